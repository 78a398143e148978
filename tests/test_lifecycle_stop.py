"""Stop, held queues and Resume (issue 13, items 1 and 5): a person's Stop through the CLI and
/ws, task_cancel holding a child's other turns, a task whose child run is lost, and interrupt of
a waiting run. Server tests drive the real process; the in-process ones use the real Toolkit,
Orchestrator and Store on a SQLite file with no effect worker (see test_tool_denials)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from harness import McpClient, T3Server, scripted_provider, wait_until
from test_delegation import call_line, tool_results, wait
from test_tool_denials import CLIENT, World, agent, run
from test_ws import ws

import orchestrator as o


def runs(mcp: McpClient, thread_id: str) -> dict[str, dict]:
    """The thread's runs by ordinal, as t3_thread_read reports them."""
    read = mcp.call("t3_thread_read", {"threadId": thread_id, "runLimit": 50})
    assert read.ok, read.structured
    return {r["ordinal"]: r for r in read.structured["recentRuns"]}


def running(mcp: McpClient, thread_id: str, ordinal: int = 1) -> bool:
    return runs(mcp, thread_id)[ordinal]["status"] == "running"


def cli_json(t3: T3Server, *args: str) -> dict:
    done = t3.cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_stop_holds_two_queued_runs_across_a_restart_and_resume_runs_them_in_order(
        t3_factory) -> None:
    """Stop with a running and two queued runs: the running one ends interrupted, both queued
    stay held (queueHeld) across a server restart, and Resume runs them in order."""
    t3 = t3_factory()
    mcp = t3.client()
    created = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:600 first"}]})
    tid = created.structured["threads"][0]["threadId"]
    wait_until(lambda: running(mcp, tid), 30)
    for text in ("second", "third"):
        sent = mcp.call("t3_thread_send", {"threadId": tid, "message": text, "mode": "queue"})
        assert sent.structured["delivery"] == "queued", sent.structured
    stopped = cli_json(t3, "stop", tid[-12:], "--reason", "enough for now")
    first, second, third = (runs(mcp, tid)[n]["runId"] for n in (1, 2, 3))
    assert stopped == {"threadId": tid, "interruptedRunIds": [first],
                       "heldRunIds": [second, third]}
    ended = wait(mcp, tid, runId=first)
    assert (ended["status"], ended["statusReason"]) == ("interrupted", "enough for now")
    held = lambda: [(r["status"], r["queueHeld"]) for n, r in sorted(runs(mcp, tid).items())  # noqa: E731
                    if n > 1]
    assert held() == [("queued", True), ("queued", True)]
    t3.restart()
    assert held() == [("queued", True), ("queued", True)]  # recovery promoted nothing
    resumed = cli_json(t3, "resume", tid)
    assert resumed == {"threadId": tid, "releasedRunIds": [second, third]}
    assert wait(mcp, tid, runId=third)["status"] == "completed"
    after = runs(mcp, tid)
    assert after[2]["status"] == "completed" and not after[2]["queueHeld"]
    assert after[2]["completedAt"] <= after[3]["startedAt"]  # second ran before third


def test_task_cancel_holds_the_childs_other_queued_turns_for_resume(t3_factory,
                                                                   tmp_path: Path) -> None:
    """task_cancel stops the child as a Stop does: its running task turn ends interrupted and a
    follow-up queued in the child stays held (before: it started right after the cancel); a
    person's Resume through /ws then runs it."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                               scripted_provider(tmp_path, id="beta")])
    mcp = t3.client()
    created = mcp.call("create_threads", {"threads": [{
        "prompt": call_line("delegate_task", {"task": "SLOW:600 child", "title": "child"}),
        "target": {"providerInstanceId": "alpha"}}]})
    parent = created.structured["threads"][0]["threadId"]
    wait(mcp, parent)
    [task] = tool_results(mcp, parent)
    child = task["childThreadId"]
    wait_until(lambda: running(mcp, child), 30)
    follow_up = mcp.call("t3_thread_send", {"threadId": child, "message": "follow-up",
                                            "mode": "queue"}).structured
    assert follow_up["delivery"] == "queued"
    sent = mcp.call("t3_thread_send", {"threadId": parent, "message": call_line(
        "task_cancel", {"taskId": task["taskId"]})})
    wait(mcp, parent, runId=sent.structured["runId"])
    assert tool_results(mcp, parent)[-1] == {"taskId": task["taskId"],
                                             "status": "cancel_requested"}
    assert wait(mcp, child, runId=task["childRunId"])["status"] == "interrupted"
    queued = runs(mcp, child)[2]
    assert (queued["runId"], queued["status"]) == (follow_up["runId"], "queued")
    assert queued["queueHeld"]
    resumed = ws(t3, lambda client: client.request("dispatchCommand", {
        "type": "thread.resume", "commandId": "r1", "threadId": child}))
    assert resumed["result"]["releasedRunIds"] == [follow_up["runId"]]
    assert wait(mcp, child, runId=follow_up["runId"])["status"] == "completed"


def test_task_cancel_of_a_task_whose_child_run_was_lost_cancels_it(tmp_path: Path) -> None:
    """A task that still shows as running on the parent but whose child run is gone (here: its
    row removed while the server was down) is cancelled there and reported cancelled (before:
    task_not_cancellable)."""
    async def delegate(w: World) -> None:
        await w.thread("t1")
        task = await w.call(agent("t1"), "delegate_task", {"task": "x"})
        (tmp_path / "task.json").write_text(json.dumps(task))
    run(tmp_path, delegate)
    task = json.loads((tmp_path / "task.json").read_text())
    with sqlite3.connect(tmp_path / "t3.sqlite") as db:
        db.execute("DELETE FROM runs WHERE run_id = ?", (task["childRunId"],))

    async def cancel(w: World) -> None:
        result = await w.call(agent("t1"), "task_cancel", {"taskId": task["taskId"]})
        assert result == {"taskId": task["taskId"], "status": "cancelled"}
        status = await w.call(agent("t1"), "task_status", {"taskId": task["taskId"]})
        assert (status["status"], status["workState"]) == ("cancelled", "result_available")
        assert "lost" in status["summary"]
        parent = await w.orch.state("t1")
        assert not [r for r in parent.runs if r.user_message_id.startswith("message:task-wake")]
    run(tmp_path, cancel)


def test_interrupt_of_a_waiting_run_answers_no_active_run(tmp_path: Path) -> None:
    """A run whose turn ended and waits for finalization has no turn to interrupt: the status is
    no_active_run, with or without its run id (before: thread_not_interruptible), and nothing
    is written."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        state = await w.orch.state("t1")
        r = state.latest_run()
        await w.orch.dispatch(o.MarkRunStarted(
            command_id="started", thread_id="t1", run_id=r.id, attempt_id=r.active_attempt_id,
            provider_session_id="session-1", session_created=True, pid=None,
            native_thread_ref=None, cwd=str(tmp_path)))
        await w.orch.dispatch(o.IngestProviderEvents(
            command_id="ended", thread_id="t1", run_id=r.id, attempt_id=r.active_attempt_id,
            provider_session_id="session-1", events=(o.TurnEnded("completed"),)))
        assert (await w.orch.state("t1")).latest_run().status == "waiting"
        before = w.events()
        for args in ({}, {"runId": r.id}):
            result = await w.call(CLIENT, "t3_thread_interrupt", {"threadId": "t1", **args})
            assert result["status"] == "no_active_run"
        assert w.events() == before
    run(tmp_path, scenario)
