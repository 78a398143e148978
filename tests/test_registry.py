"""The `acpRegistry` driver end to end: a registry JSON names an agent, t3 prepares its
distribution into `<data-dir>/agents/registry` (a binary archive served over real HTTP here; the
npm package of a real ACP agent in the real_cli tier) and then runs it as the `acp` driver."""

from __future__ import annotations

import hashlib
import io
import json
import platform
import sys
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import ACP_AGENT, McpClient, ServerStartError, T3Server, agent_log, wait_until
from real_cli import AGENTS, create, npm_available, text, wait

AGENT_ID = "scripted"
AGENT_VERSION = "1.2.3"
LAUNCHER = "scripted-agent/bin/launch"


class ArchiveServer:
    """Serves files over HTTP on 127.0.0.1, counting requests per path; a path can be held
    (the response waits while `gate` is clear) to observe an instance while it is preparing, or
    redirect (302) to another URL (`redirects`)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.requests: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                owner.requests[self.path] = owner.requests.get(self.path, 0) + 1
                owner.gate.wait(60)
                if self.path in owner.redirects:
                    self.send_response(302)
                    self.send_header("Location", owner.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = owner.files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self) -> None:
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def archives() -> Iterator[ArchiveServer]:
    server = ArchiveServer()
    yield server
    server.close()


def this_platform() -> str:
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                       platform.machine().lower())
    return f"{ {'win32': 'windows'}.get(sys.platform, sys.platform)}-{arch}"


def launcher_archive() -> bytes:
    """A tar.gz whose launcher execs the scripted ACP agent with the registry's arguments."""
    script = f'#!/bin/sh\nexec "{sys.executable}" "{ACP_AGENT}" "$@"\n'.encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        member = tarfile.TarInfo(LAUNCHER)
        member.size, member.mode = len(script), 0o644  # t3 marks cmd executable itself
        tar.addfile(member, io.BytesIO(script))
    return buffer.getvalue()


def binary_registry(tmp_path: Path, archives: ArchiveServer, *, sha256: str | None = None,
                    archive: bytes | None = None, archive_url: str | None = None,
                    with_sha256: bool = True) -> Path:
    """A registry file declaring the scripted agent (or `archive`) as this platform's binary
    distribution, served at `/scripted.tar.gz` (declared at `archive_url` if given), with the
    archive's true checksum unless `sha256` says otherwise, or none without `with_sha256`."""
    archive = archive or launcher_archive()
    archives.files["/scripted.tar.gz"] = archive
    target = {"archive": archive_url or archives.url("/scripted.tar.gz"), "cmd": f"./{LAUNCHER}",
              "args": ["--state-dir", str(tmp_path / "agent-state")],
              "env": {"SCRIPTED_AGENT_LOG": str(tmp_path / "agent.log")}}
    if with_sha256:
        target["sha256"] = sha256 or hashlib.sha256(archive).hexdigest()
    registry = {"version": "1.0.0", "agents": [
        {"id": "other", "name": "Other", "version": "0.1.0", "description": "not this one",
         "distribution": {"npx": {"package": "@example/other-acp"}}},
        {"id": AGENT_ID, "name": "Scripted", "version": AGENT_VERSION,
         "description": "tests/acp_agent.py behind a launcher",
         "distribution": {"binary": {this_platform(): target, "plan9-mips": target}}}]}
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(registry))
    return path


def registry_provider(registry: Path | str, agent: str = AGENT_ID, **extra: Any) -> dict[str, Any]:
    return {"id": "reg", "driver": "acpRegistry", "agent": agent, "registry": str(registry),
            **extra}


def instance(mcp: McpClient, instance_id: str = "reg") -> dict[str, Any]:
    providers = mcp.call("orchestrator_capabilities", {}).structured["providers"]
    return next(p for p in providers if p["providerInstanceId"] == instance_id)


