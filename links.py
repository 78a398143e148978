"""links.py: linked environments, a feature an auditor of a single-node install may skip.

A linked environment is another t3 named in ``[[environments]]`` (its environment id, its URL and
a file holding a token it issued: its client token). Its provider instances appear in
``orchestrator_capabilities`` with their ``environmentId``; ``delegate_task``,
``create_threads`` and ``t3_thread_launch`` take ``target.environmentId`` to make the thread
there, through its ``/mcp`` endpoint (the SDK client); ``t3_thread_read``, ``t3_thread_wait`` and
``t3_thread_send`` take a thread's link ``t3-thread://v2/<environmentId>/<threadId>``. This
module wraps those operations (``tools.replace_operation``): what names no linked environment
goes to the core's handler unchanged. The core never imports it.

Rules:
- Capabilities never widen across a link: a thread caller's remote child or thread gets explicit
  modes, the caller's or narrower (``Toolkit.modes``), and a send to a remote thread broader
  than the caller is refused, as at home.
- A delegated remote task is a ``Subagent`` of its parent whose child is the link. Its watch is
  an outbox effect (``link.await``, replay-safe): it waits on the remote run with the remote's
  ``t3_thread_wait`` and finalizes the task with ``FinalizeSubagent`` under a command id keyed by
  the remote run, so the parent is woken once, whichever side restarts.
- A remote's answers are untrusted: bounded in size, checked against the tool's output schema, a
  failure's code kept only when it is one of ours. A link or target naming an environment that
  is not configured is refused (``thread_not_found`` / ``provider_unavailable``) and changes
  nothing. The token is read from its file at each call and never logged or recorded.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import orchestrator as orch
import tools
from orchestrator import (EFFECTS, RUN_BLOCKING, RUN_TERMINAL, CommandRejected, DelegateTask,
                          Draft, EffectKind, FinalizeSubagent, RunStatus, T3Error, bounded_id,
                          decides, put_task)
from tools import Args, Call, Operation, Toolkit

__all__ = ["Environment", "Links", "DelegateRemoteTask", "parse_link", "install"]

log = logging.getLogger("t3.links")
logging.getLogger("httpx2").setLevel(logging.WARNING)  # a line per request to a linked t3: noise

LINK = re.compile(r"t3-thread://v2/([^/\s]{1,64})/(\S{1,512})")
MAX_ANSWER_BYTES = 1024 * 1024  # a remote's result beyond it is refused
CALL_TIMEOUT_S = 30.0  # a remote call that does not wait
WATCH_MS = 300_000  # one remote t3_thread_wait of a watch (the remote wakes it on its commits)
RETRY_MAX_S = 30.0  # a watch that cannot reach its remote tries again, backing off to this


@dataclass(frozen=True, slots=True)
class Environment:
    """One ``[[environments]]`` entry: another t3, reached at ``url``/mcp with the token in
    ``token_file`` (read at each call, so a rotated token needs no restart here)."""

    id: str
    url: str
    token_file: Path

    def token(self) -> str:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise Unreachable(f"environment {self.id}: its token file {self.token_file} cannot "
                              f"be read ({exc.strerror})") from None
        if not token:
            raise Unreachable(f"environment {self.id}: its token file {self.token_file} is empty")
        return token


class Unreachable(T3Error):
    """The linked environment did not answer."""


class Links:
    """The orchestrator's part holding the linked environments (t3.py attaches it)."""

    watches: frozenset[str] = frozenset()

    def __init__(self, environments: Mapping[str, Environment]) -> None:
        self.environments = dict(environments)

    def committed(self, entity: Any) -> None:
        pass

    async def run(self) -> None:
        pass

    async def call(self, env: Environment, tool: str, args: Mapping[str, Any], *,
                   timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """Call ``tool`` on ``env`` with the client token it issued; its result, checked against
        our own output schema of that tool. A typed failure is raised with its code (ours only);
        no answer raises Unreachable."""
        headers = {"Authorization": f"Bearer {env.token()}"}
        try:
            async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(
                    10, read=timeout_s + 10)) as http, Client(streamable_http_client(
                    f"{env.url}/mcp", http_client=http)) as client:
                result = await asyncio.wait_for(client.call_tool(tool, dict(args)),
                                                timeout_s + 20)
        except Exception as exc:  # (cancellation is a BaseException: it passes)
            raise Unreachable(f"environment {env.id} did not answer {tool}: "
                              f"{_first_leaf(exc)}") from None
        answer = result.structured_content
        if not isinstance(answer, dict) or len(json.dumps(answer)) > MAX_ANSWER_BYTES:
            raise T3Error(f"environment {env.id} answered {tool} with no result t3 can use")
        if result.is_error:
            code = answer.get("code")
            raise T3Error(f"environment {env.id}: {str(answer.get('message'))[:2000]}",
                          code=code if code in tools.FAILURE_CODES else "orchestration_error")
        try:
            return dict(tools.validate(_OUTPUTS[tool], answer))
        except T3Error as exc:
            raise T3Error(f"environment {env.id} answered {tool} out of shape: {exc}") from None


