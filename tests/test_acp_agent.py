"""Fast checks of the scripted ACP agent (tests/acp_agent.py) itself."""
import json, os, queue, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness import wait_until

AGENT = Path(__file__).with_name("acp_agent.py")


class AgentProcess:
    """Runs the agent and reads its stdout lines in a thread, with deadlines."""

    def __init__(self, env):
        self.proc = subprocess.Popen([sys.executable, str(AGENT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**os.environ, **env})
        self.lines, self.next_id = queue.Queue(), 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, msg):
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def request(self, method, params):
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        return self.next_id

    def read_until(self, pred, timeout=5.0):
        """Messages up to and including the first one matching pred."""
        seen, deadline = [], time.monotonic() + timeout
        while True:
            msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert msg is not None, f"agent exited; saw {seen}"
            seen.append(msg)
            if pred(msg):
                return seen

    def call(self, method, params, timeout=5.0):
        rid = self.request(method, params)
        seen = self.read_until(lambda m: m.get("id") == rid and "method" not in m, timeout)
        return seen[-1], seen[:-1]

    def new_session(self, cwd="/tmp", mcp_servers=()):
        self.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        params = {"cwd": cwd, "mcpServers": list(mcp_servers)}
        return self.call("session/new", params)[0]["result"]["sessionId"]

    def prompt_params(self, sid, text):
        return {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}


def agent_text(msgs, kind="agent_message_chunk"):
    return "".join(m["params"]["update"]["content"]["text"] for m in msgs
                   if m.get("method") == "session/update" and m["params"]["update"]["sessionUpdate"] == kind)


def mcp_log(path):
    return [e for e in map(json.loads, Path(path).read_text().splitlines()) if e["dir"] == "mcp"]


