"""Deleting a thread (issue 20, item 3): delete ends what the thread owns (its agent process,
sessions, pending requests, queued and active runs) and wakes what waits on it with
thread_not_found; no thread's state stops startup. Last, a property test: random sequences of
a person's actions with kill -9 at random points, after each of which the server comes up,
/healthz answers and every live thread reads."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import orchestrator as o
from cli import WsClient, WsError
from harness import McpClient, T3Server, agent_log, pids_alive, raw_request, wait_until
from test_delegation import call_line, tool_results
from test_tool_denials import World, run
from test_workspace import make_repo


def ws(t3: T3Server, method: str, params: dict[str, Any]) -> Any:
    async def call() -> Any:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            return await client.request(method, params)
    return asyncio.run(call())


def rows(t3: T3Server, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    return t3.rows(sql, args)


def create(mcp: McpClient, prompt: str, **entry: Any) -> dict[str, Any]:
    made = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert made.ok, made.structured
    return made.structured["threads"][0]


def delete(t3: T3Server, thread_id: str) -> None:
    done = t3.cli("delete", thread_id, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["deleted"] is True


def ready(t3: T3Server) -> None:
    assert raw_request("GET", t3.url + "/healthz").status == 200


def test_deleting_a_completed_thread_stops_its_agent_and_every_restart_comes_up(
        t3: T3Server, mcp: McpClient, agent_log_path: Path) -> None:
    """Delete of a completed thread whose idle agent still runs: the agent exits and its
    session is stopped; a clean restart and a kill -9 restart both reach ready (at 3fab64a the
    start exited with CommandRejected), and the other thread still reads."""
    tid = create(mcp, "hello")["threadId"]
    other = create(mcp, "and me")["threadId"]
    for thread_id in (tid, other):
        assert mcp.call("t3_thread_wait", {"threadId": thread_id}).structured[
            "status"] == "completed"
    agents = {e["pid"] for e in agent_log(agent_log_path)}
    assert len(pids_alive(agents)) == 2  # idle sessions keep their processes
    delete(t3, tid)
    wait_until(lambda: len(pids_alive(agents)) == 1, 15, message="the deleted thread's agent exits")
    assert rows(t3, "SELECT DISTINCT status FROM provider_sessions WHERE thread_id = ?",
                tid) == [("stopped",)]
    for restart in (t3.restart, lambda: (t3.kill9(), t3.start())):
        restart()
        ready(t3)
        assert mcp.call("t3_thread_read", {"threadId": tid}).failure_code == "thread_not_found"
        assert mcp.call("t3_thread_read", {"threadId": other}).ok


def test_a_thread_whose_recovery_is_rejected_does_not_stop_startup(
        t3: T3Server, mcp: McpClient) -> None:
    """A start with a deleted thread whose session a 3fab64a server left running, and session
    and request rows of a thread that does not exist: the server comes up, the deleted
    thread's session is stopped, the rejected recovery is on stderr, and a run the kill -9 cut
    off is interrupted with the restart's reason as usual."""
    gone = create(mcp, "hello")["threadId"]
    assert mcp.call("t3_thread_wait", {"threadId": gone}).structured["status"] == "completed"
    delete(t3, gone)
    busy = create(mcp, "SLOW:600 busy")
    wait_until(lambda: mcp.call("t3_thread_read", {"threadId": busy["threadId"]}).structured[
        "recentRuns"][0]["status"] == "running", 20)
    t3.kill9()
    running = [(session_id, {**json.loads(payload), "status": "running"}) for session_id, payload
               in t3.rows("SELECT provider_session_id, payload_json FROM provider_sessions "
                          "WHERE thread_id = ?", (gone,))]
    for session_id, payload in running:
        t3.execute("UPDATE provider_sessions SET status = 'running', payload_json = ? WHERE "
                   "provider_session_id = ?", (json.dumps(payload), session_id))
    ghost = {**running[0][1], "id": "ghost-session", "threadId": "ghost"}
    t3.execute("INSERT INTO provider_sessions VALUES ('ghost-session', 'ghost', 'running', ?)",
               (json.dumps(ghost),))
    t3.start()
    ready(t3)
    assert "recovery of thread ghost failed" in t3.stderr_text()
    assert rows(t3, "SELECT DISTINCT status FROM provider_sessions WHERE thread_id = ?",
                gone) == [("stopped",)]
    run = mcp.call("t3_thread_read", {"threadId": busy["threadId"]}).structured["recentRuns"][0]
    assert run["status"] == "interrupted" and "restarted" in run["statusReason"]


