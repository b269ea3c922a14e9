"""Store keys have one owner (ckptfs/engine/keys.py): renames, swaps and rotations lose nothing.

Unit level: the core + the uploader over a memory tier behind the fault wrapper, with trio's
autojump clock. Each test fails without the rule it names (docs/SEMANTICS.md, "Store keys").
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from ckptfs.engine.fs import RENAME_EXCHANGE, ROOT_CALLER
from ckptfs.engine.keys import PARKING_PREFIX
from ckptfs.engine.upload import file_checksum
from ckptfs.errors import NotFound
from ckptfs.state.journal import ROOT_INODE, State
from ckptfs.store.tiers.base import Finish, Kind, ObjectInfo, ObjectMeta, Progress
from ckptfs.store.tiers.memory import MemoryTier
from tests.corerig import RecordingTier, Rig, open_rig

ROOT = ROOT_INODE


async def _evict(rig: Rig, *paths: str) -> None:
    """Drop the local copies: the store's object is then the only copy (a loss is visible)."""
    rows = [rig.fs.getattr(await rig.ino(p)) for p in paths]
    assert all(r.state in (State.COMMITTED, State.REMOTE) for r in rows)
    rig.fs.evict(*[r for r in rows if r.state is State.COMMITTED])


async def _read(rig: Rig, path: str) -> bytes:
    ino = await rig.ino(path)
    fh = await rig.fs.open(ino, os.O_RDONLY)
    try:
        return await rig.fs.read(fh, 0, 1 << 20)
    finally:
        rig.fs.release(fh)


def _data_keys(rig: Rig) -> set[str]:
    return {k for k in rig.files() if not k.startswith(".ckptfs/")}


