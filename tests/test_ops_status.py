"""``ckptfs status`` of a live mount, and the safe defaults operators rely on.

- status (human and ``--json``) shows the queue while uploads are slowed down by the tier's
  ``faults`` table, and an empty queue once ``ckptfs sync`` returned;
- credentials never appear in the daemon's log, in ``status``, or on its command line;
- the staging directory is 0700 and the journal 0600, whatever they were before.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

import pytest

from tests.mounting import Mounter, ckptfs, status, sync, tiers_config
from tests.seaweed import Seaweed

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

KiB = 1024


def file_tier_config(path: Path, store: Path, **faults: object) -> Path:
    """One upload at a time to the file tier ``store``, with ``faults``."""
    return tiers_config(path, store.as_uri(), faults=faults, upload_concurrency=1)


def test_status_shows_the_queue_of_a_slow_upload_then_empty_after_sync(
        tmp_path: Path, mounter: Mounter) -> None:
    store = tmp_path / "store"
    store.mkdir()
    # 64 KiB/s: three 256 KiB files take at least 12 s to upload, one at a time.
    config = file_tier_config(tmp_path / "ckptfs.toml", store, bandwidth=64 * KiB)
    m = mounter(config=config)
    sizes = {f"step_1/shard_{i}.pt": 256 * KiB for i in range(3)}
    (m.path / "step_1").mkdir()
    for name, size in sizes.items():
        (m.path / name).write_bytes(os.urandom(size))
    total = sum(sizes.values())

    during = status(m)
    queue = during["queue"]
    assert queue["files"] >= 1 and 0 < queue["bytes"] <= total, during
    assert queue["work_items"] >= queue["files"]
    assert set(queue["uploading"]) <= set(sizes)
    assert during["warm_tier"] == store.as_uri()
    assert [t["name"] for t in during["tiers"]] == ["hot", "warm"]
    assert during["staging"]["used_bytes"] == total
    assert during["staging"]["free_bytes"] > 0
    assert during["failed"] == [] and during["incomplete"] == []
    for key in ("upload_rate_bytes_per_s", "eta_s", "fetch", "write_stall_s", "uptime_s"):
        assert key in during
    loop = during["loop"]  # the loop watch runs in every mount
    assert loop["longest_stall_s"] >= loop["recent_longest_stall_s"] >= 0
    assert loop["gc_full_seconds"] >= loop["gc_longest_s"] >= 0
    human = ckptfs("status", m.path).stdout
    assert "queue" in human and "upload rate" in human and str(m.path) in human
    assert "daemon loop" in human

    ckptfs("sync", m.path)
    after = status(m)
    assert after["queue"] == {"files": 0, "bytes": 0, "uploading": [], "work_items": 0}
    assert after["uploaded"]["files"] == len(sizes)
    assert after["uploaded"]["bytes"] == total
    for name, size in sizes.items():
        assert (store / name).stat().st_size == size
    # Every mount is reported when none is named. Other mounts on this machine are not the
    # test's: one whose daemon is gone makes the exit status 1 and shows as an error entry.
    done = ckptfs("status", "--json", check=False)
    everything = json.loads(done.stdout)
    ours = [r for r in everything if r.get("mountpoint") == str(m.path)]
    assert len(ours) == 1 and "error" not in ours[0], everything
    others_failing = any("error" in r for r in everything)
    assert done.returncode == (1 if others_failing else 0), (done.returncode, everything)


def test_status_lists_failing_uploads_while_the_store_is_down(
        tmp_path: Path, mounter: Mounter) -> None:
    store, down = tmp_path / "store", tmp_path / "down"
    store.mkdir()
    # Registered at mount: the store goes down before this node's first write, which would
    # otherwise wait for its registration (docs/SEMANTICS.md, "Many nodes").
    m = mounter(config=tiers_config(tmp_path / "c.toml", store.as_uri(),
                                    faults={"down_file": str(down)}, upload_concurrency=1,
                                    register_at_mount=True))
    down.touch()  # after the mount: a store that is down at mount time fails the mount
    (m.path / "a.pt").write_bytes(b"a" * 1000)
    # Poll (with a deadline) for the first failed attempt to be reported.
    deadline = time.monotonic() + 60
    report = status(m)
    while not report["failed"] and time.monotonic() < deadline:
        time.sleep(0.1)
        report = status(m)
    assert report["failed"], report
    failed = report["failed"][0]
    assert "injected outage" in failed["error"]
    # The operator's words: the file's path, how often it was tried, when it is tried again.
    assert failed["item"] == "a.pt" and failed["attempts"] >= 1, failed
    if report["store_outage"] is None:
        assert failed["retry_in_s"] >= 0, failed
    else:  # taken as down already: it waits for a probe, whatever its own backoff says
        assert failed["retry_in_s"] is None, failed
    assert report["queue"]["files"] == 1
    assert report["eta_s"] is None, report  # no ETA while uploads fail
    human = ckptfs("status", m.path).stdout
    assert "a.pt" in human and "('ino'" not in human, human
    line = next(line for line in human.splitlines() if "a.pt: " in line)
    assert "injected outage" in line and "attempt" in line and "next try" in line, human
    with open(m.path / "still-open.pt", "wb") as f:   # open for writing: listed by path
        f.write(b"x")
        f.flush()
        report = status(m)
        assert report["open_for_writing"] == ["still-open.pt"], report
        assert report["open_for_writing_count"] == 1
        human = ckptfs("status", m.path).stdout
        assert any("open for writing" in line and "still-open.pt" in line
                   for line in human.splitlines()), human
    down.unlink()
    ckptfs("sync", m.path)
    assert status(m)["failed"] == [] and status(m)["open_for_writing"] == []
    assert (store / "a.pt").read_bytes() == b"a" * 1000


def test_status_shows_a_store_outage_and_the_queue_waits_for_one_probe(
        tmp_path: Path, mounter: Mounter) -> None:
    """Files closed while the store is down: after a few failures in a row status reports the
    outage (and the one-item probe), the failing list stays short, and nothing is lost."""
    store, down = tmp_path / "store", tmp_path / "down"
    store.mkdir()
    m = mounter(config=tiers_config(tmp_path / "c.toml", store.as_uri(),
                                    faults={"down_file": str(down)}, upload_concurrency=2,
                                    register_at_mount=True))
    down.touch()
    names = [f"f{i:02d}.pt" for i in range(30)]
    for name in names:
        (m.path / name).write_bytes(name.encode() * 100)
    deadline = time.monotonic() + 60
    report = status(m)
    while report["store_outage"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
        report = status(m)
    outage = report["store_outage"]
    assert outage is not None and outage["failures_in_a_row"] >= 3, report
    assert report["failed_count"] >= 3 and len(report["failed"]) <= report["failed_count"]
    assert report["queue"]["files"] == len(names)
    # No ETA while the store is down (the last minute's rate says nothing): since when.
    assert report["eta_s"] is None and report["store_unavailable_since"] is not None, report
    assert time.time() - 120 < report["store_unavailable_since"] <= time.time(), report
    assert all(f["retry_in_s"] is None for f in report["failed"]), report["failed"]
    human = ckptfs("status", m.path).stdout
    assert "down for" in human and "next probe" in human, human
    assert "no ETA: the store is unavailable since" in human and "ETA " not in \
        human.replace("no ETA", ""), human
    assert "next try after the store answers a probe" in human, human
    down.unlink()
    ckptfs("sync", m.path)
    after = status(m)
    assert after["store_outage"] is None and after["failed_count"] == 0, after
    for name in names:
        assert (store / name).read_bytes() == name.encode() * 100


def test_a_first_change_waiting_for_the_registration_is_a_stall(
        tmp_path: Path, mounter: Mounter) -> None:
    """The store down at a node's first change: the request waits for the node's
    registration, up to register_timeout, and status, the metrics and the log say so."""
    import threading

    from tests.s3server import free_port
    from tests.test_ops_metrics import scrape

    store, down = tmp_path / "store", tmp_path / "down"
    store.mkdir()
    port = free_port()
    m = mounter(config=tiers_config(tmp_path / "c.toml", store.as_uri(),
                                    faults={"down_file": str(down)}, register_timeout="6s",
                                    metrics_port=port))
    down.touch()
    failed: list[OSError] = []

    def first_change() -> None:
        try:
            (m.path / "step_1").mkdir()
        except OSError as exc:
            failed.append(exc)

    writer = threading.Thread(target=first_change)
    writer.start()
    try:
        deadline = time.monotonic() + 30
        report = status(m)
        while not report["node"]["registration_wait"] and time.monotonic() < deadline:
            time.sleep(0.1)
            report = status(m)
        wait = report["node"]["registration_wait"]
        assert wait is not None and wait["requests"] == {"mkdir": 1}, report["node"]
        assert wait["limit_s"] == 6 and time.time() - 30 < wait["since"] <= time.time()
        deadline = time.monotonic() + 30
        while not report["node"]["registration_wait"]["error"] and time.monotonic() < deadline:
            time.sleep(0.1)
            report = status(m)
        assert "injected outage" in report["node"]["registration_wait"]["error"]
        assert report["write_stall_s"] > 0 and report["store_unavailable_since"] is not None
        human = ckptfs("status", m.path).stdout
        row = next(line for line in human.splitlines() if "writers stalled" in line)
        assert "1 mkdir waits for this node's registration in the store" in row, human
        assert "EIO after 6s" in row and "register_timeout" in row, human
        assert scrape(port)["ckptfs_registration_waiting_requests"] == 1
    finally:
        writer.join(timeout=60)
    assert failed and failed[0].errno == errno.EIO, failed  # after register_timeout
    report = status(m)
    assert report["node"]["registration_wait"] is None
    assert report["write_stall_s"] >= 5, report  # the whole wait, about register_timeout
    samples = scrape(port)
    assert samples["ckptfs_registration_wait_seconds_total"] >= 5, samples
    assert samples["ckptfs_write_stall_seconds_total"] >= 5, samples
    assert samples["ckptfs_registration_waiting_requests"] == 0
    log = (m.staging / "daemon.log").read_text()
    assert "1 request (mkdir) waits for it since" in log, log[-3000:]
    down.unlink()
    (m.path / "step_1").mkdir()  # the store is back: the first change registers and goes
    assert status(m)["node"]["registered"]


def test_tables_without_a_terminal_print_whole_values(tmp_path: Path, mounter: Mounter) -> None:
    """Piped (a batch log, grep): node ids, paths and states are printed whole, however wide
    the table gets; ``--json`` stays the format for programs."""
    node = "gpu-node-0042-of-a-cluster-with-a-long-naming-scheme-" + "x" * 40
    m = mounter(extra=["-o", f"node_id={node}"])
    name = "step_100_" + "descriptive-run-name-" * 4
    (m.path / name).mkdir()
    (m.path / name / "model.pt").write_bytes(b"m" * 1000)
    sync(m)
    env = {**os.environ, "COLUMNS": "80"}
    nodes = ckptfs("nodes", m.path, env=env).stdout
    assert node in nodes, nodes
    assert max(map(len, nodes.splitlines())) > 80
    tiers = ckptfs("ls-tiers", m.path, env=env).stdout
    row = next(line for line in tiers.splitlines() if name in line)
    assert "committed" in row and "…" not in tiers, tiers
    human = ckptfs("status", m.path, env=env).stdout
    assert str(m.staging) in human and node in human, human


SECRET_KEY = "opsTestSecret/Very+Private/9876543210"


def test_credentials_never_in_logs_status_or_command_line(
        tmp_path: Path, mounter: Mounter, seaweed: Seaweed) -> None:
    """The session's SeaweedFS checks the keys: the upload proves they were used."""
    bucket = seaweed.new_bucket()
    access_key, secret_key = seaweed.access_key, seaweed.secret_key
    assert "/" in secret_key and "+" in secret_key
    config = tmp_path / "ckptfs.toml"
    config.write_text("\n".join([
        'log_level = "debug"',
        "[[tier]]", 'name = "hot"',
        "[[tier]]", 'name = "warm"', f'url = "s3://{bucket}/run1"',
        f'endpoint_url = "{seaweed.endpoint}"',
        f'access_key_id = "{access_key}"', f'secret_access_key = "{secret_key}"',
    ]) + "\n")
    os.chmod(config, 0o600)
    m = mounter(config=config)
    (m.path / "step_1").mkdir()
    (m.path / "step_1" / "model.pt").write_bytes(os.urandom(100 * KiB))
    ckptfs("sync", m.path)
    keys = [o["Key"] for o in seaweed.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert "run1/step_1/model.pt" in keys  # the credentials were used
    report = ckptfs("status", "--json", m.path).stdout + ckptfs("status", m.path).stdout
    cmdline = Path(f"/proc/{m.pid}/cmdline").read_bytes().decode(errors="replace")
    m.umount()
    log = (m.staging / "daemon.log").read_text()
    assert "DEBUG" in log and "uploaded" in log  # the log was written, at debug level
    for secret in (access_key, secret_key):
        assert secret not in log
        assert secret not in report
        assert secret not in cmdline


def test_log_lines_are_one_line_and_only_credentials_are_masked() -> None:
    """The AWS SDK's records (which may dump headers) are masked; ckptfs's own lines are
    left alone: with the secret key ``test`` a file named ``latest`` stays ``latest``."""
    import logging
    import sys

    from ckptfs.ops.cli import _OneLineRedacting

    formatter = _OneLineRedacting("%(levelname)s %(message)s", [SECRET_KEY, "test"])
    try:
        raise ValueError(f"bad key {SECRET_KEY}")
    except ValueError:
        record = logging.LogRecord("botocore.endpoint", logging.ERROR, __file__, 1,
                                   "sending %s", ({"X-Amz-Security-Token": SECRET_KEY},),
                                   sys.exc_info())
    line = formatter.format(record)
    assert SECRET_KEY not in line and "***" in line
    assert "\n" not in line and "ValueError" in line
    ours = logging.LogRecord("ckptfs.engine.upload", logging.INFO, __file__, 1,
                             "uploaded %s\nand test/x", ("latest",), None)
    assert formatter.format(ours) == "INFO uploaded latest | and test/x"


def test_staging_directory_0711_and_journal_0600(tmp_path: Path, mounter: Mounter) -> None:
    """Others may traverse the staging directory (to reach the control socket, whose server
    checks who connects: test_ops_control_access.py), never list it or read its files."""
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o755)
    os.chmod(staging, 0o755)  # an operator made it too open
    m = mounter(staging=staging)
    (m.path / "f").write_bytes(b"x")
    ckptfs("sync", m.path)
    assert stat.S_IMODE(staging.stat().st_mode) == 0o711
    assert stat.S_IMODE((staging / "data").stat().st_mode) == 0o700
    journal_files = list(staging.glob("journal.db*"))
    assert journal_files
    for path in journal_files + [staging / "daemon.log", staging / "lock",
                                 staging / "node-id", staging / "node-run"]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    assert stat.S_IMODE((staging / "control.sock").stat().st_mode) == 0o666
