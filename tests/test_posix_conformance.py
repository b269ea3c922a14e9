"""POSIX permission, time and set-id rules on a real mount, as root and as another user
(docs/SEMANTICS.md, "Permissions and times").

First the core (fs.py, no mount): who clears set-id bits on a write, and the EFBIG of a
truncate. Then a mount with ``allow_other`` over a file store, with passthrough off and on
(``both_modes``; set-id files are daemon-served, passthrough.py). tests/posix_cases.py runs
every case twice per identity: on the mount and on a directory of the local disk (the
oracle: the kernel's VFS and a local filesystem). Each outcome must be the same on both, and
the ones written down here (the rules an application relies on, and those ckptfs got wrong
before: set-id bits kept after an unprivileged write through a write-only descriptor, a
truncate to a size the staging disk can never hold) must be what they say. The actions of
the unprivileged runs are made by uid and gid 65534, as a forked child that drops to them.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfs import errors
from ckptfs.engine.fs import ROOT_CALLER, Caller, Filesystem
from ckptfs.state.journal import ROOT_INODE
from tests.mounting import Mount, mounter_in
from tests.test_fs_core import close_fs, open_fs

pytestmark = [pytest.mark.timeout(240)]

CASES = Path(__file__).with_name("posix_cases.py")
NOBODY = (65534, 65534)

# What Linux answers (ext4 and tmpfs alike), for the identities that the rule is about.
EXPECTED_AS_NOBODY = {
    "chmod a file of another owner": "EPERM 0o644",
    "chown a file of another owner": "EPERM",
    "open O_WRONLY without write permission": "EACCES",
    "open O_RDONLY|O_TRUNC without write permission": "EACCES 4",
    "truncate without write permission": "EACCES 4",
    "utimensat(now) without write permission": "EACCES",
    "utimensat(now) with write permission": "ok",
    "utimensat(times) with write permission, not owner": "EPERM",
    "chown own file to root": "EPERM",
    "chown own file to a group not one's own": "EPERM",
    "chown own file to -1, -1": "ok c",
    "mkdir in a 0755 directory of another owner": "EACCES",
    "rmdir in a 0755 directory of another owner": "EACCES",
    "stat through a 0700 directory of another owner": "EACCES",
    "sticky: unlink another owner's file": "EPERM",
    "sticky: rename another owner's file": "EPERM",
    "sticky: rmdir another owner's directory": "EPERM",
    "sticky: rename over another owner's file": "EPERM",
    "sticky: unlink own file": "ok",
    "sticky: the directory's owner unlinks another owner's file": "ok",
    "write 0o4777 via O_WRONLY": "ok 0o777",
    "write 0o2777 via O_WRONLY": "ok 0o777",
    "write 0o6777 via O_WRONLY": "ok 0o777",
    "write 0o2767 via O_WRONLY": "ok 0o767",
    "write 0o6777 via O_RDWR": "ok 0o777",
    "truncate 0o6777": "ok 0o777",
    "chmod g+s on own file of a group not one's own": "ok 0o755",
}
EXPECTED_AS_ROOT = {
    "write 0o6777 via O_WRONLY": "ok 0o6777",
    "write 0o6777 via O_RDWR": "ok 0o6777",
    "root chowns a 0o4755 file": "ok 0o755",
    "root chowns a 0o2755 file": "ok 0o755",
    "root chowns a 0o2745 file": "ok 0o2745",
}
EXPECTED_EITHER = {
    "times: open O_TRUNC of a non-empty file": "ok mc",
    "times: open O_TRUNC of an empty file": "ok mc",
    "times: open O_WRONLY without O_TRUNC": "ok -",
    "times: truncate to the same size": "ok mc",
    "times: ftruncate up": "ok mc",
    "times: write": "ok mc",
    "times: chmod": "ok c",
    "times: setxattr": "ok c",
    "times: rename, the file": "ok c",
    "times: rename, the directory": "ok mc",
    "times: rmdir, the directory": "ok mc",
    "times: read": "ok -",
}


# -- the core ----------------------------------------------------------------------------------


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Filesystem]:
    f = open_fs(tmp_path / "staging")
    yield f
    close_fs(f)


@pytest.mark.parametrize(("mode", "writer", "after"), [
    (0o6777, Caller(1000, 1000), 0o777),
    (0o2767, Caller(1000, 1000), 0o767),   # not in the file's group
    (0o2767, Caller(1000, 0), 0o2767),     # in it, and not group-executable: kept
    (0o6777, ROOT_CALLER, 0o6777),         # CAP_FSETID
])
async def test_a_write_clears_set_id_bits_by_the_kernels_rule(
    fs: Filesystem, mode: int, writer: Caller, after: int
) -> None:
    fh, row = fs.create(ROOT_INODE, b"f", mode, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    fs.release(fh)
    fh = await fs.open(row.ino, os.O_WRONLY, writer)
    ctime = fs.getattr(row.ino).ctime_ns
    assert stat.S_IMODE(fs.getattr(row.ino).mode) == mode  # opening changes nothing
    await fs.write(fh, 0, b"x")
    fs.release(fh)
    assert stat.S_IMODE(fs.getattr(row.ino).mode) == after
    assert fs.journal.get(row.ino).mode == fs.getattr(row.ino).mode  # type: ignore[union-attr]
    assert fs.getattr(row.ino).ctime_ns >= ctime


SET_ID_RULES = [
    (0o6777, Caller(1000, 1000), 0o777),
    (0o2767, Caller(1000, 1000), 0o767),
    (0o2767, Caller(1000, 0), 0o2767),
    (0o6777, ROOT_CALLER, 0o6777),
]


@pytest.mark.parametrize(("mode", "writer", "after"), SET_ID_RULES)
@pytest.mark.parametrize("how", ["truncate", "open O_TRUNC"])
async def test_a_truncate_clears_set_id_bits_in_the_daemon(
    fs: Filesystem, mode: int, writer: Caller, after: int, how: str
) -> None:
    # With FUSE_CAP_HANDLE_KILLPRIV_V2 the kernel sends no cleared mode: the daemon applies
    # the rule itself, from the request's caller.
    fh, row = fs.create(ROOT_INODE, b"f", mode, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, b"data")
    fs.release(fh)
    if how == "truncate":
        await fs.setattr(row.ino, size=1, caller=writer)
    else:
        fs.release(await fs.open(row.ino, os.O_WRONLY | os.O_TRUNC, writer))
    assert stat.S_IMODE(fs.getattr(row.ino).mode) == after
    assert fs.journal.get(row.ino).mode == fs.getattr(row.ino).mode  # type: ignore[union-attr]


@pytest.mark.parametrize(("mode", "who", "after"), [
    (0o6755, Caller(1000, 1000), 0o755),    # setuid always; setgid: group-executable
    (0o6745, Caller(1000, 1000), 0o745),    # setgid: not in the file's group
    (0o6745, Caller(1000, 0), 0o2745),      # in it: kept
    (0o6745, ROOT_CALLER, 0o2745),          # root: setuid goes all the same
    (0o6755, ROOT_CALLER, 0o755),
])
async def test_a_chown_clears_set_id_bits_in_the_daemon(
    fs: Filesystem, mode: int, who: Caller, after: int
) -> None:
    fh, row = fs.create(ROOT_INODE, b"f", mode, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    fs.release(fh)
    await fs.setattr(row.ino, uid=1000, gid=who.gid, caller=who)
    assert stat.S_IMODE(fs.getattr(row.ino).mode) == after
    d = fs.mkdir(ROOT_INODE, b"d", 0o2755, ROOT_CALLER)
    await fs.setattr(d.ino, uid=1000, gid=1000, caller=who)
    assert fs.getattr(d.ino).mode & stat.S_ISGID  # a directory keeps its setgid bit


async def test_a_truncate_the_staging_disk_could_never_hold_is_efbig(fs: Filesystem) -> None:
    fh, row = fs.create(ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    fs.release(fh)
    with pytest.raises(errors.FileTooLarge):
        await fs.setattr(row.ino, size=2**62)
    assert fs.getattr(row.ino).size == 0
    assert errors.errno_for(errors.FileTooLarge("x")) == errno.EFBIG
    await fs.setattr(row.ino, size=1 << 20)  # a hole that fits
    assert fs.getattr(row.ino).size == 1 << 20


# -- a real mount ----------------------------------------------------------------------------


@pytest.fixture
def world(open_base: Path, io_mode: str) -> Iterator[tuple[Mount, Path]]:
    """A mount (allow_other) and a local directory, under a base every user traverses."""
    with mounter_in(open_base, io_mode) as mounter:
        m = mounter("posix", extra=["--allow-other"])
        os.chmod(m.path, 0o755)
        local = open_base / "local"
        local.mkdir(mode=0o755)
        yield m, local


def run_cases(where: Path, who: tuple[int, int]) -> dict[str, str]:
    done = subprocess.run([sys.executable, str(CASES), str(where), str(who[0]), str(who[1])],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    outcomes: dict[str, str] = json.loads(done.stdout)
    return outcomes


@pytest.mark.mount
@pytest.mark.both_modes
@pytest.mark.parametrize("who", [(0, 0), NOBODY], ids=["root", "nobody"])
def test_the_mount_answers_as_the_local_disk(world: tuple[Mount, Path],
                                             who: tuple[int, int]) -> None:
    m, local = world
    on_mount, on_disk = m.path / f"as-{who[0]}", local / f"as-{who[0]}"
    for d in (on_mount, on_disk):
        d.mkdir()
        os.chmod(d, 0o755)
    mount_says, disk_says = run_cases(on_mount, who), run_cases(on_disk, who)

    expected = dict(EXPECTED_EITHER)
    expected.update(EXPECTED_AS_NOBODY if who == NOBODY else EXPECTED_AS_ROOT)
    assert {k: disk_says[k] for k in expected} == expected, "the oracle disagrees with the rules"
    assert {k: mount_says[k] for k in expected} == expected
    differ = {k: (mount_says[k], disk_says[k]) for k in disk_says if mount_says[k] != disk_says[k]}
    assert differ == {}


@pytest.mark.mount
@pytest.mark.both_modes
def test_a_truncate_beyond_the_staging_disk_fails_at_once(world: tuple[Mount, Path]) -> None:
    """A hole is counted like written bytes: one the staging disk can never hold is EFBIG at
    once (before: a stall of write_stall_timeout, then ENOSPC). One that fits is sparse."""
    m, _ = world
    f = m.path / "huge"
    f.write_bytes(b"x")
    with pytest.raises(OSError) as caught:
        os.truncate(f, 999_999_999_999_999)
    assert caught.value.errno == errno.EFBIG
    fd = os.open(f, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as caught:
            os.ftruncate(fd, 2**62)
        assert caught.value.errno == errno.EFBIG
        os.ftruncate(fd, 1 << 20)
    finally:
        os.close(fd)
    assert f.stat().st_size == 1 << 20
