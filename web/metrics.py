"""The service's Prometheus metrics: the job runtime's (`jobs.metrics.JobMetrics`) and the HTTP
side's (webhook deliveries, admission reviews), in one registry per service."""

from __future__ import annotations

from jobs.metrics import Counter, Histogram, JobMetrics


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
        self.admission_seconds = add(
            Histogram("gpubadge_admission_duration_seconds", "Admission review handling time.", ["webhook"])
        )
