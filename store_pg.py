"""store_pg.py: t3's store on PostgreSQL (psycopg 3), which several t3 nodes may share
(cluster.py; README, "Running on several machines").

A feature module: the core never imports it; ``t3.py`` does when ``[store] url`` or
``--database`` names a ``postgresql://`` URL (``pip install -e '.[postgres]'``). An auditor of a
single-node install may skip it.

How: ``store.Store`` runs unchanged over a ``PostgresEngine``. Its connections answer the calls
the Store makes of a sqlite3 connection, and send each statement in PostgreSQL's dialect: the
form in ``_FORMS`` where the dialects differ (keyed by store.py's own statement), else the same
text with ``?`` and ``:name`` written as psycopg's ``%s`` and ``%(name)s``. The contract tests run
every store operation on both engines, so a statement without its form fails there.

Rules:
- Schema: ``sql/pg/NNNN_*.sql``, numbered as ``sql/`` (a version means the same schema on both),
  each file applied in one transaction together with its row in ``t3_schema``, all under a
  session advisory lock, so nodes that start together migrate once. A database from a newer t3
  is refused untouched. No copy is made before migrating: that is the database's own backups'.
- One writer at a time, on every node together: ``BEGIN IMMEDIATE`` (SQLite's write lock) is
  ``BEGIN`` plus a transaction advisory lock. Events take their sequence from the ``event_log``
  row in the appending transaction, so sequences are gap-free and in commit order: a reader that
  saw N never later finds a new event below N.
- The outbox's claims, lease renewals, settles and recoveries commit beside that lock, under one
  of their own (``outbox_apart``): one node's claim never waits on another's commit. Only a claim
  makes a row running, so claims in turn keep one running row per thread; a commit that cancels
  rows meets a claim on the row's lock (``FOR UPDATE ... SKIP LOCKED``), as in some serial order.
- A snapshot (``BEGIN`` on a reader) is a REPEATABLE READ, READ ONLY transaction; readers'
  connections are read-only.
- Text compares and sorts as bytes, as in SQLite: the database's collation must be C (refused
  otherwise). Errors of the driver become ``StoreError`` here.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

import store as s
from store import DatabaseTooNew, StoreError

__all__ = ["SQL_DIR", "PostgresEngine", "is_postgres_url"]

SQL_DIR = s.SQL_DIR / "pg"
# Advisory lock keys (any bigint; these spell "t3" and a purpose).
_WRITE_LOCK = 0x7433_0001
_MIGRATE_LOCK = 0x7433_0002
_OUTBOX_LOCK = 0x7433_0003


def is_postgres_url(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


class PostgresEngine:
    """A ``store.Engine`` on the PostgreSQL database at ``url``."""

    outbox_apart = True

    def __init__(self, url: str, *, sql_dir: Path = SQL_DIR) -> None:
        if not is_postgres_url(url):
            raise ValueError("a PostgreSQL URL starts with postgresql://")
        self.url, self.sql_dir = url, sql_dir
        self.writers: set[int] = set()  # the server process ids of its writers' connections

    def connect(self, *, readonly: bool = False) -> Any:
        try:
            conn = _Connection.connect(self.url, autocommit=True, cursor_factory=_Cursor,
                                       row_factory=_row_factory)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc
        if readonly:
            conn.execute("SET default_transaction_read_only = on")
        else:
            self.writers.add(conn.info.backend_pid)
        return conn

    def migrate(self, *, stop_after: int | None = None) -> int:
        """Bring the database to the newest schema (or ``stop_after``); return its version."""
        files = s.schema_files(self.sql_dir)
        latest = files[-1][0] if files else 0
        with self.connect() as conn:
            # Session-level: held across the files' own transactions, released with the session.
            conn.execute(f"SELECT pg_advisory_lock({_MIGRATE_LOCK:d})")
            _check_collation(conn)
            conn.execute("CREATE TABLE IF NOT EXISTS t3_schema (version INTEGER PRIMARY KEY, "
                         "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
            current = int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM t3_schema")
                          .fetchone()[0])
            if current > latest:
                raise DatabaseTooNew(f"the PostgreSQL database has schema version {current}, "
                                     f"newer than this t3 (knows {latest}); it was left untouched")
            for version, file in files:
                if version <= current or (stop_after is not None and version > stop_after):
                    continue
                try:
                    with conn.transaction():
                        # As written (a plain cursor: no dialect), all statements in one query.
                        conn.cursor().execute(file.read_text())
                        conn.execute("INSERT INTO t3_schema (version) VALUES (?)", (version,))
                except (psycopg.Error, StoreError) as exc:
                    raise StoreError(f"schema file pg/{file.name} failed: {exc}") from exc
                s.log.info("applied schema pg/%s", file.name)
                current = version
            return current


def _check_collation(conn: _Connection) -> None:
    # Ids, times and cursors are compared as SQLite compares them: byte by byte. A locale
    # collation orders 'a' before 'B' and skips punctuation.
    collate, bytewise = conn.execute(
        "SELECT datcollate, 'B' < 'a' AND '-1' < '0' AND 'a0' < 'a_' FROM pg_database "
        "WHERE datname = current_database()").fetchone()
    if not bytewise:
        raise StoreError(f"the PostgreSQL database sorts text by locale ({collate}); t3 needs "
                         "collation C: CREATE DATABASE t3 TEMPLATE template0 ENCODING 'UTF8' "
                         "LOCALE 'C'")


# ---------------------------------------------------------------------------------------------
# Connections that answer as sqlite3's


class _Row:
    """A row as ``sqlite3.Row`` reads: by position or by column name."""

    __slots__ = ("_values", "_index")

    def __init__(self, values: tuple[Any, ...], index: dict[str, int]) -> None:
        self._values, self._index = values, index

    def __getitem__(self, key: int | str | slice) -> Any:
        return self._values[self._index[key]] if isinstance(key, str) else self._values[key]

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Any:
    index = {d.name: i for i, d in enumerate(cursor.description or ())}
    return lambda values: _Row(tuple(values), index)


class _Cursor(psycopg.Cursor[Any]):
    @property
    def lastrowid(self) -> Any:
        """The generated key of the row just inserted: store.py reads it after an event insert,
        whose form here ends in RETURNING sequence."""
        row = self.fetchone()
        return None if row is None else row[0]


class _Connection(psycopg.Connection[Any]):
    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        try:
            return super().execute(_dialect(query) if isinstance(query, str) else query,
                                   params or None, **kwargs)
        except psycopg.Error as exc:
            raise StoreError(f"database error: {exc}") from exc

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[None]:
        """Statements sent without waiting for each answer (a read waits for those before it);
        an error may surface at a later statement or at the end: a StoreError either way."""
        try:
            with self.pipeline():
                yield
        except psycopg.Error as exc:
            raise StoreError(f"database error: {exc}") from exc

    @property
    def in_transaction(self) -> bool:
        return self.info.transaction_status != TransactionStatus.IDLE


_PLACEHOLDER = re.compile(r"\?|(?<![:\w]):(\w+)")


@functools.lru_cache(maxsize=4096)
def _dialect(sql: str) -> str:
    form = _FORMS.get(sql)
    if form is not None:
        return form
    return _PLACEHOLDER.sub(lambda m: "%s" if m[0] == "?" else f"%({m[1]})s", sql)


# ---------------------------------------------------------------------------------------------
# The statements whose PostgreSQL form differs from store.py's (json_extract, a subquery's
# alias, SQLite's scalar MAX, t3_fold, rowid, NULLs' place in an order, typed parameters)


def _json(column: str, key: str) -> str:
    """``json_extract(column, '$.key')`` for a string or null value (dotted: nested), through
    t3_json (sql/pg/0001: a NUL in the value is dropped)."""
    path = key.split(".")
    return f"(t3_json({column}) ->> '{key}')" if len(path) == 1 \
        else f"(t3_json({column}) #>> '{{{','.join(path)}}}')"


# Several nodes (cluster.py): a node claims the work of threads it serves (their project and
# provider) unless another live node holds the thread and serves it too, and a new thread's start
# only while it has room (``_ROOM``) or when no other node can run it; a claim makes the claiming
# node the thread's holder, so its agent process stays in one place. These run at every wake of
# every node's effect worker, over every pending row they pass: each node's lists are read once
# per statement (``served``), each row's thread once (``th``), the node's room once.
_SERVED = """served AS MATERIALIZED (SELECT n.node_id,
    ARRAY(SELECT json_array_elements_text(n.projects_json::json)) AS projects,
    ARRAY(SELECT p ->> 'instance_id' FROM json_array_elements(n.providers_json::json) p)
        AS providers
    FROM cluster_nodes n)"""
# (OFFSET 0 keeps it a lookup per row the scan reaches, not a hash of every thread.)
_THREAD_OF_ROW = """LEFT JOIN LATERAL (
    SELECT t.project_id AS project, t3_json(t.payload_json) ->> 'providerInstanceId' AS provider
    FROM threads t WHERE t.thread_id = o.thread_id OFFSET 0) th ON true"""
# Whether node s serves the row's thread (a row of no thread, any node does).
_SERVES = "(th.project IS NULL OR th.project = ANY(s.projects) AND th.provider = ANY(s.providers))"
# Whether the claiming node has an agent slot that the runs on its threads (starting, running,
# or waiting in its line for a slot) leave free; a claimer that is no node has room.
_ROOM = """(COALESCE((SELECT n.slots FROM cluster_nodes n WHERE n.node_id = %(owner)s) - (
    SELECT COUNT(*) FROM thread_holders h JOIN runs r ON r.thread_id = h.thread_id
    WHERE h.node_id = %(owner)s AND r.status IN ('starting', 'running', 'queued')
      AND (r.status <> 'queued' OR (t3_json(r.payload_json) ->> 'awaitingAgentSlot') = 'true')),
    1) > 0)"""
_ELSEWHERE = f"""(EXISTS (SELECT 1 FROM served s WHERE s.node_id = %(owner)s) AND NOT EXISTS (
        SELECT 1 FROM served s WHERE s.node_id = %(owner)s AND {_SERVES})
    OR EXISTS (SELECT 1 FROM thread_holders h JOIN served s ON s.node_id = h.node_id
               WHERE h.thread_id = o.thread_id AND h.node_id <> %(owner)s AND {_SERVES})
    OR o.effect_type = 'provider-turn.start' AND NOT {_ROOM}
       AND NOT EXISTS (SELECT 1 FROM thread_holders h
                       WHERE h.thread_id = o.thread_id AND h.node_id = %(owner)s)
       AND EXISTS (SELECT 1 FROM served s WHERE s.node_id <> %(owner)s AND {_SERVES}))"""
_FIRST_CLAIMABLE = f"""SELECT * FROM (
    SELECT o.effect_id, o.available_at_ms, o.created_at FROM effect_outbox o {_THREAD_OF_ROW}
    WHERE {{due}}
      AND NOT EXISTS (SELECT 1 FROM effect_outbox r
                      WHERE r.thread_id = o.thread_id AND r.status = 'running'
                        AND r.lease_expires_ms >= %(now)s AND r.effect_id <> o.effect_id)
      AND NOT {_ELSEWHERE}
    ORDER BY o.available_at_ms, o.created_at, o.effect_id LIMIT 1
    FOR UPDATE OF o SKIP LOCKED) {{name}}"""
_SNOOZED = f"""(COALESCE({_json('t.payload_json', 'snoozedUntil')} > %(now)s, false)
  AND NOT EXISTS (SELECT 1 FROM runtime_requests q
                  WHERE q.thread_id = t.thread_id AND q.status = 'pending')
  AND NOT EXISTS (SELECT 1 FROM runs f WHERE f.thread_id = t.thread_id AND f.status = 'failed'
                  AND {_json('f.payload_json', 'completedAt')}
                      > {_json('t.payload_json', 'snoozedAt')}))"""
_LISTED_THREADS = f"""
FROM threads t
WHERE t.project_id = %(project)s AND t.deleted_at IS NULL
  AND (%(archived)s::boolean IS NULL
       OR ({_json('t.payload_json', 'archivedAt')} IS NOT NULL) = %(archived)s::boolean)
  AND (%(snoozed)s::boolean IS NULL OR {_SNOOZED} = %(snoozed)s::boolean)
  AND (%(subagents)s::boolean
       OR {_json('t.payload_json', 'lineage.relationshipToParent')} IS DISTINCT FROM 'subagent')
  AND (%(needle)s::text IS NULL OR strpos(t.title_folded, %(needle)s::text) > 0)
  AND (%(statuses)s::json IS NULL
       OR t.latest_status IN (SELECT json_array_elements_text(%(statuses)s::json)))
