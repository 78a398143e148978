-- The list of a project's threads, newest activity first, read as an index range scan.
-- activity_at is the later of the thread's updated_at and its latest run's requestedAt and
-- completedAt (the latest run is the one with the highest ordinal). store.py keeps it current
-- with _REFRESH_ACTIVITY after every thread or run projection write; this file fills it for
-- the threads of an older database with the same expression.

ALTER TABLE threads ADD COLUMN activity_at TEXT NOT NULL DEFAULT '';

UPDATE threads SET activity_at = COALESCE((
    SELECT MAX(threads.updated_at, COALESCE(json_extract(r.payload_json, '$.requestedAt'), ''),
               COALESCE(json_extract(r.payload_json, '$.completedAt'), ''))
    FROM runs r WHERE r.thread_id = threads.thread_id
    ORDER BY r.ordinal DESC LIMIT 1), updated_at);

CREATE INDEX IF NOT EXISTS threads_by_activity
    ON threads (project_id, activity_at, thread_id) WHERE deleted_at IS NULL;

-- Its only reader was the list query this index replaces.
DROP INDEX IF EXISTS threads_by_project;
