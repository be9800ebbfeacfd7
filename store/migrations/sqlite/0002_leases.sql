-- Job leases (a crashed worker's jobs return to the queue when its lease passes) and the
-- row /healthz writes to prove the database takes writes.
ALTER TABLE jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE jobs ADD COLUMN lease_expires TEXT;
CREATE INDEX IF NOT EXISTS jobs_lease ON jobs(state, lease_expires);
CREATE INDEX IF NOT EXISTS jobs_progress ON jobs(updated_at) WHERE attempts > 0;
CREATE TABLE IF NOT EXISTS health (id INTEGER PRIMARY KEY CHECK (id = 1), checked_at TEXT NOT NULL);
