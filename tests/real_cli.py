"""The real agent CLIs for `real_cli` tests: pinned in tests/agents.json, installed with
`npm install --prefix` into a cache directory (reused when present), each run with its state in
a temp directory and its model replaced by tests/fake_model.py.

    python tests/real_cli.py install [name ...]    # what .ci/run does before the tests
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["AGENTS", "cache_dir", "installed", "ensure_installed", "npm_available",
           "acp_provider", "claude_provider", "codex_provider", "pi_provider", "opencode_provider",
           "create", "wait", "text", "Send", "strace_command", "sends", "violations", "registry_hosts"]

AGENTS: dict[str, dict[str, str]] = json.loads(
    (Path(__file__).resolve().parent / "agents.json").read_text())


def cache_dir() -> Path:
    root = os.environ.get("T3_AGENTS_CACHE") or str(Path.home() / ".cache" / "t3-test-agents")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prefix(name: str) -> Path:
    spec = AGENTS[name]
    return cache_dir() / f"{name}-{spec['version']}"


def installed(name: str) -> Path | None:
    binary = _prefix(name) / "node_modules" / ".bin" / AGENTS[name]["bin"]
    return binary if binary.exists() else None


def npm_available() -> bool:
    return shutil.which("npm") is not None


def ensure_installed(name: str) -> Path:
    """The CLI's executable, installing the pinned version first if needed (one installer at a
    time across test workers)."""
    found = installed(name)
    if found:
        return found
    spec = AGENTS[name]
    with open(cache_dir() / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = installed(name)
        if found:
            return found
        prefix = _prefix(name)
        partial = prefix.with_name(prefix.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        subprocess.run(["npm", "install", "--prefix", str(partial), "--no-audit", "--no-fund",
                        "--loglevel=error", f"{spec['package']}@{spec['version']}"],
                       check=True, timeout=900)
        shutil.rmtree(prefix, ignore_errors=True)
        partial.rename(prefix)  # only a complete install is ever seen as installed
    found = installed(name)
    if found is None:
        raise RuntimeError(f"{spec['package']}@{spec['version']} installed no {spec['bin']}")
    return found


# ---------------------------------------------------------------- `[[providers]]` entries
# Each runs one CLI with its state under tmp (HOME and the XDG dirs) and its model replaced by
# the fake model at `model_url`, with the settings research/agents.md found to keep it offline.

def _home(tmp_path: Path, name: str) -> tuple[Path, dict[str, str]]:
    home = tmp_path / f"{name}-home"
    home.mkdir(parents=True, exist_ok=True)
    return home, {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                  "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
                  "XDG_STATE_HOME": str(home / ".local/state")}


def _codex_home(home: Path, model_url: str, settings: str = "") -> Path:
    codex_home = home / "codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "fake-model"\nmodel_provider = "fake"\n{settings}\n'
        '[model_providers.fake]\nname = "Fake"\n'
        f'base_url = "{model_url}/v1"\nwire_api = "responses"\n\n'
        "[features]\nplugins = false\napps = false\nremote_plugin = false\n")
    return codex_home


def acp_provider(name: str, tmp_path: Path, model_url: str) -> dict[str, Any]:
    """The `acp` driver running claude-agent-acp, codex-acp or gemini --acp (instance "agent")."""
    binary = str(ensure_installed(name))
    home, env = _home(tmp_path, name)
    if name == "claude-agent-acp":
        env |= {"IS_SANDBOX": "1", "ANTHROPIC_BASE_URL": model_url,
                "ANTHROPIC_API_KEY": "fake-key", "CLAUDE_CONFIG_DIR": str(home / "claude"),
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1",
                # Its SDK (Claude Code 2.1.83) fetches the plugin blocklist from
                # raw.githubusercontent.com despite the settings above; only bare mode skips it.
                "CLAUDE_CODE_SIMPLE": "1"}
        command = [binary]
    elif name == "codex-acp":
        codex_home = _codex_home(home, model_url, 'approval_policy = "untrusted"\n'
                                                  'sandbox_mode = "danger-full-access"\n')
        env |= {"CODEX_HOME": str(codex_home)}
        command = [binary]
    elif name == "gemini":
        settings = home / ".gemini"
        settings.mkdir()
        (settings / "settings.json").write_text(json.dumps({
            "security": {"auth": {"selectedType": "gemini-api-key"},
                         "folderTrust": {"enabled": False}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}))
        env |= {"GEMINI_CLI_HOME": str(home), "GEMINI_API_KEY": "fake-key",
                "GOOGLE_GEMINI_BASE_URL": model_url}
        command = [binary, "--acp", "--model", "gemini-2.5-pro"]
    else:
        raise ValueError(f"no ACP agent named {name}")
    return {"id": "agent", "driver": "acp", "command": command, "env": env}


def claude_provider(tmp_path: Path, model_url: str) -> dict[str, Any]:
    """The `claudeAgent` driver running `claude -p` over stream-json (instance "claude")."""
    home, _ = _home(tmp_path, "claude")
    return {"id": "claude", "driver": "claudeAgent",
            "command": [str(ensure_installed("claude")), "-p", "--input-format", "stream-json",
                        "--output-format", "stream-json", "--verbose",
                        "--permission-prompt-tool", "stdio"],
            "env": {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / "claude"),
                    "ANTHROPIC_BASE_URL": model_url, "ANTHROPIC_API_KEY": "fake-key",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                    "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                    # The fake model cannot search deferred tools: offer MCP tools directly.
                    "ENABLE_TOOL_SEARCH": "false",
                    "IS_SANDBOX": "1"},
            "models": ["claude-sonnet-4-5"]}


def codex_provider(tmp_path: Path, model_url: str) -> dict[str, Any]:
    """The `codex` driver running `codex app-server` (instance "codex"; thread/start overrides
    the approval policy and sandbox, research/agents.md 2.1)."""
    home, env = _home(tmp_path, "codex")
    env |= {"CODEX_HOME": str(_codex_home(home, model_url))}
    return {"id": "codex", "driver": "codex", "env": env,
            "command": [str(ensure_installed("codex")), "app-server"]}


def pi_provider(tmp_path: Path, model_url: str) -> dict[str, Any]:
    """The `pi` driver running `pi --mode rpc` (instance "pi"), its model faked through
    `$PI_CODING_AGENT_DIR/models.json` (research/agents.md 5)."""
    home, env = _home(tmp_path, "pi")
    agent_dir = home / "pi-agent"
    agent_dir.mkdir()
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"fake": {
        "baseUrl": f"{model_url}/v1", "api": "openai-completions", "apiKey": "fake-key",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": "fake-model", "name": "Fake", "reasoning": False, "input": ["text"],
                    "contextWindow": 128000, "maxTokens": 8000,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}]}}}))
    env |= {"PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1"}
    return {"id": "pi", "driver": "pi", "env": env, "command": [
        str(ensure_installed("pi")), "--mode", "rpc", "--provider", "fake", "--model", "fake-model"]}


def opencode_provider(tmp_path: Path, model_url: str) -> dict[str, Any]:
    """The `opencode` driver running `opencode serve` (instance "opencode"; sessions live in its
    XDG data dir) with a fake Chat Completions provider (research/agents.md 6)."""
    _, env = _home(tmp_path, "opencode")
    config = {"provider": {"fake": {
        "npm": "@ai-sdk/openai-compatible", "name": "Fake",
        "options": {"baseURL": f"{model_url}/v1", "apiKey": "fake-key"},
        "models": {"fake-model": {"name": "Fake model", "tool_call": True}}}},
        "model": "fake/fake-model"}
    env |= {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    return {"id": "opencode", "driver": "opencode", "env": env,
            "command": [str(ensure_installed("opencode")), "serve"]}


# ---------------------------------------------------------------- driving t3 in real-CLI tests

def create(mcp: Any, prompt: str, **entry: Any) -> dict[str, Any]:
    """create_threads with one prompt; the created thread."""
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: Any, thread_id: str, **args: Any) -> dict[str, Any]:
    """t3_thread_wait with room for a real CLI's slow start."""
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 120_000, **args},
                      timeout=180)
    assert result.ok, result.structured
    return result.structured


