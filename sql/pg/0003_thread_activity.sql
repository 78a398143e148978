-- sql/0003_thread_activity.sql in PostgreSQL's dialect: a thread's activity time, kept by
-- store_pg's form of _REFRESH_LISTING, and the index a list reads backwards.

ALTER TABLE threads ADD COLUMN activity_at TEXT NOT NULL DEFAULT '';

UPDATE threads SET activity_at = COALESCE((
    SELECT GREATEST(threads.updated_at, COALESCE(t3_json(r.payload_json) ->> 'requestedAt', ''),
                    COALESCE(t3_json(r.payload_json) ->> 'completedAt', ''))
    FROM runs r WHERE r.thread_id = threads.thread_id
    ORDER BY r.ordinal DESC LIMIT 1), updated_at);

CREATE INDEX threads_by_activity
    ON threads (project_id, activity_at, thread_id) WHERE deleted_at IS NULL;

DROP INDEX threads_by_project;