def _first_leaf(exc: BaseException) -> str:
    """What went wrong, from the innermost of the SDK's exception groups (no headers in it)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def parse_link(value: str) -> tuple[str, str] | None:
    """(environmentId, threadId) of a ``t3-thread://v2/`` link; None for anything else."""
    match = LINK.fullmatch(value)
    return (match.group(1), match.group(2)) if match else None


def _links(kit: Toolkit) -> Links:
    try:
        return kit.orch.part(Links)
    except LookupError:  # a toolkit built without one (in-process tests): nothing is linked
        return Links({})


def _remote_key(scope_key: str, key: str) -> str:
    """The clientRequestId sent to the remote: the caller's here and its own key, so two callers
    here (who reach the remote as one client) never share a remote retry key."""
    return "link-" + hashlib.sha256(f"{scope_key}\0{key}".encode()).hexdigest()[:40]


# =============================================================================================
# Routing: which environment a call names


def _environment(kit: Toolkit, env_id: str | None, *, what: str, code: str
                 ) -> Environment | None:
    """The linked environment ``env_id`` names; None for this t3 (or none named). An id that is
    neither is refused with ``code``."""
    if env_id is None or env_id == kit.ctx.environment_id:
        return None
    env = _links(kit).environments.get(env_id)
    if env is None:
        raise T3Error(f"{what}: environment {env_id} is not linked to this t3 ([[environments]] "
                      "in t3.toml)", code=code)
    return env


def _thread_route(kit: Toolkit, args: Args) -> tuple[Environment | None, dict[str, Any]]:
    """A thread tool's environment and its arguments there: a link to this t3 is its thread."""
    parsed = parse_link(args["threadId"])
    if parsed is None:
        return None, dict(args)
    env = _environment(kit, parsed[0], what="threadId", code="thread_not_found")
    return env, {**args, "threadId": parsed[1]}


def _target_route(kit: Toolkit, target: Mapping[str, Any] | None
                  ) -> tuple[Environment | None, dict[str, Any] | None]:
    """A target's environment, and the target without ``environmentId``."""
    if not target:
        return None, None
    env = _environment(kit, target.get("environmentId"), what="target.environmentId",
                       code="provider_unavailable")
    return env, {k: v for k, v in target.items() if k != "environmentId"}


async def _remote_modes(kit: Toolkit, call: Call, args: Args, what: str) -> dict[str, str]:
    """The modes a remote thread is made with: a thread caller's (live run required) or
    narrower, always explicit, so the remote cannot widen them by inheriting; a person's
    client as given."""
    if call.scope.kind != "thread":
        return {k: args[k] for k in ("runtimeMode", "interactionMode") if k in args}
    caller, _ = await kit.agent_caller(call.scope, what)
    assert caller.thread is not None
    strategy = args.get("workspaceStrategy", "root")
    if (strategy if isinstance(strategy, str) else strategy["type"]) == "worktree" and \
            caller.thread.runtime_mode != orch.RuntimeMode.FULL_ACCESS:
        # Its project's setup would run there without the approval it needs here (the remote
        # sees its client token: a person).
        raise T3Error("workspaceStrategy: a new worktree on a linked t3 needs an agent in "
                      "full-access", code="capability_denied")
    runtime, interaction = kit.modes(args, caller)
    return {"runtimeMode": runtime, "interactionMode": interaction}


# =============================================================================================
# Delegation to a linked environment


