"""Run a many-node program (tests/model_ref.py) on a simulated cluster and check it.

The cluster is tests/cluster.py's: each node is the real filesystem core, uploader, coordinator
and listing over its own staging directory, all over one memory store, in virtual time (the
autojump clock). Each node's store client can fail requests (transient errors), be slow, and
has a bandwidth, so that uploads are in flight while other nodes act.

The job's part of the rules (docs/SEMANTICS.md, "Many nodes, one checkpoint"), played before
each operation of node Y:
- a file another node X wrote is changed (written, renamed, removed, linked, evicted) by Y
  only once X's version is in the store (``sync`` of X: close-to-commit) and Y sees it;
- a path another node renamed or removed (or anything above or below it) is touched by Y only
  once that change is in the store and Y's listing shows it;
- a directory is renamed or removed by Y with no wait for the files closed in it: the
  barrier before the operation orders only the closes (a tmp-dir commit right after the
  shards' close, a rank-0 rotation), and ckptfs must carry every file closed before.

Checked: at every put and copy, that the object holds bytes closed under that name (or moved
there) and that a commit marker has every file closed before it in its directory; after
quiescence (every node synced, listings refreshed, records read), that the store, every
node's view and a fresh node's view equal the reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ckptfs import errors
from ckptfs.config import DEFAULT_COMMIT_MARKERS, KeepRules
from ckptfs.engine.fs import Filesystem
from ckptfs.lifecycle.checkpoints import HOT
from ckptfs.lifecycle.retention import Action, Policy, Retention, Snapshot, TierPolicy, plan
from ckptfs.state.journal import ROOT_INODE, Row
from ckptfs.store.tiers.base import CONTROL_PREFIX, Kind
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.cluster import (
    SETTINGS,
    Node,
    ObservedTier,
    durable_point,
    power_loss,
    run_node,
    write_file,
)
from tests.model_ref import Op, Reference, content, is_marker

log = logging.getLogger(__name__)

BANDWIDTH = 4000.0  # bytes per second per node: an upload takes 0-40 s
SYNC_LIMIT = 3600.0  # virtual seconds a sync may take before it counts as a hang
_CONTENT = re.compile(rb"^<(\d+):")
# Clock skew between nodes: every task of node i sees ``time.time()`` off by SKEWS[i]
# (contextvars follow a node's tasks, which it spawns from its own).
NODE: contextvars.ContextVar[int | None] = contextvars.ContextVar("model_node", default=None)
SKEWS: dict[int, float] = {}
_REAL_TIME = time.time


def _skewed_time() -> float:
    node = NODE.get()
    return _REAL_TIME() + (SKEWS.get(node, 0.0) if node is not None else 0.0)


@contextlib.contextmanager
def as_node(i: int) -> Iterator[None]:
    """What the runner does on node ``i`` (a request, a listing) sees node ``i``'s clock."""
    token = NODE.set(i)
    try:
        yield
    finally:
        NODE.reset(token)


def content_id(body: bytes) -> int | None:
    found = _CONTENT.match(body)
    return int(found.group(1)) if found else None


@dataclass
class Plan:
    node: int
    run: int  # which run of that node made it (a restart ends its plans)
    retention: Retention
    actions: list[Action]
    snapshot: Snapshot
    planned: dict[str, int]  # path -> content id the plan saw
    checkpoint: str
    touched: bool = False  # its node changed the checkpoint since


