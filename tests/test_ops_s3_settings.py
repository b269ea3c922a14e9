"""S3 connection settings of a tier: ``profile`` and ``addressing_style``
used against a real S3 server (SeaweedFS, tests/seaweed.py), and errors (of a call, of the
check at mount, of the mount command) that keep the S3 error code and name the endpoint and
where the credentials came from.

The profile comes from temporary AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE files; every
other source of credentials is removed from the environment, so the server accepting the
requests proves the profile's keys were the ones sent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from ckptfs.config import load_config
from ckptfs.errors import UserError
from ckptfs.store.tiers import open_tier
from ckptfs.store.tiers.base import ObjectMeta, TierError
from ckptfs.store.tiers.s3 import S3Tier
from tests.mounting import ckptfs
from tests.seaweed import Seaweed
from tests.test_cli_errors import assert_nothing_left, assert_user_error

_AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION")


@pytest.fixture
def aws_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seaweed: Seaweed) -> Path:
    """A shared credentials file with profile ``ckpt`` (the server's keys) and ``wrong``
    (keys the server refuses), and a config file giving ``ckpt`` a region."""
    for name in _AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    keys = seaweed.credentials
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[ckpt]\naws_access_key_id = {keys['aws_access_key_id']}\n"
        f"aws_secret_access_key = {keys['aws_secret_access_key']}\n"
        "[wrong]\naws_access_key_id = AKIDNOTKNOWNHERE\n"
        "aws_secret_access_key = not-the-secret-of-anyone\n")
    config = tmp_path / "config"
    config.write_text("[profile ckpt]\nregion = eu-west-3\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    # No instance-metadata probe when a profile lacks keys: the test must not wait on it.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def _tier(seaweed: Seaweed, bucket: str, **settings: Any) -> S3Tier:
    tier = open_tier(load_config(None, {
        "store": f"s3://{bucket}/run", "s3_endpoint": seaweed.endpoint, **settings}).warm)
    assert isinstance(tier, S3Tier)
    return tier


def test_a_profile_is_used_and_path_style_is_set(
    aws_files: Path, seaweed: Seaweed, tmp_path: Path
) -> None:
    bucket = seaweed.new_bucket()
    tier = _tier(seaweed, bucket, s3_profile="ckpt", s3_addressing_style="path")
    assert tier.client.meta.config.s3["addressing_style"] == "path"
    assert tier.client.meta.region_name == "eu-west-3"  # the profile's region
    assert "from shared-credentials-file (profile ckpt)" in tier.where
    sent: list[str] = []
    tier.client.meta.events.register("before-send.s3", lambda request, **_: sent.append(
        request.url))
    source = tmp_path / "shard"
    source.write_bytes(b"x" * 1000)

    async def roundtrip() -> None:
        await tier.check()
        await tier.put_file("step_1/shard", source, 1000, ObjectMeta())

    trio.run(roundtrip)
    got = seaweed.client().get_object(Bucket=bucket, Key="run/step_1/shard")["Body"].read()
    assert got == b"x" * 1000
    # Path style: the bucket is the first component of the path, never in the host name.
    assert sent and all(url.startswith(f"{seaweed.endpoint}/{bucket}") for url in sent), sent


def test_a_refused_profile_names_code_endpoint_and_credential_source(
    aws_files: Path, seaweed: Seaweed
) -> None:
    tier = _tier(seaweed, seaweed.new_bucket(), s3_profile="wrong", s3_addressing_style="path")

    async def put() -> None:
        await tier.put_small("k", b"data")

    with pytest.raises(TierError) as caught:
        trio.run(put)
    text = str(caught.value)
    assert ("InvalidAccessKeyId" in text or "AccessDenied" in text
            or "SignatureDoesNotMatch" in text), text
    assert f"endpoint {seaweed.endpoint}" in text, text
    assert "credentials from shared-credentials-file (profile wrong)" in text, text
    assert "not-the-secret" not in text


def test_explicit_keys_are_named_as_the_tiers_own(seaweed: Seaweed) -> None:
    tier = S3Tier("warm", "s3://somebucket/p", endpoint_url=seaweed.endpoint,
                  **seaweed.tier_credentials)
    assert tier.where == f"endpoint {seaweed.endpoint}, credentials from the tier's " \
                         "access_key_id"


def test_an_undefined_profile_is_one_user_error(aws_files: Path) -> None:
    with pytest.raises(UserError, match=r"AWS profile 'nosuch' is not defined .*credentials"):
        S3Tier("warm", "s3://somebucket/p", endpoint_url="http://127.0.0.1:9",
               profile="nosuch")


@pytest.mark.parametrize(("overrides", "needles"), [
    ({"s3_endpoint": "127.0.0.1:9000"}, ["--s3-endpoint", "http:// or https://"]),
    ({"s3_addressing_style": "pathstyle"}, ["--s3-addressing-style", "'path'"]),
    ({"s3_region": "eu west"}, ["--s3-region"]),
    ({"s3_profile": "a profile"}, ["--s3-profile"]),
])
def test_bad_s3_settings_name_their_flag(overrides: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(UserError) as caught:
        load_config(None, {"store": "s3://bucket/p", **overrides})
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


def test_s3_settings_need_an_s3_warm_tier(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"-o s3_region: the warm tier is file:///.*not an s3"):
        load_config(None, {"store": str(tmp_path), "s3_region": "eu-west-3"},
                    flag_names={"s3_region": "-o s3_region"})


def test_profile_and_keys_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[[tier]]\nname = "hot"\n[[tier]]\nname = "warm"\nurl = "s3://bucket/p"\n'
                    'profile = "ckpt"\naccess_key_id = "AKID"\nsecret_access_key = "s3cr3t"\n')
    with pytest.raises(UserError, match="tier.1: profile: give either profile or"):
        load_config(path)


def test_the_config_file_keys_reach_the_client(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    path = tmp_path / "c.toml"
    path.write_text('[[tier]]\nname = "hot"\n[[tier]]\nname = "warm"\nurl = "s3://bucket/p"\n'
                    'endpoint_url = "http://127.0.0.1:9"\nregion = "ceph-1"\n'
                    'addressing_style = "virtual"\n')
    tier = open_tier(load_config(path).warm)
    assert isinstance(tier, S3Tier)
    assert tier.client.meta.config.s3["addressing_style"] == "virtual"
    assert tier.client.meta.region_name == "ceph-1"


def test_a_store_that_cannot_be_reached_names_the_credential_source(aws_files: Path) -> None:
    tier = S3Tier("warm", "s3://somebucket/p", endpoint_url="http://127.0.0.1:9",
                  profile="ckpt")
    with pytest.raises(TierError) as caught:
        trio.run(tier.check)
    text = str(caught.value)
    assert "cannot be reached" in text and "endpoint http://127.0.0.1:9" in text, text
    assert "credentials from shared-credentials-file (profile ckpt)" in text, text


def test_the_check_at_mount_names_the_s3_error_code_endpoint_and_credentials(
    aws_files: Path, seaweed: Seaweed
) -> None:
    """A HEAD of the bucket has no body: the check asks again with a listing, whose reply
    tells a missing bucket from refused keys from a port that is no S3 server at all."""
    def check(**settings: Any) -> str:
        tier = _tier(seaweed, settings.pop("bucket", seaweed.new_bucket()), **settings)
        with pytest.raises(TierError) as caught:
            trio.run(tier.check)
        return str(caught.value)

    source = "credentials from shared-credentials-file"
    text = check(bucket="no-such-bucket-here", s3_profile="ckpt")
    assert text.startswith("bucket 'no-such-bucket-here' of s3://no-such-bucket-here/run does "
                           "not exist (NoSuchBucket; "), text
    assert f"endpoint {seaweed.endpoint}" in text and f"{source} (profile ckpt)" in text, text
    text = check(s3_profile="wrong")
    assert "refused access: InvalidAccessKeyId: the access key id is not known" in text, text
    assert f"{source} (profile wrong)" in text, text
    # The master's port of the same SeaweedFS: an HTTP server, not S3 (it answers 404).
    master = f"http://127.0.0.1:{seaweed.ports['master']}"
    text = check(s3_profile="ckpt", s3_endpoint=master)
    assert text.startswith(f"{master} does not answer as an S3 server (HTTP 404 "), text
    assert "does not exist" not in text and f"{source} (profile ckpt)" in text, text


@pytest.mark.mount
def test_a_mount_refused_by_the_store_says_why_in_one_line(
    aws_files: Path, seaweed: Seaweed, tmp_path: Path
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = ckptfs("mount", mnt, "--staging", tmp_path / "staging",
                  "--store", f"s3://{seaweed.new_bucket()}/run", "--s3-endpoint", seaweed.endpoint,
                  "--s3-profile", "wrong", "--s3-addressing-style", "path", check=False,
                  env=dict(os.environ))
    line = assert_user_error(done, "refused access", f"endpoint {seaweed.endpoint}",
                             "credentials from shared-credentials-file (profile wrong)")
    assert "InvalidAccessKeyId" in line or "AccessDenied" in line or "403" in line, line
    assert_nothing_left(mnt)
