"""Write-only opens bypass the kernel page cache (``write_direct_io``, docs/SEMANTICS.md).

The core decides per open (write-only and the key on); the adapter passes the decision to the
kernel; a real mount shows that readers on other descriptors, cached reads and read-only
mmaps included, see every direct write at once, and that appends and sparse writes land where
they should. Every mount test runs with the key on and off, so both paths stay correct, and
with ``passthrough = off``: the key applies only to opens the daemon serves.
"""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from ckptfs.engine.fs import ROOT_CALLER, Filesystem
from ckptfs.fuse.handlers import FuseOps
from ckptfs.state.journal import ROOT_INODE, Journal
from ckptfs.state.staging import Staging
from tests.mounting import Mounter


def _fs(root: Path, direct: bool) -> Filesystem:
    staging = Staging(root)
    staging.prepare()
    fs = Filesystem(Journal(root / "journal.db"), staging, write_direct_io=direct)
    fs.start()
    return fs


class _Ctx:
    uid, gid, pid, umask = 0, 0, 0, 0o022


@pytest.mark.parametrize("direct", [True, False])
async def test_only_write_only_opens_are_direct(tmp_path: Path, direct: bool) -> None:
    fs = _fs(tmp_path / "staging", direct)
    ops = FuseOps(fs)
    try:
        info, entry = await ops.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, _Ctx())
        assert info.direct_io is direct
        await ops.release(info.fh)
        info, _ = await ops.create(ROOT_INODE, b"g", 0o644, os.O_RDWR | os.O_CREAT, _Ctx())
        assert info.direct_io is False  # may be mmapped shared: must stay cached
        await ops.release(info.fh)
        for flags, want in ((os.O_WRONLY | os.O_TRUNC, direct), (os.O_WRONLY | os.O_APPEND,
                            direct), (os.O_RDWR, False), (os.O_RDONLY, False)):
            info = await ops.open(entry.st_ino, flags, _Ctx())
            assert info.direct_io is want, flags
            await ops.release(info.fh)
        fh, _ = fs.create(ROOT_INODE, b"h", 0o644, os.O_WRONLY, ROOT_CALLER)
        assert fs.direct_io(fh) is direct
        fs.release(fh)
    finally:
        fs.close()
        fs.journal.close()
        fs.staging.close()



@pytest.mark.mount
@pytest.mark.parametrize("direct", ["true", "false"])
def test_readers_see_direct_writes_at_once(mounter: Mounter, direct: str) -> None:
    m = mounter(extra=["-o", "passthrough=off", "-o", f"write_direct_io={direct}"])
    path = m.path / "f"
    path.write_bytes(b"A" * 3 * mmap.PAGESIZE)
    reader = os.open(path, os.O_RDONLY)
    view = mmap.mmap(reader, 3 * mmap.PAGESIZE, prot=mmap.PROT_READ)
    try:
        assert os.pread(reader, 4, 0) == b"AAAA" and view[:4] == b"AAAA"  # now cached
        writer = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(writer, b"BBBB", mmap.PAGESIZE + 10)
            assert os.pread(reader, 6, mmap.PAGESIZE + 8) == b"AABBBB"
            assert view[mmap.PAGESIZE + 8:mmap.PAGESIZE + 14] == b"AABBBB"
            os.pwrite(writer, b"C" * 100, 3 * mmap.PAGESIZE + 50)  # past the end: a hole
            assert os.fstat(reader).st_size == 3 * mmap.PAGESIZE + 150
            assert os.pread(reader, 60, 3 * mmap.PAGESIZE) == b"\0" * 50 + b"C" * 10
        finally:
            os.close(writer)
        appender = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(appender, b"Z")
            os.write(appender, b"Y")
        finally:
            os.close(appender)
        assert os.pread(reader, 3, 3 * mmap.PAGESIZE + 149) == b"CZY"
    finally:
        view.close()
        os.close(reader)
    expected = bytearray(b"A" * 3 * mmap.PAGESIZE)
    expected[mmap.PAGESIZE + 10:mmap.PAGESIZE + 14] = b"BBBB"
    expected += b"\0" * 50 + b"C" * 100 + b"ZY"
    assert path.read_bytes() == expected
    m.umount()
    assert (m.store / "f").read_bytes() == expected
    m.remount()
    assert (m.path / "f").read_bytes() == expected


@pytest.mark.mount
@pytest.mark.parametrize("direct", ["true", "false"])
def test_unaligned_writes_and_shared_mmap_alongside(mounter: Mounter, direct: str) -> None:
    """Random unaligned writes through a write-only descriptor, mixed with a shared writable
    mmap of the same file (whose dirty pages the kernel writes back before a direct write)."""
    m = mounter(extra=["-o", "passthrough=off", "-o", f"write_direct_io={direct}"])
    path = m.path / "g"
    size = 256 * 1024
    rng = random.Random(7)
    expected = bytearray(rng.randbytes(size))
    path.write_bytes(expected)
    rw = os.open(path, os.O_RDWR)
    shared = mmap.mmap(rw, size)
    wo = os.open(path, os.O_WRONLY)
    try:
        for _ in range(200):
            off = rng.randrange(size - 1)
            data = rng.randbytes(rng.randint(1, min(20_000, size - off)))
            if rng.random() < 0.3:
                shared[off:off + len(data)] = data
            else:
                os.pwrite(wo, data, off)
            expected[off:off + len(data)] = data
            probe = rng.randrange(size - 64)
            assert os.pread(rw, 64, probe) == expected[probe:probe + 64]
        shared.flush()
    finally:
        shared.close()
        os.close(wo)
        os.close(rw)
    assert path.read_bytes() == expected
    m.umount()
    assert (m.store / "g").read_bytes() == expected
