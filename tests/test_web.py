"""The web view at GET / (ui.html): how it is served (headers, CSP hashes, no auth, Host and
Origin rules), and, in Debian's headless Chromium driven over the DevTools protocol, a user's
session: log in with the client token, watch a parent delegate two children that appear and
finish live, answer a pending approval from the page; and a server restart under an open page,
which reconnects and resumes its streams. Each step is a screenshot (under the test's tmp dir)
whose page text, read from the DOM at that moment, is checked. The page never polls (no request
or frame it sends while it only watches) and the token reaches no URL but the WebSocket's and no
line of t3's log. The scheduled tasks are listed live, with their next and last runs, as the
server's test clock moves. Without Debian's chromium the browser tests skip, saying so."""

from __future__ import annotations

import asyncio
import base64
import calendar
import hashlib
import json
import re
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from cli import WsClient
from browser import Browser, Page, find_chromium
from harness import REPO, McpClient, T3Server, raw_request, scripted_provider


def test_root_serves_the_page_with_a_strict_policy(t3: T3Server) -> None:
    """GET / needs no token and answers ui.html as it is on disk, not cached, not frameable, no
    referrer, with a CSP that lets only the page's own inline script and style run (by their
    SHA-256) and connect only to this server; HEAD answers the headers alone; other methods get
    405, and a foreign Origin or Host is refused as on every route."""
    page = raw_request("GET", t3.url + "/")
    html = (REPO / "ui.html").read_bytes()
    assert page.status == 200 and page.body == html
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["cache-control"] == "no-store"
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["x-content-type-options"] == "nosniff"
    csp = dict(d.strip().split(" ", 1) for d in page.headers["content-security-policy"].split(";"))
    for tag in ("script", "style"):
        [body] = re.findall(rf"<{tag}>(.*?)</{tag}>".encode(), html, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        assert csp[f"{tag}-src"] == f"'sha256-{digest}'"
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert csp["form-action"] == "'none'" and csp["frame-ancestors"] == "'none'"
    assert csp["require-trusted-types-for"] == "'script'"
    head = raw_request("HEAD", t3.url + "/")
    assert head.status == 200 and head.body == b"" and head.headers["content-length"] == str(
        len(html))
    assert raw_request("POST", t3.url + "/", b"").status == 405
    assert raw_request("GET", t3.url + "/", headers={"Origin": "http://evil.example"}
                       ).status == 403
    assert raw_request("GET", t3.url + "/", headers={"Host": "evil.example"}).status == 403


# ---------------------------------------------------------------- in a real browser


@pytest.fixture
def browser(tmp_path: Path) -> Any:
    executable = find_chromium()
    if executable is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run "
                    "installs it)")
    chromium = Browser(executable, tmp_path)
    yield chromium
    chromium.close()


def lines_with(*words: str, within: str = "body") -> str:
    """A JS predicate: some line of the text of `within` holds all of `words`."""
    test = " && ".join(f"l.includes({json.dumps(w)})" for w in words)
    return (f"() => document.querySelector({json.dumps(within)}).innerText.split('\\n')"
            f".some(l => {test})")


def all_of(*predicates: str) -> str:
    return "() => " + " && ".join(f"({p})()" for p in predicates)


class Steps:
    """Numbered screenshots, each with the page text read from the DOM right after it."""

    def __init__(self, page: Page, folder: Path) -> None:
        self.page, self.folder, self.n = page, folder, 0

    def shot(self, name: str, *expected: tuple[str, ...], within: str = "body") -> str:
        """Screenshot the page as step `name`; every tuple of `expected` words must share a line
        of the text of `within`."""
        self.n += 1
        png = self.page.screenshot(self.folder / f"{self.n:02d}-{name}.png")
        text = self.page.text(within)
        png.with_suffix(".txt").write_text(text)
        lines = text.splitlines()
        for words in expected:
            assert any(all(w in line for w in words) for line in lines), (name, words, text)
        return text


def log_in(page: Any, t3: T3Server) -> None:
    """Open the web view and log in with the client token."""
    page.navigate(t3.url + "/")
    page.type_into("#token", t3.token)
    page.click("#login button", text="Log in")


def sent_by_page(events: list[dict[str, Any]]) -> list[str]:
    """What the page sent: its HTTP requests and the methods of its WebSocket frames."""
    out = []
    for e in events:
        if e["method"] == "Network.requestWillBeSent":
            out.append(f"{e['params']['request']['method']} {e['params']['request']['url']}")
        elif e["method"] == "Network.webSocketFrameSent":
            out.append("ws " + json.loads(e["params"]["response"]["payloadData"])["method"])
    return out


def create(mcp: McpClient, **entry: Any) -> str:
    made = mcp.call("create_threads", {"threads": [entry]})
    assert made.ok, made.structured
    return str(made.structured["threads"][0]["threadId"])


