"""Security properties of the server (issue 10), one banner section per item: what reaches an
agent's environment and which processes a restart kills (7), what the logs redact (8), and where
acpRegistry downloads from (9). Real servers, agents and processes, as everywhere else."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import providers
from harness import ACP_AGENT, T3Server, agent_log, pids_alive, scripted_provider, wait_until
from real_cli import create, text, wait
from test_registry import ArchiveServer, binary_registry, registry_provider, settled

# ---- item 7: agents' environment

# t3's own variables, as a server started by someone who uses them (or a test) has them.
T3_OWN = {"T3_HOME": "/t3/home/elsewhere", "T3_TEST_HOOKS": "1", "T3_CRASH_AT": "never:reached",
          "T3_MAX_PAGE_COUNT": "1000000", "T3_MCP_URL": "http://127.0.0.1:9/not-this-session",
          "T3_MCP_BEARER_TOKEN": "not-this-session", "T3_OWNER": "/not/this/owner",
          "T3_SERVER_PID": "1", "T3_THREAD_ID": "not-this-thread"}
NEVER_PASSED_ON = ("T3_HOME", "T3_TEST_HOOKS", "T3_CRASH_AT", "T3_MAX_PAGE_COUNT", "T3_MCP_URL",
                   "T3_MCP_BEARER_TOKEN")


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process started with, from /proc."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def fake_npm(tmp_path: Path, body: str) -> dict[str, str]:
    """An `npm` first on PATH that runs the Python `body` (its environment dump goes to the file
    `dump`); the server environment that makes t3 find it."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    npm = bin_dir / "npm"
    npm.write_text(f"#!{sys.executable}\nimport json, os, sys\ndump = {str(tmp_path / 'npm-env.json')!r}\n"
                   + body)
    npm.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def npx_registry(tmp_path: Path) -> Path:
    path = tmp_path / "npx-registry.json"
    path.write_text(json.dumps({"version": "1.0.0", "agents": [
        {"id": "npx-agent", "name": "Npx agent", "version": "1.0.0", "description": "via npm",
         "distribution": {"npx": {"package": "@example/npx-agent-acp"}}}]}))
    return path


@pytest.fixture
def bystanders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts outside any server (each in its own session); killed and reaped
    at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(10)


def test_agent_environment_lacks_t3_variables_and_has_the_instance_env(t3_factory: Any,
                                                                         tmp_path: Path) -> None:
    """An agent gets none of t3's variables from the server's environment, and its instance env and session marker."""
    provider = scripted_provider(tmp_path, env={"INSTANCE_ONLY": "from-config"})
    t3 = t3_factory(providers=[provider], env=T3_OWN)
    mcp = t3.client()
    created = create(mcp, "ECHO_ENV")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    env = json.loads(text(mcp, created["threadId"]))
    assert [name for name in NEVER_PASSED_ON if name in env] == []
    assert env["T3_OWNER"] == str(t3.data_dir.resolve())
    assert env["T3_SERVER_PID"] == str(t3.pid)
    assert env["T3_THREAD_ID"] == created["threadId"]
    assert env["INSTANCE_ONLY"] == "from-config"
    assert env["T3_TEST_SESSION"] == os.environ["T3_TEST_SESSION"]
    assert env["T3_TEST_MARKER"] == t3.env["T3_TEST_MARKER"]


def test_installer_environment_lacks_t3_variables(t3_factory: Any, tmp_path: Path) -> None:
    """npm, run by acpRegistry, gets none of t3's variables from the server's environment, and the owner marker."""
    env = {**T3_OWN, **fake_npm(tmp_path, "open(dump, 'w').write(json.dumps(dict(os.environ)))\n"
                                          "sys.exit(1)\n")}
    t3 = t3_factory(providers=[registry_provider(npx_registry(tmp_path), agent="npx-agent")],
                    env=env)
    [reason] = settled(t3.client())["constraints"]
    assert "exited with code 1" in reason, reason
    installer_env = json.loads((tmp_path / "npm-env.json").read_text())
    assert [name for name in NEVER_PASSED_ON if name in installer_env] == []
    assert installer_env["T3_OWNER"] == str(t3.data_dir.resolve())
    assert installer_env["T3_SERVER_PID"] == str(t3.pid)
    assert installer_env["T3_TEST_SESSION"] == os.environ["T3_TEST_SESSION"]


