"""history.py: a thread's history: context handoffs, checkpoints, forks, merge-backs, rollbacks
and diffs, a feature an auditor of the core may skip.

A context handoff is a summary of a thread's runs for a provider that missed them: after a
provider switch or a resume that failed, at a fork's first run, at a parent's run after a
merge-back. A checkpoint is the workspace as a hidden git ref, captured before a thread's first
run and at each run's end. A fork (``thread.fork``, /ws forkThread) continues a thread's
conversation from a completed run in a new thread; a merge-back (``thread.merge_back``, /ws
mergeBack) hands a fork's runs to its parent's next run; a rollback (``checkpoint.rollback``, /ws
rollbackThread or dispatchCommand) puts a thread's files back to a checkpoint and its later runs
``rolled_back``; a diff (``t3_thread_diff``, /ws getTurnDiff and getFullThreadDiff) compares two
checkpoints. The commands are decided here as the core's are (pure, with
``orchestrator.decides``), a restore and a deleted thread's refs are replay-safe outbox effects
(``EFFECTS``), handoffs and checkpoints reach the core's runs through ``RUN_HOOKS``, and the
operations join tools.OPERATIONS. The core never imports this module; t3.py does (FEATURES),
before it serves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, cast

from orchestrator import (EFFECTS, RUN_BLOCKING, RUN_HOOKS, RUN_TERMINAL, Actor, Command,
                          CommandRejected, ContextTransfer, CreateThread, Draft, EffectKind,
                          Entity, MarkRunStarted, Orchestrator, ProviderAdapter, ProviderInfo,
                          ProviderThread, Run, RunHooks, RunStatus, T3Error, ThreadState,
                          TurnItem, Workspaces, bounded_id, decide_create_thread, decides,
                          put_item, register_entities, sendable, thread_work)
from tools import (BOOLEAN, CLIENT_REQUEST_ID, INTEGER, OPT_INTEGER, OPT_STRING, SEED_TITLE,
                   STRING, THREAD_ID, Args, Call, Operation, Toolkit, enum_of, list_of,
                   new_worktree, obj, register, register_wire, shape, text_field, ws_op)

__all__ = ["Checkpoint", "ForkThread", "MergeBack", "RollbackThread", "FinishRollback", "MERGE_BACK_LABEL",
           "fork_transfer_id", "merge_back_head", "kept_turns", "describe_handoff", "put_handoff",
           "handoff_line", "handoff_text", "HANDOFF_BUDGET", "checkpoint_id",
           "checkpoint_scope_id", "kept_before", "file_changes", "ContextHandoff", "handoff_prompt"]

log = logging.getLogger("t3.history")


# =============================================================================================
# Context handoffs. A run on a provider thread that missed earlier runs (it never took part, or
# could not resume its conversation) carries a ContextHandoff with a turn item: a deterministic
# summary of what it missed, which ``handoff_prompt`` puts before the user's text in the run's
# first prompt (RunHooks.prompt). A fork's first run and a parent's run after a merge-back carry
# theirs the same way.

HANDOFF_BUDGET = 32_000  # characters of summary; the newest context is kept when cut
HANDOFF_LINE = 240  # characters of one item line
_HANDOFF_HEADERS = {
    "full_thread_summary": "Full conversation context for provider handoff.",
    "delta_since_target_last_seen": "Conversation delta since this provider last participated."}


@dataclass(frozen=True, slots=True)
class ContextHandoff(Entity):
    """The context a provider got when it joined a thread's conversation late: after a
    provider switch (the delta since it last took part, or the whole thread) or after a resume
    that failed (the whole thread), or from a fork or a merge-back. Deterministic text, no
    model call."""

    kind: ClassVar[str] = "context-handoff"
    thread_id: str
    target_run_id: str
    from_provider_thread_ids: Sequence[str]
    to_provider_thread_id: str
    covered_run_ordinals: Mapping[str, int]  # {"from": a, "to": b}
    strategy: str  # full_thread_summary | delta_since_target_last_seen
    status: str  # consumed: it went out with the run's first prompt
    summary_text: str
    created_at: str
    updated_at: str
    created_by_provider_instance_id: str | None = None


register_entities(ContextHandoff)


def handoff_prompt(text: str, *handoffs: ContextHandoff | None) -> str:
    """What the provider is sent: the handoffs before the user's text."""
    given = [h for h in handoffs if h is not None]
    if not given:
        return text
    return "".join(f"Context handoff ({HANDOFF_LABELS.get(h.strategy, h.strategy)}):\n"
                   f"{h.summary_text}\n\n" for h in given) + f"User message:\n{text}"


def _prompt(state: ThreadState, handoff_ids: Sequence[str], text: str) -> str:
    """RunHooks.prompt: the handoffs MarkRunStarted recorded for the run, then ``text``."""
    handoffs = state.entities["context-handoff"]
    return handoff_prompt(text, *(handoffs.get(h) for h in handoff_ids))


def _hand_off(d: Draft, run: Run, started: MarkRunStarted,
              providers: Mapping[str, ProviderInfo]) -> str | None:
    """RunHooks.context: a fork's first run's context (``_take_fork``), else the handoff ``run``
    needs on its provider thread, if any, recorded; its id. A provider thread that never took
    part or could not resume its conversation gets every earlier run; one coming back to its own
    conversation gets the runs since it last took part."""
    if (forked := _take_fork(d, run, started.native_fork)) is not None:
        return forked
    pthread = d.get("provider-thread", run.provider_thread_id)
    covered = [r for r in d.runs() if r.ordinal < run.ordinal and r.started_at is not None
               and r.status != RunStatus.ROLLED_BACK]
    strategy = "full_thread_summary"
    if pthread is not None and not started.resume_failed and pthread.last_run_ordinal is not None:
        strategy = "delta_since_target_last_seen"
        covered = [r for r in covered if r.ordinal > pthread.last_run_ordinal]
    return put_handoff(d, run, describe_handoff(
        d, strategy, covered, run.provider_instance_id, providers)) if covered else None


