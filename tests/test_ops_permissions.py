"""Other users and the mount: ``allow_other`` only when asked, and then the kernel checks modes.

A mount made by root with ``allow_other``: a second uid (``nobody``, via setpriv) can read a
0644 file, cannot write it, cannot read a 0600 file and cannot create files in a 0755 root-owned
directory. Without ``allow_other`` it cannot even look inside. As root, /etc/fuse.conf's
``user_allow_other`` is not needed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import Mounter, mounter_in

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240), pytest.mark.both_modes]

SETPRIV = shutil.which("setpriv")


@pytest.fixture
def world_mounter(open_base: Path, io_mode: str) -> Iterator[Mounter]:
    with mounter_in(open_base, io_mode) as m:
        yield m


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    user = pwd.getpwnam("nobody")
    return subprocess.run(
        [str(SETPRIV), f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
         "--", *argv], capture_output=True, text=True, timeout=60, cwd="/", check=False)


def fuse_conf_allows_other() -> bool:
    try:
        lines = Path("/etc/fuse.conf").read_text().splitlines()
    except FileNotFoundError:
        return False
    return any(line.strip() == "user_allow_other" for line in lines)


def test_allow_other_lets_another_uid_read_by_mode_only(world_mounter: Mounter) -> None:
    m = world_mounter("shared", extra=["--allow-other"])
    public, private = m.path / "public.pt", m.path / "private.pt"
    public.write_bytes(b"for everyone")
    os.chmod(public, 0o644)
    private.write_bytes(b"root only")
    os.chmod(private, 0o600)
    os.chmod(m.path.parent, 0o755)

    done = as_nobody("cat", str(public))
    assert done.returncode == 0 and done.stdout == "for everyone", done.stderr
    done = as_nobody("sh", "-c", f"echo x >> '{public}'")
    assert done.returncode != 0 and "Permission denied" in done.stderr
    done = as_nobody("cat", str(private))
    assert done.returncode != 0 and "Permission denied" in done.stderr
    done = as_nobody("touch", str(m.path / "new-file"))
    assert done.returncode != 0 and "Permission denied" in done.stderr
    assert public.read_bytes() == b"for everyone"
    assert not (m.path / "new-file").exists()
    # As root, no user_allow_other is needed in /etc/fuse.conf (when it is absent, this mount
    # just proved it).
    if not fuse_conf_allows_other():
        assert "allow_other" in Path("/proc/self/mountinfo").read_text()


def test_without_allow_other_other_users_are_shut_out(world_mounter: Mounter) -> None:
    m = world_mounter("private")
    (m.path / "public.pt").write_bytes(b"x")
    os.chmod(m.path / "public.pt", 0o644)
    os.chmod(m.path.parent, 0o755)
    done = as_nobody("cat", str(m.path / "public.pt"))
    assert done.returncode != 0 and "Permission denied" in done.stderr
