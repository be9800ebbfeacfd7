-- Version 10: finished jobs do not grow for ever, and counting them reads none of them.
-- The job runtime deletes finished jobs (done or failed) past GPUBADGE_JOB_RETENTION_SECONDS and
-- beyond the newest GPUBADGE_JOB_RETENTION_COUNT, oldest first, in batches (jobs/retention.py);
-- jobs_finished is the order it reads them in.
CREATE INDEX jobs_finished ON jobs (updated_at) WHERE state IN ('done', 'failed');
-- How many jobs are done and how many failed, kept as jobs change state, so /healthz, /metrics and
-- the jobs page count them without a scan (queued and running ones are counted from their indexes).
-- A state's count is the sum of its rows' deltas. Many processes write here at once, so each change
-- is a row of its own (no row is updated by two transactions, so none waits for another on it);
-- the sweeper folds them into one row per state (`PostgresStore.compact_job_tallies`).
CREATE TABLE job_tallies (
    state TEXT NOT NULL,
    delta BIGINT NOT NULL
);
INSERT INTO job_tallies (state, delta)
    SELECT state, count(*) FROM jobs WHERE state IN ('done', 'failed') GROUP BY state;
CREATE FUNCTION jobs_tally_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.state IN ('done', 'failed') THEN
        INSERT INTO job_tallies (state, delta) VALUES (OLD.state, -1);
    END IF;
    IF NEW.state IN ('done', 'failed') THEN
        INSERT INTO job_tallies (state, delta) VALUES (NEW.state, 1);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER jobs_tally_insert AFTER INSERT ON jobs FOR EACH ROW
    WHEN (NEW.state IN ('done', 'failed')) EXECUTE FUNCTION jobs_tally_row();
CREATE TRIGGER jobs_tally_update AFTER UPDATE OF state ON jobs FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND (OLD.state IN ('done', 'failed') OR NEW.state IN ('done', 'failed')))
    EXECUTE FUNCTION jobs_tally_row();
-- A batch of deletions adds one row per state, not one per job.
CREATE FUNCTION jobs_tally_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_tallies (state, delta)
        SELECT state, -count(*) FROM gone WHERE state IN ('done', 'failed') GROUP BY state;
    RETURN NULL;
END
$$;
CREATE TRIGGER jobs_tally_delete AFTER DELETE ON jobs REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION jobs_tally_deleted();
