"""The adapter contract: every provider driver passes the same cases (STYLE.md, one contract suite
per interface). Each profile below is one driver with one agent: how to configure it, how to
script it (the scripted ACP agent's trigger words, or the fake model's behind a real CLI), and
what it is expected to do where drivers differ (steering natively or by restart, approvals).

The scripted ACP agent runs in the default tier; the real CLIs are `real_cli` params, installed
from npm at their pinned versions (tests/agents.json) and run against tests/fake_model.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import McpClient, T3Server, scripted_provider, wait_until
from real_cli import (AGENTS, acp_provider, claude_provider, codex_provider, create, npm_available,
                      opencode_provider, pi_provider, text, wait)


FIRST_TEXT = 180  # s until a slow turn's first text; opencode alone takes a minute on a loaded host


@dataclass(frozen=True, slots=True)
class Script:
    """The words that make a provider do something, and what its answers then contain."""
    hello: str                    # the plain answer's prefix, before the prompt
    slow: str                     # a prompt streaming long enough to interrupt or steer
    use_tool: str                 # a prompt making one shell command call
    tool_done: tuple[str, ...]    # in the answer once the command ran
    call: str                     # `{call} <tool> <json>` makes one call of a t3 MCP tool
    call_done: str                # in the answer once that call returned


SCRIPTED_AGENT = Script(hello="Hello from scripted agent. You said: ", slow="SLOW:400 please",
                        use_tool="ASK_PERMISSION", tool_done=("permission granted: allow",),
                        call="CALL_TOOL", call_done="TOOL_RESULT:")
FAKE_MODEL = Script(hello="Hello from fake model. You said: ", slow="SLOW please",
                    use_tool="USE_TOOL: echo fake-tool-ran | tee fake-tool.txt",
                    tool_done=("TOOL_RESULT_SEEN", "fake-tool-ran"),
                    call="CALL_MCP", call_done="TOOL_RESULT_SEEN")


@dataclass(frozen=True, slots=True)
class Profile:
    """One driver with one agent, and what the contract expects of it."""
    provider: Callable[[Path, str], dict[str, Any]]  # (tmp_path, fake model URL) -> [[providers]]
    script: Script
    api: str | None = None        # the fake model API the CLI speaks; None: no model (scripted)
    native_steer: bool = False    # else t3 steers by interrupt and restart (a second attempt)
    approvals: bool = True        # else only full-access is offered: approval-required is refused
    steer_xfail: str | None = None
    resume_skip: str | None = None


def _acp(name: str) -> Callable[[Path, str], dict[str, Any]]:
    return lambda tmp_path, url: acp_provider(name, tmp_path, url)


def _real(id: str, profile: Profile) -> Any:
    return pytest.param(profile, id=id, marks=[
        pytest.mark.real_cli, pytest.mark.skipif(not npm_available(), reason="npm is not installed")])


PROFILES = [
    pytest.param(Profile(lambda tmp_path, _: scripted_provider(tmp_path), SCRIPTED_AGENT), id="scripted-acp"),
    _real("claude-agent-acp", Profile(_acp("claude-agent-acp"), FAKE_MODEL, api="anthropic", steer_xfail=(
        "claude-agent-acp 0.23.1 answers the first prompt after a session/cancel at once "
        "with end_turn and no content; its text arrives with the prompt after that"))),
    _real("codex-acp", Profile(_acp("codex-acp"), FAKE_MODEL, api="responses")),
    _real("gemini-acp", Profile(_acp("gemini"), FAKE_MODEL, api="gemini", resume_skip=(
        "gemini 0.61.0 answers session/load with 'Invalid session identifier' "
        "(research/agents.md 4.4); t3 falls back to a new session"))),
    _real("claude", Profile(claude_provider, FAKE_MODEL, api="anthropic")),
    _real("codex", Profile(codex_provider, FAKE_MODEL, api="responses", native_steer=True)),
    _real("pi", Profile(pi_provider, FAKE_MODEL, api="chat", native_steer=True, approvals=False)),
    _real("opencode", Profile(opencode_provider, FAKE_MODEL, api="chat")),
]


@dataclass
class Driver:
    """A started server whose only provider is the profile's, and what the test needs around it."""
    profile: Profile
    server: T3Server
    mcp: McpClient
    model: FakeModelServer
    tmp_path: Path

    @property
    def script(self) -> Script:
        return self.profile.script

    def call(self, tool: str, args: dict[str, Any]) -> str:
        return f"{self.script.call} {tool} {json.dumps(args)}"

    def model_requests(self) -> list[dict[str, Any]]:
        assert self.profile.api is not None
        return self.model.requests_for(self.profile.api)

    def conversations(self) -> list[tuple[str, str]]:
        """What the provider itself holds of each conversation: (its latest user text, all of it)
        per model request, or per scripted agent session (its history file)."""
        if self.profile.api is not None:
            return [(FakeModelServer.last_user_text(r), json.dumps(r["body"])) for r in self.model_requests()]
        found = []
        for history in (self.tmp_path / "agent-state").glob("*.json"):
            users = [m["text"] for m in json.loads(history.read_text())["messages"] if m["role"] == "user"]
            found += [(users[-1], json.dumps(users))] if users else []
        return found


@pytest.fixture(params=PROFILES)
def driver(request: pytest.FixtureRequest, model: FakeModelServer, tmp_path: Path,
           t3_factory: Any) -> Iterator[Driver]:
    profile: Profile = request.param
    server = t3_factory(providers=[profile.provider(tmp_path, model.url)])
    yield Driver(profile, server, server.client(), model, tmp_path)


