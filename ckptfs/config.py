"""Typed configuration: one TOML file plus CLI overrides, validated at load.

Invariants:
- Every default lives in this module (and is documented in docs/CONFIGURATION.md).
- Unknown keys, wrong types and bad values are rejected at load with a ``UserError`` whose one
  line names the offending key (``tier.1.url``), never later at first use; an unknown key
  close to a known one of its table gets "did you mean".
- ``to_toml`` prints a configuration that loads back to the same one (credentials as ***).
- With no file at all, ``Config()`` is the embedded default: staging in
  /var/lib/ckptfs/staging and the local directory /var/lib/ckptfs/store as the warm tier,
  which keeps every checkpoint (the default never deletes the only remote copy).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import parse_qs, urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ckptfs.errors import UserError

DEFAULT_STAGING = Path("/var/lib/ckptfs/staging")
DEFAULT_STORE = Path("/var/lib/ckptfs/store")
# Default ``checkpoint_pattern``: a path component made of an optional prefix ending in
# ``_``, ``.`` or ``-``, then ``step``, ``checkpoint`` or ``iter``, an optional ``_``/``-``,
# the step, an optional suffix starting with ``_``, ``.`` or ``-``, and not ending in ``.tmp``.
DEFAULT_CHECKPOINT_PATTERN = (
    r"(?:^|/)(?:[^/]*[_.-])?(?:step|checkpoint|iter)[_-]?(?P<step>\d+)"
    r"(?:[._-][^/]*)?(?<!\.tmp)(?=/|$)"
)

DEFAULT_COMMIT_MARKERS = (
    ".metadata",
    "latest",
    "latest_checkpointed_iteration.txt",
    "*.done",
    "COMMITTED",
    "_CHECKPOINT_METADATA",  # Orbax: written by the primary host once every host finished
    "commit_success.txt",  # Orbax on object stores
)
STORAGE_CLASSES = frozenset(
    {"STANDARD", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR", "GLACIER",
     "DEEP_ARCHIVE"}
)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# The longest duration accepted (100 years): anything longer means "never" to a person, and
# timedelta, trio's deadlines and sleep(3) overflow somewhere past it.
MAX_DURATION_S = 100 * 365 * 86400


def parse_duration(value: Any) -> timedelta:
    """'50ms', '90s', '15m', '24h', '7d', '8w' or a number of seconds: finite, 0 to 100
    years."""
    if isinstance(value, timedelta):
        seconds: float = value.total_seconds()
    # ValueError, not TypeError: pydantic turns only ValueError into a validation error (an
    # OverflowError from timedelta would be a traceback).
    elif isinstance(value, bool):
        raise ValueError("expected a duration such as '30s', '24h', '7d' or '8w'")  # noqa: TRY004
    elif isinstance(value, (int, float)):
        seconds = value
    elif isinstance(value, str) and (match := _DURATION_RE.match(value)):
        seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
    else:
        raise ValueError(f"expected a duration such as '50ms', '30s', '24h', '7d' or '8w', not {value!r}")
    # Before the comparisons: nan passes both of them. (An int is finite, however large; a
    # string of too many digits becomes inf, which the last test refuses as too long.)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a duration must be finite, not {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {_short(value)}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"a duration can be at most 100 years ({MAX_DURATION_S}s), "
                         f"got {_short(value)}")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def parse_settle(value: Any) -> timedelta | None:
    """``checkpoint_settle``: a duration, or "off" (None)."""
    if value is None or value == "off":
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"{exc} (or 'off')") from None


SettleTime = Annotated[timedelta | None, BeforeValidator(parse_settle)]


class _Strict(BaseModel):
    # No inf or nan in any float (TOML has both): a ratio, cost or milestone that is not a
    # number would fail later, far from its key, or never compare as intended.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class KeepRules(_Strict):
    """Which checkpoints a tier keeps (the union of the rules)."""

    # Every checkpoint. A tier without a ``keep`` table gets this: retention never deletes
    # what no rule was written for (``keep = {}`` keeps nothing, on purpose).
    all: bool = False
    last: int | None = Field(default=None, ge=0)
    hourly: Duration | None = None
    daily: Duration | None = None
    weekly: Duration | None = None
    milestones: tuple[float, ...] | None = None

    @field_validator("milestones")
    @classmethod
    def _fractions(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if value is not None:
            for fraction in value:
                if not 0.0 < fraction <= 1.0:
                    raise ValueError(f"milestones are fractions of total_steps in (0, 1], not {fraction}")
        return value


class FaultConfig(_Strict):
    """Fault injection for tests and drills (tiers/faulty.py). Never set it in production."""

    latency: Duration = timedelta(0)
    bandwidth: int | None = Field(default=None, ge=1)  # bytes per second
    fail_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    down_file: Path | None = None  # the store is "down" while this file exists
    # Crash drills: SIGKILL the daemon right after this many successful file uploads, before
    # the journal records them.
    kill_after_puts: int | None = Field(default=None, ge=1)


class TierConfig(_Strict):
    """One tier. ``hot`` is the staging directory itself and has no URL."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    url: str | None = None
    keep: KeepRules = KeepRules(all=True)
    cost_per_tb_month: float = Field(default=0.0, ge=0)
    # S3 connection settings; credentials default to boto3's standard chain (or ``profile``'s
    # section of ~/.aws/config and ~/.aws/credentials).
    endpoint_url: str | None = None
    region: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    profile: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.@+=,/-]{1,128}$")
    # "path" (bucket in the URL path) is what MinIO, Ceph RGW and SeaweedFS behind a plain
    # host name need; "auto" lets botocore choose (virtual-hosted on AWS).
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    # Multipart uploads: files larger than part_size go in parts, part_concurrency at once.
    part_size: int = Field(default=16 * 1024 * 1024, ge=5 * 1024 * 1024, le=5 * 1024**3)
    part_concurrency: int = Field(default=4, ge=1, le=64)
    faults: FaultConfig | None = None

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        if value is not None:
            validate_tier_url(value)
        return value

    @field_validator("endpoint_url")
    @classmethod
    def _valid_endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"must be an http:// or https:// URL, not {value!r}")
        return value

    @model_validator(mode="after")
    def _one_credential_source(self) -> TierConfig:
        # boto3 would take the explicit keys and silently ignore the profile: the operator
        # would debug the wrong credentials.
        if self.profile is not None and (self.access_key_id or self.secret_access_key):
            raise ValueError("profile: give either profile or access_key_id/secret_access_key, "
                             "not both")
        return self


