"""Checkpoints and diffs (issue 12, items 3 and 4) against a real server, the scripted ACP agent
(its WRITE_FILE / DELETE_FILE lines edit the project) and small local git repositories: a
baseline before the first run, a capture after each root turn with the files it changed, the
user's checkout untouched, diffs over MCP (t3_thread_diff), /ws, the CLI and the web view, a
workspace outside git, a git failure, and kill -9 in the middle of a capture."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from cli import WsClient, WsError
from harness import McpClient, T3Server, wait_until
from test_web import (Steps, browser, create, lines_with, log_in,  # noqa: F401 (fixture)
                      sent_by_page)
from test_workspace import git, make_repo, user_state

EDIT = ("WRITE_FILE a.txt one\\nthree\nWRITE_FILE src/new.py print('hi')\n"
        "DELETE_FILE gone.txt")


def ws(t3: T3Server, method: str, params: dict[str, Any]) -> Any:
    async def call() -> Any:
        async with WsClient(t3.url + "/ws", t3.token) as client:
            return await client.request(method, params)
    return asyncio.run(call())


def project_repo(tmp_path: Path) -> Path:
    """The default project's folder as a git repository with a staged and an untracked change,
    so that its index and status have something to lose."""
    repo = make_repo(tmp_path / "workspace")
    (repo / "staged.txt").write_text("staged\n")
    git(repo, "add", "staged.txt")
    (repo / "notes.txt").write_text("untracked\n")
    return repo


def finished(mcp: McpClient, prompt: str, thread_id: str | None = None) -> dict[str, Any]:
    """Start a thread (or send to one) and wait for its run to complete; its projection."""
    if thread_id is None:
        thread_id = mcp.call("create_threads", {"threads": [{"prompt": prompt}]}).structured[
            "threads"][0]["threadId"]
    else:
        mcp.call("t3_thread_send", {"threadId": thread_id, "message": prompt})
    waited = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 30_000}).structured
    assert waited["status"] == "completed", waited
    return {"threadId": thread_id}


def projection(t3: T3Server, thread_id: str) -> dict[str, Any]:
    return ws(t3, "getThreadProjection", {"threadId": thread_id})["projection"]


def checkpoints(t3: T3Server, thread_id: str) -> dict[int, dict[str, Any]]:
    return {c["ordinal"]: c for c in projection(t3, thread_id)["checkpoints"]}


def by_path(files: list[dict[str, Any]]) -> dict[str, tuple[str, int, int]]:
    return {f["path"]: (f["kind"], f["additions"], f["deletions"]) for f in files}


CHANGED = {"a.txt": ("modified", 1, 1), "src/new.py": ("added", 1, 0),
           "gone.txt": ("deleted", 0, 1)}


def test_a_run_that_edits_files_ends_with_a_checkpoint_of_its_changes(
        tmp_path: Path, t3_factory: Any) -> None:
    """Baseline 0 and checkpoint 1 are ready hidden refs; checkpoint 1 lists the edited, created
    and deleted files with their line counts; the run's checkpointId names it and the timeline
    has its `checkpoint` item; the user's status, branches, stash, HEAD and index bytes are the
    same as before; a second run's checkpoint lists only its own change. Deleting the thread
    deletes its hidden refs, and only its own."""
    repo = project_repo(tmp_path)
    t3 = t3_factory()
    mcp = t3.client()
    before = user_state(repo)
    tid = finished(mcp, EDIT)["threadId"]
    seen = projection(t3, tid)
    cps = {c["ordinal"]: c for c in seen["checkpoints"]}
    assert sorted(cps) == [0, 1] and {c["status"] for c in cps.values()} == {"ready"}
    assert by_path(cps[1]["files"]) == CHANGED and cps[0]["files"] == []
    assert seen["runs"][0]["checkpointId"] == cps[1]["id"] and cps[1]["runId"] == seen["runs"][0]["id"]
    assert git(repo, "rev-parse", cps[1]["ref"]).strip() == cps[1]["commit"]
    assert cps[1]["ref"].startswith("refs/t3/checkpoints/")
    item = next(i for i in seen["turnItems"] if i["type"] == "checkpoint")
    assert item["data"]["checkpointId"] == cps[1]["id"] and by_path(item["data"]["files"]) == CHANGED
    after = user_state(repo)
    assert after["index"] == before["index"] and after["head"] == before["head"]
    assert after["branches"] == before["branches"] and after["stash"] == before["stash"]
    # the agent's edits are in the status, and nothing else changed in it
    assert git(repo, "status", "--porcelain").splitlines() == [
        " M a.txt", " D gone.txt", "A  staged.txt", "?? notes.txt", "?? src/"]
    finished(mcp, "WRITE_FILE notes.txt changed", tid)
    cps = checkpoints(t3, tid)
    assert by_path(cps[2]["files"]) == {"notes.txt": ("modified", 1, 1)}
    assert list((t3.data_dir / "git-index").iterdir()) == []
    other = finished(mcp, "WRITE_FILE other.txt o")["threadId"]
    kept = git(repo, "for-each-ref", "--format=%(refname)",
               checkpoints(t3, other)[1]["ref"].rsplit("/", 1)[0])
    assert t3.cli("delete", tid).returncode == 0
    wait_until(lambda: git(repo, "for-each-ref", "--format=%(refname)", "refs/t3") == kept, 30,
               message="the deleted thread's checkpoint refs are gone, the other's kept")
    assert len(kept.split()) == 2 and cps[2]["ref"] not in kept


def test_diffs_of_a_run_and_of_the_thread_over_mcp_ws_and_the_cli(
        tmp_path: Path, t3_factory: Any) -> None:
    """t3_thread_diff (by ordinal), getTurnDiff (by run id) and `t3.py diff --run` show run 1's
    change (`t3.py show` lists its files); getFullThreadDiff and `t3.py diff` span both runs; a run that does not exist is
    run_not_found, a running one's diff is pending, getTurnDiff without a run is refused."""
    project_repo(tmp_path)
    t3 = t3_factory()
    mcp = t3.client()
    tid = finished(mcp, EDIT)["threadId"]
    finished(mcp, "WRITE_FILE b.txt bee", tid)
    run1 = mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 1}).structured
    assert run1["status"] == "ready" and by_path(run1["files"]) == CHANGED
    assert "-two\n+three\n" in run1["diff"] and "+print('hi')" in run1["diff"]
    assert "b.txt" not in run1["diff"] and run1["truncated"] is False
    by_id = ws(t3, "getTurnDiff", {"threadId": tid, "runId": run1["runId"]})
    assert by_id == run1
    whole = ws(t3, "getFullThreadDiff", {"threadId": tid})
    assert by_path(whole["files"]) == {**CHANGED, "b.txt": ("added", 1, 0)}
    assert whole["runId"] is None and whole["toCheckpointId"].endswith(":2")
    assert mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 3}).failure_code == \
        "run_not_found"
    refused = t3.cli("diff", tid[-12:], "--run", "9")
    assert refused.returncode == 1 and "run_not_found" in refused.stderr
    cli = t3.cli("diff", tid[-12:], "--run", "1")
    assert cli.returncode == 0, cli.stderr
    assert "modified  +1     -1     a.txt" in cli.stdout and "+three" in cli.stdout
    assert json.loads(t3.cli("diff", tid[-12:], "--json").stdout) == whole
    shown = t3.cli("show", tid[-12:])
    assert "[checkpoint] Checkpoint 1: 3 file(s) changed" in shown.stdout, shown.stdout
    assert "modified +1 -1 a.txt" in shown.stdout
    mcp.call("t3_thread_send", {"threadId": tid, "message": "SLOW:40"})  # about 2 s
    pending = mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 3}).structured
    assert pending["status"] == "pending" and "run 3 is" in pending["reason"], pending
    try:
        ws(t3, "getTurnDiff", {"threadId": tid})
        raise AssertionError("getTurnDiff without a run was accepted")
    except WsError as exc:
        assert exc.code == "invalid_request"


