"""P6 fan-out: one parent thread whose scripted agent calls `delegate_task` (mode async) 100
times in one turn, over the MCP server t3 injected into its session; every child is a t3 thread
with its own scripted agent process streaming `SLOW:1200` (1,200 chunks 50 ms apart, about a
minute, so that the tasks overlap). Measures the wall time from creating the parent to every
task completed, the peak number of tasks live at once (child runs starting or running), and the
server's RSS growth (VmRSS from /proc/<pid>/status, sampled every 0.2 s) over its idle baseline,
per live task at the peak. Target: <= 2 MB per live task, all tasks complete.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time

import _bench
from harness import wait_until


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    n = 20 if args.quick else 100
    with _bench.scratch_dir("p6") as tmp, _bench.t3_server(tmp) as server, server.client() as mcp:
        db = sqlite3.connect(f"file:{server.data_dir / 't3.sqlite'}?mode=ro", uri=True)
        # Warm up: one delegation end to end, so imports and caches are in the baseline.
        warm = mcp.call("create_threads", {"threads": [{"prompt": "CALL_TOOL delegate_task " + json.dumps(
            {"task": "hello", "mode": "wait"})}]}).structured["threads"][0]
        mcp.call("t3_thread_wait", {"threadId": warm["threadId"], "timeoutMs": 120_000}, timeout=130)
        baseline = _bench.rss_kb(server.pid)
        lines = "\n".join("CALL_TOOL delegate_task " + json.dumps(
            {"task": f"SLOW:1200 child {i}", "mode": "async", "title": f"task {i}"}) for i in range(n))
        peak = {"rss": baseline, "live": 0}

        def all_done() -> bool:
            rss = _bench.rss_kb(server.pid)
            done, failed = db.execute(
                "SELECT SUM(status = 'completed'), "
                "SUM(status IN ('failed', 'cancelled', 'interrupted')) FROM subagents "
                "WHERE thread_id = ?", (parent,)).fetchone()
            running = db.execute("SELECT COUNT(*) FROM runs r JOIN threads t ON t.thread_id = "
                                 "r.thread_id WHERE t.parent_thread_id = ? AND r.status IN "
                                 "('starting', 'running')", (parent,)).fetchone()[0]
            peak["rss"] = max(peak["rss"], rss)
            peak["live"] = max(peak["live"], running)
            if failed:
                raise RuntimeError(f"{failed} delegated tasks failed")
            return (done or 0) == n

        started = time.perf_counter()
        parent = mcp.call("create_threads", {"threads": [{"prompt": lines, "title": "fan-out"}]}
                          ).structured["threads"][0]["threadId"]
        wait_until(all_done, 1200, interval=0.2, message=f"{n} delegated tasks completed")
        wall = time.perf_counter() - started
        with contextlib.closing(db):
            children = db.execute("SELECT COUNT(*) FROM threads WHERE parent_thread_id = ?",
                                  (parent,)).fetchone()[0]
    growth_mb = (peak["rss"] - baseline) / 1024
    per_task = growth_mb / max(peak["live"], 1)
    _bench.report(f"P6 fan-out ({n} delegated tasks)", [
        ("tasks completed", f"{n} of {n} ({children} child threads)"),
        ("wall time, parent created -> all completed", f"{wall:.1f} s"),
        ("peak live tasks (child runs starting/running)", str(peak["live"])),
        ("server RSS baseline -> peak", f"{baseline / 1024:.1f} MB -> {peak['rss'] / 1024:.1f} MB "
                                        f"(+{growth_mb:.1f} MB)"),
        ("RSS growth per live task", f"{per_task:.2f} MB"),
    ], verdict=f"{'PASS' if per_task <= 2 else 'MISS'}: target <= 2 MB per live task")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
