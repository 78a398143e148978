"""t3 on PostgreSQL end to end: a real `t3.py` process started with `--database` (or `[store]
url`), the scripted ACP agent, MCP over HTTP, a real PostgreSQL server (tests/pg.py). The
`postgres` tier, skipped saying why without a server or psycopg.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import McpClient, ServerStartError, T3Server, write_config
from test_threads import assistant_text, create, read, wait

pytestmark = pytest.mark.postgres


def _count(url: str, table: str) -> int:
    import psycopg
    with psycopg.connect(url) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def test_a_thread_created_sent_to_and_read_on_postgresql(t3_factory, postgres_url: str) -> None:
    """With --database: create a thread with a prompt, wait for its run, send again, read both
    answers; everything is in PostgreSQL (the data dir holds no SQLite database), and after a
    restart the thread's items read the same and it takes another message."""
    server: T3Server = t3_factory(args=["--database", postgres_url])
    mcp: McpClient = server.client()
    created = create(mcp, "hello there", title="On PostgreSQL")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "again"})
    assert sent.ok, sent.structured
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert assistant_text(mcp, created["threadId"]) == (
        "Hello from scripted agent. You said: hello there"
        "Hello from scripted agent. You said: again")
    assert not (server.data_dir / "t3.sqlite").exists()
    assert _count(postgres_url, "threads") == 1 and _count(postgres_url, "runs") == 2
    before = read(mcp, created["threadId"])

    server.restart()
    mcp = server.client()
    after = read(mcp, created["threadId"])
    assert after["items"] == before["items"] and after["thread"]["title"] == "On PostgreSQL"
    listed = mcp.call("t3_thread_list", {}).structured
    assert [t["threadId"] for t in listed["threads"]] == [created["threadId"]]
    mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "third"})
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert _count(postgres_url, "runs") == 3


def test_the_store_url_in_the_config_file_selects_postgresql(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """`[store] url` in t3.toml does what --database does."""
    config = write_config(tmp_path, extra=f'[store]\nurl = "{postgres_url}"\n')
    mcp = t3_factory(config=config).client()
    created = create(mcp, "hi", title="Configured")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert _count(postgres_url, "threads") == 1


def test_two_servers_with_one_node_id_are_refused_and_two_nodes_share_threads(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """A second server on the same database with the same `[node] id` exits saying so and
    writes nothing; with its own id it is a second node: it reads the first's thread, and a
    message it takes runs to completion (on either node), seen on both."""
    same = write_config(tmp_path, extra='[node]\nid = "alpha"\n', name="alpha.toml")
    first = t3_factory(config=same, args=["--database", postgres_url])
    created = create(first.client(), "hi", title="First")
    twin = t3_factory(data_dir=tmp_path / "data-2", config=same,
                      args=["--database", postgres_url], start=False)
    with pytest.raises(ServerStartError, match="another t3 server runs as node 'alpha'"):
        twin.start()
    assert wait(first.client(), created["threadId"])["status"] == "completed"
    assert _count(postgres_url, "threads") == 1 and _count(postgres_url, "cluster_nodes") == 1
    second = t3_factory(data_dir=tmp_path / "data-3", args=["--database", postgres_url])
    other = second.client()
    assert read(other, created["threadId"])["thread"]["title"] == "First"
    sent = other.call("t3_thread_send", {"threadId": created["threadId"], "message": "again"})
    assert sent.ok, sent.structured
    assert wait(first.client(), created["threadId"], runId=sent.structured["runId"])[
        "status"] == "completed"
    assert assistant_text(other, created["threadId"]) == (
        "Hello from scripted agent. You said: hi"
        "Hello from scripted agent. You said: again")
    assert _count(postgres_url, "cluster_nodes") == 2