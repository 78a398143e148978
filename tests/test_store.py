"""Store-level tests for store.py: schema application, backups, pragmas, commit, outbox, replay,
listing.

Every test works on real SQLite files under `tmp_path` and talks to `store.py` directly; no t3
server is started. The tests of `st` (and `stores`) are the store's contract: they run once on
SQLite and once on a real PostgreSQL database through store_pg.py (the `postgres` tier, skipped
saying why without a server). The store's async API is driven with `asyncio.run` through `_run`.
Lease expiry is simulated with explicit `now_ms` values, never by waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` run without `python -m` does not put the repo on the path
    sys.path.insert(0, str(_ROOT))

import store  # noqa: E402
from store import Commit, EffectRow, NewEffect, NewEvent, Store  # noqa: E402

T = TypeVar("T")
REAL_SQL_FILES = sorted(p for p in store.SQL_DIR.iterdir() if re.match(r"^\d{4}_.*\.sql$", p.name))
STAMP = "2025-01-01T00:00:00.000Z"
LEASE_MS = 1_000

# A synthetic second schema file: a new table, an index on it, and a column added to a table of
# 0001 (ALTER TABLE rewrites the stored CREATE TABLE text, which the comparison must also match).
EXTRA_SQL = """\
-- test-only schema step
CREATE TABLE test_extra (
    extra_id   TEXT PRIMARY KEY,
    thread_id  TEXT NOT NULL,
    note       TEXT
);
CREATE INDEX test_extra_by_thread ON test_extra (thread_id);

ALTER TABLE projects ADD COLUMN archived_at TEXT;
"""


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """`open_store(path=None)` -> a Store on `<tmp>/t3.sqlite`; every store is closed at teardown."""
    opened: list[Store] = []

    def make(path: Path | None = None) -> Store:
        s = Store(path or tmp_path / "t3.sqlite", backups_dir=tmp_path / "backups")
        opened.append(s)
        return s

    yield make
    for s in reversed(opened):
        s.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stores(request: pytest.FixtureRequest, open_store: Callable[..., Store]
           ) -> Iterator[Callable[[], Store]]:
    """`stores()` -> a new Store on the test's one database: `<tmp>/t3.sqlite`, or a new
    PostgreSQL database (as another node would open it); every store is closed at teardown."""
    if request.param == "sqlite":
        yield open_store
        return
    yield from pg_stores_on(request.getfixturevalue("postgres_url"))


def pg_stores_on(url: str) -> Iterator[Callable[[], Store]]:
    """For a fixture: `make()` -> a new Store (a node) on the PostgreSQL database at `url`;
    every one closed at teardown."""
    import store_pg
    opened: list[Store] = []

    def make() -> Store:
        opened.append(Store(store_pg.PostgresEngine(url)))
        return opened[-1]

    yield make
    for s in reversed(opened):
        s.close()


@pytest.fixture
def st(stores: Callable[[], Store]) -> Store:
    return stores()


@pytest.fixture
def sql_dir(tmp_path: Path) -> Path:
    """A schema directory: a copy of the real 0001 plus the synthetic 0002_test_extra.sql."""
    d = tmp_path / "sql"
    d.mkdir()
    shutil.copy(REAL_SQL_FILES[0], d / REAL_SQL_FILES[0].name)
    (d / "0002_test_extra.sql").write_text(EXTRA_SQL)
    return d


# ---------------------------------------------------------------------------------------------
# Helpers


def _schema(path: Path) -> tuple[int, list[tuple[str, str, str, str | None]]]:
    with closing(sqlite3.connect(path)) as conn:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    return version, sorted((t, n, tbl, " ".join(sql.split()) if sql else None)
                           for t, n, tbl, sql in rows)


def _user_version(path: Path) -> int:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute("PRAGMA user_version").fetchone()[0]


def _thread(tid: str, *, project: str = "proj", updated: str = STAMP, parent: str | None = None,
            title: str = "t") -> dict[str, Any]:
    return {"id": tid, "projectId": project, "title": title,
            "lineage": {"parentThreadId": parent, "rootThreadId": parent or tid},
            "createdAt": STAMP, "updatedAt": updated, "deletedAt": None}


def _run_entity(rid: str, tid: str, ordinal: int, status: str) -> dict[str, Any]:
    return {"id": rid, "threadId": tid, "ordinal": ordinal, "status": status, "requestedAt": STAMP}


def _event(event_id: str, tid: str, type_: str, payload: dict[str, Any]) -> NewEvent:
    return NewEvent(event_id=event_id, thread_id=tid, type=type_, occurred_at=STAMP, payload=payload)


def _effect(effect_id: str, tid: str, effect_type: str = "provider-turn.start", *,
            replay_safe: bool = False) -> NewEffect:
    return NewEffect(effect_id=effect_id, thread_id=tid, effect_type=effect_type,
                     payload={"effectId": effect_id}, replay_safe=replay_safe)


def _commit(command_id: str, tid: str | None, events: Sequence[NewEvent] = (),
            effects: Sequence[NewEffect] = (), *, fingerprint: str | None = None,
            result: dict[str, Any] | None = None, cancel: Sequence[str] = ()) -> Commit:
    return Commit(command_id=command_id, command_type="test.command",
                  fingerprint=fingerprint or f"fp-{command_id}", thread_id=tid, events=events,
                  effects=effects, result=result or {"ok": command_id}, cancel_effect_types=cancel)


def _add_effects(s: Store, *effects: NewEffect) -> int:
    """Commit outbox rows (no events); return the latest `available_at_ms` they got."""
    _run(s.commit(_commit(f"cmd-{effects[0].effect_id}", effects[0].thread_id, effects=effects)))
    return max(_effect_row(s, e.effect_id).available_at_ms for e in effects)


def _effect_row(s: Store, effect_id: str) -> EffectRow:
    row = s.effect(effect_id)
    assert row is not None, effect_id
    return row


def _claim(s: Store, owner: str, now_ms: int, lease_ms: int = LEASE_MS) -> EffectRow | None:
    return _run(s.claim_effect(owner=owner, now_ms=now_ms, lease_ms=lease_ms))


def _count(s: Store, table: str) -> int:
    return s.read(f"SELECT COUNT(*) FROM {table}")[0][0]


PROJECTION_TABLES = [table for table, _, _ in store._PROJECTIONS.values()]
TABLES_SINCE_0004 = ("scheduled_tasks", "webhook_deliveries", "context_handoffs",
                     "checkpoints")


def _tables(conn: sqlite3.Connection | Store, tables: Sequence[str]
            ) -> dict[str, list[tuple[Any, ...]]]:
    """Each table's rows, sorted. Not PostgreSQL's runs.row_order: it stands for SQLite's rowid
    (which SELECT * leaves out), the order rows were first written, numbered afresh by a rebuild."""
    read = conn.read if isinstance(conn, Store) else lambda sql: conn.execute(sql).fetchall()
    return {t: sorted(tuple(v for k, v in zip(r.keys(), r, strict=True) if k != "row_order")
                      for r in read(f"SELECT * FROM {t}")) for t in tables}


# ---------------------------------------------------------------------------------------------
# Schema application


def test_migrating_file_by_file_equals_applying_all_files_fresh(tmp_path: Path, sql_dir: Path) -> None:
    """Applying 0001 then 0002 in two runs gives the same schema and user_version as one run."""
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    assert store.apply_migrations(a, backups_dir=tmp_path / "bk-a", sql_dir=sql_dir, stop_after=1) == 1
    assert _user_version(a) == 1
    assert store.apply_migrations(a, backups_dir=tmp_path / "bk-a", sql_dir=sql_dir) == 2
    assert store.apply_migrations(b, backups_dir=tmp_path / "bk-b", sql_dir=sql_dir) == 2

    version_a, schema_a = _schema(a)
    version_b, schema_b = _schema(b)
    assert version_a == version_b == 2
    assert schema_a == schema_b
    names = {name for _, name, _, _ in schema_b}
    assert {"test_extra", "test_extra_by_thread", "events", "effect_outbox"} <= names
    assert any("archived_at" in (sql or "") for _, name, _, sql in schema_b if name == "projects")


def test_fresh_database_reaches_the_number_of_real_schema_files(tmp_path: Path) -> None:
    """With the shipped sql/ files, a fresh database ends at user_version == their count."""
    path = tmp_path / "t3.sqlite"
    assert store.apply_migrations(path, backups_dir=tmp_path / "backups") == len(REAL_SQL_FILES)
    assert _user_version(path) == len(REAL_SQL_FILES)
    assert [v for v, _ in store.schema_files()] == list(range(1, len(REAL_SQL_FILES) + 1))


def test_applying_migrations_to_a_current_database_changes_nothing(tmp_path: Path, sql_dir: Path) -> None:
    """A second apply on an up-to-date database keeps its schema and writes no backup."""
    path = tmp_path / "t3.sqlite"
    store.apply_migrations(path, backups_dir=tmp_path / "backups", sql_dir=sql_dir)
    before = _schema(path)
    assert store.apply_migrations(path, backups_dir=tmp_path / "backups", sql_dir=sql_dir) == 2
    assert _schema(path) == before
    assert not (tmp_path / "backups").exists()


def test_opening_an_older_database_writes_a_backup_first(tmp_path: Path, sql_dir: Path) -> None:
    """Migrating v1 -> v2 first writes backups/t3-v1-*.sqlite: a complete v1 copy, no temp file left."""
    path, backups = tmp_path / "t3.sqlite", tmp_path / "backups"
    store.apply_migrations(path, backups_dir=backups, sql_dir=sql_dir, stop_after=1)
    with closing(store.connect(path)) as conn:
        conn.executemany("INSERT INTO projects (project_id, path, title) VALUES (?, ?, ?)",
                         [("p1", "/src/one", "One"), ("p2", "/src/two", "Two")])
        conn.execute("INSERT INTO server_meta (key, value) VALUES ('environment', 'env-1')")
    assert not backups.exists(), "a fresh database (version 0) needs no backup"

    assert store.apply_migrations(path, backups_dir=backups, sql_dir=sql_dir) == 2

    copies = sorted(backups.glob("t3-v1-*.sqlite"))
    assert len(copies) == 1
    assert [p.name for p in backups.iterdir() if p.name.endswith(".tmp")] == []
    with closing(sqlite3.connect(f"file:{copies[0]}?mode=ro", uri=True)) as copy:
        assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert copy.execute("PRAGMA user_version").fetchone()[0] == 1
        assert copy.execute("SELECT project_id, path, title FROM projects ORDER BY 1").fetchall() == [
            ("p1", "/src/one", "One"), ("p2", "/src/two", "Two")]
        assert copy.execute("SELECT value FROM server_meta").fetchall() == [("env-1",)]
        assert copy.execute("SELECT 1 FROM sqlite_master WHERE name = 'test_extra'").fetchall() == []
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT COUNT(*) FROM projects").fetchone()[0] == 2
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2


def _newer_database(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path)) as conn:  # default rollback journal, not WAL
        conn.execute("CREATE TABLE from_the_future (x TEXT)")
        conn.execute("INSERT INTO from_the_future VALUES ('keep me')")
        conn.execute("PRAGMA user_version = 99")
        conn.commit()
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def _fingerprint(directory: Path, path: Path) -> tuple[str, int, list[str]]:
    return (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns,
            sorted(p.name for p in directory.iterdir()))


def test_a_newer_database_is_refused_untouched(tmp_path: Path) -> None:
    """user_version 99: apply_migrations and Store raise DatabaseTooNew; bytes, mtime, dir unchanged."""
    data = tmp_path / "data"
    path = data / "t3.sqlite"
    _newer_database(path)
    before = _fingerprint(data, path)
    assert before[2] == ["t3.sqlite"]

    with pytest.raises(store.DatabaseTooNew):
        store.apply_migrations(path, backups_dir=data / "backups")
    with pytest.raises(store.DatabaseTooNew):
        Store(path, backups_dir=data / "backups")

    assert _fingerprint(data, path) == before
    assert not (data / "t3.sqlite-wal").exists() and not (data / "t3.sqlite-shm").exists()
    assert not (data / "backups").exists()


def test_a_newer_database_is_refused_in_a_directory_whose_name_has_a_hash(tmp_path: Path) -> None:
    """A '#' in the data dir's name does not defeat the newer-database refusal."""
    data = tmp_path / "data#1"
    path = data / "t3.sqlite"
    _newer_database(path)
    before = _fingerprint(data, path)
    try:
        with pytest.raises(store.DatabaseTooNew):
            store.apply_migrations(path, backups_dir=data / "backups")
    finally:
        assert _fingerprint(data, path) == before
        assert not (tmp_path / "data").exists(), "the probe must not create a stray database"


