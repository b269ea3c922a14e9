"""Where a mount's control socket lives, and the client side of its protocol (blocking).

Kept apart from the server (control.py) so that the CLI's requests (``status``, ``sync``,
``ls-tiers``, and ``mount`` waiting for its daemon) import neither trio nor the filesystem core:
each CLI command starts in a fraction of the time.

Protocol: one JSON object per connection as the request line, JSON lines as replies (control.py).
Invariant: ``socket_path`` is a pure function of the staging directory (and, for long paths, the
uid and runtime directory), so the daemon and every client agree on it without asking anyone.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptfs.errors import UserError

SOCKET_NAME = "control.sock"
# The runtime directory that holds the sockets of mounts whose staging path is too long:
# traversable by everyone (the server checks who connects), listable and writable by us only.
RUN_DIR_MODE = 0o711
_SUN_PATH_MAX = 107  # bytes of a unix socket path (sockaddr_un.sun_path, NUL excluded)


def socket_path(staging_root: Path) -> Path:
    """Where the control socket of a mount with this staging directory lives.

    In the staging directory unless that path is too long for a unix socket; then in a
    runtime directory (``/run/ckptfs-<uid>`` as root, mode ``RUN_DIR_MODE``), named by a hash
    of the staging directory."""
    path = staging_root / SOCKET_NAME
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return path
    import hashlib
    import tempfile

    digest = hashlib.sha256(os.fsencode(staging_root.resolve())).hexdigest()[:24]
    # $CKPTFS_RUNTIME_DIR: where /run is not ours to use (containers; tests, which must not
    # change the machine's /run/ckptfs-0 under the mounts of other runs).
    base = Path(os.environ.get("CKPTFS_RUNTIME_DIR") or (
        "/run" if os.geteuid() == 0 else
        os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()))
    run_dir = base / f"ckptfs-{os.geteuid()}"
    _private_dir(run_dir)
    return run_dir / f"{digest}.sock"


def _private_dir(path: Path) -> None:
    """Make ``path`` a directory of ours with mode ``RUN_DIR_MODE``, or refuse it (UserError).

    It may be left from an earlier mount, or made by something else with a wider mode (a
    umask, a tmpfiles rule): a directory we own is ours to tighten. One owned by another user
    or a symlink (which could lead anywhere) is refused: whoever made it could see or replace
    the socket. lstat, so that the check is of the entry itself."""
    try:
        path.mkdir(mode=RUN_DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UserError(f"{path} is a symlink: refusing to put the control socket there")
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path} is not a directory: cannot put the control socket there")
    if st.st_uid != os.geteuid():
        raise UserError(f"{path} is owned by uid {st.st_uid}, not by this user "
                        f"({os.geteuid()}): refusing to put the control socket there")
    if stat.S_IMODE(st.st_mode) != RUN_DIR_MODE:
        # Through an fd opened without following a symlink, and checked to be the directory
        # just lstat'ed: a swap in between cannot redirect the chmod.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino, now.st_uid) != (st.st_dev, st.st_ino, st.st_uid):
                raise UserError(f"{path} changed while it was checked: refusing it")
            os.fchmod(fd, RUN_DIR_MODE)
        finally:
            os.close(fd)


def request(socket_path: Path, payload: dict[str, Any], timeout: float | None = 30.0
            ) -> Iterator[dict[str, Any]]:
    """Send one request and yield each reply line as it arrives."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(socket_path))
        except PermissionError:
            # The socket or a directory on its way is closed to this user (an older daemon
            # made them owner-only; or a parent directory is private).
            raise UserError(f"permission denied connecting to the ckptfs control socket "
                            f"{socket_path}: only root and the mount's owner (or, with "
                            f"access to it, its group) may use it") from None
        try:
            sock.sendall(json.dumps(payload).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at connect (a peer it does not serve): the reason waits to be read
        buffer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield json.loads(line)
