"""Delegation end to end: agents in t3 threads call t3's MCP tools through the injected server."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from harness import McpClient, T3Server, agent_log, scripted_provider, wait_until

pytestmark = pytest.mark.both_stores  # .ci/run runs these again on PostgreSQL


def two_agents(tmp_path: Path) -> list[dict]:
    return [scripted_provider(tmp_path, id="alpha"), scripted_provider(tmp_path, id="beta")]


def create(mcp: McpClient, prompt: str, **entry: object) -> dict:
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: McpClient, thread_id: str, **args: object) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000, **args})
    assert result.ok, result.structured
    return result.structured


def items(mcp: McpClient, thread_id: str, view: str = "activity") -> list[dict]:
    """The whole timeline, read page by page."""
    out, cursor = [], -1
    while True:
        page = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": cursor,
                                           "view": view, "limit": 100}).structured
        out += page["items"]
        if not page["hasMore"]:
            return out
        cursor = page["nextPosition"]


def tool_results(mcp: McpClient, thread_id: str) -> list[dict]:
    """The TOOL_RESULT lines the scripted agent wrote in its assistant messages."""
    out = []
    for item in items(mcp, thread_id, "messages"):
        for line in (item["text"] or "").splitlines():
            if item["type"] == "assistant_message" and line.startswith("TOOL_RESULT: "):
                out.append(json.loads(line[len("TOOL_RESULT: "):]))
    return out


def call_line(tool: str, args: dict) -> str:
    return f"CALL_TOOL {tool} {json.dumps(args)}"


def test_delegate_wait_cross_provider(t3_factory, tmp_path: Path) -> None:
    """An agent on alpha delegates to beta in wait mode and gets beta's answer back."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {
        "task": "ECHO_PROMPT", "target": {"providerInstanceId": "beta"}, "mode": "wait",
        "title": "Echo"}), target={"providerInstanceId": "alpha"})
    assert wait(mcp, parent["threadId"])["status"] == "completed"
    [result] = tool_results(mcp, parent["threadId"])
    assert result["status"] == "completed" and result["waitTimedOut"] is False
    assert result["summary"] == "ECHO_PROMPT"  # the child got the task prompt and nothing else
    assert result["providerInstanceId"] == "beta"
    beta_prompts = [e["msg"]["params"]["prompt"][-1]["text"] for e in agent_log(
        tmp_path / "agent-beta.log") if e["dir"] == "in" and e["msg"].get("method") ==
        "session/prompt"]
    assert beta_prompts == ["ECHO_PROMPT"]
    timeline = items(mcp, parent["threadId"])
    [sub] = [i for i in timeline if i["type"] == "subagent"]
    assert sub["status"] == "completed" and sub["text"] == "ECHO_PROMPT"
    child = mcp.call("t3_thread_read", {"threadId": result["childThreadId"]}).structured
    assert child["thread"]["parentThreadId"] == parent["threadId"]
    assert child["thread"]["relationshipToParent"] == "subagent"
    assert child["thread"]["providerInstanceId"] == "beta"
    types = [t["type"] for t in child["transfers"]]
    assert types == ["subagent_spawn", "subagent_result"]
    assert all(t["status"] == "consumed" for t in child["transfers"])


def wake_prompts(log_path: Path) -> list[str]:
    """Prompts the parent's agent received that are task wakes (the user's block is the last)."""
    return [e["msg"]["params"]["prompt"][-1]["text"] for e in agent_log(log_path)
            if e["dir"] == "in" and e["msg"].get("method") == "session/prompt"
            and e["msg"]["params"]["prompt"][-1]["text"].startswith("Delegated task")]


def runs_settled(mcp: McpClient, thread_id: str, count: int) -> bool:
    runs = mcp.call("t3_thread_read", {"threadId": thread_id, "runLimit": 50}).structured[
        "recentRuns"]
    return len(runs) >= count and all(
        r["status"] in ("completed", "failed", "interrupted", "cancelled") for r in runs)


def spawn_lines(wave: int, n: int, child_prompt: str) -> str:
    return "\n".join(call_line("delegate_task", {
        "task": child_prompt, "title": f"w{wave}c{i}", "target": {"providerInstanceId": "beta"},
        "clientRequestId": f"w{wave}c{i}"}) for i in range(n))


