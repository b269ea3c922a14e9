"""Real mounts of several nodes: a dead reader blocks nobody, a read-only
mount, what ``nodes``/``status`` say about a node waited for, and what ``umount`` says about
files it leaves behind (docs/SEMANTICS.md, "Many nodes"; docs/OPERATIONS.md).

Mounts on this machine over one S3 prefix on the session's SeaweedFS stand for the nodes of a job
(tests/test_multinode_mount.py); tests/test_multinode_lazy.py checks the registration
protocol itself without a mount.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from ckptfs.cluster.coordination import NODES
from ckptfs.fuse.mountinfo import find
from tests.mounting import Mounter, ckptfs, is_mounted, status, sync, wait_dead, wait_for
from tests.s3bucket import PREFIX, Bucket

pytestmark = [pytest.mark.mount, pytest.mark.timeout(600)]

MiB = 1024 * 1024
SLOW = 200_000  # bytes per second: a 4 MiB shard takes ~20 s


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def registered(bucket: Bucket) -> set[str]:
    """The node ids registered in the store, as a reader of the bucket sees them."""
    reply = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=PREFIX + NODES)
    return {o["Key"][len(PREFIX + NODES):] for o in reply.get("Contents", [])}


def test_a_killed_reader_holds_no_marker_and_a_dead_writer_is_explained(
    mounter: Mounter, bucket: Bucket, tmp_path: Path
) -> None:
    fast = bucket.config(tmp_path / "fast.toml", node_poll_interval="0.2s",
                         metadata_ttl="1s")
    slow = bucket.config(tmp_path / "slow.toml", node_poll_interval="0.2s",
                         faults={"bandwidth": SLOW})
    a, reader = mounter("a", config=fast), mounter("reader", config=fast)
    a_id, reader_id = (str(status(m)["node"]["node"]) for m in (a, reader))
    write(a.path / "step_1/__0_0.distcp", os.urandom(MiB))
    write(a.path / "step_1/.metadata", b"meta 1")
    sync(a)
    # The reader lists and reads (a fault-in), then is SIGKILLed: it never registered.
    wait_for("step_1 on the reader", lambda: "step_1" in os.listdir(reader.path))
    assert (reader.path / "step_1/.metadata").read_bytes() == b"meta 1"
    assert status(reader)["node"]["registered"] is False
    reader.kill()
    assert reader_id not in registered(bucket)
    write(a.path / "step_2/__0_0.distcp", os.urandom(MiB))
    write(a.path / "step_2/.metadata", b"meta 2")
    sync(a, timeout=30)  # not held by the dead reader
    assert "step_2/.metadata" in bucket.sizes()
    assert registered(bucket) == {a_id}

    # A writer killed mid-upload is waited for; status names it, when it was last seen,
    # and what to do.
    b = mounter("b", config=slow)
    b_id = str(status(b)["node"]["node"])
    write(b.path / "step_3/__1_0.distcp", os.urandom(4 * MiB))
    assert b_id in registered(bucket)
    write(a.path / "step_3/.metadata", b"meta 3")
    b.kill()
    shown = wait_for("status saying when the dead node was last seen", lambda: (
        text if " ago" in (text := ckptfs("status", a.path).stdout) else None), 60)
    assert b_id in shown and "--forget" in shown, shown
    nodes = {n["node"]: n for n in json.loads(ckptfs("nodes", a.path, "--json").stdout)["nodes"]}
    assert set(nodes) == {a_id, b_id}
    # Files pending as of its last heartbeat (none yet: it registered at its first open).
    assert nodes[b_id]["waited_for"] and nodes[b_id]["pending_files"] == 0
    assert isinstance(nodes[b_id]["seen_ago_s"], float)
    assert "token" not in json.dumps(nodes)
    table = ckptfs("nodes", a.path).stdout
    assert "last seen" in table and "ago" in table
    ckptfs("nodes", a.path, "--forget", b_id)
    sync(a, timeout=60)
    assert "step_3/.metadata" in bucket.sizes()


def test_a_read_only_mount_changes_nothing_and_registers_nowhere(
    mounter: Mounter, bucket: Bucket, tmp_path: Path
) -> None:
    config = bucket.config(tmp_path / "c.toml", metadata_ttl="1s")
    w = mounter("w", config=config)
    write(w.path / "step_1/model.pt", b"weights")
    sync(w)
    ro = mounter("ro", config=config, extra=["-o", "ro"])
    entry = find(ro.path)
    assert entry is not None and "ro" in entry.options.split(",")
    assert (ro.path / "step_1/model.pt").read_bytes() == b"weights"
    for change in (lambda: write(ro.path / "new", b"x"),
                   lambda: (ro.path / "dir").mkdir(),
                   lambda: (ro.path / "step_1/model.pt").unlink(),
                   lambda: os.chmod(ro.path / "step_1/model.pt", 0o600)):
        with pytest.raises(OSError) as info:
            change()
        assert info.value.errno == errno.EROFS
    assert str(status(ro)["node"]["node"]) not in registered(bucket)
    ro.umount()
    # --read-only is the same; a staging directory with files left is refused in one line
    # (tested in test_umount_says_what_it_leaves_behind).
    ro.extra = ["--read-only"]
    ro.remount()
    assert "ro" in (find(ro.path) or entry).options.split(",")


def test_umount_says_what_it_leaves_behind(
    mounter: Mounter, bucket: Bucket, tmp_path: Path
) -> None:
    slow = bucket.config(tmp_path / "slow.toml", node_poll_interval="0.2s",
                         faults={"bandwidth": SLOW})
    fast = bucket.config(tmp_path / "fast.toml", node_poll_interval="0.2s")
    m = mounter("m", config=slow)
    node = str(status(m)["node"]["node"])
    write(m.path / "step_1/shard", os.urandom(4 * MiB))
    done = ckptfs("umount", m.path, "--no-wait")
    assert done.returncode == 0
    assert (f"1 file (4.0 MiB) not uploaded; it stays in {m.staging} and goes up at the next "
            "mount") in done.stderr, done.stderr
    assert f"node {node} stays registered" in done.stderr
    assert node in registered(bucket)

    # A read-only mount would never upload them: refused, in one line.
    refused = ckptfs("mount", m.path, "--staging", m.staging, "--config", fast,
                     "--read-only", check=False)
    assert refused.returncode != 0 and not is_mounted(m.path)
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "not uploaded" in refused.stderr and "read-write" in refused.stderr

    # --strict makes it an error (exit 3).
    m.remount()
    write(m.path / "step_2/shard", os.urandom(4 * MiB))
    strict = ckptfs("umount", m.path, "--no-wait", "--strict", check=False)
    assert strict.returncode == 3 and "not uploaded" in strict.stderr

    # --lazy with a file still open: the daemon stays until it is closed, and says so.
    m.config = fast
    m.remount()
    pid = m.pid
    with open(m.path / "step_3", "wb") as f:
        f.write(b"x")
        lazy = ckptfs("umount", m.path, "--lazy", "--no-wait")
        assert lazy.returncode == 0 and f"pid {pid}" in lazy.stderr, lazy.stderr
        assert "still open" in lazy.stderr and str(m.staging) in lazy.stderr
    wait_dead(pid, timeout=60)

    # Mounted again (a fast store): everything goes up; a clean umount says nothing and
    # deregisters.
    m.remount()
    sync(m, timeout=60)
    assert {"step_1/shard", "step_2/shard", "step_3"} <= set(bucket.sizes())
    clean = ckptfs("umount", m.path)
    assert clean.stderr.strip() == "", clean.stderr
    assert node not in registered(bucket)
    time.sleep(0.1)
    assert not is_mounted(m.path)
