"""Commit order across nodes: a commit marker reaches the store only after every file closed
before it, on ANY node mounting the same store prefix, is committed (docs/SEMANTICS.md,
"Many nodes").

The nodes coordinate through the store alone, with small objects under ``.ckptfs/``
(tiers/base.py ``CONTROL_PREFIX``); no server, no clocks compared:

- **Registration.** At mount, before the first request is served, a node creates
  ``.ckptfs/nodes/<node id>`` (create-if-absent) holding a token kept in its staging
  directory: the same token is a restart of the same node; another one is a second staging
  directory claiming the id, refused (``DuplicateNode``), since the two would not wait for
  each other. A clean unmount with nothing left to upload deletes it. A node
  that was killed stays registered: markers wait for it until it comes back (the same staging
  directory is the same node id) and has uploaded what it had, or until an operator removes
  it (``ckptfs nodes forget``).
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
B acks only once the file is committed. A node that registers after A listed the nodes mounted
after the marker was closed, so nothing it closes is "before" it.

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

Store requests per node: one GET of the epoch per poll (``node_poll_interval`` while there is
work or a recent barrier, ``node_idle_poll_interval`` when idle); per barrier, one LIST of the
barriers, one GET of its own registration (a forgotten live node registers again) and one PUT
of the ack on every other node, and on the poster one PUT of the barrier,
one of the epoch, a LIST of nodes and of acks per poll until done, and the clean-up DELETEs.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from ckptfs.errors import StoreUnavailable
from ckptfs.noderun import Hold, NodeRun
from ckptfs.tiers.base import (
    CONTROL_PREFIX,
    ObjectMissing,
    PreconditionFailed,
    Tier,
    TierError,
)

log = logging.getLogger(__name__)

NODES = CONTROL_PREFIX + "nodes/"
BARRIERS = CONTROL_PREFIX + "barriers/"
ACKS = CONTROL_PREFIX + "acks/"
EPOCH = CONTROL_PREFIX + "epoch"
# Checkpoints retention deleted, or moved off the warm tier: ``retired/<quoted path>`` holds
# {"by": node, "at": wall time}, written before the first object goes. A node whose listing
# misses an object it still has a local copy of uploads it again, unless the object is under
# a path retired after the node committed it: then the store's absence is the policy's
# decision, and the node drops its copy too (listing.py).
RETIRED = CONTROL_PREFIX + "retired/"


def retired_key(path: str) -> str:
    """The retirement record of a checkpoint path (``runs/exp1/step_100``)."""
    from urllib.parse import quote

    return RETIRED + quote(path.strip("/"), safe="")


def retired_paths(key: str) -> list[str]:
    """The paths whose retirement covers ``key``: itself and each of its ancestors."""
    parts = key.strip("/").split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
NODE_ID_FILE = "node-id"
NODE_TOKEN_FILE = "node-token"
RECENT = 60.0  # seconds after a barrier or upload during which a node polls at the fast rate
BACKOFF_MAX = 30.0


class Queue(Protocol):
    """What the coordinator needs from the uploader (upload.py)."""

    def current_seq(self) -> int: ...
    def data_outstanding(self, upto_seq: int) -> bool: ...
    def released(self) -> None: ...


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
    ) -> None:
        self.tier = tier
        self.node = node
        self.token = token or secrets.token_hex(16)
        self._posted: tuple[str, int, bool] | None = None  # barrier name, upto, announced
        self.queue = queue
        self.poll = poll
        self.idle_poll = max(idle_poll, poll)
        self._clock = clock
        self._released = 0  # markers numbered up to this may go to the store
        self._wanted = 0  # the highest marker number waiting for a barrier
        self._kick = trio.Event()
        self._active = trio.Event()
        self._numbers = itertools.count(int(time.time() * 1000))
        self._last_activity = -math.inf
        self.waiting_for: list[str] = []  # nodes that have not acked our barrier yet
        self.barrier: str | None = None
        self.error: str | None = None
        self.stats = CoordinationStats()
        self.registered = False
        self.run_record = run  # this run's record (noderun.py): the hold, if any
        self.held_barriers: list[str] = []  # barriers seen and not acked because of the hold

    @property
    def hold(self) -> Hold | None:
        return None if self.run_record is None else self.run_record.hold

    # -- the uploader's side ----------------------------------------------------------------

    def is_released(self, seq: int) -> bool:
        return seq <= self._released

    def want(self, seq: int) -> None:
        """A marker numbered ``seq`` is ready on this node: post a barrier for it."""
        if seq > self._wanted:
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

    async def register(self) -> None:
        """Register, or register again after a restart of this staging directory (the same
        token). Raises ``DuplicateNode`` if another staging directory holds this id: the two
        would not wait for each other."""
        record: dict[str, Any] = {"node": self.node, "token": self.token,
                                  "host": socket.gethostname(), "pid": os.getpid(),
                                  "since": time.time()}
        if self.hold is not None:
            record["hold"] = self.hold.reason  # other nodes' 'ckptfs nodes' say why
        body = json.dumps(record).encode()
        key = NODES + self.node
        while True:
            try:
                await self._request("put", self.tier.put_small, key, body, if_absent=True)
                break
            except PreconditionFailed:
                pass
            try:
                old, tag = await self._request("get", self.tier.get_small, key)
            except ObjectMissing:
                continue  # it left meanwhile
            try:
                theirs = json.loads(old)
            except ValueError:
                theirs = {}
            if theirs.get("token") != self.token:
                raise DuplicateNode(
                    f"node id {self.node!r} is registered by another staging directory (host "
                    f"{theirs.get('host', '?')}, pid {theirs.get('pid', '?')}): give each node "
                    f"its own node_id, or if that node is gone for good, run 'ckptfs nodes "
                    f"--forget {self.node}' on a live node")
            try:
                await self._request("put", self.tier.put_small, key, body, if_tag=tag)
                break
            except PreconditionFailed:
                continue
        self.registered = True

    async def deregister(self) -> None:
        if self.hold is not None:
            # Leaving would let every marker waiting for it go out: the operator decides.
            log.warning("node %s stays registered: it holds barriers (%s)", self.node,
                        self.hold.reason)
            return
        await self._request("delete", self.tier.delete, NODES + self.node)
        self.registered = False

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
        try:
            await self._request("get", self.tier.get_small, NODES + self.node)
        except ObjectMissing:
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
            nursery.start_soon(self._retrying, self._post_barriers)
            nursery.start_soon(self._retrying, self._ack_barriers)
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

    async def _post_barriers(self) -> None:
        """Post a barrier for the markers wanted, wait for every node's ack, release them.
        A store error anywhere retries from where it was (``_posted``): a barrier once put is
        waited for, not replaced by a new one that would orphan it."""
        while True:
            if self._posted is None:
                while self._wanted <= self._released:
                    await self._kick.wait()
                upto = max(self.queue.current_seq(), self._wanted)
                others = await self.nodes() - {self.node}
                if not others:
                    self._release(upto)
                    continue
                # Unique even if the wall clock steps back or an id is reused: a repeated name
                # could meet leftover acks, or leave the epoch's tag unchanged.
                name = f"{self.node}/{next(self._numbers)}-{secrets.token_hex(3)}"
                body = json.dumps({"node": self.node, "upto": upto, "at": time.time()}).encode()
                await self._request("put", self.tier.put_small, BARRIERS + name, body)
                self._posted = (name, upto, False)
                self.barrier = name
                self.stats.barriers_posted += 1
            name, upto, announced = self._posted
            if not announced:
                await self._request("put", self.tier.put_small, EPOCH, name.encode())
                self._posted = (name, upto, True)
            self.activity()
            while True:
                others = await self.nodes() - {self.node}
                acked = set(await self._names(f"{ACKS}{name}/"))
                self.waiting_for = sorted(others - acked)
                if not self.waiting_for:
                    break
                await trio.sleep(self.poll)
            self.error = None
            self._posted = None
            self._release(upto)
            await self._cleanup(name)

    def _release(self, upto: int) -> None:
        self._released = max(self._released, upto)
        self.waiting_for = []
        self.barrier = None
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
                if not first and self.hold is None:
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
                if not self.queue.data_outstanding(barrier.upto):
                    await self._request("put", self.tier.put_small,
                                        f"{ACKS}{name}/{self.node}", b"")
                    del seen[name]
                    acked.add(name)
                    self.stats.barriers_acked += 1
            self.error = None
            recent = self._clock() - self._last_activity < RECENT
            if (seen or recent) and self.hold is None:
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
            "barrier": self.barrier,
            "waiting_for": list(self.waiting_for),
            "error": self.error,
            "hold": None if self.hold is None else {
                **self.hold.as_dict(), "barriers": list(self.held_barriers)},
            "requests": dict(self.stats.requests),
        }
