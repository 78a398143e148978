"""t3.py: the entry point of t3, a small auditable server that orchestrates coding agents.

``python t3.py [serve]`` runs one local server (hypercorn on 127.0.0.1): MCP tools at ``/mcp``,
the client API at ``/ws``, the web view (``ui.html``) at ``/``; ``python t3.py token
[--rotate]`` prints (or replaces) the client token; the other commands are for people
(``cli.py``, imported only for them) and talk to a running server only through ``/ws``. This
file owns configuration (``t3.toml``), the data directory (private: 0700 and 0600, no symlink
followed; its lock, the client token, ``server.json``), credentials and bearer auth, the ASGI
app and its routes (Host and Origin checked, auth before the body is read, bodies bounded in
size and time), the /ws protocol (parsing and shaping only: the rules are
``tools.Toolkit``'s, as for MCP), the capped listening socket, and startup/shutdown
order. It wires the layers and decides nothing: ``store.py`` <- ``orchestrator.py`` <-
``tools.py``, with the adapters (``providers.py``, built by ``drivers.py``) handed in here, and
it loads the feature modules the core never imports (``FEATURES``: schedules.py, history.py,
metadata.py, links.py) and workspace.py's preparation of a launch's worktree, which plug into
the core's tables.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import dataclasses
import fcntl
import gc
import hashlib
import hmac
import importlib
import ipaddress
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
from collections.abc import (Awaitable, Callable, Collection, Iterator, Mapping, MutableMapping,
                             Sequence)
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the layers' types, for annotations: t3.py imports the layers when it serves
    import hypercorn.config
    from orchestrator import McpEndpoint, Orchestrator, ProviderInfo
    from providers import Adapter
    from schedules import Scheduler
    from store import Store
    from tools import Emit, Scope, Toolkit

__all__ = ["VERSION", "main", "Config", "ConfigError", "load_config", "DataDirError",
           "open_data_dir", "ClientToken", "Credentials", "HttpPolicy", "Route", "WebView",
           "build_app"]

VERSION = "0.1.0"
log = logging.getLogger("t3")

_Receive = Callable[[], Awaitable[Any]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], _Receive, _Send], Awaitable[None]]

_ID = re.compile(r"^[a-zA-Z][a-zA-Z0-9_-]{0,63}$")
_ENV_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_BODY_BYTES = 4 * 1024 * 1024
# Feature modules an auditor of the core may skip: the core never imports them; each registers
# its entities, commands, effects and operations into the core's tables when imported here.
FEATURES = ("schedules", "history", "metadata", "links")


def load_features() -> None:
    """FEATURES, and workspace.py: a core layer (git) that also registers a launch's worktree
    preparation (its command and effect) into the core's tables."""
    for name in ("workspace", *FEATURES):
        importlib.import_module(name)


# =============================================================================================
# Configuration


class ConfigError(Exception):
    """The configuration file is invalid."""


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    projects: list[dict[str, Any]]  # id, path, title, setup (commands for a new worktree)
    providers: list[dict[str, Any]] | None  # None: detect installed CLIs
    host: str = "127.0.0.1"
    port: int = 3773
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
    store_url: str | None = None  # [store] url: PostgreSQL (store_pg.py); None: SQLite
    node_id: str | None = None  # [node] id, on PostgreSQL (cluster.py); None: the data dir's
    node_projects: list[str] | None = None  # [node] projects it runs; None: those found here
    environments: tuple[dict[str, Any], ...] = ()  # [[environments]]: linked t3s (links.py)


def _strings(value: Any, _: Path) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) and s for s in value)


