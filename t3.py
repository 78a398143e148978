"""t3.py: the entry point of t3, a small auditable server that orchestrates coding agents.

``python t3.py [serve]`` runs one local server (hypercorn on 127.0.0.1) with MCP tools at ``/mcp``;
``python t3.py token`` prints the client token. This file owns configuration (``t3.toml``), the
data directory (its lock, the client token, ``server.json``), credentials and bearer auth, the
ASGI app and its routes, and startup/shutdown order. It wires the layers; it decides nothing and
holds no SQL: ``store.py`` (SQLite) <- ``orchestrator.py`` (domain) <- ``tools.py`` (MCP tools),
with ``providers.py`` (agent subprocesses) handed to the orchestrator here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
import tomllib
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["VERSION", "main", "Config", "ConfigError", "load_config", "Credentials", "build_app"]

VERSION = "0.1.0"
log = logging.getLogger("t3")

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                    Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]

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
    projects: list[dict[str, str]]
    providers: list[dict[str, Any]] | None  # None: detect installed CLIs
    credential_max_lifetime_s: int = 86_400
    credential_idle_s: int = 7_200
    max_delegation_depth: int = 5
    max_live_agent_processes: int = 16
    allowed_origins: tuple[str, ...] = ()  # besides the server's own http://127.0.0.1:<port> etc.
    allowed_hosts: tuple[str, ...] = ()  # Host header names besides loopback addresses
    max_connections: int = 512
    certfile: str | None = None
    keyfile: str | None = None


_SECTIONS = {"server": {"host", "port", "allowed_origins", "allowed_hosts", "max_connections",
                        "certfile", "keyfile"},
             "projects": {"id", "path", "title"},
             "providers": {"id", "driver", "command", "env", "models", "enabled", "displayName",
                           "agent", "registry", "instructions", "allow_unverified"},
             "limits": {"credential_max_lifetime_s", "credential_idle_s", "max_delegation_depth",
                        "max_live_agent_processes"}}


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
    server = data.get("server", {})
    for key in server:
        if key not in _SECTIONS["server"]:
            raise fail("server", None, key, "unknown key")
    host = server.get("host", "127.0.0.1")
    port = server.get("port", 3773)
    if not isinstance(host, str):
        raise fail("server", None, "host", "must be a string")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise fail("server", None, "port", "must be an integer 0-65535")
    http: dict[str, Any] = {}
    for key in ("allowed_origins", "allowed_hosts"):
        value = server.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise fail("server", None, key, "must be a list of non-empty strings")
        http[key] = tuple(v.rstrip("/") if key == "allowed_origins" else v.lower() for v in value)
    if "max_connections" in server:
        if not isinstance(server["max_connections"], int) or server["max_connections"] < 1:
            raise fail("server", None, "max_connections", "must be a positive integer")
        http["max_connections"] = server["max_connections"]
    for key in ("certfile", "keyfile"):
        if key in server:
            value = server[key]
            if not isinstance(value, str) or not (path.parent / value).is_file():
                raise fail("server", None, key, f"must name an existing file ({value!r})")
            http[key] = str((path.parent / value).resolve())
    if ("certfile" in http) != ("keyfile" in http):
        raise fail("server", None, "certfile", "certfile and keyfile go together")

    projects: list[dict[str, str]] = []
    for i, entry in enumerate(data.get("projects", [])):
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
        projects.append({"id": pid, "path": str(Path(ppath).resolve()), "title": title})
    if not projects:
        projects.append({"id": "default", "path": str(cwd.resolve()), "title": cwd.name or "/"})

    providers: list[dict[str, Any]] | None = None
    if "providers" in data:
        from providers import DRIVERS
        providers = []
        for i, entry in enumerate(data["providers"]):
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
                # Agents run in their project's directory: a relative executable path means
                # relative to this file.
                command = [str((path.parent / command[0]).resolve()), *command[1:]]
            env = entry.get("env", {})
            if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
                raise fail("providers", i, "env", "must be a table of strings")
            models = entry.get("models", [])
            if not isinstance(models, list) or not all(
                    isinstance(m, str) or (isinstance(m, dict) and isinstance(m.get("id"), str))
                    for m in models):
                raise fail("providers", i, "models", "must be a list of ids or {id=...} tables")
            enabled = entry.get("enabled", True)
            if not isinstance(enabled, bool):
                raise fail("providers", i, "enabled", "must be true or false")
            instructions = entry.get("instructions", True)
            if not isinstance(instructions, bool):
                raise fail("providers", i, "instructions", "must be true or false")
            if any(p["id"] == pid for p in providers):
                raise fail("providers", i, "id", f"duplicate provider id {pid!r}")
            allow_unverified = entry.get("allow_unverified", False)
            if not isinstance(allow_unverified, bool):
                raise fail("providers", i, "allow_unverified", "must be true or false")
            if allow_unverified and driver != "acpRegistry":
                raise fail("providers", i, "allow_unverified",
                           "only the acpRegistry driver takes it")
            agent, registry = entry.get("agent"), entry.get("registry")
            for key, value in (("agent", agent), ("registry", registry)):
                if driver == "acpRegistry" and (not isinstance(value, str) or not value):
                    raise fail("providers", i, key, "the acpRegistry driver needs it (a string)")
                if driver != "acpRegistry" and value is not None:
                    raise fail("providers", i, key, "only the acpRegistry driver takes it")
            if registry and not registry.startswith(("http://", "https://")):
                registry = str((path.parent / registry).resolve())  # relative to this file
            providers.append({"id": pid, "driver": driver, "command": command, "env": env,
                              "models": models, "enabled": enabled,
                              "displayName": entry.get("displayName"), "agent": agent,
                              "registry": registry, "instructions": instructions,
                              "allowUnverified": allow_unverified})

    limits = data.get("limits", {})
    values = {}
    for key in limits:
        if key not in _SECTIONS["limits"]:
            raise fail("limits", None, key, "unknown key")
        if not isinstance(limits[key], int) or isinstance(limits[key], bool) or limits[key] <= 0:
            raise fail("limits", None, key, "must be a positive integer")
        values[key] = limits[key]
    return Config(host=host, port=port, projects=projects, providers=providers, **http, **values)


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
# Data directory


def data_dir_of(value: str | None) -> Path:
    raw = value or os.environ.get("T3_HOME") or str(Path.home() / ".t3")
    path = Path(raw).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def client_token(data_dir: Path) -> str:
    """Read the client token, creating it (mode 0600) on first use."""
    path = data_dir / "client-token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


class DataDirLock:
    """An exclusive lock on ``<data-dir>/t3.lock``: one server per data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "t3.lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)


