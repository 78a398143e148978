#!/usr/bin/env python3
"""Scripted ACP agent: a fast, deterministic stand-in for an ACP agent CLI in tests.

Speaks ACP (JSON-RPC 2.0, one JSON object per line) on stdin/stdout; stdout carries only
protocol lines, diagnostics go to stderr. What a `session/prompt` does depends on trigger words
in its text (case-sensitive tokens; see below for their order and combinations):

  CRASH                one chunk "about to crash", then exit code 3 without answering
  KILL_SELF            one chunk "about to die", then SIGKILL to itself (death by a signal)
  HALF_LINE            write the first half of a JSON line (no newline) to stdout, exit code 4
  ORPHAN               start a grandchild that ignores SIGTERM and keeps stdout open for 600 s
                       (its pid is logged as {"pid", "dir": "grandchild", "grandchildPid"}),
                       one chunk "leaving a grandchild", then exit code 5
  HANG                 ignore SIGTERM and block forever (nothing is answered any more)
  FAIL                 one chunk "failing now", then JSON-RPC error -32603 "scripted failure"
  THINK / PLAN         modifiers: an agent_thought_chunk / a plan update, then the reply below
  DELAYED_CALL s name {..}   (a whole line) schedule an MCP tool call in the background, made
                       s seconds (float) later with the session's first http MCP server and its
                       headers as they are then (a later session/load may change them), for as long
                       as the process lives; its outcome is only logged (no turn). Line
                       "scheduled <n> call(s)"
  CALL_TOOL name {..}  (a whole line; each such line is one call, run in order) call an MCP tool on
                       the session's first http MCP server (rest of the line: JSON arguments), each
                       in a tool_call / tool_call_update pair; one line per call, "TOOL_RESULT:
                       <compact JSON of structuredContent, else the text content>" or "TOOL_ERROR:
                       <message, with the HTTP status if there was one>". A session/cancel ends
                       the prompt at once (the HTTP request finishes in its thread and is logged)
  ECHO_PROMPT          one line with the exact prompt text (text blocks joined by "\n")
  ASK_PERMISSION       tool_call + session/request_permission; the reply depends on the answer
  ASK_QUESTION         grok's `_x.ai/ask_user_question` request with QUESTIONS (a single-choice
                       "Which color?" and a multi-select "Which sizes?"); an accepted answer is
                       replied as "answered: <compact JSON of its answers, keys sorted>", a
                       cancelled one as "question cancelled" with stopReason "cancelled"
  BACKGROUND           modifier: a grok `x.ai/task_backgrounded` notification first
  DETACH               start a grandchild in a session of its own (out of the agent's process group,
                       so stopping the agent does not reach it) that sleeps 600 s with the agent's
                       environment (pid logged as {"pid", "dir": "detached", "detachedPid"}); line
                       "left a detached process"
  SLOW[:n]             n chunks "chunk <i> " (default 40), SCRIPTED_AGENT_CHUNK_DELAY seconds
                       apart (default 0.05), then "done"; session/cancel stops it at once
  FAST:n[:w]           n tiny chunks as fast as possible (throughput benchmarks); with w, each
                       chunk padded with dots to w characters
  TOOLS:n              n completed tool calls "step <i>" as fast as possible (one timeline item
                       each: long threads), then the line "ran <n> tools"
  PACED:n:w:s          n chunks spread evenly over s seconds (float), each "<i>@<time.time() at
                       its send, 4 decimals> " padded with dots to w characters: a reader of the
                       text can tell when each chunk left the agent
  WRITE_FILE path text (a whole line) write "text\n" (a literal \n in it is a line break) to path,
                       relative to the session cwd (parent folders made); line "wrote <path>"
  DELETE_FILE path     (a whole line) delete path, relative to the session cwd; line "deleted <path>"
  ECHO_CWD             reply with the session cwd
  ECHO_MCP             reply with the session's mcpServers, header values redacted
  ECHO_ENV             reply with the agent's environment as JSON (keys sorted)
  (none of the above)  "Hello from scripted agent. You said: <text>" in 3 chunks

A prompt that starts with `<t3_title_request>` (t3's title regeneration) is answered only with
"Scripted title: <the first 3 words after its first blank line>", or, if it holds the word
NO_TITLE, with JSON-RPC error -32603 (t3 then falls back to a title of its own).

A prompt runs these steps in the order listed: CRASH/KILL_SELF/HALF_LINE/ORPHAN/HANG/FAIL end it;
THINK/PLAN/BACKGROUND add updates; DETACH; then the DELAYED_CALL lines (scheduled), the CALL_TOOL
lines, the WRITE_FILE / DELETE_FILE lines, the ECHO_PROMPT line; then at most one of ASK_PERMISSION, ASK_QUESTION, SLOW, FAST, TOOLS, PACED, ECHO_CWD,
ECHO_MCP, ECHO_ENV (first found), and the hello reply only when nothing else replied. Outputs of
different steps are separated by "\n". Trigger words are looked for
outside the CALL_TOOL / DELAYED_CALL lines, so a call's JSON arguments (e.g. a prompt for another
agent) never trigger anything here. A prompt's text blocks are joined by "\n"; a block that is
t3's orchestration instructions (it starts with `<t3_code_orchestration_instructions>`) is left out
of the prompt text (the log keeps every block). A call line is `[spaces]CALL_TOOL <name> [json]` or
`[spaces]DELAYED_CALL <seconds> <name> [json]`; other lines with these words are plain text.

Env SCRIPTED_AGENT_FAIL_STARTS=FILE:N makes the first N processes sharing FILE (a counter) exit
with code 7 on `initialize` (a provider that fails to start, then recovers).
Env SCRIPTED_AGENT_LINGER_S=S: at stdin EOF, log {"dir": "eof"} and exit only S seconds later
(an agent slow to stop).
Env SCRIPTED_AGENT_AUTH=mcp-only refuses a session/new without MCP servers with ACP's
auth_required (-32000 "Authentication required"): what a logged-out agent says to t3's probe,
while t3's own sessions (which carry its MCP server) still open.
Options: --state-dir DIR (default $SCRIPTED_AGENT_STATE, else /tmp/scripted-acp-agent) holds one
history file per session for session/load; --no-load hides loadSession and refuses session/load;
--fork advertises sessionCapabilities.fork and answers session/fork {sessionId, cwd, mcpServers}
with a new session that has a copy of that session's history.
Env SCRIPTED_AGENT_LOG=FILE appends one JSON line per message received/sent, {"pid", "dir":
"in"|"out", "msg"} (raw, header values included), and one per MCP tool call when it ends (immediate,
cancelled or delayed): {"pid", "dir": "mcp", "sessionId", "tool", "arguments", "httpStatus" (int or
null), "isError", "result" (structuredContent, else text, else null), "error" (str or null),
"startedAt", "endedAt" (time.time())}.
A session/cancel ends the running prompt and any queued ones received before it as "cancelled".
MCP calls speak Streamable HTTP (protocol version 2025-06-18; JSON or SSE responses; a stateful
server gets an initialize first), each in its own thread, with a 700 s socket timeout.
Verified by hand against mcp 2.3.0 servers: MCPServer over uvicorn (stateless and stateful, JSON
and SSE responses) and the low-level Server with StreamableHTTPSessionManager(stateless=True,
json_response=False) on hypercorn (several calls per turn, DELAYED_CALL, cancel mid-call).
"""
import argparse, asyncio, fcntl, itertools, json, os, re, signal, subprocess, sys, tempfile, threading, time
import urllib.error, urllib.request, uuid
from dataclasses import dataclass, field

