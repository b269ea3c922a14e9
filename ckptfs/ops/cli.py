"""The ``ckptfs`` command line.

Invariants:
- A user error (``UserError``) prints one line, ``ckptfs: error: ...``, and exits non-zero;
  never a traceback. Only bugs print tracebacks.
- ``ckptfs mount`` without ``--foreground`` returns only once the mount is ready (or with the
  daemon's one-line error): the daemon reports through a pipe (``--ready-fd``).
- ``mount`` and ``config check`` take the same flags and build the configuration the same way
  (``_configure``): what ``config check`` prints is what ``mount`` would use.
- Every log record is one line (text) or one JSON object per line. ckptfs never formats a
  credential into a message (configuration values are ``SecretStr``; endpoints are shown
  without ``user:password@``); the records of the AWS SDK, which may dump request headers
  and parameters, have every credential of the configuration and the AWS environment
  replaced by ``***``. Other lines are left as they are: a file named ``latest`` stays
  ``latest`` when a secret key is ``test``.
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer >= 0.20 vendors click; older versions use click itself
    from typer._click import exceptions as _click_exc  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover
    from click import exceptions as _click_exc  # type: ignore[no-redef,unused-ignore]

from ckptfs.config import MAX_DURATION_S, Config, config_path, load_config, store_url
from ckptfs.errors import UserError
from ckptfs.fuse.mountinfo import FSTYPE, check_mountpoint, check_staging_place, find
from ckptfs.humanize import console, count, human_bytes, plural
from ckptfs.ops import client


def _usage_name(self: Any) -> str:
    """An argument as usage lines write it: ``MOUNTPOINT`` if required, ``[PATH]`` if not
    (typer writes ``{MOUNTPOINT}``, which reads as a placeholder left unfilled)."""
    name = str(self.display_name_raw)
    if not self.required:
        name = f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


if hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _usage_name  # type: ignore[method-assign]

app = typer.Typer(
    name="ckptfs",
    help="Checkpoint filesystem: write to local NVMe, upload to shared storage in the background.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
)


def _show_version(value: bool) -> None:
    if value:
        from ckptfs import __version__

        print(f"ckptfs {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", "-V", help="Print the version and exit.", callback=_show_version,
        is_eager=True)] = False,
) -> None:
    """Checkpoint filesystem: write to local NVMe, upload to shared storage in the
    background."""

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config file (default: $CKPTFS_CONFIG, or none).",
                 show_default=False),
]

READY_TIMEOUT = 120.0
DAEMON_EXIT_TIMEOUT = 120.0
LAZY_EXIT_WAIT = 10.0  # seconds umount --lazy waits for the daemon before saying it stays
# Without a terminal, sync and umount print a progress line this often (seconds).
BATCH_PROGRESS_EVERY = 15.0
EXIT_LEFT_BEHIND = 3  # umount --strict: files were left not uploaded


# Loggers of the AWS SDK: their records may carry request headers and parameters.
SDK_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")


class _OneLineRedacting(logging.Formatter):
    """One line per event (tracebacks folded); in records of the AWS SDK (``SDK_LOGGERS``),
    credentials replaced by ``***``."""

    def __init__(self, fmt: str, secrets: list[str]) -> None:
        super().__init__(fmt)
        # Longest first: a secret that contains another is replaced whole.
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def redact(self, text: str, record: logging.LogRecord) -> str:
        if not record.name.startswith(SDK_LOGGERS):
            return text
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def format(self, record: logging.LogRecord) -> str:
        return self.redact(super().format(record), record).replace("\n", " | ")


class _JsonRedacting(_OneLineRedacting):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message[, exception].

    Redacted before encoding: JSON escapes could hide a secret from a search in the encoded
    text."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__("%(message)s", secrets)

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        event: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": self.redact(record.getMessage(), record),
        }
        if record.exc_info:
            event["exception"] = self.redact(self.formatException(record.exc_info), record)
        return json.dumps(event, ensure_ascii=False)


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log file created mode 0600 (also after each rotation): log lines name the
    files of the mount and the stores, as the journal in the staging directory does."""

    def _open(self) -> Any:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                     0o600)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def _log_handler(config: Config) -> logging.Handler:
    """Where the daemon's log goes: ``log_file`` (rotated), else stderr. UserError if the
    file cannot be opened."""
    if config.log_file is None:
        return logging.StreamHandler(sys.stderr)
    try:
        return _PrivateRotatingFileHandler(
            config.log_file, maxBytes=config.log_max_bytes, backupCount=config.log_backups,
            encoding="utf-8")
    except OSError as exc:
        raise UserError(f"log_file {config.log_file}: cannot open it: "
                        f"{exc.strerror or exc}") from None


def _check_log_file(config: Config, mountpoint: Path) -> None:
    """UserError unless ``log_file`` (if any) can be opened and is outside the mount: the
    daemon would fail before it could report, or write its log through itself."""
    if config.log_file is None:
        return
    inside = os.path.realpath(mountpoint).rstrip("/") + "/"
    if (os.path.realpath(config.log_file) + "/").startswith(inside):
        raise UserError(f"log_file {config.log_file} is inside the mount {mountpoint}: the "
                        "daemon would write its log through itself")
    _log_handler(config).close()


def _setup_logging(config: Config) -> None:
    env_secrets = [os.environ.get(k, "") for k in
                   ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
    secrets = [*config.secret_values(), *env_secrets]
    formatter: logging.Formatter
    if config.log_format == "json":
        formatter = _JsonRedacting(secrets)
    else:
        # Under systemd (stderr is the journal) journald adds the time itself; a file has none.
        fmt = "%(levelname)s %(name)s: %(message)s"
        if config.log_file is not None or not os.environ.get("JOURNAL_STREAM"):
            fmt = "%(asctime)s " + fmt
        formatter = _OneLineRedacting(fmt, secrets)
    handler = _log_handler(config)
    handler.setFormatter(formatter)
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    # The AWS SDK's debug output is request dumps, not events: keep it at info and above.
    for noisy in SDK_LOGGERS:
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))


