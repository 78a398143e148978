"""workspace.py against real git repositories in a temp dir: checkpoints never touch the user's
index, HEAD, branches, stash or files; diffs count what changed; a restore brings a checkpoint's
files back; worktrees are made from a ref (or origin's, freshly fetched), found, and removed."""

from __future__ import annotations

import asyncio
import http.server
import os
import shutil
import subprocess
import sys
import threading
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


def test_a_folder_outside_git_has_no_checkpoint_and_starts_no_git(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside any repository a capture is None without a git process (each run captures
    twice); in a repository the same git is run."""
    calls, bin_dir = tmp_path / "git-calls", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("git")} "$@"\n')
    (bin_dir / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "plain" / "deeper").mkdir(parents=True)
    spaces = spaces_in(tmp_path)
    assert run(spaces.capture(str(tmp_path / "plain" / "deeper"), "refs/t3/x")) is None
    assert run(spaces.top_level(str(tmp_path / "plain"))) is None
    assert not calls.exists()
    repo = make_repo(tmp_path / "plain" / "repo")
    assert run(spaces.top_level(str(repo))) == str(repo)
    assert "rev-parse" in calls.read_text()


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


# -- a repository's own config names no command t3's git runs -------------------------------------

ATTRIBUTES = "*.txt filter=evil diff=evil\n*.bin filter=proc\n*.dat filter=userlfs\n"


def user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marks: Path) -> None:
    """A HOME whose global config has a git-lfs-like filter and a credential helper: the user's
    own, which keep working."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        f'[filter "userlfs"]\n\tclean = "touch {marks}/user-clean; cat"\n'
        f'\tsmudge = "touch {marks}/user-smudge; cat"\n\trequired = true\n'
        f'[credential]\n\thelper = "!touch {marks}/user-cred; true"\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))


def script(tmp_path: Path, marks: Path, name: str) -> str:
    """An executable that leaves a marker (for the keys git runs without a shell)."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\ntouch {marks}/{name}\nexit 1\n")
    path.chmod(0o755)
    return str(path)


def planted(case: str, tmp_path: Path, origin: Path, marks: Path, port: int
            ) -> tuple[str, dict[str, str], str]:
    """What an agent that only edits files writes for ``case``: lines for `.git/config`,
    files (relative to the repository), and the URL it gives `origin`."""
    def m(name: str) -> str:  # git appends arguments through "$@"
        return f"touch {marks}/{name}; false"
    url, files = str(origin), {}
    config = {
        "fsmonitor, pager, editor": f'[core]\n\tfsmonitor = "{m("fsmonitor")}"\n'
        f'\tpager = "{m("pager")}"\n\teditor = "{m("editor")}"\n'
        f'[pager]\n\tdiff = "{m("pager-diff")}"\n[sequence]\n\teditor = "{m("seq-editor")}"\n',
        "filter clean, smudge, process": f'[filter "evil"]\n\tclean = "{m("clean")}"\n'
        f'\tsmudge = "{m("smudge")}"\n\trequired = true\n'
        f'[filter "proc"]\n\tprocess = "{m("process")}"\n'
        f'[filter "userlfs"]\n\tclean = "{m("hijack")}"\n\tsmudge = "{m("hijack")}"\n',
        "diff external, textconv, command": f'[diff]\n\texternal = "{m("external")}"\n'
        f'[diff "evil"]\n\ttextconv = "{m("textconv")}"\n\tcommand = "{m("command")}"\n',
        "include, includeIf": '[include]\n\tpath = ../included.cfg\n'
        '[includeIf "gitdir:/"]\n\tpath = ../included-if.cfg\n',
        "sshCommand": f'[core]\n\tsshCommand = "{m("ssh")}"\n',
        "uploadpack": f'[remote "origin"]\n\tuploadpack = "{m("uploadpack")}"\n',
        "ext:: url": "[protocol]\n\tallow = always\n",
        "insteadOf to ext::": f'[url "ext::sh -c touch% {marks}/insteadof"]\n'
        f"\tinsteadOf = {origin}\n[protocol]\n\tallow = always\n",
        "gitProxy": f"[core]\n\tgitProxy = {script(tmp_path, marks, 'proxy')}\n",
        "credential.helper, askPass": f'[credential]\n\thelper = "!{m("cred")}"\n'
        f'[credential "http://127.0.0.1:{port}"]\n\thelper = "!{m("cred-url")}"\n'
        f"[core]\n\taskPass = {script(tmp_path, marks, 'askpass')}\n",
        "alternateRefsCommand": f'[core]\n\talternateRefsCommand = "{m("altrefs")}"\n',
    }[case]
    if case == "include, includeIf":
        files = {"included.cfg": f'[filter "evil"]\n\tclean = "{m("include")}"\n',
                 "included-if.cfg": f'[filter "proc"]\n\tprocess = "{m("include-if")}"\n'}
    elif case == "alternateRefsCommand":
        git(tmp_path, "init", "-q", "--bare", "alt.git")
        files = {".git/objects/info/alternates": f"{tmp_path}/alt.git/objects\n"}
    url = {"sshCommand": "ssh://127.0.0.1:1/x", "ext:: url": f"ext::sh -c touch% {marks}/ext",
           "gitProxy": "git://127.0.0.1:1/x",
           "credential.helper, askPass": f"http://127.0.0.1:{port}/x.git"}.get(case, url)
    return config, files, url


class _Unauthorized(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="x"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


TRANSPORT = {"sshCommand", "ext:: url", "insteadOf to ext::", "gitProxy",
             "credential.helper, askPass"}


@pytest.mark.parametrize("case", [
    "fsmonitor, pager, editor", "filter clean, smudge, process",
    "diff external, textconv, command", "include, includeIf", "sshCommand", "uploadpack",
    "ext:: url", "insteadOf to ext::", "gitProxy", "credential.helper, askPass",
    "alternateRefsCommand"])
def test_no_command_a_repository_config_names_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """With a command-naming key planted in `.git/config` (and `.gitattributes` selecting its
    driver), a capture, a diff, a restore, a worktree from the planted branch and a fetch from
    origin run none of it; the user's global filter and credential helper still run."""
    marks = tmp_path / "marks"
    marks.mkdir()
    user_home(tmp_path, monkeypatch, marks)
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(origin))
    repo = make_repo(tmp_path / "repo")
    for name, text in {".gitattributes": ATTRIBUTES, "blob.bin": "b\n", "data.dat": "d\n"}.items():
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "attributes")
    git(repo, "branch", "agent")
    git(repo, "remote", "add", "origin", str(origin))
    git(repo, "push", "-q", "origin", "main")
    listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unauthorized)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    config, files, url = planted(case, tmp_path, origin, marks, listener.server_address[1])
    shutil.rmtree(marks)  # the user's filter ran for the commits above
    marks.mkdir()
    dot_config = repo / ".git" / "config"  # the agent's edits: files only
    dot_config.write_text(dot_config.read_text().replace(str(origin), url) + config)
    for name, text in files.items():
        (repo / name).write_text(text)
    (repo / "a.txt").write_text("edited\n")
    (repo / "data.dat").write_text("edited\n")
    spaces = spaces_in(tmp_path)

    async def scenario() -> bool:
        first = await spaces.capture(str(repo), checkpoint_ref("t", 0))
        (repo / "a.txt").write_text("edited again\n")
        second = await spaces.capture(str(repo), checkpoint_ref("t", 1))
        assert first and second
        assert "a.txt" in {f.path for f in (await spaces.diff(str(repo), first, second)).files}
        await spaces.restore(str(repo), first)
        made = await spaces.add_worktree(str(repo), "w1", base_ref="agent", branch="t3/w1")
        assert (Path(made) / "data.dat").read_text() == "d\n"
        try:
            await spaces.add_worktree(str(repo), "w2", base_ref="main", branch="t3/w2",
                                      from_origin=True)
            return True
        except GitError:
            return False
    try:
        fetched = run(scenario())
    finally:
        listener.shutdown()
        listener.server_close()
    assert fetched == (case not in TRANSPORT)
    user = {"user-clean", "user-smudge"} | ({"user-cred"} if "credential" in case else set())
    assert {p.name for p in marks.iterdir()} == user


