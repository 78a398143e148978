"""Every typed denial of the tool surface, in process: the real Toolkit, Orchestrator and Store on
a SQLite file, with callers' scopes as the auth middleware sets them. Each denial writes nothing.
(No effect worker runs here, so provider turns never start; that is what these tests need.)"""

from __future__ import annotations

import asyncio
import time
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orchestrator as o  # noqa: E402
from store import Store  # noqa: E402
from harness import output_problems  # noqa: E402
from orchestrator import T3Error as ToolFailure  # noqa: E402
from schedules import Scheduler  # noqa: E402
from tools import Project, Scope, ServerContext, Toolkit, current_scope  # noqa: E402
from workspace import Workspaces  # noqa: E402

CLIENT = Scope(kind="client", key="client")


def agent(thread_id: str, instance: str = "alpha", **kwargs: Any) -> Scope:
    return Scope(kind="thread", key=f"{thread_id}:{instance}", thread_id=thread_id,
                 provider_instance_id=instance, **kwargs)


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.store = Store(tmp_path / "t3.sqlite", backups_dir=tmp_path / "backups")
        caps = o.Capabilities()
        self.orch = o.Orchestrator(self.store, adapters={}, providers={
            "alpha": o.ProviderInfo("alpha", "acp", None, [{"id": "m1"}, {"id": "m2"}], caps),
            "beta": o.ProviderInfo("beta", "acp", None, [{"id": "b1"}], caps),
            "off": o.ProviderInfo("off", "acp", None, [], caps, available=False,
                                  constraints=("disabled in the configuration",))},
            workspaces=Workspaces(tmp_path))
        self.tools = Toolkit(self.orch, self.store, ServerContext(
            "env-test", [Project("proj", str(tmp_path), "P")], tmp_path))
        self.orch.attach(Scheduler(self.tools, wall=time.time, redact=None))

    async def call(self, scope: Scope, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        reset = current_scope.set(scope)
        try:
            result = await self.tools.call(tool, args)
        finally:
            current_scope.reset(reset)
        assert not output_problems(tool, result, is_error=False)  # its declared shape
        return result

    async def thread(self, thread_id: str, *, prompt: str | None = "work",
                     runtime: str = "full-access", interaction: str = "default") -> None:
        await self.orch.dispatch(o.CreateThread(
            command_id=f"create-{thread_id}", thread_id=thread_id, project_id="proj",
            title=thread_id, provider_instance_id="alpha", model="m1", runtime_mode=runtime,
            interaction_mode=interaction, workspace="/tmp", created_by="user",
            creation_source="web",
            initial_message=o.InitialMessage(f"msg-{thread_id}", prompt) if prompt else None))

    def events(self) -> int:
        return self.store.max_sequence()

    async def denied(self, scope: Scope, tool: str, args: dict[str, Any], code: str) -> str:
        before = self.events()
        with pytest.raises(ToolFailure) as info:
            await self.call(scope, tool, args)
        assert info.value.code == code, str(info.value)
        assert self.events() == before
        return str(info.value)


def run(tmp_path: Path, scenario: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        world = World(tmp_path)
        try:
            await scenario(world)
        finally:
            world.store.close()
    asyncio.run(main())


def test_capability_denied(tmp_path: Path) -> None:
    """A credential without the orchestration capability is refused by every tool."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        preview_only = agent("t1", capabilities=frozenset({"preview"}))
        for tool, args in [("orchestrator_capabilities", {}), ("t3_thread_list", {}),
                           ("delegate_task", {"task": "x"})]:
            await w.denied(preview_only, tool, args, "capability_denied")
    run(tmp_path, scenario)


def test_thread_credential_required(tmp_path: Path) -> None:
    """The client token cannot delegate, poll or cancel tasks: they need a calling thread."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        await w.denied(CLIENT, "delegate_task", {"task": "x"}, "thread_credential_required")
        await w.denied(CLIENT, "task_status", {"taskId": "x"}, "thread_credential_required")
        await w.denied(CLIENT, "task_cancel", {"taskId": "x"}, "thread_credential_required")
    run(tmp_path, scenario)


def test_parent_not_active(tmp_path: Path) -> None:
    """A thread whose run ended (or a credential of another instance) cannot delegate or create
    threads."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        run_id = (await w.orch.state("t1")).latest_run().id
        await w.orch.dispatch(o.InterruptRun(command_id="stop", thread_id="t1", run_id=run_id))
        await w.denied(agent("t1"), "delegate_task", {"task": "x"}, "parent_not_active")
        await w.denied(agent("t1"), "create_threads", {"threads": [{"prompt": "x"}]},
                       "parent_not_active")
        await w.thread("t2")
        await w.denied(agent("t2", "beta"), "delegate_task", {"task": "x"}, "parent_not_active")
        await w.denied(agent("t1"), "t3_thread_send", {"threadId": "t2", "message": "x"},
                       "parent_not_active")
    run(tmp_path, scenario)


def test_provider_and_model_unavailable(tmp_path: Path) -> None:
    """Unknown or unavailable provider instances and unadvertised models are refused."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        me = agent("t1")
        message = await w.denied(me, "delegate_task", {
            "task": "x", "target": {"providerInstanceId": "nope"}}, "provider_unavailable")
        assert "nope" in message
        message = await w.denied(me, "delegate_task", {
            "task": "x", "target": {"providerInstanceId": "off"}}, "provider_unavailable")
        assert "disabled" in message
        await w.denied(me, "delegate_task", {"task": "x", "target": {"driverKind": "codex"}},
                       "provider_unavailable")
        await w.denied(me, "delegate_task", {"task": "x", "target": {"model": "gpt-x"}},
                       "model_unavailable")
        await w.denied(me, "delegate_task", {"task": "x", "target": {
            "providerInstanceId": "beta", "model": "m1"}}, "model_unavailable")
    run(tmp_path, scenario)


def test_mode_escalations(tmp_path: Path) -> None:
    """A child may not be broader than its parent in runtime or interaction mode."""
    async def scenario(w: World) -> None:
        await w.thread("narrow", runtime="approval-required", interaction="plan")
        me = agent("narrow")
        await w.denied(me, "delegate_task", {"task": "x", "runtimeMode": "full-access"},
                       "runtime_mode_escalation_denied")
        await w.denied(me, "delegate_task", {"task": "x", "interactionMode": "default"},
                       "interaction_mode_escalation_denied")
        await w.denied(me, "create_threads", {"threads": [{"prompt": "x",
                                                            "runtimeMode": "auto"}]},
                       "runtime_mode_escalation_denied")
        await w.thread("wide")
        await w.denied(me, "t3_thread_send", {"threadId": "wide", "message": "x"},
                       "runtime_mode_escalation_denied")
        result = await w.call(me, "delegate_task", {"task": "x"})  # inherits: allowed
        child = await w.orch.state(result["childThreadId"])
        assert (child.thread.runtime_mode, child.thread.interaction_mode) == \
            ("approval-required", "plan")
    run(tmp_path, scenario)


def test_task_not_found(tmp_path: Path) -> None:
    """Unknown task ids and another parent's task ids are task_not_found."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        await w.thread("t2")
        other = await w.call(agent("t2"), "delegate_task", {"task": "x"})
        for taskId in ("node:nope", other["taskId"]):
            await w.denied(agent("t1"), "task_status", {"taskId": taskId}, "task_not_found")
            await w.denied(agent("t1"), "task_cancel", {"taskId": taskId}, "task_not_found")
    run(tmp_path, scenario)


def test_task_not_cancellable(tmp_path: Path) -> None:
    """A task whose child run already ended, with nothing left to stop, is not cancellable."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        task = await w.call(agent("t1"), "delegate_task", {"task": "x"})
        await w.orch.dispatch(o.InterruptRun(command_id="stop-child",
                                             thread_id=task["childThreadId"],
                                             run_id=task["childRunId"]))
        status = await w.call(agent("t1"), "task_status", {"taskId": task["taskId"]})
        assert status["status"] == "waiting"  # ended; its result is not published yet
        await w.denied(agent("t1"), "task_cancel", {"taskId": task["taskId"]},
                       "task_not_cancellable")
    run(tmp_path, scenario)


def test_invalid_requests(tmp_path: Path) -> None:
    """Schema violations name the field; a reused clientRequestId with another task is refused."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        me = agent("t1")
        for args, field in [({}, "task"), ({"task": "x", "role": "boss"}, "role"),
                            ({"task": "x", "mode": "later"}, "mode"),
                            ({"task": "x", "timeoutMs": -1}, "timeoutMs"),
                            ({"task": "x", "target": {"instance": "a"}}, "target.instance")]:
            message = await w.denied(me, "delegate_task", args, "invalid_request")
            assert message.startswith(field + ":")
        await w.call(me, "delegate_task", {"task": "one", "clientRequestId": "k"})
        await w.denied(me, "delegate_task", {"task": "two", "clientRequestId": "k"},
                       "invalid_request")
    run(tmp_path, scenario)


def test_workspace_strategy_forms(tmp_path: Path) -> None:
    """workspaceStrategy takes "root" or {type: root}; the worktree objects are checked against
    their own branch (the error names the field), then against the project (here not a git
    repository: refused, nothing made)."""
    async def scenario(w: World) -> None:
        for strategy, message in [
                ({"type": "worktree"}, "workspaceStrategy.baseRef: required"),
                ({"type": "existing_worktree", "worktreePath": "/x", "baseRef": "main"},
                 "workspaceStrategy.baseRef: unknown field"),
                ({"type": "later"}, "workspaceStrategy.type: must be one of root, worktree, "
                                    "existing_worktree"),
                ({}, "workspaceStrategy.type: required"),
                ("worktree", "workspaceStrategy: must be one of root"),
                (7, "workspaceStrategy: expected string or object"),
                ({"type": "worktree", "baseRef": "main", "startFromOrigin": False},
                 "message: a worktree launch needs the first message"),
                ({"type": "worktree", "baseRef": "main", "message": "go"},
                 f"workspaceStrategy: project proj ({tmp_path}) is not a git repository"),
                ({"type": "existing_worktree", "worktreePath": "/x"},
                 "worktreePath: git worktree: fatal: not a git repository")]:
            message_arg = {"message": strategy.pop("message")} \
                if isinstance(strategy, dict) and "message" in strategy else {}
            denied = await w.denied(CLIENT, "t3_thread_launch", {"workspaceStrategy": strategy,
                                                                 **message_arg},
                                    "invalid_request")
            assert denied.startswith(message), (strategy, denied)
        for strategy in ("root", {"type": "root"}):
            made = await w.call(CLIENT, "t3_thread_launch", {"workspaceStrategy": strategy})
            assert made["workspaceStrategy"] == "root" and made["workspacePath"] == str(tmp_path)
    run(tmp_path, scenario)


def test_delegate_retry_returns_the_same_task(tmp_path: Path) -> None:
    """The same delegate_task with the same clientRequestId, even from a later turn, returns the
    same task and writes nothing more."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        me = agent("t1")
        first = await w.call(me, "delegate_task", {"task": "do it", "clientRequestId": "r1"})
        events = w.events()
        again = await w.call(me, "delegate_task", {"task": "do it", "clientRequestId": "r1"})
        assert (again["taskId"], again["childRunId"]) == (first["taskId"], first["childRunId"])
        assert w.events() == events
        run_id = (await w.orch.state("t1")).latest_run().id
        await w.orch.dispatch(o.InterruptRun(command_id="end", thread_id="t1", run_id=run_id))
        await w.orch.dispatch(o.DispatchMessage(
            command_id="next", thread_id="t1", message_id="m-next", text="next turn",
            created_by="user", creation_source="web", mode="start_immediately"))
        events = w.events()
        later = await w.call(me, "delegate_task", {"task": "do it", "clientRequestId": "r1",
                                                   "mode": "async"})
        assert later["taskId"] == first["taskId"] and w.events() == events
    run(tmp_path, scenario)


def test_capabilities_shape(tmp_path: Path) -> None:
    """orchestrator_capabilities reports the inherited selection, providers and features."""
    async def scenario(w: World) -> None:
        await w.thread("t1", runtime="auto")
        caps = await w.call(agent("t1"), "orchestrator_capabilities", {})
        assert caps["parentThreadId"] == "t1"
        assert (caps["inheritedProviderInstanceId"], caps["inheritedModel"]) == ("alpha", "m1")
        assert caps["runtimeMode"] == "auto" and caps["interactionMode"] == "default"
        by_id = {p["providerInstanceId"]: p for p in caps["providers"]}
        assert by_id["alpha"]["canRunChildTask"] and not by_id["off"]["canRunChildTask"]
        assert by_id["off"]["constraints"] == ["disabled in the configuration"]
        assert [m["id"] for m in by_id["alpha"]["models"]] == ["m1", "m2"]
        assert "runtimeModes" not in by_id["alpha"]
        assert caps["features"]["appOwnedSubagents"] and caps["features"]["maxBatchThreads"] == 20
        found = await w.call(agent("t1"), "orchestrator_capabilities", {"search": "b1"})
        assert [[m["id"] for m in p["models"]] for p in found["providers"]] == [[], ["b1"], []]
    run(tmp_path, scenario)
