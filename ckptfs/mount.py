"""Composition root: config -> staging -> journal -> filesystem -> FUSE, in one trio nursery.

Shutdown order (reverse of start-up, each step in a ``finally``): stop serving FUSE requests,
unmount, persist what is dirty, close the journal, record the clean stop (noderun.py: after a
sync of the staging filesystem), release the staging lock. The run record is started after
the journal's replay and before the node registers: a node that must hold barriers says so
in its registration.

A mount is *ready* when the kernel has accepted it; ``serve`` calls ``on_ready`` at that point
(the CLI uses it to let a background ``ckptfs mount`` return, systemd gets READY=1).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ckptfs import __version__
from ckptfs.config import Config
from ckptfs.control import ControlServer
from ckptfs.coordination import Coordinator, DuplicateNode, node_id, node_token
from ckptfs.errors import StoreUnavailable, UserError
from ckptfs.fs import Filesystem, ReadSettings
from ckptfs.fuse_ops import FuseOps
from ckptfs.journal import ROOT_INODE, Journal, State
from ckptfs.mountinfo import check_mountpoint, find, mounts
from ckptfs.noderun import NodeRun, boot_id
from ckptfs.passthrough import Decision, PassthroughFiles, decide, facts
from ckptfs.retention import Retention, upload_progress
from ckptfs.staging import SpaceBudget, Staging
from ckptfs.tiers import open_tier
from ckptfs.tiers.base import Tier, TierError
from ckptfs.upload import Uploader

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.db"
LOG_NAME = "daemon.log"


def fuse_options(config: Config) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    # The source column of mount(8)/df shows which store this node writes to.
    source = "ckptfs:" + (config.warm.url or "").replace(",", "%2C")
    options |= {f"fsname={source}", "subtype=ckptfs"}
    if config.allow_other:
        options.add("allow_other")
    # Device nodes cannot be made here (mknod of one is EPERM), and the store should not be
    # trusted with them either; set-id bits of store entries are stripped (storetrust.py), and
    # nosuid keeps the kernel from honouring those of local files unless the operator asks.
    options.add("nodev")
    options.add("suid" if config.suid else "nosuid")
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


def read_settings(config: Config) -> ReadSettings:
    return ReadSettings(
        metadata_ttl=config.metadata_ttl.total_seconds(),
        fetch_block_size=config.fetch_block_size,
        fetch_concurrency=config.fetch_concurrency,
        readahead_bytes=config.readahead_bytes,
    )


async def open_warm_tier(config: Config) -> Tier:
    """The warm tier, checked: an unreachable store or missing bucket fails the mount fast."""
    tier = open_tier(config.warm)
    try:
        await tier.check()
    except (TierError, StoreUnavailable) as exc:
        await tier.aclose()
        raise UserError(str(exc)) from None
    return tier


async def serve(
    config: Config, mountpoint: Path, staging: Staging, on_ready: Callable[[], None]
) -> None:
    """Mount and serve until unmounted or signalled."""
    # FUSE handlers run on the trio thread and share the GIL with upload threads; a short
    # switch interval keeps a write() from queueing 5 ms behind a busy upload thread.
    sys.setswitchinterval(0.0005)
    # Before anything is mounted or registered: passthrough = on without what it needs fails
    # the mount here, with the missing piece (passthrough.py).
    passthrough = decide(config.passthrough, facts(pyfuse3))
    tier = await open_warm_tier(config)
    journal = Journal(staging.root / JOURNAL_NAME)
    _owner_only(staging.root, JOURNAL_NAME)
    run: NodeRun | None = None
    try:
        fs = Filesystem(
            journal, staging, unlink_remote=config.unlink == "posix",
            fsync_remote=config.fsync == "remote",
            space=SpaceBudget(staging, config.staging_max_bytes, config.staging_min_free_ratio),
            tier=tier, read=read_settings(config),
            write_stall_timeout=config.write_stall_timeout.total_seconds(),
            write_direct_io=config.write_direct_io,
        )
        fs.start()
        fs.mountpoint = str(mountpoint)
        uploader = Uploader(journal, fs.ns, staging, tier,
                            concurrency=config.upload_concurrency, markers=config.commit_markers,
                            keys=fs.keys)
        fs.listener = uploader
        uploader.requeue_from_journal()
        node = node_id(staging.root, config.node_id)
        run = NodeRun(staging.root, boot_id())
        run.start(node, incomplete=len(
            [r for r in journal.rows_in_states(State.OPEN) if r.incomplete]))
        coordinator = Coordinator(
            tier, node, uploader,
            poll=config.node_poll_interval.total_seconds(),
            idle_poll=config.node_idle_poll_interval.total_seconds(),
            token=node_token(staging.root), run=run)
        uploader.coordinator = coordinator
        # Before the first request: a node that closes files must be known to the others
        # before any of them can miss it (coordination.py).
        try:
            await coordinator.register()
        except (TierError, StoreUnavailable) as exc:
            raise UserError(f"cannot register this node in {tier.url}: {exc}") from None
        except DuplicateNode as exc:
            raise UserError(str(exc)) from None
        try:
            await _serve_registered(config, mountpoint, staging, journal, tier, fs, uploader,
                                    coordinator, on_ready, passthrough)
        except BaseException:
            # Failed before or while serving: leave only if nothing at all is left to upload
            # (the in-flight items are gone from the queue by now: ask the journal too).
            with trio.CancelScope(shield=True):
                await _leave(coordinator, _nothing_left(uploader, journal))
            raise
    finally:
        journal.close()
        with trio.CancelScope(shield=True):
            if run is not None:
                try:
                    await trio.to_thread.run_sync(run.stop_clean)
                except OSError as exc:  # the next start then counts this stop as unclean
                    log.warning("could not record the clean stop in %s: %s", staging.root, exc)
            staging.close()
            await tier.aclose()


async def _serve_registered(
    config: Config, mountpoint: Path, staging: Staging, journal: Journal, tier: Tier,
    fs: Filesystem, uploader: Uploader, coordinator: Coordinator, on_ready: Callable[[], None],
    passthrough: Decision,
) -> None:
    """Serve the mount of a registered node until it is unmounted."""
    retention: Retention | None = None
    try:
        control = ControlServer(fs, uploader, mountpoint, config.warm.url or "", config)
        # One node at a time applies the policy: under the lease, as this node's id.
        retention = await Retention.open(
            config, warm=tier, fs=fs, upload_progress=lambda: upload_progress(uploader),
            on_removed=lambda parent, name: pyfuse3.invalidate_entry_async(
                parent, os.fsencode(name), ignore_enoent=True),
            node=coordinator.node)
        control.retention = retention
        metrics = None
        if config.metrics_port is not None:
            from ckptfs.metrics import MetricsServer

            metrics = MetricsServer(control)
            await metrics.listen(config.metrics_address, config.metrics_port)
        fs.daemon_info = {
            "pid": os.getpid(),
            "staging_dir": str(staging.root),
            "control": str(control.path),
            "version": __version__,
        }
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            await nursery.start(coordinator.run)
            await nursery.start(control.serve)
            nursery.start_soon(retention.run, uploader,
                               config.retention_interval.total_seconds())
            if metrics is not None:
                nursery.start_soon(metrics.serve)
            assert fs.fetcher is not None and fs.lister is not None
            fs.fetcher.nursery = nursery  # readahead runs beside the FUSE workers
            nursery.start_soon(fs.fetcher.run_flusher)
            fs.lister.nursery = nursery  # and listings a lookup stopped waiting for
            # The root's listing before the mount is ready: the first lookups (often a
            # writer's new files) then never wait for the store.
            await fs.lister.refresh(fs.getattr(ROOT_INODE))
            ops = FuseOps(fs, attr_timeout=min(10.0, config.metadata_ttl.total_seconds()),
                          passthrough=PassthroughFiles(
                              fs, passthrough.request, passthrough.reason,
                              write_reserve=config.passthrough_write_reserve))
            control.passthrough = ops.passthrough
            if passthrough.request:
                nursery.start_soon(ops.passthrough.watch)
            if config.read_ahead_kb:
                # After our INIT reply: the kernel lowers the readahead to what it offered
                # in INIT (its default), so it is raised once that is done.
                ops.on_init = lambda: nursery.start_soon(
                    trio.to_thread.run_sync, set_read_ahead, mountpoint, config.read_ahead_kb)
            init_args: dict[str, Any] = {}
            if passthrough.request:  # only the patched pyfuse3 knows these
                init_args = {"passthrough": True,
                             "max_stack_depth": backing_stack_depth(staging.root)}
            pyfuse3.init(ops, str(mountpoint), fuse_options(config), **init_args)
            try:
                log.info("mounted %s (staging %s, warm tier %s)", mountpoint, staging.root,
                         config.warm.url)
                nursery.start_soon(_terminate_on_signal)
                on_ready()
                sd_notify("READY=1")
                await pyfuse3.main(min_tasks=1, max_tasks=config.fuse_workers)
            finally:
                sd_notify("STOPPING=1")
                fs.close()
                pyfuse3.close(unmount=True)
                log.info("unmounted %s", mountpoint)
            # Before the cancellation reaches the workers (it drops their items).
            idle = not uploader.outstanding()
            # Uploads still in flight stop here; the journal requeues them at the next mount.
            nursery.cancel_scope.cancel()
            await _leave(coordinator, idle)
    finally:
        if retention is not None:
            with trio.CancelScope(shield=True):
                await retention.aclose()


def backing_stack_depth(staging_root: Path) -> int:
    """The kernel's max_stack_depth for backing files in ``staging_root``: 1, or 2 when the
    staging filesystem is itself stacked (overlayfs, as in many containers)."""
    root = os.path.realpath(staging_root)
    best = None
    for entry in mounts():
        mp = entry.mountpoint.rstrip("/") or "/"
        if (root == mp or root.startswith(mp.rstrip("/") + "/")) and \
                (best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/")):
            best = entry
    return 2 if best is not None and best.fstype in ("overlay", "ecryptfs") else 1


def _nothing_left(uploader: Uploader, journal: Journal) -> bool:
    return not (uploader.outstanding() or journal.rows_in_states(State.STAGED, State.UPLOADING)
                or journal.tombstones())


async def _leave(coordinator: Coordinator, idle: bool) -> None:
    """After a clean unmount with nothing left to upload, this node no longer holds anything
    the others' markers need: it deregisters. Otherwise it stays, and they wait for it."""
    if not coordinator.registered:
        return
    if not idle:
        log.info("node %s stays registered: files are left to upload", coordinator.node)
        return
    with trio.move_on_after(10, shield=True):
        try:
            await coordinator.deregister()
        except (TierError, StoreUnavailable) as exc:
            log.warning("could not deregister node %s: %s", coordinator.node, exc)


def set_read_ahead(mountpoint: Path, kb: int) -> None:
    """The kernel reads ahead 128 KiB on a FUSE mount by default, one small READ request at
    a time; 1 MiB (the largest request) reads a local file through the mount 1.4x faster.
    Needs root (sysfs); without it the kernel's default stays, with a note in the log."""
    try:
        # From the mount table: a stat of the mountpoint would be a FUSE request to ourselves.
        entry = find(mountpoint)
        path = Path("/sys/class/bdi") / (entry.device if entry else "?") / "read_ahead_kb"
        path.write_text(f"{kb}\n")
    except Exception as exc:  # noqa: BLE001 (a tuning knob: never worth the mount)
        log.info("read_ahead_kb left at the kernel's default: %s", exc)


def _owner_only(root: Path, journal_name: str) -> None:
    """The journal (and SQLite's -wal/-shm files) readable by the daemon's user only: it
    names every file of the mount. The staging directory itself is 0711 (staging.py)."""
    for suffix in ("", "-wal", "-shm"):
        try:
            os.chmod(root / (journal_name + suffix), 0o600)
        except FileNotFoundError:
            pass


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return
