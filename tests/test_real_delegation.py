"""Cross-provider delegation with real CLIs: a codex thread's model calls t3's delegate_task
targeting the claudeAgent instance; the child runs on Claude Code; codex's next model request
carries the child's answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from real_cli import claude_provider, codex_provider, create, npm_available, text, wait

pytestmark = [pytest.mark.real_cli,
              pytest.mark.skipif(not npm_available(), reason="npm is not installed")]


def test_codex_delegates_to_claude(model: FakeModelServer, tmp_path: Path,
                                   t3_factory: Any) -> None:
    """codex -> delegate_task(claude, wait) -> the child answers on Claude Code -> codex's next
    request carries that answer; the child thread is Claude's, with lineage to codex's thread."""
    t3 = t3_factory(providers=[codex_provider(tmp_path, model.url),
                               claude_provider(tmp_path, model.url)])
    mcp = t3.client()
    args = {"task": "greet the reviewer", "target": {"providerInstanceId": "claude"},
            "mode": "wait", "title": "greeting"}
    created = create(mcp, f"CALL_MCP delegate_task {json.dumps(args)}",
                     target={"providerInstanceId": "codex"})
    assert wait(mcp, created["threadId"])["status"] == "completed"
    answer = "Hello from fake model. You said: greet the reviewer"
    anthropic = [r for r in model.requests if r.get("api") == "anthropic"]
    assert any("greet the reviewer" in json.dumps(r["body"]) for r in anthropic)
    responses = [r for r in model.requests if r.get("api") == "responses"]
    assert answer in json.dumps(responses[-1]["body"])  # codex sent the tool result back
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])
    page = mcp.call("t3_thread_read", {"threadId": created["threadId"], "view": "activity",
                                       "afterPosition": -1, "limit": 100}).structured
    [task] = [i for i in page["items"] if i["type"] == "subagent"]
    assert task["status"] == "completed" and task["text"] == answer
    child_id = page["transfers"][0]["targetThreadId"]
    child = mcp.call("t3_thread_read", {"threadId": child_id}).structured
    assert child["thread"]["providerInstanceId"] == "claude"
    assert child["thread"]["parentThreadId"] == created["threadId"]
