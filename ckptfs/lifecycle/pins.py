"""Restore pins: a checkpoint ``ckptfs restore`` brought back stays where it put it.

``ckptfs restore PATH --days D`` copies archived objects back into the warm tier's class
(restore.py); without a pin, the next retention run would find a checkpoint the warm tier's
rules no longer select and move it straight back to the archive (and evict the copy
``--local`` fetched). A pin makes the tiers restore filled keep it, for D days from the
restore, as if one of their rules selected it (``ls-tiers`` shows the rule
``restored, pinned until ...``):

- **warm**: a small record ``.ckptfs/pins/<quoted PATH>`` in the warm tier
  (``{"path": PATH, "until": wall time, "by": node}``). It is in the store because the node
  that applies retention (the lease holder) may be any node.
- **hot** (``--local`` only): a row of this node's journal (``meta``, key ``pin:<PATH>``):
  only this node's NVMe copy is kept, and only this node evicts it.

A pin covers every checkpoint at, under or above PATH (restoring a run directory pins each
checkpoint in it; restoring one file pins its checkpoint).

Invariants:
- restore writes the pin before the first object leaves the archive class, and retention
  reads the pins after it listed the objects: a run that sees a restored object also sees its
  pin (S3's strong consistency: the pin's PUT finished before the promote started, the list
  of pins starts after the list of objects returned), so no run undoes a restore;
- an expired pin is ignored, then removed (the store's by the lease holder, the journal's by
  its node); a pin is never needed for safety, only to keep what the user asked for.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from ckptfs.store.tiers.base import CONTROL_PREFIX, ObjectMissing, Tier

if TYPE_CHECKING:
    from ckptfs.state.journal import Journal

log = logging.getLogger(__name__)

PINS = CONTROL_PREFIX + "pins/"
LOCAL_PREFIX = "pin:"


@dataclass(frozen=True, slots=True)
class Pin:
    path: str  # relative to the mount root; "" is the whole mount
    until: float  # wall time
    key: str | None = None  # the store record (None: a journal row)

    def covers(self, name: str) -> bool:
        """Whether the pin holds checkpoint ``name``: at, under or above the pinned path."""
        p = self.path.strip("/")
        return not p or name == p or name.startswith(p + "/") or p.startswith(name + "/")

    def describe(self) -> str:
        return "restored, pinned until " + time.strftime("%Y-%m-%d %H:%M UTC",
                                                         time.gmtime(self.until))


def pin_key(path: str) -> str:
    return PINS + quote(path.strip("/"), safe="")


async def pin_in_store(tier: Tier, path: str, until: float, node: str | None = None) -> None:
    """Write (or extend) the warm tier's pin of ``path``."""
    body = json.dumps({"path": path.strip("/"), "until": until, "by": node}).encode()
    await tier.put_small(pin_key(path), body)


def pin_here(journal: Journal, path: str, until: float) -> None:
    """Pin the NVMe copies of ``path`` on this node."""
    journal.set_value(LOCAL_PREFIX + path.strip("/"), repr(until))


async def store_pins(tier: Tier) -> list[Pin]:
    """Every pin record in ``tier`` (expired ones too). Malformed ones are skipped (logged);
    a store error is raised: a run that cannot read the pins must not plan without them."""
    pins = []
    for info in await tier.list(PINS):
        try:
            body, _ = await tier.get_small(info.key)
        except ObjectMissing:
            continue  # removed since the listing (expired, pruned by another node)
        try:
            record = json.loads(body)
            pins.append(Pin(str(record["path"]), float(record["until"]), info.key))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the malformed restore pin %s: %s", info.key, exc)
    return pins


def local_pins(journal: Journal) -> list[Pin]:
    pins = []
    for key, value in journal.values_under(LOCAL_PREFIX).items():
        try:
            pins.append(Pin(key[len(LOCAL_PREFIX):], float(value)))
        except ValueError:
            journal.drop_value(key)
    return pins


def drop_local(journal: Journal, pin: Pin) -> None:
    journal.drop_value(LOCAL_PREFIX + pin.path.strip("/"))
