"""Thread tools end to end: a real `t3.py` process, real SQLite (or PostgreSQL: T3_TEST_STORE), the
scripted ACP agent, MCP over HTTP."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from conftest import sqlite_only
from harness import (T3_PY, McpClient, T3Server, agent_log, count_prompts, protocol_log,
                     raw_post, scripted_provider, wait_until, write_config)

pytestmark = pytest.mark.both_stores  # .ci/run runs these again on PostgreSQL


def event_count(server: T3Server) -> int:
    return server.rows("SELECT COUNT(*) FROM events")[0][0]


def row_counts(server: T3Server) -> dict[str, int]:
    tables = [r[0] for r in server.rows(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        if server.database is not None else
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    return {t: server.rows(f"SELECT COUNT(*) FROM {t}")[0][0] for t in tables}


def create(mcp: McpClient, prompt: str | None = None, **entry: object) -> dict:
    if prompt is not None:
        entry["prompt"] = prompt
    result = mcp.call("create_threads", {"threads": [entry]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def read(mcp: McpClient, thread_id: str, **args: object) -> dict:
    result = mcp.call("t3_thread_read", {"threadId": thread_id, **args})
    assert result.ok, result.structured
    return result.structured


def wait(mcp: McpClient, thread_id: str, **args: object) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 20_000, **args})
    assert result.ok, result.structured
    return result.structured


def assistant_text(mcp: McpClient, thread_id: str) -> str:
    items = read(mcp, thread_id, afterPosition=-1)["items"]
    return "".join(i["text"] or "" for i in items if i["type"] == "assistant_message")


def test_create_wait_read_list(mcp: McpClient, t3: T3Server) -> None:
    """create_threads -> t3_thread_wait completed -> read shows both messages with provenance."""
    created = create(mcp, "hello there", title="Greeting")
    assert created["createdBy"] == "agent" and created["creationSource"] == "mcp"
    assert created["link"] == f"t3-thread://v2/{t3.info['environmentId']}/{created['threadId']}"
    done = wait(mcp, created["threadId"])
    assert done == {**done, "runId": created["runId"], "status": "completed", "timedOut": False}
    page = read(mcp, created["threadId"])
    assert page["thread"]["createdBy"] == "agent" and page["thread"]["creationSource"] == "mcp"
    user, assistant = page["items"]
    assert (user["type"], user["text"], user["createdBy"], user["creationSource"]) == \
        ("user_message", "hello there", "agent", "mcp")
    assert assistant["type"] == "assistant_message"
    assert assistant["text"] == "Hello from scripted agent. You said: hello there"
    assert (assistant["createdBy"], assistant["creationSource"]) == ("agent", "provider")
    listed = mcp.call("t3_thread_list", {}).structured
    assert listed["projectId"] == "proj" and listed["total"] == 1
    assert listed["threads"][0]["threadId"] == created["threadId"]
    assert listed["threads"][0]["status"] == "completed"


def test_list_is_newest_activity_first_page_by_page(mcp: McpClient) -> None:
    """t3_thread_list orders by the latest of creation, a thread's update and its latest run
    (a sent message), and cursor pages of 1 walk that order with the same total."""
    a, b, c = (create(mcp, title=title)["threadId"] for title in ("A", "B", "C"))
    mcp.call("t3_thread_send", {"threadId": a, "message": "wake up"})
    assert wait(mcp, a)["status"] == "completed"
    listed = mcp.call("t3_thread_list", {}).structured
    assert [t["threadId"] for t in listed["threads"]] == [a, c, b]
    assert (listed["total"], listed["nextCursor"]) == (3, None)
    walked, cursor = [], 0
    while cursor is not None:
        page = mcp.call("t3_thread_list", {"cursor": cursor, "limit": 1}).structured
        assert page["total"] == 3 and len(page["threads"]) == 1
        walked += page["threads"]
        cursor = page["nextCursor"]
    assert walked == listed["threads"]
    idle = mcp.call("t3_thread_list", {"statuses": ["idle"], "titleContains": "b"}).structured
    assert ([t["threadId"] for t in idle["threads"]], idle["total"]) == ([b], 1)


def test_idle_thread_without_prompt(mcp: McpClient) -> None:
    """An entry without a prompt creates an idle thread; waiting on it returns at once."""
    created = create(mcp, title="Idle")
    assert (created["runId"], created["status"]) == (None, "idle")
    assert wait(mcp, created["threadId"]) == {
        "threadId": created["threadId"], "runId": None, "status": "idle", "statusReason": None,
        "timedOut": False, "hasPendingQuestion": False, "pendingApproval": None}


def test_send_auto_steers_by_restart(mcp: McpClient, agent_log_path: Path) -> None:
    """mode auto on a running ACP turn restarts it: a second attempt on the same run."""
    created = create(mcp, "SLOW:400 first")
    wait_until(lambda: "chunk 1" in assistant_text(mcp, created["threadId"]), 20)
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"],
                                       "message": "change of plan", "mode": "auto"}).structured
    assert sent["runId"] == created["runId"] and sent["delivery"] == "steered"
    assert wait(mcp, created["threadId"])["status"] == "completed"
    run = read(mcp, created["threadId"])["recentRuns"][0]
    assert run["runId"] == created["runId"] and run["attemptCount"] == 2
    assert "You said: change of plan" in assistant_text(mcp, created["threadId"])
    assert count_prompts(agent_log_path) == 2


def test_send_queue_runs_after_active(mcp: McpClient) -> None:
    """mode queue creates a queued run that starts only after the active run ends."""
    created = create(mcp, "SLOW:8 first")
    queued = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "second",
                                         "mode": "queue"}).structured
    assert queued["delivery"] == "queued" and queued["status"] == "queued"
    assert queued["runId"] != created["runId"]
    assert wait(mcp, created["threadId"], runId=queued["runId"])["status"] == "completed"
    runs = {r["runId"]: r for r in read(mcp, created["threadId"])["recentRuns"]}
    assert runs[created["runId"]]["status"] == "completed"
    assert runs[created["runId"]]["completedAt"] <= runs[queued["runId"]]["startedAt"]
    items = read(mcp, created["threadId"])["items"]
    assert [i["text"] for i in items if i["type"] == "user_message"] == ["SLOW:8 first", "second"]


def test_interrupt_ends_run_interrupted(mcp: McpClient) -> None:
    """t3_thread_interrupt on a streaming run ends it interrupted, with a reason."""
    created = create(mcp, "SLOW:400 long")
    wait_until(lambda: "chunk 0" in assistant_text(mcp, created["threadId"]), 20)
    result = mcp.call("t3_thread_interrupt", {"threadId": created["threadId"],
                                              "reason": "enough"}).structured
    assert result == {"threadId": created["threadId"], "runId": created["runId"],
                      "status": "interrupt_requested"}
    done = wait(mcp, created["threadId"])
    assert done["status"] == "interrupted" and done["statusReason"] == "enough"
    again = mcp.call("t3_thread_interrupt", {"threadId": created["threadId"]}).structured
    assert again["status"] == "no_active_run"
    assert mcp.call("t3_thread_interrupt", {"threadId": created["threadId"],
                                            "runId": created["runId"]}).structured["status"] \
        == "interrupted"


def test_wait_timeout_cancels_nothing(mcp: McpClient) -> None:
    """A short wait returns timedOut with the run still running; the run then completes."""
    created = create(mcp, "SLOW:20 wait for me")
    early = wait(mcp, created["threadId"], timeoutMs=100)
    assert early["timedOut"] is True and early["status"] in ("starting", "running")
    assert wait(mcp, created["threadId"])["status"] == "completed"


def test_permission_request_roundtrip(mcp: McpClient) -> None:
    """A permission request is listed and readable, and answering it lets the turn finish."""
    created = create(mcp, "ASK_PERMISSION please", runtimeMode="approval-required")
    blocked = wait(mcp, created["threadId"])
    assert blocked["timedOut"] is False and blocked["status"] == "running"
    request_id = blocked["pendingApproval"]["requestId"]
    listed = mcp.call("t3_pending_request", {"threadId": created["threadId"],
                                             "action": "list"}).structured
    assert [r["requestId"] for r in listed["requests"]] == [request_id]
    detail = mcp.call("t3_pending_request", {"threadId": created["threadId"], "action": "read",
                                             "requestId": request_id}).structured["request"]
    assert detail["status"] == "pending" and detail["kind"] == "command"
    assert detail["detail"]["toolCall"]["title"] == "Run scripted command"
    answer = mcp.call("t3_pending_request", {"threadId": created["threadId"],
                                             "action": "respond", "requestId": request_id,
                                             "decision": "accept"}).structured
    assert answer["status"] == "resolved"
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "permission granted: allow-once" in assistant_text(mcp, created["threadId"])
    again = mcp.call("t3_pending_request", {"threadId": created["threadId"], "action": "respond",
                                            "requestId": request_id, "decision": "accept"})
    assert again.failure_code == "invalid_request"


def test_permission_decline(mcp: McpClient) -> None:
    """Declining a permission request denies the tool; the turn still completes."""
    created = create(mcp, "ASK_PERMISSION please", runtimeMode="approval-required")
    request_id = wait(mcp, created["threadId"])["pendingApproval"]["requestId"]
    mcp.call("t3_pending_request", {"threadId": created["threadId"], "action": "respond",
                                    "requestId": request_id, "decision": "decline"})
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "permission denied" in assistant_text(mcp, created["threadId"])


def test_full_access_never_asks(mcp: McpClient) -> None:
    """In full-access mode the agent's permission request is granted without a pending request."""
    created = create(mcp, "ASK_PERMISSION please", runtimeMode="full-access")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "permission granted" in assistant_text(mcp, created["threadId"])


