"""Many nodes, one store: what a node does about what other nodes did to the objects it wrote.

Any node may delete, rename or overwrite any node's files. Each node holds local copies of
the files it wrote; when one of those objects is missing from the store, the store alone
cannot say why (another node deleted it, moved it, or the store lost it). This module keeps
the records that say, and makes the decision from them, by version, never by clocks.

**Stamps.** Every object a node uploads carries a *stamp* in its metadata: the node's id, a
token of its mount run and the row's version (journal.py ``next_version``), ``"<node>:<run>.<n>"``.
A stamp names one version of one file's bytes as written by one node: two uploads of different
bytes never share a stamp (versions only grow within a run; a new run has a new token), and a
server-side copy keeps it. The journal keeps the stamp of each row's committed object
(``Row.stamp``).

**Records.** A node that deletes or moves away an object stamped by *another* node first
writes a record for that version, addressed to its writer::

    .ckptfs/fates/<writer>/<run>.<n>/<quoted key> = {"fate": "deleted" | "moved",
                                                     "key": ..., "to": ..., "by": ...}

(journal first, then the record, then the store operation: a crash between them leaves a record
of something that did not happen yet, which is harmless, since the writer acts on a record only
when its object is gone). Deletions and moves are pinned to the version they apply to
(``Tier.delete``/``Tier.copy`` with ``if_etag``), so a newer version written in between is
never taken.

**The decision** (``judge``): when a node finds an object it wrote, committed and still holds
locally missing at its key, it looks for a record naming exactly that version at that key:

- ``DELETED``: the version was deleted by another node (an ``rm`` of rank 0, a rotation,
  retention's removal): the local copy and the entry go too;
- ``MOVED``: another node renamed it (a tmp-dir commit): the entry under the old name goes,
  the data lives on under the new name, which a listing of that directory shows;
- ``LOST``: nothing accounts for it (the store lost it, or a deletion raced a new upload):
  the local copy is uploaded again. A node never drops data on the word of a listing alone.

An object that is *different* at the key (a new version by another node) needs no record: the
new version is itself the evidence, and listing.py takes it.

**Garbage.** A node reads its own mailbox (``mailbox``) when a listing finds its objects
missing and on a slow period (listing.py ``apply_records``), applies what concerns a row it
still holds and deletes each record once done with it. Records addressed to a node that is not
registered are deleted by retention's whole-store rounds once older than ``RECORD_MAX_AGE``
(``collect_garbage``; the one use of a wall clock here, and only for garbage: a node back after
that long with local copies of versions deleted meanwhile uploads them again, as if nothing had
recorded their deletion).

Interleavings (tests/test_peer_renames.py, tests/test_model_nodes.py):
- record put, then a crash before the deletion: the writer still finds its object, does
  nothing; the deleting node's tombstone is replayed and deletes it;
- a deletion pinned to version v while the writer uploads v+1: the pinned delete fails
  (``PreconditionFailed``) and v+1 stays; without a conditional delete, the HEAD-then-delete
  may take v+1 in its instant: its writer finds no record for v+1 and uploads it again;
- a record for a version the writer no longer holds (rewritten, evicted, removed): deleted
  unread at its next scan.
"""

from __future__ import annotations

import enum
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote

from ckptfs.errors import StoreUnavailable
from ckptfs.state.journal import Row
from ckptfs.store.tiers.base import (
    CONTROL_PREFIX,
    ObjectMissing,
    PreconditionFailed,
    Tier,
    TierError,
)

log = logging.getLogger(__name__)

FATES = CONTROL_PREFIX + "fates/"
# Records addressed to a node that is not registered are deleted after this long (seconds).
RECORD_MAX_AGE = 30 * 86400.0


class Verdict(enum.Enum):
    DELETED = "deleted"
    MOVED = "moved"
    LOST = "lost"


@dataclass(frozen=True)
class Record:
    """What another node did to one version of ours (the stamp) at one key."""

    stamp: str
    key: str
    fate: Verdict
    to: str | None = None
    by: str | None = None
    at: float | None = None
    path: str = ""  # the record's own key in the store


def writer_of(stamp: str | None) -> str | None:
    """The node that wrote the version ``stamp`` names."""
    if not stamp or ":" not in stamp:
        return None
    return stamp.rpartition(":")[0]


def version_of(stamp: str | None) -> int | None:
    """The version number (within its writer's run) that ``stamp`` names."""
    tail = (stamp or "").rpartition(":")[2].rpartition(".")[2]
    return int(tail) if tail.isdigit() else None


def record_key(stamp: str, key: str) -> str:
    writer, _, version = stamp.rpartition(":")
    return f"{FATES}{quote(writer, safe='')}/{quote(version, safe='')}/{quote(key, safe='')}"


def mailbox_of(node: str) -> str:
    return f"{FATES}{quote(node, safe='')}/"