def test_delete_ends_requests_and_runs_and_every_waiter_gets_thread_not_found(
        t3_factory: Any, tmp_path: Path) -> None:
    """Deleting a thread with a run blocked on an approval and a queued run behind it: a
    t3_thread_wait from another client ends at once with thread_not_found, the request is
    cancelled, both runs are cancelled, the agent exits. Deleting a child a parent's
    delegate_task wait waits on ends that wait with thread_not_found too, and the task ends
    cancelled; a schedule bound to a deleted thread fires into it as a failed run with the
    reason; the server restarts after all of it."""
    t3 = t3_factory()
    mcp, other = t3.client(), t3.client()
    asked = create(mcp, "ASK_PERMISSION please", runtimeMode="approval-required")
    tid = asked["threadId"]
    wait_until(lambda: ws(t3, "listPendingRequests", {"threadId": tid})["requests"], 20)
    queued = mcp.call("t3_thread_send", {"threadId": tid, "message": "then this", "mode": "queue"})
    waiting = threading.Event()  # its first progress note (after 5 s) says it waits
    waiter = other.submit("t3_thread_wait", {"threadId": tid, "runId": queued.structured["runId"],
                                             "timeoutMs": 120_000}, timeout=130,
                          on_progress=lambda _: waiting.set())
    assert waiting.wait(30)
    agents = {e["pid"] for e in agent_log(tmp_path / "agent.log")}
    started = time.monotonic()
    delete(t3, tid)
    assert waiter.result(timeout=30).failure_code == "thread_not_found"
    assert time.monotonic() - started < 15
    assert rows(t3, "SELECT status FROM runtime_requests WHERE thread_id = ?", tid) == [
        ("cancelled",)]
    assert sorted(rows(t3, "SELECT status FROM runs WHERE thread_id = ?", tid)) == [
        ("cancelled",), ("cancelled",)]
    wait_until(lambda: not pids_alive(agents), 15, message="the deleted thread's agent exits")

    made = create(mcp, call_line("delegate_task", {"task": "SLOW:600 child", "title": "child",
                                                   "mode": "wait", "timeoutMs": 120_000}))
    parent = made["threadId"]
    child = wait_until(lambda: next(iter(ws(t3, "getThreadProjection", {"threadId": parent})[
        "projection"]["subagents"]), None), 20)["childThreadId"]
    wait_until(lambda: "chunk" in json.dumps(mcp.call("t3_thread_read", {
        "threadId": child, "afterPosition": -1}).structured["items"]), 20)
    delete(t3, child)
    assert mcp.call("t3_thread_wait", {"threadId": parent, "runId": made["runId"],
                                       "timeoutMs": 20_000}).structured["status"] == "completed"
    assert [r.get("code") for r in tool_results(mcp, parent)] == ["thread_not_found"]
    wait_until(lambda: ws(t3, "getThreadProjection", {"threadId": parent})["projection"][
        "subagents"][0]["status"] == "cancelled", 20, message="the task ends cancelled")

    bound = create(mcp, call_line("schedule_task", {
        "prompt": "later", "schedule": {"type": "interval", "everyMs": 3_600_000}}))["threadId"]
    assert mcp.call("t3_thread_wait", {"threadId": bound}).structured["status"] == "completed"
    [task] = [t for t in ws(t3, "listScheduledTasks", {})["tasks"] if t["boundThreadId"] == bound]
    delete(t3, bound)
    ws(t3, "scheduleTask", {"scheduledTaskId": task["scheduledTaskId"], "runNow": True})
    fired = wait_until(lambda: next((t for t in ws(t3, "listScheduledTasks", {})["tasks"] if t[
        "scheduledTaskId"] == task["scheduledTaskId"] and t["lastRunStatus"] == "failed"), None),
        20)
    assert "was not found" in fired["lastRunError"]
    t3.restart()
    ready(t3)


