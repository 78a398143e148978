"""Security and limits (issue 10), one section per numbered item of the issue. Each test drives a
real `t3.py` process over real HTTP with the scripted ACP agent: what it creates on disk, what it
refuses to start with, what it answers over HTTP, and what an agent may do with its own
credential (read from the scripted agent's log, where it records the MCP headers t3 gave it),
playing a prompt-injected agent.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import orchestrator as orch
import providers
import registry
from conftest import sqlite_only
from harness import (ACP_AGENT, T3_PY, McpClient, RawResponse, ServerStartError, T3Server,
                     agent_log, pids_alive, protocol_log, raw_post, raw_request, scripted_provider,
                     wait_until, write_config)
from real_cli import text
from test_registry import ArchiveServer, binary_registry, registry_provider, settled
from test_webhooks import CLOCK, PUSH, github, last_sequence, make_hook
from test_ws import StalledReader


def call_line(tool: str, args: dict) -> str:
    return f"CALL_TOOL {tool} {json.dumps(args)}"


def create(mcp: McpClient, prompt: str | None = None, **entry: object) -> dict:
    result = mcp.call("create_threads", {"threads": [
        {**({"prompt": prompt} if prompt else {}), **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: McpClient, thread_id: str, **args: object) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000, **args},
                      timeout=90)
    assert result.ok, result.structured
    return result.structured


def event_count(server: T3Server, thread_id: str) -> int:
    return query(server, "SELECT COUNT(*) FROM events WHERE thread_id = ?", thread_id)[0][0]


def query(server: T3Server, sql: str, *params: object) -> list[tuple]:
    return server.rows(sql, params)


def session_tokens(log_path: Path) -> list[str]:
    """The bearer tokens t3 gave the scripted agent logging to `log_path`, oldest first."""
    tokens = []
    for entry in agent_log(log_path):
        if entry["dir"] == "in" and entry["msg"].get("method") in ("session/new", "session/load") \
                and entry["msg"]["params"].get("mcpServers"):  # not a capabilities probe
            [header] = entry["msg"]["params"]["mcpServers"][0]["headers"]
            tokens.append(header["value"].removeprefix("Bearer "))
    return tokens


def mcp_calls(log_path: Path) -> list[dict]:
    """The MCP tool calls the scripted agent made, as it logged them when each ended."""
    return [e for e in agent_log(log_path) if e["dir"] == "mcp"]


def refused(server: T3Server, caller: McpClient, tool: str, args: dict, code: str, *,
            thread_id: str) -> dict:
    """The call fails with ``code`` and writes nothing to the thread it names (or would make)."""
    before = event_count(server, thread_id)
    result = caller.call(tool, args)
    assert result.failure_code == code, (tool, result.structured)
    assert event_count(server, thread_id) == before, f"{tool} refused with {code} but wrote"
    return result.structured


def tools_list_status(server: T3Server, token: str) -> int:
    return raw_post(server.mcp_url, json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                                "params": {}}).encode(),
                    {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                     "Accept": "application/json, text/event-stream"}).status


def children(mcp: McpClient, parent_id: str) -> list[dict]:
    listed = mcp.call("t3_thread_list", {"includeSubagents": True, "limit": 100}).structured
    return [t for t in listed["threads"] if t["parentThreadId"] == parent_id]


def running(mcp: McpClient, thread_id: str) -> bool:
    return mcp.call("t3_thread_read", {"threadId": thread_id}).structured["thread"][
        "status"] == "running"


# ---- item 1: approval authority


def pending_request(mcp: McpClient, thread_id: str) -> str:
    result = wait(mcp, thread_id)
    assert result["pendingApproval"], result
    return result["pendingApproval"]["requestId"]


def test_only_a_broad_enough_ancestor_answers_an_agents_request(t3_factory, tmp_path: Path
                                                                 ) -> None:
    """The child-approves-parent attack and an unrelated live thread's answer are refused and
    write nothing; an approval-required parent may not approve its child's command; a
    full-access parent may, and the child's activity view says who answered."""
    names = ("parent", "child", "bystander", "boss", "worker")
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id=n) for n in names])
    client = t3.client()
    delegate = {"task": "ASK_PERMISSION", "target": {"providerInstanceId": "child"}}
    parent = create(client, call_line("delegate_task", delegate) + "\nASK_PERMISSION",
                    runtimeMode="approval-required", target={"providerInstanceId": "parent"})
    parent_request = pending_request(client, parent["threadId"])
    [child] = wait_until(lambda: children(client, parent["threadId"]), 30)
    child_request = pending_request(client, child["threadId"])
    bystander = create(client, "SLOW:2000", target={"providerInstanceId": "bystander"})
    wait_until(lambda: running(client, bystander["threadId"]), 30)
    token = {n: session_tokens(tmp_path / f"agent-{n}.log")[-1]
             for n in ("parent", "child", "bystander")}
    attacks = [("child", parent, parent_request), ("bystander", parent, parent_request),
               ("bystander", child, child_request), ("parent", parent, parent_request),
               ("parent", child, child_request)]  # the last: approval-required cannot grant
    for name, target, request_id in attacks:
        agent = McpClient(t3.mcp_url, token[name])
        try:
            refused(t3, agent, "t3_pending_request", {
                "threadId": target["threadId"], "action": "respond", "requestId": request_id,
                "decision": "accept"}, "capability_denied", thread_id=target["threadId"])
        finally:
            agent.close()
    assert pending_request(client, parent["threadId"]) == parent_request
    assert pending_request(client, child["threadId"]) == child_request

    delegate = {"task": "ASK_PERMISSION", "target": {"providerInstanceId": "worker"},
                "runtimeMode": "approval-required"}
    boss = create(client, call_line("delegate_task", delegate) + "\nSLOW:2000",
                  runtimeMode="full-access", target={"providerInstanceId": "boss"})
    [worker] = wait_until(lambda: children(client, boss["threadId"]), 30)
    worker_request = pending_request(client, worker["threadId"])
    wait_until(lambda: running(client, boss["threadId"]), 30)
    agent = McpClient(t3.mcp_url, session_tokens(tmp_path / "agent-boss.log")[-1])
    try:
        answered = agent.call("t3_pending_request", {
            "threadId": worker["threadId"], "action": "respond", "requestId": worker_request,
            "decision": "accept"})
    finally:
        agent.close()
    assert answered.ok, answered.structured
    assert wait(client, worker["threadId"])["status"] == "completed"
    who = {"kind": "thread", "threadId": boss["threadId"]}
    read = client.call("t3_pending_request", {"threadId": worker["threadId"], "action": "read",
                                              "requestId": worker_request}).structured
    assert read["request"]["answeredBy"] == who
    activity = client.call("t3_thread_read", {"threadId": worker["threadId"],
                                              "view": "activity"}).structured["items"]
    assert [i["answeredBy"] for i in activity if "answeredBy" in i] == [who]
    for thread in (parent, bystander, boss):
        client.call("t3_thread_interrupt", {"threadId": thread["threadId"]})


def test_the_mode_an_answer_needs_follows_the_request_kind() -> None:
    """Questions need no mode, file reads and changes auto-accept-edits, commands, MCP and other
    permissions auto (SPEC 5.1a)."""
    assert orch.mode_to_answer("user_input") is None
    assert orch.mode_to_answer("file-change") == orch.mode_to_answer("file-read") \
        == orch.RuntimeMode.AUTO_ACCEPT_EDITS
    for kind in ("command", "permission", "mcp-elicitation", "something-new"):
        assert orch.mode_to_answer(kind) == orch.RuntimeMode.AUTO


# ---- item 2: a private data dir