def validate_tier_url(url: str) -> None:
    """Raise ValueError if ``url`` is not a tier URL ckptfs understands."""
    typo = re.fullmatch(r"(s3|file|memory):/*(.*)", url, re.IGNORECASE)
    if typo and "://" not in url:
        scheme, rest = typo.group(1).lower(), typo.group(2)
        right = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
        raise ValueError(f"{url!r} is not a URL: did you mean {right!r}?")
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"a file tier URL needs an absolute path (file:///path), not {url!r}")
        if parts.query:
            raise ValueError(f"a file tier URL takes no query, not {url!r}")
    elif parts.scheme == "s3":
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", parts.netloc):
            raise ValueError(f"not a valid S3 bucket name in {url!r}")
        for key, values in parse_qs(parts.query, keep_blank_values=True).items():
            if key != "storage_class":
                raise ValueError(f"unknown S3 URL parameter {key!r} in {url!r}")
            if values[-1] not in STORAGE_CLASSES:
                raise ValueError(
                    f"storage_class must be one of {', '.join(sorted(STORAGE_CLASSES))}, "
                    f"not {values[-1]!r} (in {url!r})"
                )
    elif parts.scheme == "memory":
        if not parts.netloc:
            raise ValueError(f"a memory tier URL needs a name (memory://name), not {url!r}")
    else:
        raise ValueError(f"tier URL scheme must be file://, s3:// or memory://, not {url!r}")


def _default_tiers() -> tuple[TierConfig, ...]:
    return (
        TierConfig(name="hot", keep=KeepRules(last=3)),
        # No keep rule for warm: it keeps every checkpoint. The embedded default must never
        # delete the only remote copy; deleting is for a policy someone wrote.
        TierConfig(name="warm", url=DEFAULT_STORE.as_uri()),
    )


