-- sql/0010_events_unindexed_by_command.sql in PostgreSQL's dialect.
DROP INDEX events_by_command;
