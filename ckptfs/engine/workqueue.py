"""The uploader's pending items, in number order, with the ones backing off kept apart.

The scheduler (upload.py ``Uploader._pick``) looks at pending items smallest number first and
takes the first one it may start. Sorting every pending item on every pick made the drain of
n items O(n² log n) (20,000 files queued after a remount, or a store outage with thousands of
closed files, froze the trio thread). This queue gives the same order in O(log n) per item
looked at:

- ``ready``: a heap of (number, tiebreak, work) of the items whose backoff is over;
- ``delayed``: a heap of (not before, tiebreak, work) of the items still backing off; they
  move to ``ready`` when their time comes;
- ``numbers``: a heap of (number, tiebreak, work) of every pending item, for the smallest
  number (the marker floor) whatever its backoff.

Invariants:
- The dict ``_items`` is the truth: an item is pending iff it is there. Heap entries are
  hints: an entry whose item left the queue, or whose number or backoff changed since it was
  pushed, is stale and dropped when it reaches the top (lazy deletion). So every change of
  an item's ``seq`` or ``not_before`` must be followed by ``touch`` (which pushes fresh
  entries), and an item is never lost: its latest values always have an entry.
- A pick looks at ready items in number order and puts back the ones it passes over, so the
  cost of a pick is the number of items ahead of the one taken (those waiting for a marker's
  turn, a busy key or another node), not the number pending.
- The heaps are rebuilt from ``_items`` when stale entries outnumber live ones, so memory
  stays O(pending).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Hashable


class Item(Protocol):
    seq: int
    not_before: float

    @property
    def key(self) -> Hashable: ...


W = TypeVar("W", bound=Item)

_Entry = tuple[float, int, W]


class WorkQueue(Generic[W]):
    def __init__(self) -> None:
        self._items: dict[Hashable, W] = {}
        self._ready: list[_Entry[W]] = []
        self._delayed: list[_Entry[W]] = []
        self._numbers: list[_Entry[W]] = []
        self._tie = itertools.count()

    # -- the dict view ----------------------------------------------------------------------

    def get(self, key: Hashable) -> W | None:
        return self._items.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> Iterator[W]:
        return iter(list(self._items.values()))

    def add(self, work: W) -> None:
        """Queue ``work`` (its key must not be queued)."""
        assert work.key not in self._items
        self._items[work.key] = work
        self.touch(work)

    def pop(self, key: Hashable, default: None = None) -> W | None:
        """Take the item with ``key`` out of the queue (its heap entries go stale)."""
        return self._items.pop(key, None)

    def touch(self, work: W) -> None:
        """``work``'s number or backoff changed (or it was just added): re-file it."""
        if self._items.get(work.key) is not work:
            return
        tie = next(self._tie)
        heapq.heappush(self._numbers, (work.seq, tie, work))
        if work.not_before > 0.0:
            heapq.heappush(self._delayed, (work.not_before, tie, work))
        # An item backing off has a ready entry too; ``pick`` sends it to ``delayed`` if its
        # time has not come, so its number's order is kept whichever heap it is found in.
        heapq.heappush(self._ready, (work.seq, tie, work))
        if len(self._numbers) > 4 * len(self._items) + 64:
            self._rebuild()

    # -- ordered views ----------------------------------------------------------------------

    def smallest_seq(self) -> float:
        """The smallest number queued, backing off or not (``inf`` when empty)."""
        return self._top(self._numbers, lambda work, seq: work.seq == seq)

    def pick(self, now: float, take: Callable[[W], bool]) -> tuple[W | None, float]:
        """The first item in number order whose backoff is over and that ``take`` accepts
        (it leaves the queue), and the earliest time a backing-off item is due (to look
        again then). ``take`` may queue or touch items; items it turns down stay queued."""
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            _, tie, work = heapq.heappop(delayed)
            if self._items.get(work.key) is work and work.not_before <= now:
                heapq.heappush(self._ready, (work.seq, tie, work))
        passed: list[_Entry[W]] = []
        seen: set[int] = set()
        taken = None
        while self._ready:  # not aliased: ``take`` may rebuild the heaps
            entry = heapq.heappop(self._ready)
            seq, _, work = entry
            if self._items.get(work.key) is not work or work.seq != seq or id(work) in seen:
                continue  # stale or a duplicate entry
            seen.add(id(work))
            if work.not_before > now:
                continue  # backing off: its ``delayed`` entry brings it back
            if take(work):
                self._items.pop(work.key, None)
                taken = work
                break
            passed.append(entry)
        for entry in passed:
            heapq.heappush(self._ready, entry)
        return taken, self._next_due()

    def _next_due(self) -> float:
        return self._top(self._delayed, lambda work, when: work.not_before == when)

    def _top(self, heap: list[_Entry[W]], fresh: Callable[[W, float], bool]) -> float:
        """The value at the top of ``heap`` once stale entries are dropped (``inf``)."""
        while heap:
            value, _, work = heap[0]
            if self._items.get(work.key) is work and fresh(work, value):
                return value
            heapq.heappop(heap)
        return math.inf

    def _rebuild(self) -> None:
        items = list(self._items.values())
        self._numbers = [(w.seq, next(self._tie), w) for w in items]
        self._ready = list(self._numbers)
        self._delayed = [(w.not_before, next(self._tie), w) for w in items if w.not_before > 0.0]
        for heap in (self._numbers, self._ready, self._delayed):
            heapq.heapify(heap)
