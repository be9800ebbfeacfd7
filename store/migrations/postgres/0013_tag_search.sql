-- Version 13: the image search's other names, found through an index. `list_images`' `q` also matches
-- the names tags give a digest (registry, repository, tag); a trigram index on that text, spelt as the
-- search spells it, over the tags still present, as 0003's is over the reports. Without pg_trgm the
-- search scans the tags, as it scans the reports.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm') THEN
        EXECUTE 'CREATE INDEX IF NOT EXISTS tags_search ON tags USING gin ('
            || '(registry || chr(31) || repository || chr(31) || tag) gin_trgm_ops)'
            || ' WHERE gone_at IS NULL';
    END IF;
END
$$;