"""
_NEWEST_DELIVERIES = (f"ORDER BY {_json('payload_json', 'ordinal')}::numeric DESC NULLS LAST, "
                      "received_at DESC")
_DUE = f"""FROM scheduled_tasks
WHERE enabled AND deleted_at IS NULL AND next_run_at IS NOT NULL
  AND {_json('payload_json', 'lastRunStatus')} != 'running'"""
# A JSON true, as SQLite's json_extract makes it a true condition.
_AWAITING_SLOT = "(t3_json({column}) ->> 'awaitingAgentSlot') = 'true'"

_FORMS: dict[str, str] = {
    "BEGIN IMMEDIATE": f"BEGIN; SELECT pg_advisory_xact_lock({_WRITE_LOCK:d})",
    s._BEGIN_OUTBOX: f"BEGIN; SELECT pg_advisory_xact_lock({_OUTBOX_LOCK:d})",
    "BEGIN": "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
    s._INSERT_EVENT: """
WITH next AS (UPDATE event_log SET last_sequence = last_sequence + 1 WHERE id = 1
              RETURNING last_sequence)
INSERT INTO events (sequence, event_id, thread_id, stream_version, command_id, type, occurred_at,
                    payload_json)
SELECT last_sequence, %s, %s, %s, %s, %s, %s, %s FROM next
RETURNING sequence
""",
    s._APPENDED_TEXT: f"""
