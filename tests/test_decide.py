"""Unit tests for ``orchestrator.decide``: no database, no server, no clock.

State is built only by applying decisions, as ``Orchestrator._apply`` does: every event goes
through ``ThreadState.apply`` (its payload becomes an entity; appended text grows its message). Time is one fixed string and ids come from a counter, so every decision replays.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import history  # noqa: E402
import orchestrator as o  # noqa: E402
import schedules  # noqa: E402
from harness import CountingIds  # noqa: E402
import store  # noqa: E402
import workspace  # noqa: E402

NOW = "2030-01-02T03:04:05.678Z"
THREAD = "thread-1"
SESSION = "provider-session:1"


def providers(*, active_steering: bool = False) -> dict[str, o.ProviderInfo]:
    return {"scripted": o.ProviderInfo(
        instance_id="scripted", driver="acp", display_name=None, models=[{"id": "m1"}],
        capabilities=o.Capabilities(supports_active_steering=active_steering,
                                    supports_steering_by_restart=True))}


def apply(state: o.ThreadState, decision: o.Decision) -> o.ThreadState:
    """What ``Orchestrator._apply`` does with committed events, minus sequences and wakes."""
    for event in decision.events:
        state.apply(event.type, event.payload)
    return state


def changed(decision: o.Decision, kind: str) -> list[Any]:
    """The entities of one kind that a decision writes, in event order."""
    return [o._ENTITY_TYPES[kind].from_json(e.payload) for e in decision.events
            if store.event_kind(e.type) == kind]


def final(decision: o.Decision, kind: str, entity_id: str) -> Any:
    """The last version of one entity that a decision writes (None if it does not touch it)."""
    versions = [e for e in changed(decision, kind) if e.id == entity_id]
    return versions[-1] if versions else None


def effect_types(decision: o.Decision) -> list[str]:
    return [e.effect_type for e in decision.effects]


def create_command(command_id: str, *, text: str | None = "hello") -> o.CreateThread:
    initial = o.InitialMessage(message_id="msg-1", text=text) if text is not None else None
    return o.CreateThread(
        command_id=command_id, thread_id=THREAD, project_id="default", title="A thread",
        provider_instance_id="scripted", model="m1", runtime_mode="full-access",
        interaction_mode="default", workspace="/work/ws", created_by="user",
        creation_source="web", initial_message=initial)


class Sim:
    """One thread, advanced by deciding commands and applying the decisions."""

    def __init__(self, *, active_steering: bool = False) -> None:
        self.state = o.ThreadState()
        self.providers = providers(active_steering=active_steering)
        self.count = 0
        self.now = NOW

    def cid(self, label: str) -> str:
        self.count += 1
        return f"cmd-{self.count}-{label}"

    def decide(self, command: Any) -> o.Decision:
        return o.decide(self.state, command, now=self.now, new_id=CountingIds(),
                        providers=self.providers)

    def do(self, command: Any) -> o.Decision:
        decision = self.decide(command)
        apply(self.state, decision)
        return decision

    def run(self, ordinal: int = 1) -> o.Run:
        return self.state.run(f"run:{THREAD}:{ordinal}")

    def get(self, kind: str, entity_id: str) -> Any:
        return self.state.entities[kind].get(entity_id)

    # Commands, each decided and applied; the decision is returned for inspection.
    def create(self, text: str | None = "hello") -> o.Decision:
        return self.do(create_command(self.cid("create"), text=text))

    def send(self, text: str = "more", *, mode: str = "start_immediately",
             target: str | None = None) -> o.Decision:
        command_id = self.cid("send")
        return self.do(o.DispatchMessage(
            command_id=command_id, thread_id=THREAD, message_id=f"msg-{command_id}", text=text,
            created_by="agent", creation_source="mcp", mode=mode, target_run_id=target))

    def mark_started(self, ordinal: int = 1, *, attempt_id: str | None = None,
                     resume_failed: bool = False) -> o.Decision:
        run = self.run(ordinal)
        return self.do(o.MarkRunStarted(
            command_id=self.cid("start"), thread_id=THREAD, run_id=run.id,
            attempt_id=attempt_id or run.active_attempt_id, provider_session_id=SESSION,
            session_created=True, pid=4242, native_thread_ref="native-thread-1", cwd="/work/ws",
            resume_failed=resume_failed))

    def ingest(self, *events: Any, ordinal: int = 1, attempt_id: str | None = None) -> o.Decision:
        run = self.run(ordinal)
        return self.do(o.IngestProviderEvents(
            command_id=self.cid("ingest"), thread_id=THREAD, run_id=run.id,
            attempt_id=attempt_id or run.active_attempt_id, provider_session_id=SESSION,
            events=tuple(events)))

    def interrupt(self, ordinal: int = 1, reason: str | None = None) -> o.Decision:
        return self.do(o.InterruptRun(command_id=self.cid("interrupt"), thread_id=THREAD,
                                      run_id=self.run(ordinal).id, reason=reason))

    def complete(self, ordinal: int = 1) -> o.Decision:
        return self.do(o.CompleteRun(command_id=self.cid("complete"), thread_id=THREAD,
                                     run_id=self.run(ordinal).id))

    def fail(self, ordinal: int = 1, *, status: str = "failed", reason: str = "boom") -> o.Decision:
        return self.do(o.FailRun(command_id=self.cid("fail"), thread_id=THREAD,
                                 run_id=self.run(ordinal).id, attempt_id=None, status=status,
                                 reason=reason))

    def respond(self, request_id: str, decision: str = "accept") -> o.Decision:
        return self.do(o.RespondRuntimeRequest(command_id=self.cid("respond"), thread_id=THREAD,
                                               request_id=request_id, decision=decision))

    def recover(self, reason: str = "The server restarted.",
                resumable: frozenset[str] = frozenset()) -> o.Decision:
        return self.do(o.RecoverThread(command_id=self.cid("recover"), thread_id=THREAD,
                                       reason=reason, resumable_run_ids=resumable))


def running_sim(**kwargs: Any) -> Sim:
    """A thread whose first run is running with a live provider turn."""
    sim = Sim(**kwargs)
    sim.create()
    sim.mark_started()
    return sim


PERMISSION = o.RuntimeRequestOpened(native_ref="perm-1", request_kind="permission",
                                    title="Run ls?", detail={"command": "ls"})
REQUEST_ID = f"runtime-request:{SESSION}:perm-1"


# =============================================================================================
# Purity and determinism


def test_decide_is_deterministic_and_leaves_state_untouched() -> None:
    """Same state + command + clock + id source decides equal events and effects; state is unchanged."""
    sim = running_sim()
    sim.ingest(o.TextDelta("partial"), PERMISSION)
    sim.send("later")  # queued behind the running run
    run = sim.run()
    commands = [
        o.DispatchMessage(command_id="c-a", thread_id=THREAD, message_id="m-a", text="x",
                          created_by="user", creation_source="web", mode="queue_after_active"),
        o.DispatchMessage(command_id="c-b", thread_id=THREAD, message_id="m-b", text="y",
                          created_by="user", creation_source="web", mode="steer_active",
                          target_run_id=run.id),
        o.IngestProviderEvents(command_id="c-c", thread_id=THREAD, run_id=run.id,
                               attempt_id=run.active_attempt_id, provider_session_id=SESSION,
                               events=(o.TextDelta("more"), o.TurnEnded("interrupted"))),
        o.InterruptRun(command_id="c-d", thread_id=THREAD, run_id=run.id),
        o.RespondRuntimeRequest(command_id="c-e", thread_id=THREAD, request_id=REQUEST_ID,
                                decision="accept"),
        o.FailRun(command_id="c-f", thread_id=THREAD, run_id=run.id, attempt_id=None,
                  status="failed", reason="gone"),
        o.RecoverThread(command_id="c-g", thread_id=THREAD, reason="restart"),
    ]
    for command in commands:
        before = (copy.deepcopy(sim.state.entities), sim.state.thread, sim.state.next_position)
        first, second = sim.decide(command), sim.decide(command)
        assert first == second, command
        assert first.commit(command) == second.commit(command)
        assert (sim.state.entities, sim.state.thread, sim.state.next_position) == before, command


# =============================================================================================
# Creating threads and dispatching messages


def test_create_thread_with_initial_message_starts_the_first_run() -> None:
    """CreateThread with a message: thread, starting run #1, attempt, root, user message + item, start effect."""
    sim = Sim()
    decision = sim.create()
    assert [e.type for e in decision.events][:3] == ["thread.created", "run.created",
                                                     "run-attempt.created"]
    thread = sim.state.thread
    assert (thread.id, thread.created_by, thread.creation_source) == (THREAD, "user", "web")
    run = sim.run()
    assert (run.status, run.ordinal, run.user_message_id) == ("starting", 1, "msg-1")
    attempt = sim.get("run-attempt", run.active_attempt_id)
    assert (attempt.attempt_ordinal, attempt.status, attempt.reason) == (1, "pending", "initial")
    root = sim.get("node", run.root_node_id)
    assert (root.kind_, root.parent_node_id, root.counts_for_run) == ("root_turn", None, True)
    message = sim.get("message", "msg-1")
    assert (message.role, message.text, message.created_by, message.creation_source) == \
        ("user", "hello", "user", "web")
    [item] = sim.state.items()
    assert (item.type, item.position, item.message_id, item.input_intent) == \
        ("user_message", 0, "msg-1", "turn_start")
    assert effect_types(decision) == ["provider-turn.start"]
    assert decision.effects[0].payload == {"runId": run.id, "attemptId": attempt.id}
    assert decision.result == {"threadId": THREAD, "runId": run.id, "messageId": "msg-1",
                               "delivery": "started"}


def test_effect_and_event_ids_derive_from_the_command_id() -> None:
    """Effect and event ids are a function of the command id, so a replayed command converges."""
    state = o.ThreadState()
    command = create_command("cmd-create")
    commit = o.decide(state, command, now=NOW, new_id=CountingIds(),
                      providers=providers()).commit(command)
    [effect] = commit.effects
    assert effect.effect_id == f"effect:cmd-create:provider-turn.start:run:{THREAD}:1"
    assert [e.event_id for e in commit.events] == \
        [f"event:cmd-create:{i}" for i in range(len(commit.events))]
    other = dataclasses.replace(command, command_id="cmd-other")
    other_commit = o.decide(state, other, now=NOW, new_id=CountingIds(),
                            providers=providers()).commit(other)
    assert other_commit.effects[0].effect_id == \
        f"effect:cmd-other:provider-turn.start:run:{THREAD}:1"
    assert commit.fingerprint == other_commit.fingerprint


