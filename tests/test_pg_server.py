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


def test_a_second_server_on_the_same_database_is_refused(
        t3_factory, tmp_path: Path, postgres_url: str) -> None:
    """Until several servers can share one database, the second one exits saying so and writes
    nothing; the first keeps serving, and once it stops another may start."""
    first = t3_factory(args=["--database", postgres_url])
    created = create(first.client(), "hi", title="First")
    second = t3_factory(data_dir=tmp_path / "data-2", args=["--database", postgres_url],
                        start=False)
    with pytest.raises(ServerStartError, match="another t3 server already uses this database"):
        second.start()
    assert wait(first.client(), created["threadId"])["status"] == "completed"
    assert _count(postgres_url, "threads") == 1
    first.stop()
    assert read(second.start().client(), created["threadId"])["thread"]["title"] == "First"
