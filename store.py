"""store.py: t3's only door to SQLite (stdlib ``sqlite3``).

What it owns:
- Schema: ``sql/NNNN_name.sql`` applied in order at open, each file in one ``BEGIN IMMEDIATE``
  transaction together with ``PRAGMA user_version = NNNN``. An older database is copied into
  ``backups/`` (sqlite3 backup API, temp file + rename) before it is migrated; a newer one is
  refused untouched.
- One writer: a dedicated thread owns the only write connection and runs the jobs of a queue
  inside ``BEGIN IMMEDIATE``, those queued meanwhile together (one fsync for all; a job that
  fails leaves nothing of itself); callers await a future. Reads use a separate ``query_only``
  connection. (An engine with ``outbox_apart`` gives the outbox's jobs a second such writer.)
- ``commit``: a command's receipt, its events (global ``sequence``, per-thread
  ``stream_version``), the projection rows those events imply, its outbox rows and any outbox
  cancellations, in ONE transaction. A command id seen before is answered from its receipt.
- The effect outbox: claim with a lease, renew, settle fenced by attempt number, recovery
  after a lost process.

The engine: a ``Store`` opens its database through an engine (``migrate``, then
``connect``): ``SqliteEngine``, one file, by default. ``store_pg.PostgresEngine`` (a feature
module the core never imports) serves the same statements from PostgreSQL, its connections
answering the same calls as sqlite3's; everything above ``connect`` is shared.

What it refuses to do: decide anything. It never imports another layer of t3; it stores and
returns JSON-shaped dicts and leaves their meaning to ``orchestrator.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "SQL_DIR", "StoreError", "DatabaseTooNew", "FingerprintMismatch", "StaleState", "crash_point",
    "NewEvent", "NewEffect", "Commit", "CommitResult", "Receipt", "EffectRow",
    "TEXT_APPENDED", "event_json", "event_kind", "projection_writes", "rebuild_projections",
    "connect", "add_functions", "apply_migrations", "schema_files", "Engine", "SqliteEngine",
    "Store",
]

# Beside store.py in a checkout; in <prefix>/share/t3/sql where an installed wheel puts it.
SQL_DIR = next((d for d in (Path(__file__).resolve().parent / "sql",
                            Path(sys.prefix) / "share" / "t3" / "sql") if d.is_dir()),
               Path(__file__).resolve().parent / "sql")
log = logging.getLogger("t3.store")
T = TypeVar("T")
_Value = TypeVar("_Value", bound="DataclassInstance")


class StoreError(Exception):
    """The database could not complete the operation."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class DatabaseTooNew(StoreError):
    """The database was written by a newer t3; it was left untouched."""


class FingerprintMismatch(StoreError):
    """This command id was already used for a different command payload."""


class StaleState(StoreError):
    """The thread has events the commit's decision did not see (another node committed them)."""


# ---------------------------------------------------------------------------------------------
# Test hooks (README "Fault injection"), inert unless T3_TEST_HOOKS=1


# Read once at import, and only together with the switch, so a stray variable cannot crash or
# cap a real server. T3_CRASH_AT: the process SIGKILLs itself at the one named point (unset,
# every crash_point is a no-op). T3_MAX_PAGE_COUNT: the writer connection's max_page_count, a
# full disk on demand.
_TEST_HOOKS = os.environ.get("T3_TEST_HOOKS") == "1"
_CRASH_AT = (os.environ.get("T3_CRASH_AT") or None) if _TEST_HOOKS else None
_MAX_PAGE_COUNT = (os.environ.get("T3_MAX_PAGE_COUNT") or None) if _TEST_HOOKS else None


def crash_point(name: str) -> None:
    if name == _CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Values crossing the boundary


@dataclass(frozen=True, slots=True)
class NewEvent:
    event_id: str
    thread_id: str
    type: str
    occurred_at: str
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class NewEffect:
    effect_id: str
    thread_id: str
    effect_type: str
    payload: Mapping[str, Any]
    replay_safe: bool
    max_attempts: int = 5


@dataclass(frozen=True, slots=True)
class Commit:
    """Everything one accepted command writes, committed atomically."""

    command_id: str
    command_type: str
    fingerprint: str
    thread_id: str | None
    events: Sequence[NewEvent]
    effects: Sequence[NewEffect] = ()
    result: Mapping[str, Any] = field(default_factory=dict)
    # Outbox rows of these types for this thread that are not settled yet become cancelled.
    cancel_effect_types: Sequence[str] = ()
    # (thread id, sequence): refused (StaleState) if the thread has an event after the sequence
    # its decision saw. Set where other processes commit to the same database (cluster.py).
    base: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Receipt:
    command_id: str
    command_type: str
    fingerprint: str
    thread_id: str | None
    status: str
    result_sequence: int
    result: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class CommitResult:
    committed: bool  # False: the receipt already existed and nothing was written
    receipt: Receipt
    sequences: Sequence[int] = ()
    cancelled_effect_ids: Sequence[str] = ()
    stream_versions: Sequence[int] = ()  # per event, as sequences
    payloads_json: Sequence[str] = ()  # per event: the payload as stored (for subscribers)


@dataclass(frozen=True, slots=True)
class EffectRow:
    effect_id: str
    command_id: str
    thread_id: str
    effect_type: str
    payload: Mapping[str, Any]
    replay_safe: bool
    status: str
    attempt_count: int
    max_attempts: int
    available_at_ms: int
    lease_owner: str | None
    lease_expires_ms: int | None
    last_error: str | None


def _from_row(cls: type[_Value], row: sqlite3.Row, **decoded: Any) -> _Value:
    """``row`` as ``cls``: each field is the column of the same name, unless ``decoded`` gives it
    (a ``*_json`` column parsed, a 0/1 made a bool)."""
    return cls(**{f.name: decoded[f.name] if f.name in decoded else row[f.name]
                  for f in fields(cls)})


def _effect_from_row(row: sqlite3.Row) -> EffectRow:
    if row["status"] not in ("pending", "running", "succeeded", "failed", "cancelled"):
        raise StoreError(f"unknown outbox status {row['status']!r}")
    return _from_row(EffectRow, row, payload=json.loads(row["payload_json"]),
                     replay_safe=bool(row["replay_safe"]))


def _receipt_from_row(row: sqlite3.Row) -> Receipt:
    if row["status"] not in ("accepted", "rejected"):
        raise StoreError(f"unknown receipt status {row['status']!r}")
    return _from_row(Receipt, row, result=json.loads(row["result_json"]))


# ---------------------------------------------------------------------------------------------
# Projections: which table an event's entity lands in, and the columns reads index.
# {kind: (table, primary key column, {column: payload key, dotted for a nested one})}

