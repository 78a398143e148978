"""providers.py: provider adapters over asyncio subprocesses, one protocol each, behind one interface.

An adapter is built per configured provider instance from ``build_adapter``. It reports what it is
(``info``: models, capabilities, whether it can run and why not) and opens sessions: a session is
one provider process serving one app thread. A session turns its protocol into the domain's
adapter events (``orchestrator.TextDelta``, ``ToolUpdate``, ``RuntimeRequestOpened``,
``TurnEnded``...) on ``session.events`` (an asyncio queue; ``None`` = the process is gone, with
``session.exit_reason``).

Process rules: every provider process starts in its own process group (``start_new_session``)
and asks the kernel to kill it if t3 dies (``PR_SET_PDEATHSIG``); it carries ``T3_OWNER`` in its
environment so a restarted server can find and kill what a killed one left (``kill_orphans``).
Stop = close stdin, wait, SIGTERM the group, wait, SIGKILL the group: no grandchild survives.
Raw protocol traffic goes to rotating files under ``<data-dir>/logs/`` with credentials redacted;
never to SQLite.

Drivers here: ``acp`` (JSON-RPC 2.0 over stdio NDJSON: gemini --acp, claude-agent-acp,
codex-acp, ...). Other drivers of the design are listed as unavailable until built.
This module never touches the database and imports only the domain's types.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import logging
import logging.handlers
import os
import re
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator import (Capabilities, McpEndpoint, PlanUpdate, ProviderInfo, ReasoningDelta,
                          RuntimeRequestOpened, TextDelta, ToolUpdate, TurnEnded)

__all__ = ["DRIVERS", "ProviderConfig", "AcpAdapter", "UnavailableAdapter", "build_adapter",
           "detect_providers", "kill_orphans", "redact"]

log = logging.getLogger("t3.providers")

DRIVERS = ("codex", "claudeAgent", "acp", "acpRegistry", "grok", "pi", "opencode")
_DEFAULT_COMMANDS = {"codex": ["codex", "app-server"],
                     "claudeAgent": ["claude", "-p", "--input-format", "stream-json",
                                     "--output-format", "stream-json", "--verbose",
                                     "--permission-prompt-tool", "stdio"],
                     "grok": ["grok", "agent", "stdio"], "pi": ["pi", "--mode", "rpc"],
                     "opencode": ["opencode", "serve"]}
# Executables detected on PATH when the config declares no providers: (instance id, driver, command)
_DETECTABLE = (("codex", "codex", ["codex", "app-server"]),
               ("claude", "claudeAgent", _DEFAULT_COMMANDS["claudeAgent"]),
               ("gemini", "acp", ["gemini", "--acp"]),
               ("claude-agent-acp", "acp", ["claude-agent-acp"]),
               ("codex-acp", "acp", ["codex-acp"]),
               ("pi", "pi", ["pi", "--mode", "rpc"]),
               ("opencode", "opencode", ["opencode", "serve"]))

_LINE_LIMIT = 64 * 1024 * 1024


class ProviderConfig:
    """One ``[[providers]]`` entry, validated by t3.py."""

    def __init__(self, *, instance_id: str, driver: str, command: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, models: Sequence[Any] = (),
                 enabled: bool = True, display_name: str | None = None) -> None:
        if driver not in DRIVERS:
            raise ValueError(f"unknown driver {driver!r}")
        self.instance_id = instance_id
        self.driver = driver
        self.command = list(command) if command else list(_DEFAULT_COMMANDS.get(driver, []))
        self.env = dict(env or {})
        self.models = [m if isinstance(m, Mapping) else {"id": str(m)} for m in models]
        self.enabled = enabled
        self.display_name = display_name


def detect_providers() -> list[ProviderConfig]:
    found = []
    for instance_id, driver, command in _DETECTABLE:
        if shutil.which(command[0]):
            found.append(ProviderConfig(instance_id=instance_id, driver=driver, command=command))
    return found


_SECRET = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+|(\"(?:value|Authorization|authorization|"
                     r"token|bearer_token)\"\s*:\s*\")[^\"]*(\")")


def redact(text: str) -> str:
    """Blank out bearer tokens and Authorization values anywhere in a protocol line."""
    return _SECRET.sub(lambda m: (m.group(1) + "<redacted>") if m.group(1)
                       else m.group(2) + "<redacted>" + m.group(3), text)


def _protocol_log(log_dir: Path, instance_id: str) -> logging.Logger:
    logger = logging.getLogger(f"t3.protocol.{instance_id}")
    if not logger.handlers:
        log_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            log_dir / f"provider-{instance_id}.log", maxBytes=5 * 1024 * 1024, backupCount=3)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


# =============================================================================================
# Processes


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Process:
    """A provider subprocess in its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def spawn(cls, command: Sequence[str], *, cwd: str, env: Mapping[str, str]) -> _Process:
        proc = await asyncio.create_subprocess_exec(
            *command, cwd=cwd, env=dict(env), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, limit=_LINE_LIMIT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        return cls(proc)

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def stop(self, *, grace: float) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        if await self._exited_within(grace):
            self._kill_group(signal.SIGKILL)  # grandchildren that kept running
            return
        self._kill_group(signal.SIGTERM)
        if not await self._exited_within(2.0):
            self._kill_group(signal.SIGKILL)
            await self._exited_within(5.0)
        self._kill_group(signal.SIGKILL)

    async def _exited_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.proc.wait(), seconds)
            return True
        except TimeoutError:
            return False

    def _kill_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_orphans(owner: str) -> int:
    """Kill processes a previous t3 on this data directory started (found by ``T3_OWNER``)."""
    needle = f"T3_OWNER={owner}".encode() + b"\0"
    killed = 0
    proc_dir = Path("/proc")
    if not proc_dir.exists():
        return 0
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if needle in environ and f"T3_SERVER_PID={os.getpid()}\0".encode() not in environ:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


