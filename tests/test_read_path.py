"""The read path without a mount: two "nodes" (core + uploader) over one memory store.

Node A writes and uploads; node B starts with an empty staging directory and must see and
read everything through the store: the namespace merge (listing.py) and range fault-in
(fetch.py). Deterministic: the autojump clock stands in for time (metadata_ttl, backoff).
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs import errors
from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.engine.fs import ROOT_CALLER, Filesystem, ReadSettings
from ckptfs.engine.listing import HEADS_BEFORE_LISTING
from ckptfs.state.journal import ROOT_INODE, Journal, Row, State
from ckptfs.state.staging import SpaceBudget, Staging
from ckptfs.store.tiers.base import Kind, ObjectInfo, ObjectMeta
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, _Object, store_named
from tests.cluster import write_file

BLOCK = 256 * 1024
TTL = 5.0
SETTINGS = ReadSettings(metadata_ttl=TTL, fetch_block_size=BLOCK, fetch_concurrency=4,
                        readahead_bytes=4 * BLOCK)


@dataclass
class Node:
    fs: Filesystem
    tier: FaultyTier

    async def resolve(self, path: str) -> Row:
        row = self.fs.getattr(ROOT_INODE)
        for part in path.split("/"):
            row = await self.fs.lookup(row.ino, part.encode())
        return row

    async def write(self, path: str, data: bytes, mode: int = 0o644) -> int:
        return await write_file(self.fs, path, data, mode)

    async def read(self, path: str, offset: int = 0, size: int = 1 << 40) -> bytes:
        fh = await self.fs.open((await self.resolve(path)).ino, os.O_RDONLY)
        try:
            return await self.fs.read(fh, offset, size)
        finally:
            self.fs.release(fh)

    async def names(self, path: str = "") -> list[str]:
        ino = (await self.resolve(path)).ino if path else ROOT_INODE
        return sorted(os.fsdecode(r.name or b"") for r in await self.fs.readdir(ino, 0))

    async def sync(self) -> None:
        listener = self.fs.listener
        await listener.wait_until_done(listener.last_seq())
        await listener.wait_idle()  # type: ignore[attr-defined]


@asynccontextmanager
async def node(root: Path, store: str, settings: ReadSettings = SETTINGS, *,
               max_bytes: int | None = None) -> AsyncIterator[Node]:
    """A node (core + uploader) over ``root``, started as a mount starts it; ``max_bytes``
    caps its staging space."""
    from ckptfs.engine.upload import Uploader

    tier = FaultyTier(MemoryTier("warm", f"memory://{store}", store))
    staging = Staging(root)
    staging.prepare()
    journal = Journal(root / "journal.db")
    fs = Filesystem(journal, staging, tier=tier, read=settings,
                    space=SpaceBudget(staging, max_bytes, 0.0))
    fs.start()
    uploader = Uploader(journal, fs.ns, staging, tier, concurrency=4,
                        markers=DEFAULT_COMMIT_MARKERS, min_block=settings.fetch_block_size)
    fs.listener = uploader
    uploader.requeue_from_journal()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            assert fs.fetcher is not None
            fs.fetcher.nursery = nursery
            fs.nursery = nursery
            yield Node(fs, tier)
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


async def publish(root: Path, store: str, files: dict[str, bytes]) -> None:
    """A node under ``root`` writes ``files`` (path -> bytes) and uploads them to ``store``."""
    async with node(root, store) as a:
        for path, data in files.items():
            await a.write(path, data)
        await a.sync()


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"read-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


async def test_fresh_node_sees_the_tree_with_its_metadata(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    async with node(tmp_path / "a", store) as a:
        await a.write("step_1/model.pt", b"m" * 1000, mode=0o600)
        await a.write("step_1/optim.pt", b"o" * 10)
        a.fs.mkdir(ROOT_INODE, b"empty", 0o750, ROOT_CALLER)
        a.fs.symlink(ROOT_INODE, b"latest", b"step_1", ROOT_CALLER)
        await a.sync()
        written = {p: a.fs.getattr((await a.resolve(p)).ino)
                   for p in ("step_1", "step_1/model.pt", "step_1/optim.pt", "empty", "latest")}
    async with node(tmp_path / "b", store) as b:
        assert await b.names() == ["empty", "latest", "step_1"]
        assert await b.names("step_1") == ["model.pt", "optim.pt"]
        for path, want in written.items():
            got = b.fs.getattr((await b.resolve(path)).ino)
            assert (got.mode, got.size, got.uid, got.gid) == (want.mode, want.size, want.uid,
                                                              want.gid), path
            if not stat.S_ISDIR(want.mode):
                assert got.mtime_ns == want.mtime_ns, path
        assert b.fs.readlink((await b.resolve("latest")).ino) == b"step_1"
        assert b.fs.getattr((await b.resolve("step_1/model.pt")).ino).state is State.REMOTE
        assert b.tier.calls["read_into"] == 0  # listing reads no file body
        assert await b.read("step_1/model.pt") == b"m" * 1000


async def test_only_what_is_read_is_fetched_and_kept_across_restart(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(40 * BLOCK + 123)
    await publish(tmp_path / "a", store, {"ckpt.pt": data})
    no_readahead = ReadSettings(metadata_ttl=TTL, fetch_block_size=BLOCK, readahead_bytes=0)
    async with node(tmp_path / "b", store, no_readahead) as b:
        assert await b.read("ckpt.pt", 10 * BLOCK + 5, 100) == data[10 * BLOCK + 5:][:100]
        assert b.tier.calls["read_into"] == 1 and b.tier.bytes_read == BLOCK
        # A read across a block boundary fetches the next block only.
        assert await b.read("ckpt.pt", 11 * BLOCK - 10, 20) == data[11 * BLOCK - 10:][:20]
        assert b.tier.calls["read_into"] == 2
        assert await b.read("ckpt.pt", 10 * BLOCK, 2 * BLOCK) == data[10 * BLOCK:12 * BLOCK]
        assert b.tier.calls["read_into"] == 2  # served locally
        assert b.fs.space.used == 2 * BLOCK
    async with node(tmp_path / "b", store, no_readahead) as b:
        assert b.fs.space.used == 2 * BLOCK
        assert await b.read("ckpt.pt", 10 * BLOCK, 2 * BLOCK) == data[10 * BLOCK:12 * BLOCK]
        assert b.tier.calls["read_into"] == 0  # the fetched ranges survived the restart
        assert await b.read("ckpt.pt") == data  # the rest, then the file is whole and local
        row = b.fs.getattr((await b.resolve("ckpt.pt")).ino)
        # It becomes a local copy (an fdatasync) in the background once fetching pauses.
        with trio.fail_after(60):
            while row.state is not State.COMMITTED:
                await trio.sleep(0.1)
        assert b.tier.bytes_read == len(data) - 2 * BLOCK
        assert b.fs.space.used == len(data)


async def test_a_download_is_made_durable_once_it_pauses(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Fetched ranges are synced and journaled, and a whole file becomes a local copy, once
    no fetch has landed for a flush interval: not while the download runs (an fdatasync
    then made the disk write what the reader was about to read)."""
    data = os.urandom(8 * BLOCK + 7)
    await publish(tmp_path / "a", store, {"ckpt.pt": data})
    no_readahead = ReadSettings(metadata_ttl=TTL, fetch_block_size=BLOCK, readahead_bytes=0)
    async with node(tmp_path / "b", store, no_readahead) as b:
        fetcher = b.fs.fetcher
        assert fetcher is not None
        row = await b.resolve("ckpt.pt")
        assert await b.read("ckpt.pt", 0, 10) == data[:10]
        await fetcher.flush(quiet=1.0)  # a fetch just landed: the download is under way
        assert b.fs.journal.ranges(row.ino) == []
        await trio.sleep(1.5)
        await fetcher.flush(quiet=1.0)
        assert b.fs.journal.ranges(row.ino) == [(0, BLOCK)]
        assert await b.read("ckpt.pt") == data  # the rest: every block verified, served
        assert b.fs.getattr(row.ino).state is State.REMOTE  # not a local copy yet
        await trio.sleep(0.5)
        assert b.fs.getattr(row.ino).state is State.REMOTE  # fetches landed 0.5 s ago
        with trio.fail_after(5):
            while b.fs.getattr(row.ino).state is not State.COMMITTED:
                await trio.sleep(0.1)
        assert b.fs.journal.ranges(row.ino) == []  # a whole local copy has no ranges
        assert await b.read("ckpt.pt") == data
        assert b.tier.bytes_read == len(data)  # nothing fetched twice