def settled(mcp: McpClient, *, timeout: float = 120.0) -> dict[str, Any]:
    """The instance once its preparation ended (ready, or unavailable with its reason)."""
    def ended() -> dict[str, Any] | None:
        found = instance(mcp)
        return None if any(c.startswith("preparing") for c in found["constraints"]) else found
    return wait_until(ended, timeout, interval=0.2, message="preparation ended")


def cache_files(server: T3Server) -> list[Path]:
    return [p for p in (server.data_dir / "agents" / "registry").rglob("*") if p.is_file()]


def test_binary_agent_prepares_then_runs_a_turn(tmp_path: Path, t3_factory: Any,
                                                archives: ArchiveServer) -> None:
    """The server is up while the archive downloads (instance unavailable, "preparing"); once
    verified and unpacked the agent's own models are listed and a thread completes a turn with
    the registry's args and env applied."""
    registry = binary_registry(tmp_path, archives)
    archives.gate.clear()  # hold the download
    server = t3_factory(providers=[registry_provider(registry)])
    mcp = server.client()
    wait_until(lambda: archives.requests.get("/scripted.tar.gz"), 30, message="download started")
    preparing = instance(mcp)
    assert not preparing["canRunChildTask"]
    assert preparing["constraints"] == [f"preparing {AGENT_ID} {AGENT_VERSION}"]
    refused = mcp.call("create_threads", {"threads": [
        {"prompt": "too early", "target": {"providerInstanceId": "reg"}}]})
    assert refused.failure_code == "provider_unavailable"

    archives.gate.set()
    ready = settled(mcp)
    assert ready["canRunChildTask"] and ready["constraints"] == [], ready
    assert [m["id"] for m in ready["models"]] == ["scripted-1", "scripted-2"]
    created = create(mcp, "hello registry", target={"providerInstanceId": "reg"})
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert text(mcp, created["threadId"]) == "Hello from scripted agent. You said: hello registry"
    prompts = [e for e in agent_log(tmp_path / "agent.log")  # the registry's env reached it
               if e["msg"].get("method") == "session/prompt"]
    assert len(prompts) == 1
    assert (tmp_path / "agent-state").is_dir()  # the registry's args reached the agent
    installed = server.data_dir / "agents/registry/bin" / AGENT_ID / AGENT_VERSION / this_platform()
    assert (installed / LAUNCHER).is_file() and (installed / ".t3-prepared").is_file()


def test_checksum_mismatch_is_refused(tmp_path: Path, t3_factory: Any,
                                      archives: ArchiveServer) -> None:
    """A wrong declared sha256 leaves the instance unavailable with both digests named,
    creating a thread there is provider_unavailable, and nothing is left in the cache."""
    wrong = "0" * 64
    registry = binary_registry(tmp_path, archives, sha256=wrong)
    actual = hashlib.sha256(archives.files["/scripted.tar.gz"]).hexdigest()
    server = t3_factory(providers=[registry_provider(registry)])
    mcp = server.client()
    failed = settled(mcp)
    assert not failed["canRunChildTask"]
    [reason] = failed["constraints"]
    assert "checksum" in reason and wrong in reason and actual in reason, reason
    refused = mcp.call("create_threads", {"threads": [
        {"prompt": "x", "target": {"providerInstanceId": "reg"}}]})
    assert refused.failure_code == "provider_unavailable"
    assert "checksum" in refused.structured["message"]
    assert cache_files(server) == []
    assert not (server.data_dir / "agents/registry/bin" / AGENT_ID).exists()


