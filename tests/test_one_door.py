"""One door: MCP, /ws methods, /ws dispatchCommand and the CLI are framings of one table of
operations (tools.OPERATIONS), so each rule holds on all of them or on none. A refused case sent
through every transport that can express it gets the same typed failure code and writes nothing;
dispatchCommand takes the seed's wire shapes; each operation is reachable where the table says,
validated against its one schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import history
import cli
import tools
from harness import McpClient, T3Server, agent_log, wait_until

LONG = "x" * 257  # one past the 256 characters of a clientRequestId or commandId


def ws(t3: T3Server, method: str, params: dict[str, Any]) -> Any:
    async def run() -> Any:
        async with cli.WsClient(t3.url + "/ws", t3.token) as client:
            return await client.request(method, params)
    return asyncio.run(run())


def ws_code(t3: T3Server, method: str, params: dict[str, Any]) -> str | None:
    """The /ws failure code, or None when it was accepted."""
    try:
        ws(t3, method, params)
    except cli.WsError as exc:
        return exc.code
    return None


def mcp_code(mcp: McpClient, tool: str, args: dict[str, Any]) -> str | None:
    return mcp.call(tool, args).failure_code


def cli_code(t3: T3Server, *args: str) -> str | None:
    done = t3.cli(*args)
    if done.returncode == 0:
        return None
    assert done.stderr.startswith("t3: "), done
    return done.stderr.split(":")[1].strip()


def event_count(t3: T3Server) -> int:
    return int(t3.rows("SELECT count(*) FROM events")[0][0])


def dispatch(t3: T3Server, command: dict[str, Any]) -> dict[str, Any]:
    return ws(t3, "dispatchCommand", command)["result"]  # type: ignore[no-any-return]


def idle_thread(t3: T3Server, name: str) -> str:
    return dispatch(t3, {"type": "thread.create", "commandId": name, "title": name})["threadId"]


Attempt = Callable[[], str | None]


def refused_everywhere(t3: T3Server, attempts: dict[str, Attempt], code: str) -> None:
    """Each transport's attempt fails with ``code`` and the event log does not grow."""
    for transport, attempt in attempts.items():
        before = event_count(t3)
        assert attempt() == code, transport
        assert event_count(t3) == before, f"{transport} wrote events"


def test_a_refused_case_is_refused_alike_by_every_transport(t3: T3Server, mcp: McpClient) -> None:
    """Archived and deleted threads, unknown and scratch projects, over-long ids: MCP, a /ws
    method, dispatchCommand and the CLI answer the same code and write nothing."""
    archived, deleted = idle_thread(t3, "archived"), idle_thread(t3, "deleted")
    dispatch(t3, {"type": "thread.archive", "commandId": "a", "threadId": archived})
    dispatch(t3, {"type": "thread.delete", "commandId": "d", "threadId": deleted})
    for tid, code in ((archived, "thread_not_sendable"), (deleted, "thread_not_found")):
        refused_everywhere(t3, {
            "mcp": lambda: mcp_code(mcp, "t3_thread_send", {"threadId": tid, "message": "hi"}),
            "ws": lambda: ws_code(t3, "sendToThread", {"threadId": tid, "message": "hi"}),
            "dispatch": lambda: ws_code(t3, "dispatchCommand", {
                "type": "message.dispatch", "commandId": f"m-{tid}", "threadId": tid,
                "text": "hi"}),
            "cli": lambda: cli_code(t3, "send", tid, "hi")}, code)
    for project in ("nope", "scratch"):
        refused_everywhere(t3, {
            "mcp": lambda: mcp_code(mcp, "create_threads", {"threads": [{"prompt": "hi"}],
                                                            "projectId": project}),
            "ws": lambda: ws_code(t3, "launchThread", {"commandId": "l", "projectId": project}),
            "dispatch": lambda: ws_code(t3, "dispatchCommand", {
                "type": "thread.create", "commandId": f"c-{project}", "projectId": project}),
            "cli": lambda: cli_code(t3, "new", "hi", "--project", project)}, "invalid_request")
    live = idle_thread(t3, "live")
    refused_everywhere(t3, {
        "mcp": lambda: mcp_code(mcp, "t3_thread_send", {"threadId": live, "message": "hi",
                                                        "clientRequestId": LONG}),
        "ws": lambda: ws_code(t3, "sendToThread", {"threadId": live, "message": "hi",
                                                   "clientRequestId": LONG}),
        "dispatch": lambda: ws_code(t3, "dispatchCommand", {
            "type": "message.dispatch", "commandId": LONG, "threadId": live, "text": "hi"})},
        "invalid_request")


