"""Security and limits (issue 10), one section per numbered item of the issue. Each test drives a
real server over real HTTP with the scripted ACP agent; agents' own credentials (read from the
scripted agent's log, where it records the MCP headers t3 gave it) play the prompt-injected agent.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import orchestrator as orch
from harness import McpClient, T3Server, agent_log, raw_post, scripted_provider, wait_until


def call_line(tool: str, args: dict) -> str:
    return f"CALL_TOOL {tool} {json.dumps(args)}"


def create(mcp: McpClient, prompt: str | None = None, **entry: object) -> dict:
    result = mcp.call("create_threads", {"threads": [
        {**({"prompt": prompt} if prompt else {}), **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: McpClient, thread_id: str, **args: object) -> dict:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000, **args},
                      timeout=90)
    assert result.ok, result.structured
    return result.structured


def event_count(server: T3Server, thread_id: str) -> int:
    return query(server, "SELECT COUNT(*) FROM events WHERE thread_id = ?", thread_id)[0][0]


def query(server: T3Server, sql: str, *params: object) -> list[tuple]:
    with sqlite3.connect(f"file:{server.data_dir / 't3.sqlite'}?mode=ro", uri=True) as db:
        return db.execute(sql, params).fetchall()


def session_tokens(log_path: Path) -> list[str]:
    """The bearer tokens t3 gave the scripted agent logging to `log_path`, oldest first."""
    tokens = []
    for entry in agent_log(log_path):
        if entry["dir"] == "in" and entry["msg"].get("method") in ("session/new", "session/load"):
            [header] = entry["msg"]["params"]["mcpServers"][0]["headers"]
            tokens.append(header["value"].removeprefix("Bearer "))
    return tokens


def mcp_calls(log_path: Path) -> list[dict]:
    """The MCP tool calls the scripted agent made, as it logged them when each ended."""
    return [e for e in agent_log(log_path) if e["dir"] == "mcp"]


def refused(server: T3Server, caller: McpClient, tool: str, args: dict, code: str, *,
            thread_id: str) -> dict:
    """The call fails with ``code`` and writes nothing to the thread it names (or would make)."""
    before = event_count(server, thread_id)
    result = caller.call(tool, args)
    assert result.failure_code == code, (tool, result.structured)
    assert event_count(server, thread_id) == before, f"{tool} refused with {code} but wrote"
    return result.structured


def tools_list_status(server: T3Server, token: str) -> int:
    return raw_post(server.mcp_url, json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                                "params": {}}).encode(),
                    {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                     "Accept": "application/json, text/event-stream"}).status


def children(mcp: McpClient, parent_id: str) -> list[dict]:
    listed = mcp.call("t3_thread_list", {"includeSubagents": True, "limit": 100}).structured
    return [t for t in listed["threads"] if t["parentThreadId"] == parent_id]


def running(mcp: McpClient, thread_id: str) -> bool:
    return mcp.call("t3_thread_read", {"threadId": thread_id}).structured["thread"][
        "status"] == "running"


# ---- item 1: approval authority


def pending_request(mcp: McpClient, thread_id: str) -> str:
    result = wait(mcp, thread_id)
    assert result["pendingApproval"], result
    return result["pendingApproval"]["requestId"]


def test_only_a_broad_enough_ancestor_answers_an_agents_request(t3_factory, tmp_path: Path
                                                                 ) -> None:
    """The child-approves-parent attack and an unrelated live thread's answer are refused and
    write nothing; an approval-required parent may not approve its child's command; a
    full-access parent may, and the child's activity view says who answered."""
    names = ("parent", "child", "bystander", "boss", "worker")
    t3 = t3_factory(providers=[scripted_provider(tmp_path, id=n) for n in names])
    client = t3.client()
    delegate = {"task": "ASK_PERMISSION", "target": {"providerInstanceId": "child"}}
    parent = create(client, call_line("delegate_task", delegate) + "\nASK_PERMISSION",
                    runtimeMode="approval-required", target={"providerInstanceId": "parent"})
    parent_request = pending_request(client, parent["threadId"])
    [child] = wait_until(lambda: children(client, parent["threadId"]), 30)
    child_request = pending_request(client, child["threadId"])
    bystander = create(client, "SLOW:2000", target={"providerInstanceId": "bystander"})
    wait_until(lambda: running(client, bystander["threadId"]), 30)
    token = {n: session_tokens(tmp_path / f"agent-{n}.log")[-1]
             for n in ("parent", "child", "bystander")}
    attacks = [("child", parent, parent_request), ("bystander", parent, parent_request),
               ("bystander", child, child_request), ("parent", parent, parent_request),
               ("parent", child, child_request)]  # the last: approval-required cannot grant
    for name, target, request_id in attacks:
        agent = McpClient(t3.mcp_url, token[name])
        try:
            refused(t3, agent, "t3_pending_request", {
                "threadId": target["threadId"], "action": "respond", "requestId": request_id,
                "decision": "accept"}, "capability_denied", thread_id=target["threadId"])
        finally:
            agent.close()
    assert pending_request(client, parent["threadId"]) == parent_request
    assert pending_request(client, child["threadId"]) == child_request

    delegate = {"task": "ASK_PERMISSION", "target": {"providerInstanceId": "worker"},
                "runtimeMode": "approval-required"}
    boss = create(client, call_line("delegate_task", delegate) + "\nSLOW:2000",
                  runtimeMode="full-access", target={"providerInstanceId": "boss"})
    [worker] = wait_until(lambda: children(client, boss["threadId"]), 30)
    worker_request = pending_request(client, worker["threadId"])
    wait_until(lambda: running(client, boss["threadId"]), 30)
    agent = McpClient(t3.mcp_url, session_tokens(tmp_path / "agent-boss.log")[-1])
    try:
        answered = agent.call("t3_pending_request", {
            "threadId": worker["threadId"], "action": "respond", "requestId": worker_request,
            "decision": "accept"})
    finally:
        agent.close()
    assert answered.ok, answered.structured
    assert wait(client, worker["threadId"])["status"] == "completed"
    who = {"kind": "thread", "threadId": boss["threadId"]}
    read = client.call("t3_pending_request", {"threadId": worker["threadId"], "action": "read",
                                              "requestId": worker_request}).structured
    assert read["request"]["answeredBy"] == who
    activity = client.call("t3_thread_read", {"threadId": worker["threadId"],
                                              "view": "activity"}).structured["items"]
    assert [i["answeredBy"] for i in activity if "answeredBy" in i] == [who]
    for thread in (parent, bystander, boss):
        client.call("t3_thread_interrupt", {"threadId": thread["threadId"]})