# =============================================================================================
# JSON-RPC 2.0 over stdio, one JSON object per line


class JsonRpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


class _JsonRpc:
    """Requests and notifications both ways over a process's stdin/stdout."""

    def __init__(self, process: _Process, *, protocol_log: logging.Logger, label: str,
                 on_request: Any, on_notification: Any, on_close: Any) -> None:
        self._process = process
        self._log = protocol_log
        self._label = label
        self._on_request = on_request
        self._on_notification = on_notification
        self._on_close = on_close
        self._ids = itertools.count(1)
        self._pending: dict[Any, asyncio.Future[Any]] = {}
        self._tasks = [asyncio.get_running_loop().create_task(self._read_stdout()),
                       asyncio.get_running_loop().create_task(self._read_stderr())]
        self.closed = False

    async def request(self, method: str, params: Mapping[str, Any], *,
                      timeout: float | None = None) -> Any:
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._send({"jsonrpc": "2.0", "id": request_id, "method": method,
                              "params": params})
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(request_id, None)

    async def notify(self, method: str, params: Mapping[str, Any]) -> None:
        await self._send({"jsonrpc": "2.0", "method": method, "params": params})

    async def respond(self, request_id: Any, result: Any = None, *,
                      error: JsonRpcError | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id}
        if error is not None:
            message["error"] = {"code": error.code, "message": str(error)}
        else:
            message["result"] = result
        await self._send(message)

    async def _send(self, message: Mapping[str, Any]) -> None:
        stdin = self._process.proc.stdin
        if self.closed or stdin is None or stdin.is_closing():
            raise ConnectionError(f"{self._label}: the provider process is not running")
        line = json.dumps(message, separators=(",", ":"))
        self._log.info("%s -> %s", self._label, redact(line))
        stdin.write(line.encode() + b"\n")
        await stdin.drain()

    async def _read_stdout(self) -> None:
        stdout = self._process.proc.stdout
        assert stdout is not None
        try:
            while True:
                raw = await stdout.readline()
                if not raw:
                    break
                line = raw.decode(errors="replace").strip()
                if not line:
                    continue
                self._log.info("%s <- %s", self._label, redact(line))
                try:
                    message = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("%s: ignoring a line that is not JSON", self._label)
                    continue
                if isinstance(message, dict):
                    await self._route(message)
        except (ConnectionError, ValueError) as exc:  # ValueError: a line over the limit
            log.warning("%s: stopped reading: %s", self._label, exc)
        finally:
            self.closed = True
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the provider process exited"))
            returncode = await self._process.proc.wait()
            await self._on_close(returncode)

    async def _route(self, message: dict[str, Any]) -> None:
        if "method" in message and "id" in message:
            asyncio.get_running_loop().create_task(self._serve(message))
        elif "method" in message:
            await self._on_notification(message["method"], message.get("params") or {})
        elif "id" in message:
            future = self._pending.get(message["id"])
            if future is None or future.done():
                return
            if "error" in message and message["error"] is not None:
                err = message["error"]
                future.set_exception(JsonRpcError(err.get("code", -32603),
                                                  err.get("message", "error"), err.get("data")))
            else:
                future.set_result(message.get("result"))

    async def _serve(self, message: dict[str, Any]) -> None:
        try:
            result = await self._on_request(message["id"], message["method"],
                                            message.get("params") or {})
            if result is not _DEFERRED:
                await self.respond(message["id"], result)
        except JsonRpcError as exc:
            await self.respond(message["id"], error=exc)
        except ConnectionError:
            pass

    async def _read_stderr(self) -> None:
        stderr = self._process.proc.stderr
        assert stderr is not None
        while True:
            raw = await stderr.readline()
            if not raw:
                return
            self._log.info("%s stderr %s", self._label, redact(raw.decode(errors="replace")
                                                              .rstrip()))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