def _abs(path: Path | None) -> Path | None:
    return None if path is None else Path(os.path.abspath(path.expanduser()))


def _seconds(value: float | None) -> float | None:
    """A number of seconds given as a flag: finite, 0 to 100 years like every duration
    (config.py). inf or nan would end in an OverflowError (socket timeouts, deadlines)."""
    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_DURATION_S):
        raise typer.BadParameter(f"must be a number of seconds from 0 to {MAX_DURATION_S}, "
                                 f"not {value}")
    return value


# The configuration flags of ``mount``, which ``config check`` takes too.
StagingOpt = Annotated[Path | None, typer.Option(
    "--staging", help="Staging directory on local NVMe.", show_default=False)]
StoreOpt = Annotated[str | None, typer.Option(
    "--store", help="Warm tier: a directory, file:///dir or s3://bucket/prefix.",
    show_default=False)]
AllowOtherOpt = Annotated[bool | None, typer.Option(
    "--allow-other/--no-allow-other", help="Let other users use the mount.",
    show_default=False)]
LogLevelOpt = Annotated[str | None, typer.Option(
    "--log-level", help="debug, info, warning or error (any case). Default: info.",
    metavar="LEVEL", show_default=False)]
LogFileOpt = Annotated[Path | None, typer.Option(
    "--log-file", help="Log to this file, rotated at log_max_bytes (default: stderr, which is "
    "the journal or <staging>/daemon.log).", metavar="PATH", show_default=False)]
LogFormatOpt = Annotated[str | None, typer.Option(
    "--log-format", help="text or json (one object per line). Default: text.",
    metavar="FORMAT", show_default=False)]
ReadOnlyOpt = Annotated[bool | None, typer.Option(
    "--read-only/--read-write", help="A reader's mount: no change, no upload, no "
    "retention, never waited for by other nodes (-o ro).", show_default=False)]
AdoptStoreOpt = Annotated[bool | None, typer.Option(
    "--adopt-store", help="Use a staging directory that belongs to another store with "
    "this one (its files then go here; -o adopt_store).", show_default=False)]
CreateStoreOpt = Annotated[bool | None, typer.Option(
    "--create-store", help="Create the store directory (a file tier) if it does not exist; "
    "otherwise a missing one is an error (-o create_store).", show_default=False)]
S3EndpointOpt = Annotated[str | None, typer.Option(
    "--s3-endpoint", help="The warm tier's S3 endpoint, e.g. http://minio:9000 "
    "(-o s3_endpoint).", metavar="URL", show_default=False)]
S3RegionOpt = Annotated[str | None, typer.Option(
    "--s3-region", help="The warm tier's S3 region (-o s3_region).", metavar="REGION",
    show_default=False)]
S3ProfileOpt = Annotated[str | None, typer.Option(
    "--s3-profile", help="AWS profile (~/.aws/config, ~/.aws/credentials) for the warm "
    "tier's credentials (-o s3_profile).", metavar="NAME", show_default=False)]
S3AddressingOpt = Annotated[str | None, typer.Option(
    "--s3-addressing-style", help="auto, path (MinIO, Ceph) or virtual "
    "(-o s3_addressing_style).", metavar="STYLE", show_default=False)]
OptionsOpt = Annotated[list[str] | None, typer.Option(
    "--option", "-o", help="Config keys as mount options: key=value,... "
    "(as in fstab; see docs/CONFIGURATION.md).", metavar="KEY=VALUE,...",
    show_default=False)]


def _configure(
    config_file: Path | None, options: list[str] | None, flags: dict[str, Any]
) -> tuple[Path | None, dict[str, Any], Config]:
    """The config file, the overrides and the validated configuration of ``mount`` (and
    ``config check``): flags win over ``-o`` options, which win over the file."""
    from ckptfs.ops import mounthelper

    parsed = mounthelper.parse_options(options or [])
    # Relative paths are resolved here: the background daemon runs in "/".
    config_file = config_path(config_file or parsed.config)
    overrides: dict[str, Any] = dict(parsed.overrides)
    overrides.update({k: v for k, v in flags.items() if v is not None or k not in overrides})
    names = {k: f"-o {k}" for k in parsed.overrides if flags.get(k) is None}
    return config_file, overrides, load_config(config_file, overrides, flag_names=names)


def _flags(
    staging: Path | None, store: str | None, allow_other: bool | None, log_level: str | None,
    log_file: Path | None, log_format: str | None, read_only: bool | None,
    create_store: bool | None, adopt_store: bool | None, s3_endpoint: str | None,
    s3_region: str | None, s3_profile: str | None, s3_addressing_style: str | None,
) -> dict[str, Any]:
    """The overrides the flags of ``mount`` and ``config check`` give (None: not given)."""
    return {
        "staging_dir": _abs(staging),
        "store": None if store is None else store_url(store),
        "allow_other": allow_other,
        "read_only": read_only,
        "create_store": create_store,
        "adopt_store": adopt_store,
        "log_level": log_level,
        "log_file": _abs(log_file),
        "log_format": log_format,
        "s3_endpoint": s3_endpoint,
        "s3_region": s3_region,
        "s3_profile": s3_profile,
        "s3_addressing_style": s3_addressing_style,
    }