@dataclass(frozen=True, slots=True)
class DelegateRemoteTask(DelegateTask):
    """delegated_task.request whose child runs in a linked environment: the parent records the
    task with the child's link, and an effect watches the remote run."""

    type: ClassVar[str] = "delegated_task.request-linked"
    # The provider and model are the remote's answer, known only after it made the thread.
    fingerprint_fields: ClassVar[tuple[str, ...]] = (
        "thread_id", "task", "title", "runtime_mode", "interaction_mode", "environment_id",
        "requested_target")
    environment_id: str = ""
    requested_target: str = ""  # the target as asked (JSON)
    remote_thread_id: str = ""
    remote_run_id: str = ""

    @property
    def link(self) -> str:
        return f"t3-thread://v2/{self.environment_id}/{self.remote_thread_id}"


@decides(DelegateRemoteTask)
def _decide_remote_delegate(d: Draft, c: DelegateRemoteTask, **_: Any) -> Mapping[str, Any]:
    run = d.get("run", c.parent_run_id)
    if run is None or run.status not in RUN_BLOCKING:
        raise CommandRejected("delegated tasks need an active run of the calling thread",
                              code="parent_not_active")
    task = put_task(d, run, c, driver="linked", child_thread_id=c.link,
                    child_run_id=c.remote_run_id)
    # Owned by the link, not the parent: the outbox runs one effect of an owner at a time, and
    # the watch lasts as long as the remote run, so it would hold up the parent's own effects
    # (its runs' starts and ends, and so its task_status and task_cancel) until then.
    d.effect("link.await", {"environmentId": c.environment_id, "taskId": task.id,
                            "parentThreadId": c.thread_id, "remoteThreadId": c.remote_thread_id,
                            "remoteRunId": c.remote_run_id}, task.id, thread_id=c.link)
    return {"taskId": task.id, "childThreadId": c.link, "childRunId": c.remote_run_id}


async def _delegate_remote(kit: Toolkit, call: Call, args: Args, env: Environment,
                           target: Mapping[str, Any]) -> dict[str, Any]:
    """delegate_task to ``env``: the remote thread first (create_threads, its retry key derived
    from this task's command id, so a retry here finds the same one), then the parent's record
    and its watch in one command."""
    scope, key = call.scope, kit.key(args)
    caller, run = await kit.agent_caller(scope, "delegate_task")
    assert caller.thread is not None
    runtime, interaction = kit.modes(args, caller)
    depth = len(await kit.ancestors(caller.thread)) + 1
    if depth > kit.ctx.max_delegation_depth:
        raise T3Error(f"delegate_task: the child would be {depth} levels deep, beyond "
                      f"max_delegation_depth = {kit.ctx.max_delegation_depth}",
                      code="capability_denied")
    role = args.get("role")
    task = args["task"] if role in (None, "general") else \
        f"Act as the {role} sub-agent for this task.\n\n{args['task']}"
    command = DelegateRemoteTask(
        command_id=kit.derive_id("command", "mcp", scope.key, "delegate-task", key),
        thread_id=caller.thread.id, parent_run_id=run.id, task=task,
        title=orch.thread_title(args.get("title"), args["task"], "Delegated task"),
        provider_instance_id=target.get("providerInstanceId") or "", model=target.get("model"),
        runtime_mode=runtime, interaction_mode=interaction, environment_id=env.id,
        requested_target=json.dumps(target, sort_keys=True),
        completion_wake="settled_only" if args.get("mode") == "wait" else "always",
        created_by=orch.Actor.AGENT, creation_source=orch.CreationSource.MCP)
    receipt = kit.store.receipt(command.command_id)
    if receipt is not None and receipt.fingerprint != orch.fingerprint_of(command):
        raise T3Error("clientRequestId: already used for a different delegate_task request",
                      code="invalid_request")
    if receipt is None:
        task_id = (await _make_remote_task(kit, env, command, {
            "threads": [{"prompt": task, "title": command.title, "target": dict(target),
                         "runtimeMode": runtime, "interactionMode": interaction}],
            "clientRequestId": _remote_key(scope.key, command.command_id)}))["taskId"]
    else:
        task_id = receipt.result["taskId"]
    timed_out = False
    if args.get("mode") == "wait":
        timed_out = not await _wait_remote_task(kit, caller.thread.id, task_id, args, call)
        if timed_out and not kit.orch.stopping:  # the completion must now wake the parent
            await kit.orch.dispatch(orch.SetWakePolicy(
                command_id=kit.derive_id("command", "mcp", scope.key,
                                         "delegate-task-wake-policy", key),
                thread_id=caller.thread.id, task_id=task_id, completion_wake="always"))
    shaped = await _remote_task_result(kit, caller.thread.id, task_id)
    shaped["waitTimedOut"] = timed_out and shaped["status"] not in orch.TASK_TERMINAL
    return shaped


