"""The README's "Use t3 from your MCP client" recipes, run against a real t3 server (the scripted
ACP agent as its provider) by the real clients pinned in tests/agents.json: the MCP Inspector CLI
(its `--strict` schema portability report, calls, looping waits), Claude Code (`claude mcp add
--transport http ... --header`, the `--mcp-config` JSON, `-p` with and without `--allowedTools
mcp__t3`) and Codex (`[mcp_servers.t3]` with `url` and `bearer_token_env_var`, `codex exec`,
`default_tools_approval_mode` for t3's destructive tools); and the Python SDK snippet, taken from
the README itself (default tier: the SDK is a dependency, not an npm CLI).

Claude Code and Codex talk to tests/fake_model.py, whose `CALL_MCP <tool> <json>` line makes the
client call one of t3's tools and answer `TOOL_RESULT_SEEN: <what the tool returned>`. Each
client keeps its state (HOME, CLAUDE_CONFIG_DIR, CODEX_HOME) in the test's temp directory and
runs under strace like t3 itself: a send to an address that is not this host fails the test.
The commands differ from the README's only in the server's URL (`--port 0`) and in naming the
pinned executables.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import REPO, McpClient, T3Server
from real_cli import (claude_provider, codex_provider, ensure_installed, npm_available,
                      strace_command, violations)


def real_cli(test: Any) -> Any:
    return pytest.mark.real_cli(pytest.mark.skipif(not npm_available(),
                                                   reason="npm is not installed")(test))

README_URL = "http://127.0.0.1:3773/mcp"


@dataclass
class Clients:
    """A started t3, the fake model, and a way to run a pinned client CLI against them."""
    t3: T3Server
    mcp: McpClient
    model: FakeModelServer
    tmp_path: Path
    traces: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.t3.mcp_url

    def run(self, name: str, args: Sequence[str], *, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """Run the pinned CLI `name` with `args` in `<tmp>/work`, under strace when present."""
        wrap: list[str] = []
        if shutil.which("strace") and os.environ.get("T3_TEST_STRACE", "1") != "0":
            self.traces.append(self.tmp_path / f"client-{len(self.traces) + 1}.strace")
            wrap = strace_command(self.traces[-1])
        work = self.tmp_path / "work"
        work.mkdir(exist_ok=True)
        return subprocess.run([*wrap, str(ensure_installed(name)), *args], cwd=work,
                              env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def thread(self, title: str) -> str:
        """A new idle thread's id (made with the SDK client)."""
        made = self.mcp.call("create_threads", {"threads": [{"title": title}]})
        return str(made.structured["threads"][0]["threadId"])

    def titles(self) -> list[str]:
        listed = self.mcp.call("t3_thread_list", {"limit": 100}).structured
        return [t["title"] for t in listed["threads"]]


@pytest.fixture
def clients(t3_factory: Any, model: FakeModelServer, tmp_path: Path) -> Iterator[Clients]:
    t3 = t3_factory()
    found = Clients(t3, t3.client(), model, tmp_path)
    yield found
    sent = [v for trace in found.traces if trace.exists()
            for v in violations(trace.read_text(errors="replace").splitlines())]
    assert not sent, "a client sent to an address that is not this host:\n" + "\n".join(
        v.line for v in sent)


# ---------------------------------------------------------------- the MCP Inspector CLI

def inspector(clients: Clients, *args: str) -> subprocess.CompletedProcess[str]:
    """`npx @modelcontextprotocol/inspector --cli <url> --transport http --header ... ARGS`
    (the pinned install instead of npx), its state in the temp directory."""
    home = clients.tmp_path / "inspector-home"
    home.mkdir(exist_ok=True)
    return clients.run("inspector", [
        "--cli", clients.url, "--transport", "http",
        "--header", f"Authorization: Bearer {clients.t3.token}", *args],
        env={"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")})


