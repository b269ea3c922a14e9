"""Real-mount acceptance tests of commit order across nodes (docs/SEMANTICS.md, "Many nodes").

Several mounts on this machine, each with its own staging directory, over one S3 prefix on the
session's SeaweedFS stand for the nodes of a training job. Node B's store is slowed down (the tier's
``faults.bandwidth``), so its shard is still uploading when rank 0 on node A writes the
checkpoint's ``.metadata``. What the store holds is read with boto3, as a reader on another
machine would.

tests/test_multinode.py checks the same protocol without a mount (memory store, virtual clock).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, ckptfs, status, sync
from tests.s3bucket import Bucket, crc

pytestmark = [pytest.mark.mount, pytest.mark.timeout(600)]

MiB = 1024 * 1024
SLOW = 200_000  # bytes per second of the slow node's store: its 4 MiB shard takes ~20 s


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def node_of(m: Mount) -> str:
    return str(status(m)["node"]["node"])


def wait_until(what: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s: {message}")
        time.sleep(0.1)


class Watcher:
    """Lists the bucket over and over; records what the store held when the marker appeared."""

    def __init__(self, bucket: Bucket, marker: str) -> None:
        self.bucket = bucket
        self.marker = marker
        self.seen_with: dict[str, int] | None = None

    def poll(self) -> bool:
        listing = self.bucket.sizes()
        if self.marker in listing and self.seen_with is None:
            self.seen_with = listing
        return self.seen_with is not None


@pytest.mark.both_modes  # what a shard's close records differs (passthrough: fstat at flush)
def test_a_marker_waits_for_every_nodes_shards_and_for_a_killed_node_to_come_back(
    mounter: Mounter, bucket: Bucket, tmp_path: Path
) -> None:
    fast = bucket.config(tmp_path / "fast.toml", node_poll_interval="0.2s")
    slow = bucket.config(tmp_path / "slow.toml", node_poll_interval="0.2s",
                         faults={"bandwidth": SLOW})
    a, b, c = mounter("a", config=fast), mounter("b", config=slow), mounter("c", config=fast)
    b_id = node_of(b)
    shards = {f"step_1/__{rank}_0.distcp": os.urandom(size) for rank, size in
              ((0, MiB), (1, 4 * MiB), (2, MiB))}
    # DCP: every rank writes its shard; after the barrier rank 0 writes the metadata.
    for m, (key, data) in zip((a, b, c), shards.items()):
        write(m.path / key, data)
    write(a.path / "step_1/.metadata", b"metadata of step 1")
    watch = Watcher(bucket, "step_1/.metadata")

    # A's and C's shards land; the marker waits for B's, which is uploading.
    wait_until(lambda: {"step_1/__0_0.distcp", "step_1/__2_0.distcp"} <= set(bucket.sizes()),
               60, "the fast nodes' shards in the store")
    wait_until(lambda: status(a)["node"]["waiting_for"] == [b_id], 30,
               "node A's marker waiting for node B")
    assert not watch.poll()
    assert status(a)["node"]["held_markers"] == ["step_1/.metadata"]

    # B dies mid-upload: the marker stays out of the store, and A says whom it waits for.
    b.kill()
    time.sleep(3)
    assert not watch.poll()
    assert "step_1/__1_0.distcp" not in bucket.sizes()
    assert status(a)["node"]["waiting_for"] == [b_id]
    listed = json.loads(ckptfs("nodes", a.path, "--json").stdout)
    assert {n["node"]: n["waited_for"] for n in listed["nodes"]} == {
        node_of(a): False, b_id: True, node_of(c): False}
    shown = ckptfs("status", a.path).stdout
    assert "step_1/.metadata" in shown and b_id in shown

    # B restarts over the same staging directory (the same node), faster this time: it
    # uploads its shard and acknowledges, and only then does the marker land.
    b.config = fast
    b.remount()
    assert node_of(b) == b_id
    wait_until(watch.poll, 120, "the marker in the store after B came back")
    assert watch.seen_with is not None
    assert set(shards) <= set(watch.seen_with), "the marker landed before a shard"
    for key, data in shards.items():
        body, meta, _ = bucket.get(key)
        assert body == data and meta["ckptfs-checksum"] == crc(data), key
    for m in (a, b, c):
        sync(m)


# One mode: forgetting a node is the registry's business, not the data path's.
def test_a_dead_node_can_be_forgotten(mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    fast = bucket.config(tmp_path / "fast.toml", node_poll_interval="0.2s")
    slow = bucket.config(tmp_path / "slow.toml", node_poll_interval="0.2s",
                         faults={"bandwidth": SLOW})
    a, b = mounter("a", config=fast), mounter("b", config=slow)
    b_id = node_of(b)
    write(b.path / "step_1/__1_0.distcp", os.urandom(4 * MiB))
    write(a.path / "step_1/.metadata", b"meta")
    wait_until(lambda: status(a)["node"]["waiting_for"] == [b_id], 30, "A waiting for B")
    b.kill()
    # `sync` says why it cannot finish.
    stuck = ckptfs("sync", a.path, "--timeout", "2", check=False)
    assert stuck.returncode == 1
    assert "step_1/.metadata" not in bucket.sizes()

    done = ckptfs("nodes", a.path, "--forget", b_id)
    assert b_id not in done.stdout
    sync(a, timeout=60)  # released: the checkpoint is torn, as the operator chose
    assert "step_1/.metadata" in bucket.sizes()
    assert "step_1/__1_0.distcp" not in bucket.sizes()

    # Forgetting is refused for oneself and for unknown nodes, in one line.
    for bad in (node_of(a), "no-such-node"):
        refused = ckptfs("nodes", a.path, "--forget", bad, check=False)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    # B comes back: it registers again and uploads what it had.
    b.config = fast
    b.remount()
    sync(b, timeout=120)
    assert "step_1/__1_0.distcp" in bucket.sizes()
    assert b_id in {n["node"] for n in json.loads(
        ckptfs("nodes", a.path, "--json").stdout)["nodes"]}
