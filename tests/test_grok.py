"""The grok driver end to end: the ACP adapter plus xAI's extensions, with the scripted ACP agent
standing in for `grok agent stdio` (the grok CLI is not installable here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import McpClient, T3Server, agent_log, scripted_provider, wait_until


@pytest.fixture
def server(t3_factory, tmp_path: Path) -> T3Server:
    """A server whose only provider is a grok instance running the scripted agent."""
    return t3_factory(providers=[scripted_provider(tmp_path, id="grok", driver="grok")])


@pytest.fixture
def client(server: T3Server) -> McpClient:
    return server.client()


def create(mcp: McpClient, prompt: str, **entry: object) -> dict:
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: McpClient, thread_id: str) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000})
    assert result.ok, result.structured
    return result.structured


def assistant_text(mcp: McpClient, thread_id: str) -> str:
    items = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1}).structured
    return "".join(i["text"] or "" for i in items["items"] if i["type"] == "assistant_message")


def question_answers(log_path: Path) -> list[dict]:
    """What the agent got back for its _x.ai/ask_user_question requests."""
    log = agent_log(log_path)
    asked = {e["msg"]["id"] for e in log if e["dir"] == "out"
             and e["msg"].get("method") == "_x.ai/ask_user_question"}
    return [e["msg"].get("result") or e["msg"].get("error") for e in log if e["dir"] == "in"
            and "method" not in e["msg"] and e["msg"].get("id") in asked]


def pending_question(mcp: McpClient, thread_id: str) -> dict:
    blocked = wait(mcp, thread_id)
    assert blocked["status"] == "running" and blocked["hasPendingQuestion"] is True
    [request] = mcp.call("t3_pending_request", {"threadId": thread_id,
                                                "action": "list"}).structured["requests"]
    return request


def test_question_roundtrip(client: McpClient, tmp_path: Path) -> None:
    """Grok's ask_user_question becomes a pending user_input request with its questions; the
    answers given through t3_pending_request go back to grok keyed by question text."""
    created = create(client, "ASK_QUESTION BACKGROUND please")
    thread_id = created["threadId"]
    request = pending_question(client, thread_id)
    assert request["kind"] == "user_input" and request["title"] == "Which color?"
    detail = client.call("t3_pending_request", {"threadId": thread_id, "action": "read",
                                                "requestId": request["requestId"]}
                         ).structured["request"]["detail"]
    assert [(q["id"], q["question"], q["multiSelect"]) for q in detail["questions"]] == [
        ("q0", "Which color?", False), ("q1", "Which sizes?", True)]
    assert [o["label"] for o in detail["questions"][0]["options"]] == ["red", "blue"]
    answered = client.call("t3_pending_request", {
        "threadId": thread_id, "action": "respond", "requestId": request["requestId"],
        "answers": {"q0": "blue", "Which sizes?": ["S", "L"]}})
    assert answered.ok and answered.structured["status"] == "resolved"
    assert wait(client, thread_id)["status"] == "completed"
    expected = {"Which color?": "blue", "Which sizes?": ["S", "L"]}
    assert f"answered: {json.dumps(expected, sort_keys=True, separators=(',', ':'))}" in \
        assistant_text(client, thread_id)
    assert question_answers(tmp_path / "agent-grok.log") == [
        {"outcome": "accepted", "answers": expected, "annotations": {}}]


def test_question_cancelled_by_interrupt(client: McpClient, tmp_path: Path) -> None:
    """Interrupting a turn blocked on a question answers grok "cancelled"; the run is
    interrupted and the request can no longer be answered."""
    created = create(client, "ASK_QUESTION")
    thread_id = created["threadId"]
    request = pending_question(client, thread_id)
    interrupted = client.call("t3_thread_interrupt", {"threadId": thread_id})
    assert interrupted.ok, interrupted.structured
    # A wait returns at once while the question is still pending: the interrupt is asynchronous.
    settled = wait_until(lambda: (w := wait(client, thread_id))["status"] != "running" and w, 60)
    assert settled["status"] == "interrupted"
    assert question_answers(tmp_path / "agent-grok.log") == [{"outcome": "cancelled"}]
    late = client.call("t3_pending_request", {"threadId": thread_id, "action": "respond",
                                              "requestId": request["requestId"],
                                              "answers": {"q0": "red"}})
    assert late.failure_code == "invalid_request"


def test_question_declined(client: McpClient, tmp_path: Path) -> None:
    """Declining a question answers grok "cancelled" without answers."""
    thread_id = create(client, "ASK_QUESTION")["threadId"]
    request = pending_question(client, thread_id)
    client.call("t3_pending_request", {"threadId": thread_id, "action": "respond",
                                       "requestId": request["requestId"], "decision": "decline"})
    assert wait(client, thread_id)["status"] == "interrupted"  # the agent stops on "cancelled"
    assert "question cancelled" in assistant_text(client, thread_id)
    assert question_answers(tmp_path / "agent-grok.log") == [{"outcome": "cancelled"}]


def test_grok_turn_and_capabilities(client: McpClient) -> None:
    """A plain grok turn completes; the instance is listed as a runnable grok-driver one."""
    created = create(client, "hello grok")
    assert wait(client, created["threadId"])["status"] == "completed"
    assert "You said: hello grok" in assistant_text(client, created["threadId"])
    [entry] = client.call("orchestrator_capabilities", {}).structured["providers"]
    assert (entry["providerInstanceId"], entry["driverKind"]) == ("grok", "grok")
    assert entry["canRunChildTask"] is True and entry["constraints"] == []


def test_steer_by_cancel_and_restart(client: McpClient) -> None:
    """Grok cannot steer a running turn: a message sent to it restarts the turn (a second
    attempt of the same run) with the new message."""
    created = create(client, "SLOW:400 first")
    thread_id = created["threadId"]
    wait_until(lambda: "chunk 1" in assistant_text(client, thread_id), 60)
    sent = client.call("t3_thread_send", {"threadId": thread_id, "message": "second",
                                          "mode": "auto"})
    assert sent.ok and sent.structured["delivery"] == "steered", sent.structured
    assert wait(client, thread_id)["status"] == "completed"
    run = client.call("t3_thread_read", {"threadId": thread_id}).structured["recentRuns"][0]
    assert run["runId"] == created["runId"] and run["attemptCount"] == 2
    assert "You said: second" in assistant_text(client, thread_id)
