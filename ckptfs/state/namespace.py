"""Inodes and the directory tree, cached in memory over the journal.

The kernel refers to files by inode number and keeps a *lookup count* per inode (raised by
lookup/create/mkdir/symlink/readdirplus, lowered by forget). An inode it still knows must keep
answering getattr even after unlink, so an unlinked inode's row survives (detached, parent NULL)
until both its lookup count and its open count are zero.

Invariants:
- The ``Row`` objects handed out are the cached ones: mutate, then ``persist`` (write-through).
  The one exception is ``note_write``, which only updates size and mtime in memory; the owner
  of the open handle persists them at flush/fsync/release. So a write() never touches SQLite.
- A cached row stays cached while the kernel knows it (lookup > 0), it is open, or it is dirty.
- Names are bytes of 1-255 bytes with no '/' or NUL (the kernel checks this too).

Hard links (journal.py "Hard links", docs/DESIGN.md): a *name row* is the row of one
name (``entry``); the *kernel row* is the inode the kernel knows (``lookup``, ``kernel``): the
name row itself, or for an alias its head. The kernel never hears of an alias's ino.
- ``persist`` of a head writes its aliases in the same transaction, with the head's mode,
  owner, size, times and version mirrored: an alias is never seen with another version.
- Removing a name of a linked file never detaches the inode: an alias's row is deleted (the
  kernel holds no reference to it); the head's own name is handed the name of its first
  alias (*promotion*: the head takes that name, the alias row goes), so the kernel's inode
  lives on under the remaining names. ``succession`` says which alias, and whether the head
  also takes over that alias's committed object (*adopt*: both hold the same version, and
  nothing is on its way to either key) or is carried to its new key like a renamed file.
- ``_linked`` (head -> number of aliases) is the journal's, loaded at start and kept by the
  only writers of ``link_of``: ``link`` and the removals here.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from ckptfs.errors import (
    AlreadyExists,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
)
from ckptfs.state.journal import ROOT_INODE, Journal, NameTaken, Row, State
from ckptfs.store.tiers.base import CONTROL_PREFIX
from ckptfs.store.trust import is_special

MAX_NAME = 255


# At the root of the store, the nodes keep their shared state (tiers/base.py CONTROL_PREFIX).
RESERVED_AT_ROOT = CONTROL_PREFIX.rstrip("/").encode()


def check_name(name: bytes, parent: int | None = None) -> None:
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise InvalidArgument(f"invalid name {name!r}")
    if len(name) > MAX_NAME:
        raise NameTooLong(f"name of {len(name)} bytes")
    if parent == ROOT_INODE and name == RESERVED_AT_ROOT:
        raise NotPermitted(f"{name.decode()} at the root is reserved for ckptfs")


class Namespace:
    """The tree of inodes. Calls ``on_drop(row)`` when an unlinked inode may be freed."""

    def __init__(self, journal: Journal, on_drop: Callable[[Row], None]) -> None:
        self.journal = journal
        self._on_drop = on_drop
        self._rows: dict[int, Row] = {}
        self._lookups: dict[int, int] = {}
        self._opens: dict[int, int] = {}
        self._dirty: set[int] = set()
        self._linked: dict[int, int] = journal.linked_heads()
        # Bumped whenever an existing entry changes place (rename, exchange, a head taking
        # its alias's name): a walk of the tree that let other tasks run between entries
        # (retention.py) is consistent only if this did not change meanwhile.
        self.moves = 0

    # -- reading --------------------------------------------------------------------------

    def get(self, ino: int) -> Row:
        row = self._rows.get(ino)
        if row is None:
            row = self.journal.get(ino)
            if row is None:
                raise NotFound(f"inode {ino}")
            self._rows[ino] = row
        return row

    def lookup(self, parent: int, name: bytes) -> Row:
        """The kernel row of the entry ``name`` (for an alias: its head)."""
        return self.kernel(self.entry(parent, name))

    def kernel(self, row: Row) -> Row:
        """The inode the kernel knows for the name row ``row``."""
        return row if row.link_of is None else self.get(row.link_of)

    def kernel_ino(self, ino: int) -> int:
        if not self._linked:
            return ino  # no hard links at all (the common case): no query
        # Not through ``get``, which would cache a row object that callers holding another
        # object of the same row (a listing's, from ``children``) do not update.
        row = self._rows.get(ino) or self.journal.get(ino)
        return ino if row is None or row.link_of is None else row.link_of

    def is_linked(self, row: Row) -> bool:
        """Whether ``row`` is a name of a file with several names."""
        return row.link_of is not None or row.ino in self._linked

    def nlink(self, row: Row) -> int:
        """``st_nlink`` of a kernel row (directories: 1, see docs/SEMANTICS.md)."""
        if row.parent is None and row.ino != ROOT_INODE:
            return 0
        return 1 + self._linked.get(row.ino, 0)

    def aliases(self, head: int) -> list[Row]:
        """The alias rows of ``head`` (cached: the uploader and fs.py share the objects)."""
        if head not in self._linked:
            return []
        return [self._rows.setdefault(found.ino, found) for found in self.journal.aliases(head)]

    def entry_at(self, path: str) -> Row | None:
        """The name row at ``path`` (relative to the root, "/"-separated: a store key is
        one), or None if there is no such entry here."""
        row = self.get(ROOT_INODE)
        for part in path.strip("/").split("/"):
            try:
                row = self.entry(row.ino, os.fsencode(part))
            except (NotFound, NotADirectory):
                return None
        return row

    def entry(self, parent: int, name: bytes) -> Row:
        """The name row of ``name`` in ``parent`` (``.`` and ``..``: the directories)."""
        parent_row = self.get(parent)
        if not stat.S_ISDIR(parent_row.mode):
            raise NotADirectory(f"inode {parent}")
        if name == b".":
            return parent_row
        if name == b"..":
            return self.get(parent_row.parent or ROOT_INODE)
        if len(name) > MAX_NAME:
            raise NameTooLong(f"name of {len(name)} bytes")
        found = self.journal.lookup(parent, name)
        if found is None:
            raise NotFound(name.decode(errors="replace"))
        return self._rows.setdefault(found.ino, found)

    def children(self, parent: int, after_ino: int) -> Iterator[Row]:
        """Entries of ``parent`` after the cursor ``after_ino``, in a stable order."""
        while True:
            batch = self.journal.children(parent, after_ino)
            for found in batch:
                yield self._rows.get(found.ino, found)
            if len(batch) < 1000:
                return
            after_ino = batch[-1].ino

    def path_of(self, ino: int) -> bytes | None:
        return self.journal.path_of(ino)

    # -- kernel and handle references -----------------------------------------------------

    def remember(self, ino: int) -> None:
        """The kernel got a reference to ``ino`` (one lookup count)."""
        self._lookups[ino] = self._lookups.get(ino, 0) + 1

    def forget(self, ino: int, count: int) -> None:
        left = self._lookups.get(ino, 0) - count
        if left > 0:
            self._lookups[ino] = left
            return
        self._lookups.pop(ino, None)
        self._maybe_release(ino)

    def pin(self, ino: int) -> None:
        """An open handle refers to ``ino``."""
        self._opens[ino] = self._opens.get(ino, 0) + 1

    def unpin(self, ino: int) -> None:
        left = self._opens[ino] - 1
        if left:
            self._opens[ino] = left
        else:
            del self._opens[ino]
            self._maybe_release(ino)

    def open_count(self, ino: int) -> int:
        return self._opens.get(ino, 0)

    def _maybe_release(self, ino: int) -> None:
        """Free what nothing refers to: data once no handle is open, the row once unknown."""
        if ino == ROOT_INODE or ino in self._opens:
            return
        row = self._rows.get(ino)
        detached = row is not None and row.parent is None
        if detached:
            assert row is not None
            # No handle can read it any more: free the space now, even if the kernel still
            # holds a reference (it may stat it until it sends forget).
            self._on_drop(row)
        if ino in self._lookups:
            return
        if detached:
            self.journal.delete(ino)
            self._dirty.discard(ino)
        if ino not in self._dirty:
            self._rows.pop(ino, None)

    # -- writing --------------------------------------------------------------------------

    def persist(self, row: Row) -> None:
        if row.ino in self._linked:
            with self.journal.transaction():
                self.journal.update(row)
                for alias in self.aliases(row.ino):
                    alias.mode, alias.uid, alias.gid, alias.size = (row.mode, row.uid, row.gid,
                                                                    row.size)
                    alias.atime_ns, alias.mtime_ns, alias.ctime_ns = (row.atime_ns, row.mtime_ns,
                                                                      row.ctime_ns)
                    alias.version = row.version
                    self.journal.update(alias)
        else:
            self.journal.update(row)
        self._dirty.discard(row.ino)

    def persist_closed(self, row: Row) -> None:
        """Write ``row``, an OPEN file whose last writer's close(2) is returning (FLUSH), as
        the journal holds a closed file: STAGED, while it stays OPEN here until its RELEASE
        (nothing uploads it before). A crash in between replays it staged, as the release
        would have left it, so the release has nothing left to write: one commit per closed
        file, not two."""
        names = [row, *self.aliases(row.ino)] if row.ino in self._linked else [row]
        for name in names:
            name.state = State.STAGED
        try:
            self.persist(row)
        finally:
            for name in names:
                name.state = State.OPEN
        self.journal.mark_open([name.ino for name in names])

    def note_write(self, row: Row, end: int) -> None:
        """A write() ended at byte ``end``: update size and mtime in memory only."""
        row.size = max(row.size, end)
        row.mtime_ns = row.ctime_ns = time.time_ns()
        self._dirty.add(row.ino)

    def is_dirty(self, ino: int) -> bool:
        return ino in self._dirty

    def create(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, state: State,
        target: bytes | None = None, rdev: int = 0,
    ) -> Row:
        check_name(name, parent)
        parent_row = self.get(parent)
        if not stat.S_ISDIR(parent_row.mode):
            raise NotADirectory(f"inode {parent}")
        if parent_row.mode & stat.S_ISGID:
            # BSD group semantics of a setgid directory, as every Linux filesystem does.
            gid = parent_row.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        now = time.time_ns()
        row = Row(
            ino=0, parent=parent, name=name, mode=mode, uid=uid, gid=gid,
            size=len(target) if target is not None else 0,
            atime_ns=now, mtime_ns=now, ctime_ns=now, target=target, state=state,
            closed_at=None if state is State.OPEN else time.time(), rdev=rdev,
            version=self.journal.next_version(),
        )
        try:
            # No lookup first: the UNIQUE (parent, name) rule finds a taken name in the insert
            # itself (one statement fewer per create; the kernel looked the name up already).
            with self.journal.transaction():
                self.journal.insert(row)
                self._touch_dir(parent_row, now)
        except NameTaken:
            raise AlreadyExists(name.decode(errors="replace")) from None
        self._rows[row.ino] = row
        return row

    def _touch_dir(self, row: Row, now: int) -> None:
        row.mtime_ns = row.ctime_ns = now
        self.persist(row)

    def unlink(self, parent: int, name: bytes, *, directory: bool) -> Row:
        """Remove the entry; the inode is freed once nothing refers to it any more. Returns
        the name row (for a linked file: see ``remove_name``)."""
        row = self.entry(parent, name)
        if directory:
            if not stat.S_ISDIR(row.mode):
                raise NotADirectory(name.decode(errors="replace"))
            if self.journal.has_children(row.ino):
                raise NotEmpty(name.decode(errors="replace"))
        elif stat.S_ISDIR(row.mode):
            raise IsADirectory(name.decode(errors="replace"))
        if self.is_linked(row):
            self.remove_name(row)
        else:
            self._detach(row)
        return row

    # -- hard links -----------------------------------------------------------------------

    def link(self, head: Row, parent: int, name: bytes) -> Row:
        """A new name for the regular file ``head``: an alias row, its object still to be
        written (STAGED; OPEN with the head while the head is being written)."""
        check_name(name, parent)
        assert head.link_of is None and (stat.S_ISREG(head.mode) or is_special(head.mode))
        parent_row = self.get(parent)
        if not stat.S_ISDIR(parent_row.mode):
            raise NotADirectory(f"inode {parent}")
        if self.journal.lookup(parent, name) is not None:
            raise AlreadyExists(name.decode(errors="replace"))
        now = time.time_ns()
        writing = head.state is State.OPEN
        alias = replace(
            head, ino=0, parent=parent, name=name, link_of=head.ino,
            state=State.OPEN if writing else State.STAGED, incomplete=head.incomplete,
            closed_at=head.closed_at if writing else time.time(), committed_at=None,
            checksum=None, blocks=None, tiers="", remote_key=None, uploading_key=None,
            storage_class=None, remote_etag=None, target=None, ctime_ns=now)
        with self.journal.transaction():
            self.journal.insert(alias)
            self._linked[head.ino] = self._linked.get(head.ino, 0) + 1
            self._rows[alias.ino] = alias
            self._touch_dir(parent_row, now)
            head.ctime_ns = now
            self.persist(head)
        return alias

    def succession(self, row: Row) -> tuple[Row, bool] | None:
        """For the head's own name of a linked file: the alias whose name the head takes when
        this name goes, and whether the head adopts that alias's committed object (else the
        head is carried to the alias's key as a renamed file is). None for other rows."""
        if row.link_of is not None or row.ino not in self._linked:
            return None
        heir = self.aliases(row.ino)[0]
        path = self.journal.path_of(heir.ino)
        adopt = (row.state in (State.COMMITTED, State.REMOTE) and row.uploading_key is None
                 and not row.incomplete and heir.state in (State.COMMITTED, State.REMOTE)
                 and heir.uploading_key is None and heir.version == row.version
                 and heir.checksum is not None and heir.checksum == row.checksum
                 and path is not None and heir.remote_key == os.fsdecode(path))
        return heir, adopt

    def remove_name(self, row: Row) -> None:
        """Remove the name row ``row`` of a linked file; the inode keeps its other names."""
        now = time.time_ns()
        with self.journal.transaction():
            assert row.parent is not None
            self._touch_dir(self.get(row.parent), now)
            if row.link_of is not None:
                head = self.get(row.link_of)
                self._forget_alias(row)
            else:
                found = self.succession(row)
                assert found is not None
                heir, adopt = found
                head = row
                place = (heir.parent, heir.name)
                self._forget_alias(heir)  # frees the (parent, name) slot for the head
                head.parent, head.name = place
                self.moves += 1
                if adopt:
                    # The alias's object becomes the head's: same version, same bytes.
                    head.remote_key, head.remote_etag = heir.remote_key, heir.remote_etag
                    head.stamp = heir.stamp
                    head.committed_at, head.storage_class = heir.committed_at, heir.storage_class
                    head.tiers = heir.tiers
            head.ctime_ns = now
            self.persist(head)

    def _forget_alias(self, alias: Row) -> None:
        assert alias.link_of is not None
        self.journal.delete(alias.ino)
        self._rows.pop(alias.ino, None)
        self._dirty.discard(alias.ino)
        left = self._linked[alias.link_of] - 1
        if left:
            self._linked[alias.link_of] = left
        else:
            del self._linked[alias.link_of]

    def _detach(self, row: Row) -> None:
        now = time.time_ns()
        with self.journal.transaction():
            assert row.parent is not None
            self._touch_dir(self.get(row.parent), now)
            row.parent = None
            row.name = None
            row.ctime_ns = now
            self.persist(row)
        self._maybe_release(row.ino)

    def rename(
        self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, *,
        noreplace: bool, exchange: bool,
    ) -> tuple[Row, Row | None]:
        """Move an entry; returns (moved row, replaced row or None). Atomic in the journal."""
        check_name(new_name, new_parent)
        src = self.entry(old_parent, old_name)
        dst_dir = self.get(new_parent)
        if not stat.S_ISDIR(dst_dir.mode):
            raise NotADirectory(f"inode {new_parent}")
        dst = self.journal.lookup(new_parent, new_name)
        dst = self._rows.get(dst.ino, dst) if dst is not None else None
        if dst is not None and self.kernel(dst).ino == self.kernel(src).ino:
            return src, None  # two names of one inode (or one name): POSIX does nothing
        if exchange:
            if dst is None:
                raise NotFound(new_name.decode(errors="replace"))
            if stat.S_ISDIR(src.mode):
                self._check_not_ancestor(src.ino, new_parent)
            if stat.S_ISDIR(dst.mode):
                self._check_not_ancestor(dst.ino, old_parent)
            return self._exchange(src, dst)
        if dst is not None:
            if noreplace:
                raise AlreadyExists(new_name.decode(errors="replace"))
            if stat.S_ISDIR(src.mode):
                if not stat.S_ISDIR(dst.mode):
                    raise NotADirectory(new_name.decode(errors="replace"))
                if self.journal.has_children(dst.ino):
                    raise NotEmpty(new_name.decode(errors="replace"))
            elif stat.S_ISDIR(dst.mode):
                raise IsADirectory(new_name.decode(errors="replace"))
        if stat.S_ISDIR(src.mode):
            self._check_not_ancestor(src.ino, new_parent)
        now = time.time_ns()
        with self.journal.transaction():
            if dst is not None:
                # A name of a linked file was removed by fs.py first (``remove_name``, with
                # its keys): only an inode with one name is replaced here.
                assert not self.is_linked(dst)
                self._detach(dst)
            self._touch_dir(self.get(old_parent), now)
            src.parent, src.name, src.ctime_ns = new_parent, new_name, now
            self.moves += 1
            self.persist(src)
            self._touch_dir(dst_dir, now)
        return src, dst

    def _exchange(self, a: Row, b: Row) -> tuple[Row, Row]:
        now = time.time_ns()
        a_place, b_place = (a.parent, a.name), (b.parent, b.name)
        self.moves += 1
        with self.journal.transaction():
            a.parent, a.name = None, None  # free the (parent, name) slot for b
            self.persist(a)
            b.parent, b.name, b.ctime_ns = a_place[0], a_place[1], now
            self.persist(b)
            a.parent, a.name, a.ctime_ns = b_place[0], b_place[1], now
            self.persist(a)
            for parent in {a.parent, b.parent}:
                assert parent is not None
                self._touch_dir(self.get(parent), now)
        return a, b

    def _check_not_ancestor(self, ino: int, descendant: int) -> None:
        """EINVAL if ``ino`` is ``descendant`` or one of its ancestors (a loop)."""
        cursor: int | None = descendant
        while cursor is not None:
            if cursor == ino:
                raise InvalidArgument("cannot move a directory into itself")
            if cursor == ROOT_INODE:
                return
            cursor = self.get(cursor).parent

    def replay_fixups(self) -> None:
        """Purge inodes that were unlinked while open before a crash (kernel refs are gone)."""
        for row in self.journal.orphans():
            self._on_drop(row)
            self.journal.delete(row.ino)

    def snapshot(self, row: Row) -> Row:
        """A copy that later mutations of the cached row do not change."""
        return replace(row)