async def _make_remote_task(kit: Toolkit, env: Environment, command: DelegateRemoteTask,
                            create: Args) -> Mapping[str, Any]:
    """The thread made on ``env`` (``create``: its create_threads arguments), then recorded
    here; a record refused (the parent's run ended meanwhile) interrupts the run made there,
    which would otherwise go on with no one here to hear of it."""
    made = (await _links(kit).call(env, "create_threads", create))["threads"]
    if len(made) != 1 or not made[0].get("runId"):
        raise T3Error(f"environment {env.id} made no run for the task")
    try:
        return (await kit.orch.dispatch(dataclasses.replace(
            command, provider_instance_id=made[0]["providerInstanceId"], model=made[0]["model"],
            remote_thread_id=made[0]["threadId"], remote_run_id=made[0]["runId"]))).result
    except T3Error as exc:
        if kit.store.receipt(command.command_id) is None:  # (not recorded after all)
            await _interrupt_remote(kit, env, made[0]["threadId"], made[0]["runId"],
                                    f"Its delegation was refused: {exc}", command.task_id)
        raise


async def _interrupt_remote(kit: Toolkit, env: Environment, thread_id: str, run_id: str,
                            reason: str | None, task_id: str) -> None:
    """Interrupt a run on ``env``; a failure is logged (the caller's outcome stands)."""
    try:
        await _links(kit).call(env, "t3_thread_interrupt", {
            "threadId": thread_id, "runId": run_id, **({"reason": reason} if reason else {})})
    except T3Error as exc:
        log.warning("task %s: the remote run was not interrupted: %s", task_id, exc)


async def _wait_remote_task(kit: Toolkit, parent_id: str, task_id: str, args: Args,
                            call: Call) -> bool:
    """Until the task is finalized here (its watch does it), or the timeout: woken by commits."""
    timeout_s = args.get("timeoutMs", tools.DEFAULT_WAIT_MS) / 1000
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not kit.orch.stopping and (remaining := deadline - loop.time()) > 0:
        if await kit.orch.wait_until([parent_id], lambda s: s[parent_id].entities["subagent"][
                task_id].status in orch.TASK_TERMINAL, min(remaining, tools.PROGRESS_EVERY_S)):
            return True
        if call.progress is not None and not kit.orch.stopping:
            await call.progress(timeout_s - max(0.0, deadline - loop.time()),
                                "waiting for the delegated task")
    return False


async def _remote_task(kit: Toolkit, parent_id: str, task_id: str) -> orch.Subagent | None:
    """The parent's task ``task_id`` if its child is in a linked environment."""
    state = await kit.thread(parent_id)
    task = state.entities["subagent"].get(task_id)
    return task if task is not None and parse_link(task.child_thread_id) else None


async def _remote_task_result(kit: Toolkit, parent_id: str, task_id: str) -> dict[str, Any]:
    """task_status of a remote task, from the parent's record alone: what the watch finalized."""
    task = await _remote_task(kit, parent_id, task_id)
    assert task is not None
    terminal = task.status in orch.TASK_TERMINAL
    return {"taskId": task.id, "childThreadId": task.child_thread_id,
            "childRunId": task.child_run_id, "childNodeId": task.id,
            "status": task.status if terminal else "running",
            "workState": "result_available" if terminal else "working",
            "hasPendingChildRuns": False, "providerInstanceId": task.provider_instance_id,
            "model": task.model, "summary": task.result if terminal else None,
            "resultContextTransferId": orch.result_transfer_id(task.id) if terminal else None,
            "latestTerminalRunId": None, "latestTerminalStatus": None,
            "latestTerminalSummary": None, "latestTerminalResultContextTransferId": None,
            "hasPendingQuestion": False, "pendingApproval": None, "waitTimedOut": False,
            "childThreadLink": task.child_thread_id}


