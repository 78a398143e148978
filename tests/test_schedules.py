"""Scheduled tasks (SPEC 7) against a real server whose clock the tests move (T3_TEST_CLOCK with
T3_TEST_HOOKS=1; /ws advanceTestClock returns once the scheduler has fired what became due), so
nothing waits real minutes: intervals, fixed times across a DST change, a missed fire skipped,
pause / update / runNow / delete, bound and unbound runs, the creator's mode ceiling, and kill -9
at the fire's commit and while its run streams: each due fire happens exactly once."""

from __future__ import annotations

import asyncio
import calendar
import json
from pathlib import Path
from typing import Any

from cli import WsClient
from orchestrator import iso_time as iso
from harness import McpClient, T3Server, agent_log, scripted_provider, wait_until

# Fri 2026-03-06 17:00 UTC = 12:00 in New York (EST); DST starts there on Sun 2026-03-08.
START = calendar.timegm((2026, 3, 6, 17, 0, 0))
CLOCK = {"T3_TEST_HOOKS": "1", "T3_TEST_CLOCK": str(START), "TZ": "America/New_York"}


def advance(t3: T3Server, seconds: float) -> None:
    """Move the server's clock; returns once the scheduler has fired what became due."""
    async def run() -> None:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            await client.request("advanceTestClock", {"seconds": seconds})
    asyncio.run(run())


def task(mcp: McpClient, task_id: str) -> dict[str, Any]:
    listed = mcp.call("list_scheduled_tasks", {"scheduledTaskId": task_id})
    assert listed.ok, listed.structured
    [found] = listed.structured["tasks"]
    return found


def schedule(mcp: McpClient, **args: Any) -> dict[str, Any]:
    made = mcp.call("schedule_task", args)
    assert made.ok, made.structured
    return made.structured


def settled(mcp: McpClient, task_id: str, runs: int) -> dict[str, Any]:
    """The task once its ``runs``-th run has ended."""
    return wait_until(lambda: (t := task(mcp, task_id))["runCount"] == runs
                      and t["lastRunStatus"] in ("succeeded", "failed") and t, 30)


def prompts(log: Path) -> list[str]:
    return [e["msg"]["params"]["prompt"][-1]["text"] for e in agent_log(log)
            if e["dir"] == "in" and e["msg"].get("method") == "session/prompt"]


def test_an_interval_task_fires_at_each_due_time_and_not_between(t3_factory,
                                                                  agent_log_path: Path) -> None:
    """Every 60 s: nothing at 59 s, one run at 60 s (a fresh thread with the prefixed prompt),
    the next at 120 s."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = schedule(mcp, prompt="hello", title="Ping",
                    schedule={"type": "interval", "everyMs": 60_000})
    assert made["boundThreadId"] is None and made["nextRunAt"] == iso(START + 60)
    advance(t3, 59)
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 0
    advance(t3, 1)
    first = settled(mcp, made["scheduledTaskId"], 1)
    assert first["lastRunStatus"] == "succeeded" and first["nextRunAt"] >= iso(START + 120)
    advance(t3, 60)
    settled(mcp, made["scheduledTaskId"], 2)
    assert prompts(agent_log_path) == ["[Triggered by schedule task: Ping]\n\nhello"] * 2


def test_a_fixed_time_fires_on_its_weekdays_across_a_dst_change(t3_factory) -> None:
    """09:00 on weekdays in New York, made on a Friday noon: nothing over the weekend, then Monday
    09:00 EDT (13:00 UTC, no longer 14:00) after the clocks went forward, then Tuesday."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = schedule(mcp, prompt="standup", schedule={
        "type": "fixed_time", "timeOfDay": "09:00", "weekdays": [1, 2, 3, 4, 5]})
    monday = calendar.timegm((2026, 3, 9, 13, 0, 0))
    assert made["nextRunAt"] == iso(monday)
    advance(t3, calendar.timegm((2026, 3, 8, 14, 0, 0)) - START)  # Sunday 10:00 EDT
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 0
    advance(t3, monday - calendar.timegm((2026, 3, 8, 14, 0, 0)))
    after = settled(mcp, made["scheduledTaskId"], 1)
    assert after["nextRunAt"] == iso(monday + 86_400)


