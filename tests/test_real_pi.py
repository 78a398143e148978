"""The `pi` driver with the real `pi --mode rpc` (@mariozechner/pi-coding-agent, pinned in
tests/agents.json), installed from npm and run against the fake model server."""

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
    """A `[[providers]]` entry running `pi --mode rpc` with its state in tmp and its model faked
    through `$PI_CODING_AGENT_DIR/models.json` (research/agents.md 5)."""
    binary = str(ensure_installed("pi"))
    home = tmp_path / "pi-home"
    agent_dir = home / "pi-agent"
    agent_dir.mkdir(parents=True)
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"fake": {
        "baseUrl": f"{model_url}/v1", "api": "openai-completions", "apiKey": "fake-key",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": "fake-model", "name": "Fake", "reasoning": False, "input": ["text"],
                    "contextWindow": 128000, "maxTokens": 8000,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}]}}}))
    env = {"HOME": str(home), "PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state")}
    return {"id": "pi", "driver": "pi", "env": env,
            "command": [binary, "--mode", "rpc", "--provider", "fake", "--model", "fake-model"]}


@pytest.fixture
def server(model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> T3Server:
    return t3_factory(providers=[provider(tmp_path, model.url)])


def test_text_turn(server: T3Server, model: FakeModelServer) -> None:
    """A plain turn completes (agent_end) and its answer is readable."""
    mcp = server.client()
    created = create(mcp, "say hi")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "Hello from fake model. You said: say hi" in text(mcp, created["threadId"])
    # t3's orchestration instructions reached the model (--append-system-prompt).
    assert any("You are running inside t3" in json.dumps(r["body"]) for r in model.requests)


def test_tool_runs_without_approval(server: T3Server) -> None:
    """pi has no permission prompts: its bash tool runs even in approval-required mode."""
    mcp = server.client()
    created = create(mcp, "USE_TOOL please", runtimeMode="approval-required")
    done = wait(mcp, created["threadId"])
    assert done["status"] == "completed" and done["pendingApproval"] is None, done
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])
    assert "fake-tool-ran" in text(mcp, created["threadId"])


def test_interrupt(server: T3Server) -> None:
    """t3_thread_interrupt ends a slow turn interrupted (abort)."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    wait_until(lambda: text(mcp, created["threadId"]).strip(), 60)
    stop = mcp.call("t3_thread_interrupt", {"threadId": created["threadId"]})
    assert stop.structured["status"] == "interrupt_requested"
    assert wait(mcp, created["threadId"])["status"] == "interrupted"


def test_native_steer(server: T3Server, model: FakeModelServer) -> None:
    """t3_thread_send auto on a slow turn steers it natively (steer): the same attempt goes on
    and the model's next request carries the new message."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    tid = created["threadId"]
    wait_until(lambda: text(mcp, tid).strip(), 60)
    before = len(model.requests_for("chat"))
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "say bye", "mode": "auto"})
    assert sent.structured["delivery"] == "steered", sent.structured
    assert wait(mcp, tid)["status"] == "completed"
    run = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"][0]
    assert run["runId"] == created["runId"] and run["attemptCount"] == 1, run
    after = model.requests_for("chat")[before:]
    assert after and "say bye" in FakeModelServer.last_user_text(after[0])
    assert "You said: say bye" in text(mcp, tid)


def test_resume_after_restart(server: T3Server, model: FakeModelServer) -> None:
    """After a server restart, a follow-up continues pi's conversation (--session <file>)."""
    mcp = server.client()
    created = create(mcp, "remember the word heron")
    wait(mcp, created["threadId"])
    assert server.stop() == 0
    server.restart()
    mcp = server.client()
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "and now?"})
    assert wait(mcp, created["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    last = model.requests_for("chat")[-1]
    assert "remember the word heron" in json.dumps(last["body"])
    assert "and now?" in FakeModelServer.last_user_text(last)


def test_mcp_bridge(server: T3Server) -> None:
    """pi calls t3's orchestrator_capabilities through the t3-owned bridge extension
    (mcp__t3-code__orchestrator_capabilities), scoped to its own thread."""
    mcp = server.client()
    created = create(mcp, "CALL_MCP orchestrator_capabilities {}")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    answer = text(mcp, created["threadId"])
    assert "TOOL_RESULT_SEEN" in answer and created["threadId"] in answer, answer
