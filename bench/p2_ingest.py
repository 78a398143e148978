"""P2 ingest: provider text deltas persisted per second, from the scripted agent streaming
`FAST:n:10` 10-character chunks through the real server (ACP over stdio -> driver ->
orchestrator, which coalesces up to 200 ms of deltas into one `provider.ingest` command -> one
commit that appends only their text: store.TEXT_APPENDED), against a raw sqlite3 loop.

Real: wall time from `create_threads` to `t3_thread_wait` returning completed, for FAST:N and for
FAST:N0 in the same repetition; the difference removes the fixed cost (agent process start, ACP
session, run bookkeeping), so N - N0 deltas / (t_N - t_N0) is the marginal ingest rate. Each run's
full text is checked in the database. The server's CPU time (all threads, from /proc) is taken
around both runs the same way: CPU per delta is less hurt by other load than the rate.

Bytes: what recording the FAST:N answer (1 MB in the full run) wrote, as event payloads plus
projection rows (each event but an append upserts a row of its payload's size), against the
answer's length. Target <= 4x: it does not grow with the square of the answer.

Raw (the floor the ratio is taken against): a plain loop that receives the same N ACP
`session/update` lines through a pipe from `cat`, decodes each, appends its text, and writes the
accumulated message (an event row and a projection row) in as many fsynced transactions as the
server made for that run. Also shown, not used for the ratio: the server's own ingest commands of
one FAST:N run read back (receipt, events, projection upserts) and replayed into a fresh
database, one transaction per command as the server did: the database part alone.
Targets: >= 40,000 deltas/s and real rate >= raw rate / 2.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import time
from pathlib import Path

import _bench
import store as s
from harness import McpClient, T3Server, scripted_provider
from p1_commit import command_plans, replay


WIDTH = 10  # characters per delta


def _text(n: int) -> str:
    return "".join(f"{i} ".rjust(WIDTH, ".") for i in range(n))


def _run(mcp: McpClient, n: int) -> tuple[float, str, str]:
    """FAST:n on a new thread to completion; (seconds, thread id, run id)."""
    started = time.perf_counter()
    created = mcp.call("create_threads", {"threads": [{"prompt": f"FAST:{n}:{WIDTH}"}]}).structured
    thread = created["threads"][0]
    done = mcp.call("t3_thread_wait", {"threadId": thread["threadId"], "timeoutMs": 300_000},
                    timeout=320).structured
    elapsed = time.perf_counter() - started
    if done["status"] != "completed":
        raise RuntimeError(f"FAST:{n} ended {done}")
    return elapsed, thread["threadId"], thread["runId"]


def _check_text(server: T3Server, run_id: str, n: int) -> None:
    with contextlib.closing(sqlite3.connect(f"file:{server.data_dir / 't3.sqlite'}?mode=ro",
                                            uri=True)) as db:
        texts = [json.loads(r[0])["text"] for r in db.execute(
            "SELECT payload_json FROM messages WHERE run_id = ? AND "
            "json_extract(payload_json, '$.role') = 'assistant'", (run_id,))]
    if "".join(texts) != _text(n):
        raise RuntimeError(f"run {run_id}: persisted text is not the {n} deltas in order")


def _rows(server: T3Server, thread_id: str) -> tuple[int, int, int, int]:
    """(ingest commits, events, bytes of event payloads, bytes of projection rows) of one
    thread's provider.ingest commands."""
    with contextlib.closing(sqlite3.connect(f"file:{server.data_dir / 't3.sqlite'}?mode=ro",
                                            uri=True)) as db:
        return db.execute(
            "SELECT COUNT(DISTINCT r.command_id), COUNT(e.sequence), "
            "COALESCE(SUM(LENGTH(e.payload_json)), 0), COALESCE(SUM(LENGTH(e.payload_json)) "
            f"FILTER (WHERE e.type != '{s.TEXT_APPENDED}'), 0) FROM command_receipts r "
            "JOIN events e ON e.command_id = r.command_id "
            "WHERE r.command_type = 'provider.ingest' AND r.thread_id = ?", (thread_id,)).fetchone()


def acp_lines(n: int) -> bytes:
    """The `session/update` lines the scripted agent writes for FAST:n."""
    return b"".join(json.dumps({"jsonrpc": "2.0", "method": "session/update", "params": {
        "sessionId": "s", "update": {"sessionUpdate": "agent_message_chunk",
                                     "content": {"type": "text",
                                                 "text": f"{i} ".rjust(WIDTH, ".")}}}}).encode()
        + b"\n" for i in range(n))