def describe_handoff(d: Any, strategy: str, covered: Sequence[Run], to_instance: str,
                     providers: Mapping[str, ProviderInfo], head: Sequence[str] | None = None
                     ) -> dict[str, Any]:
    """What a handoff of ``covered`` (runs of the thread ``d`` holds: a Draft, or any view
    with its ``get``/``all``) to ``to_instance`` says and records (``put_handoff``)."""
    def driver(instance: str) -> str:
        return providers[instance].driver if instance in providers else instance
    instances = list(dict.fromkeys(r.provider_instance_id for r in covered))
    span = {"from": covered[0].ordinal, "to": covered[-1].ordinal}
    return {"strategy": strategy, "covered": span, "fromProviderInstanceIds": instances,
            "fromProviderThreadIds": list(dict.fromkeys(r.provider_thread_id or ""
                                                        for r in covered)),
            "fromModelSelections": [dict(r.model_selection) for r in covered],
            "summary": handoff_text(
                strategy=strategy, from_drivers=[driver(i) for i in instances],
                to_driver=driver(to_instance), covered=span, head=head,
                lines=_item_lines(d, {r.id for r in covered}))}


def put_handoff(d: Draft, run: Run, about: Mapping[str, Any], key: str = "") -> str:
    """The ContextHandoff ``describe_handoff`` described, for ``run``, and its turn item."""
    strategy, froms, instances = (about["strategy"], about["fromProviderThreadIds"],
                                  about["fromProviderInstanceIds"])
    handoff = d.put(ContextHandoff(
        id=bounded_id(f"context-handoff:{run.id}{key}"), thread_id=run.thread_id,
        target_run_id=run.id, from_provider_thread_ids=froms,
        to_provider_thread_id=run.provider_thread_id or "", covered_run_ordinals=about["covered"],
        strategy=strategy, status="consumed", summary_text=about["summary"], created_at=d.now,
        updated_at=d.now, created_by_provider_instance_id=instances[-1]))
    put_item(
        d, bounded_id(f"turn-item:handoff:{run.id}{key}"), run, run.root_node_id, "handoff",
        "completed", title=f"{strategy} handoff to {run.provider_instance_id}",
        text=about["summary"], data={
            "contextHandoffId": handoff.id, "fromProviderThreadIds": froms,
            "toProviderThreadId": handoff.to_provider_thread_id,
            "fromProviderInstanceIds": instances, "toProviderInstanceId": run.provider_instance_id,
            "fromModelSelections": about["fromModelSelections"],
            "toModel": run.model_selection.get("model"), "strategy": strategy})
    return handoff.id


def _item_lines(d: Any, run_ids: set[str]) -> list[str]:
    """The covered runs' user-visible items as handoff lines, in timeline order."""
    lines = []
    for item in sorted(d.all("turn-item"), key=lambda i: i.position):
        if item.run_id not in run_ids:
            continue
        message = d.get("message", item.message_id)
        text = {"user_message": ("User", message.text if message else item.text),
                "assistant_message": ("Assistant", message.text if message else item.text),
                "tool_call": ("Command", item.title),
                "checkpoint": ("Checkpoint", f"{len((item.data or {}).get('files') or [])} files"),
                "handoff": ("Handoff", item.text or (item.data or {}).get("strategy"))
                }.get(item.type)
        if text is not None and text[1]:
            lines.append(handoff_line(*text))
    return lines


def handoff_line(label: str, text: str) -> str:
    """``- Label: text`` with whitespace collapsed, at most HANDOFF_LINE characters."""
    line = f"- {label}: {' '.join(text.split())}"
    return line if len(line) <= HANDOFF_LINE else line[:HANDOFF_LINE - 3] + "..."


def handoff_text(*, strategy: str, from_drivers: Sequence[str], to_driver: str,
                 covered: Mapping[str, int], lines: Sequence[str],
                 budget: int = HANDOFF_BUDGET, head: Sequence[str] | None = None) -> str:
    """The handoff summary, pure and deterministic; ``head``: the
    lines before the items, when not a provider handoff's. Over ``budget`` characters the
    oldest item lines go first, replaced by one line saying how many."""
    head = "\n".join(head or [
        _HANDOFF_HEADERS[strategy], f"From driver: {', '.join(from_drivers)}",
        f"To driver: {to_driver}", f"Covered app runs: {covered['from']}-{covered['to']}", "",
        "Canonical conversation context:"])
    items = list(lines) or ["- No user-visible context items."]
    room = budget - len(head) - 80  # 80: room for the line that says what was cut
    kept = 0
    while kept < len(items) and room >= len(items[-1 - kept]) + 1:
        room -= len(items[-1 - kept]) + 1
        kept += 1
    cut = [f"- ({len(items) - kept} earlier items omitted to fit the handoff budget.)"] \
        if kept < len(items) else []
    return "\n".join([head, *cut, *items[len(items) - kept:]])[:budget]


# =============================================================================================
# Checkpoints: the workspace as a hidden git ref (workspace.py) at one point of a thread, ordinal
# 0 before its first run (captured as the run starts), N after run N's root turn (captured by the
# ``run.finalize`` effect, recorded by CompleteRun with a ``checkpoint`` turn item). Outside git
# they are ``missing``; a git failure is ``error`` and the run goes on. A deleted thread's refs go
# with it (``checkpoint.forget``).


@dataclass(frozen=True, slots=True)
class Checkpoint(Entity):
    """``files``: the changes against the previous checkpoint: [{path, kind, additions,
    deletions}]."""

    kind: ClassVar[str] = "checkpoint"
    _checks: ClassVar[Mapping[str, frozenset[str]]] = {
        "status": frozenset({"ready", "missing", "error", "stale"})}
    thread_id: str
    scope_id: str
    run_id: str | None
    ordinal: int  # ordinalWithinScope = the app run ordinal (0: the thread's baseline)
    status: str  # ready | missing (not in a git repository) | error (git failed) | stale
    files: Sequence[Mapping[str, Any]]
    captured_at: str
    ref: str | None = None
    commit: str | None = None
    parent_checkpoint_id: str | None = None
    status_reason: str | None = None


register_entities(Checkpoint)


