"""Fixtures for t3's tests: a real `t3.py` process per test on a tmp data dir, with the scripted ACP
agent (tests/acp_agent.py) as its provider, and a sync MCP client for it.

Markers: `real_cli` (npm CLIs against the fake model server; run by CI), `soak` (long fault loops;
skipped unless selected with `-m soak`), `postgres` (a throwaway PostgreSQL server), `both_stores`
(suites .ci/run runs again with T3_TEST_STORE=postgres: every server a test starts then runs on a
new PostgreSQL database; `sqlite_only` tests skip there, saying why).

Process hygiene: every process carrying the test's marker (its tmp dir, in a command line or an
environment) is killed at teardown, and a test that leaves a child of the test runner alive fails.
After the whole run, a process still carrying the run's `T3_TEST_SESSION=<id>` (set in os.environ
here, so inherited by every server, provider and subprocess the tests start) or living in a
process group a test's server used is killed, and the run fails naming it.

Network audit: a real_cli test runs its servers under strace (when installed; `T3_TEST_STRACE=0`
turns it off) and fails if t3 or an agent CLI sent anything to an address that is not this host
(real_cli.violations).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from harness import ...` in any import mode

import pg  # noqa: E402
from fake_model import FakeModelServer  # noqa: E402
from harness import (KEPT_MARKERS, McpClient, T3Server, child_pids, describe_process, kill_matching, leaked_processes,  # noqa: E402
                     mcp_results, output_problems, pids_alive, process_group, processes_matching, start_time,
                     wait_until, write_config)
from real_cli import Send, registry_hosts, strace_command, violations  # noqa: E402

import t3  # noqa: E402

t3.load_features()  # the core's tables as a server has them: feature modules register into them

SESSION_ENV = "T3_TEST_SESSION"
# T3_TEST_STORE=postgres: every server a test starts runs on a new PostgreSQL database (t3_factory)
TEST_STORE = os.environ.get("T3_TEST_STORE") or "sqlite"
ON_POSTGRES = TEST_STORE == "postgres"


def sqlite_only(why: str) -> pytest.MarkDecorator:
    """For a server test whose subject is the SQLite file itself: skipped, saying `why`, when
    T3_TEST_STORE=postgres runs the servers on PostgreSQL."""
    return pytest.mark.skipif(ON_POSTGRES, reason=f"SQLite only: {why}")


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform != "linux":  # README, Platforms: on macOS the portable path is tested here
        pytest.exit("t3's tests read /proc (process hygiene, environments, process groups): they "
                    "run on Linux, where T3_PORTABLE_PROCESSES=1 tests macOS's process rules")
    config.addinivalue_line("markers", "real_cli: drives the real npm agent CLIs against the fake model server")
    config.addinivalue_line("markers", "soak: long fault loops for bench/; skipped unless `-m soak`")
    config.addinivalue_line("markers", "postgres: runs against a throwaway PostgreSQL server "
                            "(tests/pg.py); skipped, saying why, without one")
    config.addinivalue_line("markers", "both_stores: the core, delegation and fault suites, which "
                            ".ci/run runs again with T3_TEST_STORE=postgres")
    if TEST_STORE not in ("sqlite", "postgres"):
        pytest.exit(f"T3_TEST_STORE={TEST_STORE}: the stores are sqlite (the default) and postgres")
    # Set before xdist starts its workers, so they and everything they start carry the same id.
    os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)


def _session_marker() -> str:
    return f"{SESSION_ENV}={os.environ[SESSION_ENV]}\0"  # the NUL ends the value in /proc/<pid>/environ


def _groups_file() -> Path:
    """Process groups the run's servers and providers used, one `<group> <leader start>` a line
    (appended by every worker, read by the controller at the end)."""
    return Path(tempfile.gettempdir()) / f"t3-test-{os.environ[SESSION_ENV]}" / "groups"


def _record_groups(marker: str) -> None:
    lines = {f"{g} {t}\n" for pid in processes_matching(marker)
             if (g := process_group(pid)) and (t := start_time(g)) is not None}
    _groups_file().parent.mkdir(exist_ok=True)
    with open(_groups_file(), "a") as f:
        f.writelines(sorted(lines))


def leftover_processes(*, exclude: Sequence[int] = ()) -> list[int]:
    """Live processes the run started, by its session marker or a recorded process group."""
    groups: dict[int, int] = {}
    try:
        for line in _groups_file().read_text().splitlines():
            group, started = map(int, line.split())
            groups[group] = started
    except (OSError, ValueError):
        pass
    return leaked_processes(_session_marker(), groups=groups, exclude=exclude)


@pytest.hookimpl(trylast=True)  # after xdist has stopped its workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run if a process it started is still alive (killed first)."""
    if hasattr(session.config, "workerinput"):
        return
    # The controller's children are its xdist workers (they carry the marker too); a process a
    # test leaked has been re-parented away from the controller.
    xdist = session.config.pluginmanager.has_plugin("dsession")
    leaked = leftover_processes(exclude=child_pids() if xdist else ())
    described = [describe_process(pid) for pid in leaked]
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(_groups_file().parent, ignore_errors=True)
    if leaked:
        print("\nprocesses started by the tests were still alive after the run (killed):\n  "
              + "\n  ".join(described), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = "soak" in (config.getoption("-m") or "")
    skip = pytest.mark.skip(reason="soak test: select with -m soak")
    # Under T3_TEST_STORE=postgres, a test that starts no server and opens no PostgreSQL store
    # would run exactly as the default tier runs it: it is left to that tier.
    same = pytest.mark.skip(reason="uses no server or store on the one T3_TEST_STORE chooses: "
                            "the default tier runs it")
    for item in items:
        if "soak" in item.keywords and not soak:
            item.add_marker(skip)
        names = getattr(item, "fixturenames", ())
        if ON_POSTGRES and item.get_closest_marker("postgres") is None \
                and not {"t3_factory", "new_store", "postgres_server"} & set(names):
            item.add_marker(same)


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    """Fail a test that leaves a new child process of the test runner alive (it is killed first)."""
    before = set(child_pids())
    yield
    kept = {pid for marker in KEPT_MARKERS for pid in processes_matching(marker)}
    leaked = [p for p in child_pids() if p not in before and p not in kept]
    if not leaked:
        return
    try:
        wait_until(lambda: not pids_alive(leaked), 5.0, message="children exit")
    except TimeoutError:
        for pid in pids_alive(leaked):
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):  # an asyncio child watcher reaped it
                os.waitpid(pid, 0)
        pytest.fail(f"test left child processes alive: {leaked}")


