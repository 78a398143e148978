"""Fuzzing the MCP surface of one real server (reliability test 9): every tool's arguments, valid,
boundary and invalid, generated from the tools' own JSON schemas (tools.TOOLS) plus hand-written
invalid variants, sent over real MCP HTTP; and raw HTTP at /mcp (malformed JSON-RPC, batches,
wrong methods, content types and headers, oversized bodies).

Properties: the server never crashes, never answers 5xx or a traceback; a call either succeeds or
is a typed failure with a known code; a failed call writes nothing (the event log does not grow);
an invalid argument is `invalid_request` naming the field; every answer's structuredContent
validates (jsonschema, the validator the SDK client uses) against the tool's success output
schema or the failure schema, and against the outputSchema tools/list publishes; no published
schema uses a JSON-Schema `type` array.

Speed: one server per module (per xdist worker); the seed is fixed (derandomize). CI runs
FUZZ_EXAMPLES cases per tool and variant over HTTP. The soak mode,
`T3_FUZZ_IN_PROCESS=1 T3_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py`, sends the tool
fuzzers' calls to the same layers in process (InProcessTarget; about 6 cases/s over HTTP on 2
cores, 30 to 100 in process) and keeps the raw HTTP fuzzers on a real server.
Valid `create_threads` / `t3_thread_launch` calls carry no prompt (a run per fuzz case would start
thousands of agent processes); sends go to a few seeded threads, whose runs are waited out before
the next case so that the event log is quiet when a failed call is checked.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import os
import sqlite3
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from harness import (
    KEPT_MARKERS,
    T3Server,
    ToolResult,
    kill_matching,
    output_problems,
    raw_request,
    wait_until,
    write_config,
)
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import providers
import t3
import tools
from orchestrator import CONTROL_CHARACTERS, Orchestrator
from orchestrator import T3Error as ToolFailure
from store import Store
from tools import (
    FAILURE_CODES,
    TOOLS,
    Project,
    Scope,
    ServerContext,
    Toolkit,
    current_scope,
)

FUZZ_EXAMPLES = int(os.environ.get("T3_FUZZ_EXAMPLES", "12"))
IN_PROCESS = os.environ.get("T3_FUZZ_IN_PROCESS") == "1"
# Derandomized (one fixed seed per test) unless T3_FUZZ_SEED names another one: a second soak
# round then draws other cases, as reproducible.
FUZZ_SEED = os.environ.get("T3_FUZZ_SEED")
_FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, derandomize=FUZZ_SEED is None,
                          deadline=None, database=None, suppress_health_check=list(HealthCheck))


def FUZZ(test: Callable[..., None]) -> Callable[..., None]:  # noqa: N802 - reads as a decorator
    return _FUZZ_SETTINGS(seed(int(FUZZ_SEED))(test) if FUZZ_SEED else test)
SCHEMAS = {tool.name: tool.input_schema for tool in TOOLS}
# Tools whose success can set a seeded thread's run going (valid creates and launches carry no
# prompt, and seeded threads never ask for approval).
STARTS_WORK = {"t3_thread_send", "t3_thread_interrupt"}
# Fields left out of valid cases: they would start a provider run (and process) per case.
NO_RUNS = {("create_threads", "prompt"), ("t3_thread_launch", "message")}
JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object")


# ---------------------------------------------------------------- the server under fuzz

class Target:
    """Where the tool fuzzers' calls go, its seeded threads and a view of its event log."""

    db_path: Path

    def call(self, tool: str, args: dict[str, Any], *, timeout: float = 120) -> ToolResult:
        raise NotImplementedError

    def seed(self) -> None:
        created = self.call("create_threads", {"threads": [
            {"prompt": "hello", "title": "seeded with a run"}, {"title": "idle one"},
            {"title": "idle two"}]}).structured["threads"]
        self.thread_ids = [t["threadId"] for t in created]
        self.run_ids = [created[0]["runId"]]
        self.settle()

    @functools.cached_property
    def _reader(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, isolation_level=None,
                               check_same_thread=False)

    def events(self) -> int:
        return self._reader.execute("SELECT COALESCE(MAX(sequence), 0) FROM events").fetchone()[0]

    def settle(self, thread_ids: list[str] | None = None) -> None:
        """Wait until the seeded threads' latest runs have ended, so no writes are in flight."""
        for thread_id in self.thread_ids if thread_ids is None else thread_ids:
            result = self.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 60_000},
                               timeout=90)
            assert result.ok and not result.structured["timedOut"], result.structured


