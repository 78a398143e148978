"""Delegation end to end: agents in t3 threads call t3's MCP tools through the injected server."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from harness import McpClient, T3Server, agent_log, scripted_provider, wait_until


def two_agents(tmp_path: Path) -> list[dict]:
    return [scripted_provider(tmp_path, id="alpha"), scripted_provider(tmp_path, id="beta")]


def create(mcp: McpClient, prompt: str, **entry: object) -> dict:
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: McpClient, thread_id: str, **args: object) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000, **args})
    assert result.ok, result.structured
    return result.structured


def items(mcp: McpClient, thread_id: str, view: str = "activity") -> list[dict]:
    return mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1,
                                       "view": view, "limit": 100}).structured["items"]


def tool_results(mcp: McpClient, thread_id: str) -> list[dict]:
    """The TOOL_RESULT lines the scripted agent wrote in its assistant messages."""
    out = []
    for item in items(mcp, thread_id, "messages"):
        for line in (item["text"] or "").splitlines():
            if item["type"] == "assistant_message" and line.startswith("TOOL_RESULT: "):
                out.append(json.loads(line[len("TOOL_RESULT: "):]))
    return out


def call_line(tool: str, args: dict) -> str:
    return f"CALL_TOOL {tool} {json.dumps(args)}"


def test_delegate_wait_cross_provider(t3_factory, tmp_path: Path) -> None:
    """An agent on alpha delegates to beta in wait mode and gets beta's answer back."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {
        "task": "ECHO_PROMPT", "target": {"providerInstanceId": "beta"}, "mode": "wait",
        "title": "Echo"}), target={"providerInstanceId": "alpha"})
    assert wait(mcp, parent["threadId"])["status"] == "completed"
    [result] = tool_results(mcp, parent["threadId"])
    assert result["status"] == "completed" and result["waitTimedOut"] is False
    assert result["summary"] == "ECHO_PROMPT"  # the child got the task prompt and nothing else
    assert result["providerInstanceId"] == "beta"
    beta_prompts = [e["msg"]["params"]["prompt"][0]["text"] for e in agent_log(
        tmp_path / "agent-beta.log") if e["dir"] == "in" and e["msg"].get("method") ==
        "session/prompt"]
    assert beta_prompts == ["ECHO_PROMPT"]
    timeline = items(mcp, parent["threadId"])
    [sub] = [i for i in timeline if i["type"] == "subagent"]
    assert sub["status"] == "completed" and sub["text"] == "ECHO_PROMPT"
    child = mcp.call("t3_thread_read", {"threadId": result["childThreadId"]}).structured
    assert child["thread"]["parentThreadId"] == parent["threadId"]
    assert child["thread"]["relationshipToParent"] == "subagent"
    assert child["thread"]["providerInstanceId"] == "beta"
    types = [t["type"] for t in child["transfers"]]
    assert types == ["subagent_spawn", "subagent_result"]
    assert all(t["status"] == "consumed" for t in child["transfers"])
