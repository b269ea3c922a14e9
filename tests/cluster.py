"""Nodes without a mount: each is the filesystem core, its uploader and its coordinator over
its own staging directory, all over one memory store (the nodes of a training job sharing a
bucket). A node can be killed (its tasks cancelled where they are, nothing deregistered: the
journal is what a SIGKILL leaves) and restarted over the same staging directory.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ckptfs import errors
from ckptfs.cluster.coordination import Coordinator, node_id, node_token
from ckptfs.cluster.noderun import NodeRun
from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.engine.fs import ROOT_CALLER, Filesystem, ReadSettings
from ckptfs.engine.upload import Uploader
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import Staging
from ckptfs.store.tiers.base import Finish, ObjectMeta, Progress, Tier
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier

SETTINGS = ReadSettings(metadata_ttl=5.0, fetch_block_size=256 * 1024, fetch_concurrency=4,
                        readahead_bytes=1024 * 1024)


@dataclass
class Node:
    name: str
    fs: Filesystem
    tier: FaultyTier
    uploader: Uploader
    coordinator: Coordinator
    scope: trio.CancelScope
    stop_requested: trio.Event
    stopped: trio.Event

    async def write(self, path: str, data: bytes) -> None:
        """Write as through the mount: its first change registers the node (mount.py's
        RegisteringOps; free once registered)."""
        await self.coordinator.enlist()
        await write_file(self.fs, path, data)

    def kill(self) -> None:
        """SIGKILL: every task stops where it is; the journal keeps what it recorded, the
        node stays registered."""
        self.scope.cancel()

    async def stop(self) -> None:
        """A clean unmount (uploads in flight stop; it deregisters if nothing is left)."""
        self.stop_requested.set()
        await self.stopped.wait()


async def write_file(fs: Filesystem, path: str, data: bytes, mode: int = 0o644) -> int:
    """Create (or truncate) ``path`` (and its directories) on the core, write ``data``, close
    it as close(2) does (FLUSH, then RELEASE); returns its inode."""
    parent = ROOT_INODE
    parts = path.split("/")
    for part in parts[:-1]:
        try:
            parent = (await fs.lookup(parent, part.encode())).ino
        except errors.NotFound:
            try:
                parent = fs.mkdir(parent, part.encode(), 0o755, ROOT_CALLER).ino
            except errors.AlreadyExists:  # another writer of this node made it meanwhile
                parent = (await fs.lookup(parent, part.encode())).ino
    try:  # written before: a new version, as open(O_TRUNC) makes it
        ino = (await fs.lookup(parent, parts[-1].encode())).ino
        fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    except errors.NotFound:
        fh, row = fs.create(parent, parts[-1].encode(), mode, os.O_WRONLY | os.O_CREAT,
                            ROOT_CALLER)
        ino = row.ino
    await fs.write(fh, 0, data)
    fs.flush(fh)
    fs.release(fh)
    return ino


class ObservedTier(MemoryTier):
    """The shared memory store, calling ``stored(key)`` after every put and copy (the
    simulations check their invariants there, at the moment an object appears)."""

    def __init__(self, store: str, stored: Callable[[str], None]) -> None:
        super().__init__("warm", f"memory://{store}", store)
        self.stored = stored

    async def put_file(self, key: str, source: Path, size: int, meta: ObjectMeta,
                       progress: Progress | None = None, *,
                       finish: Finish | None = None) -> str | None:
        tag = await super().put_file(key, source, size, meta, progress, finish=finish)
        self.stored(key)
        return tag

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        tag = await super().copy(src, dst, if_etag=if_etag)
        self.stored(dst)
        return tag


def make_tier(store: str, wrap: Tier | None = None) -> FaultyTier:
    return FaultyTier(wrap or MemoryTier("warm", f"memory://{store}", store))


async def run_node(
    root: Path, store: str, *, poll: float = 1.0, idle_poll: float = 10.0,
    tier: FaultyTier | None = None, node: str | None = None, boot: str | None = "boot-1",
    lazy: bool = False, register_timeout: float = 300.0,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A node, started with ``nursery.start``: it runs until ``stop()`` or ``kill()``.
    ``boot`` stands for the machine's boot id (noderun.py): a power loss is a kill, the
    journal rolled back (``power_loss``) and a restart with another ``boot``. ``lazy``:
    registered as a mount registers (at start only with work left or a hold, else at its
    first ``write``); otherwise at start, as if it had changed something at once (the tests
    that change the core directly, not through ``write``, need that)."""
    tier = tier or make_tier(store)
    staging = Staging(root)
    staging.prepare()
    journal = Journal(root / "journal.db")
    fs = Filesystem(journal, staging, tier=tier, read=SETTINGS)
    stopped = trio.Event()
    run = NodeRun(root, boot)
    scope: trio.CancelScope | None = None
    try:
        fs.start()
        name = node_id(root, node)
        assert fs.peers is not None
        fs.peers.node = name
        uploader = Uploader(journal, fs.ns, staging, tier, concurrency=2,
                            markers=DEFAULT_COMMIT_MARKERS, min_block=SETTINGS.fetch_block_size,
                            keys=fs.keys, peers=fs.peers, lister=fs.lister)
        fs.listener = uploader
        uploader.requeue_from_journal()
        run.start(name, incomplete=len(
            [r for r in journal.rows_in_states(State.OPEN) if r.incomplete]))
        coordinator = Coordinator(tier, name, uploader, poll=poll,
                                  idle_poll=idle_poll, token=node_token(root), run=run,
                                  register_timeout=register_timeout,
                                  wall=trio.current_time)  # "last seen" on the test's clock
        uploader.coordinator = coordinator
        await coordinator.check_at_mount(enlist=uploader.work_left() or not lazy)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(journal.commit_batches)  # group commit, as mount.py
                await nursery.start(uploader.run)
                await nursery.start(coordinator.run)
                assert fs.fetcher is not None and fs.lister is not None
                fs.fetcher.nursery = nursery
                fs.lister.nursery = nursery  # as mount.py: listings a lookup stopped waiting for
                # As mount.py: what other nodes did to this node's files (peers.py).
                nursery.start_soon(fs.lister.run_records)
                started = Node(coordinator.node, fs, tier, uploader, coordinator, scope,
                               trio.Event(), stopped)
                task_status.started(started)
                await started.stop_requested.wait()
                idle = not uploader.outstanding()  # as mount.py: before the cancellation
                nursery.cancel_scope.cancel()
        if not scope.cancel_called and idle and coordinator.registered:
            await coordinator.deregister()
    finally:
        killed = scope is not None and scope.cancel_called
        if killed:
            # SIGKILL: nothing more is written; what the batch had not committed is in the
            # redo log, which the next start replays.
            journal.abandon()
        else:
            fs.close()
            journal.close()
        if not killed:
            run.stop_clean()  # a kill leaves the record as a SIGKILL does: unclean
        staging.close()
        stopped.set()


def durable_point(root: Path, journal: Journal) -> Path:
    """What a power loss at this moment would leave of a node's journal (its last durable
    point): a consistent copy of it, made with SQLite's backup API beside the live one. The
    node's ``journal`` commits its batch first (group commit): the moment is declared durable,
    as ``make_durable`` would make it."""
    journal.commit_batch()
    copy = root / "journal.durable"
    src = sqlite3.connect(root / "journal.db")
    dst = sqlite3.connect(copy)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return copy


def power_loss(root: Path, durable: Path, lost_data: tuple[int, ...] = ()) -> None:
    """After ``Node.kill()``: the journal rolled back to ``durable`` (its WAL lost) and the
    data files of ``lost_data`` (inodes) emptied, as the page cache held them."""
    for suffix in ("-wal", "-shm", "-redo"):  # never fsynced (the redo log: redo.py)
        (root / ("journal.db" + suffix)).unlink(missing_ok=True)
    os.replace(durable, root / "journal.db")
    for ino in lost_data:
        path = root / "data" / str(ino)
        if path.exists():
            os.truncate(path, 0)
