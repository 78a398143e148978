#!/usr/bin/env python3
"""Scripted fake model server: the only fake when tests drive the real agent CLIs (SPEC 9).

Speaks four model APIs on 127.0.0.1 (research/agents.md §1), ignoring query strings, model names
and API keys:
  POST /v1/responses, /responses                 OpenAI Responses (SSE when "stream": true)
  POST /v1/chat/completions, /chat/completions   OpenAI Chat Completions (SSE when "stream": true)
  POST /v1/messages (?beta=true)                 Anthropic Messages (SSE when "stream": true)
  POST /v1/messages/count_tokens, ...:countTokens  a small constant count
  POST /v1beta/models/{model}:streamGenerateContent (?alt=sse) and :generateContent   Gemini
  GET  /v1/models, /models, /v1beta/models       a one-model list
Anything else is a 404 with a JSON error, recorded like every other request.

Each reply is decided from the conversation, first rule that applies:
  1. the last input item is a tool result   -> text "TOOL_RESULT_SEEN: <output>"
  2. the last user text contains USE_TOOL    -> one call of the shell tool the request offers
     (exec_command, shell_command, shell, Bash, bash, run_shell_command) running
     `echo fake-tool-ran`, or the rest of the line after `USE_TOOL:` (Claude Code runs read-only
     commands such as echo without asking: `USE_TOOL: echo x > f` gets a permission request)
  3. a line `CALL_MCP <name-substring> [json-args]` -> one call of the first offered tool whose
     name (for codex namespace tools `<namespace>__<name>`) contains the substring
  4. the last user text contains SLOW        -> 30 text deltas "chunk <i> ", `slow_delay` seconds
     apart (env FAKE_SLOW_DELAY, default 0.5); a client hanging up ends the stream at once
  5. otherwise -> "Hello from fake model. You said: <last user text>" in 4 deltas
USE_TOOL and SLOW are looked for outside CALL_MCP lines, so a call's arguments (a prompt for a
delegated agent) trigger nothing here. A wanted tool that is not offered gives the text
"NO_SUCH_TOOL <wanted> (offered: <names>)". Side requests (titles, summaries) follow the same rules.
The last user text is the last text part of the last user message, skipping parts that are
context wrapped whole in tags (Claude's `<system-reminder>`...).

Streams are `text/event-stream`, chunked, one chunk per SSE record, flushed, ended by the zero
chunk. Clients hanging up (interrupt, steer) are expected: no traceback, counted in `hangups`.
Every request is recorded in `requests` as {method, path, api, body, headers, time, reply}, with
credential header values redacted, and appended as a JSON line to `log_path` if given.
Standalone: `python tests/fake_model.py [--port N] [--log FILE]` prints its URL on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

__all__ = ["SHELL_COMMAND", "SHELL_TOOLS", "FakeModelServer", "Reply", "Tool", "Turn", "decide", "parse_turn"]

SHELL_COMMAND = "echo fake-tool-ran"
# In order of preference: codex 0.171, older codex (two), claude, pi and opencode, gemini.
SHELL_TOOLS = ("exec_command", "shell_command", "shell", "Bash", "bash", "run_shell_command")
USE_TOOL_COMMAND = re.compile(r"USE_TOOL:[ \t]*(\S.*)")
SLOW_CHUNKS = 30
CONTEXT_BLOCK = re.compile(r"\s*<[\w-]+>.*>\s*", re.DOTALL)  # e.g. Claude's <system-reminder> text blocks
CALL_MCP_LINE = re.compile(r"^[ \t]*CALL_MCP[ \t]+(\S+)[ \t]*(.*?)[ \t]*$", re.MULTILINE)
USAGE = {"input": 10, "output": 5}
REDACTED_HEADERS = {"authorization", "x-api-key", "x-goog-api-key", "api-key"}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    namespace: str | None = None  # codex offers MCP tools inside {"type": "namespace"} tools

    @property
    def full_name(self) -> str:
        return f"{self.namespace}__{self.name}" if self.namespace else self.name


@dataclass(frozen=True, slots=True)
class Turn:
    """What the script reads from one request, whatever its API."""
    user_text: str
    tool_output: str | None  # set when the conversation ends with a tool result
    tools: tuple[Tool, ...]


@dataclass(frozen=True, slots=True)
class Reply:
    chunks: tuple[str, ...] = ()  # text deltas, when the reply is text
    delay: float = 0.0            # seconds between two deltas, when streamed
    tool: Tool | None = None      # else one call of this tool
    arguments: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def summary(self) -> dict[str, Any]:
        return {"tool": self.tool.full_name, "arguments": self.arguments} if self.tool else {"text": self.text}


def decide(turn: Turn, *, slow_delay: float) -> Reply:
    """The reply script (module docstring)."""
    if turn.tool_output is not None:
        return Reply(("TOOL_RESULT_SEEN: ", turn.tool_output))
    text = turn.user_text
    plain = CALL_MCP_LINE.sub("", text)
    if "USE_TOOL" in plain:
        tool = next((t for name in SHELL_TOOLS for t in turn.tools if t.name == name), None)
        command = m[1] if (m := USE_TOOL_COMMAND.search(plain)) else SHELL_COMMAND
        if tool is None:
            return _no_such_tool("shell", turn)
        return Reply(tool=tool, arguments=_shell_arguments(tool.name, command))
    if call := CALL_MCP_LINE.search(text):
        wanted, raw_arguments = call[1], call[2]
        tool = next((t for t in turn.tools if wanted in t.full_name), None)
        if tool is None:
            return _no_such_tool(wanted, turn)
        try:
            arguments = json.loads(raw_arguments) if raw_arguments else {}
        except json.JSONDecodeError as e:
            return Reply((f"BAD_CALL_MCP_ARGUMENTS {e}",))
        return Reply(tool=tool, arguments=arguments)
    if "SLOW" in plain:
        return Reply(tuple(f"chunk {i} " for i in range(1, SLOW_CHUNKS + 1)), slow_delay)
    return Reply(("Hello ", "from fake model.", " You said: ", text))


def parse_turn(api: str, body: Any) -> Turn:
    """The conversation of a model request of `api` ("responses", "chat", "anthropic", "gemini")."""
    parse = _PARSERS.get(api)
    return parse(body) if parse and isinstance(body, dict) else Turn("", None, ())


class FakeModelServer:
    """The fake model on 127.0.0.1; `with FakeModelServer() as model: ... model.url ...`."""

    def __init__(self, *, port: int = 0, log_path: str | Path | None = None, slow_delay: float | None = None) -> None:
        self.port, self.log_path = port, Path(log_path) if log_path else None
        self.slow_delay = float(os.environ.get("FAKE_SLOW_DELAY", "0.5")) if slow_delay is None else slow_delay
        self.requests: list[dict[str, Any]] = []
        self.hangups = 0  # streams ended early because the client went away
        self._changed = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._httpd = _HTTPServer(("127.0.0.1", self.port), _Handler)
        self._httpd.fake = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-model-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, and end every open connection (a paced stream stops at its next wait)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        with self._changed:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._httpd.server_close()
        self._httpd = None

    def __enter__(self) -> Self:
        return self if self._httpd else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests_for(self, api: str) -> list[dict[str, Any]]:
        with self._changed:
            return [r for r in self.requests if r["api"] == api]

    @staticmethod
    def last_user_text(request: dict[str, Any]) -> str:
        """The last user text of a recorded request ("" when it is not a model request)."""
        return parse_turn(request["api"], request["body"]).user_text

    def wait_for_requests(self, n: int, timeout: float = 10.0, *, api: str | None = None) -> list[dict[str, Any]]:
        """Block until at least `n` requests (of `api`, if given) were recorded; they are returned."""
        def matching() -> list[dict[str, Any]]:
            return [r for r in self.requests if api is None or r["api"] == api]
        with self._changed:
            if not self._changed.wait_for(lambda: len(matching()) >= n, timeout):
                raise TimeoutError(f"{len(matching())} of {n} {api or ''} requests within {timeout} s")
            return matching()

    def wait_for_hangups(self, n: int, timeout: float = 10.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.hangups >= n, timeout):
                raise TimeoutError(f"{self.hangups} of {n} hangups within {timeout} s")

    def _record(self, request: dict[str, Any]) -> None:
        with self._changed:
            self.requests.append(request)
            if self.log_path:
                with self.log_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(request) + "\n")
            self._changed.notify_all()

    def _note_hangup(self) -> None:
        with self._changed:
            self.hangups += 1
            self._changed.notify_all()


# ---------------------------------------------------------------- conversation parsing, per API

def _user_text(content: Any) -> str:
    """The last text part of a user message's content, skipping parts that are context wrapped whole
    in tags. Claude puts <system-reminder>, <local-command-stdout>... blocks before the prompt, and
    after a cancel merges the cancelled prompt, "[Request interrupted by user]" and the next prompt
    into one message: only its last part is the new prompt."""
    if isinstance(content, str):
        return content
    texts = [p["text"] for p in content or () if isinstance(p, dict) and isinstance(p.get("text"), str)]
    plain = [t for t in texts if not CONTEXT_BLOCK.fullmatch(t)]
    return (plain or texts or [""])[-1]


def _output_text(value: Any) -> str:
    """A tool result as text, whichever shape the client used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_output_text(v) for v in value)
    if isinstance(value, dict):
        for key in ("text", "output", "content"):
            if key in value:
                return _output_text(value[key])
    return json.dumps(value)


