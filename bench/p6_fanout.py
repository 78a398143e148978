"""P6 fan-out: many live delegated tasks at once, server RSS per live task and wake latency.

One parent thread whose scripted agent calls `delegate_task` (mode async) 200 times (`--quick`:
40) in one turn, over the MCP server t3 injected into its session; every child is a t3 thread
with its own scripted agent process streaming `SLOW:n` chunks long enough that all tasks are live
at once. `max_live_agent_processes` is raised to fit every task. Measures:
- completion: every task `completed`, and the wall time from creating the parent;
- the peak number of live tasks (child runs starting/running) and of the server's child processes;
- the server's RSS growth (VmRSS from /proc/<pid>/status, sampled every 0.2 s) over its idle
  baseline, per live task at the peak (the server process only, not its agents);
- wake latency during the run, as P5 measures it: a second MCP client keeps sending `SLOW:2` to
  a probe thread (its own provider entry, 50 ms chunks) and calls `t3_thread_wait` on each run;
  a sample is the run's `completedAt` (server clock, set in decide) to the wait returning
  (client clock, same machine). Samples count from the parent's creation to the last task's
  completion; the ones taken while at least 95% of the tasks were live are also shown alone,
  and the same probe's samples just before the fan-out (no task live) are the side-by-side
  reference for what the machine's load alone costs;
- the parent's wake, from the server's own timestamps: a child run's `completedAt` to its task's
  `completedAt` (the finalization the parent's agent is woken by).
Target: all complete, <= 1 MB server RSS per live task, wake p99 <= 50 ms.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from pathlib import Path

import _bench
from harness import scripted_provider, wait_until
from p5_wake import _completed_at

_PARENT_WAKE = """
SELECT (julianday(json_extract(s.payload_json, '$.completedAt'))
        - julianday(json_extract(r.payload_json, '$.completedAt'))) * 86400.0
FROM subagents s JOIN runs r ON r.run_id = json_extract(s.payload_json, '$.childRunId')
WHERE s.thread_id = ? AND s.status = 'completed'"""


def _server_children(pid: int) -> int:
    """How many child processes the server has now (its agents), over all its threads."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            count += len((task / "children").read_text().split())
    return count


def _probe(server: _bench.T3Server, db_path: str, stop: threading.Event, live: dict[str, int],
           samples: list[tuple[float, int]]) -> None:
    """Wake samples on a thread of its own until ``stop``: (seconds, live tasks at the time)."""
    with server.client() as mcp:
        thread_id = mcp.call("create_threads", {"threads": [{
            "title": "wake probe", "target": {"providerInstanceId": "probe"}}]}).structured["threads"][0][
            "threadId"]
        i = 0
        while not stop.is_set():
            i += 1
            run_id = mcp.call("t3_thread_send", {"threadId": thread_id,
                                                 "message": f"SLOW:2 {i}"}).structured["runId"]
            waited_from = time.time()
            done = mcp.call("t3_thread_wait", {"threadId": thread_id, "runId": run_id,
                                               "timeoutMs": 60_000}, timeout=70).structured
            returned = time.time()
            if done["status"] != "completed":
                raise RuntimeError(f"probe run {run_id} ended {done}")
            completed = _completed_at(db_path, run_id)
            if i > 3 and completed >= waited_from:  # after a warm-up; the wait was in time
                samples.append((returned - completed, live["now"]))


def _ms(values: list[float]) -> str:
    if not values:
        return "no samples"
    return (f"p50 {_bench.median(values) * 1e3:.1f} ms, p99 "
            f"{_bench.percentile(values, 99) * 1e3:.1f} ms, max {max(values) * 1e3:.1f} ms "
            f"({len(values)} samples)")


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser(__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, help="delegated tasks (default 200, --quick 40)")
    p.add_argument("--chunks", type=int, help="SLOW:n chunks per child (default 600, --quick 120)")
    p.add_argument("--chunk-delay", type=float, default=0.25, help="seconds between chunks")
    p.add_argument("--keep", type=Path, help="copy the final database here (for a post-mortem)")
    args = p.parse_args(argv)
    n = args.tasks or (40 if args.quick else 200)
    args.chunks = args.chunks or (120 if args.quick else 600)
    with _bench.scratch_dir("p6") as tmp:
        providers = [scripted_provider(tmp, chunk_delay=args.chunk_delay),
                     scripted_provider(tmp, id="probe", chunk_delay=0.05)]
        with _bench.t3_server(tmp, providers=providers,
                              extra=f"[limits]\nmax_live_agent_processes = {n + 8}\n") as server, \
                server.client() as mcp:
            figures = _fan_out(server, mcp, n, args.chunks, args.keep, 10 if args.quick else 40)
    return _report(n, args, figures)


