"""The checks that guard every test run can fail: the end-of-run process scan (conftest.py) finds
a process the run started and left alive, and the network audit (real_cli.violations) flags a
send to any address that is not this host."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from conftest import SESSION_ENV
from harness import leaked_processes, pids_alive, process_group, start_time, wait_until
from real_cli import sends, violations


@pytest.fixture
def sleeper() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A `sleep` in its own session carrying a fresh run marker, as a leaked server would; its
    session keeps it away from the test's own child check, and it is reaped here."""
    session = uuid.uuid4().hex
    proc = subprocess.Popen(["sleep", "600"], env={**os.environ, SESSION_ENV: session},
                            start_new_session=True)
    yield proc, f"{SESSION_ENV}={session}\0"
    proc.kill()
    proc.wait(10)


def test_leak_check_finds_a_marked_process(sleeper: tuple[subprocess.Popen[bytes], str]) -> None:
    """A live process carrying the run marker is reported; once it is gone, nothing is."""
    proc, marker = sleeper
    # Until the child has exec'd, /proc shows its parent's environment (without the marker).
    wait_until(lambda: leaked_processes(marker) == [proc.pid], 10)
    proc.kill()
    proc.wait(10)
    assert leaked_processes(marker) == []


def test_leak_check_finds_a_process_in_a_recorded_group() -> None:
    """A process without the marker (an agent's child with a clean environment) is reported when
    it lives in a process group the run recorded; another marker finds nothing."""
    proc = subprocess.Popen(["sleep", "600"], env={"PATH": os.environ["PATH"]}, start_new_session=True)
    try:
        wait_until(lambda: process_group(proc.pid) == proc.pid, 10)
        started = start_time(proc.pid)
        assert started is not None
        assert leaked_processes("no-such-marker\0", groups={proc.pid: started}) == [proc.pid]
        assert leaked_processes("no-such-marker\0", groups={proc.pid: started + 1}) == []
        assert leaked_processes("no-such-marker\0") == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert not pids_alive([proc.pid])


TRACE = """\
4101  connect(7, {sa_family=AF_INET, sin_port=htons(41234), sin_addr=inet_addr("127.0.0.1")}, 16) = -1 EINPROGRESS (Operation now in progress)
4101  connect(8, {sa_family=AF_INET6, sin6_port=htons(41234), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = 0
4102  sendto(9, "x", 1, 0, {sa_family=AF_INET6, sin6_port=htons(9), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = 1
4102  connect(10, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT (No such file or directory)
4102  sendto(11, "GET / HTTP/1.1", 14, MSG_NOSIGNAL, NULL, 0) = 14
4103  connect(12, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("203.0.113.9")}, 16 <unfinished ...>
4104  sendmsg(13, {msg_name={sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.53")}, msg_namelen=16, msg_iov=[{iov_base="q", iov_len=1}], msg_iovlen=1, msg_controllen=0, msg_flags=0}, 0) = 1
4103  <... connect resumed>) = -1 EINPROGRESS (Operation now in progress)
4105  connect(14, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), inet_pton(AF_INET6, "2001:db8::7", &sin6_addr), sin6_scope_id=0}, 28) = -1 ENETUNREACH (Network is unreachable)
""".splitlines()


def test_network_audit_flags_remote_sends_only() -> None:
    """Loopback (IPv4, IPv6, v4-mapped), AF_UNIX and address-less sends pass; a connect to a remote
    IPv4 or IPv6 address and DNS to a nameserver are violations."""
    assert [(s.call, s.address, s.port) for s in sends(TRACE)] == [
        ("connect", "127.0.0.1", 41234), ("connect", "::1", 41234), ("sendto", "::ffff:127.0.0.1", 9),
        ("connect", "203.0.113.9", 443), ("sendmsg", "10.0.0.53", 53), ("connect", "2001:db8::7", 443)]
    assert [(s.pid, s.address) for s in violations(TRACE)] == [
        (4103, "203.0.113.9"), (4104, "10.0.0.53"), (4105, "2001:db8::7")]


def test_network_audit_allows_the_registry_and_its_dns() -> None:
    """The npm registry's address is allowed, and DNS to this host's nameserver with it; DNS to
    another server, or DNS with no registry connection, is still a violation."""
    registry = [("203.0.113.9", 443)]
    assert [s.address for s in violations(TRACE, registry=registry, nameservers=["10.0.0.53"])] == \
        ["2001:db8::7"]
    assert [s.address for s in violations(TRACE, registry=registry, nameservers=["10.9.9.9"])] == \
        ["10.0.0.53", "2001:db8::7"]
    without_registry = [line for line in TRACE if "203.0.113.9" not in line]
    assert [s.address for s in violations(without_registry, registry=registry, nameservers=["10.0.0.53"])] == \
        ["10.0.0.53", "2001:db8::7"]


def test_the_repository_tracks_no_built_artefacts() -> None:
    """Wheels, archives and shared objects stay out of git: the repository holds the project."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout.decode().split("\0")
    built = [f for f in tracked if f.endswith((".whl", ".tar.gz", ".zip", ".so", ".pyc"))]
    assert built == []


CORE = ("store", "orchestrator", "tools", "providers", "workspace")
FEATURES = ("schedules", "history", "metadata", "drivers", "registry", "cli", "store_pg", "links")


def test_the_core_imports_no_feature_module() -> None:
    """store, orchestrator, tools, providers and workspace import none of the feature modules
    (they plug into the core's tables when t3.py loads them), so an auditor of the core reads
    only the core; every feature module is one t3.py knows how to load."""
    import ast

    import t3
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in CORE:
        with open(os.path.join(root, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & set(FEATURES), (name, imported & set(FEATURES))
    assert set(t3.FEATURES) <= set(FEATURES)
