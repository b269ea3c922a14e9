"""What a node takes from the store's metadata (store/trust.py, listing.py; docs/SEMANTICS.md,
"What the store may decide"): set-id bits stripped, impossible owners
mapped to nobody, bad symlink targets refused; the mount is nodev, and nosuid by default.

Objects with hostile metadata are put straight into a memory store; a fresh node lists them.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import trio

from ckptfs.config import Config
from ckptfs.fuse.mountinfo import find
from ckptfs.ops.mount import fuse_options
from ckptfs.store.tiers.base import Kind, ObjectMeta
from ckptfs.store.tiers.memory import _Object, store_named
from ckptfs.store.trust import NOBODY, dir_mode, file_mode, owner, symlink_target
from tests.mounting import Mounter, status
from tests.test_read_path import TTL, node


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"trust-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


def test_modes_lose_set_id_bits_and_files_lose_the_sticky_bit() -> None:
    assert file_mode(0o6755) == stat.S_IFREG | 0o755
    assert file_mode(0o1777) == stat.S_IFREG | 0o777
    assert file_mode(0o170644) == stat.S_IFREG | 0o644  # a type in the bits is not taken
    assert dir_mode(0o3775) == stat.S_IFDIR | 0o1775  # sticky kept, setgid dropped
    assert dir_mode(0o4000) == stat.S_IFDIR | 0o755  # nothing left: the default
    assert dir_mode(0) == stat.S_IFDIR | 0o755


@pytest.mark.parametrize(("value", "expected"), [
    (0, 0), (1000, 1000), (2**32 - 2, 2**32 - 2),
    (-1, NOBODY), (-5, NOBODY), (2**32 - 1, NOBODY), (2**40, NOBODY),
])
def test_impossible_owners_become_nobody(value: int, expected: int) -> None:
    assert owner(value) == expected


def test_unreadable_owners_in_headers_are_not_root() -> None:
    meta = ObjectMeta.from_headers({"ckptfs-uid": "root", "ckptfs-gid": "0x10"})
    assert owner(meta.uid) == NOBODY and owner(meta.gid) == NOBODY
    assert ObjectMeta.from_headers({}).uid == 0  # no metadata at all (another tool): as before


@pytest.mark.parametrize(("target", "why"), [
    ("", "empty"), (None, "empty"), ("a\0b", "NUL"), ("x" * 4096, "longer than 4095"),
    ("\udcff" * 4096, "longer than 4095"),
])
def test_bad_symlink_targets_are_refused(target: str | None, why: str) -> None:
    raw, reason = symlink_target(target)
    assert raw is None and reason is not None and why in reason


@pytest.mark.parametrize("target", ["/etc/passwd", "../../outside", "x" * 4095, "caf\udce9"])
def test_other_symlink_targets_are_kept_verbatim(target: str) -> None:
    raw, reason = symlink_target(target)
    assert reason is None and raw is not None and raw.decode(errors="surrogateescape") == target


async def test_a_fresh_node_maps_hostile_metadata_safely(
    tmp_path: Path, store: str, autojump_clock: trio.abc.Clock,
) -> None:
    objects = store_named(store)
    objects["bin/"] = _Object(b"", ObjectMeta(Kind.DIRECTORY, 0o7777, 1, 0, 0))
    objects["bin/su"] = _Object(b"x", ObjectMeta(Kind.FILE, 0o4755, 1, 0, 0))
    objects["bin/sg"] = _Object(b"x", ObjectMeta(Kind.FILE, 0o2711, 1, 2**32 - 1, -3))
    objects["bin/t"] = _Object(b"x", ObjectMeta(Kind.FILE, 0o1644, 1, 1000, 1000))
    for name, target in [("empty", ""), ("nul", "a\0b"), ("long", "y" * 4096),
                         ("abs", "/etc/shadow"), ("up", "../../../x")]:
        objects[f"links/{name}"] = _Object(
            target.encode(), ObjectMeta(Kind.SYMLINK, 0o777, 1, 0, 0, target=target))
    async with node(tmp_path / "b", store) as b:
        bin_dir = await b.resolve("bin")
        assert bin_dir.mode == stat.S_IFDIR | 0o1777
        assert (await b.resolve("bin/su")).mode == stat.S_IFREG | 0o755
        sg = await b.resolve("bin/sg")
        assert sg.mode == stat.S_IFREG | 0o711 and (sg.uid, sg.gid) == (NOBODY, NOBODY)
        t = await b.resolve("bin/t")
        assert t.mode == stat.S_IFREG | 0o644 and (t.uid, t.gid) == (1000, 1000)
        # Refused targets are not mapped at all (and listed as refused, like unsafe names);
        # the others are symlinks to exactly what the store says.
        assert await b.names("links") == ["abs", "up"]
        assert b.fs.readlink((await b.resolve("links/abs")).ino) == b"/etc/shadow"
        assert b.fs.readlink((await b.resolve("links/up")).ino) == b"../../../x"
        assert b.fs.lister is not None
        refused = {key: why for key, why in b.fs.lister.refused}
        assert "empty" in refused["links/empty"] and "NUL" in refused["links/nul"]
        assert "4095" in refused["links/long"]

        # A new version written by another node: still stripped.
        objects["bin/t"] = _Object(b"yy", ObjectMeta(Kind.FILE, 0o6777, 2, -1, 7))
        await trio.sleep(TTL + 1)
        await b.names("bin")
        t = await b.resolve("bin/t")
        assert t.size == 2 and t.mode == stat.S_IFREG | 0o777 and (t.uid, t.gid) == (NOBODY, 7)


def test_the_mount_is_nodev_and_nosuid_unless_configured() -> None:
    options = fuse_options(Config())
    assert {"nodev", "nosuid"} <= options and "suid" not in options and "dev" not in options
    options = fuse_options(Config(suid=True))
    assert {"nodev", "suid"} <= options and "nosuid" not in options


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_a_real_mount_is_nosuid_nodev_and_suid_only_when_asked(mounter: Mounter) -> None:
    plain = mounter("plain")
    entry = find(plain.path)
    assert entry is not None and {"nosuid", "nodev"} <= set(entry.options.split(","))
    asked = mounter("asked", extra=["-o", "suid"])
    entry = find(asked.path)
    assert entry is not None
    assert "nodev" in entry.options.split(",") and "nosuid" not in entry.options.split(",")
    assert status(asked)["options"]["suid"] is True
