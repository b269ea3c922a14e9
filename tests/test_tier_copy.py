"""Copies on a tier and between tiers, beyond the contract suite:

- a pinned copy refuses a source rewritten between the caller's look and the copy itself,
  also in the middle of a multipart copy (which is then aborted);
- S3 copies keep all metadata through our own multipart copy, between tiers too, and a
  self-copy (promote, in-place transition) is a REPLACE with the same metadata, which
  SeaweedFS accepts (the S3 tests run on the session's SeaweedFS, ``s3``; on moto its
  refusal of the plain one would be emulated: tests/s3conditions.py);
- retention's copies through the node are checked against the recorded CRC32C before they
  are put (streamed, from a file tier, from NVMe) and carry block CRCs; ``verify`` rejects a
  copy without the checksum.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from ckptfs.config import Config
from ckptfs.engine.fs import Filesystem
from ckptfs.engine.upload import Uploader
from ckptfs.errors import StoreUnavailable
from ckptfs.lifecycle.retention import Policy, Retention, detector_for
from ckptfs.state.journal import Journal, State
from ckptfs.state.staging import Staging
from ckptfs.store.integrity import BlockSums, file_sums
from ckptfs.store.tiers.base import Kind, ObjectMeta, PreconditionFailed, Tier
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.local import FileTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from ckptfs.store.tiers.s3 import MIN_PART_SIZE, S3Tier
from ckptfs.store.tiers.transfer import CopyMismatch, StreamSums, copy_object, put_checked, verify
from tests.s3bucket import Server
from tests.s3conditions import count_calls, honour_copy_conditions, refuse_plain_self_copy
from tests.s3server import S3Server
from tests.test_retention_sim import write

SIZE = 2 * MIN_PART_SIZE + 12345  # three parts of MIN_PART_SIZE


def s3_tier(server: Server, url_tail: str, bucket: str | None = None) -> S3Tier:
    tier = S3Tier("warm", f"s3://{bucket or server.new_bucket()}/{url_tail}",
                  endpoint_url=server.endpoint, part_size=MIN_PART_SIZE, part_concurrency=2,
                  **server.tier_credentials)
    if isinstance(server, S3Server):  # as SeaweedFS (and AWS) answer copies
        honour_copy_conditions(tier.client)
        refuse_plain_self_copy(tier.client)
    tier.copy_threshold = tier.copy_part_size = MIN_PART_SIZE
    return tier


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Damage a file in place: same size, other bytes at ``offset``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def put_source(tmp_path: Path, size: int) -> tuple[Path, bytes, ObjectMeta]:
    data = os.urandom(size)
    path = tmp_path / f"src-{uuid.uuid4().hex}"
    path.write_bytes(data)
    checksum, sums = file_sums(path, size)
    meta = ObjectMeta(Kind.FILE, 0o600, 1_700_000_000_000_000_001, 1000, 1000, checksum,
                      blocks=sums.encode())
    return path, data, meta


async def read_all(tier: Tier, key: str, size: int, tmp_path: Path) -> bytes:
    out = tmp_path / f"out-{uuid.uuid4().hex}"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n = await tier.read_into(key, 0, size, fd, 0)
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def rewrite_after_first(client: Any, operation: str, bucket: str, key: str) -> None:
    """Once the first ``operation`` call returns, put new bytes at ``key``: the source is
    rewritten between the tier's look and its copy (or between two parts)."""
    done = False
    lock = threading.Lock()

    def rewrite(**_: Any) -> None:
        nonlocal done
        with lock:  # parts in flight wait until the new version is there
            if not done:
                client.put_object(Bucket=bucket, Key=key, Body=b"the next checkpoint")
                done = True

    client.meta.events.register(f"after-call.s3.{operation}", rewrite)


# -- pinned copies on S3, with the source rewritten mid-way ------------------------------------


