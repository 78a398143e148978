-- sql/0002_delegation.sql in PostgreSQL's dialect: subagents and context transfers.

CREATE TABLE subagents (
    subagent_id     TEXT PRIMARY KEY,
    thread_id       TEXT NOT NULL,
    child_thread_id TEXT,
    status          TEXT NOT NULL CHECK (status IN ('pending', 'running', 'waiting', 'completed',
                    'failed', 'cancelled', 'interrupted')),
    payload_json    TEXT NOT NULL
);
CREATE INDEX subagents_by_thread ON subagents (thread_id);
CREATE INDEX subagents_by_child ON subagents (child_thread_id);

CREATE TABLE context_transfers (
    context_transfer_id TEXT PRIMARY KEY,
    thread_id        TEXT NOT NULL,
    type             TEXT NOT NULL,
    source_thread_id TEXT NOT NULL,
    target_thread_id TEXT NOT NULL,
    payload_json     TEXT NOT NULL
);
CREATE INDEX context_transfers_by_thread ON context_transfers (thread_id);
CREATE INDEX context_transfers_by_target ON context_transfers (target_thread_id);
