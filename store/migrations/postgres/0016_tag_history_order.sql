-- An image page shows its repository's newest tag events: through (registry, repository, tag, id) that read
-- and sorted every event of the repository (122 ms for 50,000 on SQLite: a CI repository tags each commit).
-- In event order, the page's LIMIT stops the walk. The order is kept as -id, which no other index gives:
-- by id itself, PostgreSQL's planner may walk the primary key backwards instead, reading every newer event
-- of other repositories until it meets this one's (20,000 rows for a repository gone quiet).
CREATE INDEX tags_history ON tags (registry, repository, (-id));
