-- The schema as it stood before versioning: IF NOT EXISTS, so files made then migrate cleanly.
CREATE TABLE IF NOT EXISTS reports (
    digest TEXT PRIMARY KEY,
    registry TEXT NOT NULL,
    repository TEXT NOT NULL,
    reference TEXT NOT NULL,
    media_type TEXT,
    gpu_required INTEGER NOT NULL,
    cuda_versions TEXT NOT NULL,
    libc_flavours TEXT NOT NULL,
    platforms TEXT NOT NULL,
    distro TEXT,
    scanned_at TEXT NOT NULL,
    report TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS reports_repo ON reports(registry, repository);
CREATE INDEX IF NOT EXISTS reports_scanned ON reports(scanned_at);
-- matches list_images' ORDER BY exactly, so deep pages skip rows in the index without a sort
CREATE INDEX IF NOT EXISTS reports_order ON reports(scanned_at DESC, digest);
CREATE TABLE IF NOT EXISTS platform_reports (
    digest TEXT PRIMARY KEY,
    report TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tags (
    id INTEGER PRIMARY KEY,
    registry TEXT NOT NULL,
    repository TEXT NOT NULL,
    tag TEXT NOT NULL,
    digest TEXT NOT NULL,
    first_seen TEXT NOT NULL,
    last_seen TEXT NOT NULL,
    gone_at TEXT
);
CREATE INDEX IF NOT EXISTS tags_lookup ON tags(registry, repository, tag, id);
CREATE INDEX IF NOT EXISTS tags_digest ON tags(digest);
CREATE TABLE IF NOT EXISTS gone_digests (
    registry TEXT NOT NULL,
    repository TEXT NOT NULL,
    digest TEXT NOT NULL,
    gone_at TEXT NOT NULL,
    PRIMARY KEY (registry, repository, digest)
);
CREATE TABLE IF NOT EXISTS layers (
    digest TEXT PRIMARY KEY,
    evidence TEXT NOT NULL,
    stored_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    reference TEXT NOT NULL,
    registry TEXT NOT NULL,
    dedupe_key TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL DEFAULT 5,
    not_before TEXT NOT NULL,
    error TEXT,
    result_digest TEXT,
    source TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs(state, not_before);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_active_key ON jobs(dedupe_key) WHERE state IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS jobs_reference ON jobs(reference, created_at);
CREATE TABLE IF NOT EXISTS servers (
    name TEXT PRIMARY KEY,
    inventory TEXT NOT NULL,
    registered_at TEXT NOT NULL,
    last_heartbeat TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS deployments (
    id TEXT PRIMARY KEY,
    server TEXT NOT NULL,
    record TEXT NOT NULL,
    state TEXT NOT NULL,
    desired TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS deployments_server ON deployments(server, state);
CREATE TABLE IF NOT EXISTS reservations (
    gpu_uuid TEXT PRIMARY KEY,
    server TEXT NOT NULL,
    deployment_id TEXT NOT NULL
);
