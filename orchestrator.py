"""orchestrator.py: t3's domain rules.

A command is decided into events plus effect requests by ``decide``, a pure function of the
thread's state, the command, a clock reading and an id source: nothing in it awaits, reads a
clock or draws randomness. ``Orchestrator.dispatch`` serializes commands per thread, answers a
command id it has seen from its receipt, commits receipt + events + projections + outbox rows in
one transaction (``store.py``), then wakes waiters and the effect worker. The effect worker
claims outbox rows under a lease and drives provider adapters (handed in by ``t3.py``); what the
adapters report comes back as ingest commands through the same path, acknowledged only after
they committed.

Rules that hold everywhere below:
- App ids are identity; provider ids are refs. Ids derive from command ids where a retry must
  converge on the same entity.
- Only the root node completes a run: ``running -> waiting -> completed``.
- A run whose provider process is gone never stays ``running``: it ends ``interrupted`` or
  ``failed`` with a visible ``statusReason``.
- No SQL, subprocesses or HTTP here; never imports ``providers.py`` or ``tools.py``.

Features outside the core (schedules.py, history.py, metadata.py, links.py, workspace.py's
preparation of a launch's worktree) plug in only through the tables here: ``decides`` (a
command and its decide function), ``register_entities``, ``EFFECTS`` (an outbox effect),
``RUN_HOOKS`` (a say in a run's start), ``BEGIN_PREPARATION`` and ``SETUP_ANSWERED`` (the
preparation's) and ``Orchestrator.attach`` (a runtime ``Part``); this file never imports them.
"""

from __future__ import annotations

import asyncio
import calendar
import collections
import contextlib
import datetime
import email.utils
import enum
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import store as _store

__all__ = [
    "T3Error", "CommandRejected", "RunStatus", "RUN_TERMINAL", "RUN_BLOCKING", "RuntimeMode",
    "InteractionMode", "Actor", "CreationSource", "AppThread", "Run", "RunAttempt",
    "ExecutionNode", "ProviderSession", "ProviderThread", "ProviderTurn", "RuntimeRequest",
    "ConversationMessage", "TurnItem", "ThreadState", "Capabilities", "ProviderInfo", "Clock",
    "IdSource", "CreateThread", "InitialMessage", "DispatchMessage", "InterruptRun",
    "RespondRuntimeRequest", "CancelQueuedRun", "Decision", "decide", "AdapterEvent",
    "TextDelta", "ReasoningDelta", "ToolUpdate", "PlanUpdate", "RuntimeRequestOpened",
    "TurnEnded", "ProviderAdapter", "ProviderSessionHandle", "Orchestrator", "McpEndpoint",
    "SessionCredentials", "Subagent", "ContextTransfer", "DelegateTask", "SetWakePolicy",
    "RequestTaskCancel", "FinalizeSubagent", "task_result", "TASK_TERMINAL",
    "NotifyTaskQuestion", "bounded_id", "MAX_ID_CHARS", "mode_to_answer", "result_transfer_id",
    "AwaitAgentSlot", "GrantAgentSlot", "thread_title", "client_commands",
    "decides", "register_entities", "EffectKind", "Entity", "Command", "Draft", "Part",
    "iso_time", "epoch_of", "parse_timestamp", "redact_hook_tokens",
    "StopThread", "ResumeThread", "RUN_LIVE", "SwitchProvider", "Workspaces", "parse_json",
    "json_too_deep", "MAX_JSON_DEPTH", "CONTROL_CHARACTERS", "EFFECTS", "RunHooks", "RUN_HOOKS",
    "thread_work", "put_item", "put_task", "MarkRunStarted", "SETUP_ANSWERED",
    "BEGIN_PREPARATION", "PermanentEffectError"]

log = logging.getLogger("t3.orchestrator")


# =============================================================================================
# Errors


class T3Error(Exception):
    """t3 could not do that. ``detail``: more fields a transport adds to the failure's body."""

    code = "orchestration_error"

    def __init__(self, message: str | None = None, *, code: str | None = None,
                 **detail: Any) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        if code is not None:
            self.code = code
        self.detail = detail


class CommandRejected(T3Error):
    """The command does not apply to the current state."""


# =============================================================================================
# Vocabulary


class RunStatus(enum.StrEnum):
    PREPARING = "preparing"
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    FAILED = "failed"
    CANCELLED = "cancelled"
    ROLLED_BACK = "rolled_back"


RUN_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.INTERRUPTED, RunStatus.FAILED,
                          RunStatus.CANCELLED, RunStatus.ROLLED_BACK})
RUN_BLOCKING = frozenset({RunStatus.PREPARING, RunStatus.STARTING, RunStatus.RUNNING,
                          RunStatus.WAITING})
RUN_LIVE = frozenset({RunStatus.PREPARING, RunStatus.STARTING, RunStatus.RUNNING})


class RuntimeMode(enum.StrEnum):
    APPROVAL_REQUIRED = "approval-required"
    AUTO_ACCEPT_EDITS = "auto-accept-edits"
    AUTO = "auto"
    FULL_ACCESS = "full-access"


RUNTIME_RANK = {m: i for i, m in enumerate(RuntimeMode)}
# What a terminal or a page acts on instead of showing: C0 controls (ESC begins the sequences
# that set a window's title, write the clipboard, clear the screen), DEL, C1, and the bidi
# controls that reorder the text around them. A title holds none; the CLI shows each escaped.
CONTROL_CHARACTERS = frozenset([*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F,
                                *range(0x202A, 0x202F), *range(0x2066, 0x206A)])


class InteractionMode(enum.StrEnum):
    PLAN = "plan"
    DEFAULT = "default"


INTERACTION_RANK = {m: i for i, m in enumerate(InteractionMode)}


def mode_to_answer(request_kind: str) -> RuntimeMode | None:
    """The narrowest runtime mode that may answer this kind of request for a descendant: none
    for questions, auto-accept-edits for file reads and changes, else auto."""
    edits = RuntimeMode.AUTO_ACCEPT_EDITS
    needed = {"user_input": None, "file-read": edits, "file-change": edits}
    return needed.get(request_kind, RuntimeMode.AUTO)


class Actor(enum.StrEnum):
    USER = "user"
    AGENT = "agent"
    SYSTEM = "system"


class CreationSource(enum.StrEnum):
    WEB = "web"
    MCP = "mcp"
    PROVIDER = "provider"
    SERVER = "server"
    CLI = "cli"


_ATTEMPT_STATUSES = frozenset({"pending", "running", "completed", "interrupted", "failed",
                               "cancelled", "superseded"})
_NODE_STATUSES = frozenset({"pending", "running", "waiting", "completed", "interrupted", "failed",
                            "cancelled", "rolled_back"})
_REQUEST_STATUSES = frozenset({"pending", "resolved", "expired", "cancelled"})
DECISIONS = ("accept", "acceptForSession", "decline", "cancel")
MAX_ID_CHARS = 160


def bounded_id(text: str) -> str:
    """``text``, or past MAX_ID_CHARS its head and a hash of the whole: derived ids nest (a
    delegated child's from its parent's command), so unbounded they grow with every level."""
    if len(text) <= MAX_ID_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return f"{text[:MAX_ID_CHARS - len(digest) - 1]}~{digest}"


