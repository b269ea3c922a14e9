"""No write the daemon cannot see: every way a writer can reach a file without a WRITE request
(docs/PASSTHROUGH.md, "No write the daemon cannot see"), on a real mount, in both modes.

Each case writes through one escape, then ``ckptfs sync``: the store (a file tier, read
directly) must hold the bytes the mount shows; then ``ckptfs evict`` and a read through the
mount must give them back from the store. The cases: a shared mapping written after close(2)
(the C idiom; with a reader keeping the inode open meanwhile too), a dup'ed descriptor and a
child process writing after the parent's close(2), splice/copy_file_range/sendfile into the
file, fallocate, writes after fsync. The exact syscall sequence of the mapping is a C helper
compiled here (Python's ``mmap`` keeps a dup of the descriptor, which hides the case).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, ckptfs, status, sync

pytestmark = [pytest.mark.mount, pytest.mark.both_modes, pytest.mark.timeout(240)]

PAGE = 4096

MAPHOLE_C = r"""
/* open O_RDWR, ftruncate, mmap MAP_SHARED, write 'A', close(fd), write 'B' through the
   mapping, munmap: waits for a line on stdin after each step it prints. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void step(const char *what) {
    char line[16];
    printf("%s\n", what);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) _exit(3);
}

int main(int argc, char **argv) {
    size_t size = 4 * 4096;
    int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
    if (fd < 0) { perror("open"); return 1; }
    if (ftruncate(fd, size)) { perror("ftruncate"); return 1; }
    char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 1; }
    memset(p, 'A', size);
    step("mapped");
    if (close(fd)) { perror("close"); return 1; }
    step("closed");
    memset(p, 'B', size);
    if (munmap(p, size)) { perror("munmap"); return 1; }
    printf("unmapped\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def maphole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler: the mapping case needs its exact syscalls")
    where = tmp_path_factory.mktemp("maphole")
    (where / "maphole.c").write_text(MAPHOLE_C)
    subprocess.run([gcc, "-O2", "-o", str(where / "maphole"), str(where / "maphole.c")],
                   check=True, capture_output=True)
    return where / "maphole"


class Helper:
    """The C helper, one step at a time."""

    def __init__(self, binary: Path, path: Path) -> None:
        self.proc = subprocess.Popen([str(binary), str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def expect(self, what: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == what, f"helper said {line!r}, expected {what!r}"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        self.go()
        self.expect("unmapped")
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def mount(mounter: Mounter) -> Mount:
    return mounter("esc")


def _stored_and_served(m: Mount, name: str, want: bytes) -> None:
    """After sync: the store holds ``want``, the mount shows it; after an eviction the mount
    reads it back from the store."""
    path = m.path / name
    assert path.read_bytes() == want, f"{name}: the mount shows other bytes"
    sync(m)
    assert m.state(name) == "committed", (name, m.state(name))
    assert m.store is not None
    assert (m.store / name).read_bytes() == want, f"{name}: the store holds other bytes"
    ckptfs("evict", path)
    assert m.state(name) == "remote"
    assert path.read_bytes() == want, f"{name}: read back after eviction differs"


def test_a_mapping_written_after_close(mount: Mount, maphole: Path, io_mode: str) -> None:
    """The C idiom: the last write goes through the mapping after close(fd). With
    passthrough the kernel maps the staging file itself and RELEASE comes at close(fd): the
    daemon holds the file OPEN until the mapping is gone."""
    path = mount.path / "mapped.bin"
    helper = Helper(maphole, path)
    helper.expect("mapped")
    helper.go()
    helper.expect("closed")
    # Closed, still mapped: nothing of it may be committed yet ('A' would be the old bytes).
    sync(mount)
    assert mount.state("mapped.bin") == "open"
    if io_mode == "on":
        assert status(mount)["passthrough"]["mapped_files"] == 1
    helper.finish()
    _stored_and_served(mount, "mapped.bin", b"B" * 4 * PAGE)


def test_a_mapping_written_after_close_while_a_reader_holds_it(
        mount: Mount, maphole: Path) -> None:
    """The writer's release comes while another open of the inode is left (and the daemon
    then holds the staging file open itself): it waits for that open, then for the mapping."""
    path = mount.path / "shared.bin"
    helper = Helper(maphole, path)
    helper.expect("mapped")
    with open(path, "rb") as reader:
        helper.go()
        helper.expect("closed")
        assert reader.read(PAGE) == b"A" * PAGE
    helper.finish()
    _stored_and_served(mount, "shared.bin", b"B" * 4 * PAGE)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def test_a_dup_written_after_the_other_copy_is_closed(mount: Mount) -> None:
    """close(2) of one copy sends FLUSH (the file's close is recorded); the other copy keeps
    the open file, so RELEASE waits for it."""
    path = mount.path / "dup.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    other = os.dup(fd)
    _write_all(fd, b"a" * 100_000)
    os.close(fd)
    _write_all(other, b"b" * 100_000)
    os.pwrite(other, b"c" * 10, 5)                  # an overwrite: size unchanged
    os.close(other)
    _stored_and_served(mount, "dup.bin", b"a" * 5 + b"c" * 10 + b"a" * 99_985 + b"b" * 100_000)


def test_a_child_writes_after_the_parent_closed(mount: Mount) -> None:
    """A process forked while holding the descriptor: the parent's close(2) is a FLUSH, the
    child's writes and exit come after it."""
    path = mount.path / "fork.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _write_all(fd, b"p" * 50_000)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys; sys.stdin.readline(); os.write(int(sys.argv[1]), b'k' * 70000)",
         str(fd)], pass_fds=(fd,), stdin=subprocess.PIPE, text=True)
    os.close(fd)
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.close()
    assert child.wait(timeout=60) == 0
    _stored_and_served(mount, "fork.bin", b"p" * 50_000 + b"k" * 70_000)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.bin"
    path.write_bytes(bytes(range(256)) * 1024)     # 256 KiB, outside the mount
    return path


def test_splice_copy_file_range_and_sendfile_into_the_file(mount: Mount, source: Path) -> None:
    data = source.read_bytes()
    size = len(data)

    def by_splice(dst: int, src: int) -> None:
        r, w = os.pipe()
        try:
            left = size
            while left:
                n = os.splice(src, w, min(65536, left))
                left -= n
                while n:
                    n -= os.splice(r, dst, n)
        finally:
            os.close(r)
            os.close(w)

    def by_copy_file_range(dst: int, _: int) -> None:
        # From another file of the mount: across filesystems the kernel refuses (EXDEV),
        # and tools fall back to read/write.
        inside = os.open(mount.path / "splice.bin", os.O_RDONLY)
        try:
            done = 0
            while done < size:
                done += os.copy_file_range(inside, dst, size - done)
        finally:
            os.close(inside)

    def by_sendfile(dst: int, src: int) -> None:
        done = 0
        while done < size:
            done += os.sendfile(dst, src, done, size - done)

    for name, copy in (("splice.bin", by_splice), ("cfr.bin", by_copy_file_range),
                       ("sendfile.bin", by_sendfile)):
        dst = os.open(mount.path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        src = os.open(source, os.O_RDONLY)
        try:
            copy(dst, src)
        finally:
            os.close(src)
            os.close(dst)
        _stored_and_served(mount, name, data)


def test_fallocate(mount: Mount) -> None:
    """fallocate(2) is not offered (EOPNOTSUPP, in both modes); posix_fallocate falls back to
    writing a zero byte per block, which extends the file like any write."""
    path = mount.path / "falloc.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, b"f" * 1000)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        assert libc.fallocate(fd, 0, 0, 1 << 20) == -1
        assert ctypes.get_errno() == errno.EOPNOTSUPP
        os.posix_fallocate(fd, 1000, 200_000)
    finally:
        os.close(fd)
    assert os.path.getsize(path) == 201_000
    _stored_and_served(mount, "falloc.bin", b"f" * 1000 + b"\0" * 200_000)


def test_writes_after_fsync(mount: Mount) -> None:
    path = mount.path / "fsync.bin"
    with open(path, "wb", buffering=0) as f:
        f.write(b"1" * 300_000)
        os.fsync(f.fileno())
        f.write(b"2" * 300_000)
        os.fdatasync(f.fileno())
        f.seek(10)
        f.write(b"3" * 10)
    _stored_and_served(mount, "fsync.bin", b"1" * 10 + b"3" * 10 + b"1" * 299_980 + b"2" * 300_000)
