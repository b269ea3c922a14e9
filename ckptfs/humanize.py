"""How figures read in messages and tables: counts with their noun, byte sizes in binary
units, and the console the CLI prints tables on.

Every message of the CLI and the daemon uses these, so that ``status``, ``sync``, ``umount``
and the log say "1 file" and "6.3 MiB" the same way. Pure functions but ``console``.
"""

from __future__ import annotations

from typing import Any


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``noun`` or its plural (``nouns``, default ``noun + "s"``) as ``n`` asks: no number."""
    return noun if n == 1 else (nouns or noun + "s")


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 file"``, ``"3 files"``."""
    return f"{n} {plural(n, noun, nouns)}"


def human_bytes(n: float) -> str:
    """``"512 B"``, ``"6.3 MiB"``: binary units, as ``status`` and ``df -h`` count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


# Without a terminal (a pipe, a batch job's log) tables are this wide: nothing is cut.
UNCUT_WIDTH = 100_000


def console(stderr: bool = False) -> Any:
    """A rich console: on a terminal, as wide as it is; anywhere else wide enough that no
    value of a table is cut or folded (a node id, a path, a state must be copied whole from
    a batch log or a pipe). ``--json`` is still the format for programs."""
    from rich.console import Console

    out = Console(stderr=stderr)
    if not out.is_terminal:
        out = Console(stderr=stderr, width=UNCUT_WIDTH)
    return out