@app.command()
def mount(
    mountpoint: Annotated[Path, typer.Argument(
        metavar="MOUNTPOINT", help="Where to mount, e.g. /ckpt.")],
    config_file: ConfigOpt = None,
    staging: StagingOpt = None,
    store: StoreOpt = None,
    allow_other: AllowOtherOpt = None,
    log_level: LogLevelOpt = None,
    log_file: LogFileOpt = None,
    log_format: LogFormatOpt = None,
    read_only: ReadOnlyOpt = None,
    adopt_store: AdoptStoreOpt = None,
    create_store: CreateStoreOpt = None,
    s3_endpoint: S3EndpointOpt = None,
    s3_region: S3RegionOpt = None,
    s3_profile: S3ProfileOpt = None,
    s3_addressing_style: S3AddressingOpt = None,
    foreground: Annotated[bool, typer.Option(
        "--foreground", "-f", help="Serve in this process (systemd, debugging).")] = False,
    options: OptionsOpt = None,
    ready_fd: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """Mount ckptfs at MOUNTPOINT; returns once the mount is ready.

    Without options: staging in /var/lib/ckptfs/staging, the warm tier (the store) in
    /var/lib/ckptfs/store, the hot tier keeping the last 3 checkpoints on NVMe. Every
    setting and its default: docs/CONFIGURATION.md.

    \b
    Example:
      ckptfs mount /ckpt --staging /nvme/ckptfs --store s3://ckpt/run1 \\
          -o upload_concurrency=8,passthrough=auto
    """
    config_file, overrides, config = _configure(config_file, options, _flags(
        staging, store, allow_other, log_level, log_file, log_format, read_only, create_store,
        adopt_store, s3_endpoint, s3_region, s3_profile, s3_addressing_style))
    if not foreground:
        # Fail fast on a bad mountpoint; the daemon checks again (and owns the staging checks).
        check_mountpoint(mountpoint)
        check_staging_place(config.staging_dir, mountpoint)
        _check_log_file(config, mountpoint)
        warnings = _check_stores(config)
        reported, note = _spawn_daemon(mountpoint, config_file, overrides)
        warnings += reported
        # After the mount: a failed one prints its one error line and nothing else.
        for warning in warnings:
            print("ckptfs: warning: " + warning, file=sys.stderr)
        print(_ready_line(config, mountpoint))
        if note:  # passthrough = "auto" could not be used: say who serves the data, and why
            print(f"ckptfs: {note}")
        return
    if ready_fd is None:  # with --ready-fd, the parent that spawned this daemon checked
        check_mountpoint(mountpoint)
        _check_log_file(config, mountpoint)
        for warning in _check_stores(config):
            print("ckptfs: warning: " + warning, file=sys.stderr)
    _serve_foreground(config, mountpoint, ready_fd)


config_app = typer.Typer(help="Check the configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("check")
def config_check(
    config_file: ConfigOpt = None,
    staging: StagingOpt = None,
    store: StoreOpt = None,
    allow_other: AllowOtherOpt = None,
    log_level: LogLevelOpt = None,
    log_file: LogFileOpt = None,
    log_format: LogFormatOpt = None,
    read_only: ReadOnlyOpt = None,
    adopt_store: AdoptStoreOpt = None,
    create_store: CreateStoreOpt = None,
    s3_endpoint: S3EndpointOpt = None,
    s3_region: S3RegionOpt = None,
    s3_profile: S3ProfileOpt = None,
    s3_addressing_style: S3AddressingOpt = None,
    options: OptionsOpt = None,
) -> None:
    """Print the configuration a mount with these flags would use (as TOML, credentials as
    ***), or the one-line error that mount would fail with. Checks no store."""
    from ckptfs.config import to_toml

    config_file, _, config = _configure(config_file, options, _flags(
        staging, store, allow_other, log_level, log_file, log_format, read_only, create_store,
        adopt_store, s3_endpoint, s3_region, s3_profile, s3_addressing_style))
    print(f"# effective configuration: {config_file or 'embedded defaults'}, with the flags "
          "given")
    print(to_toml(config), end="")


def _check_stores(config: Config) -> list[str]:
    """A file-tier store must exist (or be created on request); returns the warnings (a
    local store)."""
    from ckptfs.store.check import check_stores

    return check_stores(config)


def _spawn_daemon(mountpoint: Path, config_file: Path | None, overrides: dict[str, Any]
                  ) -> tuple[list[str], str]:
    """Start ``mount --foreground`` detached and relay its readiness or its one-line error;
    returns the warnings it reported before it was ready (one line each) and its note on a
    mount that is ready ("" without one)."""
    from ckptfs.ops.mounthelper import format_option

    args = [sys.executable, "-m", "ckptfs", "mount", os.path.abspath(mountpoint), "--foreground"]
    if config_file is not None:
        args += ["--config", str(config_file)]
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in ("staging_dir", "store"):
            args += ["-o", format_option(key, value)]  # the same keys as mount options
            continue
        flag = "--" + ("staging" if key == "staging_dir" else key.replace("_", "-"))
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    read_end, write_end = os.pipe()
    args += ["--ready-fd", str(write_end)]
    # The daemon runs in "/" (it must not keep a directory busy); make it import the very
    # ckptfs this command runs, not whichever one "/" would find.
    env = dict(os.environ)
    # Only the process systemd started may notify it (NotifyAccess=main); not this daemon.
    env.pop("NOTIFY_SOCKET", None)
    package_root = str(Path(__file__).resolve().parents[2])  # above ckptfs/ops/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            args, stdin=devnull, pass_fds=(write_end,), start_new_session=True, cwd="/",
            env=env,
        )
    os.close(write_end)
    warnings, message = _read_ready(read_end, proc)
    if message != "ok" and not message.startswith("ok "):
        raise UserError(message.removeprefix("error: "), exit_code=1)
    return warnings, message[3:]


def _ready_line(config: Config, mountpoint: Path) -> str:
    """The one line a successful mount prints: where the mount is and where its bytes go."""
    tiers = [f"hot {config.staging_dir}"]
    for tier in config.tier:
        if tier.url is None:
            continue
        where = f"{tier.name} {tier.url}"
        if tier.endpoint_url:
            where += f" (endpoint {tier.endpoint_url})"
        tiers.append(where)
    ro = " (read-only)" if config.read_only else ""
    return f"ckptfs: {os.path.abspath(mountpoint)} ready{ro}: {', '.join(tiers)}"


# The daemon's report through --ready-fd: zero or more "warning: ..." lines, then "ok" or
# "error: ...", then the end of the pipe.
WARNING_PREFIX = "warning: "


def _read_ready(fd: int, proc: subprocess.Popen[bytes]) -> tuple[list[str], str]:
    """The warnings the daemon reported and its last word ("ok" or "error: ...")."""
    chunks = []
    deadline = time.monotonic() + READY_TIMEOUT
    with os.fdopen(fd, "rb") as pipe:
        while time.monotonic() < deadline:
            chunk = pipe.read(4096)
            if not chunk:
                break
            chunks.append(chunk)
    lines = [line.strip() for line in b"".join(chunks).decode(errors="replace").splitlines()]
    warnings = [line.removeprefix(WARNING_PREFIX) for line in lines
                if line.startswith(WARNING_PREFIX)]
    last = [line for line in lines if line and not line.startswith(WARNING_PREFIX)]
    if last:
        return warnings, last[-1]
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return warnings, (f"error: the ckptfs daemon (pid {proc.pid}) did not report the "
                          "mount as ready")
    return warnings, f"error: the ckptfs daemon exited (code {code}) before the mount was ready"


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc`` (a trio nursery wraps what its tasks raised in groups)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _mount_failure(exc: BaseException) -> UserError | None:
    """Why a mount failed, as the one line a user reads: the user error inside ``exc`` if
    there is one, else the first real exception (a bug: the traceback goes to the log).
    None for a plain stop (a signal, a cancellation)."""
    import trio

    leaves = [leaf for leaf in _leaves(exc)
              if not isinstance(leaf, (trio.Cancelled, KeyboardInterrupt, SystemExit))]
    for leaf in leaves:
        if isinstance(leaf, UserError):
            return leaf
    if not leaves:
        return None
    leaf = leaves[0]
    return UserError(f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__)


def _serve_foreground(config: Config, mountpoint: Path, ready_fd: int | None) -> None:
    import trio

    from ckptfs.fuse.passthrough import use_patched_pyfuse3

    def send(line: str) -> None:
        if ready_fd is not None:
            try:
                os.write(ready_fd, " ".join(line.split()).encode() + b"\n")
            except OSError:
                pass  # the parent is gone; nobody is waiting for the answer

    def report(message: str) -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            send(message)
            os.close(ready_fd)
            ready_fd = None

    def warn(message: str) -> None:
        if ready_fd is not None:
            send(WARNING_PREFIX + message)
        else:  # in the foreground (systemd): where the log goes too
            print("ckptfs: warning: " + message, file=sys.stderr, flush=True)

    detached = ready_fd is not None
    try:
        _setup_logging(config)
    except UserError as exc:
        if ready_fd is None:
            raise
        report(f"error: {exc}")
        raise SystemExit(exc.exit_code) from None
    # Before ckptfs.ops.mount imports pyfuse3: the passthrough build unless passthrough = off.
    use_patched_pyfuse3(config.passthrough)
    from ckptfs.ops import mount as mount_mod

    try:
        real_mountpoint, staging, claim = mount_mod.prepare(config, mountpoint)
    except UserError as exc:
        if ready_fd is None:
            raise
        # The parent prints the one line; printing it here too would show it twice.
        report(f"error: {exc}")
        raise SystemExit(exc.exit_code) from None
    log_path = staging.root / mount_mod.LOG_NAME
    if detached:
        # Detached: from here on, logs go to the staging directory.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    try:
        trio.run(mount_mod.serve, config, real_mountpoint, staging,
                 lambda note: report(f"ok {note}".strip()), claim, warn)
    except BaseException as exc:
        failure = _mount_failure(exc)
        if failure is None:
            raise
        bug = not any(isinstance(leaf, UserError) for leaf in _leaves(exc))
        logging.getLogger("ckptfs.ops.mount").error(
            "mount of %s failed: %s", real_mountpoint, failure, exc_info=exc if bug else None)
        where = config.log_file or (log_path if detached else "the daemon's log (stderr)")
        text = str(failure) + (f" (details in {where})" if bug else "")
        if detached:
            report(f"error: {text}")
            raise SystemExit(failure.exit_code if not bug else 1) from None
        raise UserError(text, exit_code=failure.exit_code) from None


@app.command()
def umount(
    mountpoint: Annotated[Path, typer.Argument(
        metavar="MOUNTPOINT", help="A ckptfs mountpoint.")],
    wait: Annotated[bool, typer.Option(
        "--wait/--no-wait",
        help="Wait for pending uploads first (--no-wait leaves them for the next mount).",
    )] = True,
    timeout: Annotated[float | None, typer.Option(
        help="Give up waiting for uploads after this many seconds.", show_default=False,
        callback=_seconds)] = None,
    lazy: Annotated[bool, typer.Option("--lazy", "-z", help="Detach even if busy.")] = False,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Exit with code 3 if files are left not uploaded (with --no-wait "
        "or --lazy).")] = False,
) -> None:
    """Wait for pending uploads, unmount, and wait for the daemon to exit.

    Files left not uploaded (--no-wait, --lazy) are named on stderr with where they stay."""
    entry = find(mountpoint)
    if entry is None:
        if not os.path.lexists(mountpoint):
            raise UserError(f"{mountpoint} does not exist")
        raise UserError(f"{mountpoint} is not mounted")
    if entry.fstype != FSTYPE:
        raise UserError(f"{mountpoint} is not a ckptfs mount (it is {entry.fstype})")
    info = client.daemon_info(Path(entry.mountpoint))
    try:
        if wait and info is not None and not _sync_with_progress(
                entry.mountpoint, "", timeout, "uploading before unmount"):
            raise UserError(
                f"uploads to the store did not finish within {timeout:.0f}s; not unmounted "
                "(see 'ckptfs status', or use --no-wait)", exit_code=1)
    except UserError as exc:
        if exc.exit_code != 130:
            raise
        raise UserError(f"interrupted: {entry.mountpoint} is still mounted and its daemon "
                        f"goes on uploading (watch it with 'ckptfs status "
                        f"{entry.mountpoint}'; 'ckptfs umount {entry.mountpoint}' again to "
                        "wait and unmount, --no-wait to unmount now)", exit_code=130) from None
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [entry.mountpoint]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        if "busy" in reason.lower():
            reason = "it is busy (files are open or a process has its cwd there); try --lazy"
        raise UserError(f"cannot unmount {mountpoint}: {reason}", exit_code=1)
    pid = info.get("pid") if info else None
    if not isinstance(pid, int):
        return
    staging = Path(str(info.get("staging_dir"))) if info and info.get("staging_dir") else None
    # Detached while files are open, the daemon serves them (and goes on uploading) until
    # they are closed: say so rather than wait for it.
    if not _wait_exit(pid, LAZY_EXIT_WAIT if lazy else DAEMON_EXIT_TIMEOUT):
        if not lazy:
            raise UserError(
                f"unmounted, but daemon {pid} is still running after "
                f"{DAEMON_EXIT_TIMEOUT:.0f}s", exit_code=1)
        print(f"ckptfs: detached {entry.mountpoint}; the daemon (pid {pid}) serves the files "
              f"still open there until they are closed, then exits; files it has not "
              f"uploaded by then stay in {staging or 'its staging directory'} and go up at "
              "the next mount (its log says how many)", file=sys.stderr)
        if strict:
            raise SystemExit(EXIT_LEFT_BEHIND)
        return
    report = None if staging is None else _stop_report(staging, pid)
    if report is None:
        return
    files, size = int(report.get("files") or 0), int(report.get("bytes") or 0)
    if files:
        print(f"ckptfs: {count(files, 'file')} ({_human(size)}) not uploaded; "
              f"{plural(files, 'it stays', 'they stay')} in {staging} and "
              f"{plural(files, 'goes', 'go')} up at the next mount", file=sys.stderr)
    if report.get("registered"):
        print(f"ckptfs: node {report.get('node')} stays registered: the commit markers of "
              "the other nodes mounting this store wait for it until it is mounted again "
              "and has uploaded them (or 'ckptfs nodes --forget' on another node)",
              file=sys.stderr)
    if files and strict:
        raise SystemExit(EXIT_LEFT_BEHIND)


