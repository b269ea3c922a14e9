"""Optional Prometheus endpoint: ``http://<metrics_address>:<metrics_port>/metrics``.

Off unless ``metrics_port`` is set. The names are documented in docs/OPERATIONS.md (a test
checks that every documented name is served).

Invariants:
- Read-only: a scrape reads the counters the daemon keeps anyway (the uploader's stats, the
  filesystem's stall time and space budget, the fetcher's counters, the control server's
  status) and changes nothing. Only the upload latency histogram is fed as uploads finish.
- The HTTP server is a trio task in the mount's nursery, on the trio thread like every other
  reader of that state: no thread, no lock. A slow or broken client cannot hold it up.
- No paths, keys or credentials in labels: only the mountpoint and warm tier URL, in
  ``ckptfs_info``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ckptfs import __version__
from ckptfs.errors import UserError
from ckptfs.ops.control import ControlServer

log = logging.getLogger(__name__)

UPLOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
REQUEST_LIMIT = 8192
CLIENT_TIMEOUT = 10.0


class _DaemonCollector(Collector):
    """Turns the daemon's own counters into metric families at each scrape."""

    def __init__(self, control: ControlServer) -> None:
        self.control = control

    def collect(self) -> Iterator[Metric]:
        control = self.control
        fs, stats = control.fs, control.uploader.stats
        status = control.status()

        info = GaugeMetricFamily("ckptfs_info", "The mount this daemon serves (always 1).",
                                 labels=["version", "mountpoint", "warm_tier"])
        info.add_metric([__version__, str(control.mountpoint), control.tier_url], 1)
        yield info
        fetch, queue, staging = status["fetch"], status["queue"], status["staging"]
        loop = status["loop"]
        counters = (
            ("ckptfs_written_bytes", "Bytes written by applications.", fs.bytes_written),
            ("ckptfs_uploaded_bytes", "Bytes uploaded to the warm tier.", stats.uploaded_bytes),
            ("ckptfs_uploaded_files", "Files uploaded to the warm tier.", stats.uploaded_files),
            ("ckptfs_moved_files", "Files moved on the warm tier (renames).", stats.moved),
            ("ckptfs_deleted_objects", "Objects deleted from the warm tier.", stats.deleted),
            ("ckptfs_upload_retries", "Failed warm-tier operations (each is retried).",
             stats.retries),
            ("ckptfs_upload_failures",
             "Failed warm-tier operations whose error is not transient.", stats.failures),
            ("ckptfs_fetched_bytes", "Bytes fetched from the warm tier by reads.",
             fetch["bytes"]),
            ("ckptfs_fetch_failures", "Fetches that failed their checksum.", fetch["failures"]),
            ("ckptfs_write_stall_seconds",
             "Time writers waited: for staging space, or for this node's registration.",
             status["write_stall_s"]),
            ("ckptfs_registration_wait_seconds",
             "Time requests waited for this node's registration in the store.",
             (status["node"] or {}).get("registration_waited_s", 0.0)),
            ("ckptfs_passthrough_opens", "Opens served by the kernel (FUSE passthrough).",
             status["passthrough"].get("opens", {}).get("passthrough", 0)),
            ("ckptfs_loop_stalls",
             "Times the daemon's loop answered nothing for 100 ms or more.", loop["stalls"]),
            ("ckptfs_gc_full_collections", "Full garbage collections (each stops the loop).",
             loop["gc_full_collections"]),
            ("ckptfs_gc_full_seconds", "Time spent in full garbage collections.",
             loop["gc_full_seconds"]),
        )
        gauges = (
            ("ckptfs_queue_files", "Closed files not yet committed to the warm tier.",
             queue["files"]),
            ("ckptfs_queue_bytes", "Bytes of closed files not yet committed.", queue["bytes"]),
            ("ckptfs_queue_items",
             "Work items of the uploader (uploads, moves, deletions) outstanding.",
             queue["work_items"]),
            ("ckptfs_failing_items", "Work items whose last attempt failed.",
             len(status["failed"])),
            ("ckptfs_incomplete_files",
             "Files whose writer never closed them (kept locally, never uploaded).",
             len(status["incomplete"])),
            ("ckptfs_staging_used_bytes", "Bytes of file data held on local NVMe.",
             staging["used_bytes"]),
            ("ckptfs_staging_free_bytes", "Free bytes on the staging filesystem.",
             staging["free_bytes"]),
            ("ckptfs_staging_size_bytes", "Size of the staging filesystem.",
             staging["total_bytes"]),
            ("ckptfs_upload_rate_bytes_per_second", "Upload throughput over the last minute.",
             status["upload_rate_bytes_per_s"]),
            ("ckptfs_passthrough_active", "1 if FUSE passthrough is in use (docs/PASSTHROUGH.md).",
             int(bool(status["passthrough"].get("active")))),
            ("ckptfs_registration_waiting_requests",
             "Requests waiting now for this node's registration in the store.",
             sum(((status["node"] or {}).get("registration_wait") or {})
                 .get("requests", {}).values())),
            ("ckptfs_loop_longest_stall_seconds",
             "The longest time the daemon's loop answered nothing, over the last 5 minutes.",
             loop["recent_longest_stall_s"]),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)


class MetricsServer:
    """The ``/metrics`` endpoint of one mount."""

    def __init__(self, control: ControlServer) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_DaemonCollector(control))
        self.upload_seconds = Histogram(
            "ckptfs_upload_seconds", "Time to upload one file to the warm tier.",
            buckets=UPLOAD_BUCKETS, registry=self.registry)
        control.uploader.stats.observers.append(self._uploaded)
        self._listeners: list[trio.SocketListener] = []

    def _uploaded(self, seconds: float, nbytes: int) -> None:
        self.upload_seconds.observe(seconds)

    async def listen(self, address: str, port: int) -> None:
        """Bind now (a port in use fails the mount with one line), serve later."""
        try:
            self._listeners = await trio.open_tcp_listeners(port, host=address or None)
        except OSError as exc:
            raise UserError(f"metrics_port {port}: cannot listen on {address or '*'}:{port}: "
                            f"{exc.strerror or exc}") from None
        log.info("metrics on http://%s:%d/metrics", address or "*", port)

    async def serve(self) -> None:
        """Serve scrapes on the sockets ``listen`` bound, until cancelled."""
        await trio.serve_listeners(self._handle, self._listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(CLIENT_TIMEOUT):
                try:
                    await self._answer(stream)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def _answer(self, stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            head += chunk
            if len(head) > REQUEST_LIMIT:
                await _respond(stream, 431, b"request too large\n")
                return
        words = head.split(b"\r\n", 1)[0].split()
        if len(words) < 2 or words[0] not in (b"GET", b"HEAD"):
            await _respond(stream, 405, b"only GET\n")
            return
        path = words[1].split(b"?", 1)[0]
        if path not in (b"/metrics", b"/"):
            await _respond(stream, 404, b"not found: try /metrics\n")
            return
        body = generate_latest(self.registry)
        await _respond(stream, 200, body, CONTENT_TYPE_LATEST, head_only=words[0] == b"HEAD")


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


async def _respond(stream: trio.SocketStream, code: int, body: bytes,
                   content_type: str = "text/plain; charset=utf-8", *,
                   head_only: bool = False) -> None:
    headers: dict[str, Any] = {"Content-Type": content_type, "Content-Length": len(body),
                               "Connection": "close"}
    lines = [f"HTTP/1.1 {code} {_REASONS[code]}"] + [f"{k}: {v}" for k, v in headers.items()]
    await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode()
                          + (b"" if head_only else body))