class HttpTarget(Target):
    """The module's real server, over MCP HTTP (what CI fuzzes), and raw HTTP at /mcp."""

    def __init__(self, server: T3Server) -> None:
        self.server = server
        self.db_path = server.data_dir / "t3.sqlite"
        self.mcp = server.client()
        self.seed()

    def call(self, tool: str, args: dict[str, Any], *, timeout: float = 120) -> ToolResult:
        return self.mcp.call(tool, args, timeout=timeout)

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.server.token}", "Content-Type": "application/json",
                "Accept": "application/json, text/event-stream", **extra}


class InProcessTarget(Target):
    """Soak mode (T3_FUZZ_IN_PROCESS=1): a server's layers built as t3.py builds them (Store,
    Orchestrator with its effect worker and the scripted agent, Toolkit), on an event loop in a
    thread of this process. A call goes where the MCP handler sends it, under the scope the client
    token resolves to, and is shaped by the same tools._result. Only HTTP and the MCP SDK are left
    out (the HTTP fuzzers cover them), which makes a case about 20 times cheaper."""

    def __init__(self, tmp: Path) -> None:
        config = t3.load_config(write_config(tmp), cwd=tmp)
        data_dir = tmp / "data"
        for sub in ("logs", "backups", "scratch", "worktrees", "agents", "processes"):
            (data_dir / sub).mkdir(parents=True, exist_ok=True)
        self.db_path = data_dir / "t3.sqlite"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

        async def build() -> None:
            self.store = Store(self.db_path, backups_dir=data_dir / "backups")
            credentials = t3.Credentials(max_lifetime_s=3600, idle_s=3600,
                                         mcp_url="http://127.0.0.1:9/mcp")
            self.scope = Scope(kind="client", key="client")  # what the client token resolves to
            self.adapters = adapters = t3.build_adapters(config, data_dir, providers)
            self.orch = Orchestrator(self.store, adapters=adapters, credentials=credentials,
                                     providers=t3._LiveProviderInfo(adapters))
            await self.store.sync_projects(config.projects)
            self.orch.start()
            self.toolkit = Toolkit(self.orch, self.store, ServerContext(
                environment_id="env-fuzz", data_dir=data_dir,
                projects=[Project(p["id"], p["path"], p["title"]) for p in config.projects]))
        self._run(build(), 60)
        self.seed()

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, tool: str, args: dict[str, Any], *, timeout: float = 120) -> ToolResult:
        async def handle() -> ToolResult:
            current_scope.set(self.scope)  # this task's context only
            try:
                shaped = tools._result(await self.toolkit.call(tool, args), is_error=False)
            except ToolFailure as failure:
                shaped = tools.failure_result(failure.code, str(failure))
            except Exception:  # noqa: BLE001 - the MCP handler makes this orchestration_error
                shaped = tools.failure_result("orchestration_error", traceback.format_exc())
            text = shaped.content[0].text
            return ToolResult(json.loads(text), shaped.is_error, text, shaped)
        return self._run(handle(), timeout)

    def close(self) -> None:
        async def stop() -> None:
            self.orch.begin_shutdown()
            await self.orch.close()
            for adapter in self.adapters.values():
                adapter.close()
            self.store.close()
        try:
            self._run(stop(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture(scope="module")
def http_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpTarget]:
    tmp = tmp_path_factory.mktemp("fuzz")
    marker = f"{tmp}{os.sep}"
    server = T3Server(tmp / "data", write_config(tmp), env={"T3_TEST_MARKER": marker}).start()
    try:
        yield HttpTarget(server)
    finally:
        server.close()
        kill_matching(marker)
    assert "Traceback" not in server.stderr_text(), server.stderr_text()[-4000:]


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Target]:
    """The tool fuzzers' target: the HTTP server, or its layers in process in soak mode."""
    if not IN_PROCESS:
        yield request.getfixturevalue("http_target")
        return
    tmp = tmp_path_factory.mktemp("fuzz-in-process")
    marker = f"{tmp}{os.sep}"
    KEPT_MARKERS.add(marker)
    inner = InProcessTarget(tmp)
    try:
        yield inner
    finally:
        inner.close()
        KEPT_MARKERS.discard(marker)
        assert not kill_matching(marker), "the in-process server left agent processes behind"


