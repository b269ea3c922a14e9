"""FIFOs, UNIX sockets and device nodes (docs/SEMANTICS.md, "Special files").

Layers: the journal's schema migration (an old journal gains the ``rdev`` column), then real
mounts over a file store: each special file made through the mount behaves as on ext4 (a FIFO
carries bytes between a writer and a reader on this node, a socket accepts a connection, a
device node shows its number and never opens, the mount being ``nodev``), every metadata
operation works on it, the store holds a marker of it (an empty regular file, never the
special file itself), and a second node over the same store maps the same entries.
"""

from __future__ import annotations

import errno
import os
import socket
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.lifecycle.checkpoints import DEFAULT_DETECTOR, RemoteFile, build
from ckptfs.state.journal import SCHEMA_VERSION, Journal, Row, State
from ckptfs.store.tiers.base import Kind, ObjectMeta
from ckptfs.store.tiers.local import FileTier
from ckptfs.store.tiers.memory import MemoryTier
from ckptfs.store.tiers.transfer import copy_object
from ckptfs.store.trust import NOBODY, owner, special_mode
from tests.mounting import Mounter, status, sync, tiers_config, wait_for
from tests.s3bucket import PREFIX, Bucket

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mknod of a device node needs CAP_MKNOD")

CHR = os.makedev(1, 3)  # /dev/null's number: harmless were it ever opened (it is not)
BLK = os.makedev(7, 0)  # a loop device's number


# -- the journal ---------------------------------------------------------------------------

# The inodes table as schema 2 made it: no rdev column.
_V2_INODES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE inodes (
    ino INTEGER PRIMARY KEY AUTOINCREMENT, parent INTEGER, name BLOB, mode INTEGER NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL DEFAULT 0, mtime_ns INTEGER NOT NULL DEFAULT 0,
    ctime_ns INTEGER NOT NULL DEFAULT 0, target BLOB, state TEXT NOT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0, version INTEGER NOT NULL DEFAULT 0, checksum TEXT,
    tiers TEXT NOT NULL DEFAULT '', closed_at REAL, committed_at REAL, remote_key TEXT,
    uploading_key TEXT, blocks TEXT, storage_class TEXT, remote_etag TEXT,
    UNIQUE (parent, name)
);
INSERT INTO meta VALUES ('schema', '2'), ('created', '0');
INSERT INTO inodes (ino, parent, name, mode, uid, gid, state)
    VALUES (1, NULL, NULL, 16877, 0, 0, 'staged'),
           (2, 1, CAST('old.bin' AS BLOB), 33188, 5, 6, 'committed');
