"""Nodes changing each other's files, on real mounts over SeaweedFS (docs/SEMANTICS.md, "Many
nodes, one checkpoint", "Changes to another node's files").

Several mounts on this machine, each with its own staging directory, over one S3 prefix of the
session's SeaweedFS stand for the nodes of a training job; each rank writes through its own
node's mount. What the store holds is read with boto3, as a reader on another machine would,
and what a fresh node sees through a mount of its own.

tests/test_model_nodes.py checks the same rules on generated programs without a mount.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, ckptfs, sync
from tests.s3bucket import Bucket

pytestmark = [pytest.mark.mount, pytest.mark.timeout(600)]

SLOW = 100_000  # bytes per second of a slowed node's store
SETTINGS = {"node_poll_interval": "0.2s", "metadata_ttl": "1s"}


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def view(m: Mount) -> dict[str, bytes]:
    """Every file the mount shows (a listing of every directory, as ``ls -R`` does), read."""
    out = {}
    for top, _, names in os.walk(m.path):
        for name in names:
            path = Path(top) / name
            out[str(path.relative_to(m.path))] = path.read_bytes()
    return out


def wait_until(what: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s: {message}")
        time.sleep(0.2)


def stored(bucket: Bucket) -> dict[str, bytes]:
    return {key: bucket.get(key)[0] for key in bucket.sizes() if not key.endswith("/")}


def converged(bucket: Bucket, mounts: list[Mount], expected: dict[str, bytes]) -> None:
    """The store and every mount's view (each listed again until it agrees, past its
    ``metadata_ttl``) hold exactly ``expected``."""
    for m in mounts:
        sync(m)
    wait_until(lambda: stored(bucket) == expected, 120,
               f"the store holds {sorted(expected)} (it holds {sorted(stored(bucket))})")
    for m in mounts:
        wait_until(lambda m=m: view(m) == expected, 60,  # type: ignore[misc]
                   f"{m.path} shows {sorted(expected)} (it shows {sorted(view(m))})")
    for m in mounts:
        sync(m)  # nothing was uploaded again meanwhile
    assert stored(bucket) == expected


def test_rank0_rotation_removes_every_nodes_shards(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """DeepSpeed's rotation: every rank saves its shard of ``global_stepN/``, rank 0 writes
    ``latest`` and removes all but the last two checkpoints with ``shutil.rmtree``. The other
    nodes' shards of the removed checkpoints must not come back (they still have them on
    NVMe), on any node or a fresh one."""
    config = bucket.config(tmp_path / "c.toml", **SETTINGS)
    nodes = [mounter(name, config=config) for name in ("a", "b", "c")]
    expected: dict[str, bytes] = {}
    for step in range(1, 6):
        for rank, m in enumerate(nodes):
            data = os.urandom(50_000 + rank)
            write(m.path / f"global_step{step}/zero_pp_rank_{rank}_optim_states.pt", data)
            expected[f"global_step{step}/zero_pp_rank_{rank}_optim_states.pt"] = data
        for m in nodes:  # the job's barrier, and the shards in the store before rank 0 looks
            sync(m)
        write(nodes[0].path / "latest", f"global_step{step}".encode())
        expected["latest"] = f"global_step{step}".encode()
        for old in range(1, step - 1):
            if (nodes[0].path / f"global_step{old}").exists():
                shutil.rmtree(nodes[0].path / f"global_step{old}")
            expected = {k: v for k, v in expected.items()
                        if not k.startswith(f"global_step{old}/")}
    converged(bucket, nodes, expected)
    assert {k.split("/")[0] for k in expected} == {"global_step4", "global_step5", "latest"}
    fresh = mounter("fresh", config=config)
    assert view(fresh) == expected


def test_a_shard_rewritten_during_a_tmp_dir_commit_is_published_in_its_new_version(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """Node B's shard is committed, then rewritten (closed before the job's barrier, still
    uploading) when rank 0 on node A renames ``step_1.tmp`` to ``step_1``: A's listing saw the
    first version, the checkpoint must be published with the second, and nothing left under
    ``step_1.tmp``."""
    fast = bucket.config(tmp_path / "fast.toml", **SETTINGS)
    slow = bucket.config(tmp_path / "slow.toml", faults={"bandwidth": SLOW}, **SETTINGS)
    a, b = mounter("a", config=fast), mounter("b", config=slow)
    v1, v2, own = os.urandom(100_000), os.urandom(400_000), os.urandom(50_000)
    write(b.path / "step_1.tmp/shard_1", v1)
    write(a.path / "step_1.tmp/shard_0", own)
    sync(a)
    sync(b)
    assert (a.path / "step_1.tmp/shard_1").read_bytes() == v1  # A sees the first version
    write(b.path / "step_1.tmp/shard_1", v2)  # ~4 s to upload
    write(a.path / "step_1.tmp/.metadata", b"metadata")  # after the job's barrier
    os.rename(a.path / "step_1.tmp", a.path / "step_1")
    wait_until(lambda: "step_1/.metadata" in bucket.sizes(), 120, "the marker published")
    assert bucket.get("step_1/shard_1")[0] == v2
    converged(bucket, [a, b], {"step_1/shard_0": own, "step_1/shard_1": v2,
                               "step_1/.metadata": b"metadata"})
    assert view(mounter("fresh", config=fast))["step_1/shard_1"] == v2


def test_another_nodes_marker_in_a_renamed_tmp_dir_follows_its_shard(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """Node B writes its shard and its own commit marker (``b.done``) into ``step_1.tmp``
    (its shard still uploading) before rank 0 renames it: ``step_1/b.done`` never appears
    without ``step_1/shard_1``, and neither stays behind under ``step_1.tmp``."""
    fast = bucket.config(tmp_path / "fast.toml", **SETTINGS)
    slow = bucket.config(tmp_path / "slow.toml", faults={"bandwidth": SLOW}, **SETTINGS)
    a, b = mounter("a", config=fast), mounter("b", config=slow)
    shard = os.urandom(400_000)
    write(b.path / "step_1.tmp/shard_1", shard)
    write(b.path / "step_1.tmp/b.done", b"done")
    write(a.path / "step_1.tmp/.metadata", b"metadata")
    os.rename(a.path / "step_1.tmp", a.path / "step_1")
    seen: list[set[str]] = []

    def marker_seen() -> bool:
        keys = set(bucket.sizes())
        if "step_1/b.done" in keys:
            seen.append(keys)
        return bool(seen)

    wait_until(marker_seen, 120, "B's marker under the new name")
    assert "step_1/shard_1" in seen[0], "B's marker was published before its shard"
    converged(bucket, [a, b], {"step_1/shard_1": shard, "step_1/b.done": b"done",
                               "step_1/.metadata": b"metadata"})


def test_a_hard_link_reads_after_another_node_removed_the_heads_checkpoint(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """``step_100/model.pt`` linked as ``best/model.pt`` on node A, both committed; A's copy
    is evicted; node B removes ``step_100``. The link still reads, from its own object."""
    config = bucket.config(tmp_path / "c.toml", **SETTINGS)
    a, b = mounter("a", config=config), mounter("b", config=config)
    data = os.urandom(300_000)
    write(a.path / "step_100/model.pt", data)
    (a.path / "best").mkdir()
    os.link(a.path / "step_100/model.pt", a.path / "best/model.pt")
    sync(a)
    ckptfs("evict", a.path / "step_100")
    wait_until(lambda: (b.path / "step_100/model.pt").exists(), 30, "B sees step_100")
    shutil.rmtree(b.path / "step_100")
    sync(b)
    wait_until(lambda: "step_100/model.pt" not in bucket.sizes(), 60, "step_100 removed")
    assert (a.path / "best/model.pt").read_bytes() == data
    converged(bucket, [a, b], {"best/model.pt": data})
