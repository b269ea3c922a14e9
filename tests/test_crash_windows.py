"""Crash windows between the journal and the staging directory or the store, in-process.

A "kill" is an exception raised at a chosen point (or a state built directly, as a crash
leaves it); the node is then started again over the same staging directory and must converge
to what the store and the journal say. Deterministic: the autojump clock, a memory store.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.engine.fs import RENAME_EXCHANGE
from ckptfs.engine.keys import PARKING_PREFIX
from ckptfs.engine.upload import is_marker
from ckptfs.state.journal import ROOT_INODE, Row, State
from ckptfs.state.staging import Staging
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.test_read_path import node

DATA = os.urandom(700_000)  # several fetch blocks (256 KiB)


class Killed(Exception):
    """The daemon died here."""


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"crash-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


def _kill(*_: object) -> None:
    raise Killed


def _marker(key: str) -> bool:
    return is_marker(key.rstrip("/").rsplit("/", 1)[-1], DEFAULT_COMMIT_MARKERS)


def watch_markers(monkeypatch: pytest.MonkeyPatch, copy_bandwidth: float | None = None
                  ) -> dict[str, set[str]]:
    """Every server-side copy to a marker's key -> the keys the store held the moment it
    landed. ``copy_bandwidth`` (bytes/s) makes copies take time by size: a slow tier, where
    a small marker moved alongside big shards would land first."""
    seen: dict[str, set[str]] = {}
    real_copy = MemoryTier.copy

    async def copy(self: MemoryTier, src: str, dst: str, *,
                   if_etag: str | None = None) -> str | None:
        source = self.objects.get(src)
        if copy_bandwidth and source is not None:
            await trio.sleep(len(source.body) / copy_bandwidth)
        tag = await real_copy(self, src, dst, if_etag=if_etag)
        if _marker(dst):
            seen[dst] = set(self.objects)
        return tag

    monkeypatch.setattr(MemoryTier, "copy", copy)
    return seen


async def _committed(root: Path, store: str, path: str) -> int:
    """A node under ``root`` writes ``path`` and waits until it is committed; its inode."""
    async with node(root, store) as a:
        ino = await a.write(path, DATA)
        await a.sync()
        assert a.fs.getattr(ino).state is State.COMMITTED
    assert store_named(store)[path].body == DATA
    return ino


async def _read_after_restart(root: Path, store: str, path: str, ino: int) -> Row:
    """Restart over ``root``: the file reads back as the store holds it, fetched from there."""
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        assert row.state is State.REMOTE, "no local data: it must be read from the store"
        gets = a.tier.calls["read_into"]
        assert await a.read(path) == store_named(store)[path].body == DATA
        assert a.tier.calls["read_into"] > gets
        return row


# -- (a) eviction: journal REMOTE first, then unlink -------------------------------------------


async def test_kill_during_eviction_before_the_journal_keeps_a_readable_file(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Killed when the eviction is about to journal REMOTE: the local copy must still be
    there (nothing was unlinked before the journal said so), and the file reads right."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        a.fs.ns.persist = _kill  # type: ignore[method-assign]
        with pytest.raises(Killed):
            a.fs.evict(row)
    async with node(root, store) as a:
        assert a.fs.getattr(ino).state is State.COMMITTED
        assert await a.read("step_1/model.pt") == DATA


@pytest.mark.parametrize("at", ["discard", "remove_trashed"])
async def test_kill_during_eviction_after_the_journal_reads_from_the_store(
    tmp_path: Path, store: str, at: str, autojump_clock: trio.abc.Clock
) -> None:
    """Killed after the journal said REMOTE, before the data file went to the trash or before
    the trash was emptied: the leftover is garbage, removed at start, and the file is fetched
    from the store."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        setattr(a.fs.staging, at, _kill)
        with pytest.raises(Killed):
            a.fs.evict(row)
    left = list((root / "trash").iterdir()) if (root / "trash").exists() else []
    assert len(left) == (at == "remove_trashed")
    async with node(root, store) as a:
        assert not a.fs.staging.exists(ino), "a REMOTE row's unrecorded data file is garbage"
        assert not (root / "trash").exists() or not list((root / "trash").iterdir())
        assert a.fs.space.used == 0
    await _read_after_restart(root, store, "step_1/model.pt", ino)


def _hold_unlinks(staging: Staging) -> tuple[trio.Event, trio.Event]:
    """Make the worker thread's unlinks of trashed files wait: the first event is set when
    one starts, and it goes on once the second is."""
    started, go_on = trio.Event(), trio.Event()
    real_remove = staging.remove_trashed

    def held_remove(paths: list[Path]) -> None:
        trio.from_thread.run_sync(started.set)
        trio.from_thread.run(go_on.wait)
        real_remove(paths)

    staging.remove_trashed = held_remove  # type: ignore[method-assign]
    return started, go_on


