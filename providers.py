"""providers.py: the process rules, and the adapter and session every driver builds on.

An adapter is built per configured provider instance (drivers.py's ``build_adapter``, registry.py's
for ``acpRegistry``). It reports what it is (``info``: models, capabilities, whether it can run
and why not) and opens sessions: a session is one provider process serving one app thread. A
session turns its protocol into the domain's adapter events (``orchestrator.TextDelta``,
``ToolUpdate``, ``RuntimeRequestOpened``, ``TurnEnded``...) on ``session.events`` (an asyncio
queue; ``None`` = the process is gone, with ``session.exit_reason``).

Process rules: every provider process starts in its own process group (``start_new_session``)
and is recorded in ``<data-dir>/processes/<pid>`` (pid, start time, group, thread) before it is
told anything; the record goes when the process is reaped. Its group dies with t3, even on kill
-9: on Linux the kernel kills it (``PR_SET_PDEATHSIG``); elsewhere, or with
``T3_PORTABLE_PROCESSES=1`` (``PORTABLE``), a watcher in its group ends the group when a pipe
whose write end only t3 holds ends (``_spawn_watcher``). A starting server ends every recorded
process that is still the same process (``kill_orphans``); on the Linux path also every process
with ``T3_OWNER=<data-dir>`` in its environment (one that left its group).
Its environment is the server's minus t3's own variables (``_T3_VARIABLES``: the data dir, test
hooks, per-session values), plus the instance's ``env``, plus what the driver sets per session.
Stop = close stdin, wait, SIGTERM the group, wait, SIGKILL the group: no grandchild survives.
A session's tasks (its readers, the agent requests it serves) are its own: close() ends them.
Raw protocol traffic goes to rotating gzip files under ``<data-dir>/logs/`` with credentials
redacted (``redact``); never to SQLite. ``zcat``/``zless``/``zgrep`` read them, also while a
server writes (``zcat`` then only notes the missing end); there is no ``tail -f``:
``zcat logs/provider-<id>.log.gz | tail`` shows what was flushed (every ``FLUSH_S``).

Here: those rules, ``DriverAdapter`` and ``DriverSession`` (what every driver shares), JSON-RPC
2.0 over JSON lines (``RpcSession``), ``UnavailableAdapter`` and ``ProviderConfig``. Each agent
CLI's protocol is drivers.py's, which this module never imports. It never touches the database
and imports only the domain's types.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import json
import logging
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from orchestrator import (AdapterEvent, Capabilities, ProviderInfo, RuntimeRequestOpened,
                          TurnEnded, parse_json, redact_hook_tokens)

__all__ = ["ProviderConfig", "Adapter", "DriverAdapter", "DriverSession", "RpcSession",
           "JsonRpcError", "ProviderProcess", "UnavailableAdapter", "kill_orphans", "opened",
           "redact"]

log = logging.getLogger("t3.providers")

_LINE_LIMIT = 64 * 1024 * 1024


@dataclass(kw_only=True, slots=True)
class ProviderConfig:
    """One ``[[providers]]`` entry, validated by t3.py; ``command`` is empty where the entry
    names none (drivers.py's ``build_adapter`` gives it the driver's default)."""

    instance_id: str
    driver: str
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    models: list[Any] = field(default_factory=list)  # ids or {"id": ...}; kept as the latter
    enabled: bool = True
    display_name: str | None = None
    agent: str | None = None  # acpRegistry: the agent's id in the registry
    registry: str | None = None  # acpRegistry: the registry's http(s) URL or file path
    instructions: bool = True  # deliver the orchestration instructions (README)
    allow_unverified: bool = False  # acpRegistry: run a binary with no sha256

    def __post_init__(self) -> None:
        self.command, self.env = list(self.command), dict(self.env)
        self.models = [m if isinstance(m, Mapping) else {"id": str(m)} for m in self.models]


# =============================================================================================
# Redaction and the protocol log


# What redact() blanks out: a bearer token, an Authorization (or API key) header's value, and the
# value given to a name ending in a secret's word (T3_MCP_BEARER_TOKEN, apiKey, client_secret,
# password...), matched on the ASCII-lower-cased line. Every match starts with one of the words
# (a fast scan); its last named group (lastgroup) ends the text kept, the secret follows. A quote
# may be escaped (JSON inside a JSON string); a quoted value also ends where a line was cut.
_QUOTE = r"\\*[\"']"
_SPACE = r"(?:\s|%20|\+|\\u0020)+"  # also URL-encoded or JSON-escaped
_SECRET = re.compile(
    r"(?:bearer|token|secret|passw(?:or)?d|api[_-]?key|authorization)(?:"
    # Bearer X, bearer%20X (a word of its own: not cupbearer)
    rf"(?P<bearer>(?<=bearer)(?<![\w-]bearer){_SPACE})[\w.~+/=%-]+"
    # a header line: Authorization: Basic X, Proxy-Authorization: X, X-Api-Key: X
    rf"|(?P<header>(?:(?<=authorization)|(?<=key))\s*:\s*(?:[a-z][\w-]*{_SPACE})?)[^\s\"'\\,;]+"
    # a key with a string value: "token": "X", 'apiKey': 'X', \"password\": \"X\"
    rf"|(?P<key>(?P<kq>{_QUOTE})\s*:\s*(?P=kq))(?:\\.|[^\\])*?(?=(?P=kq)|$)"
    # a header object: {"name": "Authorization", "value": "X"} (ACP's mcpServers)
    rf"|(?P<pair>(?P<pq>{_QUOTE})\s*,\s*(?P=pq)value(?P=pq)\s*:\s*(?P=pq))(?:\\.|[^\\])*?"
    r"(?=(?P=pq)|$)"
    # an assignment: T3_MCP_BEARER_TOKEN=X, ?access_token=X&, --api-key="X"
    rf"|(?P<assign>\s*=(?!=)\s*(?:{_QUOTE})?)[^\s\"'\\&,;]+)")
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def redact(text: str) -> str:
    """Blank out credentials anywhere in a protocol line (``_SECRET``), in any letter case, and
    hook URLs' tokens."""
    text = redact_hook_tokens(text)
    lowered = text.lower()
    # Most lines hold no secret's word: skip the scan (spelled out, as this runs per line).
    if "bearer" not in lowered and "token" not in lowered and "key" not in lowered and \
            "authoriz" not in lowered and "secret" not in lowered and "passw" not in lowered:
        return text
    if not text.isascii():  # str.lower() may change the length, and the offsets with it
        lowered = text.translate(_ASCII_LOWER)
    parts: list[str] = []
    kept = 0
    for match in _SECRET.finditer(lowered):  # each alternative has a named group (lastgroup)
        parts += (text[kept:match.end(match.lastgroup or 0)], "<redacted>")
        kept = match.end()
    return "".join(parts) + text[kept:]


