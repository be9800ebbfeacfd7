-- The deployments an agent must act on (`actionable_servers`, `actionable_deployments`: a placed one to start,
-- a stopped one still running) are few, but every deployment ever made stays in the table, and these reads
-- found them by reading every deployment (of the fleet when another process changed one, of the server on
-- each agent poll that may have work). A partial index holds the actionable ones alone; its condition is
-- `queries.fleet._ACTIONABLE`, word for word, so both engines see that the reads' condition implies it.
CREATE INDEX deployments_actionable ON deployments (server, created_at)
    WHERE ((desired = 'run' AND state = 'pending') OR (desired = 'stop' AND state NOT IN ('exited', 'failed', 'stopped')));