def test_interrupts_stops_and_schedules_are_refused_alike_by_every_transport(
        t3: T3Server, mcp: McpClient) -> None:
    """A deleted thread cannot be interrupted or stopped, and no task is scheduled in an
    unknown project: MCP, a /ws method, dispatchCommand and the CLI answer the same code (as
    far as each can express the call) and write nothing."""
    gone = idle_thread(t3, "gone")
    dispatch(t3, {"type": "thread.delete", "commandId": "del", "threadId": gone})
    refused_everywhere(t3, {
        "mcp": lambda: mcp_code(mcp, "t3_thread_interrupt", {"threadId": gone}),
        "ws": lambda: ws_code(t3, "interruptThread", {"threadId": gone}),
        "dispatch": lambda: ws_code(t3, "dispatchCommand", {
            "type": "run.interrupt", "commandId": "i", "threadId": gone, "runId": "r"}),
        "cli": lambda: cli_code(t3, "interrupt", gone)}, "thread_not_found")
    refused_everywhere(t3, {
        "dispatch": lambda: ws_code(t3, "dispatchCommand", {
            "type": "thread.stop", "commandId": "s", "threadId": gone}),
        "cli": lambda: cli_code(t3, "stop", gone)}, "thread_not_found")
    task = {"prompt": "report", "schedule": {"type": "interval", "everyMs": 3_600_000},
            "projectId": "nope"}
    refused_everywhere(t3, {
        "mcp": lambda: mcp_code(mcp, "schedule_task", task),
        "ws": lambda: ws_code(t3, "scheduleTask", task),
        "cli": lambda: cli_code(t3, "schedule", "report", "--every", "1h", "--project",
                                "nope")}, "invalid_request")


def children(mcp: McpClient, parent_id: str) -> list[dict[str, Any]]:
    threads = mcp.call("t3_thread_list", {"includeSubagents": True}).structured["threads"]
    return [t for t in threads if t["parentThreadId"] == parent_id]


def test_delegation_limits_hold_on_mcp_and_dispatch_command(t3_factory, agent_log_path: Path
                                                            ) -> None:
    """max_delegation_depth and the parent's mode ceiling bind delegate_task (an agent's call)
    and /ws delegated_task.request alike: capability_denied and
    runtime_mode_escalation_denied, no child made."""
    t3 = t3_factory(extra="[limits]\nmax_delegation_depth = 1\n")
    mcp = t3.client()
    root = dispatch(t3, {"type": "thread.create", "commandId": "root",
                         "runtimeMode": "approval-required",
                         "initialMessage": {"text": "ASK_PERMISSION"}})
    assert wait_until(lambda: mcp.call("t3_pending_request", {
        "threadId": root["threadId"], "action": "list"}).structured["requests"], 30)
    level1 = dispatch(t3, {"type": "delegated_task.request", "commandId": "level1",
                           "parentThreadId": root["threadId"], "parentRunId": root["runId"],
                           "task": "ASK_PERMISSION"})
    assert wait_until(lambda: mcp.call("t3_pending_request", {
        "threadId": level1["childThreadId"], "action": "list"}).structured["requests"], 30)

    def delegated(command_id: str, thread_id: str, run_id: str, **extra: Any) -> Attempt:
        return lambda: ws_code(t3, "dispatchCommand", {
            "type": "delegated_task.request", "commandId": command_id, "parentThreadId":
            thread_id, "parentRunId": run_id, "task": "hello", **extra})
    refused_everywhere(t3, {"dispatch": delegated(
        "deep", level1["childThreadId"], level1["childRunId"])}, "capability_denied")
    refused_everywhere(t3, {"dispatch": delegated(
        "broad", root["threadId"], root["runId"], runtimeMode="full-access")},
        "runtime_mode_escalation_denied")
    # The same two through an agent's own delegate_task: a child of the root asks for both.
    asks = [{"task": "hello"}, {"task": "hello", "runtimeMode": "full-access"}]
    agent = dispatch(t3, {"type": "delegated_task.request", "commandId": "agent",
                          "parentThreadId": root["threadId"], "parentRunId": root["runId"],
                          "task": "\n".join(f"CALL_TOOL delegate_task {json.dumps(a)}"
                                            for a in asks)})
    calls = wait_until(lambda: len(c := [e for e in agent_log(agent_log_path)
                                         if e["dir"] == "mcp"]) >= 2 and c, 60)
    assert [c["result"]["code"] for c in calls[-2:]] == [
        "capability_denied", "runtime_mode_escalation_denied"], calls
    assert children(mcp, agent["childThreadId"]) == []
    assert children(mcp, level1["childThreadId"]) == []


