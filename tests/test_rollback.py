"""Rollback (issue 12, item 5): `checkpoint.rollback` restores a thread's workspace to run N's
checkpoint, marks the later runs `rolled_back` and their checkpoints stale (refs deleted), and
the next message continues from run N's context: the scripted ACP agent (no native rollback)
gets a fresh session with a full-thread handoff of runs 1..N; the real codex CLI rolls its own
thread back. Reached over /ws (rollbackThread, dispatchCommand) and the CLI (`rollback`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli import WsError
from fake_model import FakeModelServer
from harness import T3Server, agent_log, wait_until
from real_cli import codex_provider, create
from real_cli import wait as real_wait
from test_checkpoints import checkpoints, finished, projection, project_repo, ws
from test_lifecycle_stop import cli_json, runs
from test_schedules import prompts
from test_workspace import git


def two_runs(t3: T3Server, repo: Path) -> tuple[str, dict[int, dict[str, Any]]]:
    """Run 1 edits a.txt; run 2 edits it again and creates b.txt; an ignored file of the
    user's (build/) sits in the checkout throughout."""
    (repo / "build").mkdir()
    (repo / "build" / "cache.bin").write_text("user's build output\n")
    mcp = t3.client()
    tid = finished(mcp, "WRITE_FILE a.txt kiwi")["threadId"]
    finished(mcp, "WRITE_FILE a.txt mango\nWRITE_FILE b.txt new", tid)
    assert (repo / "a.txt").read_text() == "mango\n" and (repo / "b.txt").exists()
    return tid, checkpoints(t3, tid)


def test_rollback_to_run_1_restores_files_and_the_next_run_continues_from_run_1(
        tmp_path: Path, t3_factory: Any, agent_log_path: Path) -> None:
    """rollbackThread to run 1: run 2's edit and created file are gone, the user's ignored and
    untracked files stay, run 2 is rolled_back and checkpoint 2 stale with its ref deleted;
    the next message is run 3 in a fresh agent session whose prompt carries a handoff with
    run 1's text and not run 2's; run 3's checkpoint is measured from checkpoint 1."""
    repo = project_repo(tmp_path)
    t3 = t3_factory()
    tid, cps = two_runs(t3, repo)
    done = ws(t3, "rollbackThread", {"threadId": tid, "runOrdinal": 1})
    assert (done["status"], done["ordinal"], done["checkpointId"]) == (
        "completed", 1, cps[1]["id"]), done
    assert (repo / "a.txt").read_text() == "kiwi\n" and not (repo / "b.txt").exists()
    assert (repo / "build" / "cache.bin").read_text() == "user's build output\n"
    assert (repo / "notes.txt").read_text() == "untracked\n"
    mcp = t3.client()
    by_ordinal = runs(mcp, tid)
    assert [by_ordinal[n]["status"] for n in (1, 2)] == ["completed", "rolled_back"]
    assert done["rolledBackRunIds"] == [by_ordinal[2]["runId"]]
    after = checkpoints(t3, tid)
    assert (after[1]["status"], after[2]["status"]) == ("ready", "stale")
    assert subprocess.run(["git", "rev-parse", "--verify", "-q", cps[2]["ref"]], cwd=repo,
                          capture_output=True).returncode != 0
    seen = projection(t3, tid)
    roots = {n["runId"]: n["status"] for n in seen["nodes"] if n["kind"] == "root_turn"}
    assert roots[by_ordinal[2]["runId"]] == "rolled_back"
    assert [i["status"] for i in seen["turnItems"] if i["type"] == "rollback"] == ["completed"]

    finished(mcp, "WRITE_FILE c.txt after", tid)
    third = prompts(agent_log_path)[-1]
    assert third.startswith("Context handoff (full_thread_summary):\n"), third
    assert "Covered app runs: 1-1\n" in third and "- User: WRITE_FILE a.txt kiwi" in third
    assert "mango" not in third and third.endswith("User message:\nWRITE_FILE c.txt after")
    methods = [e["msg"].get("method") for e in agent_log(agent_log_path) if e["dir"] == "in"]
    assert methods.count("session/new") == 2, methods  # run 3: a fresh session, not a load
    by_ordinal = runs(mcp, tid)
    assert sorted(by_ordinal) == [1, 2, 3] and by_ordinal[3]["status"] == "completed"
    cp3 = checkpoints(t3, tid)[3]
    assert cp3["parentCheckpointId"] == cps[1]["id"]
    assert {f["path"] for f in cp3["files"]} == {"c.txt"}
    assert (repo / "a.txt").read_text() == "kiwi\n"


