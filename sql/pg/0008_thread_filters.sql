-- sql/0008_thread_filters.sql in PostgreSQL's dialect: a thread's latest status and its title
-- folded as Python's str.lower does (lower() under the ICU root locale: the database's own
-- collation is C, whose lower() folds ASCII only).

ALTER TABLE threads ADD COLUMN latest_status TEXT NOT NULL DEFAULT 'idle';
ALTER TABLE threads ADD COLUMN title_folded TEXT NOT NULL DEFAULT '';

UPDATE threads SET
  latest_status = COALESCE((SELECT r.status FROM runs r WHERE r.thread_id = threads.thread_id
                            ORDER BY r.ordinal DESC LIMIT 1), 'idle'),
  title_folded = COALESCE(lower((t3_json(payload_json) ->> 'title') COLLATE "und-x-icu"), '');