"""


def _columns(path: Path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return [r[1] for r in db.execute("PRAGMA table_info(inodes)")]
    finally:
        db.close()


def test_an_old_journal_gains_the_rdev_column_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    db = sqlite3.connect(path)
    db.executescript(_V2_INODES)
    db.close()
    assert "rdev" not in _columns(path)

    journal = Journal(path)
    try:
        old = journal.get(2)
        assert old is not None and (old.name, old.uid, old.rdev) == (b"old.bin", 5, 0)
        fifo = journal.insert(Row(0, 1, b"dev", stat.S_IFCHR | 0o600, 0, 0, rdev=CHR,
                                  state=State.STAGED))
        assert journal.get(fifo.ino).rdev == CHR  # type: ignore[union-attr]
    finally:
        journal.close()
    assert "rdev" in _columns(path)
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == \
            (str(SCHEMA_VERSION),)
    finally:
        db.close()
    Journal(path).close()  # opened again at the new version: nothing more to migrate


# -- the store -------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "rdev", "mapped"), [
    (stat.S_IFIFO | 0o640, 0, (stat.S_IFIFO | 0o640, 0)),
    (stat.S_IFIFO | 0o4755, 99, (stat.S_IFIFO | 0o755, 0)),  # set-id dropped, rdev meaningless
    (stat.S_IFCHR | 0o2666, CHR, (stat.S_IFCHR | 0o666, CHR)),
    (stat.S_IFBLK | 0o600, 2**64, None),  # no dev_t
    (stat.S_IFBLK | 0o600, -1, None),
    (stat.S_IFREG | 0o644, 0, None),  # a "special" object that is no special file
    (stat.S_IFDIR | 0o755, 0, None),
    (stat.S_IFLNK | 0o777, 0, None),
    (0o644, 0, None),
])
def test_the_store_decides_only_the_four_special_types(
    mode: int, rdev: int, mapped: tuple[int, int] | None
) -> None:
    assert special_mode(mode, rdev) == mapped
    assert owner(-1) == NOBODY


async def test_a_copy_to_another_tier_keeps_a_special_file(tmp_path: Path) -> None:
    """Retention's copies between tiers (tiers/transfer.py) put the entry, never bytes."""
    src = MemoryTier("warm", "memory://w", "special-copy")
    dst = FileTier("cold", f"file://{tmp_path}/cold", tmp_path / "cold")
    (tmp_path / "scratch").mkdir()
    meta = ObjectMeta(Kind.SPECIAL, stat.S_IFCHR | 0o600, 5, 0, 0, rdev=CHR)
    await src.put_entry("step_1/null", meta)
    await copy_object(src, dst, "step_1/null", 0, tmp_path / "scratch")
    got = (await dst.head("step_1/null")).meta
    assert (got.kind, got.mode, got.rdev, got.mtime_ns) == (Kind.SPECIAL, meta.mode, CHR, 5)
    assert stat.S_ISREG(os.lstat(tmp_path / "cold/step_1/null").st_mode)


# -- checkpoints -----------------------------------------------------------------------------


def test_a_special_file_is_no_file_and_no_marker_of_its_checkpoint() -> None:
    remote = {"warm": [RemoteFile("step_1/shard", 10), RemoteFile("step_1/COMMITTED", 0,
                                                                  special=True),
                       RemoteFile("step_2/shard", 10), RemoteFile("step_2/COMMITTED", 0)],
              "cold": [RemoteFile("step_2/shard", 10)]}
    cps = {c.name: c for c in build([], remote, step_regex="", tier_order=["hot", "warm", "cold"],
                                    detector=DEFAULT_DETECTOR,
                                    markers=list(DEFAULT_COMMIT_MARKERS))}
    # A FIFO named like a marker does not complete step_1; a real marker completes step_2.
    assert cps["step_1"].busy == "no marker" and cps["step_2"].complete
    assert dict(cps["step_1"].files) == {"step_1/shard": 10}
    # A cold copy without the special file's object still holds step_1: only files decide.
    remote["cold"] = [RemoteFile("step_1/shard", 10)]
    cps = {c.name: c for c in build([], remote, step_regex="", tier_order=["hot", "warm", "cold"],
                                    detector=DEFAULT_DETECTOR, markers=None)}
    assert cps["step_1"].held == frozenset({"warm", "cold"})


# -- on a mount ----------------------------------------------------------------------------


def _make_all(root: Path) -> dict[str, tuple[int, int]]:
    """Make one of each special file under ``root``; their expected (type, rdev) by name."""
    (root / "run").mkdir()
    os.mkfifo(root / "run/pipe", 0o640)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(root / "run/sock"))
    finally:
        sock.close()
    made = {"run/pipe": (stat.S_IFIFO, 0), "run/sock": (stat.S_IFSOCK, 0)}
    if ROOT:
        os.mknod(root / "run/null", stat.S_IFCHR | 0o600, CHR)
        os.mknod(root / "run/loop", stat.S_IFBLK | 0o600, BLK)
        made |= {"run/null": (stat.S_IFCHR, CHR), "run/loop": (stat.S_IFBLK, BLK)}
    return made