def test_a_thread_whose_recovery_fails_has_its_run_failed_and_the_next_one_recovers(
        tmp_path: Path, caplog: Any) -> None:
    """In process: thread a's recovery command fails (its id was taken by another command, as
    only a hand-edited database could do); recover() returns, logs it, fails a's run with the
    reason, and recovers thread b after it."""
    async def scenario(w: World) -> None:
        await w.thread("a")
        await w.thread("b")
        for _ in "ab":  # the old process claimed both starts: a restart must look at them
            assert await w.store.claim_effect(owner="old", now_ms=int(time.time() * 1000),
                                              lease_ms=30_000) is not None
        now = "2030-01-01T00:00:00.000Z"
        orch = o.Orchestrator(w.store, adapters={}, providers=w.orch.providers, clock=lambda: now)
        await orch.dispatch(o.ChangeThreadLifecycle(f"recover:a:{now}", "a", "thread.visit", now))
        assert await orch.recover(reason="restarted") == []
        a, b = (await orch.state("a")).runs[0], (await orch.state("b")).runs[0]
        assert a.status == "failed" and a.status_reason.startswith(
            "Recovery after a server restart failed: the request id behind command")
        assert b.status == "starting"  # its start had not begun: recovered, it still starts
        assert [r for r in caplog.records if r.message.startswith("recovery of thread a failed")]
    run(tmp_path, scenario)


# ---------------------------------------------------------------- the property test

PROMPTS = ("hello", "SLOW:30 work", "WRITE_FILE notes/{n}.txt v{n}", "ASK_PERMISSION")


