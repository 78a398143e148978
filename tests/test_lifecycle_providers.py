"""Honest providers (issue 13, item 6): the modes an adapter can enforce, models and login state
from the CLI, unrunnable drivers listed with a reason, driver-only targets, and delegation owned
by the provider session."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import tools
from fake_model import FakeModelServer
from harness import McpClient, scripted_provider
from real_cli import codex_provider, ensure_installed, npm_available
from test_decide import SESSION, Sim
from test_delegation import call_line, create, items, wait


def tool_outcomes(mcp: McpClient, thread_id: str) -> list[str]:
    """The TOOL_RESULT / TOOL_ERROR lines the scripted agent wrote, in order (a typed failure
    is a TOOL_RESULT whose JSON is tagged OrchestratorMcpFailure)."""
    return [line for item in items(mcp, thread_id, "messages")
            if item["type"] == "assistant_message"
            for line in (item["text"] or "").splitlines()
            if line.startswith(("TOOL_RESULT: ", "TOOL_ERROR: "))]


def providers_of(mcp: McpClient, **args: Any) -> dict[str, dict]:
    caps = mcp.call("orchestrator_capabilities", args)
    assert caps.ok, caps.structured
    return {p["providerInstanceId"]: p for p in caps.structured["providers"]}


def pi_instance() -> dict[str, Any]:
    # `true` stands in for pi's executable: nothing here runs a pi turn, and its empty
    # --list-models output is no claim either way.
    return {"id": "pi", "driver": "pi", "command": ["true"]}


def test_pi_offers_only_full_access_and_narrower_modes_are_refused(t3_factory, tmp_path: Path
                                                                   ) -> None:
    """Pi cannot enforce approvals or plan: capabilities list runtimeModes ["full-access"] (and
    interactionModes ["default"]) for pi alone; an explicit approval-required or plan thread on
    pi is refused, and an inherited approval-required delegation is refused, not run."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path), pi_instance()])
    mcp = t3.client()
    listed = providers_of(mcp)
    assert listed["pi"]["runtimeModes"] == ["full-access"], listed["pi"]
    assert listed["pi"]["interactionModes"] == ["default"]
    assert "runtimeModes" not in listed["scripted"] and "interactionModes" not in listed["scripted"]
    for modes in ({"runtimeMode": "approval-required"}, {"interactionMode": "plan"}):
        refused = mcp.call("create_threads", {"threads": [
            {"prompt": "hi", "target": {"providerInstanceId": "pi"}, **modes}]})
        assert refused.failure_code == "invalid_request", refused.structured
    parent = create(mcp, call_line("delegate_task", {"task": "hi", "target": {
        "providerInstanceId": "pi"}}), target={"providerInstanceId": "scripted"},
        runtimeMode="approval-required")
    assert wait(mcp, parent["threadId"])["status"] == "completed"
    [outcome] = tool_outcomes(mcp, parent["threadId"])
    assert '"code":"runtime_mode_escalation_denied"' in outcome, outcome
    threads = mcp.call("t3_thread_list", {"includeSubagents": True}).structured["threads"]
    assert [t["threadId"] for t in threads] == [parent["threadId"]]  # no child was made


def test_acp_models_and_login_come_from_the_agent(t3_factory, tmp_path: Path) -> None:
    """With no configured models, an ACP instance lists the models its session/new advertises;
    an agent that refuses a session for want of authentication is listed "not logged in"."""
    t3 = t3_factory(providers=[
        scripted_provider(tmp_path, models=()),
        scripted_provider(tmp_path, id="out", models=(), env={"SCRIPTED_AGENT_AUTH": "mcp-only"})])
    listed = providers_of(t3.client())
    ok, out = listed["scripted"], listed["out"]
    assert [(m["id"], m["label"]) for m in ok["models"]] == [
        ("scripted-1", "Scripted 1"), ("scripted-2", "Scripted 2")]
    assert ok["canRunChildTask"] and ok["omittedModels"] == 0
    assert not out["canRunChildTask"] and out["constraints"][0].startswith("not logged in"), out