class _Git(Workspaces, Protocol):
    """What checkpoints, diffs and rollbacks ask of git (workspace.py) beside a launch's."""

    def checkpoint_ref(self, thread_id: str, ordinal: int | None) -> str: ...
    async def capture(self, cwd: str, ref: str) -> str | None: ...
    async def delete_ref(self, cwd: str, ref: str) -> None: ...
    async def ref_commit(self, cwd: str, ref: str) -> str | None: ...
    async def diff(self, cwd: str, before: str | None, after: str) -> Any: ...
    async def restore(self, cwd: str, commit: str) -> None: ...


def _git(o: Orchestrator) -> _Git | None:
    """The server's git, as t3.py handed it in (None: this server has no git workspaces)."""
    return cast("_Git | None", o.workspaces)


def checkpoint_scope_id(thread_id: str) -> str:
    return bounded_id(f"checkpoint-scope:thread:{thread_id}:name:root")


def checkpoint_id(thread_id: str, ordinal: int) -> str:
    return bounded_id(f"checkpoint:scope:{checkpoint_scope_id(thread_id)}:name:{ordinal}")


def kept_before(runs: Sequence[Run], ordinal: int) -> int:
    """The checkpoint ordinal a run's changes are measured from: the newest earlier run that
    was not rolled back (0: the thread's baseline)."""
    return max([r.ordinal for r in runs if r.ordinal < ordinal
                and r.status != RunStatus.ROLLED_BACK] + [0])


def file_changes(diff: Any) -> list[dict[str, Any]]:
    """A workspace Diff's files as checkpoints and diffs carry them."""
    return [{"path": f.path, "kind": f.kind, "additions": f.additions, "deletions": f.deletions}
            for f in diff.files]


def _record_checkpoints(d: Draft, run: Run, found: Sequence[Mapping[str, Any]]) -> str | None:
    """RunHooks.completed: the checkpoints a finalization captured (baselines first, the run's
    own last; ones the thread already has are kept), and the run's ``checkpoint`` turn item; the
    id of the last one recorded."""
    made = None
    for record in sorted(found, key=lambda r: r["ordinal"]):
        n = record["ordinal"]
        if d.get("checkpoint", checkpoint_id(run.thread_id, n)) is not None:
            continue
        made = d.put(Checkpoint(
            id=checkpoint_id(run.thread_id, n), thread_id=run.thread_id,
            scope_id=checkpoint_scope_id(run.thread_id), run_id=run.id if n == run.ordinal
            else None, ordinal=n, status=record["status"], files=record.get("files") or [],
            captured_at=d.now, ref=record.get("ref"), commit=record.get("commit"),
            parent_checkpoint_id=checkpoint_id(run.thread_id, kept_before(d.runs(), n))
            if n else None,
            status_reason=record.get("reason")), "checkpoint.captured")
    if made is None or made.ordinal != run.ordinal or made.status == "missing":
        return made.id if made else None  # outside git the timeline says nothing
    put_item(d, bounded_id(f"turn-item:checkpoint:{made.id}"), run, run.root_node_id,
             "checkpoint", "completed",
             title=f"Checkpoint {made.ordinal}: {len(made.files)} file(s) changed"
             if made.status == "ready" else f"Checkpoint {made.ordinal}: git failed",
             data={"checkpointId": made.id, "scopeId": made.scope_id, "status": made.status,
                   "files": made.files, "reason": made.status_reason})
    return made.id


def _forget_checkpoints(d: Draft) -> None:
    """RunHooks.deleted: a deleted thread's checkpoints' hidden refs go with it."""
    if d.thread is not None and d.thread.workspace:
        d.effect("checkpoint.forget", {"workspace": d.thread.workspace}, d.thread.id)


async def _capture_baseline(o: Orchestrator, state: ThreadState, run: Run) -> None:
    """RunHooks.started: before a run's first attempt, capture the ``kept_before`` checkpoint
    unless the thread has it ready. A git failure only loses the baseline; the turn goes on."""
    thread, ws = state.thread, _git(o)
    before = kept_before(state.runs, run.ordinal)
    previous = state.entities["checkpoint"].get(checkpoint_id(run.thread_id, before))
    attempt = state.entities["run-attempt"].get(run.active_attempt_id or "")
    if ws is None or thread is None or not thread.workspace or (
            previous is not None and previous.status == "ready") or (
            attempt is not None and attempt.attempt_ordinal > 1):
        return
    try:
        await ws.capture(thread.workspace, ws.checkpoint_ref(thread.id, before))
    except Exception as exc:
        log.warning("baseline checkpoint of %s not captured: %s", run.id, exc)


async def _capture_checkpoints(o: Orchestrator, state: ThreadState, run: Run
                               ) -> list[dict[str, Any]]:
    """RunHooks.finalize, for a finished root turn: the baselines 0 and ``kept_before`` the
    thread lacks (ready when their ref exists) and the run's own capture with its files; outside
    git all ``missing``, a git failure ``error``. A rerun only rewrites the ref."""
    thread, n, ws = state.thread, run.ordinal, _git(o)
    assert thread is not None
    have = {c.ordinal for c in state.entities["checkpoint"].values()}
    prev = kept_before(state.runs, n)  # n-1 unless runs were rolled back
    ordinals = [*sorted({0, prev} - have), n]
    cwd = thread.workspace
    if ws is None or not cwd or await ws.top_level(cwd) is None:
        return [{"ordinal": k, "status": "missing"} for k in ordinals]
    found: list[dict[str, Any]] = []
    try:
        for k in ordinals[:-1]:
            ref = ws.checkpoint_ref(thread.id, k)
            commit = await ws.ref_commit(cwd, ref)
            found.append({"ordinal": k, "status": "ready" if commit else "missing",
                          "ref": ref, "commit": commit})
        before = await ws.ref_commit(cwd, ws.checkpoint_ref(thread.id, prev)) if n else None
        ref = ws.checkpoint_ref(thread.id, n)
        commit = await ws.capture(cwd, ref)
        files = file_changes(await ws.diff(cwd, before, commit)) if before else []
        found.append({"ordinal": n, "status": "ready", "ref": ref, "commit": commit,
                      "files": files})
    except Exception as exc:  # GitError, OSError: the run completes all the same
        log.warning("checkpoint of %s failed: %s", run.id, exc)
        found = [f for f in found if f["ordinal"] != n] + [
            {"ordinal": n, "status": "error", "reason": str(exc)[:1000]}]
    return found


