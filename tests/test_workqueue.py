"""The uploader's queue (ckptfs/engine/workqueue.py) against the scan it replaced: for any sequence
of adds, renumberings, backoffs, removals and picks, ``pick`` takes what a sort of every
pending item by number would have taken, and says when the next backing-off item is due."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.engine.workqueue import WorkQueue


@dataclass(eq=False)
class W:
    key: int
    seq: int
    not_before: float = 0.0


def reference(items: dict[int, W], now: float, refuse: set[int]) -> tuple[int | None, float]:
    due = min((w.not_before for w in items.values() if w.not_before > now), default=math.inf)
    for w in sorted(items.values(), key=lambda w: w.seq):
        if w.not_before <= now and w.key not in refuse:
            return w.key, due
    return None, due


op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 30), st.integers(0, 100)),
    st.tuples(st.just("seq"), st.integers(0, 30), st.integers(0, 100)),
    st.tuples(st.just("backoff"), st.integers(0, 30), st.integers(0, 20)),
    st.tuples(st.just("pop"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("pick"), st.integers(0, 30), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.just(0), st.integers(0, 5)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(op, max_size=120))
def test_pick_matches_a_sorted_scan(ops: list[tuple[str, int, int]]) -> None:
    q: WorkQueue[W] = WorkQueue()
    model: dict[int, W] = {}
    now = 0.0
    for kind, key, value in ops:
        work = model.get(key)
        if kind == "add" and work is None:
            model[key] = W(key, value)
            q.add(model[key])
        elif kind == "seq" and work is not None:
            work.seq = value
            q.touch(work)
        elif kind == "backoff" and work is not None:
            work.not_before = now + value
            q.touch(work)
        elif kind == "pop":
            assert (q.pop(key) is not None) == (model.pop(key, None) is not None)
        elif kind == "tick":
            now += value
        elif kind == "pick":
            # Refuse some items (a busy key, a marker's turn): they must stay queued.
            refuse = {k for k in model if k % 4 == value}
            expected, due = reference(model, now, refuse)
            taken, wake_at = q.pick(now, lambda w, refuse=refuse: w.key not in refuse)
            assert (None if taken is None else taken.key) == expected
            if taken is not None:
                del model[taken.key]
            else:
                assert wake_at == due
        assert len(q) == len(model)
        assert q.smallest_seq() == min((w.seq for w in model.values()), default=math.inf)


def test_a_pick_costs_the_items_ahead_not_the_items_pending() -> None:
    """10,000 items backing off and one ready: a pick looks at one item, not 10,000."""
    q: WorkQueue[W] = WorkQueue()
    for k in range(10_000):
        q.add(W(k, k, not_before=100.0))
    q.add(W(-1, 10_001))
    q.pick(0.0, lambda w: False)  # the first pick moves the backing-off items aside
    looked: list[int] = []
    taken, wake_at = q.pick(0.0, lambda w: looked.append(w.key) or True)
    assert taken is not None and taken.key == -1 and looked == [-1]
    assert wake_at == 100.0
