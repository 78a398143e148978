"""The store on PostgreSQL (store_pg.py): its schema and migration lock, the order of its event
log under several writers, and every read answering as SQLite's does for the same commits.

A real PostgreSQL server (tests/pg.py) and a real SQLite file; the `postgres` tier, skipped saying
why without a server or psycopg. The store's contract itself (commit, receipts, the outbox) runs
on both engines in test_store.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[postgres]')")

import store  # noqa: E402
import store_pg  # noqa: E402
from store import Store  # noqa: E402
from test_store import (LIST_FILTERS, _at, _commit, _event, _mixed_threads, pg_stores_on,  # noqa: E402
                        _run, _run_entity, _several_commits, _thread)

pytestmark = pytest.mark.postgres


def _connect(url: str) -> Any:
    import psycopg
    return psycopg.connect(url, autocommit=True)


@pytest.fixture
def pg_stores(postgres_url: str) -> Iterator[Callable[[], Store]]:
    """`pg_stores()` -> a new Store (a node) on the test's PostgreSQL database."""
    yield from pg_stores_on(postgres_url)


# ---------------------------------------------------------------------------------------------
# Schema


def test_every_postgresql_form_replaces_a_statement_store_runs() -> None:
    """Each statement store_pg translates by hand is still one store.py has: a statement changed
    there without its form here would otherwise go out in SQLite's dialect."""
    statements = {v for v in vars(store).values() if isinstance(v, str)}
    statements |= set(store._UPSERTS.values())
    assert [k for k in store_pg._FORMS if k not in statements and not k.startswith("BEGIN")] == []


def test_the_postgresql_schema_files_are_numbered_as_sqlites() -> None:
    """sql/pg has a file for each number of sql/: a schema version means the same on both."""
    assert [v for v, _ in store.schema_files(store_pg.SQL_DIR)] == \
        [v for v, _ in store.schema_files()]


def _schema(url: str) -> list[tuple[Any, ...]]:
    with _connect(url) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = 'public'").fetchall()
        indexes = conn.execute("SELECT indexname, indexdef FROM pg_indexes "
                               "WHERE schemaname = 'public'").fetchall()
        versions = conn.execute("SELECT version FROM t3_schema ORDER BY version").fetchall()
    return sorted(columns) + sorted(indexes) + versions


def test_postgresql_migrating_file_by_file_equals_applying_all_fresh(
        postgres_server: Any) -> None:
    """Applying sql/pg one file per start gives the schema one start applying all gives."""
    stepwise, fresh = postgres_server.database(), postgres_server.database()
    for version, _ in store.schema_files(store_pg.SQL_DIR):
        assert store_pg.PostgresEngine(stepwise).migrate(stop_after=version) == version
    assert store_pg.PostgresEngine(fresh).migrate() == version
    assert _schema(stepwise) == _schema(fresh)


def test_nodes_starting_together_migrate_once(postgres_url: str) -> None:
    """Four engines migrating one database at the same moment: each sees the newest version,
    every file was applied once (its t3_schema row is a primary key)."""
    barrier = threading.Barrier(4)
    results: list[Any] = []

    def start() -> None:
        barrier.wait()
        try:
            results.append(store_pg.PostgresEngine(postgres_url).migrate())
        except BaseException as exc:  # reported below, with the others
            results.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    latest = store.schema_files(store_pg.SQL_DIR)[-1][0]
    assert results == [latest] * 4
    with _connect(postgres_url) as conn:
        assert conn.execute("SELECT COUNT(*) FROM t3_schema").fetchone()[0] == latest


def test_a_newer_postgresql_database_is_refused_untouched(postgres_url: str) -> None:
    """A database a newer t3 migrated raises DatabaseTooNew and is not changed."""
    store_pg.PostgresEngine(postgres_url).migrate()
    with _connect(postgres_url) as conn:
        conn.execute("INSERT INTO t3_schema (version) VALUES (9999)")
    before = _schema(postgres_url)
    with pytest.raises(store.DatabaseTooNew):
        Store(store_pg.PostgresEngine(postgres_url))
    assert _schema(postgres_url) == before


