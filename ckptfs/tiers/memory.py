"""``memory://name``: a tier held in this process's memory, for tests.

Tiers with the same name share one store (a module-level registry), so a test can open the
"same bucket" from two filesystems, like two nodes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ckptfs.tiers.base import (
    Kind,
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


_STORES: dict[str, dict[str, _Object]] = {}


def store_named(name: str) -> dict[str, _Object]:
    return _STORES.setdefault(name, {})


class MemoryTier(Tier):
    def __init__(self, name: str, url: str, store: str) -> None:
        super().__init__(name, url)
        self.objects = store_named(store)

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None,
    ) -> str | None:
        def read() -> bytes:
            with open(source, "rb") as f:
                return f.read(size)

        # Small files are read on the trio thread: simulations with the autojump clock stay
        # deterministic (the clock jumps while a thread runs).
        body = read() if size <= 256 * 1024 else await trio.to_thread.run_sync(read)
        await trio.lowlevel.checkpoint()
        obj = self.objects[key] = _Object(body, meta)
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
        chunk = obj.body[offset:offset + length]
        return write_local(fd, chunk, fd_offset)

    async def head(self, key: str) -> ObjectInfo:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        return ObjectInfo(key, len(obj.body), obj.meta, etag=obj.tag)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await trio.lowlevel.checkpoint()
        return [
            ObjectInfo(k, len(o.body), o.meta, etag=o.tag)
            for k, o in sorted((k, o) for k, o in self.objects.items() if k.startswith(prefix))
        ]

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(src)
        if obj is None:
            raise ObjectMissing(src)
        if if_etag is not None and obj.tag != if_etag:
            raise PreconditionFailed(f"{src}: changed (tag {obj.tag}, expected {if_etag})")
        new = self.objects[dst] = _Object(obj.body, obj.meta)
        return new.tag

    async def delete(self, key: str) -> None:
        await trio.lowlevel.checkpoint()
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
