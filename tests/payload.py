"""Checkpoint-like file contents that tests can regenerate instead of keeping in memory.

A ``Payload`` is ``size`` bytes made from a seed: incompressible, different in every MiB block
(each block is a seeded rotation of a random base and starts with its own seed and index), so
that a lost, repeated, swapped or truncated block is caught, yet producing a GiB costs a few
memory copies rather than a random generator's time. ``check_file`` compares a file with the
payload block by block and names the first differing offset.
"""

from __future__ import annotations

import functools
import os
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c

BLOCK = 1 << 20


@functools.lru_cache(maxsize=64)
def _base(seed: int) -> bytes:
    return random.Random(seed).randbytes(2 * BLOCK)


@dataclass(frozen=True)
class Payload:
    seed: int
    size: int

    def block(self, index: int) -> bytes:
        """Block ``index`` (the last one may be short)."""
        start = index * BLOCK
        length = min(BLOCK, self.size - start)
        if length <= 0:
            return b""
        base = _base(self.seed)
        shift = (index * 2654435761 + self.seed * 40503) % BLOCK
        data = struct.pack("<QQ", self.seed, index) + base[shift + 16:shift + BLOCK]
        return data[:length]

    def chunks(self) -> Iterator[bytes]:
        for index in range((self.size + BLOCK - 1) // BLOCK):
            yield self.block(index)

    def data(self) -> bytes:
        """All of it at once (for small payloads)."""
        return b"".join(self.chunks())

    def crc32c(self) -> int:
        value = 0
        for chunk in self.chunks():
            value = crc32c.crc32c(chunk, value)
        return value

    def checksum(self) -> str:
        """As ckptfs records it (journal, ``x-amz-meta-ckptfs-checksum``, file-tier xattr)."""
        return f"crc32c:{self.crc32c():08x}"

    def write(self, path: Path, *, fsync: bool = False) -> None:
        """Create or truncate ``path`` and write the payload in 1 MiB writes; close it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            for chunk in self.chunks():
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def mismatch(self, data: bytes) -> str | None:
        """None if ``data`` is the payload, else where it first differs."""
        if len(data) != self.size:
            prefix = self.mismatch(data[: self.size]) if len(data) > self.size else None
            return prefix or f"{len(data)} bytes instead of {self.size}"
        for index in range((self.size + BLOCK - 1) // BLOCK):
            got = data[index * BLOCK:(index + 1) * BLOCK]
            if got != self.block(index):
                return _first_difference(got, self.block(index), index * BLOCK)
        return None

    def check_file(self, path: Path) -> str | None:
        """None if the file at ``path`` holds exactly the payload, else what differs."""
        size = os.stat(path).st_size
        if size != self.size:
            return f"{path}: {size} bytes instead of {self.size}"
        with open(path, "rb", buffering=0) as f:
            for index in range((self.size + BLOCK - 1) // BLOCK):
                want = self.block(index)
                got = b""
                while len(got) < len(want):
                    more = f.read(len(want) - len(got))
                    if not more:
                        return f"{path}: ends early at {index * BLOCK + len(got)}"
                    got += more
                if got != want:
                    return f"{path}: " + _first_difference(got, want, index * BLOCK)
        return None


def _first_difference(got: bytes, want: bytes, base: int) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"differs from offset {base + at} (block at {base})"