def _stop_report(staging: Path, pid: int) -> dict[str, Any] | None:
    from ckptfs.cluster.noderun import read_stop_report

    return read_stop_report(staging, pid)


@app.command()
def sync(
    path: Annotated[Path, typer.Argument(
        metavar="PATH", help="A ckptfs mount, or a path in one.")] = Path("."),
    timeout: Annotated[float | None, typer.Option(
        help="Give up after this many seconds (exit code 1).", show_default=False,
        callback=_seconds)] = None,
) -> None:
    """Wait until everything closed so far (under PATH) is committed to the warm tier."""
    entry, rel = client.locate(_existing(path))
    if not _sync_with_progress(entry.mountpoint, rel, timeout, "committing"):
        raise UserError(f"not everything under {path} was committed within {timeout:.0f}s "
                        "(see 'ckptfs status')", exit_code=1)


def _sync_with_progress(mountpoint: str, rel: str, timeout: float | None, what: str) -> bool:
    """``client.sync`` with a progress bar on a terminal, a line every
    ``BATCH_PROGRESS_EVERY`` seconds elsewhere. Ctrl-C: one line saying the uploads go on
    (exit code 130)."""
    from rich.progress import BarColumn, TextColumn, TimeRemainingColumn

    columns = (TextColumn(f"[bold]{what}"), BarColumn(), *byte_columns(),
               TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
    started = time.monotonic()
    last_line = started
    try:
        with _progress(*columns) as bar:
            task = bar.add_task(what, total=None, note="")

            def show(reply: dict[str, Any]) -> None:
                nonlocal last_line
                total = int(reply.get("total_bytes", 0))
                done = total - int(reply["pending_bytes"])
                errors = reply.get("errors") or []
                waiting = reply.get("waiting") or []
                note = (f"{count(reply['pending_files'], 'file')} left"
                        + (f"; retrying: {errors[0]}" if errors else "")
                        + (f"; {waiting[0]}" if waiting and not errors else ""))
                bar.update(task, total=total or None, completed=done, note=note)
                now = time.monotonic()
                if bar.disable and now - last_line >= BATCH_PROGRESS_EVERY:
                    # No terminal (a batch job's log): a line now and then instead of a bar.
                    last_line = now
                    rate = done / max(now - started, 1e-9)
                    print(f"ckptfs: {what}: {_human(done)} of {_human(total)} "
                          f"({_human(rate)}/s), {note}", file=sys.stderr, flush=True)

            return client.sync(mountpoint, rel, timeout, show)
    except KeyboardInterrupt:
        raise UserError(f"interrupted: the daemon of {mountpoint} goes on uploading in the "
                        f"background (watch it with 'ckptfs status {mountpoint}', or wait "
                        f"again with 'ckptfs sync {mountpoint}')", exit_code=130) from None


def byte_columns() -> tuple[Any, ...]:
    """Progress columns of bytes done / total and the rate, in binary units (MiB) as
    ``status`` counts, not rich's decimal MB."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Done(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = "?" if task.total is None else human_bytes(task.total)
            return Text(f"{human_bytes(task.completed)}/{total}", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s",
                        style="progress.data.speed")

    return Done(), Rate()


@app.command()
def evict(
    path: Annotated[Path | None, typer.Argument(
        metavar="PATH",
        help="A file or directory on a ckptfs mount; with --staging, a path relative to the "
        "mount root (default: everything).", show_default=False)] = None,
    staging: Annotated[Path | None, typer.Option(
        "--staging", help="Evict offline, from this unmounted staging directory (e.g. one "
        "too full to mount).", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="With --staging: say what would be evicted, change nothing.")
    ] = False,
) -> None:
    """Drop the NVMe copies of committed files under PATH (they stay readable from the store).

    With --staging DIR: offline, on an unmounted staging directory (one too full to mount,
    docs/OPERATIONS.md); PATH is then relative to the mount root."""
    if staging is not None:
        _evict_offline(staging, path, dry_run)
        return
    if path is None:
        raise UserError("evict needs a PATH on a ckptfs mount (or --staging DIR, offline)")
    if dry_run:
        raise UserError("--dry-run is for an offline eviction (--staging DIR)")
    entry, rel = client.locate(_existing(path))
    reply = client.evict(entry.mountpoint, rel)
    print(f"evicted {count(reply['evicted_files'], 'file')}, freed "
          f"{_human(reply['freed_bytes'])}")
    if reply.get("kept_count"):
        print(f"kept {count(reply['kept_count'], 'file')} that are open or not committed yet:")
        for line in reply.get("kept", []):
            print(f"  {line}")


def _evict_offline(staging: Path, prefix: Path | None, dry_run: bool) -> None:
    from ckptfs.lifecycle.offline_evict import evict_offline
    from ckptfs.state.staging import MIN_FREE_BYTES_TO_MOUNT

    done = evict_offline(Path(os.path.abspath(staging.expanduser())),
                         str(prefix) if prefix is not None else "", dry_run)
    if dry_run:
        print(f"would evict {count(done.evicted_files, 'file')}, freeing "
              f"{_human(done.freed_bytes)} (dry run: nothing changed)")
    else:
        print(f"evicted {count(done.evicted_files, 'file')}, freed {_human(done.freed_bytes)}")
    if done.kept:
        print(f"kept {count(len(done.kept), 'file')} on the NVMe:")
        for line in done.kept[:20]:
            print(f"  {line}")
    free = f"{_human(done.free_bytes)} free on the staging filesystem"
    if dry_run:
        free = (f"{_human(done.free_before)} free on the staging filesystem now, "
                f"{_human(done.free_bytes)} after")
    if done.mountable:
        print(free)
    else:
        print(f"{free}: {'would be ' if dry_run else ''}still too full to mount (at least "
              f"{MIN_FREE_BYTES_TO_MOUNT // (1024 * 1024)} MiB needed)")


@app.command()
def restore(
    path: Annotated[Path, typer.Argument(
        metavar="PATH", help="A file or directory on a ckptfs mount.")],
    days: Annotated[int, typer.Option(min=1, help="How long the store keeps the temporary "
                                      "restored copy (it is also copied to the warm tier), "
                                      "and retention keeps the checkpoint there (a pin, "
                                      "shown by ls-tiers).")] = 1,
    local: Annotated[bool, typer.Option(
        "--local", help="Also fetch the restored files to the local NVMe (pinned there for "
        "--days too).")] = False,
    poll_interval: Annotated[float, typer.Option(
        min=0.01, help="Seconds between checks of the store.", callback=_seconds)] = 30.0,
    timeout: Annotated[float | None, typer.Option(
        help="Give up waiting after this many seconds (exit code 1); the restore goes on.",
        show_default=False, callback=_seconds)] = None,
) -> None:
    """Restore files held only in an archive storage class (GLACIER, DEEP_ARCHIVE): request the
    restore, wait with progress, then keep them in the warm tier."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    entry, rel = client.locate(path)
    columns = (TextColumn("[bold]restoring"), BarColumn(), byte_columns()[0],
               TimeElapsedColumn(), TextColumn("{task.fields[note]}"))
    with _progress(*columns) as bar:
        task = bar.add_task("restore", total=None, note="")

        def show(reply: dict[str, Any]) -> None:
            waiting = reply.get("waiting") or []
            bar.update(task, total=reply["total_bytes"] or None,
                       completed=reply["restored_bytes"],
                       note=f"{reply['restored_files']}/{count(reply['files'], 'file')}"
                       + (f"; waiting for {waiting[0]}" if waiting else ""))

        result = client.restore(entry.mountpoint, rel, days=days, local=local,
                                poll_interval=poll_interval, timeout=timeout, on_progress=show)
    if result is None:
        raise UserError(f"{path}: not restored within {timeout:.0f}s; the store goes on with "
                        "it (run the command again to wait)", exit_code=1)
    if not result.get("files"):
        print(f"{path}: nothing to restore (no file there is only in an archive class)")
    else:
        print(f"restored {count(result['restored_files'], 'file')} "
              f"({_human(result['restored_bytes'])}) to the warm tier")


def _err_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _progress(*columns: Any) -> Any:
    """A transient progress bar on stderr, only on a terminal: elsewhere it would print a
    blank line when it stops, and an error after it would no longer be one line."""
    from rich.progress import Progress

    console = _err_console()
    return Progress(*columns, transient=True, console=console, disable=not console.is_terminal)


@app.command()
def status(
    mountpoint: Annotated[Path | None, typer.Argument(
        metavar="MOUNTPOINT",
        help="A ckptfs mount (default: every ckptfs mount).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Queue, rates, failures and incomplete files of live mounts."""
    if mountpoint is not None:
        targets = [client.locate(mountpoint)[0].mountpoint]
    else:
        targets = [m.mountpoint for m in client.ckptfs_mounts()]
        if not targets:
            if as_json:
                print("[]")
                return
            raise UserError("no ckptfs mount is active")
    reports = []
    for target in targets:
        try:
            reports.append(client.status(target))
        except (UserError, OSError) as exc:
            if mountpoint is not None:
                raise UserError(str(exc), exit_code=1) from None
            reports.append({"mountpoint": target, "error": str(exc)})
    silent = [r for r in reports if "error" in r]
    if as_json:
        print(json.dumps(reports if mountpoint is None else reports[0], indent=2))
        _no_answer(silent)
        return
    from rich.table import Table

    out = console()
    for r in reports:
        if "error" in r:
            out.print(f"[red]ckptfs {r['mountpoint']}: {r['error']}")
            continue
        table = Table(title=f"ckptfs {r['mountpoint']}", show_header=False, title_justify="left")
        for name, value in _status_rows(r):
            table.add_row(name, value)
        out.print(table)
    _no_answer(silent)


def _status_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of ``status``'s table for one mount's report (``--json`` has it all)."""
    rows = [("daemon", f"pid {r['pid']}, up {r['uptime_s']:.0f}s")]
    tiers = r.get("tiers") or [{"name": "warm", "url": r["warm_tier"]}]
    rows.append(("tiers", "\n".join(f"{t['name']}: {t['url']}" for t in tiers)))
    staging = r["staging"]
    rows.append(("staging", (f"{r['staging_dir']}: {_human(staging.get('used_bytes', 0))} "
                 f"held, {_human(staging['free_bytes'])} free of "
                 f"{_human(staging['total_bytes'])}")))
    queue = r["queue"]
    rows.append(("queue", f"{count(queue['files'], 'file')}, {_human(queue['bytes'])}"))
    rows.append(("uploaded", (f"{count(r['uploaded']['files'], 'file')}, "
                 f"{_human(r['uploaded']['bytes'])}")))
    rate = f"{_human(r['upload_rate_bytes_per_s'])}/s"
    unavailable = r.get("store_unavailable_since")
    if unavailable is not None:
        rate += f"; no ETA: the store is unavailable since {_clock(unavailable)}"
    elif r.get("eta_s"):
        rate += f", ETA {_duration(r['eta_s'])}"
    rows.append(("upload rate", rate))
    if "fetch" in r:
        rows.append(("fetched", (f"{_human(r['fetch']['bytes'])}, "
                     f"{_human(r['fetch']['rate_bytes_per_s'])}/s")))
        stalled = f"{r['write_stall_s']:.1f}s"
        wait = (r.get("node") or {}).get("registration_wait")
        if wait:
            stalled += (f"; now {_waiting(wait['requests'])} for this node's registration "
                        f"in the store, since {_clock(wait['since'])} "
                        f"({wait['waiting_s']:.0f}s; they fail with EIO after "
                        f"{wait['limit_s']:.0f}s, register_timeout)"
                        + (f": {wait['error']}" if wait.get("error") else ""))
        rows.append(("writers stalled", stalled))
    pt = r.get("passthrough")
    if pt:
        rows.append(("passthrough", (
            f"active: {pt['opens']['passthrough']} opens served by the kernel, "
            f"{pt['opens']['daemon']} by the daemon") if pt["active"]
            else f"off: {pt['reason']}"))
    loop = r.get("loop")
    if loop:
        rows.append(("daemon loop", (
            f"longest stall {loop['recent_longest_stall_s'] * 1000:.0f} ms in the last "
            f"5 min ({loop['longest_stall_s'] * 1000:.0f} ms since the mount, "
            f"{loop['stalls']} over 100 ms); {loop['gc_full_collections']} full garbage "
            f"collections, longest {loop['gc_longest_s'] * 1000:.0f} ms")))
    held = r.get("upload_yield")
    if held and held["holding"]:
        rows.append(("uploads", (f"yield to the job: {count(held['open_files'], 'file')} "
                                 "open on the mount (at most upload_hold_max; 'ckptfs sync' "
                                 "does not wait)")))
    outage = r.get("store_outage")
    if outage:
        rows.append(("store", (f"down for {outage['down_for_s']:.0f}s "
                     f"({outage['failures_in_a_row']} failures in a row); next probe in "
                     f"{outage['next_probe_in_s']:.0f}s, the queue waits for it")))
    failed = r["failed"]
    more = r.get("failed_count", len(failed)) - len(failed)
    rows.append(("failing", "\n".join(_failing(f) for f in failed)
                 + (f"\n... and {more} more" if more > 0 else "") or "none"))
    writing = r.get("open_for_writing") or []
    more = r.get("open_for_writing_count", len(writing)) - len(writing)
    rows.append(("open for writing", "\n".join(writing)
                 + (f"\n... and {more} more" if more > 0 else "") or "none"))
    rows.append(("incomplete", "\n".join(r["incomplete"]) or "none"))
    node = r.get("node")
    if node:
        rows.append(("node", node["node"] + ("" if node["registered"] else " (not registered)")))
        if node["held_markers"]:
            rows.append(("markers held", _held_text(r["mountpoint"], node)))
        hold = node.get("hold")
        if hold:
            held = ", ".join(hold.get("barriers") or []) or "none yet"
            rows.append(("holding", f"{hold['reason']}\nbarriers held: {held}"))
        if node["error"]:
            rows.append(("coordination", node["error"]))
    return rows


def _failing(item: dict[str, Any]) -> str:
    """One failing item: what, the error, the attempts and when the next one comes."""
    attempts = item.get("attempts")
    retry = item.get("retry_in_s")
    when = ("next try after the store answers a probe" if retry is None
            else f"next try in {_duration(retry)}")
    tried = "" if attempts is None else f"{count(attempts, 'attempt')}, "
    return f"{item['item']}: {item['error']} ({tried}{when})"


def _waiting(requests: dict[str, int]) -> str:
    """``"1 mkdir waits"``, ``"3 requests (create, mkdir) wait"``."""
    n = sum(requests.values())
    if len(requests) == 1:
        return f"{n} {next(iter(requests))} {plural(n, 'waits', 'wait')}"
    return f"{n} requests ({', '.join(sorted(requests))}) wait"


def _clock(when: float) -> str:
    """A wall time as an operator reads it in a report: ``12:03:04`` (today) or the date."""
    local = time.localtime(when)
    if time.strftime("%Y-%m-%d", local) == time.strftime("%Y-%m-%d"):
        return time.strftime("%H:%M:%S", local)
    return time.strftime("%Y-%m-%d %H:%M:%S", local)


def _duration(seconds: float) -> str:
    """``"45s"``, ``"12m 5s"``, ``"3h 20m"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


@app.command()
def nodes(
    mountpoint: Annotated[Path, typer.Argument(
        metavar="MOUNTPOINT", help="A ckptfs mount.")] = Path("."),
    forget: Annotated[str | None, typer.Option(
        help="Remove this dead node's registration: markers stop waiting for its uploads. "
        "Also ends the hold of a node back from a power loss (its own id on that node).",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The nodes sharing this mount's store; markers wait for every one of them."""
    entry, _ = client.locate(mountpoint)
    reply = client.nodes(entry.mountpoint, forget)
    if as_json:
        print(json.dumps(reply, indent=2))
        return
    from rich.table import Table

    table = Table("node", "host", "pid", "registered", "last seen", "not uploaded", "",
                  title_justify="left", title=f"nodes of the store of {entry.mountpoint}")
    for n in reply["nodes"]:
        since = n.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
        note = "this node" if n.get("self") else (
            "a marker waits for it" if n.get("waited_for") else "")
        if n.get("hold"):
            note = (note + "; " if note else "") + "holding barriers (see its 'ckptfs status')"
        pending = "?" if n.get("pending_files") is None else \
            f"{count(n['pending_files'], 'file')}, {_human(n.get('pending_bytes') or 0)}"
        table.add_row(n["node"], str(n.get("host", "?")), str(n.get("pid", "?")), when,
                      _ago(n.get("seen_ago_s")), pending, note)
    console().print(table)
    if reply.get("held_markers"):
        print(f"markers held on this node: {', '.join(reply['held_markers'])}")


def _ago(seconds: object) -> str:
    """'12s ago', '5m ago', '3h ago'; '?' when unknown (a node of an older ckptfs)."""
    if not isinstance(seconds, (int, float)):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _held_text(mountpoint: str, node: dict[str, Any]) -> str:
    """Which markers wait, for which nodes, what those nodes last said, and what to do."""
    held = ", ".join(node["held_markers"])
    if not node["waiting_for"]:
        return f"{held}: waiting for the barrier to be posted"
    infos = node.get("waiting_for_info") or {}
    lines = [f"{held}: waiting for"]
    for name in node["waiting_for"]:
        info = infos.get(name) or {}
        files = info.get("pending_files")
        lines.append(f"  {name} (host {info.get('host', '?')}, last seen "
                     f"{_ago(info.get('seen_ago_s'))}"
                     + ("" if files is None else f", {count(files, 'file')} not uploaded")
                     + ")")
    lines.append(f"a slow node needs nothing; one that is gone for good (check its host "
                 f"first) is dropped with 'ckptfs nodes {mountpoint} --forget ID': the "
                 "markers then go out without its files")
    return "\n".join(lines)


@app.command("ls-tiers")
def ls_tiers(
    mountpoint: Annotated[Path | None, typer.Argument(
        metavar="MOUNTPOINT",
        help="A ckptfs mount (default: the configured staging directory's daemon, or none).",
        show_default=False)] = None,
    config_file: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Each checkpoint's state in every tier, the rule keeping it, the next action; costs."""
    from ckptfs.ops import retention_cli

    retention_cli.run_ls_tiers(mountpoint, config_path(config_file), as_json)


@app.command()
def retention(
    mountpoint: Annotated[Path | None, typer.Argument(
        metavar="MOUNTPOINT",
        help="A ckptfs mount (default: the configured staging directory's daemon, or none).",
        show_default=False)] = None,
    config_file: ConfigOpt = None,
    plan_only: Annotated[bool, typer.Option(
        "--plan/--apply", help="--plan: print what would happen (default); --apply: do it.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Apply the tiers' keep rules: copy, verify, remove, evict, delete (docs/RETENTION.md)."""
    from ckptfs.ops import retention_cli

    retention_cli.run_retention(mountpoint, config_path(config_file), not plan_only, as_json)


def _no_answer(silent: list[dict[str, Any]]) -> None:
    """Exit non-zero, after the report, when a daemon did not answer (monitoring relies on
    it), saying why for each."""
    if silent:
        raise UserError("; ".join(str(r["error"]) for r in silent), exit_code=1)


def _existing(path: Path) -> Path:
    """``path``, or a one-line error naming it: a typo must not sync or evict nothing and
    say it succeeded."""
    if not os.path.lexists(path):
        raise UserError(f"{path}: no such file or directory")
    return path


_human = human_bytes


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _fail(message: str, exit_code: int) -> None:
    print("ckptfs: error: " + " ".join(message.split()), file=sys.stderr)
    sys.exit(exit_code)


def main() -> None:
    try:
        # Not standalone: usage errors come back here and are printed as one line, like
        # every other user error, instead of click's multi-line box.
        code = app(prog_name="ckptfs", standalone_mode=False)
    except UserError as exc:
        _fail(str(exc), exc.exit_code)
    except _click_exc.NoArgsIsHelpError as exc:
        print(exc.format_message(), file=sys.stderr)
        sys.exit(exc.exit_code)
    except _click_exc.NoSuchOption as exc:
        if exc.option_name not in ("--version", "-V"):
            _fail(_usage_text(exc), exc.exit_code)
        # click would suggest the closest option of the command (--s3-region for mount).
        command = exc.ctx.command_path if exc.ctx is not None else "this command"
        _fail(f"{exc.option_name} is not an option of '{command}': the version is "
              "'ckptfs --version'", exc.exit_code)
    except _click_exc.UsageError as exc:
        _fail(_usage_text(exc), exc.exit_code)
    except _click_exc.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _usage_text(exc: Any) -> str:
    """A usage error as one line, with where to read more."""
    hint = ""
    if exc.ctx is not None:
        hint = f" (see '{exc.ctx.command_path} --help')"
    return str(exc.format_message()) + hint