@pytest.mark.parametrize("size", [1000, SIZE], ids=["single", "multipart"])
async def test_s3_source_rewritten_after_the_look(s3: Server, tmp_path: Path,
                                                  size: int) -> None:
    tier = s3_tier(s3, "run1")
    src, _, meta = put_source(tmp_path, size)
    tag = await tier.put_file("ckpt", src, size, meta)
    # After the tier's own HEAD (single copy) / after the first part (multipart).
    operation = "HeadObject" if size < tier.copy_threshold else "UploadPartCopy"
    rewrite_after_first(tier.client, operation, tier.bucket, tier._key("ckpt"))
    with pytest.raises(PreconditionFailed):
        await tier.copy("ckpt", "ckpt.prev", if_etag=tag)
    listed = [i.key for i in await tier.list()]
    assert listed == ["ckpt"], "no copy of the new bytes under the old name"
    uploads = tier.client.list_multipart_uploads(Bucket=tier.bucket).get("Uploads", [])
    assert uploads == [], "the multipart copy was aborted"
    await tier.aclose()


async def test_s3_unpinned_multipart_copy_of_a_changing_source_is_retried(
        s3: Server, tmp_path: Path) -> None:
    """Parts of two versions are never stitched together: the parts are pinned to the ETag
    the copy's HEAD saw, and a change mid-way is a transient error (copy again)."""
    tier = s3_tier(s3, "run1")
    src, _, meta = put_source(tmp_path, SIZE)
    await tier.put_file("ckpt", src, SIZE, meta)
    rewrite_after_first(tier.client, "UploadPartCopy", tier.bucket, tier._key("ckpt"))
    with pytest.raises(StoreUnavailable):
        await tier.copy("ckpt", "other")
    await tier.copy("ckpt", "other")  # the retry copies the new version, whole
    assert await read_all(tier, "other", 100, tmp_path) == b"the next checkpoint"
    await tier.aclose()