def test_text_turn(driver: Driver) -> None:
    """A plain turn completes and its answer is readable, once (deltas are not doubled)."""
    created = create(driver.mcp, "say hi")
    assert wait(driver.mcp, created["threadId"])["status"] == "completed"
    answer = text(driver.mcp, created["threadId"])
    assert f"{driver.script.hello}say hi" in answer
    assert answer.count(driver.script.hello) == 1, answer
    if driver.profile.api is not None:  # t3's orchestration instructions reached the model
        assert any("You are running inside t3" in body for _, body in driver.conversations())


def test_tool_call(driver: Driver) -> None:
    """In approval-required mode a shell command becomes a runtime request (kind "command") and
    accepting it lets the turn finish with the command's output. A driver t3 cannot hold to
    approvals refuses approval-required (never runs it unrestricted) and runs it in full-access."""
    mcp = driver.mcp
    if not driver.profile.approvals:
        refused = mcp.call("create_threads", {"threads": [{
            "prompt": driver.script.use_tool, "runtimeMode": "approval-required"}]})
        assert refused.failure_code == "invalid_request", refused.structured
    created = create(mcp, driver.script.use_tool, runtimeMode="approval-required"
                     if driver.profile.approvals else "full-access")
    state = wait(mcp, created["threadId"])
    if driver.profile.approvals:
        assert state["pendingApproval"] is not None, state
        assert state["pendingApproval"]["kind"] == "command", state
        accepted = mcp.call("t3_pending_request", {"threadId": created["threadId"],
                                                   "action": "respond", "decision": "accept",
                                                   "requestId": state["pendingApproval"]["requestId"]})
        assert accepted.ok, accepted.structured
        state = wait(mcp, created["threadId"])
    assert state["status"] == "completed" and state["pendingApproval"] is None, state
    answer = text(mcp, created["threadId"])
    assert all(done in answer for done in driver.script.tool_done), answer


def test_interrupt(driver: Driver) -> None:
    """t3_thread_interrupt ends a slow turn interrupted."""
    created = create(driver.mcp, driver.script.slow)
    wait_until(lambda: text(driver.mcp, created["threadId"]).strip(), FIRST_TEXT)
    stop = driver.mcp.call("t3_thread_interrupt", {"threadId": created["threadId"]})
    assert stop.structured["status"] == "interrupt_requested"
    assert wait(driver.mcp, created["threadId"])["status"] == "interrupted"


def test_steer(driver: Driver, request: pytest.FixtureRequest) -> None:
    """t3_thread_send auto on a slow turn steers it: natively, the same attempt goes on and the
    model's next request carries the new message; otherwise the run restarts with it (a second
    attempt). Either way the answer is to the new message."""
    if driver.profile.steer_xfail:
        request.applymarker(pytest.mark.xfail(strict=True, reason=driver.profile.steer_xfail))
    mcp = driver.mcp
    created = create(mcp, driver.script.slow)
    tid = created["threadId"]
    wait_until(lambda: text(mcp, tid).strip(), FIRST_TEXT)
    before = len(driver.model_requests()) if driver.profile.native_steer else 0
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "say bye", "mode": "auto"})
    assert sent.structured["delivery"] == "steered", sent.structured
    assert wait(mcp, tid)["status"] == "completed"
    run = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"][0]
    assert run["runId"] == created["runId"], run
    assert run["attemptCount"] == (1 if driver.profile.native_steer else 2), run
    if driver.profile.native_steer:
        after = driver.model_requests()[before:]
        assert after and "say bye" in FakeModelServer.last_user_text(after[0])
    assert "You said: say bye" in text(mcp, tid)


def test_mcp_injection(driver: Driver) -> None:
    """The agent calls t3's orchestrator_capabilities through the MCP server t3 injected, and
    the call is scoped to the agent's own thread."""
    created = create(driver.mcp, driver.call("orchestrator_capabilities", {}))
    assert wait(driver.mcp, created["threadId"])["status"] == "completed"
    answer = text(driver.mcp, created["threadId"])
    assert driver.script.call_done in answer and created["threadId"] in answer, answer


def test_mcp_typed_failure(driver: Driver) -> None:
    """A t3 tool's typed failure (isError, structuredContent {"_tag", code, message}) reaches the
    agent whole: its code and message, not a client's complaint that the result does not fit
    the tool's outputSchema (some clients validate error results too)."""
    created = create(driver.mcp, driver.call("t3_thread_read", {"threadId": "thread:none"}))
    assert wait(driver.mcp, created["threadId"])["status"] == "completed"
    answer = text(driver.mcp, created["threadId"])
    assert driver.script.call_done in answer, answer
    assert "thread_not_found" in answer and "thread:none was not found" in answer, answer
    assert "output schema" not in answer.lower(), answer


def test_resume_after_restart(driver: Driver) -> None:
    """After a server restart, a follow-up continues the provider's own conversation: what the
    provider holds with the new message also holds the first one."""
    if driver.profile.resume_skip:
        pytest.skip(driver.profile.resume_skip)
    mcp = driver.mcp
    created = create(mcp, "remember the word heron")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert driver.server.stop() == 0
    driver.server.restart()
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "and now?"})
    assert wait(mcp, created["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    held = [whole for latest, whole in driver.conversations() if "and now?" in latest]
    assert held and any("remember the word heron" in whole for whole in held), driver.conversations()


def test_agents_are_pinned() -> None:
    """Every real CLI is pinned to an exact version in tests/agents.json."""
    assert all(spec["version"].count(".") == 2 for spec in AGENTS.values())
