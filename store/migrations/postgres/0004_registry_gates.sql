-- Fair claims: one row per registry that was claimed from or told us to come back later.
-- last_claimed orders registries with as many jobs in flight (least recently claimed first);
-- cool_until, set from a 429/503 Retry-After, keeps every worker off that registry until then.
CREATE TABLE registry_gates (
    registry TEXT PRIMARY KEY,
    last_claimed TIMESTAMPTZ,
    cool_until TIMESTAMPTZ,
    cool_reason TEXT
);
CREATE INDEX jobs_ready_registry ON jobs (registry, not_before, created_at) WHERE state = 'queued';
