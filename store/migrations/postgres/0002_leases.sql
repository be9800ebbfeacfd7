-- Job leases (a crashed worker's jobs return to the queue when its lease passes) and the
-- row /healthz writes to prove the database takes writes.
ALTER TABLE jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE jobs ADD COLUMN lease_expires TIMESTAMPTZ;
CREATE INDEX jobs_lease ON jobs (lease_expires) WHERE state = 'running';
CREATE INDEX jobs_running_registry ON jobs (registry) WHERE state = 'running';
CREATE INDEX jobs_progress ON jobs (updated_at) WHERE attempts > 0;
CREATE TABLE health (id INTEGER PRIMARY KEY CHECK (id = 1), checked_at TIMESTAMPTZ NOT NULL);