# ---------------------------------------------------------------- strategies from the schemas

def _kinds(schema: Mapping[str, Any]) -> list[str]:
    if "anyOf" in schema:
        return [kind for branch in schema["anyOf"] for kind in _kinds(branch)]
    return [schema["type"]] if "type" in schema else list(JSON_TYPES)


# Strategies are built once and reused: building one per draw (its filters' lambdas are described
# by compiling their source) cost hypothesis ten times more than an in-process tool call.
_BUILT: dict[tuple[Any, ...], st.SearchStrategy[Any]] = {}


@functools.cache
def any_json(depth: int = 2) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                       allow_infinity=False), st.text(max_size=20))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
        max_leaves=6) if depth else leaves


def valid_value(schema: Mapping[str, Any], name: str, target: Target, tool: str
                ) -> st.SearchStrategy[Any]:
    """Values the schema accepts, boundaries included; ids drawn partly from real ones."""
    key = (id(schema), name, id(target), tool)
    if key not in _BUILT:
        _BUILT[key] = _valid_value(schema, name, target, tool)
    return _BUILT[key]


def _valid_value(schema: Mapping[str, Any], name: str, target: Target, tool: str
                 ) -> st.SearchStrategy[Any]:
    real = {"threadId": target.thread_ids, "runId": target.run_ids, "projectId": ["proj"],
            "providerInstanceId": ["scripted"], "model": ["scripted-1", "scripted-2"]}
    if name in real:
        plain = schema.get("maxLength", 64)
        return st.one_of(st.sampled_from(real[name]),
                         st.text(min_size=1, max_size=min(plain, 40)).filter(str.strip))
    if name == "timeoutMs":  # the schema allows 600 s; a fuzz case must not wait that long
        return st.integers(0, 2_000)
    if "anyOf" in schema:
        return st.one_of([valid_value(b, name, target, tool) for b in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(list(schema["enum"]))
    return st.one_of([_valid_of_kind(kind, schema, target, tool) for kind in _kinds(schema)])


def _valid_of_kind(kind: str, schema: Mapping[str, Any], target: Target, tool: str
                   ) -> st.SearchStrategy[Any]:
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        text = st.text(st.characters(exclude_characters="".join(map(chr, CONTROL_CHARACTERS)))
                       if schema.get("line") else st.characters(), min_size=low,
                       max_size=min(high or 64, 64))
        if low and schema.get("trim"):
            text = text.filter(lambda s: len(s.strip()) >= low)
        return st.one_of(text, st.just("b" * high)) if high else text
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        edges = [v for v in (low, high) if v is not None]
        return st.one_of(st.integers(low, high), *([st.sampled_from(edges)] if edges else []))
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        items = valid_value(schema["items"], "", target, tool) if "items" in schema else any_json()
        return st.lists(items, min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 3), 3))
    if kind == "object":
        if "properties" not in schema:
            return st.dictionaries(st.text(max_size=8), any_json(), max_size=3)
        props = {k: v for k, v in schema["properties"].items() if (tool, k) not in NO_RUNS}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: valid_value(v, k, target, tool) for k, v in props.items() if k in required},
            optional={k: valid_value(v, k, target, tool) for k, v in props.items()
                      if k not in required})
    return st.none()


