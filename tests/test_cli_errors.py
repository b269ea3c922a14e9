"""Every bad input to the real CLI (``python -m ckptfs``) fails with one clear line.

The contract (cli.py): a user error prints exactly one line on stderr, ``ckptfs: error: ...``,
names the problem (for a config error: the key), exits non-zero, never shows a traceback, and a
failed mount leaves nothing mounted and no daemon running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import Mount, Mounter, Tmpfs, ckptfs, is_mounted

pytestmark = pytest.mark.mount


# -- helpers ------------------------------------------------------------------------------


def assert_user_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """One ``ckptfs: error:`` line on stderr naming every needle; returns that line."""
    context = f"rc={done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode != 0, context
    assert "Traceback" not in done.stdout + done.stderr, context
    lines = done.stderr.splitlines()
    assert len(lines) == 1, context
    line = lines[0]
    assert line.startswith("ckptfs: error: "), context
    for needle in needles:
        assert needle in line, f"{needle!r} not named in: {line}"
    return line


def daemons_for(mountpoint: Path) -> list[int]:
    """Pids of ``ckptfs mount`` processes (CLI or daemon) for ``mountpoint``."""
    target = os.path.abspath(mountpoint)
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "ckptfs" in argv and "mount" in argv and target in argv:
            pids.append(int(entry.name))
    return pids


def assert_nothing_left(mountpoint: Path) -> None:
    """Nothing mounted at ``mountpoint`` and no daemon for it (allowing it a moment to exit)."""
    assert not is_mounted(mountpoint), f"{mountpoint} is mounted after a failed mount"
    deadline = time.monotonic() + 5
    while daemons_for(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemons_for(mountpoint) == [], f"a ckptfs daemon for {mountpoint} is still running"


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    """An empty mountpoint; checked to be left unmounted and daemon-free after the test."""
    path = tmp_path / "mnt"
    path.mkdir()
    yield path
    try:
        assert_nothing_left(path)
    finally:
        if is_mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)


def mount_args(tmp_path: Path, mountpoint: Path, *extra: str | os.PathLike[str]) -> list[str]:
    return ["mount", str(mountpoint), "--staging", str(tmp_path / "staging"),
            "--store", str(tmp_path / "store"), "--create-store", *map(str, extra)]


def write_config(tmp_path: Path, text: str, name: str = "ckptfs.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


TIERS_OK = """
[[tier]]
name = "hot"
keep = { last = 3 }
[[tier]]
name = "warm"
url = "file:///var/tmp/ckptfs-never-used"
"""


# -- the mountpoint -----------------------------------------------------------------------


def test_mountpoint_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    done = ckptfs(*mount_args(tmp_path, missing), check=False)
    assert_user_error(done, str(missing), "does not exist")
    assert not missing.exists()
    assert_nothing_left(missing)
    assert not (tmp_path / "staging").exists(), "a failed mountpoint check created the staging"


def test_mountpoint_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    done = ckptfs(*mount_args(tmp_path, path), check=False)
    assert_user_error(done, str(path), "not a directory")
    assert path.read_text() == "x"
    assert_nothing_left(path)


def test_mountpoint_not_empty(tmp_path: Path) -> None:
    path = tmp_path / "full"
    path.mkdir()
    (path / "something").write_text("x")
    done = ckptfs(*mount_args(tmp_path, path), check=False)
    assert_user_error(done, str(path), "not empty")
    assert os.listdir(path) == ["something"]
    assert_nothing_left(path)


def test_mountpoint_already_ckptfs(tmp_path: Path, mounter: Mounter) -> None:
    m = mounter()
    (m.path / "keep.bin").write_bytes(b"still here")
    pid = m.pid
    done = ckptfs(*mount_args(tmp_path, m.path), check=False)
    assert_user_error(done, str(m.path), "already mounted", "ckptfs")
    # The existing mount is untouched and served by the same daemon.
    assert (m.path / "keep.bin").read_bytes() == b"still here"
    assert m.pid == pid
    assert daemons_for(m.path) == [pid]
    assert not (tmp_path / "staging").exists()


def test_mountpoint_already_other_mount(tmp_path: Path, tmpfs: Tmpfs) -> None:
    path = tmpfs(tmp_path / "tmpfs")
    done = ckptfs(*mount_args(tmp_path, path), check=False)
    assert_user_error(done, str(path), "already mounted", "tmpfs")
    assert is_mounted(path)
    assert daemons_for(path) == []


def test_usage_errors(tmp_path: Path, mnt: Path) -> None:
    assert_user_error(ckptfs("mount", check=False), "Missing argument")
    assert_user_error(ckptfs("mount", mnt, "--no-such-flag", check=False), "--no-such-flag")
    assert_user_error(ckptfs("no-such-command", check=False), "no-such-command")
    assert_user_error(ckptfs("umount", mnt, "--timeout", "soon", check=False), "--timeout")
    assert ckptfs("mount", "--help").returncode == 0


# -- the staging directory ----------------------------------------------------------------


@pytest.mark.parametrize("below", [False, True], ids=["root", "subdir"])
def test_staging_read_only(tmp_path: Path, mnt: Path, tmpfs: Tmpfs, below: bool) -> None:
    ro = tmpfs(tmp_path / "ro", "ro,size=1m")
    staging = ro / "staging" if below else ro
    done = ckptfs("mount", mnt, "--staging", staging, "--store", tmp_path / "store", "--create-store",
                  check=False)
    assert_user_error(done, str(staging), "not writable", "Read-only")


@pytest.mark.parametrize("below", [False, True], ids=["root", "subdir"])
def test_staging_full_disk(tmp_path: Path, mnt: Path, tmpfs: Tmpfs, below: bool) -> None:
    disk = tmpfs(tmp_path / "disk", "size=1m")
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    staging = disk / "staging" if below else disk
    done = ckptfs("mount", mnt, "--staging", staging, "--store", tmp_path / "store", "--create-store",
                  check=False)
    # The figures and the way out, also at 0 bytes free (where the write probe fails).
    assert_user_error(done, str(staging), "full disk", "KiB free", "MiB needed",
                      f"ckptfs evict --staging {staging}")


def test_staging_small_disk(tmp_path: Path, mnt: Path, tmpfs: Tmpfs) -> None:
    """Not full, but below the minimum a mount needs."""
    disk = tmpfs(tmp_path / "disk", "size=2m")
    done = ckptfs("mount", mnt, "--staging", disk, "--store", tmp_path / "store", "--create-store",
                  check=False)
    assert_user_error(done, str(disk), "full disk", "MiB needed", "ckptfs evict --staging")


def test_staging_is_a_file(tmp_path: Path, mnt: Path) -> None:
    staging = tmp_path / "staging-file"
    staging.write_text("x")
    done = ckptfs("mount", mnt, "--staging", staging, "--store", tmp_path / "store", "--create-store",
                  check=False)
    assert_user_error(done, str(staging), "not a directory")
    done = ckptfs("mount", mnt, "--staging", staging / "sub", "--store", tmp_path / "store",
                  check=False)
    assert_user_error(done, str(staging / "sub"), "Not a directory")
    assert staging.read_text() == "x"


def test_staging_in_use(tmp_path: Path, mnt: Path, mounter: Mounter) -> None:
    m = mounter()
    assert m.store is not None
    (m.path / "a").write_bytes(b"a")
    before = sorted(os.listdir(m.staging / "data"))
    done = ckptfs("mount", mnt, "--staging", m.staging, "--store", m.store, check=False)
    assert_user_error(done, str(m.staging), "in use")
    # The owner's staging directory is left alone and its mount keeps working.
    assert sorted(os.listdir(m.staging / "data")) == before
    assert (m.path / "a").read_bytes() == b"a"


# -- the config file ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("bogus_key = 1\n", "bogus_key"),
        ("[retention]\nlast = 3\n", "retention"),
        (TIERS_OK + "bogus_tier_key = 1\n", "tier.1.bogus_tier_key"),
        (TIERS_OK.replace("{ last = 3 }", "{ last = 3, lats = 4 }"), "tier.0.keep.lats"),
    ],
    ids=["top-level", "table", "tier", "keep"],
)
def test_config_unknown_key(tmp_path: Path, mnt: Path, text: str, key: str) -> None:
    config = write_config(tmp_path, text)
    done = ckptfs(*mount_args(tmp_path, mnt, "--config", config), check=False)
    assert_user_error(done, str(config), key, "unknown key")


@pytest.mark.parametrize(
    ("text", "key", "also"),
    [
        ('upload_concurrency = "many"\n', "upload_concurrency", "'many'"),
        ("upload_concurrency = 0\n", "upload_concurrency", "greater than or equal to 1"),
        ('fsync = "sometimes"\n', "fsync", "'sometimes'"),
        ('allow_other = [1]\n', "allow_other", "bool"),
        ('write_stall_timeout = "forever"\n', "write_stall_timeout", "'forever'"),
        ('staging_dir = "relative/dir"\n', "staging_dir", "absolute"),
        ("tier = 3\n", "tier", "tuple"),
        ('step_regex = "("\n', "step_regex", "regular expression"),
        (TIERS_OK.replace("last = 3", 'last = "three"'), "tier.0.keep.last", "'three'"),
        (TIERS_OK.replace("last = 3", "milestones = [2.0]"), "tier.0.keep.milestones", "2.0"),
    ],
    ids=["int", "range", "literal", "bool", "duration", "path", "tier-list", "regex",
         "keep-last", "milestone"],
)
def test_config_bad_value(tmp_path: Path, mnt: Path, text: str, key: str, also: str) -> None:
    if key != "staging_dir":
        text = f'staging_dir = "{tmp_path / "staging"}"\n' + text
    config = write_config(tmp_path, text)
    # No --staging: it would replace staging_dir from the file.
    done = ckptfs("mount", mnt, "--config", config, "--store", tmp_path / "store", "--create-store",
                  check=False)
    line = assert_user_error(done, str(config), key + ":", also)
    assert "\n" not in line


FAULTS = '\n[tier.faults]\n'


@pytest.mark.parametrize(
    ("text", "key", "also"),
    [
        ('retention_interval = "99999999999w"\n', "retention_interval", "100 years"),
        ("retention_interval = 99999999999999999\n", "retention_interval", "100 years"),
        ("node_poll_interval = 1e300\n", "node_poll_interval", "100 years"),
        ("metadata_ttl = inf\n", "metadata_ttl", "finite"),
        ("metadata_ttl = -inf\n", "metadata_ttl", "finite"),
        ("metadata_ttl = nan\n", "metadata_ttl", "finite"),
        ("write_stall_timeout = -5\n", "write_stall_timeout", "negative"),
        ("staging_min_free_ratio = nan\n", "staging_min_free_ratio", "finite"),
        (TIERS_OK.replace("last = 3", 'hourly = "99999999999w"'), "tier.0.keep.hourly",
         "100 years"),
        (TIERS_OK + "cost_per_tb_month = inf\n", "tier.1.cost_per_tb_month", "finite"),
        (TIERS_OK + FAULTS + "latency = inf\n", "tier.1.faults.latency", "finite"),
        (TIERS_OK + FAULTS + "fail_ratio = nan\n", "tier.1.faults.fail_ratio", "finite"),
    ],
    ids=["weeks-overflow", "int-overflow", "float-huge", "inf", "minus-inf", "nan", "negative",
         "ratio-nan", "keep-duration", "cost-inf", "faults-latency", "faults-ratio"],
)
def test_config_numbers_finite_and_bounded(tmp_path: Path, mnt: Path, text: str, key: str,
                                           also: str) -> None:
    """Durations are 0 .. 100 years and floats are finite: one line naming the key, never
    an OverflowError traceback (timedelta) or a mount that cannot work."""
    config = write_config(tmp_path, f'staging_dir = "{tmp_path / "staging"}"\n' + text)
    done = ckptfs("mount", mnt, "--config", config, "--store", tmp_path / "store", "--create-store",
                  check=False)
    assert_user_error(done, str(config), key + ":", also)


@pytest.mark.parametrize(
    ("option", "flag", "also"),
    [("metadata_ttl=99999999999w", "-o metadata_ttl", "100 years"),
     ("staging_min_free_ratio=nan", "-o staging_min_free_ratio", "finite"),
     ("retention_interval=inf", "-o retention_interval", "'inf'")],
)
def test_option_numbers_finite_and_bounded(tmp_path: Path, mnt: Path, option: str, flag: str,
                                           also: str) -> None:
    done = ckptfs(*mount_args(tmp_path, mnt, "-o", option), check=False)
    assert_user_error(done, flag, also)


@pytest.mark.parametrize(
    "url",
    ["ftp://x", "s3://", "file://relative", "s3://bucket/p?storage_class=FROZEN",
     "s3://bucket/p?region=x", "memory://", "/plain/path"],
)
def test_config_bad_tier_url(tmp_path: Path, mnt: Path, url: str) -> None:
    config = write_config(tmp_path, TIERS_OK.replace("file:///var/tmp/ckptfs-never-used", url))
    # No --store here: it would replace the URL under test.
    done = ckptfs("mount", mnt, "--config", config, "--staging", tmp_path / "staging",
                  check=False)
    assert_user_error(done, str(config), "tier.1.url", url)


def test_config_tier_structure(tmp_path: Path, mnt: Path) -> None:
    cases = {
        '[[tier]]\nname = "warm"\nurl = "file:///x"\n[[tier]]\nname = "x"\nurl = "file:///y"\n':
            "first tier must be 'hot'",
        '[[tier]]\nname = "hot"\n': "at least one tier besides 'hot'",
        TIERS_OK + '[[tier]]\nname = "warm"\nurl = "file:///z"\n': "unique",
        TIERS_OK + '[[tier]]\nname = "cold"\n': "tier 'cold' needs a url",
        TIERS_OK.replace('"warm"', '"no spaces allowed"'): "tier.1.name",
    }
    for text, needle in cases.items():
        config = write_config(tmp_path, text)
        done = ckptfs("mount", mnt, "--config", config, "--staging", tmp_path / "staging",
                      check=False)
        assert_user_error(done, str(config), needle)


def test_config_missing(tmp_path: Path, mnt: Path) -> None:
    config = tmp_path / "nope.toml"
    done = ckptfs(*mount_args(tmp_path, mnt, "--config", config), check=False)
    assert_user_error(done, str(config), "does not exist")
    done = ckptfs(*mount_args(tmp_path, mnt, "--config", tmp_path), check=False)
    assert_user_error(done, str(tmp_path), "is a directory")


@pytest.mark.parametrize(
    "content",
    [b"staging_dir = \n", b"[[tier]\nname = 'hot'\n", b"a = 1\na = 2\n", b"\xff\xfe = 1\n"],
    ids=["no-value", "bracket", "duplicate", "not-utf8"],
)
def test_config_invalid_toml(tmp_path: Path, mnt: Path, content: bytes) -> None:
    config = tmp_path / "bad.toml"
    config.write_bytes(content)
    done = ckptfs(*mount_args(tmp_path, mnt, "--config", config), check=False)
    assert_user_error(done, str(config), "not valid TOML")


def test_config_from_env_bad(tmp_path: Path, mnt: Path) -> None:
    config = write_config(tmp_path, "bogus_key = 1\n", "env.toml")
    env = {**os.environ, "CKPTFS_CONFIG": str(config)}
    done = ckptfs(*mount_args(tmp_path, mnt), check=False, env=env)
    assert_user_error(done, str(config), "bogus_key", "unknown key")
    env["CKPTFS_CONFIG"] = str(tmp_path / "missing.toml")
    done = ckptfs(*mount_args(tmp_path, mnt), check=False, env=env)
    assert_user_error(done, str(tmp_path / "missing.toml"), "does not exist")


def test_config_with_store_flag_bad_tiers(tmp_path: Path, mnt: Path) -> None:
    """--store patches the warm tier; a malformed tier list must still be a clean error."""
    for text, needle in [
        ("tier = [1, 2]\n", "tier.0"),
        ('[tier]\nname = "hot"\n', "tier"),
        ("tier = 3\n", "tier"),
        ('[[tier]]\nname = "hot"\n', "warm tier"),
    ]:
        config = write_config(tmp_path, text)
        done = ckptfs(*mount_args(tmp_path, mnt, "--config", config), check=False)
        assert_user_error(done, needle)


def test_cli_flag_bad_value(tmp_path: Path, mnt: Path) -> None:
    done = ckptfs(*mount_args(tmp_path, mnt, "--log-level", "loud"), check=False)
    assert_user_error(done, "--log-level", "'loud'")


# -- --store ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "needle"),
    [("ftp://x", "scheme"), ("s3://", "bucket"), ("file://relative", "absolute path"),
     ("s3://Bad_Bucket/x", "bucket"), ("", "empty")],
)
def test_store_bad_url(tmp_path: Path, mnt: Path, url: str, needle: str) -> None:
    done = ckptfs("mount", mnt, "--staging", tmp_path / "staging", "--store", url, check=False)
    line = assert_user_error(done, "--store", needle)
    if url:
        assert url in line
    assert not (tmp_path / "staging").exists()


# -- umount -------------------------------------------------------------------------------


def test_umount_not_mounted(tmp_path: Path) -> None:
    path = tmp_path / "plain"
    path.mkdir()
    assert_user_error(ckptfs("umount", path, check=False), str(path), "not mounted")


def test_umount_nonexistent(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    assert_user_error(ckptfs("umount", path, check=False), str(path), "does not exist")


def test_umount_other_fs(tmp_path: Path, tmpfs: Tmpfs) -> None:
    path = tmpfs(tmp_path / "tmpfs")
    (path / "x").write_text("x")
    assert_user_error(ckptfs("umount", path, check=False), str(path), "not a ckptfs mount",
                      "tmpfs")
    assert is_mounted(path)
    assert (path / "x").read_text() == "x"


# -- config that works --------------------------------------------------------------------


def _daemon(path: Path) -> dict[str, object]:
    info = json.loads(os.getxattr(path, "user.ckptfs.daemon"))
    assert isinstance(info, dict)
    return info


def _config(staging: Path, store: Path) -> str:
    return (
        f'staging_dir = "{staging}"\n'
        'log_level = "debug"\n'
        "upload_concurrency = 2\n"
        '[[tier]]\nname = "hot"\nkeep = { last = 2 }\n'
        f'[[tier]]\nname = "warm"\nurl = "{store.as_uri()}"\nkeep = {{ last = 5 }}\n'
    )


def _mount_raw(mounter: Mounter, path: Path, *args: str | os.PathLike[str],
               env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    """``ckptfs mount`` with exactly these args; registered with ``mounter`` for teardown."""
    mounter.mounts.append(Mount(path, Path("/nonexistent"), Path("/nonexistent")))
    done = subprocess.run(
        [sys.executable, "-m", "ckptfs", "mount", str(path), *map(str, args)],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # One line on success, naming the mount and its tiers; on stderr at most the warning
    # that a temp-dir store is on the staging directory's filesystem (not shared storage).
    assert all(line.startswith("ckptfs: warning: store ") and "not shared storage" in line
               for line in done.stderr.splitlines()), done
    assert done.stdout.startswith(f"ckptfs: {path} ready: hot "), done
    assert len(done.stdout.splitlines()) == 1, done
    assert is_mounted(path)


def test_config_file_is_used(tmp_path: Path, mnt: Path, mounter: Mounter) -> None:
    staging = tmp_path / "from-config"
    store = tmp_path / "store-from-config"
    config = write_config(tmp_path, _config(staging, store))
    _mount_raw(mounter, mnt, "--config", config, "--create-store")
    assert _daemon(mnt)["staging_dir"] == str(staging)
    (mnt / "f").write_bytes(b"data")
    assert (staging / "journal.db").exists()
    log = (staging / "daemon.log").read_text()
    assert store.as_uri() in log
    assert " DEBUG " in log, "log_level from the config file was not applied"
    ckptfs("umount", mnt)
    assert_nothing_left(mnt)


def test_cli_flags_override_config(tmp_path: Path, mnt: Path, mounter: Mounter) -> None:
    config = write_config(tmp_path, _config(tmp_path / "from-config", tmp_path / "cstore"))
    staging = tmp_path / "from-flag"
    store = tmp_path / "store-from-flag"
    _mount_raw(mounter, mnt, "--config", config, "--staging", staging, "--store", store,
               "--log-level", "warning", "--create-store")
    assert _daemon(mnt)["staging_dir"] == str(staging)
    assert not (tmp_path / "from-config").exists()
    log = (staging / "daemon.log").read_text()
    assert " INFO " not in log and " DEBUG " not in log, log
    ckptfs("umount", mnt)
    assert_nothing_left(mnt)


def test_env_config_and_relative_paths(tmp_path: Path, mnt: Path, mounter: Mounter) -> None:
    """$CKPTFS_CONFIG is used; relative paths mean the caller's cwd, not the daemon's."""
    work = tmp_path / "work"
    work.mkdir()
    staging = tmp_path / "env-staging"
    write_config(work, _config(staging, tmp_path / "env-store"), "rel.toml")
    env = {**os.environ, "CKPTFS_CONFIG": "rel.toml"}
    # A relative --store is refused (a typo must not become a directory here), not made
    # absolute against the cwd.
    refused = subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(mnt), "--store",
                              "relstore", "--create-store"], capture_output=True, text=True,
                             env=env, cwd=work, timeout=120, check=False)
    assert_user_error(refused, "'relstore'", "absolute")
    assert not (work / "relstore").exists()
    _mount_raw(mounter, mnt, "--create-store", env=env, cwd=work)
    assert _daemon(mnt)["staging_dir"] == str(staging)
    log = (staging / "daemon.log").read_text()
    assert (tmp_path / "env-store").as_uri() in log, log
    ckptfs("umount", mnt)
    assert_nothing_left(mnt)


def test_longest_durations_work(tmp_path: Path, mnt: Path, mounter: Mounter) -> None:
    """The bound is usable: 100 years (in days and in weeks) mounts and serves files."""
    staging = tmp_path / "staging"
    config = write_config(tmp_path, 'retention_interval = "36500d"\nmetadata_ttl = "5214w"\n'
                          'write_stall_timeout = 3153600000\n'
                          + _config(staging, tmp_path / "store").replace(
                              f'staging_dir = "{staging}"\n', ""))
    _mount_raw(mounter, mnt, "--config", config, "--staging", staging, "--create-store")
    (mnt / "f").write_bytes(b"data")
    assert (mnt / "f").read_bytes() == b"data"
    ckptfs("umount", mnt)
    assert (tmp_path / "store" / "f").read_bytes() == b"data"
    assert_nothing_left(mnt)


def test_seconds_flags_finite_and_bounded(tmp_path: Path, mounter: Mounter) -> None:
    """--timeout / --poll-interval inf, nan or negative: one line, not an OverflowError from a
    socket timeout (the mount is live, so the value would be used)."""
    m = mounter()
    (m.path / "f").write_bytes(b"x")
    for argv in (["sync", m.path, "--timeout", "inf"], ["sync", m.path, "--timeout", "nan"],
                 ["sync", m.path, "--timeout", "-1"],
                 ["umount", m.path, "--timeout", "1e999"],
                 ["restore", m.path / "f", "--poll-interval", "inf"],
                 ["restore", m.path / "f", "--timeout", "inf"]):
        option = next(a for a in argv if str(a).startswith("--"))
        assert_user_error(ckptfs(*argv, check=False), f"'{option}'", "number of seconds")
    assert is_mounted(m.path)
    ckptfs("sync", m.path, "--timeout", "3153600000")  # the longest still works