class ToyMcp:
    """A tiny stateless MCP server with JSON responses, run in threads of the test process. Every
    tool answers {"tool", "arguments"} as structuredContent; tool "block" only once `release` is
    set. `calls` receives (tool, arguments, Authorization header) as each request arrives."""

    def __init__(self):
        self.calls, self.release = queue.Queue(), threading.Event()
        toy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                params = body.get("params") or {}
                name, args = params.get("name"), params.get("arguments")
                toy.calls.put((name, args, self.headers.get("Authorization")))
                if name == "block":
                    toy.release.wait(30)
                out = json.dumps({"jsonrpc": "2.0", "id": body.get("id"), "result": {
                    "content": [], "structuredContent": {"tool": name, "arguments": args}}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.servers = [{"type": "http", "name": "toy", "url": f"http://127.0.0.1:{self.httpd.server_port}/mcp",
                         "headers": [{"name": "Authorization", "value": "Bearer tok-1"}]}]

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def toy_mcp():
    toy = ToyMcp()
    yield toy
    toy.close()


@pytest.fixture
def start_agent(tmp_path):
    procs = []

    def start(**env):
        procs.append(AgentProcess({"SCRIPTED_AGENT_STATE": str(tmp_path / "state"),
                                   "SCRIPTED_AGENT_LOG": str(tmp_path / "log.jsonl"), **env}))
        return procs[-1]

    yield start
    for p in procs:
        p.proc.kill()
        p.proc.wait()


def test_plain_prompt_streams_reply_and_is_logged(start_agent, tmp_path):
    """A plain prompt streams the hello reply in 3 chunks, ends the turn and is logged."""
    agent = start_agent()
    sid = agent.new_session()
    result, updates = agent.call("session/prompt", agent.prompt_params(sid, "hi"))
    assert result["result"] == {"stopReason": "end_turn"}
    assert len(updates) == 3 and agent_text(updates) == "Hello from scripted agent. You said: hi"
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert sum(e["dir"] == "in" and e["msg"].get("method") == "session/prompt" for e in log) == 1


def test_cancel_stops_slow_prompt(start_agent):
    """session/cancel during a SLOW prompt resolves it promptly as cancelled."""
    agent = start_agent(SCRIPTED_AGENT_CHUNK_DELAY="0.05")
    sid = agent.new_session()
    rid = agent.request("session/prompt", agent.prompt_params(sid, "SLOW:1000"))
    agent.read_until(lambda m: m.get("method") == "session/update")
    agent.send({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": sid}})
    msgs = agent.read_until(lambda m: m.get("id") == rid, timeout=2.0)
    assert msgs[-1]["result"] == {"stopReason": "cancelled"}
    assert len(msgs) < 50


def test_permission_request_is_answered(start_agent):
    """ASK_PERMISSION waits for the client's answer and reports the chosen option."""
    agent = start_agent()
    sid = agent.new_session()
    rid = agent.request("session/prompt", agent.prompt_params(sid, "ASK_PERMISSION"))
    ask = agent.read_until(lambda m: m.get("method") == "session/request_permission")[-1]
    assert [o["kind"] for o in ask["params"]["options"]] == ["allow_once", "allow_always", "reject_once"]
    agent.send({"jsonrpc": "2.0", "id": ask["id"],
                "result": {"outcome": {"outcome": "selected", "optionId": "allow-always"}}})
    msgs = agent.read_until(lambda m: m.get("id") == rid)
    assert msgs[-1]["result"] == {"stopReason": "end_turn"}
    assert agent_text(msgs) == "permission granted: allow-always"


def test_question_is_answered(start_agent):
    """ASK_QUESTION sends grok's _x.ai/ask_user_question and replies with the answers it got;
    BACKGROUND first sends an x.ai/task_backgrounded notification."""
    agent = start_agent()
    sid = agent.new_session()
    rid = agent.request("session/prompt", agent.prompt_params(sid, "BACKGROUND ASK_QUESTION"))
    seen = agent.read_until(lambda m: m.get("method") == "_x.ai/ask_user_question")
    assert any(m.get("method") == "x.ai/task_backgrounded" for m in seen)
    ask = seen[-1]
    assert [q["question"] for q in ask["params"]["questions"]] == ["Which color?", "Which sizes?"]
    agent.send({"jsonrpc": "2.0", "id": ask["id"], "result": {
        "outcome": "accepted", "answers": {"Which color?": "red"}, "annotations": {}}})
    msgs = agent.read_until(lambda m: m.get("id") == rid)
    assert msgs[-1]["result"] == {"stopReason": "end_turn"}
    assert agent_text(msgs) == 'answered: {"Which color?":"red"}'


def test_instruction_block_is_not_prompt_text(start_agent):
    """A block of t3's orchestration instructions is left out of the scripted prompt text."""
    agent = start_agent()
    sid = agent.new_session()
    params = {"sessionId": sid, "prompt": [
        {"type": "text", "text": "<t3_code_orchestration_instructions>\nFAIL\n"
                                 "</t3_code_orchestration_instructions>"},
        {"type": "text", "text": "ECHO_PROMPT"}]}
    result, updates = agent.call("session/prompt", params)
    assert result["result"] == {"stopReason": "end_turn"} and agent_text(updates) == "ECHO_PROMPT"


def test_load_replays_history_in_new_process(start_agent):
    """A second agent process replays a session's history on session/load."""
    first = start_agent()
    sid = first.new_session()
    first.call("session/prompt", first.prompt_params(sid, "ECHO_CWD"))
    first.proc.stdin.close()
    assert first.proc.wait(5) == 0
    second = start_agent()
    second.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    result, replay = second.call("session/load", {"sessionId": sid, "cwd": "/srv", "mcpServers": []})
    assert "error" not in result
    assert agent_text(replay, "user_message_chunk") == "ECHO_CWD" and agent_text(replay) == "/tmp"
    _, updates = second.call("session/prompt", second.prompt_params(sid, "ECHO_CWD"))
    assert agent_text(updates) == "/srv"


def test_tool_calls_run_in_order_and_are_logged(start_agent, tmp_path, toy_mcp):
    """Each CALL_TOOL line is one call, in order, with the session's headers; trigger words in the
    arguments are inert; ECHO_PROMPT adds the prompt; every call is logged as a "mcp" line."""
    agent = start_agent()
    sid = agent.new_session(mcp_servers=toy_mcp.servers)
    text = 'CALL_TOOL echo {"n": 1}\nCALL_TOOL echo {"n": 2, "prompt": "SLOW:500 FAIL"}\nECHO_PROMPT'
    result, updates = agent.call("session/prompt", agent.prompt_params(sid, text))
    assert result["result"] == {"stopReason": "end_turn"}
    assert agent_text(updates) == ('TOOL_RESULT: {"tool":"echo","arguments":{"n":1}}\n'
                                   'TOOL_RESULT: {"tool":"echo","arguments":{"n":2,"prompt":"SLOW:500 FAIL"}}\n'
                                   + text)
    assert [(m["params"]["update"]["sessionUpdate"], m["params"]["update"]["status"]) for m in updates
            if "tool_call" in m["params"]["update"]["sessionUpdate"]] == [
        ("tool_call", "pending"), ("tool_call_update", "completed")] * 2
    assert [toy_mcp.calls.get_nowait() for _ in range(2)] == [
        ("echo", {"n": 1}, "Bearer tok-1"), ("echo", {"n": 2, "prompt": "SLOW:500 FAIL"}, "Bearer tok-1")]
    logged = mcp_log(tmp_path / "log.jsonl")  # written before the call's result reaches the turn
    assert [(e["sessionId"], e["tool"], e["arguments"], e["httpStatus"], e["isError"], e["error"])
            for e in logged] == [(sid, "echo", {"n": 1}, 200, False, None),
                                 (sid, "echo", {"n": 2, "prompt": "SLOW:500 FAIL"}, 200, False, None)]
    assert logged[0]["result"] == {"tool": "echo", "arguments": {"n": 1}}
    assert logged[0]["startedAt"] <= logged[0]["endedAt"] <= logged[1]["startedAt"]


def test_cancel_during_tool_call_and_delayed_call(start_agent, tmp_path, toy_mcp):
    """session/cancel ends a prompt waiting for a tool at once (the call is logged when it ends);
    DELAYED_CALL ends the turn at once and makes its call later in the background."""
    agent = start_agent()
    sid = agent.new_session(mcp_servers=toy_mcp.servers)
    rid = agent.request("session/prompt", agent.prompt_params(sid, "CALL_TOOL block {}\nCALL_TOOL echo {}"))
    assert toy_mcp.calls.get(timeout=5)[0] == "block"
    agent.send({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": sid}})
    msgs = agent.read_until(lambda m: m.get("id") == rid, timeout=2.0)
    assert msgs[-1]["result"] == {"stopReason": "cancelled"}
    assert msgs[-2]["params"]["update"]["status"] == "failed"

    result, updates = agent.call("session/prompt", agent.prompt_params(sid, 'DELAYED_CALL 0.01 echo {"late": 1}'))
    assert result["result"] == {"stopReason": "end_turn"} and agent_text(updates) == "scheduled 1 call(s)"
    assert toy_mcp.calls.get(timeout=5) == ("echo", {"late": 1}, "Bearer tok-1")  # not the cancelled "echo {}"
    toy_mcp.release.set()
    logged = wait_until(lambda: len(entries := mcp_log(tmp_path / "log.jsonl")) == 2 and entries, 5.0)
    assert sorted((e["tool"], e["result"]["arguments"]) for e in logged) == [("block", {}), ("echo", {"late": 1})]
    assert toy_mcp.calls.empty()