def test_web_view_follows_delegation_live_and_answers_an_approval(
        t3_factory, tmp_path: Path, browser: Browser) -> None:
    """In headless Chromium: the page logs in with the token; while a parent delegates two
    children, both appear running and then completed in the delegation tree without a reload
    and without the page sending anything; an approval-required thread shows its pending
    request, and Accept on the page resolves it (the run completes, MCP shows the client's
    accept). The token is only in sessionStorage and the WebSocket URL, never in t3's log."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, chunk_delay=0.1)])
    mcp = t3.client()
    page = browser.new_page()
    page.call("Runtime.enable")  # page exceptions and console errors land in browser.events
    page.call("Log.enable")  # ... and CSP violations
    steps = Steps(page, tmp_path)

    page.navigate(t3.url + "/")
    steps.shot("login", ("Client token",), ("Log in",))
    page.type_into("#token", t3.token)
    page.click("#login button", text="Log in")
    page.wait_for(lines_with("No threads yet."))
    steps.shot("logged-in", ("live",), ("Log out",), ("TEST PROJECT",))
    page.evaluate("window.t3TestMark = 'same page'")  # a reload would lose it

    children = "\n".join("CALL_TOOL delegate_task " + json.dumps({
        "task": f"SLOW:30 child {i}", "title": f"child {i}", "clientRequestId": f"c{i}"})
        for i in range(2))
    create(mcp, prompt=children, title="parent")
    page.click("nav a", text="parent")
    page.wait_for(lines_with("parent", "completed"))  # its own turn ends; the children run on
    watching = len(browser.events)
    page.wait_for(all_of(lines_with("child 0", "running", within="#tree"),
                         lines_with("child 1", "running", within="#tree")))
    steps.shot("children-running", ("DELEGATION",), ("parent",), ("child 0", "running"),
               ("child 1", "running"), within="#tree")
    page.wait_for(all_of(lines_with("child 0", "completed", within="#tree"),
                         lines_with("child 1", "completed", within="#tree")))
    steps.shot("children-completed", ("DELEGATION",), ("child 0", "completed"),
               ("child 1", "completed"), within="#tree")
    assert sent_by_page(browser.events[watching:]) == []  # it only listened: no polling
    assert page.evaluate("window.t3TestMark") == "same page"

    asking = create(mcp, prompt="ASK_PERMISSION", title="needs approval",
                    runtimeMode="approval-required")
    page.click("nav a", text="needs approval")
    page.wait_for("() => [...document.querySelectorAll('#requests button')]"
                  ".some(b => b.innerText === 'Accept')")
    steps.shot("approval-pending", ("PENDING REQUESTS",), ("Run scripted command", "pending"),
               ("Accept",), ("needs approval", "1 pending"))
    [pending] = mcp.call("t3_pending_request", {"threadId": asking, "action": "list"}
                         ).structured["requests"]
    page.click("#requests button", text="Accept")
    page.wait_for(lines_with("permission granted: allow-once"))
    page.wait_for(lines_with("needs approval", "completed"))
    text = steps.shot("approval-answered", ("needs approval", "completed"),
                      ("permission granted: allow-once",))
    assert "PENDING REQUESTS" not in text
    assert mcp.call("t3_thread_wait", {"threadId": asking}).structured["status"] == "completed"
    answered = mcp.call("t3_pending_request", {"threadId": asking, "action": "read",
                                               "requestId": pending["requestId"]})
    assert answered.structured["request"]["decision"] == "accept"
    assert answered.structured["request"]["answeredBy"] == {"kind": "client"}

    sent = sent_by_page(browser.events)
    assert sent[0] == f"GET {t3.url}/" and [s for s in sent if s.startswith("GET")] == [sent[0]]
    assert {s for s in sent[1:]} == {"ws subscribeShell", "ws subscribeThread",
                                     "ws unsubscribe", "ws dispatchCommand"}
    sockets = [e["params"]["url"] for e in browser.events
               if e["method"] == "Network.webSocketCreated"]
    ws_url = t3.url.replace("http", "ws", 1)
    assert sockets == [f"{ws_url}/ws?orchestrationProtocol=2&token={t3.token}"]
    assert t3.token not in page.evaluate("location.href")
    assert page.evaluate("sessionStorage.getItem('t3.clientToken')") == t3.token
    assert page.evaluate("localStorage.length") == 0

    page.click("#logout")
    page.wait_for(lines_with("not connected"))
    steps.shot("logged-out", ("Client token",), ("not connected",))
    assert page.evaluate("sessionStorage.length") == 0
    problems = [e for e in browser.events if e["method"] == "Runtime.exceptionThrown" or (
        e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error") or (
        e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")]
    assert problems == []
    mcp.close()
    t3.stop()
    assert t3.token not in t3.stderr_text()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_web_view_reconnects_after_a_restart_and_resumes_from_its_last_sequence(
        t3_factory, tmp_path: Path, browser: Browser) -> None:
    """A wrong token gets the login form back with a reason (and is forgotten). Then the server
    restarts (same port) under an open page: the page says it is reconnecting, reconnects on
    its own, subscribes again after the last sequence it applied (no new snapshot, no reload),
    and shows what happens next live."""
    t3 = t3_factory(args=["--port", str(free_port())])
    mcp = t3.client()
    page = browser.new_page()
    steps = Steps(page, tmp_path)
    page.navigate(t3.url + "/")
    wrong = "not-the-token-" + "x" * 32
    page.type_into("#token", wrong)
    page.click("#login button", text="Log in")
    page.wait_for(lines_with("Could not connect"))
    steps.shot("wrong-token", ("Could not connect", "check the token"), ("Log in",))
    assert page.evaluate("sessionStorage.length") == 0
    page.type_into("#token", t3.token)
    page.click("#login button", text="Log in")
    create(mcp, prompt="before the restart", title="resumed")
    page.click("nav a", text="resumed")
    page.wait_for(lines_with("You said: before the restart"))
    page.evaluate("window.t3TestMark = 'same page'")
    first = len(browser.events)

    t3.stop()
    page.wait_for(lines_with("reconnecting"))
    steps.shot("disconnected", ("reconnecting",), ("You said: before the restart",))
    t3.start()
    page.wait_for(lines_with("live"))
    [thread] = [t["threadId"] for t in mcp.call("t3_thread_list", {}).structured["threads"]]
    mcp.call("t3_thread_send", {"threadId": thread, "message": "after the restart"})
    page.wait_for(lines_with("You said: after the restart"))
    page.wait_for(lines_with("resumed", "completed"))  # the run's finalization commits after
    steps.shot("resumed", ("live",), ("You said: before the restart",),
               ("You said: after the restart",), ("resumed", "completed"))
    assert page.evaluate("window.t3TestMark") == "same page"
    frames = [json.loads(e["params"]["response"]["payloadData"]) for e in browser.events[first:]
              if e["method"] == "Network.webSocketFrameSent"]
    assert [(f["method"], sorted(f["params"])) for f in frames] == [
        ("subscribeShell", ["afterSequence"]), ("subscribeThread", ["afterSequence", "threadId"])]
    mcp.close()
    assert wrong not in t3.stderr_text() and "rejected a /ws connection" in t3.stderr_text()


def local_minute(epoch: float) -> str:
    """A time as the page shows it: this machine's time zone (the browser's too), to the minute."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def test_web_view_lists_schedules_and_follows_their_runs_live(t3_factory, tmp_path: Path,
                                                               browser: Browser) -> None:
    """The sidebar's Schedules lists each task in words with its next and last run; when the
    server's clock passes a task's due time, its run count, last run and next run change on the
    page without it sending anything; its title then opens the run's thread; a deleted task
    leaves the list."""
    start = calendar.timegm((2026, 3, 6, 17, 0, 0))
    t3 = t3_factory(env={"T3_TEST_HOOKS": "1", "T3_TEST_CLOCK": str(start)})
    mcp = t3.client()

    def ws(method: str, params: dict[str, Any]) -> Any:
        async def run() -> Any:
            async with WsClient(t3.url + "/ws", t3.token) as client:
                return await client.request(method, params)
        return asyncio.run(run())
    nightly = ws("scheduleTask", {"prompt": "check the build", "title": "nightly",
                                  "schedule": {"type": "interval", "everyMs": 900_000}})
    assert mcp.call("schedule_task", {"prompt": "notes", "title": "standup", "enabled": False,
                                      "schedule": {"type": "fixed_time", "timeOfDay": "09:00",
                                                   "weekdays": [1, 2, 3, 4, 5]}}).ok
    page = browser.new_page()
    page.call("Runtime.enable")
    page.call("Log.enable")
    steps = Steps(page, tmp_path)
    log_in(page, t3)
    page.wait_for(lines_with("nightly", within="#schedules"))
    steps.shot("schedules", ("SCHEDULES",), ("every 15 min", "enabled"),
               ("next run", local_minute(start + 900)), ("never run", "0 runs"),
               ("09:00 Mon-Fri", "paused"), ("no next run",), within="#schedules")
    assert page.evaluate("document.querySelector('#schedules time').getAttribute('datetime')") \
        == nightly["nextRunAt"]

    watching = len(browser.events)
    ws("advanceTestClock", {"seconds": 900})
    page.wait_for(lines_with("last run", "succeeded", "1 run", within="#schedules"))
    steps.shot("ran-once", ("next run", local_minute(start + 1800)),
               ("last run", "succeeded", local_minute(start + 900), "1 run"), within="#schedules")
    assert sent_by_page(browser.events[watching:]) == []  # it only listened: no polling

    page.click("#schedules a", text="nightly")
    page.wait_for(lines_with("[Triggered by schedule task: nightly]", within="main"))
    steps.shot("its-run", ("nightly", "completed"), ("check the build",), within="main")
    ws("deleteScheduledTask", {"scheduledTaskId": nightly["scheduledTaskId"]})
    page.wait_for("() => !document.querySelector('#schedules').innerText.includes('nightly')")
    steps.shot("deleted", ("standup",), within="#schedules")
    assert [e for e in browser.events if e["method"] == "Runtime.exceptionThrown" or (
        e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")] == []
    mcp.close()


def test_web_view_shows_a_checkpoints_files_and_a_folded_handoff(
        t3_factory, tmp_path: Path, browser: Any) -> None:
    """In headless Chromium: run 1 (on alpha) writes a file in a git project: its checkpoint
    item shows `ready` and the file with its line counts; run 2, switched to beta, shows the
    handoff item with its strategy, target, covered runs and source provider, its summary text
    folded until the person opens it (beta answers ECHO_CWD: its reply is not the prompt)."""
    from test_workspace import make_repo
    make_repo(tmp_path / "workspace")
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                               scripted_provider(tmp_path, id="beta")])
    mcp = t3.client()
    tid = create(mcp, prompt="WRITE_FILE notes/plan.txt kiwi\\nmango", title="switched",
                 target={"providerInstanceId": "alpha"})
    assert mcp.call("t3_thread_wait", {"threadId": tid, "timeoutMs": 30_000}).structured[
        "status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "ECHO_CWD",
                                       "target": {"providerInstanceId": "beta"}}).structured
    assert mcp.call("t3_thread_wait", {"threadId": tid, "runId": sent["runId"],
                                       "timeoutMs": 30_000}).structured["status"] == "completed"
    page = browser.new_page()
    log_in(page, t3)
    page.click("nav a", text="switched")
    page.wait_for(lines_with("Handoff full_thread_summary to beta"))
    steps = Steps(page, tmp_path)
    folded = steps.shot("handoff", ("Checkpoint 1: 1 file(s) changed", "ready"),
                        ("added +2 -0 notes/plan.txt",),
                        ("Handoff full_thread_summary to beta", "runs 1–1 from alpha"),
                        ("Summary",))
    assert "Canonical conversation context:" not in folded
    page.click("#items summary", text="Summary")
    page.wait_for(lines_with("Canonical conversation context:"))
    steps.shot("handoff-open", ("Covered app runs: 1-1",),
               ("- User: WRITE_FILE notes/plan.txt kiwi\\nmango",))


