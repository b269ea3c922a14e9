"""mount(8) integration: ``mount -t ckptfs SOURCE DIR -o key=value,...`` and fstab lines.

mount(8) runs ``/sbin/mount.ckptfs SOURCE DIR [-sfnv] [-o OPTIONS]``; that file is the thin
wrapper ``mount/mount.ckptfs`` (installed by ``mount/install.sh``), which runs ``main`` here.

- SOURCE is the warm tier: ``s3://bucket/prefix``, ``file:///dir`` or a directory; ``ckptfs``
  or ``none`` takes it from the config file.
- OPTIONS are configuration keys (``staging_dir=/nvme/ckptfs``, ``upload_concurrency=8``,
  ``fsync=remote``, a bare ``allow_other``), plus ``config=/etc/ckptfs/ckpt.toml`` and the warm
  tier's S3 settings (``s3_endpoint=http://minio:9000``, ``s3_region``, ``s3_profile``,
  ``s3_addressing_style=path``). The generic
  options fstab and systemd use (``defaults``, ``auto``, ``noauto``, ``_netdev``,
  ``nofail``, ``x-systemd.*``, ``noatime``, ...) are accepted and ignored. ``ro`` and ``rw``
  (and mount(8)'s ``-r``/``-w``) set the ``read_only`` key (the last one given wins).
  Set-id bits: ``ckptfs.suid`` turns the ``suid`` key on, ``nosuid`` (or ``ckptfs.nosuid``)
  off. mount(8) never passes ``suid``, ``dev`` nor ``exec`` to a helper (they are its
  defaults: it drops them, and reorders what it passes, VFS flags first), so in fstab only
  ``ckptfs.suid`` can ask for set-id bits, and ``nosuid`` with ``ckptfs.suid`` is refused
  (which came last cannot be known). ``ckptfs mount -o`` takes ``suid`` too (the last one
  given wins there). ``nodev`` is accepted (the mount always is); ``dev``, if it arrives
  (``ckptfs mount -o dev``), is refused.
- ``ckptfs mount -o OPTIONS`` takes the same options (``parse_options``).

The helper then execs ``ckptfs mount``, which returns once the mount is ready (or with the
daemon's one-line error), so ``mount`` and systemd's mount units see a ready mount.

Invariants: every bad option is reported as one line naming it, with a non-zero exit, before
anything is started. Credentials are refused as mount options: fstab is world-readable and
command lines show in ``ps``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.config import WARM_OVERRIDES, Config, did_you_mean, load_config
from ckptfs.errors import UserError

# Accepted and ignored: they mean something to mount(8), fstab or systemd, not to ckptfs.
GENERIC_OPTIONS = frozenset({
    "defaults", "auto", "noauto", "_netdev", "nofail", "user", "nouser", "users",
    "owner", "group", "exec", "noexec", "nodev", "async", "atime",
    "noatime", "relatime", "norelatime", "strictatime", "nostrictatime", "diratime",
    "nodiratime", "lazytime", "nolazytime", "iversion", "noiversion", "silent", "loud",
})
GENERIC_PREFIXES = ("x-", "X-", "comment=")
# Options ckptfs cannot honour: refused rather than silently ignored.
REFUSED_OPTIONS = {
    "sync": "'sync' is not supported (fsync=remote makes fsync wait for the store)",
    "dev": "ckptfs always mounts nodev (device files are not supported)",
}
# Generic options that are configuration keys (``suid = true`` in the config file).
# ``ckptfs.suid``: mount(8) keeps ``suid`` for itself (module docstring).
BOOL_ALIASES = {"suid": ("suid", True), "nosuid": ("suid", False),
                "ckptfs.suid": ("suid", True), "ckptfs.nosuid": ("suid", False),
                "ro": ("read_only", True), "rw": ("read_only", False)}
SECRET_KEYS = frozenset({"access_key_id", "secret_access_key"})
ALIASES = {"staging": "staging_dir"}
# Keys that are lists or tables: the config file's business, not a mount option's.
FILE_ONLY_KEYS = frozenset({"tier", "commit_markers"})
NO_SOURCE = ("ckptfs", "none", "")
EXIT_USAGE = 1  # mount(8): "incorrect invocation or permissions"


def option_keys() -> frozenset[str]:
    """The configuration keys that may be given as mount options, and the warm tier's S3
    settings (``s3_endpoint``, ``s3_region``, ``s3_profile``, ``s3_addressing_style``)."""
    return (frozenset(Config.model_fields) - FILE_ONLY_KEYS) | frozenset(WARM_OVERRIDES)


def split_options(text: str) -> list[str]:
    """Split ``a=1,b="x,y",c`` on the commas outside double quotes (quotes removed)."""
    items: list[str] = []
    current: list[str] = []
    quoted = False
    for char in text:
        if char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if quoted:
        raise UserError(f"unbalanced double quote in mount options {text!r}")
    items.append("".join(current))
    return [item for item in items if item]


def format_option(key: str, value: str | bool) -> str:
    """The inverse of ``split_options`` for one option (quoted when it holds a comma)."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if '"' in text:
        raise UserError(f"mount option {key}: a value cannot contain a double quote")
    return f'{key}="{text}"' if "," in text else f"{key}={text}"


