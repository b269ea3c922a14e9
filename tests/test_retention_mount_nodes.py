"""Retention with two real mounts over one S3 prefix (SeaweedFS), docs/RETENTION.md "Several nodes".

Node A and node B write multi-node checkpoints (each a shard, A the ``.metadata`` marker), B
also a whole checkpoint of its own, and two that never got their marker (an old one and the
newest). Policy: the warm tier keeps the last complete one. Then:

- A applies (slowed by injected store latency) and holds ``.ckptfs/retention.lease``;
  meanwhile B's ``ckptfs retention --apply`` skips the round and names A as the holder;
- A's run deletes old complete checkpoints including B's shards and B's own checkpoint (the
  inventory is the store listing, not A's journal), keeps the last complete one whole, and
  leaves both marker-less ones alone (the newest is not counted as newest: last = 1 keeps the
  last complete one); then it releases the lease, and B can apply;
- B, which still had its shards of the deleted checkpoints on NVMe, drops them (they were
  retired by retention) instead of uploading them again: the store stays as A left it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mounting import CKPTFS, Mount, Mounter, ckptfs, sync, wait_for
from tests.s3bucket import PREFIX, Bucket, store_lines

pytestmark = pytest.mark.mount

LEASE = ".ckptfs/retention.lease"


def node_config(bucket: Bucket, path: Path, node: str, latency: str | None = None) -> Path:
    """hot and warm keep the last complete checkpoint; retention runs only when asked."""
    faults = f"\n[tier.faults]\nlatency = {json.dumps(latency)}\n" if latency else ""
    store = "\n".join(store_lines(bucket.server))
    path.write_text(f"""
node_id = "{node}"
retention_interval = 0
metadata_ttl = "1s"
node_poll_interval = "0.2s"
node_idle_poll_interval = "0.5s"
log_level = "debug"

[[tier]]
name = "hot"
keep = {{ last = 1 }}

[[tier]]
name = "warm"
url = "s3://{bucket.name}/{PREFIX.rstrip('/')}"
{store}
keep = {{ last = 1 }}
{faults}""")
    return path


def write(m: Mount, rel: str, data: bytes) -> None:
    path = m.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def lease_holder(bucket: Bucket) -> str | None:
    try:
        body, _, _ = bucket.get(LEASE)
    except Exception:  # noqa: BLE001 (absent)
        return None
    holder: str = json.loads(body)["holder"]
    return holder


def checkpoints_in(bucket: Bucket) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for key in bucket.sizes():
        if key.startswith("step_") and not key.endswith("/"):
            name, _, rest = key.partition("/")
            out.setdefault(name, set()).add(rest)
    return out


def report(m: Mount) -> dict[str, Any]:
    rows = json.loads(ckptfs("ls-tiers", m.path, "--json").stdout)["checkpoints"]
    return {r["name"]: r for r in rows}


def test_one_node_applies_and_sees_every_node_s_checkpoints(
        mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    # A's store requests take 0.4 s each: its run lasts seconds, long enough to watch.
    a = mounter("a", config=node_config(bucket, tmp_path / "a.toml", "node-a", "0.4s"))
    b = mounter("b", config=node_config(bucket, tmp_path / "b.toml", "node-b"))
    write(b, "step_50/__1_0.distcp", b"old, never finished")  # no marker ever
    for step in (100, 200, 300):
        write(b, f"step_{step}/__1_0.distcp", b"b" * step)
        write(a, f"step_{step}/__0_0.distcp", b"a" * step)
        sync(b)  # B's shard is in the store before A's marker is written (as after DCP's
        write(a, f"step_{step}/.metadata", b"meta")  # barrier); the marker comes last
    write(b, "step_150/__0_0.distcp", b"B alone")  # a checkpoint A's journal never saw
    write(b, "step_150/.metadata", b"meta")
    write(b, "step_400/__1_0.distcp", b"newest, still being written")  # no marker yet
    write(a, "step_400/__0_0.distcp", b"newest, still being written")
    sync(a)
    sync(b)
    assert checkpoints_in(bucket) == {
        "step_50": {"__1_0.distcp"},
        "step_100": {"__0_0.distcp", "__1_0.distcp", ".metadata"},
        "step_150": {"__0_0.distcp", ".metadata"},
        "step_200": {"__0_0.distcp", "__1_0.distcp", ".metadata"},
        "step_300": {"__0_0.distcp", "__1_0.distcp", ".metadata"},
        "step_400": {"__0_0.distcp", "__1_0.distcp"},
    }
    wait_for("A to list B's checkpoint",
             lambda: "step_150" in {p.name for p in a.path.iterdir()}, timeout=30)
    rows = report(a)
    assert rows["step_400"]["state"] == "no marker" and rows["step_50"]["state"] == "no marker"
    assert rows["step_300"]["kept_by"] == ["hot: last 1", "warm: last 1"]  # last *complete*
    assert "step_150" in rows and rows["step_150"]["next"] == ["delete"]

    # A applies; while it holds the lease, B skips and says who holds it.
    applying = subprocess.Popen([*CKPTFS, "retention", str(a.path), "--apply"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("A's lease in the store", lambda: lease_holder(bucket) == "node-a",
                 timeout=60, every=0.02)
        skipped = ckptfs("retention", b.path, "--apply", check=False)
        assert skipped.returncode == 1, skipped
        assert "held by node node-a" in skipped.stderr, skipped.stderr
        assert "skipped: the retention lease is held by node node-a" in skipped.stdout
        assert "done " not in skipped.stdout
        out, err = applying.communicate(timeout=300)
    finally:
        if applying.poll() is None:
            applying.kill()
    assert applying.returncode == 0, (out, err)
    for name in ("step_100", "step_150", "step_200"):
        assert f"done     {name}: delete" in out, out
    assert not [ln for ln in out.splitlines() if not ln.startswith("skipped  ") and
                any(n in ln for n in ("step_300", "step_400", "step_50"))], out
    # Without a marker and with another node writing: left alone, and the output says why.
    assert "skipped  step_400: no commit marker, and other nodes write to the store (node-b)" \
        in out, out
    assert "skipped  step_50: no commit marker" in out, out
    assert lease_holder(bucket) is None  # released

    assert checkpoints_in(bucket) == {
        "step_50": {"__1_0.distcp"},
        "step_300": {"__0_0.distcp", "__1_0.distcp", ".metadata"},
        "step_400": {"__0_0.distcp", "__1_0.distcp"},
    }
    # The lease is free: B applies now, and finds nothing left to do.
    again = ckptfs("retention", b.path, "--apply")
    assert "nothing to do" in again.stdout, again.stdout
    # B still had its shards of step_100 and step_200 on NVMe. Its listings miss them, and
    # find them retired by retention: B drops its copies instead of uploading them again.
    deadline = time.monotonic() + 60
    while (seen := walk(b)) != {"step_50", "step_300", "step_400"}:
        assert time.monotonic() < deadline, seen
        time.sleep(0.5)
    sync(b)
    assert set(checkpoints_in(bucket)) == {"step_50", "step_300", "step_400"}
    assert walk(a) == {"step_50", "step_300", "step_400"}


def walk(m: Mount) -> set[str]:
    """The top-level names, after listing every directory (each listing merges the store)."""
    names = set()
    for entry in m.path.iterdir():
        names.add(entry.name)
        try:
            for _ in entry.rglob("*"):
                pass
        except FileNotFoundError:
            pass  # removed while we walked
    return names