def test_an_older_database_is_backed_up_in_a_directory_whose_name_has_a_hash(
        tmp_path: Path, sql_dir: Path) -> None:
    """A '#' in the data dir's name does not skip the copy-before-migrate backup."""
    data = tmp_path / "data#1"
    data.mkdir()
    path = data / "t3.sqlite"
    store.apply_migrations(path, backups_dir=data / "backups", sql_dir=sql_dir, stop_after=1)
    assert store.apply_migrations(path, backups_dir=data / "backups", sql_dir=sql_dir) == 2
    assert len(list((data / "backups").glob("t3-v1-*.sqlite"))) == 1


def test_a_migration_that_fails_halfway_leaves_version_and_schema_as_before(
        tmp_path: Path, sql_dir: Path) -> None:
    """A file whose later statement fails is rolled back whole: user_version and schema unchanged."""
    path = tmp_path / "t3.sqlite"
    store.apply_migrations(path, backups_dir=tmp_path / "backups", sql_dir=sql_dir, stop_after=1)
    before = _schema(path)
    (sql_dir / "0002_test_extra.sql").write_text(
        "ALTER TABLE projects ADD COLUMN archived_at TEXT;\n"
        "CREATE TABLE test_extra (extra_id TEXT PRIMARY KEY);\n"
        "INSERT INTO no_such_table (x) VALUES (1);\n")

    with pytest.raises((store.StoreError, sqlite3.Error)):
        store.apply_migrations(path, backups_dir=tmp_path / "backups", sql_dir=sql_dir)

    assert _schema(path) == before
    assert before[0] == 1
    # Once the file is fixed the same database migrates normally.
    (sql_dir / "0002_test_extra.sql").write_text(EXTRA_SQL)
    assert store.apply_migrations(path, backups_dir=tmp_path / "backups", sql_dir=sql_dir) == 2