def test_an_interval_task_catches_up_with_a_single_run(t3_factory, agent_log_path: Path) -> None:
    """Five intervals pass at once (the server was down, say): one run, then the next is one
    interval after it."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    task_id = schedule(mcp, prompt="catch up", schedule={"type": "interval",
                                                          "everyMs": 60_000})["scheduledTaskId"]
    advance(t3, 300)
    after = settled(mcp, task_id, 1)
    assert after["nextRunAt"] == iso(START + 360) and len(prompts(agent_log_path)) == 1


def test_a_fixed_time_missed_by_11_minutes_is_skipped(t3_factory) -> None:
    """A daily 12:30 the clock jumps past by 11 minutes: no run, and the next is tomorrow's."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = schedule(mcp, prompt="late", schedule={"type": "fixed_time", "timeOfDay": "12:30"})
    due = START + 30 * 60
    assert made["nextRunAt"] == iso(due)
    advance(t3, 30 * 60 + 11 * 60)
    after = task(mcp, made["scheduledTaskId"])
    assert after["runCount"] == 0 and after["nextRunAt"] == iso(due + 86_400)


def test_pause_update_run_now_and_delete(t3_factory) -> None:
    """enabled false pauses (no next run, nothing fires); re-enabled with a new interval it is
    aimed from now; runNow fires at once; delete removes it and nothing fires after."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    task_id = schedule(mcp, prompt="p", schedule={"type": "interval", "everyMs": 60_000})[
        "scheduledTaskId"]
    paused = schedule(mcp, scheduledTaskId=task_id, enabled=False)
    assert paused["enabled"] is False and paused["nextRunAt"] is None
    advance(t3, 120)
    assert task(mcp, task_id)["runCount"] == 0
    resumed = schedule(mcp, scheduledTaskId=task_id, enabled=True,
                       schedule=json.dumps({"type": "interval", "everyMs": 300_000}))
    assert resumed["nextRunAt"] == iso(START + 120 + 300)
    assert resumed["schedule"] == {"type": "interval", "everyMs": 300_000}
    schedule(mcp, scheduledTaskId=task_id, runNow=True)
    settled(mcp, task_id, 1)
    deleted = mcp.call("delete_scheduled_task", {"scheduledTaskId": task_id})
    assert deleted.structured == {"scheduledTaskId": task_id, "deleted": True}
    advance(t3, 600)
    assert mcp.call("list_scheduled_tasks", {}).structured["tasks"] == []
    assert mcp.call("delete_scheduled_task", {"scheduledTaskId": task_id}).failure_code == \
        "task_not_found"


def call_line(tool: str, args: dict[str, Any]) -> str:
    return f"CALL_TOOL {tool} {json.dumps(args)}"


def test_bound_runs_post_into_the_thread_and_unbound_ones_launch_with_the_tasks_modes(
        t3_factory, tmp_path: Path) -> None:
    """An agent's task posts into its own thread by default; one it unbinds, on another
    provider in a narrower mode, launches a fresh thread there; one broader than the agent's
    approval-required mode is refused."""
    t3 = t3_factory(env=CLOCK, providers=[scripted_provider(tmp_path, id="alpha"),
                                          scripted_provider(tmp_path, id="beta")])
    mcp = t3.client()
    every = {"type": "interval", "everyMs": 900_000}
    lines = [call_line("schedule_task", {"prompt": "bound work", "schedule": every,
                                         "title": "bound"}),
             call_line("schedule_task", {"prompt": "free work", "schedule": every,
                                         "title": "free", "bindToCurrentThread": False,
                                         "target": {"providerInstanceId": "beta"}}),
             call_line("schedule_task", {"prompt": "x", "schedule": every,
                                         "bindToCurrentThread": False,
                                         "runtimeMode": "full-access"})]
    made = mcp.call("create_threads", {"threads": [{
        "prompt": "\n".join(lines), "runtimeMode": "approval-required",
        "target": {"providerInstanceId": "alpha"}}]}).structured["threads"][0]
    calls = wait_until(lambda: len(c := [e for e in agent_log(tmp_path / "agent-alpha.log")
                                         if e["dir"] == "mcp"]) == 3 and c, 30)
    assert calls[2]["result"]["code"] == "runtime_mode_escalation_denied", calls[2]
    bound, free = calls[0]["result"], calls[1]["result"]
    assert bound["boundThreadId"] == made["threadId"] and free["boundThreadId"] is None
    assert free["runtimeMode"] == "approval-required" and free["providerInstanceId"] == "beta"
    # The fire posts a new run into the thread once the turn that scheduled it has ended (a fire
    # during that turn queues behind it: test_a_bound_fire_from_inside_its_threads_turn_...).
    assert mcp.call("t3_thread_wait", {"threadId": made["threadId"]}).structured["status"] \
        == "completed"
    advance(t3, 900)
    fired = {t["title"]: t for t in (settled(mcp, bound["scheduledTaskId"], 1),
                                     settled(mcp, free["scheduledTaskId"], 1))}
    assert fired["bound"]["lastRunThreadId"] == made["threadId"]
    fresh = mcp.call("t3_thread_read", {"threadId": fired["free"]["lastRunThreadId"]}).structured
    assert fresh["thread"]["providerInstanceId"] == "beta"
    assert fresh["thread"]["runtimeMode"] == "approval-required"
    assert prompts(tmp_path / "agent-beta.log") == [
        "[Triggered by schedule task: free]\n\nfree work"]
    assert "[Triggered by schedule task: bound]\n\nbound work" in prompts(
        tmp_path / "agent-alpha.log")


def test_a_bound_fire_from_inside_its_threads_turn_queues_behind_that_turn(
        t3_factory, agent_log_path: Path) -> None:
    """An agent's `schedule_task {runNow: true}` into its own thread, mid-turn, neither steers
    nor restarts that turn: the turn completes once, with the tool's result and the rest of its
    work in the thread, and the fired run is a run of its own that starts after it ended."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    call = call_line("schedule_task", {"prompt": "ECHO_PROMPT", "title": "now", "runNow": True,
                                       "schedule": {"type": "interval", "everyMs": 3_600_000}})
    made = mcp.call("create_threads", {"threads": [{"prompt": f"{call}\nSLOW:40"}]}
                    ).structured["threads"][0]
    [called] = wait_until(lambda: [e for e in agent_log(agent_log_path) if e["dir"] == "mcp"], 30)
    fired = settled(mcp, called["result"]["scheduledTaskId"], 1)
    assert (fired["lastRunStatus"], fired["lastRunThreadId"]) == ("succeeded", made["threadId"])
    read = mcp.call("t3_thread_read", {"threadId": made["threadId"], "view": "messages"}
                    ).structured
    runs = {r["runId"]: r for r in read["recentRuns"]}
    turn, later = runs[made["runId"]], runs[fired["lastRunId"]]
    assert (turn["status"], turn["attemptCount"]) == ("completed", 1), turn
    assert later["status"] == "completed" and turn["completedAt"] <= later["startedAt"]
    [answer] = [i["text"] for i in read["items"]
                if i["type"] == "assistant_message" and i["runId"] == made["runId"]]
    assert f'"scheduledTaskId":"{fired["scheduledTaskId"]}"' in answer and "done" in answer
    stops = [e["msg"]["result"]["stopReason"] for e in agent_log(agent_log_path)
             if e["dir"] == "out" and "stopReason" in (e["msg"].get("result") or {})]
    assert stops == ["end_turn", "end_turn"]  # no turn was cancelled
    assert prompts(agent_log_path)[1] == "[Triggered by schedule task: now]\n\nECHO_PROMPT"


