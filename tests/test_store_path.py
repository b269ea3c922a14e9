"""A file-tier store path: absolute, existing (or --create-store), no s3:/ typos, a warning when
it is local. Real CLI subprocesses; one real mount per mount test."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, Tmpfs, ckptfs, is_mounted, sync
from tests.test_cli_errors import assert_nothing_left, assert_user_error


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    """An empty mountpoint, unmounted in teardown if a failed test left a mount there."""
    path = tmp_path / "mnt"
    path.mkdir()
    try:
        yield path
    finally:
        if is_mounted(path):
            subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(path), "--timeout",
                            "30"], capture_output=True, timeout=120, check=False)
        if is_mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True,
                           check=False)


def _mount(mnt: Path, staging: Path, *args: str | os.PathLike[str],
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptfs", "mount", str(mnt), "--staging", str(staging),
         *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd,
        stdin=subprocess.DEVNULL, check=False)


def test_relative_store_refused(tmp_path: Path, mnt: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    done = _mount(mnt, tmp_path / "staging", "--store", "ckpt/run1", "--create-store", cwd=work)
    assert_user_error(done, "'ckpt/run1'", "absolute", "s3://")
    assert not (work / "ckpt").exists()
    assert_nothing_left(mnt)


def test_s3_typos_name_the_right_form(tmp_path: Path, mnt: Path) -> None:
    for typo, right in [("s3:/ckpt/run1", "s3://ckpt/run1"), ("s3:ckpt", "s3://ckpt"),
                        ("S3:/ckpt/run1", "s3://ckpt/run1"), ("file:/data/x", "file:///data/x")]:
        done = _mount(mnt, tmp_path / "staging", "--store", typo, "--create-store", cwd=tmp_path)
        assert_user_error(done, repr(typo), repr(right))
        assert not (tmp_path / "s3:").exists() and not (tmp_path / "S3:").exists()
    # The same typo in a config file: named with its key.
    config = tmp_path / "c.toml"
    config.write_text('[[tier]]\nname = "hot"\n[[tier]]\nname = "warm"\nurl = "s3:/ckpt/x"\n')
    done = ckptfs("mount", mnt, "--config", config, "--staging", tmp_path / "staging",
                  check=False)
    assert_user_error(done, "tier.1.url", "'s3://ckpt/x'")
    assert_nothing_left(mnt)


def test_missing_store_refused(tmp_path: Path, mnt: Path) -> None:
    lustre = tmp_path / "lustre" / "ckpt"
    done = _mount(mnt, tmp_path / "staging", "--store", lustre)
    assert_user_error(done, str(lustre), "does not exist", "--create-store")
    assert not (tmp_path / "lustre").exists()
    # By config url too.
    config = tmp_path / "c.toml"
    config.write_text(f'[[tier]]\nname = "hot"\n[[tier]]\nname = "warm"\n'
                      f'url = "{lustre.as_uri()}"\n')
    done = ckptfs("mount", mnt, "--config", config, "--staging", tmp_path / "staging",
                  check=False)
    assert_user_error(done, str(lustre), "does not exist")
    assert not (tmp_path / "lustre").exists()
    # A file where the directory should be.
    (tmp_path / "afile").write_text("x")
    done = _mount(mnt, tmp_path / "staging", "--store", tmp_path / "afile", "--create-store")
    assert_user_error(done, str(tmp_path / "afile"), "not a directory")
    assert_nothing_left(mnt)


def test_create_store_mounts_and_warns_local(tmp_path: Path, mnt: Path,
                                             mounter: Mounter) -> None:
    store = tmp_path / "new" / "store"
    staging = tmp_path / "staging"
    mounter.mounts.append(Mount(mnt, staging, store))
    done = _mount(mnt, staging, "--store", store, "--create-store")
    assert done.returncode == 0, done.stderr
    assert store.is_dir() and is_mounted(mnt)
    assert done.stdout.strip() == f"ckptfs: {mnt} ready: hot {staging}, warm {store.as_uri()}"
    # Same filesystem as the staging directory: one warning line naming both.
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: warning: store "), done.stderr
    assert str(store) in lines[0] and str(staging) in lines[0]
    assert "not shared storage" in lines[0]
    (mnt / "f").write_bytes(b"data")
    sync(mounter.mounts[-1])
    assert (store / "f").read_bytes() == b"data"
    ckptfs("umount", mnt)
    assert_nothing_left(mnt)


def test_config_create_store_and_other_filesystem(tmp_path: Path, mnt: Path, mounter: Mounter,
                                                  tmpfs: Tmpfs) -> None:
    """``create_store = true`` in the config file; a store on its own filesystem (neither
    the staging directory's nor /'s): no warning."""
    shared = tmpfs(tmp_path / "shared", "size=4m")
    store = shared / "run1"
    staging = tmp_path / "staging"
    config = tmp_path / "c.toml"
    config.write_text(f'create_store = true\n[[tier]]\nname = "hot"\n[[tier]]\n'
                      f'name = "warm"\nurl = "{store.as_uri()}"\n')
    mounter.mounts.append(Mount(mnt, staging, None, config=config))
    done = ckptfs("mount", mnt, "--config", config, "--staging", staging, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert store.is_dir()
    ckptfs("umount", mnt)
    # -o create_store (as in fstab) with a missing store of the same kind.
    store2 = shared / "run2"
    done = _mount(mnt, tmp_path / "staging2", "--store", store2, "-o", "create_store=true")
    assert done.returncode == 0, done.stderr
    assert store2.is_dir() and done.stderr == "", done.stderr
    ckptfs("umount", mnt)
    assert_nothing_left(mnt)


# -- the store a staging directory belongs to ---------------------------------------------


def test_staging_refuses_another_store(tmp_path: Path, mounter: Mounter) -> None:
    store_a, store_b = tmp_path / "a", tmp_path / "b"
    m = mounter("n", store=store_a)
    record = m.staging / "store-id"
    assert record.read_text() == store_a.as_uri() + "\n"
    (m.path / "f").write_bytes(b"data")
    m.umount()
    done = ckptfs("mount", m.path, "--staging", m.staging, "--store", store_b, "--create-store",
                  check=False)
    assert_user_error(done, str(m.staging), store_a.as_uri(), store_b.as_uri(), "--adopt-store")
    assert not is_mounted(m.path)
    assert record.read_text() == store_a.as_uri() + "\n"
    # The same store, spelled differently (a path, a trailing slash): the same identity.
    done = ckptfs("mount", m.path, "--staging", m.staging, "--store", f"{store_a}/")
    m.umount()
    # --adopt-store moves it, and rewrites the record.
    m.store, m.extra = store_b, ["--adopt-store"]
    m.remount()
    assert record.read_text() == store_b.as_uri() + "\n"
    assert (m.path / "f").read_bytes() == b"data"
    sync(m)
    assert (store_b / "f").read_bytes() == b"data"
    m.umount()
    # From now on B is the store; A is refused.
    done = ckptfs("mount", m.path, "--staging", m.staging, "--store", store_a, check=False)
    assert_user_error(done, store_b.as_uri(), store_a.as_uri())
    assert not is_mounted(m.path)


def test_staging_without_record_adopts(tmp_path: Path, mounter: Mounter) -> None:
    m = mounter("n", store=tmp_path / "a")
    m.umount()
    (m.staging / "store-id").unlink()
    m.store = tmp_path / "b"
    m.remount()
    assert (m.staging / "store-id").read_text() == (tmp_path / "b").as_uri() + "\n"
    assert not list(m.staging.glob(".store-id*"))
    m.umount()
