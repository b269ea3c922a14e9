"""Who may touch which key of the warm tier, and when: one owner for every store key.

A key of the store belongs to exactly one of these at a time:

- the live inode whose committed copy it holds (journal ``remote_key``): its *owner*;
- a work item in flight (upload.py): an upload or a directory marker put (its target key), a
  server-side move (its source AND its target key), a deletion (its key). In-flight claims
  exclude each other: no two items touch one key at once;
- a pending deletion (a tombstone), which never deletes a key that has an owner by the time
  it runs, and which an upload to the key supersedes;
- a key hidden by ``unlink = "local-only"``: kept in the store for retention, not shown, and
  never deleted by this node.

The rules that follow (docs/SEMANTICS.md, "Store keys"):

1. **A copy waits for the key it would overwrite.** An upload or a move to key K waits while
   K is owned by another file whose own move is still to come (it was renamed away from K:
   ``mv ckpt ckpt.prev; mv ckpt.new ckpt``). Overwriting K first would destroy the only copy
   the pending move has to take away. A file that is going to be uploaded again from its
   local copy does not need its old object, so it holds nobody back.
2. **Cycles are broken by parking.** Moves that wait for each other in a ring (a directory
   exchange, ``mv a t; mv b a; mv t b`` of evicted files) would wait forever: one of them is
   first moved to a parking key of its own (``PARKING_PREFIX``, under the nodes' control
   prefix, never listed as an entry), which frees its old key; from there it moves to its
   path like any other move, and the parked copy is retired. A commit marker moving away
   from a key that an earlier item waits for is parked the same way (as a marker it would
   wait for that item in turn); parking publishes nothing, so it needs no order.
3. **Copies are pinned**: a move copies its source only if the source still holds the
   version the journal recorded (the caller passes the tag it just checked to
   ``Tier.copy(..., if_etag=...)``), so another node's write between the check and the copy
   makes the move fail and retry instead of copying the wrong bytes.
4. **A listing never takes a claimed key for a new entry** (``listing_skip``): a key that is
   tombstoned, was deleted while the listing was on its way, is hidden, or is held by an
   inode that is not (any more) the entry of that name.

Invariants: claims live in memory only; after a restart the journal (``uploading_key``,
tombstones, ``remote_key``) is the whole truth, and ``Uploader.requeue_from_journal`` rebuilds
the work from it. A parking key is journalled as ``uploading_key`` before the copy starts and
as ``remote_key`` once it holds the file, so a crash at any step leaves either the old key
owned (the parked copy is then a leftover, retired at restart) or the parked key owned.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Hashable, Iterable

from ckptfs.errors import NotFound
from ckptfs.journal import Journal, Row, State
from ckptfs.namespace import Namespace
from ckptfs.tiers.base import CONTROL_PREFIX

PARKING_PREFIX = CONTROL_PREFIX + "parked/"


class KeyClaims:
    """Claims on store keys for one mount (see the module docstring for the rules)."""

    def __init__(self, journal: Journal, ns: Namespace) -> None:
        self.journal = journal
        self.ns = ns
        self._by_key: dict[str, Hashable] = {}
        self._by_holder: dict[Hashable, tuple[str, ...]] = {}
        # Parking keys are per mount run: two nodes (or two runs of one node's staging
        # directory, inode numbers reused) never park at the same key.
        self.token = secrets.token_hex(6)

    # -- in-flight claims (rule: no two items on one key) ------------------------------------

    def busy(self, keys: Iterable[str | None]) -> bool:
        return any(k is not None and k in self._by_key for k in keys)

    def claim(self, holder: Hashable, keys: Iterable[str | None]) -> None:
        held = tuple(k for k in keys if k is not None)
        assert not self.busy(held), f"{held} claimed twice"
        for key in held:
            self._by_key[key] = holder
        self._by_holder[holder] = held

    def release(self, holder: Hashable) -> None:
        for key in self._by_holder.pop(holder, ()):
            del self._by_key[key]

    def claimed(self) -> set[str]:
        return set(self._by_key)

    # -- owners ------------------------------------------------------------------------------

    def key_of(self, row: Row) -> str | None:
        """The key ``row`` belongs at (its path; directories end in "/"), None if unlinked."""
        path = self.journal.path_of(row.ino)
        if not path:
            return None
        return os.fsdecode(path) + ("/" if stat.S_ISDIR(row.mode) else "")

    @staticmethod
    def is_move(row: Row, key: str | None) -> bool:
        """Whether bringing ``row`` to ``key`` is a server-side move of its committed copy."""
        return (stat.S_ISREG(row.mode) and row.state in (State.COMMITTED, State.REMOTE)
                and not row.incomplete and row.remote_key is not None
                and key is not None and row.remote_key != key)

    def mover_at(self, key: str, but: int) -> Row | None:
        """A file other than ``but`` whose committed copy is at ``key`` and still has to be
        moved away from it (rule 1: whoever writes ``key`` waits for it)."""
        for ino in self.journal.holders_of(key):
            if ino == but:
                continue
            try:
                row = self.ns.get(ino)
            except NotFound:
                continue
            if self.is_move(row, self.key_of(row)):
                return row
        return None

    def blocker(self, row: Row, key: str) -> tuple[Row | None, bool]:
        """What writing ``row`` to ``key`` waits for: the mover at ``key`` (or None), and
        whether the waits lead back to ``row`` (a cycle: rule 2, park ``row``)."""
        first = self.mover_at(key, row.ino)
        if first is None:
            return None, False
        seen = {row.ino}
        cursor: Row | None = first
        while cursor is not None and cursor.ino not in seen:
            seen.add(cursor.ino)
            target = self.key_of(cursor)
            if target is None:
                break
            cursor = self.mover_at(target, cursor.ino)
            if cursor is not None and cursor.ino == row.ino:
                return first, self.is_move(row, key)
        return first, False

    def parking_key(self, ino: int) -> str:
        return f"{PARKING_PREFIX}{self.token}/{ino}"

    # -- deletions ---------------------------------------------------------------------------

    def may_delete(self, key: str) -> bool:
        """Whether a tombstone of ``key`` may delete it now: no live inode owns it (a file
        committed there since, by a rename over it or an exchange) and it is not hidden."""
        return self.journal.holder_of(key) is None and not self.journal.is_hidden(key)

    def keep_unowned(self, key: str) -> bool:
        """An entry removed while its copy was being written to ``key``: whether that copy
        stays (``unlink = "local-only"`` hid the key for retention) instead of being retired."""
        return self.journal.is_hidden(key)

    # -- listings ----------------------------------------------------------------------------

    def listing_skip(self, prefix: str, mark: int, local: dict[bytes, Row]) -> set[str]:
        """Keys under ``prefix`` a listing must not map as entries (rule 4). ``local`` is the
        directory's entries by name, read after the listing came back; ``mark`` is the
        listing's ``Journal.listing_started`` mark."""
        skip = (self.journal.hidden_under(prefix) | self.journal.tombstoned_under(prefix)
                | self.journal.tombstoned_since(prefix, mark))
        for key, ino in self.journal.claimed_under(prefix).items():
            held = local.get(os.fsencode(key[len(prefix):].removesuffix("/")))
            if held is None or held.ino != ino:
                skip.add(key)  # the key of an entry moving away from it, not a new entry
        return skip
