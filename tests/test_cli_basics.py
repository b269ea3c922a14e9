"""The everyday CLI contract: --version/-h, case-insensitive log
levels, exit codes of status, and paths that do not exist."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptfs import __version__
from tests.mounting import Mounter, ckptfs, daemon_gone
from tests.test_cli_errors import assert_user_error


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    done = ckptfs(flag)
    assert done.stdout.strip() == f"ckptfs {__version__}" and done.stderr == ""


@pytest.mark.parametrize("argv", [["-h"], ["--help"], ["mount", "-h"], ["status", "-h"]])
def test_short_help(argv: list[str]) -> None:
    done = ckptfs(*argv)
    assert "Usage:" in done.stdout and done.returncode == 0


@pytest.mark.mount
def test_log_level_is_case_insensitive(mounter: Mounter) -> None:
    m = mounter(extra=["--log-level", "WARNING"])
    assert json.loads(ckptfs("status", m.path, "--json").stdout)["mountpoint"] == str(m.path)


@pytest.mark.mount
def test_sync_and_evict_of_a_path_that_is_not_there(mounter: Mounter) -> None:
    m = mounter()
    for command in ("sync", "evict"):
        done = ckptfs(command, m.path / "step_9", check=False)   # a typo of step_90
        assert_user_error(done, str(m.path / "step_9"), "no such file or directory")


def test_status_json_with_nothing_mounted_is_an_empty_list() -> None:
    """Seen from a mount namespace of its own, where every ckptfs mount is detached."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    script = ("awk '$3 == \"fuse.ckptfs\" {print $2}' /proc/mounts | "
              "while read -r m; do umount -l \"$(printf '%b' \"$m\")\"; done; "
              'exec "$@"')
    done = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, "-m", "ckptfs", "status", "--json"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and json.loads(done.stdout) == [], done


@pytest.mark.mount
def test_status_exits_non_zero_when_a_daemon_does_not_answer(mounter: Mounter) -> None:
    m = mounter()
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not daemon_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    done = ckptfs("status", "--json", check=False)   # every mount: this one is dead
    assert done.returncode == 1, done
    reports = {r["mountpoint"]: r for r in json.loads(done.stdout)}
    assert "error" in reports[str(m.path)]
    assert str(m.path) in done.stderr and "daemon.log" in done.stderr, done.stderr


@pytest.mark.mount
def test_sync_without_a_terminal_prints_progress_lines(mounter: Mounter, tmp_path: Path) -> None:
    """A batch job's log gets a line every 15 s (bytes, rate, files left), not a bar."""
    from tests.test_ops_status import file_tier_config

    store = tmp_path / "store"
    store.mkdir()
    # 64 KiB/s: 1.25 MiB takes 20 s to upload.
    m = mounter(config=file_tier_config(tmp_path / "c.toml", store, bandwidth=64 * 1024))
    (m.path / "slow.pt").write_bytes(b"s" * (1280 * 1024))
    done = ckptfs("sync", m.path, "--timeout", "120")   # stdin/stdout/stderr: not a tty
    lines = [line for line in done.stderr.splitlines() if line.startswith("ckptfs: committing")]
    assert lines, done.stderr
    assert "MiB" in lines[0] and "/s" in lines[0] and "1 file left" in lines[0], lines
    assert not lines[0].startswith("ckptfs: committing: 0 B of"), lines  # moves within it


@pytest.mark.mount
def test_the_daemon_raises_its_open_file_limit(mounter: Mounter, tmp_path: Path) -> None:
    """Started with a soft limit of 1024 (a common default), the daemon runs at its hard
    limit: a checkpoint of thousands of open shards must not meet EMFILE."""
    import resource

    prlimit = shutil.which("prlimit")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if prlimit is None or hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip("needs prlimit(1) and a finite hard limit above 1024")
    path = tmp_path / "mnt"
    path.mkdir()
    from tests.mounting import Mount

    mounter.mounts.append(Mount(path, tmp_path / "st", tmp_path / "store"))
    subprocess.run([prlimit, f"--nofile=1024:{hard}", sys.executable, "-m", "ckptfs", "mount",
                    str(path), "--staging", str(tmp_path / "st"), "--store",
                    str(tmp_path / "store"), "--create-store"], check=True, capture_output=True, timeout=120)
    pid = mounter.mounts[-1].pid
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    row = next(line for line in limits if line.startswith("Max open files")).split()
    assert int(row[3]) == hard, row   # soft limit, as the hard one
