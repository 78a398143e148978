-- sql/0006_checkpoints.sql in PostgreSQL's dialect: checkpoints.

CREATE TABLE checkpoints (
    checkpoint_id TEXT PRIMARY KEY,
    thread_id     TEXT NOT NULL,
    run_id        TEXT,
    payload_json  TEXT NOT NULL
);
CREATE INDEX checkpoints_by_thread ON checkpoints (thread_id);
