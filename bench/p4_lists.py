"""P4 filtered lists: `t3_thread_list` of a project holding 40,000 threads, with `statuses` or
`titleContains`, against the same list unfiltered, over MCP on the real server.

The database: a real server creates one thread with a completed run and stops; the bulk loader
of p4_scale.py copies that thread's events into project "bulk" until it holds 40,000 threads
(`--quick`: 10,000), through the projection writes store.py uses. Each list asks for the first
page (50) and the total, as a client paging through the project does. The filters cover both
ends: a status every thread has and one none has, a title fragment every title holds and one none
holds (a filter matching none still tests every thread). The calls are interleaved from one
client. Target: every filtered list's p50 <= 1.5x the unfiltered p50.
"""

from __future__ import annotations

import contextlib
import sqlite3

import _bench
from p3_tools import measure, seed_threads
from p4_scale import _server, bulk_fill


def main(argv: list[str] | None = None) -> int:
    args = _bench.parser(__doc__.splitlines()[0]).parse_args(argv)
    threads, samples = (10_000, 20) if args.quick else (40_000, 60)
    with _bench.scratch_dir("p4-lists") as tmp:
        server = _server(tmp, "lists", tmp / "data")
        with contextlib.closing(server.start()), server.client() as mcp:
            template = seed_threads(mcp, 1)[0]
            title = mcp.call("t3_thread_read", {"threadId": template}).structured["thread"]["title"]
        db_path = tmp / "data" / "t3.sqlite"
        with contextlib.closing(sqlite3.connect(db_path)) as db:
            per_thread = db.execute("SELECT COUNT(*) FROM events WHERE thread_id = ?",
                                    (template,)).fetchone()[0]
            have = db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        fill_s = _bench.timed(lambda: bulk_fill(db_path, template, have + per_thread * threads))
        lists = {"unfiltered": {},
                 "statuses all match": {"statuses": ["completed"]},
                 "statuses none match": {"statuses": ["failed"]},
                 "titleContains all match": {"titleContains": title[:4].upper()},
                 "titleContains none match": {"titleContains": "no such title"}}
        with contextlib.closing(server.start()), server.client() as mcp:
            totals = {k: mcp.call("t3_thread_list", {"projectId": "bulk", **a}).structured["total"]
                      for k, a in lists.items()}
            times = measure({k: (mcp, "t3_thread_list", {"projectId": "bulk", **a})
                             for k, a in lists.items()}, samples)
    p50 = {k: _bench.median(v) for k, v in times.items()}
    ratios = {k: p50[k] / p50["unfiltered"] for k in lists if k != "unfiltered"}
    worst = max(ratios.values())
    rows = [("project 'bulk'", f"{totals['unfiltered']:,} threads ({per_thread} events each, "
                               f"filled in {fill_s:.0f} s)")]
    rows += [(k, f"p50 {p50[k] * 1e3:.1f} ms, p99 {_bench.percentile(times[k], 99) * 1e3:.1f} ms, "
                 f"total {totals[k]:,}" + (f": {ratios[k]:.2f}x unfiltered" if k in ratios else ""))
             for k in lists]
    _bench.report(f"P4 filtered lists ({totals['unfiltered']:,} threads)", rows,
                  verdict=f"{'PASS' if worst <= 1.5 else 'MISS'}: target every filter <= 1.5x "
                          f"unfiltered (worst {worst:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
