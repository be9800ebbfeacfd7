-- The scans page and GET /api/scans list the newest jobs. PostgreSQL has had this index since 0001; without it
-- SQLite read and sorted every job retention keeps (100,000 by default: 104 ms a page).
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at);