def _count(value: Any, least: int, most: int | None = None) -> bool:
    """An integer (true and false are not) from ``least`` to ``most``."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value and (
        most is None or value <= most)


_Rule = tuple[Callable[[Any, Path], bool], str]
_FILE: _Rule = (lambda v, base: isinstance(v, str) and (base / v).is_file(),
                "must name an existing file (%r)")
# The keys of each section but [[providers]], and each one's rule: a test of its value (given
# the configuration file's folder) and the problem named when the test fails (%r: the value).
_RULES: dict[str, dict[str, _Rule]] = {
    "server": {"host": (lambda v, _: isinstance(v, str), "must be a string"),
               "port": (lambda v, _: _count(v, 0, 65535), "must be an integer 0-65535"),
               "allowed_origins": (_strings, "must be a list of non-empty strings"),
               "allowed_hosts": (_strings, "must be a list of non-empty strings"),
               "max_connections": (lambda v, _: _count(v, 1), "must be a positive integer"),
               "certfile": _FILE, "keyfile": _FILE},
    "projects": {"id": (lambda v, _: isinstance(v, str) and bool(_ID.match(v)),
                        "must match ^[a-zA-Z][a-zA-Z0-9_-]{0,63}$"),
                 "path": (lambda v, _: isinstance(v, str) and Path(v).is_dir(),
                          "must be an existing directory (%r)"),
                 "title": (lambda v, _: isinstance(v, str), "must be a string"),
                 "setup": (_strings, "must be a list of shell commands (strings)")},
    "limits": dict.fromkeys(("credential_max_lifetime_s", "credential_idle_s",
                             "max_delegation_depth", "max_live_agent_processes",
                             "max_scheduled_tasks_per_project", "min_agent_task_interval_s"),
                            (lambda v, _: _count(v, 1), "must be a positive integer")),
    "store": {"url": (lambda v, _: isinstance(v, str) and v.startswith(("postgresql://",
                                                                       "postgres://")),
                      "must be a postgresql:// URL")},
    "node": {"id": (lambda v, _: isinstance(v, str) and bool(re.fullmatch(r"[\w.-]{1,64}", v)),
                    "must be 1 to 64 letters, digits, '.', '_' or '-'"),
             "projects": (_strings, "must be a list of project ids")},
    "environments": {"id": (lambda v, _: isinstance(v, str) and bool(_ENV_ID.match(v)),
                            "must be the other t3's environmentId (its /healthz shows it)"),
                     "url": (lambda v, _: isinstance(v, str) and bool(re.match(
                         r"https?://[^/\s]+$", v)), "must be http(s)://host[:port], no path"),
                     "token_file": _FILE}}
_SECTIONS: dict[str, Collection[str]] = {
    **_RULES, "providers": {"id", "driver", "command", "env", "models", "enabled",
                            "displayName", "agent", "registry", "instructions",
                            "allow_unverified"}}


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

    def checked(section: str, index: int | None, entry: Mapping[str, Any], *required: str
                ) -> dict[str, Any]:  # entry, with no unknown key and every rule passed
        for key in entry:
            if key not in _RULES[section]:
                raise fail(section, index, key, "unknown key")
        for key, (test, problem) in _RULES[section].items():
            if (key in entry or key in required) and not test(entry.get(key), path.parent):
                raise fail(section, index, key, problem.replace("%r", repr(entry.get(key))))
        return dict(entry)

    for section, value in data.items():
        if section not in _SECTIONS:
            raise fail(section, None, None, "unknown section")
        many = section in ("projects", "providers", "environments")
        if not (isinstance(value, list) and all(isinstance(e, dict) for e in value) if many
                else isinstance(value, dict)):
            raise fail(section, None, None, f"must be {'tables [[' if many else 'a table ['}"
                       f"{section}{']]' if many else ']'}")
    providers: list[dict[str, Any]] | None = None
    if "providers" in data:
        providers = []
        for i, entry in enumerate(data["providers"]):
            providers.append(_provider_entry(i, entry, fail, base=path.parent))
            if any(p["id"] == providers[-1]["id"] for p in providers[:-1]):
                raise fail("providers", i, "id", f"duplicate provider id {providers[-1]['id']!r}")
    limits = checked("limits", None, data.get("limits", {}))
    if limits.get("min_agent_task_interval_s", 60) < 60:
        raise fail("limits", None, "min_agent_task_interval_s", "must be at least 60 (no task "
                   "runs more often than once a minute)")
    server = checked("server", None, data.get("server", {}))
    for key in ("certfile", "keyfile"):
        if key in server:
            server[key] = str((path.parent / server[key]).resolve())
    if ("certfile" in server) != ("keyfile" in server):
        raise fail("server", None, "certfile", "certfile and keyfile go together")
    server["allowed_origins"] = tuple(o.rstrip("/") for o in server.get("allowed_origins", ()))
    server["allowed_hosts"] = tuple(h.lower() for h in server.get("allowed_hosts", ()))
    projects: list[dict[str, Any]] = []
    for i, entry in enumerate(data.get("projects", [])):
        pid = checked("projects", i, entry, "id", "path")["id"]
        if any(p["id"] == pid for p in projects):
            raise fail("projects", i, "id", f"duplicate project id {pid!r}")
        if pid == "scratch":
            raise fail("projects", i, "id", "'scratch' is reserved for scratch workspaces")
        projects.append({"id": pid, "path": str(Path(entry["path"]).resolve()),
                         "title": entry.get("title", pid), "setup": entry.get("setup", [])})
    if not projects:
        projects.append({"id": "default", "path": str(cwd.resolve()), "title": cwd.name or "/"})
    return Config(**server, projects=projects, providers=providers, **limits,
                  store_url=checked("store", None, data.get("store", {})).get("url"),
                  **{f"node_{k}": v
                     for k, v in checked("node", None, data.get("node", {})).items()},
                  environments=_environments(data.get("environments", []), checked, fail,
                                             base=path.parent))


def _environments(entries: list[dict[str, Any]], checked: Callable[..., dict[str, Any]],
                  fail: _Fail, *, base: Path) -> tuple[dict[str, Any], ...]:
    """[[environments]]: each with its token file's absolute path (relative to the config)."""
    found: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        env = checked("environments", i, entry, "id", "url", "token_file")
        if any(e["id"] == env["id"] for e in found):
            raise fail("environments", i, "id", f"duplicate environment {env['id']!r}")
        found.append({**env, "token_file": str((base / env["token_file"]).resolve())})
    return tuple(found)


def _provider_entry(i: int, entry: Mapping[str, Any], fail: _Fail, *, base: Path) -> dict[str, Any]:
    from drivers import DRIVERS
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
    seen, inside = -1, False  # the section's entries so far; whether this line is in one
    top = True  # before any header: where ``section = ...`` would stand
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[\[?\s*([A-Za-z0-9_.-]+)\s*\]\]?", line)
        if header:
            inside, top = header.group(1) == section, False
            seen += 1 if inside else 0
        if inside and index in (None, seen) and (
                re.match(rf"\s*{re.escape(key)}\s*=", line) if key else header) or (
                top and key is None and re.match(rf"\s*{re.escape(section)}\s*=", line)):
            return number
    return None