async def test_rotation_retried_after_a_transient_error_keeps_the_old_checkpoint(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``mv ckpt ckpt.prev; mv ckpt.new ckpt``: the first move fails once (503); the second
    must not overwrite ``ckpt`` before the first has copied it away."""
    await rig.write("ckpt", b"old" * 1000)
    await rig.write("ckpt.new", b"new" * 1000)
    await rig.settle()
    await _evict(rig, "ckpt", "ckpt.new")
    rig.tier.fail_next = 1  # the next store call (the first move's HEAD or COPY) fails
    await rig.fs.rename(ROOT, b"ckpt", ROOT, b"ckpt.prev")
    await rig.fs.rename(ROOT, b"ckpt.new", ROOT, b"ckpt")
    await rig.settle()
    assert not rig.uploader.failed()
    assert rig.files() == {"ckpt.prev": b"old" * 1000, "ckpt": b"new" * 1000}
    assert await _read(rig, "ckpt.prev") == b"old" * 1000
    assert await _read(rig, "ckpt") == b"new" * 1000


async def test_rotation_with_a_slow_store_keeps_the_old_checkpoint(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """No error, but latency: the second move's copy must not land between the first move's
    HEAD and COPY."""
    await rig.write("ckpt", b"old" * 1000)
    await rig.write("ckpt.new", b"new" * 1000)
    await rig.settle()
    await _evict(rig, "ckpt", "ckpt.new")
    head = rig.tier.head

    async def slow_head(key: str) -> ObjectInfo:
        info = await head(key)
        if key == "ckpt":
            await trio.sleep(2.0)  # the answer is on its way while other requests go on
        return info

    rig.tier.head = slow_head  # type: ignore[method-assign]
    await rig.fs.rename(ROOT, b"ckpt", ROOT, b"ckpt.prev")
    await rig.fs.rename(ROOT, b"ckpt.new", ROOT, b"ckpt")
    await rig.settle()
    assert rig.files() == {"ckpt.prev": b"old" * 1000, "ckpt": b"new" * 1000}
    assert await _read(rig, "ckpt.prev") == b"old" * 1000


async def test_new_file_at_a_key_being_moved_away_waits_for_the_move(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``mv ckpt ckpt.prev`` then a new ``ckpt`` written and closed at once: its upload must
    not overwrite the old object before the move has copied it."""
    await rig.write("ckpt", b"old" * 1000)
    await rig.settle()
    await _evict(rig, "ckpt")
    rig.tier.fail_next = 1
    await rig.fs.rename(ROOT, b"ckpt", ROOT, b"ckpt.prev")
    await rig.write("ckpt", b"fresh" * 100)
    await rig.settle()
    assert rig.files() == {"ckpt.prev": b"old" * 1000, "ckpt": b"fresh" * 100}


@pytest.mark.parametrize("evicted", [False, True])
async def test_directory_exchange_swaps_the_store_copies(
        rig: Rig, autojump_clock: trio.abc.Clock, evicted: bool) -> None:
    """``renameat2(cur, nxt, RENAME_EXCHANGE)`` of two directories holding ``model.pt``."""
    await rig.write("cur/model.pt", b"OLD" * 500)
    await rig.write("nxt/model.pt", b"NEW" * 500)
    await rig.write("nxt/extra.pt", b"E")
    await rig.settle()
    if evicted:
        await _evict(rig, "cur/model.pt", "nxt/model.pt")
    rig.tier.latency = 0.5
    await rig.fs.rename(ROOT, b"cur", ROOT, b"nxt", RENAME_EXCHANGE)
    await rig.settle()
    assert _data_keys(rig) == {"cur/model.pt", "cur/extra.pt", "nxt/model.pt"}
    assert rig.objects["cur/model.pt"].body == b"NEW" * 500
    assert rig.objects["nxt/model.pt"].body == b"OLD" * 500
    assert not any(k.startswith(PARKING_PREFIX) for k in rig.objects)  # parked copies go
    await _evict(rig, "cur/model.pt", "nxt/model.pt")
    assert await _read(rig, "cur/model.pt") == b"NEW" * 500
    assert await _read(rig, "nxt/model.pt") == b"OLD" * 500


async def test_swap_through_three_renames_of_evicted_files(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``mv a t; mv b a; mv t b`` of files whose only copies are in the store: each move's
    target is the other's source (a cycle), broken by parking one copy server-side."""
    await rig.write("a", b"A" * 4000)
    await rig.write("b", b"B" * 4000)
    await rig.settle()
    await _evict(rig, "a", "b")
    await rig.fs.rename(ROOT, b"a", ROOT, b"t")
    await rig.fs.rename(ROOT, b"b", ROOT, b"a")
    await rig.fs.rename(ROOT, b"t", ROOT, b"b")
    await rig.settle()
    assert rig.files() == {"a": b"B" * 4000, "b": b"A" * 4000}
    assert await _read(rig, "a") == b"B" * 4000
    assert await _read(rig, "b") == b"A" * 4000


class SlowPutTier(RecordingTier):
    """Puts take ``put_seconds`` and cannot be cancelled once started (as an S3 PUT)."""

    put_seconds = 5.0

    async def put_file(self, key: str, source: Path, size: int, meta: ObjectMeta,
                       progress: Progress | None = None, *,
                       finish: Finish | None = None) -> str | None:
        data = source.read_bytes()[:size]
        with trio.CancelScope(shield=True):
            await trio.sleep(self.put_seconds)
            scratch = source.with_name(source.name + ".sent")
            scratch.write_bytes(data)
            etag = await self.inner.put_file(key, scratch, size, meta, progress, finish=finish)
            scratch.unlink()
        return etag


@pytest.fixture
async def local_only(tmp_path: Path, autojump_clock: trio.abc.Clock) -> AsyncIterator[Rig]:
    inner = MemoryTier("warm", "memory://lo", f"lo-{id(tmp_path)}")
    inner.objects.clear()
    async with open_rig(tmp_path, SlowPutTier(inner), inner, unlink_remote=False,
                        concurrency=2) as opened:
        yield opened


async def test_local_only_unlink_during_a_put_keeps_the_store_copy(
        local_only: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``unlink = "local-only"`` drops the NVMe copy and hides the path; a PUT already on its
    way lands, and its object is kept for retention, not deleted."""
    rig = local_only
    await rig.write("step_1/model.pt", b"m" * 1000)
    await trio.sleep(1)  # the PUT is on its way (5 s)
    step = await rig.ino("step_1")
    await rig.fs.unlink(step, b"model.pt")
    await rig.settle()
    await trio.sleep(10)
    assert rig.files() == {"step_1/model.pt": b"m" * 1000}
    with pytest.raises(NotFound):
        await rig.ino("step_1/model.pt")  # hidden here


async def test_a_move_copies_only_the_version_it_checked(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """Another node rewrites ``ckpt`` between the move's HEAD and its COPY: the pinned copy
    refuses, and ``ckpt.prev`` never gets the other node's bytes under our name (this node
    wrote ``ckpt``: a file it wrote is not followed to another node's version)."""
    await rig.write("ckpt", b"old" * 1000)
    await rig.settle()
    await _evict(rig, "ckpt")
    head = rig.tier.head
    other = rig.root / "other-node"
    other.write_bytes(b"other" * 100)

    async def racing_head(key: str) -> ObjectInfo:
        info = await head(key)
        if key == "ckpt" and rig.objects["ckpt"].body == b"old" * 1000:
            meta = ObjectMeta(Kind.FILE, 0o644, 0, 0, 0, file_checksum(other, 500))
            await rig.tier.inner.put_file("ckpt", other, 500, meta)
        return info

    rig.tier.head = racing_head  # type: ignore[method-assign]
    await rig.fs.rename(ROOT, b"ckpt", ROOT, b"ckpt.prev")
    with trio.move_on_after(60):
        await rig.settle()
    assert rig.objects.get("ckpt.prev") is None or \
        rig.objects["ckpt.prev"].body == b"old" * 1000
    # Reported, not retried forever (which would hold every later marker of this node): the
    # only copy of ckpt.prev was overwritten, so it is incomplete.
    assert rig.fs.ns.get(await rig.ino("ckpt.prev")).incomplete
    assert not rig.uploader.outstanding()


async def test_a_marker_moving_away_from_a_key_a_new_marker_wants_does_not_deadlock(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``step/.metadata`` (evicted) moves with ``mv step old``; a new ``step/.metadata`` is
    written; then ``mv old older`` numbers the moving marker after the new one. The new one
    waits for the old one to leave its key, the old one (a marker) waits for every earlier
    item: the old copy is parked first, which is no publication and needs no order."""
    await rig.write("step/shard", b"s" * 1000)
    await rig.write("step/.metadata", b"old meta")
    await rig.settle()
    await _evict(rig, "step/shard", "step/.metadata")
    gate = trio.Event()
    head = rig.tier.head

    async def gated_head(key: str) -> ObjectInfo:
        if key == "step/shard":
            await gate.wait()  # the shard's move (and so the marker's) waits for the renames
        return await head(key)

    rig.tier.head = gated_head  # type: ignore[method-assign]
    await rig.fs.rename(ROOT, b"step", ROOT, b"old")
    await rig.write("step/.metadata", b"new meta")
    await rig.fs.rename(ROOT, b"old", ROOT, b"older")
    gate.set()
    with trio.fail_after(600):
        await rig.settle()
    assert rig.files() == {"older/shard": b"s" * 1000, "older/.metadata": b"old meta",
                           "step/.metadata": b"new meta"}


async def test_a_symlink_made_at_a_key_being_moved_away_waits_for_the_move(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``mv ckpt ckpt.prev`` of an evicted file, its move failing once (a transient error),
    then a symlink made at ``ckpt``: its put (an empty object with its meta) must not
    overwrite the only copy of the file before the move has copied it (rule 1 holds for
    every put, not only a file's). Without it the move finds the symlink, and the file is
    lost ("the only copy ... is gone", retried forever: hence the deadline)."""
    await rig.write("ckpt", b"old" * 1000)
    await rig.settle()
    await _evict(rig, "ckpt")
    rig.tier.fail_next = 1  # the move's HEAD
    await rig.fs.rename(ROOT, b"ckpt", ROOT, b"ckpt.prev")
    rig.fs.symlink(ROOT, b"ckpt", b"ckpt.prev", ROOT_CALLER)
    with trio.fail_after(3600):  # trio time: the autojump clock makes it instant
        await rig.settle()
    assert not rig.uploader.failed()
    assert rig.files() == {"ckpt.prev": b"old" * 1000}
    assert rig.objects["ckpt"].meta.kind is Kind.SYMLINK
    assert await _read(rig, "ckpt.prev") == b"old" * 1000


async def test_a_file_whose_rename_is_not_in_the_store_is_never_evicted(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``mv x y`` while the store is down: ``y``'s committed copy is still at ``x`` until its
    move runs. Its local copy is not evicted (for room, by ``ckptfs evict``, or by retention):
    another node deleting or overwriting ``x`` meanwhile would leave nothing to move."""
    await rig.write("x", b"x" * 1000)
    await rig.settle()
    rig.tier.down = True
    await rig.fs.rename(ROOT, b"x", ROOT, b"y")
    await trio.sleep(5)
    ino = await rig.ino("y")
    row = rig.fs.getattr(ino)
    assert row.state is State.COMMITTED and row.remote_key == "x"
    assert not rig.fs.evictable(row)
    assert rig.fs.evict_for_space(10_000) == 0
    evicted, _, kept = await rig.fs.evict_tree(ROOT)
    assert evicted == 0 and kept == ["y: its rename is not carried to the store yet"]
    del rig.objects["x"]  # another node deletes the old key meanwhile
    rig.tier.down = False
    rig.uploader.hurry()
    with trio.fail_after(600):
        await rig.settle()
    assert rig.objects["y"].body == b"x" * 1000  # uploaded again from the local copy
    assert rig.fs.evictable(rig.fs.getattr(ino))