def test_a_database_that_sorts_text_by_locale_is_refused(postgres_server: Any) -> None:
    """t3 compares ids and times as bytes: a database with a locale's collation is refused
    before anything is created in it, with the command that makes a suitable one."""
    with _connect(postgres_server.url()) as conn:
        conn.execute("CREATE DATABASE by_locale TEMPLATE template0 ENCODING 'UTF8' "
                     "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'")
    url = postgres_server.url("by_locale")
    with pytest.raises(store.StoreError, match="collation C"):
        Store(store_pg.PostgresEngine(url))
    with _connect(url) as conn:
        assert conn.execute("SELECT to_regclass('events')").fetchone()[0] is None


# ---------------------------------------------------------------------------------------------
# The event log under several writers


def test_sequences_are_gap_free_and_in_commit_order_across_nodes(
        pg_stores: Callable[[], Store]) -> None:
    """Two nodes committing at once (each with commits grouped in shared transactions) while a
    third reads events_after its last sequence: every read continues exactly where the previous
    one ended, so no event ever appears below a sequence a reader has already seen, and the
    log ends as 1..N without a gap."""
    nodes, reader = [pg_stores(), pg_stores()], pg_stores()
    per_node, done = 60, threading.Event()

    async def write(node: Store, name: str) -> None:
        await asyncio.gather(*(node.commit(_commit(f"{name}-{i}", f"{name}-th-{i % 5}", [
            _event(f"{name}-ev-{i}-{k}", f"{name}-th-{i % 5}", "run.updated",
                   _run_entity(f"{name}-run-{i % 5}", f"{name}-th-{i % 5}", 1, "running"))
            for k in range(2)])) for i in range(per_node)))

    writers = [threading.Thread(target=lambda n=n, i=i: _run(write(n, f"n{i}")))
               for i, n in enumerate(nodes)]
    for w in writers:
        w.start()
    watcher = threading.Thread(target=lambda: ([w.join(120) for w in writers], done.set()))
    watcher.start()
    seen: list[int] = []
    while True:
        finished = done.is_set()  # read before the events: a last pass after both finished
        rows = reader.events_after(seen[-1] if seen else 0)
        if rows:
            assert rows[0]["sequence"] == (seen[-1] if seen else 0) + 1, "a later read skipped one"
            seen += [r["sequence"] for r in rows]
        elif finished:
            break
    watcher.join()
    total = 2 * per_node * len(nodes)
    assert seen == list(range(1, total + 1))
    versions: dict[str, list[int]] = {}
    for r in reader.events_after(0, limit=total):
        versions.setdefault(r["threadId"], []).append(r["streamVersion"])
    assert all(v == list(range(len(v))) for v in versions.values()), "stream versions in order"


def test_a_nul_in_a_payload_is_kept_and_read_out_without_it(pg_stores: Callable[[], Store]) -> None:
    """PostgreSQL's text cannot hold NUL (and ->> refuses a \\u0000 escape): a title and
    streamed text with NULs commit; a payload keeps them whole; what SQL reads out of one (the
    folded title, appended text) drops only the NULs, not a backslash followed by "u0000"."""
    st = pg_stores()
    title = "a\x00B \\u0000 \\\x00 É"
    assert _run(st.commit(_commit("n1", "th-n", [
        _event("n1-t", "th-n", "thread.created", _thread("th-n", title=title)),
        _event("n1-m", "th-n", "message.created", {"id": "m-n", "threadId": "th-n", "runId": None,
                                                   "text": "x\x00", "streaming": True}),
        _event("n1-a", "th-n", store.TEXT_APPENDED, {"id": "m-n", "threadId": "th-n",
                                                     "text": "y\x00z\\u0000"})]))).committed
    _, entities = st.thread_entities("th-n")
    assert entities["thread"][0]["title"] == title
    assert entities["message"][0]["text"] == "x\x00" + "yz\\u0000"
    for needle in ("ab", "\\u0000", "\\ é"):
        assert st.list_threads("proj", title_contains=needle)[0] == 1, needle


# ---------------------------------------------------------------------------------------------
# Every read answers as SQLite's


