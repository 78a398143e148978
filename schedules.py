"""schedules.py: scheduled tasks and webhooks, a feature an auditor of the core may skip.

A scheduled task is an event stream of its own holding a prompt that runs on a schedule (an
interval, a fixed time of day, or each delivery to its webhook URL), in its bound thread or in a
fresh thread each time. Its commands are decided here as the core's are (pure, registered with
``orchestrator.decides``); ``Scheduler`` is its runtime, which t3.py attaches to the orchestrator
and hands webhook requests to (token and body size checked there); its operations join
tools.OPERATIONS. The core never imports this module.

Rules:
- A fire happens at most once, crash or not: its command id is its fire key, and its run is an
  effect safe to replay (its ids derive from that key). A fixed-time fire missed by more than
  MISSED_FIXED_TIME_GRACE_S is skipped.
- A task never runs twice at once: webhook deliveries wait in line.
- A delivery's signature, nesting and rate are checked before anything is written; its secrets
  never reach the log, a template or a filter.
- An agent acts only on its own project's tasks, within its own modes; it never holds a hook's
  token, and changes a prompt or a webhook's schedule only on a task its own thread made.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from orchestrator import (MAX_JSON_DEPTH, RUN_TERMINAL, REDACTED, EFFECTS, Actor,
                          Command, CommandRejected, CreationSource, Draft,
                          EffectKind, Entity, InteractionMode, Run,
                          RunStatus, RuntimeMode, T3Error, bounded_id, decides, epoch_of,
                          iso_time, json_too_deep, parse_json, parse_timestamp,
                          register_entities, thread_title, ThreadState)
from tools import (ACTOR, BOOLEAN, CLIENT, CLIENT_REQUEST_ID, INTEGER, INTERACTION,
                   INTERACTION_INPUT, OBJECT, OPT_STRING, RUNTIME, RUNTIME_INPUT, SOURCE, STRING,
                   TARGET, TITLE, Args, Call, Operation, Scope, Toolkit, enum_of, list_of,
                   obj, register, shape, text_field)

__all__ = ["ScheduledTask", "WebhookDelivery", "validate_schedule", "next_run_after",
           "UpsertScheduledTask", "DeleteScheduledTask", "FireScheduledTask",
           "SettleScheduledRun", "WebhookRequest", "ReceiveWebhookDelivery", "Scheduler",
           "HOOK_BODY_MAX_BYTES", "RateLimited"]

log = logging.getLogger("t3.schedules")


# =============================================================================================
# Entities


SCHEDULE_RUN_STATUSES = frozenset({"never", "running", "succeeded", "failed"})
DELIVERY_OUTCOMES = frozenset({"queued", "running", "succeeded", "failed", "skipped",
                               "duplicate", "expired"})
DELIVERY_WAITING = frozenset({"queued", "running"})  # the task's waiting line


@dataclass(frozen=True, slots=True)
class ScheduledTask(Entity):
    """Recurring work; an event stream of its own, keyed by its id."""

    kind: ClassVar[str] = "scheduled-task"
    opens_stream: ClassVar[bool] = True
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"last_run_status": SCHEDULE_RUN_STATUSES}
    title: str
    prompt: str
    enabled: bool
    schedule: Mapping[str, Any]  # interval | fixed_time | webhook (validate_schedule)
    project_id: str
    workspace: str  # where an unbound run's fresh thread works
    model_selection: Mapping[str, Any]  # {instanceId, model}
    runtime_mode: str
    interaction_mode: str
    created_by: str
    creation_source: str
    created_at: str
    updated_at: str
    bound_thread_id: str | None = None  # runs post into this thread; None: a fresh one each
    creator_thread_id: str | None = None  # the agent's thread that made it (None: the client)
    next_run_at: str | None = None
    last_run_at: str | None = None
    last_run_status: str = "never"
    last_run_error: str | None = None
    last_fire_key: str | None = None
    last_run_thread_id: str | None = None
    last_run_id: str | None = None
    run_count: int = 0
    hook_token_sha256: str | None = None  # a webhook's token, hashed: the token is shown once
    delivery_count: int = 0  # webhook deliveries recorded: the next one's ordinal
    deleted_at: str | None = None


@dataclass(frozen=True, slots=True)
class WebhookDelivery(Entity):
    """One request to a webhook task's URL, as its log shows it (secrets redacted)."""

    kind: ClassVar[str] = "webhook-delivery"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {"outcome": DELIVERY_OUTCOMES}
    task_id: str
    received_at: str
    outcome: str
    method: str
    headers: Mapping[str, str]
    body_excerpt: str
    body_truncated: bool
    query: Mapping[str, Any]
    delivery_key: str | None = None
    fire_key: str | None = None
    error: str | None = None
    run_thread_id: str | None = None  # the thread its run went to
    run_id: str | None = None
    updated_at: str | None = None
    ordinal: int = 0  # its place among the task's deliveries: the waiting line's order
    reason: str | None = None  # why it was skipped, expired or a duplicate
    prompt: str | None = None  # the filled-in prompt while it waits (dropped once it runs)

    @property
    def stream(self) -> str:
        return self.task_id

    def held(self) -> bool:
        """decide needs only the waiting line; the log lives in the store (newest 50), so a
        busy hook's task does not grow in memory."""
        return self.outcome in DELIVERY_WAITING


register_entities(ScheduledTask, WebhookDelivery)


# =============================================================================================
# Schedules: what a task's schedule may be, and when it is next due


MIN_INTERVAL_MS = 60_000
MISSED_FIXED_TIME_GRACE_S = 600.0  # a fixed-time fire later than this is skipped, not run late
_TIME_OF_DAY = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)")


def validate_schedule(schedule: Any) -> dict[str, Any]:
    """A schedule, checked and normalized: ``{"type": "interval", "everyMs"}`` (>= 60,000),
    ``{"type": "fixed_time", "timeOfDay": "HH:MM", "weekdays"?: [0..6, 0 = Sunday]}`` in the
    server's local time zone, or ``{"type": "webhook", ...}`` (its options are the webhook's);
    or the same as a JSON string (models often send one)."""
    if isinstance(schedule, str):
        try:
            schedule = parse_json(schedule)
        except ValueError as exc:
            raise T3Error(f"schedule: not an object, nor JSON of one ({exc})",
                          code="invalid_request") from None
    _require(isinstance(schedule, Mapping), "schedule", "must be an object")
    kind = schedule.get("type")
    if kind == "interval":
        every = schedule.get("everyMs")
        _require(set(schedule) <= {"type", "everyMs"} and _is_int(every, MIN_INTERVAL_MS),
                 "schedule", f"an interval is {{type, everyMs}} with everyMs >= {MIN_INTERVAL_MS}")
        return {"type": "interval", "everyMs": every}
    if kind == "fixed_time":
        at, days = schedule.get("timeOfDay"), schedule.get("weekdays")
        clock = _TIME_OF_DAY.fullmatch(at) if isinstance(at, str) else None
        _require(set(schedule) <= {"type", "timeOfDay", "weekdays"} and clock is not None and (
            days is None or isinstance(days, list) and all(_is_int(d, 0, 6) for d in days)),
            "schedule", 'a fixed time is {type, timeOfDay: "HH:MM", weekdays?: [0-6, 0 = Sunday]}')
        hours, minutes = clock.groups()  # type: ignore[union-attr]
        return {"type": "fixed_time", "timeOfDay": f"{int(hours):02d}:{minutes}",
                **({"weekdays": sorted(set(days))} if days else {})}
    _require(kind == "webhook", "schedule.type", "must be interval, fixed_time or webhook")
    return _validate_webhook(schedule)


