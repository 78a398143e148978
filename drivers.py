"""drivers.py: each agent CLI's protocol; read the section of the driver you run.

A driver turns one CLI's protocol into the domain's adapter events, on the adapter and session
that providers.py defines (its process rules, protocol log and JSON-RPC framing hold for every
driver here): ``acp`` (JSON-RPC 2.0 over stdio NDJSON: gemini --acp, claude-agent-acp,
codex-acp, ...), ``grok`` (the same plus xAI's extensions), ``claudeAgent`` (claude -p
stream-json), ``codex`` (codex app-server), ``pi`` (pi --mode rpc) and ``opencode`` (opencode
serve, REST + SSE). Each delivers ``ORCHESTRATION_INSTRUCTIONS`` its own way to a session that
has t3's MCP server. t3.py builds the adapters from the driver table (``DRIVERS``,
``detect_providers``, ``build_adapter``); ``acpRegistry`` (an agent installed from an ACP
registry, then run as ``acp``) is registry.py's. The core never imports this module, and it
never touches the database.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from orchestrator import (Capabilities, McpEndpoint, PlanUpdate, ReasoningDelta,
                          RuntimeRequestOpened, TextDelta, ToolUpdate, parse_json)
from providers import (Adapter, DriverAdapter, DriverSession, JsonRpcError, ProviderConfig,
                       ProviderProcess, RpcSession, UnavailableAdapter, log, opened)

__all__ = ["DRIVERS", "DETECTABLE", "ORCHESTRATION_INSTRUCTIONS",
           "AcpAdapter", "GrokAdapter", "ClaudeAdapter", "CodexAdapter", "PiAdapter",
           "OpenCodeAdapter", "build_adapter", "detect_providers"]

# Drivers t3 knows of but cannot run: configured, they are listed unavailable with this.
_UNRUNNABLE = {
    "cursor": "Cursor runs only through its TypeScript SDK (@cursor/sdk); t3 has no Cursor CLI "
              "driver",
    "antigravity": "Antigravity has no agent CLI or protocol that t3 can drive",
    "opencode2": "OpenCode 2's server API is not supported by this t3 (driver opencode runs "
                 "opencode serve)"}
DRIVERS = ("codex", "claudeAgent", "acp", "acpRegistry", "grok", "pi", "opencode", *_UNRUNNABLE)
_DEFAULT_COMMANDS = {"codex": ["codex", "app-server"],
                     "claudeAgent": ["claude", "-p", "--input-format", "stream-json",
                                     "--output-format", "stream-json", "--verbose",
                                     "--permission-prompt-tool", "stdio"],
                     "grok": ["grok", "agent", "stdio"], "pi": ["pi", "--mode", "rpc"],
                     "opencode": ["opencode", "serve"]}
# Executables detected on PATH when the config declares no providers: (instance id, driver, command)
_DETECTABLE = (("codex", "codex", _DEFAULT_COMMANDS["codex"]),
               ("claude", "claudeAgent", _DEFAULT_COMMANDS["claudeAgent"]),
               ("gemini", "acp", ["gemini", "--acp"]),
               ("claude-agent-acp", "acp", ["claude-agent-acp"]),
               ("codex-acp", "acp", ["codex-acp"]),
               ("pi", "pi", _DEFAULT_COMMANDS["pi"]),
               ("opencode", "opencode", _DEFAULT_COMMANDS["opencode"]))
DETECTABLE = tuple(command[0] for _, _, command in _DETECTABLE)  # executables looked for

# What an agent with t3's MCP server is told about it, in t3's words. Each driver delivers
# it its own way: a system or developer prompt where the CLI has one, else a separate prompt block
# before the user's first prompt (ACP). Only sessions that have the MCP endpoint get it.
ORCHESTRATION_INSTRUCTIONS = """\
You are running inside t3, a server that orchestrates coding agents. Its MCP server "t3-code" \
gives you tools to hand work to other agents; your client may show their names with a prefix \
(for example mcp__t3-code__delegate_task).
- delegate_task: give one task to a child agent that t3 runs and records. Use it whenever you want \
a sub-agent, a worker, a reviewer or parallel help, on this provider or another one; make one call \
per child and write the whole task into it (the child does not see this conversation). With mode \
"async" (the default) it returns at once and t3 tells you when the task ends, so finish your turn \
instead of polling; with mode "wait" it returns the result, or the current state if the wait times \
out (the child keeps working). Keep the taskId it returns.
- task_status: the state and result of a task you delegated. task_cancel: stop a task you no \
longer need.
- orchestrator_capabilities: the provider instances, models and modes you may delegate to; use \
its ids in delegate_task's target. A child never gets broader permissions than you have.
- create_threads: start separate top-level threads, only when the user asks for such threads; \
they are not your sub-tasks.
Do not do work twice that you delegated, do not poll in a tight loop, and when you retry a call \
that failed or timed out, pass the same clientRequestId so the work starts only once."""


def detect_providers() -> list[ProviderConfig]:
    return [ProviderConfig(instance_id=instance_id, driver=driver, command=command)
            for instance_id, driver, command in _DETECTABLE if shutil.which(command[0])]


def build_adapter(config: ProviderConfig, *, log_dir: Path, owner: str) -> Adapter:
    """The adapter of one instance (``acpRegistry``'s is registry.py's, built by t3.py); one
    that names no command runs its driver's default command."""
    if config.driver in _UNRUNNABLE:
        return UnavailableAdapter(config, _UNRUNNABLE[config.driver])
    if config.driver not in _ADAPTERS:
        raise ValueError(f"driver {config.driver} is not built here")
    config.command = config.command or list(_DEFAULT_COMMANDS.get(config.driver, ()))
    return _ADAPTERS[config.driver](config, log_dir=log_dir, owner=owner)


def _instructions(config: ProviderConfig, mcp: McpEndpoint | None) -> str | None:
    """The orchestration instructions for a session, when it has t3's MCP server."""
    return ORCHESTRATION_INSTRUCTIONS if mcp is not None and config.instructions else None


def _texts(blocks: Iterable[Any] | None) -> list[str]:
    """The text of each ``{"type": "text", "text": ...}`` content block."""
    return [b.get("text", "") for b in blocks or []
            if isinstance(b, Mapping) and b.get("type") == "text"]


# =============================================================================================
# ACP


_TOOL_KIND_TO_REQUEST = {"execute": "command", "edit": "file-change", "delete": "file-change",
                         "move": "file-change", "read": "file-read"}
_INSTRUCTIONS_TAG = "t3_code_orchestration_instructions"
# t3's plan and runtime modes -> the ACP agent's own mode ids; the first one the agent advertises
# wins (claude-agent-acp: default, acceptEdits, plan, dontAsk, bypassPermissions; gemini: default,
# autoEdit, yolo, plan; codex-acp: none). Without a match t3 answers permission requests by the
# runtime mode. "auto" keeps the agent asking for commands so t3 records (and grants) each one.
_ACP_MODES = {"plan": ("plan",),
              "approval-required": ("default",),
              "auto-accept-edits": ("acceptEdits", "autoEdit"),
              "auto": ("acceptEdits", "autoEdit"),
              "full-access": ("bypassPermissions", "yolo")}