async def test_concurrent_readers_share_one_fetch_and_readahead_runs_ahead(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(16 * BLOCK)
    await publish(tmp_path / "a", store, {"f": data})
    async with node(tmp_path / "b", store) as b:
        b.tier.latency = 1.0  # every GET takes a (virtual) second
        results: list[bytes] = []

        async def reader() -> None:
            results.append(await b.read("f", 0, 4096))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(reader)
        assert results == [data[:4096]] * 8
        await trio.testing.wait_all_tasks_blocked()
        # Block 0 once for all eight readers, and blocks 1-2 once, ahead of them (a read at
        # offset 0 counts as the start of a sequential read: a window of two blocks).
        assert b.tier.calls["read_into"] == 3

        # A sequential reader: each read of 64 KiB; blocks ahead are fetched concurrently.
        fh = await b.fs.open((await b.resolve("f")).ino, os.O_RDONLY)
        started = trio.current_time()
        got = bytearray()
        while len(got) < len(data):
            got += await b.fs.read(fh, len(got), 64 * 1024)
        b.fs.release(fh)
        assert bytes(got) == data
        serial = 16 * 1.0  # one GET after another would take this long
        assert trio.current_time() - started < serial / 2
        assert b.tier.calls["read_into"] == 16


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reads=st.lists(st.tuples(st.integers(0, 5 * BLOCK), st.integers(1, 3 * BLOCK)),
                      min_size=1, max_size=12))
