"""Crash recovery: kill -9 of the real server mid-turn, then a restart on the same data directory.
Every test runs with both process rules (``process_rules``): the Linux path and the portable one."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import T3Factory
from harness import (McpClient, T3Server, agent_log, count_prompts, pids_alive, process_group,
                     processes_matching, wait_until)

pytestmark = pytest.mark.both_stores  # .ci/run runs these again on PostgreSQL


@pytest.fixture
def t3(t3_factory: T3Factory, process_rules: dict[str, str]) -> T3Server:
    return t3_factory(env=process_rules)


def group_members(group: int) -> list[int]:
    """Live processes in process group ``group``."""
    return pids_alive(int(p.name) for p in Path("/proc").iterdir()
                      if p.name.isdigit() and process_group(int(p.name)) == group)


def records(t3: T3Server) -> list[str]:
    """The names of the process records in the server's data directory."""
    return sorted(p.name for p in (t3.data_dir / "processes").iterdir())


def assistant_text(mcp: McpClient, thread_id: str) -> str:
    items = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1}).structured
    return "".join(i["text"] or "" for i in items["items"] if i["type"] == "assistant_message")


def agent_pids(marker_log: list[dict]) -> set[int]:
    return {entry["pid"] for entry in marker_log}


def test_kill9_while_streaming_then_restart(t3: T3Server, mcp: McpClient, agent_log_path,
                                            test_marker: str) -> None:
    """After kill -9 mid-stream: the run is interrupted with a reason, every committed delta is
    readable, no outbox row is left running, no old agent survives, and the thread works again."""
    created = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:600 stream"}]}).structured
    thread_id, run_id = created["threads"][0]["threadId"], created["threads"][0]["runId"]
    seen = wait_until(lambda: (t := assistant_text(mcp, thread_id)).count("chunk") >= 5 and t,
                      30)
    old_agents = agent_pids(agent_log(agent_log_path))
    assert old_agents
    t3.kill9()
    # The provider dies with the server (PDEATHSIG); a restart would also sweep survivors.
    wait_until(lambda: not pids_alive(old_agents), 10, message="old agents gone")

    t3.restart()
    read = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1}).structured
    run = next(r for r in read["recentRuns"] if r["runId"] == run_id)
    assert run["status"] == "interrupted"
    assert "restarted" in run["statusReason"]
    assert assistant_text(mcp, thread_id).startswith(seen)  # nothing committed was lost
    assert t3.rows("SELECT COUNT(*) FROM effect_outbox WHERE status = 'running'")[0][0] == 0
    assert t3.rows("SELECT COUNT(*) FROM runs WHERE status IN ('starting', 'running')")[0][0] == 0
    assert not pids_alive(old_agents)

    sent = mcp.call("t3_thread_send", {"threadId": thread_id, "message": "again"}).structured
    assert sent["delivery"] == "started"
    done = mcp.call("t3_thread_wait", {"threadId": thread_id, "runId": sent["runId"]}).structured
    assert done["status"] == "completed"
    assert "You said: again" in assistant_text(mcp, thread_id)
    # The ACP agent was asked to resume the same conversation (session/load).
    loads = [e["msg"] for e in agent_log(agent_log_path)
             if e["dir"] == "in" and e["msg"].get("method") == "session/load"]
    assert loads and loads[-1]["params"]["sessionId"]
    assert all(p not in old_agents for p in processes_matching(test_marker))


def test_kill9_with_queued_run_resumes_it(t3: T3Server, mcp: McpClient) -> None:
    """A queued run behind a run killed mid-turn starts by itself after the restart."""
    created = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:600 first"}]}).structured
    thread_id = created["threads"][0]["threadId"]
    queued = mcp.call("t3_thread_send", {"threadId": thread_id, "message": "then this",
                                         "mode": "queue"}).structured
    wait_until(lambda: "chunk 1" in assistant_text(mcp, thread_id), 30)
    t3.kill9()
    t3.restart()
    done = mcp.call("t3_thread_wait", {"threadId": thread_id, "runId": queued["runId"]})
    assert done.structured["status"] == "completed"
    assert "You said: then this" in assistant_text(mcp, thread_id)


def test_restart_after_clean_shutdown_keeps_everything(t3: T3Server, mcp: McpClient) -> None:
    """Threads, runs and messages survive a clean restart unchanged."""
    created = mcp.call("create_threads", {"threads": [{"prompt": "remember me"}]}).structured
    thread_id = created["threads"][0]["threadId"]
    mcp.call("t3_thread_wait", {"threadId": thread_id})
    before = mcp.call("t3_thread_read", {"threadId": thread_id}).structured
    assert t3.stop() == 0
    t3.restart()
    after = mcp.call("t3_thread_read", {"threadId": thread_id}).structured
    assert after["items"] == before["items"]
    assert after["recentRuns"] == before["recentRuns"]



