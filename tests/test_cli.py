"""The commands for people (`python t3.py threads|show|new|send|wait|interrupt|requests|answer|
tasks|schedules|schedule|unschedule`) run as real subprocesses against a real server, which they
reach only through `<data-dir>/server.json` and /ws: what they print, what `--json` prints, and
their exit codes."""

from __future__ import annotations

import asyncio
import calendar
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import t3 as server
from cli import WsClient
from harness import T3_PY, T3Server, raw_post, scripted_provider, wait_until


def cli(t3: T3Server, *args: str) -> subprocess.CompletedProcess[str]:
    """`python t3.py ARGS --data-dir <the server's>`."""
    return t3.cli(*args)


def ok_json(t3: T3Server, *args: str) -> Any:
    """The one JSON document a successful `ARGS --json` prints."""
    done = cli(t3, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def new(t3: T3Server, *args: str) -> str:
    done = cli(t3, "new", *args)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout.strip()


def short(thread_id: str) -> str:
    """The part of a CLI-made thread id a person types: it is unique."""
    return thread_id.rsplit(":", 1)[-1]


def test_new_and_show_until_done_print_the_streamed_answer(t3: T3Server) -> None:
    """`new` prints the id of a thread made by the CLI; `show --until-done` follows it to the end
    of its run and prints the conversation, then the run's end, and exits 0."""
    thread_id = new(t3, "SLOW:20 stream please")
    assert thread_id.startswith("thread:") and "\n" not in thread_id
    shown = cli(t3, "show", short(thread_id), "--until-done")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"SLOW:20 stream please  {thread_id}"
    assert "> SLOW:20 stream please" in lines
    assert "".join(f"chunk {i} " for i in range(20)) + "done" in lines
    assert lines[-1] == "--- run 1 completed"
    made = ok_json(t3, "show", thread_id)["thread"]
    assert (made["createdBy"], made["creationSource"]) == ("user", "cli")


def test_show_follow_json_sees_the_answer_grow_and_ctrl_c_ends_it(t3: T3Server) -> None:
    """A follower subscribed before the run starts gets one JSON object per line: the assistant
    message growing chunk by chunk, then the run completed; Ctrl-C ends it with exit 0, also
    when it was started as a script's background job (with SIGINT ignored)."""
    thread_id = new(t3)  # idle: nothing happens before the follower is subscribed
    follower = subprocess.Popen(
        [sys.executable, str(T3_PY), "show", thread_id, "--follow", "--json", "--data-dir",
         str(t3.data_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=t3.env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in follower.stdout],
                              daemon=True)
    reader.start()
    try:
        first = json.loads(lines.get(timeout=30))
        assert first["kind"] == "thread" and first["id"] == thread_id  # the snapshot: subscribed
        assert cli(t3, "send", thread_id, "SLOW:20").returncode == 0
        texts: list[str] = []
        while True:
            entry = json.loads(lines.get(timeout=30))
            if entry["kind"] == "item" and entry["type"] == "assistant_message":
                texts.append(entry["text"])
            if entry["kind"] == "run" and entry["status"] == "completed":
                break
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 0, follower.stderr.read() if follower.stderr else ""
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    grown = [t for i, t in enumerate(texts) if i == 0 or t != texts[i - 1]]
    assert len(grown) >= 3 and all(b.startswith(a) for a, b in itertools.pairwise(grown))
    assert grown[-1] == "".join(f"chunk {i} " for i in range(20)) + "done"


EVIL = "\x1b]0;pwned\x07 \x1b]52;c;ZXZpbA==\x07 \x1b[2J \x9b2J \u202eevil\u202c"
SHOWN = "\\x1b]0;pwned\\x07 \\x1b]52;c;ZXZpbA==\\x07 \\x1b[2J \\x9b2J <U+202E>evil<U+202C>"


def acts_on_a_terminal(text: str) -> bool:
    """Whether ``text`` holds a character a terminal acts on: C0 but newline and tab, DEL, C1,
    bidi marks, embeddings, overrides and isolates."""
    return any(ord(c) in range(0x20) and c not in "\n\t" or ord(c) in range(0x7F, 0xA0)
               or ord(c) in (0x61C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                             *range(0x2066, 0x206A)) for c in text)


def test_what_the_cli_prints_for_people_is_inert_and_json_is_exact(t3_factory, tmp_path: Path
                                                                   ) -> None:
    """OSC 0, OSC 52, ESC[2J, a C1 CSI and bidi overrides in what an agent wrote (its message,
    a file name in the diff), in a webhook body echoed back, and in a title and PR link an
    older t3 stored, print escaped for people: the terminal shows them and acts on none; a PR
    is named by its link's real host. --json keeps every string exact."""
    from test_workspace import make_repo
    make_repo(tmp_path / "workspace")
    t3 = t3_factory()
    name = "notes" + EVIL.replace(" ", "_") + ".txt"
    thread_id = new(t3, f"WRITE_FILE {name} kiwi\nECHO_PROMPT {EVIL}")
    assert cli(t3, "wait", thread_id).returncode == 0
    made = cli(t3, "schedule", "note: {{body.note}}", "--webhook", "--title", "hook")
    hook_url = made.stdout.splitlines()[1].rsplit(" ", 1)[1]
    assert raw_post(hook_url, json.dumps({"note": EVIL}).encode(),
                    {"Content-Type": "application/json"}).status == 202
    ran = wait_until(lambda: [t for t in ok_json(t3, "schedules")["tasks"]
                              if t["lastRunStatus"] == "succeeded"], 30, interval=0.3)[0][
        "lastRunThreadId"]

    shown, diff = cli(t3, "show", thread_id), cli(t3, "diff", thread_id)
    hooked = cli(t3, "show", ran, "--until-done")
    for done in (shown, diff, hooked):
        assert done.returncode == 0 and not acts_on_a_terminal(done.stdout), done
    assert f"ECHO_PROMPT {SHOWN}" in shown.stdout and SHOWN.replace(" ", "_") in diff.stdout
    assert f"note: {SHOWN}" in hooked.stdout
    items = ok_json(t3, "show", thread_id)["items"]
    assert items[0]["text"] == f"WRITE_FILE {name} kiwi\nECHO_PROMPT {EVIL}"
    assert [f["path"] for f in ok_json(t3, "diff", thread_id)["files"]] == [name]
    assert any(f"note: {EVIL}" in i["text"] for i in ok_json(t3, "show", ran)["items"])

    t3.stop()  # a title and a link as a t3 before these checks stored them
    pr = {"repository": "acme\u202e/widgets", "number": 7,
          "url": "https://github.com@evil.example/acme/widgets/pull/7"}
    [(payload,)] = t3.rows("SELECT payload_json FROM threads WHERE thread_id = ?", (thread_id,))
    t3.execute("UPDATE threads SET payload_json = ? WHERE thread_id = ?", (json.dumps(
        {**json.loads(payload), "title": "title " + EVIL, "linkedPullRequest": pr}), thread_id))
    t3.start()
    listed, shown = cli(t3, "threads"), cli(t3, "show", thread_id)
    for done in (listed, shown):
        assert done.returncode == 0 and not acts_on_a_terminal(done.stdout), done
    assert f"title {SHOWN}  [PR evil.example/acme<U+202E>/widgets#7]" in listed.stdout
    assert shown.stdout.startswith(f"title {SHOWN}  {thread_id}\n")
    assert "| PR evil.example/acme<U+202E>/widgets#7 https://github.com@evil" in shown.stdout
    [row] = [t for t in ok_json(t3, "threads")["threads"] if t["threadId"] == thread_id]
    assert (row["title"], row["linkedPullRequest"]) == ("title " + EVIL, pr)
    assert ok_json(t3, "show", thread_id)["thread"]["title"] == "title " + EVIL


def test_send_wait_interrupt_and_their_exit_codes(t3: T3Server) -> None:
    """`wait` exits 0 for a completed run (or none), 4 when its --timeout passes, 5 for an
    interrupted run; `send` starts a run; `interrupt` stops it, or says nothing runs."""
    thread_id = new(t3)
    idle = cli(t3, "wait", thread_id)
    assert (idle.returncode, idle.stdout.strip()) == (0, f"idle: {thread_id} has no run")
    sent = ok_json(t3, "send", short(thread_id), "hello there")
    assert sent["threadId"] == thread_id and sent["runId"]
    waited = cli(t3, "wait", short(thread_id), "--json")
    assert waited.returncode == 0, waited.stderr
    assert json.loads(waited.stdout)["status"] == "completed"
    shown = cli(t3, "show", thread_id).stdout
    assert "> hello there" in shown and "You said: hello there" in shown
    slow = ok_json(t3, "send", thread_id, "SLOW:400")
    early = cli(t3, "wait", thread_id, "--timeout", "0.2", "--json")
    assert early.returncode == 4 and json.loads(early.stdout)["timedOut"] is True
    interrupted = ok_json(t3, "interrupt", thread_id, "--reason", "enough")
    assert (interrupted["runId"], interrupted["status"]) == (slow["runId"], "interrupt_requested")
    ended = cli(t3, "wait", thread_id)
    assert ended.returncode == 5 and ended.stdout.startswith("interrupted: "), ended.stdout
    assert ended.stderr == ""  # piped: no progress line
    assert "(enough)" in ended.stdout
    again = cli(t3, "interrupt", thread_id)
    assert again.returncode == 0 and again.stdout.startswith("nothing to interrupt")


def test_requests_and_answer_an_approval(t3: T3Server) -> None:
    """On an approval-required thread, `wait` exits 4 naming the request, `requests` lists it,
    `answer` refuses free text for an approval (exit 2) and accepts `accept` given a unique
    part of the request id; the run then completes with the permission granted."""
    thread_id = new(t3, "--runtime-mode", "approval-required", "ASK_PERMISSION please")
    blocked = cli(t3, "wait", thread_id)
    assert blocked.returncode == 4 and blocked.stdout.startswith("needs an answer: command")
    [request] = ok_json(t3, "requests")["requests"]
    assert (request["threadId"], request["kind"]) == (thread_id, "command")
    assert request["requestId"] in blocked.stdout
    assert request["requestId"] in cli(t3, "requests", short(thread_id)).stdout
    refused = cli(t3, "answer", request["requestId"], "yes please")
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.splitlines()) == 1
    part = request["requestId"].split(":")[2]  # the provider session's uuid
    answered = ok_json(t3, "answer", part, "accept")
    assert answered["result"]["status"] == "resolved"
    assert cli(t3, "wait", thread_id).returncode == 0
    assert ok_json(t3, "requests") == {"requests": []}
    items = ok_json(t3, "show", thread_id)["items"]
    [approval] = [i for i in items if i["type"] == "approval_request"]
    assert approval["data"]["requestId"] == request["requestId"]
    assert any("permission granted" in i["text"] for i in items
               if i["type"] == "assistant_message")


def test_answer_a_question_with_one_text_per_question(t3_factory, tmp_path: Path) -> None:
    """A question's answers are given as TEXTs in question order, labels separated by commas
    for a multi-select one; the agent gets them keyed by question."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="grok", driver="grok")])
    thread_id = new(t3, "ASK_QUESTION")
    blocked = cli(t3, "wait", thread_id)
    assert blocked.returncode == 4 and "asks a question" in blocked.stdout
    [request] = ok_json(t3, "requests", thread_id)["requests"]
    wrong = cli(t3, "answer", request["requestId"], "red")
    assert wrong.returncode == 2 and "asks 2 question(s); 1. Which color?" in wrong.stderr
    assert cli(t3, "answer", request["requestId"], "red", "S,L").returncode == 0
    assert cli(t3, "wait", thread_id).returncode == 0
    expected = {"Which color?": "red", "Which sizes?": ["S", "L"]}
    assert "answered: " + json.dumps(expected, sort_keys=True, separators=(",", ":")) in \
        cli(t3, "show", thread_id).stdout


def test_tasks_prints_the_delegation_tree_and_threads_lists(t3: T3Server) -> None:
    """`tasks` shows a thread's delegated task and the task its child delegated in turn, with
    statuses and child thread ids; `threads` lists top-level threads, `--all` the children too,
    and a part of an id shared by several threads is refused as ambiguous (exit 1)."""
    inner = json.dumps({"task": "hi there", "title": "Inner", "mode": "wait"})
    outer = {"task": f"CALL_TOOL delegate_task {inner}", "title": "Outer", "mode": "wait"}
    thread_id = new(t3, f"CALL_TOOL delegate_task {json.dumps(outer)}")
    assert cli(t3, "wait", thread_id).returncode == 0
    tree = ok_json(t3, "tasks", short(thread_id))
    assert (tree["threadId"], tree["status"]) == (thread_id, "completed")
    [task] = tree["tasks"]
    assert (task["title"], task["status"]) == ("Outer", "completed")
    [nested] = task["tasks"]
    assert (nested["title"], nested["status"], nested["tasks"]) == ("Inner", "completed", [])
    printed = cli(t3, "tasks", thread_id).stdout.splitlines()
    assert printed[1] == f"`-- Outer (completed)  {task['threadId']}  scripted"
    assert printed[2] == f"    `-- Inner (completed)  {nested['threadId']}  scripted"
    listed = ok_json(t3, "threads")
    assert [t["threadId"] for t in listed["threads"]] == [thread_id]
    everything = {t["threadId"]: t for t in ok_json(t3, "threads", "--all")["threads"]}
    assert set(everything) == {thread_id, task["threadId"], nested["threadId"]}
    assert everything[nested["threadId"]]["parentThreadId"] == task["threadId"]
    row = cli(t3, "threads").stdout.strip()
    assert row.startswith("completed") and thread_id in row
    ambiguous = cli(t3, "show", "thread:")
    assert ambiguous.returncode == 1 and ambiguous.stdout == ""
    assert ambiguous.stderr.startswith("t3: ambiguous_reference: ")


# Fri 2026-03-06 12:00 in New York; the server and the commands share its time zone.
START = calendar.timegm((2026, 3, 6, 17, 0, 0))
CLOCK = {"T3_TEST_HOOKS": "1", "T3_TEST_CLOCK": str(START), "TZ": "America/New_York"}


def advance_until_run(t3: T3Server, seconds: float, task_id: str, runs: int) -> None:
    """Move the server's clock over /ws, then follow the shell stream (no polling) until the
    task's ``runs``-th run has ended."""
    async def run() -> None:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            stream = client.stream("subscribeShell", {})
            tasks = (await anext(stream))["snapshot"]["schedules"]
            await client.request("advanceTestClock", {"seconds": seconds})
            async for item in stream:
                tasks = [item["task"]] if item["kind"] == "schedule.updated" else tasks
                if any(t["scheduledTaskId"] == task_id and t["runCount"] == runs
                       and t["lastRunStatus"] in ("succeeded", "failed") for t in tasks):
                    break
            await stream.aclose()
    asyncio.run(run())


def row_of(listing: str, task_id: str) -> list[str]:
    """The cells of a task's row in `schedules` (two or more spaces apart)."""
    [line] = [line for line in listing.splitlines() if line.startswith(task_id)]
    return re.split(r"\s{2,}", line.strip())


def test_schedule_schedules_and_unschedule_follow_the_clock(t3_factory) -> None:
    """`schedule` makes tasks the user's (creationSource cli) and prints their id; `schedules`
    lists them in words with next run, last run and run count (paused ones with --all), and
    shows the run count and next run move after the clock does; `--id` by a unique part
    changes and runs one now; a webhook task prints its URL once (--standard-webhooks takes the
    Standard Webhooks scheme); usage errors exit 2, a
    refused schedule 1; `unschedule` deletes."""
    t3 = t3_factory(env=CLOCK)
    made = cli(t3, "schedule", "check the build", "--every", "15m", "--title", "nightly")
    assert made.returncode == 0 and made.stderr == "", made.stderr
    nightly = made.stdout.strip()
    assert nightly.startswith("scheduled-task:cli:") and "\n" not in nightly
    standup = ok_json(t3, "schedule", "standup", "--at", "9:00", "--weekdays", "mon-fri",
                      "--disabled")
    assert standup["schedule"] == {"type": "fixed_time", "timeOfDay": "09:00",
                                   "weekdays": [1, 2, 3, 4, 5]}
    assert (standup["enabled"], standup["createdBy"], standup["creationSource"]) == (
        False, "user", "cli")
    listing = cli(t3, "schedules").stdout
    assert listing.splitlines()[0].split() == ["ID", "TITLE", "SCHEDULE", "ENABLED", "NEXT",
                                               "RUN", "LAST", "RUN", "RUNS"]
    assert row_of(listing, nightly) == [nightly, "nightly", "every 15 min", "yes",
                                        "2026-03-06 12:15", "never", "0"]
    assert standup["scheduledTaskId"] not in listing
    assert listing.splitlines()[-1] == "(1 paused; --all shows them)"
    assert row_of(cli(t3, "schedules", "--all").stdout, standup["scheduledTaskId"])[2:5] == [
        "09:00 Mon-Fri", "paused", "-"]

    advance_until_run(t3, 15 * 60, nightly, 1)
    assert row_of(cli(t3, "schedules").stdout, nightly)[4:] == [
        "2026-03-06 12:30", "succeeded 2026-03-06 12:15", "1"]
    changed = ok_json(t3, "schedule", "--id", nightly[-12:], "--every", "1h", "--run-now")
    assert changed["schedule"] == {"type": "interval", "everyMs": 3_600_000}
    assert (changed["runCount"], changed["nextRunAt"]) == (2, "2026-03-06T18:15:00.000Z")

    hooked = cli(t3, "schedule", "on push", "--webhook", "--secret-header", "X-Sig",
                 "--secret", "s3cret-value", "--prefix", "sha256=")
    hook_id, url_line = hooked.stdout.splitlines()
    assert url_line.startswith("webhook URL (shown only now") and f"/hooks/{hook_id}/" in url_line
    everything = cli(t3, "schedules", "--all", "--json").stdout
    assert "s3cret-value" not in everything and "hookUrl" not in everything
    assert {t["scheduledTaskId"] for t in json.loads(everything)["tasks"]} == {
        nightly, standup["scheduledTaskId"], hook_id}
    assert row_of(cli(t3, "schedules").stdout, hook_id)[2] == "webhook"
    standard = ok_json(t3, "schedule", "on event", "--webhook", "--standard-webhooks",
                       "--secret", "whsec_" + "QUJD" * 8)
    assert standard["schedule"]["signature"] == {"scheme": "standard-webhooks"}

    for usage in (["schedule", "no schedule"], ["schedule", "x", "--every", "15m", "--at", "9:00"],
                  ["schedule", "x", "--every", "15m", "--weekdays", "mon"],
                  ["schedule", "x", "--every", "soon"], ["schedule", "x", "--secret", "s"],
                  ["schedule", "x", "--webhook", "--standard-webhooks"]):
        assert cli(t3, *usage).returncode == 2, usage
    for refused in (["--every", "30s"], ["--at", "25:00"]):  # the server checks values
        done = cli(t3, "schedule", "x", *refused)
        assert done.returncode == 1 and done.stderr.startswith("t3: invalid_request: "), done
    ambiguous = cli(t3, "unschedule", "schedule-task")
    assert ambiguous.returncode == 1 and "ambiguous_reference" in ambiguous.stderr
    gone = cli(t3, "unschedule", nightly[-12:])
    assert (gone.returncode, gone.stdout.strip()) == (0, f"deleted {nightly}")
    again = cli(t3, "unschedule", nightly)
    assert again.returncode == 1 and again.stderr.startswith("t3: task_not_found: ")
    assert nightly not in cli(t3, "schedules", "--all").stdout


def test_options_that_exclude_each_other_are_a_usage_error(t3: T3Server) -> None:
    """new's workspace options that cannot go together exit 2 (usage), one line on stderr,
    and make nothing."""
    for args in (("--worktree", "main", "--existing-worktree", "."), ("--branch", "b")):
        done = cli(t3, "new", "hello", *args)
        assert done.returncode == 2 and done.stdout == "", done
        assert done.stderr.startswith("t3: --") and len(done.stderr.splitlines()) == 1, done
    assert cli(t3, "threads", "--json").stdout.count('"threadId"') == 0


def test_no_server_is_one_clear_line_and_exit_3(t3_factory, tmp_path: Path) -> None:
    """With no data directory, no server.json, or a server.json left by a killed server, every
    command prints one line on stderr, nothing on stdout, and exits 3; a typed failure from a
    live server is `t3: <code>: <message>` and exit 1."""
    def refused(data_dir: Path, *args: str) -> str:
        done = subprocess.run([sys.executable, str(T3_PY), *args, "--data-dir", str(data_dir)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert (done.returncode, done.stdout) == (3, ""), done
        [line] = done.stderr.splitlines()
        return line
    assert "no such directory" in refused(tmp_path / "absent", "threads")
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    assert refused(empty, "wait", "x", "--json") == (
        f"t3: no server is running for {empty} (no server.json); start one with "
        f"`python t3.py --data-dir {empty}`")
    t3 = t3_factory()
    missing = cli(t3, "show", "no-such-thread")
    assert missing.returncode == 1 and missing.stderr.startswith("t3: thread_not_found: ")
    t3.kill9()
    assert (t3.data_dir / "server.json").exists()
    assert "server.json is stale" in refused(t3.data_dir, "requests")


def test_help_documents_every_command_and_the_exit_codes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`python t3.py --help` names every command and the exit codes; each command's --help
    documents its own options and the exit codes too."""
    done = subprocess.run([sys.executable, str(T3_PY), "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "100"}, check=False)
    assert done.returncode == 0, done.stderr
    commands = ["threads", "show", "new", "send", "wait", "interrupt", "requests", "answer",
                "tasks", "schedules", "schedule", "unschedule"]
    for name in ["serve", "token", *commands]:
        assert f"\n    {name} " in done.stdout, name
    assert "exit codes" in done.stdout and "\n  4 " in done.stdout

    def help_of(name: str) -> str:  # in process: the same parser, without 9 more interpreters
        with pytest.raises(SystemExit) as exited:
            server.main([name, "--help"])
        assert exited.value.code == 0
        return capsys.readouterr().out
    for name in commands:
        text = help_of(name)
        assert "--json" in text and "--data-dir" in text and "\n  3 " in text, name
    assert "--follow" in help_of("show") and "--timeout" in help_of("wait")
    assert all(option in help_of("schedule") for option in (
        "--every", "--at", "--weekdays", "--webhook", "--secret", "--id", "--run-now",
        "--rotate-hook-token", "--disable"))


@pytest.mark.parametrize(("argv", "lazy"), [
    ([], True), (["serve"], True), (["--port=0"], True), (["--port", "0"], True),
    (["--port", "0", "--data-dir", "/d", "serve", "--config", "/c"], True),
    (["token", "--rotate", "--data-dir", "threads"], True), (["--data-dir", "show", "token"], True),
    (["threads"], False), (["--port", "0", "show", "th-1"], False), (["bogus"], False),
    (["--data", "/d", "serve"], False), (["serve", "--help"], False), (["-h"], False)])
def test_serving_parses_its_command_line_as_the_full_parser_does(argv: list[str],
                                                                 lazy: bool) -> None:
    """Serve and token skip the people commands' parsers: a command line read without them
    gives what the full parser gives; one that names such a command, asks for help or is unsure
    (an abbreviated option) gets them all."""
    def parse(people: bool) -> object:
        try:
            return server._parser(people=people).parse_args(argv)
        except SystemExit as exc:
            return exc.code
    assert server._names_no_command_for_people(argv) == lazy
    if lazy:
        assert parse(False) == parse(True)
