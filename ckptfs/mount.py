"""Composition root: config -> staging -> journal -> filesystem -> FUSE, in one trio nursery.

Shutdown order (reverse of start-up, each step in a ``finally``): stop serving FUSE requests,
unmount, persist what is dirty, close the journal, release the staging lock.

A mount is *ready* when the kernel has accepted it; ``serve`` calls ``on_ready`` at that point
(the CLI uses it to let a background ``ckptfs mount`` return, systemd gets READY=1).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from ckptfs import __version__
from ckptfs.config import Config
from ckptfs.fs import Filesystem
from ckptfs.fuse_ops import FuseOps
from ckptfs.journal import Journal
from ckptfs.mountinfo import check_mountpoint
from ckptfs.staging import Staging

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.db"
LOG_NAME = "daemon.log"


def fuse_options(config: Config) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    options |= {"fsname=ckptfs", "subtype=ckptfs"}
    if config.allow_other:
        options.add("allow_other")
    return options


def sd_notify(message: str) -> None:
    """Tell systemd (if it started us with Type=notify) about our state."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(message.encode())


def prepare(config: Config, mountpoint: Path) -> tuple[Path, Staging]:
    """Every check that can fail because of user input, before anything is mounted."""
    mountpoint = check_mountpoint(mountpoint)
    staging = Staging(config.staging_dir)
    staging.prepare()
    return mountpoint, staging


async def serve(
    config: Config, mountpoint: Path, staging: Staging, on_ready: Callable[[], None]
) -> None:
    """Mount and serve until unmounted or signalled."""
    journal = Journal(staging.root / JOURNAL_NAME)
    try:
        fs = Filesystem(journal, staging)
        fs.start()
        fs.daemon_info = {
            "pid": os.getpid(),
            "staging_dir": str(staging.root),
            "version": __version__,
        }
        pyfuse3.init(FuseOps(fs), str(mountpoint), fuse_options(config))
        mounted = True
        try:
            log.info("mounted %s (staging %s, warm tier %s)", mountpoint, staging.root,
                     config.warm.url)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_terminate_on_signal)
                on_ready()
                sd_notify("READY=1")
                await pyfuse3.main(min_tasks=1, max_tasks=config.fuse_workers)
                nursery.cancel_scope.cancel()
        finally:
            sd_notify("STOPPING=1")
            fs.close()
            if mounted:
                pyfuse3.close(unmount=True)
            log.info("unmounted %s", mountpoint)
    finally:
        journal.close()
        staging.close()


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return
