"""Streamed text against a real server: deltas are committed in windows of at most
`Orchestrator.INGEST_WINDOW_S`, so a `/ws` subscriber sees an answer while it streams, and a kill -9
loses only the text of the last window (and of the commit in flight), none of it shown to anyone.

The scripted agent's `PACED:n:w:s` stamps each chunk with the time it sent it; its log keeps every
chunk it sent, so what a kill lost can be told apart from what was never sent."""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from typing import Any

from cli import WsClient
from harness import T3Server, agent_log, wait_until
from orchestrator import Orchestrator

CHUNK = re.compile(r"(\d+)@(\d+\.\d+) ")
# What a loaded machine adds to the window: the commit in flight, the pipe, a busy event loop.
SLACK_S = 1.0


async def _follow(t3: T3Server, prompt: str, *, stop_after: int | None = None
                  ) -> tuple[str, list[tuple[float, int, float]]]:
    """Stream ``prompt`` on a new thread; (thread id, [(seen at, chunk, sent at)] of each chunk's
    first sighting in a text event), until the run ends or ``stop_after`` chunks were seen."""
    async with WsClient(t3.url + "/ws", t3.token) as client:
        created = await client.request("dispatchCommand", {
            "type": "thread.create", "commandId": "stream", "title": "stream",
            "creationSource": "cli"})
        thread_id = created["result"]["threadId"]
        seen: list[tuple[float, int, float]] = []
        run_id = None
        stream = client.stream("subscribeThread", {"threadId": thread_id})
        async for item in stream:
            if item["kind"] == "synchronized":
                run_id = (await client.request("sendToThread", {
                    "threadId": thread_id, "message": prompt}))["runId"]
            elif item["kind"] == "event":
                event, now = item["event"], time.time()
                for match in CHUNK.finditer(event["payload"].get("text") or ""):
                    if int(match[1]) >= len(seen):
                        seen.append((now, int(match[1]), float(match[2])))
                if stop_after is not None and len(seen) >= stop_after or \
                        event["type"] == "run.updated" and event["payload"]["id"] == run_id and \
                        event["payload"]["status"] not in ("starting", "running"):
                    break
        await stream.aclose()
    return thread_id, seen


def _persisted_text(t3: T3Server, thread_id: str) -> str:
    """The assistant text on disk: the message as opened, then its appended text in order."""
    rows = t3.rows("SELECT message_id, json_extract(payload_json, '$.text') FROM messages "
                   "WHERE thread_id = ? AND json_extract(payload_json, '$.role') = 'assistant'",
                   (thread_id,))
    assert len(rows) == 1
    appended = t3.rows(
        "SELECT json_extract(payload_json, '$.text') FROM events WHERE type = "
        "'message-text.appended' AND json_extract(payload_json, '$.id') = ? ORDER BY sequence",
        (rows[0][0],))
    return rows[0][1] + "".join(r[0] for r in appended)


def _sent_chunks(entries: list[dict[str, Any]]) -> list[str]:
    return [e["msg"]["params"]["update"]["content"]["text"] for e in entries
            if e["dir"] == "out" and e["msg"].get("method") == "session/update"
            and CHUNK.search(e["msg"]["params"]["update"].get("content", {}).get("text", ""))]


def test_a_subscriber_sees_streamed_text_while_it_streams(t3: T3Server) -> None:
    """A 3 s answer reaches a /ws subscriber in many commits while it streams, each chunk about
    one window after the agent sent it: not held until the turn ends."""
    _, seen = asyncio.run(_follow(t3, "PACED:150:50:3"))
    assert [chunk for _, chunk, _ in seen] == list(range(150))
    sightings = {at for at, _, _ in seen}
    assert len(sightings) >= 5  # 3 s in windows of 0.2 s: about 15 commits
    delays = [at - sent for at, _, sent in seen]
    assert statistics.median(delays) <= Orchestrator.INGEST_WINDOW_S + SLACK_S, delays


def test_a_kill9_mid_stream_loses_at_most_the_last_window(t3: T3Server, agent_log_path) -> None:
    """kill -9 mid-stream, 1.5 s of sending after a subscriber saw text: on disk is the sent text
    up to some chunk, in order, with every chunk a subscriber was shown; every chunk sent but lost
    left the agent within the last window (plus slack for the commit in flight) before the kill."""
    thread_id, seen = asyncio.run(_follow(t3, "PACED:1000:50:10", stop_after=100))
    # The kill falls where the agent is, not just after a commit the subscriber saw.
    wait_until(lambda: len(_sent_chunks(agent_log(agent_log_path))) >= len(seen) + 150, 30)
    killed_at = time.time()
    t3.kill9()
    sent = _sent_chunks(agent_log(agent_log_path))  # each logged before it was sent
    stamps = [float(CHUNK.search(c)[2]) for c in sent]  # type: ignore[index]
    before_kill = sum(1 for s in stamps if s < killed_at)
    text = _persisted_text(t3, thread_id)
    kept = len(CHUNK.findall(text))
    assert text == "".join(sent[:kept])  # a prefix of what was sent, in order
    assert kept >= len(seen)  # nothing a subscriber saw is lost
    lost = stamps[kept:before_kill]
    assert not lost or lost[0] >= killed_at - Orchestrator.INGEST_WINDOW_S - SLACK_S, (
        f"lost {len(lost)} chunks, the first sent {killed_at - lost[0]:.3f} s before the kill")
