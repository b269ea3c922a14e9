"""POSIX permission, time and set-id rules as cases, run on one directory (a script, no imports
from the project: tests/test_posix_conformance.py runs it on a ckptfs mount and on the local
disk, and compares).

Usage (as root): ``python3 posix_cases.py DIR UID GID`` prints one JSON object, case name ->
outcome. Every case sets up as root, does its one action as UID:GID (a forked child that drops
to them with setresgid/setresuid, no supplementary groups; 0:0 stays root), then looks as
root. An outcome is ``"ok"`` or an errno name, followed by what the case looks at after it
(a mode, whether a time moved).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

PAST = 1_000_000_000  # 2001-09-09: a time no operation of this run can leave behind
CLOCK_REALTIME_COARSE = 5  # Linux's clock id (Python's time module does not name it)


def as_user(uid: int, gid: int, action: Callable[[], object]) -> str:
    """Run ``action`` as uid:gid in a child; "ok" or the errno name it failed with."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the caller, act, report, exit without cleanup
        os.close(read)
        try:
            if (uid, gid) != (0, 0):
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            action()
            outcome = "ok"
        except OSError as exc:
            outcome = errno.errorcode.get(exc.errno or 0, str(exc))
        except BaseException as exc:  # noqa: BLE001 - reported, the parent fails the case
            outcome = f"crash: {exc!r}"
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 4096):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def next_tick(path: Path) -> None:
    """Wait until the clock the filesystem stamps ctime with has passed ``path``'s ctime, so
    that a change made now shows as a later ctime (a coarse clock ticks every few ms)."""
    ctime = path.lstat().st_ctime_ns
    while time.clock_gettime_ns(CLOCK_REALTIME_COARSE) <= ctime:
        pass


def new_file(path: Path, mode: int, data: bytes = b"data", owner: tuple[int, int] = (0, 0)) -> Path:
    path.write_bytes(data)
    os.chown(path, *owner)
    os.chmod(path, mode)
    return path


def mode_of(path: Path) -> str:
    return oct(stat.S_IMODE(path.lstat().st_mode))


def times_moved(path: Path, act: Callable[[], str], moved_to: Path | None = None) -> str:
    """Run ``act`` after setting mtime far back and letting the clock tick: its outcome, then
    whether mtime and ctime moved ("m" / "c"); looked at ``moved_to`` after, if given."""
    os.utime(path, ns=(PAST, PAST), follow_symlinks=False)
    next_tick(path)
    before = path.lstat()
    outcome = act()
    after = (moved_to or path).lstat()
    moved = ("m" if after.st_mtime_ns != before.st_mtime_ns else "") + \
        ("c" if after.st_ctime_ns != before.st_ctime_ns else "")
    return f"{outcome} {moved or '-'}"


