"""The Prometheus endpoint (``metrics_port``): it serves every metric docs/OPERATIONS.md
documents, and its byte counters match what the test wrote and read.
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.mounting import Mount, Mounter, ckptfs
from tests.s3server import free_port

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
KiB = 1024


def documented_metrics() -> dict[str, str]:
    """``name -> type`` from the metrics table of docs/OPERATIONS.md."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    found = dict(re.findall(r"^\| `(ckptfs_[a-z_]+)` \| (counter|gauge|histogram) \|", text,
                            re.MULTILINE))
    assert len(found) >= 15, found
    return found


def scrape(port: int, path: str = "/metrics") -> dict[str, float]:
    """Every sample of the endpoint, by name (labels dropped: one series each here)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            samples[sample.name] = sample.value
    return samples


def metrics_mount(mounter: Mounter, name: str, store: Path) -> tuple[Mount, int]:
    port = free_port()
    return mounter(name, store=store, extra=["-o", f"metrics_port={port}"]), port


def test_metrics_serve_the_documented_names_and_count_bytes(
        tmp_path: Path, mounter: Mounter) -> None:
    store = tmp_path / "store"
    m, port = metrics_mount(mounter, "a", store)
    sizes = {"step_1/model.pt": 1000 * KiB + 7, "step_1/optim.pt": 123_457, "step_1/empty": 0}
    (m.path / "step_1").mkdir()
    for rel, size in sizes.items():
        (m.path / rel).write_bytes(os.urandom(size))
    ckptfs("sync", m.path)
    samples = scrape(port)

    for name, kind in documented_metrics().items():
        wanted = {"histogram": name + "_count", "counter": name}.get(kind, name)
        assert wanted in samples, f"{wanted} (documented) is not served"
    total = sum(sizes.values())
    assert samples["ckptfs_uploaded_bytes_total"] == total
    assert samples["ckptfs_uploaded_files_total"] == len(sizes)
    assert samples["ckptfs_upload_seconds_count"] == len(sizes)
    assert samples["ckptfs_staging_used_bytes"] == total
    assert samples["ckptfs_queue_files"] == 0 and samples["ckptfs_queue_bytes"] == 0
    assert samples["ckptfs_failing_items"] == 0 and samples["ckptfs_incomplete_files"] == 0
    assert samples["ckptfs_staging_free_bytes"] > 0
    if "ckptfs_written_bytes_total" in samples:  # once the core counts writes
        assert samples["ckptfs_written_bytes_total"] == total
    # the same numbers as status
    assert scrape(port, "/")["ckptfs_uploaded_bytes_total"] == total
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=30)
    assert info.value.code == 404


def test_metrics_count_fetched_bytes(tmp_path: Path, mounter: Mounter) -> None:
    """Node B reads what node A wrote: B's fetched-bytes counter is the file's size."""
    store = tmp_path / "store"
    a = mounter("a", store=store)
    data = os.urandom(300 * KiB + 5)
    (a.path / "model.pt").write_bytes(data)
    ckptfs("sync", a.path)
    b, port = metrics_mount(mounter, "b", store)
    assert scrape(port)["ckptfs_fetched_bytes_total"] == 0
    assert (b.path / "model.pt").read_bytes() == data
    assert scrape(port)["ckptfs_fetched_bytes_total"] == len(data)


def test_metrics_port_in_use_fails_the_mount_with_one_line(
        tmp_path: Path, mounter: Mounter) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        done = ckptfs("mount", mnt, "--staging", tmp_path / "st", "--store", tmp_path / "s",
                      "--create-store", "-o", f"metrics_port={port}", check=False)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and f"metrics_port {port}" in lines[0], done.stderr
    assert not os.path.ismount(mnt)


def _listening(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6})."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_metrics_listen_on_loopback_unless_told_otherwise(
        tmp_path: Path, mounter: Mounter) -> None:
    """The endpoint has no authentication: by default no other host can reach it."""
    _, port = metrics_mount(mounter, "a", tmp_path / "store")
    assert _listening(port) == {"0100007F"}   # 127.0.0.1, and nothing else
    port = free_port()
    mounter("b", store=tmp_path / "store",
            extra=["-o", f"metrics_port={port}", "-o", "metrics_address=0.0.0.0"])
    assert _listening(port) == {"00000000"}
