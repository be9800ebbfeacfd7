-- Version 7: each stamp names the process that wrote it. An API replica follows the stamps the
-- others wrote (their agents' heartbeats); without the writer's name it read back its own as well,
-- half the rows with two replicas, converted and compared for nothing. Not indexed: a stamp stays
-- a HOT update.
ALTER TABLE server_heartbeats ADD COLUMN stamped_by TEXT NOT NULL DEFAULT '';
