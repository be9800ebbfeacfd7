-- The image list filtered by registry, newest first: from (registry, repository, ...) a registry's rows were
-- sorted whole for each page, a cost that grows with the registry. In list order, a page stops at its last
-- row. (The GPU filter has had its index, reports_gpu_order, since 0001; SQLite gets it in this version.)
CREATE INDEX reports_registry_order ON reports (registry, scanned_at DESC, digest);
