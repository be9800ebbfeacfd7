-- Version 12: the webhook intake may commit to a local journal (GPUBADGE_INTAKE_JOURNAL,
-- store/intake_journal.py) that a mover carries into `jobs` (store/intake_mover.py), as SQLite's
-- intake always does. How far each journal was moved (a journal names itself with a random id) is
-- written in the move's own transaction, so a crash anywhere moves each job exactly once.
CREATE TABLE intake_moved (
    journal TEXT PRIMARY KEY,
    seq BIGINT NOT NULL
);
-- A journaled job that found another active job for its reference when it moved was coalesced into it:
-- the id its sender was given names that job (queries.jobs.job reads through this table).
CREATE TABLE job_aliases (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE
);
CREATE INDEX job_aliases_job ON job_aliases (job_id);
