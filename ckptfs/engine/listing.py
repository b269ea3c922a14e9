"""One namespace for every node: the journal merged with a cached listing of the warm tier.

A directory's entries are the journal's rows, refreshed from a one-level listing of the warm
tier when the cached listing is older than ``metadata_ttl``. The refresh makes the journal
agree with the store for every entry that is *clean* here (its committed copy is the remote
object: state REMOTE or COMMITTED at the same key, not open for writing):

- an entry only in the store is added (files as REMOTE: no local data, fetched on read;
  special files, FIFOs, sockets and device nodes, as COMMITTED rows with their type, mode and
  rdev: a FIFO on another node is a separate pipe in that node's kernel, never shared data);
- a clean entry whose object was rewritten (another node wrote a new version) takes the new
  size, mode, mtime and checksums, and its local data is dropped;
- a clean entry known from the store whose object is gone (another node deleted it) is
  removed, unless it was committed after the listing began; so is an entry written here and
  since evicted (nothing of it is left). An entry written *here* that still has its local
  copy is removed only on the word of peers.py, which decides by the object's version what
  this node does about what other nodes did: a record says another node deleted or moved
  exactly that version. Otherwise the copy is uploaded again (``on_lost``): a listing never
  deletes local data the store does not hold on the strength of a missing key alone.
- a name of a hard-linked file is decided the same way for itself alone: a name whose
  object another node deleted (or renamed) goes, and the inode lives on under its other
  names (namespace.py ``remove_name``; reads then fetch from their objects). A name whose
  committed version another node replaced goes the same way and comes back as that node's
  file (another inode): its new bytes are not the other names'.

Everything that is not clean (written here and not committed yet, being renamed, open for
writing) wins over the store: local changes are never undone by a listing.

Invariants:
- Names from the store that are not a valid single path component (empty, ``.``, ``..``,
  ``/`` or NUL inside, over 255 bytes) are refused and logged, never mapped into the tree.
- Keys with a pending deletion (tombstone), deleted while the listing was on its way (the
  store may have answered before the deletion), hidden by ``unlink = "local-only"``, or held
  by another entry (a rename or a copy not carried to the store yet) do not come back as new
  entries.
- A listing that fails (store down) leaves the local view as it is: lookups and ``ls`` keep
  answering from the journal; it is retried at the next access after a short delay.
- The store never holds up the write path for long: a directory listed before (or created
  here) whose listing is stale is refreshed in the background, and a lookup waits for that
  at most ``STALE_WAIT`` before it answers from the journal. Only the first listing of a
  directory since the mount is waited for in full (a fresh node knows nothing else). The
  root is listed at mount time.
- A lookup in a directory the journal knows but that was not listed since the mount (a
  remount) costs O(1), not a listing of the directory: a clean regular file at the key of
  its path is checked with one HEAD (``check_entry``); only the same tag and storage class,
  with nothing of the row changed meanwhile, lets it stand without the listing, which
  decides everything else.
- Concurrent refreshes of one directory share one listing. Metadata the listing lacks (S3
  lists only key, size and tag) is read with HEADs, concurrently, and only for new or changed
  objects, and for special files, whose empty objects keep their tag when only their
  metadata changes.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections import deque
from collections.abc import Callable

import trio

from ckptfs.cluster.peers import Peers, Record, Verdict, version_of
from ckptfs.engine.keys import KeyClaims
from ckptfs.errors import CkptfsError, NotEmpty, StoreUnavailable
from ckptfs.state.journal import ROOT_INODE, Journal, Row, State
from ckptfs.state.namespace import MAX_NAME, Namespace
from ckptfs.store.tiers.base import (
    ARCHIVE_CLASSES,
    CONTROL_PREFIX,
    Kind,
    ObjectInfo,
    ObjectMissing,
    Tier,
    TierError,
)
from ckptfs.store.trust import (
    dir_mode,
    file_mode,
    is_special,
    owner,
    special_mode,
    symlink_target,
)

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE = 2.0  # seconds before a failed listing is tried again
STALE_WAIT = 1.0  # the longest a lookup waits for the refresh of a stale listing
HEAD_CONCURRENCY = 16
# A lookup in a directory not listed since the mount checks its entry with one HEAD; after
# this many, the directory is listed instead. A listing costs about one HEAD on S3 (a small
# directory) and tens of them on a file tier (its merge, per entry), so a directory whose
# every file is looked up pays at most this many HEADs more than before (the first time
# after a remount), and a lookup here and there in many directories one HEAD each.
HEADS_BEFORE_LISTING = 8
# How often a node reads the records other nodes left about its files (peers.py) besides
# when a listing finds one of its objects missing: one LIST of its own mailbox.
RECORDS_EVERY = 300.0
ENTRY_FRESH_MAX = 100_000  # entries checked alone that are remembered at once (then pruned)


def refusal(name: str) -> str | None:
    """Why ``name`` (one component from a store listing) cannot be an entry, or None."""
    if not name:
        return "empty name"
    if name in (".", ".."):
        return f"{name!r} is not a name"
    if "/" in name or "\0" in name:
        return "contains '/' or NUL"
    if len(os.fsencode(name)) > MAX_NAME:
        return f"longer than {MAX_NAME} bytes"
    return None


class Lister:
    """Keeps directories of the namespace in line with the warm tier."""

    def __init__(
        self, journal: Journal, ns: Namespace, tier: Tier, *, ttl: float,
        is_busy: Callable[[int], bool], on_drop: Callable[[Row], None],
        on_lost: Callable[[Row], None], clock: Callable[[], float] = trio.current_time,
        keys: KeyClaims | None = None, peers: Peers | None = None,
        on_relocated: Callable[[int], None] | None = None,
    ) -> None:
        self.journal = journal
        self.keys = keys if keys is not None else KeyClaims(journal, ns)
        # Why a key written here is missing (peers.py).
        self.peers = peers if peers is not None else Peers(tier)
        # A linked file whose head's name went: the head is carried to its new key.
        self._on_relocated = on_relocated
        self.ns = ns
        self.tier = tier
        self.ttl = ttl
        self._is_busy = is_busy  # open or being written: never replaced under a reader
        self._on_drop = on_drop  # frees a file's local data (whole or fetched ranges)
        self._on_lost = on_lost  # an entry written here lost its object: upload it again
        self._clock = clock
        self._fresh_until: dict[int, float] = {}
        self._listed: set[int] = set()  # listed once since the mount, or created here
        self._failed: set[int] = set()  # whose last listing failed (the store was down)
        # Directories another node removed or moved whose entries were listed once since
        # (``apply_records``): still not empty at the next round, they keep entries of
        # their own, and the record goes.
        self._entries_listed: set[int] = set()
        self._inflight: dict[int, trio.Event] = {}
        # Where refreshes run so that a lookup can stop waiting for one (the mount's nursery);
        # without one they run in the caller.
        self.nursery: trio.Nursery | None = None
        self._heads = trio.CapacityLimiter(HEAD_CONCURRENCY)
        self.refused: deque[tuple[str, str]] = deque(maxlen=64)
        self._refused_seen: set[str] = set()
        self.listings = 0
        self.heads = 0
        # Regular files of directories not listed since the mount, checked one HEAD each
        # (``check_entry``): until when each is current, and how many were checked per
        # directory.
        self._entry_fresh: dict[int, float] = {}
        self._entry_heads: dict[int, int] = {}
        self.entry_heads = 0

    def created(self, ino: int) -> None:
        """A directory made here: nothing of it can be in the store yet (until the ttl)."""
        self._listed.add(ino)
        self._fresh_until[ino] = self._clock() + self.ttl

    async def check_entry(self, directory: Row, row: Row) -> None:
        """Before a lookup answers with ``row``, an entry of ``directory`` that is a view of
        a remote object: make it as current as a listing would (another node may have
        replaced or removed the object).

        In a directory listed since the mount (or being listed) that is ``refresh``. In one
        not listed yet, which only a remount over a journal that knows it has, a regular
        file is checked alone with one HEAD of its key (O(1): a first listing of every
        directory a lookup touches would cost the whole directory each): the same
        tag and storage class is what the listing would find, so the row stands, fresh for
        the ttl. Anything else (changed, missing, refused, the store down, a hard link, not
        a regular file) lists the directory as before; so does every such hit in one
        directory after ``HEADS_BEFORE_LISTING`` of them (one listing then costs less than
        more HEADs)."""
        ino = directory.ino
        now = self._clock()
        if ino in self._listed or ino in self._inflight or \
                self._fresh_until.get(ino, 0.0) > now or not self._checkable(row):
            await self.refresh(directory)
            return
        if self._entry_fresh.get(row.ino, 0.0) > now:
            return
        if self._entry_heads.get(ino, 0) >= HEADS_BEFORE_LISTING:
            await self.refresh(directory)
            return
        self._entry_heads[ino] = self._entry_heads.get(ino, 0) + 1
        key, etag, storage_class = row.remote_key, row.remote_etag, row.storage_class
        assert key is not None
        self.entry_heads += 1
        try:
            info: ObjectInfo | None = await self.tier.head(key)
        except (ObjectMissing, StoreUnavailable, TierError):
            info = None
        # Nothing of the row may have changed meanwhile (an open for writing, a rename, an
        # upload, a listing of the directory), else the listing decides.
        archived = info.storage_class if info is not None and \
            info.storage_class in ARCHIVE_CLASSES else None
        if info is not None and info.etag == etag and archived == storage_class and \
                self._checkable(row) and \
                (row.remote_key, row.remote_etag, row.storage_class) == \
                (key, etag, storage_class) and self._still_entry(ino, row):
            if len(self._entry_fresh) >= ENTRY_FRESH_MAX:
                self._entry_fresh = {i: t for i, t in self._entry_fresh.items() if t > now}
            self._entry_fresh[row.ino] = self._clock() + self.ttl
            return
        await self.refresh(directory)

    def _still_entry(self, parent: int, row: Row) -> bool:
        """Whether ``row`` is still the entry of its name in ``parent``, the only owner of its
        key."""
        found = self.journal.lookup(parent, row.name or b"")
        return found is not None and found.ino == row.ino and \
            self.journal.holders_of(row.remote_key or "") == [row.ino]

    def _checkable(self, row: Row) -> bool:
        """Whether one HEAD can tell if ``row`` is current: a clean regular file with a tag,
        at the key of its path (not being moved there), a key nobody is deleting, hiding or
        copying to."""
        key = row.remote_key
        if key is None or row.remote_etag is None or row.link_of is not None or \
                row.name is None or not stat.S_ISREG(row.mode) or not self._clean(row, key):
            return False
        return key == self.keys.key_of(row) and not self.keys.busy([key]) and \
            not self.journal.is_hidden(key)

    async def refresh(self, directory: Row, *, wait: float | None = None,
                      current: bool = False) -> bool:
        """Bring ``directory``'s entries in line with the store if its listing is stale.

        Waits for the listing at most ``wait`` seconds (default: ``STALE_WAIT`` if the
        directory was listed before, else until it is done); it goes on in the background.
        True if the directory's view is known to be current (fresh, or listed just now).
        ``current``: list it again even if the last listing is within the ttl (a listing
        already on its way may predate the call: it is waited for, then one more runs).
        Renames and rmdir need it: other nodes' files that landed since the last listing
        move (or keep the directory) too."""
        if not stat.S_ISDIR(directory.mode) or directory.parent is None and \
                directory.ino != ROOT_INODE:
            return True
        if current:
            running = self._inflight.get(directory.ino)
            if running is not None:
                with trio.move_on_after(math.inf if wait is None else wait):
                    await running.wait()
            self._fresh_until.pop(directory.ino, None)
        elif self._fresh_until.get(directory.ino, 0.0) > self._clock():
            return directory.ino not in self._failed
        if wait is None:
            wait = STALE_WAIT if directory.ino in self._listed else math.inf
        done = self._inflight.get(directory.ino)
        if done is None:
            done = self._inflight[directory.ino] = trio.Event()
            if self.nursery is None:
                await self._run(directory, done)
            else:
                self.nursery.start_soon(self._run, directory, done)
        with trio.move_on_after(wait):
            await done.wait()
        return done.is_set() and directory.ino not in self._failed

    async def _run(self, directory: Row, done: trio.Event) -> None:
        ok = False
        try:
            ok = await self._refresh(directory)
        except Exception:
            log.exception("listing of directory inode %d failed", directory.ino)
        finally:
            if ok:
                self._failed.discard(directory.ino)
            else:
                self._failed.add(directory.ino)
            self._listed.add(directory.ino)
            del self._inflight[directory.ino]
            done.set()

    async def run_records(self) -> None:
        """``apply_records`` at once, then every ``RECORDS_EVERY`` seconds (the mount's
        nursery): a node learns what was done to its files even in directories it never
        lists again, and the records do not pile up."""
        while True:
            try:
                await self.apply_records()
            except Exception:
                log.exception("reading this node's records failed")
            await trio.sleep(RECORDS_EVERY)

    async def apply_records(self) -> int:
        """Act on the records other nodes left about this node's versions (peers.py) without
        waiting for a listing of their directories: an entry written here whose version was
        deleted or moved goes (its object is checked gone first: a record is written just
        before its deletion); a directory goes once it is empty, its record kept until the
        next round (its entries are listed meanwhile).
        Records about versions this node no longer holds as they were are deleted unread
        further; those about an entry that is open, or that may be a file that came back
        incomplete, stay for the next round. Returns how many entries went."""
        try:
            records = await self.peers.mailbox()
        except (StoreUnavailable, TierError) as exc:
            log.info("cannot read this node's records (%s): later", exc)
            return 0
        done: list[Record] = []
        removed = 0
        # A file that came back incomplete after a power loss has no stamp any more (the
        # journal forgot its upload): a record of its version is for the listing of its
        # directory to decide (``Peers.replaced``), not unread garbage.
        incomplete_keys = self.journal.incomplete_paths()
        # Files first, then directories deepest first: a directory may be emptied by those.
        records.sort(key=lambda r: (r.key.endswith("/"), -r.key.count("/")))
        for record in records:
            # Any version at such a key: a later one the journal forgot may decide it too.
            keep = record.key in incomplete_keys or \
                self._forgotten_dir(record) is not None  # for the uploader to decide
            for ino in self.journal.with_stamp(record.stamp):
                try:
                    row = self.ns.get(ino)
                except CkptfsError:
                    continue
                if record.fate is Verdict.LOST:
                    continue
                if row.remote_key != record.key:
                    # On its way to that key (a rename whose move is not carried yet; after
                    # a power loss, a sweep whose end the journal forgot): the record decides
                    # once the row is there, or when the uploader finds its object missing.
                    keep = keep or self.keys.key_of(row) == record.key
                    continue
                # A directory is acted on too: a power loss that rolls the journal back to
                # before its marker's commit must find the record (``removed_dir_forgotten``).
                if not self._settled(row, record.key) or \
                        not (self._holds_copy(row) or stat.S_ISDIR(row.mode)):
                    keep = keep or self._is_busy(row.ino)  # open now: decided later
                    continue
                try:
                    # A directory stays while any marker is there (put again since).
                    still = (await self.tier.head(record.key)).meta.stamp == record.stamp \
                        or record.key.endswith("/")
                except ObjectMissing:
                    still = False
                except (StoreUnavailable, TierError):
                    keep = True
                    continue
                if still:
                    keep = True  # recorded, not carried out yet (or it failed): later
                    continue
                # Read again after the HEAD: the entry may have changed meanwhile.
                if row.parent is None or row.name is None or \
                        not self._settled(row, record.key) or row.stamp != record.stamp:
                    continue
                directory = self.ns.get(row.parent)
                with self.journal.transaction():
                    if self._remove(directory, row.name, row):
                        removed += 1
                        self._entries_listed.discard(row.ino)
                        log.info("%s: %s by node %s; removed here too", record.key,
                                 record.fate.value, record.by or "?")
                    elif stat.S_ISDIR(row.mode) and row.ino not in self._entries_listed:
                        # Entries first (listed now: those moved or removed with it go);
                        # the record stays until the next round, so that a power loss
                        # meanwhile does not put its marker again (``removed_dir_forgotten``).
                        # Not empty then, it keeps entries written here (a file closed into
                        # it before this node saw the move, carried): the record goes.
                        self._entries_listed.add(row.ino)
                        keep = True
            if not keep:
                done.append(record)
        await self.drop_records(done)
        return removed

    async def settle_forgotten(self) -> None:
        """After a power loss (the journal rolled back to its last durable point): files whose
        upload the journal forgot, and whose version another node deleted, replaced or moved
        since (a record names this node and that version, from an earlier run), go, instead
        of being uploaded again (they would bring back what the job removed). Called once,
        before the uploader starts; a record left later is found at the file's upload
        (``replaced_since``)."""
        try:
            records = await self.peers.mailbox()
        except (StoreUnavailable, TierError) as exc:
            log.warning("cannot read this node's records (%s): files committed before the "
                        "power loss are uploaded again", exc)
            return
        await self.drop_records([record for record in records
                                 if self._forget_replaced(record)])

    async def replaced_since(self, row: Row, key: str) -> bool:
        """``settle_forgotten`` for one file, at its upload (upload.py ``_upload_forgotten``:
        its key holds another node's version): a record another node left since the start
        names this version at ``key``; then the file went here too (True)."""
        try:
            records = await self.peers.mailbox()
        except (StoreUnavailable, TierError) as exc:
            log.warning("cannot read this node's records (%s)", exc)
            return False
        done = [record for record in records if record.key == key
                and self.ns.entry_at(key) is row and self._forget_replaced(record)]
        await self.drop_records(done)
        return bool(done)

    async def removed_dir_forgotten(self, row: Row, key: str) -> bool:
        """After a power loss, before the marker of the directory ``row`` is put at ``key``
        again (the journal forgot that it was put): if it is gone from the store and another
        node's record says it removed or moved this very version of it (peers.py: a marker
        carries its writer's stamp), the directory went with the job. Its entries are listed
        first (those the job removed or moved with it go, as for any file: a file that came
        back incomplete goes by its own record); if none is left, it goes here too (True).
        An entry left in it keeps it (False: its marker is put again)."""
        try:
            await self.tier.head(key)
            return False  # there: putting it again changes nothing
        except ObjectMissing:
            pass
        records = [record for record in await self.peers.mailbox()
                   if record.key == key and self._forgotten_dir(record) is row]
        if not records:
            return False
        await self.refresh_tree(row, current=True)
        row = self.ns.get(row.ino)
        if row.parent is None or row.name is None or self.journal.has_children(row.ino) or \
                self._forgotten_dir(records[0]) is not row:
            return False
        with self.journal.transaction():
            removed = self._remove(self.ns.get(row.parent), row.name, row)
        if removed:
            log.warning("%s: its marker's put was forgotten by the power loss, and node %s %s "
                        "that directory since: not put again", key, records[0].by or "?",
                        records[0].fate.value)
            await self.drop_records(records)
        return removed

    def _forgotten_dir(self, record: Record) -> Row | None:
        """The directory whose marker's put a power loss made the journal forget, if
        ``record`` names exactly that version (another node removed or moved it since)."""
        version = version_of(record.stamp)
        if not record.key.endswith("/") or record.fate is Verdict.LOST or version is None or \
                version > self.journal.current_version():
            return None
        row = self.ns.entry_at(record.key)
        if row is None or not stat.S_ISDIR(row.mode) or row.version != version or \
                row.stamp == record.stamp or row.state is not State.STAGED:
            return None
        return row

    def _forget_replaced(self, record: Record) -> bool:
        """The file whose upload a power loss made the journal forget goes if ``record``
        says another node deleted, replaced or moved exactly its version since (a name of a
        hard-linked file goes alone, as for any removal by another node); whether the record
        was acted on."""
        version = version_of(record.stamp)
        # Versions above current_version were handed out after the roll-back point, to
        # other contents.
        if record.fate is Verdict.LOST or version is None or \
                version > self.journal.current_version():
            return False
        row = self.ns.entry_at(record.key)
        # The row's stamp is the record's where the journal kept that very commit; an
        # exchange puts the same version again at the other name, where a commit of the
        # same stamp is what the power loss made it forget (``remote_key`` still elsewhere).
        if row is None or row.version != version or \
                (row.stamp == record.stamp and row.remote_key == record.key) or \
                not stat.S_ISREG(row.mode) or row.incomplete or self._is_busy(row.ino) or \
                row.state not in (State.STAGED, State.UPLOADING) or row.parent is None or \
                row.name is None:
            return False
        with self.journal.transaction():
            if self._remove(self.ns.get(row.parent), row.name, row):
                log.warning("%s: its upload was forgotten by the power loss, and node %s "
                            "%s that version since: not uploaded again", record.key,
                            record.by or "?", record.fate.value)
        return True

    async def drop_records(self, records: list[Record]) -> None:
        """Delete records acted on, once what they made this node do is durable: a power
        loss must not roll the journal back to before the act while the record is gone (the
        node would hold its copy again with nothing to say why the store lacks it, and
        upload it again)."""
        if records:
            await self.journal.make_durable_async()
            await self.peers.drop(records)

    async def refresh_tree(self, directory: Row, *, current: bool = False) -> bool:
        """Refresh ``directory`` and every directory below it, waiting for each (before a
        rename or rmdir, the journal must know every descendant); False if one failed.
        ``current``: as for ``refresh``."""
        ok = await self.refresh(directory, wait=math.inf, current=current)
        for child in list(self.ns.children(directory.ino, 0)):
            if stat.S_ISDIR(child.mode):
                ok = await self.refresh_tree(child, current=current) and ok
        return ok

    async def _refresh(self, directory: Row) -> bool:
        """One listing merged into the journal; False if the store could not be listed."""
        path = self.journal.path_of(directory.ino)
        if path is None:
            return True
        prefix = os.fsdecode(path) + "/" if path else ""
        started = time.time()
        mark = self.journal.listing_started()
        try:
            return await self._merge(directory, path, prefix, started, mark)
        finally:
            self.journal.listing_done(mark)

    async def _merge(self, directory: Row, path: bytes, prefix: str, started: float,
                     mark: int) -> bool:
        try:
            entries = await self.tier.list_dir(prefix)
        except (StoreUnavailable, TierError) as exc:
            log.warning("cannot list %s/%s (serving the local view): %s", self.tier.url,
                        prefix, exc)
            self._fresh_until[directory.ino] = self._clock() + min(self.ttl, RETRY_AFTER_FAILURE)
            return False
        self.listings += 1
        remote = self._accept(prefix, entries)
        before = self._children(directory)
        heads = [info for name, info in remote.items()
                 if not info.meta_known and self._needs_meta(before.get(name), info)]
        details = await self._head_all(heads)
        lost = self._lost_candidates(prefix, remote, before, mark)
        verdicts, used = await self.peers.judge(lost)
        replaced = await self.peers.replaced(self._lost_to_power(remote, details, before))
        used += replaced.values()
        # Incomplete here and gone from the store: another node removed (or moved) the
        # version this node committed before a power loss made its journal forget it.
        gone = self._removed_while_lost(prefix, remote, before)
        # A later version counts too (``_later_version``).
        removed = await self.peers.replaced(gone, later=gone)
        used += removed.values()
        acted: set[str] = set()  # keys whose record was acted on: those records go
        # From here on nothing is awaited: the journal changes in one go. Everything the
        # decisions depend on is read again now, since the namespace went on meanwhile (an
        # unlink adds a tombstone, a rename claims a key, the directory itself may move).
        if self.journal.path_of(directory.ino) != path:
            return True  # moved or removed while we listed: this listing says nothing of it
        local = self._children(directory)
        # Deleted, being deleted, or deleted while this listing was on its way (the store
        # may have answered before the deletion).
        skip = self.keys.listing_skip(prefix, mark, local)
        # Under a directory renamed or removed here whose sweep has not run yet, the store's
        # keys are on their way away (upload.py ``_sweep``): not entries (``rm -r d; ls``
        # would show ``d`` again, a file another node closed in it landing meanwhile).
        swept = tuple(self.journal.sweeping())
        with self.journal.transaction():
            for name, info in remote.items():
                if info.key in skip or (swept and info.key.startswith(swept)):
                    continue
                info = details.get(info.key, info)
                existing = local.get(name)
                if existing is None:
                    if info.meta_known or info.key.endswith("/"):
                        self._insert(directory, name, info, started)
                elif not self._same_kind(existing, info):
                    # A file became a directory (or the reverse) on another node.
                    if self._clean(existing, self._key_of(prefix, name, existing)) and \
                            self._remove(directory, name, existing):
                        self._insert(directory, name, info, started)
                elif self._clean(existing, info.key) and stat.S_ISREG(existing.mode):
                    self._maybe_update(existing, info)
                elif self._clean(existing, info.key) and is_special(existing.mode):
                    self._maybe_update_special(existing, info)
                elif self._replaced_link(existing, info):
                    # Its version is gone from the store, as if deleted: the name goes alone
                    # (the file lives on under its other names), and comes back as the other
                    # node's file.
                    log.info("%s: another node wrote a new version over this name of a "
                             "hard-linked file; the name now shows it (%d bytes)", info.key,
                             info.size)
                    if self._remove(directory, name, existing):
                        self._insert(directory, name, info, started)
                elif self._forgotten_link(existing, info):
                    log.warning("%s: its bytes were lost here with a commit the journal forgot; "
                                "this node's later version in the store is taken (%d bytes)",
                                info.key, info.size)
                    self._maybe_update(existing, info)
                elif self._lost_head(existing, info):
                    log.warning("%s: the bytes of this hard-linked file were lost here (it came "
                                "back incomplete); this name's version in the store, this "
                                "node's own, is taken (%d bytes)", info.key, info.size)
                    if info.etag != existing.remote_etag:
                        self._maybe_update(existing, info)  # a later commit the journal forgot
                    self._recover_bytes(existing)
                elif self._recoverable(existing, info):
                    self._recover(existing, info)
                elif info.key in replaced and self._recoverable(existing, None) and \
                        existing.version == version_of(replaced[info.key].stamp):
                    self._recover(existing, info, by=replaced[info.key].by or "?")
                    acted.add(info.key)
            for name, row in local.items():
                if name in remote and (remote[name].key not in skip
                                       or self._holds_listed(row, remote[name])):
                    continue
                key = self._key_of(prefix, name, row)
                if key in removed and self._recoverable(row, None) and (
                        row.version == version_of(removed[key].stamp)
                        or self._later_version(row, removed[key])):
                    # Its version was removed by the job after the commit this node forgot:
                    # the incomplete copy goes with it (else it would stay, shown, forever).
                    if self._remove(directory, name, row):
                        acted.add(key)
                    continue
                if not self._settled(row, key) or self.journal.committed_since(row.ino, mark):
                    continue
                judged = lost.get(key)
                verdict = verdicts.get(key) if judged is not None and \
                    (judged.ino, judged.committed_at) == (row.ino, row.committed_at) else None
                if not self._holds_copy(row):
                    # Known from the store (or no local data left): it is gone everywhere.
                    self._remove(directory, name, row)
                elif verdict is Verdict.DELETED or verdict is Verdict.MOVED:
                    # Another node deleted or renamed exactly this version (peers.py): the
                    # copy goes too (a moved one lives on under its new name), else it would
                    # bring back what the job removed.
                    if self._remove(directory, name, row):
                        acted.add(key)
                elif verdict is Verdict.LOST:
                    # Written here, local copy at hand, and nothing accounts for its
                    # absence: never lose it on the word of a listing (the store lost it,
                    # or a deletion raced this version's upload); upload it again.
                    log.warning("%s: committed here but missing from %s; uploading the "
                                "local copy again", key, self.tier.url)
                    self._on_lost(row)
                # No verdict (the records could not be read): the next listing decides.
        self._fresh_until[directory.ino] = self._clock() + self.ttl
        # A record not acted on (the entry changed meanwhile) stays for the next decision.
        await self.drop_records([r for r in used if r.key in acted])
        return True

    def _holds_copy(self, row: Row) -> bool:
        """Whether ``row`` is a regular file written here whose bytes are still here (for a
        name of a linked file: its head's bytes). Directories, symlinks and special files
        hold no bytes: one missing from the store is gone (a directory once it is empty)."""
        return stat.S_ISREG(row.mode) and row.closed_at is not None and \
            row.state is not State.REMOTE and self.ns.kernel(row).state is not State.REMOTE

    def _lost_candidates(self, prefix: str, remote: dict[bytes, ObjectInfo],
                         local: dict[bytes, Row], mark: int) -> dict[str, Row]:
        """Entries written here, with their local copy, that this listing misses (what would
        be uploaded again), by key: peers.py judges why they are missing."""
        out: dict[str, Row] = {}
        for name, row in local.items():
            if name in remote:
                continue
            key = self._key_of(prefix, name, row)
            if self._settled(row, key) and not self.journal.committed_since(row.ino, mark) \
                    and self._holds_copy(row):
                out[key] = row
        return out

    def _children(self, directory: Row) -> dict[bytes, Row]:
        found: dict[bytes, Row] = {}
        for row in self.ns.children(directory.ino, 0):
            assert row.name is not None
            found[row.name] = row
        return found

    def _accept(self, prefix: str, entries: list[ObjectInfo]) -> dict[bytes, ObjectInfo]:
        """The entries whose names are safe path components (the others are refused)."""
        remote: dict[bytes, ObjectInfo] = {}
        for info in entries:
            if not info.key.startswith(prefix) or info.key.startswith(CONTROL_PREFIX):
                continue  # the nodes' shared state (coordination.py), not an entry
            name = info.key[len(prefix):].removesuffix("/")
            why = refusal(name)
            if why is None and os.fsencode(name) in remote:
                why = "a file and a directory of the same name"
            if why is not None:
                self._refuse(info.key, why)
                continue
            remote[os.fsencode(name)] = info
        return remote

    def _refuse(self, key: str, why: str) -> None:
        self.refused.append((key, why))
        if key not in self._refused_seen:
            self._refused_seen.add(key)
            log.warning("refusing store entry %r of %s: %s", key, self.tier.url, why)

    def _needs_meta(self, row: Row | None, info: ObjectInfo) -> bool:
        if row is None:
            return True
        if info.key.endswith("/"):
            return False  # a known directory: its marker's metadata does not change it
        if is_special(row.mode):
            # A special file's object is empty, and S3's ETag of an empty object is the same
            # whatever its metadata: a chmod, chown or touch on another node keeps the tag.
            # So its metadata is read at every refresh (special files are few).
            return self._clean(row, info.key)
        changed = info.etag is None or info.etag != row.remote_etag
        return (self._clean(row, info.key) and changed or self._recoverable(row, None)
                or self._lost_head(row, None)
                or changed and (self._forgotten_link(row, None)
                                or self._replaced_link(row, None)))

    async def _head_all(self, infos: list[ObjectInfo]) -> dict[str, ObjectInfo]:
        found: dict[str, ObjectInfo] = {}

        async def one(info: ObjectInfo) -> None:
            async with self._heads:
                self.heads += 1
                try:
                    found[info.key] = await self.tier.head(info.key)
                except ObjectMissing:
                    # A directory with no marker of its own (only keys below it): defaults.
                    # A file deleted since the listing: left out until the next listing.
                    pass
                except (StoreUnavailable, TierError) as exc:
                    log.warning("cannot read metadata of %s: %s", info.key, exc)

        async with trio.open_nursery() as nursery:
            for info in infos:
                nursery.start_soon(one, info)
        return found

    # -- decisions --------------------------------------------------------------------------

    def _clean(self, row: Row, key: str) -> bool:
        """Whether the row is just a view of the remote object at ``key`` (safe to update).
        A name of a hard-linked file never is: its bytes are shared with its other names,
        so a new version of one object does not decide them; the removal of a name is taken
        (``_settled``), and a replaced version as a removal (``_replaced_link``)."""
        return self._settled(row, key) and not self.ns.is_linked(row)

    def _settled(self, row: Row, key: str) -> bool:
        """Whether ``row``'s committed object is at ``key``, with nothing of it on its way
        here: a name whose object is gone may be judged (also a hard link's name)."""
        return (row.remote_key == key and not row.incomplete
                and row.state in (State.REMOTE, State.COMMITTED)
                and not self._is_busy(row.ino))

    @staticmethod
    def _same_kind(row: Row, info: ObjectInfo) -> bool:
        if info.key.endswith("/"):
            return stat.S_ISDIR(row.mode)
        if not info.meta_known:
            # Key and size only (S3): an unchanged object is what the row already maps, and a
            # changed one of a clean row is HEADed first; an unknown kind decides nothing.
            return not stat.S_ISDIR(row.mode)
        if info.meta.kind is Kind.SYMLINK:
            return stat.S_ISLNK(row.mode)
        if info.meta.kind is Kind.SPECIAL:
            return stat.S_IFMT(row.mode) == stat.S_IFMT(info.meta.mode) and \
                is_special(row.mode)
        return stat.S_ISREG(row.mode)

    @staticmethod
    def _key_of(prefix: str, name: bytes, row: Row) -> str:
        return prefix + os.fsdecode(name) + ("/" if stat.S_ISDIR(row.mode) else "")

    def _insert(self, directory: Row, name: bytes, info: ObjectInfo, now: float) -> None:
        # Modes, owners and targets as store/trust.py allows them: the store is not trusted.
        meta = info.meta
        mtime = meta.mtime_ns or int(now * 1e9)
        target = None
        rdev = 0
        if info.key.endswith("/"):
            mode, state, size = dir_mode(meta.mode), State.COMMITTED, 0
        elif meta.kind is Kind.SYMLINK:
            target, why = symlink_target(meta.target)
            if target is None:
                self._refuse(info.key, why or "bad symlink")
                return
            mode, state, size = stat.S_IFLNK | 0o777, State.COMMITTED, len(target)
        elif meta.kind is Kind.SPECIAL:
            special = special_mode(meta.mode, meta.rdev)
            if special is None:
                self._refuse(info.key, f"not a special file type ({meta.mode:o})")
                return
            (mode, rdev), state, size = special, State.COMMITTED, 0
        else:
            mode, state, size = file_mode(meta.mode), State.REMOTE, info.size
        row = Row(
            ino=0, parent=directory.ino, name=name, mode=mode, uid=owner(meta.uid),
            gid=owner(meta.gid),
            size=size, atime_ns=mtime, mtime_ns=mtime, ctime_ns=mtime, target=target,
            state=state, checksum=meta.checksum, blocks=meta.blocks,
            storage_class=info.storage_class if info.storage_class in ARCHIVE_CLASSES else None,
            remote_etag=info.etag, remote_key=info.key, tiers=self.tier.name,
            committed_at=now, rdev=rdev, stamp=meta.stamp,
            version=self.journal.next_version(),
        )
        self.journal.insert(row)
        self.journal.note_committed(row.ino)

    def drop_removed(self, row: Row) -> bool:
        """The uploader found ``row``'s version removed from the store by another node (after
        a power loss: upload.py ``_move_forgotten``): it goes here too."""
        if row.parent is None or row.name is None or self._is_busy(row.ino):
            return False
        with self.journal.transaction():
            return self._remove(self.ns.get(row.parent), row.name, row)

    def take(self, row: Row, info: ObjectInfo) -> bool:
        """``row``, a view of the object at ``info.key``, takes the version ``info`` describes
        now (a sweep or a move found a newer one than the row's: upload.py); False if the
        row is not a plain view of that key any more (open, changed here, moved)."""
        if not self._clean(row, info.key) or not info.meta_known:
            return False
        with self.journal.transaction():
            self._maybe_update(row, info)
        return True

    def _maybe_update(self, row: Row, info: ObjectInfo) -> None:
        archived = info.storage_class if info.storage_class in ARCHIVE_CLASSES else None
        if info.etag is not None and info.etag == row.remote_etag:
            # The same object, but maybe not in the same class: a storage-class transition
            # (retention's in-place copy, on any node, or a bucket lifecycle rule) keeps the
            # ETag of a single-part object. The class decides whether it can be read.
            if row.storage_class != archived:
                row.storage_class = archived
                self.ns.persist(row)
            return
        if not info.meta_known:
            return  # changed, but its metadata could not be read: the next listing decides
        meta = info.meta
        if info.size == row.size and meta.checksum is not None and meta.checksum == row.checksum \
                and (meta.stamp == row.stamp or meta.stamp is None or row.stamp is None):
            # Same data (our own upload, or a copy): remember the tag and storage class.
            if (row.remote_etag, row.storage_class, row.stamp) != \
                    (info.etag, archived, meta.stamp or row.stamp):
                row.remote_etag, row.storage_class = info.etag, archived
                row.stamp = meta.stamp or row.stamp
                self.ns.persist(row)
            return
        log.info("%s: a new version in the store (%d bytes); dropping the local copy",
                 info.key, info.size)
        self._on_drop(row)
        row.state = State.REMOTE
        row.size = info.size
        row.mode = file_mode(meta.mode)
        row.uid, row.gid = owner(meta.uid), owner(meta.gid)
        row.mtime_ns = row.ctime_ns = meta.mtime_ns or time.time_ns()
        row.checksum, row.blocks = meta.checksum, meta.blocks
        row.storage_class, row.remote_etag = archived, info.etag
        row.stamp = meta.stamp
        row.version = self.journal.next_version()
        row.closed_at = None  # another node's version now, known from the store
        self.ns.persist(row)
        self.journal.note_committed(row.ino)

    def _recoverable(self, row: Row, info: ObjectInfo | None) -> bool:
        """Whether ``row`` is a file of this node that came back incomplete (a power loss
        took its data, or its writer died) while the store holds a version this node wrote
        of it (``info``, its metadata read; None: not read yet): that version is all that is
        left of the file, complete and committed, and it is taken instead."""
        return (row.incomplete and stat.S_ISREG(row.mode) and not self._is_busy(row.ino)
                and (info is None or (info.meta_known and info.meta.kind is Kind.FILE
                                      and self.peers.own(info.meta.stamp))))

    def _replaced_link(self, row: Row, info: ObjectInfo | None) -> bool:
        """Whether ``row``, a name of a hard-linked file settled at its key (its committed
        object is the one there, nothing on its way), finds there another node's new version
        (``info``, its metadata read; None: not read yet). That node replaced the version
        this name stands for, which is then gone from the store as if deleted: the name
        goes alone, as for a deletion (``_remove``), and shows the new version. The bytes
        of the other names are not the other node's to change (local wins for them)."""
        if not (stat.S_ISREG(row.mode) and self.ns.is_linked(row)
                and row.remote_key is not None and self._settled(row, row.remote_key)):
            return False
        if info is None:
            return True
        return info.meta_known and info.meta.kind is Kind.FILE and \
            info.key == row.remote_key and info.etag != row.remote_etag and \
            info.meta.stamp is not None and info.meta.stamp != row.stamp and \
            self.peers.foreign(info.meta.stamp)

    def _forgotten_link(self, row: Row, info: ObjectInfo | None) -> bool:
        """Whether ``row``, a name of a hard-linked file whose bytes this node no longer has
        (a power loss took them, and the journal rolled back to an older commit), finds in
        the store a later version of its own (``info``, its metadata read; None: not read
        yet): the journal forgot that commit. Nothing local is left to win over it (the rule
        for linked files, ``_clean``), so the name takes it."""
        if not (stat.S_ISREG(row.mode) and self.ns.is_linked(row) and self._settled(
                row, row.remote_key or "") and self.ns.kernel(row).state is State.REMOTE):
            return False
        if info is None:
            return True
        version = version_of(info.meta.stamp) if info.meta_known else None
        return info.meta.kind is Kind.FILE and self.peers.own(info.meta.stamp) and \
            info.key == row.remote_key and info.etag != row.remote_etag and \
            version is not None and version > row.version

    def _holds_listed(self, row: Row, info: ObjectInfo) -> bool:
        """Whether ``row`` is settled at ``info.key`` and the listing shows exactly its
        object there (the same tag). A deletion pending at that key is then of another,
        older version (pinned to it: the retired copy of a file that had that name before,
        an exchange's), not of this one: the entry is in the store, not gone (it was dropped
        here, and the deletion, finding no holder, then took the row's own version)."""
        return info.etag is not None and info.etag == row.remote_etag and \
            self._settled(row, info.key)

    def _later_version(self, row: Row, record: Record) -> bool:
        """Whether ``record`` names a version of ``row`` (a file that came back incomplete)
        later than the one the journal rolled back to, from an earlier run: the journal
        forgot the commits of the later versions (a rewrite, a name of a hard-linked file
        whose version is the bytes'), and the job removed one of them from the key after
        the roll-back point. The file at that key went with it: its bytes are lost here
        anyway (incomplete), and what the job did last there was that removal."""
        version = version_of(record.stamp)
        return version is not None and version > row.version and \
            not self.peers.this_run(record.stamp)

    def _lost_head(self, row: Row, info: ObjectInfo | None) -> bool:
        """Whether ``row``, another name of a hard-linked file, settled at its key, stands
        for bytes a power loss took (the head, which holds them, came back incomplete; this
        name did not: its close was not the one cut short) while the store holds this
        node's own version at this name's key (``info``, its metadata read; None: not read
        yet): nothing local is left to win over it, and the file takes it
        (``_recover_bytes``)."""
        if row.link_of is None or not stat.S_ISREG(row.mode) or row.remote_key is None or \
                not self._settled(row, row.remote_key):
            return False
        head = self.ns.get(row.link_of)
        if not head.incomplete or self._is_busy(head.ino):
            return False
        if info is None:
            return True
        return info.meta_known and info.meta.kind is Kind.FILE and \
            info.key == row.remote_key and self.peers.own(info.meta.stamp)

    def _recover(self, row: Row, info: ObjectInfo, by: str | None = None) -> None:
        """``row`` came back incomplete: it takes the store's version ``info``, this node's
        own (committed before the power loss), or, ``by`` another node, the one that
        replaced it since (``Peers.replaced``)."""
        if by is None:
            log.warning("%s: came back incomplete here; the version this node committed to "
                        "the store before is taken (%d bytes)", info.key, info.size)
        else:
            log.warning("%s: came back incomplete here; node %s replaced the version this "
                        "node committed before, and its version is taken (%d bytes)",
                        info.key, by, info.size)
        row.incomplete = False
        # Nothing of it kept: _maybe_update drops the local data and takes the rest.
        row.state = State.COMMITTED
        row.remote_key = info.key
        row.checksum = row.remote_etag = None
        self._maybe_update(row, info)
        if by is None:
            row.closed_at = row.committed_at = time.time()  # this node's version, as before
        self.ns.persist(row)
        self._recover_bytes(row)

    def _recover_bytes(self, row: Row) -> None:
        """``row``, a name of a hard-linked file, just took the store's version of its
        object: the file's bytes are the head's (the kernel reads those), so the head takes
        that version too if the power loss took its bytes as well (it came back incomplete),
        or if it took an older one of this node's from its own name's object meanwhile (the
        power loss fell between two names' puts). The head's own name keeps its object's tag:
        the listing of that name then judges it as any committed name (gone from the store:
        another node removed it, and it goes; holding an older version: it stays, the names
        diverge as docs/HARD_LINKS.md says). A head never committed under its own name is
        left as it is (its object is not known gone: it may never have been put)."""
        if row.link_of is None or row.incomplete:
            return
        head = self.ns.get(row.link_of)
        if head.remote_key is None or self._is_busy(head.ino):
            return
        if not head.incomplete:
            ours, theirs = (head.stamp or "").rpartition("."), (row.stamp or "").rpartition(".")
            if head.state is not State.REMOTE or ours[0] != theirs[0] or \
                    (version_of(head.stamp) or 0) >= (version_of(row.stamp) or 0):
                return
        log.warning("%s: a hard-linked file came back incomplete here; it takes the version "
                    "this node committed under that name (%d bytes)", row.remote_key, row.size)
        self._on_drop(head)
        head.incomplete = False
        head.state = State.REMOTE
        head.size, head.checksum, head.blocks = row.size, row.checksum, row.blocks
        head.mode, head.uid, head.gid = row.mode, row.uid, row.gid
        head.mtime_ns, head.ctime_ns = row.mtime_ns, row.ctime_ns
        head.stamp, head.version = row.stamp, row.version
        head.closed_at, head.committed_at = row.closed_at, row.committed_at
        self.ns.persist(head)

    def _lost_to_power(self, remote: dict[bytes, ObjectInfo], details: dict[str, ObjectInfo],
                       before: dict[bytes, Row]) -> dict[str, Row]:
        """Files of this node that came back incomplete while the store holds another
        node's version at their key (key -> row): ``Peers.replaced`` says which of them
        another node replaced after this node committed them."""
        found: dict[str, Row] = {}
        for name, listed in remote.items():
            row = before.get(name)
            info = details.get(listed.key, listed)
            if row is not None and self._recoverable(row, None) and info.meta_known and \
                    info.meta.kind is Kind.FILE and self.peers.foreign(info.meta.stamp):
                found[info.key] = row
        return found

    def _removed_while_lost(self, prefix: str, remote: dict[bytes, ObjectInfo],
                            before: dict[bytes, Row]) -> dict[str, Row]:
        """Files of this node that came back incomplete and that the store no longer holds
        (key -> row): ``Peers.replaced`` says which of them another node deleted or moved
        after this node committed them (their records name the version)."""
        found: dict[str, Row] = {}
        for name, row in before.items():
            if name not in remote and self._recoverable(row, None):
                found[self._key_of(prefix, name, row)] = row
        return found

    def _maybe_update_special(self, row: Row, info: ObjectInfo) -> None:
        """Another node changed a special file's metadata (chmod, chown, touch): take it.
        It has no data, so there is nothing to drop."""
        if not info.meta_known:
            return  # the HEAD failed: the next listing decides (no tag test: _needs_meta)
        meta = info.meta
        if (meta.mode, meta.rdev, meta.uid, meta.gid) == (row.mode, row.rdev, row.uid, row.gid) \
                and meta.mtime_ns in (0, row.mtime_ns):
            return  # what this row put (its set-id bits included: mapped here, not from there)
        special = special_mode(info.meta.mode, info.meta.rdev)
        if special is None or stat.S_IFMT(special[0]) != stat.S_IFMT(row.mode):
            return  # refused, or another type: _same_kind's case, not an update
        uid, gid = owner(info.meta.uid), owner(info.meta.gid)
        mtime = info.meta.mtime_ns or row.mtime_ns
        if (row.mode, row.rdev, row.uid, row.gid, row.mtime_ns, row.remote_etag) == \
                (*special, uid, gid, mtime, info.etag):
            return  # read at every refresh (_needs_meta): write the journal only on a change
        row.mode, row.rdev = special
        row.uid, row.gid = uid, gid
        if mtime != row.mtime_ns:
            row.mtime_ns = row.ctime_ns = mtime
        row.remote_etag = info.etag
        self.ns.persist(row)

    async def _entries_first(self, directory: Row, row: Row) -> None:
        """A directory whose key is gone from the store still has entries here: they are
        decided first (a listing of it and of every directory below), then its parent is
        listed again at once, which drops it if they went."""
        await self.refresh_tree(row, current=True)
        self._fresh_until.pop(directory.ino, None)

    def _remove(self, directory: Row, name: bytes, row: Row) -> bool:
        """Another node removed it: drop it here too (no tombstone: it is gone already). A
        name of a linked file goes alone; if it was the head's, the head takes another
        name and, unless that name's object holds its bytes, is carried there."""
        succession = self.ns.succession(row)
        try:
            self.ns.unlink(directory.ino, name, directory=stat.S_ISDIR(row.mode))
        except NotEmpty:
            # Its entries go first: list it now (another node may have renamed it with
            # entries this node wrote; peers.py decides about them), the next listing of
            # this directory then drops it: that listing is due at once, not a ttl later.
            if self.nursery is not None:
                self.nursery.start_soon(self._entries_first, directory, row)
            return False
        except CkptfsError as exc:
            log.warning("cannot drop %r (gone from the store): %s", name, exc)
            return False
        log.info("%s: gone from the store; removed here too",
                 os.fsdecode(name))
        if succession is not None and not succession[1] and self._on_relocated is not None:
            self._on_relocated(row.ino)
        return True

