-- Indexes PostgreSQL has had since 0001 that SQLite lacked:
-- jobs_created: the scans page and GET /api/scans list the newest jobs; SQLite read and sorted every job
--   retention keeps (100,000 by default: 104 ms a page).
-- deployments_created: the newest deployments (GET /api/deployments), sorted from all of them.
-- reservations_deployment: a deployment that ends releases its GPUs, a delete that read every reservation
--   of the fleet inside the write transaction.
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at);
CREATE INDEX IF NOT EXISTS deployments_created ON deployments(created_at);
CREATE INDEX IF NOT EXISTS reservations_deployment ON reservations(deployment_id);