def test_a_bystander_naming_the_owner_survives_a_restart(t3: T3Server, agent_log_path: Path,
                                                         bystanders: list[subprocess.Popen[bytes]]) -> None:
    """A restart kills an orphan with the entry T3_OWNER=<dir>, not a bystander with FOO=T3_OWNER=<dir>."""
    mcp = t3.client()
    created = create(mcp, "DETACH")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    [orphan] = [e["detachedPid"] for e in agent_log(agent_log_path) if e["dir"] == "detached"]
    owner = environ_of(orphan)["T3_OWNER"]
    assert owner == str(t3.data_dir.resolve())
    bystander = subprocess.Popen(["sleep", "300"], env={**os.environ, "FOO": f"T3_OWNER={owner}"},
                                 start_new_session=True)
    bystanders.append(bystander)
    t3.stop()
    assert pids_alive([orphan]), "the orphan outlived its server (so only the restart can kill it)"
    t3.start()
    wait_until(lambda: not pids_alive([orphan]), 10, message="the restart killed the orphan")
    assert bystander.poll() is None and pids_alive([bystander.pid])


def test_test_hooks_do_nothing_without_the_switch(t3_factory: Any) -> None:
    """T3_CRASH_AT and T3_MAX_PAGE_COUNT do nothing without T3_TEST_HOOKS=1; with it the crash happens."""
    t3 = t3_factory(env={"T3_CRASH_AT": "commit:after-receipt", "T3_MAX_PAGE_COUNT": "1"},
                    start=False)
    t3.env.pop("T3_TEST_HOOKS", None)
    t3.start()
    mcp = t3.client()
    created = create(mcp, "hello")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    sent = mcp.call("t3_thread_send", {"threadId": created["threadId"], "message": "big " * 25_000})
    assert sent.ok, sent.structured
    assert wait(mcp, created["threadId"])["status"] == "completed"
    assert t3.running

    t3.stop()
    t3.env["T3_TEST_HOOKS"] = "1"
    t3.env.pop("T3_MAX_PAGE_COUNT")
    t3.start()
    try:
        mcp.call("create_threads", {"threads": [{"prompt": "never recorded"}]}, timeout=30)
    except Exception:  # the server died mid-call; what the client sees varies by SDK layer
        pass
    wait_until(lambda: not t3.running, 30, message="the armed server crashed at its first commit")
    assert t3.returncode == -signal.SIGKILL


# ---- item 8: redaction

SECRET = "sk-9f8e7d6c5b4a"
R = "<redacted>"
# (a line as a provider, an installer or t3 itself may write it, the line redacted); None: the
# line with only SECRET replaced, so everything around it is kept as it was.
REDACTED_FORMS = [
    (f"stderr: using Bearer {SECRET} for the call", None),
    (f"bearer {SECRET}", None),
    (f"BEARER {SECRET}, then more", None),
    (f"GET /mcp?auth=Bearer%20{SECRET} HTTP/1.1", None),
    (f"GET /mcp?auth=Bearer+{SECRET}&x=1 HTTP/1.1", None),
    (f'{{"text":"Bearer\\u0020{SECRET}"}}', None),
    (f"Authorization: Basic {SECRET}", None),
    (f"authorization: bearer {SECRET}", None),
    (f"AUTHORIZATION: Digest {SECRET}", None),
    (f"Proxy-Authorization: {SECRET}", None),
    (f"X-Api-Key: {SECRET}", None),
    (f"T3_MCP_BEARER_TOKEN={SECRET} pi --mode rpc", None),
    (f'export T3_MCP_BEARER_TOKEN="{SECRET}"', None),
    (f"npm ERR! //registry.example/:_authToken={SECRET}", None),
    (f"https://example.test/cb?access_token={SECRET}&state=1", None),
    (f'{{"env":{{"T3_MCP_BEARER_TOKEN":"{SECRET}","HOME":"/h"}}}}', None),
    (f'{{"token":"{SECRET}"}}', None),
    (f'{{"bearer_token": "{SECRET}"}}', None),
    (f'{{"apiKey":"{SECRET}","model":"m"}}', None),
    (f'{{"api_key":"{SECRET}"}}', None),
    (f'{{"X-API-KEY":"{SECRET}"}}', None),
    (f'{{"password":"{SECRET}","user":"u"}}', None),
    (f'{{"client_secret" : "{SECRET}"}}', None),
    (f"{{'api_key': '{SECRET}'}}", None),
    (f'{{"headers":{{"Authorization":"Bearer {SECRET}"}}}}', f'{{"headers":{{"Authorization":"{R}"}}}}'),
    (f'{{"authorization":"Basic {SECRET}"}}', f'{{"authorization":"{R}"}}'),
    (f'{{"headers":[{{"name":"Authorization","value":"Basic {SECRET}"}}]}}',
     f'{{"headers":[{{"name":"Authorization","value":"{R}"}}]}}'),
    (f'{{"headers":[{{"name":"x-api-key","value":"{SECRET}"}}]}}', None),
    (f'{{"rawInput":"{{\\"Authorization\\": \\"Basic {SECRET}\\"}}"}}',
     f'{{"rawInput":"{{\\"Authorization\\": \\"{R}\\"}}"}}'),
    (f'{{"rawInput":"{{\\"token\\":\\"{SECRET}\\"}}"}}', None),
    (f'{{"text":"curl -H \\"Authorization: Bearer {SECRET}\\" http://x"}}', None),
    (f'{{"password":"{SECRET}', None),  # a line cut short inside the value
    (f"İİ ünïcode before Bearer {SECRET} and after", None),  # lower() would change the length
]
KEPT = ['{"max_tokens": 100, "input_tokens": 5, "tokenizer": "bpe"}', "max_tokens=100",
        "if token == expected:", '{"token_type":"Bearer","expires_in":3600}',
        "the cupbearer keeps bearer_tokens", '{"name":"color","value":"red"}',
        '{"passwordless":"yes","keyboard":"us"}', "a key point about secrets and passwords",
        '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"1 "}}']


