"""The fake model server over real HTTP, one API at a time, without any agent CLI (SPEC 9).

Each API is described by an `Api` row: how a CLI shapes a request (as recorded in
research/agents.md §1-6) and how a CLI reads the reply, including the stream's end marker.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_model import SHELL_COMMAND, FakeModelServer

Records = list[tuple[str | None, Any]]


@pytest.fixture
def model(tmp_path: Path) -> Iterator[FakeModelServer]:
    with FakeModelServer(log_path=tmp_path / "model.jsonl", slow_delay=0.01) as server:
        yield server


def post(server: FakeModelServer, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def sse(raw: str) -> Records:
    """(event, data) per SSE record; data is parsed JSON, or the raw string for `[DONE]`."""
    records = []
    for block in raw.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line)
        if "data" in fields:
            data = fields["data"]
            records.append((fields.get("event"), data if data == "[DONE]" else json.loads(data)))
    return records


# ---------------------------------------------------------------- the four APIs, as the CLIs use them

def _responses_ask(text: str, tools: Sequence[str]) -> dict[str, Any]:
    return {"model": "fake-model", "stream": True, "store": False,
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be nice"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}],
            "tools": [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in tools]}


def _responses_tool_result(output: str) -> dict[str, Any]:
    body = _responses_ask("USE_TOOL", ["exec_command"])
    body["input"] += [{"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_1", "output": output}]
    return body


def _responses_text(records: Records) -> str:
    assert records[-1][0] == "response.completed"
    assert [data["sequence_number"] for _, data in records] == list(range(len(records)))
    assert all(event == data["type"] for event, data in records)
    text = "".join(d["delta"] for e, d in records if e == "response.output_text.delta")
    assert records[-1][1]["response"]["output"][0]["content"][0]["text"] == text
    return text


def _responses_call(records: Records) -> tuple[str, dict[str, Any]]:
    assert records[-1][0] == "response.completed" and records[-1][1]["response"]["usage"]["total_tokens"] == 15
    item = next(d["item"] for e, d in records if e == "response.output_item.done")
    assert item["type"] == "function_call" and item["call_id"]
    name = f"{item['namespace']}__{item['name']}" if "namespace" in item else item["name"]
    return name, json.loads(item["arguments"])


def _chat_ask(text: str, tools: Sequence[str]) -> dict[str, Any]:
    return {"model": "fake-model", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": text}],
            "tools": [{"type": "function", "function": {"name": n, "parameters": {}}} for n in tools]}


def _chat_tool_result(output: str) -> dict[str, Any]:
    body = _chat_ask("USE_TOOL", ["bash"])
    call = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": output}]
    return body


def _chat_choices(records: Records) -> list[dict[str, Any]]:
    assert records[-1] == (None, "[DONE]")
    assert records[-2][1]["choices"] == [] and records[-2][1]["usage"]["total_tokens"] == 15
    return [d["choices"][0] for _, d in records[:-2]]


def _chat_text(records: Records) -> str:
    choices = _chat_choices(records)
    assert choices[-1]["finish_reason"] == "stop"
    return "".join(c["delta"].get("content") or "" for c in choices)


def _chat_call(records: Records) -> tuple[str, dict[str, Any]]:
    choices = _chat_choices(records)
    assert choices[-1]["finish_reason"] == "tool_calls"
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    name = "".join(c["function"].get("name", "") for c in calls)
    return name, json.loads("".join(c["function"].get("arguments", "") for c in calls))


REMINDER = {"type": "text", "text": "<system-reminder>\nCLAUDE.md says hi\n</system-reminder>\n"}
CONTEXT = [REMINDER,  # the blocks claude-agent-acp 0.23.1 (Claude Code 2.1.83) puts before the first prompt
           {"type": "text", "text": "<local-command-caveat>Caveat: ...</local-command-caveat>\n"},
           {"type": "text", "text": "<command-name>/model</command-name>\n   <command-args>default</command-args>\n"}]


def _anthropic_ask(text: str, tools: Sequence[str]) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-6", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "x"}],
            "messages": [{"role": "user", "content": [*CONTEXT, {"type": "text", "text": text}]}],
            "tools": [{"name": n, "description": n, "input_schema": {"type": "object"}} for n in tools]}


def _anthropic_tool_result(output: str) -> dict[str, Any]:
    body = _anthropic_ask("USE_TOOL", ["Bash"])
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "x"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": output}]}
    body["messages"] += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result, REMINDER]}]
    return body


def _anthropic_events(records: Records) -> list[str]:
    events = [e for e, _ in records]
    assert events[0] == "message_start" and events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(e == d["type"] for e, d in records)
    return events


def _anthropic_text(records: Records) -> str:
    _anthropic_events(records)
    assert records[-2][1]["delta"]["stop_reason"] == "end_turn"
    return "".join(d["delta"]["text"] for e, d in records if e == "content_block_delta")


def _anthropic_call(records: Records) -> tuple[str, dict[str, Any]]:
    _anthropic_events(records)
    assert records[-2][1]["delta"]["stop_reason"] == "tool_use"
    block = records[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    arguments = "".join(d["delta"]["partial_json"] for e, d in records if e == "content_block_delta")
    return block["name"], json.loads(arguments)


def _gemini_ask(text: str, tools: Sequence[str]) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], "systemInstruction": {"parts": [{"text": "x"}]},
            "tools": [{"functionDeclarations": [{"name": n, "parametersJsonSchema": {}} for n in tools]}],
            "generationConfig": {"temperature": 0}}


def _gemini_tool_result(output: str) -> dict[str, Any]:
    body = _gemini_ask("USE_TOOL", ["run_shell_command"])
    call = {"functionCall": {"name": "run_shell_command", "args": {"command": "x"}}}
    response = {"functionResponse": {"name": "run_shell_command", "response": {"output": output}}}
    body["contents"] += [{"role": "model", "parts": [call]}, {"role": "user", "parts": [response]}]
    return body


def _gemini_parts(records: Records) -> list[dict[str, Any]]:
    assert all(e is None for e, _ in records)
    assert records[-1][1]["candidates"][0]["finishReason"] == "STOP"
    assert all("finishReason" not in d["candidates"][0] for _, d in records[:-1])
    return [p for _, d in records for p in d["candidates"][0]["content"]["parts"]]


def _gemini_call(records: Records) -> tuple[str, dict[str, Any]]:
    (part,) = _gemini_parts(records)
    return part["functionCall"]["name"], part["functionCall"]["args"]


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    ask: Callable[[str, Sequence[str]], dict[str, Any]]
    tool_result: Callable[[str], dict[str, Any]]
    text: Callable[[Records], str]
    call: Callable[[Records], tuple[str, dict[str, Any]]]
    shell_tool: tuple[str, dict[str, Any]]          # what USE_TOOL calls, given the client's usual tools
    tools: tuple[str, ...]                          # the client's usual tools
    mcp_tool: Any                                   # how the client offers the t3 tool `delegate_task`


APIS = [
    Api("responses", "/v1/responses", _responses_ask, _responses_tool_result, _responses_text, _responses_call,
        ("exec_command", {"cmd": SHELL_COMMAND}), ("apply_patch", "exec_command", "write_stdin"),
        {"type": "namespace", "name": "mcp__t3-code", "tools": [{"type": "function", "name": "delegate_task"}]}),
    Api("chat", "/v1/chat/completions", _chat_ask, _chat_tool_result, _chat_text, _chat_call,
        ("bash", {"command": SHELL_COMMAND}), ("read", "bash", "edit"),
        {"type": "function", "function": {"name": "t3-code_delegate_task", "parameters": {}}}),
    Api("anthropic", "/v1/messages?beta=true", _anthropic_ask, _anthropic_tool_result, _anthropic_text,
        _anthropic_call, ("Bash", {"command": SHELL_COMMAND, "description": "Run the scripted command"}),
        ("Read", "Bash", "Edit"), {"name": "mcp__t3-code__delegate_task", "input_schema": {}}),
    Api("gemini", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", _gemini_ask, _gemini_tool_result,
        lambda records: "".join(p["text"] for p in _gemini_parts(records)), _gemini_call,
        ("run_shell_command", {"command": SHELL_COMMAND}), ("read_file", "run_shell_command"),
        {"functionDeclarations": [{"name": "mcp_t3-code_delegate_task"}]}),
]
by_api = pytest.mark.parametrize("api", APIS, ids=[a.name for a in APIS])


def stream(model: FakeModelServer, api: Api, body: dict[str, Any]) -> Records:
    status, raw = post(model, api.path, body)
    assert status == 200, raw
    return sse(raw)


# ---------------------------------------------------------------- the reply script

@by_api
def test_streamed_text_reply_says_hello(model: FakeModelServer, api: Api) -> None:
    """A plain prompt streams "Hello from fake model. You said: <text>" in several deltas, with the end marker."""
    records = stream(model, api, api.ask("hi there", api.tools))
    assert api.text(records) == "Hello from fake model. You said: hi there"
    assert len(records) >= 4


@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/responses", _responses_ask("plain", []) | {"stream": False},
     lambda r: r["output"][0]["content"][0]["text"]),
    ("/responses", _responses_ask("plain", []) | {"stream": False}, lambda r: r["output"][0]["content"][0]["text"]),
    ("/v1/chat/completions", _chat_ask("plain", []) | {"stream": False},
     lambda r: r["choices"][0]["message"]["content"]),
    ("/chat/completions", _chat_ask("plain", []) | {"stream": False},
     lambda r: r["choices"][0]["message"]["content"]),
    ("/v1/messages", _anthropic_ask("plain", []) | {"stream": False}, lambda r: r["content"][0]["text"]),
    ("/v1beta/models/gemini-3.5-flash-lite:generateContent", _gemini_ask("plain", []),
     lambda r: r["candidates"][0]["content"]["parts"][0]["text"]),
], ids=["responses", "responses-root", "chat", "chat-root", "anthropic", "gemini"])
def test_non_streamed_text_reply_is_one_json(model: FakeModelServer, path: str, body: Any, text_of: Callable) -> None:
    """Without streaming, each API answers one JSON object with the same script's text."""
    status, raw = post(model, path, body)
    assert status == 200
    assert text_of(json.loads(raw)) == "Hello from fake model. You said: plain"


