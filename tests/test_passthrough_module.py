"""ckptfs/passthrough.py without a mount: the auto/on/off decision from injected facts, and the
per-inode io mode and backing ids against a fake backend (the real ioctl is covered by
tests/test_passthrough_build.py)."""

from __future__ import annotations

import errno

import pytest

from ckptfs.errors import UserError
from ckptfs.passthrough import (
    BackingTable,
    Facts,
    _has_cap_sys_admin,
    _kernel_release,
    decide,
    file_info_fields,
)

READY = Facts(kernel=(6, 18), cap_sys_admin=True, pyfuse3_has_passthrough=True)


class FakeBackend:
    """Hands out ids like the kernel (from 1); ``fail`` makes the next opens raise it."""

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail
        self.next_id = 1
        self.open_ids: dict[int, int] = {}    # id -> fd
        self.calls: list[str] = []

    def open(self, fd: int) -> int:
        self.calls.append(f"open {fd}")
        if self.fail is not None:
            raise OSError(self.fail, "fake")
        self.open_ids[self.next_id] = fd
        self.next_id += 1
        return self.next_id - 1

    def close(self, backing_id: int) -> None:
        self.calls.append(f"close {backing_id}")
        del self.open_ids[backing_id]


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_decide_requests_when_everything_is_there(mode: str) -> None:
    assert decide(mode, READY).request  # type: ignore[arg-type]


@pytest.mark.parametrize(("facts", "why"), [
    (Facts((6, 18), True, False), "pyfuse3"),
    (Facts((6, 8), True, True), "kernel 6.8"),
    (Facts((6, 18), False, True), "CAP_SYS_ADMIN"),
])
def test_auto_falls_back_and_on_fails_with_one_reason(facts: Facts, why: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="ckptfs.passthrough"):
        d = decide("auto", facts)
    assert not d.request and why in d.reason
    assert [r.getMessage() for r in caplog.records] == [f"passthrough off: {d.reason}"]
    with pytest.raises(UserError, match=why):
        decide("on", facts)


def test_off_never_requests() -> None:
    assert not decide("off", READY).request


def test_kernel_release_and_caps_parsing() -> None:
    assert _kernel_release("6.18.44-fc-v1045") == (6, 18)
    assert _kernel_release("5.4.0") == (5, 4)
    assert _kernel_release("weird") == (0, 0)
    assert _has_cap_sys_admin("/nonexistent") is False


def test_one_backing_id_per_inode_until_last_release() -> None:
    b = FakeBackend()
    t = BackingTable(b)
    first = t.acquire(7, fd=70, eligible=True)
    second = t.acquire(7, fd=71, eligible=True)
    assert first == second == 1 and b.calls == ["open 70"]
    assert t.mode(7) == "passthrough"
    t.release(7, first)
    assert b.open_ids == {1: 70}           # one open left: the id stays
    t.release(7, second)
    assert b.open_ids == {} and t.mode(7) == "closed"


def test_daemon_opens_keep_the_inode_daemon_served() -> None:
    """A file being faulted in (not eligible) keeps every later open, even once it is wholly
    local, on the daemon path until its last daemon-served open is released."""
    b = FakeBackend()
    t = BackingTable(b)
    assert t.acquire(3, fd=30, eligible=False) == 0
    assert t.acquire(3, fd=31, eligible=True) == 0   # mixing would be EIO in the kernel
    assert b.calls == []
    t.release(3, 0)
    t.release(3, 0)
    assert t.acquire(3, fd=32, eligible=True) == 1   # all closed: now it may switch


def test_passthrough_inode_takes_every_open() -> None:
    t = BackingTable(FakeBackend())
    bid = t.acquire(5, fd=50, eligible=True)
    assert t.acquire(5, fd=51, eligible=False) == bid


@pytest.mark.parametrize("err", [errno.EPERM, errno.EOPNOTSUPP])
def test_backing_open_refused_gives_up_for_the_mount(err: int) -> None:
    b = FakeBackend(fail=err)
    t = BackingTable(b)
    assert t.acquire(1, fd=10, eligible=True) == 0
    assert not t.active
    assert t.acquire(2, fd=20, eligible=True) == 0
    assert b.calls == ["open 10"]         # asked once, not at every open
    t.release(1, 0)


def test_other_backing_open_errors_fall_back_for_that_file_only() -> None:
    b = FakeBackend(fail=errno.ELOOP)     # e.g. staging stacked deeper than max_stack_depth
    t = BackingTable(b)
    assert t.acquire(1, fd=10, eligible=True) == 0
    assert t.active
    b.fail = None
    assert t.acquire(2, fd=20, eligible=True) == 1


def test_no_backend_serves_everything_in_the_daemon() -> None:
    t = BackingTable(None)
    assert t.acquire(1, fd=10, eligible=True) == 0 and t.mode(1) == "daemon"


def test_file_info_fields() -> None:
    assert file_info_fields(4, direct_io=True) == {
        "backing_id": 4, "keep_cache": False, "direct_io": False}
    assert file_info_fields(0, direct_io=True) == {"direct_io": True}