@pytest.mark.parametrize("line, redacted", REDACTED_FORMS, ids=range(len(REDACTED_FORMS)))
def test_redact_blanks_every_form_of_a_secret_and_keeps_the_rest(line: str, redacted: str | None) -> None:
    """Each form of a credential is blanked out and the text around it is kept exactly."""
    assert providers.redact(line) == (redacted or line.replace(SECRET, R))
    assert SECRET not in providers.redact(line)


@pytest.mark.parametrize("line", KEPT)
def test_redact_keeps_lines_without_a_secret(line: str) -> None:
    """Lines that only mention secret-like words (token counts, a token type) come out unchanged."""
    assert providers.redact(line) == line


def test_what_providers_logs_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """What providers.py's logger logs (an agent's error text) is redacted before any handler sees it."""
    with caplog.at_level(logging.INFO, logger="t3.providers"):
        providers.log.warning("session/load of %s failed (%s)", "s-1",
                              f"rejected header Authorization: Bearer {SECRET}")
    assert "rejected header Authorization: Bearer <redacted>" in caplog.text
    assert SECRET not in caplog.text


def test_an_installers_secret_is_redacted_in_the_reason_and_the_logs(t3_factory: Any,
                                                                     tmp_path: Path) -> None:
    """Credentials in npm's output are blanked in the instance's reason, the server log and the traffic log."""
    body = (f"print('npm ERR! //registry.example/:_authToken={SECRET}', file=sys.stderr)\n"
            f"print('npm ERR! Authorization: Bearer {SECRET}', file=sys.stderr)\nsys.exit(1)\n")
    t3 = t3_factory(providers=[registry_provider(npx_registry(tmp_path), agent="npx-agent")],
                    env=fake_npm(tmp_path, body))
    [reason] = settled(t3.client())["constraints"]
    assert "_authToken=<redacted>" in reason and "Authorization: Bearer <redacted>" in reason
    traffic = t3.data_dir / "logs" / "provider-reg.log"
    wait_until(lambda: "Bearer <redacted>" in traffic.read_text(), 10, message="traffic logged")
    wait_until(lambda: "provider reg unavailable" in t3.stderr_text(), 10, message="logged")
    assert SECRET not in reason + traffic.read_text() + t3.stderr_text()


# ---- item 9: acpRegistry

ELSEWHERE = "http://192.0.2.1"  # TEST-NET-1: not this machine; refused before any connection


@pytest.fixture
def archive_server() -> Iterator[ArchiveServer]:
    server = ArchiveServer()
    yield server
    server.close()


def constraints_once_prepared(mcp: Any, instance_id: str) -> list[str]:
    """An instance's constraints once its preparation ended ([] when it is ready)."""
    def ended() -> tuple[list[str]] | None:
        found = next(p for p in mcp.call("orchestrator_capabilities", {}).structured["providers"]
                     if p["providerInstanceId"] == instance_id)
        done = not any(c.startswith("preparing") for c in found["constraints"])
        return (found["constraints"],) if done else None
    return wait_until(ended, 120, interval=0.2, message=f"{instance_id} prepared")[0]


@pytest.mark.parametrize("url, refused", [
    ("https://cdn.example/registry.json", False), ("http://127.0.0.1:8080/r.json", False),
    ("http://127.3.4.5/a.tar.gz", False), ("http://[::1]:8080/a.zip", False),
    ("http://localhost:8080/r.json", False), (f"{ELSEWHERE}/r.json", True),
    ("http://example.com/r.json", True), ("http://127.0.0.1.example.com/r.json", True),
    ("http://user@127.0.0.1@example.com/r.json", True), ("http://[::ffff:127.0.0.1]/r.json", True),
    ("http://0.0.0.0/r.json", True), ("ftp://127.0.0.1/r.json", True), ("file:///etc/hosts", True),
    ("https:///no-host", True)])
def test_downloads_need_https_or_loopback_http(url: str, refused: bool) -> None:
    """The download rule: https anywhere, plain http only to 127.0.0.0/8, ::1 or localhost."""
    assert providers._insecure(url) is refused


