"""``file:///path``: a directory on a parallel filesystem (Lustre, GPFS, NFS, ...).

The tree under the root mirrors the mount: files are files, symlinks are symlinks, directories
are directories. Mode, mtime and (as root) owner are set on the entry itself; the checksum goes
in the ``user.ckptfs.checksum`` xattr where the filesystem supports xattrs.

Invariants:
- A put writes ``.<name>.ckptfs-tmp.<random>`` next to the target, fsyncs it, then renames it
  over the target and fsyncs the directory: readers never see a partial file. Temporary names
  are never listed and are removed when a put fails or is cancelled.
- Copy is a hard link where the filesystem allows it (a rename on the store costs no data
  copy), a streamed copy otherwise. The source is opened once; a pinned copy (``if_etag``)
  checks the tag on that open inode and links or reads that inode, so what lands is the
  version the caller named even if a put renames a new one over the source meanwhile.
- An object's tag (``_tag``) is its inode, size, mtime, mode and owner, never ctime: copying
  an object (a hard link) must not change its tag.
- All blocking I/O runs in worker threads in chunks, so cancellation is seen between chunks.
- Nothing beneath the root is reached through a symlink. Anyone who can write the store could
  plant one (``step_1 -> /etc``), and ckptfs often runs as root: following it would write, read
  or delete outside the store. So every operation opens the root (which the admin configured,
  and which may itself be a symlink), then each component of the key beneath the previous one
  with ``O_NOFOLLOW`` and ``dir_fd``, and acts on the leaf with ``*at`` calls relative to its
  parent's fd (``O_NOFOLLOW`` opens, ``renameat``, ``unlinkat``, ``linkat`` without
  ``AT_SYMLINK_FOLLOW``, ``mkdirat``). A symlink where a key needs a directory, or where it
  needs a file to read, is ``SymlinkInStore`` (a permanent ``TierError``); a listing reports a
  symlink as a symlink entry and never descends into it. Symlinks that are objects of the mount
  (``latest -> step_9``) are still stored, listed, copied and deleted as the links themselves.
- Only regular files are read as objects: a FIFO or device planted in the store is refused
  (opened ``O_NONBLOCK``, so that it cannot hang a worker thread first).
- The directory fds are opened per call (a few ``openat`` per operation, none per byte).
"""

from __future__ import annotations

import builtins
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import crc32c
import trio

