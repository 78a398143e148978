-- sql/0005_handoffs.sql in PostgreSQL's dialect: context handoffs.

CREATE TABLE context_handoffs (
    context_handoff_id TEXT PRIMARY KEY,
    thread_id          TEXT NOT NULL,
    target_run_id      TEXT NOT NULL,
    payload_json       TEXT NOT NULL
);
CREATE INDEX context_handoffs_by_thread ON context_handoffs (thread_id);
