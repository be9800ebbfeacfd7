"""The job runtime's Prometheus metrics, kept by `prometheus_client` in one registry per service.

`JobMetrics` names every metric of the runtime once (scans, the queue, registries, attachments,
workers); `web.metrics.ServiceMetrics` adds the HTTP side's to the same registry. Counters, gauges and histograms take their label values
positionally (`inc(*labels)`, `set(value, *labels)`, `observe(value, *labels)`); a counter or gauge
may instead be read from a callback at scrape time (`collect_from`, `collect=`), so counts kept
elsewhere (the registry client's bytes) are never copied. The registry also carries the process,
platform and garbage-collector collectors; `render` writes the text format Prometheus scrapes.
`_created` series are off (`disable_created_metrics`): the exposition keeps its metric names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from store.models import RegistryLoad

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client

LabelValues = tuple[str, ...]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _filled(family: CounterMetricFamily | GaugeMetricFamily, values: dict[LabelValues, float]) -> Metric:
    """`family` with one sample per label values read at scrape time, in label order."""
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _by_label(counts: dict[str, int]) -> Callable[[], dict[LabelValues, float]]:
    """A scrape-time reader of counts kept elsewhere by one label (a snapshot, never a copy kept here)."""
    return lambda: {(label,): float(count) for label, count in list(counts.items())}


Forward = Callable[[str, str, LabelValues, float], None]
"""Told of every change a metric takes: (metric name, "inc" | "set" | "observe", labels, value)."""


class Counter(Collector):
    """A counter incremented here, or (`collect_from`) read at scrape time from whoever counts; other
    processes' counts of the same thing (`add_source`) are added at scrape time."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._counter = prometheus_client.Counter(name, help_text, self.label_names, registry=None)
        self._collect: Callable[[], dict[LabelValues, float]] | None = None
        self._sources: list[Callable[[], dict[LabelValues, float]]] = []
        self.forward: Forward | None = None

    def collect_from(self, collect: Callable[[], dict[LabelValues, float]]) -> None:
        self._collect = collect

    def add_source(self, source: Callable[[], dict[LabelValues, float]]) -> None:
        """Counts kept elsewhere (another process's), added to this counter's at scrape time."""
        self._sources.append(source)

    def read(self) -> dict[LabelValues, float]:
        """This process's own counts of a `collect_from` counter, by label values."""
        return self._collect() if self._collect is not None else {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        (self._counter.labels(*labels) if labels else self._counter).inc(amount)
        if self.forward is not None:
            self.forward(self.name, "inc", labels, amount)

    def collect(self) -> Iterable[Metric]:
        if self._collect is None and not self._sources:
            return self._counter.collect()
        totals = dict(self._collect()) if self._collect is not None else {}
        for source in self._sources:
            for key, value in source().items():
                totals[key] = totals.get(key, 0.0) + value
        family = CounterMetricFamily(self.name, self.help, labels=self.label_names)
        return [_filled(family, totals)]


class Gauge(Collector):
    """A gauge set directly, or read from a callback at scrape time."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        collect: Callable[[], dict[LabelValues, float]] | None = None,
    ) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._gauge = prometheus_client.Gauge(name, help_text, self.label_names, registry=None)
        self._collect = collect
        self.forward: Forward | None = None

    def set(self, value: float, *labels: str) -> None:
        (self._gauge.labels(*labels) if labels else self._gauge).set(value)
        if self.forward is not None:
            self.forward(self.name, "set", labels, value)

    def collect(self) -> Iterable[Metric]:
        if self._collect is None:
            return self._gauge.collect()
        family = GaugeMetricFamily(self.name, self.help, labels=self.label_names)
        return [_filled(family, self._collect())]


class Histogram(Collector):
    """A histogram of seconds, by the labels given (`LATENCY_BUCKETS` unless told)."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        self.name, self.label_names = name, tuple(labels)
        self._histogram = prometheus_client.Histogram(
            name, help_text, self.label_names, registry=None, buckets=tuple(buckets)
        )
        self.forward: Forward | None = None

    def observe(self, value: float, *labels: str) -> None:
        (self._histogram.labels(*labels) if labels else self._histogram).observe(value)
        if self.forward is not None:
            self.forward(self.name, "observe", labels, value)

    def collect(self) -> Iterable[Metric]:
        return self._histogram.collect()


M = TypeVar("M", bound=Collector)
OwnMetric = Counter | Gauge | Histogram


class JobMetrics:
    """The runtime's metrics, named once here (`web.metrics.ServiceMetrics` adds the HTTP side's)."""

    def __init__(self) -> None:
        # One registry per service: tests build many services in one process, each counting its own.
        self.registry = CollectorRegistry()
        self.by_name: dict[str, OwnMetric] = {}
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        add = self.add
        self.scans = add(Counter("gpubadge_scans_total", "Scans finished, by outcome.", ["outcome"]))
        self.scan_seconds = add(Histogram("gpubadge_scan_duration_seconds", "Wall time of one scan job."))
        self.registry_errors = add(
            Counter("gpubadge_registry_errors_total", "Registry requests that failed, by host.", ["registry"])
        )
        self.registry_bytes = add(
            Counter(
                "gpubadge_registry_received_bytes_total",
                "Bytes registries sent to the scanner (manifests, configs, layers; partial reads"
                " included), by registry or mirror host.",
                ["registry"],
            )
        )
        self.rate_limit = add(
            Gauge("gpubadge_registry_ratelimit_remaining", "Last ratelimit-remaining seen.", ["registry"])
        )
        self.referrer_attach = add(
            Counter(
                "gpubadge_referrer_attach_total",
                "Report attachments as OCI referrers, by result (attached, retry, failed, dropped).",
                ["result"],
            )
        )
        self.nfd_attach = add(
            Counter(
                "gpubadge_nfd_attach_total",
                "NFD image-compatibility artifacts, by result (attached, reused, deferred to another tool's, retry,"
                " failed).",
                ["result"],
            )
        )
        # What the image page keeps of NFD artifacts it read (parsed, bounded; at most nfd_cache_bytes).
        self.nfd_cache_source: Callable[[], int] = lambda: 0
        self.nfd_cache = add(
            Gauge(
                "gpubadge_nfd_cache_bytes",
                "Memory held by the NFD artifacts kept for the image page (parsed; capped by nfd_cache_bytes).",
                collect=lambda: {(): float(self.nfd_cache_source())},
            )
        )
        # Gauges read from the database are set by the /metrics handler just before it renders,
        # so rendering itself never runs SQL.
        self.queue = add(Gauge("gpubadge_queue_jobs", "Scan jobs by state.", ["state"]))
        self.oldest_queued = add(
            Gauge(
                "gpubadge_queue_oldest_ready_seconds",
                "How long the oldest ready job has waited to be claimed (0 when none waits).",
            )
        )
        self.worker_restarts = add(
            Counter(
                "gpubadge_worker_restarts_total",
                "Faults the scan workers recovered from (store or scanner errors), after a backoff.",
            )
        )
        self.worker_processes = add(
            Gauge(
                "gpubadge_worker_processes",
                "Worker processes `serve` runs its scans in (GPUBADGE_WORKER_PROCESSES), running now.",
            )
        )
        self.worker_process_restarts = add(
            Counter(
                "gpubadge_worker_process_restarts_total",
                "Worker processes that exited or fell silent and were started again.",
            )
        )
        self.lease_expiries = add(
            Counter(
                "gpubadge_lease_expiries_total",
                "Running jobs whose worker stopped renewing the lease, by what happened next.",
                ["outcome"],
            )
        )
        self.preemptions = add(
            Counter(
                "gpubadge_scan_preemptions_total",
                "Scans put back in the queue to give their worker to a registry that waited with none in"
                " flight (GPUBADGE_PREEMPT_AFTER), by the registry of the scan put back.",
                ["registry"],
            )
        )
        # Per-registry load, read from the store by the /metrics handler (every worker process's
        # scans, not only this one's); a registry with nothing queued, running or gated drops out.
        self._registry_load: list[RegistryLoad] = []
        self.registry_in_flight = add(
            Gauge(
                "gpubadge_registry_scans_in_flight",
                "Scans running against each registry now, every worker process counted.",
                ["registry"],
                collect=lambda: {(load.registry,): float(load.running) for load in self._registry_load},
            )
        )
        self.registry_ready = add(
            Gauge(
                "gpubadge_registry_ready_jobs",
                "Scan jobs ready to run, by registry (a registry at its cap or cooling down keeps them waiting).",
                ["registry"],
                collect=lambda: {(load.registry,): float(load.ready) for load in self._registry_load},
            )
        )
        self.registry_cool_down = add(
            Gauge(
                "gpubadge_registry_cooldown_seconds",
                "Seconds until a registry that answered 429/503 with Retry-After is asked again (0: open).",
                ["registry"],
                collect=lambda: {(load.registry,): load.cool_down_seconds for load in self._registry_load},
            )
        )
        self.jobs_deleted = add(
            Counter(
                "gpubadge_jobs_deleted_total",
                "Finished scan jobs deleted by retention (GPUBADGE_JOB_RETENTION_SECONDS, _COUNT) in this process.",
            )
        )
        self.deployments_deleted = add(
            Counter(
                "gpubadge_deployments_deleted_total",
                "Ended deployments deleted by retention (GPUBADGE_DEPLOYMENT_RETENTION_SECONDS, _COUNT) in this"
                " process.",
            )
        )
        self.transfer_cutoffs = add(
            Counter(
                "gpubadge_registry_transfer_cutoffs_total",
                "Manifest and blob reads cut off for falling below GPUBADGE_MIN_TRANSFER_RATE, by registry host.",
                ["registry"],
            )
        )
        self.inline_analyses = add(
            Counter(
                "gpubadge_inline_analyses_total",
                "Images whose layers were small enough to analyse on the scanning process's loop"
                " (GPUBADGE_INLINE_ANALYSIS_BYTES), by outcome: finished there, or handed_over to an analysis"
                " process at the inline budget.",
                ["outcome"],
            )
        )

    def count_inline_analyses(self, by_outcome: dict[str, int]) -> None:
        """Serve the layer reader's running counts of images analysed inline (read at scrape time)."""
        self.inline_analyses.collect_from(_by_label(by_outcome))

    def count_registry_bytes(self, received_by_registry: dict[str, int]) -> None:
        """Serve the registry client's running byte counts (read at scrape time, never copied)."""
        self.registry_bytes.collect_from(_by_label(received_by_registry))

    def count_transfer_cutoffs(self, cutoffs_by_registry: dict[str, int]) -> None:
        """Serve the registry client's running counts of slow transfers cut off (read at scrape time)."""
        self.transfer_cutoffs.collect_from(_by_label(cutoffs_by_registry))

    def set_registry_load(self, loads: list[RegistryLoad]) -> None:
        """The store's per-registry picture, as the /metrics handler read it just now."""
        self._registry_load = loads

    def add(self, metric: M) -> M:
        """Register `metric` in this service's registry; returns it."""
        self.registry.register(metric)
        if isinstance(metric, Counter | Gauge | Histogram):
            self.by_name[metric.name] = metric
        return metric

    # -- several processes, one service: a worker process's metrics reach `serve`'s /metrics

    def forward_to(self, forward: Forward) -> None:
        """In a worker process `serve` supervises: tell `forward` of every metric change made here."""
        for metric in self.by_name.values():
            metric.forward = forward

    def apply(self, name: str, change: str, labels: Sequence[str], value: float) -> None:
        """In `serve`: a change a worker process made to one of its metrics, made here too (it counts
        in this process's /metrics as if this process had scanned). Unknown names are ignored."""
        metric = self.by_name.get(name)
        if metric is None:
            return
        forward, metric.forward = metric.forward, None  # applied here, never sent on
        try:
            if isinstance(metric, Counter) and change == "inc":
                metric.inc(*labels, amount=value)
            elif isinstance(metric, Histogram) and change == "observe":
                metric.observe(value, *labels)
            elif isinstance(metric, Gauge) and change == "set":
                metric.set(value, *labels)
        finally:
            metric.forward = forward

    def process_counts(self) -> dict[str, dict[LabelValues, float]]:
        """Counts this process keeps outside the metrics (read at scrape time), by metric name: what a
        worker process sends `serve` now and then, which adds them to its own (`add_source`)."""
        return {
            self.registry_bytes.name: self.registry_bytes.read(),
            self.transfer_cutoffs.name: self.transfer_cutoffs.read(),
            self.inline_analyses.name: self.inline_analyses.read(),
        }

    def render(self) -> str:
        """The text exposition (format 0.0.4) of every metric, the process and platform ones too."""
        return generate_latest(self.registry).decode()
