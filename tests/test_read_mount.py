"""Real-mount acceptance tests of the read path with the warm tier on S3 over real HTTP.

Several mounts on this machine with separate staging directories and one store prefix stand
for several nodes. The store is the session's SeaweedFS, except where a test says
(``moto``). What the store serves is counted on the store side: moto's HTTP server logs every
request (werkzeug), and ``StoreLog`` counts the GETs of object bodies.

tests/test_read_path.py checks the same rules without a mount (memory tier, virtual clock).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.store.tiers.base import CONTROL_PREFIX
from tests.mounting import Mount, Mounter, ckptfs, register_first, status, wait_for
from tests.s3bucket import ARCHIVE, PREFIX, REQUEST_LOG, UNSAFE_KEYS, Bucket
from tests.s3server import S3Server

pytestmark = [pytest.mark.mount, pytest.mark.timeout(600)]

MiB = 1024 * 1024


class StoreLog(logging.Handler):
    """Counts requests the moto server answered, by method, for keys under one bucket."""

    # werkzeug colours some lines: ANSI escapes may sit between the quote and the method.
    LINE = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|HEAD|PUT|POST|DELETE) /([^ ?]+)(\?[^ ]*)? HTTP')

    def __init__(self, bucket: str) -> None:
        super().__init__(logging.INFO)
        self.bucket = bucket
        self.requests: list[tuple[str, str, str]] = []  # (method, key, query)

    def emit(self, record: logging.LogRecord) -> None:
        match = self.LINE.search(record.getMessage())
        if match and match[2].startswith(self.bucket + "/"):
            self.requests.append((match[1], match[2][len(self.bucket) + 1:], match[3] or ""))

    def body_gets(self, key_part: str = "") -> int:
        """GETs of object bodies (listings are GETs of the bucket itself, not counted)."""
        return sum(1 for method, key, _ in self.requests
                   if method == "GET" and key.startswith(PREFIX) and key != PREFIX
                   and not key.startswith(PREFIX + CONTROL_PREFIX)  # nodes' polls
                   and key_part in key)


@pytest.fixture
def store_log(bucket: Bucket) -> Iterator[StoreLog]:
    """Needs moto (``@pytest.mark.moto(REQUEST_LOG)``): on another server it would count
    nothing."""
    assert isinstance(bucket.server, S3Server), "store_log needs @pytest.mark.moto(REQUEST_LOG)"
    handler = StoreLog(bucket.name)
    logger = logging.getLogger("werkzeug")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def config(bucket: Bucket, tmp_path: Path, **settings: Any) -> Path:
    settings.setdefault("metadata_ttl", "1s")
    return bucket.config(tmp_path / "c.toml", **settings)


def fetched(m: Mount) -> int:
    return int(status(m)["fetch"]["bytes"])


def daemon_log(m: Mount) -> str:
    return (m.staging / "daemon.log").read_text(errors="replace")


# ---------------------------------------------------------------------------------------------
# 1. DCP across two nodes, loaded on a third


@pytest.mark.torch
def test_dcp_saved_on_two_nodes_loads_on_a_third(mounter: Mounter, bucket: Bucket,
                                                 tmp_path: Path) -> None:
    from tests.test_torch_mount import DCP_FILES_4_RANKS, dcp_load_and_check, run_ranks, tree

    cfg = config(bucket, tmp_path)
    a, b = mounter("a", config=cfg), mounter("b", config=cfg)
    seed = 21
    work = tmp_path / "work"
    results = run_ranks("save", 4, a.path / "ckpt", work, seed=seed,
                        ckpt_of=lambda rank: (a if rank < 2 else b).path / "ckpt")
    assert all(r["saved"] for r in results)
    assert set(os.listdir(a.path / "ckpt")) >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    ckptfs("sync", a.path)
    ckptfs("sync", b.path)

    c = mounter("c", config=cfg)  # an empty staging directory: everything comes from S3
    assert tree(c.path / "ckpt") == {name: "file" for name in DCP_FILES_4_RANKS}
    dcp_load_and_check(c.path / "ckpt", work, seed=seed)
    # Node A sees node B's shards too, once its cached listing is older than metadata_ttl.
    time.sleep(1.5)
    assert tree(a.path / "ckpt") == {name: "file" for name in DCP_FILES_4_RANKS}


# ---------------------------------------------------------------------------------------------
# 2. A 256 MiB torch.save file read lazily on a fresh mount


@pytest.mark.torch
@pytest.mark.moto(REQUEST_LOG)
def test_lazy_torch_load_fetches_only_what_it_reads(mounter: Mounter, bucket: Bucket,
                                                    store_log: StoreLog, tmp_path: Path) -> None:
    import torch

    from tests.test_torch_mount import assert_same_state_dict, make_big_state_dict

    # No readahead: what is fetched is exactly the blocks torch reads. A quarter of the 1 GiB
    # state dict with blocks a quarter of 32 MiB: the same blocks touched, as a fraction of
    # the file, for a quarter of the bytes (moto copies the whole object for every range GET,
    # so the object's size is what makes this slow).
    block = 8 * MiB
    cfg = config(bucket, tmp_path, readahead_bytes=0, fetch_block_size=block)
    a = mounter("a", config=cfg)
    want = make_big_state_dict(seed=5, n=4096)
    # The node registers in the store at its first change, and the store (moto) runs in this
    # process: torch.save's C++ open holds the GIL while it waits for the mount, so moto could
    # not answer. A first change from Python (which lets the GIL go) registers the node.
    register_first(a)
    torch.save(want, a.path / "ckpt_step_100.pt")
    size = os.path.getsize(a.path / "ckpt_step_100.pt")
    a.umount()  # waits for the upload

    b = mounter("b", config=cfg)
    gets_before = store_log.body_gets()
    lazy = torch.load(b.path / "ckpt_step_100.pt", mmap=True, weights_only=True)
    assert torch.equal(lazy["model.layers.0.bias"], want["model.layers.0.bias"])
    assert torch.equal(lazy["model.norm.weight"], want["model.norm.weight"])
    del lazy
    first = fetched(b)
    gets = store_log.body_gets("ckpt_step_100.pt") - gets_before
    # torch reads the zip directory at the end, data.pkl, and the local header of every
    # record (one block per tensor), then the pages of the two tensors it touched.
    assert 0 < first < size // 4, f"fetched {first} of {size} bytes for two small tensors"
    # One GET per block fetched, whole blocks (the last one of the file is shorter).
    assert (gets - 1) * block < first <= gets * block, (gets, first)

    b.umount()
    b.remount()  # the fetched ranges are still local
    lazy = torch.load(b.path / "ckpt_step_100.pt", mmap=True, weights_only=True)
    assert torch.equal(lazy["model.layers.0.bias"], want["model.layers.0.bias"])
    del lazy
    assert fetched(b) == 0
    assert store_log.body_gets("ckpt_step_100.pt") - gets_before == gets

    got = torch.load(b.path / "ckpt_step_100.pt", weights_only=True)
    assert_same_state_dict(got, want)
    del got
    total = fetched(b)
    assert total <= size  # nothing fetched twice
    # Whole and verified: a local copy. The completion (an fdatasync of the whole file) runs
    # in the background once the fetches pause, so it is a moment after the last read.
    wait_for("a committed local copy", lambda: b.state("ckpt_step_100.pt") == "committed")
    got = torch.load(b.path / "ckpt_step_100.pt", weights_only=True)  # served locally
    del got
    assert fetched(b) == total


# ---------------------------------------------------------------------------------------------
# 3. Random ranges of a remote-only file


@pytest.fixture
def remote_file(mounter: Mounter, bucket: Bucket, tmp_path: Path) -> tuple[Mount, bytes]:
    cfg = config(bucket, tmp_path, fetch_block_size=256 * 1024, readahead_bytes=1 * MiB)
    a = mounter("a", config=cfg)
    data = os.urandom(9 * MiB + 12345)
    (a.path / "d").mkdir()
    (a.path / "d" / "x.bin").write_bytes(data)
    a.umount()
    return mounter("b", config=cfg), data


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 10 * MiB), size=st.integers(1, 3 * MiB))
def test_random_ranges_of_a_remote_file(remote_file: tuple[Mount, bytes], offset: int,
                                        size: int) -> None:
    b, data = remote_file
    fd = os.open(b.path / "d" / "x.bin", os.O_RDONLY)
    try:
        got = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    assert got == data[offset:offset + size]


# ---------------------------------------------------------------------------------------------
# 4. Corrupted and deleted objects


def test_corrupt_object_is_eio_and_deleted_object_estale(mounter: Mounter, bucket: Bucket,
                                                         tmp_path: Path) -> None:
    cfg = config(bucket, tmp_path)
    a = mounter("a", config=cfg)
    data = os.urandom(20 * MiB)
    for name in ("good.pt", "bad.pt", "gone.pt"):
        (a.path / name).write_bytes(data)
    a.umount()
    # Rewritten behind ckptfs's back: one bit flipped, the metadata copied as it was.
    body, meta, _ = bucket.get("bad.pt")
    flipped = bytearray(body)
    flipped[12 * MiB + 1] ^= 0x10
    bucket.client.put_object(Bucket=bucket.name, Key=PREFIX + "bad.pt", Body=bytes(flipped),
                             Metadata=meta)

    b = mounter("b", config=cfg)
    with open(b.path / "bad.pt", "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]  # the blocks that are intact read fine
        f.seek(12 * MiB)
        with pytest.raises(OSError) as caught:
            f.read(MiB)
        assert caught.value.errno == errno.EIO
    with pytest.raises(OSError) as caught:
        (b.path / "bad.pt").read_bytes()
    assert caught.value.errno == errno.EIO
    assert re.search(r"bad.pt: block 12 has crc32c [0-9a-f]{8}, expected", daemon_log(b))
    assert status(b)["fetch"]["failures"] >= 2

    assert (b.path / "gone.pt").stat().st_size == len(data)  # listed while it existed
    bucket.client.delete_object(Bucket=bucket.name, Key=PREFIX + "gone.pt")
    with pytest.raises(OSError) as caught:
        (b.path / "gone.pt").read_bytes()
    assert caught.value.errno == errno.ESTALE
    assert "gone.pt: deleted from" in daemon_log(b)
    time.sleep(1.5)  # the next listing drops it
    assert not (b.path / "gone.pt").exists()
    assert (b.path / "good.pt").read_bytes() == data


# ---------------------------------------------------------------------------------------------
# 5. An object only in GLACIER


@pytest.mark.moto(ARCHIVE)
def test_glacier_object_needs_restore(mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    cfg = config(bucket, tmp_path)
    a = mounter("a", config=cfg)
    data = os.urandom(3 * MiB)
    (a.path / "step_1").mkdir()
    (a.path / "step_1" / "model.pt").write_bytes(data)
    a.umount()
    key = PREFIX + "step_1/model.pt"
    # What retention does when it moves a checkpoint to the cold tier: same key, GLACIER.
    bucket.client.copy_object(Bucket=bucket.name, Key=key, StorageClass="GLACIER",
                              CopySource={"Bucket": bucket.name, "Key": key},
                              MetadataDirective="COPY")

    b = mounter("b", config=cfg)
    path = b.path / "step_1" / "model.pt"
    assert path.stat().st_size == len(data)
    assert b.state("step_1/model.pt") == "archived"
    started = time.monotonic()
    with pytest.raises(OSError) as caught:
        path.read_bytes()
    assert caught.value.errno == errno.EAGAIN
    assert time.monotonic() - started < 10  # fails fast, no waiting for the archive
    assert f"run `ckptfs restore {path}`" in daemon_log(b)

    done = ckptfs("restore", b.path / "step_1", "--poll-interval", "0.2", "--timeout", "60")
    assert "restored 1 file" in done.stdout
    assert path.read_bytes() == data
    head = bucket.client.head_object(Bucket=bucket.name, Key=key)
    assert head.get("StorageClass", "STANDARD") == "STANDARD"  # kept in the warm tier
    # The pin keeping it there names the node that restored it.
    pin = bucket.client.get_object(Bucket=bucket.name, Key=PREFIX + ".ckptfs/pins/step_1")
    node = json.loads(ckptfs("status", "--json", b.path).stdout)["node"]["node"]
    assert json.loads(pin["Body"].read())["by"] == node
    again = ckptfs("restore", path, "--poll-interval", "0.2")
    assert "nothing to restore" in again.stdout


# ---------------------------------------------------------------------------------------------
# 6. ls -R of 1,000 files without a single body download


@pytest.mark.moto(REQUEST_LOG)
def test_ls_of_a_thousand_files_downloads_no_body(mounter: Mounter, bucket: Bucket,
                                                  store_log: StoreLog, tmp_path: Path) -> None:
    cfg = config(bucket, tmp_path, upload_concurrency=16)
    a = mounter("a", config=cfg)
    for d in range(10):
        sub = a.path / f"step_{d:03d}"
        sub.mkdir(mode=0o750 if d % 2 else 0o755)
        for i in range(100):
            f = sub / f"shard_{i:03d}.bin"
            f.write_bytes(bytes([i]) * (i * 7 + d))
            os.chmod(f, 0o600 if i % 3 == 0 else 0o644)
            os.utime(f, ns=(1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_000 + i * d))
    (a.path / "empty_dir").mkdir()
    os.symlink("step_009", a.path / "latest")
    want = snapshot(a.path)
    a.umount()

    b = mounter("b", config=cfg)
    gets_before = store_log.body_gets()
    assert snapshot(b.path) == want
    assert store_log.body_gets() == gets_before
    assert fetched(b) == 0


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` with what ``ls -lR`` shows (without reading a file)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st_ = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st_.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st_.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st_.st_mode), st_.st_size, st_.st_mtime_ns)
    assert len(out) > 0
    return out


# ---------------------------------------------------------------------------------------------
# Names from the store that are not safe path components (docs/SEMANTICS.md)


@pytest.mark.moto(UNSAFE_KEYS)
def test_unsafe_names_in_the_store_never_leave_the_mount(mounter: Mounter, bucket: Bucket,
                                                         tmp_path: Path) -> None:
    bad = ["../x_escaped", "a/../../b_escaped", "c/" + "n" * 300, "d//e", "ok/./f"]
    for key in [*bad, "ok/g"]:
        bucket.client.put_object(Bucket=bucket.name, Key=PREFIX + key, Body=b"evil")
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    b = mounter("b", config=config(bucket, tmp_path))
    seen = snapshot(b.path)
    assert seen == {"a": ("dir", 0o755), "c": ("dir", 0o755), "d": ("dir", 0o755),
                    "ok": ("dir", 0o755), "ok/g": ("file", 0o644, 4, seen["ok/g"][3])}
    assert (b.path / "ok" / "g").read_bytes() == b"evil"
    log = daemon_log(b)
    for key in ("../", "a/../", "c/" + "n" * 300, "d//", "ok/./"):
        assert f"refusing store entry {key!r}" in log, key
    refused = status(b)["fetch"]["errors"]
    assert any("'../'" in line for line in refused)
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before
    b.umount()
    # os.walk, not rglob: other tests' trees here may be deeper than PATH_MAX (a file tier
    # walks by directory fds), and walk skips what it cannot open.
    assert not [name for _, dirs, files in os.walk(tmp_path.parent) for name in dirs + files
                if name.endswith("_escaped")]


# ---------------------------------------------------------------------------------------------
# ckptfs evict


def test_evict_drops_local_copies_that_stay_readable(mounter: Mounter, bucket: Bucket,
                                                     tmp_path: Path) -> None:
    m = mounter("a", config=config(bucket, tmp_path))
    data = {f"step_1/shard_{i}.bin": os.urandom(3 * MiB + i) for i in range(3)}
    (m.path / "step_1").mkdir()
    for rel, body in data.items():
        (m.path / rel).write_bytes(body)
    (m.path / "step_2").mkdir()
    (m.path / "step_2" / "open.bin").write_bytes(b"o" * 1000)
    ckptfs("sync", m.path)
    writer = open(m.path / "step_2" / "open.bin", "ab")  # noqa: SIM115 (held open on purpose)
    (m.path / "step_2" / "new.bin").write_bytes(b"n" * 10)  # closed, maybe not committed
    try:
        used_before = status(m)["staging"]["used_bytes"]
        out = ckptfs("evict", m.path / "step_1").stdout
        assert "evicted 3 files" in out
        assert {m.state(rel) for rel in data} == {"remote"}
        assert status(m)["staging"]["used_bytes"] <= used_before - sum(map(len, data.values()))
        out = ckptfs("evict", m.path / "step_2").stdout
        assert "open" in out  # the file open for writing keeps its data, and says why
        assert m.state("step_2/open.bin") == "open"
    finally:
        writer.close()
    for rel, body in data.items():  # fetched back by range on read, verified
        assert (m.path / rel).read_bytes() == body
    assert fetched(m) == sum(map(len, data.values()))
    # Each becomes a local copy (an fdatasync) in the background once fetching pauses.
    deadline = time.monotonic() + 60
    while {m.state(rel) for rel in data} != {"committed"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {m.state(rel) for rel in data} == {"committed"}
