-- Context handoffs: the summary a provider got when it joined a thread's conversation late
-- (a provider switch, or a resume that failed), one per run at most.

CREATE TABLE IF NOT EXISTS context_handoffs (
    context_handoff_id TEXT PRIMARY KEY,
    thread_id          TEXT NOT NULL,
    target_run_id      TEXT NOT NULL,
    payload_json       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS context_handoffs_by_thread ON context_handoffs (thread_id);
