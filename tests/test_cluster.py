"""Several t3 nodes on one PostgreSQL database (cluster.py): real `t3.py` processes, each with
its own data directory and `[node] id`, the scripted ACP agent, MCP over HTTP, and a real
PostgreSQL server (tests/pg.py). The `postgres` tier, skipped saying why without a server.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from cli import WsClient
from harness import McpClient, T3Server, scripted_provider, wait_until, write_config
from test_delegation import (call_line, create, items, runs_settled, tool_results, wait,
                             wake_prompts)



def _rows(url: str, query: str, *params: object) -> list[tuple]:
    import psycopg
    with psycopg.connect(url) as conn:
        return conn.execute(query, params).fetchall()


def _nodes(t3_factory, tmp_path: Path, url: str, providers: dict[str, list[str]],
           ) -> dict[str, T3Server]:
    """One node per entry: its `[node] id` and the scripted provider instances it runs."""
    servers = {}
    for node, ids in providers.items():
        config = write_config(tmp_path, name=f"{node}.toml",
                              providers=[scripted_provider(tmp_path, id=i) for i in ids],
                              extra=f'[node]\nid = "{node}"\n')
        servers[node] = t3_factory(config=config, data_dir=tmp_path / f"data-{node}",
                                   args=["--database", url])
    return servers


def _holder(url: str, thread_id: str) -> str | None:
    found = _rows(url, "SELECT node_id FROM thread_holders WHERE thread_id = %s", thread_id)
    return found[0][0] if found else None


@pytest.mark.postgres
def test_a_thread_made_on_one_node_runs_on_the_node_that_has_its_provider(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """Node a runs provider alpha, b runs beta, c runs alpha: a thread created on a for beta
    runs on b; a's capabilities offer beta (it runs elsewhere); c waits for it and reads the
    answer; a thread for alpha made on b runs on a or c, never on b."""
    nodes = _nodes(t3_factory, tmp_path, postgres_url,
                   {"a": ["alpha"], "b": ["beta"], "c": ["alpha"]})
    on_a, on_c = nodes["a"].client(), nodes["c"].client()

    def offered() -> dict:  # a node learns what another runs once it joined (t3_nodes)
        listed = on_a.call("orchestrator_capabilities", {}).structured["providers"]
        return {p["providerInstanceId"]: (p["canRunChildTask"], p["nodes"]) for p in listed}
    wait_until(lambda: offered()["alpha"][1] == ["a", "c"], 10)
    assert offered() == {"alpha": (True, ["a", "c"]), "beta": (True, ["b"])}
    made = create(on_a, "hello from a", target={"providerInstanceId": "beta"})
    assert wait(on_c, made["threadId"])["status"] == "completed"
    assert _holder(postgres_url, made["threadId"]) == "b"
    text = [i["text"] for i in items(on_c, made["threadId"], "messages")
            if i["type"] == "assistant_message"]
    assert text == ["Hello from scripted agent. You said: hello from a"]
    assert (tmp_path / "agent-beta.log").exists()
    other = create(nodes["b"].client(), "hello from b", target={"providerInstanceId": "alpha"})
    assert wait(on_a, other["threadId"])["status"] == "completed"
    assert _holder(postgres_url, other["threadId"]) in ("a", "c")


@pytest.mark.postgres
def test_a_killed_node_s_delegated_child_is_recovered_and_wakes_its_parent_once(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """A parent on node a (alpha) delegates a slow child to beta, which nodes b and c run. The
    node running the child is killed (-9) mid-stream: another node declares it dead and
    recovers the child (its run ends, as after a restart), and the parent's agent is woken
    exactly once for the task."""
    nodes = _nodes(t3_factory, tmp_path, postgres_url,
                   {"a": ["alpha"], "b": ["beta"], "c": ["beta"]})
    mcp = nodes["a"].client()
    parent = create(mcp, call_line("delegate_task", {
        "task": "SLOW:400", "title": "slow child", "target": {"providerInstanceId": "beta"},
        "clientRequestId": "only-child"}), target={"providerInstanceId": "alpha"})
    tid = parent["threadId"]

    delegated = wait_until(lambda: tool_results(mcp, tid), 60)[0]
    child_id = delegated["childThreadId"]
    wait_until(lambda: "chunk 3 " in "".join(
        i["text"] or "" for i in items(mcp, child_id, "messages")), 60)
    victim = _holder(postgres_url, child_id)
    assert victim in ("b", "c")
    nodes[victim].kill9()

    def live() -> list[str]:
        return [n for (n,) in _rows(postgres_url, "SELECT node_id FROM cluster_nodes")]
    wait_until(lambda: victim not in live(), 60)  # declared dead by another node
    wait_until(lambda: len(wake_prompts(tmp_path / "agent-alpha.log")) >= 1, 90)
    wait_until(lambda: runs_settled(mcp, tid, 2), 90)
    wait_until(lambda: _rows(postgres_url, "SELECT COUNT(*) FROM effect_outbox WHERE status IN "
                             "('pending', 'running')") == [(0,)], 60)  # no wake can follow
    wakes = wake_prompts(tmp_path / "agent-alpha.log")
    assert len(wakes) == 1, wakes
    runs = mcp.call("t3_thread_read", {"threadId": child_id}).structured["recentRuns"]
    assert runs[0]["status"] in ("completed", "failed", "interrupted"), runs
    assert sorted(live()) == sorted({"a", "b", "c"} - {victim})


LOAD_S = float(os.environ.get("T3_CLUSTER_LOAD_S", "60"))


@pytest.mark.postgres
def test_thirty_clients_over_three_nodes_lose_nothing(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """30 clients over three nodes for LOAD_S seconds (a minute unless T3_CLUSTER_LOAD_S says
    otherwise): each creates threads and sends to them, waiting for each run through another
    node than the one it sent to; every acknowledged message is in its thread exactly once,
    read from any node, and every run completed."""
    nodes = list(_nodes(t3_factory, tmp_path, postgres_url,
                        {"a": ["scripted"], "b": ["scripted"], "c": ["scripted"]}).values())
    acknowledged: list[tuple[str, str]] = []  # (thread id, message)
    failures: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + LOAD_S

    def client(n: int) -> None:
        try:
            calls(n)
        except Exception as exc:  # a call cut off (its connection closed) fails the test too
            with lock:
                failures.append(f"client {n}: {exc!r}")

    def calls(n: int) -> None:
        """Creates a thread, then sends to it, waiting for each run on a node it picks in turn."""
        clients = [node.client() for node in nodes]
        thread_id, sent = None, 0
        while time.monotonic() < deadline and not failures:
            mcp, message = clients[(n + sent) % 3], f"c{n}-m{sent}"
            if thread_id is None or sent % 4 == 0:
                result = mcp.call("create_threads", {"threads": [{"prompt": message}]})
                if result.ok:
                    thread_id = result.structured["threads"][0]["threadId"]
            else:
                result = mcp.call("t3_thread_send", {"threadId": thread_id, "message": message})
            if result.ok:
                with lock:
                    acknowledged.append((thread_id, message))
                result = clients[(n + sent + 1) % 3].call(
                    "t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000})
            if not result.ok or result.structured.get("status") != "completed":
                with lock:
                    failures.append(f"{message}: {result.structured}")
                return
            sent += 1
    threads = [threading.Thread(target=client, args=(n,)) for n in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert len(acknowledged) >= 60
    by_thread: dict[str, list[str]] = {}
    for thread_id, message in acknowledged:
        by_thread.setdefault(thread_id, []).append(message)
    readers = [node.client() for node in nodes]
    for i, (thread_id, messages) in enumerate(sorted(by_thread.items())):
        reader = readers[i % 3]
        wait_until(lambda: runs_settled(reader, thread_id, len(messages)), 120)
        said = [m["text"] for m in items(reader, thread_id, "messages")
                if m["type"] == "user_message"]
        assert sorted(said) == sorted(messages), (thread_id, said, messages)
    runs = _rows(postgres_url, "SELECT status, COUNT(*) FROM runs GROUP BY status")
    assert dict(runs) == {"completed": len(acknowledged)}, runs
    assert json.dumps(sorted(n for (n,) in _rows(postgres_url, "SELECT node_id FROM cluster_nodes"))
                      ) == '["a", "b", "c"]'


@pytest.mark.postgres
def test_a_subscriber_on_one_node_sees_another_node_s_commits_in_order(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """A /ws subscriber on node b follows a thread that node a's agent streams: after its
    snapshot it gets every event of the thread, in sequence order, none twice, until the run
    completes (the commits reach b through NOTIFY, not polling)."""
    nodes = _nodes(t3_factory, tmp_path, postgres_url, {"a": ["alpha"], "b": ["beta"]})
    made = create(nodes["a"].client(), "SLOW:30", target={"providerInstanceId": "alpha"})
    b = nodes["b"]

    async def follow() -> tuple[int, list[int]]:
        async with WsClient(b.url + "/ws", b.token) as client:
            snapshot, seen = 0, []
            async for item in client.stream("subscribeThread", {"threadId": made["threadId"]}):
                if item["kind"] == "snapshot":
                    snapshot = item["snapshotSequence"]
                elif item["kind"] == "event":
                    seen.append(item["sequence"])
                    event = item["event"]
                    if event["type"] == "run.updated" and event["payload"]["status"] == "completed":
                        return snapshot, seen
        raise AssertionError("the stream ended")
    snapshot, seen = asyncio.run(asyncio.wait_for(follow(), 60))
    stored = [s for (s,) in _rows(postgres_url, "SELECT sequence FROM events WHERE thread_id = %s "
                                  "AND sequence > %s ORDER BY sequence", made["threadId"], snapshot)]
    assert seen and seen == stored[:len(seen)], (seen, stored)
    assert _holder(postgres_url, made["threadId"]) == "a"


@pytest.mark.parametrize(("node", "said"), [
    ('id = "two words"', r"node\.id: must be 1 to 64"), ('projects = "web"', r"node\.projects")])
def test_the_node_table_is_checked(tmp_path: Path, node: str, said: str) -> None:
    """`[node]` is checked at load like every table; a good one is read as written."""
    import t3 as server_module
    with pytest.raises(server_module.ConfigError, match=said):
        server_module.load_config(write_config(tmp_path, extra=f"[node]\n{node}\n"), cwd=tmp_path)
    good = server_module.load_config(write_config(
        tmp_path, extra='[node]\nid = "build-1"\nprojects = ["proj"]\n'), cwd=tmp_path)
    assert (good.node_id, good.node_projects) == ("build-1", ["proj"])