def test_dispatch_command_takes_the_seeds_wire_shapes(t3: T3Server) -> None:
    """Fields a T3 client always sends and the server derives itself (attachments, createdBy,
    creationSource, parentNodeId, scopeId) are checked or ignored, never an unknown field."""
    tid = dispatch(t3, {"type": "thread.create", "commandId": "c", "createdBy": "user",
                        "creationSource": "web", "branch": None, "worktreePath": None})["threadId"]
    sent = dispatch(t3, {"type": "message.dispatch", "commandId": "m", "threadId": tid,
                         "messageId": "msg-1", "text": "hello", "attachments": [],
                         "createdBy": "user", "creationSource": "web",
                         "dispatchMode": {"type": "start_immediately"}})
    assert sent["messageId"] == "msg-1"
    ws(t3, "waitForThread", {"threadId": tid})
    for command, code in (
            ({"type": "delegated_task.request", "commandId": "d", "parentThreadId": tid,
              "parentRunId": sent["runId"], "parentNodeId": "node-1", "task": "t",
              "createdBy": "user", "creationSource": "web"}, "parent_not_active"),
            ({"type": "checkpoint.rollback", "commandId": "r", "threadId": tid,
              "scopeId": history.checkpoint_scope_id(tid), "checkpointId": "nope"},
             "invalid_request"),
            ({"type": "message.dispatch", "commandId": "m2", "threadId": tid, "text": "x",
              "createdBy": "agent"}, "invalid_request")):
        with pytest.raises(cli.WsError) as refused:
            ws(t3, "dispatchCommand", command)
        assert refused.value.code == code and "unknown field" not in str(refused.value), (
            command, refused.value)


def test_every_operation_is_reachable_where_the_table_says_with_one_schema(
        t3: T3Server, mcp: McpClient) -> None:
    """tools.OPERATIONS lists every operation once: each MCP one is in tools/list with its
    input schema; each /ws name answers, and both refuse an unknown field by the same schema."""
    ops = tools.OPERATIONS
    listed = {tool.name: tool for tool in mcp.tools()}
    assert sorted(op.name for op in ops if op.mcp) == sorted(listed)
    assert len({op.name for op in ops}) == len(ops)
    ws_names = [name for op in ops for name in op.ws]
    assert len(set(ws_names)) == len(ws_names)
    for op in ops:
        assert op.callers and op.callers <= {"client", "thread"}, op.name
        assert callable(op.handler) and op.handler.__name__ != "<lambda>", op.name
        if op.mcp:
            assert listed[op.name].input_schema == tools.published_input(op), op.name
            failure = mcp.call(op.name, {"zzUnknown": 1}).structured
            assert failure["code"] == "invalid_request" and "zzUnknown: unknown field" in \
                failure["message"], (op.name, failure)
        for name in op.ws:
            with pytest.raises(cli.WsError) as refused:
                ws(t3, name, {"zzUnknown": 1})
            assert refused.value.code == "invalid_request", (name, refused.value)
            assert "zzUnknown: unknown field" in str(refused.value) or \
                op.input_schema.get("anyOf"), (name, refused.value)
