"""P4 scale: the P3 reads (t3_thread_read, t3_thread_list) on a database holding 1M events
against one holding 10k, both served at once and read interleaved. (Startup on such a database
is P8's, bench/p8_startup.py, which builds it with `bulk_fill` from here.)

How the databases are made: a real server creates 20 threads in project "proj", each with one
completed run (the threads that are read), and stops. That database is copied twice and each
copy is filled with a bulk loader to 10k and to 1M events: the events of one real thread are
replayed as many new threads in project "bulk", every id in them suffixed per copy, through the
same INSERT into `events` and the same projection writes `store.py` uses
(`store.projection_writes`), in large transactions with synchronous=OFF. Not through `Store.commit`: a million fsynced commits
would take hours. Each copy also gets the template thread's command receipts and (settled)
outbox rows, ids suffixed, so those tables grow with the log as they do in use. `--quick` uses
100k instead of 1M.

Target: read p50 on the big database <= 1.3x the small one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import _bench
import store as s
from harness import T3Server, scripted_provider, write_config
from p3_tools import measure, seed_threads

SEED_THREADS = 20


def _suffixed(value: Any, suffix: str) -> Any:
    """The payload with every id (keys `id`, `*Id`; lists under `*Ids`) suffixed."""
    if isinstance(value, dict):
        return {k: (v + suffix if isinstance(v, str) and (k == "id" or k.endswith("Id"))
                    else [x + suffix for x in v] if k.endswith("Ids") and isinstance(v, list)
                    else _suffixed(v, suffix)) for k, v in value.items()}
    if isinstance(value, list):
        return [_suffixed(v, suffix) for v in value]
    return value


def bulk_fill(db_path: Path, template_thread: str, total_events: int) -> int:
    """Add copies of one thread's events (project "bulk") until the log holds `total_events`."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    s.add_functions(conn)
    # Each template event is prepared once with a marker in every id; a copy only replaces it.
    marker = "~bulk#"
    template = []
    for version, type_, occurred_at, payload_json in conn.execute(
            "SELECT stream_version, type, occurred_at, payload_json FROM events "
            "WHERE thread_id = ? ORDER BY sequence", (template_thread,)).fetchall():
        body = _suffixed(json.loads(payload_json), marker)
        kind = s.event_kind(type_)
        if kind == "thread":
            body["projectId"] = "bulk"
        text = json.dumps(body, separators=(",", ":"))
        template.append((version, type_, occurred_at, text,
                         s.projection_writes(type_, body, text)))
    have = conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    # The template's receipts and settled outbox rows, read once (command_receipts has no
    # index by thread: a lookup per copy would make the fill quadratic).
    conn.execute("CREATE TEMP TABLE template_receipts AS SELECT * FROM command_receipts "
                 "WHERE thread_id = ?", (template_thread,))
    conn.execute("CREATE TEMP TABLE template_outbox AS SELECT * FROM effect_outbox WHERE "
                 "thread_id = ? AND status IN ('succeeded', 'failed', 'cancelled')", (template_thread,))
    copy = 0
    conn.execute("BEGIN")
    while have < total_events:
        copy += 1
        suffix = f"~bulk{copy}"
        thread_id = template_thread + suffix
        for version, type_, occurred_at, text, writes in template:
            if have >= total_events:
                break
            conn.execute(s._INSERT_EVENT, (f"event:{have}{suffix}", thread_id, version,
                                           f"bulk{suffix}", type_, occurred_at,
                                           text.replace(marker, suffix))).fetchone()
            for sql, params in writes:
                conn.execute(sql, tuple(v.replace(marker, suffix) if isinstance(v, str) else v
                                        for v in params))
            have += 1
        for sql in _COPY_ROWS:  # the thread's command receipts and settled outbox rows
            conn.execute(sql, (suffix, suffix))
        if copy % 2000 == 0:
            conn.execute("COMMIT")
            conn.execute("BEGIN")
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return have


_COPY_ROWS = ("INSERT INTO command_receipts SELECT command_id || ?1, command_type, fingerprint, "
              "thread_id || ?2, status, result_sequence, result_json, error, accepted_at "
              "FROM temp.template_receipts",
              "INSERT INTO effect_outbox SELECT effect_id || ?1, command_id || ?1, thread_id || ?2, "
              "effect_type, payload_json, replay_safe, status, attempt_count, max_attempts, "
              "available_at_ms, lease_owner, lease_expires_ms, last_error, created_at, updated_at "
              "FROM temp.template_outbox")


