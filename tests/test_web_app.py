"""The web view as a person's daily tool, in Debian's headless Chromium driven over the DevTools
protocol: one person's whole session (start a worktree thread, send, steer, interrupt, Stop and
Resume, answer a question and an approval, switch provider, view a diff, roll back, fork and
merge back, rename, link a pull request, snooze, filter, archive, delete, and make, pause, run
and delete schedules, a webhook's among them), every step through the page's own controls and
the same /ws operations other clients call; hostile text that stays inert; and a 5,000-item
thread that opens quickly. Each step is a screenshot (under the test's tmp dir) whose page text,
read from the DOM at that moment, is checked. Without Debian's chromium they skip, saying so."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from browser import Browser, Page
from cli import WsClient, WsError
from harness import T3Server, raw_request, scripted_provider
from test_web import Steps, all_of, browser, create, lines_with, log_in  # noqa: F401

NO_PROBLEMS = ("Runtime.exceptionThrown",)


def ws(t3: T3Server, method: str, params: dict[str, Any]) -> Any:
    async def run() -> Any:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            return await client.request(method, params)
    return asyncio.run(run())


def problems(browser: Browser) -> list[dict[str, Any]]:
    """Page exceptions, console errors and CSP violations seen so far."""
    return [e for e in browser.events if e["method"] == "Runtime.exceptionThrown" or (
        e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error") or (
        e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")]


def watched_page(browser: Browser) -> Page:
    page = browser.new_page()
    page.call("Runtime.enable")  # exceptions and console errors land in browser.events
    page.call("Log.enable")  # ... and CSP violations
    return page


def send(page: Page, text: str, *, mode: str = "auto") -> None:
    """Type a message in the composer and press Enter, as a person does."""
    page.choose("#composer-mode", mode)
    page.type_into("#composer-text", text)
    page.press("Enter")  # the notice is cleared at once, then says how it went
    page.wait_for("() => /^Sen[dt]/.test(document.querySelector('#notice').innerText)")


def in_item(kind: str, has: str, then: str = "") -> str:
    """A CSS-free locator: the first timeline item of `kind` whose text holds `has`, as JS."""
    return (f"[...document.querySelectorAll('#items li.{kind}')].find(li => "
            f"li.innerText.includes({json.dumps(has)})){then}")


def click_in(page: Page, kind: str, has: str, label: str) -> None:
    """Click the button `label` inside the first timeline item of `kind` holding `has`."""
    page.wait_for(f"() => {in_item(kind, has)}")
    page.evaluate(in_item(kind, has, ".setAttribute('data-target', '1')"))
    page.click("[data-target] button", text=label)
    page.evaluate("document.querySelector('[data-target]').removeAttribute('data-target')")


def test_get_capabilities_over_ws_lists_providers_with_why_one_cannot_run(
        t3_factory, tmp_path: Path) -> None:
    """/ws getCapabilities is orchestrator_capabilities (one operation, two framings): the same
    providers as MCP shows, an instance whose executable is missing marked unable to run with
    the reason; arguments are checked as everywhere (an unknown one is invalid_request)."""
    missing = {"id": "gone", "driver": "acp", "command": [str(tmp_path / "no-such-agent")]}
    t3 = t3_factory(providers=[scripted_provider(tmp_path), missing])
    caps = ws(t3, "getCapabilities", {})
    mcp = t3.client()
    assert caps == mcp.call("orchestrator_capabilities", {}).structured
    gone = next(p for p in caps["providers"] if p["providerInstanceId"] == "gone")
    assert gone["canRunChildTask"] is False
    assert gone["constraints"] == [f"executable not found: {tmp_path / 'no-such-agent'}"]
    assert [m["id"] for m in next(p for p in caps["providers"] if p["providerInstanceId"] ==
                                  "scripted")["models"]] == ["scripted-1", "scripted-2"]
    with pytest.raises(WsError) as refused:
        ws(t3, "getCapabilities", {"nope": 1})
    assert refused.value.code == "invalid_request" and "nope" in str(refused.value)
    mcp.close()


def test_a_persons_whole_session_in_the_web_view(t3_factory, tmp_path: Path,
                                                  browser: Browser) -> None:
    """In headless Chromium, only through the page: start a worktree thread on the scripted
    agent (the provider whose executable is missing shown with its reason), send with Enter
    (Shift+Enter breaks the line), steer a running turn, interrupt one, Stop (the queued run is
    held) and Resume, answer a question and an approval (the page's title and the list show the
    wait, a notification is raised), switch provider, view a run's diff, roll back to run 1
    (the dialog says what is lost; run 2 is struck out), fork from run 1 and merge back (the
    parent's next run gets the fork's delta), regenerate the title and rename, link and unlink
    a pull request, snooze, filter and unsnooze, archive, unarchive and delete; make a webhook
    schedule (its URL shown once, with Copy) and fire it, make, pause, resume, run and delete an
    interval schedule, and make a fixed-time one. A refused action shows the
    server's typed failure. No page error, no CSP violation."""
    from test_workspace import make_repo
    make_repo(tmp_path / "workspace")
    missing = {"id": "gone", "driver": "acp", "command": [str(tmp_path / "no-such-agent")]}
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha", chunk_delay=0.05),
                               scripted_provider(tmp_path, id="beta", driver="grok"), missing])
    page = watched_page(browser)
    steps = Steps(page, tmp_path)
    log_in(page, t3)
    page.wait_for(lines_with("No threads yet."))
    steps.shot("logged-in", ("live",), ("New thread",), ("TEST PROJECT",))

    # Start a thread in a new worktree, approvals required.
    page.click("a[href='#new']")
    page.wait_for(lines_with("gone is unavailable: executable not found"))
    steps.shot("start-form", ("Start a thread",), ("gone is unavailable: executable not found",))
    page.choose("#start-provider", "alpha")
    page.choose("#start-runtime", "approval-required")
    page.click("#start input[value=worktree]")
    page.type_into("#start-title", "daily")
    page.type_into("#start-message", "WRITE_FILE notes.txt first")
    page.click("#start button[type=submit]")
    page.wait_for(lines_with("Checkpoint 1: 1 file(s) changed", "ready"))
    steps.shot("started", ("daily", "completed"), ("alpha", "approval-required"),
               ("branch t3/", "worktree"), ("wrote notes.txt",), within="main")
    [shell] = ws(t3, "listThreads", {})["threads"]
    thread_id = shell["threadId"]
    assert shell["worktreePath"] and shell["creationSource"] == "web"

    # Send with Enter; Shift+Enter breaks the line.
    page.type_into("#composer-text", "WRITE_FILE notes.txt second")
    page.press("Enter", shift=True)
    page.call("Input.insertText", {"text": "and that is all"})
    assert page.evaluate("document.querySelector('#composer-text').value") == \
        "WRITE_FILE notes.txt second\nand that is all"
    page.press("Enter")
    page.wait_for(lines_with("Checkpoint 2: 1 file(s) changed", "ready"))
    assert page.evaluate("document.querySelector('#composer-text').value") == ""
    click_in(page, "checkpoint", "Checkpoint 2", "Show diff")
    page.wait_for(lines_with("+second"))
    steps.shot("diff", ("-first",), ("+second",), ("modified +1 -1 notes.txt",), within="#items")

    # Steer a running turn, then interrupt one.
    send(page, "SLOW:400")
    page.wait_for(lines_with("run 3", "running"))
    page.wait_for(lines_with("chunk 3"))
    send(page, "steered in", mode="steer")
    page.wait_for(lines_with("You said: steered in"))
    steps.shot("steered", ("Sent: ",), ("You said: steered in",))
    send(page, "SLOW:400")
    page.wait_for(lines_with("run 4", "running"))
    page.click("#interrupt")
    page.wait_for(lines_with("run 4", "interrupted"))
    steps.shot("interrupted", ("run 4", "interrupted"), within="#items")

    # Stop holds the queued run; Resume releases it.
    send(page, "SLOW:400")
    page.wait_for(lines_with("run 5", "running"))
    send(page, "after the stop", mode="queue")
    page.wait_for(lines_with("Queued run 6: after the stop", within="#queue"))
    page.click("#stop")
    page.wait_for(lines_with("Stopped: 1 run(s) interrupted, 1 held"))
    page.wait_for("() => !document.querySelector('#resume').disabled")
    page.wait_for(lines_with("run 5", "interrupted"))
    steps.shot("stopped", ("Stopped: 1 run(s) interrupted, 1 held",), ("run 5", "interrupted"),
               ("Queued run 6", "held", "after the stop"))
    page.click("#resume")
    page.wait_for(lines_with("You said: after the stop"))
    steps.shot("resumed", ("Resumed: 1 held run(s) released",), ("You said: after the stop",))

    # Switch provider and model (to a grok-driver instance: grok's agents ask questions).
    page.click("#toolbar button", text="Switch provider")
    page.choose("#switch-provider", "beta")
    page.choose("#switch-model", "scripted-2")
    page.click("#panel-switch button[type=submit]")
    page.wait_for(lines_with("beta · scripted-2", within="#heading"))
    steps.shot("switched", ("Switched to beta scripted-2",), ("beta · scripted-2",))

    # A question and an approval: the title, the list and a notification say so.
    page.evaluate("""window.t3Notes = []; window.Notification = class {
        static permission = 'granted';
        constructor(title, options) { window.t3Notes.push([title, options.tag]); } }""")
    send(page, "ASK_QUESTION")
    page.wait_for("() => document.querySelector('#requests input[value=blue]')")
    page.wait_for("() => document.title.startsWith('(1) t3')")
    steps.shot("question", ("PENDING REQUESTS",), ("Color: Which color?",),
               ("daily", "1 pending"), ("1 waiting on you",))
    assert page.evaluate("window.t3Notes") == [["t3: daily needs an answer", thread_id]]
    page.click("#requests input[value=blue]")
    page.click("#requests input[value=M]")
    page.click("#requests button", text="Send answers")
    page.wait_for(lines_with("answered:", "blue", "M"))
    page.wait_for("() => document.title === 't3'")
    send(page, "ASK_PERMISSION")
    page.wait_for("() => [...document.querySelectorAll('#requests button')]"
                  ".some(b => b.innerText === 'Accept')")
    page.click("#requests button", text="Accept")
    page.wait_for(lines_with("permission granted: allow-once"))
    page.wait_for(lines_with("completed", within="#heading h1"))  # the run ended
    assert len(page.evaluate("window.t3Notes")) == 2

    # Roll back to run 1: the dialog says what is lost; run 2 is struck out.
    click_in(page, "checkpoint", "Checkpoint 1", "Roll back to here")
    page.wait_for("() => document.querySelector('#confirm').open")
    text = steps.shot("rollback-dialog", ("Roll back to run 1?",), within="#confirm")
    assert "are marked rolled back" in text and "cannot be undone" in text
    page.click("#confirm-ok")
    page.wait_for(lines_with("Rolled back to run 1"))
    struck = in_item("user_message", "run 2", ".classList.contains('rolled_back')")
    page.wait_for(f"() => {struck}")
    steps.shot("rolled-back", ("run 2", "rolled_back"), ("Rolled back to run 1",))
    assert page.evaluate(in_item("user_message", "run 2", ".parentNode && getComputedStyle("
                                 + in_item("user_message", "run 2") + ").textDecorationLine")) \
        == "line-through"
    assert page.evaluate(in_item("user_message", "run 1", ".className")) == "user_message"

    # Fork from run 1, work there, merge back: the parent's next run gets the fork's delta.
    click_in(page, "checkpoint", "Checkpoint 1", "Fork from here")
    page.wait_for(lines_with("Forked from daily", within="#heading"))
    fork_id = page.evaluate("decodeURIComponent(location.hash.slice(8))")
    assert fork_id != thread_id
    send(page, "in the fork")
    assert ws(t3, "waitForThread", {"threadId": fork_id})["status"] == "completed"
    page.wait_for(lines_with("completed", within="#heading h1"))
    fork_title = page.text("#heading h1").split(" completed")[0]
    page.click("#toolbar button", text="Merge back")
    page.wait_for(lines_with("Merged back: runs 1–1"))
    steps.shot("merged", ("Merged back: runs 1–1",), ("Forked from daily",))
    page.click("#heading a", text="daily")
    page.wait_for(lines_with("Rollback to checkpoint 1", within="#items"))
    send(page, "after the merge")
    page.wait_for(lines_with("Handoff fork_delta_summary"))

    # Regenerate the title (the agent suggests one), rename, link a pull request, snooze; the
    # list filters.
    page.click("#toolbar button", text="Regenerate title")
    page.wait_for(lines_with("Scripted title:", within="#heading h1"))
    page.click("#toolbar button", text="Rename")
    page.type_into("#rename-title", "daily renamed")
    page.click("#panel-rename button[type=submit]")
    page.wait_for(lines_with("daily renamed", within="#heading"))
    page.click("#toolbar button", text="Link PR")
    page.type_into("#pr-url", "https://example.com/not-a-pull-request")
    page.click("#panel-pr button[type=submit]")  # refused: the typed failure is shown
    page.wait_for(lines_with("Link PR failed: invalid_request: url: not a pull request URL"))
    steps.shot("refused", ("Link PR failed: invalid_request",), ("Pull request",))
    page.evaluate("document.querySelector('#pr-url').value = ''")
    page.type_into("#pr-url", "https://github.com/acme/widgets/pull/7")
    page.click("#panel-pr button[type=submit]")
    page.wait_for(lines_with("Pull request: github.com/acme/widgets#7"))
    page.click("#toolbar button", text="Unlink PR")
    page.wait_for("() => !document.querySelector('#heading').innerText.includes('Pull request')")
    page.click("#toolbar button", text="Link PR")
    page.type_into("#pr-url", "https://github.com/acme/widgets/pull/7")
    page.click("#panel-pr button[type=submit]")
    page.wait_for(lines_with("Pull request: github.com/acme/widgets#7"))
    page.click("#toolbar button", text="Snooze")
    page.click("#panel-snooze button", text="in 1 hour")
    page.wait_for(lines_with("Snoozed until", within="#heading"))
    steps.shot("renamed-snoozed", ("daily renamed", "snoozed"),
               ("Pull request: github.com/acme/widgets#7",), ("Snoozed until",), within="main")
    page.choose("#filter-snoozed", "only")
    page.wait_for(f"() => !document.querySelector('#sidebar').innerText.includes("
                  f"{json.dumps(fork_title)})")
    steps.shot("filter-snoozed", ("daily renamed", "snoozed"), within="#sidebar")
    page.choose("#filter-snoozed", "")
    page.type_into("#filter-text", "RENAMED")
    page.wait_for(lines_with("daily renamed", within="#sidebar"))
    page.choose("#filter-status", "failed")
    page.wait_for(lines_with("No matching threads.", within="#sidebar"))
    page.choose("#filter-status", "")
    page.evaluate("document.querySelector('#filter-text').value = ''")
    page.evaluate("document.querySelector('#filter-text').dispatchEvent(new Event('input'))")
    page.click("#toolbar button", text="Unsnooze")
    page.wait_for("() => !document.querySelector('#heading').innerText.includes('Snoozed')")

    # Archive the fork (it leaves the list; the archived filter shows it), then delete it.
    page.evaluate(f"location.hash = {json.dumps('#thread=' + fork_id)}")
    page.wait_for(lines_with("Forked from daily renamed", within="#heading"))
    page.click("#toolbar button", text="Archive")
    page.wait_for(lines_with("archived", within="#heading"))
    page.click("#filter-archived")
    page.wait_for(lines_with("archived", within="#sidebar"))
    steps.shot("archived", ("archived",), within="#sidebar")
    page.click("#filter-archived")
    page.click("#toolbar button", text="Unarchive")
    page.wait_for(lines_with(fork_title, within="#sidebar"))
    page.click("#toolbar button", text="Delete")
    page.wait_for("() => document.querySelector('#confirm').open")
    steps.shot("delete-dialog", ("for good",), within="#confirm")
    page.click("#confirm-ok")
    page.wait_for(f"() => !document.querySelector('#sidebar').innerText.includes("
                  f"{json.dumps(fork_title)})")
    page.wait_for(lines_with("Select a thread on the left.", within="main"))
    assert fork_id not in {t["threadId"] for t in ws(t3, "listThreads", {})["threads"]}

    # A webhook schedule: its URL shown once, with Copy; a delivery runs it.
    page.click("a[href='#schedule']")
    page.wait_for("() => document.querySelector('#new-schedule')")
    page.type_into("#sched-title", "hook")
    page.type_into("#sched-prompt", "hook says {{body.msg}}")
    page.choose("#sched-provider", "alpha")
    page.click("#new-schedule input[value=webhook]")
    page.click("#new-schedule button[type=submit]")
    page.wait_for("() => document.querySelector('#hook-url')")
    url = page.text("#hook-url")
    steps.shot("webhook-url", ("Webhook of hook",), (url,), ("Copy",))
    assert url.startswith(t3.url + "/")
    page.click("#hook button", text="Copy")
    page.wait_for("() => /Copied|Select and copy/.test(document.querySelector('#notice')"
                  ".innerText)")
    page.click("#hook button", text="Done")
    page.wait_for("() => document.querySelector('#new-schedule')")
    assert url not in page.text("body")  # shown once
    delivered = raw_request("POST", url, json.dumps({"msg": "hello"}).encode(),
                            {"Content-Type": "application/json"})
    assert delivered.status in (200, 202), delivered.body
    page.wait_for(lines_with("last run", "succeeded", within="#schedules"))
    page.click("#schedules a", text="hook")
    page.wait_for(lines_with("hook says hello", within="#items"))
    steps.shot("webhook-ran", ("hook says hello",), within="main")

    # An interval schedule: pause, resume, run now, delete (it sorts before "hook").
    page.click("a[href='#schedule']")
    page.wait_for("() => document.querySelector('#new-schedule')")
    page.type_into("#sched-title", "every hour")
    page.type_into("#sched-prompt", "tick")
    page.click("#new-schedule button[type=submit]")
    page.wait_for(lines_with("every 60 min", "enabled", within="#schedules"))
    page.click("#schedules li button", text="Pause")
    page.wait_for(lines_with("every 60 min", "paused", within="#schedules"))
    page.click("#schedules li button", text="Resume")
    page.wait_for(lines_with("every 60 min", "enabled", within="#schedules"))
    page.click("#schedules li button", text="Run now")
    page.wait_for(lines_with("1 run", within="#schedules li"))
    page.click("a[href='#schedule']")
    page.wait_for("() => document.querySelector('#new-schedule')")
    page.type_into("#sched-title", "standup")
    page.type_into("#sched-prompt", "notes")
    page.click("#new-schedule input[value=fixed_time]")
    page.click("#new-schedule button[type=submit]")
    page.wait_for(lines_with("09:00 Mon-Fri", "enabled", within="#schedules"))
    steps.shot("schedules", ("every 60 min", "enabled"), ("webhook",), ("09:00 Mon-Fri",),
               within="#schedules")
    page.click("#schedules li button", text="Delete")
    page.wait_for("() => document.querySelector('#confirm').open")
    page.click("#confirm-ok")
    page.wait_for("() => !document.querySelector('#schedules').innerText.includes('every 60')")
    steps.shot("schedule-deleted", ("hook",), within="#schedules")
    assert problems(browser) == []