_PROJECTIONS: dict[str, tuple[str, str, dict[str, str]]] = {
    "thread": ("threads", "thread_id", {
        "thread_id": "id", "project_id": "projectId", "parent_thread_id": "lineage.parentThreadId",
        "created_at": "createdAt", "updated_at": "updatedAt", "deleted_at": "deletedAt"}),
    "run": ("runs", "run_id", {
        "run_id": "id", "thread_id": "threadId", "ordinal": "ordinal", "status": "status"}),
    "run-attempt": ("run_attempts", "attempt_id", {
        "attempt_id": "id", "thread_id": "threadId", "run_id": "runId"}),
    "node": ("nodes", "node_id", {"node_id": "id", "thread_id": "threadId", "run_id": "runId"}),
    "provider-session": ("provider_sessions", "provider_session_id", {
        "provider_session_id": "id", "thread_id": "threadId", "status": "status"}),
    "provider-thread": ("provider_threads", "provider_thread_id", {
        "provider_thread_id": "id", "thread_id": "appThreadId"}),
    "provider-turn": ("provider_turns", "provider_turn_id", {
        "provider_turn_id": "id", "thread_id": "threadId"}),
    "runtime-request": ("runtime_requests", "runtime_request_id", {
        "runtime_request_id": "id", "thread_id": "threadId", "status": "status"}),
    "message": ("messages", "message_id", {
        "message_id": "id", "thread_id": "threadId", "run_id": "runId"}),
    "turn-item": ("turn_items", "turn_item_id", {
        "turn_item_id": "id", "thread_id": "threadId", "position": "position", "type": "type"}),
    "subagent": ("subagents", "subagent_id", {
        "subagent_id": "id", "thread_id": "threadId", "child_thread_id": "childThreadId",
        "status": "status"}),
    "context-transfer": ("context_transfers", "context_transfer_id", {
        "context_transfer_id": "id", "thread_id": "threadId", "type": "type",
        "source_thread_id": "sourceThreadId", "target_thread_id": "targetThreadId"}),
    "context-handoff": ("context_handoffs", "context_handoff_id", {
        "context_handoff_id": "id", "thread_id": "threadId", "target_run_id": "targetRunId"}),
    "checkpoint": ("checkpoints", "checkpoint_id", {
        "checkpoint_id": "id", "thread_id": "threadId", "run_id": "runId"}),
    # A scheduled task is a stream of its own: its id is its stream key.
    "scheduled-task": ("scheduled_tasks", "scheduled_task_id", {
        "scheduled_task_id": "id", "thread_id": "id", "project_id": "projectId",
        "enabled": "enabled", "next_run_at": "nextRunAt", "deleted_at": "deletedAt"}),
    "webhook-delivery": ("webhook_deliveries", "webhook_delivery_id", {
        "webhook_delivery_id": "id", "thread_id": "taskId", "received_at": "receivedAt",
        "delivery_key": "deliveryKey", "outcome": "outcome"}),
}


def _upsert_sql(table: str, pk: str, columns: Mapping[str, str]) -> str:
    names = [*columns, "payload_json"]
    updates = ", ".join(f"{n} = excluded.{n}" for n in names if n != pk)
    return (f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))}) "
            f"ON CONFLICT ({pk}) DO UPDATE SET {updates}")


_UPSERTS = {kind: _upsert_sql(*spec) for kind, spec in _PROJECTIONS.items()}
# Per kind, each column's payload key (None where it is dotted) and the dotted key, and the
# position of thread_id among them: a commit's Python reads these rather than parsing keys.
_KEYS = {kind: [(None, key) if "." in key else (key, None) for key in columns.values()]
         for kind, (_, _, columns) in _PROJECTIONS.items()}
_THREAD_COLUMN = {kind: list(columns).index("thread_id")
                  for kind, (_, _, columns) in _PROJECTIONS.items()}


def _pluck(payload: Mapping[str, Any], dotted: str) -> Any:
    value: Any = payload
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


# Streamed text is appended, not rewritten: while a message streams, each ingest commit
# records only its new text as a TEXT_APPENDED event ({id, threadId, runId, text, updatedAt}),
# which projects nothing. The message's row keeps what it was opened with; the row and the event
# log hold the whole entity again when it closes. So the bytes written per delta do not grow
# with the message, and ``thread_entities`` adds a still-open message's appends back on load.
TEXT_APPENDED = "message-text.appended"


def event_json(row: Mapping[str, Any]) -> str:
    """A stored event (a row of ``events``) as the wire shows it, its payload as stored."""
    return (f'{{"sequence":{row["sequence"]},"eventId":{json.dumps(row["event_id"])},'
            f'"threadId":{json.dumps(row["thread_id"])},"streamVersion":{row["stream_version"]},'
            f'"commandId":{json.dumps(row["command_id"])},"type":{json.dumps(row["type"])},'
            f'"occurredAt":{json.dumps(row["occurred_at"])},"payload":{row["payload_json"]}}}')


def event_kind(event_type: str) -> str:
    """``run.updated`` -> ``run``; ``provider-turn.updated`` -> ``provider-turn``."""
    return event_type.rsplit(".", 1)[0]


# ---------------------------------------------------------------------------------------------
# Statements

_INSERT_RECEIPT = """
INSERT INTO command_receipts (command_id, command_type, fingerprint, thread_id, status,
                              result_sequence, result_json, error, accepted_at)
VALUES (?, ?, ?, ?, 'accepted', ?, ?, NULL, ?)
"""
_SELECT_RECEIPT = "SELECT * FROM command_receipts WHERE command_id = ?"
_NEXT_STREAM_VERSION = "SELECT COALESCE(MAX(stream_version) + 1, 0) FROM events WHERE thread_id = ?"
# Its sequence is the cursor's lastrowid (the rowid), read without a RETURNING row: half the cost.
_INSERT_EVENT = """
INSERT INTO events (event_id, thread_id, stream_version, command_id, type, occurred_at, payload_json)
VALUES (?, ?, ?, ?, ?, ?, ?)
"""
_MAX_SEQUENCE = "SELECT COALESCE(MAX(sequence), 0) FROM events"
_EVENT_AFTER = "SELECT 1 FROM events WHERE thread_id = ? AND sequence > ? LIMIT 1"
# Built once: json.dumps with separators builds an encoder per call. Stateless, so shared.
_compact_json = json.JSONEncoder(separators=(",", ":")).encode
_APPENDED_TEXT = f"""
SELECT json_extract(payload_json, '$.text') FROM events
WHERE type = '{TEXT_APPENDED}' AND json_extract(payload_json, '$.id') = ? ORDER BY sequence
"""
_INSERT_EFFECT = """
INSERT INTO effect_outbox (effect_id, command_id, thread_id, effect_type, payload_json, replay_safe,
                           status, attempt_count, max_attempts, available_at_ms, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)
ON CONFLICT (effect_id) DO NOTHING
"""
# The heads of outbox updates, each caller adding its WHERE: a cancelled row, or one back in
# line, holds no lease. _CANCEL takes (reason, time), _REQUEUE (when it is due, time).
_CANCEL = """UPDATE effect_outbox SET status = 'cancelled', lease_owner = NULL,
    lease_expires_ms = NULL, last_error = ?, updated_at = ?"""
