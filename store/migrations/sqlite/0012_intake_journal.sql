-- Version 12: webhook intake commits to a journal of its own (store/sqlite_intake.py): a second SQLite
-- file beside this one (<file>-intake) that no scan ever writes, so a delivery's answer never waits
-- for this file's writer. A mover carries the journal's jobs into `jobs` in journal order; how far it
-- got, per journal (a journal file names itself with a random id), is written in the same transaction.
CREATE TABLE intake_moved (
    journal TEXT PRIMARY KEY,
    seq INTEGER NOT NULL
);
-- A journaled job that found another active job for its reference when it moved was coalesced into it:
-- the id its sender was given names that job (queries.job reads through this table on SQLite).
CREATE TABLE job_aliases (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL
);
CREATE INDEX job_aliases_job ON job_aliases(job_id);
CREATE TRIGGER jobs_alias_delete AFTER DELETE ON jobs
BEGIN
    DELETE FROM job_aliases WHERE job_id = old.id;
END;
