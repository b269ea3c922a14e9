"""ckptfs/fuse/passthrough.py without a mount: the auto/on/off decision from injected facts, and the
per-inode io mode and backing ids against a fake backend (the real ioctl is covered by
tests/test_passthrough_build.py)."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ckptfs.engine.fs import ROOT_CALLER, Filesystem
from ckptfs.errors import UserError
from ckptfs.fuse.passthrough import (
    WRITE_HEADROOM,
    BackingTable,
    Facts,
    PassthroughFiles,
    _has_cap_sys_admin,
    _kernel_release,
    _leases_unusable,
    decide,
    fallback_note,
    file_info_fields,
    writers_left,
)
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import Staging

READY = Facts(kernel=(6, 18), cap_sys_admin=True, pyfuse3_has_passthrough=True)


class FakeBackend:
    """Hands out ids like the kernel (from 1); ``fail`` makes the next opens raise it."""

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail
        self.next_id = 1
        self.open_ids: dict[int, int] = {}    # id -> fd
        self.calls: list[str] = []

    def open(self, fd: int) -> int:
        self.calls.append(f"open {fd}")
        if self.fail is not None:
            raise OSError(self.fail, "fake")
        self.open_ids[self.next_id] = fd
        self.next_id += 1
        return self.next_id - 1

    def close(self, backing_id: int) -> None:
        self.calls.append(f"close {backing_id}")
        del self.open_ids[backing_id]


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_decide_requests_when_everything_is_there(mode: str) -> None:
    assert decide(mode, READY).request  # type: ignore[arg-type]


@pytest.mark.parametrize(("facts", "why"), [
    (Facts((6, 18), True, False), "pyfuse3"),
    (Facts((6, 8), True, True), "kernel 6.8"),
    (Facts((6, 18), False, True), "CAP_SYS_ADMIN"),
    (Facts((6, 18), True, True, leases="Invalid argument"), "file leases"),
])
def test_auto_falls_back_and_on_fails_with_one_reason(facts: Facts, why: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="ckptfs.fuse.passthrough"):
        d = decide("auto", facts)
    assert not d.request and why in d.reason
    assert [r.getMessage() for r in caplog.records] == [f"passthrough off: {d.reason}"]
    with pytest.raises(UserError, match=why):
        decide("on", facts)


def test_off_never_requests() -> None:
    assert not decide("off", READY).request


def test_the_mount_says_who_serves_the_data_only_when_auto_fell_back() -> None:
    no_caps = Facts((6, 18), False, True)
    note = fallback_note("auto", decide("auto", no_caps))
    assert note.startswith("the daemon serves reads and writes") and "CAP_SYS_ADMIN" in note
    assert fallback_note("auto", decide("auto", READY)) == ""
    assert fallback_note("off", decide("off", READY)) == ""   # the user's choice


def test_writers_left_sees_a_mapping_outlive_its_descriptor(tmp_path: Path) -> None:
    """The kernel's answer ``PassthroughFiles`` relies on: a writable shared mapping keeps
    its file open for writing after close(2), until munmap; a read-only one does not."""
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 4096)
    assert _leases_unusable(tmp_path) == ""
    assert writers_left(path) is False
    with open(path, "rb") as reader, \
            mmap.mmap(reader.fileno(), 0, access=mmap.ACCESS_READ):
        assert writers_left(path) is False       # readers, read-only mappings do not count
    fd = os.open(path, os.O_RDWR)
    assert writers_left(path) is True
    view = mmap.mmap(fd, 4096)                   # dup()s fd: closing both leaves the mapping
    os.close(fd)
    assert writers_left(path) is True
    view.close()
    assert writers_left(path) is False
    assert writers_left(tmp_path / "gone") is False


def test_kernel_release_and_caps_parsing() -> None:
    assert _kernel_release("6.18.44-fc-v1045") == (6, 18)
    assert _kernel_release("5.4.0") == (5, 4)
    assert _kernel_release("weird") == (0, 0)
    assert _has_cap_sys_admin("/nonexistent") is False


def test_one_backing_id_per_inode_until_last_release() -> None:
    b = FakeBackend()
    t = BackingTable(b)
    first = t.acquire(7, fd=70, eligible=True)
    second = t.acquire(7, fd=71, eligible=True)
    assert first == second == 1 and b.calls == ["open 70"]
    assert t.mode(7) == "passthrough"
    t.release(7, first)
    assert b.open_ids == {1: 70}           # one open left: the id stays
    t.release(7, second)
    assert b.open_ids == {} and t.mode(7) == "closed"


def test_daemon_opens_keep_the_inode_daemon_served() -> None:
    """A file being faulted in (not eligible) keeps every later open, even once it is wholly
    local, on the daemon path until its last daemon-served open is released."""
    b = FakeBackend()
    t = BackingTable(b)
    assert t.acquire(3, fd=30, eligible=False) == 0
    assert t.acquire(3, fd=31, eligible=True) == 0   # mixing would be EIO in the kernel
    assert b.calls == []
    t.release(3, 0)
    t.release(3, 0)
    assert t.acquire(3, fd=32, eligible=True) == 1   # all closed: now it may switch


def test_passthrough_inode_takes_every_open() -> None:
    t = BackingTable(FakeBackend())
    bid = t.acquire(5, fd=50, eligible=True)
    assert t.acquire(5, fd=51, eligible=False) == bid


@pytest.mark.parametrize("err", [errno.EPERM, errno.EOPNOTSUPP])
def test_backing_open_refused_gives_up_for_the_mount(err: int) -> None:
    b = FakeBackend(fail=err)
    t = BackingTable(b)
    assert t.acquire(1, fd=10, eligible=True) == 0
    assert not t.active
    assert t.acquire(2, fd=20, eligible=True) == 0
    assert b.calls == ["open 10"]         # asked once, not at every open
    t.release(1, 0)


def test_other_backing_open_errors_fall_back_for_that_file_only() -> None:
    b = FakeBackend(fail=errno.ELOOP)     # e.g. staging stacked deeper than max_stack_depth
    t = BackingTable(b)
    assert t.acquire(1, fd=10, eligible=True) == 0
    assert t.active
    b.fail = None
    assert t.acquire(2, fd=20, eligible=True) == 1


def test_no_backend_serves_everything_in_the_daemon() -> None:
    t = BackingTable(None)
    assert t.acquire(1, fd=10, eligible=True) == 0 and t.mode(1) == "daemon"


def test_file_info_fields() -> None:
    assert file_info_fields(4, direct_io=True) == {
        "backing_id": 4, "keep_cache": False, "direct_io": False}
    assert file_info_fields(0, direct_io=True) == {"direct_io": True}


# -- PassthroughFiles: the core's files behind the table (a Filesystem, no mount)

@pytest.fixture
def core(tmp_path: Path) -> Iterator[Filesystem]:
    staging = Staging(tmp_path / "staging")
    staging.prepare()
    fs = Filesystem(Journal(tmp_path / "staging" / "journal.db"), staging,
                    write_direct_io=True)
    fs.start()
    try:
        yield fs
    finally:
        fs.close()
        fs.journal.close()
        staging.close()


def _files(fs: Filesystem, backend: FakeBackend | None = None) -> PassthroughFiles:
    pt = PassthroughFiles(fs, requested=True, reason="")
    pt.negotiated(backend or FakeBackend())
    return pt


def test_negotiation_failure_is_a_reason(core: Filesystem) -> None:
    pt = PassthroughFiles(core, requested=True, reason="")
    pt.negotiated(None)
    assert not pt.active and "did not negotiate" in pt.status()["reason"]


async def test_passthrough_write_reaches_the_row_and_the_budget(core: Filesystem) -> None:
    pt = _files(core)
    fh, row = core.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    before = core.space.used
    fields = pt.opened(fh, row.ino, os.O_WRONLY, core.direct_io(fh))
    # write_direct_io does not apply to a passthrough open; keep_cache must be off.
    assert fields == {"backing_id": 1, "keep_cache": False, "direct_io": False}
    assert core.space.used == before + WRITE_HEADROOM   # held ahead of the writes
    core.staging.path(row.ino).write_bytes(b"x" * 5000)  # the kernel's write, not ours
    pt.refresh(row.ino)
    assert core.getattr(row.ino).size == 5000
    assert pt.status()["reserved_bytes"] == WRITE_HEADROOM - 5000   # charged to the reserve
    assert core.getattr(row.ino).mtime_ns == os.stat(core.staging.path(row.ino)).st_mtime_ns
    core.flush(fh)
    pt.release(fh)
    assert core.journal.get(row.ino).size == 5000  # persisted by the core's release
    assert core.space.used == before + 5000        # the reserve's rest given back
    assert pt.table.mode(row.ino) == "closed"
    # A daemon-served open of it later must not trust pages cached before those writes.
    pt.table = BackingTable(None)
    fh = await core.open(row.ino, os.O_RDONLY)
    assert pt.opened(fh, row.ino, os.O_RDONLY, False)["keep_cache"] is False
    pt.release(fh)


MiB = 1 << 20


def _committed(fs: Filesystem, name: bytes, size: int) -> int:
    """A file as the uploader leaves it: committed, with its hot copy (evictable)."""
    fh, row = fs.create(ROOT_INODE, name, 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    fs.staging.path(row.ino).write_bytes(b"c" * size)
    fs.space.try_take(size)
    fs.release(fh)
    row = fs.getattr(row.ino)
    row.size, row.state, row.remote_key = size, State.COMMITTED, name.decode()
    fs.ns.persist(row)
    return row.ino


def _open(fs: Filesystem, pt: PassthroughFiles, name: bytes,
          flags: int = os.O_WRONLY) -> tuple[int, int, dict[str, Any]]:
    fh, row = fs.create(ROOT_INODE, name, 0o644, flags | os.O_CREAT, ROOT_CALLER)
    return fh, row.ino, pt.opened(fh, row.ino, flags, fs.direct_io(fh))


def _close(fs: Filesystem, pt: PassthroughFiles, fh: int) -> None:
    ino = pt.handle_ino(fh)
    if ino is not None:
        pt.refresh(ino)   # what the adapter does before FLUSH and RELEASE
    fs.flush(fh)
    pt.release(fh)


async def test_remote_files_and_writers_short_of_space_are_daemon_served(
        core: Filesystem) -> None:
    pt = _files(core)
    pt.write_reserve = 4 * MiB
    fh, row = core.create(ROOT_INODE, b"r", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    core.release(fh)
    row = core.getattr(row.ino)
    fh = await core.open(row.ino, os.O_RDONLY)
    row.state = State.REMOTE  # known from the store, fetched on demand
    assert "backing_id" not in pt.opened(fh, row.ino, os.O_RDONLY, False)
    row.state = State.COMMITTED
    pt.release(fh)
    core.space.max_bytes = core.space.used + pt.write_reserve - 1   # nothing to evict either
    fh = await core.open(row.ino, os.O_RDONLY)
    assert "backing_id" in pt.opened(fh, row.ino, os.O_RDONLY, False)  # readers need no room
    pt.release(fh)
    used = core.space.used
    fh, _, fields = _open(core, pt, b"w")
    assert "backing_id" not in fields       # the daemon stalls it if need be
    assert core.space.used == used and pt.status()["reserved_bytes"] == 0
    _close(core, pt, fh)
    core.space.max_bytes = None
    fh, _, fields = _open(core, pt, b"w2", os.O_RDWR)
    assert "backing_id" in fields
    _close(core, pt, fh)


def test_passthrough_writers_hold_a_reserve_and_give_back_what_they_did_not_write(
        core: Filesystem) -> None:
    pt = _files(core)
    pt.write_reserve = 4 * MiB
    used = core.space.used
    a, ino_a, fa = _open(core, pt, b"a")
    b, _, fb = _open(core, pt, b"b")
    assert fa["backing_id"] and fb["backing_id"]
    assert core.space.used == used + 8 * MiB   # two writers, two reserves: not one shared
    core.staging.path(ino_a).write_bytes(b"x" * 3 * MiB)   # the kernel's writes
    pt.refresh(ino_a)
    # From a's reserve; 1 MiB left is under half of it, so it was topped up again.
    assert core.space.used == used + 3 * MiB + 8 * MiB
    assert pt.status()["reserved_bytes"] == 8 * MiB
    _close(core, pt, a)
    assert core.space.used == used + 3 * MiB + 4 * MiB   # a's data, b's reserve
    _close(core, pt, b)
    assert core.space.used == used + 3 * MiB
    assert pt.status()["reserved_bytes"] == 0 and pt.status()["writers"] == 0


def test_a_writer_past_its_reserve_makes_room_by_evicting_committed_copies(
        core: Filesystem) -> None:
    pt = _files(core)
    pt.write_reserve = 2 * MiB
    base = core.space.used
    old = [_committed(core, f"old{i}".encode(), 2 * MiB) for i in range(3)]
    core.space.max_bytes = core.space.used + 2 * MiB   # room for the reserve, no more
    fh, ino, fields = _open(core, pt, b"big")
    assert fields["backing_id"]
    core.staging.path(ino).write_bytes(b"y" * 5 * MiB)  # past the reserve, unseen
    pt.refresh(ino)
    evicted = [i for i in old if core.getattr(i).state is State.REMOTE]
    assert evicted and all(not core.staging.exists(i) for i in evicted)
    assert pt.status()["reserved_bytes"] == 2 * MiB      # topped up again
    assert core.space.used <= core.space.max_bytes
    _close(core, pt, fh)
    assert core.journal.get(ino).size == 5 * MiB
    assert core.space.used == base + 5 * MiB + 2 * MiB * (3 - len(evicted))


def test_a_writer_past_a_full_budget_is_charged_and_said_once(
        core: Filesystem, caplog: pytest.LogCaptureFixture) -> None:
    pt = _files(core)
    pt.write_reserve = 2 * MiB
    core.space.max_bytes = core.space.used + 2 * MiB   # nothing committed to evict
    fh, ino, fields = _open(core, pt, b"big")
    assert fields["backing_id"]
    used = core.space.used
    for size in (3 * MiB, 4 * MiB):
        core.staging.path(ino).write_bytes(b"z" * size)
        pt.refresh(ino)
    assert core.space.used == used - 2 * MiB + 4 * MiB   # the bytes on disk, over budget
    assert len([r for r in caplog.records if "staging budget full" in r.message]) == 1
    _close(core, pt, fh)
    assert core.space.used == used - 2 * MiB + 4 * MiB


async def test_watch_follows_a_writer_that_sends_no_requests(
        core: Filesystem, autojump_clock: trio.testing.MockClock) -> None:
    pt = _files(core)
    pt.write_reserve = 2 * MiB
    victim = _committed(core, b"old", 3 * MiB)
    core.space.max_bytes = core.space.used + 2 * MiB
    fh, ino, _ = _open(core, pt, b"big")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pt.watch)
        core.staging.path(ino).write_bytes(b"w" * 3 * MiB)   # no getattr, no flush
        await trio.sleep(1)
        assert core.getattr(ino).size == 3 * MiB            # the watcher saw it
        assert core.getattr(victim).state is State.REMOTE   # and made room ahead of it
        nursery.cancel_scope.cancel()
    _close(core, pt, fh)


def test_a_write_after_the_last_close_reopens_the_file(core: Filesystem) -> None:
    pt = _files(core)
    fh, row = core.create(ROOT_INODE, b"d", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    pt.opened(fh, row.ino, os.O_WRONLY, False)
    core.flush(fh)                        # close(2) of one copy of a dup'ed descriptor
    assert core.getattr(row.ino).closed_at is not None
    core.staging.path(row.ino).write_bytes(b"late")  # written through the other copy
    pt.refresh(row.ino)
    assert core.getattr(row.ino).closed_at is None
    assert core.journal.get(row.ino).closed_at is None
    pt.release(fh)
    assert core.journal.get(row.ino).size == 4


# -- a mapping that outlives its descriptor: the release waits (the class docstring)

def _hold_for_writing(fs: Filesystem, ino: int) -> int:
    """What a shared mapping of a closed O_RDWR passthrough open leaves: the kernel's backing
    file, open for writing, held by nobody the daemon knows of."""
    return os.open(fs.staging.path(ino), os.O_RDWR)


def test_an_rdwr_writer_is_released_once_nothing_can_write_the_file(core: Filesystem) -> None:
    pt = _files(core)
    fh, ino, fields = _open(core, pt, b"mapped", os.O_RDWR)
    assert fields["backing_id"]
    mapping = _hold_for_writing(core, ino)
    try:
        _close(core, pt, fh)
        row = core.getattr(ino)
        assert row.state is State.OPEN           # not staged: the mapping may still write
        assert pt.status()["mapped_files"] == 1
        assert pt.table.mode(ino) == "closed"    # the kernel's side is all released
        pt.poll()
        assert core.getattr(ino).state is State.OPEN
        os.pwrite(mapping, b"B" * 10, 0)         # written through the mapping
    finally:
        os.close(mapping)                        # munmap
    pt.poll()
    row = core.getattr(ino)
    assert row.state is State.STAGED and row.size == 10
    assert core.journal.get(ino).size == 10
    assert pt.status()["mapped_files"] == 0 and not core.is_open(ino)


def test_write_only_opens_never_wait_for_mappings(core: Filesystem) -> None:
    """``O_WRONLY`` (torch.save, DCP) cannot map: its release stages at once, whatever else
    holds the staging file."""
    pt = _files(core)
    fh, ino, fields = _open(core, pt, b"wb", os.O_WRONLY)
    assert fields["backing_id"]
    other = _hold_for_writing(core, ino)
    try:
        _close(core, pt, fh)
        assert core.getattr(ino).state is State.STAGED
        assert pt.status()["mapped_files"] == 0
    finally:
        os.close(other)


async def test_an_rdwr_writer_closed_before_a_reader_waits_for_the_reader(
        core: Filesystem) -> None:
    """A mapping may outlive the O_RDWR open while a reader keeps the inode open (the daemon
    then holds the staging file open itself and cannot ask): the writer's release waits for
    the inode's last open, then for the mapping."""
    pt = _files(core)
    fh, ino, _ = _open(core, pt, b"r", os.O_RDWR)
    reader = await core.open(ino, os.O_RDONLY)
    assert pt.opened(reader, ino, os.O_RDONLY, False)["backing_id"]
    _close(core, pt, fh)
    assert core.getattr(ino).state is State.OPEN
    pt.poll()
    assert core.getattr(ino).state is State.OPEN   # still open: not asked yet
    _close(core, pt, reader)
    assert core.getattr(ino).state is State.STAGED and pt.status()["mapped_files"] == 0


async def test_a_mapped_file_opened_again_is_released_after_that_open(
        core: Filesystem) -> None:
    pt = _files(core)
    fh, ino, _ = _open(core, pt, b"again", os.O_RDWR)
    mapping = _hold_for_writing(core, ino)
    _close(core, pt, fh)
    os.close(mapping)
    fh = await core.open(ino, os.O_RDONLY)        # before the watch looked again
    assert pt.opened(fh, ino, os.O_RDONLY, False)["backing_id"]
    pt.poll()
    assert core.getattr(ino).state is State.OPEN  # an open is left: not asked
    _close(core, pt, fh)
    assert core.getattr(ino).state is State.STAGED


def test_unmount_stages_what_a_mapping_still_holds(core: Filesystem,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    pt = _files(core)
    fh, ino, _ = _open(core, pt, b"held", os.O_RDWR)
    mapping = _hold_for_writing(core, ino)
    try:
        _close(core, pt, fh)
        pt.close()
        assert core.getattr(ino).state is State.STAGED
        assert any("still mapped at unmount" in r.getMessage() for r in caplog.records)
    finally:
        os.close(mapping)
