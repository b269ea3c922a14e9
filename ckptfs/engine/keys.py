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

The rules that follow (docs/DESIGN.md, "Store keys"; what users get: docs/SEMANTICS.md,
"Store keys"):

1. **A copy waits for the key it would overwrite.** An upload or a move to key K waits while
   K is owned by another file whose own move is still to come (it was renamed away from K:
   ``mv ckpt ckpt.prev; mv ckpt.new ckpt``). Overwriting K first would destroy the only copy
   the pending move has to take away. A file that is going to be uploaded again from its
   local copy does not need its old object, so it holds nobody back. A symlink's or special
   file's put waits the same way (``ln -s x ckpt`` after ``mv ckpt ckpt.prev``); it never
   moves, so no ring goes through it.
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

5. **A directory is deleted only when nothing is on its way beneath it.** A file tier (and
   only it) holds a directory wherever it holds a key beneath it: a put or copy to ``d/x``
   creates ``d`` again if it is gone. So the deletion of a directory key ``d/`` waits while
   any item in flight claims a key beneath it, and no item starts on a key beneath ``d/``
   while its deletion is in flight. Without it: ``rm d/x; rmdir d`` while ``d/x`` is
   uploading deletes ``d`` first, the upload puts ``d`` back, and the deletion of ``d/x``
   leaves an empty ``d`` that no tombstone names any more. The deletion of a directory that
   still has entries (their deletions or moves are queued) fails with ``NotEmptyYet`` and
   is retried at the next deletion (upload.py): an ordering wait, not a store outage.

6. **A moved directory's old key is retired even if its marker never got there.** On a file
   tier a directory exists once anything was put beneath it, whether or not its own marker
   was put (a marker put that failed once and waits for its retry, or that is still queued).
   A rename of such a directory (or of a directory above it) moves the entries beneath and
   puts the marker at the new key, but the old directory would stay, empty, with no
   tombstone: the rename itself tombstones the old keys of the moved directories that no
   marker put will retire (``directory_keys`` before, ``left_behind`` after, in the rename's
   transaction). In an exchange the keys one tree leaves and the other takes are kept. The
   deletion waits for the entries to move away (rule 5, ``NotEmptyYet``); on an object
   store it deletes a key that is usually absent; a key a live directory has since been
   committed to is kept (``may_delete``), and a marker put to it drops the tombstone.

7. **A file and a directory of one name are one place.** A file tier keeps the object ``d``
   and the directory ``d/`` (needed by ``d/`` itself and by every key beneath it) at one
   path: putting the directory's marker replaces a file ``d`` (tiers/local.py
   ``_make_directory``), and a file ``d`` cannot be published while ``d/`` holds entries.
   So rule 1's wait looks at those keys too: whoever writes ``d/`` or ``d/x`` waits for a
   file still to move away from ``d`` (``mv d t; mkdir d`` of an evicted file: the marker
   would delete the only copy before the move took it). And a move whose source and target
   nest (``mv d/x t; rmdir d; mv t d``, or ``mv d t; mkdir d; mv t d/x``) parks first, as a
   ring does (rule 2): its own source is in its way, and it would be retried forever. On an
   object store these keys do not collide; the wait and the extra copy are harmless there
   and these renames rare. Items in flight on ``d`` and ``d/`` exclude each other too
   (``busy_around``): else ``rm d; mkdir d`` while the file ``d`` is uploading puts the
   directory at once, the file's put replaces it, the file's deletion removes that, and the
   store holds no ``d`` at all (a remount then drops the directory from the mount too).