def test_create_thread_without_message_starts_nothing() -> None:
    """CreateThread without a message creates only the thread: no run, item or effect."""
    sim = Sim()
    decision = sim.create(text=None)
    assert [e.type for e in decision.events] == ["thread.created"]
    assert decision.effects == () and sim.state.runs == []
    assert sim.state.status() == "idle"


def test_dispatch_on_an_idle_thread_starts_a_run() -> None:
    """start_immediately with nothing blocking gives a starting run, its user item and a start effect."""
    sim = Sim()
    sim.create(text=None)
    decision = sim.send("go")
    run = sim.run()
    assert (run.status, run.ordinal, run.queue_position) == ("starting", 1, None)
    assert decision.result["delivery"] == "started"
    assert [i.input_intent for i in sim.state.items()] == ["turn_start"]
    assert effect_types(decision) == ["provider-turn.start"]


@pytest.mark.parametrize("blocking", ["starting", "running", "waiting"])
def test_dispatch_behind_a_blocking_run_queues_without_item_or_effect(blocking: str) -> None:
    """A message sent while a run blocks becomes a queued run: queuePosition, no user item, no effect."""
    sim = Sim()
    sim.create()
    if blocking != "starting":
        sim.mark_started()
    if blocking == "waiting":
        sim.ingest(o.TurnEnded("completed"))
    assert sim.run().status == blocking
    items_before = len(sim.state.items())
    decision = sim.send("later")
    queued = sim.run(2)
    assert (queued.status, queued.queue_position) == ("queued", 1)
    assert decision.result["delivery"] == "queued"
    assert decision.effects == ()
    assert changed(decision, "turn-item") == []
    assert len(sim.state.items()) == items_before
    sim.send("even later")
    assert sim.run(3).queue_position == 2


def assert_promoted(decision: o.Decision, sim: Sim, ordinal: int = 2) -> None:
    promoted = final(decision, "run", f"run:{THREAD}:{ordinal}")
    assert promoted is not None, "the queued run was not promoted in this decision"
    assert (promoted.status, promoted.queue_position) == ("starting", None)
    [item] = [i for i in changed(decision, "turn-item") if i.run_id == promoted.id]
    assert (item.type, item.input_intent, item.message_id) == \
        ("user_message", "queued_turn", promoted.user_message_id)
    assert item.position == max(i.position for i in sim.state.items())
    assert ("provider-turn.start", {"runId": promoted.id, "attemptId": promoted.active_attempt_id}) \
        in [(e.effect_type, e.payload) for e in decision.effects]


def test_queued_run_is_promoted_when_the_turn_ends_interrupted() -> None:
    """TurnEnded(interrupted) ends the run and starts the queued run in the same decision."""
    sim = running_sim()
    sim.send("later")
    decision = sim.ingest(o.TurnEnded("interrupted"))
    assert final(decision, "run", sim.run().id).status == "interrupted"
    assert_promoted(decision, sim)


def test_queued_run_is_promoted_when_the_run_fails() -> None:
    """FailRun ends the run with a failure and starts the queued run in the same decision."""
    sim = running_sim()
    sim.send("later")
    decision = sim.fail(reason="the provider crashed")
    run = sim.run()
    assert (run.status, run.status_reason) == ("failed", "the provider crashed")
    assert run.failure["message"] == "the provider crashed"
    assert_promoted(decision, sim)


def test_completed_turn_waits_for_finalize_and_only_completion_promotes() -> None:
    """TurnEnded(completed) moves running -> waiting with run.finalize; CompleteRun completes and promotes."""
    sim = running_sim()
    sim.send("later")
    waiting = sim.ingest(o.TurnEnded("completed"))
    run = sim.run()
    assert (run.status, run.completed_at) == ("waiting", None)
    assert sim.get("node", run.root_node_id).status == "waiting"
    assert sim.get("run-attempt", run.active_attempt_id).status == "completed"
    assert effect_types(waiting) == ["run.finalize"]
    assert waiting.effects[0].replay_safe
    assert sim.run(2).status == "queued"
    done = sim.complete()
    assert sim.run().status == "completed"
    assert sim.get("node", run.root_node_id).status == "completed"
    assert_promoted(done, sim)


def test_complete_run_rejects_a_run_that_is_not_waiting() -> None:
    """Only a waiting run (root turn done) can complete."""
    sim = running_sim()
    with pytest.raises(o.CommandRejected):
        sim.complete()


# =============================================================================================
# Starting runs


def test_mark_run_started_moves_starting_to_running() -> None:
    """MarkRunStarted creates the provider session, thread and turn and marks the run running."""
    sim = Sim()
    sim.create()
    decision = sim.mark_started()
    run = sim.run()
    assert (run.status, run.started_at) == ("running", NOW)
    session = sim.get("provider-session", SESSION)
    assert (session.status, session.pid, session.driver, session.model) == \
        ("running", 4242, "acp", "m1")
    pthread = sim.get("provider-thread", run.provider_thread_id)
    assert (pthread.status, pthread.provider_session_id, pthread.native_thread_ref) == \
        ("active", SESSION, "native-thread-1")
    assert sim.state.thread.active_provider_thread_id == pthread.id
    attempt = sim.get("run-attempt", run.active_attempt_id)
    turn = sim.get("provider-turn", attempt.provider_turn_id)
    assert (turn.status, turn.ordinal, turn.node_id) == ("running", 1, run.root_node_id)
    assert attempt.status == "running"
    assert sim.get("node", run.root_node_id).status == "running"
    assert decision.effects == ()


def test_mark_run_started_rejects_a_stale_attempt_or_a_run_not_starting() -> None:
    """MarkRunStarted for an unknown attempt, or for a run already running, is rejected."""
    sim = Sim()
    sim.create()
    with pytest.raises(o.CommandRejected):
        sim.mark_started(attempt_id=f"run:{THREAD}:1:attempt:9")
    sim.mark_started()
    with pytest.raises(o.CommandRejected):
        sim.mark_started()


# =============================================================================================
# Ingesting provider events


def test_text_deltas_stream_into_one_assistant_message() -> None:
    """Consecutive TextDeltas concatenate into one streaming assistant message with one item."""
    sim = running_sim()
    sim.ingest(o.TextDelta("Hel"), o.TextDelta("lo"))
    sim.ingest(o.TextDelta(" world"))
    [message] = [m for m in sim.state.entities["message"].values() if m.role == "assistant"]
    assert (message.text, message.streaming, message.created_by) == ("Hello world", True, "agent")
    items = [i for i in sim.state.items() if i.type == "assistant_message"]
    assert [(i.message_id, i.status) for i in items] == [(message.id, "running")]


def test_a_tool_update_closes_the_open_stream() -> None:
    """A ToolUpdate closes the streaming message; text after it opens a new message."""
    sim = running_sim()
    sim.ingest(o.TextDelta("Let me look."), o.ToolUpdate("tool-1", "pending", title="ls"),
               o.TextDelta("Done."))
    first, second = sorted((m for m in sim.state.entities["message"].values()
                            if m.role == "assistant"), key=lambda m: m.id)
    assert (first.text, first.streaming) == ("Let me look.", False)
    assert (second.text, second.streaming) == ("Done.", True)
    assert [i.type for i in sim.state.items()] == ["user_message", "assistant_message",
                                                   "tool_call", "assistant_message"]
    tool = next(i for i in sim.state.items() if i.type == "tool_call")
    assert (tool.status, tool.title) == ("running", "ls")


def test_turn_completed_closes_streams() -> None:
    """TurnEnded(completed) closes the open assistant and reasoning streams and their items."""
    sim = running_sim()
    sim.ingest(o.ReasoningDelta("thinking"), o.TextDelta("answer"))
    sim.ingest(o.TurnEnded("completed"))
    messages = [m for m in sim.state.entities["message"].values() if m.role != "user"]
    assert sorted(m.role for m in messages) == ["assistant", "reasoning"]
    assert not any(m.streaming for m in messages)
    assert all(i.status == "completed" for i in sim.state.items())


def test_events_for_a_superseded_attempt_do_not_touch_the_run() -> None:
    """After a restart, the old attempt's text is dropped and only its provider turn's end is kept."""
    sim = running_sim()
    old_attempt = sim.get("run-attempt", sim.run().active_attempt_id)
    sim.send("redo", mode="restart_active", target=sim.run().id)
    decision = sim.ingest(o.TextDelta("stale"), o.ToolUpdate("t", "running"),
                          o.TurnEnded("interrupted"), attempt_id=old_attempt.id)
    assert [e.type for e in decision.events] == ["provider-turn.updated"]
    assert sim.get("provider-turn", old_attempt.provider_turn_id).status == "interrupted"
    assert sim.run().status == "starting"
    assert not any(m.text == "stale" for m in sim.state.entities["message"].values())


# =============================================================================================
# Steering


def test_steering_without_active_steering_interrupts_and_restarts() -> None:
    """steer_active on a provider without steering supersedes the attempt and restarts the run."""
    sim = running_sim()
    run = sim.run()
    old_attempt_id, old_root = run.active_attempt_id, run.root_node_id
    decision = sim.send("change course", mode="steer_active", target=run.id)
    assert decision.result["delivery"] == "steered"
    assert sim.get("run-attempt", old_attempt_id).status == "superseded"
    assert sim.get("node", old_root).status == "interrupted"
    run = sim.run()
    new_attempt = sim.get("run-attempt", run.active_attempt_id)
    assert (new_attempt.attempt_ordinal, new_attempt.reason, new_attempt.status) == \
        (2, "steering_restart", "pending")
    assert run.active_attempt_id == f"{run.id}:attempt:2" != old_attempt_id
    assert run.root_node_id == new_attempt.root_node_id != old_root
    assert sim.get("node", run.root_node_id).kind_ == "root_turn"
    assert run.status == "starting"
    assert effect_types(decision) == ["provider-turn.restart"]
    assert decision.effects[0].payload == {"runId": run.id, "interruptedAttemptId": old_attempt_id,
                                           "attemptId": new_attempt.id}
    item = sim.state.items()[-1]
    assert (item.type, item.input_intent, item.node_id) == ("user_message", "steer", run.root_node_id)
    sim.mark_started()  # the restarted attempt starts like any other
    assert sim.run().status == "running"