from ckptfs.errors import StoreUnavailable
from ckptfs.store.tiers.base import (
    Finish,
    Kind,
    LocalWriteFailed,
    NotEmptyYet,
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
_XATTR_STAMP = "user.ckptfs.stamp"
# On the empty regular file that stands for a special file: "<st_mode in octal>:<rdev>".
# Never the real special file in the store (tiers/base.py): a FIFO there would block a
# reader of the store, a device node would open a device wherever the store is not nodev.
_XATTR_SPECIAL = "user.ckptfs.special"
_TRANSIENT = {errno.EIO, errno.ETIMEDOUT, errno.ENOTCONN, errno.ESTALE, errno.EAGAIN,
              errno.ENOSPC, errno.EDQUOT, errno.EHOSTDOWN, errno.ECONNRESET}
# A directory beneath the root: never through a symlink (O_NOFOLLOW; with O_DIRECTORY a
# symlink fails with ENOTDIR, a missing name with ENOENT).
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# An object to read: a symlink fails with ELOOP; O_NONBLOCK so that a FIFO cannot block the
# open (it has no effect on regular files, the only kind read).
_READ_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_OPEN = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class SymlinkInStore(TierError):
    """A symlink inside the store stands where a key needs a directory (or a file to read):
    ckptfs never follows one, whatever it points to."""


class FileTier(Tier):
    def __init__(self, name: str, url: str, root: Path,
                 limiter: trio.CapacityLimiter | None = None) -> None:
        super().__init__(name, url)
        self.root = root
        self._limiter = limiter or trio.CapacityLimiter(8)

    async def _run(self, fn: Callable[..., T], *args: Any, key: str | None = None) -> T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except FileNotFoundError as exc:
            raise ObjectMissing(key if key is not None else str(exc.filename)) from exc
        except OSError as exc:
            if exc.errno in _TRANSIENT:
                raise StoreUnavailable(f"{self.url}: {exc}") from exc
            raise TierError(f"{self.url}: {exc}") from exc

    # -- resolving keys beneath the root, never through a symlink ---------------------------

    def _parts(self, key: str) -> list[str]:
        key = key.rstrip("/")
        parts = key.split("/") if key else []
        if any(p in ("", ".", "..") for p in parts):
            raise TierError(f"invalid key {key!r}")
        return parts

    def _split(self, key: str) -> tuple[list[str], str]:
        """The parent directories of ``key`` and its own name."""
        parts = self._parts(key)
        if not parts:
            raise TierError(f"invalid key {key!r}")
        return parts[:-1], parts[-1]

    def _open_root(self, create: bool) -> int:
        # The root itself is the admin's choice and may be a symlink (to a Lustre mount, say):
        # it is the one path that is followed.
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
        self.root.mkdir(parents=True, exist_ok=True)
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _open_dir(self, parts: list[str], create: bool) -> int:
        """An fd of the directory ``root/parts``, each component opened beneath the previous
        one; with ``create``, missing ones are made. The caller closes it."""
        fd = self._open_root(create)
        try:
            for depth, name in enumerate(parts):
                where = "/".join(parts[:depth + 1])
                try:
                    child = _open_subdir(fd, name, where)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)  # the umask decides, as mkdir -p
                    except FileExistsError:
                        pass  # made meanwhile (another put, another node): use it
                    child = _open_subdir(fd, name, where)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_object(self, key: str) -> int:
        """An fd reading the regular file at ``key``. The caller closes it."""
        parents, name = self._split(key)
        dir_fd = self._open_dir(parents, create=False)
        try:
            return _open_leaf(dir_fd, name, key)
        finally:
            os.close(dir_fd)

    async def open_object(self, key: str) -> int:
        """An fd reading the object at ``key`` (transfer.py copies from it); caller closes."""
        fd: int = await self._run(self._open_object, key, key=key)
        return fd

    # -- the Tier interface ------------------------------------------------------------------

    async def check(self) -> None:
        def probe() -> None:
            root_fd = self._open_dir([], create=True)
            try:
                name = f"{TMP_MARK}probe.{secrets.token_hex(4)}"
                os.close(os.open(name, _CREATE_OPEN, 0o600, dir_fd=root_fd))
                os.unlink(name, dir_fd=root_fd)
            finally:
                os.close(root_fd)

        try:
            await self._run(probe)
        except (StoreUnavailable, TierError) as exc:
            raise TierError(f"store {self.url} is not usable: {exc.__cause__ or exc}") from None

    async def cleanup(self, keys_of_ours: set[str]) -> int:
        def sweep() -> int:
            removed = 0
            try:
                root_fd = self._open_dir([], create=False)
            except FileNotFoundError:
                return 0
            try:
                for rel_dir, dir_fd, entries in _walk(root_fd):
                    for entry in entries:
                        name = entry.name
                        if TMP_MARK in name and name.startswith(".") \
                                and _tmp_target(name, rel_dir, keys_of_ours):
                            _unlink_quiet_at(dir_fd, name)
                            removed += 1
            finally:
                os.close(root_fd)
            return removed

        result: int = await self._run(sweep)
        return result

    @property
    def late_meta(self) -> bool:
        return True  # the checksums are xattrs set once the bytes are in (``_finish``)

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None, *, finish: Finish | None = None,
    ) -> str | None:
        parents, name = self._split(key)
        tmp = _tmp_name(name)
        # Held for the whole put: the temporary file, the rename and the fsync all happen in
        # this directory, whatever is renamed or planted along the path meanwhile.
        dir_fd = await self._run(self._open_dir, parents, True, key=key)
        try:
            src_fd = await self._run(os.open, source, os.O_RDONLY | os.O_CLOEXEC)
            try:
                dst_fd = await self._run(_create_at, dir_fd, tmp, 0o600)
                try:
                    done = 0
                    while done < size:
                        if self.pace is not None:
                            await self.pace()  # the job is busy: the next chunk waits for it
                        n = await self._run(_copy_chunk_out, src_fd, dst_fd, done,
                                            min(CHUNK, size - done))
                        if n == 0:
                            raise TierError(f"{source} is shorter than {size} bytes")
                        done += n
                        if progress:
                            progress(n)
                    if finish is not None:
                        meta = await finish()
                    await self._run(_finish, dst_fd, meta)
                finally:
                    os.close(dst_fd)
                await self._run(_publish, dir_fd, tmp, name, key)
                published: os.stat_result = await self._run(_lstat_at, dir_fd, name)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_unlink_quiet_at, dir_fd, tmp)
                raise
            finally:
                os.close(src_fd)
        finally:
            os.close(dir_fd)
        return _tag(published)

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        parents, name = self._split(key)

        def make() -> None:
            dir_fd = self._open_dir(parents, create=True)
            try:
                if meta.kind is Kind.DIRECTORY:
                    _make_directory(dir_fd, name, key, meta)
                elif meta.kind is Kind.SPECIAL:
                    _make_special(dir_fd, name, key, meta)
                else:
                    tmp = _tmp_name(name)
                    os.symlink(meta.target or "", tmp, dir_fd=dir_fd)
                    try:
                        if os.geteuid() == 0:
                            os.chown(tmp, meta.uid, meta.gid, dir_fd=dir_fd,
                                     follow_symlinks=False)
                        os.utime(tmp, ns=(meta.mtime_ns, meta.mtime_ns), dir_fd=dir_fd,
                                 follow_symlinks=False)
                        _publish(dir_fd, tmp, name, key)
                    except BaseException:
                        _unlink_quiet_at(dir_fd, tmp)
                        raise
            finally:
                os.close(dir_fd)

        await self._run(make, key=key)

    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        def copy() -> int:
            src = self._open_object(key)
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

        result: int = await self._run(copy, key=key)
        return result

    async def head(self, key: str) -> ObjectInfo:
        parents, name = self._split(key)

        def stat_it() -> ObjectInfo:
            dir_fd = self._open_dir(parents, create=False)
            try:
                return _info(dir_fd, name, key.rstrip("/"))
            finally:
                os.close(dir_fd)

        result: ObjectInfo = await self._run(stat_it, key=key)
        return result

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        def walk() -> list[ObjectInfo]:
            found = []
            try:
                root_fd = self._open_dir([], create=False)
            except FileNotFoundError:
                return []

            def wanted(dir_key: str) -> bool:
                # Only directories that can hold keys starting with the prefix.
                return dir_key.startswith(prefix) or prefix.startswith(dir_key)

            try:
                for rel_dir, dir_fd, entries in _walk(root_fd, wanted):
                    for entry in sorted(entries, key=lambda e: e.name):
                        if TMP_MARK in entry.name:
                            continue
                        if not (rel_dir + entry.name + "/").startswith(prefix):
                            continue  # no stat of what cannot match (a directory's key ends in /)
                        try:
                            info = _info(dir_fd, entry.name, rel_dir + entry.name)
                        except FileNotFoundError:
                            continue  # removed while we walked
                        if info.key.startswith(prefix):
                            found.append(info)
            finally:
                os.close(root_fd)
            return sorted(found, key=lambda i: i.key)

        result: list[ObjectInfo] = await self._run(walk)
        return result

    async def list_dir(self, prefix: str) -> builtins.list[ObjectInfo]:
        parts = self._parts(prefix)

        def scan() -> list[ObjectInfo]:
            found = []
            try:
                dir_fd = self._open_dir(parts, create=False)
            except (FileNotFoundError, NotADirectoryError, SymlinkInStore):
                return []  # nothing beneath the root there (a symlink is not followed)
            try:
                with os.scandir(dir_fd) as it:
                    names = [entry.name for entry in it]
                for name in names:
                    if TMP_MARK in name:
                        continue
                    try:
                        found.append(_info(dir_fd, name, prefix + name))
                    except FileNotFoundError:
                        continue  # removed while we scanned
            finally:
                os.close(dir_fd)
            return sorted(found, key=lambda i: i.key)

        result: list[ObjectInfo] = await self._run(scan)
        return result

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        src_parents, src_name = self._split(src)
        dst_parents, dst_name = self._split(dst)

        def do_copy() -> str:
            src_dir = self._open_dir(src_parents, create=False)
            try:
                dst_dir = self._open_dir(dst_parents, create=True)
                try:
                    tmp = _tmp_name(dst_name)
                    try:
                        st = os.stat(src_name, dir_fd=src_dir, follow_symlinks=False)
                        if stat.S_ISLNK(st.st_mode):
                            # The link itself (an object of the mount), not what it names;
                            # the same link before and after reading it is that version.
                            _check_tag(st, if_etag, src)
                            target = os.readlink(src_name, dir_fd=src_dir)
                            again = os.stat(src_name, dir_fd=src_dir, follow_symlinks=False)
                            _check_tag(again, _tag(st), src)
                            os.symlink(target, tmp, dir_fd=dst_dir)
                        else:
                            # Opened once: the tag is checked on the inode that is then
                            # linked or read, whatever is renamed over ``src`` meanwhile.
                            try:
                                fd = _open_leaf(src_dir, src_name, src)
                            except PermissionError:
                                # Unreadable to this (non-root) daemon: link by name, then
                                # check the inode that was linked.
                                os.link(src_name, tmp, src_dir_fd=src_dir, dst_dir_fd=dst_dir,
                                        follow_symlinks=False)
                                linked = _lstat_at(dst_dir, tmp)
                                if not stat.S_ISREG(linked.st_mode):
                                    raise TierError(f"{src} is not a regular file in the store")
                                _check_tag(linked, if_etag, src)
                                _publish(dst_dir, tmp, dst_name, dst)
                                return _tag(_lstat_at(dst_dir, dst_name))
                            try:
                                _check_tag(os.fstat(fd), if_etag, src)
                                _copy_open(fd, dst_dir, tmp)
                            finally:
                                os.close(fd)
                        _publish(dst_dir, tmp, dst_name, dst)
                        return _tag(_lstat_at(dst_dir, dst_name))
                    except BaseException:
                        _unlink_quiet_at(dst_dir, tmp)
                        raise
                finally:
                    os.close(dst_dir)
            finally:
                os.close(src_dir)

        tag: str = await self._run(do_copy, key=src)
        return tag

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        parents, name = self._split(key)

        def remove() -> None:
            try:
                dir_fd = self._open_dir(parents, create=False)
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing there (a file where a directory was: not ours either)
            try:
                if if_etag is not None:
                    # Only the version named (the check and the unlink are two calls: the
                    # base class says what the rare write between them costs).
                    _check_tag(_lstat_at(dir_fd, name), if_etag, key)
                if key.endswith("/"):
                    os.rmdir(name, dir_fd=dir_fd)
                else:
                    os.unlink(name, dir_fd=dir_fd)  # a symlink itself, never what it names
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    # The deletions of its old children are still queued: try again later.
                    raise NotEmptyYet(f"{self.url}: {key} is not empty yet") from None
                # A file key that is now a directory (or the reverse) names something else,
                # not ours to delete. (An object store keeps "x" and "x/" apart; a tree cannot.)
                if exc.errno not in (errno.ENOTDIR, errno.EISDIR):
                    raise
            finally:
                os.close(dir_fd)

        await self._run(remove, key=key)

    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        parents, name = self._split(key)

        def put() -> str:
            dir_fd = self._open_dir(parents, create=True)
            tmp = _tmp_name(name)
            try:
                fd = _create_at(dir_fd, tmp, 0o666)  # the umask decides, as open() did
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                    # Its tag, before anyone can see it: once published it may be swapped away.
                    tag = _small_tag_of(os.fstat(fd), data)
                finally:
                    os.close(fd)
                if if_tag is not None:
                    _swap_small(dir_fd, name, tmp, if_tag, key)
                elif if_absent:
                    try:
                        # Atomic create-if-absent, also over NFS.
                        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                                follow_symlinks=False)
                    except FileExistsError:
                        raise PreconditionFailed(f"{self.url}: {key}: exists") from None
                else:
                    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                return tag
            finally:
                _unlink_quiet_at(dir_fd, tmp)
                os.close(dir_fd)

        tag: str = await self._run(put, key=key)
        return tag

    async def get_small(self, key: str) -> tuple[bytes, str]:
        def get() -> tuple[bytes, str]:
            fd = self._open_object(key)
            try:
                return _read_tagged(fd)
            finally:
                os.close(fd)

        result: tuple[bytes, str] = await self._run(get, key=key)
        return result