def test_async_waves_wake_the_parent_once_per_child(t3_factory, tmp_path: Path) -> None:
    """3 waves of 5 async children, finishing while the parent runs and while it is idle: 15
    wakes, one per task, none lost, none doubled."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    # Wave 1: the children finish while the parent's turn is still streaming.
    parent = create(mcp, spawn_lines(1, 5, "quick child") + "\nSLOW:60",
                    target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    wait_until(lambda: len(wake_prompts(tmp_path / "agent-alpha.log")) == 5, 60)
    # Wave 2: the parent's turn ends at once; the children finish while it is idle.
    mcp.call("t3_thread_send", {"threadId": tid, "message": spawn_lines(2, 5, "SLOW:10 kid"),
                                "mode": "queue"})
    wait_until(lambda: len(wake_prompts(tmp_path / "agent-alpha.log")) == 10, 60)
    # Wave 3: mixed.
    mcp.call("t3_thread_send", {"threadId": tid, "message": spawn_lines(3, 5, "SLOW:3 kid")
                                + "\nSLOW:20", "mode": "queue"})
    wait_until(lambda: len(wake_prompts(tmp_path / "agent-alpha.log")) == 15, 60)
    wait_until(lambda: runs_settled(mcp, tid, 18), 60)
    wakes = wake_prompts(tmp_path / "agent-alpha.log")
    task_ids = {w.split("taskId ")[1].split(" ")[0] for w in wakes}
    assert len(wakes) == 15 and len(task_ids) == 15
    results = tool_results(mcp, tid)
    assert {r["taskId"] for r in results} == task_ids


def test_wakes_survive_kill9(t3_factory, tmp_path: Path) -> None:
    """3 waves of 5 children, with a kill -9 of the server right after each wave's children
    complete: still exactly 15 wakes, one per task."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, "hello", target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    wait(mcp, tid)
    for wave in (1, 2, 3):
        sent = mcp.call("t3_thread_send", {"threadId": tid, "mode": "queue",
                                           "message": spawn_lines(wave, 5, "quick child")
                                           + "\nSLOW:400"})
        assert sent.ok

        def children_done() -> bool:
            subs = [i for i in items(mcp, tid) if i["type"] == "subagent"
                    and f'"w{wave}c' in json.dumps(i)]
            return len(subs) == 5 and all(s["status"] == "completed" for s in subs)
        wait_until(children_done, 60)
        t3.kill9()
        t3.restart()
        wait_until(lambda: len(wake_prompts(tmp_path / "agent-alpha.log")) >= 5 * wave, 60)
    wait_until(lambda: runs_settled(mcp, tid, 1 + 3 + 15), 90)
    wakes = wake_prompts(tmp_path / "agent-alpha.log")
    assert len(wakes) == 15 and len(set(wakes)) == 15


