"""Provider-session credentials over real HTTP (reliability test 10): what an agent's token may do
to other threads (seed: thread tools take any thread as a target; a tool that changes another
thread needs the caller's live run and the ceiling of its modes), thread-only tools refused to the
client token, and a token revoked in mid-session. Every refusal is typed and writes nothing.
Expiry (lifetime, idle) and revocation at session end are in test_delegation.py."""

from __future__ import annotations

import json
from pathlib import Path

from harness import (McpClient, T3Server, agent_log, count_prompts, raw_post, scripted_provider,
                     wait_until)


def event_count(server: T3Server) -> int:
    return server.rows("SELECT COALESCE(MAX(sequence), 0) FROM events")[0][0]


def session_ended(server: T3Server, thread_id: str) -> bool:
    """Every provider session of the thread is recorded closed and no effect of it is on its way."""
    open_sessions = server.rows("SELECT COUNT(*) FROM provider_sessions WHERE thread_id = ? AND "
                                "status NOT IN ('closed', 'error')", (thread_id,))[0][0]
    effects = server.rows("SELECT COUNT(*) FROM effect_outbox WHERE thread_id = ? AND status IN "
                          "('pending', 'running')", (thread_id,))[0][0]
    return open_sessions == 0 and effects == 0


def session_token(log_path: Path) -> str:
    """The bearer token t3 gave the agent logging to `log_path` (its latest session)."""
    opened = [e["msg"] for e in agent_log(log_path) if e["dir"] == "in"
              and e["msg"].get("method") in ("session/new", "session/load")]
    [header] = opened[-1]["params"]["mcpServers"][0]["headers"]
    return header["value"].removeprefix("Bearer ")


def start(mcp: McpClient, prompt: str | None, instance: str, runtime: str) -> tuple[str, str | None]:
    entry = {"title": f"{instance} {runtime}", "runtimeMode": runtime,
             "target": {"providerInstanceId": instance}}
    result = mcp.call("create_threads", {"threads": [{**entry, "prompt": prompt} if prompt else entry]})
    assert result.ok, result.structured
    return result.structured["threads"][0]["threadId"], result.structured["threads"][0]["runId"]


def wait(mcp: McpClient, thread_id: str) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000}, timeout=90)
    assert result.ok, result.structured
    return result.structured


def refused(server: T3Server, caller: McpClient, tool: str, args: dict, code: str) -> None:
    before = event_count(server)
    result = caller.call(tool, args)
    assert result.failure_code == code, (tool, result.structured)
    assert event_count(server) == before, f"{tool} refused with {code} but wrote events"


def allowed(server: T3Server, caller: McpClient, tool: str, args: dict) -> dict:
    before = event_count(server)
    result = caller.call(tool, args)
    assert result.ok, (tool, result.structured)
    assert event_count(server) == before, f"read-only {tool} wrote events"
    return result.structured


def two_agents(tmp_path: Path) -> list[dict]:
    return [scripted_provider(tmp_path, id="alpha"), scripted_provider(tmp_path, id="beta")]


def pending_approval(mcp: McpClient, thread_id: str) -> str:
    result = wait(mcp, thread_id)
    assert result["pendingApproval"], result
    return result["pendingApproval"]["requestId"]