# =============================================================================================
# Credentials and bearer auth


class Credentials:
    """Bearer tokens: the client token, and provider-session credentials (hashes only, in memory).

    A session credential lives at most ``max_lifetime_s`` and ends after ``idle_s`` without an
    authenticated call or turn activity, but never while its session serves a turn. Once it has
    ended (expired or revoked) it is gone for good: nothing revives it, and the orchestrator
    replaces the session (``renewal_due``) before its next turn."""

    def __init__(self, *, client_token: str, max_lifetime_s: int, idle_s: int,
                 mcp_url: str, clock: Callable[[], float] = time.monotonic) -> None:
        from tools import Scope
        self._scope_type = Scope
        self._client_hash = _hash(client_token)
        self._sessions: dict[str, _SessionCredential] = {}  # token hash -> credential
        self._by_session: dict[str, str] = {}  # provider session id -> token hash
        self.max_lifetime_s = max_lifetime_s
        self.idle_s = idle_s
        self.mcp_url = mcp_url
        self._clock = clock

    def issue(self, *, thread_id: str, provider_instance_id: str, provider_session_id: str
              ) -> Any:
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
        digest = _hash(token)
        if hmac.compare_digest(digest, self._client_hash):
            return self._scope_type(kind="client", key="client")
        credential = self._sessions.get(digest)
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


