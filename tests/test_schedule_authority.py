"""Who may make and change scheduled tasks, in process (the real Toolkit, Orchestrator and Store
of test_tool_denials): an agent never rewrites a task it did not make, schedules only in its own
project, and is held to the [limits] caps; each refusal is typed and writes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import orchestrator as o
import schedules  # noqa: E402
import t3 as server
from test_tool_denials import CLIENT, World, agent, run
from tools import Project

HUB = {"header": "X-Hub-Signature-256", "secret": "s3cret", "prefix": "sha256="}
HOOK = {"type": "webhook", "signature": HUB, "filters": [{"path": "ref", "equals": "main"}]}
EVERY_15 = {"type": "interval", "everyMs": 900_000}


async def stored(w: World, task_id: str) -> schedules.ScheduledTask:
    return (await w.orch.state(task_id)).entities["scheduled-task"][task_id]


async def in_project(w: World, thread_id: str, project_id: str) -> None:
    await w.orch.dispatch(o.CreateThread(
        command_id=f"create-{thread_id}", thread_id=thread_id, project_id=project_id,
        title=thread_id, provider_instance_id="alpha", model="m1", runtime_mode="full-access",
        interaction_mode="default", workspace="/tmp", created_by="user", creation_source="web",
        initial_message=o.InitialMessage(f"msg-{thread_id}", "work")))


def test_an_agent_rewrites_only_the_tasks_its_thread_made(tmp_path: Path) -> None:
    """On a person's GitHub-signed hook, and on another agent's task, an agent's token rotation,
    dropped or changed signature or filters, new prompt, or switch to an interval is each
    capability_denied and writes nothing (token hash, prompt and schedule stay); a rename is
    fine; the agent that made a task changes its prompt, signature and filters."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        await w.thread("t2")
        person = await w.call(CLIENT, "schedule_task", {"prompt": "review {{body.ref}}",
                                                         "schedule": HOOK})
        other = await w.call(agent("t2"), "schedule_task", {"prompt": "t2's", "schedule": HOOK,
                                                             "bindToCurrentThread": False})
        assert "hookUrl" in person
        before = await stored(w, person["scheduledTaskId"])
        for task in (person, other):
            me = {"scheduledTaskId": task["scheduledTaskId"]}
            for change in ({"rotateHookToken": True}, {"schedule": {"type": "webhook"}},
                           {"schedule": {**HOOK, "signature": {**HUB, "secret": "mine"}}},
                           {"schedule": {**HOOK, "filters": []}}, {"prompt": "rm -rf"},
                           {"schedule": EVERY_15, "runNow": True}):
                await w.denied(agent("t1"), "schedule_task", {**me, **change},
                               "capability_denied")
        after = await stored(w, person["scheduledTaskId"])
        assert (after.hook_token_sha256, after.prompt, after.schedule) == \
            (before.hook_token_sha256, before.prompt, before.schedule) and after.run_count == 0
        assert (await w.call(agent("t1"), "schedule_task", {
            "scheduledTaskId": person["scheduledTaskId"], "title": "renamed"}))["title"] == \
            "renamed"
        mine = {"scheduledTaskId": other["scheduledTaskId"]}
        changed = await w.call(agent("t2"), "schedule_task", {
            **mine, "prompt": "t2's new words", "schedule": {"type": "webhook"}})
        assert (changed["prompt"], changed["schedule"]) == ("t2's new words", {"type": "webhook"})
        await w.denied(agent("t2"), "schedule_task", {**mine, "rotateHookToken": True},
                       "capability_denied")
    run(tmp_path, scenario)


