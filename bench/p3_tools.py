"""P3 tool latency: t3_thread_read and t3_thread_list round trips over MCP (the SDK client,
Streamable HTTP, bearer auth) against the real server, next to a trivial `echo` tool served by
bench/_echo_server.py on the same SDK + hypercorn stack. The three calls are interleaved
(read, list, echo, read, ...) from one client process so they share the machine's noise.
The database holds 20 threads, each with one completed run. Target: p50 <= 1.5x echo p50.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import _bench
from harness import McpClient, ServerStartError

ECHO_SERVER = _bench.BENCH / "_echo_server.py"


@contextlib.contextmanager
def echo_server() -> Iterator[str]:
    """Start bench/_echo_server.py; yield its MCP URL."""
    proc = subprocess.Popen([sys.executable, str(ECHO_SERVER)], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # blocks until the ready line (or EOF if it died)
        if not (m := re.search(r"http://\S+/mcp", line)):
            raise ServerStartError(f"echo server did not start: {line}{proc.stderr.read()}")
        yield m.group(0)
    finally:
        proc.terminate()
        proc.wait(10)


def seed_threads(mcp: McpClient, n: int) -> list[str]:
    created = mcp.call("create_threads", {"threads": [{"prompt": f"hello {i}"} for i in range(n)]})
    ids = [t["threadId"] for t in created.structured["threads"]]
    for thread_id in ids:
        if mcp.call("t3_thread_wait", {"threadId": thread_id}).structured["status"] != "completed":
            raise RuntimeError(f"seed thread {thread_id} did not complete")
    return ids


def measure(calls: dict[str, tuple[McpClient, str, dict]], samples: int) -> dict[str, list[float]]:
    """Interleave the calls; per label, the round-trip seconds of `samples` successful calls."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for label, (client, tool, args) in calls.items():  # warm up each path
        for _ in range(5):
            client.call(tool, args)
    for _ in range(samples):
        for label, (client, tool, args) in calls.items():
            started = time.perf_counter()
            result = client.call(tool, args)
            times[label].append(time.perf_counter() - started)
            if not result.ok:
                raise RuntimeError(f"{tool} failed: {result.structured}")
    return times


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    samples = 60 if args.quick else 400
    with _bench.scratch_dir("p3") as tmp, _bench.t3_server(tmp) as server, server.client() as mcp, \
            echo_server() as echo_url, McpClient(echo_url, "unused") as echo:
        thread_ids = seed_threads(mcp, 20)
        times = measure({"t3_thread_read": (mcp, "t3_thread_read", {"threadId": thread_ids[7]}),
                         "t3_thread_list": (mcp, "t3_thread_list", {}),
                         "echo": (echo, "echo", {"text": "ping"})}, samples)
    p50 = {k: _bench.median(v) for k, v in times.items()}
    p99 = {k: _bench.percentile(v, 99) for k, v in times.items()}
    rows = [(label, f"p50 {p50[label] * 1e3:.2f} ms, p99 {p99[label] * 1e3:.2f} ms"
                    + ("" if label == "echo" else f", p50 ratio {p50[label] / p50['echo']:.2f}x"))
            for label in times]
    worst = max(p50["t3_thread_read"], p50["t3_thread_list"]) / p50["echo"]
    _bench.report("P3 tool latency over MCP", [("samples per tool", str(samples)), *rows],
                  verdict=f"{'PASS' if worst <= 1.5 else 'MISS'}: worst p50 ratio {worst:.2f}x, "
                          "target <= 1.5x echo")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