def test_a_workspace_outside_git_gets_missing_checkpoints_and_the_run_completes(
        t3: T3Server, mcp: McpClient) -> None:
    """The default project folder is not a repository: checkpoints 0 and 1 are missing (no
    ref), the run completes with checkpointId set, the timeline has no checkpoint item, and the
    diff says missing (the CLI exits 1)."""
    tid = finished(mcp, "WRITE_FILE a.txt hello")["threadId"]
    seen = projection(t3, tid)
    assert {c["ordinal"]: c["status"] for c in seen["checkpoints"]} == {0: "missing",
                                                                      1: "missing"}
    assert seen["runs"][0]["status"] == "completed" and seen["runs"][0]["checkpointId"]
    assert not any(i["type"] == "checkpoint" for i in seen["turnItems"])
    found = mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 1}).structured
    assert found["status"] == "missing" and "not in a git repository" in found["reason"]
    assert t3.cli("diff", tid[-12:]).returncode == 1


def test_a_git_failure_makes_an_error_checkpoint_and_the_run_completes(
        tmp_path: Path, t3_factory: Any) -> None:
    """A file where git keeps refs/t3 makes every capture fail: the run still completes, its
    checkpoint is `error` with git's reason, shown in the timeline and the diff."""
    repo = project_repo(tmp_path)
    (repo / ".git" / "refs" / "t3").write_text("in the way\n")
    t3 = t3_factory()
    mcp = t3.client()
    tid = finished(mcp, EDIT)["threadId"]
    seen = projection(t3, tid)
    cps = {c["ordinal"]: c for c in seen["checkpoints"]}
    assert cps[0]["status"] == "missing" and cps[1]["status"] == "error"
    assert "git update-ref" in cps[1]["statusReason"]
    assert seen["runs"][0]["status"] == "completed"
    assert seen["runs"][0]["checkpointId"] == cps[1]["id"]
    item = next(i for i in seen["turnItems"] if i["type"] == "checkpoint")
    assert item["data"]["status"] == "error" and "update-ref" in item["data"]["reason"]
    found = mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 1}).structured
    assert found["status"] == "error" and "update-ref" in found["reason"]