@by_api
def test_use_tool_calls_the_offered_shell_tool(model: FakeModelServer, api: Api) -> None:
    """USE_TOOL calls the client's shell tool, chosen from the request's tools, with the harmless command."""
    assert api.call(stream(model, api, api.ask("please USE_TOOL now", api.tools))) == api.shell_tool


@pytest.mark.parametrize("tools, expected", [
    (["shell_command", "apply_patch"], ("shell_command", {"command": SHELL_COMMAND})),
    (["shell"], ("shell", {"command": ["bash", "-lc", SHELL_COMMAND]})),
    (["bash", "exec_command"], ("exec_command", {"cmd": SHELL_COMMAND})),
])
def test_use_tool_prefers_the_newest_codex_shell(model: FakeModelServer, tools: list[str], expected: tuple) -> None:
    """Older codex tool names get their own argument shapes; exec_command wins when several are offered."""
    assert _responses_call(stream(model, APIS[0], _responses_ask("USE_TOOL", tools))) == expected


@by_api
def test_use_tool_with_a_command_runs_that_command(model: FakeModelServer, api: Api) -> None:
    """`USE_TOOL: <command>` runs the rest of the line instead (e.g. a command a CLI must ask permission for)."""
    name, arguments = api.call(stream(model, api, api.ask("USE_TOOL: touch marker.txt\nthanks", api.tools)))
    assert name == api.shell_tool[0]
    assert arguments == {k: "touch marker.txt" if v == SHELL_COMMAND else v for k, v in api.shell_tool[1].items()}


