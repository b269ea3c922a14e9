"""ckptfs with passthrough on a real mount (docs/PASSTHROUGH.md), the default where it can run.

A wholly local file is written and read back by the kernel from its staging file: the daemon
sees its opens, flushes and releases but no READ or WRITE request, and still learns the size
(stat while open, the journal after a remount) and uploads the right bytes with the right
checksum. A file evicted from NVMe (REMOTE) is daemon-served and faults in as without
passthrough, and an inode with a daemon-served open gives later opens the same mode (the
kernel fails a mix with EIO).

Needs the build of scripts/build_passthrough_fuse.sh (run here, cached), kernel 6.9+ and
root; skipped with the reason otherwise. Every mount is unmounted in teardown (``mounter``).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from tests.mounting import (
    Mount,
    Mounter,
    ckptfs,
    is_mounted,
    mounter_in,
    status,
    sync,
    wait_for,
)
from tests.passthrough_fs import unavailable
from tests.s3bucket import Bucket, crc

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

MiB = 1 << 20


@pytest.fixture(scope="module")
def passthrough_ready() -> None:
    why = unavailable()
    if why:
        pytest.skip(why)


def _pt(m: Mount) -> dict[str, Any]:
    info: dict[str, Any] = status(m)["passthrough"]
    return info


def _pattern(size: int, seed: int = 0) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest() * 1024
        i += 1
    return bytes(out[:size])


def test_hot_file_never_reaches_the_daemon(passthrough_ready: None, mounter: Mounter,
                                           bucket: Bucket, tmp_path: Path) -> None:
    m = mounter("pt", config=bucket.config(tmp_path / "c.toml", passthrough="on"))
    assert _pt(m)["active"] is True, _pt(m)
    data = _pattern(5 * MiB + 12345)
    path = m.path / "step_100" / "model.bin"
    path.parent.mkdir()
    with open(path, "wb", buffering=0) as f:  # write-only: write_direct_io would apply
        f.write(data[:3 * MiB])
        assert os.stat(path).st_size == 3 * MiB  # the daemon learns the size while open
        f.write(data[3 * MiB:])
        os.fsync(f.fileno())
    assert os.path.getsize(path) == len(data)
    with open(path, "rb", buffering=0) as f:
        assert f.read() == data
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as view:  # mmap of a passthrough open
        assert view[:4096] == data[:4096]
    pt = _pt(m)
    assert pt["requests"] == {"read": 0, "write": 0}, pt
    assert pt["opens"]["passthrough"] >= 3 and pt["opens"]["daemon"] == 0, pt

    sync(m)
    assert m.state("step_100/model.bin") == "committed"
    stored, meta, _ = bucket.get("step_100/model.bin")
    assert stored == data
    assert meta["ckptfs-checksum"] == crc(data)
    assert meta["ckptfs-mtime-ns"] == str(os.stat(path).st_mtime_ns)

    # The journal holds the size the daemon never saw written.
    m.umount()
    m.remount()
    assert os.path.getsize(path) == len(data)
    assert path.read_bytes() == data


def test_evicted_file_is_daemon_served(passthrough_ready: None, mounter: Mounter,
                                       bucket: Bucket, tmp_path: Path) -> None:
    m = mounter("pt", config=bucket.config(tmp_path / "c.toml", passthrough="on"))
    data = _pattern(4 * MiB + 7, seed=1)
    path = m.path / "ckpt.bin"
    path.write_bytes(data)
    sync(m)
    ckptfs("evict", path)
    assert m.state("ckpt.bin") == "remote"
    before = _pt(m)
    with open(path, "rb", buffering=0) as reader:  # faults in: served by the daemon
        assert reader.read(MiB) == data[:MiB]
        # Another open while the daemon serves this inode: the same mode (a passthrough
        # open would be EIO in the kernel), even once the whole file is local.
        with open(path, "rb", buffering=0) as other:
            assert other.read() == data
        assert reader.read() == data[MiB:]
    after = _pt(m)
    assert after["requests"]["read"] > before["requests"]["read"], after
    assert after["opens"]["daemon"] == before["opens"]["daemon"] + 2, after
    wait_for("fully fetched", lambda: m.state("ckpt.bin") == "committed")
    # Wholly local again, every daemon-served open released: the next open is passthrough.
    reads = after["requests"]["read"]
    assert path.read_bytes() == data
    again = _pt(m)
    assert again["requests"]["read"] == reads, again
    assert again["opens"]["passthrough"] == after["opens"]["passthrough"] + 1, again


def test_overwrite_and_truncate_keep_the_journal_right(passthrough_ready: None,
                                                        mounter: Mounter, tmp_path: Path) -> None:
    m = mounter("pt", extra=["-o", "passthrough=on"])
    path = m.path / "f"
    path.write_bytes(b"a" * MiB)
    with open(path, "r+b", buffering=0) as f:
        f.seek(2 * MiB)
        f.write(b"b" * 100)                      # a hole, then bytes: size 2 MiB + 100
        assert os.fstat(f.fileno()).st_size == 2 * MiB + 100
        os.ftruncate(f.fileno(), MiB + 10)        # through the daemon (SETATTR)
        f.seek(0, os.SEEK_END)
        f.write(b"c" * 5)
        os.utime(f.fileno(), ns=(1_000_000_000, 2_000_000_000))  # futimens before close
    want = b"a" * MiB + b"\0" * 10 + b"c" * 5
    assert path.read_bytes() == want
    assert os.stat(path).st_mtime_ns == 2_000_000_000
    sync(m)
    stored = (m.store or Path()) / "f"
    assert stored.read_bytes() == want
    m.umount()
    m.remount()
    assert os.stat(path).st_size == len(want) and os.stat(path).st_mtime_ns == 2_000_000_000
    assert _pt(m)["requests"] == {"read": 0, "write": 0}


def test_off_is_the_stock_path(mounter: Mounter) -> None:
    m = mounter("stock", extra=["-o", "passthrough=off"])
    (m.path / "f").write_bytes(b"x" * MiB)
    assert (m.path / "f").read_bytes() == b"x" * MiB
    pt = _pt(m)
    assert pt["active"] is False and pt["reason"] == "passthrough = off", pt
    assert pt["requests"]["write"] > 0 and pt["opens"]["passthrough"] == 0, pt


def test_passthrough_is_the_default(passthrough_ready: None, tmp_path: Path) -> None:
    with mounter_in(tmp_path, passthrough="") as mounter:   # no option: the config's default
        m = mounter("default")
        assert len(m.ready.strip().splitlines()) == 1, m.ready   # the success line alone
        (m.path / "f").write_bytes(b"z" * MiB)
        assert (m.path / "f").read_bytes() == b"z" * MiB
        pt = _pt(m)
        assert pt["active"] is True and pt["requests"] == {"read": 0, "write": 0}, pt


def test_without_the_build_the_default_says_the_daemon_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (auto) where passthrough cannot run: the mount works on the daemon path,
    and its output says so and why, as status does; ``on`` refuses to mount."""
    monkeypatch.setenv("CKPTFS_FUSE_PREFIX", str(tmp_path / "no-build"))  # the daemon inherits it
    with mounter_in(tmp_path, passthrough="") as mounter:
        m = mounter("auto")
        lines = m.ready.strip().splitlines()
        assert len(lines) == 2 and "ready" in lines[0], m.ready
        assert lines[1].startswith("ckptfs: the daemon serves reads and writes (no FUSE "
                                   "passthrough: the pyfuse3 found has no passthrough"), m.ready
        pt = _pt(m)
        assert pt["active"] is False and "no passthrough support" in pt["reason"], pt
        (m.path / "f").write_bytes(b"y" * MiB)
        assert (m.path / "f").read_bytes() == b"y" * MiB
        assert _pt(m)["requests"]["write"] > 0

    mnt = tmp_path / "on" / "mnt"
    mnt.mkdir(parents=True)
    done = ckptfs("mount", mnt, "--staging", tmp_path / "on" / "staging",
                  "--store", tmp_path / "store", "--create-store", "-o", "passthrough=on",
                  check=False)
    try:
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "passthrough = on, but" in lines[0], done.stderr
        assert "scripts/build_passthrough_fuse.sh" in lines[0]
    finally:
        if is_mounted(mnt):
            ckptfs("umount", mnt, check=False)


