"""What a node does about what other nodes did to the keys it wrote.

listing.py merges a listing into the journal; when the listing misses a file this node wrote,
committed and still holds a local copy of, the store alone cannot say why. This module
decides, from records the nodes leave under the control prefix:

- ``RETIRED``: retention (on whichever node held its lease) deleted the checkpoint, or moved
  it to a colder tier, after this copy was committed (``.ckptfs/retired/<path>``,
  coordination.py): the local copy and its entry go, or they would bring back shards
  without their marker.
- ``MOVED``: another node renamed it (a tmp-dir commit: rank 0 renames ``step_1.tmp`` to
  ``step_1`` with every node's shard in it). The renaming node writes a *move record*
  ``.ckptfs/moved/<old root>`` = ``{"to": <new root>, "at": <time>}`` before it deletes any
  old key of the move; the key is followed if the record is newer than this node's commit
  and the object at the new key holds the same data (same CRC32C; a directory: its marker is
  there). The local entry goes (its data lives on under the new name, which a listing of
  that directory shows); it is never uploaded again under the old name.
- ``LOST``: anything else (the store lost the object, or another node deleted what this node
  still holds): the local copy is uploaded again. A node never drops data on the word of a
  listing alone.

The roots of a move are its keys with their common trailing components stripped
(``step_1.tmp/model/shard_3`` -> ``step_1/model/shard_3`` gives ``step_1.tmp`` -> ``step_1``),
so one record covers every file of a directory rename. A record is rewritten when a file is
moved that was committed after the record was written.

Limits: a record is followed one hop per listing (a file renamed twice by other nodes is
followed as each listing finds it); a shard uploaded under the old name after the rename
(another node still writing into ``step_1.tmp`` when rank 0 renamed it) is not followed and
stays under the old name; see docs/SEMANTICS.md, "Renames by another node".
"""

from __future__ import annotations

import enum
import json
import logging
import math
import time
from collections.abc import Callable
from urllib.parse import quote

from ckptfs.coordination import retired_key, retired_paths
from ckptfs.errors import StoreUnavailable
from ckptfs.journal import Row
from ckptfs.tiers.base import CONTROL_PREFIX, ObjectMissing, Tier, TierError

log = logging.getLogger(__name__)

MOVED = CONTROL_PREFIX + "moved/"


class Verdict(enum.Enum):
    RETIRED = "retired"
    MOVED = "moved"
    LOST = "lost"


def moved_key(root: str) -> str:
    """The move record of a path (one key, whatever the depth: no file/directory clash on a
    file tier between the records of ``a`` and ``a/b``)."""
    return MOVED + quote(root.strip("/"), safe="")


def move_roots(old_key: str, new_key: str) -> tuple[str, str]:
    """The renamed paths behind a move of ``old_key`` to ``new_key``."""
    old, new = old_key.rstrip("/").split("/"), new_key.rstrip("/").split("/")
    while len(old) > 1 and len(new) > 1 and old[-1] == new[-1]:
        old.pop()
        new.pop()
    return "/".join(old), "/".join(new)


class MoveRecorder:
    """The renaming side: writes move records before the old keys of a move are deleted."""

    def __init__(self, tier: Tier, clock: Callable[[], float] = time.time) -> None:
        self.tier = tier
        self._clock = clock
        self._written: dict[tuple[str, str], float] = {}  # (old root, new root) -> its "at"

    async def moved(self, old_key: str, new_key: str, committed_at: float | None) -> None:
        """``old_key`` was copied to ``new_key`` and is about to be deleted."""
        if old_key.startswith(CONTROL_PREFIX) or new_key.startswith(CONTROL_PREFIX):
            return  # a parking move (keys.py): not a rename anyone made
        roots = move_roots(old_key, new_key)
        if self._written.get(roots, -math.inf) > (committed_at or 0.0):
            return  # the record already covers files committed this early
        at = self._clock()
        body = json.dumps({"to": roots[1], "at": at}).encode()
        await self.tier.put_small(moved_key(roots[0]), body)
        self._written[roots] = at
        if len(self._written) > 4096:
            self._written.pop(next(iter(self._written)))


class PeerJudge:
    """The listing side: why a key this node wrote is missing from the store."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    async def judge(self, lost: dict[str, Row]) -> dict[str, Verdict]:
        """A verdict for each missing key (its row: written here, committed, local copy)."""
        if not lost:
            return {}
        retired = await self._records(retired_key, lost)
        moved = await self._records(moved_key, lost)
        verdicts: dict[str, Verdict] = {}
        for key, row in lost.items():
            committed = row.committed_at or 0.0
            if any(_at(retired.get(p)) > committed for p in retired_paths(key)):
                verdicts[key] = Verdict.RETIRED
            elif await self._followed(key, row, moved):
                verdicts[key] = Verdict.MOVED
            else:
                verdicts[key] = Verdict.LOST
        return verdicts

    async def _followed(self, key: str, row: Row, moved: dict[str, dict[str, object]]) -> bool:
        """Whether a move record newer than ``row``'s commit leads to a copy of its data."""
        committed = row.committed_at or 0.0
        for root in reversed(retired_paths(key)):  # the deepest record first
            record = moved.get(root)
            if record is None:
                continue
            at, to = _at(record), record.get("to")
            if not isinstance(to, str) or at <= committed:
                continue
            new_key = to + key.rstrip("/")[len(root):] + ("/" if key.endswith("/") else "")
            try:
                info = await self.tier.head(new_key)
            except ObjectMissing:
                continue
            except (StoreUnavailable, TierError) as exc:
                log.info("cannot check %s (moved from %s): %s", new_key, key, exc)
                continue
            directory = key.endswith("/")  # its marker: it has no data to compare
            if directory or (row.checksum is not None and info.meta.checksum == row.checksum
                             and info.size == row.size):
                log.info("%s: renamed to %s by another node; local entry dropped", key, new_key)
                return True
        return False

    async def _records(self, record_key: Callable[[str], str],
                       lost: dict[str, Row]) -> dict[str, dict[str, object]]:
        """The record of each path covering one of the lost keys that has one."""
        found: dict[str, dict[str, object]] = {}
        for path in sorted({p for key in lost for p in retired_paths(key)}):
            try:
                body, _ = await self.tier.get_small(record_key(path))
                record = json.loads(body)
            except ObjectMissing:
                continue
            except (StoreUnavailable, TierError, ValueError) as exc:
                log.info("record %s unreadable (%s): keeping the copy", record_key(path), exc)
                continue
            if isinstance(record, dict):
                found[path] = record
        return found


def _at(record: dict[str, object] | None) -> float:
    """A record's time ("at"), or -inf if there is none or it is not a number."""
    value = None if record is None else record.get("at")
    return float(value) if isinstance(value, (int, float)) else -math.inf
