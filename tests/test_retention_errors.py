"""Bad retention policies through the real CLI: one ``ckptfs: error:`` line naming the key,
a non-zero exit code, no traceback; a mount with such a policy leaves nothing mounted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mounting import ckptfs, is_mounted
from tests.s3server import free_port
from tests.test_cli_errors import assert_user_error

WARM = """
[[tier]]
name = "hot"
keep = { last = 2 }

[[tier]]
name = "warm"
url = "file://STORE"
keep = KEEP
"""


def policy(tmp_path: Path, keep: str = "{ last = 3 }", top: str = "", extra: str = "") -> Path:
    staging = tmp_path / "staging"
    text = f'staging_dir = "{staging}"\n{top}\n' + WARM.replace("STORE", str(tmp_path / "store")) \
        .replace("KEEP", keep) + extra
    path = tmp_path / "ckptfs.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("keep", "top", "needles"), [
    ("{ last = 3, monthly = \"12m\" }", "", ["tier.1.keep.monthly", "unknown key"]),
    ("{ last = -1 }", "", ["tier.1.keep.last", "greater than or equal to 0"]),
    ("{ hourly = \"-1h\" }", "", ["tier.1.keep.hourly"]),
    ("{ daily = \"often\" }", "", ["tier.1.keep.daily", "'often'"]),
    ("{ milestones = [0.5, 1.0] }", "", ["tier.1.keep.milestones", "total_steps"]),
    ("{ milestones = [0.0] }", "total_steps = 100", ["tier.1.keep.milestones", "0.0"]),
    ("{ last = 2 }", "total_steps = -5", ["total_steps", "greater than or equal to 1"]),
    ("{ last = 2 }", "step_regex = \"step\"", ["step_regex", "capturing group"]),
    ("{ last = 2 }", "checkpoint_pattern = 'step(\\d+)'", ["checkpoint_pattern", "named group"]),
    ("{ last = 2 }", "retention_lease = \"2s\"", ["retention_lease", "at least 3s"]),
    ("3", "", ["tier.1.keep"]),
])
@pytest.mark.parametrize("command", [["retention", "--plan"], ["ls-tiers"]])
def test_bad_policy_is_one_line_naming_the_key(
        tmp_path: Path, keep: str, top: str, needles: list[str], command: list[str]) -> None:
    config = policy(tmp_path, keep, top)
    assert_user_error(ckptfs(*command, "--config", config, check=False), *needles)


def test_same_store_twice(tmp_path: Path) -> None:
    extra = f'\n[[tier]]\nname = "cold"\nurl = "file://{tmp_path / "store"}/"\n'
    config = policy(tmp_path, extra=extra)
    assert_user_error(ckptfs("retention", "--config", config, check=False),
                      "tier.2.url", "same store as tier 'warm'")


def test_unreachable_colder_tier(tmp_path: Path) -> None:
    # Nothing listens on this port: connection refused, quickly.
    extra = (f'\n[[tier]]\nname = "cold"\nurl = "s3://bucket/run?storage_class=GLACIER"\n'
             f'endpoint_url = "http://127.0.0.1:{free_port()}"\n')
    config = policy(tmp_path, extra=extra)
    for command in (["retention", "--apply"], ["ls-tiers", "--json"]):
        assert_user_error(ckptfs(*command, "--config", config, check=False),
                          "tier.2.url (cold)", "cannot be reached")


@pytest.mark.mount
def test_mount_with_unreachable_colder_tier_fails_fast(tmp_path: Path) -> None:
    extra = (f'\n[[tier]]\nname = "cold"\nurl = "s3://bucket/run"\n'
             f'endpoint_url = "http://127.0.0.1:{free_port()}"\n')
    config = policy(tmp_path, extra=extra)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = ckptfs("mount", mnt, "--config", config, "--create-store", check=False)
    try:
        assert_user_error(done, "tier.2.url (cold)", "cannot be reached")
        assert not is_mounted(mnt)
    finally:
        if is_mounted(mnt):
            ckptfs("umount", mnt, "--no-wait", check=False)


def test_not_a_mount(tmp_path: Path) -> None:
    assert_user_error(ckptfs("ls-tiers", tmp_path, check=False), "not on a ckptfs mount")
    assert_user_error(ckptfs("retention", tmp_path, "--apply", check=False),
                      "not on a ckptfs mount")