def test_an_agent_changes_or_deletes_only_tasks_its_own_modes_cover(
        t3_factory, tmp_path: Path) -> None:
    """The user's full-access task is out of an approval-required agent's reach: rewriting its
    prompt and running it now, or deleting it, is capability_denied and changes nothing (else
    the agent would have a full-access run of its own words); an approval-required task of the
    same project it may change."""
    t3 = t3_factory(env=CLOCK, providers=[scripted_provider(tmp_path)])
    mcp = t3.client()
    every = {"type": "interval", "everyMs": 60_000}
    broad = schedule(mcp, prompt="tidy up", schedule=every, title="broad")
    narrow = schedule(mcp, prompt="look", schedule=every, title="narrow",
                      runtimeMode="approval-required")
    assert broad["runtimeMode"] == "full-access"
    lines = [call_line("schedule_task", {"scheduledTaskId": broad["scheduledTaskId"],
                                         "prompt": "injected", "runNow": True}),
             call_line("delete_scheduled_task", {"scheduledTaskId": broad["scheduledTaskId"]}),
             call_line("schedule_task", {"scheduledTaskId": narrow["scheduledTaskId"],
                                         "title": "renamed"})]
    mcp.call("create_threads", {"threads": [{"prompt": "\n".join(lines),
                                             "runtimeMode": "approval-required"}]})
    calls = wait_until(lambda: len(c := [e for e in agent_log(tmp_path / "agent.log")
                                         if e["dir"] == "mcp"]) == 3 and c, 30)
    assert [c["result"].get("code") for c in calls[:2]] == ["capability_denied"] * 2, calls
    assert calls[2]["result"]["title"] == "renamed"
    after = task(mcp, broad["scheduledTaskId"])
    assert (after["prompt"], after["runCount"], after["enabled"]) == ("tidy up", 0, True)