# -- helpers working relative to a directory fd ------------------------------------------------


# A temporary name whose target's name had to be cut to fit NAME_MAX says so after the mark.
_CUT = "cut."
_NAME_MAX = 255


def _tmp_name(name: str) -> str:
    """``.<name>.ckptfs-tmp.<hex>``, or for a name too long for that (a 255-byte name would
    make a 281-byte one: ENAMETOOLONG, an upload retried forever) the longest prefix of the
    name that fits, marked ``cut.`` (``cleanup`` then matches by prefix)."""
    suffix = secrets.token_hex(6)
    whole = f".{name}{TMP_MARK}{suffix}"
    if len(os.fsencode(whole)) <= _NAME_MAX:
        return whole
    room = _NAME_MAX - len(os.fsencode(f".{TMP_MARK}{_CUT}{suffix}"))
    prefix = os.fsdecode(os.fsencode(name)[:room])
    return f".{prefix}{TMP_MARK}{_CUT}{suffix}"


def _tmp_target(tmp: str, rel_dir: str, keys: set[str]) -> bool:
    """Whether the temporary file ``tmp`` in ``rel_dir`` was written for one of ``keys``."""
    stem, _, rest = tmp[1:].partition(TMP_MARK)
    if not rest.startswith(_CUT):
        return rel_dir + stem in keys
    # A cut name: any of ours with that prefix (in this directory) may be its target.
    return any(k.startswith(rel_dir + stem) and "/" not in k[len(rel_dir):] for k in keys)