async def test_file_tier_copies_the_inode_it_checked(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The file tier checks the tag on the inode it then links: a new version renamed over
    the source right after the check is not what lands at the target."""
    from ckptfs.store.tiers import local

    tier = FileTier("warm", f"file://{tmp_path}/store", tmp_path / "store")
    src, data, meta = put_source(tmp_path, 5000)
    tag = await tier.put_file("ckpt", src, len(data), meta)
    real_check = local._check_tag

    def check_then_rewrite(st: os.stat_result, expected: str | None, key: str) -> None:
        real_check(st, expected, key)
        newer = tmp_path / "store" / ".newer"
        newer.write_bytes(b"the next checkpoint")
        os.replace(newer, tmp_path / "store" / "ckpt")  # another node's put lands

    monkeypatch.setattr(local, "_check_tag", check_then_rewrite)
    await tier.copy("ckpt", "ckpt.prev", if_etag=tag)
    monkeypatch.setattr(local, "_check_tag", real_check)
    assert (tmp_path / "store/ckpt.prev").read_bytes() == data
    assert (await tier.head("ckpt.prev")).meta.checksum == meta.checksum
    with pytest.raises(PreconditionFailed):
        await tier.copy("ckpt", "ckpt.prev", if_etag=tag)
    assert (tmp_path / "store/ckpt.prev").read_bytes() == data


# -- metadata through multipart copies, promote, transfers between tiers -----------------------


async def test_promote_is_a_replace_with_the_same_metadata(s3: Server,
                                                           tmp_path: Path) -> None:
    """SeaweedFS refuses a plain self-copy; REPLACE with the same metadata and
    content type works everywhere, at any size."""
    bucket = s3.new_bucket()
    tier = s3_tier(s3, "run1?storage_class=STANDARD_IA", bucket)
    for key, size in (("small", 1000), ("large", SIZE)):
        _, data, meta = put_source(tmp_path, size)
        tier.client.put_object(Bucket=bucket, Key=tier._key(key), Body=data,
                               Metadata=meta.to_headers(), ContentType="application/x-ckpt",
                               StorageClass="STANDARD")
        await tier.promote(key)
        head = tier.client.head_object(Bucket=bucket, Key=tier._key(key))
        assert head.get("StorageClass") == "STANDARD_IA"
        assert head["ContentType"] == "application/x-ckpt"
        assert ObjectMeta.from_headers(head["Metadata"]) == meta
        assert await read_all(tier, key, size, tmp_path) == data
    await tier.aclose()


@pytest.mark.parametrize("same_prefix", [False, True], ids=["other-prefix", "in-place"])
async def test_transfer_between_s3_tiers_keeps_metadata(s3: Server, tmp_path: Path,
                                                        same_prefix: bool) -> None:
    bucket = s3.new_bucket()
    warm = s3_tier(s3, "run1", bucket)
    cold = s3_tier(s3, ("run1" if same_prefix else "cold")
                   + "?storage_class=STANDARD_IA", bucket)
    calls = count_calls(cold.client)
    src, data, meta = put_source(tmp_path, SIZE)
    await warm.put_file("step_1/shard_0", src, SIZE, meta)
    await copy_object(warm, cold, "step_1/shard_0", SIZE, tmp_path, meta.checksum)
    await verify(cold, "step_1/shard_0", SIZE, meta.checksum)
    info = await cold.head("step_1/shard_0")
    assert info.meta == meta and info.storage_class == "STANDARD_IA"
    assert calls.get("UploadPartCopy") == 3, calls
    assert await read_all(cold, "step_1/shard_0", SIZE, tmp_path) == data
    await warm.aclose()
    await cold.aclose()


# -- copies through the node are checked against the recorded CRC32C ---------------------------


def test_stream_sums_match_file_sums(tmp_path: Path) -> None:
    rng = random.Random(7)
    for size in (0, 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) - 5):
        data = rng.randbytes(size)
        path = tmp_path / "f"
        path.write_bytes(data)
        sums = StreamSums(size)
        at = 0
        while at < size:
            n = rng.randint(1, 700_000)
            sums.update(data[at:at + n])
            at += n
        assert sums.result() == file_sums(path, size)


@pytest.fixture
def memory_pair(request: pytest.FixtureRequest) -> Iterator[tuple[MemoryTier, MemoryTier]]:
    names = [f"copy-{which}-{uuid.uuid4().hex}" for which in ("warm", "cold")]
    yield (MemoryTier("warm", "memory://warm", names[0]),
           MemoryTier("cold", "memory://cold", names[1]))
    for name in names:
        store_named(name).clear()


async def test_streamed_copy_of_corrupt_reads_is_refused(
        memory_pair: tuple[MemoryTier, MemoryTier], tmp_path: Path) -> None:
    warm, cold = memory_pair
    src, data, meta = put_source(tmp_path, 3 * (1 << 20))
    await warm.put_file("step_1/model.pt", src, len(data), meta)
    faulty = FaultyTier(warm)  # a wrapper: the copy streams through this node
    faulty.corrupt_reads = True
    with pytest.raises(CopyMismatch):
        await copy_object(faulty, cold, "step_1/model.pt", len(data), tmp_path, meta.checksum)
    assert cold.objects == {}, "nothing is put"
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".retention-")] == []
    # Good reads: the copy carries the checksum and the block CRCs of its bytes, computed on
    # the way where the source had none.
    await warm.put_file("step_1/model.pt", src, len(data),
                        dataclasses.replace(meta, blocks=None))
    faulty.corrupt_reads = False
    await copy_object(faulty, cold, "step_1/model.pt", len(data), tmp_path, meta.checksum)
    await verify(cold, "step_1/model.pt", len(data), meta.checksum)
    copied = cold.objects["step_1/model.pt"]
    assert copied.body == data and copied.meta == meta
    assert BlockSums.decode(copied.meta.blocks) == file_sums(src, len(data))[1]


async def test_copy_from_a_file_tier_is_checked(tmp_path: Path) -> None:
    store = FileTier("warm", f"file://{tmp_path}/store", tmp_path / "store")
    cold = MemoryTier("cold", "memory://cold", f"copy-{uuid.uuid4().hex}")
    src, data, meta = put_source(tmp_path, 100_000)
    await store.put_file("step_1/model.pt", src, len(data), meta)
    # The bytes in the store are not the bytes the checksum was recorded for.
    overwrite(tmp_path / "store/step_1/model.pt", 0, b"X")
    with pytest.raises(CopyMismatch):
        await copy_object(store, cold, "step_1/model.pt", len(data), tmp_path, meta.checksum)
    assert cold.objects == {}


async def test_verify_rejects_a_copy_without_the_checksum(
        memory_pair: tuple[MemoryTier, MemoryTier], tmp_path: Path) -> None:
    _, cold = memory_pair
    src, data, meta = put_source(tmp_path, 1000)
    await cold.put_file("k", src, len(data), dataclasses.replace(meta, checksum=None))
    with pytest.raises(CopyMismatch):
        await verify(cold, "k", len(data), meta.checksum)
    await verify(cold, "k", len(data), None)  # nothing recorded: nothing to compare
    await cold.put_file("k", src, len(data), meta)
    await verify(cold, "k", len(data), meta.checksum)


async def test_put_checked_refuses_nvme_data_that_changed(
        memory_pair: tuple[MemoryTier, MemoryTier], tmp_path: Path) -> None:
    _, cold = memory_pair
    src, data, meta = put_source(tmp_path, 3 * (1 << 20))
    bare = dataclasses.replace(meta, blocks=None)
    await put_checked(cold, "k", src, len(data), bare, meta.checksum)
    assert cold.objects["k"].meta == meta  # with block CRCs, like an upload
    # Pages lost in a power loss: same size, other bytes.
    overwrite(src, len(data) // 2, b"\0" * 4096)
    with pytest.raises(CopyMismatch):
        await put_checked(cold, "k2", src, len(data), bare, meta.checksum)
    assert "k2" not in cold.objects


async def test_retention_does_not_copy_corrupt_nvme_data(
        memory_pair: tuple[MemoryTier, MemoryTier], tmp_path: Path) -> None:
    """A committed checkpoint whose NVMe copy no longer matches its checksum is not copied
    from NVMe to another tier (it would carry the good checksum over bad bytes)."""
    warm, _ = memory_pair
    # A file tier: no server-side copy from the memory tier, so NVMe is the nearest source.
    cold = FileTier("cold", f"file://{tmp_path}/cold", tmp_path / "cold")
    config = Config.model_validate({
        "staging_dir": "/tmp/unused",
        "tier": [
            {"name": "hot", "keep": {"last": 3}},
            {"name": "warm", "url": warm.url, "keep": {"last": 3}},
            {"name": "cold", "url": cold.url, "keep": {"last": 3}},
        ],
    })
    staging = Staging(tmp_path / "staging")
    staging.prepare()
    journal = Journal(staging.root / "journal.db")
    fs = Filesystem(journal, staging)
    fs.start()
    uploader = Uploader(journal, fs.ns, staging, warm, concurrency=2,
                        markers=config.commit_markers)
    fs.listener = uploader
    retention = Retention(Policy.from_config(config), {"warm": warm, "cold": cold},
                          detector=detector_for(config), markers=config.commit_markers,
                          fs=fs, scratch=staging.root / "tmp")
    data = os.urandom(200_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.run)
        ino = await write(fs, "step_1/model.pt", data)
        await write(fs, "step_1/.metadata", b"step 1")
        await uploader.wait_idle()
        assert fs.ns.get(ino).state is State.COMMITTED
        overwrite(staging.path(ino), 1000, b"\0" * 100)  # lost pages: same size, other bytes
        result = await retention.run_once()
        nursery.cancel_scope.cancel()
    assert [(a.kind, a.tier, a.source) for a, _ in result.failed] == [("copy", "cold", "hot")]
    assert not (tmp_path / "cold/step_1/model.pt").exists()
    assert warm.objects["step_1/model.pt"].body == data