def next_run_after(schedule: Mapping[str, Any], after: float) -> float | None:
    """The first time (epoch seconds) the schedule is due strictly after ``after``; None for a
    webhook. Fixed times are wall-clock times of the server's local time zone: each day's slot
    is converted with the zone's rules for that day, so DST changes move it correctly."""
    if schedule["type"] == "interval":
        return after + max(schedule["everyMs"], MIN_INTERVAL_MS) / 1000
    if schedule["type"] != "fixed_time":
        return None
    hour, minute = map(int, schedule["timeOfDay"].split(":"))
    weekdays = set(schedule.get("weekdays") or range(7))
    day = time.localtime(after)
    for offset in range(9):
        # mktime normalizes the day overflow and, with tm_isdst -1, applies that day's DST.
        slot = time.mktime((day.tm_year, day.tm_mon, day.tm_mday + offset, hour, minute, 0, 0,
                            0, -1))
        local = time.localtime(slot)
        if slot > after and (local.tm_wday + 1) % 7 in weekdays:  # tm_wday 0 = Monday
            return slot
    return None


def _next_run_at(schedule: Mapping[str, Any], now: str) -> str | None:
    due = next_run_after(schedule, epoch_of(now))
    return iso_time(due) if due is not None else None


def _require(ok: Any, name: str, problem: str) -> None:
    """Refuse a request whose field ``name`` is not ``ok``, saying what it must be."""
    if not ok:
        raise T3Error(f"{name}: {problem}", code="invalid_request")