def test_client_request_id_is_idempotent(mcp: McpClient, t3: T3Server,
                                         agent_log_path: Path) -> None:
    """The same create_threads / t3_thread_send call with one clientRequestId starts one turn."""
    args = {"threads": [{"prompt": "only once"}], "clientRequestId": "req-1"}
    first = mcp.call("create_threads", args).structured["threads"][0]
    second = mcp.call("create_threads", args).structured["threads"][0]
    assert (first["threadId"], first["runId"]) == (second["threadId"], second["runId"])
    wait(mcp, first["threadId"])
    send = {"threadId": first["threadId"], "message": "follow up", "clientRequestId": "req-2"}
    sent = mcp.call("t3_thread_send", send).structured
    wait(mcp, first["threadId"])
    events = event_count(t3)
    resent = mcp.call("t3_thread_send", send).structured
    assert (resent["runId"], resent["messageId"]) == (sent["runId"], sent["messageId"])
    assert event_count(t3) == events
    assert count_prompts(agent_log_path) == 2
    other = mcp.call("t3_thread_send", {**send, "message": "something else"})
    assert other.failure_code == "invalid_request"
    assert event_count(t3) == events


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic abc"}])
def test_unauthenticated_requests_get_401(t3: T3Server, headers: dict[str, str]) -> None:
    """No or a wrong token: 401 with the SPEC body and headers, and nothing is written."""
    before = row_counts(t3)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "create_threads", "arguments": {"threads": [{"prompt": "x"}]}}}).encode()
    response = raw_post(t3.mcp_url, body, {"Content-Type": "application/json",
                                           "Accept": "application/json, text/event-stream",
                                           **headers})
    assert response.status == 401
    assert response.json()["error"] == "invalid_mcp_credential"
    assert response.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert response.headers["cache-control"] == "no-store"
    assert row_counts(t3) == before
    assert t3.token not in t3.stderr_text()


