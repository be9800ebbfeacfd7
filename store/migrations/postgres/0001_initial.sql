-- The schema SQLite's migration 1 creates, in PostgreSQL's types: timestamps are timestamptz (the
-- database's clock orders jobs and leases for every replica), the per-image lists are text[].
CREATE TABLE reports (
    digest TEXT PRIMARY KEY,
    registry TEXT NOT NULL,
    repository TEXT NOT NULL,
    reference TEXT NOT NULL,
    media_type TEXT,
    gpu_required BOOLEAN NOT NULL,
    cuda_versions TEXT[] NOT NULL,
    libc_flavours TEXT[] NOT NULL,
    platforms TEXT[] NOT NULL,
    distro TEXT,
    scanned_at TIMESTAMPTZ NOT NULL,
    report TEXT NOT NULL
);
CREATE INDEX reports_repo ON reports (registry, repository);
-- list_images' ORDER BY exactly: a page is an index range scan, however many reports there are
CREATE INDEX reports_order ON reports (scanned_at DESC, digest);
CREATE INDEX reports_gpu_order ON reports (gpu_required, scanned_at DESC, digest);
CREATE INDEX reports_libc ON reports USING gin (libc_flavours);
CREATE INDEX reports_cuda ON reports USING gin (cuda_versions);
CREATE TABLE platform_reports (
    digest TEXT PRIMARY KEY,
    report TEXT NOT NULL
);
CREATE TABLE tags (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    registry TEXT NOT NULL,
    repository TEXT NOT NULL,
    tag TEXT NOT NULL,
    digest TEXT NOT NULL,
    first_seen TIMESTAMPTZ NOT NULL,
    last_seen TIMESTAMPTZ NOT NULL,
    gone_at TIMESTAMPTZ
);
CREATE INDEX tags_lookup ON tags (registry, repository, tag, id);
CREATE INDEX tags_digest ON tags (digest);
CREATE TABLE gone_digests (
    registry TEXT NOT NULL,
    repository TEXT NOT NULL,
    digest TEXT NOT NULL,
    gone_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (registry, repository, digest)
);
CREATE TABLE layers (
    digest TEXT PRIMARY KEY,
    evidence TEXT NOT NULL,
    stored_at TIMESTAMPTZ NOT NULL
);
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    reference TEXT NOT NULL,
    registry TEXT NOT NULL,
    dedupe_key TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed')),
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL DEFAULT 5,
    not_before TIMESTAMPTZ NOT NULL,
    error TEXT,
    result_digest TEXT,
    source TEXT,
    created_at TIMESTAMPTZ NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL
);
-- claims scan only queued rows, in claim order
CREATE INDEX jobs_ready ON jobs (not_before, created_at) WHERE state = 'queued';
-- one active job per reference across every API replica: enqueue's ON CONFLICT target
CREATE UNIQUE INDEX jobs_active_key ON jobs (dedupe_key) WHERE state IN ('queued', 'running');
CREATE INDEX jobs_reference ON jobs (dedupe_key, created_at);
CREATE INDEX jobs_created ON jobs (created_at);
CREATE INDEX jobs_state ON jobs (state);
CREATE TABLE servers (
    name TEXT PRIMARY KEY,
    inventory TEXT NOT NULL,
    registered_at TIMESTAMPTZ NOT NULL,
    last_heartbeat TIMESTAMPTZ NOT NULL
);
CREATE TABLE deployments (
    id TEXT PRIMARY KEY,
    server TEXT NOT NULL,
    record TEXT NOT NULL,
    state TEXT NOT NULL,
    desired TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX deployments_server ON deployments (server, state);
CREATE INDEX deployments_created ON deployments (created_at);
-- the primary key is what makes double-booking a GPU impossible, whichever replica reserves it
CREATE TABLE reservations (
    gpu_uuid TEXT PRIMARY KEY,
    server TEXT NOT NULL,
    deployment_id TEXT NOT NULL
);
CREATE INDEX reservations_deployment ON reservations (deployment_id);