def test_hostile_text_stays_inert(t3_factory, tmp_path: Path, browser: Browser) -> None:
    """A title, a message (rendered as Markdown), a file name and Markdown links carrying
    `<img onerror>`, `<script>`, `javascript:` and control characters run no script (a CDP
    binding the payloads call is never called, no element but the page's own appears, no CSP
    violation is logged) and show as text: controls as escapes, a javascript: link as its
    source, an https link clickable and named by its host."""
    from test_workspace import make_repo
    make_repo(tmp_path / "workspace")
    t3 = t3_factory(providers=[scripted_provider(tmp_path)])
    mcp = t3.client()
    title = "<img src=x onerror=\"t3Pwned('title')\"> title"
    prompt = "\n".join([
        "WRITE_FILE <img/src=x/onerror=t3Pwned('file')>.txt boom",
        "ECHO_PROMPT",
        "# Heading <script>t3Pwned('heading')</script>",
        "- [click me](javascript:t3Pwned) and [safe](https://example.com/a)",
        "- <img src=x onerror=\"t3Pwned('message')\"> \x1b[31mred\u202eevil",
        "```",
        "<svg onload=\"t3Pwned('code')\"></svg>",
        "```"])
    thread_id = create(mcp, prompt=prompt, title=title)
    assert mcp.call("t3_thread_wait", {"threadId": thread_id}).structured["status"] == \
        "completed"
    page = watched_page(browser)
    page.call("Runtime.addBinding", {"name": "t3Pwned"})
    steps = Steps(page, tmp_path)
    log_in(page, t3)
    page.click("nav a", text="title")
    page.wait_for(lines_with("Heading", within="#items"))
    page.wait_for(lines_with("onerror=t3Pwned('file')>.txt", within="#items"))
    text = steps.shot("hostile", (title,), ("Heading <script>t3Pwned('heading')</script>",),
                      ("[click me](javascript:t3Pwned) and safe (example.com)",),
                      ("<img src=x onerror=\"t3Pwned('message')\"> \\x1b[31mred<U+202E>evil",),
                      ("<svg onload=\"t3Pwned('code')\"></svg>",),
                      ("added +1 -0 <img/src=x/onerror=t3Pwned('file')>.txt",))
    assert "\x1b" not in text and "\u202e" not in text
    md = "#items .md"
    assert page.evaluate(f"document.querySelector('{md} h3').innerText") == \
        "Heading <script>t3Pwned('heading')</script>"
    assert page.evaluate(f"document.querySelectorAll('{md} li').length") == 2
    assert page.evaluate(f"[...document.querySelectorAll('{md} a')].map(a => a.href)") == \
        ["https://example.com/a"]
    assert page.evaluate(f"document.querySelector('{md} pre code').innerText") == \
        "<svg onload=\"t3Pwned('code')\"></svg>"
    assert page.evaluate("document.querySelectorAll('img, script:not(body > script), svg, "
                         "iframe, object, embed').length") == 0
    assert page.evaluate("[...document.querySelectorAll('a[href]')].every(a => "
                         "/^(https?:|#|$)/.test(a.getAttribute('href')) || "
                         "a.getAttribute('href').startsWith('#'))")
    page.click("#items .md li", text="click me")  # its text: nothing to follow
    page.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")
    assert [e for e in browser.events if e["method"] == "Runtime.bindingCalled"] == []
    assert problems(browser) == []
    assert page.evaluate("location.hash") == "#thread=" + page.evaluate(
        f"encodeURIComponent({json.dumps(thread_id)})")
    mcp.close()