def test_token_of_an_ended_run_reads_but_changes_nothing(t3_factory, tmp_path: Path) -> None:
    """An agent whose run has ended may still read any thread, but its token cannot send to,
    interrupt, answer for, delegate from or create threads, nor see another thread's tasks."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    client = t3.client()
    a_id, _ = start(client, "hello", "alpha", "full-access")
    assert wait(client, a_id)["status"] == "completed"
    b_id, _ = start(client, "ASK_PERMISSION", "beta", "approval-required")
    request_id = pending_approval(client, b_id)
    a = McpClient(t3.mcp_url, session_token(tmp_path / "agent-alpha.log"))
    try:
        read = allowed(t3, a, "t3_thread_read", {"threadId": b_id})
        assert read["thread"]["threadId"] == b_id
        listed = allowed(t3, a, "t3_pending_request", {"threadId": b_id, "action": "list"})
        assert [r["requestId"] for r in listed["requests"]] == [request_id]
        for tool, args in [
                ("t3_thread_send", {"threadId": b_id, "message": "do as I say"}),
                ("t3_thread_interrupt", {"threadId": b_id}),
                ("delegate_task", {"task": "x"}),
                ("create_threads", {"threads": [{"title": "x"}]}),
                ("t3_thread_launch", {"title": "x"})]:
            refused(t3, a, tool, args, "parent_not_active")
        # B is not A's descendant: no agent but B's ancestors may answer it (SPEC 5.1a).
        refused(t3, a, "t3_pending_request", {"threadId": b_id, "action": "respond",
                                              "requestId": request_id, "decision": "accept"},
                "capability_denied")
        refused(t3, a, "task_status", {"taskId": f"node:{b_id}"}, "task_not_found")
        refused(t3, a, "task_cancel", {"taskId": f"node:{b_id}"}, "task_not_found")
    finally:
        a.close()
    assert pending_approval(client, b_id) == request_id  # still waiting for a real answer


def test_live_token_cannot_reach_above_its_own_modes(t3_factory, tmp_path: Path) -> None:
    """An agent with a live approval-required run cannot send to or interrupt a thread with
    broader runtime mode, nor answer an unrelated thread's or its own thread's request; it may
    still read them."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    client = t3.client()
    a_id, _ = start(client, "ASK_PERMISSION", "alpha", "approval-required")
    own_request = pending_approval(client, a_id)  # A's run stays live, and quiet, until answered
    b_id, _ = start(client, "ASK_PERMISSION", "beta", "auto-accept-edits")
    request_id = pending_approval(client, b_id)
    a = McpClient(t3.mcp_url, session_token(tmp_path / "agent-alpha.log"))
    try:
        allowed(t3, a, "t3_thread_read", {"threadId": b_id})
        for tool, args in [
                ("t3_thread_send", {"threadId": b_id, "message": "escalate"}),
                ("t3_thread_interrupt", {"threadId": b_id})]:
            refused(t3, a, tool, args, "runtime_mode_escalation_denied")
        refused(t3, a, "t3_pending_request", {"threadId": b_id, "action": "respond",
                                              "requestId": request_id, "decision": "accept"},
                "capability_denied")  # not its descendant
        refused(t3, a, "create_threads", {"threads": [{"title": "x", "runtimeMode": "auto"}]},
                "runtime_mode_escalation_denied")
        # Nor may it grant its own approval: that would void approval-required.
        refused(t3, a, "t3_pending_request", {"threadId": a_id, "action": "respond",
                                              "requestId": own_request, "decision": "accept"},
                "capability_denied")
    finally:
        a.close()
    assert pending_approval(client, b_id) == request_id
    assert pending_approval(client, a_id) == own_request


def test_client_token_cannot_use_thread_only_tools(t3: T3Server, mcp: McpClient) -> None:
    """The client token has no calling thread: delegate_task, task_status and task_cancel are
    thread_credential_required, and nothing is written."""
    for tool, args in [("delegate_task", {"task": "x"}), ("task_status", {"taskId": "node:x"}),
                       ("task_cancel", {"taskId": "node:x"})]:
        refused(t3, mcp, tool, args, "thread_credential_required")


def test_token_revoked_mid_session(t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """What an agent's token did before its session ended stays committed; afterwards the same
    token is 401 invalid_token and writes nothing."""
    t3 = t3_factory()
    client = t3.client()
    a_id, _ = start(client, "SLOW:600 working", "scripted", "full-access")
    wait_until(lambda: count_prompts(agent_log_path) == 1, 30, message="A's turn is running")
    token = session_token(agent_log_path)
    with McpClient(t3.mcp_url, token) as a:
        made = a.call("create_threads", {"threads": [{"title": "made by A"}]})
        assert made.ok, made.structured
    child_id = made.structured["threads"][0]["threadId"]
    client.call("t3_thread_interrupt", {"threadId": a_id})
    wait(client, a_id)
    crashed = client.call("t3_thread_send", {"threadId": a_id, "message": "CRASH"}).structured
    assert wait(client, a_id)["runId"] == crashed["runId"]  # the session died with its process
    # The credential is revoked first, then the session's end is recorded: count after that.
    wait_until(lambda: session_ended(t3, a_id), 30, message="A's provider session recorded ended")
    before = event_count(t3)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "create_threads", "arguments": {"threads": [{"title": "too late"}]}}}).encode()
    late = raw_post(t3.mcp_url, body, {"Authorization": f"Bearer {token}",
                                       "Content-Type": "application/json",
                                       "Accept": "application/json, text/event-stream"})
    assert late.status == 401 and late.json()["error"] == "invalid_mcp_credential"
    assert late.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert event_count(t3) == before
    child = client.call("t3_thread_read", {"threadId": child_id}).structured
    assert child["thread"]["title"] == "made by A" and child["thread"]["createdBy"] == "agent"
