"""Copying objects between tiers (retention), and checking the copy.

``copy_object`` picks the cheapest way the two stores allow:
- two S3 tiers behind the same endpoint: a server-side copy (CopyObject, multipart
  UploadPartCopy above 5 GiB through boto3's managed copy) that sets the target tier's storage
  class and keeps the metadata; when both tiers are one prefix (``s3://b/p`` and
  ``s3://b/p?storage_class=GLACIER``) this is an in-place storage-class transition;
- two memory tiers: the object itself;
- a file-tier source: the file is the put's source, no temporary copy (opened beneath the
  store root without following symlinks, like every file-tier access: local.py);
- otherwise a streamed copy: the object is read into a temporary file in ``scratch`` (on the
  staging disk) and put from there.

``verify`` heads the copy: same size, same checksum as recorded at upload (where both are
known), and the target's storage class. It never reads the data back: an archived copy cannot
be read, and the stores check every transfer's integrity themselves.

Everything here uses the public ``Tier`` interface except the S3 server-side copy, which uses
``S3Tier``'s client (the same client, limiter and error translation as its own calls).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import trio

from ckptfs.tiers.base import Kind, ObjectMeta, Tier, TierError

STREAM_CHUNK = 64 * 1024 * 1024


class CopyMismatch(TierError):
    """A copy does not match its source (size, checksum or storage class)."""


def unwrap(tier: Tier) -> Tier:
    """The real tier under a fault-injection wrapper (for capabilities, not for I/O)."""
    inner = getattr(tier, "inner", None)
    return unwrap(inner) if isinstance(inner, Tier) else tier


def storage_class(tier: Tier) -> str:
    return str(getattr(unwrap(tier), "storage_class", "STANDARD"))


def _s3_pair(src: Tier, dst: Tier) -> tuple[Any, Any] | None:
    from ckptfs.tiers.s3 import S3Tier

    s, d = unwrap(src), unwrap(dst)
    if isinstance(s, S3Tier) and isinstance(d, S3Tier) \
            and s.client.meta.endpoint_url == d.client.meta.endpoint_url:
        return s, d
    return None


def server_side(src: Tier, dst: Tier) -> bool:
    """Whether ``copy_object(src, dst, ...)`` moves no data through this node."""
    from ckptfs.tiers.memory import MemoryTier

    if src is not unwrap(src) or dst is not unwrap(dst):
        return False  # a fault wrapper must see the transfer
    return _s3_pair(src, dst) is not None or (
        isinstance(src, MemoryTier) and isinstance(dst, MemoryTier))


async def copy_object(src: Tier, dst: Tier, key: str, size: int, scratch: Path) -> None:
    """Copy ``key`` from ``src`` to ``dst`` (same key), with its metadata."""
    from ckptfs.tiers.local import FileTier
    from ckptfs.tiers.memory import MemoryTier

    pair = _s3_pair(src, dst) if server_side(src, dst) else None
    if pair is not None:
        await _s3_copy(pair[0], pair[1], key)
        return
    if isinstance(src, MemoryTier) and isinstance(dst, MemoryTier) and server_side(src, dst):
        await trio.lowlevel.checkpoint()
        obj = src.objects.get(key)
        if obj is None:
            await src.head(key)  # raises ObjectMissing
        else:
            dst.objects[key] = dataclasses.replace(obj)
        return
    info = await src.head(key)
    meta = info.meta
    if meta.kind is Kind.SYMLINK:
        if meta.target is None:
            meta = dataclasses.replace(meta, target=(await _read_small(src, key, info.size, scratch)))
        await dst.put_entry(key, meta)
        return
    if isinstance(src, FileTier):
        # Opened beneath the store root without following symlinks (a path would follow one
        # planted in the store). The put reads it through /proc/self/fd/N, which names this
        # open file, not a path resolved again: still no temporary copy.
        fd = await src.open_object(key)
        try:
            await dst.put_file(key, Path(f"/proc/self/fd/{fd}"), info.size, meta)
        finally:
            os.close(fd)
        return
    await _stream(src, dst, key, info.size, meta, scratch)


async def _stream(src: Tier, dst: Tier, key: str, size: int, meta: ObjectMeta,
                  scratch: Path) -> None:
    fd, name = tempfile.mkstemp(prefix=".retention-", suffix=".copy", dir=scratch)
    try:
        done = 0
        while done < size:
            n = await src.read_into(key, done, min(STREAM_CHUNK, size - done), fd, done)
            if n <= 0:
                raise TierError(f"{src.url}: {key} ended after {done} of {size} bytes")
            done += n
        await dst.put_file(key, Path(name), size, meta)
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
    from boto3.s3.transfer import TransferConfig

    # Always name the class: a copy onto itself is only allowed when something changes, and
    # an in-place transition is exactly that.
    extra = {"StorageClass": dst.storage_class, "MetadataDirective": "COPY"}
    config = TransferConfig(multipart_threshold=5 * 1024**3, multipart_chunksize=256 * 1024**2,
                            max_concurrency=dst.part_concurrency, use_threads=True)
    await dst._call(
        dst.client.copy, {"Bucket": src.bucket, "Key": src._key(key)},
        dst.bucket, dst._key(key), ExtraArgs=extra, Config=config)


async def verify(dst: Tier, key: str, size: int, checksum: str | None) -> None:
    """Raise ``CopyMismatch`` unless ``dst`` holds ``key`` as expected."""
    info = await dst.head(key)
    if info.size != size:
        raise CopyMismatch(f"{dst.url}: {key} has {info.size} bytes, expected {size}")
    if checksum and info.meta.checksum and info.meta.checksum != checksum:
        raise CopyMismatch(f"{dst.url}: {key} has checksum {info.meta.checksum}, "
                           f"expected {checksum}")
    wanted = storage_class(dst)
    if wanted != "STANDARD" and info.storage_class != wanted:
        raise CopyMismatch(f"{dst.url}: {key} is in storage class {info.storage_class}, "
                           f"expected {wanted}")
