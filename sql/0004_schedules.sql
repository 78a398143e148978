-- Scheduled tasks and their webhook deliveries (SPEC 7). Each task is an event stream of its
-- own: the events' thread_id (the stream key) is the task's id, and so is thread_id here.
-- payload_json is the full entity; the other columns are what the scheduler and reads filter on.

CREATE TABLE IF NOT EXISTS scheduled_tasks (
    scheduled_task_id TEXT PRIMARY KEY,
    thread_id    TEXT    NOT NULL,
    project_id   TEXT    NOT NULL,
    enabled      INTEGER NOT NULL,
    next_run_at  TEXT,
    deleted_at   TEXT,
    payload_json TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS scheduled_tasks_by_stream ON scheduled_tasks (thread_id);
-- The scheduler's question: what is due next?
CREATE INDEX IF NOT EXISTS scheduled_tasks_due ON scheduled_tasks (next_run_at)
    WHERE enabled = 1 AND deleted_at IS NULL AND next_run_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS webhook_deliveries (
    webhook_delivery_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    received_at  TEXT NOT NULL,
    delivery_key TEXT,
    outcome      TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_stream
    ON webhook_deliveries (thread_id, received_at);
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_key ON webhook_deliveries (thread_id, delivery_key);