@dataclass
class Runner:
    nursery: trio.Nursery
    root: Path
    store: str
    count: int
    ref: Reference = field(default_factory=Reference)
    nodes: dict[int, Node] = field(default_factory=dict)
    runs: dict[int, int] = field(default_factory=dict)
    boots: dict[int, int] = field(default_factory=dict)
    durable: dict[int, Path] = field(default_factory=dict)
    since_durable: dict[int, list[int]] = field(default_factory=dict)  # inodes written since
    renamed: set[int] = field(default_factory=set)  # nodes that changed names since then
    plans: dict[int, Plan] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)

    @property
    def objects(self) -> dict[str, object]:
        return store_named(self.store)  # type: ignore[return-value]

    # -- nodes --------------------------------------------------------------------------------

    async def start(self, i: int) -> Node:
        tier = FaultyTier(ObservedTier(self.store, self.stored), bandwidth=BANDWIDTH, seed=i)
        boot = self.boots.setdefault(i, 1)
        with as_node(i):  # the node's tasks inherit it
            node: Node = await self.nursery.start(functools.partial(
                run_node, self.dir(i), self.store, tier=tier, node=f"n{i}",
                boot=f"boot-{boot}", lazy=True))
        self.nodes[i] = node
        self.runs[i] = self.runs.get(i, 0) + 1
        self.mark_durable(i)
        self._follow_durability(i, node)
        return node

    def _follow_durability(self, i: int, node: Node) -> None:
        """A power loss keeps what the node's journal made durable itself (an fsync, a
        sweep's listing), not only what the node had at its last sync or start: the
        journal's durable point moves with ``make_durable`` (its data files' pages do not)."""
        journal = node.fs.journal
        durable, durable_async = journal.make_durable, journal.make_durable_async

        def now_durable() -> None:
            if self.nodes.get(i) is node:
                self.durable[i] = durable_point(self.dir(i), journal)
                self.renamed.discard(i)

        def made_durable() -> None:
            durable()
            now_durable()

        async def made_durable_async() -> None:
            await durable_async()
            now_durable()

        journal.make_durable = made_durable  # type: ignore[method-assign]
        journal.make_durable_async = made_durable_async  # type: ignore[method-assign]

    def dir(self, i: int) -> Path:
        return self.root / f"node{i}"

    def mark_durable(self, i: int) -> None:
        """What a power loss of the node from now on leaves of its journal."""
        self.durable[i] = durable_point(self.dir(i), self.nodes[i].fs.journal)
        self.since_durable[i] = []
        self.renamed.discard(i)

    async def sync(self, i: int) -> None:
        """``ckptfs sync`` on node ``i``: everything it did so far is in the store."""
        node = self.nodes[i]
        with trio.move_on_after(SYNC_LIMIT) as scope:
            await node.uploader.wait_until_done(node.uploader.last_seq())
        if scope.cancelled_caught:
            self.violations.append(f"node {i}: sync did not return within {SYNC_LIMIT:.0f}s "
                                   f"({len(node.uploader.outstanding())} items left, "
                                   f"held markers {node.uploader.held_markers()})")
            self.violations += [self._stuck(j) for j in sorted(self.nodes)]
            raise Hang()

    def _stuck(self, i: int) -> str:
        """What node ``i`` has left (for a hang's report)."""
        node = self.nodes[i]
        def what(key: tuple[str, int]) -> str:
            if key[0] == "ino":
                path = node.fs.journal.path_of(key[1])
                return f"{path.decode() if path is not None else '?'} ({key[1]})"
            return f"{key[0]} {key[1]}"

        items = ", ".join(f"{what(w.key)} #{w.seq}{' (' + w.error + ')' if w.error else ''}"
                          for w in sorted(node.uploader.outstanding(), key=lambda w: w.seq))
        return (f"  node {i}: items [{items}]; waiting for {node.coordinator.waiting_for}, "
                f"hold {node.coordinator.hold is not None}")

    async def restart(self, i: int, down: float, power: bool) -> None:
        node = self.nodes.pop(i)
        node.kill()
        await node.stopped.wait()
        written = self.since_durable.get(i, [])
        if power:
            power_loss(self.dir(i), self.durable[i], lost_data=tuple(written))
            self.boots[i] += 1
        await trio.sleep(down)
        node = await self.start(i)
        if node.coordinator.hold is not None:
            await self.operator(i, node)

    async def operator(self, i: int, node: Node) -> None:
        """A node back from a power loss holds; the operator rewrites on it what it lost (the
        files it closed whose version the store does not have, where they are now: another
        node may have renamed their directory meanwhile; not a name another node linked to
        such a file, nor one another node exchanged, which that node uploads; as the job
        would, only once what other nodes
        changed of them is in the store and seen here), then forgets its own id there: the
        shards first, then the commit markers, each in the order the job closed them (as
        docs/SEMANTICS.md asks of an operator after a power loss)."""
        for path, cid in sorted(self.ref.files.items(),
                                key=lambda item: (is_marker(item[0]), item[1])):
            group = self.ref.links.get(path)
            if self.ref.exchanged.get(path, self.ref.closed_by.get(cid)) != i or \
                    (group is not None and group[0] != i):
                # Another node's to upload: a name another node linked, or exchanged (that
                # node uploads both names again from its copies).
                continue
            if self._holds(path, cid) or self._kept_elsewhere(cid):
                continue
            # The operator keeps the job's rules too: a file another node changed since (an
            # exchange, a rename) is rewritten only once that change is in the store and
            # this node sees it; it may then need no rewrite at all. The other node's data
            # only: its markers wait for this node, which holds.
            paths, actors, _ = self._actors(Op("write", i, path))
            for x in sorted(actors):
                await self.settle_data(x)
            if actors:
                await self.refresh(i, paths)
                if self._holds(path, cid):
                    continue
            await node.coordinator.enlist()
            await write_file(node.fs, path, content(cid, self.ref.closed_at[cid]))
            self.steps.append(f"operator rewrote {path} on node {i}")
        await node.coordinator.forget(node.name)

    def _holds(self, path: str, cid: int) -> bool:
        obj = self.objects.get(path)
        return obj is not None and content_id(obj.body) == cid  # type: ignore[attr-defined]

    def _kept_elsewhere(self, cid: int) -> bool:
        """Whether the store holds the version ``cid`` under another key: not lost, only not
        moved yet (another node renamed its directory, and that rename's sweep carries it).
        Rewritten, it would race the sweep's copy of the same name."""
        return any(not key.startswith(CONTROL_PREFIX)
                   and content_id(obj.body) == cid  # type: ignore[attr-defined]
                   for key, obj in self.objects.items())

    async def settle_data(self, i: int) -> None:
        """Node ``i``'s files and directories (not its markers) are in the store."""
        uploader = self.nodes[i].uploader
        upto = uploader.last_seq()
        with uploader.gate.bypassed(), trio.move_on_after(SYNC_LIMIT) as scope:
            while uploader.data_outstanding(upto):
                await uploader.wait_progress()
        if scope.cancelled_caught:
            self.violations.append(f"node {i}: its data did not reach the store within "
                                   f"{SYNC_LIMIT:.0f}s")
            raise Hang()

    # -- the invariants at every step -------------------------------------------------------

    def stored(self, key: str) -> None:
        if key.startswith(CONTROL_PREFIX) or key.endswith("/"):
            return
        obj = self.objects.get(key)
        if obj is None or obj.meta.kind is not Kind.FILE:  # type: ignore[attr-defined]
            return
        cid = content_id(obj.body)  # type: ignore[attr-defined]
        if cid is None or cid not in self.ref.history.get(key, set()):
            self.violations.append(f"{key} stored with bytes never closed under that name "
                                   f"(close {cid})")
            return
        found = self.ref.markers.get(cid)
        if not is_marker(key) or found is None:
            return
        made, snapshot = found
        directory = key.rpartition("/")[0]
        for name, wanted in snapshot.items():
            path = f"{directory}/{name}"
            if path not in self.ref.files or self.ref.arrived.get(path, 0) > made:
                continue  # removed, renamed or replaced since: the marker does not cover it
            there = self.objects.get(path)
            have = None if there is None else content_id(there.body)  # type: ignore
            later = {c for c in self.ref.history.get(path, set()) if c > wanted}
            if have not in {wanted, self.ref.files[path], *later}:
                self.violations.append(
                    f"marker {key} (close {cid}) stored while {path} holds "
                    f"{'nothing' if have is None else f'close {have}'}, not close {wanted}")

    # -- the job's part of the rules --------------------------------------------------------

    def _related(self, a: str, b: str) -> bool:
        return a == b or a.startswith(b + "/") or b.startswith(a + "/") or not a or not b

    async def prepare(self, op: Op) -> None:
        """What the job's barrier and rules give before ``op`` (module docstring)."""
        paths, actors, removed = self._actors(op)
        for x in sorted(actors):
            await self.sync(x)
        if op.kind != "write" or actors:
            await self.refresh(op.node, paths + sorted(p for _, p in removed))

    def _actors(self, op: Op) -> tuple[list[str], set[int], set[tuple[int, str]]]:
        """The paths ``op`` touches, the other nodes whose changes it must wait for, and the
        names of a hard-linked file that other nodes removed."""
        paths = [p for p in (op.a, op.b) if p or op.kind in ("evict", "rmtree")]
        actors = {x for p, x in self.ref.moved_by.items()
                  if any(self._related(p, q) for q in paths)}
        file_level = op.kind in ("write", "unlink", "link", "exchange") or (
            op.kind == "rename" and op.a in self.ref.files)
        if file_level:
            for q in paths:
                actors |= {x for p, x in self.ref.writer.items() if self._related(p, q)}
        # A write through a hard link: the daemon is told the inode, never the name, so the
        # writing node must see first what other nodes removed of the file's names (a name
        # removed meanwhile would take the new bytes too; docs/HARD_LINKS.md).
        group = self.ref.links.get(op.a) if op.kind == "write" else None
        removed = self.ref.unlinked_from.get(group, set()) if group else set()
        actors |= {x for x, _ in removed}
        actors.discard(op.node)
        return paths, actors, removed

    async def refresh(self, i: int, paths: list[str]) -> None:
        """Node ``i`` lists anew the directories of ``paths`` (as a lookup would, past the
        listing's ttl)."""
        with as_node(i):
            await self._refresh(i, paths)

    async def _refresh(self, i: int, paths: list[str]) -> None:
        # Until the node's view no longer shows what the job removed there: a directory whose
        # entries are decided first goes at a second listing (listing.py ``_entries_first``).
        for _ in range(10):
            await self._refresh_once(i, paths)
            shown = names(self.nodes[i].fs)
            around = {"/".join(p.split("/")[:n]) for p in paths if p
                      for n in range(1, p.count("/") + 2)}
            # ... and below them (a directory renamed or removed carries its subtree).
            around |= {q.rstrip("/") for q in shown for p in paths if p
                       and q.startswith(p + "/")}
            gone = [p for p in around for q in (p, p + "/")
                    if q in shown and p not in self.ref.files and p not in self.ref.dirs]
            if not gone:
                return
            await trio.sleep(SETTINGS.metadata_ttl + 1)

    async def _refresh_once(self, i: int, paths: list[str]) -> None:
        fs = self.nodes[i].fs
        assert fs.lister is not None
        seen: set[str] = set()
        for path in paths:
            parts = path.split("/") if path else []
            for depth in range(len(parts) + 1):
                where = "/".join(parts[:depth])
                if where in seen:
                    continue
                seen.add(where)
                row = await lookup(fs, where)
                if row is None or not stat.S_ISDIR(row.mode):
                    break
                # Until a listing succeeds: the rule is that the node sees the change (a
                # store error injected into the listing would leave it with a stale view).
                for attempt in range(12):
                    if await fs.lister.refresh(row, current=True):
                        break
                    await trio.sleep(2 ** min(attempt, 5))

    # -- operations ---------------------------------------------------------------------------

    async def run(self, ops: list[Op]) -> None:
        for i in range(self.count):
            await self.start(i)
        for op in ops:
            if not self.ref.can(op) or op.node not in self.nodes:
                self.skipped.append(f"{op} (not valid any more)")
                continue
            self.steps.append(repr(op))
            if op.kind not in ("pause", "plan", "apply", "skew"):
                await self.prepare(op)
            done = await self.do(op)
            if done and op.kind in ("rename", "exchange", "unlink", "rmtree", "link"):
                self.renamed.add(op.node)
            if done:
                for plan_ in self.plans.values():
                    if plan_.node == op.node and op.kind in (
                            "write", "rename", "unlink", "rmtree", "link", "exchange") and \
                            any(self._related(p, plan_.checkpoint) and p
                                for p in (op.a, op.b)):
                        plan_.touched = True
                self.ref.apply(op)

    async def do(self, op: Op) -> bool:
        """Make ``op`` on its node; False if it could not be made (then the reference does
        not apply it either, and the step says why). A request the store failed (an error
        injected) is what a job sees as EIO: it is made again, as a job would retry it;
        the operations that can fail so (a rename or a removal that lists a directory, a
        retention round) fail before they change anything, or go on where they stopped."""
        for attempt in range(10):
            try:
                with as_node(op.node):
                    return await self._do(op)
            except errors.StoreUnavailable as exc:
                self.steps.append(f"  {op}: {exc}; again")
                await trio.sleep(2 ** attempt)
        return self.skip(op, "the store kept failing")

    async def _do(self, op: Op) -> bool:
        node = self.nodes.get(op.node)
        k = op.kind
        try:
            if k == "write":
                assert node is not None
                await node.coordinator.enlist()
                cid = self.ref.next_cid  # the id the reference gives this close
                ino = await write_file(node.fs, op.a, content(cid, op.a))
                self.since_durable.setdefault(op.node, []).append(ino)
            elif k in ("rename", "exchange"):
                assert node is not None
                await node.coordinator.enlist()
                src = await self.entry(node.fs, op.a)
                dst_parent = await self.entry(node.fs, op.b.rpartition("/")[0])
                if src is None or dst_parent is None:
                    return self.skip(op, "not visible on the node")
                flags = 2 if k == "exchange" else 0  # RENAME_EXCHANGE
                await node.fs.rename(src.parent or ROOT_INODE, src.name or b"",
                                     dst_parent.ino, op.b.rpartition("/")[2].encode(), flags)
            elif k == "unlink":
                assert node is not None
                await node.coordinator.enlist()
                row = await self.entry(node.fs, op.a)
                if row is None:
                    return self.skip(op, "not visible on the node")
                await node.fs.unlink(row.parent or ROOT_INODE, row.name or b"")
            elif k == "rmtree":
                assert node is not None
                await node.coordinator.enlist()
                if not await self.rmtree(op.node, op.a):
                    return self.skip(op, "not visible on the node")
            elif k == "link":
                assert node is not None
                await node.coordinator.enlist()
                src = await lookup(node.fs, op.a)
                dst_parent = await self.entry(node.fs, op.b.rpartition("/")[0])
                if src is None or dst_parent is None:
                    return self.skip(op, "not visible on the node")
                await node.fs.link(src.ino, dst_parent.ino, op.b.rpartition("/")[2].encode())
            elif k == "evict":
                assert node is not None
                row = await lookup(node.fs, op.a)
                if row is not None:
                    await node.fs.evict_tree(row.ino)
            elif k in ("kill", "power"):
                power = k == "power" and self.may_lose_power(op.node)
                await self.restart(op.node, float(op.n), power)
            elif k == "fault":
                assert node is not None
                node.tier.fail_next = op.n
            elif k == "slow":
                assert node is not None
                node.tier.latency = op.n * 0.5
            elif k == "skew":
                SKEWS[op.node] = float(op.n)
            elif k == "pause":
                await trio.sleep(op.n)
            elif k == "sync":
                await self.sync(op.node)
                self.mark_durable(op.node)
            elif k == "plan":
                await self.plan(op)
            elif k == "apply":
                await self.apply(op)
        except (errors.NotFound, errors.NotEmpty, errors.AlreadyExists) as exc:
            return self.skip(op, f"{type(exc).__name__}: {exc}")
        return True

    def may_lose_power(self, i: int) -> bool:
        """A power loss is modelled for a node that changed no name since its durable point
        (a lost rename or removal is the job's to redo, not ckptfs's: like rank 0's in
        tests/test_cluster_sim_renames.py); otherwise the node is only killed."""
        return i not in self.renamed

    def skip(self, op: Op, why: str) -> bool:
        self.skipped.append(f"{op}: {why}")
        return False

    async def entry(self, fs: Filesystem, path: str) -> Row | None:
        """The name row of ``path`` (its parent's entry), None if not visible."""
        if not path:
            return fs.ns.get(ROOT_INODE)
        parent = await lookup(fs, path.rpartition("/")[0])
        if parent is None:
            return None
        try:
            await fs.lookup(parent.ino, path.rpartition("/")[2].encode())
            return fs.ns.entry(parent.ino, path.rpartition("/")[2].encode())
        except errors.NotFound:
            return None

    async def rmtree(self, i: int, path: str) -> bool:
        """``shutil.rmtree`` on node ``i``, again if a file landed meanwhile (ENOTEMPTY)."""
        fs = self.nodes[i].fs
        assert fs.lister is not None
        for _ in range(5):
            row = await lookup(fs, path)
            if row is None:
                await self.refresh(i, [path])
                row = await lookup(fs, path)
                if row is None:
                    return False
            await fs.lister.refresh_tree(row, current=True)
            try:
                await remove_tree(fs, row)
                return True
            except errors.NotEmpty:
                continue
        raise errors.NotEmpty(f"{path}: files kept landing in it")

    async def plan(self, op: Op) -> None:
        node = self.nodes[op.node]
        policy = Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                         TierPolicy("warm", KeepRules(last=1), "memory:w", "memory")))
        retention = Retention(policy, {"warm": node.tier}, fs=node.fs,
                              markers=DEFAULT_COMMIT_MARKERS)
        snapshot = await retention.collect()
        actions = [a for a in await trio.to_thread.run_sync(plan, snapshot.checkpoints,
                                                             policy, snapshot.now)
                   if a.kind == "delete" and a.checkpoint == op.a]
        # What the plan saw: the store's version of each object it listed, this node's own
        # of each file only it has.
        planned: dict[str, int] = {}
        for r in snapshot.remote.get("warm", []):
            obj = self.objects.get(r.key)
            cid = None if obj is None else content_id(obj.body)  # type: ignore[attr-defined]
            if cid is not None and r.key.split("/")[0] == op.a:
                planned[r.key] = cid
        for key in snapshot.local:
            if key.split("/")[0] == op.a and key not in planned and key in self.ref.files:
                planned[key] = self.ref.files[key]
        self.plans[op.n] = Plan(op.node, self.runs[op.node], retention, actions, snapshot,
                                planned, op.a)
        self.steps.append(f"  plan {op.n}: {[a.describe() for a in actions]} of {planned}")

    async def apply(self, op: Op) -> None:
        found = self.plans.pop(op.n, None)
        if found is None or not found.actions or self.runs.get(found.node) != found.run:
            return  # nothing planned, or its node restarted since (the plan went with it)
        with as_node(found.node):
            result = await found.retention.apply(found.actions, found.snapshot)
        done = bool(result.done)
        if found.touched:
            if done:
                self.violations.append(f"plan {op.n}: {found.checkpoint} was deleted though "
                                       f"node {found.node} wrote to it since the plan")
            return
        if not done:
            self.violations.append(f"plan {op.n}: the deletion of {found.checkpoint} failed: "
                                   f"{result.failed}")
            return
        for path, cid in found.planned.items():
            if self.ref.files.get(path) == cid:
                self.ref.unlink(found.node, path)
        # Retention deletes the checkpoint's directories too (``rm -r``), those that hold no
        # file the plan did not see.
        for path in self.ref.under(found.checkpoint):
            if path in self.ref.dirs and not any(
                    f.startswith(path + "/") for f in self.ref.files):
                self.ref.rmtree(found.node, path)
        self.steps.append(f"  applied plan {op.n}")

    # -- the end ------------------------------------------------------------------------------

    async def quiesce(self) -> None:
        """Every node up, no faults, everything synced, listings and records read, until the
        store stops changing."""
        for node in self.nodes.values():
            node.tier.fail_next = 0
            node.tier.latency = 0.0
        last: dict[str, object] | None = None
        for _ in range(6):
            await trio.sleep(SETTINGS.metadata_ttl + 1)
            for i, node in sorted(self.nodes.items()):
                assert node.fs.lister is not None
                with as_node(i):
                    await node.fs.lister.apply_records()
                    await node.fs.lister.refresh_tree(node.fs.ns.get(ROOT_INODE),
                                                      current=True)
            for i in sorted(self.nodes):
                await self.sync(i)
            now = {k: getattr(v, "tag", None) for k, v in self.objects.items()
                   if not k.startswith(CONTROL_PREFIX)}
            for i, node in sorted(self.nodes.items()):  # and the views (names only)
                now.update({f"{i}:{p}": None for p in names(node.fs)})
            if now == last:
                return
            last = now

    def store_files(self) -> dict[str, bytes]:
        """Every file of the store, and every directory (its marker or a key beneath it)."""
        files = {k: v.body for k, v in self.objects.items()  # type: ignore[attr-defined]
                 if not k.startswith(CONTROL_PREFIX) and not k.endswith("/")
                 and v.meta.kind is Kind.FILE}  # type: ignore[attr-defined]
        dirs = {k for k in self.objects if k.endswith("/") and not k.startswith(CONTROL_PREFIX)}
        for key in files:
            parts = key.split("/")
            dirs |= {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}
        return {**files, **{d: DIRECTORY for d in dirs}}

    async def check(self) -> None:
        expected = self.ref.expected()
        expected.update({d + "/": DIRECTORY for d in self.ref.dirs})
        self.compare("the store", self.store_files(), expected)
        for i, node in sorted(self.nodes.items()):
            with as_node(i):
                self.compare(f"node {i}'s view", await view(node.fs), expected)
        fresh = await self.nursery.start(functools.partial(
            run_node, self.root / "fresh", self.store, node="fresh", lazy=True,
            tier=FaultyTier(MemoryTier("warm", f"memory://{self.store}", self.store))))
        self.compare("a fresh node's view", await view(fresh.fs), expected)
        await fresh.stop()

    def compare(self, what: str, got: dict[str, bytes], expected: dict[str, bytes]) -> None:
        for path in sorted(set(got) | set(expected)):
            have, want = got.get(path), expected.get(path)
            if have == want:
                continue
            self.violations.append(f"{what}: {path} holds {_describe(have)}, the job left "
                                   f"{_describe(want)}")

    async def stop(self) -> None:
        for node in list(self.nodes.values()):
            await node.stop()