OWN_PATHS = ["t3.sqlite", "t3.sqlite-wal", "t3.sqlite-shm", "client-token", "server.json", "t3.lock",
             "logs", "backups", "scratch", "worktrees", "agents"]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes_under(root: Path) -> dict[str, int]:
    """`{relative path: mode}` of the root and everything below it (symlinks not followed)."""
    found = {".": mode_of(root)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            found[str(path.relative_to(root))] = mode_of(path)
    return found


def not_private(root: Path) -> dict[str, str]:
    """What under `root` is not 0700 (folders) or 0600 (anything else)."""
    return {name: oct(mode) for name, mode in modes_under(root).items()
            if mode != (0o700 if (root / name).is_dir() else 0o600)}


def refused_start(server: T3Server) -> str:
    """Start `server`, which must refuse: exit code 2 before it is ready. Returns its stderr."""
    with pytest.raises(ServerStartError):
        server.start()
    assert server.returncode == 2, server.stderr_text()
    return server.stderr_text()


def tools_list(server: T3Server, token: str) -> int:
    """The HTTP status of a tools/list call presenting `token`."""
    return raw_post(server.mcp_url, b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}',
                    {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                     "Accept": "application/json"}).status


def test_data_dir_and_everything_in_it_are_private(t3: T3Server) -> None:
    """A fresh data dir is 0700 and every file t3 makes in it 0600, after startup and after
    commits, a provider's traffic log and a scratch workspace."""
    assert not_private(t3.data_dir) == {}
    mcp = t3.client()
    launched = mcp.call("t3_thread_launch", {"message": "hello", "scratch": True}).structured
    done = mcp.call("t3_thread_wait", {"threadId": launched["threadId"], "timeoutMs": 30_000})
    assert done.structured["status"] == "completed"
    names = set(modes_under(t3.data_dir))
    sqlite_files = {"t3.sqlite-wal", "t3.sqlite-shm"} if t3.database is None else set()
    assert {*sqlite_files, "logs/provider-scripted.log.gz"} <= names, names
    assert any(name.startswith("scratch/") for name in names), names
    assert not_private(t3.data_dir) == {}


def test_existing_data_dir_is_tightened(t3_factory, tmp_path: Path) -> None:
    """A data dir left 0755 with 0644 files (an older t3) is tightened at startup, and the
    backup taken before a schema upgrade is 0600 too (SQLite's: t3 makes none of PostgreSQL)."""
    import store
    data = tmp_path / "data"
    (data / "logs").mkdir(parents=True)
    store.apply_migrations(data / "t3.sqlite", backups_dir=data / "backups", stop_after=1)
    (data / "client-token").write_text("A" * 43 + "\n")
    (data / "logs" / "provider-old.log").write_text("old traffic\n")
    for path in [data, *data.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    t3 = t3_factory()
    if t3.database is None:
        assert list((data / "backups").glob("t3-v1-*.sqlite")), "no backup was taken"
    assert not_private(data) == {}
    assert t3.token == "A" * 43


def test_group_writable_data_dir_is_refused(t3_factory, tmp_path: Path) -> None:
    """A data dir others may write to is refused (exit 2, naming it and the fix), untouched."""
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o775)
    err = refused_start(t3_factory(start=False))
    assert f"refusing the data directory {data}" in err and f"chmod 700 {data}" in err
    assert mode_of(data) == 0o775 and list(data.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give the data dir to another user")
def test_data_dir_of_another_user_is_refused(t3_factory, tmp_path: Path) -> None:
    """A data dir owned by another user (nobody) is refused with exit 2, and left untouched."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, 65534, 65534)
    err = refused_start(t3_factory(start=False))
    assert f"refusing the data directory {data}: it belongs to uid 65534" in err
    assert list(data.iterdir()) == []


@pytest.mark.parametrize("name", OWN_PATHS)
def test_symlink_in_data_dir_is_refused(t3_factory, tmp_path: Path, name: str) -> None:
    """A symlink planted for any of t3's own files or folders is refused (exit 2), and what it
    points at is neither read, written nor tightened."""
    data, target = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir(mode=0o700)
    if "." in name or name in ("client-token", "t3.lock"):
        target.write_text("B" * 43 + "\n")
    else:
        target.mkdir()
    target.chmod(0o644 if target.is_file() else 0o755)
    (data / name).symlink_to(target)
    before = modes_under(target) if target.is_dir() else {".": mode_of(target)}
    err = refused_start(t3_factory(start=False))
    assert f"refusing {data / name}: it is a symlink" in err
    assert (modes_under(target) if target.is_dir() else {".": mode_of(target)}) == before
    if target.is_file():
        assert target.read_text() == "B" * 43 + "\n"


@pytest.mark.parametrize("where", ["data-dir", "--config"])
@pytest.mark.parametrize("problem", ["writable by others", "another user's"])
def test_unsafe_config_is_refused(tmp_path: Path, where: str, problem: str) -> None:
    """A t3.toml (in the data dir, or given by --config) that another user wrote or could write
    is refused with exit 2 before the command it names ever runs."""
    if problem == "another user's" and os.geteuid() != 0:
        pytest.skip("only root can give the file to another user")
    data, ran = tmp_path / "data", tmp_path / "ran"
    data.mkdir(mode=0o700)
    config = data / "t3.toml" if where == "data-dir" else tmp_path / "planted.toml"
    config.write_text(f'[[providers]]\nid = "x"\ndriver = "acp"\ncommand = ["touch", "{ran}"]\n')
    if problem == "writable by others":
        config.chmod(0o646)
    else:
        os.chown(config, 65534, 65534)
    args = ["--config", str(config)] if where == "--config" else []
    out = subprocess.run([sys.executable, str(T3_PY), "--port", "0", "--data-dir", str(data), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"refusing the configuration {config}" in out.stderr
    assert not ran.exists()


def test_config_readable_by_others_with_env_warns(t3: T3Server) -> None:
    """A config other users may read that holds provider env values gets a startup warning."""
    assert mode_of(t3.config) & 0o044, "the harness config is expected to be world-readable"
    assert f"{t3.config} holds provider env values and other users may read it" in t3.stderr_text()


def test_config_readable_by_others_with_a_database_password_warns(tmp_path: Path) -> None:
    """A readable config whose `[store] url` carries a password gets the same warning, and the
    password itself is never printed (the database here refuses the connection)."""
    config = write_config(tmp_path, extra='[store]\nurl = "postgresql://t3:hunter2-secret@127.0.0.1:1/t3"\n')
    os.chmod(config, 0o644)
    out = subprocess.run([sys.executable, str(T3_PY), "--port", "0", "--data-dir", str(tmp_path / "data"),
                          "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"{config} holds provider env values and a database password and other users may read " \
        "it" in out.stderr
    assert "hunter2-secret" not in out.stderr + out.stdout


@pytest.mark.parametrize("content", ["", "\n", "short-token", "has spaces " * 5, "é" * 43],
                         ids=["empty", "newline", "short", "spaces", "non-ascii"])
def test_malformed_client_token_is_refused(t3_factory, tmp_path: Path, content: str) -> None:
    """A client-token file that does not hold a well-formed token stops startup (exit 2, saying
    how to fix it), and `t3.py token` prints nothing from it."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "client-token").write_text(content)
    (data / "client-token").chmod(0o600)
    server = t3_factory(start=False)
    assert "python t3.py token --rotate" in refused_start(server)
    printed = server.cli("token")
    assert printed.returncode == 2 and printed.stdout == ""
    assert "python t3.py token --rotate" in printed.stderr


def test_token_rotate_takes_effect_on_the_running_server(t3: T3Server) -> None:
    """`t3.py token --rotate` prints a new 0600 token; the running server refuses the old one
    (401) and accepts the new one from the next request on."""
    old = t3.token
    assert tools_list(t3, old) == 200
    rotated = t3.cli("token", "--rotate")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert new != old and len(new) == 43 and t3.token == new
    assert mode_of(t3.data_dir / "client-token") == 0o600
    assert tools_list(t3, old) == 401
    assert tools_list(t3, new) == 200
    assert t3.cli("token").stdout.strip() == new
    assert old not in t3.stderr_text() and new not in t3.stderr_text()


def test_agents_get_the_users_umask(t3: T3Server, agent_log_path: Path) -> None:
    """t3 keeps its own files private, but an agent creates files with the umask t3 was started
    with (here the agent's JSONL log, which it creates 0644 less that umask)."""
    umask = os.umask(0)
    os.umask(umask)
    if 0o644 & ~umask == 0o600:
        pytest.skip(f"this test runs under umask {umask:03o}: t3's private one looks the same")
    assert t3.client().call("create_threads", {"threads": [{"prompt": "hello"}]}).ok
    wait_until(lambda: agent_log_path.exists(), 30, message="the agent wrote its log")
    assert mode_of(agent_log_path) == 0o644 & ~umask


# ---- item 3: HTTP hardening


def assert_refused(response: RawResponse, status: int, error: str) -> None:
    """A refusal: `status`, a JSON body {"error", "message"}, and the connection closed."""
    assert response.status == status, response
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["error"] == error and isinstance(body["message"], str), body
    assert b"Traceback" not in response.body
    assert response.headers.get("connection") == "close", response.headers


def connect(server: T3Server, head: str = "") -> socket.socket:
    """A connection to the server that has sent `head` (request line and headers, CRLF-ended)."""
    url = urllib.parse.urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    if head:
        sock.sendall(head.replace("\n", "\r\n").encode())
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket timeout: 30 s)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def held_body_head(server: T3Server, *, token: str | None, length: int) -> str:
    """A POST /mcp whose `length`-byte body is announced and not sent. One with a token asks
    `Expect: 100-continue`: its `100 Continue` says the server accepted it and read its headers."""
    port = urllib.parse.urlsplit(server.url).port
    auth = f"Authorization: Bearer {token}\nExpect: 100-continue\n" if token else ""
    return (f"POST /mcp HTTP/1.1\nHost: 127.0.0.1:{port}\n{auth}Content-Type: application/json\n"
            f"Accept: application/json\nContent-Length: {length}\n\n")


