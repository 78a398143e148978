"""workspace.py against real git repositories in a temp dir: checkpoints never touch the user's
index, HEAD, branches, stash or files; diffs count what changed; a restore brings a checkpoint's
files back; worktrees are made from a ref (or origin's, freshly fetched), found, and removed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workspace import GitError, Workspaces, checkpoint_ref  # noqa: E402


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "u@example.com")
    git(path, "config", "user.name", "U")
    (path / ".gitignore").write_text("build/\n")
    (path / "a.txt").write_text("one\ntwo\n")
    (path / "gone.txt").write_text("bye\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "first")
    return path


def user_state(repo: Path) -> dict[str, object]:
    """What a person sees of their checkout: status, branches, stash, HEAD, index bytes."""
    return {"status": git(repo, "status", "--porcelain=v2", "--branch", "--untracked=all"),
            "branches": git(repo, "branch", "-a", "-v"), "stash": git(repo, "stash", "list"),
            "head": (repo / ".git" / "HEAD").read_bytes(),
            "index": (repo / ".git" / "index").read_bytes(),
            "refs": git(repo, "for-each-ref", "refs/heads", "refs/stash", "refs/tags")}


def spaces_in(tmp_path: Path) -> Workspaces:
    (tmp_path / "data").mkdir(mode=0o700, exist_ok=True)
    return Workspaces(tmp_path / "data")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_a_capture_records_the_workspace_and_changes_nothing_the_user_sees(tmp_path: Path
                                                                           ) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "a.txt").write_text("stashed\n")
    git(repo, "stash", "-q")
    git(repo, "branch", "feature")
    (repo / "a.txt").write_text("one\ntwo\nstaged\n")
    git(repo, "add", "a.txt")
    (repo / "a.txt").write_text("one\ntwo\nstaged\nunstaged\n")
    (repo / "new.txt").write_text("untracked\n")
    (repo / "build").mkdir()
    (repo / "build" / "out.bin").write_text("ignored\n")
    (repo / "gone.txt").unlink()
    before = user_state(repo)
    spaces = spaces_in(tmp_path)
    ref = checkpoint_ref("thread:x", 1)
    commit = run(spaces.capture(str(repo / "build"), ref))  # any folder of the work tree
    assert user_state(repo) == before
    assert git(repo, "rev-parse", ref).strip() == commit
    assert sorted(git(repo, "ls-tree", "-r", "--name-only", commit).split()) == [
        ".gitignore", "a.txt", "new.txt"]
    assert git(repo, "show", f"{commit}:a.txt") == "one\ntwo\nstaged\nunstaged\n"
    assert list((tmp_path / "data" / "git-index").iterdir()) == []


def test_a_scratch_folder_in_a_repository_around_the_data_dir_has_no_checkpoint(
        tmp_path: Path) -> None:
    """A data dir inside a repository (a home kept in git): its scratch folders are not that
    repository's, while a worktree under the data dir is a repository of its own."""
    home = make_repo(tmp_path / "home")
    (home / "data" / "scratch" / "t1").mkdir(parents=True)
    spaces = Workspaces(home / "data")
    assert run(spaces.capture(str(home / "data" / "scratch" / "t1"), checkpoint_ref("t", 0))) \
        is None
    assert git(home, "for-each-ref", "refs/t3") == ""
    (home / "data" / "worktrees").mkdir()
    inner = make_repo(home / "data" / "worktrees" / "w")
    assert run(spaces.top_level(str(inner))) == str(inner)
    assert run(spaces.top_level(str(home))) == str(home)


def test_a_folder_outside_git_has_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    assert run(spaces_in(tmp_path).capture(str(tmp_path / "plain"), "refs/t3/x")) \
        is None