@pytest.mark.parametrize(("tool", "args", "field"), [
    ("create_threads", {"threads": []}, "threads"),
    ("create_threads", {"threads": [{"prompt": "x", "colour": "red"}]}, "threads[0].colour"),
    ("create_threads", {"threads": [{"prompt": ""}]}, "threads[0].prompt"),
    ("create_threads", {"threads": [{"prompt": "x" * 120_001}]}, "threads[0].prompt"),
    ("create_threads", {"threads": [{"prompt": "x", "runtimeMode": "root"}]},
     "threads[0].runtimeMode"),
    ("t3_thread_send", {"threadId": "t", "message": "x", "mode": "shout"}, "mode"),
    ("t3_thread_send", {"threadId": "t"}, "message"),
    ("t3_thread_read", {"threadId": "t", "limit": 0}, "limit"),
    ("t3_thread_wait", {"threadId": "t", "timeoutMs": 600_001}, "timeoutMs"),
    ("t3_thread_list", {"statuses": ["sleeping"]}, "statuses[0]"),
    ("t3_pending_request", {"threadId": "t", "action": "approve"}, "action"),
])
def test_bad_arguments_are_invalid_request(mcp: McpClient, t3: T3Server, tool: str, args: dict,
                                           field: str) -> None:
    """Bad arguments get invalid_request naming the field, and write nothing."""
    before = row_counts(t3)
    result = mcp.call(tool, args)
    assert result.is_error and result.failure_code == "invalid_request"
    assert result.structured["_tag"] == "OrchestratorMcpFailure"
    assert result.structured["message"].startswith(field + ":")
    assert json.loads(result.text) == result.structured
    assert row_counts(t3) == before


