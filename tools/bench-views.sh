#!/usr/bin/env bash
# Views benchmark (docs/PERFORMANCE.md): mount a 7B-shaped sparse GGUF and
# time, from the start of `rknot-mount` (background mode: it returns once the
# mount answers) to the first byte of model.safetensors, of model.gguf and of
# a .f32 file, each in a fresh mount, and read the daemon's RSS then. Needs
# root and fuse3.
#
#   tools/bench-views.sh [ROUNDS] [rknot-mount options...]
#   LAYERS=8 tools/bench-views.sh          # the same model with 8 blocks
#   MOUNT_BIN=/path/to/other/rknot-mount tools/bench-views.sh   # compare a build
#
# The model (examples/make_synth_model.rs --shape qwen2.5-7b --sparse) is
# written to $BENCH_DIR (default /tmp/rknot-bench-views); its data section is
# a hole, so it takes a few MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
shift || true
layers=${LAYERS:-28}
dir=${BENCH_DIR:-/tmp/rknot-bench-views}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build --release --quiet --bin rknot-mount --example make_synth_model
bin=${MOUNT_BIN:-$CARGO_TARGET_DIR/release/rknot-mount}
mkdir -p "$dir"
model=$dir/q7b-$layers-sparse.gguf
[ -f "$model" ] || "$CARGO_TARGET_DIR/release/examples/make_synth_model" "$model" \
  --shape qwen2.5-7b --layers "$layers" --sparse
mp=$dir/mnt
mkdir -p "$mp"

# first_byte FILE OPTIONS...: ms from the start of rknot-mount to the first
# byte of FILE in a fresh mount ("-" if FILE does not exist), the daemon's
# RSS and the CPU time it has used by then (10 ms ticks).
first_byte() {
  local file=$1
  shift
  local t0 t1 out pid rss cpu ok=1
  t0=$(date +%s%N)
  out=$("$bin" "$model" "$mp" --log-file "$dir/mount.log" "$@")
  head -c1 "$mp/$file" >/dev/null 2>&1 || ok=0
  t1=$(date +%s%N)
  pid=$(sed -n 's/.*(pid \([0-9]*\);.*/\1/p' <<<"$out")
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")
  cpu=$(awk '{print ($14 + $15) * 10}' "/proc/$pid/stat")
  fusermount3 -u "$mp"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.01; done
  if [ $ok = 1 ]; then
    echo "$(( (t1 - t0) / 1000000 )) ms, $(( rss / 1024 )) MiB, cpu $cpu"
  else
    echo "-, $(( rss / 1024 )) MiB, cpu $cpu"
  fi
}

echo "model: $model ($(stat -c %s "$model") bytes, $(du -k "$model" | cut -f1) KiB on disk); $layers blocks"
echo "mount binary: $bin; options: ${*:-none}; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "per column: time to the first byte, daemon RSS, daemon CPU ms (user+sys)"
printf '%-5s %-26s %-26s %-26s\n' round model.safetensors model.gguf blk.0.attn_q.weight.f32
for r in $(seq 1 "$rounds"); do
  printf '%-5s %-26s %-26s %-26s\n' "$r" \
    "$(first_byte model.safetensors "$@")" \
    "$(first_byte model.gguf "$@")" \
    "$(first_byte blk.0.attn_q.weight.f32 "$@")"
done
grep -o 'views built in .*' "$dir/mount.log" | tail -1 | cut -c1-200 || true
