-- Substring search over 1M reports without reading them all: a trigram index on the text that
-- list_images' `q` filter searches. pg_trgm ships with PostgreSQL (contrib) and is a trusted
-- extension, so the database owner may create it; where it cannot be had, search still works
-- (by scanning), and this migration only says so.
DO $$
BEGIN
    BEGIN
        CREATE EXTENSION IF NOT EXISTS pg_trgm;
    EXCEPTION WHEN insufficient_privilege OR undefined_file OR feature_not_supported THEN
        RAISE NOTICE 'pg_trgm unavailable (%); image search will scan the reports table', SQLERRM;
    END;
    IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm') THEN
        EXECUTE 'CREATE INDEX IF NOT EXISTS reports_search ON reports USING gin ('
            || '(repository || chr(31) || reference || chr(31) || digest || chr(31) || coalesce(distro, ''''))'
            || ' gin_trgm_ops)';
    END IF;
END
$$;
