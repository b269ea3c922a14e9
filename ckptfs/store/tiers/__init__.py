"""Tiers: one narrow async interface (base.py), one module per kind, and ``open_tier``."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from ckptfs.config import TierConfig
from ckptfs.store.tiers.base import Tier


def open_tier(config: TierConfig) -> Tier:
    """The tier a config entry names (not checked: call ``Tier.check`` for that)."""
    tier = _open(config)
    if config.faults is not None:
        from ckptfs.store.tiers.faulty import FaultyTier

        f = config.faults
        tier = FaultyTier(tier, latency=f.latency.total_seconds(), bandwidth=f.bandwidth,
                          fail_ratio=f.fail_ratio, down_file=f.down_file,
                          kill_after_puts=f.kill_after_puts)
    return tier


def _open(config: TierConfig) -> Tier:
    assert config.url is not None, "the hot tier is the staging directory"
    parts = urlsplit(config.url)
    if parts.scheme == "file":
        from ckptfs.store.tiers.local import FileTier

        return FileTier(config.name, config.url, Path(unquote(parts.path)))
    if parts.scheme == "memory":
        from ckptfs.store.tiers.memory import MemoryTier

        return MemoryTier(config.name, config.url, parts.netloc + parts.path)
    if parts.scheme == "s3":
        from ckptfs.store.tiers.s3 import S3Tier

        return S3Tier(
            config.name, config.url,
            endpoint_url=config.endpoint_url, region=config.region, profile=config.profile,
            addressing_style=config.addressing_style,
            access_key_id=config.access_key_id.get_secret_value()
            if config.access_key_id else None,
            secret_access_key=config.secret_access_key.get_secret_value()
            if config.secret_access_key else None,
            part_size=config.part_size, part_concurrency=config.part_concurrency,
        )
    raise ValueError(f"unknown tier URL scheme in {config.url!r}")
