"""The one narrow async interface every tier implements (memory, file, S3, fault wrapper).

A tier stores *objects* under *keys*. A key is the path of a file relative to the mount root
(``step_100/model.pt``); the tier adds its own prefix. The store stays a plain tree that
``aws s3 cp``, DCP's own readers or a person can use without ckptfs.

Entry kinds on a tier:
- a file: the object itself, with ``ObjectMeta`` (mode, mtime, uid/gid, checksum);
- a symlink: an object whose body is the target and whose meta says ``kind = symlink``
  (a file tier uses a real symlink);
- an empty directory: the key with a trailing ``/`` (a file tier uses a real directory);
- a special file (FIFO, UNIX socket, character or block device node): an empty object whose
  meta says ``kind = special``, with the file type in ``mode`` (``S_IFIFO | 0o644``) and the
  device number in ``rdev``. A file tier holds the same marker (an empty regular file with
  the meta in xattrs), never the real special file: a device node in a store directory that
  is not mounted ``nodev`` would open the device for anyone allowed to open the marker.

Invariants every implementation keeps (tests/test_tier_contract.py checks them):
- ``put`` is atomic: a reader sees the old object or the whole new one, never a partial one,
  and no temporary name is left behind if it fails or is cancelled.
- Every operation is idempotent (deleting a missing key succeeds), so replaying the journal
  after a crash is always safe.
- Errors are ``StoreUnavailable`` (transient: retry later) or ``TierError`` (permanent);
  ``NotEmptyYet`` (a ``StoreUnavailable``) when a file tier's directory still has entries;
  ``ObjectMissing`` for a missing key; ``PreconditionFailed`` when a conditional operation
  (``put_small`` with ``if_absent``/``if_tag``, ``copy`` or ``delete`` with ``if_etag``)
  finds another version than the one named.
- ``copy`` keeps every piece of metadata (``ObjectMeta``: mode, owner, checksum, block CRCs)
  whatever the object's size, and a pinned copy (``if_etag``) copies that version or fails:
  never a mix of versions, never the bytes of a version written after the caller looked.
- Blocking client calls run in worker threads, never on the trio thread.

Small objects (``put_small``/``get_small``) carry coordination state between the nodes that
mount one store (coordination.py, the retention lease). They live under ``CONTROL_PREFIX`` at
the tier's root, which listings of the mount and retention never show, copy or delete. Their
conditional writes (create-if-absent, replace-if-tag) are atomic: of two nodes racing, exactly
one succeeds and the other gets ``PreconditionFailed``.
"""

from __future__ import annotations

import abc
import builtins
import enum
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

from ckptfs.errors import CkptfsError, NeedsRestore, StoreRefused, StoreUnavailable

# Called with the number of bytes just transferred (progress bars, rates); negative when a
# retry takes them back. A tier may call it from a worker thread: keep it to arithmetic.
Progress = Callable[[int], None]
Pace = Callable[[], Awaitable[None]]
# The meta of an object being put, once its checksums are known (``Tier.put_file``'s finish).
Finish = Callable[[], Awaitable["ObjectMeta"]]


# Keys under this prefix at a tier's root hold ckptfs's own state shared by the nodes
# (registrations, commit barriers, the retention lease): never a file of the mount.
CONTROL_PREFIX = ".ckptfs/"

# Storage classes whose objects must be restored before a GET (GLACIER_IR reads directly).
ARCHIVE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})


class Kind(enum.StrEnum):
    FILE = "file"
    SYMLINK = "symlink"
    DIRECTORY = "dir"
    SPECIAL = "special"


class TierError(StoreRefused):
    """A permanent tier error (bad credentials, missing bucket, invalid key): do not retry."""


class PreconditionFailed(CkptfsError):
    """A conditional write (``put_small``) or a pinned ``copy`` found the object not as the
    caller expected: its tag is not the one given (the key was rewritten meanwhile)."""


class NotEmptyYet(StoreUnavailable):
    """A directory key (file tier) cannot be deleted, or replaced by a file, while entries
    are still under it: an ordering wait for the deletions or moves of those entries, not a
    sign that the store is down (it answered). A ``StoreUnavailable`` so that callers that
    retry transient errors retry it; the uploader tells it apart (no outage gate)."""


class ObjectMissing(CkptfsError):
    """The key does not exist on the tier."""


