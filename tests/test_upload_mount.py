"""Real-mount acceptance tests of stage 2 (upload) with the warm tier on S3 over real HTTP.

Each test mounts ckptfs for real (``mounter``; the daemon is another process) with a TOML
config whose warm tier is ``s3://<bucket>/run1`` on the session's SeaweedFS (``bucket``), often
slowed down or taken down by the tier's ``faults`` table, and checks the bucket through boto3:
bytes, ``x-amz-meta-ckptfs-*`` metadata, the order in which objects appear, and that the
listing ends up exactly equal to the mount's tree.

tests/test_upload.py checks the same rules without a mount (memory tier, virtual clock).
"""

from __future__ import annotations

import io
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import pytest

from tests.mounting import (
    Mount,
    Mounter,
    ckptfs,
    is_mounted,
    register_first,
    status,
    wait_for,
)
from tests.seaweed import Seaweed

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

from tests.s3bucket import PART_SIZE, PREFIX, Bucket, MiB, crc  # noqa: F401

# ---------------------------------------------------------------------------------------------
# the bucket side


# ---------------------------------------------------------------------------------------------
# the mount side


def mount_tree(root: Path) -> dict[str, tuple[str, bytes]]:
    """The mount as a store should hold it: key -> (kind, body).

    Files are ``path`` -> ("file", bytes); directories ``path/`` -> ("dir", b""); symlinks
    ``path`` -> ("symlink", target).
    """
    out: dict[str, tuple[str, bytes]] = {}

    def walk(d: Path, rel: str) -> None:
        for entry in os.scandir(d):
            key = rel + entry.name
            if entry.is_symlink():
                out[key] = ("symlink", os.fsencode(os.readlink(entry.path)))
            elif entry.is_dir():
                out[key + "/"] = ("dir", b"")
                walk(Path(entry.path), key + "/")
            else:
                out[key] = ("file", Path(entry.path).read_bytes())

    walk(root, "")
    return out


def assert_store_equals_mount(m: Mount, b: Bucket) -> dict[str, tuple[str, bytes]]:
    """The bucket holds exactly the mount's tree: same keys, bytes, kinds, checksums. (On a
    server that drops a directory marker's metadata, SeaweedFS, a directory's is none.)"""
    want = mount_tree(m.path)
    have = b.sizes()
    assert not [k for k in have if ".ckptfs-tmp" in k], have
    assert sorted(have) == sorted(want), (
        f"only in the store: {sorted(set(have) - set(want))}; "
        f"only on the mount: {sorted(set(want) - set(have))}")
    for key, (kind, body) in want.items():
        data, meta, _ = b.get(key)
        if kind == "dir" and not b.server.keeps_directory_metadata:
            assert (data, meta) == (b"", {}), (key, meta)
            continue
        assert meta.get("ckptfs-kind") == kind, (key, meta)
        assert data == body, f"{key}: store holds {len(data)} bytes, mount {len(body)}"
        st = os.lstat(m.path / key.rstrip("/"))
        if kind != "symlink":
            assert meta.get("ckptfs-mode") == f"{stat.S_IMODE(st.st_mode):o}", (key, meta)
        if kind == "file":
            assert meta.get("ckptfs-checksum") == crc(body), (key, meta)
            assert meta.get("ckptfs-mtime-ns") == str(st.st_mtime_ns), (key, meta)
            assert m.state(key) == "committed", key
    assert b.multipart_uploads() == []
    return want


def sync(m: Mount, *args: str, timeout: float = 150) -> float:
    """``ckptfs sync MP``; returns how long it took."""
    t0 = time.monotonic()
    ckptfs("sync", m.path, *args, timeout=timeout)
    return time.monotonic() - t0


