"""ptdemo: a minimal pyfuse3 + trio filesystem that mirrors one flat directory, with or without
FUSE passthrough (docs/PASSTHROUGH.md). A test and benchmark helper, not part of ckptfs.

``--mode passthrough`` needs the pyfuse3 built by ``scripts/build_passthrough_fuse.sh``
(``PYTHONPATH=/opt/ckptfs-fuse/python``): every open registers the mirrored file as the backing
file of its inode (one backing id per inode, shared by its opens, closed at the inode's last
release, as the kernel wants) and answers with ``FileInfo.backing_id``, so the kernel serves
read/write/mmap without asking the daemon. ``--mode stock`` runs with any pyfuse3 and serves
every read and write itself (no writeback cache, page cache kept across opens off), the path
ckptfs has today.

The root's xattr ``user.ptdemo.stats`` is JSON: whether passthrough was negotiated, the READ and
WRITE requests that reached the daemon, passthrough and plain opens, open backing ids.
A passthrough mount whose backing ioctl fails (EPERM without CAP_SYS_ADMIN) serves that open
itself and counts it in ``fallback_opens``.

Usage: ``python tests/passthrough_fs.py SOURCE_DIR MOUNTPOINT [--mode passthrough|stock]``;
serves in the foreground until unmounted (``fusermount3 -u MOUNTPOINT``). Tests and benchmarks
use ``build()`` and ``demo_mount()`` below, which start it as a subprocess and always unmount.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import logging
import os
import platform
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

log = logging.getLogger("ptdemo")
STATS_XATTR = b"user.ptdemo.stats"
REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "build_passthrough_fuse.sh"
PREFIX = Path(os.environ.get("CKPTFS_FUSE_PREFIX", "/opt/ckptfs-fuse"))
# build_passthrough_fuse.sh's exit status when a prerequisite (apt source, PyPI) is unreachable
BUILD_UNFETCHABLE = 3


@dataclass
class _Backing:
    backing_id: int
    opens: int


class PassthroughDemo(pyfuse3.Operations):  # type: ignore[misc]
    def __init__(self, source: str, passthrough: bool) -> None:
        super().__init__()
        self.source = source
        self.passthrough = passthrough
        self.negotiated = False
        self.names: dict[int, str] = {}       # inode -> name in source
        self.inodes: dict[str, int] = {}
        self.next_inode = pyfuse3.ROOT_INODE + 1
        self.fds: dict[int, tuple[int, int]] = {}   # fh -> (fd, inode)
        self.backing: dict[int, _Backing] = {}      # inode -> its backing id while open
        self.stats: Counter[str] = Counter()

    # -- names and attributes
    def _path(self, inode: int) -> str:
        if inode == pyfuse3.ROOT_INODE:
            return self.source
        return os.path.join(self.source, self.names[inode])

    def _inode(self, name: str) -> int:
        if name not in self.inodes:
            self.inodes[name] = self.next_inode
            self.names[self.next_inode] = name
            self.next_inode += 1
        return self.inodes[name]

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(self._path(inode))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        a = pyfuse3.EntryAttributes()
        for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                  "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, k, getattr(st, k))
        a.st_ino = inode
        a.st_blksize = 4096
        a.st_blocks = st.st_blocks
        # Writes in passthrough never reach us: the kernel keeps size itself; short timeouts
        # are enough for a demo.
        a.attr_timeout = a.entry_timeout = 1.0
        return a

    def init(self) -> None:
        enabled = getattr(pyfuse3, "passthrough_enabled", None)
        self.negotiated = bool(self.passthrough and enabled is not None and enabled())

    async def lookup(self, parent: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        n = os.fsdecode(name)
        if parent != pyfuse3.ROOT_INODE or not os.path.lexists(os.path.join(self.source, n)):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self._inode(n))

    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        if fields.update_size:
            os.truncate(self._path(inode), attr.st_size)
        if fields.update_mode:
            os.chmod(self._path(inode), stat.S_IMODE(attr.st_mode))
        return self._attr(inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        names = sorted(os.listdir(self.source))
        for i, n in enumerate(names[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, os.fsencode(n), self._attr(self._inode(n)), i + 1):
                break

    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        os.unlink(os.path.join(self.source, os.fsdecode(name)))

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        sv = os.statvfs(self.source)
        out = pyfuse3.StatvfsData()
        for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(out, k, getattr(sv, k))
        return out

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == STATS_XATTR:
            return json.dumps({"passthrough": self.negotiated,
                               "open_backing_ids": len(self.backing), **self.stats}).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)

    # -- opens: one backing id per inode, shared by all its opens
    def _file_info(self, inode: int, fd: int) -> pyfuse3.FileInfo:
        fh = fd  # the fd is unique while open
        self.fds[fh] = (fd, inode)
        if self.negotiated:
            b = self.backing.get(inode)
            if b is None:
                try:
                    b = _Backing(pyfuse3.passthrough_open(fd), 0)
                except OSError as e:
                    log.warning("passthrough_open: %s; serving this open in the daemon", e)
                    self.stats["fallback_opens"] += 1
                    return pyfuse3.FileInfo(fh=fh, keep_cache=False)
                self.backing[inode] = b
            b.opens += 1
            self.stats["passthrough_opens"] += 1
            # keep_cache must be off: the kernel refuses (EIO) a passthrough open whose flags
            # leave FOPEN_PASSTHROUGH_MASK (passthrough, direct_io, parallel writes, noflush).
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, backing_id=b.backing_id)
        self.stats["plain_opens"] += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=False)

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        try:
            fd = os.open(self._path(inode), flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        return self._file_info(inode, fd)

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        n = os.fsdecode(name)
        try:
            fd = os.open(os.path.join(self.source, n), flags | os.O_CREAT, mode)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        inode = self._inode(n)
        return self._file_info(inode, fd), self._attr(inode)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.stats["read_requests"] += 1
        return os.pread(self.fds[fh][0], size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.stats["write_requests"] += 1
        return os.pwrite(self.fds[fh][0], buf, off)

    async def flush(self, fh: int) -> None:
        pass

    async def fsync(self, fh: int, datasync: bool) -> None:
        fd = self.fds[fh][0]
        (os.fdatasync if datasync else os.fsync)(fd)

    async def release(self, fh: int) -> None:
        fd, inode = self.fds.pop(fh)
        os.close(fd)
        b = self.backing.get(inode)
        if b is not None:
            b.opens -= 1
            if b.opens == 0:
                del self.backing[inode]
                pyfuse3.passthrough_close(b.backing_id)


# -- helpers for tests and benchmarks

def build() -> subprocess.CompletedProcess[str]:
    """Run scripts/build_passthrough_fuse.sh (cached: well under a second when built)."""
    return subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True,
                          timeout=1200, check=False, stdin=subprocess.DEVNULL)


@functools.cache
def unavailable() -> str:
    """Why ckptfs cannot use passthrough on this machine ("" if it can); builds it once.

    A build that could not fetch its prerequisites is a reason (the caller skips); a build
    that failed otherwise is an error, never a skip."""
    done = build()
    if done.returncode == BUILD_UNFETCHABLE:
        return ("the passthrough build's prerequisites cannot be fetched: "
                + done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, f"build_passthrough_fuse.sh failed:\n{done.stdout}\n{done.stderr}"
    release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    if release < (6, 9):
        return f"kernel {platform.release()} has no FUSE passthrough (6.9+)"
    if os.geteuid() != 0:
        return "registering backing files needs CAP_SYS_ADMIN (run as root)"
    return ""


def stats(mountpoint: Path) -> dict[str, Any]:
    return json.loads(os.getxattr(mountpoint, STATS_XATTR))  # type: ignore[no-any-return]


def _mounted(path: Path) -> bool:
    target = os.fsencode(os.path.abspath(path)).replace(b" ", b"\\040")
    with open("/proc/self/mountinfo", "rb") as f:
        return any(line.split()[4] == target for line in f)


@contextlib.contextmanager
def demo_mount(source: Path, mountpoint: Path, mode: str) -> Iterator[subprocess.Popen[bytes]]:
    """Serve ``source`` at ``mountpoint`` (``mode``: passthrough or stock) in a subprocess.

    Passthrough mode runs the pyfuse3 in PREFIX/python, stock mode the installed one. Always
    unmounted on exit, even when the body failed or the daemon died.
    """
    env = dict(os.environ)
    if mode == "passthrough":
        env["PYTHONPATH"] = os.pathsep.join([str(PREFIX / "python"), str(REPO)])
    mountpoint.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, str(source), str(mountpoint),
                             "--mode", mode], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _mounted(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode() if proc.poll() is not None else ""  # type: ignore[union-attr]
                raise RuntimeError(f"ptdemo ({mode}) did not mount {mountpoint}: {out}")
            time.sleep(0.02)
        yield proc
    finally:
        if _mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True,
                           check=False)
        if _mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True,
                           check=False)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--mode", choices=("passthrough", "stock"), default="passthrough")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ptdemo: %(message)s")
    passthrough = args.mode == "passthrough"
    if passthrough and not hasattr(pyfuse3, "passthrough_open"):
        raise SystemExit(f"ptdemo: {pyfuse3.__file__} has no passthrough support "
                         "(PYTHONPATH=/opt/ckptfs-fuse/python, scripts/build_passthrough_fuse.sh)")
    ops = PassthroughDemo(os.path.abspath(args.source), passthrough)
    options = set(pyfuse3.default_options) | {"fsname=ptdemo", "subtype=ptdemo"}
    if passthrough:
        pyfuse3.init(ops, args.mountpoint, options, passthrough=True)
    else:
        pyfuse3.init(ops, args.mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__":
    main()