def _redact_record(record: logging.LogRecord) -> bool:
    """A filter on this module's logger: what it logs often quotes a provider (an error message,
    an exit reason, an installer's output), so every message is redacted as the traffic is."""
    record.msg, record.args = redact(record.getMessage()), None
    return True


log.addFilter(_redact_record)


class _ProtocolLog:
    """The raw traffic of one provider instance: one redacted, timestamped line per protocol
    message in ``provider-<id>.log.gz``, gzip-compressed (a streamed answer's lines take a
    thirtieth of their length on disk), rotated when the uncompressed text passes ``max_bytes`` (backups
    ``provider-<id>.log.1.gz`` .. ``.3.gz``). Not ``logging``: a record per delta cost more than
    all else t3 does with it (bench/README.md, P2). Lines are compressed as they come and the
    compressor is sync-flushed to the file ``FLUSH_S`` after the first unflushed line, when a turn
    or process ends (``_SessionEvents``) and on ``close()``: a kill -9 loses at most ``FLUSH_S``,
    never a turn, and what was flushed decompresses (the file only lacks the gzip trailer).
    A file is one gzip member written by one server: one left non-empty (a crash, an older run)
    is rotated before the first line, never appended to."""

    FLUSH_S = 0.2
    _LEVEL = 1  # zlib's fastest: 0.5 us a line over writing it plain; files a few % bigger

    def __init__(self, path: Path, *, max_bytes: int = 32 * 1024 * 1024,
                 backup_count: int = 3) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._open()
        self._flush_timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""
        self._failed = False  # reported once, not once a line

    def write(self, line: str) -> None:
        """Append one line, with credentials redacted (dropped once the log is closed)."""
        if self._file.closed:
            return
        now = time.time()
        second = int(now)
        if second != self._second:  # strftime once a second, not once a line
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        data = f"{self._stamp},{int(now * 1000) % 1000:03d} {redact(line)}\n".encode(
            errors="backslashreplace")
        try:
            self._file.write(self._deflate.compress(data))
            self._size += len(data)
            if self._size >= self._max_bytes:
                self.close()
                self._open()
        except OSError as exc:  # the traffic log is not worth failing a session for
            if not self._failed:
                log.error("cannot write the protocol log %s: %s", self.path, exc)
            self._failed = True
            return
        if self._flush_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # outside the event loop: nothing would run a timer
                self.flush()
            else:
                self._flush_timer = loop.call_later(self.FLUSH_S, self.flush)

    def flush(self, *, finish: bool = False) -> None:
        """Hand everything written so far to the file, decompressible: a sync flush ends the
        deflate block on a byte boundary; ``finish`` also writes the gzip trailer."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if not self._file.closed:
            mode = zlib.Z_FINISH if finish else zlib.Z_SYNC_FLUSH
            with contextlib.suppress(OSError):  # write() reports a failing log
                self._file.write(self._deflate.flush(mode))
                self._file.flush()

    def close(self) -> None:
        self.flush(finish=True)
        self._file.close()

    def _open(self) -> None:
        """A new file, private to the user (0600) and never through a symlink planted in its
        place. A non-empty one there moves to .1.gz first (.1.gz to .2.gz ..., the oldest beyond
        ``backup_count`` dropped)."""
        stem = self.path.name.removesuffix(".gz")
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_size > 0:
                for n in range(self._backup_count - 1, 0, -1):
                    older = self.path.with_name(f"{stem}.{n}.gz")
                    if older.exists():
                        os.replace(older, self.path.with_name(f"{stem}.{n + 1}.gz"))
                if self._backup_count > 0:
                    os.replace(self.path, self.path.with_name(f"{stem}.1.gz"))
                else:
                    self.path.unlink()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self._file = os.fdopen(fd, "ab", buffering=64 * 1024)  # closed in close()
        self._deflate = zlib.compressobj(self._LEVEL, zlib.DEFLATED, 31)  # 31: one gzip member
        self._size = 0  # of the text, uncompressed


class _SessionEvents(asyncio.Queue[AdapterEvent | None]):
    """A session's adapter events. The end of a turn or of the process first flushes the
    protocol log, so an ended turn's traffic is on disk before t3 records that it ended."""

    def __init__(self, protocol_log: _ProtocolLog) -> None:
        super().__init__()
        self._protocol_log = protocol_log

    def put_nowait(self, item: AdapterEvent | None) -> None:
        if item is None or isinstance(item, TurnEnded):
            self._protocol_log.flush()
        super().put_nowait(item)