async def _send_json(send: Callable[[MutableMapping[str, Any]], Awaitable[None]], status: int,
                     body: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": payload})


async def _drain(receive: Callable[[], Awaitable[Any]], *, limit: int) -> None:
    """Read and drop a request body so the client sees our answer instead of a reset."""
    seen = 0
    while seen <= limit:
        message = await receive()
        seen += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return


def bearer_auth(app: ASGIApp, credentials: Credentials) -> ASGIApp:
    """Resolve ``Authorization: Bearer`` to a scope for the tool handlers, or answer 401."""
    from tools import current_scope

    async def middleware(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        resolved = credentials.resolve(token) if token else None
        if resolved is None:
            log.warning("rejected an MCP request: %s", "unknown or expired token" if token
                        else "missing bearer token")
            await _send_json(send, 401, {
                "error": "invalid_mcp_credential",
                "message": "A valid t3 bearer credential is required (the client token from "
                           "`python t3.py token`, or a provider-session credential)."},
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
# The ASGI app


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


def build_app(*, mcp: ASGIApp, credentials: Credentials, environment_id: str) -> ASGIApp:
    authed_mcp = bearer_auth(mcp, credentials)

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        started = False

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            if path == "/healthz" and method == "GET":
                await _send_json(tracked_send, 200, {"ok": True, "version": VERSION,
                                                     "environmentId": environment_id})
            elif path == "/mcp":
                length = dict(scope.get("headers") or []).get(b"content-length", b"0")
                if length.isdigit() and int(length) > MAX_BODY_BYTES:
                    await _drain(receive, limit=4 * MAX_BODY_BYTES)
                    await _send_json(tracked_send, 413, {
                        "error": "payload_too_large",
                        "message": f"request bodies are limited to {MAX_BODY_BYTES} bytes"})
                else:
                    await authed_mcp(scope, receive, tracked_send)
            else:
                await _send_json(tracked_send, 404, {"error": "not_found",
                                                     "message": f"no route for {method} {path}"})
        except Exception:
            log.exception("request %s %s failed", method, path)
            if not started:
                await _send_json(send, 500, {"error": "internal_error",
                                             "message": "t3 hit an internal error; see its log"})
    return app


# =============================================================================================
# Serving


async def serve(args: argparse.Namespace) -> int:
    import hypercorn.asyncio
    import hypercorn.config
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    import providers as prov
    from orchestrator import Orchestrator
    from store import DatabaseTooNew, Store, StoreError
    from tools import Project, ServerContext, Toolkit, build_mcp_server

    data_dir = data_dir_of(args.data_dir)
    config_path = Path(args.config).expanduser().resolve() if args.config \
        else data_dir / "t3.toml"
    try:
        config = load_config(config_path, cwd=Path.cwd())
    except ConfigError as exc:
        print(f"t3: invalid configuration: {exc}", file=sys.stderr)
        return 2
    host = args.host or config.host
    port = config.port if args.port is None else args.port
    for sub in ("logs", "backups", "scratch", "worktrees", "agents"):
        (data_dir / sub).mkdir(exist_ok=True)
    lock = DataDirLock(data_dir)
    if not lock.acquire():
        print(f"t3: another t3 server (pid {lock.holder()}) is already using {data_dir}; "
              "stop it first or pass another --data-dir", file=sys.stderr)
        return 1
    server_json = data_dir / "server.json"
    try:
        try:
            store = Store(data_dir / "t3.sqlite", backups_dir=data_dir / "backups")
        except DatabaseTooNew as exc:
            print(f"t3: {exc}", file=sys.stderr)
            return 1
        except StoreError as exc:
            print(f"t3: cannot open the database: {exc}", file=sys.stderr)
            return 1
        try:
            return await _run(args, config, data_dir, store, host, port, server_json,
                              prov=prov, orchestrator_cls=Orchestrator, toolkit_cls=Toolkit,
                              context_cls=ServerContext, project_cls=Project,
                              build_mcp_server=build_mcp_server, hypercorn=hypercorn,
                              manager_cls=StreamableHTTPSessionManager)
        finally:
            store.close()
    finally:
        with contextlib.suppress(FileNotFoundError):
            if json.loads(server_json.read_text()).get("pid") == os.getpid():
                server_json.unlink()
        lock.release()


async def _run(args: argparse.Namespace, config: Config, data_dir: Path, store: Any, host: str,
               port: int, server_json: Path, *, prov: Any, orchestrator_cls: Any,
               toolkit_cls: Any, context_cls: Any, project_cls: Any, build_mcp_server: Any,
               hypercorn: Any, manager_cls: Any) -> int:
    # Bind first: provider-session credentials name the MCP URL, and recovery may start agents.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"t3: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        sock.close()
        return 1
    sock.listen(128)
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    local_host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, url_host)
    url = f"http://{url_host}:{port}"

    environment_id = await store.meta("environmentId", f"env-{uuid.uuid4().hex[:12]}")
    token = client_token(data_dir)
    credentials = Credentials(client_token=token, max_lifetime_s=config.credential_max_lifetime_s,
                              idle_s=config.credential_idle_s,
                              mcp_url=f"http://{local_host}:{port}/mcp")
    owner = str(data_dir)
    orphans = prov.kill_orphans(owner)
    if orphans:
        log.warning("killed %d provider process(es) left by a previous server", orphans)

    adapters = build_adapters(config, data_dir, prov)
    for adapter in adapters.values():
        if not adapter.info.available:
            log.info("provider %s unavailable: %s", adapter.info.instance_id,
                     "; ".join(adapter.info.constraints))
    orch = orchestrator_cls(store, adapters=adapters, providers=_LiveProviderInfo(adapters),
                            credentials=credentials,
                            max_live_agent_processes=config.max_live_agent_processes)
    await store.sync_projects(config.projects)
    recovered = await orch.recover(
        reason="The t3 server restarted while this run was active; its provider process is gone.")
    if recovered:
        log.warning("interrupted the runs left active by the previous server in %d thread(s)",
                    len(recovered))
    orch.start()

    context = context_cls(environment_id=environment_id,
                          projects=[project_cls(p["id"], p["path"], p["title"])
                                    for p in config.projects], data_dir=data_dir,
                          max_delegation_depth=config.max_delegation_depth)
    toolkit = toolkit_cls(orch, store, context)
    mcp_server = build_mcp_server(toolkit, version=VERSION)
    # Streamable HTTP answers in SSE (progress notifications flow); a client that accepts only
    # JSON gets plain JSON answers from a second manager over the same server instead of a 406.
    sse = manager_cls(app=mcp_server, stateless=True, json_response=False,
                      max_request_body_size=MAX_BODY_BYTES)
    plain = manager_cls(app=mcp_server, stateless=True, json_response=True,
                        max_request_body_size=MAX_BODY_BYTES)
    app = build_app(mcp=_by_accept(sse.handle_request, plain.handle_request),
                    credentials=credentials, environment_id=environment_id)
    hconfig = hypercorn.config.Config()
    hconfig.bind = [f"fd://{sock.fileno()}"]
    hconfig.graceful_timeout = 3.0
    hconfig.accesslog = None
    hconfig.errorlog = logging.getLogger("hypercorn.error")

    stop = asyncio.Event()
    http_stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with sse.run(), plain.run(), asyncio.TaskGroup() as tasks:
        # Adapters with something to install (acpRegistry) prepare in the background: the
        # server is up meanwhile and lists them unavailable with "preparing ...".
        preparing = [tasks.create_task(a.prepare(), name=f"prepare-{k}")
                     for k, a in adapters.items() if hasattr(a, "prepare")]
        server = loop.create_task(hypercorn.asyncio.serve(app, hconfig,
                                                          shutdown_trigger=http_stop.wait))
        _write_json_atomic(server_json, {
            "pid": os.getpid(), "url": url, "mcpUrl": f"{url}/mcp", "wsUrl": f"ws://{url_host}:{port}/ws",
            "port": port, "environmentId": environment_id,
            "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        print(f"t3 {VERSION} ready: MCP at {url}/mcp (client token in {data_dir / 'client-token'})",
              file=sys.stderr, flush=True)
        stopped = loop.create_task(stop.wait())
        await asyncio.wait({server, stopped}, return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down")
        for task in preparing:
            task.cancel()  # an install in progress is killed; its partial directory is removed
        orch.begin_shutdown()  # waits return their current state before HTTP closes
        http_stop.set()
        with contextlib.suppress(Exception):
            await server
        stopped.cancel()
        await orch.close()
        for adapter in adapters.values():
            adapter.close()  # the provider traffic logs' last buffered lines
    with contextlib.suppress(OSError):  # hypercorn usually closed it already
        sock.close()
    log.info("stopped")
    return 0


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
# Command line


def _parser() -> argparse.ArgumentParser:
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
        prog="t3", description="t3: a local server that orchestrates coding agents over MCP.")
    options(parser, None)
    sub = parser.add_subparsers(dest="command")
    options(sub.add_parser("serve", help="run the server (the default)",
                           description="Run the t3 server: MCP tools at /mcp, health at "
                                       "/healthz."), argparse.SUPPRESS)
    options(sub.add_parser("token", help="print the client token (creating it)",
                           description="Print the client token of the data directory, "
                                       "creating it if absent."), argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mcp").setLevel(logging.WARNING)
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    if args.command == "token":
        print(client_token(data_dir_of(args.data_dir)))
        return 0
    return asyncio.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