@pytest.mark.parametrize(("tool", "args"), [
    ("t3_thread_read", {}), ("t3_thread_wait", {}), ("t3_thread_interrupt", {}),
    ("t3_thread_send", {"message": "hi"}), ("t3_pending_request", {"action": "list"})])
def test_unknown_thread_is_thread_not_found(mcp: McpClient, t3: T3Server, tool: str,
                                            args: dict) -> None:
    """Every thread tool answers thread_not_found for an unknown thread, writing nothing."""
    before = row_counts(t3)
    result = mcp.call(tool, {"threadId": "thread:nope", **args})
    assert result.is_error and result.failure_code == "thread_not_found"
    assert row_counts(t3) == before


def test_unknown_run_and_provider(mcp: McpClient) -> None:
    """An unknown run is run_not_found; an unknown provider or model is refused before writing."""
    created = create(mcp, title="x")
    assert mcp.call("t3_thread_wait", {"threadId": created["threadId"], "runId": "run:x"}) \
        .failure_code == "run_not_found"
    assert mcp.call("create_threads", {"threads": [{"prompt": "x", "target": {
        "providerInstanceId": "nope"}}]}).failure_code == "provider_unavailable"
    assert mcp.call("create_threads", {"threads": [{"prompt": "x", "target": {
        "model": "gpt-99"}}]}).failure_code == "model_unavailable"


def test_read_pagination_and_budget(mcp: McpClient) -> None:
    """Reads page with both cursors, stop near 30,000 characters and bound long items."""
    created = create(mcp, "FAST:1 a")
    tid = created["threadId"]
    wait(mcp, tid)
    for i in range(4):
        mcp.call("t3_thread_send", {"threadId": tid, "message": f"{i} " + "y" * 7_000})
        wait(mcp, tid)
    positions, cursor, pages = [], -1, 0
    while True:  # every user and assistant text is ~7,000 chars: about 3 fit in one read
        page = read(mcp, tid, afterPosition=cursor, limit=100)
        assert len(json.dumps(page["items"])) < 30_000 + 10_000
        positions += [i["position"] for i in page["items"]]
        cursor, pages = page["nextPosition"], pages + 1
        if not page["hasMore"]:
            break
    assert positions == list(range(10)) and pages >= 3
    newest = read(mcp, tid, limit=2)  # a client caller without a cursor starts at the oldest
    assert [i["position"] for i in newest["items"]] == [0, 1]
    older = read(mcp, tid, beforePosition=9, limit=3)
    assert [i["position"] for i in older["items"]] == [6, 7, 8]
    assert older["earlierPosition"] == 6 and older["hasMore"] is True
    bounded = read(mcp, tid, afterPosition=1, limit=1, maxCharsPerItem=100)["items"][0]
    assert bounded["textTruncated"] is True and len(bounded["text"]) == 100


def test_read_pages_hold_the_whole_result_within_the_budget(mcp: McpClient) -> None:
    """Four 20,000-character messages and their echoes: every read result, envelope and items,
    stays within 30,000 characters, paging either way reaches every item exactly once, and an
    item too big for any page comes cut to fit, saying so."""
    tid = create(mcp, "FAST:1 a")["threadId"]
    wait(mcp, tid)
    for i in range(4):
        mcp.call("t3_thread_send", {"threadId": tid, "message": f"{i} " + "z" * 19_998})
        wait(mcp, tid)

    def page(**args: object) -> dict:
        result = mcp.call("t3_thread_read", {"threadId": tid, "limit": 100, **args})
        assert result.ok and result.text is not None and len(result.text) <= 30_000, \
            len(result.text or "")
        return result.structured
    forward, cursor = [], -1
    while True:
        read_page = page(afterPosition=cursor)
        forward += [i["position"] for i in read_page["items"]]
        cursor = read_page["nextPosition"]
        if not read_page["hasMore"]:
            break
    backward, before = [], 10
    while before is not None:
        read_page = page(beforePosition=before)
        backward = [i["position"] for i in read_page["items"]] + backward
        before = read_page["earlierPosition"]
    assert forward == backward == list(range(10))
    mcp.call("t3_thread_send", {"threadId": tid, "message": "w" * 45_000})
    wait(mcp, tid)
    cut = page(afterPosition=9, maxCharsPerItem=50_000)
    [item] = cut["items"]
    assert item["position"] == 10 and item["textTruncated"] is True and cut["hasMore"] is True
    assert item["text"].startswith("w" * 20_000) and item["text"].endswith("[truncated]")