class LocalWriteFailed(CkptfsError):
    """Writing fetched bytes into the local (staging) file failed: not the store's fault."""

    def __init__(self, errno: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = errno


def write_local(fd: int, data: bytes | memoryview, offset: int) -> int:
    """pwrite all of ``data`` into the reader's file at ``offset`` (``read_into`` helper):
    a local error (a full staging disk) is a LocalWriteFailed, never a store error."""
    view = memoryview(data)
    done = 0
    try:
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as exc:
        raise LocalWriteFailed(exc.errno, f"writing fetched data locally: {exc}") from exc
    return done


class ObjectArchived(NeedsRestore):
    """The object is in an archive storage class and must be restored before reading."""


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What travels with an object so that a fresh node sees the same file."""

    kind: Kind = Kind.FILE
    mode: int = 0o644
    mtime_ns: int = 0
    uid: int = 0
    gid: int = 0
    checksum: str | None = None  # "crc32c:<8 hex digits>" of the whole object
    target: str | None = None  # symlinks
    # Per-block CRC32Cs so that a range read can be verified without the whole object
    # (integrity.py: "<block size>:<base64 of 4-byte big-endian CRCs>").
    blocks: str | None = None
    # A special file's device number (character and block devices; 0 for FIFOs and sockets).
    rdev: int = 0
    # Which node wrote this version and which of its versions it is ("<node>:<run>.<n>",
    # peers.py): records of what other nodes did to an object name it. A copy keeps it.
    stamp: str | None = None

    def to_headers(self) -> dict[str, str]:
        """As S3 user metadata (x-amz-meta-ckptfs-*) or file-tier xattrs."""
        headers = {
            "ckptfs-kind": self.kind.value,
            "ckptfs-mode": f"{self.mode:o}",
            "ckptfs-mtime-ns": str(self.mtime_ns),
            "ckptfs-uid": str(self.uid),
            "ckptfs-gid": str(self.gid),
        }
        if self.checksum:
            headers["ckptfs-checksum"] = self.checksum
        if self.blocks:
            headers["ckptfs-blocks"] = self.blocks
        if self.rdev:
            headers["ckptfs-rdev"] = str(self.rdev)
        if self.stamp:
            # S3 metadata is ASCII: a node id is percent-encoded like a symlink target.
            headers["ckptfs-stamp"] = quote(self.stamp, safe=":._-~")
        if self.target is not None:
            # S3 metadata is ASCII: the target is percent-encoded (its bytes, surrogateescape).
            headers["ckptfs-target"] = quote(self.target.encode("utf-8", "surrogateescape"),
                                             safe="/._-~")
        return headers

    @classmethod
    def from_headers(cls, headers: dict[str, str]) -> ObjectMeta:
        def num(key: str, base: int = 10, default: int = 0, bad: int | None = None) -> int:
            try:
                return int(headers[key], base)
            except KeyError:
                return default
            except ValueError:
                return default if bad is None else bad

        try:
            kind = Kind(headers.get("ckptfs-kind", "file"))
        except ValueError:
            kind = Kind.FILE
        return cls(
            kind=kind,
            mode=num("ckptfs-mode", 8, 0o644),
            mtime_ns=num("ckptfs-mtime-ns"),
            # Unreadable owners are not root: -1, which store/trust.py maps to nobody.
            uid=num("ckptfs-uid", bad=-1),
            gid=num("ckptfs-gid", bad=-1),
            checksum=headers.get("ckptfs-checksum"),
            target=(unquote(headers["ckptfs-target"], errors="surrogateescape")
                    if "ckptfs-target" in headers else None),
            blocks=headers.get("ckptfs-blocks"),
            rdev=num("ckptfs-rdev"),
            stamp=unquote(headers["ckptfs-stamp"]) if "ckptfs-stamp" in headers else None,
        )


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    meta: ObjectMeta = field(default_factory=ObjectMeta)
    storage_class: str = "STANDARD"
    restore_state: str | None = None  # None, "ongoing" or "done" (archive classes)
    # False when a listing gave only key and size (S3): ``head`` tells the rest.
    meta_known: bool = True
    # Changes whenever the object is rewritten (S3 ETag; a file tier's inode, size and mtime):
    # an unchanged tag means the metadata known from an earlier ``head`` still holds.
    etag: str | None = None

    @property
    def archived(self) -> bool:
        """Readable only after a restore (GLACIER / DEEP_ARCHIVE not restored yet)."""
        return self.storage_class in ARCHIVE_CLASSES and self.restore_state != "done"


class Tier(abc.ABC):
    """One storage location. Subclasses implement the abstract methods; nothing else."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url
        # Awaited between the parts (S3) or chunks (file tier) of a put: the mount's yield
        # gate, so that an upload in flight pauses while the job writes (yieldgate.py).
        self.pace: Pace | None = None

    @property
    def late_meta(self) -> bool:
        """Whether ``put_file`` reads the object's meta only after it has copied the bytes
        (the file tier writes its xattrs last): the uploader then sums the file beside the
        copy (``finish``) instead of before it. A store that sends the meta first (S3's
        headers) would only wait for it."""
        return False

    async def check(self) -> None:
        """Fail fast at mount time (unreachable, missing bucket, bad credentials)."""

    async def cleanup(self, keys_of_ours: set[str]) -> int:
        """Remove leftovers of interrupted puts to ``keys_of_ours``; returns how many."""
        return 0

    @abc.abstractmethod
    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None, *, finish: Finish | None = None,
    ) -> str | None:
        """Store ``size`` bytes of the local file ``source`` at ``key``, atomically; returns
        the new object's tag (``ObjectInfo.etag``) when the store tells it. With ``finish``
        the object's meta is what it returns (``meta`` lacks the checksums then), awaited
        before anything of the meta is used: after the copy where ``late_meta``."""

    @abc.abstractmethod
    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        """Represent a symlink (``meta.target``), a special file (``meta.mode``, ``meta.rdev``)
        or an empty directory at ``key``."""

    @abc.abstractmethod
    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        """Copy ``length`` bytes at ``offset`` of the object into ``fd`` at ``fd_offset``."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size and metadata of ``key``; ``ObjectMissing`` if absent."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every entry under ``prefix`` (recursive); directories appear as ``key/``.

        A file tier lists every directory (a file implies its parents); an object store lists
        only the directory markers that were put.
        """

    async def list_dir(self, prefix: str) -> builtins.list[ObjectInfo]:
        """The entries directly under ``prefix`` ("" or "a/b/"): files, symlinks, and
        directories as ``name/`` (a directory exists if anything is under it or its marker
        does). Keys are relative to the tier like everywhere else. The default filters a
        recursive listing; stores override it with a one-level listing."""
        seen: dict[str, ObjectInfo] = {}
        for info in await self.list(prefix):
            rest = info.key[len(prefix):]
            if not rest:
                continue
            head, slash, _ = rest.partition("/")
            if slash:
                key = prefix + head + "/"
                if rest == head + "/":
                    seen[key] = info  # the directory's own marker, with its metadata
                else:
                    seen.setdefault(key, ObjectInfo(key, 0, ObjectMeta(Kind.DIRECTORY, 0o755),
                                                    meta_known=False))
            else:
                seen[info.key] = info
        return [seen[k] for k in sorted(seen)]

    async def restore(self, key: str, days: int) -> None:
        """Ask for a temporary readable copy of an archived object (S3 RestoreObject)."""
        raise TierError(f"{self.url}: {key}: this tier has no archive storage classes")

    async def promote(self, key: str) -> None:
        """Move a restored object back to this tier's storage class, in place."""
        raise TierError(f"{self.url}: {key}: this tier has no archive storage classes")

    @abc.abstractmethod
    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        """Store a small object (a few KiB of coordination state) at ``key``, atomically;
        returns its new tag. ``if_absent``: only if nothing is at ``key``; ``if_tag``: only
        if the object there has that tag. Otherwise ``PreconditionFailed``."""

    @abc.abstractmethod
    async def get_small(self, key: str) -> tuple[bytes, str]:
        """The body and tag of a small object; ``ObjectMissing`` if absent."""

    @abc.abstractmethod
    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        """Server-side copy of ``src`` to ``dst`` (same tier), keeping all metadata; ``dst``
        appears atomically. With ``if_etag``, only if ``src`` still has that tag (its
        ``ObjectInfo.etag``): the copy is then of exactly that version or nothing
        (``PreconditionFailed``), however the key is rewritten meanwhile. ``ObjectMissing``
        if ``src`` is absent. Returns the new object's tag when the store tells it."""

    @abc.abstractmethod
    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        """Remove ``key`` (a file, a symlink, or an empty-directory marker ``key/``). With
        ``if_etag``, only if it still holds that version (its ``ObjectInfo.etag``), else
        ``PreconditionFailed``: a deletion of the version someone saw never takes a newer
        one written since. Where the store has no conditional delete this is a HEAD, then
        the delete: the rare version written between the two is deleted too, and its writer,
        which no record tells that it was deleted, uploads it again (peers.py)."""

    def is_transient(self, exc: BaseException) -> bool:
        """Whether retrying later may succeed."""
        return isinstance(exc, StoreUnavailable)

    async def aclose(self) -> None:
        """Release clients and pools."""