def test_an_agent_schedules_and_lists_only_in_its_own_project(tmp_path: Path) -> None:
    """A p1 agent's schedule_task {projectId: p2} is capability_denied before anything is
    written, as is listing p2's tasks; its own list holds none of p2's (nor does asking by id);
    a scratch thread schedules nothing; the client token lists every project's."""
    async def scenario(w: World) -> None:
        w.tools.ctx.projects.append(Project("p2", str(tmp_path / "p2"), "P2"))
        await w.thread("t1")
        await in_project(w, "t2", "p2")
        await in_project(w, "loose", "scratch")
        theirs = await w.call(CLIENT, "schedule_task", {"prompt": "p2's secret plan",
                                                         "schedule": EVERY_15,
                                                         "projectId": "p2"})
        await w.denied(agent("t1"), "schedule_task", {
            "prompt": "x", "schedule": EVERY_15, "projectId": "p2",
            "bindToCurrentThread": False}, "capability_denied")
        await w.denied(agent("loose"), "schedule_task", {
            "prompt": "x", "schedule": EVERY_15, "bindToCurrentThread": False},
            "capability_denied")
        await w.denied(agent("t1"), "list_scheduled_tasks", {"projectId": "p2"},
                       "capability_denied")
        ours = await w.call(agent("t1"), "schedule_task", {"prompt": "ours",
                                                           "schedule": EVERY_15})
        listed = await w.call(agent("t1"), "list_scheduled_tasks", {})
        assert [t["scheduledTaskId"] for t in listed["tasks"]] == [ours["scheduledTaskId"]]
        assert (await w.call(agent("t1"), "list_scheduled_tasks", {
            "scheduledTaskId": theirs["scheduledTaskId"]}))["tasks"] == []
        assert (await w.call(agent("loose"), "list_scheduled_tasks", {}))["tasks"] == []
        everything = await w.call(CLIENT, "list_scheduled_tasks", {})
        assert {t["projectId"] for t in everything["tasks"]} == {"proj", "p2"}
        assert len(w.store.scheduled_tasks()) == 2
    run(tmp_path, scenario)


def test_agents_are_held_to_the_task_cap_and_the_minimum_interval(tmp_path: Path) -> None:
    """An agent's interval under min_agent_task_interval_s (made, or changed to) and a task
    beyond max_scheduled_tasks_per_project are capability_denied naming the limit and write
    nothing; a fixed time passes; a retry of a task it made is no new task; the client token
    is held to neither."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        me = agent("t1")
        every_minute = {"type": "interval", "everyMs": 60_000}
        message = await w.denied(me, "schedule_task", {"prompt": "x", "schedule": every_minute},
                                 "capability_denied")
        assert "min_agent_task_interval_s = 900" in message
        first = await w.call(me, "schedule_task", {"prompt": "a", "schedule": EVERY_15,
                                                   "clientRequestId": "a"})
        await w.denied(me, "schedule_task", {"scheduledTaskId": first["scheduledTaskId"],
                                             "schedule": every_minute}, "capability_denied")
        await w.call(me, "schedule_task", {"prompt": "b", "schedule": {
            "type": "fixed_time", "timeOfDay": "09:00"}})
        await w.call(CLIENT, "schedule_task", {"prompt": "c", "schedule": every_minute})
        w.tools.ctx.max_scheduled_tasks_per_project = 3
        message = await w.denied(me, "schedule_task", {"prompt": "d", "schedule": EVERY_15},
                                 "capability_denied")
        assert "max_scheduled_tasks_per_project = 3" in message
        again = await w.call(me, "schedule_task", {"prompt": "a", "schedule": EVERY_15,
                                                   "clientRequestId": "a"})
        assert again["scheduledTaskId"] == first["scheduledTaskId"]
        await w.call(CLIENT, "schedule_task", {"prompt": "e", "schedule": every_minute})
        assert len(w.store.scheduled_tasks()) == 4
    run(tmp_path, scenario)


@pytest.mark.parametrize(("limits", "problem"), [
    ("max_scheduled_tasks_per_project = 0", "limits.max_scheduled_tasks_per_project: must be a "
                                            "positive integer"),
    ("min_agent_task_interval_s = 30", "limits.min_agent_task_interval_s: must be at least 60")])
def test_the_schedule_limits_are_checked_in_the_config(tmp_path: Path, limits: str,
                                                       problem: str) -> None:
    """Bad [limits] values stop startup naming the file, line and key; the defaults are 20
    tasks per project and 900 s."""
    config = tmp_path / "t3.toml"
    config.write_text(f"[limits]\n{limits}\n")
    with pytest.raises(server.ConfigError, match=f"t3.toml:2: {problem}"):
        server.load_config(config, cwd=tmp_path)
    config.write_text("")
    loaded: Any = server.load_config(config, cwd=tmp_path)
    assert (loaded.max_scheduled_tasks_per_project, loaded.min_agent_task_interval_s) == (20, 900)