def _extra_commits() -> list[Any]:
    """Rows the reads filter on that _mixed_threads lacks: snoozed and archived threads, runs
    waiting for an agent slot (tied on requestedAt), pending requests, scheduled tasks."""
    later = "2025-01-09T00:00:00.000Z"
    return [
        _commit("x1", "sn-1", [_event("x1-e", "sn-1", "thread.created", {
            **_thread("sn-1", title="Snoozed ÉTÉ"), "snoozedUntil": later,
            "snoozedAt": _at(1)})]),
        _commit("x2", "sn-2", [
            _event("x2-e", "sn-2", "thread.created", {
                **_thread("sn-2"), "snoozedUntil": later, "snoozedAt": _at(1)}),
            _event("x2-r", "sn-2", "run.created", {
                **_run_entity("sn-2-r", "sn-2", 1, "failed"), "completedAt": _at(5)})]),
        _commit("x3", "ar-1", [_event("x3-e", "ar-1", "thread.created", {
            **_thread("ar-1", title="NUL\x00 and \\u0000"), "archivedAt": _at(3)})]),
        *[_commit(f"x4-{i}", f"q-{i}", [
            _event(f"x4-{i}-t", f"q-{i}", "thread.created", _thread(f"q-{i}")),
            _event(f"x4-{i}-r", f"q-{i}", "run.created", {
                **_run_entity(f"q-{i}-r", f"q-{i}", 1, "queued"), "awaitingAgentSlot": True,
                "activeAttemptId": f"q-{i}-a", "requestedAt": _at(7 if i % 2 else 6)}),
            _event(f"x4-{i}-q", f"q-{i}", "runtime-request.created", {
                "id": f"rq-{i}", "threadId": f"q-{i}", "status": "pending",
                "createdAt": _at(9 - i % 3)})]) for i in (3, 1, 4, 0, 2)],
        *[_commit(f"x5-{i}", f"task-{i}", [_event(
            f"x5-{i}", f"task-{i}", "scheduled-task.updated", {
            "id": f"task-{i}", "projectId": "proj", "enabled": i != 2,
            "nextRunAt": _at(20 + i), "deletedAt": None,
            "lastRunStatus": "running" if i == 1 else "completed"})]) for i in range(4)],
    ]


def _reads(st: Store) -> dict[str, Any]:
    reads: dict[str, Any] = {}
    for project in ("proj", "other"):
        for n, filters in enumerate([*LIST_FILTERS, {"snoozed": True}, {"snoozed": False},
                                     {"archived": True}, {"archived": None},
                                     {"title_contains": "été"}]):
            for page_size in (3, 100):
                pages, offset = [], 0
                while True:
                    total, page = st.list_threads(project, offset=offset, limit=page_size,
                                                  now=_at(2), **filters)
                    pages.append((total, page))
                    offset += len(page)
                    if not page:
                        break
                reads[f"list {project} {n} {page_size}"] = pages
    threads = sorted({r[0] for r in st.read("SELECT thread_id FROM threads")})
    reads["entities"] = {t: st.thread_entities(t) for t in threads}
    reads["pending requests"] = st.pending_requests()
    reads["scheduled"] = st.scheduled_tasks()
    reads["due"] = st.due_tasks(_at(22))
    reads["next due"] = st.next_due_at()
    reads["awaiting slot"] = st.runs_awaiting_slot()
    reads["recovery"] = sorted(st.threads_needing_recovery())
    reads["events"] = st.events_after(0, limit=10_000)
    reads["touched"] = st.threads_touched_after(10, limit=1000)
    reads["max"] = st.max_sequence()
    reads["deliveries"] = st.deliveries("task-1")
    return reads


def test_every_read_answers_as_on_sqlite(tmp_path: Path, pg_stores: Callable[[], Store]) -> None:
    """The same commits into a SQLite file and a PostgreSQL database: every read the server makes
    (lists with each filter, paged; a thread's entities; requests, tasks, the slot line, what
    a restart recovers; the event log and its sequences) gives the same answer."""
    lite = Store(tmp_path / "t3.sqlite", backups_dir=tmp_path / "backups")
    pg = pg_stores()
    try:
        commits = [_commit(f"mixed-{n}", tid, events) for n, (tid, events) in
                   enumerate(_mixed_threads())] + _extra_commits()
        for s in (lite, pg):
            _several_commits(s)
            for c in commits:
                assert _run(s.commit(c)).committed
        expected, got = _reads(lite), _reads(pg)
        assert expected["awaiting slot"] and expected["due"] and expected["pending requests"]
        assert [k for k in expected if got[k] != expected[k]] == []
    finally:
        lite.close()