class AcpSession(RpcSession):
    """One ACP agent process serving one app thread (one ACP session)."""

    CLIENT_META: Mapping[str, Any] = {}  # flavors announce their extensions in initialize

    def __init__(self, adapter: AcpAdapter, process: ProviderProcess, *, runtime_mode: str,
                 probe: bool = False) -> None:
        super().__init__(adapter, process, runtime_mode=runtime_mode, probe=probe)
        self.agent_capabilities: Mapping[str, Any] = {}
        self.advertised_models: list[Mapping[str, Any]] = []  # session/new's availableModels
        self.forked = False  # opened by session/fork (history.py, "Fork and merge-back")
        self._loading = False
        self._instructions: str | None = None  # sent with the first prompt, then None
        self._prompt_task: asyncio.Task[None] | None = None

    # -- opening -------------------------------------------------------------------------------

    async def open(self, *, cwd: str, model: str | None, interaction_mode: str,
                   resume_ref: str | None, mcp: McpEndpoint | None,
                   fork: Mapping[str, Any] | None = None) -> None:
        capabilities: dict[str, Any] = {"fs": {"readTextFile": False, "writeTextFile": False},
                                        "terminal": False}
        if self.CLIENT_META:
            capabilities["_meta"] = dict(self.CLIENT_META)
        init = await self._request("initialize", {
            "protocolVersion": 1, "clientCapabilities": capabilities,
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
                session = await self._request("session/load", {
                    "sessionId": resume_ref, "cwd": cwd, "mcpServers": servers}, timeout=120)
                self.native_thread_ref = resume_ref
            except JsonRpcError as exc:
                log.warning("session/load of %s failed (%s); starting a new session",
                            resume_ref, exc)
            finally:
                self._loading = False
        if fork and not fork["dropTurns"] and _acp_forks(self.agent_capabilities):
            session = await self._fork(fork["ref"], cwd, servers)
        if self.native_thread_ref is None:
            session = await self._request("session/new", {"cwd": cwd, "mcpServers": servers},
                                          timeout=120)
            self.native_thread_ref = (session or {}).get("sessionId")
            if not self.native_thread_ref:
                raise JsonRpcError(-32603, "session/new returned no sessionId")
            # A new ACP session is the provider thread's first run: it gets the instructions
            # (a loaded one had them in its first prompt).
            self._instructions = _instructions(self._adapter.config, mcp) if servers else None
        self.advertised_models = list(((session or {}).get("models") or {})
                                      .get("availableModels") or [])
        await self._apply_mode_and_model(session or {}, model, interaction_mode)

    async def _fork(self, ref: str, cwd: str, servers: list[dict[str, Any]]
                    ) -> Mapping[str, Any] | None:
        """``session/fork`` of session ``ref`` (its whole conversation: ACP forks no earlier
        turn); None when the agent refuses (a new session follows, with the portable context)."""
        try:
            session = await self._request("session/fork", {
                "sessionId": ref, "cwd": cwd, "mcpServers": servers}, timeout=120)
        except JsonRpcError as exc:
            log.warning("session/fork of %s failed (%s); starting a new session", ref, exc)
            return None
        self.native_thread_ref = (session or {}).get("sessionId")
        self.forked = bool(self.native_thread_ref)
        return session

    async def _apply_mode_and_model(self, session: Mapping[str, Any], model: str | None,
                                    interaction_mode: str) -> None:
        modes = session.get("modes") or {}
        advertised = [m.get("id") for m in modes.get("availableModes") or []]
        wanted = _ACP_MODES["plan"] if interaction_mode == "plan" else \
            _ACP_MODES.get(self._runtime_mode, ())
        mode_id = next((m for m in wanted if m in advertised), None)  # the agent's own mode
        if mode_id is not None and mode_id != modes.get("currentModeId"):
            await self._optional("session/set_mode", {"sessionId": self.native_thread_ref,
                                                      "modeId": mode_id})
        models = session.get("models") or {}
        available = {m.get("modelId") for m in models.get("availableModels") or []}
        if model and model in available and model != models.get("currentModelId"):
            await self._optional("session/set_model", {"sessionId": self.native_thread_ref,
                                                       "modelId": model})

    async def _optional(self, method: str, params: Mapping[str, Any]) -> None:
        try:
            await self._request(method, params, timeout=30)
        except JsonRpcError as exc:
            log.info("%s not applied: %s", method, exc)

    # -- turns -----------------------------------------------------------------------------------

    async def start_turn(self, text: str) -> None:
        if self._prompt_task is not None and not self._prompt_task.done():
            raise RuntimeError("a turn is already running on this session")
        prompt = [{"type": "text", "text": text}]
        if self._instructions:
            # A block of its own before the user's: the user's prompt stays exactly as written.
            prompt.insert(0, {"type": "text", "text": f"<{_INSTRUCTIONS_TAG}>\n"
                              f"{self._instructions}\n</{_INSTRUCTIONS_TAG}>"})
            self._instructions = None
        self._prompt_task = self._tasks.start(self._prompt(prompt))

    async def _prompt(self, prompt: list[dict[str, Any]]) -> None:
        try:
            result = await self._request("session/prompt", {
                "sessionId": self.native_thread_ref, "prompt": prompt})
        except JsonRpcError as exc:
            await self._end_turn(f"The agent failed the turn: {exc}")
            return
        except ConnectionError:
            return  # the process is gone; the closed queue tells the orchestrator
        # stopReason: end_turn, max_tokens, max_turn_requests and refusal complete the turn
        await self._end_turn(interrupted=(result or {}).get("stopReason") == "cancelled")

    async def interrupt_turn(self) -> None:
        # ACP: the client answers every pending request "cancelled" and sends session/cancel;
        # the prompt then resolves with stopReason "cancelled".
        await self._cancel_requests()
        with contextlib.suppress(ConnectionError):
            await self._notify("session/cancel", {"sessionId": self.native_thread_ref})

    def _result(self, method: str, context: Any, decision: str | None,
                answers: Mapping[str, Any] | None) -> Mapping[str, Any]:
        return _permission_outcome(decision, context)  # flavors add methods

    # -- incoming --------------------------------------------------------------------------------

    async def _on_request(self, request_id: Any, method: str, params: Mapping[str, Any]) -> Any:
        if method != "session/request_permission":
            raise JsonRpcError(-32601, f"t3 does not offer {method}")
        tool = params.get("toolCall") or {}
        options = list(params.get("options") or [])
        if self._never_asks(edit=tool.get("kind") == "edit"):
            return _permission_outcome("accept", options)
        return await self._ask(request_id, method, options, RuntimeRequestOpened(
            native_ref=str(request_id),
            request_kind=_TOOL_KIND_TO_REQUEST.get(tool.get("kind", ""), "permission"),
            title=tool.get("title") or "Permission requested",
            detail={"toolCall": tool, "options": options}))

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
    texts = _texts(b.get("content") for b in update.get("content") or [] if isinstance(b, Mapping))
    if texts:
        return "\n".join(texts)
    raw = update.get("rawOutput")
    if raw is None:
        return None
    return raw if isinstance(raw, str) else json.dumps(raw)


def _acp_forks(advertised: Mapping[str, Any]) -> bool:
    """Whether an agent's ``initialize`` advertises ``session/fork`` (sessionCapabilities)."""
    return isinstance((advertised.get("sessionCapabilities") or {}).get("fork"), Mapping)


class AcpAdapter(DriverAdapter):
    """Any ACP agent started by command."""

    # supports_resume / supports_fork: where the agent's ``initialize`` advertises them
    CAPABILITIES = Capabilities(supports_resume=True, supports_mcp=True, supports_fork=True)
    SESSION: type[AcpSession] = AcpSession

    async def _probe_cli(self) -> tuple[list[dict[str, Any]], str | None]:
        """session/new's models; an agent that refuses it for want of authentication (ACP's
        auth_required, -32000) is not logged in."""
        with tempfile.TemporaryDirectory(prefix="t3-probe-") as cwd:
            try:
                models, _ = await self._open_probe(cwd)
            except JsonRpcError as exc:
                if exc.code == -32000 or "auth" in str(exc).lower():
                    return [], f"not logged in: the agent answered session/new with {exc}"
                raise
        return models, None

    async def _open_probe(self, cwd: str) -> tuple[list[dict[str, Any]], Capabilities]:
        """A disposable ``initialize`` + ``session/new``: success proves the agent can run (and
        is authenticated); it yields the models and capabilities the agent advertises."""
        process = await self._spawn(self.config.command, cwd, self._env(""))
        session = AcpSession(self, process, runtime_mode="approval-required", probe=True)
        try:
            await session.open(cwd=cwd, model=None, interaction_mode="default", resume_ref=None,
                               mcp=None)
        finally:
            await session.close(grace=1.0)
        models = [{"id": m["modelId"], "label": m.get("name")} for m in session.advertised_models
                  if isinstance(m, Mapping) and isinstance(m.get("modelId"), str)]
        advertised = session.agent_capabilities
        return models, replace(
            self.CAPABILITIES, supports_resume=bool(advertised.get("loadSession")),
            supports_mcp=bool((advertised.get("mcpCapabilities") or {}).get("http")),
            supports_fork=_acp_forks(advertised))

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None, fork: Mapping[str, Any] | None = None
                           ) -> AcpSession:
        self._check_available()
        process = await self._spawn(self.config.command, cwd, self._env(thread_id))
        session = self.SESSION(self, process, runtime_mode=runtime_mode)
        return await opened(session, session.open(
            cwd=cwd, model=model, interaction_mode=interaction_mode, resume_ref=resume_ref,
            mcp=mcp, fork=fork))


# =============================================================================================
# Grok (grok agent stdio): the ACP adapter plus xAI's extensions
#
# Grok asks with the request ``x.ai/ask_user_question`` (or ``_x.ai/...``), params ``{sessionId,
# toolCallId, questions: [{question, header?, options: [{label, description?}], multiSelect?}],
# mode?}``, and wants ``{outcome: "accepted", answers: {<question text>: label | [labels]},
# annotations: {}}`` or ``{outcome: "cancelled"}``: the shape other ACP clients of grok answer
# with. The CLI is not installable here, so the mapping is tolerant. ``x.ai/task_backgrounded``
# is only logged. Forks: by portable context.


_GROK_ASK = ("x.ai/ask_user_question", "_x.ai/ask_user_question")
_GROK_BACKGROUNDED = ("x.ai/task_backgrounded", "_x.ai/task_backgrounded")


class GrokSession(AcpSession):
    CLIENT_META = {"x.ai/ask_user_question": True}

    async def _on_request(self, request_id: Any, method: str, params: Mapping[str, Any]) -> Any:
        if method not in _GROK_ASK:
            return await super()._on_request(request_id, method, params)
        questions = _grok_questions(params)
        if not questions:
            return {"outcome": "cancelled"}  # nothing to ask: never leave the tool hanging
        return await self._ask(request_id, method, questions, RuntimeRequestOpened(
            native_ref=str(request_id), request_kind="user_input",
            title=questions[0]["question"] or "Grok asks a question",
            detail={"questions": questions, "toolCallId": params.get("toolCallId"),
                    "mode": params.get("mode")}))

    def _result(self, method: str, context: Any, decision: str | None,
                answers: Mapping[str, Any] | None) -> Mapping[str, Any]:
        if method not in _GROK_ASK:
            return super()._result(method, context, decision, answers)
        if answers is None or decision in ("decline", "cancel"):
            return {"outcome": "cancelled"}
        return {"outcome": "accepted", "answers": _grok_answers(context, answers),
                "annotations": {}}

    async def _on_notification(self, method: str, params: Mapping[str, Any]) -> None:
        if method in _GROK_BACKGROUNDED:
            log.info("%s: a task went to the background: %s", self._adapter.info.instance_id,
                     json.dumps(params)[:500])
            return
        await super()._on_notification(method, params)


def _grok_questions(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Grok's questions as t3 shows them: each with an id (q0, q1, ...) to answer it by."""
    inner = params.get("params")
    if isinstance(inner, Mapping) and "questions" not in params:
        params = inner  # some clients see the extension's params wrapped once more
    raw = params.get("questions")
    if raw is None and params.get("question"):
        raw = [params]  # a single question, flat
    questions = []
    for i, q in enumerate(raw if isinstance(raw, list) else []):
        if not isinstance(q, Mapping):
            continue
        options = [{"label": str(o.get("label", "")), "description": o.get("description")}
                   if isinstance(o, Mapping) else {"label": str(o), "description": None}
                   for o in q.get("options") or q.get("choices") or []]
        questions.append({"id": f"q{i}", "question": str(q.get("question") or ""),
                          "header": q.get("header"), "options": options,
                          "multiSelect": bool(q.get("multiSelect") or q.get("multi_select"))})
    return questions


def _grok_answers(questions: Sequence[Mapping[str, Any]], answers: Mapping[str, Any]
                  ) -> dict[str, Any]:
    """t3 answers (keyed by question id or text; a label, free text or a list of them) -> grok's
    answers keyed by question text."""
    out: dict[str, Any] = {}
    for q in questions:
        value = answers.get(q["id"], answers.get(q["question"]))
        if isinstance(value, Mapping):  # codex's shape {"answers": [...]}
            value = value.get("answers")
        if value is None:
            continue
        values = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
        out[q["question"]] = values if q["multiSelect"] or len(values) > 1 else values[0]
    return out


class GrokAdapter(AcpAdapter):
    """``grok agent stdio``: ACP with xAI's question extension."""

    SESSION = GrokSession
    CAPABILITIES = replace(AcpAdapter.CAPABILITIES, supports_fork=False)  # portable context


# =============================================================================================
# Claude Code (claude -p, stream-json)


_CLAUDE_REQUEST_KINDS = {"Bash": "command", "Read": "file-read", **dict.fromkeys(
    ("Edit", "Write", "MultiEdit", "NotebookEdit"), "file-change")}


class ClaudeSession(DriverSession):
    """One `claude -p` stream-json process serving one app thread; it lives across turns."""

    def __init__(self, adapter: ClaudeAdapter, process: ProviderProcess, *, runtime_mode: str,
                 session_ref: str, mcp_dir: str | None) -> None:
        super().__init__(adapter, process, runtime_mode=runtime_mode)
        self._mcp_dir = mcp_dir
        self.native_thread_ref = session_ref
        self._control_ids = itertools.count(1)
        self._read()

    async def start_turn(self, text: str) -> None:
        async with self._turn_starting():
            content = [{"type": "text", "text": text}]
            await self._send({"type": "user", "session_id": "", "parent_tool_use_id": None,
                              "message": {"role": "user", "content": content}})

    async def interrupt_turn(self) -> None:
        self._interrupted = True
        for native_ref in list(self._requests):
            await self._answer(native_ref, {"behavior": "deny", "message": "Interrupted."})
        with contextlib.suppress(ConnectionError):
            await self._send({"type": "control_request",
                              "request_id": f"t3-{next(self._control_ids)}",
                              "request": {"subtype": "interrupt"}})

    async def respond(self, native_ref: str, decision: str | None,
                      answers: Mapping[str, Any] | None) -> None:
        request = self._requests.get(native_ref)
        if request is None:
            raise RuntimeError(f"no pending permission request {native_ref} on this session")
        await self._answer(native_ref, {"behavior": "allow",
                                        "updatedInput": request.get("input") or {}}
                           if decision in ("accept", "acceptForSession") else
                           {"behavior": "deny", "message": "The user declined this tool call."})

    async def _answer(self, native_ref: str, response: Mapping[str, Any]) -> None:
        self._requests.pop(native_ref, None)
        with contextlib.suppress(ConnectionError):
            await self._send({"type": "control_response", "response": {
                "subtype": "success", "request_id": native_ref, "response": response}})

    def _forget(self) -> None:
        super()._forget()
        if self._mcp_dir:
            shutil.rmtree(self._mcp_dir, ignore_errors=True)

    async def _route(self, message: Mapping[str, Any]) -> None:
        kind = message.get("type")
        if kind == "stream_event":
            event = message.get("event") or {}
            delta = event.get("delta") or {}
            if event.get("type") == "content_block_delta" and delta.get("type") == "text_delta":
                await self.events.put(TextDelta(delta.get("text", "")))
            elif event.get("type") == "content_block_delta" and \
                    delta.get("type") == "thinking_delta":
                await self.events.put(ReasoningDelta(delta.get("thinking", "")))
        elif kind == "assistant":
            for block in (message.get("message") or {}).get("content") or []:
                if block.get("type") == "tool_use":
                    await self.events.put(ToolUpdate(
                        native_id=str(block.get("id")), status="running",
                        title=block.get("name"), tool_kind=block.get("name"),
                        input=block.get("input")))
        elif kind == "user":
            for block in (message.get("message") or {}).get("content") or []:
                if isinstance(block, Mapping) and block.get("type") == "tool_result":
                    content = block.get("content")
                    output = content if isinstance(content, str) else json.dumps(content)
                    await self.events.put(ToolUpdate(
                        native_id=str(block.get("tool_use_id")),
                        status="failed" if block.get("is_error") else "completed",
                        output=output))
        elif kind == "control_request":
            await self._on_control_request(message)
        elif kind == "result" and self._in_turn:
            # a turn that ended well after an interrupt has completed all the same
            if message.get("is_error"):
                await self._end_turn(str(message.get("result") or message.get("subtype") or
                                         "Claude Code failed"), interrupted=self._interrupted)
            else:
                await self._end_turn()

    async def _on_control_request(self, message: Mapping[str, Any]) -> None:
        request = message.get("request") or {}
        request_id = str(message.get("request_id"))
        if request.get("subtype") != "can_use_tool":
            await self._send({"type": "control_response", "response": {
                "subtype": "error", "request_id": request_id,
                "error": f"t3 does not handle {request.get('subtype')}"}})
            return
        tool = str(request.get("tool_name") or "")
        self._requests[request_id] = request
        # claude itself grants edits in acceptEdits (auto-accept-edits); t3's own tools are
        # scoped to the thread by the credential
        if self._never_asks(edit=False) or tool.startswith("mcp__t3-code__"):
            await self.respond(request_id, "accept", None)
            return
        await self.events.put(RuntimeRequestOpened(
            native_ref=request_id, request_kind=_CLAUDE_REQUEST_KINDS.get(tool, "permission"),
            title=f"Allow {request.get('display_name') or tool}?",
            detail={"toolName": tool, "input": request.get("input"),
                    "description": request.get("description")}))


class ClaudeAdapter(DriverAdapter):
    """Claude Code headless: `claude -p` with stream-json input and output and permission
    prompts over stdio; t3's MCP server via a private --mcp-config file."""

    CAPABILITIES = Capabilities(supports_resume=True, supports_mcp=True)
    # Claude Code's model aliases: they follow Anthropic's current models, so they stay valid.
    MODELS = ({"id": "sonnet", "label": "Claude Sonnet (latest)"},
              {"id": "opus", "label": "Claude Opus (latest)"},
              {"id": "haiku", "label": "Claude Haiku (latest)"},
              {"id": "opusplan", "label": "Opus to plan, Sonnet to execute"})

    async def _probe_cli(self) -> tuple[list[dict[str, Any]], str | None]:
        """The aliases, and ``claude auth status --json``'s ``loggedIn`` (an API key in the
        environment counts)."""
        out = await self._cli_output("auth", "status", "--json")
        try:
            status = parse_json(out)
        except ValueError:
            status = {}
        logged_in = status.get("loggedIn") is not False if isinstance(status, dict) else True
        return [dict(m) for m in self.MODELS], None if logged_in else \
            "not logged in: claude auth status says loggedIn false (claude auth login)"

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None) -> ClaudeSession:
        self._check_available()
        command = list(self.config.command)
        if "--include-partial-messages" not in command:
            command.append("--include-partial-messages")
        if model:
            command += ["--model", model]
        mode = "plan" if interaction_mode == "plan" else \
            "acceptEdits" if runtime_mode == "auto-accept-edits" else "default"
        command += ["--permission-mode", mode]
        session_ref = resume_ref or str(uuid.uuid4())
        command += ["--resume", session_ref] if resume_ref else ["--session-id", session_ref]
        mcp_dir = None
        if mcp is not None:
            # The token goes in a private file, not on the command line others can read.
            mcp_dir = tempfile.mkdtemp(prefix="t3-mcp-")
            config_path = Path(mcp_dir) / "mcp.json"
            fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"mcpServers": {mcp.name: {"type": "http", "url": mcp.url,
                                                     "headers": dict(mcp.headers)}}}, f)
            command += ["--mcp-config", str(config_path), "--strict-mcp-config",
                        "--allowedTools", f"mcp__{mcp.name}__*"]
        if instructions := _instructions(self.config, mcp):  # the system prompt is per process
            command += ["--append-system-prompt", instructions]
        process = await self._spawn(command, cwd, self._env(thread_id))
        return ClaudeSession(self, process, runtime_mode=runtime_mode, session_ref=session_ref,
                             mcp_dir=mcp_dir)


