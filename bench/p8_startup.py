"""P8 startup: time from process start to `server.json` written, t3 on a 1M-event database and on
a data directory with a backlog next to the bare MCP SDK + hypercorn echo server
(bench/_echo_server.py), and t3 on an empty data directory, started interleaved (big, backlog,
empty, echo, big, ...).

What is timed: from just before `Popen` to the moment this process reads the ready line on the
child's stderr. t3 prints that line right after it renames `server.json` into place (t3.py
`_announce`); the echo server prints its own once it listens. After each t3 start,
`server.json` is checked to name the child's pid. Also shown, not judged: the time to the first
answered `tools/list` over HTTP (each server's full tool list, sent as soon as the line is read),
so that work moved past `server.json` would show up here.

The databases: "empty" is a data directory one server has started on (schema applied, no
threads); "big" is P4's (bench/p4_scale.py `bulk_fill`): one real thread with a completed run,
its events, receipts and outbox rows copied as new threads up to 1M events (`--quick`: 100k).
"backlog" is built by a real server whose config allows one agent process: 20,000 threads created
without a prompt (each one cached by the server, then evicted as the cache passes its bound), then
5,000 threads with a prompt: the first one's run holds the only agent process, the others wait in
line for it (runs `queued`, waiting for a slot), and the server is stopped with them waiting.
`--data DIR` keeps all three in DIR and reuses them on the next run (the 1M fill takes minutes).

Targets (issue 15): big <= 1.3x echo (medians of the time to the ready line); startup does not
grow with the event count: the CPU t3 has used when it is ready, big <= 1.1x empty. Issue 24:
a restart with that backlog is ready within 1.3x the empty data directory's time. CPU time,
not the time to ready, because on 2 shared cores the latter moves by more than 10% from one
start to the next with what else runs; both databases are in the page cache after the first
start, so reading more of the file would show as CPU too. The tolerance: anything that reads
every event costs far more than 10% on 1M events (the run prints what reading every event's
payload once takes, for scale).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import _bench
from harness import T3_PY, T3Server, raw_post, scripted_provider, wait_until, write_config
from p3_tools import ECHO_SERVER, seed_threads
from p4_scale import _server, bulk_fill

READY = re.compile(r"(https?://\S+/mcp)\b")
# Python's default: imported modules' bytecode is cached in __pycache__ (as after a first run,
# or a wheel's install). This sandbox sets PYTHONDONTWRITEBYTECODE; t3.py itself, the script,
# is compiled on every start either way.
CACHED = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TOOLS_LIST = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()


IDLE_THREADS, WAITING_STARTS = 20_000, 5_000
BACKLOG_LIMITS = "[limits]\nmax_live_agent_processes = 1\n"


def build(root: Path, big_n: int) -> dict[str, Path]:
    """The empty, the big and the backlog data directory under `root`, each made unless there."""
    dirs = {"big": root / "big", "backlog": root / "backlog", "empty": root / "empty"}
    root.mkdir(parents=True, exist_ok=True)
    if not (dirs["empty"] / "t3.sqlite").exists():
        with contextlib.closing(_server(root, "empty", dirs["empty"]).start()):
            pass
    if not (dirs["big"] / "t3.sqlite").exists():
        seed = _server(root, "seed", root / "seed")
        with contextlib.closing(seed.start()), seed.client() as mcp:
            template = seed_threads(mcp, 1)[0]
        shutil.copytree(root / "seed", dirs["big"], ignore=shutil.ignore_patterns("server.json", "*.lock"))
        bulk_fill(dirs["big"] / "t3.sqlite", template, big_n)
    if not (dirs["backlog"] / "t3.sqlite").exists():
        build_backlog(root, dirs["backlog"])
    return dirs


def _backlog_server(root: Path, data_dir: Path) -> T3Server:
    config = write_config(root, providers=[scripted_provider(root)], extra=BACKLOG_LIMITS,
                          name="backlog.toml")
    return T3Server(data_dir, config, env={"T3_TEST_MARKER": f"{root}/"}, startup_timeout=300)


def build_backlog(root: Path, data_dir: Path) -> None:
    """IDLE_THREADS threads, then WAITING_STARTS prompts of which all but the first wait in line
    for the one agent process; stopped (SIGTERM) once every start has reached the line."""
    server = _backlog_server(root, data_dir.with_name("backlog-building"))
    with contextlib.closing(server.start()), server.client() as mcp:
        def create(entries: list[dict[str, str]]) -> None:
            for i in range(0, len(entries), 20):
                result = mcp.call("create_threads", {"threads": entries[i:i + 20]}, timeout=300)
                if not result.ok:
                    raise RuntimeError(f"create_threads failed: {result.structured}")
        create([{"title": f"idle {i}"} for i in range(IDLE_THREADS)])
        create([{"title": f"waiting {i}", "prompt": f"SLOW:100000 waiting {i}"}
                for i in range(WAITING_STARTS)])
        db = server.data_dir / "t3.sqlite"

        def lined_up() -> bool:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
                return conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'queued' AND "
                                    "json_extract(payload_json, '$.awaitingAgentSlot')"
                                    ).fetchone()[0] >= WAITING_STARTS - 1
        wait_until(lined_up, 1800, interval=1.0)
    server.data_dir.rename(data_dir)


def start(cmd: list[str], *, data_dir: Path | None) -> tuple[float, float, int, float]:
    """Seconds to the ready line, to the first answered tools/list, the tools it listed, and the
    CPU seconds the server had used when its ready line was read."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=CACHED)
    try:
        assert proc.stderr is not None
        lines = []
        while not (m := READY.search(line := proc.stderr.readline())):
            lines.append(line)
            if not line:
                raise RuntimeError(f"{cmd} exited before it was ready:\n{''.join(lines)}")
        ready, cpu = time.perf_counter() - started, _bench.cpu_seconds(proc.pid)
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if data_dir is not None:
            if json.loads((data_dir / "server.json").read_text())["pid"] != proc.pid:
                raise RuntimeError("server.json does not name the server just started")
            headers["Authorization"] = f"Bearer {(data_dir / 'client-token').read_text().strip()}"
        answer = raw_post(m.group(1), TOOLS_LIST, headers)
        listed = time.perf_counter() - started
        body = answer.body.decode()
        tools = json.loads(body[body.index("{"):body.rindex("}") + 1])["result"]["tools"]
        return ready, listed, len(tools), cpu
    finally:
        proc.terminate()
        proc.wait(30)


