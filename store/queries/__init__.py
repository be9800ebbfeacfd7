"""The store's queries written once, run on SQLite and PostgreSQL alike.

Each is a function of a `store.dialect.Db`, marked as a read or a write; run one with
`await AsyncStore.run(query, ...)` (off the event loop, one thread hop), or synchronously with
`AsyncStore.blocking.run` (on a thread of the caller's own) or `StoreBackend.run` (commands and
tools without an event loop). What really differs per engine (claims, leases, enqueueing,
outcomes, registry gates, health, upgrades, GPU reservations, LISTEN) stays in `store.sqlite`
and `store.postgres`.
"""

from store.queries.fleet import (
    actionable_deployments,
    actionable_servers,
    deployment,
    deployments,
    heartbeat,
    heartbeats,
    reserved_gpus,
    server_inventory,
    server_records,
    servers,
    stamp_heartbeats,
    update_deployment,
    upsert_server,
)
from store.queries.jobs import (
    job,
    jobs,
    latest_job_for,
    lease_owners,
    next_job_due,
    pending_job_for,
    queue_depth,
    queued_jobs,
    scan_in_flight,
)
from store.queries.reports import (
    TagSeen,
    has_report,
    list_images,
    platform_report,
    reference_report,
    registries,
    report,
    report_page,
    save_report,
    save_reports,
    save_scan_results,
    stored,
    stored_digests,
    stored_many,
)
from store.queries.tags import (
    is_gone,
    layer_evidence,
    mark_gone,
    record_tag,
    record_tags,
    resolve_tag,
    resolve_tags,
    save_layer_evidence,
    tag_history,
    tags_for_digest,
)

# The writes that change what a reference stands for (its tag, its report): run through
# `AsyncStore.run`, each makes the process forget the references it looked up (`store.report_lookups`).
REPORT_WRITES = frozenset({record_tag, record_tags, mark_gone, save_report, save_reports, save_scan_results})

__all__ = [
    "REPORT_WRITES",
    "TagSeen",
    "actionable_deployments",
    "actionable_servers",
    "deployment",
    "deployments",
    "has_report",
    "heartbeat",
    "heartbeats",
    "is_gone",
    "job",
    "jobs",
    "latest_job_for",
    "layer_evidence",
    "lease_owners",
    "list_images",
    "mark_gone",
    "next_job_due",
    "pending_job_for",
    "platform_report",
    "queue_depth",
    "queued_jobs",
    "record_tag",
    "record_tags",
    "reference_report",
    "registries",
    "report",
    "report_page",
    "reserved_gpus",
    "resolve_tag",
    "resolve_tags",
    "save_layer_evidence",
    "save_report",
    "save_reports",
    "save_scan_results",
    "scan_in_flight",
    "server_inventory",
    "server_records",
    "servers",
    "stamp_heartbeats",
    "stored",
    "stored_digests",
    "stored_many",
    "tag_history",
    "tags_for_digest",
    "update_deployment",
    "upsert_server",
]
