"""registry.py: the ``acpRegistry`` driver, a feature to skip unless an instance uses it.

An instance names an agent in an ACP registry (a JSON catalog, from an https URL or a file):
``select_agent`` validates its entry and picks the distribution for this platform (a binary
archive with its sha256, else a pinned npm or uv package), ``AcpRegistryAdapter.prepare()``
installs it into ``<data-dir>/agents/registry/`` (t3.py runs it in the background at startup)
and proves it with a disposable ``session/new``; then it runs exactly as the ``acp`` driver.
Rules: downloads over https only (plain http only to this machine's loopback), redirects too;
a binary runs only when its checksum matches (``allow_unverified`` on the instance waives a
missing one); archive members never land outside their directory; npm and uv install into the
cache, never globally; a failed install leaves nothing behind. The core never imports this
module: t3.py builds these adapters beside drivers.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import platform
import re
import shutil
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from orchestrator import Capabilities, parse_json
from drivers import AcpAdapter, AcpSession
from providers import JsonRpcError, ProviderConfig, log, redact

__all__ = ["AcpRegistryAdapter", "RegistryAgent", "RegistryError", "read_registry",
           "registry_platform", "select_agent"]

_REGISTRY_MAX_BYTES = 16 * 1024 * 1024
_NETWORK_TIMEOUT_S = 60.0
_INSTALL_TIMEOUT_S = 900.0
_PREPARED = ".t3-prepared"  # written last: a directory without it is not a usable install
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
# Package specs go on npm's / uv's command line: no leading dash, no spaces, no paths.
_NPM_PACKAGE = re.compile(r"^(@[a-z0-9][\w.-]*/)?[a-z0-9][\w.-]*(@[\w.+-]+)?$", re.IGNORECASE)
_UV_PACKAGE = re.compile(r"^[A-Za-z0-9][\w.-]*(\[[\w,.-]+\])?((==|@)[\w.+!-]+)?$")
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar")
_CACHE_LOCKS: dict[Path, asyncio.Lock] = {}  # one preparation at a time per cache


class RegistryError(Exception):
    """The registry, an agent's entry in it, or its distribution cannot be used."""


@dataclass(frozen=True, slots=True)
class RegistryAgent:
    """One agent's entry as the catalog validated it, with the distribution chosen for this
    platform: ``binary`` (archive, cmd, sha256), else ``npx`` or ``uvx`` (a pinned package)."""

    id: str
    name: str
    version: str
    kind: str
    platform: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    package: str | None = None
    archive: str | None = None
    cmd: str | None = None
    sha256: str | None = None


