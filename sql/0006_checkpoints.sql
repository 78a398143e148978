-- Checkpoints (issue 12): the workspace as a hidden git ref after each run, and the thread's
-- baseline (ordinal 0). payload_json is the full entity.

CREATE TABLE IF NOT EXISTS checkpoints (
    checkpoint_id TEXT PRIMARY KEY,
    thread_id     TEXT NOT NULL,
    run_id        TEXT,
    payload_json  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_by_thread ON checkpoints (thread_id);