SELECT {_json('payload_json', 'text')} FROM events
WHERE type = '{s.TEXT_APPENDED}' AND {_json('payload_json', 'id')} = %s ORDER BY sequence
""",
    s._CLAIM_EFFECT: f"""
WITH {_SERVED},
claimed AS (
UPDATE effect_outbox
SET status = 'running', attempt_count = attempt_count + 1, lease_owner = %(owner)s,
    lease_expires_ms = %(now)s + %(lease)s, last_error = NULL, updated_at = %(stamp)s
WHERE effect_id = (
    SELECT effect_id FROM (
        {_FIRST_CLAIMABLE.format(due="o.status = 'pending' AND o.available_at_ms <= %(now)s",
                                 name="first_pending")}
        UNION ALL
        {_FIRST_CLAIMABLE.format(due="o.status = 'running' AND o.lease_expires_ms < %(now)s",
                                 name="first_expired")}) claimable
    ORDER BY available_at_ms, created_at, effect_id LIMIT 1)
RETURNING *),
held AS (INSERT INTO thread_holders (thread_id, node_id) SELECT thread_id, %(owner)s FROM claimed
         WHERE EXISTS (SELECT 1 FROM threads t WHERE t.thread_id = claimed.thread_id)
         ON CONFLICT (thread_id) DO UPDATE SET node_id = excluded.node_id)