async def _await_remote(o: orch.Orchestrator, row: Any) -> None:
    """The watch of a remote task: the remote's t3_thread_wait on its run, again until it ends
    (the remote wakes each wait on its own commits), then the task's finalization here, keyed
    by the remote run. An unreachable remote is tried again, backing off; the watch outlives
    a restart of either side (the outbox row is replay-safe)."""
    p = row.payload
    try:
        env = o.part(Links).environments[p["environmentId"]]
    except LookupError:  # no Links part, or the entry was removed
        env = None
    remote = {"threadId": p["remoteThreadId"], "runId": p["remoteRunId"]}
    status, text = RunStatus.FAILED, f"environment {p['environmentId']} is no longer linked"
    delay = 1.0
    while env is not None:
        try:
            waited = await o.part(Links).call(env, "t3_thread_wait", {
                **remote, "timeoutMs": WATCH_MS}, timeout_s=WATCH_MS / 1000)
            if waited["status"] in RUN_TERMINAL:
                status, text = waited["status"], await _remote_result(o, env, waited)
                break
            if not (waited["hasPendingQuestion"] or waited["pendingApproval"]):
                delay = 1.0
                continue
            # A pending request ends a remote wait at once: look again, backing off.
        except T3Error as exc:
            if exc.code in ("thread_not_found", "run_not_found"):  # gone on the remote
                status, text = RunStatus.FAILED, f"The linked task could not be followed: {exc}"
                break
            log.info("task %s: %s; trying again in %.0f s", p["taskId"], exc, delay)
        await asyncio.sleep(delay)
        delay = min(RETRY_MAX_S, delay * 2)
    await o.try_dispatch(FinalizeSubagent(
        command_id=bounded_id(f"command:link-finalize:{p['taskId']}:{p['remoteRunId']}"),
        thread_id=p.get("parentThreadId", row.thread_id),  # (older watches: the row's owner)
        task_id=p["taskId"], result=text, run_id=p["remoteRunId"],
        status=RunStatus.CANCELLED if status == RunStatus.ROLLED_BACK else status),
        f"linked task {p['taskId']} could not be finalized")


async def _remote_result(o: orch.Orchestrator, env: Environment, waited: Mapping[str, Any]
                         ) -> str:
    """What the remote run hands back, as ``orch.task_result`` says it for a child here."""
    page = await o.part(Links).call(env, "t3_thread_read", {
        "threadId": waited["threadId"], "view": "messages", "beforePosition": 2 ** 31,
        "limit": 20})
    texts = [i["text"] for i in page["items"] if i["type"] == "assistant_message"
             and i["runId"] == waited["runId"] and (i.get("text") or "").strip()]
    progress = texts[-1] if texts else None
    if waited["status"] == RunStatus.COMPLETED:
        return progress or "Child task completed without an assistant result."
    head = f"Child task ended with status {waited['status']}"
    if waited.get("statusReason"):
        head += f": {waited['statusReason']}"
    return head + (f"\n\nProgress before it ended:\n{progress}" if progress else "")


EFFECTS["link.await"] = EffectKind(_await_remote, replay_safe=True)


# =============================================================================================
# The operations: each core handler, wrapped


_Handler = Callable[[Toolkit, Call, Args], Awaitable[Any]]


