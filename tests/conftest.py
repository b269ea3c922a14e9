"""Shared fixtures. Real mounts come from ``mounter`` and are always unmounted in teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import Mounter
from tests.s3server import S3Server, start_server


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Mounter]:
    m = Mounter(tmp_path)
    try:
        yield m
    finally:
        m.teardown()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = start_server()
    try:
        yield server
    finally:
        server.stop()