@pytest.fixture(autouse=True)
def _agents_got_declared_results(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test (its servers stopped), every answer of t3's tools that a scripted agent
    logged under its tmp_path fits the tool's output schema, or the typed failure's. (The SDK
    client checks the client token's calls itself; the agents' calls are checked here.)"""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path = request.getfixturevalue("tmp_path")
    yield
    problems = [p for e in mcp_results(tmp_path)
                for p in output_problems(e["tool"], e["result"], is_error=e["isError"])]
    if problems:
        pytest.fail("t3 answered an agent outside the tool's output schema:\n" + "\n".join(problems))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pg.PostgresServer]:
    """One throwaway PostgreSQL server per test worker (tests/pg.py); skips saying why without."""
    if (why := pg.unavailable()) is not None:
        pytest.skip(why)
    server = pg.PostgresServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: pg.PostgresServer) -> str:
    """The URL of a new, empty database on the worker's PostgreSQL server."""
    return postgres_server.database()


@pytest.fixture
def new_store(request: pytest.FixtureRequest) -> Iterator[Callable[[Path], Any]]:
    """`new_store(path)` -> a `store.Store` on a new database of the store T3_TEST_STORE chooses:
    `<path>/t3.sqlite`, or a new PostgreSQL database (so the test runs in the PostgreSQL tier
    too); every one closed at teardown."""
    import store
    opened: list[store.Store] = []

    def make(path: Path) -> store.Store:
        if ON_POSTGRES:
            url = request.getfixturevalue("postgres_server").database()  # or skip, saying why
            import store_pg
            opened.append(store.Store(store_pg.PostgresEngine(url)))
        else:
            opened.append(store.Store(path / "t3.sqlite", backups_dir=path / "backups"))
        return opened[-1]

    yield make
    for db in reversed(opened):
        db.close()


@pytest.fixture
def test_marker(tmp_path: Path) -> str:
    """A string found in the command line or environment of every process the test's server starts."""
    return f"{tmp_path}{os.sep}"


T3Factory = Callable[..., T3Server]


def _strace_wanted(request: pytest.FixtureRequest) -> bool:
    return (request.node.get_closest_marker("real_cli") is not None and shutil.which("strace") is not None
            and os.environ.get("T3_TEST_STRACE", "1") != "0")


@pytest.fixture
def t3_factory(tmp_path: Path, test_marker: str, request: pytest.FixtureRequest) -> Iterator[T3Factory]:
    """`t3_factory(providers=, extra=, env=, config=, data_dir=, args=, start=True)` -> T3Server.
    Defaults: data dir `<tmp>/data`, config from `write_config(tmp_path, ...)`. With
    T3_TEST_STORE=postgres each server gets a new PostgreSQL database (`--database`). In a real_cli test
    each server runs under strace into `<tmp>/net-<n>.strace`, audited at teardown."""
    servers: list[T3Server] = []
    traces: list[Path] = []

    def make(*, providers: Sequence[Mapping[str, Any]] | None = None, extra: str = "",
             env: Mapping[str, str] | None = None, config: Path | None = None, data_dir: Path | None = None,
             args: Sequence[str] = (), start: bool = True) -> T3Server:
        if config is None:
            name = "t3.toml" if not servers else f"t3-{len(servers) + 1}.toml"
            config = write_config(tmp_path, providers=providers, extra=extra, name=name)
        wrap: list[str] = []
        if _strace_wanted(request):
            traces.append(tmp_path / f"net-{len(servers) + 1}.strace")
            wrap = strace_command(traces[-1])
        if ON_POSTGRES and "--database" not in args:
            args = [*args, "--database", request.getfixturevalue("postgres_server").database()]
        server = T3Server(data_dir or tmp_path / "data", config, args=args, wrap=wrap,
                          env={"T3_TEST_MARKER": test_marker, **(env or {})})
        servers.append(server)
        return server.start() if start else server

    yield make
    _record_groups(test_marker)
    for server in reversed(servers):
        server.close()
    kill_matching(test_marker)  # agents orphaned by a kill -9 of the server, or a server that leaked them
    found = [v for trace in traces if trace.exists() for v in _audit(trace)]
    if found:
        pytest.fail("sent to an address that is not this host:\n" + "\n".join(v.line for v in found))


def _audit(trace: Path) -> list[Send]:
    lines = trace.read_text(errors="replace").splitlines()
    found = violations(lines)
    if found:  # only then ask npm and DNS which addresses the registry has
        registry, nameservers = registry_hosts()
        found = violations(lines, registry=registry, nameservers=nameservers)
    return found


@pytest.fixture(params=["linux", "portable"])
def process_rules(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment choosing a server's process rules, for the tests of orphans and crashes:
    the Linux path (PR_SET_PDEATHSIG, the /proc sweep), or the portable one every other system
    runs (records, watchers, ps) forced with T3_PORTABLE_PROCESSES=1."""
    return {"T3_PORTABLE_PROCESSES": "1" if request.param == "portable" else "0"}


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
