"""A directory marker's put is kept apart from the writes beneath it (tiers/markergate.py).

SeaweedFS loses a marker ``d/`` put while a write beneath it (``d/sub/``, ``d/x``) makes the
directory ``d`` itself, now and then (measured: 10 of 2,000 pairs put at once through one
S3 tier without the gate, 0 of 2,000 with it). That race cannot be forced from outside the
server, so these tests check the tier's side deterministically: on the wire, a marker's
request and a request creating a key beneath it are never in flight at once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import trio
import trio.testing

from ckptfs.store.tiers.base import Kind, ObjectMeta
from ckptfs.store.tiers.markergate import MarkerGate
from ckptfs.store.tiers.s3 import MIN_PART_SIZE, S3Tier
from tests.seaweed import Seaweed

# The requests that create an entry on the server (and, on SeaweedFS, its parents).
CREATING = ("PutObject", "CompleteMultipartUpload", "CopyObject")
HOLD = 1.0  # how long the marker's request waits for a request beneath it to go first


class Wire:
    """Watches a tier's creating requests from botocore's thread: which keys are in flight,
    and every request that started while a marker above it was in flight. The first
    request for ``held`` waits (up to HOLD s) until another creating request starts."""

    def __init__(self, client: Any, held: str) -> None:
        self.held = held
        self.lock = threading.Lock()
        self.in_flight: list[str] = []
        self.overlaps: list[tuple[str, str]] = []
        self.other_started = threading.Event()
        self.holding = threading.Event()
        for op in CREATING:
            client.meta.events.register(f"before-parameter-build.s3.{op}", self.before)
            client.meta.events.register(f"after-call.s3.{op}", self.after)

    def before(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        key = str(params["Key"])
        context["wire_key"] = key
        with self.lock:
            for other in self.in_flight:
                for marker, child in ((other, key), (key, other)):
                    if marker.endswith("/") and child != marker and child.startswith(marker):
                        self.overlaps.append((marker, child))
            self.in_flight.append(key)
            hold = key == self.held and not self.holding.is_set()
            if hold:
                self.holding.set()
            else:
                self.other_started.set()
        if hold:
            self.other_started.wait(HOLD)

    def after(self, context: dict[str, Any], **_: Any) -> None:
        with self.lock:
            self.in_flight.remove(context["wire_key"])


async def wait_until(event: threading.Event) -> None:
    with trio.fail_after(30):
        while not event.is_set():
            await trio.sleep(0.005)


async def test_a_marker_and_the_writes_beneath_it_are_not_in_flight_at_once(
        seaweed: Seaweed, tmp_path: Path) -> None:
    """The marker ``d/`` is held on its way out; meanwhile a subdirectory's marker, a small
    file, a multipart file and a copy are written beneath ``d/``: each goes only once the
    marker's request is done. Before the gate each of them went at once (4 overlaps)."""
    bucket = seaweed.new_bucket()
    tier = S3Tier("warm", f"s3://{bucket}/p", endpoint_url=seaweed.endpoint,
                  part_size=MIN_PART_SIZE, **seaweed.tier_credentials)
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"s" * 1000)
    big.write_bytes(b"b" * (MIN_PART_SIZE + 1))
    await tier.put_file("src", small, 1000, ObjectMeta())  # the copy's source, outside d/
    wire = Wire(tier.client, held="p/d/")
    directory = ObjectMeta(Kind.DIRECTORY, 0o755)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.put_entry, "d/", directory)
        await wait_until(wire.holding)
        nursery.start_soon(tier.put_entry, "d/sub/", directory)
        nursery.start_soon(tier.put_file, "d/small", small, 1000, ObjectMeta())
        nursery.start_soon(tier.put_file, "d/big", big, MIN_PART_SIZE + 1, ObjectMeta())
        nursery.start_soon(tier.copy, "src", "d/copy")
    assert wire.overlaps == []
    listed = tier.client.list_objects_v2(Bucket=bucket, Prefix="p/d/")
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        "p/d/", "p/d/big", "p/d/copy", "p/d/small", "p/d/sub/"]
    await tier.aclose()


async def test_the_gate_keeps_only_markers_and_what_is_beneath_them_apart() -> None:
    gate = MarkerGate()
    order: list[str] = []
    release = {name: trio.Event() for name in ("d/", "d/x", "d/y", "d/", "e/x", "d2")}

    async def request(key: str, started: trio.Event) -> None:
        async with gate.creating(key):
            order.append(f"+{key}")
            started.set()
            await release[key].wait()
            order.append(f"-{key}")

    async def start(nursery: trio.Nursery, key: str) -> trio.Event:
        started = trio.Event()
        nursery.start_soon(request, key, started)
        await trio.testing.wait_all_tasks_blocked()
        return started

    async with trio.open_nursery() as nursery:
        marker = await start(nursery, "d/")
        assert marker.is_set()
        # unrelated keys, and the same marker again, go at once
        assert (await start(nursery, "e/x")).is_set()
        assert (await start(nursery, "d2")).is_set()
        assert (await start(nursery, "d/")).is_set()
        # beneath the marker: waits for it
        child = await start(nursery, "d/x")
        assert not child.is_set()
        release["d/"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert child.is_set()
        # a marker waits for the write beneath it that came first, and a later write
        # beneath it waits for the marker (first come, first served)
        release["d/"] = trio.Event()
        marker2 = await start(nursery, "d/")
        later = await start(nursery, "d/y")
        assert not marker2.is_set() and not later.is_set()
        release["d/x"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert marker2.is_set() and not later.is_set()
        release["d/"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert later.is_set()
        for event in release.values():
            event.set()
    assert order.index("-d/x") < order.index("+d/y")
