"""Directories on a file tier: removed and renamed directories leave nothing behind.

A file tier (``file://``) differs from an object store in one way that matters here: it holds
a directory wherever it holds a key beneath it (a put of ``d/x`` makes ``d``), and it cannot
delete a directory that still has entries. ``TreeTier`` gives the memory tier exactly these
two rules, so the interleavings run deterministically (autojump clock) without threads or a
real directory. Each test fails without the rule it names (ckptfs/engine/keys.py, rule 5; upload.py,
``NotEmptyYet``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from ckptfs.engine.fs import RENAME_EXCHANGE, ROOT_CALLER
from ckptfs.errors import StoreUnavailable
from ckptfs.state.journal import ROOT_INODE
from ckptfs.store.tiers.base import Finish, Kind, NotEmptyYet, ObjectMeta, Progress
from ckptfs.store.tiers.memory import MemoryTier
from tests.corerig import RecordingTier, Rig, open_rig
from tests.test_store_keys import _evict, _read

ROOT = ROOT_INODE


class TreeTier(RecordingTier):
    """The memory tier with a file tier's directories: a write makes its parents, and a
    directory with entries cannot be deleted (``NotEmptyYet``, as tiers/local.py raises).
    ``put_delay`` seconds pass between the start of a put and the moment it makes its
    parents (a slow tier); like a put in tiers/local.py's worker thread, a started put
    cannot be cancelled."""

    def __init__(self, inner: MemoryTier) -> None:
        super().__init__(inner)
        self.objects = inner.objects
        self.put_delay = 0.0

    def _make_parents(self, key: str) -> None:
        for parent in _parents(key):
            self.objects.setdefault(
                parent, self.inner.objects.get(parent)  # type: ignore[attr-defined]
                or _dir_object(self.inner))

    def _make_way(self, key: str, meta_kind: Kind) -> None:
        """What tiers/local.py does at a write of ``key``: its parents must be directories
        (a file where one is needed fails the put, a transient error there); a directory is
        made over a file or symlink of its name (``_make_directory`` unlinks it); anything
        else replaces an empty directory of its name and is refused by one with entries."""
        for parent in _parents(key):
            found = self.objects.get(parent.rstrip("/"))
            if found is not None and found.meta.kind is not Kind.DIRECTORY:
                raise StoreUnavailable(f"{parent.rstrip('/')} is not a directory")
        if meta_kind is Kind.DIRECTORY:
            self.objects.pop(key.rstrip("/"), None)
            return
        folder = key + "/"
        if any(k != folder and k.startswith(folder) for k in self.objects):
            raise NotEmptyYet(f"{key} is still a directory with entries")
        self.objects.pop(folder, None)

    async def put_file(self, key: str, source: Path, size: int, meta: ObjectMeta,
                       progress: Progress | None = None, *,
                       finish: Finish | None = None) -> str | None:
        # Not called back once started: tiers/local.py puts in a worker thread.
        with trio.CancelScope(shield=True):
            await trio.sleep(self.put_delay)
            self._make_way(key, Kind.FILE)
            self._make_parents(key)
            return await super().put_file(key, source, size, meta, progress, finish=finish)

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        self._make_way(key, meta.kind)
        self._make_parents(key)
        await super().put_entry(key, meta)

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        self._make_way(dst, Kind.FILE)
        self._make_parents(dst)
        return await super().copy(src, dst, if_etag=if_etag)

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        if key.endswith("/") and any(k != key and k.startswith(key) for k in self.objects):
            await trio.lowlevel.checkpoint()
            raise NotEmptyYet(f"{key} is not empty yet")
        await super().delete(key, if_etag=if_etag)


def _parents(key: str) -> list[str]:
    """The directory keys above ``key``: ["a/", "a/b/"] for "a/b/c"."""
    parts = key.rstrip("/").split("/")[:-1]
    return ["/".join(parts[:n]) + "/" for n in range(1, len(parts) + 1)]


def _dir_object(inner: MemoryTier) -> object:
    """An implicit directory, as a file tier lists a directory nobody put a marker for."""
    from ckptfs.store.tiers.memory import _Object
    return _Object(b"", ObjectMeta(Kind.DIRECTORY, 0o755))


@pytest.fixture
async def tree(tmp_path: Path, request: pytest.FixtureRequest,
               autojump_clock: trio.abc.Clock) -> AsyncIterator[Rig]:
    inner = MemoryTier("warm", "memory://t", f"tree-{request.node.name}-{id(tmp_path)}")
    inner.objects.clear()
    async with open_rig(tmp_path, TreeTier(inner), inner) as opened:
        yield opened


def _store_dirs(rig: Rig) -> set[str]:
    return {k for k, o in rig.objects.items()
            if o.meta.kind is Kind.DIRECTORY and not k.startswith(".ckptfs/")}


async def test_rmdir_while_a_file_in_it_uploads_leaves_no_directory(
        tree: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``rm d/x; rmdir d`` while ``d/x`` is on its way: the deletion of ``d/`` must wait for
    the upload (which makes ``d`` again on a file tier), or ``d`` stays in the store with no
    tombstone to remove it (the stale directories of tests/test_fsx.py, seed 3)."""
    tree.tier.put_delay = 5.0  # type: ignore[attr-defined]
    await tree.write("d/x", b"x" * 1000)
    await trio.sleep(1.0)  # d's marker is in the store; x's put is on its way
    assert "d/" in tree.objects and "d/x" not in tree.objects
    d = await tree.ino("d")
    await tree.fs.unlink(d, b"x")
    await tree.fs.rmdir(ROOT, b"d")
    await tree.settle()
    assert not tree.uploader.failed()
    assert _store_dirs(tree) == set() and tree.files() == {}