def _describe(body: bytes | None) -> str:
    if body == DIRECTORY:
        return "a directory"
    return "nothing" if body is None else f"close {content_id(body)}"


class Hang(Exception):
    """A sync that never returned (recorded as a violation)."""


async def lookup(fs: Filesystem, path: str) -> Row | None:
    """The row (the kernel's: a hard link's head) at ``path``, None if not visible."""
    row = fs.ns.get(ROOT_INODE)
    for part in path.split("/") if path else []:
        try:
            row = await fs.lookup(row.ino, part.encode())
        except (errors.NotFound, errors.NotADirectory):
            return None
    return row


async def remove_tree(fs: Filesystem, row: Row) -> None:
    """``rm -r`` of the directory ``row`` as the node sees it."""
    for child in list(fs.ns.children(row.ino, 0)):
        assert child.name is not None
        if stat.S_ISDIR(child.mode):
            await remove_tree(fs, child)
        else:
            await fs.unlink(row.ino, child.name)
    assert row.name is not None
    await fs.rmdir(row.parent or ROOT_INODE, row.name)


DIRECTORY = b"<directory>"


def names(fs: Filesystem) -> set[str]:
    """Every path the node shows (files and ``dir/``), from its namespace as it is."""
    out: set[str] = set()

    def walk(ino: int, prefix: str) -> None:
        for child in list(fs.ns.children(ino, 0)):
            assert child.name is not None
            path = prefix + os.fsdecode(child.name)
            if stat.S_ISDIR(child.mode):
                out.add(path + "/")
                walk(child.ino, path + "/")
            else:
                out.add(path)

    walk(ROOT_INODE, "")
    return out