def test_two_statements_on_one_line_are_both_applied(tmp_path: Path, sql_dir: Path) -> None:
    """A schema line holding two complete statements applies both."""
    (sql_dir / "0002_test_extra.sql").write_text(
        "CREATE TABLE one_a (x TEXT); CREATE TABLE one_b (y TEXT);\n")
    path = tmp_path / "t3.sqlite"
    assert store.apply_migrations(path, backups_dir=tmp_path / "backups", sql_dir=sql_dir) == 2
    names = {n for _, n, _, _ in _schema(path)[1]}
    assert {"one_a", "one_b"} <= names


# ---------------------------------------------------------------------------------------------
# Connections


def test_pragmas_take_effect_on_the_writer_and_the_reader(open_store: Callable[..., Store]) -> None:
    """Both connections run WAL, synchronous FULL, foreign keys on, busy_timeout 5000."""
    st = open_store()
    names = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout", "query_only")

    def pragmas(conn: sqlite3.Connection) -> tuple[Any, ...]:
        return tuple(conn.execute(f"PRAGMA {n}").fetchone()[0] for n in names)

    assert _run(st.write(pragmas)) == ("wal", 2, 1, 5000, 0)
    assert tuple(st.read(f"PRAGMA {n}")[0][0] for n in names) == ("wal", 2, 1, 5000, 1)
    with open(st.path, "rb") as f:
        assert f.read(20)[18:20] == b"\x02\x02", "the file header records WAL mode"


def test_a_new_database_gets_1_kb_pages_and_an_existing_one_keeps_its_own(
        tmp_path: Path, open_store: Callable[..., Store]) -> None:
    """t3 creates its database with 1 KB pages; one made with 4 KB pages (an older t3) keeps
    them through migration and use."""
    old = tmp_path / "old.sqlite"
    with closing(sqlite3.connect(old)) as conn:
        conn.execute("PRAGMA page_size = 4096")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE made_before (x)")
    assert open_store().read("PRAGMA page_size")[0][0] == 1024
    assert open_store(old).read("PRAGMA page_size")[0][0] == 4096


def test_the_reader_is_query_only(st: Store) -> None:
    """A write through `Store.read` raises and leaves the table empty."""
    with pytest.raises(store.StoreError):
        st.read("INSERT INTO projects (project_id, path, title) VALUES ('p', '/p', 'P')")
    assert _count(st, "projects") == 0


# ---------------------------------------------------------------------------------------------
# Commit


def _thread_and_run_commit(command_id: str = "cmd-1", *, fingerprint: str | None = None) -> Commit:
    return _commit(command_id, "th-1", [
        _event("ev-1", "th-1", "thread.created", _thread("th-1")),
        _event("ev-2", "th-1", "run.created", _run_entity("run-1", "th-1", 1, "queued")),
        _event("ev-3", "th-1", "run.updated", _run_entity("run-1", "th-1", 1, "starting")),
    ], [_effect("eff-1", "th-1")], fingerprint=fingerprint, result={"runId": "run-1", "n": [1, 2]})


def test_commit_writes_events_projections_outbox_and_receipt(st: Store) -> None:
    """One Commit: increasing sequences, stream versions 0.., projection rows, a pending outbox row, a receipt."""
    res = _run(st.commit(_thread_and_run_commit()))
    assert res.committed
    assert len(res.sequences) == 3 and list(res.sequences) == sorted(set(res.sequences))
    rows = st.read("SELECT sequence, event_id, thread_id, stream_version, command_id, type "
                   "FROM events ORDER BY sequence")
    assert [tuple(r) for r in rows] == [
        (res.sequences[0], "ev-1", "th-1", 0, "cmd-1", "thread.created"),
        (res.sequences[1], "ev-2", "th-1", 1, "cmd-1", "run.created"),
        (res.sequences[2], "ev-3", "th-1", 2, "cmd-1", "run.updated"),
    ]
    assert [tuple(r) for r in st.read(
        "SELECT thread_id, project_id, parent_thread_id, created_at, updated_at, deleted_at FROM threads")
    ] == [("th-1", "proj", None, STAMP, STAMP, None)]
    runs = st.read("SELECT run_id, thread_id, ordinal, status, payload_json FROM runs")
    assert [tuple(r)[:4] for r in runs] == [("run-1", "th-1", 1, "starting")]
    assert runs[0]["payload_json"] == st.read(
        "SELECT payload_json FROM events WHERE event_id = 'ev-3'")[0][0]

    eff = _effect_row(st, "eff-1")
    assert (eff.status, eff.attempt_count, eff.command_id, eff.thread_id, eff.lease_owner) == (
        "pending", 0, "cmd-1", "th-1", None)
    assert st.receipt("cmd-1") == res.receipt
    assert res.receipt.result == {"runId": "run-1", "n": [1, 2]}
    assert res.receipt.result_sequence == res.sequences[-1] == st.max_sequence()

    # A second command on the same thread continues its stream; global sequence keeps rising.
    res2 = _run(st.commit(_commit("cmd-2", "th-1", [
        _event("ev-4", "th-1", "run.updated", _run_entity("run-1", "th-1", 1, "running"))])))
    assert res2.sequences[0] > res.sequences[-1]
    assert st.read("SELECT stream_version FROM events WHERE event_id = 'ev-4'")[0][0] == 3
    assert st.read("SELECT status FROM runs")[0][0] == "running"

    # Stream versions count per thread, also when one commit interleaves two threads.
    _run(st.commit(_commit("cmd-3", "th-2", [
        _event("ev-5", "th-2", "thread.created", _thread("th-2", parent="th-1")),
        _event("ev-6", "th-1", "thread.updated", _thread("th-1", title="renamed")),
        _event("ev-7", "th-2", "thread.updated", _thread("th-2", parent="th-1", title="child")),
    ])))
    versions = st.read("SELECT event_id, stream_version FROM events WHERE command_id = 'cmd-3' "
                       "ORDER BY sequence")
    assert [tuple(r) for r in versions] == [("ev-5", 0), ("ev-6", 4), ("ev-7", 1)]
    assert st.read("SELECT parent_thread_id FROM threads WHERE thread_id = 'th-2'")[0][0] == "th-1"


def test_a_repeated_command_id_with_the_same_fingerprint_writes_nothing(st: Store) -> None:
    """The same command id and fingerprint again: committed=False, the stored receipt, no new rows."""
    first = _run(st.commit(_thread_and_run_commit()))
    counts = {t: _count(st, t) for t in ("events", "threads", "runs", "effect_outbox", "command_receipts")}
    again = _run(st.commit(_thread_and_run_commit()))
    assert not again.committed
    assert again.receipt == first.receipt
    assert list(again.sequences) == [] and list(again.cancelled_effect_ids) == []
    assert {t: _count(st, t) for t in counts} == counts


def test_a_repeated_command_id_with_another_fingerprint_is_refused(st: Store) -> None:
    """The same command id with a different fingerprint raises FingerprintMismatch and writes nothing."""
    first = _run(st.commit(_thread_and_run_commit()))
    counts = {t: _count(st, t) for t in ("events", "threads", "runs", "effect_outbox", "command_receipts")}
    other = _commit("cmd-1", "th-2", [_event("ev-9", "th-2", "thread.created", _thread("th-2"))],
                    [_effect("eff-9", "th-2")], fingerprint="another")
    with pytest.raises(store.FingerprintMismatch):
        _run(st.commit(other))
    assert {t: _count(st, t) for t in counts} == counts
    assert st.receipt("cmd-1") == first.receipt
    assert st.effect("eff-9") is None


