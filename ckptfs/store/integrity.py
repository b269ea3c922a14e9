"""Checksums that travel with every object: one CRC32C of the whole file and one per block.

The whole-file CRC32C (``crc32c:<8 hex>``) proves a file assembled from the store is the file
that was uploaded. The per-block CRCs let a *range* read be verified before its bytes are
served, without downloading the rest of the object.

Block layout: blocks are aligned, ``block_size`` bytes each (the last one shorter). The block
size is a power of two, at least ``MIN_BLOCK`` and large enough that a file has at most
``MAX_BLOCKS`` blocks, so the list fits in S3 user metadata (2 KB in all):
256 CRCs are 1,024 bytes, 1,368 in base64. The encoded form is
``<block size>:<base64 of the 4-byte big-endian CRCs>``.

Invariants: pure functions over bytes and files; nothing here touches the journal or a tier.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import crc32c

MAX_BLOCKS = 256
# The smallest integrity block: fine-grained enough that a reader verifies what it fetches
# without reading far beyond it, coarse enough that the CRC list stays small.
MIN_BLOCK = 1024 * 1024
_READ_CHUNK = 8 * 1024 * 1024


def block_size_for(size: int, min_block: int) -> int:
    """The integrity block size of a ``size``-byte file (a power of two >= ``min_block``)."""
    block = min_block
    while block * MAX_BLOCKS < size:
        block *= 2
    return block


@dataclass(frozen=True, slots=True)
class BlockSums:
    block_size: int
    crcs: tuple[int, ...]

    def encode(self) -> str:
        raw = struct.pack(f">{len(self.crcs)}I", *self.crcs)
        return f"{self.block_size}:{base64.b64encode(raw).decode()}"

    @classmethod
    def decode(cls, text: str | None) -> BlockSums | None:
        """None for a missing or malformed value (the object is then verified whole only)."""
        if not text:
            return None
        size_text, _, data = text.partition(":")
        try:
            block_size = int(size_text)
            raw = base64.b64decode(data, validate=True)
        except (ValueError, binascii.Error):
            return None
        if block_size <= 0 or block_size & (block_size - 1) or len(raw) % 4:
            return None
        return cls(block_size, struct.unpack(f">{len(raw) // 4}I", raw))

    def matches_size(self, size: int) -> bool:
        return len(self.crcs) == -(-size // self.block_size)


def format_crc(value: int) -> str:
    return f"crc32c:{value:08x}"


def file_sums(path: Path, size: int, min_block: int = MIN_BLOCK) -> tuple[str, BlockSums]:
    """Whole-file CRC32C and per-block CRCs of the first ``size`` bytes of ``path``, one pass."""
    block = block_size_for(size, min_block)
    whole = 0
    crcs: list[int] = []
    with open(path, "rb", buffering=0) as f:
        left = size
        while left > 0:
            # One block at a time, read in chunks: a block CRC continues across its chunks.
            block_left = min(block, left)
            value = 0
            while block_left > 0:
                chunk = f.read(min(_READ_CHUNK, block_left))
                if not chunk:
                    raise OSError(f"{path} is shorter than {size} bytes")
                value = crc32c.crc32c(chunk, value)
                whole = crc32c.crc32c(chunk, whole)
                block_left -= len(chunk)
                left -= len(chunk)
            crcs.append(value)
    return format_crc(whole), BlockSums(block, tuple(crcs))


def range_crc(fd: int, offset: int, length: int) -> int:
    """CRC32C of ``length`` bytes of ``fd`` at ``offset`` (read back from the page cache)."""
    value = 0
    done = 0
    while done < length:
        chunk = os.pread(fd, min(_READ_CHUNK, length - done), offset + done)
        if not chunk:
            break
        value = crc32c.crc32c(chunk, value)
        done += len(chunk)
    return value


def fd_checksum(fd: int, size: int) -> str:
    return format_crc(range_crc(fd, 0, size))
