"""Thread metadata and lifecycle (issue 13, items 3 and 4): t3_thread_update (rename,
regenerate_title), link_pull_request / unlink_pull_request, and archive, delete, snooze and visit
for people, seen through every way in: MCP, /ws and the CLI. Scope and decide rules run in
process (test_tool_denials' World); the rest against a real server and the scripted agent."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

import orchestrator as o
import metadata  # noqa: E402
from cli import WsClient, WsError
from harness import McpClient, T3Server, wait_until
from test_tool_denials import CLIENT, World, agent, run

PR = "https://github.com/acme/widgets/pull/42"


def ws(t3: T3Server, method: str, params: dict[str, Any] | None = None) -> Any:
    async def call() -> Any:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            return await client.request(method, params or {})
    return asyncio.run(call())


def command(t3: T3Server, kind: str, thread_id: str, **fields: Any) -> dict[str, Any]:
    return ws(t3, "dispatchCommand", {"type": kind, "commandId": f"{kind}:{thread_id[-8:]}:"
                                      f"{json.dumps(fields, sort_keys=True)}",
                                      "threadId": thread_id, **fields})


def listed(mcp: McpClient, thread_id: str, **filters: Any) -> dict[str, Any] | None:
    shells = mcp.call("t3_thread_list", filters).structured["threads"]
    return next((t for t in shells if t["threadId"] == thread_id), None)


def created(mcp: McpClient, prompt: str, **entry: Any) -> str:
    thread_id = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]}).structured[
        "threads"][0]["threadId"]
    assert mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 20_000}
                    ).structured["status"] == "completed"
    return thread_id


def cli_json(t3: T3Server, *args: str) -> Any:
    done = t3.cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_rename_regenerate_link_unlink_everywhere_and_retries_replay(t3: T3Server,
                                                                    mcp: McpClient) -> None:
    """Each metadata action shows in t3_thread_list, t3_thread_read, /ws and the CLI; a retry
    with the same clientRequestId gets the same command id and sequence back; the scripted
    agent answers the title request."""
    tid = created(mcp, "plan the garden party please")
    renamed = mcp.call("t3_thread_update", {"threadId": tid, "action": "rename",
                                            "title": "Party plans", "clientRequestId": "r1"})
    assert renamed.ok, renamed.structured
    again = mcp.call("t3_thread_update", {"threadId": tid, "action": "rename",
                                          "title": "Party plans", "clientRequestId": "r1"})
    assert again.structured == renamed.structured
    assert listed(mcp, tid)["title"] == "Party plans"
    assert ws(t3, "readThread", {"threadId": tid})["thread"]["title"] == "Party plans"

    regen = mcp.call("t3_thread_update", {"threadId": tid, "action": "regenerate_title",
                                          "clientRequestId": "g1"}).structured
    assert regen["titleRegeneration"]["requestId"] == regen["commandId"]
    titled = "Scripted title: plan the garden"
    wait_until(lambda: mcp.call("t3_thread_read", {"threadId": tid}).structured["thread"][
        "title"] == titled, 20)
    detail = mcp.call("t3_thread_read", {"threadId": tid}).structured["thread"]
    assert detail["titleRegeneration"] is None
    assert mcp.call("t3_thread_update", {"threadId": tid, "action": "regenerate_title",
                                         "clientRequestId": "g1"}).structured == regen

    linked = mcp.call("link_pull_request", {"threadId": tid, "url": PR,
                                            "clientRequestId": "l1"}).structured
    assert linked["linkedPullRequest"] == {"repository": "acme/widgets", "number": 42, "url": PR}
    assert linked["title"] == titled and linked["sequence"] > regen["sequence"]
    assert mcp.call("link_pull_request", {"threadId": tid, "url": PR,
                                          "clientRequestId": "l1"}).structured == linked
    assert listed(mcp, tid)["linkedPullRequest"] == linked["linkedPullRequest"]
    assert mcp.call("t3_thread_read", {"threadId": tid}).structured["thread"][
        "linkedPullRequest"] == linked["linkedPullRequest"]
    shells = ws(t3, "listThreads")["threads"]
    assert [t["linkedPullRequest"] for t in shells if t["threadId"] == tid] == [
        linked["linkedPullRequest"]]
    text = t3.cli("threads").stdout
    assert f"{tid}  {titled}  [PR github.com/acme/widgets#42]" in text
    assert f"| PR github.com/acme/widgets#42 {PR}" in t3.cli("show", tid).stdout

    # The same through /ws and the CLI, as a person.
    assert ws(t3, "unlinkPullRequest", {"threadId": tid})["linkedPullRequest"] is None
    assert listed(mcp, tid)["linkedPullRequest"] is None
    assert cli_json(t3, "link-pr", tid, PR)["linkedPullRequest"]["number"] == 42
    assert cli_json(t3, "show", tid)["thread"]["linkedPullRequest"]["url"] == PR
    assert cli_json(t3, "unlink-pr", tid)["linkedPullRequest"] is None
    assert cli_json(t3, "rename", tid, "By hand")["title"] == "By hand"
    assert [t["title"] for t in cli_json(t3, "threads")["threads"] if t["threadId"] == tid] == [
        "By hand"]
    assert cli_json(t3, "rename", tid, "--regenerate")["titleRegeneration"] is not None
    wait_until(lambda: listed(mcp, tid)["title"] == titled, 20)
    assert ws(t3, "updateThread", {"threadId": tid, "action": "rename", "title": "Via ws"})[
        "title"] == "Via ws"


def test_regeneration_falls_back_to_the_first_message(t3: T3Server, mcp: McpClient) -> None:
    """A provider that cannot answer the title request leaves a title made from the first
    message (its first 80 characters), not the old one."""
    prompt = "NO_TITLE " + "word " * 30
    tid = created(mcp, prompt)
    mcp.call("t3_thread_update", {"threadId": tid, "action": "rename", "title": "Old"})
    mcp.call("t3_thread_update", {"threadId": tid, "action": "regenerate_title"})
    fallback = " ".join(prompt.split())[:77] + "..."
    wait_until(lambda: listed(mcp, tid)["title"] == fallback, 20)


def test_metadata_denials_follow_the_send_scope(tmp_path: Path) -> None:
    """Bad input and callers beyond their scope get typed failures and change nothing: an
    agent changes another thread only with its own live run and no broader target modes."""
    async def scenario(w: World) -> None:
        await w.thread("narrow", runtime="approval-required", interaction="plan")
        await w.thread("wide")
        me = agent("narrow")
        await w.denied(me, "t3_thread_update", {"threadId": "wide", "action": "rename",
                                                "title": "x"}, "runtime_mode_escalation_denied")
        await w.denied(me, "link_pull_request", {"threadId": "wide", "url": PR},
                       "runtime_mode_escalation_denied")
        await w.denied(CLIENT, "t3_thread_update", {"action": "rename", "title": "x"},
                       "thread_credential_required")
        await w.denied(me, "t3_thread_update", {"action": "rename"}, "invalid_request")
        await w.denied(me, "t3_thread_update", {"action": "regenerate_title", "title": "x"},
                       "invalid_request")
        for url in ("javascript:alert(1)", "https://github.com/acme/widgets",
                    "ftp://github.com/acme/widgets/pull/1", PR + " x"):
            await w.denied(me, "link_pull_request", {"url": url}, "invalid_request")
        await w.denied(CLIENT, "unlink_pull_request", {"threadId": "gone"}, "thread_not_found")
        wide = agent("wide")
        run_id = (await w.orch.state("wide")).latest_run().id
        await w.orch.dispatch(o.InterruptRun(command_id="stop", thread_id="wide", run_id=run_id))
        await w.denied(wide, "t3_thread_update", {"threadId": "narrow", "action": "rename",
                                                  "title": "x"}, "parent_not_active")
        own = await w.call(wide, "t3_thread_update", {"action": "rename", "title": "Mine"})
        assert own["title"] == "Mine"  # its own thread needs no live run
        narrowed = await w.call(wide, "link_pull_request", {"threadId": "wide", "url": PR})
        assert narrowed["linkedPullRequest"]["repository"] == "acme/widgets"
    run(tmp_path, scenario)


# What a terminal acts on: OSC 0 (window title), OSC 52 (clipboard write), ESC[2J (clear), a C1
# CSI, bidi overrides and isolates, a line break, NUL.
BAD_TITLES = ["x\x1b]0;pwned\x07", "x\x1b]52;c;ZXZpbA==\x07", "x\x1b[2J", "x\x9b2J",
              "gpj.\u202eexe", "a\u2066b", "two\nlines", "nul\x00"]
BAD_PR_LINKS = [
    "http://github.com/acme/widgets/pull/42",  # not https
    "https://github.com@evil.example/acme/widgets/pull/42",  # user info: goes to evil.example
    "https://user:pw@github.com/acme/widgets/pull/42",
    "https://gith\u00fcb.com/acme/widgets/pull/42",  # a non-ASCII host
    "https://github.com/acme\u202e/widgets/pull/42",  # a bidi-spoofed name
    "https://github.com/acme/wid\x1b]0;x\x07gets/pull/42"]


def test_titles_and_pr_links_a_person_could_misread_are_refused(tmp_path: Path) -> None:
    """A title with a control character (C0, C1, bidi) and a PR link that is not https with an
    ASCII host and no user info are invalid_request naming the field, and write nothing; a
    title made from a prompt holds none of those characters."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        me = agent("t1")
        for title in BAD_TITLES:
            for scope, tool, args, field in (
                    (me, "t3_thread_update", {"action": "rename", "title": title}, "title"),
                    (CLIENT, "create_threads", {"threads": [{"prompt": "p", "title": title}]},
                     "threads[0].title"),
                    (CLIENT, "t3_thread_launch", {"title": title}, "title"),
                    (me, "delegate_task", {"task": "t", "title": title}, "title"),
                    (CLIENT, "schedule_task", {"prompt": "p", "title": title, "schedule": {
                        "type": "interval", "everyMs": 3_600_000}}, "title")):
                message = await w.denied(scope, tool, args, "invalid_request")
                assert message.startswith(f"{field}: holds control character"), message
        for url in BAD_PR_LINKS:
            message = await w.denied(me, "link_pull_request", {"url": url}, "invalid_request")
            assert message.startswith("url: "), message
        for url in ("https://github.com:443/acme/widgets/pull/42/",
                    "https://gitlab.example/group/proj/-/merge_requests/7"):
            assert (await w.call(me, "link_pull_request", {"url": url}))["linkedPullRequest"][
                "url"] == url
        made = await w.call(CLIENT, "create_threads", {"threads": [
            {"prompt": "fix \x1b]0;pwned\x07the\u202e build\x9b"}]})
        assert made["threads"][0]["title"] == "fix ]0;pwnedthe build"
    run(tmp_path, scenario)