_DEFERRED = object()  # a request handler that answers later through respond()


# =============================================================================================
# ACP


_STOP_STATUS = {"end_turn": "completed", "max_tokens": "completed",
                "max_turn_requests": "completed", "refusal": "completed",
                "cancelled": "interrupted"}
_TOOL_KIND_TO_REQUEST = {"execute": "command", "edit": "file-change", "delete": "file-change",
                         "move": "file-change", "read": "file-read"}


class AcpSession:
    """One ACP agent process serving one app thread (one ACP session)."""

    def __init__(self, *, adapter: AcpAdapter, process: _Process, runtime_mode: str) -> None:
        self._adapter = adapter
        self._process = process
        self._runtime_mode = runtime_mode
        self.pid: int | None = process.pid
        self.native_thread_ref: str | None = None
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.exit_reason: str | None = None
        self.agent_capabilities: Mapping[str, Any] = {}
        self._loading = False
        self._prompt_task: asyncio.Task[None] | None = None
        self._permissions: dict[str, tuple[Any, list[Mapping[str, Any]]]] = {}
        self._closing = False
        self.rpc = _JsonRpc(process, protocol_log=adapter.protocol_log,
                            label=f"{adapter.info.instance_id}[{process.pid}]",
                            on_request=self._on_request, on_notification=self._on_notification,
                            on_close=self._on_close)

    def alive(self) -> bool:
        return self._process.alive() and not self.rpc.closed

    # -- opening -------------------------------------------------------------------------------

    async def open(self, *, cwd: str, model: str | None, interaction_mode: str,
                   resume_ref: str | None, mcp: McpEndpoint | None) -> None:
        init = await self.rpc.request("initialize", {
            "protocolVersion": 1,
            "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False},
                                   "terminal": False},
            "clientInfo": {"name": "t3", "version": "0.1.0"}}, timeout=60)
        self.agent_capabilities = (init or {}).get("agentCapabilities") or {}
        servers = []
        if mcp is not None and (self.agent_capabilities.get("mcpCapabilities") or {}).get("http"):
            # ACP's injection: an http MCP server with headers as name/value pairs.
            servers.append({"type": "http", "name": mcp.name, "url": mcp.url,
                            "headers": [{"name": k, "value": v} for k, v in mcp.headers.items()]})
        elif mcp is not None:
            log.info("%s does not take http MCP servers; t3's tools are not injected",
                     self._adapter.info.instance_id)
        session: Mapping[str, Any] | None = None
        if resume_ref and self.agent_capabilities.get("loadSession"):
            self._loading = True  # history replayed by session/load is not a new turn
            try:
                session = await self.rpc.request("session/load", {
                    "sessionId": resume_ref, "cwd": cwd, "mcpServers": servers}, timeout=120)
                self.native_thread_ref = resume_ref
            except JsonRpcError as exc:
                log.warning("session/load of %s failed (%s); starting a new session",
                            resume_ref, exc)
            finally:
                self._loading = False
        if self.native_thread_ref is None:
            session = await self.rpc.request("session/new", {"cwd": cwd, "mcpServers": servers},
                                             timeout=120)
            self.native_thread_ref = (session or {}).get("sessionId")
            if not self.native_thread_ref:
                raise JsonRpcError(-32603, "session/new returned no sessionId")
        await self._apply_mode_and_model(session or {}, model, interaction_mode)

    async def _apply_mode_and_model(self, session: Mapping[str, Any], model: str | None,
                                    interaction_mode: str) -> None:
        modes = (session.get("modes") or {}).get("availableModes") or []
        if interaction_mode == "plan" and any(m.get("id") == "plan" for m in modes):
            await self._optional("session/set_mode", {"sessionId": self.native_thread_ref,
                                                      "modeId": "plan"})
        models = session.get("models") or {}
        available = {m.get("modelId") for m in models.get("availableModels") or []}
        if model and model in available and model != models.get("currentModelId"):
            await self._optional("session/set_model", {"sessionId": self.native_thread_ref,
                                                       "modelId": model})

    async def _optional(self, method: str, params: Mapping[str, Any]) -> None:
        try:
            await self.rpc.request(method, params, timeout=30)
        except JsonRpcError as exc:
            log.info("%s not applied: %s", method, exc)

    # -- turns -----------------------------------------------------------------------------------

    async def start_turn(self, text: str) -> None:
        if self._prompt_task is not None and not self._prompt_task.done():
            raise RuntimeError("a turn is already running on this session")
        self._prompt_task = asyncio.get_running_loop().create_task(self._prompt(text))

    async def _prompt(self, text: str) -> None:
        try:
            result = await self.rpc.request("session/prompt", {
                "sessionId": self.native_thread_ref, "prompt": [{"type": "text", "text": text}]})
        except JsonRpcError as exc:
            await self.events.put(TurnEnded("failed", f"The agent failed the turn: {exc}"))
            return
        except ConnectionError:
            return  # the process is gone; the closed queue tells the orchestrator
        reason = (result or {}).get("stopReason", "end_turn")
        await self.events.put(TurnEnded(_STOP_STATUS.get(reason, "completed")))

    async def steer_turn(self, text: str) -> None:
        raise RuntimeError("ACP agents cannot steer a running turn")

    async def interrupt_turn(self) -> None:
        # ACP: the client answers every pending permission request "cancelled" and sends
        # session/cancel; the prompt then resolves with stopReason "cancelled".
        for native_ref in list(self._permissions):
            await self._answer(native_ref, {"outcome": {"outcome": "cancelled"}})
        try:
            await self.rpc.notify("session/cancel", {"sessionId": self.native_thread_ref})
        except ConnectionError:
            pass

    async def respond(self, native_ref: str, decision: str | None,
                      answers: Mapping[str, Any] | None) -> None:
        if native_ref not in self._permissions:
            raise RuntimeError(f"no pending permission request {native_ref} on this session")
        _, options = self._permissions[native_ref]
        await self._answer(native_ref, _permission_outcome(decision, options))

    async def _answer(self, native_ref: str, result: Mapping[str, Any]) -> None:
        request_id, _ = self._permissions.pop(native_ref)
        try:
            await self.rpc.respond(request_id, result)
        except ConnectionError:
            pass

    async def close(self, *, grace: float = 3.0) -> None:
        self._closing = True
        await self._process.stop(grace=grace)

    # -- incoming --------------------------------------------------------------------------------

    async def _on_request(self, request_id: Any, method: str, params: Mapping[str, Any]) -> Any:
        if method != "session/request_permission":
            raise JsonRpcError(-32601, f"t3 does not offer {method}")
        tool = params.get("toolCall") or {}
        options = list(params.get("options") or [])
        if self._runtime_mode in ("full-access", "auto") or (
                self._runtime_mode == "auto-accept-edits" and tool.get("kind") == "edit"):
            return _permission_outcome("accept", options)  # this mode never asks the user
        native_ref = str(request_id)
        self._permissions[native_ref] = (request_id, options)
        await self.events.put(RuntimeRequestOpened(
            native_ref=native_ref,
            request_kind=_TOOL_KIND_TO_REQUEST.get(tool.get("kind", ""), "permission"),
            title=tool.get("title") or "Permission requested",
            detail={"toolCall": tool, "options": options}))
        return _DEFERRED

    async def _on_notification(self, method: str, params: Mapping[str, Any]) -> None:
        if method != "session/update" or self._loading:
            return
        update = params.get("update") or {}
        kind = update.get("sessionUpdate")
        content = update.get("content") or {}
        if kind == "agent_message_chunk" and content.get("type") == "text":
            await self.events.put(TextDelta(content.get("text", "")))
        elif kind == "agent_thought_chunk" and content.get("type") == "text":
            await self.events.put(ReasoningDelta(content.get("text", "")))
        elif kind in ("tool_call", "tool_call_update"):
            await self.events.put(ToolUpdate(
                native_id=str(update.get("toolCallId")), status=update.get("status") or "running",
                title=update.get("title"), tool_kind=update.get("kind"),
                input=update.get("rawInput"), output=_tool_output(update)))
        elif kind == "plan":
            await self.events.put(PlanUpdate(entries=list(update.get("entries") or [])))

    async def _on_close(self, returncode: int) -> None:
        self.exit_reason = None if self._closing else \
            f"The provider process exited unexpectedly (exit code {returncode})."
        self._permissions.clear()
        await self.events.put(None)


