"""P9 cluster: t3 on PostgreSQL beside SQLite, and what more nodes add.

(a) One node on PostgreSQL beside one on SQLite, same machine, same workload, one after the
    other: 8 clients, each on its own thread, loop send + wait + read + list for a fixed time
    (tool calls per second); then wake latency as bench/p5_wake.py measures it (a run's
    `completedAt` to `t3_thread_wait` returning). Targets: PostgreSQL at least 0.5x SQLite's
    calls per second, wake p99 at most 2x.
(b) Capacity: one parent agent delegates 60 tasks whose scripted agents each stream for 2 s (as
    on a model), with `max_live_agent_processes = 4` per node, on one, two and three nodes of
    one database (the same data, a new database each time). The time is from the parent's
    creation to the last child's `completedAt`. Target: three nodes in at most 0.4x one node's
    time, every task completed. Printed with it: the ideal (60 x 2 s over the slots), when the
    parent's agent made its last delegation (its 60 calls go one after another), and how the
    children spread over the nodes.

Needs PostgreSQL's server binaries (tests/pg.py starts a throwaway server) and psycopg.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _bench
import pg
from harness import T3Server, kill_matching, scripted_provider, write_config

TASKS, TASK_S, SLOTS = 60, 2.0, 4


def _stamp(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class _Db:
    """Reads of a server's database, SQLite file or PostgreSQL URL."""

    def __init__(self, where: str) -> None:
        self.where = where

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        if self.where.startswith("postgresql://"):
            import psycopg
            with psycopg.connect(self.where) as conn:
                return conn.execute(sql.replace("?", "%s"), params).fetchall()
        with contextlib.closing(sqlite3.connect(f"file:{self.where}?mode=ro", uri=True)) as db:
            return db.execute(sql, params).fetchall()

    def completed_at(self, run_id: str) -> float:
        payload = self.rows("SELECT payload_json FROM runs WHERE run_id = ?", run_id)[0][0]
        return _stamp(json.loads(payload)["completedAt"])


@contextlib.contextmanager
def _nodes(tmp: Path, count: int, url: str | None, *, extra: str = "") -> Iterator[list[T3Server]]:
    """`count` started servers on `url` (None: one on SQLite), each its own data dir and node."""
    marker = f"{tmp}{os.sep}"
    tmp.mkdir(parents=True, exist_ok=True)
    servers = []
    try:
        for n in range(count):
            config = write_config(tmp, name=f"node-{n}.toml",
                                  providers=[scripted_provider(tmp, chunk_delay=0.05)],
                                  extra=extra + (f'[node]\nid = "n{n}"\n' if url else ""))
            servers.append(T3Server(tmp / f"data-{n}", config,
                                    args=["--database", url] if url else [],
                                    env={"T3_TEST_MARKER": marker}).start())
        yield servers
    finally:
        for server in reversed(servers):
            server.close()
        kill_matching(marker)


def _calls_per_second(server: T3Server, seconds: float) -> float:
    """8 clients, each on its own thread: send, wait, read, list, for `seconds`."""
    done, failures = [0] * 8, []
    deadline = time.monotonic() + seconds

    def client(n: int) -> None:
        with server.client() as mcp:
            tid = mcp.call("create_threads", {"threads": [{"prompt": "hi"}]}).structured[
                "threads"][0]["threadId"]
            mcp.call("t3_thread_wait", {"threadId": tid, "timeoutMs": 60_000})
            while time.monotonic() < deadline:
                sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "hi"})
                waited = mcp.call("t3_thread_wait", {"threadId": tid, "timeoutMs": 60_000,
                                                     "runId": sent.structured.get("runId")})
                read = mcp.call("t3_thread_read", {"threadId": tid})
                listed = mcp.call("t3_thread_list", {})
                if not all(r.ok for r in (sent, waited, read, listed)):
                    failures.append(n)
                    return
                done[n] += 4
    started = time.monotonic()
    _run_all([lambda n=n: client(n) for n in range(8)])
    if failures:
        raise RuntimeError(f"clients {failures} got errors")
    return sum(done) / (time.monotonic() - started)


def _wakes(server: T3Server, db: _Db, samples: int) -> list[float]:
    with server.client() as mcp:
        return [w for w in _bench.wakes(mcp, db.completed_at, samples) if w is not None]