def test_kill9_at_the_fire_commit_runs_it_once(t3_factory, agent_log_path: Path) -> None:
    """The server dies right after a fire committed: after the restart its run happens once
    (one prompt, one run), and the next fire is scheduled."""
    t3 = t3_factory(env={**CLOCK, "T3_CRASH_AT": "after-commit:scheduled-task.fire"})
    mcp = t3.client()
    task_id = schedule(mcp, prompt="once", schedule={"type": "interval", "everyMs": 60_000})[
        "scheduledTaskId"]
    try:
        advance(t3, 60)
    except Exception:  # the server died in the middle of the call  # noqa: BLE001
        pass
    wait_until(lambda: not t3.running, 10)
    t3.env.pop("T3_CRASH_AT")
    t3.env["T3_TEST_CLOCK"] = str(START + 61)
    t3.start()
    after = settled(mcp, task_id, 1)
    assert after["lastRunStatus"] == "succeeded" and after["nextRunAt"] == iso(START + 120)
    assert prompts(agent_log_path) == ["[Triggered by schedule task: once]\n\nonce"]
    runs = mcp.call("t3_thread_read", {"threadId": after["lastRunThreadId"]}).structured
    assert len(runs["recentRuns"]) == 1


def test_kill9_while_the_fired_run_streams_fails_it_and_schedules_the_next(
        t3_factory, agent_log_path: Path) -> None:
    """The server dies while a fired run streams: after the restart the task's last run failed
    ("Run was interrupted by a server restart."), it was prompted once, and the next fire is
    scheduled and happens."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    task_id = schedule(mcp, prompt="SLOW:400", title="long",
                       schedule={"type": "interval", "everyMs": 60_000})["scheduledTaskId"]
    advance(t3, 60)
    wait_until(lambda: any(e["dir"] == "out" and "chunk 3 " in json.dumps(e["msg"])
                           for e in agent_log(agent_log_path)), 30)
    t3.kill9()
    t3.env["T3_TEST_CLOCK"] = str(START + 70)
    t3.start()
    after = settled(mcp, task_id, 1)
    assert (after["lastRunStatus"], after["lastRunError"]) == (
        "failed", "Run was interrupted by a server restart.")
    assert after["nextRunAt"] == iso(START + 120)
    assert len(prompts(agent_log_path)) == 1