def test_a_core_worktree_pointing_away_from_the_repository_is_refused(tmp_path: Path) -> None:
    """`core.worktree` aimed at another folder (a home folder, say) makes captures and restores
    fail naming the key: nothing of that folder is read into a checkpoint, nothing removed."""
    repo = make_repo(tmp_path / "repo")
    spaces = spaces_in(tmp_path)
    commit = run(spaces.capture(str(repo), checkpoint_ref("t", 0)))
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("private\n")
    with (repo / ".git" / "config").open("a") as f:
        f.write(f"[core]\n\tworktree = {elsewhere}\n")
    with pytest.raises(GitError, match="core.worktree"):
        run(spaces.capture(str(repo), checkpoint_ref("t", 1)))
    with pytest.raises(GitError, match="core.worktree"):
        run(spaces.restore(str(repo), commit))
    assert (elsewhere / "secret.txt").read_text() == "private\n"
    assert git(repo, "for-each-ref", "refs/t3").count("\n") == 1


def test_a_git_file_pointing_at_a_planted_git_directory_runs_nothing_either(
        tmp_path: Path) -> None:
    """A worktree's `.git` file rewritten to name a git directory the agent wrote inside it:
    git reads that directory's config, and so does t3's listing, so its filter is off too."""
    marks = tmp_path / "marks"
    marks.mkdir()
    repo = make_repo(tmp_path / "repo")
    spaces = spaces_in(tmp_path)
    tree = Path(run(spaces.add_worktree(str(repo), "w", base_ref="main", branch="t3/w")))
    for name, text in {"evil/HEAD": "ref: refs/heads/main\n", "evil/objects/info/keep": "",
                       "evil/refs/heads/keep": "", ".git": "gitdir: evil\n",
                       "evil/config": f'[filter "evil"]\n\tclean = "touch {marks}/clean"\n',
                       ".gitattributes": "*.txt filter=evil\n"}.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    assert run(spaces.capture(str(tree), checkpoint_ref("t", 1)))
    assert list(marks.iterdir()) == []
