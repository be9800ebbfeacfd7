-- Version 8: a GPU UUID belongs to the server that first reported it (see PostgreSQL's 0008), until an
-- operator releases it or the fleet-wide agent token reports it on another server. The servers
-- registered before this version keep the GPUs they report; where two report one UUID, the one heard
-- from last keeps it.
CREATE TABLE gpu_owners (
    gpu_uuid TEXT PRIMARY KEY,
    server TEXT NOT NULL,
    claimed_at TEXT NOT NULL
);
CREATE INDEX gpu_owners_server ON gpu_owners (server);
INSERT OR IGNORE INTO gpu_owners (gpu_uuid, server, claimed_at)
SELECT json_extract(g.value, '$.uuid'), s.name, h.last_heartbeat
FROM servers s JOIN server_heartbeats h ON h.name = s.name, json_each(s.inventory, '$.gpus') g
WHERE json_extract(g.value, '$.uuid') IS NOT NULL
ORDER BY h.last_heartbeat DESC;
-- A GPU's MIG devices are named by reservations too: each belongs to the server that reports it.
INSERT OR IGNORE INTO gpu_owners (gpu_uuid, server, claimed_at)
SELECT json_extract(m.value, '$.uuid'), s.name, h.last_heartbeat
FROM servers s JOIN server_heartbeats h ON h.name = s.name, json_each(s.inventory, '$.gpus') g,
    json_each(g.value, '$.mig_devices') m
WHERE json_extract(m.value, '$.uuid') IS NOT NULL
ORDER BY h.last_heartbeat DESC;
