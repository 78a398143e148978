"""Test harness: run `t3.py` as a real process and talk to it the way outside clients do.

Contract (SPEC 1.1, 5.2, 9): started with `--port 0`, the server writes `<data-dir>/server.json` and
prints one stderr line naming the MCP URL when ready; MCP is Streamable HTTP with the bearer token
from `<data-dir>/client-token`. Nothing is mocked: tests drive processes, files and sockets. No
sleeps as synchronisation: a condition with no event to wait on goes through `wait_until`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import anyio
import httpx2
import mcp_types
from anyio.from_thread import start_blocking_portal
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

__all__ = ["REPO", "T3_PY", "ACP_AGENT", "ServerStartError", "T3Server", "Progress", "ToolResult", "McpClient",
           "mcp_session", "RawResponse", "raw_request", "raw_post", "wait_until", "agent_log", "count_prompts",
           "output_problems", "mcp_results", "protocol_log",
           "scripted_provider", "write_config", "pids_alive", "processes_matching", "kill_matching", "child_pids",
           "process_group", "start_time", "leaked_processes", "describe_process", "KEPT_MARKERS",
           "CountingIds"]

REPO = Path(__file__).resolve().parent.parent
T3_PY = REPO / "t3.py"
ACP_AGENT = REPO / "tests" / "acp_agent.py"
READY_LINE = re.compile(r"https?://\S+/mcp\b")
T = TypeVar("T")


class ServerStartError(RuntimeError):
    """The server exited or stayed silent before it was ready; the message carries its stderr."""


# ---------------------------------------------------------------- the server process

class _Pump(threading.Thread):
    """Drains one pipe into `lines` (so the child never blocks on a full pipe); notifies `cond`."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines, self.eof, self.cond = stream, list[str](), False, threading.Condition()
        self.start()

    def run(self) -> None:
        for line in self.stream:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def text(self) -> str:
        with self.cond:
            return "".join(self.lines)


@dataclass
class _Run:
    proc: subprocess.Popen[str]  # t3, or the `wrap` command running it
    stderr: _Pump
    stdout: _Pump
    pid: int = 0  # t3's own pid, from server.json


_JSON_EXTRACT = re.compile(r"json_extract\(\s*([\w.]+)\s*,\s*'\$\.([\w.]+)'\s*\)")


def _pg_json(column: str, key: str) -> str:
    from store_pg import _json  # the store's own rule for json_extract on PostgreSQL
    return _json(column, key)


