-- No query of t3 looks events up by their command (a receipt answers a command seen before), and
-- every event paid for this index: one more B-tree page written per commit.
DROP INDEX IF EXISTS events_by_command;
