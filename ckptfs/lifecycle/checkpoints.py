"""Checkpoints: what retention works on, built from the journal and from tier listings.

*Detection* (``Detector``): ``checkpoint_pattern`` is a regular expression with a named group
``step``, searched in each key (the path relative to the mount root); the checkpoint is the
path up to the end of the component in which ``step`` matched: ``runs/exp1/step_100/model.pt``
belongs to the checkpoint ``runs/exp1/step_100`` (step 100), ``ckpt_step_1000.pt`` is a
checkpoint by itself. The default matches ``step_100``, ``step-100``, ``step100``,
``checkpoint-500`` (HF), ``iter_0000500`` (Megatron), ``global_step500`` (DeepSpeed) and
``ckpt_step_1000.pt`` at any depth, but not a name ending in ``.tmp`` (``step_100.tmp/``, a
checkpoint being written under a temporary name). The legacy ``step_regex`` (when configured
instead) keeps the old rule: every top-level entry is a checkpoint, its step the regex's
first group. A key that belongs to no checkpoint belongs to a *pointer* named by its
top-level component (``latest``, ``latest_checkpointed_iteration.txt``): retention never
deletes it and copies it to every tier that holds checkpoint data.

*Complete*: a checkpoint is complete only when its **commit marker** is present: an object
whose file name matches ``commit_markers`` (``.metadata``, ``COMMITTED``, ``*.done``, ...)
somewhere inside it, in the store or committed in the journal. A checkpoint that is a single
file is its own marker (an object appears whole). Without a marker it is ``"no marker"`` and
retention leaves it alone: never counted as the newest or among the last N, never copied,
evicted, removed or deleted (see docs/RETENTION.md: an abandoned one is removed by hand).
Besides, a checkpoint with a file this node is writing or uploading is busy, as before.
*Settling* (``settle``) relaxes the marker rule for a single writer (plain ``torch.save``
into ``step_N/``): with no other node registered with the store, a checkpoint without a
marker whose files are all committed is complete once a later checkpoint was written after
it, or ``checkpoint_settle`` after its last file; each one still left alone carries a
``note`` saying why and how to add a marker.

A checkpoint's *time* is when its last file was committed to the warm tier (the journal's
``committed_at``), not the modification time of a remote copy: copying it to a colder tier
does not make it younger. A checkpoint this node never wrote (known only from the store) gets
the newest ``mtime`` its objects carry in their ckptfs metadata.

Which tiers hold a checkpoint is decided on *files* (regular files; directory markers,
symlinks and special files are not part of the test, and a special file is never a marker): a tier holds it when every file of the checkpoint is there
with its size (and checksum, where the listing tells it). The files of a checkpoint are the
objects the warmest tier that has any of it lists under it (other nodes write shards this
journal never heard of) plus the journal's files, whose sizes win. Colder tiers are not
merged in: a stale leftover there must not make the warmer copy look partial. Tiers that are
storage classes of that tier's prefix are merged in (the same keys: one object per key), so
that a checkpoint halfway through a transition or a restore is seen with all its files.

``build`` is pure (tests drive it directly); ``collect`` gathers its inputs from a live
namespace and the tiers.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ckptfs.config import DEFAULT_CHECKPOINT_PATTERN
from ckptfs.state.journal import ROOT_INODE, Row, State

HOT = "hot"


def parse_step(name: str, step_regex: str | re.Pattern[str]) -> int | None:
    """The step in a top-level name, or None for a pointer (``latest``)."""
    pattern = re.compile(step_regex) if isinstance(step_regex, str) else step_regex
    match = pattern.search(name)
    if match is None or match.group(1) is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        return None


def top_level(key: str) -> str:
    """The first path component of a key (the name of a pointer)."""
    return key.split("/", 1)[0]


@dataclass(frozen=True)
class Detector:
    """Which checkpoint (or pointer) a key belongs to, and its step (module docstring).

    Invariant: ``locate`` of every key under a checkpoint's path gives that checkpoint, so
    the objects of a checkpoint are exactly the keys equal to its name or under ``name/``
    whose ``locate`` names it."""

    pattern: re.Pattern[str]
    step_regex: re.Pattern[str] | None = None  # legacy: top-level names, first group

    @classmethod
    def from_pattern(cls, pattern: str = DEFAULT_CHECKPOINT_PATTERN,
                     step_regex: str | None = None) -> Detector:
        return cls(re.compile(pattern), re.compile(step_regex) if step_regex else None)

    def locate(self, key: str) -> tuple[str, int | None]:
        """(checkpoint or pointer name, step; None for a pointer) of a key."""
        key = key.rstrip("/")
        if self.step_regex is not None:
            name = top_level(key)
            return name, parse_step(name, self.step_regex)
        match = self.pattern.search(key)
        if match is None:
            return top_level(key), None
        try:
            step = int(match.group("step"))
        except (IndexError, TypeError, ValueError):
            return top_level(key), None
        end = key.find("/", match.end("step"))
        return (key if end < 0 else key[:end]), step

    def name_of(self, key: str) -> str:
        return self.locate(key)[0]


DEFAULT_DETECTOR = Detector.from_pattern()


@dataclass(frozen=True, slots=True)
class LocalFile:
    """One regular file of the journal, as retention sees it."""

    key: str  # path relative to the mount root
    ino: int
    size: int
    state: State
    incomplete: bool = False
    # When this node committed it (None for a file only known from a store listing).
    committed_at: float | None = None
    checksum: str | None = None
    open: bool = False  # a handle is open on it (reading or writing)
    mtime: float | None = None  # the file's own mtime (seconds)
    # When its writer last closed it here (None for a file only known from a store listing).
    # The settle rule orders checkpoints by this, not by ``committed_at``: uploads run in
    # parallel, so a later checkpoint's files can be committed before an earlier one's.
    closed_at: float | None = None
    # The row's version (journal.py ``next_version``): retention deletes a checkpoint only
    # if no file of it was written here since the plan.
    version: int = 0

    @property
    def local(self) -> bool:
        """Its whole data is on NVMe."""
        return self.state is not State.REMOTE


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One object of a tier, assigned to that tier (co-located tiers split by class)."""

    key: str
    size: int
    checksum: str | None = None
    mtime: float | None = None  # from ckptfs metadata, when known
    storage_class: str = "STANDARD"
    restoring: bool = False
    etag: str | None = None
    # The empty object of a FIFO, socket or device node (tiers/base.py): never a file of its
    # checkpoint nor a marker, but still one of its keys (removed with it).
    special: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint (or pointer) and where it is."""

    name: str
    step: int | None
    time: float | None  # when its last file was committed; None while not committed
    size: int
    # None when complete; else why retention must not touch it: "writing" (a file is open for
    # writing or has no file yet), "uploading" (staged or uploading), "incomplete" (a writer
    # died before closing a file), "no marker" (no commit marker object in it: its writers,
    # on any node, may not be done).
    busy: str | None = None
    held: frozenset[str] = frozenset()  # tiers with every file
    partial: frozenset[str] = frozenset()  # tiers with some files but not all
    progress: float | None = None  # fraction uploaded to the warm tier, while uploading
    restoring: frozenset[str] = frozenset()  # tiers where a restore from archive is running
    files: tuple[tuple[str, int], ...] = ()  # (key, size) of every file
    in_use: bool = False  # a file is open: no eviction, no deletion
    # Tiers sharing one location (storage classes of a prefix) that hold it only together:
    # an in-place transition cut short left some files in one class, the rest in another.
    # Each member is ``partial``; the location still has every file once (the planner
    # completes the transition from them).
    spread: frozenset[str] = frozenset()
    # Restore pins (pins.py): (tier, until wall time); the tier keeps it until then.
    pins: tuple[tuple[str, float], ...] = ()
    # Without a marker: when its last file was written (the settle rule, ``settle``).
    last_write: float | None = None
    # Why retention leaves it alone, or why it takes it as complete without a marker
    # (shown by ls-tiers and retention --plan).
    note: str | None = None

    @property
    def is_pointer(self) -> bool:
        return self.step is None

    @property
    def complete(self) -> bool:
        return self.busy is None


@dataclass
class _Acc:
    local: list[LocalFile] = field(default_factory=list)
    remote: dict[str, list[RemoteFile]] = field(default_factory=dict)
    has_entry: bool = False  # known to the journal (even as an empty directory)


def build(
    local_files: Iterable[LocalFile],
    remote: Mapping[str, Iterable[RemoteFile]],
    *,
    step_regex: str,
    tier_order: Sequence[str],
    local_entries: Iterable[str] = (),
    progress: Mapping[str, float] | None = None,
    detector: Detector | None = None,
    markers: Sequence[str] | None = None,
    locations: Mapping[str, str] | None = None,
) -> list[Checkpoint]:
    """Checkpoints from the journal's files and each remote tier's files, oldest step first.

    ``tier_order`` names every tier, ``hot`` first; ``local_entries`` are paths of entries
    the journal has (a checkpoint directory with no file yet counts as being written);
    ``progress`` gives bytes already sent of each uploading file (by key). ``detector``
    (default: the legacy top-level rule with ``step_regex``) groups keys into checkpoints;
    with ``markers`` (``commit_markers``), a checkpoint with no marker object is not complete;
    ``locations`` (tier -> location) tells which tiers are classes of one prefix (``spread``).
    """
    if detector is None:
        detector = Detector.from_pattern(step_regex=step_regex)
    progress = progress or {}
    accs: dict[str, _Acc] = {}
    steps: dict[str, int | None] = {}

    def acc_of(key: str) -> _Acc:
        name, step = detector.locate(key)
        steps[name] = step
        return accs.setdefault(name, _Acc())

    for entry in local_entries:
        name, step = detector.locate(entry)
        if step is not None or "/" not in entry.rstrip("/"):
            acc_of(entry).has_entry = True
    for f in local_files:
        acc = acc_of(f.key)
        acc.has_entry = True
        acc.local.append(f)
    for tier, files in remote.items():
        for r in files:
            acc_of(r.key).remote.setdefault(tier, []).append(r)
    result = []
    for name, acc in accs.items():
        result.append(_checkpoint(name, steps[name], acc, tier_order, progress, markers,
                                  locations or {}))
    result.sort(key=lambda c: (c.step is None, c.step if c.step is not None else 0,
                               c.time or 0.0, c.name))
    return result


def _checkpoint(name: str, step: int | None, acc: _Acc, tier_order: Sequence[str],
                progress: Mapping[str, float], markers: Sequence[str] | None,
                locations: Mapping[str, str]) -> Checkpoint:
    # Special files have no data: they decide neither where a checkpoint is nor whether it
    # is complete (a FIFO named like a marker is no marker).
    by_tier = {t: {r.key: r for r in files if not r.special} for t, files in acc.remote.items()}
    busy: str | None = None
    checksums: dict[str, str | None] = {}
    # The files are the warmest tier's listing of the checkpoint (it has the shards other
    # nodes wrote) plus the journal's own files, which override (this node knows them best).
    # Colder tiers are not merged in: a stale leftover there must not make the warm copy
    # look partial.
    # Tiers that are classes of one prefix share their keys (one object per key): their
    # listings together are that location's, e.g. halfway through an in-place transition
    # or a restore, some objects are in one class and the rest in another.
    files: dict[str, int] = {}
    for tier in tier_order:
        if by_tier.get(tier):
            where = locations.get(tier)
            for member in tier_order:
                if member == tier or (where is not None and locations.get(member) == where):
                    files.update({key: r.size for key, r in by_tier.get(member, {}).items()})
            break
    if acc.has_entry:
        files.update({f.key: f.size for f in acc.local})
        checksums = {f.key: f.checksum for f in acc.local}
        if any(f.incomplete for f in acc.local):
            busy = "incomplete"
        elif (not acc.local and not files) or any(f.state is State.OPEN for f in acc.local):
            busy = "writing"
        elif any(f.state in (State.STAGED, State.UPLOADING) for f in acc.local):
            busy = "uploading"
        # Files this node did not write (known from a store listing) carry their mtime.
        times = [f.committed_at if f.committed_at is not None else f.mtime
                 for f in acc.local]
        time = max((t for t in times if t is not None), default=None) \
            if busy is None else None
    else:
        time = None
    no_marker = busy is None and step is not None and markers is not None \
        and not _has_marker(name, files, acc, by_tier, markers)
    if time is None and busy is None:
        mtimes = [r.mtime for t in by_tier.values() for r in t.values() if r.mtime is not None]
        time = max(mtimes) if mtimes else None
    last_write = None
    if no_marker:
        busy = "no marker"
        closed = [f.closed_at for f in acc.local if f.closed_at is not None]
        # For the settle rule (``settle``): when it was last written here, else its time.
        last_write, time = (max(closed) if closed else time), None
    held, partial, restoring = set(), set(), set()
    for tier in tier_order:
        if tier == HOT:
            local = [f for f in acc.local if f.local]
            # Held on NVMe: every file of the checkpoint (others' shards too) is local here,
            # committed or not (a checkpoint without a marker is held as much as any other:
            # whether it is complete is another question, ``busy``).
            if local and len(local) == len(acc.local) and busy in (None, "no marker") \
                    and {f.key for f in local} >= files.keys():
                held.add(tier)
            elif local:
                partial.add(tier)
            continue
        present = by_tier.get(tier, {})
        if not present:
            continue
        if any(r.restoring for r in present.values()):
            restoring.add(tier)
        (held if _whole(files, present, checksums) else partial).add(tier)
    spread: set[str] = set()
    by_location: dict[str, list[str]] = {}
    for tier in partial:
        if tier in locations:
            by_location.setdefault(locations[tier], []).append(tier)
    for location, members in by_location.items():
        if len(members) < 2 or any(t in held for t in tier_order
                                   if locations.get(t) == location):
            continue
        union: dict[str, RemoteFile] = {}
        for tier in members:
            union.update(by_tier.get(tier, {}))
        if _whole(files, union, checksums):
            spread.update(members)
    fraction = None
    if busy == "uploading":
        total = sum(f.size for f in acc.local) or 1
        done = sum(f.size if f.state is State.COMMITTED or f.state is State.REMOTE
                   else min(f.size, int(progress.get(f.key, 0))) for f in acc.local)
        fraction = done / total
    return Checkpoint(
        name=name, step=step, time=time, size=sum(files.values()), busy=busy,
        held=frozenset(held), partial=frozenset(partial), progress=fraction,
        restoring=frozenset(restoring), files=tuple(sorted(files.items())),
        in_use=any(f.open for f in acc.local), spread=frozenset(spread),
        last_write=last_write,
    )


def _whole(files: Mapping[str, int], present: Mapping[str, RemoteFile],
           checksums: Mapping[str, str | None]) -> bool:
    """Every file is in ``present`` with its size (and checksum, where both are known)."""
    return bool(files) and all(
        key in present and present[key].size == size
        and (checksums.get(key) is None or present[key].checksum is None
             or present[key].checksum == checksums[key])
        for key, size in files.items())


MARKER_HINT = ("to mark a checkpoint complete, have the job write a file named COMMITTED "
               "into it after its last file, or add the name of the file it writes last to "
               "commit_markers")


def settle(checkpoints: Sequence[Checkpoint], *, after: float, now: float,
           other_writers: Sequence[str] = ()) -> list[Checkpoint]:
    """The settle rule for checkpoints without a commit marker (plain ``torch.save`` into
    ``step_N/``): one is taken as complete when
    - every file of it is committed (this node has nothing of it open, staged, uploading or
      incomplete: checked before, or it would not be ``no marker``),
    - no other node is registered with the store (``other_writers`` empty): another node's
      shards may still be on their way, which only a marker can rule out, and
    - a later checkpoint (a higher step in the same directory, written after this one's
      last file) exists (the writer moved on), or nothing was written to it for ``after``
      seconds (0: never by time; a negative ``after`` turns the rule off).
    Each checkpoint still left alone gets a ``note`` saying why and how to add a marker."""
    # Per directory: (step, when it was last written) of each checkpoint. A later one must
    # have been written after this one's last file: a higher step left by an earlier run
    # (training resumed from an older checkpoint) says nothing about this one.
    written: dict[str, list[tuple[int, float]]] = {}
    for c in checkpoints:
        when = c.time if c.time is not None else c.last_write
        if c.busy in ("writing", "uploading"):
            when = now  # being written here now
        if c.step is not None and when is not None:
            written.setdefault(c.name.rpartition("/")[0], []).append((c.step, when))
    out = []
    for c in checkpoints:
        if c.busy != "no marker" or c.step is None:
            out.append(c)
            continue
        last = c.last_write
        next_exists = last is not None and any(
            step > c.step and when > last
            for step, when in written.get(c.name.rpartition("/")[0], []))
        quiet = c.last_write is not None and after > 0 and now - c.last_write >= after
        if after < 0:
            note = f"no commit marker (checkpoint_settle is off): {MARKER_HINT}"
        elif other_writers:
            names = ", ".join(sorted(other_writers)[:3])
            more = len(other_writers) - 3
            note = (f"no commit marker, and other nodes write to the store ({names}"
                    f"{f' and {more} more' if more > 0 else ''}): their files may still be "
                    f"on their way; {MARKER_HINT}")
        elif next_exists or quiet:
            why = "a later checkpoint exists" if next_exists else \
                f"nothing written to it for {_span(after)}"
            out.append(replace(c, busy=None, time=c.last_write,
                               note=f"no commit marker; complete: {why}"))
            continue
        else:
            left = "" if c.last_write is None or after <= 0 else \
                f" ({_span(max(0.0, after - (now - c.last_write)))} left)"
            note = ("no commit marker: complete once a later checkpoint exists"
                    + (f" or {_span(after)} after its last file{left}" if after > 0 else "")
                    + f"; {MARKER_HINT}")
        out.append(replace(c, note=note))
    return out


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}" if seconds % size == 0 or seconds >= 10 * size \
                else f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _has_marker(name: str, files: Mapping[str, int], acc: _Acc,
                by_tier: Mapping[str, Mapping[str, RemoteFile]], markers: Sequence[str]) -> bool:
    """A committed marker object inside the checkpoint (in a store, or committed by this
    node), or the checkpoint is one file (an object appears whole)."""
    if set(files) == {name}:
        return True
    present = {f.key for f in acc.local if f.state in (State.COMMITTED, State.REMOTE)}
    for objects in by_tier.values():
        present.update(objects)
    return any(is_marker_key(key, markers) for key in present)


def is_marker_key(key: str, markers: Sequence[str]) -> bool:
    """Whether the file name of ``key`` matches a ``commit_markers`` pattern."""
    base = key.rstrip("/").rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(base, m) for m in markers)


# -- the journal side ---------------------------------------------------------------------


def journal_files(rows_of: RowSource) -> tuple[list[LocalFile], list[str]]:
    """Every regular file under the mount root, and the paths of every entry (directories
    included: a checkpoint directory with no file yet is being written), from the namespace."""
    files: list[LocalFile] = []
    names: list[str] = []
    for _ in walk_journal(rows_of, files, names):
        pass
    return files, names


def walk_journal(rows_of: RowSource, files: list[LocalFile], names: list[str]
                 ) -> Iterator[None]:
    """``journal_files`` one entry at a time: fills ``files`` and ``names`` and yields after
    each entry, so that a caller on the trio thread can let other tasks run between entries
    (retention.py: then it must check that nothing moved meanwhile, ``Namespace.moves``)."""
    for top in rows_of.children(ROOT_INODE, 0):
        assert top.name is not None
        name = os.fsdecode(top.name)
        yield from _walk(rows_of, top, name, files, names)


def _walk(rows_of: RowSource, row: Row, key: str, out: list[LocalFile],
          names: list[str]) -> Iterator[None]:
    names.append(key)
    if stat.S_ISREG(row.mode):
        # A row the store listing added has no closed_at: its committed_at is when it was
        # listed, not when it was committed.
        committed = row.committed_at if row.closed_at is not None else None
        out.append(LocalFile(key, row.ino, row.size, row.state, row.incomplete, committed,
                             row.checksum, rows_of.open_count(row.link_of or row.ino) > 0,
                             row.mtime_ns / 1e9 if row.mtime_ns else None, row.closed_at,
                             row.version))
    yield
    if stat.S_ISDIR(row.mode):
        for child in rows_of.children(row.ino, 0):
            assert child.name is not None
            yield from _walk(rows_of, child, key + "/" + os.fsdecode(child.name), out, names)


class RowSource(Protocol):
    """What ``journal_files`` needs of a namespace (``Namespace`` has both methods)."""

    def children(self, parent: int, after_ino: int) -> Iterable[Row]: ...

    def open_count(self, ino: int) -> int: ...
