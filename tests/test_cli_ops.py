"""Operator experience of the CLI: ``ckptfs config check``, "did
you mean" for unknown keys, the S3 flags of ``mount``, the log file (rotation, JSON lines,
redaction, mode 0600), and registration tokens that ``nodes``/``status`` never show.

Parsing and formatting are tested in this process; the CLI contract (one line, non-zero exit)
through the real command; one real mount checks the log file and ``nodes --json`` end to end.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from ckptfs.cluster.coordination import NODE_TOKEN_FILE
from ckptfs.config import format_duration, load_config, parse_duration, to_toml
from ckptfs.errors import UserError
from ckptfs.ops.cli import _JsonRedacting, _log_handler
from ckptfs.ops.mounthelper import mount_command, parse_helper_args, parse_options
from tests.mounting import Mounter, ckptfs, status
from tests.test_cli_errors import assert_nothing_left, assert_user_error

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY/s3cr3t"

# -- ckptfs config check ------------------------------------------------------------------


def test_config_check_prints_the_effective_config_that_loads_back(tmp_path: Path) -> None:
    config = tmp_path / "ckptfs.toml"
    config.write_text(
        'staging_dir = "/nvme/ckptfs"\nretention_interval = "90s"\ncheckpoint_settle = "off"\n'
        'total_steps = 1000\n'
        '[[tier]]\nname = "hot"\nkeep = { last = 2 }\n'
        '[[tier]]\nname = "warm"\nurl = "s3://bucket/run"\n'
        f'access_key_id = "AKIDCHECKME"\nsecret_access_key = "{SECRET}"\n'
        'keep = { milestones = [0.5, 1.0], daily = "7d" }\n'
        '[[tier]]\nname = "cold"\nurl = "file:///lustre/ckpt"\nkeep = {}\n'
        'faults = { latency = "50ms", down_file = "/tmp/down" }\n')
    done = ckptfs("config", "check", "-c", config, "--s3-endpoint", "http://minio:9000",
                  "--s3-addressing-style", "path", "-o", "upload_concurrency=7,log_format=json")
    assert done.returncode == 0 and done.stderr == "", done
    out = done.stdout
    assert SECRET not in out and "AKIDCHECKME" not in out
    assert 'secret_access_key = "***"' in out and 'access_key_id = "***"' in out
    for line in ('upload_concurrency = 7', 'log_format = "json"', 'retention_interval = "90s"',
                 'checkpoint_settle = "off"', 'endpoint_url = "http://minio:9000"',
                 'addressing_style = "path"', "keep = {}", "# node_id = (not set)"):
        assert line in out.splitlines(), (line, out)
    # What it printed is a config file that means the same (but for the hidden credentials).
    again = tmp_path / "again.toml"
    again.write_text(out.replace('"***"', '"hidden"'))
    expected = load_config(config, {"s3_endpoint": "http://minio:9000",
                                    "s3_addressing_style": "path", "upload_concurrency": "7",
                                    "log_format": "json"})
    loaded = load_config(again)
    hide = {"tier": {i: {"access_key_id", "secret_access_key"} for i in range(3)}}
    assert loaded.model_dump(exclude=hide) == expected.model_dump(exclude=hide)


@pytest.mark.parametrize(("text", "needles"), [
    ('staging_dri = "/nvme"\n', ["staging_dri: unknown key (did you mean 'staging_dir'?)"]),
    ('[[tier]]\nname = "hot"\n[[tier]]\nname = "warm"\nurl = "s3://b-1/p"\nendpiont = "x"\n',
     ["tier.1.endpiont: unknown key (did you mean 'endpoint_url'?)"]),
    ("log_max_bytes = 1000\n", ["log_max_bytes", "greater than or equal to 1048576"]),
    ("log_backups = 0\n", ["log_backups", "greater than or equal to 1"]),
    ('log_file = "ckptfs.log"\n', ["log_file: must be an absolute path"]),
    ('log_format = "xml"\n', ["log_format", "'text' or 'json'"]),
    ("unrelated_thing = 1\n", ["unrelated_thing: unknown key"]),
])
def test_config_check_refuses_a_bad_file_in_one_line(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    config = tmp_path / "ckptfs.toml"
    config.write_text(text)
    line = assert_user_error(ckptfs("config", "check", "-c", config, check=False), *needles)
    if "unrelated" in text:
        assert "did you mean" not in line  # nothing close: no guess


@pytest.mark.parametrize(("flags", "needles"), [
    (["--s3-endpoint", "minio:9000", "--store", "s3://b-1/p"],
     ["--s3-endpoint", "http:// or https://"]),
    (["--s3-region", "eu-west-3"], ["--s3-region: the warm tier is file://", "not an s3://"]),
    (["--log-format", "yaml"], ["--log-format"]),
    (["-o", "log_backups=many"], ["-o log_backups"]),
    (["-o", "s3_adressing_style=path"], ["did you mean 's3_addressing_style'?"]),
])
def test_config_check_names_the_bad_flag(flags: list[str], needles: list[str]) -> None:
    assert_user_error(ckptfs("config", "check", *flags, check=False), *needles)


@pytest.mark.parametrize("text", ["0ms", "50ms", "1500ms", "90s", "10m", "36h", "7d", "8w"])
def test_durations_print_as_they_read(text: str) -> None:
    assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)
    assert format_duration(parse_duration("1.5s")) == "1500ms"
    assert format_duration(parse_duration("120m")) == "2h"


def test_legacy_step_regex_prints_without_the_default_pattern() -> None:
    config = load_config(None, {"step_regex": r"(\d+)"})
    text = to_toml(config)
    assert "# checkpoint_pattern = (not set)" in text and 'step_regex = "(\\\\d+)"' in text


# -- S3 settings as mount flags and fstab options -----------------------------------------


def test_s3_mount_options_reach_the_warm_tier_and_the_mount_command(tmp_path: Path) -> None:
    options = ("s3_endpoint=http://ceph:7480,s3_region=default,s3_profile=ckpt,"
               "s3_addressing_style=path")
    parsed = parse_options([options])
    config = load_config(None, {"store": "s3://bucket/run", **parsed.overrides})
    warm = config.warm
    assert (warm.endpoint_url, warm.region, warm.profile, warm.addressing_style) == (
        "http://ceph:7480", "default", "ckpt", "path")
    options = "_netdev,s3_endpoint=http://ceph:7480,s3_addressing_style=path"
    command = mount_command(parse_helper_args(["s3://bucket/run", str(tmp_path), "-o", options]))
    assert command[-4:] == ["-o", "s3_endpoint=http://ceph:7480", "-o",
                            "s3_addressing_style=path"]
    with pytest.raises(UserError, match="mount option s3_addressing_style: Input should be"):
        mount_command(parse_helper_args(["s3://bucket/run", str(tmp_path), "-o",
                                         "s3_addressing_style=dns"]))


def test_mount_with_a_bad_s3_flag_fails_in_one_line(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = ckptfs("mount", mnt, "--staging", tmp_path / "st", "--store", "s3://bucket/p",
                  "--s3-addressing-style", "dns", check=False)
    assert_user_error(done, "--s3-addressing-style", "'auto', 'path' or 'virtual'")
    assert_nothing_left(mnt)


# -- logs ---------------------------------------------------------------------------------


def _record(message: str, *args: object, exc: bool = False,
            logger: str = "ckptfs.engine.upload") -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError(f"boom with {SECRET}")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.LogRecord(logger, logging.WARNING, __file__, 1, message, args, exc_info)


def test_json_log_lines_are_objects_with_credentials_redacted() -> None:
    formatter = _JsonRedacting([SECRET])
    line = formatter.format(_record('upload of "step_1/a" failed: %s\nsecond line', "Denied"))
    assert "\n" not in line
    event = json.loads(line)
    assert set(event) == {"time", "level", "logger", "message"}
    assert event["level"] == "WARNING" and event["logger"] == "ckptfs.engine.upload"
    assert event["message"] == 'upload of "step_1/a" failed: Denied\nsecond line'
    assert event["time"].endswith("Z") and "T" in event["time"]
    # The AWS SDK's records (request headers at debug) are masked, tracebacks included.
    sdk = json.loads(formatter.format(_record("headers %s", {"Authorization": SECRET},
                                              exc=True, logger="botocore.endpoint")))
    assert "***" in sdk["message"] and "RuntimeError: boom with ***" in sdk["exception"]
    assert SECRET not in json.dumps(sdk)


def test_the_log_file_rotates_at_log_max_bytes_and_keeps_log_backups(tmp_path: Path) -> None:
    path = tmp_path / "ckptfs.log"
    config = load_config(None, {"log_file": str(path), "log_max_bytes": str(1024**2),
                                "log_backups": "2"})
    handler = _log_handler(config)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("test_cli_ops.rotation")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for _ in range(4 * 1024):  # 4 MiB: three rotations
            logger.warning("x" * 1023)
    finally:
        logger.removeHandler(handler)
        handler.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckptfs.log", "ckptfs.log.1", "ckptfs.log.2"], names
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 1024**2
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p  # the new file after a rotation too


def test_a_log_file_that_cannot_be_opened_fails_the_mount_in_one_line(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = ckptfs("mount", mnt, "--staging", tmp_path / "st", "--store", tmp_path / "store",
                  "--create-store", "--log-file", tmp_path / "no-such-dir" / "ckptfs.log",
                  check=False)
    assert_user_error(done, "log_file", "no-such-dir", "No such file or directory")
    assert_nothing_left(mnt)


def test_a_log_file_inside_the_mount_is_refused(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = ckptfs("mount", mnt, "--staging", tmp_path / "st", "--store", tmp_path / "store",
                  "--create-store", "-o", f"log_file={mnt}/logs/ckptfs.log", check=False)
    assert_user_error(done, "log_file", "is inside the mount")
    assert_nothing_left(mnt)
    assert not (mnt / "logs").exists()


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_a_mount_logs_json_to_its_file_and_nodes_never_show_the_token(
    mounter: Mounter, tmp_path: Path
) -> None:
    log = tmp_path / "logs" / "ckptfs.log"
    log.parent.mkdir()
    m = mounter(extra=["--log-file", str(log), "--log-format", "json",
                       "-o", "register_at_mount"])
    token = (m.staging / NODE_TOKEN_FILE).read_text().strip()
    assert len(token) >= 16
    reply = json.loads(ckptfs("nodes", m.path, "--json").stdout)
    node = status(m)["node"]["node"]
    assert [n["node"] for n in reply["nodes"]] == [node]
    assert all("token" not in n for n in reply["nodes"])
    for args in (("nodes", m.path, "--json"), ("nodes", m.path), ("status", m.path, "--json"),
                 ("status", m.path)):
        assert token not in ckptfs(*args).stdout, args
    m.umount()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events, "nothing logged"
    assert all({"time", "level", "logger", "message"} <= set(e) for e in events)
    assert any(e["logger"].startswith("ckptfs") for e in events)
    assert token not in log.read_text()
    # Nothing went to the staging directory's log but what is not a log record.
    daemon_log = m.staging / "daemon.log"
    assert not daemon_log.exists() or not daemon_log.read_text().strip(), \
        daemon_log.read_text()
    assert os.path.exists(log)
