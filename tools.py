"""tools.py: t3's operations, and their MCP framing (server key ``t3-code``, server name ``t3``).

``OPERATIONS`` is the one table of what callers may do: each operation has a name, a hand-written
input JSON Schema (``anyOf``, never a ``type`` array, so every client takes it) and the exact
shape of its result, who may call it (``client``: the client token, over MCP or as a person over
/ws; ``thread``: an agent inside a t3 thread) and a handler, a plain function ``(kit, call,
args)``; feature modules add theirs (``register``, and ``register_wire`` for a wire command)
or wrap one (``replace_operation``: links.py's, which calls the core's handler). MCP
publishes the operations that are tools; ``t3.py``'s /ws methods call the same entries by their
/ws names (``dispatchCommand`` takes T3 Code's wire commands). Arguments are checked here
against that one schema (the SDK's low-level server does not): unknown fields are refused, and a
violation is ``invalid_request`` naming the field. Handlers check the caller's scope, make
orchestrator commands with ids derived from ``clientRequestId`` and the caller, and shape
results. Every denial is an ``orchestrator.T3Error`` with its typed code; MCP shapes it once
(``isError: true``, ``structuredContent = {"_tag": "OrchestratorMcpFailure", code, message}``),
/ws once (``t3.py``). No SQL, subprocesses or provider calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import os
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.server import Server, ServerRequestContext

import orchestrator as orch
from orchestrator import RUN_TERMINAL, RunStatus, T3Error, ThreadState
from store import Store, StoreError

__all__ = ["FAILURE_CODES", "FAILURE_OUTPUT", "Scope", "current_scope", "Call", "Operation",
           "OPERATIONS", "TOOLS", "replace_operation", "Project", "ServerContext", "Toolkit",
           "build_mcp_server", "failure_of", "failure_result", "published_input",
           "published_output", "validate"]

log = logging.getLogger("t3.tools")

FAILURE_CODES = frozenset({
    "capability_denied", "parent_not_active", "provider_unavailable", "model_unavailable",
    "runtime_mode_escalation_denied", "interaction_mode_escalation_denied", "task_not_found",
    "task_not_cancellable", "thread_not_found", "run_not_found", "thread_not_sendable",
    "thread_not_interruptible", "invalid_request", "orchestration_error",
    "thread_credential_required"})

DEFAULT_WAIT_MS = 30_000
MAX_WAIT_MS = 600_000
PROGRESS_EVERY_S = 5.0  # a wait reports progress this often
# Threads and messages made through MCP: by an agent (or a client acting as one), over MCP.
_AGENT_MADE = {"created_by": orch.Actor.AGENT, "creation_source": orch.CreationSource.MCP}
READ_BUDGET_CHARS = 30_000
DEFAULT_ITEM_CHARS = 20_000
TRUNCATION_MARK = "\n…[truncated]"
MIN_ITEM_CHARS = 1_000  # an item cut to fit a page keeps at least this much of its text
TRANSFER_SUMMARY_CHARS = 1_000  # a read's transfer summary (the whole is the task's result)
# A list's page unless it asks for more: a shell is about 1,000 characters, and a result of many
# more than READ_BUDGET_CHARS passes what some agents take from a tool (Claude Code saves it to
# a file instead).
LIST_PAGE = 20


@dataclass(frozen=True, slots=True)
class Scope:
    """Who is calling: the client token, or an agent in a thread (provider-session credential)."""

    kind: str  # client | thread
    key: str  # stable caller identity for idempotency keys
    thread_id: str | None = None
    provider_instance_id: str | None = None
    provider_session_id: str | None = None  # the session whose agent holds the credential
    capabilities: frozenset[str] = frozenset({"orchestration"})


current_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("t3_scope",
                                                                             default=None)
Args = Mapping[str, Any]  # a tool's arguments, validated


Progress = Callable[[float, str], Awaitable[None]]
Emit = Callable[[Any], Awaitable[None]]  # a stream's item: a dict, or prebuilt JSON text


@dataclass(frozen=True, slots=True)
class Call:
    """One call of an operation: who calls, and where what it makes comes from (``mcp``: made
    by an agent, or a client acting as one; ``web`` or ``cli``: by a person over /ws); a /ws
    stream's items go to ``emit``."""

    scope: Scope
    source: str = "mcp"
    progress: Progress | None = None
    emit: Emit | None = None

    @property
    def made_by(self) -> dict[str, str]:
        return _AGENT_MADE if self.source == "mcp" else {
            "created_by": orch.Actor.USER, "creation_source": orch.CreationSource(self.source)}

    @property
    def space(self) -> str:
        """The id space of its commands: one per transport, so a /ws call never meets an MCP
        call's ids."""
        return "mcp" if self.source == "mcp" else "ws"


def failure_of(exc: Exception, what: str) -> tuple[str, str]:
    """(code, message) of a failed operation, for each transport to shape: a T3Error's own; a
    store that could not write (a full disk: the transaction rolled back, nothing was written);
    else an internal error, logged."""
    if isinstance(exc, T3Error):
        return exc.code, str(exc)
    if isinstance(exc, StoreError):
        log.warning("%s could not write: %s", what, exc)
        return "orchestration_error", f"t3 could not record this: {exc}"
    log.error("%s failed", what, exc_info=exc)
    return "orchestration_error", "t3 hit an internal error; see the server log."


@dataclass(frozen=True, slots=True)
class Project:
    id: str
    path: str
    title: str
    setup: tuple[str, ...] = ()  # shell commands run in a new worktree before its first turn


@dataclass(slots=True)
class ServerContext:
    environment_id: str
    projects: list[Project]
    data_dir: Path
    max_delegation_depth: int = 5
    max_scheduled_tasks_per_project: int = 20  # agents make no task beyond it
    min_agent_task_interval_s: int = 900  # the shortest interval of an agent's task
    base_url: str = "http://127.0.0.1"  # the server's own URL (webhook URLs name it)
    scratch_project: Project = field(init=False)

    def __post_init__(self) -> None:
        self.scratch_project = Project("scratch", str(self.data_dir / "scratch"), "Scratch")

    def project(self, project_id: str | None, *, listing: bool = False) -> Project:
        """A configured project (the first by default). ``scratch`` is the folder that holds
        every scratch workspace: its threads can be listed, but a thread made there would run in
        all of them (``t3_thread_launch`` with ``scratch: true`` gives each its own folder)."""
        if project_id is None:
            return self.projects[0]
        for project in [*self.projects, *([self.scratch_project] if listing else [])]:
            if project.id == project_id:
                return project
        if project_id == self.scratch_project.id:
            raise T3Error("projectId: scratch threads are made by t3_thread_launch with scratch: "
                          "true, each in its own folder", code="invalid_request")
        raise T3Error(f"projectId: unknown project {project_id!r}", code="invalid_request")

    def link(self, thread_id: str) -> str:
        return f"t3-thread://v2/{self.environment_id}/{thread_id}"

    def links(self, thread_id: str) -> dict[str, str]:
        """A thread's ``link``, which t3's own clients open; for a person (the client token)
        also ``webUrl``, the thread in this server's web view, which any browser opens."""
        scope = current_scope.get()
        if scope is None or scope.kind != "client":
            return {"link": self.link(thread_id)}
        return {"link": self.link(thread_id), "webUrl": f"{self.base_url}/#thread="
                                                        f"{_fragment(thread_id)}"}


@functools.lru_cache(maxsize=4096)  # each list page quotes its ids again
def _fragment(thread_id: str) -> str:
    return urllib.parse.quote(thread_id, safe="")


# =============================================================================================
# Schemas and validation


def text_field(max_len: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_len, "trim": True}


TITLE = {**text_field(512), "line": True}  # "line", ours as "trim": no orch.CONTROL_CHARACTERS


RUNTIME_INPUT = {"type": "string", "enum": ["inherit", *orch.RuntimeMode]}
INTERACTION_INPUT = {"type": "string", "enum": ["inherit", *orch.InteractionMode]}
TARGET = {"type": "object", "additionalProperties": False, "properties": {
    "providerInstanceId": text_field(64), "driverKind": text_field(64), "model": text_field(256),
    "environmentId": text_field(64),  # another t3's instance (links.py); left out: this one
    "options": {"anyOf": [{"type": "array"}, {"type": "object"}]}}}