def test_a_commit_is_all_or_nothing(st: Store) -> None:
    """A Commit whose second event breaks a CHECK leaves no receipt, event, projection or outbox row."""
    bad = _commit("cmd-bad", "th-1", [
        _event("ev-1", "th-1", "thread.created", _thread("th-1")),
        _event("ev-2", "th-1", "run.created", _run_entity("run-1", "th-1", 1, "not-a-status")),
    ], [_effect("eff-1", "th-1")])
    with pytest.raises(store.StoreError):
        _run(st.commit(bad))
    assert st.receipt("cmd-bad") is None
    for table in ("command_receipts", "events", "effect_outbox", *PROJECTION_TABLES):
        assert _count(st, table) == 0, table
    # The writer survives the failed transaction, and the same command id can still be used.
    ok = _run(st.commit(_commit("cmd-bad", "th-1", [
        _event("ev-1", "th-1", "thread.created", _thread("th-1"))], [_effect("eff-1", "th-1")])))
    assert ok.committed
    assert st.read("SELECT stream_version FROM events")[0][0] == 0


def _behind_a_busy_writer(st: Store, jobs: Sequence[Callable[[], Any]]) -> tuple[list[Any], int]:
    """Run `jobs` (each returns an awaitable of the store) queued while the writer is held busy;
    their outcomes (results or exceptions) and how many transactions committed meanwhile."""
    statements: list[str] = []
    st._writer.conn.set_trace_callback(statements.append)
    gate = threading.Event()

    async def main() -> list[Any]:
        busy = asyncio.ensure_future(st.write(lambda conn: gate.wait(30)))
        queued = [asyncio.ensure_future(job()) for job in jobs]
        # Ready callbacks run in order: each job's first step (which queues it at the writer)
        # runs before the gate opens.
        asyncio.get_running_loop().call_soon(gate.set)
        await busy
        return await asyncio.gather(*queued, return_exceptions=True)

    outcomes = _run(main())
    st._writer.conn.set_trace_callback(None)
    return outcomes, statements.count("COMMIT")


def test_commands_queued_behind_a_busy_writer_share_one_transaction(open_store: Callable[..., Store]) -> None:
    """Group commit: ten commits queued while the writer is busy commit together (one COMMIT, so
    one fsync), and the one that breaks a CHECK fails alone, leaving nothing of itself."""
    st = open_store()
    commits = [_commit(f"cmd-{i}", f"th-{i}", [_event(f"ev-{i}", f"th-{i}", "thread.created",
                                                       _thread(f"th-{i}"))], [_effect(f"eff-{i}", f"th-{i}")])
               for i in range(10)]
    commits[4] = _commit("cmd-4", "th-4", [
        _event("ev-4", "th-4", "thread.created", _thread("th-4")),
        _event("ev-4b", "th-4", "run.created", _run_entity("run-4", "th-4", 1, "not-a-status"))])
    outcomes, transactions = _behind_a_busy_writer(st, [lambda c=c: st.commit(c) for c in commits])
    assert transactions <= 2  # the busy job's and the batch's (one, if the writer took all at once)
    assert isinstance(outcomes[4], store.StoreError)
    assert all(o.committed for i, o in enumerate(outcomes) if i != 4)
    assert st.receipt("cmd-4") is None
    assert {r[0] for r in st.read("SELECT thread_id FROM threads")} == {f"th-{i}" for i in range(10)} - {"th-4"}
    assert _count(st, "effect_outbox") == 9 and _count(st, "events") == 9


def test_a_batch_whose_transaction_is_lost_runs_each_job_alone(open_store: Callable[..., Store]) -> None:
    """A job that ends the shared transaction (as SQLite does on SQLITE_FULL or an I/O error)
    costs the others nothing: each job runs again in its own transaction; only it fails."""
    st = open_store()
    def rogue(conn: sqlite3.Connection) -> None:
        conn.execute("ROLLBACK")

    commits = [_commit(f"cmd-{i}", f"th-{i}", [_event(f"ev-{i}", f"th-{i}", "thread.created",
                                                       _thread(f"th-{i}"))]) for i in range(4)]
    jobs = [lambda c=c: st.commit(c) for c in commits]
    jobs.insert(2, lambda: st.write(rogue))
    outcomes, _ = _behind_a_busy_writer(st, jobs)
    assert isinstance(outcomes[2], store.StoreError)
    assert [o.committed for o in outcomes[:2] + outcomes[3:]] == [True] * 4
    assert _count(st, "threads") == 4


def test_cancel_effect_types_cancels_unsettled_rows_of_the_thread(st: Store) -> None:
    """cancel_effect_types cancels that thread's pending/running rows of those types and reports them."""
    t0 = _add_effects(st, _effect("T-x0", "T", "x"))
    done = _claim(st, "w1", t0)
    assert done is not None and done.effect_id == "T-x0"
    assert _run(st.settle_effect(done, owner="w1", status="succeeded"))
    t1 = _add_effects(st, _effect("T-x1", "T", "x"), _effect("T-x2", "T", "x"),
                      _effect("T-y1", "T", "y"), _effect("U-x1", "U", "x"))
    running = _claim(st, "w1", t1)
    assert running is not None and running.effect_id == "T-x1"

    res = _run(st.commit(_commit("cmd-cancel", "T", effects=[_effect("T-x3", "T", "x")],
                                 cancel=["x"])))
    assert sorted(res.cancelled_effect_ids) == ["T-x1", "T-x2"]
    status = {r[0]: r[1] for r in st.read("SELECT effect_id, status FROM effect_outbox")}
    assert status == {"T-x0": "succeeded", "T-x1": "cancelled", "T-x2": "cancelled",
                      "T-y1": "pending", "U-x1": "pending", "T-x3": "pending"}
    assert "cmd-cancel" in (_effect_row(st, "T-x2").last_error or "")
    # The worker that held the cancelled row is fenced out.
    assert not _run(st.settle_effect(running, owner="w1", status="succeeded"))
    assert _effect_row(st, "T-x1").status == "cancelled"


def test_a_hooks_log_keeps_its_newest_50_deliveries_and_every_waiting_one(st: Store) -> None:
    """Each delivery commit prunes the task's log to its 50 newest (by the task's count: the
    times tie), but never a queued or running delivery however old; once that one settles it
    goes too. deliveries() lists newest first."""
    def deliver(n: int, outcome: str) -> None:
        _run(st.commit(_commit(f"c{n}-{outcome}", "task-1", [_event(
            f"e{n}-{outcome}", "task-1", "webhook-delivery.updated",
            {"id": f"d{n}", "taskId": "task-1", "receivedAt": STAMP, "outcome": outcome,
             "ordinal": n})])))
    for n, outcome in enumerate(["queued", "running"] + ["skipped"] * 58, 1):
        deliver(n, outcome)
    assert [d["id"] for d in st.deliveries("task-1")] == \
        [f"d{n}" for n in range(60, 10, -1)] + ["d2", "d1"]
    deliver(1, "succeeded")
    assert [d["id"] for d in st.deliveries("task-1")][-2:] == ["d11", "d2"]


# ---------------------------------------------------------------------------------------------
# The effect outbox


