"""One contract, every tier kind: memory, a local directory (file://), and S3 over real HTTP
on two servers on 127.0.0.1: moto (a mock, with the copy preconditions real servers enforce
and moto does not added by tests/s3conditions.py) and SeaweedFS (a real S3 server that
verifies checksums and credentials: tests/seaweed.py), each exactly as it would be AWS.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import trio

from ckptfs.engine.upload import file_checksum
from ckptfs.store.integrity import BlockSums, file_sums, format_crc
from ckptfs.store.tiers.base import (
    Kind,
    ObjectMeta,
    ObjectMissing,
    PreconditionFailed,
    Tier,
    TierError,
)
from ckptfs.store.tiers.local import TMP_MARK, FileTier
from ckptfs.store.tiers.memory import MemoryTier
from ckptfs.store.tiers.s3 import MIN_PART_SIZE, S3Tier
from tests.s3conditions import count_calls, honour_copy_conditions, refuse_plain_self_copy
from tests.s3server import S3Server
from tests.seaweed import Seaweed

S3_SERVERS = ["moto", "seaweed"]
KINDS = ["memory", "file", *S3_SERVERS]


@pytest.fixture(params=S3_SERVERS)
def s3_endpoint(request: pytest.FixtureRequest) -> S3Server | Seaweed:
    """Each S3 server of the suite in turn (the session's ``s3_server`` or ``seaweed``)."""
    name = "s3_server" if request.param == "moto" else "seaweed"
    server: S3Server | Seaweed = request.getfixturevalue(name)
    return server


def s3_tier(server: S3Server | Seaweed, url: str, **settings: Any) -> S3Tier:
    """An S3 tier on ``server`` (with its credentials: SeaweedFS checks them)."""
    keys = server.tier_credentials if isinstance(server, Seaweed) else {}
    t = S3Tier("warm", url, endpoint_url=server.endpoint, **keys, **settings)
    if isinstance(server, S3Server):
        # moto as a real server answers: CopySourceIfMatch honoured, no plain self-copy.
        honour_copy_conditions(t.client)
        refuse_plain_self_copy(t.client)
    return t


@pytest.fixture(params=KINDS)
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    kind = request.param
    t: Tier
    if kind == "memory":
        t = MemoryTier("warm", "memory://c", f"contract-{uuid.uuid4().hex}")
    elif kind == "file":
        t = FileTier("warm", f"file://{tmp_path}/store", tmp_path / "store")
    else:
        server: S3Server | Seaweed = request.getfixturevalue(
            "s3_server" if kind == "moto" else "seaweed")
        t = s3_tier(server, f"s3://{server.new_bucket()}/run1", part_size=MIN_PART_SIZE,
                    part_concurrency=3)
    await t.check()
    yield t
    await t.aclose()


def make_file(tmp_path: Path, size: int, name: str = "src") -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


async def read_back(tier: Tier, key: str, size: int, tmp_path: Path,
                    offset: int = 0) -> bytes:
    out = tmp_path / f"out-{uuid.uuid4().hex}"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n = await tier.read_into(key, offset, size, fd, 0)
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


META = ObjectMeta(Kind.FILE, 0o640, 1_700_000_000_123_456_789, os.getuid(), os.getgid())


def meta_of(data: bytes, meta: ObjectMeta = META) -> ObjectMeta:
    """``meta`` carrying the CRC32C of ``data``: what every caller of ``put_file`` passes (an
    S3 tier sends it as the request's checksum, and the store refuses bytes that differ)."""
    return dataclasses.replace(meta, checksum=format_crc(crc32c.crc32c(data)))


async def test_put_head_read_list(tier: Tier, tmp_path: Path) -> None:
    src, data = make_file(tmp_path, 100_000)
    tag = await tier.put_file("step_1/model.pt", src, len(data), meta_of(data))
    info = await tier.head("step_1/model.pt")
    assert tag is not None and info.etag == tag  # the tag a listing will show
    assert info.size == len(data)
    assert info.meta.mode == 0o640 and info.meta.checksum == meta_of(data).checksum
    assert info.meta.mtime_ns == META.mtime_ns
    assert await read_back(tier, "step_1/model.pt", len(data), tmp_path) == data
    assert await read_back(tier, "step_1/model.pt", 100, tmp_path, offset=5000) == data[5000:5100]
    keys = [i.key for i in await tier.list()]
    assert "step_1/model.pt" in keys
    # A file tier also lists the directories a file implies; object stores only markers.
    files = [i.key for i in await tier.list("step_1/") if not i.key.endswith("/")]
    assert files == ["step_1/model.pt"]


async def test_multipart_sized_file_round_trips(tier: Tier, tmp_path: Path) -> None:
    size = 2 * MIN_PART_SIZE + 12345
    src, data = make_file(tmp_path, size)
    seen: list[int] = []
    await tier.put_file("big.bin", src, size, meta_of(data), seen.append)
    assert sum(seen) == size
    back = await read_back(tier, "big.bin", size, tmp_path)
    assert back == data
    assert (await tier.head("big.bin")).size == size


async def test_the_meta_may_come_after_the_bytes(tier: Tier, tmp_path: Path) -> None:
    """``finish``: the meta is what it returns. A tier that writes it last (``late_meta``, the
    file tier) awaits it only once every byte is copied, so the uploader sums the file beside
    the copy; the others await it before they send anything."""
    size = 2 * MIN_PART_SIZE + 12345
    src, data = make_file(tmp_path, size)
    seen: list[int] = []
    sent_when_asked: list[int] = []

    async def finish() -> ObjectMeta:
        sent_when_asked.append(sum(seen))
        return dataclasses.replace(meta_of(data), stamp="n1:r1.7")

    await tier.put_file("late.bin", src, size, META, seen.append, finish=finish)
    assert sent_when_asked == [size if tier.late_meta else 0]
    assert tier.late_meta == isinstance(tier, FileTier)
    info = await tier.head("late.bin")
    assert info.meta.checksum == meta_of(data).checksum and info.meta.stamp == "n1:r1.7"
    assert await read_back(tier, "late.bin", size, tmp_path) == data


async def test_overwrite_copy_delete(tier: Tier, tmp_path: Path) -> None:
    a, data_a = make_file(tmp_path, 3000, "a")
    b, data_b = make_file(tmp_path, 5000, "b")
    await tier.put_file("x", a, len(data_a), meta_of(data_a))
    await tier.put_file("x", b, len(data_b), meta_of(data_b))
    assert await read_back(tier, "x", 10_000, tmp_path) == data_b
    await tier.copy("x", "dir/y")
    assert await read_back(tier, "dir/y", 10_000, tmp_path) == data_b
    assert (await tier.head("dir/y")).meta.checksum == meta_of(data_b).checksum
    await tier.delete("x")
    await tier.delete("x")  # idempotent
    with pytest.raises(ObjectMissing):
        await tier.head("x")
    with pytest.raises(ObjectMissing):
        await read_back(tier, "x", 10, tmp_path)


async def test_copy_is_pinned_to_the_source_tag(tier: Tier, tmp_path: Path) -> None:
    """A copy names the version it copies; a rewritten source is refused,
    a missing one is missing, and copying does not change the source's own tag (a pinned
    copy retried after an error must still find it)."""
    a, data_a = make_file(tmp_path, 3000, "a")
    b, data_b = make_file(tmp_path, 5000, "b")
    old = await tier.put_file("ckpt", a, len(data_a), meta_of(data_a))
    assert old is not None
    new_tag = await tier.copy("ckpt", "ckpt.prev", if_etag=old)
    assert new_tag is None or (await tier.head("ckpt.prev")).etag == new_tag
    assert await read_back(tier, "ckpt.prev", 10_000, tmp_path) == data_a
    assert (await tier.head("ckpt")).etag == old  # copying it did not change its tag
    await tier.copy("ckpt", "ckpt.prev", if_etag=old)  # a retry finds it as it was
    assert await read_back(tier, "ckpt.prev", 10_000, tmp_path) == data_a
    # The new checkpoint lands at the source: the old tag must not copy it.
    await tier.put_file("ckpt", b, len(data_b), meta_of(data_b))
    with pytest.raises(PreconditionFailed):
        await tier.copy("ckpt", "elsewhere", if_etag=old)
    with pytest.raises(ObjectMissing):
        await tier.head("elsewhere")
    assert await read_back(tier, "ckpt.prev", 10_000, tmp_path) == data_a
    with pytest.raises(ObjectMissing):
        await tier.copy("nothing-here", "elsewhere", if_etag=old)
    with pytest.raises(ObjectMissing):
        await tier.copy("nothing-here", "elsewhere")
    # Unpinned, it copies whatever is there.
    await tier.copy("ckpt", "elsewhere")
    assert await read_back(tier, "elsewhere", 10_000, tmp_path) == data_b


FULL_META = ObjectMeta(Kind.FILE, 0o600, 1_700_000_000_987_654_321, os.getuid() + 1,
                       os.getgid() + 2, "crc32c:0badf00d", blocks="1048576:AAAAAA==")


async def test_large_copy_keeps_every_piece_of_metadata(tier: Tier, tmp_path: Path) -> None:
    """A copy at or above the size where S3 must copy in parts (5 GiB;
    lowered here so that the multipart path runs on a small object) keeps mode, owner,
    mtime, checksum and block CRCs."""
    calls: dict[str, int] = {}
    if isinstance(tier, S3Tier):
        calls = count_calls(tier.client)
        tier.copy_threshold = tier.copy_part_size = MIN_PART_SIZE
    size = 2 * MIN_PART_SIZE + 12345
    src, data = make_file(tmp_path, size)
    if os.geteuid() != 0 and isinstance(tier, FileTier):
        meta = ObjectMeta(Kind.FILE, 0o600, FULL_META.mtime_ns, os.getuid(), os.getgid(),
                          FULL_META.checksum, blocks=FULL_META.blocks)  # chown needs root
    else:
        meta = FULL_META
    meta = meta_of(data, meta)
    tag = await tier.put_file("step_1.tmp/shard_0", src, size, meta)
    await tier.copy("step_1.tmp/shard_0", "step_1/shard_0", if_etag=tag)
    info = await tier.head("step_1/shard_0")
    assert info.size == size and info.meta == meta
    assert await read_back(tier, "step_1/shard_0", size, tmp_path) == data
    if isinstance(tier, S3Tier):
        assert calls.get("UploadPartCopy") == 3, calls  # the multipart path did run
        # promote: a self-copy (changing only the class), REPLACE with the same metadata.
        await tier.promote("step_1/shard_0")
        assert (await tier.head("step_1/shard_0")).meta == meta
        assert await read_back(tier, "step_1/shard_0", size, tmp_path) == data


async def test_symlinks_and_directories(tier: Tier, tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:
    await tier.put_entry("latest", ObjectMeta(Kind.SYMLINK, 0o777, 5, 0, 0, target="step_9"))
    await tier.put_entry("empty/", ObjectMeta(Kind.DIRECTORY, 0o750, 7, 0, 0,
                                              stamp="n0:ab12.7"))
    info = await tier.head("latest")
    assert info.meta.kind is Kind.SYMLINK
    entries = {i.key: i for i in await tier.list()}
    assert "empty/" in entries and entries["empty/"].meta.kind is Kind.DIRECTORY
    # A marker carries its writer's stamp (peers.py: a node that removes it tells its writer),
    # where the store keeps a marker's metadata (not SeaweedFS: see the next test).
    assert (await tier.head("empty/")).meta.stamp == (
        None if request.node.callspec.params["tier"] == "seaweed" else "n0:ab12.7")
    await tier.delete("empty/")
    await tier.delete("latest")
    assert [i.key for i in await tier.list()] == []


async def test_special_files_keep_type_mode_and_rdev(tier: Tier, tmp_path: Path) -> None:
    """A FIFO and a device node round-trip as empty entries: kind, st_mode with its type, rdev,
    owner and mtime, through head, list and copy (what another node maps them from)."""
    import stat
    dev = os.makedev(8, 1)
    await tier.put_entry("run/pipe", ObjectMeta(Kind.SPECIAL, stat.S_IFIFO | 0o640, 11, 7, 8))
    await tier.put_entry("run/disk", ObjectMeta(Kind.SPECIAL, stat.S_IFBLK | 0o600, 12, 0, 6,
                                                rdev=dev))
    await tier.copy("run/disk", "run/disk2")
    listed = {i.key: i for i in await tier.list("run/")}
    for key, mode, rdev in (("run/pipe", stat.S_IFIFO | 0o640, 0),
                            ("run/disk", stat.S_IFBLK | 0o600, dev),
                            ("run/disk2", stat.S_IFBLK | 0o600, dev)):
        info = await tier.head(key)
        assert (info.size, info.meta.kind, info.meta.mode, info.meta.rdev) == \
            (0, Kind.SPECIAL, mode, rdev), key
        assert listed[key].size == 0
        if listed[key].meta_known:  # S3 lists key and size only
            assert (listed[key].meta.kind, listed[key].meta.mode) == (Kind.SPECIAL, mode)
    assert (await tier.head("run/pipe")).meta.mtime_ns == 11
    if os.geteuid() == 0 or not isinstance(tier, FileTier):
        assert ((await tier.head("run/pipe")).meta.uid,
                (await tier.head("run/pipe")).meta.gid) == (7, 8)
    if isinstance(tier, FileTier):
        # The store holds a marker file, never a real FIFO or device node.
        assert stat.S_ISREG(os.lstat(tmp_path / "store/run/disk").st_mode)
    for key in ("run/pipe", "run/disk", "run/disk2"):
        await tier.delete(key)
    assert [i.key for i in await tier.list("run/") if not i.key.endswith("/")] == []


async def test_cancelled_put_leaves_nothing(tier: Tier, tmp_path: Path) -> None:
    size = 3 * MIN_PART_SIZE
    src, data = make_file(tmp_path, size)
    with trio.move_on_after(0.05):
        await tier.put_file("cancelled.bin", src, size, meta_of(data))
    await trio.sleep(0.2)
    keys = [i.key for i in await tier.list()]
    assert all(TMP_MARK not in k for k in keys)
    if "cancelled.bin" in keys:  # the put won the race: then it must be whole
        assert (await tier.head("cancelled.bin")).size == size
    if isinstance(tier, S3Tier):
        uploads = tier.client.list_multipart_uploads(Bucket=tier.bucket).get("Uploads", [])
        assert uploads == []
    if isinstance(tier, FileTier):
        leftovers = [p for p in tier.root.rglob("*") if TMP_MARK in p.name]
        assert leftovers == []


async def test_s3_cleanup_aborts_stale_multipart(s3_endpoint: S3Server | Seaweed) -> None:
    bucket = s3_endpoint.new_bucket()
    tier = s3_tier(s3_endpoint, f"s3://{bucket}/p")
    client = s3_endpoint.client()
    client.create_multipart_upload(Bucket=bucket, Key="p/step_1/shard")
    client.create_multipart_upload(Bucket=bucket, Key="p/not-ours")
    assert await tier.cleanup({"step_1/shard"}) == 1
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    assert left == ["p/not-ours"]


async def test_s3_put_sends_the_uploaders_crc32c(seaweed: Seaweed, tmp_path: Path) -> None:
    """The bytes are summed once per upload: each PutObject / UploadPart carries the CRC32C the
    uploader computed (a part's from its integrity blocks; the part size is then a whole
    number of blocks), not one botocore computes in another pass. SeaweedFS checks it, so a
    wrong block CRC is refused, and what it keeps is our CRC32C."""
    bucket = seaweed.new_bucket()
    tier = s3_tier(seaweed, f"s3://{bucket}/p", part_size=MIN_PART_SIZE + 1)
    size = 3 * MIN_PART_SIZE + 7
    src, _ = make_file(tmp_path, size)
    checksum, sums = file_sums(src, size, 1024 * 1024)
    meta = dataclasses.replace(META, checksum=checksum, blocks=sums.encode())
    await tier.put_file("big", src, size, meta)
    client = seaweed.client()
    head = client.head_object(Bucket=bucket, Key="p/big", ChecksumMode="ENABLED")
    # Parts of 6 MiB (5 MiB + 1 rounded up to whole 1 MiB blocks): 3 parts, not 4.
    assert head["ETag"].endswith('-3"') and head.get("ChecksumCRC32C", "").endswith("-3"), head
    small, small_data = make_file(tmp_path, 1000, "small")
    await tier.put_file("small", small, 1000, meta_of(small_data))
    head = client.head_object(Bucket=bucket, Key="p/small", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") == base64.b64encode(
        crc32c.crc32c(small_data).to_bytes(4, "big")).decode()
    wrong = BlockSums(sums.block_size, (sums.crcs[0] ^ 1, *sums.crcs[1:]))
    with pytest.raises(TierError, match="BadDigest"):
        await tier.put_file("bad", src, size, dataclasses.replace(meta, blocks=wrong.encode()))
    with pytest.raises(TierError, match="BadDigest"):
        await tier.put_file("bad", small, 1000, meta)  # not the small file's CRC32C
    await tier.aclose()


async def test_s3_single_put_reports_progress_as_it_sends(
        s3_endpoint: S3Server | Seaweed, tmp_path: Path) -> None:
    """A file sent in one PutObject reports its progress while it goes (a slow store shows
    it moving, not at 0 until it is all there), and only the bytes sent: botocore reads the
    body once more to sign the request, which is not progress."""
    tier = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/p")
    size = 3 * 1024 * 1024 + 5
    assert size <= tier.part_size  # one PutObject
    src, data = make_file(tmp_path, size)
    totals: list[int] = []

    def progress(n: int) -> None:
        totals.append((totals[-1] if totals else 0) + n)

    await tier.put_file("one", src, size, meta_of(data), progress)
    assert totals[-1] == size
    assert len(totals) > 2 and 0 < totals[0] < size  # in steps, not all at the end
    assert max(totals) == size  # the signing pass was not counted
    await tier.aclose()


async def test_s3_check_fails_fast(s3_endpoint: S3Server | Seaweed) -> None:
    with pytest.raises(TierError, match="does not exist"):
        await s3_tier(s3_endpoint, "s3://no-such-bucket-here/p").check()
    with pytest.raises(TierError, match="cannot be reached"):
        await S3Tier("warm", "s3://bucket/p", endpoint_url="http://127.0.0.1:9").check()


def test_checksum_is_crc32c(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"123456789")
    assert file_checksum(path, 9) == "crc32c:e3069283"  # the standard CRC-32C check value


async def test_list_dir_is_one_level(tier: Tier, tmp_path: Path) -> None:
    src, data = make_file(tmp_path, 1000)
    for key in ("a/x", "a/b/y", "a/b/c/z", "top"):
        await tier.put_file(key, src, len(data), meta_of(data))
    await tier.put_entry("a/empty/", ObjectMeta(Kind.DIRECTORY, 0o750))
    root = {i.key for i in await tier.list_dir("")}
    assert root == {"a/", "top"}
    inside = {i.key: i for i in await tier.list_dir("a/")}
    assert set(inside) == {"a/x", "a/b/", "a/empty/"}
    assert inside["a/x"].size == len(data)
    assert {i.key for i in await tier.list_dir("a/b/")} == {"a/b/y", "a/b/c/"}
    assert await tier.list_dir("nothing/") == []


async def test_s3_list_dir_drops_a_prefix_once_its_last_key_is_gone(
        s3_endpoint: S3Server | Seaweed, tmp_path: Path) -> None:
    """A prefix whose keys (its marker too) are all deleted is no longer listed, at once, as
    on AWS. SeaweedFS keeps such a directory of its filer for minutes (its empty-folder
    cleanup) and lists it as a common prefix, so a renamed or removed directory would come
    back on the mount: ``list_dir`` drops it. (A file tier's directories are real ones.)"""
    tier = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/run1")
    src, data = make_file(tmp_path, 100)
    await tier.put_entry("d/", ObjectMeta(Kind.DIRECTORY, 0o750))
    await tier.put_entry("d/e/", ObjectMeta(Kind.DIRECTORY, 0o750))
    for key in ("d/e/f", "d/g", "implicit/h", "keep/k"):
        await tier.put_file(key, src, len(data), meta_of(data))
    assert {i.key for i in await tier.list_dir("")} == {"d/", "implicit/", "keep/"}
    for key in ("d/e/f", "d/e/", "d/g", "d/", "implicit/h"):
        await tier.delete(key)
    assert [i.key for i in await tier.list_dir("")] == ["keep/"]
    assert await tier.list_dir("d/") == []
    await tier.aclose()


async def test_small_objects_are_compare_and_swap(tier: Tier) -> None:
    key = ".ckptfs/lease"
    with pytest.raises(ObjectMissing):
        await tier.get_small(key)
    with pytest.raises(PreconditionFailed):
        await tier.put_small(key, b"x", if_tag="no-such-tag")  # nothing to replace
    first = await tier.put_small(key, b"one", if_absent=True)
    assert await tier.get_small(key) == (b"one", first)
    with pytest.raises(PreconditionFailed):
        await tier.put_small(key, b"two", if_absent=True)
    second = await tier.put_small(key, b"two", if_tag=first)
    assert second != first
    with pytest.raises(PreconditionFailed):
        await tier.put_small(key, b"three", if_tag=first)  # a stale tag loses
    assert await tier.get_small(key) == (b"two", second)
    third = await tier.put_small(key, b"three")  # unconditional
    assert await tier.get_small(key) == (b"three", third)


async def test_racing_conditional_writes_have_one_winner(tier: Tier) -> None:
    key = ".ckptfs/race"
    base = await tier.put_small(key, b"base", if_absent=True)
    won: list[bytes] = []

    async def contend(body: bytes) -> None:
        try:
            await tier.put_small(key, body, if_tag=base)
            won.append(body)
        except PreconditionFailed:
            pass

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(contend, b"node-%d" % i)
    assert len(won) == 1
    assert (await tier.get_small(key))[0] == won[0]


# -- what SeaweedFS (a real server) showed up, each checked on both servers ------------------


def unquote_copy_tags(client: Any) -> None:
    """Make moto answer copies' ETags the way SeaweedFS does: unquoted (HEAD and listings
    quote them on both)."""

    def strip(parsed: dict[str, Any], **_: Any) -> None:
        for result in ("CopyObjectResult", "CopyPartResult"):
            if "ETag" in parsed.get(result, {}):
                parsed[result]["ETag"] = parsed[result]["ETag"].strip('"')

    for operation in ("CopyObject", "UploadPartCopy"):
        client.meta.events.register(f"after-call.s3.{operation}", strip)


async def test_s3_copy_tag_is_the_tag_head_shows(s3_endpoint: S3Server | Seaweed,
                                                 tmp_path: Path) -> None:
    """SeaweedFS answers CopyObject/UploadPartCopy ETags unquoted, HEAD quoted: the tag a copy
    returns must be the one HEAD and listings show, and pin a later copy."""
    t = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/run1", part_size=MIN_PART_SIZE)
    if isinstance(s3_endpoint, S3Server):
        unquote_copy_tags(t.client)
    src, data = make_file(tmp_path, 2 * MIN_PART_SIZE + 1)
    await t.put_file("a", src, len(data), meta_of(data))
    single = await t.copy("a", "b")
    t.copy_threshold = t.copy_part_size = MIN_PART_SIZE  # the multipart copy: Complete's tag
    multi = await t.copy("a", "c")
    listed = {i.key: i.etag for i in await t.list()}
    for key, tag in (("b", single), ("c", multi)):
        assert tag is not None and tag.startswith('"'), tag
        assert tag == (await t.head(key)).etag == listed[key]
    # The copies' tags pin copies of them (quoted or not: the same tag).
    await t.copy("b", "d", if_etag=single)
    await t.copy("c", "e", if_etag=multi.strip('"'))
    assert {(await t.head(k)).size for k in "de"} == {len(data)}
    await t.aclose()


async def test_s3_listings_follow_every_page(s3_endpoint: S3Server | Seaweed) -> None:
    """Listings longer than a page (MaxKeys lowered to 4): ``list`` and ``list_dir`` see each
    key once across pages, directories (common prefixes) included."""
    t = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/run1")
    calls = count_calls(t.client)

    def small_pages(params: dict[str, Any], **_: Any) -> None:
        params["MaxKeys"] = 4

    t.client.meta.events.register("before-parameter-build.s3.ListObjectsV2", small_pages)
    keys = [f"d{i % 3}/f{i:02d}" for i in range(12)] + [f"top{i:02d}" for i in range(7)]
    for key in keys:
        await t.put_small(key, b"x" * len(key))
    await t.put_entry("d1/sub/", ObjectMeta(Kind.DIRECTORY, 0o750))
    assert sorted(i.key for i in await t.list()) == sorted([*keys, "d1/sub/"])
    assert calls["ListObjectsV2"] >= 5, calls  # (20 keys, 4 a page): it did page
    root = await t.list_dir("")
    assert [i.key for i in root] == ["d0/", "d1/", "d2/", *(f"top{i:02d}" for i in range(7))]
    inside = {i.key: i.size for i in await t.list_dir("d1/")}
    assert inside == {"d1/sub/": 0, **{k: len(k) for k in keys if k.startswith("d1/")}}
    await t.aclose()


async def test_s3_plain_self_copy_is_refused(s3_endpoint: S3Server | Seaweed) -> None:
    """SeaweedFS refuses a copy onto itself without MetadataDirective=REPLACE, even when the
    storage class changes (400 InvalidRequest); on moto tests/s3conditions.py says the same,
    so ``promote``'s REPLACE path is what both check."""
    from botocore.exceptions import ClientError

    t = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/run1")
    await t.put_small("x", b"body")
    for changes in ({}, {"StorageClass": "STANDARD_IA"}):
        with pytest.raises(ClientError) as refused:
            t.client.copy_object(Bucket=t.bucket, Key="run1/x",
                                 CopySource={"Bucket": t.bucket, "Key": "run1/x"}, **changes)
        assert refused.value.response["Error"]["Code"] == "InvalidRequest"
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    await t.promote("x")  # REPLACE with the same metadata: allowed
    assert await t.get_small("x") == (b"body", (await t.head("x")).etag)
    await t.aclose()


async def test_s3_directory_marker_metadata_as_the_fixtures_say(
        s3_endpoint: S3Server | Seaweed) -> None:
    """A directory marker (``key/``) keeps its user metadata on moto (and AWS); SeaweedFS
    makes it a directory of its filer and drops the metadata (and refuses to copy it), as
    ``keeps_directory_metadata`` tells the mount tests. Either way it is listed and is a
    directory to ``head``."""
    t = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/run1")
    await t.put_entry("d/", ObjectMeta(Kind.DIRECTORY, 0o750, 7, 0, 0))
    meta = t.client.head_object(Bucket=t.bucket, Key="run1/d/").get("Metadata", {})
    assert bool(meta) == s3_endpoint.keeps_directory_metadata, meta
    if s3_endpoint.keeps_directory_metadata:
        assert meta["ckptfs-kind"] == "dir" and meta["ckptfs-mode"] == "750", meta
    info = await t.head("d/")
    assert info.meta.kind is Kind.DIRECTORY
    assert info.meta.mode == (0o750 if s3_endpoint.keeps_directory_metadata else 0o755)
    assert [i.key for i in await t.list()] == ["d/"]
    await t.aclose()


async def test_seaweed_refuses_wrong_credentials(seaweed: Seaweed) -> None:
    """A real server checks the keys (moto accepts any): ``check`` says so."""
    bucket = seaweed.new_bucket()
    for keys in ({"access_key_id": seaweed.access_key, "secret_access_key": "wrong"},
                 {"access_key_id": "no-such-key", "secret_access_key": "wrong"}):
        t = S3Tier("warm", f"s3://{bucket}/p", endpoint_url=seaweed.endpoint, **keys)
        with pytest.raises(TierError, match="refused access"):
            await t.check()
        await t.aclose()


def test_seaweed_uses_loopback_only(seaweed: Seaweed) -> None:
    """Every socket ``weed`` has is on 127.0.0.1, to 127.0.0.1 (listening: to nothing), and
    no port it listens on is the admin server's machine-wide default (23646)."""
    sockets = seaweed.sockets()
    assert sockets
    for local, remote in sockets:
        assert local.startswith("127.0.0.1:"), sockets
        assert remote.split(":")[0] in ("127.0.0.1", "0.0.0.0"), sockets
    listening = {int(local.rsplit(":", 1)[1]) for local, remote in sockets
                 if remote == "0.0.0.0:0"}
    ports = set(seaweed.ports.values())
    assert listening == ports | {p + 10_000 for p in ports}, (listening, seaweed.ports)


async def test_s3_empty_put_does_not_stall_the_next(s3_endpoint: S3Server | Seaweed) -> None:
    """SeaweedFS answers an empty PUT without "100 Continue"; botocore then misread the next
    ``Expect: 100-continue`` PUT's reply on that pooled connection and stalled for the read
    timeout (60 s) before a hidden retry (boto/botocore#3755). One connection, so the second
    PUT surely reuses it."""
    t = s3_tier(s3_endpoint, f"s3://{s3_endpoint.new_bucket()}/run1", threads=1)
    for attempt in range(3):
        started = trio.current_time()
        await t.put_entry(f"d{attempt}/", ObjectMeta(Kind.DIRECTORY, 0o755))  # empty body
        tag = await t.put_small(f"f{attempt}", b"x" * 100_000)
        assert trio.current_time() - started < 5, attempt
        assert await t.get_small(f"f{attempt}") == (b"x" * 100_000, tag)
    await t.aclose()


async def test_s3_a_failed_part_is_the_upload_s_own_error(
        s3_endpoint: S3Server | Seaweed, tmp_path: Path) -> None:
    """A part that cannot be sent (the store unreachable) fails the multipart upload with
    that part's StoreUnavailable, not an exception group of them: the uploader must see a
    transient failure (retried, counted towards a store outage), and it is aborted."""
    from botocore.exceptions import EndpointConnectionError

    from ckptfs.errors import StoreUnavailable

    bucket = s3_endpoint.new_bucket()
    tier = s3_tier(s3_endpoint, f"s3://{bucket}/p", part_size=MIN_PART_SIZE)
    src = tmp_path / "big"
    src.write_bytes(os.urandom(3 * MIN_PART_SIZE))

    def unreachable(**_: Any) -> Any:
        raise EndpointConnectionError(endpoint_url=s3_endpoint.endpoint)

    tier.client.upload_part = unreachable
    with pytest.raises(StoreUnavailable):
        await tier.put_file("big", src, 3 * MIN_PART_SIZE, ObjectMeta())
    client = s3_endpoint.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


async def test_file_tier_long_names_and_their_leftovers(tmp_path: Path) -> None:
    """A 255-byte name fits its temporary name (cut, marked), and ``cleanup`` finds a
    leftover temporary of a cut name by its prefix (ours only)."""
    tier = FileTier("warm", f"file://{tmp_path}/store", tmp_path / "store")
    src = tmp_path / "src"
    src.write_bytes(b"long")
    name = "n" * 255
    await tier.put_file(f"d/{name}", src, 4, ObjectMeta())
    assert (tmp_path / "store" / "d" / name).read_bytes() == b"long"
    from ckptfs.store.tiers.local import _tmp_name

    leftover = tmp_path / "store" / "d" / _tmp_name(name)
    other = tmp_path / "store" / "d" / _tmp_name("m" * 255)
    leftover.write_bytes(b"x")
    other.write_bytes(b"y")
    assert await tier.cleanup({f"d/{name}"}) == 1
    assert not leftover.exists() and other.exists()