def healthz(server: T3Server, **headers: str) -> RawResponse:
    return raw_request("GET", f"{server.url}/healthz", headers=headers, timeout=10)


def serves(server: T3Server) -> bool:
    """Does /healthz answer 200 (a connection turned away may also be reset: False)?"""
    try:
        return healthz(server).status == 200
    except OSError:
        return False


def mcp_post(server: T3Server, **headers: str) -> RawResponse:
    return raw_post(server.mcp_url, b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}',
                    {"Authorization": f"Bearer {server.token}", "Content-Type": "application/json",
                     "Accept": "application/json", **headers}, timeout=10)


@pytest.mark.parametrize("route", ["/healthz", "/mcp", "/nope"])
def test_foreign_origin_is_refused(t3: T3Server, route: str) -> None:
    """A request with an Origin that is not the server's own is 403 on every route (an
    authenticated MCP call included); the server's own origins are accepted."""
    send = mcp_post if route == "/mcp" else lambda s, **h: raw_request(
        "GET", f"{s.url}{route}", headers=h, timeout=10)
    assert_refused(send(t3, Origin="http://evil.example"), 403, "origin_not_allowed")
    assert_refused(send(t3, Origin="null"), 403, "origin_not_allowed")
    port = urllib.parse.urlsplit(t3.url).port
    for own in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"):
        assert send(t3, Origin=own).status == (404 if route == "/nope" else 200), own
    assert "'http://evil.example'" in t3.stderr_text()  # client strings are logged quoted


@pytest.mark.parametrize("route", ["/healthz", "/mcp"])
def test_foreign_host_is_refused(t3: T3Server, route: str) -> None:
    """A Host header that names neither a loopback address nor an allowed host is 403 (DNS
    rebinding), on /healthz as on /mcp; loopback names with or without a port pass."""
    send = mcp_post if route == "/mcp" else healthz
    for foreign in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "[::1]x", ""):
        assert_refused(send(t3, Host=foreign), 403, "host_not_allowed")
    for own in ("127.0.0.1", "localhost:1", "127.9.9.9:80", "[::1]", "[::1]:3773", "LOCALHOST"):
        assert send(t3, Host=own).status == 200, own


def test_request_without_host_is_refused(t3: T3Server) -> None:
    """An HTTP/1.0 request with no Host header at all is 403."""
    sock = connect(t3, "GET /healthz HTTP/1.0\n\n")
    with sock:
        answer = read_to_end(sock)
    assert answer.startswith(b"HTTP/1.1 403") and b'"host_not_allowed"' in answer, answer


def test_allowed_origins_and_hosts_admit_what_they_name(t3_factory) -> None:
    """`[server] allowed_origins` and `allowed_hosts` admit exactly the names they list."""
    t3 = t3_factory(extra='[server]\nallowed_origins = ["https://app.example/"]\n'
                          'allowed_hosts = ["t3.internal", "Box.Lan:8080"]\n')
    assert healthz(t3, Origin="https://app.example").status == 200
    assert mcp_post(t3, Origin="https://app.example").status == 200
    assert healthz(t3, Host="t3.internal:1234").status == 200
    assert healthz(t3, Host="box.lan:8080").status == 200
    assert_refused(healthz(t3, Host="box.lan:8081"), 403, "host_not_allowed")
    assert_refused(healthz(t3, Origin="https://app.example.evil"), 403, "origin_not_allowed")
    assert_refused(healthz(t3, Host="evil.example"), 403, "host_not_allowed")


def test_json_nested_200000_deep_is_a_typed_refusal_on_every_edge(t3_factory) -> None:
    """A body or frame nested 200,000 deep gets a typed answer, never a 500, a traceback or a
    dropped connection: to a webhook 400 invalid_request, writing nothing and taking no place in
    its 60 a minute; on /ws an invalid_request frame, and the connection serves the next
    request; on /mcp a JSON-RPC parse error (400), and as a schedule's JSON string
    invalid_request."""
    from wsproto.events import TextMessage
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    deep = "[" * 200_000 + "]" * 200_000
    made = make_hook(mcp, filters=[{"path": "never", "equals": True}])  # all skipped: fast
    before = last_sequence(t3)
    for kind in ("application/json", "text/plain"):
        answer = raw_post(made["hookUrl"], deep.encode(), {"Content-Type": kind})
        assert_refused(answer, 400, "invalid_request")
    assert last_sequence(t3) == before
    taken = [github(made["hookUrl"], {"n": n}) for n in range(60)]
    assert [r.json()["outcome"] for r in taken] == ["skipped"] * 60, taken[-1]
    assert_refused(github(made["hookUrl"], PUSH), 429, "rate_limited")

    ws = StalledReader(t3)
    with ws.sock:
        ws.sock.sendall(ws.ws.send(TextMessage(data=deep)))
        ws.read_until(lambda: ws.frames)
        assert ws.frames[0]["id"] is None, ws.frames
        assert ws.frames[0]["error"]["code"] == "invalid_request", ws.frames
        ws.send({"id": 1, "method": "listThreads", "params": {}})
        ws.read_until(lambda: len(ws.frames) == 2)
        assert ws.frames[1]["id"] == 1 and "threads" in ws.frames[1]["result"], ws.frames

    answer = raw_post(t3.mcp_url, deep.encode(), {
        "Authorization": f"Bearer {t3.token}", "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream"})
    assert answer.status == 400 and answer.json()["error"]["code"] == -32700, answer
    refused = mcp.call("schedule_task", {"prompt": "p", "title": "t", "schedule": deep})
    assert not refused.ok and refused.structured["code"] == "invalid_request", refused
    assert "Traceback" not in t3.stderr_text()


