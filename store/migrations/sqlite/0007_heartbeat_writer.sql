-- Version 7: each stamp names the process that wrote it (see PostgreSQL's 0007): a process
-- following the others' stamps skips its own.
ALTER TABLE server_heartbeats ADD COLUMN stamped_by TEXT NOT NULL DEFAULT '';
