"""The process rules of providers.py, in process, with real subprocesses: the record each provider
process leaves in the data directory, what a starting server's sweep ends with it (the same
process, not a reused pid), and the portable path's watcher (it alone holds the pipe only t3
writes). Each test runs with both process rules (``process_rules``); the server-level crash tests
are test_crash.py's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import pids_alive, process_group, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import providers  # noqa: E402
from providers import ProviderProcess, kill_orphans  # noqa: E402


@pytest.fixture
def portable(process_rules: dict[str, str], monkeypatch: pytest.MonkeyPatch,
             tmp_path: Path) -> Iterator[bool]:
    """The process rules in this process; ``tmp_path`` is the data directory."""
    monkeypatch.setattr(providers, "PORTABLE", process_rules["T3_PORTABLE_PROCESSES"] == "1")
    (tmp_path / "processes").mkdir()
    yield providers.PORTABLE


def group_members(group: int) -> list[int]:
    return pids_alive(int(p.name) for p in Path("/proc").iterdir()
                      if p.name.isdigit() and process_group(int(p.name)) == group)


async def spawn(owner: Path, thread: str, command: tuple[str, ...] = ("sleep", "600")
                ) -> ProviderProcess:
    return await ProviderProcess.spawn(command, cwd=str(owner), owner=str(owner),
                                       env={"T3_THREAD_ID": thread})


def record(owner: Path, pid: int) -> dict:
    return json.loads((owner / "processes" / str(pid)).read_text())


def test_the_sweep_ends_a_recorded_process_and_spares_a_reused_pid(tmp_path: Path,
                                                                   portable: bool) -> None:
    """A record names pid, group, start time and thread; the sweep kills the group of a process
    whose start time matches, spares one whose does not (its pid was reused), drops a malformed
    record, and leaves no record behind."""
    async def scenario() -> None:
        same, reused = await spawn(tmp_path, "thread-a"), await spawn(tmp_path, "thread-b")
        try:
            entry = record(tmp_path, same.pid)
            assert entry["pid"] == entry["pgid"] == same.pid
            assert entry["threadId"] == "thread-a"
            assert entry["started"].startswith("ps " if portable else "proc ")
            claimed = record(tmp_path, reused.pid)
            last = claimed["started"][-1]
            claimed["started"] = claimed["started"][:-1] + ("1" if last != "1" else "2")
            (tmp_path / "processes" / str(reused.pid)).write_text(json.dumps(claimed))
            (tmp_path / "processes" / "12345").write_text("{not json")
            assert await kill_orphans(str(tmp_path)) == 1
            await asyncio.wait_for(same.proc.wait(), 10)
            assert same.proc.returncode == -signal.SIGKILL
            assert reused.alive() and pids_alive([reused.pid])
            assert list((tmp_path / "processes").iterdir()) == []
        finally:
            await same.stop(grace=0.1)
            await reused.stop(grace=0.1)
    asyncio.run(scenario())


def test_a_process_that_exits_takes_its_group_and_record_with_it(tmp_path: Path,
                                                                 portable: bool) -> None:
    """An agent that exits by itself: its group (a watcher, a helper) is killed and its record
    removed; a missing program fails to start on either path, as subprocess says it."""
    async def scenario() -> None:
        process = await spawn(tmp_path, "t", ("sh", "-c", "sleep 600 & read _"))
        wait_until(lambda: len(group_members(process.pid)) == (3 if portable else 2), 10)
        members = group_members(process.pid)
        process.proc.stdin.close()  # `read` ends, and so does the shell
        await asyncio.wait_for(process.proc.wait(), 10)
        await asyncio.wait_for(process._reaper, 10)
        wait_until(lambda: not pids_alive(members), 10, message="the group is killed")
        assert list((tmp_path / "processes").iterdir()) == []
        with pytest.raises(FileNotFoundError):
            await spawn(tmp_path, "t", ("no-such-program-t3",))
    asyncio.run(scenario())


def test_only_the_watcher_holds_the_pipe_t3_writes(tmp_path: Path, process_rules: dict[str, str],
                                                   portable: bool) -> None:
    """Portable path: the agent gets exactly its three pipes; the watcher in its group, there
    before the agent runs, holds the read end of t3's pipe (as stdin, output to /dev/null), none
    of the agent's pipes, and no environment."""
    if not portable:
        pytest.skip("the Linux path has no watcher")

    def fds(pid: int) -> dict[str, str]:
        return {fd.name: os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}

    async def scenario() -> None:
        process = await spawn(tmp_path, "t")
        try:
            [watcher] = [p for p in group_members(process.pid) if p != process.pid]
            death_pipe = f"pipe:[{os.fstat(providers._death_pipe()).st_ino}]"
            agent = fds(process.pid)
            assert sorted(agent) == ["0", "1", "2"] and death_pipe not in agent.values()
            assert all(target.startswith("pipe:") for target in agent.values())
            std = {"0": death_pipe, "1": os.devnull, "2": os.devnull}
            held = fds(watcher)  # besides fds the test runner inherited: t3's are close-on-exec
            assert {fd: held.get(fd) for fd in std} == std
            assert not set(held.values()) & set(agent.values())
            assert Path(f"/proc/{watcher}/environ").read_bytes() == b""
        finally:
            await process.stop(grace=0.1)
    asyncio.run(scenario())