async def _forget_refs(o: Orchestrator, workspace: str, thread_id: str) -> None:
    if (ws := _git(o)) is not None:
        await ws.delete_ref(workspace, ws.checkpoint_ref(thread_id, None))


EFFECTS["checkpoint.forget"] = EffectKind(lambda o, row: _forget_refs(  # gone refs: no error
    o, row.payload["workspace"], row.thread_id), replay_safe=True)


# =============================================================================================
# Fork and merge-back. ``thread.fork`` makes a thread (lineage ``fork``) with a pending ``fork``
# ContextTransfer: the source point (a completed run) and a full_thread_summary up to it. At the
# fork's first run its session opens as a native fork of the source's provider thread where the
# driver can (transfer consumed as ``native_fork``), else the run carries the summary
# (``portable_context``). A point with a ready checkpoint gives the fork its own worktree at that
# commit (first run ``preparing``); outside git it shares the source's workspace.
# ``thread.merge_back`` records on the parent a pending ``merge_back`` transfer of the fork's
# completed runs (superseding a pending one from that fork); the parent's next run carries each as
# a MERGE_BACK_LABEL handoff.

MERGE_BACK_LABEL = "merge_back / fork_delta_summary"
# A strategy's label in the prompt where it is not its name.
HANDOFF_LABELS = {"fork_delta_summary": MERGE_BACK_LABEL}


@dataclass(frozen=True, slots=True)
class ForkThread(Command):
    type: ClassVar[str] = "thread.fork"
    # thread_id: the fork (the command's thread)
    create: CreateThread  # the fork as made: lineage, forkedFrom, workspace; no message
    source_thread_id: str
    source_point: Mapping[str, Any]  # {type, runId, runOrdinal, checkpointId}
    context: Mapping[str, Any] | None  # describe_handoff of the source's runs up to the point
    native: Mapping[str, Any] | None  # {providerInstanceId, providerThreadId} of the source run
    preparation: Mapping[str, Any] | None = None  # the fork's own worktree, made at first run


@dataclass(frozen=True, slots=True)
class MergeBack(Command):
    type: ClassVar[str] = "thread.merge_back"
    # thread_id: the fork's parent (the command's thread)
    source_thread_id: str  # the fork
    delta: Mapping[str, Any]  # describe_handoff of the fork's runs (fork_delta_summary)
    created_by: str


def fork_transfer_id(fork_thread_id: str) -> str:
    return bounded_id(f"context-transfer:fork:{fork_thread_id}")


def view(state: ThreadState) -> Draft:
    """A read-only view of a thread's state with a draft's ``get``/``all``/``runs``."""
    return Draft(state, None, "")


@decides(ForkThread, thread=False)
def _decide_fork(d: Draft, c: ForkThread, **kw: Any) -> Mapping[str, Any]:
    result = decide_create_thread(d, c.create, **kw)
    transfer = d.put(ContextTransfer(
        id=fork_transfer_id(c.thread_id), thread_id=c.thread_id, type="fork",
        source_thread_id=c.source_thread_id, target_thread_id=c.thread_id, status="pending",
        created_by=c.create.created_by, created_at=d.now, updated_at=d.now, data={
            "sourcePoint": c.source_point, "context": c.context, "native": c.native,
            "preparation": c.preparation}))
    return {**result, "sourceThreadId": c.source_thread_id, "sourcePoint": c.source_point,
            "contextTransferId": transfer.id, "workspacePath": c.create.workspace,
            "worktreePath": c.create.worktree_path, "branch": c.create.branch}


def _fork_transfer(d: Draft) -> ContextTransfer | None:
    """The fork's pending transfer, until its first run started."""
    transfer = d.get("context-transfer", fork_transfer_id(d.thread.id)) if d.thread else None
    return transfer if transfer is not None and transfer.status == "pending" else None


def _fork_preparation(d: Draft) -> Mapping[str, Any] | None:
    """The worktree a fork's first run makes (again, after a first run that failed to)."""
    transfer = _fork_transfer(d)
    if transfer is None or any(r.started_at for r in d.runs()):
        return None
    return (transfer.data or {}).get("preparation")


def _take_fork(d: Draft, run: Run, native: bool) -> str | None:
    """At the fork's first run: consume its transfer; the portable context's handoff id."""
    transfer = _fork_transfer(d)
    if transfer is None:
        return None
    data = transfer.data or {}
    handoff_id = put_handoff(d, run, data["context"]) if data.get("context") and not native \
        else None
    d.put(replace(transfer, status="consumed", target_run_id=run.id, consumed_at=d.now,
                  updated_at=d.now, data={**data, "resolution": {
                      "strategy": "native_fork" if native else "portable_context",
                      "contextHandoffId": handoff_id}}))
    return handoff_id


async def _native_fork(o: Orchestrator, state: ThreadState, run: Run, adapter: ProviderAdapter
                       ) -> Mapping[str, Any]:
    """``fork`` ({ref, dropTurns}) for a fork's first session to open as a native fork of the
    source run's conversation; nothing when the driver or instance cannot. If the fork itself
    fails the driver opens a new conversation (portable context)."""
    transfer = _fork_transfer(view(state))
    native = (transfer.data or {}).get("native") if transfer else None
    caps = adapter.info.capabilities
    if transfer is None or not native or not caps.supports_fork or \
            native["providerInstanceId"] != run.provider_instance_id:
        return {}
    source = await o.state(transfer.source_thread_id)
    pthread = source.entities["provider-thread"].get(native["providerThreadId"]) \
        if source else None
    if source is None or pthread is None or not pthread.native_thread_ref:
        return {}
    later = kept_turns(source, pthread.id, len(source.runs)) - kept_turns(
        source, pthread.id, (transfer.data or {})["sourcePoint"]["runOrdinal"])
    if later and not caps.supports_fork_from_turn:
        return {}
    return {"fork": {"ref": pthread.native_thread_ref, "dropTurns": later}}