# =============================================================================================
# Processes


# t3.py narrows its own umask to keep the data directory private; agents create files in the
# user's project and get the umask t3 was started with.
CHILD_UMASK: int | None = None
# The portable process rules (records, the watcher, start times from ps) without the Linux-only
# ones (PR_SET_PDEATHSIG, the /proc environment sweep): everywhere but Linux, and on Linux when
# asked, so that they are tested there.
PORTABLE = sys.platform != "linux" or os.environ.get("T3_PORTABLE_PROCESSES") == "1"


def _die_with_parent() -> None:  # runs in the child between fork and exec (the Linux path)
    with contextlib.suppress(OSError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG; None: any libc


@functools.cache
def _setpriv() -> str | None:
    """util-linux's setpriv when it sets PR_SET_PDEATHSIG (2.33+): the Linux path runs an agent
    through it, so no preexec_fn runs in a forked child and subprocess uses vfork. A fork copies
    t3's page tables and t3 then takes a copy-on-write fault on each page it writes (about 3,000
    faults, 5 ms of CPU per agent at 90 MB). Without it, ``_die_with_parent`` runs in a fork."""
    path = shutil.which("setpriv")
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, timeout=5).stdout \
            if path else b""
    except (OSError, subprocess.SubprocessError):
        usage = b""
    return path if b"--pdeathsig" in usage else None


def _check_program(name: str, *, cwd: str, path: str) -> None:
    """The FileNotFoundError subprocess raises for a program exec would not find (on ``path``,
    or from ``cwd`` if it names a folder): through setpriv it would only exit 127."""
    if shutil.which(os.path.join(cwd, name) if os.sep in name else name, path=path) is None:
        raise FileNotFoundError(2, "No such file or directory", name)


# The portable parent-death rule: a watcher in each agent's process group, a /bin/sh with no
# environment and its output discarded whose stdin is the read end of a pipe only t3 writes to.
# It is spawned by the agent's own child process before that execs the agent, so it has the
# agent's group, and it holds nothing else of t3's (t3's descriptors are close-on-exec: the
# agent holds neither end of the pipe). It is the agent's child. When t3 ends, however it
# ends, the write end closes with it, ``read`` meets EOF and the watcher SIGKILLs the group.
# It ignores SIGTERM: a stop's grace period does not disarm it.
_WATCHER = "trap '' HUP INT TERM; read _; kill -KILL 0"


def _spawn_watcher() -> None:  # runs in the child between fork and exec (the portable path)
    os.posix_spawn("/bin/sh", ["t3-watch", "-c", _WATCHER], {}, file_actions=[
        (os.POSIX_SPAWN_DUP2, _death_pipe(), 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0), (os.POSIX_SPAWN_DUP2, 1, 2)])


@functools.cache
def _death_pipe() -> int:
    """The read end of the pipe the watchers hold. Its write end is never closed and never
    inherited (``os.pipe`` makes both close-on-exec): it ends when t3 does."""
    return os.pipe()[0]


