"""A slow MCP consumer (reliability test 12): clients that send requests and never read the
answers must neither block the server nor make its memory grow with what they asked for."""

from __future__ import annotations

import array
import fcntl
import json
import socket
import termios
import time
import urllib.parse
from pathlib import Path

from harness import McpClient, T3Server, wait_until

STALLED = 100


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def unread_bytes(sock: socket.socket) -> int:
    """Bytes the server has sent that this client has not read (FIONREAD), without reading."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return buf[0]


def stalled_call(server: T3Server, tool: str, arguments: dict, rid: int) -> socket.socket:
    """POST one tools/call with a tiny receive buffer, and never read the answer."""
    url = urllib.parse.urlsplit(server.mcp_url)
    body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": tool, "arguments": arguments, "_meta": {"progressToken": rid}}}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.hostname, url.port))
    sock.sendall(b"\r\n".join([
        f"POST {url.path} HTTP/1.1".encode(), f"Host: {url.netloc}".encode(),
        f"Authorization: Bearer {server.token}".encode(), b"Content-Type: application/json",
        b"Accept: application/json, text/event-stream", b"mcp-protocol-version: 2025-06-18",
        f"Content-Length: {len(body)}".encode(), b"", body]))
    return sock


def thread_text(mcp: McpClient, thread_id: str) -> str:
    result = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1}).structured
    return "".join(item.get("text") or "" for item in result["items"])


def test_stalled_readers_neither_block_nor_bloat_the_server(t3: T3Server, mcp: McpClient) -> None:
    """100 clients that never read a ~60 KB answer each (and 10 that never read a wait's
    progress) leave the server answering others at once and running turns, cost a bounded amount
    of memory each, and the server still serves after they hang up."""
    big = mcp.call("create_threads", {"threads": [{"prompt": "x" * 100_000}]}).structured
    big_id = big["threads"][0]["threadId"]
    mcp.call("t3_thread_wait", {"threadId": big_id})
    slow = mcp.call("create_threads", {"threads": [{"prompt": "SLOW:2000 long"}]}).structured
    slow_id = slow["threads"][0]["threadId"]
    read_args = {"threadId": big_id, "afterPosition": -1, "maxCharsPerItem": 50_000}
    answer_size = len(json.dumps(mcp.call("t3_thread_read", read_args).raw.model_dump()))
    assert answer_size > 55_000  # a full page, as its text and its structuredContent
    baseline = rss_bytes(t3.pid)

    sockets = [stalled_call(t3, "t3_thread_read", read_args, i) for i in range(STALLED)]
    sockets += [stalled_call(t3, "t3_thread_wait", {"threadId": slow_id, "timeoutMs": 120_000},
                             STALLED + i) for i in range(10)]
    try:
        # Every stalled reader has been answered as far as its tiny buffer allows.
        wait_until(lambda: all(unread_bytes(s) > 0 for s in sockets[:STALLED]), 120,
                   message="the server answered every stalled reader")
        stalled = rss_bytes(t3.pid)
        began = time.monotonic()
        assert mcp.call("t3_thread_list", {}).ok
        assert time.monotonic() - began < 10
        other = mcp.call("create_threads", {"threads": [{"prompt": "still served"}]}).structured
        done = mcp.call("t3_thread_wait", {"threadId": other["threads"][0]["threadId"],
                                           "timeoutMs": 60_000}).structured
        assert done["status"] == "completed"
        # Each stalled answer costs a bounded amount while in flight: its copies as objects,
        # JSON and SSE bytes (~0.5 MB was measured for a ~100 KB answer).
        assert (stalled - baseline) / len(sockets) < 1024 * 1024, (stalled, baseline)
        # The stalled waits keep being sent progress while the slow turn streams; what the
        # server holds for them must not grow with it (the first other turn above may leave
        # allocator growth of its own, so measure from after it).
        before = rss_bytes(t3.pid)
        streamed = len(thread_text(mcp, slow_id))
        wait_until(lambda: len(thread_text(mcp, slow_id)) > streamed + 1_000, 120,
                   message="the slow turn streamed on while its waiters stalled")
        assert rss_bytes(t3.pid) - before < 8 * 1024 * 1024, (rss_bytes(t3.pid), before)
    finally:
        for s in sockets:
            s.close()
    mcp.call("t3_thread_interrupt", {"threadId": slow_id})
    assert mcp.call("t3_thread_list", {}).structured["total"] == 3
    assert t3.running