@decides(MergeBack)
def _decide_merge_back(d: Draft, c: MergeBack, **_: Any) -> Mapping[str, Any]:
    thread = sendable(d)
    superseded = [d.put(replace(t, status="superseded", updated_at=d.now)).id
                  for t in d.all("context-transfer") if t.type == "merge_back"
                  and t.status == "pending" and t.source_thread_id == c.source_thread_id]
    transfer = d.put(ContextTransfer(
        id=bounded_id(f"context-transfer:merge_back:{c.command_id}"), thread_id=thread.id,
        type="merge_back", source_thread_id=c.source_thread_id, target_thread_id=thread.id,
        status="pending", created_by=c.created_by, created_at=d.now, updated_at=d.now,
        data={"delta": c.delta}))
    return {"threadId": thread.id, "forkThreadId": c.source_thread_id,
            "contextTransferId": transfer.id, "coveredRunOrdinals": c.delta["covered"],
            "superseded": superseded}


def _take_merge_backs(d: Draft, run: Run) -> list[str]:
    """At a thread's next run: its pending merge-backs as handoffs, oldest first; their ids."""
    pending = sorted((t for t in d.all("context-transfer") if t.type == "merge_back"
                      and t.status == "pending"), key=lambda t: t.created_at)
    ids = []
    for transfer in pending:
        ids.append(put_handoff(d, run, (transfer.data or {})["delta"],
                               f":merge-back:{transfer.source_thread_id}"))
        d.put(replace(transfer, status="consumed", target_run_id=run.id, consumed_at=d.now,
                      updated_at=d.now))
    return ids


def merge_back_head(fork_id: str, target_id: str, covered: Sequence[Run]) -> list[str]:
    """The merge-back summary's lines before the fork's items."""
    return ["Merge-back context from forked conversation.", f"Source thread: {fork_id}",
            f"Target thread: {target_id}",
            f"Covered fork runs: {covered[0].ordinal}-{covered[-1].ordinal}", "", "Fork delta:"]


# history.py's part in every run: context handoffs, checkpoints, a fork's first run, merge-backs
RUN_HOOKS.append(RunHooks(
    preparation=_fork_preparation, context=_hand_off, handoffs=_take_merge_backs,
    completed=_record_checkpoints, deleted=_forget_checkpoints, session=_native_fork,
    started=_capture_baseline, prompt=_prompt, finalize=_capture_checkpoints))


# =============================================================================================
# Rollback: ``checkpoint.rollback`` records a running ``rollback`` item (the core's
# ``thread_work``: no message is taken meanwhile, a deletion cancels it) and a replay-safe effect.
# The effect restores the files, deletes later refs, rolls back provider conversations natively
# where the driver can (``supports_rollback``) and closes the live session; FinishRollback then
# marks later runs ``rolled_back``, their checkpoints ``stale``, and resets the other provider
# threads (a fresh session with a full handoff). Every step is idempotent; run ordinals keep
# increasing.


@dataclass(frozen=True, slots=True)
class RollbackThread(Command):
    type: ClassVar[str] = "checkpoint.rollback"
    checkpoint_id: str


@dataclass(frozen=True, slots=True)
class FinishRollback(Command):
    type: ClassVar[str] = "checkpoint.rollback-finish"
    item_id: str
    native_provider_thread_ids: tuple[str, ...] = ()  # their conversations were rolled back
    failure: str | None = None  # the restore failed: nothing is marked


@decides(RollbackThread, client=True)
def _decide_rollback(d: Draft, c: RollbackThread, **_: Any) -> Mapping[str, Any]:
    cp = d.get("checkpoint", c.checkpoint_id)
    if cp is None or cp.thread_id != c.thread_id:
        raise CommandRejected(f"thread {c.thread_id} has no checkpoint {c.checkpoint_id}",
                              code="invalid_request")
    if cp.status != "ready" or not cp.commit:
        raise CommandRejected(f"checkpoint {cp.ordinal} is {cp.status}: only a ready checkpoint "
                              "can be restored", code="invalid_request")
    busy = next((r for r in d.runs() if r.status in RUN_BLOCKING or r.status == RunStatus.QUEUED),
                None)
    work = thread_work(d)
    if busy is not None or work is not None:
        raise CommandRejected("the thread is busy (" + (
            f"run {busy.ordinal} is {busy.status}" if busy else f"a {work.type} is running")
            + "): stop or wait for it first", code="thread_not_sendable")
    later = [r.id for r in d.runs() if r.ordinal > cp.ordinal and r.status != RunStatus.ROLLED_BACK]
    item = d.put(TurnItem(
        id=bounded_id(f"turn-item:rollback:{c.command_id}"), thread_id=c.thread_id, run_id=None,
        node_id=None, type="rollback", status="running", position=d.position(),
        updated_at=d.now, title=f"Rollback to checkpoint {cp.ordinal}", started_at=d.now,
        data={"checkpointId": cp.id, "ordinal": cp.ordinal, "rolledBackRunIds": later}))
    d.effect("checkpoint.rollback", {"itemId": item.id, "checkpointId": cp.id}, item.id)
    return {"threadId": c.thread_id, "checkpointId": cp.id, "ordinal": cp.ordinal,
            "rolledBackRunIds": later, "itemId": item.id}


@decides(FinishRollback)
def _decide_finish_rollback(d: Draft, c: FinishRollback, **_: Any) -> Mapping[str, Any]:
    item = d.get("turn-item", c.item_id)
    if item is None or item.status != "running":
        raise CommandRejected("the rollback has already finished")
    n = item.data["ordinal"]
    d.put(replace(item, status="failed" if c.failure else "completed", text=c.failure,
                  updated_at=d.now, completed_at=d.now))
    if c.failure:
        return {"status": "failed", "reason": c.failure}
    for run in d.runs():
        if run.ordinal > n and run.status != RunStatus.ROLLED_BACK:
            d.put(replace(run, status=RunStatus.ROLLED_BACK,
                          status_reason=f"rolled back to checkpoint {n}"))
            d.update("node", run.root_node_id, status="rolled_back")
    for cp in d.all("checkpoint"):
        if cp.ordinal > n and cp.status != "stale":
            d.put(replace(cp, status="stale", status_reason=f"rolled back to checkpoint {n}"))
    for pthread in d.all("provider-thread"):
        if (pthread.last_run_ordinal or 0) <= n:
            continue  # it never saw a rolled-back run
        kept = [r.ordinal for r in d.runs() if r.provider_thread_id == pthread.id
                and r.ordinal <= n and r.started_at is not None]
        native = pthread.id in c.native_provider_thread_ids
        d.put(replace(pthread, last_run_ordinal=max(kept) if kept and native else None,
                      native_thread_ref=pthread.native_thread_ref if native else None,
                      updated_at=d.now))
    return {"status": "completed", "reason": None}


