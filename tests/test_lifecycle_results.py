"""Delegated results and question notices (issue 13 items 2 and 7), end to end: a task's result
comes from its final work turn (completion follow-ups included) and stays stable while later work
is reported beside it; a child's question notice is withdrawn when the question expires; a wait
ends only for the task's own live approvals."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from harness import McpClient, agent_log, scripted_provider, wait_until
from test_delegation import call_line, create, tool_results, two_agents, wait

HELLO = "Hello from scripted agent. You said: "


def task_status(mcp: McpClient, parent_id: str, task_id: str) -> dict:
    """The parent's agent calls task_status in a new turn; its result."""
    sent = mcp.call("t3_thread_send", {"threadId": parent_id, "mode": "queue",
                                       "message": call_line("task_status", {"taskId": task_id})})
    assert sent.ok, sent.structured
    wait(mcp, parent_id, runId=sent.structured["runId"])
    return tool_results(mcp, parent_id)[-1]


def runs(mcp: McpClient, thread_id: str) -> list[dict]:
    return mcp.call("t3_thread_read", {"threadId": thread_id, "runLimit": 50}).structured[
        "recentRuns"]


def test_wait_gets_the_final_work_turn_after_a_grandchild(t3_factory, tmp_path: Path) -> None:
    """A parent waiting on a child whose grandchild finishes after the child's first turn gets
    the result of the child's final work turn (its completion follow-up), with nothing pending;
    task_status shows the same afterwards."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    child_task = "\n".join([call_line("delegate_task", {
        "task": "SLOW:20 grandchild", "title": "grandchild"}), "first turn of the child"])
    parent = create(mcp, call_line("delegate_task", {
        "task": child_task, "title": "child", "target": {"providerInstanceId": "beta"},
        "mode": "wait", "timeoutMs": 60_000}), target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    [result] = tool_results(mcp, tid)
    assert result["status"] == "completed" and result["waitTimedOut"] is False
    assert result["summary"].startswith(f'{HELLO}Delegated task "grandchild" completed.')
    assert result["hasPendingChildRuns"] is False and result["latestTerminalRunId"] is None
    child_runs = runs(mcp, result["childThreadId"])
    assert [r["status"] for r in child_runs] == ["completed", "completed"]
    later = task_status(mcp, tid, result["taskId"])
    for key in ("status", "summary", "resultContextTransferId", "hasPendingChildRuns",
                "latestTerminalRunId", "workState"):
        assert later[key] == result[key], key


def test_later_work_is_reported_beside_the_published_result(t3_factory, tmp_path: Path) -> None:
    """A follow-up sent to a finished task's child runs as later work: the published summary and
    result transfer stay; latestTerminal* (with its own result transfer) report the follow-up."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {
        "task": "the task itself", "target": {"providerInstanceId": "beta"}, "mode": "wait"}),
        target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    wait(mcp, tid)
    [first] = tool_results(mcp, tid)
    assert first["summary"] == f"{HELLO}the task itself"
    sent = mcp.call("t3_thread_send", {"threadId": first["childThreadId"],
                                       "message": "later work"}).structured
    assert wait(mcp, first["childThreadId"], runId=sent["runId"])["status"] == "completed"
    status = wait_until(lambda: (s := task_status(mcp, tid, first["taskId"]))[
        "latestTerminalResultContextTransferId"] and s, 30)
    assert (status["summary"], status["resultContextTransferId"]) == \
        (first["summary"], first["resultContextTransferId"])
    assert (status["latestTerminalRunId"], status["latestTerminalStatus"]) == \
        (sent["runId"], "completed")
    assert status["latestTerminalSummary"] == f"{HELLO}later work"
    assert status["hasPendingChildRuns"] is False
    transfers = {t["id"]: t for t in mcp.call("t3_thread_read", {
        "threadId": first["childThreadId"]}).structured["transfers"]}
    assert transfers[status["latestTerminalResultContextTransferId"]]["summary"] == \
        f"{HELLO}later work"
    assert transfers[status["resultContextTransferId"]]["summary"] == first["summary"]


def test_question_notice_is_withdrawn_when_the_question_expires(t3_factory,
                                                                tmp_path: Path) -> None:
    """A child's question queues a notice behind its parent's long turn; when the child's agent
    dies, the question expires and the queued notice is cancelled before it ever starts."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                               scripted_provider(tmp_path, id="grok", driver="grok")])
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {
        "task": "ASK_QUESTION", "title": "asker", "target": {"providerInstanceId": "grok"}})
        + "\nSLOW:600", target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    notice = wait_until(lambda: next((r for r in runs(mcp, tid) if r["status"] == "queued"),
                                     None), 30)
    child_pid = agent_log(tmp_path / "agent-grok.log")[0]["pid"]
    os.kill(child_pid, signal.SIGKILL)
    wait_until(lambda: next(r for r in runs(mcp, tid) if r["runId"] == notice["runId"])[
        "status"] == "cancelled", 20)
    mcp.call("t3_thread_interrupt", {"threadId": tid})
    wait(mcp, tid)
    prompts = [e["msg"]["params"]["prompt"][-1]["text"] for e in agent_log(
        tmp_path / "agent-alpha.log") if e["dir"] == "in"
        and e["msg"].get("method") == "session/prompt"]
    assert not any("blocked on a question" in p for p in prompts)


def test_wait_ignores_approvals_outside_the_task(t3_factory, tmp_path: Path) -> None:
    """While a task waits for its grandchild, a follow-up someone sent to the child asks for an
    approval: that is not the task's own work, so the parent's wait does not end for it (it
    times out, with no pendingApproval)."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    child_task = call_line("delegate_task", {"task": "SLOW:400 grandchild"})
    parent = create(mcp, call_line("delegate_task", {
        "task": child_task, "target": {"providerInstanceId": "beta"}, "mode": "wait",
        "timeoutMs": 8_000}), target={"providerInstanceId": "alpha"},
        runtimeMode="approval-required")
    tid = parent["threadId"]

    def child_idle() -> str | None:
        listed = mcp.call("t3_thread_list", {"limit": 100}).structured["threads"]
        child = next((t for t in listed if t["parentThreadId"] == tid), None)
        return child["threadId"] if child and child["status"] == "completed" else None
    child_id = wait_until(child_idle, 30)
    mcp.call("t3_thread_send", {"threadId": child_id, "message": "ASK_PERMISSION"})
    wait_until(lambda: mcp.call("t3_pending_request", {"threadId": child_id, "action": "list"})
               .structured["requests"], 30)
    assert wait(mcp, tid)["status"] == "completed"
    [result] = tool_results(mcp, tid)
    assert result["waitTimedOut"] is True and result["pendingApproval"] is None
    assert result["status"] == "waiting" and result["workState"] == "waiting_for_children"