def test_a_passthrough_writer_makes_room_as_it_writes(passthrough_ready: None,
                                                      mounter: Mounter) -> None:
    """The daemon sees no WRITE of a passthrough writer, yet follows its size and evicts
    committed copies ahead of it, before the writer sends any request (docs/PASSTHROUGH.md,
    "Space")."""
    m = mounter("pt", extra=["-o", "passthrough=on", "-o", f"staging_max_bytes={48 * MiB}",
                             "-o", f"passthrough_write_reserve={8 * MiB}"])
    old = [f"old{i}" for i in range(4)]
    for i, name in enumerate(old):
        (m.path / name).write_bytes(_pattern(8 * MiB, seed=10 + i))
    sync(m)
    assert [m.state(n) for n in old] == ["committed"] * 4
    data = _pattern(40 * MiB, seed=20)
    before = _pt(m)
    with open(m.path / "big", "wb", buffering=0) as f:
        f.writelines(data[at:at + 8 * MiB] for at in range(0, len(data), 8 * MiB))
        # No request about "big" since its open: only the daemon's watch can know.
        wait_for("committed copies evicted ahead of the writer",
                 lambda: sum(m.state(n) == "remote" for n in old) >= 2)
        staging = status(m)["staging"]
        assert staging["used_bytes"] >= 40 * MiB, staging   # the writer's bytes are counted
        assert staging["used_bytes"] <= 48 * MiB + 8 * MiB, staging
    assert (m.path / "big").read_bytes() == data
    after = _pt(m)
    assert after["requests"]["write"] == before["requests"]["write"], after
    assert after["reserved_bytes"] == 0 and after["writers"] == 0, after
    for i, name in enumerate(old):   # evicted, not lost
        assert (m.path / name).read_bytes() == _pattern(8 * MiB, seed=10 + i)