def kept_turns(state: ThreadState, pthread_id: str, ordinal: int) -> int:
    """How many provider turns of ``pthread_id`` belong to runs up to ``ordinal``."""
    attempts = state.entities["run-attempt"]
    return sum(1 for t in state.entities["provider-turn"].values()
               if t.provider_thread_id == pthread_id and (run := state.run(
                   getattr(attempts.get(t.run_attempt_id), "run_id", ""))) is not None
               and run.ordinal <= ordinal and run.status != RunStatus.ROLLED_BACK)


async def _rollback(o: Orchestrator, thread_id: str, item_id: str, checkpoint: str) -> None:
    """The ``checkpoint.rollback`` effect: restore, drop later refs, roll back or close the
    provider conversations, then FinishRollback. Safe to run again."""
    state = await o.state(thread_id)
    item = state.entities["turn-item"].get(item_id) if state else None
    if state is None or state.thread is None or item is None or item.status != "running":
        return  # finished before a crash, or the thread was deleted: nothing left to do
    cp, ws, cwd = state.entities["checkpoint"][checkpoint], _git(o), \
        state.thread.workspace
    failure, native = None, []
    try:
        if ws is None or not cwd:
            raise T3Error("this server has no git workspaces")
        await ws.restore(cwd, cp.commit)
        for later in state.entities["checkpoint"].values():
            if later.ordinal > cp.ordinal and later.ref:
                await ws.delete_ref(cwd, later.ref)
    except Exception as exc:  # GitError, OSError: said in the item, nothing marked
        failure = f"the workspace was not restored: {exc}"[:2000]
    if failure is None:  # idle: no run may be active during a rollback
        await o.sessions.stop(thread_id, f"Closed by a rollback to checkpoint {cp.ordinal}.")
    for pthread in state.entities["provider-thread"].values() if failure is None else ():
        if (pthread.last_run_ordinal or 0) > cp.ordinal and await _rollback_natively(
                o, state, pthread, kept_turns(state, pthread.id, cp.ordinal)):
            native.append(pthread.id)
    await o.try_dispatch(FinishRollback(
        command_id=bounded_id(f"command:rollback-finish:{item_id}"), thread_id=thread_id,
        item_id=item_id, native_provider_thread_ids=tuple(native), failure=failure))


async def _rollback_natively(o: Orchestrator, state: ThreadState, pthread: ProviderThread,
                             keep: int) -> bool:
    """Roll ``pthread``'s conversation back to its first ``keep`` turns in a short session;
    False when the driver cannot (the next turn starts fresh with a handoff)."""
    adapter = o.adapters.get(pthread.provider_instance_id)
    thread = state.thread
    if adapter is None or thread is None or not pthread.native_thread_ref or \
            not adapter.info.capabilities.supports_rollback:
        return False
    handle = None
    try:
        handle = await adapter.open_session(
            session_id=o.new_id("provider-session"), thread_id=thread.id,
            cwd=thread.workspace or os.getcwd(), model=None,
            runtime_mode=thread.runtime_mode, interaction_mode=thread.interaction_mode,
            resume_ref=pthread.native_thread_ref, mcp=None)
        if handle.native_thread_ref != pthread.native_thread_ref:
            return False  # the conversation is gone: a fresh one gets the handoff
        await handle.rollback(keep)  # type: ignore[attr-defined]
        return True
    except Exception as exc:
        log.warning("native rollback of %s failed (%s); the next turn starts fresh",
                    pthread.id, exc)
        return False
    finally:
        if handle is not None:
            await handle.close()


# each step is idempotent
EFFECTS["checkpoint.rollback"] = EffectKind(lambda o, row: _rollback(
    o, row.thread_id, row.payload["itemId"], row.payload["checkpointId"]), replay_safe=True)


# =============================================================================================
# Operations: t3_thread_diff (MCP, and /ws getFullThreadDiff), /ws getTurnDiff, forkThread,
# mergeBack and rollbackThread, and dispatchCommand's checkpoint.rollback


ROLLBACK_WAIT_S = 120.0  # rollbackThread answers ``running`` after this
FILE_CHANGE = shape({"path": STRING, "kind": STRING, "additions": INTEGER,
                     "deletions": INTEGER})
DIFF_OUTPUT = shape({"threadId": STRING, "runId": OPT_STRING, "ordinal": OPT_INTEGER,
                     "status": enum_of(["ready", "pending", "missing", "error", "stale"]),
                     "reason": OPT_STRING, "fromCheckpointId": OPT_STRING,
                     "toCheckpointId": OPT_STRING, "files": list_of(FILE_CHANGE),
                     "diff": STRING, "truncated": BOOLEAN})
_DIFF_INPUT = obj({"threadId": THREAD_ID, "runId": text_field(512),
                   "ordinal": {"type": "integer", "minimum": 1}}, ["threadId"])


