"""When the daemon's retention task runs after a start, and that a round lets the loop run
(a whole-store round at the mount must not hold the trio thread for seconds at 40,000 files
while a restarting job reads its checkpoint back).

- No round at the start: the first interval round (the whole store, under the lease) comes one
  ``retention_interval`` after the start, the next one an interval later;
- a commit after the start still brings its local round (this node's NVMe copies) once the
  uploader is idle, long before the first interval round;
- the journal walk that pauses between entries never sees an entry twice or not at all when
  entries move meanwhile (it walks again, and at last without pauses).

Rigs as tests/test_retention_scope.py: the memory tier, ``Filesystem`` + ``Uploader`` without
a mount, trio's autojump clock (virtual time: nothing here waits for real time).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
import trio.testing

import ckptfs.lifecycle.retention as retention_mod
from ckptfs.config import KeepRules
from ckptfs.engine.fs import ROOT_CALLER
from ckptfs.lifecycle.checkpoints import HOT, Detector, LocalFile, RowSource, walk_journal
from ckptfs.lifecycle.retention import Policy, Retention, RunResult, TierPolicy
from ckptfs.state.journal import ROOT_INODE, State
from ckptfs.store.tiers.base import Tier
from ckptfs.store.tiers.memory import MemoryTier
from tests.test_retention_nodes import MARKERS, fill, local_node, memory_tiers
from tests.test_retention_sim import write

INTERVAL = 600.0


class Recorded(Retention):
    """Records when (trio time since ``t0``) each round starts, and its scope."""

    t0 = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[float, str]] = []

    async def run_once(self, now: float | None = None, *,
                       scope: Literal["full", "local", "interval"] = "full") -> RunResult:
        self.rounds.append((trio.current_time() - self.t0, scope))
        return await super().run_once(now, scope=scope)


def policy(warm: KeepRules) -> Policy:
    return Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                   TierPolicy("warm", warm, "memory:w", "memory")))


async def save(fs: Any, steps: Iterable[int]) -> None:
    """A checkpoint per step: step_<s>/model.pt and its marker."""
    for s in steps:
        await write(fs, f"step_{s}/model.pt", b"w" * 100)
        await write(fs, f"step_{s}/.metadata", b"m")


async def first_run(tmp_path: Path, tier: Tier, steps: range) -> None:
    """A mount without retention (or one stopped before its round) committed ``steps``: all
    on NVMe and in the store."""
    fs, uploader, journal, staging = await local_node(tmp_path, tier)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            await save(fs, steps)
            await uploader.wait_idle()
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


def store_names(tier: MemoryTier) -> set[str]:
    return {k.split("/")[0] for k in tier.objects if not k.startswith(".ckptfs/")}


def states(fs: Any) -> dict[str, State]:
    out = {}
    for top in fs.ns.children(ROOT_INODE, 0):
        for child in fs.ns.children(top.ino, 0):
            out[f"{top.name.decode()}/{child.name.decode()}"] = child.state
    return out


async def test_no_round_at_the_start_the_first_interval_round_one_interval_later(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Other nodes' step_1..3 in the store, this node's step_4 and step_5 on NVMe; hot keeps
    the last 1, warm the last 2. After a restart nothing is listed, evicted or deleted until
    one interval has passed (fails with a round at the start: it deleted step_1..3 and
    evicted step_4 at once); then the interval round applies the whole policy, and the next
    comes one interval later."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    assert isinstance(inner, MemoryTier)
    await fill(inner, tmp_path, range(1, 4))
    await first_run(tmp_path, inner, range(4, 6))
    before = dict(inner.objects)

    fs, uploader, journal, staging = await local_node(tmp_path, inner)
    uploader.requeue_from_journal()
    retention = Recorded(policy(KeepRules(last=2)), tiers, fs=fs, markers=MARKERS, node="b")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            retention.t0 = trio.current_time()
            await nursery.start(retention.run, uploader, INTERVAL)
            await trio.sleep(INTERVAL - 1)
            assert retention.rounds == []
            assert inner.objects == before
            assert states(fs)["step_4/model.pt"] is State.COMMITTED

            await trio.sleep(2)
            assert [scope for _, scope in retention.rounds] == ["interval"]
            assert retention.rounds[0][0] == pytest.approx(INTERVAL)
            assert store_names(inner) == {"step_4", "step_5"}
            assert states(fs)["step_4/model.pt"] is State.REMOTE
            assert states(fs)["step_5/model.pt"] is State.COMMITTED

            await trio.sleep(INTERVAL)
            assert [scope for _, scope in retention.rounds] == ["interval", "interval"]
            assert retention.rounds[1][0] == pytest.approx(2 * INTERVAL)
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


@asynccontextmanager
async def keeping_all(tmp_path: Path, tiers: dict[str, Tier], *, requeue: bool = False
                      ) -> AsyncIterator[tuple[Any, Any, Recorded, trio.Nursery]]:
    """This node (warm keeps all, hot the last 1), its uploader running (``requeue``: what
    its journal left queued first); its retention task is started by ``start_retention``."""
    fs, uploader, journal, staging = await local_node(tmp_path, tiers["warm"])
    if requeue:
        uploader.requeue_from_journal()
    retention = Recorded(policy(KeepRules(all=True)), tiers, fs=fs, markers=MARKERS,
                         node="b")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            yield fs, uploader, retention, nursery
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


async def start_retention(nursery: trio.Nursery, retention: Recorded, uploader: Any) -> None:
    retention.t0 = trio.current_time()
    await nursery.start(retention.run, uploader, INTERVAL)


async def test_a_commit_after_the_start_brings_its_local_round(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """warm keeps all, hot the last 1: a save 100 s after the start is followed by a local
    round at once (step_4 and step_5 evicted, step_6 kept), not by the interval round: the
    store is not listed whole (other nodes' step_1..3 are not this round's business)."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    assert isinstance(inner, MemoryTier)
    await fill(inner, tmp_path, range(1, 4))
    await first_run(tmp_path, inner, range(4, 6))

    async with keeping_all(tmp_path, tiers, requeue=True) as (fs, uploader, retention, nursery):
        await start_retention(nursery, retention, uploader)
        await trio.sleep(100)
        assert retention.rounds == []
        await save(fs, [6])
        await uploader.wait_idle()
        await trio.sleep(1)
        assert [scope for _, scope in retention.rounds] == ["local"]
        assert retention.rounds[0][0] < 102
        got = states(fs)
        assert got["step_4/model.pt"] is State.REMOTE
        assert got["step_5/model.pt"] is State.REMOTE
        assert got["step_6/model.pt"] is State.COMMITTED
        assert store_names(inner) == {f"step_{s}" for s in range(1, 7)}


