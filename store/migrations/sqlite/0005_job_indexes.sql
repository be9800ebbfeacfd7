-- The job indexes PostgreSQL has had since 0001 and 0002.
-- jobs_reference was on `reference`, which no query reads, so the latest job of a reference
-- (the image page, `GET /api/images/{ref}?wait=`) scanned the whole table. Lookups go by
-- dedupe_key, in creation order.
DROP INDEX IF EXISTS jobs_reference;
CREATE INDEX jobs_reference ON jobs(dedupe_key, created_at);
-- Leases matter only for running jobs: every lease query names state = 'running'. The full
-- (state, lease_expires) index also took a page write in every webhook's commit of a queued job.
DROP INDEX IF EXISTS jobs_lease;
CREATE INDEX jobs_lease ON jobs(lease_expires) WHERE state = 'running';
