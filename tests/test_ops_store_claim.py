"""The store a staging directory belongs to (``<staging>/store-id``): recorded only by a mount
that became ready, and moved to another store with ``--adopt-store``, which queues every file
with a local copy for the new store at once (mount.py ``claim_store``, ``adopt_store``).

Real mounts: a SeaweedFS bucket for the failures only a store can give (a missing bucket, a
closed port), file stores for adopting.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.mounting import Mounter, ckptfs, is_mounted, status, sync
from tests.s3bucket import PREFIX, Bucket
from tests.test_cli_errors import assert_nothing_left, assert_user_error

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_mount_that_never_succeeded_records_no_store(
        tmp_path: Path, mounter: Mounter, bucket: Bucket) -> None:
    config = bucket.config(tmp_path / "ckptfs.toml")
    staging, mnt = tmp_path / "staging", tmp_path / "mnt"
    mnt.mkdir()
    record = staging / "store-id"
    good = f"s3://{bucket.name}/{PREFIX.rstrip('/')}"
    typo = f"s3://{bucket.name}-typo/{PREFIX.rstrip('/')}"

    def mount(*args: str) -> subprocess.CompletedProcess[str]:
        return ckptfs("mount", mnt, "--config", config, "--staging", staging, *args,
                      check=False)

    # A bucket that does not exist, then a closed port: the store was never reached.
    assert_user_error(mount("--store", typo), "does not exist")
    assert_nothing_left(mnt)
    assert not record.exists()
    port = _closed_port()
    assert_user_error(mount("--s3-endpoint", f"http://127.0.0.1:{port}"), "cannot be reached", f"127.0.0.1:{port}")
    assert_nothing_left(mnt)
    assert not record.exists()
    # The corrected command mounts, and only now is the store recorded.
    done = mount()
    assert done.returncode == 0, done
    assert record.read_text().startswith(good), record.read_text()
    ckptfs("umount", mnt)
    # Adopting a store that cannot be reached fails and leaves the record as it was: the
    # staging directory still belongs to the good store, which mounts without --adopt-store.
    assert_user_error(mount("--store", typo, "--adopt-store"),
                      "does not exist")
    assert_nothing_left(mnt)
    assert record.read_text().startswith(good)
    done = mount()
    assert done.returncode == 0, done
    ckptfs("umount", mnt)


def test_adopting_a_store_queues_every_local_file_and_reports_the_evicted(
        tmp_path: Path, mounter: Mounter) -> None:
    store_a, store_b = tmp_path / "a", tmp_path / "b"
    m = mounter("n", store=store_a)
    (m.path / "step_1").mkdir()
    (m.path / "step_1" / "model.pt").write_bytes(b"m" * 300_000)
    (m.path / "step_1" / ".metadata").write_bytes(b"meta")
    (m.path / "old").mkdir()
    (m.path / "old" / "gone.pt").write_bytes(b"g" * 5000)
    (m.path / "link").symlink_to("step_1/model.pt")
    sync(m)
    ckptfs("evict", m.path / "old" / "gone.pt")  # its only copy is now in store A
    m.umount()

    store_b.mkdir()
    done = ckptfs("mount", m.path, "--staging", m.staging, "--store", store_b, "--adopt-store")
    # One line on stderr (besides the usual one: a store on the local disk is no shared one).
    warnings = [line for line in done.stderr.splitlines() if "local copy" in line]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith("ckptfs: warning: 1 file of ") and " has no local copy " \
        in warnings[0] and store_b.as_uri() in warnings[0], warnings[0]
    log = (m.staging / "daemon.log").read_text()
    assert "old/gone.pt" in log, log[-2000:]
    # Nothing reads or lists the files: sync alone brings every local one to the new store.
    sync(m)
    assert (store_b / "step_1" / "model.pt").read_bytes() == b"m" * 300_000
    assert (store_b / "step_1" / ".metadata").read_bytes() == b"meta"
    assert (store_b / "link").is_symlink() or (store_b / "link").exists()
    assert not (store_b / "old" / "gone.pt").exists()
    report = status(m)
    assert report["queue"]["files"] == 0 and report["failed_count"] == 0, report
    assert (m.staging / "store-id").read_text() == store_b.as_uri() + "\n"
    m.umount()
    assert not is_mounted(m.path)