def test_an_agents_line_nested_200000_deep_is_skipped_and_reading_goes_on(
        tmp_path: Path) -> None:
    """A provider's stdout line nested 200,000 deep is logged as not JSON and dropped, and the
    next line is read as usual (it once raised RecursionError, which ended the reader)."""
    import asyncio
    seen: list[dict] = []

    async def on_message(message: dict) -> None:
        seen.append(message)
    log = providers._ProtocolLog(tmp_path / "provider.log")
    for line in (b"[" * 200_000 + b"]" * 200_000, b'{"jsonrpc": "2.0", "id": 1}'):
        asyncio.run(providers._json_line(line, log, "scripted", on_message))
    log.close()
    assert seen == [{"jsonrpc": "2.0", "id": 1}]


def test_get_mcp_is_405(t3: T3Server) -> None:
    """GET /mcp answers 405 with `Allow: POST, DELETE` (no idle stream is held), with or
    without a token, and keeps the connection: an MCP client asks so once initialized and sends
    its next POST on the same connection (bun's fetch, in opencode, raced a close there and
    lost its tools/list). Other wrong methods get 405 and a closed connection."""
    for headers in ({}, {"Authorization": f"Bearer {t3.token}", "Accept": "text/event-stream"}):
        response = raw_request("GET", t3.mcp_url, headers=headers, timeout=10)
        assert response.status == 405 and response.json()["error"] == "method_not_allowed"
        assert response.headers["allow"] == "POST, DELETE"
    port = urllib.parse.urlsplit(t3.url).port
    body = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
    with connect(t3, f"GET /mcp HTTP/1.1\nHost: 127.0.0.1:{port}\n"
                     f"Authorization: Bearer {t3.token}\n\n") as sock:
        first = b""
        while b"\r\n\r\n" not in first or len(first.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"(?i)content-length: *(\d+)", first).group(1)):  # the whole 405
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 405") and b"connection: close" not in first.lower()
        sock.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer "
                     f"{t3.token}\r\nContent-Type: application/json\r\nAccept: application/json"
                     f"\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        second = read_to_end(sock)
    assert second.startswith(b"HTTP/1.1 200") and b"t3_thread_read" in second, second[:300]
    assert_refused(raw_request("POST", f"{t3.url}/healthz", b"", timeout=10), 405,
                   "method_not_allowed")
    assert_refused(raw_request("GET", f"{t3.url}/nope", timeout=10), 404, "not_found")


def test_401_never_waits_for_the_body(t3: T3Server) -> None:
    """An unauthenticated POST announcing a 10 MB body is answered 401 at once, without one
    byte of it sent, and the connection is closed."""
    started = time.monotonic()
    with connect(t3, held_body_head(t3, token=None, length=10_000_000)) as sock:
        answer = read_to_end(sock)
    assert time.monotonic() - started < 5
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 401") and b"connection: close" in head, answer
    assert b'"invalid_mcp_credential"' in answer


def test_slow_unauthenticated_bodies_do_not_starve_the_server(t3: T3Server) -> None:
    """300 connections announcing 10 MB bodies that trickle in are each answered 401 and closed
    at once, and meanwhile /healthz and an authenticated t3_thread_list answer promptly."""
    head = held_body_head(t3, token=None, length=10_000_000)
    socks = [connect(t3, head + '{"jsonrpc"') for _ in range(300)]
    try:
        answered = [read_to_end(sock) for sock in socks]
        assert all(a.startswith(b"HTTP/1.1 401") for a in answered), \
            {a[:40] for a in answered}
        started = time.monotonic()
        assert healthz(t3).status == 200
        assert t3.client().call("t3_thread_list", {}, timeout=10).ok
        assert time.monotonic() - started < 5
    finally:
        for sock in socks:
            sock.close()


def test_slow_authenticated_body_is_cut_but_long_answers_are_not(t3: T3Server,
                                                                 mcp: McpClient) -> None:
    """An authenticated body that has not arrived BODY_TIMEOUT_S after its headers gets 408
    and a closed connection; a wait streaming its answer for longer is not cut."""
    import t3 as server_module
    limit = server_module.BODY_TIMEOUT_S
    created = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:2000 long"}]}).structured
    thread_id = created["threads"][0]["threadId"]
    waiting = mcp.submit("t3_thread_wait", {"threadId": thread_id,
                                            "timeoutMs": int((limit + 3) * 1000)},
                         timeout=limit + 30)
    with connect(t3, held_body_head(t3, token=t3.token, length=100)) as sock:
        assert sock.recv(100).startswith(b"HTTP/1.1 100")
        started = time.monotonic()
        sock.sendall(b'{"jsonrpc"')
        answer = read_to_end(sock)
    took = time.monotonic() - started
    assert limit - 1 < took < limit + 5, took
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer
    waited = waiting.result(timeout=limit + 30)
    assert waited.ok and waited.structured["timedOut"] is True, waited.structured
    mcp.call("t3_thread_interrupt", {"threadId": thread_id})


def test_connection_cap(t3_factory) -> None:
    """With `max_connections = 4`, a fifth connection is answered 503 and closed while four are
    open, and new connections are served again once they close."""
    t3 = t3_factory(extra="[server]\nmax_connections = 4\n")
    held = [connect(t3, held_body_head(t3, token=t3.token, length=100)) for _ in range(4)]
    try:
        for sock in held:  # each was accepted and counted: the server read its headers
            assert sock.recv(100).startswith(b"HTTP/1.1 100")
        for _ in range(3):
            with connect(t3) as extra:
                answer = read_to_end(extra)
            assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: serves(t3), 10, message="served again")
    assert t3.stderr_text().count("connections open ([server] max_connections)") == 1