Interleavings of rules 5 and 6 (tests/test_store_dirs.py, over a memory tier that keeps a
file tier's directories):

- ``rm d/x; rmdir d`` while ``d/x`` is uploading: the deletion of ``d/`` waits for the
  upload, then for the deletion of ``d/x`` (rule 5);
- a child's deletion fails (a transient error) and its parents' deletions run meanwhile:
  ``NotEmptyYet`` each, no outage, all retried once the child is gone;
- a directory renamed (or exchanged) while its marker and its subdirectories' markers wait
  for a retry, after a file beneath was put: the old keys are tombstoned by the rename; a
  new directory made at the old name at once keeps its key (its marker put drops the
  tombstone, or, committed first, ``may_delete`` keeps it);
- a crash after the rename: the tombstones are in its transaction, replayed at start; the
  deletion is retried until the replayed moves have emptied the directory;
- a crash before the rename's transaction: nothing changed, nothing to delete;
- another node's file beneath the old directory (a shard closed into ``step.tmp/`` before
  the rename): on a file tier the directory's deletion fails (``NotEmptyYet``) until the
  sweep (upload.py ``_sweep``) has moved the file; a directory's tombstone deletes a
  directory key, never a file, and on an object store only the marker object.

Interleavings of rule 7 (tests/test_store_dirs.py): ``mv d t; mkdir d`` while the move of
the evicted ``d`` fails once (the marker put waits for the retried move); the two nesting
renames, the first move failing once so that one move is left whose source is in its way
(parked, then moved on); a crash after the park is journalled replays it as for a ring. Not
covered: another node writing ``d/`` while this node moves a file away from ``d`` (claims are
per node; the cross-node order is that of markers and sweeps, upload.py).

Directory renames and removals (upload.py ``_sweep``): no move out of a renamed directory's
old prefix, and no upload, put or move into a renamed or removed directory's old prefix,
starts before its sweep has run (after a barrier): the sweep moves or deletes everything
there, this node's files and other nodes' alike, and claims each new key while it copies.

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
from collections.abc import Hashable, Iterable, Iterator

from ckptfs.errors import NotFound
from ckptfs.state.journal import Journal, Row, State
from ckptfs.state.namespace import Namespace
from ckptfs.store.tiers.base import CONTROL_PREFIX

PARKING_PREFIX = CONTROL_PREFIX + "parked/"


def _ancestors(key: str) -> Iterator[str]:
    """The directory keys above ``key``: "a/", "a/b/" for "a/b/c" (and for "a/b/c/")."""
    end = key.find("/")
    while 0 <= end < len(key.rstrip("/")):
        yield key[:end + 1]
        end = key.find("/", end + 1)


def _same_place(key: str) -> Iterator[str]:
    """``key``, then the file keys a file tier keeps where ``key`` needs a directory: "a"
    and "a/b" for "a/b/c"; "a" for "a/" (a file and a directory cannot share a name)."""
    yield key
    for parent in _ancestors(key):
        yield parent.rstrip("/")
    if key.endswith("/"):
        yield key.rstrip("/")


def _twin(key: str) -> str:
    """The key at the same path of a file tier: ``d/`` for ``d``, and ``d`` for ``d/``."""
    return key[:-1] if key.endswith("/") else key + "/"


