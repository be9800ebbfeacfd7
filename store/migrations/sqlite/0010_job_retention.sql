-- Version 10: finished jobs do not grow for ever, and counting them reads none of them.
-- The job runtime deletes finished jobs (done or failed) past GPUBADGE_JOB_RETENTION_SECONDS and
-- beyond the newest GPUBADGE_JOB_RETENTION_COUNT, oldest first, in batches (jobs/retention.py);
-- jobs_finished is the order it reads them in.
CREATE INDEX jobs_finished ON jobs(updated_at) WHERE state IN ('done', 'failed');
-- How many jobs are done and how many failed, kept as jobs change state, so /healthz, /metrics and
-- the jobs page count them without a scan (queued and running ones are counted from their indexes).
-- A state's count is the sum of its rows' deltas; SQLite has one writer, so it keeps one row per
-- state, updated in place by the triggers below (PostgreSQL appends a row per change instead).
CREATE TABLE job_tallies (
    state TEXT PRIMARY KEY,
    delta INTEGER NOT NULL
);
INSERT INTO job_tallies (state, delta)
    SELECT state, count(*) FROM jobs WHERE state IN ('done', 'failed') GROUP BY state;
CREATE TRIGGER jobs_tally_insert AFTER INSERT ON jobs WHEN new.state IN ('done', 'failed')
BEGIN
    INSERT INTO job_tallies (state, delta) VALUES (new.state, 1)
        ON CONFLICT (state) DO UPDATE SET delta = delta + 1;
END;
CREATE TRIGGER jobs_tally_delete AFTER DELETE ON jobs WHEN old.state IN ('done', 'failed')
BEGIN
    INSERT INTO job_tallies (state, delta) VALUES (old.state, -1)
        ON CONFLICT (state) DO UPDATE SET delta = delta - 1;
END;
CREATE TRIGGER jobs_tally_update AFTER UPDATE OF state ON jobs
    WHEN old.state IS NOT new.state AND (old.state IN ('done', 'failed') OR new.state IN ('done', 'failed'))
BEGIN
    INSERT INTO job_tallies (state, delta) SELECT new.state, 1 WHERE new.state IN ('done', 'failed')
        ON CONFLICT (state) DO UPDATE SET delta = delta + 1;
    INSERT INTO job_tallies (state, delta) SELECT old.state, -1 WHERE old.state IN ('done', 'failed')
        ON CONFLICT (state) DO UPDATE SET delta = delta - 1;
END;