def test_diffs_count_the_changes_and_a_restore_brings_the_files_back(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    spaces = spaces_in(tmp_path)

    async def scenario() -> tuple[object, ...]:
        first = await spaces.capture(str(repo), checkpoint_ref("t", 0))
        (repo / "a.txt").write_text("one\n2\nthree\n")
        (repo / "gone.txt").unlink()
        (repo / "new.txt").write_text("x\ny\n")
        second = await spaces.capture(str(repo), checkpoint_ref("t", 1))
        diff = await spaces.diff(str(repo), first, second)
        baseline = await spaces.diff(str(repo), None, first)
        (repo / "build").mkdir()
        (repo / "build" / "keep").write_text("ignored stays\n")
        (repo / "later.txt").write_text("made after\n")
        await spaces.restore(str(repo), first)
        return diff, baseline
    diff, baseline = run(scenario())
    assert {(f.path, f.kind, f.additions, f.deletions) for f in diff.files} == {
        ("a.txt", "modified", 2, 1), ("gone.txt", "deleted", 0, 1), ("new.txt", "added", 2, 0)}
    assert "+three" in diff.text and not diff.truncated
    assert {f.path for f in baseline.files} == {".gitignore", "a.txt", "gone.txt"}
    assert (repo / "a.txt").read_text() == "one\ntwo\n" and (repo / "gone.txt").exists()
    assert not (repo / "new.txt").exists() and not (repo / "later.txt").exists()
    assert (repo / "build" / "keep").exists()
    assert git(repo, "status", "--porcelain") == ""


def test_a_long_diff_is_cut_and_says_so(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    spaces = spaces_in(tmp_path)

    async def scenario() -> object:
        first = await spaces.capture(str(repo), checkpoint_ref("t", 0))
        (repo / "big.txt").write_text("".join(f"line {i}\n" for i in range(10_000)))
        return await spaces.diff(str(repo), first,
                                 await spaces.capture(str(repo), checkpoint_ref("t", 1)))
    diff = run(scenario())
    assert diff.truncated and len(diff.text) == 30_000
    assert diff.files[0].additions == 10_000


def test_worktrees_from_a_ref_or_from_origin_are_found_and_removed(tmp_path: Path) -> None:
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(origin))
    repo = make_repo(tmp_path / "repo")
    git(repo, "remote", "add", "origin", str(origin))
    git(repo, "push", "-q", "origin", "main")
    other = make_repo(tmp_path / "other")  # someone pushes a newer main
    git(other, "remote", "add", "origin", str(origin))
    git(other, "fetch", "-q", "origin")
    git(other, "reset", "-q", "--hard", "origin/main")
    (other / "fresh.txt").write_text("from origin\n")
    git(other, "add", "-A")
    git(other, "commit", "-qm", "newer")
    git(other, "push", "-q", "origin", "main")
    before = user_state(repo)
    spaces = spaces_in(tmp_path)

    async def scenario() -> tuple[str, str, str | None, str | None]:
        local = await spaces.add_worktree(str(repo), "w1", base_ref="main", branch="t3/one")
        assert (Path(local) / "a.txt").exists() and not (Path(local) / "fresh.txt").exists()
        fresh = await spaces.add_worktree(str(repo), "w2", base_ref="main", branch="t3/two",
                                          from_origin=True)
        found = await spaces.worktree_branch(str(repo), fresh)
        stranger = await spaces.worktree_branch(str(repo), str(other))
        await spaces.remove_worktree(str(repo), local, "t3/one")
        return local, fresh, found, stranger
    local, fresh, found, stranger = run(scenario())
    assert (Path(fresh) / "fresh.txt").exists() and found == "t3/two" and stranger is None
    assert not Path(local).exists() and "t3/one" not in git(repo, "branch")
    after = user_state(repo)  # the checkout is untouched; only the new branch t3/two is added
    assert {k: v for k, v in after.items() if k not in ("branches", "refs")} == \
        {k: v for k, v in before.items() if k not in ("branches", "refs")}
    assert after["refs"].replace(git(repo, "for-each-ref", "refs/heads/t3/two"), "") == \
        before["refs"]


@pytest.mark.parametrize("base_ref, branch, origin, message", [
    ("main", "-D", False, "branch '-D' is not a branch or ref name"),
    ("--upload-pack=x", "t3/a", False, "baseRef '--upload-pack=x'"),
    ("nope", "t3/a", False, "baseRef: no commit 'nope'"),
    ("main", "t3/a", True, "has no remote named origin"),
])
def test_bad_worktree_requests_fail_clearly_and_make_nothing(
        tmp_path: Path, base_ref: str, branch: str, origin: bool, message: str) -> None:
    repo = make_repo(tmp_path / "repo")
    spaces = spaces_in(tmp_path)
    with pytest.raises(GitError, match=message):
        run(spaces.add_worktree(str(repo), "w", base_ref=base_ref, branch=branch,
                                from_origin=origin))
    assert not (tmp_path / "data" / "worktrees" / "w").exists()
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


def test_a_stray_index_from_a_killed_capture_is_swept(tmp_path: Path) -> None:
    spaces_in(tmp_path)
    stray = tmp_path / "data" / "git-index" / "index-dead"
    stray.write_text("half")
    spaces_in(tmp_path)
    assert not stray.exists()


def test_a_repository_without_an_index_or_commits_is_captured(tmp_path: Path) -> None:
    """A fresh `git init` has no index file to start from: the capture starts from nothing."""
    repo = tmp_path / "fresh"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "first.txt").write_text("hello\n")
    commit = run(spaces_in(tmp_path).capture(str(repo), checkpoint_ref("t", 0)))
    assert git(repo, "ls-tree", "-r", "--name-only", commit).split() == ["first.txt"]
    assert not (repo / ".git" / "index").exists()  # still none of the user's