def test_delegate_retry_after_credential_reissue(t3_factory, tmp_path: Path) -> None:
    """The same delegate_task with the same clientRequestId, also from a new provider session
    (a new credential after a restart), returns the same task and starts no second child turn."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    line = call_line("delegate_task", {"task": "only once", "clientRequestId": "same",
                                       "target": {"providerInstanceId": "beta"}})
    parent = create(mcp, f"{line}\n{line}", target={"providerInstanceId": "alpha"})
    wait(mcp, parent["threadId"])
    first, second = tool_results(mcp, parent["threadId"])
    assert first["taskId"] == second["taskId"]
    wait(mcp, first["childThreadId"])
    t3.stop()
    t3.restart()
    sent = mcp.call("t3_thread_send", {"threadId": parent["threadId"], "message": line})
    wait(mcp, parent["threadId"], runId=sent.structured["runId"])
    third = tool_results(mcp, parent["threadId"])[-1]
    assert third["taskId"] == first["taskId"]
    tokens = {json.dumps(e["msg"]["params"]["mcpServers"]) for e in agent_log(
        tmp_path / "agent-alpha.log") if e["dir"] == "in" and e["msg"].get("method") in (
        "session/new", "session/load")}
    assert len(tokens) == 2  # two sessions, two credentials
    beta_prompts = [e for e in agent_log(tmp_path / "agent-beta.log")
                    if e["dir"] == "in" and e["msg"].get("method") == "session/prompt"]
    assert len(beta_prompts) == 1


def test_task_cancel_stops_child_and_grandchild(t3_factory, tmp_path: Path) -> None:
    """task_cancel on a running task whose child runs its own task: both end interrupted; on a
    completed task it returns completed and changes nothing."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    grandchild = call_line("delegate_task", {"task": "SLOW:600 grandchild", "mode": "wait",
                                             "timeoutMs": 120_000, "title": "grandchild"})
    parent = create(mcp, call_line("delegate_task", {"task": grandchild, "title": "child"}),
                    target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    wait(mcp, tid)
    [task] = tool_results(mcp, tid)

    def grandchild_thread() -> str | None:
        listed = mcp.call("t3_thread_list", {"limit": 100}).structured["threads"]
        return next((t["threadId"] for t in listed
                     if t["parentThreadId"] == task["childThreadId"]), None)
    gid = wait_until(grandchild_thread, 30)
    wait_until(lambda: "chunk 1" in "".join(i["text"] or "" for i in items(mcp, gid)), 30)
    sent = mcp.call("t3_thread_send", {"threadId": tid, "message": call_line(
        "task_cancel", {"taskId": task["taskId"], "reason": "stop it"})})
    wait(mcp, tid, runId=sent.structured["runId"])
    assert tool_results(mcp, tid)[-1] == {"taskId": task["taskId"], "status": "cancel_requested"}
    assert wait(mcp, gid)["status"] == "interrupted"
    assert wait(mcp, task["childThreadId"])["status"] == "interrupted"
    status_line = call_line("task_status", {"taskId": task["taskId"]})
    wait_until(lambda: (mcp.call("t3_thread_send", {"threadId": tid, "message": status_line,
                                                    "mode": "queue"}) and
                        wait(mcp, tid) and
                        tool_results(mcp, tid)[-1]["status"] == "interrupted"), 30)


def test_task_cancel_on_completed_task_changes_nothing(t3_factory, tmp_path: Path) -> None:
    """task_cancel of a finished task returns its status and writes no event."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {"task": "done soon", "mode": "wait"}),
                    target={"providerInstanceId": "alpha"})
    wait(mcp, parent["threadId"])
    [task] = tool_results(mcp, parent["threadId"])
    assert task["status"] == "completed"
    child_events = lambda: len(items(mcp, task["childThreadId"]))  # noqa: E731
    before = child_events()
    sent = mcp.call("t3_thread_send", {"threadId": parent["threadId"], "message": call_line(
        "task_cancel", {"taskId": task["taskId"]})})
    wait(mcp, parent["threadId"], runId=sent.structured["runId"])
    assert tool_results(mcp, parent["threadId"])[-1] == {"taskId": task["taskId"],
                                                         "status": "completed"}
    assert child_events() == before
    assert t3.rows("SELECT status FROM subagents")[0][0] == "completed"


def mcp_calls(log_path: Path) -> list[dict]:
    return [e for e in agent_log(log_path) if e["dir"] == "mcp"]


def session_token(log_path: Path) -> str:
    """The raw bearer token t3 gave the agent's latest session (the agent logs what it got;
    orchestrator_capabilities' probe opens sessions without MCP servers)."""
    opened = [e["msg"] for e in agent_log(log_path) if e["dir"] == "in"
              and e["msg"].get("method") in ("session/new", "session/load")
              and e["msg"]["params"].get("mcpServers")]
    [server] = opened[-1]["params"]["mcpServers"]
    assert (server["type"], server["name"]) == ("http", "t3-code")
    [header] = server["headers"]
    assert header["name"] == "Authorization" and header["value"].startswith("Bearer ")
    return header["value"][len("Bearer "):]


def tools_list(t3: T3Server, token: str) -> int:
    from harness import raw_post
    return raw_post(t3.mcp_url, json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                            "params": {}}).encode(),
                    {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                     "Accept": "application/json, text/event-stream"}).status


@pytest.mark.parametrize("limits", ["credential_max_lifetime_s = 4", "credential_idle_s = 2"])
def test_credentials_expire(t3_factory, tmp_path: Path, agent_log_path: Path,
                            limits: str) -> None:
    """A provider-session credential works during the turn and gets 401 after its configured
    lifetime or idle time."""
    # The delayed call's 8 s count from inside the turn and idle time from its end as t3 sees
    # it: a loaded machine can take seconds between the two, so the margins are seconds too.
    t3 = t3_factory(extra=f"[limits]\n{limits}\n")
    mcp = t3.client()
    parent = create(mcp, "CALL_TOOL orchestrator_capabilities {}\n"
                         "DELAYED_CALL 8 orchestrator_capabilities {}")
    wait(mcp, parent["threadId"])
    calls = wait_until(lambda: len(c := mcp_calls(agent_log_path)) == 2 and c, 30)
    assert [c["httpStatus"] for c in calls] == [200, 401]
    assert calls[0]["result"]["parentThreadId"] == parent["threadId"]


