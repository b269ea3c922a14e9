#!/usr/bin/env bash
# Build libfuse 3.17 and a pyfuse3 with FUSE passthrough support, beside the stock ones.
#
#   libfuse 3.17.2  from Debian trixie's source package (trixie's binary needs glibc 2.38; bookworm
#                   has 2.36), built with meson (PyPI) + ninja (Debian), installed in $PREFIX/lib.
#   pyfuse3 3.5.0   from its PyPI sdist with scripts/pyfuse3-passthrough.patch, linked against that
#                   libfuse (rpath), installed in $PREFIX/python: use it with PYTHONPATH=$PREFIX/python.
#                   The stock pyfuse3 in site-packages is left alone.
#
# Idempotent and cached: sources and the build venv stay in $CACHE, and a stamp naming the inputs
# (versions, this script, the patch, the Python) makes a second run a no-op check (<1 s).
# Needs root for the apt source line (/etc/apt/sources.list.d/ckptfs-trixie-src.list, a file of
# its own; system sources are not touched). Exit status 3 means a prerequisite could not be
# fetched (no network, no apt source): callers such as the tests may skip on it.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

PREFIX="${CKPTFS_FUSE_PREFIX:-/opt/ckptfs-fuse}"
CACHE="${CKPTFS_FUSE_CACHE:-/var/cache/ckptfs-fuse}"
PYTHON="${PYTHON:-python3}"
FUSE_VERSION=3.17.2
PYFUSE3_VERSION=3.5.0
PATCH="$HERE/pyfuse3-passthrough.patch"
APT_LIST=/etc/apt/sources.list.d/ckptfs-trixie-src.list
APT_LINE='deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main'

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
log() { echo "build_passthrough_fuse: $*" >&2; }
fetch_failed() { log "cannot fetch prerequisite: $*"; exit 3; }
# pip, minus the warnings this machine's pip.conf (index folders that may be absent) adds.
pipq() { "$VENV/bin/pip" "$@" --disable-pip-version-check 2> >(grep -v ' is ignored: ' >&2); }

PY_TAG="$("$PYTHON" -c 'import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())')"
KEY="$( { echo "$FUSE_VERSION $PYFUSE3_VERSION $PY_TAG $PREFIX"; cat "$0" "$PATCH"; } | sha256sum | cut -c1-16)"

installed_ok() {
    [ -f "$PREFIX/.stamp" ] && [ "$(cat "$PREFIX/.stamp")" = "$KEY" ] || return 1
    PYTHONPATH="$PREFIX/python" "$PYTHON" - "$PREFIX" <<'EOF' 2>/dev/null
import sys, pyfuse3
assert pyfuse3.__file__.startswith(sys.argv[1]), pyfuse3.__file__
assert hasattr(pyfuse3, "passthrough_open") and hasattr(pyfuse3.FileInfo(), "backing_id")
EOF
}

if installed_ok; then log "cached: $PREFIX ($KEY)"; exit 0; fi

$SUDO mkdir -p "$CACHE" "$PREFIX"
$SUDO chown "$(id -u):$(id -g)" "$CACHE" "$PREFIX"
exec 9>"$CACHE/lock"
flock 9                                  # two builds at once (tests in parallel) take turns
if installed_ok; then log "cached: $PREFIX ($KEY)"; exit 0; fi
START=$SECONDS
VENV="$CACHE/venv"

# --- tools: ninja and pkg-config from Debian, meson/Cython/setuptools in a venv of our own
if ! command -v ninja >/dev/null || ! command -v pkg-config >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq ninja-build pkg-config >/dev/null || fetch_failed "apt ninja-build"
fi
if ! "$VENV/bin/python" -c 'import mesonbuild, Cython, setuptools_scm' 2>/dev/null; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pipq install -q meson Cython 'setuptools>=78.1.1' \
        setuptools_scm wheel || fetch_failed "meson/Cython from PyPI"
fi

# --- libfuse source: Debian trixie's fuse3 source package (upstream tarball + Debian patches)
SRC="$CACHE/src"
FUSE_SRC="$SRC/fuse3-$FUSE_VERSION"
if [ ! -f "$FUSE_SRC/meson.build" ]; then
    if [ "$(cat "$APT_LIST" 2>/dev/null)" != "$APT_LINE" ]; then
        echo "$APT_LINE" | $SUDO tee "$APT_LIST" >/dev/null
    fi
    # Refresh only this list, so the system's own lists are neither fetched nor cleaned.
    $SUDO apt-get update -qq -o Dir::Etc::sourcelist="$APT_LIST" -o Dir::Etc::sourceparts=- \
        -o APT::Get::List-Cleanup=0 || fetch_failed "apt-get update (trixie deb-src)"
    mkdir -p "$SRC"
    (cd "$SRC" && apt-get source -qq fuse3 >/dev/null 2>&1) || fetch_failed "apt-get source fuse3"
    [ -f "$FUSE_SRC/meson.build" ] || {
        log "trixie's fuse3 is no longer $FUSE_VERSION: $(ls "$SRC")"; exit 1; }
fi

# --- build libfuse into $PREFIX (library and headers only: fusermount3 stays Debian's)
rm -rf "$CACHE/build-fuse" "$PREFIX/lib" "$PREFIX/include" "$PREFIX/python"
PATH="$VENV/bin:$PATH" meson setup "$CACHE/build-fuse" "$FUSE_SRC" --prefix="$PREFIX" \
    --libdir=lib --buildtype=release -Dutils=false -Dexamples=false -Dtests=false >/dev/null
ninja -C "$CACHE/build-fuse" >/dev/null
ninja -C "$CACHE/build-fuse" install >/dev/null

# --- pyfuse3: sdist (source only on PyPI), patched, built against $PREFIX's libfuse
SDIST="$SRC/pyfuse3-$PYFUSE3_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    # --no-build-isolation: fetching the sdist must not build setuptools from source for metadata.
    pipq download -q --no-deps --no-build-isolation \
        --no-binary pyfuse3 "pyfuse3==$PYFUSE3_VERSION" -d "$SRC" || fetch_failed "pyfuse3 sdist"
fi
rm -rf "$CACHE/build-pyfuse3" && mkdir -p "$CACHE/build-pyfuse3"
tar xzf "$SDIST" -C "$CACHE/build-pyfuse3"
PYSRC="$CACHE/build-pyfuse3/pyfuse3-$PYFUSE3_VERSION"
patch -s -p1 -d "$PYSRC" < "$PATCH"
rm -f "$PYSRC/src/pyfuse3/__init__.c"   # generated from the unpatched .pyx: let Cython redo it
PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$PREFIX/lib" \
    pipq install -q --no-deps --no-build-isolation \
    --target "$PREFIX/python" "$PYSRC" >/dev/null

echo "$KEY" > "$PREFIX/.stamp"
installed_ok || { log "built, but $PREFIX/python does not import as expected"; exit 1; }
log "built libfuse $FUSE_VERSION + pyfuse3 $PYFUSE3_VERSION (passthrough) in $PREFIX in $((SECONDS - START)) s"
