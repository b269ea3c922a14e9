"""Uploads yield to the job (ckptfs/engine/yieldgate.py): the core, the uploader and a memory tier,
with trio's autojump clock (so a wait of 30 s costs nothing and times are exact)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from ckptfs.engine.fs import ROOT_CALLER
from ckptfs.engine.yieldgate import YieldGate
from ckptfs.state.journal import ROOT_INODE, State
from ckptfs.state.staging import SpaceBudget
from ckptfs.store.integrity import file_sums
from ckptfs.store.tiers.base import Finish, Kind, ObjectMeta, ObjectMissing, Progress, Tier
from ckptfs.store.tiers.local import CHUNK, FileTier
from ckptfs.store.tiers.memory import MemoryTier
from ckptfs.store.tiers.s3 import S3Tier
from tests.corerig import RecordingTier, Rig, open_rig
from tests.mounting import Mounter, ckptfs, status, tiers_config

MiB = 1024 * 1024
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


def test_a_mount_holds_uploads_for_the_job_and_sync_does_not_wait(
        tmp_path: Path, mounter: Mounter) -> None:
    """On a real mount: a file closed while another is open waits for it (status says why,
    the file reads staged), ``ckptfs sync`` does not wait for the job (and leaves the gate
    as it found it), and the file left open goes up once it is closed."""
    store = tmp_path / "store"
    store.mkdir()
    m = mounter(config=tiers_config(tmp_path / "c.toml", store.as_uri()))
    with open(m.path / "train.log", "wb") as log:
        log.write(b"step 1\n")
        (m.path / "model.pt").write_bytes(b"m" * 4096)
        deadline = time.monotonic() + 30
        while not (held := status(m)["upload_yield"])["holding"]:
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
        assert held["open_files"] == 1 and held["enabled"], held
        assert os.getxattr(m.path / "model.pt", "user.ckptfs.state") == b"staged"
        assert "yield to the job" in ckptfs("status", m.path).stdout
        t0 = time.monotonic()
        ckptfs("sync", m.path)
        assert time.monotonic() - t0 < 20  # not upload_hold_max (30 s) after the open
        assert (store / "model.pt").read_bytes() == b"m" * 4096
        # The sync opened the gate only while it waited: the next file closed beside the
        # open log waits for the job again (it once went up within 2 s of a sync).
        (m.path / "optim.pt").write_bytes(b"o" * 4096)
        time.sleep(1.0)
        assert os.getxattr(m.path / "optim.pt", "user.ckptfs.state") == b"staged"
        assert not (store / "optim.pt").exists()
        log.write(b"step 2\n")
    ckptfs("sync", m.path)
    assert (store / "train.log").read_bytes() == b"step 1\nstep 2\n"


@pytest.mark.parametrize("kind", ["file", "s3"])
async def test_a_put_in_flight_waits_for_the_gate_between_parts(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A burst that begins while an upload is under way pauses it after the part (S3) or
    chunk (file tier) in flight: the tier awaits its ``pace`` before each one."""
    size = 12 * MiB + 5 if kind == "s3" else CHUNK + 5  # 3 parts of 5 MiB; 2 chunks
    src = tmp_path / "src"
    data = os.urandom(size)
    src.write_bytes(data)
    tier: Tier
    if kind == "s3":
        seaweed = request.getfixturevalue("seaweed")
        tier = S3Tier("warm", f"s3://{seaweed.new_bucket()}/p", endpoint_url=seaweed.endpoint,
                      part_size=5 * MiB, **seaweed.tier_credentials)
    else:
        tier = FileTier("warm", (tmp_path / "store").as_uri(), tmp_path / "store")
        (tmp_path / "store").mkdir()
    paced, job_done = [], trio.Event()

    async def pace() -> None:
        paced.append(trio.current_time())
        await job_done.wait()  # the job is busy until the test says

    tier.pace = pace
    checksum, sums = file_sums(src, size)
    meta = ObjectMeta(Kind.FILE, 0o644, 1, 0, 0, checksum, blocks=sums.encode())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.put_file, "k", src, size, meta)
            while len(paced) < (1 if kind == "file" else 3):
                await trio.sleep(0.01)
            with pytest.raises(ObjectMissing):
                await tier.head("k")  # nothing sent past the gate
            job_done.set()
    assert len(paced) == (3 if kind == "s3" else 2)
    assert (await tier.head("k")).size == size
    await tier.aclose()


class PacedTier(RecordingTier):
    """Sends each file in 8 parts of 0.5 s, asking its ``pace`` before each (as S3 does)."""

    async def put_file(self, key: str, source: Path, size: int, meta: ObjectMeta,
                       progress: Progress | None = None, *,
                       finish: Finish | None = None) -> str | None:
        for _ in range(8):  # longer than a hurry keeps the gate open
            if self.pace is not None:
                await self.pace()
            await trio.sleep(0.5)
        return await super().put_file(key, source, size, meta, progress, finish=finish)


async def test_a_writer_short_of_space_keeps_the_gate_open(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """A writer waiting for staging space holds its file open, which closes the gate; the
    upload that would free the space must not wait for that writer (it re-hurries, and each
    hurry opens the gate), or it would stall until upload_hold_max."""
    inner = MemoryTier("warm", "memory://t", f"t-space-{id(tmp_path)}")
    inner.objects.clear()
    gate = YieldGate(SETTLE, HOLD_MAX)
    tier = PacedTier(inner)
    tier.pace = gate.wait_open
    async with open_rig(tmp_path, tier, inner, gate=gate) as rig:
        rig.fs.space = SpaceBudget(rig.fs.staging, 3 * MiB, 0.0)
        await rig.write("a.pt", b"a" * (2 * MiB))
        await trio.sleep(SETTLE + 0.6)  # a.pt's upload is under way: its first part is sent
        t0 = trio.current_time()
        fh = open_writer(rig, b"b.pt")
        await rig.fs.write(fh, 0, b"b" * (2 * MiB))  # room only once a.pt is committed
        assert trio.current_time() - t0 < 8, "the writer waited for upload_hold_max"
        rig.fs.release(fh)
        await rig.settle()
        assert rig.files() == {"a.pt": b"a" * (2 * MiB), "b.pt": b"b" * (2 * MiB)}
