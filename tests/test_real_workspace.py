"""Issue 12's workspace acceptance with the real codex CLI (`codex app-server`, fake model): a
worktree launch from `main` (and one with startFromOrigin) in a real git repository whose
`origin` is a bare repository on disk. Codex runs its shell tool in the new worktree on a branch
of its own, edits one file and creates another; the run ends with a checkpoint listing exactly
those files with their line counts, t3_thread_diff shows the change, and the user's checkout
(status, branches, index bytes) is the same before and after."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import write_config
from real_cli import codex_provider, npm_available, wait
from test_worktrees import git, make_repo, user_state, worktrees

pytestmark = [pytest.mark.real_cli,
              pytest.mark.skipif(not npm_available(), reason="npm is not installed")]

EDIT = "USE_TOOL: printf 'uno\\ntwo\\n' > a.txt && printf 'x\\ny\\nz\\n' > made.txt"


@pytest.mark.parametrize("from_origin", [False, True], ids=["main", "origin"])
def test_real_codex_works_in_a_new_worktree_and_its_checkpoint_lists_its_files(
        model: FakeModelServer, tmp_path: Path, t3_factory: Any, from_origin: bool) -> None:
    """Codex's requests carry the new worktree as its cwd; the worktree is on its own branch at
    main's (or origin's newer) commit with codex's edits; checkpoint 1 lists a.txt (+2 -1) and
    made.txt (+3 -0) and nothing else; t3_thread_diff shows them; the user's checkout reads
    byte for byte as before, but for the one new branch."""
    repo = make_repo(tmp_path)
    if from_origin:  # origin moves on: the worktree starts from its commit, not local main's
        other = tmp_path / "other"
        git(tmp_path, "clone", "-q", str(tmp_path / "origin.git"), str(other))
        git(other, "-c", "user.email=o@example.com", "-c", "user.name=O", "commit",
            "--allow-empty", "-qm", "second")
        git(other, "push", "-q", "origin", "main")
    base = git(tmp_path / "origin.git", "rev-parse", "main")
    assert (base == git(repo, "rev-parse", "main")) is not from_origin
    before, local = user_state(repo), heads(repo)
    project = {"id": "proj", "path": str(repo), "title": "Repo"}
    t3 = t3_factory(config=write_config(tmp_path, projects=[project],
                                        providers=[codex_provider(tmp_path, model.url)]))
    mcp = t3.client()
    strategy = {"type": "worktree", "baseRef": "main", "startFromOrigin": from_origin}
    launched = mcp.call("t3_thread_launch", {"message": EDIT, "workspaceStrategy": strategy,
                                             "runtimeMode": "full-access"})
    assert launched.ok, launched.structured
    tid, path, branch = (launched.structured[k] for k in ("threadId", "worktreePath", "branch"))
    assert wait(mcp, tid)["status"] == "completed"
    work = Path(path)
    assert Path(path).parent == t3.data_dir / "worktrees" and worktrees(repo) == [str(repo), path]
    assert f"<cwd>{path}</cwd>" in json.dumps(model.requests_for("responses")[0]["body"])
    assert git(work, "branch", "--show-current").strip() == branch != "main"
    assert git(work, "rev-parse", "HEAD") == base
    assert (work / "a.txt").read_text() == "uno\ntwo\n" and (work / "made.txt").exists()
    assert not (repo / "made.txt").exists()
    assert (repo / "a.txt").read_text() == "one\nuncommitted\n"

    files = {f["path"]: (f["kind"], f["additions"], f["deletions"]) for f in mcp.call(
        "t3_thread_diff", {"threadId": tid, "ordinal": 1}).structured["files"]}
    expected = {"a.txt": ("modified", 2, 1), "made.txt": ("added", 3, 0)}
    assert files == expected
    diff = mcp.call("t3_thread_diff", {"threadId": tid, "ordinal": 1}).structured
    assert diff["status"] == "ready" and "-one\n+uno\n+two\n" in diff["diff"], diff
    assert "+x\n+y\n+z\n" in diff["diff"]
    assert diff["runId"] == launched.structured["runId"] and diff["toCheckpointId"].endswith(":1")
    read = mcp.call("t3_thread_read", {"threadId": tid, "view": "activity",
                                       "afterPosition": -1}).structured
    assert [i["title"] for i in read["items"] if i["type"] == "checkpoint"] == [
        "Checkpoint 1: 2 file(s) changed"], read["items"]

    after = user_state(repo)
    assert {k: after[k] for k in ("status", "index", "head")} == {
        k: before[k] for k in ("status", "index", "head")}
    assert heads(repo) == {**local, f"refs/heads/{branch}": base.strip()}
    # startFromOrigin's fetch moves origin/main, as any fetch does; nothing else moved
    assert git(repo, "rev-parse", "origin/main") == base


def heads(repo: Path) -> dict[str, str]:
    """The repository's local branches and their commits (`git branch`)."""
    return dict(line.split() for line in git(
        repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads").splitlines())