async def test_a_directory_made_where_a_removed_file_was_uploading_stays(
        tree: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``rm d; mkdir d`` while the file ``d`` is on its way: a file tier holds ``d`` and
    ``d/`` at one path, so the directory's put must wait for the file's. Before, it ran at
    once; the file's put then replaced the empty directory, the file's deletion removed it,
    and the store held no ``d`` at all: after a remount the listing removed the directory
    from the mount too (an empty directory of tests/test_fsx.py gone after a remount)."""
    tree.tier.put_delay = 5.0  # type: ignore[attr-defined]
    await tree.write("d", b"x" * 1000)
    await trio.sleep(1.0)  # the file's put is on its way
    await tree.fs.unlink(ROOT, b"d")
    tree.fs.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    await tree.settle()
    assert not tree.uploader.failed()
    assert _store_dirs(tree) == {"d/"} and tree.files() == {}


async def test_a_directory_not_empty_yet_is_no_outage(
        tree: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``rm a/b/c/f; rmdir a/b/c a/b a`` and the deletion of ``f`` fails once (a transient
    error): the directories' deletions run meanwhile and find them not empty. That is an
    ordering wait (NotEmptyYet), retried once ``f`` is gone, never counted as a store outage,
    which would let only one item at a time reach the store, on a growing backoff."""
    await tree.write("a/b/c/f", b"f")
    await tree.settle()
    c = await tree.ino("a/b/c")
    b = await tree.ino("a/b")
    a = await tree.ino("a")
    real_delete = tree.tier.delete
    failed: list[str] = []

    async def delete(key: str, *, if_etag: str | None = None) -> None:
        if key == "a/b/c/f" and not failed:
            failed.append(key)
            raise StoreUnavailable("injected failure (delete)")
        await real_delete(key, if_etag=if_etag)

    tree.tier.delete = delete  # type: ignore[method-assign]
    outage_seen = False
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            nonlocal outage_seen
            while True:
                outage_seen = outage_seen or tree.uploader.outage() is not None
                await trio.sleep(0.01)

        nursery.start_soon(watch)
        await tree.fs.unlink(c, b"f")
        await tree.fs.rmdir(b, b"c")
        await tree.fs.rmdir(a, b"b")
        await tree.fs.rmdir(ROOT, b"a")
        await tree.settle()
        nursery.cancel_scope.cancel()
    assert failed and tree.uploader.stats.retries >= 2  # the directories did wait for f
    assert not outage_seen
    assert _store_dirs(tree) == set() and tree.files() == {}
    assert tree.uploader.stats.failures == 0


@pytest.mark.parametrize("how", ["rename", "exchange", "remade"])
async def test_a_directory_renamed_before_its_marker_was_put_leaves_nothing(
        tree: Rig, autojump_clock: trio.abc.Clock, how: str) -> None:
    """``a/s/f`` is uploaded (which makes ``a/`` and ``a/s/`` on a file tier) while the
    markers of ``a`` and ``a/s`` wait for a retry; then ``a`` is renamed to ``b`` (or
    exchanged with a directory ``b``, or renamed and a new ``a/h`` written at once). The old
    directories must go, though no marker of theirs was ever put at their old keys (keys.py,
    rule 6), and a new directory at the old name must stay."""
    exchange = how == "exchange"
    if exchange:
        await tree.write("b/g", b"g")
        await tree.settle()
    real_put_entry = tree.tier.put_entry
    failed: set[str] = set()

    async def put_entry(key: str, meta: ObjectMeta) -> None:
        if key.startswith("a/") and key not in failed:
            failed.add(key)
            raise StoreUnavailable(f"injected failure (put_entry {key})")
        await real_put_entry(key, meta)

    tree.tier.put_entry = put_entry  # type: ignore[method-assign]
    await tree.write("a/s/f", b"f" * 100)
    await trio.sleep(0.1)  # f is up, the markers wait for their retry
    assert failed == {"a/", "a/s/"} and "a/s/f" in tree.objects
    await tree.fs.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE if exchange else 0)
    # In the rename's transaction: a crash now replays the deletion (requeue_from_journal).
    assert "a/s/" in {key for _, key in tree.fs.journal.tombstones()}
    if how == "remade":
        tree.tier.put_entry = real_put_entry  # type: ignore[method-assign]
        await tree.write("a/h", b"h")
    await tree.settle()
    assert not tree.uploader.failed()
    if exchange:
        assert tree.files() == {"b/s/f": b"f" * 100, "a/g": b"g"}
        assert _store_dirs(tree) == {"a/", "b/", "b/s/"}
    elif how == "remade":
        assert tree.files() == {"b/s/f": b"f" * 100, "a/h": b"h"}
        assert _store_dirs(tree) == {"a/", "b/", "b/s/"}
    else:
        assert tree.files() == {"b/s/f": b"f" * 100}
        assert _store_dirs(tree) == {"b/", "b/s/"}


