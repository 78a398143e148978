"""Soak: kill -9 / restart cycles of the real server under a running workload.

Each cycle starts (or restarts) `t3.py` on one data directory, makes a fixed number of calls
over MCP (`--calls`, default 12: threads created with slow, fast and no prompts; messages sent in
auto and queue mode to earlier threads; at most 4 calls in flight), and SIGKILLs the server a
random 0-0.3 s after its last call went out, with calls still in flight. After the restart it
retries every call that got no answer (same clientRequestId), lets the server finish the cycle's
work (no run left queued, starting or running: a run the kill did not interrupt starts and
completes) and counts, cumulatively:

- lost:       acknowledged results (thread, run, message ids from a successful call) missing from
              the database
- duplicates: a retried request that produced a second thread or message, or a command id whose
              events are not one contiguous block (committed twice)
- stuck:      outbox rows `running` with an expired lease once the restarted server is ready
- ghosts:     runs `starting`/`running` without a live provider process of the current server for
              their thread and without a pending or running outbox row on it (an effect on its
              way), still so 10 s after the restart
- orphans:    provider processes of a killed server (T3_OWNER=<data dir>, another T3_SERVER_PID)
              still alive 5 s after the restart
- undrained:  runs still queued, starting or running 60 s after the retries

Lost and duplicates are checked incrementally (the ids acknowledged and the events committed since
the last check), so a cycle does not slow down as the log grows; every 100th cycle and the last
one re-check every acknowledged id.

Each cycle does the same work and ends with nothing left to do, so its time should not grow:
the mean cycle time of the last 100 cycles is compared with that of the first 100 (`--quick`:
10 cycles, halves of 5), target at most 1.2x. Every 10 cycles a line shows the time per cycle
lately.

Usage: python bench/soak.py [--cycles 1000] [--calls 12] [--quick] [--seed N] [--keep FILE]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import random
import sqlite3
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _bench
from harness import McpClient, T3Server, ToolResult, pids_alive, processes_matching, wait_until

GHOST_GRACE_S = 10.0
DRAIN_S = 60.0
ORPHAN_GRACE_S = 5.0
IN_FLIGHT = 4
FLAT = 1.2  # last 100 cycles' mean time at most this times the first 100's


@dataclass
class Tally:
    cycles: int = 0
    calls_ok: int = 0
    calls_unanswered: int = 0
    retried_ok: int = 0
    lost: int = 0
    duplicates: int = 0
    stuck: int = 0
    ghosts: int = 0
    orphans: int = 0
    undrained: int = 0
    restart_s: list[float] = field(default_factory=list)
    cycle_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Acked:
    threads: set[str] = field(default_factory=set)
    runs: set[str] = field(default_factory=set)
    messages: set[str] = field(default_factory=set)


@dataclass
class Seen:
    """What the incremental log checks have read so far."""
    sequence: int = 0
    commands: set[str] = field(default_factory=set)
    titles: dict[str, str] = field(default_factory=dict)  # title -> thread id
    texts: dict[str, str] = field(default_factory=dict)  # user message text -> message id
    duplicates: int = 0


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


class Soak:
    def __init__(self, tmp: Path, server: T3Server, *, seed: int, calls: int) -> None:
        self.tmp, self.server, self.rng, self.calls = tmp, server, random.Random(seed), calls
        self.client: McpClient = server.client()
        self.db_path = server.data_dir / "t3.sqlite"
        self.owner = str(server.data_dir.resolve())
        self.acked, self.unverified, self.tally = Acked(), Acked(), Tally()
        self.seen = Seen()
        self.known_threads: list[str] = []
        self.serial = 0

    # -- the workload ----------------------------------------------------------------------

    def _next_call(self) -> tuple[str, dict[str, Any]]:
        self.serial += 1
        tag = f"soak-{self.serial}"
        if self.known_threads and self.rng.random() < 0.45:
            mode = self.rng.choice(["auto", "queue"])
            return "t3_thread_send", {"threadId": self.rng.choice(self.known_threads[-40:]),
                                      "message": f"{tag} SLOW:{self.rng.randint(5, 30)}",
                                      "mode": mode, "clientRequestId": tag}
        entries = [{"title": f"{tag}-slow", "prompt": f"SLOW:{self.rng.randint(10, 60)} {tag}"},
                   {"title": f"{tag}-fast", "prompt": f"hello {tag}"},
                   {"title": f"{tag}-idle"}]
        return "create_threads", {"threads": self.rng.sample(entries, self.rng.randint(1, 3)),
                                  "clientRequestId": tag}

    def _record(self, tool: str, result: ToolResult) -> None:
        s = result.structured or {}
        for acked in (self.acked, self.unverified):
            if tool == "create_threads":
                for t in s.get("threads", []):
                    acked.threads.add(t["threadId"])
                    if t.get("runId"):
                        acked.runs.add(t["runId"])
            else:
                acked.runs.add(s["runId"])
                acked.messages.add(s["messageId"])
        if tool == "create_threads":
            self.known_threads += [t["threadId"] for t in s.get("threads", [])]

    def drive(self) -> list[tuple[str, dict[str, Any]]]:
        """Make `self.calls` calls, at most IN_FLIGHT at once; kill -9 a random 0-0.3 s after
        the last went out; return the calls left unanswered."""
        in_flight: dict[concurrent.futures.Future[ToolResult], tuple[str, dict[str, Any]]] = {}
        for n in range(self.calls):
            if len(in_flight) >= IN_FLIGHT:
                done, _ = concurrent.futures.wait(in_flight, timeout=60,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    self._settle(fut, in_flight.pop(fut))
            tool, args = self._next_call()
            in_flight[self.client.submit(tool, args, timeout=60)] = (tool, args)
        done, _ = concurrent.futures.wait(in_flight, timeout=self.rng.uniform(0, 0.3),
                                          return_when=concurrent.futures.ALL_COMPLETED)
        for fut in done:
            self._settle(fut, in_flight.pop(fut))
        self.server.kill9()
        unanswered = []
        done, not_done = concurrent.futures.wait(in_flight, timeout=60)
        for fut in done:
            if self._settle(fut, in_flight[fut]) is None:
                unanswered.append(in_flight[fut])
        unanswered += [in_flight[f] for f in not_done]
        self.tally.calls_unanswered += len(unanswered)
        return unanswered

    def _settle(self, fut: concurrent.futures.Future[ToolResult], call: tuple[str, dict[str, Any]]
                ) -> ToolResult | None:
        try:
            result = fut.result()
        except Exception:  # the connection died with the server: not acknowledged
            return None
        if result.ok:
            self.tally.calls_ok += 1
            self._record(call[0], result)
        return result

    def retry(self, calls: list[tuple[str, dict[str, Any]]]) -> None:
        for tool, args in calls:
            with contextlib.suppress(Exception):
                result = self.client.call(tool, args, timeout=60)
                if result.ok:
                    self.tally.retried_ok += 1
                    self._record(tool, result)

    # -- the checks -------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)

    def check_after_restart(self, cycle: int) -> None:
        t = self.tally
        pid = self.server.pid
        # orphans: providers of a killed server; PDEATHSIG and the startup sweep should end them
        stale = [p for p in processes_matching(f"T3_OWNER={self.owner}")
                 if _env_of(p).get("T3_SERVER_PID") not in (None, str(pid))]
        if stale:
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not pids_alive(stale), ORPHAN_GRACE_S, interval=0.1)
            if left := pids_alive(stale):
                t.orphans += len(left)
                t.notes.append(f"cycle {cycle}: orphan provider pids {left}")
        now_ms = int(time.time() * 1000)
        with contextlib.closing(self._db()) as db:
            stuck = db.execute("SELECT COUNT(*) FROM effect_outbox WHERE status = 'running' "
                               "AND lease_expires_ms < ?", (now_ms,)).fetchone()[0]
        if stuck:
            t.stuck += stuck
            t.notes.append(f"cycle {cycle}: {stuck} outbox rows running with an expired lease")
        ghosts = self._ghosts(pid)
        if ghosts:
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not self._ghosts(pid), GHOST_GRACE_S, interval=0.1)
            if left_ghosts := self._ghosts(pid):
                t.ghosts += len(left_ghosts)
                t.notes.append(f"cycle {cycle}: ghost runs {sorted(left_ghosts)}")

    def _ghosts(self, pid: int) -> set[str]:
        with contextlib.closing(self._db()) as db:
            # a run whose thread still has its start effect pending or running is on its way
            # (the worker runs at most 16 effects at once), not a ghost
            active = db.execute("SELECT run_id, thread_id FROM runs r "
                                "WHERE status IN ('starting', 'running') AND NOT EXISTS ("
                                "SELECT 1 FROM effect_outbox o WHERE o.thread_id = r.thread_id "
                                "AND o.status IN ('pending', 'running'))").fetchall()
        if not active:
            return set()
        live_threads = {env.get("T3_THREAD_ID") for p in processes_matching(f"T3_OWNER={self.owner}")
                        if (env := _env_of(p)).get("T3_SERVER_PID") == str(pid)}
        return {run_id for run_id, thread_id in active if thread_id not in live_threads}

    def check_log(self, cycle: int, *, full: bool = False) -> None:
        """Lost acknowledgements and duplicates. Incremental: only the ids acknowledged and the
        events committed since the last check are read, so a check does not slow down as the log
        grows; `full` re-checks every acknowledged id (every 100 cycles and at the end)."""
        t, seen = self.tally, self.seen
        fresh = self.acked if full else self.unverified
        with contextlib.closing(self._db()) as db:
            lost = sum(len(ids) - db.execute(f"SELECT COUNT(*) FROM {table} WHERE {column} IN "
                                             f"({','.join('?' * len(ids))})", sorted(ids)).fetchone()[0]
                       for table, column, ids in (("threads", "thread_id", fresh.threads),
                                                  ("runs", "run_id", fresh.runs),
                                                  ("messages", "message_id", fresh.messages)) if ids)
            rows = db.execute("SELECT sequence, command_id, type, payload_json FROM events "
                              "WHERE sequence > ? ORDER BY sequence", (seen.sequence,)).fetchall()
        self.unverified = Acked()
        blocks: dict[str, list[int]] = {}
        for sequence, command_id, type_, payload_json in rows:
            seen.sequence = sequence
            if command_id is not None:
                blocks.setdefault(command_id, []).append(sequence)
            kind = type_.rsplit(".", 1)[0]
            if kind not in ("thread", "message"):
                continue
            payload = json.loads(payload_json)
            if kind == "thread" and payload.get("title", "").startswith("soak-"):
                seen.duplicates += seen.titles.setdefault(payload["title"], payload["id"]) != payload["id"]
            elif kind == "message" and payload.get("role") == "user" and \
                    payload.get("text", "").startswith("soak-"):
                seen.duplicates += seen.texts.setdefault(payload["text"], payload["id"]) != payload["id"]
        for command_id, sequences in blocks.items():
            # one command commits once, as one contiguous block; a command id already seen in an
            # earlier check was committed twice
            split = command_id in seen.commands or sequences[-1] - sequences[0] + 1 != len(sequences)
            seen.duplicates += split
            seen.commands.add(command_id)
        if lost:
            t.notes.append(f"cycle {cycle}: {lost} acknowledged ids missing")
        if seen.duplicates > t.duplicates:
            t.notes.append(f"cycle {cycle}: {seen.duplicates - t.duplicates} new duplicates")
        t.lost = lost if full else t.lost + lost
        t.duplicates = seen.duplicates

    def cycle(self, n: int) -> None:
        began = time.perf_counter()
        unanswered = self.drive()
        started = time.perf_counter()
        self.server.start()
        self.tally.restart_s.append(time.perf_counter() - started)
        self.check_after_restart(n)
        self.retry(unanswered)
        self.check_log(n, full=n % 100 == 0)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not self.unfinished(), DRAIN_S, interval=0.05)
        if left := self.unfinished():
            self.tally.undrained += left
            self.tally.notes.append(f"cycle {n}: {left} runs not done {DRAIN_S:.0f} s later")
        self.tally.cycles += 1
        self.tally.cycle_s.append(time.perf_counter() - began)

    def unfinished(self) -> int:
        with contextlib.closing(self._db()) as db:
            return db.execute("SELECT COUNT(*) FROM runs WHERE status IN ('preparing', 'queued', "
                              "'starting', 'running', 'waiting')").fetchone()[0]


def main(argv: list[str] | None = None) -> int:
    p = _bench.parser("kill -9 / restart soak of the real t3 server under load")
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--calls", type=int, default=12, help="calls per cycle")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", type=Path, help="copy the final database here (for a post-mortem)")
    args = p.parse_args(argv)
    cycles = 10 if args.quick else args.cycles
    began = time.perf_counter()
    with _bench.scratch_dir("soak") as tmp, _bench.t3_server(tmp, chunk_delay=0.02) as server:
        soak = Soak(tmp, server, seed=args.seed, calls=args.calls)
        mark = time.perf_counter()
        try:
            for n in range(1, cycles + 1):
                soak.cycle(n)
                if n == cycles and n % 100:
                    soak.check_log(n, full=True)
                if n % 10 == 0 or n == cycles:
                    t, last10 = soak.tally, time.perf_counter() - mark
                    mark = time.perf_counter()
                    print(f"cycle {n}/{cycles}: {mark - began:.0f} s ({last10 / 10:.2f} s per "
                          f"cycle lately), ok calls {t.calls_ok}, lost {t.lost}, dup "
                          f"{t.duplicates}, stuck {t.stuck}, ghosts {t.ghosts}, orphans "
                          f"{t.orphans}, undrained {t.undrained}", file=sys.stderr, flush=True)
        finally:
            soak.client.close()
        with contextlib.closing(soak._db()) as db:
            events = db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
            if args.keep:
                with contextlib.closing(sqlite3.connect(args.keep)) as dest:
                    db.backup(dest)
    t = soak.tally
    elapsed = time.perf_counter() - began
    failures = t.lost + t.duplicates + t.stuck + t.ghosts + t.orphans + t.undrained
    window = max(1, min(100, t.cycles // 2))
    first, last = (statistics.mean(t.cycle_s[:window]), statistics.mean(t.cycle_s[-window:])) \
        if t.cycles else (0.0, 0.0)
    flat = last / first if first else float("inf")
    _bench.report(f"soak: {t.cycles} kill -9 / restart cycles", [
        ("wall time", f"{elapsed:.0f} s ({elapsed / max(t.cycles, 1):.1f} s per cycle)"),
        ("cycle time", f"first {window} mean {first:.2f} s, last {window} mean {last:.2f} s: "
                       f"{flat:.2f}x"),
        ("calls acknowledged", f"{t.calls_ok} (+{t.retried_ok} retries after restart)"),
        ("calls unanswered at kill", str(t.calls_unanswered)),
        ("threads / runs / messages acked", f"{len(soak.acked.threads)} / {len(soak.acked.runs)} / "
                                            f"{len(soak.acked.messages)}"),
        ("events in the log", str(events)),
        ("restart to ready p50 / max", f"{_bench.median(t.restart_s) * 1000:.0f} ms / "
                                       f"{max(t.restart_s) * 1000:.0f} ms"),
        ("acknowledged commands lost", str(t.lost)),
        ("duplicate events", str(t.duplicates)),
        ("stuck outbox rows", str(t.stuck)),
        ("ghost runs", str(t.ghosts)),
        ("orphan processes", str(t.orphans)),
        ("runs not done 60 s after a restart", str(t.undrained)),
    ], verdict=("PASS" if failures == 0 and flat <= FLAT else "MISS") +
       (": 0 of each" if failures == 0 else f": {failures} problems") +
       f" over {t.cycles} cycles of {args.calls} calls (target: 0 over 1,000), cycle time "
       f"last/first {window} {flat:.2f}x (target <= {FLAT}x)")
    for note in t.notes[:30]:
        print(f"  ! {note}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