def test_rollback_refusals_are_typed_and_change_nothing(tmp_path: Path, t3_factory: Any) -> None:
    """A checkpoint of another thread, an unknown run, a stale checkpoint, a thread with a
    running run, and no target at all: each refused with its code; the files, runs and events
    are untouched."""
    repo = project_repo(tmp_path)
    t3 = t3_factory()
    tid, cps = two_runs(t3, repo)
    other = finished(t3.client(), "hello")["threadId"]
    before = (projection(t3, tid), (repo / "a.txt").read_text())

    def refused(params: dict[str, Any]) -> str:
        with pytest.raises(WsError) as failed:
            ws(t3, "rollbackThread", params)
        return f"{failed.value.code}: {failed.value}"
    assert "invalid_request" in refused({"threadId": tid, "checkpointId": checkpoints(
        t3, other)[1]["id"]})
    assert "run_not_found" in refused({"threadId": tid, "runOrdinal": 7})
    assert "invalid_request" in refused({"threadId": tid})
    assert "invalid_request" in refused({"threadId": tid, "runOrdinal": 1,
                                         "checkpointId": cps[1]["id"]})
    assert (projection(t3, tid), (repo / "a.txt").read_text()) == before
    ws(t3, "rollbackThread", {"threadId": tid, "runOrdinal": 1})
    assert "invalid_request" in refused({"threadId": tid, "checkpointId": cps[2]["id"]})
    mcp = t3.client()
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "ASK_PERMISSION"})
    assert sent.ok, sent.structured
    busy = refused({"threadId": tid, "runOrdinal": 0})
    assert "thread_not_sendable" in busy and "run 3 is" in busy
    assert (repo / "a.txt").read_text() == "kiwi\n"


def test_cli_rollback_round_trip(tmp_path: Path, t3_factory: Any) -> None:
    """`t3.py rollback THREAD --run 0 --json` takes the thread back to its baseline (both runs
    rolled back, the files as before run 1); a run that does not exist exits non-zero."""
    repo = project_repo(tmp_path)
    t3 = t3_factory()
    tid, _ = two_runs(t3, repo)
    done = cli_json(t3, "rollback", tid, "--run", "0")
    assert (done["status"], done["ordinal"], len(done["rolledBackRunIds"])) == (
        "completed", 0, 2)
    assert (repo / "a.txt").read_text() == "one\ntwo\n" and not (repo / "b.txt").exists()
    assert [r["status"] for _, r in sorted(runs(t3.client(), tid).items())] == [
        "rolled_back", "rolled_back"]
    missing = t3.cli("rollback", tid, "--run", "9")
    assert missing.returncode != 0 and "run_not_found" in missing.stdout + missing.stderr
    plain = t3.cli("rollback", tid, "--run", "0")
    assert plain.returncode == 0 and "back to run 0" in plain.stdout
    shown = t3.cli("show", tid).stdout
    assert "--- run 2 (rolled_back)" in shown and \
        "[rollback] Rollback to checkpoint 0 (completed)" in shown, shown


@pytest.mark.real_cli
def test_real_codex_rollback_drops_run_2_from_the_next_model_request(
        model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> None:
    """The real codex CLI (fake model) in a git repository: two turns, rollback to run 1 (files
    restored, codex's own thread rolled back); the next model request carries run 1's user
    text and not run 2's."""
    repo = project_repo(tmp_path)
    t3 = t3_factory(providers=[codex_provider(tmp_path, model.url)])
    mcp = t3.client()
    tid = create(mcp, "remember the kiwi", target={"providerInstanceId": "codex"})["threadId"]
    assert real_wait(mcp, tid)["status"] == "completed"
    (repo / "a.txt").write_text("changed by run 2\n")  # what run 2's checkpoint records
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "remember the mango"})
    assert real_wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    done = ws(t3, "rollbackThread", {"threadId": tid, "runOrdinal": 1})
    assert done["status"] == "completed", done
    assert (repo / "a.txt").read_text() == "one\ntwo\n"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "what do you remember?"})
    assert real_wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    last = json.dumps([r["body"] for r in model.requests
                       if "what do you remember?" in json.dumps(r["body"])][-1])
    assert "remember the kiwi" in last and "remember the mango" not in last, last
    assert "Context handoff" not in last  # codex rolled back its own thread: no handoff
    assert [r["status"] for _, r in sorted(runs(mcp, tid).items())] == [
        "completed", "rolled_back", "completed"]
    assert git(repo, "status", "--porcelain").count("a.txt") == 0


def test_kill_9_before_the_rollback_finishes_converges_after_restart(
        tmp_path: Path, t3_factory: Any) -> None:
    """A rollback sent as dispatchCommand checkpoint.rollback (answered at once); the server
    SIGKILLs itself after the files are restored, just before the runs are marked. After a
    restart the effect runs again: the rollback completes, run 2 is rolled_back, the files are
    run 1's, and the next message is run 3."""
    repo = project_repo(tmp_path)
    t3 = t3_factory(env={"T3_TEST_HOOKS": "1",
                         "T3_CRASH_AT": "before-commit:checkpoint.rollback-finish"})
    tid, cps = two_runs(t3, repo)
    sent = ws(t3, "dispatchCommand", {"type": "checkpoint.rollback", "commandId": "rb-1",
                                      "threadId": tid, "checkpointId": cps[1]["id"]})
    assert sent["result"]["rolledBackRunIds"] and sent["commandType"] == "checkpoint.rollback"
    wait_until(lambda: not t3.running, timeout=30)
    assert (repo / "a.txt").read_text() == "kiwi\n"  # restored before the kill
    t3.env.pop("T3_CRASH_AT")
    t3.restart()
    wait_until(lambda: [i["status"] for i in projection(t3, tid)["turnItems"]
                        if i["type"] == "rollback"] == ["completed"], timeout=30)
    mcp = t3.client()
    assert [r["status"] for _, r in sorted(runs(mcp, tid).items())] == [
        "completed", "rolled_back"]
    assert (repo / "a.txt").read_text() == "kiwi\n" and not (repo / "b.txt").exists()
    assert checkpoints(t3, tid)[2]["status"] == "stale"
    finished(mcp, "hello again", tid)
    assert sorted(runs(mcp, tid)) == [1, 2, 3]