_REQUEUE = """UPDATE effect_outbox SET status = 'pending', lease_owner = NULL,
    lease_expires_ms = NULL, available_at_ms = ?, updated_at = ?"""
_CANCEL_EFFECTS = f"""{_CANCEL}
WHERE thread_id = ? AND effect_type = ? AND status IN ('pending', 'running')
RETURNING effect_id
"""
# A row is claimable when it is due and pending, or running with an expired lease (its worker
# is presumed dead; the attempt number fences that worker out). At most one row per thread
# runs at a time, so a thread's provider effects happen in order. The first of each kind is
# read in index order, so a claim does not sort a backlog of pending rows.
_FIRST_CLAIMABLE = """SELECT * FROM (
    SELECT o.effect_id, o.available_at_ms, o.created_at FROM effect_outbox o WHERE {due}
      AND NOT EXISTS (SELECT 1 FROM effect_outbox r
                      WHERE r.thread_id = o.thread_id AND r.status = 'running'
                        AND r.lease_expires_ms >= :now AND r.effect_id <> o.effect_id)
    ORDER BY o.available_at_ms, o.created_at, o.effect_id LIMIT 1)"""
_CLAIM_EFFECT = f"""
UPDATE effect_outbox
SET status = 'running', attempt_count = attempt_count + 1, lease_owner = :owner,
    lease_expires_ms = :now + :lease, last_error = NULL, updated_at = :stamp
WHERE effect_id = (
    SELECT effect_id FROM (
        {_FIRST_CLAIMABLE.format(due="o.status = 'pending' AND o.available_at_ms <= :now")}
        UNION ALL
        {_FIRST_CLAIMABLE.format(due="o.status = 'running' AND o.lease_expires_ms < :now")})
    ORDER BY available_at_ms, created_at, effect_id LIMIT 1)
RETURNING *
"""
_RENEW_LEASE = """
UPDATE effect_outbox SET lease_expires_ms = ?, updated_at = ?
WHERE effect_id = ? AND status = 'running' AND lease_owner = ? AND attempt_count = ?
"""
_SETTLE_EFFECT = """
UPDATE effect_outbox
SET status = ?, available_at_ms = ?, last_error = ?, lease_owner = NULL, lease_expires_ms = NULL,
    updated_at = ?
WHERE effect_id = ? AND status = 'running' AND lease_owner = ? AND attempt_count = ?
"""
# When the worker should look again: the earliest pending row not held back by a running row of
# its thread (a settle wakes the worker for those), or the earliest lease to expire.
_NEXT_DUE = """
SELECT MIN(t) FROM (
    SELECT * FROM (SELECT o.available_at_ms AS t FROM effect_outbox o
    WHERE o.status = 'pending'
      AND NOT EXISTS (SELECT 1 FROM effect_outbox r
                      WHERE r.thread_id = o.thread_id AND r.status = 'running')
    ORDER BY o.available_at_ms LIMIT 1)
    UNION ALL
    SELECT lease_expires_ms FROM effect_outbox WHERE status = 'running')
"""
# What a list filters and orders a thread by, kept in its row: its activity time (the later of
# its updated_at and its latest run's requestedAt and completedAt), its status (its latest run's,
# or idle) and its title folded with Python's str.lower (t3_fold). Recomputed from the projection
# rows after every thread or run write, so it does not depend on the order those events arrive
# in (sql/0003 and sql/0008 backfill them with the same expressions).
_REFRESH_LISTING = """
UPDATE threads SET activity_at = COALESCE((
    SELECT MAX(threads.updated_at, COALESCE(json_extract(r.payload_json, '$.requestedAt'), ''),
               COALESCE(json_extract(r.payload_json, '$.completedAt'), ''))
    FROM runs r WHERE r.thread_id = threads.thread_id
    ORDER BY r.ordinal DESC LIMIT 1), updated_at),
  latest_status = COALESCE((SELECT r.status FROM runs r WHERE r.thread_id = threads.thread_id
                            ORDER BY r.ordinal DESC LIMIT 1), 'idle'),
  title_folded = t3_fold(json_extract(payload_json, '$.title'))
WHERE thread_id = ?
"""
# The threads of one project a list shows, newest activity first: a range of the partial index
# threads_by_activity read backwards. Each filter is off when its parameter is NULL; each reads
# the thread's own row (_REFRESH_LISTING), so a filtered list costs about what an unfiltered one
# does (the count is one pass either way; a filter that matches few makes the page read further).
# A thread is snoozed while its snoozedUntil is ahead of :now, unless it has a pending request
# or a run failed after it was snoozed (orchestrator.ThreadState.snoozed says the same).
_SNOOZED = """(COALESCE(json_extract(t.payload_json, '$.snoozedUntil') > :now, 0)
  AND NOT EXISTS (SELECT 1 FROM runtime_requests q
                  WHERE q.thread_id = t.thread_id AND q.status = 'pending')
  AND NOT EXISTS (SELECT 1 FROM runs f WHERE f.thread_id = t.thread_id AND f.status = 'failed'
                  AND json_extract(f.payload_json, '$.completedAt')
                      > json_extract(t.payload_json, '$.snoozedAt')))"""
_LISTED_THREADS = f"""
FROM threads t
WHERE t.project_id = :project AND t.deleted_at IS NULL
  AND (:archived IS NULL
       OR (json_extract(t.payload_json, '$.archivedAt') IS NOT NULL) = :archived)
  AND (:snoozed IS NULL OR {_SNOOZED} = :snoozed)
  AND (:subagents OR json_extract(t.payload_json, '$.lineage.relationshipToParent')
                     IS NOT 'subagent')
  AND (:needle IS NULL OR instr(t.title_folded, :needle) > 0)
  AND (:statuses IS NULL OR t.latest_status IN (SELECT value FROM json_each(:statuses)))
"""
_COUNT_LISTED_THREADS = "SELECT COUNT(*)" + _LISTED_THREADS
_IDS_OF_LISTED_THREADS = f"SELECT t.thread_id {_LISTED_THREADS} ORDER BY t.activity_at DESC, " \
    "t.thread_id DESC"
