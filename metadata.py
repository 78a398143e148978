"""metadata.py: a thread's title and pull request link, a feature an auditor of the core may skip.

``t3_thread_update`` renames a thread or has its own provider suggest a title from its first
message (``regenerate_title``); ``link_pull_request`` and ``unlink_pull_request`` set or clear the
pull request a thread works on. Only a person's client, the thread's own agent, or an agent with
a live run and modes no broader than the thread's may change a thread's metadata (the core's
``Toolkit.require_live_caller``). A regeneration runs on a lane of its own, so a slow provider
never holds up turns, and applies only while its marker is current: a later rename, archive or
delete wins. Its provider session is a one-shot one with no history, no t3 tools and the
narrowest modes the provider offers. The core never imports this module; t3.py does (FEATURES).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from orchestrator import (EFFECTS, RUNTIME_RANK, AppThread, Command, Draft, EffectKind,
                          InteractionMode, Orchestrator, RuntimeMode, RuntimeRequestOpened,
                          T3Error, TextDelta, TurnEnded, bounded_id, decides, thread_title)
from tools import (CLIENT_REQUEST_ID, INTEGER, PULL_REQUEST, STRING, THREAD_ID, TITLE,
                   TITLE_REGENERATION, Args, Call, Operation, Toolkit, enum_of, obj, register,
                   shape, text_field)

__all__ = ["METADATA_ACTIONS", "UpdateThreadMetadata", "CompleteTitleRegeneration"]

log = logging.getLogger("t3.metadata")


METADATA_ACTIONS = ("rename", "regenerate_title", "link_pull_request", "unlink_pull_request")
TITLE_TIMEOUT_S = 60.0
TITLE_PROMPT = ("<t3_title_request>\nReply with only a short title (at most 8 words, no quotes) "
                "for a conversation that begins with this message:\n\n{text}\n"
                "</t3_title_request>")


@dataclass(frozen=True, slots=True)
class UpdateThreadMetadata(Command):
    type: ClassVar[str] = "thread.metadata.update"
    action: str  # METADATA_ACTIONS
    title: str | None = None  # rename only
    pull_request: Mapping[str, Any] | None = None  # link_pull_request only

    def __post_init__(self) -> None:
        if self.action not in METADATA_ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")
        if (self.action == "rename") != bool(self.title):
            raise ValueError("title: rename needs one, other actions take none")
        if (self.action == "link_pull_request") != (self.pull_request is not None):
            raise ValueError("pullRequest: link_pull_request needs one, other actions none")


@dataclass(frozen=True, slots=True)
class CompleteTitleRegeneration(Command):
    """The title effect's answer: applied only if ``request_id`` is still the marker."""

    type: ClassVar[str] = "thread.title.regeneration.complete"
    request_id: str
    title: str


def metadata_result(thread: AppThread, action: str, command_id: str) -> dict[str, Any]:
    return {"threadId": thread.id, "action": action, "commandId": command_id,
            "title": thread.title, "titleRegeneration": thread.title_regeneration,
            "linkedPullRequest": thread.linked_pull_request, "updatedAt": thread.updated_at}


@decides(UpdateThreadMetadata)
def _decide_metadata(d: Draft, c: UpdateThreadMetadata, **_: Any) -> Mapping[str, Any]:
    thread = d.thread
    assert thread is not None
    changed: dict[str, Any] = {
        "rename": {"title": c.title, "title_regeneration": None},
        "regenerate_title": {"title_regeneration": {"requestId": c.command_id,
                                                    "startedAt": d.now}},
        "link_pull_request": {"linked_pull_request": dict(c.pull_request or {})},
        "unlink_pull_request": {"linked_pull_request": None}}[c.action]
    thread = d.put(replace(thread, **changed, updated_at=d.now), "thread.metadata-updated")
    if c.action == "regenerate_title":
        d.effect("thread-title.generate", {"threadId": thread.id, "requestId": c.command_id},
                 c.command_id, thread_id=bounded_id(f"title-lane:{thread.id}"))
    return metadata_result(thread, c.action, c.command_id)


@decides(CompleteTitleRegeneration)
def _decide_title_complete(d: Draft, c: CompleteTitleRegeneration, **_: Any
                           ) -> Mapping[str, Any]:
    thread = d.thread
    assert thread is not None
    if (thread.title_regeneration or {}).get("requestId") == c.request_id:
        thread = d.put(replace(thread, title=c.title, title_regeneration=None, updated_at=d.now),
                       "thread.metadata-updated")
    return metadata_result(thread, "regenerate_title", c.request_id)


def _title_of(reply: str) -> str | None:
    line = next((s for s in (raw.strip(" \t\"'`*#") for raw in reply.splitlines()) if s), "")
    return thread_title(None, line, "") or None


async def _regenerate_title(o: Orchestrator, thread_id: str, request_id: str) -> None:
    """Ask the thread's provider for a title, else take its first message's first 80
    characters; skipped once a rename, another regeneration, archive or delete made this request
    stale."""
    state = await o.state(thread_id)
    thread = state.thread if state else None
    if state is None or thread is None or thread.deleted_at is not None or \
            (thread.title_regeneration or {}).get("requestId") != request_id:
        return
    first = state.runs[0] if state.runs else None
    prompt = getattr(state.entities["message"].get(first.user_message_id), "text", None) \
        if first else None
    title = (await _ask_title(o, thread, prompt) if prompt else None) \
        or thread_title(None, prompt, thread.title)
    await o.dispatch(CompleteTitleRegeneration(
        command_id=bounded_id(f"command:title:{request_id}"), thread_id=thread_id,
        request_id=request_id, title=title))