def test_ws_and_the_cli_refuse_them_too_and_change_nothing(t3: T3Server, mcp: McpClient) -> None:
    """/ws (updateThread, thread.create, launchThread, forkThread, linkPullRequest) and the CLI
    (rename, new --title, link-pr) pass the same checks: invalid_request, the thread keeps its
    title and link, no thread is made; the CLI's refusal line names the field."""
    tid = created(mcp, "hello", title="Kept")
    assert mcp.call("link_pull_request", {"threadId": tid, "url": PR}).ok
    title, link = BAD_TITLES[0], BAD_PR_LINKS[1]
    for method, params in (
            ("updateThread", {"threadId": tid, "action": "rename", "title": title}),
            ("dispatchCommand", {"type": "thread.create", "commandId": "c1", "title": title}),
            ("launchThread", {"commandId": "c2", "title": title}),
            ("forkThread", {"commandId": "c3", "sourceThreadId": tid, "title": title}),
            ("linkPullRequest", {"threadId": tid, "url": link})):
        with pytest.raises(WsError) as refused:
            ws(t3, method, params)
        assert refused.value.code == "invalid_request", (method, refused.value)
    for args in (("rename", tid, title), ("new", "hi", "--title", title), ("link-pr", tid, link)):
        done = t3.cli(*args)
        assert done.returncode == 1 and done.stderr.startswith("t3: invalid_request: "), done
    assert t3.cli("rename", tid, title).stderr == (
        "t3: invalid_request: title: holds control character U+001B (one line of plain text)\n")
    [shell] = mcp.call("t3_thread_list", {}).structured["threads"]
    assert (shell["title"], shell["linkedPullRequest"]["url"]) == ("Kept", PR)


