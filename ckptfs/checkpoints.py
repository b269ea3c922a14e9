"""Checkpoints: what retention works on, built from the journal and from tier listings.

A *checkpoint* is a top-level entry of the mount (``step_1000/``, ``ckpt_step_1000.pt``,
``global_step1000/``, ``iter_0001000/``). Its *step* is parsed from the name with
``step_regex`` (default: the last integer). A top-level entry whose name has no step
(``latest``, ``latest_checkpointed_iteration.txt``) is a *pointer*: retention never deletes
it and copies it to every tier that holds checkpoint data.

A checkpoint's *time* is when its last file was committed to the warm tier (the journal's
``committed_at``), not the modification time of a remote copy: copying it to a colder tier
does not make it younger. A checkpoint this node never wrote (known only from the store) gets
the newest ``mtime`` its objects carry in their ckptfs metadata.

Which tiers hold a checkpoint is decided on *files* (regular files; directory markers and
symlinks are not part of the test): a tier holds it when every file of the checkpoint is there
with its size (and checksum, where the listing tells it). The files of a checkpoint are the
journal's when this node knows it, else the union over the tiers.

``build`` is pure (tests drive it directly); ``collect`` gathers its inputs from a live
namespace and the tiers.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ckptfs.journal import ROOT_INODE, Row, State

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
    """The checkpoint a key belongs to: its first path component."""
    return key.split("/", 1)[0]


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


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint (or pointer) and where it is."""

    name: str
    step: int | None
    time: float | None  # when its last file was committed; None while not committed
    size: int
    # None when complete; else why retention must not touch it: "writing" (a file is open for
    # writing or has no file yet), "uploading" (staged or uploading), "incomplete" (a writer
    # died before closing a file).
    busy: str | None = None
    held: frozenset[str] = frozenset()  # tiers with every file
    partial: frozenset[str] = frozenset()  # tiers with some files but not all
    progress: float | None = None  # fraction uploaded to the warm tier, while uploading
    restoring: frozenset[str] = frozenset()  # tiers where a restore from archive is running
    files: tuple[tuple[str, int], ...] = ()  # (key, size) of every file
    in_use: bool = False  # a file is open: no eviction, no deletion

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
) -> list[Checkpoint]:
    """Checkpoints from the journal's files and each remote tier's files, oldest step first.

    ``tier_order`` names every tier, ``hot`` first; ``local_entries`` are top-level names the
    journal has (a checkpoint directory with no file yet counts as being written);
    ``progress`` gives bytes already sent of each uploading file (by key).
    """
    pattern = re.compile(step_regex)
    progress = progress or {}
    accs: dict[str, _Acc] = {}
    for name in local_entries:
        accs.setdefault(name, _Acc()).has_entry = True
    for f in local_files:
        acc = accs.setdefault(top_level(f.key), _Acc())
        acc.has_entry = True
        acc.local.append(f)
    for tier, files in remote.items():
        for r in files:
            accs.setdefault(top_level(r.key), _Acc()).remote.setdefault(tier, []).append(r)
    result = []
    for name, acc in accs.items():
        result.append(_checkpoint(name, acc, pattern, tier_order, progress))
    result.sort(key=lambda c: (c.step is None, c.step if c.step is not None else 0,
                               c.time or 0.0, c.name))
    return result


def _checkpoint(name: str, acc: _Acc, pattern: re.Pattern[str], tier_order: Sequence[str],
                progress: Mapping[str, float]) -> Checkpoint:
    step = parse_step(name, pattern)
    by_tier = {t: {r.key: r for r in files} for t, files in acc.remote.items()}
    busy: str | None = None
    checksums: dict[str, str | None] = {}
    if acc.has_entry:
        files = {f.key: f.size for f in acc.local}
        checksums = {f.key: f.checksum for f in acc.local}
        if any(f.incomplete for f in acc.local):
            busy = "incomplete"
        elif not acc.local or any(f.state is State.OPEN for f in acc.local):
            busy = "writing"
        elif any(f.state in (State.STAGED, State.UPLOADING) for f in acc.local):
            busy = "uploading"
        # Files this node did not write (known from a store listing) carry their mtime.
        times = [f.committed_at if f.committed_at is not None else f.mtime
                 for f in acc.local]
        time = max((t for t in times if t is not None), default=None) \
            if busy is None else None
    else:
        files = {}
        for tier in tier_order:  # the union over tiers; sizes from the warmest
            for key, r in by_tier.get(tier, {}).items():
                files.setdefault(key, r.size)
        time = None
    if time is None and busy is None:
        mtimes = [r.mtime for t in by_tier.values() for r in t.values() if r.mtime is not None]
        time = max(mtimes) if mtimes else None
    held, partial, restoring = set(), set(), set()
    for tier in tier_order:
        if tier == HOT:
            local = [f for f in acc.local if f.local]
            if local and len(local) == len(acc.local) and acc.local and busy is None:
                held.add(tier)
            elif local:
                partial.add(tier)
            continue
        present = by_tier.get(tier, {})
        if not present:
            continue
        if any(r.restoring for r in present.values()):
            restoring.add(tier)
        whole = bool(files) and all(
            key in present and present[key].size == size
            and (checksums.get(key) is None or present[key].checksum is None
                 or present[key].checksum == checksums[key])
            for key, size in files.items())
        (held if whole else partial).add(tier)
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
        in_use=any(f.open for f in acc.local),
    )


# -- the journal side ---------------------------------------------------------------------


def journal_files(rows_of: RowSource) -> tuple[list[LocalFile], list[str]]:
    """Every regular file under the mount root, and the top-level names, from the namespace."""
    files: list[LocalFile] = []
    names: list[str] = []
    for top in rows_of.children(ROOT_INODE, 0):
        assert top.name is not None
        name = os.fsdecode(top.name)
        names.append(name)
        _walk(rows_of, top, name, files)
    return files, names


def _walk(rows_of: RowSource, row: Row, key: str, out: list[LocalFile]) -> None:
    if stat.S_ISREG(row.mode):
        # A row the store listing added has no closed_at: its committed_at is when it was
        # listed, not when it was committed.
        committed = row.committed_at if row.closed_at is not None else None
        out.append(LocalFile(key, row.ino, row.size, row.state, row.incomplete, committed,
                             row.checksum, rows_of.open_count(row.ino) > 0,
                             row.mtime_ns / 1e9 if row.mtime_ns else None))
    elif stat.S_ISDIR(row.mode):
        for child in rows_of.children(row.ino, 0):
            assert child.name is not None
            _walk(rows_of, child, key + "/" + os.fsdecode(child.name), out)


class RowSource(Protocol):
    """What ``journal_files`` needs of a namespace (``Namespace`` has both methods)."""

    def children(self, parent: int, after_ino: int) -> Iterable[Row]: ...

    def open_count(self, ino: int) -> int: ...
