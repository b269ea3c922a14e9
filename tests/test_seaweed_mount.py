"""A real mount with the warm tier on SeaweedFS (a real S3 server: tests/seaweed.py), torch-free.

SeaweedFS verifies every checksum botocore sends and checks the credentials, so a wrong
checksum header, a lost part or a missing key in the config fails here where moto would
accept it. The files are written on one node, synced and evicted, read back through that
node (from the store) and through a second node with a fresh staging directory, and checked
on the store side: bytes, ``ckptfs-checksum`` (CRC32C) metadata, the CRC32 SeaweedFS
verified and kept for one-request uploads, and the parts of the multipart one.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import crc32c
import pytest

from ckptfs.store.tiers.base import CONTROL_PREFIX
from tests.mounting import Mounter, ckptfs, tiers_config
from tests.s3bucket import PART_SIZE, crc
from tests.seaweed import Seaweed

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]

PREFIX = "run1/"


def config(seaweed: Seaweed, bucket: str, path: Path) -> Path:
    """Hot tier + ``s3://bucket/run1`` on SeaweedFS as the warm tier, with its credentials."""
    keys = seaweed.tier_credentials
    return tiers_config(
        path, f"s3://{bucket}/{PREFIX.rstrip('/')}",
        f'endpoint_url = "{seaweed.endpoint}"', f"part_size = {PART_SIZE}",
        "part_concurrency = 3",
        f'access_key_id = "{keys["access_key_id"]}"',
        f'secret_access_key = "{keys["secret_access_key"]}"',
        metadata_ttl="1s", log_level="info")


def crc32c_header(data: bytes) -> str:
    """``x-amz-checksum-crc32c`` of ``data`` (base64 of the big-endian CRC32C)."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def test_files_round_trip_through_seaweedfs(mounter: Mounter, seaweed: Seaweed,
                                            tmp_path: Path) -> None:
    bucket = seaweed.new_bucket()
    cfg = config(seaweed, bucket, tmp_path / "c.toml")
    files = {
        "step_1/model.bin": os.urandom(2 * PART_SIZE + 12_345),  # multipart: 3 parts
        "step_1/optim/rank_0.bin": os.urandom(300_000),
        "step_1/empty": b"",
        "meta.json": b'{"step": 1}\n',
    }
    a = mounter("a", config=cfg)
    for rel, data in files.items():
        (a.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (a.path / rel).write_bytes(data)
    os.symlink("step_1", a.path / "latest")
    ckptfs("sync", a.path, "--timeout", "120", timeout=150)
    assert {rel: a.state(rel) for rel in files} == dict.fromkeys(files, "committed")

    ckptfs("evict", a.path / "step_1")
    evicted = [rel for rel in files if rel.startswith("step_1/")]
    assert {rel: a.state(rel) for rel in evicted} == dict.fromkeys(evicted, "remote")
    for rel in evicted:  # node A reads them back from the store
        assert (a.path / rel).read_bytes() == files[rel], rel

    b = mounter("b", config=cfg)  # a fresh staging directory: everything from the store
    for rel, data in files.items():
        assert (b.path / rel).read_bytes() == data, rel
    assert os.readlink(b.path / "latest") == "step_1"
    assert sorted(os.listdir(b.path / "step_1")) == ["empty", "model.bin", "optim"]

    # The store side, through a client of our own.
    client = seaweed.client()
    listed = {
        obj["Key"][len(PREFIX):]: int(obj["Size"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=PREFIX)
        for obj in page.get("Contents", [])
        if not obj["Key"][len(PREFIX):].startswith(CONTROL_PREFIX)
    }
    assert listed == {**{rel: len(data) for rel, data in files.items()},
                      "latest": len(b"step_1"), "step_1/": 0, "step_1/optim/": 0}, listed
    for rel, data in files.items():
        key = PREFIX + rel
        reply = client.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert reply["Body"].read() == data, rel
        assert reply["Metadata"]["ckptfs-checksum"] == crc(data), rel
        parts = client.get_object_attributes(Bucket=bucket, Key=key,
                                             ObjectAttributes=["ObjectParts"])
        if len(data) > PART_SIZE:
            # uploaded in parts, each checked by the server (botocore's CRC32 per part)
            assert parts["ObjectParts"]["TotalPartsCount"] == 3, parts
            assert reply["ETag"].endswith('-3"'), reply["ETag"]
        else:
            # one PutObject: SeaweedFS verified the CRC32C the uploader computed (no second
            # pass by botocore) and keeps it
            assert reply.get("ChecksumCRC32C") == crc32c_header(data), (rel, reply)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
