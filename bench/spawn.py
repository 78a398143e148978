"""Spawn: what the portable process rules add to an agent's start, against the Linux path.

In process (providers.ProviderProcess, as the drivers use it): each sample spawns the scripted
ACP agent (tests/acp_agent.py), sends `initialize` and takes the time until its answer is read,
then stops it; also the time until `spawn()` returns (the process is recorded then). Samples
alternate between the Linux path (PR_SET_PDEATHSIG, start time from /proc) and the portable one
(the trampoline and its watcher, start time from ps), so load hits both alike. Target: the
portable path's answer p50 within 15 ms of the Linux path's (a real agent CLI takes 0.3 to 2 s
to answer `initialize`). Linux only: the comparison needs both paths.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import _bench
import providers


async def _sample(data_dir: Path, *, portable: bool) -> tuple[float, float]:
    providers.PORTABLE = portable
    command = [sys.executable, str(_bench.REPO / "tests" / "acp_agent.py"),
               "--state-dir", str(data_dir / "agent-state")]
    began = time.perf_counter()
    process = await providers.ProviderProcess.spawn(command, cwd=str(data_dir),
                                                    owner=str(data_dir), env={})
    spawned = time.perf_counter()
    assert process.proc.stdin is not None and process.proc.stdout is not None
    process.proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                         "params": {"protocolVersion": 1}}).encode() + b"\n")
    answer = await process.proc.stdout.readline()
    answered = time.perf_counter()
    assert b'"id": 1' in answer or b'"id":1' in answer, answer
    await process.stop(grace=2.0)
    return (spawned - began) * 1000, (answered - began) * 1000


async def _run(data_dir: Path, samples: int) -> dict[bool, list[tuple[float, float]]]:
    (data_dir / "processes").mkdir()
    found: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for portable in (False, True):  # warm both
        await _sample(data_dir, portable=portable)
    for _ in range(samples):
        for portable in (False, True):
            found[portable].append(await _sample(data_dir, portable=portable))
    return found


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    if sys.platform != "linux":
        print("spawn: the Linux path runs on Linux only")
        return 2
    samples = 10 if args.quick else 50
    with _bench.scratch_dir("spawn") as tmp:
        found = asyncio.run(_run(tmp, samples))
    rows, p50 = [], {}
    for portable, name in ((False, "Linux path"), (True, "portable path")):
        spawned = [s for s, _ in found[portable]]
        answered = [a for _, a in found[portable]]
        p50[portable] = _bench.median(answered)
        rows.append((name, f"answer p50 {p50[portable]:.1f} ms, p90 "
                           f"{_bench.percentile(answered, 90):.1f} ms; spawn() returns p50 "
                           f"{_bench.median(spawned):.1f} ms"))
    added = p50[True] - p50[False]
    rows.append(("portable - Linux", f"{added:+.1f} ms ({p50[True] / p50[False]:.2f}x)"))
    _bench.report(f"spawn: {samples} agents per path", rows,
                  verdict="PASS" if added <= 15 else "MISS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