class Person:
    """A person's actions against one server, each taken on a random thread. Every answer is
    a success or a typed failure (an exception otherwise fails the test)."""

    def __init__(self, t3: T3Server, rng: random.Random) -> None:
        self.t3, self.rng, self.mcp = t3, rng, t3.client()
        self.live: list[str] = []
        self.deleted: list[str] = []
        self.n = 0

    def act(self, action: str) -> None:
        self.n += 1
        pick = self.rng.choice(self.live) if self.live else None
        if action == "create" or pick is None:
            prompt = self.rng.choice(PROMPTS).format(n=self.n)
            mode = "approval-required" if prompt == "ASK_PERMISSION" else "full-access"
            made = self._mcp("create_threads", {"threads": [{"prompt": prompt,
                                                             "runtimeMode": mode}]})
            self.live += [made["threads"][0]["threadId"]] if made else []
        elif action == "wait":
            self._mcp("t3_thread_wait", {"threadId": pick, "timeoutMs": 5_000})
        elif action == "send":
            self._mcp("t3_thread_send", {"threadId": pick, "message": f"more {self.n}",
                                         "mode": self.rng.choice(("auto", "queue"))})
        elif action in ("stop", "resume", "archive", "unarchive"):
            self._ws("dispatchCommand", {"type": f"thread.{action}", "threadId": pick})
        elif action == "switch":
            self._ws("dispatchCommand", {"type": "provider.switch", "threadId": pick,
                                         "modelSelection": {"model": self.rng.choice((
                                             "scripted-1", "scripted-2"))}})
        elif action == "rollback":
            self._ws("rollbackThread", {"threadId": pick, "runOrdinal": self.rng.randint(0, 2)})
        elif action == "fork":
            forked = self._ws("forkThread", {"commandId": f"fork-{self.n}",
                                             "sourceThreadId": pick})
            self.live += [forked["threadId"]] if forked else []
        elif action == "schedule":
            self._schedule(pick)
        elif action == "delete":
            done = self.t3.cli("delete", pick)
            assert done.returncode == 0 or done.stderr.startswith("t3: "), done.stderr
            if done.returncode == 0:
                self.live.remove(pick)
                self.deleted.append(pick)

    def _schedule(self, pick: str) -> None:
        """A bound task made by an agent in ``pick``, else one of a person's fired now."""
        tasks = self._ws("listScheduledTasks", {})["tasks"]
        if tasks and self.rng.random() < 0.5:
            self._ws("scheduleTask", {"scheduledTaskId": self.rng.choice(tasks)[
                "scheduledTaskId"], "runNow": True})
        elif self.rng.random() < 0.5:
            self._mcp("t3_thread_send", {"threadId": pick, "message": call_line("schedule_task", {
                "prompt": "bound", "schedule": {"type": "interval", "everyMs": 3_600_000}})})
        else:
            self._ws("scheduleTask", {"prompt": "unbound", "runNow": True, "schedule": {
                "type": "interval", "everyMs": 3_600_000}})

    def _mcp(self, tool: str, args: dict[str, Any]) -> Any:
        result = self.mcp.call(tool, args)
        assert result.ok or result.failure_code, (tool, args, result.structured, result.text)
        return result.structured if result.ok else None

    def _ws(self, method: str, params: dict[str, Any]) -> Any:
        if method == "dispatchCommand":
            params = {**params, "commandId": f"{params['type']}:{self.n}"}
        try:
            return ws(self.t3, method, params)
        except WsError as exc:
            assert exc.code and exc.status is None, (method, params, exc)
            return None

    def check(self, where: str) -> None:
        """Ready, /healthz, and every thread reads: a live one (listed or not) fully, a deleted
        one as thread_not_found."""
        ready(self.t3)
        listed = {s["threadId"] for archived in (False, True) for s in self.mcp.call(
            "t3_thread_list", {"archived": archived, "limit": 100}).structured["threads"]}
        for thread_id in {*self.live, *listed}:
            read = self.mcp.call("t3_thread_read", {"threadId": thread_id})
            assert read.ok, (where, thread_id, read.structured)
        for thread_id in self.deleted:
            read = self.mcp.call("t3_thread_read", {"threadId": thread_id})
            assert read.failure_code == "thread_not_found", (where, thread_id, read.structured)


ACTIONS = ("create", "send", "wait", "stop", "resume", "archive", "unarchive", "delete",
           "rollback", "fork", "switch", "schedule")


def test_random_actions_with_kill9_always_come_back(t3_factory: Any, tmp_path: Path) -> None:
    """A person's actions (each of ACTIONS once, the rest drawn at random, more often create,
    wait and delete) in random order with kill -9 at random points: after each kill the server
    reaches ready, /healthz answers, every live thread reads and every deleted one is
    thread_not_found. T3_PROPERTY_SEED picks another sequence (CI: 20); T3_PROPERTY_STEPS a
    longer one."""
    seed = int(os.environ.get("T3_PROPERTY_SEED", "20"))
    steps = max(len(ACTIONS), int(os.environ.get("T3_PROPERTY_STEPS", "25")))
    rng = random.Random(seed)
    plan = [*ACTIONS, *rng.choices(("create", "wait", "delete", *ACTIONS),
                                   k=steps - len(ACTIONS))]
    rng.shuffle(plan)
    kills = set(rng.sample(range(steps - 1), k=steps // 6)) | {steps - 1}
    make_repo(tmp_path / "workspace")
    t3 = t3_factory()
    person = Person(t3, rng)
    for step, action in enumerate(plan):
        person.act(action)
        if step in kills:
            t3.kill9()
            t3.start()
            person.check(f"seed {seed}, after {plan[:step + 1]}")
    assert t3.stop() == 0, f"seed {seed}"
    assert "Traceback" not in t3.stderr_text(), f"seed {seed}"  # no background task died
