-- A filtered list reads each thread's own row: its latest run's status (or idle) and its title
-- folded with Python's str.lower (the t3_fold function store.connect registers). store.py keeps
-- both current with _REFRESH_LISTING after every thread or run projection write; this file fills
-- them for the threads of an older database with the same expressions.

ALTER TABLE threads ADD COLUMN latest_status TEXT NOT NULL DEFAULT 'idle';
ALTER TABLE threads ADD COLUMN title_folded TEXT NOT NULL DEFAULT '';

UPDATE threads SET
  latest_status = COALESCE((SELECT r.status FROM runs r WHERE r.thread_id = threads.thread_id
                            ORDER BY r.ordinal DESC LIMIT 1), 'idle'),
  title_folded = t3_fold(json_extract(payload_json, '$.title'));