def _fan_out(server: _bench.T3Server, mcp: object, n: int, chunks: int, keep: Path | None,
             idle_samples: int) -> dict[str, object]:
    db_path = str(server.data_dir / "t3.sqlite")
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    # Warm up: one delegation end to end, so imports and caches are in the baseline.
    warm = mcp.call("create_threads", {"threads": [{"prompt": "CALL_TOOL delegate_task " + json.dumps(
        {"task": "hello", "mode": "wait"})}]}).structured["threads"][0]
    mcp.call("t3_thread_wait", {"threadId": warm["threadId"], "timeoutMs": 120_000}, timeout=130)
    baseline = _bench.rss_kb(server.pid)
    lines = "\n".join("CALL_TOOL delegate_task " + json.dumps(
        {"task": f"SLOW:{chunks} child {i}", "mode": "async", "title": f"task {i}"})
        for i in range(n))
    peak = {"rss": baseline, "live": 0, "procs": 0}
    live = {"now": 0}
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    probe = threading.Thread(target=_probe, args=(server, db_path, stop, live, samples))

    def all_done() -> bool:
        done, failed = db.execute(
            "SELECT SUM(status = 'completed'), "
            "SUM(status IN ('failed', 'cancelled', 'interrupted')) FROM subagents "
            "WHERE thread_id = ?", (parent,)).fetchone()
        live["now"] = db.execute(
            "SELECT COUNT(*) FROM runs r JOIN threads t ON t.thread_id = r.thread_id WHERE "
            "t.parent_thread_id = ? AND r.status IN ('starting', 'running')", (parent,)).fetchone()[0]
        peak["rss"] = max(peak["rss"], _bench.rss_kb(server.pid))
        peak["live"] = max(peak["live"], live["now"])
        peak["procs"] = max(peak["procs"], _server_children(server.pid))
        if failed:
            raise RuntimeError(f"{failed} delegated tasks failed")
        if not probe.is_alive():
            raise RuntimeError("the wake probe stopped")
        return (done or 0) == n

    probe.start()
    wait_until(lambda: len(samples) >= idle_samples or not probe.is_alive(), 300,
               message="the probe's samples before the fan-out")
    if not probe.is_alive():
        raise RuntimeError("the wake probe stopped")
    idle = [s for s, _ in samples]
    del samples[:]
    started, cpu_from = time.perf_counter(), _bench.cpu_seconds(server.pid)
    parent = mcp.call("create_threads", {"threads": [{"prompt": lines, "title": "fan-out"}]}
                      ).structured["threads"][0]["threadId"]
    try:
        wait_until(all_done, 3600, interval=0.2, message=f"{n} delegated tasks completed")
    finally:
        stop.set()
        probe.join()
    wall = time.perf_counter() - started
    cpu = _bench.cpu_seconds(server.pid) - cpu_from
    with contextlib.closing(db):
        children = db.execute("SELECT COUNT(*) FROM threads WHERE parent_thread_id = ?",
                              (parent,)).fetchone()[0]
        parent_wakes = [row[0] for row in db.execute(_PARENT_WAKE, (parent,))]
        if keep:
            with contextlib.closing(sqlite3.connect(keep)) as dest:
                db.backup(dest)
    return {"baseline": baseline, "peak": peak, "wall": wall, "cpu": cpu, "children": children,
            "idle": idle,
            "samples": samples, "parent_wakes": parent_wakes}


def _report(n: int, args: object, f: dict[str, object]) -> int:
    peak, baseline = f["peak"], f["baseline"]
    growth_mb = (peak["rss"] - baseline) / 1024
    per_task = growth_mb / max(peak["live"], 1)
    wakes = [s for s, _ in f["samples"]]
    plateau = [s for s, live in f["samples"] if live >= 0.95 * n]
    p99 = _bench.percentile(wakes, 99) if wakes else float("inf")
    idle_p99 = _bench.percentile(f["idle"], 99)
    ok = f["children"] == n and per_task <= 1 and p99 <= 0.050
    _bench.report(f"P6 fan-out ({n} delegated tasks, SLOW:{args.chunks} at "
                  f"{args.chunk_delay * 1e3:.0f} ms a chunk)", [
        ("tasks completed", f"{n} of {n} ({f['children']} child threads)"),
        ("wall time, parent created -> all completed", f"{f['wall']:.1f} s"),
        ("server CPU over that time", f"{f['cpu']:.1f} s ({f['cpu'] / f['wall'] * 100:.0f}% of one core)"),
        ("peak live tasks (child runs starting/running)", str(peak["live"])),
        ("peak server child processes (agents)", str(peak["procs"])),
        ("server RSS baseline -> peak", f"{baseline / 1024:.1f} MB -> {peak['rss'] / 1024:.1f} MB "
                                        f"(+{growth_mb:.1f} MB)"),
        ("RSS growth per live task", f"{per_task:.2f} MB"),
        ("wake before the fan-out (no live task)", _ms(f["idle"])),
        ("wake during the run", f"{_ms(wakes)}; p99 {p99 / idle_p99:.1f}x the one before"),
        (f"wake with >= {0.95 * n:.0f} tasks live", _ms(plateau)),
        ("parent's wake (child done -> task done)", _ms(f["parent_wakes"])),
    ], verdict=f"{'PASS' if ok else 'MISS'}: target all complete, <= 1 MB per live task, "
               f"wake p99 <= 50 ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
