"""Crash acceptance: SIGKILL the daemon mid-write, remount the same staging, check everything.

"SIGKILL the daemon while files are being written and others are closed; remount the same
staging: every file closed before the kill reads back with identical bytes; the file being
written is reported incomplete."

Also: fsync()ed-but-open data survives; SIGTERM unmounts cleanly; ``ckptfs umount`` clears a
mount whose daemon was SIGKILLed (ENOTCONN).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptfs.store.tiers.base import CONTROL_PREFIX
from tests.mounting import Mount, Mounter, ckptfs, is_mounted, wait_dead, wait_for

pytestmark = [pytest.mark.mount, pytest.mark.slow, pytest.mark.both_modes]

MiB = 1 << 20
CHUNK = 64 * 1024
STREAM_CAP = 48 * MiB  # the writer stops growing the file here (but keeps it open)
FSYNCED_BYTES = 3 * MiB  # fsynced.bin: this much is fsync()ed, then 1 MiB more is written


# -- the writer: a separate process that keeps files open -----------------------------------

WRITER = r"""
import os, random, sys, time
stream_path, fsynced_path, seed, sync_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cap, chunk, fsynced = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])

def out(*words):
    print(*words, flush=True)

# A file fsync()ed while open, then written some more, never closed.
data = random.Random(seed).randbytes(fsynced + (1 << 20))
fd2 = os.open(fsynced_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
os.write(fd2, data[:fsynced])
os.fsync(fd2)
os.write(fd2, data[fsynced:])
out("fsynced", fsynced)

# A file written for as long as we live.
rng = random.Random(seed + 1)
fd = os.open(stream_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
total = 0
try:
    while True:
        if total >= cap:
            time.sleep(0.01)
            os.fstat(fd)
            continue
        buf = memoryview(rng.randbytes(chunk))
        while buf:
            buf = buf[os.write(fd, buf):]
        total += chunk
        out("wrote", total)
        if total == sync_at:
            os.fsync(fd)
            out("synced", total)
except OSError as exc:
    out("error", exc.errno)
"""


def stream_bytes(seed: int, size: int) -> bytes:
    """What the writer writes to stream.bin with this seed (the first ``size`` bytes)."""
    rng = random.Random(seed + 1)
    out = bytearray()
    while len(out) < size:
        out += rng.randbytes(CHUNK)
    return bytes(out[:size])


def fsynced_bytes(seed: int) -> bytes:
    return random.Random(seed).randbytes(FSYNCED_BYTES + MiB)


class Writer:
    """Runs WRITER against ``directory``; follows its progress from its stdout."""

    def __init__(self, directory: Path, seed: int, sync_at: int) -> None:
        self.stream = directory / "stream.bin"
        self.fsynced = directory / "fsynced.bin"
        self.seed = seed
        self.written = 0
        self.synced = 0
        self.fsynced_ok = False
        self.error: int | None = None
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(self.stream), str(self.fsynced), str(seed),
             str(sync_at), str(STREAM_CAP), str(CHUNK), str(FSYNCED_BYTES)],
            stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            what, _, value = line.partition(" ")
            with self._cond:
                if what == "wrote":
                    self.written = int(value)
                elif what == "synced":
                    self.synced = int(value)
                elif what == "fsynced":
                    self.fsynced_ok = True
                elif what == "error":
                    self.error = int(value)
                self._cond.notify_all()

    def wait_for(self, written: int, synced: int = 0, timeout: float = 30) -> None:
        """Until the fsynced file is done and the stream has ``written``/``synced`` bytes."""
        def reached() -> bool:
            return self.fsynced_ok and self.written >= written and self.synced >= synced

        with self._cond:
            ok = self._cond.wait_for(lambda: reached() or self.proc.poll() is not None, timeout)
        assert ok and reached() and self.proc.poll() is None, (
            f"writer stopped or stalled (rc={self.proc.poll()}, written={self.written}, "
            f"error={self.error})"
        )

    def stop(self) -> None:
        """After the kill: the writer must see an error (not hang); reap it either way."""
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the writer hung on a dead mount") from None
        finally:
            self._thread.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    started: list[Writer] = []
    try:
        yield started
    finally:
        for w in started:
            w.kill()


# -- the expected tree ---------------------------------------------------------------------


@dataclass
class Expected:
    """What the mount must show after a crash, relative to its root."""

    files: dict[str, tuple[int, str, int, int]] = field(default_factory=dict)  # size, sha, mode, mtime
    dirs: dict[str, int] = field(default_factory=dict)  # mode
    links: dict[str, str] = field(default_factory=dict)
    # Incomplete files: path -> (bytes they must start with, bytes they may have at most).
    incomplete: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    # After the first remount an incomplete file must not change any more.
    incomplete_seen: dict[str, str] = field(default_factory=dict)

    def record_file(self, root: Path, rel: str) -> None:
        st = os.stat(root / rel)
        digest = hashlib.sha256((root / rel).read_bytes()).hexdigest()
        self.files[rel] = (st.st_size, digest, stat.S_IMODE(st.st_mode), st.st_mtime_ns)

    def record_dir(self, root: Path, rel: str) -> None:
        self.dirs[rel] = stat.S_IMODE(os.stat(root / rel).st_mode)

    def rename(self, old: str, new: str) -> None:
        """Carry a rename (of a file or a whole directory) into the expectations."""
        for table in (self.files, self.dirs, self.links):
            for key in list(table):
                if key == old or key.startswith(old + "/"):
                    table[new + key[len(old):]] = table.pop(key)  # type: ignore[assignment]


def write_file(root: Path, rel: str, data: bytes, *, mode: int | None = None,
               mtime_ns: int | None = None) -> None:
    path = root / rel
    with open(path, "wb") as f:
        # Uneven write sizes, so that the kernel sees partial pages and odd offsets.
        view = memoryview(data)
        step = 1
        while view:
            f.write(view[:step])
            view = view[step:]
            step = min(step * 7 + 13, 3 * MiB)
    if mode is not None:
        os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def write_closed_files(root: Path, exp: Expected, rnd: int, rng: random.Random,
                       big: bool) -> None:
    """A DCP-like checkpoint plus odds and ends, every file closed when this returns."""
    step = f"step_{rnd}00"
    tmp = f"{step}.tmp"
    (root / tmp / "model" / "layers").mkdir(parents=True)
    (root / tmp / "optim").mkdir()
    (root / tmp / "empty").mkdir(mode=0o750)
    os.chmod(root / tmp / "empty", 0o750)
    sizes = [0, 1, 4095, 4096, 128 * 1024 + 1, MiB, 10 * MiB + 17] + ([24 * MiB + 3] if big else [])
    rng.shuffle(sizes)
    for i, size in enumerate(sizes):
        sub = "model/layers" if i % 2 else "optim"
        write_file(root, f"{tmp}/{sub}/shard_{i}.distcp", rng.randbytes(size),
                   mode=[0o644, 0o600, 0o755][i % 3])
    write_file(root, f"{tmp}/old_mtime.bin", rng.randbytes(1000),
               mtime_ns=1_600_000_000_123_456_789 + rnd)
    # Overwritten with shorter content: only the second version may survive.
    write_file(root, f"{tmp}/overwritten.bin", rng.randbytes(2 * MiB))
    write_file(root, f"{tmp}/overwritten.bin", rng.randbytes(1234))
    # Written, closed, deleted: must not come back.
    write_file(root, f"{tmp}/deleted.bin", rng.randbytes(5000))
    os.unlink(root / tmp / "deleted.bin")
    # DCP: .metadata.tmp -> .metadata, then the directory x.tmp -> x.
    write_file(root, f"{tmp}/.metadata.tmp", rng.randbytes(777))
    os.rename(root / tmp / ".metadata.tmp", root / tmp / ".metadata")
    for dirpath, dirnames, filenames in os.walk(root / tmp):
        rel_dir = os.path.relpath(dirpath, root)
        exp.record_dir(root, rel_dir)
        for name in filenames:
            exp.record_file(root, f"{rel_dir}/{name}")
    os.rename(root / tmp, root / step)
    exp.rename(tmp, step)
    os.symlink(step, root / f"latest_{rnd}")
    exp.links[f"latest_{rnd}"] = step
    os.symlink("../nowhere/dangling", root / step / "dangling")
    exp.links[f"{step}/dangling"] = "../nowhere/dangling"
    # A top-level pointer file, rewritten every round through rename (like `latest`).
    write_file(root, "latest.txt.tmp", f"{step}\n".encode())
    os.rename(root / "latest.txt.tmp", root / "latest.txt")
    exp.record_file(root, "latest.txt")


def check_tree(m: Mount, exp: Expected) -> None:
    root = m.path
    seen_files: set[str] = set()
    seen_dirs: set[str] = set()
    seen_links: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            (seen_links if os.path.islink(root / rel) else seen_dirs).add(rel)
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            (seen_links if os.path.islink(root / rel) else seen_files).add(rel)
    incomplete_dirs = {os.path.dirname(p) for p in exp.incomplete}
    assert seen_files == set(exp.files) | set(exp.incomplete)
    assert seen_dirs == set(exp.dirs) | incomplete_dirs
    assert seen_links == set(exp.links)

    for rel, (size, digest, mode, mtime_ns) in exp.files.items():
        st = os.stat(root / rel)
        assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (size, mode, mtime_ns), rel
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest, rel
        state = m.state(rel)
        assert state not in ("incomplete", "open"), f"{rel} was closed before the kill: {state}"
    for rel, mode in exp.dirs.items():
        assert stat.S_IMODE(os.stat(root / rel).st_mode) == mode, rel
    for rel, target in exp.links.items():
        assert os.readlink(root / rel) == target, rel

    for rel, (must, may) in exp.incomplete.items():
        assert m.state(rel) == "incomplete", rel
        data = (root / rel).read_bytes()  # readable, not EIO
        assert os.stat(root / rel).st_size == len(data), rel
        assert len(data) >= len(must), f"{rel}: {len(data)} bytes, fsynced {len(must)}"
        assert data == may[: len(data)], f"{rel}: content is not what was written"
        digest = hashlib.sha256(data).hexdigest()
        if rel in exp.incomplete_seen:
            assert exp.incomplete_seen[rel] == digest, f"{rel} changed across remounts"
        exp.incomplete_seen[rel] = digest
    # getfattr, as an operator would ask.
    for rel in exp.incomplete:
        out = subprocess.run(["getfattr", "--only-values", "-n", "user.ckptfs.state",
                              str(root / rel)], capture_output=True, text=True, check=True)
        assert out.stdout == "incomplete"


def store_tree(store: Path) -> tuple[set[str], set[str]]:
    """(regular files, symlinks) under ``store``, relative to it (the nodes' shared state
    under ``.ckptfs/`` aside)."""
    files: set[str] = set()
    links: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(store):
        if dirpath == str(store):
            dirnames[:] = [d for d in dirnames if d != CONTROL_PREFIX.rstrip("/")]
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), store)
            if os.path.islink(store / rel):
                links.add(rel)
            elif name in filenames:
                files.add(rel)
    return files, links


def check_store(m: Mount, exp: Expected, *, exactly: bool = False) -> None:
    """After ``ckptfs sync``: the file tier holds every closed file with the right bytes.

    Files never closed (incomplete) and deleted files are never published. With ``exactly``,
    nothing else is there either: no copy under a name renamed away, no temporary file.
    """
    assert m.store is not None
    done = ckptfs("sync", m.path, "--timeout", "60", check=False)
    assert done.returncode == 0, done.stderr
    files, links = store_tree(m.store)
    assert set(exp.files) <= files, f"missing from the store: {sorted(set(exp.files) - files)}"
    never = {rel for rel in files
             if rel in exp.incomplete or os.path.basename(rel) == "deleted.bin"}
    assert not never, f"published but never closed, or deleted: {sorted(never)}"
    if exactly:
        assert files == set(exp.files), f"stale in the store: {sorted(files - set(exp.files))}"
        assert links == set(exp.links), f"stale links in the store: {sorted(links)}"
    for rel, (size, digest, mode, mtime_ns) in exp.files.items():
        st = os.lstat(m.store / rel)
        assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (size, mode, mtime_ns), rel
        assert hashlib.sha256((m.store / rel).read_bytes()).hexdigest() == digest, rel
        assert m.state(rel) == "committed", rel
    for rel, target in exp.links.items():
        assert os.readlink(m.store / rel) == target, rel
    for rel in exp.dirs:
        assert (m.store / rel).is_dir(), f"directory {rel} is not in the store"


# -- the tests -----------------------------------------------------------------------------


# kill timing per round: where the daemon dies relative to the other activity.
ROUNDS = [
    # (name, writer started before the closed files?, bytes the stream must reach, delay)
    ("right-after-the-last-operation", True, CHUNK, 0.0),
    ("deep-in-a-big-write", False, 24 * MiB, 0.0),
    ("after-a-pause", True, 2 * MiB, 0.3),
]


def test_sigkill_while_writing(mounter: Mounter, writers: list[Writer]) -> None:
    m = mounter("crash")
    exp = Expected()
    rng = random.Random(20240611)
    for rnd, (name, writer_first, reach, delay) in enumerate(ROUNDS):
        inflight = f"inflight_{rnd}"
        (m.path / inflight).mkdir()
        exp.record_dir(m.path, inflight)
        sync_at = 8 * MiB if reach >= 8 * MiB else -1
        w: Writer | None = None
        if writer_first:
            w = Writer(m.path / inflight, seed=rnd, sync_at=sync_at)
            writers.append(w)
            w.wait_for(written=1)
        write_closed_files(m.path, exp, rnd, rng, big=rnd == 1)
        if w is None:
            w = Writer(m.path / inflight, seed=rnd, sync_at=sync_at)
            writers.append(w)
        w.wait_for(written=reach, synced=max(sync_at, 0))
        time.sleep(delay)
        written_before_kill = w.written
        assert w.proc.poll() is None, "the writer must still be writing at the kill"
        m.kill()
        w.stop()
        assert w.error in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO), (name, w.error)
        assert not is_mounted(m.path)

        stream_rel = f"{inflight}/stream.bin"
        exp.incomplete[stream_rel] = (
            stream_bytes(rnd, max(w.synced, 0)),
            stream_bytes(rnd, max(w.written, written_before_kill) + 4 * CHUNK),
        )
        fs = fsynced_bytes(rnd)
        exp.incomplete[f"{inflight}/fsynced.bin"] = (fs[:FSYNCED_BYTES], fs)

        m.remount()
        try:
            check_tree(m, exp)
            check_store(m, exp)
        except AssertionError as exc:
            raise AssertionError(f"round {rnd} ({name}): {exc}") from exc
    # A clean unmount and one more remount keep the same picture.
    m.umount()
    m.remount()
    check_tree(m, exp)
    check_store(m, exp)


def test_fsync_then_kill(mounter: Mounter) -> None:
    """fsync()ed data of a file still open is there after a crash, even if never closed."""
    m = mounter("fsync")
    data = random.Random(7).randbytes(5 * MiB + 11)
    fd = os.open(m.path / "open.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data[: 3 * MiB])
        os.fsync(fd)
        os.write(fd, data[3 * MiB:])
        os.fdatasync(fd)
        m.kill()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    m.remount()
    assert m.state("open.bin") == "incomplete"
    assert (m.path / "open.bin").read_bytes() == data


def test_kill_right_after_close(mounter: Mounter) -> None:
    """close() returned, then the daemon died before any other request: the file is closed."""
    m = mounter("close")
    data = random.Random(11).randbytes(MiB + 5)
    states = []
    for i in range(3):
        pid = m.pid
        fd = os.open(m.path / f"f{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
        os.kill(pid, signal.SIGKILL)  # nothing else goes through FUSE in between
        wait_dead(pid)
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)
        m.remount()
        assert (m.path / f"f{i}.bin").read_bytes() == data
        states.append(m.state(f"f{i}.bin"))
    assert "incomplete" not in states, states


def test_kill_right_after_a_burst_of_metadata(mounter: Mounter) -> None:
    """Creates, a rename, an unlink, a chmod, then SIGKILL at once: the journal's group commit
    had not committed the last of them (journal.py ``commit_batches``), its redo log had
    them, and the remount shows every one."""
    m = mounter("burst")
    pid = m.pid
    (m.path / "d").mkdir()
    for i in range(200):
        fd = os.open(m.path / "d" / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"x" * i)
        os.close(fd)
    os.rename(m.path / "d" / "f1", m.path / "d" / "moved")
    os.unlink(m.path / "d" / "f2")
    os.chmod(m.path / "d" / "f3", 0o600)
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)
    m.remount()
    names = set(os.listdir(m.path / "d"))
    assert names == {f"f{i}" for i in range(200)} - {"f1", "f2"} | {"moved"}
    assert all(os.stat(m.path / "d" / f"f{i}").st_size == i for i in range(3, 200))
    assert stat.S_IMODE(os.stat(m.path / "d" / "f3").st_mode) == 0o600
    assert "incomplete" not in {m.state(f"d/f{i}") for i in range(3, 200)}


def test_kill_during_rename_leaves_one_copy(mounter: Mounter) -> None:
    """DCP's "write x.tmp/, rename to x/", killed at once: the store ends with x/ only."""
    m = mounter("rename")
    assert m.store is not None
    rng = random.Random(5)
    exp = Expected()
    for i in range(3):
        tmp, final = f"step_{i}.tmp", f"step_{i}"
        (m.path / tmp).mkdir()
        for j in range(4):
            write_file(m.path, f"{tmp}/f{j}", rng.randbytes(100_000 + j))
            exp.record_file(m.path, f"{tmp}/f{j}")
        exp.record_dir(m.path, tmp)
        os.rename(m.path / tmp, m.path / final)
        exp.rename(tmp, final)
        m.kill()
        m.remount()
        check_tree(m, exp)
        check_store(m, exp, exactly=True)
    m.umount()
    files, _ = store_tree(m.store)
    assert files == set(exp.files), f"stale in the store: {sorted(files - set(exp.files))}"


def test_sigterm_unmounts_cleanly(mounter: Mounter) -> None:
    m = mounter("term")
    rng = random.Random(3)
    exp = Expected()
    write_closed_files(m.path, exp, 0, rng, big=False)
    # A writer still has a file open: SIGTERM must unmount anyway, and keep its bytes.
    (m.path / "busy").mkdir()
    exp.record_dir(m.path, "busy")
    busy = rng.randbytes(3 * MiB + 3)
    fd = os.open(m.path / "busy" / "open.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, busy)
        pid = m.pid
        os.kill(pid, signal.SIGTERM)
        wait_for("SIGTERM to unmount", lambda: not is_mounted(m.path), timeout=30)
        wait_dead(pid)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass  # ENOTCONN: the mount is gone
    assert os.listdir(m.path) == []
    assert "received SIGTERM" in (m.staging / "daemon.log").read_text()
    m.remount()
    assert m.pid != pid
    exp.incomplete["busy/open.bin"] = (busy, busy)
    check_tree(m, exp)


def test_umount_stale_mount(mounter: Mounter) -> None:
    m = mounter("stale")
    (m.path / "d").mkdir()
    (m.path / "d" / "f.bin").write_bytes(b"survives" * 1000)
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    assert is_mounted(m.path)
    with pytest.raises(OSError) as info:
        os.stat(m.path / "d")
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)

    assert m.store is not None
    # Mounting over it says what is wrong and what to do.
    done = ckptfs("mount", m.path, "--staging", m.staging, "--store", m.store, check=False)
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("ckptfs: error: ")
    assert "stale" in done.stderr and "ckptfs umount" in done.stderr, done.stderr

    started = time.monotonic()
    done = ckptfs("umount", m.path, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert time.monotonic() - started < 10
    assert not is_mounted(m.path)
    m.remount()
    assert (m.path / "d" / "f.bin").read_bytes() == b"survives" * 1000
    assert m.state("d/f.bin") != "incomplete"
