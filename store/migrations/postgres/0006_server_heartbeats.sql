-- Version 6: a server's last heartbeat moves to a narrow table of its own. The heartbeat writer
-- stamps thousands of servers every few seconds; in `servers` each stamp rewrote the whole row,
-- inventory JSON (about 1.4 KB with 8 GPUs) included: with 10,000 agents the table bloated to about
-- four times its live size, and the other API replicas' read of the stamps scanned all of it.
-- Here a stamp rewrites a name and a time, mostly in place (HOT: the time is not indexed).
CREATE TABLE server_heartbeats (
    name TEXT PRIMARY KEY,
    last_heartbeat TIMESTAMPTZ NOT NULL
);
INSERT INTO server_heartbeats (name, last_heartbeat) SELECT name, last_heartbeat FROM servers;
ALTER TABLE servers DROP COLUMN last_heartbeat;
