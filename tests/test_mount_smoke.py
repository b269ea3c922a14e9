"""The smallest real-mount round trip: write, remount, read back."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs.errors import UserError
from ckptfs.ops import controlsocket
from tests.mounting import Mounter, ckptfs, wait_for

pytestmark = [pytest.mark.mount, pytest.mark.both_modes]


def test_write_remount_read(mounter: Mounter) -> None:
    m = mounter()
    (m.path / "step_1").mkdir()
    (m.path / "step_1" / "model.pt").write_bytes(b"x" * 100_000)
    os.symlink("step_1", m.path / "latest")
    assert m.state("step_1/model.pt") in ("staged", "uploading", "committed")
    m.umount()  # waits for the uploads
    assert (m.store / "step_1" / "model.pt").read_bytes() == b"x" * 100_000
    assert os.readlink(m.store / "latest") == "step_1"
    assert not any(m.path.iterdir())
    m.remount()
    assert (m.path / "step_1" / "model.pt").read_bytes() == b"x" * 100_000
    assert os.readlink(m.path / "latest") == "step_1"
    assert sorted(os.listdir(m.path)) == ["latest", "step_1"]
    assert m.state("step_1/model.pt") == "committed"


def test_long_staging_path(mounter: Mounter, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A staging path too long for a unix socket still gets a control socket (elsewhere)."""
    # Not the machine's /run/ckptfs-0, which other runs' mounts may be using (whose mode this
    # version sets: controlsocket.RUN_DIR_MODE); the daemon inherits the environment.
    monkeypatch.setenv("CKPTFS_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    staging = tmp_path / ("s" * 60) / ("t" * 60)
    m = mounter("long", staging=staging)
    (m.path / "f").write_bytes(b"data")
    status = json.loads(ckptfs("status", m.path, "--json").stdout)
    assert status["staging_dir"] == str(staging)
    ckptfs("sync", m.path)
    assert (m.store / "f").read_bytes() == b"data"
    run_dir = tmp_path / "run" / f"ckptfs-{os.geteuid()}"
    assert [p.suffix for p in run_dir.iterdir()] == [".sock"]
    assert stat.S_IMODE(os.lstat(run_dir).st_mode) == controlsocket.RUN_DIR_MODE


UNSHARE = shutil.which("unshare")


@pytest.mark.skipif(os.geteuid() != 0 or UNSHARE is None,
                    reason="needs root and unshare(1): a private /run in a mount namespace")
def test_long_staging_path_with_a_loose_runtime_dir(tmp_path: Path) -> None:
    """/run/ckptfs-<uid> left 0755 (by a umask, a tool, an older run) is ours: the mount
    tightens it instead of failing with "is not private to this user" (a CI failure).

    In a private mount namespace with its own tmpfs on /run: the machine's real
    /run/ckptfs-0 may serve other mounts meanwhile, and loosening it would break them."""
    staging = tmp_path / ("s" * 60) / ("t" * 60)
    mnt, store, out = tmp_path / "mnt", tmp_path / "store", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    run_dir = f"/run/ckptfs-{os.geteuid()}"
    cli = f"{shlex.quote(sys.executable)} -m ckptfs"
    q = shlex.quote
    script = f"""
set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -m 0755 {run_dir}
trap 'fusermount3 -u -z {q(str(mnt))} 2>/dev/null || true' EXIT
{cli} mount {q(str(mnt))} --staging {q(str(staging))} --store {q(str(store))} --create-store
echo data > {q(str(mnt / "f"))}
{cli} status {q(str(mnt))} --json > {q(str(out / "status.json"))}
{cli} sync {q(str(mnt))}
stat -c %a {run_dir} > {q(str(out / "mode"))}
ls {run_dir} > {q(str(out / "sockets"))}
{cli} umount {q(str(mnt))}
"""
    done = subprocess.run([str(UNSHARE), "--mount", "--propagation", "private", "sh", "-c",
                           script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "status.json").read_text())["staging_dir"] == str(staging)
    assert int((out / "mode").read_text(), 8) == controlsocket.RUN_DIR_MODE
    assert (out / "sockets").read_text().strip().endswith(".sock")
    assert (store / "f").read_bytes() == b"data\n"


def test_runtime_dir_of_ours_is_tightened_others_refused(tmp_path: Path) -> None:
    """The runtime directory check itself (lstat): ours but loose is chmod'ed; a symlink, a
    file or a directory of another user is refused with a one-line UserError."""
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    controlsocket._private_dir(loose)
    assert stat.S_IMODE(os.lstat(loose).st_mode) == controlsocket.RUN_DIR_MODE
    controlsocket._private_dir(tmp_path / "new")
    assert stat.S_IMODE(os.lstat(tmp_path / "new").st_mode) == controlsocket.RUN_DIR_MODE

    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(UserError, match="symlink"):
        controlsocket._private_dir(tmp_path / "link")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755  # never chmod'ed through the link
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UserError, match="not a directory"):
        controlsocket._private_dir(tmp_path / "file")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UserError, match="owned by uid 65534"):
            controlsocket._private_dir(theirs)
        assert stat.S_IMODE(os.stat(theirs).st_mode) == 0o755


def _read_ahead_kb(path: Path) -> int:
    dev = os.stat(path).st_dev
    return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
               .read_text())


@pytest.mark.skipif(os.geteuid() != 0, reason="read_ahead_kb is set through sysfs (root)")
def test_kernel_readahead_is_set_on_the_mount(mounter: Mounter) -> None:
    """read_ahead_kb (default 1024) lands in the mount's bdi; the mount point is found in
    /proc/self/mountinfo even with a space in its path (an octal escape there)."""
    m = mounter("with space")
    assert " " in str(m.path)
    # Set by the daemon right after the kernel's INIT, which may be a moment after the mount.
    wait_for("read_ahead_kb 1024", lambda: _read_ahead_kb(m.path) == 1024, timeout=10)
    other = mounter("other", extra=["-o", "read_ahead_kb=2048"])
    wait_for("read_ahead_kb 2048", lambda: _read_ahead_kb(other.path) == 2048, timeout=10)
    assert _read_ahead_kb(m.path) == 1024