# =============================================================================================
# Codex (codex app-server)
#
# JSON-RPC over stdio, one JSON object per line. Codex's own messages carry no "jsonrpc" field;
# the ones t3 sends do, which codex accepts. One process per session, one codex thread per process.


# runtime mode -> (approvalPolicy, sandbox)
_CODEX_MODES = {"approval-required": ("untrusted", "read-only"),
                "auto-accept-edits": ("on-request", "workspace-write"),
                "auto": ("on-request", "workspace-write"),
                "full-access": ("never", "danger-full-access")}
_CODEX_REQUEST_KINDS = {"item/commandExecution/requestApproval": "command",
                        "item/fileChange/requestApproval": "file-change",
                        "mcpServer/elicitation/request": "mcp-elicitation",
                        "item/tool/requestUserInput": "user_input"}
_CODEX_DECISIONS = ("accept", "acceptForSession", "decline", "cancel")
_CODEX_TOOL_ITEMS = {"commandExecution": "execute", "fileChange": "edit", "mcpToolCall": "mcp"}
_CODEX_TOOL_STATUS = {"inProgress": "running", "completed": "completed", "failed": "failed",
                      "declined": "failed"}
_CODEX_PLAN_STATUS = {"pending": "pending", "inProgress": "in_progress", "completed": "completed"}
_CODEX_WAIT_TOOL = "t3_thread_wait"  # served alone by the "-direct" registration
_CODEX_MCP_STARTUP_S = 30  # codex's own limit per server is startup_timeout_sec (10 s)