def test_released_session_revokes_its_token_and_no_token_leaks(t3: T3Server, mcp: McpClient,
                                                               agent_log_path: Path) -> None:
    """The token works while its session lives, is refused once the session ends, and appears
    nowhere in the data directory or the server's stderr."""
    parent = create(mcp, "CALL_TOOL orchestrator_capabilities {}")
    wait(mcp, parent["threadId"])
    token = session_token(agent_log_path)
    assert tools_list(t3, token) == 200
    sent = mcp.call("t3_thread_send", {"threadId": parent["threadId"], "message": "CRASH"})
    assert wait(mcp, parent["threadId"], runId=sent.structured["runId"])["status"] == "failed"
    assert tools_list(t3, token) == 401
    assert t3.stop() == 0
    for path in t3.data_dir.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
    assert token not in t3.stderr_text()
    assert (t3.data_dir / "logs").exists() and any((t3.data_dir / "logs").iterdir())


def test_capabilities_through_the_injected_server(t3_factory, tmp_path: Path) -> None:
    """An agent sees its own thread, both instances and the features via orchestrator_capabilities."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, "CALL_TOOL orchestrator_capabilities {}",
                    target={"providerInstanceId": "beta", "model": "scripted-2"})
    wait(mcp, parent["threadId"])
    [caps] = tool_results(mcp, parent["threadId"])
    assert caps["parentThreadId"] == parent["threadId"]
    assert (caps["inheritedProviderInstanceId"], caps["inheritedModel"]) == ("beta", "scripted-2")
    assert [p["providerInstanceId"] for p in caps["providers"]] == ["alpha", "beta"]
    assert all(p["canRunChildTask"] for p in caps["providers"])


def test_failed_child_and_role_prefix(t3_factory, tmp_path: Path) -> None:
    """A failed child's result leads with its provider error; a role adds one line to the task."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, "\n".join([
        call_line("delegate_task", {"task": "FAIL please", "mode": "wait"}),
        call_line("delegate_task", {"task": "ECHO_PROMPT", "role": "review", "mode": "wait"})]),
        target={"providerInstanceId": "alpha"})
    wait(mcp, parent["threadId"])
    failed, reviewed = tool_results(mcp, parent["threadId"])
    assert failed["status"] == "failed"
    assert failed["summary"].startswith("Child task ended with status failed: ")
    assert "scripted failure" in failed["summary"].split("\n")[0]
    assert failed["summary"].index("scripted failure") < failed["summary"].index("failing now")
    assert reviewed["summary"] == "Act as the review sub-agent for this task.\n\nECHO_PROMPT"


def test_wait_timeout_then_the_result_wakes_the_parent(t3_factory, tmp_path: Path) -> None:
    """A wait that times out reports waitTimedOut without cancelling; the child's completion
    then wakes the parent once."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {"task": "SLOW:30 slow child",
                                                     "mode": "wait", "timeoutMs": 300}),
                    target={"providerInstanceId": "alpha"})
    wait(mcp, parent["threadId"])
    [result] = tool_results(mcp, parent["threadId"])
    assert result["waitTimedOut"] is True and result["status"] == "running"
    wait_until(lambda: len(wake_prompts(tmp_path / "agent-alpha.log")) == 1, 30)
    assert wait(mcp, result["childThreadId"])["status"] == "completed"
    wait_until(lambda: runs_settled(mcp, parent["threadId"], 2), 30)
    assert len(wake_prompts(tmp_path / "agent-alpha.log")) == 1


def test_wait_ends_early_for_a_pending_approval(t3_factory, tmp_path: Path) -> None:
    """A child's pending approval ends the parent's wait with pendingApproval; answering it
    lets the child finish."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {"task": "ASK_PERMISSION", "mode": "wait"}),
                    target={"providerInstanceId": "alpha"}, runtimeMode="approval-required")
    wait(mcp, parent["threadId"])
    [result] = tool_results(mcp, parent["threadId"])
    assert result["waitTimedOut"] is False and result["hasPendingQuestion"] is False
    approval = result["pendingApproval"]
    assert approval["kind"] == "command" and approval["runId"] == result["childRunId"]
    answered = mcp.call("t3_pending_request", {"threadId": result["childThreadId"],
                                               "action": "respond",
                                               "requestId": approval["requestId"],
                                               "decision": "accept"})
    assert answered.ok
    assert wait(mcp, result["childThreadId"])["status"] == "completed"