def test_a_due_row_is_claimed_once_while_its_lease_holds(st: Store) -> None:
    """claim_effect hands a due pending row to one owner; a second claim gets None until the lease expires."""
    t0 = _add_effects(st, _effect("e1", "T"))
    assert _claim(st, "w1", t0 - 1) is None, "not due yet"
    row = _claim(st, "w1", t0)
    assert row is not None
    assert (row.effect_id, row.status, row.attempt_count, row.lease_owner, row.lease_expires_ms) == (
        "e1", "running", 1, "w1", t0 + LEASE_MS)
    assert _claim(st, "w2", t0) is None
    assert _claim(st, "w2", t0 + LEASE_MS) is None, "the lease holds through its last millisecond"
    assert _run(st.settle_effect(row, owner="w1", status="succeeded"))
    settled = _effect_row(st, "e1")
    assert (settled.status, settled.lease_owner, settled.lease_expires_ms) == ("succeeded", None, None)
    assert _claim(st, "w2", t0 + 10 * LEASE_MS) is None


def test_at_most_one_row_per_thread_runs_and_threads_run_concurrently(st: Store) -> None:
    """A thread's second pending row waits for its first to settle; another thread's row is claimable."""
    t0 = _add_effects(st, _effect("a1", "A"), _effect("a2", "A"), _effect("b1", "B"))
    first = _claim(st, "w1", t0)
    second = _claim(st, "w1", t0)
    assert first is not None and second is not None
    assert (first.effect_id, second.effect_id) == ("a1", "b1")
    assert _claim(st, "w2", t0) is None, "a2 waits for a1"
    assert st.next_effect_due_ms() == t0 + LEASE_MS
    assert _run(st.settle_effect(first, owner="w1", status="succeeded"))
    third = _claim(st, "w2", t0)
    assert third is not None and third.effect_id == "a2"
    assert _run(st.settle_effect(second, owner="w1", status="failed", error="boom"))
    assert _effect_row(st, "b1").last_error == "boom"


def test_a_stale_holder_is_fenced_after_another_owner_reclaims(st: Store) -> None:
    """After lease expiry and a re-claim (attempt 2), the old holder's settle and renew fail and change nothing."""
    t0 = _add_effects(st, _effect("e1", "T"))
    stale = _claim(st, "w1", t0)
    assert stale is not None and stale.attempt_count == 1
    later = t0 + LEASE_MS + 1
    fresh = _claim(st, "w2", later)
    assert fresh is not None
    assert (fresh.effect_id, fresh.attempt_count, fresh.lease_owner) == ("e1", 2, "w2")
    assert _claim(st, "w3", later) is None, "the new lease holds"

    before = _effect_row(st, "e1")
    assert not _run(st.settle_effect(stale, owner="w1", status="succeeded"))
    assert not _run(st.renew_lease(stale, owner="w1", until_ms=later + 50 * LEASE_MS))
    assert _effect_row(st, "e1") == before

    assert _run(st.renew_lease(fresh, owner="w2", until_ms=later + 5 * LEASE_MS))
    assert _effect_row(st, "e1").lease_expires_ms == later + 5 * LEASE_MS
    assert _run(st.settle_effect(fresh, owner="w2", status="succeeded"))
    assert _effect_row(st, "e1").status == "succeeded"


def test_two_stores_on_one_file_never_claim_a_row_twice(stores: Callable[[], Store]) -> None:
    """Two stores (two writer connections, as two processes would have) claiming concurrently
    from one outbox: every row is claimed exactly once while the leases hold."""
    a, b = stores(), stores()
    t0 = _add_effects(a, *(_effect(f"e{i}", f"T{i}") for i in range(24)))

    def drain(s: Store, owner: str) -> list[str]:
        got = []
        while (row := _claim(s, owner, t0, lease_ms=60_000)) is not None:
            got.append(row.effect_id)
        return got

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        claimed = [f.result() for f in [pool.submit(drain, a, "wa"), pool.submit(drain, b, "wb")]]
    every = claimed[0] + claimed[1]
    assert sorted(every) == sorted(f"e{i}" for i in range(24))
    assert len(set(every)) == len(every)
    owners = {r[0]: r[1] for r in a.read("SELECT effect_id, lease_owner FROM effect_outbox")}
    assert all(owners[e] == "wa" for e in claimed[0]) and all(owners[e] == "wb" for e in claimed[1])


def test_the_attempt_number_fences_a_stale_holder_with_the_same_owner(st: Store) -> None:
    """A re-claim by the same owner string still fences the earlier attempt's EffectRow."""
    t0 = _add_effects(st, _effect("e1", "T"))
    stale = _claim(st, "w1", t0)
    fresh = _claim(st, "w1", t0 + LEASE_MS + 1)
    assert stale is not None and fresh is not None and fresh.attempt_count == 2
    before = _effect_row(st, "e1")
    assert not _run(st.settle_effect(stale, owner="w1", status="failed", error="stale"))
    assert _effect_row(st, "e1") == before
    assert _run(st.settle_effect(fresh, owner="w1", status="succeeded"))


def test_a_row_settled_for_retry_is_not_claimable_before_its_retry_time(st: Store) -> None:
    """Settling as pending with retry_at_ms in the future holds the row back until exactly that time."""
    t0 = _add_effects(st, _effect("e1", "T"))
    row = _claim(st, "w1", t0)
    assert row is not None
    retry_at = t0 + 5_000
    assert _run(st.settle_effect(row, owner="w1", status="pending", error="transient",
                                 retry_at_ms=retry_at))
    pending = _effect_row(st, "e1")
    assert (pending.status, pending.available_at_ms, pending.attempt_count, pending.last_error) == (
        "pending", retry_at, 1, "transient")
    assert st.next_effect_due_ms() == retry_at
    assert _claim(st, "w1", retry_at - 1) is None
    again = _claim(st, "w2", retry_at)
    assert again is not None and again.attempt_count == 2 and again.last_error is None


def test_settle_refuses_running_as_a_status(st: Store) -> None:
    """settle_effect only accepts a settled status (or pending for a retry)."""
    t0 = _add_effects(st, _effect("e1", "T"))
    row = _claim(st, "w1", t0)
    assert row is not None
    with pytest.raises(ValueError):
        _run(st.settle_effect(row, owner="w1", status="running"))


def test_recover_outbox_cancels_started_process_bound_rows_and_requeues_the_rest(st: Store) -> None:
    """After a lost process: started process-bound rows are cancelled, unstarted ones stay, replay-safe requeue."""
    t0 = _add_effects(st, _effect("p-run", "T1"), _effect("p-retry", "T2"),
                      _effect("s-run", "T3", replay_safe=True))
    claimed = {r.effect_id: r for r in (_claim(st, "dead", t0) for _ in range(3)) if r}
    assert sorted(claimed) == ["p-retry", "p-run", "s-run"]
    assert _run(st.settle_effect(claimed["p-retry"], owner="dead", status="pending",
                                 retry_at_ms=t0 + 60_000))
    _add_effects(st, _effect("p-fresh", "T4"))

    now = t0 + 100
    cancelled, requeued = _run(st.recover_outbox(reason="process lost", now_ms=now))
    assert sorted(r.effect_id for r in cancelled) == ["p-retry", "p-run"]
    assert all(r.status == "cancelled" and r.last_error == "process lost" for r in cancelled)
    assert requeued == 1
    rows = {e: _effect_row(st, e) for e in ("p-run", "p-retry", "p-fresh", "s-run")}
    assert {e: r.status for e, r in rows.items()} == {
        "p-run": "cancelled", "p-retry": "cancelled", "p-fresh": "pending", "s-run": "pending"}
    assert rows["p-fresh"].attempt_count == 0
    assert (rows["s-run"].lease_owner, rows["s-run"].lease_expires_ms, rows["s-run"].available_at_ms) == (
        None, None, now)
    assert not _run(st.settle_effect(claimed["p-run"], owner="dead", status="succeeded"))
    reclaimed = {r.effect_id for r in (_claim(st, "new", now) for _ in range(3)) if r}
    assert reclaimed == {"p-fresh", "s-run"}


