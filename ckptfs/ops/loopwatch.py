"""How long the daemon's trio loop went without answering anything (it must never freeze).

Every FUSE request, upload step and control request of a mount runs on one trio thread, so
anything that holds that thread (a long step, a blocking call, a full garbage collection)
delays every answer by as long. Two measurements, both cheap enough to run always:

- A heartbeat task sleeps ``interval`` and measures how late it wakes: the lateness is time
  the loop spent elsewhere. Stalls of ``STALL`` or more are counted; the longest per minute is
  kept for ``WINDOW`` (status, metrics), and the longest since the mount.
- Python's cyclic garbage collector is timed through ``gc.callbacks``: a full (generation 2)
  collection scans every tracked object, so its pause grows with what the daemon holds
  (rows of the files it knows, queued work). Whatever thread triggers it, it holds the GIL,
  so the loop stands still for its length: 166 ms at 40,000 files here, ~400 ms at 100,000.

And one remedy: after a full collection the heartbeat freezes what survived it
(``gc.freeze``: the permanent generation, which no collection scans), so the next full
collection scans only what became long-lived since, a fraction of the heap. What is frozen is
still freed by reference counting; only a reference cycle through a frozen object waits, so
once per ``unfreeze_after`` the heap is unfrozen and the next full collection scans it all
(one long pause an hour instead of one per 25 % of growth).

Invariants: the figures only grow (counters) or describe a bounded recent window; the gc
callback is removed when ``run`` ends, so a watch never outlives its mount. The heartbeat
uses the real monotonic clock: under trio's autojump clock (tests) it would turn virtual
sleeps into busy steps, so only a real mount (mount.py) starts it.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any

import trio

INTERVAL = 0.02   # the heartbeat's sleep: the resolution of what is seen
STALL = 0.1       # lateness counted as a stall (a request waiting this long is noticed)
UNFREEZE_AFTER = 3600.0  # s: how long a cycle through frozen objects may wait to be collected
WINDOW = 300.0    # how far back the recent longest stall looks (s), kept as per-minute maxima
_WINDOW_MINUTES = int(WINDOW // 60)


class LoopWatch:
    def __init__(self, interval: float = INTERVAL, freeze: bool = True,
                 unfreeze_after: float = UNFREEZE_AFTER) -> None:
        self.interval = interval
        self.freeze = freeze
        self.unfreeze_after = unfreeze_after
        self.gc_unfreezes = 0
        self._freeze_due = False
        self._unfrozen_at = time.monotonic()
        self.longest_stall = 0.0
        self.stalls = 0
        self.gc_full = 0
        self.gc_full_seconds = 0.0
        self.gc_longest = 0.0
        # (minute, longest lateness in it): at most _WINDOW_MINUTES + 1 entries
        self._minutes: deque[tuple[int, float]] = deque()
        self._gc_started: float | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            task_status.started()
            while True:
                before = time.monotonic()
                await trio.sleep(self.interval)
                self.note(time.monotonic() - before - self.interval)
                if self._freeze_due:
                    self._after_full_collection()
        finally:
            gc.callbacks.remove(self._on_gc)
            if self.freeze:
                gc.unfreeze()  # leave the interpreter as found (tests mount in-process)

    def _after_full_collection(self) -> None:
        # Not in the gc callback itself: the collector is still running its callbacks.
        self._freeze_due = False
        now = time.monotonic()
        if now - self._unfrozen_at >= self.unfreeze_after:
            gc.unfreeze()  # the next full collection scans everything once
            self._unfrozen_at = now
            self.gc_unfreezes += 1
        else:
            gc.freeze()

    def note(self, late: float, now: float | None = None) -> None:
        """The heartbeat woke ``late`` seconds after it asked to."""
        if late <= 0:
            return
        now = time.monotonic() if now is None else now
        minute = int(now // 60)
        if self._minutes and self._minutes[-1][0] == minute:
            if late > self._minutes[-1][1]:
                self._minutes[-1] = (minute, late)
        else:
            self._minutes.append((minute, late))
        while self._minutes and self._minutes[0][0] <= minute - _WINDOW_MINUTES:
            self._minutes.popleft()
        self.longest_stall = max(self.longest_stall, late)
        if late >= STALL:
            self.stalls += 1

    def recent_longest(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        oldest = int(now // 60) - _WINDOW_MINUTES
        return max((late for minute, late in self._minutes if minute > oldest), default=0.0)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            pause = time.perf_counter() - self._gc_started
            self._gc_started = None
            self.gc_full += 1
            self.gc_full_seconds += pause
            self.gc_longest = max(self.gc_longest, pause)
            self._freeze_due = self.freeze

    def status(self) -> dict[str, Any]:
        return {
            "longest_stall_s": round(self.longest_stall, 3),
            "recent_longest_stall_s": round(self.recent_longest(), 3),
            "stalls": self.stalls,
            "gc_full_collections": self.gc_full,
            "gc_full_seconds": round(self.gc_full_seconds, 3),
            "gc_longest_s": round(self.gc_longest, 3),
            "gc_frozen_objects": gc.get_freeze_count(),
        }