def test_launch_root_and_scratch(mcp: McpClient, t3: T3Server) -> None:
    """t3_thread_launch runs in the project root or a scratch folder; a strategy that is not
    one of the seed's forms is refused (the worktree ones: tests/test_worktrees.py)."""
    root = mcp.call("t3_thread_launch", {"message": "ECHO_CWD"}).structured
    assert root["workspaceStrategy"] == "root"
    assert wait(mcp, root["threadId"])["status"] == "completed"
    assert assistant_text(mcp, root["threadId"]) == root["workspacePath"]
    scratch = mcp.call("t3_thread_launch", {"message": "ECHO_CWD", "scratch": True}).structured
    assert scratch["projectId"] == "scratch"
    assert Path(scratch["workspacePath"]).is_relative_to(t3.data_dir / "scratch")
    assert wait(mcp, scratch["threadId"])["status"] == "completed"
    assert assistant_text(mcp, scratch["threadId"]) == scratch["workspacePath"]
    refused = mcp.call("t3_thread_launch", {"message": "x", "workspaceStrategy": "worktree"})
    assert refused.failure_code == "invalid_request"


def test_failing_agent_turn_is_failed_with_reason(mcp: McpClient) -> None:
    """An agent that fails the prompt, or dies mid-turn, ends the run failed with its reason."""
    failed = create(mcp, "FAIL now")
    done = wait(mcp, failed["threadId"])
    assert done["status"] == "failed" and "scripted failure" in done["statusReason"]
    crashed = create(mcp, "CRASH now")
    done = wait(mcp, crashed["threadId"])
    assert done["status"] == "failed" and "exit code 3" in done["statusReason"]
    again = mcp.call("t3_thread_send", {"threadId": crashed["threadId"], "message": "hi"})
    assert wait(mcp, crashed["threadId"], runId=again.structured["runId"])["status"] == \
        "completed"


def test_routes(t3: T3Server) -> None:
    """/healthz answers without auth; unknown routes are JSON 404; oversized bodies 413."""
    from harness import raw_request
    health = raw_request("GET", f"{t3.url}/healthz")
    assert health.status == 200
    assert health.json() == {"ok": True, "version": "0.1.0",
                             "environmentId": t3.info["environmentId"]}
    missing = raw_request("GET", f"{t3.url}/nope")
    assert missing.status == 404 and missing.json()["error"] == "not_found"
    huge = raw_post(t3.mcp_url, b"x" * (4 * 1024 * 1024 + 1),
                    {"Authorization": f"Bearer {t3.token}", "Content-Type": "application/json"})
    assert huge.status == 413


def test_second_server_refused(t3: T3Server, t3_factory) -> None:
    """A second server on the same data directory refuses to start and leaves the first running."""
    second = t3_factory(data_dir=t3.data_dir, start=False)
    with pytest.raises(Exception):
        second.start()
    assert "already using" in second.stderr_text()
    assert t3.running


def test_sigterm_shuts_down_cleanly(t3: T3Server, mcp: McpClient) -> None:
    """SIGTERM mid-run: exit 0, server.json removed, the run ends with a reason, no agent left."""
    created = create(mcp, "SLOW:400 busy")
    wait_until(lambda: "chunk 0" in assistant_text(mcp, created["threadId"]), 20)
    assert t3.stop() == 0
    assert not (t3.data_dir / "server.json").exists()
    [(status,)] = t3.rows("SELECT status FROM runs")
    running = t3.rows("SELECT COUNT(*) FROM effect_outbox WHERE status = 'running'")[0][0]
    assert status == "interrupted" and running == 0


