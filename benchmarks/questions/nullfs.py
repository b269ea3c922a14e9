"""nullfs: a do-nothing pyfuse3 + trio filesystem, the ceiling of the FUSE write path.

One directory (the root). Files created in it accept writes and throw the bytes away; only
their size is kept, so ``getattr`` reports what was written and ``torch.save`` (which stats
and seeks around) works. Nothing is ever read back.

It implements the operations a writer such as ``torch.save`` needs, with the same mount
options as ckptfs (``default_permissions``, ``fsname``/``subtype``), the same worker settings
(``pyfuse3.main(min_tasks=1, max_tasks=64)``) and no writeback cache, so the difference to
ckptfs is exactly the work ckptfs does per request:

    lookup, getattr, setattr, create, open, write, flush, release, getxattr (ENODATA, the kernel
    asks ``security.capability`` around every write, as it does on ckptfs), statfs, plus unlink,
    forget, opendir/readdir/releasedir so the benchmark can clean up and ``ls`` works.

Statistics (op counts and a histogram of the sizes of the write requests the kernel sends)
are readable as the xattr ``user.nullfs.stats`` of the mount root (JSON), and, with
``--stats-file F``, written to F whenever someone looks up the name ``.nullfs-stats`` in the
root (``os.path.exists(mnt/".nullfs-stats")``; the lookup then fails with ENOENT), which works
even with ``--getxattr-enosys``. They are cumulative; readers diff two snapshots.

Variants, to take the FUSE write path apart (all off by default):

  --backing-dir DIR    land the bytes in DIR/<ino> with os.pwrite (one more copy, into the page
                       cache of a real disk): the least any staging filesystem must do
  --pwrite-chunk N     with --backing-dir, land each request in pwrite() calls of at most N bytes
                       (the page cache picks its folio size from the write size)
  --writeback-cache    let the kernel cache writes (FUSE writeback cache) and send them in the
                       background; close() still waits until every byte reached the daemon
  --getxattr-enosys    answer getxattr with ENOSYS, so the kernel stops asking for
                       security.capability before every write() (costs the xattr API)
  --direct-io          open files for writing with FOPEN_DIRECT_IO: the kernel hands the
                       writer's pages to the daemon instead of copying them into the page cache
                       of the FUSE file first (one copy and one page-cache allocation less)
  --bandwidth B        accept at most B bytes/s of writes in all (one token bucket for the
                       whole mount): with --backing-dir, a slow shared filesystem for the
                       "write straight to shared storage" baselines of run_all.py

Usage: ``python benchmarks/questions/nullfs.py MOUNTPOINT`` serves in the foreground until
unmounted (``fusermount3 -u MOUNTPOINT``) or sent SIGTERM/SIGINT. run_all.py's questions start
it as a child through ``questions.common.nullfs_mount`` (Q1's slow store, Q2's FUSE ceiling and
its variants, Q7's read ceilings).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import stat
import sys
import time
from collections import Counter
from typing import Any

import pyfuse3
import trio

log = logging.getLogger("nullfs")

ROOT = pyfuse3.ROOT_INODE
STATS_XATTR = b"user.nullfs.stats"
STATS_NAME = b".nullfs-stats"
ATTR_TIMEOUT = 10.0  # as ckptfs
BLOCK_SIZE_HINT = 1024 * 1024  # as ckptfs
BURST_S = 0.25  # --bandwidth: credit a quiet link may build up, seconds
MAX_DISTINCT_SIZES = 256  # keep the stats xattr well below XATTR_SIZE_MAX (64 KiB)


class _Inode:
    __slots__ = ("ctime_ns", "gid", "ino", "lookups", "mode", "mtime_ns", "name", "size", "uid")

    def __init__(self, ino: int, name: bytes, mode: int, uid: int, gid: int) -> None:
        now = time.time_ns()
        self.ino = ino
        self.name = name
        self.mode = mode
        self.size = 0
        self.uid = uid
        self.gid = gid
        self.mtime_ns = now
        self.ctime_ns = now
        self.lookups = 0


class NullFs(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False  # as ckptfs

    def __init__(self, *, backing_dir: str | None = None, writeback_cache: bool = False,
                 getxattr_enosys: bool = False, stats_file: str | None = None,
                 direct_io: bool = False, pwrite_chunk: int = 0,
                 bandwidth: float | None = None) -> None:
        super().__init__()
        self.bandwidth = bandwidth
        self._next_free = 0.0  # token bucket: when the link is free again (monotonic s)
        self.pwrite_chunk = pwrite_chunk
        self.direct_io = direct_io
        self.backing_dir = backing_dir
        self.enable_writeback_cache = writeback_cache
        self.getxattr_enosys = getxattr_enosys
        self.stats_file = stats_file
        self.backing_fds: dict[int, tuple[int, int]] = {}  # ino -> (fd, refs)
        root = _Inode(ROOT, b"", stat.S_IFDIR | 0o777, os.getuid(), os.getgid())
        self.inodes: dict[int, _Inode] = {ROOT: root}
        self.names: dict[bytes, int] = {}
        self.next_ino = ROOT + 1
        self.handles: dict[int, int] = {}
        self.next_fh = 1
        self.ops: Counter[str] = Counter()
        self.write_sizes: Counter[int] = Counter()
        self.write_bytes = 0

    # -- helpers ---------------------------------------------------------------------------

    def _attrs(self, node: _Inode) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = 0
        e.entry_timeout = ATTR_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        e.st_mode = node.mode
        e.st_nlink = 1
        e.st_uid = node.uid
        e.st_gid = node.gid
        e.st_rdev = 0
        e.st_size = node.size
        e.st_blksize = BLOCK_SIZE_HINT
        e.st_blocks = (node.size + 511) // 512
        e.st_atime_ns = node.mtime_ns
        e.st_mtime_ns = node.mtime_ns
        e.st_ctime_ns = node.ctime_ns
        return e

    def _node(self, ino: int) -> _Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def stats(self) -> dict[str, Any]:
        sizes = self.write_sizes.most_common(MAX_DISTINCT_SIZES)
        other = sum(self.write_sizes.values()) - sum(n for _, n in sizes)
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "ops": dict(self.ops),
            "write_bytes": self.write_bytes,
            "write_sizes": {str(size): n for size, n in sizes},
        }
        if other:
            out["write_sizes_other"] = other
        return out

    # -- operations ------------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        self.ops["lookup"] += 1
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name in (b".", b".."):
            ino = ROOT
        elif name == STATS_NAME and self.stats_file:
            tmp = self.stats_file + ".tmp"
            with open(tmp, "w") as f:  # noqa: ASYNC230 (a few bytes on a benchmark's request)
                json.dump(self.stats(), f)
            os.replace(tmp, self.stats_file)
            raise pyfuse3.FUSEError(errno.ENOENT)
        else:
            ino = self.names.get(name, 0)
            if not ino:
                raise pyfuse3.FUSEError(errno.ENOENT)
        node = self.inodes[ino]
        node.lookups += 1
        return self._attrs(node)

    async def forget(self, inode_list: Any) -> None:
        self.ops["forget"] += 1
        for ino, count in inode_list:
            node = self.inodes.get(ino)
            if node is None or ino == ROOT:
                continue
            node.lookups -= count
            if node.lookups <= 0 and self.names.get(node.name) != ino:
                del self.inodes[ino]

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        self.ops["getattr"] += 1
        return self._attrs(self._node(inode))

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        self.ops["setattr"] += 1
        node = self._node(inode)
        if fields.update_size:
            node.size = attr.st_size
            if self.backing_dir:
                fd = self._backing_acquire(inode)
                os.ftruncate(fd, attr.st_size)
                self._backing_release(inode)
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            node.uid = attr.st_uid
        if fields.update_gid:
            node.gid = attr.st_gid
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        node.ctime_ns = time.time_ns()
        return self._attrs(node)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> Any:
        self.ops["create"] += 1
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name in self.names:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = _Inode(self.next_ino, name, stat.S_IFREG | stat.S_IMODE(mode),
                      ctx.uid, ctx.gid)
        self.next_ino += 1
        node.lookups = 1
        self.inodes[node.ino] = node
        self.names[name] = node.ino
        fi = pyfuse3.FileInfo(fh=self._new_fh(node.ino))
        fi.direct_io = self.direct_io and _writable(flags)
        return fi, self._attrs(node)

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        self.ops["open"] += 1
        node = self._node(inode)
        if stat.S_ISDIR(node.mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        fh = self._new_fh(inode)
        if flags & os.O_TRUNC:
            node.size = 0
            if self.backing_dir:
                os.ftruncate(self.backing_fds[inode][0], 0)
        fi = pyfuse3.FileInfo(fh=fh)
        fi.direct_io = self.direct_io and _writable(flags)
        return fi

    def _new_fh(self, ino: int) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = ino
        if self.backing_dir:
            self._backing_acquire(ino)
        return fh

    def _backing_acquire(self, ino: int) -> int:
        assert self.backing_dir is not None
        fd, refs = self.backing_fds.get(ino, (-1, 0))
        if fd < 0:
            fd = os.open(os.path.join(self.backing_dir, str(ino)),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.backing_fds[ino] = (fd, refs + 1)
        return fd

    def _backing_release(self, ino: int) -> None:
        fd, refs = self.backing_fds[ino]
        if refs == 1:
            del self.backing_fds[ino]
            os.close(fd)
        else:
            self.backing_fds[ino] = (fd, refs - 1)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        n = len(buf)
        self.ops["write"] += 1
        self.write_sizes[n] += 1
        self.write_bytes += n
        ino = self.handles[fh]
        if self.bandwidth:
            now = time.monotonic()
            # A bucket of BURST_S seconds of credit: the writer's own time between requests
            # does not count against the link (sustained rate = bandwidth).
            self._next_free = max(self._next_free, now - BURST_S) + n / self.bandwidth
            if self._next_free > now:
                await trio.sleep(self._next_free - now)
        if self.backing_dir:
            fd = self.backing_fds[ino][0]
            view = memoryview(buf)
            done = 0
            step = self.pwrite_chunk or n
            while done < n:
                done += os.pwrite(fd, view[done:done + step], off + done)
        node = self.inodes[ino]
        node.size = max(node.size, off + n)
        return n

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.ops["read"] += 1
        ino = self.handles[fh]
        if self.backing_dir:
            return os.pread(self.backing_fds[ino][0], size, off)
        node = self.inodes[ino]
        return bytes(max(0, min(size, node.size - off)))  # zeros: the data was discarded

    async def flush(self, fh: int) -> None:
        self.ops["flush"] += 1

    async def release(self, fh: int) -> None:
        self.ops["release"] += 1
        ino = self.handles.pop(fh, None)
        if ino is not None and self.backing_dir:
            self._backing_release(ino)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.ops["unlink"] += 1
        ino = self.names.pop(name, 0)
        if not ino:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.inodes[ino].lookups <= 0:
            del self.inodes[ino]
        if self.backing_dir:
            try:
                os.unlink(os.path.join(self.backing_dir, str(ino)))
            except FileNotFoundError:
                pass

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        self.ops["getxattr"] += 1
        if self.getxattr_enosys:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel will not ask again
        if inode == ROOT and name == STATS_XATTR:
            return json.dumps(self.stats()).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def statfs(self, ctx: Any) -> Any:
        self.ops["statfs"] += 1
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = st.f_bfree = st.f_bavail = 1 << 40  # 4 PiB, all free
        st.f_files = st.f_ffree = st.f_favail = 1 << 32
        st.f_namemax = 255
        return st

    async def opendir(self, inode: int, ctx: Any) -> int:
        self.ops["opendir"] += 1
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        self.ops["readdir"] += 1
        for ino in sorted(i for i in self.names.values() if i > start_id):
            node = self.inodes[ino]
            if not pyfuse3.readdir_reply(token, node.name, self._attrs(node), ino):
                return
            node.lookups += 1

    async def releasedir(self, fh: int) -> None:
        self.ops["releasedir"] += 1


def _writable(flags: int) -> bool:
    return (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)


def fuse_options() -> set[str]:
    """The options ckptfs mounts with (ckptfs.ops.mount.fuse_options), under our own name."""
    return set(pyfuse3.default_options) | {"fsname=nullfs", "subtype=nullfs"}


async def _serve(max_tasks: int) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_terminate_on_signal)
        await pyfuse3.main(min_tasks=1, max_tasks=max_tasks)
        nursery.cancel_scope.cancel()


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mountpoint")
    parser.add_argument("--max-tasks", type=int, default=64,
                        help="pyfuse3 worker tasks (ckptfs default: fuse_workers = 64)")
    parser.add_argument("--backing-dir", help="pwrite the data into files in this directory")
    parser.add_argument("--pwrite-chunk", type=int, default=0,
                        help="with --backing-dir: largest pwrite() call, bytes (0: whole request)")
    parser.add_argument("--writeback-cache", action="store_true",
                        help="enable the FUSE writeback cache")
    parser.add_argument("--getxattr-enosys", action="store_true",
                        help="answer getxattr with ENOSYS (no security.capability round trips)")
    parser.add_argument("--direct-io", action="store_true",
                        help="FOPEN_DIRECT_IO for files opened for writing")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="limit writes to this many bytes/s (whole mount)")
    parser.add_argument("--stats-file", help="dump stats here on lookup of .nullfs-stats")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s nullfs %(levelname)s: %(message)s", stream=sys.stderr)
    ops = NullFs(backing_dir=args.backing_dir, writeback_cache=args.writeback_cache,
                 getxattr_enosys=args.getxattr_enosys, stats_file=args.stats_file,
                 direct_io=args.direct_io, pwrite_chunk=args.pwrite_chunk,
                 bandwidth=args.bandwidth)
    pyfuse3.init(ops, args.mountpoint, fuse_options())
    try:
        trio.run(_serve, args.max_tasks)
    finally:
        pyfuse3.close(unmount=True)
    log.info("unmounted; stats: %s", json.dumps(ops.stats()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
