"""The `opencode` driver with the real `opencode serve` (opencode-ai, pinned in
tests/agents.json), installed from npm and run against the fake model server (Chat Completions
through @ai-sdk/openai-compatible, research/agents.md §6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import T3Server, wait_until
from real_cli import create, ensure_installed, npm_available, text, wait

pytestmark = [pytest.mark.real_cli,
              pytest.mark.skipif(not npm_available(), reason="npm is not installed")]


def provider(tmp_path: Path, model_url: str) -> dict[str, Any]:
    """A `[[providers]]` entry running `opencode serve` with its state in tmp (the XDG dirs,
    where opencode keeps its sessions) and a fake provider as its model."""
    binary = str(ensure_installed("opencode"))
    home = tmp_path / "opencode-home"
    home.mkdir()
    config = {"provider": {"fake": {
        "npm": "@ai-sdk/openai-compatible", "name": "Fake",
        "options": {"baseURL": f"{model_url}/v1", "apiKey": "fake-key"},
        "models": {"fake-model": {"name": "Fake model", "tool_call": True}}}},
        "model": "fake/fake-model"}
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_STATE_HOME": str(home / ".local/state"), "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    return {"id": "opencode", "driver": "opencode", "command": [binary, "serve"], "env": env}


@pytest.fixture
def server(model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> T3Server:
    return t3_factory(providers=[provider(tmp_path, model.url)])


def test_text_turn(server: T3Server, model: FakeModelServer) -> None:
    """A plain turn completes and its answer is readable."""
    mcp = server.client()
    created = create(mcp, "say hi")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    answer = text(mcp, created["threadId"])
    assert "Hello from fake model. You said: say hi" in answer
    assert answer.count("Hello from fake model") == 1, answer  # deltas and part updates, once
    # t3's orchestration instructions reached the model (the system of prompt_async).
    assert any("You are running inside t3" in json.dumps(r["body"]) for r in model.requests)


def test_tool_call_needs_approval(server: T3Server) -> None:
    """In approval-required mode opencode's permission.asked for bash becomes a runtime request;
    accepting it (reply "once") lets the turn finish with the command's output."""
    mcp = server.client()
    created = create(mcp, "USE_TOOL: echo fake-tool-ran | tee fake-tool.txt",
                     runtimeMode="approval-required")
    blocked = wait(mcp, created["threadId"])
    assert blocked["pendingApproval"] is not None, blocked
    answer = mcp.call("t3_pending_request", {"threadId": created["threadId"],
                                             "action": "respond", "decision": "accept",
                                             "requestId": blocked["pendingApproval"]["requestId"]})
    assert answer.ok, answer.structured
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])
    assert "fake-tool-ran" in text(mcp, created["threadId"])


def test_interrupt(server: T3Server) -> None:
    """t3_thread_interrupt ends a slow turn interrupted (POST /session/{id}/abort)."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    wait_until(lambda: text(mcp, created["threadId"]).strip(), 60)
    stop = mcp.call("t3_thread_interrupt", {"threadId": created["threadId"]})
    assert stop.structured["status"] == "interrupt_requested"
    assert wait(mcp, created["threadId"])["status"] == "interrupted"


def test_steer_by_restart(server: T3Server) -> None:
    """t3_thread_send auto on a slow turn interrupts it and starts a second attempt with the
    new message (opencode has no native steer in this driver)."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    tid = created["threadId"]
    wait_until(lambda: text(mcp, tid).strip(), 60)
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "say bye", "mode": "auto"})
    assert sent.ok, sent.structured
    assert wait(mcp, tid)["status"] == "completed"
    run = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"][0]
    assert run["attemptCount"] == 2, run
    assert "You said: say bye" in text(mcp, tid)


def test_mcp_injection(server: T3Server, model: FakeModelServer) -> None:
    """opencode calls t3's orchestrator_capabilities through the injected remote MCP server
    (Authorization header), scoped to its own thread."""
    mcp = server.client()
    created = create(mcp, "CALL_MCP orchestrator_capabilities {}")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    answer = text(mcp, created["threadId"])
    assert "TOOL_RESULT_SEEN" in answer and created["threadId"] in answer, answer


def test_own_mcp_tools_need_no_approval(server: T3Server) -> None:
    """t3's own tools run without an approval even in approval-required mode: opencode does
    not gate remote MCP tools, and t3 asks only for bash and edits."""
    mcp = server.client()
    created = create(mcp, 'CALL_MCP t3_thread_interrupt {"threadId": "thread:none"}',
                     runtimeMode="approval-required")
    done = wait(mcp, created["threadId"])
    assert done["status"] == "completed" and done["pendingApproval"] is None, done
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])


def test_resume_after_restart(server: T3Server, model: FakeModelServer) -> None:
    """After a server restart, a follow-up continues the same opencode session (kept in its
    data dir): the model sees the earlier exchange."""
    mcp = server.client()
    created = create(mcp, "remember the word heron")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert server.stop() == 0
    server.restart()
    mcp = server.client()
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "and now?"})
    assert wait(mcp, created["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    last = [r for r in model.requests_for("chat") if "and now?" in json.dumps(r["body"])][-1]
    assert "remember the word heron" in json.dumps(last["body"])
    assert "and now?" in FakeModelServer.last_user_text(last)
