-- Fair claims: one row per registry that was claimed from or told us to come back later.
-- last_claimed orders registries with as many jobs in flight (least recently claimed first);
-- cool_until, set from a 429/503 Retry-After, keeps every worker off that registry until then.
CREATE TABLE IF NOT EXISTS registry_gates (
    registry TEXT PRIMARY KEY,
    last_claimed TEXT,
    cool_until TEXT,
    cool_reason TEXT
);
CREATE INDEX IF NOT EXISTS jobs_running_registry ON jobs(registry) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_ready_registry ON jobs(registry, not_before) WHERE state = 'queued';