def _parse_responses(body: dict[str, Any]) -> Turn:
    items = body.get("input") or []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    last = items[-1] if items else {}
    output = _output_text(last.get("output")) if str(last.get("type", "")).endswith("call_output") else None
    user = next((_user_text(i.get("content")) for i in reversed(items)
                 if i.get("role") == "user" and i.get("type", "message") == "message"), "")
    tools: list[Tool] = []
    for t in body.get("tools") or []:
        if t.get("type") == "namespace":
            tools += [Tool(s["name"], t.get("name")) for s in t.get("tools") or [] if s.get("name")]
        elif t.get("name"):
            tools.append(Tool(t["name"]))
    return Turn(user, output, tuple(tools))


def _parse_chat(body: dict[str, Any]) -> Turn:
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    output = _output_text(last.get("content")) if last.get("role") == "tool" else None
    user = next((_user_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    functions = [t.get("function") or t for t in body.get("tools") or []]
    tools = [Tool(f["name"]) for f in functions if f.get("name")]
    return Turn(user, output, tuple(tools))


def _parse_anthropic(body: dict[str, Any]) -> Turn:
    def results(message: dict[str, Any]) -> list[dict[str, Any]]:
        content = message.get("content")
        return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"] \
            if message.get("role") == "user" and isinstance(content, list) else []
    messages = body.get("messages") or []
    last_results = results(messages[-1]) if messages else []
    output = _output_text(last_results[-1].get("content", "")) if last_results else None
    user = next((_user_text(m.get("content")) for m in reversed(messages)
                 if m.get("role") == "user" and not results(m)), "")
    return Turn(user, output, tuple(Tool(t["name"]) for t in body.get("tools") or [] if t.get("name")))


def _parse_gemini(body: dict[str, Any]) -> Turn:
    def responses(content: dict[str, Any]) -> list[dict[str, Any]]:
        return [p["functionResponse"] for p in content.get("parts") or [] if "functionResponse" in p]
    contents = [c for c in body.get("contents") or [] if isinstance(c, dict)]
    last_responses = responses(contents[-1]) if contents and contents[-1].get("role", "user") == "user" else []
    output = _output_text(last_responses[-1].get("response", "")) if last_responses else None
    user = next((_user_text(c.get("parts")) for c in reversed(contents)
                 if c.get("role", "user") == "user" and not responses(c)), "")
    tools = [Tool(d["name"]) for t in body.get("tools") or []
             for d in t.get("functionDeclarations") or t.get("function_declarations") or [] if d.get("name")]
    return Turn(user, output, tuple(tools))


_PARSERS: dict[str, Callable[[dict[str, Any]], Turn]] = {
    "responses": _parse_responses, "chat": _parse_chat, "anthropic": _parse_anthropic, "gemini": _parse_gemini}


def _shell_arguments(tool: str, command: str) -> dict[str, Any]:
    if tool == "exec_command":
        return {"cmd": command}
    if tool == "shell":
        return {"command": ["bash", "-lc", command]}
    if tool == "Bash":
        return {"command": command, "description": "Run the scripted command"}
    return {"command": command}


def _no_such_tool(wanted: str, turn: Turn) -> Reply:
    offered = ", ".join(t.full_name for t in turn.tools) or "none"
    return Reply((f"NO_SUCH_TOOL {wanted} (offered: {offered})",))


# ---------------------------------------------------------------- replies, per API
# A stream function yields (event name or None, data) SSE records; `deltas` is the reply's text,
# paced by the handler. A complete function returns the non-streaming JSON reply.

Records = Iterator[tuple[str | None, Any]]


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _responses_item(reply: Reply, text: str, item_id: str, status: str) -> dict[str, Any]:
    if reply.tool:
        item = {"type": "function_call", "id": item_id, "call_id": "call_" + item_id[3:], "name": reply.tool.name,
                "arguments": json.dumps(reply.arguments) if status == "completed" else "", "status": status}
        return item | ({"namespace": reply.tool.namespace} if reply.tool.namespace else {})
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _responses_object(model: str, status: str, output: list[Any]) -> dict[str, Any]:
    usage = {"input_tokens": USAGE["input"], "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": USAGE["output"], "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": USAGE["input"] + USAGE["output"]}
    return {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response", "created_at": int(time.time()),
            "model": model, "status": status, "output": output, "usage": usage if status == "completed" else None}


def _stream_responses(reply: Reply, deltas: Iterator[str], model: str) -> Records:
    sequence = iter(range(1 << 30))
    def record(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(sequence), **fields}
    item_id = _new_id("fc_" if reply.tool else "msg_")
    start = _responses_object(model, "in_progress", [])
    yield record("response.created", response=start)
    yield record("response.in_progress", response=start)
    yield record("response.output_item.added", output_index=0, item=_responses_item(reply, "", item_id, "in_progress"))
    text = ""
    if reply.tool:
        arguments = json.dumps(reply.arguments)
        yield record("response.function_call_arguments.delta", item_id=item_id, output_index=0, delta=arguments)
        yield record("response.function_call_arguments.done", item_id=item_id, output_index=0, arguments=arguments)
    else:
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        yield record("response.content_part.added", **where, part=part)
        for delta in deltas:
            text += delta
            yield record("response.output_text.delta", **where, delta=delta)
        yield record("response.output_text.done", **where, text=text)
        yield record("response.content_part.done", **where, part=part | {"text": text})
    done = _responses_item(reply, text, item_id, "completed")
    yield record("response.output_item.done", output_index=0, item=done)
    yield record("response.completed", response=_responses_object(model, "completed", [done]) | {"id": start["id"]})


def _complete_responses(reply: Reply, model: str) -> dict[str, Any]:
    item = _responses_item(reply, reply.text, _new_id("fc_" if reply.tool else "msg_"), "completed")
    return _responses_object(model, "completed", [item])


def _chat_tool_call(tool: Tool, arguments: str) -> dict[str, Any]:
    return {"index": 0, "id": _new_id("call_"), "type": "function",
            "function": {"name": tool.name, "arguments": arguments}}


_CHAT_USAGE = {"prompt_tokens": USAGE["input"], "completion_tokens": USAGE["output"],
               "total_tokens": USAGE["input"] + USAGE["output"]}


def _stream_chat(reply: Reply, deltas: Iterator[str], model: str, *, usage: bool) -> Records:
    base = {"id": _new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    def chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
        return None, base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if reply.tool:
        yield chunk({"role": "assistant", "tool_calls": [_chat_tool_call(reply.tool, "")]})
        yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(reply.arguments)}}]})
        yield chunk({}, "tool_calls")
    else:
        yield chunk({"role": "assistant", "content": ""})
        for delta in deltas:
            yield chunk({"content": delta})
        yield chunk({}, "stop")
    if usage:
        yield None, base | {"choices": [], "usage": _CHAT_USAGE}
    yield None, "[DONE]"