def test_an_idle_kept_alive_connection_serves_its_next_request(t3) -> None:
    """A kept-alive connection stays open through 6 s idle and serves the next request: t3 keeps
    idle connections longer than HTTP clients keep theirs (httpx 5 s), so none reuses one that
    the server is closing at that moment (at hypercorn's 5 s, an MCP call now and then failed
    with "Connection closed")."""
    url = urllib.parse.urlsplit(t3.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        for first in (True, False):
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["ok"] is True
            if first:  # the server's close would make the socket readable (EOF): none comes
                assert conn.sock is not None
                assert select.select([conn.sock], [], [], 6.0)[0] == []
    finally:
        conn.close()


def test_accepted_connections_send_without_nagle_delay() -> None:
    """t3's listener hands asyncio connections with TCP_NODELAY set (asyncio sets it only when
    a socket's proto is IPPROTO_TCP, which an accepted plain socket's is not): without it a
    response's body waited behind its headers for the client's delayed ACK, about 40 ms."""
    import t3 as server_module
    listener = server_module._listen("127.0.0.1", 0, cap=4, tls=False)
    with listener, socket.create_connection(listener.getsockname(), timeout=10):
        conn, _ = listener.accept()
        with conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_non_loopback_host_warns_about_clear_text_tokens(t3_factory) -> None:
    """Listening beyond loopback without certfile/keyfile prints a warning on startup."""
    t3 = t3_factory(args=["--host", "0.0.0.0"])
    assert "bearer tokens travel in clear text" in t3.stderr_text()


def test_tls(t3_factory, tmp_path: Path) -> None:
    """With [server] certfile/keyfile, healthz and MCP answer over https and server.json says so."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True, timeout=60)
    t3 = t3_factory(extra='[server]\ncertfile = "cert.pem"\nkeyfile = "key.pem"\n')
    info = json.loads((t3.data_dir / "server.json").read_text())
    assert info["url"].startswith("https://127.0.0.1:") and info["mcpUrl"].startswith("https://")
    context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    with urllib.request.urlopen(f"{info['url']}/healthz", context=context, timeout=10) as answer:
        assert answer.status == 200 and json.loads(answer.read())["ok"] is True
    call = urllib.request.Request(info["mcpUrl"], method="POST", headers={
        "Authorization": f"Bearer {t3.token}", "Content-Type": "application/json",
        "Accept": "application/json"}, data=b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}')
    with urllib.request.urlopen(call, context=context, timeout=10) as answer:
        assert answer.status == 200 and "tools" in json.loads(answer.read())["result"]
    with pytest.raises(OSError):  # plain HTTP on the TLS port is not served
        urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/healthz", timeout=10).read()


# ---- item 4: bounded, unambiguous ids at any depth


def test_a_ten_level_chain_is_addressable_at_every_level(t3_factory) -> None:
    """Ten levels of delegation: every id stays within 160 characters and every thread tool
    answers for every level, including the approval asked at the deepest one."""
    t3 = t3_factory(extra="[limits]\nmax_delegation_depth = 10\n")
    client = t3.client()
    prompt = "ASK_PERMISSION"
    for level in range(10, 0, -1):
        args = {"task": prompt, "title": f"level {level}"}
        if level == 10:
            args["runtimeMode"] = "approval-required"
        prompt = call_line("delegate_task", args)
    chain = [create(client, prompt)["threadId"]]
    for _ in range(10):
        [child] = wait_until(lambda: children(client, chain[-1]), 60)
        chain.append(child["threadId"])
    request_id = pending_request(client, chain[-1])
    ids = [r[0] for table in ("thread", "run", "runtime_request")
           for r in query(t3, f"SELECT {table}_id FROM {table}s")]
    assert max(map(len, ids)) <= orch.MAX_ID_CHARS
    for thread_id in chain:
        for tool, args in [("t3_thread_read", {}), ("t3_thread_wait", {"timeoutMs": 0}),
                           ("t3_pending_request", {"action": "list"}),
                           ("t3_thread_interrupt", {"runId": "no-such-run"})]:
            result = client.call(tool, {"threadId": thread_id, **args})
            assert result.ok or result.failure_code == "run_not_found", (tool, result.structured)
    answered = client.call("t3_pending_request", {"threadId": chain[-1], "action": "respond",
                                                  "requestId": request_id, "decision": "accept"})
    assert answered.ok, answered.structured
    for thread_id in chain:  # each level gets its task's wake, then a message of ours
        sent = client.call("t3_thread_send", {"threadId": thread_id, "message": "still there?",
                                              "mode": "queue"})
        assert sent.ok, sent.structured
        assert wait(client, thread_id, runId=sent.structured["runId"])["status"] == "completed"


def test_tools_never_share_an_id(t3: T3Server, mcp: McpClient) -> None:
    """create_threads with clientRequestId "launch" and t3_thread_launch with "0" make two
    threads, not one thread returned twice."""
    made = mcp.call("create_threads", {"threads": [{"title": "a"}], "clientRequestId": "launch"})
    launched = mcp.call("t3_thread_launch", {"title": "b", "clientRequestId": "0"})
    assert made.ok and launched.ok, (made.structured, launched.structured)
    assert made.structured["threads"][0]["threadId"] != launched.structured["threadId"]
    assert launched.structured["title"] == "b"


# ---- item 5: credentials that last as long as their use


def test_a_long_turn_keeps_its_credential_and_the_next_turn_gets_a_new_one(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """With credential_idle_s = 2, a call 3 s into a 5 s turn works; a call 4 s after the turn
    is refused (the credential ended, for good); the next turn runs in a resumed session whose
    new credential works."""
    t3 = t3_factory(extra="[limits]\ncredential_idle_s = 2\n")
    mcp = t3.client()
    thread = create(mcp, "DELAYED_CALL 3 orchestrator_capabilities {}\n"
                         "DELAYED_CALL 9 orchestrator_capabilities {}\nSLOW:100")
    assert wait(mcp, thread["threadId"])["status"] == "completed"
    calls = wait_until(lambda: len(c := mcp_calls(agent_log_path)) == 2 and c, 30)
    assert [c["httpStatus"] for c in calls] == [200, 401]
    sent = mcp.call("t3_thread_send", {"threadId": thread["threadId"],
                                       "message": "CALL_TOOL orchestrator_capabilities {}"})
    assert wait(mcp, thread["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    calls = mcp_calls(agent_log_path)
    assert [c["httpStatus"] for c in calls] == [200, 401, 200]
    assert calls[2]["result"]["parentThreadId"] == thread["threadId"]
    first, second = session_tokens(agent_log_path)
    assert first != second
    loads = [e for e in agent_log(agent_log_path) if e["dir"] == "in"
             and e["msg"].get("method") == "session/load"]
    assert len(loads) == 1  # the new session resumed the conversation


def test_a_credential_past_half_its_lifetime_is_replaced_at_the_next_turn(
        t3_factory, agent_log_path: Path) -> None:
    """With credential_max_lifetime_s = 4, a turn starting 2.5 s after the first gets a new
    credential in a resumed session, and the old one stops working at once."""
    t3 = t3_factory(extra="[limits]\ncredential_max_lifetime_s = 4\n")
    mcp = t3.client()
    thread = create(mcp, "DELAYED_CALL 2.5 orchestrator_capabilities {}")
    wait_until(lambda: len(mcp_calls(agent_log_path)) == 1, 30)
    [old] = session_tokens(agent_log_path)
    sent = mcp.call("t3_thread_send", {"threadId": thread["threadId"],
                                       "message": "CALL_TOOL orchestrator_capabilities {}"})
    assert wait(mcp, thread["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    assert [c["httpStatus"] for c in mcp_calls(agent_log_path)] == [200, 200]
    assert session_tokens(agent_log_path)[-1] != old
    assert tools_list_status(t3, old) == 401


# ---- item 6: caps on agents


def test_delegation_beyond_the_depth_limit_is_denied(t3_factory, agent_log_path: Path) -> None:
    """With max_delegation_depth = 2, the second level's delegate_task is capability_denied,
    naming the limit, and no third level exists."""
    t3 = t3_factory(extra="[limits]\nmax_delegation_depth = 2\n")
    mcp = t3.client()
    prompt = "hello"
    for level in (3, 2, 1):
        prompt = call_line("delegate_task", {"task": prompt, "title": f"level {level}"})
    root = create(mcp, prompt)
    calls = wait_until(lambda: len(c := mcp_calls(agent_log_path)) == 3 and c, 60)
    denied = [c for c in calls if c["isError"]]
    assert len(denied) == 1 and denied[0]["result"]["code"] == "capability_denied", calls
    assert "max_delegation_depth = 2" in denied[0]["result"]["message"]
    [level1] = children(mcp, root["threadId"])
    [level2] = children(mcp, level1["threadId"])
    assert children(mcp, level2["threadId"]) == []


def agent_processes(data_dir: Path) -> int:
    """Live processes carrying this server's exact T3_OWNER entry: its agents."""
    needle = f"\0T3_OWNER={data_dir}\0".encode()
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in b"\0" + (entry / "environ").read_bytes():
                    count += 1
            except OSError:
                pass
    return count


def test_forty_children_with_four_slots_all_complete(t3_factory, tmp_path: Path) -> None:
    """An agent delegates 40 children with max_live_agent_processes = 4: never more than 4
    agent processes are alive, runs beyond the cap wait queued saying why, and all 40 finish."""
    t3 = t3_factory(extra="[limits]\nmax_live_agent_processes = 4\n")
    mcp = t3.client()
    peak, done = [0], threading.Event()

    def sample() -> None:  # a measurement, not a synchronization
        while not done.wait(0.01):
            peak[0] = max(peak[0], agent_processes(t3.data_dir))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        lines = [call_line("delegate_task", {"task": "SLOW:6 child", "title": f"c{i}",
                                             "clientRequestId": f"c{i}"}) for i in range(40)]
        parent = create(mcp, "\n".join(lines))

        def finished() -> bool:
            kids = children(mcp, parent["threadId"])
            return len(kids) == 40 and all(k["status"] == "completed" for k in kids)
        wait_until(finished, 180)
        wait_until(lambda: wait(mcp, parent["threadId"], timeoutMs=0)["status"] == "completed"
                   and len(query(t3, "SELECT run_id FROM runs WHERE thread_id = ?",
                                 parent["threadId"])) == 41, 120)
    finally:
        done.set()
        sampler.join()
    assert 1 <= peak[0] <= 4, peak
    reasons = query(t3, "SELECT COUNT(*) FROM events WHERE type = 'run.updated' AND "
                        "payload_json LIKE '%max_live_agent_processes = 4%'")
    assert reasons[0][0] > 0  # some runs waited, and said why


# ---- item 7: agents' environment

# t3's own variables, as a server started by someone who uses them (or a test) has them.
T3_OWN = {"T3_HOME": "/t3/home/elsewhere", "T3_TEST_HOOKS": "1", "T3_CRASH_AT": "never:reached",
          "T3_MAX_PAGE_COUNT": "1000000", "T3_MCP_URL": "http://127.0.0.1:9/not-this-session",
          "T3_MCP_BEARER_TOKEN": "not-this-session", "T3_OWNER": "/not/this/owner",
          "T3_SERVER_PID": "1", "T3_THREAD_ID": "not-this-thread", "T3_PORTABLE_PROCESSES": "1"}
NEVER_PASSED_ON = ("T3_HOME", "T3_TEST_HOOKS", "T3_CRASH_AT", "T3_MAX_PAGE_COUNT", "T3_MCP_URL",
                   "T3_MCP_BEARER_TOKEN", "T3_PORTABLE_PROCESSES")


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process started with, from /proc."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def fake_npm(tmp_path: Path, body: str) -> dict[str, str]:
    """An `npm` first on PATH that runs the Python `body` (its environment dump goes to the file
    `dump`); the server environment that makes t3 find it."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    npm = bin_dir / "npm"
    npm.write_text(f"#!{sys.executable}\nimport json, os, sys\ndump = {str(tmp_path / 'npm-env.json')!r}\n"
                   + body)
    npm.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def npx_registry(tmp_path: Path) -> Path:
    path = tmp_path / "npx-registry.json"
    path.write_text(json.dumps({"version": "1.0.0", "agents": [
        {"id": "npx-agent", "name": "Npx agent", "version": "1.0.0", "description": "via npm",
         "distribution": {"npx": {"package": "@example/npx-agent-acp"}}}]}))
    return path


@pytest.fixture
def bystanders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts outside any server (each in its own session); killed and reaped
    at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(10)


def test_agent_environment_lacks_t3_variables_and_has_the_instance_env(t3_factory: Any,
                                                                         tmp_path: Path) -> None:
    """An agent gets none of t3's variables from the server's environment, and its instance env and session marker."""
    provider = scripted_provider(tmp_path, env={"INSTANCE_ONLY": "from-config"})
    t3 = t3_factory(providers=[provider], env=T3_OWN)
    mcp = t3.client()
    created = create(mcp, "ECHO_ENV")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    env = json.loads(text(mcp, created["threadId"]))
    assert [name for name in NEVER_PASSED_ON if name in env] == []
    assert env["T3_OWNER"] == str(t3.data_dir.resolve())
    assert env["T3_SERVER_PID"] == str(t3.pid)
    assert env["T3_THREAD_ID"] == created["threadId"]
    assert env["INSTANCE_ONLY"] == "from-config"
    assert env["T3_TEST_SESSION"] == os.environ["T3_TEST_SESSION"]
    assert env["T3_TEST_MARKER"] == t3.env["T3_TEST_MARKER"]


def test_installer_environment_lacks_t3_variables(t3_factory: Any, tmp_path: Path) -> None:
    """npm, run by acpRegistry, gets none of t3's variables from the server's environment, and the owner marker."""
    env = {**T3_OWN, **fake_npm(tmp_path, "open(dump, 'w').write(json.dumps(dict(os.environ)))\n"
                                          "sys.exit(1)\n")}
    t3 = t3_factory(providers=[registry_provider(npx_registry(tmp_path), agent="npx-agent")],
                    env=env)
    [reason] = settled(t3.client())["constraints"]
    assert "exited with code 1" in reason, reason
    installer_env = json.loads((tmp_path / "npm-env.json").read_text())
    assert [name for name in NEVER_PASSED_ON if name in installer_env] == []
    assert installer_env["T3_OWNER"] == str(t3.data_dir.resolve())
    assert installer_env["T3_SERVER_PID"] == str(t3.pid)
    assert installer_env["T3_TEST_SESSION"] == os.environ["T3_TEST_SESSION"]


def test_a_bystander_naming_the_owner_survives_a_restart(t3_factory: Any, agent_log_path: Path,
                                                         bystanders: list[subprocess.Popen[bytes]]) -> None:
    """A restart kills an orphan with the entry T3_OWNER=<dir>, not a bystander with FOO=T3_OWNER=<dir>
    (the Linux path's sweep: what left its agent's process group is found by its environment)."""
    t3 = t3_factory(env={"T3_PORTABLE_PROCESSES": "0"})
    mcp = t3.client()
    created = create(mcp, "DETACH")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    [orphan] = [e["detachedPid"] for e in agent_log(agent_log_path) if e["dir"] == "detached"]
    owner = environ_of(orphan)["T3_OWNER"]
    assert owner == str(t3.data_dir.resolve())
    bystander = subprocess.Popen(["sleep", "300"], env={**os.environ, "FOO": f"T3_OWNER={owner}"},
                                 start_new_session=True)
    bystanders.append(bystander)
    t3.stop()
    assert pids_alive([orphan]), "the orphan outlived its server (so only the restart can kill it)"
    t3.start()
    wait_until(lambda: not pids_alive([orphan]), 10, message="the restart killed the orphan")
    assert bystander.poll() is None and pids_alive([bystander.pid])


def test_test_hooks_do_nothing_without_the_switch(t3_factory: Any) -> None:
    """T3_CRASH_AT and T3_MAX_PAGE_COUNT do nothing without T3_TEST_HOOKS=1; with it the crash happens."""
    t3 = t3_factory(env={"T3_CRASH_AT": "commit:after-receipt", "T3_MAX_PAGE_COUNT": "1"},
                    start=False)
    t3.env.pop("T3_TEST_HOOKS", None)
    t3.start()
    mcp = t3.client()
    created = create(mcp, "hello")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "big " * 25_000})
    assert sent.ok, sent.structured
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert t3.running

    t3.stop()
    t3.env["T3_TEST_HOOKS"] = "1"
    t3.env.pop("T3_MAX_PAGE_COUNT")
    t3.start()
    try:
        mcp.call("create_threads", {"threads": [{"prompt": "never recorded"}]}, timeout=30)
    except Exception:  # the server died mid-call; what the client sees varies by SDK layer
        pass
    wait_until(lambda: not t3.running, 30, message="the armed server crashed at its first commit")
    assert t3.returncode == -signal.SIGKILL


# ---- item 8: redaction

SECRET = "sk-9f8e7d6c5b4a"
R = "<redacted>"
# (a line as a provider, an installer or t3 itself may write it, the line redacted); None: the
# line with only SECRET replaced, so everything around it is kept as it was.
REDACTED_FORMS = [
    (f"stderr: using Bearer {SECRET} for the call", None),
    (f"bearer {SECRET}", None),
    (f"BEARER {SECRET}, then more", None),
    (f"GET /mcp?auth=Bearer%20{SECRET} HTTP/1.1", None),
    (f"GET /mcp?auth=Bearer+{SECRET}&x=1 HTTP/1.1", None),
    (f'{{"text":"Bearer\\u0020{SECRET}"}}', None),
    (f"Authorization: Basic {SECRET}", None),
    (f"authorization: bearer {SECRET}", None),
    (f"AUTHORIZATION: Digest {SECRET}", None),
    (f"Proxy-Authorization: {SECRET}", None),
    (f"X-Api-Key: {SECRET}", None),
    (f"T3_MCP_BEARER_TOKEN={SECRET} pi --mode rpc", None),
    (f'export T3_MCP_BEARER_TOKEN="{SECRET}"', None),
    (f"npm ERR! //registry.example/:_authToken={SECRET}", None),
    (f"https://example.test/cb?access_token={SECRET}&state=1", None),
    (f'{{"env":{{"T3_MCP_BEARER_TOKEN":"{SECRET}","HOME":"/h"}}}}', None),
    (f'{{"token":"{SECRET}"}}', None),
    (f'{{"bearer_token": "{SECRET}"}}', None),
    (f'{{"apiKey":"{SECRET}","model":"m"}}', None),
    (f'{{"api_key":"{SECRET}"}}', None),
    (f'{{"X-API-KEY":"{SECRET}"}}', None),
    (f'{{"password":"{SECRET}","user":"u"}}', None),
    (f'{{"client_secret" : "{SECRET}"}}', None),
    (f"{{'api_key': '{SECRET}'}}", None),
    (f'{{"headers":{{"Authorization":"Bearer {SECRET}"}}}}', f'{{"headers":{{"Authorization":"{R}"}}}}'),
    (f'{{"authorization":"Basic {SECRET}"}}', f'{{"authorization":"{R}"}}'),
    (f'{{"headers":[{{"name":"Authorization","value":"Basic {SECRET}"}}]}}',
     f'{{"headers":[{{"name":"Authorization","value":"{R}"}}]}}'),
    (f'{{"headers":[{{"name":"x-api-key","value":"{SECRET}"}}]}}', None),
    (f'{{"rawInput":"{{\\"Authorization\\": \\"Basic {SECRET}\\"}}"}}',
     f'{{"rawInput":"{{\\"Authorization\\": \\"{R}\\"}}"}}'),
    (f'{{"rawInput":"{{\\"token\\":\\"{SECRET}\\"}}"}}', None),
    (f'{{"text":"curl -H \\"Authorization: Bearer {SECRET}\\" http://x"}}', None),
    (f'{{"password":"{SECRET}', None),  # a line cut short inside the value
    (f"İİ ünïcode before Bearer {SECRET} and after", None),  # lower() would change the length
]
KEPT = ['{"max_tokens": 100, "input_tokens": 5, "tokenizer": "bpe"}', "max_tokens=100",
        "if token == expected:", '{"token_type":"Bearer","expires_in":3600}',
        "the cupbearer keeps bearer_tokens", '{"name":"color","value":"red"}',
        '{"passwordless":"yes","keyboard":"us"}', "a key point about secrets and passwords",
        '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"1 "}}']


@pytest.mark.parametrize("line, redacted", REDACTED_FORMS, ids=range(len(REDACTED_FORMS)))
def test_redact_blanks_every_form_of_a_secret_and_keeps_the_rest(line: str, redacted: str | None) -> None:
    """Each form of a credential is blanked out and the text around it is kept exactly."""
    assert providers.redact(line) == (redacted or line.replace(SECRET, R))
    assert SECRET not in providers.redact(line)


@pytest.mark.parametrize("line", KEPT)
def test_redact_keeps_lines_without_a_secret(line: str) -> None:
    """Lines that only mention secret-like words (token counts, a token type) come out unchanged."""
    assert providers.redact(line) == line


def test_what_providers_logs_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """What providers.py's logger logs (an agent's error text) is redacted before any handler sees it."""
    with caplog.at_level(logging.INFO, logger="t3.providers"):
        providers.log.warning("session/load of %s failed (%s)", "s-1",
                              f"rejected header Authorization: Bearer {SECRET}")
    assert "rejected header Authorization: Bearer <redacted>" in caplog.text
    assert SECRET not in caplog.text


def test_an_installers_secret_is_redacted_in_the_reason_and_the_logs(t3_factory: Any,
                                                                     tmp_path: Path) -> None:
    """Credentials in npm's output are blanked in the instance's reason, the server log and the traffic log."""
    body = (f"print('npm ERR! //registry.example/:_authToken={SECRET}', file=sys.stderr)\n"
            f"print('npm ERR! Authorization: Bearer {SECRET}', file=sys.stderr)\nsys.exit(1)\n")
    t3 = t3_factory(providers=[registry_provider(npx_registry(tmp_path), agent="npx-agent")],
                    env=fake_npm(tmp_path, body))
    [reason] = settled(t3.client())["constraints"]
    assert "_authToken=<redacted>" in reason and "Authorization: Bearer <redacted>" in reason
    traffic = t3.data_dir / "logs" / "provider-reg.log.gz"
    wait_until(lambda: "Bearer <redacted>" in protocol_log(traffic), 10, message="traffic logged")
    wait_until(lambda: "provider reg unavailable" in t3.stderr_text(), 10, message="logged")
    assert SECRET not in reason + protocol_log(traffic) + t3.stderr_text()


# ---- item 9: acpRegistry

ELSEWHERE = "http://192.0.2.1"  # TEST-NET-1: not this machine; refused before any connection


@pytest.fixture
def archive_server() -> Iterator[ArchiveServer]:
    server = ArchiveServer()
    yield server
    server.close()


def constraints_once_prepared(mcp: Any, instance_id: str) -> list[str]:
    """An instance's constraints once its preparation ended ([] when it is ready)."""
    def ended() -> tuple[list[str]] | None:
        found = next(p for p in mcp.call("orchestrator_capabilities", {}).structured["providers"]
                     if p["providerInstanceId"] == instance_id)
        done = not any(c.startswith("preparing") for c in found["constraints"])
        return (found["constraints"],) if done else None
    return wait_until(ended, 120, interval=0.2, message=f"{instance_id} prepared")[0]


