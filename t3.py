"""t3.py: the entry point of t3, a small auditable server that orchestrates coding agents.

``python t3.py [serve]`` runs one local server (hypercorn on 127.0.0.1): MCP tools at ``/mcp``,
the client API at ``/ws``, the web view (``ui.html``) at ``/``; ``python t3.py token
[--rotate]`` prints (or replaces) the client token; the other commands are for people and talk
to a running server only through ``/ws``. This file owns configuration (``t3.toml``), the data
directory (private: 0700 and 0600, no symlink followed; its lock, the client token,
``server.json``), credentials and bearer auth, the ASGI app and its routes (Host and Origin
checked, auth before the body is read, bodies bounded in size and time), the /ws protocol
(parsing and shaping only: the rules are ``orchestrator.ThreadService``'s, as for MCP), the
capped listening socket, and startup/shutdown order. It wires the layers and decides nothing:
``store.py`` <- ``orchestrator.py`` <- ``tools.py``, with ``providers.py`` handed in here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import fcntl
import functools
import gc
import hashlib
import hmac
import ipaddress
import itertools
import json
import logging
import os
import re
import resource
import secrets
import signal
import socket
import ssl
import stat
import sys
import time
import tomllib
import urllib.parse
import uuid
from collections.abc import (AsyncIterator, Awaitable, Callable, Iterator, Mapping,
                             MutableMapping, Sequence)
from pathlib import Path
from typing import Any

__all__ = ["VERSION", "main", "Config", "ConfigError", "load_config", "DataDirError",
           "open_data_dir", "ClientToken", "Credentials", "HttpPolicy", "Route", "WebView",
           "build_app"]

VERSION = "0.1.0"
log = logging.getLogger("t3")

_Receive = Callable[[], Awaitable[Any]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], _Receive, _Send], Awaitable[None]]

_ID = re.compile(r"^[a-zA-Z][a-zA-Z0-9_-]{0,63}$")
MAX_BODY_BYTES = 4 * 1024 * 1024


# =============================================================================================
# Configuration


class ConfigError(Exception):
    """The configuration file is invalid."""


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    host: str
    port: int
    projects: list[dict[str, Any]]  # id, path, title, setup (commands for a new worktree)
    providers: list[dict[str, Any]] | None  # None: detect installed CLIs
    credential_max_lifetime_s: int = 86_400
    credential_idle_s: int = 7_200
    max_delegation_depth: int = 5
    max_live_agent_processes: int = 16
    max_scheduled_tasks_per_project: int = 20
    min_agent_task_interval_s: int = 900
    allowed_origins: tuple[str, ...] = ()  # besides the server's own http://127.0.0.1:<port> etc.
    allowed_hosts: tuple[str, ...] = ()  # Host header names besides loopback addresses
    max_connections: int = 512
    certfile: str | None = None
    keyfile: str | None = None


_SECTIONS = {"server": {"host", "port", "allowed_origins", "allowed_hosts", "max_connections",
                        "certfile", "keyfile"},
             "projects": {"id", "path", "title", "setup"},
             "providers": {"id", "driver", "command", "env", "models", "enabled", "displayName",
                           "agent", "registry", "instructions", "allow_unverified"},
             "limits": {"credential_max_lifetime_s", "credential_idle_s", "max_delegation_depth",
                        "max_live_agent_processes", "max_scheduled_tasks_per_project",
                        "min_agent_task_interval_s"}}


_Fail = Callable[[str, "int | None", "str | None", str], ConfigError]


def load_config(path: Path, *, cwd: Path) -> Config:
    """Read ``t3.toml``; a missing file is an empty configuration."""
    text = path.read_text() if path.exists() else ""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc

    def fail(section: str, index: int | None, key: str | None, problem: str) -> ConfigError:
        line = _line_of(text, section, index, key)
        where = f"{path}:{line}" if line else str(path)
        name = section + (f"[{index}]" if index is not None else "") + (f".{key}" if key else "")
        return ConfigError(f"{where}: {name}: {problem}")

    for section in data:
        if section not in _SECTIONS:
            raise fail(section, None, None, "unknown section")
    providers: list[dict[str, Any]] | None = None
    if "providers" in data:
        providers = []
        for i, entry in enumerate(data["providers"]):
            providers.append(_provider_entry(i, entry, fail, base=path.parent))
            if any(p["id"] == providers[-1]["id"] for p in providers[:-1]):
                raise fail("providers", i, "id", f"duplicate provider id {providers[-1]['id']!r}")
    limits = data.get("limits", {})
    for key in limits:
        if key not in _SECTIONS["limits"]:
            raise fail("limits", None, key, "unknown key")
        if not isinstance(limits[key], int) or isinstance(limits[key], bool) or limits[key] <= 0:
            raise fail("limits", None, key, "must be a positive integer")
    if limits.get("min_agent_task_interval_s", 60) < 60:
        raise fail("limits", None, "min_agent_task_interval_s", "must be at least 60 (no task "
                   "runs more often than once a minute)")
    return Config(**_server_section(data.get("server", {}), fail, base=path.parent),
                  projects=_project_entries(data.get("projects", []), fail, cwd=cwd),
                  providers=providers, **limits)


def _server_section(server: Mapping[str, Any], fail: _Fail, *, base: Path) -> dict[str, Any]:
    for key in server:
        if key not in _SECTIONS["server"]:
            raise fail("server", None, key, "unknown key")
    host, port = server.get("host", "127.0.0.1"), server.get("port", 3773)
    if not isinstance(host, str):
        raise fail("server", None, "host", "must be a string")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise fail("server", None, "port", "must be an integer 0-65535")
    values: dict[str, Any] = {"host": host, "port": port}
    for key in ("allowed_origins", "allowed_hosts"):
        listed = server.get(key, [])
        if not isinstance(listed, list) or not all(isinstance(v, str) and v for v in listed):
            raise fail("server", None, key, "must be a list of non-empty strings")
        values[key] = tuple(v.rstrip("/") if key == "allowed_origins" else v.lower()
                            for v in listed)
    if "max_connections" in server:
        if not isinstance(server["max_connections"], int) or server["max_connections"] < 1:
            raise fail("server", None, "max_connections", "must be a positive integer")
        values["max_connections"] = server["max_connections"]
    for key in ("certfile", "keyfile"):
        if key in server:
            name = server[key]
            if not isinstance(name, str) or not (base / name).is_file():
                raise fail("server", None, key, f"must name an existing file ({name!r})")
            values[key] = str((base / name).resolve())
    if ("certfile" in values) != ("keyfile" in values):
        raise fail("server", None, "certfile", "certfile and keyfile go together")
    return values


def _project_entries(entries: Sequence[Mapping[str, Any]], fail: _Fail, *, cwd: Path
                     ) -> list[dict[str, Any]]:
    projects: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        for key in entry:
            if key not in _SECTIONS["projects"]:
                raise fail("projects", i, key, "unknown key")
        pid, ppath = entry.get("id"), entry.get("path")
        if not isinstance(pid, str) or not _ID.match(pid):
            raise fail("projects", i, "id", "must match ^[a-zA-Z][a-zA-Z0-9_-]{0,63}$")
        if not isinstance(ppath, str) or not Path(ppath).is_dir():
            raise fail("projects", i, "path", f"must be an existing directory ({ppath!r})")
        title = entry.get("title", pid)
        if not isinstance(title, str):
            raise fail("projects", i, "title", "must be a string")
        if any(p["id"] == pid for p in projects):
            raise fail("projects", i, "id", f"duplicate project id {pid!r}")
        if pid == "scratch":
            raise fail("projects", i, "id", "'scratch' is reserved for scratch workspaces")
        setup = entry.get("setup", [])
        if not isinstance(setup, list) or not all(isinstance(c, str) and c for c in setup):
            raise fail("projects", i, "setup", "must be a list of shell commands (strings)")
        projects.append({"id": pid, "path": str(Path(ppath).resolve()), "title": title,
                         "setup": setup})
    if not projects:
        projects.append({"id": "default", "path": str(cwd.resolve()), "title": cwd.name or "/"})
    return projects


def _provider_entry(i: int, entry: Mapping[str, Any], fail: _Fail, *, base: Path) -> dict[str, Any]:
    from providers import DRIVERS
    for key in entry:
        if key not in _SECTIONS["providers"]:
            raise fail("providers", i, key, "unknown key")
    pid, driver = entry.get("id"), entry.get("driver")
    if not isinstance(pid, str) or not _ID.match(pid):
        raise fail("providers", i, "id", "must match ^[a-zA-Z][a-zA-Z0-9_-]{0,63}$")
    if driver not in DRIVERS:
        raise fail("providers", i, "driver", f"must be one of {', '.join(DRIVERS)}")
    command = entry.get("command")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(c, str) for c in command)):
        raise fail("providers", i, "command", "must be a non-empty list of strings")
    if command and "/" in command[0] and not Path(command[0]).is_absolute():
        # Agents run in their project's directory: a relative executable path means relative
        # to this file.
        command = [str((base / command[0]).resolve()), *command[1:]]
    env = entry.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise fail("providers", i, "env", "must be a table of strings")
    models = entry.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) or _model_table(m)
                                               for m in models):
        raise fail("providers", i, "models", "must be a list of ids or {id=...} tables "
                                             "(label a string, options a list of tables)")
    flags = {key: entry.get(key, default) for key, default in (
        ("enabled", True), ("instructions", True), ("allow_unverified", False))}
    for key, flag in flags.items():
        if not isinstance(flag, bool):
            raise fail("providers", i, key, "must be true or false")
    if flags["allow_unverified"] and driver != "acpRegistry":
        raise fail("providers", i, "allow_unverified", "only the acpRegistry driver takes it")
    agent, registry = entry.get("agent"), entry.get("registry")
    for key, value in (("agent", agent), ("registry", registry)):
        if driver == "acpRegistry" and (not isinstance(value, str) or not value):
            raise fail("providers", i, key, "the acpRegistry driver needs it (a string)")
        if driver != "acpRegistry" and value is not None:
            raise fail("providers", i, key, "only the acpRegistry driver takes it")
    if registry and not registry.startswith(("http://", "https://")):
        registry = str((base / registry).resolve())  # relative to this file
    return {"id": pid, "driver": driver, "command": command, "env": env, "models": models,
            "enabled": flags["enabled"], "displayName": entry.get("displayName"),
            "agent": agent, "registry": registry, "instructions": flags["instructions"],
            "allowUnverified": flags["allow_unverified"]}


def _model_table(m: Any) -> bool:
    """``{id = "...", label = "...", options = [{...}]}``: what orchestrator_capabilities
    publishes under its outputSchema."""
    options = m.get("options", []) if isinstance(m, dict) else None
    return isinstance(m, dict) and isinstance(m.get("id"), str) \
        and isinstance(m.get("label", ""), str) and isinstance(options, list) \
        and all(isinstance(o, dict) for o in options)


def _line_of(text: str, section: str, index: int | None, key: str | None) -> int | None:
    """Best-effort line number of ``section[index].key`` in TOML text."""
    seen = -1
    in_section = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.match(r"^\[\[?\s*([A-Za-z0-9_.-]+)\s*\]\]?", stripped)
        if header:
            in_section = header.group(1) == section
            if in_section:
                seen += 1
                if key is None and (index is None or seen == index):
                    return number
            continue
        if in_section and key and (index is None or seen == index) and \
                re.match(rf"^{re.escape(key)}\s*=", stripped):
            return number
    return None


# =============================================================================================
# Data directory: private to the user who runs t3 (SPEC 1.2)


class DataDirError(Exception):
    """The data directory (or the configuration file) is not private to this user, or holds
    something t3 cannot use: t3 refuses to start."""


_OWN_FILES = ("t3.sqlite", "t3.sqlite-wal", "t3.sqlite-shm", "client-token", "server.json",
              "t3.lock")
_OWN_DIRS = ("logs", "backups", "scratch", "worktrees", "agents")
_TIGHTENED_DIRS = ("logs", "backups", "agents")  # their files are t3's; the others hold workspaces
_TOKEN = re.compile(r"[A-Za-z0-9_-]{32,}")  # what secrets.token_urlsafe(32) makes (43 chars)


def open_data_dir(value: str | None) -> Path:
    """The data directory, created 0700 or checked and tightened to 0700; its own files and
    folders are checked (never a symlink) and tightened to 0600 / 0700."""
    path = Path(value or os.environ.get("T3_HOME") or str(Path.home() / ".t3")).expanduser()
    path = path.resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # the user's umask: not t3's folders
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.stat(path)
    except OSError as exc:
        raise DataDirError(f"cannot create the data directory {path}: {exc.strerror}") from exc
    if info.st_uid != os.geteuid():
        raise DataDirError(f"refusing the data directory {path}: it belongs to uid "
                           f"{info.st_uid}, not to this user (uid {os.geteuid()}); pass a "
                           "--data-dir of your own")
    if info.st_mode & 0o022:
        raise DataDirError(f"refusing the data directory {path}: other users may write to it "
                           f"(mode {info.st_mode & 0o777:o}); fix: chmod 700 {path}")
    _tighten(path, info.st_mode)
    for name in (*_OWN_FILES, *_OWN_DIRS):
        try:
            mode = os.lstat(path / name).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise DataDirError(f"refusing {path / name}: it is a symlink, and t3 never follows "
                               "one in its data directory; remove it")
        if name in _OWN_DIRS and not stat.S_ISDIR(mode):
            raise DataDirError(f"refusing {path / name}: t3 keeps a folder there; remove it")
        _tighten(path / name, mode)
    for name in _OWN_DIRS:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path / name, 0o700)
    for name in _TIGHTENED_DIRS:  # only the first level: deeper ones sit in a 0700 folder
        for entry in os.scandir(path / name):
            if not entry.is_symlink():
                _tighten(Path(entry.path), entry.stat(follow_symlinks=False).st_mode)
    return path


def _tighten(path: Path, mode: int) -> None:
    if mode & 0o077:
        os.chmod(path, mode & 0o700)


def check_config_file(path: Path) -> None:
    """Refuse a configuration file another user could have written: it names the commands t3
    runs. Root's own files are trusted (root can do anything anyway)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    if info.st_uid not in (os.geteuid(), 0):
        raise DataDirError(f"refusing the configuration {path}: it belongs to uid "
                           f"{info.st_uid}, not to this user (uid {os.geteuid()}), and it "
                           "names the commands t3 runs")
    if info.st_mode & 0o022:
        raise DataDirError(f"refusing the configuration {path}: other users may write to it "
                           f"(mode {info.st_mode & 0o777:o}), and it names the commands t3 "
                           f"runs; fix: chmod 600 {path}")