def test_an_agent_editing_only_files_gets_no_command_run_by_t3s_git(
        tmp_path: Path, t3_factory: Any) -> None:
    """An auto-accept-edits agent rewrites `.git/config` with a core.fsmonitor, a clean and
    smudge filter and a textconv and external diff for the files `.gitattributes` selects: its
    turn's checkpoint is ready, t3_thread_diff shows the change, and a worktree launch from its
    branch starts, with none of those commands run."""
    marks = tmp_path / "marks"
    marks.mkdir()
    repo = project_repo(tmp_path)
    (repo / ".gitattributes").write_text("*.txt filter=evil diff=evil\n")
    git(repo, "add", ".gitattributes")
    git(repo, "commit", "-qm", "attributes")
    t3 = t3_factory()
    mcp = t3.client()

    def m(name: str) -> str:
        return f'"touch {marks}/{name}; false"'
    config = "\\n".join([
        "[core]", "repositoryformatversion = 0", "bare = false", f"fsmonitor = {m('fsmonitor')}",
        '[filter "evil"]', f"clean = {m('clean')}", f"smudge = {m('smudge')}", "required = true",
        '[diff "evil"]', f"textconv = {m('textconv')}", "[diff]", f"external = {m('external')}"])
    tid = mcp.call("create_threads", {"threads": [{
        "prompt": f"WRITE_FILE .git/config {config}\nWRITE_FILE a.txt changed",
        "runtimeMode": "auto-accept-edits"}]}).structured["threads"][0]["threadId"]
    waited = mcp.call("t3_thread_wait", {"threadId": tid, "timeoutMs": 30_000}).structured
    assert waited["status"] == "completed", waited
    assert "fsmonitor" in (repo / ".git" / "config").read_text()
    ran = lambda: sorted(p.name for p in marks.iterdir())  # noqa: E731
    assert ran() == []
    cps = checkpoints(t3, tid)
    assert cps[1]["status"] == "ready" and "a.txt" in by_path(cps[1]["files"]), cps[1]
    found = mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 1}).structured
    assert ran() == [] and found["status"] == "ready" and "+changed" in found["diff"], found
    launched = mcp.call("t3_thread_launch", {"message": "ECHO_CWD", "workspaceStrategy": {
        "type": "worktree", "baseRef": "main"}}).structured
    waited = mcp.call("t3_thread_wait", {"threadId": launched["threadId"],
                                         "timeoutMs": 30_000}).structured
    assert waited["status"] == "completed", waited
    assert ran() == []
    assert (Path(launched["worktreePath"]) / "a.txt").read_text() == "one\ntwo\n"

def test_kill_9_during_a_capture_leaves_no_index_or_ref_and_the_run_completes_after_restart(
        tmp_path: Path, t3_factory: Any) -> None:
    """The server SIGKILLs itself inside run 1's capture (its temporary index written, no ref
    yet). After a restart the run's finalization runs again: the run completes with the right
    checkpoint, the stray index is gone, no lock file is left under refs/t3, and the user's
    checkout reads as before."""
    repo = project_repo(tmp_path)
    before = user_state(repo)
    t3 = t3_factory(env={"T3_TEST_HOOKS": "1", "T3_CRASH_AT": "checkpoint:capture:1"})
    mcp = t3.client()
    tid = mcp.call("create_threads", {"threads": [{"prompt": EDIT}]}).structured[
        "threads"][0]["threadId"]
    wait_until(lambda: not t3.running, timeout=30)
    assert len(list((t3.data_dir / "git-index").iterdir())) == 1  # the capture's own index
    assert git(repo, "for-each-ref", "refs/t3").count("\n") == 1  # only the baseline
    t3.env.pop("T3_CRASH_AT")
    t3.restart()
    waited = mcp.call("t3_thread_wait", {"threadId": tid, "timeoutMs": 30_000}).structured
    assert waited["status"] == "completed", waited
    cps = checkpoints(t3, tid)
    assert cps[1]["status"] == "ready" and by_path(cps[1]["files"]) == CHANGED
    assert list((t3.data_dir / "git-index").iterdir()) == []
    assert not [p for p in (repo / ".git" / "refs" / "t3").rglob("*") if p.suffix == ".lock"]
    refs = git(repo, "for-each-ref", "--format=%(refname) %(objecttype)", "refs/t3").split("\n")
    assert sorted(r.split()[1] for r in refs if r) == ["commit", "commit"]
    after = user_state(repo)
    assert (after["index"], after["head"], after["branches"]) == (
        before["index"], before["head"], before["branches"])