def test_the_mode_an_answer_needs_follows_the_request_kind() -> None:
    """Questions need no mode, file reads and changes auto-accept-edits, commands, MCP and other
    permissions auto (SPEC 5.1a)."""
    assert orch.mode_to_answer("user_input") is None
    assert orch.mode_to_answer("file-change") == orch.mode_to_answer("file-read") \
        == orch.RuntimeMode.AUTO_ACCEPT_EDITS
    for kind in ("command", "permission", "mcp-elicitation", "something-new"):
        assert orch.mode_to_answer(kind) == orch.RuntimeMode.AUTO


# ---- item 4: bounded, unambiguous ids at any depth


def test_a_ten_level_chain_is_addressable_at_every_level(t3_factory) -> None:
    """Ten levels of delegation: every id stays within 160 characters and every thread tool
    answers for every level, including the approval asked at the deepest one."""
    t3 = t3_factory(extra="[limits]\nmax_delegation_depth = 10\n")
    client = t3.client()
    prompt = "ASK_PERMISSION"
    for level in range(10, 0, -1):
        args = {"task": prompt, "title": f"level {level}"}
        if level == 10:
            args["runtimeMode"] = "approval-required"
        prompt = call_line("delegate_task", args)
    chain = [create(client, prompt)["threadId"]]
    for _ in range(10):
        [child] = wait_until(lambda: children(client, chain[-1]), 60)
        chain.append(child["threadId"])
    request_id = pending_request(client, chain[-1])
    ids = [r[0] for table in ("thread", "run", "runtime_request")
           for r in query(t3, f"SELECT {table}_id FROM {table}s")]
    assert max(map(len, ids)) <= orch.MAX_ID_CHARS
    for thread_id in chain:
        for tool, args in [("t3_thread_read", {}), ("t3_thread_wait", {"timeoutMs": 0}),
                           ("t3_pending_request", {"action": "list"}),
                           ("t3_thread_interrupt", {"runId": "no-such-run"})]:
            result = client.call(tool, {"threadId": thread_id, **args})
            assert result.ok or result.failure_code == "run_not_found", (tool, result.structured)
    answered = client.call("t3_pending_request", {"threadId": chain[-1], "action": "respond",
                                                  "requestId": request_id, "decision": "accept"})
    assert answered.ok, answered.structured
    for thread_id in chain:  # each level gets its task's wake, then a message of ours
        sent = client.call("t3_thread_send", {"threadId": thread_id, "message": "still there?",
                                              "mode": "queue"})
        assert sent.ok, sent.structured
        assert wait(client, thread_id, runId=sent.structured["runId"])["status"] == "completed"