def _codex_mcp_servers(mcp: McpEndpoint) -> dict[str, Any]:
    """Two registrations of t3's MCP server: ``t3-code`` with every tool but
    ``t3_thread_wait``, ``t3-code-direct`` with only that one. t3's own tools are scoped to the
    thread by the credential, so codex runs them without asking."""
    common = {"url": mcp.url, "http_headers": dict(mcp.headers),
              "default_tools_approval_mode": "approve",
              "startup_timeout_sec": _CODEX_MCP_STARTUP_S}
    return {mcp.name: {**common, "disabled_tools": [_CODEX_WAIT_TOOL]},
            f"{mcp.name}-direct": {**common, "enabled_tools": [_CODEX_WAIT_TOOL]}}


class CodexSession(RpcSession):
    """One ``codex app-server`` process serving one app thread (one codex thread)."""

    def __init__(self, adapter: CodexAdapter, process: ProviderProcess, *, runtime_mode: str,
                 probe: bool = False) -> None:
        super().__init__(adapter, process, runtime_mode=runtime_mode, probe=probe)
        self.forked = False  # opened by thread/fork (history.py, "Fork and merge-back")
        self._turn_id: str | None = None
        self._ended_turns: set[str] = set()
        self._last_error: str | None = None
        # t3's MCP servers still starting: codex builds a turn's tools from the servers ready
        # when the turn starts, so a turn started earlier runs without t3's tools.
        self._mcp_starting: set[str] = set()
        self._mcp_settled = asyncio.Event()

    # -- opening -------------------------------------------------------------------------------

    async def open(self, *, cwd: str, model: str | None, resume_ref: str | None,
                   mcp: McpEndpoint | None, fork: Mapping[str, Any] | None = None) -> None:
        await self._initialize()
        approval, sandbox = _CODEX_MODES.get(self._runtime_mode, _CODEX_MODES["auto"])
        params: dict[str, Any] = {"cwd": cwd, "approvalPolicy": approval, "sandbox": sandbox}
        if model:
            params["model"] = model
        if mcp is not None:
            params["config"] = {"mcp_servers": _codex_mcp_servers(mcp)}
            self._mcp_starting = set(params["config"]["mcp_servers"])
        result = await self._fork(fork, params) if fork else None
        if resume_ref:
            try:
                # excludeTurns: t3 keeps its own history; codex still gives the model all of it
                result = await self._request("thread/resume", {
                    "threadId": resume_ref, "excludeTurns": True, **params}, timeout=120)
            except JsonRpcError as exc:
                log.warning("thread/resume of %s failed (%s); starting a new thread",
                            resume_ref, exc)
        if result is None:
            # A new codex thread is the first run; a resumed one keeps what it was started with.
            instructions = _instructions(self._adapter.config, mcp)
            if instructions:
                params["developerInstructions"] = instructions
            result = await self._request("thread/start", params, timeout=120)
        self.native_thread_ref = ((result or {}).get("thread") or {}).get("id")
        if not self.native_thread_ref:
            raise JsonRpcError(-32603, "codex returned no thread id")

    async def _initialize(self) -> None:
        await self._request("initialize", {
            "clientInfo": {"name": "t3", "title": "t3", "version": "0.1.0"},
            "capabilities": {"experimentalApi": True}}, timeout=60)
        await self._notify("initialized", {})

    async def _fork(self, fork: Mapping[str, Any], params: Mapping[str, Any]
                    ) -> Mapping[str, Any] | None:
        """``thread/fork`` of codex thread ``fork["ref"]`` through the turn before its last
        ``dropTurns`` ones (``lastTurnId``, from ``thread/read``'s turns: codex forks from an
        earlier turn this way); None when codex refuses (a new thread follows, with the
        portable context)."""
        try:
            last = None
            if fork["dropTurns"]:
                read = await self._request("thread/read", {
                    "threadId": fork["ref"], "includeTurns": True}, timeout=60)
                turns = ((read or {}).get("thread") or {}).get("turns") or []
                if len(turns) <= fork["dropTurns"]:
                    raise JsonRpcError(-32603, f"the thread has {len(turns)} turns")
                last = turns[-1 - fork["dropTurns"]]["id"]
            result = await self._request("thread/fork", {
                "threadId": fork["ref"], "excludeTurns": True, **params,
                **({"lastTurnId": last} if last else {})}, timeout=120)
        except JsonRpcError as exc:
            log.warning("thread/fork of %s failed (%s); starting a new thread", fork["ref"], exc)
            return None
        self.forked = True
        return result

    # -- turns -----------------------------------------------------------------------------------

    async def start_turn(self, text: str) -> None:
        if self._turn_id is not None:
            raise RuntimeError("a turn is already running on this session")
        self._last_error = None
        if self._mcp_starting:
            try:
                await asyncio.wait_for(self._mcp_settled.wait(), _CODEX_MCP_STARTUP_S)
            except TimeoutError:
                log.warning("codex's MCP servers %s still starting after %d s; the turn starts "
                            "without them", sorted(self._mcp_starting), _CODEX_MCP_STARTUP_S)
                self._mcp_starting.clear()
        result = await self._request("turn/start", {
            "threadId": self.native_thread_ref, "input": _codex_input(text)}, timeout=60)
        turn_id = ((result or {}).get("turn") or {}).get("id")
        if turn_id and turn_id not in self._ended_turns:  # a fast turn may have ended already
            self._turn_id = turn_id

    async def steer_turn(self, text: str) -> None:
        if self._turn_id is None:
            raise RuntimeError("no turn is running on this session")
        await self._request("turn/steer", {"threadId": self.native_thread_ref,
                                           "expectedTurnId": self._turn_id,
                                           "input": _codex_input(text)}, timeout=60)

    async def interrupt_turn(self) -> None:
        await self._cancel_requests()
        if self._turn_id is None:
            return
        try:
            await self._request("turn/interrupt", {"threadId": self.native_thread_ref,
                                                   "turnId": self._turn_id}, timeout=30)
        except (JsonRpcError, ConnectionError) as exc:
            log.info("turn/interrupt not applied: %s", exc)

    def _result(self, method: str, context: Any, decision: str | None,
                answers: Mapping[str, Any] | None) -> Mapping[str, Any]:
        return _codex_answer(method, decision, answers)

    async def rollback(self, keep_turns: int) -> None:
        """Keep only the thread's first ``keep_turns`` turns (``thread/revert`` before the next
        one); nothing when it has no more, so a second call changes nothing."""
        listed = await self._request("thread/turns/list", {
            "threadId": self.native_thread_ref, "sortDirection": "asc",
            "limit": keep_turns + 1}, timeout=60)
        turns = (listed or {}).get("data") or []
        if len(turns) > keep_turns:
            await self._request("thread/revert", {"threadId": self.native_thread_ref,
                                                  "beforeTurnId": turns[keep_turns]["id"]},
                                timeout=120)

    # -- incoming --------------------------------------------------------------------------------

    async def _on_request(self, request_id: Any, method: str, params: Mapping[str, Any]) -> Any:
        kind = _CODEX_REQUEST_KINDS.get(method)
        if kind is None:
            raise JsonRpcError(-32601, f"t3 does not offer {method}")
        if self._runtime_mode == "full-access" and kind != "user_input":
            return _codex_answer(method, "accept", None)  # this mode never asks the user
        return await self._ask(request_id, method, None, RuntimeRequestOpened(
            native_ref=str(request_id), request_kind=kind,
            title=_codex_request_title(method, params), detail=dict(params)))

    async def _on_notification(self, method: str, params: Mapping[str, Any]) -> None:
        if method == "mcpServer/startupStatus/updated" and params.get("status") != "starting":
            # before thread/start answers, so before the thread id is known: names are this
            # process's own
            if params.get("status") != "ready":
                log.warning("codex could not start MCP server %s: %s", params.get("name"),
                            params.get("error") or params.get("status"))
            self._mcp_starting.discard(params.get("name"))
            if not self._mcp_starting:
                self._mcp_settled.set()
        if params.get("threadId") not in (None, self.native_thread_ref):
            return
        if method == "item/agentMessage/delta":
            await self.events.put(TextDelta(params.get("delta", "")))
        elif method in ("item/reasoning/textDelta", "item/reasoning/summaryTextDelta"):
            await self.events.put(ReasoningDelta(params.get("delta", "")))
        elif method in ("item/started", "item/completed"):
            item = params.get("item") or {}
            if item.get("type") in _CODEX_TOOL_ITEMS:
                await self.events.put(_codex_tool_update(item))
        elif method == "turn/plan/updated":
            await self.events.put(PlanUpdate(entries=[
                {"content": step.get("step", ""),
                 "status": _CODEX_PLAN_STATUS.get(step.get("status"), "pending")}
                for step in params.get("plan") or []]))
        elif method == "turn/started":
            turn_id = (params.get("turn") or {}).get("id")
            if turn_id and turn_id not in self._ended_turns:
                self._turn_id = turn_id
        elif method == "error" and not params.get("willRetry"):
            self._last_error = (params.get("error") or {}).get("message") or self._last_error
        elif method == "turn/completed":
            await self._turn_completed(params.get("turn") or {})

    async def _turn_completed(self, turn: Mapping[str, Any]) -> None:
        if self._turn_id is not None and turn.get("id") not in (None, self._turn_id):
            return
        self._turn_id = None
        if turn.get("id"):
            self._ended_turns.add(turn["id"])
        self._requests.clear()  # nothing can answer them any more
        message = (turn.get("error") or {}).get("message") or self._last_error
        await self._end_turn(f"Codex failed the turn: {message or 'no reason given'}"
                             if turn.get("status") == "failed" else None,
                             interrupted=turn.get("status") == "interrupted")