def inspector_call(clients: Clients, tool: str, arguments: dict[str, Any]
                   ) -> tuple[int, dict[str, Any]]:
    done = inspector(clients, "--method", "tools/call", "--tool-name", tool,
                     "--tool-args-json", json.dumps(arguments), "--format", "json")
    return done.returncode, json.loads(done.stdout)["result"]


@real_cli
def test_inspector_strict_tools_list_is_clean(clients: Clients) -> None:
    """The Inspector's `tools/list --strict` finds no schema portability problem at all (no
    error, no warning), and lists every tool with an outputSchema."""
    done = inspector(clients, "--method", "tools/list", "--strict", "--format", "json")
    assert done.returncode == 0, done.stderr
    envelope = json.loads(done.stdout)
    assert "schemaFindings" not in envelope, json.dumps(envelope.get("schemaFindings"), indent=1)
    assert "portability" not in done.stderr, done.stderr
    tools = envelope["result"]["tools"]
    assert sorted(t["name"] for t in tools) == sorted(clients.mcp.list_tools())
    assert all(t["outputSchema"]["type"] == "object" for t in tools)


@real_cli
def test_inspector_calls_and_loops_a_wait(clients: Clients) -> None:
    """Through the Inspector (which checks each success against the tool's outputSchema): a
    thread is created, waited on in short waits until its run ends (each under the Inspector's
    60 s cut-off), and a typed failure arrives with isError and its structuredContent."""
    code, made = inspector_call(clients, "create_threads",
                                {"threads": [{"prompt": "SLOW:200 through the inspector"}]})
    assert code == 0 and not made["isError"], made
    thread_id = made["structuredContent"]["threads"][0]["threadId"]
    waits = []
    while not waits or waits[-1]["timedOut"]:
        code, waited = inspector_call(clients, "t3_thread_wait",
                                      {"threadId": thread_id, "timeoutMs": 2_000})
        assert code == 0, waited
        waits.append(waited["structuredContent"])
        assert len(waits) < 60, waits
    assert waits[-1]["status"] == "completed" and len(waits) > 1, waits
    code, failed = inspector_call(clients, "t3_thread_read", {"threadId": "thread:none"})
    assert code != 0 and failed["isError"], failed  # the CLI exits non-zero on isError
    assert failed["structuredContent"] == {
        "_tag": "OrchestratorMcpFailure", "code": "thread_not_found",
        "message": "thread thread:none was not found"}


# ---------------------------------------------------------------- Claude Code

def claude_env(clients: Clients, **extra: str) -> dict[str, str]:
    """Claude Code with its state in the temp directory and the fake model as its API."""
    return {**claude_provider(clients.tmp_path, clients.model.url)["env"], **extra}


@real_cli
def test_claude_code_mcp_add(clients: Clients) -> None:
    """`claude mcp add --scope user --transport http t3 <url> --header "Authorization: Bearer
    <token>"` connects; `claude -p` calls t3's tools with `--allowedTools mcp__t3`, and is
    refused them without it."""
    env = claude_env(clients)
    thread_id = clients.thread("seen by claude")
    added = clients.run("claude", ["mcp", "add", "--scope", "user", "--transport", "http", "t3",
                                   clients.url, "--header",
                                   f"Authorization: Bearer {clients.t3.token}"], env=env)
    assert added.returncode == 0, added.stderr
    listed = clients.run("claude", ["mcp", "list"], env=env)
    assert re.search(rf"t3: {re.escape(clients.url)} \(HTTP\) - \S+ Connected", listed.stdout), \
        listed.stdout
    allowed = clients.run("claude", ["-p", "CALL_MCP t3_thread_list",
                                     "--allowedTools", "mcp__t3"], env=env)
    assert "TOOL_RESULT_SEEN" in allowed.stdout and thread_id in allowed.stdout, allowed
    refused = clients.run("claude", ["-p", "CALL_MCP t3_thread_list"], env=env)
    assert "permissions to use mcp__t3__t3_thread_list" in refused.stdout, refused
    assert thread_id not in refused.stdout, refused


