"""Power loss: what is left of a staging directory when the machine loses power, and a restart.

A "power loss" here copies the staging directory as the disk would hold it: a file's bytes
as they were at its last fsync(2)/fdatasync(2), and zeros where pages were never synced (the
size kept: the nastiest case, a size check passes). The journal's WAL is what its last fsync
wrote, or nothing. A restart starts a node over the copy; the run record (noderun.py) the
copy holds says an unclean stop on another boot, as a power loss leaves it.

Durability is observed through ``os.fsync``/``os.fdatasync`` (the calls ckptfs makes; SQLite's
own syncs, made in C, are not seen: a test of the journal models only what ``make_durable``
itself guarantees). Deterministic: the autojump clock, a memory store.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from ckptfs.cluster.noderun import RUN_FILE, boot_id
from ckptfs.engine.fs import ROOT_CALLER, state_label
from ckptfs.state.journal import ROOT_INODE, Journal, Row, State
from ckptfs.store.tiers.memory import store_named
from tests.test_read_path import Node, node

DATA = os.urandom(700_000)
PATH = "step_1/model.pt"


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"power-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


class Disk:
    """Records what each fsync/fdatasync made durable: the file's bytes at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: dict[str, bytes] = {}
        self._lock = threading.Lock()  # syncs run in worker threads
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._recording(getattr(os, name)))

    def _recording(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            real(fd)
            path = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.isfile(path):
                content = Path(path).read_bytes()
                with self._lock:
                    self.synced[path] = content
        return sync

    def power_loss(self, root: Path, dest: Path, *, reboot: bool = True) -> Path:
        """``dest``: ``root``'s data files as the disk holds them after a power loss. The
        journal is copied whole (these tests are about data files; ``test_make_durable_*``
        models the journal)."""
        shutil.copytree(root, dest)
        for path in (dest / "data").iterdir():
            source = str(root / "data" / path.name)
            if source in self.synced:
                path.write_bytes(self.synced[source])
            else:  # never synced: the size may have reached the disk, the pages did not
                path.write_bytes(bytes(path.stat().st_size))
        (dest / "journal.db-shm").unlink(missing_ok=True)
        (dest / "lock").unlink(missing_ok=True)
        if reboot:
            lose_power(dest)
        return dest


def lose_power(root: Path, boot: str = "a boot before the power loss") -> None:
    """The run record a run over ``root`` that never stopped leaves, on boot ``boot``."""
    (root / RUN_FILE).write_text(json.dumps({"boot_id": boot, "clean": False, "pid": 1}))


async def _committed(root: Path, store: str) -> int:
    async with node(root, store) as a:
        ino = await a.write(PATH, DATA)
        await a.sync()
        assert a.fs.getattr(ino).state is State.COMMITTED
    return ino


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    """Change bytes of a data file behind ckptfs's back (its size stays)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


async def _open_file(a: Node, path: str) -> tuple[int, Row]:
    step = a.fs.mkdir(ROOT_INODE, path.split("/")[0].encode(), 0o755, ROOT_CALLER)
    return a.fs.create(step.ino, path.split("/")[1].encode(), 0o644,
                       os.O_WRONLY | os.O_CREAT, ROOT_CALLER)


# -- a committed local copy is durable, and checked after a reboot -----------------------------


async def test_committed_data_survives_a_power_loss(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    """The uploader makes a file's data durable before the journal says COMMITTED: after a
    power loss (same size, pages never synced would be zeros) the local copy reads right."""
    disk = Disk(monkeypatch)
    ino = await _committed(tmp_path / "a", store)
    after = disk.power_loss(tmp_path / "a", tmp_path / "after", reboot=False)
    async with node(after, store) as a:
        assert a.fs.getattr(ino).state is State.COMMITTED
        gets = a.tier.calls["read_into"]
        assert await a.read(PATH) == DATA
        assert a.tier.calls["read_into"] == gets, "served from the local copy"


@pytest.mark.parametrize("damage", ["zeros", "flipped"])
async def test_committed_file_with_lost_pages_is_read_from_the_store_after_a_reboot(
    tmp_path: Path, store: str, damage: str, autojump_clock: trio.abc.Clock
) -> None:
    """A committed file whose size survived but whose bytes did not (a rewrite whose OPEN row
    the power loss took; data an older ckptfs never synced) is checked against its recorded
    checksum after a reboot: it is served from the store, and a later chmod does not push the
    wrong bytes over the good copy under the good checksum."""
    root = tmp_path / "a"
    ino = await _committed(root, store)
    data_file = root / "data" / str(ino)
    _overwrite(data_file, 300_000,
               bytes(4096) if damage == "zeros" else bytes(b ^ 0xFF for b in DATA[:4096]))
    lose_power(root)
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        assert row.state is State.REMOTE
        assert not a.fs.staging.exists(ino), "the wrong bytes are gone"
        assert await a.read(PATH) == DATA
        await a.fs.setattr(ino, mode=0o600)
        await a.sync()
    assert store_named(store)[PATH].body == DATA
    async with node(root, store) as a:
        assert await a.read(PATH) == DATA


async def test_a_restart_without_a_reboot_checks_sizes_only(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """The page cache survives a daemon's death (and a clean stop syncs it): a restart on the
    same boot does not read every local copy again (minutes on a full NVMe). Bytes changed
    behind ckptfs's back (here by the test) are not looked for then."""
    root = tmp_path / "a"
    ino = await _committed(root, store)
    _overwrite(root / "data" / str(ino), 0, bytes(4096))
    lose_power(root, boot=boot_id() or "")  # killed, not rebooted
    async with node(root, store) as a:
        assert a.fs.getattr(ino).state is State.COMMITTED
    (root / RUN_FILE).write_text(json.dumps({"boot_id": "before", "clean": True}))
    async with node(root, store) as a:
        assert a.fs.getattr(ino).state is State.COMMITTED  # a clean stop synced everything
    lose_power(root)
    async with node(root, store) as a:
        assert a.fs.getattr(ino).state is State.REMOTE


async def test_closed_file_cut_short_by_a_power_loss_is_incomplete_not_uploaded_short(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Closed (FLUSH recorded closed_at) just before the power loss, never synced: the data
    file came back shorter than the close recorded. It is incomplete, never uploaded at the
    truncated size."""
    root = tmp_path / "a"
    async with node(root, store) as a:
        fh, row = await _open_file(a, PATH)
        await a.fs.write(fh, 0, DATA)
        a.fs.flush(fh)  # close(2) returned; RELEASE never came
        ino = row.ino
    os.truncate(root / "data" / str(ino), len(DATA) // 3)
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        assert row.incomplete and state_label(row) == "incomplete"
        assert row.size == len(DATA) // 3
        await a.sync()
        assert PATH not in store_named(store)
        assert [r.ino for r in a.fs.journal.rows_in_states(State.OPEN) if r.incomplete] == [ino]


async def test_staged_file_cut_short_by_a_power_loss_is_incomplete_not_retried_forever(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Staged (the store was down), then the power loss took its tail: it is reported
    incomplete, and the uploader does not retry an upload that can never succeed."""
    root = tmp_path / "a"
    async with node(root, store) as a:
        a.tier.down = True
        ino = await a.write(PATH, DATA)
        await trio.sleep(5)
        assert a.fs.getattr(ino).state is State.STAGED
    os.truncate(root / "data" / str(ino), len(DATA) // 2)
    async with node(root, store) as a:
        row = a.fs.getattr(ino)
        assert row.incomplete and state_label(row) == "incomplete"
        with trio.fail_after(600):
            await a.sync()
        assert PATH not in store_named(store)
        assert a.fs.listener.stats.retries == 0  # type: ignore[attr-defined]
        # Written again, it is a file like any other.
        fh = await a.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        await a.fs.write(fh, 0, DATA)
        a.fs.flush(fh)
        a.fs.release(fh)
        await a.sync()
        assert store_named(store)[PATH].body == DATA


# -- make_durable with another reader holding a snapshot ---------------------------------------


def test_make_durable_syncs_the_wal_while_a_reader_holds_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline ``ckptfs retention --plan`` holds a read transaction: the PASSIVE checkpoint
    cannot complete (and syncs nothing). make_durable must still make the row durable: after a
    power loss that keeps only what was fsynced, the row is there."""
    root = tmp_path / "a"
    root.mkdir()
    journal = Journal(root / "journal.db")
    journal.ensure_root(0, 0, stat.S_IFDIR | 0o755)
    journal.close()  # a clean close: everything is in journal.db, on disk
    baseline = (root / "journal.db").read_bytes()

    disk = Disk(monkeypatch)
    journal = Journal(root / "journal.db")
    reader = sqlite3.connect(root / "journal.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM inodes").fetchone()  # the snapshot is taken here
    row = journal.insert(Row(0, ROOT_INODE, b"model.pt", stat.S_IFREG | 0o644, 0, 0, size=7,
                             state=State.STAGED, closed_at=1.0))
    _busy, frames, done = journal._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert done < frames, "the reader holds the checkpoint back (the case under test)"
    journal.make_durable()

    after = tmp_path / "after"
    after.mkdir()
    (after / "journal.db").write_bytes(disk.synced.get(str(root / "journal.db"), baseline))
    wal = disk.synced.get(str(root / "journal.db-wal"))
    if wal is not None:
        (after / "journal.db-wal").write_bytes(wal)
    reader.rollback()
    reader.close()
    journal.close()
    survivor = Journal(after / "journal.db")
    try:
        found = survivor.get(row.ino)
        assert found is not None and found.name == b"model.pt" and found.size == 7
    finally:
        survivor.close()


async def test_fsync_is_durable_while_a_reader_holds_a_snapshot(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    """fsync(2) of an open file, a reader holding the journal: after a power loss the data
    and the row (its size) are both there, and the file comes back incomplete (its writer
    never closed it), with every fsynced byte."""
    root = tmp_path / "a"
    async with node(root, store):
        pass  # the journal exists and was closed cleanly
    baseline = (root / "journal.db").read_bytes()
    disk = Disk(monkeypatch)
    reader = sqlite3.connect(root / "journal.db", isolation_level=None)
    try:
        async with node(root, store) as a:
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM inodes").fetchone()
            fh, row = await _open_file(a, PATH)
            await a.fs.write(fh, 0, DATA)
            await a.fs.fsync(fh, datasync=False)
            ino = row.ino
            after = tmp_path / "after"
            (after / "data").mkdir(parents=True)
            (after / "journal.db").write_bytes(disk.synced.get(str(root / "journal.db"),
                                                               baseline))
            wal = disk.synced.get(str(root / "journal.db-wal"))
            if wal is not None:
                (after / "journal.db-wal").write_bytes(wal)
            data = disk.synced.get(str(root / "data" / str(ino)))
            if data is not None:
                (after / "data" / str(ino)).write_bytes(data)
            a.fs.release(fh)
    finally:
        reader.close()
    async with node(after, store) as a:
        row = a.fs.getattr(ino)
        assert row.incomplete and row.size == len(DATA)
        fh = await a.fs.open(ino, os.O_RDONLY)
        assert await a.fs.read(fh, 0, len(DATA)) == DATA
        a.fs.release(fh)


# -- the space budget reserves exactly and gives the surplus back ------------------------------


async def test_concurrent_extending_writes_are_accounted_exactly(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Two writes extend one file while the staging budget is full: each reserved from the
    size it saw, which the other changes while they wait. What is accounted afterwards is the
    file's size, not the sum of the guesses (a surplus that would stay until a remount)."""
    n = 100_000
    async with node(tmp_path / "a", store, max_bytes=4 * n) as a:
        a.tier.down = True
        await a.write("step_1/full.bin", os.urandom(4 * n))  # fills the budget, not committed
        assert a.fs.space.used == 4 * n
        fh, row = await _open_file(a, "step_2/model.pt")
        chunks = [os.urandom(n), os.urandom(n)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.fs.write, fh, 0, chunks[0])
            nursery.start_soon(a.fs.write, fh, n, chunks[1])
            await trio.sleep(10)
            assert a.fs.stall_seconds == 0 and a.fs.getattr(row.ino).size == 0, "both wait"
            a.tier.down = False  # full.bin is committed, then evicted: room for both
        assert a.fs.getattr(row.ino).size == 2 * n
        assert a.fs.space.used == 2 * n
        a.fs.flush(fh)
        a.fs.release(fh)
        assert a.fs.space.used == a.fs.journal.local_bytes() == 2 * n
        await a.fs.setattr(row.ino, size=n // 2)
        assert a.fs.space.used == a.fs.journal.local_bytes() == n // 2


async def test_a_truncate_waiting_for_space_settles_against_the_size_it_finds(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """A truncate that extends a file waits for space; a write extends the file further
    meanwhile. The truncate shrinks it back: the budget follows, to the byte."""
    n = 100_000
    async with node(tmp_path / "a", store, max_bytes=4 * n) as a:
        a.tier.down = True
        await a.write("step_1/full.bin", os.urandom(4 * n))
        fh, row = await _open_file(a, "step_2/model.pt")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: a.fs.setattr(row.ino, size=n))
            await trio.sleep(1)
            nursery.start_soon(a.fs.write, fh, 0, os.urandom(2 * n))
            await trio.sleep(10)
            a.tier.down = False
        a.fs.flush(fh)
        a.fs.release(fh)
        size = a.fs.getattr(row.ino).size
        assert a.fs.space.used == a.fs.journal.local_bytes() == size


@pytest.mark.timeout(60)
async def test_writers_waiting_for_space_do_not_wake_each_other_forever(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock
) -> None:
    """Each waiting writer hurries the uploader, and a hurry wakes every waiter: two writers
    that hurried at every wake-up would wake each other in a loop that never sleeps (100% CPU
    on a real clock; no virtual time ever passes under the autojump clock)."""
    n = 100_000
    async with node(tmp_path / "a", store, max_bytes=n) as a:
        a.tier.down = True
        await a.write("step_1/full.bin", os.urandom(n))
        hurries = 0
        real_hurry = a.fs.listener.hurry

        def hurry() -> None:
            nonlocal hurries
            hurries += 1
            real_hurry()

        a.fs.listener.hurry = hurry  # type: ignore[method-assign]
        fh, _ = await _open_file(a, "step_2/model.pt")
        with trio.move_on_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.fs.write, fh, 0, os.urandom(n))
                nursery.start_soon(a.fs.write, fh, n, os.urandom(n))
        assert hurries <= 2 * (30 + 1)  # at most once a second each
