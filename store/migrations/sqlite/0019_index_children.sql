-- Which indexes list a platform manifest (`index_of`: its page, a lookup by its digest, each such job on the
-- scans page). `index_of` looked for the child's digest in the text of its repository's reports, then, for a
-- child no report of its own repository lists (named through another repository, or its index deleted), in
-- the text of every report: each such lookup read the whole table (seconds at 1,000,000 reports). Now
-- `save_reports` writes a row per (child, index), and the lookup reads the child's rows.
-- Filled from the stored index reports: only an index lists platforms with digests of their own.
CREATE TABLE index_children (
    child TEXT NOT NULL,
    parent TEXT NOT NULL,
    PRIMARY KEY (child, parent)
) WITHOUT ROWID;
INSERT OR IGNORE INTO index_children (child, parent)
SELECT json_extract(p.value, '$.digest'), r.digest
FROM reports r, json_each(r.report, '$.platforms') p
WHERE (r.media_type IS NULL OR r.media_type NOT IN (
        'application/vnd.oci.image.manifest.v1+json', 'application/vnd.docker.distribution.manifest.v2+json'))
    AND json_extract(p.value, '$.digest') IS NOT NULL
    AND json_extract(p.value, '$.digest') <> r.digest;
