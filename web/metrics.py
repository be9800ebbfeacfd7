"""The service's Prometheus metrics: the job runtime's (`jobs.metrics.JobMetrics`) and the HTTP
side's (webhook deliveries, admission reviews), in one registry per service."""

from __future__ import annotations

import gc
from collections.abc import Callable

from jobs.metrics import Counter, Gauge, Histogram, JobMetrics
from web.hooks import SOURCES

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServiceMetrics(JobMetrics):
    """The runtime's metrics plus those only HTTP handlers count, named once here."""

    def __init__(self) -> None:
        super().__init__()
        add = self.add
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
        self.admission = add(
            Counter(
                "gpubadge_admission_reviews_total",
                "POST /k8s/admit answers, by webhook (validate, mutate) and decision (allowed, warned, denied, patched).",
                ["webhook", "decision"],
            )
        )
        self.gc_frozen = add(
            Gauge(
                "gpubadge_gc_frozen_objects",
                "Objects `serve` froze out of the cyclic collector's reach (jobs/garbage_collection.py):"
                " what it built before serving, and what survived each step of memory growth.",
                collect=lambda: {(): float(gc.get_freeze_count())},
            )
        )
        self.intake_unmoved_source: Callable[[], int] = lambda: 0
        self.intake_unmoved = add(
            Gauge(
                "gpubadge_intake_journal_unmoved_jobs",
                "Jobs this process's webhook intake journaled that are not in the store's queue yet: a few while"
                " the mover keeps up, growing while the store is out of reach (store/intake_mover.py).",
                collect=lambda: {(): float(self.intake_unmoved_source())},
            )
        )
        self.loop_lag = add(
            Histogram(
                "gpubadge_event_loop_lag_seconds",
                "How late `serve`'s event loop ran a timer due every 20 ms: how long anything due waited.",
                buckets=LAG_BUCKETS,
            )
        )
        self.admission_seconds = add(
            Histogram("gpubadge_admission_duration_seconds", "Admission review handling time.", ["webhook"])
        )

    def count_webhook(self, source: str, status: int, seconds: float | None) -> None:
        """One delivery's answer, on either port: counted by source (`unknown` for a source no sender
        is named) and status; its handling time where it was handled (None: refused from its head)."""
        label = source if source in SOURCES else "unknown"
        self.webhooks.inc(label, str(status))
        if seconds is not None:
            self.webhook_seconds.observe(seconds, label)