def _is_symlink_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_subdir(dir_fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, _DIR_OPEN, dir_fd=dir_fd)
    except NotADirectoryError:
        # O_DIRECTORY | O_NOFOLLOW fails the same way on a file and on a symlink: tell them
        # apart (only on this error path) for the message.
        if _is_symlink_at(dir_fd, name):
            raise SymlinkInStore(f"{where} is a symlink inside the store: not followed") from None
        raise


def _open_leaf(dir_fd: int, name: str, key: str) -> int:
    try:
        fd = os.open(name, _READ_OPEN, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkInStore(f"{key} is a symlink inside the store: not followed") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise TierError(f"{key} is not a regular file in the store")
    return fd


def _walk(root_fd: int, wanted: Callable[[str], bool] = lambda _: True
          ) -> Iterator[tuple[str, int, list[os.DirEntry[str]]]]:
    """``(rel_dir, dir_fd, entries)`` for the root and every directory beneath it whose key
    ``wanted`` accepts (``rel_dir`` is "" or "a/b/"). Each directory is opened beneath its
    parent's fd with ``O_NOFOLLOW``: a symlink is an entry, never descended into."""
    stack = [("", os.dup(root_fd))]
    try:
        while stack:
            rel_dir, dir_fd = stack.pop()
            try:
                with os.scandir(dir_fd) as it:
                    entries = list(it)
                yield rel_dir, dir_fd, entries
                for entry in entries:
                    # d_type, or an fstatat beneath dir_fd: neither follows a symlink.
                    if TMP_MARK in entry.name or not entry.is_dir(follow_symlinks=False):
                        continue
                    child_key = rel_dir + entry.name + "/"
                    if not wanted(child_key):
                        continue
                    try:
                        child = os.open(entry.name, _DIR_OPEN, dir_fd=dir_fd)
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # removed, or swapped for a file or a symlink, since the scan
                    stack.append((child_key, child))
            finally:
                os.close(dir_fd)
    finally:
        for _, fd in stack:
            os.close(fd)


def _create_at(dir_fd: int, name: str, mode: int) -> int:
    return os.open(name, _CREATE_OPEN, mode, dir_fd=dir_fd)


def _lstat_at(dir_fd: int, name: str) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _unlink_quiet_at(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _getxattr_at(dir_fd: int, name: str, attr: str) -> bytes:
    # getxattr has no *at form. /proc/self/fd/N is the directory we hold open (not a path
    # resolved again), and follow_symlinks=False (lgetxattr) does not follow the leaf; no
    # open() either, which costs a metadata round trip on Lustre or NFS.
    return os.getxattr(f"/proc/self/fd/{dir_fd}/{name}", attr, follow_symlinks=False)


def _make_directory(dir_fd: int, name: str, key: str, meta: ObjectMeta) -> None:
    try:
        st: os.stat_result | None = _lstat_at(dir_fd, name)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)  # a file or symlink (the link itself) made way
    try:
        os.mkdir(name, 0o777, dir_fd=dir_fd)
    except FileExistsError:
        pass
    fd = _open_subdir(dir_fd, name, key.rstrip("/"))
    try:
        os.fchmod(fd, stat.S_IMODE(meta.mode))
        if meta.stamp:
            # Which node put it (peers.py): its writer is told if another node removes it.
            try:
                os.setxattr(fd, _XATTR_STAMP, meta.stamp.encode())
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM,
                                     errno.ENOSPC, errno.E2BIG):
                    raise
        os.utime(fd, ns=(meta.mtime_ns, meta.mtime_ns))
        if os.geteuid() == 0:
            os.fchown(fd, meta.uid, meta.gid)
    finally:
        os.close(fd)