def registry_platform() -> str:
    """This machine as the registry names platforms: ``<os>-<arch>``, e.g. ``linux-x86_64``."""
    system = {"win32": "windows"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    return f"{system}-" + {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine,
                                                                                     machine)


def read_registry(source: str) -> Mapping[str, Any]:
    """The registry JSON from an https URL (``_open_url``) or a file path. Blocking: run it in
    a thread."""
    try:
        if source.startswith(("http://", "https://")):
            with _open_url(source, "the ACP registry") as response:
                raw = response.read(_REGISTRY_MAX_BYTES + 1)
        else:
            with open(source, "rb") as f:
                raw = f.read(_REGISTRY_MAX_BYTES + 1)
    except (OSError, ValueError) as exc:  # URLError is an OSError
        raise RegistryError(f"cannot read the ACP registry {source}: {exc}") from exc
    if len(raw) > _REGISTRY_MAX_BYTES:
        raise RegistryError(f"the ACP registry {source} is larger than {_REGISTRY_MAX_BYTES} bytes")
    try:
        data = parse_json(raw)
    except ValueError as exc:
        raise RegistryError(f"the ACP registry {source} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("agents"), list):
        raise RegistryError(f'the ACP registry {source} has no "agents" list')
    return data


def select_agent(registry: Mapping[str, Any], agent_id: str, *, platform_key: str,
                 allow_unverified: bool = False) -> RegistryAgent:
    """Validate ``agent_id``'s entry and choose its distribution: the binary for
    ``platform_key`` if declared, else npx, else uvx. A binary needs an https archive and a
    declared sha256 (without one only if ``allow_unverified``). Never starts a process."""
    entries = [a for a in registry["agents"] if isinstance(a, dict)]
    entry = next((a for a in entries if a.get("id") == agent_id), None)
    if entry is None:
        known = ", ".join(sorted(str(a.get("id")) for a in entries)) or "none"
        raise RegistryError(f"agent {agent_id!r} is not in the ACP registry (it lists: {known})")

    def bad(where: str, problem: str) -> RegistryError:
        return RegistryError(f"ACP registry agent {agent_id}: {where}: {problem}")

    version = entry.get("version")
    if not isinstance(version, str) or not _VERSION.match(version):
        raise bad("version", "must be a version string")
    name = entry.get("name")
    display = name if isinstance(name, str) else agent_id
    distribution = entry.get("distribution")
    if not isinstance(distribution, dict):
        raise bad("distribution", "must be an object")
    binary = distribution.get("binary")
    if binary is not None and not isinstance(binary, dict):
        raise bad("distribution.binary", "must be an object keyed by platform")
    if binary and platform_key in binary:
        where = f"distribution.binary.{platform_key}"
        target = binary[platform_key]
        if not isinstance(target, dict):
            raise bad(where, "must be an object")
        archive, cmd, sha256 = target.get("archive"), target.get("cmd"), target.get("sha256")
        if not isinstance(archive, str) or _insecure(archive):
            raise bad(f"{where}.archive", f"{archive!r} is refused: {_HTTPS_ONLY}")
        if not isinstance(cmd, str) or not _inside(cmd) or PurePosixPath(cmd).name in ("", "."):
            raise bad(f"{where}.cmd", "must be a relative path to a file inside the archive")
        if sha256 is not None and not (isinstance(sha256, str)
                                       and re.fullmatch(r"[0-9a-fA-F]{64}", sha256)):
            raise bad(f"{where}.sha256", "must be 64 hex digits")
        if sha256 is None and not allow_unverified:
            raise bad(f"{where}.sha256", "is not declared: t3 runs a downloaded binary only "
                      "when its checksum is known (allow_unverified = true on the instance runs "
                      "it anyway)")
        args, env = _args_env(target, where, bad)
        return RegistryAgent(id=agent_id, name=display, version=version, kind="binary",
                             platform=platform_key, args=args, env=env, archive=archive, cmd=cmd,
                             sha256=sha256.lower() if sha256 else None)
    for kind, pattern in (("npx", _NPM_PACKAGE), ("uvx", _UV_PACKAGE)):
        spec = distribution.get(kind)
        if spec is None:
            continue
        where = f"distribution.{kind}"
        if not isinstance(spec, dict):
            raise bad(where, "must be an object")
        package = spec.get("package")
        if not isinstance(package, str) or not pattern.match(package):
            raise bad(f"{where}.package", f"is not a {kind} package name ({package!r})")
        args, env = _args_env(spec, where, bad)
        return RegistryAgent(id=agent_id, name=display, version=version, kind=kind,
                             platform=platform_key, args=args, env=env,
                             package=_pinned(kind, package, version))
    raise bad("distribution", f"declares no binary for {platform_key} and no npx or uvx package")


class AcpRegistryAdapter(AcpAdapter):
    """An agent named in an ACP registry: resolved, prepared into ``<data-dir>/agents/registry``
    and proven by a disposable ``session/new``, then run exactly as the ``acp`` driver."""

    def __init__(self, config: ProviderConfig, *, log_dir: Path, owner: str,
                 cache_dir: Path) -> None:
        super().__init__(config, log_dir=log_dir, owner=owner)
        self._cache_dir = cache_dir
        self._command_override = list(config.command)  # a local executable instead of ours
        self._env_configured = dict(config.env)
        self._lock = asyncio.Lock()
        self._prepared = not config.enabled  # a disabled instance has nothing to prepare
        reason = f"preparing {config.agent}" if config.enabled else "disabled in the configuration"
        self.info = replace(self.info, available=False, constraints=(reason,))

    async def prepare(self) -> None:
        """Resolve, install and probe the agent, once (a second caller waits for the first);
        afterwards ``info`` says whether the instance can run and, if not, why. Raises only
        on cancellation."""
        async with self._lock:
            if self._prepared:
                return
            try:
                agent = await self._install()
                models, capabilities = await self._probe()
            except Exception as exc:  # noqa: BLE001  # any failure is this instance's reason
                # shown to MCP callers; it may quote an installer's output
                reason = redact(str(exc) if isinstance(exc, RegistryError) else
                                f"ACP registry agent {self.config.agent} could not be prepared: "
                                f"{exc}")  # not "preparing ...": that is the in-progress state
                log.warning("provider %s unavailable: %s", self.info.instance_id, reason)
                self.info = replace(self.info, constraints=(reason,))
            else:
                log.info("provider %s ready: %s %s (%s)", self.info.instance_id, agent.id,
                         agent.version, agent.kind)
                self.info = replace(
                    self.info, available=True, constraints=(), capabilities=capabilities,
                    models=self.config.models or models)  # configured models win
            self._prepared = True

    async def open_session(self, **kwargs: Any) -> AcpSession:
        await self.prepare()
        return await super().open_session(**kwargs)

    async def _install(self) -> RegistryAgent:
        """Read the catalog, prepare the distribution, and set the command the sessions run."""
        assert self.config.agent is not None and self.config.registry is not None
        registry = await asyncio.to_thread(read_registry, self.config.registry)
        agent = select_agent(registry, self.config.agent, platform_key=registry_platform(),
                             # a configured command: nothing is downloaded, nothing to verify
                             allow_unverified=self.config.allow_unverified
                             or bool(self._command_override))
        self.info = replace(self.info, constraints=(f"preparing {agent.id} {agent.version}",))
        if self._command_override:
            executable = self._command_override
        else:
            async with _CACHE_LOCKS.setdefault(self._cache_dir, asyncio.Lock()):
                if agent.kind == "binary":
                    path = await asyncio.to_thread(_prepare_binary, agent, self._cache_dir)
                elif agent.kind == "npx":
                    path = await self._prepare_npx(agent)
                else:
                    path = await self._prepare_uvx(agent)
            executable = [str(path)]
        self.config.command = [*executable, *agent.args]
        self.config.env = {**agent.env, **self._env_configured}
        return agent

    async def _prepare_npx(self, agent: RegistryAgent) -> Path:
        """``npm install --prefix`` of the pinned package into its own cache directory (never
        global: the user's system stays as it was); its bin is then run directly, not via npx."""
        assert agent.package is not None
        npm = _installer("npm", "npm", agent)
        final = self._cache_dir / "npx" / _safe(agent.package)
        if not (final / _PREPARED).exists():
            partial = final.with_name(final.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            try:
                await self._run_installer(
                    [npm, "install", "--prefix", str(partial), "--no-audit", "--no-fund",
                     "--loglevel=error", agent.package], cwd=partial, env={})
                _npm_executable(partial, agent)
                (partial / _PREPARED).write_text(agent.package + "\n")
                shutil.rmtree(final, ignore_errors=True)
                os.rename(partial, final)  # npm's .bin links are relative: the move keeps them
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
        return _npm_executable(final, agent)

    async def _prepare_uvx(self, agent: RegistryAgent) -> Path:
        """``uv tool install`` with its tool and bin directories inside the cache. Installed in
        place (no rename): a tool environment records its absolute path."""
        assert agent.package is not None
        uv = _installer("uv", "uvx", agent)
        home = self._cache_dir / "uvx" / _safe(agent.package)
        if not (home / _PREPARED).exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            try:
                await self._run_installer(
                    [uv, "tool", "install", "--force", agent.package], cwd=home,
                    env={"UV_TOOL_DIR": str(home / "tools"), "UV_TOOL_BIN_DIR": str(home / "bin")})
                (home / _PREPARED).write_text(agent.package + "\n")
            except BaseException:
                shutil.rmtree(home, ignore_errors=True)
                raise
        bins = sorted((home / "bin").iterdir()) if (home / "bin").is_dir() else []
        wanted = re.split(r"[\[=@]", agent.package)[0]
        chosen = next((b for b in bins if b.name in (wanted, agent.id)), None) or \
            (bins[0] if len(bins) == 1 else None)
        if chosen is None:
            raise RegistryError(f"ACP registry agent {agent.id}: uv installed {len(bins)} "
                                f"executables for {agent.package} and none is named {wanted}")
        return chosen

    async def _run_installer(self, command: list[str], *, cwd: Path,
                             env: Mapping[str, str]) -> None:
        """Run npm or uv in its own process group (killed if t3 stops meanwhile) with ``env`` on
        top of the server's environment; its output goes to the protocol log, the end of its
        stderr into the error."""
        process = await self._spawn(command, str(cwd), env)
        try:
            out, err = await asyncio.wait_for(process.proc.communicate(), _INSTALL_TIMEOUT_S)
        except BaseException as exc:
            await process.stop(grace=0.0)
            if isinstance(exc, TimeoutError):
                raise RegistryError(f"{' '.join(command[1:3])} {command[-1]} did not finish "
                                    f"within {_INSTALL_TIMEOUT_S:.0f} s") from None
            raise
        for line in (out + err).decode(errors="replace").splitlines():
            self.protocol_log.write(f"install {line}")
        if process.proc.returncode != 0:
            tail = " / ".join(err.decode(errors="replace").strip().splitlines()[-3:])
            raise RegistryError(f"{Path(command[0]).name} {command[1]} {command[-1]} exited with "
                                f"code {process.proc.returncode}: {tail}")

    async def probe(self) -> None:
        """Nothing: preparing (started with the server) probes; an install is not waited for."""

    async def _probe(self) -> tuple[list[dict[str, Any]], Capabilities]:
        self._cache_dir.mkdir(parents=True, exist_ok=True)  # also with a configured command
        try:
            return await self._open_probe(str(self._cache_dir))
        except (JsonRpcError, ConnectionError, TimeoutError) as exc:
            raise RegistryError(f"ACP registry agent {self.config.agent} did not open a session "
                                f"(readiness check): {exc or type(exc).__name__}") from exc


def _installer(program: str, via: str, agent: RegistryAgent) -> str:
    if (found := shutil.which(program)) is None:
        raise RegistryError(f"ACP registry agent {agent.id} is distributed through {via}, "
                            f"and {program} is not installed")
    return found


def _args_env(spec: Mapping[str, Any], where: str, bad: Callable[[str, str], RegistryError]
              ) -> tuple[tuple[str, ...], dict[str, str]]:
    args, env = spec.get("args", []), spec.get("env", {})
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise bad(f"{where}.args", "must be a list of strings")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise bad(f"{where}.env", "must be an object of strings")
    return tuple(args), dict(env)


def _pinned(kind: str, package: str, version: str) -> str:
    """The package spec at an exact version: the registry's own pin, else the entry's version."""
    if kind == "npx":
        return package if "@" in package[1:] else f"{package}@{version}"
    name, _, pin = package.partition("@")
    return f"{name}=={pin}" if pin else package if "==" in package else f"{package}=={version}"


def _safe(name: str) -> str:
    """A package spec or id as one directory name."""
    return re.sub(r"[^A-Za-z0-9._@+=-]", "+", name).lstrip(".") or "_"


def _inside(name: str) -> bool:
    """A relative archive path that stays inside the directory it is unpacked into."""
    path = PurePosixPath(name.replace("\\", "/"))
    return not path.is_absolute() and ".." not in path.parts and not re.match(r"^[A-Za-z]:", name)


def _npm_executable(prefix: Path, agent: RegistryAgent) -> Path:
    """The installed package's bin: the only one, else the one named like the package or agent."""
    assert agent.package is not None
    name = agent.package[:agent.package.index("@", 1)] if "@" in agent.package[1:] \
        else agent.package
    try:
        manifest = json.loads((prefix / "node_modules" / name / "package.json").read_text())
    except (OSError, ValueError) as exc:
        raise RegistryError(f"ACP registry agent {agent.id}: npm installed no readable "
                            f"package.json for {name}: {exc}") from exc
    bins = manifest.get("bin")
    short = name.rsplit("/", 1)[-1]
    names = [short] if isinstance(bins, str) else list(bins) if isinstance(bins, dict) else []
    chosen = names[0] if len(names) == 1 else next((n for n in names if n in (short, agent.id)),
                                                  None)
    if chosen is None:
        raise RegistryError(f"ACP registry agent {agent.id}: {name} declares bins {names}, "
                            f"none named {short} or {agent.id}")
    return prefix / "node_modules" / ".bin" / chosen


def _prepare_binary(agent: RegistryAgent, cache_dir: Path) -> Path:
    """Download, verify and unpack a binary distribution into its versioned cache directory
    (once); returns its executable. Blocking: run it in a thread. A failure leaves nothing."""
    assert agent.archive is not None and agent.cmd is not None
    final = cache_dir / "bin" / _safe(agent.id) / _safe(agent.version) / agent.platform
    if (final / _PREPARED).exists():
        return final / agent.cmd
    partial = final.with_name(final.name + ".partial")
    download = final.with_name(final.name + ".download")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        digest = _download(agent.archive, download, agent.id)
        if agent.sha256 is None:  # select_agent let it through: allow_unverified
            log.warning("ACP registry agent %s: installing %s (sha256 %s) unverified: the "
                        "registry declares no sha256 and the instance allows that",
                        agent.id, agent.archive, digest)
        elif digest != agent.sha256:
            raise RegistryError(
                f"ACP registry agent {agent.id}: the archive {agent.archive} failed its checksum: "
                f"expected sha256 {agent.sha256}, got {digest}; nothing was installed")
        _unpack(download, partial, agent)
        executable = partial / agent.cmd
        if not executable.is_file():
            raise RegistryError(f"ACP registry agent {agent.id}: the archive {agent.archive} "
                                f"has no file {agent.cmd} (distribution.binary.{agent.platform}"
                                ".cmd)")
        executable.chmod(executable.stat().st_mode | 0o111)
        (partial / _PREPARED).write_text(json.dumps({"archive": agent.archive,
                                                     "sha256": digest}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        download.unlink(missing_ok=True)
        for directory in (final.parent, final.parent.parent):  # <agent>/<version>, if empty now
            with contextlib.suppress(OSError):
                directory.rmdir()
    return final / agent.cmd


def _download(url: str, into: Path, agent_id: str) -> str:
    """Stream ``url`` (``_open_url``) into a file; returns its sha256 (hex)."""
    digest = hashlib.sha256()
    try:
        with _open_url(url, f"ACP registry agent {agent_id}: the archive") as response, \
                open(into, "wb") as f:
            while chunk := response.read(1 << 16):
                digest.update(chunk)
                f.write(chunk)
    except (OSError, ValueError) as exc:
        raise RegistryError(f"ACP registry agent {agent_id}: cannot download {url}: {exc}") \
            from exc
    return digest.hexdigest()


_HTTPS_ONLY = "t3 downloads over https only; plain http only from this machine's loopback " \
    "(127.0.0.0/8, ::1, localhost)"


def _insecure(url: str) -> bool:
    """Not an https URL, nor an http one to this machine's loopback (tests, a local mirror)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        return not parts.hostname
    if parts.scheme != "http" or not parts.hostname:
        return True
    if parts.hostname == "localhost":
        return False
    try:
        return not ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:  # a host name
        return True


class _RedirectGuard(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to where t3 would download from anyway, and never from https
    down to http."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        from_https = urllib.parse.urlsplit(req.full_url).scheme == "https"
        if _insecure(newurl) or (from_https and urllib.parse.urlsplit(newurl).scheme != "https"):
            raise RegistryError(f"{req.full_url} redirects to {newurl}, refused: {_HTTPS_ONLY}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_RedirectGuard)


def _open_url(url: str, what: str) -> Any:
    """Open ``url`` for reading under t3's rule for downloads (``_insecure``, redirects too)."""
    if _insecure(url):
        raise RegistryError(f"{what} {url} is refused: {_HTTPS_ONLY}")
    return _OPENER.open(url, timeout=_NETWORK_TIMEOUT_S)


def _unpack(archive: Path, into: Path, agent: RegistryAgent) -> None:
    """Unpack a tar (any compression) or zip archive, refusing any member that would land
    outside ``into``; any other file is the executable itself."""
    assert agent.archive is not None and agent.cmd is not None
    url_path = urllib.parse.urlparse(agent.archive).path.lower()
    try:
        if url_path.endswith(_TAR_SUFFIXES):
            with tarfile.open(archive) as tar:
                _refuse_unsafe(agent, (m.name for m in tar.getmembers()))
                tar.extractall(into, filter="data")  # also refuses links leading outside
        elif url_path.endswith(".zip"):
            with zipfile.ZipFile(archive) as zipped:
                _refuse_unsafe(agent, zipped.namelist())
                zipped.extractall(into)
        else:
            (into / agent.cmd).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(archive, into / agent.cmd)
    except (tarfile.TarError, zipfile.BadZipFile) as exc:
        raise RegistryError(f"ACP registry agent {agent.id}: cannot unpack {agent.archive}: "
                            f"{exc}") from exc


def _refuse_unsafe(agent: RegistryAgent, names: Iterable[str]) -> None:
    for name in names:
        if not _inside(name):
            raise RegistryError(f"ACP registry agent {agent.id}: the archive {agent.archive} "
                                f"holds an unsafe path {name!r} (absolute or with ..); refused")