def test_restart_active_reports_restarted() -> None:
    """restart_active takes the same interrupt-and-restart path and reports delivery restarted."""
    sim = running_sim(active_steering=True)
    decision = sim.send("start over", mode="restart_active", target=sim.run().id)
    assert decision.result["delivery"] == "restarted"
    assert effect_types(decision) == ["provider-turn.restart"]
    assert sim.run().status == "starting"


def test_active_steering_sends_a_steer_effect_and_keeps_running() -> None:
    """With active steering the message goes to the live turn: a steer effect, the run stays running."""
    sim = running_sim(active_steering=True)
    run = sim.run()
    decision = sim.send("also do X", mode="steer_active", target=run.id)
    assert decision.result["delivery"] == "steered"
    assert effect_types(decision) == ["provider-turn.steer"]
    assert sim.run() == run  # untouched: same attempt, same root, still running
    assert sim.state.items()[-1].input_intent == "steer"


@pytest.mark.parametrize("situation", ["starting", "queued", "waiting"])
def test_steering_a_run_without_a_running_turn_is_rejected(situation: str) -> None:
    """Steering needs a running run with a running provider turn, else thread_not_sendable."""
    sim = Sim()
    sim.create()
    ordinal = 1
    if situation == "queued":
        sim.send("queued")
        ordinal = 2
    if situation == "waiting":
        sim.mark_started()
        sim.ingest(o.TurnEnded("completed"))
    with pytest.raises(o.CommandRejected) as info:
        sim.send("steer", mode="steer_active", target=sim.run(ordinal).id)
    assert info.value.code == "thread_not_sendable"


# =============================================================================================
# Interrupting


def test_interrupting_a_running_turn_asks_the_provider() -> None:
    """InterruptRun on a live turn records the request and emits an interrupt effect; still running."""
    sim = running_sim()
    decision = sim.interrupt(reason="stop please")
    assert decision.result["status"] == "interrupt_requested"
    assert sim.run().status == "running"
    item = sim.state.items()[-1]
    assert (item.type, item.text) == ("run_interrupt_request", "stop please")
    assert effect_types(decision) == ["provider-turn.interrupt"]
    sim.ingest(o.TurnEnded("interrupted"))
    assert (sim.run().status, sim.run().status_reason) == ("interrupted", "stop please")


def test_interrupting_a_starting_run_ends_it_at_once() -> None:
    """A run with no provider turn yet is interrupted immediately and its start effect is called off."""
    sim = Sim()
    sim.create()
    decision = sim.interrupt()
    run = sim.run()
    assert run.status == "interrupted"
    assert run.status_reason == "Interrupted before the provider started."
    assert "provider-turn.start" in decision.cancel_effect_types
    assert decision.effects == ()


def test_interrupting_a_terminal_run_changes_nothing() -> None:
    """InterruptRun on an ended run writes no events and reports the terminal status."""
    sim = running_sim()
    sim.fail()
    decision = sim.interrupt()
    assert decision.events == () and decision.effects == ()
    assert decision.result["status"] == "failed"


def test_interrupting_a_queued_run_is_rejected() -> None:
    """A queued run has no turn to interrupt: thread_not_interruptible."""
    sim = running_sim()
    sim.send("later")
    with pytest.raises(o.CommandRejected) as info:
        sim.interrupt(2)
    assert info.value.code == "thread_not_interruptible"


def test_interrupting_during_a_steering_restart_still_stops_the_old_turn() -> None:
    """Interrupting a run mid-restart leaves no provider turn running without a way to stop it."""
    sim = running_sim()
    old_attempt = sim.get("run-attempt", sim.run().active_attempt_id)
    sim.send("change course", mode="steer_active", target=sim.run().id)
    decision = sim.interrupt()
    assert sim.get("provider-turn", old_attempt.provider_turn_id).status == "running"
    assert "provider-turn.interrupt" in effect_types(decision) \
        or "provider-turn.restart" not in decision.cancel_effect_types


# =============================================================================================
# Runtime requests


def test_a_runtime_request_opens_a_pending_request_node_and_item() -> None:
    """RuntimeRequestOpened: a pending live request, a waiting approval node and a waiting item."""
    sim = running_sim()
    sim.ingest(PERMISSION)
    request = sim.get("runtime-request", REQUEST_ID)
    assert (request.status, request.kind_, request.native_request_ref) == \
        ("pending", "permission", "perm-1")
    assert request.response_capability == {"type": "live", "providerSessionId": SESSION}
    node = sim.get("node", request.node_id)
    assert (node.kind_, node.status, node.parent_node_id) == \
        ("approval_request", "waiting", sim.run().root_node_id)
    item = sim.state.items()[-1]
    assert (item.type, item.status, item.data["requestId"]) == \
        ("approval_request", "waiting", REQUEST_ID)
    assert sim.state.pending_requests() == [request]


def test_responding_resolves_the_request_once() -> None:
    """RespondRuntimeRequest resolves it with a respond effect; a second answer is rejected."""
    sim = running_sim()
    sim.ingest(PERMISSION)
    decision = sim.respond(REQUEST_ID, "accept")
    request = sim.get("runtime-request", REQUEST_ID)
    assert (request.status, request.decision, request.resolved_at) == ("resolved", "accept", NOW)
    assert sim.get("node", request.node_id).status == "completed"
    assert effect_types(decision) == ["runtime-request.respond"]
    assert decision.effects[0].payload["providerSessionId"] == SESSION
    assert decision.effects[0].payload["nativeRequestRef"] == "perm-1"
    with pytest.raises(o.CommandRejected):
        sim.respond(REQUEST_ID, "accept")


def test_declining_cancels_the_request_node() -> None:
    """A decline resolves the request and marks its node and item cancelled."""
    sim = running_sim()
    sim.ingest(PERMISSION)
    sim.respond(REQUEST_ID, "decline")
    request = sim.get("runtime-request", REQUEST_ID)
    assert (request.status, request.decision) == ("resolved", "decline")
    assert sim.get("node", request.node_id).status == "cancelled"
    assert sim.state.items()[-1].status == "cancelled"


def test_a_pending_request_is_cancelled_when_the_run_ends() -> None:
    """Ending the run (interrupted) cancels its pending request and node; answering is then refused."""
    sim = running_sim()
    sim.ingest(PERMISSION)
    sim.ingest(o.TurnEnded("interrupted"))
    request = sim.get("runtime-request", REQUEST_ID)
    assert request.status == "cancelled" and request.status_reason
    assert sim.get("node", request.node_id).status == "cancelled"
    assert sim.state.pending_requests() == []
    with pytest.raises(o.CommandRejected):
        sim.respond(REQUEST_ID)


def test_a_pending_request_does_not_outlive_a_completed_run() -> None:
    """After TurnEnded(completed) and CompleteRun no request of the run is still pending."""
    sim = running_sim()
    sim.ingest(PERMISSION)
    sim.ingest(o.TurnEnded("completed"))
    sim.complete()
    assert sim.run().status == "completed"
    assert sim.get("runtime-request", REQUEST_ID).status != "pending"


def test_no_message_stays_streaming_after_a_restarted_run_completes() -> None:
    """A message streaming when its attempt was superseded is closed by the time the run completes."""
    sim = running_sim()
    sim.ingest(o.TextDelta("half a thought"))
    sim.send("change course", mode="steer_active", target=sim.run().id)
    sim.mark_started()
    sim.ingest(o.TextDelta("new answer"), o.TurnEnded("completed"))
    sim.complete()
    assert sim.run().status == "completed"
    assert [m.text for m in sim.state.entities["message"].values() if m.streaming] == []
    assert [i.type for i in sim.state.items() if i.status == "running"] == []


# =============================================================================================
# Cancelling queued runs


def test_cancel_queued_run_cancels_only_queued_runs() -> None:
    """CancelQueuedRun cancels a queued run with its attempt and root; a non-queued run is rejected."""
    sim = running_sim()
    sim.send("later")
    queued = sim.run(2)
    sim.do(o.CancelQueuedRun(command_id=sim.cid("cancel"), thread_id=THREAD, run_id=queued.id))
    run = sim.run(2)
    assert (run.status, run.queue_position) == ("cancelled", None)
    assert sim.get("run-attempt", run.active_attempt_id).status == "cancelled"
    assert sim.get("node", run.root_node_id).status == "cancelled"
    with pytest.raises(o.CommandRejected):
        sim.do(o.CancelQueuedRun(command_id=sim.cid("cancel"), thread_id=THREAD,
                                 run_id=sim.run(1).id))
    # nothing left to promote when the running run ends
    decision = sim.fail()
    assert decision.effects == () and sim.run(2).status == "cancelled"


# =============================================================================================
# Recovery after a restart


def test_recover_interrupts_live_runs_expires_requests_and_promotes() -> None:
    """RecoverThread: a running run ends interrupted, sessions stop, requests expire, the queue moves."""
    sim = running_sim()
    sim.ingest(o.TextDelta("partial"), PERMISSION)
    sim.send("later")
    decision = sim.recover("The server restarted.")
    run = sim.run()
    assert (run.status, run.status_reason) == ("interrupted", "The server restarted.")
    assert sim.get("provider-session", SESSION).status == "stopped"
    assert sim.get("provider-thread", run.provider_thread_id).status == "idle"
    request = sim.get("runtime-request", REQUEST_ID)
    assert request.status == "expired"
    assert request.response_capability == {"type": "not_resumable",
                                           "reason": "The server restarted."}
    assert not any(m.streaming for m in sim.state.entities["message"].values())
    assert decision.result["interruptedRunIds"] == [run.id]
    assert_promoted(decision, sim)


def test_recover_interrupts_a_starting_run() -> None:
    """A starting run that is not resumable is interrupted with the reason, never left starting."""
    sim = Sim()
    sim.create()
    sim.recover("gone")
    assert (sim.run().status, sim.run().status_reason) == ("interrupted", "gone")


