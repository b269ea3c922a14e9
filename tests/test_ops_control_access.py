"""Who may use a mount's control socket (control.py): decided from the peer's credentials.

Real mounts made by root with ``allow_other`` in a base directory every user can traverse; the
CLI is run as ``nobody`` through setpriv, with no groups, or with the group of the mount's root
directory as its primary or a supplementary group:
- a user outside the group is refused ``status`` and ``sync`` with one line
  ``ckptfs: error: permission denied ...`` (exit code != 0, no traceback);
- a member of the group may run ``status`` and ``sync`` (it waits until the upload is done)
  but not ``evict``;
- root still runs everything; the staging directory is 0711 (the socket is reachable) and the
  files in it stay 0600.
The same holds when the socket lives in the runtime directory (a long staging path). The rule
table itself (owner, root, member, other; every op) is checked on ``ControlServer._refusal``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptfs.ops import control, controlsocket
from tests.mounting import Mount, Mounter, ckptfs, mounter_in
from tests.test_cli_errors import assert_user_error

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]

SETPRIV = shutil.which("setpriv")
UNSHARE = shutil.which("unshare")
GROUP = 4242  # the mount root's group in these tests: any gid works, it need not be named


@pytest.fixture
def world_mounter(open_base: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mounter]:
    # A runtime directory of our own for sockets of long staging paths: the machine's
    # /run/ckptfs-0 may serve other runs' mounts (the daemons inherit this environment).
    run = open_base / "run"
    run.mkdir(mode=0o755)
    monkeypatch.setenv("CKPTFS_RUNTIME_DIR", str(run))
    with mounter_in(open_base) as m:
        yield m


def reachable_interpreter(base: Path) -> list[str]:
    """An argv prefix under which another user can run this interpreter.

    It may live in root's 0700 home (pyenv): then the command runs in a private mount
    namespace where /root is a 0755 tmpfs holding just that installation, bind-mounted at its
    own path. Nothing changes for the rest of the machine, and the FUSE mount and the control
    socket (made before) are the same in there."""
    prefix = Path(sys.prefix).resolve()
    home = Path("/root")
    if not prefix.is_relative_to(home) or os.stat(home).st_mode & 0o001:
        return []
    if UNSHARE is None:
        pytest.skip("the interpreter is in /root (0700) and unshare(1) is missing")
    top = home / prefix.relative_to(home).parts[0]
    keep = base / "interpreter"
    keep.mkdir(mode=0o755, exist_ok=True)
    q = shlex.quote
    script = (f"mount --bind {q(str(top))} {q(str(keep))} && "
              "mount -t tmpfs -o mode=0755 tmpfs /root && "
              f"mkdir -p {q(str(top))} && mount --bind {q(str(keep))} {q(str(top))} && "
              'exec "$@"')
    return [UNSHARE, "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def as_user(*argv: str, gid: int | None = None, groups: list[int] | None = None,
            python: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``ckptfs argv`` (or, with ``python``, that script with ``argv``) as nobody, with
    primary group ``gid`` (default: nobody's) and supplementary ``groups`` (default: none)."""
    user = pwd.getpwnam("nobody")
    ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid if gid is None else gid}"]
    ids += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HOME": "/"}
    base = Path(os.environ["CKPTFS_RUNTIME_DIR"]).parent  # world_mounter's open base
    return subprocess.run(
        [*reachable_interpreter(base), str(SETPRIV), *ids, "--", sys.executable,
         *(["-c", python] if python else ["-m", "ckptfs"]), *argv],
        capture_output=True, text=True, timeout=120, cwd="/", env=env, check=False)


def shared_mount(world_mounter: Mounter, name: str, staging: Path | None = None) -> Mount:
    m = world_mounter(name, staging=staging, extra=["--allow-other"])
    os.chmod(m.path.parent, 0o755)
    os.chown(m.path, -1, GROUP)  # the mount root's group: who may sync
    os.chmod(m.path, 0o755)
    return m


def check_access(m: Mount) -> None:
    (m.path / "f").write_bytes(b"x" * 100_000)
    # Outside the group: refused, one line, before anything is answered.
    for argv in (["status", str(m.path)], ["sync", str(m.path)],
                 ["evict", str(m.path / "f")]):
        line = assert_user_error(as_user(*argv), "permission denied")
        assert f"gid {GROUP}" in line, line
    # In the group (as a supplementary group, and as the primary one): status and sync.
    for ids in ({"groups": [GROUP]}, {"gid": GROUP}):
        done = as_user("sync", str(m.path), "--timeout", "120", **ids)  # type: ignore[arg-type]
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert m.state("f") == "committed"
        done = as_user("status", str(m.path), "--json", **ids)  # type: ignore[arg-type]
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["queue"]["files"] == 0
        line = assert_user_error(as_user("evict", str(m.path / "f"), **ids),  # type: ignore[arg-type]
                                 "permission denied", "'evict'")
        assert "sync" in line
    assert m.state("f") == "committed"  # the refused evicts did nothing
    # Root (the owner) runs everything.
    ckptfs("evict", m.path / "f")
    assert m.state("f") == "remote"


