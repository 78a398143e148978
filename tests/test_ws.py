"""The /ws client API (SPEC 8) against a real server: the protocol gate and auth, dispatching
every client command, thread subscriptions that are gap-free from any sequence, the shell stream,
and a subscriber that never reads: cut off with a resubscribe error while the server stays flat.
The client is t3.py's own WsClient (what the CLI uses), except where raw bytes are the point."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import orchestrator
from cli import WsClient, WsError
from harness import T3Server, raw_request, scripted_provider

pytestmark = pytest.mark.both_stores  # .ci/run runs these again on PostgreSQL


def ws(t3: T3Server, body: Callable[[WsClient], Awaitable[Any]]) -> Any:
    """Run ``body`` with a client connected to the server's /ws."""
    async def run() -> Any:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            return await body(client)
    return asyncio.run(run())


def events(t3: T3Server, thread_id: str, after: int = 0) -> list[int]:
    """The stored sequences of a thread's events after ``after``."""
    return [r[0] for r in t3.rows("SELECT sequence FROM events WHERE thread_id = ? AND "
                                  "sequence > ? ORDER BY sequence", (thread_id, after))]


def upgrade(t3: T3Server, target: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """A raw WebSocket upgrade request: the HTTP status and JSON body of the answer."""
    host, port = t3.url.removeprefix("http://").rsplit(":", 1)
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket",
             "Connection: Upgrade", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
             "Sec-WebSocket-Version: 13", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(body) >= length:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


def test_protocol_gate_comes_before_auth_and_auth_before_frames(t3: T3Server) -> None:
    """No protocol or protocol 1: 426 with the exact body, token or not; protocol 2 with a bad
    token: 401; a plain GET: 426 asking for WebSocket."""
    refusal = {"code": "orchestration_protocol_incompatible",
               "message": "Update this client to one that supports orchestration protocol 2.",
               "orchestrationProtocolVersion": 2}
    assert upgrade(t3, "/ws") == (426, refusal)
    assert upgrade(t3, "/ws?orchestrationProtocol=1", {"Authorization": "Bearer x"}) == (
        426, refusal)
    assert upgrade(t3, "/ws", {"x-t3-orchestration-protocol": "1"}) == (426, refusal)
    status, body = upgrade(t3, "/ws?orchestrationProtocol=2&token=wrong")
    assert status == 401 and body["error"] == "invalid_mcp_credential"
    assert upgrade(t3, "/ws", {"x-t3-orchestration-protocol": "2",
                               "Authorization": f"Bearer {t3.token}x"})[0] == 401
    assert upgrade(t3, "/ws", {"Origin": "http://evil.example"})[0] == 403
    assert upgrade(t3, "/nowhere?orchestrationProtocol=2")[0] == 404
    assert raw_request("GET", t3.url + "/ws").status == 426
    with pytest.raises(WsError) as refused:
        ws(T3ServerToken(t3, "not-the-token"), lambda c: c.request("listThreads"))
    assert refused.value.status == 401


class T3ServerToken:
    """A server seen with another token."""

    def __init__(self, t3: T3Server, token: str) -> None:
        self.url, self.token = t3.url, token


def test_dispatch_then_subscribe_after_n_gets_exactly_the_rest(t3: T3Server) -> None:
    """message.dispatch over /ws starts a run recorded as the user's; subscribeThread from N
    replays exactly the stored events after N in order, then the live ones, none twice."""
    async def body(client: WsClient) -> tuple[str, int, list[int]]:
        created = await client.request("dispatchCommand", {
            "type": "thread.create", "commandId": "c1", "title": "over ws",
            "creationSource": "cli"})
        thread_id = created["result"]["threadId"]
        first = await client.request("dispatchCommand", {
            "type": "message.dispatch", "commandId": "c2", "threadId": thread_id,
            "text": "hello"})
        assert (await client.request("waitForThread", {"threadId": thread_id}))[
            "status"] == "completed"
        after = first["sequence"]
        seen: list[int] = []
        stream = client.stream("subscribeThread", {"threadId": thread_id,
                                                   "afterSequence": after})
        async for item in stream:
            if item["kind"] == "synchronized":
                await client.request("sendToThread", {"threadId": thread_id, "message": "SLOW:5"})
            elif item["kind"] == "event":
                assert item["event"]["threadId"] == thread_id
                seen.append(item["sequence"])
                if item["event"]["type"] == "run.updated" and \
                        item["event"]["payload"]["status"] == "completed" and \
                        item["event"]["payload"]["ordinal"] == 2:
                    break
        await stream.aclose()
        return thread_id, after, seen
    thread_id, after, seen = ws(t3, body)
    assert seen == sorted(set(seen)) and seen == events(t3, thread_id, after)[:len(seen)]
    projection = ws(t3, lambda c: c.request("getThreadProjection", {"threadId": thread_id}))
    thread = projection["projection"]["thread"]
    assert (thread["createdBy"], thread["creationSource"]) == ("user", "cli")
    assert [m["createdBy"] for m in projection["projection"]["messages"]
            if m["role"] == "user"] == ["user", "user"]


def test_every_client_command_can_be_dispatched(t3_factory, tmp_path: Path) -> None:
    """A test walks orchestrator.client_commands(): each is accepted over /ws in its wire form;
    the server's own commands are refused."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, chunk_delay=0.05)])

    async def body(client: WsClient) -> set[str]:
        done: set[str] = set()

        async def send(command: dict[str, Any]) -> dict[str, Any]:
            result = await client.request("dispatchCommand", command)
            done.add(command["type"])
            return result["result"]
        parent = (await send({"type": "thread.create", "commandId": "p",
                              "initialMessage": {"text": "SLOW:400"}}))
        pid, prun = parent["threadId"], parent["runId"]
        queued = await send({"type": "message.dispatch", "commandId": "q", "threadId": pid,
                             "text": "later", "dispatchMode": {"type": "queue_after_active"}})
        await send({"type": "queued-run.cancel", "commandId": "qc", "threadId": pid,
                    "runId": queued["runId"]})
        await client.request("waitForThread", {"threadId": pid, "timeoutMs": 0})
        wait_started = await wait_for(client, pid, lambda p: any(
            r["status"] == "running" for r in p["runs"]))
        assert wait_started
        task = await send({"type": "delegated_task.request", "commandId": "d", "parentThreadId":
                           pid, "parentRunId": prun, "task": "ASK_PERMISSION",
                           "runtimeMode": "approval-required"})
        await send({"type": "delegated_task.wake-policy", "commandId": "w",
                    "parentThreadId": pid, "taskId": task["taskId"], "completionWake": "always"})
        child = task["childThreadId"]
        assert await wait_for(client, child, lambda p: any(
            r["status"] == "pending" for r in p["runtimeRequests"]))
        request = (await client.request("listPendingRequests", {"threadId": child}))[
            "requests"][0]
        await send({"type": "runtime-request.respond", "commandId": "r", "threadId": child,
                    "requestId": request["requestId"], "decision": "accept"})
        await send({"type": "delegated_task.cancel", "commandId": "x", "parentThreadId": pid,
                    "taskId": task["taskId"]})
        await send({"type": "run.interrupt", "commandId": "i", "threadId": pid, "runId": prun})
        await send({"type": "thread.stop", "commandId": "s", "threadId": pid})
        await send({"type": "thread.resume", "commandId": "u", "threadId": pid})
        idle = (await send({"type": "thread.create", "commandId": "l"}))["threadId"]
        switched = await send({"type": "provider.switch", "commandId": "ps", "threadId": idle,
                               "modelSelection": {"instanceId": "scripted",
                                                  "model": "scripted-2"}})
        assert (switched["model"], switched["previous"]["model"]) == ("scripted-2", "scripted-1")
        for kind, extra in (("thread.snooze", {"snoozedUntil": "2099-01-01T00:00:00Z"}),
                            ("thread.unsnooze", {}), ("thread.visit", {}), ("thread.archive", {}),
                            ("thread.unarchive", {}), ("thread.delete", {})):
            await send({"type": kind, "commandId": kind, "threadId": idle, **extra})
        for internal in ("provider.ingest", "thread.recover", "run.fail"):
            with pytest.raises(WsError) as refused:
                await client.request("dispatchCommand", {"type": internal, "commandId": "z"})
            assert refused.value.code == "invalid_request"
        return done
    # checkpoint.rollback needs a git checkpoint: test_rollback dispatches it in its wire form
    assert ws(t3, body) | {"checkpoint.rollback"} == set(orchestrator.client_commands())


async def wait_for(client: WsClient, thread_id: str,
                   done: Callable[[dict[str, Any]], bool]) -> bool:
    """Follow the thread's stream until its projection (snapshot, then events applied as
    entities) satisfies ``done``."""
    stream = client.stream("subscribeThread", {"threadId": thread_id})
    projection: dict[str, Any] = {}
    keys = {"run": "runs", "runtime-request": "runtimeRequests"}
    async for item in stream:
        if item["kind"] == "snapshot":
            projection = item["projection"]
        elif item["kind"] == "event":
            kind = item["event"]["type"].split(".")[0]
            if kind in keys:
                entity = item["event"]["payload"]
                projection[keys[kind]] = [e for e in projection[keys[kind]]
                                          if e["id"] != entity["id"]] + [entity]
        if projection and done(projection):
            await stream.aclose()
            return True
    return False


def test_shell_stream_shows_threads_as_they_change(t3: T3Server) -> None:
    """subscribeShell: a snapshot of projects and threads, synchronized, then the shell of a
    thread each time it changes, with its status. Bad parameters (its, and listPendingRequests')
    are refused as invalid_request."""
    async def refused(client: WsClient, method: str, params: dict[str, Any]) -> str:
        async def drain() -> None:
            async for _ in client.stream(method, params):
                pass
        with pytest.raises(WsError) as failure:  # an accepted stream runs into the timeout
            await asyncio.wait_for(drain() if method == "subscribeShell"
                                   else client.request(method, params), 10)
        return failure.value.code

    async def body(client: WsClient) -> list[str]:
        for method, params in (("subscribeShell", {"afterSequence": "7"}),
                               ("subscribeShell", {"afterSequence": -1}),
                               ("subscribeShell", {"afterSequence": True}),
                               ("listPendingRequests", {"threadId": 5}),
                               ("listPendingRequests", {"thread": "x"})):
            assert await refused(client, method, params) == "invalid_request", (method, params)
        statuses: list[str] = []
        stream = client.stream("subscribeShell", {})
        async for item in stream:
            if item["kind"] == "snapshot":
                assert [p["projectId"] for p in item["snapshot"]["projects"]] == [
                    "proj", "scratch"]
            elif item["kind"] == "synchronized":
                await client.request("launchThread", {"commandId": "l1", "title": "seen",
                                                      "initialMessage": {"text": "hi"}})
            elif item["kind"] == "thread.updated" and item["thread"]["title"] == "seen":
                statuses.append(item["thread"]["status"])
                if item["thread"]["status"] == "completed":
                    break
        await stream.aclose()
        return statuses
    statuses = ws(t3, body)
    assert statuses[-1] == "completed" and "running" in statuses


def test_schedules_over_ws_are_the_users_and_stream_in_the_shell(t3_factory) -> None:
    """scheduleTask over /ws records createdBy user and its creationSource (cli; web by
    default), and a retry gives the same task; listScheduledTasks equals MCP's list; the shell
    stream carries the tasks in its snapshot, then each change as it commits (a fire after the
    clock moves, a pause, a delete), and again after a given sequence."""
    t3 = t3_factory(env={"T3_TEST_HOOKS": "1", "T3_TEST_CLOCK": "1772816400"})
    mcp = t3.client()
    every = {"type": "interval", "everyMs": 60_000}
    create = {"prompt": "check the build", "title": "nightly", "schedule": every,
              "clientRequestId": "c1", "creationSource": "cli"}

    async def body(client: WsClient) -> dict[str, Any]:
        out: dict[str, Any] = {"seen": [], "refusals": []}
        stream = client.stream("subscribeShell", {})
        out["snapshot"] = (await anext(stream))["snapshot"]
        assert (await anext(stream))["kind"] == "synchronized"
        out["made"] = await client.request("scheduleTask", create)
        out["retried"] = await client.request("scheduleTask", create)
        task_id = out["made"]["scheduledTaskId"]
        await client.request("advanceTestClock", {"seconds": 60})
        out["listed"] = await client.request("listScheduledTasks", {})
        out["mcp_listed"] = mcp.call("list_scheduled_tasks", {}).structured
        out["paused"] = await client.request("scheduleTask", {"scheduledTaskId": task_id,
                                                              "enabled": False})
        # The shell shows a task as it is when the stream sends it: a change the next one
        # overtakes is not shown (on several nodes a commit arrives a moment later), so the
        # pause is read before the delete.
        async for item in stream:
            out["seen"].append(item)
            if item["kind"] == "schedule.updated" and not item["task"]["enabled"]:
                break
        out["deleted"] = await client.request("deleteScheduledTask", {"scheduledTaskId": task_id})
        async for item in stream:
            out["seen"].append(item)
            if item["kind"] == "schedule.removed":
                break
        await stream.aclose()
        for params in ({**create, "creationSource": "mcp"}, {**create, "everyMs": 1},
                       {**create, "schedule": {"type": "interval", "everyMs": 1000}},
                       {"scheduledTaskId": task_id}):
            try:
                await client.request("scheduleTask", params)
            except WsError as exc:
                out["refusals"].append(exc.code)
        again = client.stream("subscribeShell", {"afterSequence": out["seen"][-1]["sequence"] - 1})
        out["replayed"] = []
        async for item in again:
            if item["kind"] == "synchronized":
                break
            out["replayed"].append(item)
        await again.aclose()
        return out
    out = ws(t3, body)
    made, task_id = out["made"], out["made"]["scheduledTaskId"]
    assert out["snapshot"]["schedules"] == [] and out["retried"] == made
    assert task_id == "scheduled-task:cli:client:schedule-task:c1"
    assert (made["createdBy"], made["creationSource"], made["runCount"]) == ("user", "cli", 0)
    [listed] = out["listed"]["tasks"]
    # The fired run may end between the two reads: compare what it does not change.
    settling = {"lastRunStatus", "lastRunError", "lastRunThreadId", "lastRunId", "updatedAt"}
    assert [{k: v for k, v in t.items() if k not in settling} for t in out["listed"]["tasks"]] \
        == [{k: v for k, v in t.items() if k not in settling} for t in out["mcp_listed"]["tasks"]]
    assert listed["runCount"] == 1
    assert (out["paused"]["enabled"], out["paused"]["nextRunAt"]) == (False, None)
    assert out["paused"]["creationSource"] == "cli"  # a change keeps who made it
    assert out["deleted"] == {"scheduledTaskId": task_id, "deleted": True}
    updates = [i["task"] for i in out["seen"] if i["kind"] == "schedule.updated"]
    assert (updates[0]["runCount"], updates[0]["enabled"]) == (0, True)
    assert any(u["runCount"] == 1 for u in updates)  # the fire, live
    assert updates[-1]["enabled"] is False
    assert {"kind": "schedule.removed", "scheduledTaskId": task_id}.items() <= \
        out["seen"][-1].items()
    assert [i["scheduledTaskId"] for i in out["replayed"] if i["kind"] == "schedule.removed"] \
        == [task_id]
    assert out["refusals"] == ["invalid_request"] * 3 + ["task_not_found"]
    by_mcp = mcp.call("schedule_task", {"prompt": "p", "schedule": every}).structured
    assert (by_mcp["createdBy"], by_mcp["creationSource"]) == ("agent", "mcp")
    web = ws(t3, lambda c: c.request("scheduleTask", {"prompt": "p", "schedule": every}))
    assert (web["createdBy"], web["creationSource"]) == ("user", "web")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class StalledReader:
    """A raw WebSocket client (wsproto over a socket) that subscribes and then reads nothing
    until told to: the server's writes to it back up."""

    def __init__(self, t3: T3Server) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import Request
        host, port = t3.url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(self.ws.send(Request(
            host=f"{host}:{port}", target="/ws?orchestrationProtocol=2",
            extra_headers=[(b"authorization", f"Bearer {t3.token}".encode())])))
        self.frames: list[dict[str, Any]] = []
        self._text: list[str] = []
        self.read_until(lambda: self.accepted)

    accepted = False

    def send(self, frame: dict[str, Any]) -> None:
        from wsproto.events import TextMessage
        self.sock.sendall(self.ws.send(TextMessage(data=json.dumps(frame))))

    def read_until(self, done: Callable[[], bool]) -> None:
        from wsproto.events import AcceptConnection, TextMessage
        while not done():
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            self.ws.receive_data(chunk)
            for event in self.ws.events():
                if isinstance(event, AcceptConnection):
                    self.accepted = True
                elif isinstance(event, TextMessage):
                    self._text.append(event.data)
                    if event.message_finished:
                        self.frames.append(json.loads("".join(self._text)))
                        self._text.clear()


def test_a_subscriber_that_never_reads_is_cut_off_and_resumes_without_gaps(
        t3_factory, tmp_path: Path) -> None:
    """A client subscribes, then reads nothing while a thread streams six long answers: its
    stream is cut off, so the server's memory grows with the last four answers' text only, not
    with their events (tens of MB more); reading again, it gets a resubscribe error naming the last sequence sent,
    and resubscribing from the last one received misses nothing."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path)])
    launched = ws(t3, lambda c: c.request("launchThread", {"commandId": "quiet", "title": "q"}))
    thread_id = launched["threadId"]
    reader = StalledReader(t3)
    reader.send({"id": 1, "method": "subscribeThread", "params": {"threadId": thread_id}})
    reader.read_until(lambda: any(f.get("item", {}).get("kind") == "synchronized"
                                  for f in reader.frames))

    async def answer() -> int:
        """One long streamed answer; the server's RSS (KiB) once it is recorded."""
        async with WsClient(t3.url + "/ws", t3.token) as other:
            sent = await other.request("sendToThread", {"threadId": thread_id,
                                                        "message": f"FAST:{n}:400"})
            assert (await other.request("waitForThread", {
                "threadId": thread_id, "runId": sent["runId"]}))["status"] == "completed"
        return rss_kb(t3.pid)
    n = 12_000  # chunks of 400 characters: answers of 4.8 MB
    first = [asyncio.run(answer()) for _ in range(2)][-1]  # the stream is cut off by now
    after_first = event_bytes(t3, thread_id)
    last = [asyncio.run(answer()) for _ in range(4)][-1]
    more = event_bytes(t3, thread_id) - after_first
    # The thread's state keeps the four answers' text (`kept`); held events would grow the
    # server by `more` (about twice that) on top. What the allocator keeps of freed text, and the
    # noise of a loaded machine, stay well below half of `more`.
    kept = 4 * n * 400
    assert more > 16 * 1024 * 1024 and last - first < (kept + more / 2) / 1024, (
        first, last, kept, more)  # KiB
    reader.read_until(lambda: "error" in reader.frames[-1])
    reader.sock.close()
    error = reader.frames[-1]["error"]
    received = [f["item"]["sequence"] for f in reader.frames if f.get("item", {}).get(
        "kind") == "event"]
    assert error["code"] == "resubscribe" and received, error
    assert error["lastSequence"] == received[-1]
    resumed = ws(t3, lambda c: collect_after(c, thread_id, error["lastSequence"]))
    assert received + resumed == events(t3, thread_id, received[0] - 1)


def event_bytes(t3: T3Server, thread_id: str) -> int:
    return t3.rows("SELECT SUM(LENGTH(payload_json)) FROM events WHERE thread_id = ?",
                   (thread_id,))[0][0]


async def collect_after(client: WsClient, thread_id: str, after: int) -> list[int]:
    got: list[int] = []
    stream = client.stream("subscribeThread", {"threadId": thread_id, "afterSequence": after})
    async for item in stream:
        if item["kind"] == "synchronized":
            break
        got.append(item["sequence"])
    await stream.aclose()
    return got


def test_shutdown_does_not_wait_for_a_reader_that_reads_nothing(t3_factory, tmp_path: Path
                                                                ) -> None:
    """SIGTERM with a /ws subscriber that reads nothing (its stream backed up): the server still
    exits 0 within seconds instead of waiting forever to flush what it sent."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path)])
    thread_id = ws(t3, lambda c: c.request("launchThread", {"commandId": "q", "title": "q"}))[
        "threadId"]
    reader = StalledReader(t3)
    reader.send({"id": 1, "method": "subscribeThread", "params": {"threadId": thread_id}})
    reader.read_until(lambda: any(f.get("item", {}).get("kind") == "synchronized"
                                  for f in reader.frames))
    ws(t3, lambda c: c.request("sendToThread", {"threadId": thread_id,
                                                "message": "FAST:200000"}))
    ws(t3, lambda c: c.request("waitForThread", {"threadId": thread_id}))
    started = time.monotonic()
    assert t3.stop(timeout=15) == 0
    assert time.monotonic() - started < 10
    reader.sock.close()