async def test_a_read_while_the_eviction_unlinks_in_a_thread(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """``evict_async`` waits for the journal's fsync and the unlink in worker threads; a read
    meanwhile faults the file in again into a new data file, which the unlink of the old one
    (moved to the trash) must not touch: the bytes stay right, during and after. The space
    comes back only once the unlink returned."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        used = a.fs.space.used
        unlinked, go_on = _hold_unlinks(a.fs.staging)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.fs.evict_async, row)
            await unlinked.wait()
            assert a.fs.getattr(ino).state is State.REMOTE
            assert a.fs.space.used == used, "given back before the disk has the space"
            assert await a.read("step_1/model.pt") == DATA  # fetched into a new data file
            before = a.fs.space.used  # the old copy, and the new one's fetched bytes
            go_on.set()
        assert a.fs.space.used == before - len(DATA)
        assert await a.read("step_1/model.pt") == DATA
        assert not list((root / "trash").iterdir())


async def test_a_big_removed_file_is_unlinked_in_a_thread_and_its_space_wakes_a_writer(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removed multi-GB file (here: above a lowered threshold) goes to the trash and is
    unlinked in a worker thread. A writer short of space meanwhile, with nothing to evict and
    the store down (so no upload progress will come), gets the space once the unlink
    returned, not before and not never."""
    monkeypatch.setattr("ckptfs.engine.fs.UNLINK_IN_BACKGROUND", 100_000)
    n = 200_000
    async with node(tmp_path / "a", store, max_bytes=2 * n) as a:
        a.tier.down = True
        await a.write("old.bin", os.urandom(2 * n))
        assert a.fs.space.used == 2 * n
        unlinking, go_on = _hold_unlinks(a.fs.staging)
        new = os.urandom(n)
        written_at: list[float] = []

        async def writer() -> None:
            await a.write("new.bin", new)
            written_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.sleep(5)
            assert a.fs.stall_seconds == 0, "the writer waits"
            await a.fs.unlink(ROOT_INODE, b"old.bin")
            await unlinking.wait()
            assert len(list((tmp_path / "a" / "trash").iterdir())) == 1
            await trio.sleep(5)
            assert a.fs.space.used == 2 * n, "given back before the disk has the space"
            go_on.set()
            freed_at = trio.current_time()
        # Woken by the unlink itself (virtual time: the store's retries would take seconds).
        assert written_at[0] - freed_at < 0.1
        assert a.fs.space.used == n
        assert not list((tmp_path / "a" / "trash").iterdir())
        assert await a.read("new.bin") == new


@pytest.mark.parametrize("left", [None, 0, len(DATA) // 2])
async def test_committed_row_without_its_data_is_read_from_the_store(
    tmp_path: Path, store: str, left: int | None, autojump_clock: trio.abc.Clock
) -> None:
    """The state an unlink-first eviction (or a power loss) leaves: a COMMITTED row whose
    data file is missing, empty or short. Start-up makes it REMOTE: never zeros or nothing."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    data_file = root / "data" / str(ino)
    if left is None:
        data_file.unlink()
    else:
        os.truncate(data_file, left)
    await _read_after_restart(root, store, "step_1/model.pt", ino)


# -- (b) a restart finishes the server-side moves of evicted (REMOTE) files ------------------


async def _evicted_tree(root: Path, store: str, files: dict[str, bytes]) -> None:
    """Write ``files`` under ``step_1/``, commit them and evict them all (state REMOTE)."""
    async with node(root, store) as a:
        for path, data in files.items():
            await a.write(path, data)
        await a.sync()
        step = await a.resolve("step_1")
        assert (await a.fs.evict_tree(step.ino))[0] == len(files)
        for path in files:
            assert a.fs.getattr((await a.resolve(path)).ino).state is State.REMOTE


@pytest.mark.parametrize("renamed", ["directory", "file"])
async def test_restart_finishes_the_move_of_an_evicted_renamed_file(
    tmp_path: Path, store: str, renamed: str, monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock
) -> None:
    """Rename an evicted file (or its directory), kill before the store copy + delete: the
    restart moves the object to its new key and removes the old one; a marker moved by the
    restart lands after the shards (it was closed first here, so the journal's order would
    have put it first)."""
    root = tmp_path / "a"
    files = {"step_1/.metadata": b"index", "step_1/model/shard_0": DATA,
             "step_1/model/shard_1": DATA[::-1]}
    await _evicted_tree(root, store, files)
    async with node(root, store) as a:
        if renamed == "directory":
            await a.fs.rename(ROOT_INODE, b"step_1", ROOT_INODE, b"step_2")
            moves = {p: p.replace("step_1/", "step_2/") for p in files}
        else:
            model = (await a.resolve("step_1/model")).ino
            await a.fs.rename(model, b"shard_0", model, b"shard_9")
            moves = {"step_1/model/shard_0": "step_1/model/shard_9"}
        a.tier.hang = True  # the store never sees the moves: the daemon dies first
        await trio.sleep(5)
    objects = store_named(store)
    assert all(old in objects and new not in objects for old, new in moves.items())
    landed = watch_markers(monkeypatch, copy_bandwidth=1_000_000)
    async with node(root, store) as a:
        with trio.fail_after(3600):
            await a.sync()
        for old, new in moves.items():
            assert old not in objects, f"{old}: the old key stayed behind"
            assert objects[new].body == files[old], f"{new}: not moved"
            assert a.fs.getattr((await a.resolve(new)).ino).state is State.REMOTE
            assert await a.read(new) == files[old]
    for marker, present in landed.items():
        shards = {new for new in moves.values() if not _marker(new)}
        assert shards <= present, f"{marker} landed before {sorted(shards - present)}"
    assert set(landed) == {new for new in moves.values() if _marker(new)}


# -- (c) a directory rename moves its markers after every other file of the tree ------------


@pytest.mark.parametrize("marker", [".metadata", "COMMITTED"])
async def test_renamed_tree_moves_its_markers_after_the_deeper_shards(
    tmp_path: Path, store: str, marker: str, monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock
) -> None:
    """Orbax-style ``step_1/{<marker>, model/shard_0, model/shard_1}`` renamed to ``step_2``
    over a slow tier (server-side copies take time by size): the moment the marker's new key
    appears in the store, every shard's new key is already there."""
    files = {f"step_1/{marker}": b"index", "step_1/model/shard_0": DATA,
             "step_1/model/shard_1": DATA[::-1], "step_1/model/deeper/shard_2": DATA[:300_000]}
    landed = watch_markers(monkeypatch, copy_bandwidth=1_000_000)
    async with node(tmp_path / "a", store) as a:
        for path, data in files.items():
            await a.write(path, data)
        await a.sync()
        await a.fs.rename(ROOT_INODE, b"step_1", ROOT_INODE, b"step_2")
        with trio.fail_after(3600):
            await a.sync()
    objects = store_named(store)
    moved = {p.replace("step_1/", "step_2/", 1): data for p, data in files.items()}
    assert {k: o.body for k, o in objects.items() if k in moved} == moved
    assert not [k for k in objects if k.startswith("step_1")]
    shards = {k for k in moved if not _marker(k)}
    assert set(landed) == {f"step_2/{marker}"}
    assert shards <= landed[f"step_2/{marker}"], \
        f"the marker landed before {sorted(shards - landed[f'step_2/{marker}'])}"


# -- (d) a directory swap killed halfway through its parking (keys.py rule 2) ---------------


@pytest.mark.parametrize("kill_at", ["parked, not journalled", "parked and journalled"])
async def test_restart_in_the_middle_of_a_directory_swap(
    tmp_path: Path, store: str, kill_at: str, autojump_clock: trio.abc.Clock
) -> None:
    """``RENAME_EXCHANGE`` of ``cur`` and ``nxt`` (both hold an evicted ``model.pt``): the
    moves form a ring, one copy is parked. Killed right after the parking copy (before the
    journal knows it holds the file) or right after the parking (at the next move): the
    restart brings each copy to its new key and leaves no parked copy behind."""
    root = tmp_path / "a"
    files = {"cur/model.pt": DATA, "nxt/model.pt": DATA[::-1]}
    async with node(root, store) as a:
        for path, data in files.items():
            await a.write(path, data)
        await a.sync()
        for name in ("cur", "nxt"):
            await a.fs.evict_tree((await a.resolve(name)).ino)
    async with node(root, store) as a:
        copy = a.tier.copy

        async def dying_copy(src: str, dst: str, **kw: object) -> object:
            parking = dst.startswith(PARKING_PREFIX)
            if parking and kill_at == "parked, not journalled":
                await copy(src, dst, **kw)  # type: ignore[arg-type]
                await trio.sleep_forever()
            if not parking and kill_at == "parked and journalled":
                await trio.sleep_forever()
            return await copy(src, dst, **kw)  # type: ignore[arg-type]

        a.tier.copy = dying_copy  # type: ignore[assignment,method-assign]
        await a.fs.rename(ROOT_INODE, b"cur", ROOT_INODE, b"nxt", RENAME_EXCHANGE)
        await trio.sleep(5)
    objects = store_named(store)
    assert any(k.startswith(PARKING_PREFIX) for k in objects)  # killed with a parked copy
    async with node(root, store) as a:
        with trio.fail_after(3600):
            await a.sync()
        assert objects["cur/model.pt"].body == DATA[::-1]
        assert objects["nxt/model.pt"].body == DATA
        assert not [k for k in objects if k.startswith(PARKING_PREFIX)]
        assert await a.read("cur/model.pt") == DATA[::-1]
        assert await a.read("nxt/model.pt") == DATA
