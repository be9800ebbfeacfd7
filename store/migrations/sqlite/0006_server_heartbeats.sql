-- Version 6: a server's last heartbeat moves to a narrow table of its own (see PostgreSQL's 0006):
-- a batch of stamps writes a name and a time per server, not its inventory JSON again (on SQLite,
-- pages of the WAL).
CREATE TABLE server_heartbeats (
    name TEXT PRIMARY KEY,
    last_heartbeat TEXT NOT NULL
);
INSERT INTO server_heartbeats (name, last_heartbeat) SELECT name, last_heartbeat FROM servers;
ALTER TABLE servers DROP COLUMN last_heartbeat;
