"""The control socket of a live mount: ``<staging>/control.sock``, JSON lines.

Requests are one JSON object per connection, e.g. ``{"op": "status"}`` or
``{"op": "sync", "path": "step_100"}``. Replies are JSON lines: ``sync`` streams progress
objects and ends with ``{"done": true}``; every other request answers with one object.
Errors are ``{"error": "..."}``.

Who may ask what: the socket is 0666 (and the staging directory holding it 0711, so that it can
be reached but not listed), and the server decides per connection from the peer's credentials
(``SO_PEERCRED``: pid, uid, gid, taken by the kernel at connect, so they cannot be forged):
- root and the mount's owner (the uid the daemon runs as, the one that mounted) may run every
  request;
- members of the group of the mount's root directory (their gid, or a supplementary group from
  ``/proc/<pid>/status``) may run the read-only ones (``status``, ``ls-tiers``, ``retention``
  without ``apply``) and ``sync``, which only waits;
- anyone else is refused with an error naming why.

Invariants: the server only reads state and waits; it never changes the filesystem except
through the same core calls the FUSE handlers use. Secrets never appear in a reply. No request,
however malformed, and no peer, however slow or numerous, can stop the server: a peer that may
not use the socket at all is refused at connect, before anything is read; a group member holds
at most ``MEMBER_CONNECTIONS`` connections at once (root and the owner are not limited); errors
are answered, and a request line must arrive within ``REQUEST_TIMEOUT``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from ckptfs.config import Config
from ckptfs.engine.fs import Filesystem
from ckptfs.engine.upload import Uploader, Work
from ckptfs.errors import CkptfsError
from ckptfs.fuse.passthrough import PassthroughFiles
from ckptfs.lifecycle.retention import Retention, upload_progress
from ckptfs.ops.controlsocket import socket_path
from ckptfs.ops.loopwatch import LoopWatch
from ckptfs.state.journal import ROOT_INODE, State

log = logging.getLogger(__name__)
SOCKET_MODE = 0o666
# Requests a member of the mount root's group may make: they only read state, or wait.
READ_ONLY_OPS = frozenset({"status", "ls-tiers", "sync"})
# Files open for writing that ``status`` names (the count is always given).
OPEN_LISTED = 20
FAILED_LISTED = 20  # status lists this many failing items (oldest first) and counts the rest
REQUEST_TIMEOUT = 2.0  # seconds to send the request line (the CLI sends it at connect)
# Connections a group member's uid may hold at once (``sync`` waits, so they last): a local
# user must not be able to take every descriptor of the daemon.
MEMBER_CONNECTIONS = 8
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


PROGRESS_INTERVAL = 0.25
RATE_WINDOW = 60.0  # seconds over which upload and fetch rates are averaged


class ControlServer:
    retention: Retention | None = None  # set by mount.py: serves ls-tiers and retention
    def __init__(self, fs: Filesystem, uploader: Uploader, mountpoint: Path, tier_url: str,
                 config: Config | None = None) -> None:
        self.fs = fs
        self.uploader = uploader
        self.mountpoint = mountpoint
        self.tier_url = tier_url
        self.config = config
        # PassthroughFiles of the mount (set once the FUSE adapter exists): status shows it.
        self.passthrough: PassthroughFiles | None = None
        # The mount's loop stall and garbage-collection figures (mount.py runs it).
        self.loop_watch = LoopWatch()
        self.path = socket_path(fs.staging.root)
        self.started = time.time()
        # (monotonic time, bytes fetched so far), sampled every second, for the fetch rate.
        self._fetch_samples: deque[tuple[float, int]] = deque(maxlen=int(RATE_WINDOW) + 1)
        self._connections: dict[int, int] = {}  # uid -> connections open

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
        # Connecting needs write permission on the socket: everyone gets it, and _handle
        # decides from the peer's credentials who may ask what.
        os.chmod(self.path, SOCKET_MODE)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._handle, [listener])
                nursery.start_soon(self._sample_rates)
                task_status.started()
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _outsider(self, peer: tuple[int, int, int]) -> str | None:
        """Why the peer may not use the socket at all (neither root, the owner nor a member
        of the mount root's group); None if it may make some request."""
        pid, uid, gid = peer
        owner = os.geteuid()
        if uid in (0, owner):
            return None
        group = self.fs.getattr(ROOT_INODE).gid
        if gid == group or group in _supplementary_groups(pid, uid):
            return None
        return (f"permission denied: uid {uid} may not use the control socket of "
                f"{self.mountpoint}: only root, its owner (uid {owner}) and members of its "
                f"group (gid {group}) may")

    def _refusal(self, peer: tuple[int, int, int], request: dict[str, Any]) -> str | None:
        """Why the peer ``(pid, uid, gid)`` may not make ``request``; None if it may."""
        pid, uid, gid = peer
        owner = os.geteuid()
        op = request.get("op")
        if uid in (0, owner):
            return None
        group = self.fs.getattr(ROOT_INODE).gid
        member = gid == group or group in _supplementary_groups(pid, uid)
        read_only = op in READ_ONLY_OPS or (op == "retention" and not request.get("apply"))
        if member and read_only:
            return None
        what = f"'{op}'" if isinstance(op, str) else "this request"
        if member:
            return (f"permission denied: uid {uid} may not run {what} on "
                    f"{self.mountpoint}: members of its group (gid {group}) may only run "
                    f"status, ls-tiers, retention --plan and sync; root and its owner "
                    f"(uid {owner}) may run everything")
        return (f"permission denied: uid {uid} may not run {what} on {self.mountpoint}: "
                f"only root, its owner (uid {owner}) and members of its group (gid {group}) "
                f"may use its control socket")

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                peer = _peer_credentials(stream)
            except OSError:
                return  # gone already
            uid = peer[1]
            outsider = self._outsider(peer)
            if outsider is None and uid not in (0, os.geteuid()) \
                    and self._connections.get(uid, 0) >= MEMBER_CONNECTIONS:
                outsider = (f"busy: uid {uid} has {MEMBER_CONNECTIONS} requests open on "
                            f"{self.mountpoint} already")
            if outsider is not None:
                log.warning("control socket: %s", outsider)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await _send(stream, {"error": outsider})
                return
            self._connections[uid] = self._connections.get(uid, 0) + 1
            try:
                await self._answer(stream, peer)
            finally:
                self._connections[uid] -= 1
                if not self._connections[uid]:
                    del self._connections[uid]

    async def _answer(self, stream: trio.SocketStream, peer: tuple[int, int, int]) -> None:
        try:
            line = ""
            with trio.move_on_after(REQUEST_TIMEOUT):
                line = await _read_line(stream)
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")  # noqa: TRY004
            refusal = self._refusal(peer, request)
            if refusal is not None:
                log.warning("control socket: %s", refusal)
                await _send(stream, {"error": refusal})
                return
            op = request.get("op")
            if op == "status":
                await _send(stream, self.status())
            elif op == "sync":
                await self._sync(stream, request.get("path"))
            elif op == "evict":
                await _send(stream, await self._evict(str(request.get("path") or "")))
            elif op in ("ls-tiers", "retention") and self.retention is not None:
                await _send(stream, await self._retention(bool(request.get("apply"))))
            elif op == "nodes":
                await _send(stream, await self._nodes(request.get("forget")))
            elif op == "restore":
                await self._restore(stream, str(request.get("path") or ""),
                                    int(request.get("days") or 1),
                                    bool(request.get("local")),
                                    float(request.get("poll_interval") or 5.0))
            else:
                await _send(stream, {"error": f"unknown request {op!r}"})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except (ValueError, TypeError) as exc:  # int([]) is a TypeError
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await _send(stream, {"error": f"bad request: {exc}"})
        except Exception as exc:
            log.exception("control socket: request failed")
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await _send(stream, {"error": f"request failed: {exc}"})

    async def _nodes(self, forget: object) -> dict[str, Any]:
        """The nodes registered in the store (``ckptfs nodes``), after forgetting one."""
        coordinator = self.uploader.coordinator
        if coordinator is None:
            return {"error": "this mount does not coordinate with other nodes"}
        try:
            if forget:
                await coordinator.forget(str(forget))
                if forget == coordinator.node:
                    log.warning("hold ended on request: this node acknowledges barriers again, "
                                "without what it lost")
                else:
                    log.warning("node %s forgotten on request: markers no longer wait for it",
                                forget)
            return {"node": coordinator.node, "nodes": await coordinator.describe(),
                    "held_markers": self.uploader.held_markers()}
        except ValueError as exc:
            return {"error": str(exc)}
        except CkptfsError as exc:
            return {"error": f"the store did not answer: {exc}"}

    async def _retention(self, apply: bool) -> dict[str, Any]:
        """``ls-tiers`` and ``retention --plan`` (the report) or ``--apply`` (run, then it)."""
        assert self.retention is not None
        try:
            done = (await self.retention.run_once()).as_dict() if apply else {}
            return {**done, **await self.retention.report()}
        except CkptfsError as exc:
            return {"error": f"retention: {exc}"}

    async def _evict(self, path: str) -> dict[str, Any]:
        try:
            row = await self.fs.resolve(path)
            evicted, freed, kept = await self.fs.evict_tree(row.ino)
        except CkptfsError as exc:
            return {"error": f"{path or '/'}: {exc}"}
        return {"evicted_files": evicted, "freed_bytes": freed, "kept": kept[:20],
                "kept_count": len(kept)}

    async def _restore(self, stream: trio.SocketStream, path: str, days: int, local: bool,
                       poll_interval: float) -> None:
        from ckptfs.lifecycle.restore import restore

        async def report(progress: dict[str, Any]) -> None:
            await _send(stream, progress)

        try:
            row = await self.fs.resolve(path)
            coordinator = self.uploader.coordinator
            await restore(self.fs, row, days=days, local=local, report=report,
                          poll_interval=poll_interval,
                          node=coordinator.node if coordinator is not None else None)
        except CkptfsError as exc:
            await _send(stream, {"error": f"{path or '/'}: {exc}"})
            return
        await _send(stream, {"done": True})

    async def _sample_rates(self) -> None:
        while True:
            self._fetch_samples.append((time.monotonic(), self.fetched_bytes()))
            await trio.sleep(1)

    def fetched_bytes(self) -> int:
        return self.fs.fetcher.stats.fetched_bytes if self.fs.fetcher else 0

    def fetch_failures(self) -> int:
        """Blocks whose bytes did not match their checksum (each bad read counts)."""
        return self.fs.fetcher.stats.integrity_failures if self.fs.fetcher else 0

    def read_errors(self) -> list[str]:
        """Recent read-path errors (corrupt or deleted objects) and refused store names."""
        out = [message for _, message in self.fs.fetcher.stats.errors] if self.fs.fetcher \
            else []
        if self.fs.lister is not None:
            out += [f"refused store entry {key!r}: {why}" for key, why in self.fs.lister.refused]
        return out[-20:]

    def fetch_rate(self) -> float:
        if len(self._fetch_samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._fetch_samples[0], self._fetch_samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def tiers(self) -> list[dict[str, Any]]:
        """Name, URL and endpoint of each tier; never credentials."""
        if self.config is None:
            return [{"name": "warm", "url": self.tier_url}]
        out: list[dict[str, Any]] = [{"name": self.config.tier[0].name,
                                      "url": self.fs.staging.root.as_uri()}]
        for t in self.config.tier[1:]:
            entry: dict[str, Any] = {"name": t.name, "url": t.url}
            if t.endpoint_url:
                entry["endpoint_url"] = _without_userinfo(t.endpoint_url)
            out.append(entry)
        return out

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

    def _pending_totals(self, prefix: str | None) -> tuple[int, int]:
        """Files not uploaded yet (under ``prefix``) and their bytes. The whole mount's is
        an indexed count; a prefix's needs each staged file's path."""
        if not prefix:
            return self.fs.journal.linked_totals(State.STAGED, State.UPLOADING)
        rows = self._pending_rows(prefix)
        return len(rows), sum(size for _, size, _ in rows)

    def status(self) -> dict[str, Any]:
        pending_files, pending_bytes = self._pending_totals(None)
        uploading = [os.fsdecode(p) for p in (
            self.fs.journal.path_of(r.ino)
            for r in self.fs.journal.rows_in_states(State.UPLOADING)) if p is not None]
        stats = self.uploader.stats
        now = time.monotonic()
        window = [(t, n) for t, n in stats.recent if now - t < RATE_WINDOW]
        rate = sum(n for _, n in window) / RATE_WINDOW if window else 0.0
        open_rows = self.fs.journal.rows_in_states(State.OPEN)
        incomplete = [os.fsdecode(self.fs.journal.path_of(r.ino) or b"?")
                      for r in open_rows if r.incomplete]
        open_files = [os.fsdecode(self.fs.journal.path_of(r.ino) or b"?")
                      for r in open_rows if not r.incomplete]
        st = self.fs.staging.statvfs()
        # During an outage every queued item may be failing: list the oldest, count them all.
        failed = sorted(self.uploader.failed(), key=lambda w: w.seq)
        outage = self.uploader.outage()
        # While the store fails, the rate of the last minute says nothing of when the queue
        # will be done: no ETA (nor while items fail), but since when it is unavailable.
        unavailable = self._unavailable_since(outage)
        return {
            "mountpoint": str(self.mountpoint),
            "staging_dir": str(self.fs.staging.root),
            "warm_tier": self.tier_url,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "queue": {
                "files": pending_files,
                "bytes": pending_bytes,
                "uploading": uploading,
                "work_items": self.uploader.count(),
            },
            "uploaded": {"files": stats.uploaded_files, "bytes": stats.uploaded_bytes,
                         "moved": stats.moved, "deleted": stats.deleted},
            "upload_rate_bytes_per_s": round(rate, 1),
            "eta_s": round(pending_bytes / rate, 1) if rate > 0 and pending_bytes
            and unavailable is None and not failed else None,
            "store_unavailable_since": unavailable,
            "retries": stats.retries,
            "failures": stats.failures,
            "fetch": {"bytes": self.fetched_bytes(),
                      "failures": self.fetch_failures(),
                      "errors": self.read_errors(),
                      "rate_bytes_per_s": round(self.fetch_rate(), 1)},
            "write_stall_s": round(self.stall_seconds(), 3),
            "passthrough": (self.passthrough.status() if self.passthrough is not None
                            else {"active": False, "reason": "not mounted yet"}),
            "tiers": self.tiers(),
            "loop": self.loop_watch.status(),
            "options": {} if self.config is None else {
                "upload_concurrency": self.config.upload_concurrency,
                "fsync": self.config.fsync, "unlink": self.config.unlink,
                "allow_other": self.config.allow_other, "suid": self.config.suid,
                "metrics_port": self.config.metrics_port,
            },
            "store_outage": outage,
            "upload_yield": self.uploader.gate.status(),
            "failed": [{"item": self._describe(w.key), "error": w.error,
                        "attempts": w.attempts, "retry_in_s": self._retry_in(w, outage)}
                       for w in failed[:FAILED_LISTED]],
            "failed_count": len(failed),
            "incomplete": incomplete,
            "open_for_writing": open_files[:OPEN_LISTED],
            "open_for_writing_count": len(open_files),
            "node": self._node(),
            "staging": {"free_bytes": st.f_bavail * st.f_frsize,
                        "total_bytes": st.f_blocks * st.f_frsize,
                        "used_bytes": self.fs.space.used,
                        "max_bytes": self.fs.space.max_bytes},
        }

    def _unavailable_since(self, outage: dict[str, float] | None) -> float | None:
        """Since when (wall time) the store is unavailable: taken as down by the uploader
        (``OUTAGE_AFTER`` failures in a row), or refusing this node's registration while a
        request waits for it; None otherwise."""
        if outage is not None:
            return round(time.time() - outage["down_for_s"], 1)
        coordinator = self.uploader.coordinator
        wait = coordinator.registration_wait() if coordinator is not None else None
        if wait is not None and wait.get("error"):
            return round(float(wait["since"]), 1)
        return None

    def _retry_in(self, work: Work, outage: dict[str, float] | None) -> float | None:
        """Seconds until ``work`` is tried again; None while the store is taken as down: the
        queue then waits for one probe to succeed (upload.py ``OUTAGE_AFTER``), whatever
        the item's own backoff says."""
        if outage is not None:
            return None
        return round(max(0.0, work.not_before - trio.current_time()), 1)

    def stall_seconds(self) -> float:
        """Seconds writers waited since the mount, summed over the requests: for staging
        space, and for this node's registration in the store (its first change waits for
        it, up to ``register_timeout``)."""
        coordinator = self.uploader.coordinator
        return self.fs.stall_seconds + (
            coordinator.registration_waited_s() if coordinator is not None else 0.0)

    def _describe(self, key: tuple[str, int]) -> str:
        """A work item as an operator reads it: the file's path, or what a deletion or a
        directory rename's sweep is about (never the internal key)."""
        kind, ident = key
        if kind == "ino":
            path = self.fs.journal.path_of(ident)
            return os.fsdecode(path) if path else f"inode {ident} (unlinked since)"
        if kind == "tomb":
            return f"deletion of {self.fs.journal.tombstone_key(ident) or '?'} from the store"
        if kind == "sweep":
            sweep = self.fs.journal.sweep(ident)
            return (f"moving {sweep[0]} to {sweep[1]} in the store" if sweep
                    else f"directory move {ident}")
        return f"{kind} {ident}"

    def _held(self) -> list[str]:
        """Why markers are not uploaded yet, for ``sync``'s progress line."""
        coordinator = self.uploader.coordinator
        held = self.uploader.held_markers()
        if coordinator is None or not held:
            return []
        if not coordinator.waiting_for:
            return [f"{held[0]} waits for its barrier to be posted"]
        nodes = ", ".join(coordinator.waiting_for)
        return [f"{held[0]} waits for node {nodes} (see 'ckptfs status' and 'ckptfs nodes')"]

    def _node(self) -> dict[str, Any] | None:
        coordinator = self.uploader.coordinator
        if coordinator is None:
            return None
        return {**coordinator.status(), "held_markers": self.uploader.held_markers()}

    async def _sync(self, stream: trio.SocketStream, path: str | None) -> None:
        """Stream progress until everything closed so far (under ``path``) is committed."""
        # Someone waits for the store now: failing items (and a store-down probe) are tried
        # within a second, not after their backoff (up to 90 s).
        self.uploader.hurry(for_space=False)
        if self.passthrough is not None:
            self.passthrough.poll()  # a file unmapped just now is staged before we look
        upto = self.uploader.last_seq()
        total = None
        while True:
            pending, remaining = self._pending_totals(path)
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
                          pending)
                for row in self.fs.journal.rows_in_states(State.STAGED, State.UPLOADING):
                    self.uploader.inode_changed(row.ino)
                upto = self.uploader.last_seq()
                outstanding = self.uploader.outstanding()
            if path is None:
                done = not outstanding and not pending
            else:
                done = not pending
            # Failures are retried ("errors"); a marker held for other nodes is a normal wait.
            errors = [w.error for w in outstanding if w.error]
            # Bytes of the uploads in flight already sent: the progress moves within a file
            # (as far as the tier reports it: a file tier per chunk, S3 per part).
            sent = sum(done for key, done in upload_progress(self.uploader).items()
                       if not path or key == path or key.startswith(path.rstrip("/") + "/"))
            left = max(0, remaining - int(sent))
            await _send(stream, {"pending_files": pending, "pending_bytes": left,
                                 "total_bytes": max(total, remaining), "errors": errors[:3],
                                 "waiting": self._held()[:3]})
            if done:
                await _send(stream, {"done": True})
                return
            with trio.move_on_after(PROGRESS_INTERVAL):
                await self.uploader.wait_until_done(upto)


def _peer_credentials(stream: trio.SocketStream) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process that connected (the kernel's, as of connect)."""
    raw = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def _supplementary_groups(pid: int, uid: int) -> frozenset[int]:
    """The supplementary groups of process ``pid`` (``Groups:`` in /proc/<pid>/status); none
    if it is gone or its effective uid is no longer ``uid`` (the pid was reused by another
    process: its groups say nothing of the peer). The peer is waiting for the reply, so it is
    normally alive."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        uids = fields["Uid"].split()
        if len(uids) < 2 or int(uids[1]) != uid:
            return frozenset()
        return frozenset(int(g) for g in fields.get("Groups", "").split())
    except (OSError, ValueError, KeyError):
        return frozenset()


def _without_userinfo(url: str) -> str:
    """``https://user:pass@host/`` -> ``https://host/``: credentials never leave the daemon."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


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