def _is_int(value: Any, low: int, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


# =============================================================================================
# Webhooks: what a webhook schedule may hold, how a delivery is signed and named (for dedupe),
# and what its log, templates and filters see of it


HOOK_BODY_MAX_BYTES = 1024 * 1024  # t3.py refuses a longer body (413) before reading it
HOOK_DELIVERIES_PER_MINUTE = 60
MAX_WAITING_DELIVERIES = 20  # queued + running, per task
DELIVERY_EXCERPT_BYTES = 64 * 1024
MAX_FILLED_PROMPT_CHARS = 120_000
MAX_HOOK_FILTERS = 20
DELIVERY_ID_HEADERS = ("x-github-delivery", "webhook-id", "x-request-id")
TIMESTAMP_HEADERS = ("webhook-timestamp", "x-webhook-timestamp")
STANDARD_WEBHOOKS = "standard-webhooks"  # webhook-id, webhook-timestamp, webhook-signature
_WEBHOOK_KEYS = ("type", "signature", "filters", "maxDeliveryAgeMinutes", "deliveryIdHeader",
                 "timestampHeader")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
_FILTER_PATH = re.compile(r"[^.\s]{1,128}(\.[^.\s]{1,128}){0,31}")
# Header and query names whose values the log never keeps, and templates and filters never see.
_SECRET_NAME = re.compile(r"auth|cookie|token|secret|signature|passw|api[-_]?key|credential|"
                          r"session", re.IGNORECASE)
_PLACEHOLDER = re.compile(r"\{\{\s*(body|headers|query)(?:\.([^{}\s]+))?\s*\}\}")
_MISSING = object()


class RateLimited(T3Error):
    """Too many requests; try again later (t3.py answers 429 with ``Retry-After``)."""

    code = "rate_limited"

    def __init__(self, message: str | None = None, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _validate_webhook(schedule: Mapping[str, Any]) -> dict[str, Any]:
    """``{"type": "webhook", "signature"?: {header, secret, prefix?}, "filters"?: [{path,
    equals}], "maxDeliveryAgeMinutes"?, "deliveryIdHeader"?, "timestampHeader"?}``, checked."""
    if unknown := sorted(set(schedule) - set(_WEBHOOK_KEYS)):
        raise T3Error(f"schedule.{unknown[0]}: unknown field; a webhook takes "
                      f"{', '.join(_WEBHOOK_KEYS[1:])}", code="invalid_request")
    checked: dict[str, Any] = {"type": "webhook"}
    if (sig := schedule.get("signature")) is not None:
        checked["signature"] = _validate_signature(sig, schedule)
    if (filters := schedule.get("filters")) is not None:
        _require(isinstance(filters, list) and len(filters) <= MAX_HOOK_FILTERS,
                 "schedule.filters", f"a list of at most {MAX_HOOK_FILTERS} {{path, equals}}")
        for i, f in enumerate(filters):
            name = f"schedule.filters[{i}]"
            _require(isinstance(f, Mapping) and set(f) == {"path", "equals"}, name,
                     "an object {path, equals}")
            _require(isinstance(f["path"], str) and _FILTER_PATH.fullmatch(f["path"]),
                     f"{name}.path", "a dotted path (e.g. pull_request.base.ref, commits.0.id, "
                     "headers.x-github-event, query.name)")
            _require(f["equals"] is None or isinstance(f["equals"], (str, bool, int, float)),
                     f"{name}.equals", "a string, number, boolean or null")
        checked["filters"] = [{"path": f["path"], "equals": f["equals"]} for f in filters]
    if (age := schedule.get("maxDeliveryAgeMinutes")) is not None:
        _require(_is_int(age, 1, 10_080), "schedule.maxDeliveryAgeMinutes",
                 "an integer from 1 to 10080 (a week)")
        checked["maxDeliveryAgeMinutes"] = age
    for name in ("deliveryIdHeader", "timestampHeader"):
        if schedule.get(name) is not None:
            checked[name] = _header_name(schedule[name], name)
    return checked


def _validate_signature(sig: Any, schedule: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(sig, Mapping) and sig.get("scheme") == STANDARD_WEBHOOKS:
        _require(set(sig) == {"scheme", "secret"} and _standard_key(sig["secret"]),
                 "schedule.signature", f"{{scheme: {STANDARD_WEBHOOKS}, secret: whsec_<base64>}}")
        _require(schedule.get("timestampHeader") is None, "schedule.timestampHeader",
                 "the scheme's signed webhook-timestamp is the one read")
        return {"scheme": STANDARD_WEBHOOKS, "secret": sig["secret"]}
    _require(isinstance(sig, Mapping) and set(sig) <= {"header", "secret", "prefix"},
             "schedule.signature", "an object {header, secret, prefix?}, or {scheme: "
             f"{STANDARD_WEBHOOKS}, secret}}")
    secret, prefix = sig.get("secret"), sig.get("prefix", "")
    _require(isinstance(secret, str) and 1 <= len(secret) <= 1024, "schedule.signature.secret",
             "a string of 1 to 1,024 characters")
    _require(isinstance(prefix, str) and len(prefix) <= 64, "schedule.signature.prefix",
             "a string of at most 64 characters (e.g. sha256=)")
    return {"header": _header_name(sig.get("header"), "signature.header"), "secret": secret,
            **({"prefix": prefix} if prefix else {})}


def _header_name(value: Any, name: str) -> str:
    _require(isinstance(value, str) and _HEADER_NAME.fullmatch(value), f"schedule.{name}",
             "an HTTP header name (letters, digits and -, at most 128)")
    return value


@dataclass(frozen=True, slots=True)
class WebhookRequest:
    """A request to a hook's URL as HTTP carried it (t3.py parses it; nothing in it is trusted)."""

    method: str
    headers: tuple[tuple[str, str], ...]  # names lower-cased, in the order sent
    query: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)


def signature_valid(schedule: Mapping[str, Any], request: WebhookRequest) -> bool:
    """No signature asked for; or its header holds prefix + the hex HMAC-SHA256 of the raw body
    (GitHub: ``X-Hub-Signature-256: sha256=<hex>``); or, for Standard Webhooks, a ``v1,<base64>``
    in ``webhook-signature`` signs what ``_signed_content`` says. Constant-time compares."""
    sig = schedule.get("signature")
    if not sig:
        return True
    signed = _signed_content(schedule, request)
    if sig.get("scheme") == STANDARD_WEBHOOKS:
        expected = base64.b64encode(hmac.new(_standard_key(sig["secret"]) or b"", signed or b"",
                                             hashlib.sha256).digest()).decode()
        given = (request.header("webhook-signature") or "").split()
        # compare_digest takes only ASCII text: a value with other characters matches nothing.
        return signed is not None and any(
            g.isascii() and g.startswith("v1,") and hmac.compare_digest(g[3:], expected)
            for g in given)
    given = (request.header(sig["header"]) or "").strip()
    prefix = sig.get("prefix", "")
    expected = hmac.new(sig["secret"].encode(), request.body, hashlib.sha256).hexdigest()
    return given.isascii() and given.startswith(prefix) and \
        hmac.compare_digest(given[len(prefix):].lower(), expected)


def replay_key(schedule: Mapping[str, Any], request: WebhookRequest) -> str | None:
    """What names the delivery for dedupe: the hash of what its signature covers (a copy is
    known whatever delivery id it carries), else its ``delivery_key`` (None: never a duplicate)."""
    if schedule.get("signature") and (signed := _signed_content(schedule, request)) is not None:
        return "signed:" + hashlib.sha256(signed).hexdigest()
    return delivery_key(schedule, request)


def delivery_key(schedule: Mapping[str, Any], request: WebhookRequest) -> str | None:
    """The value of the task's ``deliveryIdHeader``, else of the first of DELIVERY_ID_HEADERS
    present, as the log shows it (None when absent)."""
    names = [schedule["deliveryIdHeader"]] if schedule.get("deliveryIdHeader") \
        else DELIVERY_ID_HEADERS
    value = next((v.strip() for n in names if (v := request.header(n)) and v.strip()), None)
    return bounded_id(value) if value else None


def _signed_content(schedule: Mapping[str, Any], request: WebhookRequest) -> bytes | None:
    """The bytes the task's signature covers: the body, or for Standard Webhooks
    ``<webhook-id>.<webhook-timestamp>.<body>`` (None without those headers)."""
    if (schedule.get("signature") or {}).get("scheme") != STANDARD_WEBHOOKS:
        return request.body
    msg_id, stamp = request.header("webhook-id"), request.header("webhook-timestamp")
    if not msg_id or not stamp:
        return None
    return f"{msg_id}.{stamp}.".encode("latin-1") + request.body  # the header bytes as sent


def _standard_key(secret: Any) -> bytes | None:
    """A Standard Webhooks secret ``whsec_<base64>`` as its HMAC key (None if it is not one)."""
    if not isinstance(secret, str) or not secret.startswith("whsec_") or len(secret) > 1024:
        return None
    try:
        return base64.b64decode(secret[6:], validate=True) or None
    except ValueError:
        return None


def delivery_excerpt(schedule: Mapping[str, Any], body: bytes,
                     redact: Callable[[str], str] | None) -> str:
    """What the log keeps of a body: its first 64 KiB as text through ``redact`` (t3.py hands
    in providers.redact; without one nothing is kept), the signature's secret blanked too."""
    if redact is None:
        return ""
    text = body[:DELIVERY_EXCERPT_BYTES].decode("utf-8", "replace")
    return _blank_secret(schedule, redact(text))


def _blank_secret(schedule: Mapping[str, Any], text: str) -> str:
    secret = (schedule.get("signature") or {}).get("secret")
    return text.replace(secret, REDACTED) if secret and secret in text else text


class _Delivery:
    """A request as the rules see it: headers and query with secrets blanked (the log keeps
    these, and templates and filters see only these), the body as text and as JSON."""

    def __init__(self, schedule: Mapping[str, Any], request: WebhookRequest) -> None:
        self.schedule, self.request = schedule, request
        signed = ((schedule.get("signature") or {}).get("header") or "").lower()
        self.headers: dict[str, str] = {}
        for name, value in request.headers:
            shown = REDACTED if _SECRET_NAME.search(name) or name == signed else \
                _blank_secret(schedule, value)
            self.headers[name] = f"{self.headers[name]}, {shown}" if name in self.headers \
                else shown
        self.query: dict[str, list[str]] = {}
        for name, value in request.query:
            self.query.setdefault(name, []).append(
                REDACTED if _SECRET_NAME.search(name) else _blank_secret(schedule, value))
        self.text = request.body.decode("utf-8", "replace")
        try:
            self.json: Any = parse_json(self.text)
        except ValueError:
            self.json = _MISSING

    def value(self, path: str) -> Any:
        """``headers.<name>``, ``query.<name>``, or a dotted path into the JSON body (``body.``
        optional; a list index is a number); _MISSING when there is none."""
        head, _, rest = path.partition(".")
        if head == "headers":
            return self.headers.get(rest.lower(), _MISSING)
        if head == "query":
            return self.query[rest][0] if self.query.get(rest) else _MISSING
        found = self.json
        for part in (rest.split(".") if rest else []) if head == "body" else path.split("."):
            if isinstance(found, dict) and part in found:
                found = found[part]
            elif isinstance(found, list) and part.isdigit() and int(part) < len(found):
                found = found[int(part)]
            else:
                return _MISSING
        return found

    def fill(self, template: str) -> str:
        """The prompt template with ``{{body}}`` (the raw body), ``{{body.a.b}}``,
        ``{{headers.name}}`` and ``{{query.name}}`` filled in (missing: empty), in one pass: a
        placeholder inside a filled-in value stays as it is."""
        def filled(match: re.Match[str]) -> str:
            source, path = match.groups()
            if path is None:
                return self.text if source == "body" else match.group(0)
            value = self.value(f"{source}.{path}")
            if value is _MISSING or value is None:
                return ""
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return _PLACEHOLDER.sub(filled, template).strip()

    def unmatched_filter(self) -> str | None:
        """Why the delivery is skipped: the first filter it does not match (in JSON's equality:
        true is not 1, 1 is 1.0), or None."""
        for i, f in enumerate(self.schedule.get("filters") or ()):
            found, wanted = self.value(f["path"]), f["equals"]
            if found is _MISSING or isinstance(found, bool) != isinstance(wanted, bool) or \
                    found != wanted:
                return f"filters[{i}] ({f['path']} equals {json.dumps(wanted)}) did not match"
        return None

    def too_old(self, now: float) -> str | None:
        """Why the delivery is expired: its timestamp header is missing, unreadable, or further
        than ``maxDeliveryAgeMinutes`` from now (either way); None without a limit."""
        limit = self.schedule.get("maxDeliveryAgeMinutes")
        if limit is None:
            return None
        names = [self.schedule["timestampHeader"]] if self.schedule.get("timestampHeader") \
            else TIMESTAMP_HEADERS
        name, value = next(((n, v) for n in names if (v := self.request.header(n))), ("", None))
        if value is None:  # else a replay would only have to leave its stamp out
            return f"it has no timestamp header ({', '.join(names)}) and " \
                f"maxDeliveryAgeMinutes is {limit}"
        sent = parse_timestamp(value)
        if sent is None:
            return f"its {name} header is not a time (epoch seconds or milliseconds, ISO 8601, " \
                "or an HTTP date)"
        if now - sent > limit * 60:
            return f"sent {now - sent:.0f} s ago, more than maxDeliveryAgeMinutes ({limit})"
        if sent - now > limit * 60:  # else a copy could outlive its dedupe (_delivery_command_id)
            return f"stamped {sent - now:.0f} s ahead, more than maxDeliveryAgeMinutes ({limit})"
        return None


# =============================================================================================
# Decisions: the commands on a task's stream (a command's thread_id is the task's id). A webhook
# delivery fires in the command that records it, or in the one that settles the run before it.


_CHANGEABLE = ("title", "prompt", "enabled", "schedule", "model_selection", "runtime_mode",
               "interaction_mode", "hook_token_sha256")  # UpsertScheduledTask's, None: unchanged


@dataclass(frozen=True, slots=True)
class UpsertScheduledTask(Command):
    """Create a task, or change one (fields left None stay as they are)."""

    type: ClassVar[str] = "scheduled-task.upsert"
    title: str | None = None
    prompt: str | None = None
    enabled: bool | None = None
    schedule: Mapping[str, Any] | None = None
    project_id: str | None = None
    workspace: str | None = None
    bound_thread_id: str | None = None
    bind: bool | None = None  # None: keep the binding; False: unbind
    model_selection: Mapping[str, Any] | None = None
    runtime_mode: str | None = None
    interaction_mode: str | None = None
    created_by: str = Actor.USER
    creation_source: str = CreationSource.MCP
    creator_thread_id: str | None = None
    hook_token_sha256: str | None = None


@dataclass(frozen=True, slots=True)
class DeleteScheduledTask(Command):
    type: ClassVar[str] = "scheduled-task.delete"


@dataclass(frozen=True, slots=True)
class FireScheduledTask(Command):
    """A task is due (trigger scheduled) or asked to run now (manual); the command id is the
    fire key."""

    type: ClassVar[str] = "scheduled-task.fire"
    trigger: str  # scheduled | manual
    due_at: str | None = None  # scheduled: the next_run_at this fire is for

    def __post_init__(self) -> None:
        if self.trigger not in ("scheduled", "manual"):
            raise ValueError(f"unknown trigger {self.trigger!r}")


@dataclass(frozen=True, slots=True)
class SettleScheduledRun(Command):
    """What became of a fire: its run started (``run_id``), or ended (succeeded / failed)."""

    type: ClassVar[str] = "scheduled-task.settle"
    fire_key: str
    status: str  # running | succeeded | failed
    error: str | None = None
    run_thread_id: str | None = None
    run_id: str | None = None


@dataclass(frozen=True, slots=True)
class ReceiveWebhookDelivery(Command):
    """A delivery passed its hook's token, signature and rate limit: record it, with its
    outcome, and queue its run unless it is a duplicate, expired, skipped or failed."""

    type: ClassVar[str] = "webhook-delivery.receive"
    # The command id, webhook:<task>:<replay_key>[:<n>] (random without a key), names the
    # delivery, so a copy is the same command whatever else it carries.
    fingerprint_fields: ClassVar[tuple[str, ...]] = ("thread_id",)
    delivery_id: str
    request: WebhookRequest
    body_excerpt: str  # the log's copy: ``delivery_excerpt``
    delivery_key: str | None = None
    duplicate_of: str | None = None  # the delivery first recorded under this key


@decides(UpsertScheduledTask, thread=False)
def _decide_upsert_task(d: Draft, c: UpsertScheduledTask, **_: Any) -> Mapping[str, Any]:
    task = d.get("scheduled-task", c.thread_id)
    if task is None:
        if None in (c.title, c.prompt, c.schedule, c.project_id, c.workspace, c.model_selection):
            raise CommandRejected("a new scheduled task needs a title, prompt, schedule, "
                                  "project and provider", code="invalid_request")
        task = ScheduledTask(
            id=c.thread_id, title=c.title, prompt=c.prompt, enabled=True, schedule=c.schedule,
            project_id=c.project_id, workspace=c.workspace, model_selection=c.model_selection,
            runtime_mode=c.runtime_mode or RuntimeMode.APPROVAL_REQUIRED,
            interaction_mode=c.interaction_mode or InteractionMode.DEFAULT,
            created_by=c.created_by, creation_source=c.creation_source, created_at=d.now,
            updated_at=d.now, creator_thread_id=c.creator_thread_id)
    elif task.deleted_at is not None:
        raise CommandRejected(f"scheduled task {task.id} was deleted", code="task_not_found")
    changes = {name: getattr(c, name) for name in _CHANGEABLE if getattr(c, name) is not None}
    if c.bind is not None:
        changes["bound_thread_id"] = c.bound_thread_id if c.bind else None
    updated = replace(task, **changes, updated_at=d.now)
    # A new task (no next run yet) or a changed timing is aimed again from now.
    if task.next_run_at is None or updated.schedule != task.schedule or \
            updated.enabled != task.enabled:
        updated = replace(updated, next_run_at=_next_run_at(updated.schedule, d.now)
                          if updated.enabled else None)
    d.put(_fire_next_delivery(d, updated))  # deliveries that waited while it was paused
    return {"scheduledTaskId": task.id, "nextRunAt": updated.next_run_at}


@decides(DeleteScheduledTask, thread=False)
def _decide_delete_task(d: Draft, c: DeleteScheduledTask, **_: Any) -> Mapping[str, Any]:
    task = _scheduled_task(d, c.thread_id)
    d.put(replace(task, deleted_at=d.now, enabled=False, next_run_at=None, updated_at=d.now))
    for delivery in d.all("webhook-delivery"):
        if delivery.outcome == "queued":
            d.put(replace(delivery, outcome="failed", prompt=None, updated_at=d.now,
                          error="The scheduled task was deleted before this delivery ran."))
    return {"scheduledTaskId": task.id, "deleted": True}


@decides(FireScheduledTask, thread=False)
def _decide_fire(d: Draft, c: FireScheduledTask, **_: Any) -> Mapping[str, Any]:
    task = _scheduled_task(d, c.thread_id)
    if task.last_run_status == "running":
        raise CommandRejected(f"scheduled task {task.id} is running; it never runs twice at "
                              "once", code="invalid_request")
    next_at = task.next_run_at
    if c.trigger == "scheduled":
        if not task.enabled or task.next_run_at != c.due_at or c.due_at is None:
            raise CommandRejected("the fire is stale: the task changed meanwhile")
        next_at = _next_run_at(task.schedule, d.now)
        if task.schedule["type"] == "fixed_time" and \
                epoch_of(d.now) - epoch_of(c.due_at) > MISSED_FIXED_TIME_GRACE_S:
            d.put(replace(task, next_run_at=next_at, updated_at=d.now))  # skipped, re-aimed
            return {"scheduledTaskId": task.id, "fired": False, "nextRunAt": next_at}
    d.put(replace(_fired(d, task, c.command_id, task.prompt), next_run_at=next_at))
    return {"scheduledTaskId": task.id, "fired": True, "fireKey": c.command_id,
            "nextRunAt": next_at}


@decides(SettleScheduledRun, thread=False)
def _decide_settle_run(d: Draft, c: SettleScheduledRun, **_: Any) -> Mapping[str, Any]:
    task = d.get("scheduled-task", c.thread_id)
    if task is None or task.last_fire_key != c.fire_key or task.last_run_status != "running":
        raise CommandRejected("that fire is not the task's running one")
    delivery = next((x.id for x in d.all("webhook-delivery") if x.fire_key == c.fire_key), None)
    if c.status == "running":
        task = replace(task, last_run_thread_id=c.run_thread_id, last_run_id=c.run_id,
                       updated_at=d.now)
        d.update("webhook-delivery", delivery, run_thread_id=c.run_thread_id, run_id=c.run_id,
                 updated_at=d.now)
    else:
        task = replace(task, last_run_status=c.status, last_run_error=c.error, updated_at=d.now)
        d.update("webhook-delivery", delivery, outcome=c.status, error=c.error, updated_at=d.now)
        task = _fire_next_delivery(d, task)  # in this same commit: the line never stalls
    d.put(task)
    return {"scheduledTaskId": task.id, "status": c.status}


@decides(ReceiveWebhookDelivery, thread=False)
def _decide_receive_delivery(d: Draft, c: ReceiveWebhookDelivery, **_: Any
                             ) -> Mapping[str, Any]:
    task = d.get("scheduled-task", c.thread_id)
    if not _is_hook(task):
        raise CommandRejected("No webhook at this address.", code="hook_not_found")
    if not task.enabled:
        raise CommandRejected(f"Scheduled task {task.id} is paused (enabled: false).",
                              code="hook_disabled")
    view = _Delivery(task.schedule, c.request)
    task = replace(task, delivery_count=task.delivery_count + 1, updated_at=d.now)
    delivery = WebhookDelivery(
        id=c.delivery_id, task_id=task.id, received_at=d.now, outcome="queued",
        method=c.request.method, headers=view.headers, body_excerpt=c.body_excerpt,
        body_truncated=len(c.request.body) > DELIVERY_EXCERPT_BYTES, query=view.query,
        delivery_key=c.delivery_key, updated_at=d.now, ordinal=task.delivery_count)
    if c.duplicate_of is not None:
        delivery = replace(delivery, outcome="duplicate", reason=(
            "the same signed delivery" if task.schedule.get("signature") else
            f"delivery {c.delivery_key}") + f" came before: {c.duplicate_of}")
    elif (why := view.too_old(epoch_of(d.now))) is not None:
        delivery = replace(delivery, outcome="expired", reason=why)
    elif (why := view.unmatched_filter()) is not None:
        delivery = replace(delivery, outcome="skipped", reason=why)
    else:
        waiting = sum(1 for x in d.all("webhook-delivery") if x.outcome in DELIVERY_WAITING)
        if waiting >= MAX_WAITING_DELIVERIES:
            raise CommandRejected(f"{waiting} deliveries to this hook are waiting or running "
                                  f"(at most {MAX_WAITING_DELIVERIES}); send it again later",
                                  code="queue_full")
        prompt = view.fill(task.prompt)
        delivery = replace(delivery, prompt=prompt) if len(prompt) <= MAX_FILLED_PROMPT_CHARS \
            else replace(delivery, outcome="failed", error="The filled-in prompt is too long.")
    if delivery.outcome == "queued":
        task = _fire_next_delivery(d, task, arriving=delivery)
    else:
        d.put(delivery)
    d.put(task)
    return {"deliveryId": delivery.id, "receivedAt": d.now,
            "outcome": d.get("webhook-delivery", delivery.id).outcome}


def _scheduled_task(d: Draft, task_id: str) -> ScheduledTask:
    task = d.get("scheduled-task", task_id)
    if task is None or task.deleted_at is not None:
        raise CommandRejected(f"scheduled task {task_id} was not found", code="task_not_found")
    return task  # type: ignore[no-any-return]


def _is_hook(task: ScheduledTask | None) -> bool:
    """A webhook task that was not deleted."""
    return task is not None and task.deleted_at is None and task.schedule.get("type") == "webhook"


def _fired(d: Draft, task: ScheduledTask, fire_key: str, prompt: str) -> ScheduledTask:
    """The task once a fire started: its run requested, the task running. The caller puts it."""
    d.effect("scheduled-task.run", {
        "taskId": task.id, "fireKey": fire_key,
        "prompt": f"[Triggered by schedule task: {task.title}]\n\n{prompt}"}, fire_key)
    return replace(task, last_run_status="running", last_run_at=d.now, last_run_error=None,
                   last_fire_key=fire_key, last_run_thread_id=None, last_run_id=None,
                   run_count=task.run_count + 1, updated_at=d.now)


def _fire_next_delivery(d: Draft, task: ScheduledTask, *,
                        arriving: WebhookDelivery | None = None) -> ScheduledTask:
    """Fire the oldest queued delivery if the task is idle, enabled and not deleted, and put
    the delivery (``arriving`` joins the line first). Returns the task for the caller to put."""
    line = sorted([x for x in d.all("webhook-delivery") if x.outcome == "queued"]
                  + ([arriving] if arriving else []), key=lambda x: x.ordinal)
    idle = bool(line) and task.enabled and task.deleted_at is None and \
        task.last_run_status != "running"
    if arriving is not None and not (idle and arriving is line[0]):
        d.put(arriving)
    if not idle:
        return task
    first = line[0]
    fire_key = bounded_id(f"scheduled-task:{task.id}:{first.id}:webhook")
    d.put(replace(first, outcome="running", fire_key=fire_key, prompt=None, updated_at=d.now))
    return _fired(d, task, fire_key, first.prompt or "")


# =============================================================================================
# Runtime: the scheduler, and the run a fire requests


_RESTARTED = "Run was interrupted by a server restart."


class Scheduler:
    """Fires what is due, runs each fire's turn, settles the task when that run ends, and takes
    webhook deliveries. The orchestrator shows it every committed run and task (``watches``)
    and starts ``run``."""

    watches = frozenset({"run", "scheduled-task"})

    def __init__(self, toolkit: Toolkit, *, wall: Callable[[], float],
                 redact: Callable[[str], str] | None) -> None:
        self.toolkit, self.orch, self._store = toolkit, toolkit.orch, toolkit.store
        self._wall = wall  # epoch seconds, from the same clock as ``clock`` (tests move both)
        self._redact = redact  # what webhook delivery logs keep of a body goes through it
        self._schedule_wake = asyncio.Event()
        self._scheduled_runs: dict[str, tuple[str, str]] = {}  # run id -> (task id, fire key)
        self._hook_hits: dict[str, collections.deque[float]] = {}  # task id -> admitted at
        self.making_task = asyncio.Lock()  # a project's task count holds until its commit

    def committed(self, entity: Run | ScheduledTask) -> None:
        if isinstance(entity, ScheduledTask):
            self._schedule_wake.set()  # its timing or state changed: aim again
        elif entity.status in RUN_TERMINAL and entity.id in self._scheduled_runs:
            self.orch.spawn(self.settle_scheduled(entity), f"settle {entity.id}")

    async def run(self) -> None:
        """Fire every due task, then sleep until the next due time or a change: no polling."""
        await self._resume_scheduled()
        while not self.orch.stopping:
            await self.scheduler_pass()
            self._schedule_wake.clear()  # after the pass: a change from now on wakes it
            due = self._store.next_due_at()
            timeout = None if due is None else max(0.0, epoch_of(due) - self._wall())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._schedule_wake.wait(), timeout)

    async def scheduler_pass(self) -> None:
        """Fire every task due now. Tests that move the clock call it too, to know what did, and
        did not, fire: a fire the loop makes at the same time is the same command."""
        for task in self._store.due_tasks(iso_time(self._wall())):
            try:
                await self.fire(task["id"], trigger="scheduled", due_at=task["nextRunAt"])
            except CommandRejected as exc:  # changed meanwhile: the next pass sees how
                log.debug("scheduled task %s not fired: %s", task["id"], exc)
        self._schedule_wake.set()  # the loop aims again from the moved clock

    async def fire(self, task_id: str, *, trigger: str, due_at: str | None = None) -> None:
        """Fire a task once: the command id is the fire key (the task, the due time and the
        trigger), so a fire is recorded at most once, however often it is asked for."""
        stamp = str(int(epoch_of(due_at or iso_time(self._wall())) * 1000))
        await self.orch.dispatch(FireScheduledTask(
            command_id=bounded_id(f"scheduled-task:{task_id}:{stamp}:{trigger}"),
            thread_id=task_id, trigger=trigger, due_at=due_at))

    async def run_scheduled(self, task_id: str, fire_key: str, prompt: str) -> None:
        """A fire's run: queued in the bound thread behind its running turn (steering could
        restart that turn, and a fire from a tool call in it would lose the call's result), or
        a fresh thread with the task's provider and modes. Every id derives from the fire key,
        so a replay after a crash finds what it already did."""
        state = await self.orch.state(task_id)
        task = state.entities["scheduled-task"].get(task_id) if state else None
        if task is None or task.last_fire_key != fire_key:
            return  # a later fire replaced it
        made = {"command_id": bounded_id(f"command:{fire_key}"),
                "message_id": bounded_id(f"message:{fire_key}"),
                "created_by": Actor.SYSTEM, "creation_source": CreationSource.SERVER}
        selection = task.model_selection
        try:
            if task.bound_thread_id:
                thread_id = task.bound_thread_id
                sent = await self.toolkit.send(thread_id, text=prompt, mode="queue", **made)
                run_id = sent["runId"]
            else:
                thread_id = bounded_id(f"thread:{fire_key}")
                created = await self.orch.dispatch(self.toolkit.plan_create(
                    thread_id=thread_id, project_id=task.project_id, workspace=task.workspace,
                    caller=None, entry={
                        "prompt": prompt, "title": task.title, "target": {
                            "providerInstanceId": selection.get("instanceId"),
                            **({"model": selection["model"]} if selection.get("model") else {})},
                        "runtimeMode": task.runtime_mode,
                        "interactionMode": task.interaction_mode}, **made))
                run_id = created.result["runId"]
        except T3Error as exc:
            await self._settle(task_id, fire_key, "failed", error=str(exc))
            return
        await self._settle(task_id, fire_key, "running", run_thread_id=thread_id, run_id=run_id)
        self._scheduled_runs[run_id] = (task_id, fire_key)
        run = (await self.toolkit.thread(thread_id)).run(run_id)
        if run is not None and run.status in RUN_TERMINAL:  # it ended before we watched
            await self.settle_scheduled(run)

    async def settle_scheduled(self, run: Run, *, reason: str | None = None) -> None:
        """A fired run ended: the task's last run succeeded, or failed with ``reason`` (else
        the run's own)."""
        task_id, fire_key = self._scheduled_runs.pop(run.id, (None, None))
        if task_id is None or fire_key is None:
            return
        failed = run.status != RunStatus.COMPLETED
        await self._settle(task_id, fire_key, "failed" if failed else "succeeded", error=(
            reason or run.status_reason or f"The run ended {run.status}.") if failed else None)

    async def _settle(self, task_id: str, fire_key: str, status: str, **fields: Any) -> None:
        await self.orch.try_dispatch(SettleScheduledRun(
            command_id=bounded_id(f"command:settle:{fire_key}:{status}"), thread_id=task_id,
            fire_key=fire_key, status=status, **fields), f"scheduled task {task_id}")

    async def _resume_scheduled(self) -> None:
        """After a restart: a fired run that ended meanwhile is settled, a running one watched; a
        fire whose run had not started finishes through its outbox row (replay-safe)."""
        for task in self._store.scheduled_tasks():
            if task["lastRunStatus"] != "running" or not task.get("lastRunId"):
                continue
            task_id, fire_key = task["id"], task["lastFireKey"]
            try:
                thread = await self.orch.state(task["lastRunThreadId"])
                run = thread.run(task["lastRunId"]) if thread else None
                if run is None:
                    await self._settle(task_id, fire_key, "failed", error=_RESTARTED)
                    continue
                self._scheduled_runs[run.id] = (task_id, fire_key)
                if run.status in RUN_TERMINAL:
                    await self.settle_scheduled(run, reason=_RESTARTED)
            except Exception as exc:  # one task's state never stops the scheduler
                log.error("recovery of scheduled task %s failed: %s", task_id, exc,
                          exc_info=exc)

    async def webhook_task(self, task_id: str) -> ScheduledTask | None:
        """The webhook task with this id, unless deleted (t3.py checks the hook token on it)."""
        state = await self.orch.state(task_id)
        task = state.entities["scheduled-task"].get(task_id) if state else None
        return task if _is_hook(task) else None

    async def receive_webhook(self, task_id: str, request: WebhookRequest) -> Mapping[str, Any]:
        """A delivery whose token t3.py checked: signature (``invalid_signature``), nesting
        (``invalid_request``), rate (``RateLimited``), then its record (``hook_disabled``,
        ``queue_full`` or an outcome), answered once committed. Refusals write nothing and take
        no place in the rate."""
        task = await self.webhook_task(task_id)
        if task is None:
            raise T3Error("No webhook at this address.", code="hook_not_found")
        if not signature_valid(task.schedule, request):
            raise T3Error("The signature does not match: no HMAC-SHA256 of the delivery under "
                          "the task's secret.", code="invalid_signature")
        if json_too_deep(request.body.decode("utf-8", "replace")):
            raise T3Error(f"The body nests deeper than {MAX_JSON_DEPTH} levels.",
                          code="invalid_request")
        self._admit_delivery(task_id)
        command = ReceiveWebhookDelivery(
            command_id=self._delivery_command_id(task, request), thread_id=task_id,
            delivery_id=self.orch.new_id("webhook-delivery"), request=request,
            delivery_key=delivery_key(task.schedule, request),
            body_excerpt=delivery_excerpt(task.schedule, request.body, self._redact))
        result = await self.orch.dispatch(command)
        if result.replayed:  # this delivery came before: log the copy as its duplicate
            result = await self.orch.dispatch(replace(
                command, command_id=self.orch.new_id("webhook"),
                duplicate_of=result.result["deliveryId"]))
        log.info("webhook delivery %s to scheduled task %s: %s", result.result["deliveryId"],
                 task_id, result.result["outcome"])
        return {k: result.result[k] for k in ("deliveryId", "outcome")}

    def _delivery_command_id(self, task: ScheduledTask, request: WebhookRequest) -> str:
        """``webhook:<task>:<replay key>``: a copy meets that receipt and is a duplicate. A signed
        copy is one for twice ``maxDeliveryAgeMinutes`` after the first (forever without it), as
        long as the first's stamp (which may be that far ahead or behind) keeps a copy from
        expiring; after that the same content counts anew under the next id (``:<n>``)."""
        key = replay_key(task.schedule, request)
        if key is None:
            return self.orch.new_id("webhook")
        command_id, n = bounded_id(f"webhook:{task.id}:{key}"), 0
        window = task.schedule.get("maxDeliveryAgeMinutes")
        while key.startswith("signed:") and window is not None and \
                (seen := self._store.receipt(command_id)) is not None and \
                epoch_of(seen.result.get("receivedAt") or iso_time(0)) <= \
                self._wall() - 2 * window * 60:
            n += 1
            command_id = bounded_id(f"webhook:{task.id}:{key}:{n}")
        return command_id

    def _admit_delivery(self, task_id: str) -> None:
        """At most HOOK_DELIVERIES_PER_MINUTE per hook in any 60 s, kept in memory (a restart
        forgets it); refused requests do not count, so a sender that backs off gets through."""
        now = self._wall()
        hits = self._hook_hits.setdefault(task_id, collections.deque())
        while hits and hits[0] <= now - 60:
            hits.popleft()
        if len(hits) >= HOOK_DELIVERIES_PER_MINUTE:
            raise RateLimited(f"This hook takes at most {HOOK_DELIVERIES_PER_MINUTE} deliveries "
                              "a minute.", retry_after_s=max(1, math.ceil(hits[0] + 60 - now)))
        hits.append(now)


EFFECTS["scheduled-task.run"] = EffectKind(lambda o, row: o.part(Scheduler).run_scheduled(
    row.thread_id, row.payload["fireKey"], row.payload["prompt"]), replay_safe=True)


# =============================================================================================
# Operations: schedule_task, list_scheduled_tasks, delete_scheduled_task (MCP and /ws) and /ws
# listWebhookDeliveries, registered into tools.OPERATIONS


_SCHEDULE_RESULT = {
    "scheduledTaskId": STRING, "title": STRING, "prompt": STRING, "enabled": BOOLEAN,
    "projectId": STRING, "boundThreadId": OPT_STRING, "schedule": {"type": "object"},
    "nextRunAt": OPT_STRING, "lastRunAt": OPT_STRING,
    "lastRunStatus": enum_of(sorted(SCHEDULE_RUN_STATUSES)), "lastRunError": OPT_STRING,
    "lastRunThreadId": OPT_STRING, "lastRunId": OPT_STRING, "runCount": INTEGER,
    "providerInstanceId": OPT_STRING, "model": OPT_STRING, "runtimeMode": RUNTIME,
    "interactionMode": INTERACTION, "createdBy": ACTOR, "creationSource": SOURCE,
    "createdAt": STRING, "updatedAt": STRING, "hookUrl": STRING, "hookNote": STRING,
    "deliveries": list_of({"type": "object"})}
_SUMMARY_EXTRAS = ("hookUrl", "hookNote", "deliveries")  # only where they apply
SCHEDULE_OUTPUT = shape(_SCHEDULE_RESULT, optional=list(_SUMMARY_EXTRAS))
LIST_SCHEDULES_OUTPUT = shape({"tasks": list_of(SCHEDULE_OUTPUT)})
DELETE_SCHEDULE_OUTPUT = shape({"scheduledTaskId": STRING, "deleted": BOOLEAN})


async def _schedule_task(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """schedule_task and /ws scheduleTask: make a task (``call.made_by`` is its maker), or
    change the one ``scheduledTaskId`` names."""
    scope = call.scope
    caller = (await kit.agent_caller(scope, "schedule_task"))[0] \
        if scope.kind == "thread" else None
    schedule = validate_schedule(args["schedule"]) if "schedule" in args else None
    limit = kit.ctx.min_agent_task_interval_s
    if caller is not None and schedule is not None and schedule["type"] == "interval" and \
            schedule["everyMs"] < limit * 1000:
        raise T3Error(f"schedule.everyMs: an agent's task runs at most every {limit} s, "
                      f"min_agent_task_interval_s = {limit} ([limits] in t3.toml)",
                      code="capability_denied")
    if "scheduledTaskId" in args:
        task = await _visible_task(kit, scope, caller, args["scheduledTaskId"], changing=True)
        if caller is not None:
            _agent_may_change(caller, task, args, schedule)
        fields, token = _run_settings(kit, caller, args, schedule, task.project_id, task)
        command = UpsertScheduledTask(
            command_id=kit.derive_id("command", call.source, scope.key, "schedule-task-update",
                                     task.id, kit.key(args)),
            thread_id=task.id, title=args.get("title"), prompt=args.get("prompt"),
            enabled=args.get("enabled"), **fields)
        await kit.orch.dispatch(command)
    else:
        _require(schedule is not None and "prompt" in args, "prompt", "a new scheduled task "
                 "needs a prompt and a schedule (or give scheduledTaskId to change one)")
        home = caller.thread.project_id if caller and caller.thread else None
        if caller is not None and (home == kit.ctx.scratch_project.id
                                   or args.get("projectId", home) != home):
            raise T3Error("projectId: an agent schedules tasks only in its own thread's project "
                          f"({home}, not a scratch folder)", code="capability_denied")
        project = kit.ctx.project(home or args.get("projectId"))
        fields, token = _run_settings(kit, caller, args, schedule, project.id)
        retry = (call.source, scope.key, "schedule-task", kit.key(args))
        command = UpsertScheduledTask(
            command_id=kit.derive_id("command", *retry),
            thread_id=kit.derive_id("scheduled-task", *retry),
            title=thread_title(args.get("title"), args["prompt"], "Scheduled task"),
            prompt=args["prompt"], enabled=args.get("enabled", True), project_id=project.id,
            workspace=project.path, creator_thread_id=scope.thread_id, **fields,
            **call.made_by)
        async with kit.orch.part(Scheduler).making_task:
            _within_task_cap(kit, caller, command)
            await kit.orch.dispatch(command)
    if args.get("runNow"):
        await kit.orch.part(Scheduler).fire(command.thread_id, trigger="manual")
    task = await _visible_task(kit, scope, caller, command.thread_id)
    return _task_summary(kit, task, hook_token=token)


def _run_settings(kit: Toolkit, caller: ThreadState | None, args: Args,
                  schedule: dict[str, Any] | None, project_id: str,
                  task: ScheduledTask | None = None) -> tuple[dict[str, Any], str | None]:
    """The UpsertScheduledTask fields a new task and a change to ``task`` share (a change's
    only as given), and the hook token minted for a person: shown once, only its hash kept."""
    here = caller is not None and caller.thread is not None and \
        caller.thread.project_id == project_id
    bind = args.get("bindToCurrentThread", here if task is None else None)
    _require(here or not bind, "bindToCurrentThread", f"needs a calling thread in project "
             f"{project_id}" + (" (the client token has none)" if task is None else ""))
    selection = task.model_selection if task is not None else None
    if task is None or "target" in args:
        info, model = kit.resolve_target(args.get("target"), caller)
        selection = {"instanceId": info.instance_id, "model": model}
    runtime = interaction = None
    if task is None or "runtimeMode" in args or "interactionMode" in args:
        kept = {"runtimeMode": task.runtime_mode, "interactionMode": task.interaction_mode} \
            if task is not None else {}
        runtime, interaction = kit.modes({**kept, **args}, caller)
    # An agent never holds a hook's token: a person mints its URL (_task_summary's hookNote).
    webhook = schedule is not None and schedule["type"] == "webhook"
    mint = caller is None and (webhook and (task is None or task.hook_token_sha256 is None)
                               or task is not None and bool(args.get("rotateHookToken")))
    token = secrets.token_urlsafe(32) if mint else None
    return {"schedule": schedule, "bind": bind, "model_selection": selection,
            "bound_thread_id": caller.thread.id if bind and caller and caller.thread else None,
            "runtime_mode": runtime, "interaction_mode": interaction,
            "hook_token_sha256": hashlib.sha256(token.encode()).hexdigest() if token else None
            }, token


async def _visible_task(kit: Toolkit, scope: Scope, caller: ThreadState | None, task_id: str, *,
                        changing: bool = False) -> ScheduledTask:
    """A task the caller may see (an agent: its project's). To change one, an agent's modes
    must cover the task's runs (a bound task's: its thread's), else an approval-required
    agent could rewrite a full-access task's prompt and run it now."""
    state = await kit.orch.state(task_id)
    task = state.entities["scheduled-task"].get(task_id) if state else None
    if task is None or task.deleted_at is not None or (
            scope.kind == "thread" and (caller is None or caller.thread is None
                                        or caller.thread.project_id != task.project_id)):
        raise T3Error(f"no scheduled task {task_id} in your project", code="task_not_found")
    if changing and caller is not None and caller.thread is not None:
        bound = await kit.orch.state(task.bound_thread_id) if task.bound_thread_id else None
        runs_as = bound.thread if bound is not None and bound.thread is not None else task
        try:
            kit.ceiling(caller.thread, runs_as.runtime_mode, runs_as.interaction_mode)
        except T3Error as exc:
            raise T3Error(f"scheduled task {task_id} runs in {runs_as.runtime_mode}/"
                          f"{runs_as.interaction_mode}, broader than your "
                          f"{caller.thread.runtime_mode}/{caller.thread.interaction_mode}: only "
                          "a caller with those modes (or the client) may change it",
                          code="capability_denied") from exc
    return task  # type: ignore[no-any-return]


def _agent_may_change(caller: ThreadState, task: ScheduledTask, args: Args,
                      schedule: dict[str, Any] | None) -> None:
    """An agent never holds a hook's token (a person rotates it), and changes a task's prompt or
    a webhook's schedule (signature, filters) only on a task its own thread made: else it could
    turn a person's signed hook into an unsigned one that runs its words."""
    assert caller.thread is not None
    if args.get("rotateHookToken"):
        raise T3Error("rotateHookToken: a person rotates a hook's token (python t3.py schedule "
                      "--id ID --rotate-hook-token, or /ws scheduleTask); an agent never holds "
                      "one", code="capability_denied")
    if task.creator_thread_id == caller.thread.id:
        return
    changed = "prompt" if args.get("prompt", task.prompt) != task.prompt else "schedule" if (
        schedule is not None and schedule != task.schedule
        and "webhook" in (schedule["type"], task.schedule["type"])) else None
    if changed is not None:
        maker = f"thread {task.creator_thread_id}" if task.creator_thread_id else "a person"
        raise T3Error(f"{changed}: scheduled task {task.id} was made by {maker}; an agent "
                      "changes the prompt, signature and filters only of tasks its thread made",
                      code="capability_denied")


def _within_task_cap(kit: Toolkit, caller: ThreadState | None,
                     command: UpsertScheduledTask) -> None:
    """An agent adds no task to a project that holds max_scheduled_tasks_per_project (a
    retry of one it made is no new task)."""
    cap, project = kit.ctx.max_scheduled_tasks_per_project, command.project_id
    if caller is None or kit.store.receipt(command.command_id) is not None:
        return
    if (held := sum(t["projectId"] == project for t in kit.store.scheduled_tasks())) >= cap:
        raise T3Error(f"project {project} holds {held} scheduled tasks, "
                      f"max_scheduled_tasks_per_project = {cap} ([limits] in t3.toml): delete "
                      "one first", code="capability_denied")


async def _list_schedules(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    scope = call.scope
    caller = await kit.caller_thread(scope)
    wanted = args.get("projectId")
    if scope.kind == "thread":
        home = caller.thread.project_id if caller and caller.thread else ""
        if wanted not in (None, home):
            raise T3Error(f"projectId: an agent lists only its own project's tasks ({home})",
                          code="capability_denied")
        wanted = home
    tasks = [ScheduledTask.from_json(t) for t in kit.store.scheduled_tasks()]
    return {"tasks": [_task_summary(kit, t, deliveries=args.get("includeDeliveries"))
                      for t in tasks if wanted in (None, t.project_id)
                      and args.get("scheduledTaskId") in (None, t.id)]}


async def _delete_schedule(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    scope = call.scope
    caller = (await kit.agent_caller(scope, "delete_scheduled_task"))[0] \
        if scope.kind == "thread" else None
    task = await _visible_task(kit, scope, caller, args["scheduledTaskId"], changing=True)
    await kit.orch.dispatch(DeleteScheduledTask(
        command_id=kit.derive_id("command", call.source, scope.key, "delete-scheduled-task",
                                 task.id), thread_id=task.id))
    return {"scheduledTaskId": task.id, "deleted": True}


async def _webhook_deliveries(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """A webhook task's kept deliveries, newest first, as recorded (secrets redacted)."""
    task_id = args["scheduledTaskId"]
    if await kit.orch.part(Scheduler).webhook_task(task_id) is None:
        raise T3Error(f"no webhook task {task_id}", code="task_not_found")
    return {"scheduledTaskId": task_id, "deliveries": kit.store.deliveries(task_id)}


def _task_summary(kit: Toolkit, task: ScheduledTask, *, hook_token: str | None = None,
                  deliveries: bool = False) -> dict[str, Any]:
    """A task as results show it: its fields, the signature's secret left out (it is
    write-only), and its hook URL once, when a token was just minted."""
    schedule = dict(task.schedule)
    if isinstance(schedule.get("signature"), Mapping):
        schedule["signature"] = {k: v for k, v in schedule["signature"].items()
                                 if k != "secret"}
    row = {**task.to_json(), "scheduledTaskId": task.id, "schedule": schedule,
           "providerInstanceId": task.model_selection.get("instanceId"),
           "model": task.model_selection.get("model")}
    summary = {key: row[key] for key in _SCHEDULE_RESULT if key not in _SUMMARY_EXTRAS}
    if hook_token is not None:
        # The id may hold a % (clientRequestId is quoted into it): quote it once more.
        summary["hookUrl"] = (f"{kit.ctx.base_url}/hooks/"
                              f"{urllib.parse.quote(task.id, safe=':~')}/{hook_token}")
    elif task.schedule.get("type") == "webhook" and not task.hook_token_sha256:
        summary["hookNote"] = (
            "This hook has no URL yet: a person makes one, shown to them once, with "
            f"`python t3.py schedule --id {task.id} --rotate-hook-token` (or /ws "
            "scheduleTask with rotateHookToken).")
    if deliveries and task.schedule.get("type") == "webhook":
        summary["deliveries"] = kit.store.deliveries(task.id)
    return summary


register(
    Operation(
        "schedule_task",
        "Schedule recurring work that runs without an active turn, or change a scheduled task "
        "(pass scheduledTaskId; fields left out stay). schedule is an object: {type: "
        "'interval', everyMs} (at least 60000), {type: 'fixed_time', timeOfDay: 'HH:MM', "
        "weekdays?: [0-6, 0 = Sunday]} in the server's local time, or {type: 'webhook', "
        "signature?: {header, secret, prefix?}, filters?: [{path, equals}], "
        "maxDeliveryAgeMinutes?, deliveryIdHeader?, timestampHeader?} (signature may also be "
        "{scheme: 'standard-webhooks', secret: 'whsec_...'}; a person mints the hook's URL, "
        "see the result's hookNote; the prompt is then a template filled from each delivery: "
        "{{body.a.b}}, {{headers.name}}, {{query.name}}, {{body}}). By default "
        "each run posts into this thread; bindToCurrentThread false launches a fresh thread "
        "per run. Provider, model and modes inherit (never broader than yours). enabled "
        "false pauses; runNow fires once now.",
        obj({"scheduledTaskId": text_field(512), "prompt": text_field(120_000),
             "schedule": {"anyOf": [{"type": "object"}, {"type": "string"}]},
             "title": TITLE, "enabled": {"type": "boolean"},
             "bindToCurrentThread": {"type": "boolean"}, "projectId": text_field(256),
             "target": TARGET, "runtimeMode": RUNTIME_INPUT,
             "interactionMode": INTERACTION_INPUT, "runNow": {"type": "boolean"},
             "rotateHookToken": {"type": "boolean"},
             "clientRequestId": CLIENT_REQUEST_ID}),
        _schedule_task, SCHEDULE_OUTPUT, ws=("scheduleTask",), destructive=True),
    Operation(
        "list_scheduled_tasks",
        "List scheduled tasks (an agent sees its project's), with their next and last runs; "
        "includeDeliveries adds a webhook task's newest deliveries.",
        obj({"scheduledTaskId": text_field(512), "projectId": text_field(256),
             "includeDeliveries": {"type": "boolean"}}),
        _list_schedules, LIST_SCHEDULES_OUTPUT, ws=("listScheduledTasks",),
        read_only=True),
    Operation(
        "delete_scheduled_task", "Delete a scheduled task for good.",
        obj({"scheduledTaskId": text_field(512)}, ["scheduledTaskId"]),
        _delete_schedule, DELETE_SCHEDULE_OUTPUT, ws=("deleteScheduledTask",),
        destructive=True),
    Operation("listWebhookDeliveries", "A webhook task's kept deliveries, newest first.",
              obj({"scheduledTaskId": text_field(512)}, ["scheduledTaskId"]),
              _webhook_deliveries, OBJECT, callers=CLIENT, ws=("listWebhookDeliveries",),
              mcp=False))