def test_tools_never_share_an_id(t3: T3Server, mcp: McpClient) -> None:
    """create_threads with clientRequestId "launch" and t3_thread_launch with "0" make two
    threads, not one thread returned twice."""
    made = mcp.call("create_threads", {"threads": [{"title": "a"}], "clientRequestId": "launch"})
    launched = mcp.call("t3_thread_launch", {"title": "b", "clientRequestId": "0"})
    assert made.ok and launched.ok, (made.structured, launched.structured)
    assert made.structured["threads"][0]["threadId"] != launched.structured["threadId"]
    assert launched.structured["title"] == "b"


# ---- item 5: credentials that last as long as their use


def test_a_long_turn_keeps_its_credential_and_the_next_turn_gets_a_new_one(
        t3_factory, tmp_path: Path, agent_log_path: Path) -> None:
    """With credential_idle_s = 2, a call 3 s into a 5 s turn works; a call 4 s after the turn
    is refused (the credential ended, for good); the next turn runs in a resumed session whose
    new credential works."""
    t3 = t3_factory(extra="[limits]\ncredential_idle_s = 2\n")
    mcp = t3.client()
    thread = create(mcp, "DELAYED_CALL 3 orchestrator_capabilities {}\n"
                         "DELAYED_CALL 9 orchestrator_capabilities {}\nSLOW:100")
    assert wait(mcp, thread["threadId"])["status"] == "completed"
    calls = wait_until(lambda: len(c := mcp_calls(agent_log_path)) == 2 and c, 30)
    assert [c["httpStatus"] for c in calls] == [200, 401]
    sent = mcp.call("t3_thread_send", {"threadId": thread["threadId"],
                                       "message": "CALL_TOOL orchestrator_capabilities {}"})
    assert wait(mcp, thread["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    calls = mcp_calls(agent_log_path)
    assert [c["httpStatus"] for c in calls] == [200, 401, 200]
    assert calls[2]["result"]["parentThreadId"] == thread["threadId"]
    first, second = session_tokens(agent_log_path)
    assert first != second
    loads = [e for e in agent_log(agent_log_path) if e["dir"] == "in"
             and e["msg"].get("method") == "session/load"]
    assert len(loads) == 1  # the new session resumed the conversation


def test_a_credential_past_half_its_lifetime_is_replaced_at_the_next_turn(
        t3_factory, agent_log_path: Path) -> None:
    """With credential_max_lifetime_s = 4, a turn starting 2.5 s after the first gets a new
    credential in a resumed session, and the old one stops working at once."""
    t3 = t3_factory(extra="[limits]\ncredential_max_lifetime_s = 4\n")
    mcp = t3.client()
    thread = create(mcp, "DELAYED_CALL 2.5 orchestrator_capabilities {}")
    wait_until(lambda: len(mcp_calls(agent_log_path)) == 1, 30)
    [old] = session_tokens(agent_log_path)
    sent = mcp.call("t3_thread_send", {"threadId": thread["threadId"],
                                       "message": "CALL_TOOL orchestrator_capabilities {}"})
    assert wait(mcp, thread["threadId"], runId=sent.structured["runId"])["status"] == "completed"
    assert [c["httpStatus"] for c in mcp_calls(agent_log_path)] == [200, 200]
    assert session_tokens(agent_log_path)[-1] != old
    assert tools_list_status(t3, old) == 401


# ---- item 6: caps on agents


def test_delegation_beyond_the_depth_limit_is_denied(t3_factory, agent_log_path: Path) -> None:
    """With max_delegation_depth = 2, the second level's delegate_task is capability_denied,
    naming the limit, and no third level exists."""
    t3 = t3_factory(extra="[limits]\nmax_delegation_depth = 2\n")
    mcp = t3.client()
    prompt = "hello"
    for level in (3, 2, 1):
        prompt = call_line("delegate_task", {"task": prompt, "title": f"level {level}"})
    root = create(mcp, prompt)
    calls = wait_until(lambda: len(c := mcp_calls(agent_log_path)) == 3 and c, 60)
    denied = [c for c in calls if c["isError"]]
    assert len(denied) == 1 and denied[0]["result"]["code"] == "capability_denied", calls
    assert "max_delegation_depth = 2" in denied[0]["result"]["message"]
    [level1] = children(mcp, root["threadId"])
    [level2] = children(mcp, level1["threadId"])
    assert children(mcp, level2["threadId"]) == []


def agent_processes(data_dir: Path) -> int:
    """Live processes carrying this server's exact T3_OWNER entry: its agents."""
    needle = f"\0T3_OWNER={data_dir}\0".encode()
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in b"\0" + (entry / "environ").read_bytes():
                    count += 1
            except OSError:
                pass
    return count


def test_forty_children_with_four_slots_all_complete(t3_factory, tmp_path: Path) -> None:
    """An agent delegates 40 children with max_live_agent_processes = 4: never more than 4
    agent processes are alive, runs beyond the cap wait queued saying why, and all 40 finish."""
    t3 = t3_factory(extra="[limits]\nmax_live_agent_processes = 4\n")
    mcp = t3.client()
    peak, done = [0], threading.Event()

    def sample() -> None:  # a measurement, not a synchronization
        while not done.wait(0.01):
            peak[0] = max(peak[0], agent_processes(t3.data_dir))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        lines = [call_line("delegate_task", {"task": "SLOW:6 child", "title": f"c{i}",
                                             "clientRequestId": f"c{i}"}) for i in range(40)]
        parent = create(mcp, "\n".join(lines))

        def finished() -> bool:
            kids = children(mcp, parent["threadId"])
            return len(kids) == 40 and all(k["status"] == "completed" for k in kids)
        wait_until(finished, 180)
        wait_until(lambda: wait(mcp, parent["threadId"], timeoutMs=0)["status"] == "completed"
                   and len(query(t3, "SELECT run_id FROM runs WHERE thread_id = ?",
                                 parent["threadId"])) == 41, 120)
    finally:
        done.set()
        sampler.join()
    assert 1 <= peak[0] <= 4, peak
    reasons = query(t3, "SELECT COUNT(*) FROM events WHERE type = 'run.updated' AND "
                        "payload_json LIKE '%max_live_agent_processes = 4%'")
    assert reasons[0][0] > 0  # some runs waited, and said why


# ---- item 10: the small ones


def test_scratch_is_not_a_project_to_create_in(t3: T3Server, mcp: McpClient) -> None:
    """projectId "scratch" without scratch: true is refused by both creating tools and writes
    nothing; listing the scratch threads still works."""
    for tool, args in [("t3_thread_launch", {"projectId": "scratch", "message": "x"}),
                       ("create_threads", {"projectId": "scratch",
                                           "threads": [{"prompt": "x"}]})]:
        before = query(t3, "SELECT COUNT(*) FROM events")
        assert mcp.call(tool, args).failure_code == "invalid_request"
        assert query(t3, "SELECT COUNT(*) FROM events") == before
    assert mcp.call("t3_thread_list", {"projectId": "scratch"}).ok


def test_a_failed_scratch_launch_leaves_no_folder(t3: T3Server, mcp: McpClient) -> None:
    """A scratch launch that cannot be recorded (a full disk) removes the folder it made."""
    t3.stop()
    t3.env.update({"T3_MAX_PAGE_COUNT": "1", "T3_TEST_HOOKS": "1"})
    t3.start()
    failed = mcp.call("t3_thread_launch", {"scratch": True, "message": "big " * 25_000})
    assert failed.failure_code == "orchestration_error", failed.structured
    assert list((t3.data_dir / "scratch").iterdir()) == []
