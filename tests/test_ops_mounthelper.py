"""mount(8) integration (mount/, ckptfs/ops/mounthelper.py): options, fstab, the installed helper.

The option parsing is tested directly; then the real thing: a temporary fstab file mounted
with ``mount -T FILE DIR`` (which runs the installed /sbin/mount.ckptfs) and unmounted with
``umount``. The helper is installed by scripts/install.sh (mount/install.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfs.errors import UserError
from ckptfs.fuse.mountinfo import find
from ckptfs.ops.mounthelper import (
    format_option,
    mount_command,
    parse_helper_args,
    parse_options,
    split_options,
)
from tests.mounting import ckptfs, is_mounted, wait_dead

ROOT = Path(__file__).resolve().parent.parent
HELPER = Path("/sbin/mount.ckptfs")


# -- option parsing -----------------------------------------------------------------------


def test_options_map_to_config_keys_and_generic_ones_are_ignored() -> None:
    parsed = parse_options([
        ("defaults,rw,auto,noauto,_netdev,nofail,x-systemd.requires-mounts-for=/nvme,"
        "x-systemd.after=network-online.target,comment=systemd.automount,nosuid,nodev,noatime"),
        "config=/etc/ckptfs/ckpt.toml,staging=/nvme/ckptfs,upload_concurrency=8,allow_other",
        'fsync=remote,step_regex="step(\\d+),x"',
    ])
    assert parsed.config == Path("/etc/ckptfs/ckpt.toml")
    assert parsed.overrides == {
        "staging_dir": "/nvme/ckptfs", "upload_concurrency": "8", "allow_other": True,
        "fsync": "remote", "step_regex": "step(\\d+),x", "suid": False,  # from nosuid
        "read_only": False,  # from rw
    }
    assert "_netdev" in parsed.ignored and "nofail" in parsed.ignored
    assert "nodev" in parsed.ignored  # always nodev


def test_suid_and_nosuid_set_the_suid_key_and_dev_is_refused(tmp_path: Path) -> None:
    assert parse_options(["defaults"]).overrides == {}  # defaults turns neither suid nor dev on
    assert parse_options(["suid"]).overrides == {"suid": True}
    assert parse_options(["ckptfs.suid"]).overrides == {"suid": True}  # what mount(8) passes
    assert parse_options(["ckptfs.nosuid"]).overrides == {"suid": False}
    with pytest.raises(UserError, match="contradict"):
        parse_options(["nosuid,ckptfs.suid"])
    assert parse_options(["suid,nosuid"]).overrides == {"suid": False}  # the last one wins
    assert parse_options(["nosuid", "suid=true"]).overrides == {"suid": "true"}
    with pytest.raises(UserError, match="'dev': ckptfs always mounts nodev"):
        parse_options(["defaults,dev"])
    # An explicit nosuid wins over the config file's suid = true.
    config = tmp_path / "c.toml"
    config.write_text("suid = true\n")
    command = mount_command(parse_helper_args(
        [str(tmp_path), "/ckpt", "-o", f"config={config},nosuid"]))
    assert command[-2:] == ["-o", "suid=false"]
    from ckptfs.config import load_config

    assert load_config(config, {"suid": "false"}).suid is False
    assert load_config(config, {}).suid is True


@pytest.mark.parametrize(("options", "needle"), [
    ("bogus=1", "unknown mount option 'bogus'"),
    ("upload_concurrency", "'upload_concurrency' needs a value"),
    ("sync", "fsync=remote"),
    ("dev", "nodev"),
    ("secret_access_key=abc", "credentials"),
    ("access_key_id=abc", "credentials"),
    ("config=", "needs a file"),
    ('step_regex="(\\d+)', "unbalanced"),
    ("tier=x", "unknown mount option 'tier'"),
])
def test_bad_options_are_refused_with_their_name(options: str, needle: str) -> None:
    with pytest.raises(UserError, match=None) as info:
        parse_options([options])
    assert needle in str(info.value)


def test_sloppy_ignores_unknown_options() -> None:
    assert parse_options(["bogus=1,upload_concurrency=2"], sloppy=True).overrides == {
        "upload_concurrency": "2"}


def test_split_and_format_round_trip() -> None:
    for key, value in [("a", "x,y"), ("b", "plain"), ("c", True)]:
        assert split_options(format_option(key, value)) == [
            f"{key}={str(value).lower() if isinstance(value, bool) else value}"]


def test_helper_args_as_mount_passes_them(tmp_path: Path) -> None:
    args = parse_helper_args(["s3://b-1/run", "/ckpt", "-sfnv", "-o", "upload_concurrency=2",
                              "-t", "ckptfs"])
    assert (args.source, args.mountpoint, args.options) == ("s3://b-1/run", "/ckpt",
                                                           ["upload_concurrency=2"])
    assert args.fake and args.verbose and args.sloppy
    # mount -r is -o ro (a read-only mount), which an explicit -o rw overrides.
    assert parse_helper_args(["src", "/ckpt", "-r"]).options == ["ro"]
    assert parse_options(parse_helper_args(["src", "/ckpt", "-r"]).options).overrides == {
        "read_only": True}
    assert parse_options(parse_helper_args(
        ["src", "/ckpt", "-r", "-o", "rw"]).options).overrides == {"read_only": False}
    with pytest.raises(UserError, match="SOURCE and DIR"):
        parse_helper_args(["/ckpt"])


def test_mount_command(tmp_path: Path) -> None:
    store = tmp_path / "store"
    args = parse_helper_args([str(store), str(tmp_path / "mnt"), "-o",
                              f"_netdev,staging_dir={tmp_path / 'st'},metadata_ttl=2s"])
    command = mount_command(args)
    assert command[:4] == [sys.executable, "-m", "ckptfs", "mount"]
    assert command[4:] == [str(tmp_path / "mnt"), "--store", str(store),
                           "-o", f"staging_dir={tmp_path / 'st'}", "-o", "metadata_ttl=2s"]
    # "none" takes the warm tier from the config file
    config = tmp_path / "c.toml"
    config.write_text('[[tier]]\nname = "hot"\n[[tier]]\nname = "warm"\nurl = "file:///x"\n')
    command = mount_command(parse_helper_args(["none", "/ckpt", "-o", f"config={config}"]))
    assert "--store" not in command and command[-2:] == ["--config", str(config)]


def _helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptfs.ops.mounthelper", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


@pytest.mark.parametrize(("options", "needle"), [
    ("upload_concurrency=0", "mount option upload_concurrency"),
    ("fsync=sometimes", "mount option fsync"),
    ("unknown_key=1", "unknown mount option 'unknown_key'"),
    ("config=/nonexistent/ckptfs.toml", "/nonexistent/ckptfs.toml"),
])
def test_helper_errors_are_one_line(tmp_path: Path, options: str, needle: str) -> None:
    done = _helper(str(tmp_path), str(tmp_path), "-o", options)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mount.ckptfs: error: "), done.stderr
    assert needle in lines[0]


def test_bad_source_is_named(tmp_path: Path) -> None:
    done = _helper("ftp://nope", str(tmp_path))
    assert done.returncode != 0 and "SOURCE" in done.stderr and len(done.stderr.splitlines()) == 1


def test_ckptfs_mount_takes_the_same_options(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    done = ckptfs("mount", tmp_path / "mnt", "-o", "upload_concurrency=0", check=False)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "-o upload_concurrency" in lines[0], done.stderr


def test_example_config_is_valid() -> None:
    from ckptfs.config import load_config

    config = load_config(ROOT / "mount" / "ckptfs.toml")
    assert config.warm.url == "s3://my-bucket/run1"


# -- the real mount(8) --------------------------------------------------------------------


@pytest.fixture
def fstab_mount(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mount -T needs root")
    if not HELPER.exists() or "ckptfs.ops.mounthelper" not in HELPER.read_text():
        pytest.fail(f"{HELPER} is not installed: run scripts/install.sh (or mount/install.sh)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        yield mnt
    finally:
        if is_mounted(mnt):
            subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_fstab_line_mounts_with_mount_T_and_options_take_effect(
        tmp_path: Path, fstab_mount: Path) -> None:
    mnt, store, staging = fstab_mount, tmp_path / "store", tmp_path / "staging"
    store.mkdir()
    config = tmp_path / "ckptfs.toml"
    config.write_text('log_level = "debug"\nfsync = "remote"\n')
    fstab = tmp_path / "fstab"
    options = ",".join([
        "defaults", "rw", "noauto", "_netdev", "nofail",
        "x-systemd.requires-mounts-for=/tmp", "x-systemd.after=network-online.target",
        f"config={config}", f"staging_dir={staging}", "upload_concurrency=3",
    ])
    fstab.write_text(f"# a test fstab\n{store}  {mnt}  ckptfs  {options}  0  0\n")
    done = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert is_mounted(mnt)
    status = json.loads(ckptfs("status", "--json", mnt).stdout)
    assert status["staging_dir"] == str(staging)
    assert status["warm_tier"] == store.as_uri()
    assert status["options"]["upload_concurrency"] == 3  # from the fstab options
    assert status["options"]["fsync"] == "remote"  # from config=
    entry = find(mnt)  # nosuid and nodev by default, though fstab said "defaults"
    assert entry is not None and {"nosuid", "nodev"} <= set(entry.options.split(","))
    assert (staging / "daemon.log").read_text().count(" DEBUG ") > 0  # from config=
    (mnt / "step_1").mkdir()
    (mnt / "step_1" / "model.pt").write_bytes(b"x" * 1000)
    ckptfs("sync", mnt)
    assert (store / "step_1" / "model.pt").read_bytes() == b"x" * 1000
    pid = status["pid"]
    done = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert not is_mounted(mnt)
    wait_dead(pid, timeout=60)  # the daemon exits after umount


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_fstab_line_with_a_bad_option_fails_with_one_line(
        tmp_path: Path, fstab_mount: Path) -> None:
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{tmp_path}  {fstab_mount}  ckptfs  _netdev,upload_concurency=3  0  0\n")
    done = subprocess.run(["mount", "-T", str(fstab), str(fstab_mount)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        ("mount.ckptfs: error: unknown mount option 'upload_concurency' "
        "(did you mean 'upload_concurrency'?) (see docs/CONFIGURATION.md)")], done.stderr
    assert not is_mounted(fstab_mount)


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_fstab_asks_for_set_id_bits_with_ckptfs_suid(tmp_path: Path, fstab_mount: Path) -> None:
    """mount(8) keeps ``suid`` and ``dev`` (its defaults) and passes ``nosuid`` and
    ``nodev`` first: ``ckptfs.suid`` is how an fstab line asks for set-id bits."""
    mnt, store, staging = fstab_mount, tmp_path / "store", tmp_path / "staging"
    store.mkdir()
    fstab = tmp_path / "fstab"

    def mount(options: str) -> subprocess.CompletedProcess[str]:
        fstab.write_text(f"{store}  {mnt}  ckptfs  {options},staging_dir={staging}  0  0\n")
        return subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True,
                              text=True, timeout=120, check=False)

    def flags() -> set[str]:
        entry = find(mnt)
        assert entry is not None
        return set(entry.options.split(","))

    def umount() -> None:
        pid = json.loads(ckptfs("status", "--json", mnt).stdout)["pid"]
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)
        wait_dead(pid, timeout=60)

    done = mount("defaults,ckptfs.suid")
    assert done.returncode == 0, done.stderr
    assert "nosuid" not in flags() and "nodev" in flags(), flags()  # set-id bits honoured
    assert json.loads(ckptfs("status", "--json", mnt).stdout)["options"]["suid"] is True
    umount()
    # suid and dev never reach the helper: the mount stays nosuid and nodev, as documented.
    done = mount("defaults,suid,dev")
    assert done.returncode == 0, done.stderr
    assert {"nosuid", "nodev"} <= flags(), flags()
    assert json.loads(ckptfs("status", "--json", mnt).stdout)["options"]["suid"] is False
    umount()
    done = mount("nosuid,ckptfs.suid")
    assert done.returncode != 0 and not is_mounted(mnt)
    assert done.stderr.splitlines() == [
        ("mount.ckptfs: error: mount options 'ckptfs.suid' and 'nosuid' contradict each other "
        "(and mount(8) does not keep their order): give one")], done.stderr


def test_install_script_installs_under_destdir(tmp_path: Path) -> None:
    env = {**os.environ, "DESTDIR": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "mount" / "install.sh")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    helper = tmp_path / "sbin" / "mount.ckptfs"
    assert os.access(helper, os.X_OK)
    assert "@PYTHON@" not in helper.read_text()
    assert (tmp_path / "etc/systemd/system/ckptfs@.service").exists()
    assert (tmp_path / "usr/share/doc/ckptfs/examples/ckptfs.toml").exists()
    # the installed helper works (-f: check everything, mount nothing)
    done = subprocess.run([str(helper), str(tmp_path), str(tmp_path), "-f", "-o",
                           "_netdev,upload_concurrency=2"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr
    shutil.rmtree(tmp_path / "sbin")