SELECT * FROM claimed
""",
    s._NEXT_DUE: f"""
WITH {_SERVED}
SELECT MIN(t) FROM (
    SELECT * FROM (SELECT o.available_at_ms AS t FROM effect_outbox o {_THREAD_OF_ROW}
    WHERE o.status = 'pending'
      AND NOT EXISTS (SELECT 1 FROM effect_outbox r
                      WHERE r.thread_id = o.thread_id AND r.status = 'running')
      AND NOT {_ELSEWHERE}
    ORDER BY o.available_at_ms LIMIT 1) first_pending
    UNION ALL
    SELECT lease_expires_ms FROM effect_outbox WHERE status = 'running') due
""",
    s._REFRESH_LISTING: f"""
UPDATE threads SET activity_at = COALESCE((
    SELECT GREATEST(threads.updated_at, COALESCE({_json('r.payload_json', 'requestedAt')}, ''),
                    COALESCE({_json('r.payload_json', 'completedAt')}, ''))
    FROM runs r WHERE r.thread_id = threads.thread_id
    ORDER BY r.ordinal DESC LIMIT 1), updated_at),
  latest_status = COALESCE((SELECT r.status FROM runs r WHERE r.thread_id = threads.thread_id
                            ORDER BY r.ordinal DESC LIMIT 1), 'idle'),
  title_folded = COALESCE(lower({_json('payload_json', 'title')} COLLATE "und-x-icu"), '')
