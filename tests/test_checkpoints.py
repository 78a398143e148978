"""Checkpoints and diffs (issue 12, items 3 and 4) against a real server, the scripted ACP agent
(its WRITE_FILE / DELETE_FILE lines edit the project) and small local git repositories: a
baseline before the first run, a capture after each root turn with the files it changed, the
user's checkout untouched, diffs over MCP (t3_thread_diff), /ws and the CLI, a workspace outside
git, and kill -9 in the middle of a capture."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import t3 as server
from harness import McpClient, T3Server, wait_until
from test_workspace import git, make_repo, user_state

EDIT = ("WRITE_FILE a.txt one\\nthree\nWRITE_FILE src/new.py print('hi')\n"
        "DELETE_FILE gone.txt")


def ws(t3: T3Server, method: str, params: dict[str, Any]) -> Any:
    async def call() -> Any:
        async with server.WsClient(t3.url + "/ws", t3.token) as client:
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
    same as before; a second run's checkpoint lists only its own change."""
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
