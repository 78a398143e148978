"""cluster.py: several t3 processes (nodes) serving one PostgreSQL database.

A feature module: the core never imports it; ``t3.py`` starts a ``Node`` when the store is on
PostgreSQL (store_pg.py), and every such server is a node, alone or not. An auditor of a
single-node SQLite install may skip it. README, "Running on several machines".

How the core's single-process rules carry over:
- Identity: each node has an id (``[node] id``, else one made once and kept in the data
  directory's ``node-id`` file, so a restarted node is the same node). A session advisory lock
  on it refuses a second process with the same id.
- Commands: the orchestrator is ``shared``. Each commit carries the sequence the decision's state
  reflected and is refused (``store.StaleState``) if the thread has an event after it, under the
  database's one write lock; the orchestrator then loads the thread again and decides again. So a
  thread's commands are serialized across nodes, whichever node a client or agent reached.
- Seeing other nodes' commits: every node LISTENs. A commit of events sends ``t3_events`` and
  the node reads the events after the last it absorbed (``Orchestrator.absorb``: cached states,
  parts, waits and /ws subscriptions, in sequence order, its own commits included); an outbox
  row added or stopping sends ``t3_effects`` and wakes the effect worker (another node's: its
  own changes woke its worker as on SQLite; it skips notices of its writers); a node joining sends
  ``t3_nodes`` and the others read what it runs (heartbeats refresh that too). No polling.
- Effects: a thread's effects run on the node that holds it (``thread_holders``: the node that
  claimed its first effect, so its agent process stays with it), claimed ``FOR UPDATE SKIP
  LOCKED`` under a lease fenced by owner and attempt (store_pg's claim form).
- Liveness: a node renews its ``cluster_nodes`` row's heartbeat (the database's clock) every
  ``HEARTBEAT_S``. The first other node to see a heartbeat ``DEAD_MS`` old deletes that row (one
  node wins) and recovers the dead node's threads as a restart would (``Orchestrator.recover``
  over ``NodeWork``); the next node to claim one of their effects holds that thread. A node
  that finds its own row gone was
  declared dead while alive (cut off from the database): its work was recovered elsewhere, so
  it stops (SIGTERM to itself) rather than run it twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import store as s
import store_pg
from orchestrator import Capabilities, ProviderInfo

__all__ = ["HEARTBEAT_S", "DEAD_MS", "ClusterProviders", "Node", "NodeWork", "node_id"]

log = logging.getLogger("t3.cluster")
HEARTBEAT_S = 1.0
DEAD_MS = 5_000  # a heartbeat this old: the node is dead (several missed beats, not one)
_NODE_LOCK = 0x7433_0003
_DB_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
_HELD_BY = "thread_id IN (SELECT thread_id FROM thread_holders WHERE node_id = %s)"
# A few at a time: an event may carry a long answer's text.
_PAGE = 64  # events read at a time
_EVENTS_AFTER = f"SELECT * FROM events WHERE sequence > ? ORDER BY sequence LIMIT {_PAGE:d}"


def node_id(configured: str | None, data_dir: Path) -> str:
    """``[node] id``, else the id this data directory's node took the first time it ran."""
    if configured:
        return configured
    path = data_dir / "node-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        made = f"node-{uuid.uuid4().hex[:12]}"
        path.write_text(made + "\n")
        return made


class NodeWork:
    """What one node left behind, as ``Orchestrator.recover`` reads it of a store: the outbox
    rows it leased and the threads it held (this node's own after a restart, or a dead node's)."""

    def __init__(self, store: s.Store, node: str) -> None:
        self.store, self.node = store, node

    async def recover_outbox(self, *, reason: str, now_ms: int) -> tuple[list[s.EffectRow], int]:
        return await self.store.recover_outbox(reason=reason, now_ms=now_ms, node=self.node)

    def threads_needing_recovery(self) -> list[str]:
        form = store_pg._FORMS[s._THREADS_NEEDING_RECOVERY]
        return [r[0] for r in self.store.read(sql.SQL(
            f"SELECT thread_id FROM ({form}) needing WHERE {_HELD_BY}"), (self.node,))]

    def runs_awaiting_slot(self) -> list[tuple[str, str, str]]:
        form = store_pg._FORMS[s._RUNS_AWAITING_SLOT].replace("ORDER BY", f"AND {_HELD_BY}\n"
                                                              "ORDER BY")
        return [(r[0], r[1], r[2]) for r in self.store.read(sql.SQL(form), (self.node,))]


