"""P7 many clients: 50 concurrent MCP clients for 60 s against the real server with the scripted
agent, then the same 50 clients for 60 s calling `echo` on bench/_echo_server.py (the same SDK +
hypercorn stack); calls/s of each, their ratio, errors, per-tool latency and peak server RSS.

Each client is an SDK `Client` with its own session and HTTP connection (harness.mcp_session);
all 50 run on one event loop in this process, which loads the machine less than 50 McpClient
portals (50 threads, each with a loop, contending for the GIL): on 2 cores the bench competes
with the server. Each client repeats a fixed cycle of 20 calls, starting at a different place in
it so that the creates are spread out: 1 `create_threads` (one thread, prompt `FAST:3`, which
becomes the client's own thread), 2 `t3_thread_send` (`mode: "queue"`, `FAST:3`: a queued
follow-up run, accepted in any state), 2 `t3_thread_wait` (timeoutMs 10,000: until that run
settles), 9 `t3_thread_read` and 6 `t3_thread_list`. An error is an exception, an `isError`
result, or a wait whose run ended other than `completed`; a wait that times out is counted
apart. The bench config raises `[limits] max_live_agent_processes` to 64 (default 16) so that
every client's thread can keep its agent; nothing else is changed. Before the clock starts,
each client lists the tools and calls each tool once (untimed). Then, once every run has
settled, the same clients make only the cycle's reads and lists for a quarter of the time (at
least 5 s): the server's CPU per read or list call. Also printed: CPU seconds per call of the
server, of its children (agents, git; running or exited) and of this process, whose echo/t3
ratio is what the calls/s ratio tends to when the cores are the limit; under other load the
phases' calls/s depend on the share of the cores each gets. `--quick`: 20 clients, 10 s.
Targets: 0 errors; the server's CPU per read or list call <= 2x the echo server's per call; t3
calls/s >= 0.3x the echo server's.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

import _bench
from harness import child_pids, mcp_session
from p3_tools import echo_server

CYCLE = ("create_threads", "t3_thread_read", "t3_thread_list", "t3_thread_send", "t3_thread_wait",
         "t3_thread_read", "t3_thread_list", "t3_thread_read", "t3_thread_list", "t3_thread_read",
         "t3_thread_send", "t3_thread_wait", "t3_thread_read", "t3_thread_list", "t3_thread_read",
         "t3_thread_list", "t3_thread_read", "t3_thread_read", "t3_thread_list", "t3_thread_read")
READS = tuple(tool for tool in CYCLE if tool in ("t3_thread_read", "t3_thread_list"))
PROMPT = "FAST:3"
UNSETTLED = ["preparing", "queued", "starting", "running", "waiting"]


@dataclass
class Phase:
    """What one phase's clients saw."""
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    errors: list[str] = field(default_factory=list)
    wait_timeouts: int = 0
    elapsed: float = 0.0
    peak_rss_kb: int = 0
    server_cpu: float = 0.0
    children_cpu: float = 0.0  # the server's children, exited or running: agents, git
    bench_cpu: float = 0.0

    @property
    def calls(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    @property
    def cpu_per_call(self) -> float:
        """Seconds of CPU per call of every process the phase ran (server, its children, us)."""
        return (self.server_cpu + self.children_cpu + self.bench_cpu) / self.calls


class _T3Mix:
    """One client's place in CYCLE and its current thread."""

    def __init__(self, start: int) -> None:
        self.step, self.thread_id, self.cycle = start, "", CYCLE

    async def warm(self, client: Any) -> None:
        """Each tool once, untimed: the client's first thread (its run waited for), and the SDK
        compiles each tool's output schema validator on its first result in a session."""
        created = await client.call_tool("create_threads", {"threads": [{"prompt": PROMPT}]})
        self.thread_id = created.structured_content["threads"][0]["threadId"]
        for tool in ("t3_thread_wait", "t3_thread_read", "t3_thread_list", "t3_thread_send",
                     "t3_thread_wait"):
            await client.call_tool(tool, self._args(tool))

    def next_call(self) -> tuple[str, dict[str, Any]]:
        tool, self.step = self.cycle[self.step % len(self.cycle)], self.step + 1
        return tool, self._args(tool)

    def _args(self, tool: str) -> dict[str, Any]:
        return {"create_threads": {"threads": [{"prompt": PROMPT}]},
                "t3_thread_send": {"threadId": self.thread_id, "message": PROMPT, "mode": "queue"},
                "t3_thread_wait": {"threadId": self.thread_id, "timeoutMs": 10_000},
                "t3_thread_list": {}}.get(tool, {"threadId": self.thread_id})

    def seen(self, tool: str, result: dict[str, Any], phase: Phase) -> None:
        if tool == "create_threads":
            self.thread_id = result["threads"][0]["threadId"]
        elif tool == "t3_thread_wait" and result["timedOut"]:
            phase.wait_timeouts += 1
        elif tool == "t3_thread_wait" and result["status"] != "completed":
            phase.errors.append(f"t3_thread_wait: run ended {result['status']}: {result}")


class _EchoMix:
    async def warm(self, client: Any) -> None:
        await client.call_tool(*self.next_call())

    def next_call(self) -> tuple[str, dict[str, Any]]:
        return "echo", {"text": "ping"}

    def seen(self, tool: str, result: dict[str, Any], phase: Phase) -> None:
        pass


async def _drive(client: Any, mix: Any, deadline: float, phase: Phase) -> None:
    while time.perf_counter() < deadline:
        tool, args = mix.next_call()
        started = time.perf_counter()
        try:
            with anyio.fail_after(60):
                result = await client.call_tool(tool, args)
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the run
            phase.errors.append(f"{tool}: {exc!r}")
            continue
        phase.latencies[tool].append(time.perf_counter() - started)
        if result.is_error:
            phase.errors.append(f"{tool}: {result.structured_content or result.content}")
        else:
            mix.seen(tool, result.structured_content, phase)


async def _sample_rss(pid: int, phase: Phase) -> None:
    while True:  # cancelled when the clients are done
        phase.peak_rss_kb = max(phase.peak_rss_kb, _bench.rss_kb(pid))
        await anyio.sleep(0.2)


async def _settle(client: Any) -> None:
    """Until no run of the project is unsettled (each waited for, not polled)."""
    while threads := (await client.call_tool("t3_thread_list", {
            "statuses": UNSETTLED, "limit": 100})).structured_content["threads"]:
        for thread in threads:
            await client.call_tool("t3_thread_wait", {"threadId": thread["threadId"],
                                                      "timeoutMs": 60_000})


async def _timed(sessions: list[Any], mixes: list[Any], *, pid: int, seconds: float) -> Phase:
    phase = Phase()
    server_cpu, bench_cpu = _bench.cpu_seconds(pid), time.process_time()
    children_cpu = _bench.cpu_seconds(pid, children=True)
    started = time.perf_counter()
    async with anyio.create_task_group() as sampler:
        sampler.start_soon(_sample_rss, pid, phase)
        async with anyio.create_task_group() as workers:
            for client, mix in zip(sessions, mixes):
                workers.start_soon(_drive, client, mix, started + seconds, phase)
        sampler.cancel_scope.cancel()
    phase.elapsed = time.perf_counter() - started
    phase.server_cpu = _bench.cpu_seconds(pid) - server_cpu
    phase.bench_cpu = time.process_time() - bench_cpu
    phase.children_cpu = _bench.cpu_seconds(pid, children=True) - children_cpu
    return phase


async def run_phase(url: str, token: str, *, pid: int, clients: int, seconds: float,
                    t3: bool) -> tuple[Phase, Phase | None]:
    """Connect `clients` sessions (each lists the tools and warms up, untimed), then let them
    all call for `seconds`; for t3, then its reads and lists alone (the second Phase)."""
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(mcp_session(url, token)) for _ in range(clients)]
        # 7 is prime to len(CYCLE): the clients' creates are spread over the cycle.
        mixes = [_T3Mix(k * 7) if t3 else _EchoMix() for k in range(clients)]
        for client, mix in zip(sessions, mixes):
            await client.list_tools()  # the SDK takes the output schemas from here
            await mix.warm(client)
        phase = await _timed(sessions, mixes, pid=pid, seconds=seconds)
        if not t3:
            return phase, None
        await _settle(sessions[0])
        for mix in mixes:
            mix.cycle = READS
        return phase, await _timed(sessions, mixes, pid=pid, seconds=max(5.0, seconds / 4))