def test_agent_batch_threads_and_async_polling(t3_factory, tmp_path: Path) -> None:
    """An agent creates ordinary threads with per-thread overrides, and polls an async task with
    task_status until its result is available."""
    t3 = t3_factory(providers=two_agents(tmp_path))
    mcp = t3.client()
    parent = create(mcp, "\n".join([
        call_line("create_threads", {"threads": [
            {"prompt": "first"}, {"title": "Idle on beta", "target": {
                "providerInstanceId": "beta"}}], "clientRequestId": "batch"}),
        call_line("delegate_task", {"task": "SLOW:10 background", "title": "bg"}),
        call_line("task_status", {"taskId": "unknown-task"})]),
        target={"providerInstanceId": "alpha"})
    wait(mcp, parent["threadId"])
    batch, task = tool_results(mcp, parent["threadId"])[:2]
    first, idle = batch["threads"]
    assert (first["providerInstanceId"], first["createdBy"], first["creationSource"]) == \
        ("alpha", "agent", "mcp")
    assert (idle["providerInstanceId"], idle["status"], idle["runId"]) == ("beta", "idle", None)
    assert task["status"] in ("queued", "running") and task["workState"] == "working"
    listed = mcp.call("t3_thread_list", {"includeSubagents": False}).structured
    assert {t["threadId"] for t in listed["threads"]} == {
        parent["threadId"], first["threadId"], idle["threadId"]}
    poll = call_line("task_status", {"taskId": task["taskId"]})

    def polled() -> dict:
        sent = mcp.call("t3_thread_send", {"threadId": parent["threadId"], "message": poll,
                                           "mode": "queue"}).structured
        wait(mcp, parent["threadId"], runId=sent["runId"])
        return tool_results(mcp, parent["threadId"])[-1]
    done = wait_until(lambda: (r := polled())["workState"] == "result_available" and r, 60)
    assert done["status"] == "completed" and "chunk 9" in done["summary"]
    assert done["resultContextTransferId"].startswith("context-transfer:subagent_result:")


def test_a_wait_ended_by_a_question_still_gets_the_completion_wake(t3_factory,
                                                                   tmp_path: Path) -> None:
    """A parent's wait ends on its child's question and its turn goes on; the question is
    answered and the child finishes while that run is live (then the server is killed and
    restarted): the completion wakes the parent exactly once."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id="alpha"),
                               scripted_provider(tmp_path, id="grok", driver="grok")])
    mcp = t3.client()
    parent = create(mcp, call_line("delegate_task", {
        "task": "ASK_QUESTION", "title": "asker", "target": {"providerInstanceId": "grok"},
        "mode": "wait", "timeoutMs": 60_000}) + "\nSLOW:2000",
        target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]
    [ended] = wait_until(lambda: mcp_calls(tmp_path / "agent-alpha.log"), 30)
    result = ended["result"]
    assert result["hasPendingQuestion"] is True and result["waitTimedOut"] is False
    child_id = result["childThreadId"]
    [question] = mcp.call("t3_pending_request", {"threadId": child_id, "action": "list"}
                          ).structured["requests"]
    assert mcp.call("t3_pending_request", {"threadId": child_id, "action": "respond",
                                           "requestId": question["requestId"],
                                           "answers": {"q0": "red"}}).ok
    assert wait(mcp, child_id)["status"] == "completed"
    wait_until(lambda: [i["status"] for i in items(mcp, tid) if i["type"] == "subagent"] == [
        "completed"], 30)
    first = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"][-1]
    assert first["status"] == "running"  # the finalization met the parent's live run
    t3.kill9()
    t3.restart()
    wait_until(lambda: runs_settled(mcp, tid, 2), 60)
    [wake] = wake_prompts(tmp_path / "agent-alpha.log")
    assert result["taskId"] in wake and "completed" in wake
    runs = mcp.call("t3_thread_read", {"threadId": tid}).structured["recentRuns"]
    assert [(r["ordinal"], r["status"]) for r in runs] == [(2, "completed"), (1, "interrupted")]



def test_waiting_parents_lend_their_agent_slots_to_their_children(t3_factory,
                                                                  tmp_path: Path) -> None:
    """With max_live_agent_processes = 2, four parents each wait 60 s on a child: every child
    starts within seconds of being asked for and every wait ends with the child's result."""
    t3 = t3_factory(providers=two_agents(tmp_path),
                    extra="[limits]\nmax_live_agent_processes = 2\n")
    mcp = t3.client()
    made = mcp.call("create_threads", {"threads": [{"prompt": call_line("delegate_task", {
        "task": f"ECHO_PROMPT child {i}", "target": {"providerInstanceId": "beta"},
        "mode": "wait", "timeoutMs": 60_000}), "target": {"providerInstanceId": "alpha"}}
        for i in range(4)]})
    assert made.ok, made.structured
    parents = [t["threadId"] for t in made.structured["threads"]]
    for i, parent in enumerate(parents):  # far below the waits' 60 s
        assert wait(mcp, parent, timeoutMs=30_000)["status"] == "completed"
        [result] = tool_results(mcp, parent)
        assert (result["status"], result["waitTimedOut"]) == ("completed", False)
        assert result["summary"] == f"ECHO_PROMPT child {i}"
        [run] = mcp.call("t3_thread_read", {"threadId": result["childThreadId"]}).structured[
            "recentRuns"]
        asked, started = (datetime.fromisoformat(run[k]) for k in ("requestedAt", "startedAt"))
        assert (started - asked).total_seconds() < 5, run