# t3's own variables (read by it, or set per session): never passed on from the server's
# environment. A named set, not every T3_*: other tools' variables of that shape pass through.
_T3_VARIABLES = frozenset({"T3_HOME", "T3_CRASH_AT", "T3_MAX_PAGE_COUNT", "T3_TEST_HOOKS",
                           "T3_TEST_CLOCK", "T3_MCP_URL", "T3_MCP_BEARER_TOKEN", "T3_OWNER",
                           "T3_SERVER_PID", "T3_THREAD_ID", "T3_PORTABLE_PROCESSES"})


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a process's pipes, which also says when the process exited
    (``exited``): ``Process.wait`` on 3.11 waits for the pipes too, and a helper may hold them."""

    def __init__(self, *, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class ProviderProcess:
    """A provider subprocess in its own process group, recorded until it is reaped."""

    def __init__(self, proc: asyncio.subprocess.Process, exited: asyncio.Future[None],
                 record: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._record = record
        self._reaper = asyncio.get_running_loop().create_task(self._kill_group_on_exit(exited))

    @classmethod
    async def spawn(cls, command: Sequence[str], *, cwd: str, owner: str,
                    env: Mapping[str, str]) -> ProviderProcess:
        """Start ``command`` and record it. Its environment is built here and nowhere else: the
        server's minus ``_T3_VARIABLES``, then ``env``, then the marker ``kill_orphans`` finds
        it by."""
        environment = {k: v for k, v in os.environ.items() if k not in _T3_VARIABLES}
        environment.update(env)
        environment.update(T3_OWNER=owner, T3_SERVER_PID=str(os.getpid()))
        preexec: Callable[[], None] | None = _die_with_parent
        if PORTABLE:
            _death_pipe()  # made here, not in a child
            preexec = _spawn_watcher
        elif setpriv := _setpriv():
            _check_program(command[0], cwd=cwd, path=environment.get("PATH", os.defpath))
            command, preexec = [setpriv, "--pdeathsig", "KILL", "--", *command], None
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.subprocess_exec(
            lambda: _ExitProtocol(limit=_LINE_LIMIT, loop=loop), *command, cwd=cwd,
            env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
            umask=-1 if CHILD_UMASK is None else CHILD_UMASK, preexec_fn=preexec)
        pid = transport.get_pid()
        record = Path(owner) / "processes" / str(pid)
        try:
            started = (await _starts([pid])).get(pid)
            _write_record(record, {"pid": pid, "pgid": pid, "started": started,
                                   "threadId": env.get("T3_THREAD_ID", "")})
        except BaseException:  # unrecorded, it must not run
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            transport.close()
            raise
        return cls(asyncio.subprocess.Process(transport, protocol, loop), protocol.exited, record)

    async def _kill_group_on_exit(self, exited: asyncio.Future[None]) -> None:
        """When the provider exits, SIGKILL what is left of its group (helpers holding its pipes
        open would keep stdout from EOF, so no turn would end; the watcher), then drop its
        record."""
        await exited
        self._kill_group(signal.SIGKILL)
        self._record.unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def stop(self, *, grace: float) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        if not await self._exited_within(grace):
            self._kill_group(signal.SIGTERM)
            if not await self._exited_within(2.0):
                self._kill_group(signal.SIGKILL)
                await self._exited_within(5.0)
        self._kill_group(signal.SIGKILL)  # grandchildren that kept running
        await asyncio.wait({self._reaper}, timeout=1.0)  # it ends with the process

    async def _exited_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.proc.wait(), seconds)
            return True
        except TimeoutError:
            return False

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


class _Tasks:
    """The background tasks of one session (its readers, the agent requests it serves), each
    held until it ends. ``end`` waits for them once the process is gone (they reach EOF), then
    cancels what is left: none outlives its session, none is fire-and-forget."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def end(self, *, within: float) -> None:
        tasks = self._running - {asyncio.current_task()}
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=within)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)


def _exit_reason(closing: bool, returncode: int) -> str | None:
    """Why a session's process ended, when t3 did not end it."""
    if closing:
        return None
    if returncode < 0:  # asyncio reports death by signal N as -N
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"The provider process was killed by {name} (exit code {returncode})."
    return f"The provider process exited unexpectedly (exit code {returncode})."