def warn_readable_secrets(path: Path, config: Config) -> None:
    """Provider ``env`` values are often API keys: say so when other users may read them."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.stat(path).st_mode
        if mode & 0o044 and any(p["env"] for p in config.providers or ()):
            log.warning("%s holds provider env values and other users may read it (mode %o); "
                        "fix: chmod 600 %s", path, mode & 0o777, path)


def client_token(data_dir: Path) -> str:
    """Read the client token, creating it (mode 0600) on first use: whole, so that a reader
    racing the creation never sees an empty file."""
    path = data_dir / "client-token"
    if not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):  # another process made it first
            _write_private_atomic(path, secrets.token_urlsafe(32) + "\n", replace=False)
    return _read_token(path)


def rotate_client_token(data_dir: Path) -> str:
    """Replace the client token atomically; a running server refuses the old one from its next
    request on (``ClientToken``)."""
    path = data_dir / "client-token"
    token = secrets.token_urlsafe(32)
    _write_private_atomic(path, token + "\n", replace=True)
    return token


def _read_token(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise DataDirError(f"cannot read the client token {path}: {exc.strerror}; "
                           "run `python t3.py token --rotate` to write a new one") from exc
    with os.fdopen(fd, errors="replace") as f:
        token = f.read(4096).strip()
    if not _TOKEN.fullmatch(token):
        raise DataDirError(f"{path} does not hold a well-formed client token (32 or more of "
                           "A-Z a-z 0-9 _ -); run `python t3.py token --rotate` to write a "
                           "new one")
    return token


class ClientToken:
    """The client token as the file holds it now (``token --rotate`` may replace it): each check
    stats the file and re-reads it when inode, mtime or size changed, so an old one ends at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature: tuple[int, int, int] | None = None
        self._hash: str | None = None  # None: no well-formed token, nothing matches

    def matches(self, token: str) -> bool:
        try:
            info = os.lstat(self.path)
        except OSError:
            info = None
        signature = (info.st_ino, info.st_mtime_ns, info.st_size) if info else None
        if signature != self._signature:
            self._signature = signature
            try:
                self._hash = _hash(_read_token(self.path)) if signature else None
            except DataDirError as exc:
                log.error("the client token is unusable, so it is refused: %s", exc)
                self._hash = None
        return self._hash is not None and hmac.compare_digest(_hash(token), self._hash)


class DataDirLock:
    """An exclusive lock on ``<data-dir>/t3.lock``: one server per data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "t3.lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _create_private(path: Path) -> None:
    """Create ``path`` empty and 0600 unless it exists (never through a symlink): SQLite then
    gives its -wal and -shm files the same mode."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def _write_private_atomic(path: Path, text: str, *, replace: bool) -> None:
    """Write a 0600 file through a temp file: readers see no content or all of it. Without
    ``replace``, an existing ``path`` (even a symlink) raises FileExistsError, untouched."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)  # left by a killed process that had our pid
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(temp, path)
        else:
            os.link(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


# =============================================================================================
# Credentials and bearer auth


class Credentials:
    """Provider-session credentials (hashes only, in memory). One lives at most
    ``max_lifetime_s`` and ends after ``idle_s`` idle, never while its session serves a turn;
    an ended one is gone for good (the orchestrator replaces the session: ``renewal_due``)."""

    def __init__(self, *, max_lifetime_s: int, idle_s: int, mcp_url: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from tools import Scope
        self._scope_type = Scope
        self._sessions: dict[str, _SessionCredential] = {}  # token hash -> credential
        self._by_session: dict[str, str] = {}  # provider session id -> token hash
        self.max_lifetime_s, self.idle_s, self.mcp_url = max_lifetime_s, idle_s, mcp_url
        self._clock = clock

    def issue(self, *, thread_id: str, provider_instance_id: str, provider_session_id: str) -> Any:
        """A new credential for one provider session, as the MCP endpoint its agent is given.
        Only the token's hash is kept; the raw token lives in the returned endpoint alone."""
        from orchestrator import McpEndpoint
        token = secrets.token_urlsafe(32)
        now = self._clock()
        # The idempotency key names the caller (thread + instance), not this credential, so a
        # retry after a re-issue converges; hashed, so the ids derived from it stay short.
        key = "agent-" + _hash(f"{thread_id}\0{provider_instance_id}")[:32]
        scope = self._scope_type(kind="thread", key=key, thread_id=thread_id,
                                 provider_instance_id=provider_instance_id,
                                 provider_session_id=provider_session_id,
                                 capabilities=frozenset({"orchestration", "preview"}))
        self.revoke(provider_session_id)
        digest = _hash(token)
        self._sessions[digest] = _SessionCredential(scope=scope, session_id=provider_session_id,
                                                    issued=now, touched=now)
        self._by_session[provider_session_id] = digest
        return McpEndpoint(name="t3-code", url=self.mcp_url,
                           headers={"Authorization": f"Bearer {token}"})

    def set_active(self, provider_session_id: str, active: bool) -> None:
        """The session serves a turn (``active``), or has just finished one."""
        if (credential := self._live(provider_session_id)) is not None:
            credential.active = active
            credential.touched = self._clock()

    def renewal_due(self, provider_session_id: str) -> bool:
        """True when the session was given a credential that has ended or is past half its
        maximum lifetime: its next turn should run in a session with a new one."""
        if provider_session_id not in self._by_session:
            return False
        credential = self._live(provider_session_id)
        return credential is None or \
            self._clock() - credential.issued > self.max_lifetime_s / 2

    def revoke(self, provider_session_id: str) -> None:
        digest = self._by_session.pop(provider_session_id, None)
        if digest is not None:
            self._sessions.pop(digest, None)

    def resolve(self, token: str) -> Any:
        credential = self._sessions.get(_hash(token))
        if credential is None or self._live(credential.session_id) is not credential:
            return None
        credential.touched = self._clock()
        return credential.scope

    def _live(self, provider_session_id: str) -> _SessionCredential | None:
        """The session's credential if it is still valid; an ended one is dropped for good
        (its session id stays known, so ``renewal_due`` can tell)."""
        digest = self._by_session.get(provider_session_id)
        credential = self._sessions.get(digest) if digest else None
        if credential is None:
            return None
        now = self._clock()
        if now - credential.issued > self.max_lifetime_s or (
                not credential.active and now - credential.touched > self.idle_s):
            del self._sessions[digest]  # type: ignore[arg-type]
            return None
        return credential


@dataclasses.dataclass(slots=True)
class _SessionCredential:
    scope: Any
    session_id: str
    issued: float
    touched: float
    active: bool = False  # serving a turn: idle expiry does not apply


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_auth(app: ASGIApp, *, credentials: Credentials, client_token: ClientToken) -> ASGIApp:
    """``Authorization: Bearer`` as a scope for the tool handlers, or 401 before the body is
    read: the client token (as the file holds it now), else a provider-session credential."""
    from tools import Scope, current_scope

    async def middleware(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        header = _header(scope, b"authorization") or ""
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not token:
            resolved = None
        elif client_token.matches(token):
            resolved = Scope(kind="client", key="client")
        else:
            resolved = credentials.resolve(token)
        if resolved is None:
            log.warning("rejected an MCP request: %s", "unknown or expired token" if token
                        else "missing bearer token")
            await _refuse(scope, send, 401, "invalid_mcp_credential",
                          "A valid t3 bearer credential is required (the client token from "
                          "`python t3.py token`, or a provider-session credential).",
                          [(b"www-authenticate", b'Bearer error="invalid_token"'),
                           (b"cache-control", b"no-store")])
            return
        reset = current_scope.set(resolved)
        try:
            await app(scope, receive, send)
        finally:
            current_scope.reset(reset)
    return middleware


# =============================================================================================
# The ASGI app: routes, and what every request passes before a route runs (SPEC 1.5)


BODY_TIMEOUT_S = 10.0  # for a whole request body, counted from when it may be read


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """What serves one path, and for which methods (others get 405)."""

    methods: tuple[str, ...]
    handler: ASGIApp
    # False for webhooks: their senders send no Origin, and no page of the server's posts to
    # them, so only [server] allowed_origins may.
    own_origin: bool = True
    websocket: ASGIApp | None = None  # what serves a WebSocket upgrade of this path


@dataclasses.dataclass(frozen=True, slots=True)
class HttpPolicy:
    """Which ``Host`` and ``Origin`` headers may reach the server. The Host rule defeats DNS
    rebinding (a web page whose name resolves to 127.0.0.1 still sends its own name); the
    Origin rule keeps pages open in the user's browser from calling the server."""

    hosts: frozenset[str]  # besides loopback addresses and localhost
    own_origins: frozenset[str]
    listed_origins: frozenset[str]  # [server] allowed_origins

    @classmethod
    def for_server(cls, *, config: Config, host: str, port: int, tls: bool) -> HttpPolicy:
        """Loopback names, the address the server listens on (unless a wildcard), and the
        ``[server]`` entries; the server's own origins for each of those names."""
        bound = [] if host in ("0.0.0.0", "::") else [host.lower()]
        names = ["127.0.0.1", "localhost", "[::1]", *(f"[{h}]" if ":" in h else h for h in bound)]
        scheme = "https" if tls else "http"
        return cls(hosts=frozenset([*bound, *config.allowed_hosts]),
                   own_origins=frozenset(f"{scheme}://{name}:{port}" for name in names),
                   listed_origins=frozenset(o.lower() for o in config.allowed_origins))

    def host_allowed(self, value: str) -> bool:
        value = value.strip().lower()
        parsed = _HOST.fullmatch(value)
        if parsed is None:
            return False
        name = parsed.group("v6") or parsed.group("name")
        return _is_loopback(name) or name in self.hosts or value in self.hosts

    def origin_allowed(self, value: str, *, own: bool = True) -> bool:
        value = value.strip().lower().rstrip("/")
        return value in self.listed_origins or (own and value in self.own_origins)


_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[^:\[\]/@\s]+))(?::\d{1,5})?")


def _is_loopback(name: str) -> bool:
    try:
        return name == "localhost" or ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class WebView:
    """The web view served at ``GET /``: ``ui.html``, one static page that holds no data and so
    needs no auth (it gets everything over /ws once the user gives it the client token). Its
    policy lets only its own inline script and style run (by hash), lets it connect only to this
    server, and refuses HTML sinks (Trusted Types), form submissions, framing and referrers."""

    body: bytes
    csp: str

    @classmethod
    def load(cls) -> WebView | None:
        """``ui.html`` beside this file (a checkout, an editable install) or in
        ``<prefix>/share/t3`` (where an installed wheel puts it); None when absent."""
        for path in (Path(__file__).resolve().parent / "ui.html",
                     Path(sys.prefix) / "share" / "t3" / "ui.html"):
            with contextlib.suppress(FileNotFoundError):
                return cls.of(path.read_text(encoding="utf-8"))
        return None

    @classmethod
    def of(cls, html: str) -> WebView:
        def hashes(tag: str) -> str:
            found = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
            return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(
                text.encode()).digest()).decode() + "'" for text in found) or "'none'"
        # connect-src 'self' covers ws: and wss: to this origin (CSP level 3).
        return cls(body=html.encode(), csp=(
            f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'; require-trusted-types-for 'script'; trusted-types 'none'"))

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-length", str(len(self.body)).encode()), (b"cache-control", b"no-store"),
            (b"content-security-policy", self.csp.encode()), (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"no-referrer"), (b"x-content-type-options", b"nosniff")]})
        await send({"type": "http.response.body",
                    "body": b"" if scope.get("method") == "HEAD" else self.body})


