-- t3 core schema: the event log, command receipts, the effect outbox and the
-- projections of threads and runs. Every projection row carries the full entity
-- as payload_json (the same JSON the last event about it carried) plus the
-- columns reads filter or sort on.

CREATE TABLE IF NOT EXISTS events (
    sequence        INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id        TEXT    NOT NULL UNIQUE,
    thread_id       TEXT    NOT NULL,
    stream_version  INTEGER NOT NULL,
    command_id      TEXT,
    type            TEXT    NOT NULL,
    occurred_at     TEXT    NOT NULL,
    payload_json    TEXT    NOT NULL,
    UNIQUE (thread_id, stream_version)
);
CREATE INDEX IF NOT EXISTS events_by_command ON events (command_id);
CREATE INDEX IF NOT EXISTS events_by_thread ON events (thread_id, sequence);

CREATE TABLE IF NOT EXISTS command_receipts (
    command_id      TEXT PRIMARY KEY,
    command_type    TEXT NOT NULL,
    fingerprint     TEXT NOT NULL,
    thread_id       TEXT,
    status          TEXT NOT NULL CHECK (status IN ('accepted', 'rejected')),
    result_sequence INTEGER NOT NULL,
    result_json     TEXT NOT NULL,
    error           TEXT,
    accepted_at     TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS effect_outbox (
    effect_id        TEXT PRIMARY KEY,
    command_id       TEXT    NOT NULL,
    thread_id        TEXT    NOT NULL,
    effect_type      TEXT    NOT NULL,
    payload_json     TEXT    NOT NULL,
    replay_safe      INTEGER NOT NULL CHECK (replay_safe IN (0, 1)),
    status           TEXT    NOT NULL
                     CHECK (status IN ('pending', 'running', 'succeeded', 'failed', 'cancelled')),
    attempt_count    INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    available_at_ms  INTEGER NOT NULL,
    lease_owner      TEXT,
    lease_expires_ms INTEGER,
    last_error       TEXT,
    created_at       TEXT    NOT NULL,
    updated_at       TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS effect_outbox_claim ON effect_outbox (status, available_at_ms);
CREATE INDEX IF NOT EXISTS effect_outbox_by_thread ON effect_outbox (thread_id, status);

CREATE TABLE IF NOT EXISTS projects (
    project_id   TEXT PRIMARY KEY,
    path         TEXT NOT NULL,
    title        TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS threads (
    thread_id    TEXT PRIMARY KEY,
    project_id   TEXT NOT NULL,
    parent_thread_id TEXT,
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL,
    deleted_at   TEXT,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS threads_by_project ON threads (project_id, updated_at);

CREATE TABLE IF NOT EXISTS runs (
    run_id       TEXT PRIMARY KEY,
    thread_id    TEXT    NOT NULL,
    ordinal      INTEGER NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('preparing', 'queued', 'starting', 'running',
                 'waiting', 'completed', 'interrupted', 'failed', 'cancelled', 'rolled_back')),
    payload_json TEXT    NOT NULL,
    UNIQUE (thread_id, ordinal)
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs (status);

CREATE TABLE IF NOT EXISTS run_attempts (
    attempt_id   TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS run_attempts_by_thread ON run_attempts (thread_id);

CREATE TABLE IF NOT EXISTS nodes (
    node_id      TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    run_id       TEXT,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS nodes_by_thread ON nodes (thread_id);

CREATE TABLE IF NOT EXISTS provider_sessions (
    provider_session_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    status       TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS provider_sessions_by_thread ON provider_sessions (thread_id);
CREATE INDEX IF NOT EXISTS provider_sessions_by_status ON provider_sessions (status);

CREATE TABLE IF NOT EXISTS provider_threads (
    provider_thread_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS provider_threads_by_thread ON provider_threads (thread_id);

CREATE TABLE IF NOT EXISTS provider_turns (
    provider_turn_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS provider_turns_by_thread ON provider_turns (thread_id);

CREATE TABLE IF NOT EXISTS runtime_requests (
    runtime_request_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN ('pending', 'resolved', 'expired', 'cancelled')),
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runtime_requests_by_thread ON runtime_requests (thread_id, status);

CREATE TABLE IF NOT EXISTS messages (
    message_id   TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    run_id       TEXT,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_thread ON messages (thread_id);

CREATE TABLE IF NOT EXISTS turn_items (
    turn_item_id TEXT PRIMARY KEY,
    thread_id    TEXT    NOT NULL,
    position     INTEGER NOT NULL,
    type         TEXT    NOT NULL,
    payload_json TEXT    NOT NULL,
    UNIQUE (thread_id, position)
);

-- Facts about this data directory that outlive one server process (environment id).
CREATE TABLE IF NOT EXISTS server_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
