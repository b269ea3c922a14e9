#!/usr/bin/env bash
# The main job on a fresh machine: install, mount ckptfs at /ckpt with the embedded default
# configuration (staging /var/lib/ckptfs/staging, warm tier /var/lib/ckptfs/store), run a
# small unmodified torch training loop that checkpoints there, show what ckptfs did, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh

MNT="${CKPT_MOUNT:-/ckpt}"
mkdir -p "$MNT"
ckptfs mount "$MNT"
trap 'ckptfs umount "$MNT" || fusermount3 -u -z "$MNT"' EXIT

python3 examples/train_demo.py --ckpt-dir "$MNT" --steps 200 --every 50
echo "--- the mount:"
ls -la "$MNT"
for f in "$MNT"/*; do
    printf '%-40s %s\n' "$(basename "$f")" "$(getfattr --only-values -n user.ckptfs.state "$f" 2>/dev/null)"
done
echo "--- waiting for the background uploads, then the warm tier (/var/lib/ckptfs/store):"
ckptfs sync "$MNT"
ckptfs status "$MNT"
ls -la /var/lib/ckptfs/store
echo "--- resuming from the latest checkpoint:"
python3 examples/train_demo.py --ckpt-dir "$MNT" --steps 250 --every 50
