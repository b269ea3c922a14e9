"""FUSE passthrough build (docs/PASSTHROUGH.md): scripts/build_passthrough_fuse.sh gives a
pyfuse3 whose opens the kernel serves from a backing file, with no READ or WRITE request
reaching the daemon.

Runs the build script (cached: under a second once built; skipped only when its prerequisites
cannot be fetched), then mounts tests/passthrough_fs.py (the demo fs) as a subprocess; every
mount is unmounted in teardown, even on failure.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mounting import wait_for
from tests.passthrough_fs import BUILD_UNFETCHABLE, PREFIX, build, demo_mount, stats

pytestmark = [pytest.mark.mount, pytest.mark.slow]

SIZE = 64 << 20
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def built() -> Path:
    done = build()
    if done.returncode == BUILD_UNFETCHABLE:
        pytest.skip("the passthrough build's prerequisites cannot be fetched: "
                    + done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, f"build_passthrough_fuse.sh failed:\n{done.stdout}\n{done.stderr}"
    return PREFIX / "python"


@pytest.fixture
def needs_kernel_passthrough() -> None:
    release = tuple(int(x) for x in platform.release().split(".")[:2])
    if release < (6, 9):
        pytest.skip(f"kernel {platform.release()} has no FUSE passthrough (6.9+)")
    if os.geteuid() != 0:
        pytest.skip("FUSE_DEV_IOC_BACKING_OPEN needs CAP_SYS_ADMIN (the demo would fall back)")


def _random_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for i in range(size // CHUNK):
            block = hashlib.sha256(i.to_bytes(8, "little")).digest() * (CHUNK // 32)
            f.write(block)
            h.update(block)
    return h.hexdigest()


def _read_all(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def test_build_leaves_stock_pyfuse3_alone(built: Path) -> None:
    code = "import pyfuse3; print(pyfuse3.__file__, hasattr(pyfuse3, 'passthrough_open'))"
    stock = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={k: v for k, v in os.environ.items()
                                            if k != "PYTHONPATH"}).stdout.split()
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": str(built)}).stdout.split()
    assert stock[1] == "False" and not stock[0].startswith(str(PREFIX))
    assert ours == [str(built / "pyfuse3" / Path(ours[0]).name), "True"]


def test_passthrough_read_reaches_no_daemon(built: Path, needs_kernel_passthrough: None,
                                            tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    digest = _random_file(source / "ckpt.bin", SIZE)
    mnt = tmp_path / "mnt"
    with demo_mount(source, mnt, "passthrough"):
        assert stats(mnt)["passthrough"] is True
        assert os.path.getsize(mnt / "ckpt.bin") == SIZE
        assert _read_all(mnt / "ckpt.bin") == digest
        s = stats(mnt)
        assert s.get("read_requests", 0) == 0, s
        assert s["passthrough_opens"] == 1 and s.get("fallback_opens", 0) == 0, s
        # RELEASE comes after close(2) returns: the inode's backing id goes with it.
        wait_for("backing id closed", lambda: stats(mnt)["open_backing_ids"] == 0)


def test_passthrough_write_reaches_no_daemon(built: Path, needs_kernel_passthrough: None,
                                             tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    mnt = tmp_path / "mnt"
    block = os.urandom(CHUNK)
    with demo_mount(source, mnt, "passthrough"):
        with open(mnt / "new.bin", "wb", buffering=0) as f:
            f.writelines(block for _ in range(8))
            os.fsync(f.fileno())
            # a second open of the same inode shares its backing id
            with open(mnt / "new.bin", "rb", buffering=0) as g:
                assert g.read(CHUNK) == block
        assert os.path.getsize(mnt / "new.bin") == 8 * CHUNK
        s = stats(mnt)
        assert s.get("write_requests", 0) == 0 and s.get("read_requests", 0) == 0, s
    assert (source / "new.bin").read_bytes() == block * 8


def test_stock_mode_counts_reads(built: Path, tmp_path: Path) -> None:
    """The same demo without passthrough serves reads itself: the zero above is meaningful."""
    source = tmp_path / "src"
    source.mkdir()
    digest = _random_file(source / "ckpt.bin", 4 * CHUNK)
    mnt = tmp_path / "mnt"
    with demo_mount(source, mnt, "stock"):
        assert _read_all(mnt / "ckpt.bin") == digest
        s = stats(mnt)
        assert s["passthrough"] is False and s["read_requests"] > 0, s