async def _thread_diff(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """The unified diff of one run (``runId`` or ``ordinal``: its checkpoint against the one
    before it) or, with neither, of the whole thread (its first ready checkpoint against its
    newest), bounded (workspace.MAX_DIFF_CHARS) with a truncation flag. Unless both sides are
    ready checkpoints, ``status`` says why there is none (pending, missing, error) in
    ``reason``."""
    thread_id, run_id, ordinal = args["threadId"], args.get("runId"), args.get("ordinal")
    state = await kit.thread(thread_id)
    cps = {c.ordinal: c for c in state.entities["checkpoint"].values()}
    run = None
    if run_id is not None or ordinal is not None:
        run = state.run(run_id) if run_id else next(
            (r for r in state.runs if r.ordinal == ordinal), None)
        if run is None or ordinal not in (None, run.ordinal):
            raise T3Error(f"thread {thread_id} has no run {run_id or ordinal}",
                          code="run_not_found")
        before, after = cps.get(kept_before(state.runs, run.ordinal)), cps.get(run.ordinal)
    else:
        ready = sorted(n for n, c in cps.items() if c.status == "ready")
        before, after = (cps[ready[0]], cps[ready[-1]]) if ready else (None, None)
    result: dict[str, Any] = {
        "threadId": thread_id, "runId": run.id if run else None,
        "ordinal": run.ordinal if run else None, "status": "ready", "reason": None,
        "fromCheckpointId": before.id if before else None,
        "toCheckpointId": after.id if after else None, "files": [], "diff": "",
        "truncated": False}
    for side, name in ((after, "this run's"), (before, "the previous")):
        if side is None or side.status != "ready":
            status, reason = _no_diff(side, name, run)
            return {**result, "status": status, "reason": reason}
    assert before is not None and after is not None and state.thread is not None
    try:
        if (ws := _git(kit.orch)) is None or not state.thread.workspace:
            raise T3Error("this server has no git workspaces")
        found = await ws.diff(state.thread.workspace, before.commit, after.commit)
    except Exception as exc:  # the repository moved or git failed: said, not raised
        return {**result, "status": "error", "reason": str(exc)[:1000]}
    return {**result, "files": file_changes(found), "diff": found.text,
            "truncated": found.truncated}


def _no_diff(side: Checkpoint | None, name: str, run: Run | None) -> tuple[str, str]:
    """Why one side of a diff is not a ready checkpoint: (status, reason)."""
    if side is not None:
        return side.status, side.status_reason or f"{name} checkpoint is {side.status}" + (
            " (the workspace is not in a git repository)" if side.status == "missing" else "")
    if run is None:
        return "missing", "the thread has no checkpoint yet"
    if run.status not in RUN_TERMINAL:
        return "pending", f"run {run.ordinal} is {run.status}: its checkpoint comes when it ends"
    return "missing", f"{name} checkpoint does not exist (run {run.ordinal} is {run.status})"


async def _turn_diff(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    if "runId" not in args and "ordinal" not in args:
        raise T3Error("getTurnDiff: runId or ordinal is required (getFullThreadDiff gives "
                      "the whole thread's)", code="invalid_request")
    return await _thread_diff(kit, call, args)


async def _fork_thread(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """``thread.fork`` of ``sourceThreadId`` at ``sourcePoint`` (default latest_stable): a new
    thread with the source's context up to there, in a worktree of its own at that point's
    checkpoint when the source works in git and it is ready. Refused before anything is
    written."""
    ids = (call.source, call.scope.key, "fork", args["commandId"])
    thread_id, command_id = kit.derive_id("thread", *ids), kit.derive_id("command", *ids)
    state = await kit.thread(args["sourceThreadId"])
    source = state.thread
    assert source is not None
    setup = kit.ctx.project(source.project_id, listing=True).setup  # scratch: none
    point = args.get("sourcePoint") or {"type": "latest_stable"}
    run, checkpoint = _fork_point(state, point)
    covered = [r for r in state.runs if run and r.ordinal <= run.ordinal and r.started_at
               and r.status != RunStatus.ROLLED_BACK]
    binding: dict[str, Any] = {"workspace": source.workspace or "", "branch": source.branch,
                               "worktree_path": source.worktree_path}
    git, preparation = kit.orch.workspaces, None
    repo = await git.top_level(source.workspace) if git and source.workspace else None
    if repo and checkpoint is not None and checkpoint.status == "ready" and checkpoint.commit:
        path, branch = new_worktree(git, thread_id)
        binding = {"workspace": path, "branch": branch, "worktree_path": path}
        preparation = {"repo": repo, "baseRef": checkpoint.commit, "fromOrigin": False,
                       "setup": list(setup)}
    source_point = {"type": point["type"], "runId": run.id if run else None,
                    "runOrdinal": run.ordinal if run else 0,
                    "checkpointId": checkpoint.id if checkpoint else None}
    create = CreateThread(
        command_id=command_id, thread_id=thread_id, project_id=source.project_id,
        title=args.get("title") or f"Fork of {source.title}"[:200],
        provider_instance_id=source.provider_instance_id,
        model=source.model_selection.get("model"), runtime_mode=source.runtime_mode,
        interaction_mode=source.interaction_mode, **call.made_by, lineage={
            "parentThreadId": source.id, "relationshipToParent": "fork",
            "rootThreadId": source.lineage.get("rootThreadId") or source.id},
        forked_from={"type": "run", "threadId": source.id, **source_point}, **binding)
    command = ForkThread(
        command_id=command_id, thread_id=thread_id, create=create, source_thread_id=source.id,
        source_point=source_point, preparation=preparation,
        context=describe_handoff(view(state), "full_thread_summary", covered,
                                 source.provider_instance_id, kit.orch.providers)
        if covered else None,
        native={"providerInstanceId": run.provider_instance_id,
                "providerThreadId": run.provider_thread_id} if run else None)
    return {**(await kit.orch.dispatch(command)).result, "threadId": thread_id}


def _fork_point(state: ThreadState, point: Mapping[str, Any]
                ) -> tuple[Run | None, Checkpoint | None]:
    """The source run (None: a baseline checkpoint) and its checkpoint a fork starts at."""
    checkpoints = state.entities["checkpoint"]
    checkpoint = checkpoints.get(point.get("checkpointId") or "")
    named = {"checkpoint": "checkpointId", "run": "runId or ordinal"}.get(point["type"])
    if named and not any(point.get(k) for k in ("checkpointId", "runId", "ordinal")):
        raise T3Error(f"sourcePoint: a {point['type']} point needs {named}",
                      code="invalid_request")
    if point["type"] == "checkpoint":
        if checkpoint is None or checkpoint.status != "ready":
            raise T3Error(f"sourcePoint: checkpoint {point['checkpointId']} is "
                          f"{checkpoint.status if checkpoint else 'not found'} in this "
                          "thread", code="invalid_request")
        run = state.run(checkpoint.run_id) if checkpoint.run_id else None
    elif point["type"] == "run":  # {runId} or {ordinal}
        run = state.run(point.get("runId") or "") or next(
            (r for r in state.runs if r.ordinal == point.get("ordinal")), None)
        if run is None:
            raise T3Error(f"sourcePoint: run {point.get('runId') or point.get('ordinal')} "
                          "was not found", code="run_not_found")
    else:
        run = next((r for r in reversed(state.runs) if r.status == RunStatus.COMPLETED), None)
        if run is None:
            raise T3Error("sourcePoint: the thread has no completed run to fork from",
                          code="invalid_request")
    if run is not None and run.status != RunStatus.COMPLETED:
        raise T3Error(f"sourcePoint: run {run.ordinal} is {run.status}; a fork starts at a "
                      "completed run", code="invalid_request")
    if point["type"] != "checkpoint" and run is not None:
        checkpoint = checkpoints.get(checkpoint_id(run.thread_id, run.ordinal))
    return run, checkpoint


async def _merge_back(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """``thread.merge_back`` of fork ``sourceThreadId`` into its parent (``targetThreadId``,
    which must be that parent when given): the fork's completed runs as its delta, which goes
    to the parent with its next message."""
    fork_id, target_id = args["sourceThreadId"], args.get("targetThreadId")
    command_id = kit.derive_id("command", call.source, call.scope.key, "merge-back",
                               args["commandId"])
    fork = await kit.thread(fork_id)
    assert fork.thread is not None
    parent_id = fork.thread.lineage.get("parentThreadId")
    if fork.thread.lineage.get("relationshipToParent") != "fork" or \
            target_id not in (None, parent_id):
        raise T3Error(f"thread {fork_id} is not a fork of "
                      f"{target_id or 'another thread'}", code="invalid_request")
    parent = (await kit.thread(parent_id)).thread
    assert parent is not None
    covered = [r for r in fork.runs if r.status in (RunStatus.COMPLETED, RunStatus.WAITING)]
    if not covered:
        raise T3Error(f"fork {fork_id} has no completed run to merge back",
                      code="invalid_request")
    return dict((await kit.orch.dispatch(MergeBack(
        command_id=command_id, thread_id=parent.id, source_thread_id=fork_id,
        created_by=Actor.USER, delta=describe_handoff(
            view(fork), "fork_delta_summary", covered, parent.provider_instance_id,
            kit.orch.providers, head=merge_back_head(fork_id, parent.id, covered))))).result)


async def _rollback_thread(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
    """``checkpoint.rollback`` to run ``runOrdinal``'s checkpoint (0: the thread's baseline) or
    to ``checkpointId``, answered once its effect has finished: status completed (the files are
    restored) or failed with the reason, or running after ROLLBACK_WAIT_S."""
    if ("runOrdinal" in args) == ("checkpointId" in args):
        raise T3Error("rollbackThread: give runOrdinal or checkpointId", code="invalid_request")
    thread_id, ordinal, checkpoint = args["threadId"], args.get("runOrdinal"), \
        args.get("checkpointId")
    command_id = kit.derive_id("command", call.space, call.scope.key, "thread-rollback",
                               thread_id, kit.key(args))
    state = await kit.thread(thread_id)
    if checkpoint is None:
        if ordinal and not any(r.ordinal == ordinal for r in state.runs):
            raise T3Error(f"thread {thread_id} has no run {ordinal}", code="run_not_found")
        checkpoint = checkpoint_id(thread_id, ordinal)
    done = (await kit.orch.dispatch(RollbackThread(
        command_id=command_id, thread_id=thread_id, checkpoint_id=checkpoint))).result
    item_id = done["itemId"]
    await kit.orch.wait_until([thread_id], lambda s: s[thread_id].entities["turn-item"][
        item_id].status != "running", ROLLBACK_WAIT_S)
    ended = (await kit.thread(thread_id)).entities["turn-item"][item_id]
    return {**done, "status": ended.status, "reason": ended.text}


def _wire_rollback(kit: Toolkit, a: Args, command_id: str) -> RollbackThread:
    """dispatchCommand's checkpoint.rollback; the seed's ``scopeId``, when sent, is checked."""
    scope = checkpoint_scope_id(a["threadId"])
    if a.get("scopeId", scope) != scope:
        raise T3Error(f"scopeId: thread {a['threadId']}'s checkpoints are in scope {scope}",
                      code="invalid_request")
    return RollbackThread(command_id=command_id, thread_id=a["threadId"],
                          checkpoint_id=a["checkpointId"])


register(
    Operation(
        "t3_thread_diff",
        "The unified diff of one run of a thread (runId or ordinal: what the run changed in "
        "its workspace, between its checkpoint and the one before) or, with neither, of the "
        "whole thread; files with additions and deletions, text stops near 30,000 characters "
        "(truncated). status says why there is no diff: pending (the run is not finished), "
        "missing (not a git repository), error.",
        _DIFF_INPUT, _thread_diff, DIFF_OUTPUT, ws=("getFullThreadDiff",), read_only=True),
    ws_op("getTurnDiff", "t3_thread_diff of one run (runId or ordinal).", _DIFF_INPUT,
          _turn_diff, DIFF_OUTPUT),
    ws_op("forkThread", "thread.fork: a thread with the source's context up to sourcePoint.",
          obj({"commandId": CLIENT_REQUEST_ID, "sourceThreadId": THREAD_ID, "title": SEED_TITLE,
               "sourcePoint": obj({
                   "type": {"type": "string", "enum": ["latest_stable", "run", "checkpoint"]},
                   "runId": THREAD_ID, "ordinal": {"type": "integer", "minimum": 1},
                   "checkpointId": THREAD_ID}, ["type"])}, ["commandId", "sourceThreadId"]),
          _fork_thread),
    ws_op("mergeBack", "thread.merge_back: a fork's delta to its parent.",
          obj({"commandId": CLIENT_REQUEST_ID, "sourceThreadId": THREAD_ID,
               "targetThreadId": THREAD_ID}, ["commandId", "sourceThreadId"]), _merge_back),
    ws_op("rollbackThread", "checkpoint.rollback to a run's checkpoint (0: the baseline), or "
          "to checkpointId, answered once the files are restored.",
          obj({"threadId": THREAD_ID, "runOrdinal": {"type": "integer", "minimum": 0},
               "checkpointId": THREAD_ID, "clientRequestId": CLIENT_REQUEST_ID}, ["threadId"]),
          _rollback_thread))
register_wire("checkpoint.rollback", {"threadId": THREAD_ID, "scopeId": STRING,
                                      "checkpointId": THREAD_ID},
              ["threadId", "checkpointId"], _wire_rollback)