class Config(_Strict):
    """The whole configuration of one mount."""

    staging_dir: Path = DEFAULT_STAGING
    allow_other: bool = False
    # A reader's mount: the kernel refuses every change, nothing is uploaded, retention does
    # not run, and the node never registers with the others (mount.py, coordination.py).
    read_only: bool = False
    # Create a missing file-tier store directory at mount (otherwise a missing one is an
    # error: an unmounted Lustre must not become a directory on the root disk).
    create_store: bool = False
    # Let this staging directory move to another store than the one it recorded (store-id,
    # staging.py): its files then go to the new one. Otherwise another store is refused.
    adopt_store: bool = False
    # The mount is always nodev, and nosuid unless this is set: the store (anyone who can
    # write its prefix) decides what a node maps (mount.py, listing.py).
    suid: bool = False
    fsync: Literal["local", "remote"] = "local"
    unlink: Literal["posix", "local-only"] = "posix"
    commit_markers: tuple[str, ...] = DEFAULT_COMMIT_MARKERS
    upload_concurrency: int = Field(default=4, ge=1, le=256)
    # Uploads yield to the job (yieldgate.py): none starts while a file of the mount is open
    # or for upload_settle after the last close, for at most upload_hold_max (0: never wait).
    upload_settle: Duration = timedelta(milliseconds=250)
    upload_hold_max: Duration = timedelta(seconds=30)
    # Nodes that mount one store keep its commit order together (coordination.py): this
    # node's id (default: made once per staging directory), and how often it polls the store
    # while it has work, and when idle.
    node_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    node_poll_interval: Duration = timedelta(seconds=1)
    # Register with the other nodes at mount, not before the first change: the first write
    # never waits for the store, but a killed node holds the others' markers even if it only
    # read (coordination.py).
    register_at_mount: bool = False
    # How long a node's first change waits for its registration in the store (the store
    # down or refusing) before it fails with EIO; status and metrics count the wait as a
    # stall of the writers (coordination.py ``enlist``).
    register_timeout: Duration = timedelta(minutes=5)
    node_idle_poll_interval: Duration = timedelta(seconds=10)
    staging_max_bytes: int | None = Field(default=None, ge=1)
    staging_min_free_ratio: float = Field(default=0.05, ge=0.0, lt=1.0)
    write_stall_timeout: Duration = timedelta(minutes=5)
    # Write-only opens bypass the kernel page cache of the mount: one copy fewer per byte
    # (docs/SEMANTICS.md, "Files").
    write_direct_io: bool = True
    # FUSE passthrough (docs/PASSTHROUGH.md): opens of wholly local files served by the kernel
    # straight from the staging file. "auto" falls back, saying why on the mount's output and
    # in status; "on" fails the mount with the reason; "off" never asks (and keeps the stock
    # pyfuse3).
    passthrough: Literal["auto", "on", "off"] = "auto"
    # Budget a passthrough writer holds ahead of its writes (the daemon never sees them to
    # stall them): a writable open that cannot get it is served by the daemon instead.
    passthrough_write_reserve: int = Field(default=1024**3, ge=1024**2)
    metadata_ttl: Duration = timedelta(seconds=10)
    # Read path: missing data is fetched in aligned blocks of fetch_block_size (at least; an
    # object's own integrity blocks may be larger), fetch_concurrency range GETs at once, and
    # sequential readers get up to readahead_bytes fetched ahead of them.
    fetch_block_size: int = Field(default=16 * 1024 * 1024, ge=64 * 1024, le=1024**3)
    fetch_concurrency: int = Field(default=8, ge=1, le=256)
    readahead_bytes: int = Field(default=64 * 1024 * 1024, ge=0, le=16 * 1024**3)
    # The kernel's readahead on the mount (its bdi's read_ahead_kb; 0: the kernel's 128).
    read_ahead_kb: int = Field(default=1024, ge=0, le=1024 * 1024)
    total_steps: int | None = Field(default=None, ge=1)
    # Which paths are checkpoints (checkpoints.py): a regex with a named group ``step``,
    # searched in the path relative to the mount; the checkpoint is the component where the
    # step matched. ``step_regex`` (legacy; not with checkpoint_pattern): every top-level
    # entry is a checkpoint whose step is the regex's first group.
    checkpoint_pattern: str = DEFAULT_CHECKPOINT_PATTERN
    step_regex: str | None = None
    # Retention runs this often, and after the uploads that follow a commit; 0: only
    # `ckptfs retention --apply`.
    retention_interval: Duration = timedelta(minutes=10)
    # The lease (.ckptfs/retention.lease in the warm tier) that lets one node at a time
    # apply the policy: this long from each renewal. Wall clocks of the nodes are compared:
    # their skew must be far below a third of it (docs/RETENTION.md, "Several nodes").
    retention_lease: Duration = timedelta(minutes=10)
    # A checkpoint without a commit marker is taken as complete once a later one exists, or
    # this long after its last file, if no other node writes to the store; 0: only the
    # later-checkpoint rule; "off": a marker is required (docs/RETENTION.md).
    checkpoint_settle: SettleTime = timedelta(minutes=10)
    log_level: Annotated[Literal["debug", "info", "warning", "error"],
                         BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)] = "info"
    # Logs go to stderr (the journal, or <staging>/daemon.log when detached) unless log_file
    # names a file, rotated at log_max_bytes with log_backups old files kept (.1, .2, ...).
    log_file: Path | None = None
    log_max_bytes: int = Field(default=64 * 1024**2, ge=1024**2)
    log_backups: int = Field(default=5, ge=1, le=100)
    # "json": one object per line (time, level, logger, message[, exception]) for collectors.
    log_format: Annotated[Literal["text", "json"],
                          BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)] = "text"
    fuse_workers: int = Field(default=64, ge=1, le=1024)
    # Prometheus endpoint (metrics.py): off unless a port is given.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # Loopback by default: the endpoint has no authentication, and a scrape costs the daemon
    # CPU; "0.0.0.0" exposes it to every host that can reach the node.
    metrics_address: str = "127.0.0.1"
    tier: tuple[TierConfig, ...] = Field(default_factory=_default_tiers)

    @field_validator("staging_dir", "log_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        # The daemon runs in "/": a relative path would mean another file than the one meant.
        if value is not None and not value.is_absolute():
            raise ValueError(f"must be an absolute path, not {str(value)!r}")
        return value

    @field_validator("fetch_block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, not {value}")
        return value

    @field_validator("step_regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            pattern = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        if pattern.groups < 1:
            raise ValueError("needs one capturing group for the step number")
        return value

    @field_validator("checkpoint_pattern")
    @classmethod
    def _has_step(cls, value: str) -> str:
        try:
            pattern = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        if "step" not in pattern.groupindex:
            raise ValueError("needs a named group (?P<step>...) for the step number")
        return value

    @field_validator("retention_lease")
    @classmethod
    def _lease_length(cls, value: timedelta) -> timedelta:
        if value < timedelta(seconds=3):
            raise ValueError(f"must be at least 3s (renewed every third of it), not "
                             f"{value.total_seconds():g}s")
        return value

    @model_validator(mode="after")
    def _tiers(self) -> Config:
        if self.step_regex is not None and "checkpoint_pattern" in self.model_fields_set:
            raise ValueError("checkpoint_pattern: give either checkpoint_pattern or the "
                             "legacy step_regex, not both")
        names = [t.name for t in self.tier]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if not self.tier or self.tier[0].name != "hot" or self.tier[0].url is not None:
            raise ValueError("the first tier must be 'hot' (the staging directory) with no url")
        for extra in self.tier[1:]:
            if extra.url is None:
                raise ValueError(f"tier {extra.name!r} needs a url")
        if len(self.tier) < 2:
            raise ValueError("at least one tier besides 'hot' (the warm tier) is needed")
        for index, t in enumerate(self.tier):
            if t.keep.milestones and self.total_steps is None:
                raise ValueError(f"tier.{index}.keep.milestones: needs total_steps (the "
                                 f"milestones of tier {t.name!r} are fractions of it)")
        # Retention copies between tiers: two tiers naming the same objects would delete
        # each other's copies.
        seen: dict[tuple[str, str | None], str] = {}
        for index, t in enumerate(self.tier[1:], start=1):
            assert t.url is not None
            where = (t.url.rstrip("/"), t.endpoint_url)
            if where in seen:
                raise ValueError(f"tier.{index}.url: the same store as tier {seen[where]!r}")
            seen[where] = t.name
        return self

    @property
    def warm(self) -> TierConfig:
        """The tier every closed file is uploaded to (stage 2)."""
        return self.tier[1]

    def secret_values(self) -> list[str]:
        """Every credential in the configuration: logs and ``status`` must never show them."""
        values = []
        for t in self.tier:
            for secret in (t.access_key_id, t.secret_access_key):
                if secret is not None and secret.get_secret_value():
                    values.append(secret.get_secret_value())
        return values


def _format_validation_error(
    exc: ValidationError, source: str, flags: dict[str, str] | None = None
) -> str:
    """One line naming every offending key (or the CLI flag that set it)."""
    flags = flags or {}
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc)
        for prefix, flag in flags.items():
            if key == prefix or key.startswith(prefix + "."):
                key = flag
                break
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + did_you_mean(loc[-1] if loc else "", _known_keys(loc[:-1]))
        elif err["type"] not in ("value_error", "assertion_error") and _is_scalar(err["input"]) \
                and not (loc and loc[-1] in SECRET_FIELDS):  # a credential is never echoed
            msg = f"{msg}, got {err['input']!r}"
        msg = " ".join(msg.split())  # one line, whatever pydantic says
        parts.append(f"{key}: {msg}" if key else msg)
    return f"invalid configuration ({source}): " + "; ".join(parts)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'staging_dir'?)`` for a near miss among ``known``, else ``""``."""
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _known_keys(loc: tuple[str, ...]) -> frozenset[str]:
    """The keys of the table at ``loc`` (``("tier", "1", "keep")``: a KeepRules)."""
    model: type[BaseModel] = Config
    for part in loc:
        if part.isdigit():
            continue  # an index into a list of tables
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return frozenset()
        model = inner
    return frozenset(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model inside ``tuple[TierConfig, ...]``, ``FaultConfig | None``, ..., if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 80


def store_url(value: str) -> str:
    """``--store`` accepts a tier URL or a plain directory path (made absolute here)."""
    if not value.strip():
        raise UserError("--store must not be empty")
    if "://" in value:
        return value
    typo = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.-]*):/*(.*)", value)
    if typo and typo.group(1).lower() in ("s3", "file", "memory"):
        scheme, rest = typo.group(1).lower(), typo.group(2)
        right = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
        raise UserError(f"--store {value!r} is not a URL: did you mean {right!r}? "
                        f"(the form is {scheme}://...)")
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise UserError(f"--store must be an absolute path or a URL (file:///dir, "
                        f"s3://bucket/prefix), not {value!r}")
    return Path(os.path.normpath(path)).as_uri()


def config_path(path: Path | None = None) -> Path | None:
    """The config file to read: ``path``, else $CKPTFS_CONFIG, else none; made absolute."""
    if path is None:
        env = os.environ.get("CKPTFS_CONFIG")
        if not env:
            return None
        path = Path(env)
    return Path(os.path.abspath(path.expanduser()))


# Keys a CLI flag sets, named by the flag in error messages.
_FLAG_NAMES = {
    "staging_dir": "--staging",
    "allow_other": "--allow-other",
    "log_level": "--log-level",
}
# Overrides (flags and mount options) of the warm tier's S3 settings: option -> tier key.
WARM_OVERRIDES = {
    "s3_endpoint": "endpoint_url",
    "s3_region": "region",
    "s3_profile": "profile",
    "s3_addressing_style": "addressing_style",
}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"config file {path} is a directory") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not valid TOML: it is not UTF-8 text") from None


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None,
                flag_names: dict[str, str] | None = None) -> Config:
    """Load ``path`` (or $CKPTFS_CONFIG, or nothing) and apply CLI ``overrides``.

    Overrides use config keys, plus ``store`` which replaces the warm tier's URL and the
    ``WARM_OVERRIDES`` (``s3_endpoint``, ...) which set the warm tier's S3 settings.
    ``flag_names`` names how an override was given (``-o upload_concurrency``) in errors.
    """
    names = {**_FLAG_NAMES, **(flag_names or {})}
    path = config_path(path)
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = _read_toml(path)
    overrides = dict(overrides or {})
    # Settings of the warm tier (tier.1): --store and the --s3-* flags.
    warm: dict[str, tuple[str, Any]] = {}
    store = overrides.pop("store", None)
    if store is not None:
        warm["url"] = ("store", store_url(store))
    for option, key in WARM_OVERRIDES.items():
        value = overrides.pop(option, None)
        if value is not None:
            warm[key] = (option, value)
    flags = {}
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
            flags[key] = names.get(key, "--" + key.replace("_", "-"))
    if warm:
        if "tier" not in data:
            data["tier"] = [t.model_dump(exclude_none=True) for t in _default_tiers()]
        tiers = data["tier"]
        # A malformed tier list is reported by validation below, with its key.
        if isinstance(tiers, list) and all(isinstance(t, dict) for t in tiers):
            first = names.get(next(iter(warm.values()))[0], "--store")
            if len(tiers) < 2:
                raise UserError(
                    f"{first} needs a warm tier: the config ({source}) has only "
                    f"{len(tiers)} tier(s)"
                )
            tiers = [dict(t) for t in tiers]
            for key, (option, value) in warm.items():
                tiers[1][key] = value
                flags[f"tier.1.{key}"] = names.get(option, "--" + option.replace("_", "-"))
            data["tier"] = tiers
            url = tiers[1].get("url")
            s3_keys = [o for o, _ in warm.values() if o in WARM_OVERRIDES]
            if s3_keys and isinstance(url, str) and not url.startswith("s3://"):
                option = s3_keys[0]
                raise UserError(f"{names.get(option, '--' + option.replace('_', '-'))}: the "
                                f"warm tier is {url}, not an s3:// store")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise UserError(_format_validation_error(exc, source, flags)) from None


SECRET_FIELDS = frozenset({"access_key_id", "secret_access_key"})
# Keys of a tier that mean something only for a tier with a URL of that kind: ``config check``
# leaves them out of the other tiers (the hot tier is the staging directory).
_S3_ONLY = frozenset({"endpoint_url", "region", "profile", "addressing_style", "part_size",
                      "part_concurrency", *SECRET_FIELDS})


def to_toml(config: Config) -> str:
    """``config`` as a TOML file that loads back to it, every key shown; credentials as
    ``***`` (``ckptfs config check``). Keys with no value are comments: TOML has no null."""
    lines = []
    for key, value in config:
        if key == "tier":
            continue
        if key == "checkpoint_settle" and value is None:
            value = "off"
        if key == "checkpoint_pattern" and config.step_regex is not None:
            value = None  # the legacy step_regex rules instead; the two together are refused
        lines.append(f"# {key} = (not set)" if value is None else f"{key} = {_toml(value)}")
    for tier in config.tier:
        lines += ["", "[[tier]]"]
        s3 = tier.url is not None and tier.url.startswith("s3://")
        for key, value in tier:
            if key in _S3_ONLY and not s3:
                continue  # a default of no meaning here (an S3 setting of the hot tier)
            if key == "cost_per_tb_month" and tier.url is None and not value:
                continue
            if isinstance(value, BaseModel):
                # Only what differs from the defaults: keep = {} (nothing) is not keep = {}
                # with every rule spelled out as off.
                value = value.model_dump(exclude_defaults=True)
            if value is not None:
                lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, SecretStr):
        return '"***"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, timedelta):
        return _toml(format_duration(value))
    if isinstance(value, Path):
        return _toml(str(value))
    if isinstance(value, str):
        # A JSON string with raw non-ASCII is a TOML basic string (same escapes).
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()
                                if v is not None) + " }" if value else "{}"
    raise TypeError(f"no TOML form for {value!r}")


def format_duration(value: timedelta) -> str:
    """The shortest exact form ``parse_duration`` reads back: "10m", "7d", "50ms", "1.5s"."""
    ms = round(value.total_seconds() * 1000)
    for unit in ("w", "d", "h", "m", "s"):
        size = round(_UNIT_SECONDS[unit] * 1000)
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
