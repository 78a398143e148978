"""Crash recovery: kill -9 of the real server mid-turn, then a restart on the same data directory."""

from __future__ import annotations

import sqlite3

from harness import McpClient, T3Server, agent_log, pids_alive, processes_matching, wait_until


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
    with sqlite3.connect(f"file:{t3.data_dir / 't3.sqlite'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT COUNT(*) FROM effect_outbox WHERE status = 'running'") \
            .fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM runs WHERE status IN ('starting', 'running')") \
            .fetchone()[0] == 0
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