def _make_special(dir_fd: int, name: str, key: str, meta: ObjectMeta) -> None:
    """The marker of a special file at ``name``: an empty regular file carrying its type and
    device number in an xattr, published like a file (tmp + rename: atomic)."""
    tmp = _tmp_name(name)
    fd = os.open(tmp, _CREATE_OPEN, 0o600, dir_fd=dir_fd)
    try:
        try:
            # Unlike a file's checksum, this xattr is the entry itself: without it the marker
            # would read back as an empty file, so a store that refuses it fails the put.
            os.setxattr(fd, _XATTR_SPECIAL, f"{meta.mode:o}:{meta.rdev}".encode())
            # Only the permission bits: the marker is a plain file, never set-id.
            _finish(fd, ObjectMeta(Kind.FILE, meta.mode & 0o777, meta.mtime_ns, meta.uid,
                                   meta.gid))
        finally:
            os.close(fd)
        _publish(dir_fd, tmp, name, key)
    except BaseException:
        _unlink_quiet_at(dir_fd, tmp)
        raise


def _special_meta(dir_fd: int, name: str, st: os.stat_result) -> ObjectMeta | None:
    """The meta of a special file's marker (an empty file with ``_XATTR_SPECIAL``), or None
    when ``name`` is an ordinary file (or the xattr is unreadable: then it is one)."""
    if st.st_size != 0:
        return None
    try:
        raw = _getxattr_at(dir_fd, name, _XATTR_SPECIAL).decode()
        mode_text, rdev_text = raw.split(":", 1)
        mode, rdev = int(mode_text, 8), int(rdev_text)
    except (OSError, ValueError):
        return None
    return ObjectMeta(Kind.SPECIAL, mode, st.st_mtime_ns, st.st_uid, st.st_gid, rdev=rdev)