MODES = {"currentModeId": "default", "availableModes": [
    {"id": "default", "name": "Default"}, {"id": "plan", "name": "Plan"}]}
MODELS = {"currentModelId": "scripted-1", "availableModels": [
    {"modelId": "scripted-1", "name": "Scripted 1"}, {"modelId": "scripted-2", "name": "Scripted 2"}]}
QUESTIONS = [
    {"question": "Which color?", "header": "Color", "multiSelect": False,
     "options": [{"label": "red", "description": "warm"}, {"label": "blue", "description": "cool"}]},
    {"question": "Which sizes?", "header": "Sizes", "multiSelect": True,
     "options": [{"label": "S"}, {"label": "M"}, {"label": "L"}]}]
INSTRUCTIONS_TAG = "<t3_code_orchestration_instructions>"
TITLE_TAG = "<t3_title_request>"
PERMISSION_OPTIONS = [
    {"optionId": "allow-once", "name": "Allow", "kind": "allow_once"},
    {"optionId": "allow-always", "name": "Always allow", "kind": "allow_always"},
    {"optionId": "reject-once", "name": "Reject", "kind": "reject_once"}]
MCP_VERSION = "2025-06-18"
MCP_TIMEOUT = 700.0  # per socket operation; t3's waits last up to 600 s
CALL_LINE = re.compile(r"[ \t]*CALL_TOOL[ \t]+(\S+)[ \t]*(.*?)\s*")
FILE_LINE = re.compile(r"[ \t]*(WRITE_FILE|DELETE_FILE)[ \t]+(\S+)[ \t]?(.*)")
DELAYED_LINE = re.compile(r"[ \t]*DELAYED_CALL[ \t]+(\d+(?:\.\d*)?|\.\d+)[ \t]+(\S+)[ \t]*(.*?)\s*")


