-- t3 core schema in PostgreSQL's dialect (store_pg.py): sql/0001_core.sql with PostgreSQL's
-- types. Text compares as bytes (the database's collation is C, store_pg checks), integers are
-- BIGINT, payload_json stays TEXT: it is returned byte for byte as it was written.

-- A payload as JSON, for reading a value out of it in SQL. PostgreSQL's text cannot hold NUL,
-- and ->> fails on a \u0000 escape: those escapes (not an escaped backslash followed by u0000)
-- are dropped first, so a value read out here lacks its NULs; the stored payload keeps them.
CREATE FUNCTION t3_json(payload TEXT) RETURNS json
    IMMUTABLE STRICT PARALLEL SAFE LANGUAGE sql
    AS $$ SELECT CASE WHEN strpos(payload, '\u0000') = 0 THEN payload::json
                      ELSE regexp_replace(payload, '(?<!\\)((?:\\\\)*)\\u0000', '\1', 'g')::json
                 END $$;

-- The log's last sequence, as SQLite's AUTOINCREMENT keeps it: each event insert takes the next
-- one from this row, so appends are serialized by its row lock and sequences are gap-free and in
-- commit order (a sequence object is neither).
CREATE TABLE event_log (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    last_sequence BIGINT  NOT NULL
);
INSERT INTO event_log (id, last_sequence) VALUES (1, 0);

CREATE TABLE events (
    sequence        BIGINT  PRIMARY KEY,
    event_id        TEXT    NOT NULL UNIQUE,
    thread_id       TEXT    NOT NULL,
    stream_version  BIGINT  NOT NULL,
    command_id      TEXT,
    type            TEXT    NOT NULL,
    occurred_at     TEXT    NOT NULL,
    payload_json    TEXT    NOT NULL,
    UNIQUE (thread_id, stream_version)
);
CREATE INDEX events_by_command ON events (command_id);
CREATE INDEX events_by_thread ON events (thread_id, sequence);

CREATE TABLE command_receipts (
    command_id      TEXT PRIMARY KEY,
    command_type    TEXT NOT NULL,
    fingerprint     TEXT NOT NULL,
    thread_id       TEXT,
    status          TEXT NOT NULL CHECK (status IN ('accepted', 'rejected')),
    result_sequence BIGINT NOT NULL,
    result_json     TEXT NOT NULL,
    error           TEXT,
    accepted_at     TEXT NOT NULL
);

CREATE TABLE effect_outbox (
    effect_id        TEXT PRIMARY KEY,
    command_id       TEXT    NOT NULL,
    thread_id        TEXT    NOT NULL,
    effect_type      TEXT    NOT NULL,
    payload_json     TEXT    NOT NULL,
    replay_safe      INTEGER NOT NULL CHECK (replay_safe IN (0, 1)),
    status           TEXT    NOT NULL
                     CHECK (status IN ('pending', 'running', 'succeeded', 'failed', 'cancelled')),
    attempt_count    BIGINT  NOT NULL DEFAULT 0,
    max_attempts     BIGINT  NOT NULL,
    available_at_ms  BIGINT  NOT NULL,
    lease_owner      TEXT,
    lease_expires_ms BIGINT,
    last_error       TEXT,
    created_at       TEXT    NOT NULL,
    updated_at       TEXT    NOT NULL
);
CREATE INDEX effect_outbox_claim ON effect_outbox (status, available_at_ms);
CREATE INDEX effect_outbox_by_thread ON effect_outbox (thread_id, status);

CREATE TABLE projects (
    project_id   TEXT PRIMARY KEY,
    path         TEXT NOT NULL,
    title        TEXT NOT NULL
);

CREATE TABLE threads (
    thread_id    TEXT PRIMARY KEY,
    project_id   TEXT NOT NULL,
    parent_thread_id TEXT,
    created_at   TEXT NOT NULL,
    updated_at   TEXT NOT NULL,
    deleted_at   TEXT,
    payload_json TEXT NOT NULL
);
CREATE INDEX threads_by_project ON threads (project_id, updated_at);

-- row_order: the order rows were first written (SQLite's rowid; an upsert keeps it).
CREATE TABLE runs (
    run_id       TEXT PRIMARY KEY,
    thread_id    TEXT    NOT NULL,
    ordinal      BIGINT  NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('preparing', 'queued', 'starting', 'running',
                 'waiting', 'completed', 'interrupted', 'failed', 'cancelled', 'rolled_back')),
    payload_json TEXT    NOT NULL,
    row_order    BIGINT  GENERATED ALWAYS AS IDENTITY,
    UNIQUE (thread_id, ordinal)
);
CREATE INDEX runs_by_status ON runs (status);

CREATE TABLE run_attempts (
    attempt_id   TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX run_attempts_by_thread ON run_attempts (thread_id);

CREATE TABLE nodes (
    node_id      TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    run_id       TEXT,
    payload_json TEXT NOT NULL
);
CREATE INDEX nodes_by_thread ON nodes (thread_id);

CREATE TABLE provider_sessions (
    provider_session_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    status       TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX provider_sessions_by_thread ON provider_sessions (thread_id);
CREATE INDEX provider_sessions_by_status ON provider_sessions (status);

CREATE TABLE provider_threads (
    provider_thread_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX provider_threads_by_thread ON provider_threads (thread_id);

CREATE TABLE provider_turns (
    provider_turn_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX provider_turns_by_thread ON provider_turns (thread_id);

CREATE TABLE runtime_requests (
    runtime_request_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN ('pending', 'resolved', 'expired', 'cancelled')),
    payload_json TEXT NOT NULL
);
CREATE INDEX runtime_requests_by_thread ON runtime_requests (thread_id, status);

CREATE TABLE messages (
    message_id   TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    run_id       TEXT,
    payload_json TEXT NOT NULL
);
CREATE INDEX messages_by_thread ON messages (thread_id);

CREATE TABLE turn_items (
    turn_item_id TEXT PRIMARY KEY,
    thread_id    TEXT    NOT NULL,
    position     BIGINT  NOT NULL,
    type         TEXT    NOT NULL,
    payload_json TEXT    NOT NULL,
    UNIQUE (thread_id, position)
);

-- Facts about this t3 installation that outlive one server process (environment id).
CREATE TABLE server_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
