"""A small Prometheus text-format registry: counters, gauges and histograms with labels.

Small enough to own, so the service needs no metrics dependency, and the
exposition stays exactly the text format Prometheus scrapes (version 0.0.4).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from store.models import RegistryLoad

LabelValues = tuple[str, ...]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._lock = threading.Lock()

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()]
        return "\n".join(lines)


class Counter(Metric):
    """A counter incremented here, or (`collect_from`) read at scrape time from whoever counts."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}
        self._collect: Callable[[], dict[LabelValues, float]] | None = None

    def collect_from(self, collect: Callable[[], dict[LabelValues, float]]) -> None:
        self._collect = collect

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def samples(self) -> Iterable[str]:
        values = self._collect() if self._collect else dict(self._values)
        for key, value in sorted(values.items()):
            yield f"{self.name}{_labels(self.label_names, key)} {_number(value)}"


class Gauge(Metric):
    """A gauge set directly, or read from a callback at scrape time."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        collect: Callable[[], dict[LabelValues, float]] | None = None,
    ) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}
        self._collect = collect

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = value

    def samples(self) -> Iterable[str]:
        values = self._collect() if self._collect else dict(self._values)
        for key, value in sorted(values.items()):
            yield f"{self.name}{_labels(self.label_names, key)} {_number(value)}"


class Histogram(Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            counts = self._counts.setdefault(labels, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sums[labels] = self._sums.get(labels, 0.0) + value

    def count(self, *labels: str) -> int:
        return sum(self._counts.get(labels, []))

    def samples(self) -> Iterable[str]:
        for key, counts in sorted(self._counts.items()):
            cumulative = 0
            for bound, count in zip([*self.buckets, math.inf], counts, strict=True):
                cumulative += count
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.label_names, key, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.label_names, key)} {_number(self._sums[key])}"
            yield f"{self.name}_count{_labels(self.label_names, key)} {cumulative}"


M = TypeVar("M", bound="Metric")


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(metric.render() for metric in self.metrics) + "\n"


class ServiceMetrics:
    """The service's metrics, named once here."""

    def __init__(self) -> None:
        self.registry = Registry()
        add = self.registry.add
        self.scans = add(Counter("gpubadge_scans_total", "Scans finished, by outcome.", ["outcome"]))
        self.scan_seconds = add(Histogram("gpubadge_scan_duration_seconds", "Wall time of one scan job."))
        self.webhooks = add(
            Counter(
                "gpubadge_webhooks_total", "Webhook requests, by source and status.", ["source", "status"]
            )
        )
        self.webhook_seconds = add(
            Histogram(
                "gpubadge_webhook_duration_seconds", "Webhook handling time, to the durable 202.", ["source"]
            )
        )
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
        self.admission = add(
            Counter(
                "gpubadge_admission_reviews_total",
                "POST /k8s/admit answers, by webhook (validate, mutate) and decision (allowed, warned, denied, patched).",
                ["webhook", "decision"],
            )
        )
        self.admission_seconds = add(
            Histogram("gpubadge_admission_duration_seconds", "Admission review handling time.", ["webhook"])
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
        self.transfer_cutoffs = add(
            Counter(
                "gpubadge_registry_transfer_cutoffs_total",
                "Manifest and blob reads cut off for falling below GPUBADGE_MIN_TRANSFER_RATE, by registry host.",
                ["registry"],
            )
        )

    def count_registry_bytes(self, received_by_registry: dict[str, int]) -> None:
        """Serve the registry client's running byte counts (read at scrape time, never copied)."""
        self.registry_bytes.collect_from(
            lambda: {(host,): float(count) for host, count in list(received_by_registry.items())}
        )

    def count_transfer_cutoffs(self, cutoffs_by_registry: dict[str, int]) -> None:
        """Serve the registry client's running counts of slow transfers cut off (read at scrape time)."""
        self.transfer_cutoffs.collect_from(
            lambda: {(host,): float(count) for host, count in list(cutoffs_by_registry.items())}
        )

    def set_registry_load(self, loads: list[RegistryLoad]) -> None:
        """The store's per-registry picture, as the /metrics handler read it just now."""
        self._registry_load = loads

    def render(self) -> str:
        return self.registry.render()