def text(mcp: Any, thread_id: str) -> str:
    """The thread's assistant text, oldest first."""
    page = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1,
                                       "limit": 100}).structured
    return "\n".join(i["text"] or "" for i in page["items"] if i["type"] == "assistant_message")


# ---------------------------------------------------------------- network audit (strace)
# A real_cli test runs t3 under strace (`strace_command`), which records every connect/send of t3
# and of each agent CLI it starts; `violations` lists the destinations that were not local.

_TRACED = "connect,sendto,sendmsg,sendmmsg"
_INET = re.compile(r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), '
                   r'(?:sin6_flowinfo=htonl\(\d+\), )?'
                   r'(?:sin_addr=inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)")')
_CALL = re.compile(r"^(\d+)\s+(\w+)\(")


@dataclass(frozen=True, slots=True)
class Send:
    """One connect or send to an IP address, as strace recorded it."""
    pid: int
    call: str
    address: str
    port: int
    line: str

    @property
    def local(self) -> bool:
        ip = ipaddress.ip_address(self.address.split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback or ip.is_unspecified  # 0.0.0.0 and :: reach this host


def strace_command(trace: Path) -> list[str]:
    """The command prefix recording, into `trace` (appended), the connects and sends of a process
    and all its descendants (seccomp-bpf: only these calls stop the tracee)."""
    return ["strace", "-f", "--seccomp-bpf", "-qq", "-e", f"trace={_TRACED}", "-e", "signal=none",
            "-A", "-o", str(trace)]


def sends(lines: Iterable[str]) -> list[Send]:
    """The IPv4/IPv6 destinations in strace output lines (AF_UNIX and AF_NETLINK are local)."""
    found = []
    for line in lines:
        call = _CALL.match(line)
        for m in _INET.finditer(line):
            if call:
                found.append(Send(int(call[1]), call[2], m[2] or m[3], int(m[1]), line.rstrip()))
    return found


def violations(lines: Iterable[str], *, registry: Iterable[tuple[str, int]] = (),
               nameservers: Iterable[str] = ()) -> list[Send]:
    """The sends to anything but this host. Allowed too: the npm registry's `(address, port)`s
    (an acpRegistry install), and DNS to `nameservers` in a trace that also reached the registry."""
    remote = [s for s in sends(lines) if not s.local]
    allowed = set(registry)
    if any((s.address, s.port) in allowed for s in remote):
        allowed |= {(n, 53) for n in nameservers}
    return [s for s in remote if (s.address, s.port) not in allowed]


@functools.cache
def registry_hosts() -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """The npm registry's `(address, port)`s and this host's DNS nameservers."""
    url = "https://registry.npmjs.org/"
    if npm_available():
        url = subprocess.run(["npm", "config", "get", "registry"], capture_output=True,
                             text=True, timeout=60).stdout.strip() or url
    parts = urlsplit(url)
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        found = {(str(info[4][0]), port) for info in socket.getaddrinfo(parts.hostname, port)}
    except OSError:
        found = set()
    try:
        resolv = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        resolv = []
    servers = tuple(w[1] for w in (line.split() for line in resolv) if len(w) > 1 and w[0] == "nameserver")
    return tuple(sorted(found)), servers


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"]:
        print(__doc__, file=sys.stderr)
        return 2
    for name in argv[1:] or list(AGENTS):
        print(f"{name}: {ensure_installed(name)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