def _kinds(root: Path, names: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    out = {}
    for name in names:
        st = os.lstat(root / name)
        out[name] = (stat.S_IFMT(st.st_mode), st.st_rdev)
    return out


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_fifo_carries_bytes_between_a_writer_and_a_reader(mounter: Mounter) -> None:
    m = mounter()
    fifo = m.path / "progress"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    # (No user.ckptfs.state here: the kernel refuses user.* xattrs on special files, as on ext4.)
    got: list[bytes] = []

    def reader() -> None:
        with open(fifo, "rb") as f:  # blocks until the writer opens: a real FIFO
            got.append(f.read())

    t = threading.Thread(target=reader)
    t.start()
    with open(fifo, "wb") as f:
        f.write(b"step 1 done\n" * 1000)
    t.join(timeout=30)
    assert not t.is_alive()
    assert got == [b"step 1 done\n" * 1000]
    # Non-blocking opens as on any FIFO: no writer without a reader.
    with pytest.raises(OSError) as exc:
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert exc.value.errno == errno.ENXIO
    assert os.stat(fifo).st_size == 0  # nothing was staged for it


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_socket_bound_on_the_mount_accepts_a_connection(mounter: Mounter) -> None:
    m = mounter()
    path = str(m.path / "ctl.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(1)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(path)
            conn, _ = server.accept()
            with conn:
                client.sendall(b"ping")
                assert conn.recv(4) == b"ping"
        finally:
            client.close()
    finally:
        server.close()


@pytest.mark.mount
@pytest.mark.timeout(300)
@needs_root
def test_device_nodes_show_their_number_and_never_open(mounter: Mounter) -> None:
    m = mounter()
    os.mknod(m.path / "null", stat.S_IFCHR | 0o666, CHR)
    os.mknod(m.path / "loop", stat.S_IFBLK | 0o600, BLK)
    for name, kind, dev in (("null", stat.S_IFCHR, CHR), ("loop", stat.S_IFBLK, BLK)):
        st = os.stat(m.path / name)
        assert (stat.S_IFMT(st.st_mode), st.st_rdev) == (kind, dev)
        for flags in (os.O_RDONLY, os.O_WRONLY):
            with pytest.raises(OSError) as exc:
                os.open(m.path / name, flags | os.O_NONBLOCK)
            assert exc.value.errno in (errno.EACCES, errno.EPERM)  # the mount is nodev


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_metadata_operations_work_on_every_special_file(mounter: Mounter) -> None:
    m = mounter()
    made = _make_all(m.path)
    for name in made:
        path = m.path / name
        os.chmod(path, 0o604)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o604
        os.utime(path, ns=(1_600_000_000_000_000_000, 1_700_000_000_000_000_000))
        st = os.stat(path)
        assert (st.st_atime_ns, st.st_mtime_ns) == \
            (1_600_000_000_000_000_000, 1_700_000_000_000_000_000)
        if ROOT:
            os.chown(path, 1234, 5678)
            assert (os.stat(path).st_uid, os.stat(path).st_gid) == (1234, 5678)
        moved = path.with_name(path.name + ".moved")
        os.rename(path, moved)
        assert not path.exists() and (stat.S_IFMT(os.lstat(moved).st_mode),
                                      os.lstat(moved).st_rdev) == made[name]
        os.rename(moved, path)
    assert _kinds(m.path, made) == made
    # A rename over another special file replaces it, as on ext4.
    os.mkfifo(m.path / "run/other")
    os.rename(m.path / "run/other", m.path / "run/sock")
    assert stat.S_ISFIFO(os.lstat(m.path / "run/sock").st_mode)
    for name in os.listdir(m.path / "run"):
        os.unlink(m.path / "run" / name)
    os.rmdir(m.path / "run")
    sync(m)
    assert not (m.store / "run").exists()  # type: ignore[operator]


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_another_node_maps_the_same_entries(mounter: Mounter) -> None:
    a = mounter("a")
    made = _make_all(a.path)
    os.chmod(a.path / "run/pipe", 0o604)
    if ROOT:
        os.chown(a.path / "run/pipe", 1234, 5678)
    sync(a)
    store = a.store
    assert store is not None
    for name in made:
        # The store holds a marker, never the special file itself.
        st = os.lstat(store / name)
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0
        assert os.getxattr(store / name, "user.ckptfs.special")

    b = mounter("b", extra=["-o", "metadata_ttl=0.2s"])
    assert _kinds(b.path, made) == made
    pipe = os.stat(b.path / "run/pipe")
    assert stat.S_IMODE(pipe.st_mode) == 0o604
    if ROOT:
        assert (pipe.st_uid, pipe.st_gid) == (1234, 5678)

    # A rename on A reaches B: the entry is put at its new key, the old key retired.
    os.rename(a.path / "run/pipe", a.path / "run/pipe2")
    sync(a)
    wait_for("the rename on B", lambda: (b.path / "run/pipe2").exists()
             and not (b.path / "run/pipe").exists())
    assert stat.S_ISFIFO(os.stat(b.path / "run/pipe2").st_mode)
    # A FIFO on B is B's own pipe: it works there as on A.
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append((b.path / "run/pipe2").read_bytes()))
    t.start()
    (b.path / "run/pipe2").write_bytes(b"from b")
    t.join(timeout=30)
    assert got == [b"from b"]


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_special_files_survive_a_remount(mounter: Mounter) -> None:
    m = mounter()
    made = _make_all(m.path)
    m.umount()
    m.remount()
    assert _kinds(m.path, made) == made


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_a_crash_before_the_upload_puts_the_entry_at_the_next_start(
    mounter: Mounter, tmp_path: Path
) -> None:
    """The journal row is written at mknod; the store is down, so no put happens before the
    daemon is SIGKILLed. At the next start the row is replayed and the entry put."""
    store, down = tmp_path / "store", tmp_path / "down"
    store.mkdir()
    m = mounter(config=tiers_config(tmp_path / "c.toml", store.as_uri(),
                                    faults={"down_file": str(down)}, register_at_mount=True))
    down.touch()  # after the mount: a store down at mount time fails the mount
    made = _make_all(m.path)
    wait_for("a failed put", lambda: status(m)["failed"], timeout=60)
    assert not (store / "run/pipe").exists()
    m.kill()
    down.unlink()
    m.remount()
    assert _kinds(m.path, made) == made
    sync(m)
    for name, (kind, rdev) in made.items():
        mode, dev = os.getxattr(store / name, "user.ckptfs.special").decode().split(":")
        assert (stat.S_IFMT(int(mode, 8)), int(dev)) == (kind, rdev)


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_nodes_over_s3_map_the_same_entries_and_follow_changes(
    mounter: Mounter, bucket: Bucket, tmp_path: Path
) -> None:
    config = bucket.config(tmp_path / "c.toml", metadata_ttl="1s")
    a = mounter("a", config=config)
    made = _make_all(a.path)
    sync(a)
    head = bucket.client.head_object(Bucket=bucket.name, Key=PREFIX + "run/pipe")
    assert head["ContentLength"] == 0 and head["Metadata"]["ckptfs-kind"] == "special"
    assert int(head["Metadata"]["ckptfs-mode"], 8) == stat.S_IFIFO | 0o640
    if ROOT:
        head = bucket.client.head_object(Bucket=bucket.name, Key=PREFIX + "run/null")
        assert int(head["Metadata"]["ckptfs-rdev"]) == CHR

    b = mounter("b", config=config)
    assert _kinds(b.path, made) == made
    # Listed again (S3 lists no metadata: the kind is kept, not guessed), and a chmod and a
    # rename on A reach B.
    os.chmod(a.path / "run/sock", 0o600)
    os.rename(a.path / "run/pipe", a.path / "run/pipe2")
    sync(a)
    wait_for("A's changes on B", lambda: (b.path / "run/pipe2").exists()
             and not (b.path / "run/pipe").exists()
             and stat.S_IMODE(os.stat(b.path / "run/sock").st_mode) == 0o600)
    assert stat.S_ISFIFO(os.stat(b.path / "run/pipe2").st_mode)
    assert stat.S_ISSOCK(os.stat(b.path / "run/sock").st_mode)