def log(*parts):
    print("scripted-acp-agent:", *parts, file=sys.stderr, flush=True)


def has_word(text, word):
    return re.search(rf"(?<!\w){word}(?!\w)", text) is not None


class RpcError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code, self.message = code, message


class McpError(Exception):
    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status  # the HTTP status of the failing response, if there was one


def parse_calls(text):
    """-> ([(tool, raw_args)], [(seconds, tool, raw_args)], text without those lines, and
    [(WRITE_FILE | DELETE_FILE, path, text)])."""
    calls, delayed, rest, files = [], [], [], []
    for line in text.split("\n"):
        if m := CALL_LINE.fullmatch(line):
            calls.append((m[1], m[2]))
        elif m := FILE_LINE.fullmatch(line):
            files.append((m[1], m[2], m[3]))
        elif m := DELAYED_LINE.fullmatch(line):
            delayed.append((float(m[1]), m[2], m[3]))
        else:
            rest.append(line)
    return calls, delayed, "\n".join(rest), files


@dataclass
class Session:
    cwd: str
    mcp_servers: list
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # FIFO queue of prompts
    running: asyncio.Task | None = None
    cancels: int = 0  # bumped by session/cancel; prompts received before it are cancelled


class Turn:
    """Sends the session/update notifications of one prompt and collects its agent text."""

    def __init__(self, agent, session_id):
        self.agent, self.session_id = agent, session_id
        self.parts = []  # joined on demand: `str +=` on an attribute copies, quadratic for FAST:n
        self.new_line = False  # the next agent text starts a new line

    @property
    def text(self):
        return "".join(self.parts)

    def line(self, text):
        """Agent text on a line of its own."""
        self.new_line = any(self.parts)
        self.chunk(text)

    def update(self, update):
        self.agent.notify("session/update", {"sessionId": self.session_id, "update": update})

    def chunk(self, text, kind="agent_message_chunk"):
        if kind == "agent_message_chunk":
            if self.new_line:
                text, self.new_line = "\n" + text, False
            self.parts.append(text)
        self.update({"sessionUpdate": kind, "content": {"type": "text", "text": text}})

    def tool_call(self, call_id, title, raw_input):
        self.update({"sessionUpdate": "tool_call", "toolCallId": call_id, "title": title,
                     "kind": "execute", "status": "pending", "rawInput": raw_input})

    def tool_done(self, call_id, ok, raw_output, text):
        self.update({"sessionUpdate": "tool_call_update", "toolCallId": call_id,
                     "status": "completed" if ok else "failed", "rawOutput": raw_output,
                     "content": [{"type": "content", "content": {"type": "text", "text": text}}]})


