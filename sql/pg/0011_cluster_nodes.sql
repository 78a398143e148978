-- sql/0011_nodes.sql in PostgreSQL's dialect, and the notices that wake every node (cluster.py
-- LISTENs): t3_events when events commit; t3_effects when an outbox row is added or stops
-- running (another row of its thread may run now), not when one is claimed or renewed. A notice
-- is sent at COMMIT, once per transaction and channel however many rows it wrote.
CREATE TABLE cluster_nodes (
    node_id        TEXT   PRIMARY KEY,
    started_at     TEXT   NOT NULL,
    heartbeat_ms   BIGINT NOT NULL,
    providers_json TEXT   NOT NULL DEFAULT '[]',
    projects_json  TEXT   NOT NULL DEFAULT '[]',
    slots          BIGINT NOT NULL DEFAULT 16
);

CREATE TABLE thread_holders (
    thread_id TEXT PRIMARY KEY,
    node_id   TEXT NOT NULL
);
CREATE INDEX thread_holders_by_node ON thread_holders (node_id);

-- Whether a node can run a thread's work: the thread's project and provider instance are among
-- those the node serves (a scheduled task's row, not a thread's, any node can). A claimer that
-- is not a registered node (the store used alone) serves everything.
CREATE FUNCTION t3_serves(node TEXT, thread TEXT) RETURNS boolean STABLE LANGUAGE sql AS $$
    SELECT NOT EXISTS (SELECT 1 FROM cluster_nodes WHERE node_id = node)
        OR NOT EXISTS (SELECT 1 FROM threads WHERE thread_id = thread)
        OR EXISTS (SELECT 1 FROM threads t JOIN cluster_nodes n ON n.node_id = node
                   WHERE t.thread_id = thread
                     AND t.project_id IN (SELECT json_array_elements_text(n.projects_json::json))
                     AND (t3_json(t.payload_json) ->> 'providerInstanceId') IN (
                         SELECT p ->> 'instance_id' FROM json_array_elements(n.providers_json::json) p))
$$;

-- Whether a node may take a new thread's run (the start of a run on a thread it does not hold):
-- while it has an agent slot that the runs on its threads (starting, running, or waiting in its
-- line for a slot) leave free, or when no other node can run it (alone, it lines runs up as a
-- single server does, and an agent waiting on its work lends it a slot). So no node lines up new
-- runs that another node could start: they wait in the outbox until a slot frees somewhere.
CREATE FUNCTION t3_room(node TEXT) RETURNS bigint STABLE LANGUAGE sql AS $$
    SELECT n.slots - (SELECT COUNT(*) FROM thread_holders h JOIN runs r ON r.thread_id = h.thread_id
                      WHERE h.node_id = node AND (r.status IN ('starting', 'running')
                        OR (t3_json(r.payload_json) ->> 'awaitingAgentSlot') = 'true'))
    FROM cluster_nodes n WHERE n.node_id = node
$$;
CREATE FUNCTION t3_may_take(node TEXT, thread TEXT) RETURNS boolean STABLE LANGUAGE sql AS $$
    SELECT EXISTS (SELECT 1 FROM thread_holders WHERE thread_id = thread AND node_id = node)
        OR COALESCE(t3_room(node), 1) > 0
        OR NOT EXISTS (SELECT 1 FROM cluster_nodes n WHERE n.node_id <> node
                       AND t3_serves(n.node_id, thread))
$$;

CREATE FUNCTION t3_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END $$;
CREATE TRIGGER events_notify AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION t3_notify('t3_events');
CREATE TRIGGER effects_added AFTER INSERT ON effect_outbox
    FOR EACH ROW EXECUTE FUNCTION t3_notify('t3_effects');
CREATE TRIGGER effects_stopped AFTER UPDATE ON effect_outbox
    FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status <> 'running')
    EXECUTE FUNCTION t3_notify('t3_effects');
