"""Keep a directory marker's put apart from the puts beneath it (one S3 tier's requests).

Why: SeaweedFS keeps a marker ``d/`` as a directory of its filer, marked explicit by a MIME
type on the entry, and a write of a key beneath it (``d/x``, ``d/sub/``) makes a missing
``d`` itself: it looks ``d`` up, then inserts a plain directory. A marker put that lands
between the lookup and the insert is overwritten by that insert (with its default leveldb2
filer store, an insert replaces), and ``d/`` is gone from listings while ``d/x`` is there
(``weed`` 4.48: about 1 pair in 100 put at the same moment; a directory and its first
subdirectory made together, as DCP's ``step_N/`` and ``step_N/model/``, are such a pair).
Requests one after the other are safe: either the marker finds ``d`` and marks it, or the
write beneath finds the marked ``d``. On AWS, where ``d/`` and ``d/x`` are unrelated keys,
the gate only makes one short request wait for another.

Invariants:
- A marker request for ``d/`` and a request that creates an object strictly beneath it
  (``d/...``: a PutObject, a CompleteMultipartUpload, a CopyObject, a marker of a
  subdirectory) are never in flight at once through one ``MarkerGate``. Nothing else is
  kept apart: writes of unrelated keys, two writes beneath the same directory, and two
  puts of the same marker go at once.
- First come, first served: a request waits only for the ones that arrived before it and
  conflict with it, so a stream of writes beneath a directory cannot starve its marker and
  no two requests wait for each other.
- Requests of other processes (another node, another mount of the same store) are not
  seen: the gate narrows the race to writers on different nodes, it cannot close it.

Callers: ``S3Tier`` (s3.py), around each request that creates an entry; trio only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio


@dataclass(eq=False)
class _Request:
    key: str  # the full key; a marker's ends with "/"
    marker: bool
    done: trio.Event = field(default_factory=trio.Event)

    def conflicts(self, other: _Request) -> bool:
        return _beneath(other, self) or _beneath(self, other)


def _beneath(request: _Request, marker: _Request) -> bool:
    """``request`` writes strictly beneath the directory ``marker`` puts."""
    return marker.marker and request.key != marker.key and request.key.startswith(marker.key)


class MarkerGate:
    def __init__(self) -> None:
        self._present: list[_Request] = []  # arrived and not done, in order of arrival

    @asynccontextmanager
    async def creating(self, key: str) -> AsyncIterator[None]:
        """Around one request that creates ``key`` (a full key; ``d/`` is a directory
        marker): returns once no earlier conflicting request is in flight or waiting."""
        me = _Request(key, key.endswith("/"))
        ahead = [r for r in self._present if r.conflicts(me)]
        self._present.append(me)
        try:
            for request in ahead:
                await request.done.wait()
            yield
        finally:
            self._present.remove(me)
            me.done.set()