def _echo_pid() -> int:
    """The echo server's pid: this process's child running bench/_echo_server.py."""
    for pid in child_pids():
        with contextlib.suppress(OSError):
            if b"_echo_server.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise RuntimeError("no echo server process")


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    clients, seconds = (20, 10.0) if args.quick else (50, 60.0)
    limits = "[limits]\nmax_live_agent_processes = 64\n"
    load_before = os.getloadavg()[0]
    with _bench.scratch_dir("p7") as tmp, _bench.t3_server(tmp, extra=limits) as server, \
            echo_server() as echo_url:
        t3, reads = anyio.run(lambda: run_phase(server.mcp_url, server.token, pid=server.pid,
                                                clients=clients, seconds=seconds, t3=True))
        echo, _ = anyio.run(lambda: run_phase(echo_url, "unused", pid=_echo_pid(),
                                              clients=clients, seconds=seconds, t3=False))
    assert reads is not None
    rate = {name: p.calls / p.elapsed for name, p in (("t3", t3), ("echo", echo))}
    ratio = rate["t3"] / rate["echo"]
    read_cpu = reads.server_cpu / reads.calls / (echo.server_cpu / echo.calls)
    errors = len(t3.errors) + len(echo.errors) + len(reads.errors)
    rows = [("clients, seconds per phase", f"{clients}, {seconds:g}"),
            ("t3 calls/s", f"{rate['t3']:.1f} ({t3.calls} calls in {t3.elapsed:.1f} s)"),
            ("echo calls/s", f"{rate['echo']:.1f} ({echo.calls} calls in {echo.elapsed:.1f} s)"),
            ("ratio t3/echo", f"{ratio:.2f}"),
            ("CPU per call, all processes", f"t3 {t3.cpu_per_call * 1e3:.2f} ms, echo "
             f"{echo.cpu_per_call * 1e3:.2f} ms: echo/t3 {echo.cpu_per_call / t3.cpu_per_call:.2f}"
             " (what the calls/s ratio tends to when the cores are the limit)"),
            ("server CPU per read or list call", f"{reads.server_cpu / reads.calls * 1e3:.2f} ms "
             f"({reads.calls} calls in {reads.elapsed:.1f} s, {reads.calls / reads.elapsed:.1f}/s)"
             f": {read_cpu:.2f}x the echo server's per call"),
            ("load average (1 min)", f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after"),
            ("errors", f"{len(t3.errors)} t3, {len(reads.errors)} reads, {len(echo.errors)} echo"
                       + "".join(f"; {e[:300]}" for e in (t3.errors + reads.errors
                                                          + echo.errors)[:3])),
            ("t3_thread_wait timeouts", str(t3.wait_timeouts))]
    for name, phase in (("t3", t3), ("t3 reads", reads), ("echo", echo)):
        rows += [(f"  {tool}", f"{len(v)} calls, p50 {_bench.median(v) * 1e3:.1f} ms, "
                               f"p99 {_bench.percentile(v, 99) * 1e3:.1f} ms")
                 for tool, v in sorted(phase.latencies.items())]
        rows += [(f"{name} server peak RSS", f"{phase.peak_rss_kb / 1024:.1f} MB"),
                 (f"{name} CPU per call", f"server {phase.server_cpu / phase.calls * 1e3:.2f} ms, "
                                          f"its children {phase.children_cpu / phase.calls * 1e3:.2f} ms, "
                                          f"bench client {phase.bench_cpu / phase.calls * 1e3:.2f} ms")]
    ok = errors == 0 and read_cpu <= 2 and ratio >= 0.3
    _bench.report("P7 many clients", rows,
                  verdict=f"{'PASS' if ok else 'MISS'}: {errors} errors, server CPU per read or "
                          f"list call {read_cpu:.2f}x echo's, t3/echo calls/s {ratio:.2f}x; "
                          "targets 0 errors, <= 2x and >= 0.3x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
