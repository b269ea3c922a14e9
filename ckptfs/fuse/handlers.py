"""The FUSE adapter: decode pyfuse3 arguments, call the core, map errors. No decisions here.

Invariants:
- Every handler raises only ``pyfuse3.FUSEError``. Domain errors get their errno from
  ``errors.errno_for``; anything else is a bug: logged with its traceback, answered with EIO,
  and the daemon keeps serving.
- Every inode the kernel is told about (lookup, create, mkdir, symlink, readdirplus entry)
  is counted with ``Filesystem.lookup``/``remember`` so that ``forget`` balances it.
- Every open/create that succeeded is reported to ``PassthroughFiles`` (passthrough.py), which
  decides how the kernel serves it; every RELEASE goes through it to the core (it may hold a
  writer's release while a passthrough mapping can still write the file). Attributes and
  flush/fsync/release first let it copy what passthrough writes did to the staging file
  into the row.
"""

from __future__ import annotations

import errno
import functools
import logging
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3

from ckptfs.engine.fs import Caller, Filesystem
from ckptfs.errors import FsError, NotFound, errno_for
from ckptfs.fuse.passthrough import PassthroughFiles, negotiated_backend
from ckptfs.state.journal import ROOT_INODE, Row

log = logging.getLogger(__name__)

# The kernel sees every change made through this mount, so cached attributes stay right.
ATTR_TIMEOUT = 10.0
# st_blksize is the I/O size hint: Python's open() and stdio size their buffers from it, and
# larger writes mean fewer trips through FUSE.
BLOCK_SIZE_HINT = 1024 * 1024

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _translate_errors(fn: F) -> F:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except NotFound:
            # The usual error (a create's lookup of its new name): no table to search.
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except Exception as exc:
            code = errno_for(exc)
            if code is None:
                log.exception("unexpected error in %s; answering EIO", fn.__name__)
                code = errno.EIO
            elif not isinstance(exc, FsError) or code == errno.EIO:
                log.warning("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(code) from None

    return wrapper  # type: ignore[return-value]


def entry_attributes(row: Row, timeout: float = ATTR_TIMEOUT,
                     nlink: int | None = None) -> pyfuse3.EntryAttributes:
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = row.ino
    entry.generation = 0
    entry.entry_timeout = timeout
    entry.attr_timeout = timeout
    entry.st_mode = row.mode
    # Directories report 1 like btrfs: "unknown number of subdirectories" to find(1).
    if nlink is None:
        nlink = 0 if row.parent is None and row.ino != ROOT_INODE else 1
    entry.st_nlink = nlink
    entry.st_uid = row.uid
    entry.st_gid = row.gid
    entry.st_rdev = row.rdev
    entry.st_size = row.size
    entry.st_blksize = BLOCK_SIZE_HINT
    entry.st_blocks = (row.size + 511) // 512 if stat.S_ISREG(row.mode) else 0
    entry.st_atime_ns = row.atime_ns
    entry.st_mtime_ns = row.mtime_ns
    entry.st_ctime_ns = row.ctime_ns
    return entry


def _caller(ctx: pyfuse3.RequestContext) -> Caller:
    return Caller(ctx.uid, ctx.gid, ctx.umask)


class FuseOps(pyfuse3.Operations):
    """pyfuse3 handlers over a ``Filesystem``."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, fs: Filesystem, attr_timeout: float = ATTR_TIMEOUT,
                 on_init: Callable[[], None] | None = None,
                 passthrough: PassthroughFiles | None = None) -> None:
        super().__init__()
        self.fs = fs
        # Requested at pyfuse3.init by the mount (or not: every open daemon-served).
        self.passthrough = passthrough or PassthroughFiles(fs)
        # Another node's changes show up within metadata_ttl: the kernel may not cache
        # entries and attributes longer than that.
        self.attr_timeout = attr_timeout
        self.on_init = on_init

    def init(self) -> None:
        """FUSE_INIT from the kernel; our reply follows as soon as this returns (synchronously,
        in the same trio task), so anything ``on_init`` schedules runs after it."""
        pt = self.passthrough
        if pt.requested:
            pt.negotiated(negotiated_backend(pyfuse3))
        if self.on_init is not None:
            self.on_init()

    def _entry(self, row: Row, fresh: bool = False) -> pyfuse3.EntryAttributes:
        """``row``'s attributes for the kernel; ``fresh``: nothing can have written the file
        since the daemon last saw it (a create's reply: its backing file was just opened)."""
        if not fresh:
            self.passthrough.refresh(row.ino)  # the kernel must not learn an old size
        return entry_attributes(row, self.attr_timeout, self.fs.ns.nlink(row))

    @_translate_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        return self._entry(await self.fs.lookup(parent_inode, name))

    @_translate_errors
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.fs.forget(ino, count)

    @_translate_errors
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self._entry(self.fs.getattr(inode))

    @_translate_errors
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any) -> Any:
        self.passthrough.refresh(inode)  # what was written before, e.g. before a futimens
        row = await self.fs.setattr(
            inode,
            fh=fh,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            caller=_caller(ctx),
        )
        self.passthrough.observe(inode)  # a truncate here is not a passthrough write
        return self._entry(row)

    @_translate_errors
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return self.fs.readlink(inode)

    @_translate_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        return self._entry(self.fs.mknod(parent_inode, name, mode, _caller(ctx), rdev))

    @_translate_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        return self._entry(self.fs.mkdir(parent_inode, name, mode, _caller(ctx)))

    @_translate_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.unlink(parent_inode, name)

    @_translate_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.rmdir(parent_inode, name)

    @_translate_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        return self._entry(self.fs.symlink(parent_inode, name, target, _caller(ctx)))

    @_translate_errors
    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
        flags: int, ctx: Any,
    ) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_translate_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        return self._entry(await self.fs.link(inode, new_parent_inode, new_name))

    @_translate_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        fh = await self.fs.open(inode, flags, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, **self._opened(fh, inode, flags))

    @_translate_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[Any, Any]:
        fh, row = self.fs.create(parent_inode, name, mode, flags, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, **self._opened(fh, row.ino, flags)), \
            self._entry(row, fresh=True)

    def _opened(self, fh: int, ino: int, flags: int) -> dict[str, Any]:
        try:
            return self.passthrough.opened(fh, ino, flags, self.fs.direct_io(fh))
        except BaseException:
            self.fs.release(fh)  # the kernel never hears of this handle
            raise

    @_translate_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.passthrough.counters.read_requests += 1
        return await self.fs.read(fh, off, size)

    @_translate_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.passthrough.counters.write_requests += 1
        return await self.fs.write(fh, off, buf)

    @_translate_errors
    async def flush(self, fh: int) -> None:
        self._refresh_handle(fh)
        self.fs.flush(fh)

    @_translate_errors
    async def release(self, fh: int) -> None:
        self._refresh_handle(fh)
        self.passthrough.release(fh)  # the core's release, now or once no mapping writes

    @_translate_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        self._refresh_handle(fh)
        await self.fs.fsync(fh, datasync)

    def _refresh_handle(self, fh: int) -> None:
        ino = self.passthrough.handle_ino(fh)
        if ino is not None:
            self.passthrough.refresh(ino)

    @_translate_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        row = self.fs.getattr(inode)
        if not stat.S_ISDIR(row.mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_translate_errors
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        # Cursors: 1 after ".", 2 after "..", ino + 2 after an entry (inode order is stable).
        if start_id == 0:
            if not pyfuse3.readdir_reply(token, b".", self._entry(self.fs.getattr(fh)), 1):
                return
            start_id = 1
        if start_id == 1:
            parent = self.fs.getattr(fh).parent or ROOT_INODE
            if not pyfuse3.readdir_reply(token, b"..", self._entry(self.fs.getattr(parent)), 2):
                return
            start_id = 2
        for row in await self.fs.readdir(fh, start_id - 2):
            assert row.name is not None
            # The cursor is the name row's (stable order); the inode is the kernel's (the
            # head of a hard link's extra name).
            inode = self.fs.ns.kernel(row)
            if not pyfuse3.readdir_reply(token, row.name, self._entry(inode), row.ino + 2):
                return
            # readdirplus gave the kernel a reference ("." and ".." excepted).
            self.fs.remember(inode.ino)

    @_translate_errors
    async def releasedir(self, fh: int) -> None:
        return None

    @_translate_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.fs.fsyncdir()

    @_translate_errors
    async def statfs(self, ctx: Any) -> Any:
        st = self.fs.statfs()
        data = pyfuse3.StatvfsData()
        data.f_bsize = st.block_size
        data.f_frsize = st.block_size
        data.f_blocks = st.blocks
        data.f_bfree = st.blocks_free
        data.f_bavail = st.blocks_avail
        data.f_files = st.files
        data.f_ffree = st.files_free
        data.f_favail = st.files_free
        data.f_namemax = st.name_max
        return data

    @_translate_errors
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        return self.fs.getxattr(inode, name)

    @_translate_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        self.fs.setxattr(inode, name, value)

    @_translate_errors
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return self.fs.listxattr(inode)

    @_translate_errors
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        self.fs.removexattr(inode, name)