def test_token_command_and_invalid_config(tmp_path: Path) -> None:
    """`t3.py token` prints the 0600 token; an invalid config names file, line and key."""
    out = subprocess.run([sys.executable, str(T3_PY), "token", "--data-dir", str(tmp_path / "d")],
                         capture_output=True, text=True, check=True)
    token_file = tmp_path / "d" / "client-token"
    assert out.stdout.strip() == token_file.read_text().strip()
    assert token_file.stat().st_mode & 0o777 == 0o600
    config = write_config(tmp_path, providers=[{**scripted_provider(tmp_path), "driver": "nope"}])
    bad = subprocess.run([sys.executable, str(T3_PY), "--port", "0", "--data-dir",
                          str(tmp_path / "d"), "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    line = next(n for n, text in enumerate(config.read_text().splitlines(), 1)
                if text.startswith("driver"))
    assert f"{config}:{line}: providers[0].driver" in bad.stderr


@pytest.mark.parametrize("model", [{"id": "m", "label": 3}, {"id": "m", "options": "fast"},
                                   {"id": "m", "options": ["fast"]}])
def test_model_tables_are_checked(tmp_path: Path, model: dict) -> None:
    """A configured model whose label is not a string, or whose options are not a list of
    tables, is refused at load: orchestrator_capabilities publishes them under its outputSchema."""
    import t3 as server_module
    config = write_config(tmp_path, providers=[scripted_provider(tmp_path, models=[model])])
    with pytest.raises(server_module.ConfigError, match=r"providers\[0\]\.models"):
        server_module.load_config(config, cwd=tmp_path)
    good = write_config(tmp_path, providers=[scripted_provider(tmp_path, models=[
        {"id": "m", "label": "M", "options": [{"id": "effort", "type": "select"}]}])])
    assert server_module.load_config(good, cwd=tmp_path).providers[0]["models"][0]["label"] == "M"


@pytest.mark.parametrize(("text", "said"), [
    ("limits = 3\n", ":1: limits: must be a table [limits]"),
    ("server = 3\n", ":1: server: must be a table [server]"),
    ("projects = 3\n", ":1: projects: must be tables [[projects]]"),
    ("[server]\nport = true\n", ":2: server.port: must be an integer 0-65535"),
    ("[server]\nmax_connections = false\n", ":2: server.max_connections: must be a positive")])
def test_a_section_or_value_of_the_wrong_kind_is_a_config_error(tmp_path: Path, text: str,
                                                                said: str) -> None:
    """A section that is not a table (or tables), and true or false where a number goes, stop
    the load with the file, line and key, not with a traceback or as 1 and 0."""
    import t3 as server_module
    config = tmp_path / "t3.toml"
    config.write_text(text)
    with pytest.raises(server_module.ConfigError) as refused:
        server_module.load_config(config, cwd=tmp_path)
    assert str(refused.value).startswith(f"{config}{said}"), refused.value


def test_wait_reports_progress(mcp: McpClient) -> None:
    """A wait longer than 5 s sends MCP progress notifications to a client that asked for them."""
    created = create(mcp, "SLOW:130 take a while")
    result = mcp.call_with_progress("t3_thread_wait", {"threadId": created["threadId"],
                                                       "timeoutMs": 30_000})
    assert result.structured["status"] == "completed"
    assert len(result.progress) >= 1


def test_shutdown_ends_waits_with_current_state(t3: T3Server, mcp: McpClient) -> None:
    """SIGTERM during a long wait: the wait returns the run's current state, not an error."""
    created = create(mcp, "SLOW:600 long")
    wait_until(lambda: "chunk 0" in assistant_text(mcp, created["threadId"]), 20)
    pending = mcp.submit("t3_thread_wait", {"threadId": created["threadId"],
                                            "timeoutMs": 120_000})
    read(mcp, created["threadId"])  # a later request answered: the wait is in the server
    assert t3.stop() == 0
    result = pending.result(timeout=30)
    # The wait ended before the run did: like a timeout, the caller polls again later.
    assert result.ok and result.structured["status"] == "running"
    assert result.structured["timedOut"] is True


def test_create_threads_validates_every_entry_first(mcp: McpClient, t3: T3Server) -> None:
    """A batch with one bad entry creates none of its threads."""
    before = row_counts(t3)
    result = mcp.call("create_threads", {"threads": [
        {"prompt": "fine"}, {"prompt": "x", "target": {"providerInstanceId": "nope"}}]})
    assert result.failure_code == "provider_unavailable"
    assert row_counts(t3) == before


def test_legacy_mcp_client(t3: T3Server) -> None:
    """A handshake-era MCP client (initialize, protocol 2025-11-25) gets the same tools."""
    legacy = t3.client(mode="legacy")
    try:
        assert "t3_thread_read" in legacy.list_tools()
        created = legacy.call("create_threads", {"threads": [{"prompt": "hi"}]}).structured
        assert wait(legacy, created["threads"][0]["threadId"])["status"] == "completed"
    finally:
        legacy.close()


@sqlite_only("SQLite's schema version and its backup file (test_store_pg tests PostgreSQL's "
             "migrations, a newer database refused untouched among them)")
def test_database_versions_on_start(t3: T3Server, t3_factory) -> None:
    """An older database is backed up before migrating; a newer one is refused untouched."""
    created = create(t3.client(), "keep me")
    assert t3.stop() == 0
    db_path = t3.data_dir / "t3.sqlite"
    with sqlite3.connect(db_path) as db:  # back to schema 2, as a t3 before sql/0003 left it
        db.execute("DROP INDEX threads_by_activity")
        for column in ("activity_at", "latest_status", "title_folded"):
            db.execute(f"ALTER TABLE threads DROP COLUMN {column}")
        db.execute("CREATE INDEX threads_by_project ON threads (project_id, updated_at)")
        db.execute("PRAGMA user_version = 2")
    t3.restart()
    backups = list((t3.data_dir / "backups").glob("t3-v2-*.sqlite"))
    assert len(backups) == 1
    with sqlite3.connect(backups[0]) as db:
        assert db.execute("SELECT COUNT(*) FROM threads").fetchone()[0] == 1
    listed = t3.client().call("t3_thread_list", {}).structured
    assert listed["total"] == 1 and listed["threads"][0]["threadId"] == created["threadId"]
    assert t3.stop() == 0
    with sqlite3.connect(db_path) as db:
        db.execute("PRAGMA user_version = 99")
    before = db_path.read_bytes()
    with pytest.raises(Exception):
        t3.restart()
    assert "newer than this t3" in t3.stderr_text()
    assert db_path.read_bytes() == before


def test_provider_that_cannot_start_fails_the_run_after_retries(t3_factory, tmp_path: Path
                                                                ) -> None:
    """An agent that dies during its handshake is retried with backoff, then the run fails."""
    broken = {"id": "broken", "driver": "acp", "models": ["m"],
              "command": [sys.executable, "-c", "import sys; sys.exit(7)"]}
    server = t3_factory(providers=[broken])
    client = server.client()
    created = create(client, "hello")
    done = wait(client, created["threadId"])
    assert done["status"] == "failed"
    assert "after 5 attempt(s)" in done["statusReason"]
    [(status, attempts)] = server.rows("SELECT status, attempt_count FROM effect_outbox "
                                       "WHERE effect_type = 'provider-turn.start'")
    assert (status, attempts) == ("failed", 5)


def test_startup_names_each_provider_and_why_it_cannot_run(t3_factory, tmp_path: Path) -> None:
    """Startup prints one stderr line per provider instance (its driver, ready or the reason it
    cannot run) before the ready line, and a hint when no instance can run."""
    missing = {"id": "gone", "driver": "acp", "command": [str(tmp_path / "no-such-agent")]}
    off = {**scripted_provider(tmp_path, id="off"), "enabled": False}
    err = t3_factory(providers=[scripted_provider(tmp_path), missing, off]).stderr_text()
    assert "t3: provider scripted (acp, configured): ready\n" in err
    assert ("t3: provider gone (acp, configured): unavailable: executable not found: "
            f"{tmp_path / 'no-such-agent'}\n") in err
    assert "t3: provider off (acp, configured): unavailable: disabled in the configuration" in err
    assert err.index("provider scripted") < err.index("ready: MCP at")
    assert "no provider instance can run" not in err
    (tmp_path / "empty").mkdir()
    bare = t3_factory(config=write_config(tmp_path, providers=[], name="bare.toml"),
                      data_dir=tmp_path / "bare", env={"PATH": str(tmp_path / "empty")})
    assert "t3: no provider instance can run yet: no agent CLI on PATH (codex, claude, " \
        in bare.stderr_text()
    refused = bare.client().call("create_threads", {"threads": [{"title": "x"}]})
    assert refused.failure_code == "provider_unavailable"


def test_json_only_clients_get_json(t3: T3Server) -> None:
    """A client that accepts only application/json gets a JSON answer, not a 406; one that
    accepts both gets SSE."""
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "t3_thread_list", "arguments": {}}}).encode()
    auth = {"Authorization": f"Bearer {t3.token}", "Content-Type": "application/json",
            "mcp-protocol-version": "2025-06-18"}
    plain = raw_post(t3.mcp_url, body, {**auth, "Accept": "application/json"})
    assert plain.status == 200 and plain.headers["content-type"].startswith("application/json")
    assert plain.json()["result"]["structuredContent"]["projectId"] == "proj"
    sse = raw_post(t3.mcp_url, body, {**auth, "Accept": "application/json, text/event-stream"})
    assert sse.status == 200 and sse.headers["content-type"].startswith("text/event-stream")