def write(path: Path, data: bytes) -> float:
    """Create/overwrite ``path`` (parents made) and close it; returns how long it took."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(path, "wb") as f:
        f.write(data)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# 1. torch.save returns before the upload is done; sync makes the store byte-identical


@pytest.mark.torch
def test_torch_save_returns_before_upload(mounter: Mounter, bucket: Bucket,
                                          tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    bandwidth = 20_000_000  # 20 MB/s: a 64 MiB checkpoint needs > 3 s to reach the store
    m = mounter("torch", config=bucket.config(tmp_path / "c.toml",
                                              faults={"bandwidth": bandwidth}))
    names = [f"ckpt_step_{step}.pt" for step in (100, 200, 300)]
    register_first(m)   # torch.save holds the GIL (an in-process store would need it: mounting.py)
    tensors = {}
    for step, name in zip((100, 200, 300), names, strict=True):
        tensors[name] = torch.randn(16 * MiB)  # 64 MiB of float32
        torch.save({"step": step, "weights": tensors[name]}, m.path / name)
        # Right after torch.save returned, the upload has not finished (nor, at this
        # bandwidth, could it have: it takes > 3 s from close): the object is not in the
        # bucket, the file is not committed.
        state = m.state(name)
        listed = bucket.sizes()
        assert state in ("staged", "uploading"), (name, state)
        assert name not in listed, f"{name} already in the store: {listed}"

    took = sync(m)
    assert took > 1.0, f"sync took {took:.1f}s: the uploads were not slowed down"
    for name in names:
        assert m.state(name) == "committed"
        local = (m.path / name).read_bytes()
        data, meta, etag = bucket.get(name)
        assert data == local
        assert meta["ckptfs-checksum"] == crc(data)
        assert meta["ckptfs-kind"] == "file"
        assert etag.endswith(f"-{-(-len(data) // PART_SIZE)}"), f"not multipart: {etag}"
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert torch.equal(loaded["weights"], tensors[name])
    assert_store_equals_mount(m, bucket)


# ---------------------------------------------------------------------------------------------
# 2. commit markers appear on the store only after what they refer to


SHARDS = 4


@dataclass
class MarkerPoller:
    """Lists the bucket over and over while uploads run, and records every violation."""

    bucket: Bucket
    steps: dict[str, dict[str, int]]  # step dir -> {shard key: full size}, filled before writing
    observations: int = 0
    seen_metadata: set[str] = field(default_factory=set)
    seen_latest: set[str] = field(default_factory=set)
    states: set[frozenset[str]] = field(default_factory=set)  # distinct listings seen
    violations: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def check_step(self, step: str, listing: dict[str, int], why: str) -> None:
        shards = self.steps.get(step)
        if shards is None:
            self.violations.append(f"{why}: unknown step {step!r}")
            return
        for key, size in shards.items():
            if listing.get(key) != size:
                self.violations.append(
                    f"{why}: {key} is {listing.get(key, 'missing')} (want {size} bytes); "
                    f"listing: {sorted(listing)}")

    def run(self) -> None:
        client = self.bucket.server.client()
        latest_seen = False
        while not self.stop.is_set():
            try:
                listing = self.bucket.sizes(client)
                self.states.add(frozenset(listing))
                for key in listing:
                    if key.endswith("/.metadata"):
                        step = key.rsplit("/", 1)[0]
                        self.seen_metadata.add(step)
                        self.check_step(step, listing, f"{key} listed")
                body = None
                if "latest" in listing:
                    try:
                        body, _, _ = self.bucket.get("latest", client)
                    except client.exceptions.NoSuchKey:
                        pass
                if body is None:
                    if latest_seen:
                        # Once a pointer is on the store, a reader must always find one.
                        self.violations.append(f"'latest' disappeared; listing: {sorted(listing)}")
                else:
                    latest_seen = True
                    step = body.decode(errors="replace").strip()
                    self.seen_latest.add(step)
                    # 'latest' named step at the time of the get; the marker and every shard
                    # it refers to were committed before it, so a listing made now holds them.
                    after = self.bucket.sizes(client)
                    if f"{step}/.metadata" not in after:
                        self.violations.append(
                            f"latest names {step!r} but {step}/.metadata is not in the store; "
                            f"listing: {sorted(after)}")
                    else:
                        self.check_step(step, after, f"latest = {step!r}")
                self.observations += 1
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(30)

    def check(self, min_observations: int = 30) -> None:
        assert not self.errors, self.errors[:5]
        assert not self.violations, (
            f"{len(self.violations)} violations seen on the store, the first ones:\n"
            + "\n".join(self.violations[:5]))
        assert self.observations >= min_observations, self.observations


def write_step(m: Mount, steps: dict[str, dict[str, int]], n: int, shard_mib: float) -> str:
    """A DCP-like checkpoint: shards of different sizes, then ``.metadata`` (a marker)."""
    step = f"step_{n}"
    # Known before the first byte is written, so the poller never sees an unknown step.
    steps[step] = {f"{step}/__{r}_0.distcp": int((1 + 2 * r) * shard_mib * MiB) + 1000 * n + r
                   for r in range(SHARDS)}
    for key, size in steps[step].items():
        write(m.path / key, os.urandom(size))
    write(m.path / step / ".metadata", b"dcp metadata of " + step.encode())
    return step


def test_markers_appear_after_their_shards(mounter: Mounter, bucket: Bucket,
                                           tmp_path: Path) -> None:
    # 3 MB/s per upload: a step's largest shard (7 MiB) takes > 2 s, so each step is written
    # (and 'latest' rewritten) while the previous step is still uploading.
    m = mounter("markers", config=bucket.config(
        tmp_path / "c.toml", faults={"latency": "0.1s", "bandwidth": 3_000_000}))
    steps: dict[str, dict[str, int]] = {}
    with MarkerPoller(bucket, steps) as poller:
        for n in (10, 20, 30):
            step = write_step(m, steps, n, shard_mib=1)  # 1, 3, 5 and 7 MiB: some multipart
            write(m.path / "latest", step.encode())  # rewritten in place
            time.sleep(0.3)  # training
        sync(m)
        time.sleep(0.3)  # a few more observations of the final state
    poller.check()
    # The poller saw the store while it was changing, not only the end state.
    assert poller.seen_metadata == set(steps)
    assert len(poller.states) >= 10, len(poller.states)
    assert bucket.get("latest")[0] == b"step_30"
    assert_store_equals_mount(m, bucket)


def test_pointer_replaced_by_rename_never_leaves_the_store(mounter: Mounter, bucket: Bucket,
                                                           tmp_path: Path) -> None:
    """The careful trainer's pointer update, ``latest.tmp`` -> ``latest`` (atomic on the mount):
    the store always has a ``latest`` once it had one, and it always names a whole step."""
    m = mounter("pointer", config=bucket.config(
        tmp_path / "c.toml", faults={"latency": "0.1s", "bandwidth": 6_000_000}))
    steps: dict[str, dict[str, int]] = {}
    step = write_step(m, steps, 1, shard_mib=0.25)
    write(m.path / "latest", step.encode())
    sync(m)
    with MarkerPoller(bucket, steps) as poller:
        for n in (2, 3):
            step = write_step(m, steps, n, shard_mib=0.5)
            write(m.path / "latest.tmp", step.encode())
            os.rename(m.path / "latest.tmp", m.path / "latest")
        sync(m)
        time.sleep(0.3)
    poller.check(min_observations=10)
    assert bucket.get("latest")[0] == b"step_3"
    assert_store_equals_mount(m, bucket)


# ---------------------------------------------------------------------------------------------
# 3. an outage of the store delays uploads, never writes, and loses nothing


def write_while_down(m: Mount, datas: dict[str, bytes]) -> dict[str, Any]:
    """Write ``datas`` with the store down, each in < 5 s; the first status with failures."""
    for rel, data in datas.items():
        took = write(m.path / rel, data)
        assert took < 5.0, f"writing {rel} took {took:.1f}s while the store was down"
    return wait_for("failed uploads in 'ckptfs status'",  # type: ignore[no-any-return]
                    lambda: (s := status(m))["failed"] and s, timeout=20, every=0.1)


def test_outage_down_file(mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    down = tmp_path / "store-is-down"
    # Registered at mount: the store is down before the first write (docs/SEMANTICS.md).
    m = mounter("down", config=bucket.config(tmp_path / "c.toml", faults={"down_file": down},
                                             register_at_mount=True))
    down.touch()
    t_down = time.monotonic()
    datas = {f"step_{i}/model.pt": os.urandom(100_000 * i) for i in range(1, 5)}
    datas["big.pt"] = os.urandom(12 * MiB)  # multipart
    report = write_while_down(m, datas)
    assert report["retries"] >= 1
    assert any("outage" in (f["error"] or "") for f in report["failed"]), report["failed"]
    assert report["queue"]["files"] >= len(datas)
    assert bucket.sizes() == {}
    assert all(m.state(rel) in ("staged", "uploading") for rel in datas)
    # A short outage: the next retries are a few seconds away at most.
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t_down)))
    down.unlink()
    took = sync(m, "--timeout", "120")
    assert took < 60, f"sync took {took:.0f}s after a 2s outage"
    for rel, data in datas.items():
        assert bucket.get(rel)[0] == data
    assert_store_equals_mount(m, bucket)
    assert status(m)["failed"] == []


def test_outage_server_stopped(mounter: Mounter, own_seaweed: Seaweed, tmp_path: Path) -> None:
    """The store's server itself stops (this test's own SeaweedFS) and comes back."""
    bucket = Bucket(own_seaweed, own_seaweed.new_bucket())
    m = mounter("stopped", config=bucket.config(tmp_path / "c.toml"))
    (m.path / "warmup").write_bytes(b"ok")
    sync(m)  # the daemon has a live connection to the store before it goes away
    datas = {f"step_{i}/model.pt": os.urandom(200_000 * i) for i in range(1, 4)}
    datas["big.pt"] = os.urandom(11 * MiB)
    own_seaweed.pause()
    try:
        t_down = time.monotonic()
        report = write_while_down(m, datas)
        assert report["retries"] >= 1
        time.sleep(max(0.0, 2.0 - (time.monotonic() - t_down)))
        # (The bucket cannot be listed now: the states tell that nothing was committed.)
        assert all(m.state(rel) in ("staged", "uploading") for rel in datas)
    finally:
        own_seaweed.resume()
    assert "warmup" in bucket.sizes()  # the server kept its data
    took = sync(m, "--timeout", "120")
    assert took < 60, f"sync took {took:.0f}s after a short outage"
    for rel, data in datas.items():
        assert bucket.get(rel)[0] == data
    assert_store_equals_mount(m, bucket)


# ---------------------------------------------------------------------------------------------
# 4. namespace changes after (and during) upload end with the store equal to the mount


def test_namespace_changes_reach_the_store(mounter: Mounter, bucket: Bucket,
                                           tmp_path: Path) -> None:
    # Every store call takes 0.3 s: what is still in flight when sync returns shows up.
    m = mounter("ns", config=bucket.config(
        tmp_path / "c.toml", faults={"latency": "0.3s", "bandwidth": 8_000_000}))
    p = m.path
    write(p / "a", b"A" * 10_000)
    write(p / "d" / "b", b"B" * 100)
    write(p / "d" / "e" / "c", b"C" * 7 * MiB)  # multipart
    write(p / "over", b"old content")
    write(p / "trunc", os.urandom(6 * MiB))
    write(p / "mode", b"chmod me")
    write(p / "gone", b"unlink me")
    write(p / "x", b"X")
    write(p / "y", b"Y")
    (p / "empty").mkdir()
    (p / "rmd").mkdir()
    os.symlink("step_1", p / "latest")
    os.symlink("nowhere/at/all", p / "dangling")
    sync(m)
    assert_store_equals_mount(m, bucket)

    # after commit: rename a file and a tree, overwrite, truncate, chmod, unlink, rmdir,
    # rename over an existing file, retarget a symlink
    os.rename(p / "a", p / "a2")
    os.rename(p / "d", p / "d2")
    write(p / "over", b"new and longer content")
    os.truncate(p / "trunc", 100_000)
    os.chmod(p / "mode", 0o600)
    os.unlink(p / "gone")
    os.rmdir(p / "rmd")
    os.rename(p / "x", p / "y")
    os.unlink(p / "latest")
    os.symlink("step_2", p / "latest")
    os.chmod(p / "empty", 0o700)

    # 'step_1.tmp/' holds committed files and one still uploading when it is renamed
    write(p / "step_1.tmp" / "__0_0.distcp", os.urandom(300_000))
    write(p / "step_1.tmp" / "__1_0.distcp", os.urandom(400_000))
    sync(m)
    write(p / "step_1.tmp" / "__2_0.distcp", os.urandom(16 * MiB))  # > 2 s at this bandwidth
    write(p / "step_1.tmp" / ".metadata.tmp", b"meta of step 1")
    os.rename(p / "step_1.tmp" / ".metadata.tmp", p / "step_1.tmp" / ".metadata")
    # rewritten and removed while their first upload is queued or in flight
    write(p / "rewritten", os.urandom(6 * MiB))
    write(p / "removed", os.urandom(6 * MiB))
    time.sleep(0.1)
    assert m.state("step_1.tmp/__2_0.distcp") in ("staged", "uploading")
    os.rename(p / "step_1.tmp", p / "step_1")
    write(p / "rewritten", b"second version")
    os.unlink(p / "removed")

    # DCP's own pattern, renamed while the shards are still uploading
    for r in range(2):
        write(p / "step_2" / f"__{r}_0.distcp", os.urandom(2 * MiB + r))
    write(p / "step_2" / ".metadata.tmp", b"meta of step 2")
    os.rename(p / "step_2" / ".metadata.tmp", p / "step_2" / ".metadata")

    sync(m)
    tree = assert_store_equals_mount(m, bucket)
    assert tree["y"] == ("file", b"X")
    assert tree["trunc"][1] == (p / "trunc").read_bytes() and len(tree["trunc"][1]) == 100_000
    assert bucket.get("mode")[1]["ckptfs-mode"] == "600"
    assert bucket.get("latest")[0] == b"step_2"
    assert bucket.get("rewritten")[0] == b"second version"
    if bucket.server.keeps_directory_metadata:  # SeaweedFS keeps none on a marker
        assert bucket.get("empty/")[1]["ckptfs-mode"] == "700"
    assert bucket.get("step_1/.metadata")[0] == b"meta of step 1"
    assert "step_1.tmp/" not in bucket.sizes()


def test_sync_waits_for_the_old_directory_to_go(mounter: Mounter, bucket: Bucket,
                                               tmp_path: Path) -> None:
    """``mv step_5.tmp step_5; ckptfs sync``: once sync returns, ``step_5.tmp/`` is gone too."""
    # One worker and slow calls: the old directory's marker is deleted last, well after sync
    # started (its deletion is queued only once the new directory is on the store).
    m = mounter("dirmv", config=bucket.config(
        tmp_path / "c.toml", upload_concurrency=1, faults={"latency": "0.5s"}))
    write(m.path / "step_5.tmp" / "__0_0.distcp", b"shard")
    write(m.path / "step_5.tmp" / ".metadata", b"meta")
    sync(m)
    assert sorted(bucket.sizes()) == ["step_5.tmp/", "step_5.tmp/.metadata",
                                      "step_5.tmp/__0_0.distcp"]
    os.rename(m.path / "step_5.tmp", m.path / "step_5")
    sync(m)
    assert_store_equals_mount(m, bucket)


def test_old_key_goes_when_the_new_file_there_is_renamed_away(mounter: Mounter, bucket: Bucket,
                                                              tmp_path: Path) -> None:
    """``latest.tmp`` -> ``latest`` twice in a row: the first file's copy at ``latest.tmp`` must
    go even though a second ``latest.tmp`` existed (open) when the first one was moved, and
    that second one never reaches the store under the name ``latest.tmp``."""
    # One worker and slow calls: the move (head, copy, delete: 1 s) is under way when the new
    # file appears, and the new file waits behind a slow upload until it has been renamed.
    m = mounter("reuse", config=bucket.config(
        tmp_path / "c.toml", upload_concurrency=1,
        faults={"latency": "0.5s", "bandwidth": 1_000_000}))
    p = m.path
    write(p / "latest.tmp", b"step_1")
    sync(m)
    os.rename(p / "latest.tmp", p / "latest")
    with open(p / "latest.tmp", "wb") as f:  # the next pointer, still being written
        sync(m)  # meanwhile the first one is moved on the store
        assert bucket.get("latest")[0] == b"step_1"
        write(p / "blocker", b"b" * 1_000_000)  # keeps the only worker busy for 1.5 s
        f.write(b"step_2")
    os.rename(p / "latest.tmp", p / "latest")
    assert m.state("latest") == "staged"  # not started under its old name
    sync(m)
    assert_store_equals_mount(m, bucket)
    assert bucket.get("latest")[0] == b"step_2"


# ---------------------------------------------------------------------------------------------
# 5. umount waits for the queue; umount --no-wait leaves it in the journal for the next mount


def slow_checkpoint(mounter: Mounter, bucket: Bucket, tmp_path: Path, name: str, *,
                    bandwidth: int, step: int, shards: int,
                    shard_size: int) -> tuple[Mount, dict[str, bytes]]:
    """Mount ``name`` over a slow bucket; write ``step_N``'s shards, ``.metadata``, ``latest``."""
    m = mounter(name, config=bucket.config(
        tmp_path / "c.toml", faults={"latency": "0.1s", "bandwidth": bandwidth}))
    datas = {f"step_{step}/__{r}_0.distcp": os.urandom(shard_size + r) for r in range(shards)}
    datas[f"step_{step}/.metadata"] = b"meta"
    datas["latest"] = f"step_{step}".encode()
    for rel, data in datas.items():
        write(m.path / rel, data)
    return m, datas


