"""The daemon's loop watch (ckptfs/ops/loopwatch.py): stalls of the trio loop and full garbage
collections are seen, and the recent window forgets old ones. Real clock: the watch measures
real time on purpose (the bounds below are lower bounds, safe on a loaded machine)."""

from __future__ import annotations

import gc
import time

import trio

from ckptfs.ops.loopwatch import LoopWatch


async def test_a_blocked_loop_is_seen_as_a_stall() -> None:
    watch = LoopWatch(interval=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        await trio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 - what a blocking call on the loop does to every other task
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert watch.longest_stall >= 0.25
    assert watch.recent_longest() >= 0.25
    assert watch.stalls >= 1
    assert watch.status()["longest_stall_s"] >= 0.25


async def test_a_full_garbage_collection_is_timed_and_the_hook_goes_with_the_watch() -> None:
    watch = LoopWatch()
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        gc.collect(1)  # not a full collection: not counted
        assert watch.gc_full == 0
        gc.collect()
        nursery.cancel_scope.cancel()
    assert watch.gc_full == 1 and watch.gc_longest > 0
    assert watch.gc_full_seconds >= watch.gc_longest
    assert watch._on_gc not in gc.callbacks
    gc.collect()
    assert watch.gc_full == 1


def test_the_recent_window_forgets_old_stalls() -> None:
    watch = LoopWatch()
    watch.note(0.5, now=10.0)       # minute 0
    watch.note(0.05, now=70.0)      # minute 1
    watch.note(-0.001, now=80.0)    # on time: nothing
    assert watch.recent_longest(now=200.0) == 0.5
    assert watch.recent_longest(now=330.0) == 0.05  # minute 0 is over 5 minutes old
    watch.note(0.01, now=1000.0)
    assert watch.recent_longest(now=1000.0) == 0.01
    assert len(watch._minutes) == 1  # old minutes are dropped, not only skipped
    assert watch.longest_stall == 0.5 and watch.stalls == 1  # 0.5 s >= STALL, 0.05 s not


async def test_after_a_full_collection_the_survivors_are_frozen_and_thawed_in_time() -> None:
    watch = LoopWatch(interval=0.01, unfreeze_after=3600.0)
    assert gc.get_freeze_count() == 0
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        gc.collect()
        await trio.sleep(0.05)  # the heartbeat freezes, outside the collector's callback
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        watch.unfreeze_after = 0.0  # an hour later: the next full collection sees everything
        gc.collect()
        await trio.sleep(0.05)
        assert gc.get_freeze_count() == 0 and watch.gc_unfreezes == 1
        watch.unfreeze_after = 3600.0
        gc.collect()
        await trio.sleep(0.05)
        assert gc.get_freeze_count() >= frozen // 2  # frozen again, for the next hour
        nursery.cancel_scope.cancel()
    assert gc.get_freeze_count() == 0  # a watch leaves nothing frozen behind


async def test_a_cycle_through_a_frozen_object_is_collected_once_thawed() -> None:
    import weakref

    class Node:
        other: object = None

    watch = LoopWatch(interval=0.01, unfreeze_after=3600.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        a, b = Node(), Node()
        a.other, b.other = b, a
        gc.collect()
        await trio.sleep(0.05)  # a and b are frozen now
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is not None  # the cycle waits while frozen
        watch.unfreeze_after = 0.0
        await trio.sleep(0.05)
        gc.collect()  # a full collection: the watch thaws after it
        await trio.sleep(0.05)
        gc.collect()
        assert gone() is None
        nursery.cancel_scope.cancel()