def test_traffic_log_holds_an_ended_turns_every_line_redacted(mcp: McpClient, t3: T3Server,
                                                              agent_log_path: Path) -> None:
    """Once a turn is recorded completed, the provider traffic log already holds every line the
    agent streamed, in order, and the session's bearer token only as <redacted>."""
    created = create(mcp, "FAST:3000")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    log = protocol_log(t3.data_dir / "logs" / "provider-scripted.log.gz")
    chunks = re.findall(r'"agent_message_chunk", "content": \{"type": "text", "text": "(\d+) "', log)
    assert chunks == [str(i) for i in range(3000)]
    [opened] = [e["msg"] for e in agent_log(agent_log_path)
                if e["dir"] == "in" and e["msg"].get("method") == "session/new"]
    [header] = opened["params"]["mcpServers"][0]["headers"]
    token = header["value"].removeprefix("Bearer ")
    assert len(token) > 10 and token not in log
    assert '"name":"Authorization","value":"<redacted>"' in log


def test_a_long_stream_is_appended_not_rewritten(mcp: McpClient, t3: T3Server) -> None:
    """A long streamed answer (about 220,000 characters over 1.5 s, several ingest windows) is
    stored whole, once, as one assistant message, and what recording it wrote (its events'
    payloads and its projection row) stays under 4x its length: each commit appends only its new
    text (store.TEXT_APPENDED), so the bytes do not grow with the square of the answer (they
    were over 20x)."""
    n = 10_000
    created = create(mcp, f"PACED:{n}:22:1.5")
    assert wait(mcp, created["threadId"], timeoutMs=120_000)["status"] == "completed"
    [(message_id, stored, row)] = t3.rows(
        "SELECT message_id, json_extract(payload_json, '$.text'), LENGTH(payload_json) "
        "FROM messages WHERE run_id = ? AND json_extract(payload_json, '$.role') = "
        "'assistant'", (created["runId"],))
    events = t3.rows("SELECT type, LENGTH(payload_json) FROM events WHERE json_extract(payload_json, "
                     "'$.id') = ? ORDER BY sequence", (message_id,))
    chunks = re.findall(r"\.*(\d+)@\d+\.\d{4} ", stored)
    assert chunks == [str(i) for i in range(n)] and len(stored) == 22 * n
    expected = stored
    appends = [size for type_, size in events if type_ == "message-text.appended"]
    assert len(appends) >= 3, events  # it streamed over several commits
    assert row + sum(size for _, size in events) < 4 * len(expected), (row, events)
    [item, *_] = read(mcp, created["threadId"], afterPosition=0, maxCharsPerItem=50_000)["items"]
    assert item["type"] == "assistant_message"
    assert item["textTruncated"] and expected.startswith(item["text"].removesuffix("\n…[truncated]"))
    # Replay equivalence with the appends: projections rebuilt from the log equal the live ones.
    assert_rebuilt_equals_live(t3)


def assert_rebuilt_equals_live(t3: T3Server) -> None:
    """The server's projections rebuilt from its event log equal the live ones: on SQLite in a
    copy of the database, on PostgreSQL in a write transaction rolled back afterwards."""
    sys.path.insert(0, str(T3_PY.parent))
    import store
    from test_faults import table_rows  # rows of a store or a connection, runs.row_order aside
    tables = [table for table, _, _ in store._PROJECTIONS.values()]
    if t3.database is not None:
        import store_pg
        with closing(store_pg.PostgresEngine(t3.database).connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")  # the write lock: the server commits nothing meanwhile
            try:
                live = table_rows(conn, tables)
                store.rebuild_projections(conn)
                assert table_rows(conn, tables) == live
            finally:
                conn.execute("ROLLBACK")
        return
    with sqlite3.connect(":memory:", isolation_level=None) as copy:
        with sqlite3.connect(f"file:{t3.data_dir / 't3.sqlite'}?mode=ro", uri=True) as db:
            db.backup(copy)
        store.add_functions(copy)
        copy.row_factory = sqlite3.Row
        live = table_rows(copy, tables)
        copy.execute("BEGIN")
        store.rebuild_projections(copy)
        assert table_rows(copy, tables) == live