def run(base: Path, uid: int, gid: int) -> dict[str, str]:
    me = (uid, gid)
    out: dict[str, str] = {}
    n = 0

    def fresh() -> Path:
        """A new directory per case, root's, open to everyone."""
        nonlocal n
        n += 1
        d = base / f"case{n}"
        d.mkdir()
        os.chmod(d, 0o777)
        return d

    def user(action: Callable[[], object]) -> str:
        return as_user(uid, gid, action)

    # -- permission rules -------------------------------------------------------------------
    d = fresh()
    f = new_file(d / "roots", 0o644)
    out["chmod a file of another owner"] = user(lambda: os.chmod(f, 0o600)) + " " + mode_of(f)
    out["chown a file of another owner"] = user(lambda: os.chown(f, uid, gid))
    out["open O_WRONLY without write permission"] = user(
        lambda: os.close(os.open(f, os.O_WRONLY)))
    out["open O_RDONLY|O_TRUNC without write permission"] = user(
        lambda: os.close(os.open(f, os.O_RDONLY | os.O_TRUNC))) + f" {f.stat().st_size}"
    out["truncate without write permission"] = user(lambda: os.truncate(f, 0)) + \
        f" {f.stat().st_size}"
    out["utimensat(now) without write permission"] = user(lambda: os.utime(f))
    g = new_file(d / "writable", 0o666)
    out["utimensat(now) with write permission"] = user(lambda: os.utime(g))
    out["utimensat(times) with write permission, not owner"] = user(
        lambda: os.utime(g, ns=(PAST, PAST)))
    own = new_file(d / "own", 0o644, owner=me)
    out["utimensat(times) by the owner"] = user(lambda: os.utime(own, ns=(PAST, PAST)))
    out["chown own file to root"] = user(lambda: os.chown(own, 0, -1))
    out["chown own file to a group not one's own"] = user(lambda: os.chown(own, -1, 4242))
    out["chown own file to -1, -1"] = times_moved(own, lambda: user(lambda: os.chown(own, -1, -1)))

    closed = fresh()
    os.chmod(closed, 0o755)
    (closed / "sub").mkdir()
    new_file(closed / "file", 0o666)
    out["mkdir in a 0755 directory of another owner"] = user(lambda: os.mkdir(closed / "new"))
    out["create in a 0755 directory of another owner"] = user(
        lambda: os.close(os.open(closed / "new", os.O_CREAT | os.O_WRONLY, 0o644)))
    out["rmdir in a 0755 directory of another owner"] = user(lambda: os.rmdir(closed / "sub"))
    out["unlink in a 0755 directory of another owner"] = user(lambda: os.unlink(closed / "file"))
    out["rename out of a 0755 directory of another owner"] = user(
        lambda: os.rename(closed / "file", d / "moved"))
    search = fresh()
    os.chmod(search, 0o700)
    new_file(search / "inside", 0o644)
    out["stat through a 0700 directory of another owner"] = user(
        lambda: os.stat(search / "inside"))

    # -- sticky directories -----------------------------------------------------------------
    sticky = fresh()
    os.chmod(sticky, 0o1777)
    new_file(sticky / "roots", 0o666)
    (sticky / "roots-dir").mkdir(mode=0o777)
    new_file(sticky / "mine", 0o644, owner=me)
    out["sticky: unlink another owner's file"] = user(lambda: os.unlink(sticky / "roots"))
    out["sticky: rename another owner's file"] = user(
        lambda: os.rename(sticky / "roots", sticky / "renamed"))
    out["sticky: rmdir another owner's directory"] = user(lambda: os.rmdir(sticky / "roots-dir"))
    out["sticky: rename over another owner's file"] = user(
        lambda: os.rename(sticky / "mine", sticky / "roots"))
    out["sticky: unlink own file"] = user(lambda: os.unlink(sticky / "mine"))
    theirs = fresh()
    os.chown(theirs, *me)
    os.chmod(theirs, 0o1777)
    new_file(theirs / "roots", 0o644)
    out["sticky: the directory's owner unlinks another owner's file"] = user(
        lambda: os.unlink(theirs / "roots"))

    # -- set-id bits ------------------------------------------------------------------------
    for label, flags in (("O_WRONLY", os.O_WRONLY), ("O_RDWR", os.O_RDWR)):
        for bits in (0o4777, 0o2777, 0o6777, 0o2767):
            p = new_file(fresh() / "setid", bits)

            def write_it(p: Path = p, flags: int = flags) -> None:
                fd = os.open(p, flags)
                try:
                    os.write(fd, b"x")
                finally:
                    os.close(fd)
            out[f"write {oct(bits)} via {label}"] = user(write_it) + " " + mode_of(p)
    p = new_file(fresh() / "setid", 0o6777)
    out["truncate 0o6777"] = user(lambda: os.truncate(p, 1)) + " " + mode_of(p)
    for bits in (0o6777, 0o6767):
        p = new_file(fresh() / "setid", bits)
        out[f"open O_TRUNC {oct(bits)}"] = user(
            lambda p=p: os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))) + " " + mode_of(p)
        p = new_file(fresh() / "setid", bits)

        def ftruncate_it(p: Path = p) -> None:
            fd = os.open(p, os.O_RDWR)
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        out[f"ftruncate {oct(bits)}"] = user(ftruncate_it) + " " + mode_of(p)
    p = new_file(fresh() / "setid", 0o6755)
    out["root chowns a 0o6755 file to nobody"] = as_user(
        0, 0, lambda: os.chown(p, 65534, 65534)) + " " + mode_of(p)
    p = new_file(fresh() / "setid", 0o6755, owner=me)
    out["chown own 0o6755 file to own ids"] = user(lambda: os.chown(p, uid, gid)) + " " + \
        mode_of(p)
    p = new_file(fresh() / "setid", 0o644, owner=(uid, 4242))
    out["chmod g+s on own file of a group not one's own"] = user(
        lambda: os.chmod(p, 0o2755)) + " " + mode_of(p)
    for bits in (0o4755, 0o2755, 0o2745):
        given = new_file(fresh() / "setid", bits, owner=me)

        def chown_to_root(given: Path = given) -> None:
            os.chown(given, 0, 0)
        out[f"root chowns a {oct(bits)} file"] = as_user(0, 0, chown_to_root) + " " + \
            mode_of(given)

    # -- which times move -------------------------------------------------------------------
    d = fresh()
    f = new_file(d / "file", 0o666, owner=me)
    out["times: open O_TRUNC of a non-empty file"] = times_moved(
        f, lambda: user(lambda: os.close(os.open(f, os.O_WRONLY | os.O_TRUNC))))
    out["times: open O_TRUNC of an empty file"] = times_moved(
        f, lambda: user(lambda: os.close(os.open(f, os.O_WRONLY | os.O_TRUNC))))
    out["times: open O_WRONLY without O_TRUNC"] = times_moved(
        f, lambda: user(lambda: os.close(os.open(f, os.O_WRONLY))))
    f.write_bytes(b"0123456789")
    out["times: truncate to the same size"] = times_moved(f, lambda: user(lambda: os.truncate(f, 10)))
    out["times: truncate down"] = times_moved(f, lambda: user(lambda: os.truncate(f, 5)))

    def ftruncate_up() -> None:
        fd = os.open(f, os.O_WRONLY)
        try:
            os.ftruncate(fd, 100)
        finally:
            os.close(fd)
    out["times: ftruncate up"] = times_moved(f, lambda: user(ftruncate_up))

    def write_one() -> None:
        fd = os.open(f, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x", 3)
        finally:
            os.close(fd)
    out["times: write"] = times_moved(f, lambda: user(write_one))
    out["times: chmod"] = times_moved(f, lambda: user(lambda: os.chmod(f, 0o640)))
    out["times: utimensat(now)"] = times_moved(f, lambda: user(lambda: os.utime(f)))
    out["times: setxattr"] = times_moved(
        f, lambda: user(lambda: os.setxattr(f, "user.k", b"v")))
    out["times: rename, the file"] = times_moved(
        f, lambda: user(lambda: os.rename(f, d / "renamed")), moved_to=d / "renamed")
    f = d / "renamed"
    out["times: rename, the directory"] = times_moved(
        d, lambda: user(lambda: os.rename(f, d / "file")))
    f = d / "file"
    out["times: create, the directory"] = times_moved(
        d, lambda: user(lambda: os.close(os.open(d / "new", os.O_CREAT | os.O_WRONLY, 0o644))))
    out["times: unlink, the directory"] = times_moved(d, lambda: user(lambda: os.unlink(d / "new")))
    out["times: mkdir, the directory"] = times_moved(d, lambda: user(lambda: os.mkdir(d / "sub")))
    out["times: rmdir, the directory"] = times_moved(d, lambda: user(lambda: os.rmdir(d / "sub")))
    out["times: read"] = times_moved(f, lambda: user(f.read_bytes))
    return out


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
