"""t3_thread_launch's workspace strategies against real git repositories (a bare repository on
disk is `origin`) and the scripted ACP agent, whose logged `session/new` cwd and ECHO_CWD reply
show where it runs: a new worktree under `<data-dir>/worktrees/` on a branch of its own (the
user's checkout untouched), an existing worktree (refused when it is not one of the project's),
`startFromOrigin`, the project's setup commands (their output in the timeline, a failure fails
the launch), a launch killed mid-way finished after the restart, and `create_threads` inheriting
the caller's worktree; `/ws launchThread` through the CLI's `new --worktree`; where a launch may
start from (never t3's checkpoints) and whose launch runs setup unasked (an agent's below
full-access waits for an approval)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import McpClient, T3Server, agent_log, wait_until, write_config
from test_tokens import session_token

import t3 as server
from workspace import Workspaces


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def make_repo(tmp_path: Path, *, origin: bool = True) -> Path:
    """`<tmp>/repo` on branch main with one commit, pushed to the bare `<tmp>/origin.git`."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "u@example.com")
    git(repo, "config", "user.name", "U")
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "first")
    if origin:
        git(tmp_path, "init", "-q", "--bare", "-b", "main", "origin.git")
        git(repo, "remote", "add", "origin", str(tmp_path / "origin.git"))
        git(repo, "push", "-q", "origin", "main")
    (repo / "a.txt").write_text("one\nuncommitted\n")  # the user's work in progress
    (repo / "staged.txt").write_text("staged\n")
    git(repo, "add", "staged.txt")
    return repo


def user_state(repo: Path) -> dict[str, Any]:
    return {"status": git(repo, "status", "--porcelain=v2", "--branch", "--untracked=all"),
            "branches": git(repo, "branch", "-a", "-v"),
            "index": (repo / ".git" / "index").read_bytes(),
            "head": (repo / ".git" / "HEAD").read_bytes()}


def start(t3_factory, tmp_path: Path, repo: Path, *, setup: list[str] | None = None,
          env: dict[str, str] | None = None) -> T3Server:
    project = {"id": "proj", "path": str(repo), "title": "Repo",
               **({"setup": setup} if setup is not None else {})}
    return t3_factory(config=write_config(tmp_path, projects=[project]), env=env)


def launch(mcp: McpClient, strategy: Any, message: str = "ECHO_CWD", **extra: Any):
    return mcp.call("t3_thread_launch", {"message": message, "workspaceStrategy": strategy,
                                         **extra})


def finished(mcp: McpClient, thread_id: str) -> dict[str, Any]:
    return mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000}).structured


def read(mcp: McpClient, thread_id: str) -> dict[str, Any]:
    return mcp.call("t3_thread_read", {"threadId": thread_id, "view": "activity",
                                       "afterPosition": -1}).structured


def reply(mcp: McpClient, thread_id: str) -> str:
    return "".join(i["text"] or "" for i in read(mcp, thread_id)["items"]
                   if i["type"] == "assistant_message")


def session_cwds(log: Path) -> list[str]:
    return [e["msg"]["params"]["cwd"] for e in agent_log(log)
            if e["dir"] == "in" and e["msg"].get("method") in ("session/new", "session/load")]


def run_statuses(t3: T3Server, run_id: str) -> list[str]:
    """Each status a run had, in order, from the event log."""
    payloads = [json.loads(p) for (p,) in t3.rows(
        "SELECT payload_json FROM events WHERE type LIKE 'run.%' ORDER BY sequence")]
    statuses = [p["status"] for p in payloads if p.get("id") == run_id]
    return [s for i, s in enumerate(statuses) if i == 0 or statuses[i - 1] != s]


def worktrees(repo: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in git(repo, "worktree", "list", "--porcelain")
            .splitlines() if line.startswith("worktree ")]


