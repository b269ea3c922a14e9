"""Real-mount helpers for tests: start ``ckptfs mount`` as a subprocess, always unmount.

Used through the ``mounter`` fixture in conftest.py. Every mount made here is lazily
unmounted in teardown (``fusermount3 -u -z``), even when the test failed or killed the daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.fuse.mountinfo import find

CKPTFS = [sys.executable, "-m", "ckptfs"]
# CKPTFS_TEST_PASSTHROUGH=off (or on, auto) runs every mount made here with that passthrough
# mode unless the test chose one (conftest.py ``io_mode``); unset, mounts get the config's
# default, "auto": passthrough wherever it can run. =off runs the whole mount suite on the
# daemon-served path, by hand (docs/PASSTHROUGH.md, "Tests").
PASSTHROUGH = os.environ.get("CKPTFS_TEST_PASSTHROUGH", "")


def ckptfs(*args: str | os.PathLike[str], check: bool = True, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real CLI; returns the completed process (stdout/stderr as text)."""
    done = subprocess.run(
        [*CKPTFS, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False,
        env=env, stdin=subprocess.DEVNULL,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"ckptfs {' '.join(map(str, args))} failed ({done.returncode}):\n"
            f"{done.stdout}\n{done.stderr}"
        )
    return done


def is_mounted(path: Path) -> bool:
    return find(path) is not None


@dataclass
class Mount:
    path: Path
    staging: Path
    store: Path | None  # the --store flag (None: the config file names the warm tier)
    extra: list[str] = field(default_factory=list)
    # A TOML config file (``-c``): its tiers are used as they are unless ``store`` is set.
    config: Path | None = None
    passthrough: str = ""  # "-o passthrough=..." ahead of ``extra``; "": the config decides
    ready: str = ""        # what the last ``remount`` printed (the success line, a note)

    @property
    def pid(self) -> int:
        import json

        return int(json.loads(os.getxattr(self.path, "user.ckptfs.daemon"))["pid"])

    def state(self, rel: str) -> str:
        return os.getxattr(self.path / rel, "user.ckptfs.state").decode()

    def umount(self) -> None:
        ckptfs("umount", self.path)

    def kill(self) -> None:
        """SIGKILL the daemon and clear the dead mount (as a crash would leave it)."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except FileNotFoundError:
                break
            time.sleep(0.02)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True,
                       check=False)

    def remount(self) -> None:
        args: list[str | os.PathLike[str]] = ["mount", self.path, "--staging", self.staging]
        if self.passthrough:  # before the test's own options, which may name it again
            args += ["-o", f"passthrough={self.passthrough}"]
        if self.config is not None:
            args += ["--config", self.config]
        if self.store is not None:
            args += ["--store", self.store]
        # The tests' stores are fresh temp directories: created at the first mount (a missing
        # store is otherwise an error, tests/test_store_path.py).
        self.ready = ckptfs(*args, "--create-store", *self.extra).stdout


class Mounter:
    """Creates mounts under a temp dir and tears every one of them down."""

    def __init__(self, base: Path, passthrough: str = PASSTHROUGH) -> None:
        self.base = base
        self.passthrough = passthrough
        self.mounts: list[Mount] = []

    def __call__(self, name: str = "m", *, staging: Path | None = None,
                 store: Path | None = None, extra: list[str] | None = None,
                 config: Path | None = None) -> Mount:
        """Mount ``name``; with ``config`` (a TOML file) its warm tier is used unless
        ``store`` is given too, otherwise the warm tier is ``store`` (default: a shared dir)."""
        path = self.base / name / "mnt"
        path.mkdir(parents=True, exist_ok=True)
        if store is None and config is None:
            store = self.base / "store"
        m = Mount(path, staging or self.base / name / "staging", store, list(extra or []),
                  config, self.passthrough)
        m.remount()
        self.mounts.append(m)
        return m

    def teardown(self) -> None:
        for m in self.mounts:
            if is_mounted(m.path):
                subprocess.run(CKPTFS + ["umount", str(m.path), "--timeout", "30"],
                               capture_output=True, timeout=120, check=False)
            if is_mounted(m.path):
                subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True,
                               check=False)


def status(m: Mount) -> dict[str, Any]:
    """``ckptfs status MP --json``, parsed."""
    return json.loads(ckptfs("status", m.path, "--json").stdout)  # type: ignore[no-any-return]


def sync(m: Mount, timeout: float = 120) -> None:
    """``ckptfs sync MP --timeout T``: every upload of the mount done within ``timeout``."""
    ckptfs("sync", m.path, "--timeout", str(timeout), timeout=timeout + 30)


@contextlib.contextmanager
def mounter_in(base: Path, passthrough: str = PASSTHROUGH) -> Iterator[Mounter]:
    """A ``Mounter`` under ``base`` whose mounts are all torn down on exit."""
    m = Mounter(base, passthrough)
    try:
        yield m
    finally:
        m.teardown()


def register_first(m: Mount) -> None:
    """Make the mount's node register in the store now, with a change made from Python.

    A node registers at its first change (coordination.py), which waits for the store. When
    the store is moto inside the test process and the first change is torch.save's (its C++
    open holds the GIL while the mount answers), moto cannot run and the two wait for each
    other until the registration times out. A real store is another process: no such wait."""
    os.utime(m.path)   # a SETATTR of the root: a change, and nothing for the store


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 30,
             every: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something true and return that; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def daemon_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, zombie or dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def wait_dead(pid: int, timeout: float = 30, every: float = 0.01) -> None:
    """Wait until the daemon ``pid`` has exited; fail if it still runs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon_gone(pid):
            return
        time.sleep(every)
    raise AssertionError(f"daemon {pid} still running after {timeout}s")


def tiers_config(path: Path, url: str, /, *warm: str, faults: dict[str, Any] | None = None,
                 **top: Any) -> Path:
    """Write a config file: ``top`` keys, a hot tier, the warm tier at ``url`` (more ``warm``
    lines, optionally faulty)."""
    lines = [*(f"{k} = {json.dumps(v)}" for k, v in top.items()), "",
             "[[tier]]", 'name = "hot"', "", "[[tier]]", 'name = "warm"', f'url = "{url}"',
             *warm]
    if faults:
        lines += ["", "[tier.faults]"]
        lines += [f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}"
                  for k, v in faults.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Tmpfs:
    """Mounts small tmpfs file systems and unmounts every one of them in teardown."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    def __call__(self, path: Path, options: str = "size=1m") -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
        self.mounted.append(path)
        return path

    def teardown(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