def raw_pipe(db_path: Path, source: Path, n: int, commits: int) -> float:
    """Seconds for the floor loop: n lines from a pipe, decoded, the text appended, and the
    whole message written (an event row and a projection row) in `commits` transactions."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY, payload TEXT)")
    conn.execute("CREATE TABLE IF NOT EXISTS message (id INTEGER PRIMARY KEY, payload TEXT)")
    every = max(1, n // max(1, commits))
    parts: list[str] = []
    started = time.perf_counter()
    with subprocess.Popen(["cat", str(source)], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        for count, line in enumerate(proc.stdout, 1):
            parts.append(json.loads(line)["params"]["update"]["content"]["text"])
            if count % every == 0 or count == n:
                payload = json.dumps({"role": "assistant", "text": "".join(parts)})
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO log (payload) VALUES (?)", (payload,))
                conn.execute("INSERT OR REPLACE INTO message VALUES (1, ?)", (payload,))
                conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    if json.loads(conn.execute("SELECT payload FROM message").fetchone()[0])["text"] != \
            _text(n):
        raise RuntimeError("raw loop: the persisted text is not the deltas in order")
    conn.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    # --quick still streams enough that the marginal time is not lost in one run's noise
    n, n0, reps = (60_000, 1_000, 3) if args.quick else (100_000, 1_000, 5)
    real_rates, raw_rates, replay_rates, cpu_per_delta, coalesced = [], [], [], [], []
    with _bench.scratch_dir("p2") as tmp:
        source = tmp / "fast.jsonl"
        source.write_bytes(acp_lines(n))
        provider = scripted_provider(tmp, env={"SCRIPTED_AGENT_LOG": ""})  # no per-message log
        with _bench.t3_server(tmp, providers=[provider]) as server, server.client() as mcp:
            _run(mcp, n0)  # warm up: imports, first session
            pid = int(server.info["pid"])
            for _ in range(reps):
                cpu0 = _bench.cpu_seconds(pid)
                small, _, run0 = _run(mcp, n0)
                cpu1 = _bench.cpu_seconds(pid)
                big, thread_id, run_id = _run(mcp, n)
                cpu2 = _bench.cpu_seconds(pid)
                _check_text(server, run0, n0)
                _check_text(server, run_id, n)
                real_rates.append((n - n0) / (big - small))
                cpu_per_delta.append(((cpu2 - cpu1) - (cpu1 - cpu0)) / (n - n0))
                coalesced.append(_rows(server, thread_id))
                plans = command_plans(server.data_dir / "t3.sqlite", "provider.ingest",
                                      thread_id=thread_id)
                replay_db = tmp / f"replay-{len(replay_rates)}.sqlite"
                s.apply_migrations(replay_db, backups_dir=tmp / "backups")
                replay_rates.append(n / replay(replay_db, plans))
                raw_rates.append(n / raw_pipe(tmp / f"raw-{len(raw_rates)}.sqlite", source, n,
                                              coalesced[-1][0]))
    real, raw = _bench.median(real_rates), _bench.median(raw_rates)
    commits = _bench.median([c for c, _, _, _ in coalesced])
    events = _bench.median([e for _, e, _, _ in coalesced])
    payload_mb = _bench.median([b for _, _, b, _ in coalesced]) / 1e6
    written = _bench.median([(b + p) / (n * WIDTH) for _, _, b, p in coalesced])
    cpu_us = _bench.median(cpu_per_delta) * 1e6
    ratio = raw / real
    rate_ok, ratio_ok, bytes_ok = real >= 40_000, ratio <= 2, written <= 4
    _bench.report("P2 ingest (provider text deltas)", [
        ("deltas per run", f"FAST:{n} minus FAST:{n0}, {reps} repetitions"),
        ("real: deltas received and persisted", f"{real:,.0f} deltas/s (median; all {', '.join(f'{r:,.0f}' for r in real_rates)})"),
        ("server CPU per delta", f"{cpu_us:.1f} us (median, all threads; alone that allows "
                                 f"{1e6 / cpu_us:,.0f} deltas/s)"),
        ("rows written per run", f"{commits:.0f} ingest commits, {events:.0f} events "
                                 f"({n / commits:,.0f} deltas per commit), "
                                 f"{payload_mb:.1f} MB of event payloads"),
        ("bytes written per byte of answer", f"{written:.2f}x (event payloads and projection "
                                             f"rows, for {n * WIDTH / 1e6:.1f} MB)"),
        ("raw: pipe, decode, append, same commits", f"{raw:,.0f} deltas/s"),
        ("the server's ingest rows replayed alone", f"{_bench.median(replay_rates):,.0f} deltas/s"),
        ("ratio raw/real", f"{ratio:.2f}x"),
    ], verdict=f"{'PASS' if rate_ok and ratio_ok and bytes_ok else 'MISS'}: target >= 40,000 "
               f"deltas/s ({'met' if rate_ok else 'missed'}), <= 2x raw "
               f"({'met' if ratio_ok else 'missed'}), <= 4x bytes "
               f"({'met' if bytes_ok else 'missed'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
