-- The image list filtered by registry or by GPU, newest first. SQLite keeps no statistics: it took the
-- registry's rows from (registry, repository, ...) and sorted them all, and counted GPU images by reading
-- every report; at 100,000 reports a page took 179 ms (registry) and 82 ms (GPU). In list order, a page
-- stops at its last row and the count reads the index alone. PostgreSQL has had the GPU one since 0001.
CREATE INDEX reports_gpu_order ON reports (gpu_required, scanned_at DESC, digest);
CREATE INDEX reports_registry_order ON reports (registry, scanned_at DESC, digest);