class ClusterProviders(Mapping[str, ProviderInfo]):
    """The provider instances this node runs, and those only other live nodes run (as they
    published them; ``elsewhere``): what decide and the tools check a target against, so a
    thread made here may run on another node (the claim sends its work where it can run)."""

    def __init__(self, local: Mapping[str, ProviderInfo]) -> None:
        self.local = local
        self.elsewhere: dict[str, ProviderInfo] = {}
        self.nodes: dict[str, list[str]] = {}  # instance id -> the nodes that run it

    def __getitem__(self, instance_id: str) -> ProviderInfo:
        info = self.local.get(instance_id)
        if info is not None and (info.available or instance_id not in self.elsewhere):
            return info
        return self.elsewhere[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self.local, *self.elsewhere]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self.local, *self.elsewhere]))

    def runnable(self) -> list[dict[str, Any]]:
        """This node's available instances, as published for the others."""
        return [dataclasses.asdict(info) for info in self.local.values() if info.available]

    def learn(self, nodes: Sequence[tuple[str, str]]) -> None:
        """(node id, providers JSON) of the live nodes, this one included."""
        elsewhere: dict[str, ProviderInfo] = {}
        runs: dict[str, list[str]] = {}
        for node, published in nodes:
            for entry in json.loads(published):
                runs.setdefault(entry["instance_id"], []).append(node)
                elsewhere[entry["instance_id"]] = ProviderInfo(**{
                    **entry, "capabilities": Capabilities(**entry["capabilities"])})
        self.elsewhere, self.nodes = elsewhere, runs


