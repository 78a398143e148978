-- What a restart reads: the threads with a live provider session or a pending runtime request
-- (store._THREADS_NEEDING_RECOVERY) and the scheduled tasks not deleted (the scheduler resumes
-- their fires); clients also list the pending requests. Partial indexes of just those rows keep
-- these reads in proportion to what is live, not to every session, request and task the log
-- ever recorded.

CREATE INDEX IF NOT EXISTS provider_sessions_live ON provider_sessions (thread_id)
  WHERE status NOT IN ('stopped', 'error');
CREATE INDEX IF NOT EXISTS runtime_requests_pending ON runtime_requests (thread_id)
  WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS scheduled_tasks_kept ON scheduled_tasks (scheduled_task_id)
  WHERE deleted_at IS NULL;