def test_group_members_may_sync_others_are_refused(world_mounter: Mounter) -> None:
    m = shared_mount(world_mounter, "shared")
    st = os.stat(m.staging)
    assert stat.S_IMODE(st.st_mode) == 0o711
    assert stat.S_IMODE(os.stat(m.staging / "control.sock").st_mode) == control.SOCKET_MODE
    check_access(m)
    for entry in os.scandir(m.staging):
        if entry.name == "control.sock":
            continue
        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
        assert mode & 0o077 == 0, f"{entry.name} is {mode:o}: staging files stay private"


def test_socket_in_the_runtime_directory(world_mounter: Mounter, open_base: Path) -> None:
    """A staging path too long for a socket: the runtime directory is reachable (0711)."""
    staging = open_base / "long" / ("s" * 60) / ("t" * 60)
    m = shared_mount(world_mounter, "long", staging=staging)
    sock = Path(json.loads(os.getxattr(m.path, "user.ckptfs.daemon"))["control"])
    assert sock.parent == open_base / "run" / f"ckptfs-{os.geteuid()}"
    assert stat.S_IMODE(os.lstat(sock.parent).st_mode) == controlsocket.RUN_DIR_MODE == 0o711
    check_access(m)


def test_permission_error_connecting_is_one_line(world_mounter: Mounter) -> None:
    """A socket a user cannot reach at all (a private directory on its way, or an older
    daemon's 0600 socket): one line, not a PermissionError traceback."""
    m = shared_mount(world_mounter, "closed")
    os.chmod(m.staging, 0o700)
    try:
        for argv in (["status", str(m.path)], ["sync", str(m.path)]):
            assert_user_error(as_user(*argv, groups=[GROUP]), "permission denied",
                              "control socket")
    finally:
        os.chmod(m.staging, 0o711)


def test_without_allow_other_one_line(world_mounter: Mounter) -> None:
    m = world_mounter("private")
    os.chmod(m.path.parent, 0o755)
    assert_user_error(as_user("status", str(m.path), groups=[GROUP]), "permission denied",
                      "allow_other")


def _refusal(uid: int, gid: int, op: str, pid: int = 0, **more: Any) -> str | None:
    """``ControlServer._refusal`` on a stand-in whose root directory has group GROUP."""
    fs = SimpleNamespace(getattr=lambda ino: SimpleNamespace(gid=GROUP))
    server = SimpleNamespace(fs=fs, mountpoint=Path("/ckpt"))
    return control.ControlServer._refusal(server, (pid, uid, gid),  # type: ignore[arg-type]
                                          {"op": op, **more})


ALL_OPS = ["status", "sync", "ls-tiers", "retention", "evict", "restore", "no-such-op"]


# Opens N connections to the socket argv[1], sends nothing on any, prints the reply of the last.
SILENT_PEER = """
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    socks.append(s)
socks[-1].settimeout(30)
print(socks[-1].recv(65536).decode())
"""


def test_silent_and_numerous_peers_cannot_hold_the_socket(world_mounter: Mounter) -> None:
    """A stranger is refused at connect, before it sends anything (no descriptor held for
    ``REQUEST_TIMEOUT``); a group member gets at most ``MEMBER_CONNECTIONS`` at once; root
    is never limited."""
    m = shared_mount(world_mounter, "a")
    sock = str(json.loads(os.getxattr(m.path, "user.ckptfs.daemon"))["control"])
    done = as_user(sock, "1", python=SILENT_PEER)
    assert done.returncode == 0, done.stderr
    assert "permission denied" in done.stdout and "control socket" in done.stdout, done.stdout
    n = control.MEMBER_CONNECTIONS + 1
    done = as_user(sock, str(n), python=SILENT_PEER, groups=[GROUP])
    assert done.returncode == 0, done.stderr
    assert "busy" in done.stdout and f"{control.MEMBER_CONNECTIONS} requests" in done.stdout, \
        done.stdout
    with contextlib.ExitStack() as held:   # root's own silent connections do not lock it out
        for _ in range(n):
            s = held.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            s.connect(sock)
        assert ckptfs("status", m.path).returncode == 0


def test_refusal_rules() -> None:
    owner = os.geteuid()
    for op in ALL_OPS:
        assert _refusal(owner, 12345, op) is None
        assert _refusal(0, 0, op, apply=True) is None
    allowed = {"status", "sync", "ls-tiers", "retention"}
    for op in ALL_OPS:
        member = _refusal(54321, GROUP, op)
        assert (member is None) == (op in allowed), op
        assert _refusal(54321, 7, op) is not None  # not in the group at all
    assert _refusal(54321, GROUP, "retention", apply=True) is not None
    # Supplementary groups come from /proc/<pid>/status of the peer, trusted only while that
    # process's effective uid is the peer's (a reused pid says nothing of the peer).
    assert control._supplementary_groups(os.getpid(), os.geteuid()) == frozenset(
        os.getgroups())
    assert control._supplementary_groups(os.getpid(), os.geteuid() + 1) == frozenset()
    assert control._supplementary_groups(2**22 + 1, 0) == frozenset()  # no such process