@pytest.mark.parametrize("url, refused", [
    ("https://cdn.example/registry.json", False), ("http://127.0.0.1:8080/r.json", False),
    ("http://127.3.4.5/a.tar.gz", False), ("http://[::1]:8080/a.zip", False),
    ("http://localhost:8080/r.json", False), (f"{ELSEWHERE}/r.json", True),
    ("http://example.com/r.json", True), ("http://127.0.0.1.example.com/r.json", True),
    ("http://user@127.0.0.1@example.com/r.json", True), ("http://[::ffff:127.0.0.1]/r.json", True),
    ("http://0.0.0.0/r.json", True), ("ftp://127.0.0.1/r.json", True), ("file:///etc/hosts", True),
    ("https:///no-host", True)])
def test_downloads_need_https_or_loopback_http(url: str, refused: bool) -> None:
    """The download rule: https anywhere, plain http only to 127.0.0.0/8, ::1 or localhost."""
    assert registry._insecure(url) is refused


def test_a_registry_over_http_from_another_host_is_refused(t3_factory: Any) -> None:
    """A registry URL with plain http to another host is refused, unfetched, as the instance's reason."""
    mcp = t3_factory(providers=[registry_provider(f"{ELSEWHERE}/registry.json")]).client()
    [reason] = settled(mcp)["constraints"]
    assert reason.startswith(f"the ACP registry {ELSEWHERE}/registry.json is refused: t3 "
                             "downloads over https only"), reason