def test_recover_leaves_a_resumable_starting_run_alone() -> None:
    """A starting run named in resumable_run_ids keeps its status and still blocks the queue."""
    sim = Sim()
    sim.create()
    sim.send("later")
    decision = sim.recover("gone", resumable=frozenset({sim.run().id}))
    assert changed(decision, "run") == [] and decision.effects == ()
    assert (sim.run().status, sim.run(2).status) == ("starting", "queued")
    assert decision.result["interruptedRunIds"] == []


def test_delete_ends_everything_the_thread_has_going_in_its_own_decision() -> None:
    """thread.delete of a thread with a running run holding an approval, a queued run, an
    open delegated task and a live session: all end in the deleting decision, the agent's stop
    is an effect, starts are called off; the deleted child reports its task to the parent;
    recovery of the deleted thread is accepted, anything else is thread_not_found."""
    sim = running_sim()
    sim.ingest(PERMISSION)
    sim.send("later", mode="queue_after_active")
    world = World(sim)
    world.delegate()
    deleted = sim.do(o.ChangeThreadLifecycle("cmd-delete", THREAD, "thread.delete"))
    assert [r.status for r in sim.state.runs] == ["cancelled", "cancelled"]
    assert sim.run().status_reason == "The thread was deleted."
    assert sim.get("runtime-request", REQUEST_ID).status == "cancelled"
    assert sim.get("provider-session", SESSION).status == "stopped"
    assert sim.get("subagent", TASK_ID).status == "cancelled"
    assert [e.effect_type for e in deleted.effects] == ["provider-session.stop",
                                                        "checkpoint.forget"]
    assert "provider-turn.start" in deleted.cancel_effect_types
    child = world.child()
    gone = world.do(o.ChangeThreadLifecycle("cmd-delete-child", child.thread.id,
                                            "thread.delete"))
    assert [(e.effect_type, e.thread_id, e.payload["publish"]) for e in gone.effects
            if e.effect_type == "subagent.finalize"] == [("subagent.finalize", THREAD, True)]
    assert sim.recover().events == ()
    with pytest.raises(o.CommandRejected) as refused:
        sim.send("again")
    assert refused.value.code == "thread_not_found"


# =============================================================================================
# Workspace preparation (a launch into a new worktree)


def test_a_worktree_launch_prepares_before_its_turn_starts_then_is_released_or_failed() -> None:
    """The first run is preparing with a "Preparing workspace" item and a workspace.prepare
    effect (no provider turn yet); phases update the item; ready releases the run to its
    provider turn; failed ends it with the reason; a run not preparing refuses both."""
    for phase, status, effects in (("ready", "starting", ["provider-turn.start"]),
                                   ("failed", "failed", [])):
        sim = Sim()
        preparation = {"repo": "/r", "baseRef": "main", "fromOrigin": False, "setup": ["x"]}
        created = sim.do(dataclasses.replace(create_command(sim.cid("create")),
                                             preparation=preparation, worktree_path="/wt/a",
                                             branch="t3/a", workspace="/wt/a"))
        run = sim.run()
        assert run.status == "preparing" and effect_types(created) == ["workspace.prepare"]
        assert created.effects[0].payload == {"runId": run.id, **preparation}
        item_id = workspace._preparation_item_id(run.id)
        assert (sim.get("turn-item", item_id).status, sim.get("turn-item", item_id).data) == (
            "running", {"phase": "worktree"})
        sim.do(workspace.AdvancePreparation(command_id=sim.cid("setup"), thread_id=THREAD,
                                            run_id=run.id, phase="setup", output="$ x\n"))
        assert sim.get("turn-item", item_id).text == "$ x\n"
        ended = sim.do(workspace.AdvancePreparation(
            command_id=sim.cid(phase), thread_id=THREAD, run_id=run.id, phase=phase,
            output="$ x\nboom", reason="setup failed"))
        assert (sim.run().status, effect_types(ended)) == (status, effects)
        assert sim.get("turn-item", item_id).status == ("completed" if phase == "ready"
                                                        else "failed")
        if phase == "failed":
            assert sim.run().status_reason == "setup failed"
        with pytest.raises(o.CommandRejected):
            sim.decide(workspace.AdvancePreparation(command_id=sim.cid("late"),
                                                    thread_id=THREAD, run_id=run.id,
                                                    phase="ready"))


# =============================================================================================
# Fingerprints, rejections, entity JSON


def test_fingerprint_ignores_the_command_id_but_not_the_payload() -> None:
    """Equal payloads under different ids fingerprint equal; changing any payload field changes it."""
    dispatch = o.DispatchMessage(command_id="a", thread_id=THREAD, message_id="m", text="hi",
                                 created_by="user", creation_source="web",
                                 mode="start_immediately")
    create = create_command("a")
    recover = o.RecoverThread(command_id="a", thread_id=THREAD, reason="r",
                              resumable_run_ids=frozenset({"x", "y"}))
    variants = {"thread_id": "other", "message_id": "m2", "text": "hi!", "created_by": "agent",
                "creation_source": "mcp", "mode": "queue_after_active", "target_run_id": "run-x",
                "project_id": "p2", "title": "t2", "provider_instance_id": "codex",
                "model": "m2", "runtime_mode": "auto", "interaction_mode": "plan",
                "workspace": "/elsewhere", "branch": "main", "worktree_path": "/wt",
                "preparation": {"repo": "/r", "baseRef": "main", "setup": []},
                "lineage": {"parentThreadId": "t0", "relationshipToParent": "fork"},
                "forked_from": {"type": "run", "threadId": "t0", "runId": "r1"},
                "initial_message": o.InitialMessage(message_id="msg-1", text="bye"),
                "reason": "r2", "resumable_run_ids": frozenset({"x"})}
    for command in (dispatch, create, recover):
        base = o.fingerprint_of(command)
        assert o.fingerprint_of(dataclasses.replace(command, command_id="b")) == base
        counted = getattr(command, "fingerprint_fields", None)
        for f in dataclasses.fields(command):
            if f.name == "command_id":
                continue
            other = o.fingerprint_of(dataclasses.replace(command, **{f.name: variants[f.name]}))
            assert (other != base) == (counted is None or f.name in counted), f.name
    assert o.fingerprint_of(dataclasses.replace(recover, resumable_run_ids=frozenset({"y", "x"}))) \
        == o.fingerprint_of(recover)
    # A dispatch's mode and target follow the thread's state when it arrived: a retry matches.
    steer = dataclasses.replace(dispatch, mode="steer_active", target_run_id="run-x")
    assert o.fingerprint_of(steer) == o.fingerprint_of(dispatch)


@pytest.mark.parametrize("command", [
    o.DispatchMessage(command_id="c", thread_id=THREAD, message_id="m", text="x",
                      created_by="user", creation_source="web", mode="start_immediately"),
    o.InterruptRun(command_id="c", thread_id=THREAD, run_id="r"),
    o.CancelQueuedRun(command_id="c", thread_id=THREAD, run_id="r"),
    o.RespondRuntimeRequest(command_id="c", thread_id=THREAD, request_id="q", decision="accept"),
    o.RecoverThread(command_id="c", thread_id=THREAD, reason="r"),
], ids=lambda c: type(c).__name__)
def test_commands_for_an_unknown_thread_are_rejected(command: Any) -> None:
    """Any command but CreateThread on a thread that does not exist: thread_not_found."""
    with pytest.raises(o.CommandRejected) as info:
        o.decide(o.ThreadState(), command, now=NOW, new_id=CountingIds(), providers=providers())
    assert info.value.code == "thread_not_found"


def test_creating_an_existing_thread_is_rejected() -> None:
    """CreateThread for an id that already exists is refused."""
    sim = Sim()
    sim.create()
    with pytest.raises(o.CommandRejected):
        sim.create()


def sample_entities() -> dict[str, list[Any]]:
    """One of every entity kind, as a realistic run produces them."""
    sim = running_sim()
    sim.ingest(o.TextDelta("hi"), o.ToolUpdate("t1", "completed", title="ls", input={"a": [1]},
                                               output="ok"), PERMISSION)
    world = World(sim)
    world.delegate()
    entities = {kind: list(by_id.values()) for kind, by_id in sim.state.entities.items()}
    entities["thread"] = [sim.state.thread]
    task = Sim()
    task.do(upsert_task("task-1", {"type": "interval", "everyMs": 60_000}))
    task.do(schedules.FireScheduledTask(command_id="fire-1", thread_id="task-1", trigger="manual"))
    entities["scheduled-task"] = list(task.state.entities["scheduled-task"].values())
    entities["webhook-delivery"] = [schedules.WebhookDelivery(
        id="d1", task_id="task-1", received_at=NOW, outcome="skipped", method="POST",
        headers={"x-github-event": "push"}, body_excerpt="{}", body_truncated=False,
        query={"a": ["1"]}, delivery_key="abc")]
    entities["context-handoff"] = list(handoff_sim().state.entities["context-handoff"].values())
    entities["checkpoint"] = [history.Checkpoint(
        id=history.checkpoint_id(THREAD, 1), thread_id=THREAD, scope_id=history.checkpoint_scope_id(THREAD),
        run_id="run-1", ordinal=1, status="ready", captured_at=NOW, ref="refs/t3/x/1",
        commit="c0ffee", files=[{"path": "a.txt", "kind": "modified", "additions": 1,
                                 "deletions": 2}], parent_checkpoint_id=history.checkpoint_id(THREAD, 0))]
    return entities


def handoff_sim() -> Sim:
    """Run 1 answered and completed; run 2 started on a session that could not resume run 1's."""
    sim = running_sim()
    sim.ingest(o.TextDelta("the answer"), o.TurnEnded("completed"))
    sim.complete()
    sim.send("and then?")
    sim.mark_started(2, resume_failed=True)
    return sim


def upsert_task(task_id: str, schedule: dict[str, Any], **fields: Any) -> schedules.UpsertScheduledTask:
    return schedules.UpsertScheduledTask(
        command_id=f"upsert-{task_id}-{len(fields)}", thread_id=task_id, title="Nightly",
        schedule=schedules.validate_schedule(schedule), project_id="default",
        workspace="/work/ws", model_selection={"instanceId": "scripted", "model": "m1"},
        runtime_mode="auto", interaction_mode="default", **{"prompt": "run the tests", **fields})