def _count_events(db: Path) -> tuple[int, float]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        started = time.perf_counter()
        n = conn.execute("SELECT COUNT(*), SUM(length(payload_json)) FROM events").fetchone()[0]
        return n, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="keep the built data directories here and reuse them")
    p.add_argument("--starts", type=int, help="starts of each server (default 10, --quick 5)")
    args = p.parse_args(argv)
    big_n, starts = (100_000, 5) if args.quick else (1_000_000, 10)
    starts = args.starts or starts
    with contextlib.ExitStack() as stack:
        root = args.data or stack.enter_context(_bench.scratch_dir("p8"))
        began = time.perf_counter()
        dirs = build(root, big_n)
        filled = time.perf_counter() - began
        for k, d in dirs.items():  # writes <root>/<k>.toml
            _backlog_server(root, d) if k == "backlog" else _server(root, k, d)
        events, count_s = _count_events(dirs["big"] / "t3.sqlite")
        big_mb = (dirs["big"] / "t3.sqlite").stat().st_size / 1e6
        cmds = {k: [sys.executable, str(T3_PY), "--port", "0", "--data-dir", str(d),
                    "--config", str(root / f"{k}.toml")] for k, d in dirs.items()}
        cmds["echo"] = [sys.executable, str(ECHO_SERVER)]
        for k in cmds:  # one start each first: the page cache and .pyc files are warm for all
            start(cmds[k], data_dir=dirs.get(k))
        times: dict[str, list[tuple[float, float, int, float]]] = {k: [] for k in cmds}
        for _ in range(starts):
            for k, cmd in cmds.items():
                times[k].append(start(cmd, data_dir=dirs.get(k)))
    ready = {k: _bench.median([t[0] for t in v]) for k, v in times.items()}
    listed = {k: _bench.median([t[1] for t in v]) for k, v in times.items()}
    cpu = {k: _bench.median([t[3] for t in v]) for k, v in times.items()}
    vs_echo, vs_empty = ready["big"] / ready["echo"], cpu["big"] / cpu["empty"]
    backlog = ready["backlog"] / ready["empty"]
    rows = [("big database", f"{events:,} events, {big_mb:.0f} MB"
                             f" (built or found in {filled:.0f} s); reading every event's payload once: "
                             f"{count_s * 1e3:.0f} ms")]
    rows += [(f"{k}", f"ready median {ready[k] * 1e3:.0f} ms (min {min(t[0] for t in v) * 1e3:.0f}, "
                      f"max {max(t[0] for t in v) * 1e3:.0f}) of {starts}; first tools/list "
                      f"({v[0][2]} tools) {listed[k] * 1e3:.0f} ms; CPU to ready {cpu[k] * 1e3:.0f} ms")
             for k, v in times.items()]
    rows += [("big / echo", f"{vs_echo:.2f}x (CPU to ready {cpu['big'] / cpu['echo']:.2f}x)"),
             ("big / empty", f"CPU to ready {vs_empty:.2f}x (ready "
                             f"{ready['big'] / ready['empty']:.2f}x)"),
             ("backlog / empty", f"ready {backlog:.2f}x (CPU to ready "
                                 f"{cpu['backlog'] / cpu['empty']:.2f}x); {WAITING_STARTS:,} "
                                 f"queued starts, {IDLE_THREADS:,} threads at rest")]
    ok = vs_echo <= 1.3 and vs_empty <= 1.1 and backlog <= 1.3
    _bench.report(f"P8 startup ({events:,} events, a backlog, vs echo and empty)", rows,
                  verdict=f"{'PASS' if ok else 'MISS'}: target big <= 1.3x echo ({vs_echo:.2f}x), "
                          f"CPU to ready big <= 1.1x empty ({vs_empty:.2f}x) and backlog <= 1.3x "
                          f"empty ({backlog:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
