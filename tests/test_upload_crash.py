"""Crash acceptance for stage 2: SIGKILL the daemon at chosen points of an upload.

"SIGKILL the daemon during uploads (several points: before, during a multipart upload, after
upload before the journal update); remount: every closed file ends in the store,
byte-identical, no leftover multipart uploads or temp objects."

The points, each on a real mount (the daemon is another process):

1. *before*: the store is down (``faults.down_file``), files are closed and queued, the
   daemon is killed; the remount (store back) uploads them.
2. *during*: a multipart upload to S3 (SeaweedFS, ``part_size`` = 5 MiB) is killed
   after some of its parts went up; on the file tier, a put is killed while its
   ``.ckptfs-tmp`` file exists. The remount must finish the upload and leave no multipart
   upload and no temporary name behind.
3. *after the put, before the journal*: ``faults.kill_after_puts`` makes the daemon kill
   itself right after a successful put; the journal still says "uploading". The remount
   (without the drill) uploads everything exactly once.
4. the same points when the file was renamed (DCP's ``step_N.tmp/`` -> ``step_N/`` and
   ``.metadata.tmp`` -> ``.metadata``) or unlinked while its upload was in flight: nothing
   may stay behind under the old key.

The store is checked from outside (boto3, or the directory), byte for byte, with the
``crc32c:%08x`` checksum metadata ckptfs attaches to every file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

from ckptfs.store.tiers.base import CONTROL_PREFIX
from tests.mounting import (
    Mount,
    Mounter,
    is_mounted,
    status,
    sync,
    tiers_config,
    wait_dead,
    wait_for,
)
from tests.payload import Payload
from tests.s3bucket import Server, store_lines

pytestmark = [pytest.mark.mount, pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1 << 20
PART_SIZE = 5 * MiB  # the S3 minimum: bigger files go multipart
PREFIX = "run1"
TMP_MARK = ".ckptfs-tmp."


# ---------------------------------------------------------------------------------------------
# the two kinds of store, seen from outside


class Store(Protocol):
    kind: str

    def config(self, path: Path, *, faults: dict[str, Any] | None = None,
               upload_concurrency: int = 2, part_concurrency: int = 2,
               **settings: Any) -> Path: ...
    def files(self) -> dict[str, int]: ...
    def dirs(self) -> set[str]: ...
    def read(self, key: str) -> bytes: ...
    def checksum(self, key: str) -> str | None: ...
    def leftovers(self) -> list[str]: ...


@dataclass
class S3Store:
    server: Server
    bucket: str
    kind: str = "s3"
    client: Any = None

    def __post_init__(self) -> None:
        self.client = self.server.client()

    def config(self, path: Path, *, faults: dict[str, Any] | None = None,
               upload_concurrency: int = 2, part_concurrency: int = 2,
               **settings: Any) -> Path:
        return tiers_config(
            path, f"s3://{self.bucket}/{PREFIX}", *store_lines(self.server),
            f"part_size = {PART_SIZE}", f"part_concurrency = {part_concurrency}",
            faults=faults, upload_concurrency=upload_concurrency, **settings)

    def _objects(self) -> dict[str, int]:
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=PREFIX + "/"):
            for obj in page.get("Contents", []):
                key = obj["Key"][len(PREFIX) + 1:]
                if not key.startswith(CONTROL_PREFIX):  # the nodes' shared state
                    out[key] = int(obj["Size"])
        return out

    def files(self) -> dict[str, int]:
        return {k: v for k, v in self._objects().items() if not k.endswith("/")}

    def dirs(self) -> set[str]:
        return {k.rstrip("/") for k in self._objects() if k.endswith("/")}

    def read(self, key: str) -> bytes:
        reply = self.client.get_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}")
        return reply["Body"].read()  # type: ignore[no-any-return]

    def checksum(self, key: str) -> str | None:
        reply = self.client.head_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}")
        return reply.get("Metadata", {}).get("ckptfs-checksum")  # type: ignore[no-any-return]

    def uploads(self) -> list[dict[str, Any]]:
        reply = self.client.list_multipart_uploads(Bucket=self.bucket)
        return list(reply.get("Uploads", []))

    def leftovers(self) -> list[str]:
        """Multipart uploads still open (anywhere in the bucket), and temporary names."""
        found = [f"multipart upload of {u['Key']}" for u in self.uploads()]
        return found + [k for k in self._objects() if TMP_MARK in k]

    def parts_sent(self, key: str) -> int:
        """Parts uploaded so far by an open multipart upload of ``key`` (0 if none)."""
        for upload in self.uploads():
            if upload["Key"] == f"{PREFIX}/{key}":
                try:
                    reply = self.client.list_parts(Bucket=self.bucket, Key=upload["Key"],
                                                   UploadId=upload["UploadId"])
                except self.client.exceptions.NoSuchUpload:
                    return 0  # completed or aborted meanwhile
                return len(reply.get("Parts", []))
        return 0

    def empty(self) -> None:
        for u in self.uploads():
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"],
                                               UploadId=u["UploadId"])
        for key in self._objects():
            self.client.delete_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}")
        self.client.delete_bucket(Bucket=self.bucket)


@dataclass
class FileStore:
    root: Path
    kind: str = "file"

    def config(self, path: Path, *, faults: dict[str, Any] | None = None,
               upload_concurrency: int = 2, part_concurrency: int = 2,
               **settings: Any) -> Path:
        return tiers_config(path, self.root.as_uri(), faults=faults,
                            upload_concurrency=upload_concurrency, **settings)

    def _walk(self) -> Iterator[tuple[str, bool]]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            if dirpath == str(self.root):  # the nodes' shared state aside
                dirnames[:] = [d for d in dirnames if d + "/" != CONTROL_PREFIX]
            for name in dirnames:
                yield os.path.relpath(os.path.join(dirpath, name), self.root), True
            for name in filenames:
                yield os.path.relpath(os.path.join(dirpath, name), self.root), False

    def files(self) -> dict[str, int]:
        return {rel: os.lstat(self.root / rel).st_size for rel, is_dir in self._walk()
                if not is_dir}

    def dirs(self) -> set[str]:
        return {rel for rel, is_dir in self._walk() if is_dir}

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def checksum(self, key: str) -> str | None:
        try:
            return os.getxattr(self.root / key, "user.ckptfs.checksum").decode()
        except OSError:
            return None

    def leftovers(self) -> list[str]:
        return [rel for rel, _ in self._walk() if TMP_MARK in rel]

    def tmp_names(self) -> list[str]:
        return self.leftovers()


@pytest.fixture
def s3_store(s3: Server) -> Iterator[S3Store]:
    """A fresh bucket on the test's S3 server (``s3``: the session's SeaweedFS)."""
    store = S3Store(s3, s3.new_bucket())
    yield store
    with contextlib.suppress(Exception):  # best effort
        store.empty()


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    root = tmp_path / "store"
    root.mkdir()
    return FileStore(root)


@pytest.fixture(params=["s3", "file"])
def store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue(f"{request.param}_store")  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# writing, killing, checking


@dataclass
class Checkpoint:
    """What was written through the mount: relative path -> payload; and the directories."""

    files: dict[str, Payload] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    def write(self, m: Mount, rel: str, payload: Payload) -> None:
        parent = os.path.dirname(rel)
        if parent:
            (m.path / parent).mkdir(parents=True, exist_ok=True)
            while parent:
                self.dirs.add(parent)
                parent = os.path.dirname(parent)
        payload.write(m.path / rel)
        self.files[rel] = payload

    def rename(self, m: Mount, old: str, new: str) -> None:
        os.rename(m.path / old, m.path / new)
        self.files[new] = self.files.pop(old)


def write_step(m: Mount, ckpt: Checkpoint, step: int, *, big: int = 0) -> None:
    """A DCP-like checkpoint directory: shards of assorted sizes, then its ``.metadata``."""
    sizes = [0, 1, 4096, 300 * 1024 + 7, PART_SIZE - 1, PART_SIZE + 1, 2 * PART_SIZE + 12345]
    if big:
        sizes.append(big)
    for i, size in enumerate(sizes):
        sub = "model" if i % 2 else "optim"
        ckpt.write(m, f"step_{step}/{sub}/shard_{i}.distcp", Payload(step * 100 + i, size))
    ckpt.write(m, f"step_{step}/.metadata", Payload(step * 100 + 99, 2345))


def wait_closed(m: Mount, ckpt: Checkpoint) -> None:
    """Every file has left state ``open``: the kernel's asynchronous RELEASE was handled.

    (close(2) returns before the daemon hears of RELEASE; tests/test_crash.py covers a kill
    in between. These tests are about uploads, so they kill only after that.)
    """
    def closed(rel: str) -> bool:
        return m.state(rel) != "open"

    for rel in ckpt.files:
        wait_for(f"{rel} to be closed", functools.partial(closed, rel), timeout=10, every=0.01)


def kill(m: Mount, pid: int) -> None:
    """SIGKILL the daemon ``pid`` at once (pid read beforehand) and clear the dead mount."""
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    clear_dead_mount(m)


def clear_dead_mount(m: Mount) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True, check=False)
    assert not is_mounted(m.path)


def check_store(store: Store, ckpt: Checkpoint, *, exact: bool = True) -> None:
    """The store holds every file of ``ckpt`` byte-identical with its checksum, nothing else
    (when ``exact``), and no leftover multipart upload or temporary name."""
    have = store.files()
    if exact:
        assert sorted(have) == sorted(ckpt.files), (
            f"only in the store: {sorted(set(have) - set(ckpt.files))}; "
            f"missing from the store: {sorted(set(ckpt.files) - set(have))}")
    for rel, payload in ckpt.files.items():
        assert rel in have, f"{rel} is not in the store"
        assert have[rel] == payload.size, f"{rel}: {have[rel]} bytes in the store"
        problem = payload.mismatch(store.read(rel))
        assert problem is None, f"{rel} in the store: {problem}"
        assert store.checksum(rel) == payload.checksum(), rel
    assert ckpt.dirs <= store.dirs(), f"directories missing: {ckpt.dirs - store.dirs()}"
    assert store.leftovers() == []


def check_mount(m: Mount, ckpt: Checkpoint) -> None:
    """Every file reads back right through the mount and is committed to the warm tier."""
    for rel, payload in ckpt.files.items():
        problem = payload.check_file(m.path / rel)
        assert problem is None, problem
        assert m.state(rel) == "committed", (rel, m.state(rel))
        assert os.getxattr(m.path / rel, "user.ckptfs.tiers") == b"warm", rel


def daemon_log(m: Mount) -> str:
    try:
        return (m.staging / "daemon.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------------------------
# 1. before: closed and queued, the store down, then SIGKILL


@pytest.mark.both_modes
def test_kill_before_upload(store: Store, mounter: Mounter, tmp_path: Path) -> None:
    down = tmp_path / "store-down"
    # Registered at mount: the store is down before the first write (docs/SEMANTICS.md).
    m = mounter("before", config=store.config(tmp_path / "c.toml", faults={"down_file": down},
                                              register_at_mount=True))
    down.touch()  # the store was up for the mount's own check; now it is down
    ckpt = Checkpoint()
    write_step(m, ckpt, 100)
    ckpt.write(m, "latest", Payload(7, 9))
    wait_closed(m, ckpt)
    # The uploads were tried and failed: the kill comes while they wait to retry.
    wait_for("a failed upload in the status", lambda: status(m)["failed"])
    assert store.files() == {}
    for rel in ckpt.files:
        assert m.state(rel) in ("staged", "uploading"), rel
    kill(m, m.pid)

    down.unlink()
    m.remount()
    sync(m)
    check_store(store, ckpt)
    check_mount(m, ckpt)


# ---------------------------------------------------------------------------------------------
# 2. during: a multipart upload killed after some parts; a file-tier put killed mid-copy


BIG = 48 * MiB + 4321  # ten parts of 5 MiB


@pytest.mark.both_modes
def test_kill_during_multipart_upload(s3_store: S3Store, mounter: Mounter,
                                      tmp_path: Path) -> None:
    # The throttle (faults.bandwidth) delays each put by size/bandwidth before it starts;
    # one part at a time (part_concurrency = 1) makes the multipart upload itself last.
    # At debug level the daemon logs each directory marker it puts or deletes (a failed
    # run's report carries its log, and weed's: conftest.py).
    cfg = s3_store.config(tmp_path / "c.toml", faults={"bandwidth": 100_000_000},
                          upload_concurrency=2, part_concurrency=1, log_level="debug")
    m = mounter("during", config=cfg)
    ckpt = Checkpoint()
    write_step(m, ckpt, 200, big=BIG)
    [big] = [rel for rel, p in ckpt.files.items() if p.size == BIG]
    wait_closed(m, ckpt)
    pid = m.pid
    wait_for(f"{big} to be uploading", lambda: m.state(big) == "uploading", every=0.005)
    wait_for(f"2 parts of {big} sent", lambda: s3_store.parts_sent(big) >= 2, every=0.005)
    kill(m, pid)

    # Killed in the middle: the multipart upload is open, the object not there.
    assert f"{PREFIX}/{big}" in [u["Key"] for u in s3_store.uploads()]
    assert big not in s3_store.files()

    m.remount()
    sync(m)
    check_store(s3_store, ckpt)
    check_mount(m, ckpt)
    assert "leftover partial uploads" in daemon_log(m)


def test_kill_during_file_tier_put(file_store: FileStore, mounter: Mounter,
                                   tmp_path: Path) -> None:
    cfg = file_store.config(tmp_path / "c.toml", faults={"bandwidth": 400_000_000},
                            upload_concurrency=1)
    m = mounter("during-file", config=cfg)
    ckpt = Checkpoint()
    ckpt.write(m, "step_300/model.pt", Payload(300, 96 * MiB + 5))
    wait_closed(m, ckpt)
    pid = m.pid
    tmp = wait_for("a temporary file in the store", file_store.tmp_names, every=0.001)
    kill(m, pid)
    assert tmp[0].startswith("step_300/.model.pt" + TMP_MARK), tmp
    # Killed mid-copy: the temporary file is left, and no reader of the store sees a
    # partial model.pt.
    assert file_store.tmp_names() == tmp
    assert "step_300/model.pt" not in file_store.files()

    m.remount()
    sync(m)
    check_store(file_store, ckpt)
    check_mount(m, ckpt)


# ---------------------------------------------------------------------------------------------
# 3. after the put, before the journal: faults.kill_after_puts


@pytest.mark.parametrize(("kind", "puts"), [("s3", 2), ("file", 1)])
def test_kill_after_put_before_journal(kind: str, puts: int, request: pytest.FixtureRequest,
                                       mounter: Mounter, tmp_path: Path) -> None:
    store: Store = request.getfixturevalue(f"{kind}_store")
    down = tmp_path / "store-down"
    drill = store.config(tmp_path / "drill.toml", upload_concurrency=1,
                         faults={"down_file": down, "kill_after_puts": puts},
                         register_at_mount=True)  # the store is down before the first write
    m = mounter("after", config=drill)
    # Everything is closed before the first put (the store is down meanwhile), so that the
    # daemon dies with every file closed and nothing else in flight.
    down.touch()
    ckpt = Checkpoint()
    write_step(m, ckpt, 400)
    ckpt.write(m, "latest", Payload(8, 4))
    wait_closed(m, ckpt)
    pid = m.pid
    down.unlink()
    wait_dead(pid, timeout=60)
    clear_dead_mount(m)

    # The daemon died right after its put: exactly that many files are in the store, whole,
    # and the journal does not know (the files come back as not committed).
    have = store.files()
    assert len(have) == puts, have
    for rel in have:
        assert ckpt.files[rel].mismatch(store.read(rel)) is None, rel
    assert "injected outage" in daemon_log(m)

    m.config = store.config(tmp_path / "plain.toml")
    m.remount()
    for rel in have:
        assert m.state(rel) in ("staged", "uploading", "committed"), rel
    sync(m)
    check_store(store, ckpt)
    check_mount(m, ckpt)
    # Once more, cleanly: nothing is uploaded again, nothing changes.
    before = {rel: store.checksum(rel) for rel in ckpt.files}
    m.umount()
    m.remount()
    sync(m)
    assert status(m)["uploaded"]["files"] == 0
    assert {rel: store.checksum(rel) for rel in ckpt.files} == before
    check_store(store, ckpt)


# ---------------------------------------------------------------------------------------------
# 4. the file changed name (or went away) while its upload was in flight, then the kill

# A put killed mid-way leaves a multipart upload (S3) or a .ckptfs-tmp file (file tier) at the
# key it was writing; the remount must clean it up even when that key is no longer the file's
# path: renamed meanwhile (DCP: step_N.tmp/ -> step_N/, .metadata.tmp -> .metadata), or
# unlinked (the unlink cancels the upload, but the SIGKILL may land before its cleanup).


def wait_mid_put(store: Store, key: str) -> None:
    """Until the put of ``key`` has sent data: parts of a multipart upload, or a temp file."""
    if isinstance(store, S3Store):
        wait_for(f"2 parts of {key} sent", lambda: store.parts_sent(key) >= 2, every=0.005)
    else:
        assert isinstance(store, FileStore)
        name = "." + os.path.basename(key) + TMP_MARK
        wait_for(f"a temporary file for {key}", lambda: [
            t for t in store.tmp_names() if os.path.basename(t).startswith(name)], every=0.001)


@pytest.mark.parametrize(("kind", "action"), [
    ("s3", "rename"),
    ("file", "rename"),
    pytest.param("s3", "unlink"),
])
def test_kill_during_upload_of_renamed_or_unlinked_file(
        kind: str, action: str, request: pytest.FixtureRequest, mounter: Mounter,
        tmp_path: Path) -> None:
    store: Store = request.getfixturevalue(f"{kind}_store")
    cfg = store.config(tmp_path / "c.toml", faults={"bandwidth": 400_000_000},
                       upload_concurrency=1, part_concurrency=1)
    m = mounter("moved", config=cfg)
    ckpt = Checkpoint()
    ckpt.write(m, "step_500.tmp/model.distcp", Payload(500, 64 * MiB + 3))
    ckpt.write(m, "step_500.tmp/.metadata", Payload(501, 1000))
    wait_closed(m, ckpt)
    pid = m.pid
    wait_mid_put(store, "step_500.tmp/model.distcp")
    if action == "rename":
        # DCP's last step: the directory x.tmp becomes x while the upload is under way
        # (the upload goes on under the old name, to be moved once done).
        os.rename(m.path / "step_500.tmp", m.path / "step_500")
        ckpt.files = {rel.replace("step_500.tmp", "step_500"): p
                      for rel, p in ckpt.files.items()}
        ckpt.dirs = {"step_500"}
    else:
        os.unlink(m.path / "step_500.tmp/model.distcp")  # cancels the upload
        del ckpt.files["step_500.tmp/model.distcp"]
    kill(m, pid)

    m.remount()
    sync(m)
    check_store(store, ckpt)
    check_mount(m, ckpt)
    if action == "rename":
        assert "step_500.tmp" not in store.dirs()


def test_kill_after_put_of_renamed_file(s3_store: S3Store, mounter: Mounter,
                                        tmp_path: Path) -> None:
    """DCP's .metadata.tmp -> .metadata while the put runs; the daemon dies right after it."""
    store = s3_store
    # 8 MiB at 4 MB/s: the put waits 2 s in the throttle before it starts: time to rename.
    drill = store.config(tmp_path / "drill.toml", upload_concurrency=1,
                         faults={"bandwidth": 4_000_000, "kill_after_puts": 1})
    m = mounter("moved-after", config=drill)
    ckpt = Checkpoint()
    ckpt.write(m, "step_600/.metadata.tmp", Payload(600, 8 * MiB))
    wait_closed(m, ckpt)
    pid = m.pid
    wait_for("the upload to start", lambda: m.state("step_600/.metadata.tmp") == "uploading")
    ckpt.rename(m, "step_600/.metadata.tmp", "step_600/.metadata")
    wait_dead(pid, timeout=30)
    clear_dead_mount(m)
    assert list(store.files()) == ["step_600/.metadata.tmp"]  # put under the old name

    m.config = store.config(tmp_path / "plain.toml")
    m.remount()
    sync(m)
    check_store(store, ckpt)
    check_mount(m, ckpt)
