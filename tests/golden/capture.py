"""Capture the golden histories in this directory: `python tests/golden/capture.py`.

Each scenario runs against a real `t3.py` server with the scripted ACP agent. Afterwards the
server is stopped and two files are written: `<name>.events.jsonl` (every row of the event log,
in sequence order) and `<name>.projections.json` (every projection table as the live server left
it, rows sorted). `tests/test_faults.py` loads the events into a fresh database, rebuilds the
projections from them and expects exactly the captured tables. Re-capture (and review the diff)
only when the event or projection format changes on purpose.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

import store  # noqa: E402
from harness import McpClient, T3Server, scripted_provider, wait_until, write_config  # noqa: E402

PROJECTION_TABLES = [table for table, _, _ in store._PROJECTIONS.values()]


def create(mcp: McpClient, prompt: str, **entry: Any) -> dict[str, Any]:
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: McpClient, thread_id: str, **args: Any) -> dict[str, Any]:
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000, **args})
    assert result.ok, result.structured
    return result.structured


def text(mcp: McpClient, thread_id: str) -> str:
    read = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1}).structured
    return "".join(i["text"] or "" for i in read["items"] if i["type"] == "assistant_message")


def steering_and_interrupts(mcp: McpClient) -> None:
    """A turn steered mid-stream (restart), a queued run, an interrupt, a failure, a completion."""
    t = create(mcp, "THINK PLAN SLOW:400 first")["threadId"]
    wait_until(lambda: "chunk 1" in text(mcp, t), 30)
    mcp.call("t3_thread_send", {"threadId": t, "message": "SLOW:400 change of plan"})
    queued = mcp.call("t3_thread_send", {"threadId": t, "message": "FAIL then this",
                                         "mode": "queue"}).structured
    wait_until(lambda: "chunk 2" in text(mcp, t).split("change of plan")[-1] or
               text(mcp, t).count("chunk 2") >= 2, 30)
    mcp.call("t3_thread_interrupt", {"threadId": t, "reason": "enough"})
    wait(mcp, t, runId=queued["runId"])
    done = mcp.call("t3_thread_send", {"threadId": t, "message": "finally"}).structured
    wait(mcp, t, runId=done["runId"])


def permissions(mcp: McpClient) -> None:
    """Permission requests: accepted, declined, and one left pending when the turn is interrupted."""
    t = create(mcp, "ASK_PERMISSION please", runtimeMode="approval-required")["threadId"]
    for decision in ("accept", "decline"):
        request = wait(mcp, t)["pendingApproval"]["requestId"]
        mcp.call("t3_pending_request", {"threadId": t, "action": "respond",
                                        "requestId": request, "decision": decision})
        wait(mcp, t)
        if decision == "accept":
            mcp.call("t3_thread_send", {"threadId": t, "message": "ASK_PERMISSION again"})
    mcp.call("t3_thread_send", {"threadId": t, "message": "ASK_PERMISSION last"})
    wait(mcp, t)
    mcp.call("t3_thread_interrupt", {"threadId": t})
    wait(mcp, t)


def delegation(mcp: McpClient) -> None:
    """A parent delegates in wait mode and asynchronously to another provider; both report back."""
    call = lambda tool, args: f"CALL_TOOL {tool} {json.dumps(args)}"  # noqa: E731
    parent = create(mcp, "\n".join([
        call("delegate_task", {"task": "ECHO_PROMPT", "target": {"providerInstanceId": "beta"},
                               "mode": "wait", "title": "Echo"}),
        call("delegate_task", {"task": "SLOW:5 in the background", "mode": "async",
                               "target": {"providerInstanceId": "beta"}, "title": "Async"})]),
        target={"providerInstanceId": "alpha"})["threadId"]
    wait(mcp, parent)

    def woken() -> bool:  # the async child's completion wakes the parent for a second run
        runs = mcp.call("t3_thread_read", {"threadId": parent}).structured["recentRuns"]
        return len(runs) >= 2 and all(r["status"] == "completed" for r in runs)
    wait_until(woken, 60)


SCENARIOS: dict[str, tuple[Callable[[McpClient], None], bool]] = {
    "steering": (steering_and_interrupts, False),
    "permissions": (permissions, False),
    "delegation": (delegation, True),
}


def capture(name: str, scenario: Callable[[McpClient], None], two_agents: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        providers = [scripted_provider(tmp_path, id="alpha"), scripted_provider(tmp_path, id="beta")] \
            if two_agents else None
        server = T3Server(tmp_path / "data", write_config(tmp_path, providers=providers)).start()
        mcp = server.client()
        try:
            scenario(mcp)
        finally:
            server.close()
        with closing(sqlite3.connect(tmp_path / "data" / "t3.sqlite")) as db:
            db.row_factory = sqlite3.Row
            events = [dict(r) for r in db.execute("SELECT * FROM events ORDER BY sequence")]
            tables = {t: sorted([list(r) for r in db.execute(f"SELECT * FROM {t}")], key=repr)
                      for t in PROJECTION_TABLES}
    (HERE / f"{name}.events.jsonl").write_text(
        "".join(json.dumps(e, sort_keys=True) + "\n" for e in events), encoding="utf-8")
    (HERE / f"{name}.projections.json").write_text(
        json.dumps(tables, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{name}: {len(events)} events", file=sys.stderr)


if __name__ == "__main__":
    for name in sys.argv[1:] or SCENARIOS:
        capture(name, *SCENARIOS[name])
