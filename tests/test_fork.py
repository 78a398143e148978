"""Fork and merge-back (issue 12, item 6): a person's `fork` (over /ws forkThread) makes a new
thread whose first run gets the source's conversation up to the chosen run only (portable
context with the scripted ACP agent, which has no session/fork; native `thread/fork` with the
real codex CLI), in a worktree of its own at that run's checkpoint when the source works in git;
`merge-back` (/ws mergeBack) hands the fork's runs to the parent with its next message.
Bad points and merge-backs are refused with typed failures and change nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_model import FakeModelServer
from harness import agent_log, scripted_provider, write_config
from real_cli import codex_provider, create, npm_available
from real_cli import wait as real_wait
from test_checkpoints import ws
from test_delegation import wait
from test_lifecycle_stop import cli_json
from test_schedules import prompts
from test_worktrees import git, make_repo, session_cwds

import history
from cli import WsError


def refused(t3, *args: str) -> str:
    done = t3.cli(*args, "--json")
    assert done.returncode != 0, done.stdout
    return done.stdout + done.stderr


def two_runs(mcp) -> str:
    """A thread whose run 1 plans the kiwi migration and run 2 picks the banana route; its id."""
    tid = mcp.call("create_threads", {"threads": [{"prompt": "plan the kiwi migration"}]}
                   ).structured["threads"][0]["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "now pick the banana route"})
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    return tid


def test_fork_from_run_1_carries_only_run_1_and_merge_back_reaches_the_parent(
        t3_factory, agent_log_path: Path) -> None:
    """Fork a 2-run thread at run 1: the fork (lineage fork, listed) starts with a
    full_thread_summary of run 1 and nothing of run 2; merge-back gives the parent's next
    prompt "Merge-back context from forked conversation." with the fork's run. Refused,
    changing nothing: a run that does not exist, a checkpoint that is not ready, a merge-back
    of a thread that is not a fork (or into another thread than its parent)."""
    t3 = t3_factory()
    mcp = t3.client()
    tid = two_runs(mcp)

    assert "run_not_found" in refused(t3, "fork", tid, "--run", "9")
    assert "invalid_request" in refused(t3, "fork", tid, "--checkpoint", "nope")
    assert "invalid_request" in refused(t3, "merge-back", tid)
    listed = mcp.call("t3_thread_list", {}).structured["threads"]
    assert [t["threadId"] for t in listed] == [tid]

    forked = cli_json(t3, "fork", tid, "--run", "1", "--title", "kiwi fork")
    fid = forked["threadId"]
    assert forked["sourcePoint"]["runOrdinal"] == 1 and forked["worktreePath"] is None
    shell = next(t for t in mcp.call("t3_thread_list", {}).structured["threads"]
                 if t["threadId"] == fid)
    assert (shell["parentThreadId"], shell["relationshipToParent"]) == (tid, "fork")
    assert f"(fork of {tid})" in t3.cli("threads").stdout
    sent = mcp.call("t3_thread_send", {"threadId": fid, "message": "explore the fork"})
    assert wait(mcp, fid, runId=sent.structured["runId"])["status"] == "completed"
    first = prompts(agent_log_path)[2]
    assert first.startswith("Context handoff (full_thread_summary):\n"), first
    assert "Covered app runs: 1-1\n" in first and "- User: plan the kiwi migration\n" in first
    assert "banana" not in first and first.endswith("\n\nUser message:\nexplore the fork")
    read = mcp.call("t3_thread_read", {"threadId": fid}).structured
    assert (read["thread"]["parentThreadId"], read["thread"]["relationshipToParent"]) == (
        tid, "fork")

    other = mcp.call("create_threads", {"threads": [{"title": "other"}]}
                     ).structured["threads"][0]["threadId"]
    with pytest.raises(WsError) as failure:
        ws(t3, "mergeBack", {"commandId": "m0", "sourceThreadId": fid, "targetThreadId": other})
    assert failure.value.code == "invalid_request"
    merged = cli_json(t3, "merge-back", fid)
    assert (merged["threadId"], merged["coveredRunOrdinals"]) == (tid, {"from": 1, "to": 1})
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "what came of the fork?"})
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    back = prompts(agent_log_path)[3]
    assert back.startswith("Context handoff (merge_back / fork_delta_summary):\n"
                           "Merge-back context from forked conversation.\n"
                           f"Source thread: {fid}\nTarget thread: {tid}\n"
                           "Covered fork runs: 1-1\n\nFork delta:\n- User: explore the fork\n"), back
    assert back.endswith("\n\nUser message:\nwhat came of the fork?")
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "and again"})
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    assert prompts(agent_log_path)[4] == "and again"  # delivered once


def test_a_scratch_thread_forks_like_any_other(t3) -> None:
    """A thread in a scratch folder (t3_thread_launch scratch: true) can be forked: the fork
    shares its folder (no git there) and its first run gets the source's run."""
    mcp = t3.client()
    tid = mcp.call("t3_thread_launch", {"scratch": True, "message": "plan the kiwi migration"}
                   ).structured["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    fork = ws(t3, "forkThread", {"commandId": "f", "sourceThreadId": tid})
    assert fork["sourcePoint"]["runOrdinal"] == 1 and fork["worktreePath"] is None
    sent = mcp.call("t3_thread_send", {"threadId": fork["threadId"], "message": "go on"})
    assert wait(mcp, fork["threadId"], runId=sent.structured["runId"])["status"] == "completed"


def test_an_acp_agent_with_session_fork_forks_the_latest_run_natively(
        t3_factory, tmp_path: Path) -> None:
    """An ACP agent that advertises session/fork: a fork of the latest run opens by session/fork
    of the source's session and its first prompt is the bare message; a fork of an earlier run
    cannot be made so (ACP forks no earlier turn): a new session with the portable context."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha", args=["--fork"])])
    mcp = t3.client()
    tid = two_runs(mcp)
    for args, text in ((("fork", tid), "explore natively"),
                       (("fork", tid, "--run", "1"), "explore from run 1")):
        fid = cli_json(t3, *args)["threadId"]
        sent = mcp.call("t3_thread_send", {"threadId": fid, "message": text})
        assert wait(mcp, fid, runId=sent.structured["runId"])["status"] == "completed"
    log = [e["msg"] for e in agent_log(tmp_path / "agent-alpha.log") if e["dir"] == "in"]
    source = next(m["params"]["sessionId"] for m in log if m.get("method") == "session/prompt")
    assert [m["params"]["sessionId"] for m in log if m.get("method") == "session/fork"] == [
        source]
    native, portable = prompts(tmp_path / "agent-alpha.log")[2:]
    assert native == "explore natively"
    assert portable.startswith("Context handoff (full_thread_summary):\n") and \
        "banana" not in portable and "- User: plan the kiwi migration\n" in portable


def test_fork_from_a_checkpoint_in_git_runs_in_its_own_worktree_at_that_checkpoint(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """In a git project, fork at run 1's checkpoint after run 2 changed the file: the fork's
    first run prepares a worktree under <data-dir>/worktrees on a new branch with run 1's
    files, and the agent runs there; the user's checkout keeps run 2's file."""
    repo = make_repo(tmp_path, origin=False)
    project = {"id": "proj", "path": str(repo), "title": "Repo"}
    t3 = t3_factory(config=write_config(tmp_path, projects=[project]))
    mcp = t3.client()
    tid = mcp.call("create_threads", {"threads": [{"prompt": "WRITE_FILE notes.txt first"}]}
                   ).structured["threads"][0]["threadId"]
    assert wait(mcp, tid)["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "WRITE_FILE notes.txt second"})
    assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"

    forked = cli_json(t3, "fork", tid, "--checkpoint", history.checkpoint_id(tid, 1))
    path = forked["worktreePath"]
    assert path and Path(path).parent == t3.data_dir / "worktrees", forked
    sent = mcp.call("t3_thread_send", {"threadId": forked["threadId"], "message": "ECHO_CWD"})
    assert wait(mcp, forked["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    assert session_cwds(agent_log_path)[-1] == path
    assert (Path(path) / "notes.txt").read_text() == "first\n"
    assert (repo / "notes.txt").read_text() == "second\n"
    assert git(Path(path), "branch", "--show-current").strip() == forked["branch"]


@pytest.mark.real_cli
@pytest.mark.skipif(not npm_available(), reason="npm is not installed")
def test_real_codex_fork_from_run_1_is_native(model: FakeModelServer, tmp_path: Path,
                                              t3_factory) -> None:
    """The real codex CLI (fake model): fork a 2-run thread at run 1; the fork's first model
    request carries run 1's user text and not run 2's, and no handoff text (codex forked its
    own conversation through run 1's turn)."""
    t3 = t3_factory(providers=[codex_provider(tmp_path, model.url)])
    mcp = t3.client()
    tid = create(mcp, "plan the kiwi migration")["threadId"]
    assert real_wait(mcp, tid)["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": "now pick the banana route"})
    assert real_wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
    fid = cli_json(t3, "fork", tid, "--run", "1")["threadId"]
    sent = mcp.call("t3_thread_send", {"threadId": fid, "message": "explore the fork"})
    assert real_wait(mcp, fid, runId=sent.structured["runId"])["status"] == "completed"
    bodies = [json.dumps(r["body"]) for r in model.requests
              if "explore the fork" in json.dumps(r["body"])]
    assert bodies, [r["path"] for r in model.requests]
    assert "plan the kiwi migration" in bodies[0] and "banana" not in bodies[0]
    assert "Context handoff" not in bodies[0]
    transfer = next(t for t in mcp.call("t3_thread_read", {"threadId": fid}).structured[
        "transfers"] if t["type"] == "fork")
    assert transfer["resolution"]["strategy"] == "native_fork"
