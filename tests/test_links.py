"""Linked environments end to end: two real t3 servers, each naming the other in
[[environments]], an agent on A delegating to a provider on B (links.py)."""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import McpClient, T3Server, scripted_provider, wait_until
from test_delegation import call_line, create, items, tool_results, wait, wake_prompts


@dataclass
class Pair:
    a: T3Server
    b: T3Server
    mcp_a: McpClient
    mcp_b: McpClient

    @property
    def env_b(self) -> str:
        return str(self.b.info["environmentId"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(server: T3Server) -> str:
    return (f'[[environments]]\nid = "{server.info["environmentId"]}"\n'
            f'url = "{server.url}"\ntoken_file = "{server.data_dir / "client-token"}"\n')


def linked_pair(t3_factory, tmp_path: Path, *, both_ways: bool = False) -> Pair:
    """B (provider beta), then A (provider alpha) linked to B; ``both_ways``: B restarted linked
    to A. Fixed ports, so each side's URL survives a restart of the other."""
    b = t3_factory(providers=[scripted_provider(tmp_path, id="beta")], data_dir=tmp_path / "b",
                   args=["--port", str(_free_port())])
    a = t3_factory(providers=[scripted_provider(tmp_path, id="alpha")], data_dir=tmp_path / "a",
                   args=["--port", str(_free_port())], extra=_environment(b))
    if both_ways:
        b.config.write_text(b.config.read_text() + "\n" + _environment(a))
        b.restart()
    return Pair(a, b, a.client(), b.client())


def delegate_line(pair: Pair, task: str, **args: object) -> str:
    return call_line("delegate_task", {"task": task, "title": "Remote", "target": {
        "providerInstanceId": "beta", "environmentId": pair.env_b}, **args})


def settled_runs(mcp: McpClient, thread_id: str, count: int) -> bool:
    runs = mcp.call("t3_thread_read", {"threadId": thread_id, "runLimit": 50}).structured[
        "recentRuns"]
    return len(runs) >= count and all(r["status"] in ("completed", "failed", "interrupted",
                                                      "cancelled") for r in runs)


def test_remote_delegation_completes_and_wakes_the_parent_once(t3_factory, tmp_path: Path
                                                               ) -> None:
    """Linked both ways: a task delegated from A to beta on B runs there with the parent's
    modes, is tracked by its link, and its completion wakes A's parent exactly once with B's
    answer; an agent on B delegates to alpha on A and waits for the result."""
    pair = linked_pair(t3_factory, tmp_path, both_ways=True)
    env_a = pair.a.info["environmentId"]
    caps = pair.mcp_a.call("orchestrator_capabilities").structured
    assert {(p["providerInstanceId"], p["environmentId"]) for p in caps["providers"]} == {
        ("alpha", env_a), ("beta", pair.env_b)}
    assert caps["linkedEnvironments"] == [
        {"environmentId": pair.env_b, "reachable": True, "error": None}]
    parent = create(pair.mcp_a, delegate_line(pair, "ECHO_PROMPT"),
                    target={"providerInstanceId": "alpha"}, runtimeMode="auto-accept-edits")
    tid = parent["threadId"]
    wait_until(lambda: settled_runs(pair.mcp_a, tid, 2), 60)
    [started] = tool_results(pair.mcp_a, tid)
    link = started["childThreadId"]
    assert link.startswith(f"t3-thread://v2/{pair.env_b}/") and started["childThreadLink"] == link
    assert wake_prompts(tmp_path / "agent-alpha.log") == [(
        f'Delegated task "Remote" completed. Use task_status with taskId {started["taskId"]} '
        "to read the result.")]
    [sub] = [i for i in items(pair.mcp_a, tid) if i["type"] == "subagent"]
    assert sub["status"] == "completed" and sub["text"] == "ECHO_PROMPT"
    child = pair.mcp_a.call("t3_thread_read", {"threadId": link}).structured["thread"]
    assert child["providerInstanceId"] == "beta"
    assert child["runtimeMode"] == "auto-accept-edits"  # the parent's, never broader
    assert pair.a.rows("SELECT status FROM effect_outbox WHERE effect_type = 'link.await'") == [
        ("succeeded",)]
    # The other way: B's agent waits for a task it delegated to A.
    back = create(pair.mcp_b, call_line("delegate_task", {
        "task": "ECHO_PROMPT back", "mode": "wait", "target": {
            "providerInstanceId": "alpha", "environmentId": env_a}}),
        target={"providerInstanceId": "beta"})
    assert wait(pair.mcp_b, back["threadId"])["status"] == "completed"
    [waited] = tool_results(pair.mcp_b, back["threadId"])
    assert waited["status"] == "completed" and waited["summary"] == "ECHO_PROMPT back"
    assert waited["waitTimedOut"] is False and waited["providerInstanceId"] == "alpha"
    assert waited["childThreadId"].startswith(f"t3-thread://v2/{env_a}/")


def test_either_side_killed_while_the_remote_child_runs(t3_factory, tmp_path: Path) -> None:
    """kill -9 of A while B's child runs (20 s of output), then of B: A restarts first and its watch
    finds B gone, B restarts and ends the child's run; the parent on A is woken exactly once."""
    pair = linked_pair(t3_factory, tmp_path)
    parent = create(pair.mcp_a, delegate_line(pair, "SLOW:400"),
                    target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    [started] = wait_until(lambda: tool_results(pair.mcp_a, tid), 30)  # the task is made
    remote_id = started["childThreadId"].rsplit("/", 1)[1]
    pair.a.kill9()
    assert wait(pair.mcp_b, remote_id, timeoutMs=0)["status"] == "running"
    pair.b.kill9()
    pair.a.start()
    wait_until(lambda: "did not answer t3_thread_wait" in pair.a.stderr_text(), 30)
    pair.b.start()  # its recovery ends the run its dead agent had: interrupted
    wait_until(lambda: settled_runs(pair.mcp_a, tid, 2), 60)
    assert wake_prompts(tmp_path / "agent-alpha.log") == [
        'Delegated task "Remote" ended with status interrupted. Use task_status with taskId '
        f"{started['taskId']} to read the result."]
    assert pair.a.rows("SELECT status FROM effect_outbox WHERE effect_type = 'link.await'") == [
        ("succeeded",)]
    [sub] = [i for i in items(pair.mcp_a, tid) if i["type"] == "subagent"]
    assert sub["status"] == "interrupted" and "interrupted" in sub["text"]


def test_remote_task_status_and_cancel(t3_factory, tmp_path: Path) -> None:
    """task_status of a task delegated to B says running while B's child runs; task_cancel
    interrupts the run on B, and the task here ends as a local one does (interrupted, its
    summary B's), with no wake of the parent and no later completion."""
    pair = linked_pair(t3_factory, tmp_path)
    mcp = pair.mcp_a
    parent = create(mcp, delegate_line(pair, "SLOW:2000"), target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    wait(mcp, tid)
    [started] = tool_results(mcp, tid)
    remote_id = started["childThreadId"].rsplit("/", 1)[1]
    wait_until(lambda: "chunk 1" in "".join(i["text"] or "" for i in items(pair.mcp_b,
                                                                           remote_id)), 30)

    def parent_calls(tool: str, **args: object) -> dict:
        """The parent's agent calls ``tool`` on the task in a turn of its own: its result."""
        sent = mcp.call("t3_thread_send", {"threadId": tid, "message": call_line(
            tool, {"taskId": started["taskId"], **args})})
        assert sent.ok, sent.structured
        assert wait(mcp, tid, runId=sent.structured["runId"])["status"] == "completed"
        return tool_results(mcp, tid)[-1]
    running = parent_calls("task_status")
    assert (running["status"], running["workState"], running["summary"]) == (
        "running", "working", None)
    assert (running["childThreadId"], running["childRunId"]) == (
        started["childThreadId"], started["childRunId"])
    assert parent_calls("task_cancel", reason="stop it") == {
        "taskId": started["taskId"], "status": "cancel_requested"}
    assert wait(pair.mcp_b, remote_id, runId=started["childRunId"])["status"] == "interrupted"
    wait_until(lambda: pair.a.rows("SELECT status FROM effect_outbox WHERE effect_type = "
                                   "'link.await'") == [("succeeded",)], 60)
    ended = parent_calls("task_status")
    assert (ended["status"], ended["workState"]) == ("interrupted", "result_available")
    assert ended["summary"].startswith("Child task ended with status interrupted")
    assert "chunk 1" in ended["summary"]  # B's progress before the cancel
    assert parent_calls("task_cancel") == {"taskId": started["taskId"], "status": "interrupted"}
    # The parent ran only the turns sent to it: a cancelled task wakes no one, here as at home.
    assert wake_prompts(tmp_path / "agent-alpha.log") == []
    assert len(mcp.call("t3_thread_read", {"threadId": tid, "runLimit": 50}).structured[
        "recentRuns"]) == 5
    assert pair.a.rows("SELECT status FROM subagents") == [("interrupted",)]


def _accept_queue(port: int) -> int:
    """Connections waiting for the accept of the server listening on ``port`` (its listening
    socket's queue, /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            return int(fields[4].split(":")[1], 16)
    return 0


def test_a_delegation_refused_here_stops_its_remote_thread(t3_factory, tmp_path: Path) -> None:
    """The parent's run ends while B makes the delegated thread (B held stopped until then):
    the record here is refused, and B's new run is interrupted, not left running untracked."""
    pair = linked_pair(t3_factory, tmp_path)
    os.kill(pair.b.pid, signal.SIGSTOP)
    try:
        parent = create(pair.mcp_a, delegate_line(pair, "SLOW:2000"),
                        target={"providerInstanceId": "alpha"})
        wait_until(lambda: _accept_queue(int(pair.b.url.rsplit(":", 1)[1])), 30)  # A calls B
        assert pair.mcp_a.call("t3_thread_interrupt", {"threadId": parent["threadId"]}).ok
        assert wait(pair.mcp_a, parent["threadId"])["status"] == "interrupted"
    finally:
        os.kill(pair.b.pid, signal.SIGCONT)
    [made] = wait_until(lambda: pair.mcp_b.call("t3_thread_list").structured["threads"], 30)
    assert wait(pair.mcp_b, made["threadId"], timeoutMs=30_000)["status"] == "interrupted"
    assert pair.a.rows("SELECT COUNT(*) FROM subagents") == [(0,)]


def test_links_in_thread_tools_and_refusals(t3_factory, tmp_path: Path) -> None:
    """A remote thread's link works in t3_thread_read/wait/send; a link or target naming an
    environment that is not linked is refused, typed, and changes nothing; an agent may not
    make or send to a remote thread broader than itself."""
    pair = linked_pair(t3_factory, tmp_path)
    mcp = pair.mcp_a
    made = create(mcp, "first", target={"providerInstanceId": "beta",
                                        "environmentId": pair.env_b}, runtimeMode="full-access")
    link = made["link"]
    assert link == f"t3-thread://v2/{pair.env_b}/{made['threadId']}"
    assert wait(mcp, link)["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": link, "message": "second"})
    assert sent.ok, sent.structured
    assert wait(mcp, link, runId=sent.structured["runId"])["status"] == "completed"
    texts = [i["text"] for i in mcp.call("t3_thread_read", {"threadId": link}).structured[
        "items"]]
    assert texts[0] == "first" and texts[2] == "second" and len(texts) == 4
    # Not linked: typed failures, nothing made on either side.
    before = [len(m.call("t3_thread_list").structured["threads"]) for m in (mcp, pair.mcp_b)]
    unknown = "t3-thread://v2/env-nowhere/thread-1"
    for tool, args in (("t3_thread_read", {}), ("t3_thread_wait", {}),
                       ("t3_thread_send", {"message": "hi"})):
        assert mcp.call(tool, {"threadId": unknown, **args}).failure_code == "thread_not_found"
    refused = mcp.call("create_threads", {"threads": [{"prompt": "x", "target": {
        "providerInstanceId": "beta", "environmentId": "env-nowhere"}}]})
    assert refused.failure_code == "provider_unavailable"
    # An agent in approval-required: its remote work is no broader.
    narrow = create(mcp, "\n".join([
        delegate_line(pair, "ECHO_PROMPT", runtimeMode="full-access"),
        call_line("delegate_task", {"task": "x", "target": {"environmentId": "env-nowhere"}}),
        call_line("t3_thread_send", {"threadId": link, "message": "widen?"}),
        call_line("create_threads", {"threads": [{"prompt": "x", "runtimeMode": "auto",
                                                  "target": {"environmentId": pair.env_b}}]}),
        call_line("t3_thread_launch", {"message": "x", "target": {"environmentId": pair.env_b},
                                       "workspaceStrategy": {"type": "worktree",
                                                             "baseRef": "main"}})]),
        target={"providerInstanceId": "alpha"}, runtimeMode="approval-required")
    assert wait(mcp, narrow["threadId"])["status"] == "completed"
    codes = [r.get("code") for r in tool_results(mcp, narrow["threadId"])]
    assert codes == ["runtime_mode_escalation_denied", "provider_unavailable",
                     "runtime_mode_escalation_denied", "runtime_mode_escalation_denied",
                     "capability_denied"]  # (a worktree whose setup would run unasked there)
    after = [len(m.call("t3_thread_list").structured["threads"]) for m in (mcp, pair.mcp_b)]
    assert after == [before[0] + 1, before[1]]  # only the narrow thread itself
    # A full-access agent: a retried delegation is the same task and remote thread; a different
    # task under its retry key is refused; B's own typed refusal comes back as it is; a launch.
    wide = create(mcp, "\n".join([
        delegate_line(pair, "ECHO_PROMPT", clientRequestId="once"),
        delegate_line(pair, "ECHO_PROMPT", clientRequestId="once"),
        delegate_line(pair, "other", clientRequestId="once"),
        call_line("delegate_task", {"task": "x", "target": {
            "providerInstanceId": "nope", "environmentId": pair.env_b}}),
        call_line("t3_thread_launch", {"message": "launched", "target": {
            "environmentId": pair.env_b}})]),
        target={"providerInstanceId": "alpha"}, runtimeMode="full-access")
    wait_until(lambda: settled_runs(mcp, wide["threadId"], 2), 60)  # the task's wake ran
    first, again, other, nope, launched = tool_results(mcp, wide["threadId"])
    assert again["taskId"] == first["taskId"] and again["childThreadId"] == first["childThreadId"]
    assert other["code"] == "invalid_request" and nope["code"] == "provider_unavailable"
    assert launched["link"].startswith(f"t3-thread://v2/{pair.env_b}/")
    assert launched["providerInstanceId"] == "beta" and "webUrl" not in launched  # (a person's)
    assert len(wake_prompts(tmp_path / "agent-alpha.log")) == 1
    assert len(pair.mcp_b.call("t3_thread_list").structured["threads"]) == before[1] + 2


@pytest.mark.parametrize(("entry", "said"), [
    ('id = "env-b"\nurl = "http://h:1/mcp"\ntoken_file = "tok"\n',
     ":3: environments[0].url: must be http(s)://host[:port], no path"),
    ('id = "env-b"\nurl = "http://h:1"\ntoken_file = "missing"\n',
     ":4: environments[0].token_file: must name an existing file ('missing')"),
    ('id = "env b"\nurl = "http://h:1"\ntoken_file = "tok"\n',
     ":2: environments[0].id: must be the other t3's environmentId"),
    ('id = "env-b"\nurl = "http://h:1"\n', ": environments[0].token_file: must name"),
    ('id = "env-b"\nurl = "http://h:1"\ntoken_file = "tok"\ntoken = "x"\n',
     ":5: environments[0].token: unknown key")])
def test_an_environment_entry_is_checked_at_startup(tmp_path: Path, entry: str, said: str
                                                    ) -> None:
    """[[environments]]: its id, a URL with no path, an existing token file; nothing else."""
    import t3 as server_module
    (tmp_path / "tok").write_text("secret\n")
    config = tmp_path / "t3.toml"
    config.write_text("[[environments]]\n" + entry)
    with pytest.raises(server_module.ConfigError) as refused:
        server_module.load_config(config, cwd=tmp_path)
    assert str(refused.value).startswith(f"{config}{said}"), refused.value
    config.write_text("[[environments]]\n" + entry.split("token = ")[0].replace(
        "/mcp", "").replace("missing", "tok").replace("env b", "env-b") + (
        "" if "token_file" in entry else 'token_file = "tok"\n'))
    [env] = server_module.load_config(config, cwd=tmp_path).environments
    assert env == {"id": "env-b", "url": "http://h:1", "token_file": str(tmp_path / "tok")}