# One page of them; the counts and the latest run are looked up for the page's rows only.
_PAGE_OF_LISTED_THREADS = f"""
SELECT t.payload_json AS thread_json, t.activity_at,
       lr.run_id AS latest_run_id, lr.status AS latest_status,
       (SELECT COUNT(*) FROM turn_items i WHERE i.thread_id = t.thread_id) AS item_count,
       (SELECT COUNT(*) FROM runtime_requests q
        WHERE q.thread_id = t.thread_id AND q.status = 'pending') AS pending_count,
       (SELECT COUNT(*) FROM subagents s WHERE s.thread_id = t.thread_id AND s.status NOT IN
        ('completed', 'failed', 'cancelled', 'interrupted')) AS background_count,
       {_SNOOZED} AS snoozed
FROM ({_IDS_OF_LISTED_THREADS} LIMIT :limit OFFSET :offset) page
JOIN threads t ON t.thread_id = page.thread_id
LEFT JOIN runs lr ON lr.run_id = (SELECT r.run_id FROM runs r WHERE r.thread_id = t.thread_id
                                  ORDER BY r.ordinal DESC LIMIT 1)
ORDER BY t.activity_at DESC, t.thread_id DESC
"""
DELIVERIES_KEPT = 50
# Newest first by the task's own count (received_at ties under a coarse or test clock). A
# delivery that waits or runs is never pruned: it is the task's waiting line.
_NEWEST_DELIVERIES = "ORDER BY json_extract(payload_json, '$.ordinal') DESC, received_at DESC"
_PRUNE_DELIVERIES = f"""
DELETE FROM webhook_deliveries WHERE thread_id = ? AND outcome NOT IN ('queued', 'running')
  AND webhook_delivery_id NOT IN (
    SELECT webhook_delivery_id FROM webhook_deliveries WHERE thread_id = ?
    {_NEWEST_DELIVERIES} LIMIT {DELIVERIES_KEPT})
"""
# A task whose run is still running is not due: it never runs twice at once.
_DUE = """FROM scheduled_tasks
WHERE enabled = 1 AND deleted_at IS NULL AND next_run_at IS NOT NULL
  AND json_extract(payload_json, '$.lastRunStatus') != 'running'"""
_DUE_TASKS = f"SELECT payload_json {_DUE} AND next_run_at <= ? ORDER BY next_run_at"
_NEXT_DUE_TASK = f"SELECT MIN(next_run_at) {_DUE}"
_SCHEDULED_TASKS = """
SELECT payload_json FROM scheduled_tasks WHERE deleted_at IS NULL ORDER BY scheduled_task_id
"""
_DELIVERIES = f"""
SELECT payload_json FROM webhook_deliveries WHERE thread_id = ? {_NEWEST_DELIVERIES}
"""

_PENDING_REQUESTS = """
SELECT payload_json FROM runtime_requests WHERE status = 'pending'
ORDER BY json_extract(payload_json, '$.createdAt'), runtime_request_id
"""
_THREADS_TOUCHED_AFTER = """
SELECT thread_id FROM events WHERE sequence > ? GROUP BY thread_id ORDER BY MAX(sequence) DESC
LIMIT ?
"""

# What a restart must settle: threads where the old process may have had something live, or
# a queued run with nothing ahead of it. Not those of a backlog, so that a restart does not walk
# it: a run whose start (or preparation) was never claimed had nothing live, its effect just
# runs; a run waiting for an agent process slot waits on (the line of those waiting is rebuilt
# from the store: _RUNS_AWAITING_SLOT), and so do queued runs behind either.
_THREADS_NEEDING_RECOVERY = """
SELECT thread_id FROM runs r WHERE status = 'running' OR status IN ('preparing', 'starting')
  AND NOT EXISTS (SELECT 1 FROM effect_outbox o WHERE o.thread_id = r.thread_id
    AND o.status = 'pending' AND o.attempt_count = 0
    AND o.effect_type IN ('provider-turn.start', 'workspace.prepare')
    AND json_extract(o.payload_json, '$.runId') = r.run_id)
UNION SELECT thread_id FROM runs q WHERE status = 'queued' AND NOT EXISTS (
  SELECT 1 FROM runs b WHERE b.thread_id = q.thread_id
    AND (b.status IN ('preparing', 'starting', 'running', 'waiting')
         OR json_extract(b.payload_json, '$.awaitingAgentSlot')))
UNION SELECT thread_id FROM provider_sessions WHERE status NOT IN ('stopped', 'error')
UNION SELECT thread_id FROM runtime_requests WHERE status = 'pending'
"""
_RUNS_AWAITING_SLOT = """
SELECT thread_id, run_id, json_extract(payload_json, '$.activeAttemptId') FROM runs
WHERE status = 'queued' AND json_extract(payload_json, '$.awaitingAgentSlot')
ORDER BY json_extract(payload_json, '$.requestedAt'), rowid
"""


# ---------------------------------------------------------------------------------------------
# Connections and schema


def connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    """The one place connection policy is set. ``isolation_level=None``: we issue BEGIN ourselves."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
    conn.row_factory = sqlite3.Row
    # Before WAL, which fixes it: a new database gets 1 KB pages (an existing one keeps its own).
    # A commit writes each page it touched whole, to the WAL and again at checkpoint, mostly
    # B-tree pages of which it changed a few bytes: a long streamed answer writes a quarter less
    # (bench P10), for reads about a fifth slower in CPU (more pages per row and per scan).
    conn.execute("PRAGMA page_size = 1024")
    conn.execute("PRAGMA journal_mode = WAL")
    # FULL: an acknowledged command is a promise; WAL+NORMAL can lose the last commits on power loss.
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA busy_timeout = 5000")
    add_functions(conn)
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    return conn


def add_functions(conn: sqlite3.Connection) -> None:
    """The SQL functions projection writes use (any connection that writes projections)."""
    conn.create_function("t3_fold", 1, _fold, deterministic=True)


def _fold(text: Any) -> str:
    """A title as lists match it: Python's str.lower (SQLite's lower() is ASCII-only)."""
    return text.lower() if isinstance(text, str) else ""


@contextmanager
def _transaction(conn: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE"
                 ) -> Iterator[sqlite3.Connection]:
    # BEGIN IMMEDIATE takes the write lock up front: a deferred transaction that reads then
    # writes can fail with SQLITE_BUSY at once in WAL mode instead of waiting out busy_timeout.
    conn.execute(begin)
    try:
        yield conn
    except BaseException:
        # SQLITE_FULL / IOERR may already have rolled back; ROLLBACK then raises, and that
        # error must not hide the original one.
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise
    conn.execute("COMMIT")


@contextmanager
def _snapshot(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A read transaction: every statement in it sees the same committed state."""
    conn.execute("BEGIN")
    try:
        yield conn
    finally:
        conn.execute("COMMIT")