@real_cli
def test_claude_code_mcp_config(clients: Clients) -> None:
    """`claude -p --mcp-config t3.json --allowedTools mcp__t3`, the JSON naming the token as
    ${T3_TOKEN}: Claude Code creates a thread in t3 and reads it back."""
    config = clients.tmp_path / "work" / "t3.json"
    config.parent.mkdir(exist_ok=True)
    config.write_text(json.dumps({"mcpServers": {"t3": {
        "type": "http", "url": clients.url,
        "headers": {"Authorization": "Bearer ${T3_TOKEN}"}}}}))
    env = claude_env(clients, T3_TOKEN=clients.t3.token)
    prompt = 'CALL_MCP create_threads {"threads": [{"title": "made by claude"}]}'
    made = clients.run("claude", ["-p", prompt, "--mcp-config", str(config),
                                  "--allowedTools", "mcp__t3"], env=env)
    assert "TOOL_RESULT_SEEN" in made.stdout and '"title":"made by claude"' in made.stdout, made
    assert "made by claude" in clients.titles()


# ---------------------------------------------------------------- Codex

def codex_env(clients: Clients, server: str) -> dict[str, str]:
    """Codex with its state in the temp directory, the fake model as its provider, and
    `server` (an `[mcp_servers.t3]` table) appended to its config.toml. (`codex exec` looks up
    ab.chatgpt.com for its analytics unless they are off.)"""
    env = codex_provider(clients.tmp_path, clients.model.url)["env"]
    config = Path(env["CODEX_HOME"]) / "config.toml"
    config.write_text(config.read_text() + "\n[analytics]\nenabled = false\n\n" + server)
    return {**env, "T3_TOKEN": clients.t3.token}


def codex_exec(clients: Clients, prompt: str, env: dict[str, str]) -> str:
    done = clients.run("codex", ["exec", "--skip-git-repo-check", prompt], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@real_cli
def test_codex_mcp_servers(clients: Clients) -> None:
    """`[mcp_servers.t3]` with `url` and `bearer_token_env_var = "T3_TOKEN"`: `codex exec` calls
    a read-only tool; a destructive one needs approval, which exec cannot ask for, until
    `default_tools_approval_mode = "approve"`."""
    server = (f'[mcp_servers.t3]\nurl = "{clients.url}"\n'
              'bearer_token_env_var = "T3_TOKEN"\n')
    env = codex_env(clients, server)
    thread_id = clients.thread("seen by codex")
    listed = clients.run("codex", ["mcp", "list"], env=env)
    assert re.search(rf"t3\s+{re.escape(clients.url)}\s+T3_TOKEN\s+enabled", listed.stdout), \
        listed.stdout
    assert thread_id in codex_exec(clients, "CALL_MCP t3_thread_list", env)
    create = 'CALL_MCP create_threads {"threads": [{"title": "made by codex"}]}'
    refused = codex_exec(clients, create, env)
    assert "requires approval" in refused and "made by codex" not in clients.titles(), refused
    approved = codex_env(clients, server + 'default_tools_approval_mode = "approve"\n')
    assert '"title":"made by codex"' in codex_exec(clients, create, approved)
    assert "made by codex" in clients.titles()


# ---------------------------------------------------------------- the Python SDK

def readme_python_recipe() -> str:
    """The Python block of the README's "Use t3 from your MCP client" section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use t3 from your MCP client", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0]


def test_python_sdk_recipe(t3: T3Server) -> None:
    """The README's Python SDK snippet, as written but for the URL, creates a thread and loops
    short waits until its run ends, printing the run's status."""
    script = readme_python_recipe()
    assert README_URL in script
    done = subprocess.run([sys.executable, "-c", script.replace(README_URL, t3.mcp_url)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "T3_TOKEN": t3.token})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "completed", done.stdout
