"""A tiny MCP server with one `echo` tool on the stack t3 uses (the SDK's low-level `Server`,
`StreamableHTTPSessionManager(stateless=True, json_response=False)`, hypercorn): the floor that
P3 compares t3's read tools against. Prints `ready: <url>/mcp` on stderr; stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from typing import Any

import hypercorn.asyncio
import hypercorn.config
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

ECHO = types.Tool(name="echo", description="Return the arguments.",
                  input_schema={"type": "object", "properties": {"text": {"type": "string"}}})


async def main() -> None:
    async def list_tools(ctx: ServerRequestContext, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[ECHO])

    async def call_tool(ctx: ServerRequestContext, params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        payload = dict(params.arguments or {})
        return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(payload))],
                                    structured_content=payload, is_error=False)

    # As t3 does: the SDK checks a call's Mcp-Param-* headers against this schema, and without
    # the lookup it runs a whole tools/list for every call.
    server = Server("echo", version="1", on_list_tools=list_tools, on_call_tool=call_tool,
                    get_tool_input_schema=lambda name: ECHO.input_schema if name == "echo" else None)
    manager = StreamableHTTPSessionManager(app=server, stateless=True, json_response=False)
    sock = socket.socket()
    # As hypercorn does for sockets it binds itself (and t3's listener for each connection):
    # accepted sockets inherit it, so an answer's body does not wait for a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = hypercorn.config.Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await manager.handle_request(scope, receive, send)
    async with manager.run():
        served = asyncio.create_task(hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait))
        print(f"ready: http://127.0.0.1:{sock.getsockname()[1]}/mcp", file=sys.stderr, flush=True)
        await served


if __name__ == "__main__":
    asyncio.run(main())