def test_an_archive_over_http_from_another_host_is_refused(t3_factory: Any, tmp_path: Path,
                                                           archive_server: ArchiveServer) -> None:
    """An archive with plain http to another host is refused naming the field; nothing is downloaded."""
    url = f"{ELSEWHERE}/scripted.tar.gz"
    registry = binary_registry(tmp_path, archive_server, archive_url=url)
    t3 = t3_factory(providers=[registry_provider(registry)])
    [reason] = settled(t3.client())["constraints"]
    assert f".archive: '{url}' is refused: t3 downloads over https only" in reason, reason
    assert archive_server.requests == {}
    assert not (t3.data_dir / "agents/registry/bin").exists()


def test_a_redirect_to_plain_http_elsewhere_is_refused(t3_factory: Any, tmp_path: Path,
                                                       archive_server: ArchiveServer) -> None:
    """A redirect from loopback to plain http elsewhere is refused; one staying on loopback is followed."""
    away, home = tmp_path / "away", tmp_path / "home"
    away.mkdir()
    home.mkdir()
    archive_server.redirects["/away.tar.gz"] = f"{ELSEWHERE}/scripted.tar.gz"
    archive_server.redirects["/home.tar.gz"] = archive_server.url("/scripted.tar.gz")
    refused = binary_registry(away, archive_server, archive_url=archive_server.url("/away.tar.gz"))
    followed = binary_registry(home, archive_server, archive_url=archive_server.url("/home.tar.gz"))
    # Two servers on two data dirs: instances of one agent version share its cache, so one
    # server's install would be reused by the other instance.
    mcp = t3_factory(providers=[registry_provider(refused)]).client()
    [reason] = constraints_once_prepared(mcp, "reg")
    assert f"redirects to {ELSEWHERE}/scripted.tar.gz, refused: t3 downloads over https only" \
        in reason, reason
    mcp = t3_factory(providers=[registry_provider(followed)], data_dir=tmp_path / "data2").client()
    assert constraints_once_prepared(mcp, "reg") == []