# =============================================================================================
# Data directory: private to the user who runs t3


class DataDirError(Exception):
    """The data directory (or the configuration file) is not private to this user, or holds
    something t3 cannot use: t3 refuses to start."""


_OWN_FILES = ("t3.sqlite", "t3.sqlite-wal", "t3.sqlite-shm", "client-token", "server.json",
              "t3.lock")
_OWN_DIRS = ("logs", "backups", "scratch", "worktrees", "agents", "processes")
# Their files are t3's; the others hold workspaces.
_TIGHTENED_DIRS = ("logs", "backups", "agents", "processes")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{32,}")  # what secrets.token_urlsafe(32) makes (43 chars)


def open_data_dir(value: str | None) -> Path:
    """The data directory, created 0700 or checked and tightened to 0700; its own files and
    folders are checked (never a symlink) and tightened to 0600 / 0700."""
    path = Path(value or os.environ.get("T3_HOME") or Path.home() / ".t3").expanduser().resolve()
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


def check_config_file(path: Path) -> int:
    """Refuse a configuration file another user could have written: it names the commands t3
    runs. Root's own files are trusted (root can do anything anyway). Its mode, 0 if absent."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return 0
    if info.st_uid not in (os.geteuid(), 0):
        raise DataDirError(f"refusing the configuration {path}: it belongs to uid "
                           f"{info.st_uid}, not to this user (uid {os.geteuid()}), and it "
                           "names the commands t3 runs")
    if info.st_mode & 0o022:
        raise DataDirError(f"refusing the configuration {path}: other users may write to it "
                           f"(mode {info.st_mode & 0o777:o}), and it names the commands t3 "
                           f"runs; fix: chmod 600 {path}")
    return info.st_mode


def client_token(data_dir: Path, *, rotate: bool = False) -> str:
    """The client token, created on first use (0600, and whole: a reader racing the creation
    never sees an empty file); ``rotate`` replaces it atomically, and a running server refuses
    the old one from its next request on (``ClientToken``)."""
    path = data_dir / "client-token"
    if rotate or not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):  # another process made it first
            _write_private_atomic(path, secrets.token_urlsafe(32) + "\n", replace=rotate)
    return _read_token(path)


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


def _lock(data_dir: Path) -> int | None:
    """An exclusive lock on ``t3.lock`` (one server per data directory), which then holds our
    pid: its file descriptor, or None while another process holds it."""
    fd = os.open(data_dir / "t3.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


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
        self.max_lifetime_s, self.idle_s, self.mcp_url = max_lifetime_s, idle_s, mcp_url
        self._clock = clock
        self._live: dict[str, _SessionCredential] = {}  # token hash -> a credential not ended
        self._issued: dict[str, _SessionCredential] = {}  # provider session id -> its last one

    def issue(self, *, thread_id: str, provider_instance_id: str,
              provider_session_id: str) -> McpEndpoint:
        """A new credential for one provider session, as the MCP endpoint its agent is given.
        Only the token's hash is kept; the raw token lives in the returned endpoint alone."""
        from orchestrator import McpEndpoint
        from tools import Scope
        token = secrets.token_urlsafe(32)
        # The idempotency key names the caller (thread + instance), not this credential, so a
        # retry after a re-issue converges; hashed, so the ids derived from it stay short.
        key = "agent-" + _hash(f"{thread_id}\0{provider_instance_id}")[:32]
        self.revoke(provider_session_id)
        now = self._clock()
        credential = _SessionCredential(
            digest=_hash(token), issued=now, touched=now, scope=Scope(
                kind="thread", key=key, thread_id=thread_id,
                provider_instance_id=provider_instance_id,
                provider_session_id=provider_session_id,
                capabilities=frozenset({"orchestration", "preview"})))
        self._live[credential.digest] = self._issued[provider_session_id] = credential
        return McpEndpoint(name="t3-code", url=self.mcp_url,
                           headers={"Authorization": f"Bearer {token}"})

    def set_active(self, provider_session_id: str, active: bool) -> None:
        """The session serves a turn (``active``), or has just finished one."""
        if (credential := self._valid(self._issued.get(provider_session_id))) is not None:
            credential.active = active
            credential.touched = self._clock()

    def renewal_due(self, provider_session_id: str) -> bool:
        """True when the session was given a credential that has ended or is past half its
        maximum lifetime: its next turn should run in a session with a new one."""
        if provider_session_id not in self._issued:
            return False
        credential = self._valid(self._issued[provider_session_id])
        return credential is None or \
            self._clock() - credential.issued > self.max_lifetime_s / 2

    def revoke(self, provider_session_id: str) -> None:
        credential = self._issued.pop(provider_session_id, None)
        if credential is not None:
            self._live.pop(credential.digest, None)

    def resolve(self, token: str) -> Scope | None:
        credential = self._valid(self._live.get(_hash(token)))
        if credential is None:
            return None
        credential.touched = self._clock()
        return credential.scope

    def _valid(self, credential: _SessionCredential | None) -> _SessionCredential | None:
        """``credential`` unless it has ended; one that has just ended is dropped for good."""
        if credential is None or credential.digest not in self._live:
            return None
        now = self._clock()
        if now - credential.issued > self.max_lifetime_s or (
                not credential.active and now - credential.touched > self.idle_s):
            del self._live[credential.digest]
            return None
        return credential