def _codex_input(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text, "text_elements": []}]


def _codex_answer(method: str, decision: str | None, answers: Mapping[str, Any] | None
                  ) -> Mapping[str, Any]:
    if method == "item/tool/requestUserInput":
        # codex wants {question id: {answers: [strings]}}
        return {"answers": {qid: (a if isinstance(a, Mapping) else
                                  {"answers": list(a) if isinstance(a, (list, tuple))
                                   else [str(a)]})
                            for qid, a in (answers or {}).items()}}
    if method == "mcpServer/elicitation/request":
        action = {"accept": "accept", "acceptForSession": "accept",
                  "decline": "decline"}.get(decision or "cancel", "cancel")
        return {"action": action, "content": dict(answers) if answers and action == "accept"
                else None, "_meta": None}
    return {"decision": decision if decision in _CODEX_DECISIONS else "cancel"}


def _codex_request_title(method: str, params: Mapping[str, Any]) -> str:
    if method == "item/commandExecution/requestApproval":
        return f"Run {params.get('command') or 'a command'}"
    if method == "item/fileChange/requestApproval":
        return params.get("reason") or "Apply file changes"
    if method == "mcpServer/elicitation/request":
        return params.get("message") or f"{params.get('serverName', 'An MCP server')} asks"
    questions = params.get("questions") or []
    first = questions[0] if questions and isinstance(questions[0], Mapping) else {}
    return first.get("question") or first.get("header") or "Codex asks a question"


def _codex_tool_update(item: Mapping[str, Any]) -> ToolUpdate:
    kind = str(item.get("type"))
    output: str | None = None
    tool_input: Any
    if kind == "commandExecution":
        title, tool_input = item.get("command"), {"command": item.get("command"),
                                                  "cwd": item.get("cwd")}
        output = item.get("aggregatedOutput")
    elif kind == "fileChange":
        changes = item.get("changes") or []
        title = "Edit " + ", ".join(str(c.get("path")) for c in changes) if changes else "Edit"
        tool_input = {"changes": changes}
    else:
        title = f"{item.get('server')}.{item.get('tool')}"
        tool_input = item.get("arguments")
        if item.get("error"):
            output = (item.get("error") or {}).get("message")
        elif item.get("result") is not None:
            texts = _texts(item["result"].get("content"))
            output = "\n".join(texts) if texts else json.dumps(item["result"])
    return ToolUpdate(native_id=str(item.get("id")),
                      status=_CODEX_TOOL_STATUS.get(str(item.get("status")), "running"),
                      title=title, tool_kind=_CODEX_TOOL_ITEMS[kind], input=tool_input,
                      output=output)