def test_release_leases_requeues_replay_safe_rows_and_cancels_process_bound_ones(st: Store) -> None:
    """At shutdown an owner's replay-safe running rows go back to pending; its process-bound ones are cancelled."""
    t0 = _add_effects(st, _effect("s1", "T1", replay_safe=True), _effect("p1", "T2"))
    mine = [_claim(st, "w1", t0), _claim(st, "w1", t0)]
    _add_effects(st, _effect("s2", "T3", replay_safe=True))
    theirs = _claim(st, "w2", t0 + 100)
    assert all(mine) and theirs is not None and theirs.effect_id == "s2"

    assert _run(st.release_leases(owner="w1", reason="shutting down", now_ms=t0 + 200)) == 2
    s1, p1, s2 = (_effect_row(st, e) for e in ("s1", "p1", "s2"))
    assert (s1.status, s1.lease_owner, s1.attempt_count, s1.available_at_ms) == ("pending", None, 0, t0 + 200)
    assert (p1.status, p1.lease_owner, p1.last_error) == ("cancelled", None, "shutting down")
    assert (s2.status, s2.lease_owner, s2.attempt_count) == ("running", "w2", 1)


# ---------------------------------------------------------------------------------------------
# Replay


def _several_commits(st: Store) -> None:
    commits = [
        _commit("c1", "th-1", [
            _event("e1", "th-1", "thread.created", _thread("th-1")),
            _event("e2", "th-1", "run.created", _run_entity("run-1", "th-1", 1, "queued")),
            _event("e3", "th-1", "run-attempt.created",
                   {"id": "att-1", "threadId": "th-1", "runId": "run-1", "number": 1}),
            _event("e4", "th-1", "message.created",
                   {"id": "msg-1", "threadId": "th-1", "runId": "run-1", "text": "hi"}),
        ]),
        _commit("c2", "th-1", [
            _event("e5", "th-1", "run.updated", _run_entity("run-1", "th-1", 1, "running")),
            _event("e6", "th-1", "provider-session.created",
                   {"id": "ps-1", "threadId": "th-1", "status": "running"}),
            _event("e7", "th-1", "provider-thread.created",
                   {"id": "pt-1", "appThreadId": "th-1", "providerThreadId": "x"}),
            _event("e8", "th-1", "provider-turn.created", {"id": "ptu-1", "threadId": "th-1"}),
            _event("e9", "th-1", "turn-item.created",
                   {"id": "ti-1", "threadId": "th-1", "position": 0, "type": "agentMessage"}),
            _event("e10", "th-1", "node.created", {"id": "n-1", "threadId": "th-1", "runId": "run-1"}),
        ]),
        _commit("c3", "th-2", [
            _event("e11", "th-2", "thread.created", _thread("th-2", parent="th-1")),
            _event("e12", "th-2", "runtime-request.created",
                   {"id": "rr-1", "threadId": "th-2", "status": "pending"}),
        ]),
        _commit("c4", "th-1", [
            _event("e13", "th-1", "run.updated", _run_entity("run-1", "th-1", 1, "completed")),
            _event("e14", "th-1", "turn-item.updated",
                   {"id": "ti-1", "threadId": "th-1", "position": 0, "type": "agentMessage",
                    "text": "done"}),
            _event("e15", "th-1", "thread.updated", _thread("th-1", updated="2025-01-02T00:00:00.000Z",
                                                           title="renamed")),
            _event("e16", "th-2", "runtime-request.updated",
                   {"id": "rr-1", "threadId": "th-2", "status": "resolved"}),
            _event("e17", "th-1", "run.created", _run_entity("run-2", "th-1", 2, "queued")),
            _event("e18", "th-1", "subagent.updated",
                   {"id": "task-1", "threadId": "th-1", "childThreadId": "th-2",
                    "status": "running"}),
            _event("e19", "th-1", "context-transfer.updated",
                   {"id": "ct-1", "threadId": "th-1", "type": "subagent_spawn",
                    "sourceThreadId": "th-1", "targetThreadId": "th-2"}),
            _event("e19b", "th-1", "context-handoff.updated",
                   {"id": "ch-1", "threadId": "th-1", "targetRunId": "run-2"}),
            _event("e19c", "th-1", "checkpoint.captured",
                   {"id": "cp-1", "threadId": "th-1", "runId": "run-1", "status": "ready"}),
        ]),
        _commit("c5", "task-1", [  # a scheduled task is a stream of its own
            _event("e20", "task-1", "scheduled-task.updated",
                   {"id": "task-1", "projectId": "proj", "enabled": True,
                    "nextRunAt": "2025-01-03T00:00:00.000Z", "deletedAt": None}),
            _event("e21", "task-1", "webhook-delivery.updated",
                   {"id": "d-1", "taskId": "task-1", "receivedAt": "2025-01-02T00:00:00.000Z",
                    "deliveryKey": "k-1", "outcome": "skipped"}),
        ]),
    ]
    for c in commits:
        assert _run(st.commit(c)).committed


