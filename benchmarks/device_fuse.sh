#!/usr/bin/env bash
# The FUSE layer on a many-core machine (run through the device tool, as root, from the repo root):
# bench_fuse with 16 readers over request-loop and passthrough variants, then a ResNet-50 epoch
# fed from local disk and from a cachefs mount (disk tier, page cache dropped).
# Needs trio/outcome/sniffio wheels in .whl (Python 3.12). FILES, READERS, ROUNDS override.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nproc; uname -r; ls -la /dev/fuse || exit 3
W=/var/tmp/cfb
if df -T /var/tmp | grep -q tmpfs; then W=$PWD/.cfb; fi
df -hT "$(dirname "$W")"
python3 -m benchmarks.bench_fuse --files "${FILES:-10000}" --readers "${READERS:-16}" --rounds "${ROUNDS:-2}" \
  --fill read --keep --workdir "$W" --json "$OUT/fuse.json" \
  --variants cachefs cachefs,--fuse-loops=0 cachefs,--fuse-loops=2 cachefs,--passthrough=off 2>&1 | tee "$OUT/fuse.log"
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  mkdir -p "$W/mnt-train"
  python3 -m cachefs mount "file://$W/dataset/data" "$W/mnt-train" --cache-dir "$W/cache-cachefs" --immutable \
    --metrics-port 0 || exit 4
  python3 -m benchmarks.bench_train --drop --root "local=$W/dataset/data/train" --root "cachefs=$W/mnt-train/train" \
    --workers "${READERS:-16}" --json "$OUT/train.json" 2>&1 | tee "$OUT/train.log"
  python3 -m cachefs status "$W/mnt-train" --json > "$OUT/status.json"
  python3 -m cachefs umount "$W/mnt-train"
fi