def _run_all(jobs: list[Callable[[], Any]]) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _capacity(tmp: Path, server: pg.PostgresServer, count: int) -> dict[str, Any]:
    """The 60 delegated tasks on `count` nodes: seconds to the last completion, and spread."""
    url = server.database()
    lines = "\n".join("CALL_TOOL delegate_task " + json.dumps({
        "task": "SLOW:40", "title": f"task {i}", "clientRequestId": f"t{i}"})
        for i in range(TASKS))
    with _nodes(tmp / f"cap-{count}", count, url,
                extra=f"[limits]\nmax_live_agent_processes = {SLOTS}\n") as nodes, \
            nodes[0].client() as mcp:
        db = _Db(url)
        started = time.time()
        parent = mcp.call("create_threads", {"threads": [{"prompt": lines}]}).structured[
            "threads"][0]["threadId"]
        mcp.call("t3_thread_wait", {"threadId": parent, "timeoutMs": 600_000})
        children = [r[0] for r in db.rows(
            "SELECT thread_id FROM threads WHERE thread_id <> ?", parent)]
        if len(children) != TASKS:
            raise RuntimeError(f"{len(children)} children, not {TASKS}")

        def wait(ids: list[str]) -> None:
            with nodes[0].client() as waiter:
                for tid in ids:
                    waiter.call("t3_thread_wait", {"threadId": tid, "timeoutMs": 600_000})
        _run_all([lambda ids=children[k::10]: wait(ids) for k in range(10)])
        runs = db.rows("SELECT r.status, r.payload_json FROM runs r WHERE r.thread_id <> ?",
                       parent)
        completed = [_stamp(json.loads(p)["completedAt"]) for s, p in runs if s == "completed"]
        spread = dict(db.rows("SELECT node_id, COUNT(*) FROM thread_holders WHERE thread_id <> ? "
                              "GROUP BY node_id ORDER BY node_id", parent))
        made = max(_stamp(json.loads(p)["createdAt"]) for (p,) in db.rows(
            "SELECT payload_json FROM threads WHERE thread_id <> ?", parent))
        return {"seconds": max(completed) - started, "completed": len(completed),
                "spread": spread, "delegated": made - started}


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    if (why := pg.unavailable()) is not None:
        print(f"p9_cluster: skipped: {why}")
        return 0
    seconds, samples = (5.0, 15) if args.quick else (20.0, 100)
    server = pg.PostgresServer().start()
    try:
        with _bench.scratch_dir("p9") as tmp:
            rate, wake = {}, {}
            for name, url in (("sqlite", None), ("postgres", server.database())):
                with _nodes(tmp / name, 1, url) as (node,):
                    db = _Db(url or str(node.data_dir / "t3.sqlite"))
                    rate[name] = _calls_per_second(node, seconds)
                    wake[name] = _wakes(node, db, samples)
            p99 = {k: _bench.percentile(v, 99) for k, v in wake.items()}
            rate_ratio, wake_ratio = rate["postgres"] / rate["sqlite"], p99["postgres"] / p99["sqlite"]
            _bench.report("P9a one node: PostgreSQL beside SQLite", [
                ("calls/s (8 clients)", f"sqlite {rate['sqlite']:.0f}, postgres "
                                        f"{rate['postgres']:.0f}: {rate_ratio:.2f}x"),
                ("wake p50", ", ".join(f"{k} {_bench.median(v) * 1e3:.1f} ms"
                                       for k, v in wake.items())),
                ("wake p99", f"sqlite {p99['sqlite'] * 1e3:.1f} ms, postgres "
                             f"{p99['postgres'] * 1e3:.1f} ms: {wake_ratio:.2f}x"),
            ], verdict=("PASS" if rate_ratio >= 0.5 and wake_ratio <= 2 else "MISS")
                + ": target calls/s >= 0.5x, wake p99 <= 2x")
            cap = {n: _capacity(tmp, server, n) for n in (1, 2, 3)}
            lost = [n for n, c in cap.items() if c["completed"] != TASKS]
            ratio = cap[3]["seconds"] / cap[1]["seconds"]
            _bench.report(f"P9b capacity: {TASKS} delegated tasks of {TASK_S:.0f} s, "
                          f"{SLOTS} agent slots per node", [
                (f"{n} node(s)", f"{c['seconds']:.1f} s (ideal {TASKS * TASK_S / (SLOTS * n):.1f} "
                                 f"s; the parent's last delegation at {c['delegated']:.1f} s), "
                                 f"{c['completed']}/{TASKS} completed, children per node "
                                 f"{c['spread']}") for n, c in cap.items()
            ] + [("three / one", f"{ratio:.2f}x")],
                verdict=("PASS" if ratio <= 0.4 and not lost else "MISS")
                + ": target three nodes <= 0.4x one node's time, nothing lost")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