async def test_only_uploads_into_a_checkpoint_bring_a_local_round(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Files outside any checkpoint (logs, a job's small files) bring no local round: it
    walks the whole journal on the loop, and cannot change what it plans (pointers and
    other files are never planned; at 16,000 files such rounds after each sync made a create
    burst 1.6x slower). A checkpoint's file after them does; so do more uploads than the
    uploader remembers the keys of (it cannot tell then)."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    async with keeping_all(tmp_path, tiers) as (fs, uploader, retention, nursery):
        await start_retention(nursery, retention, uploader)
        for i in range(3):
            await write(fs, f"logs/run{i}.txt", b"l" * 10)
            await uploader.wait_idle()
            await trio.sleep(1)
        assert retention.rounds == []
        await save(fs, [1])
        await uploader.wait_idle()
        await trio.sleep(1)
        assert [scope for _, scope in retention.rounds] == ["local"]
        assert uploader.uploaded_since(uploader.stats.uploaded_files - 2) == \
            ["step_1/model.pt", "step_1/.metadata"]
        assert uploader.uploaded_since(-10**6) is None


async def test_uploads_requeued_at_the_start_bring_a_local_round(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Files the uploader committed after its start but before the retention task started
    (uploads a restart requeued can be that quick) are followed by a local round, as a
    commit is: the uploader counts from its own start."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    async with keeping_all(tmp_path, tiers) as (fs, uploader, retention, nursery):
        await save(fs, (1, 2))
        await uploader.wait_idle()  # done before the retention task starts
        await start_retention(nursery, retention, uploader)
        await trio.sleep(1)
        assert [scope for _, scope in retention.rounds] == ["local"]
        assert states(fs)["step_1/model.pt"] is State.REMOTE


# -- the journal walk that pauses ------------------------------------------------------


def tree(fs: Any, n: int) -> None:
    """a/f0..f{n-1} and z/ (z after a in the walk: a higher inode)."""
    a = fs.mkdir(ROOT_INODE, b"a", 0o755, ROOT_CALLER).ino
    fs.mkdir(ROOT_INODE, b"z", 0o755, ROOT_CALLER)
    for i in range(n):
        fh, _ = fs.create(a, f"f{i}".encode(), 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
        fs.release(fh)


@pytest.mark.parametrize("moves_on", ["first walk", "every walk"])
async def test_a_walk_during_which_entries_move_is_walked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moves_on: str) -> None:
    """While the walk pauses inside a/, a/f0 moves to z/ (or back): an entry moved during a
    walk may be seen twice or not at all. The result is always the tree
    as it is at one moment: every file exactly once. With moves during every walk, the last
    walk is made without pauses."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    fs, _, journal, staging = await local_node(tmp_path, tiers["warm"])
    monkeypatch.setattr(retention_mod, "YIELD_EVERY", 2)
    walks: list[int] = []

    def moving_walk(rows_of: RowSource, files: list[LocalFile], names: list[str]
                    ) -> Iterator[None]:
        walks.append(len(walks))
        for count, _ in enumerate(walk_journal(rows_of, files, names), 1):
            yield
            if count == 5 and (moves_on == "every walk" or len(walks) == 1):
                # The walk is in a/ (a, f0, f1, f2, f3 seen). a/f0 (seen) moves to z/ (not
                # walked yet: it would be seen twice), or back from z/ into a/ (whose
                # entries were read already: seen nowhere).
                z = fs.ns.lookup(ROOT_INODE, b"z").ino
                a = fs.ns.lookup(ROOT_INODE, b"a").ino
                src, dst = (a, z) if len(walks) % 2 else (z, a)
                fs.ns.rename(src, b"f0", dst, b"f0", noreplace=True, exchange=False)

    monkeypatch.setattr(retention_mod, "walk_journal", moving_walk)
    try:
        tree(fs, 20)
        retention = Retention(policy(KeepRules(all=True)), tiers, fs=fs, markers=MARKERS)
        files, names = await retention._journal_files()
        keys = sorted(f.key for f in files)
        assert len(keys) == 20 == len({k.rsplit("/", 1)[1] for k in keys})
        here = {f"{p}/{os.fsdecode(c.name or b'')}" for p in ("a", "z")
                for c in fs.ns.children(fs.ns.lookup(ROOT_INODE, p.encode()).ino, 0)}
        assert set(keys) == here
        assert sorted(names) == sorted(["a", "z", *keys])
        if moves_on == "first walk":
            assert len(walks) == 2
        else:
            assert len(walks) == retention_mod.WALK_TRIES  # then journal_files, no pauses
    finally:
        fs.close()
        journal.close()
        staging.close()


# -- a round lets the loop run -----------------------------------------------------------


class PerStep(trio.abc.Instrument):
    """The most work units counted within a single step of any task (a step: the time a
    task runs without giving the loop back)."""

    def __init__(self) -> None:
        self.units = 0
        self.most = 0
        self.where = ""  # where the task of the longest step stopped

    def count(self) -> None:
        self.units += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.units = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.units > self.most:
            co: Any = task.coro
            frames = []
            while co is not None:
                f = getattr(co, "cr_frame", None)
                if f is not None:
                    frames.append(f"{f.f_code.co_name}:{f.f_lineno}")
                co = getattr(co, "cr_await", None)
            self.where = " < ".join(frames)
        self.most = max(self.most, self.units)


async def test_a_round_over_many_files_gives_the_loop_back_every_few_hundred(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,500 committed files in step_1, hot and warm keep everything: in a full round (the
    inventory, the plan; nothing to apply), no task step reads more than a few hundred journal
    rows or names a few hundred keys on the trio thread (counted, not timed). Before, the walk
    of the journal, the checkpoints and the plan were one step: every file several times
    over. (Applying an action to one checkpoint is still one step: its files are checked and
    evicted together, module docstring.)"""
    import threading

    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    fs, uploader, journal, staging = await local_node(tmp_path, tiers["warm"])
    steps = PerStep()
    on_loop = threading.main_thread()

    def counted(f: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is on_loop:
                steps.count()
            return f(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fs.ns, "open_count", counted(fs.ns.open_count))  # per file walked
    monkeypatch.setattr(fs.ns, "get", counted(fs.ns.get))  # per row read
    monkeypatch.setattr(Detector, "locate", counted(Detector.locate))  # per key named
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            for i in range(1500):
                await write(fs, f"step_1/shard_{i}", b"s")
            await write(fs, "step_1/.metadata", b"m")
            await write(fs, "step_2/model.pt", b"w")
            await write(fs, "step_2/.metadata", b"m")
            await uploader.wait_idle()
            keep_all = Policy((TierPolicy(HOT, KeepRules(all=True), HOT, HOT),
                               TierPolicy("warm", KeepRules(all=True), "memory:w", "memory")))
            retention = Retention(keep_all, tiers, fs=fs, markers=MARKERS, node="b")
            trio.lowlevel.add_instrument(steps)
            steps.units = 0  # this step's units so far: the writes'
            try:
                result = await retention.run_once(scope="full")
            finally:
                trio.lowlevel.remove_instrument(steps)
            assert not result.done and not result.failed
            assert 0 < steps.most <= 3 * retention_mod.YIELD_EVERY, steps.where
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()