CLIENT_REQUEST_ID = text_field(256)
THREAD_ID = text_field(512)
RUN_STATUSES = ["idle", *RunStatus]
BRANCH = text_field(256)
# The seed's forms (Toolkit.launch).
WORKSPACE_STRATEGY = {"anyOf": [
    {"type": "string", "enum": ["root"]},
    {"type": "object", "additionalProperties": False, "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["root"]}}},
    {"type": "object", "additionalProperties": False, "required": ["type", "baseRef"],
     "properties": {"type": {"type": "string", "enum": ["worktree"]}, "baseRef": BRANCH,
                    "branch": BRANCH, "startFromOrigin": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["type", "worktreePath"],
     "properties": {"type": {"type": "string", "enum": ["existing_worktree"]},
                    "worktreePath": text_field(4096), "branch": BRANCH}}]}


def obj(properties: Mapping[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": dict(properties),
            "required": list(required)}


def validate(schema: Mapping[str, Any], value: Any, path: str = "") -> Any:
    """Check ``value`` against the subset of JSON Schema our tools use; return it normalized."""
    name = path or "arguments"
    if "anyOf" in schema:
        return validate(_branch(schema["anyOf"], value, name), value, path)
    kind = schema.get("type")
    if kind and not _is_type(value, kind):
        raise T3Error(f"{name}: expected {kind}", code="invalid_request")
    if isinstance(value, str):
        if schema.get("trim"):
            value = value.strip()
        if "minLength" in schema and len(value) < schema["minLength"]:
            raise T3Error(f"{name}: must not be empty", code="invalid_request")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise T3Error(f"{name}: longer than {schema['maxLength']} "
                          "characters", code="invalid_request")
        if schema.get("line") and (bad := [c for c in value if ord(c) in orch.CONTROL_CHARACTERS]):
            raise T3Error(f"{name}: holds control character U+"
                          f"{ord(bad[0]):04X} (one line of plain text)", code="invalid_request")
    if "enum" in schema and value not in schema["enum"]:
        raise T3Error(f"{name}: must be one of "
                      f"{', '.join(map(str, schema['enum']))}", code="invalid_request")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise T3Error(f"{name}: must be >= {schema['minimum']}", code="invalid_request")
        if "maximum" in schema and value > schema["maximum"]:
            raise T3Error(f"{name}: must be <= {schema['maximum']}", code="invalid_request")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise T3Error(f"{name}: needs at least {schema['minItems']}", code="invalid_request")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise T3Error(f"{name}: at most {schema['maxItems']} allowed", code="invalid_request")
        if "items" in schema:
            value = [validate(schema["items"], v, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        for key in value:
            if key not in props and schema.get("additionalProperties") is False:
                raise T3Error(f"{_join(path, key)}: unknown field", code="invalid_request")
        for key in schema.get("required", ()):
            if key not in value:
                raise T3Error(f"{_join(path, key)}: required", code="invalid_request")
        # An optional field sent as null counts as absent: models often fill every field.
        value = {k: validate(props[k], v, _join(path, k)) if k in props else v
                 for k, v in value.items() if v is not None or k in schema.get("required", ())}
    return value


def _branch(branches: Sequence[Mapping[str, Any]], value: Any, name: str) -> Mapping[str, Any]:
    """The ``anyOf`` branch ``value`` is checked against: the one of its JSON type, and among
    objects the one whose ``type`` property names it (``{"type": "worktree", ...}``), so that
    an error names the field that is wrong rather than every branch."""
    fitting = [b for b in branches if "type" not in b or _is_type(value, b["type"])]
    if not fitting:
        kinds = dict.fromkeys(str(b["type"]) for b in branches)
        raise T3Error(f"{name}: expected {' or '.join(kinds)}", code="invalid_request")
    tags = [b.get("properties", {}).get("type", {}).get("enum") for b in fitting]
    if len(fitting) == 1 or not isinstance(value, dict) or not all(tags):
        return fitting[0]
    for branch, tag in zip(fitting, tags):
        if value.get("type") in tag:
            return branch
    kinds = ", ".join(str(t) for tag in tags for t in tag)
    problem = "required" if value.get("type") is None else f"must be one of {kinds}"
    raise T3Error(f"{name}.type: {problem}", code="invalid_request")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_type(value: Any, kind: str) -> bool:
    return {"string": isinstance(value, str), "object": isinstance(value, dict),
            "array": isinstance(value, list), "boolean": isinstance(value, bool),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "null": value is None}.get(kind, False)


def _public_schema(schema: Any) -> Any:
    """The schema as published: without our private ``trim`` and ``line`` keywords."""
    if isinstance(schema, dict):
        return {k: _public_schema(v) for k, v in schema.items() if k not in ("trim", "line")}
    if isinstance(schema, list):
        return [_public_schema(v) for v in schema]
    return schema


# =============================================================================================
# Output schemas: each tool's success structuredContent exactly (every key required unless the
# handler may leave it out; a missing value is anyOf with null), and the typed failure's.


def nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"anyOf": [dict(schema), {"type": "null"}]}


def list_of(items: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": dict(items)}


def shape(properties: Mapping[str, Any], optional: Sequence[str] = ()) -> dict[str, Any]:
    """An object with exactly these keys."""
    return obj(properties, [k for k in properties if k not in optional])


def enum_of(values: Sequence[str]) -> dict[str, Any]:
    return {"type": "string", "enum": [str(v) for v in values]}


STRING: Mapping[str, Any] = {"type": "string"}
INTEGER: Mapping[str, Any] = {"type": "integer"}
BOOLEAN: Mapping[str, Any] = {"type": "boolean"}
OPT_STRING = nullable(STRING)
OPT_INTEGER = nullable(INTEGER)
THREAD_STATUS = enum_of(RUN_STATUSES)
ACTOR, SOURCE = enum_of(list(orch.Actor)), enum_of(list(orch.CreationSource))
RUNTIME, INTERACTION = enum_of(list(orch.RuntimeMode)), enum_of(list(orch.InteractionMode))
FEATURES = {"appOwnedSubagents": True, "asyncPolling": True, "cancellation": True,
            "batchThreadCreation": True, "threadManagement": True,
            "incrementalThreadRead": True, "scheduledTasks": True, "maxBatchThreads": 20}
PENDING_APPROVAL = nullable(shape({"requestId": STRING, "kind": STRING, "runId": STRING}))
ANSWERED_BY = {"anyOf": [shape({"kind": enum_of(["client"])}),
                         shape({"kind": enum_of(["thread"]), "threadId": STRING})]}
FAILURE_OUTPUT = shape({"_tag": enum_of(["OrchestratorMcpFailure"]),
                        "code": enum_of(sorted(FAILURE_CODES)), "message": STRING})

_CREATED = {"threadId": STRING, "runId": OPT_STRING, "status": THREAD_STATUS, "title": STRING,
            "createdBy": ACTOR, "creationSource": SOURCE, "providerInstanceId": STRING,
            "model": OPT_STRING, "projectId": STRING, "link": STRING, "webUrl": STRING}
_WEB = ["webUrl"]  # only in the client token's results (ServerContext.links)
_LINEAGE = {"parentThreadId": OPT_STRING, "relationshipToParent": OPT_STRING}
PULL_REQUEST = nullable(shape({"repository": STRING, "number": INTEGER, "url": STRING}))
TITLE_REGENERATION = nullable(shape({"requestId": STRING, "startedAt": STRING}))
# What a person did with a thread, and what it still waits on (the seed's shell fields).
_THREAD_STATE = {"archived": BOOLEAN, "snoozed": BOOLEAN, "snoozedUntil": OPT_STRING,
                 "blockedOnThreadWait": BOOLEAN, "pendingBackgroundTasks": INTEGER,
                 "linkedPullRequest": PULL_REQUEST}
_THREAD_SHELL = shape({
    "threadId": STRING, "title": STRING, "createdBy": ACTOR, "creationSource": SOURCE,
    "status": THREAD_STATUS, "latestRunId": OPT_STRING, "providerInstanceId": STRING,
    "model": OPT_STRING, "runtimeMode": RUNTIME, "interactionMode": INTERACTION,
    "branch": OPT_STRING, "worktreePath": OPT_STRING, **_LINEAGE,
    "itemCount": INTEGER, "pendingRequestCount": INTEGER, "createdAt": STRING,
    "updatedAt": STRING, "link": STRING, "webUrl": STRING, **_THREAD_STATE}, _WEB)
_THREAD_DETAIL = shape({
    "threadId": STRING, "projectId": STRING, "title": STRING, "createdBy": ACTOR,
    "creationSource": SOURCE, "status": THREAD_STATUS, "latestRunId": OPT_STRING,
    "activeRunId": OPT_STRING, "providerInstanceId": STRING, "model": OPT_STRING,
    "runtimeMode": RUNTIME, "interactionMode": INTERACTION, "branch": OPT_STRING,
    "worktreePath": OPT_STRING, "workspacePath": OPT_STRING, **_LINEAGE, "runCount": INTEGER,
    "itemCount": INTEGER, "pendingRequestCount": INTEGER, **_THREAD_STATE,
    "titleRegeneration": TITLE_REGENERATION, "createdAt": STRING, "updatedAt": STRING,
    "link": STRING, "webUrl": STRING}, _WEB)
_RUN_SUMMARY = shape({
    "runId": STRING, "ordinal": INTEGER, "status": enum_of(list(RunStatus)),
    "statusReason": OPT_STRING, "providerInstanceId": STRING, "model": OPT_STRING,
    "requestedAt": STRING, "startedAt": OPT_STRING, "completedAt": OPT_STRING,
    "attemptCount": INTEGER, "queuePosition": OPT_INTEGER, "queueHeld": BOOLEAN})
_TRANSFER = shape({
    "id": STRING, "type": STRING, "sourceThreadId": STRING, "targetThreadId": STRING,
    "status": STRING, "createdBy": STRING, "createdAt": STRING, "updatedAt": STRING,
    "targetRunId": OPT_STRING, "summary": OPT_STRING, "consumedAt": OPT_STRING,
    # a fork's: where it starts and how its first run got the context (native_fork or not)
    "sourcePoint": {"type": "object"}, "resolution": {"type": "object"}},
    ["sourcePoint", "resolution"])
_TIMELINE_ITEM = shape({
    "position": INTEGER, "visibility": enum_of(["local"]), "sourceThreadId": STRING,
    "itemId": STRING, "runId": OPT_STRING, "messageId": OPT_STRING, "role": OPT_STRING,
    "createdBy": ACTOR, "creationSource": SOURCE, "type": STRING, "status": STRING,
    "title": OPT_STRING, "text": OPT_STRING, "textTruncated": BOOLEAN, "updatedAt": STRING,
    "answeredBy": ANSWERED_BY}, optional=["answeredBy"])
_TASK = shape({
    "taskId": STRING, "childThreadId": STRING, "childRunId": STRING, "childNodeId": STRING,
    "status": enum_of([*sorted(orch.TASK_TERMINAL), "running", "queued", "waiting"]),
    "workState": enum_of(["working", "waiting_for_children", "result_available"]),
    "hasPendingChildRuns": BOOLEAN, "providerInstanceId": STRING, "model": OPT_STRING,
    "summary": OPT_STRING, "resultContextTransferId": OPT_STRING,
    "latestTerminalRunId": OPT_STRING, "latestTerminalStatus": nullable(enum_of(
        sorted(RUN_TERMINAL))), "latestTerminalSummary": OPT_STRING,
    "latestTerminalResultContextTransferId": OPT_STRING, "hasPendingQuestion": BOOLEAN,
    "pendingApproval": PENDING_APPROVAL, "waitTimedOut": BOOLEAN, "childThreadLink": STRING})
_REQUEST = {"requestId": STRING, "kind": STRING, "title": STRING, "status": STRING,
            "runId": STRING, "createdAt": STRING, "options": {"type": "array"}}

CAPABILITIES_OUTPUT = shape({
    "parentThreadId": OPT_STRING, "inheritedProviderInstanceId": OPT_STRING,
    "inheritedModel": OPT_STRING, "runtimeMode": nullable(RUNTIME),
    "interactionMode": nullable(INTERACTION),
    "providers": list_of(shape({
        "providerInstanceId": STRING, "driverKind": STRING, "displayName": OPT_STRING,
        "models": list_of(shape({"id": STRING, "label": OPT_STRING,
                                "options": list_of({"type": "object"})}, optional=["options"])),
        "omittedModels": INTEGER, "canRunChildTask": BOOLEAN,
        "canRunCrossProviderChildTask": BOOLEAN, "constraints": list_of(STRING),
        "runtimeModes": list_of(RUNTIME), "interactionModes": list_of(INTERACTION),
        "nodes": list_of(STRING)}, optional=["runtimeModes", "interactionModes", "nodes"])),
    "features": shape({k: BOOLEAN if isinstance(v, bool) else INTEGER
                       for k, v in FEATURES.items()})})
TASK_CANCEL_OUTPUT = shape({"taskId": STRING, "status": enum_of(
    [*sorted(orch.TASK_TERMINAL), "cancel_requested"])})
CREATE_OUTPUT = shape({"threads": list_of(shape(_CREATED, _WEB))})
LAUNCH_OUTPUT = shape({**_CREATED, "workspaceStrategy": enum_of(
    ["root", "scratch", "worktree", "existing_worktree"]), "workspacePath": STRING,
    "branch": OPT_STRING, "worktreePath": OPT_STRING}, _WEB)
LIST_OUTPUT = shape({"projectId": STRING, "currentThreadId": OPT_STRING,
                     "threads": list_of(_THREAD_SHELL), "nextCursor": OPT_INTEGER,
                     "total": INTEGER})
READ_OUTPUT = shape({"thread": _THREAD_DETAIL, "transfers": list_of(_TRANSFER),
                     "recentRuns": list_of(_RUN_SUMMARY), "items": list_of(_TIMELINE_ITEM),
                     "nextPosition": OPT_INTEGER, "hasMore": BOOLEAN,
                     "earlierPosition": OPT_INTEGER, "link": STRING, "webUrl": STRING}, _WEB)
SEND_OUTPUT = shape({"threadId": STRING, "messageId": STRING, "runId": STRING,
                     "status": nullable(enum_of(list(RunStatus))),
                     "delivery": nullable(enum_of(["started", "queued", "steered",
                                                   "restarted"]))})
WAIT_OUTPUT = shape({"threadId": STRING, "runId": OPT_STRING, "status": THREAD_STATUS,
                     "statusReason": OPT_STRING, "timedOut": BOOLEAN,
                     "hasPendingQuestion": BOOLEAN, "pendingApproval": PENDING_APPROVAL})
INTERRUPT_OUTPUT = shape({"threadId": STRING, "runId": OPT_STRING, "status": enum_of(
    [*sorted(RUN_TERMINAL), "interrupt_requested", "no_active_run"])})
PENDING_REQUEST_OUTPUT = {"type": "object", "anyOf": [  # one shape per action
    shape({"threadId": STRING, "requests": list_of(shape(_REQUEST))}),
    shape({"threadId": STRING, "request": shape({
        **_REQUEST, "detail": {"type": "object"}, "decision": OPT_STRING,
        "answers": nullable({"type": "object"}), "answeredBy": nullable(ANSWERED_BY),
        "resolvedAt": OPT_STRING, "statusReason": OPT_STRING})}),
    shape({"threadId": STRING, "requestId": STRING, "status": STRING,
           "decision": OPT_STRING})]}


# /ws's shapes, and the client commands of dispatchCommand in T3 Code's wire form: what
# a T3 client always sends and the server derives itself (createdBy, createdAt, ...) is checked or
# ignored, never refused as unknown.
OBJECT: Mapping[str, Any] = {"type": "object"}
SEED_TITLE = {"type": "string", "maxLength": 512, "line": True}  # (may be empty: none given)
_SELECTION = obj({"instanceId": THREAD_ID, "model": THREAD_ID})
_MODES = {"runtimeMode": RUNTIME_INPUT, "interactionMode": INTERACTION_INPUT}
_INITIAL = obj({"messageId": CLIENT_REQUEST_ID, "text": text_field(120_000)}, ["text"])
_WAKE = {"type": "string", "enum": ["always", "settled_only"]}
_REASON = {"type": "string", "maxLength": 2000}
_THREAD = {"threadId": THREAD_ID}
_TASK_REF = {"parentThreadId": THREAD_ID, "taskId": THREAD_ID}


def _wire(kind: str, properties: Mapping[str, Any], required: Sequence[str] = ("threadId",)
          ) -> dict[str, Any]:
    return obj({"type": {"type": "string", "enum": [kind]}, "commandId": CLIENT_REQUEST_ID,
                "createdBy": enum_of(["user"]),  # a person: the client token, over /ws
                "createdAt": STRING, **properties}, ["type", "commandId", *required])


_WIRE_COMMANDS = [_wire(kind, *rest) for kind, *rest in (
    ("thread.create", {"threadId": CLIENT_REQUEST_ID, "projectId": text_field(256),
                       "title": SEED_TITLE, "modelSelection": _SELECTION, **_MODES,
                       "initialMessage": _INITIAL,
                       "branch": BRANCH, "worktreePath": text_field(4096)}, ()),
    ("message.dispatch", {**_THREAD, "messageId": CLIENT_REQUEST_ID, "text": text_field(120_000),
                          "dispatchMode": obj({"type": enum_of([
                              "start_immediately", "queue_after_active", "steer_active",
                              "restart_active"]), "targetRunId": THREAD_ID}, ["type"]),
                          "attachments": {"type": "array"}, "titleSeed": STRING},
     ["threadId", "text"]),
    ("run.interrupt", {**_THREAD, "runId": THREAD_ID, "reason": _REASON}, ["threadId", "runId"]),
    ("runtime-request.respond", {**_THREAD, "requestId": THREAD_ID, "decision": enum_of(
        orch.DECISIONS), "answers": OBJECT}, ["threadId", "requestId"]),
    ("queued-run.cancel", {**_THREAD, "runId": THREAD_ID}, ["threadId", "runId"]),
    ("delegated_task.request", {
        "parentThreadId": THREAD_ID, "parentRunId": THREAD_ID, "parentNodeId": STRING,
        "task": text_field(120_000), "title": SEED_TITLE, "modelSelection": _SELECTION, **_MODES,
        "completionWake": _WAKE}, ["parentThreadId", "parentRunId", "task"]),
    ("delegated_task.wake-policy", {**_TASK_REF, "completionWake": _WAKE},
     ["parentThreadId", "taskId", "completionWake"]),
    ("delegated_task.cancel", {**_TASK_REF, "reason": _REASON}, ["parentThreadId", "taskId"]),
    ("thread.stop", {**_THREAD, "reason": _REASON}),
    ("provider.switch", {**_THREAD, "modelSelection": _SELECTION}, ["threadId", "modelSelection"]),
    ("thread.snooze", {**_THREAD, "snoozedUntil": THREAD_ID}, ["threadId", "snoozedUntil"]),
    ("thread.visit", {**_THREAD, "visitedAt": THREAD_ID}),
    ("thread.unsnooze", {**_THREAD, "reason": enum_of(["user"])}),
    *((kind, _THREAD) for kind in ("thread.resume", "thread.archive", "thread.unarchive",
                                   "thread.delete")))]
_WIRE_TYPES = {c.type: c for c in (orch.InterruptRun, orch.RespondRuntimeRequest,
                                   orch.CancelQueuedRun, orch.StopThread, orch.ResumeThread,
                                   orch.SetWakePolicy, orch.RequestTaskCancel)}
_WIRE_BUILDERS: dict[str, Callable[[Toolkit, Args, str], Any]] = {}  # register_wire's
_PROJECTION_KEYS = {"run": "runs", "run-attempt": "attempts", "node": "nodes",
                    "subagent": "subagents", "provider-session": "providerSessions",
                    "provider-thread": "providerThreads", "provider-turn": "providerTurns",
                    "runtime-request": "runtimeRequests", "message": "messages",
                    "turn-item": "turnItems", "context-transfer": "contextTransfers",
                    "context-handoff": "contextHandoffs", "checkpoint": "checkpoints"}


# =============================================================================================
# Operations: the entry, and the output schemas of the tools


ANYONE, THREAD, CLIENT = (frozenset({"client", "thread"}), frozenset({"thread"}),
                          frozenset({"client"}))


@dataclass(frozen=True, slots=True)
class Operation:
    """One entry of OPERATIONS. ``mcp``: published as the MCP tool ``name``; ``ws``: the /ws
    methods that call it (for a person: the client token)."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    handler: Callable[[Toolkit, Call, Args], Awaitable[dict[str, Any] | None]]
    output_schema: Mapping[str, Any]  # of a success; published_output adds the failure
    callers: frozenset[str] = ANYONE
    ws: tuple[str, ...] = ()
    mcp: bool = True
    read_only: bool = False
    destructive: bool = False


_CREATE_ENTRY = obj({"prompt": text_field(120_000), "title": TITLE, "target": TARGET,
                     "runtimeMode": RUNTIME_INPUT, "interactionMode": INTERACTION_INPUT})

ROLES = ["implementation", "research", "review", "design", "test", "general"]


# =============================================================================================
# The toolkit


class Toolkit:
    """The one application boundary every transport calls (MCP tools, /ws methods, the
    scheduler): ``run`` checks an operation's arguments and callers and runs its handler; the
    methods below hold the rules the handlers share, once: who the caller is and what it may
    touch, thread lookup, send-mode selection, waits, interrupts, answers, and the provider,
    model and modes a new thread gets."""

    def __init__(self, orchestrator: orch.Orchestrator, store: Store, context: ServerContext
                 ) -> None:
        self.orch, self.store, self.ctx = orchestrator, store, context

    async def call(self, name: str, arguments: Mapping[str, Any] | None, *,
                   progress: Progress | None = None) -> dict[str, Any]:
        """MCP: run tool ``name`` for the caller ``current_scope`` holds (set by t3.py's auth)."""
        tool = _BY_NAME.get(name)
        if tool is None:
            raise T3Error(f"unknown tool {name!r}", code="invalid_request")
        scope = current_scope.get()
        if scope is None or "orchestration" not in scope.capabilities:
            raise T3Error("this credential may not use orchestration", code="capability_denied")
        return await self.run(tool, Call(scope, "mcp", progress), arguments or {})

    async def run(self, op: Operation, call: Call, arguments: Mapping[str, Any]
                  ) -> dict[str, Any]:
        """One operation, for any transport: its arguments checked against its schema, its
        callers checked, its handler run. Raises T3Error for every expected denial."""
        args = validate(op.input_schema, dict(arguments))
        if call.scope.kind not in op.callers:
            if call.scope.kind == "client":
                self.thread_caller(call.scope, op.name)
            raise T3Error(f"{op.name} is for a person's client", code="capability_denied")
        reset = current_scope.set(call.scope)  # (ServerContext.links reads it)
        try:
            result = await op.handler(self, call, args)
        finally:
            current_scope.reset(reset)
        return _without_hook_tokens(result) if call.scope.kind == "thread" else result

    # -- callers, ids and lookup ------------------------------------------------------------

    def key(self, args: Args) -> str:
        return args.get("clientRequestId") or str(uuid.uuid4())

    @staticmethod
    def derive_id(kind: str, *parts: str) -> str:
        """An id derived from the caller, the tool and the retry key: the same call maps to the
        same id, two tools never share one, and none is longer than orch.MAX_ID_CHARS."""
        return orch.bounded_id(":".join([kind, *(urllib.parse.quote(p, safe="") for p in parts)]))

    async def thread(self, thread_id: str) -> ThreadState:
        state = await self.orch.state(thread_id)
        if state is None or state.thread is None or state.thread.deleted_at is not None:
            raise T3Error(f"thread {thread_id} was not found", code="thread_not_found")
        return state

    async def caller_thread(self, scope: Scope) -> ThreadState | None:
        return await self.orch.state(scope.thread_id) if scope.thread_id else None

    @staticmethod
    def thread_caller(scope: Scope, what: str) -> str:
        """The calling thread's id; the client token has none."""
        if scope.kind != "thread" or scope.thread_id is None:
            raise T3Error(f"{what} needs an agent running inside a t3 thread (a provider-session "
                          "credential)", code="thread_credential_required")
        return scope.thread_id

    async def agent_caller(self, scope: Scope, what: str) -> tuple[ThreadState, orch.Run]:
        """The calling thread and its active run, for tools that act on behalf of an agent."""
        self.thread_caller(scope, what)
        caller = await self.caller_thread(scope)
        run = _live_run(caller, scope) if caller else None
        if caller is None or run is None:
            raise T3Error(f"{what} needs an active run of the calling "
                          "thread owned by this provider session", code="parent_not_active")
        return caller, run

    async def require_live_caller(self, scope: Scope, target: ThreadState, what: str) -> None:
        """A thread caller changing another thread needs its own live run, and the target's
        modes may not be broader than the caller's (the ceiling)."""
        caller, thread = await self.caller_thread(scope), target.thread
        if caller is None or caller.thread is None or thread is None or \
                caller.thread.id == thread.id:
            return
        if _live_run(caller, scope) is None:
            raise T3Error(f"{what} on another thread needs an active "
                          "run of the calling thread", code="parent_not_active")
        self.ceiling(caller.thread, thread.runtime_mode, thread.interaction_mode)

    async def answering_thread(self, scope: Scope, target: ThreadState,
                               request: orch.RuntimeRequest) -> str:
        """An agent answers only its descendants' requests, with a live run, and only
        what its own runtime mode allows without asking; else it could approve its own work
        through another thread, voiding approval-required."""
        caller = await self.caller_thread(scope)
        if caller is None or caller.thread is None:
            raise T3Error("the calling thread is gone", code="parent_not_active")
        assert target.thread is not None
        if caller.thread.id not in await self.ancestors(target.thread):
            raise T3Error("an agent may answer only the requests of threads it delegated (its "
                          "descendants); the user answers the rest", code="capability_denied")
        if _live_run(caller, scope) is None:
            raise T3Error("answering a request needs an active run of "
                          "the calling thread", code="parent_not_active")
        needed = orch.mode_to_answer(request.kind_)
        mode = orch.RuntimeMode(caller.thread.runtime_mode)
        if needed is not None and orch.RUNTIME_RANK[mode] < orch.RUNTIME_RANK[needed]:
            raise T3Error(f"answering a {request.kind_} request needs runtime mode {needed} or "
                          f"broader; this thread runs in {mode}", code="capability_denied")
        return caller.thread.id

    async def ancestors(self, thread: orch.AppThread) -> list[str]:
        """The thread's parent, grandparent, ... through delegation lineage (a fork is a
        thread of its own: its source gains no say over it)."""
        found: list[str] = []
        lineage = thread.lineage
        while (parent_id := lineage.get("parentThreadId")) and parent_id != thread.id and \
                parent_id not in found and lineage.get("relationshipToParent") == "subagent":
            found.append(parent_id)  # (lineage cannot loop; the checks make sure)
            parent = await self.orch.state(parent_id)
            lineage = parent.thread.lineage if parent is not None and parent.thread else {}
        return found

    async def plan_delegation(self, parent: ThreadState, args: Args, *, command_id: str,
                              parent_run_id: str, title_from: str, wake: str,
                              made_by: Mapping[str, str]) -> orch.DelegateTask:
        """delegated_task.request, for delegate_task and /ws alike: the target, the modes
        (``modes``: never broader than the parent's) and the depth limit."""
        assert parent.thread is not None
        info, model = self.resolve_target(args.get("target"), parent)
        runtime, interaction = self.modes(args, parent, info)
        depth = len(await self.ancestors(parent.thread)) + 1
        if depth > self.ctx.max_delegation_depth:
            raise T3Error(f"delegate_task: the child would be {depth} levels deep, beyond "
                          f"max_delegation_depth = {self.ctx.max_delegation_depth} ([limits] in "
                          "t3.toml)", code="capability_denied")
        return orch.DelegateTask(
            command_id=command_id, thread_id=parent.thread.id, parent_run_id=parent_run_id,
            task=args["task"], title=orch.thread_title(args.get("title"), title_from,
                                                       "Delegated task"),
            provider_instance_id=info.instance_id, model=model, runtime_mode=runtime,
            interaction_mode=interaction, completion_wake=wake, **made_by)

    # -- send, wait, interrupt, answer, switch ----------------------------------------------

    async def send(self, thread_id: str, *, text: str, mode: str, command_id: str,
                   message_id: str, created_by: str, creation_source: str,
                   target: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``mode`` auto: steer the active provider turn if there is one, else start (or queue
        behind a run that cannot be steered yet); queue: a separate follow-up run; steer and
        restart: the active provider turn, which must exist. A ``target`` naming another
        provider instance or model switches the thread first: the message is a new run there
        (auto never steers across a switch)."""
        state = await self.thread(thread_id)  # (an archived thread: decide refuses, once)
        steerable = steerable_run(state)
        if target is not None:
            switch = await self.plan_switch(thread_id, target,
                                            command_id=orch.bounded_id(f"{command_id}:switch"))
            if (switch.provider_instance_id, switch.model) != (
                    state.thread.provider_instance_id, state.thread.model_selection.get("model")):
                if mode in ("steer", "restart"):
                    raise T3Error(f"mode {mode}: a message to another provider or model starts "
                                  "a new run; use auto or queue", code="invalid_request")
                steerable = None
            await self.orch.dispatch(switch)
        if mode in ("steer", "restart") and steerable is None:
            raise T3Error(f"thread {thread_id} has no active provider turn to {mode}",
                          code="thread_not_sendable")
        dispatch_mode, target = {
            "auto": ("steer_active", steerable.id) if steerable else ("start_immediately", None),
            "queue": ("queue_after_active", None),
            "steer": ("steer_active", steerable.id if steerable else None),
            "restart": ("restart_active", steerable.id if steerable else None),
        }[mode]
        result = await self.orch.dispatch(orch.DispatchMessage(
            command_id=command_id, thread_id=thread_id, message_id=message_id, text=text,
            created_by=created_by, creation_source=creation_source, mode=dispatch_mode,
            target_run_id=target))
        run = (await self.thread(thread_id)).run(result.result["runId"])
        return {"threadId": thread_id, "messageId": result.result["messageId"],
                "runId": result.result["runId"], "status": run.status if run else None,
                "delivery": result.result.get("delivery")}

    async def wait(self, thread_id: str, *, run_id: str | None, timeout_s: float,
                   progress: Callable[[float, str], Awaitable[None]] | None = None,
                   lender: tuple[str, str] | None = None) -> dict[str, Any]:
        """Until the run (``run_id``, else the latest) is terminal or one of its requests needs
        an answer, or the timeout; woken by commits, with ``progress`` every PROGRESS_EVERY_S.
        A timeout never cancels the work; shutdown ends the wait with the state as it is. An
        agent that waits (``lender``) lends its process slot to the thread's work meanwhile."""
        state = await self.thread(thread_id)
        if run_id is not None and state.run(run_id) is None:
            raise T3Error(f"run {run_id} was not found in {thread_id}", code="run_not_found")
        run = state.run(run_id) if run_id else state.latest_run()
        if run is None:
            return {"threadId": thread_id, "runId": None, "status": "idle", "statusReason": None,
                    "timedOut": False, "hasPendingQuestion": False, "pendingApproval": None}
        pinned = run.id

        def settled(s: ThreadState) -> bool:
            r = s.run(pinned)
            return r is None or r.status in RUN_TERMINAL or any(
                q.run_id == pinned for q in s.pending_requests())

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        done = settled(state)
        with self.orch.lending(lender, thread_id):
            while not done and not self.orch.stopping:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                done = await self.orch.wait_until([thread_id], lambda s: settled(s[thread_id]),
                                                  min(remaining, PROGRESS_EVERY_S))
                if not done and progress is not None and not self.orch.stopping:
                    await progress(timeout_s - max(0.0, deadline - loop.time()),
                                   "waiting for the run to finish")
        state = await self.thread(thread_id)
        current = state.run(pinned)
        pending = [q for q in state.pending_requests() if q.run_id == pinned]
        question = next((q for q in pending if q.kind_ == "user_input"), None)
        approval = next((q for q in pending if q.kind_ != "user_input"), None)
        status = current.status if current else "idle"
        return {"threadId": thread_id, "runId": pinned, "status": status,
                "statusReason": current.status_reason if current else None,
                "timedOut": not done and status not in RUN_TERMINAL and not pending,
                "hasPendingQuestion": question is not None,
                "pendingApproval": {"requestId": approval.id, "kind": approval.kind_,
                                    "runId": approval.run_id} if approval else None}

    async def interrupt(self, thread_id: str, *, run_id: str | None, reason: str | None,
                        command_id: str) -> dict[str, Any]:
        """Interrupt ``run_id``, else the newest active run. A terminal run is returned as it
        is; with no active provider turn (nothing active, or a ``waiting`` run: its turn ended)
        the status is ``no_active_run``."""
        state = await self.thread(thread_id)
        active = [r for r in state.runs if r.status in orch.RUN_LIVE or r.awaiting_agent_slot]
        if run_id is not None:
            run = state.run(run_id)
            if run is None:
                raise T3Error(f"run {run_id} was not found", code="run_not_found")
            if run.status in RUN_TERMINAL:
                return {"threadId": thread_id, "runId": run.id, "status": run.status}
            if run.status == RunStatus.WAITING:
                return {"threadId": thread_id, "runId": run.id, "status": "no_active_run"}
            if not active or active[-1].id != run.id:
                raise T3Error(f"run {run.id} is {run.status}; only the newest active run can be "
                              "interrupted", code="thread_not_interruptible")
        elif not active:
            return {"threadId": thread_id, "runId": None, "status": "no_active_run"}
        else:
            run = active[-1]
        result = await self.orch.dispatch(orch.InterruptRun(
            command_id=command_id, thread_id=thread_id, run_id=run.id, reason=reason))
        status = result.result.get("status", "interrupt_requested")
        return {"threadId": thread_id, "runId": run.id,
                "status": status if status in RUN_TERMINAL else "interrupt_requested"}

    async def respond(self, thread_id: str, *, request_id: str, decision: str | None,
                      answers: Mapping[str, Any] | None, answered_by: Mapping[str, Any],
                      command_id: str) -> dict[str, Any]:
        result = await self.orch.dispatch(orch.RespondRuntimeRequest(
            command_id=command_id, thread_id=thread_id, request_id=request_id,
            decision=decision, answers=answers, answered_by=answered_by))
        return {"threadId": thread_id, "requestId": request_id,
                "status": result.result.get("status", "resolved"), "decision": decision}

    async def plan_switch(self, thread_id: str, target: Mapping[str, Any], *, command_id: str
                          ) -> orch.SwitchProvider:
        """``provider.switch`` to ``target`` ({providerInstanceId?, driverKind?, model?}): the
        instance must be able to run the thread's interaction mode; its runtime mode steps down
        to the broadest the instance offers that is no broader."""
        state = await self.thread(thread_id)
        thread = state.thread
        assert thread is not None
        info, model = self.resolve_target(target, state)
        return orch.SwitchProvider(
            command_id=command_id, thread_id=thread_id, provider_instance_id=info.instance_id,
            model=model, runtime_mode=self.step_down(info, thread.runtime_mode, False,
                                                     thread.interaction_mode))

    # -- planning new threads: provider, model and modes ------------------------------------

    def resolve_target(self, target: Mapping[str, Any] | None, caller: ThreadState | None
                       ) -> tuple[orch.ProviderInfo, str | None]:
        """The provider instance and model a new thread runs on: the target's, else the
        caller's, else the first available instance; refused when it cannot run."""
        target = target or {}
        if target.get("environmentId", self.ctx.environment_id) != self.ctx.environment_id:
            raise T3Error(f"target.environmentId: {target['environmentId']} is not this t3's "
                          "environment, and no linked one can serve this call",
                          code="provider_unavailable")
        providers = self.orch.providers
        instance_id = target.get("providerInstanceId")
        driver = target.get("driverKind")
        if instance_id is None and driver is not None:
            candidates = [p for p in providers.values() if p.driver == driver]
            if not candidates:
                raise T3Error(f"no provider instance of driver {driver!r} is registered",
                              code="provider_unavailable")
            own = caller.thread.provider_instance_id if caller and caller.thread else None
            chosen = next((p for p in candidates if p.instance_id == own and p.available),
                          None) or next((p for p in candidates if p.available), candidates[0])
            instance_id = chosen.instance_id
        if instance_id is None:
            if caller is not None and caller.thread is not None:
                instance_id = caller.thread.provider_instance_id
            else:
                available = [p for p in providers.values() if p.available]
                if not available:
                    raise T3Error("no provider instance can run on this server",
                                  code="provider_unavailable")
                instance_id = available[0].instance_id
        info = providers.get(instance_id)
        if info is None:
            raise T3Error(f"provider instance {instance_id!r} is not registered",
                          code="provider_unavailable")
        if driver is not None and info.driver != driver:
            raise T3Error(f"target.driverKind: instance {instance_id} is driver {info.driver}, "
                          f"not {driver}", code="invalid_request")
        if not info.available:
            raise T3Error(f"provider instance {instance_id} cannot run: "
                          f"{'; '.join(info.constraints)}", code="provider_unavailable")
        model = target.get("model")
        advertised = [m["id"] for m in info.models]
        if model is None:
            if caller is not None and caller.thread is not None and \
                    caller.thread.provider_instance_id == instance_id:
                model = caller.thread.model_selection.get("model")
            else:
                model = info.first_model()
        elif advertised and model not in advertised:
            raise T3Error(f"model {model!r} is not offered by {instance_id} "
                          f"({', '.join(advertised)})", code="model_unavailable")
        return info, model

    def modes(self, args: Mapping[str, Any], caller: ThreadState | None,
              info: orch.ProviderInfo | None = None) -> tuple[str, str]:
        """``runtimeMode`` / ``interactionMode`` with ``inherit`` (or left out) resolved (the
        caller's, else full-access and default), never broader than the caller's; with
        ``info``, what that provider runs (``step_down``)."""
        parent = caller.thread if caller is not None else None
        given = args.get("runtimeMode", "inherit")
        runtime = parent.runtime_mode if parent and given == "inherit" else \
            orch.RuntimeMode.FULL_ACCESS if given == "inherit" else given
        interaction = args.get("interactionMode", "inherit")
        if interaction == "inherit":
            interaction = parent.interaction_mode if parent else orch.InteractionMode.DEFAULT
        if parent is not None:
            self.ceiling(parent, runtime, interaction)
        if info is not None:
            runtime = self.step_down(info, runtime, given != "inherit", interaction)
        return runtime, interaction

    @staticmethod
    def ceiling(caller: orch.AppThread, runtime: str, interaction: str) -> None:
        rank = orch.RUNTIME_RANK
        if rank[orch.RuntimeMode(runtime)] > rank[orch.RuntimeMode(caller.runtime_mode)]:
            raise T3Error(f"runtime mode {runtime} is broader than the caller's "
                          f"{caller.runtime_mode}", code="runtime_mode_escalation_denied")
        if orch.INTERACTION_RANK[orch.InteractionMode(interaction)] > \
                orch.INTERACTION_RANK[orch.InteractionMode(caller.interaction_mode)]:
            raise T3Error(f"interaction mode {interaction} is broader than the caller's "
                          f"{caller.interaction_mode}", code="interaction_mode_escalation_denied")

    def plan_create(self, *, command_id: str, thread_id: str, project_id: str, workspace: str,
                    entry: Mapping[str, Any], message_id: str, caller: ThreadState | None,
                    created_by: str, creation_source: str) -> orch.CreateThread:
        """One new thread's command with provider, model and modes resolved (``entry``: prompt,
        title, target, runtimeMode, interactionMode); refuses before anything is written."""
        info, model = self.resolve_target(entry.get("target"), caller)
        runtime, interaction = self.modes(entry, caller, info)
        prompt = entry.get("prompt")
        return orch.CreateThread(
            command_id=command_id, thread_id=thread_id, project_id=project_id,
            title=orch.thread_title(entry.get("title"), prompt, "New thread"),
            provider_instance_id=info.instance_id, model=model, runtime_mode=runtime,
            interaction_mode=interaction, workspace=workspace, created_by=created_by,
            creation_source=creation_source,
            initial_message=orch.InitialMessage(message_id, prompt) if prompt else None)

    @staticmethod
    def step_down(info: orch.ProviderInfo, runtime: str, explicit: bool,
                  interaction: str | None = None) -> str:
        """A provider that offers only some runtime modes: explicit ones must be offered;
        inherited ones step down to the broadest it offers that is no broader. An interaction
        mode it cannot enforce (plan) has nothing narrower to step down to: refused."""
        if interaction is not None and info.interaction_modes is not None and \
                interaction not in info.interaction_modes:
            raise T3Error(f"interactionMode: {info.instance_id} cannot enforce {interaction} "
                          f"(it offers {', '.join(info.interaction_modes)})",
                          code="invalid_request")
        if info.runtime_modes is None or runtime in info.runtime_modes:
            return runtime
        if explicit:
            raise T3Error(f"runtimeMode: {info.instance_id} offers only "
                          f"{', '.join(info.runtime_modes)}", code="invalid_request")
        rank = orch.RUNTIME_RANK[orch.RuntimeMode(runtime)]
        offered = [m for m in info.runtime_modes if orch.RUNTIME_RANK[orch.RuntimeMode(m)] <= rank]
        if not offered:
            raise T3Error(f"{info.instance_id} offers no runtime mode as narrow as {runtime}",
                          code="runtime_mode_escalation_denied")
        return max(offered, key=lambda m: orch.RUNTIME_RANK[orch.RuntimeMode(m)])

    async def create(self, command: orch.CreateThread) -> dict[str, Any]:
        """A new thread (``plan_create``'s command), as create_threads and launches show it."""
        run_id = (await self.orch.dispatch(command)).result.get("runId")
        state = await self.thread(command.thread_id)
        thread = state.thread
        assert thread is not None
        run = state.run(run_id) if run_id else state.latest_run()
        return {"threadId": thread.id, "runId": run.id if run else None,
                "status": run.status if run else "idle", "title": thread.title,
                "createdBy": thread.created_by, "creationSource": thread.creation_source,
                "providerInstanceId": thread.provider_instance_id,
                "model": thread.model_selection.get("model"), "projectId": thread.project_id,
                **self.ctx.links(thread.id)}

    # -- reads ------------------------------------------------------------------------------

    def shell_of(self, state: ThreadState) -> dict[str, Any]:
        """A thread's shell as ``t3_thread_list`` shows it, from its live state, plus its
        project (the /ws shell stream spans projects)."""
        assert state.thread is not None
        detail = _detail(self, state)
        return {**shell(self, {"thread": state.thread.to_json(), **{
            k: detail[k] for k in ("latestRunId", "status", "updatedAt", "itemCount",
                                   "pendingRequestCount", "snoozed", "pendingBackgroundTasks")}}),
                "projectId": state.thread.project_id}

    def projection(self, thread_id: str) -> tuple[int, dict[str, Any]]:
        """The thread's entities and the sequence they reflect, read in one snapshot."""
        sequence, rows = self.store.thread_entities(thread_id)
        projection: dict[str, Any] = {key: rows[kind] for kind, key in _PROJECTION_KEYS.items()}
        projection["thread"] = rows["thread"][0] if rows["thread"] else None
        return sequence, projection


# =============================================================================================
# Handlers: delegation (orchestrator_capabilities, delegate_task, task_status, task_cancel). A
# handler takes the toolkit, the call and the checked arguments, as OPERATIONS calls it.


async def _capabilities(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    caller = await kit.caller_thread(call.scope)
    thread = caller.thread if caller else None
    search = (args.get("search") or "").lower()
    await kit.orch.probe_providers()
    providers = []
    for info in kit.orch.providers.values():
        models = [dict(m) for m in info.models]
        own = thread.model_selection.get("model") if thread and \
            thread.provider_instance_id == info.instance_id else None
        current = [m for m in models if not m.get("legacy") or m["id"] == own]
        if search:
            shown = [m for m in models if search in m["id"].lower()
                     or search in str(m.get("label") or "").lower()]
        elif info.driver in ("codex", "claudeAgent", "grok"):
            shown = current
        else:
            shown = current[:8] + [m for m in current[8:] if m["id"] == own]
        entry: dict[str, Any] = {
            "providerInstanceId": info.instance_id, "driverKind": info.driver,
            "displayName": info.display_name,
            "models": [{"id": m["id"], "label": m.get("label"),
                        **({"options": m["options"]} if m.get("options") else {})}
                       for m in shown],
            "omittedModels": len(models) - len(shown),
            "canRunChildTask": info.available, "canRunCrossProviderChildTask": info.available,
            "constraints": list(info.constraints)}
        if info.runtime_modes is not None:
            entry["runtimeModes"] = list(info.runtime_modes)
        if info.interaction_modes is not None:
            entry["interactionModes"] = list(info.interaction_modes)
        if (nodes := getattr(kit.orch.providers, "nodes", None)) is not None:  # cluster.py's
            entry["nodes"] = nodes.get(info.instance_id, [])  # the live nodes that run it
        providers.append(entry)
    return {"parentThreadId": thread.id if thread else None,
            "inheritedProviderInstanceId": thread.provider_instance_id if thread else None,
            "inheritedModel": thread.model_selection.get("model") if thread else None,
            "runtimeMode": thread.runtime_mode if thread else None,
            "interactionMode": thread.interaction_mode if thread else None,
            "providers": providers,
            "features": dict(FEATURES)}


async def _delegate(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    scope, key = call.scope, kit.key(args)
    caller = await kit.caller_thread(scope)
    if caller is None or caller.thread is None:
        raise T3Error("the calling thread is gone", code="parent_not_active")
    role = args.get("role")
    command = await kit.plan_delegation(
        caller, {**args, "task": args["task"] if role in (None, "general") else
                 f"Act as the {role} sub-agent for this task.\n\n{args['task']}"},
        command_id=kit.derive_id("command", "mcp", scope.key, "delegate-task", key),
        parent_run_id="", title_from=args["task"], made_by=_AGENT_MADE,
        wake="settled_only" if args.get("mode") == "wait" else "always")
    parent_id = caller.thread.id
    receipt = kit.store.receipt(command.command_id)
    if receipt is not None:  # a retry: the same task, whatever the parent does now
        if receipt.fingerprint != orch.fingerprint_of(command):
            raise T3Error("clientRequestId: already used for a different delegate_task "
                          "request", code="invalid_request")
        task_id = receipt.result["taskId"]
    else:
        _, run = await kit.agent_caller(scope, "delegate_task")
        result = await kit.orch.dispatch(dataclasses.replace(command, parent_run_id=run.id))
        task_id = result.result["taskId"]
    timed_out = False
    if args.get("mode") == "wait":
        timed_out = not await _wait_task(kit, parent_id, task_id, args, call.progress,
                                         _lender(scope))
        await _wait_ended(kit, parent_id, task_id, kit.derive_id(
            "command", "mcp", scope.key, "delegate-task-wake-policy", key))
    shaped = await _task_result(kit, parent_id, task_id)
    shaped["waitTimedOut"] = timed_out and shaped["status"] not in orch.TASK_TERMINAL
    return shaped


async def _wait_ended(kit: Toolkit, parent_id: str, task_id: str, command_id: str) -> None:
    """A wait that showed the agent its child's question: no notice or catch-up wake for
    it. One that ends before the result (timed out, or a question or approval ended it):
    the completion must now wake the parent, mid-turn or not. In that order, so the
    question's notice is never queued."""
    task = (await kit.thread(parent_id)).entities["subagent"][task_id]
    question, _ = orch.task_attention(await kit.thread(task.child_thread_id), task)
    if question is not None:
        await kit.orch.dispatch(orch.SettleTaskQuestion(
            command_id=kit.derive_id("command", "question-delivered", question.id),
            thread_id=parent_id, task_id=task_id, request_id=question.id))
    if task.status not in orch.TASK_TERMINAL and not kit.orch.stopping:
        await kit.orch.dispatch(orch.SetWakePolicy(
            command_id=command_id, thread_id=parent_id, task_id=task_id,
            completion_wake="always"))


async def _wait_task(kit: Toolkit, parent_id: str, task_id: str, args: Args,
                     progress: Callable[[float, str], Awaitable[None]] | None,
                     lender: tuple[str, str] | None) -> bool:
    parent = await kit.thread(parent_id)
    task = parent.entities["subagent"][task_id]
    child_id = task.child_thread_id

    def settled(states: Mapping[str, ThreadState]) -> bool:
        current = states[parent_id].entities["subagent"][task_id]
        child = states.get(child_id)
        return current.status in orch.TASK_TERMINAL or bool(
            child and any(orch.task_attention(child, current)))

    timeout_s = args.get("timeoutMs", DEFAULT_WAIT_MS) / 1000
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with kit.orch.lending(lender, child_id):  # the child never waits for the parent's slot
        while not kit.orch.stopping:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            if await kit.orch.wait_until([parent_id, child_id], settled,
                                         min(remaining, PROGRESS_EVERY_S)):
                return True
            if progress is not None and not kit.orch.stopping:
                await progress(timeout_s - max(0.0, deadline - loop.time()),
                               "waiting for the delegated task")
    return False


async def _task_result(kit: Toolkit, parent_id: str, task_id: str) -> dict[str, Any]:
    parent = await kit.thread(parent_id)
    task = parent.entities["subagent"].get(task_id)
    if task is None:
        raise T3Error(f"no task {task_id} was delegated by this thread", code="task_not_found")
    child = await kit.thread(task.child_thread_id)
    terminal = task.status in orch.TASK_TERMINAL
    children_open = any(s.status not in orch.TASK_TERMINAL
                        for s in child.entities["subagent"].values())
    # The task's known work: its original run and t3's completion follow-ups, up to the
    # published run once there is one. Every other run is later work.
    published = child.run(task.result_run_id or task.child_run_id)
    work = [r for r in orch.task_work(child.runs)
            if not terminal or published is None or r.ordinal <= published.ordinal]
    busy = [r for r in work if r.status not in RUN_TERMINAL and r.status != RunStatus.WAITING]
    if terminal:
        status, state = task.status, "result_available"
    elif not work or busy:
        state = "working"
        status = "queued" if busy and busy == work[:1] and \
            busy[0].status == RunStatus.QUEUED else "running"
    else:
        status, state = "waiting", "waiting_for_children" if children_open else "working"
    later = [r for r in child.runs if r.ordinal > 1 and r not in work]
    latest = next((r for r in reversed(later) if orch.ran(r)), None)
    later_transfer = orch.later_transfer_id(task.id, latest.id) if latest else None
    question, approval = orch.task_attention(child, task)
    return {"taskId": task.id, "childThreadId": task.child_thread_id,
            "childRunId": task.child_run_id, "childNodeId": task.id, "status": status,
            "workState": state,
            "hasPendingChildRuns": any(r.status not in RUN_TERMINAL for r in later),
            "providerInstanceId": task.provider_instance_id, "model": task.model,
            "summary": task.result if terminal else None,
            "resultContextTransferId": orch.result_transfer_id(task.id)
            if terminal else None,
            "latestTerminalRunId": latest.id if latest else None,
            "latestTerminalStatus": latest.status if latest else None,
            "latestTerminalSummary": orch.task_result(child, latest) if latest else None,
            "latestTerminalResultContextTransferId": later_transfer
            if later_transfer in parent.entities["context-transfer"] else None,
            "hasPendingQuestion": question is not None,
            "pendingApproval": {"requestId": approval.id, "kind": approval.kind_,
                                "runId": approval.run_id} if approval else None,
            "waitTimedOut": False, "childThreadLink": kit.ctx.link(task.child_thread_id)}


async def _task_status(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    parent_id = kit.thread_caller(call.scope, "task_status")
    return await _task_result(kit, parent_id, args["taskId"])


async def _task_cancel(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    parent_id = kit.thread_caller(call.scope, "task_cancel")
    before = await _task_result(kit, parent_id, args["taskId"])
    terminal = before["status"] in orch.TASK_TERMINAL
    if not terminal and not await _stoppable(kit, parent_id, args["taskId"]):
        raise T3Error(f"task {args['taskId']} has no run to interrupt, no queued turn and no "
                      "open task of its own", code="task_not_cancellable")
    lost = await _cancel_task(kit, parent_id, args["taskId"], args.get("reason"),
                              kit.key(args))
    return {"taskId": args["taskId"], "status": before["status"] if terminal
            else "cancelled" if lost else "cancel_requested"}


async def _stoppable(kit: Toolkit, parent_id: str, task_id: str) -> bool:
    parent = await kit.thread(parent_id)
    task = parent.entities["subagent"][task_id]
    child = await kit.thread(task.child_thread_id)
    return child.run(task.child_run_id) is None or any(
        s.status not in orch.TASK_TERMINAL for s in child.entities["subagent"].values()) \
        or any(r.status in orch.RUN_LIVE or (r.status == RunStatus.QUEUED and
                                             r.id == task.child_run_id) for r in child.runs)


async def _cancel_task(kit: Toolkit, parent_id: str, task_id: str, reason: str | None,
                       key: str) -> bool:
    """Stop the task's child thread as a person's Stop does, then the child's own tasks (in this
    order: a task of its own that ends first could hand the child its result, and the child end
    its turn completed, before the Stop reaches it), then cancel its own queued turn even if
    held. True: its child run was lost, so it is cancelled here."""
    parent = await kit.thread(parent_id)
    task = parent.entities["subagent"].get(task_id)
    if task is None:
        raise T3Error(f"no task {task_id} was delegated by this thread", code="task_not_found")
    child = await kit.thread(task.child_thread_id)
    lost = task.status not in orch.TASK_TERMINAL and child.run(task.child_run_id) is None
    if task.status not in orch.TASK_TERMINAL:  # a published result stays as it is
        await kit.orch.dispatch(orch.RequestTaskCancel(
            command_id=kit.derive_id("command", "task-cancel", task_id, key),
            thread_id=parent_id, task_id=task_id, reason=reason))
    if lost:
        await kit.orch.dispatch(orch.FinalizeSubagent(
            command_id=kit.derive_id("command", "task-cancel", "lost", task_id, key),
            thread_id=parent_id, task_id=task_id, status="cancelled",
            result="The task was cancelled: its child run was lost."))
    await kit.orch.dispatch(orch.StopThread(
        command_id=kit.derive_id("command", "task-cancel", "stop", task.child_thread_id, key),
        thread_id=task.child_thread_id,
        reason=reason or "The delegated task was cancelled by its parent."))
    for sub in list((await kit.thread(task.child_thread_id)).entities["subagent"].values()):
        if sub.status not in orch.TASK_TERMINAL and not sub.child_thread_id.startswith(
                "t3-thread:"):  # (a linked environment's child: not here)
            await _cancel_task(kit, task.child_thread_id, sub.id, reason, key)
    own = (await kit.thread(task.child_thread_id)).run(task.child_run_id)
    if own is not None and own.status == RunStatus.QUEUED and not own.awaiting_agent_slot:
        await kit.orch.dispatch(orch.CancelQueuedRun(
            command_id=kit.derive_id("command", "task-cancel", own.id, key),
            thread_id=own.thread_id, run_id=own.id))
    return lost


# =============================================================================================
# Handlers: threads (create_threads, t3_thread_launch, list, read, send, wait, interrupt,
# t3_pending_request, metadata) and the shapes their results take


async def _create_threads(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    scope = call.scope
    caller = (await kit.agent_caller(scope, "create_threads"))[0] \
        if scope.kind == "thread" else None
    project = kit.ctx.project(args.get("projectId") or _home_project(caller))
    key = kit.key(args)
    # In the caller's own project a new thread works where the caller works (its worktree).
    home = caller.thread if caller and caller.thread and \
        caller.thread.project_id == project.id else None
    commands = [dataclasses.replace(kit.plan_create(
        command_id=kit.derive_id("command", "mcp", scope.key, "create-thread", key, str(i)),
        thread_id=kit.derive_id("thread", "mcp", scope.key, "create-threads", key, str(i)),
        project_id=project.id, workspace=home.workspace or project.path if home
        else project.path, entry=entry,
        message_id=kit.derive_id("message", "mcp", scope.key, "create-threads", key, str(i)),
        caller=caller, **_AGENT_MADE), branch=home.branch if home else None,
        worktree_path=home.worktree_path if home else None)
        for i, entry in enumerate(args["threads"])]
    return {"threads": [await kit.create(command) for command in commands]}


async def _launch(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """t3_thread_launch, and /ws launchThread's code (the thread records call.source)."""
    scope, transport = call.scope, call.source
    strategy = args.get("workspaceStrategy", "root")
    kind = strategy if isinstance(strategy, str) else strategy["type"]
    caller = (await kit.agent_caller(scope, "t3_thread_launch"))[0] \
        if scope.kind == "thread" else None
    key = kit.key(args)
    thread_id = kit.derive_id("thread", transport, scope.key, "launch", key)
    if args.get("scratch"):
        if args.get("projectId") or kind != "root":
            raise T3Error("scratch: cannot be combined with projectId "
                          "or a workspaceStrategy", code="invalid_request")
        project = kit.ctx.scratch_project
        workspace, binding = str(Path(project.path) / _folder_name(thread_id)), {}
    else:
        project = kit.ctx.project(args.get("projectId") or _home_project(caller))
        # An agent below full-access may have written what setup would run (a script, a
        # Makefile, package.json): its launch's setup waits for an approval.
        ask = caller is not None and caller.thread is not None and \
            caller.thread.runtime_mode != orch.RuntimeMode.FULL_ACCESS
        workspace, binding = await _bind_workspace(kit, kind, strategy, project, thread_id,
                                                   bool(args.get("message")), ask)
    entry = {"prompt": args.get("message"), "title": args.get("title"),
             "target": args.get("target"), "runtimeMode": args.get("runtimeMode", "inherit"),
             "interactionMode": args.get("interactionMode", "inherit")}
    command = dataclasses.replace(kit.plan_create(
        command_id=kit.derive_id("command", transport, scope.key, "launch", key),
        thread_id=thread_id, project_id=project.id, workspace=workspace, entry=entry,
        message_id=kit.derive_id("message", transport, scope.key, "launch", key),
        caller=caller, **call.made_by), **binding)
    folder = Path(workspace)
    made = args.get("scratch") and not folder.exists()
    if made:
        folder.mkdir(parents=True)  # before the agent can start in it
    try:
        created = await kit.create(command)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # only ever an empty folder
                folder.rmdir()
        raise
    return {**created, "workspaceStrategy": "scratch" if args.get("scratch") else kind,
            "workspacePath": workspace, "branch": command.branch,
            "worktreePath": command.worktree_path}


async def _bind_workspace(kit: Toolkit, kind: str, strategy: Any, project: Project, thread_id: str,
                          has_message: bool, ask_setup: bool) -> tuple[str, dict[str, Any]]:
    """A launch's workspace and the CreateThread fields that bind the thread to it; bad
    input is refused before anything is made. A new worktree's path and default branch
    derive from the thread id, so a retried launch asks for the same one; ``ask_setup``:
    its setup commands wait for an approval."""
    git = kit.orch.workspaces
    if kind == "root":
        return project.path, {}
    if git is None:
        raise T3Error(f"workspaceStrategy: {kind} needs git", code="invalid_request")
    if kind == "existing_worktree":
        path = os.path.realpath(strategy["worktreePath"])
        try:
            branch = await git.worktree_branch(project.path, path)
        except Exception as exc:  # not a repository, or git failed
            raise T3Error(f"worktreePath: {exc}", code="invalid_request") from None
        if branch is None:
            raise T3Error(f"worktreePath: {path} is not a worktree "
                          f"of project {project.id}'s repository", code="invalid_request")
        if strategy.get("branch", branch) != branch:
            raise T3Error(f"branch: the worktree at {path} is on "
                          f"{branch or 'a detached HEAD'}, not "
                          f"{strategy['branch']}", code="invalid_request")
        return path, {"branch": branch or None, "worktree_path": path}
    if not has_message:
        raise T3Error("message: a worktree launch needs the first message (the agent starts "
                      "once its worktree is ready)", code="invalid_request")
    repo = await git.top_level(project.path)
    path, branch = new_worktree(git, thread_id)
    branch = strategy.get("branch") or branch
    from_origin = bool(strategy.get("startFromOrigin"))
    problem = f"project {project.id} ({project.path}) is not a git repository" \
        if repo is None else None
    if repo and await kit.orch.state(thread_id) is None:  # (a retry asks again)
        problem = await git.worktree_problem(repo, base_ref=strategy["baseRef"],
                                             branch=branch, from_origin=from_origin)
    if problem:
        raise T3Error(f"workspaceStrategy: {problem}", code="invalid_request")
    return path, {"branch": branch, "worktree_path": path, "preparation": {
        "repo": repo, "baseRef": strategy["baseRef"], "fromOrigin": from_origin,
        "setup": list(project.setup), **({"askSetup": True} if ask_setup and project.setup
                                         else {})}}


async def _list_threads(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    caller = await kit.caller_thread(call.scope)
    project = kit.ctx.project(args.get("projectId") or (
        caller.thread.project_id if caller and caller.thread else None), listing=True)
    cursor = args.get("cursor", 0)
    total, rows = kit.store.list_threads(
        project.id, statuses=args.get("statuses") or (),
        title_contains=args.get("titleContains") or "",
        include_subagents=args.get("includeSubagents", True), offset=cursor,
        limit=args.get("limit", LIST_PAGE), archived=args.get("archived", False),
        snoozed=args.get("snoozed"), now=kit.orch.now())
    page = [shell(kit, row) for row in rows]
    more = cursor + len(page) < total
    return {"projectId": project.id, "currentThreadId": call.scope.thread_id, "threads": page,
            "nextCursor": cursor + len(page) if more else None, "total": total}


def shell(kit: Toolkit, row: Mapping[str, Any]) -> dict[str, Any]:
    thread = row["thread"]
    return {"threadId": thread["id"], "title": thread["title"],
            "createdBy": thread["createdBy"], "creationSource": thread["creationSource"],
            "status": row["status"], "latestRunId": row["latestRunId"],
            "providerInstanceId": thread["providerInstanceId"],
            "model": thread["modelSelection"].get("model"),
            "runtimeMode": thread["runtimeMode"], "interactionMode": thread["interactionMode"],
            "branch": thread.get("branch"), "worktreePath": thread.get("worktreePath"),
            "parentThreadId": thread["lineage"].get("parentThreadId"),
            "relationshipToParent": thread["lineage"].get("relationshipToParent"),
            "itemCount": row["itemCount"], "pendingRequestCount": row["pendingRequestCount"],
            "createdAt": thread["createdAt"], "updatedAt": row["updatedAt"],
            **kit.ctx.links(thread["id"]), **_thread_state(thread, row)}


async def _read_thread(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    state = await kit.thread(args["threadId"])
    if "afterPosition" in args and "beforePosition" in args:
        raise T3Error("beforePosition: cannot be combined with "
                      "afterPosition", code="invalid_request")
    view = args.get("view", "messages")
    max_chars = args.get("maxCharsPerItem", DEFAULT_ITEM_CHARS)
    limit = args.get("limit", 50)
    rows = [i for i in state.items() if view == "activity" or i.type in (
        "user_message", "assistant_message", "proposed_plan")]
    newest_first = "beforePosition" in args or (
        "afterPosition" not in args and call.scope.kind == "thread")
    if newest_first:
        before = args.get("beforePosition")
        candidates = [r for r in rows if before is None or r.position < before][::-1]
    else:
        after = args.get("afterPosition", -1)
        candidates = [r for r in rows if r.position > after]
    run_limit = args.get("runLimit", 10)
    result = {"thread": _detail(kit, state), "transfers": await _transfers(kit, state),
              "recentRuns": [
                  _run_summary(state, r) for r in state.runs[::-1][:run_limit]],
              "items": [], "nextPosition": None, "hasMore": False, "earlierPosition": None,
              **kit.ctx.links(state.thread.id if state.thread else "")}
    room = READ_BUDGET_CHARS - _chars(result) - 30  # the budget holds the whole result
    page: list[dict[str, Any]] = []
    for row in candidates[:limit]:
        item = _timeline_item(kit, state, row, max_chars)
        size = _chars(item) + 2
        if page and size > room:
            break  # left to the next page
        if size > room:  # the first item is cut to fit: every page moves on
            item = _timeline_item(kit, state, row, max(MIN_ITEM_CHARS, len(
                item["text"] or "") - (size - room) - _chars(TRUNCATION_MARK)))
            size = _chars(item) + 2
        room -= size
        page.append(item)
    if newest_first:
        page.reverse()
    first = page[0]["position"] if page else None
    last = page[-1]["position"] if page else None
    return {**result, "items": page,
            "nextPosition": last if last is not None else args.get("afterPosition"),
            "hasMore": last is not None and any(r.position > last for r in rows),
            "earlierPosition": first if first is not None and any(
                r.position < first for r in rows) else None}


async def _transfers(kit: Toolkit, state: ThreadState) -> list[dict[str, Any]]:
    """Context transfers naming this thread: its tasks' spawns and results, or its own."""
    own = list(state.entities["context-transfer"].values())
    parent_id = state.thread.lineage.get("parentThreadId") if state.thread else None
    parent = await kit.orch.state(parent_id) if parent_id else None
    if parent is not None and state.thread is not None:
        own += [t for t in parent.entities["context-transfer"].values()
                if state.thread.id in (t.source_thread_id, t.target_thread_id)]
    return [{**{k: v for k, v in t.to_json().items() if k not in ("threadId", "data")},
             "summary": _bounded(t.summary, TRANSFER_SUMMARY_CHARS),
             **{k: v for k, v in (t.data or {}).items() if k in ("sourcePoint",
                                                                 "resolution")}}
            for t in sorted(own, key=lambda t: (t.created_at, t.id))]


def _detail(kit: Toolkit, state: ThreadState) -> dict[str, Any]:
    thread = state.thread
    assert thread is not None
    latest = state.latest_run()
    active = next((r for r in reversed(state.runs) if r.status in (
        RunStatus.PREPARING, RunStatus.STARTING, RunStatus.RUNNING)), None)
    return {"threadId": thread.id, "projectId": thread.project_id, "title": thread.title,
            "createdBy": thread.created_by, "creationSource": thread.creation_source,
            "status": state.status(), "latestRunId": latest.id if latest else None,
            "activeRunId": active.id if active else None,
            "providerInstanceId": thread.provider_instance_id,
            "model": thread.model_selection.get("model"), "runtimeMode": thread.runtime_mode,
            "interactionMode": thread.interaction_mode, "branch": thread.branch,
            "worktreePath": thread.worktree_path, "workspacePath": thread.workspace,
            "parentThreadId": thread.lineage.get("parentThreadId"),
            "relationshipToParent": thread.lineage.get("relationshipToParent"),
            "runCount": len(state.runs), "itemCount": len(state.entities["turn-item"]),
            "pendingRequestCount": len(state.pending_requests()),
            **_thread_state(thread.to_json(), {
                "status": state.status(), "snoozed": state.snoozed(kit.orch.now()),
                "pendingBackgroundTasks": state.pending_background_tasks()}),
            "titleRegeneration": thread.title_regeneration, "createdAt": thread.created_at,
            "updatedAt": max([thread.updated_at, *(t for t in (
                (latest.requested_at, latest.completed_at) if latest else ()) if t)]),
            **kit.ctx.links(thread.id)}


def _run_summary(state: ThreadState, run: orch.Run) -> dict[str, Any]:
    attempts = [a for a in state.entities["run-attempt"].values() if a.run_id == run.id]
    return {"runId": run.id, "ordinal": run.ordinal, "status": run.status,
            "statusReason": run.status_reason, "providerInstanceId": run.provider_instance_id,
            "model": run.model_selection.get("model"), "requestedAt": run.requested_at,
            "startedAt": run.started_at, "completedAt": run.completed_at,
            "attemptCount": len(attempts), "queuePosition": run.queue_position,
            "queueHeld": run.queue_held}


def _timeline_item(kit: Toolkit, state: ThreadState, item: orch.TurnItem, max_chars: int
                   ) -> dict[str, Any]:
    message = state.entities["message"].get(item.message_id) if item.message_id else None
    if message is not None:
        text: str | None = message.text
        created_by, source = message.created_by, message.creation_source
    else:
        text = item.text
        created_by, source = (("system", "server") if item.type.startswith("run_interrupt")
                              else ("agent", "provider"))
    truncated = text is not None and len(text) > max_chars
    text = _bounded(text, max_chars)
    return {"position": item.position, "visibility": "local",
            "sourceThreadId": item.thread_id, "itemId": item.id, "runId": item.run_id,
            "messageId": item.message_id, "role": message.role if message else None,
            "createdBy": created_by, "creationSource": source, "type": item.type,
            "status": item.status, "title": item.title, "text": text,
            "textTruncated": truncated, "updatedAt": item.updated_at,
            **({"answeredBy": item.data["answeredBy"]}  # who answered a request
               if item.data and item.data.get("answeredBy") else {})}


async def _send(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    state = await kit.thread(args["threadId"])
    await kit.require_live_caller(call.scope, state, "t3_thread_send")
    ids = (call.space, call.scope.key, "thread-send", args["threadId"], kit.key(args))
    return await kit.send(
        args["threadId"], text=args["message"], mode=args.get("mode", "auto"),
        command_id=kit.derive_id("command", *ids), message_id=kit.derive_id("message", *ids),
        target=args.get("target"), **call.made_by)


async def _wait(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    return await kit.wait(args["threadId"], run_id=args.get("runId"),
                          timeout_s=args.get("timeoutMs", DEFAULT_WAIT_MS) / 1000,
                          progress=call.progress, lender=_lender(call.scope))


async def _interrupt(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    scope = call.scope
    thread_id = args["threadId"]
    await kit.require_live_caller(scope, await kit.thread(thread_id),
                                  "t3_thread_interrupt")
    return await kit.interrupt(
        thread_id, run_id=args.get("runId"), reason=args.get("reason"),
        command_id=kit.derive_id("command", call.space, scope.key, "thread-interrupt",
                                 thread_id, kit.key(args)))


async def _pending_request(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    scope = call.scope
    state = await kit.thread(args["threadId"])
    action = args["action"]
    if action == "list":
        return {"threadId": args["threadId"],
                "requests": [_request_summary(r) for r in state.pending_requests()]}
    if "requestId" not in args:
        raise T3Error(f"requestId: required for action {action}", code="invalid_request")
    request = state.entities["runtime-request"].get(args["requestId"])
    if request is None:
        raise T3Error(f"requestId: no request {args['requestId']} in this "
                      "thread", code="invalid_request")
    if action == "read":
        return {"threadId": args["threadId"], "request": {
            **_request_summary(request), "detail": request.detail,
            "decision": request.decision, "answers": request.answers,
            "answeredBy": request.answered_by, "resolvedAt": request.resolved_at,
            "statusReason": request.status_reason}}
    if ("decision" in args) == ("answers" in args):
        raise T3Error("decision: give exactly one of decision or "
                      "answers", code="invalid_request")
    answered_by = {"kind": "client"} if scope.kind == "client" else \
        {"kind": "thread", "threadId": await kit.answering_thread(scope, state, request)}
    return await kit.respond(
        args["threadId"], request_id=request.id, decision=args.get("decision"),
        answers=args.get("answers"), answered_by=answered_by,
        command_id=kit.derive_id("command", call.space, scope.key, "respond", request.id,
                                 kit.key(args)))


# =============================================================================================
# A person's operations: the /ws methods that are no MCP tool (their handlers, as the tools'
# methods, take the toolkit, the call and the checked arguments)


async def _launch_thread(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """t3_thread_launch in T3 Code's launchThread shape; the result carries the projection."""
    selection = args.get("modelSelection") or {}
    target = {k: v for k, v in (("providerInstanceId", selection.get("instanceId")),
                                ("model", selection.get("model"))) if v}
    launch = {k: v for k, v in {
        "projectId": args.get("projectId"), "title": args.get("title"),
        "message": (args.get("initialMessage") or {}).get("text"), "target": target or None,
        "runtimeMode": args.get("runtimeMode"), "interactionMode": args.get(
            "interactionMode"), "workspaceStrategy": args.get("workspaceStrategy"),
        "scratch": args.get("scratch"), "clientRequestId": args["commandId"]}.items()
        if v is not None}
    existed = kit.store.receipt(kit.derive_id(
        "command", call.source, call.scope.key, "launch", args["commandId"])) is not None
    launched = await _launch(kit, call, launch)  # (checked as launchThread's)
    sequence, projection = kit.projection(launched["threadId"])
    return {"threadId": launched["threadId"], "runId": launched["runId"],
            "resumed": existed, "snapshotSequence": sequence, "projection": projection}


async def _thread_projection(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    await kit.thread(args["threadId"])
    sequence, projection = kit.projection(args["threadId"])
    return {"snapshotSequence": sequence, "projection": projection}


async def _all_pending_requests(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    requests = [orch.RuntimeRequest.from_json(r) for r in kit.store.pending_requests()]
    return {"requests": [{**_request_summary(r), "threadId": r.thread_id, "detail": r.detail}
                         for r in requests if args.get("threadId") in (None, r.thread_id)]}


async def _dispatch_command(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """Any client command (orchestrator.client_commands()) in T3 Code's wire form."""
    try:
        command = await _wire_command(kit, call, args)
    except ValueError as exc:  # a contradiction the command itself refuses
        raise T3Error(str(exc), code="invalid_request") from exc
    result = await kit.orch.dispatch(command)
    return {"sequence": result.sequence, "result": dict(result.result),
            "commandType": command.type}


async def _wire_command(kit: Toolkit, call: Call, a: Args) -> orch.Command:
    """The orchestrator command for a checked wire command, through the rules the tools
    use. Its id is the client's commandId in a namespace of its own, so a client never
    meets the server's internal command ids."""
    kind, made = a["type"], call.made_by
    command_id = kit.derive_id("command", "ws", "client", a["commandId"])
    if kind in _WIRE_BUILDERS:  # a feature module's (register_wire)
        return _WIRE_BUILDERS[kind](kit, a, command_id)

    def derived(what: str) -> str:  # an id the client left out
        return kit.derive_id(what, "ws", "client", a["commandId"])
    target = {key: (a.get("modelSelection") or {})[wire] for key, wire in (
        ("providerInstanceId", "instanceId"), ("model", "model"))
        if wire in (a.get("modelSelection") or {})}
    if kind in orch.THREAD_LIFECYCLE:  # times in any ISO form (ValueError: invalid_request)
        when = a.get("snoozedUntil") or a.get("visitedAt")
        return orch.ChangeThreadLifecycle(
            command_id=command_id, thread_id=a["threadId"], type=kind, at=orch.parse_time(
                when) if when else kit.orch.now() if kind == "thread.visit" else None)
    if kind == "thread.create":
        if a.get("branch") or a.get("worktreePath"):
            raise T3Error("branch: a thread in a worktree is made by launchThread with a "
                          "workspaceStrategy", code="invalid_request")
        project = kit.ctx.project(a.get("projectId"))
        initial = a.get("initialMessage") or {}
        return kit.plan_create(
            command_id=command_id, thread_id=a.get("threadId") or derived("thread"),
            project_id=project.id, workspace=project.path, caller=None,
            message_id=initial.get("messageId") or derived("message"), entry={
                "runtimeMode": a.get("runtimeMode", "inherit"), "target": target,
                "interactionMode": a.get("interactionMode", "inherit"),
                "title": a.get("title"), "prompt": initial.get("text")}, **made)
    if kind == "message.dispatch":
        if a.get("attachments"):
            raise T3Error("attachments: t3 delivers text only", code="invalid_request")
        mode = a.get("dispatchMode") or {"type": "start_immediately"}
        return orch.DispatchMessage(
            command_id=command_id, thread_id=a["threadId"], text=a["text"],
            message_id=a.get("messageId") or derived("message"), mode=mode["type"],
            target_run_id=mode.get("targetRunId"), **made)
    if kind == "delegated_task.request":
        return await kit.plan_delegation(
            await kit.thread(a["parentThreadId"]), {**a, "target": target},
            command_id=command_id, parent_run_id=a["parentRunId"], title_from=a["task"],
            wake=a.get("completionWake", "settled_only"), made_by=made)
    if kind == "provider.switch":
        return await kit.plan_switch(a["threadId"], target, command_id=command_id)
    fields = {"threadId": "thread_id", "parentThreadId": "thread_id", "runId": "run_id",
              "reason": "reason", "requestId": "request_id", "decision": "decision",
              "answers": "answers", "taskId": "task_id",
              "completionWake": "completion_wake"}
    extra = {"answered_by": {"kind": "client"}} if kind == "runtime-request.respond" else {}
    return _WIRE_TYPES[kind](command_id=command_id, **extra, **{
        fields[k]: v for k, v in a.items() if k in fields})


# =============================================================================================
# A person's streams: subscribeThread and subscribeShell send items through ``call.emit`` until
# the client unsubscribes (the task is cancelled) or falls SUBSCRIBER_BYTES behind its reader


SUBSCRIBER_BYTES = 4 * 1024 * 1024


class Subscription:
    """Events committed after it began, for one thread (or all), in commit order, as JSON text.
    Bounded: a reader more than ``max_bytes`` of events behind is cut off (``overflowed``) and
    resubscribes from the last sequence it got, so a slow reader never grows the server."""

    def __init__(self, *, thread_id: str | None, max_bytes: int) -> None:
        self.thread_id = thread_id
        self.max_bytes = max_bytes
        self.overflowed = False
        self._items: collections.deque[tuple[int, str, str]] = collections.deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def offer(self, sequence: int, thread_id: str, text: str) -> None:
        if self.overflowed:
            return
        self._bytes += len(text) + 64
        if self._bytes > self.max_bytes:
            self.overflowed = True
            self._items.clear()
        else:
            self._items.append((sequence, thread_id, text))
        self._ready.set()

    async def take(self) -> list[tuple[int, str, str]]:
        """(sequence, thread id, event JSON) of what arrived since the last take, waiting for at
        least one; [] once overflowed."""
        await self._ready.wait()
        self._ready.clear()
        items, self._items, self._bytes = list(self._items), collections.deque(), 0
        return items


async def _subscribe_thread(kit: Toolkit, call: Call, args: Args) -> None:
    """A snapshot at N (or, with ``afterSequence`` N, the stored events after N), a
    ``synchronized`` marker, then each event as it commits: gap-free, none twice."""
    emit, thread_id, after = call.emit, args["threadId"], args.get("afterSequence")
    assert emit is not None
    await kit.thread(thread_id)
    subscription = Subscription(thread_id=thread_id, max_bytes=SUBSCRIBER_BYTES)
    kit.orch.subscribe(subscription)
    try:  # subscribed before reading: what commits meanwhile is in one or both, never lost
        if after is None:
            last, projection = kit.projection(thread_id)
            await emit({"kind": "snapshot", "snapshotSequence": last, "projection": projection})
        else:
            last = after
            while rows := kit.store.events_after(last, thread_id=thread_id, limit=500):
                for row in rows:
                    await emit({"kind": "event", "sequence": row["sequence"], "event": row})
                    last = row["sequence"]
        await emit({"kind": "synchronized", "sequence": last})
        while True:
            items = await subscription.take()
            if subscription.overflowed:
                raise _resubscribe(last)
            for sequence, _, text in items:
                if sequence > last:
                    await emit(f'{{"kind":"event","sequence":{sequence},"event":{text}}}')
                    last = sequence
    finally:
        kit.orch.unsubscribe(subscription)


async def _subscribe_shell(kit: Toolkit, call: Call, args: Args) -> None:
    """The projects, threads and scheduled tasks (a snapshot, or those changed after
    ``afterSequence``), ``synchronized``, then a thread's shell, or a scheduled task as
    ``list_scheduled_tasks`` shows it, each time it changes."""
    emit, after = call.emit, args.get("afterSequence")
    assert emit is not None
    subscription = Subscription(thread_id=None, max_bytes=SUBSCRIBER_BYTES // 64)
    kit.orch.subscribe(subscription)
    try:
        last = kit.store.max_sequence()
        if after is None:
            await emit({"kind": "snapshot", "snapshot": {
                **_shell_snapshot(kit, last), "schedules": await _schedules(kit, call)}})
        else:
            for thread_id in kit.store.threads_touched_after(after, limit=1000):
                await _emit_shell(kit, call, thread_id, last)
        await emit({"kind": "synchronized", "sequence": last})
        while True:
            items = await subscription.take()
            if subscription.overflowed:
                raise _resubscribe(last)
            changed = {thread_id: sequence for sequence, thread_id, _ in items}
            for thread_id, sequence in changed.items():
                await _emit_shell(kit, call, thread_id, sequence)
                last = max(last, sequence)
    finally:
        kit.orch.unsubscribe(subscription)


async def _emit_shell(kit: Toolkit, call: Call, thread_id: str, sequence: int) -> None:
    assert call.emit is not None
    state = await kit.orch.state(thread_id)
    if state is None:
        return
    if state.thread is None:  # a scheduled task's stream (schedules.py's operations)
        listed = await _schedules(kit, call, thread_id)
        await call.emit({"kind": "schedule.updated", "sequence": sequence, "task": listed[0]}
                        if listed else {"kind": "schedule.removed", "sequence": sequence,
                                        "scheduledTaskId": thread_id})
    elif state.thread.deleted_at is not None:
        await call.emit({"kind": "thread.removed", "sequence": sequence, "threadId": thread_id})
    else:
        await call.emit({"kind": "thread.updated", "sequence": sequence,
                         "thread": kit.shell_of(state)})


async def _schedules(kit: Toolkit, call: Call, task_id: str | None = None) -> list[Any]:
    """The scheduled tasks as ``listScheduledTasks`` shows them (none without schedules.py)."""
    op = BY_WS_NAME.get("listScheduledTasks")
    args = {"scheduledTaskId": task_id} if task_id else {}
    return (await kit.run(op, call, args))["tasks"] if op else []


def _shell_snapshot(kit: Toolkit, sequence: int) -> dict[str, Any]:
    projects = [*kit.ctx.projects, kit.ctx.scratch_project]
    threads = []
    for project in projects:
        _, rows = kit.store.list_threads(project.id, limit=500, archived=None,
                                         now=kit.orch.now())
        threads += [{**shell(kit, row), "projectId": project.id} for row in rows]
    return {"snapshotSequence": sequence, "threads": threads,
            "projects": [{"projectId": p.id, "title": p.title, "path": p.path}
                         for p in projects]}


def _resubscribe(last: int) -> T3Error:
    return T3Error("this stream fell too far behind its reader and was ended; subscribe again "
                   f"with afterSequence = {last}", code="resubscribe", lastSequence=last)


# =============================================================================================
# The operations table


_LAUNCH_INPUT = obj({"projectId": text_field(256), "title": TITLE, "message": text_field(120_000),
                     "target": TARGET, "runtimeMode": RUNTIME_INPUT,
                     "interactionMode": INTERACTION_INPUT,
                     "workspaceStrategy": WORKSPACE_STRATEGY, "scratch": {"type": "boolean"},
                     "clientRequestId": CLIENT_REQUEST_ID})
SEQUENCE = {"type": "integer", "minimum": 0}


def ws_op(name: str, description: str, input_schema: Mapping[str, Any],
          handler: Callable[[Toolkit, Call, Args], Awaitable[dict[str, Any] | None]],
          output_schema: Mapping[str, Any] = OBJECT) -> Operation:
    """A /ws-only operation: a person's, named as the /ws method."""
    return Operation(name, description, input_schema, handler, output_schema, callers=CLIENT,
                     ws=(name,), mcp=False)


OPERATIONS: list[Operation] = [
    Operation(
        "orchestrator_capabilities",
        "List t3's provider instances and models you can delegate to, your inherited provider, "
        "model and modes, and the orchestration features. Model lists are short; pass search "
        "to find omitted models.",
        obj({"search": {"type": "string", "maxLength": 256}}), _capabilities,
        CAPABILITIES_OUTPUT, ws=("getCapabilities",), read_only=True),
    Operation(
        "delegate_task",
        "Delegate ONE task to a t3-owned child agent of THIS thread, on any provider, using only "
        "the given task text (no parent history). Use it whenever work should go to another "
        "agent, subagent or worker, including cross-provider. Provider, model and modes inherit "
        "unless target/runtimeMode/interactionMode override them (never broader than yours). "
        "mode 'async' (default) returns at once and the child's completion wakes this thread "
        "with a message naming the task, so end your turn instead of polling; mode 'wait' "
        "blocks until the result or timeoutMs (the child keeps running after a timeout; use "
        "task_status). Reuse clientRequestId when retrying the same task.",
        obj({"task": text_field(120_000), "target": TARGET, "title": TITLE,
             "role": {"type": "string", "enum": ROLES},
             "mode": {"type": "string", "enum": ["async", "wait"]},
             "timeoutMs": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_MS},
             "clientRequestId": CLIENT_REQUEST_ID, "runtimeMode": RUNTIME_INPUT,
             "interactionMode": INTERACTION_INPUT}, ["task"]),
        _delegate, _TASK, callers=THREAD, destructive=True),
    Operation(
        "task_status",
        "The latest durable state and result of a task this thread delegated.",
        obj({"taskId": text_field(1024)}, ["taskId"]), _task_status, _TASK, callers=THREAD,
        read_only=True),
    Operation(
        "task_cancel",
        "Cancel a task this thread delegated: its own delegated tasks first, then its child "
        "thread. A finished task is returned unchanged (its child thread is still stopped).",
        obj({"taskId": text_field(1024), "reason": {"type": "string", "maxLength": 2000},
             "clientRequestId": CLIENT_REQUEST_ID}, ["taskId"]),
        _task_cancel, TASK_CANCEL_OUTPUT, callers=THREAD, destructive=True),
    Operation(
        "create_threads",
        "Create 1-20 ORDINARY top-level t3 threads (not delegation). Entries with a prompt start "
        "a run at once; entries without stay idle. Each entry may pick its provider instance, "
        "model and modes. Retry with the same clientRequestId to get the same threads back.",
        obj({"threads": {"type": "array", "minItems": 1, "maxItems": 20,
                         "items": _CREATE_ENTRY},
             "clientRequestId": CLIENT_REQUEST_ID, "projectId": text_field(256)}, ["threads"]),
        _create_threads, CREATE_OUTPUT, destructive=True),
    Operation(
        "t3_thread_launch",
        "Launch one ordinary top-level thread bound to a workspace before its agent starts: "
        "workspaceStrategy 'root' (the project root, default; the caller's worktree is not "
        "inherited), {type: 'worktree', baseRef, branch?, startFromOrigin?} (a new git "
        "worktree on a new branch from baseRef, or from origin/<baseRef> freshly fetched; "
        "the run is 'preparing' until it and the project's setup commands are done; for "
        "stacked PRs use the parent branch as baseRef), {type: 'existing_worktree', "
        "worktreePath, branch?} (a worktree of the project's repository), or scratch: true "
        "(a fresh folder outside any project). Pass the task in message. Launch has no "
        "retry key of its own: after a lost response, list threads before launching again.",
        _LAUNCH_INPUT,
        _launch, LAUNCH_OUTPUT, destructive=True),
    Operation(
        "t3_thread_list",
        "List thread shells of one project, newest first (projectId, else the caller's or the "
        "default project). Filter by run status, title, snoozed, and archived (archived "
        "threads are listed only with archived: true); offset pagination with cursor, "
        f"{LIST_PAGE} a page unless limit says more.",
        obj({"projectId": text_field(256),
             "statuses": {"type": "array", "maxItems": 10,
                          "items": {"type": "string", "enum": RUN_STATUSES}},
             "titleContains": {"type": "string", "maxLength": 256},
             "includeSubagents": {"type": "boolean"}, "archived": {"type": "boolean"},
             "snoozed": {"type": "boolean"},
             "cursor": {"type": "integer", "minimum": 0},
             "limit": {"type": "integer", "minimum": 1, "maximum": 100}}),
        _list_threads, LIST_OUTPUT, ws=("listThreads",), read_only=True),
    Operation(
        "t3_thread_read",
        "Read a thread's durable state, recent runs and timeline. view 'messages' (default: "
        "user and assistant messages, plans) or 'activity' (also tools, reasoning, requests). "
        "afterPosition=nextPosition reads newer items, beforePosition=earlierPosition older "
        "ones, afterPosition=-1 starts at the oldest. Results stop near 30,000 characters.",
        obj({"threadId": THREAD_ID, "view": {"type": "string",
                                             "enum": ["messages", "activity"]},
             "afterPosition": {"type": "integer", "minimum": -1},
             "beforePosition": {"type": "integer", "minimum": 0},
             "limit": {"type": "integer", "minimum": 1, "maximum": 100},
             "runLimit": {"type": "integer", "minimum": 1, "maximum": 50},
             "maxCharsPerItem": {"type": "integer", "minimum": 1, "maximum": 50_000}},
            ["threadId"]),
        _read_thread, READ_OUTPUT, ws=("readThread",), read_only=True),
    Operation(
        "t3_thread_send",
        "Send a message to a thread. mode 'auto' (default) starts an idle thread, steers an "
        "active turn, or queues behind a turn that cannot be steered yet; 'queue' makes a "
        "separate follow-up run; 'steer' and 'restart' need an active provider turn (steering "
        "falls back to interrupt-and-restart when the provider cannot steer). A target naming "
        "another provider instance or model switches the thread: the message starts a new run "
        "there, with a context handoff of the conversation that provider missed.",
        obj({"threadId": THREAD_ID, "message": text_field(120_000),
             "mode": {"type": "string", "enum": ["auto", "queue", "steer", "restart"]},
             "target": TARGET, "clientRequestId": CLIENT_REQUEST_ID},
            ["threadId", "message"]),
        _send, SEND_OUTPUT, ws=("sendToThread",), destructive=True),
    Operation(
        "t3_thread_wait",
        "Wait until a run (runId, else the thread's latest run) is completed, failed, "
        f"cancelled, interrupted or rolled_back, or a request of that run needs an answer. "
        f"timeoutMs default {DEFAULT_WAIT_MS}, max {MAX_WAIT_MS}; a timeout never cancels work. "
        "Keep timeoutMs under your MCP client's tool-call limit (often 60 s) and call again "
        "while timedOut is true.",
        obj({"threadId": THREAD_ID, "runId": text_field(512),
             "timeoutMs": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_MS}},
            ["threadId"]),
        _wait, WAIT_OUTPUT, ws=("waitForThread",), read_only=True),
    Operation(
        "t3_thread_interrupt",
        "Interrupt a run (runId, else the newest interruptible one). A terminal run is returned "
        "unchanged; a thread with nothing running returns status no_active_run.",
        obj({"threadId": THREAD_ID, "runId": text_field(512), "reason": {
            "type": "string", "maxLength": 2000}, "clientRequestId": CLIENT_REQUEST_ID},
            ["threadId"]),
        _interrupt, INTERRUPT_OUTPUT, ws=("interruptThread",), destructive=True),
    Operation(
        "t3_pending_request",
        "List, read or answer a thread's pending runtime requests (approvals and questions "
        "from its agent). respond takes requestId plus decision (accept, acceptForSession, "
        "decline, cancel) or answers. An agent may answer only requests of threads it "
        "delegated (descendants), while its own run is live, and approvals only when its own "
        "runtime mode would have allowed the action (auto or full-access for commands; "
        "auto-accept-edits for file edits).",
        obj({"threadId": THREAD_ID,
             "action": {"type": "string", "enum": ["list", "read", "respond"]},
             "requestId": text_field(512),
             "decision": {"type": "string", "enum": list(orch.DECISIONS)},
             "answers": {"type": "object"}, "clientRequestId": CLIENT_REQUEST_ID},
            ["threadId", "action"]),
        _pending_request, PENDING_REQUEST_OUTPUT, destructive=True),
    # A person's (the client token over /ws): T3 Code's own methods.
    ws_op("dispatchCommand", "Any client command in T3 Code's wire form.",
          {"anyOf": _WIRE_COMMANDS}, _dispatch_command),
    ws_op("launchThread", "t3_thread_launch in T3 Code's form; answered with the projection.",
          obj({"commandId": CLIENT_REQUEST_ID, "projectId": text_field(256), "title": SEED_TITLE,
               "modelSelection": _SELECTION, **_MODES, "scratch": {"type": "boolean"},
               "workspaceStrategy": WORKSPACE_STRATEGY, "initialMessage": _INITIAL},
              ["commandId"]), _launch_thread),
    ws_op("getThreadProjection", "A thread's entities and the sequence they reflect.",
          obj({"threadId": THREAD_ID}, ["threadId"]), _thread_projection),
    ws_op("listPendingRequests", "Every thread's pending runtime requests (or threadId's).",
          obj({"threadId": THREAD_ID}), _all_pending_requests),
    ws_op("subscribeThread", "A thread's snapshot (or the events after afterSequence), then "
          "each event as it commits.", obj({"threadId": THREAD_ID, "afterSequence": SEQUENCE},
                                           ["threadId"]), _subscribe_thread),
    ws_op("subscribeShell", "Every thread's and scheduled task's shell, then each change.",
          obj({"afterSequence": SEQUENCE}), _subscribe_shell),
]
TOOLS: list[Operation] = []  # the operations MCP publishes, in the table's order
_BY_NAME: dict[str, Operation] = {}
BY_WS_NAME: dict[str, Operation] = {}


def register(*operations: Operation) -> None:
    """Add operations to the table: the core's below, a feature module's (schedules.py) when
    t3.py imports it, before the server serves."""
    for op in operations:
        if op.name in _BY_NAME or any(name in BY_WS_NAME for name in op.ws):
            raise ValueError(f"operation {op.name!r} is already registered")
        if op not in OPERATIONS:
            OPERATIONS.append(op)
        if op.mcp:
            TOOLS.append(op)
            _BY_NAME[op.name] = op
        BY_WS_NAME.update((name, op) for name in op.ws)
    _published_tools.cache_clear()


def replace_operation(op: Operation) -> None:
    """A feature module's version of a registered operation (links.py's forward what names a
    linked environment and call the core's handler for the rest), before the server serves."""
    old = _BY_NAME.get(op.name) or next(o for o in OPERATIONS if o.name == op.name)
    for table in (OPERATIONS, TOOLS):
        table[:] = [op if o is old else o for o in table]
    if op.mcp:
        _BY_NAME[op.name] = op
    BY_WS_NAME.update((name, op) for name in op.ws)
    _published_tools.cache_clear()


def register_wire(kind: str, properties: Mapping[str, Any], required: Sequence[str],
                  build: Callable[[Toolkit, Args, str], Any]) -> None:
    """A client command a feature module adds to dispatchCommand (history.py's
    checkpoint.rollback), as ``register`` adds an operation: its wire form and ``build(kit,
    args, command_id)``, the orchestrator command the checked wire command becomes."""
    _WIRE_COMMANDS.append(_wire(kind, properties, required))
    _WIRE_BUILDERS[kind] = build


def published_input(op: Operation) -> dict[str, Any]:
    return _public_schema(op.input_schema)  # type: ignore[no-any-return]


@functools.cache
def _published_tools() -> dict[str, types.Tool]:
    """Every tool as tools/list shows it, built once: also where the SDK looks up the input
    schema a call's ``Mcp-Param-*`` headers are checked against (given no lookup, it runs a
    whole tools/list for every call that has arguments)."""
    return {t.name: types.Tool(name=t.name, description=t.description,
                               input_schema=published_input(t),
                               output_schema=published_output(t),
                               annotations=types.ToolAnnotations(
                                   read_only_hint=t.read_only, destructive_hint=t.destructive,
                                   open_world_hint=False))
            for t in TOOLS}


register(*OPERATIONS)


def published_output(tool: Operation) -> dict[str, Any]:
    """The tool's outputSchema as listed: its success shape or the typed failure (MCP does not
    ask it of errors, but gemini-cli 0.61 and opencode 1.18 check it anyway). An object in a
    list is listed by the keys it always has, not its values' types: the SDK client checks each
    result with jsonschema at some microseconds per typed value, and a page of thread shells
    holds hundreds (checking 20 took longer than the rest of the call). The tests check every
    value of every result against ``output_schema``."""
    success = tool.output_schema
    return {"type": "object",
            "anyOf": [*map(_keyed_lists, success.get("anyOf", [success])), FAILURE_OUTPUT]}


def _keyed_lists(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_keyed_lists(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    items = schema.get("items")
    if isinstance(items, dict) and "required" in items:
        return {**schema, "items": {"type": "object", "required": items["required"]}}
    return {k: _keyed_lists(v) for k, v in schema.items()}


def steerable_run(state: ThreadState) -> orch.Run | None:
    """The newest running run whose provider turn is running: what steering would reach."""
    for run in (r for r in reversed(state.runs) if r.status == RunStatus.RUNNING):
        attempt = state.entities["run-attempt"].get(run.active_attempt_id or "")
        turn = state.entities["provider-turn"].get(attempt.provider_turn_id) if attempt else None
        if turn is not None and turn.status == "running":
            return run
    return None


def new_worktree(git: orch.Workspaces, thread_id: str) -> tuple[str, str]:
    """The path and default branch of a thread's own new worktree: from its id, so that a
    retried launch (or fork) asks for the same one."""
    return (str(git.worktrees_dir / _folder_name(thread_id)),
            f"t3/{hashlib.sha256(thread_id.encode()).hexdigest()[:12]}")


def _folder_name(thread_id: str) -> str:
    """A thread's scratch folder name: its quoted id, or a prefix and a hash when that would pass
    the 255-byte limit of a file name (ids carry clientRequestId: 256 characters of any script)."""
    quoted = urllib.parse.quote(thread_id, safe="")
    if len(quoted) <= 128:
        return quoted
    return f"{quoted[:80]}-{hashlib.sha256(thread_id.encode()).hexdigest()[:32]}"


def _without_hook_tokens(result: dict[str, Any]) -> dict[str, Any]:
    """A tool result for an agent with hook URLs' tokens blanked (a person's message may hold
    one): no agent reads another's live hook."""
    text = json.dumps(result, ensure_ascii=False)
    return json.loads(orch.redact_hook_tokens(text)) if "/hooks/" in text else result


def _home_project(caller: ThreadState | None) -> str | None:
    """The project a calling thread creates threads in by default: its own, unless it is a
    scratch thread (then the default project)."""
    project_id = caller.thread.project_id if caller and caller.thread else None
    return None if project_id == "scratch" else project_id


def _live_run(state: ThreadState, scope: Scope) -> orch.Run | None:
    """The caller's active run, if the calling provider session owns it: the run's turn runs in
    that session (not merely on the same provider instance). A client scope has neither."""
    run = state.blocking_run()
    if run is None or scope.provider_instance_id not in (None, run.provider_instance_id):
        return None
    if scope.provider_session_id is None:
        return run
    attempt = state.entities["run-attempt"].get(run.active_attempt_id or "")
    pthread = state.entities["provider-thread"].get(run.provider_thread_id or "")
    if attempt is None or attempt.provider_turn_id is None or pthread is None \
            or pthread.provider_session_id != scope.provider_session_id:
        return None
    return run


def _lender(scope: Scope) -> tuple[str, str] | None:
    """The agent whose process slot its wait lends (a client caller holds none)."""
    if scope.kind != "thread" or not scope.thread_id or not scope.provider_session_id:
        return None
    return scope.thread_id, scope.provider_session_id


def _chars(value: Any) -> int:
    """How many characters ``value`` takes in a tool result's text."""
    return len(json.dumps(value, ensure_ascii=False))


def _bounded(text: str | None, max_chars: int) -> str | None:
    if text is None or len(text) <= max_chars:
        return text
    return text[:max(0, max_chars - len(TRUNCATION_MARK))] + TRUNCATION_MARK


def _thread_state(thread: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The shell fields of ``_THREAD_STATE`` from a thread's JSON and its list row. A thread
    whose own turn is over while tasks it delegated still work waits on those threads."""
    return {"archived": thread.get("archivedAt") is not None, "snoozed": row["snoozed"],
            "snoozedUntil": thread.get("snoozedUntil"),
            "blockedOnThreadWait": row["pendingBackgroundTasks"] > 0 and row["status"] in (
                "idle", RunStatus.WAITING, *RUN_TERMINAL),
            "pendingBackgroundTasks": row["pendingBackgroundTasks"],
            "linkedPullRequest": thread.get("linkedPullRequest")}


def _request_summary(request: orch.RuntimeRequest) -> dict[str, Any]:
    return {"requestId": request.id, "kind": request.kind_, "title": request.title,
            "status": request.status, "runId": request.run_id, "createdAt": request.created_at,
            "options": list(request.detail.get("options") or [])}


# =============================================================================================
# MCP wiring


def _result(payload: Mapping[str, Any], *, is_error: bool) -> types.CallToolResult:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                structured_content=dict(payload), is_error=is_error)


def failure_result(code: str, message: str) -> types.CallToolResult:
    """A typed failure as a tool result: isError, {"_tag": "OrchestratorMcpFailure", ...}."""
    return _result({"_tag": "OrchestratorMcpFailure", "code": code, "message": message},
                   is_error=True)


def build_mcp_server(toolkit: Toolkit, *, version: str) -> Server:
    async def list_tools(ctx: ServerRequestContext, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(_published_tools().values()))

    async def call_tool(ctx: ServerRequestContext, params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        async def progress(done: float, message: str) -> None:
            try:
                await ctx.session.report_progress(done, None, message)
            except Exception as exc:  # a client gone mid-wait must not fail the wait
                log.debug("progress not delivered: %s", exc)
        try:
            payload = await toolkit.call(params.name, params.arguments, progress=progress)
        except Exception as exc:  # the one place MCP shapes a failure
            code, message = failure_of(exc, f"tool {params.name!r}")
            return failure_result(code if code in FAILURE_CODES else "orchestration_error",
                                  message)
        return _result(payload, is_error=False)

    def input_schema(name: str) -> Mapping[str, Any] | None:
        tool = _published_tools().get(name)
        return None if tool is None else tool.input_schema

    return Server("t3", version=version, on_list_tools=list_tools, on_call_tool=call_tool,
                  get_tool_input_schema=input_schema)