@dataclass
class Options:
    """Mount options sorted out: the config file, config-key overrides, what was ignored."""

    config: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def parse_options(texts: Iterable[str], *, sloppy: bool = False) -> Options:
    """Parse ``-o`` strings (each ``key=value,...``); UserError naming the first bad option.

    ``sloppy`` (mount -s) ignores unknown options instead of refusing them.
    """
    keys = option_keys()
    bools = {k for k, f in Config.model_fields.items() if f.annotation is bool}
    result = Options()
    items = [item for text in texts for item in split_options(text)]
    if "ckptfs.suid" in items and "nosuid" in items:
        raise UserError("mount options 'ckptfs.suid' and 'nosuid' contradict each other (and "
                        "mount(8) does not keep their order): give one")
    for text in texts:
        for item in split_options(text):
            name, has_value, value = item.partition("=")
            name = name.strip()
            if item in GENERIC_OPTIONS or item.startswith(GENERIC_PREFIXES):
                result.ignored.append(item)
                continue
            if item in REFUSED_OPTIONS:
                raise UserError(f"mount option {item!r}: {REFUSED_OPTIONS[item]}")
            if item in BOOL_ALIASES:
                key, flag = BOOL_ALIASES[item]
                result.overrides[key] = flag
                continue
            if name in SECRET_KEYS:
                raise UserError(
                    f"mount option {name!r}: credentials do not belong in mount options "
                    "(fstab is world-readable); put them in the config file (mode 0600) or "
                    "the environment")
            name = ALIASES.get(name, name)
            if name == "config":
                if not value:
                    raise UserError("mount option 'config' needs a file: config=/path/ckptfs.toml")
                result.config = Path(os.path.abspath(Path(value).expanduser()))
                continue
            if name not in keys:
                if sloppy:
                    result.ignored.append(item)
                    continue
                raise UserError(f"unknown mount option {name!r}{did_you_mean(name, keys)} "
                                "(see docs/CONFIGURATION.md)")
            if not has_value:
                if name not in bools:
                    raise UserError(f"mount option {name!r} needs a value: {name}=...")
                result.overrides[name] = True
                continue
            result.overrides[name] = value
    return result


def flag_names(overrides: Iterable[str]) -> dict[str, str]:
    """How configuration errors name keys that came from mount options."""
    return {key: f"mount option {key}" for key in overrides}


# -- the helper mount(8) runs -------------------------------------------------------------


@dataclass
class HelperArgs:
    source: str
    mountpoint: str
    options: list[str] = field(default_factory=list)
    fake: bool = False
    verbose: bool = False
    sloppy: bool = False


USAGE = "usage: mount.ckptfs SOURCE DIR [-sfnv] [-o key=value,...]"


def parse_helper_args(argv: list[str]) -> HelperArgs:
    """``SOURCE DIR [-sfnvw] [-o OPTIONS] [-t TYPE] [-N NS]``, as mount(8) passes them."""
    positional: list[str] = []
    options: list[str] = []
    fake = verbose = sloppy = False
    args = iter(argv)
    # mount -r / -w: the same as -o ro / -o rw (given first: an explicit -o wins).
    access: list[str] = []
    for arg in args:
        if arg in ("-h", "--help"):
            raise UserError(USAGE, exit_code=0)
        if arg.startswith("-o"):
            value = arg[2:] or next(args, None)
            if value is None:
                raise UserError(f"-o needs options ({USAGE})", exit_code=EXIT_USAGE)
            options.append(value)
        elif arg in ("-t", "-N"):
            if next(args, None) is None:
                raise UserError(f"{arg} needs a value ({USAGE})", exit_code=EXIT_USAGE)
        elif arg.startswith(("-t", "-N")):
            continue  # -tckptfs: the type is ours, the namespace is mount(8)'s business
        elif arg.startswith("-") and len(arg) > 1:
            for flag in arg[1:]:
                if flag == "f":
                    fake = True
                elif flag == "v":
                    verbose = True
                elif flag == "s":
                    sloppy = True
                elif flag in "rw":
                    access = ["ro" if flag == "r" else "rw"]
                elif flag != "n":
                    raise UserError(f"unknown flag -{flag} ({USAGE})", exit_code=EXIT_USAGE)
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise UserError(f"expected SOURCE and DIR ({USAGE})", exit_code=EXIT_USAGE)
    return HelperArgs(positional[0], positional[1], access + options, fake, verbose, sloppy)


def mount_command(args: HelperArgs) -> list[str]:
    """The ``ckptfs mount`` command line for a helper call; UserError if an option is bad.

    Validates the whole configuration first, so a bad option fails here with one line.
    """
    try:
        parsed = parse_options(args.options, sloppy=args.sloppy)
    except UserError as exc:
        raise UserError(str(exc), exit_code=EXIT_USAGE) from None
    overrides = dict(parsed.overrides)
    source = None if args.source.strip().lower() in NO_SOURCE else args.source
    if source is not None:
        overrides["store"] = source
    names = {**flag_names(parsed.overrides), "store": "SOURCE"}
    try:
        load_config(parsed.config, overrides, flag_names=names)
    except UserError as exc:
        raise UserError(str(exc), exit_code=EXIT_USAGE) from None
    command = [sys.executable, "-m", "ckptfs", "mount", os.path.abspath(args.mountpoint)]
    if parsed.config is not None:
        command += ["--config", str(parsed.config)]
    if source is not None:
        command += ["--store", source]
    for key, value in parsed.overrides.items():
        command += ["-o", format_option(key, value)]
    return command


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_helper_args(argv)
        command = mount_command(args)
    except UserError as exc:
        if exc.exit_code == 0:
            print(exc)
            sys.exit(0)
        print("mount.ckptfs: error: " + " ".join(str(exc).split()), file=sys.stderr)
        sys.exit(exc.exit_code)
    if args.verbose:
        print("mount.ckptfs: " + " ".join(command), file=sys.stderr)
    if args.fake:
        return
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
