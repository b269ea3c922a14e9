"""systemd integration (mount/): the units verify, the fstab example makes a network mount
ordered after the NVMe, and ``ckptfs mount --foreground`` reports readiness through
``NOTIFY_SOCKET`` exactly when the mount is there (a fake socket bound by the test).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import CKPTFS, ckptfs, is_mounted

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
FSTAB_GENERATOR = Path("/lib/systemd/system-generators/systemd-fstab-generator")


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """mount/install.sh run under a DESTDIR (the units with the interpreter filled in)."""
    root = tmp_path / "root"
    env = {**os.environ, "DESTDIR": str(root), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "mount" / "install.sh")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return root


def verify(*units: Path) -> None:
    """``systemd-analyze verify``: exit 0 and not one complaint about our units."""
    if SYSTEMD_ANALYZE is None:
        pytest.skip("systemd-analyze is not installed")
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", *map(str, units)], capture_output=True,
                          text=True, timeout=120, check=False)
    ours = [line for line in (done.stdout + done.stderr).splitlines()
            if any(u.name in line or u.stem in line for u in units)]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr


def test_service_template_verifies(installed: Path) -> None:
    unit = installed / "etc/systemd/system/ckptfs@.service"
    text = unit.read_text()
    assert "Type=notify" in text and "--foreground" in text and "@PYTHON@" not in text
    verify(unit)


def test_mount_unit_example_verifies(installed: Path) -> None:
    verify(installed / "usr/share/doc/ckptfs/examples/ckpt.mount")


def test_fstab_example_is_a_network_mount_after_the_nvme(tmp_path: Path) -> None:
    if not FSTAB_GENERATOR.exists():
        pytest.skip("systemd-fstab-generator is not installed")
    out = tmp_path / "generated"
    out.mkdir()
    env = {**os.environ, "SYSTEMD_FSTAB": str(ROOT / "mount" / "fstab.example"),
           "SYSTEMD_PROC_CMDLINE": ""}
    done = subprocess.run([str(FSTAB_GENERATOR), str(out), str(out), str(out)], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    unit = out / "ckpt.mount"
    text = unit.read_text()
    assert "Type=ckptfs" in text and "What=s3://my-bucket/run1" in text
    assert "RequiresMountsFor=/nvme" in text
    # _netdev: a remote mount, so systemd orders it after network-online.target
    assert (out / "remote-fs.target.wants" / "ckpt.mount").exists()
    verify(unit)


# -- readiness ----------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(120)  # a hang fails the test instead of blocking it forever
    try:
        yield sock, path
    finally:
        sock.close()


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_foreground_mount_notifies_ready_when_mounted_and_stopping_on_sigterm(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    sock, address = notify_socket
    mnt, staging, store = tmp_path / "mnt", tmp_path / "staging", tmp_path / "store"
    mnt.mkdir()
    store.mkdir()
    env = {**os.environ, "NOTIFY_SOCKET": address}
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [*CKPTFS, "mount", "--foreground", str(mnt), "--staging", str(staging),
         "--store", str(store)], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        message = sock.recv(4096)
        assert message == b"READY=1", (tmp_path / "daemon.log").read_text()
        assert is_mounted(mnt)  # ready means mounted, not "about to be"
        (mnt / "f").write_bytes(b"ready")
        assert (mnt / "f").read_bytes() == b"ready"
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert proc.wait(timeout=120) == 0, (tmp_path / "daemon.log").read_text()
        assert not is_mounted(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_background_daemon_does_not_inherit_notify_socket(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """Only the process systemd started may notify (NotifyAccess=main): the daemon that
    ``ckptfs mount`` leaves behind must not claim readiness for someone else's unit."""
    _, address = notify_socket
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "NOTIFY_SOCKET": address}
    ckptfs("mount", mnt, "--staging", tmp_path / "staging", "--store", tmp_path / "store",
           "--create-store", env=env)
    try:
        import json

        pid = json.loads(os.getxattr(mnt, "user.ckptfs.daemon"))["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(v.startswith(b"NOTIFY_SOCKET=") for v in environ)
    finally:
        ckptfs("umount", mnt, check=False)
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