@by_api
def test_use_tool_without_a_shell_tool_answers_in_text(model: FakeModelServer, api: Api) -> None:
    """A side request (a title, a summary) offers no tools: USE_TOOL then gets a text naming what was offered."""
    assert api.text(stream(model, api, api.ask("title for: USE_TOOL", []))) == "NO_SUCH_TOOL shell (offered: none)"


@by_api
def test_tool_result_is_acknowledged(model: FakeModelServer, api: Api) -> None:
    """A conversation ending with a tool result gets the final text TOOL_RESULT_SEEN: <output>."""
    assert api.text(stream(model, api, api.tool_result("fake-tool-ran\n"))) == "TOOL_RESULT_SEEN: fake-tool-ran\n"


@by_api
def test_call_mcp_calls_the_matching_tool_with_its_arguments(model: FakeModelServer, api: Api) -> None:
    """CALL_MCP <substring> <json> calls the offered tool whose name contains the substring; trigger words in
    the arguments (a prompt for a delegated agent) trigger nothing."""
    body = api.ask('Delegate this.\nCALL_MCP delegate_task {"prompt": "USE_TOOL then SLOW", "n": 1}', api.tools)
    body["tools"].append(api.mcp_tool)
    name, arguments = api.call(stream(model, api, body))
    assert name.endswith("delegate_task") and "t3-code" in name
    assert arguments == {"prompt": "USE_TOOL then SLOW", "n": 1}