def test_driver_only_target_skips_the_parents_unavailable_instance(t3_factory, tmp_path: Path
                                                                   ) -> None:
    """A parent on an instance that is not logged in delegates with only driverKind: the child
    runs on an available instance of that driver instead of failing on the parent's."""
    t3 = t3_factory(providers=[
        scripted_provider(tmp_path, id="out", env={"SCRIPTED_AGENT_AUTH": "mcp-only"}),
        scripted_provider(tmp_path, id="other")])
    mcp = t3.client()
    prompt = "\n".join([call_line("orchestrator_capabilities", {}), call_line("delegate_task", {
        "task": "ECHO_PROMPT", "target": {"driverKind": "acp"}, "mode": "wait"})])
    parent = create(mcp, prompt, target={"providerInstanceId": "out"})
    assert wait(mcp, parent["threadId"])["status"] == "completed"
    caps, delegated = tool_outcomes(mcp, parent["threadId"])
    assert '"not logged in' in caps  # the probe ran before the delegation
    assert "OrchestratorMcpFailure" not in delegated, delegated
    assert '"providerInstanceId":"other"' in delegated and '"status":"completed"' in delegated


def test_unrunnable_drivers_are_listed_unavailable(t3_factory, tmp_path: Path) -> None:
    """A config naming cursor, antigravity or opencode2 starts; each is listed unavailable with
    its reason, and a thread on one is refused."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path), *(
        {"id": driver, "driver": driver} for driver in ("cursor", "antigravity", "opencode2"))])
    mcp = t3.client()
    listed = providers_of(mcp)
    for driver in ("cursor", "antigravity", "opencode2"):
        assert listed[driver]["driverKind"] == driver
        assert not listed[driver]["canRunChildTask"] and listed[driver]["constraints"], listed
    refused = mcp.call("create_threads", {"threads": [
        {"prompt": "hi", "target": {"providerInstanceId": "cursor"}}]})
    assert refused.failure_code == "provider_unavailable"


def test_delegation_ownership_is_the_provider_session() -> None:
    """A credential owns the thread's active run only when the run's turn runs in that
    credential's provider session: another session of the same instance does not."""
    sim = Sim()
    sim.create()
    sim.mark_started()
    mine = tools.Scope(kind="thread", key="k", thread_id="thread-1",
                       provider_instance_id="scripted", provider_session_id=SESSION)
    stale = tools.Scope(kind="thread", key="k", thread_id="thread-1",
                        provider_instance_id="scripted", provider_session_id="provider-session:0")
    assert tools._live_run(sim.state, mine) == sim.run()
    assert tools._live_run(sim.state, stale) is None


# ---------------------------------------------------------------- real CLIs (fake model)

@pytest.mark.real_cli
@pytest.mark.skipif(not npm_available(), reason="npm is not installed")
def test_detected_codex_lists_its_models_from_the_cli(t3_factory, tmp_path: Path,
                                                      model: FakeModelServer) -> None:
    """With only `codex` on PATH and no t3.toml, orchestrator_capabilities lists the models
    codex's model/list gives (default first; hidden ones only through search), and the
    instance is available: codex's provider (the fake model) needs no OpenAI login."""
    binary = ensure_installed("codex")
    path = tmp_path / "bin"
    path.mkdir()
    (path / "codex").symlink_to(binary)
    env = codex_provider(tmp_path, model.url)["env"]
    t3 = t3_factory(config=tmp_path / "absent.toml", env={
        **env, "PATH": f"{path}:{Path(shutil.which('node') or '/usr/bin/node').parent}"})
    [codex] = providers_of(t3.client()).values()
    assert (codex["providerInstanceId"], codex["canRunChildTask"]) == ("codex", True), codex
    assert len(codex["models"]) >= 2 and all(m["id"] and m["label"] for m in codex["models"])
    assert not any(m["id"] == "fake-model" for m in codex["models"])  # codex's, not t3.toml's


@pytest.mark.real_cli
@pytest.mark.skipif(not npm_available(), reason="npm is not installed")
def test_logged_out_claude_is_listed_not_logged_in(t3_factory, tmp_path: Path) -> None:
    """claude with an empty config dir and no API key: `claude auth status` says loggedIn
    false, so the instance is unavailable "not logged in"; it still lists its aliases."""
    home = tmp_path / "claude-home"
    home.mkdir()
    t3 = t3_factory(providers=[{"id": "claude", "driver": "claudeAgent", "env": {
        "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / "claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1"},
        "command": [str(ensure_installed("claude")), "-p"]}],
        env={"ANTHROPIC_API_KEY": "", "ANTHROPIC_AUTH_TOKEN": ""})
    [claude] = providers_of(t3.client()).values()
    assert not claude["canRunChildTask"] and claude["constraints"][0].startswith("not logged in")
    assert [m["id"] for m in claude["models"]][:3] == ["sonnet", "opus", "haiku"]