# ---------------------------------------------------------------------------------------------
# Delegation: commands that touch a parent and a child thread


class World:
    """Several threads; each decision's events are applied to the thread they belong to."""

    def __init__(self, parent: Sim) -> None:
        self.parent = parent
        self.states = {THREAD: parent.state}
        self.count = 0

    def do(self, command: Any) -> o.Decision:
        state = self.states.setdefault(command.thread_id, o.ThreadState())
        decision = o.decide(state, command, now=NOW, new_id=CountingIds(),
                            providers=self.parent.providers)
        for event in decision.events:
            self.states.setdefault(event.thread_id, o.ThreadState()).apply(event.type,
                                                                            event.payload)
        return decision

    def delegate(self, task: str = "child work", *, wake: str = "always",
                 command_id: str = "cmd-delegate") -> o.Decision:
        return self.do(o.DelegateTask(
            command_id=command_id, thread_id=THREAD, parent_run_id=self.parent.run().id,
            task=task, title="Child", provider_instance_id="scripted", model="m1",
            runtime_mode="full-access", interaction_mode="default", completion_wake=wake,
            created_by="agent", creation_source="mcp"))

    def child(self, command_id: str = "cmd-delegate") -> o.ThreadState:
        return self.states[f"thread:delegated-task:{command_id}"]

    def end_child(self, status: str = "interrupted") -> o.Decision:
        child = self.child()
        run = child.runs[0]
        self.do(o.MarkRunStarted(
            command_id="cmd-child-start", thread_id=run.thread_id, run_id=run.id,
            attempt_id=run.active_attempt_id, provider_session_id="s2", session_created=True,
            pid=1, native_thread_ref="n2", cwd="/w"))
        return self.do(o.IngestProviderEvents(
            command_id="cmd-child-end", thread_id=run.thread_id, run_id=run.id,
            attempt_id=run.active_attempt_id, provider_session_id="s2",
            events=(o.TextDelta("child answer"), o.TurnEnded(status))))

    def finalize(self, status: str = "completed", result: str = "child answer") -> o.Decision:
        self.count += 1
        return self.do(o.FinalizeSubagent(
            command_id=f"cmd-finalize-{self.count}", thread_id=THREAD,
            task_id="node:delegated-task:cmd-delegate", status=status, result=result))


TASK_ID = "node:delegated-task:cmd-delegate"


def test_delegation_creates_child_with_only_the_task_prompt() -> None:
    """delegated_task.request: child thread (lineage subagent), its run with only the task text,
    the parent's subagent node, row and item, and a consumed spawn transfer, in one decision."""
    world = World(running_sim())
    decision = world.delegate("do exactly this")
    child = world.child()
    assert child.thread.lineage == {"parentThreadId": THREAD, "relationshipToParent": "subagent",
                                    "rootThreadId": THREAD}
    assert child.thread.forked_from == {"type": "node", "nodeId": TASK_ID}
    [run] = child.runs
    assert run.status == "starting"
    assert [m.text for m in child.entities["message"].values()] == ["do exactly this"]
    start = [e for e in decision.effects if e.effect_type == "provider-turn.start"]
    assert [e.thread_id for e in start] == [child.thread.id]
    parent = world.states[THREAD]
    task = parent.entities["subagent"][TASK_ID]
    assert (task.status, task.child_thread_id, task.child_run_id) == \
        ("running", child.thread.id, run.id)
    assert parent.entities["node"][TASK_ID].kind_ == "subagent"
    [spawn] = parent.entities["context-transfer"].values()
    assert (spawn.type, spawn.status, spawn.target_run_id) == ("subagent_spawn", "consumed",
                                                              run.id)


def test_delegation_needs_an_active_parent_run() -> None:
    """A parent whose run ended cannot delegate: parent_not_active."""
    sim = running_sim()
    sim.interrupt()
    sim.ingest(o.TurnEnded("interrupted"))
    with pytest.raises(o.CommandRejected) as info:
        World(sim).delegate()
    assert info.value.code == "parent_not_active"


def test_child_terminal_asks_the_parent_to_finalize_through_the_outbox() -> None:
    """The child's original run ending emits a replay-safe subagent.finalize for the parent."""
    world = World(running_sim())
    world.delegate()
    decision = world.end_child("interrupted")
    [finalize] = [e for e in decision.effects if e.effect_type == "subagent.finalize"]
    assert finalize.thread_id == THREAD and finalize.replay_safe
    assert finalize.payload["taskId"] == TASK_ID


def test_finalize_publishes_the_result_and_wakes_an_async_parent_once() -> None:
    """An async task's result is published with a result transfer and wakes the parent exactly
    once (queued behind its running turn); a second finalize changes nothing."""
    world = World(running_sim())
    world.delegate(wake="always")
    decision = world.finalize()
    parent = world.states[THREAD]
    task = parent.entities["subagent"][TASK_ID]
    assert (task.status, task.result) == ("completed", "child answer")
    assert parent.entities["node"][TASK_ID].status == "completed"
    transfer = parent.entities["context-transfer"][f"context-transfer:subagent_result:{TASK_ID}"]
    assert transfer.status == "consumed" and transfer.summary == "child answer"
    wake = parent.runs[-1]
    assert wake.status == "queued" and wake.ordinal == 2
    assert TASK_ID in parent.entities["message"][wake.user_message_id].text
    assert world.finalize().events == ()
    assert len(parent.runs) == 2 and decision.effects == ()


def test_wait_mode_task_does_not_wake_a_live_parent() -> None:
    """A settled_only task finishing while its parent runs (the parent is waiting on it) does
    not queue a wake; finishing after the parent went idle does."""
    world = World(running_sim())
    world.delegate(wake="settled_only")
    world.finalize()
    assert len(world.states[THREAD].runs) == 1
    idle = World(running_sim())
    idle.delegate(wake="settled_only")
    idle.parent.ingest(o.TurnEnded("interrupted"))
    decision = idle.finalize()
    assert idle.states[THREAD].runs[-1].status == "starting"
    assert "provider-turn.start" in effect_types(decision)


def test_no_wait_outlives_a_restart_so_a_wait_mode_task_wakes_its_parent() -> None:
    """After a restart no wait delivers a wait-mode task's result: recovery makes it wake the
    parent, also when the parent runs again by the time the task finishes."""
    world = World(running_sim())
    world.delegate(wake="settled_only")
    world.parent.recover()
    world.parent.send("a new turn")
    assert world.parent.run(2).status == "starting"
    world.finalize()
    wake = world.states[THREAD].runs[-1]
    assert (wake.ordinal, wake.status) == (3, "queued")
    assert TASK_ID in world.states[THREAD].entities["message"][wake.user_message_id].text


def test_cancelled_task_settles_interrupted_without_a_wake() -> None:
    """After task_cancel, a late success counts as interrupted and no wake is delivered."""
    world = World(running_sim())
    world.delegate(wake="always")
    world.do(o.RequestTaskCancel(command_id="cmd-cancel", thread_id=THREAD, task_id=TASK_ID))
    world.finalize("completed")
    parent = world.states[THREAD]
    assert parent.entities["subagent"][TASK_ID].status == "interrupted"
    assert len(parent.runs) == 1


def test_delegation_fingerprint_ignores_the_parent_run_and_mode() -> None:
    """A retried delegate_task from a later turn (or another mode) is the same request."""
    base = o.DelegateTask(command_id="c", thread_id=THREAD, parent_run_id="r1", task="t",
                          title="T", provider_instance_id="scripted", model=None,
                          runtime_mode="full-access", interaction_mode="default",
                          completion_wake="always", created_by="agent", creation_source="mcp")
    assert o.fingerprint_of(dataclasses.replace(base, parent_run_id="r2",
                                                completion_wake="settled_only")) == \
        o.fingerprint_of(base)
    assert o.fingerprint_of(dataclasses.replace(base, task="other")) != o.fingerprint_of(base)


@pytest.mark.parametrize("kind", sorted(o._ENTITY_TYPES))
def test_entity_json_round_trips(kind: str) -> None:
    """from_json(to_json(x)) == x for every entity kind."""
    samples = sample_entities()[kind]
    assert samples
    for entity in samples:
        assert type(entity).from_json(entity.to_json()) == entity


@pytest.mark.parametrize("kind", [
    "run", "run-attempt", "node", "provider-session", "provider-thread", "runtime-request",
    "provider-turn", "turn-item"])
def test_entity_from_json_rejects_an_unknown_status(kind: str) -> None:
    """from_json refuses a status outside the entity's vocabulary."""
    entity = sample_entities()[kind][0]
    with pytest.raises(ValueError):
        type(entity).from_json({**entity.to_json(), "status": "bogus"})


QUESTION = o.RuntimeRequestOpened(native_ref="q1", request_kind="user_input",
                                  title="Which branch?", detail={"questions": []})


def child_running(world: World) -> o.Run:
    run = world.child().runs[0]
    world.do(o.MarkRunStarted(
        command_id="cmd-child-start", thread_id=run.thread_id, run_id=run.id,
        attempt_id=run.active_attempt_id, provider_session_id="s2", session_created=True, pid=1,
        native_thread_ref="n2", cwd="/w"))
    return run


def test_child_question_is_routed_to_the_parent_and_withdrawn_when_answered() -> None:
    """A child's question emits a notice for the parent (queued behind its turn); answering it
    emits the withdrawal; a parent waiting on the task is not notified (its wait reports it):
    the question is held for a catch-up."""
    world = World(running_sim())
    world.delegate(wake="always")
    run = child_running(world)
    asked = world.do(o.IngestProviderEvents(
        command_id="cmd-q", thread_id=run.thread_id, run_id=run.id,
        attempt_id=run.active_attempt_id, provider_session_id="s2", events=(QUESTION,)))
    [route] = [e for e in asked.effects if e.effect_type == "subagent.question"]
    assert route.thread_id == THREAD and route.replay_safe
    notice = world.do(o.NotifyTaskQuestion(
        command_id="cmd-notice", thread_id=THREAD, task_id=TASK_ID,
        request_id=route.payload["requestId"], child_thread_id=run.thread_id,
        question="Which branch?"))
    queued = world.states[THREAD].runs[-1]
    assert queued.status == "queued" and notice.result["notified"] is True
    assert "Which branch?" in world.states[THREAD].entities["message"][queued.user_message_id].text
    answered = world.do(o.RespondRuntimeRequest(
        command_id="cmd-answer", thread_id=run.thread_id,
        request_id=route.payload["requestId"], answers={"q": "main"}))
    assert "subagent.question-settled" in effect_types(answered)
    waiting = World(running_sim())
    waiting.delegate(wake="settled_only")
    quiet = waiting.do(o.NotifyTaskQuestion(
        command_id="cmd-notice", thread_id=THREAD, task_id=TASK_ID, request_id="r",
        child_thread_id="c", question="?"))
    assert quiet.result["notified"] is False and len(waiting.states[THREAD].runs) == 1
    assert waiting.states[THREAD].entities["subagent"][TASK_ID].questions["r"]["state"] == "held"