@dataclasses.dataclass(slots=True)
class _SessionCredential:
    digest: str  # of the token
    issued: float
    touched: float
    scope: Scope
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
        # An empty token matches neither: no well-formed token or credential is empty.
        resolved = Scope(kind="client", key="client") if client_token.matches(token) \
            else credentials.resolve(token)
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
# The ASGI app: routes, and what every request passes before a route runs


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
        route = route_of(scope.get("path", ""))
        if scope["type"] == "websocket":
            await _websocket(scope, receive, send, route, policy)
            return
        path, method = _shown_path(scope.get("path", "")), scope.get("method", "GET")
        started = False

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            refusal = _refusal(scope, route, policy)
            if refusal is not None:
                # GET /mcp is how MCP clients ask for a server stream, once initialized; they
                # send their next POST on the same pooled connection, which must stay open.
                await _refuse(scope, tracked_send, *refusal,
                              keep=(method, path, refusal[0]) == ("GET", "/mcp", 405))
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


# A delivery refused after its body was read: the status for each of the scheduler's codes.
_HOOK_STATUS = {"hook_not_found": 404, "hook_disabled": 409, "invalid_signature": 401,
                "invalid_request": 400, "rate_limited": 429, "queue_full": 429}


def webhook_endpoint(scheduler: Scheduler) -> ASGIApp:
    """``POST/PUT/PATCH /hooks/{scheduledTaskId}/{hookToken}``, the HTTP part. Before
    the body is read: the token against the task's hash in constant time (wrong: the same 404 as
    an unknown hook), 409 paused, 413 over 1 MiB declared. Then the body whole (within
    ``BODY_TIMEOUT_S``), ``Scheduler.receive_webhook``, and 202 ``{deliveryId, outcome}``."""
    from orchestrator import T3Error
    from schedules import HOOK_BODY_MAX_BYTES, WebhookRequest

    async def hook(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        task_id, token = _hook_address(scope)
        presented = _hash(token)  # hashed for an unknown hook too: the same work either way
        task = await scheduler.webhook_task(task_id) if task_id else None
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
            result = await scheduler.receive_webhook(task_id, request)
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
                  message: str, headers: Sequence[tuple[bytes, bytes]] = (), *,
                  keep: bool = False) -> None:
    """An error answer sent without reading (all of) the body. An HTTP/1 connection then
    closes (``keep``: a bodiless request the protocol expects to be refused): what is left of
    the body must not be read as the next request. (HTTP/2 forbids the header; there the answer
    ends only its stream.)"""
    if not keep and str(scope.get("http_version", "1.1")).startswith("1"):
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
# unsubscribed or too far behind. A method is an operation of tools.OPERATIONS (the streams
# too), run for a person (the client token); this frames it.


PROTOCOL_VERSION = 2
_PROTOCOL_REFUSAL = {"code": "orchestration_protocol_incompatible",
                     "message": "Update this client to one that supports orchestration "
                                "protocol 2.", "orchestrationProtocolVersion": PROTOCOL_VERSION}


