"""The control socket of a live mount: ``<staging>/control.sock`` (owner-only), JSON lines.

Requests are one JSON object per connection, e.g. ``{"op": "status"}`` or
``{"op": "sync", "path": "step_100"}``. Replies are JSON lines: ``sync`` streams progress
objects and ends with ``{"done": true}``; every other request answers with one object.
Errors are ``{"error": "..."}``.

Invariants: the server only reads state and waits; it never changes the filesystem except
through the same core calls the FUSE handlers use. Secrets never appear in a reply.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from ckptfs.fs import Filesystem
from ckptfs.journal import State
from ckptfs.upload import Uploader

log = logging.getLogger(__name__)
SOCKET_NAME = "control.sock"
PROGRESS_INTERVAL = 0.25


class ControlServer:
    def __init__(self, fs: Filesystem, uploader: Uploader, mountpoint: Path, tier_url: str) -> None:
        self.fs = fs
        self.uploader = uploader
        self.mountpoint = mountpoint
        self.tier_url = tier_url
        self.path = fs.staging.root / SOCKET_NAME
        self.started = time.time()

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, stat.S_IRUSR | stat.S_IWUSR)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._handle, [listener])
                task_status.started()
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                request = json.loads(await _read_line(stream))
                op = request.get("op")
                if op == "status":
                    await _send(stream, self.status())
                elif op == "sync":
                    await self._sync(stream, request.get("path"))
                else:
                    await _send(stream, {"error": f"unknown request {op!r}"})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            except ValueError as exc:
                await _send(stream, {"error": f"bad request: {exc}"})

    def _pending_rows(self, prefix: str | None) -> list[tuple[str, int, str]]:
        rows = []
        for row in self.fs.journal.rows_in_states(State.STAGED, State.UPLOADING):
            path = self.fs.journal.path_of(row.ino)
            if path is None:
                continue
            name = os.fsdecode(path)
            if prefix and not (name == prefix or name.startswith(prefix.rstrip("/") + "/")):
                continue
            rows.append((name, row.size, row.state.value))
        return rows

    def status(self) -> dict[str, Any]:
        pending = self._pending_rows(None)
        stats = self.uploader.stats
        now = time.monotonic()
        window = [(t, n) for t, n in stats.recent if now - t < 60]
        rate = sum(n for _, n in window) / 60 if window else 0.0
        pending_bytes = sum(size for _, size, _ in pending)
        incomplete = [
            os.fsdecode(self.fs.journal.path_of(r.ino) or b"?")
            for r in self.fs.journal.rows_in_states(State.OPEN) if r.incomplete
        ]
        st = self.fs.staging.statvfs()
        return {
            "mountpoint": str(self.mountpoint),
            "staging_dir": str(self.fs.staging.root),
            "warm_tier": self.tier_url,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "queue": {
                "files": len(pending),
                "bytes": pending_bytes,
                "uploading": [n for n, _, s in pending if s == "uploading"],
                "work_items": len(self.uploader.outstanding()),
            },
            "uploaded": {"files": stats.uploaded_files, "bytes": stats.uploaded_bytes,
                         "moved": stats.moved, "deleted": stats.deleted},
            "upload_rate_bytes_per_s": round(rate, 1),
            "eta_s": round(pending_bytes / rate, 1) if rate > 0 else None,
            "retries": stats.retries,
            "failed": [{"item": str(w.target or w.key), "error": w.error, "attempts": w.attempts}
                       for w in self.uploader.failed()],
            "incomplete": incomplete,
            "staging": {"free_bytes": st.f_bavail * st.f_frsize,
                        "total_bytes": st.f_blocks * st.f_frsize},
        }

    async def _sync(self, stream: trio.SocketStream, path: str | None) -> None:
        """Stream progress until everything closed so far (under ``path``) is committed."""
        upto = self.uploader.last_seq()
        total = None
        while True:
            pending = self._pending_rows(path)
            remaining = sum(size for _, size, _ in pending)
            if total is None:
                total = remaining
            # Deletions of old copies (after moves and directory renames) are queued as work
            # finishes, with later numbers: wait for them too, so the store is exact.
            outstanding = self.uploader.outstanding(upto) + [
                w for w in self.uploader.outstanding() if self.uploader.is_cleanup(w)
                and w.seq > upto]
            if pending and not self.uploader.outstanding():
                # Staged files with no work item would make sync wait forever: a bug, but
                # not one the user should pay for. Queue them and say so.
                log.error("%d staged files were not queued for upload; queueing them now",
                          len(pending))
                for row in self.fs.journal.rows_in_states(State.STAGED, State.UPLOADING):
                    self.uploader.inode_changed(row.ino)
                upto = self.uploader.last_seq()
                outstanding = self.uploader.outstanding()
            if path is None:
                done = not outstanding and not pending
            else:
                done = not pending
            errors = [w.error for w in outstanding if w.error]
            await _send(stream, {"pending_files": len(pending), "pending_bytes": remaining,
                                 "total_bytes": max(total, remaining), "errors": errors[:3]})
            if done:
                await _send(stream, {"done": True})
                return
            with trio.move_on_after(PROGRESS_INTERVAL):
                await self.uploader.wait_until_done(upto)


async def _read_line(stream: trio.SocketStream, limit: int = 65536) -> str:
    data = b""
    while b"\n" not in data:
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError("request too long")
    return data.split(b"\n", 1)[0].decode()


async def _send(stream: trio.SocketStream, obj: dict[str, Any]) -> None:
    await stream.send_all(json.dumps(obj).encode() + b"\n")


# -- client side (the CLI; blocking) ----------------------------------------------------------


def request(socket_path: Path, payload: dict[str, Any], timeout: float | None = 30.0
            ) -> Iterator[dict[str, Any]]:
    """Send one request and yield each reply line as it arrives."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(socket_path))
        sock.sendall(json.dumps(payload).encode() + b"\n")
        buffer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield json.loads(line)