def test_rebuild_projections_equals_the_live_projections(st: Store) -> None:
    """Replaying the event log into emptied projection tables reproduces every live projection row."""
    _several_commits(st)
    live = _tables(st, PROJECTION_TABLES)
    assert all(live.values()), "every projection table has rows"

    def damage_and_rebuild(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
        conn.execute("DELETE FROM runs")
        conn.execute("UPDATE threads SET payload_json = '{}', updated_at = 'x'")
        conn.execute("INSERT INTO messages (message_id, thread_id, run_id, payload_json) "
                     "VALUES ('ghost', 'th-9', NULL, '{}')")
        store.rebuild_projections(conn)
        return _tables(conn, PROJECTION_TABLES)

    assert _run(st.write(damage_and_rebuild)) == live
    assert _tables(st, PROJECTION_TABLES) == live


def test_thread_entities_reads_one_thread_and_its_sequence(st: Store) -> None:
    """thread_entities returns only that thread's entities with the sequence of the latest event."""
    _several_commits(st)
    sequence, entities = st.thread_entities("th-2")
    assert sequence == st.max_sequence()
    assert [e["id"] for e in entities["thread"]] == ["th-2"]
    assert [e["status"] for e in entities["runtime-request"]] == ["resolved"]
    assert entities["run"] == []
    _, th1 = st.thread_entities("th-1")
    assert sorted(e["id"] for e in th1["run"]) == ["run-1", "run-2"]
    assert [e["text"] for e in th1["turn-item"]] == ["done"]


def test_real_schema_step_by_step_equals_fresh(tmp_path: Path) -> None:
    """The shipped sql/ files applied one at a time give the same schema as all at once."""
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    for version in range(1, len(REAL_SQL_FILES) + 1):
        assert store.apply_migrations(a, backups_dir=tmp_path / "bk-a",
                                      stop_after=version) == version
    assert store.apply_migrations(b, backups_dir=tmp_path / "bk-b") == len(REAL_SQL_FILES)
    assert _schema(a) == _schema(b)


# What a (re)start reads before and right after it writes server.json: recovery, the outbox
# worker's first claim and wait, the scheduler's resume and first pass.
_STARTUP_READS = {"recovery": (store._THREADS_NEEDING_RECOVERY, ()),
                  "claim": (store._CLAIM_EFFECT, {"owner": "w", "now": 1, "lease": 1, "stamp": "s"}),
                  "next effect": (store._NEXT_DUE, ()), "tasks": (store._SCHEDULED_TASKS, ()),
                  "due tasks": (store._DUE_TASKS, ("x",)), "next task": (store._NEXT_DUE_TASK, ()),
                  "pending requests": (store._PENDING_REQUESTS, ())}


def test_what_a_restart_reads_does_not_grow_with_the_log(open_store: Callable[..., Store]) -> None:
    """Each read a restart makes searches an index or scans a partial index of live rows only:
    none scans a table or a whole index (both grow with the log)."""
    st = open_store()
    partial = {r[0] for r in st.read("SELECT name FROM sqlite_master WHERE type = 'index' "
                                     "AND sql LIKE '% WHERE %'")}
    for name, (sql, params) in _STARTUP_READS.items():
        plan = [r["detail"] for r in st.read("EXPLAIN QUERY PLAN " + sql, params)]
        for detail in plan:
            if detail.startswith("SCAN ") and not detail.startswith("SCAN ("):
                index = re.search(r"USING (?:COVERING )?INDEX (\S+)", detail)
                assert index and index.group(1) in partial, f"{name}: {detail}"


# ---------------------------------------------------------------------------------------------
# A crash between the statements of one commit


_CRASHING_COMMIT = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import store
s = store.Store(Path(sys.argv[2]), backups_dir=Path(sys.argv[3]))
commit = store.Commit(
    command_id="cmd-crash", command_type="test.command", fingerprint="fp", thread_id="th-1",
    events=[store.NewEvent("ev-c1", "th-1", "run.created", "2025-01-01T00:00:00.000Z",
                           {"id": "run-c", "threadId": "th-1", "ordinal": 2, "status": "queued"}),
            store.NewEvent("ev-c2", "th-2", "thread.created", "2025-01-01T00:00:00.000Z",
                           {"id": "th-2", "projectId": "proj", "createdAt": "x", "updatedAt": "x"})],
    effects=[store.NewEffect("eff-crash", "th-1", "provider-turn.start", {}, replay_safe=False)],
    cancel_effect_types=["provider-turn.start"])
asyncio.run(s.commit(commit))
print("committed")
"""


@pytest.mark.parametrize("point", ["commit:after-receipt", "commit:after-events",
                                   "commit:after-outbox"])
def test_a_process_killed_inside_a_commit_leaves_none_of_it(tmp_path: Path, point: str) -> None:
    """SIGKILL between the statements of one commit transaction: after reopening, no receipt,
    event, projection row or outbox row of that command exists, earlier commits are whole, and
    integrity_check is ok."""
    path = tmp_path / "t3.sqlite"
    first = Store(path, backups_dir=tmp_path / "backups")
    _run(first.commit(_thread_and_run_commit()))
    before = {t: _count(first, t) for t in ("command_receipts", "events", "effect_outbox",
                                            *PROJECTION_TABLES)}
    first.close()
    hooks = {"T3_TEST_HOOKS": "1", "T3_CRASH_AT": point}
    child = subprocess.run([sys.executable, "-c", _CRASHING_COMMIT, str(_ROOT), str(path),
                            str(tmp_path / "backups")], env={**os.environ, **hooks},
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "committed" not in child.stdout

    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    reopened = Store(path, backups_dir=tmp_path / "backups")
    try:
        assert reopened.receipt("cmd-crash") is None
        assert reopened.read("SELECT COUNT(*) FROM events WHERE command_id = 'cmd-crash'")[0][0] == 0
        assert reopened.read("SELECT COUNT(*) FROM threads WHERE thread_id = 'th-2'")[0][0] == 0
        assert reopened.read("SELECT COUNT(*) FROM runs WHERE run_id = 'run-c'")[0][0] == 0
        assert reopened.effect("eff-crash") is None
        assert {t: _count(reopened, t) for t in before} == before
        assert _effect_row(reopened, "eff-1").status == "pending", "the cancel did not persist"
        # The same command commits in full once the process lives.
        again = subprocess.run([sys.executable, "-c", _CRASHING_COMMIT, str(_ROOT), str(path),
                                str(tmp_path / "backups")], capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 0 and "committed" in again.stdout, again.stderr
        assert reopened.receipt("cmd-crash") is not None
        assert reopened.effect("eff-crash") is not None
        assert _effect_row(reopened, "eff-1").status == "cancelled"
    finally:
        reopened.close()


# ---------------------------------------------------------------------------------------------
# Listing threads: an indexed activity column (sql/0003) in place of a full sort


# The list query and the tool's filters as they were before sql/0003 (commit 4b811a9): the
# reference order and filtering the indexed list must reproduce exactly.
_LIST_THREADS_BEFORE_0003 = """
SELECT t.payload_json AS thread_json,
       lr.run_id AS latest_run_id, lr.status AS latest_status,
       MAX(t.updated_at, COALESCE(json_extract(lr.payload_json, '$.requestedAt'), ''),
           COALESCE(json_extract(lr.payload_json, '$.completedAt'), '')) AS activity_at,
       (SELECT COUNT(*) FROM turn_items i WHERE i.thread_id = t.thread_id) AS item_count,
       (SELECT COUNT(*) FROM runtime_requests q
        WHERE q.thread_id = t.thread_id AND q.status = 'pending') AS pending_count
FROM threads t
LEFT JOIN runs lr ON lr.run_id = (SELECT r.run_id FROM runs r WHERE r.thread_id = t.thread_id
                                  ORDER BY r.ordinal DESC LIMIT 1)
WHERE t.project_id = ? AND t.deleted_at IS NULL
ORDER BY activity_at DESC, t.thread_id DESC
"""


def _listed_before_0003(conn: sqlite3.Connection | Store, project: str, *,
                        statuses: Sequence[str] = (), title_contains: str = "",
                        include_subagents: bool = True) -> list[tuple[Any, ...]]:
    rows = (conn.read if isinstance(conn, Store) else conn.execute)(
        _LIST_THREADS_BEFORE_0003, (project,))
    needle = title_contains.lower()
    listed = []
    for r in rows:
        thread = json.loads(r[0])
        if not include_subagents and thread["lineage"].get("relationshipToParent") == "subagent":
            continue
        if statuses and (r[2] or "idle") not in statuses:
            continue
        if needle and needle not in thread["title"].lower():
            continue
        listed.append((thread["id"], r[1], r[2] or "idle", r[3], r[4], r[5]))
    return listed


def _listed(st: Store, project: str, *, page_size: int, **filters: Any) -> list[tuple[Any, ...]]:
    """Every page of Store.list_threads in turn; each page's total must agree."""
    listed: list[tuple[Any, ...]] = []
    totals = set()
    while True:
        total, page = st.list_threads(project, offset=len(listed), limit=page_size, **filters)
        totals.add(total)
        listed += [(r["thread"]["id"], r["latestRunId"], r["status"], r["updatedAt"],
                    r["itemCount"], r["pendingRequestCount"]) for r in page]
        if not page:
            break
    assert totals == {len(listed)}
    return listed


def _at(minute: int) -> str:
    return f"2025-01-01T{minute // 60:02d}:{minute % 60:02d}:00.000Z"


def _mixed_threads(seed: int = 7) -> list[tuple[str, list[NewEvent]]]:
    """Commits of threads whose activity comes from creation, later thread updates (renames,
    deletion), and runs (a sent message starts one: requestedAt, then completedAt). Some runs
    arrive before their thread, some threads tie on activity time, some are subagents, some
    in another project; turn items and pending requests make the counts differ."""
    import random
    rng = random.Random(seed)
    commits: list[tuple[str, list[NewEvent]]] = []
    n = 0

    def event(tid: str, type_: str, payload: dict[str, Any]) -> NewEvent:
        nonlocal n
        n += 1
        return _event(f"ev-{n}", tid, type_, payload)

    titles = ["Alpha", "beta fix", "ÄPFEL und Birnen", "äpfel", "Gamma ALPHA", "delta"]
    for i in range(60):
        tid = f"th-{i:02d}"
        created = rng.choice([10, 10, 20, 30, rng.randrange(0, 400)])  # ties on purpose
        thread = {**_thread(tid, project="proj" if i % 7 else "other", updated=_at(created),
                            title=rng.choice(titles)), "createdAt": _at(created)}
        if i % 5 == 0:
            thread["lineage"] = {"parentThreadId": "th-01", "relationshipToParent": "subagent",
                                 "rootThreadId": "th-01"}
        events = [event(tid, "thread.created", thread)]
        for ordinal in range(1, rng.choice([0, 1, 1, 2, 3]) + 1):
            requested = created + rng.randrange(0, 300)
            run = {**_run_entity(f"run-{tid}-{ordinal}", tid, ordinal, "running"),
                   "requestedAt": _at(requested), "completedAt": None}
            events.append(event(tid, "message.created", {"id": f"msg-{tid}-{ordinal}",
                                                         "threadId": tid, "runId": run["id"]}))
            events.append(event(tid, "run.created", run))
            if rng.random() < 0.6:
                status = rng.choice(["completed", "failed", "interrupted"])
                events.append(event(tid, "run.updated", {**run, "status": status,
                                                         "completedAt": _at(requested + 5)}))
        for position in range(rng.randrange(0, 3)):
            events.append(event(tid, "turn-item.created", {
                "id": f"ti-{tid}-{position}", "threadId": tid, "position": position,
                "type": "agentMessage"}))
        if rng.random() < 0.2:
            events.append(event(tid, "runtime-request.created", {
                "id": f"rr-{tid}", "threadId": tid, "status": "pending"}))
        if rng.random() < 0.3:
            renamed = {**thread, "title": rng.choice(titles),
                       "updatedAt": _at(created + rng.randrange(0, 500))}
            events.append(event(tid, "thread.updated", renamed))
        if rng.random() < 0.1:
            events.append(event(tid, "thread.updated", {**thread, "deletedAt": _at(created + 1),
                                                        "updatedAt": _at(created + 1)}))
        if i % 9 == 4 and len(events) > 2:  # a run's event before its thread's (order-independent)
            runs = [e for e in events if e.type.startswith("run.")]
            if runs:
                events.remove(runs[0])
                events.insert(0, runs[0])
        commits.append((tid, events))
    rng.shuffle(commits)
    return commits


LIST_FILTERS: list[dict[str, Any]] = [
    {}, {"statuses": ["idle"]}, {"statuses": ["completed", "running"]},
    {"title_contains": "äPf"}, {"title_contains": "ALPHA"}, {"include_subagents": False},
    {"statuses": ["failed", "idle"], "title_contains": "a", "include_subagents": False},
    {"statuses": ["waiting"]},
]


def test_list_order_paging_and_filters_match_the_full_sort(open_store: Callable[..., Store]) -> None:
    """Store.list_threads, read page by page (sizes 1, 7, 100), gives the same threads, order,
    status, activity time, counts and totals as sorting the whole project did before sql/0003,
    for each filter; a cursor past the end gives an empty page and the total."""
    st = open_store()
    for number, (tid, events) in enumerate(_mixed_threads()):
        assert _run(st.commit(_commit(f"c{number}", tid, events))).committed
    for project in ("proj", "other", "none"):
        for filters in LIST_FILTERS:
            expected = _listed_before_0003(st, project, **filters)
            for page_size in (1, 7, 100):
                assert _listed(st, project, page_size=page_size, **filters) == expected, \
                    (project, filters, page_size)
    everything = _listed_before_0003(st, "proj")
    assert len(everything) > 30 and len({e[3] for e in everything}) < len(everything), "ties"
    assert st.list_threads("proj", offset=2**70, limit=5) == (len(everything), [])


def _write_like_before_0003(path: Path, commits: list[tuple[str, list[NewEvent]]]) -> None:
    """What a t3 before sql/0003 wrote for these commits: each event and its entity's upsert."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        versions: dict[str, int] = {}
        for command, (_, events) in enumerate(commits):
            for e in events:
                version = versions[e.thread_id] = versions.get(e.thread_id, -1) + 1
                payload_json = json.dumps(e.payload, separators=(",", ":"))
                conn.execute(store._INSERT_EVENT, (e.event_id, e.thread_id, version,
                                                   f"c{command}", e.type, e.occurred_at,
                                                   payload_json)).fetchone()
                kind = store.event_kind(e.type)
                columns = store._PROJECTIONS[kind][2]
                conn.execute(store._UPSERTS[kind], (*(store._pluck(e.payload, k)
                                                      for k in columns.values()), payload_json))
        conn.execute("COMMIT")


def test_a_database_from_before_the_activity_column_is_backed_up_migrated_and_lists_alike(
        tmp_path: Path) -> None:
    """A schema v2 database holding threads is copied to backups/t3-v2-*.sqlite first, then
    migrated: its rows are kept, activity_at is filled as the projection would fill it (a
    rebuild from the events changes nothing), and every list gives the order it gave before."""
    path, backups = tmp_path / "t3.sqlite", tmp_path / "backups"
    assert store.apply_migrations(path, backups_dir=backups, stop_after=2) == 2
    _write_like_before_0003(path, _mixed_threads(seed=11))
    cases = [(p, f) for p in ("proj", "other") for f in LIST_FILTERS]
    with closing(sqlite3.connect(path)) as old:
        before = [_listed_before_0003(old, p, **f) for p, f in cases]
        old_tables = {t: sorted(old.execute(f"SELECT * FROM {t}").fetchall())
                      for t in ("events", *PROJECTION_TABLES) if t not in TABLES_SINCE_0004}
    assert not backups.exists()

    st = Store(path, backups_dir=backups)
    try:
        (copy,) = backups.glob("t3-v2-*.sqlite")
        with closing(sqlite3.connect(f"file:{copy}?mode=ro", uri=True)) as backup:
            assert backup.execute("PRAGMA user_version").fetchone()[0] == 2
            assert {t: sorted(backup.execute(f"SELECT * FROM {t}").fetchall())
                    for t in old_tables} == old_tables
        assert _user_version(path) == len(REAL_SQL_FILES) >= 3
        kept = {t: sorted(tuple(r)[:len(old_tables[t][0])] for r in st.read(f"SELECT * FROM {t}"))
                for t in old_tables}
        assert kept == old_tables
        for (project, filters), expected in zip(cases, before):
            assert _listed(st, project, page_size=5, **filters) == expected, (project, filters)
        live = _tables(st, PROJECTION_TABLES)

        def rebuilt(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
            store.rebuild_projections(conn)
            return _tables(conn, PROJECTION_TABLES)
        assert _run(st.write(rebuilt)) == live
    finally:
        st.close()