class ClientApi:
    """The /ws methods: each an operation of tools.OPERATIONS, run for a person holding the
    client token (commands are recorded ``createdBy: "user"`` with ``creationSource`` web, the
    default, or cli); a stream sends its items through ``emit`` and returns when it ends."""

    def __init__(self, *, toolkit: Toolkit) -> None:
        from tools import Scope
        self.toolkit = toolkit
        self.connections: set[_WsConnection] = set()
        self.scope = Scope(kind="client", key="client")

    async def call(self, method: str, params: Mapping[str, Any], emit: Emit) -> Any:
        """One method (``orchestration.`` prefix optional)."""
        from orchestrator import T3Error
        from tools import BY_WS_NAME, Call
        name = method.removeprefix("orchestration.")
        if name not in BY_WS_NAME:
            raise T3Error(f"unknown method {method!r}; the methods are "
                          f"{', '.join([*BY_WS_NAME, 'unsubscribe'])}", code="invalid_request")
        source = params.get("creationSource", "web")
        if source not in ("web", "cli"):
            raise T3Error("creationSource: must be web or cli", code="invalid_request")
        return await self.toolkit.run(BY_WS_NAME[name], Call(self.scope, source, emit=emit), {
            k: v for k, v in params.items() if k != "creationSource"})


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
        from orchestrator import T3Error, parse_json
        try:
            frame, unparsed = parse_json(text), ""
        except ValueError as exc:
            frame, unparsed = None, f" ({exc})"
        request_id = frame.get("id") if isinstance(frame, dict) else None
        failure = None
        if not isinstance(frame, dict) or not isinstance(frame.get("method"), str) or \
                not isinstance(frame.get("params", {}), dict) or \
                not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            failure = T3Error('a frame is {"id": string or integer, "method": string, '
                              f'"params": object}}{unparsed}', code="invalid_request")
        elif request_id in self._tasks:
            failure = T3Error(f"request id {request_id!r} is in use", code="invalid_request")
        elif len(self._tasks) >= self.MAX_IN_FLIGHT:
            failure = T3Error(f"at most {self.MAX_IN_FLIGHT} requests and streams at once on "
                              "one connection", code="too_many_requests")
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
    """Run the server until SIGINT or SIGTERM; the exit status (2: the data directory or the
    configuration is refused, 1: the server cannot start)."""
    import providers as prov
    import workspace
    from store import DatabaseTooNew, StoreError

    # What t3 (SQLite, logs, backups too) creates in its data directory is private; agents,
    # git and setup get the user's umask back (CHILD_UMASK): they write in the user's projects.
    prov.CHILD_UMASK = workspace.CHILD_UMASK = os.umask(0o077)
    with contextlib.ExitStack() as cleanup:  # undone in reverse order, whatever happens
        cleanup.callback(os.umask, prov.CHILD_UMASK)
        try:
            data_dir = open_data_dir(args.data_dir)
            config_path = Path(args.config).expanduser().resolve() if args.config \
                else data_dir / "t3.toml"
            config_mode = check_config_file(config_path)
            config = load_config(config_path, cwd=Path.cwd())
            client_token(data_dir)  # created, or refused when malformed, before anything starts
        except DataDirError as exc:
            print(f"t3: {exc}", file=sys.stderr)
            return 2
        except ConfigError as exc:
            print(f"t3: invalid configuration: {exc}", file=sys.stderr)
            return 2
        secrets_held = [what for what, held in (
            ("provider env values", any(p["env"] for p in config.providers or ())),  # API keys
            ("a database password", bool(config.store_url and _has_password(config.store_url))))
            if held]
        if config_mode & 0o044 and secrets_held:
            log.warning("%s holds %s and other users may read it (mode %o); fix: chmod 600 %s",
                        config_path, " and ".join(secrets_held), config_mode & 0o777, config_path)
        for env in config.environments:  # a linked t3's client token
            with contextlib.suppress(OSError):
                if (mode := os.stat(env["token_file"]).st_mode) & 0o044:
                    log.warning("%s holds environment %s's token and other users may read it "
                                "(mode %o); fix: chmod 600 %s", env["token_file"], env["id"],
                                mode & 0o777, env["token_file"])
        _raise_fd_limit(config.max_connections)
        _return_big_buffers()
        lock = _lock(data_dir)
        if lock is None:
            holder = "?"
            with contextlib.suppress(OSError):
                holder = (data_dir / "t3.lock").read_text().strip() or "?"
            print(f"t3: another t3 server (pid {holder}) is already using {data_dir}; "
                  "stop it first or pass another --data-dir", file=sys.stderr)
            return 1
        cleanup.callback(os.close, lock)
        cleanup.callback(_withdraw, data_dir / "server.json")
        try:
            store = _open_store(args.database or config.store_url, data_dir)
        except DatabaseTooNew as exc:
            print(f"t3: {exc}", file=sys.stderr)
            return 1
        except (StoreError, OSError) as exc:
            print(f"t3: cannot open the database: {exc}", file=sys.stderr)
            return 1
        cleanup.callback(store.close)
        return await _run(args, config, data_dir, store)


def _has_password(url: str) -> bool:
    """Whether a database URL carries a password (``user:secret@`` or ``?password=``)."""
    parts = urllib.parse.urlsplit(url)
    return bool(parts.password) or "password" in urllib.parse.parse_qs(parts.query)