def test_results_for_a_person_carry_a_web_url_and_an_agents_do_not(tmp_path: Path) -> None:
    """Each result that names a thread's t3-thread:// link carries, for the client token,
    webUrl: that thread in the server's web view (`<url>/#thread=<id, URL-encoded>`); an
    agent's results keep the link alone. Both match the tools' output schemas."""
    async def scenario(w: World) -> None:
        await w.thread("t1")
        made = (await w.call(CLIENT, "create_threads", {"threads": [{"prompt": "p"}]}))[
            "threads"][0]
        web = f"http://127.0.0.1/#thread={urllib.parse.quote(made['threadId'], safe='')}"
        assert "%3A" in web and made["webUrl"] == web
        read = await w.call(CLIENT, "t3_thread_read", {"threadId": made["threadId"]})
        assert read["webUrl"] == read["thread"]["webUrl"] == web
        listed = (await w.call(CLIENT, "t3_thread_list", {}))["threads"]
        assert all(t["webUrl"].endswith(urllib.parse.quote(t["threadId"], safe=""))
                   for t in listed) and len(listed) == 2
        launched = await w.call(CLIENT, "t3_thread_launch", {"title": "launched"})
        assert launched["webUrl"].startswith("http://127.0.0.1/#thread=thread%3A")
        me = agent("t1")
        for result in (
                (await w.call(me, "create_threads", {"threads": [{"prompt": "p"}]}))[
                    "threads"][0],
                await w.call(me, "t3_thread_read", {"threadId": "t1"}),
                (await w.call(me, "t3_thread_read", {"threadId": "t1"}))["thread"],
                *(await w.call(me, "t3_thread_list", {}))["threads"]):
            assert "webUrl" not in result and result["link"].startswith("t3-thread://v2/")
    run(tmp_path, scenario)


