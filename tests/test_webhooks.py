"""Webhook triggers (SPEC 7, issue 14 item 3) against a real server over real HTTP: a webhook
task made over MCP with the client token, GitHub-style deliveries POSTed to its hookUrl. A
delivery starts one run with its templated prompt; a bad signature is 401 and writes nothing; the
same delivery again is a duplicate; a filtered-out one is skipped; the 61st in a minute is 429; a
2 MiB body is 413 before it is read; a wrong token is the 404 of an unknown hook; a paused hook is
409; deliveries wait in line and run one at a time; a kill -9 after the 202 still runs it once;
no secret reaches a log. The server's clock is the test clock (T3_TEST_CLOCK with T3_TEST_HOOKS),
so "a minute" is exact and nothing waits for real time."""

from __future__ import annotations

import asyncio
import base64
import calendar
import hashlib
import hmac
import json
import socket
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from harness import (McpClient, RawResponse, T3Server, agent_log, protocol_log, raw_post,
                     raw_request, scripted_provider, wait_until, write_config)

import t3 as server
from cli import WsClient
from test_schedules import prompts, settled, task

START = calendar.timegm((2026, 3, 6, 17, 0, 0))
CLOCK = {"T3_TEST_HOOKS": "1", "T3_TEST_CLOCK": str(START)}
SECRET = "It's a Secret to Everybody"
SIGNED = {"header": "X-Hub-Signature-256", "secret": SECRET, "prefix": "sha256="}
WHSEC = "whsec_" + base64.b64encode(b"a Standard Webhooks key, 32 byte").decode()
PUSH = {"ref": "refs/heads/main", "repository": {"full_name": "octo/hello"},
        "pusher": {"name": "mona"}, "commits": [{"id": "abc"}]}


# ---------------------------------------------------------------------------------------------
# helpers


def make_hook(mcp: McpClient, *, prompt: str = "{{headers.x-github-event}} {{body.ref}}",
              title: str = "Hook", task_args: dict[str, Any] | None = None,
              **options: Any) -> dict[str, Any]:
    """A webhook task made with the client token: its summary, with the hookUrl shown once."""
    made = mcp.call("schedule_task", {"prompt": prompt, "title": title, **(task_args or {}),
                                      "schedule": {"type": "webhook", **options}})
    assert made.ok, made.structured
    assert made.structured["hookUrl"].startswith("http://127.0.0.1:")
    return made.structured


def github(url: str, payload: Any, *, event: str = "push", delivery: str | None = None,
           secret: str = SECRET, headers: dict[str, str] | None = None,
           method: str = "POST") -> RawResponse:
    """One delivery as GitHub sends it: JSON body, event and delivery headers, and
    ``X-Hub-Signature-256: sha256=<hex HMAC of the body>``."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return raw_request(method, url, body, {
        "Content-Type": "application/json", "User-Agent": "GitHub-Hookshot/044aadd",
        "X-GitHub-Event": event, "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body,
                                                    hashlib.sha256).hexdigest(),
        **(headers or {})})


def standard(url: str, body: bytes, *, msg_id: str, stamp: int, secret: str = WHSEC,
             signature: str | None = None) -> RawResponse:
    """One Standard Webhooks delivery: ``webhook-signature: v1,<base64 HMAC-SHA256 of
    id.timestamp.body under the whsec_ secret's key>``, unless ``signature`` says otherwise."""
    return raw_post(url, body, {"Content-Type": "application/json", "webhook-id": msg_id,
                                "webhook-timestamp": str(stamp), "webhook-signature":
                                signature or v1(body, msg_id, stamp, secret)})


def v1(body: bytes, msg_id: str, stamp: int, secret: str = WHSEC) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    return "v1," + base64.b64encode(hmac.new(key, f"{msg_id}.{stamp}.".encode() + body,
                                             hashlib.sha256).digest()).decode()


def ws(t3: T3Server, method: str, params: dict[str, Any] | None = None) -> Any:
    async def call() -> Any:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            return await client.request(method, params or {})
    return asyncio.run(call())


def deliveries(t3: T3Server, task_id: str) -> list[dict[str, Any]]:
    return ws(t3, "listWebhookDeliveries", {"scheduledTaskId": task_id})["deliveries"]


def last_sequence(t3: T3Server) -> int:
    return int(t3.rows("SELECT COALESCE(MAX(sequence), 0) FROM events")[0][0])


