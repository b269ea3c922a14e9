"""Store keys have one owner (docs/SEMANTICS.md, "Store keys"), on real mounts.

Two mounts on this machine (two nodes: separate staging directories) over one S3 prefix on
the suite's SeaweedFS; where the endpoint itself fails and slows requests (tests/s3server.py,
``Rule``) the server is moto, whose requests go through that middleware (``moto`` marker).
What the store holds is read with boto3, as a reader on another machine would. The unit-level
versions are tests/test_store_keys.py and tests/test_peer_renames.py; the three scenarios here
are their real-mount counterparts: a tmp-dir commit across nodes, a rotation with a store that
fails once and is slow, a directory swap followed by evict and read-back.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfs.engine.keys import PARKING_PREFIX
from tests.mounting import Mount, Mounter, ckptfs, sync
from tests.s3bucket import FAULT_RULES, PREFIX, Bucket, crc
from tests.s3server import Rule

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]

KiB = 1024
TTL = 1.0  # metadata_ttl of both nodes: how long a listing is trusted


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def wait_until(what: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s: {message}")
        time.sleep(0.1)


def nodes(mounter: Mounter, bucket: Bucket, tmp_path: Path) -> tuple[Mount, Mount]:
    cfg = bucket.config(tmp_path / "node.toml", node_poll_interval="0.2s",
                        metadata_ttl=f"{TTL}s")
    return mounter("a", config=cfg), mounter("b", config=cfg)


def ls_r(root: Path) -> dict[str, int]:
    """What ``ls -lR`` sees: every file under ``root`` and its size (directories listed
    afresh once their ttl has passed)."""
    found: dict[str, int] = {}
    for top, _dirs, files in os.walk(root):
        for name in files:
            path = Path(top, name)
            found[str(path.relative_to(root))] = path.stat().st_size
    return found


def evict(m: Mount, *paths: str) -> None:
    for p in paths:
        ckptfs("evict", m.path / p)
        assert m.state(p) == "remote", (p, m.state(p))


def log_of(m: Mount) -> str:
    log = m.staging / "daemon.log"
    return log.read_text(errors="replace") if log.exists() else ""


def control_keys(bucket: Bucket, under: str) -> list[str]:
    reply = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=PREFIX + under)
    return [o["Key"] for o in reply.get("Contents", [])]


def assert_store(bucket: Bucket, files: dict[str, bytes]) -> None:
    """The store's files (directory markers aside) are exactly ``files``, with their bytes
    and the checksum the writer recorded."""
    keys = {k for k in bucket.sizes() if not k.endswith("/")}
    assert keys == set(files), f"store holds {sorted(keys)}"
    for key, data in files.items():
        body, meta, _ = bucket.get(key)
        assert body == data, f"{key}: the store holds other bytes ({body[:8]!r}...)"
        assert meta.get("ckptfs-checksum") == crc(data), key


RENAME_EXCHANGE = 2
SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}
AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """``renameat2(a, b, RENAME_EXCHANGE)`` through the raw system call."""
    libc = ctypes.CDLL(None, use_errno=True)
    number = SYS_RENAMEAT2.get(platform.machine())
    if number is None:
        pytest.skip(f"renameat2's number on {platform.machine()} is not known here")
    if libc.syscall(number, AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b),
                    RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


@pytest.mark.parametrize("a_synced", [True, False], ids=["both-synced", "a-not-synced"])
def test_tmp_dir_commit_across_nodes_leaves_only_the_committed_name(
        mounter: Mounter, bucket: Bucket, tmp_path: Path, a_synced: bool) -> None:
    """Every node writes its shard into ``step_1.tmp/``, rank 0 (node A) renames it to
    ``step_1`` as soon as every shard is committed (B synced; A too, or A not even that:
    its own shard and marker of ``step_1.tmp`` are still to be uploaded). A's listing of
    ``step_1.tmp`` is within its ttl (A made the directory; its ttl is long): the rename
    must list it anyway, and take B's shard along. Node B, listing again, follows the
    rename: nothing is uploaded under ``step_1.tmp`` again, and B reads both shards under
    ``step_1/``."""
    a = mounter("a", config=bucket.config(tmp_path / "a.toml", node_poll_interval="0.2s",
                                          metadata_ttl="60s"))
    b = mounter("b", config=bucket.config(tmp_path / "b.toml", node_poll_interval="0.2s",
                                          metadata_ttl=f"{TTL}s"))
    shards = {"shard_0": os.urandom(300 * KiB), "shard_1": os.urandom(200 * KiB)}
    (a.path / "step_1.tmp").mkdir()
    assert os.listdir(a.path / "step_1.tmp") == []
    write(a.path / "step_1.tmp/shard_0", shards["shard_0"])
    write(b.path / "step_1.tmp/shard_1", shards["shard_1"])
    sync(b)
    if a_synced:
        sync(a)
        assert_store(bucket, {f"step_1.tmp/{n}": d for n, d in shards.items()})
    os.rename(a.path / "step_1.tmp", a.path / "step_1")
    assert sorted(os.listdir(a.path / "step_1")) == ["shard_0", "shard_1"]
    sync(a)
    committed = {f"step_1/{n}": d for n, d in shards.items()}
    assert_store(bucket, committed)

    for _ in range(3):  # ls -R on B a few times, as a user would; B's uploader idle each time
        time.sleep(TTL + 0.3)
        seen = ls_r(b.path)
        sync(b)
        assert not [k for k in bucket.sizes() if k.startswith("step_1.tmp")], (
            f"step_1.tmp came back in the store; B's log:\n{log_of(b)}")
    assert seen == {f"step_1/{n}": len(d) for n, d in shards.items()}, seen
    assert not (b.path / "step_1.tmp").exists()
    for name, data in shards.items():
        assert (b.path / "step_1" / name).read_bytes() == data, name
        assert (a.path / "step_1" / name).read_bytes() == data, name
    assert_store(bucket, committed)
    assert "uploading the local copy again" not in log_of(b), log_of(b)


@pytest.mark.moto(FAULT_RULES)
@pytest.mark.parametrize("fail", [1, 3], ids=["503-hidden-by-botocore", "503-seen-by-ckptfs"])
def test_rotation_with_a_store_that_fails_once_and_is_slow(
        mounter: Mounter, bucket: Bucket, tmp_path: Path, fail: int) -> None:
    """``mv ckpt ckpt.prev; mv ckpt.new ckpt`` of evicted files (the store holds the only
    copies) while the endpoint answers 503 SlowDown to the first request on ``ckpt`` (fail=1:
    botocore's own retry absorbs it; fail=3: one failed store call that ckptfs retries) and
    answers slowly, HEADs of ``ckpt`` slowest (a copy to ``ckpt`` landing between the first
    move's HEAD and COPY would take the old checkpoint)."""
    a, b = nodes(mounter, bucket, tmp_path)
    old, new = os.urandom(400 * KiB), os.urandom(300 * KiB)
    write(a.path / "ckpt", old)
    write(a.path / "ckpt.new", new)
    sync(a)
    evict(a, "ckpt", "ckpt.new")
    rules = (Rule(bucket.name, key=PREFIX + "ckpt", fail=fail),
             Rule(bucket.name, key=PREFIX + "ckpt", methods=("HEAD",), delay=1.0),
             Rule(bucket.name, delay=0.1))
    with bucket.server.inject(*rules):
        os.rename(a.path / "ckpt", a.path / "ckpt.prev")
        os.rename(a.path / "ckpt.new", a.path / "ckpt")
        sync(a, timeout=90)
    assert len(rules[0].failed) == fail, rules[0].failed  # the fault did fire
    if fail == 3:  # past botocore's retries: ckptfs's uploader saw it and tried again
        assert "upload of ckpt.prev failed (attempt 1" in log_of(a), log_of(a)
    assert_store(bucket, {"ckpt.prev": old, "ckpt": new})
    evict(a, "ckpt", "ckpt.prev")
    assert (a.path / "ckpt.prev").read_bytes() == old
    assert (a.path / "ckpt").read_bytes() == new
    time.sleep(TTL + 0.3)  # node B's listing of the root is stale: it lists again
    assert sorted(os.listdir(b.path)) == ["ckpt", "ckpt.prev"]
    assert (b.path / "ckpt.prev").read_bytes() == old
    assert (b.path / "ckpt").read_bytes() == new


@pytest.mark.moto(FAULT_RULES)
def test_directory_exchange_then_evict_reads_the_swapped_bytes(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """``renameat2(cur, nxt, RENAME_EXCHANGE)`` of two directories that both hold
    ``model.pt``, over a slow endpoint: the store's keys swap (a ring of moves, broken by a
    parked copy that is then deleted), and after ``ckptfs evict`` each path reads the bytes
    written to it, on this node and on the other."""
    a, b = nodes(mounter, bucket, tmp_path)
    cur, nxt, extra = os.urandom(300 * KiB), os.urandom(350 * KiB), os.urandom(10 * KiB)
    write(a.path / "cur/model.pt", cur)
    write(a.path / "nxt/model.pt", nxt)
    write(a.path / "nxt/extra.pt", extra)
    sync(a)
    assert_store(bucket, {"cur/model.pt": cur, "nxt/model.pt": nxt, "nxt/extra.pt": extra})
    with bucket.server.inject(Rule(bucket.name, delay=0.1)):
        exchange(a.path / "cur", a.path / "nxt")
        assert (a.path / "cur/model.pt").read_bytes() == nxt
        sync(a, timeout=90)
    assert_store(bucket, {"cur/model.pt": nxt, "nxt/model.pt": cur, "cur/extra.pt": extra})
    assert control_keys(bucket, PARKING_PREFIX) == []
    evict(a, "cur/model.pt", "nxt/model.pt", "cur/extra.pt")
    assert (a.path / "cur/model.pt").read_bytes() == nxt
    assert (a.path / "nxt/model.pt").read_bytes() == cur
    assert (a.path / "cur/extra.pt").read_bytes() == extra
    time.sleep(TTL + 0.3)
    assert ls_r(b.path) == {"cur/model.pt": len(nxt), "cur/extra.pt": len(extra),
                            "nxt/model.pt": len(cur)}
    assert (b.path / "cur/model.pt").read_bytes() == nxt
    assert (b.path / "nxt/model.pt").read_bytes() == cur


@pytest.mark.moto(FAULT_RULES)
def test_tmp_dir_commit_while_another_nodes_shard_is_uploading(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """DCP into ``step_1.tmp/`` then rank 0's rename, as frameworks do after the job's
    barrier: B's shard is closed before A writes ``.metadata`` and renames, but B's upload
    is slow and lands after the rename. ``step_1/`` must end with every shard (the marker
    waits for them under the name it is committed at) and no ``step_1.tmp`` key is left."""
    a, b = nodes(mounter, bucket, tmp_path)
    s0, s1 = os.urandom(100 * KiB), os.urandom(100 * KiB)
    slow_put = Rule(bucket.name, key=PREFIX + "step_1.tmp/__1_0.distcp", methods=("PUT",),
                    delay=3.0)
    with bucket.server.inject(slow_put):
        write(a.path / "step_1.tmp/__0_0.distcp", s0)
        write(b.path / "step_1.tmp/__1_0.distcp", s1)  # closed: the barrier is passed
        write(a.path / "step_1.tmp/.metadata", b"metadata of step 1")
        os.rename(a.path / "step_1.tmp", a.path / "step_1")
        sync(a, timeout=60)
        sync(b, timeout=60)
    time.sleep(TTL + 0.3)
    ls_r(a.path), ls_r(b.path)
    sync(a)
    sync(b)
    assert_store(bucket, {"step_1/__0_0.distcp": s0, "step_1/__1_0.distcp": s1,
                          "step_1/.metadata": b"metadata of step 1"})
