"""First-run orchestration instructions over ACP: a separate, tagged prompt block before the
user's first prompt, only when the session has t3's MCP server, never again after a resume."""

from __future__ import annotations

from pathlib import Path

from harness import McpClient, agent_log, scripted_provider

TAG = "t3_code_orchestration_instructions"


def prompts(log_path: Path) -> list[list[str]]:
    """The text blocks of every session/prompt the scripted agent received, in order."""
    return [[b["text"] for b in e["msg"]["params"]["prompt"]] for e in agent_log(log_path)
            if e["dir"] == "in" and e["msg"].get("method") == "session/prompt"]


def run(mcp: McpClient, thread_id: str | None, text: str) -> str:
    if thread_id is None:
        result = mcp.call("create_threads", {"threads": [{"prompt": text}]})
        assert result.ok, result.structured
        thread_id = result.structured["threads"][0]["threadId"]
    else:
        assert mcp.call("t3_thread_send", {"threadId": thread_id, "message": text}).ok
    done = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000}).structured
    assert done["status"] == "completed", done
    return thread_id


def test_first_prompt_only_then_not_after_resume(t3_factory, tmp_path: Path) -> None:
    """The first prompt carries the instructions in a tagged block of its own before the user's
    unchanged block; later prompts and a session resumed after a restart carry only the user's."""
    server = t3_factory(providers=[scripted_provider(tmp_path)])
    mcp = server.client()
    thread_id = run(mcp, None, "first ECHO_PROMPT")
    run(mcp, thread_id, "second")
    server.restart()
    run(mcp, thread_id, "third")
    [first, second, third] = prompts(tmp_path / "agent.log")
    instructions, user = first
    assert instructions.startswith(f"<{TAG}>\n") and instructions.endswith(f"\n</{TAG}>")
    assert "delegate_task" in instructions and "task_status" in instructions
    assert user == "first ECHO_PROMPT"
    assert (second, third) == (["second"], ["third"])
    loads = [e for e in agent_log(tmp_path / "agent.log")
             if e["dir"] == "in" and e["msg"].get("method") == "session/load"]
    assert len(loads) == 1  # the third prompt went to the resumed session
    # The agent saw the user's prompt exactly; the instructions were a block apart.
    text = "".join(i["text"] or "" for i in mcp.call("t3_thread_read", {
        "threadId": thread_id, "afterPosition": -1}).structured["items"]
        if i["type"] == "assistant_message")
    assert text.startswith("first ECHO_PROMPT")


def test_turned_off_by_config(t3_factory, tmp_path: Path) -> None:
    """`instructions = false` on a provider sends the user's prompt alone."""
    server = t3_factory(providers=[scripted_provider(tmp_path, instructions=False)])
    run(server.client(), None, "plain")
    assert prompts(tmp_path / "agent.log") == [["plain"]]


def test_grok_gets_them_too(t3_factory, tmp_path: Path) -> None:
    """The grok flavor delivers them the same way."""
    server = t3_factory(providers=[scripted_provider(tmp_path, id="grok", driver="grok")])
    run(server.client(), None, "hi")
    [[instructions, user]] = prompts(tmp_path / "agent-grok.log")
    assert instructions.startswith(f"<{TAG}>") and user == "hi"
