"""Checks of a file-tier store path before a mount, and the identity of the warm tier.

A typo in ``--store`` must not end as a directory on the local disk: a file tier's path is
absolute and exists (``--create-store`` / ``create_store = true`` creates it); the embedded
default store (/var/lib/ckptfs/store) is ours and is created when missing. A store on the
same filesystem as the staging directory or as ``/`` is not shared storage: warned about.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from ckptfs.config import DEFAULT_STORE, Config
from ckptfs.errors import UserError


def file_tier_paths(config: Config) -> list[tuple[str, Path]]:
    """(tier name, directory) of every file tier of ``config``."""
    out = []
    for tier in config.tier:
        if tier.url is not None and urlsplit(tier.url).scheme == "file":
            out.append((tier.name, Path(unquote(urlsplit(tier.url).path))))
    return out


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_stores(config: Config) -> list[str]:
    """Raise ``UserError`` for a missing or unusable file-tier directory (creating it when
    allowed); return the warnings to print (one line each)."""
    warnings = []
    for name, path in file_tier_paths(config):
        default = path == DEFAULT_STORE
        if not path.is_absolute():  # config.validate_tier_url refuses these already
            raise UserError(f"the {name} tier's store must be an absolute path, not {path}")
        if not os.path.lexists(path):
            if not (config.create_store or default):
                raise UserError(
                    f"store directory {path} (the {name} tier) does not exist; is its "
                    "filesystem mounted? Create it, or mount with --create-store "
                    "(-o create_store)")
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise UserError(f"cannot create store directory {path}: "
                                f"{exc.strerror or exc}") from None
        if not path.is_dir():
            raise UserError(f"store {path} (the {name} tier) is not a directory")
        if default:
            continue  # the documented single-node default: local on purpose
        dev = os.stat(path).st_dev
        staging = _existing_ancestor(config.staging_dir)
        if dev == os.stat(staging).st_dev:
            same = f"the staging directory {config.staging_dir}"
        elif dev == os.stat("/").st_dev:
            same = "/"
        else:
            continue
        warnings.append(f"store {path} (the {name} tier) is on the same filesystem as {same}: "
                        "it is not shared storage and does not survive the loss of this node")
    return warnings


def store_identity(config: Config) -> str:
    """The warm tier, normalized: what a staging directory's files belong to. No query (a
    storage class is not another store), no trailing slash, a file path normalized; the S3
    endpoint when one is set."""
    url = config.warm.url
    assert url is not None
    parts = urlsplit(url)
    path = parts.path
    if parts.scheme == "file":
        path = os.path.normpath(unquote(path))
        return Path(path).as_uri()
    identity = urlunsplit((parts.scheme, parts.netloc, path.rstrip("/"), "", ""))
    endpoint = config.warm.endpoint_url
    if endpoint:
        identity += f" (endpoint {endpoint.rstrip('/')})"
    return identity