def test_the_web_view_shows_a_runs_checkpoint_files_and_its_diff(
        tmp_path: Path, t3_factory: Any, browser: Any) -> None:  # noqa: F811
    """In headless Chromium: the open thread's checkpoint item lists the files the run changed
    with their line counts; Show diff fetches the run's diff (getTurnDiff) and shows it."""
    project_repo(tmp_path)
    t3 = t3_factory()
    mcp = t3.client()
    create(mcp, prompt=EDIT, title="edits")
    mcp.call("t3_thread_wait", {"threadId": mcp.call("t3_thread_list", {}).structured[
        "threads"][0]["threadId"], "timeoutMs": 30_000})
    page = browser.new_page()
    page.call("Runtime.enable")
    log_in(page, t3)
    page.click("nav a", text="edits")
    page.wait_for(lines_with("Checkpoint 1: 3 file(s) changed"))
    steps = Steps(page, tmp_path)
    steps.shot("checkpoint", ("modified +1 -1 a.txt",), ("added +1 -0 src/new.py",),
               ("deleted +0 -1 gone.txt",), ("Show diff",))
    watching = len(browser.events)
    page.click("#items button", text="Show diff")
    page.wait_for(lines_with("+three"))
    steps.shot("diff", ("-two",), ("+three",), ("+print('hi')",))
    assert sent_by_page(browser.events[watching:]) == ["ws getTurnDiff"]
    assert not [e for e in browser.events if e["method"] == "Runtime.exceptionThrown"]


def test_decide_records_each_checkpoint_once_and_only_a_git_one_in_the_timeline() -> None:
    """In process: CompleteRun with run 1's capture records baseline 0 and checkpoint 1 (the
    run's checkpointId, one `checkpoint` item); run 2's completion records only checkpoint 2,
    even when its capture repeats ordinal 1; a run outside git gets a `missing` checkpoint and
    no item."""
    import history
    import orchestrator as o
    from test_decide import THREAD, Sim, running_sim

    def finish(sim: Sim, ordinal: int, found: tuple[dict[str, Any], ...]) -> o.Decision:
        sim.ingest(o.TurnEnded("completed"), ordinal=ordinal)
        return sim.do(o.CompleteRun(command_id=sim.cid("complete"), thread_id=THREAD,
                                    run_id=sim.run(ordinal).id, checkpoints=found))

    files = [{"path": "a.txt", "kind": "modified", "additions": 1, "deletions": 1}]
    sim = running_sim()
    finish(sim, 1, ({"ordinal": 0, "status": "ready", "ref": "r0", "commit": "c0"},
                    {"ordinal": 1, "status": "ready", "ref": "r1", "commit": "c1",
                     "files": files}))
    cps = {c.ordinal: c for c in sim.state.entities["checkpoint"].values()}
    assert sorted(cps) == [0, 1] and cps[1].files == files and cps[0].run_id is None
    assert sim.run(1).checkpoint_id == cps[1].id == history.checkpoint_id(THREAD, 1)
    assert cps[1].parent_checkpoint_id == cps[0].id
    [item] = [i for i in sim.state.items() if i.type == "checkpoint"]
    assert item.data["files"] == files and item.run_id == sim.run(1).id
    sim.send("again")
    sim.mark_started(2)
    done = finish(sim, 2, ({"ordinal": 1, "status": "ready", "ref": "r1", "commit": "cX"},
                           {"ordinal": 2, "status": "missing"}))
    assert [e.type for e in done.events].count("checkpoint.captured") == 1
    assert sim.get("checkpoint", history.checkpoint_id(THREAD, 1)).commit == "c1"
    assert sim.get("checkpoint", history.checkpoint_id(THREAD, 2)).status == "missing"
    assert sim.run(2).checkpoint_id == history.checkpoint_id(THREAD, 2)
    assert len([i for i in sim.state.items() if i.type == "checkpoint"]) == 1
