-- Streamed text is recorded as append-only events (store.TEXT_APPENDED); loading a thread whose
-- message is still open reads that message's appends through this index.
CREATE INDEX IF NOT EXISTS events_text_appends ON events (json_extract(payload_json, '$.id'), sequence)
WHERE type = 'message-text.appended';
