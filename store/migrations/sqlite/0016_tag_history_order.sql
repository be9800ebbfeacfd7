-- An image page shows its repository's newest tag events: through (registry, repository, tag, id) that read
-- and sorted every event of the repository (122 ms for 50,000 on SQLite: a CI repository tags each commit).
-- In event order, the page's LIMIT stops the walk.
CREATE INDEX tags_history ON tags (registry, repository, id DESC);