def test_umount_waits_for_uploads(mounter: Mounter, bucket: Bucket, tmp_path: Path) -> None:
    # 4 MB/s: a shard needs ~0.8 s, 'latest' lands > 1 s after the writes
    m, datas = slow_checkpoint(mounter, bucket, tmp_path, "umount", bandwidth=4_000_000,
                               step=5, shards=4, shard_size=3 * MiB)
    assert "latest" not in bucket.sizes()  # there is something to wait for
    m.umount()
    assert not is_mounted(m.path)
    for rel, data in datas.items():
        assert bucket.get(rel)[0] == data, rel
    assert sorted(bucket.sizes()) == sorted([*datas, "step_5/"])
    assert bucket.multipart_uploads() == []


def test_umount_no_wait_keeps_the_queue(mounter: Mounter, bucket: Bucket,
                                        tmp_path: Path) -> None:
    # 2 MB/s: a shard needs > 3 s
    m, datas = slow_checkpoint(mounter, bucket, tmp_path, "nowait", bandwidth=2_000_000,
                               step=7, shards=3, shard_size=6 * MiB)
    ckptfs("umount", m.path, "--no-wait")
    assert not is_mounted(m.path)
    landed = bucket.sizes()
    assert not set(datas) <= set(landed), "everything landed: --no-wait proved nothing"
    assert "latest" not in landed and "step_7/.metadata" not in landed
    assert bucket.multipart_uploads() == []  # the uploads cut short were aborted

    m.remount()
    # What had not landed is queued again from the journal.
    assert all(m.state(rel) in ("staged", "uploading") for rel in datas if rel not in landed)
    sync(m)
    for rel, data in datas.items():
        assert bucket.get(rel)[0] == data, rel
    assert_store_equals_mount(m, bucket)
