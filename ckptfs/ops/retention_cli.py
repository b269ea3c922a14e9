"""``ckptfs ls-tiers`` and ``ckptfs retention``: with a live mount or without one.

With a live mount (a MOUNTPOINT argument, or a daemon answering on the configured staging
directory's control socket) the daemon answers: it sees uploads in flight and is the only one
that may change its namespace. Without one, this process reads the journal in the staging
directory and lists the stores itself; ``--apply`` then takes the staging directory's lock,
so that no daemon mounts it meanwhile.

The JSON (``--json``) is ``retention.report``'s: keys are only ever added.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ckptfs.config import Config, load_config
from ckptfs.errors import UserError
from ckptfs.humanize import console, human_bytes
from ckptfs.ops import client, controlsocket

JOURNAL_NAME = "journal.db"


def gather(mountpoint: Path | None, config_file: Path | None, apply: bool) -> dict[str, Any]:
    """The report (after applying, with ``apply``), from the daemon or from here."""
    payload = {"op": "retention", "apply": apply}
    if mountpoint is not None:
        entry, _ = client.locate(mountpoint)
        return _ask(client.control_socket(entry.mountpoint), payload, str(mountpoint))
    config = load_config(config_file)
    sock = controlsocket.socket_path(config.staging_dir)
    if sock.exists():
        try:
            return _ask(sock, payload, str(config.staging_dir))
        except OSError:
            pass  # a socket left by a daemon that died: nobody is serving this staging
    import trio

    from ckptfs.errors import CkptfsError

    try:
        result: dict[str, Any] = trio.run(_offline, config, apply)
    except UserError:
        raise
    except CkptfsError as exc:  # e.g. a journal this version cannot read
        raise UserError(str(exc), exit_code=1) from None
    return result


def _ask(sock: Path, payload: dict[str, Any], where: str) -> dict[str, Any]:
    timeout = None if payload.get("apply") else 120.0
    for reply in controlsocket.request(sock, payload, timeout=timeout):
        if "error" in reply:
            raise UserError(str(reply["error"]), exit_code=1)
        if "checkpoints" not in reply:
            raise UserError(f"the ckptfs daemon of {where} does not know retention "
                            "(an older version: remount)", exit_code=1)
        return reply
    raise UserError(f"the ckptfs daemon of {where} gave no answer", exit_code=1)


async def _offline(config: Config, apply: bool) -> dict[str, Any]:
    from ckptfs.engine.fs import Filesystem
    from ckptfs.errors import CkptfsError
    from ckptfs.lifecycle.retention import Retention
    from ckptfs.state.journal import Journal
    from ckptfs.state.staging import Staging

    staging: Staging | None = None
    journal: Journal | None = None
    fs: Filesystem | None = None
    if (config.staging_dir / JOURNAL_NAME).exists():
        staging = Staging(config.staging_dir)
        if apply:
            staging.prepare()  # the lock: no daemon may mount it while we change it
        journal = Journal(config.staging_dir / JOURNAL_NAME)
        fs = Filesystem(journal, staging, unlink_remote=config.unlink == "posix")
    # Applying from here is one more node applying the policy: under the lease too, as the
    # staging directory's node (or a one-off id when there is no staging directory). The
    # plan needs the id too: this node's own registration is not another writer (the
    # settle rule, checkpoints.settle).
    node = _node_id(config)
    retention = await Retention.open(config, fs=fs, node=node)
    try:
        done = (await retention.run_once()).as_dict() if apply else {}
        return {**done, **await retention.report()}
    except CkptfsError as exc:
        raise UserError(f"retention: {exc}", exit_code=1) from None
    finally:
        await retention.aclose()
        if journal is not None:
            journal.close()
        if staging is not None:
            staging.close()


def _node_id(config: Config) -> str:
    import os
    import socket

    from ckptfs.cluster.coordination import NODE_ID_FILE, node_id

    if config.node_id or (config.staging_dir / NODE_ID_FILE).exists():
        return node_id(config.staging_dir, config.node_id)
    return f"{socket.gethostname() or 'node'}-cli-{os.getpid()}"


# -- rendering ---------------------------------------------------------------------------


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}" if seconds >= 10 * size or unit == "m" \
                else f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


_STATE_STYLE = {"committed": "green", "absent": "dim", "partial": "yellow",
                "restoring": "cyan"}


def print_ls_tiers(report: dict[str, Any]) -> None:
    from rich.table import Table

    out = console()
    tiers = [t["name"] for t in report["tiers"]]
    table = Table(title="checkpoints", title_justify="left")
    table.add_column("name")
    table.add_column("step", justify="right")
    table.add_column("size", justify="right")
    table.add_column("age", justify="right")
    for t in tiers:
        table.add_column(t)
    table.add_column("kept by")
    table.add_column("next")
    for row in report["checkpoints"]:
        cells = []
        for t in tiers:
            state = row["tiers"][t]
            style = _STATE_STYLE.get(state.split()[0], "magenta")
            cells.append(f"[{style}]{state}[/]")
        table.add_row(
            row["name"], "-" if row["step"] is None else str(row["step"]),
            human_bytes(row["size"]), human_age(row["age_s"]), *cells,
            ", ".join(row["kept_by"]) or "-",
            "; ".join(row["next"]) or _skipped(row) or "-")
    out.print(table)
    costs = Table(title="tiers", title_justify="left")
    for column, justify in (("tier", "left"), ("url", "left"), ("bytes", "right"),
                            ("$/TB-month", "right"), ("$/month", "right")):
        costs.add_column(column, justify=justify)  # type: ignore[arg-type]
    for t in report["tiers"]:
        costs.add_row(t["name"], t["url"], human_bytes(t["bytes"]),
                      f"{t['cost_per_tb_month']:g}", f"{t['monthly_cost']:.2f}")
    costs.add_row("[bold]total", "", f"[bold]{human_bytes(report['total']['bytes'])}", "",
                  f"[bold]{report['total']['monthly_cost']:.2f}")
    out.print(costs)


def _skipped(row: dict[str, Any]) -> str | None:
    """Why retention leaves a checkpoint alone (or takes it as complete without a marker)."""
    note = row.get("note")
    return str(note) if note else None


def _print_skipped(report: dict[str, Any]) -> None:
    """Checkpoints the policy cannot manage yet, and why: a checkpoint without a marker would
    otherwise be missing from the plan without a word."""
    for row in report.get("checkpoints", []):
        if row.get("state") == "no marker" and row.get("note"):
            print(f"skipped  {row['name']}: {row['note']}")


def print_retention(report: dict[str, Any], applied: bool) -> None:
    _print_plan(report, applied)
    _print_skipped(report)


def _print_plan(report: dict[str, Any], applied: bool) -> None:
    if applied and report.get("skipped"):
        for a in report.get("done", []):  # evictions of this node's NVMe copies need no lease
            print(f"done     {a['checkpoint']}: {a['text']}")
        print(f"skipped: {report['skipped']}: copies, removals and deletions are left to it")
        for a in report["plan"]:
            print(f"pending  {a['checkpoint']}: {a['text']}")
        return
    if applied:
        for a in report.get("done", []):
            print(f"done     {a['checkpoint']}: {a['text']}")
        for a in report.get("failed", []):
            print(f"FAILED   {a['checkpoint']}: {a['text']}: {a['error']}")
        left = report["plan"]
        for a in left:
            print(f"pending  {a['checkpoint']}: {a['text']}")
        if not report.get("done") and not report.get("failed") and not left:
            print("nothing to do")
        return
    if not report["plan"]:
        print("nothing to do")
    for a in report["plan"]:
        print(f"{a['checkpoint']}: {a['text']}")


def run_ls_tiers(mountpoint: Path | None, config_file: Path | None, as_json: bool) -> None:
    report = gather(mountpoint, config_file, apply=False)
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print_ls_tiers(report)


def run_retention(mountpoint: Path | None, config_file: Path | None, apply: bool,
                  as_json: bool) -> None:
    started = time.monotonic()
    report = gather(mountpoint, config_file, apply=apply)
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return
    print_retention(report, apply)
    if apply and report.get("skipped"):
        raise UserError(f"retention not applied: {report['skipped']}", exit_code=1)
    if apply and report.get("failed"):
        raise UserError(f"{len(report['failed'])} retention actions failed "
                        f"(after {time.monotonic() - started:.0f}s); they are retried at the "
                        "next run", exit_code=1)