_SCHEMA_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def schema_files(sql_dir: Path = SQL_DIR) -> list[tuple[int, Path]]:
    files = []
    for path in sorted(sql_dir.glob("*.sql")):
        match = _SCHEMA_NAME.match(path.name)
        if not match:
            raise StoreError(f"schema file {path.name} is not named NNNN_lower_snake.sql")
        files.append((int(match.group(1)), path))
    versions = [v for v, _ in files]
    if versions != list(range(1, len(versions) + 1)):
        raise StoreError(f"schema files in {sql_dir} must be numbered 0001, 0002, ... without gaps")
    return files


def _statements(script: str) -> Iterator[str]:
    """Split a schema file into statements at each ';' that completes one."""
    start = 0
    for end, char in enumerate(script):
        if char == ";" and sqlite3.complete_statement(script[start:end + 1]):
            statement = script[start:end + 1].strip()
            start = end + 1
            if _has_code(statement):
                yield statement
    if _has_code(script[start:]):
        raise StoreError("schema file ends with an incomplete statement")


def _has_code(text: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in text.splitlines())


def apply_migrations(path: Path, *, backups_dir: Path, sql_dir: Path = SQL_DIR,
                     stop_after: int | None = None) -> int:
    """Bring the database at ``path`` to the newest schema (or ``stop_after``); return its version."""
    files = schema_files(sql_dir)
    latest = files[-1][0] if files else 0
    if path.exists():
        # Look before touching anything: opening in WAL mode would already modify a newer file.
        with closing(sqlite3.connect(_readonly_uri(path), uri=True)) as probe:
            current = probe.execute("PRAGMA user_version").fetchone()[0]
            has_schema = probe.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] > 0
        if current > latest:
            raise DatabaseTooNew(f"{path} has schema version {current}, newer than this t3 "
                                 f"(knows {latest}); it was left untouched")
        if has_schema and current < min(latest, stop_after or latest):
            _backup(path, backups_dir, current)
    with closing(connect(path)) as conn:
        current = int(conn.execute("PRAGMA user_version").fetchone()[0])
        for version, file in files:
            if version <= current or (stop_after is not None and version > stop_after):
                continue
            try:
                with _transaction(conn):
                    for statement in _statements(file.read_text()):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {version:d}")
            except sqlite3.Error as exc:
                raise StoreError(f"schema file {file.name} failed: {exc}") from exc
            log.info("applied schema %s", file.name)
            current = version
        return current


def _readonly_uri(path: Path) -> str:
    return Path(path).resolve().as_uri() + "?mode=ro"  # as_uri escapes '#', '?' and '%'


def _backup(path: Path, backups_dir: Path, version: int) -> None:
    backups_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = backups_dir / f"t3-v{version}-{stamp}.sqlite"
    temp = target.with_suffix(".sqlite.tmp")
    with closing(sqlite3.connect(_readonly_uri(path), uri=True)) as source, \
            closing(sqlite3.connect(temp)) as dest:
        source.backup(dest)
    os.replace(temp, target)
    log.info("backed up schema v%d database to %s before migrating", version, target)


class Engine(Protocol):
    """Where a Store keeps its data. ``migrate`` brings the schema up to date (before any
    ``connect``); ``connect`` opens the writer's connection, or with ``readonly`` the readers'.
    A connection answers the sqlite3 calls the Store makes: ``execute`` (a cursor with
    ``fetchone``, ``fetchall``, iteration, ``rowcount``, ``lastrowid``), ``in_transaction``,
    ``close``. ``outbox_apart``: whether the outbox's jobs may commit beside event commits, on a
    connection of their own (then ``BEGIN`` with ``_BEGIN_OUTBOX`` serializes them)."""

    outbox_apart: bool

    def migrate(self) -> int: ...

    def connect(self, *, readonly: bool = False) -> sqlite3.Connection: ...


class SqliteEngine:
    """The default: one SQLite file, copied into ``backups_dir`` before a migration."""

    outbox_apart = False  # one writer at a time: a second would wait on the first
    def __init__(self, path: Path, *, backups_dir: Path) -> None:
        self.path, self.backups_dir = path, backups_dir

    def migrate(self) -> int:
        return apply_migrations(self.path, backups_dir=self.backups_dir)

    def connect(self, *, readonly: bool = False) -> sqlite3.Connection:
        conn = connect(self.path, readonly=readonly)
        if _MAX_PAGE_COUNT is not None and not readonly:  # test hook: a full disk
            conn.execute(f"PRAGMA max_page_count = {int(_MAX_PAGE_COUNT):d}")
        return conn


# ---------------------------------------------------------------------------------------------
# The store


def _now_iso() -> str:
    global _SECOND
    second, ms = divmod(int(time.time() * 1000), 1000)  # one reading: two could straddle a second
    formatted = _SECOND  # one read: the writer thread and the event loop both call this
    if formatted[0] != second:  # strftime costs more than the rest of a small commit's Python
        formatted = _SECOND = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{formatted[1]}.{ms:03d}Z"


_SECOND: tuple[int, str] = (-1, "")  # the last second _now_iso formatted, and its text