def child_turn(world: World, run: o.Run, *events: Any, end: str | None = "completed",
               started: bool = False) -> list[o.Decision]:
    """Start one of the child's runs (unless ``started``) and end its turn (``end``),
    finalizing a completed one."""
    decisions = [] if started else [world.do(o.MarkRunStarted(
        command_id=f"cmd-start-{run.id}", thread_id=run.thread_id, run_id=run.id,
        attempt_id=run.active_attempt_id, provider_session_id="s2", session_created=True, pid=1,
        native_thread_ref="n2", cwd="/w"))]
    if end is not None:
        decisions.append(world.do(o.IngestProviderEvents(
            command_id=f"cmd-end-{run.id}", thread_id=run.thread_id, run_id=run.id,
            attempt_id=run.active_attempt_id, provider_session_id="s2",
            events=(*events, o.TurnEnded(end)))))
    if end == "completed":
        decisions.append(world.do(o.CompleteRun(command_id=f"cmd-complete-{run.id}",
                                                thread_id=run.thread_id, run_id=run.id)))
    return decisions


def finalize_effects(decisions: list[o.Decision]) -> list[o.EffectRequest]:
    return [e for d in decisions for e in d.effects if e.effect_type == "subagent.finalize"]


def test_task_result_waits_for_the_completion_follow_up() -> None:
    """A child whose own task ends after its first turn publishes nothing until the follow-up
    that wake started has run: the published run is that final work turn."""
    world = World(running_sim())
    world.delegate()
    child_id = world.child().thread.id
    first = world.child().runs[0]
    child_turn(world, first, end=None)
    world.do(o.DelegateTask(
        command_id="cmd-grand", thread_id=child_id, parent_run_id=first.id, task="grand",
        title="Grandchild", provider_instance_id="scripted", model="m1",
        runtime_mode="full-access", interaction_mode="default", completion_wake="always",
        created_by="agent", creation_source="mcp"))
    ended = child_turn(world, world.child().runs[0], o.TextDelta("first turn"), started=True)
    assert finalize_effects(ended) == []  # its own task is still open
    grand_task = "node:delegated-task:cmd-grand"
    woke = world.do(o.FinalizeSubagent(command_id="cmd-grand-done", thread_id=child_id,
                                       task_id=grand_task, status="completed", result="g"))
    assert finalize_effects([woke]) == []  # the wake is the task's known work
    follow_up = world.child().runs[-1]
    assert follow_up.user_message_id.startswith("message:task-wake:")
    assert o.task_final_run(world.child().runs) is None
    [publish] = finalize_effects(child_turn(world, follow_up, o.TextDelta("final")))
    assert publish.payload["runId"] == follow_up.id and publish.payload["publish"] is True
    assert o.task_result(world.child(), world.child().run(follow_up.id)) == "final"


def test_later_work_is_recorded_beside_the_published_result() -> None:
    """After publication, a later run's result (or a re-settled work run's) gets its own result
    transfer; the task's status, summary and result transfer stay as published."""
    world = World(running_sim())
    world.delegate()
    run_id = world.child().runs[0].id
    world.do(o.FinalizeSubagent(command_id="f1", thread_id=THREAD, task_id=TASK_ID,
                                status="completed", result="first", run_id=run_id))
    for command_id, later, publish in (("f2", "r2", False), ("f3", "r3", True)):
        world.do(o.FinalizeSubagent(command_id=command_id, thread_id=THREAD, task_id=TASK_ID,
                                    status="failed", result=f"later {later}", run_id=later,
                                    publish=publish))
        transfer = world.states[THREAD].entities["context-transfer"][
            o.later_transfer_id(TASK_ID, later)]
        assert transfer.summary == f"later {later}" and transfer.type == "subagent_result"
    task = world.states[THREAD].entities["subagent"][TASK_ID]
    assert (task.status, task.result, task.result_run_id) == ("completed", "first", run_id)
    assert world.states[THREAD].entities["context-transfer"][
        o.result_transfer_id(TASK_ID)].summary == "first"


def notice(world: World, *, blocking: bool = True, request_id: str = "q-1") -> o.Decision:
    return world.do(o.NotifyTaskQuestion(
        command_id=f"cmd-notice-{request_id}", thread_id=THREAD, task_id=TASK_ID,
        request_id=request_id, child_thread_id=world.child().thread.id, question="Which branch?",
        blocking=blocking))


def test_async_question_notice_says_still_working_even_to_a_waiting_parent() -> None:
    """An async question does not end the parent's wait, so its notice is delivered at once,
    saying the child is still working; a blocking one says it is blocked."""
    world = World(running_sim())
    world.delegate(wake="settled_only")
    assert notice(world, blocking=False).result["notified"] is True
    text = world.states[THREAD].entities["message"][world.states[THREAD].runs[-1].user_message_id]
    assert "is still working: Which branch?" in text.text and "blocked" not in text.text
    idle = World(running_sim())
    idle.delegate(wake="always")
    notice(idle)
    last = idle.states[THREAD].runs[-1]
    assert "is blocked on a question" in idle.states[THREAD].entities["message"][
        last.user_message_id].text


@pytest.mark.parametrize("end, delivered, woken", [
    ("completed", False, True), ("failed", False, True), ("interrupted", False, False),
    ("completed", True, False)])
def test_question_held_for_a_cut_short_wait_catches_up(end: str, delivered: bool,
                                                       woken: bool) -> None:
    """A blocking question arriving while the parent waits on the task is held for the wait; if
    the wait never delivered it, the launching run's completion or failure wakes the parent with
    it; an interrupted run (or a delivered question) gets no catch-up."""
    world = World(running_sim())
    world.delegate(wake="settled_only")
    assert notice(world).result["notified"] is False and len(world.states[THREAD].runs) == 1
    if delivered:
        world.do(o.SettleTaskQuestion(command_id="cmd-delivered", thread_id=THREAD,
                                      task_id=TASK_ID, request_id="q-1"))
    world.parent.ingest(o.TurnEnded(end, failure="boom" if end == "failed" else None))
    parent = world.states[THREAD]
    woke = [r for r in parent.runs if r.user_message_id == "message:task-question:q-1"]
    assert bool(woke) is woken
    if woken:
        assert "is blocked on a question: Which branch?" in parent.entities["message"][
            woke[0].user_message_id].text
    assert parent.entities["subagent"][TASK_ID].questions["q-1"] == {"state": "settled"}
    assert notice(world).result["notified"] is False  # a replayed notice stays settled


def test_expired_or_dismissed_child_question_withdraws_the_notice() -> None:
    """A child's question that expires (its session ends) or is dismissed (its run ends) asks
    the parent to withdraw the notice; settling cancels the notice still queued there."""
    for end in ("session", "run"):
        world = World(running_sim())
        world.delegate(wake="always")
        run = child_running(world)
        world.do(o.IngestProviderEvents(
            command_id="cmd-q", thread_id=run.thread_id, run_id=run.id,
            attempt_id=run.active_attempt_id, provider_session_id="s2", events=(QUESTION,)))
        closed = world.do(o.EndProviderSession(
            command_id="cmd-end", thread_id=run.thread_id, provider_session_id="s2",
            status="error", reason="gone") if end == "session" else o.InterruptRun(
            command_id="cmd-int", thread_id=run.thread_id, run_id=run.id) and o.FailRun(
            command_id="cmd-fail", thread_id=run.thread_id, run_id=run.id, attempt_id=None,
            status="interrupted", reason="stopped"))
        [settled] = [e for e in closed.effects if e.effect_type == "subagent.question-settled"]
        notice(world, request_id=settled.payload["requestId"])
        queued = world.states[THREAD].runs[-1]
        assert queued.status == "queued"
        world.do(o.SettleTaskQuestion(command_id="cmd-settle", thread_id=THREAD, task_id=TASK_ID,
                                      request_id=settled.payload["requestId"]))
        assert world.states[THREAD].run(queued.id).status == "cancelled"


def test_wait_attention_is_blocking_questions_and_the_tasks_own_approvals() -> None:
    """task_attention: an async question ends no wait, a blocking one does; an approval counts
    only while it belongs to the task's own work."""
    world = World(running_sim())
    world.delegate()
    run = child_running(world)
    task = world.states[THREAD].entities["subagent"][TASK_ID]
    world.do(o.IngestProviderEvents(
        command_id="cmd-q", thread_id=run.thread_id, run_id=run.id,
        attempt_id=run.active_attempt_id, provider_session_id="s2",
        events=(dataclasses.replace(QUESTION, detail={"isBlocking": False}),)))
    assert o.task_attention(world.child(), task) == (None, None)
    world.do(o.IngestProviderEvents(
        command_id="cmd-p", thread_id=run.thread_id, run_id=run.id,
        attempt_id=run.active_attempt_id, provider_session_id="s2",
        events=(dataclasses.replace(QUESTION, native_ref="q2"), PERMISSION)))
    question, approval = o.task_attention(world.child(), task)
    assert question.detail == QUESTION.detail and approval.kind_ == "permission"
    done = dataclasses.replace(task, status="completed")
    assert o.task_attention(world.child(), done)[1] is None


# =============================================================================================
# Agent process slots (max_live_agent_processes)


def await_slot(sim: Sim, ordinal: int = 1) -> o.Decision:
    run = sim.run(ordinal)
    return sim.do(o.AwaitAgentSlot(command_id=sim.cid("await"), thread_id=THREAD, run_id=run.id,
                                   attempt_id=run.active_attempt_id, reason="no slot"))


