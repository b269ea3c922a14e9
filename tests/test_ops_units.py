"""What an operator reads, tested without a mount: ls-tiers states, log masking, wording,
configuration spellings, tables without a terminal.
"""

from __future__ import annotations

import subprocess
import sys

from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.lifecycle.checkpoints import DEFAULT_DETECTOR, LocalFile, RemoteFile, build
from ckptfs.state.journal import State


def test_a_checkpoint_without_a_marker_wholly_on_nvme_is_held_there() -> None:
    """ls-tiers said hot "partial" for a marker-less checkpoint whose every file is committed
    on the NVMe: being complete (a marker) and being held (every file) are two questions."""
    files = [LocalFile("step_1/model.pt", 10, 5, State.COMMITTED, committed_at=100.0),
             LocalFile("step_1/optim.pt", 11, 7, State.COMMITTED, committed_at=101.0),
             LocalFile("step_2/model.pt", 12, 5, State.REMOTE, committed_at=102.0)]
    remote = {"warm": [RemoteFile("step_1/model.pt", 5), RemoteFile("step_1/optim.pt", 7),
                       RemoteFile("step_2/model.pt", 5)]}
    got = {c.name: c for c in build(files, remote, step_regex="", tier_order=["hot", "warm"],
                                    detector=DEFAULT_DETECTOR,
                                    markers=DEFAULT_COMMIT_MARKERS)}
    assert got["step_1"].busy == "no marker"
    assert got["step_1"].held == {"hot", "warm"} and not got["step_1"].partial
    assert got["step_2"].held == {"warm"} and not got["step_2"].partial  # evicted: not on NVMe


# -- wording, spellings, usage --------------------------------------------------------------


def test_counts_read_as_english_and_bytes_in_binary_units() -> None:
    from ckptfs.humanize import count, human_bytes

    assert count(1, "file") == "1 file" and count(0, "file") == "0 files"
    assert count(2, "entry", "entries") == "2 entries"
    assert human_bytes(6.3 * 2**20) == "6.3 MiB" and human_bytes(512) == "512 B"


def test_progress_columns_count_in_mib_as_status_does() -> None:
    from rich.progress import Progress

    from ckptfs.ops.cli import byte_columns

    done, rate = byte_columns()
    with Progress(disable=True) as progress:
        task_id = progress.add_task("x", total=6.3 * 2**20, completed=2**20)
        task = progress.tasks[task_id]
        assert done.render(task).plain == "1.0 MiB/6.3 MiB"
        assert rate.render(task).plain in ("?", "0 B/s")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True,
                          text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)


def test_version_after_a_command_points_to_ckptfs_version() -> None:
    done = _cli("mount", "--version")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        ("ckptfs: error: --version is not an option of 'ckptfs mount': the version is "
        "'ckptfs --version'")], done.stderr  # not "Possible options: --s3-region"


def test_usage_lines_name_arguments_without_braces() -> None:
    for command, usage in (("mount", "Usage: ckptfs mount [OPTIONS] MOUNTPOINT"),
                           ("sync", "Usage: ckptfs sync [OPTIONS] [PATH]"),
                           ("restore", "Usage: ckptfs restore [OPTIONS] PATH")):
        assert usage in _cli(command, "--help").stdout.splitlines()
    done = _cli("umount")
    assert done.stderr.startswith("ckptfs: error: Missing argument 'MOUNTPOINT'"), done.stderr


def test_log_format_takes_any_case_and_the_hot_tier_shows_no_s3_keys() -> None:
    done = _cli("config", "check", "--store", "s3://bucket/run", "--log-format", "JSON")
    assert done.returncode == 0, done.stderr
    assert 'log_format = "json"' in done.stdout.splitlines()
    hot, warm = done.stdout.split("[[tier]]")[1:3]
    assert 'name = "hot"' in hot and not any(
        key in hot for key in ("addressing_style", "part_size", "part_concurrency",
                               "endpoint_url", "region")), hot
    assert "addressing_style" in warm and "part_size" in warm, warm
