-- sql/0004_schedules.sql in PostgreSQL's dialect: scheduled tasks and webhook deliveries.
-- enabled is a boolean here (the entity's own JSON value).

CREATE TABLE scheduled_tasks (
    scheduled_task_id TEXT PRIMARY KEY,
    thread_id    TEXT    NOT NULL,
    project_id   TEXT    NOT NULL,
    enabled      BOOLEAN NOT NULL,
    next_run_at  TEXT,
    deleted_at   TEXT,
    payload_json TEXT    NOT NULL
);
CREATE INDEX scheduled_tasks_by_stream ON scheduled_tasks (thread_id);
CREATE INDEX scheduled_tasks_due ON scheduled_tasks (next_run_at)
    WHERE enabled AND deleted_at IS NULL AND next_run_at IS NOT NULL;

CREATE TABLE webhook_deliveries (
    webhook_delivery_id TEXT PRIMARY KEY,
    thread_id    TEXT NOT NULL,
    received_at  TEXT NOT NULL,
    delivery_key TEXT,
    outcome      TEXT NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE INDEX webhook_deliveries_by_stream ON webhook_deliveries (thread_id, received_at);
CREATE INDEX webhook_deliveries_by_key ON webhook_deliveries (thread_id, delivery_key);