def _small_tag_of(st: os.stat_result, data: bytes) -> str:
    # The inode and a checksum of the body, not times: renames and links move ctime, and an
    # inode number can be reused by the next version, whose body differs (it says so).
    return f"{st.st_ino:x}-{crc32c.crc32c(data):08x}"


def _read_tagged(fd: int) -> tuple[bytes, str]:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    data = b"".join(chunks)
    return data, _small_tag_of(os.fstat(fd), data)


def _swap_small(dir_fd: int, name: str, new: str, expected: str, key: str) -> None:
    """Replace ``name`` by ``new`` only if its tag is ``expected``, atomically against other
    nodes doing the same: the old file is first renamed aside, which only one of them can do."""
    aside = f".{name}{TMP_MARK}swap.{secrets.token_hex(6)}"
    try:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        raise PreconditionFailed(f"{key}: missing") from None
    try:
        try:
            fd = _open_leaf(dir_fd, aside, key)
            try:
                actual = _read_tagged(fd)[1]
            finally:
                os.close(fd)
        except BaseException:
            _put_back(dir_fd, aside, name)  # not ours to judge (a planted symlink): restore it
            raise
        if actual != expected:
            _put_back(dir_fd, aside, name)
            raise PreconditionFailed(f"{key}: changed")
        try:
            os.link(new, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            raise PreconditionFailed(f"{key}: created meanwhile") from None
    finally:
        _unlink_quiet_at(dir_fd, aside)


def _put_back(dir_fd: int, aside: str, name: str) -> None:
    try:
        # Unless somebody created a new one meanwhile. No AT_SYMLINK_FOLLOW: a link links.
        os.link(aside, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass


# copy_file_range(2) refuses some pairs of files (another filesystem: EXDEV, since Linux
# 5.19; a filesystem without it: EOPNOTSUPP/ENOSYS/EINVAL); sendfile(2) copies between any
# two files in the kernel too. Either way no byte passes through this process.
_NO_COPY_RANGE = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EPERM}


def _copy_chunk(src: int, dst: int, offset: int, length: int) -> int:
    """Copy up to ``length`` bytes at ``offset`` of ``src`` to the same offset of ``dst``,
    in the kernel (a reflink where the filesystem can share extents); the bytes copied, 0 at
    the end of ``src``. The destination's file position is left at the end of the copy."""
    try:
        return os.copy_file_range(src, dst, length, offset, offset)
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise
    os.lseek(dst, offset, os.SEEK_SET)
    try:
        return os.sendfile(dst, src, offset, length)
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise
    data = os.pread(src, length, offset)
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(dst, view[written:], offset + written)
    return len(data)


def _copy_chunk_out(src: int, dst: int, offset: int, length: int) -> int:
    """``_copy_chunk``, then the device starts writing what it copied while the next chunk is
    copied (``POSIX_FADV_DONTNEED`` starts the writeback of dirty pages, and drops the pages
    once clean: nobody reads the store's copy soon). The fsync at the end then waits for the
    tail only, not for the whole file."""
    n = _copy_chunk(src, dst, offset, length)
    if n:
        try:
            os.posix_fadvise(dst, offset, n, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only: a filesystem that cannot take it is written at the fsync
    return n


def _finish(fd: int, meta: ObjectMeta) -> None:
    os.fchmod(fd, stat.S_IMODE(meta.mode))
    if os.geteuid() == 0:
        os.fchown(fd, meta.uid, meta.gid)
    for name, value in ((_XATTR_CHECKSUM, meta.checksum), (_XATTR_BLOCKS, meta.blocks),
                        (_XATTR_STAMP, meta.stamp)):
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


def _publish(dir_fd: int, tmp: str, name: str, key: str) -> None:
    """Rename ``tmp`` over ``name`` (both in ``dir_fd``) and make that durable."""
    try:
        st: os.stat_result | None = _lstat_at(dir_fd, name)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        try:
            os.rmdir(name, dir_fd=dir_fd)  # a file replaces an (empty) directory of the same name
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                # The old directory's children are still queued for deletion: retry later.
                raise NotEmptyYet(f"{key} is still a directory with entries") from None
            raise
    # rename(2) replaces a symlink at ``name`` itself; it never follows it.
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    # tmp and name were hard links to one file (a move redone after a crash): rename(2) then
    # does nothing, successfully, and leaves tmp.
    _unlink_quiet_at(dir_fd, tmp)
    os.fsync(dir_fd)


def _check_tag(st: os.stat_result, expected: str | None, key: str) -> None:
    if expected is not None and _tag(st) != expected:
        raise PreconditionFailed(f"{key}: changed (tag {_tag(st)}, expected {expected})")


def _copy_open(fd: int, dst_dir: int, dst_name: str) -> None:
    """Make ``dst_name`` in ``dst_dir`` a copy of the open regular file ``fd``: a hard link to
    its inode where the filesystem allows it (through /proc/self/fd, which names this open
    file, not a path resolved again), a full copy otherwise."""
    try:
        # AT_SYMLINK_FOLLOW on the magic link is how linkat(2) links an open file without
        # CAP_DAC_READ_SEARCH (AT_EMPTY_PATH needs it); nothing in the store is followed.
        os.link(f"/proc/self/fd/{fd}", dst_name, dst_dir_fd=dst_dir, follow_symlinks=True)
        return
    except FileNotFoundError:
        if os.fstat(fd).st_nlink != 0:
            raise
        # Replaced or deleted since it was opened (checked): linkat(2) refuses an inode with
        # no name left, but it is still the version asked for, and readable.
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                             errno.EACCES):
            raise
    _full_copy(fd, dst_dir, dst_name)


def _full_copy(fin: int, dst_dir: int, dst_name: str) -> None:
    fout = os.open(dst_name, _CREATE_OPEN, 0o600, dir_fd=dst_dir)
    try:
        offset = 0
        while n := _copy_chunk(fin, fout, offset, CHUNK):
            offset += n
        st = os.fstat(fin)
        os.fchmod(fout, stat.S_IMODE(st.st_mode))
        if os.geteuid() == 0:
            os.fchown(fout, st.st_uid, st.st_gid)
        for name in (_XATTR_CHECKSUM, _XATTR_BLOCKS, _XATTR_SPECIAL, _XATTR_STAMP):
            try:
                os.setxattr(fout, name, os.getxattr(fin, name))
            except OSError:
                pass
        os.utime(fout, ns=(st.st_mtime_ns, st.st_mtime_ns))
        os.fsync(fout)
    finally:
        os.close(fout)


def _info(dir_fd: int, name: str, key: str) -> ObjectInfo:
    st = _lstat_at(dir_fd, name)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=dir_fd)
        meta = ObjectMeta(Kind.SYMLINK, 0o777, st.st_mtime_ns, st.st_uid, st.st_gid, None, target)
        return ObjectInfo(key, len(target), meta, etag=_tag(st))
    if stat.S_ISDIR(st.st_mode):
        try:
            marker_stamp: str | None = _getxattr_at(dir_fd, name, _XATTR_STAMP).decode()
        except OSError:
            marker_stamp = None
        meta = ObjectMeta(Kind.DIRECTORY, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_uid,
                          st.st_gid, stamp=marker_stamp)
        return ObjectInfo(key + "/", 0, meta, etag=_tag(st))
    special = _special_meta(dir_fd, name, st)
    if special is not None:
        return ObjectInfo(key, 0, special, etag=_tag(st))
    try:
        checksum: str | None = _getxattr_at(dir_fd, name, _XATTR_CHECKSUM).decode()
    except OSError:
        checksum = None
    try:
        blocks: str | None = _getxattr_at(dir_fd, name, _XATTR_BLOCKS).decode()
    except OSError:
        blocks = None
    try:
        stamp: str | None = _getxattr_at(dir_fd, name, _XATTR_STAMP).decode()
    except OSError:
        stamp = None
    meta = ObjectMeta(Kind.FILE, stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_uid, st.st_gid,
                      checksum, blocks=blocks, stamp=stamp)
    return ObjectInfo(key, st.st_size, meta, etag=_tag(st))


def _tag(st: os.stat_result) -> str:
    # A rewrite is a new inode (tmp + rename); an in-place change moves the size or mtime,
    # an in-place chmod/chown the mode or owner. Not ctime: a copy hard-links the source,
    # which moves its ctime, and a source's tag must not change because it was copied (a
    # pinned copy retried after an error would refuse it).
    return (f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_mode:o}-"
            f"{st.st_uid:x}-{st.st_gid:x}")