def test_a_5000_item_thread_opens_quickly_and_loads_older_items_on_demand(
        t3_factory, tmp_path: Path, browser: Browser, record_property: Any) -> None:
    """A thread of 5,000 timeline items (one run of the scripted agent's tool calls) opens in
    headless Chromium within a bound generous for a loaded CI machine (the figure is logged;
    on an idle machine it is well under 2 s): its newest items drawn, older ones counted;
    scrolling to the top loads older ones a page at a time, each quickly."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path)])
    mcp = t3.client()
    thread_id = create(mcp, prompt="TOOLS:4998", title="long one")
    # /ws, whose client sets no deadline: on a loaded machine the run may take a minute.
    built = time.monotonic()
    assert ws(t3, "waitForThread", {"threadId": thread_id, "timeoutMs": 600_000})[
        "status"] == "completed"
    built = time.monotonic() - built
    items = len(ws(t3, "getThreadProjection", {"threadId": thread_id})["projection"]["turnItems"])
    assert items >= 5000
    page = watched_page(browser)
    steps = Steps(page, tmp_path)
    log_in(page, t3)
    page.wait_for(lines_with("long one", within="nav"))
    started = time.monotonic()
    page.click("nav a", text="long one")
    page.wait_for(lines_with("ran 4998 tools", within="#items"))
    opened = time.monotonic() - started
    steps.shot("opened", ("Show 200 older", f"({items - 200} earlier items not shown)"),
               ("ran 4998 tools",))
    loads = []
    for _ in range(5):
        loads.append(page.evaluate("""new Promise(resolve => {
            const box = document.querySelector('#items'), list = box.querySelector('ol');
            const before = list.children.length, t = performance.now();
            box.scrollTop = 0;
            const check = () => list.children.length > before ? resolve(performance.now() - t)
                                                             : requestAnimationFrame(check);
            requestAnimationFrame(check); })"""))
    shown = page.evaluate("document.querySelectorAll('#items li').length")
    steps.shot("older", (f"({items - shown} earlier items not shown)",))
    # The figures, in the test's output (pytest -rP shows it) and its junit properties.
    print(f"web view: a {items}-item thread (built in {built:.1f} s) opened in {opened:.2f} s; "
          f"five older pages loaded in {', '.join(f'{ms:.0f}' for ms in loads)} ms")
    record_property("open_seconds", round(opened, 3))
    record_property("older_page_ms", [round(ms) for ms in loads])
    assert shown == 1200
    assert opened < 8.0, opened  # idle: well under 2 s; CI on 2 loaded cores: far less than 8
    assert max(loads) < 2000, loads
    assert problems(browser) == []
    mcp.close()
