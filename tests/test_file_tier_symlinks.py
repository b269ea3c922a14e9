"""The file tier never reaches outside its root through a symlink planted in the store.

Anyone who can write the store directory can plant ``store/step_1 -> /elsewhere`` (a directory
symlink) or ``store/a/file -> /elsewhere/secret`` (a file symlink). Each test plants such links
at several depths, runs one tier operation through them, and checks that a sentinel directory
outside the store is exactly as it was (names, kinds, bytes, modes, mtimes) and that nothing
of it was read back. A symlink where a key needs a directory is an error; a symlink at a key's
leaf is an object of its own (the link itself is listed, copied, replaced or deleted).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from ckptfs.engine.upload import file_checksum
from ckptfs.store.tiers.base import Kind, ObjectMeta, ObjectMissing, PreconditionFailed, TierError
from ckptfs.store.tiers.local import TMP_MARK, FileTier, SymlinkInStore
from ckptfs.store.tiers.memory import MemoryTier
from ckptfs.store.tiers.transfer import copy_object

SECRET = b"outside the store: never read, written or deleted"
META = ObjectMeta(Kind.FILE, 0o640, 1_700_000_000_000_000_000, os.getuid(), os.getgid(),
                  "crc32c:0badf00d")
Snapshot = dict[str, tuple[str, bytes | str | None, int, int]]


def snapshot(top: Path) -> Snapshot:
    """Every entry under ``top`` (not following symlinks): kind, content, mode, mtime."""
    out: Snapshot = {".": ("dir", None, os.lstat(top).st_mode, os.lstat(top).st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            content: bytes | str | None = None
            if stat.S_ISLNK(st.st_mode):
                kind, content = "link", os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                kind = "dir"
            else:
                kind, content = "file", path.read_bytes()
            out[str(path.relative_to(top))] = (kind, content, st.st_mode, st.st_mtime_ns)
    return out


class Store:
    """A file tier at ``root`` with symlinks planted in it, and the sentinel they point to."""

    def __init__(self, base: Path) -> None:
        self.root = base / "store"
        self.outside = base / "outside"
        self.tier = FileTier("warm", f"file://{self.root}", self.root)
        self.scratch = base / "scratch"
        self.scratch.mkdir()
        self.source = self.scratch / "src"
        self.source.write_bytes(b"new bytes from the put")
        # The sentinel: a file, a subdirectory with a file, and a temp-looking name.
        (self.outside / "sub").mkdir(parents=True)
        (self.outside / "secret").write_bytes(SECRET)
        (self.outside / "sub" / "deep").write_bytes(SECRET)
        (self.outside / f".x{TMP_MARK}0123").write_bytes(SECRET)
        (self.outside / ".ckptfs").mkdir()
        (self.outside / ".ckptfs" / "lease").write_bytes(SECRET)
        (self.outside / "lease").write_bytes(SECRET)
        # Planted links: a directory at depth 1 and 2, a directory deeper still, and files.
        self.root.mkdir()
        (self.root / "a" / "b").mkdir(parents=True)
        os.symlink(self.outside, self.root / "step_1")                       # depth 1, dir
        os.symlink(self.outside / "sub", self.root / "a" / "sub")             # depth 2, dir
        os.symlink(self.outside, self.root / "a" / "b" / "c")                 # depth 3, dir
        os.symlink(self.outside / "secret", self.root / "a" / "file")         # depth 2, file
        os.symlink(self.outside / "secret", self.root / "a" / "b" / "leaf")   # depth 3, file
        self.before = snapshot(self.outside)

    def assert_outside_untouched(self) -> None:
        assert snapshot(self.outside) == self.before

    async def read(self, key: str, size: int = 4096) -> bytes:
        out = self.scratch / "read"
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            n = await self.tier.read_into(key, 0, size, fd, 0)
            return os.pread(fd, n, 0)
        finally:
            os.close(fd)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path)
    yield s
    s.assert_outside_untouched()  # every test, whatever it asserted itself


# Keys whose parent directories pass through a planted directory symlink.
THROUGH_DIR_LINK = ["step_1/secret", "step_1/sub/deep", "a/sub/deep", "a/b/c/secret",
                    "a/b/c/sub/deep"]
# Keys that pass through a file symlink as if it were a directory.
THROUGH_FILE_LINK = ["a/file/x", "a/b/leaf/x"]


@pytest.mark.parametrize("key", THROUGH_DIR_LINK + ["step_1/new", "a/b/c/sub/new"])
async def test_put_file_refuses_a_symlinked_directory(store: Store, key: str) -> None:
    with pytest.raises(SymlinkInStore):
        await store.tier.put_file(key, store.source, store.source.stat().st_size, META)
    store.assert_outside_untouched()


@pytest.mark.parametrize("key", THROUGH_FILE_LINK)
async def test_put_file_under_a_file_symlink_fails(store: Store, key: str) -> None:
    with pytest.raises(TierError):
        await store.tier.put_file(key, store.source, store.source.stat().st_size, META)
    store.assert_outside_untouched()


@pytest.mark.parametrize("key", ["a/file", "a/b/leaf", "step_1"])
async def test_put_file_replaces_a_symlink_leaf_itself(store: Store, key: str) -> None:
    """A put at a key that is a symlink replaces the link, not the file it names."""
    data = store.source.read_bytes()
    await store.tier.put_file(key, store.source, len(data), META)
    path = store.root / key
    assert not path.is_symlink() and path.read_bytes() == data
    assert (await store.tier.head(key)).meta.kind is Kind.FILE
    store.assert_outside_untouched()


@pytest.mark.parametrize("key", THROUGH_DIR_LINK)
async def test_put_entry_refuses_a_symlinked_directory(store: Store, key: str) -> None:
    with pytest.raises(SymlinkInStore):
        await store.tier.put_entry(key + "-dir/", ObjectMeta(Kind.DIRECTORY, 0o700, 5))
    with pytest.raises(SymlinkInStore):
        await store.tier.put_entry(key + "-link", ObjectMeta(Kind.SYMLINK, 0o777, 5,
                                                            target="/etc/passwd"))
    store.assert_outside_untouched()


async def test_put_entry_directory_replaces_a_symlink_leaf(store: Store) -> None:
    """A directory entry at a symlinked name: the link makes way; chmod/utime/chown never
    reach the directory it named."""
    await store.tier.put_entry("step_1/", ObjectMeta(Kind.DIRECTORY, 0o700, 5))
    await store.tier.put_entry("a/sub/", ObjectMeta(Kind.DIRECTORY, 0o700, 5))
    for rel in ("step_1", "a/sub"):
        path = store.root / rel
        assert not path.is_symlink() and path.is_dir() and list(path.iterdir()) == []
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    await store.tier.put_entry("a/file", ObjectMeta(Kind.SYMLINK, 0o777, 5, target="x"))
    assert os.readlink(store.root / "a" / "file") == "x"
    store.assert_outside_untouched()


@pytest.mark.parametrize("key", THROUGH_DIR_LINK)
async def test_reads_refuse_a_symlinked_directory(store: Store, key: str) -> None:
    with pytest.raises(SymlinkInStore):
        await store.read(key)
    with pytest.raises(SymlinkInStore):
        await store.tier.head(key)
    with pytest.raises(SymlinkInStore):
        await store.tier.get_small(key)


@pytest.mark.parametrize("key", ["a/file", "a/b/leaf"])
async def test_reads_do_not_follow_a_symlink_leaf(store: Store, key: str) -> None:
    with pytest.raises(SymlinkInStore):
        await store.read(key)
    with pytest.raises(SymlinkInStore):
        await store.tier.get_small(key)
    info = await store.tier.head(key)  # the link itself: an object of the mount
    assert info.meta.kind is Kind.SYMLINK
    assert info.meta.target == str(store.outside / "secret")
    assert info.size == len(str(store.outside / "secret"))


async def test_read_refuses_a_fifo_without_hanging(store: Store) -> None:
    os.mkfifo(store.root / "a" / "fifo")
    with trio.fail_after(10):
        with pytest.raises(TierError, match="not a regular file"):
            await store.read("a/fifo")


@pytest.mark.parametrize("key", THROUGH_DIR_LINK)
async def test_delete_refuses_a_symlinked_directory(store: Store, key: str) -> None:
    with pytest.raises(SymlinkInStore):
        await store.tier.delete(key)
    with pytest.raises(SymlinkInStore):
        await store.tier.delete(key.rsplit("/", 1)[0] + "/sub/")
    store.assert_outside_untouched()


async def test_delete_removes_only_the_link(store: Store) -> None:
    await store.tier.delete("step_1/")  # a directory key naming a symlink: not ours, kept
    assert (store.root / "step_1").is_symlink()
    for key in ("a/file", "a/b/leaf", "step_1", "a/b/c"):
        await store.tier.delete(key)
        assert not os.path.lexists(store.root / key)
    for key in THROUGH_FILE_LINK:
        await store.tier.delete(key)  # nothing there now: idempotent
    store.assert_outside_untouched()


async def test_list_reports_symlinks_and_never_descends(store: Store) -> None:
    everything = {i.key: i for i in await store.tier.list()}
    assert set(everything) == {"a/", "a/b/", "a/b/c", "a/b/leaf", "a/file", "a/sub",
                               "step_1"}
    for key in ("a/b/c", "a/b/leaf", "a/file", "a/sub", "step_1"):
        assert everything[key].meta.kind is Kind.SYMLINK
    assert await store.tier.list("step_1/") == []
    assert await store.tier.list("a/sub/") == []
    assert {i.key for i in await store.tier.list("a/b/")} == {"a/b/", "a/b/c", "a/b/leaf"}
    # One level: the link is an entry; beneath it there is nothing (not the outside).
    top = {i.key: i for i in await store.tier.list_dir("")}
    assert set(top) == {"a/", "step_1"} and top["step_1"].meta.kind is Kind.SYMLINK
    for prefix in ("step_1/", "a/sub/", "a/b/c/", "a/b/c/sub/", "a/file/"):
        assert await store.tier.list_dir(prefix) == []


async def test_copy_refuses_symlinked_directories(store: Store) -> None:
    data = store.source.read_bytes()
    await store.tier.put_file("real", store.source, len(data), META)
    for src in THROUGH_DIR_LINK:
        with pytest.raises(SymlinkInStore):
            await store.tier.copy(src, "copied")
    for dst in ("step_1/copied", "a/b/c/sub/copied", "a/sub/copied"):
        with pytest.raises(SymlinkInStore):
            await store.tier.copy("real", dst)
    assert not os.path.lexists(store.root / "copied")
    store.assert_outside_untouched()


async def test_copy_of_a_symlink_copies_the_link(store: Store) -> None:
    data = store.source.read_bytes()
    await store.tier.put_file("real", store.source, len(data), META)
    await store.tier.copy("a/file", "copied")
    assert os.readlink(store.root / "copied") == str(store.outside / "secret")
    await store.tier.copy("real", "a/b/leaf")  # over a link: replaces the link
    assert (store.root / "a" / "b" / "leaf").read_bytes() == data
    store.assert_outside_untouched()


async def test_small_objects_refuse_a_symlinked_control_directory(store: Store) -> None:
    os.symlink(store.outside / ".ckptfs", store.root / ".ckptfs")
    with pytest.raises(SymlinkInStore):
        await store.tier.get_small(".ckptfs/lease")
    for kwargs in ({}, {"if_absent": True}, {"if_tag": "0-0"}):
        with pytest.raises(SymlinkInStore):
            await store.tier.put_small(".ckptfs/lease", b"mine", **kwargs)  # type: ignore[arg-type]
    store.assert_outside_untouched()


async def test_small_objects_do_not_follow_a_symlinked_object(store: Store) -> None:
    (store.root / ".ckptfs").mkdir()
    lease = store.root / ".ckptfs" / "lease"
    os.symlink(store.outside / "lease", lease)
    with pytest.raises(SymlinkInStore):
        await store.tier.get_small(".ckptfs/lease")
    with pytest.raises(PreconditionFailed):
        await store.tier.put_small(".ckptfs/lease", b"mine", if_absent=True)
    with pytest.raises(SymlinkInStore):
        await store.tier.put_small(".ckptfs/lease", b"mine", if_tag="0-0")
    assert lease.is_symlink()  # renamed aside to be judged, then put back as it was
    assert not [p for p in (store.root / ".ckptfs").iterdir() if TMP_MARK in p.name]
    tag = await store.tier.put_small(".ckptfs/lease", b"mine")  # unconditional: replaces it
    assert not lease.is_symlink() and lease.read_bytes() == b"mine"
    assert await store.tier.get_small(".ckptfs/lease") == (b"mine", tag)
    store.assert_outside_untouched()


async def test_cleanup_does_not_reach_through_symlinks(store: Store) -> None:
    ours = {"step_1/x", "a/b/c/x", "x"}
    (store.root / f".x{TMP_MARK}0123").write_bytes(b"left by a crash")
    assert await store.tier.cleanup(ours) == 1
    assert not (store.root / f".x{TMP_MARK}0123").exists()
    store.assert_outside_untouched()


async def test_transfer_from_a_file_tier_does_not_follow(store: Store) -> None:
    """Retention copies between tiers: the file-tier source is opened beneath its root."""
    dst = MemoryTier("cold", "memory://cold", f"symlinks-{id(store)}")
    for key in THROUGH_DIR_LINK:
        with pytest.raises(SymlinkInStore):
            await copy_object(store.tier, dst, key, len(SECRET), store.scratch)
    # A symlink leaf travels as a symlink entry, whatever it names.
    await copy_object(store.tier, dst, "a/file", 0, store.scratch)
    info = await dst.head("a/file")
    assert info.meta.kind is Kind.SYMLINK and info.meta.target == str(store.outside / "secret")
    # And a real object still travels, without a temporary copy (its data summed on the
    # way: it must match the recorded checksum).
    data = store.source.read_bytes()
    meta = dataclasses.replace(META, checksum=file_checksum(store.source, len(data)))
    await store.tier.put_file("step_2/model.pt", store.source, len(data), meta)
    await copy_object(store.tier, dst, "step_2/model.pt", len(data), store.scratch)
    assert dst.objects["step_2/model.pt"].body == data
    assert list(store.scratch.iterdir()) == [store.source]
    # File tier to file tier.
    other = FileTier("cold", f"file://{store.scratch}/cold", store.scratch / "cold")
    await copy_object(store.tier, other, "step_2/model.pt", len(data), store.scratch)
    assert (store.scratch / "cold" / "step_2" / "model.pt").read_bytes() == data
    with pytest.raises(SymlinkInStore):
        await copy_object(store.tier, other, "step_1/secret", len(SECRET), store.scratch)
    assert not (store.scratch / "cold" / "step_1").exists()


async def test_missing_keys_are_still_missing(store: Store) -> None:
    """Normal errors are unchanged: a missing key is ObjectMissing, deletes are idempotent."""
    with pytest.raises(ObjectMissing):
        await store.read("a/nothing")
    with pytest.raises(ObjectMissing):
        await store.tier.head("no/such/dir/x")
    with pytest.raises(ObjectMissing):
        await store.tier.get_small(".ckptfs/nothing")
    await store.tier.delete("no/such/dir/x")
    await store.tier.delete("a/nothing")


async def test_a_symlinked_root_is_followed(tmp_path: Path) -> None:
    """The root itself is configuration (a link to a parallel filesystem, say): followed."""
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    tier = FileTier("warm", f"file://{tmp_path}/link", tmp_path / "link")
    await tier.check()
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    await tier.put_file("d/x", src, 3, META)
    assert (real / "d" / "x").read_bytes() == b"abc"
    assert [i.key for i in await tier.list()] == ["d/", "d/x"]