BULK_LISTS = (("", {}), (" filtered", {"statuses": ["completed"], "titleContains": "no such"}))


def _bulk_threads(db_path: Path) -> int:
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        return conn.execute("SELECT COUNT(*) FROM threads WHERE project_id = 'bulk'").fetchone()[0]


def _server(tmp: Path, name: str, data_dir: Path) -> T3Server:
    projects = [{"id": "proj", "path": str(tmp / "workspace"), "title": "Test project"},
                {"id": "bulk", "path": str(tmp / "workspace"), "title": "Bulk"}]
    (tmp / "workspace").mkdir(exist_ok=True)
    config = write_config(tmp, providers=[scripted_provider(tmp)], projects=projects,
                          name=f"{name}.toml")
    return T3Server(data_dir, config, env={"T3_TEST_MARKER": f"{tmp}/"})


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    small_n, big_n = 10_000, (100_000 if args.quick else 1_000_000)
    samples = 40 if args.quick else 300
    with _bench.scratch_dir("p4") as tmp:
        seed = _server(tmp, "seed", tmp / "seed")
        with contextlib.closing(seed.start()), seed.client() as mcp:
            thread_ids = seed_threads(mcp, SEED_THREADS)
        dirs = {"small": tmp / "small", "big": tmp / "big"}
        fill_s = {}
        for (name, data_dir), n in zip(dirs.items(), (small_n, big_n)):
            shutil.copytree(tmp / "seed", data_dir, ignore=shutil.ignore_patterns("server.json", "*.lock"))
            fill_s[name] = _bench.timed(lambda d=data_dir, n=n: bulk_fill(d / "t3.sqlite", thread_ids[0], n))
        sizes = {k: (d / "t3.sqlite").stat().st_size for k, d in dirs.items()}
        bulk_threads = {k: _bulk_threads(d / "t3.sqlite") for k, d in dirs.items()}
        servers = {k: _server(tmp, k, d) for k, d in dirs.items()}
        with contextlib.ExitStack() as stack:
            clients = {}
            for k, server in servers.items():
                stack.callback(server.close)
                server.start()
                clients[k] = stack.enter_context(server.client())
            calls = {f"{tool} {k}": (clients[k], tool, a) for tool, a in (
                ("t3_thread_read", {"threadId": thread_ids[7]}), ("t3_thread_list", {}))
                for k in dirs}
            times = measure(calls, samples)
            # Informational: project "bulk" holds every bulk thread (about 66,000 at 1M events).
            # The first page is an index range scan; the total still counts every match, and a
            # filter is tested on each thread (this one matches none).
            bulk_list = measure({f"{k}{label}": (clients[k], "t3_thread_list",
                                                 {"projectId": "bulk", **extra})
                                 for k in dirs for label, extra in BULK_LISTS},
                                5 if args.quick else 20)
    p50 = {k: _bench.median(v) for k, v in times.items()}
    p99 = {k: _bench.percentile(v, 99) for k, v in times.items()}
    ratios = {tool: p50[f"{tool} big"] / p50[f"{tool} small"]
              for tool in ("t3_thread_read", "t3_thread_list")}
    rows = [("events", f"small {small_n:,} ({sizes['small'] / 1e6:.0f} MB, filled in "
                       f"{fill_s['small']:.0f} s), big {big_n:,} ({sizes['big'] / 1e6:.0f} MB, "
                       f"filled in {fill_s['big']:.0f} s)")]
    rows += [(k, f"p50 {p50[k] * 1e3:.2f} ms, p99 {p99[k] * 1e3:.2f} ms") for k in times]
    rows += [(f"{tool} big/small p50", f"{r:.2f}x") for tool, r in ratios.items()]
    rows += [(f"list of project 'bulk' {k}", f"p50 {_bench.median(v) * 1e3:.1f} ms "
                                             f"({bulk_threads[k.split()[0]]:,} threads)")
             for k, v in bulk_list.items()]
    ok = max(ratios.values()) <= 1.3
    _bench.report("P4 scale (1M vs 10k events)" if not args.quick else "P4 scale (100k vs 10k events)",
                  rows, verdict=f"{'PASS' if ok else 'MISS'}: target reads <= 1.3x (worst read "
                                f"ratio {max(ratios.values()):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
