"""Duration strings in the configuration (config.py ``parse_duration``)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ckptfs.config import parse_duration


@pytest.mark.parametrize(("text", "seconds"), [
    ("50ms", 0.05), ("1500ms", 1.5), ("0ms", 0.0), ("90s", 90), ("1.5m", 90), ("24h", 86400),
    ("7d", 7 * 86400), ("2w", 14 * 86400), (" 10 s ", 10), (3, 3), (0.25, 0.25),
])
def test_units(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["50 msec", "5x", "ms", "-1s", "1e3s", True])
def test_refused(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
