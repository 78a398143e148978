"""P1 command commit: one `message.dispatch` (DispatchMessage, start_immediately on an idle
thread) through the real path in process (`Orchestrator.dispatch`: receipt check, decide, the
store's writer thread, one BEGIN IMMEDIATE commit of receipt + events + projections + outbox,
state applied) against a raw sqlite3 loop writing the same rows with the same pragmas.

Each repetition: N idle threads are created through the real path (not timed), the database is
copied, N dispatches are timed on the original; the rows those dispatches wrote (receipts,
events, projection writes, outbox) are read back and replayed into the copy, one BEGIN IMMEDIATE
... COMMIT per command, with every parameter prepared before the clock starts. The figure is the
median over repetitions of the per-command time. The same n dispatches are also timed made by
20 concurrent callers (each to its own threads), whose commands share transactions (group commit).
Targets: one caller <= 1.5x raw; 20 callers commit >= 2x raw's commands per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import _bench
import orchestrator as o
import store as s

PROVIDERS = {"scripted": o.ProviderInfo(instance_id="scripted", driver="acp", display_name=None,
                                        models=[{"id": "m1"}], capabilities=o.Capabilities())}


TRANSACTIONS = [0]  # store transactions begun, counted while dispatches are timed
_TRANSACTION = s._transaction


def _counted(conn: sqlite3.Connection) -> Any:
    TRANSACTIONS[0] += 1
    return _TRANSACTION(conn)


async def _real(path: Path, copy_to: Path, n: int, callers: int = 1) -> float:
    """Create n idle threads, copy the database, then time n dispatches made by `callers`
    concurrent callers (each dispatching to its own threads, one command at a time); seconds
    per command. TRANSACTIONS holds how many transactions (so fsyncs) those n took."""
    store = s.Store(path, backups_dir=path.parent / "backups")
    try:
        orch = o.Orchestrator(store, adapters={}, providers=PROVIDERS)
        for i in range(n):
            await orch.dispatch(o.CreateThread(
                command_id=f"create-{i}", thread_id=f"thread-{i}", project_id="proj",
                title=f"Thread {i}", provider_instance_id="scripted", model="m1",
                runtime_mode="full-access", interaction_mode="default", workspace="/tmp/ws",
                created_by="user", creation_source="mcp"))
        with contextlib.closing(sqlite3.connect(copy_to)) as dest:
            store._reader.backup(dest)
        commands = [o.DispatchMessage(command_id=f"dispatch-{i}", thread_id=f"thread-{i}",
                                      message_id=f"message-{i}", text=f"message {i}",
                                      created_by="agent", creation_source="mcp",
                                      mode="start_immediately") for i in range(n)]

        async def caller(lane: list[o.DispatchMessage]) -> None:
            for command in lane:
                await orch.dispatch(command)

        TRANSACTIONS[0], s._transaction = 0, _counted
        started = time.perf_counter()
        await asyncio.gather(*(caller(commands[i::callers]) for i in range(callers)))
        return (time.perf_counter() - started) / n
    finally:
        s._transaction = _TRANSACTION
        store.close()


Plan = list[tuple[str, tuple[Any, ...]]]


def command_plans(path: Path, command_type: str, *, thread_id: str | None = None) -> list[Plan]:
    """Per command of `command_type`, in commit order: the statements and parameters that write
    the rows it wrote (receipt, events, each event's projection writes, outbox rows)."""
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    plans = []
    receipts = db.execute("SELECT * FROM command_receipts WHERE command_type = ? "
                          "AND (? IS NULL OR thread_id = ?) ORDER BY rowid",
                          (command_type, thread_id, thread_id)).fetchall()
    for r in receipts:
        plan: list[tuple[str, tuple[Any, ...]]] = [(
            "INSERT INTO command_receipts (command_id, command_type, fingerprint, thread_id, status, "
            "result_sequence, result_json, error, accepted_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (r["command_id"], r["command_type"], r["fingerprint"], r["thread_id"], r["status"],
             r["result_sequence"], r["result_json"], r["error"], r["accepted_at"]))]
        for e in db.execute("SELECT * FROM events WHERE command_id = ? ORDER BY sequence",
                            (r["command_id"],)):
            plan.append(("INSERT INTO events (event_id, thread_id, stream_version, command_id, type, "
                         "occurred_at, payload_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (e["event_id"], e["thread_id"], e["stream_version"], e["command_id"],
                          e["type"], e["occurred_at"], e["payload_json"])))
            plan += s.projection_writes(e["type"], json.loads(e["payload_json"]),
                                        e["payload_json"])
        for x in db.execute("SELECT * FROM effect_outbox WHERE command_id = ?", (r["command_id"],)):
            plan.append((f"INSERT INTO effect_outbox ({', '.join(x.keys())}) "
                         f"VALUES ({', '.join('?' * len(x.keys()))})", tuple(x)))
        plans.append(plan)
    db.close()
    return plans


def replay(path: Path, plans: list[Plan]) -> float:
    """Write each plan in one BEGIN IMMEDIATE ... COMMIT with t3's pragmas; total seconds."""
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode = WAL", "synchronous = FULL", "foreign_keys = ON",
                   "busy_timeout = 5000"):
        conn.execute(f"PRAGMA {pragma}")
    s.add_functions(conn)
    started = time.perf_counter()
    for plan in plans:
        conn.execute("BEGIN IMMEDIATE")
        for sql, params in plan:
            conn.execute(sql, params)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


CALLERS = 20


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    n, reps = (100, 3) if args.quick else (300, 7)
    real_s, group_s, raw_s, rows_per, shared_tx = [], [], [], 0, []
    for rep in range(reps):
        with _bench.scratch_dir("p1") as tmp:
            real_db, raw_db = tmp / "real.sqlite", tmp / "raw.sqlite"
            real_s.append(asyncio.run(_real(real_db, raw_db, n)))
            plans = command_plans(real_db, "message.dispatch")
            rows_per = sum(len(p) for p in plans) // len(plans)
            raw_s.append(replay(raw_db, plans) / len(plans))
            group_s.append(asyncio.run(_real(tmp / "group.sqlite", tmp / "unused.sqlite", n, CALLERS)))
            shared_tx.append(TRANSACTIONS[0] / n)
    real, group, raw = _bench.median(real_s), _bench.median(group_s), _bench.median(raw_s)
    single, shared = real / raw, raw / group
    _bench.report("P1 command commit (message.dispatch)", [
        ("commands per repetition", f"{n} x {reps} repetitions"),
        ("statements per command (raw)", f"{rows_per} (receipt, events, projection upserts, outbox)"),
        ("raw: one sqlite3 transaction each", f"{raw * 1e3:.3f} ms/command ({1 / raw:,.0f}/s)"),
        ("real, one caller", f"{real * 1e3:.3f} ms/command ({1 / real:,.0f}/s): {single:.2f}x raw"),
        (f"real, {CALLERS} concurrent callers", f"{group * 1e3:.3f} ms/command ({1 / group:,.0f}/s): "
                                               f"{shared:.2f}x raw's commands/s, "
                                               f"{_bench.median(shared_tx):.2f} transactions "
                                               f"(fsyncs) per command"),
    ], verdict=f"{'PASS' if single <= 1.5 and shared >= 2 else 'MISS'}: targets one caller <= 1.5x "
               f"raw, {CALLERS} callers >= 2x raw's commands/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