class CodexAdapter(DriverAdapter):
    """``codex app-server``, one process per session. Its probe is a disposable app-server:
    ``model/list`` (hidden models are legacy: found by search only; the default first) and
    ``account/read`` (no account while codex's provider needs an OpenAI login: not logged in)."""

    CAPABILITIES = Capabilities(supports_active_steering=True, supports_resume=True,
                                supports_mcp=True, supports_fork=True,
                                supports_fork_from_turn=True, supports_rollback=True)

    async def _probe_cli(self) -> tuple[list[dict[str, Any]], str | None]:
        with tempfile.TemporaryDirectory(prefix="t3-probe-") as cwd:
            process = await self._spawn(self.config.command, cwd, self._env(""))
            session = CodexSession(self, process, runtime_mode="approval-required", probe=True)
            try:
                await session._initialize()
                listed: list[Mapping[str, Any]] = []
                cursor = None
                for _ in range(10):
                    page = await session._request(
                        "model/list", {"cursor": cursor} if cursor else {})
                    listed += (page or {}).get("data") or []
                    if not (cursor := (page or {}).get("nextCursor")):
                        break
                account = await session._request("account/read", {"refreshToken": False}) or {}
            finally:
                await session.close(grace=1.0)
        listed.sort(key=lambda m: not m.get("isDefault"))
        models = [{"id": m["id"], "label": m.get("displayName"),
                   **({"legacy": True} if m.get("hidden") else {})}
                  for m in listed if isinstance(m.get("id"), str)]
        logged_out = account.get("requiresOpenaiAuth") and account.get("account") is None
        return models, "not logged in: codex needs an OpenAI login (codex login)" \
            if logged_out else None

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None, fork: Mapping[str, Any] | None = None
                           ) -> CodexSession:
        self._check_available()
        process = await self._spawn(self.config.command, cwd, self._env(thread_id))
        session = CodexSession(self, process, runtime_mode=runtime_mode)
        return await opened(session, session.open(cwd=cwd, model=model, resume_ref=resume_ref,
                                                  mcp=mcp, fork=fork))


# =============================================================================================
# Pi (pi --mode rpc)
#
# pi's own JSONL protocol over stdio: commands ``{type, id, ...}`` on stdin, responses ``{type:
# "response", id, command, success, data?, error?}`` and events (no id) on stdout. Framing is LF
# only: pi's strings may hold U+2028/U+2029, which a line splitter on "any line break" would cut,
# so t3 splits on b"\n" (``_read_json_lines``).


_PI_REQUEST_TIMEOUT = 90.0  # pi answers its first command only once it has started (slow under load)
_PI_EXTENSION_NAME = "pi-t3-mcp-extension.ts"


def _pi_extension() -> str:
    """The MCP bridge (t3's tools as pi tools named mcp__t3-code__<tool>, each calling t3's MCP
    server over HTTP with the session's credential): the TypeScript file beside this one, or
    in <prefix>/share/t3 where an installed wheel puts it."""
    for folder in (Path(__file__).resolve().parent, Path(sys.prefix) / "share" / "t3"):
        if (folder / _PI_EXTENSION_NAME).is_file():
            return (folder / _PI_EXTENSION_NAME).read_text()
    raise FileNotFoundError(f"{_PI_EXTENSION_NAME} is not installed beside drivers.py")


class PiSession(DriverSession):
    """One ``pi --mode rpc`` process serving one app thread; its session file is the native
    thread ref and lives across processes."""

    def __init__(self, adapter: PiAdapter, process: ProviderProcess, *, runtime_mode: str,
                 session_file: str) -> None:
        super().__init__(adapter, process, runtime_mode=runtime_mode)
        self.native_thread_ref = session_file
        self._ids = itertools.count(1)
        self._last_error: str | None = None
        self._read()

    async def _request(self, kind: str, *, timeout: float = _PI_REQUEST_TIMEOUT,
                       **fields: Any) -> Mapping[str, Any]:
        request_id = f"t3-{next(self._ids)}"
        response = await self._call(request_id, {"type": kind, "id": request_id, **fields},
                                    timeout)
        if not response.get("success"):
            raise RuntimeError(f"pi refused {kind}: {response.get('error') or 'no reason given'}")
        return response

    async def start_turn(self, text: str) -> None:
        async with self._turn_starting():
            self._last_error = None
            await self._request("prompt", message=text)

    async def steer_turn(self, text: str) -> None:
        if not self._in_turn:
            raise RuntimeError("no turn is running on this session")
        await self._request("steer", message=text)

    async def interrupt_turn(self) -> None:
        if not self._in_turn:
            return
        self._interrupted = True
        try:  # pi answers abort only after the turn has ended
            await self._request("abort", timeout=30.0)
        except (ConnectionError, RuntimeError, TimeoutError) as exc:
            log.info("%s: abort not applied: %s", self._label, exc)

    async def respond(self, native_ref: str, decision: str | None,
                      answers: Mapping[str, Any] | None) -> None:
        raise RuntimeError("pi raises no runtime requests")

    async def _route(self, message: Mapping[str, Any]) -> None:
        kind = message.get("type")
        if kind == "response":
            self._settle(str(message.get("id")), message)
        elif kind == "message_update":
            event = message.get("assistantMessageEvent") or {}
            if event.get("type") == "text_delta":
                await self.events.put(TextDelta(event.get("delta", "")))
            elif event.get("type") == "thinking_delta":
                await self.events.put(ReasoningDelta(event.get("delta", "")))
        elif kind == "message_end":
            msg = message.get("message") or {}
            if msg.get("role") == "assistant" and msg.get("stopReason") == "error":
                self._last_error = msg.get("errorMessage") or "the model request failed"
            elif msg.get("role") == "assistant":
                self._last_error = None
        elif kind in ("tool_execution_start", "tool_execution_update", "tool_execution_end"):
            await self.events.put(_pi_tool_update(message))
        elif kind in ("agent_end", "agent_settled") and self._in_turn:
            # pi 0.73.1 ends a prompt with agent_end (it has no agent_settled yet)
            await self._end_turn(self._last_error and f"pi failed the turn: {self._last_error}",
                                 interrupted=self._interrupted)


def _pi_tool_update(message: Mapping[str, Any]) -> ToolUpdate:
    kind = message.get("type")
    name = str(message.get("toolName") or "tool")
    args = message.get("args")
    output: str | None = None
    result = message.get("result") if kind == "tool_execution_end" else \
        message.get("partialResult")
    if isinstance(result, Mapping):
        output = "\n".join(_texts(result.get("content")))
    status = ("failed" if message.get("isError") else "completed") \
        if kind == "tool_execution_end" else "running"
    title = f"{name} {args.get('command')}" if name == "bash" and isinstance(args, Mapping) \
        and args.get("command") else name
    return ToolUpdate(native_id=str(message.get("toolCallId")), status=status,
                      title=title if kind == "tool_execution_start" else None,
                      tool_kind="execute" if name == "bash" else
                      "mcp" if name.startswith("mcp__") else name,
                      input=args if kind == "tool_execution_start" else None, output=output)


