#!/usr/bin/env bash
# Install ckptfs's system integration on a node: the mount(8) helper /sbin/mount.ckptfs, the
# systemd template unit ckptfs@.service, and examples (a config, a .mount unit, an fstab
# line) under /usr/share/doc/ckptfs. ckptfs itself must be installed for $PYTHON first.
# Idempotent; needs root. DESTDIR=/some/root installs under a prefix instead (packaging,
# tests); then systemd is not reloaded.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
DESTDIR="${DESTDIR:-}"

# The real interpreter (not a pyenv shim or a venv's symlink chain resolved differently
# under systemd's minimal environment).
PYTHON="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
if ! "$PYTHON" -c 'import ckptfs' 2>/dev/null; then
    echo "mount/install.sh: ckptfs is not installed for $PYTHON (pip install it first)" >&2
    exit 1
fi

render() {  # render TEMPLATE DEST MODE
    local tmp
    tmp="$(mktemp)"
    sed "s|@PYTHON@|$PYTHON|g" "$1" >"$tmp"
    install -D -m "$3" "$tmp" "$2"
    rm -f "$tmp"
}

# mount(8) looks for helpers in /sbin (on merged-/usr systems that is /usr/sbin).
render "$here/mount.ckptfs" "$DESTDIR/sbin/mount.ckptfs" 0755
render "$here/ckptfs@.service" "$DESTDIR/etc/systemd/system/ckptfs@.service" 0644
install -d -m 0755 "$DESTDIR/etc/ckptfs"
docs="$DESTDIR/usr/share/doc/ckptfs/examples"
install -D -m 0644 "$here/ckptfs.toml" "$docs/ckptfs.toml"
install -D -m 0644 "$here/ckpt.mount" "$docs/ckpt.mount"
install -D -m 0644 "$here/fstab.example" "$docs/fstab.example"
install -D -m 0644 "$here/../docs/OPERATIONS.md" "$DESTDIR/usr/share/doc/ckptfs/OPERATIONS.md"

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