def _slots(schema: Mapping[str, Any], path: tuple[Any, ...] = ()
           ) -> Iterator[tuple[tuple[Any, ...], Mapping[str, Any], bool]]:
    """Every property reachable through objects and first array items: (path, schema, required)."""
    for key, sub in schema.get("properties", {}).items():
        here = (*path, key)
        yield here, sub, key in schema.get("required", ())
        if "properties" in sub:
            yield from _slots(sub, here)
        elif "items" in sub and "properties" in sub["items"]:
            yield from _slots(sub["items"], (*here, 0))


def _name(path: tuple[Any, ...]) -> str:
    """The field's name as tools.validate spells it: threads[0].prompt."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _wrong_type(schema: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    key = ("wrong type", id(schema))
    if key in _BUILT:
        return _BUILT[key]
    samples = {"string": st.text(max_size=10), "integer": st.integers(),
               "number": st.floats(allow_nan=False, allow_infinity=False).filter(
                   lambda f: not f.is_integer()),
               "boolean": st.booleans(), "array": st.lists(st.integers(), max_size=2),
               "object": st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)}
    allowed = set(_kinds(schema))
    _BUILT[key] = st.one_of([s for kind, s in samples.items() if kind not in allowed])
    return _BUILT[key]


@st.composite
def invalid_case(draw: st.DrawFn, tool: str, target: Target) -> tuple[dict[str, Any], str]:
    """A valid call with exactly one thing broken: -> (arguments, the field named in the error)."""
    schema = SCHEMAS[tool]
    args = draw(valid_value(schema, "", target, tool))
    slots = list(_slots(schema))
    mutations = ["unknown", "wrong_type"]
    if any(req for path, _, req in slots if len(path) == 1):
        mutations += ["missing", "null_required"]
    if any("maxLength" in s for _, s, _ in slots):
        mutations.append("too_long")
    if any(s.get("trim") and s.get("minLength") for _, s, _ in slots):
        mutations.append("blank")
    if any(s.get("line") for _, s, _ in slots):
        mutations.append("control")
    if any("minimum" in s or "maximum" in s for _, s, _ in slots):
        mutations.append("out_of_range")
    if any("enum" in s for _, s, _ in slots):
        mutations.append("not_in_enum")
    kind = draw(st.sampled_from(mutations))
    if kind == "unknown":
        parents = [()] + [p for p, s, _ in slots if "properties" in s] + \
            [(*p, 0) for p, s, _ in slots if "properties" in s.get("items", {})]
        parent = draw(st.sampled_from(parents))
        props = _schema_at(schema, parent).get("properties", {})
        key = draw(st.text(min_size=1, max_size=12))
        key += "~" if key in props else ""
        return _put(args, (*parent, key), draw(any_json(1))), _name((*parent, key))
    if kind in ("missing", "null_required"):
        path, _, _ = draw(st.sampled_from([s for s in slots if s[2] and len(s[0]) == 1]))
        if kind == "missing":
            args.pop(path[0], None)
            return args, _name(path)
        return _put(args, path, None), _name(path)
    candidates = {
        "wrong_type": slots,
        "too_long": [s for s in slots if "maxLength" in s[1]],
        "blank": [s for s in slots if s[1].get("trim") and s[1].get("minLength")],
        "control": [s for s in slots if s[1].get("line")],
        "out_of_range": [s for s in slots if "minimum" in s[1] or "maximum" in s[1]],
        "not_in_enum": [s for s in slots if "enum" in s[1]],
    }[kind]
    path, sub, _ = draw(st.sampled_from(candidates))
    if kind == "wrong_type":
        value = draw(_wrong_type(sub))
    elif kind == "too_long":
        value = draw(st.sampled_from(["x", " ", "é", "\U0001F600"])) * (sub["maxLength"] + 1)
    elif kind == "blank":
        value = draw(st.sampled_from(["", " ", "\t\n ", "\u3000"]))
    elif kind == "control":  # OSC 0, a C1 CSI, a bidi override, a line break
        value = draw(st.sampled_from(["x\x1b]0;t\x07", "a\x9b2J", "\u202eexe", "a\nb"]))
    elif kind == "out_of_range":
        bounds = [sub["minimum"] - draw(st.integers(1, 10**12))] if "minimum" in sub else []
        bounds += [sub["maximum"] + draw(st.integers(1, 10**12))] if "maximum" in sub else []
        value = draw(st.sampled_from(bounds))
    else:
        value = draw(st.text(max_size=12))
        value += "~" if value in sub["enum"] else ""
    return _put(args, path, value), _name(path)


def _schema_at(schema: Mapping[str, Any], path: tuple[Any, ...]) -> Mapping[str, Any]:
    for part in path:
        schema = schema["items"] if isinstance(part, int) else schema["properties"][part]
    return schema


def _put(args: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """Set `value` at `path`, making the containers on the way (a list gets one entry)."""
    here: Any = args
    for part, nxt in zip(path, path[1:]):
        if isinstance(part, int):
            here = here[part]
            continue
        if not isinstance(here.get(part), (dict, list)) or (isinstance(nxt, int) and not here[part]):
            here[part] = [{}] if isinstance(nxt, int) else {}
        here = here[part]
    here[path[-1]] = value
    return args


# ---------------------------------------------------------------- tool fuzzing

def call_and_check(target: Target, tool: str, args: Mapping[str, Any]) -> ToolResult:
    """One call: success, or a typed failure that wrote nothing; never an internal error."""
    before = target.events()
    result = target.call(tool, dict(args))
    assert "Traceback" not in (result.text or "")
    check_output(tool, result)
    if result.ok:
        assert isinstance(result.structured, dict) and json.loads(result.text) == result.structured
        if tool in STARTS_WORK and args.get("threadId") in target.thread_ids:
            target.settle([args["threadId"]])
        if tool == "t3_thread_update" and args["action"] == "regenerate_title":
            wait_until(lambda: target.call("t3_thread_read", {"threadId": args["threadId"]})
                       .structured["thread"]["titleRegeneration"] is None, 60)  # its effect
        return result
    assert result.structured and result.structured.get("_tag") == "OrchestratorMcpFailure", \
        result.text
    assert result.failure_code in FAILURE_CODES
    assert result.failure_code != "orchestration_error", (tool, args, result.structured)
    assert target.events() == before, (tool, args, result.structured)
    return result


def check_output(tool: str, result: ToolResult) -> None:
    """The answer's structuredContent is exactly the tool's success shape or the failure shape,
    and fits the outputSchema tools/list publishes."""
    problems = output_problems(tool, result.structured, is_error=result.is_error)
    assert not problems, (tool, result.structured, problems)


@pytest.mark.parametrize("tool", sorted(SCHEMAS))
@FUZZ
@given(data=st.data())
def test_valid_and_boundary_arguments(target: Target, tool: str, data: st.DataObject) -> None:
    """Arguments the schema accepts, ids real or not, boundaries included, never make the server
    fail: each call succeeds or is a typed failure that wrote nothing."""
    args = data.draw(valid_value(SCHEMAS[tool], "", target, tool), label="arguments")
    call_and_check(target, tool, args)


@pytest.mark.parametrize("tool", sorted(SCHEMAS))
@FUZZ
@given(data=st.data())
def test_invalid_arguments(target: Target, tool: str, data: st.DataObject) -> None:
    """A call with one broken field (unknown, wrong type, missing, null, too long, blank, a
    control character in a title, out of range, not in the enum) is invalid_request naming that
    field, and writes nothing."""
    args, field = data.draw(invalid_case(tool, target), label="arguments")
    result = call_and_check(target, tool, args)
    assert result.failure_code == "invalid_request", (args, result.structured)
    assert result.structured["message"].startswith(field + ":"), (field, result.structured)


@FUZZ
@given(name=st.one_of(st.text(max_size=40), st.sampled_from(sorted(SCHEMAS)).map(str.upper)),
       args=st.dictionaries(st.text(max_size=10), any_json(), max_size=3))
def test_unknown_tools(target: Target, name: str, args: dict[str, Any]) -> None:
    """A tool name t3 does not have is invalid_request, writing nothing."""
    if name in SCHEMAS:
        return
    result = call_and_check(target, name, args)
    assert result.failure_code == "invalid_request"


def _type_arrays(schema: Any, path: str = "") -> Iterator[str]:
    """Where a schema uses a `type` array (`{"type": ["string", "object"]}`)."""
    if isinstance(schema, dict):
        if isinstance(schema.get("type"), list):
            yield path or "(root)"
        for key, sub in schema.items():
            yield from _type_arrays(sub, f"{path}.{key}" if path else key)
    elif isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from _type_arrays(sub, f"{path}[{i}]")


def test_published_schemas_are_portable(http_target: HttpTarget) -> None:
    """tools/list gives every tool an inputSchema and an outputSchema, both object-rooted, and
    neither uses a `type` array anywhere (clients that map schemas onto a one-type dialect
    refuse or mangle those; `anyOf` says the same to every client)."""
    listed = {t.name: t for t in http_target.mcp.tools()}
    assert sorted(listed) == sorted(SCHEMAS)
    for name, tool in listed.items():
        for kind, schema in (("inputSchema", tool.input_schema),
                             ("outputSchema", tool.output_schema)):
            assert isinstance(schema, dict) and schema.get("type") == "object", (name, kind)
            jsonschema.Draft202012Validator.check_schema(schema)
            assert not list(_type_arrays(schema)), (name, kind, list(_type_arrays(schema)))


def test_scratch_launch_with_the_longest_client_request_id(target: Target) -> None:
    """Found by the soak: a scratch launch named its folder after the quoted thread id, which a
    256-character clientRequestId pushed past the file-name limit (an internal error). The folder
    name is now bounded, and a retry gets the same folder."""
    args = {"scratch": True, "title": "long key", "clientRequestId": "é" * 256}
    first = call_and_check(target, "t3_thread_launch", args)
    assert first.ok and Path(first.structured["workspacePath"]).is_dir()
    again = call_and_check(target, "t3_thread_launch", args)
    assert again.structured["workspacePath"] == first.structured["workspacePath"]


# ---------------------------------------------------------------- raw HTTP at /mcp

def _rpc(method: Any, params: Any = None, rid: Any = 1, version: Any = "2.0") -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": version, "method": method, "id": rid}
    if params is not None:
        msg["params"] = params
    return msg


tool_call = st.builds(lambda name, args: _rpc("tools/call", {"name": name, "arguments": args}),
                      st.sampled_from(sorted(SCHEMAS)), any_json())
junk_rpc = st.one_of(
    st.builds(_rpc, st.one_of(st.text(max_size=20), any_json(0)), any_json(), any_json(0),
              st.sampled_from(["2.0", "1.0", 2, None, ""])),
    tool_call,
    st.lists(st.one_of(tool_call, any_json()), max_size=4),  # batches
    any_json())
raw_bodies = st.one_of(
    junk_rpc.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    junk_rpc.map(lambda v: json.dumps(v).encode()[:-1]),  # cut short
    st.just(b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t3_thread_list",'
            b'"arguments":{"titleContains":"\\ud800"}}}'),  # a lone surrogate
    st.just(b""), st.just(b"\n"), st.just(b"null"), st.just(b"[]"))
odd_headers = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "",
                                     "application/json; charset=latin-1", "multipart/form-data"]),
    "Accept": st.sampled_from(["", "*/*", "text/html", "application/json", "text/event-stream"]),
    "mcp-session-id": st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
    "mcp-protocol-version": st.sampled_from(["1999-01-01", "", "2025-06-18", "latest"]),
    "Last-Event-ID": st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20)})


def _successful_write(tool_body: bytes, response: bytes) -> bool:
    """Did this raw exchange include a successful destructive tool call (allowed to write)?"""
    return b"tools/call" in tool_body and b'"isError":false' in response.replace(b" ", b"")


def check_raw(http_target: HttpTarget, method: str, body: bytes | None, headers: Mapping[str, str]) -> int:
    before = http_target.events()
    response = raw_request(method, http_target.server.mcp_url, body, headers, timeout=60)
    assert response.status < 500, (method, body, headers, response)
    assert b"Traceback" not in response.body and b'File "' not in response.body
    if not _successful_write(body or b"", response.body):
        assert http_target.events() == before, (body, response)
    return response.status


@FUZZ
@given(body=raw_bodies, headers=odd_headers)
def test_raw_posts(http_target: HttpTarget, body: bytes, headers: dict[str, str]) -> None:
    """Malformed JSON-RPC, batches, cut-off or binary bodies, odd content types and headers:
    never a 5xx or a traceback, and nothing is written unless a tool call succeeded."""
    check_raw(http_target, "POST", body, http_target.headers(**headers))


@FUZZ
@given(method=st.sampled_from(["GET", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]),
       headers=odd_headers, body=st.one_of(st.none(), st.binary(max_size=50)))
def test_raw_other_methods(http_target: HttpTarget, method: str, headers: dict[str, str],
                           body: bytes | None) -> None:
    """Other HTTP methods on /mcp are answered (or refused) without a 5xx or a traceback."""
    if method in ("GET", "HEAD"):  # a GET may open a stream the server keeps; it must answer
        headers = {**headers, "Accept": "application/json"}
        body = None
    check_raw(http_target, method, body, http_target.headers(**headers))


@FUZZ
@given(auth=st.one_of(st.text(max_size=60).map(lambda t: t.encode("utf-8").decode("latin-1")),
                      st.binary(max_size=40).map(lambda b: "Bearer " + b.hex())),
       body=raw_bodies)
def test_raw_bad_credentials(http_target: HttpTarget, auth: str, body: bytes) -> None:
    """Any Authorization header but a valid token is 401 before the body is looked at (one with
    control characters is malformed HTTP: the HTTP layer may answer 400 first)."""
    if http_target.server.token in auth:
        return
    headers = {**http_target.headers(), "Authorization": auth}
    if not auth.strip() or any(c in auth for c in "\r\n\x00"):
        headers.pop("Authorization")
    malformed = any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7f for c in auth)
    assert check_raw(http_target, "POST", body, headers) in ((400, 401) if malformed else (401,))


def test_oversized_bodies_are_413(http_target: HttpTarget) -> None:
    """A body over 4 MiB is 413, whether it announces its length or is sent chunked; the server
    stays up and writes nothing."""
    before = http_target.events()
    huge = json.dumps(_rpc("tools/call", {"name": "create_threads", "arguments": {
        "threads": [{"title": "x" * (4 * 1024 * 1024)}]}})).encode()
    headers = http_target.headers()
    assert raw_request("POST", http_target.server.mcp_url, huge, headers).status == 413
    url = urllib.parse.urlsplit(http_target.server.mcp_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", url.path, body=(huge[i:i + 65536] for i in range(0, len(huge), 65536)),
                     headers=headers, encode_chunked=True)
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    assert http_target.events() == before
    assert raw_request("GET", f"{http_target.server.url}/healthz").status == 200


def test_server_survives_the_fuzz(target: Target, http_target: HttpTarget) -> None:
    """After everything above, the server still serves a whole turn."""
    created = target.call("create_threads", {"threads": [{"prompt": "still there?"}]})
    thread = created.structured["threads"][0]
    done = target.call("t3_thread_wait", {"threadId": thread["threadId"], "timeoutMs": 60_000})
    assert done.structured["status"] == "completed"
    wait_until(lambda: http_target.server.running, 1)
