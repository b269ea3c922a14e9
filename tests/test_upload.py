"""Stage 2 without a mount: the core + the uploader + a memory tier behind a fault wrapper.

Deterministic: trio's autojump clock stands in for time, so backoff and latency cost nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckptfs import errors
from ckptfs.engine.fs import RENAME_EXCHANGE, ROOT_CALLER, Filesystem
from ckptfs.engine.upload import OUTAGE_AFTER, Uploader, file_checksum
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import Staging
from ckptfs.store.tiers.base import Kind
from ckptfs.store.tiers.memory import MemoryTier
from tests.corerig import Rig, read_path

ROOT = ROOT_INODE


async def test_close_commits_with_checksum(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    data = os.urandom(100_000)
    ino = await rig.write("step_1/model.pt", data, mode=0o600)
    assert rig.fs.getattr(ino).state is State.STAGED
    await rig.settle()
    row = rig.fs.getattr(ino)
    assert row.state is State.COMMITTED and row.remote_key == "step_1/model.pt"
    obj = rig.objects["step_1/model.pt"]
    assert obj.body == data
    assert obj.meta.checksum == row.checksum == file_checksum(rig.fs.staging.path(ino), len(data))
    assert obj.meta.mode == 0o600 and obj.meta.mtime_ns == row.mtime_ns
    assert rig.objects["step_1/"].meta.kind is Kind.DIRECTORY
    assert rig.fs.getxattr(ino, b"user.ckptfs.state") == b"committed"


async def test_open_file_is_never_uploaded(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    fh, row = rig.fs.create(ROOT, b"partial", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await rig.fs.write(fh, 0, b"half")
    await rig.write("other", b"x")
    await rig.settle()
    assert "partial" not in rig.objects and "other" in rig.objects
    assert rig.fs.getattr(row.ino).state is State.OPEN
    rig.fs.release(fh)
    await rig.settle()
    assert rig.objects["partial"].body == b"half"


async def test_marker_waits_for_every_shard(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig.tier.latency = 1.0
    rig.tier.bandwidth = 1_000_000  # 1 MB/s: a 2 MB shard takes 2 s
    for rank in range(4):
        await rig.write(f"step_5/__{rank}_0.distcp", os.urandom(500_000 * (rank + 1)))
    await rig.write("step_5/.metadata", b"meta")
    await rig.write("latest", b"step_5")
    await rig.settle()
    ends = {key: t for ev, key, t in rig.tier.events if ev == "end"}
    starts = {key: t for ev, key, t in rig.tier.events if ev == "start"}
    shards = [k for k in ends if k.endswith(".distcp")]
    assert len(shards) == 4
    assert starts["step_5/.metadata"] >= max(ends[k] for k in shards)
    assert starts["latest"] >= ends["step_5/.metadata"]


async def test_dcp_renames_end_with_one_copy(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig.tier.latency = 0.5
    await rig.write("step_7.tmp/__0_0.distcp", b"shard0")
    await rig.write("step_7.tmp/.metadata.tmp", b"meta")
    tmp_dir = await rig.ino("step_7.tmp")
    await rig.fs.rename(tmp_dir, b".metadata.tmp", tmp_dir, b".metadata")
    await trio.sleep(0.7)  # some uploads in flight under the old names
    await rig.fs.rename(ROOT, b"step_7.tmp", ROOT, b"step_7")
    await rig.settle()
    assert set(rig.objects) == {"step_7/", "step_7/__0_0.distcp", "step_7/.metadata"}
    assert rig.objects["step_7/.metadata"].body == b"meta"


async def test_rename_unlink_overwrite_truncate_reach_the_store(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    await rig.write("a", b"A" * 10)
    await rig.write("d/b", b"B")
    await rig.write("d/e/c", b"C")
    await rig.settle()
    await rig.fs.rename(ROOT, b"a", ROOT, b"a2")
    await rig.fs.rename(ROOT, b"d", ROOT, b"d2")
    await rig.write("over", b"old")
    await rig.settle()
    await rig.write("over", b"new content")
    await rig.fs.setattr(await rig.ino("a2"), size=3)
    await rig.fs.unlink(await rig.ino("d2"), b"b")
    await rig.settle()
    assert rig.files() == {"a2": b"AAA", "d2/e/c": b"C", "over": b"new content"}
    assert {k for k in rig.objects if k.endswith("/")} == {"d2/", "d2/e/"}
    # rename over an existing committed file, and an exchange
    await rig.write("x", b"X")
    await rig.write("y", b"Y")
    await rig.settle()
    await rig.fs.rename(ROOT, b"x", ROOT, b"y")
    await rig.write("p", b"P")
    await rig.write("q", b"Q")
    await rig.settle()
    await rig.fs.rename(ROOT, b"p", ROOT, b"q", RENAME_EXCHANGE)
    await rig.settle()
    files = rig.files()
    assert files["y"] == b"X" and "x" not in files
    assert files["p"] == b"Q" and files["q"] == b"P"


async def test_rmdir_and_symlink(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    d = rig.fs.mkdir(ROOT, b"empty", 0o750, ROOT_CALLER)
    rig.fs.symlink(ROOT, b"latest", b"step_3", ROOT_CALLER)
    await rig.settle()
    assert rig.objects["empty/"].meta.mode == 0o750
    assert rig.objects["latest"].meta.kind is Kind.SYMLINK
    assert rig.objects["latest"].body == b"step_3"
    await rig.fs.rmdir(ROOT, b"empty")
    await rig.fs.unlink(ROOT, b"latest")
    await rig.settle()
    assert rig.objects == {}
    assert d.ino


async def test_outage_delays_but_loses_nothing(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig.tier.down = True
    datas = {f"step_{i}/m.pt": os.urandom(1000 + i) for i in range(5)}
    for path, data in datas.items():
        await rig.write(path, data)  # acknowledged while the store is down
    await trio.sleep(60)
    assert rig.files() == {}
    assert rig.uploader.failed()
    rig.tier.down = False
    await rig.settle()
    assert rig.files() == datas
    assert not rig.uploader.failed()


async def test_an_outage_is_probed_by_one_item_not_retried_by_every_item(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """200 files closed while the store is down: after OUTAGE_AFTER failures in a row one item
    at a time probes the store (with backoff), so ten minutes of outage cost a few dozen
    store calls, not a retry of every file on its own backoff (thousands)."""
    rig.tier.down = True
    datas = {f"d/f{i}": os.urandom(100 + i) for i in range(200)}
    for path, data in datas.items():
        await rig.write(path, data)
    start = sum(rig.tier.calls.values())
    await trio.sleep(600)
    calls = sum(rig.tier.calls.values()) - start
    assert calls <= 40, rig.tier.calls
    outage = rig.uploader.outage()
    assert outage is not None and outage["down_for_s"] >= 590, outage
    assert outage["failures_in_a_row"] >= OUTAGE_AFTER
    # A writer waiting for space hurries the next probe too.
    rig.uploader.hurry()
    assert rig.uploader.outage()["next_probe_in_s"] <= 1.0  # type: ignore[index]
    # What status and sync count (one indexed query): linked entries not uploaded yet (the
    # files and their directory ``d``).
    totals = rig.fs.journal.linked_totals(State.STAGED, State.UPLOADING)
    assert totals == (len(datas) + 1, sum(map(len, datas.values())))
    await rig.fs.unlink(await rig.ino("d"), b"f0")
    del datas["d/f0"]
    totals = rig.fs.journal.linked_totals(State.STAGED, State.UPLOADING)
    assert totals == (len(datas) + 1, sum(map(len, datas.values())))
    rig.tier.down = False
    t0 = trio.current_time()
    await rig.settle()
    assert trio.current_time() - t0 <= 2.0  # the next probe, then everything at once
    assert rig.files() == datas
    assert rig.fs.journal.linked_totals(State.STAGED, State.UPLOADING) == (0, 0)
    assert rig.uploader.outage() is None and not rig.uploader.failed()


async def test_failures_between_successes_are_not_an_outage(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """Fewer than OUTAGE_AFTER failures in a row (a flaky store) never gate the queue."""
    for i in range(6):
        rig.tier.fail_next = OUTAGE_AFTER - 1
        await rig.write(f"f{i}", b"x" * 100)
        await rig.settle()
        assert rig.uploader.outage() is None
    assert len(rig.files()) == 6


async def test_reopen_cancels_the_old_upload(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig.tier.bandwidth = 100_000
    ino = await rig.write("big", b"1" * 1_000_000)
    await trio.sleep(1)  # the upload is in flight (10 s at this bandwidth)
    assert rig.fs.getattr(ino).state is State.UPLOADING
    fh = await rig.fs.open(ino, os.O_WRONLY)
    assert rig.fs.getattr(ino).state is State.OPEN
    await trio.sleep(20)
    assert "big" not in rig.objects  # never published while open
    await rig.fs.write(fh, 0, b"2")
    rig.fs.release(fh)
    await rig.settle()
    assert rig.objects["big"].body == b"2" + b"1" * 999_999


async def test_unlink_during_upload_leaves_nothing(rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig.tier.bandwidth = 100_000
    await rig.write("gone", b"g" * 500_000)
    await trio.sleep(1)
    await rig.fs.unlink(ROOT, b"gone")
    await rig.settle()
    await trio.sleep(10)
    assert rig.objects == {}


async def test_replay_requeues_staged_and_uploading(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    inner = MemoryTier("warm", "memory://r", f"replay-{id(tmp_path)}")
    staging = Staging(tmp_path / "s")
    staging.prepare()
    journal = Journal(staging.root / "journal.db")
    fs = Filesystem(journal, staging)
    fs.start()
    fh, row = fs.create(ROOT, b"f", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, b"payload")
    fs.release(fh)
    row.state = State.UPLOADING  # the daemon died mid-upload
    fs.ns.persist(row)
    journal.close()
    staging.close()

    staging = Staging(tmp_path / "s")
    staging.prepare()
    journal = Journal(staging.root / "journal.db")
    fs = Filesystem(journal, staging)
    fs.start()
    uploader = Uploader(journal, fs.ns, staging, inner, concurrency=2, markers=())
    fs.listener = uploader
    uploader.requeue_from_journal()
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.run)
        await uploader.wait_until_done(uploader.last_seq())
        nursery.cancel_scope.cancel()
    assert inner.objects["f"].body == b"payload"
    assert fs.getattr(row.ino).state is State.COMMITTED
    journal.close()
    staging.close()


async def test_full_staging_evicts_then_waits_never_drops(
    rig: Rig, autojump_clock: trio.abc.Clock
) -> None:
    rig.fs.space.max_bytes = 1_000_000
    rig.tier.bandwidth = 200_000  # uploads are what frees room
    datas = {f"step_{i}/model.pt": os.urandom(300_000) for i in range(8)}
    start = trio.current_time()
    for path, data in datas.items():
        await rig.write(path, data)  # waits for room instead of failing
    assert trio.current_time() - start >= 2  # writers did wait for uploads
    assert rig.fs.stall_seconds > 0
    await rig.settle()
    assert rig.files() == datas
    states = {p: rig.fs.getattr(await rig.ino(p)).state for p in datas}
    assert State.REMOTE in states.values()  # some local copies were evicted...
    assert rig.fs.space.used <= 1_000_000
    for path, data in datas.items():  # ...and every file still reads back whole
        assert await read_path(rig, path) == data
    assert rig.fs.getxattr(await rig.ino("step_7/model.pt"), b"user.ckptfs.state") == b"committed"


async def test_a_writer_short_of_room_takes_it_when_a_committed_file_is_closed(
    rig: Rig, autojump_clock: trio.abc.Clock
) -> None:
    # A reader of evicted files closes one and faults in the next: the first is committed
    # and local, but was still open when the second looked for victims. With no upload
    # left to wait for, the writer (the fetch) waited until write_stall_timeout for nothing
    # (seen once on a real mount: a read hung for 300 s).
    rig.fs.space.max_bytes = 1_000_000
    await rig.write("a", os.urandom(700_000))
    await rig.settle()
    ino = await rig.ino("a")
    assert rig.fs.getattr(ino).state is State.COMMITTED
    fh = await rig.fs.open(ino, os.O_RDONLY)
    start = trio.current_time()
    data = os.urandom(600_000)
    written = trio.Event()

    async def write_b() -> None:
        await rig.write("b", data)
        written.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_b)
        await trio.sleep(5)
        assert not written.is_set()  # waiting for room: "a" is open
        rig.fs.release(fh)  # "a" may go now
    assert trio.current_time() - start < 10  # not write_stall_timeout (300 s)
    assert rig.fs.getattr(ino).state is State.REMOTE  # evicted to make the room
    await rig.settle()
    assert rig.files()["b"] == data


async def test_full_staging_and_store_down_gives_enospc(
    rig: Rig, autojump_clock: trio.abc.Clock
) -> None:
    rig.fs.space.max_bytes = 500_000
    rig.fs.write_stall_timeout = 30
    rig.tier.down = True
    await rig.write("a", os.urandom(400_000))
    with pytest.raises(errors.StagingFull):
        await rig.write("b", os.urandom(400_000))
    rig.tier.down = False
    await rig.settle()
    assert "a" in rig.files()


async def test_corrupt_store_copy_is_never_served(
    rig: Rig, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(50_000)
    await rig.write("m.pt", data)
    await rig.settle()
    ino = await rig.ino("m.pt")
    rig.fs.evict(rig.fs.getattr(ino))
    rig.tier.corrupt_reads = True
    fh = await rig.fs.open(ino, os.O_RDONLY)
    try:
        with pytest.raises(errors.ChecksumMismatch):
            await rig.fs.read(fh, 0, 4096)
        assert rig.fs.getattr(ino).state is State.REMOTE
        assert rig.fs.fetcher is not None and rig.fs.fetcher.stats.integrity_failures == 2
        rig.tier.corrupt_reads = False
        assert await rig.fs.read(fh, 0, 1 << 20) == data
    finally:
        rig.fs.release(fh)
    assert rig.fs.getattr(ino).state is State.COMMITTED
