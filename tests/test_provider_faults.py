"""Provider faults (reliability tests 7 and 8): the scripted agent crashes, dies by a signal, writes
half a JSON line, leaves a grandchild holding its stdout, fails to start, or hangs ignoring
SIGTERM. Each time the run ends with a human reason, no process of the thread survives, and the
server keeps serving other requests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness import (McpClient, T3Server, agent_log, count_prompts, pids_alive, processes_matching,
                     scripted_provider, wait_until)

pytestmark = pytest.mark.both_stores  # .ci/run runs these again on PostgreSQL


@pytest.fixture
def t3(t3_factory, process_rules: dict[str, str]) -> T3Server:
    """The server for the death cases, with either process rules (the group is killed the same)."""
    return t3_factory(env=process_rules)


def start(mcp: McpClient, prompt: str, **entry: object) -> tuple[str, str]:
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    created = result.structured["threads"][0]
    return created["threadId"], created["runId"]


def wait(mcp: McpClient, thread_id: str, run_id: str) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "runId": run_id,
                                         "timeoutMs": 120_000}, timeout=180)
    assert result.ok, result.structured
    return result.structured


def thread_processes(thread_id: str) -> list[int]:
    """Live processes t3 started for this thread (every provider child carries T3_THREAD_ID)."""
    return processes_matching(f"T3_THREAD_ID={thread_id}\0")


def assert_thread_works_again(mcp: McpClient, thread_id: str) -> None:
    sent = mcp.call("t3_thread_send", {"threadId": thread_id, "message": "are you back"})
    assert sent.ok, sent.structured
    assert wait(mcp, thread_id, sent.structured["runId"])["status"] == "completed"


@pytest.mark.parametrize(("prompt", "reason"), [
    ("CRASH", "exit code 3"),
    ("KILL_SELF", "SIGKILL"),
    ("HALF_LINE", "exit code 4"),
    ("ORPHAN", "exit code 5"),
])
def test_provider_death_fails_the_run_and_leaves_no_process(t3: T3Server, mcp: McpClient,
                                                            agent_log_path: Path, prompt: str,
                                                            reason: str) -> None:
    """An agent that exits non-zero, dies by a signal, breaks off a JSON line or leaves a
    grandchild holding its stdout: the run fails with the reason, nothing of it survives, and the
    thread takes a new turn."""
    thread_id, run_id = start(mcp, f"{prompt} now")
    done = wait(mcp, thread_id, run_id)
    assert done["status"] == "failed"
    assert reason in done["statusReason"]
    assert "provider process" in done["statusReason"]
    grandchildren = [e["grandchildPid"] for e in agent_log(agent_log_path) if e["dir"] == "grandchild"]
    assert len(grandchildren) == (prompt == "ORPHAN")
    # The run is failed only once the process group is gone, so nothing may be left now.
    assert not pids_alive(grandchildren)
    assert not thread_processes(thread_id)
    assert_thread_works_again(mcp, thread_id)


def test_start_failures_are_retried_with_backoff(t3_factory, tmp_path: Path) -> None:
    """An agent that dies during its first two handshakes is started again, and the third start
    runs the turn; the outbox row records three attempts."""
    counter = tmp_path / "starts"
    server = t3_factory(providers=[scripted_provider(
        tmp_path, env={"SCRIPTED_AGENT_FAIL_STARTS": f"{counter}:2"})])
    mcp = server.client()
    thread_id, run_id = start(mcp, "hello")
    assert wait(mcp, thread_id, run_id)["status"] == "completed"
    assert counter.read_text() == "xxx"
    [(status, attempts)] = server.rows("SELECT status, attempt_count FROM effect_outbox "
                                       "WHERE effect_type = 'provider-turn.start'")
    assert (status, attempts) == ("succeeded", 3)
    assert len(thread_processes(thread_id)) == 1  # the live agent; the failed ones are gone


def test_hung_provider_is_killed_while_others_are_served(t3_factory, tmp_path: Path) -> None:
    """An agent that ignores session/cancel and SIGTERM is killed after the grace period and its
    run ends interrupted; meanwhile another instance completes a turn and listing answers."""
    server = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                                   scripted_provider(tmp_path, id="beta")])
    mcp = server.client()
    hung_id, hung_run = start(mcp, "HANG", target={"providerInstanceId": "alpha"})
    wait_until(lambda: count_prompts(tmp_path / "agent-alpha.log") == 1, 30,
               message="the hanging prompt reached the agent")
    hung_pids = thread_processes(hung_id)
    assert hung_pids
    stop = mcp.call("t3_thread_interrupt", {"threadId": hung_id})
    assert stop.structured["status"] == "interrupt_requested"

    began = time.monotonic()
    listed = mcp.call("t3_thread_list", {})
    assert listed.ok and listed.structured["total"] == 1
    assert time.monotonic() - began < 10  # the kill of the hung agent is not in the way
    other_id, other_run = start(mcp, "hello", target={"providerInstanceId": "beta"})
    assert wait(mcp, other_id, other_run)["status"] == "completed"

    done = wait(mcp, hung_id, hung_run)
    assert done["status"] == "interrupted"
    assert "did not stop the turn" in done["statusReason"]
    assert not pids_alive(hung_pids)
    assert not thread_processes(hung_id)
