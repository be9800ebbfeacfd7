-- A server's deployments, newest first (`queries.deployments(server=…)`, GET /api/deployments?server=): read
-- through (server, state), that sorted every deployment the server ever had for each page. Led by the same
-- column, the new index serves what the old one did (actionable reads have `deployments_actionable`).
DROP INDEX IF EXISTS deployments_server;
CREATE INDEX deployments_server_newest ON deployments (server, created_at);
