"""Waiting for uploads, as an operator sees it: ``sync`` progress that moves within a file,
Ctrl-C that says what goes on, and ``status`` of a mount whose daemon is gone.

The store is a file tier slowed down by its ``faults`` table (``bandwidth``: the bytes go out
over the transfer time, reported as they go, tiers/faulty.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptfs.ops import client
from tests.mounting import CKPTFS, Mounter, ckptfs, daemon_gone, is_mounted, wait_for
from tests.test_ops_status import file_tier_config

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

KiB = 1024


def test_sync_progress_moves_within_a_file(tmp_path: Path, mounter: Mounter) -> None:
    store = tmp_path / "store"
    store.mkdir()
    m = mounter(config=file_tier_config(tmp_path / "c.toml", store, bandwidth=256 * KiB))
    size = 1024 * KiB  # 4 s at 256 KiB/s
    (m.path / "model.pt").write_bytes(os.urandom(size))
    replies: list[dict[str, Any]] = []
    assert client.sync(str(m.path), "", 120, replies.append)
    assert replies[0]["total_bytes"] == size
    # Not only "everything left" then "nothing left": bytes sent of the file in flight count.
    between = [r["pending_bytes"] for r in replies if 0 < r["pending_bytes"] < size]
    assert len(between) >= 2, [r["pending_bytes"] for r in replies]
    assert between == sorted(between, reverse=True)


def _waiting_on_the_daemon(proc: subprocess.Popen[str]) -> bool:
    """Whether ``proc`` has a socket open (its request to the control socket)."""
    try:
        links = [os.readlink(fd.path) for fd in os.scandir(f"/proc/{proc.pid}/fd")]
    except OSError:
        return False
    return any(link.startswith("socket:") for link in links)


def _interrupted(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``ckptfs argv``, Ctrl-C it once it waits for the daemon; what it said."""
    # SIGINT as a terminal delivers it, whatever the test runner's own disposition (a shell
    # running the suite in the background ignores it, and a child inherits an ignored signal:
    # Python then installs no KeyboardInterrupt handler). A handled one is reset by exec.
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*CKPTFS, *map(str, argv)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        wait_for("the command to wait on the daemon", lambda: _waiting_on_the_daemon(proc))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_of_sync_or_umount_says_the_uploads_go_on(tmp_path: Path,
                                                        mounter: Mounter) -> None:
    store = tmp_path / "store"
    store.mkdir()
    m = mounter(config=file_tier_config(tmp_path / "c.toml", store, bandwidth=32 * KiB))
    (m.path / "big.pt").write_bytes(os.urandom(2048 * KiB))  # a minute at 32 KiB/s
    done = _interrupted("sync", m.path)
    assert done.returncode == 130, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("ckptfs: error: interrupted: ") and "uploading in the " \
        "background" in lines[0] and f"ckptfs status {m.path}" in lines[0], lines
    done = _interrupted("umount", m.path)
    assert done.returncode == 130, done
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and f"{m.path} is still mounted" in lines[0], done.stderr
    assert f"ckptfs status {m.path}" in lines[0] and "--no-wait" in lines[0], lines
    assert is_mounted(m.path)
    assert "uploading" in m.state("big.pt") or m.state("big.pt") == "staged"
    ckptfs("umount", m.path, "--no-wait")


def test_status_of_a_stale_mount_says_so_at_once(mounter: Mounter) -> None:
    m = mounter()
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    wait_for("the daemon to die", lambda: daemon_gone(pid))
    done = ckptfs("status", m.path, check=False)
    assert done.returncode == 1, done  # as docs/OPERATIONS.md says for a daemon gone
    assert done.stderr.splitlines() == [
        (f"ckptfs: error: {m.path} is a stale mount (its ckptfs daemon is gone): run "
        f"'ckptfs umount {m.path}', then mount it again (the daemon's log is daemon.log in "
        "its staging directory, or the journal under systemd)")], done.stderr
    assert "<staging_dir>" not in done.stderr
    done = ckptfs("umount", m.path, check=False)  # what it says to do works
    assert done.returncode == 0, done
    assert not is_mounted(m.path)