def test_a_run_never_lands_on_an_agent_that_is_being_stopped(t3_factory, tmp_path: Path
                                                             ) -> None:
    """With one agent slot, thread B's start stops thread A's idle agent, which here takes 2 s to
    exit after its stdin closes. A send to A in that window waits for a new agent (in line behind
    B's run) instead of starting a turn on the one being stopped, and both runs complete."""
    t3 = t3_factory(providers=[scripted_provider(tmp_path, env={"SCRIPTED_AGENT_LINGER_S": "2"})],
                    extra="[limits]\nmax_live_agent_processes = 1\n")
    mcp = t3.client()
    [a] = mcp.call("create_threads", {"threads": [{"prompt": "first"}]}).structured["threads"]
    assert wait(mcp, a["threadId"])["status"] == "completed"
    [b] = mcp.call("create_threads", {"threads": [{"prompt": "second"}]}).structured["threads"]
    wait_until(lambda: any(e["dir"] == "eof" for e in agent_log(tmp_path / "agent.log")), 30,
               message="A's idle agent is being stopped for B's run")
    sent = mcp.call("t3_thread_send", {"threadId": a["threadId"], "message": "again"})
    assert sent.ok, sent.structured
    for thread_id, run_id in ((b["threadId"], b["runId"]),
                              (a["threadId"], sent.structured["runId"])):
        ended = mcp.call("t3_thread_wait", {"threadId": thread_id, "runId": run_id,
                                            "timeoutMs": 60_000}).structured
        assert ended["status"] == "completed", ended


def test_nested_waits_borrow_down_the_chain(t3_factory, tmp_path: Path) -> None:
    """With max_live_agent_processes = 1, a parent waits on a child that waits on a grandchild:
    each waiting agent lends its slot on, and the parent's wait ends with the whole result."""
    t3 = t3_factory(providers=two_agents(tmp_path),
                    extra="[limits]\nmax_live_agent_processes = 1\n")
    mcp = t3.client()
    child_task = call_line("delegate_task", {"task": "ECHO_PROMPT grandchild", "mode": "wait",
                                             "timeoutMs": 60_000})
    parent = create(mcp, call_line("delegate_task", {
        "task": child_task, "target": {"providerInstanceId": "beta"}, "mode": "wait",
        "timeoutMs": 60_000}), target={"providerInstanceId": "alpha"})
    assert wait(mcp, parent["threadId"], timeoutMs=30_000)["status"] == "completed"
    [result] = tool_results(mcp, parent["threadId"])
    assert (result["status"], result["waitTimedOut"]) == ("completed", False)
    assert '"summary":"ECHO_PROMPT grandchild"' in result["summary"]
