-- The t3 processes (nodes) sharing one database, and which node holds each thread's agent work
-- (cluster.py, on PostgreSQL). A single SQLite server never writes them; the tables are here so
-- that a schema version means the same tables on both engines.
CREATE TABLE IF NOT EXISTS cluster_nodes (
    node_id        TEXT    PRIMARY KEY,
    started_at     TEXT    NOT NULL,
    heartbeat_ms   INTEGER NOT NULL,  -- the database's clock, so nodes' clocks may differ
    providers_json TEXT    NOT NULL DEFAULT '[]',  -- the provider instances it can run (their info)
    projects_json  TEXT    NOT NULL DEFAULT '[]',  -- the project ids it serves
    slots          INTEGER NOT NULL DEFAULT 16     -- its max_live_agent_processes
);

-- A thread's effects run on the node that claimed its first one while that node lives: its agent
-- process is there. When the node is declared dead its rows go and another node recovers them.
CREATE TABLE IF NOT EXISTS thread_holders (
    thread_id TEXT PRIMARY KEY,
    node_id   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS thread_holders_by_node ON thread_holders (node_id);
