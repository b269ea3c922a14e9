"""Composition root: config -> staging -> journal -> filesystem -> FUSE, in one trio nursery.

Shutdown order (reverse of start-up, each step in a ``finally``): stop serving FUSE requests,
unmount, persist what is dirty, close the journal, record the clean stop (noderun.py: after a
sync of the staging filesystem), release the staging lock. The run record is started after
the journal's replay and before the node registers: a node that must hold barriers says so
in its registration.

A mount is *ready* when the kernel has accepted it; ``serve`` calls ``on_ready`` at that point
(the CLI uses it to let a background ``ckptfs mount`` return, systemd gets READY=1), with a
note when ``passthrough = "auto"`` found it could not be used (the CLI prints it).

The store a staging directory belongs to (``<staging>/store-id``) is checked before anything
starts (``claim_store``: another store is refused unless adopted) and recorded only once the
mount is ready: a mount that never succeeded (a typo in the bucket, no credentials, a closed
port) leaves the record as it was, so the corrected command is not refused. Adopting another
store (``adopt_store``) queues every file with a local copy for the new store at the start,
once the store answered; files with no local copy (evicted: only the old store has them) are
reported, in the log and on the mount's stderr.

Registration is lazy (coordination.py): at mount only a node with work left in its journal
(or a hold) registers; any other registers before its first request that changes the tree
returns (``RegisteringOps``), so a node that only reads never holds another node's markers.
A read-only mount (``read_only``) never registers, uploads or runs retention; the kernel
refuses every change (``ro``), and a staging directory with files left to upload is refused.

At exit the daemon writes a stop report (noderun.py) in the staging directory: what it left un-uploaded
and whether it stayed registered, for ``ckptfs umount`` to say so.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ckptfs import __version__
from ckptfs.cluster.coordination import Coordinator, DuplicateNode, node_id, node_token
from ckptfs.cluster.noderun import NodeRun, boot_id, write_stop_report
from ckptfs.config import Config
from ckptfs.engine.fs import Filesystem, ReadSettings
from ckptfs.engine.upload import Uploader
from ckptfs.engine.yieldgate import YieldGate
from ckptfs.errors import StoreUnavailable, UserError
from ckptfs.fuse.handlers import FuseOps
from ckptfs.fuse.mountinfo import check_mountpoint, check_staging_place, find, mounts
from ckptfs.fuse.passthrough import Decision, PassthroughFiles, decide, facts, fallback_note
from ckptfs.humanize import count, plural
from ckptfs.lifecycle.retention import Retention, upload_progress
from ckptfs.ops.control import ControlServer
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import SpaceBudget, Staging
from ckptfs.store.check import store_identity
from ckptfs.store.tiers import open_tier
from ckptfs.store.tiers.base import Tier, TierError
from ckptfs.store.tiers.transfer import unwrap

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.db"
LOG_NAME = "daemon.log"
MiB = 1024 * 1024


def fuse_options(config: Config) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    # The source column of mount(8)/df shows which store this node writes to.
    source = "ckptfs:" + (config.warm.url or "").replace(",", "%2C")
    options |= {f"fsname={source}", "subtype=ckptfs"}
    if config.allow_other:
        options.add("allow_other")
    # Device nodes can be made (as on any filesystem, by whoever may: the kernel checks
    # CAP_MKNOD) but never opened: a node could be made to name any device, and the store
    # (another node's entries) is not trusted with that either; set-id bits of store entries
    # are stripped (store/trust.py), and nosuid keeps the kernel from honouring those of local
    # files unless the operator asks.
    options.add("nodev")
    options.add("suid" if config.suid else "nosuid")
    if config.read_only:
        options.add("ro")  # the kernel answers EROFS: no change reaches the daemon
    return options


class RegisteringOps(FuseOps):
    """The FUSE handlers, but every request that changes the tree first makes sure this node
    is registered (``Coordinator.enlist``: free once done): whatever it closes after that
    can be waited for by the other nodes' markers (coordination.py). Reads never wait."""

    def __init__(self, fs: Filesystem, coordinator: Coordinator, **kwargs: Any) -> None:
        super().__init__(fs, **kwargs)
        self.coordinator = coordinator

    async def _enlist(self, what: str) -> None:
        coordinator = self.coordinator
        if coordinator.enlisted and coordinator.registered:
            return
        try:
            await coordinator.enlist(what)
        except (StoreUnavailable, DuplicateNode) as exc:
            log.error("refusing a change: %s", exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            await self._enlist("open for writing")
        return await super().open(inode, flags, ctx)

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        await self._enlist("create")
        return await super().create(*args, **kwargs)

    async def setattr(self, *args: Any, **kwargs: Any) -> Any:
        await self._enlist("setattr")
        return await super().setattr(*args, **kwargs)

    async def mknod(self, *args: Any, **kwargs: Any) -> Any:
        await self._enlist("mknod")
        return await super().mknod(*args, **kwargs)

    async def mkdir(self, *args: Any, **kwargs: Any) -> Any:
        await self._enlist("mkdir")
        return await super().mkdir(*args, **kwargs)

    async def unlink(self, *args: Any, **kwargs: Any) -> None:
        await self._enlist("unlink")
        await super().unlink(*args, **kwargs)

    async def rmdir(self, *args: Any, **kwargs: Any) -> None:
        await self._enlist("rmdir")
        await super().rmdir(*args, **kwargs)

    async def symlink(self, *args: Any, **kwargs: Any) -> Any:
        await self._enlist("symlink")
        return await super().symlink(*args, **kwargs)

    async def rename(self, *args: Any, **kwargs: Any) -> None:
        await self._enlist("rename")
        await super().rename(*args, **kwargs)

    async def link(self, *args: Any, **kwargs: Any) -> Any:
        await self._enlist("link")
        return await super().link(*args, **kwargs)

    async def setxattr(self, *args: Any, **kwargs: Any) -> None:
        await self._enlist("setxattr")
        await super().setxattr(*args, **kwargs)

    async def removexattr(self, *args: Any, **kwargs: Any) -> None:
        await self._enlist("removexattr")
        await super().removexattr(*args, **kwargs)


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


@dataclass(frozen=True)
class StoreClaim:
    """The store a mount writes to (``identity``, store/check.py) and the one its staging
    directory recorded (``recorded``: None for a first mount)."""

    identity: str
    recorded: str | None

    @property
    def adopting(self) -> bool:
        """The staging directory moves from the recorded store to this one."""
        return self.recorded is not None and self.recorded != self.identity


def claim_store(config: Config, staging: Staging) -> StoreClaim:
    """The store this mount may use with ``staging``; UserError if the directory belongs to
    another store and ``adopt_store`` is not set. Records nothing (``serve`` does, once the
    mount is ready)."""
    claim = StoreClaim(store_identity(config), staging.recorded_store())
    if claim.adopting and not config.adopt_store:
        raise UserError(
            f"staging directory {staging.root} belongs to the store {claim.recorded}, not "
            f"{claim.identity}: its files would go to (or vanish from) the wrong store; mount "
            f"with that store, another staging directory, or --adopt-store to move it to "
            f"{claim.identity}")
    if claim.adopting and config.read_only:
        raise UserError(f"a read-only mount cannot adopt a store (it uploads nothing): mount "
                        f"{staging.root} read-write with --adopt-store first")
    return claim


def prepare(config: Config, mountpoint: Path) -> tuple[Path, Staging, StoreClaim]:
    """Every check that can fail because of user input, before anything is mounted."""
    mountpoint = check_mountpoint(mountpoint)
    check_staging_place(config.staging_dir, mountpoint)
    staging = Staging(config.staging_dir)
    staging.prepare()
    try:
        claim = claim_store(config, staging)
    except BaseException:
        staging.close()
        raise
    return mountpoint, staging, claim


def adopt_store(journal: Journal) -> tuple[int, list[str]]:
    """Move the journal's files to a new store (``--adopt-store``): every entry with a local
    copy becomes "to upload" (STAGED, no remote key), and the pending deletions and directory
    sweeps, which name keys of the old store, are dropped. Returns how many entries were
    queued again and the paths of the files left behind: those whose bytes are not on this
    node (evicted, or a hard link to such a file), which only the old store has.

    Runs before the filesystem core exists (it caches rows): the journal alone."""
    rows = journal.linked_rows()
    by_ino = {row.ino: row for row in rows}
    queued = 0
    missing: list[str] = []
    with journal.transaction():
        for tomb_id, _ in journal.tombstones():
            journal.drop_tombstone(tomb_id)
        for sweep_id in journal.sweeps():
            journal.drop_sweep(sweep_id)
        for row in rows:
            head = row if row.link_of is None else by_ino.get(row.link_of)
            if stat.S_ISREG(row.mode) and (head is None or State.REMOTE in (row.state,
                                                                            head.state)):
                path = journal.path_of(row.ino)
                missing.append(os.fsdecode(path or b"?"))
                continue
            if row.state in (State.COMMITTED, State.UPLOADING):
                row.state = State.STAGED
            if row.state is State.STAGED and not row.incomplete:
                queued += 1
            # Keys of the old store: the new one has none of them.
            row.remote_key = row.uploading_key = row.remote_etag = row.storage_class = None
            row.tiers = ""
            journal.update(row)
    return queued, sorted(missing)


def _adopted(claim: StoreClaim, staging: Staging, journal: Journal,
             on_warning: Callable[[str], None]) -> None:
    """``adopt_store`` and its report (the log, and one line for the mount's stderr)."""
    queued, missing = adopt_store(journal)
    log.warning("adopting the store %s (this staging directory belonged to %s): %s with a "
                "local copy queued for it", claim.identity, claim.recorded,
                count(queued, "entry", "entries"))
    if missing:
        log.warning("%s without a local copy (evicted: only %s has them) will not be in %s: "
                    "%s", count(len(missing), "file"), claim.recorded, claim.identity,
                    ", ".join(missing))
        n = len(missing)
        on_warning(f"{count(n, 'file')} of {staging.root} {plural(n, 'has', 'have')} no local "
                   f"copy (evicted: only {claim.recorded} has {plural(n, 'it', 'them')}) and "
                   f"will not be in {claim.identity}; the paths are in the log")


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


def raise_nofile_limit() -> int:
    """Raise the daemon's open-file limit to its hard limit (returns the new soft limit).

    Every open file of the mount holds a staging descriptor, every upload and fetch another,
    and every control-socket client one: a soft limit of 1024 (the usual default) would turn
    a large checkpoint's opens into EMFILE long before the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return soft


async def serve(
    config: Config, mountpoint: Path, staging: Staging, on_ready: Callable[[str], None],
    claim: StoreClaim | None = None, on_warning: Callable[[str], None] = lambda _: None,
) -> None:
    """Mount and serve until unmounted or signalled. ``claim`` (``claim_store``): the store
    is recorded in the staging directory once the mount is ready, and adopted at the start;
    ``on_warning`` gets the lines the mount's command should print (adopting, above)."""
    if claim is None:
        claim = claim_store(config, staging)
    # FUSE handlers run on the trio thread and share the GIL with upload threads; a short
    # switch interval keeps a write() from queueing 5 ms behind a busy upload thread.
    sys.setswitchinterval(0.0005)
    raise_nofile_limit()
    # Before anything is mounted or registered: passthrough = on without what it needs fails
    # the mount here, with the missing piece (passthrough.py).
    passthrough = decide(config.passthrough, facts(pyfuse3, staging.root))
    tier = await open_warm_tier(config)
    journal = Journal(staging.root / JOURNAL_NAME)
    _owner_only(staging.root, JOURNAL_NAME)
    run: NodeRun | None = None
    try:
        if claim.adopting:
            _adopted(claim, staging, journal, on_warning)

        def ready(note: str) -> None:
            if claim.recorded != claim.identity:
                staging.record_store(claim.identity)
            on_ready(note)
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
        node = node_id(staging.root, config.node_id)
        assert fs.peers is not None
        fs.peers.node = node  # the stamps of its uploads name it (peers.py)
        fs.gate = YieldGate(config.upload_settle.total_seconds(),
                            config.upload_hold_max.total_seconds())
        unwrap(tier).pace = fs.gate.wait_open  # parts of an upload in flight wait too
        uploader = Uploader(journal, fs.ns, staging, tier,
                            concurrency=config.upload_concurrency, markers=config.commit_markers,
                            keys=fs.keys, peers=fs.peers, lister=fs.lister, gate=fs.gate)
        fs.listener = uploader
        uploader.requeue_from_journal()
        run = NodeRun(staging.root, boot_id())
        run.start(node, incomplete=len(
            [r for r in journal.rows_in_states(State.OPEN) if r.incomplete]))
        coordinator = Coordinator(
            tier, node, uploader,
            poll=config.node_poll_interval.total_seconds(),
            idle_poll=config.node_idle_poll_interval.total_seconds(),
            token=node_token(staging.root), run=run,
            register_timeout=config.register_timeout.total_seconds())
        uploader.coordinator = coordinator
        left = uploader.work_left()
        if config.read_only:
            if left:
                files, size = uploader.pending()
                raise UserError(
                    f"{staging.root} has work not uploaded yet ({count(files, 'file')}, "
                    f"{size / MiB:.1f} MiB): a read-only mount uploads nothing; mount it "
                    "read-write first (or use another staging directory)")
        else:
            # Before the first request: a node with work left registers now (its files were
            # closed before markers of other nodes may be); any other only at its first change
            # (RegisteringOps), and a registration a killed run of it left is removed.
            try:
                await coordinator.check_at_mount(enlist=left or config.register_at_mount)
            except (TierError, StoreUnavailable) as exc:
                raise UserError(f"cannot register this node in {tier.url}: {exc}") from None
            except DuplicateNode as exc:
                raise UserError(str(exc)) from None
        try:
            await _serve_registered(config, mountpoint, staging, journal, tier, fs, uploader,
                                    coordinator, ready, passthrough)
        except BaseException:
            # Failed before or while serving: leave only if nothing at all is left to upload
            # (the in-flight items are gone from the queue by now: ask the journal too).
            with trio.CancelScope(shield=True):
                await _leave(coordinator, _nothing_left(uploader, journal))
            raise
        finally:
            _report_stop(staging.root, uploader, coordinator)
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
    fs: Filesystem, uploader: Uploader, coordinator: Coordinator, on_ready: Callable[[str], None],
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
            from ckptfs.ops.metrics import MetricsServer

            metrics = MetricsServer(control)
            await metrics.listen(config.metrics_address, config.metrics_port)
        fs.daemon_info = {
            "pid": os.getpid(),
            "staging_dir": str(staging.root),
            "control": str(control.path),
            "version": __version__,
        }
        async with trio.open_nursery() as nursery:
            # WAL checkpoints (two fsyncs each) in a worker thread, not inside a commit that
            # a FUSE request makes on this thread.
            walcheck = journal.checkpoint_in_background()
            await nursery.start(control.loop_watch.run)
            await nursery.start(walcheck.run, lambda: journal.total_changes)
            # Group commit: a request's change is safe in the redo log when it returns, and
            # commits with the others of the same few milliseconds (journal.py, redo.py).
            await nursery.start(journal.commit_batches)
            if not config.read_only:  # read-only: nothing goes to the store, nothing is acked
                await nursery.start(uploader.run)
                await nursery.start(coordinator.run)
            await nursery.start(control.serve)
            if not config.read_only:
                nursery.start_soon(retention.run, uploader,
                                   config.retention_interval.total_seconds())
                assert fs.lister is not None
                # What other nodes did to this node's files (peers.py records).
                nursery.start_soon(fs.lister.run_records)
            if metrics is not None:
                nursery.start_soon(metrics.serve)
            assert fs.fetcher is not None and fs.lister is not None
            fs.nursery = nursery  # unlinks of big removed files
            fs.fetcher.nursery = nursery  # readahead runs beside the FUSE workers
            nursery.start_soon(fs.fetcher.run_flusher)
            fs.lister.nursery = nursery  # and listings a lookup stopped waiting for
            # The root's listing before the mount is ready: the first lookups (often a
            # writer's new files) then never wait for the store.
            await fs.lister.refresh(fs.getattr(ROOT_INODE))
            ops_args: dict[str, Any] = {
                "attr_timeout": min(10.0, config.metadata_ttl.total_seconds()),
                "passthrough": PassthroughFiles(
                    fs, passthrough.request, passthrough.reason,
                    write_reserve=config.passthrough_write_reserve)}
            ops = FuseOps(fs, **ops_args) if config.read_only else \
                RegisteringOps(fs, coordinator, **ops_args)
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
            if hasattr(pyfuse3, "killpriv_v2_enabled"):
                # Without it the kernel asks for security.capability before every write(2),
                # passthrough or not: a round trip per write. The daemon clears set-id bits
                # itself (fs.py _drop_set_id), as the capability requires.
                init_args["handle_killpriv_v2"] = True
            init_fuse(ops, mountpoint, fuse_options(config), **init_args)
            try:
                log.info("mounted %s%s (staging %s, warm tier %s)", mountpoint,
                         " read-only" if config.read_only else "", staging.root,
                         config.warm.url)
                nursery.start_soon(_terminate_on_signal)
                on_ready(fallback_note(config.passthrough, passthrough))
                sd_notify("READY=1")
                await pyfuse3.main(min_tasks=1, max_tasks=config.fuse_workers)
            finally:
                sd_notify("STOPPING=1")
                ops.passthrough.close()  # files a mapping still holds: staged as they are
                fs.close()
                pyfuse3.close(unmount=True)
                log.info("unmounted %s", mountpoint)
            # Before the cancellation reaches the workers (it drops their items).
            idle = not uploader.busy()
            # Uploads still in flight stop here; the journal requeues them at the next mount.
            nursery.cancel_scope.cancel()
            await _leave(coordinator, idle)
    finally:
        if retention is not None:
            with trio.CancelScope(shield=True):
                await retention.aclose()


def init_fuse(ops: FuseOps, mountpoint: Path, options: set[str], **init_args: Any) -> None:
    """``pyfuse3.init``; if the kernel or libfuse refuses the mount, a UserError saying
    what libfuse said, e.g. ``cannot mount /ckpt: failed to open /dev/fuse: Permission
    denied`` (pyfuse3 itself says only "fuse_session_mount failed"). libfuse writes its reason
    to stderr (fusermount3 too): stderr is caught around the call and passed on as it was."""
    import tempfile

    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        failed: RuntimeError | None = None
        try:
            pyfuse3.init(ops, str(mountpoint), options, **init_args)
        except RuntimeError as exc:
            failed = exc
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        said = caught.read().decode(errors="replace")
    if said:
        sys.stderr.write(said)  # where it would have gone: the log
        sys.stderr.flush()
    if failed is not None:
        why = "; ".join(line.strip().removeprefix("fuse: ") for line in said.splitlines()
                        if line.strip())
        raise UserError(f"cannot mount {mountpoint}: {why or failed}") from None


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
    return not (uploader.busy() or journal.rows_in_states(State.STAGED, State.UPLOADING)
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


def _report_stop(root: Path, uploader: Uploader, coordinator: Coordinator) -> None:
    """What this run leaves behind, for ``ckptfs umount`` (noderun.py ``STOP_REPORT``)."""
    try:
        files, size = uploader.pending()
    except Exception as exc:  # noqa: BLE001 (the journal may be what failed: report nothing)
        log.warning("could not count the files left to upload: %s", exc)
        return
    if files:
        log.warning("%s (%.1f MiB) not uploaded; %s in %s and %s up at the next mount",
                    count(files, "file"), size / MiB, plural(files, "it stays", "they stay"),
                    root, plural(files, "goes", "go"))
    try:
        write_stop_report(root, {"pid": os.getpid(), "node": coordinator.node, "files": files,
                                 "bytes": size, "registered": coordinator.registered})
    except OSError as exc:
        log.warning("could not write the stop report in %s: %s", root, exc)


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