class PiAdapter(DriverAdapter):
    """``pi --mode rpc``, one process per session. pi has no permission prompts, so t3 offers
    only full-access and the default interaction mode (``RUNTIME_MODES``): a narrower child is
    refused rather than run unrestricted. Models: ``pi --list-models``. Steering is native
    (before pi's next model call). The native thread ref is the ``--session <file>`` under
    ``<data-dir>/agents/pi-sessions/``, one per app thread. pi has no MCP client: a t3-owned
    extension (``<data-dir>/agents/pi-t3-mcp-extension.ts``) registers t3's tools as
    ``mcp__t3-code__<tool>`` and calls them over HTTP."""

    CAPABILITIES = Capabilities(supports_active_steering=True, supports_resume=True,
                                supports_mcp=True)
    RUNTIME_MODES = ("full-access",)
    INTERACTION_MODES = ("default",)

    def __init__(self, config: ProviderConfig, *, log_dir: Path, owner: str) -> None:
        super().__init__(config, log_dir=log_dir, owner=owner)
        self.agents_dir = log_dir.parent / "agents"

    async def _probe_cli(self) -> tuple[list[dict[str, Any]], str | None]:
        """``pi --list-models``: a table (provider, model, ...) after a header line, or "No
        models available. Use /login ..." when no provider is logged in."""
        out = await self._cli_output("--list-models")
        if out.startswith("No models available"):
            return [], "not logged in: pi has no models (pi: /login, or a models.json)"
        rows = [line.split() for line in out.splitlines()[1:]]
        return [{"id": f"{row[0]}/{row[1]}"} for row in rows if len(row) >= 2], None

    def session_file(self, thread_id: str) -> Path:
        digest = hashlib.sha256(thread_id.encode()).hexdigest()[:32]
        return self.agents_dir / "pi-sessions" / f"{digest}.jsonl"

    def _extension(self) -> Path:
        """The bridge, copied into the data dir (written again when this t3's copy differs)."""
        path, text = self.agents_dir / _PI_EXTENSION_NAME, _pi_extension()
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(path)
        return path

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None) -> PiSession:
        self._check_available()
        session_file = Path(resume_ref) if resume_ref else self.session_file(thread_id)
        session_file.parent.mkdir(parents=True, exist_ok=True)
        command = list(self.config.command) + ["--session", str(session_file)]
        if model:
            provider, _, name = model.rpartition("/")
            command += (["--provider", provider] if provider else []) + ["--model", name]
        env = self._env(thread_id)
        if mcp is not None:
            command += ["--extension", str(self._extension())]
            auth = next((v for k, v in mcp.headers.items() if k.lower() == "authorization"), "")
            env["T3_MCP_URL"] = mcp.url
            env["T3_MCP_BEARER_TOKEN"] = auth.removeprefix("Bearer ").strip()
        if instructions := _instructions(self.config, mcp):  # the system prompt is per process
            command += ["--append-system-prompt", instructions]
        process = await self._spawn(command, cwd, env)
        return PiSession(self, process, runtime_mode=runtime_mode, session_file=str(session_file))


# =============================================================================================
# OpenCode (opencode serve)
#
# HTTP REST plus one SSE stream. One `opencode serve` process per session, bound to 127.0.0.1 on
# a free port and guarded by a random server password; one opencode session per app thread.
# Stdlib HTTP/1.1 over asyncio streams.


_OPENCODE_LISTENING = re.compile(r"listening on (http://[^\s]+)")
_OPENCODE_EDIT_TOOLS = {"edit", "write", "patch", "multiedit"}
_OPENCODE_TOOL_STATUS = {"pending": "pending", "running": "running", "completed": "completed",
                         "error": "failed"}
