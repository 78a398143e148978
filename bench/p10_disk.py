"""P10 disk: what the server process writes to disk for one long streamed answer, and how soon a
live `/ws` subscriber sees its text.

The scripted agent streams `PACED:n:50:s`: n chunks of 50 characters spread evenly over s
seconds (full run: 20,000 chunks, a 1,000,000-character answer, over 20 s; `--quick`: 4,000 over
4 s), each chunk carrying the wall-clock time it left the agent. A `/ws` client subscribed to the
thread (`subscribeThread`, the web view's stream) takes every chunk's delay as the time it first
sees that chunk's text in an event minus the time the agent sent it (one clock: one machine).

Written: `write_bytes` of the server process (`/proc/<pid>/io`, every thread: the WAL, its
checkpoints into the database file, anything else) from just before the prompt is sent to just
after the run has completed, plus what checkpointing the frames still in the WAL then costs
(done by the bench itself, a passive checkpoint measured on its own `/proc/self/io`): the server
would write that later. The agent process (a warm session, started before) is not counted.
Also shown: the growth of the provider protocol logs (`logs/`, part of what the server wrote),
the bytes the run's events carry (their payloads), and the ingest commits made.

Target: written <= 10x the answer's length, and a subscriber sees 99% of the chunks within 250 ms
of their send (the maximum is shown too). A kill -9 losing at most that window of text is pinned
by tests/test_ingest_window.py, not measured here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import _bench
import store as s
from cli import WsClient
from harness import T3Server, scripted_provider

WIDTH = 50  # characters per chunk
CHUNK = re.compile(r"(\d+)@(\d+\.\d+) ")


def write_bytes(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"no write_bytes for {pid}")


async def stream(server: T3Server, n: int, seconds: float) -> dict[str, Any]:
    """One PACED answer on a warm thread, followed on /ws: delays, bytes, the thread id."""
    pid = int(server.info["pid"])
    async with WsClient(server.url + "/ws", server.token) as client:
        created = await client.request("dispatchCommand", {
            "type": "thread.create", "commandId": "p10-thread", "title": "p10",
            "creationSource": "cli"})
        thread_id = created["result"]["threadId"]
        await client.request("sendToThread", {"threadId": thread_id, "message": "warm up"})
        await client.request("waitForThread", {"threadId": thread_id})
        delays: list[float] = []
        seen = -1
        before = sent = logs_before = 0
        run_id = None
        subscription = client.stream("subscribeThread", {"threadId": thread_id})
        async for item in subscription:
            if item["kind"] == "synchronized":
                before, sent = write_bytes(pid), item["sequence"]
                logs_before = logs_size(server.data_dir)
                run_id = (await client.request("sendToThread", {
                    "threadId": thread_id, "message": f"PACED:{n}:{WIDTH}:{seconds}"}))["runId"]
                continue
            if item["kind"] != "event":
                continue
            event, now = item["event"], time.time()
            payload = event["payload"]
            if event["type"] in (s.TEXT_APPENDED, "message.updated") and \
                    payload.get("role", "assistant") == "assistant":
                for match in CHUNK.finditer(payload.get("text") or ""):
                    if int(match[1]) > seen:
                        seen = int(match[1])
                        delays.append(now - float(match[2]))
            if event["type"] == "run.updated" and payload["id"] == run_id and \
                    payload["status"] not in ("starting", "running"):
                break
        await subscription.aclose()
        done = await client.request("waitForThread", {"threadId": thread_id})
        if done["status"] != "completed" or seen != n - 1 or len(delays) != n:
            raise RuntimeError(f"run ended {done['status']}, saw {len(delays)} of {n} chunks")
        after = write_bytes(pid)
    return {"thread": thread_id, "sent": sent, "written": after - before, "delays": delays,
            "logs": logs_size(server.data_dir) - logs_before}


def logs_size(data_dir: Path) -> int:
    return sum(f.stat().st_size for f in (data_dir / "logs").glob("*") if f.is_file())


def checkpoint_rest(db_path: Path) -> tuple[int, int, int]:
    """(bytes, WAL frames, frames checkpointed) of a passive checkpoint run here."""
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as db:
        before = write_bytes("self")
        _, frames, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return write_bytes("self") - before, frames, done


def event_figures(db_path: Path, thread_id: str, after: int) -> tuple[int, int, str]:
    """(bytes of event payloads, ingest commits, the persisted answer) of the run."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        payload, commits = db.execute(
            "SELECT SUM(LENGTH(payload_json)), COUNT(DISTINCT command_id) FILTER (WHERE command_id "
            "LIKE 'ingest:%') FROM events WHERE thread_id = ? AND sequence > ?",
            (thread_id, after)).fetchone()
        texts = [json.loads(r[0])["text"] for r in db.execute(
            "SELECT payload_json FROM messages WHERE thread_id = ? ORDER BY rowid", (thread_id,))]
    return payload, commits, texts[-1]


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    n, seconds = (4_000, 4.0) if args.quick else (20_000, 20.0)
    answer = n * WIDTH
    with _bench.scratch_dir("p10") as tmp:
        provider = scripted_provider(tmp, env={"SCRIPTED_AGENT_LOG": ""})  # no per-message log
        with _bench.t3_server(tmp, providers=[provider]) as server:
            run = asyncio.run(stream(server, n, seconds))
            db_path = server.data_dir / "t3.sqlite"
            rest, frames, done = checkpoint_rest(db_path)
            payload, commits, text = event_figures(db_path, run["thread"], run["sent"])
    if len(CHUNK.findall(text)) != n:
        raise RuntimeError("the persisted answer is not the chunks sent")
    written = (run["written"] + rest) / answer
    delays = [d * 1000 for d in run["delays"]]
    p50, p99, worst = (_bench.percentile(delays, p) for p in (50, 99, 100))
    bytes_ok, seen_ok = written <= 10, p99 <= 250
    _bench.report("P10 disk (a long streamed answer)", [
        ("answer", f"{n:,} chunks of {WIDTH} characters over {seconds:.0f} s "
                   f"({answer / 1e6:.2f} MB)"),
        ("server wrote", f"{run['written'] / 1e6:.2f} MB (/proc write_bytes), "
                         f"+ {rest / 1e6:.2f} MB to checkpoint the {frames} WAL frames left "
                         f"({done} backfilled)"),
        ("of which protocol logs", f"{run['logs'] / 1e6:.2f} MB (their growth on disk)"),
        ("events of the run carry", f"{payload / 1e6:.2f} MB ({payload / answer:.2f}x), "
                                    f"{commits} ingest commits"),
        ("subscriber delay per chunk", f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {worst:.0f} ms"),
        ("written per byte of answer", f"{written:.2f}x"),
    ], verdict=f"{'PASS' if bytes_ok and seen_ok else 'MISS'}: target <= 10x written "
               f"({'met' if bytes_ok else 'missed'}), p99 delay <= 250 ms "
               f"({'met' if seen_ok else 'missed'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
