"""Real mounts: retention moving checkpoints to an archive class of the warm tier's prefix,
``ckptfs restore`` of them, and what retention does next.

Policy: hot and warm keep the last complete checkpoint, ``cold`` (the warm tier's prefix in
GLACIER) keeps them all; retention runs only when asked (``ckptfs retention --apply``).

On moto (``moto`` marker): these tests restore archived objects, which SeaweedFS cannot.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, ckptfs, sync
from tests.s3bucket import ARCHIVE, PREFIX, Bucket, store_lines

pytestmark = [pytest.mark.mount, pytest.mark.timeout(600), pytest.mark.moto(ARCHIVE)]


def archive_config(bucket: Bucket, path: Path) -> Path:
    url = f"s3://{bucket.name}/{PREFIX.rstrip('/')}"
    store = "\n".join(store_lines(bucket.server))
    path.write_text(f"""
retention_interval = 0
metadata_ttl = "1s"
log_level = "debug"

[[tier]]
name = "hot"
keep = {{ last = 1 }}

[[tier]]
name = "warm"
url = "{url}"
{store}
keep = {{ last = 1 }}

[[tier]]
name = "cold"
url = "{url}?storage_class=GLACIER"
{store}
keep = {{ all = true }}
""")
    return path


def storage_class(bucket: Bucket, key: str) -> str:
    head = bucket.client.head_object(Bucket=bucket.name, Key=PREFIX + key)
    return str(head.get("StorageClass", "STANDARD"))


def daemon_log(m: Mount) -> str:
    return (m.staging / "daemon.log").read_text(errors="replace")


def write_checkpoints(m: Mount, steps: range) -> dict[str, bytes]:
    bodies = {}
    for step in steps:
        (m.path / f"step_{step}").mkdir()
        bodies[f"step_{step}/model.pt"] = data = os.urandom(256 * 1024 + step)
        (m.path / f"step_{step}" / "model.pt").write_bytes(data)
        (m.path / f"step_{step}" / ".metadata").write_bytes(b"m")
    return bodies


def apply(m: Mount) -> dict[str, object]:
    out: dict[str, object] = json.loads(ckptfs("retention", m.path, "--apply", "--json").stdout)
    return out


def test_archived_checkpoint_on_the_node_that_archived_it(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """After retention moved step_1 to GLACIER (in place) and evicted it, the node
    that did it says ``archived``, open() fails at once with EAGAIN naming `ckptfs restore`,
    and ``ckptfs restore`` restores it; the same after a remount."""
    a = mounter("a", config=archive_config(bucket, tmp_path / "c.toml"))
    bodies = write_checkpoints(a, range(1, 4))
    sync(a)
    apply(a)
    assert storage_class(bucket, "step_1/model.pt") == "GLACIER"
    assert storage_class(bucket, "step_3/model.pt") == "STANDARD"
    path = a.path / "step_1" / "model.pt"
    assert a.state("step_1/model.pt") == "archived"
    with pytest.raises(OSError) as caught:
        path.read_bytes()
    assert caught.value.errno == errno.EAGAIN
    assert f"run `ckptfs restore {path}`" in daemon_log(a)
    a.umount()
    a.remount()
    assert a.state("step_2/model.pt") == "archived"
    done = ckptfs("restore", a.path / "step_1", "--poll-interval", "0.2", "--timeout", "60")
    assert "restored 2 files" in done.stdout, done.stdout
    assert path.read_bytes() == bodies["step_1/model.pt"]
    assert storage_class(bucket, "step_1/model.pt") == "STANDARD"


def test_retention_keeps_a_restored_checkpoint_where_restore_put_it(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """``restore --local`` of an archived checkpoint, then a retention run: it stays
    in the warm class and on NVMe (a pin, shown by ls-tiers), instead of going straight back
    to GLACIER and being evicted."""
    a = mounter("a", config=archive_config(bucket, tmp_path / "c.toml"))
    bodies = write_checkpoints(a, range(1, 4))
    sync(a)
    apply(a)
    assert a.state("step_1/model.pt") == "archived"
    ckptfs("restore", a.path / "step_1", "--local", "--days", "2", "--poll-interval", "0.2",
           "--timeout", "60")
    assert a.state("step_1/model.pt") == "committed"
    result = apply(a)
    done: list[dict[str, object]] = result["done"]  # type: ignore[assignment]
    assert not [d for d in done if d["checkpoint"] == "step_1"], result
    assert storage_class(bucket, "step_1/model.pt") == "STANDARD"
    assert a.state("step_1/model.pt") == "committed"
    assert (a.path / "step_1" / "model.pt").read_bytes() == bodies["step_1/model.pt"]
    table = ckptfs("ls-tiers", a.path, env={**os.environ, "COLUMNS": "300"}).stdout
    rows = {ln.split()[1]: ln for ln in table.splitlines() if ln.startswith("│ step_")}
    assert "warm: restored, pinned until" in rows["step_1"], table
    assert "hot: restored, pinned until" in rows["step_1"], table
    assert "pinned" not in rows["step_2"], table


def test_restore_finds_files_archived_behind_the_node(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    """The other way round: a lifecycle rule (or another node's retention) moved an
    evicted file to GLACIER in place (same ETag). The node's ``restore`` lists the store
    again and finds it, instead of ``nothing to restore``; a read before that logs what to
    do (``ckptfs restore``), not a bare InvalidObjectState."""
    a = mounter("a", config=bucket.config(tmp_path / "c.toml", metadata_ttl="1h"))
    (a.path / "step_1").mkdir()
    data = os.urandom(300 * 1024)
    for name in ("model.pt", "other.pt"):
        (a.path / "step_1" / name).write_bytes(data)
    sync(a)
    ckptfs("evict", a.path / "step_1")
    for name in ("model.pt", "other.pt"):
        key = PREFIX + "step_1/" + name
        bucket.client.copy_object(Bucket=bucket.name, Key=key, StorageClass="GLACIER",
                                  CopySource={"Bucket": bucket.name, "Key": key},
                                  MetadataDirective="COPY")
    # moto thaws at once: the read may succeed on the kernel's retry, but the first one met
    # the archive and said what to do (the core tests check the errno: tests/
    # test_retention_archive.py).
    with contextlib.suppress(OSError):
        (a.path / "step_1" / "other.pt").read_bytes()
    assert "run `ckptfs restore" in daemon_log(a)
    done = ckptfs("restore", a.path / "step_1", "--poll-interval", "0.2", "--timeout", "60")
    assert "restored 2 files" in done.stdout, done.stdout
    assert (a.path / "step_1" / "model.pt").read_bytes() == data