def test_unsafe_archive_is_refused(tmp_path: Path, t3_factory: Any,
                                   archives: ArchiveServer) -> None:
    """An archive member with `..` is refused before anything is unpacked: the instance is
    unavailable naming the path, nothing lands outside (or inside) the cache."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in (LAUNCHER, "../../../../escaped.txt"):
            member = tarfile.TarInfo(name)
            member.size = 2
            tar.addfile(member, io.BytesIO(b"x\n"))
    registry = binary_registry(tmp_path, archives, archive=buffer.getvalue())
    server = t3_factory(providers=[registry_provider(registry)])
    [reason] = settled(server.client())["constraints"]
    assert "unsafe path '../../../../escaped.txt'" in reason, reason
    assert not list(tmp_path.rglob("escaped.txt")) and cache_files(server) == []


def test_unknown_agent_is_named(tmp_path: Path, t3_factory: Any, archives: ArchiveServer) -> None:
    """An agent id the registry does not list leaves the instance unavailable with a reason
    naming the id and the agents the registry does list; nothing is downloaded."""
    registry = binary_registry(tmp_path, archives)
    mcp = t3_factory(providers=[registry_provider(registry, agent="missing-agent")]).client()
    failed = settled(mcp)
    assert not failed["canRunChildTask"]
    assert failed["constraints"] == [
        "agent 'missing-agent' is not in the ACP registry (it lists: other, scripted)"]
    assert archives.requests == {}


def test_registry_over_http_and_cache_reuse(tmp_path: Path, t3_factory: Any,
                                            archives: ArchiveServer) -> None:
    """The registry is read from an http URL; a restarted server reuses the prepared cache
    (the archive is downloaded once) and the instance is ready again."""
    archives.files["/registry.json"] = binary_registry(tmp_path, archives).read_bytes()
    server = t3_factory(providers=[registry_provider(archives.url("/registry.json"))])
    mcp = server.client()
    assert settled(mcp)["canRunChildTask"]
    assert server.stop() == 0
    server.start()
    assert settled(mcp)["canRunChildTask"]
    assert archives.requests == {"/registry.json": 2, "/scripted.tar.gz": 1}


def test_registry_keys_are_checked(tmp_path: Path, t3_factory: Any) -> None:
    """acpRegistry without `agent` stops startup naming the key; `agent` on another driver too."""
    for entry, key in (({"id": "reg", "driver": "acpRegistry", "registry": "r.json"}, "agent"),
                       ({"id": "a", "driver": "acp", "command": ["x"], "agent": "y"}, "agent")):
        server = t3_factory(providers=[entry], start=False)
        with pytest.raises(ServerStartError, match=rf"providers\[0\]\.{key}"):
            server.start()


# ---------------------------------------------------------------- real_cli tier


@pytest.mark.real_cli
@pytest.mark.skipif(not npm_available(), reason="npm is not installed")
def test_npx_agent_through_fake_model(tmp_path: Path, t3_factory: Any,
                                      model: FakeModelServer) -> None:
    """A registry npx distribution of claude-agent-acp (the version pinned in agents.json) is
    npm-installed into t3's own cache, proven by session/new, and completes a text turn."""
    spec = AGENTS["claude-agent-acp"]
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"version": "1.0.0", "agents": [
        {"id": "claude-acp", "name": "Claude Agent", "version": spec["version"],
         "description": "claude-agent-acp",
         "distribution": {"npx": {"package": f"{spec['package']}@{spec['version']}"}}}]}))
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache"), "IS_SANDBOX": "1",
           "ANTHROPIC_BASE_URL": model.url, "ANTHROPIC_API_KEY": "fake-key",
           "CLAUDE_CONFIG_DIR": str(home / "claude"), "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    server = t3_factory(providers=[{**registry_provider(registry, agent="claude-acp"),
                                    "env": env}])
    mcp = server.client()
    ready = settled(mcp, timeout=900)
    assert ready["canRunChildTask"], ready
    prefix = server.data_dir / "agents/registry/npx" / \
        f"{spec['package'].replace('/', '+')}@{spec['version']}"
    assert (prefix / "node_modules/.bin" / spec["bin"]).exists()
    created = create(mcp, "say hi", target={"providerInstanceId": "reg"})
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert "Hello from fake model. You said: say hi" in text(mcp, created["threadId"])