WHERE thread_id = %s
""",
    s._COUNT_LISTED_THREADS: "SELECT COUNT(*)" + _LISTED_THREADS,
    s._PAGE_OF_LISTED_THREADS: f"""
SELECT t.payload_json AS thread_json, t.activity_at,
       lr.run_id AS latest_run_id, lr.status AS latest_status,
       (SELECT COUNT(*) FROM turn_items i WHERE i.thread_id = t.thread_id) AS item_count,
       (SELECT COUNT(*) FROM runtime_requests q
        WHERE q.thread_id = t.thread_id AND q.status = 'pending') AS pending_count,
       (SELECT COUNT(*) FROM subagents s WHERE s.thread_id = t.thread_id AND s.status NOT IN
        ('completed', 'failed', 'cancelled', 'interrupted')) AS background_count,
       {_SNOOZED} AS snoozed
FROM (SELECT t.thread_id {_LISTED_THREADS} ORDER BY t.activity_at DESC, t.thread_id DESC
      LIMIT %(limit)s OFFSET %(offset)s) page
JOIN threads t ON t.thread_id = page.thread_id
LEFT JOIN runs lr ON lr.run_id = (SELECT r.run_id FROM runs r WHERE r.thread_id = t.thread_id
                                  ORDER BY r.ordinal DESC LIMIT 1)
ORDER BY t.activity_at DESC, t.thread_id DESC
""",
    s._PRUNE_DELIVERIES: f"""
DELETE FROM webhook_deliveries WHERE thread_id = %s AND outcome NOT IN ('queued', 'running')
  AND webhook_delivery_id NOT IN (
    SELECT webhook_delivery_id FROM webhook_deliveries WHERE thread_id = %s
    {_NEWEST_DELIVERIES} LIMIT {s.DELIVERIES_KEPT:d})
""",
    s._DUE_TASKS: f"SELECT payload_json {_DUE} AND next_run_at <= %s ORDER BY next_run_at",
    s._NEXT_DUE_TASK: f"SELECT MIN(next_run_at) {_DUE}",
    s._DELIVERIES: f"""
SELECT payload_json FROM webhook_deliveries WHERE thread_id = %s {_NEWEST_DELIVERIES}
""",
    s._PENDING_REQUESTS: f"""
SELECT payload_json FROM runtime_requests WHERE status = 'pending'
ORDER BY {_json('payload_json', 'createdAt')} NULLS FIRST, runtime_request_id
""",
    s._THREADS_NEEDING_RECOVERY: f"""
SELECT thread_id FROM runs r WHERE status = 'running' OR status IN ('preparing', 'starting')
  AND NOT EXISTS (SELECT 1 FROM effect_outbox o WHERE o.thread_id = r.thread_id
    AND o.status = 'pending' AND o.attempt_count = 0
    AND o.effect_type IN ('provider-turn.start', 'workspace.prepare')
    AND {_json('o.payload_json', 'runId')} = r.run_id)
UNION SELECT thread_id FROM runs q WHERE status = 'queued' AND NOT EXISTS (
  SELECT 1 FROM runs b WHERE b.thread_id = q.thread_id
    AND (b.status IN ('preparing', 'starting', 'running', 'waiting')
         OR COALESCE({_AWAITING_SLOT.format(column='b.payload_json')}, false)))
UNION SELECT thread_id FROM provider_sessions WHERE status NOT IN ('stopped', 'error')
UNION SELECT thread_id FROM runtime_requests WHERE status = 'pending'
""",
    s._RUNS_AWAITING_SLOT: f"""
SELECT thread_id, run_id, {_json('payload_json', 'activeAttemptId')} FROM runs
WHERE status = 'queued' AND {_AWAITING_SLOT.format(column='payload_json')}
ORDER BY {_json('payload_json', 'requestedAt')} NULLS FIRST, row_order
""",
}