def test_a_run_waiting_for_a_slot_holds_its_thread_until_granted() -> None:
    """A starting run with no agent slot waits queued, saying why; a message sent meanwhile
    queues behind it; the grant starts it again and nothing else."""
    sim = Sim()
    sim.create()
    await_slot(sim)
    waiting = sim.run(1)
    assert (waiting.status, waiting.awaiting_agent_slot, waiting.status_reason) == (
        "queued", True, "no slot")
    sent = sim.send("meanwhile")
    assert sim.run(2).status == "queued" and effect_types(sent) == []
    granted = sim.do(o.GrantAgentSlot(command_id=sim.cid("grant"), thread_id=THREAD,
                                      run_id=waiting.id, attempt_id=waiting.active_attempt_id))
    assert sim.run(1).status == "starting" and not sim.run(1).awaiting_agent_slot
    assert sim.run(1).status_reason is None and sim.run(2).status == "queued"
    assert effect_types(granted) == ["provider-turn.start"]
    with pytest.raises(o.CommandRejected):  # granted once only
        sim.decide(o.GrantAgentSlot(command_id="again", thread_id=THREAD, run_id=waiting.id,
                                    attempt_id=waiting.active_attempt_id))


def test_a_run_waiting_for_a_slot_can_be_interrupted_and_is_restarted_after_a_crash() -> None:
    """Interrupting a run that waits for a slot ends it and promotes the next queued run;
    recovery after a restart puts a waiting run back to starting (the line was in memory)."""
    sim = Sim()
    sim.create()
    await_slot(sim)
    sim.send("next")
    decision = sim.interrupt(1)
    assert sim.run(1).status == "interrupted" and not sim.run(1).awaiting_agent_slot
    assert sim.run(2).status == "starting" and "provider-turn.start" in effect_types(decision)
    await_slot(sim, 2)
    decision = sim.recover()
    assert sim.run(2).status == "starting" and effect_types(decision) == ["provider-turn.start"]


# =============================================================================================
# Scheduled tasks


def task_sim(schedule: dict[str, Any]) -> Sim:
    sim = Sim()
    sim.do(upsert_task("task-1", schedule))
    return sim


def the_task(sim: Sim) -> schedules.ScheduledTask:
    return sim.state.entities["scheduled-task"]["task-1"]


def test_a_fire_is_once_and_a_task_never_runs_twice_at_once() -> None:
    """A scheduled fire for the task's due time marks it running, emits one replay-safe run
    effect and aims the next run; a second fire for the same time, or any fire while it runs,
    is refused; settling ends the run."""
    sim = task_sim({"type": "interval", "everyMs": 60_000})
    due = the_task(sim).next_run_at
    assert due == o.iso_time(o.epoch_of(NOW) + 60)
    later = sim.now = o.iso_time(o.epoch_of(NOW) + 61)
    fired = sim.do(schedules.FireScheduledTask(command_id="fire-1", thread_id="task-1",
                                       trigger="scheduled", due_at=due))
    [effect] = fired.effects
    assert effect.effect_type == "scheduled-task.run" and effect.replay_safe
    assert effect.payload["prompt"] == "[Triggered by schedule task: Nightly]\n\nrun the tests"
    task = the_task(sim)
    assert (task.last_run_status, task.run_count, task.next_run_at) == (
        "running", 1, o.iso_time(o.epoch_of(later) + 60))
    for trigger, due_at in (("scheduled", due), ("manual", None)):
        with pytest.raises(o.CommandRejected):
            sim.decide(schedules.FireScheduledTask(command_id="fire-2", thread_id="task-1",
                                           trigger=trigger, due_at=due_at))
    sim.do(schedules.SettleScheduledRun(command_id="s", thread_id="task-1", fire_key="fire-1",
                                status="failed", error="boom"))
    assert (the_task(sim).last_run_status, the_task(sim).last_run_error) == ("failed", "boom")


def test_a_late_fixed_time_fire_is_skipped_and_aimed_again() -> None:
    """A fixed-time fire more than 10 minutes late runs nothing and aims at the next slot."""
    sim = task_sim({"type": "fixed_time", "timeOfDay": "03:30"})
    due = the_task(sim).next_run_at
    late = sim.now = o.iso_time(o.epoch_of(due) + 11 * 60)
    decision = sim.decide(schedules.FireScheduledTask(command_id="f", thread_id="task-1",
                                              trigger="scheduled", due_at=due))
    assert decision.effects == () and decision.result["fired"] is False
    assert o.epoch_of(final(decision, "scheduled-task", "task-1").next_run_at) > o.epoch_of(late)


@pytest.mark.parametrize("schedule", [
    {"type": "interval", "everyMs": 59_999}, {"type": "interval"},
    {"type": "fixed_time", "timeOfDay": "24:00"}, {"type": "fixed_time", "timeOfDay": "9"},
    {"type": "fixed_time", "timeOfDay": "09:00", "weekdays": [7]}, {"type": "cron"}, []])
def test_a_bad_schedule_is_refused(schedule: Any) -> None:
    """Intervals under a minute, malformed times and weekdays, and unknown types are refused."""
    with pytest.raises(o.T3Error) as refused:
        schedules.validate_schedule(schedule)
    assert refused.value.code == "invalid_request"

# ---------------------------------------------------------------------------------------------
# Webhooks: schedules, the delivery's view (templates, filters, age), and the waiting line


def test_webhook_schedules_are_checked_field_by_field() -> None:
    """Every webhook option is checked and a mistake names its field; a valid one comes back
    normalized (an empty prefix dropped)."""
    good = {"type": "webhook", "signature": {"header": "X-Hub-Signature-256", "secret": "s",
                                             "prefix": ""},
            "filters": [{"path": "commits.0.id", "equals": None}], "maxDeliveryAgeMinutes": 5,
            "deliveryIdHeader": "X-Id", "timestampHeader": "X-At"}
    assert schedules.validate_schedule(good) == {**good, "signature": {
        "header": "X-Hub-Signature-256", "secret": "s"}}
    bad = [({"everyMs": 1}, "schedule.everyMs:"),
           ({"signature": "s"}, "schedule.signature:"),
           ({"signature": {"header": "X: y", "secret": "s"}}, "schedule.signature.header:"),
           ({"signature": {"header": "X", "secret": ""}}, "schedule.signature.secret:"),
           ({"signature": {"header": "X", "secret": "s", "algo": "md5"}}, "schedule.signature:"),
           ({"filters": {"path": "a"}}, "schedule.filters:"),
           ({"filters": [{"path": "a"}]}, "schedule.filters[0]:"),
           ({"filters": [{"path": "a..b", "equals": 1}]}, "schedule.filters[0].path:"),
           ({"filters": [{"path": "a", "equals": [1]}]}, "schedule.filters[0].equals:"),
           ({"maxDeliveryAgeMinutes": True}, "schedule.maxDeliveryAgeMinutes:"),
           ({"maxDeliveryAgeMinutes": 0}, "schedule.maxDeliveryAgeMinutes:"),
           ({"timestampHeader": ""}, "schedule.timestampHeader:")]
    for options, field in bad:
        with pytest.raises(o.T3Error) as caught:
            schedules.validate_schedule({"type": "webhook", **options})
        assert caught.value.code == "invalid_request" and str(caught.value).startswith(field)


def request(body: Any, **headers: str) -> schedules.WebhookRequest:
    text = body if isinstance(body, bytes) else o.json.dumps(body).encode()
    return schedules.WebhookRequest(method="POST", headers=tuple((k.lower().replace("_", "-"), v)
                                                         for k, v in headers.items()),
                            query=(("tag", "v1"), ("tag", "v2"), ("api_key", "k")), body=text)


def test_a_template_is_filled_once_from_what_the_log_shows() -> None:
    """Body paths, headers (any case) and query fill in; missing or null is empty, other values
    JSON; a secret-looking header or parameter reads <redacted>; a placeholder inside a
    delivered value stays as sent; {{body}} is the raw text; the result is trimmed."""
    view = schedules._Delivery({"type": "webhook"}, request(
        {"a": {"b": "{{headers.authorization}}"}, "n": [1, 2.5], "z": None},
        X_Event="push", Authorization="Bearer t0ken"))
    filled = view.fill(" {{body.a.b}}|{{ headers.X-EVENT }}|{{headers.authorization}}|"
                       "{{query.tag}}|{{query.api_key}}|{{body.n}}|{{body.n.1}}|{{body.z}}|"
                       "{{body.none}}|{{headers}}|{{other.x}} ")
    assert filled == ("{{headers.authorization}}|push|<redacted>|v1|<redacted>|[1, 2.5]|2.5|||"
                      "{{headers}}|{{other.x}}")
    assert view.fill("{{body}}") == o.json.dumps(view.json)
    assert view.query == {"tag": ["v1", "v2"], "api_key": ["<redacted>"]}


def test_filters_compare_as_json_and_a_secret_is_blanked_wherever_it_appears() -> None:
    """true is not 1, 1 is 1.0, a missing path or a non-JSON body matches nothing; a header
    value holding the signature's secret is blanked, as is the signature header."""
    def skipped(filters: list[dict[str, Any]], body: Any) -> str | None:
        return schedules._Delivery({"type": "webhook", "filters": filters}, request(body)) \
            .unmatched_filter()
    assert skipped([{"path": "a", "equals": True}], {"a": 1}) is not None
    assert skipped([{"path": "a", "equals": 1}], {"a": 1.0}) is None
    assert skipped([{"path": "body.a.0", "equals": "x"}], {"a": ["x"]}) is None
    assert skipped([{"path": "a", "equals": None}], {}) == 'filters[0] (a equals null) did ' \
        'not match'
    assert skipped([{"path": "a", "equals": "x"}], b"a=x") is not None
    schedule = {"type": "webhook", "signature": {"header": "X-Sig", "secret": "hush-hush"}}
    view = schedules._Delivery(schedule, request({}, X_Sig="abc", X_Echo="the hush-hush word"))
    assert view.headers == {"x-sig": "<redacted>", "x-echo": "the <redacted> word"}
    assert schedules.delivery_excerpt(schedule, b'{"note": "hush-hush", "token": "t"}', lambda t: t) \
        == '{"note": "<redacted>", "token": "t"}'
    assert schedules.delivery_excerpt(schedule, b"{}", None) == ""


