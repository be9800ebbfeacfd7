-- The index a platform manifest belongs to (`index_of`: its page, a lookup by its digest, each such job
-- on the scans page) is the newest report of its repository that lists it. Through (registry, repository)
-- alone that read and sorted every report of the repository: 38 ms at 20,000 reports in one repository on
-- SQLite, and a CI repository keeps a report per commit. In scan order, the walk stops at the first match.
-- The new index leads with the same columns, so what the old one served it serves (`registries`' skip scan).
DROP INDEX IF EXISTS reports_repo;
CREATE INDEX reports_repo_newest ON reports (registry, repository, scanned_at DESC);
