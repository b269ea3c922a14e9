"""Commit order across nodes: a commit marker reaches the store only after every file closed
before it, on ANY node mounting the same store prefix, is committed (docs/SEMANTICS.md,
"Many nodes").

The nodes coordinate through the store alone, with small objects under ``.ckptfs/``
(tiers/base.py ``CONTROL_PREFIX``); no server, no clocks compared:

- **Registration, lazily.** A node registers only once it may close a file that another
  node's marker must wait for: before the first request of its run that changes the tree
  (an open for writing, a create, a mkdir, a rename, ...) returns, that request waits for
  ``enlist`` (mount.py ``RegisteringOps``), or at mount when its journal already has work to
  upload or it holds (a restart after a crash, below), or when ``register_at_mount`` is set
  (writes then never wait for the store, and a killed reader holds markers as a writer). Registering creates
  ``.ckptfs/nodes/<node id>`` (create-if-absent) holding a token kept in its staging
  directory: the same token is a restart of the same node; another one is a second staging
  directory claiming the id, refused (``DuplicateNode``), since the two would not wait for
  each other. A node that never changes anything (a reader, ``ls``, a read-only mount) is
  never registered, so it never holds anyone's markers, however it dies. A clean unmount with
  nothing left to upload deletes the registration. A node that was killed stays registered:
  markers wait for it until it comes back (the same staging directory is the same node id)
  and has uploaded what it had, or until an operator removes it (``ckptfs nodes --forget``);
  one that comes back with nothing to upload removes the registration it left.
- **Liveness.** A registered node rewrites its registration every ``HEARTBEAT`` seconds with
  the wall time and what it has left to upload, which ``ckptfs nodes`` and ``status`` show
  ("last seen"), so an operator can tell a dead node from a slow one before forgetting it.
  Nothing decides on these times: a node is waited for as long as it is registered.
- **Barrier.** When node A has a marker ready (everything A closed before it committed, the
  local rule in upload.py), it puts ``.ckptfs/barriers/<A>/<n>`` and then rewrites
  ``.ckptfs/epoch``. Its markers queued so far are released once every other registered node
  has acknowledged the barrier; then A deletes the barrier and its acks.
- **Ack.** Every node reads ``.ckptfs/epoch`` each poll. When its tag changes, the node lists
  the barriers; for each one new to it, it notes the number of the last item its uploader has
  queued, waits until every data item (not markers, not deletions) numbered so far is done,
  and puts ``.ckptfs/acks/<A>/<n>/<itself>``.

Why this is enough: a file that node B closed before A's marker was closed is numbered in B's
queue when its close(2) returns (upload.py ``closed``, at FLUSH, before the kernel's RELEASE)
and keeps that number if it is queued again. A posts the barrier after the marker was closed,
and B notes its queue only after it saw the barrier, so the number it notes covers the file;
B acks only once the file is committed. And A waits for B: B's registration PUT completed
before B's open for writing returned (``enlist``), that open precedes B's close, B's close
precedes A's marker close, and A lists the nodes after the marker close, so A's listing (the
store is strongly consistent) shows B. A node that registers after A's listing closed
nothing before the marker: its first change came after its registration.

Interleavings (tests/test_multinode.py):
- B's registration and A's barrier at the same time: if A's listing misses B, B's first
  change returned after that listing, so after A's marker close: not waited for, rightly. If
  the listing shows B, A waits for B's ack, which B gives once what it queued by the time it
  saw the barrier is committed (a barrier seen before B registered counts too: B acks it
  once registered).
- B killed after its registration PUT, before the open returned: B stays registered with
  nothing to upload; A's markers wait until B restarts (it then finds its own registration,
  with nothing to upload, and removes it) or is forgotten. ``ckptfs nodes`` shows it
  registered, last seen at its last heartbeat, with no files pending.
- B killed after its close: its journal has the file; the restart registers at mount (before
  serving), uploads it and acks.
- The store down during B's first change: the request waits for the registration with the
  usual backoff for at most ``register_timeout`` (the setting of that name), then fails with
  EIO; nothing was changed, nothing can be missed. ``status``, the metrics and the log show
  the wait meanwhile (``registration_wait``): the job is stalled, as by a wait for space.
**Hold.** A node that restarts after an unclean stop AND a reboot (noderun.py: its page cache
was lost, so files whose close(2) had returned may be gone, their journal rows rolled back or
their data short) cannot know what it closed before a barrier: it acknowledges NO barrier of
another node while it holds, stays registered (a clean unmount does not deregister it) and
says why in its registration, ``status`` and ``ckptfs nodes``. The hold ends only by an
operator's decision: ``ckptfs nodes --forget ID`` on another node (this node then finds its
registration gone, clears the hold and registers again; markers held for it went out without
what it lost), or ``--forget`` of its own id on this node (it clears the hold and acks).
When the hold ends, the barriers held are noted again with the queue as it is then: shards
the operator had rewritten on this node before deciding are waited for like any file closed
before the barrier.

Markers do not wait for other nodes' markers (an ack does not wait for the node's own
markers): two nodes each holding a marker would otherwise wait for each other forever.

**Full barriers** (``FULL``) are a sweep's (upload.py ``_sweep``: a directory renamed or
removed, whose keys every node's files closed in it must reach first). Their acks wait for
the acking node's markers too (one node's own marker in another's renamed tmp dir), but not
for markers queued after a sweep of the acking node's own (they wait for that sweep, which
waits for this node's ack in turn), nor for moves that wait for a sweep (nor for files that
wait for such a move to leave their key, upload.py ``_behind_sweep``): a marker waits only
for plain barriers, whose acks wait only for files, so no ack ever waits for itself. So the
two kinds are posted apart, each by its own task: a plain barrier goes out while a full one
waits (two nodes each with a sweep waiting and a marker held would otherwise wait for each
other: each full ack waits for the other node's marker, held behind that node's full
barrier). A full barrier, acked, releases the markers numbered below it too.

Store requests per node: one GET of the epoch per poll (``node_poll_interval`` while there is
work or a recent barrier, ``node_idle_poll_interval`` when idle); per barrier, one LIST of the
barriers, one GET of its own registration (a forgotten live node registers again) and one PUT
of the ack on every other node, and on the poster one PUT of the barrier,
one of the epoch, a LIST of nodes and of acks per poll until done, and the clean-up DELETEs.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from ckptfs.cluster.noderun import Hold, NodeRun
from ckptfs.errors import StoreUnavailable
from ckptfs.store.tiers.base import (
    CONTROL_PREFIX,
    ObjectMissing,
    PreconditionFailed,
    Tier,
    TierError,
)

log = logging.getLogger(__name__)

NODES = CONTROL_PREFIX + "nodes/"
# A barrier whose name ends so is a sweep's: its acks wait for the acking node's commit
# markers too (upload.py ``data_outstanding``).
FULL = "-full"
BARRIERS = CONTROL_PREFIX + "barriers/"
ACKS = CONTROL_PREFIX + "acks/"
EPOCH = CONTROL_PREFIX + "epoch"
NODE_ID_FILE = "node-id"
NODE_TOKEN_FILE = "node-token"
RECENT = 60.0  # seconds after a barrier or upload during which a node polls at the fast rate
BACKOFF_MAX = 30.0
HEARTBEAT = 60.0  # seconds between rewrites of a registered node's registration (liveness)
SLOW_ACK = 10.0  # seconds a barrier waits for a node before its registration is read (status)


class Queue(Protocol):
    """What the coordinator needs from the uploader (upload.py)."""

    def current_seq(self) -> int: ...
    def data_outstanding(self, upto_seq: int, *, markers: bool = False) -> bool: ...
    def released(self) -> None: ...
    def pending(self) -> tuple[int, int]: ...


class DuplicateNode(Exception):
    """Another staging directory is registered under this node id."""


def _kept(path: Path, make: Callable[[], str]) -> str:
    """The value kept in ``path`` in the staging directory, made and written (0600, like
    every file there: others may traverse it, staging.py) the first time."""
    try:
        found = path.read_text().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    made = make()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (made + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return made


def node_token(staging_root: Path) -> str:
    """A random token made once per staging directory: two staging directories that claim
    the same node id (a shared ``node_id`` setting, a cloned disk) are told apart by it."""
    return _kept(staging_root / NODE_TOKEN_FILE, lambda: secrets.token_hex(16))


def node_id(staging_root: Path, configured: str | None = None) -> str:
    """This node's id: configured, or made once per staging directory and kept in it, so that a
    restart (which finds the same journal) is the same node."""
    if configured:
        return configured
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return _kept(staging_root / NODE_ID_FILE,
                 lambda: f"{host or 'node'}-{secrets.token_hex(4)}")


@dataclass
class _Seen:
    """A barrier of another node, seen and not acknowledged yet."""

    upto: int  # our last queued item when we first saw it


@dataclass
class CoordinationStats:
    barriers_posted: int = 0
    barriers_acked: int = 0
    requests: dict[str, int] = field(default_factory=dict)


class Coordinator:
    """One per mount; ``run`` lives in the mount's nursery beside the uploader."""

    def __init__(
        self, tier: Tier, node: str, queue: Queue, *, poll: float = 1.0,
        idle_poll: float = 10.0, clock: Callable[[], float] = trio.current_time,
        token: str | None = None, run: NodeRun | None = None,
        register_timeout: float = 300.0, wall: Callable[[], float] = time.time,
    ) -> None:
        self.tier = tier
        self.node = node
        self.token = token or secrets.token_hex(16)
        # Per kind (full or not): the barrier posted and not released yet (name, upto,
        # announced), and the nodes that have not acked it.
        self._posted: dict[bool, tuple[str, int, bool] | None] = {False: None, True: None}
        self._waiting: dict[bool, list[str]] = {False: [], True: []}
        self.queue = queue
        self.poll = poll
        self.idle_poll = max(idle_poll, poll)
        self._clock = clock
        self._released = 0  # markers numbered up to this may go to the store
        self._wanted = 0  # the highest marker number waiting for a barrier
        # The same for sweeps (upload.py ``_sweep``), whose barriers also wait for the other
        # nodes' markers (FULL): a full barrier releases markers too.
        self._released_full = 0
        self._wanted_full = 0
        self._kick = trio.Event()
        self._active = trio.Event()
        self._numbers = itertools.count(int(time.time() * 1000))
        self._last_activity = -math.inf
        self.waiting_for: list[str] = []  # nodes that have not acked our barrier yet
        # What the registrations of the nodes in ``waiting_for`` said (host, last seen, files
        # pending), read again every HEARTBEAT while waited for: for ``status``.
        self.waited_info: dict[str, dict[str, Any]] = {}
        self._waited_read: dict[str, float] = {}
        self.barrier: str | None = None
        self.error: str | None = None
        self.stats = CoordinationStats()
        self.registered = False
        # Whether this node must be registered: it changed the tree in this run, or it had
        # work to upload or a hold at mount. Until then it acks nothing and never registers.
        self.enlisted = False
        self._enlisting: trio.Event | None = None  # set when the running enlist ends
        self.register_timeout = register_timeout
        # Requests waiting in ``enlist`` for the registration (a stall of the job, as a
        # writer's wait for space is: status, metrics, the log): token -> (what, clock time
        # it began, wall time it began); and the seconds the finished waits took in all.
        self._register_waits: dict[int, tuple[str, float, float]] = {}
        self._register_tokens = itertools.count()
        self.register_waited = 0.0
        self._wall = wall
        self._tag: str | None = None  # our registration's tag, as we last wrote it
        self._enlist_error: Exception | None = None
        self._since = wall()
        self._heartbeat_at = -math.inf
        # Spread over 0.8-1.2 HEARTBEAT per node: nodes mounted together do not rewrite their
        # registrations in the same second, forever.
        self._heartbeat_every = HEARTBEAT * random.Random(node).uniform(0.8, 1.2)
        self.run_record = run  # this run's record (noderun.py): the hold, if any
        self.held_barriers: list[str] = []  # barriers seen and not acked because of the hold

    @property
    def hold(self) -> Hold | None:
        return None if self.run_record is None else self.run_record.hold

    # -- the uploader's side ----------------------------------------------------------------

    def is_released(self, seq: int, *, full: bool = False) -> bool:
        return seq <= (self._released_full if full else self._released)

    def want(self, seq: int, *, full: bool = False) -> None:
        """A marker numbered ``seq`` is ready on this node: post a barrier for it. ``full``:
        a sweep, whose barrier also waits for every node's markers closed before it."""
        if full and seq > self._wanted_full:
            self._wanted_full = seq
            self._wake()
        elif not full and seq > self._wanted:
            self._wanted = seq
            self._wake()

    def activity(self) -> None:
        """Something was queued or uploaded: poll at the fast rate for a while."""
        self._last_activity = self._clock()
        self._active.set()
        self._active = trio.Event()

    def _wake(self) -> None:
        self._kick.set()
        self._kick = trio.Event()

    # -- registration -----------------------------------------------------------------------

    def _record(self) -> bytes:
        """What this node's registration says: who it is, and (``ckptfs nodes``) when it was
        last seen alive and what it has left to upload."""
        files, size = self.queue.pending()
        record: dict[str, Any] = {"node": self.node, "token": self.token,
                                  "host": socket.gethostname(), "pid": os.getpid(),
                                  "since": self._since, "seen": self._wall(),
                                  "pending_files": files, "pending_bytes": size}
        if self.hold is not None:
            record["hold"] = self.hold.reason  # other nodes' 'ckptfs nodes' say why
        return json.dumps(record).encode()

    async def register(self) -> None:
        """Register, or register again after a restart of this staging directory (the same
        token). Raises ``DuplicateNode`` if another staging directory holds this id: the two
        would not wait for each other."""
        key = NODES + self.node
        while True:
            body = self._record()
            try:
                self._tag = await self._request("put", self.tier.put_small, key, body,
                                                if_absent=True)
                break
            except PreconditionFailed:
                pass
            try:
                old, tag = await self._request("get", self.tier.get_small, key)
            except ObjectMissing:
                continue  # it left meanwhile
            self._check_token(old)
            try:
                self._tag = await self._request("put", self.tier.put_small, key, body,
                                                if_tag=tag)
                break
            except PreconditionFailed:
                continue
        self.registered = True
        self._heartbeat_at = self._clock()

    def _check_token(self, body: bytes) -> None:
        """Raise ``DuplicateNode`` unless the registration ``body`` is this staging
        directory's."""
        try:
            theirs = json.loads(body)
        except ValueError:
            theirs = {}
        if not isinstance(theirs, dict) or theirs.get("token") != self.token:
            if not isinstance(theirs, dict):
                theirs = {}
            raise DuplicateNode(
                f"node id {self.node!r} is registered by another staging directory (host "
                f"{theirs.get('host', '?')}, pid {theirs.get('pid', '?')}): give each node "
                f"its own node_id, or if that node is gone for good, run 'ckptfs nodes "
                f"--forget {self.node}' on a live node")

    async def check_at_mount(self, enlist: bool) -> None:
        """At mount, before the first request. ``enlist``: this node has work to upload
        (or holds): it registers now. Otherwise it stays unregistered, but a registration
        this staging directory left (a kill after its last upload, or before its first
        close) is removed: nothing here is left to wait for. Another staging directory's
        registration of this id is refused either way (``DuplicateNode``)."""
        if enlist or self.hold is not None:
            await self.register()
            self.enlisted = True
            return
        key = NODES + self.node
        try:
            body, _ = await self._request("get", self.tier.get_small, key)
        except ObjectMissing:
            return
        self._check_token(body)
        log.info("node %s: removing the registration a previous run left (nothing is left "
                 "to upload here)", self.node)
        await self._request("delete", self.tier.delete, key)

    async def enlist(self, what: str = "a change") -> None:
        """Be registered before this node's first change returns (module docstring). Free
        once registered. While the store is down, retries with backoff for at most
        ``register_timeout``, then raises ``StoreUnavailable`` (the request fails with EIO,
        having changed nothing); ``DuplicateNode`` if another staging directory took the id.
        Concurrent callers share one attempt. ``what`` waits (a request: ``mkdir``): status
        and the log say so while it waits (``registration_wait``)."""
        if self.enlisted and self.registered:
            return
        token = next(self._register_tokens)
        self._register_waits[token] = (what, self._clock(), self._wall())
        try:
            await self._enlist()
        finally:
            self.register_waited += self._clock() - self._register_waits.pop(token)[1]

    def registration_wait(self) -> dict[str, Any] | None:
        """The requests waiting for this node's registration now, by kind, since when (wall
        time), the limit and why it is not done yet; None when none waits."""
        if not self._register_waits:
            return None
        kinds: dict[str, int] = {}
        for what, _, _ in self._register_waits.values():
            kinds[what] = kinds.get(what, 0) + 1
        since = min(wall for _, _, wall in self._register_waits.values())
        return {"requests": kinds, "since": since,
                "waiting_s": round(max(0.0, self._wall() - since), 1),
                "limit_s": self.register_timeout, "error": self.error}

    def registration_waited_s(self) -> float:
        """Seconds requests waited for the registration since the mount (waits going on
        included), summed over the requests: a stall of the job, like a wait for space."""
        now = self._clock()
        return self.register_waited + sum(now - began for _, began, _ in
                                          self._register_waits.values())

    async def _enlist(self) -> None:
        while not (self.enlisted and self.registered):
            running = self._enlisting
            if running is not None:
                await running.wait()
                if self._enlist_error is not None:
                    raise self._enlist_error
                continue
            self._enlisting = trio.Event()
            self._enlist_error = None
            try:
                await self._register_patiently()
                self.enlisted = True
                log.info("node %s registered in %s: this run changes files", self.node,
                         self.tier.url)
                self.activity()  # the ack loop polls at the fast rate again
            except (StoreUnavailable, DuplicateNode) as exc:
                self._enlist_error = exc
                raise
            finally:
                self._enlisting.set()
                self._enlisting = None

    async def _register_patiently(self) -> None:
        deadline = self._clock() + self.register_timeout
        failures = 0
        while True:
            try:
                await self.register()
                self.error = None
                return
            except DuplicateNode as exc:
                self.error = str(exc)
                log.error("%s", exc)
                raise
            except (StoreUnavailable, TierError, ObjectMissing, OSError) as exc:
                failures += 1
                self.error = f"cannot register: {type(exc).__name__}: {exc}"
                left = deadline - self._clock()
                if left <= 0:
                    raise StoreUnavailable(
                        f"node {self.node} could not register in {self.tier.url} within "
                        f"{self.register_timeout:.0f}s, so it may not change files: "
                        f"{exc}") from None
                delay = min(BACKOFF_MAX, self.poll * 2 ** min(failures, 10), left)
                log.warning("node %s could not register in %s (retry in %.0fs; %s; they fail "
                            "with EIO after register_timeout, %.0fs): %s", self.node,
                            self.tier.url, delay, self._waiting_text(), self.register_timeout,
                            exc)
                await trio.sleep(delay)

    def _waiting_text(self) -> str:
        """``"2 requests (mkdir, create) wait for it since 12:00:01"``, for the log."""
        wait = self.registration_wait()
        if wait is None:
            return "nothing waits for it"
        n = sum(wait["requests"].values())
        when = time.strftime("%H:%M:%S", time.localtime(wait["since"]))
        kinds = ", ".join(sorted(wait["requests"]))
        return (f"{n} {'request' if n == 1 else 'requests'} ({kinds}) "
                f"{'waits' if n == 1 else 'wait'} for it since {when}")

    async def deregister(self) -> None:
        if self.hold is not None:
            # Leaving would let every marker waiting for it go out: the operator decides.
            log.warning("node %s stays registered: it holds barriers (%s)", self.node,
                        self.hold.reason)
            return
        await self._request("delete", self.tier.delete, NODES + self.node)
        self.registered = False
        self.enlisted = False

    async def describe(self) -> list[dict[str, Any]]:
        """Every registered node with what it registered (``ckptfs nodes``)."""
        out = []
        for name in sorted(await self.nodes()):
            info: dict[str, Any] = {"node": name}
            try:
                body, _ = await self._request("get", self.tier.get_small, NODES + name)
                info.update(json.loads(body))
            except ObjectMissing:
                continue  # it left meanwhile
            except ValueError:
                info["error"] = "unreadable registration"
            info["node"] = name
            info["self"] = name == self.node
            info["waited_for"] = name in self.waiting_for
            seen = info.get("seen")
            if isinstance(seen, (int, float)):
                info["seen_ago_s"] = max(0.0, self._wall() - seen)
            info.pop("token", None)  # it proves the registration is ours: never shown
            out.append(info)
        return out

    async def forget(self, name: str) -> None:
        """Remove another node's registration: markers stop waiting for it. Only for a node
        that is gone for good (its uploads would no longer be waited for); a live node that
        is forgotten registers again when it next sees a barrier."""
        if name == self.node:
            if self.run_record is not None and self.hold is not None:
                # The operator's decision, taken on this node: what it lost is given up.
                self.run_record.clear_hold(f"'ckptfs nodes --forget {name}' on this node")
                self.held_barriers = []
                await self.register()  # the registration no longer says it holds
                self.activity()  # the ack loop polls now, not after an idle sleep
                return
            raise ValueError("a node cannot forget itself (unmount it instead)")
        if name not in await self.nodes():
            raise ValueError(f"no node {name!r} is registered")
        await self._request("delete", self.tier.delete, NODES + name)

    async def _still_registered(self) -> None:
        """A registered node forgotten by another node registers again (and a hold ends)."""
        try:
            await self._request("get", self.tier.get_small, NODES + self.node)
        except ObjectMissing:
            await self._forgotten()

    async def _forgotten(self) -> None:
        log.warning("this node (%s) was forgotten by another node: registering again",
                    self.node)
        if self.run_record is not None and self.hold is not None:
            # Markers held for it went out without what it lost: the hold is over.
            self.run_record.clear_hold("forgotten by another node")
            self.held_barriers = []
        try:
            await self.register()
        except DuplicateNode as exc:
            self.registered = False
            self.error = str(exc)
            log.error("%s", exc)

    async def _heartbeats(self) -> None:
        """Its own task, on its own period: not in step with the polls, which a save wakes
        on every node at once."""
        while True:
            due = self._heartbeat_at + self._heartbeat_every
            if not (self.enlisted and self.registered):
                await trio.sleep(self._heartbeat_every)
            elif self._clock() < due:
                await trio.sleep(due - self._clock())
            else:
                await self._heartbeat()

    async def _heartbeat(self) -> None:
        """Rewrite the registration (last seen, files pending), if it is still ours."""
        self._heartbeat_at = self._clock()
        try:
            self._tag = await self._request("put", self.tier.put_small, NODES + self.node,
                                            self._record(), if_tag=self._tag)
        except (PreconditionFailed, ObjectMissing):
            try:
                body, _ = await self._request("get", self.tier.get_small, NODES + self.node)
            except ObjectMissing:
                await self._forgotten()
                return
            try:
                self._check_token(body)
            except DuplicateNode as exc:
                self.registered = False
                self.error = str(exc)
                log.error("%s", exc)
                return
            await self.register()  # ours, rewritten by another run of ours: take it back

    async def nodes(self) -> set[str]:
        """The registered nodes."""
        return {k for k in await self._names(NODES) if "/" not in k}

    async def _names(self, prefix: str) -> list[str]:
        """The objects under ``prefix``, relative to it (a file tier also lists directories:
        not objects here)."""
        infos = await self._request("list", self.tier.list, prefix)
        return [i.key[len(prefix):] for i in infos if not i.key.endswith("/")]

    # -- the task ---------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._drop_own_barriers()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._retrying, functools.partial(self._post_barriers, False))
            nursery.start_soon(self._retrying, functools.partial(self._post_barriers, True))
            nursery.start_soon(self._retrying, self._ack_barriers)
            nursery.start_soon(self._retrying, self._heartbeats)
            task_status.started()

    async def _retrying(self, loop: Callable[[], Any]) -> None:
        failures = 0
        last_failure = -math.inf
        while True:
            try:
                await loop()
            except (StoreUnavailable, TierError, ObjectMissing, OSError) as exc:
                if self._clock() - last_failure > 2 * BACKOFF_MAX:
                    failures = 0  # an outage long over: start the backoff again
                last_failure = self._clock()
                failures += 1
                self.error = f"{type(exc).__name__}: {exc}"
                delay = min(BACKOFF_MAX, self.poll * 2 ** min(failures, 10))
                log.warning("node coordination through %s failed (retry in %.0fs): %s",
                            self.tier.url, delay, exc)
                await trio.sleep(delay)

    async def _drop_own_barriers(self) -> None:
        """Barriers we posted before a crash: the markers they were for are requeued and post
        new ones."""
        try:
            numbers = await self._names(BARRIERS + self.node + "/")
        except (StoreUnavailable, TierError) as exc:
            log.warning("could not list old barriers of %s: %s", self.node, exc)
            return
        for number in numbers:
            await self._cleanup(f"{self.node}/{number}")

    async def _post_barriers(self, full: bool) -> None:
        """Post a barrier of this kind (``full``: for sweeps) for what is wanted, wait for
        every node's ack, release. A store error anywhere retries from where it was
        (``_posted``): a barrier once put is waited for, not replaced by a new one that would
        orphan it."""
        while True:
            if self._posted[full] is None:
                while not self._wanting(full):
                    await self._kick.wait()
                upto = max(self.queue.current_seq(),
                           self._wanted_full if full else self._wanted)
                others = await self.nodes() - {self.node}
                if not others:
                    self._release(upto, full)
                    continue
                # Unique even if the wall clock steps back or an id is reused: a repeated name
                # could meet leftover acks, or leave the epoch's tag unchanged.
                name = f"{self.node}/{next(self._numbers)}-{secrets.token_hex(3)}" + \
                    (FULL if full else "")
                body = json.dumps({"node": self.node, "upto": upto, "at": time.time()}).encode()
                await self._request("put", self.tier.put_small, BARRIERS + name, body)
                self._posted[full] = (name, upto, False)
                self._show()
                self.stats.barriers_posted += 1
            posted = self._posted[full]
            assert posted is not None
            name, upto, announced = posted
            if not announced:
                await self._request("put", self.tier.put_small, EPOCH, name.encode())
                self._posted[full] = (name, upto, True)
            self.activity()
            waiting_since = self._clock()
            while True:
                others = await self.nodes() - {self.node}
                acked = set(await self._names(f"{ACKS}{name}/"))
                self._waiting[full] = sorted(others - acked)
                self._show()
                if not self._waiting[full]:
                    break
                if self._clock() - waiting_since >= SLOW_ACK:
                    await self._read_waited()  # a slow or dead node: say who it is
                await trio.sleep(self.poll)
            self.error = None
            self._posted[full] = None
            self._release(upto, full)
            await self._cleanup(name)

    def _wanting(self, full: bool) -> bool:
        if full:
            return self._wanted_full > self._released_full
        return self._wanted > self._released

    def _show(self) -> None:
        """``barrier`` and ``waiting_for`` (status) from the barriers of both kinds."""
        names = [p[0] for p in (self._posted[False], self._posted[True]) if p is not None]
        self.barrier = names[0] if names else None
        self.waiting_for = sorted(set(self._waiting[False]) | set(self._waiting[True]))
        self.waited_info = {k: v for k, v in self.waited_info.items() if k in self.waiting_for}

    async def _read_waited(self) -> None:
        """Refresh what the nodes we wait for registered (at most every HEARTBEAT each)."""
        now = self._clock()
        for name in list(self.waited_info):
            if name not in self.waiting_for:
                del self.waited_info[name]
                self._waited_read.pop(name, None)
        for name in self.waiting_for:
            if now - self._waited_read.get(name, -math.inf) < HEARTBEAT:
                continue
            self._waited_read[name] = now
            try:
                body, _ = await self._request("get", self.tier.get_small, NODES + name)
                info = json.loads(body)
            except (ObjectMissing, ValueError):
                continue  # it left meanwhile (the next poll sees it), or unreadable
            if isinstance(info, dict):
                info.pop("token", None)
                self.waited_info[name] = info

    def _release(self, upto: int, full: bool = False) -> None:
        self._released = max(self._released, upto)
        if full:
            self._released_full = max(self._released_full, upto)
        self._waiting[full] = []
        self._show()
        self.queue.released()

    async def _cleanup(self, name: str) -> None:
        """Remove a barrier and its acks (best effort: leftovers are harmless, a late ack may
        even come after)."""
        try:
            await self._remove(name)
        except (StoreUnavailable, TierError) as exc:
            log.info("could not remove barrier %s: %s", name, exc)

    async def _remove(self, name: str) -> None:
        for acker in await self._names(f"{ACKS}{name}/"):
            await self._request("delete", self.tier.delete, f"{ACKS}{name}/{acker}")
        await self._request("delete", self.tier.delete, BARRIERS + name)
        await self._request("delete", self.tier.delete, f"{ACKS}{name}/")  # a file tier's dir

    async def _ack_barriers(self) -> None:
        epoch: str | None = None
        seen: dict[str, _Seen] = {}
        acked: set[str] = set()
        first = True
        held = False
        while True:
            try:
                _, tag = await self._request("get", self.tier.get_small, EPOCH)
            except ObjectMissing:
                tag = ""
            if self.hold is not None:
                # Each poll: an operator's 'forget' on another node ends the hold.
                await self._still_registered()
            if tag != epoch or first:
                if not first and self.hold is None and self.enlisted:
                    await self._still_registered()
                first = False
                listed = {n for n in await self._names(BARRIERS)
                          if not n.startswith(self.node + "/")}
                for name in sorted(listed - acked - set(seen)):
                    seen[name] = _Seen(self.queue.current_seq())
                    self.activity()
                acked &= listed
                for name in set(seen) - listed:
                    del seen[name]  # withdrawn (its node restarted, or it was forgotten)
                epoch = tag
            if held and self.hold is None:
                # The operator ended the hold: whatever was queued until then (the shards it
                # lost, rewritten first) is "closed before" the barriers held, so the acks
                # wait for it.
                for name in seen:
                    seen[name] = _Seen(self.queue.current_seq())
            held = self.hold is not None
            self.held_barriers = sorted(seen) if held else []
            for name, barrier in list(seen.items()):
                if self.hold is not None:
                    break  # it cannot know what it closed before them (noderun.py)
                if not self.enlisted:
                    # Not registered: nobody waits for its ack. Kept in ``seen`` with the
                    # number noted now, and acked once it registers (a barrier posted
                    # before then may have listed it).
                    break
                if not self.queue.data_outstanding(barrier.upto, markers=name.endswith(FULL)):
                    await self._request("put", self.tier.put_small,
                                        f"{ACKS}{name}/{self.node}", b"")
                    del seen[name]
                    acked.add(name)
                    self.stats.barriers_acked += 1
            self.error = None
            recent = self._clock() - self._last_activity < RECENT
            if ((seen and self.enlisted) or recent) and self.hold is None:
                await trio.sleep(self.poll)
            else:
                # Idle: a local write (a save starting here, so likely everywhere) ends the
                # long sleep, so the barrier that follows is seen within one fast poll.
                with trio.move_on_after(self.idle_poll):
                    await self._active.wait()

    async def _request(self, kind: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        self.stats.requests[kind] = self.stats.requests.get(kind, 0) + 1
        return await fn(*args, **kw)

    def status(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "registered": self.registered,
            "enlisted": self.enlisted,
            "barrier": self.barrier,
            "waiting_for": list(self.waiting_for),
            "waiting_for_info": {name: {**info, **({"seen_ago_s": max(
                0.0, self._wall() - info["seen"])} if isinstance(info.get("seen"), (int, float))
                else {})} for name, info in self.waited_info.items()},
            "error": self.error,
            "registration_wait": self.registration_wait(),
            "registration_waited_s": round(self.registration_waited_s(), 3),
            "hold": None if self.hold is None else {
                **self.hold.as_dict(), "barriers": list(self.held_barriers)},
            "requests": dict(self.stats.requests),
        }