def test_claude_prompt_after_a_cancel_is_read_alone(model: FakeModelServer) -> None:
    """After a cancel Claude merges the cancelled prompt, an interruption note and the next prompt into one
    user message; only the last prompt decides the reply (a cancelled SLOW does not make the next turn slow)."""
    body = _anthropic_ask("go SLOW", [])
    body["messages"][0]["content"] += [{"type": "text", "text": "[Request interrupted by user]"},
                                       {"type": "text", "text": "hi again"}]
    assert _anthropic_text(stream(model, APIS[2], body)) == "Hello from fake model. You said: hi again"


def test_call_mcp_on_codex_names_the_namespace(model: FakeModelServer) -> None:
    """A codex namespace tool is called by its own name plus the namespace field, as codex requires."""
    body = _responses_ask("CALL_MCP orchestrator_capabilities", [])
    body["tools"].append({"type": "namespace", "name": "mcp__t3-code",
                          "tools": [{"type": "function", "name": "orchestrator_capabilities"}]})
    item = next(d["item"] for e, d in stream(model, APIS[0], body) if e == "response.output_item.done")
    assert (item["name"], item["namespace"], json.loads(item["arguments"])) == ("orchestrator_capabilities",
                                                                               "mcp__t3-code", {})


@by_api
def test_call_mcp_without_a_match_names_the_offered_tools(model: FakeModelServer, api: Api) -> None:
    """CALL_MCP for a tool nobody offers answers NO_SUCH_TOOL with the offered names, for debugging."""
    text = api.text(stream(model, api, api.ask("CALL_MCP nowhere {}", api.tools)))
    assert text == f"NO_SUCH_TOOL nowhere (offered: {', '.join(api.tools)})"


@by_api
def test_slow_streams_thirty_deltas(model: FakeModelServer, api: Api) -> None:
    """SLOW streams 30 deltas "chunk <i> " and then ends normally."""
    records = stream(model, api, api.ask("go SLOW", api.tools))
    assert api.text(records) == "".join(f"chunk {i} " for i in range(1, 31))


# ---------------------------------------------------------------- HTTP behaviour

