"""Uploads yield to the job (ckptfs/yieldgate.py): the core, the uploader and a memory tier,
with trio's autojump clock (so a wait of 30 s costs nothing and times are exact)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from ckptfs.fs import ROOT_CALLER
from ckptfs.journal import ROOT_INODE, State
from ckptfs.tiers.memory import MemoryTier
from ckptfs.yieldgate import YieldGate
from tests.test_upload import RecordingTier, Rig, open_rig

SETTLE = 0.25
HOLD_MAX = 30.0


@pytest.fixture
async def gated(tmp_path: Path, request: pytest.FixtureRequest,
                autojump_clock: trio.abc.Clock) -> AsyncIterator[Rig]:
    inner = MemoryTier("warm", "memory://t", f"t-{request.node.name}-{id(tmp_path)}")
    inner.objects.clear()
    gate = YieldGate(SETTLE, HOLD_MAX)
    async with open_rig(tmp_path, RecordingTier(inner), inner, gate=gate) as opened:
        yield opened


def open_writer(rig: Rig, name: bytes) -> int:
    fh, _ = rig.fs.create(ROOT_INODE, name, 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    return fh


def started(rig: Rig, key: str) -> float:
    return next(t for what, k, t in rig.tier.events if what == "start" and k == key)


async def committed(rig: Rig, path: str) -> float:
    """Trio time at which ``path`` is committed (looked at after each item finishes)."""
    ino = await rig.ino(path)
    while rig.fs.getattr(ino).state is not State.COMMITTED:
        await rig.uploader.wait_progress()
    return trio.current_time()


async def test_uploads_wait_while_a_file_is_open_then_for_the_settle(gated: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig = gated
    fh = open_writer(rig, b"shard_1")
    await rig.write("shard_0", b"a" * 1000)  # closed while shard_1 is still being written
    await trio.sleep(10)
    assert "shard_0" not in rig.objects  # held for the job
    await rig.fs.write(fh, 0, b"b" * 1000)
    rig.fs.flush(fh)
    rig.fs.release(fh)
    last_close = trio.current_time()
    await rig.settle()
    for key in ("shard_0", "shard_1"):
        # Not before the settle, and at once after it (the workers were woken, no polling).
        assert started(rig, key) == pytest.approx(last_close + SETTLE, abs=1e-6)
    assert rig.files() == {"shard_0": b"a" * 1000, "shard_1": b"b" * 1000}


async def test_a_reader_holds_uploads_too(gated: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig = gated
    ino = await rig.write("model.pt", b"m" * 100)
    await rig.settle()
    reader = await rig.fs.open(ino, os.O_RDONLY)  # a restart reading its checkpoint back
    t0 = trio.current_time()
    await rig.write("other.pt", b"o" * 100)
    with trio.move_on_after(5):
        await rig.settle()
    assert "other.pt" not in rig.objects
    rig.fs.release(reader)
    await rig.settle()
    assert started(rig, "other.pt") == pytest.approx(t0 + 5 + SETTLE, abs=1e-6)


async def test_a_steady_writer_delays_uploads_by_hold_max_at_most(gated: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig = gated
    t0 = trio.current_time()
    open_writer(rig, b"train.log")  # never closed
    await trio.sleep(5)
    await rig.write("step_1/model.pt", b"x" * 100)
    await rig.write("step_1/.metadata", b"meta")
    await committed(rig, "step_1/.metadata")
    assert started(rig, "step_1/model.pt") == pytest.approx(t0 + HOLD_MAX, abs=1e-6)
    # The stretch goes on (the log is still open): later files go at once, as without a gate.
    t1 = trio.current_time()
    await rig.write("step_2/model.pt", b"y" * 100)
    assert await committed(rig, "step_2/model.pt") - t1 < 0.1


async def test_sync_and_hurry_do_not_wait_for_the_job(gated: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig = gated
    open_writer(rig, b"train.log")
    await rig.write("a.pt", b"a")
    t0 = trio.current_time()
    # What `ckptfs sync` and fsync = "remote" wait on.
    await rig.uploader.wait_until_done(rig.uploader.last_seq())
    assert "a.pt" in rig.objects and trio.current_time() - t0 < 0.1
    await rig.write("b.pt", b"b")
    rig.uploader.hurry()  # a writer short of staging space
    t1 = trio.current_time()
    assert await committed(rig, "b.pt") - t1 < 0.1
    # The bypass of a hurry lapses: the next file waits for the job again (hold_max from
    # the start of the stretch, which began with the log's open at t0).
    await trio.sleep(5)
    await rig.write("c.pt", b"c")
    await committed(rig, "c.pt")
    assert started(rig, "c.pt") == pytest.approx(t0 + HOLD_MAX, abs=1e-6)


async def test_commit_markers_keep_their_order_behind_the_gate(gated: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig = gated
    other = open_writer(rig, b"elsewhere")
    for rank in range(4):
        await rig.write(f"step_9/__{rank}_0.distcp", os.urandom(50_000))
    await rig.write("step_9/.metadata", b"meta")
    await rig.write("latest", b"9")
    await trio.sleep(10)
    assert not rig.files()
    rig.fs.release(other)
    await rig.settle()
    ends = {k: t for what, k, t in rig.tier.events if what == "end"}
    starts = {k: t for what, k, t in rig.tier.events if what == "start"}
    shards = [f"step_9/__{rank}_0.distcp" for rank in range(4)]
    assert starts["step_9/.metadata"] >= max(ends[s] for s in shards)
    assert starts["latest"] >= ends["step_9/.metadata"]


def test_the_rules_on_a_clock() -> None:
    now = [100.0]
    gate = YieldGate(1.0, 10.0, clock=lambda: now[0])
    assert gate.opens_at(now[0]) == now[0]  # nothing open: open
    gate.opened()
    assert gate.opens_at(now[0]) == 110.0  # the bound; a close wakes the uploader before
    event = gate._event
    gate.opened()
    gate.closed()
    assert not event.is_set()  # one file still open
    now[0] = 103.0
    gate.closed()
    assert event.is_set()  # held workers look again: the gate opens before the bound now
    assert gate.opens_at(now[0]) == 104.0  # the settle
    event = gate._event
    gate.opened()
    now[0] = 103.5
    gate.closed()
    assert not event.is_set()  # later than the settle they wait for: no need to wake them
    now[0] = 104.0
    assert gate.opens_at(now[0]) == 104.5  # they wake at 104 and wait on
    gate.opened()  # within the settle: the same stretch (the bound still counts from 100)
    now[0] = 109.0
    assert gate.opens_at(now[0]) == 110.0
    now[0] = 110.0
    assert gate.opens_at(now[0]) == 110.0  # forced open: the stretch outlasted the bound
    gate.closed()
    now[0] = 110.5
    gate.opened()  # still the same (forced) stretch
    assert gate.opens_at(now[0]) == 110.5
    gate.closed()
    now[0] = 112.0
    assert gate.opens_at(now[0]) == 112.0  # settled: the stretch is over
    gate.opened()  # a new stretch, a new bound
    assert gate.opens_at(now[0]) == 122.0
    with gate.bypassed():
        assert gate.opens_at(now[0]) == 112.0
    gate.bypass_for(2.0)
    assert gate.opens_at(now[0]) == 112.0
    now[0] = 114.0
    assert gate.opens_at(now[0]) == 122.0
    assert gate.status()["holding"] and gate.status()["open_files"] == 1


def test_disabled_gate_is_always_open() -> None:
    gate = YieldGate.disabled()
    gate.opened()
    assert gate.opens_at(5.0) == 5.0 and not gate.enabled
    assert YieldGate(0.25, 0.0).opens_at(1.0) == 1.0
