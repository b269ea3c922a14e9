"""``CKPTFS_TEST_FULL=1``: the long variants of tests that run a quick variant by default.

The suite must stay well under 20 minutes on a 2-core machine, so a test whose cost grows with
a size, a number of rounds, seeds or nodes runs a quick variant that still exercises every
path it checks; the full one (the size or count the guarantee is stated for) runs with
``CKPTFS_TEST_FULL=1 python3 -m pytest -q tests/...``. Each such test names its two variants
beside the ``full_or`` call. Variables that pick one figure (``CKPTFS_TEST_BIG_DIR``,
``CKPTFS_FSX_SEEDS``, ...) still override both.
"""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

FULL = os.environ.get("CKPTFS_TEST_FULL", "") not in ("", "0")


def full_or(quick: T, full: T) -> T:
    """``full`` under ``CKPTFS_TEST_FULL=1``, else ``quick``."""
    return full if FULL else quick