MAX_JSON_DEPTH = 128
# What cannot nest: a string (escapes and all, closed or not), a run of other characters.
_FLAT_JSON = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[^"\[\]{}]+', re.DOTALL)
_NESTING = {"[": 1, "{": 1, "]": -1, "}": -1}


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` for what comes from outside t3 (a request body, a /ws frame, an agent's
    line): nesting past MAX_JSON_DEPTH is a ValueError, as malformed JSON is, where json.loads
    would raise RecursionError (or hand on what code that recurses into it cannot take)."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    if json_too_deep(text):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(text)


def json_too_deep(text: str) -> bool:
    """Whether brackets outside strings nest past MAX_JSON_DEPTH (few brackets: no scan)."""
    return text.count("[") + text.count("{") > MAX_JSON_DEPTH and max(itertools.accumulate(
        map(_NESTING.__getitem__, _FLAT_JSON.sub("", text))), default=0) > MAX_JSON_DEPTH


REDACTED = "<redacted>"
# A hook URL's token (43 URL-safe characters: secrets.token_urlsafe(32)) after its task's id.
_HOOK_TOKEN = re.compile(r"(/hooks/scheduled-task[^/\s\"'<>?#]*/)[\w-]{43}(?![\w-])", re.ASCII)


def iso_time(epoch: float) -> str:
    """An epoch time as t3 writes times: UTC, milliseconds, ``Z``."""
    ms = int(round(epoch * 1000))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def epoch_of(iso: str) -> float:
    """The epoch time of a time t3 wrote (``iso_time``)."""
    seconds, _, fraction = iso.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(seconds, "%Y-%m-%dT%H:%M:%S")) + \
        int((fraction or "0")[:3].ljust(3, "0")) / 1000


def redact_hook_tokens(text: str) -> str:
    """``text`` with every hook URL's token blanked (``/hooks/<task>/<redacted>``): what
    providers, tool results and logs carry never hands a live hook to whoever reads them."""
    return _HOOK_TOKEN.sub(rf"\g<1>{REDACTED}", text) if "/hooks/" in text else text


def parse_timestamp(value: str) -> float | None:
    """Epoch seconds from epoch seconds or milliseconds, ISO 8601 (naive: UTC) or an HTTP date."""
    value = value.strip()
    if re.fullmatch(r"\d{1,16}(\.\d{1,9})?", value):
        number = float(value)
        return number / 1000 if number > 1e11 else number  # 1e11 s is the year 5138
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


# =============================================================================================
# Entities: frozen values; events carry the whole entity after each change (camelCase JSON).


@functools.cache  # every event (de)serializes whole entities: ~140 calls per command otherwise
def _names(cls: type) -> tuple[tuple[str, str], ...]:
    """A dataclass's (field name, camelCase key) pairs: ``provider_turn_id`` ->
    ``providerTurnId``; ``kind_`` -> ``kind`` (a name a ClassVar took)."""
    return tuple((f.name, f.name.split("_")[0] + "".join(
        part.title() for part in f.name.split("_")[1:])) for f in fields(cls))


@dataclass(frozen=True, slots=True)
class Entity:
    kind: ClassVar[str]
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {}
    opens_stream: ClassVar[bool] = False  # its id names an event stream (a thread's, a task's)
    id: str

    @property
    def stream(self) -> str:
        """The event stream its events belong to: its own, or its thread's."""
        return self.id if self.opens_stream else self.thread_id  # type: ignore[attr-defined]

    def held(self) -> bool:
        """Whether a thread's state keeps it in memory (decide needs it); the store keeps all."""
        return True

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, name) for name, key in _names(type(self))}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Any:
        entity = cls(**{name: data[key] for name, key in _names(cls) if key in data})
        for name, allowed in cls._checks.items():
            if getattr(entity, name) not in allowed:
                raise ValueError(f"{cls.__name__}.{name}: unknown value {getattr(entity, name)!r}")
        return entity


@dataclass(frozen=True, slots=True)
class AppThread(Entity):
    kind: ClassVar[str] = "thread"
    opens_stream: ClassVar[bool] = True
    project_id: str
    title: str
    provider_instance_id: str
    model_selection: Mapping[str, Any]
    runtime_mode: str
    interaction_mode: str
    created_by: str
    creation_source: str
    created_at: str
    updated_at: str
    lineage: Mapping[str, Any]
    branch: str | None = None
    worktree_path: str | None = None
    workspace: str | None = None  # the directory the agent runs in
    active_provider_thread_id: str | None = None
    forked_from: Mapping[str, Any] | None = None
    archived_at: str | None = None
    deleted_at: str | None = None
    snoozed_until: str | None = None
    snoozed_at: str | None = None
    last_visited_at: str | None = None
    title_regeneration: Mapping[str, Any] | None = None  # {requestId, startedAt} while in flight
    linked_pull_request: Mapping[str, Any] | None = None  # {repository, number, url}


@dataclass(frozen=True, slots=True)
class Run(Entity):
    kind: ClassVar[str] = "run"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": frozenset(RunStatus)}
    thread_id: str
    ordinal: int
    provider_instance_id: str
    model_selection: Mapping[str, Any]
    user_message_id: str
    status: str
    requested_at: str
    provider_thread_id: str | None = None
    root_node_id: str | None = None
    active_attempt_id: str | None = None
    queue_position: int | None = None
    started_at: str | None = None
    completed_at: str | None = None
    checkpoint_id: str | None = None
    context_handoff_id: str | None = None
    status_reason: str | None = None  # why it ended as it did, in words a person can act on
    failure: Mapping[str, Any] | None = None
    # queued only until an agent process slot frees (max_live_agent_processes); it occupies its
    # thread as a starting run does
    awaiting_agent_slot: bool = False
    queue_held: bool = False  # queued, held by a thread Stop until Resume releases it


@dataclass(frozen=True, slots=True)
class RunAttempt(Entity):
    kind: ClassVar[str] = "run-attempt"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": _ATTEMPT_STATUSES}
    run_id: str
    thread_id: str
    attempt_ordinal: int
    root_node_id: str
    provider_instance_id: str
    reason: str
    status: str
    provider_thread_id: str | None = None
    provider_turn_id: str | None = None
    started_at: str | None = None
    completed_at: str | None = None


@dataclass(frozen=True, slots=True)
class ExecutionNode(Entity):
    kind: ClassVar[str] = "node"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": _NODE_STATUSES}
    thread_id: str
    run_id: str | None
    parent_node_id: str | None
    root_node_id: str
    kind_: str  # root_turn | tool_call | approval_request | user_input_request | subagent | ...
    status: str
    counts_for_run: bool
    provider_thread_id: str | None = None
    provider_turn_id: str | None = None
    runtime_request_id: str | None = None
    native_ref: str | None = None
    started_at: str | None = None
    completed_at: str | None = None


@dataclass(frozen=True, slots=True)
class ProviderSession(Entity):
    kind: ClassVar[str] = "provider-session"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {
        "status": frozenset({"starting", "ready", "running", "waiting", "stopped", "error"})}
    thread_id: str
    driver: str
    provider_instance_id: str
    status: str
    cwd: str
    model: str | None
    created_at: str
    updated_at: str
    pid: int | None = None
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class ProviderThread(Entity):
    kind: ClassVar[str] = "provider-thread"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {
        "status": frozenset({"not_loaded", "idle", "active", "archived", "closed", "error"})}
    app_thread_id: str
    driver: str
    provider_instance_id: str
    status: str
    created_at: str
    updated_at: str
    provider_session_id: str | None = None
    native_thread_ref: str | None = None
    first_run_ordinal: int | None = None
    last_run_ordinal: int | None = None

    @property
    def stream(self) -> str:
        return self.app_thread_id


@dataclass(frozen=True, slots=True)
class ProviderTurn(Entity):
    kind: ClassVar[str] = "provider-turn"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": frozenset({
        "pending", "running", "completed", "interrupted", "failed", "cancelled"})}
    thread_id: str
    provider_thread_id: str
    node_id: str
    run_attempt_id: str
    ordinal: int
    status: str
    native_turn_ref: str | None = None
    started_at: str | None = None
    completed_at: str | None = None


@dataclass(frozen=True, slots=True)
class RuntimeRequest(Entity):
    kind: ClassVar[str] = "runtime-request"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": _REQUEST_STATUSES}
    thread_id: str
    run_id: str
    node_id: str
    kind_: str  # command | file-read | file-change | permission | user_input | mcp-elicitation
    status: str
    title: str
    detail: Mapping[str, Any]
    response_capability: Mapping[str, Any]
    created_at: str
    native_request_ref: str | None = None
    provider_turn_id: str | None = None
    decision: str | None = None
    answers: Mapping[str, Any] | None = None
    resolved_at: str | None = None
    status_reason: str | None = None
    answered_by: Mapping[str, Any] | None = None  # {"kind": "client"} | {"kind": "thread", ...}


@dataclass(frozen=True, slots=True)
class ConversationMessage(Entity):
    kind: ClassVar[str] = "message"
    thread_id: str
    run_id: str | None
    node_id: str | None
    role: str  # user | assistant | system
    text: str
    streaming: bool
    created_by: str
    creation_source: str
    created_at: str
    updated_at: str


@dataclass(frozen=True, slots=True)
class TurnItem(Entity):
    """One row of a thread's timeline. Message items take their text from the message."""

    kind: ClassVar[str] = "turn-item"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": frozenset({
        "pending", "running", "waiting", "completed", "failed", "cancelled", "interrupted"})}
    thread_id: str
    run_id: str | None
    node_id: str | None
    type: str
    status: str
    position: int
    updated_at: str
    title: str | None = None
    message_id: str | None = None
    text: str | None = None
    data: Mapping[str, Any] | None = None
    input_intent: str | None = None
    started_at: str | None = None
    completed_at: str | None = None


TASK_STATUSES = frozenset({"pending", "running", "waiting", "completed", "failed", "cancelled",
                           "interrupted"})
TASK_TERMINAL = frozenset({"completed", "failed", "cancelled", "interrupted"})


@dataclass(frozen=True, slots=True)
class Subagent(Entity):
    """The parent's record of a delegated task; its id is the task id (= the parent's node id)."""

    kind: ClassVar[str] = "subagent"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"status": TASK_STATUSES}
    thread_id: str
    run_id: str
    parent_node_id: str
    origin: str  # app_owned
    created_by: str
    driver: str
    provider_instance_id: str
    child_thread_id: str
    child_run_id: str
    prompt: str
    title: str
    model: str | None
    completion_wake: str  # always | settled_only
    status: str
    started_at: str
    updated_at: str
    result: str | None = None
    completed_at: str | None = None
    cancel_requested: bool = False
    result_run_id: str | None = None  # the child run whose result was published
    # the child's questions, by request id: {"state": "held", "question", "childThreadId"} while
    # the parent's wait should report it (a catch-up wake if it does not), {"state": "settled"}
    # once delivered, answered or withdrawn
    questions: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ContextTransfer(Entity):
    kind: ClassVar[str] = "context-transfer"
    thread_id: str  # the thread that owns the record (a delegated task's parent)
    type: str  # subagent_spawn | subagent_result | fork | merge_back
    source_thread_id: str
    target_thread_id: str
    status: str  # (fork, merge_back) pending | consumed | superseded
    created_by: str
    created_at: str
    updated_at: str
    target_run_id: str | None = None
    summary: str | None = None
    consumed_at: str | None = None
    data: Mapping[str, Any] | None = None  # fork, merge_back: history.py's


_ENTITY_TYPES: dict[str, type[Entity]] = {}
_EVENT_TYPE: dict[str, str] = {}


def register_entities(*classes: type[Entity]) -> None:
    """Entity types whose events a thread's (or a stream's) state holds: the core's below, and
    a feature module's own (schedules.py) when t3.py imports it."""
    for cls in classes:
        _ENTITY_TYPES[cls.kind] = cls
        _EVENT_TYPE[cls.kind] = f"{cls.kind}.updated"


register_entities(AppThread, Run, RunAttempt, ExecutionNode, ProviderSession, ProviderThread,
                  ProviderTurn, RuntimeRequest, ConversationMessage, TurnItem, Subagent,
                  ContextTransfer)


@dataclass(slots=True)
class ThreadState:
    """Everything known about one thread, keyed by entity kind then id. Updated only by ``apply``."""

    thread: AppThread | None = None
    entities: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {kind: {} for kind in _ENTITY_TYPES if kind != "thread"})
    next_position: int = 0
    sequence: int = 0

    def apply(self, event_type: str, payload: Mapping[str, Any]) -> Any:
        """Put one committed event's entity, rebuilt from its payload (an appended text grows
        its open message); it. What an event means for the state, as a reader of the log sees
        it: the decide tests replay decisions through it. The orchestrator itself puts the
        entities decide made (``Decision.entities``), which are the same without the rebuild."""
        if event_type == _store.TEXT_APPENDED:
            message = self.entities["message"].get(payload["id"])
            if message is None:
                return None
            entity = replace(message, text=message.text + payload["text"],
                             updated_at=payload["updatedAt"])
        else:
            entity = _ENTITY_TYPES[_store.event_kind(event_type)].from_json(payload)
        self.put(entity)
        return entity

    @classmethod
    def load(cls, sequence: int, rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> ThreadState:
        state = cls(sequence=sequence)
        for kind, payloads in rows.items():
            for payload in payloads:
                state.put(_ENTITY_TYPES[kind].from_json(payload))
        return state

    def put(self, entity: Any) -> None:
        if isinstance(entity, AppThread):
            self.thread = entity
            return
        if not entity.held():
            self.entities[entity.kind].pop(entity.id, None)
            return
        self.entities[entity.kind][entity.id] = entity
        if isinstance(entity, TurnItem):
            self.next_position = max(self.next_position, entity.position + 1)

    # Reads used by decide and by tools
    @property
    def runs(self) -> list[Run]:
        return sorted(self.entities["run"].values(), key=lambda r: r.ordinal)

    def run(self, run_id: str) -> Run | None:
        return self.entities["run"].get(run_id)

    def latest_run(self) -> Run | None:
        runs = self.runs
        return runs[-1] if runs else None

    def blocking_run(self) -> Run | None:
        return next((r for r in reversed(self.runs) if r.status in RUN_BLOCKING), None)

    def queued_runs(self) -> list[Run]:
        queued = [r for r in self.runs if r.status == RunStatus.QUEUED]
        return sorted(queued, key=lambda r: (r.queue_position or r.ordinal, r.ordinal))

    def pending_requests(self) -> list[RuntimeRequest]:
        return sorted((r for r in self.entities["runtime-request"].values() if r.status == "pending"),
                      key=lambda r: r.created_at)

    def items(self) -> list[TurnItem]:
        return sorted(self.entities["turn-item"].values(), key=lambda i: i.position)

    def status(self) -> str:
        latest = self.latest_run()
        return latest.status if latest else "idle"

    def snoozed(self, now: str) -> bool:
        """Snoozed until a time still ahead, and not woken early: a snoozed thread wakes only
        for a pending request or a run that failed after it was snoozed (store.py's list filter
        says the same in SQL)."""
        t = self.thread
        if t is None or not t.snoozed_until or t.snoozed_until <= now or self.pending_requests():
            return False
        return not any(r.status == RunStatus.FAILED and (r.completed_at or "") > (t.snoozed_at or "")
                       for r in self.runs)

    def pending_background_tasks(self) -> int:
        """What holds the thread after its turn: its delegated tasks still working."""
        return sum(t.status not in TASK_TERMINAL for t in self.entities["subagent"].values())


# =============================================================================================
# Providers, as the domain sees them (providers.py implements these)


@dataclass(frozen=True, slots=True)
class Capabilities:
    supports_interrupt: bool = True
    supports_active_steering: bool = False
    supports_steering_by_restart: bool = True
    supports_queued_messages: bool = True
    supports_resume: bool = False
    supports_mcp: bool = False
    supports_fork: bool = False  # the driver can open a session as a native fork of another
    supports_fork_from_turn: bool = False  # ... through an earlier turn than the latest
    supports_rollback: bool = False  # the session handle has rollback(keep_turns)


@dataclass(frozen=True, slots=True)
class ProviderInfo:
    instance_id: str
    driver: str
    display_name: str | None
    models: Sequence[Mapping[str, Any]]
    capabilities: Capabilities
    available: bool = True
    constraints: Sequence[str] = ()
    runtime_modes: Sequence[str] | None = None  # None: every runtime mode is offered
    interaction_modes: Sequence[str] | None = None  # None: plan and default

    def first_model(self) -> str | None:
        return self.models[0]["id"] if self.models else None


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolUpdate:
    native_id: str
    status: str  # pending | running | completed | failed
    title: str | None = None
    tool_kind: str | None = None
    input: Any = None
    output: str | None = None


@dataclass(frozen=True, slots=True)
class PlanUpdate:
    entries: Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class RuntimeRequestOpened:
    native_ref: str
    request_kind: str
    title: str
    detail: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TurnEnded:
    status: str  # completed | interrupted | failed
    failure: str | None = None


AdapterEvent = TextDelta | ReasoningDelta | ToolUpdate | PlanUpdate | RuntimeRequestOpened | TurnEnded


@dataclass(frozen=True, slots=True)
class McpEndpoint:
    """t3's MCP server as one provider session sees it; each driver injects it in its own way."""

    name: str
    url: str
    headers: Mapping[str, str]


class SessionCredentials(Protocol):
    """Provider-session credentials (t3.py): issued before a session opens, kept alive while it
    serves a turn, replaced (with the session) when ``renewal_due``, revoked when it ends."""

    def issue(self, *, thread_id: str, provider_instance_id: str,
              provider_session_id: str) -> McpEndpoint | None: ...
    def set_active(self, provider_session_id: str, active: bool) -> None: ...
    def renewal_due(self, provider_session_id: str) -> bool: ...
    def revoke(self, provider_session_id: str) -> None: ...


class ProviderSessionHandle(Protocol):
    """A live provider process serving one app thread (providers.py)."""

    pid: int | None
    native_thread_ref: str | None
    events: asyncio.Queue[AdapterEvent | None]  # None: the process is gone (see exit_reason)
    exit_reason: str | None

    async def start_turn(self, text: str) -> None: ...
    async def steer_turn(self, text: str) -> None: ...
    async def interrupt_turn(self) -> None: ...
    async def respond(self, native_ref: str, decision: str | None,
                      answers: Mapping[str, Any] | None) -> None: ...
    def alive(self) -> bool: ...
    async def close(self, *, grace: float = 3.0) -> None: ...


class ProviderAdapter(Protocol):
    """``open_session`` takes ``fork`` ({ref, dropTurns}: open as a native fork of that
    conversation without its last dropTurns turns; the handle's ``forked`` says it did) only
    where ``supports_fork`` is advertised."""

    info: ProviderInfo

    async def open_session(self, *, session_id: str, thread_id: str, cwd: str, model: str | None,
                           runtime_mode: str, interaction_mode: str, resume_ref: str | None,
                           mcp: McpEndpoint | None) -> ProviderSessionHandle: ...


# =============================================================================================
# Commands


Clock = Callable[[], str]  # the current time as an ISO-8601 UTC string
IdSource = Callable[[str], str]  # a fresh unique id with the given prefix


@dataclass(frozen=True, slots=True)
class InitialMessage:
    message_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Command:
    """What every command carries: its id (the same id again is answered from its receipt) and
    the stream it is decided on, a thread's or a scheduled task's."""

    command_id: str
    thread_id: str
    # its wire name (ChangeThreadLifecycle's is one of several, a field); declared after the
    # fields, since a field of that name in a subclass takes this place in the field order
    type: ClassVar[str]


@dataclass(frozen=True, slots=True)
class CreateThread(Command):
    type: ClassVar[str] = "thread.create"
    project_id: str
    title: str
    provider_instance_id: str
    model: str | None
    runtime_mode: str
    interaction_mode: str
    workspace: str | None
    created_by: str
    creation_source: str
    initial_message: InitialMessage | None = None
    branch: str | None = None
    worktree_path: str | None = None
    # A launch into a new worktree: {repo, baseRef, fromOrigin, setup}; the first run waits
    # ``preparing`` until the ``workspace.prepare`` effect made it (needs initial_message).
    preparation: Mapping[str, Any] | None = None
    lineage: Mapping[str, Any] | None = None  # a fork's (history.py), a child's; None: a root's
    forked_from: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class DispatchMessage(Command):
    type: ClassVar[str] = "message.dispatch"
    # The mode and target are derived from the thread's state when the call arrives; a retry of
    # the same message must get the first answer even after the state moved on.
    fingerprint_fields: ClassVar[tuple[str, ...]] = (
        "thread_id", "message_id", "text", "created_by", "creation_source")
    message_id: str
    text: str
    created_by: str
    creation_source: str
    mode: str  # start_immediately | queue_after_active | steer_active | restart_active
    target_run_id: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("start_immediately", "queue_after_active", "steer_active",
                             "restart_active"):
            raise ValueError(f"unknown dispatch mode {self.mode!r}")
        if self.mode in ("steer_active", "restart_active") and not self.target_run_id:
            raise ValueError(f"{self.mode} needs target_run_id")


@dataclass(frozen=True, slots=True)
class InterruptRun(Command):
    type: ClassVar[str] = "run.interrupt"
    run_id: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class RespondRuntimeRequest(Command):
    type: ClassVar[str] = "runtime-request.respond"
    request_id: str
    decision: str | None = None
    answers: Mapping[str, Any] | None = None
    answered_by: Mapping[str, Any] | None = None  # who answered: recorded on the request

    def __post_init__(self) -> None:
        if (self.decision is None) == (self.answers is None):
            raise ValueError("give exactly one of decision or answers")
        if self.decision is not None and self.decision not in DECISIONS:
            raise ValueError(f"unknown decision {self.decision!r}")


@dataclass(frozen=True, slots=True)
class CancelQueuedRun(Command):
    type: ClassVar[str] = "queued-run.cancel"
    run_id: str


@dataclass(frozen=True, slots=True)
class StopThread(Command):
    """thread.stop (a person's Stop, and task_cancel on the child): interrupt the active turn and
    hold every queued turn, so nothing starts until ``thread.resume``."""

    type: ClassVar[str] = "thread.stop"
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ResumeThread(Command):
    """thread.resume: release the held turns, in their queue order."""

    type: ClassVar[str] = "thread.resume"


@dataclass(frozen=True, slots=True)
class DelegateTask(Command):
    """delegated_task.request: a child thread runs ``task`` (only it) for the parent's agent."""

    type: ClassVar[str] = "delegated_task.request"
    # What a retry must repeat to get the same task back; the parent run may differ by then.
    fingerprint_fields: ClassVar[tuple[str, ...]] = (
        "thread_id", "task", "title", "provider_instance_id", "model", "runtime_mode",
        "interaction_mode")
    # thread_id: the parent
    parent_run_id: str
    task: str
    title: str
    provider_instance_id: str
    model: str | None
    runtime_mode: str
    interaction_mode: str
    completion_wake: str  # settled_only (mode wait) | always (mode async)
    created_by: str
    creation_source: str

    @property
    def task_id(self) -> str:
        return bounded_id(f"node:delegated-task:{self.command_id}")


@dataclass(frozen=True, slots=True)
class SetWakePolicy(Command):
    type: ClassVar[str] = "delegated_task.wake-policy"
    task_id: str
    completion_wake: str


@dataclass(frozen=True, slots=True)
class RequestTaskCancel(Command):
    """Mark a task cancelled by its parent: no automatic delivery; a late success is interrupted."""

    type: ClassVar[str] = "delegated_task.cancel"
    task_id: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class FinalizeSubagent(Command):
    """The child's known work finished (``publish``): publish the result of its final work run
    ``run_id`` and wake the parent. Else ``run_id`` is later work: its result is recorded beside
    the published one, never replacing it."""

    type: ClassVar[str] = "subagent.finalize"
    # thread_id: the parent
    task_id: str
    status: str
    result: str
    run_id: str = ""
    publish: bool = True


@dataclass(frozen=True, slots=True)
class NotifyTaskQuestion(Command):
    """A delegated child asks a question: its parent's agent is told, unless it is already
    waiting on the task (the wait reports it) or the task was cancelled."""

    type: ClassVar[str] = "subagent.question"
    # thread_id: the parent
    task_id: str
    request_id: str
    child_thread_id: str
    question: str
    blocking: bool = True  # False: an async question, the child keeps working


@dataclass(frozen=True, slots=True)
class SettleTaskQuestion(Command):
    """A child's question no longer needs a notice: a wait delivered it, or it was answered,
    dismissed or expired. A notice still queued for the parent is cancelled."""

    type: ClassVar[str] = "subagent.question-settled"
    # thread_id: the parent
    task_id: str
    request_id: str


# Internal commands: the effect worker, the run executor and recovery speak these.


@dataclass(frozen=True, slots=True)
class AwaitAgentSlot(Command):
    """A starting run found every agent process slot taken: it waits ``queued``, saying why."""

    type: ClassVar[str] = "run.await-agent-slot"
    run_id: str
    attempt_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class GrantAgentSlot(Command):
    """A slot freed for a run waiting for one: it starts again."""

    type: ClassVar[str] = "run.grant-agent-slot"
    run_id: str
    attempt_id: str


@dataclass(frozen=True, slots=True)
class MarkRunStarted(Command):
    type: ClassVar[str] = "run.mark-started"
    run_id: str
    attempt_id: str
    provider_session_id: str
    session_created: bool
    pid: int | None
    native_thread_ref: str | None
    cwd: str
    resume_failed: bool = False  # a new session where the provider thread's could not load
    native_fork: bool = False  # the session opened as a native fork of the fork's source


@dataclass(frozen=True, slots=True)
class IngestProviderEvents(Command):
    type: ClassVar[str] = "provider.ingest"
    run_id: str
    attempt_id: str
    provider_session_id: str
    events: tuple[AdapterEvent, ...]


@dataclass(frozen=True, slots=True)
class CompleteRun(Command):
    """A waiting run's finalization; ``checkpoints``: what RunHooks.finalize captured."""

    type: ClassVar[str] = "run.complete"
    run_id: str
    checkpoints: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class FailRun(Command):
    """An effect for this run failed for good, or its provider session ended under it."""

    type: ClassVar[str] = "run.fail"
    run_id: str
    attempt_id: str | None
    status: str  # failed | interrupted
    reason: str

    def __post_init__(self) -> None:
        if self.status not in (RunStatus.FAILED, RunStatus.INTERRUPTED):
            raise ValueError(f"a run cannot be failed as {self.status!r}")


@dataclass(frozen=True, slots=True)
class EndProviderSession(Command):
    type: ClassVar[str] = "provider-session.end"
    provider_session_id: str
    status: str  # stopped | error
    reason: str


@dataclass(frozen=True, slots=True)
class RecoverThread(Command):
    """After a server restart: nothing of the old process is live any more."""

    type: ClassVar[str] = "thread.recover"
    reason: str
    resumable_run_ids: frozenset[str] = frozenset()


def fingerprint_of(command: Command) -> str:
    """A hash of what the command asks for, without its id: same id + other payload is refused."""
    def plain(value: Any) -> Any:
        if hasattr(value, "__dataclass_fields__"):
            return {"_": type(value).__name__,
                    **{name: plain(getattr(value, name)) for name, _ in _names(type(value))}}
        if isinstance(value, (list, tuple, frozenset, set)):
            items = [plain(v) for v in value]
            return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        return value
    body = plain(command)
    body.pop("command_id", None)
    counted = getattr(command, "fingerprint_fields", None)
    if counted is not None:
        body = {k: v for k, v in body.items() if k in counted}
    body["type"] = command.type
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


# =============================================================================================
# Effects


@dataclass(frozen=True, slots=True)
class EffectRequest:
    effect_type: str
    thread_id: str
    payload: Mapping[str, Any]
    key: str  # makes the effect id deterministic within its command

    @property
    def replay_safe(self) -> bool:
        """A claim after a crash may run it again (``EFFECTS``, with the runtime below)."""
        return EFFECTS[self.effect_type].replay_safe


@dataclass(frozen=True, slots=True)
class Decision:
    events: tuple[_store.NewEvent, ...]
    effects: tuple[EffectRequest, ...]
    result: Mapping[str, Any]
    cancel_effect_types: tuple[str, ...] = ()
    entities: tuple[Any, ...] = ()  # what each event records, for the in-memory state

    def commit(self, command: Command, base: tuple[str, int] | None = None) -> _store.Commit:
        return _store.Commit(
            command_id=command.command_id, command_type=command.type,
            fingerprint=fingerprint_of(command), thread_id=command.thread_id, events=self.events,
            effects=tuple(_store.NewEffect(
                effect_id=bounded_id(f"effect:{command.command_id}:{e.effect_type}:{e.key}"),
                thread_id=e.thread_id, effect_type=e.effect_type, payload=e.payload,
                replay_safe=e.replay_safe, max_attempts=EFFECTS[e.effect_type].attempts)
                for e in self.effects),
            result=self.result, cancel_effect_types=self.cancel_effect_types, base=base)


# =============================================================================================
# decide (pure): the draft, the registry, threads, messages and the run queue


_E = TypeVar("_E", bound="Entity")


class Draft:
    """The entities a decision changes, laid over the thread's state, in event order."""

    def __init__(self, state: ThreadState, command: Any, now: str, *,
                 sharing: Draft | None = None) -> None:
        self.state = state
        self.command = command
        self.now = now
        self.changed: dict[tuple[str, str], Any] = {}
        # A draft for a second thread in the same command shares the event and effect lists.
        self.events: list[_store.NewEvent] = sharing.events if sharing else []
        self.entities: list[Any] = sharing.entities if sharing else []
        self.effects: list[EffectRequest] = sharing.effects if sharing else []
        self.cancel_effect_types: list[str] = []
        self.next_position = state.next_position
        self.thread = state.thread

    def get(self, kind: str, entity_id: str | None) -> Any:
        if entity_id is None:
            return None
        if (kind, entity_id) in self.changed:
            return self.changed[(kind, entity_id)]
        return self.state.entities[kind].get(entity_id)

    def all(self, kind: str) -> list[Any]:
        merged = dict(self.state.entities[kind])
        merged.update({eid: e for (k, eid), e in self.changed.items() if k == kind})
        return list(merged.values())

    def put(self, entity: _E, event_type: str | None = None) -> _E:
        if isinstance(entity, AppThread):
            self.thread = entity
        else:
            self.changed[(entity.kind, entity.id)] = entity
        self._event(entity.stream, event_type or _EVENT_TYPE[entity.kind],
                    entity.to_json(), entity)
        return entity

    def update(self, kind: str, entity_id: str | None, **changes: Any) -> None:
        """Put the entity with ``changes``, if there is one."""
        if (entity := self.get(kind, entity_id)) is not None:
            self.put(replace(entity, **changes))

    def append(self, message: ConversationMessage, text: str) -> None:
        """Stream ``text`` onto an open message: it grows whole here, its event carries only
        ``text`` (store.TEXT_APPENDED)."""
        grown = self.changed[("message", message.id)] = replace(
            message, text=message.text + text, updated_at=self.now)
        self._event(message.thread_id, _store.TEXT_APPENDED, {
            "id": message.id, "threadId": message.thread_id, "runId": message.run_id,
            "text": text, "updatedAt": self.now}, grown)

    def _event(self, thread_id: str, event_type: str, payload: dict[str, Any], entity: Any) -> None:
        self.entities.append(entity)
        self.events.append(_store.NewEvent(
            event_id=bounded_id(f"event:{self.command.command_id}:{len(self.events)}"),
            thread_id=thread_id, type=event_type, occurred_at=self.now, payload=payload))

    def position(self) -> int:
        self.next_position += 1
        return self.next_position - 1

    def effect(self, effect_type: str, payload: Mapping[str, Any], key: str, *,
               thread_id: str | None = None) -> None:
        owner = thread_id or (self.thread.id if self.thread else self.command.thread_id)
        self.effects.append(EffectRequest(effect_type, owner, payload, key))

    def runs(self) -> list[Run]:
        return sorted(self.all("run"), key=lambda r: r.ordinal)

    def decision(self, result: Mapping[str, Any]) -> Decision:
        return Decision(tuple(self.events), tuple(self.effects), dict(result),
                        tuple(self.cancel_effect_types), tuple(self.entities))


@dataclass(frozen=True, slots=True)
class _Registered:
    decide: Callable[..., Mapping[str, Any]]
    client_types: tuple[str, ...]  # the wire types a person's client may send
    thread: bool  # the command acts on an existing thread (not a new one, not a scheduled task)


_COMMANDS: dict[type, _Registered] = {}  # command class -> how it is decided
_D = TypeVar("_D", bound=Callable[..., Mapping[str, Any]])


def decides(command_class: type[Any], *, client: bool | tuple[str, ...] = False,
            thread: bool = True) -> Callable[[_D], _D]:
    """Register the decide function of ``command_class`` (here, or in a feature module that
    t3.py imports); ``client``: a person's client may send it (True: its ``type``; a tuple: each
    of the wire types the class takes); ``thread``: it acts on an existing thread."""
    types = (command_class.type,) if client is True else client or ()

    def register(fn: _D) -> _D:
        _COMMANDS[command_class] = _Registered(fn, types, thread)
        return fn
    return register


def client_commands() -> tuple[str, ...]:
    """What a person's client may send (/ws and MCP); the rest are the server's own: a client
    forging provider output or recovery would falsify the record."""
    return tuple(t for entry in _COMMANDS.values() for t in entry.client_types)


@dataclass(frozen=True, slots=True)
class RunHooks:
    """A feature module's part in a thread's runs (history.py's: context handoffs, forks,
    merge-backs, checkpoints), in RUN_HOOKS once t3.py imported it. In decide, pure as decide is:
    ``preparation``, the workspace a run that starts now (not queued) prepares first (as
    CreateThread's); ``context``, at MarkRunStarted once per run, the context handoff it recorded
    for the run (its ``context_handoff_id``); ``handoffs``, the further handoffs it recorded for
    the run's first prompt, in order; ``completed``, at CompleteRun, what it recorded of
    ``checkpoints``: the run's checkpoint id; ``deleted``, at a thread's deletion. In the runtime:
    ``session``, extra ``open_session`` arguments (a native fork's ``fork``); ``started``, after
    MarkRunStarted, before the prompt goes out; ``prompt``, what that prompt sends instead of the
    user's ``text`` (the recorded handoffs, ``handoffIds``, before it); ``finalize``, the
    ``checkpoints`` a waiting run's CompleteRun carries."""

    preparation: Callable[[Draft], Mapping[str, Any] | None]
    context: Callable[[Draft, Run, MarkRunStarted, Mapping[str, ProviderInfo]], str | None]
    handoffs: Callable[[Draft, Run], list[str]]
    completed: Callable[[Draft, Run, Sequence[Mapping[str, Any]]], str | None]
    deleted: Callable[[Draft], None]
    session: Callable[[Orchestrator, ThreadState, Run, ProviderAdapter],
                      Awaitable[Mapping[str, Any]]]
    started: Callable[[Orchestrator, ThreadState, Run], Awaitable[None]]
    prompt: Callable[[ThreadState, Sequence[str], str], str]
    finalize: Callable[[Orchestrator, ThreadState, Run], Awaitable[Sequence[Mapping[str, Any]]]]


RUN_HOOKS: list[RunHooks] = []


def decide(state: ThreadState, command: Command, *, now: str, new_id: IdSource,
           providers: Mapping[str, ProviderInfo]) -> Decision:
    """State + command -> events + effect requests. Raises CommandRejected; never does I/O."""
    entry = _COMMANDS[type(command)]
    if entry.thread and (state.thread is None or (state.thread.deleted_at is not None
                                                  and not isinstance(command, RecoverThread))):
        raise CommandRejected(f"thread {command.thread_id} was not found", code="thread_not_found")
    draft = Draft(state, command, now)
    result = entry.decide(draft, command, new_id=new_id, providers=providers)
    return draft.decision(result)


@decides(CreateThread, client=True, thread=False)
def decide_create_thread(d: Draft, c: CreateThread, *, providers: Mapping[str, ProviderInfo],
                         **_: Any) -> Mapping[str, Any]:
    if d.state.thread is not None:
        raise CommandRejected(f"thread {c.thread_id} already exists", code="invalid_request")
    _registered(providers, c.provider_instance_id)
    thread = AppThread(
        id=c.thread_id, project_id=c.project_id, title=c.title,
        provider_instance_id=c.provider_instance_id,
        model_selection={"instanceId": c.provider_instance_id, "model": c.model},
        runtime_mode=c.runtime_mode, interaction_mode=c.interaction_mode,
        created_by=c.created_by, creation_source=c.creation_source, created_at=d.now,
        updated_at=d.now, lineage=c.lineage or {
            "parentThreadId": None, "relationshipToParent": None, "rootThreadId": c.thread_id},
        branch=c.branch, worktree_path=c.worktree_path, workspace=c.workspace,
        forked_from=c.forked_from)
    d.put(thread, "thread.created")
    result: dict[str, Any] = {"threadId": c.thread_id, "runId": None, "messageId": None}
    if c.initial_message:
        run = _new_run(d, message_id=c.initial_message.message_id, text=c.initial_message.text,
                       created_by=c.created_by, creation_source=c.creation_source, queued=False,
                       preparation=c.preparation)
        result.update(runId=run.id, messageId=c.initial_message.message_id, delivery="started")
    return result


def _new_run(d: Draft, *, message_id: str, text: str, created_by: str, creation_source: str,
             queued: bool, preparation: Mapping[str, Any] | None = None) -> Run:
    thread = d.thread
    assert thread is not None
    ordinal = len(d.runs()) + 1
    run_id = bounded_id(f"run:{thread.id}:{ordinal}")
    attempt_id = bounded_id(f"{run_id}:attempt:1")
    root_id = bounded_id(f"node:{run_id}:root")
    provider_thread_id = bounded_id(f"provider-thread:{thread.id}:{thread.provider_instance_id}")
    queue_position = max([r.queue_position or 0 for r in d.runs()
                          if r.status == RunStatus.QUEUED] + [0]) + 1 if queued else None
    run = d.put(Run(
        id=run_id, thread_id=thread.id, ordinal=ordinal,
        provider_instance_id=thread.provider_instance_id, model_selection=thread.model_selection,
        user_message_id=message_id, status=RunStatus.QUEUED if queued else
        RunStatus.PREPARING if preparation else RunStatus.STARTING,
        requested_at=d.now, provider_thread_id=provider_thread_id, root_node_id=root_id,
        active_attempt_id=attempt_id, queue_position=queue_position), "run.created")
    _put_attempt(d, run, 1, attempt_id, root_id, "initial")
    _user_message(d, run, root_id, message_id, text, created_by, creation_source)
    if not queued:
        _user_item(d, run, message_id, root_id, "turn_start")
    if preparation:
        for begin in BEGIN_PREPARATION:
            begin(d, run, preparation)
    elif not queued:
        d.effect("provider-turn.start", {"runId": run_id, "attemptId": attempt_id}, run_id)
    return run


def _put_attempt(d: Draft, run: Run, n: int, attempt_id: str, root_id: str, reason: str
                 ) -> None:
    """Attempt ``n`` of ``run`` and its root node, both pending."""
    d.put(RunAttempt(id=attempt_id, run_id=run.id, thread_id=run.thread_id, attempt_ordinal=n,
                     root_node_id=root_id, provider_instance_id=run.provider_instance_id,
                     reason=reason, status="pending", provider_thread_id=run.provider_thread_id),
          "run-attempt.created")
    d.put(ExecutionNode(id=root_id, thread_id=run.thread_id, run_id=run.id, parent_node_id=None,
                        root_node_id=root_id, kind_="root_turn", status="pending",
                        counts_for_run=True, provider_thread_id=run.provider_thread_id))


def _message_item_id(message_id: str) -> str:
    return bounded_id(f"turn-item:message:{message_id}")


def _request_item_id(request_id: str) -> str:
    return bounded_id(f"turn-item:runtime-request:{request_id}")


def _task_item_id(task_id: str) -> str:
    return bounded_id(f"turn-item:{task_id}")


def _question_message_id(request_id: str) -> str:
    return bounded_id(f"message:task-question:{request_id}")


def result_transfer_id(task_id: str) -> str:
    """The id of the context transfer that carries a delegated task's result to its parent."""
    return bounded_id(f"context-transfer:subagent_result:{task_id}")


def _user_message(d: Draft, run: Run, node_id: str | None, message_id: str, text: str,
                  created_by: str, creation_source: str) -> None:
    d.put(ConversationMessage(id=message_id, thread_id=run.thread_id, run_id=run.id,
                              node_id=node_id, role="user", text=text, streaming=False,
                              created_by=created_by, creation_source=creation_source,
                              created_at=d.now, updated_at=d.now))


def _steer_in(d: Draft, run: Run, attempt: RunAttempt, message_id: str, text: str,
              created_by: str, creation_source: str) -> None:
    """Deliver a message into the run's live turn (the provider steers actively)."""
    _user_message(d, run, run.root_node_id, message_id, text, created_by, creation_source)
    _user_item(d, run, message_id, run.root_node_id or "", "steer")
    d.effect("provider-turn.steer", {"runId": run.id, "attemptId": attempt.id,
                                     "messageId": message_id}, message_id)


def put_item(d: Draft, item_id: str, run: Run, node_id: str | None, type_: str, status: str,
             **fields: Any) -> TurnItem:
    """A new turn item of ``run`` at the timeline's end; a finished one completed now."""
    return d.put(TurnItem(id=item_id, thread_id=run.thread_id, run_id=run.id, node_id=node_id,
                          type=type_, status=status, position=d.position(), updated_at=d.now,
                          started_at=d.now, **fields,
                          completed_at=d.now if status in ("completed", "failed") else None))


def _user_item(d: Draft, run: Run, message_id: str, node_id: str, intent: str) -> TurnItem:
    return put_item(d, _message_item_id(message_id), run, node_id, "user_message", "completed",
                    message_id=message_id, input_intent=intent)


def thread_work(d: Draft) -> TurnItem | None:
    """Work of the thread's own that is no run's, while it runs: a ``running`` item of no run
    (history.py's rollback). No message is taken meanwhile; deleting the thread cancels it."""
    return next((i for i in d.all("turn-item") if i.run_id is None and i.status == "running"),
                None)


def sendable(d: Draft) -> AppThread:
    thread = d.thread
    assert thread is not None
    if thread.archived_at is not None:
        raise CommandRejected("the thread is archived", code="thread_not_sendable")
    return thread


def _registered(providers: Mapping[str, ProviderInfo], instance_id: str) -> ProviderInfo:
    if instance_id not in providers:
        raise CommandRejected(f"provider instance {instance_id!r} is not registered",
                              code="provider_unavailable")
    return providers[instance_id]


@decides(DispatchMessage, client=True)
def _decide_dispatch(d: Draft, c: DispatchMessage, *, providers: Mapping[str, ProviderInfo],
                     **_: Any) -> Mapping[str, Any]:
    thread = sendable(d)
    if d.get("message", c.message_id) is not None:
        raise CommandRejected(f"message {c.message_id} already exists", code="invalid_request")
    if (work := thread_work(d)) is not None:
        raise CommandRejected(f"a {work.type} of the thread is running; send again once it "
                              "ended", code="thread_not_sendable")
    if c.mode in ("steer_active", "restart_active"):
        return _decide_steer(d, c, providers)
    queued = any(r.status in RUN_BLOCKING or (r.status == RunStatus.QUEUED and not r.queue_held)
                 for r in d.runs())
    run = _new_run(d, message_id=c.message_id, text=c.text, created_by=c.created_by,
                   creation_source=c.creation_source, queued=queued, preparation=None if queued
                   else next(filter(None, (h.preparation(d) for h in RUN_HOOKS)), None))
    _promote_queued(d)  # only acts if queued runs were left with nothing blocking them
    run = d.get("run", run.id)
    return {"threadId": thread.id, "runId": run.id, "messageId": c.message_id,
            "delivery": "queued" if run.status == RunStatus.QUEUED else "started"}


def _run(d: Draft, run_id: str | None) -> Run:
    run = d.get("run", run_id)
    if run is None:
        raise CommandRejected(f"run {run_id} was not found", code="run_not_found")
    return run  # type: ignore[no-any-return]


def _steerable_run(d: Draft, run_id: str | None) -> tuple[Run, RunAttempt]:
    run = _run(d, run_id)
    attempt = d.get("run-attempt", run.active_attempt_id)
    turn = d.get("provider-turn", attempt.provider_turn_id) if attempt else None
    if run.status != RunStatus.RUNNING or turn is None or turn.status != "running":
        raise CommandRejected(f"run {run.id} has no active provider turn to steer",
                              code="thread_not_sendable")
    if _stop_reached(d, run):
        raise CommandRejected(f"a Stop already reached the turn of run {run.id}; send again "
                              "once it ended", code="thread_not_sendable")
    return run, attempt


def _decide_steer(d: Draft, c: DispatchMessage, providers: Mapping[str, ProviderInfo]
                  ) -> Mapping[str, Any]:
    run, attempt = _steerable_run(d, c.target_run_id)
    caps = getattr(providers.get(run.provider_instance_id), "capabilities", Capabilities())
    result = {"threadId": run.thread_id, "runId": run.id, "messageId": c.message_id}
    if c.mode == "steer_active" and caps.supports_active_steering:
        _steer_in(d, run, attempt, c.message_id, c.text, c.created_by, c.creation_source)
        return {**result, "delivery": "steered"}
    turn_message = d.get("message", run.user_message_id)
    for text in (c.text, turn_message.text if turn_message else ""):
        if _SESSION_COMMAND.match(text):
            raise CommandRejected(f"{text.split()[0]} cannot be interrupted or cut into: send "
                                  "once the turn ended", code="thread_not_sendable")
    if not (caps.supports_interrupt and caps.supports_steering_by_restart):
        if not (caps.supports_interrupt and caps.supports_queued_messages):
            raise CommandRejected("the provider can neither steer, restart nor stop a turn",
                                  code="thread_not_sendable")
        return {**result, **_stop_and_queue_ahead(d, c, run)}
    # Steering by interrupt-and-restart: the same run gets a new attempt with a new root node.
    _close_streams(d, attempt)
    _settle_open_work(d, run, "cancelled", "The turn was restarted with a new message.")
    n = attempt.attempt_ordinal + 1
    new_attempt_id = bounded_id(f"{run.id}:attempt:{n}")
    new_root = bounded_id(f"node:{run.id}:attempt:{n}:root")
    d.put(replace(attempt, status="superseded", completed_at=d.now))
    d.update("node", attempt.root_node_id, status="interrupted", completed_at=d.now)
    _put_attempt(d, run, n, new_attempt_id, new_root, "steering_restart")
    run = d.put(replace(run, status=RunStatus.STARTING, root_node_id=new_root,
                        active_attempt_id=new_attempt_id, user_message_id=c.message_id))
    _user_message(d, run, new_root, c.message_id, c.text, c.created_by, c.creation_source)
    _user_item(d, run, c.message_id, new_root, "steer")
    d.effect("provider-turn.restart", {"runId": run.id, "interruptedAttemptId": attempt.id,
                                       "attemptId": new_attempt_id}, new_attempt_id)
    return {**result, "delivery": "restarted" if c.mode == "restart_active" else "steered"}


# A turn or message that is a session command: interrupting it or cutting into it is unsafe.
_SESSION_COMMAND = re.compile(r"\s*/(compact|logout)(\s|$)")


def _stop_and_queue_ahead(d: Draft, c: DispatchMessage, run: Run) -> Mapping[str, Any]:
    """A provider that can stop a turn but not restart it with new input: the turn stops and
    the message runs next, behind only the unheld delegated-task results already queued."""
    _interrupt(d, run, "Stopped to deliver a new message.")
    new = _new_run(d, message_id=c.message_id, text=c.text, created_by=c.created_by,
                   creation_source=c.creation_source, queued=True)
    queue = [r for r in _queue(d) if r.id != new.id]
    ahead = [r for r in queue if not r.queue_held
             and r.user_message_id.startswith("message:task-wake:")]
    order = ahead + [new] + [r for r in queue if r not in ahead]
    for position, queued in enumerate(order, 1):
        current = d.get("run", queued.id)
        if current.queue_position != position:
            d.put(replace(current, queue_position=position))
    return {"runId": new.id, "delivery": "queued"}


@decides(InterruptRun, client=True)
def _decide_interrupt(d: Draft, c: InterruptRun, **_: Any) -> Mapping[str, Any]:
    run = _run(d, c.run_id)
    if run.status in RUN_TERMINAL:
        return {"threadId": run.thread_id, "runId": run.id, "status": run.status}
    if run.status == RunStatus.WAITING or (run.status == RunStatus.QUEUED
                                           and not run.awaiting_agent_slot):
        raise CommandRejected(f"run {run.id} is {run.status} and has no turn to interrupt",
                              code="thread_not_interruptible")
    return {"threadId": run.thread_id, "runId": run.id, "status": _interrupt(d, run, c.reason)}


def _interrupt(d: Draft, run: Run, reason: str | None) -> str:
    """Stop a live run's turn: ``interrupted`` at once when nothing reached the provider yet,
    else ``interrupt_requested`` (the provider's turn end terminalizes it)."""
    attempt = d.get("run-attempt", run.active_attempt_id)
    turn = d.get("provider-turn", attempt.provider_turn_id) if attempt else None
    why = reason or "Interrupted on request."
    put_item(d, bounded_id(f"turn-item:{run.id}:interrupt-request:{d.command.command_id}"),
             run, run.root_node_id, "run_interrupt_request", "completed", text=why)
    if turn is None or turn.status != "running":
        # Nothing reached the provider yet: the run ends here and its start is called off.
        _end_run(d, run, RunStatus.INTERRUPTED,
                 reason or "Interrupted before the provider started.")
        d.cancel_effect_types += _START_EFFECTS  # its setup command is killed
        for old in d.all("run-attempt"):  # a restart was cut short: stop the turn it replaced
            old_turn = d.get("provider-turn", old.provider_turn_id)
            if old.run_id == run.id and old_turn is not None and old_turn.status == "running":
                d.effect("provider-turn.interrupt", {"runId": run.id, "attemptId": old.id,
                                                     "reason": why}, old.id)
        return RunStatus.INTERRUPTED
    d.effect("provider-turn.interrupt", {"runId": run.id, "attemptId": attempt.id,
                                         "reason": why}, attempt.id)
    return "interrupt_requested"


_START_EFFECTS = ("provider-turn.start", "provider-turn.restart", "workspace.prepare")


def _stop_reached(d: Draft, run: Run) -> bool:
    """A Stop or interrupt already asked for this run's current turn to end."""
    return any(i.run_id == run.id and i.node_id == run.root_node_id
               and i.type == "run_interrupt_request" for i in d.all("turn-item"))


def _end_run(d: Draft, run: Run, status: str, reason: str | None,
             failure: Mapping[str, Any] | None = None) -> Run:
    """Terminalize a run with its attempt, root node, open requests and items; then promote."""
    attempt = d.get("run-attempt", run.active_attempt_id)
    if attempt is not None and attempt.status in ("pending", "running"):
        d.put(replace(attempt, status=status if status != RunStatus.WAITING else "completed",
                      completed_at=d.now))
        turn = d.get("provider-turn", attempt.provider_turn_id)
        if turn is not None and turn.status == "running":
            d.put(replace(turn, status="completed" if status == RunStatus.WAITING else status,
                          completed_at=d.now))
    root = d.get("node", run.root_node_id)
    if root is not None and root.status in ("pending", "running", "waiting"):
        d.put(replace(root, status=status, completed_at=None if status == RunStatus.WAITING
                      else d.now))
    _settle_open_work(d, run, status, f"The run ended ({status}) before an answer.")
    run = d.put(replace(run, status=status, status_reason=reason, failure=failure,
                        awaiting_agent_slot=False,
                        completed_at=None if status == RunStatus.WAITING else d.now))
    _catch_up_questions(d, run)
    if status == RunStatus.WAITING:
        d.effect("run.finalize", {"runId": run.id}, run.id)
    elif status in RUN_TERMINAL:
        _finalize_if_settled(d, run)
        _promote_queued(d)
    return run


def _settle_open_work(d: Draft, run: Run, status: str, reason: str) -> None:
    """Close what a run's turn left open: requests, child nodes, items, streaming messages."""
    done = RunStatus.COMPLETED if status == RunStatus.WAITING else status
    for request in d.all("runtime-request"):
        if request.run_id == run.id and request.status == "pending":
            d.put(replace(request, status="cancelled", resolved_at=d.now, status_reason=reason,
                          response_capability={"type": "not_resumable", "reason": reason}))
            _question_closed(d, request)
    for node in d.all("node"):
        if node.run_id == run.id and node.kind_ not in ("root_turn", "subagent") and \
                node.status in ("pending", "running", "waiting"):
            d.put(replace(node, status="cancelled" if node.runtime_request_id else done,
                          completed_at=d.now))
    for item in d.all("turn-item"):
        if item.run_id == run.id and item.type != "subagent" and \
                item.status in ("pending", "running", "waiting"):
            d.put(replace(item, status="cancelled" if item.type.endswith("_request") else done,
                          completed_at=d.now, updated_at=d.now))
    for message in d.all("message"):
        if message.run_id == run.id and message.streaming:
            d.put(replace(message, streaming=False, updated_at=d.now))


def _promote_queued(d: Draft) -> None:
    """Start the next queued run when nothing blocks the thread (same transaction)."""
    if any(r.status in RUN_BLOCKING or r.awaiting_agent_slot for r in d.runs()):
        return
    queued = [r for r in _queue(d) if not r.queue_held]
    if not queued or (d.thread and (d.thread.archived_at or d.thread.deleted_at)):
        return
    run = d.put(replace(queued[0], status=RunStatus.STARTING, queue_position=None))
    _user_item(d, run, run.user_message_id, run.root_node_id or "", "queued_turn")
    d.effect("provider-turn.start", {"runId": run.id, "attemptId": run.active_attempt_id}, run.id)


def _queue(d: Draft) -> list[Run]:
    """The queued turns in the order they start (not the runs waiting for an agent slot)."""
    return sorted((r for r in d.runs() if r.status == RunStatus.QUEUED
                   and not r.awaiting_agent_slot),
                  key=lambda r: (r.queue_position or r.ordinal, r.ordinal))


@decides(StopThread, client=True)
def _decide_stop(d: Draft, c: StopThread, **_: Any) -> Mapping[str, Any]:
    """Hold the queue first, so that the turn this ends promotes nothing; a turn a Stop or an
    interrupt already reached is not asked again. A ``waiting`` run finishes its finalization."""
    held = [run.id for run in _queue(d)]
    for run in _queue(d):
        if not run.queue_held:
            d.put(replace(run, queue_held=True))
    stopped = []
    for run in d.runs():
        if (run.status in RUN_LIVE or run.awaiting_agent_slot) and not _stop_reached(d, run):
            _interrupt(d, run, c.reason or "Stopped on request.")
            stopped.append(run.id)
    return {"threadId": c.thread_id, "interruptedRunIds": stopped, "heldRunIds": held}


@decides(ResumeThread, client=True)
def _decide_resume(d: Draft, c: ResumeThread, **_: Any) -> Mapping[str, Any]:
    released = [r.id for r in _queue(d) if r.queue_held]
    for run_id in released:
        d.put(replace(d.get("run", run_id), queue_held=False))
    _promote_queued(d)
    return {"threadId": c.thread_id, "releasedRunIds": released}


@decides(RespondRuntimeRequest, client=True)
def _decide_respond(d: Draft, c: RespondRuntimeRequest, **_: Any) -> Mapping[str, Any]:
    request = d.get("runtime-request", c.request_id)
    if request is None:
        raise CommandRejected(f"request {c.request_id} was not found", code="invalid_request")
    if request.status != "pending":
        raise CommandRejected(f"request {c.request_id} is already {request.status}",
                              code="invalid_request")
    if request.response_capability.get("type") != "live":
        raise CommandRejected("the provider can no longer receive an answer to this request",
                              code="invalid_request")
    declined = c.decision in ("decline", "cancel")
    d.put(replace(request, status="resolved", decision=c.decision, answers=c.answers,
                  resolved_at=d.now, answered_by=c.answered_by))
    d.update("node", request.node_id, status="cancelled" if declined else "completed",
             completed_at=d.now)
    item = d.get("turn-item", _request_item_id(request.id))
    if item is not None:
        d.put(replace(item, status="cancelled" if declined else "completed", updated_at=d.now,
                      completed_at=d.now, data={**(item.data or {}), "decision": c.decision,
                                                "answers": c.answers,
                                                "answeredBy": c.answered_by}))
    _question_closed(d, request)
    if request.response_capability.get("setup"):
        for answered in SETUP_ANSWERED:
            answered(d, c, request, declined)
    else:
        d.effect("runtime-request.respond", {
            "requestId": request.id, "runId": request.run_id,
            "providerSessionId": request.response_capability.get("providerSessionId"),
            "nativeRequestRef": request.native_request_ref, "decision": c.decision,
            "answers": c.answers}, request.id)
    return {"threadId": request.thread_id, "requestId": request.id, "status": "resolved",
            "decision": c.decision}


@decides(CancelQueuedRun, client=True)
def _decide_cancel_queued(d: Draft, c: CancelQueuedRun, **_: Any) -> Mapping[str, Any]:
    run = _run(d, c.run_id)
    if run.status != RunStatus.QUEUED:
        raise CommandRejected(f"run {run.id} is {run.status}, not queued", code="invalid_request")
    _cancel_queued(d, run)
    return {"threadId": run.thread_id, "runId": run.id, "status": RunStatus.CANCELLED}


def _cancel_queued(d: Draft, run: Run) -> None:
    if run.awaiting_agent_slot:  # its start was under way: it ends as a started run would
        _end_run(d, run, RunStatus.CANCELLED, "The queued run was cancelled.")
        return
    d.update("run-attempt", run.active_attempt_id, status="cancelled", completed_at=d.now)
    d.update("node", run.root_node_id, status="cancelled", completed_at=d.now)
    d.put(replace(run, status=RunStatus.CANCELLED, queue_position=None, completed_at=d.now,
                  status_reason="The queued run was cancelled."))


def _current(d: Draft, run_id: str, attempt_id: str) -> tuple[Run | None, RunAttempt | None]:
    run = d.get("run", run_id)
    attempt = d.get("run-attempt", attempt_id)
    if run is None or attempt is None or run.active_attempt_id != attempt_id:
        return None, attempt
    return run, attempt


@decides(AwaitAgentSlot)
def _decide_await_slot(d: Draft, c: AwaitAgentSlot, **_: Any) -> Mapping[str, Any]:
    run, attempt = _current(d, c.run_id, c.attempt_id)
    if run is None or attempt is None or run.status != RunStatus.STARTING:
        raise CommandRejected("the run is no longer waiting to start")
    d.put(replace(run, status=RunStatus.QUEUED, awaiting_agent_slot=True, status_reason=c.reason))
    return {"runId": run.id, "status": RunStatus.QUEUED}


@decides(GrantAgentSlot)
def _decide_grant_slot(d: Draft, c: GrantAgentSlot, **_: Any) -> Mapping[str, Any]:
    run, attempt = _current(d, c.run_id, c.attempt_id)
    if run is None or attempt is None or not run.awaiting_agent_slot \
            or run.status != RunStatus.QUEUED:
        raise CommandRejected("the run no longer waits for an agent process slot")
    _restart_waiting(d, run)
    return {"runId": run.id, "status": RunStatus.STARTING}


def _restart_waiting(d: Draft, run: Run) -> None:
    d.put(replace(run, status=RunStatus.STARTING, awaiting_agent_slot=False, status_reason=None))
    d.effect("provider-turn.start", {"runId": run.id, "attemptId": run.active_attempt_id},
             f"{run.id}:slot")


# =============================================================================================
# decide: provider turns: start, provider output, completion, failure, recovery


@decides(MarkRunStarted)
def _decide_mark_started(d: Draft, c: MarkRunStarted, *, providers: Mapping[str, ProviderInfo],
                         **_: Any) -> Mapping[str, Any]:
    run, attempt = _current(d, c.run_id, c.attempt_id)
    if run is None or attempt is None or run.status != RunStatus.STARTING:
        raise CommandRejected("the run is no longer waiting to start")
    thread = d.thread
    assert thread is not None
    provider = run.provider_instance_id
    driver = getattr(providers.get(provider), "driver", provider)
    session = d.get("provider-session", c.provider_session_id) or ProviderSession(
        id=c.provider_session_id, thread_id=run.thread_id, driver=driver,
        provider_instance_id=provider, status="running", cwd=c.cwd,
        model=run.model_selection.get("model"), created_at=d.now, updated_at=d.now)
    d.put(replace(session, status="running", pid=c.pid, updated_at=d.now))
    # Once per run (a restarted attempt's turn already had it); then further handoffs.
    handoff_id = None if run.context_handoff_id else next(filter(None, (
        h.context(d, run, c, providers) for h in RUN_HOOKS)), None)
    carried = [i for h in RUN_HOOKS for i in h.handoffs(d, run)]
    pthread = d.get("provider-thread", run.provider_thread_id) or ProviderThread(
        id=run.provider_thread_id or "", app_thread_id=run.thread_id, driver=driver,
        provider_instance_id=provider, status="active", created_at=d.now, updated_at=d.now,
        first_run_ordinal=run.ordinal)
    d.put(replace(pthread, status="active", provider_session_id=c.provider_session_id,
                  native_thread_ref=c.native_thread_ref or pthread.native_thread_ref,
                  last_run_ordinal=run.ordinal, updated_at=d.now))
    if thread.active_provider_thread_id != pthread.id:
        before = d.get("provider-thread", thread.active_provider_thread_id)
        if before is not None and before.status == "active":  # a provider switch
            d.put(replace(before, status="idle", updated_at=d.now))
        d.put(replace(thread, active_provider_thread_id=pthread.id, updated_at=d.now))
    turns = [t for t in d.all("provider-turn") if t.provider_thread_id == pthread.id]
    turn = d.put(ProviderTurn(id=bounded_id(f"provider-turn:{attempt.id}"), thread_id=run.thread_id,
                              provider_thread_id=pthread.id, node_id=attempt.root_node_id,
                              run_attempt_id=attempt.id, ordinal=len(turns) + 1, status="running",
                              started_at=d.now))
    d.put(replace(attempt, status="running", started_at=d.now, provider_turn_id=turn.id))
    d.update("node", attempt.root_node_id, status="running", started_at=d.now,
             provider_turn_id=turn.id)
    d.put(replace(run, status=RunStatus.RUNNING, started_at=run.started_at or d.now,
                  context_handoff_id=run.context_handoff_id or handoff_id))
    return {"runId": run.id, "providerTurnId": turn.id,
            "handoffIds": [i for i in (handoff_id, *carried) if i]}  # the first prompt's


@decides(IngestProviderEvents)
def _decide_ingest(d: Draft, c: IngestProviderEvents, **_: Any) -> Mapping[str, Any]:
    run, attempt = _current(d, c.run_id, c.attempt_id)
    if attempt is None:
        raise CommandRejected("unknown attempt")
    for event in c.events:
        if run is None or run.status not in (RunStatus.RUNNING,):
            # A superseded or ended attempt: only its provider turn's own end is recorded.
            if isinstance(event, TurnEnded):
                turn = d.get("provider-turn", attempt.provider_turn_id)
                if turn is not None and turn.status == "running":
                    d.put(replace(turn, status=event.status, completed_at=d.now))
            continue
        run = _ingest_one(d, run, attempt, c, _without_hook_tokens(event))
    return {"runId": c.run_id}


def _without_hook_tokens(event: AdapterEvent) -> AdapterEvent:
    """Provider output with hook URLs' tokens blanked: an agent that came upon one (in a file, a
    message) never passes it into events that other agents read."""
    if isinstance(event, (TextDelta, ReasoningDelta)):  # the stream: one test per chunk
        return event if "/hooks/" not in event.text else type(event)(redact_hook_tokens(event.text))
    changes: dict[str, Any] = {}
    for name, value in ((f.name, getattr(event, f.name)) for f in fields(event)):
        if isinstance(value, str) and "/hooks/" in value:
            changes[name] = redact_hook_tokens(value)
        elif isinstance(value, (Mapping, list, tuple)) and "/hooks/" in (
                text := json.dumps(value, ensure_ascii=False, default=str)):
            changes[name] = json.loads(redact_hook_tokens(text))
    return replace(event, **changes) if changes else event


def _ingest_one(d: Draft, run: Run, attempt: RunAttempt, c: IngestProviderEvents,
                event: AdapterEvent) -> Run:
    if isinstance(event, (TextDelta, ReasoningDelta)):
        role = "assistant" if isinstance(event, TextDelta) else "reasoning"
        _append_text(d, run, attempt, role, event.text)
    elif isinstance(event, ToolUpdate):
        _close_streams(d, attempt)
        _ingest_tool(d, run, attempt, event)
    elif isinstance(event, PlanUpdate):
        item_id = bounded_id(f"turn-item:{attempt.id}:plan")
        item = d.get("turn-item", item_id) or TurnItem(
            id=item_id, thread_id=run.thread_id, run_id=run.id, node_id=attempt.root_node_id,
            type="todo_list", status="running", position=d.position(), updated_at=d.now,
            title="Plan", started_at=d.now)
        text = "\n".join(f"[{e.get('status', 'pending')}] {e.get('content', '')}"
                         for e in event.entries)
        d.put(replace(item, text=text, data={"steps": list(event.entries)}, updated_at=d.now))
    elif isinstance(event, RuntimeRequestOpened):
        _close_streams(d, attempt)
        ingest_request(d, run, attempt, c.provider_session_id, event)
    elif isinstance(event, TurnEnded):
        _close_streams(d, attempt)
        if event.status == "completed":
            return _end_run(d, run, RunStatus.WAITING, None)
        if event.status == "interrupted":
            return _end_run(d, run, RunStatus.INTERRUPTED, _interrupt_reason(d, run))
        failure = {"class": "provider_error", "message": (event.failure or "")[:4096],
                   "code": None, "retryable": None}
        put_item(d, bounded_id(f"turn-item:{attempt.id}:error"), run, attempt.root_node_id,
                 "error", "failed", title="Provider error", text=event.failure)
        return _end_run(d, run, RunStatus.FAILED, event.failure or "The provider failed.", failure)
    return run


def _ingest_tool(d: Draft, run: Run, attempt: RunAttempt, event: ToolUpdate) -> None:
    """A tool call's node and turn item, made on its first update and updated by the rest."""
    root_id = attempt.root_node_id
    node_id = bounded_id(f"node:{attempt.id}:tool:{event.native_id}")
    status = event.status if event.status in _NODE_STATUSES - {"pending"} else "running"
    ended = d.now if status in ("completed", "failed") else None
    node = d.get("node", node_id) or ExecutionNode(
        id=node_id, thread_id=run.thread_id, run_id=run.id, parent_node_id=root_id,
        root_node_id=root_id, kind_="tool_call", status=status, counts_for_run=False,
        native_ref=event.native_id, started_at=d.now)
    d.put(replace(node, status=status, completed_at=ended))
    item_id = bounded_id(f"turn-item:{attempt.id}:tool:{event.native_id}")
    item = d.get("turn-item", item_id) or TurnItem(
        id=item_id, thread_id=run.thread_id, run_id=run.id, node_id=node_id, type="tool_call",
        status=status, position=d.position(), updated_at=d.now,
        title=event.title or "Tool call", data={}, started_at=d.now)
    data = dict(item.data or {})
    if event.input is not None:
        data["input"] = event.input
    if event.tool_kind:
        data["kind"] = event.tool_kind
    d.put(replace(item, status=status, title=event.title or item.title, data=data,
                  text=item.text if event.output is None else event.output, updated_at=d.now,
                  completed_at=ended))


def ingest_request(d: Draft, run: Run, attempt: RunAttempt, session_id: str | None,
                   event: RuntimeRequestOpened) -> None:
    """A provider's question or approval request (``session_id`` None: t3's own, a launch's
    setup commands): its node, request and turn item, once."""
    request_id = bounded_id(f"runtime-request:{session_id or run.id}:{event.native_ref}")
    if d.get("runtime-request", request_id) is not None:
        return
    root_id = attempt.root_node_id
    node_id = bounded_id(f"node:runtime-request:{request_id}")
    node_kind = "user_input_request" if event.request_kind == "user_input" \
        else "approval_request"
    d.put(ExecutionNode(id=node_id, thread_id=run.thread_id, run_id=run.id,
                        parent_node_id=root_id, root_node_id=root_id, kind_=node_kind,
                        status="waiting", counts_for_run=False,
                        runtime_request_id=request_id, native_ref=event.native_ref,
                        started_at=d.now))
    d.put(RuntimeRequest(
        id=request_id, thread_id=run.thread_id, run_id=run.id, node_id=node_id,
        kind_=event.request_kind, status="pending", title=event.title,
        detail=event.detail, created_at=d.now, native_request_ref=event.native_ref,
        provider_turn_id=attempt.provider_turn_id,
        response_capability={"type": "live", **(
            {"providerSessionId": session_id} if session_id else {"setup": True})}))
    put_item(d, _request_item_id(request_id), run, node_id, node_kind, "waiting",
             title=event.title, text=event.title, data={
                 "requestId": request_id, "requestKind": event.request_kind, **event.detail})
    task = _parent_task(d)
    if event.request_kind == "user_input" and task is not None:
        # Users rarely watch child threads: the parent's agent hears about the question.
        d.effect("subagent.question", {
            **task, "requestId": request_id, "question": event.title,
            "blocking": event.detail.get("isBlocking") is not False}, request_id,
            thread_id=task["parentThreadId"])


def _interrupt_reason(d: Draft, run: Run) -> str:
    requests = [i for i in d.all("turn-item")
                if i.run_id == run.id and i.type == "run_interrupt_request"]
    if requests:
        return max(requests, key=lambda i: i.position).text or "Interrupted on request."
    return "The provider ended the turn as cancelled."


def _append_text(d: Draft, run: Run, attempt: RunAttempt, role: str, text: str) -> None:
    """Stream text into the attempt's open assistant (or reasoning) message."""
    open_id = _open_stream_id(d, attempt, role)
    if open_id is not None:
        d.append(d.get("message", open_id), text)
        return
    n = sum(1 for m in d.all("message") if m.run_id == run.id and m.role == role)
    message_id = bounded_id(f"message:{attempt.id}:{role}:{n}")
    d.put(ConversationMessage(id=message_id, thread_id=run.thread_id, run_id=run.id,
                              node_id=attempt.root_node_id, role=role, text=text, streaming=True,
                              created_by=Actor.AGENT, creation_source=CreationSource.PROVIDER,
                              created_at=d.now, updated_at=d.now))
    put_item(d, _message_item_id(message_id), run, attempt.root_node_id,
             "assistant_message" if role == "assistant" else "reasoning", "running",
             message_id=message_id)


def _open_stream_id(d: Draft, attempt: RunAttempt, role: str) -> str | None:
    return next((str(m.id) for m in d.all("message") if m.streaming and m.role == role
                 and m.node_id == attempt.root_node_id), None)


def _close_streams(d: Draft, attempt: RunAttempt) -> None:
    for role in ("assistant", "reasoning"):
        open_id = _open_stream_id(d, attempt, role)
        if open_id is None:
            continue
        message = d.get("message", open_id)
        d.put(replace(message, streaming=False, updated_at=d.now))
        d.update("turn-item", _message_item_id(open_id), status="completed", updated_at=d.now,
                 completed_at=d.now)


def task_result(state: ThreadState, run: Run) -> str:
    """What a delegated run hands back: its provider error first when it failed, else the last
    assistant text of its final attempt."""
    attempt_root = run.root_node_id
    texts = [m for m in state.entities["message"].values()
             if m.run_id == run.id and m.role == "assistant" and m.text.strip()]
    final = [m for m in texts if m.node_id == attempt_root] or texts
    progress = max(final, key=lambda m: (m.created_at, m.id)).text if final else None
    if run.status == RunStatus.COMPLETED:
        return progress or "Child task completed without an assistant result."
    head = f"Child task ended with status {run.status}"
    if run.status_reason:
        head += f": {run.status_reason}"
    return head + (f"\n\nProgress before it ended:\n{progress}" if progress else "")


@decides(CompleteRun)
def _decide_complete(d: Draft, c: CompleteRun, **_: Any) -> Mapping[str, Any]:
    run = d.get("run", c.run_id)
    if run is None or run.status != RunStatus.WAITING:
        raise CommandRejected("the run is not waiting for finalization")
    d.update("node", run.root_node_id, status="completed", completed_at=d.now)
    checkpoint = next(filter(None, (h.completed(d, run, c.checkpoints) for h in RUN_HOOKS)), None)
    run = d.put(replace(run, status=RunStatus.COMPLETED, completed_at=d.now,
                        checkpoint_id=checkpoint or run.checkpoint_id))
    _finalize_if_settled(d, run)
    _promote_queued(d)
    return {"runId": run.id, "status": run.status}


@decides(FailRun)
def decide_fail_run(d: Draft, c: FailRun, **_: Any) -> Mapping[str, Any]:
    run = d.get("run", c.run_id)
    if run is None or run.status in RUN_TERMINAL or run.status == RunStatus.QUEUED:
        raise CommandRejected("the run is not active")
    if c.attempt_id is not None and run.active_attempt_id != c.attempt_id:
        raise CommandRejected("the attempt is no longer current")
    attempt = d.get("run-attempt", run.active_attempt_id)
    if c.status == RunStatus.FAILED:
        put_item(d, bounded_id(f"turn-item:{run.active_attempt_id}:error"), run,
                 run.root_node_id, "error", "failed", title="Run failed", text=c.reason)
    if attempt is not None:
        _close_streams(d, attempt)
    failure = {"class": "unknown", "message": c.reason[:4096], "code": None, "retryable": None} \
        if c.status == RunStatus.FAILED else None
    run = _end_run(d, run, c.status, c.reason, failure)
    return {"runId": run.id, "status": run.status}


@decides(EndProviderSession)
def _decide_end_session(d: Draft, c: EndProviderSession, **_: Any) -> Mapping[str, Any]:
    session = d.get("provider-session", c.provider_session_id)
    if session is None or session.status in ("stopped", "error"):
        raise CommandRejected("the session has already ended")
    d.put(replace(session, status=c.status, last_error=c.reason if c.status == "error" else None,
                  updated_at=d.now))
    _expire_requests(d, c.provider_session_id, c.reason)
    for pthread in d.all("provider-thread"):
        if pthread.provider_session_id == session.id and pthread.status == "active":
            d.put(replace(pthread, status="idle", updated_at=d.now))
    return {"providerSessionId": session.id, "status": c.status}


def _expire_requests(d: Draft, session_id: str | None, reason: str) -> None:
    for request in d.all("runtime-request"):
        asker = request.response_capability.get("providerSessionId")
        if request.status == "pending" and asker and session_id in (None, asker):
            d.put(replace(request, status="expired", resolved_at=d.now, status_reason=reason,
                          response_capability={"type": "not_resumable", "reason": reason}))
            _question_closed(d, request)
            d.update("turn-item", _request_item_id(request.id), status="cancelled",
                     updated_at=d.now, completed_at=d.now)


def _end_sessions(d: Draft, reason: str) -> None:
    """No provider process of the thread is live: its sessions, requests and turns end."""
    for session in d.all("provider-session"):
        if session.status not in ("stopped", "error"):
            d.put(replace(session, status="stopped", updated_at=d.now, last_error=reason))
    _expire_requests(d, None, reason)
    for pthread in d.all("provider-thread"):
        if pthread.status == "active":
            d.put(replace(pthread, status="idle", updated_at=d.now))
    for turn in d.all("provider-turn"):
        if turn.status == "running":
            d.put(replace(turn, status="interrupted", completed_at=d.now))


@decides(RecoverThread)
def _decide_recover(d: Draft, c: RecoverThread, **_: Any) -> Mapping[str, Any]:
    ended: list[str] = []
    if d.thread is not None and d.thread.deleted_at is not None:  # deleted by an older t3
        _end_owned(d, DELETED)
        return {"threadId": c.thread_id, "interruptedRunIds": ended}
    _end_sessions(d, c.reason)
    asking = {r.run_id for r in d.state.pending_requests()
              if r.response_capability.get("setup")}  # no session of it ended
    for run in d.runs():
        if run.status in (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.PREPARING) and \
                run.id not in c.resumable_run_ids | asking:
            _end_run(d, d.get("run", run.id), RunStatus.INTERRUPTED, c.reason)
            ended.append(run.id)
        elif run.awaiting_agent_slot:  # the line was in memory: it queues up again
            _restart_waiting(d, run)
    for task in d.all("subagent"):  # no wait outlives the server: its completion wakes
        if task.completion_wake == "settled_only" and task.status not in TASK_TERMINAL:
            d.put(replace(task, completion_wake="always", updated_at=d.now))
    _promote_queued(d)
    return {"threadId": c.thread_id, "interruptedRunIds": ended}


# =============================================================================================
# decide: delegated tasks: the parent's record, results, wakes and questions


@decides(DelegateTask, client=True)
def _decide_delegate(d: Draft, c: DelegateTask, *, providers: Mapping[str, ProviderInfo],
                     **_: Any) -> Mapping[str, Any]:
    parent = d.thread
    assert parent is not None
    run = d.get("run", c.parent_run_id)
    if run is None or run.status not in RUN_BLOCKING:
        raise CommandRejected("delegated tasks need an active run of the calling thread",
                              code="parent_not_active")
    info = _registered(providers, c.provider_instance_id)
    task_id = c.task_id
    child_id = bounded_id(f"thread:delegated-task:{c.command_id}")
    child_run_id = decide_create_thread(Draft(ThreadState(), c, d.now, sharing=d), CreateThread(
        command_id=c.command_id, thread_id=child_id, project_id=parent.project_id, title=c.title,
        provider_instance_id=c.provider_instance_id, model=c.model, runtime_mode=c.runtime_mode,
        interaction_mode=c.interaction_mode, workspace=parent.workspace, created_by=c.created_by,
        creation_source=c.creation_source, initial_message=InitialMessage(
            bounded_id(f"message:delegated-task:{c.command_id}"), c.task),
        branch=parent.branch, worktree_path=parent.worktree_path, lineage={
            "parentThreadId": parent.id, "relationshipToParent": "subagent",
            "rootThreadId": parent.lineage.get("rootThreadId") or parent.id},
        forked_from={"type": "node", "nodeId": task_id}), providers=providers)["runId"]
    put_task(d, run, c, driver=info.driver, child_thread_id=child_id, child_run_id=child_run_id)
    return {"taskId": task_id, "childThreadId": child_id, "childRunId": child_run_id}


def put_task(d: Draft, run: Run, c: DelegateTask, *, driver: str, child_thread_id: str,
             child_run_id: str) -> Subagent:
    """A delegated task's records in its parent (its node, the task, its timeline item, its
    spawn transfer), for a child here or in a linked environment (links.py: the child's link)."""
    d.put(ExecutionNode(id=c.task_id, thread_id=run.thread_id, run_id=run.id,
                        parent_node_id=run.root_node_id, root_node_id=run.root_node_id or c.task_id,
                        kind_="subagent", status="running", counts_for_run=False, started_at=d.now))
    task = d.put(Subagent(
        id=c.task_id, thread_id=run.thread_id, run_id=run.id, driver=driver,
        parent_node_id=run.root_node_id or c.task_id, origin="app_owned", created_by=c.created_by,
        provider_instance_id=c.provider_instance_id, child_thread_id=child_thread_id,
        child_run_id=child_run_id, prompt=c.task, title=c.title, model=c.model,
        completion_wake=c.completion_wake, status="running", started_at=d.now, updated_at=d.now))
    put_item(d, _task_item_id(task.id), run, task.id, "subagent", "running", title=c.title,
             text=c.task, data={"taskId": task.id, "childThreadId": child_thread_id,
                                "providerInstanceId": c.provider_instance_id, "model": c.model})
    d.put(ContextTransfer(id=bounded_id(f"context-transfer:subagent_spawn:{task.id}"),
                          thread_id=run.thread_id, type="subagent_spawn",
                          source_thread_id=run.thread_id, target_thread_id=child_thread_id,
                          status="consumed", created_by=c.created_by, created_at=d.now,
                          updated_at=d.now, target_run_id=child_run_id, consumed_at=d.now))
    return task


def _task(d: Draft, task_id: str) -> Subagent:
    task = d.get("subagent", task_id)
    if task is None:
        raise CommandRejected(f"task {task_id} was not found in this thread",
                              code="task_not_found")
    return task  # type: ignore[no-any-return]


@decides(SetWakePolicy, client=True)
def _decide_wake_policy(d: Draft, c: SetWakePolicy, **_: Any) -> Mapping[str, Any]:
    task = _task(d, c.task_id)
    if task.completion_wake != c.completion_wake:
        d.put(replace(task, completion_wake=c.completion_wake, updated_at=d.now))
    return {"taskId": task.id, "completionWake": c.completion_wake}


@decides(RequestTaskCancel, client=True)
def _decide_task_cancel(d: Draft, c: RequestTaskCancel, **_: Any) -> Mapping[str, Any]:
    task = _task(d, c.task_id)
    if not task.cancel_requested:
        d.put(replace(task, cancel_requested=True, updated_at=d.now))
    return {"taskId": task.id, "status": task.status}


@decides(FinalizeSubagent)
def _decide_finalize(d: Draft, c: FinalizeSubagent, *, providers: Mapping[str, ProviderInfo],
                     **_: Any) -> Mapping[str, Any]:
    task = _task(d, c.task_id)
    if not c.publish or task.status in TASK_TERMINAL:
        # Later work (or already published: idempotent): recorded beside the published result.
        transfer_id = later_transfer_id(task.id, c.run_id)
        if c.run_id and c.run_id != task.result_run_id and \
                d.get("context-transfer", transfer_id) is None:
            _result_transfer(d, task, transfer_id, c.result)
        return {"taskId": task.id, "status": task.status}
    status = c.status
    if task.cancel_requested and status == "completed":
        status = "interrupted"  # a cancelled task's late success does not count as one
    task = d.put(replace(task, status=status, result=c.result, completed_at=d.now,
                         updated_at=d.now, result_run_id=c.run_id or task.child_run_id))
    d.update("node", task.id, status=status, completed_at=d.now)
    d.update("turn-item", _task_item_id(task.id), status=status, text=c.result, updated_at=d.now,
             completed_at=d.now)
    _result_transfer(d, task, result_transfer_id(task.id), c.result, task.run_id)
    live = any(r.status in RUN_LIVE for r in d.runs())
    if not task.cancel_requested and (task.completion_wake == "always" or not live):
        verb = "completed" if status == "completed" else f"ended with status {status}"
        _notify_parent(d, bounded_id(f"message:task-wake:{task.id}"), providers,
                       f'Delegated task "{task.title}" {verb}. Use task_status with taskId '
                       f"{task.id} to read the result.")
    _finalize_if_settled(d)
    return {"taskId": task.id, "status": status}


def _result_transfer(d: Draft, task: Subagent, transfer_id: str, result: str,
                     target_run_id: str | None = None) -> None:
    d.put(ContextTransfer(id=transfer_id, thread_id=task.thread_id, type="subagent_result",
                          source_thread_id=task.child_thread_id, target_thread_id=task.thread_id,
                          status="consumed", created_by=Actor.SYSTEM, created_at=d.now,
                          updated_at=d.now, target_run_id=target_run_id, summary=result,
                          consumed_at=d.now))


def _notify_parent(d: Draft, message_id: str, providers: Mapping[str, ProviderInfo],
                   text: str) -> None:
    """Deliver a system notice to this thread's agent: steered in if it can be, else queued."""
    for run in reversed(d.runs()):
        attempt = d.get("run-attempt", run.active_attempt_id)
        turn = d.get("provider-turn", attempt.provider_turn_id) if attempt else None
        info = providers.get(run.provider_instance_id)
        if run.status == RunStatus.RUNNING and turn is not None and turn.status == "running" \
                and info is not None and info.capabilities.supports_active_steering:
            _steer_in(d, run, attempt, message_id, text, Actor.AGENT, CreationSource.SERVER)
            return
        break
    blocked = any(r.status in RUN_BLOCKING or (r.status == RunStatus.QUEUED and not r.queue_held)
                  for r in d.runs())
    _new_run(d, message_id=message_id, text=text, created_by=Actor.AGENT,
             creation_source=CreationSource.SERVER, queued=blocked)


def _parent_task(d: Draft) -> dict[str, str] | None:
    """For a delegated child thread: who its parent is and which task it serves."""
    thread = d.thread
    if thread is None or thread.lineage.get("relationshipToParent") != "subagent" \
            or not thread.forked_from:
        return None
    return {"parentThreadId": thread.lineage["parentThreadId"],
            "taskId": thread.forked_from["nodeId"], "childThreadId": thread.id}


@decides(NotifyTaskQuestion)
def _decide_task_question(d: Draft, c: NotifyTaskQuestion, *,
                          providers: Mapping[str, ProviderInfo], **_: Any) -> Mapping[str, Any]:
    task = _task(d, c.task_id)
    live = any(r.status in RUN_LIVE for r in d.runs())
    if task.status in TASK_TERMINAL or task.cancel_requested or \
            c.request_id in (task.questions or {}):
        return {"taskId": task.id, "notified": False}
    if c.blocking and task.completion_wake == "settled_only" and live:
        # The parent is blocked in a wait on this task: the wait reports the question. Held
        # until then; if the wait is cut short, the launching run's end catches up.
        d.put(replace(task, updated_at=d.now, questions={**(task.questions or {}), c.request_id: {
            "state": "held", "question": c.question, "childThreadId": c.child_thread_id}}))
        return {"taskId": task.id, "notified": False}
    _notify_parent(d, _question_message_id(c.request_id), providers,
                   _question_notice(task, c.request_id, c.child_thread_id, c.question, c.blocking))
    return {"taskId": task.id, "notified": True}


def _question_notice(task: Subagent, request_id: str, child_id: str, question: str,
                     blocking: bool) -> str:
    state = "is blocked on a question" if blocking else "asked a question and is still working"
    return (f'Delegated task "{task.title}" {state}: {question}\nAnswer it with '
            f"t3_pending_request (threadId {child_id}, requestId {request_id}), or ask the user.")


@decides(SettleTaskQuestion)
def _decide_settle_question(d: Draft, c: SettleTaskQuestion, **_: Any) -> Mapping[str, Any]:
    task = _task(d, c.task_id)
    if (task.questions or {}).get(c.request_id) != {"state": "settled"}:
        d.put(replace(task, updated_at=d.now, questions={
            **(task.questions or {}), c.request_id: {"state": "settled"}}))
    for run in d.runs():
        if run.user_message_id == _question_message_id(c.request_id) and \
                run.status == RunStatus.QUEUED:
            _cancel_queued(d, run)
    return {"taskId": task.id, "requestId": c.request_id}


def _question_closed(d: Draft, request: RuntimeRequest) -> None:
    """A delegated child's question was answered, dismissed or expired: its parent's notice
    is withdrawn (through the outbox)."""
    task = _parent_task(d)
    if request.kind_ == "user_input" and task is not None:
        d.effect("subagent.question-settled", {**task, "requestId": request.id}, request.id,
                 thread_id=task["parentThreadId"])


def _catch_up_questions(d: Draft, run: Run) -> None:
    """A wait cut short never showed the parent's agent a held question: when the launching run
    completes, fails or waits for post-turn work, a still-pending one wakes the parent. A
    stopped or interrupted run drops the catch-up."""
    for task in d.all("subagent"):
        held = {k: v for k, v in (task.questions or {}).items() if v.get("state") == "held"}
        if task.run_id != run.id or not held:
            continue
        d.put(replace(task, updated_at=d.now, questions={
            **task.questions, **{k: {"state": "settled"} for k in held}}))
        if run.status in (RunStatus.WAITING, RunStatus.COMPLETED, RunStatus.FAILED) and \
                task.status not in TASK_TERMINAL and not task.cancel_requested:
            for request_id, q in held.items():
                _notify_parent(d, _question_message_id(request_id), {}, _question_notice(
                    task, request_id, q["childThreadId"], q["question"], True))


# Known work of a delegated task (what task_status reports on): its child's original run and
# the completion follow-ups t3 started there (task wakes, question notices); the rest is later.
_FOLLOW_UP_MESSAGES = ("message:task-wake:", "message:task-question:")


def task_work(runs: Sequence[Run]) -> list[Run]:
    return [r for r in runs if r.ordinal == 1 or r.user_message_id.startswith(_FOLLOW_UP_MESSAGES)]


def ran(run: Run) -> bool:
    """A terminal run that ran (a queued run cancelled before it started did not)."""
    return run.status in RUN_TERMINAL and (run.started_at is not None
                                           or run.status != RunStatus.CANCELLED)


def task_final_run(runs: Sequence[Run]) -> Run | None:
    """The run whose result a delegated task publishes: the last work run that ran, once none
    is active and a completed one has no follow-up queued (one a Stop holds does not count: it
    runs after Resume as later work). None while the work goes on."""
    work = task_work(runs)
    if any(r.status in RUN_BLOCKING or r.awaiting_agent_slot for r in work):
        return None
    done = [r for r in work if ran(r)]
    if not done or (done[-1].status == RunStatus.COMPLETED and
                    any(r.status == RunStatus.QUEUED and not r.queue_held for r in work)):
        return None
    return done[-1]


def later_transfer_id(task_id: str, run_id: str) -> str:
    """The context transfer of a later child run's result (task_status latestTerminal*)."""
    return bounded_id(f"context-transfer:subagent_result:{task_id}:{run_id}")


def blocking_question(request: RuntimeRequest) -> bool:
    """A question the child waits on (codex ``isBlocking: false`` asks without waiting)."""
    return request.kind_ == "user_input" and (request.detail or {}).get("isBlocking") is not False


def task_attention(child: ThreadState, task: Subagent
                   ) -> tuple[RuntimeRequest | None, RuntimeRequest | None]:
    """What a wait on a task ends for: a pending blocking question in its child thread, and a
    pending live approval of the task's own unfinished work. Async questions end nothing."""
    work = set() if task.status in TASK_TERMINAL else {r.id for r in task_work(child.runs)}
    pending = child.pending_requests()
    return (next((r for r in pending if blocking_question(r)), None),
            next((r for r in pending if r.kind_ != "user_input" and r.run_id in work
                  and r.response_capability.get("type") == "live"), None))


def _finalize_if_settled(d: Draft, ended: Run | None = None) -> None:
    """A delegated child reports to its parent through the outbox (a crash cannot lose it): its
    task's result once the task's known work and the child's own tasks have all finished, and
    the result of a later run that ran (``ended``, not the task's work)."""
    task = _parent_task(d)
    if task is None:
        return
    runs = d.runs()
    work = {r.id for r in task_work(runs)}
    final = task_final_run(runs)
    if final is not None and all(t.status in TASK_TERMINAL for t in d.all("subagent")) and (
            ended is None or ended.id in work):
        d.effect("subagent.finalize", {**task, "runId": final.id, "publish": True}, final.id,
                 thread_id=task["parentThreadId"])
    if ended is not None and ended.id not in work and ran(ended):
        d.effect("subagent.finalize", {**task, "runId": ended.id, "publish": False}, ended.id,
                 thread_id=task["parentThreadId"])


# =============================================================================================
# A thread's lifecycle: archive, delete, snooze, visit (its title and pull request link are
# metadata.py's). Only archive and delete touch runs (cancel queued ones, refuse while one is
# active); both end a title regeneration in flight.


THREAD_LIFECYCLE = ("thread.archive", "thread.unarchive", "thread.delete", "thread.snooze",
                    "thread.unsnooze", "thread.visit")


@dataclass(frozen=True, slots=True)
class ChangeThreadLifecycle(Command):
    """One of THREAD_LIFECYCLE; ``at`` is thread.snooze's snoozedUntil or thread.visit's
    visitedAt (t3's own time form, ``parse_time``)."""

    type: str
    at: str | None = None

    def __post_init__(self) -> None:
        if self.type not in THREAD_LIFECYCLE:
            raise ValueError(f"unknown thread command {self.type!r}")
        if self.type in ("thread.snooze", "thread.visit") and not self.at:
            raise ValueError(f"{self.type} needs a time")


def parse_time(value: str) -> str:
    """An ISO 8601 time (naive: UTC) or epoch seconds/milliseconds as t3 writes times."""
    epoch = parse_timestamp(value)
    if epoch is None:
        raise ValueError(f"not a time: {value!r}")
    return iso_time(epoch)


@decides(ChangeThreadLifecycle, client=THREAD_LIFECYCLE)
def _decide_lifecycle(d: Draft, c: ChangeThreadLifecycle, **_: Any) -> Mapping[str, Any]:
    thread = d.thread
    assert thread is not None
    verb = c.type.removeprefix("thread.")
    if verb == "visit":  # the latest visit counts; a visit is not activity
        if thread.last_visited_at is None or c.at > thread.last_visited_at:  # type: ignore
            thread = d.put(replace(thread, last_visited_at=c.at), "thread.visited")
        return {"threadId": thread.id, "lastVisitedAt": thread.last_visited_at}
    if (thread.archived_at is None) == (verb == "unarchive") and verb != "delete":
        raise CommandRejected(f"thread {thread.id} is {'' if thread.archived_at else 'not '}"
                              "archived", code="invalid_request")
    if verb == "snooze" and c.at <= d.now:  # type: ignore[operator]
        raise CommandRejected("snoozedUntil: must be in the future", code="invalid_request")
    if verb == "snooze" and (d.state.pending_requests() or d.state.queued_runs()):
        raise CommandRejected(f"thread {thread.id} has a pending request or a queued run",
                              code="invalid_request")
    active = next((r for r in d.runs() if r.status in RUN_BLOCKING), None)
    if verb == "archive" and active is not None:
        raise CommandRejected(f"run {active.id} is {active.status}: interrupt it first",
                              code="invalid_request")
    changed: dict[str, Any] = {
        "archive": {"archived_at": d.now, "title_regeneration": None},
        "unarchive": {"archived_at": None},
        "delete": {"deleted_at": d.now, "title_regeneration": None},
        "snooze": {"snoozed_until": c.at, "snoozed_at": d.now},
        "unsnooze": {"snoozed_until": None, "snoozed_at": None}}[verb]
    thread = d.put(replace(thread, **changed, updated_at=d.now), f"thread.{verb}d")
    if verb == "archive":  # after the change, so that none of them is promoted
        for run in d.runs():
            if run.status == RunStatus.QUEUED:
                _cancel_queued(d, run)
    if verb == "delete":
        _end_owned(d, DELETED)
        for hooks in RUN_HOOKS:
            hooks.deleted(d)
    return {"threadId": thread.id, "archived": thread.archived_at is not None,
            "deleted": thread.deleted_at is not None, "snoozedUntil": thread.snoozed_until}


DELETED = "The thread was deleted."


def _end_owned(d: Draft, reason: str) -> None:
    """A deleted thread leaves nothing going: its open delegated tasks, runs (queued ones
    first, so that the last run's end publishes a delegated child's result; if none of them
    ran, the deletion does), work of its own (``thread_work``), requests and sessions end; its
    agent process is stopped and no start of it goes on."""
    for task in d.all("subagent"):
        if task.status not in TASK_TERMINAL:  # its child thread lives on, reporting to no one
            d.put(replace(task, status="cancelled", cancel_requested=True, result=reason,
                          completed_at=d.now, updated_at=d.now))
            d.update("node", task.id, status="cancelled", completed_at=d.now)
            d.update("turn-item", _task_item_id(task.id), status="cancelled", updated_at=d.now,
                     completed_at=d.now)
    for run in d.runs():
        if run.status == RunStatus.QUEUED:
            _cancel_queued(d, run)
    for run in d.runs():
        if run.status not in RUN_TERMINAL:
            _end_run(d, run, RunStatus.CANCELLED, reason)
    task = _parent_task(d)
    if task is not None and d.runs() and task_final_run(d.runs()) is None:  # none of it ran
        first = d.runs()[0]
        d.effect("subagent.finalize", {**task, "runId": first.id, "publish": True}, first.id,
                 thread_id=task["parentThreadId"])
    if (work := thread_work(d)) is not None:  # its effect then does nothing
        d.put(replace(work, status="cancelled", text=reason, updated_at=d.now, completed_at=d.now))
    _end_sessions(d, reason)
    d.cancel_effect_types += _START_EFFECTS
    d.effect("provider-session.stop", {"reason": reason}, "deleted")


def thread_title(title: str | None, prompt: str | None, fallback: str) -> str:
    """``title``, else the prompt's first 80 characters on one line (a made title holds no
    control character either), else ``fallback``."""
    if title:
        return title
    if prompt:
        line = " ".join("".join(c for c in prompt if ord(c) not in CONTROL_CHARACTERS
                                or c.isspace()).split())
        return line if len(line) <= 80 else line[:77] + "..."
    return fallback


# =============================================================================================
# Workspace preparation. A launch into a new worktree starts its first run ``preparing``; the
# rest is workspace.py's, which t3.py loads. In decide: BEGIN_PREPARATION gives such a run (a
# CreateThread's or RunHooks.preparation's) its item and ``workspace.prepare`` effect, which makes
# the worktree and runs (or asks about) the setup commands, then releases or fails the run
# (``run.prepare``); SETUP_ANSWERED takes an answer to t3's own question of a run (its request's
# capability ``setup``), declined or not.

BEGIN_PREPARATION: list[Callable[[Draft, Run, Mapping[str, Any]], None]] = []
SETUP_ANSWERED: list[Callable[[Draft, RespondRuntimeRequest, RuntimeRequest, bool], None]] = []


class Workspaces(Protocol):
    """What launches ask of git (workspace.py, never imported here): tools.py checks a launch's
    strategy with these before anything is made; history.py and the preparation ask more."""

    worktrees_dir: Path

    async def top_level(self, cwd: str) -> str | None: ...
    async def worktree_branch(self, repo: str, path: str) -> str | None: ...
    async def worktree_problem(self, repo: str, *, base_ref: str, branch: str,
                               from_origin: bool) -> str | None: ...


# =============================================================================================
# Provider switch. ``provider.switch`` changes the instance (and model) a thread's next runs go
# to. A run on a provider thread that missed earlier runs (never took part, or could not resume)
# carries a context handoff (history.py's, through RUN_HOOKS), put before the user's text.


@dataclass(frozen=True, slots=True)
class SwitchProvider(Command):
    type: ClassVar[str] = "provider.switch"
    # The runtime mode is derived from the thread's when the call arrives (as DispatchMessage's
    # mode): a retry after it changed is still the same request.
    fingerprint_fields: ClassVar[tuple[str, ...]] = ("thread_id", "provider_instance_id", "model")
    provider_instance_id: str
    model: str | None
    runtime_mode: str  # the thread's, stepped down to what the new provider offers


@decides(SwitchProvider, client=True)
def _decide_switch(d: Draft, c: SwitchProvider, *, providers: Mapping[str, ProviderInfo],
                   **_: Any) -> Mapping[str, Any]:
    thread = sendable(d)
    _registered(providers, c.provider_instance_id)
    before = thread.provider_instance_id, thread.model_selection.get("model")
    if (c.provider_instance_id, c.model, c.runtime_mode) != (*before, thread.runtime_mode):
        d.put(replace(thread, provider_instance_id=c.provider_instance_id,
                      model_selection={"instanceId": c.provider_instance_id, "model": c.model},
                      runtime_mode=c.runtime_mode, updated_at=d.now), "thread.provider-switched")
    return {"threadId": thread.id, "providerInstanceId": c.provider_instance_id,
            "model": c.model, "runtimeMode": c.runtime_mode,
            "previous": {"providerInstanceId": before[0], "model": before[1]}}


# =============================================================================================
# The runtime: dispatch, the state cache, waits, subscriptions, recovery, the effect worker


def utc_now() -> str:
    return iso_time(time.time())


def random_id(prefix: str) -> str:
    return f"{prefix}:{uuid.uuid4()}"


@dataclass(frozen=True, slots=True)
class DispatchResult:
    sequence: int
    result: Mapping[str, Any]
    replayed: bool = False


class PermanentEffectError(T3Error):
    """The effect cannot succeed by retrying."""


@dataclass(eq=False, slots=True)
class _LiveSession:
    """A provider process bound to one app thread, and the turn it is serving now."""

    session_id: str
    thread_id: str
    instance_id: str
    model: str | None
    handle: ProviderSessionHandle
    turn: tuple[str, str] | None = None  # (run_id, attempt_id)
    turn_ended: asyncio.Event = field(default_factory=asyncio.Event)
    interrupting: set[str] = field(default_factory=set)  # attempt ids with an interrupt sent
    closing_reason: str | None = None
    pump_done: asyncio.Event = field(default_factory=asyncio.Event)
    idle_timer: asyncio.TimerHandle | None = None
    last_used: float = 0.0  # monotonic time of its last turn's end: idle ones go LRU first


class Part(Protocol):
    """A feature's runtime that the orchestrator drives (schedules.py's scheduler): it is shown
    each committed entity of the kinds it ``watches``, and ``run`` is its background loop."""

    watches: frozenset[str]

    def committed(self, entity: Any) -> None: ...
    async def run(self) -> None: ...


_P = TypeVar("_P")


class Orchestrator:
    """Serializes commands per thread, keeps the thread states they are decided on, wakes waits
    and subscriptions, and runs the effect worker. ``sessions`` holds the provider processes and
    agent process slots; features attach their own runtime (``attach``). Start with ``start()``
    inside the running loop."""

    MAX_CONCURRENT_EFFECTS = 16
    # Ingest commits queued at the single writer at once, over all sessions: every other command
    # (a run's completion, a delegation, a user's send) waits behind at most these, not behind one
    # commit per streaming session. A session waiting for a slot leaves its deltas queued, and
    # they all go into the commit it then makes: the writer stays busy, the batches grow.
    MAX_INGEST_COMMITS = 2
    # Text deltas wait at most this long for company (any other event ends the wait): a commit
    # writes a dozen pages whatever it carries. A kill -9 loses this window and a commit in flight.
    INGEST_WINDOW_S = 0.2
    MAX_CACHED_THREADS = 512

    def __init__(self, store: _store.Store, *, adapters: Mapping[str, ProviderAdapter],
                 providers: Mapping[str, ProviderInfo], clock: Callable[[], str] = utc_now,
                 new_id: Callable[[str], str] = random_id, lease_ms: int = 30_000,
                 backoff_base_ms: int = 100, credentials: SessionCredentials | None = None,
                 max_live_agent_processes: int = 16, max_delegation_depth: int = 5,
                 workspaces: Workspaces | None = None) -> None:
        self._store = store
        self.workspaces = workspaces  # git as an effect (workspace.py, handed in by t3.py)
        self.adapters = dict(adapters)
        self.providers = providers  # read live: an instance may become available later
        self._clock, self.new_id = clock, new_id
        self._lease_ms, self._backoff_base_ms = lease_ms, backoff_base_ms
        self.worker_id = f"t3:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # cluster.py: the node's
        self.shared = False  # other processes commit to the database too (cluster.py)
        self._states: collections.OrderedDict[str, ThreadState] = collections.OrderedDict()
        self._held: dict[str, ThreadState] = {}  # evicted while in use (_evict)
        self._locks: dict[str, asyncio.Lock] = {}
        self._signals: dict[str, asyncio.Event] = {}
        self._subscriptions: set[Any] = set()
        self._effect_tasks: dict[str, asyncio.Task[None]] = {}
        self._effect_wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False
        self.sessions = _Sessions(self, credentials=credentials, max_live=max_live_agent_processes,
                                  max_loans=max_live_agent_processes * max_delegation_depth)
        self.lending = self.sessions.lending  # (what tools.py's waits call)
        self._parts: list[Part] = []
        self._watchers: dict[str, list[Part]] = {}

    def attach(self, part: Part) -> None:
        """A feature's runtime (t3.py attaches schedules.py's scheduler before ``start``)."""
        self._parts.append(part)
        for kind in part.watches:
            self._watchers.setdefault(kind, []).append(part)

    def part(self, cls: type[_P]) -> _P:
        """The attached part of this class (LookupError: none is)."""
        found = next((p for p in self._parts if isinstance(p, cls)), None)
        if found is None:
            raise LookupError(f"no {cls.__name__} is attached")
        return found

    # -- commands, the state cache, waits and subscriptions ---------------------------------------

    async def probe_providers(self) -> None:
        """Let every adapter that can ask its CLI for models and login state do so; each one
        bounds and caches its own probe (providers.py), so this is cheap after the first."""
        await asyncio.gather(*(a.probe() for a in self.adapters.values() if hasattr(a, "probe")))

    def now(self) -> str:
        """The orchestrator's clock (a test clock moves it)."""
        return self._clock()

    async def dispatch(self, command: Command) -> DispatchResult:
        """Decide and commit one command; a command id seen before returns its first result (the
        commit finds its receipt; read here only if decide refuses it or changes nothing)."""
        async with self._locks.setdefault(command.thread_id, asyncio.Lock()):
            while True:  # shared: decided again when another process moved the thread on
                with contextlib.suppress(_store.StaleState):
                    return await self._dispatch(command)
                self.forget(command.thread_id)

    async def _dispatch(self, command: Command) -> DispatchResult:  # under the thread's lock
        state = await self.state(command.thread_id) or ThreadState()
        try:
            decision = decide(state, command, now=self._clock(), new_id=self.new_id,
                              providers=self.providers)
        except Exception:
            if (receipt := self._store.receipt(command.command_id)) is None:
                raise
            return self._replay(command, receipt)
        if not decision.events and not decision.effects:
            receipt = self._store.receipt(command.command_id)
            return self._replay(command, receipt) if receipt else \
                DispatchResult(state.sequence, decision.result)
        _store.crash_point(f"before-commit:{command.type}")
        try:
            outcome = await self._store.commit(decision.commit(
                command, (command.thread_id, state.sequence) if self.shared else None))
        except _store.FingerprintMismatch:
            return self._replay(command, None)
        if not outcome.committed:
            return self._replay(command, outcome.receipt)
        _store.crash_point(f"after-commit:{command.type}")
        self._apply(decision.events, outcome.sequences, decision.entities, command.thread_id)
        if self._subscriptions and not self.shared:  # shared: absorb publishes, in order
            self._publish(command.command_id, decision.events, outcome)
        for task in filter(None, map(self._effect_tasks.get, outcome.cancelled_effect_ids)):
            task.cancel()
        if decision.effects:
            self._effect_wake.set()
        return DispatchResult(outcome.receipt.result_sequence, decision.result)

    def _replay(self, command: Command, receipt: _store.Receipt | None) -> DispatchResult:
        """The first result of a command id seen before (None: its receipt is another's)."""
        if receipt is None or receipt.fingerprint != fingerprint_of(command):
            raise T3Error(f"the request id behind command {command.command_id!r} was already "
                          "used for a different request", code="invalid_request")
        return DispatchResult(receipt.result_sequence, receipt.result, replayed=True)

    async def try_dispatch(self, command: Command, note: str = "") -> bool:
        """Dispatch where the state may have moved on meanwhile: a CommandRejected is only
        logged (under ``note``); False then."""
        try:
            await self.dispatch(command)
        except CommandRejected as exc:
            if note:
                log.info("%s: %s", note, exc)
            return False
        return True

    def _apply(self, events: Sequence[_store.NewEvent], sequences: Sequence[int],
               entities: Sequence[Any], decided_on: str | None = None) -> None:
        """Committed events into the cached states; ``entities`` are what decide made of them,
        put as they are (None: absorbed, rebuilt from the payload). A state loaded after an event
        skips it. Shared, one the commit was not decided on may miss others' events: dropped."""
        touched: set[str] = set()
        for event, sequence, entity in zip(events, sequences, entities, strict=True):
            kind, own = _store.event_kind(event.type), entity is not None
            state = self._cached(event.thread_id)
            if state is None and own and entity.opens_stream:  # a new thread or task
                state = self._states[event.thread_id] = ThreadState()
            elif state is not None and (sequence <= state.sequence or self.shared and own
                                        and event.thread_id != decided_on):
                state = None if sequence <= state.sequence else self.forget(event.thread_id)
            if not own:
                entity = state.apply(event.type, event.payload) if state is not None else \
                    _ENTITY_TYPES[kind].from_json(event.payload) if kind in _ENTITY_TYPES else None
            elif state is not None:
                state.put(entity)
            if state is not None:
                state.sequence = sequence
            touched.add(event.thread_id)
            if entity is None or own and self.shared:  # shared: absorb shows the parts, once
                continue
            if kind == "run" and entity.status in RUN_TERMINAL:
                self.sessions.run_ended(entity.id)
            for part in self._watchers.get(kind, ()):
                part.committed(entity)
        for thread_id in touched:
            self._notify(thread_id)
        self._evict()

    def absorb(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Shared (cluster.py): every process's commits (rows of ``events``, in order), applied
        and published as ``dispatch`` does its own; a payload decoded only where it is needed."""
        def needed(row: Mapping[str, Any]) -> bool:  # by a cached state, the parts, a run's end
            kind = _store.event_kind(row["type"])
            state = self._states.get(row["thread_id"]) or self._held.get(row["thread_id"])
            return kind == "run" or kind in self._watchers or (
                state is not None and row["sequence"] > state.sequence)
        decoded = [r for r in rows if needed(r)]
        self._apply([_store.NewEvent(r["event_id"], r["thread_id"], r["type"], r["occurred_at"],
                                     json.loads(r["payload_json"])) for r in decoded],
                    [r["sequence"] for r in decoded], [None] * len(decoded))
        for thread_id in {r["thread_id"] for r in rows}:
            self._notify(thread_id)
        self._offer(rows)
        if not rows or any(_store.event_kind(r["type"]) == "run" for r in decoded):
            self._effect_wake.set()  # outbox rows changed (t3_effects), or a run ended: a slot

    def forget(self, thread_id: str) -> None:  # loaded again from the store on its next use
        self._states.pop(thread_id, None), self._held.pop(thread_id, None)

    def subscribe(self, subscriber: Any) -> None:
        """``subscriber.offer(sequence, thread id, JSON)`` each event of its ``thread_id`` (None:
        every thread's) committed from now on, in commit order (tools.py's Subscription)."""
        self._subscriptions.add(subscriber)

    def unsubscribe(self, subscriber: Any) -> None:
        self._subscriptions.discard(subscriber)

    def _publish(self, command_id: str, events: Sequence[_store.NewEvent],
                 outcome: _store.CommitResult) -> None:
        """Committed events to subscribers as stored rows, in commit order (``_apply``'s)."""
        self._offer([{"sequence": q, "event_id": e.event_id, "thread_id": e.thread_id,
                      "stream_version": v, "command_id": command_id, "type": e.type,
                      "occurred_at": e.occurred_at, "payload_json": j} for e, q, v, j in zip(
            events, outcome.sequences, outcome.stream_versions, outcome.payloads_json)])

    def _offer(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:  # each event's JSON built once, if a subscriber wants it
            wanted = [s for s in self._subscriptions if s.thread_id in (None, row["thread_id"])]
            text = _store.event_json(row) if wanted else ""
            for subscription in wanted:
                subscription.offer(row["sequence"], row["thread_id"], text)

    async def state(self, thread_id: str) -> ThreadState | None:
        """The thread's current state (cached; loaded from the store on first use)."""
        state = self._cached(thread_id)
        if state is None:
            sequence, rows = self._store.thread_entities(thread_id)
            if not any(rows.get(k) for k, cls in _ENTITY_TYPES.items() if cls.opens_stream):
                return None
            state = self._states[thread_id] = ThreadState.load(sequence, rows)
            self._evict()
        return state

    def _cached(self, thread_id: str) -> ThreadState | None:
        """The thread's cached state, now the most recently used."""
        state = self._held.pop(thread_id, None) or self._states.pop(thread_id, None)
        if state is not None:
            self._states[thread_id] = state
        return state

    def _evict(self) -> None:
        """Keep the cache bounded, O(1) per load: the least recently used threads at rest go, one
        in use (a command or session on it, a run active or queued) waits in _held until used
        again (every commit uses it); each pass also looks at the oldest held one again."""
        while len(self._states) > self.MAX_CACHED_THREADS:
            evicted = [self._states.popitem(last=False)]
            if self._held:
                evicted.append((held := next(iter(self._held)), self._held.pop(held)))
            for thread_id, state in evicted:
                lock = self._locks.get(thread_id)
                if (lock is not None and lock.locked()) or thread_id in self.sessions.live \
                        or state.blocking_run() is not None or state.queued_runs():
                    self._held[thread_id] = state
                else:
                    self._locks.pop(thread_id, None)

    def _notify(self, thread_id: str) -> None:
        if (signal := self._signals.pop(thread_id, None)) is not None:
            signal.set()

    async def wait_until(self, thread_ids: Sequence[str],
                         done: Callable[[Mapping[str, ThreadState]], bool],
                         timeout_s: float) -> bool:
        """Wait for ``done(states)``, woken by commits to any of the threads; False on timeout or
        shutdown, thread_not_found once one is deleted. No polling: each check follows a commit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            signals = [self._signals.setdefault(t, asyncio.Event()) for t in thread_ids]
            states = {t: state for t in thread_ids if (state := await self.state(t)) is not None}
            if gone := [t for t, s in states.items() if s.thread and s.thread.deleted_at]:
                raise T3Error(f"thread {gone[0]} was not found", code="thread_not_found")
            if done(states):
                return True
            if (remaining := deadline - loop.time()) <= 0 or self.stopping:
                return False
            waiters = [loop.create_task(s.wait()) for s in signals]
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    # -- lifecycle and recovery -------------------------------------------------------------------

    def start(self) -> None:
        self.spawn(self._effect_loop(), "effect-worker")
        for part in self._parts:
            self.spawn(part.run(), type(part).__name__)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def begin_shutdown(self) -> None:
        """Stop taking new effects and end every wait with the state it has now."""
        self.stopping = True
        for thread_id in list(self._signals):
            self._notify(thread_id)
        self._effect_wake.set()

    async def close(self, *, grace_s: float = 3.0) -> None:
        """Shut down: provider processes get ``grace_s`` then their groups are killed."""
        self.begin_shutdown()
        for task in list(self._effect_tasks.values()):
            task.cancel()
        reason = "The t3 server shut down while this run was active."
        await self.sessions.close_all(reason, grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if released := await self._store.release_leases(owner=self.worker_id, reason=reason,
                                                        now_ms=_ms()):
            log.info("released %d outbox lease(s)", released)

    async def recover(self, *, reason: str, of: Any = None) -> list[str]:
        """After a restart: settle what the old process (``of``: a node's, cluster.py) left."""
        of = of or self._store
        cancelled, requeued = await of.recover_outbox(
            reason="Cancelled: the server process ended before this effect completed.",
            now_ms=_ms())
        if cancelled or requeued:
            log.info("outbox recovery: %d cancelled, %d requeued", len(cancelled), requeued)
        recovered = []
        stamp = self._clock()
        for thread_id in of.threads_needing_recovery():
            try:
                if await self._recover_thread(thread_id, reason, stamp):
                    recovered.append(thread_id)
            except Exception as exc:  # one thread's state never stops startup
                log.error("recovery of thread %s failed: %s", thread_id, exc, exc_info=exc)
                await self._fail_runs(thread_id, stamp,
                                      f"Recovery after a server restart failed: {exc}"[:2000])
        self.sessions.line_up(of.runs_awaiting_slot())  # the line was in memory
        return recovered

    async def _recover_thread(self, thread_id: str, reason: str, stamp: str) -> bool:
        # A start may run again when no agent can have had its prompt: never claimed, or
        # claimed but its run still ``starting`` (the prompt goes out only after MarkRunStarted).
        state = await self.state(thread_id)
        starting = {r.id for r in state.runs if r.status == RunStatus.STARTING} if state else set()
        pending_starts = {e.payload.get("runId") for e in self._store.pending_effects(thread_id)
                          if (e.effect_type == "provider-turn.start"
                              and (e.attempt_count == 0 or e.payload.get("runId") in starting))
                          or e.effect_type == "workspace.prepare"}
        result = await self.dispatch(RecoverThread(
            command_id=bounded_id(f"recover:{thread_id}:{stamp}"), thread_id=thread_id,
            reason=reason, resumable_run_ids=frozenset(r for r in pending_starts if r)))
        return bool(result.result.get("interruptedRunIds"))

    async def _fail_runs(self, thread_id: str, stamp: str, reason: str) -> None:
        """A thread whose recovery failed: its active runs fail, saying why, where they can."""
        try:
            state = await self.state(thread_id)
            for run in state.runs if state is not None and state.thread is not None else ():
                if run.status in RUN_BLOCKING:
                    await self.try_dispatch(FailRun(
                        command_id=bounded_id(f"command:recovery-failed:{run.id}:{stamp}"),
                        thread_id=thread_id, run_id=run.id, attempt_id=None,
                        status=RunStatus.FAILED, reason=reason), f"run {run.id}")
        except Exception as exc:
            log.error("could not record the failed recovery on thread %s: %s", thread_id, exc)

    # -- the effect worker: claims outbox rows under a lease and runs them (EFFECTS) --------------

    async def _effect_loop(self) -> None:
        while not self.stopping:
            self._effect_wake.clear()
            while len(self._effect_tasks) < self.MAX_CONCURRENT_EFFECTS and not self.stopping:
                row = await self._store.claim_effect(owner=self.worker_id, now_ms=_ms(),
                                                     lease_ms=self._lease_ms)
                if row is None:
                    break
                self._effect_tasks[row.effect_id] = self.spawn(self._run_effect(row),
                                                               f"effect {row.effect_type}")
            # at the limit, an effect's end wakes it
            due = None if len(self._effect_tasks) >= self.MAX_CONCURRENT_EFFECTS \
                else self._store.next_effect_due_ms(self.worker_id)
            timeout = None if due is None else max(0.001, (due - _ms()) / 1000)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._effect_wake.wait(), timeout)

    async def _run_effect(self, row: _store.EffectRow) -> None:
        renewer = self.spawn(self._renew_lease(row, asyncio.current_task()), "lease")
        try:  # shared: the effect may be claimed before its commit reached this process's cache
            if self.shared and (seen := self._cached(row.thread_id)) is not None and \
                    self._store.moved_on(row.thread_id, seen.sequence):
                async with self._locks.setdefault(row.thread_id, asyncio.Lock()):
                    self.forget(row.thread_id)
            if row.attempt_count > row.max_attempts:  # reclaimed after its last lease expired
                raise PermanentEffectError("no attempts left after the last lease expired")
            kind = EFFECTS.get(row.effect_type)
            if kind is None:
                raise PermanentEffectError(f"unknown effect type {row.effect_type!r}")
            await kind.run(self, row)
        except asyncio.CancelledError:
            # Cancelled by a command (its row is already 'cancelled'), by losing the lease, or by
            # shutdown (close() releases the lease). Nothing to settle here.
            raise
        except Exception as exc:  # any failure of the outside world is retried, then recorded
            await self._effect_failed(row, exc)
        else:
            await self._store.settle_effect(row, owner=self.worker_id, status="succeeded")
        finally:
            renewer.cancel()
            self._effect_tasks.pop(row.effect_id, None)
            self._effect_wake.set()

    async def _renew_lease(self, row: _store.EffectRow, task: asyncio.Task[Any] | None) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            held = await self._store.renew_lease(row, owner=self.worker_id,
                                                 until_ms=_ms() + self._lease_ms)
            if not held and task is not None:
                log.warning("lost the lease on %s; stopping it", row.effect_id)
                task.cancel()
                return

    async def _effect_failed(self, row: _store.EffectRow, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, T3Error) else str(exc)
        last = row.attempt_count >= row.max_attempts or isinstance(exc, PermanentEffectError)
        log.warning("effect %s attempt %d failed: %s", row.effect_id, row.attempt_count, message)
        if not last:
            delay = min(30_000, self._backoff_base_ms * 2 ** (row.attempt_count - 1))
            await self._store.settle_effect(row, owner=self.worker_id, status="pending",
                                            error=message, retry_at_ms=_ms() + delay)
            return
        if not await self._store.settle_effect(row, owner=self.worker_id, status="failed",
                                               error=message):
            return
        run_id = row.payload.get("runId")
        if run_id and (kind := EFFECTS.get(row.effect_type)) is not None and kind.fails_run:
            await self.try_dispatch(FailRun(
                command_id=bounded_id(f"command:effect-failed:{row.effect_id}"),
                thread_id=row.thread_id, run_id=run_id, attempt_id=None, status=RunStatus.FAILED,
                reason=f"{row.effect_type} failed after {row.attempt_count} attempt(s): "
                       f"{message}"))


# =============================================================================================
# Provider sessions and agent process slots


class _Sessions:
    """The live provider processes (at most one per thread), each with the pump that turns its
    events into ingest commands, and the agent process slots that bound how many run at once
    (``max_live_agent_processes``)."""

    INTERRUPT_GRACE_S = 10.0
    IDLE_RELEASE_S = 30 * 60.0  # a provider process with no turn for this long is stopped

    def __init__(self, orch: Orchestrator, *, credentials: SessionCredentials | None,
                 max_live: int, max_loans: int) -> None:
        self.orch = orch
        self._credentials = credentials
        self.live: dict[str, _LiveSession] = {}  # thread id -> its session
        self._ingest_slots = asyncio.Semaphore(Orchestrator.MAX_INGEST_COMMITS)
        # Live sessions + sessions opening + slots granted to a run whose start has not run yet
        # never exceed _max_live, but for runs on a slot lent by an agent blocked in a wait
        # (_waits, _loans); runs without one wait in _line (FIFO).
        self._max_live, self._max_loans = max_live, max_loans
        self._opening: set[str] = set()  # run ids
        self._reserved: dict[str, str] = {}  # run id -> thread id
        self._line: list[tuple[str, str, str]] = []  # (thread id, run id, attempt id)
        self._waits: list[tuple[str, str, str]] = []  # (thread id, session id, awaited thread)
        self._loans: dict[str, str] = {}  # run id -> session id of the agent that lent a slot

    def run_ended(self, run_id: str) -> None:
        """A run ended before its start ran: the slot granted to it goes to the next in line."""
        if self._reserved.pop(run_id, None) is not None:
            asyncio.get_running_loop().call_soon(self.rebalance)

    async def end(self, live: _LiveSession, reason: str, *, grace: float = 3.0) -> None:
        """Close ``live`` saying why; return once its pump has recorded the end."""
        live.closing_reason = reason
        await live.handle.close(grace=grace)
        await live.pump_done.wait()

    async def stop(self, thread_id: str, reason: str, *, revoke: bool = False) -> None:
        """End the thread's session, if it has one; ``revoke``: its agent calls nothing more."""
        if (live := self.live.get(thread_id)) is not None:
            if revoke and self._credentials:
                self._credentials.revoke(live.session_id)
            await self.end(live, reason)

    async def close_all(self, reason: str, grace_s: float) -> None:
        for live in list(self.live.values()):
            live.closing_reason = reason
        await asyncio.gather(*(live.handle.close(grace=grace_s) for live in self.live.values()),
                             return_exceptions=True)
        await asyncio.gather(*(live.pump_done.wait() for live in list(self.live.values())))

    async def start_attempt(self, thread_id: str, run_id: str, attempt_id: str) -> None:
        state = await self.orch.state(thread_id)
        run = state.run(run_id) if state else None
        if state is None or run is None or run.status != RunStatus.STARTING \
                or run.active_attempt_id != attempt_id:
            self._started(run_id)
            return  # replayed or overtaken: nothing to start
        try:
            opened = await self._ensure_session(state, run)
        except BaseException:
            self._started(run_id)
            raise
        if opened is None:
            await self._wait_in_line(state, run)
            return
        live, created = opened
        message = state.entities["message"].get(run.user_message_id)
        pthread = state.entities["provider-thread"].get(run.provider_thread_id or "")
        resume_ref = pthread.native_thread_ref if pthread else None
        if live.idle_timer is not None:
            live.idle_timer.cancel()
        live.turn = (run_id, attempt_id)  # from here on the session is not idle
        live.turn_ended = asyncio.Event()
        self._started(run_id)
        if self._credentials:
            self._credentials.set_active(live.session_id, True)
        try:
            started = await self.orch.dispatch(MarkRunStarted(
                command_id=bounded_id(f"command:start:{attempt_id}"), thread_id=thread_id,
                run_id=run_id, attempt_id=attempt_id, provider_session_id=live.session_id,
                session_created=created, pid=live.handle.pid,
                native_thread_ref=live.handle.native_thread_ref,
                cwd=state.thread.workspace or os.getcwd() if state.thread else os.getcwd(),
                resume_failed=created and resume_ref is not None
                and live.handle.native_thread_ref != resume_ref,
                native_fork=created and bool(getattr(live.handle, "forked", False))))
        except CommandRejected:
            live.turn = None
            return
        for hooks in RUN_HOOKS:
            await hooks.started(self.orch, state, run)
        state = await self.orch.state(thread_id) or state
        text = message.text if message else ""
        for hooks in RUN_HOOKS:
            text = hooks.prompt(state, started.result.get("handoffIds", ()), text)
        try:
            await live.handle.start_turn(text)
        except Exception as exc:
            live.turn = None
            await self.orch.dispatch(FailRun(
                command_id=bounded_id(f"command:start-failed:{attempt_id}"), thread_id=thread_id,
                run_id=run_id, attempt_id=attempt_id, status=RunStatus.FAILED,
                reason=f"The provider did not accept the turn: {exc}"))

    async def _ensure_session(self, state: ThreadState, run: Run
                              ) -> tuple[_LiveSession, bool] | None:
        """The thread's live session for this run, opening one if needed; None when that needs
        an agent process slot and none is free (the run then waits in line)."""
        thread = state.thread
        assert thread is not None
        if (live := self.live.get(thread.id)) is not None and live.closing_reason is not None:
            await live.pump_done.wait()  # being stopped: a turn there would end with it
            live = None
        adapter = self.orch.adapters.get(run.provider_instance_id)
        if live is not None and live.handle.alive():
            same = (live.instance_id, live.model) == (run.provider_instance_id,
                                                      run.model_selection.get("model"))
            if same and not self._renewal_due(live, adapter):
                return live, False
            live.closing_reason = "Replaced by a session with a new t3 credential." if same \
                else "Replaced by a session of the thread's new provider or model."
        if adapter is None:
            raise PermanentEffectError(f"provider instance {run.provider_instance_id!r} is not "
                                        "configured on this server")
        if live is not None:  # replaced: its slot passes to the new session
            self._opening.add(run.id)
            await live.handle.close()
            await live.pump_done.wait()
        elif not await self._claim_slot(run.id, thread.id):
            return None
        try:
            return await self._open_session(state, run, adapter), True
        finally:
            self._opening.discard(run.id)

    async def _open_session(self, state: ThreadState, run: Run, adapter: ProviderAdapter
                            ) -> _LiveSession:
        thread = state.thread
        assert thread is not None
        pthread = state.entities["provider-thread"].get(run.provider_thread_id or "")
        session_id = self.orch.new_id("provider-session")
        # The credential exists before the process does; it dies with the session.
        mcp = self._credentials.issue(thread_id=thread.id,
                                      provider_instance_id=run.provider_instance_id,
                                      provider_session_id=session_id) \
            if self._credentials and adapter.info.capabilities.supports_mcp else None
        extra: dict[str, Any] = {}
        for hooks in RUN_HOOKS:  # a feature's say in how it opens (a fork's: natively)
            extra.update(await hooks.session(self.orch, state, run, adapter))
        try:
            handle = await adapter.open_session(
                session_id=session_id, thread_id=thread.id, cwd=thread.workspace or os.getcwd(),
                model=run.model_selection.get("model"), runtime_mode=thread.runtime_mode,
                interaction_mode=thread.interaction_mode,
                resume_ref=pthread.native_thread_ref if pthread else None, mcp=mcp, **extra)
        except BaseException:
            if self._credentials:
                self._credentials.revoke(session_id)
            raise
        live = _LiveSession(session_id=session_id, thread_id=thread.id,
                            instance_id=run.provider_instance_id,
                            model=run.model_selection.get("model"), handle=handle,
                            last_used=time.monotonic())
        live.idle_timer = asyncio.get_running_loop().call_later(self.IDLE_RELEASE_S,
                                                                self._release, live)
        self.live[thread.id] = live
        self.orch.spawn(self._pump(live), f"pump {session_id}")
        return live

    def _started(self, run_id: str) -> None:
        """A start is over (or off): a slot granted to it and not used goes to the next run in
        line, as does one a failed start gave back."""
        self._reserved.pop(run_id, None)
        self.rebalance()

    def _slots_used(self) -> int:
        """Agent processes that count against the cap: live, opening and granted ones, but a run
        on a slot lent by an agent still blocked in its wait. A loan lasts for the borrower's
        turn (or until its lender's session ends); ended ones are dropped here first."""
        sessions = {live.session_id for live in self.live.values()}
        turns = {live.turn[0] for live in self.live.values() if live.turn}
        self._loans = {run: s for run, s in self._loans.items() if s in sessions and (
            run in self._reserved or run in self._opening or run in turns)}
        lent = sum(1 for s in self._loans.values() if self._blocked(s))
        return len(self.live) + len(self._opening) + len(self._reserved) - lent

    def _blocked(self, session_id: str) -> bool:
        """That session's agent is blocked in a wait: its turn runs and a tool call waits."""
        return any(w[1] == session_id for w in self._waits) and any(
            live.session_id == session_id and live.turn is not None
            for live in self.live.values())

    @contextlib.contextmanager
    def lending(self, lender: tuple[str, str] | None, thread_id: str) -> Iterator[None]:
        """While an agent (``lender``: its thread and session) is blocked in a wait on a thread's
        work, its slot is lent to that work: the wait never keeps what it waits on in line."""
        if lender is None:
            yield
            return
        entry = (*lender, thread_id)
        self._waits.append(entry)
        self.rebalance()
        try:
            yield
        finally:
            self._waits.remove(entry)
            self.rebalance()

    def _lender_for(self, thread_id: str) -> str | None:
        """The session of an agent blocked in a wait on this thread or one it was delegated from
        (nested work), with no slot lent yet, oldest wait first. A run on a loan may lend in turn
        (a nested wait); at most max_live x max_delegation_depth runs are on loan at once."""
        if not self._waits or len(self._loans) >= self._max_loans:
            return None
        work: list[str] = []
        while thread_id and thread_id not in work:
            work.append(thread_id)
            state = self.orch._cached(thread_id)
            lineage = state.thread.lineage if state and state.thread else {}
            thread_id = lineage.get("parentThreadId") if lineage.get(
                "relationshipToParent") == "subagent" else None
        lent = set(self._loans.values())
        return next((session for _, session, awaited in self._waits if awaited in work
                     and session not in lent and self._blocked(session)), None)

    async def _claim_slot(self, run_id: str, thread_id: str) -> bool:
        """Hold a slot for a new process (``_opening`` until live): a granted one; else, if no run
        waits in line, a free one or one freed by stopping the least recently used idle session;
        else one lent by an agent that waits on this run's work."""
        granted = self._reserved.pop(run_id, None) is not None
        if not granted and (self._line or self._slots_used() >= self._max_live):
            idle = None if self._line else self._idle_sessions()[:1]
            if idle:
                self._opening.add(run_id)
                await self.end(idle[0], "Stopped to free an agent process slot.")
                return True
            lender = self._lender_for(thread_id)
            if lender is None:
                return False
            self._loans[run_id] = lender
        self._opening.add(run_id)
        return True

    def _idle_sessions(self) -> list[_LiveSession]:
        """Live sessions with no turn that nothing is stopping yet, least recently used first."""
        idle = [s for s in self.live.values() if s.turn is None and s.closing_reason is None]
        return sorted(idle, key=lambda s: s.last_used)

    async def _wait_in_line(self, state: ThreadState, run: Run) -> None:
        """No agent process slot: the run goes back to ``queued``, saying why, until
        ``rebalance`` grants it one (in the order runs started waiting)."""
        if not await self.orch.try_dispatch(AwaitAgentSlot(
                command_id=bounded_id(f"command:await-slot:{run.active_attempt_id}:"
                                      f"{self.orch.new_id('wait')}"),
                thread_id=run.thread_id, run_id=run.id, attempt_id=run.active_attempt_id or "",
                reason=f"Waiting for a free agent process: max_live_agent_processes = "
                       f"{self._max_live} are running; it starts when one frees.")):
            return  # interrupted meanwhile
        self.line_up([(run.thread_id, run.id, run.active_attempt_id or "")])

    def line_up(self, waiting: Sequence[tuple[str, str, str]]) -> None:
        """Runs (thread, run, attempt) join the end of the line; free slots go to its head."""
        self._line.extend(waiting)
        self.rebalance()

    def rebalance(self) -> None:
        """Give free slots to the runs in line, oldest first, and lent ones to the runs agents
        wait on; when more runs wait than slots are on their way to freeing, or loans that ended
        left more processes than the cap, stop idle sessions (least recently used first)."""
        if self.orch.stopping:
            return
        while self._line and self._slots_used() < self._max_live:
            self._grant(*self._line.pop(0))
        for entry in list(self._line) if self._waits else ():
            if (lender := self._lender_for(entry[0])) is not None:
                self._line.remove(entry)
                self._loans[entry[1]] = lender
                self._grant(*entry)
        freeing = sum(1 for s in self.live.values() if s.closing_reason is not None)
        over = max(0, self._slots_used() - self._max_live)
        for idle in self._idle_sessions()[:max(0, over + len(self._line) - freeing)]:
            idle.closing_reason = "Stopped to free an agent process slot."
            self.orch.spawn(idle.handle.close(), f"release {idle.session_id}")

    def _grant(self, thread_id: str, run_id: str, attempt_id: str) -> None:
        self._reserved[run_id] = thread_id
        self.orch.spawn(self._grant_slot(thread_id, run_id, attempt_id), f"slot {run_id}")

    async def _grant_slot(self, thread_id: str, run_id: str, attempt_id: str) -> None:
        grant = self.orch.new_id("grant")
        if not await self.orch.try_dispatch(GrantAgentSlot(
                command_id=bounded_id(f"command:grant-slot:{attempt_id}:{grant}"),
                thread_id=thread_id, run_id=run_id, attempt_id=attempt_id)):
            # it ended while it waited: the slot goes to the next in line
            self._reserved.pop(run_id, None)
            self.rebalance()

    def _renewal_due(self, live: _LiveSession, adapter: ProviderAdapter | None) -> bool:
        """The credential ended or is past half its life: the next turn runs in a resumed session
        with a new one. An agent that cannot resume keeps its session until the credential ends."""
        return self._credentials is not None and adapter is not None and \
            adapter.info.capabilities.supports_resume and \
            self._credentials.renewal_due(live.session_id)

    async def _pump(self, live: _LiveSession) -> None:
        """Carry one session's events into ingest commands, in order, each after its commit."""
        events: asyncio.Queue[Any] = live.handle.events
        batch_no, ended = 0, False
        try:
            while not ended:
                event = await events.get()
                if event is None:
                    break
                batch = [event]
                ended = await _coalesce(events, batch, Orchestrator.INGEST_WINDOW_S)
                if live.turn is None:
                    log.debug("dropping %d event(s) outside a turn on %s", len(batch),
                              live.session_id)
                    continue
                run_id, attempt_id = live.turn
                async with self._ingest_slots:  # what came while it waited goes in too
                    ended = await _coalesce(events, batch, 0.0) or ended
                    turn_ended = any(isinstance(e, TurnEnded) for e in batch)
                    if turn_ended:
                        _store.crash_point("before-ingest:turn-ended")
                    batch_no += 1
                    await self._ingest(live, run_id, attempt_id, batch_no, _merge_deltas(batch))
                if turn_ended and live.turn == (run_id, attempt_id):
                    live.turn = None
                    live.turn_ended.set()
                    if self._credentials:
                        self._credentials.set_active(live.session_id, False)
                    live.last_used = time.monotonic()
                    self.rebalance()  # this idle session may give a slot, its loan has ended
                    live.idle_timer = asyncio.get_running_loop().call_later(
                        self.IDLE_RELEASE_S, self._release, live)
        finally:
            await self._session_gone(live)

    async def _ingest(self, live: _LiveSession, run_id: str, attempt_id: str, batch_no: int,
                      events: tuple[AdapterEvent, ...]) -> None:
        command = IngestProviderEvents(
            command_id=bounded_id(f"ingest:{attempt_id}:{live.session_id}:{batch_no}"),
            thread_id=live.thread_id, run_id=run_id, attempt_id=attempt_id,
            provider_session_id=live.session_id, events=events)
        delay = 0.05
        while True:
            try:
                await self.orch.dispatch(command)
                return
            except CommandRejected as exc:
                log.warning("provider events for %s were not recorded: %s", attempt_id, exc)
                return
            except _store.StoreError as exc:
                # The events stay in memory and are retried: ingest is acknowledged only
                # after its commit.
                log.error("could not record provider events (retrying): %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _session_gone(self, live: _LiveSession) -> None:
        """The provider process ended: its turn and session end with a visible reason."""
        if self._credentials:  # first: nothing may use the dead session's token from now on
            self._credentials.revoke(live.session_id)
        try:
            reason = live.closing_reason or getattr(live.handle, "exit_reason", None) \
                or "The provider process exited."
            if live.turn is not None:
                run_id, attempt_id = live.turn
                status = RunStatus.INTERRUPTED if (attempt_id in live.interrupting
                                                   or live.closing_reason) else RunStatus.FAILED
                live.turn = None
                live.turn_ended.set()
                await self.orch.try_dispatch(FailRun(
                    command_id=bounded_id(f"command:session-gone:{live.session_id}:{attempt_id}"),
                    thread_id=live.thread_id, run_id=run_id, attempt_id=attempt_id,
                    status=status, reason=reason))
            await self.orch.try_dispatch(EndProviderSession(
                command_id=bounded_id(f"command:session-end:{live.session_id}"),
                thread_id=live.thread_id, provider_session_id=live.session_id,
                status="stopped" if live.closing_reason else "error", reason=reason))
        finally:
            if self.live.get(live.thread_id) is live:
                del self.live[live.thread_id]
            live.pump_done.set()
            self.rebalance()

    def _release(self, live: _LiveSession) -> None:
        if live.turn is None and self.live.get(live.thread_id) is live:
            live.closing_reason = "Stopped after being idle."
            self.orch.spawn(live.handle.close(), f"release {live.session_id}")

    async def stop_turn(self, thread_id: str, attempt_id: str) -> None:
        """Interrupt the attempt's turn and wait for it to end; kill the process if it won't."""
        live = self.live.get(thread_id)
        if live is None or live.turn is None or live.turn[1] != attempt_id:
            return
        live.interrupting.add(attempt_id)
        ended = live.turn_ended
        await live.handle.interrupt_turn()
        try:
            await asyncio.wait_for(ended.wait(), self.INTERRUPT_GRACE_S)
        except TimeoutError:
            log.warning("provider ignored the interrupt of %s; killing its session", attempt_id)
            await self.end(live, "The provider did not stop the turn when asked; t3 ended it.",
                           grace=1.0)

    async def interrupt(self, thread_id: str, run_id: str, attempt_id: str) -> None:
        live = self.live.get(thread_id)
        if live is None or live.turn != (run_id, attempt_id):
            state = await self.orch.state(thread_id)
            run = state.run(run_id) if state else None
            if run is not None and run.status == RunStatus.RUNNING and \
                    run.active_attempt_id == attempt_id:
                await self.orch.dispatch(FailRun(
                    command_id=bounded_id(f"command:interrupt-orphan:{attempt_id}"),
                    thread_id=thread_id, run_id=run_id, attempt_id=attempt_id,
                    status=RunStatus.INTERRUPTED,
                    reason="Interrupted; its provider session was already gone."))
            return
        await self.stop_turn(thread_id, attempt_id)

    async def steer(self, thread_id: str, run_id: str, attempt_id: str, message_id: str) -> None:
        live = self.live.get(thread_id)
        state = await self.orch.state(thread_id)
        message = state.entities["message"].get(message_id) if state else None
        if live is None or live.turn != (run_id, attempt_id) or message is None:
            raise PermanentEffectError("the turn to steer is no longer live")
        await live.handle.steer_turn(message.text)


# =============================================================================================
# The effects: what each outbox row does, and whether a claim after a crash may run it again


async def _finalize_task(o: Orchestrator, parent_id: str, task_id: str, child_id: str,
                         run_id: str, publish: bool) -> None:
    child = await o.state(child_id)
    run = child.run(run_id) if child else None
    if child is None or run is None:
        raise PermanentEffectError(f"the run {run_id} of task {task_id} is gone")
    status = RunStatus.CANCELLED if run.status == RunStatus.ROLLED_BACK else run.status
    await o.try_dispatch(FinalizeSubagent(
        command_id=bounded_id(f"command:finalize-task:{task_id}:{run_id}"),
        thread_id=parent_id, task_id=task_id, status=status,
        result=task_result(child, run), run_id=run_id, publish=publish),
        f"task {task_id} could not be finalized")


async def _respond(o: Orchestrator, row: _store.EffectRow) -> None:
    p = row.payload
    live = o.sessions.live.get(row.thread_id)
    if live is None or live.session_id != p["providerSessionId"]:
        raise PermanentEffectError("the provider session that asked is gone")
    await live.handle.respond(p["nativeRequestRef"], p.get("decision"), p.get("answers"))


async def _restart(o: Orchestrator, row: _store.EffectRow) -> None:
    p = row.payload
    await o.sessions.stop_turn(row.thread_id, p["interruptedAttemptId"])
    await o.sessions.start_attempt(row.thread_id, p["runId"], p["attemptId"])


async def _route_question(o: Orchestrator, row: _store.EffectRow) -> None:
    p = row.payload
    await o.try_dispatch(NotifyTaskQuestion(
        command_id=bounded_id(f"command:task-question:{p['requestId']}"),
        thread_id=p["parentThreadId"], task_id=p["taskId"], request_id=p["requestId"],
        child_thread_id=p["childThreadId"], question=p["question"],
        blocking=p.get("blocking", True)), f"question of task {p['taskId']} not routed")


async def _withdraw_question(o: Orchestrator, row: _store.EffectRow) -> None:
    p = row.payload
    await o.try_dispatch(SettleTaskQuestion(
        command_id=bounded_id(f"command:withdraw-question:{p['requestId']}"),
        thread_id=p["parentThreadId"], task_id=p["taskId"], request_id=p["requestId"]),
        f"question of task {p['taskId']} not withdrawn")


async def _finalize_run(o: Orchestrator, row: _store.EffectRow) -> None:
    run_id = row.payload["runId"]
    state = await o.state(row.thread_id)
    run = state.run(run_id) if state else None
    if state is None or run is None or run.status != RunStatus.WAITING:
        return  # already finalized (a replay after a crash): the effect is idempotent
    found = [f for hooks in RUN_HOOKS for f in await hooks.finalize(o, state, run)]
    await o.try_dispatch(CompleteRun(command_id=bounded_id(f"command:finalize:{run_id}"),
                                     thread_id=row.thread_id, run_id=run_id,
                                     checkpoints=tuple(found)))


_Runner = Callable[["Orchestrator", _store.EffectRow], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class EffectKind:
    run: _Runner
    replay_safe: bool = False  # a claim after a crash may run it again (else it is cancelled)
    fails_run: bool = False  # failing for good fails the run it serves
    attempts: int = 5


EFFECTS: dict[str, EffectKind] = {
    # start_attempt starts only a run still ``starting``, and MarkRunStarted commits before the
    # prompt goes out: a claim the crash cut short has sent nothing, so it may run again
    "provider-turn.start": EffectKind(lambda o, row: o.sessions.start_attempt(
        row.thread_id, row.payload["runId"], row.payload["attemptId"]), replay_safe=True,
        fails_run=True),
    "provider-turn.restart": EffectKind(_restart, fails_run=True),
    "provider-turn.interrupt": EffectKind(lambda o, row: o.sessions.interrupt(
        row.thread_id, row.payload["runId"], row.payload["attemptId"]), fails_run=True),
    "provider-turn.steer": EffectKind(lambda o, row: o.sessions.steer(
        row.thread_id, row.payload["runId"], row.payload["attemptId"],
        row.payload["messageId"]), fails_run=True),
    "runtime-request.respond": EffectKind(_respond),
    "provider-session.stop": EffectKind(lambda o, row: o.sessions.stop(  # the thread was deleted
        row.thread_id, row.payload["reason"], revoke=True)),
    "run.finalize": EffectKind(_finalize_run, replay_safe=True),
    "subagent.finalize": EffectKind(lambda o, row: _finalize_task(
        o, row.payload["parentThreadId"], row.payload["taskId"], row.payload["childThreadId"],
        row.payload["runId"], row.payload.get("publish", True)), replay_safe=True),
    "subagent.question": EffectKind(_route_question, replay_safe=True),
    "subagent.question-settled": EffectKind(_withdraw_question, replay_safe=True),
}


_BATCH_CHARS = 256 * 1024  # one ingest event's text at most: a lagging writer copies no MBs


def _ms() -> int:
    return int(time.time() * 1000)


async def _coalesce(events: asyncio.Queue[Any], batch: list[Any], window_s: float) -> bool:
    """Extend ``batch`` while it ends in a delta, to _BATCH_CHARS of text: with what ``events``
    holds already (no timer task per event), then with what comes within ``window_s``. True
    once the end marker came."""
    loop, size = asyncio.get_running_loop(), 0
    deadline = loop.time() + window_s
    while isinstance(last := batch[-1], (TextDelta, ReasoningDelta)) and (
            size := size + len(last.text)) < _BATCH_CHARS:
        if events.empty():
            if (remaining := deadline - loop.time()) <= 0:
                return False
            try:
                nxt = await asyncio.wait_for(events.get(), remaining)
            except TimeoutError:
                return False
        else:
            nxt = events.get_nowait()
        if nxt is None:
            return True
        batch.append(nxt)
    return False


def _merge_deltas(batch: Sequence[AdapterEvent]) -> tuple[AdapterEvent, ...]:
    """Join runs of deltas of one kind: the same text in one event per run of chunks, joined
    once (adding chunk by chunk would copy a long run's text once per chunk)."""
    merged: list[AdapterEvent] = []
    for kind, run in itertools.groupby(batch, lambda e: type(e) if isinstance(
            e, (TextDelta, ReasoningDelta)) else None):
        events = list(run)
        merged += [kind("".join(e.text for e in events))] if kind and len(events) > 1 else events
    return tuple(merged)