def _parse_path(path: str) -> tuple[str, str] | None:
    """(stamp, key) of a record's own key, or None if it is not one."""
    parts = path[len(FATES):].split("/")
    if len(parts) != 3 or not all(parts):
        return None
    writer, version, key = (unquote(p) for p in parts)
    return f"{writer}:{version}", key


class Peers:
    """One per mount: stamps this node's uploads, records what it does to other nodes'
    versions, and judges what happened to its own."""

    def __init__(self, tier: Tier, node: str = "local",
                 wall: Callable[[], float] = time.time) -> None:
        self.tier = tier
        self.node = node
        self.run = secrets.token_hex(4)
        self._wall = wall
        self.records_written = 0
        self.records_read = 0

    # -- stamps -----------------------------------------------------------------------------

    def stamp(self, version: int) -> str:
        """The stamp of this node's upload of a row at ``version``."""
        return f"{self.node}:{self.run}.{version}"

    def foreign(self, stamp: str | None) -> bool:
        """Whether ``stamp`` names a version another node wrote."""
        writer = writer_of(stamp)
        return writer is not None and writer != self.node

    def own(self, stamp: str | None) -> bool:
        return writer_of(stamp) == self.node

    # -- the acting side --------------------------------------------------------------------

    async def record(self, stamp: str | None, key: str, fate: Verdict,
                     to: str | None = None) -> None:
        """Tell the writer of ``stamp`` what this node is about to do to it at ``key``
        (nothing for this node's own versions, nor for objects with no stamp)."""
        if not self.foreign(stamp) or key.startswith(CONTROL_PREFIX):
            return  # ours, written by another tool, or a parking key nobody holds
        assert stamp is not None
        body = {"fate": fate.value, "key": key, "by": self.node, "at": self._wall()}
        if to is not None:
            body["to"] = to
        await self.tier.put_small(record_key(stamp, key), json.dumps(body).encode())
        self.records_written += 1

    async def delete(self, key: str, *, stamp: str | None = None, etag: str | None = None,
                     moved_to: str | None = None, exact: bool = False) -> bool:
        """Delete the version of ``key`` that ``stamp`` and ``etag`` name, after recording it
        for its writer (as moved to ``moved_to`` if that is where it was copied). This
        node's own versions need no record; one named by its tag is deleted only while the
        store holds a version of this node there (another node may have replaced it since:
        its upload started before this node's removal and landed after, and the job's
        removal of it is the directory's sweep, which lists after the barrier). A directory
        marker is deleted whatever its version (its writer told). With no version named,
        what is there is read first, and treated as named. ``exact``: one of this node's own
        versions is deleted only by its tag (a row of this node holds another version at the
        key; the caller names the tag). Returns whether a version was deleted (False: gone
        already, or another version is there now, which stays)."""
        if key.endswith("/"):
            # A directory marker: its writer is told too (a power loss may make it forget
            # that it put it: listing.py ``removed_dir_forgotten``). Its version is not
            # pinned: a marker put again meanwhile says the same (the directory exists).
            if stamp is None:
                try:
                    stamp = (await self.tier.head(key)).meta.stamp
                except ObjectMissing:
                    return False
            await self.record(stamp, key, Verdict.MOVED if moved_to else Verdict.DELETED,
                              to=moved_to)
            await self.tier.delete(key)
            return True
        if self.own(stamp) and not exact and etag is None:
            await self.tier.delete(key)
            return True
        if self.own(stamp):
            # No record to leave, but only that version.
            try:
                await self.tier.delete(key, if_etag=etag)
                return True
            except ObjectMissing:
                return False
            except PreconditionFailed:
                if exact:
                    # The version this node's row holds there is another node's (keys.py
                    # ``may_delete``): it stays.
                    log.info("%s: not deleted: the store holds another version than %s now",
                             key, stamp)
                    return False
            # Another tag: a version of ours under a tag this node did not keep, or another
            # node's. Only the first is this node's to delete.
            try:
                info = await self.tier.head(key)
            except ObjectMissing:
                return False
            if self.foreign(info.meta.stamp):
                log.info("%s: not deleted: node %s replaced this node's version since", key,
                         writer_of(info.meta.stamp))
                return False
            try:
                await self.tier.delete(key, if_etag=info.etag)
            except (PreconditionFailed, ObjectMissing):
                return False
            return True
        if etag is None or stamp is None:
            try:
                info = await self.tier.head(key)
            except ObjectMissing:
                return False
            stamp, etag = info.meta.stamp, info.etag
            if not self.foreign(stamp):
                await self.tier.delete(key)  # ours, or written by another tool: no record
                return True
        await self.record(stamp, key, Verdict.MOVED if moved_to else Verdict.DELETED,
                          to=moved_to)
        try:
            await self.tier.delete(key, if_etag=etag)
        except PreconditionFailed:
            log.info("%s: not deleted: the store holds another version than %s now", key,
                     stamp or etag)
            return False
        except ObjectMissing:
            return False
        return True

    # -- the deciding side ------------------------------------------------------------------

    async def mailbox(self) -> list[Record]:
        """The records other nodes left for this node's versions (bodies read)."""
        infos = await self.tier.list(mailbox_of(self.node))
        found: list[Record] = []
        for info in infos:
            if info.key.endswith("/"):
                continue
            record = await self._read(info.key)
            if record is not None:
                found.append(record)
        return found

    async def _read(self, path: str) -> Record | None:
        parsed = _parse_path(path)
        if parsed is None:
            return None
        stamp, key = parsed
        try:
            body, _ = await self.tier.get_small(path)
            value = json.loads(body)
            fate = Verdict(value["fate"])
        except ObjectMissing:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("record %s is unreadable (%s): ignored", path, exc)
            return Record(stamp, key, Verdict.LOST, path=path)  # dropped, never followed
        self.records_read += 1
        to = value.get("to") if isinstance(value.get("to"), str) else None
        at = value.get("at") if isinstance(value.get("at"), (int, float)) else None
        by = value.get("by") if isinstance(value.get("by"), str) else None
        return Record(stamp, key, fate, to, by, at, path)

    async def judge(self, lost: dict[str, Row]) -> tuple[dict[str, Verdict], list[Record]]:
        """Why each of ``lost`` (key -> a row written here, committed, holding a local copy,
        whose object this node's listing no longer finds) is missing: a verdict per key,
        and the records used (the caller deletes them once it acted)."""
        if not lost:
            return {}, []
        try:
            records = {(r.stamp, r.key): r for r in await self.mailbox()}
        except (StoreUnavailable, TierError) as exc:
            # Not knowing is no reason to act: the next listing judges again.
            log.info("cannot read the records of this node (%s): judging later", exc)
            return {}, []
        verdicts: dict[str, Verdict] = {}
        used: list[Record] = []
        for key, row in lost.items():
            record = records.get((row.stamp or "", key)) if row.stamp else None
            if record is None or record.fate is Verdict.LOST:
                verdicts[key] = Verdict.LOST
                continue
            verdicts[key] = record.fate
            used.append(record)
            log.info("%s: %s by node %s%s; local copy dropped", key, record.fate.value,
                     record.by or "?", f" to {record.to}" if record.to else "")
        return verdicts, used

    async def replaced(self, rows: dict[str, Row],
                       later: Iterable[str] = ()) -> dict[str, Record]:
        """Of ``rows`` (key -> a file of this node that came back incomplete after a power
        loss while the store holds another node's version at its key, or nothing), those
        whose version another node replaced, deleted or moved: the rolled-back journal
        forgot that it was committed, but a record names it (this node, that version number,
        an earlier run). What the store holds then came after it in the job's order, and is
        the file (or its absence is). For the keys in ``later``, a record of a later version
        of an earlier run counts too (a version the rolled-back journal forgot)."""
        if not rows:
            return {}
        try:
            records = await self.mailbox()
        except (StoreUnavailable, TierError) as exc:
            log.info("cannot read the records of this node (%s): deciding later", exc)
            return {}
        later = set(later)
        found: dict[str, Record] = {}
        for record in records:
            row = rows.get(record.key)
            version = version_of(record.stamp)
            if row is None or record.fate is Verdict.LOST or version is None:
                continue
            if version == row.version or (record.key in later and version > row.version
                                          and not self.this_run(record.stamp)):
                found[record.key] = record
        return found

    def this_run(self, stamp: str | None) -> bool:
        """Whether ``stamp`` names a version this run of this node wrote."""
        return (stamp or "").rpartition(".")[0] == f"{self.node}:{self.run}"

    async def drop(self, records: Iterable[Record]) -> None:
        """Delete records this node is done with (best effort: a leftover is read again)."""
        for record in records:
            try:
                await self.tier.delete(record.path)
            except (StoreUnavailable, TierError) as exc:
                log.info("cannot delete record %s: %s", record.path, exc)
                return

    async def collect_garbage(self, registered: set[str], now: float | None = None) -> int:
        """Delete records addressed to nodes not registered, older than RECORD_MAX_AGE
        (retention's whole-store round calls this); returns how many went."""
        now = self._wall() if now is None else now
        removed = 0
        for info in await self.tier.list(FATES):
            parsed = _parse_path(info.key)
            if parsed is None or writer_of(parsed[0]) in registered:
                continue
            record = await self._read(info.key)
            if record is None or (record.at is not None and now - record.at < RECORD_MAX_AGE):
                continue
            await self.tier.delete(info.key)
            removed += 1
        return removed