def _capabilities(core: _Handler) -> _Handler:
    async def handler(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
        result = await core(kit, call, args)
        for entry in result["providers"]:
            entry["environmentId"] = kit.ctx.environment_id
        links = _links(kit)
        envs = list(links.environments.values())
        if args.get("localOnly"):
            return {**result, "linkedEnvironments": []}
        answers = await asyncio.gather(*(links.call(env, "orchestrator_capabilities", {
            **{k: v for k, v in args.items() if k == "search"}, "localOnly": True})
            for env in envs), return_exceptions=True)
        result["linkedEnvironments"] = []
        for env, answer in zip(envs, answers):
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer
            error = str(answer) if isinstance(answer, Exception) else None
            result["linkedEnvironments"].append({"environmentId": env.id, "reachable": not error,
                                                 "error": error})
            for entry in [] if error else answer["providers"]:  # type: ignore[index]
                if entry.get("environmentId", env.id) == env.id:  # (its own instances only)
                    result["providers"].append({**entry, "environmentId": env.id})
        return result
    return handler


def _delegate(core: _Handler) -> _Handler:
    async def handler(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
        env, target = _target_route(kit, args.get("target"))
        if env is None:
            local = {**args, "target": target} if target else args
            return await core(kit, call, local)  # type: ignore[no-any-return]
        return await _delegate_remote(kit, call, args, env, target or {})
    return handler


def _task_tool(core: _Handler, remote: Callable[[Toolkit, str, Args], Awaitable[Any]]
               ) -> _Handler:
    async def handler(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
        parent_id = kit.thread_caller(call.scope, "task tools")
        if await _remote_task(kit, parent_id, args["taskId"]) is None:
            return await core(kit, call, args)  # type: ignore[no-any-return]
        return await remote(kit, parent_id, args)  # type: ignore[no-any-return]
    return handler


async def _remote_task_status(kit: Toolkit, parent_id: str, args: Args) -> dict[str, Any]:
    return await _remote_task_result(kit, parent_id, args["taskId"])


async def _remote_task_cancel(kit: Toolkit, parent_id: str, args: Args) -> dict[str, Any]:
    """Recorded here first (no wake; a late success counts as interrupted), then the remote
    run is interrupted; the watch finalizes the task when it ends."""
    task = await _remote_task(kit, parent_id, args["taskId"])
    assert task is not None
    if task.status in orch.TASK_TERMINAL:
        return {"taskId": task.id, "status": task.status}
    await kit.orch.dispatch(orch.RequestTaskCancel(
        command_id=kit.derive_id("command", "task-cancel", task.id, kit.key(args)),
        thread_id=parent_id, task_id=task.id, reason=args.get("reason")))
    env_id, thread_id = parse_link(task.child_thread_id) or ("", "")
    env = _links(kit).environments.get(env_id)
    if env is None:  # recorded here all the same: no wake, a late success is interrupted
        log.warning("task %s: the remote run was not interrupted: environment %s is not linked",
                    task.id, env_id)
    else:
        await _interrupt_remote(kit, env, thread_id, task.child_run_id, args.get("reason"),
                                task.id)
    return {"taskId": task.id, "status": "cancel_requested"}


def _creating(core: _Handler, name: str) -> _Handler:
    """create_threads and t3_thread_launch: made in the environment their targets name (one
    environment per call), with the caller's modes made explicit."""
    async def handler(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
        entries = args["threads"] if name == "create_threads" else [args]
        routes = [_target_route(kit, e.get("target")) for e in entries]
        envs = {env.id if env else None for env, _ in routes}
        if len(envs) > 1:
            raise T3Error(f"{name}: every thread of one call must target the same environment",
                          code="invalid_request")
        made = [{**e, **({"target": t} if t else {})} for e, (_, t) in zip(entries, routes)]
        env = routes[0][0]
        if env is None:
            local = {**args, "threads": made} if name == "create_threads" else made[0]
            return await core(kit, call, local)  # type: ignore[no-any-return]
        made = [{**e, **await _remote_modes(kit, call, e, name)} for e in made]
        remote = {**args, "threads": made} if name == "create_threads" else made[0]
        if "clientRequestId" in args:
            remote["clientRequestId"] = _remote_key(call.scope.key, args["clientRequestId"])
        made_there = await _links(kit).call(env, name, remote)
        return _as_here(call, made_there)  # type: ignore[no-any-return]
    return handler


def _thread_tool(core: _Handler, name: str) -> _Handler:
    """t3_thread_read, t3_thread_wait, t3_thread_send: a link to a linked environment's thread
    is read, waited on or sent to there."""
    async def handler(kit: Toolkit, call: Call, args: Args) -> dict[str, Any]:
        env, routed = _thread_route(kit, args)
        if env is None:
            return await core(kit, call, routed)  # type: ignore[no-any-return]
        links = _links(kit)
        if name == "t3_thread_send":
            await _send_ceiling(kit, call, env, routed)
            if "clientRequestId" in args:
                routed["clientRequestId"] = _remote_key(call.scope.key, args["clientRequestId"])
            if routed.get("target"):
                routed["target"] = _target_route(kit, routed["target"])[1]
        if name == "t3_thread_read" and call.scope.kind == "thread" and not (
                {"afterPosition", "beforePosition"} & set(args)):
            routed["beforePosition"] = 2 ** 31  # an agent reads the newest first, as here
        if name != "t3_thread_wait":
            return _as_here(call, await links.call(env, name, routed))
        return await _wait_remote_thread(kit, call, env, routed)
    return handler


def _as_here(call: Call, result: Any) -> Any:
    """A remote's result as this t3 shows it to the caller: ``webUrl`` (B's web view) only for a
    person's client, as here (``ServerContext.links``)."""
    if call.scope.kind == "client":
        return result
    if isinstance(result, list):
        return [_as_here(call, v) for v in result]
    if isinstance(result, dict):
        return {k: _as_here(call, v) for k, v in result.items() if k != "webUrl"}
    return result


async def _send_ceiling(kit: Toolkit, call: Call, env: Environment, args: Args) -> None:
    """An agent sends to a remote thread only with its own live run, and only to a thread no
    broader than itself (``Toolkit.require_live_caller``'s rule, with the remote's modes)."""
    if call.scope.kind != "thread":
        return
    caller, _ = await kit.agent_caller(call.scope, "t3_thread_send")
    assert caller.thread is not None
    thread = (await _links(kit).call(env, "t3_thread_read", {
        "threadId": args["threadId"], "limit": 1, "runLimit": 1}))["thread"]
    kit.ceiling(caller.thread, thread["runtimeMode"], thread["interactionMode"])


async def _wait_remote_thread(kit: Toolkit, call: Call, env: Environment, args: Args
                              ) -> dict[str, Any]:
    """t3_thread_wait on a remote thread: the remote's own wait, in slices of at most 25 s so
    that a caller who gave a progress token hears from this server meanwhile."""
    loop = asyncio.get_running_loop()
    timeout_s = args.get("timeoutMs", tools.DEFAULT_WAIT_MS) / 1000
    deadline = loop.time() + timeout_s
    routed = dict(args)
    while True:
        slice_ms = int(max(0.0, min(deadline - loop.time(), 25.0)) * 1000)
        result = await _links(kit).call(env, "t3_thread_wait", {**routed, "timeoutMs": slice_ms},
                                        timeout_s=slice_ms / 1000)
        if not result["timedOut"] or deadline - loop.time() <= 0 or kit.orch.stopping:
            return result
        routed["runId"] = result["runId"]  # the run the first slice pinned
        if call.progress is not None:
            await call.progress(timeout_s - (deadline - loop.time()), "waiting for the run")


def _capabilities_output(*, published: bool) -> dict[str, Any]:
    """orchestrator_capabilities' result here: each provider with its ``environmentId``, and
    ``linkedEnvironments`` (each reachable or not, and why). A remote's answer (``published``
    False) may leave both out."""
    schema = copy.deepcopy(tools.CAPABILITIES_OUTPUT)
    entry = schema["properties"]["providers"]["items"]
    entry["properties"]["environmentId"] = tools.STRING
    schema["properties"]["linkedEnvironments"] = tools.list_of(tools.shape({
        "environmentId": tools.STRING, "reachable": tools.BOOLEAN, "error": tools.OPT_STRING}))
    if published:
        entry["required"] = [*entry["required"], "environmentId"]
        schema["required"] = [*schema["required"], "linkedEnvironments"]
    return schema


# Output schemas a remote's answers are checked against.
_OUTPUTS: dict[str, Mapping[str, Any]] = {
    "create_threads": tools.CREATE_OUTPUT, "t3_thread_launch": tools.LAUNCH_OUTPUT,
    "t3_thread_read": tools.READ_OUTPUT, "t3_thread_wait": tools.WAIT_OUTPUT,
    "t3_thread_send": tools.SEND_OUTPUT, "t3_thread_interrupt": tools.INTERRUPT_OUTPUT,
    "orchestrator_capabilities": _capabilities_output(published=False)}
_LOCAL_ONLY = {"type": "boolean"}  # orchestrator_capabilities: list only this t3's providers


def install() -> None:
    """Wrap the core's operations (t3.py's load_features, once)."""
    by_name = {op.name: op for op in tools.OPERATIONS}
    wrappers: dict[str, Callable[[_Handler], _Handler]] = {
        "orchestrator_capabilities": _capabilities, "delegate_task": _delegate,
        "task_status": functools.partial(_task_tool, remote=_remote_task_status),
        "task_cancel": functools.partial(_task_tool, remote=_remote_task_cancel),
        **{n: functools.partial(_creating, name=n) for n in ("create_threads",
                                                            "t3_thread_launch")},
        **{n: functools.partial(_thread_tool, name=n)
           for n in ("t3_thread_read", "t3_thread_wait", "t3_thread_send")}}
    for name, wrap in wrappers.items():
        op: Operation = by_name[name]
        changes: dict[str, Any] = {"handler": wrap(op.handler)}
        if name == "orchestrator_capabilities":
            changes["output_schema"] = _capabilities_output(published=True)
            changes["input_schema"] = {**op.input_schema, "properties": {
                **op.input_schema["properties"], "localOnly": _LOCAL_ONLY}}
        tools.replace_operation(dataclasses.replace(op, **changes))


install()