async def view(fs: Filesystem) -> dict[str, bytes]:
    """path -> bytes of every regular file the node shows, read through its core, and
    ``path/`` -> DIRECTORY for every directory."""
    out: dict[str, bytes] = {}

    async def walk(ino: int, prefix: str) -> None:
        for child in list(await fs.readdir(ino, 0)):
            assert child.name is not None
            path = prefix + os.fsdecode(child.name)
            if stat.S_ISDIR(child.mode):
                out[path + "/"] = DIRECTORY
                await walk(child.ino, path + "/")
            elif stat.S_ISREG(child.mode):
                row = await fs.lookup(ino, child.name)
                try:
                    fh = await fs.open(row.ino, os.O_RDONLY)
                except errors.CkptfsError as exc:
                    out[path] = f"<unreadable: {type(exc).__name__}>".encode()
                    continue
                try:
                    out[path] = await fs.read(fh, 0, row.size + 1)
                except errors.CkptfsError as exc:
                    out[path] = f"<unreadable: {type(exc).__name__}>".encode()
                finally:
                    fs.release(fh)

    await walk(ROOT_INODE, "")
    return out


async def run_program(root: Path, store: str, count: int, ops: list[Op]) -> Runner:
    """Run ``ops`` on ``count`` nodes; the runner's ``violations`` say what went wrong."""
    store_named(store).clear()
    SKEWS.clear()
    time.time = _skewed_time
    try:
        async with trio.open_nursery() as nursery:
            runner = Runner(nursery, root, store, count)
            try:
                await runner.run(ops)
                await runner.quiesce()
                await runner.check()
            except Hang:
                pass
            finally:
                nursery.cancel_scope.cancel()
    finally:
        time.time = _REAL_TIME
    return runner
