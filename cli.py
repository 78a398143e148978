"""cli.py: the commands for people (``python t3.py threads|show|new|send|wait|...``), which
``t3.py`` parses and hands to ``run_command``; the server never imports this module.

Each command finds the server through ``<data-dir>/server.json`` and talks to it only through
/ws with the client token (``WsClient``). It prints for people, inert (no control character
reaches the terminal), or one JSON document with --json; its exit code is stable. It prints
what the server shapes and adds up nothing: ``show`` reads a streaming message's text with
``readThread``. From ``t3.py`` it takes the client token's reader and the protocol version.
Each command is an entry of one table (``_command``): its usage, help and options beside the
handler that runs it, THREAD already resolved to a thread id.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import re
import signal
import ssl
import sys
import time
import urllib.parse
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, CloseConnection, Ping, RejectConnection, RejectData,
                            Request, TextMessage)

import t3
from orchestrator import (CONTROL_CHARACTERS, DECISIONS, RUN_TERMINAL, InteractionMode,
                          RunStatus, RuntimeMode, epoch_of)

__all__ = ["WsClient", "WsError", "CLI_EXIT_CODES", "CliError", "add_parsers", "run_command",
           "inert"]


# =============================================================================================
# A /ws client (what the commands for people use): wsproto, which hypercorn brings


class WsError(Exception):
    """A /ws request failed (``code`` is a typed failure), or the connection could not open
    (``status`` is the HTTP answer to the upgrade)."""

    def __init__(self, code: str, message: str, *, status: int | None = None,
                 detail: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.status, self.detail = code, status, dict(detail or {})


class WsClient:
    """One connection to a t3 server's /ws: ``request`` awaits a result, ``stream`` yields a
    subscription's items. Frames are read by one task and handed to the request they answer."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = urllib.parse.urlsplit(url), token
        self._ids = iter(range(1, 1 << 62))
        self._waiting: dict[int, asyncio.Queue[dict[str, Any] | None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> WsClient:
        tls = ssl.create_default_context() if self.url.scheme in ("wss", "https") else None
        reader, self._writer = await asyncio.open_connection(
            self.url.hostname, self.url.port or (443 if tls else 80), ssl=tls)
        self._ws = WSConnection(ConnectionType.CLIENT)
        target = f"{self.url.path or '/ws'}?orchestrationProtocol={t3.PROTOCOL_VERSION}"
        self._writer.write(self._ws.send(Request(
            host=self.url.netloc, target=target,
            extra_headers=[(b"authorization", f"Bearer {self.token}".encode())])))
        await self._handshake(reader)
        self._reader = asyncio.create_task(self._read(reader))
        return self

    async def __aexit__(self, *_: Any) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()

    async def _handshake(self, reader: asyncio.StreamReader) -> None:
        status, body = None, b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                raise WsError("connection_closed", "the server closed the connection",
                              status=status)
            self._ws.receive_data(chunk)
            for event in self._ws.events():
                if isinstance(event, AcceptConnection):
                    return
                if isinstance(event, RejectConnection):
                    status = event.status_code
                if isinstance(event, RejectData):
                    body += event.data
                    if event.body_finished:
                        detail = json.loads(body or b"{}")
                        raise WsError(detail.get("error") or detail.get("code") or "refused",
                                      detail.get("message", f"HTTP {status}"), status=status,
                                      detail=detail)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        text: list[str] = []
        try:
            while chunk := await reader.read(65536):
                self._ws.receive_data(chunk)
                for event in self._ws.events():
                    if isinstance(event, Ping):
                        self._send(event.response())
                    elif isinstance(event, TextMessage):
                        text.append(event.data)
                        if event.message_finished:
                            frame = json.loads("".join(text))
                            text.clear()
                            if (queue := self._waiting.get(frame.get("id"))) is not None:
                                queue.put_nowait(frame)
                    elif isinstance(event, CloseConnection):
                        return
        finally:
            for queue in self._waiting.values():
                queue.put_nowait(None)  # the connection is gone

    def _send(self, event: Any) -> None:
        assert self._writer is not None
        self._writer.write(self._ws.send(event))

    def _open(self, method: str, params: Mapping[str, Any]) -> tuple[int, asyncio.Queue[Any]]:
        request_id = next(self._ids)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._waiting[request_id] = queue
        self._frame(request_id, method, params)
        return request_id, queue

    def _frame(self, request_id: int, method: str, params: Mapping[str, Any]) -> None:
        self._send(TextMessage(data=json.dumps({"id": request_id, "method": method,
                                                "params": dict(params)})))

    async def request(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        request_id, queue = self._open(method, params or {})
        try:
            return _outcome(await queue.get())
        finally:
            del self._waiting[request_id]

    async def stream(self, method: str, params: Mapping[str, Any] | None = None
                     ) -> AsyncGenerator[dict[str, Any], None]:
        """The items of a subscription, until it ends (an error is raised)."""
        request_id, queue = self._open(method, params or {})
        ended = False
        try:
            while (frame := await queue.get()) is not None and "item" in frame:
                yield frame["item"]
            ended = True
            _outcome(frame)
        finally:
            del self._waiting[request_id]
            if not ended and self._writer is not None and not self._writer.is_closing():
                # left early (closed or cancelled): end it on the server too; the answer to
                # the unsubscribe is not awaited (no one is waiting for its id)
                self._frame(next(self._ids), "unsubscribe", {"id": request_id})


def _outcome(frame: Mapping[str, Any] | None) -> Any:
    if frame is None:
        raise WsError("connection_closed", "the server closed the connection")
    if "error" in frame:
        error = frame["error"]
        raise WsError(error.get("code", "orchestration_error"), error.get("message", ""),
                      detail=error)
    return frame.get("result")


# =============================================================================================
# Commands for people: finding and reaching the server, printing, exit codes (scripts rely on
# them), and the table of commands.


EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER, EXIT_UNFINISHED, EXIT_NOT_COMPLETED = 1, 2, 3, 4, 5
CLI_EXIT_CODES = """\
THREAD is a thread id or any part of one that only one thread has (`threads --all` lists them);
REQUEST likewise among the pending requests, ID among the scheduled tasks. TEXT `-` reads
standard input.

exit codes of the commands for people:
  0    success; for wait and show --until-done: the run completed (or the thread has none)
  1    the server refused or failed the operation (`t3: <code>: <message>` on stderr), or
       THREAD / REQUEST / ID matches nothing, or more than one
  2    usage error (options, or an answer that does not fit the request)
  3    no server: none is running for the data directory (no or stale server.json), or it
       cannot be reached, refuses the client token or closed the connection
  4    wait or show --until-done ended before the run did: --timeout passed, or a request of
       the run needs an answer (`requests`, `answer`)
  5    the run ended without completing: failed, interrupted, cancelled or rolled back
  130  stopped with Ctrl-C (show --follow then exits 0)"""
_CONNECT_TIMEOUT_S = 10.0
_WAIT_SLICE_S = 600.0  # the longest wait /ws takes in one request
_SPIN = "|/-\\"


class CliError(Exception):
    """A command could not do its work: the message is one line, ``exit`` its exit code."""

    def __init__(self, message: str, *, exit: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit = exit


def inert(text: str) -> str:
    """``text`` as a terminal shows it without acting on it: every control character but
    newline and tab (orchestrator.CONTROL_CHARACTERS: an agent's title, message or file name
    could set the window title, write the clipboard or clear the screen) escaped, as ``\\x1b``
    or ``<U+202E>``. Everything the commands print for people passes here; --json does not."""
    return text.translate(_inert_table())


@functools.cache
def _inert_table() -> dict[int, str]:
    return {c: f"\\x{c:02x}" if c < 0xA0 else f"<U+{c:04X}>"
            for c in CONTROL_CHARACTERS - {ord("\n"), ord("\t")}}


def run_command(args: argparse.Namespace) -> int:
    """One command for people: connect, run, print. Every failure is one line on stderr and an
    exit code; nothing but the command's output goes to stdout."""
    with contextlib.suppress(AttributeError, ValueError):  # text an ASCII terminal cannot show
        sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    # Ctrl-C is how a follow ends, yet a command started as a script's background job inherits
    # SIGINT ignored, and then asyncio.run installs no handler: the follower never stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return asyncio.run(_connected(args))
    except CliError as exc:
        print(inert(f"t3: {exc}"), file=sys.stderr)
        return exc.exit
    except KeyboardInterrupt:
        return 0 if getattr(args, "follow", False) else 130  # Ctrl-C is how a follow ends


async def _connected(args: argparse.Namespace) -> int:
    """Connects, resolves THREAD (and FORK) to a thread id, and runs the command."""
    data_dir, server, token = _server_of(args.data_dir)
    client = WsClient(server["wsUrl"], token)
    try:
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                await client.__aenter__()
        except (OSError, TimeoutError) as exc:
            raise _unreachable(data_dir, server, exc) from exc
        except WsError as exc:
            raise CliError(f"the server at {server['wsUrl']} refused the connection (HTTP "
                           f"{exc.status}): {exc}", exit=EXIT_NO_SERVER) from exc
        try:
            if getattr(args, "thread", None) is not None:
                args.thread = await _thread_ref(client, args.thread)
            return await _COMMANDS[args.command].run(client, args)
        except WsError as exc:
            if exc.code == "connection_closed":
                raise CliError("the server closed the connection (did it stop?)",
                               exit=EXIT_NO_SERVER) from exc
            raise CliError(f"{exc.code}: {exc}") from exc
    finally:
        await client.__aexit__(None, None, None)


def _server_of(value: str | None) -> tuple[Path, dict[str, Any], str]:
    """The data directory, its server.json and the client token; server.json says where the
    token goes, so it is trusted only in a directory private to this user. Creates nothing."""
    path = Path(value or os.environ.get("T3_HOME") or str(Path.home() / ".t3")).expanduser()
    path = path.resolve()
    start = f"start one with `python t3.py --data-dir {path}`"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CliError(f"no server is running for {path} (no such directory); {start}",
                       exit=EXIT_NO_SERVER) from None
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise CliError(f"refusing the data directory {path}: it is not private to this user, "
                       "so its server.json is not trusted with the client token",
                       exit=EXIT_NO_SERVER)
    try:
        with os.fdopen(os.open(path / "server.json", os.O_RDONLY | os.O_NOFOLLOW)) as f:
            server = json.loads(f.read(65536))
    except FileNotFoundError:
        raise CliError(f"no server is running for {path} (no server.json); {start}",
                       exit=EXIT_NO_SERVER) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path / 'server.json'}: {exc}", exit=EXIT_NO_SERVER) from exc
    url = server.get("wsUrl") if isinstance(server, dict) else None
    if not isinstance(url, str) or not url.startswith(("ws://", "wss://")):
        raise CliError(f"{path / 'server.json'} names no wsUrl; restart the server",
                       exit=EXIT_NO_SERVER)
    try:
        return path, server, t3._read_token(path / "client-token")
    except t3.DataDirError as exc:
        raise CliError(str(exc), exit=EXIT_NO_SERVER) from exc


def _unreachable(data_dir: Path, server: Mapping[str, Any], exc: BaseException) -> CliError:
    if isinstance(exc, ConnectionRefusedError):  # a running server listens before server.json
        return CliError(f"no server is running for {data_dir}: its server.json is stale (nothing "
                        f"listens at {server['wsUrl']}; the server, pid {server.get('pid')}, did "
                        f"not shut down cleanly); start one with `python t3.py --data-dir "
                        f"{data_dir}`", exit=EXIT_NO_SERVER)
    why = str(exc) or f"no answer in {_CONNECT_TIMEOUT_S:.0f} s"
    return CliError(f"cannot connect to the server at {server['wsUrl']} (pid "
                    f"{server.get('pid')}): {why}", exit=EXIT_NO_SERVER)


def _out(args: argparse.Namespace, document: Any, text: str, *, exit: int = 0) -> int:
    """With --json the document (one line), else the text for people; ``exit``."""
    print(json.dumps(document, ensure_ascii=False) if args.json else inert(text), flush=True)
    return exit


def _given(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _text_arg(text: str) -> str:
    text = sys.stdin.read() if text == "-" else text
    if not text.strip():
        raise CliError("TEXT is empty", exit=EXIT_USAGE)
    return text


def _pick(rows: Sequence[Mapping[str, Any]], text: str, *, key: str, what: str
          ) -> Mapping[str, Any] | None:
    """The row whose ``key`` is ``text``, else the only one whose ``key`` contains it."""
    found = [r for r in rows if r[key] == text] or [r for r in rows if text in r[key]]
    if len(found) > 1:
        raise CliError(f"ambiguous_reference: {text!r} is part of {len(found)} {what} ids ("
                       f"{', '.join(r[key] for r in found[:3])}{', ...' if len(found) > 3 else ''}"
                       "); give more of the id")
    return found[0] if found else None


async def _thread_ref(client: WsClient, text: str) -> str:
    """THREAD as a thread id among every project's threads (the shell snapshot); else as it is
    (the server may know it, or says thread_not_found)."""
    async with contextlib.aclosing(client.stream("subscribeShell")) as shell:
        snapshot = (await anext(shell))["snapshot"]
    found = _pick(snapshot["threads"], text, key="threadId", what="thread")
    return str(found["threadId"]) if found else text


async def _dispatch(client: WsClient, kind: str, **fields: Any) -> dict[str, Any]:
    """The client command ``kind`` over dispatchCommand, made here by the user."""
    return await client.request("dispatchCommand", {
        "type": kind, "commandId": _new_id(), "creationSource": "cli", **fields})


def _new_id() -> str:
    """A command's or request's id: 12 hex digits, the end of a thread id that a person types."""
    return uuid.uuid4().hex[:12]


def _pr_words(pr: Mapping[str, Any]) -> str:
    """A linked pull request for people: the host its link goes to, then owner/repo#N."""
    return f"{urllib.parse.urlsplit(pr['url']).hostname}/{pr['repository']}#{pr['number']}"


Handler = Callable[[WsClient, argparse.Namespace], Awaitable[int]]
Option = tuple[tuple[str, ...], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Command:
    usage: str  # the name, then the required positionals: THREAD, FORK (a thread too), ...
    summary: str
    description: str
    options: tuple[Option | list[Option], ...]  # a list: options that exclude each other
    run: Handler


_COMMANDS: dict[str, _Command] = {}  # in the order --help lists them


def _command(usage: str, summary: str, description: str, *options: Option | list[Option]
             ) -> Callable[[Handler], Handler]:
    """Registers the handler it decorates as the command ``usage`` names."""
    def register(run: Handler) -> Handler:
        _COMMANDS[usage.split()[0]] = _Command(usage, summary, description, options, run)
        return run
    return register


def _arg(*flags: str, **settings: Any) -> Option:
    return flags, settings


def add_parsers(sub: Any) -> None:
    """The commands for people, each with --data-dir and --json."""
    for command in _COMMANDS.values():
        name, *positionals = command.usage.split()
        parser = sub.add_parser(name, help=command.summary, description=command.description,
                                epilog=CLI_EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--data-dir", default=argparse.SUPPRESS,
                            help="the server's data directory (default: $T3_HOME, else ~/.t3)")
        parser.add_argument("--json", action="store_true",
                            help="print one JSON document (for scripts) instead of text")
        for metavar in positionals:
            parser.add_argument("thread" if metavar == "FORK" else metavar.lower(),
                                metavar=metavar)
        for option in command.options:
            group = parser.add_mutually_exclusive_group() if isinstance(option, list) else parser
            for flags, settings in option if isinstance(option, list) else [option]:
                group.add_argument(*flags, **settings)


_PROJECT = _arg("--project", help="project id (default: the first configured)")
_PROVIDER = _arg("--provider", help="provider instance id (default: the first available)")
_REASON = _arg("--reason", help="recorded in the timeline")


# =============================================================================================
# Commands for people: list, show, start, steer, wait for and answer threads.


@_command("threads", "list threads with their status",
          "List a project's threads, newest activity first: the status of the latest run, the "
          "id, the title.", _PROJECT,
          _arg("--all", action="store_true", help="include delegated (task) threads"),
          _arg("--status", action="append", choices=["idle", *RunStatus],
               help="only threads whose latest run has this status (repeatable)"),
          _arg("--title", help="only threads whose title contains this"),
          _arg("--archived", action="store_true", help="only archived threads"),
          _arg("--snoozed", action=argparse.BooleanOptionalAction,
               help="only snoozed threads (--no-snoozed: only the others)"),
          _arg("--limit", type=int, default=50, help="at most this many (1-100; 50)"))
async def _threads(client: WsClient, args: argparse.Namespace) -> int:
    listed = await client.request("listThreads", {
        "includeSubagents": args.all, "limit": args.limit, **_given(
            projectId=args.project, statuses=args.status, titleContains=args.title,
            archived=args.archived or None, snoozed=args.snoozed)})
    rows = [f"{t['status']:<11} {t['threadId']}  {t['title']}"
            + (f"  [PR {_pr_words(pr)}]" if (pr := t["linkedPullRequest"]) else "")
            + ("  [snoozed]" if t["snoozed"] else "")
            + (f"  [{t['pendingRequestCount']} pending]" if t["pendingRequestCount"] else "")
            + (f"  ({'fork' if t['relationshipToParent'] == 'fork' else 'task'} of "
               f"{t['parentThreadId']})" if t["parentThreadId"] else "")
            for t in listed["threads"]]
    if listed["total"] > len(rows):
        rows.append(f"({listed['total'] - len(rows)} more; --limit shows up to 100)")
    return _out(args, listed, "\n".join(rows) or f"no threads in project {listed['projectId']}")


@_command("show THREAD", "a thread's timeline, or follow it live",
          "Print a thread's timeline: user and assistant messages, tool calls, approvals, "
          "questions, tasks and errors, in order. With --json, one JSON document {thread, runs, "
          "items}; followed, one JSON object per line.",
          _arg("--follow", "-f", action="store_true",
               help="keep printing what happens until Ctrl-C"),
          _arg("--until-done", action="store_true",
               help="follow until the latest run ends (exit codes as for wait)"))
async def _show(client: WsClient, args: argparse.Namespace) -> int:
    view = _Timeline(client, args.thread, json_lines=args.json)
    try:
        if args.follow or args.until_done:
            return await view.follow(until_done=args.until_done)
        view.load((await client.request("getThreadProjection", {"threadId": args.thread}))[
            "projection"])
        if args.json:
            return _out(args, view.document(), "")
        view.print_all()
        return 0
    finally:  # a message's line left open: done, Ctrl-C, or the server gone
        view.end_line()


@_command("new", "start a thread", "Start a thread (and its first run, given TEXT); print its id.",
          _arg("text", metavar="TEXT", nargs="?", help="the first message"), _PROVIDER,
          _arg("--model", help="model (default: the provider's first)"), _PROJECT,
          _arg("--scratch", action="store_true",
               help="run in a fresh folder of its own instead of a project"),
          _arg("--worktree", metavar="BASE",
               help="run in a new git worktree on a new branch from BASE (a ref)"),
          _arg("--existing-worktree", metavar="PATH",
               help="run in this existing worktree of the project's repository"),
          _arg("--branch", help="the new worktree's branch (default t3/<hash>); with "
                                "--existing-worktree, the branch it must be on"),
          _arg("--from-origin", action="store_true",
               help="with --worktree: fetch origin and start from origin/BASE"),
          _arg("--title", help="title (default: from TEXT)"),
          _arg("--runtime-mode", choices=list(RuntimeMode),
               help="what the agent may do without asking (default full-access)"),
          _arg("--interaction-mode", choices=list(InteractionMode)))
async def _new(client: WsClient, args: argparse.Namespace) -> int:
    selection = _given(instanceId=args.provider, model=args.model)
    launched = await client.request("launchThread", {
        "commandId": _new_id(), "creationSource": "cli", **_given(
            initialMessage={"text": _text_arg(args.text)} if args.text is not None else None,
            projectId=args.project, title=args.title, runtimeMode=args.runtime_mode,
            interactionMode=args.interaction_mode, modelSelection=selection or None,
            scratch=args.scratch or None, workspaceStrategy=_strategy_arg(args))})
    thread = launched["projection"]["thread"]
    _out(args, {"threadId": launched["threadId"], "runId": launched["runId"],
                "title": thread["title"], "projectId": thread["projectId"],
                "providerInstanceId": thread["providerInstanceId"],
                "model": thread["modelSelection"].get("model"),
                "runtimeMode": thread["runtimeMode"], "branch": thread.get("branch"),
                "workspacePath": thread.get("workspace")}, launched["threadId"])
    if not args.json and sys.stdout.isatty():
        print(f"follow it: python t3.py show {launched['threadId'].rsplit(':', 1)[-1]} --follow",
              file=sys.stderr)
    return 0


def _strategy_arg(args: argparse.Namespace) -> dict[str, Any] | None:
    """``new``'s workspace options as a workspaceStrategy (None: the project root)."""
    if args.worktree and args.existing_worktree:
        raise CliError("--worktree and --existing-worktree exclude each other", exit=EXIT_USAGE)
    if (args.branch or args.from_origin) and not (args.worktree or args.existing_worktree):
        raise CliError("--branch and --from-origin go with --worktree", exit=EXIT_USAGE)
    if args.worktree:
        return _given(type="worktree", baseRef=args.worktree, branch=args.branch,
                      startFromOrigin=args.from_origin or None)
    if args.existing_worktree:
        return _given(type="existing_worktree", branch=args.branch,
                      worktreePath=str(Path(args.existing_worktree).resolve()))
    return None


@_command("send THREAD", "send a message to a thread",
          "Send TEXT to a thread: auto starts an idle thread or steers its active turn; queue "
          "runs it after; steer and restart need an active turn.",
          _arg("text", metavar="TEXT"),
          _arg("--mode", choices=["auto", "queue", "steer", "restart"], default="auto"),
          _arg("--provider", help="switch the thread to this provider instance first"),
          _arg("--model", help="switch the thread to this model first"))
async def _send(client: WsClient, args: argparse.Namespace) -> int:
    target = _given(providerInstanceId=args.provider, model=args.model)
    sent = await client.request("sendToThread", {
        "threadId": args.thread, "message": _text_arg(args.text), "mode": args.mode,
        "creationSource": "cli", **_given(target=target or None)})
    return _out(args, sent, f"{sent.get('delivery') or 'sent'}: {sent['runId']} ({sent['status']})")


@_command("switch THREAD", "send a thread's next runs to another provider or model",
          "Switch a thread to provider instance ID (and model M): its next run goes there, with "
          "a context handoff of the conversation that provider missed.",
          _arg("--provider", required=True, metavar="ID"), _arg("--model", metavar="M"))
async def _switch(client: WsClient, args: argparse.Namespace) -> int:
    done = (await _dispatch(client, "provider.switch", threadId=args.thread, modelSelection=_given(
        instanceId=args.provider, model=args.model)))["result"]
    return _out(args, done, f"switched {args.thread} to {done['providerInstanceId']}"
                + (f" ({done['model']})" if done.get("model") else "")
                + f"; runtime mode {done['runtimeMode']}")


@_command("rollback THREAD", "take a thread's workspace and conversation back to run N",
          "Restore the files to run N's checkpoint (0: before the first run), mark the later "
          "runs rolled_back; the next message continues from run N.",
          _arg("--run", type=int, required=True, metavar="N"))
async def _rollback(client: WsClient, args: argparse.Namespace) -> int:
    done = await client.request("rollbackThread", {
        "threadId": args.thread, "runOrdinal": args.run, "creationSource": "cli"})
    if done["status"] != "completed":
        return _out(args, done, f"rollback of {args.thread} {done['status']}: "
                    f"{done['reason'] or 'still restoring'}", exit=EXIT_FAILED)
    return _out(args, done, f"rolled {args.thread} back to run {done['ordinal']} ("
                f"{len(done['rolledBackRunIds'])} later run(s) rolled back)")


@_command("wait THREAD", "wait for a thread's run to end",
          "Wait until the thread's latest run (or --run) ends, or one of its requests needs an "
          "answer; the exit code says which.",
          _arg("--run", help="this run instead of the latest"),
          _arg("--timeout", type=float, metavar="SECONDS",
               help="give up after this long (default: no limit); the run goes on"))
async def _wait(client: WsClient, args: argparse.Namespace) -> int:
    async with _spinner(args, f"waiting for {args.thread}"):
        result = await _wait_for(client, args.thread, run_id=args.run, timeout_s=args.timeout)
    code, text = _wait_outcome(result)
    return _out(args, result, text, exit=code)


async def _wait_for(client: WsClient, thread_id: str, *, run_id: str | None,
                    timeout_s: float | None) -> dict[str, Any]:
    """waitForThread in slices of at most 600 s, on the run the first slice chose, until the
    run ends, a request of it needs an answer, or ``timeout_s`` (None: no limit)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while True:
        remaining = _WAIT_SLICE_S if deadline is None else max(0.0, deadline - loop.time())
        slice_s = min(_WAIT_SLICE_S, remaining)
        started = loop.time()
        result: dict[str, Any] = await client.request("waitForThread", {
            "threadId": thread_id, "timeoutMs": int(slice_s * 1000), **_given(runId=run_id)})
        run_id = result["runId"]
        if not result["timedOut"] or (deadline is not None and loop.time() >= deadline):
            return result
        if loop.time() - started + 1.0 < slice_s:  # only a stopping server ends a wait early
            raise CliError("the server ended the wait early (is it shutting down?)",
                           exit=EXIT_NO_SERVER)


def _wait_outcome(result: Mapping[str, Any]) -> tuple[int, str]:
    """The exit code and the line for people that a wait's result makes."""
    run, status, approval = result["runId"], result["status"], result.get("pendingApproval")
    if run is None:
        return 0, f"idle: {result['threadId']} has no run"
    if approval:
        return EXIT_UNFINISHED, (f"needs an answer: {approval['kind']} request "
                                 f"{approval['requestId']} of {run} (`python t3.py answer`)")
    if result.get("hasPendingQuestion"):
        return EXIT_UNFINISHED, f"needs an answer: {run} asks a question (`python t3.py requests`)"
    if result["timedOut"]:
        return EXIT_UNFINISHED, f"timed out: {run} is still {status}"
    reason = f" ({result['statusReason']})" if result.get("statusReason") else ""
    return 0 if status == "completed" else EXIT_NOT_COMPLETED, f"{status}: {run}{reason}"


@contextlib.asynccontextmanager
async def _spinner(args: argparse.Namespace, label: str) -> AsyncIterator[None]:
    """A progress line on stderr while waiting, only when stdout is a terminal."""
    if args.json or not sys.stdout.isatty() or not sys.stderr.isatty():
        yield
        return

    async def spin() -> None:
        started = time.monotonic()
        for turn in itertools.count():
            sys.stderr.write(f"\r{_SPIN[turn % 4]} {label} "
                             f"({time.monotonic() - started:.0f} s)\033[K")
            sys.stderr.flush()
            await asyncio.sleep(0.2)  # animation, not synchronisation
    task = asyncio.create_task(spin())
    try:
        yield
    finally:
        task.cancel()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


@_command("interrupt THREAD", "interrupt a thread's active run",
          "Interrupt the thread's newest active run (or --run).",
          _arg("--run", help="this run (it must be the newest active one)"), _REASON)
async def _interrupt(client: WsClient, args: argparse.Namespace) -> int:
    result = await client.request("interruptThread", {"threadId": args.thread, **_given(
        runId=args.run, reason=args.reason)})
    return _out(args, result, {
        "no_active_run": f"nothing to interrupt: {args.thread} has no active run",
        "interrupt_requested": f"interrupt requested: {result['runId']}"}.get(
        result["status"], f"already {result['status']}: {result['runId']}"))


@_command("stop THREAD", "stop a thread: interrupt its turn, hold its queue",
          "Stop a thread: interrupt its running turn and hold its queued turns until `resume` "
          "(held turns survive a server restart).", _REASON)
async def _stop(client: WsClient, args: argparse.Namespace) -> int:
    """stop (thread.stop), and resume (thread.resume)."""
    result = (await _dispatch(client, f"thread.{args.command}", threadId=args.thread,
                              **_given(reason=getattr(args, "reason", None))))["result"]
    if args.command == "resume":
        text = f"resumed {args.thread}: {len(result['releasedRunIds'])} queued run(s) released"
    else:
        text = (f"stopped {args.thread}: {len(result['interruptedRunIds'])} run(s) interrupted, "
                f"{len(result['heldRunIds'])} queued run(s) held (`resume` releases them)")
    return _out(args, result, text)


_command("resume THREAD", "release a stopped thread's held turns",
         "Release the turns a Stop held, in their queue order.")(_stop)


@_command("requests", "list pending approvals and questions",
          "List the pending requests (approvals and questions) of every thread, or of THREAD.",
          _arg("of", metavar="THREAD", nargs="?"))
async def _requests(client: WsClient, args: argparse.Namespace) -> int:
    # THREAD is resolved here, not before the command: an empty one means every thread
    params = {"threadId": await _thread_ref(client, args.of)} if args.of else {}
    listed = await client.request("listPendingRequests", params)
    rows = [f"{r['requestId']}  {r['kind']}: {r['title']}\n    thread {r['threadId']}; answer "
            + ("TEXT, decline or cancel" if r["kind"] == "user_input"
               else "accept, acceptForSession, decline or cancel") for r in listed["requests"]]
    return _out(args, listed, "\n".join(rows) or "no pending requests")


@_command("answer REQUEST", "answer a pending request",
          "Answer a pending request. An approval: accept, acceptForSession, decline or cancel. A "
          "question: decline, cancel, a JSON object of answers, or one TEXT per question in "
          "order (a multi-select question takes labels separated by commas).",
          _arg("answer", metavar="accept|decline|TEXT", nargs="+"))
async def _answer(client: WsClient, args: argparse.Namespace) -> int:
    pending = (await client.request("listPendingRequests"))["requests"]
    request = _pick(pending, args.request, key="requestId", what="pending request")
    if request is None:
        raise CliError(f"request_not_found: no pending request matches {args.request!r} "
                       "(`python t3.py requests` lists them)")
    result = await _dispatch(client, "runtime-request.respond", threadId=request["threadId"],
                             requestId=request["requestId"], **_response(request, args.answer))
    return _out(args, result, f"answered {request['requestId']}: "
                              f"{result['result'].get('status', 'resolved')}")


def _response(request: Mapping[str, Any], texts: Sequence[str]) -> dict[str, Any]:
    """``decision`` for a decision word (a question takes only decline and cancel), else
    ``answers``: a JSON object as given, or one TEXT per question of the request, in order
    (for a multi-select question, labels separated by commas)."""
    question = request["kind"] == "user_input"
    if len(texts) == 1 and texts[0] in DECISIONS and (
            not question or texts[0] in ("decline", "cancel")):
        return {"decision": texts[0]}
    if not question:
        raise CliError(f"a {request['kind']} request takes one of {', '.join(DECISIONS)}",
                       exit=EXIT_USAGE)
    if len(texts) == 1 and texts[0].lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            if isinstance(answers := json.loads(texts[0]), dict):
                return {"answers": answers}
        raise CliError("the answers are not a JSON object", exit=EXIT_USAGE)
    questions = (request.get("detail") or {}).get("questions") or []
    if len(questions) != len(texts):
        asked = "".join(f"; {i + 1}. {q.get('question')}" for i, q in enumerate(questions))
        raise CliError(f"this request asks {len(questions)} question(s){asked}: give one TEXT "
                       "per question, in order, or a JSON object of answers", exit=EXIT_USAGE)
    return {"answers": {str(q.get("id") or q.get("question") or f"q{i}"): _answer_value(q, text)
                        for i, (q, text) in enumerate(zip(questions, texts))}}


def _answer_value(question: Mapping[str, Any], text: str) -> str | list[str]:
    labels = {o.get("label") for o in question.get("options") or [] if isinstance(o, dict)}
    parts = [p.strip() for p in text.split(",")]
    return parts if question.get("multiSelect") and set(parts) <= labels else text


@_command("tasks THREAD", "a thread's delegated tasks, as a tree",
          "Print the tasks the thread delegated, each with its status and child thread, and "
          "their own tasks below them.")
async def _tasks(client: WsClient, args: argparse.Namespace) -> int:
    tree = await _task_tree(client, args.thread, {args.thread})
    lines = [f"{tree['threadId']}  {tree['title']} ({tree['status']})"]

    def walk(tasks: Sequence[Mapping[str, Any]], indent: str) -> None:
        for i, task in enumerate(tasks):
            last = i == len(tasks) - 1
            lines.append(f"{indent}{'`-- ' if last else '|-- '}{task['title']} ({task['status']})"
                         f"  {task['threadId']}  {task['providerInstanceId']}")
            walk(task["tasks"], indent + ("    " if last else "|   "))
    walk(tree["tasks"], "")
    return _out(args, tree, "\n".join(lines if tree["tasks"] else [*lines, "(no delegated tasks)"]))


async def _task_tree(client: WsClient, thread_id: str, seen: set[str]) -> dict[str, Any]:
    """The thread and its delegated tasks, each with its child thread's own tasks."""
    projection = (await client.request("getThreadProjection", {"threadId": thread_id}))[
        "projection"]
    latest = max(projection["runs"], key=lambda r: r["ordinal"], default=None)
    tasks = []
    for task in sorted(projection["subagents"], key=lambda s: (s["startedAt"], s["id"])):
        child = task["childThreadId"]
        tasks.append({"taskId": task["id"], "title": task["title"], "status": task["status"],
                      "threadId": child, "providerInstanceId": task["providerInstanceId"],
                      "model": task["model"], "result": task["result"], "tasks": []})
        if child not in seen:
            seen.add(child)
            with contextlib.suppress(WsError):  # a child thread deleted since
                tasks[-1]["tasks"] = (await _task_tree(client, child, seen))["tasks"]
    return {"threadId": thread_id, "title": (projection["thread"] or {}).get("title"),
            "status": latest["status"] if latest else "idle", "tasks": tasks}


# =============================================================================================
# Commands for people: show's timeline, a thread's entities as the server sends them (followed:
# as they change, through subscribeThread).


class _Timeline:
    """A thread's timeline for people, in position order, a line where the run changes; followed,
    a growing message prints only its new text. With ``json_lines``: each new or changed item or
    run is one JSON line instead (``{"kind": "thread" | "run" | "item", ...}``). Each entity is
    as the server last sent it (in the snapshot, then whole in an event), but for the streamed
    text of an open message: that it reads from the server (readThread), never adds up."""

    def __init__(self, client: WsClient, thread_id: str, *, json_lines: bool) -> None:
        self.client, self.thread_id, self.json_lines = client, thread_id, json_lines
        self.thread: dict[str, Any] = {}
        self.entities: dict[str, dict[str, dict[str, Any]]] = {
            "run": {}, "message": {}, "turn-item": {}}  # by their events' names
        self._item_of: dict[str, str] = {}  # message id -> its item's id
        self._shown: dict[str, Any] = {}  # item id -> what of it was printed
        self._open: str | None = None  # the item whose message is printing, its line open
        self._run: str | None = None  # the run of the item printed last
        self._ended: set[str] = set()  # the runs whose end line was printed

    async def follow(self, *, until_done: bool) -> int:
        params: dict[str, Any] = {"threadId": self.thread_id}
        while True:  # again from the last sequence seen when the stream fell behind
            try:
                async with contextlib.aclosing(self.client.stream("subscribeThread", params)
                                               ) as stream:
                    async for item in stream:
                        if item["kind"] == "snapshot":
                            self.load(item["projection"])
                            self.print_all()
                            continue
                        if item["kind"] == "event":
                            await self._apply(item["event"])
                        params["afterSequence"] = item["sequence"]
                        if until_done and (code := self._finished()) is not None:
                            return code
            except WsError as exc:
                if exc.code != "resubscribe":
                    raise

    def load(self, projection: Mapping[str, Any]) -> None:
        self.thread = projection["thread"] or {}
        for kind, key in (("run", "runs"), ("message", "messages"), ("turn-item", "turnItems")):
            for entity in projection[key]:
                self._put(kind, entity)

    def document(self) -> dict[str, Any]:
        return {"thread": self.thread, "runs": self._runs(),
                "items": [self._shape(i) for i in self._items()]}

    def print_all(self) -> None:
        t, runs = self.thread, self._runs()
        if self.json_lines:
            for line in [{"kind": "thread", **t}, *({"kind": "run", **r} for r in runs)]:
                self._line(line)
        else:
            self._say(f"{t.get('title')}  {t.get('id')}\n"
                      f"{runs[-1]['status'] if runs else 'idle'} | {t.get('providerInstanceId')}"
                      f"/{(t.get('modelSelection') or {}).get('model')} | {t.get('runtimeMode')}"
                      + (f" | PR {_pr_words(pr)} {pr['url']}"
                         if (pr := t.get("linkedPullRequest")) else ""))
        for item in self._items():
            self._show(item)
        sys.stdout.flush()  # followed, a message still streaming keeps its line open

    def end_line(self) -> None:
        if self._open is not None:
            print()
            self._open = None

    def _put(self, kind: str, entity: dict[str, Any]) -> None:
        self.entities[kind][entity["id"]] = entity
        if kind == "turn-item" and entity.get("messageId"):
            self._item_of[entity["messageId"]] = entity["id"]

    async def _apply(self, event: Mapping[str, Any]) -> None:
        kind, payload = event["type"].rsplit(".", 1)[0], event["payload"]  # thread.archived...
        runs, messages, items = (self.entities[k] for k in ("run", "message", "turn-item"))
        item_id = payload["id"] if kind == "turn-item" else self._item_of.get(payload.get("id", ""))
        before = runs.get(payload["id"]) if kind == "run" else None
        if kind == "thread":
            self.thread = payload
        elif kind == "message-text" and item_id in items:  # an open message grew
            messages[payload["id"]] = {**messages.get(payload["id"], {}),
                                       "text": await self._text_now(items[item_id])}
        elif kind in self.entities:
            self._put(kind, payload)
        if kind == "run" and (before is None or before["status"] != payload["status"]):
            self._run_changed(payload)
        elif item_id in items:
            self._show(items[item_id])
        sys.stdout.flush()

    async def _text_now(self, item: Mapping[str, Any]) -> str:
        """A message item's text as the server has it now (as it was when longer than one
        readThread page holds: the message's close brings it whole)."""
        read = await self.client.request("readThread", {
            "threadId": self.thread_id, "view": "activity", "afterPosition": item["position"] - 1,
            "limit": 1, "runLimit": 1, "maxCharsPerItem": 50_000})
        found = next((i for i in read["items"] if i["itemId"] == item["id"]), None)
        return str((self._shape(item) if found is None or found["textTruncated"] else found)[
            "text"])

    def _finished(self) -> int | None:
        """None while the latest run goes on; else, its end line printed (also for a run that
        ended before the follow began), the exit code `wait` would give."""
        status = runs[-1]["status"] if (runs := self._runs()) else "completed"
        if status != "completed" and status not in RUN_TERMINAL:
            return None
        if not self.json_lines and runs and runs[-1]["id"] not in self._ended:
            self._run_changed(runs[-1])
        return 0 if status == "completed" else EXIT_NOT_COMPLETED

    def _runs(self) -> list[dict[str, Any]]:
        return sorted(self.entities["run"].values(), key=lambda r: r["ordinal"])

    def _items(self) -> list[dict[str, Any]]:
        return sorted(self.entities["turn-item"].values(), key=lambda i: i["position"])

    def _shape(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """A turn item as --json shows it: a message's item with the message's text and role."""
        message = self.entities["message"].get(item.get("messageId") or "") or {}
        text = message.get("text") if item.get("messageId") else item.get("text")
        return {"position": item["position"], "itemId": item["id"], "runId": item["runId"],
                "type": item["type"], "status": item["status"], "title": item.get("title"),
                "text": str(text or ""), "role": message.get("role"), "data": item.get("data")}

    def _show(self, item: Mapping[str, Any]) -> None:
        shaped = self._shape(item)
        now = (item["status"], item.get("title"), text := shaped["text"])
        before = self._shown.get(item["id"])
        if before == now:
            return
        self._shown[item["id"]] = now
        if self.json_lines:
            self._line({"kind": "item", **shaped})
            return
        if item.get("messageId") and before is not None and text.startswith(before[2]):
            if text != before[2]:  # the message grew: only its new text
                if self._open != item["id"]:
                    self.end_line()
                    self._open = item["id"]
                self._say(text[len(before[2]):], end="")
            return
        self.end_line()
        if item["runId"] != self._run and (run := self.entities["run"].get(item["runId"])):
            self._run = item["runId"]
            self._say(f"--- run {run['ordinal']} ({run['status']}) on "
                      f"{run['providerInstanceId']}")
        streams = item["type"] in ("assistant_message", "reasoning")  # its line stays open
        self._say(_rendered(shaped), end="" if streams else "\n")
        self._open = item["id"] if streams else None

    def _run_changed(self, run: Mapping[str, Any]) -> None:
        if self.json_lines:
            self._line({"kind": "run", **run})
        elif run["status"] in RUN_TERMINAL:
            self._ended.add(run["id"])
            self.end_line()
            reason = f": {run['statusReason']}" if run.get("statusReason") else ""
            self._say(f"--- run {run['ordinal']} {run['status']}{reason}")

    @staticmethod
    def _line(document: Mapping[str, Any]) -> None:
        print(json.dumps(document, ensure_ascii=False), flush=True)

    @staticmethod
    def _say(text: str, end: str = "\n") -> None:
        sys.stdout.write(inert(text) + end)


_LABELS = {"tool_call": "tool", "approval_request": "approval", "user_input_request": "question",
           "todo_list": "plan", "subagent": "task", "run_interrupt_request": "interrupt",
           "workspace_setup": "workspace"}


def _rendered(item: Mapping[str, Any]) -> str:
    """One timeline item for people (a message's text, or a labelled line with its details)."""
    kind, data, text = item["type"], item.get("data") or {}, str(item["text"])
    if kind in ("user_message", "assistant_message", "reasoning"):
        return {"user_message": "> " + text.replace("\n", "\n> "),
                "reasoning": "(thinking) " + text}.get(kind, text)
    title = item.get("title") or ""
    if kind == "checkpoint":  # the files the run changed
        text = "\n".join(f"{f['kind']} +{f['additions']} -{f['deletions']} {f['path']}"
                         for f in data.get("files") or []) or data.get("reason") or text
    if kind == "user_input_request":  # each question with its choices
        text = "\n".join(f"{q.get('question')} [" + " / ".join(
            str(o.get("label")) for o in q.get("options") or []) + "]"
            for q in data.get("questions") or []) or text
    if not title and "\n" not in text:  # e.g. an interrupt's reason
        title, text = text, ""
    head = f"[{_LABELS.get(kind, kind)}] {title} ({item['status']})"
    if kind in ("approval_request", "user_input_request"):
        head += f" request {data.get('requestId')}"
    elif kind == "subagent":
        head += f" thread {data.get('childThreadId')}"
    if text and text != title:
        body = text if len(text) <= 600 else text[:600] + " [...]"
        head += "\n" + "\n".join("    " + line for line in body.splitlines())
    return head


# =============================================================================================
# Commands for people: scheduled tasks (schedules, schedule, unschedule), over the /ws methods
# that run the schedule tools' own code. ID is matched like THREAD, among the scheduled tasks.


@_command("schedules", "list scheduled tasks, with their next and last runs",
          "List the scheduled tasks: id, title, schedule, enabled, next run, the last run's "
          "status and time (its error below when it failed), the number of runs; times in this "
          "machine's time zone.",
          _arg("--all", action="store_true", help="include paused tasks"),
          _arg("--project", help="only this project's tasks"))
async def _schedules(client: WsClient, args: argparse.Namespace) -> int:
    listed = await client.request("listScheduledTasks", _given(projectId=args.project))
    tasks = [t for t in listed["tasks"] if args.all or t["enabled"]]
    rows = [["ID", "TITLE", "SCHEDULE", "ENABLED", "NEXT RUN", "LAST RUN", "RUNS"]] + [[
        t["scheduledTaskId"], t["title"], _schedule_words(t["schedule"]),
        "yes" if t["enabled"] else "paused", _local_time(t["nextRunAt"]),
        f"{t['lastRunStatus']} {_local_time(t['lastRunAt'])}".removesuffix(" -"),
        str(t["runCount"])] for t in tasks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [] if tasks else ["no scheduled tasks"]
    for row, task in zip(rows if tasks else [], [{}, *tasks]):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if task.get("lastRunError"):
            lines.append(f"    last error: {' '.join(task['lastRunError'].split())[:200]}")
    if paused := len(listed["tasks"]) - len(tasks):
        lines.append(f"({paused} paused; --all shows them)")
    return _out(args, {"tasks": tasks}, "\n".join(lines))


def _every_ms(text: str) -> int:
    """--every: 90s, 15m (a bare number is minutes), 2h, 1d."""
    match = re.fullmatch(r"(\d+)\s*(s|m|min|h|d)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 15m, 90s, 2h or 1d")
    return int(match[1]) * {"s": 1000, "h": 3_600_000, "d": 86_400_000}.get(
        match[2] or "m", 60_000)


_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]  # as schedules count: 0 = Sunday


def _weekdays(text: str) -> list[int]:
    """--weekdays: days (mon, monday, 0-6 with 0 = Sunday) and ranges (mon-fri, 1-5), by commas."""
    def day(part: str) -> int:
        part = part.strip().lower()[:3]
        if part in _DAYS or part.isdigit() and int(part) < 7:
            return _DAYS.index(part) if part in _DAYS else int(part)
        raise argparse.ArgumentTypeError(f"{part!r}: a day is mon..sun or 0..6 (0 = Sunday)")
    days: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        start = day(first)
        end = day(last) if last else start
        days.update((start + i) % 7 for i in range((end - start) % 7 + 1))
    return sorted(days)


@_command("schedule", "create or change a scheduled task",
          "Create a scheduled task: PROMPT runs on a schedule (--every, --at, or --webhook), each "
          "time in a fresh thread of the project; print its id, and a webhook task's URL (shown "
          "only then). With --id ID, change a task instead: only what is given changes.",
          _arg("prompt", metavar="PROMPT", nargs="?",
               help="what each run is asked (`-`: standard input)"),
          _arg("--id", metavar="ID", help="change this task instead of creating one"),
          _arg("--prompt", dest="prompt_option", metavar="PROMPT",
               help="the new prompt (as PROMPT)"),
          [_arg("--every", type=_every_ms, metavar="DURATION",
                help="run every 15m, 90s, 2h, 1d, ... (a bare number is minutes; at least 1 "
                     "minute)"),
           _arg("--at", metavar="HH:MM", help="run daily at this time (the server's zone)"),
           _arg("--webhook", action="store_true",
                help="run when the task's webhook URL is called (printed once)")],
          _arg("--weekdays", type=_weekdays, metavar="DAYS",
               help="with --at, only on these days: mon-fri, sat,sun, 1,3,5 (0 = Sunday)"),
          _arg("--secret-header", metavar="H",
               help="with --webhook: the header that carries the HMAC-SHA256 signature"),
          _arg("--secret", metavar="S",
               help="with --webhook: the signing secret (`-`: standard input)"),
          _arg("--prefix", metavar="P",
               help="with --webhook: the signature's prefix, e.g. sha256="),
          _arg("--standard-webhooks", action="store_true",
               help="with --webhook and --secret whsec_...: check Standard Webhooks signatures "
                    "(webhook-id, webhook-timestamp, webhook-signature)"),
          _arg("--title", help="title (default: from PROMPT)"), _PROVIDER, _PROJECT,
          _arg("--runtime-mode", choices=list(RuntimeMode),
               help="what each run's agent may do without asking"),
          [_arg("--enable", dest="enabled", action="store_const", const=True,
                help="resume a paused task (its next run is aimed from now)"),
           _arg("--disable", "--disabled", dest="enabled", action="store_const", const=False,
                help="pause: no runs until --enable")],
          _arg("--run-now", action="store_true", help="also run it once now"),
          _arg("--rotate-hook-token", action="store_true",
               help="give a webhook task a new URL (printed once); the old one stops working"))
async def _schedule(client: WsClient, args: argparse.Namespace) -> int:
    params = _schedule_params(args)
    if args.id is not None:
        params["scheduledTaskId"] = await _schedule_ref(client, args.id)
    made = await client.request("scheduleTask", {
        "clientRequestId": _new_id(), **params, "creationSource": "cli"})
    hook = made.get("hookUrl")  # minted now, and never shown again
    return _out(args, made, made["scheduledTaskId"] + (
        f"\nwebhook URL (shown only now; it is the task's secret): {hook}" if hook else ""))


def _schedule_params(args: argparse.Namespace) -> dict[str, Any]:
    """schedule_task's arguments from the options; what is not given is left out (a change
    keeps it). The server checks the values; this checks what only options can get wrong."""
    def refuse(message: str) -> CliError:
        return CliError(message, exit=EXIT_USAGE)
    prompt = args.prompt_option if args.prompt_option is not None else args.prompt
    signature = _given(header=args.secret_header, prefix=args.prefix, secret=(
        sys.stdin.read().rstrip("\n") if args.secret == "-" else args.secret))
    if args.standard_webhooks:
        if not args.webhook or set(signature) != {"secret"}:
            raise refuse("--standard-webhooks goes with --webhook and --secret whsec_... "
                         "(its headers are fixed: no --secret-header or --prefix)")
        signature["scheme"] = "standard-webhooks"
    elif signature and not (args.webhook and {"header", "secret"} <= set(signature)):
        raise refuse("--secret-header and --secret (and --prefix) go together, with --webhook")
    if args.weekdays is not None and args.at is None:
        raise refuse("--weekdays goes with --at")
    schedule: dict[str, Any] | None = None
    if args.every is not None:
        schedule = {"type": "interval", "everyMs": args.every}
    elif args.at is not None:
        schedule = {"type": "fixed_time", "timeOfDay": args.at, **_given(weekdays=args.weekdays)}
    elif args.webhook:
        schedule = {"type": "webhook", **_given(signature=signature or None)}
    if args.id is None and (prompt is None or schedule is None):
        raise refuse("a new scheduled task needs PROMPT and one of --every, --at or --webhook "
                     "(or --id ID to change a task)")
    if args.id is not None and args.project is not None:
        raise refuse("--project: a task stays in the project it was made in")
    return _given(prompt=None if prompt is None else _text_arg(prompt), schedule=schedule,
                  title=args.title, projectId=args.project, runtimeMode=args.runtime_mode,
                  target=_given(providerInstanceId=args.provider) or None, enabled=args.enabled,
                  runNow=args.run_now or None, rotateHookToken=args.rotate_hook_token or None)


@_command("unschedule ID", "delete a scheduled task",
          "Delete a scheduled task for good (the threads of its past runs stay).")
async def _unschedule(client: WsClient, args: argparse.Namespace) -> int:
    deleted = await client.request("deleteScheduledTask", {
        "scheduledTaskId": await _schedule_ref(client, args.id), "creationSource": "cli"})
    return _out(args, deleted, f"deleted {deleted['scheduledTaskId']}")


async def _schedule_ref(client: WsClient, text: str) -> str:
    found = _pick((await client.request("listScheduledTasks"))["tasks"], text,
                  key="scheduledTaskId", what="scheduled task")
    return str(found["scheduledTaskId"]) if found else text


def _schedule_words(schedule: Mapping[str, Any]) -> str:
    """A schedule for people, as the web view words it too: "every 15 min", "every 90 s",
    "09:00 Mon-Fri", "09:00 Sat,Sun", "09:00 Mon,Wed", "09:00 daily", "webhook"."""
    if schedule["type"] == "interval":
        every = schedule["everyMs"]
        return f"every {every // 60_000} min" if every % 60_000 == 0 else \
            f"every {every / 1000:g} s"
    if schedule["type"] != "fixed_time":
        return str(schedule["type"])
    days = sorted(schedule.get("weekdays") or range(7), key=lambda d: (d + 6) % 7)  # Mon first
    named = {(1, 2, 3, 4, 5): "Mon-Fri", (6, 0): "Sat,Sun", (1, 2, 3, 4, 5, 6, 0): "daily"}
    return f"{schedule['timeOfDay']} " + (named.get(tuple(days)) or ",".join(
        _DAYS[d].title() for d in days))


def _local_time(iso: str | None) -> str:
    """A time t3 wrote, in this machine's time zone, to the minute; "-" for none."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch_of(iso))) if iso else "-"


# =============================================================================================
# Commands for people: a thread's title, pull request link and place (rename, link-pr,
# unlink-pr, archive, unarchive, delete, snooze, unsnooze, visit), what its runs changed (diff)
# and its history (fork, merge-back).


@_command("rename THREAD", "rename a thread, or have its agent title it",
          "Give a thread TITLE, or with --regenerate let its provider suggest a title from the "
          "first message (else one is made from that message).",
          _arg("title", metavar="TITLE", nargs="?"), _arg("--regenerate", action="store_true"))
async def _rename(client: WsClient, args: argparse.Namespace) -> int:
    if (args.title is None) != args.regenerate:
        raise CliError("give TITLE or --regenerate (not both)", exit=EXIT_USAGE)
    updated = await client.request("updateThread", {"threadId": args.thread, **(
        {"action": "regenerate_title"} if args.regenerate else
        {"action": "rename", "title": args.title})})
    regenerating = " (a new title is being generated)" if updated["titleRegeneration"] else ""
    return _out(args, updated, f"{updated['threadId']}: {updated['title']}{regenerating}")


@_command("link-pr THREAD URL", "link a pull request to a thread",
          "Link the pull request at URL (https://host/owner/repo/pull/N) to a thread.")
async def _link_pr(client: WsClient, args: argparse.Namespace) -> int:
    """link-pr, and unlink-pr."""
    updated = await client.request(
        "linkPullRequest" if args.command == "link-pr" else "unlinkPullRequest",
        {"threadId": args.thread, **_given(url=getattr(args, "url", None))})
    pr = updated["linkedPullRequest"]
    return _out(args, updated, f"{args.thread}: " + (
        f"{_pr_words(pr)} {pr['url']}" if pr else "no pull request linked"))


_command("unlink-pr THREAD", "remove a thread's pull request link",
         "Remove a thread's pull request link.")(_link_pr)


async def _lifecycle(client: WsClient, args: argparse.Namespace) -> int:
    """archive, unarchive, delete, unsnooze, visit and snooze: the thread.<command> command."""
    when = getattr(args, "until", None)
    if when is not None and re.fullmatch(r"\d+\s*(s|m|min|h|d)?", when.strip().lower()):
        when = str(time.time() + _every_ms(when) / 1000)  # a duration from now
    done = (await _dispatch(client, f"thread.{args.command}", threadId=args.thread,
                            **_given(snoozedUntil=when)))["result"]
    until = done.get("snoozedUntil")
    return _out(args, done, f"{args.command.removesuffix('e')}ed {args.thread}" + (
        f" until {_local_time(until)}" if until and args.command == "snooze" else ""))


for _name, _summary in (
        ("archive", "archive a thread: it leaves the list (threads --archived shows it); its "
                    "queued runs are cancelled"),
        ("unarchive", "bring an archived thread back to the list"),
        ("delete", "delete a thread for good: never listed or read again"),
        ("unsnooze", "wake a snoozed thread"), ("visit", "mark a thread as seen now")):
    _command(f"{_name} THREAD", _summary, _summary[0].upper() + _summary[1:] + ".")(_lifecycle)
_command("snooze THREAD UNTIL", "snooze a thread until a time",
         "Snooze a thread until UNTIL: a duration from now (30m, 2h, 1d) or an ISO time. It wakes "
         "early only for a pending request or a failed run.")(_lifecycle)


@_command("diff THREAD", "what a thread's runs changed in its workspace",
          "Print the files a thread changed (kind, lines added and deleted) and the unified "
          "diff, between its first and newest checkpoints, or of run N only (--run). Outside a "
          "git repository there are no checkpoints (exit 1).",
          _arg("--run", type=int, metavar="N", help="only run N (its ordinal, from 1)"))
async def _diff(client: WsClient, args: argparse.Namespace) -> int:
    method = "getFullThreadDiff" if args.run is None else "getTurnDiff"
    found = await client.request(method, {"threadId": args.thread, **_given(ordinal=args.run)})
    what = "the thread" if args.run is None else f"run {args.run}"
    if found["status"] != "ready":
        return _out(args, found, f"no diff for {what}: {found['reason']}", exit=EXIT_FAILED)
    lines = [f"{f['kind']:<9} +{f['additions']:<5} -{f['deletions']:<5} {f['path']}"
             for f in found["files"]] or [f"no changes in {what}"]
    return _out(args, found, "\n".join([*lines, "", found["diff"].rstrip("\n")] + (
        ["[diff truncated at 30,000 characters]"] if found["truncated"] else [])))


@_command("fork THREAD", "a new thread that continues from a point of this one",
          "Fork THREAD: a new thread with its conversation up to its latest completed run (or run "
          "N, or checkpoint ID), natively where the provider can, else as a context handoff; in "
          "git, in a new worktree at that point's checkpoint.",
          [_arg("--run", type=int, metavar="N", help="fork at run N (its ordinal)"),
           _arg("--checkpoint", metavar="ID", help="fork at this checkpoint")],
          _arg("--title", metavar="T", help="the fork's title (default: Fork of ...)"))
async def _fork(client: WsClient, args: argparse.Namespace) -> int:
    point = {"type": "run", "ordinal": args.run} if args.run is not None else \
        {"type": "checkpoint", "checkpointId": args.checkpoint} if args.checkpoint else \
        {"type": "latest_stable"}
    done = await client.request("forkThread", _given(
        commandId=_new_id(), sourceThreadId=args.thread, sourcePoint=point, title=args.title,
        creationSource="cli"))
    where = f" in worktree {done['worktreePath']} on {done['branch']}" \
        if done.get("worktreePath") and done["worktreePath"] == done.get("workspacePath") else ""
    return _out(args, done, f"forked {args.thread} at run {done['sourcePoint']['runOrdinal']} "
                f"into {done['threadId']}{where}")


@_command("merge-back FORK", "hand a fork's work back to the thread it was forked from",
          "Merge FORK back: its runs' conversation goes to the thread it was forked from, as a "
          "context handoff with that thread's next message.")
async def _merge_back(client: WsClient, args: argparse.Namespace) -> int:
    done = await client.request("mergeBack", {
        "commandId": _new_id(), "sourceThreadId": args.thread, "creationSource": "cli"})
    covered = done["coveredRunOrdinals"]
    return _out(args, done, f"merge-back of {args.thread} (runs {covered['from']}-"
                f"{covered['to']}) goes to {done['threadId']} with its next message")