async def _read_json_lines(process: ProviderProcess, protocol_log: _ProtocolLog, label: str,
                           on_message: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Hand each JSON object on the provider's stdout (one per line, logged redacted) to
    ``on_message`` until EOF or a broken stream. Read 64 KiB at a time and split on LF only: a
    ``readline()`` per line cost as much as the JSON (bench/README.md, P2)."""
    stdout = process.proc.stdout
    assert stdout is not None
    pieces: list[bytes] = []  # the start of a line that has not ended yet
    pending = 0
    try:
        while chunk := await stdout.read(1 << 16):
            if b"\n" not in chunk:
                pieces.append(chunk)
                pending += len(chunk)
                if pending > _LINE_LIMIT:
                    raise ValueError("a protocol line exceeds the size limit")
                continue
            lines = (b"".join(pieces) + chunk if pieces else chunk).split(b"\n")
            rest = lines.pop()
            pieces, pending = ([rest], len(rest)) if rest else ([], 0)
            for raw in lines:
                await _json_line(raw, protocol_log, label, on_message)
        if pieces:  # the last line, without its newline
            await _json_line(b"".join(pieces), protocol_log, label, on_message)
    except (ConnectionError, ValueError) as exc:  # ValueError: a line over the limit
        log.warning("%s: stopped reading: %s", label, exc)


async def _json_line(raw: bytes, protocol_log: _ProtocolLog, label: str,
                     on_message: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    line = raw.decode(errors="replace").strip()
    if not line:
        return
    protocol_log.write(f"{label} <- {line}")
    try:
        message = parse_json(line)
    except ValueError as exc:
        log.warning("%s: ignoring a line that is not JSON: %s", label, exc)
        return
    if isinstance(message, dict):
        await on_message(message)


async def _write_json_line(process: ProviderProcess, protocol_log: _ProtocolLog, label: str,
                           message: Mapping[str, Any]) -> None:
    """Write one JSON object as a line to the provider's stdin (logged redacted)."""
    stdin = process.proc.stdin
    if stdin is None or stdin.is_closing() or not process.alive():
        raise ConnectionError(f"{label}: the provider process is not running")
    line = json.dumps(message, separators=(",", ":"))
    protocol_log.write(f"{label} -> {line}")
    stdin.write(line.encode() + b"\n")
    await stdin.drain()


async def kill_orphans(owner: str) -> int:
    """End what an earlier t3 on this data directory left running, before this one starts any
    process: the group of each recorded process that is still the same process (pid and start
    time match: a reused pid is spared), and on the Linux path each process with the entry
    ``T3_OWNER=<owner>`` in its environment (not ``FOO=T3_OWNER=<owner>``). Each finds what
    the other cannot: an agent that cleared its environment; a grandchild that left its group.
    The number of processes and groups killed."""
    entries = []
    for path in (Path(owner) / "processes").iterdir():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # empty: t3 died
            entry = json.loads(path.read_bytes())                             # as it wrote it
            entries.append((int(entry["pid"]), int(entry["pgid"]), entry["started"]))
        with contextlib.suppress(OSError):
            path.unlink()
    now = await _starts([pid for pid, _, _ in entries])
    killed = 0
    for pid, pgid, started in entries:
        if started is not None and started == now.get(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
                killed += 1
    return killed + (0 if PORTABLE else _kill_by_environment(owner))


def _kill_by_environment(owner: str) -> int:
    # /proc/<pid>/environ is NUL-separated entries; with a NUL in front, every entry is NUL-bounded
    needle = b"\0T3_OWNER=" + owner.encode() + b"\0"
    ours = f"\0T3_SERVER_PID={os.getpid()}\0".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = b"\0" + (entry / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if needle in environ and ours not in environ:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def _write_record(path: Path, entry: Mapping[str, Any]) -> None:
    """Once write() has returned, the record is the kernel's: a kill -9 of t3 right after
    cannot lose it. No fsync: what loses the kernel's cache (a power loss) ends the agents too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(entry).encode())
    finally:
        os.close(fd)


# A start time, which with the pid names one process: "proc <boot id> <clock ticks since boot>"
# from /proc (exact; the Linux path), else "ps <lstart>" from ps(1), to the second, on every
# POSIX system. (Linux's ps derives it from the boot time, which a step of the clock moves: a
# survivor is then spared rather than a stranger killed.) A record made under the other rules
# never matches: on Linux the environment sweep still finds its processes.
_PS_ENV = {"LC_ALL": "C", "TZ": "UTC0", "PATH": os.environ.get("PATH", os.defpath)}


async def _starts(pids: Sequence[int]) -> dict[int, str]:
    """{pid: its start time} for those of ``pids`` alive (ps once for all on the portable path)."""
    if not PORTABLE or not pids:
        return {pid: started for pid in pids if (started := _proc_start(pid))}
    try:
        ps = await asyncio.create_subprocess_exec(
            "ps", "-o", "pid=,lstart=", "-p", ",".join(map(str, pids)), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=_PS_ENV)
        out = (await ps.communicate())[0].decode(errors="replace")
    except OSError as exc:  # then no record matches: nothing is killed by mistake
        log.error("cannot read start times with ps: %s", exc)
        return {}
    return {int(pid): "ps " + " ".join(lstart) for pid, *lstart in
            (line.split() for line in out.splitlines() if line.strip()) if pid.isdigit()}


@functools.cache
def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"proc {_boot_id()} {stat[stat.rindex(')') + 2:].split()[19]}"
    except (OSError, ValueError, IndexError):
        return None


# =============================================================================================
# The adapter and the session every driver builds on


class DriverAdapter:
    """What every driver's adapter shares: its configuration, protocol log and availability.
    ``RUNTIME_MODES`` / ``INTERACTION_MODES``: the modes t3 can enforce (None: all). ``probe()``
    asks the CLI, at most once per ``PROBE_TTL_S``, for its models and login (``_probe_cli``):
    configured models win over probed ones; "not logged in" makes the instance unavailable."""

    CAPABILITIES = Capabilities()  # its defaults: interrupt, steering by restart, queued messages
    RUNTIME_MODES: tuple[str, ...] | None = None
    INTERACTION_MODES: tuple[str, ...] | None = None
    PROBE_TTL_S = 300.0
    PROBE_TIMEOUT_S = 20.0

    def __init__(self, config: ProviderConfig, *, log_dir: Path, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.protocol_log = _ProtocolLog(log_dir / f"provider-{config.instance_id}.log.gz")
        self.info = _info(config, self.CAPABILITIES, self.RUNTIME_MODES, self.INTERACTION_MODES)
        self._static_info = self.info
        self._probe_lock = asyncio.Lock()
        self._probed_at: float | None = None

    def close(self) -> None:
        """Flush and close the protocol log, once the server's sessions are gone."""
        self.protocol_log.close()

    async def probe(self) -> None:
        """Refresh ``info`` from the CLI once per ``PROBE_TTL_S`` (a second caller waits for the
        first). A probe that fails or times out is logged and changes nothing."""
        async with self._probe_lock:
            now = time.monotonic()
            if not self._static_info.available or (
                    self._probed_at is not None and now - self._probed_at < self.PROBE_TTL_S):
                return
            self._probed_at = now
            try:
                models, problem = await asyncio.wait_for(self._probe_cli(), self.PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001  # a probe is advice, never fatal
                log.info("provider %s: probe failed: %s", self.info.instance_id,
                         redact(str(exc) or type(exc).__name__))
                return
            self.info = replace(self._static_info, models=self.config.models or models,
                                available=problem is None,
                                constraints=(problem,) if problem else ())

    async def _probe_cli(self) -> tuple[list[dict[str, Any]], str | None]:
        """The CLI's models and, if it says so, why it cannot run ("not logged in ...")."""
        return [], None

    async def _cli_output(self, *args: str) -> str:
        """The stdout of the instance's executable run with ``args`` in a scratch directory (a
        cheap query such as a model list)."""
        with tempfile.TemporaryDirectory(prefix="t3-probe-") as cwd:
            process = await self._spawn([self.config.command[0], *args], cwd, self._env(""))
            try:
                out, _ = await process.proc.communicate()
            finally:
                await process.stop(grace=1.0)
        return out.decode(errors="replace")

    def _check_available(self) -> None:
        if not self.info.available:
            raise _cannot_run(self.info)

    def _env(self, thread_id: str, **extra: str) -> dict[str, str]:
        """What a session's process gets on top of the server's environment
        (``ProviderProcess.spawn``): the instance's ``env``, then the driver's ``extra``, then
        the app thread's id."""
        return {**self.config.env, **extra, "T3_THREAD_ID": thread_id}

    async def _spawn(self, command: Sequence[str], cwd: str, env: Mapping[str, str]
                     ) -> ProviderProcess:
        return await ProviderProcess.spawn(command, cwd=cwd, owner=self.owner, env=env)


class UnavailableAdapter:
    """A configured instance whose driver this t3 cannot run yet."""

    def __init__(self, config: ProviderConfig, reason: str) -> None:
        self.info = ProviderInfo(instance_id=config.instance_id, driver=config.driver,
                                 display_name=config.display_name, models=config.models,
                                 capabilities=Capabilities(), available=False,
                                 constraints=(reason,))

    def close(self) -> None:
        pass

    async def open_session(self, **_: Any) -> Any:
        raise _cannot_run(self.info)


# What t3.py holds per instance: an orchestrator.ProviderAdapter that also has close().
Adapter = DriverAdapter | UnavailableAdapter


def _cannot_run(info: ProviderInfo) -> RuntimeError:
    return RuntimeError(f"provider {info.instance_id} cannot run: " + "; ".join(info.constraints))


def _info(config: ProviderConfig, capabilities: Capabilities,
          runtime_modes: Sequence[str] | None = None,
          interaction_modes: Sequence[str] | None = None) -> ProviderInfo:
    """What an instance offers, and why it cannot run if it cannot."""
    constraints = []
    if not config.enabled:
        constraints.append("disabled in the configuration")
    if not config.command:
        constraints.append("no command configured")
    elif not shutil.which(config.command[0]) and not (
            os.path.isabs(config.command[0]) and os.access(config.command[0], os.X_OK)):
        constraints.append(f"executable not found: {config.command[0]}")
    return ProviderInfo(instance_id=config.instance_id, driver=config.driver,
                        display_name=config.display_name, models=config.models,
                        capabilities=capabilities, available=not constraints,
                        constraints=tuple(constraints), runtime_modes=runtime_modes,
                        interaction_modes=interaction_modes)


class DriverSession:
    """What every driver's session shares: one provider process serving one app thread in a
    runtime mode, its adapter events (``events``; None = the process is gone, with
    ``exit_reason``), its background tasks (``_tasks``), the agent requests it holds open for the
    user (``_requests``), its own requests waiting for an answer (``_call``) and its stop. A
    driver reading JSON lines on stdout defines ``_route`` and starts ``_read()``; one with more
    to drop once the process is gone extends ``_forget``. A probe's session says so in its log
    label."""

    TASKS_GRACE_S = 2.0  # close(): how long the readers get to reach EOF before they are cancelled

    def __init__(self, adapter: DriverAdapter, process: ProviderProcess, *, runtime_mode: str,
                 probe: bool = False) -> None:
        self._adapter = adapter
        self._process = process
        self._runtime_mode = runtime_mode
        self._label = f"{adapter.info.instance_id}[{'probe ' if probe else ''}{process.pid}]"
        self.pid: int | None = process.pid
        self.native_thread_ref: str | None = None
        self.events: asyncio.Queue[AdapterEvent | None] = _SessionEvents(adapter.protocol_log)
        self.exit_reason: str | None = None
        self._closing = False
        self._gone = False  # its stdout ended: nothing more is sent or answered
        self._tasks = _Tasks()
        self._requests: dict[str, Any] = {}  # native_ref -> what answering a held request needs
        self._calls: dict[Any, asyncio.Future[Any]] = {}  # call id -> its answer, once it comes
        self._in_turn = False  # for drivers that track turns here (_turn_starting)
        self._interrupted = False

    def alive(self) -> bool:
        return self._process.alive() and not self._gone

    async def steer_turn(self, text: str) -> None:
        """Drivers without native steering: t3 steers them by interrupt-and-restart."""
        raise RuntimeError(f"{self._label} cannot steer a running turn")

    async def close(self, *, grace: float = 3.0) -> None:
        self._closing = True
        await self._process.stop(grace=grace)
        await self._tasks.end(within=self.TASKS_GRACE_S)

    @contextlib.asynccontextmanager
    async def _turn_starting(self) -> AsyncIterator[None]:
        """A turn starts, unless one is running; if starting it fails, none is running."""
        if self._in_turn:
            raise RuntimeError("a turn is already running on this session")
        self._in_turn, self._interrupted = True, False
        try:
            yield
        except BaseException:
            self._in_turn = False
            raise

    async def _end_turn(self, failure: str | None = None, *, interrupted: bool = False) -> None:
        """The turn is over: interrupted wins over a failure (the reason), else it completed."""
        self._in_turn = False
        await self.events.put(TurnEnded("interrupted") if interrupted else
                              TurnEnded("failed", failure) if failure else TurnEnded("completed"))

    def _never_asks(self, *, edit: bool) -> bool:
        """Whether the runtime mode grants an agent's request without asking the user: always in
        full-access and auto, and a file edit in auto-accept-edits."""
        return self._runtime_mode in ("full-access", "auto") or (
            self._runtime_mode == "auto-accept-edits" and edit)

    async def _send(self, message: Mapping[str, Any]) -> None:
        if self._gone:
            raise ConnectionError(f"{self._label}: the provider process is not running")
        await _write_json_line(self._process, self._adapter.protocol_log, self._label, message)

    async def _call(self, call_id: Any, message: Mapping[str, Any], timeout: float | None
                    ) -> Any:
        """Send ``message`` and wait for its answer: what ``_settle(call_id, ...)`` gives."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(message)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def _settle(self, call_id: Any, answer: Any) -> None:
        """The answer to call ``call_id``; an exception is raised to its caller."""
        future = self._calls.get(call_id)
        if future is None or future.done():
            return
        if isinstance(answer, Exception):
            future.set_exception(answer)
        else:
            future.set_result(answer)

    def _read(self) -> None:
        """Read the process: each JSON line on stdout to ``_route``, stderr into the log."""
        self._tasks.start(self._read_stdout())
        self._tasks.start(self._read_text("stderr"))

    async def _route(self, message: Mapping[str, Any]) -> None:
        raise NotImplementedError

    async def _read_stdout(self) -> None:
        try:
            await _read_json_lines(self._process, self._adapter.protocol_log, self._label,
                                   self._route)
        finally:
            await self._ended()

    async def _read_text(self, stream: str, on_line: Callable[[str], None] | None = None
                         ) -> None:
        """Drain the process's ``stream`` ("stderr", or a text "stdout") into the protocol log,
        each line to ``on_line`` too: a full pipe would stall the process."""
        reader = getattr(self._process.proc, stream)
        while raw := await reader.readline():
            line = raw.decode(errors="replace").rstrip()
            self._adapter.protocol_log.write(f"{self._label} {stream} {line}")
            if on_line is not None:
                on_line(line)

    async def _ended(self) -> None:
        """The process is gone: what it can no longer answer is dropped (``_forget``), then
        why it ended (``exit_reason``) and None on ``events``."""
        self._forget()
        self.exit_reason = _exit_reason(self._closing, await self._process.proc.wait())
        await self.events.put(None)

    async def _hold(self, request: RuntimeRequestOpened, context: Any) -> None:
        """Hold an agent's request open until the user's answer arrives through respond()."""
        self._requests[request.native_ref] = context
        await self.events.put(request)

    def _forget(self) -> None:
        """Drop what only the gone process could have answered: its held requests, the calls
        waiting for an answer, ..."""
        self._gone = True
        self._requests.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ConnectionError("the provider process exited"))


_S = TypeVar("_S", bound=DriverSession)


async def opened(session: _S, opening: Awaitable[None]) -> _S:
    """``session`` once ``opening`` has run; a session that fails to open is closed."""
    try:
        await opening
    except BaseException:
        await session.close(grace=1.0)
        raise
    return session


# =============================================================================================
# JSON-RPC 2.0 over stdio, one JSON object per line


class JsonRpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


_DEFERRED = object()  # a request handler that answers later (respond())


class RpcSession(DriverSession):
    """A session speaking JSON-RPC 2.0 both ways: its own requests (``_request``) and
    notifications, and the agent's requests, each served in a task of its own; one the user must
    answer is held (``_ask``) as native_ref -> (JSON-RPC id, method, context) until respond()."""

    def __init__(self, adapter: DriverAdapter, process: ProviderProcess, *, runtime_mode: str,
                 probe: bool = False) -> None:
        super().__init__(adapter, process, runtime_mode=runtime_mode, probe=probe)
        self._ids = itertools.count(1)
        self._read()

    # -- what a driver defines -------------------------------------------------------------------

    async def _on_request(self, request_id: Any, method: str, params: Mapping[str, Any]) -> Any:
        """The answer to an agent's request, or ``_ask(...)`` to hold it open for the user."""
        raise NotImplementedError

    async def _on_notification(self, method: str, params: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _result(self, method: str, context: Any, decision: str | None,
                answers: Mapping[str, Any] | None) -> Mapping[str, Any]:
        """The JSON-RPC result that answers a pending agent request with the user's decision."""
        raise NotImplementedError

    # -- the framing -----------------------------------------------------------------------------

    async def _request(self, method: str, params: Mapping[str, Any], *,
                       timeout: float | None = None) -> Any:
        request_id = next(self._ids)
        return await self._call(request_id, {"jsonrpc": "2.0", "id": request_id,
                                             "method": method, "params": params}, timeout)

    async def _notify(self, method: str, params: Mapping[str, Any]) -> None:
        await self._send({"jsonrpc": "2.0", "method": method, "params": params})

    async def _reply(self, request_id: Any, result: Any = None, *,
                     error: JsonRpcError | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id}
        if error is not None:
            message["error"] = {"code": error.code, "message": str(error)}
        else:
            message["result"] = result
        await self._send(message)

    async def _route(self, message: Mapping[str, Any]) -> None:
        if "method" in message and "id" in message:
            self._tasks.start(self._serve(message))
        elif "method" in message:
            await self._on_notification(message["method"], message.get("params") or {})
        elif "id" in message:
            error = message.get("error")
            self._settle(message["id"], message.get("result") if error is None else
                         JsonRpcError(error.get("code", -32603), error.get("message", "error")))

    async def _serve(self, message: Mapping[str, Any]) -> None:
        try:
            result = await self._on_request(message["id"], message["method"],
                                            message.get("params") or {})
            if result is not _DEFERRED:
                await self._reply(message["id"], result)
        except JsonRpcError as exc:
            await self._reply(message["id"], error=exc)
        except ConnectionError:
            pass

    # -- pending agent requests ------------------------------------------------------------------

    async def respond(self, native_ref: str, decision: str | None,
                      answers: Mapping[str, Any] | None) -> None:
        if native_ref not in self._requests:
            raise RuntimeError(f"no pending request {native_ref} on this session")
        request_id, method, context = self._requests[native_ref]
        result = self._result(method, context, decision, answers)
        del self._requests[native_ref]
        with contextlib.suppress(ConnectionError):
            await self._reply(request_id, result)

    async def _cancel_requests(self) -> None:
        for native_ref in list(self._requests):
            await self.respond(native_ref, "cancel", None)

    async def _ask(self, request_id: Any, method: str, context: Any,
                   request: RuntimeRequestOpened) -> Any:
        await self._hold(request, (request_id, method, context))
        return _DEFERRED
