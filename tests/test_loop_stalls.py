"""Disk waits of an fsync run off the trio thread: while one request
waits for the staging disk, the daemon answers the others.

The disk is made slow on purpose (the staging file's and the journal's fsync block in their
worker thread until the test lets them go), so the test does not depend on the machine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from ckptfs.engine.fs import ROOT_CALLER, Filesystem
from ckptfs.state.journal import ROOT_INODE
from tests.test_fs_core import close_fs, open_fs


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Filesystem]:
    f = open_fs(tmp_path)
    try:
        yield f
    finally:
        close_fs(f)


@pytest.mark.parametrize("slow", ["data", "journal"])
async def test_other_requests_are_answered_while_an_fsync_waits_for_the_disk(
        fs: Filesystem, monkeypatch: pytest.MonkeyPatch, slow: str) -> None:
    fh, row = fs.create(ROOT_INODE, b"big", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, b"x" * 65536)
    other = fs.mkdir(ROOT_INODE, b"d", 0o755, ROOT_CALLER)
    disk = threading.Event()      # set: the slow device has finished
    waiting = trio.Event()        # the fsync is blocked on it
    token = trio.lowlevel.current_trio_token()

    def blocked() -> None:
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("a disk wait on the trio thread")
        token.run_sync_soon(waiting.set)
        assert disk.wait(10)

    if slow == "data":
        real = fs.staging.sync
        monkeypatch.setattr(fs.staging, "sync", lambda fd, d: (blocked(), real(fd, d))[1])
    else:
        real_files = fs.journal._sync_files
        monkeypatch.setattr(fs.journal, "_sync_files", lambda *log: (blocked(), real_files(*log))[1])

    done = trio.Event()

    async def fsync() -> None:
        await fs.fsync(fh, datasync=False)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fsync)
        await waiting.wait()
        # The fsync is stuck on the disk; the rest of the node goes on.
        assert (await fs.lookup(ROOT_INODE, b"d")).ino == other.ino
        assert fs.getattr(row.ino).size == 65536
        fh2, _ = fs.create(ROOT_INODE, b"small", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
        await fs.write(fh2, 0, b"y")
        fs.flush(fh2)
        fs.release(fh2)
        assert not done.is_set()
        disk.set()
    assert done.is_set()
    fs.flush(fh)
    fs.release(fh)