class Agent:
    def __init__(self, state_dir, load_enabled, fork_enabled=False):
        self.state_dir, self.load_enabled, self.fork_enabled = state_dir, load_enabled, fork_enabled
        self.out = sys.stdout.buffer
        sys.stdout = sys.stderr  # a stray print() must never corrupt the protocol stream
        path = os.environ.get("SCRIPTED_AGENT_LOG")
        self.log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.sessions: dict[str, Session] = {}
        self.pending: dict[int, asyncio.Future] = {}  # our own requests awaiting an answer
        self.ids = itertools.count(1)
        self.tasks = set()

    # ---- wire ----
    def trace(self, direction, msg):
        self.write_log({"pid": os.getpid(), "dir": direction, "msg": msg})

    def write_log(self, entry):
        if self.log_fd is not None:  # one write() per line: complete even if we are killed
            os.write(self.log_fd, (json.dumps(entry) + "\n").encode())  # also from MCP threads

    def spawn(self, coro):
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def send(self, msg):
        self.trace("out", msg)
        try:
            self.out.write(json.dumps(msg).encode() + b"\n")
            self.out.flush()
        except OSError:  # client went away
            os._exit(0)

    def notify(self, method, params):
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def request(self, method, params):
        rid = next(self.ids)
        self.pending[rid] = fut = asyncio.get_running_loop().create_future()
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        try:
            return await fut
        finally:
            self.pending.pop(rid, None)

    async def run(self):
        loop, lines = asyncio.get_running_loop(), asyncio.Queue()

        def reader():  # a thread, so any kind of stdin (pipe, file, pty) works
            for line in sys.stdin.buffer:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=reader, daemon=True).start()
        while (line := await lines.get()) is not None:
            if line.strip():
                self.receive(line)
        if linger := float(os.environ.get("SCRIPTED_AGENT_LINGER_S", "0")):
            self.trace("eof", None)
            time.sleep(linger)
        os._exit(0)  # stdin EOF: running prompts (and MCP worker threads) die with us

    def receive(self, line):
        try:
            msg = json.loads(line)
            assert isinstance(msg, dict)
        except (ValueError, AssertionError):
            log("ignoring malformed line:", line[:200])
            return
        self.trace("in", msg)
        method = msg.get("method")
        if method is None:  # an answer to one of our requests
            fut = self.pending.get(msg.get("id"))
            if fut is None or fut.done():
                log("ignoring response to unknown request", msg.get("id"))
            elif "error" in msg:
                err = msg["error"] or {}
                fut.set_exception(RpcError(err.get("code", -32603), err.get("message", "error")))
            else:
                fut.set_result(msg.get("result") or {})
        elif "id" not in msg:  # a notification
            s = self.sessions.get((msg.get("params") or {}).get("sessionId"))
            if method == "session/cancel" and s:
                s.cancels += 1
                if s.running:
                    s.running.cancel()
            elif method != "session/cancel":
                log("ignoring notification", method)
        else:  # a request; a prompt remembers the cancel count now, in case it has to queue
            params = msg.get("params") or {}
            s = self.sessions.get(params.get("sessionId"))
            self.spawn(self.handle(msg["id"], method, params, s.cancels if s else 0))

    async def handle(self, rid, method, params, ticket):
        handlers = {"initialize": self.initialize, "session/new": self.new_session,
                    "session/load": self.load_session, "session/set_mode": self.set_option,
                    **({"session/fork": self.fork_session} if self.fork_enabled else {}),
                    "session/set_model": self.set_option}
        try:
            if method == "session/prompt":
                result = await self.prompt(params, ticket)
            elif method in handlers:
                result = await handlers[method](params)
            else:
                raise RpcError(-32601, f"Method not found: {method}")
            self.send({"jsonrpc": "2.0", "id": rid, "result": result})
        except RpcError as e:
            self.send({"jsonrpc": "2.0", "id": rid, "error": {"code": e.code, "message": e.message}})
        except Exception as e:  # a bug here must not kill the agent
            log(f"{method} failed: {e!r}")
            self.send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32603, "message": repr(e)}})

    # ---- session bookkeeping ----
    def session(self, params):
        sid = params.get("sessionId")
        if sid not in self.sessions:
            raise RpcError(-32602, f"Unknown session {sid}")
        return sid, self.sessions[sid]

    def history_path(self, sid):
        if not isinstance(sid, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", sid):
            return None
        return os.path.join(self.state_dir, f"{sid}.json")

    def save(self, sid, role=None, text=None):
        path = self.history_path(sid)
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            data = {"sessionId": sid, "messages": []}
        data["cwd"] = self.sessions[sid].cwd
        if role:
            data["messages"].append({"role": role, "text": text})
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    # ---- methods ----
    async def initialize(self, params):
        if failing_start():
            log("failing this start on purpose")
            os._exit(7)
        return {"protocolVersion": 1, "agentCapabilities": {
                    "loadSession": self.load_enabled,
                    "promptCapabilities": {"image": False, "embeddedContext": False},
                    "mcpCapabilities": {"http": True, "sse": False},
                    **({"sessionCapabilities": {"fork": {}}} if self.fork_enabled else {})},
                "authMethods": [], "agentInfo": {"name": "scripted-acp-agent", "version": "1.0"}}

    async def new_session(self, params):
        if os.environ.get("SCRIPTED_AGENT_AUTH") == "mcp-only" and not params.get("mcpServers"):
            raise RpcError(-32000, "Authentication required")
        sid = str(uuid.uuid4())
        self.sessions[sid] = Session(params.get("cwd", ""), params.get("mcpServers") or [])
        self.save(sid)
        return {"sessionId": sid, "modes": MODES, "models": MODELS}

    async def load_session(self, params):
        if not self.load_enabled:
            raise RpcError(-32601, "Method not found: session/load")
        sid, path = params.get("sessionId"), self.history_path(params.get("sessionId"))
        if path is None or not os.path.exists(path):
            raise RpcError(-32602, f"Unknown session {sid}")
        with open(path) as f:
            data = json.load(f)
        cwd, servers = params.get("cwd") or data.get("cwd", ""), params.get("mcpServers") or []
        if sid in self.sessions:  # reloaded in the same process: keep its prompt queue
            self.sessions[sid].cwd, self.sessions[sid].mcp_servers = cwd, servers
        else:
            self.sessions[sid] = Session(cwd, servers)
        turn = Turn(self, sid)
        for m in data["messages"]:
            turn.chunk(m["text"], "user_message_chunk" if m["role"] == "user" else "agent_message_chunk")
        return {"modes": MODES, "models": MODELS}

    async def fork_session(self, params):
        path = self.history_path(params.get("sessionId"))
        if path is None or not os.path.exists(path):
            raise RpcError(-32602, f"Unknown session {params.get('sessionId')}")
        with open(path) as f:
            messages = json.load(f)["messages"]
        sid = str(uuid.uuid4())
        self.sessions[sid] = Session(params.get("cwd", ""), params.get("mcpServers") or [])
        self.save(sid)
        for m in messages:
            self.save(sid, m["role"], m["text"])
        return {"sessionId": sid, "modes": MODES, "models": MODELS}

    async def set_option(self, params):
        self.session(params)
        return {}

    async def prompt(self, params, ticket):
        sid, s = self.session(params)
        text = "\n".join(b.get("text", "") for b in params.get("prompt", [])
                         if b.get("type") == "text" and not b.get("text", "").startswith(INSTRUCTIONS_TAG))
        async with s.lock:  # one prompt at a time per session; later ones wait here
            if s.cancels != ticket:  # cancelled while still queued
                return {"stopReason": "cancelled"}
            s.running = asyncio.current_task()
            self.save(sid, "user", text)
            turn = Turn(self, sid)
            try:
                return {"stopReason": await self.script(turn, s, text)}
            except asyncio.CancelledError:
                if s.cancels == ticket:  # not a session/cancel: let it propagate
                    raise
                asyncio.current_task().uncancel()
                return {"stopReason": "cancelled"}
            finally:
                s.running = None
                if turn.text:
                    self.save(sid, "agent", turn.text)

    async def script(self, t, s, text):
        if text.startswith(TITLE_TAG):  # t3's title request: the quoted message triggers nothing
            if has_word(text, "NO_TITLE"):
                raise RpcError(-32603, "scripted: no title")
            t.chunk("Scripted title: " + " ".join(text.split("\n\n", 1)[-1].split()[:3]))
            return "end_turn"
        calls, delayed, rest, files = parse_calls(text)  # triggers are words of `rest`
        if has_word(rest, "CRASH"):
            t.chunk("about to crash")
            os._exit(3)
        if has_word(rest, "KILL_SELF"):
            t.chunk("about to die")
            os.kill(os.getpid(), signal.SIGKILL)
        if has_word(rest, "HALF_LINE"):
            half = json.dumps({"jsonrpc": "2.0", "method": "session/update", "params": {
                "sessionId": t.session_id, "update": {"sessionUpdate": "agent_message_chunk"}}})
            self.out.write(half[:len(half) // 2].encode())
            self.out.flush()
            os._exit(4)
        if has_word(rest, "ORPHAN"):
            child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
                                     stdin=subprocess.DEVNULL)  # inherits stdout and stderr
            self.write_log({"pid": os.getpid(), "dir": "grandchild", "grandchildPid": child.pid})
            t.chunk("leaving a grandchild")
            os._exit(5)
        if has_word(rest, "HANG"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            log("hanging forever")
            while True:
                time.sleep(3600)  # blocks the event loop on purpose: nothing is answered
        if has_word(rest, "FAIL"):
            t.chunk("failing now")
            raise RpcError(-32603, "scripted failure")
        if has_word(rest, "THINK"):
            t.chunk("thinking about it", "agent_thought_chunk")
        if has_word(rest, "PLAN"):
            t.update({"sessionUpdate": "plan", "entries": [
                {"content": "Look at the request", "priority": "medium", "status": "pending"},
                {"content": "Answer it", "priority": "medium", "status": "pending"}]})
        if has_word(rest, "BACKGROUND"):
            self.notify("x.ai/task_backgrounded", {"sessionId": t.session_id, "taskId": "task-1"})
        if has_word(rest, "DETACH"):
            child = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
            self.write_log({"pid": os.getpid(), "dir": "detached", "detachedPid": child.pid})
            t.line("left a detached process")
        for delay, name, raw_args in delayed:
            self.spawn(self.delayed_call(t.session_id, s, delay, name, raw_args))
        if delayed:
            t.line(f"scheduled {len(delayed)} call(s)")
        for name, raw_args in calls:
            await self.call_tool(t, s, name, raw_args)
        for word, path, content in files:
            target = os.path.join(s.cwd, path)
            if word == "DELETE_FILE":
                os.unlink(target)
                t.line(f"deleted {path}")
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write(content.replace("\\n", "\n") + "\n")
            t.line(f"wrote {path}")
        if has_word(rest, "ECHO_PROMPT"):
            t.line(text)
        t.new_line = bool(t.text)
        if has_word(rest, "ASK_PERMISSION"):
            return await self.ask_permission(t)
        if has_word(rest, "ASK_QUESTION"):
            return await self.ask_question(t)
        if m := re.search(r"(?<!\w)SLOW(?::(\d+))?(?!\w)", rest):
            delay = float(os.environ.get("SCRIPTED_AGENT_CHUNK_DELAY", "0.05"))
            for i in range(int(m.group(1) or 40)):
                t.chunk(f"chunk {i} ")
                await asyncio.sleep(delay)  # a cancel lands here
            t.chunk("done")
        elif m := re.search(r"(?<!\w)FAST:(\d+)(?::(\d+))?", rest):
            width = int(m.group(2) or 0)
            for i in range(int(m.group(1))):
                t.chunk(f"{i} ".rjust(width, "."))
                if i % 256 == 255:
                    await asyncio.sleep(0)  # let a cancel in
        elif m := re.search(r"(?<!\w)TOOLS:(\d+)", rest):
            for i in range(int(m.group(1))):  # each call reported once, already completed
                t.update({"sessionUpdate": "tool_call", "toolCallId": f"step-{i}",
                          "title": f"step {i}", "kind": "execute", "status": "completed",
                          "rawInput": {"step": i}, "content": [{"type": "content", "content": {
                              "type": "text", "text": f"output {i}"}}]})
                if i % 128 == 127:
                    await asyncio.sleep(0)  # let a cancel in
            t.chunk(f"ran {m.group(1)} tools")
        elif m := re.search(r"(?<!\w)PACED:(\d+):(\d+):(\d+(?:\.\d+)?)", rest):
            n, width, seconds = int(m.group(1)), int(m.group(2)), float(m.group(3))
            start = time.monotonic()
            for i in range(n):
                if (wait := start + i * seconds / n - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # a cancel lands here
                t.chunk(f"{i}@{time.time():.4f} ".rjust(width, "."))
        elif has_word(rest, "ECHO_CWD"):
            t.chunk(s.cwd)
        elif has_word(rest, "ECHO_MCP"):
            t.chunk(json.dumps(redact_servers(s.mcp_servers)))
        elif has_word(rest, "ECHO_ENV"):
            t.chunk(json.dumps(dict(os.environ), sort_keys=True))
        elif not t.text:
            reply = f"Hello from scripted agent. You said: {text}"
            n = -(-len(reply) // 3)
            for i in range(3):
                t.chunk(reply[i * n:(i + 1) * n])
        return "end_turn"

    async def ask_permission(self, t):
        call_id = f"call-{uuid.uuid4().hex[:8]}"
        t.tool_call(call_id, "Run scripted command", {"command": "echo scripted"})
        answer = await self.request("session/request_permission", {
            "sessionId": t.session_id, "options": PERMISSION_OPTIONS,
            "toolCall": {"toolCallId": call_id, "title": "Run scripted command", "kind": "execute"}})
        outcome = answer.get("outcome") or {}
        if outcome.get("outcome") != "selected":
            return "cancelled"
        option = outcome.get("optionId", "")
        if option.startswith("allow"):
            t.tool_done(call_id, True, {"output": "scripted output"}, "scripted output")
            t.chunk(f"permission granted: {option}")
        else:
            t.tool_done(call_id, False, {"error": "rejected"}, "rejected by user")
            t.chunk("permission denied")
        return "end_turn"

    async def ask_question(self, t):
        answer = await self.request("_x.ai/ask_user_question", {
            "sessionId": t.session_id, "toolCallId": f"call-{uuid.uuid4().hex[:8]}",
            "questions": QUESTIONS, "mode": "default"})
        if answer.get("outcome") != "accepted":
            t.chunk("question cancelled")
            return "cancelled"
        t.chunk("answered: " + json.dumps(answer.get("answers"), sort_keys=True, separators=(",", ":")))
        return "end_turn"

    async def call_tool(self, t, s, name, raw_args):
        call_id = f"call-{uuid.uuid4().hex[:8]}"
        t.tool_call(call_id, f"mcp:{name}", {"tool": name, "arguments": raw_args})
        try:
            outcome = await self.mcp(t.session_id, s, name, raw_args)
        except asyncio.CancelledError:  # session/cancel: the request finishes in its thread
            t.tool_done(call_id, False, {"error": "cancelled"}, "cancelled")
            raise
        if outcome["error"] is not None:
            t.tool_done(call_id, False, {"error": outcome["error"]}, outcome["error"])
            t.line(f"TOOL_ERROR: {outcome['error']}")
        else:
            out = outcome["result"]
            out = out if isinstance(out, str) else json.dumps(out, separators=(",", ":"))
            t.tool_done(call_id, not outcome["isError"], outcome["raw"], out)
            t.line(f"TOOL_RESULT: {out}")

    async def delayed_call(self, sid, s, delay, name, raw_args):
        await asyncio.sleep(delay)
        await self.mcp(sid, s, name, raw_args)  # logged; nobody to tell

    def mcp(self, sid, s, name, raw_args):
        """Start one logged MCP tool call in a thread of its own (a call may wait for minutes, and
        a cancelled one keeps running); -> a future of the log entry plus "raw" (the MCP result)."""
        loop, servers = asyncio.get_running_loop(), s.mcp_servers
        fut = loop.create_future()

        def deliver(outcome):
            if not fut.done():
                fut.set_result(outcome)

        def work():
            outcome = self.mcp_logged(sid, servers, name, raw_args)
            try:
                loop.call_soon_threadsafe(deliver, outcome)
            except RuntimeError:  # the loop is gone
                pass

        threading.Thread(target=work, name=f"mcp-{name}", daemon=True).start()
        return fut

    def mcp_logged(self, sid, servers, name, raw_args):
        entry = {"pid": os.getpid(), "dir": "mcp", "sessionId": sid, "tool": name,
                 "arguments": raw_args, "httpStatus": None, "isError": True, "result": None,
                 "error": None, "startedAt": time.time(), "endedAt": None}
        raw = None
        try:
            try:
                entry["arguments"] = args = json.loads(raw_args) if raw_args else {}
            except ValueError as e:
                raise McpError(f"bad JSON arguments: {e}") from None
            server = next((x for x in servers if x.get("type") == "http" or "url" in x), None)
            if server is None:
                raise McpError("no http MCP server in this session")
            entry["httpStatus"], raw = mcp_call(server, name, args)
            if "structuredContent" in raw:
                entry["result"] = raw["structuredContent"]
            else:
                entry["result"] = "".join(c.get("text", "") for c in raw.get("content") or []
                                          if c.get("type") == "text")
            entry["isError"] = bool(raw.get("isError"))
        except McpError as e:
            entry["httpStatus"], entry["error"] = e.status, str(e)
        except Exception as e:  # timeouts while reading, broken streams, ...
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["endedAt"] = time.time()
        try:
            self.write_log(entry)
        except OSError as e:
            log(f"cannot log an MCP call: {e!r}")
        return {**entry, "raw": raw}


def failing_start():
    """SCRIPTED_AGENT_FAIL_STARTS=FILE:N: count this start in FILE; true for the first N."""
    spec = os.environ.get("SCRIPTED_AGENT_FAIL_STARTS")
    if not spec:
        return False
    path, limit = spec.rsplit(":", 1)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        count = len(f.read()) + 1
        f.write("x")
    return count <= int(limit)


def header_items(headers):
    """ACP gives headers as [{"name", "value"}]; accept a plain dict too."""
    if isinstance(headers, dict):
        return list(headers.items())
    return [(h.get("name", ""), h.get("value", "")) for h in headers or []]


def redact_servers(servers):
    redacted = []
    for srv in servers:
        srv = dict(srv)
        if "headers" in srv:
            srv["headers"] = [{"name": k, "value": "<redacted>"} for k, _ in header_items(srv["headers"])]
        redacted.append(srv)
    has_auth = any(k.lower() == "authorization" for srv in servers
                   for k, _ in header_items(srv.get("headers")))
    return {"mcpServers": redacted, "hasAuthorization": has_auth}


# ---- a minimal MCP Streamable HTTP client (runs in a worker thread) ----
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # tests talk to 127.0.0.1


def mcp_post(url, headers, body):
    """POST one JSON-RPC message; returns (status, response headers, error body, message)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        resp = _opener.open(req, timeout=MCP_TIMEOUT)
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode("utf-8", "replace")[:500]
        except Exception as read_error:
            text = f"(unreadable body: {read_error!r})"
        return e.code, e.headers, text, None
    except (urllib.error.URLError, OSError) as e:
        raise McpError(f"cannot reach {url}: {e}") from None
    with resp:
        try:
            return resp.status, resp.headers, "", read_body(resp, body)
        except McpError:
            raise
        except Exception as e:  # a read timeout, a broken stream, bad SSE data, ...
            raise McpError(f"HTTP {resp.status}: reading the response failed: {e!r}", resp.status) from None


def read_body(resp, body):
    if "id" not in body:
        return None
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        return read_sse(resp, body["id"], resp.status)
    raw = resp.read().decode("utf-8", "replace")
    try:
        return json.loads(raw)
    except ValueError:
        raise McpError(f"HTTP {resp.status}: response is not JSON: {raw[:200]}", resp.status) from None


def read_sse(resp, want_id, status):
    """Read SSE events until the JSON-RPC message with id want_id arrives."""
    data = []
    for raw in itertools.chain(resp, [b"\n"]):
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
        elif not line and data:
            msg, data = json.loads("\n".join(data)), []
            if isinstance(msg, dict) and msg.get("id") == want_id:
                return msg
    raise McpError(f"HTTP {status}: SSE stream ended without a response", status)


def mcp_call(server, tool, args):
    """-> (HTTP status of the tools/call response, its JSON-RPC result)."""
    url = server["url"]
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "mcp-protocol-version": MCP_VERSION, **dict(header_items(server.get("headers")))}
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": tool, "arguments": args}}
    status, resp_headers, body, msg = mcp_post(url, headers, call)
    if status == 400 and re.search(r"session|initiali[sz]", body, re.I):  # stateful server
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": MCP_VERSION, "capabilities": {},
            "clientInfo": {"name": "scripted-acp-agent", "version": "1.0"}}}
        status, resp_headers, body, msg = mcp_post(url, headers, init)
        if status >= 400:
            raise McpError(f"HTTP {status} on initialize: {body}", status)
        if resp_headers.get("mcp-session-id"):
            headers["mcp-session-id"] = resp_headers["mcp-session-id"]
        mcp_post(url, headers, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        status, resp_headers, body, msg = mcp_post(url, headers, call)
    if status >= 400:
        raise McpError(f"HTTP {status}: {body}", status)
    if not isinstance(msg, dict):
        raise McpError(f"HTTP {status}: no JSON-RPC response", status)
    if msg.get("error"):
        err = msg["error"]
        raise McpError(f"HTTP {status}: JSON-RPC error {err.get('code')}: {err.get('message')}", status)
    if not isinstance(msg.get("result"), dict):
        raise McpError(f"HTTP {status}: no result in response: {json.dumps(msg)[:200]}", status)
    return status, msg["result"]


def main():
    p = argparse.ArgumentParser(description="Scripted ACP agent for tests (see module docstring).")
    p.add_argument("--state-dir", default=os.environ.get("SCRIPTED_AGENT_STATE")
                   or os.path.join(tempfile.gettempdir(), "scripted-acp-agent"))
    p.add_argument("--no-load", action="store_true", help="do not support session/load")
    p.add_argument("--fork", action="store_true", help="support session/fork")
    args, unknown = p.parse_known_args()
    if unknown:
        log("ignoring arguments", unknown)
    os.makedirs(args.state_dir, exist_ok=True)
    asyncio.run(Agent(args.state_dir, not args.no_load, args.fork).run())


if __name__ == "__main__":
    main()