_STOP = object()
# The outbox writer's BEGIN: used only where the engine keeps outbox jobs apart (its form there).
_BEGIN_OUTBOX = "BEGIN IMMEDIATE -- the effect outbox"
_MAX_BATCH = 256  # jobs sharing one transaction at most
_Job = tuple[Callable[[sqlite3.Connection], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]
_Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


def _answer(outcomes: list[_Outcome]) -> None:
    """On the waiting loop: each caller's result or error (a caller gone by now is skipped)."""
    for future, result, exc in outcomes:
        if future.done():
            continue
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(_translate(exc))


class _Writer:
    """A connection and the thread that writes through it. Group commit: every job queued while
    the previous transaction was committing goes into the next one, so they share one fsync. Each
    event loop that is waiting is woken once per transaction, with all its answers."""

    def __init__(self, conn: sqlite3.Connection, begin: str, name: str) -> None:
        self.conn, self._begin = conn, begin
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while len(jobs) < _MAX_BATCH:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            live = [job for job in jobs if job is not _STOP]
            outcomes = self._run(live)
            by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
            for outcome, (_, loop, _) in zip(outcomes, live, strict=True):
                by_loop.setdefault(loop, []).append(outcome)
            for loop, answers in by_loop.items():
                with suppress(RuntimeError):  # that loop is closed: nobody waits
                    loop.call_soon_threadsafe(_answer, answers)
            if _STOP in jobs:
                break
        self.conn.close()

    def _run(self, jobs: list[_Job]) -> list[_Outcome]:
        return self._run_batch(jobs) if len(jobs) > 1 else self._run_alone(*jobs[0]) if jobs else []

    def _run_alone(self, fn: Callable[[sqlite3.Connection], Any], loop: Any, future: Any
                   ) -> list[_Outcome]:
        try:
            with _transaction(self.conn, self._begin) as conn:
                return [(future, fn(conn), None)]
        except BaseException as exc:  # handed to the awaiting caller, not swallowed
            return [(future, None, exc)]

    def _run_batch(self, jobs: list[_Job]) -> list[_Outcome]:
        """The jobs in one transaction; callers are answered after the COMMIT. A job that fails
        rolls the whole transaction back and the others run again without it, so it leaves
        nothing of its own and costs them nothing (failures are rare: a rerun then is cheaper
        than a savepoint around every job). If the transaction itself is lost (a failed COMMIT,
        or SQLite rolling back everything on SQLITE_FULL or an I/O error), each job runs again
        alone, so each caller gets its own outcome."""
        conn = self.conn
        outcomes: list[_Outcome] = []
        failed: _Outcome | None = None
        try:
            with _transaction(conn, self._begin):
                for fn, _, future in jobs:
                    try:
                        outcomes.append((future, fn(conn), None))
                    except Exception as exc:
                        if conn.in_transaction:  # only this job failed
                            failed = (future, None, exc)
                        raise
                    if not conn.in_transaction:
                        raise StoreError("a job ended the shared transaction")
        except Exception:
            if failed is None:
                return [outcome for job in jobs for outcome in self._run_alone(*job)]
            at = len(outcomes)
            others = self._run(jobs[:at] + jobs[at + 1:])
            return [*others[:at], failed, *others[at:]]
        return outcomes

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, loop, future))
        return await future

    def stop(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)


