"""The `codex` driver with the real `codex app-server` (@openai/codex, pinned in
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
    """A `[[providers]]` entry running `codex app-server` with its state in tmp and its model
    faked (research/agents.md 2.1; thread/start overrides the approval policy and sandbox)."""
    binary = str(ensure_installed("codex"))
    home = tmp_path / "codex-home"
    codex_home = home / "codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(
        'model = "fake-model"\nmodel_provider = "fake"\n\n'
        '[model_providers.fake]\nname = "Fake"\n'
        f'base_url = "{model_url}/v1"\nwire_api = "responses"\n\n'
        "[features]\nplugins = false\napps = false\nremote_plugin = false\n")
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home),
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state")}
    return {"id": "codex", "driver": "codex", "command": [binary, "app-server"], "env": env}


@pytest.fixture
def server(model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> T3Server:
    return t3_factory(providers=[provider(tmp_path, model.url)])


def test_text_turn(server: T3Server, model: FakeModelServer) -> None:
    """A plain turn completes and its answer is readable; t3's orchestration instructions
    reached the model (in the developer instructions)."""
    mcp = server.client()
    created = create(mcp, "say hi")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "Hello from fake model. You said: say hi" in text(mcp, created["threadId"])
    assert any("You are running inside t3" in json.dumps(r["body"]) for r in model.requests)


def test_tool_call_needs_approval(server: T3Server, tmp_path: Path) -> None:
    """In approval-required mode codex's command becomes a runtime request; accepting it lets
    the turn finish with the command's output."""
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
    """t3_thread_interrupt ends a slow turn interrupted (turn/interrupt)."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    wait_until(lambda: text(mcp, created["threadId"]).strip(), 60)
    stop = mcp.call("t3_thread_interrupt", {"threadId": created["threadId"]})
    assert stop.structured["status"] == "interrupt_requested"
    assert wait(mcp, created["threadId"])["status"] == "interrupted"


def test_native_steer(server: T3Server, model: FakeModelServer) -> None:
    """t3_thread_send auto on a slow turn steers it natively (turn/steer): the same attempt goes
    on and the model's next request carries the new message."""
    mcp = server.client()
    created = create(mcp, "SLOW please")
    tid = created["threadId"]
    wait_until(lambda: text(mcp, tid).strip(), 60)
    before = len(model.requests_for("responses"))
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "say bye", "mode": "auto"})
    assert sent.structured["delivery"] == "steered", sent.structured
    assert wait(mcp, tid)["status"] == "completed"
    run = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"][0]
    assert run["runId"] == created["runId"] and run["attemptCount"] == 1, run
    after = model.requests_for("responses")[before:]
    assert after and "say bye" in FakeModelServer.last_user_text(after[0])
    assert "You said: say bye" in text(mcp, tid)


def test_mcp_injection(server: T3Server) -> None:
    """Codex calls t3's orchestrator_capabilities through the injected server (Authorization
    header), scoped to its own thread."""
    mcp = server.client()
    created = create(mcp, "CALL_MCP orchestrator_capabilities {}")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    answer = text(mcp, created["threadId"])
    assert "TOOL_RESULT_SEEN" in answer and created["threadId"] in answer, answer


def test_own_mcp_tools_need_no_approval(server: T3Server) -> None:
    """t3's own tools run without an approval even in approval-required mode (a tool that is
    not read-only here): codex gets them with default_tools_approval_mode "approve" (the
    credential already scopes them)."""
    mcp = server.client()
    created = create(mcp, 'CALL_MCP t3_thread_interrupt {"threadId": "thread:none"}',
                     runtimeMode="approval-required")
    done = wait(mcp, created["threadId"])
    assert done["status"] == "completed" and done["pendingApproval"] is None, done
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])


def test_mcp_tools_are_split(server: T3Server, model: FakeModelServer) -> None:
    """t3_thread_wait is offered only by t3-code-direct; t3-code offers the rest."""
    mcp = server.client()
    created = create(mcp, "list tools")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    offered: dict[str, set[str]] = {}
    for tool in model.requests_for("responses")[-1]["body"].get("tools") or []:
        if tool.get("type") == "namespace":
            offered[tool["name"]] = {t.get("name") for t in tool.get("tools") or []}
    assert offered.get("mcp__t3_code_direct") == {"t3_thread_wait"}, offered
    assert "t3_thread_read" in offered.get("mcp__t3_code", set()), offered
    assert "t3_thread_wait" not in offered.get("mcp__t3_code", set()), offered


def test_resume_after_restart(server: T3Server, model: FakeModelServer) -> None:
    """After a server restart, a follow-up continues codex's thread (thread/resume)."""
    mcp = server.client()
    created = create(mcp, "remember the word heron")
    wait(mcp, created["threadId"])
    assert server.stop() == 0
    server.restart()
    mcp = server.client()
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "and now?"})
    assert wait(mcp, created["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    last = model.requests_for("responses")[-1]
    assert "remember the word heron" in json.dumps(last["body"])
    assert "and now?" in FakeModelServer.last_user_text(last)