def _permission_outcome(decision: str | None, options: Sequence[Mapping[str, Any]]
                        ) -> Mapping[str, Any]:
    wanted = {"accept": ("allow_once", "allow_always"),
              "acceptForSession": ("allow_always", "allow_once"),
              "decline": ("reject_once", "reject_always")}.get(decision or "cancel", ())
    for kind in wanted:
        for option in options:
            if option.get("kind") == kind:
                return {"outcome": {"outcome": "selected", "optionId": option.get("optionId")}}
    return {"outcome": {"outcome": "cancelled"}}


def _tool_output(update: Mapping[str, Any]) -> str | None:
    texts = []
    for block in update.get("content") or []:
        inner = block.get("content") if isinstance(block, Mapping) else None
        if isinstance(inner, Mapping) and inner.get("type") == "text":
            texts.append(inner.get("text", ""))
    if texts:
        return "\n".join(texts)
    raw = update.get("rawOutput")
    if raw is None:
        return None
    return raw if isinstance(raw, str) else json.dumps(raw)


class AcpAdapter:
    """Any ACP agent started by command."""

    CAPABILITIES = Capabilities(supports_interrupt=True, supports_active_steering=False,
                                supports_steering_by_restart=True, supports_queued_messages=True,
                                supports_resume=True, supports_mcp=True)

    def __init__(self, config: ProviderConfig, *, log_dir: Path, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.protocol_log = _protocol_log(log_dir, config.instance_id)
        constraints = []
        if not config.enabled:
            constraints.append("disabled in the configuration")
        if not config.command:
            constraints.append("no command configured")
        elif not _resolvable(config.command[0]):
            constraints.append(f"executable not found: {config.command[0]}")
        self.info = ProviderInfo(instance_id=config.instance_id, driver=config.driver,
                                 display_name=config.display_name, models=config.models,
                                 capabilities=self.CAPABILITIES, available=not constraints,
                                 constraints=tuple(constraints))

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None) -> AcpSession:
        if not self.info.available:
            raise RuntimeError(f"provider {self.info.instance_id} cannot run: "
                               + "; ".join(self.info.constraints))
        env = {**os.environ, **self.config.env, "T3_OWNER": self.owner,
               "T3_SERVER_PID": str(os.getpid()), "T3_THREAD_ID": thread_id}
        process = await _Process.spawn(self.config.command, cwd=cwd, env=env)
        session = AcpSession(adapter=self, process=process, runtime_mode=runtime_mode)
        try:
            await session.open(cwd=cwd, model=model, interaction_mode=interaction_mode,
                               resume_ref=resume_ref, mcp=mcp)
        except BaseException:
            await session.close(grace=1.0)
            raise
        return session


class UnavailableAdapter:
    """A configured instance whose driver this t3 cannot run yet."""

    def __init__(self, config: ProviderConfig, reason: str) -> None:
        self.info = ProviderInfo(instance_id=config.instance_id, driver=config.driver,
                                 display_name=config.display_name, models=config.models,
                                 capabilities=Capabilities(), available=False,
                                 constraints=(reason,))

    async def open_session(self, **_: Any) -> Any:
        raise RuntimeError(f"provider {self.info.instance_id} cannot run: "
                           + "; ".join(self.info.constraints))


def _resolvable(executable: str) -> bool:
    return shutil.which(executable) is not None or (os.path.isabs(executable)
                                                    and os.access(executable, os.X_OK))


def build_adapter(config: ProviderConfig, *, log_dir: Path, owner: str) -> Any:
    if config.driver == "acp":
        return AcpAdapter(config, log_dir=log_dir, owner=owner)
    return UnavailableAdapter(config, f"the {config.driver} driver is not built into this "
                                      "version of t3 yet")
