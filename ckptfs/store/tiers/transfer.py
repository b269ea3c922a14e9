"""Copying objects between tiers (retention), and checking the copy.

``copy_object`` picks the cheapest way the two stores allow:
- two S3 tiers behind the same endpoint: a server-side copy (``S3Tier.copy_from``: CopyObject,
  our own multipart UploadPartCopy from ``copy_threshold`` on) that sets the target tier's
  storage class and keeps all the metadata at any size; when both tiers are one prefix
  (``s3://b/p`` and ``s3://b/p?storage_class=GLACIER``) this is an in-place storage-class
  transition;
- two memory tiers: the object itself;
- a file-tier source: the file is the put's source, no temporary copy (opened beneath the
  store root without following symlinks, like every file-tier access: local.py);
- otherwise a streamed copy: the object is read into a temporary file in ``scratch`` (on the
  staging disk) and put from there.

Invariants (a copy is checked before the warm copy may go):
- Every copy whose bytes pass through this node is checked against the CRC32C recorded for
  the data (``expected``, from the journal, else the source's ``ckptfs-checksum``) *before*
  it is put: a streamed copy sums the bytes as they arrive, a file-tier source is summed
  from the open file that is then put, a copy from NVMe (``put_checked``) is summed like an
  upload. A mismatch is ``CopyMismatch`` and nothing is written to the target. The copy
  carries the whole-file CRC32C and the per-block CRCs of the bytes put (computed here, so
  present even where the source had none): reads of it are verified like reads of an upload.
- A server-side copy moves no data through the node; the store checks its own copies, and
  ``verify`` checks what the copy says about itself.
- ``verify`` heads the copy: same size, the checksum recorded for the data (a copy lacking
  it is rejected: it would be served unverified), and the target's storage class. It never
  reads the data back: an archived copy cannot be read.

Everything here uses the public ``Tier`` interface except the S3 server-side copy, which uses
``S3Tier.copy_from`` (the same client, limiter and error translation as its own calls).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import crc32c
import trio

from ckptfs.store.integrity import MIN_BLOCK, BlockSums, block_size_for, file_sums, format_crc
from ckptfs.store.tiers.base import Kind, ObjectArchived, ObjectInfo, ObjectMeta, Tier, TierError

STREAM_CHUNK = 64 * 1024 * 1024
_SUM_CHUNK = 8 * 1024 * 1024
# Summed on the trio thread up to this size, as the uploader does: a thread hop costs more,
# and simulations with the autojump clock stay deterministic (it jumps while a thread runs).
_INLINE_SUMS = 256 * 1024


class CopyMismatch(TierError):
    """A copy does not match its source (size, checksum or storage class)."""


class StreamSums:
    """The whole-object CRC32C and the per-block CRCs (integrity.py's layout) of ``size``
    bytes fed in order, in pieces of any length."""

    def __init__(self, size: int, min_block: int = MIN_BLOCK) -> None:
        self.size = size
        self.block = block_size_for(size, min_block)
        self.whole = 0
        self.crcs: list[int] = []
        self._current = 0
        self._in_block = 0
        self.fed = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            piece = view[:self.block - self._in_block]
            self._current = crc32c.crc32c(piece, self._current)
            self.whole = crc32c.crc32c(piece, self.whole)
            self._in_block += len(piece)
            self.fed += len(piece)
            view = view[len(piece):]
            if self._in_block == self.block:
                self.crcs.append(self._current)
                self._current, self._in_block = 0, 0

    def update_from(self, fd: int, offset: int, length: int) -> None:
        """Feed ``length`` bytes of ``fd`` at ``offset`` (read back from the page cache)."""
        done = 0
        while done < length:
            chunk = os.pread(fd, min(_SUM_CHUNK, length - done), offset + done)
            if not chunk:
                raise TierError(f"scratch file ended after {offset + done} bytes")
            self.update(chunk)
            done += len(chunk)

    def result(self) -> tuple[str, BlockSums]:
        if self.fed != self.size:
            raise TierError(f"summed {self.fed} of {self.size} bytes")
        crcs = self.crcs + ([self._current] if self._in_block else [])
        return format_crc(self.whole), BlockSums(self.block, tuple(crcs))


def checked_meta(key: str, meta: ObjectMeta, expected: str | None, checksum: str,
                 sums: BlockSums) -> ObjectMeta:
    """``meta`` for a copy whose data summed to ``checksum`` / ``sums``: ``CopyMismatch`` if
    the data is not what was recorded (``expected``, else ``meta.checksum``); the copy carries
    the checksum and the block CRCs computed here."""
    for recorded in (expected, meta.checksum):
        if recorded is not None and recorded != checksum:
            raise CopyMismatch(f"{key}: the data read for the copy has checksum {checksum}, "
                               f"recorded {recorded}: not copied")
    # The block CRCs of exactly the bytes put (the source's may be missing or malformed).
    return dataclasses.replace(meta, checksum=checksum, blocks=sums.encode())


async def put_checked(dst: Tier, key: str, source: Path, size: int, meta: ObjectMeta,
                      expected: str | None, min_block: int = MIN_BLOCK) -> None:
    """Put ``size`` bytes of the local file ``source`` (NVMe, or an open file-tier object)
    at ``key`` of ``dst`` like an upload does: summed first (whole and per block), refused
    with ``CopyMismatch`` unless it matches the recorded checksum ``expected``."""
    try:
        if size <= _INLINE_SUMS:
            checksum, sums = file_sums(source, size, min_block)
        else:
            checksum, sums = await trio.to_thread.run_sync(file_sums, source, size, min_block)
    except OSError as exc:
        raise CopyMismatch(f"{key}: reading {source} for the copy: {exc}") from exc
    await dst.put_file(key, source, size, checked_meta(key, meta, expected, checksum, sums))


def unwrap(tier: Tier) -> Tier:
    """The real tier under a fault-injection wrapper (for capabilities, not for I/O)."""
    inner = getattr(tier, "inner", None)
    return unwrap(inner) if isinstance(inner, Tier) else tier


def storage_class(tier: Tier) -> str:
    return str(getattr(unwrap(tier), "storage_class", "STANDARD"))


def _s3_pair(src: Tier, dst: Tier) -> tuple[Any, Any] | None:
    from ckptfs.store.tiers.s3 import S3Tier

    s, d = unwrap(src), unwrap(dst)
    if isinstance(s, S3Tier) and isinstance(d, S3Tier) \
            and s.client.meta.endpoint_url == d.client.meta.endpoint_url:
        return s, d
    return None


def server_side(src: Tier, dst: Tier) -> bool:
    """Whether ``copy_object(src, dst, ...)`` moves no data through this node."""
    from ckptfs.store.tiers.memory import MemoryTier

    if src is not unwrap(src) or dst is not unwrap(dst):
        return False  # a fault wrapper must see the transfer
    return _s3_pair(src, dst) is not None or (
        isinstance(src, MemoryTier) and isinstance(dst, MemoryTier))


async def copy_object(src: Tier, dst: Tier, key: str, size: int, scratch: Path,
                      expected: str | None = None) -> None:
    """Copy ``key`` from ``src`` to ``dst`` (same key), with its metadata. ``expected``: the
    CRC32C recorded for the data (the journal's); a copy through this node whose bytes do not
    match it (or the source's own recorded checksum) is ``CopyMismatch`` and is not put."""
    from ckptfs.store.tiers.local import FileTier
    from ckptfs.store.tiers.memory import MemoryTier

    pair = _s3_pair(src, dst) if server_side(src, dst) else None
    if pair is not None:
        await _s3_copy(pair[0], pair[1], key)
        return
    if isinstance(src, MemoryTier) and isinstance(dst, MemoryTier) and server_side(src, dst):
        await trio.lowlevel.checkpoint()
        obj = src.objects.get(key)
        if obj is None:
            await src.head(key)  # raises ObjectMissing
        elif (await src.head(key)).archived:
            raise ObjectArchived(f"{src.url}: InvalidObjectState: {key} is in "
                                 f"{obj.storage_class}")
        else:
            dst.place(key, obj)  # in the target's class (onto itself: a transition)
        return
    info = await src.head(key)
    meta = info.meta
    if meta.kind is Kind.SPECIAL:
        await dst.put_entry(key, meta)  # no bytes: the metadata is the whole entry
        return
    if meta.kind is Kind.SYMLINK:
        if meta.target is None:
            meta = dataclasses.replace(meta, target=(await _read_small(src, key, info.size, scratch)))
        await dst.put_entry(key, meta)
        return
    if isinstance(src, FileTier):
        # Opened beneath the store root without following symlinks (a path would follow one
        # planted in the store). The sums and the put read it through /proc/self/fd/N, which
        # names this open file, not a path resolved again: still no temporary copy, and the
        # bytes summed are the bytes put.
        fd = await src.open_object(key)
        try:
            await put_checked(dst, key, Path(f"/proc/self/fd/{fd}"), info.size, meta, expected)
        finally:
            os.close(fd)
        return
    await _stream(src, dst, key, info.size, meta, scratch, expected)


async def _stream(src: Tier, dst: Tier, key: str, size: int, meta: ObjectMeta,
                  scratch: Path, expected: str | None) -> None:
    fd, name = tempfile.mkstemp(prefix=".retention-", suffix=".copy", dir=scratch)
    try:
        sums = StreamSums(size)
        done = 0
        while done < size:
            n = await src.read_into(key, done, min(STREAM_CHUNK, size - done), fd, done)
            if n <= 0:
                raise TierError(f"{src.url}: {key} ended after {done} of {size} bytes")
            # Summed as it arrives, from what landed in the scratch file (what will be put).
            if n <= _INLINE_SUMS:
                sums.update_from(fd, done, n)
            else:
                await trio.to_thread.run_sync(sums.update_from, fd, done, n)
            done += n
        checksum, blocks = sums.result()
        await dst.put_file(key, Path(name), size,
                           checked_meta(key, meta, expected, checksum, blocks))
    finally:
        os.close(fd)
        os.unlink(name)


async def _read_small(src: Tier, key: str, size: int, scratch: Path) -> str:
    fd, name = tempfile.mkstemp(prefix=".retention-", dir=scratch)
    try:
        await src.read_into(key, 0, size, fd, 0)
        return os.pread(fd, size, 0).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)
        os.unlink(name)


async def _s3_copy(src: Any, dst: Any, key: str) -> None:
    # S3Tier.copy_from keeps the metadata at any size (its own multipart copy from
    # copy_threshold on) and names the target's class: an in-place transition is a self-copy
    # with the same metadata.
    await dst.copy_from(src.bucket, src._key(key), key)


async def verify(dst: Tier, key: str, size: int, checksum: str | None) -> ObjectInfo:
    """Raise ``CopyMismatch`` unless ``dst`` holds ``key`` as expected: ``size`` bytes, the
    recorded ``checksum`` (a copy without one is rejected: its reads could not be verified),
    the target's storage class. Returns what the store said of it (class, ETag)."""
    info = await dst.head(key)
    if info.size != size:
        raise CopyMismatch(f"{dst.url}: {key} has {info.size} bytes, expected {size}")
    if checksum is not None and info.meta.checksum != checksum:
        raise CopyMismatch(f"{dst.url}: {key} has checksum {info.meta.checksum or 'none'}, "
                           f"expected {checksum}")
    wanted = storage_class(dst)
    if wanted != "STANDARD" and info.storage_class != wanted:
        raise CopyMismatch(f"{dst.url}: {key} is in storage class {info.storage_class}, "
                           f"expected {wanted}")
    return info