def stored_bytes(t3: T3Server) -> bytes:
    """What the server's database holds: the SQLite files' bytes (free pages too), or on
    PostgreSQL every row of every table as text."""
    if t3.database is None:
        return b"".join(p.read_bytes() for p in t3.data_dir.glob("t3.sqlite*"))
    tables = [name for (name,) in t3.rows(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")]
    return "\n".join(text for table in tables
                     for (text,) in t3.rows(f"SELECT CAST(t AS TEXT) FROM {table} t")).encode()


def refused(response: RawResponse, status: int, code: str) -> bool:
    return response.status == status and response.json()["error"] == code


def raw_exchange(url: str, head: str, body: bytes) -> tuple[bytes, float]:
    """Send a request head and as much of ``body`` as given over one socket; return the answer
    (read until the server closes) and the seconds it took to come."""
    parsed = urllib.parse.urlsplit(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as sock:
        began = time.monotonic()
        sock.sendall(head.encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer, time.monotonic() - began


def hook_path(url: str) -> str:
    return urllib.parse.urlsplit(url).path


# ---------------------------------------------------------------------------------------------
# tests


def test_a_github_delivery_runs_once_with_its_templated_prompt_and_a_redacted_log(
        t3_factory, agent_log_path: Path) -> None:
    """A signed GitHub push starts one run whose prompt has the body, header and query fields
    filled in; the same delivery again is a duplicate; the log (over /ws and MCP) keeps both
    with secrets redacted, and neither the secret nor the token reaches a log file or stderr."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp, signature=SIGNED, prompt=(
        "{{headers.x-github-event}} to {{body.repository.full_name}} at {{ body.ref }} by "
        "{{body.pusher.name}} ({{query.source}}) [{{body.missing}}] {{body.commits}} "
        "{{headers.authorization}}"))
    assert "secret" not in made["schedule"]["signature"]
    url, token = made["hookUrl"] + "?source=ci", made["hookUrl"].rsplit("/", 1)[1]
    payload = {**PUSH, "password": "hunter2-in-the-body"}
    first = github(url, payload, delivery="d-1",
                   headers={"Authorization": "Bearer sender-credential-123"})
    assert first.status == 202, first.body
    assert first.json()["outcome"] == "running"
    done = settled(mcp, made["scheduledTaskId"], 1)
    assert done["lastRunStatus"] == "succeeded"
    assert prompts(agent_log_path) == [(
        "[Triggered by schedule task: Hook]\n\npush to octo/hello at refs/heads/main by mona "
        '(ci) [] [{"id": "abc"}] <redacted>')]

    again = github(url, payload, delivery="d-1")
    assert again.status == 202 and again.json()["outcome"] == "duplicate"
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 1  # a duplicate fires nothing

    log = deliveries(t3, made["scheduledTaskId"])
    assert [(d["outcome"], d["deliveryKey"]) for d in log] == [("duplicate", "d-1"),
                                                               ("succeeded", "d-1")]
    assert log[0]["reason"] == \
        f"the same signed delivery came before: {first.json()['deliveryId']}"
    ran = log[1]
    assert ran["id"] == first.json()["deliveryId"]
    assert (ran["runThreadId"], ran["runId"]) == (done["lastRunThreadId"], done["lastRunId"])
    assert ran["headers"]["x-github-event"] == "push"
    assert ran["headers"]["x-hub-signature-256"] == "<redacted>"
    assert ran["headers"]["authorization"] == "<redacted>"
    assert ran["query"] == {"source": ["ci"]} and ran["method"] == "POST"
    assert "octo/hello" in ran["bodyExcerpt"] and "hunter2" not in ran["bodyExcerpt"]
    assert ran["bodyTruncated"] is False and ran["prompt"] is None
    listed = mcp.call("list_scheduled_tasks", {"scheduledTaskId": made["scheduledTaskId"],
                                               "includeDeliveries": True}).structured
    assert listed["tasks"][0]["deliveries"] == log

    t3.stop()
    logs = [protocol_log(p) for p in (t3.data_dir / "logs").rglob("*") if p.is_file()]
    database = stored_bytes(t3)
    for secret in (SECRET, token, "sender-credential-123", "hunter2-in-the-body"):
        assert secret not in t3.stderr_text(), secret
        assert not any(secret in text for text in logs), secret
    # Only the signature's secret is stored (the server needs it); the token only as a hash.
    for secret in (token, "sender-credential-123", "hunter2-in-the-body"):
        assert secret.encode() not in database, secret


def test_a_bad_signature_is_401_starts_nothing_and_writes_nothing(t3_factory) -> None:
    """A wrong secret, a missing or unprefixed signature header, and a body other than the one
    signed are each 401 invalid_signature with no event written; the right one is then 202."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp, signature=SIGNED)
    url = made["hookUrl"]
    body = json.dumps(PUSH).encode()
    good = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    before = last_sequence(t3)
    for response in (
            github(url, PUSH, secret="not the secret"),
            raw_post(url, body, {"X-GitHub-Event": "push"}),
            raw_post(url, body, {"X-Hub-Signature-256": good.removeprefix("sha256=")}),
            raw_post(url, body + b" ", {"X-Hub-Signature-256": good}),
            raw_post(url, body, {"X-Hub-Signature-256": good[:-1] + "\u00e9"})):
        assert refused(response, 401, "invalid_signature"), response
    assert last_sequence(t3) == before
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 0
    assert deliveries(t3, made["scheduledTaskId"]) == []
    upper_hex = "sha256=" + good.removeprefix("sha256=").upper()
    assert raw_post(url, body, {"X-Hub-Signature-256": upper_hex}).status == 202


def test_filtered_out_deliveries_are_skipped_and_run_nothing(t3_factory) -> None:
    """Filters on a header and a body path: an issues event and a push to another branch are
    202 skipped, each with the filter that did not match; a push to main runs."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp, filters=[{"path": "headers.x-github-event", "equals": "push"},
                                   {"path": "body.ref", "equals": "refs/heads/main"},
                                   {"path": "commits.0.id", "equals": "abc"}])
    url = made["hookUrl"]
    issue = github(url, {"action": "opened"}, event="issues")
    branch = github(url, {**PUSH, "ref": "refs/heads/dev"})
    assert [r.json()["outcome"] for r in (issue, branch)] == ["skipped", "skipped"]
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 0
    log = deliveries(t3, made["scheduledTaskId"])
    assert [d["reason"] for d in log] == [
        'filters[1] (body.ref equals "refs/heads/main") did not match',
        'filters[0] (headers.x-github-event equals "push") did not match']
    assert github(url, PUSH).json()["outcome"] == "running"
    settled(mcp, made["scheduledTaskId"], 1)


def test_the_61st_delivery_in_a_minute_is_429_and_the_log_keeps_the_newest_50(
        t3_factory) -> None:
    """60 deliveries within one minute are taken; the 61st is 429 rate_limited with Retry-After
    and writes nothing; the log keeps the newest 50; a minute later the hook takes more."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp, filters=[{"path": "never", "equals": True}])  # all skipped: fast
    url = made["hookUrl"]
    taken = [github(url, {"n": n}, delivery=f"d-{n}") for n in range(60)]
    assert [r.json()["outcome"] for r in taken] == ["skipped"] * 60
    before = last_sequence(t3)
    limited = github(url, {"n": 60}, delivery="d-60")
    assert refused(limited, 429, "rate_limited") and limited.headers["retry-after"] == "60"
    assert last_sequence(t3) == before
    log = deliveries(t3, made["scheduledTaskId"])
    assert [d["deliveryKey"] for d in log] == [f"d-{n}" for n in range(59, 9, -1)]
    ws(t3, "advanceTestClock", {"seconds": 60})
    assert github(url, {"n": 60}, delivery="d-60").status == 202


def test_a_body_over_1_mib_is_413_before_it_is_read(t3_factory) -> None:
    """A 2 MiB body declared by Content-Length is answered 413 at once, with only its first
    64 KiB sent (the server does not wait for the rest); a chunked body that grows past 1 MiB
    is 413 too; neither writes anything, and exactly 1 MiB is taken."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp)
    host, path = urllib.parse.urlsplit(made["hookUrl"]).netloc, hook_path(made["hookUrl"])
    before = last_sequence(t3)
    answer, took = raw_exchange(made["hookUrl"], (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {2 * 1024 * 1024}\r\n\r\n"), b"x" * 65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"payload_too_large" in answer, answer
    assert b"connection: close" in answer.lower()
    assert took < server.BODY_TIMEOUT_S / 2, took  # not after waiting for the body
    chunk = b"x" * 65536
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(17)) + b"0\r\n\r\n"
    answer, _ = raw_exchange(made["hookUrl"], (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n"), chunked)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert last_sequence(t3) == before
    exact = raw_post(made["hookUrl"], b"x" * (1024 * 1024), {"X-GitHub-Event": "push"})
    assert exact.status == 202 and exact.json()["outcome"] == "running"
    [logged] = deliveries(t3, made["scheduledTaskId"])
    assert logged["bodyTruncated"] is True and len(logged["bodyExcerpt"]) == 65536


def test_wrong_tokens_unknown_and_deleted_hooks_are_one_404_and_a_paused_hook_is_409(
        t3_factory) -> None:
    """A wrong token, an unknown task, a thread's id and a deleted task all get the same 404
    hook_not_found; a paused hook is 409 until resumed; GET is 405 (the token not echoed);
    PUT and PATCH deliver; a foreign Host is 403; none of it writes, and the token never
    reaches stderr."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made, other = make_hook(mcp, title="one"), make_hook(mcp, title="two")
    url, token = made["hookUrl"], made["hookUrl"].rsplit("/", 1)[1]
    base = url.rsplit("/", 2)[0]
    thread = mcp.call("create_threads", {"threads": [{"title": "t"}]}).structured
    before = last_sequence(t3)
    answers = [github(url[:-2] + "xx", PUSH), github(f"{base}/nope/{token}", PUSH),
               github(other["hookUrl"].rsplit("/", 1)[0] + "/" + token, PUSH),
               github(f"{base}/{thread['threads'][0]['threadId']}/{token}", PUSH),
               github(url + "/extra", PUSH)]
    assert all(refused(a, 404, "hook_not_found") for a in answers), answers
    assert len({a.body for a in answers}) == 1
    get = raw_request("GET", url)
    assert get.status == 405 and get.headers["allow"] == "POST, PUT, PATCH"
    assert token not in get.body.decode()
    assert refused(github(url, PUSH, headers={"Host": "evil.example"}), 403, "host_not_allowed")
    mcp.call("schedule_task", {"scheduledTaskId": made["scheduledTaskId"], "enabled": False})
    before = last_sequence(t3)
    assert refused(github(url, PUSH), 409, "hook_disabled")
    assert last_sequence(t3) == before
    mcp.call("schedule_task", {"scheduledTaskId": made["scheduledTaskId"], "enabled": True})
    answers = [github(url, PUSH, method="PUT"), github(url, PUSH, method="PATCH")]
    assert [a.status for a in answers] == [202, 202], answers
    assert mcp.call("delete_scheduled_task", {"scheduledTaskId": made["scheduledTaskId"]}).ok
    assert refused(github(url, PUSH), 404, "hook_not_found")
    assert token not in t3.stderr_text()


def test_an_origin_not_listed_is_403_writes_nothing_and_takes_no_place_in_the_rate(
        t3_factory) -> None:
    """A request carrying an Origin that `allowed_origins` does not list is 403
    origin_not_allowed, a text/plain one (what a page may send without asking) and the server's
    own Origin included; it writes nothing and takes no place in the 60 a minute. With no Origin
    (as webhook senders send) or a listed one, the delivery is 202."""
    t3 = t3_factory(env=CLOCK, extra='[server]\nallowed_origins = ["https://hooks.example"]\n')
    mcp = t3.client()
    made = make_hook(mcp, filters=[{"path": "never", "equals": True}])  # all skipped: fast
    url, before = made["hookUrl"], last_sequence(t3)
    for origin in ("https://evil.example", t3.url, "null", "https://hooks.example.evil"):
        for kind in ("text/plain", "application/json"):
            answer = raw_post(url, b'{"ref": "x"}', {"Content-Type": kind, "Origin": origin})
            assert refused(answer, 403, "origin_not_allowed"), (origin, kind, answer)
    assert last_sequence(t3) == before and deliveries(t3, made["scheduledTaskId"]) == []
    taken = [github(url, PUSH, headers={"Origin": "https://hooks.example"}),
             *(github(url, {"n": n}) for n in range(59))]
    assert [r.json()["outcome"] for r in taken] == ["skipped"] * 60, taken[-1]
    assert refused(github(url, PUSH), 429, "rate_limited")


def test_deliveries_wait_in_line_and_run_one_at_a_time(t3_factory, agent_log_path: Path
                                                       ) -> None:
    """While a delivery's run waits on an approval, 19 more queue (20 waiting or running) and
    the 21st is 429 queue_full, writing nothing; once answered, the queued ones run in arrival
    order, each only after the one before it ended."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp, prompt="{{body.cmd}} n={{body.n}}",
                     task_args={"runtimeMode": "approval-required"})
    url = made["hookUrl"]
    first = github(url, {"cmd": "ASK_PERMISSION", "n": 0})
    assert first.json()["outcome"] == "running"
    queued = [github(url, {"cmd": "", "n": n}).json()["outcome"] for n in range(1, 20)]
    assert queued == ["queued"] * 19
    thread_id = wait_until(lambda: task(mcp, made["scheduledTaskId"])["lastRunThreadId"], 10)
    request = wait_until(lambda: mcp.call("t3_pending_request", {
        "threadId": thread_id, "action": "list"}).structured["requests"], 10)[0]
    before = last_sequence(t3)  # the first run waits on its approval: nothing else writes
    assert refused(github(url, {"n": 20}), 429, "queue_full")
    assert last_sequence(t3) == before
    assert mcp.call("t3_pending_request", {"threadId": thread_id, "action": "respond",
                                           "requestId": request["requestId"],
                                           "decision": "accept"}).ok
    settled(mcp, made["scheduledTaskId"], 20)
    assert [p.rsplit("n=", 1)[1] for p in prompts(agent_log_path)] == [str(n) for n in range(20)]
    # One at a time: each prompt is answered in the log before the next prompt arrives.
    turns = [("in", e["pid"], e["msg"]["id"]) if e["dir"] == "in" else ("out", e["pid"],
                                                                         e["msg"]["id"])
             for e in agent_log(agent_log_path)
             if (e["dir"] == "in" and e["msg"].get("method") == "session/prompt")
             or (e["dir"] == "out" and "stopReason" in (e["msg"].get("result") or {}))]
    assert [t[0] for t in turns] == ["in", "out"] * 20
    assert all(turns[i][1:] == turns[i + 1][1:] for i in range(0, 40, 2))
    assert [d["outcome"] for d in deliveries(t3, made["scheduledTaskId"])] == ["succeeded"] * 20


def test_kill9_right_after_a_delivery_commits_runs_it_once_after_the_restart(
        t3_factory, agent_log_path: Path) -> None:
    """The server dies the moment a delivery is committed (before it answers): after the
    restart the delivery runs, once; the sender's retry of it is a duplicate."""
    t3 = t3_factory(env={**CLOCK, "T3_CRASH_AT": "after-commit:webhook-delivery.receive"})
    mcp = t3.client()
    made = make_hook(mcp, signature=SIGNED)
    try:
        github(made["hookUrl"], PUSH, delivery="crash-1")
    except OSError:  # the connection died with the server (urllib's errors are OSErrors)
        pass
    wait_until(lambda: not t3.running, 10)
    t3.env.pop("T3_CRASH_AT")
    t3.start()
    assert settled(mcp, made["scheduledTaskId"], 1)["lastRunStatus"] == "succeeded"
    retry = github(t3.url + hook_path(made["hookUrl"]), PUSH, delivery="crash-1")  # new port
    assert retry.status == 202 and retry.json()["outcome"] == "duplicate"
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 1
    assert prompts(agent_log_path) == ["[Triggered by schedule task: Hook]\n\npush refs/heads/main"]


def test_a_too_long_prompt_fails_and_an_old_delivery_expires_without_running(
        t3_factory) -> None:
    """A filled-in prompt over 120,000 characters is 202 failed ("The filled-in prompt is too
    long."); with maxDeliveryAgeMinutes 5 a delivery stamped 6 minutes ago, or with an
    unreadable stamp, is expired; neither runs, and a fresh one does."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    made = make_hook(mcp, prompt="{{body.text}}", maxDeliveryAgeMinutes=5)
    url = made["hookUrl"]
    long = github(url, {"text": "x" * 120_001}, headers={"Webhook-Timestamp": str(START)})
    old = github(url, {"text": "hi"}, headers={"Webhook-Timestamp": str(START - 360)})
    odd = github(url, {"text": "hi"}, headers={"Webhook-Timestamp": "yesterday"})
    assert [r.json()["outcome"] for r in (long, old, odd)] == ["failed", "expired", "expired"]
    log = deliveries(t3, made["scheduledTaskId"])
    assert log[2]["error"] == "The filled-in prompt is too long."
    assert log[1]["reason"] == "sent 360 s ago, more than maxDeliveryAgeMinutes (5)"
    assert log[0]["reason"].startswith("its webhook-timestamp header is not a time")
    assert task(mcp, made["scheduledTaskId"])["runCount"] == 0
    fresh = github(url, {"text": "hi"}, headers={
        "Webhook-Timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(START - 240))})
    assert fresh.json()["outcome"] == "running"


def test_replays_are_duplicates_or_expired_whatever_delivery_id_they_carry(t3_factory) -> None:
    """With maxDeliveryAgeMinutes, a delivery without a timestamp, or stamped too far ahead, is
    expired. A GitHub-signed body sent again within twice that window is a duplicate with a new
    or no delivery id (after it, it runs again). Standard Webhooks: a v1 signature over
    id.timestamp.body passes (one good entry among several), a wrong key, body, id or a
    body-only HMAC is 401; a replay is a duplicate, then, once its signed stamp is too old,
    expired."""
    t3 = t3_factory(env=CLOCK)
    mcp = t3.client()
    bare = make_hook(mcp, title="bare", maxDeliveryAgeMinutes=5)
    assert github(bare["hookUrl"], PUSH).json()["outcome"] == "expired"
    assert deliveries(t3, bare["scheduledTaskId"])[0]["reason"].startswith(
        "it has no timestamp header")

    hub = make_hook(mcp, title="hub", signature=SIGNED, maxDeliveryAgeMinutes=5)
    body = json.dumps(PUSH).encode()
    signed = {"X-Hub-Signature-256": "sha256=" + hmac.new(SECRET.encode(), body,
                                                           hashlib.sha256).hexdigest()}
    stamp = {"Webhook-Timestamp": str(START)}
    assert github(hub["hookUrl"], PUSH, delivery="d-1", headers=stamp).json()["outcome"] == \
        "running"
    settled(mcp, hub["scheduledTaskId"], 1)
    copies = [github(hub["hookUrl"], PUSH, delivery="d-2", headers=stamp),
              raw_post(hub["hookUrl"], body, {**signed, "Webhook-Timestamp": str(START + 60)})]
    assert [c.json()["outcome"] for c in copies] == ["duplicate", "duplicate"]
    assert task(mcp, hub["scheduledTaskId"])["runCount"] == 1
    ws(t3, "advanceTestClock", {"seconds": 601})
    later = {"Webhook-Timestamp": str(START + 601)}
    assert github(hub["hookUrl"], PUSH, delivery="d-3", headers=later).json()["outcome"] == \
        "running"
    settled(mcp, hub["scheduledTaskId"], 2)

    std = make_hook(mcp, title="std", maxDeliveryAgeMinutes=5,
                    signature={"scheme": "standard-webhooks", "secret": WHSEC})
    assert std["schedule"]["signature"] == {"scheme": "standard-webhooks"}
    url, now = std["hookUrl"], START + 601
    mac = "v1," + base64.b64encode(hmac.new(SECRET.encode(), body, hashlib.sha256).digest()
                                   ).decode()
    wrong_key = "whsec_" + base64.b64encode(b"another key").decode()
    for refused_one in (standard(url, body, msg_id="m-1", stamp=now, secret=wrong_key),
                        standard(url, body, msg_id="m-1", stamp=now, signature=mac),
                        raw_post(url, body, {"webhook-signature": mac})):
        assert refused(refused_one, 401, "invalid_signature"), refused_one
    tampered = standard(url, body + b" ", msg_id="m-1", stamp=now, signature=v1(body, "m-1", now))
    assert refused(tampered, 401, "invalid_signature")
    assert standard(url, body, msg_id="m-1", stamp=now).json()["outcome"] == "running"
    settled(mcp, std["scheduledTaskId"], 1)
    several = f"v1,bm9wZQ== {v1(body, 'm-1', now)}"
    assert standard(url, body, msg_id="m-1", stamp=now, signature=several).json()[
        "outcome"] == "duplicate"
    ws(t3, "advanceTestClock", {"seconds": 301})  # remembered for twice the window
    assert standard(url, body, msg_id="m-1", stamp=now, signature=several).json()[
        "outcome"] == "duplicate"
    ws(t3, "advanceTestClock", {"seconds": 300})
    assert standard(url, body, msg_id="m-1", stamp=now).json()["outcome"] == "expired"
    ahead = standard(url, body, msg_id="m-3", stamp=now + 601 + 301)
    assert ahead.json()["outcome"] == "expired"
    assert deliveries(t3, std["scheduledTaskId"])[0]["reason"] == \
        "stamped 301 s ahead, more than maxDeliveryAgeMinutes (5)"
    assert standard(url, body, msg_id="m-2", stamp=now + 601).json()["outcome"] == "running"
    settled(mcp, std["scheduledTaskId"], 2)


def test_no_agent_holds_a_live_hook_token_and_a_person_sees_it_once(t3_factory, tmp_path: Path
                                                                     ) -> None:
    """An approval-required agent's webhook task gets no token (its result says how a person
    makes the URL); the person's /ws rotate shows the URL once and it works. The URL the person
    then gives an agent, echoed back, is blanked in that agent's events; an agent in another
    project reading both threads' activity sees no token; nor does any protocol log, or any
    event but the person's own message."""
    (tmp_path / "w1").mkdir()
    (tmp_path / "w2").mkdir()
    t3 = t3_factory(env=CLOCK, config=write_config(tmp_path, projects=[
        {"id": "proj", "path": str(tmp_path / "w1")}, {"id": "p2", "path": str(tmp_path / "w2")}],
        providers=[scripted_provider(tmp_path, id="one"), scripted_provider(tmp_path, id="two")]))
    mcp = t3.client()
    line = "CALL_TOOL schedule_task " + json.dumps({
        "prompt": "triage {{body.ref}}", "schedule": {"type": "webhook", "signature": SIGNED},
        "bindToCurrentThread": False})

    def start(prompt: str, project: str, provider: str, **entry: Any) -> str:
        made = mcp.call("create_threads", {"projectId": project, "threads": [{
            "prompt": prompt, "target": {"providerInstanceId": provider}, **entry}]})
        return str(made.structured["threads"][0]["threadId"])
    maker = start(line, "proj", "one", runtimeMode="approval-required")
    [call] = wait_until(lambda: [e for e in agent_log(tmp_path / "agent-one.log")
                                 if e["dir"] == "mcp"], 30)
    made = call["result"]
    assert "hookUrl" not in made and "--rotate-hook-token" in made["hookNote"], made
    task_id = made["scheduledTaskId"]
    assert ws(t3, "listScheduledTasks", {"scheduledTaskId": task_id})["tasks"][0]["hookNote"]

    minted = ws(t3, "scheduleTask", {"scheduledTaskId": task_id, "rotateHookToken": True})
    url = minted["hookUrl"]
    token = url.rsplit("/", 1)[1]
    assert github(url, PUSH).json()["outcome"] == "running"
    settled(mcp, task_id, 1)
    [listed] = ws(t3, "listScheduledTasks", {"scheduledTaskId": task_id})["tasks"]
    assert "hookUrl" not in listed and "hookNote" not in listed

    echo = start(f"ECHO_PROMPT deploy with {url} please", "proj", "one")
    assert mcp.call("t3_thread_wait", {"threadId": echo}).structured["status"] == "completed"
    reads = [f"CALL_TOOL t3_thread_read {json.dumps({'threadId': t, 'view': v})}"
             for t in (maker, echo) for v in ("activity", "messages")]
    start("\n".join(reads), "p2", "two")
    results = wait_until(lambda: len(r := [e for e in agent_log(tmp_path / "agent-two.log")
                                          if e["dir"] == "mcp"]) == 4 and r, 30)
    assert all(not r["isError"] for r in results), results
    assert "deploy with http" in json.dumps(results) and token not in json.dumps(results)
    echoed = mcp.call("t3_thread_read", {"threadId": echo}).structured
    assert "/<redacted> please" in json.dumps(echoed), echoed

    t3.stop()
    for path in (t3.data_dir / "logs").rglob("*"):
        assert not path.is_file() or token not in protocol_log(path), path
    assert token not in t3.stderr_text()
    holding = [(kind, json.loads(payload)) for kind, payload in t3.rows(
        "SELECT type, payload_json FROM events") if token in payload]
    assert holding and all(kind == "message.updated" and payload["role"] == "user"
                           for kind, payload in holding), holding