# -- a file and a directory of one name (keys.py, rule 7) -------------------------------------


async def test_a_directory_made_where_a_file_moves_away_waits_for_the_move(
        tree: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``mv d t; mkdir d`` of an evicted file ``d`` whose move fails once: on a file tier the
    directory's marker put replaces a file of its name (tiers/local.py ``_make_directory``),
    so it must wait until the file's only copy has moved to ``t``."""
    await tree.write("d", b"D" * 1000)
    await tree.settle()
    await _evict(tree, "d")
    tree.tier.fail_next = 1  # the move's first store call
    await tree.fs.rename(ROOT, b"d", ROOT, b"t")
    tree.fs.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    with trio.fail_after(3600):  # trio time: the autojump clock makes it instant
        await tree.settle()
    assert not tree.uploader.failed()
    assert tree.files() == {"t": b"D" * 1000}
    assert _store_dirs(tree) == {"d/"}
    assert await _read(tree, "t") == b"D" * 1000


@pytest.mark.parametrize("how", ["into_its_old_directory", "beneath_its_old_key"])
async def test_a_file_moved_onto_its_own_directory_key_gets_there(
        tree: Rig, autojump_clock: trio.abc.Clock, how: str) -> None:
    """``mv d/x t; rmdir d; mv t d`` (the file's new key is its old key's directory) and
    ``mv d t; mkdir d; mv t d/x`` (its new key is beneath its old key), the file evicted:
    on a file tier the move cannot publish while its own source is in the way (``d`` still
    a directory holding ``d/x``; ``d`` still a file where ``d/`` must be). It parks first
    (keys.py, rule 7); without that it is retried forever."""
    if how == "into_its_old_directory":
        await tree.write("d/x", b"X" * 1000)
        await tree.settle()
        await _evict(tree, "d/x")
        d = await tree.ino("d")
        real_copy = tree.tier.copy
        failed: list[str] = []

        async def copy(src: str, dst: str, *, if_etag: str | None = None) -> str | None:
            if not failed:  # the first move fails once: one move d/x -> d is left
                failed.append(dst)
                raise StoreUnavailable("injected failure (copy)")
            return await real_copy(src, dst, if_etag=if_etag)

        tree.tier.copy = copy  # type: ignore[method-assign]
        await tree.fs.rename(d, b"x", ROOT, b"t")
        await tree.fs.rmdir(ROOT, b"d")
        await tree.fs.rename(ROOT, b"t", ROOT, b"d")
        want_files, want_dirs, path = {"d": b"X" * 1000}, set(), "d"
    else:
        await tree.write("d", b"X" * 1000)
        await tree.settle()
        await _evict(tree, "d")
        tree.tier.fail_next = 1  # the first move fails once: one move d -> d/x is left
        await tree.fs.rename(ROOT, b"d", ROOT, b"t")
        d = tree.fs.mkdir(ROOT, b"d", 0o755, ROOT_CALLER).ino
        await tree.fs.rename(ROOT, b"t", d, b"x")
        want_files, want_dirs, path = {"d/x": b"X" * 1000}, {"d/"}, "d/x"
    with trio.fail_after(3600):
        await tree.settle()
    assert not tree.uploader.failed()
    assert tree.files() == want_files
    assert _store_dirs(tree) == want_dirs
    assert await _read(tree, path) == b"X" * 1000
