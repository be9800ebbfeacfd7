-- Retention of deployments that ended (`GPUBADGE_DEPLOYMENT_RETENTION_SECONDS`, `_COUNT`): counted, found
-- past the newest kept and deleted oldest first along their last update, never reading a live deployment.
-- The condition is `queries.fleet._ENDED`, word for word.
CREATE INDEX deployments_ended ON deployments (updated_at) WHERE state IN ('exited', 'failed', 'stopped');
