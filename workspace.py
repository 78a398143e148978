"""Git as an effect: worktrees for launches, checkpoints as hidden refs, diffs, restores, and
the preparation of a launch's worktree.

The orchestrator never imports this file: t3.py hands it a ``Workspaces`` the way it hands it
provider adapters, and ``decide`` stays pure. The preparation (its last section) plugs into the
core's tables as a feature module does, when t3.py loads this file: the ``run.prepare`` command
and its decide function, BEGIN_PREPARATION and SETUP_ANSWERED, and the ``workspace.prepare``
effect, which makes the worktree and runs the project's setup commands.

Every git call is ``git`` as an asyncio subprocess with a clean environment (no GIT_DIR,
GIT_INDEX_FILE or hooks path of ours or the user's shell leaks in), arguments after ``--`` or
``--end-of-options`` where a name comes from a client, and a timeout. A repository's own config
is written by whoever edits its files (an agent that may not run commands, too), so no setting
there makes t3's git run a command: each call that could run one first lists the config (which
runs nothing) and overrides every command-naming key the repository or a file it includes sets
with the user's global or system value, or switches it off; hooks, fsmonitor, pagers, editors,
the ``ext::`` transport and submodule recursion are always off. Captures and restores refuse a
``core.worktree`` that leads away from the repository.

A checkpoint is a commit made from a temporary index (``GIT_INDEX_FILE`` in
``<data-dir>/git-index/``): the workspace's tracked and untracked, non-ignored files, kept under
``refs/t3/checkpoints/<thread hash>/<ordinal>``. Capturing never touches the user's index, HEAD,
branches, stash or files: ``git status`` and ``git branch`` read the same before and after. A
workspace that is not in a git repository has no checkpoints (``capture`` returns None: the
checkpoint is ``missing``). Operations on one repository run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import signal
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, cast

from orchestrator import (BEGIN_PREPARATION, EFFECTS, SETUP_ANSWERED, Command, CommandRejected,
                          Draft, EffectKind, FailRun, Orchestrator, PermanentEffectError,
                          RespondRuntimeRequest, Run, RunStatus, RuntimeRequest,
                          RuntimeRequestOpened, T3Error, bounded_id, decide_fail_run, decides,
                          ingest_request, put_item)
from store import crash_point

__all__ = ["GitError", "Workspaces", "FileChange", "Diff", "checkpoint_ref", "ref_problem",
           "AdvancePreparation", "PREPARATION_OUTPUT_CHARS"]

GIT_TIMEOUT_S = 120.0
_AUTHOR = {"GIT_AUTHOR_NAME": "t3", "GIT_AUTHOR_EMAIL": "t3@localhost",
           "GIT_COMMITTER_NAME": "t3", "GIT_COMMITTER_EMAIL": "t3@localhost"}
MAX_DIFF_CHARS = 30_000
SETUP_TIMEOUT_S = 600.0
SETUP_OUTPUT_CHARS = 20_000
# Variables that would point git somewhere else, or change what it does, if inherited.
_GIT_VARIABLES = re.compile(r"GIT_[A-Z_]+")
# t3.py narrows its own umask to keep the data directory private; git and setup commands write
# in the user's repositories and get the umask t3 was started with (as agents do). Until it is
# set, -1: the child keeps this process's umask.
CHILD_UMASK = -1
_BRANCH = re.compile(r"[A-Za-z0-9._/-]{1,200}")
# Keys naming a command, and what stands for them when a repository sets them (the user's own
# global and system values follow, so theirs win, e.g. git-lfs's filter). An empty value switches
# a filter, the helper list, askpass and the alternates command off; gitProxy is below.
_NEUTRAL = ((re.compile(r"filter\..+\.(clean|smudge|process)|credential\.(.+\.)?helper"
                        r"|core\.(askpass|alternaterefscommand)"), ""),
            (re.compile(r"filter\..+\.required"), "false"),
            (re.compile(r"core\.sshcommand"), "ssh"))
_FIXED = ("core.hooksPath=/dev/null", "core.fsmonitor=false", "protocol.ext.allow=never",
          "submodule.recurse=false", "core.quotePath=false")
# Plumbing that reads no index or attributes and opens no connection: it runs no command a
# config names beside _FIXED, so it skips the listing (most of a checkpoint's git calls).
_INERT = frozenset({"rev-parse", "update-ref", "for-each-ref", "commit-tree"})
# Diffs run no external diff or textconv program, whichever config names one.
_DIFF = ("diff", "--no-color", "--no-renames", "--no-ext-diff", "--no-textconv",
         "--submodule=short")
_BASE_REFS = ("refs/heads/", "refs/tags/", "refs/remotes/")  # what a launch may start from
_COMMIT_ID = re.compile(r"[0-9a-f]{7,64}")


class GitError(Exception):
    """A git command failed; the message is its stderr's first lines (for the run's reason)."""


@dataclass(frozen=True, slots=True)
class FileChange:
    path: str
    kind: str  # added | modified | deleted | renamed | type_changed
    additions: int
    deletions: int


@dataclass(frozen=True, slots=True)
class Diff:
    files: tuple[FileChange, ...]
    text: str  # unified, at most MAX_DIFF_CHARS characters
    truncated: bool


def checkpoint_ref(thread_id: str, ordinal: int | None) -> str:
    """The hidden ref of a thread's checkpoint (ordinal None: the folder of all of them): ids
    may hold any character, so the thread part is a hash."""
    digest = hashlib.sha256(thread_id.encode()).hexdigest()[:32]
    return f"refs/t3/checkpoints/{digest}" + ("" if ordinal is None else f"/{ordinal}")


class Workspaces:
    """Git worktrees under ``<data-dir>/worktrees``, checkpoints, diffs and restores."""

    checkpoint_ref = staticmethod(checkpoint_ref)  # the orchestrator reaches it only through here

    def __init__(self, data_dir: Path) -> None:
        self._data_dir = os.path.realpath(data_dir)
        self.worktrees_dir = data_dir / "worktrees"
        self._index_dir = data_dir / "git-index"
        self._index_dir.mkdir(mode=0o700, exist_ok=True)
        for stray in self._index_dir.iterdir():  # a capture killed mid-way left it
            stray.unlink(missing_ok=True)
        self._locks: dict[str, asyncio.Lock] = {}

    # -- checkpoints -------------------------------------------------------------------------

    async def top_level(self, cwd: str) -> str | None:
        """The repository's work tree root holding ``cwd``, or None when it is not in one, or
        when only a repository around the data directory holds it (a scratch folder in a home
        directory kept in git is no project: capturing it would copy the whole home)."""
        found = await self._repository(cwd)
        return found[0] if found else None

    async def _repository(self, cwd: str) -> tuple[str, str] | None:
        """``top_level`` and the repository's git directory."""
        if not _may_be_repository(cwd):
            return None
        try:
            root, git_dir = (await _git(cwd, "rev-parse", "--show-toplevel",
                                        "--absolute-git-dir")).splitlines()
        except (GitError, OSError, ValueError):
            return None
        if _within(cwd, self._data_dir) and not _within(root, self._data_dir):
            return None
        return root, git_dir

    async def _work_tree(self, cwd: str) -> str | None:
        """``top_level``, for reading and writing its files: refused when the repository's
        ``core.worktree`` sets its work tree where its ``.git`` is not (anywhere, the home
        folder too, from one line in a config file an agent may edit)."""
        found = await self._repository(cwd)
        if found and _git_dir_in(found[0]) != os.path.realpath(found[1]):
            raise GitError(f"core.worktree: the repository {found[1]} sets its work tree at "
                           f"{found[0]}, which does not hold it; t3 reads and writes no files "
                           "there")
        return found[0] if found else None

    async def capture(self, cwd: str, ref: str) -> str | None:
        """Record the workspace under ``ref``; the commit id, or None when ``cwd`` is not in a
        git repository. Raises GitError when git fails."""
        root = await self._work_tree(cwd)
        if root is None:
            return None
        index = self._index_dir / f"index-{uuid.uuid4().hex}"
        env = {"GIT_INDEX_FILE": str(index)}
        async with self._lock(root):
            try:
                await self._fill_index(root, index, env)
                tree = (await _git(root, "write-tree", env=env)).strip()
                crash_point(f"checkpoint:capture:{ref.rsplit('/', 1)[-1]}")  # the index exists
                commit = (await _git(root, "commit-tree", tree, "-m",
                                     f"t3 checkpoint {ref}", env=_AUTHOR)).strip()
                await _git(root, "update-ref", ref, commit)
            finally:
                index.unlink(missing_ok=True)
                Path(f"{index}.lock").unlink(missing_ok=True)
        return commit

    @staticmethod
    async def _fill_index(root: str, index: Path, env: dict[str, str]) -> None:
        """The temporary index made to hold the whole work tree. It starts as a copy of the
        user's index, whose file stats let ``add`` hash only what changed since (from HEAD's tree
        every file would be hashed on every capture); a copy git cannot use falls back to HEAD."""
        add = ("-c", "core.splitIndex=false", "add", "--all", "--", ".")
        user_index = Path(root, (await _git(root, "rev-parse", "--git-path", "index")).strip())
        try:
            shutil.copyfile(user_index, index)
            await _git(root, *add, env=env)
            return
        except (OSError, GitError):
            index.unlink(missing_ok=True)
        head = await _maybe(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
        await _git(root, "read-tree", *([head] if head else ["--empty"]), env=env)
        await _git(root, *add, env=env)

    async def ref_commit(self, cwd: str, ref: str) -> str | None:
        """The commit ``ref`` names in the repository holding ``cwd``, or None."""
        return await _maybe(cwd, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}") or None

    async def diff(self, cwd: str, before: str | None, after: str) -> Diff:
        """What changed from checkpoint ``before`` (None: nothing) to ``after``."""
        root = await self.top_level(cwd) or cwd
        base = before or (await _git(root, "hash-object", "-t", "tree", "--stdin",
                                     stdin=b"")).strip()
        statuses = (await _git(root, *_DIFF, "--name-status", "-z", base, after, "--")
                    ).split("\0")
        kinds = {"A": "added", "M": "modified", "D": "deleted", "T": "type_changed"}
        kind_of = {path: kinds.get(code[:1], "modified")
                   for code, path in zip(statuses[0::2], statuses[1::2]) if path}
        files = []
        numstat = await _git(root, *_DIFF, "--numstat", "-z", base, after, "--")
        for entry in numstat.split("\0"):
            if entry:
                added, deleted, path = entry.split("\t", 2)
                files.append(FileChange(path, kind_of.get(path, "modified"),
                                        int(added) if added.isdigit() else 0,
                                        int(deleted) if deleted.isdigit() else 0))
        text = await _git(root, *_DIFF, base, after, "--")
        return Diff(tuple(files), text[:MAX_DIFF_CHARS], len(text) > MAX_DIFF_CHARS)

    async def restore(self, cwd: str, commit: str) -> None:
        """Make the workspace's files what checkpoint ``commit`` recorded (tracked and untracked,
        ignored files kept); the index afterwards matches HEAD for those paths again."""
        root = await self._work_tree(cwd)
        if root is None:
            raise GitError(f"{cwd} is not in a git repository")
        async with self._lock(root):
            await _git(root, "restore", "--source", commit, "--worktree", "--staged", "--", ".")
            await _git(root, "clean", "-fd", "--", ".")
            await _git(root, "reset", "--quiet", "--", ".")

    async def delete_ref(self, cwd: str, ref: str) -> None:
        """Delete ``ref``, or every ref under it when it names a folder (a thread's
        checkpoints); a ref that is not there, or a workspace outside git, is no error."""
        root = await self.top_level(cwd)
        if root is None:
            return
        async with self._lock(root):
            found = await _git(root, "for-each-ref", "--format=delete %(refname)", "--", ref)
            if found:
                await _git(root, "update-ref", "--stdin", stdin=found.encode())

    # -- worktrees ---------------------------------------------------------------------------

    async def add_worktree(self, repo: str, name: str, *, base_ref: str, branch: str,
                           from_origin: bool = False) -> str:
        """A new worktree at ``<data-dir>/worktrees/<name>`` on a new ``branch`` from
        ``base_ref`` (or, ``from_origin``, from ``origin/<base_ref>`` just fetched); its path.
        Refs and names are checked: none may start an option."""
        problem = ref_problem(base_ref, "baseRef") or ref_problem(branch, "branch")
        if problem:
            raise GitError(problem)
        path = self.worktrees_dir / name
        async with self._lock(repo):
            base = base_ref
            if from_origin:
                if await _maybe(repo, "remote", "get-url", "origin") is None:
                    raise GitError(f"startFromOrigin: {repo} has no remote named origin")
                # remote.<name>.uploadpack: the first value set wins, so only this flag beats
                # a repository's own; a submodule's fetch would read its own config
                await _git(repo, "fetch", "--quiet", "--no-recurse-submodules",
                           "--upload-pack=git-upload-pack", "origin", "--", base_ref)
                base = f"refs/remotes/origin/{base_ref}"
            start = await _launch_base(repo, base, reachable=False)
            if start is None:
                raise GitError(f"baseRef: no commit {base!r} in {repo}")
            self.worktrees_dir.mkdir(mode=0o700, exist_ok=True)
            await _git(repo, "worktree", "add", "--quiet", "-b", branch, str(path), start)
        return str(path)

    async def remove_worktree(self, repo: str, path: str, branch: str | None = None) -> None:
        """Remove a worktree t3 made (and its branch, when given), whatever state it is in: a
        folder under ``worktrees/`` that git no longer (or not yet) knows goes too."""
        async with self._lock(repo):
            await _maybe(repo, "worktree", "remove", "--force", "--force", path)
            if Path(path).parent == self.worktrees_dir and os.path.lexists(path):
                await asyncio.to_thread(shutil.rmtree, path, True)
            await _maybe(repo, "worktree", "prune")
            if branch:
                await _maybe(repo, "branch", "-D", "--", branch)

    async def worktree_branch(self, repo: str, path: str) -> str | None:
        """The branch of ``path`` when it is a worktree of ``repo`` ("" for a detached one);
        None when it is not one of its worktrees."""
        listing = await _git(repo, "worktree", "list", "--porcelain", "-z")
        wanted = os.path.realpath(path)
        for record in listing.split("\0\0"):
            fields = {key: value for key, _, value in
                      (line.partition(" ") for line in record.split("\0") if line)}
            if "worktree" in fields and os.path.realpath(fields["worktree"]) == wanted:
                return fields.get("branch", "").removeprefix("refs/heads/")
        return None

    # -- launches ----------------------------------------------------------------------------

    async def worktree_problem(self, repo: str, *, base_ref: str, branch: str,
                               from_origin: bool) -> str | None:
        """Why ``add_worktree`` with these arguments cannot work (checked before a launch is
        accepted, so bad input changes nothing), or None. The fetch itself is left to it."""
        problem = ref_problem(base_ref, "baseRef") or ref_problem(branch, "branch")
        if problem:
            return problem
        if await self.top_level(repo) is None:
            return f"{repo} is not a git repository"
        if await _maybe(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}"):
            return f"branch: {branch!r} already exists"
        if from_origin:
            if base_ref.startswith("refs/"):
                return f"startFromOrigin: baseRef {base_ref!r} is not a branch name of origin"
            if await _maybe(repo, "remote", "get-url", "origin") is None:
                return f"startFromOrigin: {repo} has no remote named origin"
        elif await _launch_base(repo, base_ref, reachable=True) is None:
            return (f"baseRef: no commit {base_ref!r} in {repo} that a branch, tag or "
                    "remote-tracking branch names or holds (t3's own refs never are one)")
        return None

    async def run_setup(self, cwd: str, command: str) -> tuple[int, str]:
        """One ``[[projects]] setup`` command through the shell in a new worktree, in a process
        group of its own (killed whole after SETUP_TIMEOUT_S): its exit code and its output
        (stdout and stderr together, at most SETUP_OUTPUT_CHARS, the end kept)."""
        env = {k: v for k, v in os.environ.items()
               if not _GIT_VARIABLES.fullmatch(k) and not k.startswith("T3_")}
        proc = await asyncio.create_subprocess_shell(
            command, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, umask=CHILD_UMASK)
        try:
            async with asyncio.timeout(SETUP_TIMEOUT_S):
                out, _ = await proc.communicate()
        except TimeoutError:
            return 124, f"(killed: it took over {SETUP_TIMEOUT_S:.0f} s)"
        finally:
            with contextlib.suppress(ProcessLookupError):  # what it left running in its group
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                await proc.wait()
        return proc.returncode, out.decode("utf-8", "replace")[-SETUP_OUTPUT_CHARS:]

    def _lock(self, root: str) -> asyncio.Lock:
        return self._locks.setdefault(os.path.realpath(root), asyncio.Lock())


def _git_dir_in(root: str) -> str | None:
    """The git directory ``root/.git`` is (a folder) or names (a ``gitdir:`` file), or None."""
    dot = os.path.join(root, ".git")
    try:
        if os.path.isdir(dot):
            return os.path.realpath(dot)
        with open(dot, encoding="utf-8", errors="replace") as f:
            line = f.readline(4096)
    except OSError:
        return None
    named = line.removeprefix("gitdir:").strip() if line.startswith("gitdir:") else None
    return os.path.realpath(os.path.join(root, named)) if named else None


def _may_be_repository(cwd: str) -> bool:
    """Whether git could find a repository around ``cwd``: one of its folders holds a ``.git``
    (folder or file) or is a git directory. t3's git gets no GIT_DIR or GIT_WORK_TREE, so it finds
    one only this way; when none is there, no git process is started to say so (a run in a
    workspace outside git would start two)."""
    folder = os.path.realpath(cwd)
    while True:
        if os.path.lexists(os.path.join(folder, ".git")) or (
                os.path.isfile(os.path.join(folder, "HEAD"))
                and os.path.isdir(os.path.join(folder, "objects"))):
            return True
        folder, child = os.path.dirname(folder), folder
        if folder == child:
            return False


def _within(path: str, folder: str) -> bool:
    real = os.path.realpath(path)
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


async def _launch_base(repo: str, base_ref: str, *, reachable: bool) -> str | None:
    """What git starts a launch's worktree from: the full name of the branch, tag or
    remote-tracking branch ``base_ref`` names (a short name is looked up under refs/heads/,
    refs/tags/, refs/remotes/, in that order: git's own lookup also tries refs/<name> and
    $GIT_DIR/<name>, where t3's checkpoints and files an agent wrote live), else the commit id it
    is, with ``reachable`` only one such a ref holds; None when it is none of these. A checkpoint
    holds what an agent wrote: a worktree (and its setup) made from one would run it."""
    names = [base_ref] if base_ref.startswith(_BASE_REFS) else \
        [] if base_ref.startswith("refs/") else [f"{space}{base_ref}" for space in _BASE_REFS]
    found = (await _git(repo, "for-each-ref", "--format=%(refname)", "--", *names)).split() \
        if names else []
    for name in names:
        if name in found:
            commit = await _maybe(repo, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")
            return name if commit else None
    if not _COMMIT_ID.fullmatch(base_ref):
        return None
    commit = await _maybe(repo, "rev-parse", "--verify", "--quiet", f"{base_ref}^{{commit}}")
    if commit and reachable and not await _maybe(
            repo, "for-each-ref", "--count=1", "--format=%(refname)", f"--contains={commit}",
            *(space.rstrip("/") for space in _BASE_REFS)):
        return None
    return commit


def ref_problem(value: str, what: str) -> str | None:
    """Why ``value`` cannot be a branch or ref name t3 hands git (none may start an option)."""
    if not _BRANCH.fullmatch(value) or value.startswith(("-", "/")) or ".." in value:
        return f"{what} {value!r} is not a branch or ref name"
    return None


async def _maybe(cwd: str, *args: str) -> str | None:
    """A git query's stripped output, or None when git says no."""
    try:
        return (await _git(cwd, *args)).strip()
    except GitError:
        return None


async def _git(cwd: str, *args: str, env: dict[str, str] | None = None,
               stdin: bytes | None = None) -> str:
    """``git args`` in ``cwd`` with none of the repository's command-naming settings in force."""
    listing = "" if args[0] in _INERT else await _run(
        cwd, ("config", "--list", "--show-scope", "-z"), {}, None)
    return await _run(cwd, args, {**_overrides(listing), **(env or {})}, stdin)


def _overrides(listing: str) -> dict[str, str]:
    """The environment that overrides, for one git call, each command-naming key a
    repository's own config sets (``listing``: ``git config --list --show-scope -z``)."""
    fields = listing.split("\0")
    entries = [(scope not in ("global", "system"), *item.partition("\n")[::2])
               for scope, item in zip(fields[0::2], fields[1::2])]
    reset: dict[str, str] = {}
    for own, key, _ in entries:
        neutral = next((value for pattern, value in _NEUTRAL if pattern.fullmatch(key)), None)
        if own and neutral is not None:
            reset.setdefault(_family(key), neutral)
    pairs = [*reset.items(), *((key, value) for own, key, value in entries
                               if not own and _family(key) in reset)]
    env = {"GIT_PROXY_COMMAND": ""} if any(  # its first value wins, so only this beats it
        own and key == "core.gitproxy" for own, key, _ in entries) else {}
    for i, (key, value) in enumerate(pairs):
        env |= {f"GIT_CONFIG_KEY_{i}": key, f"GIT_CONFIG_VALUE_{i}": value}
    return env | {"GIT_CONFIG_COUNT": str(len(pairs))}


def _family(key: str) -> str:
    """The key whose empty value resets ``key``: the credential helpers are one list."""
    return "credential.helper" if key.startswith("credential.") and key.endswith(".helper") \
        else key


async def _run(cwd: str, args: tuple[str, ...], env: dict[str, str],
               stdin: bytes | None) -> str:
    clean = {k: v for k, v in os.environ.items() if not _GIT_VARIABLES.fullmatch(k)}
    clean.update({"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C",
                  "GIT_EDITOR": ":", **env})
    fixed = [arg for setting in _FIXED for arg in ("-c", setting)]
    proc = await asyncio.create_subprocess_exec(
        "git", "--no-pager", *fixed, *args, cwd=cwd, env=clean, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, umask=CHILD_UMASK)
    try:
        async with asyncio.timeout(GIT_TIMEOUT_S):
            out, err = await proc.communicate(stdin)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise GitError(f"git {args[0]} took over {GIT_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()[:3]
        raise GitError(f"git {args[0]}: {' '.join(lines) or f'exit {proc.returncode}'}")
    return out.decode("utf-8", "replace")


# =============================================================================================
# Workspace preparation: a launch's worktree, made as an effect of its first run, registered
# into the core's tables when t3.py loads this file (``load_features``). The core starts such a
# run ``preparing``; BEGIN_PREPARATION gives it a "Preparing workspace" item (phase worktree,
# approval, setup, ready or failed; text: the setup output) and a ``workspace.prepare`` effect,
# which makes the worktree, runs the setup commands, then releases or fails the run
# (``run.prepare``). Replay-safe: a rerun first removes what a dead attempt left. Setup commands
# run what the worktree holds, which an agent may have written: an agent's launch below
# full-access (``askSetup``) asks first: a pending command approval of the new run that t3
# itself asks (no provider session is behind it, so none ending expires it); accepted, a second
# ``workspace.prepare`` runs them in the worktree made for the question; declined, the run
# starts without them.

PREPARATION_OUTPUT_CHARS = 20_000


@dataclass(frozen=True, slots=True)
class AdvancePreparation(Command):
    type: ClassVar[str] = "run.prepare"
    run_id: str
    phase: str  # approval | setup | ready | failed
    output: str = ""
    reason: str = ""
    setup: tuple[str, ...] = ()  # approval: the commands asked about


def _preparation_item_id(run_id: str) -> str:
    return bounded_id(f"turn-item:{run_id}:workspace")


def _setup_request_id(run_id: str) -> str:
    return bounded_id(f"runtime-request:{run_id}:setup")


def _begin_preparation(d: Draft, run: Run, preparation: Mapping[str, Any]) -> None:
    put_item(d, _preparation_item_id(run.id), run, run.root_node_id, "workspace_setup",
             "running", title="Preparing workspace", data={"phase": "worktree"})
    d.effect("workspace.prepare", {"runId": run.id, **preparation}, run.id)


@decides(AdvancePreparation)
def _decide_preparation(d: Draft, c: AdvancePreparation, **kw: Any) -> Mapping[str, Any]:
    run = d.get("run", c.run_id)
    item = d.get("turn-item", _preparation_item_id(c.run_id))
    if run is None or item is None or run.status != RunStatus.PREPARING:
        raise CommandRejected("the run is not preparing its workspace")
    if c.phase == "approval" and d.get("runtime-request", _setup_request_id(run.id)):
        return {"runId": run.id, "status": run.status, "phase": item.data["phase"]}  # a replay
    done = {"ready": "completed", "failed": "failed"}.get(c.phase)
    d.put(replace(item, status=done or ("waiting" if c.phase == "approval" else "running"),
                  text=c.output or None, data={"phase": c.phase}, updated_at=d.now,
                  completed_at=d.now if done else None))
    if c.phase == "approval":
        ingest_request(d, run, d.get("run-attempt", run.active_attempt_id), None,
                       RuntimeRequestOpened("setup", "command", (
                           "Run the project's setup commands in the new worktree: "
                           + "; ".join(c.setup))[:500],
                           {"commands": list(c.setup), "cwd": d.thread.worktree_path}))
    if c.phase == "failed":
        return decide_fail_run(d, FailRun(
            command_id=c.command_id, thread_id=c.thread_id, run_id=run.id, attempt_id=None,
            status=RunStatus.FAILED, reason=c.reason), **kw)
    if c.phase == "ready":
        run = d.put(replace(run, status=RunStatus.STARTING))
        d.effect("provider-turn.start", {"runId": run.id, "attemptId": run.active_attempt_id},
                 run.id)
    return {"runId": run.id, "status": run.status, "phase": c.phase}


def _setup_answered(d: Draft, c: RespondRuntimeRequest, request: RuntimeRequest,
                    declined: bool) -> None:
    """Accepted: the commands run (``workspace.prepare`` again, in the worktree already made).
    Declined (or cancelled): the run starts without them, its item saying so."""
    commands = request.detail["commands"]
    note = "The setup commands were declined; the agent starts without them:\n" + "".join(
        f"$ {command}\n" for command in commands)
    _decide_preparation(d, AdvancePreparation(
        command_id=c.command_id, thread_id=c.thread_id, run_id=request.run_id,
        phase="ready" if declined else "setup", output=note if declined else ""))
    if not declined:
        d.effect("workspace.prepare", {"runId": request.run_id, "setup": commands,
                                       "approved": True}, request.id)


BEGIN_PREPARATION.append(_begin_preparation)
SETUP_ANSWERED.append(_setup_answered)


async def _prepare_workspace(o: Orchestrator, thread_id: str, p: Mapping[str, Any], *,
                             retried: bool) -> None:
    """Make a launch's worktree (first removing what a killed attempt left, branch too) and run
    its setup commands, or ask first (``askSetup``) and end; ``approved``: run them in the
    worktree made before. Release the run, or fail it (a failed setup keeps the worktree)."""
    state = await o.state(thread_id)
    thread = state.thread if state else None
    run = state.run(p["runId"]) if state else None
    if thread is None or run is None or run.status != RunStatus.PREPARING or (
            not p.get("approved") and _setup_request_id(run.id) in
            state.entities["runtime-request"]):  # a replay: the question was asked
        return
    git = cast("Workspaces | None", o.workspaces)  # as t3.py handed it in: this file's
    if git is None or not thread.worktree_path or not thread.branch:
        raise PermanentEffectError("this server cannot make worktrees")
    path, output = thread.worktree_path, ""
    try:
        if not p.get("approved"):
            await _make_worktree(git, p, path, thread.branch, retried=retried)
            if p.get("askSetup"):
                asked = "".join(f"$ {command}\n" for command in p["setup"])
                await _advance_preparation(o, run, "approval", "Waiting for approval to "
                                           f"run:\n{asked}", setup=p["setup"])
                return
        for command in p["setup"]:
            output = f"{output}$ {command}\n"[-PREPARATION_OUTPUT_CHARS:]
            await _advance_preparation(o, run, "setup", output)
            code, text = await git.run_setup(path, command)
            output = (output + text)[-PREPARATION_OUTPUT_CHARS:]
            if code != 0:
                tail = " ".join(text.strip().splitlines()[-3:])
                raise T3Error(f"The setup command {command!r} exited with {code}"
                              f"{': ' + tail[-500:] if tail else ''} (the worktree is kept "
                              f"at {path})")
    except CommandRejected:
        return  # the run ended meanwhile (interrupted): nothing to release
    except T3Error as exc:
        with contextlib.suppress(CommandRejected):
            await _advance_preparation(o, run, "failed", output, str(exc))
        return
    with contextlib.suppress(CommandRejected):
        await _advance_preparation(o, run, "ready", output)


async def _make_worktree(git: Workspaces, p: Mapping[str, Any], path: str, branch: str, *,
                         retried: bool) -> None:
    if retried or os.path.lexists(path):
        await git.remove_worktree(p["repo"], path, branch)
    try:
        await git.add_worktree(
            p["repo"], os.path.basename(path), base_ref=p["baseRef"], branch=branch,
            from_origin=p["fromOrigin"])
    except Exception as exc:
        raise T3Error(f"The worktree could not be made: {exc}") from exc
    crash_point("workspace.prepare:after-worktree")


async def _advance_preparation(o: Orchestrator, run: Run, phase: str, output: str,
                               reason: str = "", setup: Sequence[str] = ()) -> None:
    await o.dispatch(AdvancePreparation(
        command_id=o.new_id("command:prepare"), thread_id=run.thread_id,
        run_id=run.id, phase=phase, output=output, reason=reason, setup=tuple(setup)))


# a second attempt first removes what the first one left
EFFECTS["workspace.prepare"] = EffectKind(lambda o, row: _prepare_workspace(
    o, row.thread_id, row.payload, retried=row.attempt_count > 1), replay_safe=True,
    fails_run=True)
