"""Fixtures for t3's tests: a real `t3.py` process per test on a tmp data dir, with the scripted ACP
agent (tests/acp_agent.py) as its provider, and a sync MCP client for it.

Markers: `real_cli` (npm CLIs against the fake model server; run by CI), `soak` (long fault loops;
skipped unless selected with `-m soak`). Process hygiene: every process carrying the test's marker
(its tmp dir, in a command line or an environment) is killed at teardown, and a test that leaves a
child of the test runner alive fails.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from harness import ...` in any import mode

from fake_model import FakeModelServer  # noqa: E402
from harness import McpClient, T3Server, child_pids, kill_matching, pids_alive, wait_until, write_config  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_cli: drives the real npm agent CLIs against the fake model server")
    config.addinivalue_line("markers", "soak: long fault loops for bench/; skipped unless `-m soak`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="soak test: select with -m soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    """Fail a test that leaves a new child process of the test runner alive (it is killed first)."""
    before = set(child_pids())
    yield
    leaked = [p for p in child_pids() if p not in before]
    if not leaked:
        return
    try:
        wait_until(lambda: not pids_alive(leaked), 5.0, message="children exit")
    except TimeoutError:
        for pid in pids_alive(leaked):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        pytest.fail(f"test left child processes alive: {leaked}")


@pytest.fixture
def test_marker(tmp_path: Path) -> str:
    """A string found in the command line or environment of every process the test's server starts."""
    return f"{tmp_path}{os.sep}"


T3Factory = Callable[..., T3Server]


@pytest.fixture
def t3_factory(tmp_path: Path, test_marker: str) -> Iterator[T3Factory]:
    """`t3_factory(providers=, extra=, env=, config=, data_dir=, args=, start=True)` -> T3Server.
    Defaults: data dir `<tmp>/data`, config from `write_config(tmp_path, ...)`."""
    servers: list[T3Server] = []

    def make(*, providers: Sequence[Mapping[str, Any]] | None = None, extra: str = "",
             env: Mapping[str, str] | None = None, config: Path | None = None, data_dir: Path | None = None,
             args: Sequence[str] = (), start: bool = True) -> T3Server:
        if config is None:
            name = "t3.toml" if not servers else f"t3-{len(servers) + 1}.toml"
            config = write_config(tmp_path, providers=providers, extra=extra, name=name)
        server = T3Server(data_dir or tmp_path / "data", config, args=args,
                          env={"T3_TEST_MARKER": test_marker, **(env or {})})
        servers.append(server)
        return server.start() if start else server

    yield make
    for server in reversed(servers):
        server.close()
    kill_matching(test_marker)  # agents orphaned by a kill -9 of the server, or a server that leaked them


@pytest.fixture
def t3(t3_factory: T3Factory) -> T3Server:
    """A started server with the default config (project "proj", provider "scripted")."""
    return t3_factory()


@pytest.fixture
def mcp(t3: T3Server) -> McpClient:
    """An MCP client with the client token; it follows `t3.restart()` to the new port."""
    return t3.client()


@pytest.fixture
def agent_log_path(tmp_path: Path) -> Path:
    """The default scripted provider's JSONL log."""
    return tmp_path / "agent.log"


@pytest.fixture
def model() -> Iterator[FakeModelServer]:
    """The scripted fake model server real-CLI tests point their agents at."""
    with FakeModelServer(slow_delay=0.3) as server:
        yield server