class Node:
    """This process as a node of the database's cluster: ``await Node.join(...)`` before the
    orchestrator recovers and starts. Its connections (and the id's lock) end with the process;
    its row stays: a node that does not come back within DEAD_MS is recovered by another, one
    that does recovers its own threads."""

    def __init__(self, store: s.Store, orch: Any, node: str, *, projects: Sequence[str],
                 slots: int) -> None:
        self.store, self.orch, self.id = store, orch, node
        self.providers = ClusterProviders(orch.providers)
        self._projects, self._slots = list(projects), slots
        self._lock: Any = None  # the connection holding this id's lock, and heartbeating
        self._listen: Any = None
        self._last = 0  # the last sequence absorbed
        self._own: set[int] = getattr(store.engine, "writers", set())

    @classmethod
    async def join(cls, store: s.Store, orch: Any, node: str, *, url: str,
                   projects: Sequence[str], slots: int) -> Node:
        """Take the id's lock (refused: StoreError), LISTEN, make the orchestrator shared, and
        register; then ``orch.recover(of=self.work(self.id))`` settles this node's last life."""
        self = cls(store, orch, node, projects=projects, slots=slots)
        try:
            self._lock = await psycopg.AsyncConnection.connect(url, autocommit=True)
            held = await (await self._lock.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))",
                                                   (_NODE_LOCK, node))).fetchone()
            if not (held and held[0]):
                await self._lock.close()
                raise s.StoreError(f"another t3 server runs as node {node!r} on this database "
                                   "(give each node its own [node] id or data directory)")
            self._listen = await psycopg.AsyncConnection.connect(url, autocommit=True)
            await self._listen.execute("LISTEN t3_events")
            await self._listen.execute("LISTEN t3_effects")
            await self._listen.execute("LISTEN t3_nodes")
            await self._lock.execute(
                "INSERT INTO cluster_nodes (node_id, started_at, heartbeat_ms, providers_json, "
                f"projects_json, slots) VALUES (%s, %s, {_DB_MS}, %s, %s, %s) ON CONFLICT "
                "(node_id) DO UPDATE SET started_at = excluded.started_at, "
                "heartbeat_ms = excluded.heartbeat_ms, providers_json = excluded.providers_json, "
                "projects_json = excluded.projects_json, slots = excluded.slots",
                (node, s._now_iso(), json.dumps(self.providers.runnable()),
                 json.dumps(self._projects), self._slots))
            await self._lock.execute("NOTIFY t3_nodes")  # the others learn what it runs
            await self._learn()
        except psycopg.Error as exc:
            raise s.StoreError(f"cannot join the cluster: {exc}") from exc
        self._last = store.max_sequence()  # after LISTEN: a commit from now on is noticed
        orch.shared, orch.worker_id, orch.providers = True, node, self.providers
        orch.spawn(self._follow(), "cluster-follow")
        orch.spawn(self._beat(), "cluster-heartbeat")
        log.info("joined the database as node %s", node)
        return self

    def work(self, node: str) -> NodeWork:
        return NodeWork(self.store, node)

    # -- seeing every node's commits ------------------------------------------------------------

    async def _follow(self) -> None:
        self._catch_up()
        async for notice in self._listen.notifies():
            if notice.channel == "t3_events":
                self._catch_up()
            elif notice.channel == "t3_nodes":
                await self._learn()
            elif notice.pid not in self._own:  # this process's changes woke its worker already
                self.orch.absorb([])

    def _catch_up(self) -> None:
        while rows := self.store.read(_EVENTS_AFTER, (self._last,)):
            self.orch.absorb(rows)
            self._last = rows[-1]["sequence"]
            if len(rows) < _PAGE:  # the last page: no read to find it empty
                break

    # -- liveness -------------------------------------------------------------------------------

    async def _beat(self) -> None:
        reached = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if asyncio.get_running_loop().time() - reached > DEAD_MS / 1000:
                log.critical("node %s could not reach the database for %d ms: other nodes may "
                             "have recovered its work; stopping", self.id, DEAD_MS)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            try:
                beat = await self._lock.execute(
                    f"UPDATE cluster_nodes SET heartbeat_ms = {_DB_MS}, providers_json = %s "
                    "WHERE node_id = %s", (json.dumps(self.providers.runnable()), self.id))
                dead = await (await self._lock.execute(
                    f"DELETE FROM cluster_nodes WHERE heartbeat_ms < {_DB_MS} - %s "
                    "AND node_id <> %s "
                    "RETURNING node_id", (DEAD_MS, self.id))).fetchall()
                await self._learn()
            except psycopg.Error as exc:  # the database is away: others cannot see us either
                log.error("node %s cannot reach the database: %s", self.id, exc)
                continue
            reached = asyncio.get_running_loop().time()
            if beat.rowcount == 0:
                log.critical("node %s was declared dead by another node (no heartbeat for %d ms) "
                             "and its work recovered there; stopping", self.id, DEAD_MS)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            for (node,) in dead:
                await self._recover(node)

    async def _learn(self) -> None:
        """What the live nodes run (for the capabilities and a new thread's target)."""
        cursor = await self._lock.execute(
            "SELECT node_id, providers_json FROM cluster_nodes "
            f"WHERE heartbeat_ms >= {_DB_MS} - %s "
            "ORDER BY node_id", (DEAD_MS,))
        self.providers.learn(await cursor.fetchall())

    async def _recover(self, node: str) -> None:
        log.warning("node %s stopped beating: recovering its threads here", node)
        try:
            recovered = await self.orch.recover(
                reason=f"The t3 node {node} running this run stopped; its provider process is "
                       "gone.", of=self.work(node))
            await self.store.write(lambda conn: conn.execute(
                "DELETE FROM thread_holders WHERE node_id = ?", (node,)))
            self.orch.absorb([])  # its rows are in line again: no notice of ours wakes the worker
        except Exception as exc:  # the next beat does not see it again: say so loudly
            log.error("recovering node %s's threads failed: %s", node, exc, exc_info=exc)
            return
        log.warning("recovered %d thread(s) of node %s", len(recovered), node)
