-- Version 8: a GPU UUID belongs to the server that first reported it, until an operator releases it
-- or the fleet-wide agent token reports it on another server. Before, a claim lasted only while its
-- server was live: any agent's token could take a silent server's GPUs (their UUIDs are listed by
-- GET /api/servers), and from then on the owner got 409 and its deployments went to the claimer.
-- The servers registered before this version keep the GPUs they report; where two report one UUID,
-- the one heard from last keeps it.
CREATE TABLE gpu_owners (
    gpu_uuid TEXT PRIMARY KEY,
    server TEXT NOT NULL,
    claimed_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX gpu_owners_server ON gpu_owners (server);
INSERT INTO gpu_owners (gpu_uuid, server, claimed_at)
SELECT DISTINCT ON (g ->> 'uuid') g ->> 'uuid', s.name, h.last_heartbeat
FROM servers s JOIN server_heartbeats h ON h.name = s.name,
    jsonb_array_elements(coalesce(s.inventory::jsonb -> 'gpus', '[]'::jsonb)) g
WHERE g ->> 'uuid' IS NOT NULL
ORDER BY g ->> 'uuid', h.last_heartbeat DESC;
-- A GPU's MIG devices are named by reservations too: each belongs to the server that reports it.
INSERT INTO gpu_owners (gpu_uuid, server, claimed_at)
SELECT DISTINCT ON (m ->> 'uuid') m ->> 'uuid', s.name, h.last_heartbeat
FROM servers s JOIN server_heartbeats h ON h.name = s.name,
    jsonb_array_elements(coalesce(s.inventory::jsonb -> 'gpus', '[]'::jsonb)) g,
    jsonb_array_elements(coalesce(g -> 'mig_devices', '[]'::jsonb)) m
WHERE m ->> 'uuid' IS NOT NULL
ORDER BY m ->> 'uuid', h.last_heartbeat DESC
ON CONFLICT (gpu_uuid) DO NOTHING;