class T3Server:
    """One `t3.py` server on a data dir; `restart()` runs it again on the same dir and config.
    Its own session (`start_new_session`), so `kill9()` hits the server and nothing else. With
    `wrap` (e.g. an strace command line) t3 runs as that command's child; signals go to t3 itself."""

    def __init__(self, data_dir: Path, config: Path, *, script: Path = T3_PY, env: Mapping[str, str] | None = None,
                 args: Sequence[str] = (), startup_timeout: float = 30.0, wrap: Sequence[str] = ()) -> None:
        self.data_dir, self.config, self.script = Path(data_dir), Path(config), Path(script)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.args, self.startup_timeout, self.wrap = list(args), startup_timeout, list(wrap)
        self.info: dict[str, Any] = {}  # server.json of the current run
        self._runs: list[_Run] = []
        self._clients: list[McpClient] = []

    @property
    def database(self) -> str | None:
        """The PostgreSQL URL its `--database` names, or None: its SQLite file in the data dir."""
        return self.args[self.args.index("--database") + 1] if "--database" in self.args else None

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one read on the server's database: its SQLite file, read-only, or the PostgreSQL
        database `database` names. Portable SQL: `?` placeholders; `json_extract(column,
        '$.key')` as store_pg writes it there (text: a JSON true reads 'true' there, 1 here)."""
        return self._run_sql(sql, params, write=False)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run one write (portable SQL, as `rows`) on the server's database and commit it: a test
        standing in for what an older t3 stored, or a row lost while the server was down."""
        self._run_sql(sql, params, write=True)

    def _run_sql(self, sql: str, params: Sequence[Any], *, write: bool) -> list[tuple[Any, ...]]:
        if self.database is not None:
            import psycopg
            sql = _JSON_EXTRACT.sub(lambda m: _pg_json(m[1], m[2]), sql)
            if params:  # psycopg's placeholders; a literal % (LIKE 'x%') is then written %%
                sql = sql.replace("%", "%%").replace("?", "%s")
            with psycopg.connect(self.database) as conn:  # commits as the block ends
                conn.read_only = not write
                cursor = conn.execute(sql, params or None)
                return [tuple(r) for r in cursor] if cursor.description else []
        import sqlite3
        uri = f"file:{self.data_dir / 't3.sqlite'}{'' if write else '?mode=ro'}"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db, db:  # commits as it ends
            return [tuple(r) for r in db.execute(sql, params)]

    def start(self) -> T3Server:
        """Start; return once the ready line is out and server.json names this process."""
        if self.running:
            raise RuntimeError("server already running")
        cmd = [*self.wrap, sys.executable, str(self.script), "--port", "0", "--data-dir", str(self.data_dir),
               "--config", str(self.config), *self.args]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, encoding="utf-8", errors="replace", env=self.env, cwd=self.data_dir.parent,
                                start_new_session=True)
        run = _Run(proc, _Pump(proc.stderr), _Pump(proc.stdout))
        self._runs.append(run)
        deadline = time.monotonic() + self.startup_timeout
        announced = lambda: any(READY_LINE.search(line) for line in run.stderr.lines)  # noqa: E731
        with run.stderr.cond:
            run.stderr.cond.wait_for(lambda: announced() or run.stderr.eof, timeout=self.startup_timeout)
        if not announced():
            self._fail_start(run, "exited before it was ready" if run.stderr.eof else "was not ready in time")
        try:  # server.json is written before the line, but one left by a killed run names another pid
            self.info = wait_until(lambda: self._own_info(run), max(1.0, deadline - time.monotonic()), interval=0.02)
        except TimeoutError:
            self._fail_start(run, "announced its URL but wrote no server.json with its pid")
        run.pid = int(self.info["pid"])
        for c in self._clients:  # a session to the previous process is dead even if the port is reused
            c.reset()
        return self

    def _own_info(self, run: _Run) -> dict[str, Any] | None:
        if run.proc.poll() is not None:
            self._fail_start(run, "exited after announcing its URL")
        with contextlib.suppress(OSError, ValueError):
            info = json.loads((self.data_dir / "server.json").read_text())
            pid = info.get("pid")
            ours = pid == run.proc.pid or (bool(self.wrap) and isinstance(pid, int)
                                           and (_state_and_ppid(pid) or ("", 0))[1] == run.proc.pid)
            return info if ours else None
        return None

    def _fail_start(self, run: _Run, what: str) -> None:
        if run.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)  # t3 and a `wrap` command around it
        run.proc.wait(10)
        run.stderr.join(2)
        raise ServerStartError(f"t3 {what} (exit {run.proc.returncode}); stderr:\n{run.stderr.text()}")

    def stop(self, *, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Send `sig`, wait up to `timeout` s, then SIGKILL; returns the exit code."""
        if not self._runs:
            return None
        run = self._runs[-1]
        if run.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.pid or run.proc.pid, sig)
            try:
                run.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(10)
        # all the server wrote is in the pipe now; a provider that inherited the pipe may keep it
        # open past the server's exit, so the (daemon) pumps get a short grace, not a wait for EOF
        run.stderr.join(1)
        run.stdout.join(1)
        return run.proc.returncode

    def kill9(self) -> None:
        """SIGKILL the server process only (its providers' process groups survive, as in a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self._runs[-1].proc.wait(10)

    def restart(self) -> T3Server:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Close the clients made by `client()`, then stop."""
        for c in self._clients:
            c.close()
        self.stop()

    def client(self, *, mode: str = "auto") -> McpClient:
        """An MCP client with the client token that follows this server across restarts."""
        self._clients.append(McpClient(lambda: self.mcp_url, self.token, mode=mode))
        return self._clients[-1]

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `python t3.py ARGS --data-dir <dir>`, e.g. `cli("token")`."""
        return subprocess.run([sys.executable, str(self.script), *args, "--data-dir", str(self.data_dir)],
                              capture_output=True, text=True, env=self.env, timeout=timeout)

    @property
    def pid(self) -> int:
        """t3's pid (not the `wrap` command's)."""
        run = self._runs[-1]
        return run.pid or run.proc.pid

    @property
    def running(self) -> bool:
        return bool(self._runs) and self._runs[-1].proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._runs[-1].proc.poll() if self._runs else None

    @property
    def url(self) -> str:
        return str(self.info["url"])

    @property
    def mcp_url(self) -> str:
        return str(self.info["mcpUrl"])

    @property
    def token(self) -> str:
        return (self.data_dir / "client-token").read_text().strip()

    def stderr_text(self) -> str:
        """All stderr captured so far, from every run of this server."""
        return "".join(r.stderr.text() for r in self._runs)

    def stdout_text(self) -> str:
        return "".join(r.stdout.text() for r in self._runs)


# ---------------------------------------------------------------- MCP client for sync tests

class Progress(NamedTuple):
    progress: float
    total: float | None
    message: str | None


@dataclass(frozen=True, slots=True)
class ToolResult:
    structured: dict[str, Any] | None  # structuredContent
    is_error: bool
    text: str | None  # the first text content
    raw: mcp_types.CallToolResult
    progress: list[Progress] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.is_error

    @property
    def failure_code(self) -> str | None:
        """`code` of a typed failure ({"_tag": "OrchestratorMcpFailure", ...}), else None."""
        s = self.structured
        return s.get("code") if self.is_error and s and s.get("_tag") == "OrchestratorMcpFailure" else None


@contextlib.asynccontextmanager
async def mcp_session(url: str, token: str, mode: str = "auto") -> AsyncIterator[Client]:
    """One SDK `Client` session on its own HTTP connection pool, for async code (McpClient
    wraps it for sync code; bench/p7_clients.py runs 50 of them on one event loop)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            yield client


class McpClient:
    """The SDK `Client` for sync code: an anyio blocking portal (an event loop in a thread) keeps
    one session open and reconnects when the URL changes. A refused connection raises from the
    first call: the SDK drops the HTTP status, so a 401 is `MCPError(-32603, "Server returned an
    error response")` (unwrapped here from its ExceptionGroups); `raw_post` shows the real 401."""

    def __init__(self, url: str | Callable[[], str], token: str, *, mode: str = "auto") -> None:
        self._url = url if callable(url) else (lambda: url)
        self._token, self._mode, self._lock = token, mode, threading.Lock()
        self._portal_cm: Any = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._session: tuple[Any, Client, str] | None = None  # (context manager, client, url)

    def _ensure(self) -> Client:
        with self._lock:
            url = self._url()
            if self._session is not None and self._session[2] == url:
                return self._session[1]
            self._close_session()
            cm = self._portal.wrap_async_context_manager(mcp_session(url, self._token, self._mode))
            try:
                self._session = (cm, cm.__enter__(), url)
            except BaseExceptionGroup as group:
                leaf: BaseException = group
                while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
                    leaf = leaf.exceptions[0]
                raise leaf from group
            return self._session[1]

    def _close_session(self) -> None:
        if self._session is not None:
            cm, self._session = self._session[0], None
            with contextlib.suppress(Exception):  # the server may be gone already
                cm.__exit__(None, None, None)

    def reset(self) -> None:
        """Drop the session; the next call connects afresh."""
        with self._lock:
            self._close_session()

    def close(self) -> None:
        with self._lock:
            self._close_session()
            portal_cm, self._portal_cm = self._portal_cm, None
            if portal_cm is not None:
                portal_cm.__exit__(None, None, None)

    def __enter__(self) -> McpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _call(self, client: Client, tool: str, args: dict[str, Any] | None, timeout: float,
                    on_progress: Callable[[Progress], None] | None) -> ToolResult:
        seen: list[Progress] = []

        async def record(progress: float, total: float | None, message: str | None) -> None:
            seen.append(Progress(progress, total, message))
            on_progress(seen[-1])  # type: ignore[misc]  # only passed when on_progress is set

        with anyio.fail_after(timeout):  # cancelling disconnects the request, as real clients do
            r = await client.call_tool(tool, args or {}, progress_callback=record if on_progress else None)
        text = next((c.text for c in r.content if isinstance(c, mcp_types.TextContent)), None)
        return ToolResult(r.structured_content, bool(r.is_error), text, r, seen)

    def call(self, tool: str, args: dict[str, Any] | None = None, *, timeout: float = 60.0,
             on_progress: Callable[[Progress], None] | None = None) -> ToolResult:
        """Call a tool. Raises TimeoutError after `timeout` s, MCPError on a protocol error. With
        `on_progress` a progress token is sent and notifications also land in `result.progress`."""
        return self._portal.call(self._call, self._ensure(), tool, args, timeout, on_progress)

    def call_with_progress(self, tool: str, args: dict[str, Any] | None = None,
                           on_progress: Callable[[Progress], None] = lambda p: None, *,
                           timeout: float = 60.0) -> ToolResult:
        return self.call(tool, args, timeout=timeout, on_progress=on_progress)

    def submit(self, tool: str, args: dict[str, Any] | None = None, *, timeout: float = 60.0,
               on_progress: Callable[[Progress], None] | None = None) -> Future[ToolResult]:
        """Start a call without waiting for it (e.g. a `t3_thread_wait` while another call sends)."""
        return self._portal.start_task_soon(self._call, self._ensure(), tool, args, timeout, on_progress)

    def list_tools(self) -> list[str]:
        return [t.name for t in self.tools()]

    def tools(self) -> list[mcp_types.Tool]:
        """tools/list: the tools with their schemas, as the server publishes them."""
        return list(self._portal.call(self._ensure().list_tools).tools)


# ---------------------------------------------------------------- raw HTTP, waiting, logs

class RawResponse(NamedTuple):
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
                *, timeout: float = 30.0) -> RawResponse:
    """One HTTP request with urllib; error statuses are returned, not raised."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return RawResponse(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as e:
        return RawResponse(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def raw_post(url: str, body: bytes, headers: Mapping[str, str] | None = None, *, timeout: float = 30.0) -> RawResponse:
    return raw_request("POST", url, body, headers, timeout=timeout)


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, *, interval: float = 0.05,
               message: str | None = None) -> T:
    """Poll `predicate` until it returns something truthy (returned), else raise TimeoutError.
    Only for conditions with no event to wait on, such as another process writing a file."""
    deadline, pause = time.monotonic() + timeout, threading.Event()
    while not (value := predicate()):
        if (left := deadline - time.monotonic()) <= 0:
            raise TimeoutError(f"not true within {timeout} s: {message or getattr(predicate, '__name__', predicate)}")
        pause.wait(min(interval, left))
    return value


def agent_log(path: Path) -> list[dict[str, Any]]:
    """The scripted agent's JSONL log ({"pid", "dir": "in"|"out", "msg"}), minus a half-written line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


def output_problems(tool: str, structured: Any, *, is_error: bool) -> list[str]:
    """How a tool's structuredContent departs from what tools.py declares for it: the tool's
    success shape, or for an error the typed failure's (and either way the published
    outputSchema); [] when it fits exactly. An unknown tool has only the failure shape."""
    return [f"{tool}: {e.message} at /{'/'.join(map(str, e.absolute_path))}"
            for validator in _output_validators(tool, is_error)
            for e in validator.iter_errors(structured)]


@functools.cache
def _output_validators(tool: str, is_error: bool) -> tuple[Any, ...]:
    import jsonschema
    import tools  # the repository's module (tests run from its root)
    declared = next((t for t in tools.TOOLS if t.name == tool), None)
    exact = tools.FAILURE_OUTPUT if is_error or declared is None else declared.output_schema
    schemas = [exact] if declared is None else [exact, tools.published_output(declared)]
    return tuple(jsonschema.Draft202012Validator(s) for s in schemas)


def mcp_results(tmp_path: Path) -> list[dict[str, Any]]:
    """Every MCP call the scripted agents logged under `tmp_path` that got an answer. Only the
    lines that can be such calls are decoded: a streaming test logs hundreds of thousands."""
    found = []
    for log in sorted(Path(tmp_path).glob("agent*.log")):
        with open(log, encoding="utf-8") as f:
            found += [json.loads(line) for line in f
                      if '"dir": "mcp"' in line and line.endswith("\n")]
    return [e for e in found if e.get("dir") == "mcp" and e.get("error") is None]


def protocol_log(path: Path) -> str:
    """The text of a provider protocol log (`logs/provider-<id>.log.gz`, or a rotated one) as far
    as it was flushed: a log still open, or cut by a kill -9, lacks the gzip trailer, and that is
    not an error here."""
    return zlib.decompressobj(wbits=31).decompress(path.read_bytes()).decode()


def count_prompts(path: Path) -> int:
    return sum(e.get("dir") == "in" and e.get("msg", {}).get("method") == "session/prompt" for e in agent_log(path))


# ---------------------------------------------------------------- configuration

def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, Path)):
        return json.dumps(str(v))  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(v, Mapping):
        key = lambda k: k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)  # noqa: E731
        return "{ " + ", ".join(f"{key(k)} = {_toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, Iterable):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def scripted_provider(tmp_path: Path, *, id: str = "scripted", args: Sequence[str] = (),
                      env: Mapping[str, str] | None = None, chunk_delay: float = 0.05,
                      models: Sequence[Any] = ("scripted-1", "scripted-2"), **extra: Any) -> dict[str, Any]:
    """A `[[providers]]` entry running tests/acp_agent.py (extra ACP agent args in `args`). It logs
    to `<tmp>/agent.log` for the default id, else `<tmp>/agent-<id>.log`."""
    log = tmp_path / ("agent.log" if id == "scripted" else f"agent-{id}.log")
    return {"id": id, "driver": "acp",
            "command": [sys.executable, str(ACP_AGENT), "--state-dir", str(tmp_path / "agent-state"), *args],
            "env": {"SCRIPTED_AGENT_LOG": str(log), "SCRIPTED_AGENT_CHUNK_DELAY": str(chunk_delay), **(env or {})},
            "models": list(models), **extra}


def write_config(tmp_path: Path, *, providers: Sequence[Mapping[str, Any]] | None = None,
                 projects: Sequence[Mapping[str, Any]] | None = None, extra: str = "",
                 name: str = "t3.toml") -> Path:
    """Write `<tmp>/<name>`: project "proj" on `<tmp>/workspace`, the scripted provider, then `extra`."""
    if projects is None:
        (tmp_path / "workspace").mkdir(exist_ok=True)
        projects = [{"id": "proj", "path": str(tmp_path / "workspace"), "title": "Test project"}]
    providers = [scripted_provider(tmp_path)] if providers is None else providers
    tables = [f"[[{table}]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in entry.items())
              for table, entries in (("projects", projects), ("providers", providers)) for entry in entries]
    path = tmp_path / name
    path.write_text("\n".join([*tables, extra]), encoding="utf-8")
    return path


# ---------------------------------------------------------------- processes (Linux /proc)

def _state_and_ppid(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]  # the command name may hold spaces and ")"
    return state, int(ppid)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def process_group(pid: int) -> int | None:
    return int(fields[2]) if (fields := _stat(pid)) else None


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (with the pid, it names one process)."""
    return int(fields[19]) if (fields := _stat(pid)) else None


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def pids_alive(pids: Iterable[int]) -> list[int]:
    """The pids that still exist and are not zombies."""
    return [p for p in pids if (s := _state_and_ppid(p)) is not None and s[0] not in "ZX"]


def child_pids(parent: int | None = None) -> list[int]:
    """Live direct children of `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    return pids_alive(p for p in _all_pids() if (s := _state_and_ppid(p)) is not None and s[1] == parent)


class CountingIds:
    """A deterministic id source for `orchestrator.decide`: ``prefix:1``, ``prefix:2``, ..."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}:{self.n}"


# Markers of processes that a module-scoped fixture keeps across its tests on purpose (the agents of
# the in-process fuzz target): a test in which one of them starts has not leaked it.
KEPT_MARKERS: set[str] = set()


def processes_matching(marker: str) -> list[int]:
    """Live processes other than this one whose command line or environment contains `marker`."""
    found = []
    for pid in _all_pids():
        with contextlib.suppress(OSError):
            blob = Path(f"/proc/{pid}/cmdline").read_bytes() + b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
            if marker.encode() in blob and pid != os.getpid():
                found.append(pid)
    return pids_alive(found)


def kill_matching(marker: str, *, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process matching `marker`, wait until they are gone, return their pids."""
    pids = processes_matching(marker)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pids_alive(pids), timeout, message=f"killed processes {pids} gone")
    return pids


def leaked_processes(marker: str, *, groups: Mapping[int, int] | None = None,
                     exclude: Iterable[int] = ()) -> list[int]:
    """Live processes carrying `marker` in their command line or environment, or in one of
    `groups` ({process group id: its leader's start time}) and started after that leader (so a
    reused group id is not taken for a recorded one). This process and `exclude` are left out."""
    found = set(processes_matching(marker))
    recorded = dict(groups or {})
    for pid in pids_alive(_all_pids()) if recorded else []:
        group, started = process_group(pid), start_time(pid)
        if group is None or group not in recorded or started is None or started < recorded[group]:
            continue
        leader_started = start_time(group)
        if leader_started is None or leader_started == recorded[group]:
            found.add(pid)
    return sorted(found - {os.getpid(), *exclude})


def describe_process(pid: int) -> str:
    """`<pid> <command line>`, for a report."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmdline = "?"
    return f"{pid} {cmdline.strip()[:300]}"