_OPENCODE_REPLIES = {"accept": "once", "acceptForSession": "always"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _HttpError(Exception):
    """An answer of the opencode server with a status of 300 or more."""


async def _http_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the opencode server closed the connection")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = (await reader.readline()).decode("latin-1").strip()
        if not line:
            return status, headers
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()


async def _http_body_chunks(reader: asyncio.StreamReader, headers: Mapping[str, str]
                            ) -> AsyncIterator[bytes]:
    """The body of a response as it arrives (chunked, by length, or until the connection ends)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            chunk = await reader.readexactly(size)
            await reader.readline()
            yield chunk
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        if remaining:
            yield await reader.readexactly(remaining)
    else:
        while chunk := await reader.read(65536):
            yield chunk


class OpenCodeSession(DriverSession):
    """One ``opencode serve`` process serving one app thread (one opencode session)."""

    def __init__(self, adapter: OpenCodeAdapter, process: ProviderProcess, *, runtime_mode: str,
                 port: int, password: str, cwd: str, model: str | None) -> None:
        super().__init__(adapter, process, runtime_mode=runtime_mode)
        self._port = port
        self._auth = "Basic " + base64.b64encode(
            f"opencode:{password}".encode()).decode()
        self._cwd = cwd
        self._model = model
        self._busy = False  # the root session went busy in this turn
        self._error: str | None = None
        self._roles: dict[str, str] = {}  # message id -> role
        self._parts: dict[str, str] = {}  # part id -> part type
        self._sent: dict[str, int] = {}  # part id -> characters already emitted
        self._tools: dict[str, tuple[str, Any]] = {}  # part id -> (status, output) emitted
        self._system: str | None = None  # the orchestration instructions, when it has t3's MCP
        loop = asyncio.get_running_loop()
        self._listening: asyncio.Future[str] = loop.create_future()
        self._subscribed: asyncio.Future[None] = loop.create_future()
        for stream in ("stdout", "stderr"):  # "listening on" may come on either
            self._tasks.start(self._read_text(stream, self._on_output))
        self._tasks.start(self._exited())

    # -- HTTP ------------------------------------------------------------------------------------

    def _target(self, path: str) -> str:
        return f"{path}?directory={quote(self._cwd, safe='')}"

    async def _request(self, method: str, path: str, body: Any = None, *,
                       timeout: float = 60) -> Any:
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        target = self._target(path)
        self._adapter.protocol_log.write(f"{self._label} -> {method} {target} {payload.decode()}")

        async def exchange() -> Any:
            reader, writer = await asyncio.open_connection("127.0.0.1", self._port)
            try:
                writer.write((f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{self._port}\r\n"
                              f"Authorization: {self._auth}\r\nAccept: application/json\r\n"
                              f"Content-Type: application/json\r\n"
                              f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                              ).encode() + payload)
                await writer.drain()
                status, headers = await _http_head(reader)
                data = b"".join([c async for c in _http_body_chunks(reader, headers)])
            finally:
                writer.close()
            text = data.decode(errors="replace")
            self._adapter.protocol_log.write(f"{self._label} <- {status} {text}")
            if status >= 300:
                raise _HttpError(f"HTTP {status}: {text[:300]}")
            return parse_json(text) if text.strip() else None

        return await asyncio.wait_for(exchange(), timeout)

    # -- opening ---------------------------------------------------------------------------------

    async def open(self, *, resume_ref: str | None, mcp: McpEndpoint | None) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._listening), 60)
        except TimeoutError:
            raise RuntimeError("opencode serve did not start listening within 60 s") from None
        self._tasks.start(self._read_events())
        await asyncio.wait_for(asyncio.shield(self._subscribed), 30)
        self._system = _instructions(self._adapter.config, mcp)
        if mcp is not None:
            # Over the loopback HTTP API: the token is never on a command line or in a file.
            await self._request("POST", "/mcp", {"name": mcp.name, "config": {
                "type": "remote", "url": mcp.url, "headers": dict(mcp.headers),
                "oauth": False, "enabled": True}})
        if resume_ref:
            try:
                found = await self._request("GET", f"/session/{resume_ref}")
                self.native_thread_ref = (found or {}).get("id")
            except _HttpError as exc:
                log.warning("opencode session %s is gone (%s); starting a new one",
                            resume_ref, exc)
        if not self.native_thread_ref:
            created = await self._request("POST", "/session", {})
            self.native_thread_ref = (created or {}).get("id")
        if not self.native_thread_ref:
            raise RuntimeError("opencode returned no session id")

    # -- turns -----------------------------------------------------------------------------------

    async def start_turn(self, text: str) -> None:
        body: dict[str, Any] = {"parts": [{"type": "text", "text": text}]}
        if self._system:  # opencode's system prompt is per prompt
            body["system"] = self._system
        if self._model and "/" in self._model:
            provider_id, _, model_id = self._model.partition("/")
            body["model"] = {"providerID": provider_id, "modelID": model_id}
        async with self._turn_starting():
            self._busy, self._error = False, None
            await self._request("POST", f"/session/{self.native_thread_ref}/prompt_async", body)

    async def interrupt_turn(self) -> None:
        self._interrupted = True
        for native_ref in list(self._requests):
            await self._reply(native_ref, "reject")
        if not self._in_turn:
            return
        try:
            await self._request("POST", f"/session/{self.native_thread_ref}/abort", {})
        except (_HttpError, ConnectionError, OSError) as exc:
            log.info("opencode abort not applied: %s", exc)

    async def respond(self, native_ref: str, decision: str | None,
                      answers: Mapping[str, Any] | None) -> None:
        if native_ref not in self._requests:
            raise RuntimeError(f"no pending permission request {native_ref} on this session")
        await self._reply(native_ref, _OPENCODE_REPLIES.get(decision or "", "reject"))

    async def _reply(self, native_ref: str, reply: str) -> None:
        self._requests.pop(native_ref, None)
        try:
            await self._request("POST", f"/permission/{native_ref}/reply", {"reply": reply})
        except (_HttpError, ConnectionError, OSError) as exc:
            log.info("opencode permission reply not applied: %s", exc)

    # -- incoming --------------------------------------------------------------------------------

    async def _exited(self) -> None:
        """Its stdout is text, not the protocol: the process's exit ends the session."""
        await self._process.proc.wait()  # first: _forget says the exit code
        await self._ended()

    def _on_output(self, line: str) -> None:
        if (found := _OPENCODE_LISTENING.search(line)) and not self._listening.done():
            self._listening.set_result(found.group(1))

    def _forget(self) -> None:
        super()._forget()
        for future in (self._listening, self._subscribed):
            if not future.done():
                future.set_exception(ConnectionError(
                    f"opencode serve exited (exit code {self._process.proc.returncode})"))

    async def _read_events(self) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self._port)
            writer.write((f"GET {self._target('/event')} HTTP/1.1\r\n"
                          f"Host: 127.0.0.1:{self._port}\r\nAuthorization: {self._auth}\r\n"
                          "Accept: text/event-stream\r\n\r\n").encode())
            await writer.drain()
            status, headers = await _http_head(reader)
            if status != 200:
                raise ConnectionError(f"GET /event answered {status}")
            buffer = b""
            async for chunk in _http_body_chunks(reader, headers):
                buffer += chunk.replace(b"\r\n", b"\n")
                while b"\n\n" in buffer:
                    record, buffer = buffer.split(b"\n\n", 1)
                    data = "\n".join(line[5:].lstrip() for line in
                                     record.decode(errors="replace").split("\n")
                                     if line.startswith("data:"))
                    if not data:
                        continue
                    self._adapter.protocol_log.write(f"{self._label} <- event {data}")
                    if not self._subscribed.done():
                        self._subscribed.set_result(None)
                    try:
                        event = parse_json(data)
                    except ValueError:
                        continue
                    if isinstance(event, dict):
                        await self._on_event(str(event.get("type")), event.get("properties") or {})
        except (ConnectionError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
            if not self._closing:
                log.warning("%s: event stream ended: %s", self._label, exc)
            if not self._subscribed.done():
                self._subscribed.set_exception(ConnectionError(str(exc)))

    async def _on_event(self, kind: str, props: Mapping[str, Any]) -> None:
        # Only the root session (this thread's) streams text and ends the turn; child sessions
        # (opencode's subagents) still raise permission asks, which t3 answers the same way.
        root = self.native_thread_ref
        if kind == "message.updated":
            info = props.get("info") or {}
            self._roles[str(info.get("id"))] = str(info.get("role"))
        elif kind == "message.part.updated":
            part = props.get("part") or {}
            if part.get("sessionID") == root:
                await self._on_part(part)
        elif kind == "message.part.delta":
            part_id = str(props.get("partID"))
            if props.get("sessionID") == root and props.get("field", "text") == "text" and \
                    self._roles.get(str(props.get("messageID"))) == "assistant":
                await self._emit_text(part_id, self._parts.get(part_id, "text"),
                                      str(props.get("delta") or ""))
        elif kind == "permission.asked":
            await self._on_permission(props)
        elif kind == "permission.replied":
            self._requests.pop(str(props.get("requestID") or props.get("permissionID")), None)
        elif kind == "session.status" and props.get("sessionID") == root:
            status = (props.get("status") or {}).get("type")
            if status == "busy":
                self._busy = True
            elif status == "idle":
                await self._turn_over()
        elif kind == "session.idle" and props.get("sessionID") == root:
            await self._turn_over()
        elif kind == "session.error" and props.get("sessionID") in (root, None):
            error = props.get("error") or {}
            if error.get("name") == "MessageAbortedError":
                self._interrupted = True
            else:
                self._error = str((error.get("data") or {}).get("message")
                                  or error.get("name") or "opencode failed the turn")
            self._busy = True

    async def _on_part(self, part: Mapping[str, Any]) -> None:
        part_id, part_type = str(part.get("id")), str(part.get("type"))
        self._parts[part_id] = part_type
        if part_type in ("text", "reasoning"):
            if self._roles.get(str(part.get("messageID"))) != "assistant":
                return
            full = str(part.get("text") or "")
            sent = self._sent.get(part_id, 0)
            if len(full) > sent:
                await self._emit_text(part_id, part_type, full[sent:])
        elif part_type == "tool":
            state = part.get("state") or {}
            status = _OPENCODE_TOOL_STATUS.get(str(state.get("status")), "running")
            output = state.get("output") if status == "completed" else state.get("error")
            if self._tools.get(part_id) == (status, output):
                return
            self._tools[part_id] = (status, output)
            tool = str(part.get("tool") or "")
            await self.events.put(ToolUpdate(
                native_id=str(part.get("callID") or part_id), status=status,
                title=state.get("title") or tool,
                tool_kind="execute" if tool == "bash" else "edit"
                if tool in _OPENCODE_EDIT_TOOLS else tool,
                input=state.get("input"),
                output=None if output is None else str(output)))

    async def _emit_text(self, part_id: str, part_type: str, text: str) -> None:
        if not text:
            return
        self._sent[part_id] = self._sent.get(part_id, 0) + len(text)
        await self.events.put(ReasoningDelta(text) if part_type == "reasoning" else TextDelta(text))

    async def _on_permission(self, props: Mapping[str, Any]) -> None:
        native_ref = str(props.get("id"))
        permission = str(props.get("permission") or "")
        if self._never_asks(edit=permission in _OPENCODE_EDIT_TOOLS):
            await self._reply(native_ref, "once")
            return
        kind = "command" if permission == "bash" else "file-change" \
            if permission in _OPENCODE_EDIT_TOOLS else "permission"
        metadata = props.get("metadata") or {}
        subject = metadata.get("command") or ", ".join(map(str, props.get("patterns") or []))
        await self._hold(RuntimeRequestOpened(
            native_ref=native_ref, request_kind=kind,
            title=f"Allow {permission}{': ' + str(subject) if subject else ''}?",
            detail={"permission": permission, "patterns": props.get("patterns"),
                    "metadata": metadata, "sessionID": props.get("sessionID")}), props)

    async def _turn_over(self) -> None:
        if not self._in_turn or not self._busy:
            return  # an idle from before this turn started
        self._requests.clear()  # nothing can answer them any more
        await self._end_turn(self._error and f"opencode failed the turn: {self._error}",
                             interrupted=self._interrupted)


class OpenCodeAdapter(DriverAdapter):
    """``opencode serve``: one HTTP server process per session, driven over REST and SSE."""

    CAPABILITIES = Capabilities(supports_resume=True, supports_mcp=True)

    async def _probe_cli(self) -> tuple[list[dict[str, Any]], str | None]:
        """``opencode models``: one ``provider/model`` per line, in opencode's order. opencode
        runs free models without a login, so it is never reported as not logged in."""
        out = await self._cli_output("models")
        return [{"id": line.strip()} for line in out.splitlines()
                if re.fullmatch(r"[\w.@-]+/\S+", line.strip())], None

    def _config_content(self, runtime_mode: str) -> str:
        """The instance's own OPENCODE_CONFIG_CONTENT (providers, model) plus t3's settings."""
        try:
            content = json.loads(self.config.env.get("OPENCODE_CONFIG_CONTENT") or "{}")
        except json.JSONDecodeError:
            content = {}
        content.setdefault("autoupdate", False)
        content.setdefault("share", "disabled")
        ask = "ask" if runtime_mode in ("approval-required", "auto-accept-edits") else "allow"
        edit = "ask" if runtime_mode == "approval-required" else "allow"
        content["permission"] = {**(content.get("permission") or {}), "bash": ask, "edit": edit}
        return json.dumps(content)

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None) -> OpenCodeSession:
        self._check_available()
        port = _free_port()
        password = uuid.uuid4().hex
        command = [*self.config.command, "--hostname", "127.0.0.1", "--port", str(port)]
        env = {"OPENCODE_DISABLE_AUTOUPDATE": "1", **self._env(
            thread_id, OPENCODE_CONFIG_CONTENT=self._config_content(runtime_mode),
            OPENCODE_SERVER_PASSWORD=password)}
        process = await self._spawn(command, cwd, env)
        session = OpenCodeSession(self, process, runtime_mode=runtime_mode, port=port,
                                  password=password, cwd=cwd, model=model)
        return await opened(session, session.open(resume_ref=resume_ref, mcp=mcp))


# =============================================================================================
# The driver table's adapters


_ADAPTERS: dict[str, type[DriverAdapter]] = {
    "acp": AcpAdapter, "grok": GrokAdapter, "claudeAgent": ClaudeAdapter, "codex": CodexAdapter,
    "pi": PiAdapter, "opencode": OpenCodeAdapter}
