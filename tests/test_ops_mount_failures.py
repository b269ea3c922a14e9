"""A mount that cannot work fails with its cause in one line, before anything is mounted:
staging or a mountpoint where they would serve another mount's store, and the kernel or
libfuse refusing the mount itself (mount.py ``init_fuse``, cli.py ``_mount_failure``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, ckptfs, is_mounted
from tests.test_cli_errors import assert_nothing_left, assert_user_error
from tests.test_ops_control_access import SETPRIV, reachable_interpreter

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]


def test_staging_or_mountpoint_inside_a_ckptfs_mount_is_refused(
        tmp_path: Path, mounter: Mounter) -> None:
    outer = mounter("outer")
    (outer.path / "inner").mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # Torn down first (before the mount it would stage in) should a mount happen after all.
    mounter.mounts.insert(0, Mount(mnt, tmp_path / "unused", None))
    # Staging in another mount: that mount would upload this one's journal and token.
    done = ckptfs("mount", mnt, "--staging", outer.path / "stg", "--store", tmp_path / "s2",
                  "--create-store", check=False)
    assert_user_error(done, f"staging directory {outer.path / 'stg'} is inside the ckptfs "
                      f"mount {outer.path}")
    assert_nothing_left(mnt)
    assert not (outer.path / "stg").exists()
    # Through a symlink too.
    (tmp_path / "via").symlink_to(outer.path)
    done = ckptfs("mount", mnt, "--staging", tmp_path / "via" / "stg", "--store",
                  tmp_path / "s2", "--create-store", check=False)
    assert_user_error(done, "is inside the ckptfs mount", str(outer.path))
    # Staging inside the mountpoint it would serve: hidden by its own mount.
    done = ckptfs("mount", mnt, "--staging", mnt / "stg", "--store", tmp_path / "s2",
                  "--create-store", check=False)
    assert_user_error(done, "is inside the mountpoint")
    assert_nothing_left(mnt)
    # A mountpoint inside a ckptfs mount.
    done = ckptfs("mount", outer.path / "inner", "--staging", tmp_path / "st3", "--store",
                  tmp_path / "s3", "--create-store", check=False)
    assert_user_error(done, f"mountpoint {outer.path / 'inner'} is inside the ckptfs mount "
                      f"{outer.path}")
    assert not is_mounted(outer.path / "inner")
    assert not (tmp_path / "st3").exists()


def test_a_mount_the_kernel_refuses_says_why_in_one_line(open_base: Path) -> None:
    """As a user who may not open /dev/fuse: libfuse's reason, not an exception group."""
    if SETPRIV is None:
        pytest.skip("setpriv (util-linux) is not installed")
    user = pwd.getpwnam("nobody")
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        pytest.skip("/dev/fuse is open to every user here: the kernel would not refuse")
    for name in ("mnt", "store", "staging"):
        (open_base / name).mkdir()
        os.chown(open_base / name, user.pw_uid, user.pw_gid)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HOME": "/"}
    done = subprocess.run(
        [*reachable_interpreter(open_base), str(SETPRIV), f"--reuid={user.pw_uid}",
         f"--regid={user.pw_gid}", "--clear-groups", "--", sys.executable, "-m", "ckptfs",
         "mount", str(open_base / "mnt"), "--staging", str(open_base / "staging"), "--store",
         str(open_base / "store")],
        capture_output=True, text=True, timeout=120, cwd="/", env=env, check=False)
    line = assert_user_error(done, f"cannot mount {open_base / 'mnt'}: ",
                             "/dev/fuse: Permission denied")
    assert "Trio" not in line and "details in" not in line, line
    assert_nothing_left(open_base / "mnt")
    log = (open_base / "staging" / "daemon.log").read_text()
    assert "fuse: failed to open /dev/fuse: Permission denied" in log, log
    shutil.rmtree(open_base / "staging", ignore_errors=True)