def test_a_stale_regeneration_never_overwrites_a_later_rename() -> None:
    """decide: a regeneration's answer applies only while its marker is current; a rename, or a
    newer regeneration, makes it stale."""
    state = o.ThreadState()
    clock = iter(f"2030-01-01T00:00:{i:02d}.000Z" for i in range(60))

    def apply(command: Any) -> o.Decision:
        decision = o.decide(state, command, now=next(clock), new_id=lambda p: p, providers={
            "a": o.ProviderInfo("a", "acp", None, [], o.Capabilities())})
        for event in decision.events:
            if event.type.startswith("thread."):
                state.put(o.AppThread.from_json(event.payload))
        return decision
    apply(o.CreateThread(command_id="c", thread_id="t", project_id="p", title="First",
                         provider_instance_id="a", model=None, runtime_mode="full-access",
                         interaction_mode="default", workspace="/tmp", created_by="user",
                         creation_source="web"))
    first = apply(metadata.UpdateThreadMetadata("g1", "t", "regenerate_title"))
    assert [e.effect_type for e in first.effects] == ["thread-title.generate"]
    apply(metadata.UpdateThreadMetadata("r1", "t", "rename", title="Mine"))
    assert not apply(metadata.CompleteTitleRegeneration("done-g1", "t", "g1", "Stale")).events
    assert state.thread.title == "Mine"
    apply(metadata.UpdateThreadMetadata("g2", "t", "regenerate_title"))
    apply(metadata.UpdateThreadMetadata("g3", "t", "regenerate_title"))
    assert not apply(metadata.CompleteTitleRegeneration("done-g2", "t", "g2", "Older")).events
    apply(metadata.CompleteTitleRegeneration("done-g3", "t", "g3", "Newest"))
    assert (state.thread.title, state.thread.title_regeneration) == ("Newest", None)


