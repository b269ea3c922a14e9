"""How figures read in messages: counts with their noun, byte sizes in binary units.

Every message of the CLI and the daemon uses these, so that ``status``, ``sync``, ``umount``
and the log say "1 file" and "6.3 MiB" the same way. Pure functions.
"""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``noun`` or its plural (``nouns``, default ``noun + "s"``) as ``n`` asks: no number."""
    return noun if n == 1 else (nouns or noun + "s")


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 file"``, ``"3 files"``."""
    return f"{n} {plural(n, noun, nouns)}"


def human_bytes(n: float) -> str:
    """``"512 B"``, ``"6.3 MiB"``: binary units, as ``status`` and ``df -h`` count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