def test_a_redirect_never_goes_from_https_down_to_http() -> None:
    """From https, a redirect to plain http is refused even to loopback; to https it is followed."""
    guard, request = registry._RedirectGuard(), urllib.request.Request("https://cdn.example/r")
    with pytest.raises(registry.RegistryError, match="redirects to http://127.0.0.1/r, refused"):
        guard.redirect_request(request, None, 302, "Found", {}, "http://127.0.0.1/r")
    followed = guard.redirect_request(request, None, 302, "Found", {}, "https://mirror.example/r")
    assert followed is not None and followed.full_url == "https://mirror.example/r"


def test_a_binary_without_sha256_is_refused(t3_factory: Any, tmp_path: Path,
                                            archive_server: ArchiveServer) -> None:
    """A binary distribution without a declared sha256 is refused, naming allow_unverified, undownloaded."""
    registry = binary_registry(tmp_path, archive_server, with_sha256=False)
    [reason] = settled(t3_factory(providers=[registry_provider(registry)]).client())["constraints"]
    assert ".sha256: is not declared" in reason and "allow_unverified = true" in reason, reason
    assert archive_server.requests == {}


def test_allow_unverified_admits_a_binary_without_sha256(t3_factory: Any, tmp_path: Path,
                                                         archive_server: ArchiveServer) -> None:
    """With allow_unverified = true a binary without sha256 is installed (logged) and the instance runs."""
    registry = binary_registry(tmp_path, archive_server, with_sha256=False)
    t3 = t3_factory(providers=[registry_provider(registry, allow_unverified=True)])
    ready = settled(t3.client())
    assert ready["canRunChildTask"] and ready["constraints"] == [], ready
    assert archive_server.requests == {"/scripted.tar.gz": 1}
    wait_until(lambda: "unverified" in t3.stderr_text(), 10, message="the install was logged")


def test_a_local_command_needs_no_sha256(t3_factory: Any, tmp_path: Path,
                                         archive_server: ArchiveServer) -> None:
    """An instance with its own command downloads nothing, so a missing sha256 does not stop it."""
    registry = binary_registry(tmp_path, archive_server, with_sha256=False)
    provider = registry_provider(registry, command=[sys.executable, str(ACP_AGENT)])
    ready = settled(t3_factory(providers=[provider]).client())
    assert ready["canRunChildTask"] and ready["constraints"] == [], ready
    assert archive_server.requests == {}


# ---- item 10: the small ones


def test_scratch_is_not_a_project_to_create_in(t3: T3Server, mcp: McpClient) -> None:
    """projectId "scratch" without scratch: true is refused by both creating tools and writes
    nothing; listing the scratch threads still works."""
    for tool, args in [("t3_thread_launch", {"projectId": "scratch", "message": "x"}),
                       ("create_threads", {"projectId": "scratch",
                                           "threads": [{"prompt": "x"}]})]:
        before = query(t3, "SELECT COUNT(*) FROM events")
        assert mcp.call(tool, args).failure_code == "invalid_request"
        assert query(t3, "SELECT COUNT(*) FROM events") == before
    assert mcp.call("t3_thread_list", {"projectId": "scratch"}).ok


@sqlite_only("the full disk is SQLite's max_page_count (the T3_MAX_PAGE_COUNT test hook)")
def test_a_failed_scratch_launch_leaves_no_folder(t3: T3Server, mcp: McpClient) -> None:
    """A scratch launch that cannot be recorded (a full disk) removes the folder it made."""
    t3.stop()
    t3.env.update({"T3_MAX_PAGE_COUNT": "1", "T3_TEST_HOOKS": "1"})
    t3.start()
    failed = mcp.call("t3_thread_launch", {"scratch": True, "message": "big " * 25_000})
    assert failed.failure_code == "orchestration_error", failed.structured
    assert list((t3.data_dir / "scratch").iterdir()) == []


def test_client_strings_cannot_forge_a_log_line(t3: T3Server) -> None:
    """A request path carrying a newline is logged quoted (repr), so it cannot start a line of
    its own in the server's log."""
    forged = "FORGED-LINE t3: everything is fine"
    url = t3.url + "/x%0A" + urllib.parse.quote(forged)
    assert raw_request("GET", url, headers={"Origin": "http://evil.example"}).status == 403
    wait_until(lambda: "FORGED-LINE" in t3.stderr_text(), 10, message="the refusal logged")
    lines = t3.stderr_text().splitlines()
    assert not any(line.startswith("FORGED-LINE") for line in lines)
    assert any("/x\\nFORGED-LINE" in line for line in lines)