def test_archive_and_delete_over_ws_and_cli(t3: T3Server, mcp: McpClient) -> None:
    """Archived threads leave the default list (archived: true shows them) and stay readable;
    deleted ones are never listed and read thread_not_found; both refuse an active run."""
    busy = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:400 busy"}]}).structured[
        "threads"][0]["threadId"]
    tid = created(mcp, "archive me")
    refused = t3.cli("archive", busy)
    assert refused.returncode == 1 and "interrupt it first" in refused.stderr
    assert cli_json(t3, "archive", tid)["archived"] is True
    assert listed(mcp, tid) is None and listed(mcp, tid, archived=True)["archived"] is True
    assert mcp.call("t3_thread_read", {"threadId": tid}).structured["thread"]["archived"]
    assert tid not in t3.cli("threads").stdout and tid in t3.cli("threads", "--archived").stdout
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "more"})
    assert sent.failure_code == "thread_not_sendable"
    assert command(t3, "thread.unarchive", tid)["result"]["archived"] is False
    assert listed(mcp, tid)["archived"] is False
    assert cli_json(t3, "delete", tid)["deleted"] is True
    assert listed(mcp, tid) is None and listed(mcp, tid, archived=True) is None
    assert mcp.call("t3_thread_read", {"threadId": tid}).failure_code == "thread_not_found"
    gone = t3.cli("unarchive", tid)
    assert gone.returncode == 1 and "thread_not_found" in gone.stderr
    mcp.call("t3_thread_interrupt", {"threadId": busy})


def test_snooze_wakes_only_for_a_request_or_a_failure(t3: T3Server, mcp: McpClient) -> None:
    """A snoozed thread stays snoozed through a completed run, wakes for a pending request or a
    run that failed after the snooze; t3_thread_list filters on snoozed; a past time is
    refused; unsnooze and visit work over /ws and the CLI."""
    tid = created(mcp, "first")
    until = "2099-01-01T00:00:00+00:00"
    assert command(t3, "thread.snooze", tid, snoozedUntil=until)["result"]["snoozedUntil"] == \
        "2099-01-01T00:00:00.000Z"
    shell = listed(mcp, tid, snoozed=True)
    assert (shell["snoozed"], shell["snoozedUntil"]) == (True, "2099-01-01T00:00:00.000Z")
    assert listed(mcp, tid, snoozed=False) is None
    created_ok = mcp.call("t3_thread_send", {"threadId": tid, "message": "hello"}).structured
    mcp.call("t3_thread_wait", {"threadId": tid, "runId": created_ok["runId"]})
    assert listed(mcp, tid)["snoozed"] is True  # a completed run keeps it snoozed
    mcp.call("t3_thread_send", {"threadId": tid, "message": "FAIL now"})
    wait_until(lambda: listed(mcp, tid)["status"] == "failed", 20)
    assert listed(mcp, tid, snoozed=False)["snoozed"] is False
    assert mcp.call("t3_thread_read", {"threadId": tid}).structured["thread"]["snoozed"] is False

    asker = created(mcp, "second", runtimeMode="approval-required")
    assert cli_json(t3, "snooze", asker, "2h")["snoozedUntil"] > "2020"
    assert "[snoozed]" in t3.cli("threads", "--snoozed").stdout
    mcp.call("t3_thread_send", {"threadId": asker, "message": "ASK_PERMISSION"})
    wait_until(lambda: listed(mcp, asker)["pendingRequestCount"] == 1, 20)
    assert listed(mcp, asker)["snoozed"] is False
    past = t3.cli("snooze", tid, "2001-01-01T00:00:00Z")
    assert past.returncode == 1 and "must be in the future" in past.stderr
    assert cli_json(t3, "unsnooze", tid)["snoozedUntil"] is None
    assert command(t3, "thread.visit", tid)["result"]["lastVisitedAt"]


def test_list_and_read_report_what_a_thread_waits_on(t3: T3Server, mcp: McpClient) -> None:
    """A parent whose turn ended while its delegated task still works reports
    blockedOnThreadWait and one pending background task, until the task ends."""
    call = json.dumps({"task": "SLOW:60 child", "mode": "async"})
    parent = mcp.call("create_threads", {"threads": [{"prompt": f"CALL_TOOL delegate_task {call}"
                                                      }]}).structured["threads"][0]["threadId"]
    wait_until(lambda: listed(mcp, parent)["status"] == "completed", 20)
    shell = listed(mcp, parent)
    assert (shell["blockedOnThreadWait"], shell["pendingBackgroundTasks"]) == (True, 1), shell
    detail = mcp.call("t3_thread_read", {"threadId": parent}).structured["thread"]
    assert (detail["blockedOnThreadWait"], detail["pendingBackgroundTasks"]) == (True, 1)
    wait_until(lambda: listed(mcp, parent)["pendingBackgroundTasks"] == 0, 30)
    assert listed(mcp, parent)["blockedOnThreadWait"] is False
