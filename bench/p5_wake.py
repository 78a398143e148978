"""P5 wake: from a run's completion to `t3_thread_wait` returning it, p50/p99.

One thread, one live scripted agent: each sample sends `SLOW:2` (two chunks 50 ms apart) with
`t3_thread_send`, calls `t3_thread_wait` on that run at once, and takes the client's wall clock
when the wait returns. The completion instant is the run's `completedAt` (set when the server
decides the completion, before its commit), read from the database; client and server share
the machine's clock. A sample whose wait was sent after the completion is dropped (none should
be). For scale, an `echo` tool round trip on the same SDK + hypercorn stack (bench/_echo_server.py)
is timed after each sample: a wake also crosses that response path. Target: p99 <= 20 ms.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sqlite3

import _bench
from harness import McpClient
from p3_tools import echo_server


def _completed_at(db_path: str, run_id: str) -> float:
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        payload = json.loads(db.execute("SELECT payload_json FROM runs WHERE run_id = ?",
                                        (run_id,)).fetchone()[0])
    stamp = payload["completedAt"].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    samples = 20 if args.quick else 200
    wakes, echoes, dropped = [], [], 0
    with _bench.scratch_dir("p5") as tmp, _bench.t3_server(tmp) as server, server.client() as mcp, \
            echo_server() as echo_url, McpClient(echo_url, "unused") as echo:
        db_path = str(server.data_dir / "t3.sqlite")
        for wake in _bench.wakes(mcp, lambda run_id: _completed_at(db_path, run_id), samples):
            if wake is None:
                dropped += 1
                continue
            wakes.append(wake)
            echoes.append(_bench.timed(lambda: echo.call("echo", {"text": "ping"})))
    p50, p99 = _bench.median(wakes), _bench.percentile(wakes, 99)
    _bench.report("P5 wake (run completion -> t3_thread_wait returns)", [
        ("samples", f"{len(wakes)} ({dropped} dropped: wait sent after completion)"),
        ("p50", f"{p50 * 1e3:.1f} ms"),
        ("p99", f"{p99 * 1e3:.1f} ms"),
        ("max", f"{max(wakes) * 1e3:.1f} ms"),
        ("echo round trip, same run", f"p50 {_bench.median(echoes) * 1e3:.1f} ms, "
                                      f"p99 {_bench.percentile(echoes, 99) * 1e3:.1f} ms"),
    ], verdict=f"{'PASS' if p99 <= 0.020 else 'MISS'}: target p99 <= 20 ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