def test_a_worktree_launch_runs_the_agent_in_a_new_worktree_and_leaves_the_checkout_alone(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """From main: the run is preparing, then starts in `<data-dir>/worktrees/...` on a new
    branch at main's commit, where the agent edits a.txt and creates b/new.txt; the thread's
    fields name it; checkpoint 1 and t3_thread_diff list exactly those two files against main's
    tree; the user's checkout reads the same (status, index bytes, HEAD, branches but the new
    one)."""
    repo = make_repo(tmp_path)
    before = user_state(repo)
    t3 = start(t3_factory, tmp_path, repo)
    mcp = t3.client()
    launched = launch(mcp, {"type": "worktree", "baseRef": "main"}, message=(
        "WRITE_FILE a.txt one\\ntwo\nWRITE_FILE b/new.txt new\nECHO_CWD")).structured
    path, branch = launched["worktreePath"], launched["branch"]
    assert launched["workspaceStrategy"] == "worktree" and launched["workspacePath"] == path
    assert Path(path).parent == t3.data_dir / "worktrees" and branch.startswith("t3/")
    assert finished(mcp, launched["threadId"])["status"] == "completed"
    assert run_statuses(t3, launched["runId"])[:2] == ["preparing", "starting"]
    assert reply(mcp, launched["threadId"]) == f"wrote a.txt\nwrote b/new.txt\n{path}"
    assert session_cwds(agent_log_path) == [path]
    assert git(Path(path), "branch", "--show-current").strip() == branch
    assert git(Path(path), "rev-parse", "HEAD") == git(repo, "rev-parse", "main")
    diff = mcp.call("t3_thread_diff", {"threadId": launched["threadId"], "ordinal": 1}).structured
    assert {f["path"]: (f["kind"], f["additions"], f["deletions"]) for f in diff["files"]} == {
        "a.txt": ("modified", 1, 0), "b/new.txt": ("added", 1, 0)}  # against main's a.txt
    assert "one\n+two\n" in diff["diff"] and diff["toCheckpointId"].endswith(":1")
    user_umask = os.umask(0o022)
    os.umask(user_umask)  # git wrote it with the user's umask, not the server's private 077
    assert (Path(path) / "a.txt").stat().st_mode & 0o777 == 0o666 & ~user_umask
    thread = read(mcp, launched["threadId"])["thread"]
    assert (thread["branch"], thread["worktreePath"], thread["workspacePath"]) == (
        branch, path, path)
    listed = mcp.call("t3_thread_list", {}).structured["threads"][0]
    assert (listed["branch"], listed["worktreePath"]) == (branch, path)
    preparing = [i for i in read(mcp, launched["threadId"])["items"]
                 if i["type"] == "workspace_setup"]
    assert [(i["title"], i["status"]) for i in preparing] == [
        ("Preparing workspace", "completed")]
    after = user_state(repo)
    new_branch_line = [line for line in after["branches"].splitlines() if branch in line]
    assert len(new_branch_line) == 1
    after["branches"] = after["branches"].replace(new_branch_line[0] + "\n", "")
    assert after == before


def test_start_from_origin_fetches_and_without_origin_fails_clearly(
        t3_factory, tmp_path: Path) -> None:
    """startFromOrigin starts at origin's newest commit (fetched, not the stale local main);
    without an origin remote, a taken branch or an unknown baseRef the launch is refused with
    invalid_request and nothing is made."""
    repo = make_repo(tmp_path)
    other = tmp_path / "other"
    git(tmp_path, "clone", "-q", str(tmp_path / "origin.git"), str(other))
    (other / "b.txt").write_text("from origin\n")
    git(other, "add", "-A")
    git(other, "-c", "user.email=o@example.com", "-c", "user.name=O", "commit", "-qm", "second")
    git(other, "push", "-q", "origin", "main")
    t3 = start(t3_factory, tmp_path, repo)
    mcp = t3.client()
    launched = launch(mcp, {"type": "worktree", "baseRef": "main", "branch": "feature/x",
                            "startFromOrigin": True}).structured
    assert finished(mcp, launched["threadId"])["status"] == "completed"
    path = Path(launched["worktreePath"])
    assert git(path, "rev-parse", "HEAD") == git(other, "rev-parse", "HEAD")
    assert git(path, "branch", "--show-current").strip() == "feature/x"
    assert (path / "b.txt").read_text() == "from origin\n"

    git(repo, "remote", "remove", "origin")
    before = user_state(repo)
    threads = mcp.call("t3_thread_list", {}).structured["total"]
    for strategy, words in (
            ({"type": "worktree", "baseRef": "main", "startFromOrigin": True},
             "no remote named origin"),
            ({"type": "worktree", "baseRef": "main", "branch": "feature/x"}, "already exists"),
            ({"type": "worktree", "baseRef": "nope"}, "no commit 'nope'"),
            ({"type": "worktree", "baseRef": "--upload-pack=x"}, "not a branch or ref name")):
        refused = launch(mcp, strategy)
        assert refused.failure_code == "invalid_request" and words in refused.text, refused.text
    assert mcp.call("t3_thread_list", {}).structured["total"] == threads
    assert user_state(repo) == before and len(worktrees(repo)) == 2
    git(repo, "remote", "add", "origin", str(tmp_path / "gone.git"))  # a fetch that fails
    lost = launch(mcp, {"type": "worktree", "baseRef": "main", "startFromOrigin": True})
    assert finished(mcp, lost.structured["threadId"])["status"] == "failed"
    reason = read(mcp, lost.structured["threadId"])["recentRuns"][0]["statusReason"]
    assert reason.startswith("The worktree could not be made: git fetch:"), reason
    assert len(worktrees(repo)) == 2 and git(repo, "branch", "--list", "t3/*") == ""


def test_an_existing_worktree_of_the_project_is_accepted_and_others_are_refused(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """existing_worktree: a worktree of the project's repository binds the thread (cwd, branch);
    a plain folder, another repository's worktree and a wrong branch are invalid_request."""
    repo = make_repo(tmp_path, origin=False)
    mine = tmp_path / "mine"
    git(repo, "worktree", "add", "-q", "-b", "topic", str(mine), "main")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    git(foreign, "init", "-q")
    t3 = start(t3_factory, tmp_path, repo)
    mcp = t3.client()
    launched = launch(mcp, {"type": "existing_worktree", "worktreePath": str(mine)}).structured
    assert (launched["branch"], launched["worktreePath"]) == ("topic", str(mine))
    assert finished(mcp, launched["threadId"])["status"] == "completed"
    assert reply(mcp, launched["threadId"]) == str(mine)
    assert session_cwds(agent_log_path) == [str(mine)]
    assert read(mcp, launched["threadId"])["thread"]["branch"] == "topic"
    for strategy, words in (
            ({"worktreePath": str(tmp_path / "plain")}, "is not a worktree"),
            ({"worktreePath": str(foreign)}, "is not a worktree"),
            ({"worktreePath": str(mine), "branch": "main"}, "is on topic, not main")):
        (tmp_path / "plain").mkdir(exist_ok=True)
        refused = launch(mcp, {"type": "existing_worktree", **strategy})
        assert refused.failure_code == "invalid_request" and words in refused.text, refused.text
    assert mcp.call("t3_thread_list", {}).structured["total"] == 1


def test_setup_runs_in_the_new_worktree_before_the_agent_and_its_output_is_in_the_timeline(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """`[[projects]] setup` runs in the worktree before the first turn (the agent finds what it
    made); its output is the "Preparing workspace" item's text."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo,
               setup=["echo setting up in $PWD", "echo ready > made-by-setup.txt"])
    mcp = t3.client()
    launched = launch(mcp, {"type": "worktree", "baseRef": "main"}).structured
    assert finished(mcp, launched["threadId"])["status"] == "completed"
    path = launched["worktreePath"]
    assert (Path(path) / "made-by-setup.txt").read_text() == "ready\n"
    item = next(i for i in read(mcp, launched["threadId"])["items"]
                if i["type"] == "workspace_setup")
    assert item["status"] == "completed"
    assert item["text"] == (f"$ echo setting up in $PWD\nsetting up in {path}\n"
                            "$ echo ready > made-by-setup.txt\n")


def test_a_failing_setup_fails_the_launch_with_its_output(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """A setup command that exits non-zero fails the run with the command, its exit code and
    its output; the agent is never prompted; the commands after it do not run; the worktree is
    kept for a look."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo,
               setup=["echo installing; echo no network >&2; exit 3", "touch never.txt"])
    mcp = t3.client()
    launched = launch(mcp, {"type": "worktree", "baseRef": "main"}).structured
    done = finished(mcp, launched["threadId"])
    assert done["status"] == "failed"
    run = read(mcp, launched["threadId"])["recentRuns"][0]
    assert "exited with 3" in run["statusReason"] and "no network" in run["statusReason"]
    assert not any(e["dir"] == "in" and e["msg"].get("method") == "session/prompt"
                   for e in agent_log(agent_log_path))
    item = next(i for i in read(mcp, launched["threadId"])["items"]
                if i["type"] == "workspace_setup")
    assert item["status"] == "failed" and "installing\nno network" in item["text"]
    assert not (Path(launched["worktreePath"]) / "never.txt").exists()
    assert worktrees(repo)[1:] == [launched["worktreePath"]]  # kept for a look (README)


def test_a_launch_killed_after_its_worktree_was_made_is_finished_after_the_restart(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """kill -9 right after `git worktree add` (before setup): after the restart the launch is
    made again from scratch and completes; one worktree and one branch, setup ran to the end,
    the agent runs there; only its checkpoints' refs and no temporary index are left."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo, setup=["echo set >> setup-runs.txt"],
               env={"T3_TEST_HOOKS": "1", "T3_CRASH_AT": "workspace.prepare:after-worktree"})
    mcp = t3.client()
    try:
        launched = launch(mcp, {"type": "worktree", "baseRef": "main"}).structured
    except Exception:  # the server may die before it answered  # noqa: BLE001
        launched = None
    wait_until(lambda: not t3.running, 30)
    path = next((t3.data_dir / "worktrees").iterdir())
    assert str(path) in worktrees(repo) and not (path / "setup-runs.txt").exists()
    t3.env.pop("T3_CRASH_AT")
    t3.start()
    thread_id = launched["threadId"] if launched else \
        mcp.call("t3_thread_list", {}).structured["threads"][0]["threadId"]
    assert finished(mcp, thread_id)["status"] == "completed"
    assert reply(mcp, thread_id) == str(path)
    assert (path / "setup-runs.txt").read_text() == "set\n"
    assert worktrees(repo) == [str(repo), str(path)]
    assert git(repo, "branch", "--list", "t3/*").count("t3/") == 1
    assert session_cwds(agent_log_path) == [str(path)]
    refs = git(repo, "for-each-ref", "--format=%(refname)", "refs/t3").split()
    assert [r.rsplit("/", 1)[1] for r in refs] == ["0", "1"]  # the launch's own checkpoints
    assert list((t3.data_dir / "git-index").iterdir()) == []


def test_create_threads_from_a_worktree_thread_inherits_its_worktree(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """A thread that create_threads makes from a worktree thread works in the same worktree,
    on the same branch; t3_thread_launch with no strategy does not inherit it (the root)."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo)
    mcp = t3.client()
    prompt = ('CALL_TOOL create_threads {"threads": [{"prompt": "ECHO_CWD"}]}\n'
              'CALL_TOOL t3_thread_launch {"message": "ECHO_CWD"}')
    launched = launch(mcp, {"type": "worktree", "baseRef": "main"}, message=prompt).structured
    assert finished(mcp, launched["threadId"])["status"] == "completed"
    results = [json.loads(line.removeprefix("TOOL_RESULT: "))
               for line in reply(mcp, launched["threadId"]).splitlines()
               if line.startswith("TOOL_RESULT: ")]
    child_id, root_id = results[0]["threads"][0]["threadId"], results[1]["threadId"]
    assert finished(mcp, child_id)["status"] == "completed"
    child = read(mcp, child_id)["thread"]
    assert (child["branch"], child["worktreePath"], child["workspacePath"]) == (
        launched["branch"], launched["worktreePath"], launched["worktreePath"])
    assert reply(mcp, child_id) == launched["worktreePath"]
    assert finished(mcp, root_id)["status"] == "completed"
    assert reply(mcp, root_id) == str(repo)


def test_the_cli_new_takes_a_worktree(t3_factory, tmp_path: Path) -> None:
    """`python t3.py new TEXT --worktree main --branch B` launches through /ws launchThread
    into a new worktree on branch B; a wrong combination of options is refused."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo)
    done = t3.cli("new", "ECHO_CWD", "--worktree", "main", "--branch", "cli-branch", "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    thread_id = printed["threadId"]
    mcp = t3.client()
    assert finished(mcp, thread_id)["status"] == "completed"
    thread = read(mcp, thread_id)["thread"]
    assert thread["branch"] == printed["branch"] == "cli-branch"
    assert printed["workspacePath"] == thread["worktreePath"]
    assert reply(mcp, thread_id) == thread["worktreePath"] == thread["workspacePath"]
    assert git(Path(thread["worktreePath"]), "branch", "--show-current").strip() == "cli-branch"
    refused = t3.cli("new", "x", "--branch", "b")
    assert refused.returncode != 0 and "--worktree" in refused.stderr


def test_the_setup_key_takes_a_list_of_commands(tmp_path: Path) -> None:
    """`[[projects]] setup` is a list of non-empty strings; anything else stops startup with the
    file, line and key."""
    config = tmp_path / "t3.toml"
    config.write_text(f'[[projects]]\nid = "p"\npath = "{tmp_path}"\nsetup = ["make", "ls"]\n')
    assert server.load_config(config, cwd=tmp_path).projects[0]["setup"] == ["make", "ls"]
    config.write_text(f'[[projects]]\nid = "p"\npath = "{tmp_path}"\nsetup = "make"\n')
    with pytest.raises(server.ConfigError, match=r"t3.toml:4: projects\[0\].setup: must be a list"):
        server.load_config(config, cwd=tmp_path)


def test_removing_a_half_made_worktree_clears_its_folder(tmp_path: Path) -> None:
    """What a `git worktree add` killed before it registered the worktree leaves (a folder under
    worktrees/ git does not know, and the branch) is removed, so the launch can be made again."""
    repo = make_repo(tmp_path, origin=False)
    (tmp_path / "data").mkdir(mode=0o700)
    spaces = Workspaces(tmp_path / "data")
    half = spaces.worktrees_dir / "half"
    (half / "sub").mkdir(parents=True)
    (half / "sub" / "file").write_text("partial")
    git(repo, "branch", "t3/half", "main")

    async def again() -> str:
        await spaces.remove_worktree(str(repo), str(half), "t3/half")
        return await spaces.add_worktree(str(repo), "half", base_ref="main", branch="t3/half")
    assert asyncio.run(again()) == str(half)
    assert worktrees(repo) == [str(repo), str(half)] and not (half / "sub").exists()


def test_interrupting_a_preparing_run_kills_its_setup(t3_factory, tmp_path: Path,
                                                      agent_log_path: Path) -> None:
    """t3_thread_interrupt while a setup command runs: the run is interrupted at once, the setup
    command's process is killed, the agent is never prompted."""
    repo = make_repo(tmp_path, origin=False)
    nap = f"sleep 613.{os.getpid()}"
    t3 = start(t3_factory, tmp_path, repo, setup=[nap])
    mcp = t3.client()
    launched = launch(mcp, {"type": "worktree", "baseRef": "main"}).structured
    wait_until(lambda: sleepers(nap), 30, message="the setup command runs")
    stopped = mcp.call("t3_thread_interrupt", {"threadId": launched["threadId"]}).structured
    assert stopped["status"] == "interrupted"
    wait_until(lambda: not sleepers(nap), 10, message="the setup command was killed")
    assert finished(mcp, launched["threadId"])["status"] == "interrupted"
    assert not any(e["dir"] == "in" and e["msg"].get("method") == "session/prompt"
                   for e in agent_log(agent_log_path))


def sleepers(command: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().replace(
                    b"\0", b" ").strip() == command.encode():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


# -- who may run setup, and from where --------------------------------------------------------

def launch_line(base_ref: str, **extra: Any) -> str:
    """A CALL_TOOL line for the scripted agent: t3_thread_launch into a worktree of base_ref."""
    return "CALL_TOOL t3_thread_launch " + json.dumps({
        "message": "ECHO_CWD", "workspaceStrategy": {"type": "worktree", "baseRef": base_ref},
        **extra})


def launches(log: Path) -> list[dict[str, Any]]:
    """What each t3_thread_launch the scripted agents made answered (structured), in order."""
    return [e["result"] for e in agent_log(log) if e["dir"] == "mcp"
            and e["tool"] == "t3_thread_launch"]


def agent_launches(mcp: McpClient, log: Path, mode: str, *bases: str) -> list[dict[str, Any]]:
    """A thread in runtime mode ``mode`` whose agent launches one worktree thread per base:
    what the launches answered."""
    before = len(launches(log))
    parent = launch(mcp, "root", message="\n".join(map(launch_line, bases)),
                    runtimeMode=mode).structured
    assert finished(mcp, parent["threadId"])["status"] == "completed"
    return launches(log)[before:]


def thread_ids(mcp: McpClient) -> list[str]:
    return [t["threadId"] for t in mcp.call("t3_thread_list", {}).structured["threads"]]


def pending(mcp: McpClient, thread_id: str) -> list[dict[str, Any]]:
    return mcp.call("t3_pending_request", {"threadId": thread_id,
                                           "action": "list"}).structured["requests"]


def setup_item(mcp: McpClient, thread_id: str) -> dict[str, Any]:
    return next(i for i in read(mcp, thread_id)["items"] if i["type"] == "workspace_setup")


def test_an_agent_cannot_launch_from_its_own_checkpoint(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """An agent that rewrote scripts/bootstrap.sh launches from its own checkpoint (the
    refs/t3/... ref, the t3/... short name git would also find, the checkpoint's commit id):
    each launch is invalid_request and nothing is written (no thread, worktree or branch)."""
    from workspace import checkpoint_ref
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo, setup=["sh scripts/bootstrap.sh"])
    mcp = t3.client()
    agent = launch(mcp, "root", message="WRITE_FILE scripts/bootstrap.sh touch pwned",
                   runtimeMode="auto-accept-edits").structured
    assert finished(mcp, agent["threadId"])["status"] == "completed"
    ref = checkpoint_ref(agent["threadId"], 1)
    commit = git(repo, "rev-parse", ref).strip()
    assert "touch pwned" in git(repo, "show", f"{commit}:scripts/bootstrap.sh")
    before = (user_state(repo), worktrees(repo), thread_ids(mcp))
    sent = mcp.call("t3_thread_send", {"threadId": agent["threadId"], "message": "\n".join(
        launch_line(base) for base in (ref, ref.removeprefix("refs/"), commit, commit[:12]))})
    assert sent.ok, sent.structured
    assert finished(mcp, agent["threadId"])["status"] == "completed"
    answers = launches(agent_log_path)
    assert [a.get("code") for a in answers] == ["invalid_request"] * 4, answers
    assert all("t3's own refs never are one" in a["message"] for a in answers), answers
    after = (user_state(repo), worktrees(repo), thread_ids(mcp))
    assert after == before and list((t3.data_dir / "worktrees").iterdir()) == []


def test_a_launch_base_is_a_branch_a_tag_a_remote_branch_or_a_commit_they_hold(
        tmp_path: Path) -> None:
    """worktree_problem (every launch's check) admits branches, tags and remote-tracking
    branches by short or full name and commit ids one of them holds; it refuses t3's refs, other
    refs (refs/notes, refs/stash, HEAD), a commit only such a ref holds, and a ref planted at
    refs/<name> where git's own lookup would find it before the branch."""
    repo = make_repo(tmp_path)
    git(repo, "fetch", "-q", "origin")
    git(repo, "tag", "-a", "-m", "v", "v1", "main")
    first = git(repo, "rev-parse", "main").strip()
    git(repo, "stash", "-q")
    hidden = git(repo, "rev-parse", "refs/stash").strip()
    git(repo, "update-ref", "refs/t3/checkpoints/x/1", hidden)
    git(repo, "update-ref", "refs/notes/x", hidden)
    git(repo, "update-ref", "refs/topic", hidden)  # git's `topic` would be this one
    git(repo, "branch", "topic", "main")
    (tmp_path / "data").mkdir(mode=0o700)
    spaces = Workspaces(tmp_path / "data")

    def problem(base: str) -> str | None:
        return asyncio.run(spaces.worktree_problem(str(repo), base_ref=base, branch="t3/new",
                                                   from_origin=False))
    for good in ("main", "refs/heads/main", "v1", "refs/tags/v1", "origin/main",
                 "refs/remotes/origin/main", first, first[:10]):
        assert problem(good) is None, good
    for bad in ("refs/t3/checkpoints/x/1", "t3/checkpoints/x/1", "refs/notes/x", "refs/stash",
                "stash", "HEAD", hidden, hidden[:10]):
        assert "no commit" in (problem(bad) or ""), bad
    made = asyncio.run(spaces.add_worktree(str(repo), "w", base_ref="topic", branch="t3/w"))
    assert git(Path(made), "rev-parse", "HEAD").strip() == first  # the branch, not refs/topic
    assert asyncio.run(spaces.worktree_problem(
        str(repo), base_ref="refs/t3/checkpoints/x/1", branch="t3/o", from_origin=True))


def test_an_agents_launch_asks_before_its_setup_runs_and_the_answer_holds_across_a_restart(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """An auto-accept-edits agent launches three worktree threads into a project whose setup
    writes a marker: each first run waits `preparing` on a pending command approval listing the
    commands (t3_pending_request, listPendingRequests through the CLI, the timeline), with no
    marker, also after a restart; the launching agent may not answer it. Accepted by the client
    token, setup runs and the agent starts; declined through the CLI, the agent starts without
    it and the "Preparing workspace" item says so; interrupted, the request is cancelled."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo, setup=["echo ran > setup-marker.txt"])
    mcp = t3.client()
    children = agent_launches(mcp, agent_log_path, "auto-accept-edits", *["main"] * 3)
    assert all("threadId" in child for child in children), children
    launcher = McpClient(t3.mcp_url, session_token(agent_log_path))
    requests = {}
    for child in children:
        thread_id = child["threadId"]
        wait_until(lambda: pending(mcp, thread_id), 30, message="the setup approval is asked")
        [request] = pending(mcp, thread_id)
        detail = mcp.call("t3_pending_request", {"threadId": thread_id, "action": "read",
                                                 "requestId": request["requestId"]}).structured
        assert request["kind"] == "command" and "echo ran > setup-marker.txt" in request["title"]
        assert detail["request"]["detail"] == {"commands": ["echo ran > setup-marker.txt"],
                                               "cwd": child["worktreePath"]}
        assert setup_item(mcp, thread_id)["status"] == "waiting"
        asked = [i for i in read(mcp, thread_id)["items"] if i["type"] == "approval_request"]
        assert [i["status"] for i in asked] == ["waiting"]
        refused = launcher.call("t3_pending_request", {
            "threadId": thread_id, "action": "respond", "requestId": request["requestId"],
            "decision": "accept"})
        assert refused.failure_code == "capability_denied", refused.text
        requests[thread_id] = request["requestId"]
    launcher.close()
    listed = json.loads(t3.cli("requests", "--json").stdout)["requests"]
    assert sorted(r["requestId"] for r in listed) == sorted(requests.values())
    t3.restart()
    accepted, declined, dropped = (c["threadId"] for c in children)
    assert [len(pending(mcp, t)) for t in requests] == [1, 1, 1]
    assert [read(mcp, t)["recentRuns"][0]["status"] for t in requests] == ["preparing"] * 3
    assert not any((Path(c["worktreePath"]) / "setup-marker.txt").exists() for c in children)
    answered = mcp.call("t3_pending_request", {"threadId": accepted, "action": "respond",
                                               "requestId": requests[accepted],
                                               "decision": "accept"})
    assert answered.ok, answered.structured
    assert finished(mcp, accepted)["status"] == "completed"
    assert (Path(children[0]["worktreePath"]) / "setup-marker.txt").read_text() == "ran\n"
    assert reply(mcp, accepted) == children[0]["worktreePath"]
    assert setup_item(mcp, accepted)["status"] == "completed"
    done = t3.cli("answer", requests[declined], "decline")
    assert done.returncode == 0, done.stderr
    assert finished(mcp, declined)["status"] == "completed"
    assert reply(mcp, declined) == children[1]["worktreePath"]
    assert not (Path(children[1]["worktreePath"]) / "setup-marker.txt").exists()
    note = setup_item(mcp, declined)
    assert note["status"] == "completed" and note["text"].startswith(
        "The setup commands were declined; the agent starts without them:\n"
        "$ echo ran > setup-marker.txt"), note
    assert mcp.call("t3_thread_interrupt", {"threadId": dropped}).structured["status"] == \
        "interrupted"
    assert pending(mcp, dropped) == [] and finished(mcp, dropped)["status"] == "interrupted"
    assert not (Path(children[2]["worktreePath"]) / "setup-marker.txt").exists()


def test_a_persons_launch_and_a_full_access_agents_launch_run_setup_without_asking(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """The client token's launch and a full-access agent's launch run the setup at once: the
    marker is there when the agent starts, and no approval was ever asked."""
    repo = make_repo(tmp_path, origin=False)
    t3 = start(t3_factory, tmp_path, repo, setup=["echo ran > setup-marker.txt"])
    mcp = t3.client()
    children = [launch(mcp, {"type": "worktree", "baseRef": "main"}).structured,
                *agent_launches(mcp, agent_log_path, "full-access", "main")]
    for child in children:
        assert finished(mcp, child["threadId"])["status"] == "completed"
        assert (Path(child["worktreePath"]) / "setup-marker.txt").read_text() == "ran\n"
        assert not any(i["type"] == "approval_request"
                       for i in read(mcp, child["threadId"])["items"])