def receive(sim: Sim, n: int, *, key: str | None = None, **headers: str) -> o.Decision:
    return sim.do(schedules.ReceiveWebhookDelivery(
        command_id=f"webhook:{n}", thread_id="hook", delivery_id=f"d{n}",
        request=request({"n": n}, **headers), body_excerpt="{}", delivery_key=key))


def test_deliveries_fire_one_at_a_time_in_arrival_order() -> None:
    """The first delivery fires in the commit that records it; the next ones queue (the 21st
    waiting or running is queue_full); the end of a run fires the next in that same commit;
    deleting the task fails the queued ones."""
    sim = Sim()
    sim.do(upsert_task("hook", {"type": "webhook"}, prompt="n={{body.n}}"))
    first = receive(sim, 1)
    assert first.result == {"deliveryId": "d1", "receivedAt": NOW, "outcome": "running"}
    fire_key = "scheduled-task:hook:d1:webhook"
    assert [(e.effect_type, e.payload["fireKey"], e.payload["prompt"]) for e in first.effects] \
        == [("scheduled-task.run", fire_key, "[Triggered by schedule task: Nightly]\n\nn=1")]
    assert [d.outcome for d in changed(first, "webhook-delivery")] == ["running"]
    for n in range(2, 21):
        assert receive(sim, n).result["outcome"] == "queued"
    with pytest.raises(o.CommandRejected) as full:
        sim.decide(schedules.ReceiveWebhookDelivery(command_id="w21", thread_id="hook", delivery_id="d21",
                                            request=request({}), body_excerpt=""))
    assert full.value.code == "queue_full"
    sim.do(schedules.SettleScheduledRun(command_id="s1", thread_id="hook", fire_key=fire_key,
                                status="running", run_thread_id="t1", run_id="r1"))
    assert sim.get("webhook-delivery", "d1").run_id == "r1"
    ended = sim.do(schedules.SettleScheduledRun(command_id="s2", thread_id="hook", fire_key=fire_key,
                                        status="failed", error="boom"))
    assert final(ended, "webhook-delivery", "d1").outcome == "failed"
    assert sim.get("webhook-delivery", "d1") is None  # settled: the store keeps the log
    assert sim.get("webhook-delivery", "d2").outcome == "running"
    assert [e.payload["prompt"][-3:] for e in ended.effects] == ["n=2"]
    deleted = sim.do(schedules.DeleteScheduledTask(command_id="del", thread_id="hook"))
    assert {d.outcome for d in changed(deleted, "webhook-delivery")} == {"failed"}
    assert len(changed(deleted, "webhook-delivery")) == 18 and deleted.effects == ()


def test_a_delivery_is_recorded_as_duplicate_expired_skipped_or_failed_without_a_run() -> None:
    """A duplicate, a delivery older than maxDeliveryAgeMinutes (or with an unreadable stamp, or
    none), one a filter skips, one whose prompt is too long: each recorded, none fired; a paused
    task refuses (hook_disabled) and writes nothing."""
    sim = Sim()
    sim.do(upsert_task("hook", {"type": "webhook", "maxDeliveryAgeMinutes": 5,
                                "filters": [{"path": "n", "equals": 1}]}, prompt="{{body}}"))
    now = o.epoch_of(NOW)
    stale = receive(sim, 1, Webhook_Timestamp=f"{now - 301:.3f}")
    assert changed(stale, "webhook-delivery")[0].reason == \
        "sent 301 s ago, more than maxDeliveryAgeMinutes (5)"
    assert receive(sim, 1, Webhook_Timestamp="later").result["outcome"] == "expired"
    assert changed(receive(sim, 1), "webhook-delivery")[0].reason.startswith(
        "it has no timestamp header (webhook-timestamp, x-webhook-timestamp)")
    assert receive(sim, 2, Webhook_Timestamp=str(int(now))).result["outcome"] == "skipped"
    dup = sim.do(schedules.ReceiveWebhookDelivery(command_id="x", thread_id="hook", delivery_id="dx",
                                          request=request({"n": 1}), body_excerpt="",
                                          delivery_key="k", duplicate_of="d0"))
    assert dup.result["outcome"] == "duplicate" and dup.effects == ()
    big = schedules.WebhookRequest(method="POST", headers=(("webhook-timestamp", str(int(now))),), query=(),
                           body=o.json.dumps({"n": 1, "pad": "x" * 120_000}).encode())
    long = sim.do(schedules.ReceiveWebhookDelivery(command_id="y", thread_id="hook", delivery_id="dy",
                                           request=big, body_excerpt=""))
    assert (long.result["outcome"], long.effects) == ("failed", ())
    assert changed(long, "webhook-delivery")[0].error == "The filled-in prompt is too long."
    assert receive(sim, 1, Webhook_Timestamp=str(int(now))).result["outcome"] == "running"
    sim.do(upsert_task("hook", {"type": "webhook"}, enabled=False))
    with pytest.raises(o.CommandRejected) as paused:
        sim.decide(schedules.ReceiveWebhookDelivery(command_id="z", thread_id="hook", delivery_id="dz",
                                            request=request({}), body_excerpt=""))
    assert paused.value.code == "hook_disabled"


# =============================================================================================
# Stop, held queues, Resume; send fallbacks and refusals (issue 13)


def stop(sim: Sim, reason: str | None = None) -> o.Decision:
    return sim.do(o.StopThread(command_id=sim.cid("stop"), thread_id=THREAD, reason=reason))


def resume(sim: Sim) -> o.Decision:
    return sim.do(o.ResumeThread(command_id=sim.cid("resume"), thread_id=THREAD))


def test_stop_interrupts_the_turn_holds_the_queue_and_resume_releases_it_in_order() -> None:
    """thread.stop: the running turn is asked to stop, both queued runs are held, and the turn's
    end promotes nothing (nor does recovery); thread.resume starts them one after the other."""
    sim = running_sim()
    sim.send("second")
    sim.send("third")
    decision = stop(sim, "enough")
    assert effect_types(decision) == ["provider-turn.interrupt"]
    assert decision.result == {"threadId": THREAD, "interruptedRunIds": [sim.run(1).id],
                               "heldRunIds": [sim.run(2).id, sim.run(3).id]}
    assert [sim.run(n).queue_held for n in (2, 3)] == [True, True]
    ended = sim.ingest(o.TurnEnded("interrupted"))
    assert (sim.run(1).status, sim.run(1).status_reason) == ("interrupted", "enough")
    assert ended.effects == () and [sim.run(n).status for n in (2, 3)] == ["queued"] * 2
    assert sim.recover().effects == () and sim.run(2).status == "queued"
    assert stop(sim).events == ()  # stopping a stopped thread changes nothing
    released = resume(sim)
    assert released.result["releasedRunIds"] == [sim.run(2).id, sim.run(3).id]
    assert (sim.run(2).status, sim.run(3).status, sim.run(3).queue_held) == \
        ("starting", "queued", False)
    assert effect_types(released) == ["provider-turn.start"]
    sim.mark_started(2)
    sim.ingest(o.TurnEnded("completed"), ordinal=2)
    sim.complete(2)
    assert sim.run(3).status == "starting"


def test_a_message_to_a_stopped_idle_thread_starts_while_the_queue_stays_held() -> None:
    """Held turns do not keep a new message (or a task notice) from starting on an idle thread."""
    sim = Sim()
    sim.create()
    sim.send("queued")
    stop(sim)  # the starting run ends at once; the queued one is held
    assert (sim.run(1).status, sim.run(2).status) == ("interrupted", "queued")
    decision = sim.send("new")
    assert decision.result["delivery"] == "started" and sim.run(3).status == "starting"
    assert sim.run(2).queue_held


def test_steering_a_turn_a_stop_reached_is_refused() -> None:
    """Once a Stop (or interrupt) reached the turn, steer and restart are thread_not_sendable."""
    for steering in (False, True):
        sim = running_sim(active_steering=steering)
        stop(sim)
        for mode in ("steer_active", "restart_active"):
            with pytest.raises(o.CommandRejected) as info:
                sim.send("more", mode=mode, target=sim.run().id)
            assert info.value.code == "thread_not_sendable" and "Stop" in str(info.value)


def no_restart_sim(**caps: bool) -> Sim:
    sim = running_sim()
    sim.providers = {"scripted": dataclasses.replace(
        sim.providers["scripted"], capabilities=o.Capabilities(
            supports_steering_by_restart=False, **caps))}
    return sim


def test_without_restart_a_steer_stops_the_turn_and_queues_the_message_ahead() -> None:
    """A provider that can stop a turn but not restart it: the turn is interrupted and the
    message is queued first, behind only an unheld delegated-task result notice."""
    sim = no_restart_sim()
    sim.send("older queued")
    sim.do(o.DispatchMessage(command_id=sim.cid("wake"), thread_id=THREAD,
                             message_id="message:task-wake:node:t", text="task done",
                             created_by="agent", creation_source="server",
                             mode="start_immediately"))
    decision = sim.send("urgent", mode="steer_active", target=sim.run(1).id)
    assert decision.result["delivery"] == "queued" and decision.result["runId"] == sim.run(4).id
    assert effect_types(decision) == ["provider-turn.interrupt"]
    assert [sim.run(n).queue_position for n in (3, 4, 2)] == [1, 2, 3]
    sim.ingest(o.TurnEnded("interrupted"))
    assert sim.run(3).status == "starting"  # the task notice first, then "urgent"


@pytest.mark.parametrize("case", ["cannot_stop", "compact_message", "logout_turn"])
def test_steer_fallback_refusals(case: str) -> None:
    """Rejected with thread_not_sendable: a provider that cannot stop a turn, a /compact
    message, a turn that is /logout."""
    if case == "logout_turn":
        sim = Sim()
        sim.do(create_command(sim.cid("create"), text="/logout"))
        sim.mark_started()
    else:
        sim = no_restart_sim(supports_interrupt=case != "cannot_stop")
    text = "/compact now" if case == "compact_message" else "more"
    for mode in ("steer_active", "restart_active"):
        with pytest.raises(o.CommandRejected) as info:
            sim.send(text, mode=mode, target=sim.run().id)
        assert info.value.code == "thread_not_sendable"
    assert sim.run().status == "running"
