"""The `claudeAgent` driver with the real Claude Code CLI (`claude -p`, stream-json, permission
prompts over stdio), installed from npm at its pinned version and run against the fake model."""

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


def claude_provider(tmp_path: Path, model_url: str) -> dict[str, Any]:
    home = tmp_path / "claude-home"
    home.mkdir()
    return {"id": "claude", "driver": "claudeAgent",
            "command": [str(ensure_installed("claude")), "-p", "--input-format", "stream-json",
                        "--output-format", "stream-json", "--verbose",
                        "--permission-prompt-tool", "stdio"],
            "env": {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / "claude"),
                    "ANTHROPIC_BASE_URL": model_url, "ANTHROPIC_API_KEY": "fake-key",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                    "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                    # The fake model cannot search deferred tools: offer MCP tools directly.
                    "ENABLE_TOOL_SEARCH": "false",
                    "IS_SANDBOX": "1"},
            "models": ["claude-sonnet-4-5"]}


@pytest.fixture
def server(model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> T3Server:
    return t3_factory(providers=[claude_provider(tmp_path, model.url)])


def test_text_turn(server: T3Server, model: FakeModelServer) -> None:
    """A plain turn completes and its answer is readable; t3's orchestration instructions
    reached the model (in the system prompt)."""
    mcp = server.client()
    created = create(mcp, "say hi")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "Hello from fake model. You said: say hi" in text(mcp, created["threadId"])
    assert any("You are running inside t3" in json.dumps(r["body"]) for r in model.requests)


def test_tool_call_needs_approval(server: T3Server) -> None:
    """In approval-required mode Claude's can_use_tool request becomes a runtime request."""
    mcp = server.client()
    created = create(mcp, "USE_TOOL: echo fake-tool-ran | tee fake-tool.txt",
                     runtimeMode="approval-required")
    blocked = wait(mcp, created["threadId"])
    assert blocked["pendingApproval"] is not None, blocked
    assert blocked["pendingApproval"]["kind"] == "command"
    answer = mcp.call("t3_pending_request", {"threadId": created["threadId"],
                                             "action": "respond", "decision": "accept",
                                             "requestId": blocked["pendingApproval"]["requestId"]})
    assert answer.ok, answer.structured
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])


def test_interrupt_and_steer(server: T3Server) -> None:
    """A slow turn is steered by restart (same run, second attempt), then a new slow turn is
    interrupted."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    tid = created["threadId"]
    wait_until(lambda: text(mcp, tid).strip(), 60)
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "say bye", "mode": "auto"})
    assert sent.structured["delivery"] == "steered"
    assert wait(mcp, tid)["status"] == "completed"
    run = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"][0]
    assert run["attemptCount"] == 2 and "You said: say bye" in text(mcp, tid)
    again = mcp.call("t3_thread_send", {"threadId": tid, "message": "SLOW more"}).structured
    wait_until(lambda: "chunk" in json.dumps(mcp.call("t3_thread_read", {
        "threadId": tid, "beforePosition": 10_000, "limit": 1}).structured["items"]), 60)
    assert mcp.call("t3_thread_interrupt", {"threadId": tid}).structured["status"] == \
        "interrupt_requested"
    assert wait(mcp, tid, runId=again["runId"])["status"] == "interrupted"


def test_mcp_injection_and_resume(server: T3Server, model: FakeModelServer) -> None:
    """Claude calls t3's orchestrator_capabilities through the injected server (scoped to its
    thread); after a restart a follow-up resumes the same Claude session."""
    mcp = server.client()
    created = create(mcp, "CALL_MCP orchestrator_capabilities {}")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    answer = text(mcp, created["threadId"])
    assert "TOOL_RESULT_SEEN" in answer and created["threadId"] in answer, answer
    assert server.stop() == 0
    server.restart()
    mcp = server.client()
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "and now?"})
    assert wait(mcp, created["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    assert "CALL_MCP orchestrator_capabilities" in json.dumps(model.requests[-1]["body"])