def _complete_chat(reply: Reply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None if reply.tool else reply.text}
    if reply.tool:
        message["tool_calls"] = [_chat_tool_call(reply.tool, json.dumps(reply.arguments))]
    return {"id": _new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.tool else "stop"}],
            "usage": _CHAT_USAGE}


def _anthropic_message(model: str, content: list[Any], stop_reason: str | None) -> dict[str, Any]:
    return {"id": _new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": None,
            "usage": {"input_tokens": USAGE["input"], "output_tokens": USAGE["output"] if stop_reason else 1,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def _stream_anthropic(reply: Reply, deltas: Iterator[str], model: str) -> Records:
    def record(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, **fields}
    yield record("message_start", message=_anthropic_message(model, [], None))
    if reply.tool:
        block = {"type": "tool_use", "id": _new_id("toolu_"), "name": reply.tool.name, "input": {}}
        yield record("content_block_start", index=0, content_block=block)
        yield record("content_block_delta", index=0,
                     delta={"type": "input_json_delta", "partial_json": json.dumps(reply.arguments)})
    else:
        yield record("content_block_start", index=0, content_block={"type": "text", "text": ""})
        for delta in deltas:
            yield record("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
    yield record("content_block_stop", index=0)
    stop_reason = "tool_use" if reply.tool else "end_turn"
    yield record("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": None},
                 usage={"output_tokens": USAGE["output"]})
    yield record("message_stop")


def _complete_anthropic(reply: Reply, model: str) -> dict[str, Any]:
    if reply.tool:
        block = {"type": "tool_use", "id": _new_id("toolu_"), "name": reply.tool.name, "input": reply.arguments}
        return _anthropic_message(model, [block], "tool_use")
    return _anthropic_message(model, [{"type": "text", "text": reply.text}], "end_turn")


def _gemini_chunk(model: str, parts: list[Any], finished: bool) -> dict[str, Any]:
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    candidate |= {"finishReason": "STOP"} if finished else {}
    usage = {"promptTokenCount": USAGE["input"], "candidatesTokenCount": USAGE["output"],
             "totalTokenCount": USAGE["input"] + USAGE["output"]}
    return {"candidates": [candidate], "usageMetadata": usage, "modelVersion": model}


def _stream_gemini(reply: Reply, deltas: Iterator[str], model: str) -> Records:
    if reply.tool:
        yield None, _gemini_chunk(model, [{"functionCall": {"name": reply.tool.name, "args": reply.arguments}}], True)
        return
    chunks = list(reply.chunks)  # the last delta carries finishReason, so look one ahead
    for i, delta in enumerate(deltas):
        yield None, _gemini_chunk(model, [{"text": delta}], i == len(chunks) - 1)


def _complete_gemini(reply: Reply, model: str, *, json_schema: Any = None) -> dict[str, Any]:
    if reply.tool:
        return _gemini_chunk(model, [{"functionCall": {"name": reply.tool.name, "args": reply.arguments}}], True)
    text = reply.text if json_schema is None else json.dumps(_sample_json(json_schema, reply.text))
    return _gemini_chunk(model, [{"text": text}], True)


def _sample_json(schema: Any, text: str) -> Any:
    """A value fitting a (Gemini or JSON) schema, for side requests asking for JSON (a guess: unseen)."""
    schema = schema if isinstance(schema, dict) else {}
    kind = str(schema.get("type", "object")).lower()
    if schema.get("enum"):
        return schema["enum"][0]
    if kind == "object":
        return {k: _sample_json(v, text) for k, v in (schema.get("properties") or {}).items()}
    return {"array": [], "boolean": False, "integer": 0, "number": 0}.get(kind, text)


# ---------------------------------------------------------------- HTTP

_ROUTES = [  # (method, path pattern, api); the first full match wins
    ("POST", re.compile(r"(?:/v1)?/responses"), "responses"),
    ("POST", re.compile(r"(?:/v1)?/chat/completions"), "chat"),
    ("POST", re.compile(r"/v1/messages/count_tokens|/v1\w*/models/[^/]+:countTokens"), "count_tokens"),
    ("POST", re.compile(r"/v1/messages"), "anthropic"),
    ("POST", re.compile(r"/v1\w*/models/(?P<model>[^/:]+):(?P<method>(?:stream)?[gG]enerateContent)"), "gemini"),
    ("GET", re.compile(r"(?:/v1\w*)?/models"), "models"),
]


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeModelServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # clients hanging up are normal
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        with self.server.fake._changed:
            self.server.fake._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.fake._changed:
            self.server.fake._connections.discard(self.connection)
        try:
            super().finish()
        except ConnectionError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the record

    def _handle(self) -> None:
        fake, url = self.server.fake, urlsplit(self.path)
        api, match = next(((api, m) for method, pattern, api in _ROUTES
                           if method == self.command and (m := pattern.fullmatch(url.path.rstrip("/") or "/"))),
                          ("unknown", None))
        request = {"method": self.command, "path": self.path, "api": api, "body": None,
                   "headers": {k.lower(): _redact(k, v) for k, v in self.headers.items()},
                   "time": time.time(), "reply": None}
        try:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                request["body"] = json.loads(raw) if raw else None
            except ValueError:
                request["body"] = raw.decode("utf-8", "replace")
            if api in _PARSERS and isinstance(request["body"], dict):
                assert match is not None
                return self._answer(api, match, url.query, request)
            fake._record(request)
            self._send_json(*_fixed_reply(api, f"{self.command} {url.path}"))
        except ConnectionError:
            self.close_connection = True
            fake._note_hangup()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    def _answer(self, api: str, match: re.Match[str], query: str, request: dict[str, Any]) -> None:
        body = request["body"]
        model = match.groupdict().get("model") or str(body.get("model") or "fake-model")
        reply = decide(parse_turn(api, body), slow_delay=self.server.fake.slow_delay)
        request["reply"] = reply.summary()
        self.server.fake._record(request)
        deltas = self._paced(reply)
        if api == "gemini" and match["method"] == "streamGenerateContent":  # gemini-cli always asks alt=sse
            return self._send_stream(_stream_gemini(reply, deltas, model))
        if api == "gemini":
            config = body.get("generationConfig") or {}
            schema = config.get("responseJsonSchema") or config.get("responseSchema") or {}
            json_schema = schema if config.get("responseMimeType") == "application/json" else None
            return self._send_json(200, _complete_gemini(reply, model, json_schema=json_schema))
        if body.get("stream") is not True:
            complete = {"responses": _complete_responses, "chat": _complete_chat, "anthropic": _complete_anthropic}
            return self._send_json(200, complete[api](reply, model))
        if api == "chat":
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._send_stream(_stream_chat(reply, deltas, model, usage=include_usage))
        self._send_stream({"responses": _stream_responses, "anthropic": _stream_anthropic}[api](reply, deltas, model))

    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, records: Records) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event, data in records:
            line = data if isinstance(data, str) else json.dumps(data)
            self._write_chunk(((f"event: {event}\n" if event else "") + f"data: {line}\n\n").encode())
        self._write_chunk(b"")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _paced(self, reply: Reply) -> Iterator[str]:
        """The reply's text deltas, `reply.delay` apart; raises ConnectionAbortedError when the client
        hangs up (or the server stops) while waiting, so a slow stream ends at once."""
        for i, chunk in enumerate(reply.chunks):
            if i and reply.delay and self._hung_up_within(reply.delay):
                raise ConnectionAbortedError("client hung up")
            yield chunk

    def _hung_up_within(self, seconds: float) -> bool:
        readable, _, _ = select.select([self.connection], [], [], seconds)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def _fixed_reply(api: str, what: str) -> tuple[int, Any]:
    """(status, JSON) for every request that is not a model turn."""
    if api == "models":
        model = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake", "type": "model",
                 "display_name": "Fake model", "created_at": "2025-01-01T00:00:00Z"}
        gemini_model = {"name": "models/fake-model", "displayName": "Fake model",
                        "supportedGenerationMethods": ["generateContent"]}
        return 200, {"object": "list", "data": [model], "has_more": False, "models": [gemini_model]}
    if api == "count_tokens":
        return 200, {"input_tokens": USAGE["input"], "totalTokens": USAGE["input"]}
    if api in _PARSERS:
        return 400, {"error": {"type": "invalid_request_error", "message": "the body is not a JSON object"}}
    return 404, {"error": {"type": "not_found_error", "message": f"fake model server: no route for {what}"}}


def _redact(name: str, value: str) -> str:
    if name.lower() not in REDACTED_HEADERS:
        return value
    scheme, _, secret = value.partition(" ")
    return f"{scheme} <redacted>" if secret else "<redacted>"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", help="append every request to this file as a JSON line")
    parser.add_argument("--slow-delay", type=float, help="seconds between SLOW deltas ($FAKE_SLOW_DELAY, else 0.5)")
    args = parser.parse_args(argv)
    server = FakeModelServer(port=args.port, log_path=args.log, slow_delay=args.slow_delay).start()
    print(f"fake model server listening on {server.url}", file=sys.stderr, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
