"""The run record of a node: did its last run stop cleanly, and on which boot of the machine?
A node that lost its page cache (a power loss, a kernel crash, a reboot with the daemon
killed) may have lost files whose close(2) had returned: it must not acknowledge other nodes'
barriers for them (coordination.py; docs/SEMANTICS.md, "Many nodes, one checkpoint").

Two small files in the staging directory, each written whole (temporary file, fsync,
rename, fsync of the directory):

- ``node-run``: ``{"boot_id", "clean", "pid", "started"}``. Written with ``clean = false``
  when a run starts, rewritten with ``clean = true`` when it stops cleanly (``stop_clean``),
  after the staging filesystem was synced (``syncfs``).
- ``node-hold``: ``{"reason", "since", "previous_boot_id", "boot_id", "incomplete"}``. Written
  at start when the previous run did not stop cleanly AND the machine booted since (its boot
  id changed, or cannot be read). Removed only by ``clear_hold``, which an operator asks for
  (``ckptfs nodes MOUNT --forget ID``, on this node or any other).

Invariants:
- ``clean = true`` is written only after everything this run wrote to the staging
  filesystem (journal, data files) is on disk: a power loss after a clean stop loses nothing,
  so it is no reason to hold.
- The hold is decided, and its file written, before the new ``node-run`` replaces the old
  one: a crash in between starts holding again, never forgets the reason.
- A hold, once written, stays through any number of restarts, clean or not, until cleared.
- A SIGKILL of the daemon without a reboot is not a hold: the journal's commits and the data
  written survive a process crash (the page cache stays), so the journal knows every close.
- Every start after an unclean stop and a reboot holds, whether or not files came back
  incomplete: a rolled-back journal may have lost a file's row altogether, and then nothing
  at all says it existed.
- No record (a new staging directory, or one of an older ckptfs) is not a hold.

A third, ``last-stop.json`` (``STOP_REPORT``), is written by every daemon as it exits: its pid,
node id, the files (and bytes) it left not uploaded and whether it stayed registered, so
that ``ckptfs umount`` can say what stays behind. Nothing decides on it.

Only the composition root (mount.py, tests/cluster.py) starts and stops a run; the
coordinator reads ``hold`` and asks for ``clear_hold``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_FILE = "node-run"
HOLD_FILE = "node-hold"
STOP_REPORT = "last-stop.json"
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """This boot of the machine (Linux: a random id made at every boot), None if unknown."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class Hold:
    """Why this node acknowledges no barrier of another node."""

    reason: str
    since: float
    previous_boot_id: str | None = None
    boot_id: str | None = None
    incomplete: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NodeRun:
    """The record of this run of the node over ``root`` (its staging directory)."""

    def __init__(self, root: Path, boot: str | None) -> None:
        self.root = root
        self.boot = boot
        self.hold: Hold | None = None
        self._started = False

    def start(self, node: str, incomplete: int) -> Hold | None:
        """Record that a run started; returns the hold in force (new, or kept from before).
        ``incomplete``: files that came back incomplete (reported with the hold)."""
        previous = _read_json(self.root / RUN_FILE)
        self.hold = self._read_hold()
        if self.hold is None and page_cache_lost(self.root, self.boot):
            before = (previous or {}).get("boot_id")
            self.hold = Hold(
                reason=(
                    "restarted after an unclean stop and a reboot (power loss or crash: "
                    "the page cache was lost), so files closed before it may be lost "
                    f"({incomplete} came back incomplete); it acknowledges no barrier of "
                    "another node until an operator runs 'ckptfs nodes MOUNT --forget "
                    f"{node}' (markers then go out without what it lost)"),
                since=time.time(), previous_boot_id=before, boot_id=self.boot,
                incomplete=incomplete)
            _write_durable(self.root / HOLD_FILE, self.hold.as_dict())
        if self.hold is not None:
            log.error("node %s holds barriers: %s", node, self.hold.reason)
        _write_durable(self.root / RUN_FILE, {"boot_id": self.boot, "clean": False,
                                              "pid": os.getpid(), "started": time.time()})
        self._started = True
        return self.hold

    def clear_hold(self, why: str) -> None:
        """The operator decided: this node acknowledges barriers again."""
        if self.hold is None:
            return
        try:
            os.unlink(self.root / HOLD_FILE)
        except FileNotFoundError:
            pass
        _sync_dir(self.root)
        log.warning("hold cleared (%s): this node acknowledges barriers again", why)
        self.hold = None

    def stop_clean(self) -> None:
        """The run stopped cleanly: once everything it wrote is on disk, say so. Blocking
        (a sync of the staging filesystem): call it from a thread."""
        if not self._started:
            return
        _sync_filesystem(self.root)
        _write_durable(self.root / RUN_FILE, {"boot_id": self.boot, "clean": True,
                                              "pid": os.getpid(), "stopped": time.time()})
        self._started = False

    def _read_hold(self) -> Hold | None:
        found = _read_json(self.root / HOLD_FILE)
        if found is None:
            return None
        try:
            return Hold(reason=str(found["reason"]), since=float(found["since"]),
                        previous_boot_id=found.get("previous_boot_id"),
                        boot_id=found.get("boot_id"), incomplete=int(found.get("incomplete", 0)))
        except (KeyError, TypeError, ValueError):
            # Unreadable but present: it was written for a reason; keep holding.
            return Hold(reason=f"{HOLD_FILE} is unreadable: holding until cleared", since=0.0)


def page_cache_lost(root: Path, boot: str | None) -> bool:
    """Whether the last run over ``root`` stopped uncleanly and the machine booted since (or
    either cannot be told): what it wrote and did not sync may be gone. Read before this
    run's ``start`` replaces the record (the filesystem core asks at its start, to check
    local copies: fs.py)."""
    previous = _read_json(root / RUN_FILE)
    if previous is None or previous.get("clean"):
        return False
    before = previous.get("boot_id")
    return before is None or boot is None or before != boot


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # torn or garbage: treated as an unclean record
    return found if isinstance(found, dict) else {}


def _write_durable(path: Path, value: dict[str, Any]) -> None:
    """Write ``path`` whole (0600, like every file in the staging directory) and durably."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(value).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_filesystem(path: Path) -> None:
    """syncfs(2) of the filesystem holding ``path`` (sync(2) where syncfs is missing)."""
    syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def write_stop_report(root: Path, report: dict[str, Any]) -> None:
    """Replace the stop report of the staging directory ``root`` (0600: it names the node)."""
    tmp = root / (STOP_REPORT + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(report).encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, root / STOP_REPORT)


def read_stop_report(root: Path, pid: int) -> dict[str, Any] | None:
    """The stop report daemon ``pid`` wrote in ``root``; None if it wrote none (or an older
    run's is there, or it cannot be read)."""
    report = _read_json(root / STOP_REPORT)
    if report is None or report.get("pid") != pid:
        return None
    return report