def _start_slow_stream(server: FakeModelServer) -> socket.socket:
    """A raw client that asks for a SLOW stream and has read its first delta."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps(_anthropic_ask("SLOW", []))
    sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while b"chunk 1 " not in received:
        data = sock.recv(65536)
        assert data, "stream ended early"
        received += data
    assert b"Transfer-Encoding: chunked" in received and b"text/event-stream" in received
    return sock


def test_client_hanging_up_mid_slow_stream_leaves_the_server_working(capfd: pytest.CaptureFixture[str]) -> None:
    """A client that disconnects during SLOW ends that stream at once, without a traceback; the next request works."""
    with FakeModelServer(slow_delay=0.2) as server:
        _start_slow_stream(server).close()
        server.wait_for_hangups(1, timeout=5)
        assert _anthropic_text(stream(server, APIS[2], _anthropic_ask("still there?", []))).endswith("still there?")
    assert "Traceback" not in capfd.readouterr().err


def test_stop_ends_open_streams(capfd: pytest.CaptureFixture[str]) -> None:
    """stop() returns promptly even while a SLOW stream with long pauses is open, and that client sees EOF."""
    server = FakeModelServer(slow_delay=30).start()
    sock = _start_slow_stream(server)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 5
    sock.settimeout(5)
    while sock.recv(65536):
        pass
    sock.close()
    assert "Traceback" not in capfd.readouterr().err


def test_requests_are_recorded_and_logged_without_secrets(model: FakeModelServer, tmp_path: Path) -> None:
    """Every request is kept in memory and in the JSONL log, with its API, body, reply and redacted credentials."""
    post(model, "/v1/messages?beta=true", _anthropic_ask("first", ["Bash"]), {"x-api-key": "sk-ant-secret"})
    post(model, "/v1/responses", _responses_ask("USE_TOOL", ["exec_command"]), {"Authorization": "Bearer sk-secret"})
    requests = model.wait_for_requests(2, timeout=5)
    assert [r["api"] for r in requests] == ["anthropic", "responses"]
    assert requests[0]["path"] == "/v1/messages?beta=true" and requests[0]["headers"]["x-api-key"] == "<redacted>"
    assert requests[1]["headers"]["authorization"] == "Bearer <redacted>"
    assert model.last_user_text(requests[0]) == "first"  # the context blocks are skipped
    assert requests[0]["reply"] == {"text": "Hello from fake model. You said: first"}
    assert requests[1]["reply"] == {"tool": "exec_command", "arguments": {"cmd": SHELL_COMMAND}}
    assert model.requests_for("responses") == [requests[1]]
    logged = [json.loads(line) for line in (tmp_path / "model.jsonl").read_text().splitlines()]
    assert logged == requests
    assert "secret" not in (tmp_path / "model.jsonl").read_text()


def test_wait_for_requests_times_out(model: FakeModelServer) -> None:
    """wait_for_requests raises TimeoutError when too few requests of that API arrive."""
    post(model, "/v1/chat/completions", _chat_ask("hi", []))
    assert len(model.wait_for_requests(1, timeout=5, api="chat")) == 1
    with pytest.raises(TimeoutError):
        model.wait_for_requests(1, timeout=0.05, api="gemini")


def test_models_token_counts_and_unknown_paths(model: FakeModelServer) -> None:
    """Model lists and token counts get small answers; anything else is a recorded JSON 404."""
    conn = http.client.HTTPConnection("127.0.0.1", model.port, timeout=10)
    for path in ("/v1/models", "/models?limit=5", "/v1beta/models"):
        conn.request("GET", path)
        response = conn.getresponse()
        listing = json.loads(response.read())
        assert response.status == 200 and listing["data"][0]["id"] and listing["models"][0]["name"]
    conn.close()
    status, raw = post(model, "/v1/messages/count_tokens", _anthropic_ask("x", []))
    assert (status, json.loads(raw)["input_tokens"]) == (200, 10)
    status, raw = post(model, "/v1/embeddings", {"input": "x"})
    assert status == 404 and "no route for POST /v1/embeddings" in json.loads(raw)["error"]["message"]
    assert post(model, "/v1/messages", [1, 2])[0] == 400
    assert [r["path"] for r in model.requests_for("unknown")] == ["/v1/embeddings"]


def test_gemini_json_side_request_gets_json_fitting_its_schema(model: FakeModelServer) -> None:
    """A Gemini side request asking for JSON gets a JSON text that fits its response schema."""
    body = _gemini_ask("who speaks next?", [])
    body["generationConfig"] = {"responseMimeType": "application/json", "responseJsonSchema": {
        "type": "object", "properties": {"reasoning": {"type": "string"},
                                         "next_speaker": {"type": "string", "enum": ["user", "model"]}}}}
    status, raw = post(model, "/v1beta/models/gemini-2.5-flash:generateContent", body)
    answer = json.loads(json.loads(raw)["candidates"][0]["content"]["parts"][0]["text"])
    assert status == 200 and answer["next_speaker"] == "user" and "who speaks next?" in answer["reasoning"]


def test_standalone_server_prints_its_url() -> None:
    """`python tests/fake_model.py --port 0` serves and names its URL on stderr."""
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_model.py")), "--port", "0"],
                               stderr=subprocess.PIPE, text=True)
    try:
        url = process.stderr.readline().split()[-1]
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stderr.close()