def _open_store(url: str | None, data_dir: Path) -> Store:
    """The store in ``data_dir``'s SQLite file, or with a URL in PostgreSQL (store_pg.py, a
    feature module: imported only then)."""
    from store import Store, StoreError
    if url is None:
        # Created empty and 0600 first (never through a symlink): SQLite then gives its -wal
        # and -shm files the same mode.
        os.close(os.open(data_dir / "t3.sqlite", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        return Store(data_dir / "t3.sqlite", backups_dir=data_dir / "backups")
    try:
        import store_pg
    except ImportError as exc:
        raise StoreError(f"a PostgreSQL database needs psycopg ({exc}): pip install -e "
                         "'.[postgres]'") from exc
    if not store_pg.is_postgres_url(url):
        raise StoreError("the database URL must start with postgresql://")
    return Store(store_pg.PostgresEngine(url))


def _withdraw(server_json: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if json.loads(server_json.read_text()).get("pid") == os.getpid():
            server_json.unlink()


async def _run(args: argparse.Namespace, config: Config, data_dir: Path, store: Store) -> int:
    import hypercorn.asyncio.run
    import hypercorn.config
    import hypercorn.utils
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from schedules import Scheduler
    from tools import build_mcp_server
    hconfig = _hypercorn_config(config, hypercorn)
    if hconfig is None:
        return 2
    host, tls = args.host or config.host, hconfig.ssl_enabled
    port = config.port if args.port is None else args.port
    # Bind first: provider-session credentials name the MCP URL, and recovery may start agents.
    try:
        sock = _listen(host, port, cap=config.max_connections, tls=tls)
    except OSError as exc:
        print(f"t3: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    local_host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, url_host)
    scheme = "https" if tls else "http"
    url = f"{scheme}://{url_host}:{port}"

    environment_id = await store.meta("environmentId", f"env-{uuid.uuid4().hex[:12]}")
    credentials = Credentials(max_lifetime_s=config.credential_max_lifetime_s,
                              idle_s=config.credential_idle_s,
                              mcp_url=f"{scheme}://{local_host}:{port}/mcp")
    clock = TestClock.from_environment()
    orch, adapters, toolkit = await _start_domain(config, data_dir, store, environment_id,
                                                  credentials, base_url=url, clock=clock)
    mcp_server = build_mcp_server(toolkit, version=VERSION)
    # Answers in SSE (progress flows); a JSON-only client gets JSON from a second manager.
    sse, plain = (StreamableHTTPSessionManager(app=mcp_server, stateless=True, json_response=j,
                                               max_request_body_size=MAX_BODY_BYTES)
                  for j in (False, True))
    client_token = ClientToken(data_dir / "client-token")
    web_view = WebView.load()
    if web_view is None:
        log.warning("ui.html is not installed beside t3.py: GET / (the web view) answers 404")
    clients = ClientApi(toolkit=toolkit)
    app = build_app(mcp=_by_accept(sse.handle_request, plain.handle_request), web_view=web_view,
                    credentials=credentials, client_token=client_token,
                    ws=ws_endpoint(clients, client_token), environment_id=environment_id,
                    hooks=webhook_endpoint(orch.part(Scheduler)),
                    policy=HttpPolicy.for_server(config=config, host=host, port=port, tls=tls))
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
        server = tasks.create_task(_until_stopped(hypercorn.asyncio.run.worker_serve(
            hypercorn.utils.wrap_app(app, hconfig.wsgi_max_body_size, "asgi"), hconfig,
            sockets=hypercorn.config.Sockets(secure_sockets=[sock] if tls else [],
                                             insecure_sockets=[] if tls else [sock],
                                             quic_sockets=[]),
            shutdown_trigger=http_stop.wait), stop))
        _announce(data_dir / "server.json", url=url, port=port, environment_id=environment_id)
        await stop.wait()
        log.info("shutting down")
        for task in preparing:
            task.cancel()  # an install in progress is killed; its partial directory is removed
        await _shut_down(orch=orch, clients=clients, server=server, http_stop=http_stop,
                         sock=sock, grace_s=hconfig.graceful_timeout)
        for adapter in adapters.values():
            adapter.close()  # the provider traffic logs' last buffered lines
    with contextlib.suppress(OSError):  # hypercorn usually closed it already
        sock.close()
    log.info("stopped")
    return 0


async def _until_stopped(serving: Awaitable[None], stop: asyncio.Event) -> None:
    """Hypercorn's serving: when it fails, the server shuts down as on a signal."""
    with contextlib.suppress(Exception):
        await serving
    stop.set()


def _announce(server_json: Path, *, url: str, port: int, environment_id: str) -> None:
    """server.json (how the commands for people find the server), then the ready line."""
    _write_private_atomic(server_json, json.dumps({
        "pid": os.getpid(), "url": url, "mcpUrl": f"{url}/mcp",
        "wsUrl": url.replace("http", "ws", 1) + "/ws", "port": port,
        "environmentId": environment_id,
        "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n",
        replace=True)
    print(f"t3 {VERSION} ready: MCP at {url}/mcp (client token in "
          f"{server_json.parent / 'client-token'})", file=sys.stderr, flush=True)


async def _shut_down(*, orch: Orchestrator, clients: ClientApi, server: asyncio.Task[Any],
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
    await server
    await orch.close()


async def _start_domain(config: Config, data_dir: Path, store: Store, environment_id: str,
                        credentials: Credentials, *, base_url: str, clock: TestClock | None
                        ) -> tuple[Orchestrator, dict[str, Adapter], Toolkit]:
    """Adapters, the orchestrator (recovered and started) and the toolkit over it; git work
    (workspace.py) is handed to the orchestrator as the adapters are."""
    import providers as prov
    orphans = await prov.kill_orphans(str(data_dir))
    if orphans:
        log.warning("killed %d provider process(es) left by a previous server", orphans)
    load_features()
    from orchestrator import Orchestrator, utc_now
    from tools import Project, ServerContext, Toolkit
    from workspace import Workspaces  # made under the data-dir lock: it clears stray indexes
    adapters = build_adapters(config, data_dir, prov)
    _report_providers(adapters, detected=config.providers is None)
    orch = Orchestrator(store, adapters=adapters, providers=_LiveProviderInfo(adapters),
                        credentials=credentials, workspaces=Workspaces(data_dir),
                        max_live_agent_processes=config.max_live_agent_processes,
                        max_delegation_depth=config.max_delegation_depth,
                        clock=clock.iso if clock else utc_now)
    toolkit = Toolkit(orch, store, ServerContext(
        environment_id=environment_id, projects=[
            Project(p["id"], p["path"], p["title"], tuple(p.get("setup", ())))
            for p in config.projects], data_dir=data_dir,
        max_delegation_depth=config.max_delegation_depth, base_url=base_url,
        max_scheduled_tasks_per_project=config.max_scheduled_tasks_per_project,
        min_agent_task_interval_s=config.min_agent_task_interval_s))
    from links import Environment, Links
    from schedules import Scheduler
    orch.attach(Scheduler(toolkit, wall=clock.now if clock else time.time, redact=prov.redact))
    orch.attach(Links({e["id"]: Environment(e["id"], e["url"], Path(e["token_file"]))
                       for e in config.environments}))
    await store.sync_projects(config.projects)
    mine = None  # on PostgreSQL this server is a node (cluster.py): it recovers its own work only
    if store.path is None:
        import cluster
        node = await cluster.Node.join(
            store, orch, cluster.node_id(config.node_id, data_dir), url=store.engine.url,
            projects=config.node_projects if config.node_projects is not None else
            ["scratch", *(p["id"] for p in config.projects if Path(p["path"]).is_dir())],
            slots=config.max_live_agent_processes)
        mine = node.work(node.id)
    recovered = await orch.recover(
        reason="The t3 server restarted while this run was active; its provider process is gone.",
        of=mine)
    if recovered:
        log.warning("interrupted the runs left active by the previous server in %d thread(s)",
                    len(recovered))
    orch.start()
    if clock is not None:
        clock.register(orch)
    return orch, adapters, toolkit


def _report_providers(adapters: Mapping[str, Adapter], *, detected: bool) -> None:
    """One stderr line per provider instance: its driver, whether it can run, and why not. (An
    acpRegistry instance is still preparing here; it logs again once it is ready or failed.)"""
    from drivers import DETECTABLE
    how = "detected on PATH" if detected else "configured"
    for adapter in adapters.values():
        info = adapter.info
        state = "ready" if info.available else "unavailable: " + "; ".join(info.constraints)
        print(f"t3: provider {info.instance_id} ({info.driver}, {how}): {state}",
              file=sys.stderr)
    if any(adapter.info.available for adapter in adapters.values()):
        return
    if detected and not adapters:
        hint = (f"no agent CLI on PATH ({', '.join(DETECTABLE)}) and no [[providers]] in the "
                "configuration; install one, or configure one (README: Configuration)")
    elif any(hasattr(adapter, "prepare") for adapter in adapters.values()):
        hint = "wait for the instances being prepared, or fix the reasons above"
    else:
        hint = "fix the reasons above in the configuration's [[providers]]"
    print(f"t3: no provider instance can run yet: {hint}. Until one can, new threads and "
          "tasks are refused (provider_unavailable).", file=sys.stderr)


def _hypercorn_config(config: Config, hypercorn: ModuleType) -> hypercorn.config.Config | None:
    """Hypercorn's settings, or None (said on stderr) when the TLS files cannot be used."""
    hconfig = hypercorn.config.Config()
    hconfig.graceful_timeout = 3.0
    # An idle kept-alive connection stays open longer than clients keep theirs (httpx 5 s, Node
    # 4 s, reqwest 90 s), so the client always closes first: at hypercorn's 5 s, a client reusing
    # one as it was being closed had its call fail ("Connection closed").
    hconfig.keep_alive_timeout = 120.0
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


def _return_big_buffers() -> None:
    """glibc: every buffer of 128 KiB or more gets pages of its own, given back when it is freed.
    Left to glibc, the bound rises to the largest buffer freed so far (up to 32 MiB), and a long
    answer's text, rebuilt as it grows, then leaves the buffers below it in the heap, where the
    server keeps their pages. No-op without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


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


# ---------------------------------------------------------------------------------------------
# Test hooks, inert unless T3_TEST_HOOKS=1 (store.py has the others: crash points, a full disk)


class TestClock:
    """The server's clock when tests move it (``T3_TEST_CLOCK`` epoch seconds, only with
    ``T3_TEST_HOOKS=1``): it stands still but for ``advance`` (/ws ``advanceTestClock``).
    Durations t3 measures (leases, grace periods) keep the real clock."""

    def __init__(self, start: float) -> None:
        self.seconds = start

    @classmethod
    def from_environment(cls) -> TestClock | None:
        start = os.environ.get("T3_TEST_CLOCK")
        if os.environ.get("T3_TEST_HOOKS") != "1" or not start:
            return None
        log.warning("test hook: the clock starts at %s and moves when tests say", start)
        return cls(float(start))

    def now(self) -> float:
        return self.seconds

    def iso(self) -> str:
        from orchestrator import iso_time
        return iso_time(self.seconds)

    def advance(self, seconds: float) -> None:
        self.seconds += seconds

    def register(self, orch: Orchestrator) -> None:
        """/ws ``advanceTestClock {seconds}``: move the clock forward, and answer once the
        scheduler has fired what that made due."""
        from schedules import Scheduler
        from tools import CLIENT, Call, Operation, obj, register

        async def advance(kit: Toolkit, call: Call, args: Mapping[str, Any]) -> dict[str, Any]:
            self.advance(float(args["seconds"]))
            await orch.part(Scheduler).scheduler_pass()
            return {"now": self.iso()}
        register(Operation("advanceTestClock", "Tests only: move the server's clock.", obj(
            {"seconds": {"type": "number", "minimum": 0}}, ["seconds"]), advance, {},
            callers=CLIENT, ws=("advanceTestClock",), mcp=False))


# ---------------------------------------------------------------------------------------------
# Provider adapters, as the orchestrator and tools are handed them


def build_adapters(config: Config, data_dir: Path, prov: ModuleType) -> dict[str, Adapter]:
    """One adapter per configured provider instance (or per detected CLI when none are configured),
    each driver's from drivers.py. Their processes are tagged with the data dir, so a later
    server can find its orphans. The ``acpRegistry`` driver is registry.py's, imported only when
    an instance uses it."""
    import drivers
    configs = [prov.ProviderConfig(
        instance_id=p["id"], driver=p["driver"], command=p["command"] or [], env=p["env"],
        models=p["models"], enabled=p["enabled"], display_name=p["displayName"],
        agent=p["agent"], registry=p["registry"], instructions=p["instructions"],
        allow_unverified=p["allowUnverified"]) for p in config.providers] \
        if config.providers is not None else drivers.detect_providers()
    adapters: dict[str, Adapter] = {}
    for c in configs:
        if c.driver == "acpRegistry":
            from registry import AcpRegistryAdapter
            adapters[c.instance_id] = AcpRegistryAdapter(
                c, log_dir=data_dir / "logs", owner=str(data_dir),
                cache_dir=data_dir / "agents" / "registry")
        else:
            adapters[c.instance_id] = drivers.build_adapter(c, log_dir=data_dir / "logs",
                                                            owner=str(data_dir))
    return adapters


class _LiveProviderInfo(Mapping[str, "ProviderInfo"]):
    """Each adapter's ``info`` as it is now, for the orchestrator and tools: an instance still
    being prepared (acpRegistry) becomes available, or fails with a reason, after startup."""

    def __init__(self, adapters: Mapping[str, Adapter]) -> None:
        self._adapters = adapters

    def __getitem__(self, instance_id: str) -> ProviderInfo:
        return self._adapters[instance_id].info

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)


# =============================================================================================
# Command line: serve and token; the commands for people are cli.py's, which this module never
# imports unless one is named (the server runs without it).


def _parser(*, people: bool = True) -> argparse.ArgumentParser:
    """The command line; with ``people=False`` only ``serve`` and ``token`` (what
    ``_names_no_command_for_people`` says is enough)."""
    def options(parser: argparse.ArgumentParser, default: Any) -> None:
        # Subcommands repeat the options with SUPPRESS defaults so that
        # `t3.py --port 0 serve` and `t3.py serve --port 0` both work.
        for flag, settings in _SERVE_OPTIONS.items():
            parser.add_argument(flag, default=default, **settings)
    parser = argparse.ArgumentParser(
        prog="t3", description="t3: a local server that orchestrates coding agents over MCP. "
        "The commands after serve and token are for people: they talk to a running server "
        "over /ws.", formatter_class=argparse.RawDescriptionHelpFormatter)
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
        parser.epilog = _cli().CLI_EXIT_CODES
        _cli().add_parsers(sub)
    return parser


def _names_no_command_for_people(argv: Sequence[str]) -> bool:
    """True when ``argv`` serves, prints the token or fails the same without the commands for
    people: then their ~30 parsers are not built (argparse looks up translations for each, a
    sizable part of a server's startup). When unsure it says False, and the full parser reads
    every command line."""
    words = [a for i, a in enumerate(argv)
             if not a.startswith("-") and not (i and argv[i - 1] in _SERVE_OPTIONS)]
    return not {"-h", "--help"} & set(argv) and (not words or words[0] in ("serve", "token"))


_SERVE_OPTIONS: dict[str, dict[str, Any]] = {
    "--data-dir": {"help": "data directory (default: $T3_HOME, else ~/.t3)"},
    "--config": {"help": "configuration file (default: <data-dir>/t3.toml)"},
    "--host": {"help": "address to listen on (default 127.0.0.1)"},
    "--port": {"type": int, "help": "port to listen on (default 3773; 0 picks a free port)"},
    "--database": {"metavar": "URL", "help": "keep t3's data in this PostgreSQL database "
                   "(postgresql://...; default: [store] url, else SQLite in the data directory)"}}


def _cli() -> ModuleType:
    """cli.py, imported only here. It imports this module: run as a script, this module is
    ``__main__``, and cli's ``import t3`` gets it rather than a second copy."""
    sys.modules.setdefault("t3", sys.modules[__name__])
    import cli
    return cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(people=not _names_no_command_for_people(argv)).parse_args(argv)
    if args.command not in (None, "serve", "token"):
        return _cli().run_command(args)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mcp").setLevel(logging.WARNING)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    if args.command == "token":
        try:
            print(client_token(open_data_dir(args.data_dir), rotate=args.rotate))
        except DataDirError as exc:
            print(f"t3: {exc}", file=sys.stderr)
            return 2
        return 0
    _watch_children_by_pidfd()
    return asyncio.run(serve(args))


def _watch_children_by_pidfd() -> None:
    """On Python 3.11 asyncio waits for each child in a thread of its own, started from the
    event loop (``ThreadedChildWatcher``); a pidfd in the loop's selector needs no thread (Linux
    5.3+). Python 3.12+ makes this choice itself; elsewhere (macOS) the threads stay."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # a kernel without pidfds
        return
    asyncio.set_child_watcher(asyncio.PidfdChildWatcher())


if __name__ == "__main__":
    raise SystemExit(main())
