"""``ckptfs evict --staging DIR``: offline eviction, the way out of a staging disk too full to
mount (docs/OPERATIONS.md, "The staging disk is full").

Every journal and staging directory here is made by a real mount (files written through it,
uploaded, then unmounted); the offline command runs as the CLI does, as a subprocess, except
where a crash is injected in-process. After it, a mount of the same staging directory reads
the evicted files back from the store, byte for byte.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptfs.lifecycle.offline_evict import evict_offline
from ckptfs.state.staging import Staging
from tests.mounting import Mount, Mounter, Tmpfs, ckptfs, is_mounted, sync, tiers_config
from tests.payload import Payload

pytestmark = [pytest.mark.mount, pytest.mark.timeout(180)]

MiB = 1 << 20


@dataclass
class Rig:
    base: Path
    mounter: Mounter
    store: Path
    down: Path  # the store is "down" while this file exists (faults.down_file)

    def mount(self, staging: Path, **config: object) -> Mount:
        # Registered at mount: a node registers at its first change, which would wait for a
        # store that is down (docs/SEMANTICS.md).
        cfg = tiers_config(self.base / "c.toml", self.store.as_uri(),
                           faults={"down_file": self.down}, register_at_mount=True, **config)
        return self.mounter("m", staging=staging, config=cfg)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    store = tmp_path / "store"
    store.mkdir()
    mounter = Mounter(tmp_path)
    try:
        yield Rig(tmp_path, mounter, store, tmp_path / "store-down")
    finally:
        mounter.teardown()


def write(m: Mount, files: dict[str, Payload]) -> dict[str, int]:
    """Write ``files`` through the mount; their inode numbers (= data file names)."""
    inos = {}
    for rel, payload in files.items():
        (m.path / rel).parent.mkdir(parents=True, exist_ok=True)
        payload.write(m.path / rel)
        inos[rel] = os.stat(m.path / rel).st_ino
    return inos


def data_file(staging: Path, ino: int) -> Path:
    return staging / "data" / str(ino)


def offline(staging: Path, *args: str, check: bool = True) -> str:
    done = ckptfs("evict", "--staging", staging, *args, check=check)
    return done.stdout if check else done.stderr


def test_offline_evict_drops_committed_keeps_staged_and_reads_back(rig: Rig) -> None:
    staging = rig.base / "staging"
    m = rig.mount(staging)
    committed = {"step_100/shard_0.distcp": Payload(1, 3 * MiB + 5),
                 "step_100/.metadata": Payload(2, 4000),
                 "step_200/shard_0.distcp": Payload(3, 2 * MiB + 7)}
    inos = write(m, committed)
    moved_ino = write(m, {"old/x": Payload(6, 70_000)})["old/x"]
    sync(m)
    assert {m.state(rel) for rel in committed} == {"committed"}
    # A file closed while the store is down: staged, never uploaded. It must keep its data.
    rig.down.touch()
    staged = {"step_300/shard_0.distcp": Payload(4, MiB + 3)}
    staged_ino = write(m, staged)["step_300/shard_0.distcp"]
    assert m.state("step_300/shard_0.distcp") in ("staged", "uploading")
    # A committed file renamed meanwhile: its store copy is still at the old key. It keeps
    # its data until the move is done (the uploader's fallback if the old key is gone).
    (m.path / "new").mkdir()
    os.rename(m.path / "old/x", m.path / "new/y")
    assert m.state("new/y") == "committed"
    ckptfs("umount", m.path, "--no-wait")  # the staged file stays for the next mount
    assert not is_mounted(m.path)
    assert all(data_file(staging, ino).exists() for ino in inos.values())

    # A dry run says what would go and changes nothing.
    out = offline(staging, "--dry-run")
    assert "would evict 3 files" in out, out
    # What is free now and what would be after, not the one as if it were the other.
    assert re.search(r" free on the staging filesystem now, [\d.]+ [KMG]iB after$", out,
                     re.MULTILINE), out
    dry = evict_offline(staging, "", dry_run=True)
    assert dry.free_bytes == dry.free_before + dry.freed_bytes and dry.freed_bytes > 0
    assert all(data_file(staging, ino).exists() for ino in inos.values())

    # A prefix limits it to one checkpoint.
    out = offline(staging, "step_200")
    assert out.startswith("evicted 1 file, freed 2.0 MiB"), out
    assert not data_file(staging, inos["step_200/shard_0.distcp"]).exists()
    assert data_file(staging, inos["step_100/shard_0.distcp"]).exists()

    out = offline(staging)
    assert out.startswith("evicted 2 files, freed 3.0 MiB"), out
    assert "kept 2 files on the NVMe:" in out, out
    assert "step_300/shard_0.distcp: staged, not committed to the store yet" in out, out
    assert "new/y: committed, but renamed since" in out, out
    assert not any(data_file(staging, ino).exists() for ino in inos.values())
    assert Payload(4, MiB + 3).check_file(data_file(staging, staged_ino)) is None
    assert data_file(staging, moved_ino).exists()

    # Mounted again: the evicted files are remote and read back from the store; the staged
    # one is uploaded once the store is back.
    rig.down.unlink()
    m.remount()
    for rel, payload in committed.items():
        assert m.state(rel) == "remote", rel
        assert payload.check_file(m.path / rel) is None, rel
    sync(m)
    assert staged["step_300/shard_0.distcp"].check_file(
        rig.store / "step_300/shard_0.distcp") is None
    assert m.state("step_300/shard_0.distcp") == "committed"
    assert Payload(6, 70_000).check_file(rig.store / "new/y") is None
    assert not (rig.store / "old/x").exists()


def test_a_mounted_staging_directory_is_refused(rig: Rig) -> None:
    staging = rig.base / "staging"
    m = rig.mount(staging)
    inos = write(m, {"a": Payload(5, 100_000)})
    sync(m)
    err = offline(staging, check=False)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "is mounted" in lines[0] and f"pid {m.pid}" in lines[0], err
    assert "ckptfs evict MOUNTPOINT/PATH" in lines[0], err
    done = ckptfs("evict", "--staging", staging, "--dry-run", check=False)
    assert done.returncode != 0 and "is mounted" in done.stderr
    assert data_file(staging, inos["a"]).exists()
    assert m.state("a") == "committed"


def test_not_a_staging_directory_is_one_line(tmp_path: Path) -> None:
    done = ckptfs("evict", "--staging", tmp_path / "nope", check=False)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "not a ckptfs staging directory" in done.stderr
    assert not (tmp_path / "nope").exists()  # nothing created by a typo


def test_a_crash_between_journal_and_unlinks_is_finished_by_the_next_run(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    staging = rig.base / "staging"
    m = rig.mount(staging)
    files = {f"step_1/shard_{i}": Payload(10 + i, 300_000 + i) for i in range(3)}
    inos = write(m, files)
    sync(m)
    m.umount()

    # The process dies after the first unlink, after the journal said REMOTE (durably) and
    # the data files went into the trash.
    real_remove = Staging.remove_trashed

    def dying_remove(paths: list[Path]) -> None:
        real_remove(paths[:1])
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(Staging, "remove_trashed", staticmethod(dying_remove))
    with pytest.raises(KeyboardInterrupt):
        evict_offline(staging)
    monkeypatch.undo()
    assert not any(data_file(staging, ino).exists() for ino in inos.values())
    assert len(list((staging / "trash").iterdir())) == 2

    # The lock died with it; the next run removes what is left in the trash.
    done = evict_offline(staging)
    assert done.evicted_files == 2 and not done.kept
    assert not list((staging / "trash").iterdir())
    m.remount()
    for rel, payload in files.items():
        assert m.state(rel) == "remote", rel
        assert payload.check_file(m.path / rel) is None, rel


def test_full_staging_disk_cannot_mount_until_evicted_offline(
        tmpfs: Tmpfs, rig: Rig) -> None:
    # A 48 MiB staging filesystem the daemon may fill (no free-space reserve).
    staging = tmpfs(rig.base / "staging", "size=48m,mode=0700")
    m = rig.mount(staging, staging_min_free_ratio=0.0)
    files = {f"step_1/shard_{i}.distcp": Payload(20 + i, 12 * MiB + i) for i in range(3)}
    write(m, files)
    sync(m)
    m.umount()
    st = os.statvfs(staging)
    assert st.f_bavail * st.f_frsize < 16 * MiB

    refused = ckptfs("mount", m.path, "--staging", staging, "--config", m.config or "",
                     check=False)
    assert refused.returncode != 0, refused
    assert "at least 16 MiB needed" in refused.stderr, refused.stderr
    assert not is_mounted(m.path)

    # Not a byte left (something else filled the disk): SQLite cannot even open the journal.
    # One line saying so and what to do; nothing changed.
    filler = staging / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError:
            pass
    err = offline(staging, check=False)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "KiB free" in err and "run this again" in err, err
    assert len(list((staging / "data").iterdir())) == len(files)
    filler.unlink()

    out = offline(staging)
    assert out.startswith("evicted 3 files, freed 36.0 MiB"), out
    assert "still too full" not in out, out
    m.remount()
    for rel, payload in files.items():
        assert m.state(rel) == "remote", rel
        assert payload.check_file(m.path / rel) is None, rel
    m.umount()


def test_fetched_parts_of_a_remote_file_are_dropped(rig: Rig) -> None:
    staging = rig.base / "staging"
    m = rig.mount(staging, fetch_block_size=MiB, readahead_bytes=0)
    payload = Payload(30, 4 * MiB + 11)
    ino = write(m, {"step_1/big": payload})["step_1/big"]
    sync(m)
    ckptfs("evict", m.path / "step_1")  # online: remote, no local data
    assert not data_file(staging, ino).exists()
    with open(m.path / "step_1/big", "rb") as f:  # one block fetched back
        assert f.read(100) == payload.data()[:100]
    assert m.state("step_1/big") == "remote"
    assert 0 < os.stat(data_file(staging, ino)).st_blocks * 512 < 4 * MiB
    m.umount()

    out = offline(staging)
    assert out.startswith("evicted 1 file, freed "), out
    assert not data_file(staging, ino).exists()
    m.remount()
    assert m.state("step_1/big") == "remote"
    assert payload.check_file(m.path / "step_1/big") is None
