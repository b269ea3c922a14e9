"""``file:///path``: a directory on a parallel filesystem (Lustre, GPFS, NFS, ...).

The tree under the root mirrors the mount: files are files, symlinks are symlinks, directories
are directories. Mode, mtime and (as root) owner are set on the entry itself; the checksum goes
in the ``user.ckptfs.checksum`` xattr where the filesystem supports xattrs.

Invariants:
- A put writes ``.<name>.ckptfs-tmp.<random>`` next to the target, fsyncs it, then renames it
  over the target and fsyncs the directory: readers never see a partial file. Temporary names
  are never listed and are removed when a put fails or is cancelled.
- Copy is a hard link where the filesystem allows it (a rename on the store costs no data
  copy), a streamed copy otherwise.
- All blocking I/O runs in worker threads in chunks, so cancellation is seen between chunks.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import crc32c
import trio

from ckptfs.errors import StoreUnavailable
from ckptfs.tiers.base import (
    Kind,
    LocalWriteFailed,
    ObjectInfo,
    ObjectMeta,
    ObjectMissing,
    PreconditionFailed,
    Progress,
    Tier,
    TierError,
    write_local,
)

T = TypeVar("T")
TMP_MARK = ".ckptfs-tmp."
CHUNK = 16 * 1024 * 1024
_XATTR_CHECKSUM = "user.ckptfs.checksum"
_XATTR_BLOCKS = "user.ckptfs.blocks"
_TRANSIENT = {errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, errno.ESTALE, errno.EAGAIN,
              errno.ENOSPC, errno.EDQUOT, errno.EHOSTDOWN, errno.ECONNRESET}


class FileTier(Tier):
    def __init__(self, name: str, url: str, root: Path,
                 limiter: trio.CapacityLimiter | None = None) -> None:
        super().__init__(name, url)
        self.root = root
        self._limiter = limiter or trio.CapacityLimiter(8)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except FileNotFoundError as exc:
            raise ObjectMissing(str(exc.filename)) from exc
        except OSError as exc:
            if exc.errno in _TRANSIENT:
                raise StoreUnavailable(f"{self.url}: {exc}") from exc
            raise TierError(f"{self.url}: {exc}") from exc

    def _path(self, key: str) -> Path:
        key = key.rstrip("/")
        parts = key.split("/") if key else []
        if any(p in ("", ".", "..") for p in parts):
            raise TierError(f"invalid key {key!r}")
        return self.root.joinpath(*parts)

    async def check(self) -> None:
        def probe() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f"{TMP_MARK}probe.{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()

        try:
            await self._run(probe)
        except (StoreUnavailable, TierError) as exc:
            raise TierError(f"store {self.url} is not usable: {exc.__cause__ or exc}") from None

    async def cleanup(self, keys_of_ours: set[str]) -> int:
        def sweep() -> int:
            removed = 0
            for dirpath, dirnames, filenames in os.walk(self.root):
                for name in filenames + dirnames:
                    if TMP_MARK in name and name.startswith("."):
                        target = name[1:name.index(TMP_MARK)]
                        rel = os.path.relpath(os.path.join(dirpath, target), self.root)
                        if rel in keys_of_ours:
                            os.unlink(os.path.join(dirpath, name))
                            removed += 1
            return removed

        result: int = await self._run(sweep)
        return result

    def _tmp_for(self, path: Path) -> Path:
        return path.with_name(f".{path.name}{TMP_MARK}{secrets.token_hex(6)}")

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None,
    ) -> str | None:
        path = self._path(key)
        await self._run(lambda: path.parent.mkdir(parents=True, exist_ok=True))
        tmp = self._tmp_for(path)
        src_fd = await self._run(os.open, source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            dst_fd = await self._run(os.open, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                done = 0
                while done < size:
                    n = await self._run(_copy_chunk, src_fd, dst_fd, done, min(CHUNK, size - done))
                    if n == 0:
                        raise TierError(f"{source} is shorter than {size} bytes")
                    done += n
                    if progress:
                        progress(n)
                await self._run(_finish, dst_fd, meta)
            finally:
                os.close(dst_fd)
            await self._run(_publish, tmp, path)
            published: os.stat_result = await self._run(os.stat, path)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_unlink_quiet, tmp)
            raise
        finally:
            os.close(src_fd)
        return _tag(published)

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        path = self._path(key)

        def make() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if meta.kind is Kind.DIRECTORY:
                if path.is_symlink() or (path.exists() and not path.is_dir()):
                    path.unlink()
                path.mkdir(exist_ok=True)
                os.chmod(path, stat.S_IMODE(meta.mode))
                os.utime(path, ns=(meta.mtime_ns, meta.mtime_ns))
                _chown(path, meta)
            else:
                tmp = self._tmp_for(path)
                os.symlink(meta.target or "", tmp)
                _chown(tmp, meta)
                os.utime(tmp, ns=(meta.mtime_ns, meta.mtime_ns), follow_symlinks=False)
                _publish(tmp, path)

        await self._run(make)

    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        path = self._path(key)

        def copy() -> int:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                done = 0
                in_kernel = True
                while done < length:
                    if in_kernel:
                        # No trip through user space (and a reflink where the filesystem can).
                        try:
                            n = os.copy_file_range(src, fd, length - done, offset + done,
                                                   fd_offset + done)
                        except OSError as exc:
                            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                                raise LocalWriteFailed(exc.errno, f"writing fetched data "
                                                       f"locally: {exc}") from exc
                            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                                                 errno.EOPNOTSUPP, errno.EBADF):
                                raise
                            in_kernel = False
                            continue
                        if n == 0:
                            break
                        done += n
                        continue
                    chunk = os.pread(src, min(CHUNK, length - done), offset + done)
                    if not chunk:
                        break
                    done += write_local(fd, chunk, fd_offset + done)
                return done
            finally:
                os.close(src)

        result: int = await self._run(copy)
        return result

    async def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        result: ObjectInfo = await self._run(_info, path, key.rstrip("/"))
        return result

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        def walk() -> list[ObjectInfo]:
            found = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                rel_dir = os.path.relpath(dirpath, self.root)
                rel_dir = "" if rel_dir == "." else rel_dir + "/"
                for name in sorted(dirnames + filenames):
                    if TMP_MARK in name:
                        continue
                    key = rel_dir + name
                    try:
                        info = _info(Path(dirpath) / name, key)
                    except FileNotFoundError:
                        continue  # removed while we walked
                    if info.key.startswith(prefix):
                        found.append(info)
            return sorted(found, key=lambda i: i.key)

        result: list[ObjectInfo] = await self._run(walk)
        return result

    async def list_dir(self, prefix: str) -> builtins.list[ObjectInfo]:
        directory = self._path(prefix) if prefix else self.root

        def scan() -> list[ObjectInfo]:
            found = []
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                return []
            for entry in entries:
                if TMP_MARK in entry.name:
                    continue
                try:
                    found.append(_info(Path(entry.path), prefix + entry.name))
                except FileNotFoundError:
                    continue  # removed while we scanned
            return sorted(found, key=lambda i: i.key)

        result: list[ObjectInfo] = await self._run(scan)
        return result

    async def copy(self, src: str, dst: str) -> None:
        src_path, dst_path = self._path(src), self._path(dst)

        def do_copy() -> None:
            dst_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp_for(dst_path)
            if src_path.is_symlink():
                os.symlink(os.readlink(src_path), tmp)
            else:
                try:
                    os.link(src_path, tmp)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                        raise
                    _full_copy(src_path, tmp)
            _publish(tmp, dst_path)

        await self._run(do_copy)

    async def delete(self, key: str) -> None:
        path = self._path(key)

        def remove() -> None:
            try:
                if key.endswith("/"):
                    os.rmdir(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    # The deletions of its old children are still queued: try again later.
                    raise StoreUnavailable(f"{self.url}: {key} is not empty yet") from None
                # A file key that is now a directory (or the reverse) names something else,
                # not ours to delete. (An object store keeps "x" and "x/" apart; a tree cannot.)
                if exc.errno not in (errno.ENOTDIR, errno.EISDIR):
                    raise

        await self._run(remove)


    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        path = self._path(key)
        tmp = self._tmp_for(path)

        def put() -> str:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                # Its tag, before anyone can see it: once published it may be swapped away.
                tag = _small_tag_of(os.fstat(f.fileno()), data)
            try:
                if if_tag is not None:
                    _swap_small(path, tmp, if_tag)
                elif if_absent:
                    try:
                        os.link(tmp, path)  # atomic create-if-absent, also over NFS
                    except FileExistsError:
                        raise PreconditionFailed(f"{self.url}: {key}: exists") from None
                else:
                    os.replace(tmp, path)
            finally:
                _unlink_quiet(tmp)
            return tag

        tag: str = await self._run(put)
        return tag

    async def get_small(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)

        def get() -> tuple[bytes, str]:
            with open(path, "rb") as f:
                data = f.read()
                return data, _small_tag_of(os.fstat(f.fileno()), data)

        result: tuple[bytes, str] = await self._run(get)
        return result


def _small_tag_of(st: os.stat_result, data: bytes) -> str:
    # The inode and a checksum of the body, not times: renames and links move ctime, and an
    # inode number can be reused by the next version, whose body differs (it says so).
    return f"{st.st_ino:x}-{crc32c.crc32c(data):08x}"


def _small_tag(path: Path) -> str:
    with open(path, "rb") as f:
        return _small_tag_of(os.fstat(f.fileno()), f.read())


def _swap_small(path: Path, new: Path, expected: str) -> None:
    """Replace ``path`` by ``new`` only if its tag is ``expected``, atomically against other
    nodes doing the same: the old file is first renamed aside, which only one of them can do."""
    aside = path.with_name(f".{path.name}{TMP_MARK}swap.{secrets.token_hex(6)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        raise PreconditionFailed(f"{path}: missing") from None
    try:
        if _small_tag(aside) != expected:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)  # put it back, unless somebody created a new one
            raise PreconditionFailed(f"{path}: changed")
        try:
            os.link(new, path)
        except FileExistsError:
            raise PreconditionFailed(f"{path}: created meanwhile") from None
    finally:
        _unlink_quiet(aside)


def _copy_chunk(src: int, dst: int, offset: int, length: int) -> int:
    data = os.pread(src, length, offset)
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(dst, view[written:], offset + written)
    return len(data)


def _finish(fd: int, meta: ObjectMeta) -> None:
    os.fchmod(fd, stat.S_IMODE(meta.mode))
    if os.geteuid() == 0:
        os.fchown(fd, meta.uid, meta.gid)
    for name, value in ((_XATTR_CHECKSUM, meta.checksum), (_XATTR_BLOCKS, meta.blocks)):
        if not value:
            continue
        try:
            os.setxattr(fd, name, value.encode())
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.ENOSPC,
                                 errno.E2BIG):
                raise
    os.utime(fd, ns=(meta.mtime_ns, meta.mtime_ns))
    os.fsync(fd)


def _publish(tmp: Path, path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        try:
            os.rmdir(path)  # a file replaces an (empty) directory of the same name
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                # The old directory's children are still queued for deletion: retry later.
                raise StoreUnavailable(f"{path} is still a directory with entries") from None
            raise
    os.replace(tmp, path)
    if os.path.lexists(tmp):
        # tmp and path were hard links to one file (a move redone after a crash): rename(2)
        # then does nothing, successfully.
        os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _full_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(CHUNK):
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    st = os.stat(src)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_mtime_ns, st.st_mtime_ns))
    for name in (_XATTR_CHECKSUM, _XATTR_BLOCKS):
        try:
            os.setxattr(dst, name, os.getxattr(src, name))
        except OSError:
            pass


def _chown(path: Path, meta: ObjectMeta) -> None:
    if os.geteuid() == 0:
        os.chown(path, meta.uid, meta.gid, follow_symlinks=False)


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _info(path: Path, key: str) -> ObjectInfo:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        meta = ObjectMeta(Kind.SYMLINK, 0o777, st.st_mtime_ns, st.st_uid, st.st_gid, None, target)
        return ObjectInfo(key, len(target), meta, etag=_tag(st))
    if stat.S_ISDIR(st.st_mode):
        meta = ObjectMeta(Kind.DIRECTORY, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_uid,
                          st.st_gid)
        return ObjectInfo(key + "/", 0, meta, etag=_tag(st))
    try:
        checksum: str | None = os.getxattr(path, _XATTR_CHECKSUM).decode()
    except OSError:
        checksum = None
    try:
        blocks: str | None = os.getxattr(path, _XATTR_BLOCKS).decode()
    except OSError:
        blocks = None
    meta = ObjectMeta(Kind.FILE, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_uid, st.st_gid,
                      checksum, blocks=blocks)
    return ObjectInfo(key, st.st_size, meta, etag=_tag(st))


def _tag(st: os.stat_result) -> str:
    # A rewrite is a new inode (tmp + rename); an in-place change moves mtime or ctime.
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ctime_ns:x}"
