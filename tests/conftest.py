"""Shared fixtures. Real mounts come from ``mounter`` and are always unmounted in teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import Mounter


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Mounter]:
    m = Mounter(tmp_path)
    try:
        yield m
    finally:
        m.teardown()
