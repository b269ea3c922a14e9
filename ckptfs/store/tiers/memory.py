"""``memory://name[?storage_class=...]``: a tier held in this process's memory, for tests.

Tiers with the same name share one store (a module-level registry), so a test can open the
"same bucket" from two filesystems, like two nodes.

Storage classes behave as S3's do, so that retention's in-place transitions and
``ckptfs restore`` run without S3: an object is put in its tier's class, a server-side copy
takes the target's class (a copy onto itself is a transition), an object in an archive class
(GLACIER, DEEP_ARCHIVE) cannot be read (``ObjectArchived``) until ``restore`` made it
readable, which takes ``restore_delay`` seconds of trio time (the autojump clock skips them);
``promote`` moves it back to the tier's class.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

import trio

from ckptfs.store.tiers.base import (
    ARCHIVE_CLASSES,
    Finish,
    Kind,
    ObjectArchived,
    ObjectInfo,
    ObjectMeta,
    ObjectMissing,
    PreconditionFailed,
    Progress,
    Tier,
    write_local,
)

_TAGS = itertools.count(1)


@dataclass
class _Object:
    body: bytes
    meta: ObjectMeta
    # Unique for the life of the process (an id() could be reused: a compare-and-swap
    # would then take a new object for the old one).
    tag: str = field(default_factory=lambda: f"{next(_TAGS):x}")
    storage_class: str = "STANDARD"
    restored_at: float | None = None  # trio time when a requested restore is readable


_STORES: dict[str, dict[str, _Object]] = {}


def store_named(name: str) -> dict[str, _Object]:
    return _STORES.setdefault(name, {})


class MemoryTier(Tier):
    # Trio seconds a restore from an archive class takes (tests set it).
    restore_delay: float = 0.0

    def __init__(self, name: str, url: str, store: str) -> None:
        super().__init__(name, url)
        self.objects = store_named(store)
        # The query by hand: urlsplit refuses a name with brackets (it reads them as an IPv6
        # host), and test stores are named after parametrized tests ("t[1]").
        self.storage_class = parse_qs(url.partition("?")[2]).get(
            "storage_class", ["STANDARD"])[-1]

    def _info(self, key: str, obj: _Object) -> ObjectInfo:
        state = None
        if obj.restored_at is not None:
            state = "done" if trio.current_time() >= obj.restored_at else "ongoing"
        return ObjectInfo(key, len(obj.body), obj.meta, obj.storage_class, state,
                          etag=obj.tag)

    def place(self, key: str, obj: _Object) -> None:
        """Store a server-side copy of ``obj`` at ``key`` in this tier's class (same tag: a
        copy of the same bytes, as a single-part S3 object keeps its ETag)."""
        self.objects[key] = dataclasses.replace(obj, storage_class=self.storage_class,
                                                restored_at=None)

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None, *, finish: Finish | None = None,
    ) -> str | None:
        if finish is not None:
            meta = await finish()

        def read() -> bytes:
            with open(source, "rb") as f:
                return f.read(size)

        # Small files are read on the trio thread: simulations with the autojump clock stay
        # deterministic (the clock jumps while a thread runs).
        body = read() if size <= 256 * 1024 else await trio.to_thread.run_sync(read)
        await trio.lowlevel.checkpoint()
        obj = self.objects[key] = _Object(body, meta, storage_class=self.storage_class)
        if progress:
            progress(len(body))
        return obj.tag

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        await trio.lowlevel.checkpoint()
        body = (meta.target or "").encode() if meta.kind is Kind.SYMLINK else b""
        self.objects[key] = _Object(body, meta)

    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        if self._info(key, obj).archived:
            raise ObjectArchived(f"{self.url}: InvalidObjectState: {key} is in "
                                 f"{obj.storage_class}")
        chunk = obj.body[offset:offset + length]
        return write_local(fd, chunk, fd_offset)

    async def head(self, key: str) -> ObjectInfo:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        return self._info(key, obj)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await trio.lowlevel.checkpoint()
        return [self._info(k, o) for k, o in sorted(self.objects.items())
                if k.startswith(prefix)]

    async def restore(self, key: str, days: int) -> None:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        if obj.storage_class in ARCHIVE_CLASSES and obj.restored_at is None:
            obj.restored_at = trio.current_time() + self.restore_delay

    async def promote(self, key: str) -> None:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        if self._info(key, obj).archived:
            raise ObjectArchived(f"{self.url}: InvalidObjectState: {key} is not restored")
        self.place(key, obj)

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(src)
        if obj is None:
            raise ObjectMissing(src)
        if if_etag is not None and obj.tag != if_etag:
            raise PreconditionFailed(f"{src}: changed (tag {obj.tag}, expected {if_etag})")
        if self._info(src, obj).archived:
            raise ObjectArchived(f"{self.url}: InvalidObjectState: {src} is in "
                                 f"{obj.storage_class}")
        new = self.objects[dst] = _Object(obj.body, obj.meta, storage_class=self.storage_class)
        return new.tag

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is not None and if_etag is not None and obj.tag != if_etag:
            raise PreconditionFailed(f"{key}: changed (tag {obj.tag}, expected {if_etag})")
        self.objects.pop(key, None)

    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        await trio.lowlevel.checkpoint()
        old = self.objects.get(key)
        if if_absent and old is not None:
            raise PreconditionFailed(f"{key}: exists")
        if if_tag is not None and (old is None or old.tag != if_tag):
            raise PreconditionFailed(f"{key}: changed")
        obj = self.objects[key] = _Object(bytes(data), ObjectMeta())
        return obj.tag

    async def get_small(self, key: str) -> tuple[bytes, str]:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        return obj.body, obj.tag
