"""The retention lease: one node at a time applies the retention policy (docs/RETENTION.md,
"Several nodes").

The lease is one small object, ``.ckptfs/retention.lease`` in the warm tier, holding
``{"holder": <node id>, "expires": <wall time, seconds since the epoch>}``. Every change is
a conditional write (tiers/base.py ``put_small``): a node creates it only if absent, and
replaces it only if its tag is the one it read. Of two nodes racing, exactly one wins; the
other sees the winner as the holder and skips that round.

Invariants:
- A node works under the lease only while ``valid()``: it holds the object's current tag and
  its own monotonic clock says the lease has at least ``margin`` (a third of its length) left
  since the last successful write was sent. Renewal, a third of the length after the last
  write was sent, rewrites ``expires``; so a renewal that takes less than a third of the
  length leaves no gap in validity.
- Another node takes the lease only once ``expires`` has passed by *its* wall clock. Expiry
  therefore compares the wall clocks of two nodes: the holder stops at ``expires - margin``
  by its clock, so the lease is exclusive as long as the clocks differ by less than
  ``margin`` (3 min 20 s with the default 10 min lease). NTP-synchronised nodes are far
  within that; nodes whose clocks may drift by minutes must not share a store.
- ``release`` first renews the lease conditionally (proving it is still ours, with a whole
  length left: nobody may take it meanwhile), then deletes the object; a lease that is not
  ours any more is left alone.
- An unreadable lease body (not our JSON) counts as expired: it is replaced, conditionally.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ckptfs.errors import CkptfsError
from ckptfs.store.tiers.base import CONTROL_PREFIX, ObjectMissing, PreconditionFailed, Tier

log = logging.getLogger(__name__)

LEASE_KEY = CONTROL_PREFIX + "retention.lease"


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds the lease, and until when (wall time)."""

    node: str
    expires: float

    def describe(self, now: float) -> str:
        left = self.expires - now
        return f"node {self.node} (for {max(0.0, left):.0f}s more)"


class LeaseLost(CkptfsError):
    """The lease could not be renewed in time, or another node holds it now."""


class Lease:
    """The retention lease of one node over ``tier`` (see the module docstring)."""

    def __init__(self, tier: Tier, node: str, length: float, *,
                 wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = trio.current_time) -> None:
        self.tier = tier
        self.node = node
        self.length = length
        self.margin = length / 3
        self.wall = wall
        self.monotonic = monotonic
        self._tag: str | None = None
        self._valid_until = -1.0  # monotonic time until which our work is safe
        self._written_at = -1.0  # monotonic time when our last successful write was sent

    # -- reading ---------------------------------------------------------------------------

    async def read(self) -> tuple[Holder | None, str | None]:
        """The holder written in the store (None: no lease or unreadable) and the tag."""
        try:
            body, tag = await self.tier.get_small(LEASE_KEY)
        except ObjectMissing:
            return None, None
        try:
            data = json.loads(body)
            return Holder(str(data["holder"]), float(data["expires"])), tag
        except (ValueError, KeyError, TypeError):
            return None, tag  # not ours to understand: counts as expired

    def holds(self) -> bool:
        return self._tag is not None

    def valid(self) -> bool:
        """Whether work under the lease may go on now."""
        return self._tag is not None and self.monotonic() < self._valid_until

    # -- changing --------------------------------------------------------------------------

    def _body(self, expires: float) -> bytes:
        return json.dumps({"holder": self.node, "expires": expires}).encode()

    async def acquire(self) -> Holder | None:
        """Take the lease. Returns None when this node holds it now, else the other holder
        (unexpired by our clock), whose lease we must leave alone."""
        for _ in range(2):  # a lost race: read the winner once more
            holder, tag = await self.read()
            now = self.wall()
            if holder is not None and holder.node != self.node and holder.expires > now:
                return holder
            started = self.monotonic()
            try:
                if tag is None:
                    new = await self.tier.put_small(LEASE_KEY, self._body(now + self.length),
                                                    if_absent=True)
                else:
                    new = await self.tier.put_small(LEASE_KEY, self._body(now + self.length),
                                                    if_tag=tag)
            except PreconditionFailed:
                continue
            self._took(new, started)
            return None
        holder, _ = await self.read()
        return holder or Holder("?", self.wall() + self.length)

    def _took(self, tag: str, started: float) -> None:
        # From when the write was sent: the store may have applied it at once.
        self._tag = tag
        self._written_at = started
        self._valid_until = started + self.length - self.margin

    async def renew(self) -> None:
        """Push the expiry forward; ``LeaseLost`` if the object is not ours any more."""
        if self._tag is None:
            raise LeaseLost("retention lease not held")
        started = self.monotonic()
        try:
            new = await self.tier.put_small(LEASE_KEY, self._body(self.wall() + self.length),
                                            if_tag=self._tag)
        except PreconditionFailed:
            self._tag = None
            raise LeaseLost("the retention lease was taken by another node") from None
        self._took(new, started)

    async def keep_renewed(self, on_lost: Callable[[], None]) -> None:
        """Renew every third of the length until cancelled; call ``on_lost`` if a renewal
        is refused or the lease ran out of margin (store unreachable)."""
        # Every third of the length from the start of the last successful write (not from
        # its end): a write that takes long still lands before the margin is reached.
        next_at = self._written_at + self.length / 3
        while True:
            await trio.sleep_until(next_at)
            try:
                await self.renew()
                next_at = self._written_at + self.length / 3
            except LeaseLost as exc:
                log.warning("retention: %s: stopping", exc)
                on_lost()
                return
            except CkptfsError as exc:
                if not self.valid():
                    log.warning("retention: lease not renewed in time (%s): stopping", exc)
                    on_lost()
                    return
                log.info("retention: lease renewal failed (retried): %s", exc)
                next_at = self.monotonic() + self.length / 30

    async def release(self) -> None:
        """Give the lease up (best effort: an unreleased lease just expires)."""
        if self._tag is None:
            return
        try:
            # A conditional renewal first proves the object is still ours and gives it a
            # whole length: nobody may take it while we delete it right after.
            await self.renew()
            if self.valid():
                await self.tier.delete(LEASE_KEY)
        except CkptfsError as exc:  # LeaseLost included: then it is not ours to delete
            log.info("retention: lease not released (it expires by itself): %s", exc)
        finally:
            self._tag = None
