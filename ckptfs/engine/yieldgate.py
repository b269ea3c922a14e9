"""When the background upload may start its next item: it yields to the job.

A checkpoint burst (R ranks writing their shards at once, then a restart reading them back)
should run at the disk's speed. An upload started meanwhile competes with it for the CPUs
(checksums, copies, the S3 client), the memory bandwidth and the disk. So the uploader asks
this gate before it starts an item (``opens_at``):

- **The job is busy** while any file of the mount is open through it (for writing or for
  reading: a restart reads its checkpoint back), and for ``settle`` seconds after the last
  one closed (the gap between one file of a burst and the next: ``torch.save`` of the model
  then of the optimizer, DCP's ``.metadata`` after the shards). A *busy stretch* runs from
  the first open while the job was not busy to the end of that settle.
- **The bound**: no item waits more than ``hold_max`` for the job. A stretch that lasts longer
  (a steady writer, a log file kept open) opens the gate until the stretch ends; uploads then
  run beside the job, as without the gate.
- **Someone waits for the store**: ``ckptfs sync``, ``fsync = "remote"`` and a writer short
  of staging space (``hurry``) open the gate while they wait (``bypassed``,
  ``bypass_for``): what they wait for must not sit behind the job they are part of.

Transfers in flight are paced too: a put asks ``wait_open`` before each part (S3) or chunk
(file tier) it sends, so an upload under way when a burst begins pauses after the part in
flight. The gate never reorders anything (commit markers still follow the files before them:
upload.py) and never drops work; at worst it delays a start, or an upload's next part, by
``hold_max``. The time from the last close of a checkpoint to its upload starting grows by
``settle``.

``hold_max = 0`` disables the gate (always open). Everything runs on the trio thread; the
clock is the uploader's (trio's, so tests use the autojump clock).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio


class YieldGate:
    """The rule above. The filesystem core calls ``opened``/``closed`` for every file handle
    it gives out and takes back; the uploader calls ``opens_at`` before it starts an item."""

    def __init__(self, settle: float, hold_max: float,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.settle = settle
        self.hold_max = hold_max
        self._clock = clock
        self._open = 0
        self._quiet_since = -math.inf  # when the last open file was closed
        self._stretch_since: float | None = None  # the busy stretch under way, if any
        self._bypassing = 0
        self._bypass_until = -math.inf
        # Workers held by the gate wait on this (``wait``), not on the uploader's own wake-ups:
        # a create burst queues a file per create, and each would wake every worker only to
        # find the gate still closed. It is set when the gate may open earlier than the time
        # it last gave out (``_promised``): the first close of a stretch, a bypass.
        self._event = trio.Event()
        self._promised = math.inf
        self.held_s = 0.0  # seconds the gate was closed with work waiting (status, tests)
        self._held_from: float | None = None

    @classmethod
    def disabled(cls) -> YieldGate:
        return cls(0.0, 0.0)

    @property
    def enabled(self) -> bool:
        return self.hold_max > 0

    # -- the job (fs.py) ------------------------------------------------------------------

    def opened(self) -> None:
        """A file handle was given out to the job."""
        if not self.enabled:
            return
        now = self._clock()
        if self._open == 0 and (self._stretch_since is None
                                or now >= self._quiet_since + self.settle):
            self._stretch_since = now  # a new stretch: the previous one had settled
        self._open += 1

    def closed(self) -> None:
        """A file handle of the job was released."""
        if not self.enabled or self._open == 0:
            return
        self._open -= 1
        if self._open == 0:
            self._quiet_since = self._clock()
            if self._quiet_since + self.settle < self._promised:
                self._changed()  # the settle starts: held workers look again at its end

    # -- the uploader ---------------------------------------------------------------------

    def opens_at(self, now: float) -> float:
        """``now`` if an item may start now; else when to ask again (``math.inf``: when a
        change wakes the uploader: a close, a bypass)."""
        if not self.enabled or self._bypassing or now < self._bypass_until:
            return self._open_now(now)
        settled_at = self._quiet_since + self.settle if self._open == 0 else math.inf
        if now >= settled_at or self._stretch_since is None:
            self._stretch_since = None
            return self._open_now(now)
        forced_at = self._stretch_since + self.hold_max
        if now >= forced_at:
            return self._open_now(now)
        if self._held_from is None:
            self._held_from = now
        if now >= self._promised:
            self._promised = math.inf  # whoever was told that time is awake now
        self._promised = min(self._promised, settled_at, forced_at)
        return min(settled_at, forced_at)

    async def wait_open(self) -> None:
        """Return once an item may start: a transfer in flight asks between its parts (the
        tiers' ``pace``), so a burst that begins during an upload pauses it too."""
        while (opens := self.opens_at(now := self._clock())) > now:
            await self.wait(opens)

    async def wait(self, until: float) -> None:
        """Hold a worker until ``until`` (what ``opens_at`` said) or until the gate may open
        sooner: then it asks ``opens_at`` again."""
        event = self._event
        with trio.move_on_at(until):
            await event.wait()

    def _open_now(self, now: float) -> float:
        self._promised = math.inf
        if self._held_from is not None:
            self.held_s += now - self._held_from
            self._held_from = None
        return now

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """Open while the block runs (someone waits for the store: ``sync``)."""
        self._bypassing += 1
        self._changed()
        try:
            yield
        finally:
            self._bypassing -= 1

    def bypass_for(self, seconds: float) -> None:
        """Open for the next ``seconds`` (a writer waiting for space asks again each second)."""
        self._bypass_until = max(self._bypass_until, self._clock() + seconds)
        self._changed()

    def status(self) -> dict[str, float | int | bool]:
        """For ``ckptfs status``: whether uploads are held for the job now, and so far."""
        now = self._clock()
        return {"enabled": self.enabled, "open_files": self._open,
                "holding": self._held_from is not None, "held_s": round(
                    self.held_s + (now - self._held_from if self._held_from is not None
                                   else 0.0), 3)}

    def _changed(self) -> None:
        self._promised = math.inf  # every held worker wakes and asks again
        self._event.set()
        self._event = trio.Event()
