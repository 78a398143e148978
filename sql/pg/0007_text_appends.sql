-- sql/0007_text_appends.sql in PostgreSQL's dialect: a still-open message's appends, by its id.
CREATE INDEX events_text_appends ON events ((t3_json(payload_json) ->> 'id'), sequence)
WHERE type = 'message-text.appended';
