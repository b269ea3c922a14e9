"""Retention: which checkpoint lives in which tier (docs/RETENTION.md).

Two parts:
- ``plan(checkpoints, policy, now) -> [Action]`` is pure: it sees checkpoints (checkpoints.py)
  and the tiers' ``keep`` rules and says what to copy, remove, evict and delete.
- ``Retention`` collects the checkpoints from the namespace and the tiers' listings (every
  node's checkpoints; checkpoints.py says what a checkpoint is and when it is complete),
  applies a plan (copy, verify, then remove), and runs as a task in the mount's nursery:
  after the uploader went idle following a commit (a local round), and every
  ``retention_interval`` (the whole store), the first time one interval after the start, not
  at the start (``Retention.run``). Of the nodes sharing a store, only the holder of the
  retention lease (lease.py) applies.

Selection, per tier (the union of its rules; complete checkpoints only, but for milestones):
- ``last = N``: the N highest steps;
- ``hourly/daily/weekly = W``: the newest checkpoint of each UTC hour / day / week (weeks
  start on Monday) whose time is within W of now;
- ``milestones = [f, ...]``: for each fraction, the checkpoint with the smallest step at or
  past ``f * total_steps`` (any checkpoint, so that the choice never moves once made).

Invariants the planner keeps (tests/test_retention.py checks them with hypothesis):
- a checkpoint that is being written, uploaded, has an incomplete file, or has no commit
  marker is never touched (and never counts as the newest or among the last N);
- a copy is removed only once every tier that must hold the checkpoint holds it, and never
  the last committed copy on a tier other than NVMe; the NVMe copy is evicted only while such
  a copy exists and stays;
- the newest complete checkpoint is always kept (where it is, if no rule selects it);
- milestones are never deleted; pointers (names with no step) are never removed, and are
  copied to every location that holds checkpoint data.

Tiers that share one location (``s3://b/p`` and ``s3://b/p?storage_class=GLACIER``) are one
copy per key: a checkpoint several of them select is kept in the warmest of them (it serves
the colder ones' purpose too), and moving it to a colder one is an in-place storage-class
transition. Leaving an archive class (GLACIER, DEEP_ARCHIVE) needs a restore first: such a
step is planned but marked blocked. A transition cut short (files in both classes, no tier
holding it whole) is completed from the location (``Checkpoint.spread``), never removed.

Besides the rules:
- a restore pin (pins.py) makes a tier keep what ``ckptfs restore`` put there until it
  expires; the pins are read after the objects are listed, so a run that sees a restored
  object sees its pin;
- a checkpoint without a marker may settle (checkpoints.settle: a single writer, every file
  committed, a later checkpoint or ``checkpoint_settle`` of quiet); with another node
  registered it never does;
- the journal learns the storage class of this node's files on the warm tier's prefix from
  every transition it verifies and from every run's listing (an evicted file in an archive
  class reads ``archived``): only a row still pointing at that object with the same bytes.

A round lets the loop run: the journal is walked ``YIELD_EVERY`` entries at a time,
the listings processed likewise, and the pure parts (the checkpoints, the plan, the report)
run in a worker thread on values the round owns (never the journal: it is trio-thread only).
Interleavings this allows, and why none of them deletes or evicts what must stay:
- *Anything between the inventory and an action* (a write, an open, a rename, an upload, a
  fetch) could already happen before: every store request of a round awaited. The plan is
  made from a snapshot; what an action relies on is checked again when it starts, in the same
  synchronous stretch as its first change: an eviction checks that no file of the checkpoint
  is open, takes only rows that are COMMITTED with a store key and not open, and marks them
  REMOTE before its first await (``Filesystem._mark_evicted``); a deletion checks open files,
  then ``_forget`` checks each file again just before its unlink; a copy from NVMe re-reads
  the row (REMOTE: refused) and checks the checksum of what it reads; an action under the
  lease starts only while the lease is valid; the journal learns a storage class only for a
  row read afresh that still names the listed object with the same bytes.
- *A walk of the journal with pauses* could see a state the tree never was in: an entry moved
  (rename, exchange, a head taking its alias's name) from a part not walked yet to one walked
  already is missed, one moved the other way is seen twice (a phantom checkpoint could push a
  real one out of ``last N``). ``Namespace.moves`` counts such moves: a walk during which it
  changed is thrown away and walked again, and after ``WALK_TRIES`` spoilt walks once without
  pauses. Entries created or removed during a walk are seen or not, as if the walk had been
  made just before or just after them: what a walk without pauses made a moment earlier or
  later would see.
- *A crash* in a pause is a crash between two steps of the applier as before: the order of
  each action's steps is unchanged (a deletion: the namespace, the retirement record, then
  the store, markers first; a removal: the retirement record, markers first; a copy: markers
  last, verified), and the next round plans again from what is there.
- *Another node holding the lease*: unchanged. A local round evicts only this node's NVMe
  copies of checkpoints a store tier holds (no lease needed), an interval round skips when
  another node holds it; the renewals of a lease held run beside a round's pauses, which
  only helps them.
- *A retry*: failed actions are retried by the next round; an interval round that failed
  (the store unreachable) is tried again one interval later; ``ckptfs retention --apply``
  during a round waits for it (one round at a time: ``_lock``).
- *An unmount* during a worker thread's computation waits for it (no abandoned threads; it
  writes nothing).
- *Deferring the first interval round* never makes a round do anything it would not have
  done: it only happens later. What a restart delays by up to one interval (copies to colder
  tiers, removals, deletions of what no node's NVMe has) stays where it is meanwhile; a full
  staging disk evicts by itself (fs.py), and every commit still brings its local round.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import trio

from ckptfs.cluster.coordination import NODES
from ckptfs.cluster.lease import Holder, Lease
from ckptfs.cluster.peers import Peers
from ckptfs.config import Config, KeepRules, TierConfig
from ckptfs.errors import CkptfsError
from ckptfs.lifecycle.checkpoints import (
    DEFAULT_DETECTOR,
    HOT,
    Checkpoint,
    Detector,
    LocalFile,
    RemoteFile,
    build,
    is_marker_key,
    journal_files,
    settle,
    walk_journal,
)
from ckptfs.lifecycle.pins import Pin, drop_local, local_pins, store_pins
from ckptfs.state.journal import ROOT_INODE, Row, State
from ckptfs.store.tiers.base import (
    CONTROL_PREFIX,
    Kind,
    NotEmptyYet,
    ObjectInfo,
    ObjectMeta,
    ObjectMissing,
    Tier,
)
from ckptfs.store.tiers.transfer import CopyMismatch, copy_object, put_checked, verify

if TYPE_CHECKING:
    from ckptfs.engine.fs import Filesystem

log = logging.getLogger(__name__)

HEAD_CONCURRENCY = 16  # HEADs in flight while collecting the objects the journal does not know
# Work on the trio thread lets other tasks (FUSE requests) run after this many items (journal
# rows, listed objects): a round over 40,000 files held the loop for up to two seconds.
YIELD_EVERY = 256
WALK_TRIES = 3  # walks of the journal that may be spoiled by a move before one without pauses

HOUR, DAY, WEEK = 3600, 86400, 7 * 86400
_MONDAY = 4 * DAY  # 1970-01-05 was a Monday: weeks start there
MAX_ROUNDS = 3
# Objects in these classes must be restored before they can be read or copied.
ARCHIVE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})


# -- policy ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierPolicy:
    name: str
    keep: KeepRules = field(default_factory=KeepRules)
    # Tiers with the same location share keys (one object per key; the class tells the tier).
    location: str = ""
    # Tiers in one group copy server-side (no data through this node).
    group: str = ""
    storage_class: str = "STANDARD"
    cost_per_tb_month: float = 0.0
    url: str = ""

    @property
    def archived(self) -> bool:
        return self.storage_class in ARCHIVE_CLASSES


@dataclass(frozen=True, slots=True)
class Policy:
    tiers: tuple[TierPolicy, ...]  # hot first
    total_steps: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    def tier(self, name: str) -> TierPolicy:
        return next(t for t in self.tiers if t.name == name)

    @classmethod
    def from_config(cls, config: Config) -> Policy:
        return cls(tuple(tier_policy(t) for t in config.tier), config.total_steps)


def tier_policy(config: TierConfig) -> TierPolicy:
    location, group, cls = tier_location(config)
    return TierPolicy(config.name, config.keep, location, group, cls,
                      config.cost_per_tb_month, config.url or "")


def tier_location(config: TierConfig) -> tuple[str, str, str]:
    """(location, server-side copy group, storage class) of a tier."""
    if config.url is None:
        return HOT, HOT, "STANDARD"
    parts = urlsplit(config.url)
    if parts.scheme == "s3":
        endpoint = config.endpoint_url or ""
        cls = parse_qs(parts.query).get("storage_class", ["STANDARD"])[-1]
        prefix = parts.path.strip("/")
        return f"s3:{endpoint}:{parts.netloc}/{prefix}", f"s3:{endpoint}", cls
    if parts.scheme == "file":
        path = os.path.normpath(unquote(parts.path))
        return f"file:{path}", f"file:{path}", "STANDARD"
    # Memory tiers (tests) have storage classes as S3 does (tiers/memory.py).
    cls = parse_qs(parts.query).get("storage_class", ["STANDARD"])[-1]
    return f"memory:{parts.netloc}{parts.path}", "memory", cls


# -- selection ---------------------------------------------------------------------------


def _order(c: Checkpoint) -> tuple[int, float, str]:
    return (c.step if c.step is not None else -1, c.time or 0.0, c.name)


def newest_complete(checkpoints: Iterable[Checkpoint]) -> Checkpoint | None:
    done = [c for c in checkpoints if c.step is not None and c.complete]
    return max(done, key=_order, default=None)


def milestone_steps(policy: Policy) -> dict[str, list[tuple[float, float]]]:
    """Per tier, (fraction, target step) of each milestone."""
    out: dict[str, list[tuple[float, float]]] = {}
    for t in policy.tiers:
        if t.keep.milestones and policy.total_steps:
            out[t.name] = [(f, f * policy.total_steps) for f in t.keep.milestones]
    return out


def milestones(checkpoints: Sequence[Checkpoint], policy: Policy) -> dict[str, set[str]]:
    """Checkpoint name -> the tiers for which it is a milestone."""
    stepped = sorted((c for c in checkpoints if c.step is not None), key=_order)
    found: dict[str, set[str]] = {}
    for tier, targets in milestone_steps(policy).items():
        for _, target in targets:
            chosen = next((c for c in stepped if c.step is not None
                           and c.step >= target - 1e-9), None)
            if chosen is not None:
                found.setdefault(chosen.name, set()).add(tier)
    return found


def select(checkpoints: Sequence[Checkpoint], policy: Policy, now: float
           ) -> dict[str, dict[str, list[str]]]:
    """Per tier: checkpoint name -> the rules that select it ("last 3", "daily", ...)."""
    complete = sorted((c for c in checkpoints if c.step is not None and c.complete),
                      key=_order, reverse=True)
    stepped = sorted((c for c in checkpoints if c.step is not None), key=_order)
    result: dict[str, dict[str, list[str]]] = {}
    for t in policy.tiers:
        chosen: dict[str, list[str]] = {}
        keep = t.keep
        if keep.all:
            for c in checkpoints:
                if c.step is not None:
                    chosen.setdefault(c.name, []).append("all")
        if keep.last:
            for c in complete[:keep.last]:
                chosen.setdefault(c.name, []).append(f"last {keep.last}")
        for rule, window, width, offset in (("hourly", keep.hourly, HOUR, 0),
                                            ("daily", keep.daily, DAY, 0),
                                            ("weekly", keep.weekly, WEEK, _MONDAY)):
            if window is None:
                continue
            since = now - window.total_seconds()
            buckets: set[int] = set()
            for c in complete:  # newest first: the first seen in a bucket is its newest
                if c.time is None or c.time < since:
                    continue
                bucket = math.floor((c.time - offset) / width)
                if bucket not in buckets:
                    buckets.add(bucket)
                    chosen.setdefault(c.name, []).append(rule)
        for c in checkpoints:
            # A restore pin (pins.py): kept where `ckptfs restore` put it, like a rule.
            until = max((u for tier, u in c.pins if tier == t.name and u > now), default=None)
            if until is not None and c.step is not None:
                chosen.setdefault(c.name, []).append(Pin("", until).describe())
        if keep.milestones and policy.total_steps:
            for fraction in keep.milestones:
                target = fraction * policy.total_steps
                first = next((c for c in stepped if c.step is not None
                              and c.step >= target - 1e-9), None)
                if first is not None:
                    chosen.setdefault(first.name, []).append(f"milestone {fraction:g}")
        result[t.name] = chosen
    return result


# -- the plan ----------------------------------------------------------------------------

ActionKind = Literal["copy", "remove", "evict", "delete"]


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    checkpoint: str
    tier: str | None = None  # copy: the target; remove: the tier it leaves
    source: str | None = None  # copy: where from
    blocked: str | None = None  # why it cannot run yet (a restore from archive is needed)

    def describe(self) -> str:
        if self.kind == "copy":
            text = f"copy {self.source} -> {self.tier}"
        elif self.kind == "remove":
            text = f"remove from {self.tier}"
        elif self.kind == "evict":
            text = "evict from hot"
        else:
            text = "delete"
        return text + (f" (blocked: {self.blocked})" if self.blocked else "")

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "checkpoint": self.checkpoint, "tier": self.tier,
                "source": self.source, "blocked": self.blocked, "text": self.describe()}


def plan(checkpoints: Sequence[Checkpoint], policy: Policy, now: float) -> list[Action]:
    """What to do so that each tier holds what its rules select (see the module docstring)."""
    order = policy.names
    loc = {t.name: t.location for t in policy.tiers}
    group = {t.name: t.group for t in policy.tiers}
    archived = {t.name for t in policy.tiers if t.archived}
    remote = [n for n in order if n != HOT]
    selected = select(checkpoints, policy, now)
    newest = newest_complete(checkpoints)
    actions: list[Action] = []
    data_locations: set[str] = set()

    def source_for(c: Checkpoint, dst: str) -> tuple[str, str | None]:
        holders = [t for t in order if t in c.held]
        readable = [t for t in holders if t not in archived]
        # Spread over classes of dst's location (a transition cut short): completed in
        # place, each file from where it is (the copy skips files dst has).
        spread = [t for t in order if t in c.spread and t != dst and loc[t] == loc[dst]
                  and t not in archived]
        for pool in (
            [t for t in readable if t != HOT and loc[t] == loc[dst]] + spread,  # in place
            [t for t in readable if t != HOT and group[t] == group[dst]],  # server-side
            [t for t in readable if t == HOT],  # local NVMe
            [t for t in readable if t != HOT],
        ):
            if pool:
                return pool[0], None
        src = next((t for t in holders if t != HOT), "?")
        return src, f"only an archived copy ({src}) exists: restore it first"

    for c in checkpoints:
        if c.step is None:
            continue
        present = [t for t in remote if t in c.held or t in c.partial]
        holders = [t for t in remote if t in c.held]
        if not holders and c.busy is None:
            # No tier holds it whole, but the classes of one location do together (an
            # in-place transition cut short): planned as held by them, so that the copy
            # into the class that must hold it completes the transition.
            holders = [t for t in remote if t in c.spread]
        if c.busy is not None or not holders:
            # Busy: not ours to touch. Complete but on no remote tier (its store copy was
            # lost): nothing is safe to do.
            data_locations.update(loc[t] for t in holders)
            continue
        wanted = {t for t in order if c.name in selected.get(t, {})}
        if not wanted:
            if (newest is not None and c.name == newest.name) or c.in_use:
                data_locations.update(loc[t] for t in holders)
                continue  # the newest is always kept, where it is; one in use is kept for now
            actions.append(Action("delete", c.name))
            continue
        # Per location, the warmest tier that wants it; with none, the warmest holder.
        required: list[str] = []
        for t in remote:
            if t in wanted and not any(loc[r] == loc[t] for r in required):
                required.append(t)
        if not required:
            required = [holders[0]]
        kept = set(holders)
        missing = [t for t in required if t not in c.held]
        for dst in missing:
            src, blocked = source_for(c, dst)
            actions.append(Action("copy", c.name, dst, src, blocked))
            if blocked is None:
                kept.add(dst)
        if not missing:
            for t in present:
                if t not in required:
                    actions.append(Action("remove", c.name, t))
                    kept.discard(t)
        data_locations.update(loc[t] for t in kept)
        if (HOT in c.held or HOT in c.partial) and HOT not in wanted and not c.in_use \
                and any(t in c.held for t in required):
            actions.append(Action("evict", c.name))
    for c in checkpoints:
        if c.step is not None or c.busy is not None:
            continue
        have = {loc[t] for t in remote if t in c.held}
        if not have:
            continue  # not uploaded yet (or from a failed copy): the uploader's job
        for location in sorted(data_locations - have, key=lambda x: _first(order, loc, x)):
            dst = next(t for t in remote if loc[t] == location)
            src, blocked = source_for(c, dst)
            actions.append(Action("copy", c.name, dst, src, blocked))
    return actions


def _first(order: Sequence[str], loc: Mapping[str, str], location: str) -> int:
    return next(i for i, t in enumerate(order) if loc[t] == location)


# -- what ls-tiers shows -----------------------------------------------------------------


def report(checkpoints: Sequence[Checkpoint], policy: Policy, now: float,
           actions: Sequence[Action], tier_bytes: Mapping[str, int] | None = None
           ) -> dict[str, Any]:
    """The JSON of ``ckptfs ls-tiers --json`` (stable: keys are only ever added)."""
    selected = select(checkpoints, policy, now)
    by_ckpt: dict[str, list[Action]] = {}
    for a in actions:
        by_ckpt.setdefault(a.checkpoint, []).append(a)
    newest = newest_complete(checkpoints)
    rows = []
    for c in checkpoints:
        tiers = {}
        for t in policy.names:
            if t in c.restoring:
                state = "restoring"
            elif t in c.held:
                state = "committed"
            elif t == policy.names[1] and c.busy == "uploading":
                state = f"uploading {100 * (c.progress or 0.0):.0f}%"
            elif t in c.partial:
                state = "partial"
            else:
                state = "absent"
            tiers[t] = state
        kept_by = [f"{t}: {rule}" for t in policy.names for rule in selected[t].get(c.name, [])]
        if c.step is None:
            kept_by = ["pointer"]
        elif not kept_by and newest is not None and c.name == newest.name:
            kept_by = ["newest complete"]
        elif c.busy is not None:
            kept_by = kept_by or [c.busy]
        rows.append({
            "name": c.name, "step": c.step, "size": c.size, "time": c.time,
            "age_s": None if c.time is None else round(now - c.time, 1),
            "state": "pointer" if c.step is None and c.busy is None else (c.busy or "complete"),
            "tiers": tiers, "kept_by": kept_by,
            "next": [a.describe() for a in by_ckpt.get(c.name, [])],
            # Restore pins still in force: tier -> until (wall time).
            "pinned": {t: max(u for p, u in c.pins if p == t)
                       for t in sorted({p for p, u in c.pins if u > now})},
            # Why it is left alone, or taken as complete without a marker (settle rule).
            "note": c.note,
        })
    if tier_bytes is None:
        tier_bytes = {t: sum(c.size for c in checkpoints if t in c.held) for t in policy.names}
    tiers_out: list[dict[str, Any]] = []
    for tp in policy.tiers:
        nbytes = int(tier_bytes.get(tp.name, 0))
        tiers_out.append({
            "name": tp.name, "url": tp.url or "(staging)", "storage_class": tp.storage_class,
            "bytes": nbytes, "cost_per_tb_month": tp.cost_per_tb_month,
            "monthly_cost": round(nbytes / 1e12 * tp.cost_per_tb_month, 6),
        })
    return {
        "now": now,
        "total_steps": policy.total_steps,
        "checkpoints": rows,
        "tiers": tiers_out,
        "total": {"bytes": sum(t["bytes"] for t in tiers_out),
                  "monthly_cost": round(sum(t["monthly_cost"] for t in tiers_out), 6)},
        "plan": [a.as_dict() for a in actions],
    }


# -- the applier -------------------------------------------------------------------------


class RetentionError(CkptfsError):
    """An action failed (it is retried at the next run)."""


class InUse(RetentionError):
    """A file of the checkpoint is open now: it is left for a later run."""


@dataclass
class RunResult:
    done: list[Action] = field(default_factory=list)
    failed: list[tuple[Action, str]] = field(default_factory=list)
    blocked: list[Action] = field(default_factory=list)
    # Another node held the retention lease: nothing was applied by this one.
    held_by: Holder | None = None
    at: float = 0.0  # wall time of the run (to show how long the other lease lasts)

    @property
    def skipped(self) -> str | None:
        if self.held_by is None:
            return None
        return f"the retention lease is held by {self.held_by.describe(self.at)}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "done": [a.as_dict() for a in self.done],
            "failed": [{**a.as_dict(), "error": e} for a, e in self.failed],
            "blocked": [a.as_dict() for a in self.blocked]}
        if self.held_by is not None:
            out["skipped"] = self.skipped
            out["lease"] = {"holder": self.held_by.node, "expires": self.held_by.expires}
        return out


@dataclass
class Snapshot:
    """One collection: the checkpoints and what the planner and applier need besides."""

    checkpoints: list[Checkpoint]
    local: dict[str, LocalFile]
    remote: dict[str, list[RemoteFile]]  # tier -> its objects (files only)
    tier_bytes: dict[str, int]
    now: float
    store_pins: list[Pin] = field(default_factory=list)  # expired ones too
    local_pins: list[Pin] = field(default_factory=list)


class Retention:
    """Collects state, plans and applies; one run at a time on this node, and with ``node``
    one node at a time over the store (the lease, lease.py).

    ``fs`` is the filesystem core (``None``: a store without a journal, nothing local); it
    evicts NVMe copies (``Filesystem.evict``) and removes deleted checkpoints from the
    namespace (``unlink``/``rmdir``, as the application would). ``tiers`` maps every tier but
    ``hot`` to an open ``Tier``. ``detector`` groups keys into checkpoints (default: the
    legacy top-level rule with ``step_regex`` if given, else ``checkpoint_pattern``'s
    default); with ``markers`` a checkpoint is complete only with a commit marker.

    Invariants of applying:
    - with ``node`` set, nothing but evictions of this node's NVMe copies is applied unless
      this node holds the unexpired lease in the warm tier; it is taken only when copies,
      removals or deletions are planned (or, by the daemon, once per interval: ``scope``),
      renewed while applying (each such action starts only while it is valid) and
      released after the run;
    - what is applied under the lease is planned from the store listing of every tier
      (``.ckptfs/`` excluded) merged with the journal: checkpoints other nodes wrote are
      seen, and copied whole; without it, only evictions, planned from this node's own
      checkpoints (``_local_round``);
    - just before a checkpoint leaves NVMe (eviction, deletion), none of its files may be
      open; else it is skipped (``InUse``) and retried at the next run.
    """

    def __init__(
        self, policy: Policy, tiers: Mapping[str, Tier], *, step_regex: str | None = None,
        detector: Detector | None = None, markers: Sequence[str] | None = None,
        fs: Filesystem | None = None, scratch: Path | None = None,
        clock: Callable[[], float] = time.time,
        upload_progress: Callable[[], Mapping[str, float]] | None = None,
        on_removed: Callable[[int, str], None] | None = None,
        node: str | None = None, lease_length: float = 600.0,
        settle: float | None = None,
    ) -> None:
        self.policy = policy
        self.tiers = dict(tiers)
        if detector is None:
            detector = Detector.from_pattern(step_regex=step_regex) if step_regex \
                else DEFAULT_DETECTOR
        self.detector = detector
        self.markers = tuple(markers) if markers is not None else None
        # ``checkpoint_settle`` in seconds (checkpoints.settle); None: a marker is required.
        self.settle = settle
        self.node = node
        self.lease: Lease | None = None
        if node is not None:
            warm = next(t.name for t in policy.tiers if t.name != HOT)
            self.lease = Lease(self.tiers[warm], node, lease_length, wall=clock)
        self.fs = fs
        self.scratch = scratch
        self.clock = clock
        self.upload_progress = upload_progress
        self.on_removed = on_removed
        self._lock = trio.Lock()
        self._meta_cache: dict[tuple[str, str, int, str | None], ObjectMeta] = {}
        self.last_run: dict[str, Any] | None = None
        self._owned: list[Tier] = []  # tiers ``open`` opened (closed by ``aclose``)
        self._peers: Peers | None = None

    # -- state ------------------------------------------------------------------------

    async def collect(self, now: float | None = None, *,
                      only: Collection[str] | None = None,
                      journal: tuple[list[LocalFile], list[str]] | None = None) -> Snapshot:
        """The inventory: the journal merged with every tier's listing. With ``only`` (the
        checkpoints that have NVMe copies here, ``_local_names``), just those checkpoints:
        the journal's files of them and one listing per checkpoint name and location,
        instead of the whole store (``_local_round``)."""
        now = self.clock() if now is None else now
        files: list[LocalFile] = []
        names: list[str] = []
        if journal is not None:  # just read by the caller (``_local_round``)
            files, names = journal
        elif self.fs is not None:
            files, names = await self._journal_files()
        name_of = self.detector.name_of
        # A checkpoint name per journal file: pure, and a regular expression each (at 40,000
        # files, a quarter of a second): in a worker thread.
        files, names, known = await trio.to_thread.run_sync(self._of_only, files, names, only)
        remote: dict[str, list[RemoteFile]] = {t: [] for t in self.tiers}
        locations: dict[str, list[TierPolicy]] = {}
        for t in self.policy.tiers:
            if t.name != HOT:
                locations.setdefault(t.location, []).append(t)
        registered: set[str] = set()
        listed: list[tuple[str, ObjectInfo, ObjectMeta | None]] = []
        heads: list[tuple[int, str, ObjectInfo]] = []
        for location, members in locations.items():
            infos = await self._list(self.tiers[members[0].name], only,
                                     location == self._warm().location)
            for count, info in enumerate(infos, 1):
                if count % YIELD_EVERY == 0:
                    await trio.lowlevel.checkpoint()
                if info.key.endswith("/") or info.meta.kind is Kind.DIRECTORY:
                    continue
                if info.key.startswith(NODES) and location == self._warm().location:
                    registered.add(info.key[len(NODES):])
                if info.key.startswith(CONTROL_PREFIX):
                    continue  # the nodes' shared state (lease, registrations): not data
                owner = next((m for m in members if m.storage_class == info.storage_class),
                             members[0])
                meta = info.meta if info.meta_known else None
                if meta is None and (name_of(info.key) not in known
                                     or self._is_pointer(info.key)):
                    heads.append((len(listed), owner.name, info))
                listed.append((owner.name, info, meta))
        await self._head_all(heads, listed)
        # The pins after the objects (pins.py): a restored object listed above was promoted
        # after its pin was written, so the pin is in this later listing.
        warm_pins = await store_pins(self.tiers[self._warm().name])
        here = local_pins(self.fs.journal) if self.fs is not None else []
        progress = dict(self.upload_progress()) if self.upload_progress else {}
        others = sorted(registered - {self.node} if self.node else registered)
        # The rest is pure computation on values this task owns (no journal, no tier): in a
        # worker thread, so that the loop answers FUSE requests meanwhile.
        return await trio.to_thread.run_sync(
            self._snapshot, files, names, listed, remote, warm_pins, here, progress, others,
            now)

    def _snapshot(self, files: list[LocalFile], names: list[str],
                  listed: Sequence[tuple[str, ObjectInfo, ObjectMeta | None]],
                  remote: dict[str, list[RemoteFile]], warm_pins: list[Pin],
                  here: list[Pin], progress: Mapping[str, float], others: Sequence[str],
                  now: float) -> Snapshot:
        """The checkpoints of one ``collect`` from what it gathered. Pure (runs in a worker
        thread): it reads only its arguments and the immutable policy and detector."""
        for owner_name, info, meta in listed:
            remote[owner_name].append(RemoteFile(
                info.key, info.size, meta.checksum if meta else None,
                meta.mtime_ns / 1e9 if meta and meta.mtime_ns else None,
                info.storage_class, info.restore_state == "ongoing", info.etag,
                special=meta is not None and meta.kind is Kind.SPECIAL))
        checkpoints = build(files, remote, step_regex="", detector=self.detector,
                            markers=self.markers, tier_order=self.policy.names,
                            local_entries=names, progress=progress,
                            locations={t.name: t.location for t in self.policy.tiers})
        checkpoints = settle(
            checkpoints, after=-1.0 if self.settle is None else self.settle, now=now,
            other_writers=others)
        checkpoints = [self._pinned(c, warm_pins, here, now) for c in checkpoints]
        tier_bytes = {t: sum(r.size for r in remote[t]) for t in remote}
        tier_bytes[HOT] = sum(f.size for f in files if f.local)
        return Snapshot(checkpoints, {f.key: f for f in files}, remote, tier_bytes, now,
                        warm_pins, here)

    async def _journal_files(self) -> tuple[list[LocalFile], list[str]]:
        """``journal_files`` of this node's namespace, letting other tasks run every
        ``YIELD_EVERY`` entries. A walk during which an entry moved (``Namespace.moves``) may
        have seen it twice or not at all (a state the tree never was in), so it is thrown
        away; after ``WALK_TRIES`` such walks, one walk without pauses."""
        assert self.fs is not None
        ns = self.fs.ns
        for _ in range(WALK_TRIES):
            moves = ns.moves
            files: list[LocalFile] = []
            names: list[str] = []
            for count, _ in enumerate(walk_journal(ns, files, names), 1):
                if count % YIELD_EVERY == 0:
                    await trio.lowlevel.checkpoint()
            if ns.moves == moves:
                return files, names
        return journal_files(ns)

    async def _list(self, tier: Tier, only: Collection[str] | None,
                    warm: bool) -> list[ObjectInfo]:
        """Every object of ``tier``, or with ``only`` those of these checkpoints (and, on the
        warm location, the node registrations the settle rule needs: one short listing)."""
        if only is None:
            return await tier.list()
        name_of = self.detector.name_of
        infos = await tier.list(NODES) if warm else []
        for name in sorted(only):
            # A prefix listing also returns step_50 for step_5: keep this checkpoint's keys.
            infos += [i for i in await tier.list(name) if name_of(i.key) == name]
        return infos

    def _of_only(self, files: list[LocalFile], names: list[str], only: Collection[str] | None
                 ) -> tuple[list[LocalFile], list[str], set[str]]:
        """``files`` and ``names`` of the checkpoints in ``only`` (all with None), and the
        names of the checkpoints they have. Pure (a worker thread)."""
        name_of = self.detector.name_of
        if only is not None:
            files = [f for f in files if name_of(f.key) in only]
            names = [n for n in names if name_of(n) in only]
        return files, names, {name_of(f.key) for f in files}

    def _in_checkpoint(self, key: str) -> bool:
        """Whether ``key`` is in a checkpoint (one with a step: pointers and other files are
        never planned)."""
        return self.detector.locate(key)[1] is not None

    def _local_names(self, files: Iterable[LocalFile]) -> set[str]:
        """The checkpoints with some data on NVMe here: all that evictions can concern."""
        name_of = self.detector.name_of
        return {name_of(f.key) for f in files if f.local}

    def _pinned(self, c: Checkpoint, warm: Sequence[Pin], here: Sequence[Pin],
                now: float) -> Checkpoint:
        if c.step is None:
            return c
        pins = [(self._warm().name, p.until) for p in warm if p.until > now and p.covers(c.name)]
        pins += [(HOT, p.until) for p in here if p.until > now and p.covers(c.name)]
        return replace(c, pins=tuple(pins)) if pins else c

    async def _prune_pins(self, state: Snapshot, shared: bool) -> None:
        """Expired pins go: this node's journal rows always, the store's records only by
        the lease holder (``shared``)."""
        if self.fs is not None:
            for pin in state.local_pins:
                if pin.until <= state.now:
                    drop_local(self.fs.journal, pin)
        if shared:
            for pin in state.store_pins:
                if pin.until <= state.now and pin.key is not None:
                    await self.tiers[self._warm().name].delete(pin.key)

    def _is_pointer(self, key: str) -> bool:
        return self.detector.locate(key)[1] is None

    def _keys_of(self, name: str, keys: Iterable[str]) -> list[str]:
        """The keys of checkpoint ``name``; commit markers first, so that a removal cut
        short never leaves a marker beside missing shards (a partial copy that would look
        complete)."""
        mine = [k for k in keys if self.detector.name_of(k) == name]
        return sorted(mine, key=lambda k: (not self._is_marker(k), k))

    def _is_marker(self, key: str) -> bool:
        return self.markers is not None and is_marker_key(key, self.markers)

    async def _head_all(self, heads: Sequence[tuple[int, str, ObjectInfo]],
                        listed: list[tuple[str, ObjectInfo, ObjectMeta | None]]) -> None:
        """HEAD the objects the journal does not know, ``HEAD_CONCURRENCY`` at a time (the
        first run after a mount may have thousands: one at a time, it took minutes), and
        put each answer at its place in ``listed``."""
        todo = iter(heads)

        async def worker() -> None:
            for index, tier, info in todo:  # shared: each item goes to one worker
                listed[index] = (tier, info, await self._head(tier, info))

        async with trio.open_nursery() as nursery:
            for _ in range(min(HEAD_CONCURRENCY, len(heads))):
                nursery.start_soon(worker)

    async def _head(self, tier: str, info: ObjectInfo) -> ObjectMeta | None:
        cache_key = (tier, info.key, info.size, getattr(info, "etag", None))
        meta = self._meta_cache.get(cache_key)
        if meta is None:
            try:
                meta = (await self.tiers[tier].head(info.key)).meta
            except CkptfsError:
                return None
            if len(self._meta_cache) > 100_000:
                self._meta_cache.clear()
            self._meta_cache[cache_key] = meta
        return meta

    async def report(self, now: float | None = None) -> dict[str, Any]:
        state = await self.collect(now)
        actions = await self._plan(state)
        out = await trio.to_thread.run_sync(
            report, state.checkpoints, self.policy, state.now, actions, state.tier_bytes)
        out["last_run"] = self.last_run
        return out

    # -- applying ---------------------------------------------------------------------

    async def run_once(self, now: float | None = None, *,
                       scope: Literal["full", "local", "interval"] = "full") -> RunResult:
        """Plan and apply until nothing is left to do (copies first, removes the run after),
        under the lease when there is one; with another node holding it, nothing is done
        and ``held_by`` says who.

        ``scope`` says how much of the store a node with a lease inventories before it
        knows whether it will apply (with a thousand nodes, a listing
        of the whole store by every node after every save is most of the store's load):
        - ``"full"`` (``ckptfs retention --apply``, tests): the whole store, as the plan
          that is shown;
        - ``"local"`` (the daemon, after a save): only the checkpoints with NVMe copies
          here (``_local_round``); the lease is taken, and the whole store listed, only if
          that plan has shared work (copies, removals, deletions);
        - ``"interval"`` (the daemon, once per ``retention_interval``): the same local
          round, then the lease is taken whatever it showed, and only its holder lists the
          whole store (what no node's NVMe shows: expiries of evicted checkpoints, other
          nodes' checkpoints)."""
        async with self._lock:
            total = RunResult(at=self.clock())
            if self.lease is not None:
                if scope == "full":
                    shared = await self._needs_lease(total, now)
                else:
                    shared = await self._local_round(total, now) or scope == "interval"
                if not shared:
                    self.last_run = {"at": self.clock(), **total.as_dict()}
                    return total
            if self.lease is not None:
                holder = await self.lease.acquire()
                if holder is not None:
                    total.held_by = holder
                    log.info("retention run skipped: %s", total.skipped)
                    self.last_run = {"at": self.clock(), **total.as_dict()}
                    return total
            error: CkptfsError | None = None
            try:
                async with trio.open_nursery() as nursery:
                    if self.lease is not None:
                        nursery.start_soon(self.lease.keep_renewed, nursery.cancel_scope.cancel)
                    try:
                        await self._rounds(total, now)
                        if scope != "local":
                            await self._forget_old_records()
                    except CkptfsError as exc:
                        error = exc  # raised below as itself, not in an exception group
                    nursery.cancel_scope.cancel()
            finally:
                if self.lease is not None:
                    with trio.CancelScope(shield=True):
                        await self.lease.release()
            if error is not None:
                raise error
            self.last_run = {"at": self.clock(), **total.as_dict()}
            return total

    async def _forget_old_records(self) -> None:
        """Records addressed to nodes not registered any more, older than
        ``peers.RECORD_MAX_AGE`` (peers.py: live nodes delete their own)."""
        warm = self.tiers[self._warm().name]
        registered = {i.key[len(NODES):] for i in await warm.list(NODES)
                      if not i.key.endswith("/")}
        removed = await self.peers.collect_garbage(registered, self.clock())
        if removed:
            log.info("retention: removed %d records of nodes gone", removed)

    async def _needs_lease(self, total: RunResult, now: float | None) -> bool:
        """A first round without the lease: evictions only drop this node's NVMe copies
        (of checkpoints a remote tier holds) and need nobody's leave, so they are applied
        here; True if anything else (copies, removals, deletions: shared state) is planned.
        A run with nothing shared to do thus writes nothing to the store."""
        return await self._evict_and_check(await self.collect(now), total)

    async def _local_round(self, total: RunResult, now: float | None) -> bool:
        """``_needs_lease`` on this node's checkpoints only (``collect(only=...)``): their
        journal rows and one listing per checkpoint and location, never the whole store.

        Why evicting from this partial view is safe: the planner sees a subset S of the
        checkpoints G a full listing shows, with the same files and objects for each one
        it sees. Every rule keeps in S at least what it keeps of S in G (a checkpoint
        among the last N of G has fewer than N newer ones in S too; the newest of an hour
        in G is the newest of that hour in S; a milestone is the smallest step past its
        fraction in both), so an NVMe copy the hot rules keep is never evicted here; and
        an eviction still needs a copy that stays in a tier, which this view lists. What
        it cannot see (other checkpoints) only makes the rules keep more. One thing it
        can do sooner than the full plan: evict a checkpoint that the full plan keeps on
        NVMe until a colder tier that must hold it does (as a source for that copy), when
        in this view the warm tier, which holds it, still selects it; the copy then reads
        from the warm tier. Anything else it plans is only a reason to take the lease;
        the holder re-plans from the whole store."""
        if self.fs is None:
            return False
        journal = await self._journal_files()
        only = await trio.to_thread.run_sync(self._local_names, journal[0])
        if not only:
            return False
        return await self._evict_and_check(
            await self.collect(now, only=only, journal=journal), total)

    async def _evict_and_check(self, state: Snapshot, total: RunResult) -> bool:
        """Plan from ``state``, apply its evictions (node-local: no lease needed); True if
        it plans anything else (copies, removals, deletions: shared state)."""
        await self._learn_classes(state)
        await self._prune_pins(state, shared=False)
        actions = await self._plan(state)
        total.blocked = [a for a in actions if a.blocked is not None]
        runnable = [a for a in actions if a.blocked is None]
        local = [a for a in runnable if a.kind == "evict"]
        if local:
            result = await self.apply(local, state)
            total.done += result.done
            total.failed += result.failed
        return any(a.kind != "evict" for a in runnable)

    async def _rounds(self, total: RunResult, now: float | None) -> None:
        for round_ in range(MAX_ROUNDS):
            state = await self.collect(now)
            await self._learn_classes(state)
            if round_ == 0:
                await self._prune_pins(state, shared=True)
            actions = await self._plan(state)
            runnable = [a for a in actions if a.blocked is None]
            total.blocked = [a for a in actions if a.blocked is not None]
            if not runnable:
                break
            result = await self.apply(runnable, state)
            total.done += result.done
            total.failed += result.failed
            if not result.done:
                break

    async def _plan(self, state: Snapshot) -> list[Action]:
        """``plan`` (pure) in a worker thread: at 40,000 files it takes a large part of a
        second, which the loop spends answering FUSE requests instead."""
        return await trio.to_thread.run_sync(plan, state.checkpoints, self.policy, state.now)

    async def apply(self, actions: Sequence[Action], state: Snapshot) -> RunResult:
        result = RunResult()
        by_name = {c.name: c for c in state.checkpoints}
        rank = {"copy": 0, "remove": 1, "evict": 2, "delete": 3}
        for action in sorted(actions, key=lambda a: rank[a.kind]):
            # Other tasks run between actions (an action that does not reach the store, an
            # eviction of small files, need not pause at all); each action checks what it
            # relies on again at its start (open files, rows' states, the lease).
            await trio.lowlevel.checkpoint()
            c = by_name[action.checkpoint]
            if self.lease is not None and action.kind != "evict" and not self.lease.valid():
                # Renewals failed for a third of the lease: another node may take it soon.
                result.failed.append((action, "the retention lease ran out: not started"))
                continue
            try:
                if action.kind == "copy":
                    await self._copy(c, action, state)
                elif action.kind == "remove":
                    assert action.tier is not None
                    await self._remove(c, action.tier, state)
                elif action.kind == "evict":
                    await self._evict(c, state)
                else:
                    await self._delete(c, state)
            except (CkptfsError, OSError) as exc:
                log.warning("retention: %s of %s failed: %s", action.describe(), c.name, exc)
                result.failed.append((action, str(exc)))
                continue
            log.info("retention: %s %s", action.describe(), c.name)
            result.done.append(action)
        return result

    def _row(self, ino: int) -> Row:
        assert self.fs is not None
        return self.fs.ns.get(ino)

    async def _copy(self, c: Checkpoint, action: Action, state: Snapshot) -> None:
        assert action.tier is not None and action.source is not None
        dst = self.tiers[action.tier]
        there = {r.key: r for r in state.remote.get(action.tier, [])}
        # Every file listed under the checkpoint (any node's), markers last: a copy cut short
        # never has a marker without its shards.
        for key, size in sorted(c.files, key=lambda f: (self._is_marker(f[0]), f[0])):
            local = state.local.get(key)
            checksum = local.checksum if local else None
            have = there.get(key)
            if have is not None and have.size == size and (
                    checksum is None or have.checksum in (None, checksum)):
                continue
            if action.source == HOT:
                assert local is not None and self.fs is not None
                row = self._row(local.ino)
                data = self.fs.ns.kernel(row)  # a hard link's extra name: its head's bytes
                if data.state is State.REMOTE:
                    raise RetentionError(f"{key} is not on NVMe any more")
                meta = ObjectMeta(Kind.FILE, stat.S_IMODE(row.mode), row.mtime_ns, row.uid,
                                  row.gid, row.checksum)
                # Summed like an upload (whole and per block) and checked against the
                # journal's checksum before it is put: NVMe pages lost in a power loss
                # never reach another tier labelled with the good checksum.
                checksum = checksum or row.checksum
                await put_checked(dst, key, self.fs.staging.path(data.ino), size, meta,
                                  checksum)
            else:
                src = self.tiers[action.source]
                if checksum is None:
                    checksum = (await src.head(key)).meta.checksum
                await copy_object(src, dst, key, size, self._scratch(), checksum)
            try:
                info = await verify(dst, key, size, checksum)
            except CopyMismatch:
                # Not a copy anyone may rely on: gone, so that no later listing counts it
                # (unless the copy was in place: then it is the only one).
                if self.policy.tier(action.tier).location != self.policy.tier(action.source).location:
                    await dst.delete(key)
                raise
            if self.policy.tier(action.tier).location == self._warm().location:
                self._learn_class(key, local, info)

    async def _learn_classes(self, state: Snapshot) -> None:
        """Every run: the journal learns the storage class the warm prefix's listing shows
        for this node's files. A transition whose journal update was lost (a crash after
        the copy, a verification that failed transiently, another node's run, a lifecycle
        rule) is caught up here even if nobody lists that directory through the mount."""
        warm = self._warm().location
        for t in self.policy.tiers:
            if t.name == HOT or t.location != warm:
                continue
            for count, r in enumerate(state.remote.get(t.name, []), 1):
                if count % YIELD_EVERY == 0:
                    await trio.lowlevel.checkpoint()  # each row is read afresh below
                local = state.local.get(r.key)
                if local is not None:
                    self._learn_class(r.key, local, ObjectInfo(
                        r.key, r.size, ObjectMeta(checksum=r.checksum), r.storage_class,
                        etag=r.etag))

    def _learn_class(self, key: str, local: LocalFile | None, info: ObjectInfo) -> None:
        """The object at ``key`` on the warm tier's prefix is now in ``info``'s class (an
        in-place transition, e.g. to GLACIER): the journal learns it at once, so that this
        node says ``archived`` and asks for ``ckptfs restore`` instead of failing reads.

        Only the row still pointing at that object with the same bytes learns it: one that
        was rewritten meanwhile (a new version on its way, or uploaded since) is not about
        this object. Anything missed here is caught by the next listing of its directory
        (listing.py compares the class even when the ETag is unchanged)."""
        if self.fs is None or local is None:
            return
        try:
            row = self._row(local.ino)
        except CkptfsError:
            return  # removed meanwhile
        same = (info.etag is not None and info.etag == row.remote_etag) or (
            info.meta.checksum is not None and info.meta.checksum == row.checksum
            and info.size == row.size)
        if row.remote_key != key or not same \
                or row.state not in (State.COMMITTED, State.REMOTE):
            return
        archived = info.storage_class if info.storage_class in ARCHIVE_CLASSES else None
        if (row.storage_class, row.remote_etag) != (archived, info.etag or row.remote_etag):
            row.storage_class = archived
            row.remote_etag = info.etag or row.remote_etag
            self.fs.ns.persist(row)

    def _scratch(self) -> Path:
        if self.scratch is not None:
            self.scratch.mkdir(parents=True, exist_ok=True)
            return self.scratch
        import tempfile

        return Path(tempfile.gettempdir())

    async def _remove(self, c: Checkpoint, tier: str, state: Snapshot) -> None:
        # The planner removes only once every tier that must hold the checkpoint holds every
        # file of it (sizes and checksums compared in this run's listing; copies verified).
        listed = {r.key: r for r in state.remote.get(tier, [])}
        keys = self._keys_of(c.name, listed)
        warm = self.policy.tier(tier).location == self._warm().location
        for key in keys:  # markers first
            if warm:
                # It leaves the tier every namespace merges: the version listed goes, with a
                # record for its writer, which drops its copy instead of uploading it again.
                await self._delete_version(key, listed[key].etag)
            else:
                await self.tiers[tier].delete(key)
        members = [t for t in self.policy.tiers if t.location == self.policy.tier(tier).location]
        if len(members) == 1:
            await self._remove_dirs(self.tiers[tier], c.name)

    async def _remove_dirs(self, tier: Tier, name: str) -> None:
        """The directory markers of checkpoint ``name``, deepest first; one that still holds
        something (a version written since the plan, on a file tier) stays."""
        listed = await tier.list(name + "/")
        dirs = [i.key for i in listed
                if i.key.endswith("/") and self.detector.name_of(i.key) == name]
        if listed or dirs:
            dirs.append(name + "/")
        for key in sorted(set(dirs), key=lambda k: k.count("/"), reverse=True):
            try:
                await tier.delete(key)
            except NotEmptyYet:
                continue

    def _warm(self) -> TierPolicy:
        return next(t for t in self.policy.tiers if t.name != HOT)

    async def _delete_version(self, key: str, etag: str | None) -> None:
        """Delete from the warm tier the version of ``key`` this run listed (``etag``), with a
        record for the node that wrote it (peers.py): that node drops its local copy instead
        of uploading it again, and a version written since the listing stays."""
        if etag is None:
            await self.peers.delete(key)
            return
        try:
            stamp = (await self.tiers[self._warm().name].head(key)).meta.stamp
        except ObjectMissing:
            return
        await self.peers.delete(key, stamp=stamp, etag=etag)

    @property
    def peers(self) -> Peers:
        if self._peers is None:
            if self.fs is not None and self.fs.peers is not None:
                self._peers = self.fs.peers
            else:
                self._peers = Peers(self.tiers[self._warm().name], self.node or "retention")
        return self._peers

    def _open_file(self, name: str) -> str | None:
        """A file of checkpoint ``name`` that is open right now (by any handle), if any:
        checked at apply time, not from the snapshot, so a reader that opened it since is
        seen."""
        fs = self.fs
        if fs is None:
            return None
        top = self._lookup(name)
        if top is None:
            return None
        todo = [(top, name)]
        while todo:
            row, path = todo.pop()
            if stat.S_ISDIR(row.mode):
                for child in fs.ns.children(row.ino, 0):
                    assert child.name is not None
                    todo.append((child, path + "/" + os.fsdecode(child.name)))
            elif fs.is_open(row.ino):
                return path
        return None

    def _lookup(self, name: str) -> Row | None:
        """The namespace row at path ``name`` (relative to the mount), or None."""
        assert self.fs is not None
        row = self.fs.ns.entry_at(name)
        return None if row is None else self.fs.ns.kernel(row)

    def _check_not_open(self, c: Checkpoint) -> None:
        path = self._open_file(c.name)
        if path is not None:
            raise InUse(f"{path} is open: left for a later run")

    async def _evict(self, c: Checkpoint, state: Snapshot) -> None:
        assert self.fs is not None
        self._check_not_open(c)
        rows = []
        for key, _ in c.files:
            local = state.local.get(key)
            if local is None:
                continue
            row = self._row(local.ino)
            if row.state is State.COMMITTED and row.remote_key is not None \
                    and self.fs.ns.open_count(row.ino) == 0:
                rows.append(row)
        await self.fs.evict_async(*rows)  # one journal sync for the checkpoint, not one per file

    async def _delete(self, c: Checkpoint, state: Snapshot) -> None:
        """Delete the checkpoint as this run planned it: the versions it listed and held, not
        whatever is there by now. The journal first (a crash after it leaves store copies
        that the next run sees as a checkpoint nobody keeps, and deletes); a checkpoint this
        node wrote to since the plan is left whole for a later run."""
        if self.fs is not None:
            self._check_not_open(c)
            await self._forget(c, state)
        seen: set[str] = set()
        for t in self.policy.tiers:
            if t.name == HOT or t.location in seen:
                continue
            seen.add(t.location)
            tier = self.tiers[t.name]
            planned = {r.key: r for m in self.policy.tiers if m.location == t.location
                       for r in state.remote.get(m.name, [])}
            # Markers first (no marker beside missing shards if cut short), then files.
            for key in self._keys_of(c.name, planned):
                # Also the keys this node's unlinks just tombstoned: the deletion is the
                # same, and the checkpoint leaves the store now, not at the uploader's turn.
                if t.location == self._warm().location:
                    await self._delete_version(key, planned[key].etag)
                else:
                    await tier.delete(key)
            await self._remove_dirs(tier, c.name)

    async def _forget(self, c: Checkpoint, state: Snapshot) -> None:
        """Remove checkpoint ``c`` from the namespace, as ``rm -r`` would, as planned: a file
        found open, or written here since the plan (open, staged, uploading, or another
        version than the plan saw), leaves the whole checkpoint for a later run (``InUse``,
        checked before anything goes). An entry known from the store whose object another
        node rewrote since the plan stays (that version was not planned on)."""
        from ckptfs.errors import NotEmpty

        fs = self.fs
        assert fs is not None
        top = self._lookup(c.name)
        if top is None:
            return
        parent_path, _, _ = c.name.rpartition("/")
        parent_row = self._lookup(parent_path) if parent_path else fs.ns.get(ROOT_INODE)
        assert parent_row is not None and top.name is not None
        top_name = os.fsdecode(top.name)  # the row forgets its name once removed
        listed = {r.key: r for t in self.policy.tiers if t.location == self._warm().location
                  for r in state.remote.get(t.name, [])}

        async def entries(row: Row, path: str) -> list[tuple[Row, Row, str]]:
            """(parent, entry, path) of every entry under ``row``, deepest last; readdir
            merges the store's listing: other nodes' shards in it are entries here too."""
            found: list[tuple[Row, Row, str]] = []
            for child in list(await fs.readdir(row.ino, 0)):
                assert child.name is not None
                where = path + "/" + os.fsdecode(child.name)
                found.append((row, child, where))
                if stat.S_ISDIR(child.mode):
                    found.extend(await entries(child, where))
            return found

        every = [(parent_row, top, c.name)]
        if stat.S_ISDIR(top.mode):
            every += await entries(top, c.name)
        planned: list[tuple[Row, Row, str]] = []
        for parent, row, path in every:
            if stat.S_ISDIR(row.mode):
                continue
            if fs.is_open(row.ino):
                raise InUse(f"{path} is open: left for a later run")
            local = state.local.get(path)
            mine = row.closed_at is not None or row.state not in (State.COMMITTED, State.REMOTE)
            if mine and (row.incomplete or row.state not in (State.COMMITTED, State.REMOTE)
                         or local is None or (local.ino, local.version) !=
                         (row.ino, row.version)):
                raise InUse(f"{path} was written here since the plan: {c.name} is left for "
                            "a later run")
            if mine or (local is not None and local.version == row.version) or (
                    path in listed and listed[path].etag == row.remote_etag):
                planned.append((parent, row, path))
        for parent, row, path in planned:
            assert row.name is not None
            await fs.unlink(parent.ino, row.name)
        for parent, row, path in reversed(every):
            if not stat.S_ISDIR(row.mode):
                continue
            assert row.name is not None
            try:
                await fs.rmdir(parent.ino, row.name, sweep=False)
            except NotEmpty:
                # A version another node wrote since the plan, or a shard of theirs this node
                # had not listed yet: it stays, with its directory.
                continue
        if self.on_removed is not None and self._lookup(c.name) is None:
            self.on_removed(parent_row.ino, top_name)

    # -- set-up -----------------------------------------------------------------------

    @classmethod
    async def open(cls, config: Config, *, warm: Tier | None = None,
                   fs: Filesystem | None = None, upload_progress: Callable[[], Mapping[str, float]]
                   | None = None, on_removed: Callable[[int, str], None] | None = None,
                   node: str | None = None) -> Retention:
        """Retention over ``config``'s tiers, each opened and checked (``warm``: already open);
        ``node``: this node's id (coordination.py), which applies only under the lease.

        A tier that cannot be used is a ``UserError`` naming its key (``tier.2.url``)."""
        tiers = await open_tiers(config, warm)
        retention = cls(Policy.from_config(config), tiers, detector=detector_for(config),
                        markers=config.commit_markers,
                        fs=fs, scratch=config.staging_dir / "retention-tmp",
                        upload_progress=upload_progress, on_removed=on_removed, node=node,
                        lease_length=config.retention_lease.total_seconds(),
                        settle=None if config.checkpoint_settle is None
                        else config.checkpoint_settle.total_seconds())
        retention._owned = [t for t in tiers.values() if t is not warm]
        return retention

    async def aclose(self) -> None:
        """Close the tiers ``open`` opened."""
        with trio.CancelScope(shield=True):
            for tier in self._owned:
                await tier.aclose()

    # -- the task ---------------------------------------------------------------------

    async def run(self, uploader: Any, interval: float,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The daemon's task: a ``"local"`` round once the uploads after a commit are done,
        and an ``"interval"`` round every ``interval`` seconds, the first one ``interval``
        after the start, not at the start (docs/RETENTION.md, "When the policy runs").

        Why not at the start: the whole-store inventory of an interval round (every object
        listed, every journal row read) competed with the restarting job that reads its
        checkpoint back, right when it does (cold ``stat`` after a remount at
        40,000 files fell from ~700/s to 64/s). Waiting makes no round do anything it would
        not have done at the start, only later (module docstring); the uploads the start
        requeued, and every commit after it, still bring a local round (this node's NVMe
        copies) as soon as the uploader is idle."""
        task_status.started()
        if interval <= 0:
            return  # retention_interval = 0: only `ckptfs retention --apply`
        # Uploads since the uploader started (with this mount): those the start requeued
        # bring a local round too, even if they were done before this task started.
        seen = 0
        # A monotonic clock: the wall clock (``self.clock``) may be a test's or jump.
        next_interval = trio.current_time() + interval
        while True:
            with trio.move_on_at(next_interval):
                while True:
                    await uploader.wait_uploaded(seen)
                    await uploader.wait_idle()
                    # Only an upload into a checkpoint can change what its NVMe copies
                    # may keep: other files (logs, a job's own small files) bring no local
                    # round, which walks the whole journal on the loop (at 16,000 files,
                    # a create burst right after a sync ran at 0.6 of its speed beside it).
                    keys = uploader.uploaded_since(seen)
                    if keys is None or any(self._in_checkpoint(key) for key in keys):
                        break
                    seen = uploader.stats.uploaded_files
            seen = uploader.stats.uploaded_files
            due = trio.current_time() >= next_interval
            try:
                result = await self.run_once(scope="interval" if due else "local")
            except CkptfsError as exc:
                log.warning("retention run skipped: %s", exc)
                continue
            finally:
                if due:  # the next one an interval after this one ended (or failed)
                    next_interval = trio.current_time() + interval
            if result.held_by is not None:
                continue  # another node applies the policy this round (logged)
            for action, error in result.failed:
                log.warning("retention: %s of %s: %s", action.describe(), action.checkpoint,
                            error)


def detector_for(config: Config) -> Detector:
    """How ``config`` finds checkpoints: the legacy ``step_regex`` if set, else
    ``checkpoint_pattern``."""
    return Detector.from_pattern(config.checkpoint_pattern, config.step_regex)


async def open_tiers(config: Config, warm: Tier | None = None) -> dict[str, Tier]:
    """Every tier but ``hot``, opened and checked; ``UserError`` naming the key of the first
    that cannot be used (the ones opened so far are closed)."""
    from ckptfs.errors import StoreUnavailable, UserError
    from ckptfs.store.tiers import open_tier
    from ckptfs.store.tiers.base import TierError

    tiers: dict[str, Tier] = {}
    try:
        for index, tc in enumerate(config.tier):
            if tc.url is None:
                continue
            if index == 1 and warm is not None:
                tiers[tc.name] = warm
                continue
            tier = open_tier(tc)
            tiers[tc.name] = tier
            try:
                await tier.check()
            except (TierError, StoreUnavailable) as exc:
                raise UserError(f"tier.{index}.url ({tc.name}): {exc}") from None
    except BaseException:
        with trio.CancelScope(shield=True):
            for tier in tiers.values():
                if tier is not warm:
                    await tier.aclose()
        raise
    return tiers


def upload_progress(uploader: Any) -> dict[str, float]:
    """Bytes already sent of each upload in flight, by key (for ls-tiers)."""
    return {w.target: float(w.done_bytes) for w in uploader.outstanding()
            if w.target is not None}
