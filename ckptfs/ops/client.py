"""Talking to a live mount from the CLI: find it, ask its daemon, wait for it.

Invariant: nothing here can hang forever on a dead or hung daemon: the daemon is found from
the mount table and asked through a thread we can abandon (getxattr) or a socket with a
timeout; only ``sync`` waits without limit, and only when asked to.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptfs.errors import UserError
from ckptfs.fuse.mountinfo import FSTYPE, MountEntry, mounts, normalize
from ckptfs.ops import controlsocket


def daemon_info(mountpoint: Path, timeout: float = 5.0) -> dict[str, Any] | None:
    """What the daemon serving ``mountpoint`` says of itself; None if it does not answer."""
    return _daemon_info(mountpoint, timeout)[0]


def _daemon_info(mountpoint: Path, timeout: float = 5.0
                 ) -> tuple[dict[str, Any] | None, OSError | None]:
    """``daemon_info``, and the error that kept it from answering (if an OSError)."""
    result: list[dict[str, Any]] = []
    errors: list[OSError] = []

    def ask() -> None:
        try:
            raw = os.getxattr(normalize(mountpoint), "user.ckptfs.daemon")
            result.append(json.loads(raw))
        except OSError as exc:
            errors.append(exc)
        except ValueError:
            pass

    # A hung daemon would block getxattr forever: ask from a thread we can abandon.
    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout)
    return (result[0] if result else None), (errors[0] if errors else None)


def ckptfs_mounts() -> list[MountEntry]:
    return [m for m in mounts() if m.fstype == FSTYPE]


def locate(path: Path) -> tuple[MountEntry, str]:
    """The ckptfs mount holding ``path`` and the path relative to its root ('' for the root)."""
    target = normalize(path)
    best: MountEntry | None = None
    for entry in ckptfs_mounts():
        root = entry.mountpoint.rstrip("/") or "/"
        inside = target == root or target.startswith(root.rstrip("/") + "/")
        if inside and (best is None or len(root) > len(best.mountpoint)):
            best = entry
    if best is None:
        raise UserError(f"{path} is not on a ckptfs mount")
    rel = os.path.relpath(target, best.mountpoint)
    return best, "" if rel == "." else rel


def control_socket(mountpoint: str | Path) -> Path:
    """The control socket of the daemon serving ``mountpoint``; UserError (exit code 1) if
    that daemon is gone (a stale mount) or does not answer."""
    info, error = _daemon_info(Path(mountpoint))
    if isinstance(error, PermissionError):
        # FUSE shuts out every user but the one that mounted unless it has allow_other.
        raise UserError(f"permission denied asking the ckptfs daemon of {mountpoint}: only "
                        "root and the user that mounted it can reach a mount made without "
                        "allow_other")
    if error is not None and error.errno in (errno.ENOTCONN, errno.ECONNABORTED):
        raise UserError(stale_mount(mountpoint), exit_code=1)
    if not info or "control" not in info:
        raise UserError(f"the ckptfs daemon of {mountpoint} does not answer{_whose(mountpoint)}",
                        exit_code=1)
    return Path(str(info["control"]))


def stale_mount(mountpoint: str | Path) -> str:
    """What to say of a mount whose daemon is gone (the kernel answers ENOTCONN)."""
    return (f"{mountpoint} is a stale mount (its ckptfs daemon is gone): run "
            f"'ckptfs umount {mountpoint}', then mount it again (the daemon's log is "
            "daemon.log in its staging directory, or the journal under systemd)")


def _whose(mountpoint: str | Path) -> str:
    """`` (pid 123; its log: /nvme/ckptfs/daemon.log)`` for the daemon process serving
    ``mountpoint``, found by its command line and its staging lock (/proc), or ``""``."""
    target = os.path.abspath(mountpoint)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = [os.fsdecode(a) for a in f.read().split(b"\0")]
            if not ("mount" in argv and "--foreground" in argv and target in argv):
                continue
            staging = None
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                link = os.readlink(fd.path)
                if link.endswith("/lock"):
                    staging = os.path.dirname(link)
        except OSError:
            continue
        log = os.path.join(staging, "daemon.log") if staging else None
        where = f"; its log: {log}" if log and os.path.exists(log) else \
            "; its log: the journal, or its log_file"
        return f" (pid {entry.name}{where})"
    return ""


def _replies(mountpoint: str | Path, payload: dict[str, Any], timeout: float | None = 30.0
             ) -> Iterator[dict[str, Any]]:
    """``controlsocket.request`` to the daemon of ``mountpoint``; a daemon that is gone (or a
    connection it drops) is a UserError. A TimeoutError is left to the caller."""
    sock = control_socket(mountpoint)
    try:
        yield from controlsocket.request(sock, payload, timeout=timeout)
    except (ConnectionError, FileNotFoundError) as exc:
        raise UserError(f"the ckptfs daemon of {mountpoint} does not answer on {sock}: "
                        f"{exc.strerror or exc}") from None


def status(mountpoint: str | Path) -> dict[str, Any]:
    for reply in _replies(mountpoint, {"op": "status"}):
        if "error" in reply:
            raise UserError(str(reply["error"]))
        return reply
    raise UserError(f"the ckptfs daemon of {mountpoint} gave no status")


def _follow(
    mountpoint: str | Path, payload: dict[str, Any], timeout: float | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
) -> dict[str, Any] | None:
    """Send a streaming request and follow its progress replies to ``{"done": true}``;
    returns the last progress reply ({} if none), or None when ``timeout`` ran out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last: dict[str, Any] = {}
    try:
        for reply in _replies(mountpoint, payload,
                              timeout=None if timeout is None else timeout + 5):
            if "error" in reply:
                raise UserError(str(reply["error"]))
            if reply.get("done"):
                return last
            last = reply
            if on_progress:
                on_progress(reply)
            if deadline is not None and time.monotonic() > deadline:
                return None
    except TimeoutError:
        return None
    raise UserError(f"the ckptfs daemon of {mountpoint} stopped answering")


def sync(
    mountpoint: str | Path, rel: str = "", timeout: float | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> bool:
    """Wait until everything closed so far (under ``rel``) is committed; False on timeout."""
    payload: dict[str, Any] = {"op": "sync"}
    if rel:
        payload["path"] = rel
    return _follow(mountpoint, payload, timeout, on_progress) is not None


def nodes(mountpoint: str | Path, forget: str | None = None) -> dict[str, Any]:
    """The nodes registered in the mount's store (after forgetting ``forget``)."""
    payload: dict[str, Any] = {"op": "nodes"}
    if forget:
        payload["forget"] = forget
    for reply in controlsocket.request(control_socket(mountpoint), payload):
        if "error" in reply:
            raise UserError(str(reply["error"]))
        return reply
    raise UserError(f"the ckptfs daemon of {mountpoint} gave no answer")


def evict(mountpoint: str | Path, rel: str) -> dict[str, Any]:
    """Drop local copies of committed files under ``rel``; what the daemon did."""
    for reply in _replies(mountpoint, {"op": "evict", "path": rel}):
        if "error" in reply:
            raise UserError(str(reply["error"]))
        return reply
    raise UserError(f"the ckptfs daemon of {mountpoint} gave no answer")


def restore(
    mountpoint: str | Path, rel: str, *, days: int, local: bool, poll_interval: float,
    timeout: float | None, on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """Restore archived files under ``rel``; the last progress, or None on timeout."""
    payload = {"op": "restore", "path": rel, "days": days, "local": local,
               "poll_interval": poll_interval}
    return _follow(mountpoint, payload, timeout, on_progress)