class Store:
    """The database of one t3 data directory: ``Store(path, backups_dir=...)`` (SQLite) or
    ``Store(engine)``, then ``close()``."""

    def __init__(self, where: Path | Engine, *, backups_dir: Path | None = None) -> None:
        self.path: Path | None = None  # the SQLite file, if that is the engine
        if isinstance(where, (str, os.PathLike)):
            if backups_dir is None:
                raise ValueError("a database file needs backups_dir")
            self.path = Path(where)
            where = SqliteEngine(self.path, backups_dir=backups_dir)
        elif backups_dir is not None:
            raise ValueError("an engine keeps its own backups (or none)")
        self.engine: Engine = where
        self.engine.migrate()
        self._reader = self.engine.connect(readonly=True)
        self._closed = False
        self._writer = _Writer(self.engine.connect(), "BEGIN IMMEDIATE", "t3-store-writer")
        # An engine whose outbox rows lock apart from event commits (store_pg.py: one node
        # claims while another commits) gives the outbox jobs a writer of their own.
        self._outbox = _Writer(self.engine.connect(), _BEGIN_OUTBOX, "t3-outbox-writer") \
            if self.engine.outbox_apart else self._writer

    # -- writing ---------------------------------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T], *, outbox: bool = False) -> T:
        """Run ``fn(conn)`` in a BEGIN IMMEDIATE transaction on the writer thread (shared with
        other jobs queued meanwhile); return once it committed. Once queued, the write happens:
        a caller cancelled meanwhile stops waiting, and the writer skips its answer. ``outbox``:
        a job that writes only effect_outbox rows (and, clustered, thread_holders)."""
        if self._closed:
            raise StoreError("the store is closed")
        return await (self._outbox if outbox else self._writer).write(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for writer in {self._writer, self._outbox}:
            writer.stop()
        self._reader.close()

    # -- commands ------------------------------------------------------------------------------

    async def commit(self, commit: Commit) -> CommitResult:
        return await self.write(lambda conn: _commit(conn, commit))

    def receipt(self, command_id: str) -> Receipt | None:
        row = self._reader.execute(_SELECT_RECEIPT, (command_id,)).fetchone()
        return _receipt_from_row(row) if row else None

    # -- reads -----------------------------------------------------------------------------------

    def read(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[sqlite3.Row]:
        try:
            return self._reader.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"database error: {exc}") from exc

    def thread_entities(self, thread_id: str) -> tuple[int, dict[str, list[dict[str, Any]]]]:
        """Every projected entity of one thread and the sequence it reflects, in one snapshot."""
        entities: dict[str, list[dict[str, Any]]] = {}
        with _snapshot(self._reader) as conn:
            for kind, (table, _, _) in _PROJECTIONS.items():
                rows = conn.execute(f"SELECT payload_json FROM {table} WHERE thread_id = ?",
                                    (thread_id,)).fetchall()
                entities[kind] = [json.loads(r[0]) for r in rows]
            for message in entities["message"]:
                if message.get("streaming"):  # opened whole, then only appended to
                    message["text"] += "".join(
                        r[0] for r in conn.execute(_APPENDED_TEXT, (message["id"],)))
            sequence = conn.execute(_MAX_SEQUENCE).fetchone()[0]
        return sequence, entities

    def list_threads(self, project_id: str, *, statuses: Sequence[str] = (),
                     title_contains: str = "", include_subagents: bool = True, offset: int = 0,
                     limit: int = 50, archived: bool | None = False, snoozed: bool | None = None,
                     now: str | None = None) -> tuple[int, list[dict[str, Any]]]:
        """How many of a project's threads match, and the page of them from ``offset``, newest
        activity first (read in one snapshot). Empty ``statuses`` / ``title_contains`` and
        ``archived`` / ``snoozed`` None match all; a thread without runs has status ``idle``;
        ``now`` (default: the wall clock) decides what is snoozed."""
        params = {"project": project_id, "subagents": include_subagents, "archived": archived,
                  "snoozed": snoozed, "now": now or _now_iso(),
                  "needle": title_contains.lower() or None,
                  "statuses": json.dumps(sorted(statuses)) if statuses else None,
                  "offset": offset, "limit": limit}
        try:
            with _snapshot(self._reader) as conn:
                # The count passes over them all; the page is a range of the index, read until
                # it holds `limit` matches (none is read once the offset is past the count).
                total = conn.execute(_COUNT_LISTED_THREADS, params).fetchone()[0]
                params["offset"] = min(offset, total)  # a cursor may be too big for SQLite
                rows = conn.execute(_PAGE_OF_LISTED_THREADS, params).fetchall() \
                    if offset < total else []
        except sqlite3.Error as exc:
            raise StoreError(f"database error: {exc}") from exc
        return total, [{"thread": json.loads(r["thread_json"]), "latestRunId": r["latest_run_id"],
                        "status": r["latest_status"] or "idle", "updatedAt": r["activity_at"],
                        "itemCount": r["item_count"], "pendingRequestCount": r["pending_count"],
                        "pendingBackgroundTasks": r["background_count"],
                        "snoozed": bool(r["snoozed"])}
                       for r in rows]

    def moved_on(self, thread_id: str, sequence: int) -> bool:
        """Whether the thread has events after ``sequence`` (another process's, cluster.py)."""
        return self._reader.execute(_EVENT_AFTER, (thread_id, sequence)).fetchone() is not None

    def max_sequence(self) -> int:
        return int(self._reader.execute(_MAX_SEQUENCE).fetchone()[0])

    def events_after(self, sequence: int, *, thread_id: str | None = None,
                     limit: int = 1000) -> list[dict[str, Any]]:
        if thread_id is None:
            rows = self.read("SELECT * FROM events WHERE sequence > ? ORDER BY sequence LIMIT ?",
                             (sequence, limit))
        else:
            rows = self.read("SELECT * FROM events WHERE thread_id = ? AND sequence > ? "
                             "ORDER BY sequence LIMIT ?", (thread_id, sequence, limit))
        return [{"sequence": r["sequence"], "eventId": r["event_id"], "threadId": r["thread_id"],
                 "streamVersion": r["stream_version"], "commandId": r["command_id"],
                 "type": r["type"], "occurredAt": r["occurred_at"],
                 "payload": json.loads(r["payload_json"])} for r in rows]

    def pending_requests(self) -> list[dict[str, Any]]:
        """Every pending runtime request (its entity), oldest first."""
        return [json.loads(r[0]) for r in self.read(_PENDING_REQUESTS)]

    def scheduled_tasks(self) -> list[dict[str, Any]]:
        """Every scheduled task that is not deleted (its entity)."""
        return [json.loads(r[0]) for r in self.read(_SCHEDULED_TASKS)]

    def due_tasks(self, now_iso: str) -> list[dict[str, Any]]:
        """Enabled tasks whose next run is due at ``now_iso``, soonest first."""
        return [json.loads(r[0]) for r in self.read(_DUE_TASKS, (now_iso,))]

    def next_due_at(self) -> str | None:
        """When the next enabled task is due (an ISO time), if any."""
        return self.read(_NEXT_DUE_TASK)[0][0]

    def deliveries(self, task_id: str) -> list[dict[str, Any]]:
        """A webhook task's kept deliveries, newest first."""
        return [json.loads(r[0]) for r in self.read(_DELIVERIES, (task_id,))]

    def threads_touched_after(self, sequence: int, *, limit: int) -> list[str]:
        """Threads with events after ``sequence``, most recently touched first."""
        return [r[0] for r in self.read(_THREADS_TOUCHED_AFTER, (sequence, limit))]

    # -- server facts and projects (configuration, not events) -----------------------------------

    async def meta(self, key: str, default: str) -> str:
        """The stored value of ``key``, storing ``default`` first if there is none."""
        def run(conn: sqlite3.Connection) -> str:
            conn.execute("INSERT INTO server_meta (key, value) VALUES (?, ?) "
                         "ON CONFLICT (key) DO NOTHING", (key, default))
            return str(conn.execute("SELECT value FROM server_meta WHERE key = ?",
                                    (key,)).fetchone()[0])
        return await self.write(run)

    async def sync_projects(self, projects: Sequence[Mapping[str, str]]) -> None:
        def run(conn: sqlite3.Connection) -> None:
            for p in projects:
                conn.execute("INSERT INTO projects (project_id, path, title) VALUES (?, ?, ?) "
                             "ON CONFLICT (project_id) DO UPDATE SET path = excluded.path, "
                             "title = excluded.title", (p["id"], p["path"], p["title"]))
        await self.write(run)

    # -- the effect outbox -----------------------------------------------------------------------

    async def claim_effect(self, *, owner: str, now_ms: int, lease_ms: int) -> EffectRow | None:
        params = {"owner": owner, "now": now_ms, "lease": lease_ms, "stamp": _now_iso()}

        def run(conn: sqlite3.Connection) -> EffectRow | None:
            row = conn.execute(_CLAIM_EFFECT, params).fetchone()
            return _effect_from_row(row) if row else None
        return await self.write(run, outbox=True)

    async def renew_lease(self, effect: EffectRow, *, owner: str, until_ms: int) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            return conn.execute(_RENEW_LEASE, (until_ms, _now_iso(), effect.effect_id, owner,
                                               effect.attempt_count)).rowcount == 1
        return await self.write(run, outbox=True)

    async def settle_effect(self, effect: EffectRow, *, owner: str, status: str,
                            error: str | None = None, retry_at_ms: int = 0) -> bool:
        """Finish a claimed row. False when this worker no longer holds it (fenced out)."""
        if status not in ("pending", "succeeded", "failed", "cancelled"):
            raise ValueError(f"cannot settle an effect as {status!r}")

        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(_SETTLE_EFFECT, (status, retry_at_ms, error, _now_iso(),
                                                effect.effect_id, owner, effect.attempt_count))
            return cur.rowcount == 1
        return await self.write(run, outbox=True)

    def next_effect_due_ms(self, owner: str = "") -> int | None:
        due = self._reader.execute(_NEXT_DUE, {"owner": owner}).fetchone()[0]
        return None if due is None else int(due)

    def pending_effects(self, thread_id: str) -> list[EffectRow]:
        return [_effect_from_row(r) for r in self._reader.execute(
            "SELECT * FROM effect_outbox WHERE thread_id = ? AND status = 'pending'",
            (thread_id,))]

    def threads_needing_recovery(self) -> list[str]:
        return [r[0] for r in self._reader.execute(_THREADS_NEEDING_RECOVERY)]

    def runs_awaiting_slot(self) -> list[tuple[str, str, str]]:
        """(thread id, run id, attempt id) of the runs waiting for an agent process slot, in
        the order they were requested."""
        return [(r[0], r[1], r[2]) for r in self._reader.execute(_RUNS_AWAITING_SLOT)]

    def effect(self, effect_id: str) -> EffectRow | None:
        row = self._reader.execute("SELECT * FROM effect_outbox WHERE effect_id = ?",
                                   (effect_id,)).fetchone()
        return _effect_from_row(row) if row else None

    async def recover_outbox(self, *, reason: str, now_ms: int, node: str | None = None
                             ) -> tuple[list[EffectRow], int]:
        """After a lost process: cancel process-bound rows that had started, requeue the rest
        (``node``: only the rows that node leased or whose thread it held, cluster.py).

        A process-bound row that never ran (attempt_count 0) touched nothing and stays pending.
        Returns the cancelled rows and the number of requeued rows.
        """
        mine = "" if node is None else " AND (lease_owner = ? OR thread_id IN (SELECT " \
            "thread_id FROM thread_holders WHERE node_id = ?))"
        of = () if node is None else (node, node)

        def run(conn: sqlite3.Connection) -> tuple[list[EffectRow], int]:
            stamp = _now_iso()
            cancelled = conn.execute(
                f"{_CANCEL} WHERE replay_safe = 0 AND (status = 'running' OR "
                f"(status = 'pending' AND attempt_count > 0)){mine} RETURNING *",
                (reason, stamp, *of)).fetchall()
            requeued = conn.execute(f"{_REQUEUE} WHERE status = 'running'{mine}",
                                    (now_ms, stamp, *of)).rowcount
            return [_effect_from_row(r) for r in cancelled], requeued
        return await self.write(run, outbox=True)

    async def release_leases(self, *, owner: str, reason: str, now_ms: int) -> int:
        """At shutdown: replay-safe rows go back to pending; process-bound ones are cancelled."""
        def run(conn: sqlite3.Connection) -> int:
            stamp = _now_iso()
            n = conn.execute(f"{_REQUEUE}, attempt_count = attempt_count - 1 "
                             "WHERE status = 'running' AND lease_owner = ? AND replay_safe = 1",
                             (now_ms, stamp, owner)).rowcount
            n += conn.execute(f"{_CANCEL} WHERE status = 'running' AND lease_owner = ?",
                              (reason, stamp, owner)).rowcount
            return n
        return await self.write(run, outbox=True)


def _translate(exc: BaseException) -> BaseException:
    if isinstance(exc, sqlite3.Error):
        err = StoreError(f"database error: {exc}")
        err.__cause__ = exc
        return err
    return exc


def _commit(conn: sqlite3.Connection, commit: Commit) -> CommitResult:
    # A connection that can (store_pg's) sends the statements whose answers are not read without
    # waiting for each: a commit's many writes, one round trip.
    with getattr(conn, "pipelined", nullcontext)():
        return _commit_now(conn, commit)


def _commit_now(conn: sqlite3.Connection, commit: Commit) -> CommitResult:
    # The receipt is looked up first and written last, once, with its result sequence: the write
    # lock is held since BEGIN IMMEDIATE, so nothing can insert the same command id in between.
    row = conn.execute(_SELECT_RECEIPT, (commit.command_id,)).fetchone()
    if row is not None:
        existing = _receipt_from_row(row)
        if existing.fingerprint != commit.fingerprint:
            raise FingerprintMismatch(
                f"command id {commit.command_id!r} was already used for a different request")
        return CommitResult(committed=False, receipt=existing)
    if commit.base is not None and conn.execute(_EVENT_AFTER, commit.base).fetchone():
        raise StaleState(f"thread {commit.base[0]} moved on after sequence {commit.base[1]}")
    stamp = _now_iso()
    sequences: list[int] = []
    stream_versions: list[int] = []
    payloads_json: list[str] = []
    next_versions: dict[str, int] = {}
    for event in commit.events:
        version = next_versions.get(event.thread_id)
        if version is None:
            version = conn.execute(_NEXT_STREAM_VERSION, (event.thread_id,)).fetchone()[0]
        next_versions[event.thread_id] = version + 1
        payload_json = _compact_json(event.payload)
        sequences.append(conn.execute(_INSERT_EVENT, (
            event.event_id, event.thread_id, version, commit.command_id, event.type,
            event.occurred_at, payload_json)).lastrowid)
        stream_versions.append(version)
        payloads_json.append(payload_json)
        _project(conn, event.type, event.payload, payload_json)
    crash_point("commit:after-events")
    cancelled: list[str] = []
    for effect_type in commit.cancel_effect_types:
        cancelled += [r[0] for r in conn.execute(_CANCEL_EFFECTS, (
            f"cancelled by command {commit.command_id}", stamp, commit.thread_id, effect_type))]
    now_ms = int(time.time() * 1000)
    for effect in commit.effects:
        conn.execute(_INSERT_EFFECT, (
            effect.effect_id, commit.command_id, effect.thread_id, effect.effect_type,
            _compact_json(effect.payload), int(effect.replay_safe),
            effect.max_attempts, now_ms, stamp, stamp))
    crash_point("commit:after-outbox")
    result_sequence = sequences[-1] if sequences else conn.execute(_MAX_SEQUENCE).fetchone()[0]
    conn.execute(_INSERT_RECEIPT, (
        commit.command_id, commit.command_type, commit.fingerprint, commit.thread_id,
        result_sequence, _compact_json(commit.result), stamp))
    crash_point("commit:after-receipt")
    receipt = Receipt(commit.command_id, commit.command_type, commit.fingerprint, commit.thread_id,
                      "accepted", result_sequence, commit.result)
    return CommitResult(committed=True, receipt=receipt, sequences=sequences,
                        cancelled_effect_ids=cancelled, stream_versions=stream_versions,
                        payloads_json=payloads_json)


def _project(conn: sqlite3.Connection, event_type: str, payload: Mapping[str, Any],
             payload_json: str) -> None:
    for sql, params in projection_writes(event_type, payload, payload_json):
        conn.execute(sql, params)


def projection_writes(event_type: str, payload: Mapping[str, Any], payload_json: str
                      ) -> list[tuple[str, tuple[Any, ...]]]:
    """The statements (and parameters) that project one event: its entity's upsert, then for a
    thread or a run the refresh of the thread's activity time; none for appended text."""
    if event_type == TEXT_APPENDED:
        return []
    kind = event_kind(event_type)
    keys = _KEYS.get(kind)
    if keys is None:
        raise StoreError(f"no projection for event type {event_type!r}")
    values = [payload.get(key) if key else _pluck(payload, dotted) for key, dotted in keys]
    writes: list[tuple[str, tuple[Any, ...]]] = [(_UPSERTS[kind], (*values, payload_json))]
    if kind in ("thread", "run"):
        writes.append((_REFRESH_LISTING, (values[_THREAD_COLUMN[kind]],)))
    if kind == "webhook-delivery":  # a hook's log keeps its newest deliveries only
        writes.append((_PRUNE_DELIVERIES, (payload["taskId"], payload["taskId"])))
    return writes


def rebuild_projections(conn: sqlite3.Connection) -> None:
    """Replay the whole event log into empty projection tables (used by replay-equivalence tests)."""
    for table, _, _ in _PROJECTIONS.values():
        conn.execute(f"DELETE FROM {table}")
    for row in conn.execute("SELECT type, payload_json FROM events ORDER BY sequence").fetchall():
        _project(conn, row[0], json.loads(row[1]), row[1])
