#!/usr/bin/env bash
# The FUSE layer on a many-core machine (run through the device tool, as root, from the repo root):
# a preflight (Python, trio, /dev/fuse, one real mount), then bench_fuse with 16 readers over
# request-loop variants (the daemon alone answering from the loops' table, the daemon alone with no
# table, 4 and 8 loop processes) and zero-message opens, then a
# ResNet-50 epoch fed from local disk and from a
# cachefs mount (disk tier, page cache dropped). Each stage has its own time limit and writes its
# results under $OUT as it goes, so a stage that fails or overruns leaves the others' figures.
# Needs trio/outcome/sniffio wheels in .whl (Python 3.12). FILES, READERS, ROUNDS override;
# LIST_FIRST=1 walks the tree before each disk-tier epoch (a loader that lists first).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
W=/var/tmp/cfb
if df -T /var/tmp | grep -q tmpfs; then W=$PWD/.cfb; fi
{
  date -u; nproc; uname -r; python3 --version; ls -la /dev/fuse
  grep -m1 'model name' /proc/cpuinfo; free -g | head -2; df -hT "$(dirname "$W")"
  grep -i fuse /proc/filesystems
  python3 -c "import trio, prometheus_client, cachefs.daemon; print('imports ok')"
} 2>&1 | tee "$OUT/preflight.log"
[ -e /dev/fuse ] || exit 3
# one real mount before the long runs: a machine whose FUSE cannot mount fails here, in seconds
mkdir -p "$W/pre/data/d" "$W/pre/mnt" && echo preflight > "$W/pre/data/d/f"
if ! timeout 60 python3 -m cachefs mount "file://$W/pre/data" "$W/pre/mnt" --cache-dir "$W/pre/cache" \
     --immutable --metrics-port 0 >> "$OUT/preflight.log" 2>&1; then
  tail -n 40 "$W/pre/cache/cachefs.log" >> "$OUT/preflight.log" 2>/dev/null; exit 4
fi
cat "$W/pre/mnt/d/f" >> "$OUT/preflight.log" 2>&1
python3 -m cachefs status "$W/pre/mnt" --json > "$OUT/preflight_status.json" 2>&1
python3 -m cachefs umount "$W/pre/mnt" >> "$OUT/preflight.log" 2>&1
grep -h '"passthrough"\|"protocol"' "$OUT/preflight_status.json" | head -3
timeout "${FUSE_LIMIT:-330}" python3 -m benchmarks.bench_fuse --files "${FILES:-10000}" --readers "${READERS:-16}" \
  --rounds "${ROUNDS:-2}" --fill read --keep --workdir "$W" --json "$OUT/fuse.json" ${LIST_FIRST:+--list-first} \
  --variants cachefs,--fuse-loops=0 cachefs,--fuse-loops=0,--fuse-loop-kind=thread \
    cachefs,--fuse-loops=4,--fuse-loop-kind=process cachefs,--fuse-loops=8,--fuse-loop-kind=process cachefs,--fuse-no-open \
  2>&1 | tee "$OUT/fuse.log"
for log in "$W"/cache-*/cachefs.log; do echo "== $log"; grep -v ' INFO ' "$log" | tail -n 20; done > "$OUT/daemon_logs.txt" 2>&1
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  mkdir -p "$W/mnt-train"
  python3 -m cachefs mount "file://$W/dataset/data" "$W/mnt-train" --cache-dir "$W/cache-cachefs" --immutable \
    --metrics-port 0 || exit 5
  timeout "${TRAIN_LIMIT:-200}" python3 -m benchmarks.bench_train --drop --root "local=$W/dataset/data/train" \
    --root "cachefs=$W/mnt-train/train" --workers "${READERS:-16}" --json "$OUT/train.json" 2>&1 | tee "$OUT/train.log"
  python3 -m cachefs status "$W/mnt-train" --json > "$OUT/status.json"
  python3 -m cachefs umount "$W/mnt-train"
fi