def test_random_range_reads_equal_the_source(tmp_path_factory: pytest.TempPathFactory,
                                             reads: list[tuple[int, int]]) -> None:
    data = os.urandom(4 * BLOCK + 777)
    root = tmp_path_factory.mktemp("ranges")
    name = f"ranges-{root.name}"
    store_named(name).clear()

    async def main() -> None:
        await publish(root / "a", name, {"d/x.bin": data})
        async with node(root / "b", name) as b:
            for offset, size in reads:
                assert await b.read("d/x.bin", offset, size) == data[offset:offset + size]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.1))


async def test_corrupt_object_gives_eio_and_deleted_object_estale(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(3 * BLOCK)
    await publish(tmp_path / "a", store, {"good": data, "bad": data, "gone": data})
    objects = store_named(store)
    # Rewritten behind ckptfs's back: other bytes, the same metadata.
    corrupt = bytearray(data)
    corrupt[BLOCK + 17] ^= 0x01
    objects["bad"] = _Object(bytes(corrupt), objects["bad"].meta)
    async with node(tmp_path / "b", store) as b:
        assert await b.read("bad", 0, 100) == data[:100]  # block 0 is intact
        with pytest.raises(errors.ChecksumMismatch):
            await b.read("bad", BLOCK, 100)
        assert b.fs.fetcher is not None and b.fs.fetcher.stats.integrity_failures == 2
        assert any("bad" in message for _, message in b.fs.fetcher.stats.errors)
        ino = (await b.resolve("gone")).ino
        del objects["gone"]
        fh = await b.fs.open(ino, os.O_RDONLY)
        with pytest.raises(errors.ObjectGone, match="deleted"):
            await b.fs.read(fh, 0, 10)
        b.fs.release(fh)
        assert await b.read("good") == data


async def test_whole_file_checksum_guards_objects_without_block_sums(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    import crc32c

    data = os.urandom(2 * BLOCK)
    objects = store_named(store)
    meta = ObjectMeta(Kind.FILE, 0o644, 1, 0, 0, f"crc32c:{crc32c.crc32c(data):08x}")
    objects["plain"] = _Object(data[:-1] + b"\0", meta)  # no block sums; last byte wrong
    async with node(tmp_path / "b", store) as b:
        with pytest.raises(errors.ChecksumMismatch):
            await b.read("plain")
        objects["plain"] = _Object(data, meta)
        assert await b.read("plain") == data


async def test_changes_on_another_node_show_after_the_ttl(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    async with node(tmp_path / "a", store) as a, node(tmp_path / "b", store) as b:
        await a.write("old", b"1")
        await a.write("keep", b"2")
        await a.sync()
        assert await b.names() == ["keep", "old"]
        await a.fs.unlink(ROOT_INODE, b"old")
        ino = (await a.resolve("keep")).ino
        fh = await a.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        await a.fs.write(fh, 0, b"version 2")
        a.fs.release(fh)
        await a.write("new", b"3")
        await a.sync()
        assert await b.names() == ["keep", "old"]  # cached for metadata_ttl
        await trio.sleep(TTL + 1)
        assert await b.names() == ["keep", "new"]
        assert await b.read("keep") == b"version 2"
        with pytest.raises(errors.NotFound):
            await b.resolve("old")


async def test_negative_lookups_are_cached(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    async with node(tmp_path / "b", store) as b:
        for _ in range(5):
            with pytest.raises(errors.NotFound):
                await b.resolve("nothing")
        assert b.tier.calls["list"] == 1
        store_named(store)["nothing"] = _Object(b"x", ObjectMeta())
        await trio.sleep(TTL + 1)
        assert (await b.resolve("nothing")).size == 1


async def test_unsafe_names_from_the_store_are_refused(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    objects = store_named(store)
    for key in ("../x", "a/../../b", "c/" + "n" * 300, "d//e", "ok/f", "ok/./g"):
        objects[key] = _Object(b"data", ObjectMeta())
    async with node(tmp_path / "b", store) as b:
        names = await b.names()
        assert ".." not in names and "" not in names
        assert await b.names("ok") == ["f"]
        assert await b.names("c") == []
        assert await b.names("d") == []
        assert await b.names("a") == []
        assert b.fs.lister is not None
        refused = {key for key, _ in b.fs.lister.refused}
        assert {"../", "a/../", "c/" + "n" * 300, "d//", "ok/./"} <= refused
    assert "refusing store entry" in caplog.text


async def test_local_only_unlink_hides_the_path_but_keeps_the_object(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    async with node(tmp_path / "a", store) as a:
        a.fs.unlink_remote = False
        await a.write("step_1/m.pt", b"x")
        await a.sync()
        await a.fs.unlink((await a.resolve("step_1")).ino, b"m.pt")
        await trio.sleep(TTL + 1)
        assert await a.names("step_1") == []
        assert "step_1/m.pt" in store_named(store)
        await a.write("step_1/m.pt", b"new")  # the path is usable again
        await a.sync()
        await trio.sleep(TTL + 1)
        assert await a.names("step_1") == ["m.pt"]
        assert await a.read("step_1/m.pt") == b"new"


async def test_remote_directory_rename_moves_every_descendant(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    await publish(tmp_path / "a", store, {f"run/step_{i}/shard": bytes([i]) * 10
                                          for i in range(3)})
    async with node(tmp_path / "b", store) as b:
        run = await b.resolve("run")  # only the top directory is listed so far
        await b.fs.rename(ROOT_INODE, b"run", ROOT_INODE, b"run.old")
        await b.sync()
        keys = sorted(k for k, o in store_named(store).items() if o.meta.kind is Kind.FILE)
        assert keys == [f"run.old/step_{i}/shard" for i in range(3)]
        assert await b.read("run.old/step_2/shard") == b"\2" * 10
        assert run.ino == (await b.resolve("run.old")).ino
        with pytest.raises(errors.NotEmpty):
            await b.fs.rmdir(ROOT_INODE, b"run.old")


async def test_writing_a_remote_file_fetches_it_first_truncating_does_not(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(3 * BLOCK)
    await publish(tmp_path / "a", store, {"f": data, "g": data})
    async with node(tmp_path / "b", store) as b:
        fh = await b.fs.open((await b.resolve("f")).ino, os.O_RDWR)
        await b.fs.write(fh, 0, b"HEAD")
        b.fs.release(fh)
        assert b.tier.bytes_read == len(data)
        fh = await b.fs.open((await b.resolve("g")).ino, os.O_WRONLY | os.O_TRUNC)
        await b.fs.write(fh, 0, b"short")
        b.fs.release(fh)
        assert b.tier.bytes_read == len(data)  # g was not downloaded
        await b.sync()
        assert store_named(store)["f"].body == b"HEAD" + data[4:]
        assert store_named(store)["g"].body == b"short"


async def test_a_bad_integrity_block_spoils_only_itself(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    data = os.urandom(4 * BLOCK)
    await publish(tmp_path / "a", store, {"f": data})
    objects = store_named(store)
    corrupt = bytearray(data)
    corrupt[2 * BLOCK + 5] ^= 0xFF
    objects["f"] = _Object(bytes(corrupt), objects["f"].meta)
    # Fetch blocks of four integrity blocks: one GET brings the bad block and three good ones.
    wide = ReadSettings(metadata_ttl=TTL, fetch_block_size=4 * BLOCK, readahead_bytes=0)
    async with node(tmp_path / "b", store, wide) as b:
        assert await b.read("f", 0, BLOCK) == data[:BLOCK]
        assert await b.read("f", 3 * BLOCK, BLOCK) == data[3 * BLOCK:]
        with pytest.raises(errors.ChecksumMismatch):
            await b.read("f", 2 * BLOCK, 10)
        assert b.fs.space.used == 3 * BLOCK  # the good blocks, nothing more


async def test_a_listing_answered_before_a_deletion_does_not_bring_it_back(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """The store answers a listing, then the entry is removed here and its object deleted
    (tombstone gone) before the listing is merged: the stale answer must not resurrect it."""
    async with node(tmp_path / "a", store) as a:
        await a.write("gone", b"1")
        a.fs.mkdir(ROOT_INODE, b"h", 0o755, ROOT_CALLER)
        await a.sync()
        answered, merge = trio.Event(), trio.Event()
        list_dir = a.tier.list_dir

        async def stale_list_dir(prefix: str) -> list[ObjectInfo]:
            entries = await list_dir(prefix)
            if prefix == "":  # the root's: rmdir lists "h/" itself first
                answered.set()
                await merge.wait()
            return entries

        a.tier.list_dir = stale_list_dir  # type: ignore[method-assign]
        await trio.sleep(TTL + 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.names)
            await answered.wait()
            await a.fs.unlink(ROOT_INODE, b"gone")
            await a.fs.rmdir(ROOT_INODE, b"h")
            await a.sync()
            assert "gone" not in store_named(store) and "h/" not in store_named(store)
            merge.set()
        a.tier.list_dir = list_dir  # type: ignore[method-assign]
        assert await a.names() == []


async def test_a_listing_during_a_move_does_not_take_its_new_key_for_a_new_entry(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """A rename's server-side copy has landed and the file is renamed again before the move
    finishes: a listing meanwhile sees the copy, which is nobody's new file."""
    async with node(tmp_path / "a", store) as a:
        await a.write("e", b"data")
        await a.sync()
        copied, finish = trio.Event(), trio.Event()
        copy = a.tier.copy

        async def paused_copy(src: str, dst: str, *, if_etag: str | None = None) -> None:
            await copy(src, dst, if_etag=if_etag)
            copied.set()
            await finish.wait()

        a.tier.copy = paused_copy  # type: ignore[method-assign]
        await a.fs.rename(ROOT_INODE, b"e", ROOT_INODE, b"c", 0)
        await copied.wait()
        assert "c" in store_named(store)
        await a.fs.rename(ROOT_INODE, b"c", ROOT_INODE, b"f", 0)
        await trio.sleep(TTL + 1)
        assert await a.names() == ["f"]
        finish.set()
        await a.sync()
        a.tier.copy = copy  # type: ignore[method-assign]
        assert await a.names() == ["f"]
        assert sorted(k for k in store_named(store)) == ["f"]
        assert await a.read("f") == b"data"


async def test_a_listing_during_a_symlink_put_does_not_keep_its_old_name(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """A symlink (or directory marker) is renamed while its put is on its way: the object at
    the old name is nobody's new entry, and ends up deleted."""
    async with node(tmp_path / "a", store) as a:
        landed, finish = trio.Event(), trio.Event()
        put_entry = a.tier.put_entry

        async def paused_put_entry(key: str, meta: ObjectMeta) -> None:
            await put_entry(key, meta)
            if key == "g":
                landed.set()
                await finish.wait()

        a.tier.put_entry = paused_put_entry  # type: ignore[method-assign]
        a.fs.symlink(ROOT_INODE, b"g", b"target", ROOT_CALLER)
        await landed.wait()
        await a.fs.rename(ROOT_INODE, b"g", ROOT_INODE, b"b", 0)
        await trio.sleep(TTL + 1)
        assert await a.names() == ["b"]
        finish.set()
        await a.sync()
        assert await a.names() == ["b"]
        assert sorted(store_named(store)) == ["b"]
        assert a.fs.readlink((await a.resolve("b")).ino) == b"target"


async def test_a_deletion_pending_when_a_listing_starts_and_done_before_its_merge(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """The tombstone exists when the listing asks the store, and is gone (the object deleted)
    by the time the listing is merged: neither check alone would catch it."""
    async with node(tmp_path / "a", store) as a:
        await a.write("gone", b"1")
        await a.sync()
        may_delete, answered, merge = trio.Event(), trio.Event(), trio.Event()
        delete, list_dir = a.tier.delete, a.tier.list_dir

        async def held_delete(key: str, *, if_etag: str | None = None) -> None:
            await may_delete.wait()
            await delete(key, if_etag=if_etag)

        async def stale_list_dir(prefix: str) -> list[ObjectInfo]:
            entries = await list_dir(prefix)
            answered.set()
            await merge.wait()
            return entries

        a.tier.delete = held_delete  # type: ignore[method-assign]
        a.tier.list_dir = stale_list_dir  # type: ignore[method-assign]
        await a.fs.unlink(ROOT_INODE, b"gone")
        await trio.sleep(TTL + 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.names)
            await answered.wait()
            may_delete.set()
            await a.sync()
            assert "gone" not in store_named(store)
            merge.set()
        a.tier.delete, a.tier.list_dir = delete, list_dir  # type: ignore[method-assign]
        assert await a.names() == []


async def test_the_nodes_shared_state_is_not_an_entry(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    objects = store_named(store)
    objects[".ckptfs/nodes/other"] = _Object(b"{}", ObjectMeta())
    async with node(tmp_path / "a", store) as a:
        await a.write("step_1/model.pt", b"m")
        assert await a.names() == ["step_1"]
        with pytest.raises(errors.NotFound):
            await a.resolve(".ckptfs")
        with pytest.raises(errors.NotPermitted):
            a.fs.mkdir(ROOT_INODE, b".ckptfs", 0o755, ROOT_CALLER)
        with pytest.raises(errors.NotPermitted):
            await a.fs.rename(ROOT_INODE, b"step_1", ROOT_INODE, b".ckptfs")
        a.fs.mkdir((await a.resolve("step_1")).ino, b".ckptfs", 0o755, ROOT_CALLER)  # elsewhere: ok


async def test_a_lookup_after_a_remount_checks_its_entry_not_the_whole_directory(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """A remount over the same staging knows every entry, but no directory counts as listed;
    the first lookup in a directory must not list all of it (that would be store and journal
    work O(files in it), per directory touched). A committed file is checked with one HEAD of
    its key; a directory is listed after ``HEADS_BEFORE_LISTING`` such checks."""
    dirs, per_dir = 6, 2 * HEADS_BEFORE_LISTING
    await publish(tmp_path / "a", store, {f"d{d}/f{f:02d}": bytes([d, f])
                                          for d in range(dirs) for f in range(per_dir)})
    async with node(tmp_path / "a", store) as a:
        before = Counter(a.tier.calls)
        for d in range(dirs):
            assert (await a.resolve(f"d{d}/f03")).size == 2
        calls = a.tier.calls - before
        # The root's listing (its directories are entries of a directory not listed since
        # the mount: not checked alone), then one HEAD per file; no listing of d0..d5.
        assert (calls["list"], calls["head"]) == (1, dirs)
        assert a.fs.lister is not None and a.fs.lister.entry_heads == dirs
        before = Counter(a.tier.calls)
        for d in range(dirs):  # within the ttl: nothing asks the store again
            await a.resolve(f"d{d}/f03")
        assert a.tier.calls - before == Counter()
        before = Counter(a.tier.calls)
        for f in range(per_dir):
            await a.resolve(f"d0/f{f:02d}")
        calls = a.tier.calls - before
        # d0 had one check; HEADS_BEFORE_LISTING - 1 more, then its listing covers the rest.
        assert (calls["list"], calls["head"]) == (1, HEADS_BEFORE_LISTING - 1)
        assert await a.read("d0/f05") == bytes([0, 5])


async def test_what_another_node_changed_during_a_remount_shows_at_the_first_lookup(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """The HEAD of a known entry (above) never answers for a changed object: a new version,
    a deletion or a file turned directory by another node while this one was unmounted lists
    the directory, which decides as before."""
    await publish(tmp_path / "a", store, {"d/new": b"1", "d/gone": b"2", "d/kind": b"3",
                                          "d/same": b"4"})
    async with node(tmp_path / "b", store) as b:
        await b.write("d/new", b"version 2")
        await b.fs.unlink((await b.resolve("d")).ino, b"gone")
        await b.fs.unlink((await b.resolve("d")).ino, b"kind")
        await b.write("d/kind/inside", b"5")
        await b.sync()
    async with node(tmp_path / "a", store) as a:
        assert (await a.resolve("d/same")).size == 1
        assert a.fs.lister is not None and a.fs.lister.entry_heads == 1
        assert await a.read("d/new") == b"version 2"
        # Written and still held here: the listing uploads it again (a listing never drops
        # the only copy; semantics), which only the listing, not a HEAD, decides.
        assert (await a.resolve("d/gone")).size == 1
        await a.sync()
        assert store_named(store)["d/gone"].body == b"2"
        assert stat.S_ISDIR((await a.resolve("d/kind")).mode)
        assert await a.read("d/kind/inside") == b"5"
