"""What every bench script shares: import paths, the machine line, medians and percentiles, a
real `t3.py` server on a scratch data dir with the scripted ACP agent, and the result line.

Bench scripts are plain programs (`python bench/<name>.py [--quick]`), not tests: they print
figures and a ratio measured side by side in the same run. They reuse tests/harness.py for the
server process and the MCP client, so they drive exactly what the tests drive.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from harness import T3Server, kill_matching, scripted_provider, write_config  # noqa: E402

__all__ = ["REPO", "machine", "median", "percentile", "timed", "parser", "scratch_dir", "t3_server",
           "wakes", "report", "rss_kb", "cpu_seconds"]


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {model}, Python {platform.python_version()}"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def parser(description: str) -> argparse.ArgumentParser:
    # A SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the servers and agents a bench
    # started are stopped and its scratch directory removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (fewer repetitions)")
    return p


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"t3-bench-{prefix}-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def t3_server(tmp: Path, *, chunk_delay: float = 0.05, data_dir: Path | None = None,
              providers: Sequence[Mapping[str, Any]] | None = None, extra: str = "",
              env: Mapping[str, str] | None = None) -> Iterator[T3Server]:
    """A started `t3.py` on `<tmp>/data` with the scripted agent; every process carrying the
    tmp dir (agents orphaned by a kill -9 included) is killed on exit."""
    marker = f"{tmp}{os.sep}"
    config = write_config(tmp, providers=providers if providers is not None
                          else [scripted_provider(tmp, chunk_delay=chunk_delay)], extra=extra)
    server = T3Server(data_dir or tmp / "data", config, env={"T3_TEST_MARKER": marker, **(env or {})})
    try:
        yield server.start()
    finally:
        server.close()
        kill_matching(marker)


def wakes(mcp: Any, completed_at: Callable[[str], float], samples: int
          ) -> Iterator[float | None]:
    """Run completion to ``t3_thread_wait`` returning it, ``samples`` times on one new thread
    after 3 warm-up runs: each a ``SLOW:2`` run sent with ``t3_thread_send`` and waited on at
    once. The completion is the run's ``completedAt`` (``completed_at(run id)``, from the
    database), the return the client's clock. None: the wait was sent after the completion."""
    thread_id = mcp.call("create_threads", {"threads": [{"title": "wake"}]}).structured[
        "threads"][0]["threadId"]
    for i in range(samples + 3):
        run_id = mcp.call("t3_thread_send", {"threadId": thread_id, "message": f"SLOW:2 {i}"}
                          ).structured["runId"]
        waited_from = time.time()
        done = mcp.call("t3_thread_wait", {"threadId": thread_id, "runId": run_id,
                                           "timeoutMs": 60_000}).structured
        returned = time.time()
        if done["status"] != "completed":
            raise RuntimeError(f"run {run_id} ended {done}")
        completed = completed_at(run_id)
        if i >= 3:
            yield returned - completed if completed >= waited_from else None


def rss_kb(pid: int) -> int:
    """VmRSS of a live process in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU time of a live process, all its threads, in seconds (Linux); with
    `children`, that of its children instead: those it has waited for (exited agents, git) and
    those still running, so that a difference over a span is what they used in it."""
    fields = _stat(pid)
    if not children:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    ticks = int(fields[13]) + int(fields[14])
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            child = _stat(int(entry.name))
            if int(child[1]) == pid:
                ticks += int(child[11]) + int(child[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: state, ppid, ... (utime is [11])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def report(title: str, rows: Sequence[tuple[str, str]], *, verdict: str) -> None:
    """Print the figures as aligned `name: value` lines, then the target verdict."""
    width = max(len(name) for name, _ in rows)
    print(f"\n== {title}  ({machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")
    print(f"  -> {verdict}")