class KeyClaims:
    """Claims on store keys for one mount (see the module docstring for the rules)."""

    def __init__(self, journal: Journal, ns: Namespace) -> None:
        self.journal = journal
        self.ns = ns
        self._by_key: dict[str, Hashable] = {}
        self._by_holder: dict[Hashable, tuple[str, ...]] = {}
        # Directory keys ("x/") whose deletion is in flight (rule 5).
        self._deleting: set[str] = set()
        # Parking keys are per mount run: two nodes (or two runs of one node's staging
        # directory, inode numbers reused) never park at the same key.
        self.token = secrets.token_hex(6)

    # -- in-flight claims (rule: no two items on one key) ------------------------------------

    def busy(self, keys: Iterable[str | None]) -> bool:
        """Whether one of ``keys`` itself is claimed by an item in flight."""
        return any(k is not None and k in self._by_key for k in keys)

    def busy_around(self, keys: Iterable[str | None], *, deletion: bool = False) -> bool:
        """Whether an item on ``keys`` must wait for one in flight: a claim on one of them,
        or rule 5 (a ``deletion`` of a directory key waits for every claim beneath it, and
        nothing is written or deleted beneath a directory whose deletion is in flight)."""
        for key in keys:
            if key is None:
                continue
            if key in self._by_key or _twin(key) in self._by_key:
                return True
            if deletion and key.endswith("/") and any(k.startswith(key) for k in self._by_key):
                return True
            if self._deleting and any(d in self._deleting for d in _ancestors(key)):
                return True
        return False

    def claim(self, holder: Hashable, keys: Iterable[str | None], *,
              deletion: bool = False) -> None:
        held = tuple(k for k in keys if k is not None)
        assert not self.busy_around(held, deletion=deletion), f"{held} claimed twice"
        for key in held:
            self._by_key[key] = holder
            if deletion and key.endswith("/"):
                self._deleting.add(key)
        self._by_holder[holder] = held

    def release(self, holder: Hashable) -> None:
        for key in self._by_holder.pop(holder, ()):
            del self._by_key[key]
            self._deleting.discard(key)

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
        """A file other than ``but`` whose committed copy is at ``key``, or at a key a file
        tier keeps in the same place as a directory ``key`` needs (rule 7), and still has to
        be moved away from it (rule 1: whoever writes ``key`` waits for it)."""
        for place in _same_place(key):
            for ino in self.journal.holders_of(place):
                if ino == but:
                    continue
                try:
                    row = self.ns.get(ino)
                except NotFound:
                    continue
                if self.is_move(row, self.key_of(row)):
                    return row
        return None

    @staticmethod
    def nested(target: str, source: str | None) -> bool:
        """Whether a move from ``source`` to ``target`` must park first (rule 7): one key is
        the other's directory, so on a file tier the move's own source is in its way."""
        if source is None:
            return False
        return (source.startswith(target.rstrip("/") + "/")
                or target.startswith(source.rstrip("/") + "/"))

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

    # -- directories that move (rule 6) -------------------------------------------------------

    def directory_keys(self, tops: Iterable[Row]) -> dict[int, str]:
        """Before a rename: every directory of the trees under ``tops`` (themselves included)
        -> its key now. Handed to ``left_behind`` once the rename is in the journal."""
        keys: dict[int, str] = {}
        for top in tops:
            for ino in [top.ino, *self.journal.directories_under(top.ino)]:
                try:
                    row = self.ns.get(ino)
                except NotFound:
                    continue
                key = self.key_of(row)
                if key is not None and stat.S_ISDIR(row.mode):
                    keys[ino] = key
        return keys

    def left_behind(self, before: dict[int, str]) -> list[str]:
        """After the rename: the old keys of the moved directories that no moved directory
        takes (in an exchange, one tree's old keys are partly the other's new ones) and that
        no put will retire (the directory's marker is not at its old key: never put, or put
        at a key it has left since). On a file tier such a directory exists all the same, as
        soon as something was put beneath it; nothing else would ever delete it."""
        rows = {}
        for ino in before:
            try:
                rows[ino] = self.ns.get(ino)
            except NotFound:
                continue
        taken = {self.key_of(row) for row in rows.values()}
        return sorted(old for ino, old in before.items()
                      if ino in rows and old not in taken and rows[ino].remote_key != old)

    # -- deletions ---------------------------------------------------------------------------

    def may_delete(self, key: str, stamp: str | None = None) -> bool:
        """Whether a tombstone of ``key`` may delete it now: it is not hidden, and no live
        inode owns the version it names (a file committed there since, by a rename over it
        or an exchange). A tombstone pinned to one version (``stamp``: the deletion is
        conditional on it, peers.py) is not held back by a row that owns another version
        there: the row's version is gone already (this node's own upload replaced it, and
        the row is on its way elsewhere), and the pinned one would stay forever."""
        if self.journal.is_hidden(key):
            return False
        for ino in self.journal.holders_of(key):
            row = self.journal.get(ino)
            if stamp is None or row is None or row.stamp is None or row.stamp == stamp:
                return False
        return True

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
