"""Provider switch mid-thread and context handoff (issue 12, item 7): t3_thread_send with a
target and a person's `switch` move a thread's next run to another provider in the same thread,
whose first prompt carries the deterministic handoff (research/t3code.md 6.13); a resume that
fails after a restart gets the same handoff instead of a bare prompt. Two scripted ACP
providers, each logging to its own agent log; the text builder is checked at decide level."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fake_model import FakeModelServer
from harness import agent_log, scripted_provider
from real_cli import claude_provider, codex_provider, create, npm_available
from real_cli import wait as real_wait
from test_decide import THREAD, Sim, changed
from test_delegation import call_line, items, tool_results, wait
from test_lifecycle_stop import cli_json, runs
from test_schedules import prompts

import history
import orchestrator as o


def test_switch_alpha_to_beta_mid_thread_hands_off_run_1_in_the_same_thread(
        t3_factory, tmp_path: Path) -> None:
    """t3_thread_send with target beta: run 2 goes to beta in the same thread, beta's first
    prompt is the full-thread handoff with run 1's user and assistant text and then the message;
    read shows both runs with their providers and a handoff item. A person's `send --provider
    alpha` gives alpha only the delta it missed (run 2); `switch` to a provider that is not
    registered is refused, and `switch --provider beta --model M` moves the thread."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                               scripted_provider(tmp_path, id="beta")])
    mcp = t3.client()
    created = mcp.call("create_threads", {"threads": [{
        "prompt": "plan the kiwi migration", "target": {"providerInstanceId": "alpha"}}]})
    tid = created.structured["threads"][0]["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "continue with the plan",
                                       "target": {"providerInstanceId": "beta"}})
    assert sent.ok and sent.structured["threadId"] == tid, sent.structured
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    beta = prompts(tmp_path / "agent-beta.log")
    assert len(beta) == 1
    assert beta[0].startswith(
        "Context handoff (full_thread_summary):\n"
        "Full conversation context for provider handoff.\nFrom driver: acp\nTo driver: acp\n"
        "Covered app runs: 1-1\n\nCanonical conversation context:\n"
        "- User: plan the kiwi migration\n"
        "- Assistant: Hello from scripted agent. You said: plan the kiwi migration\n\n"
        "User message:\ncontinue with the plan"), beta[0]
    by_ordinal = runs(mcp, tid)
    assert [(n, r["providerInstanceId"]) for n, r in sorted(by_ordinal.items())] == [
        (1, "alpha"), (2, "beta")]
    handoffs = [i for i in items(mcp, tid) if i["type"] == "handoff"]
    assert [h["runId"] for h in handoffs] == [by_ordinal[2]["runId"]]
    shown = t3.cli("show", tid).stdout.splitlines()
    assert [line for line in shown if line.startswith(("--- run", "[handoff]"))] == [
        "--- run 1 (completed) on alpha", "--- run 2 (completed) on beta",
        "[handoff] full_thread_summary handoff to beta (completed)"], shown

    refused = t3.cli("switch", tid, "--provider", "nope", "--json")
    assert refused.returncode != 0 and "provider_unavailable" in refused.stdout + refused.stderr
    back = cli_json(t3, "send", tid, "back again", "--provider", "alpha")
    assert (back["threadId"], back["delivery"]) == (tid, "started")
    assert wait(mcp, tid)["status"] == "completed"
    alpha = prompts(tmp_path / "agent-alpha.log")
    assert len(alpha) == 2 and alpha[0] == "plan the kiwi migration"
    assert alpha[1].startswith(
        "Context handoff (delta_since_target_last_seen):\n"
        "Conversation delta since this provider last participated.\n"), alpha[1]
    assert "Covered app runs: 2-2\n" in alpha[1] and "- User: continue with the plan" in alpha[1]
    lines = alpha[1].split("\n")
    assert "- User: plan the kiwi migration" not in lines  # run 1: alpha saw it itself
    handoff_line = next(line for line in lines if line.startswith("- Handoff: "))
    assert len(handoff_line) <= 240 and "Full conversation context" in handoff_line
    assert [r["providerInstanceId"] for _, r in sorted(runs(mcp, tid).items())] == [
        "alpha", "beta", "alpha"]
    switched = cli_json(t3, "switch", tid, "--provider", "beta", "--model", "scripted-2")
    assert (switched["providerInstanceId"], switched["model"], switched["previous"]) == (
        "beta", "scripted-2", {"providerInstanceId": "alpha", "model": "scripted-1"})
    thread = mcp.call("t3_thread_read", {"threadId": tid}).structured["thread"]
    assert (thread["threadId"], thread["providerInstanceId"], thread["model"]) == (
        tid, "beta", "scripted-2")


def test_a_model_switch_reopens_the_same_conversation_on_the_new_model(
        t3_factory, agent_log_path: Path) -> None:
    """switch --model on the same instance: the next run gets a new session that loads the same
    native conversation and selects the new model (before: the live session kept the old
    model); nothing was missed, so no handoff."""
    t3 = t3_factory()
    mcp = t3.client()
    created = mcp.call("create_threads", {"threads": [{"prompt": "first"}]})
    tid = created.structured["threads"][0]["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    cli_json(t3, "switch", tid, "--provider", "scripted", "--model", "scripted-2")
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "second"})
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    methods = [(e["msg"].get("method"), e["msg"].get("params", {}).get("modelId"))
               for e in agent_log(agent_log_path) if e["dir"] == "in"]
    after_first = methods[[m for m, _ in methods].index("session/prompt") + 1:]
    assert ("session/load", None) in after_first and \
        ("session/set_model", "scripted-2") in after_first, methods
    assert prompts(agent_log_path)[1] == "second"
    assert [r["model"] for _, r in sorted(runs(mcp, tid).items())] == ["scripted-1", "scripted-2"]


def test_a_resume_that_fails_after_a_restart_gets_the_handoff_not_a_bare_prompt(
        t3_factory, tmp_path: Path) -> None:
    """An agent without session/load cannot resume its session after a server restart: its
    first prompt in the new session carries run 1's conversation as a full-thread handoff
    (before: only the new message)."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha", args=["--no-load"])])
    mcp = t3.client()
    created = mcp.call("create_threads", {"threads": [{"prompt": "the secret word is mango"}]})
    tid = created.structured["threads"][0]["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    t3.restart()
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "what was the word?"})
    assert sent.ok, sent.structured
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    second = prompts(tmp_path / "agent-alpha.log")[1]
    assert second.startswith("Context handoff (full_thread_summary):\n"), second
    assert "- User: the secret word is mango\n" in second
    assert second.endswith("\n\nUser message:\nwhat was the word?")


def test_an_agent_cannot_switch_a_thread_beyond_its_scope(t3_factory, tmp_path: Path) -> None:
    """An agent in auto-accept-edits sending with a target to a full-access thread is refused
    (runtime_mode_escalation_denied) and the thread keeps its provider and has no run; a
    switching target with mode steer is invalid_request and switches nothing."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                               scripted_provider(tmp_path, id="beta")])
    mcp = t3.client()
    victim = mcp.call("create_threads", {"threads": [{
        "title": "victim", "target": {"providerInstanceId": "alpha"}}]}).structured
    vid = victim["threads"][0]["threadId"]
    beta = {"providerInstanceId": "beta"}
    caller = mcp.call("create_threads", {"threads": [{
        "prompt": "\n".join([
            call_line("t3_thread_send", {"threadId": vid, "message": "hi", "target": beta}),
            call_line("t3_thread_send", {"threadId": vid, "message": "hi", "target": beta,
                                         "mode": "steer"})]),
        "target": {"providerInstanceId": "alpha"}, "runtimeMode": "auto-accept-edits"}]})
    cid = caller.structured["threads"][0]["threadId"]
    assert wait(mcp, cid)["status"] == "completed"
    refused = [r.get("code") for r in tool_results(mcp, cid)]
    assert refused == ["runtime_mode_escalation_denied", "runtime_mode_escalation_denied"]
    read = mcp.call("t3_thread_read", {"threadId": vid}).structured
    assert (read["thread"]["providerInstanceId"], read["recentRuns"]) == ("alpha", [])
    steer = mcp.call("t3_thread_send", {"threadId": cid, "message": "hi", "target": beta,
                                        "mode": "steer"})
    assert steer.structured["code"] == "invalid_request", steer.structured
    assert "starts a new run" in steer.structured["message"]
    assert mcp.call("t3_thread_read", {"threadId": cid}).structured["thread"][
        "providerInstanceId"] == "alpha"


def test_handoff_text_keeps_the_newest_lines_within_the_budget() -> None:
    """Over the budget the oldest item lines go, one line says how many; the header and the
    newest lines stay, and the text is the same every time."""
    lines = [history.handoff_line("User", f"message {n} " + "x" * 300) for n in range(200)]
    made = [history.handoff_text(strategy="full_thread_summary", from_drivers=["codex"],
                           to_driver="claude", covered={"from": 1, "to": 9}, lines=lines)
            for _ in range(2)]
    text = made[0]
    assert made[0] == made[1] and len(text) <= history.HANDOFF_BUDGET
    assert text.startswith("Full conversation context for provider handoff.\nFrom driver: codex\n"
                           "To driver: claude\nCovered app runs: 1-9\n\n"
                           "Canonical conversation context:\n")
    assert text.endswith(lines[-1]) and lines[0] not in text
    kept = sum(line in text for line in lines)
    assert f"- ({200 - kept} earlier items omitted to fit the handoff budget.)" in text
    assert kept > 100  # the budget is used, not wasted
    small = history.handoff_text(strategy="delta_since_target_last_seen", from_drivers=["acp"],
                           to_driver="acp", covered={"from": 2, "to": 2}, lines=[])
    assert small.endswith("Canonical conversation context:\n- No user-visible context items.")


def test_handoff_line_collapses_whitespace_and_is_cut_at_240() -> None:
    """One item line: whitespace collapsed, at most 240 characters ending in '...'."""
    assert history.handoff_line("Assistant", "two\n\n  lines") == "- Assistant: two lines"
    long = history.handoff_line("User", "word " * 100)
    assert len(long) == 240 and long.endswith("...") and long.startswith("- User: word word")


def switched_sim() -> Sim:
    """Run 1 on `scripted` answered and completed; the thread switched to `other` (driver
    codex) and run 2 started there."""
    sim = Sim()
    sim.providers = {**sim.providers, "other": dataclasses.replace(
        sim.providers["scripted"], instance_id="other", driver="codex", models=[{"id": "o1"}])}
    sim.create("first question")
    sim.mark_started()
    sim.ingest(o.TextDelta("first answer"), o.TurnEnded("completed"))
    sim.complete()
    sim.do(o.SwitchProvider(command_id="switch", thread_id=THREAD, provider_instance_id="other",
                            model="o1", runtime_mode="full-access"))
    sim.send("second question")
    sim.mark_started(2)
    return sim


def test_decide_switch_sends_run_2_to_the_new_provider_with_a_recorded_handoff() -> None:
    """provider.switch changes the thread's provider and model; the next run starts on the new
    provider's own provider thread with a full-thread ContextHandoff and a `handoff` item, and
    the handoff is what handoff_prompt puts before the user's text."""
    sim = switched_sim()
    run1, run2 = sim.run(1), sim.run(2)
    assert (run1.provider_instance_id, run2.provider_instance_id) == ("scripted", "other")
    assert run2.model_selection == {"instanceId": "other", "model": "o1"}
    assert run1.provider_thread_id != run2.provider_thread_id
    handoff = sim.get("context-handoff", run2.context_handoff_id)
    assert (handoff.strategy, handoff.covered_run_ordinals, handoff.from_provider_thread_ids) == (
        "full_thread_summary", {"from": 1, "to": 1}, [run1.provider_thread_id])
    assert handoff.summary_text.endswith(
        "From driver: acp\nTo driver: codex\nCovered app runs: 1-1\n\n"
        "Canonical conversation context:\n- User: first question\n- Assistant: first answer")
    (item,) = [i for i in sim.state.items() if i.type == "handoff"]
    assert (item.run_id, item.data["contextHandoffId"], item.data["toProviderInstanceId"]) == (
        run2.id, handoff.id, "other")
    assert history.handoff_prompt("second question", handoff) == (
        f"Context handoff (full_thread_summary):\n{handoff.summary_text}\n\n"
        "User message:\nsecond question")
    assert sim.state.thread.active_provider_thread_id == run2.provider_thread_id
    assert sim.get("provider-thread", run1.provider_thread_id).status == "idle"


def test_decide_no_handoff_when_the_same_provider_continues_its_own_session() -> None:
    """A second run on the provider thread that ran the first, resumed: no handoff."""
    sim = Sim()
    sim.create()
    sim.mark_started()
    sim.ingest(o.TurnEnded("completed"))
    sim.complete()
    sim.send("again")
    decision = sim.mark_started(2)
    assert sim.run(2).context_handoff_id is None
    assert changed(decision, "context-handoff") == []


def test_decide_switch_to_an_unregistered_provider_is_refused_and_changes_nothing() -> None:
    """An unknown instance: provider_unavailable; the same selection again: no events."""
    sim = Sim()
    sim.create(None)
    with pytest.raises(o.CommandRejected) as refused:
        sim.decide(o.SwitchProvider(command_id="s", thread_id=THREAD, provider_instance_id="nope",
                                    model=None, runtime_mode="full-access"))
    assert refused.value.code == "provider_unavailable"
    same = sim.decide(o.SwitchProvider(command_id="s2", thread_id=THREAD,
                                       provider_instance_id="scripted", model="m1",
                                       runtime_mode="full-access"))
    assert same.events == ()


@pytest.mark.real_cli
@pytest.mark.skipif(not npm_available(), reason="npm is not installed")
def test_real_switch_codex_to_claude_hands_off_run_1(model: FakeModelServer, tmp_path: Path,
                                                     t3_factory) -> None:
    """The real codex and Claude Code CLIs (fake model): run 1 on codex, then t3_thread_send
    with target claude; Claude's first model request carries the handoff with run 1's user and
    assistant text before the new message; same thread id, read shows both runs' providers."""
    t3 = t3_factory(providers=[codex_provider(tmp_path, model.url),
                               claude_provider(tmp_path, model.url)])
    mcp = t3.client()
    created = create(mcp, "plan the kiwi migration", target={"providerInstanceId": "codex"})
    tid = created["threadId"]
    assert real_wait(mcp, tid)["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "continue with the plan",
                                       "target": {"providerInstanceId": "claude"}})
    assert sent.ok and sent.structured["threadId"] == tid, sent.structured
    assert real_wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    claude = [json.dumps(r["body"]) for r in model.requests_for("anthropic")
              if "continue with the plan" in json.dumps(r["body"])]
    assert claude, [r["path"] for r in model.requests]
    first = json.loads(claude[0])
    assert "Context handoff (full_thread_summary):" in claude[0]
    handoff = "\n".join(_texts(first))
    assert "Covered app runs: 1-1\n\nCanonical conversation context:\n- User: plan the kiwi " \
           "migration\n- Assistant: Hello from fake model. You said: plan the kiwi migration" \
           in handoff, handoff
    assert "User message:\ncontinue with the plan" in handoff
    assert [(n, r["providerInstanceId"]) for n, r in sorted(runs(mcp, tid).items())] == [
        (1, "codex"), (2, "claude")]


def _texts(value: object) -> list[str]:
    """Every string in a JSON value (the text parts of a model request), depth first."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []
