-- sql/0009_live_rows.sql in PostgreSQL's dialect: partial indexes of the rows a restart reads.

CREATE INDEX provider_sessions_live ON provider_sessions (thread_id)
  WHERE status NOT IN ('stopped', 'error');
CREATE INDEX runtime_requests_pending ON runtime_requests (thread_id)
  WHERE status = 'pending';
CREATE INDEX scheduled_tasks_kept ON scheduled_tasks (scheduled_task_id)
  WHERE deleted_at IS NULL;