def build_app(*, mcp: ASGIApp, credentials: Credentials, client_token: ClientToken,
              environment_id: str, policy: HttpPolicy, ws: ASGIApp | None = None,
              web_view: WebView | None = None, hooks: ASGIApp | None = None) -> ASGIApp:
    """The routes, each reached only past ``_refusal`` (Host, Origin, path, method). Paths are
    exact, but for the webhooks' ``/hooks/{scheduledTaskId}/{hookToken}``."""
    async def healthz(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await _send_json(send, 200, {"ok": True, "version": VERSION,
                                     "environmentId": environment_id})

    async def ws_without_upgrade(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await _refuse(scope, send, 426, "websocket_required",
                      "/ws speaks WebSocket (orchestration protocol 2)",
                      [(b"upgrade", b"websocket")])

    routes = {
        "/healthz": Route(methods=("GET",), handler=healthz),
        # GET would open a server-to-client stream, which a stateless server never uses.
        "/mcp": Route(methods=("POST", "DELETE"), handler=bearer_auth(
            _bounded_body(mcp), credentials=credentials, client_token=client_token)),
        "/ws": Route(methods=("GET",), handler=ws_without_upgrade, websocket=ws),
    }
    if web_view is not None:
        routes["/"] = Route(methods=("GET", "HEAD"), handler=web_view)
    hook_route = None if hooks is None else Route(
        methods=("POST", "PUT", "PATCH"), handler=hooks, own_origin=False)

    def route_of(path: str) -> Route | None:
        return hook_route if path.startswith("/hooks/") else routes.get(path)

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await _websocket(scope, receive, send, route_of(scope.get("path", "")), policy)
            return
        path, method = _shown_path(scope.get("path", "")), scope.get("method", "GET")
        started = False

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            route = route_of(scope.get("path", ""))
            refusal = _refusal(scope, route, policy)
            if refusal is not None:
                await _refuse(scope, tracked_send, *refusal)
            elif route is not None:
                await route.handler(scope, receive, tracked_send)
        except _SlowBody:
            log.warning("closed a %r %r request whose body took over %d s", method, path,
                        BODY_TIMEOUT_S)
            if not started:
                await _refuse(scope, send, 408, "request_timeout",
                              f"the request body did not arrive within {BODY_TIMEOUT_S:g} s")
        except Exception:
            log.exception("request %r %r failed", method, path)
            if not started:
                await _send_json(send, 500, {"error": "internal_error",
                                             "message": "t3 hit an internal error; see its log"})
    return app


async def _websocket(scope: MutableMapping[str, Any], receive: Any, send: Any,
                     route: Route | None, policy: HttpPolicy) -> None:
    """A WebSocket upgrade passes the same checks as any request; a refusal is an HTTP answer
    to the upgrade (ASGI's websocket.http.response), and so is a path without a WebSocket."""
    refusal = _refusal(scope, route, policy)
    if refusal is None and (route is None or route.websocket is None):
        refusal = (404, "not_found", f"no WebSocket at {scope.get('path', '')}", ())
    if refusal is not None:
        await receive()  # websocket.connect
        status, error, message, headers = refusal
        await _send_json(_denial(send), status, {"error": error, "message": message}, headers)
        return
    assert route is not None and route.websocket is not None
    try:
        await route.websocket(scope, receive, send)
    except Exception:
        log.exception("a /ws connection failed")


_Refusal = tuple[int, str, str, Sequence[tuple[bytes, bytes]]]


def _refusal(scope: MutableMapping[str, Any], route: Route | None,
             policy: HttpPolicy) -> _Refusal | None:
    """Why a request is refused before anything reads its body (logged), or None. Client-made
    strings are logged with %r: a newline in them cannot forge a log line."""
    path, method = _shown_path(scope.get("path", "")), scope.get("method", "GET")
    host, origin = _header(scope, b"host"), _header(scope, b"origin")
    if host is None or not policy.host_allowed(host):
        log.warning("refused %r %r: Host %r is not a name of this server", method, path, host)
        return (403, "host_not_allowed", "The Host header must name a loopback address or an "
                "entry of [server] allowed_hosts.", ())
    if origin is not None and \
            not policy.origin_allowed(origin, own=route is None or route.own_origin):
        log.warning("refused %r %r: Origin %r is not allowed", method, path, origin)
        return (403, "origin_not_allowed", "Requests from this Origin are refused; "
                "[server] allowed_origins lists the ones accepted.", ())
    if route is None:
        return 404, "not_found", f"no route for {method} {path}", ()
    if method not in route.methods:
        allowed = ", ".join(route.methods)
        return (405, "method_not_allowed", f"{path} takes {allowed}",
                [(b"allow", allowed.encode())])
    return None


def _shown_path(path: str) -> str:
    """A path as logs and answers show it: a webhook's token is left out (it is its password)."""
    if not path.startswith("/hooks/"):
        return path
    return "/hooks/" + path[len("/hooks/"):].split("/", 1)[0] + "/<token>"


class _SlowBody(Exception):
    """The request body did not arrive within ``BODY_TIMEOUT_S``."""


def _bounded_body(app: ASGIApp) -> ASGIApp:
    """Over ``MAX_BODY_BYTES`` is 413; a body still arriving after ``BODY_TIMEOUT_S`` is
    ``_SlowBody`` (408). Only the body is timed: hypercorn's read_timeout would also cut waits,
    which stream for up to 600 s (the MCP handler reads the body before any long work)."""
    async def bounded(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        length = _header(scope, b"content-length") or ""
        too_long = length.isdigit() and int(length) > MAX_BODY_BYTES
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S) as deadline:
                async def receive_body() -> Any:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        deadline.reschedule(None)
                    return message
                if too_long:  # read, so the client sees the answer rather than a reset
                    await _drain(receive_body, limit=4 * MAX_BODY_BYTES)
                    await _refuse(scope, send, 413, "payload_too_large",
                                  f"request bodies are limited to {MAX_BODY_BYTES} bytes")
                else:
                    await app(scope, receive_body, send)
        except TimeoutError:
            if deadline.expired():
                raise _SlowBody from None
            raise
    return bounded


# A delivery refused after its body was read: the status for each of the orchestrator's codes.
_HOOK_STATUS = {"hook_not_found": 404, "hook_disabled": 409, "invalid_signature": 401,
                "invalid_request": 400, "rate_limited": 429, "queue_full": 429}


def webhook_endpoint(orch: Any) -> ASGIApp:
    """``POST/PUT/PATCH /hooks/{scheduledTaskId}/{hookToken}`` (SPEC 7), the HTTP part. Before
    the body is read: the token against the task's hash in constant time (wrong: the same 404 as
    an unknown hook), 409 paused, 413 over 1 MiB declared. Then the body whole (within
    ``BODY_TIMEOUT_S``), ``Orchestrator.receive_webhook``, and 202 ``{deliveryId, outcome}``."""
    from orchestrator import HOOK_BODY_MAX_BYTES, T3Error, WebhookRequest

    async def hook(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        task_id, token = _hook_address(scope)
        presented = _hash(token)  # hashed for an unknown hook too: the same work either way
        task = await orch.webhook_task(task_id) if task_id else None
        if task is None or not hmac.compare_digest(presented, task.hook_token_sha256 or ""):
            log.warning("refused a webhook request: no hook %r with that token", task_id)
            await _refuse(scope, send, 404, "hook_not_found", "No webhook at this address.")
            return
        if not task.enabled:
            await _refuse(scope, send, 409, "hook_disabled",
                          f"Scheduled task {task_id} is paused (enabled: false).")
            return
        length = _header(scope, b"content-length") or ""
        try:
            body = None if length.isdigit() and int(length) > HOOK_BODY_MAX_BYTES else \
                await _read_body(receive, limit=HOOK_BODY_MAX_BYTES)
        except ConnectionResetError:
            log.info("a webhook sender for hook %r went away before its body ended", task_id)
            return
        if body is None:
            await _refuse(scope, send, 413, "payload_too_large",
                          f"webhook bodies are limited to {HOOK_BODY_MAX_BYTES} bytes")
            return
        request = WebhookRequest(
            method=scope["method"], body=body,
            headers=tuple((k.decode("latin-1").lower(), v.decode("latin-1"))
                          for k, v in scope.get("headers") or []),
            query=tuple(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                                               keep_blank_values=True)))
        try:
            result = await orch.receive_webhook(task_id, request)
        except T3Error as exc:
            if exc.code not in _HOOK_STATUS:
                raise
            log.warning("refused a delivery to hook %r: %s", task_id, exc.code)
            retry = getattr(exc, "retry_after_s", None)
            await _send_json(send, _HOOK_STATUS[exc.code], {"error": exc.code, "message": str(
                exc)}, [(b"retry-after", str(retry).encode())] if retry else [])
            return
        await _send_json(send, 202, dict(result))
    return hook


def _hook_address(scope: MutableMapping[str, Any]) -> tuple[str, str]:
    """(task id, token) of ``/hooks/<id>/<token>``, each percent-decoded once (a task id may
    hold a %); ("", "") for any other shape."""
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    parts = raw.split(b"?", 1)[0].split(b"/")
    if len(parts) != 4 or parts[1] != b"hooks" or not parts[2] or not parts[3]:
        return "", ""
    return (urllib.parse.unquote(parts[2].decode("latin-1")),
            urllib.parse.unquote(parts[3].decode("latin-1")))


async def _read_body(receive: _Receive, *, limit: int) -> bytes | None:
    """The whole request body; None as soon as it exceeds ``limit`` (the rest is left unread).
    A body still arriving ``BODY_TIMEOUT_S`` after the request is ``_SlowBody`` (408)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] != "http.request":  # http.disconnect
                    raise ConnectionResetError
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > limit:
                    return None
                if not message.get("more_body"):
                    return b"".join(chunks)
    except TimeoutError:
        raise _SlowBody from None


async def _lifespan(receive: _Receive, send: _Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _header(scope: MutableMapping[str, Any], name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers") or [] if k == name), None)


async def _refuse(scope: MutableMapping[str, Any], send: _Send, status: int, error: str,
                  message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """An error answer sent without reading (all of) the body. An HTTP/1 connection then
    closes: what is left of the body must not be read as the next request. (HTTP/2 forbids the
    header; there the answer ends only its stream.)"""
    if str(scope.get("http_version", "1.1")).startswith("1"):
        headers = [*headers, (b"connection", b"close")]
    await _send_json(send, status, {"error": error, "message": message}, headers)


async def _send_json(send: _Send, status: int,
                     body: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": payload})


async def _drain(receive: _Receive, *, limit: int) -> None:
    """Read and drop a request body, up to about ``limit`` bytes."""
    seen = 0
    while seen <= limit:
        message = await receive()
        seen += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return


def _by_accept(sse: ASGIApp, plain: ASGIApp) -> ASGIApp:
    """Route an MCP POST by its Accept header; both managers are then told the client takes
    both media types, which is what the SDK insists on."""
    async def route(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"accept"]
        accept = dict(scope.get("headers") or []).get(b"accept", b"").lower()
        target = sse if b"text/event-stream" in accept or scope.get("method") != "POST" \
            else plain
        if scope.get("method") == "POST":
            headers.append((b"accept", b"application/json, text/event-stream"))
            scope = {**scope, "headers": headers}
        await target(scope, receive, send)
    return route


# =============================================================================================
# The /ws client API for the CLI and the web view: {"id", "method", "params"} gets {"id",
# "result"} or {"id", "error": {"code", "message"}}; a stream sends {"id", "item"} until
# unsubscribed or too far behind. A method is an operation of tools.OPERATIONS, run for a person
# (the client token); this frames it. Streams and the test clock are /ws's own.


PROTOCOL_VERSION = 2
_PROTOCOL_REFUSAL = {"code": "orchestration_protocol_incompatible",
                     "message": "Update this client to one that supports orchestration "
                                "protocol 2.", "orchestrationProtocolVersion": PROTOCOL_VERSION}
_SUBSCRIBER_BYTES = 4 * 1024 * 1024  # a stream this far behind its reader is cut off
_AFTER = {"type": "integer", "minimum": 0}
_STREAM_PARAMS = {"subscribeThread": {"type": "object", "additionalProperties": False,
                                      "properties": {"threadId": {"type": "string",
                                                                  "minLength": 1},
                                                     "afterSequence": _AFTER},
                                      "required": ["threadId"]},
                  "subscribeShell": {"type": "object", "additionalProperties": False,
                                     "properties": {"afterSequence": _AFTER}}}

Emit = Callable[[Any], Awaitable[None]]  # a stream item: a dict, or prebuilt JSON text


def _failure(code: str, message: str, **detail: Any) -> Exception:
    """A /ws refusal of its own, in the one error tree (``detail``: more fields of the body)."""
    from orchestrator import T3Error
    failure = T3Error(message, code=code)
    failure.detail = detail  # type: ignore[attr-defined]
    return failure


class ClientApi:
    """The /ws methods. A person holding the client token is the caller: commands are recorded
    ``createdBy: "user"`` with ``creationSource`` web (default) or cli."""

    def __init__(self, *, orch: Any, toolkit: Any, store: Any,
                 test_clock: TestClock | None = None) -> None:
        from tools import Scope
        self.orch, self.toolkit, self.store, self.test_clock = orch, toolkit, store, test_clock
        self.connections: set[_WsConnection] = set()
        self.scope = Scope(kind="client", key="client")
        self._streams: dict[str, Callable[[Mapping[str, Any], Emit], Awaitable[None]]] = {
            "subscribeThread": self.subscribe_thread, "subscribeShell": self.subscribe_shell}

    async def call(self, method: str, params: Mapping[str, Any], emit: Emit) -> Any:
        """One method (``orchestration.`` prefix optional); a stream returns when it ends."""
        from tools import BY_WS_NAME, Call, validate
        name = method.removeprefix("orchestration.")
        if name in self._streams:
            return await self._streams[name](validate(_STREAM_PARAMS[name], dict(params)), emit)
        if name == "advanceTestClock" and self.test_clock is not None:
            return await self.advance_test_clock(params)
        if name not in BY_WS_NAME:
            raise _failure("invalid_request", f"unknown method {method!r}; the methods are "
                           f"{', '.join([*BY_WS_NAME, *self._streams, 'unsubscribe'])}")
        source = params.get("creationSource", "web")
        if source not in ("web", "cli"):
            raise _failure("invalid_request", "creationSource: must be web or cli")
        return await self.toolkit.run(BY_WS_NAME[name], Call(self.scope, source), {
            k: v for k, v in params.items() if k != "creationSource"})

    async def advance_test_clock(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Tests only (T3_TEST_CLOCK): move the clock forward, and return once the scheduler
        has fired what that made due."""
        seconds = params.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            raise _failure("invalid_request", "seconds: a number >= 0")
        assert self.test_clock is not None
        self.test_clock.advance(float(seconds))
        await self.orch.scheduler_pass()
        return {"now": self.test_clock.iso()}

    # -- streams ---------------------------------------------------------------------------------

    async def subscribe_thread(self, params: Mapping[str, Any], emit: Emit) -> None:
        """A snapshot at N (or, with ``afterSequence`` N, the stored events after N), a
        ``synchronized`` marker, then each event as it commits: gap-free, none twice."""
        thread_id, after = params["threadId"], params.get("afterSequence")
        await self.toolkit.threads.thread(thread_id)
        subscription = self.orch.subscribe(thread_id=thread_id, max_bytes=_SUBSCRIBER_BYTES)
        try:  # subscribed before reading: what commits meanwhile is in one or both, never lost
            if after is None:
                last, projection = self.toolkit.projection(thread_id)
                await emit({"kind": "snapshot", "snapshotSequence": last,
                            "projection": projection})
            else:
                last = after
                while rows := self.store.events_after(last, thread_id=thread_id, limit=500):
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
            self.orch.unsubscribe(subscription)

    async def subscribe_shell(self, params: Mapping[str, Any], emit: Emit) -> None:
        """The projects, threads and scheduled tasks (a snapshot, or those changed after
        ``afterSequence``), ``synchronized``, then a thread's shell, or a scheduled task as
        ``list_scheduled_tasks`` shows it, each time it changes."""
        from tools import BY_WS_NAME, Call
        after = params.get("afterSequence")
        subscription = self.orch.subscribe(max_bytes=_SUBSCRIBER_BYTES // 64)
        try:
            last = self.store.max_sequence()
            if after is None:
                schedules = (await self.toolkit.run(BY_WS_NAME["listScheduledTasks"],
                                                    Call(self.scope, "web"), {}))["tasks"]
                await emit({"kind": "snapshot",
                            "snapshot": {**self._shell_snapshot(last), "schedules": schedules}})
            else:
                for thread_id in self.store.threads_touched_after(after, limit=1000):
                    await self._emit_shell(thread_id, last, emit)
            await emit({"kind": "synchronized", "sequence": last})
            while True:
                items = await subscription.take()
                if subscription.overflowed:
                    raise _resubscribe(last)
                changed = {thread_id: sequence for sequence, thread_id, _ in items}
                for thread_id, sequence in changed.items():
                    await self._emit_shell(thread_id, sequence, emit)
                    last = max(last, sequence)
        finally:
            self.orch.unsubscribe(subscription)

    async def _emit_shell(self, thread_id: str, sequence: int, emit: Emit) -> None:
        state = await self.orch.state(thread_id)
        if state is None:
            return
        if state.thread is None:  # a scheduled task's stream
            task = state.entities["scheduled-task"].get(thread_id)
            if task is not None and task.deleted_at is not None:
                await emit({"kind": "schedule.removed", "sequence": sequence,
                            "scheduledTaskId": thread_id})
            elif task is not None:
                await emit({"kind": "schedule.updated", "sequence": sequence,
                            "task": self.toolkit._task_summary(task)})
        elif state.thread.deleted_at is not None:
            await emit({"kind": "thread.removed", "sequence": sequence, "threadId": thread_id})
        else:
            await emit({"kind": "thread.updated", "sequence": sequence,
                        "thread": self.toolkit.shell_of(state)})

    def _shell_snapshot(self, sequence: int) -> dict[str, Any]:
        ctx = self.toolkit.ctx
        projects = [*ctx.projects, ctx.scratch_project]
        threads = []
        for project in projects:
            _, rows = self.store.list_threads(project.id, limit=500, archived=None,
                                              now=self.orch.now())
            threads += [{**self.toolkit._shell(row), "projectId": project.id} for row in rows]
        return {"snapshotSequence": sequence, "threads": threads,
                "projects": [{"projectId": p.id, "title": p.title, "path": p.path}
                             for p in projects]}


def _resubscribe(last: int) -> Exception:
    return _failure("resubscribe", f"this stream fell too far behind its reader and was ended; "
                    f"subscribe again with afterSequence = {last}", lastSequence=last)


class _WsConnection:
    """One /ws connection: each request in its own task; frames go out one at a time, so a
    reader that does not read holds up only its own connection (its streams are cut off)."""

    MAX_IN_FLIGHT = 64

    def __init__(self, api: ClientApi, send: _Send) -> None:
        self.api, self._send = api, send
        self._lock = asyncio.Lock()
        self._tasks: dict[Any, asyncio.Task[None]] = {}

    async def serve(self, receive: _Receive) -> None:
        self.api.connections.add(self)
        try:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message["type"] == "websocket.receive":
                    self._start(message.get("text") or
                                (message.get("bytes") or b"").decode(errors="replace"))
        finally:
            self.api.connections.discard(self)
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def close(self) -> None:
        """The server is stopping: end the requests and streams, and say so (1001, going
        away), so that shutdown does not wait for clients to leave."""
        for task in list(self._tasks.values()):
            task.cancel()
        with contextlib.suppress(Exception):  # a reader that reads nothing gets no goodbye
            async with asyncio.timeout(1.0):
                async with self._lock:
                    await self._send({"type": "websocket.close", "code": 1001})

    def _start(self, text: str) -> None:
        from orchestrator import parse_json
        try:
            frame, unparsed = parse_json(text), ""
        except ValueError as exc:
            frame, unparsed = None, f" ({exc})"
        request_id = frame.get("id") if isinstance(frame, dict) else None
        failure = None
        if not isinstance(frame, dict) or not isinstance(frame.get("method"), str) or \
                not isinstance(frame.get("params", {}), dict) or \
                not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            failure = _failure("invalid_request", 'a frame is {"id": string or integer, '
                               f'"method": string, "params": object}}{unparsed}')
        elif request_id in self._tasks:
            failure = _failure("invalid_request", f"request id {request_id!r} is in use")
        elif len(self._tasks) >= self.MAX_IN_FLIGHT:
            failure = _failure("too_many_requests", f"at most {self.MAX_IN_FLIGHT} requests "
                               "and streams at once on one connection")
        if failure is not None:
            task = asyncio.create_task(self._reply(request_id, error=_error_body(failure, "")))
        elif frame["method"] in ("unsubscribe", "orchestration.unsubscribe"):
            task = asyncio.create_task(self._unsubscribe(request_id, frame.get("params", {})))
        else:
            task = asyncio.create_task(self._run(request_id, frame["method"],
                                                 frame.get("params", {})))
        key = request_id if failure is None else object()
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    async def _run(self, request_id: Any, method: str, params: Mapping[str, Any]) -> None:
        async def emit(item: Any) -> None:
            prefix = f'{{"id":{json.dumps(request_id)},"item":'
            await self._write(prefix + (item if isinstance(item, str) else
                                        json.dumps(item, ensure_ascii=False)) + "}")
        try:
            result = await self.api.call(method, params, emit)
        except Exception as exc:  # the one place /ws shapes a failure
            await self._reply(request_id, error=_error_body(exc, f"/ws method {method!r}"))
        else:
            await self._reply(request_id, result=result)

    async def _unsubscribe(self, request_id: Any, params: Mapping[str, Any]) -> None:
        stream = self._tasks.get(params.get("id"))
        if stream is not None:
            stream.cancel()
        await self._reply(request_id, result={"unsubscribed": stream is not None})

    async def _reply(self, request_id: Any, **outcome: Any) -> None:
        await self._write(json.dumps({"id": request_id, **outcome}, ensure_ascii=False))

    async def _write(self, text: str) -> None:
        async with self._lock:
            await self._send({"type": "websocket.send", "text": text})


def _error_body(exc: Exception, what: str) -> dict[str, Any]:
    from tools import failure_of
    code, message = failure_of(exc, what)
    return {"code": code, "message": message, **getattr(exc, "detail", {})}


def ws_endpoint(api: ClientApi, client_token: ClientToken) -> ASGIApp:
    """``GET /ws`` upgraded: the protocol gate (426, before any credential is looked at), then
    the client token (header, or ``?token=`` for browsers; never logged), then the frames."""
    async def endpoint(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await receive()  # websocket.connect
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        version = (query.get("orchestrationProtocol") or [None])[0] or \
            _header(scope, b"x-t3-orchestration-protocol")
        header = _header(scope, b"authorization") or ""
        token = header[7:].strip() if header[:7].lower() == "bearer " else \
            (query.get("token") or [""])[0]
        if version != str(PROTOCOL_VERSION):
            await _send_json(_denial(send), 426, _PROTOCOL_REFUSAL)
        elif not token or not client_token.matches(token):
            log.warning("rejected a /ws connection: %s", "unknown token" if token
                        else "missing token")
            await _send_json(_denial(send), 401, {
                "error": "invalid_mcp_credential",
                "message": "/ws takes the client token (`python t3.py token`): an "
                           "Authorization: Bearer header, or ?token= from a browser."})
        else:
            await send({"type": "websocket.accept"})
            await _WsConnection(api, send).serve(receive)
    return endpoint


def _denial(send: _Send) -> _Send:
    """``send`` for an HTTP answer to a WebSocket upgrade (ASGI's websocket.http.response)."""
    async def deny(message: MutableMapping[str, Any]) -> None:
        await send({**message, "type": "websocket." + message["type"]})
    return deny


# =============================================================================================
# Serving


async def serve(args: argparse.Namespace) -> int:
    import providers as prov
    # What t3 (SQLite, logs, backups too) creates in its data directory is private; agents,
    # git and setup get the user's umask back (CHILD_UMASK): they write in the user's projects.
    import workspace
    prov.CHILD_UMASK = workspace.CHILD_UMASK = os.umask(0o077)
    try:
        return await _serve(args, prov)
    finally:
        os.umask(prov.CHILD_UMASK)


async def _serve(args: argparse.Namespace, prov: Any) -> int:
    from store import DatabaseTooNew, Store, StoreError

    try:
        data_dir = open_data_dir(args.data_dir)
        config_path = Path(args.config).expanduser().resolve() if args.config \
            else data_dir / "t3.toml"
        check_config_file(config_path)
        config = load_config(config_path, cwd=Path.cwd())
        client_token(data_dir)  # created, or refused when malformed, before anything starts
    except DataDirError as exc:
        print(f"t3: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"t3: invalid configuration: {exc}", file=sys.stderr)
        return 2
    warn_readable_secrets(config_path, config)
    _raise_fd_limit(config.max_connections)
    host = args.host or config.host
    port = config.port if args.port is None else args.port
    lock = DataDirLock(data_dir)
    if not lock.acquire():
        print(f"t3: another t3 server (pid {lock.holder()}) is already using {data_dir}; "
              "stop it first or pass another --data-dir", file=sys.stderr)
        return 1
    server_json = data_dir / "server.json"
    try:
        try:
            _create_private(data_dir / "t3.sqlite")
            store = Store(data_dir / "t3.sqlite", backups_dir=data_dir / "backups")
        except DatabaseTooNew as exc:
            print(f"t3: {exc}", file=sys.stderr)
            return 1
        except (StoreError, OSError) as exc:
            print(f"t3: cannot open the database: {exc}", file=sys.stderr)
            return 1
        try:
            return await _run(args, config, data_dir, store, host, port, server_json, prov=prov)
        finally:
            store.close()
    finally:
        with contextlib.suppress(FileNotFoundError):
            if json.loads(server_json.read_text()).get("pid") == os.getpid():
                server_json.unlink()
        lock.release()


async def _run(args: argparse.Namespace, config: Config, data_dir: Path, store: Any, host: str,
               port: int, server_json: Path, *, prov: Any) -> int:
    import hypercorn.asyncio.run
    import hypercorn.config
    import hypercorn.utils
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from tools import build_mcp_server
    hconfig = _hypercorn_config(config, hypercorn)
    if hconfig is None:
        return 2
    # Bind first: provider-session credentials name the MCP URL, and recovery may start agents.
    try:
        sock = _listen(host, port, cap=config.max_connections, tls=hconfig.ssl_enabled)
    except OSError as exc:
        print(f"t3: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    local_host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, url_host)
    scheme = "https" if hconfig.ssl_enabled else "http"
    url = f"{scheme}://{url_host}:{port}"

    environment_id = await store.meta("environmentId", f"env-{uuid.uuid4().hex[:12]}")
    credentials = Credentials(max_lifetime_s=config.credential_max_lifetime_s,
                              idle_s=config.credential_idle_s,
                              mcp_url=f"{scheme}://{local_host}:{port}/mcp")
    clock = TestClock.from_environment()
    orch, adapters, toolkit = await _start_domain(config, data_dir, store, environment_id,
                                                  credentials, prov=prov, base_url=url,
                                                  clock=clock)
    mcp_server = build_mcp_server(toolkit, version=VERSION)
    # Answers in SSE (progress flows); a JSON-only client gets JSON from a second manager.
    sse, plain = (StreamableHTTPSessionManager(app=mcp_server, stateless=True, json_response=j,
                                               max_request_body_size=MAX_BODY_BYTES)
                  for j in (False, True))
    client_token = ClientToken(data_dir / "client-token")
    web_view = WebView.load()
    if web_view is None:
        log.warning("ui.html is not installed beside t3.py: GET / (the web view) answers 404")
    clients = ClientApi(orch=orch, toolkit=toolkit, store=store, test_clock=clock)
    app = build_app(mcp=_by_accept(sse.handle_request, plain.handle_request), web_view=web_view,
                    credentials=credentials, client_token=client_token,
                    ws=ws_endpoint(clients, client_token), environment_id=environment_id,
                    hooks=webhook_endpoint(orch),
                    policy=HttpPolicy.for_server(config=config, host=host, port=port,
                                                 tls=hconfig.ssl_enabled))
    stop, http_stop = asyncio.Event(), asyncio.Event()
    gc.freeze()  # what startup made lives on: full collections walk only what serving makes
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with sse.run(), plain.run(), asyncio.TaskGroup() as tasks:
        # Adapters with something to install (acpRegistry) prepare in the background: the
        # server is up meanwhile and lists them unavailable with "preparing ...".
        preparing = [tasks.create_task(a.prepare(), name=f"prepare-{k}")
                     for k, a in adapters.items() if hasattr(a, "prepare")]
        server = loop.create_task(hypercorn.asyncio.run.worker_serve(
            hypercorn.utils.wrap_app(app, hconfig.wsgi_max_body_size, "asgi"), hconfig,
            sockets=hypercorn.config.Sockets(secure_sockets=[sock] if hconfig.ssl_enabled else [],
                                             insecure_sockets=[] if hconfig.ssl_enabled else [sock],
                                             quic_sockets=[]),
            shutdown_trigger=http_stop.wait))
        _announce(server_json, url=url, ws_url=f"{'wss' if hconfig.ssl_enabled else 'ws'}://"
                  f"{url_host}:{port}/ws", port=port, environment_id=environment_id)
        stopped = loop.create_task(stop.wait())
        await asyncio.wait({server, stopped}, return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down")
        for task in preparing:
            task.cancel()  # an install in progress is killed; its partial directory is removed
        stopped.cancel()
        await _shut_down(orch=orch, clients=clients, server=server, http_stop=http_stop,
                         sock=sock, grace_s=hconfig.graceful_timeout)
        for adapter in adapters.values():
            adapter.close()  # the provider traffic logs' last buffered lines
    with contextlib.suppress(OSError):  # hypercorn usually closed it already
        sock.close()
    log.info("stopped")
    return 0


def _announce(server_json: Path, *, url: str, ws_url: str, port: int, environment_id: str) -> None:
    """server.json (how the commands for people find the server), then the ready line."""
    _write_private_atomic(server_json, json.dumps({
        "pid": os.getpid(), "url": url, "mcpUrl": f"{url}/mcp", "wsUrl": ws_url, "port": port,
        "environmentId": environment_id,
        "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n",
        replace=True)
    print(f"t3 {VERSION} ready: MCP at {url}/mcp (client token in "
          f"{server_json.parent / 'client-token'})", file=sys.stderr, flush=True)


async def _shut_down(*, orch: Any, clients: ClientApi, server: asyncio.Task[Any],
                     http_stop: asyncio.Event, sock: _Listener, grace_s: float) -> None:
    """Stop taking work, end waits and /ws connections, stop HTTP, then the agents."""
    orch.begin_shutdown()  # waits return their current state before HTTP closes
    await asyncio.gather(*(c.close() for c in list(clients.connections)))
    http_stop.set()
    await asyncio.wait({server}, timeout=grace_s + 1.0)
    if not server.done():
        # Hypercorn waits, without end, to flush what a client that reads nothing was sent;
        # cutting the connections ends that wait.
        sock.abort_connections()
    with contextlib.suppress(Exception):
        await server
    await orch.close()


async def _start_domain(config: Config, data_dir: Path, store: Any, environment_id: str,
                        credentials: Credentials, *, prov: Any, base_url: str,
                        clock: TestClock | None) -> tuple[Any, dict[str, Any], Any]:
    """Adapters, the orchestrator (recovered and started) and the toolkit over it; git work
    (workspace.py) is handed to the orchestrator as the adapters are."""
    orphans = prov.kill_orphans(str(data_dir))
    if orphans:
        log.warning("killed %d provider process(es) left by a previous server", orphans)
    from orchestrator import Orchestrator
    from tools import Project, ServerContext, Toolkit
    from workspace import Workspaces  # made under the data-dir lock: it clears stray indexes
    adapters = build_adapters(config, data_dir, prov)
    _report_providers(adapters, detected=config.providers is None, detectable=prov.DETECTABLE)
    orch = Orchestrator(store, adapters=adapters, providers=_LiveProviderInfo(adapters),
                            credentials=credentials, workspaces=Workspaces(data_dir),
                            max_live_agent_processes=config.max_live_agent_processes,
                            max_delegation_depth=config.max_delegation_depth,
                            redact=prov.redact,
                            **({"clock": clock.iso, "wall": clock.now} if clock else {}))
    await store.sync_projects(config.projects)
    recovered = await orch.recover(
        reason="The t3 server restarted while this run was active; its provider process is gone.")
    if recovered:
        log.warning("interrupted the runs left active by the previous server in %d thread(s)",
                    len(recovered))
    orch.start()
    context = ServerContext(environment_id=environment_id, projects=[
        Project(p["id"], p["path"], p["title"], tuple(p.get("setup", ())))
        for p in config.projects], data_dir=data_dir,
        max_delegation_depth=config.max_delegation_depth, base_url=base_url,
        max_scheduled_tasks_per_project=config.max_scheduled_tasks_per_project,
        min_agent_task_interval_s=config.min_agent_task_interval_s)
    return orch, adapters, Toolkit(orch, store, context)


def _report_providers(adapters: Mapping[str, Any], *, detected: bool,
                      detectable: Sequence[str]) -> None:
    """One stderr line per provider instance: its driver, whether it can run, and why not. (An
    acpRegistry instance is still preparing here; it logs again once it is ready or failed.)"""
    how = "detected on PATH" if detected else "configured"
    for adapter in adapters.values():
        info = adapter.info
        state = "ready" if info.available else "unavailable: " + "; ".join(info.constraints)
        print(f"t3: provider {info.instance_id} ({info.driver}, {how}): {state}",
              file=sys.stderr)
    if any(adapter.info.available for adapter in adapters.values()):
        return
    if detected and not adapters:
        hint = (f"no agent CLI on PATH ({', '.join(detectable)}) and no [[providers]] in the "
                "configuration; install one, or configure one (README: Configuration)")
    elif any(hasattr(adapter, "prepare") for adapter in adapters.values()):
        hint = "wait for the instances being prepared, or fix the reasons above"
    else:
        hint = "fix the reasons above in the configuration's [[providers]]"
    print(f"t3: no provider instance can run yet: {hint}. Until one can, new threads and "
          "tasks are refused (provider_unavailable).", file=sys.stderr)


def _hypercorn_config(config: Config, hypercorn: Any) -> Any:
    """Hypercorn's settings, or None (said on stderr) when the TLS files cannot be used."""
    hconfig = hypercorn.config.Config()
    hconfig.graceful_timeout = 3.0
    hconfig.websocket_max_message_size = MAX_BODY_BYTES  # a /ws frame: one request
    hconfig.accesslog = None  # never: a browser's /ws URL carries ?token=
    hconfig.errorlog = logging.getLogger("hypercorn.error")
    hconfig.certfile, hconfig.keyfile = config.certfile, config.keyfile
    try:
        hconfig.create_ssl_context()  # fail now, not at the first connection
    except (OSError, ssl.SSLError) as exc:
        print(f"t3: cannot use [server] certfile/keyfile: {exc}", file=sys.stderr)
        return None
    return hconfig


def _raise_fd_limit(max_connections: int) -> None:
    """Each connection is a file descriptor: make room for ``max_connections`` of them besides
    the database, logs and agent pipes (the soft limit is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * max_connections + 1024
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        new = soft
    if new < wanted:
        log.warning("open files are limited to %d: [server] max_connections = %d may not fit",
                    new, max_connections)


def _listen(host: str, port: int, *, cap: int, tls: bool) -> _Listener:
    sock = _Listener(socket.AF_INET6 if ":" in host else socket.AF_INET, cap=cap,
                     refusal=b"" if tls else _Listener.BUSY)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    if not _is_loopback(host) and not tls:
        log.warning("listening on %s, beyond this machine: bearer tokens travel in clear text "
                    "unless [server] certfile and keyfile are set", host)
    return sock


class _Listener(socket.socket):
    """The listening socket, counting its open connections: beyond ``cap`` a new one is answered
    503 (nothing over TLS) and closed. Hypercorn has no connection limit, and asyncio's server
    calls this ``accept()``: every connection comes and goes here. Each is handed over with
    TCP_NODELAY: asyncio sets it only on sockets whose proto says TCP, which an accepted plain
    socket's does not, and without it a response's body waits behind its headers for the
    client's delayed ACK (40 ms on Linux)."""

    _BODY = json.dumps({"error": "too_many_connections", "message": "t3 has as many "
                        "connections open as [server] max_connections allows"}).encode()
    BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BODY), _BODY))

    def __init__(self, family: int, *, cap: int, refusal: bytes) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.cap, self.refusal, self._full = cap, refusal, False
        self.open: set[_Connection] = set()

    def accept(self) -> tuple[socket.socket, Any]:
        while True:  # until the backlog is empty: then _accept raises BlockingIOError
            fd, address = self._accept()  # type: ignore[attr-defined]
            conn = _Connection(self.family, self.type, self.proto, fileno=fd)
            if len(self.open) < self.cap:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.open.add(conn)
                conn.listener = self
                return conn, address
            if not self._full:  # once per time the cap is reached, not once per connection
                log.warning("%d connections open ([server] max_connections): new ones are "
                            "answered 503 until some close", len(self.open))
                self._full = True
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # closing with unread data would reset: the 503 could be lost
            with contextlib.suppress(OSError):
                conn.send(self.refusal)
            conn.close()

    def release(self, conn: _Connection) -> None:
        self.open.discard(conn)
        self._full = self._full and len(self.open) >= self.cap

    def abort_connections(self) -> None:
        """Cut every open connection (shutdown): what is unsent is dropped."""
        for conn in list(self.open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Connection(socket.socket):
    """An accepted connection that tells its listener, once, that it closed."""

    listener: _Listener | None = None

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.release(self)
        super().close()


class TestClock:
    """The server's clock when tests move it (``T3_TEST_CLOCK`` epoch seconds, only with
    ``T3_TEST_HOOKS=1``): it stands still but for ``advance`` (/ws ``advanceTestClock``).
    Durations t3 measures (leases, grace periods) keep the real clock."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.advanced = 0.0

    @classmethod
    def from_environment(cls) -> TestClock | None:
        start = os.environ.get("T3_TEST_CLOCK")
        if os.environ.get("T3_TEST_HOOKS") != "1" or not start:
            return None
        log.warning("test hook: the clock starts at %s and moves when tests say", start)
        return cls(float(start))

    def now(self) -> float:
        return self.start + self.advanced

    def iso(self) -> str:
        from orchestrator import iso_time
        return iso_time(self.now())

    def advance(self, seconds: float) -> None:
        self.advanced += seconds


def build_adapters(config: Config, data_dir: Path, prov: Any) -> dict[str, Any]:
    """One adapter per configured provider instance (or per detected CLI when none are configured).
    Their processes are tagged with the data dir, so a later server can find its orphans."""
    configs = [prov.ProviderConfig(instance_id=p["id"], driver=p["driver"], command=p["command"],
                                   env=p["env"], models=p["models"], enabled=p["enabled"],
                                   display_name=p["displayName"], agent=p["agent"],
                                   registry=p["registry"], instructions=p["instructions"],
                                   allow_unverified=p["allowUnverified"])
               for p in config.providers] if config.providers is not None \
        else prov.detect_providers()
    return {c.instance_id: prov.build_adapter(c, log_dir=data_dir / "logs", owner=str(data_dir),
                                              agents_dir=data_dir / "agents")
            for c in configs}


class _LiveProviderInfo(Mapping[str, Any]):
    """Each adapter's ``info`` as it is now, for the orchestrator and tools: an instance still
    being prepared (acpRegistry) becomes available, or fails with a reason, after startup."""

    def __init__(self, adapters: Mapping[str, Any]) -> None:
        self._adapters = adapters

    def __getitem__(self, instance_id: str) -> Any:
        return self._adapters[instance_id].info

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)


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
        self.url = urllib.parse.urlsplit(url)
        self.token = token
        self._ids = iter(range(1, 1 << 62))
        self._waiting: dict[int, asyncio.Queue[dict[str, Any] | None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> WsClient:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import Request
        tls = ssl.create_default_context() if self.url.scheme in ("wss", "https") else None
        reader, self._writer = await asyncio.open_connection(
            self.url.hostname, self.url.port or (443 if tls else 80), ssl=tls)
        self._ws = WSConnection(ConnectionType.CLIENT)
        target = f"{self.url.path or '/ws'}?orchestrationProtocol={PROTOCOL_VERSION}"
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
        from wsproto.events import AcceptConnection, RejectConnection, RejectData
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
        from wsproto.events import CloseConnection, Ping, TextMessage
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
                            queue = self._waiting.get(frame.get("id"))
                            if queue is not None:
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
        from wsproto.events import TextMessage
        self._send(TextMessage(data=json.dumps({"id": request_id, "method": method,
                                                "params": dict(params)})))

    async def request(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        request_id, queue = self._open(method, params or {})
        try:
            return _outcome(await queue.get())
        finally:
            del self._waiting[request_id]

    async def stream(self, method: str, params: Mapping[str, Any] | None = None
                     ) -> AsyncIterator[dict[str, Any]]:
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
# Commands for people (SPEC 1.1): each finds the server through <data-dir>/server.json, talks to
# it only through /ws (WsClient, with the client token) and prints for people, or one JSON
# document with --json. Its exit code (CLI_EXIT_CODES) is stable: scripts may rely on it.


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
    from orchestrator import CONTROL_CHARACTERS
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
        if getattr(args, "follow", False):  # Ctrl-C is how a follow ends
            return 0
        return 130


async def _connected(args: argparse.Namespace) -> int:
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
            return await _COMMANDS[args.command](client, args)
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
        return path, server, _read_token(path / "client-token")
    except DataDirError as exc:
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


def _out(args: argparse.Namespace, document: Any, text: str) -> int:
    """With --json the document (one line), else the text for people; 0, success."""
    print(json.dumps(document, ensure_ascii=False) if args.json else inert(text), flush=True)
    return 0


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


# -- the commands ----------------------------------------------------------------------------


async def _cmd_threads(client: WsClient, args: argparse.Namespace) -> int:
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


def _pr_words(pr: Mapping[str, Any]) -> str:
    """A linked pull request for people: the host its link goes to, then owner/repo#N."""
    return f"{urllib.parse.urlsplit(pr['url']).hostname}/{pr['repository']}#{pr['number']}"


def _strategy_arg(args: argparse.Namespace) -> dict[str, Any] | None:
    """``new``'s workspace options as a workspaceStrategy (None: the project root)."""
    if args.worktree and args.existing_worktree:
        raise SystemExit("t3: --worktree and --existing-worktree exclude each other")
    if (args.branch or args.from_origin) and not (args.worktree or args.existing_worktree):
        raise SystemExit("t3: --branch and --from-origin go with --worktree")
    if args.worktree:
        return _given(type="worktree", baseRef=args.worktree, branch=args.branch,
                      startFromOrigin=args.from_origin or None)
    if args.existing_worktree:
        return _given(type="existing_worktree", branch=args.branch,
                      worktreePath=str(Path(args.existing_worktree).resolve()))
    return None


async def _cmd_new(client: WsClient, args: argparse.Namespace) -> int:
    selection = _given(instanceId=args.provider, model=args.model)
    launched = await client.request("launchThread", {
        "commandId": uuid.uuid4().hex[:12], "creationSource": "cli", **_given(
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


async def _cmd_send(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    target = _given(providerInstanceId=args.provider, model=args.model)
    sent = await client.request("sendToThread", {
        "threadId": thread_id, "message": _text_arg(args.text), "mode": args.mode,
        "creationSource": "cli", **_given(target=target or None)})
    return _out(args, sent, f"{sent.get('delivery') or 'sent'}: {sent['runId']} ({sent['status']})")


async def _cmd_wait(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    async with _spinner(args, f"waiting for {thread_id}"):
        result = await _wait_for(client, thread_id, run_id=args.run, timeout_s=args.timeout)
    code, text = _wait_outcome(result)
    _out(args, result, text)
    return code


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


async def _cmd_interrupt(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    result = await client.request("interruptThread", {"threadId": thread_id, **_given(
        runId=args.run, reason=args.reason)})
    return _out(args, result, {
        "no_active_run": f"nothing to interrupt: {thread_id} has no active run",
        "interrupt_requested": f"interrupt requested: {result['runId']}"}.get(
        result["status"], f"already {result['status']}: {result['runId']}"))


async def _cmd_stop(client: WsClient, args: argparse.Namespace) -> int:
    """stop (thread.stop) and resume (thread.resume), over dispatchCommand."""
    thread_id = await _thread_ref(client, args.thread)
    result = (await client.request("dispatchCommand", {
        "type": f"thread.{args.command}", "commandId": uuid.uuid4().hex,
        "creationSource": "cli", "threadId": thread_id, **_given(
            reason=getattr(args, "reason", None))}))["result"]
    if args.command == "resume":
        text = f"resumed {thread_id}: {len(result['releasedRunIds'])} queued run(s) released"
    else:
        text = (f"stopped {thread_id}: {len(result['interruptedRunIds'])} run(s) interrupted, "
                f"{len(result['heldRunIds'])} queued run(s) held (`resume` releases them)")
    return _out(args, result, text)


async def _cmd_requests(client: WsClient, args: argparse.Namespace) -> int:
    params = {"threadId": await _thread_ref(client, args.thread)} if args.thread else {}
    listed = await client.request("listPendingRequests", params)
    rows = [f"{r['requestId']}  {r['kind']}: {r['title']}\n    thread {r['threadId']}; answer "
            + ("TEXT, decline or cancel" if r["kind"] == "user_input"
               else "accept, acceptForSession, decline or cancel") for r in listed["requests"]]
    return _out(args, listed, "\n".join(rows) or "no pending requests")


async def _cmd_answer(client: WsClient, args: argparse.Namespace) -> int:
    pending = (await client.request("listPendingRequests"))["requests"]
    request = _pick(pending, args.request, key="requestId", what="pending request")
    if request is None:
        raise CliError(f"request_not_found: no pending request matches {args.request!r} "
                       "(`python t3.py requests` lists them)")
    result = await client.request("dispatchCommand", {
        "type": "runtime-request.respond", "commandId": uuid.uuid4().hex,
        "creationSource": "cli", "threadId": request["threadId"],
        "requestId": request["requestId"], **await _response(client, request, args.answer)})
    return _out(args, result, f"answered {request['requestId']}: "
                              f"{result['result'].get('status', 'resolved')}")


async def _response(client: WsClient, request: Mapping[str, Any], texts: Sequence[str]
                    ) -> dict[str, Any]:
    """``decision`` for a decision word (a question takes only decline and cancel), else
    ``answers``: a JSON object as given, or one TEXT per question of the request, in order
    (for a multi-select question, labels separated by commas)."""
    from orchestrator import DECISIONS
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
    got = await client.request("getThreadProjection", {"threadId": request["threadId"]})
    entity = next((r for r in got["projection"]["runtimeRequests"]
                   if r["id"] == request["requestId"]), {})
    questions = (entity.get("detail") or {}).get("questions") or []
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


async def _cmd_tasks(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    tree = await _task_tree(client, thread_id, {thread_id})
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


async def _cmd_show(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    view = _Timeline(json_lines=args.json)
    if not (args.follow or args.until_done):
        got = await client.request("getThreadProjection", {"threadId": thread_id})
        view.load(got["projection"])
        if args.json:
            _out(args, view.document(), "")
        else:
            view.print_all()
            view.end_line()
        return 0
    try:
        return await _follow(client, thread_id, view, until_done=args.until_done)
    finally:  # Ctrl-C, or the server gone
        view.end_line()


async def _follow(client: WsClient, thread_id: str, view: _Timeline, *, until_done: bool) -> int:
    params: dict[str, Any] = {"threadId": thread_id}
    while True:  # again from the last sequence seen when the stream fell behind
        try:
            async with contextlib.aclosing(client.stream("subscribeThread", params)) as stream:
                async for item in stream:
                    if item["kind"] == "snapshot":
                        view.load(item["projection"])
                        view.print_all()
                        continue
                    if item["kind"] == "event":
                        view.apply(item["event"])
                    params["afterSequence"] = item["sequence"]
                    if until_done and (code := view.finished()) is not None:
                        view.close()
                        return code
        except WsError as exc:
            if exc.code != "resubscribe":
                raise


class _Timeline:
    """A thread's timeline for people, in position order, a line where the run changes; followed,
    a growing message prints only its new text. With ``json_lines``: each new or changed item or
    run is one JSON line instead (``{"kind": "thread" | "run" | "item", ...}``)."""

    def __init__(self, *, json_lines: bool) -> None:
        self.json_lines = json_lines
        self.thread: dict[str, Any] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.items: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, dict[str, Any]] = {}
        self._item_of: dict[str, str] = {}  # message id -> its item's id
        self._shown: dict[str, Any] = {}  # item id -> what of it was printed
        self._open: str | None = None  # the item whose message is printing, its line open
        self._run: str | None = None  # the run of the item printed last
        self._ended: set[str] = set()  # the runs whose end line was printed

    def load(self, projection: Mapping[str, Any]) -> None:
        self.thread = projection["thread"] or {}
        for kind, key in (("run", "runs"), ("message", "messages"), ("turn-item", "turnItems")):
            for entity in projection[key]:
                self._put(kind, entity)

    def _put(self, kind: str, entity: dict[str, Any]) -> None:
        {"run": self.runs, "message": self.messages, "turn-item": self.items}[kind][
            entity["id"]] = entity
        if kind == "turn-item" and entity.get("messageId"):
            self._item_of[entity["messageId"]] = entity["id"]

    def document(self) -> dict[str, Any]:
        return {"thread": self.thread, "runs": sorted(self.runs.values(), key=lambda r: r[
            "ordinal"]), "items": [self._shape(i) for i in self._ordered()]}

    def print_all(self) -> None:
        if self.json_lines:
            self._line({"kind": "thread", **self.thread})
            for run in sorted(self.runs.values(), key=lambda r: r["ordinal"]):
                self._line({"kind": "run", **run})
        else:
            t, latest = self.thread, self._latest()
            self._say(f"{t.get('title')}  {t.get('id')}\n"
                      f"{latest['status'] if latest else 'idle'} | {t.get('providerInstanceId')}"
                      f"/{(t.get('modelSelection') or {}).get('model')} | {t.get('runtimeMode')}"
                      + (f" | PR {_pr_words(pr)} {pr['url']}"
                         if (pr := t.get("linkedPullRequest")) else ""))
        for item in self._ordered():
            self._show(item)
        sys.stdout.flush()  # followed, a message still streaming keeps its line open

    def apply(self, event: Mapping[str, Any]) -> None:
        kind, payload = event["type"].rsplit(".", 1)[0], event["payload"]  # thread.archived...
        if kind == "thread":
            self.thread = payload
        elif kind == "run":
            before = self.runs.get(payload["id"])
            self._put(kind, payload)
            if before is None or before["status"] != payload["status"]:
                self._run_changed(payload)
        elif kind in ("message", "turn-item", "message-text"):
            if kind == "message-text":  # an open message's new text (store.TEXT_APPENDED)
                before = self.messages.get(payload["id"], {})
                kind, payload = "message", {**before, **payload,
                                            "text": before.get("text", "") + payload["text"]}
            self._put(kind, payload)
            item_id = payload["id"] if kind == "turn-item" else self._item_of.get(payload["id"])
            if item_id in self.items:
                self._show(self.items[item_id])
        sys.stdout.flush()

    def close(self) -> None:
        """A follow ends: a run that ended before the follow began gets its end line too."""
        latest = self._latest()
        if not self.json_lines and latest and latest["id"] not in self._ended:
            self._run_changed(latest)

    def finished(self) -> int | None:
        """None while the latest run goes on; else the exit code `wait` would give."""
        from orchestrator import RUN_TERMINAL
        latest = self._latest()
        if latest is None or latest["status"] == "completed":
            return 0
        return EXIT_NOT_COMPLETED if latest["status"] in RUN_TERMINAL else None

    def _latest(self) -> dict[str, Any] | None:
        return max(self.runs.values(), key=lambda r: r["ordinal"], default=None)

    def _ordered(self) -> list[dict[str, Any]]:
        return sorted(self.items.values(), key=lambda i: i["position"])

    def _text(self, item: Mapping[str, Any]) -> str:
        if item.get("messageId"):
            return str((self.messages.get(item["messageId"]) or {}).get("text") or "")
        return str(item.get("text") or "")

    def _shape(self, item: Mapping[str, Any]) -> dict[str, Any]:
        message = self.messages.get(item.get("messageId") or "") or {}
        return {"position": item["position"], "itemId": item["id"], "runId": item["runId"],
                "type": item["type"], "status": item["status"], "title": item.get("title"),
                "text": self._text(item), "role": message.get("role"),
                "data": item.get("data")}

    def _show(self, item: Mapping[str, Any]) -> None:
        text = self._text(item)
        now = (item["status"], item.get("title"), text)
        before = self._shown.get(item["id"])
        if before == now:
            return
        self._shown[item["id"]] = now
        if self.json_lines:
            self._line({"kind": "item", **self._shape(item)})
            return
        if item.get("messageId") and before is not None and text.startswith(before[2]):
            if text != before[2]:  # the message grew: only its new text
                if self._open != item["id"]:
                    self.end_line()
                    self._open = item["id"]
                self._say(text[len(before[2]):], end="")
            return
        self.end_line()
        if item["runId"] != self._run and item["runId"] in self.runs:
            self._run = item["runId"]
            run = self.runs[item["runId"]]
            self._say(f"--- run {run['ordinal']} ({run['status']}) on "
                      f"{run['providerInstanceId']}")
        if item["type"] in ("assistant_message", "reasoning"):
            self._say(_rendered(item, text), end="")  # the line stays open: more may stream
            self._open = item["id"]
        else:
            self._say(_rendered(item, text))

    def _run_changed(self, run: Mapping[str, Any]) -> None:
        from orchestrator import RUN_TERMINAL
        if self.json_lines:
            self._line({"kind": "run", **run})
        elif run["status"] in RUN_TERMINAL:
            self._ended.add(run["id"])
            self.end_line()
            reason = f": {run['statusReason']}" if run.get("statusReason") else ""
            self._say(f"--- run {run['ordinal']} {run['status']}{reason}")

    def end_line(self) -> None:
        if self._open is not None:
            print()
            self._open = None

    @staticmethod
    def _line(document: Mapping[str, Any]) -> None:
        print(json.dumps(document, ensure_ascii=False), flush=True)

    @staticmethod
    def _say(text: str, end: str = "\n") -> None:
        sys.stdout.write(inert(text) + end)


_LABELS = {"tool_call": "tool", "approval_request": "approval", "user_input_request": "question",
           "todo_list": "plan", "subagent": "task", "run_interrupt_request": "interrupt",
           "workspace_setup": "workspace"}


def _rendered(item: Mapping[str, Any], text: str) -> str:
    """One timeline item for people (a message's text, or a labelled line with its details)."""
    kind, data = item["type"], item.get("data") or {}
    if kind == "user_message":
        return "> " + text.replace("\n", "\n> ")
    if kind == "assistant_message":
        return text
    if kind == "reasoning":
        return "(thinking) " + text
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


async def _cmd_schedules(client: WsClient, args: argparse.Namespace) -> int:
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


async def _cmd_schedule(client: WsClient, args: argparse.Namespace) -> int:
    params = _schedule_params(args)
    if args.id is not None:
        params["scheduledTaskId"] = await _schedule_ref(client, args.id)
    made = await client.request("scheduleTask", {
        "clientRequestId": uuid.uuid4().hex[:12], **params, "creationSource": "cli"})
    hook = made.get("hookUrl")  # minted now, and never shown again
    return _out(args, made, made["scheduledTaskId"] + (
        f"\nwebhook URL (shown only now; it is the task's secret): {hook}" if hook else ""))


async def _cmd_unschedule(client: WsClient, args: argparse.Namespace) -> int:
    deleted = await client.request("deleteScheduledTask", {
        "scheduledTaskId": await _schedule_ref(client, args.id), "creationSource": "cli"})
    return _out(args, deleted, f"deleted {deleted['scheduledTaskId']}")


async def _schedule_ref(client: WsClient, text: str) -> str:
    found = _pick((await client.request("listScheduledTasks"))["tasks"], text,
                  key="scheduledTaskId", what="scheduled task")
    return str(found["scheduledTaskId"]) if found else text


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


_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]  # as schedules count: 0 = Sunday


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


def _every_ms(text: str) -> int:
    """--every: 90s, 15m (a bare number is minutes), 2h, 1d."""
    match = re.fullmatch(r"(\d+)\s*(s|m|min|h|d)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 15m, 90s, 2h or 1d")
    return int(match[1]) * {"s": 1000, "h": 3_600_000, "d": 86_400_000}.get(
        match[2] or "m", 60_000)


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


def _local_time(iso: str | None) -> str:
    """A time t3 wrote, in this machine's time zone, to the minute; "-" for none."""
    from orchestrator import epoch_of
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch_of(iso))) if iso else "-"


# =============================================================================================
# Commands for people: a thread's title, pull request link and place (rename, link-pr,
# unlink-pr, archive, unarchive, delete, snooze, unsnooze, visit), over the metadata tools' /ws
# methods and the thread.* client commands.


async def _cmd_rename(client: WsClient, args: argparse.Namespace) -> int:
    if (args.title is None) != args.regenerate:
        raise CliError("give TITLE or --regenerate (not both)", exit=EXIT_USAGE)
    updated = await client.request("updateThread", {
        "threadId": await _thread_ref(client, args.thread), **({"action": "regenerate_title"}
        if args.regenerate else {"action": "rename", "title": args.title})})
    regenerating = " (a new title is being generated)" if updated["titleRegeneration"] else ""
    return _out(args, updated, f"{updated['threadId']}: {updated['title']}{regenerating}")


async def _cmd_link_pr(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    updated = await client.request(*(("linkPullRequest", {"threadId": thread_id, "url": args.url})
                                     if args.command == "link-pr" else
                                     ("unlinkPullRequest", {"threadId": thread_id})))
    pr = updated["linkedPullRequest"]
    return _out(args, updated, f"{thread_id}: " + (
        f"{_pr_words(pr)} {pr['url']}" if pr else "no pull request linked"))


async def _cmd_lifecycle(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    when = getattr(args, "until", None)
    if when is not None and re.fullmatch(r"\d+\s*(s|m|min|h|d)?", when.strip().lower()):
        when = str(time.time() + _every_ms(when) / 1000)  # a duration from now
    done = await client.request("dispatchCommand", {
        "type": f"thread.{args.command}", "commandId": uuid.uuid4().hex[:12],
        "threadId": thread_id, "creationSource": "cli", **_given(snoozedUntil=when)})
    until = done["result"].get("snoozedUntil")
    return _out(args, done["result"], f"{args.command.removesuffix('e')}ed {thread_id}" + (
        f" until {_local_time(until)}" if until and args.command == "snooze" else ""))


def _thread_parsers(command: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    rename = command("rename THREAD", "rename a thread, or have its agent title it",
                     "Give a thread TITLE, or with --regenerate let its provider suggest a "
                     "title from the first message (else one is made from that message).")
    rename.add_argument("title", metavar="TITLE", nargs="?")
    rename.add_argument("--regenerate", action="store_true")
    command("link-pr THREAD URL", "link a pull request to a thread",
            "Link the pull request at URL (https://host/owner/repo/pull/N) to a thread.")
    for name, summary in (
            ("unlink-pr", "remove a thread's pull request link"),
            ("archive", "archive a thread: it leaves the list (threads --archived shows it); "
                        "its queued runs are cancelled"),
            ("unarchive", "bring an archived thread back to the list"),
            ("delete", "delete a thread for good: never listed or read again"),
            ("unsnooze", "wake a snoozed thread"), ("visit", "mark a thread as seen now")):
        command(f"{name} THREAD", summary, summary[0].upper() + summary[1:] + ".")
    command("snooze THREAD UNTIL", "snooze a thread until a time", (
        "Snooze a thread until UNTIL: a duration from now (30m, 2h, 1d) or an ISO time. It "
        "wakes early only for a pending request or a failed run."))


_THREAD_COMMANDS: dict[str, Callable[[WsClient, argparse.Namespace], Awaitable[int]]] = {
    "rename": _cmd_rename, "link-pr": _cmd_link_pr, "unlink-pr": _cmd_link_pr,
    **{name: _cmd_lifecycle for name in ("archive", "unarchive", "delete", "snooze",
                                         "unsnooze", "visit")}}


async def _cmd_switch(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    done = (await client.request("dispatchCommand", {
        "type": "provider.switch", "commandId": uuid.uuid4().hex[:12], "threadId": thread_id,
        "creationSource": "cli", "modelSelection": _given(instanceId=args.provider,
                                                          model=args.model)}))["result"]
    return _out(args, done, f"switched {thread_id} to {done['providerInstanceId']}"
                + (f" ({done['model']})" if done.get("model") else "")
                + f"; runtime mode {done['runtimeMode']}")


async def _cmd_rollback(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    done = await client.request("rollbackThread", {"threadId": thread_id, "runOrdinal": args.run,
                                                   "creationSource": "cli"})
    undone = len(done["rolledBackRunIds"])
    _out(args, done, f"rolled {thread_id} back to run {done['ordinal']} ({undone} later run(s) "
         f"rolled back)" if done["status"] == "completed" else
         f"rollback of {thread_id} {done['status']}: {done['reason'] or 'still restoring'}")
    return 0 if done["status"] == "completed" else EXIT_FAILED


# =============================================================================================
# Commands for people: fork a thread and merge a fork back, over /ws forkThread and mergeBack.


async def _cmd_fork(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    point = {"type": "run", "ordinal": args.run} if args.run is not None else \
        {"type": "checkpoint", "checkpointId": args.checkpoint} if args.checkpoint else \
        {"type": "latest_stable"}
    done = await client.request("forkThread", _given(
        commandId=uuid.uuid4().hex[:12], sourceThreadId=thread_id, sourcePoint=point,
        title=args.title, creationSource="cli"))
    where = f" in worktree {done['worktreePath']} on {done['branch']}" \
        if done.get("worktreePath") and done["worktreePath"] == done.get("workspacePath") else ""
    return _out(args, done, f"forked {thread_id} at run {done['sourcePoint']['runOrdinal']} into "
                f"{done['threadId']}{where}")


async def _cmd_merge_back(client: WsClient, args: argparse.Namespace) -> int:
    fork_id = await _thread_ref(client, args.fork)
    done = await client.request("mergeBack", {
        "commandId": uuid.uuid4().hex[:12], "sourceThreadId": fork_id, "creationSource": "cli"})
    covered = done["coveredRunOrdinals"]
    return _out(args, done, f"merge-back of {fork_id} (runs {covered['from']}-{covered['to']}) "
                f"goes to {done['threadId']} with its next message")


# =============================================================================================
# Commands for people: what a thread's runs changed in its workspace (diff), over /ws
# getTurnDiff and getFullThreadDiff.


async def _cmd_diff(client: WsClient, args: argparse.Namespace) -> int:
    thread_id = await _thread_ref(client, args.thread)
    found = await client.request(*(("getTurnDiff", {"threadId": thread_id, "ordinal": args.run})
                                   if args.run is not None else ("getFullThreadDiff",
                                                     {"threadId": thread_id})))
    what = "the thread" if args.run is None else f"run {args.run}"
    if found["status"] != "ready":
        _out(args, found, f"no diff for {what}: {found['reason']}")
        return EXIT_FAILED
    lines = [f"{f['kind']:<9} +{f['additions']:<5} -{f['deletions']:<5} {f['path']}"
             for f in found["files"]] or [f"no changes in {what}"]
    return _out(args, found, "\n".join([*lines, "", found["diff"].rstrip("\n")] + (
        ["[diff truncated at 30,000 characters]"] if found["truncated"] else [])))


# =============================================================================================
# Command line


_COMMANDS: dict[str, Callable[[WsClient, argparse.Namespace], Awaitable[int]]] = {
    "threads": _cmd_threads, "show": _cmd_show, "new": _cmd_new, "send": _cmd_send,
    "wait": _cmd_wait, "interrupt": _cmd_interrupt, "stop": _cmd_stop, "resume": _cmd_stop,
    "requests": _cmd_requests, "switch": _cmd_switch, "rollback": _cmd_rollback,
    "answer": _cmd_answer, "tasks": _cmd_tasks, "schedules": _cmd_schedules,
    "schedule": _cmd_schedule, "unschedule": _cmd_unschedule, "diff": _cmd_diff,
    "fork": _cmd_fork, "merge-back": _cmd_merge_back,
    **_THREAD_COMMANDS}


def _parser(*, people: bool = True) -> argparse.ArgumentParser:
    """The command line; with ``people=False`` only ``serve`` and ``token`` (what
    ``_names_no_command_for_people`` says is enough)."""
    def options(parser: argparse.ArgumentParser, default: Any) -> None:
        # Subcommands repeat the options with SUPPRESS defaults so that
        # `t3.py --port 0 serve` and `t3.py serve --port 0` both work.
        parser.add_argument("--data-dir", default=default,
                            help="data directory (default: $T3_HOME, else ~/.t3)")
        parser.add_argument("--config", default=default,
                            help="configuration file (default: <data-dir>/t3.toml)")
        parser.add_argument("--host", default=default,
                            help="address to listen on (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=default,
                            help="port to listen on (default 3773; 0 picks a free port)")
    parser = argparse.ArgumentParser(
        prog="t3", description="t3: a local server that orchestrates coding agents over MCP. "
        "The commands after serve and token are for people: they talk to a running server "
        "over /ws.", epilog=CLI_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    options(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    options(sub.add_parser("serve", help="run the server (the default)",
                           description="Run the t3 server: MCP tools at /mcp, health at "
                                       "/healthz."), argparse.SUPPRESS)
    token = sub.add_parser("token", help="print the client token (creating it); --rotate "
                                         "replaces it",
                           description="Print the client token of the data directory, "
                                       "creating it if absent.")
    options(token, argparse.SUPPRESS)
    token.add_argument("--rotate", action="store_true",
                       help="write a new token and print it; a running server refuses the old "
                            "one from then on")
    if people:
        _cli_parsers(sub)
    return parser


def _names_no_command_for_people(argv: Sequence[str]) -> bool:
    """True when ``argv`` serves, prints the token or fails the same without the commands for
    people: then their ~30 parsers are not built (argparse looks up translations for each, a
    sizable part of a server's startup). When unsure it says False, and the full parser reads
    every command line."""
    words = [a for i, a in enumerate(argv)
             if not a.startswith("-") and not (i and argv[i - 1] in _SERVE_OPTIONS)]
    return not {"-h", "--help"} & set(argv) and (not words or words[0] in ("serve", "token"))


_SERVE_OPTIONS = ("--data-dir", "--config", "--host", "--port")


def _cli_parsers(sub: Any) -> None:
    """The commands for people, each with --data-dir and --json."""
    from orchestrator import InteractionMode, RunStatus, RuntimeMode

    def command(usage: str, summary: str, description: str) -> argparse.ArgumentParser:
        """The parser of ``usage``: a command's name, then its required positionals (THREAD)."""
        name, *positionals = usage.split()
        parser: argparse.ArgumentParser = sub.add_parser(
            name, help=summary, description=description, epilog=CLI_EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--data-dir", default=argparse.SUPPRESS,
                            help="the server's data directory (default: $T3_HOME, else ~/.t3)")
        parser.add_argument("--json", action="store_true",
                            help="print one JSON document (for scripts) instead of text")
        for metavar in positionals:
            parser.add_argument(metavar.lower(), metavar=metavar)
        return parser
    threads = command("threads", "list threads with their status",
                      "List a project's threads, newest activity first: the status of the "
                      "latest run, the id, the title.")
    threads.add_argument("--project", help="project id (default: the first configured)")
    threads.add_argument("--all", action="store_true", help="include delegated (task) threads")
    threads.add_argument("--status", action="append", choices=["idle", *RunStatus],
                         help="only threads whose latest run has this status (repeatable)")
    threads.add_argument("--title", help="only threads whose title contains this")
    threads.add_argument("--archived", action="store_true", help="only archived threads")
    threads.add_argument("--snoozed", action=argparse.BooleanOptionalAction,
                         help="only snoozed threads (--no-snoozed: only the others)")
    threads.add_argument("--limit", type=int, default=50, help="at most this many (1-100; 50)")
    show = command("show THREAD", "a thread's timeline, or follow it live",
                   "Print a thread's timeline: user and assistant messages, tool calls, "
                   "approvals, questions, tasks and errors, in order. With --json, one JSON "
                   "document {thread, runs, items}; followed, one JSON object per line.")
    show.add_argument("--follow", "-f", action="store_true",
                      help="keep printing what happens until Ctrl-C")
    show.add_argument("--until-done", action="store_true",
                      help="follow until the latest run ends (exit codes as for wait)")
    _new_parser(command("new", "start a thread", "Start a thread (and its first run, given "
                        "TEXT); print its id."), RuntimeMode, InteractionMode)
    send = command("send THREAD", "send a message to a thread",
                   "Send TEXT to a thread: auto starts an idle thread or steers its active "
                   "turn; queue runs it after; steer and restart need an active turn.")
    send.add_argument("text", metavar="TEXT")
    send.add_argument("--mode", choices=["auto", "queue", "steer", "restart"], default="auto")
    send.add_argument("--provider", help="switch the thread to this provider instance first")
    send.add_argument("--model", help="switch the thread to this model first")
    switch = command("switch THREAD", "send a thread's next runs to another provider or model",
                     "Switch a thread to provider instance ID (and model M): its next run goes "
                     "there, with a context handoff of the conversation that provider missed.")
    switch.add_argument("--provider", required=True, metavar="ID")
    switch.add_argument("--model", metavar="M")
    rollback = command("rollback THREAD",
                       "take a thread's workspace and conversation back to run N",
                       "Restore the files to run N's checkpoint (0: before the first run), mark "
                       "the later runs rolled_back; the next message continues from run N.")
    rollback.add_argument("--run", type=int, required=True, metavar="N")
    wait = command("wait THREAD", "wait for a thread's run to end",
                   "Wait until the thread's latest run (or --run) ends, or one of its requests "
                   "needs an answer; the exit code says which.")
    wait.add_argument("--run", help="this run instead of the latest")
    wait.add_argument("--timeout", type=float, metavar="SECONDS",
                      help="give up after this long (default: no limit); the run goes on")
    _control_parsers(command, RuntimeMode)
    _thread_parsers(command)
    diff = command("diff THREAD", "what a thread's runs changed in its workspace",
                   "Print the files a thread changed (kind, lines added and deleted) and the "
                   "unified diff, between its first and newest checkpoints, or of run N only "
                   "(--run). Outside a git repository there are no checkpoints (exit 1).")
    diff.add_argument("--run", type=int, metavar="N", help="only run N (its ordinal, from 1)")
    _fork_parsers(command)


def _fork_parsers(command: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    fork = command("fork THREAD", "a new thread that continues from a point of this one",
                   "Fork THREAD: a new thread with its conversation up to its latest completed "
                   "run (or run N, or checkpoint ID), natively where the provider can, else as "
                   "a context handoff; in git, in a new worktree at that point's checkpoint.")
    point = fork.add_mutually_exclusive_group()
    point.add_argument("--run", type=int, metavar="N", help="fork at run N (its ordinal)")
    point.add_argument("--checkpoint", metavar="ID", help="fork at this checkpoint")
    fork.add_argument("--title", metavar="T", help="the fork's title (default: Fork of ...)")
    command("merge-back FORK", "hand a fork's work back to the thread it was forked from",
            "Merge FORK back: its runs' conversation goes to the thread it was forked from, as a "
            "context handoff with that thread's next message.")


def _new_parser(new: argparse.ArgumentParser, RuntimeMode: Any,  # noqa: N803 - the enums
                InteractionMode: Any) -> None:
    new.add_argument("text", metavar="TEXT", nargs="?", help="the first message")
    new.add_argument("--provider", help="provider instance id (default: the first available)")
    new.add_argument("--model", help="model (default: the provider's first)")
    new.add_argument("--project", help="project id (default: the first configured)")
    new.add_argument("--scratch", action="store_true",
                     help="run in a fresh folder of its own instead of a project")
    new.add_argument("--worktree", metavar="BASE",
                     help="run in a new git worktree on a new branch from BASE (a ref)")
    new.add_argument("--existing-worktree", metavar="PATH",
                     help="run in this existing worktree of the project's repository")
    new.add_argument("--branch", help="the new worktree's branch (default t3/<hash>); with "
                                      "--existing-worktree, the branch it must be on")
    new.add_argument("--from-origin", action="store_true",
                     help="with --worktree: fetch origin and start from origin/BASE")
    new.add_argument("--title", help="title (default: from TEXT)")
    new.add_argument("--runtime-mode", choices=list(RuntimeMode),
                     help="what the agent may do without asking (default full-access)")
    new.add_argument("--interaction-mode", choices=list(InteractionMode))


def _control_parsers(command: Callable[[str, str, str], argparse.ArgumentParser],
                     RuntimeMode: Any) -> None:  # noqa: N803 - the enum, as in _cli_parsers
    """Commands that steer threads and answer them: interrupt, stop, resume, requests, answer,
    tasks, and the scheduled tasks'."""
    interrupt = command("interrupt THREAD", "interrupt a thread's active run",
                        "Interrupt the thread's newest active run (or --run).")
    interrupt.add_argument("--run", help="this run (it must be the newest active one)")
    interrupt.add_argument("--reason", help="recorded in the timeline")
    stop = command("stop THREAD", "stop a thread: interrupt its turn, hold its queue",
                   "Stop a thread: interrupt its running turn and hold its queued turns "
                   "until `resume` (held turns survive a server restart).")
    stop.add_argument("--reason", help="recorded in the timeline")
    command("resume THREAD", "release a stopped thread's held turns",
            "Release the turns a Stop held, in their queue order.")
    requests = command("requests", "list pending approvals and questions",
                       "List the pending requests (approvals and questions) of every thread, "
                       "or of THREAD.")
    requests.add_argument("thread", metavar="THREAD", nargs="?")
    answer = command("answer REQUEST", "answer a pending request",
                     "Answer a pending request. An approval: accept, acceptForSession, decline "
                     "or cancel. A question: decline, cancel, a JSON object of answers, or one "
                     "TEXT per question in order (a multi-select question takes labels "
                     "separated by commas).")
    answer.add_argument("answer", metavar="accept|decline|TEXT", nargs="+")
    command("tasks THREAD", "a thread's delegated tasks, as a tree",
            "Print the tasks the thread delegated, each with its status and child thread, and "
            "their own tasks below them.")
    schedules = command("schedules", "list scheduled tasks, with their next and last runs",
                        "List the scheduled tasks: id, title, schedule, enabled, next run, the "
                        "last run's status and time (its error below when it failed), the number "
                        "of runs; times in this machine's time zone.")
    schedules.add_argument("--all", action="store_true", help="include paused tasks")
    schedules.add_argument("--project", help="only this project's tasks")
    _schedule_parser(command("schedule", "create or change a scheduled task", (
        "Create a scheduled task: PROMPT runs on a schedule (--every, --at, or --webhook), each "
        "time in a fresh thread of the project; print its id, and a webhook task's URL (shown "
        "only then). With --id ID, change a task instead: only what is given changes.")),
        RuntimeMode)
    command("unschedule ID", "delete a scheduled task",
            "Delete a scheduled task for good (the threads of its past runs stay).")


def _schedule_parser(parser: argparse.ArgumentParser, runtime_modes: Any) -> None:
    add = parser.add_argument
    add("prompt", metavar="PROMPT", nargs="?", help="what each run is asked (`-`: standard input)")
    add("--id", metavar="ID", help="change this task instead of creating one")
    add("--prompt", dest="prompt_option", metavar="PROMPT", help="the new prompt (as PROMPT)")
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--every", type=_every_ms, metavar="DURATION",
                      help="run every 15m, 90s, 2h, 1d, ... (a bare number is minutes; at least "
                           "1 minute)")
    when.add_argument("--at", metavar="HH:MM", help="run daily at this time (the server's zone)")
    when.add_argument("--webhook", action="store_true",
                      help="run when the task's webhook URL is called (printed once)")
    add("--weekdays", type=_weekdays, metavar="DAYS",
        help="with --at, only on these days: mon-fri, sat,sun, 1,3,5 (0 = Sunday)")
    add("--secret-header", metavar="H", help="with --webhook: the header that carries the "
                                             "HMAC-SHA256 signature")
    add("--secret", metavar="S", help="with --webhook: the signing secret (`-`: standard input)")
    add("--prefix", metavar="P", help="with --webhook: the signature's prefix, e.g. sha256=")
    add("--standard-webhooks", action="store_true", help="with --webhook and --secret whsec_...: "
        "check Standard Webhooks signatures (webhook-id, webhook-timestamp, webhook-signature)")
    add("--title", help="title (default: from PROMPT)")
    add("--provider", help="provider instance id (default: the first available)")
    add("--project", help="project id (default: the first configured)")
    add("--runtime-mode", choices=list(runtime_modes),
        help="what each run's agent may do without asking")
    enabled = parser.add_mutually_exclusive_group()
    enabled.add_argument("--enable", dest="enabled", action="store_const", const=True,
                         help="resume a paused task (its next run is aimed from now)")
    enabled.add_argument("--disable", "--disabled", dest="enabled", action="store_const",
                         const=False, help="pause: no runs until --enable")
    add("--run-now", action="store_true", help="also run it once now")
    add("--rotate-hook-token", action="store_true",
        help="give a webhook task a new URL (printed once); the old one stops working")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(people=not _names_no_command_for_people(argv)).parse_args(argv)
    if args.command in _COMMANDS:
        return run_command(args)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mcp").setLevel(logging.WARNING)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    if args.command == "token":
        try:
            data_dir = open_data_dir(args.data_dir)
            print(rotate_client_token(data_dir) if args.rotate else client_token(data_dir))
        except DataDirError as exc:
            print(f"t3: {exc}", file=sys.stderr)
            return 2
        return 0
    return asyncio.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
