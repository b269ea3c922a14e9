"""Crash windows between the journal and the staging directory or the store, in-process.

A "kill" is an exception raised at a chosen point (or a state built directly, as a crash
leaves it); the node is then started again over the same staging directory and must converge
to what the store and the journal say. Deterministic: the autojump clock, a memory store.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckptfs.journal import Row, State
from ckptfs.tiers.memory import store_named
from tests.test_read_path import node

DATA = os.urandom(700_000)  # several fetch blocks (256 KiB)


class Killed(Exception):
    """The daemon died here."""


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"crash-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


def _kill(*_: object) -> None:
    raise Killed


async def _committed(root: Path, store: str, path: str) -> int:
    """A node under ``root`` writes ``path`` and waits until it is committed; its inode."""
    async with node(root, store) as a:
        ino = await a.write(path, DATA)
        await a.sync()
        assert a.fs.getattr(ino).state is State.COMMITTED
    assert store_named(store)[path].body == DATA
    return ino


async def _read_after_restart(root: Path, store: str, path: str, ino: int) -> Row:
    """Restart over ``root``: the file reads back as the store holds it, fetched from there."""
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        assert row.state is State.REMOTE, "no local data: it must be read from the store"
        gets = a.tier.calls["read_into"]
        assert await a.read(path) == store_named(store)[path].body == DATA
        assert a.tier.calls["read_into"] > gets
        return row


# -- (a) eviction: journal REMOTE first, then unlink -------------------------------------------


async def test_kill_during_eviction_before_the_journal_keeps_a_readable_file(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Killed when the eviction is about to journal REMOTE: the local copy must still be
    there (nothing was unlinked before the journal said so), and the file reads right."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        a.fs.ns.persist = _kill  # type: ignore[method-assign]
        with pytest.raises(Killed):
            a.fs.evict(row)
    async with node(root, store) as a:
        assert a.fs.getattr(ino).state is State.COMMITTED
        assert await a.read("step_1/model.pt") == DATA


async def test_kill_during_eviction_after_the_journal_reads_from_the_store(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Killed after the journal said REMOTE, before the unlink: the leftover data file is
    garbage, removed at start, and the file is fetched from the store."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        a.fs.staging.unlink = _kill  # type: ignore[method-assign]
        with pytest.raises(Killed):
            a.fs.evict(row)
    async with node(root, store) as a:
        assert not a.fs.staging.exists(ino), "a REMOTE row's unrecorded data file is garbage"
        assert a.fs.space.used == 0
    await _read_after_restart(root, store, "step_1/model.pt", ino)


@pytest.mark.parametrize("left", [None, 0, len(DATA) // 2])
async def test_committed_row_without_its_data_is_read_from_the_store(
    tmp_path: Path, store: str, left: int | None, autojump_clock: trio.abc.Clock
) -> None:
    """The state an unlink-first eviction (or a power loss) leaves: a COMMITTED row whose
    data file is missing, empty or short. Start-up makes it REMOTE: never zeros or nothing."""
    root = tmp_path / "a"
    ino = await _committed(root, store, "step_1/model.pt")
    data_file = root / "data" / str(ino)
    if left is None:
        data_file.unlink()
    else:
        os.truncate(data_file, left)
    await _read_after_restart(root, store, "step_1/model.pt", ino)