def test_web_view_survives_a_malformed_link_and_opens_a_results_web_url(
        t3: T3Server, tmp_path: Path, browser: Browser) -> None:
    """A malformed `#thread=` fragment (`%E0%A4%A`) opens no thread, yet the page logs in,
    connects and opens the thread a person clicks; a client-token result's webUrl, opened in a
    new tab, logs in straight to its thread; a pull request is named by its link's host."""
    mcp = t3.client()
    thread_id = create(mcp, prompt="hello there", title="with a PR")
    pr = "https://github.com/acme/widgets/pull/42"
    assert mcp.call("link_pull_request", {"threadId": thread_id, "url": pr}).ok
    page = browser.new_page()
    page.call("Runtime.enable")
    steps = Steps(page, tmp_path)
    page.navigate(t3.url + "/#thread=%E0%A4%A")
    page.type_into("#token", t3.token)
    page.click("#login button", text="Log in")
    page.wait_for(lines_with("with a PR", within="nav"))
    steps.shot("malformed-link", ("live",), ("Select a thread on the left.",))
    page.click("nav a", text="with a PR")
    page.wait_for(lines_with("Pull request: github.com/acme/widgets#42", within="main"))
    assert page.evaluate("document.querySelector('main a[target]').href") == pr

    [shell] = [t for t in mcp.call("t3_thread_list", {}).structured["threads"]
               if t["threadId"] == thread_id]
    assert shell["webUrl"] == f"{t3.url}/#thread={urllib.parse.quote(thread_id, safe='')}"
    opened = browser.new_page()  # a new tab: it logs in, then shows the thread it was sent to
    opened.navigate(shell["webUrl"])
    opened.type_into("#token", t3.token)
    opened.click("#login button", text="Log in")
    opened.wait_for(lines_with("You said: hello there", within="main"))
    steps.page = opened
    steps.shot("web-url", ("with a PR",), ("Pull request: github.com/acme/widgets#42",),
               within="main")
    assert [e for e in browser.events if e["method"] == "Runtime.exceptionThrown"] == []
    mcp.close()