async def _ask_title(o: Orchestrator, thread: AppThread, text: str) -> str | None:
    """A one-shot session of the thread's provider (no history, no t3 tools, the narrowest
    modes it offers) answers TITLE_PROMPT; None if it cannot within TITLE_TIMEOUT_S."""
    adapter = o.adapters.get(thread.provider_instance_id)
    if adapter is None or not adapter.info.available:
        return None
    narrowest = min(adapter.info.runtime_modes or list(RuntimeMode), key=RUNTIME_RANK.get)
    handle, parts = None, []
    try:
        async with asyncio.timeout(TITLE_TIMEOUT_S):
            handle = await adapter.open_session(
                session_id=o.new_id("provider-session"), thread_id=thread.id,
                cwd=thread.workspace or os.getcwd(),
                model=thread.model_selection.get("model"), runtime_mode=narrowest,
                interaction_mode=InteractionMode.PLAN, resume_ref=None, mcp=None)
            await handle.start_turn(TITLE_PROMPT.format(text=text[:2000]))
            while (event := await handle.events.get()) is not None:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, (TurnEnded, RuntimeRequestOpened)):
                    break
            if not isinstance(event, TurnEnded) or event.status != "completed":
                return None
    except Exception as exc:  # any failure of the provider: the fallback title
        log.info("no title from %s: %s", thread.provider_instance_id, exc)
        return None
    finally:
        if handle is not None:
            await handle.close()
    return _title_of("".join(parts))


# each step of it is idempotent
EFFECTS["thread-title.generate"] = EffectKind(lambda o, row: _regenerate_title(
    o, row.payload["threadId"], row.payload["requestId"]), replay_safe=True)


# =============================================================================================
# Operations: t3_thread_update, link_pull_request, unlink_pull_request (MCP and /ws)


UPDATE_OUTPUT = shape({"threadId": STRING, "action": enum_of(METADATA_ACTIONS),
                       "commandId": STRING, "sequence": INTEGER, "title": STRING,
                       "titleRegeneration": TITLE_REGENERATION,
                       "linkedPullRequest": PULL_REQUEST, "updatedAt": STRING})
_OWN_THREAD = {"threadId": THREAD_ID, "clientRequestId": CLIENT_REQUEST_ID}


async def _update_thread(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    if (args["action"] == "rename") != ("title" in args):
        raise T3Error("title: required for rename, refused for "
                      "regenerate_title", code="invalid_request")
    return await _change_metadata(kit, call, args, args["action"], title=args.get("title"))


async def _link_pull_request(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    return await _change_metadata(kit, call, args, "link_pull_request",
                                  pull_request=_pull_request(args["url"]))


async def _unlink_pull_request(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    return await _change_metadata(kit, call, args, "unlink_pull_request")


async def _change_metadata(kit: Toolkit, call: Call, args: Args, action: str,
                           **change: Any) -> dict[str, Any]:
    """One metadata action on the target thread (default: the caller's). Another thread
    takes the caller's live run and may not have broader modes (as t3_thread_send)."""
    scope = call.scope
    thread_id = args.get("threadId") or kit.thread_caller(scope, f"{action} without "
                                                          "threadId")
    await kit.require_live_caller(scope, await kit.thread(thread_id), action)
    command = UpdateThreadMetadata(
        command_id=kit.derive_id("command", call.space, scope.key, "thread-update", action,
                                 thread_id, kit.key(args)),
        thread_id=thread_id, action=action, **change)
    result = await kit.orch.dispatch(command)
    return {**result.result, "sequence": result.sequence}


# Only https, an ASCII host with no user info before it (``https://github.com@evil.example/``
# goes to evil.example) and ASCII names: what a person reads is where the link goes.
_PULL_REQUEST_URL = re.compile(r"https://[A-Za-z0-9.-]+(?::\d{1,5})?/([\w.~%+-]+/[\w.~%+-]+)/"
                               r"(?:pull|pulls|-/merge_requests)/(\d{1,9})/?", re.ASCII)


def _pull_request(url: str) -> dict[str, Any]:
    """A pull (or merge) request's URL as {repository, number, url}; anything else is refused."""
    match = _PULL_REQUEST_URL.fullmatch(url)
    if match is None:
        raise T3Error("url: not a pull request URL (expected https://"
                      "host/owner/repo/pull/NUMBER: an ASCII host, no "
                      "user info, no control characters)", code="invalid_request")
    return {"repository": match[1], "number": int(match[2]), "url": url}


register(
    Operation(
        "t3_thread_update",
        "Update a thread's metadata (threadId, else your own thread): action 'rename' with "
        "title, or 'regenerate_title' (no title: the thread's provider suggests one from the "
        "first message, shown as titleRegeneration until it lands). Reuse clientRequestId "
        "when retrying.",
        obj({**_OWN_THREAD, "action": {"type": "string",
                                       "enum": ["rename", "regenerate_title"]},
             "title": TITLE}, ["action"]),
        _update_thread, UPDATE_OUTPUT, ws=("updateThread",), destructive=True),
    Operation(
        "link_pull_request",
        "Link a pull request to a thread (threadId, else your own): its https URL, like "
        "https://github.com/owner/repo/pull/123. Replaces an earlier link.",
        obj({**_OWN_THREAD, "url": text_field(2048)}, ["url"]), _link_pull_request,
        UPDATE_OUTPUT, ws=("linkPullRequest",), destructive=True),
    Operation(
        "unlink_pull_request", "Remove a thread's pull request link (threadId, else your own).",
        obj(_OWN_THREAD), _unlink_pull_request, UPDATE_OUTPUT,
        ws=("unlinkPullRequest",), destructive=True))