def test_a_registry_over_http_from_another_host_is_refused(t3_factory: Any) -> None:
    """A registry URL with plain http to another host is refused, unfetched, as the instance's reason."""
    mcp = t3_factory(providers=[registry_provider(f"{ELSEWHERE}/registry.json")]).client()
    [reason] = settled(mcp)["constraints"]
    assert reason.startswith(f"the ACP registry {ELSEWHERE}/registry.json is refused: t3 "
                             "downloads over https only"), reason


def test_an_archive_over_http_from_another_host_is_refused(t3_factory: Any, tmp_path: Path,
                                                           archive_server: ArchiveServer) -> None:
    """An archive with plain http to another host is refused naming the field; nothing is downloaded."""
    url = f"{ELSEWHERE}/scripted.tar.gz"
    registry = binary_registry(tmp_path, archive_server, archive_url=url)
    t3 = t3_factory(providers=[registry_provider(registry)])
    [reason] = settled(t3.client())["constraints"]
    assert f".archive: '{url}' is refused: t3 downloads over https only" in reason, reason
    assert archive_server.requests == {}
    assert not (t3.data_dir / "agents/registry/bin").exists()


def test_a_redirect_to_plain_http_elsewhere_is_refused(t3_factory: Any, tmp_path: Path,
                                                       archive_server: ArchiveServer) -> None:
    """A redirect from loopback to plain http elsewhere is refused; one staying on loopback is followed."""
    away, home = tmp_path / "away", tmp_path / "home"
    away.mkdir()
    home.mkdir()
    archive_server.redirects["/away.tar.gz"] = f"{ELSEWHERE}/scripted.tar.gz"
    archive_server.redirects["/home.tar.gz"] = archive_server.url("/scripted.tar.gz")
    refused = binary_registry(away, archive_server, archive_url=archive_server.url("/away.tar.gz"))
    followed = binary_registry(home, archive_server, archive_url=archive_server.url("/home.tar.gz"))
    mcp = t3_factory(providers=[registry_provider(refused),
                                {**registry_provider(followed), "id": "reg2"}]).client()
    [reason] = constraints_once_prepared(mcp, "reg")
    assert f"redirects to {ELSEWHERE}/scripted.tar.gz, refused: t3 downloads over https only" \
        in reason, reason
    assert constraints_once_prepared(mcp, "reg2") == []


def test_a_redirect_never_goes_from_https_down_to_http() -> None:
    """From https, a redirect to plain http is refused even to loopback; to https it is followed."""
    guard, request = providers._RedirectGuard(), urllib.request.Request("https://cdn.example/r")
    with pytest.raises(providers.RegistryError, match="redirects to http://127.0.0.1/r, refused"):
        guard.redirect_request(request, None, 302, "Found", {}, "http://127.0.0.1/r")
    followed = guard.redirect_request(request, None, 302, "Found", {}, "https://mirror.example/r")
    assert followed is not None and followed.full_url == "https://mirror.example/r"


def test_a_binary_without_sha256_is_refused(t3_factory: Any, tmp_path: Path,
                                            archive_server: ArchiveServer) -> None:
    """A binary distribution without a declared sha256 is refused, naming allow_unverified, undownloaded."""
    registry = binary_registry(tmp_path, archive_server, with_sha256=False)
    [reason] = settled(t3_factory(providers=[registry_provider(registry)]).client())["constraints"]
    assert ".sha256: is not declared" in reason and "allow_unverified = true" in reason, reason
    assert archive_server.requests == {}


def test_allow_unverified_admits_a_binary_without_sha256(t3_factory: Any, tmp_path: Path,
                                                         archive_server: ArchiveServer) -> None:
    """With allow_unverified = true a binary without sha256 is installed (logged) and the instance runs."""
    registry = binary_registry(tmp_path, archive_server, with_sha256=False)
    t3 = t3_factory(providers=[registry_provider(registry, allow_unverified=True)])
    ready = settled(t3.client())
    assert ready["canRunChildTask"] and ready["constraints"] == [], ready
    assert archive_server.requests == {"/scripted.tar.gz": 1}
    wait_until(lambda: "unverified" in t3.stderr_text(), 10, message="the install was logged")


def test_a_local_command_needs_no_sha256(t3_factory: Any, tmp_path: Path,
                                         archive_server: ArchiveServer) -> None:
    """An instance with its own command downloads nothing, so a missing sha256 does not stop it."""
    registry = binary_registry(tmp_path, archive_server, with_sha256=False)
    provider = registry_provider(registry, command=[sys.executable, str(ACP_AGENT)])
    ready = settled(t3_factory(providers=[provider]).client())
    assert ready["canRunChildTask"] and ready["constraints"] == [], ready
    assert archive_server.requests == {}