def test_kill9_with_four_live_agents_mid_turn(t3: T3Server, mcp: McpClient, agent_log_path: Path,
                                              test_marker: str) -> None:
    """kill -9 with 4 live agents (2 streaming, 2 hung: those ignore the end of their stdin) and
    a message queued: no agent, nor anything in its group, outlives the server; each was
    recorded until then; after the restart none is alive, every acknowledged delta and message
    is kept, and the queued message runs."""
    prompts = ["SLOW:600 stream 0", "SLOW:600 stream 1", "HANG", "HANG"]
    created = mcp.call("create_threads", {"threads": [{"prompt": p} for p in prompts]}).structured
    threads = [(c["threadId"], c["runId"]) for c in created["threads"]]
    queued = mcp.call("t3_thread_send", {"threadId": threads[0][0], "message": "then this",
                                         "mode": "queue"}).structured
    wait_until(lambda: count_prompts(agent_log_path) == 4 and all(
        assistant_text(mcp, t).count("chunk") >= 3 for t, _ in threads[:2]), 60,
        message="4 agents in their turns")
    seen = {t: assistant_text(mcp, t) for t, _ in threads}
    agents = agent_pids(agent_log(agent_log_path))
    assert len(agents) == 4
    assert records(t3) == sorted(str(p) for p in agents)
    groups = {p: group_members(p) for p in agents}
    assert all(p in members for p, members in groups.items())  # each leads its own group
    t3.kill9()
    everything = [p for members in groups.values() for p in members]
    wait_until(lambda: not pids_alive(everything), 10, message="the agents die with the server")

    t3.restart()
    assert not pids_alive(everything)
    for thread_id, run_id in threads:
        read = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1}).structured
        run = next(r for r in read["recentRuns"] if r["runId"] == run_id)
        assert run["status"] == "interrupted" and "restarted" in run["statusReason"]
        assert assistant_text(mcp, thread_id).startswith(seen[thread_id])
    done = mcp.call("t3_thread_wait", {"threadId": threads[0][0], "runId": queued["runId"]})
    assert done.structured["status"] == "completed"
    assert "You said: then this" in assistant_text(mcp, threads[0][0])
    assert all(p not in everything for p in processes_matching(test_marker))
    assert t3.stop() == 0
    assert records(t3) == []  # each record goes with its process


def test_restart_ends_recorded_agents_that_outlived_the_server(
        t3: T3Server, mcp: McpClient, agent_log_path: Path, process_rules: dict[str, str]) -> None:
    """Hung agents whose watchers were stopped outlive a kill -9 of the server; the restart ends
    each, group and all, by its record alone (the portable path has no /proc sweep)."""
    if process_rules["T3_PORTABLE_PROCESSES"] != "1":
        pytest.skip("on the Linux path the kernel ends the agents with the server")
    mcp.call("create_threads", {"threads": [{"prompt": "HANG"}, {"prompt": "HANG"}]})
    wait_until(lambda: count_prompts(agent_log_path) == 2, 60, message="2 agents hung")
    agents = agent_pids(agent_log(agent_log_path))
    watchers = [p for a in agents for p in group_members(a) if p != a]
    assert len(watchers) == 2
    for watcher in watchers:
        assert Path(f"/proc/{watcher}/environ").read_bytes() == b""  # no marker, no secret
        os.kill(watcher, signal.SIGSTOP)  # a watcher that cannot run: the record must do
    t3.kill9()
    assert set(pids_alive(agents)) == agents
    t3.start()
    wait_until(lambda: not pids_alive([*agents, *watchers]), 10,
               message="the restart ended the recorded agents and their groups")
    assert "killed 2 provider process(es)" in t3.stderr_text()


def test_runs_waiting_for_an_agent_slot_keep_their_places_across_a_kill9(
        t3_factory: T3Factory, agent_log_path: Path, process_rules: dict[str, str]) -> None:
    """With one agent process slot, the runs waiting in line when the server is killed wait on
    after the restart, their threads not walked by recovery, then each runs once, in order."""
    t3 = t3_factory(env=process_rules, extra="[limits]\nmax_live_agent_processes = 1\n")
    mcp = t3.client()
    holder = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:600 holder"}]}).structured
    waiters = mcp.call("create_threads", {"threads": [{"prompt": f"waiter {i}"}
                                                      for i in range(3)]}).structured["threads"]

    def waiting() -> int:
        return sum(json.loads(p).get("awaitingAgentSlot") is True
                   for (p,) in t3.rows("SELECT payload_json FROM runs WHERE status = 'queued'"))
    wait_until(lambda: waiting() == 3, 30, message="three runs in line")
    wait_until(lambda: "chunk 1" in assistant_text(mcp, holder["threads"][0]["threadId"]), 30)
    t3.kill9()
    t3.restart()
    runs = [mcp.call("t3_thread_wait", {"threadId": w["threadId"], "runId": w["runId"],
                                        "timeoutMs": 60_000}).structured for w in waiters]
    assert [r["status"] for r in runs] == ["completed"] * 3, runs
    started = []
    for w in waiters:
        read = mcp.call("t3_thread_read", {"threadId": w["threadId"]}).structured
        started.append(next(r for r in read["recentRuns"] if r["runId"] == w["runId"])["startedAt"])
    assert started == sorted(started)
    prompts = [json.dumps(e["msg"]) for e in agent_log(agent_log_path)
               if e["dir"] == "in" and e["msg"].get("method") == "session/prompt"]
    assert [sum(f"waiter {i}" in p for p in prompts) for i in range(3)] == [1, 1, 1]
    held = holder["threads"][0]
    assert mcp.call("t3_thread_wait", {"threadId": held["threadId"], "runId": held["runId"]}
                    ).structured["status"] == "interrupted"
    # recovery committed nothing on the waiters
    assert t3.rows("SELECT COUNT(*) FROM command_receipts WHERE command_type = 'thread.recover' "
                   "AND thread_id IN (?, ?, ?)", [w["threadId"] for w in waiters])[0][0] == 0
