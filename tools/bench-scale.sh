#!/usr/bin/env bash
# Scale benchmark (docs/PERFORMANCE.md, "Scale: 7B and 70B shapes"): a
# synthetic Qwen2.5-7B-shaped Q4_K_M model on disk, encoded to a
# self-contained .rknot (default profile) and to SK32 r64, each verified,
# mounted alone and streamed through a 256 MiB cache, and probed; then a
# Llama-3-70B-shaped header-only mount and 1- and 2-layer encodes of the
# 70B shape. Every step prints wall time, peak RSS (the process's VmHWM, or
# the daemon's for mounts) and its ratio to the baseline measured in the
# same run: one full decode of the source GGUF (`rknot verify` on it).
# Needs root (mounts, dropping the page cache) and fuse3.
#
#   tools/bench-scale.sh                      # everything (about an hour on 2 cores)
#   STEPS=gen,base,rknot,mount tools/bench-scale.sh   # some steps
#
# Files go to $BENCH_DIR (default /var/tmp/rknot-bench-scale, ~20 GB); the
# generated models are kept and reused by later runs.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BENCH_DIR:-/var/tmp/rknot-bench-scale}
steps=",${STEPS:-gen,base,rknot,sk32,mount,verify,probe,70b},"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build --release --quiet --bins --example make_synth_model
bin=$CARGO_TARGET_DIR/release
gen=$bin/examples/make_synth_model
mkdir -p "$dir"
log=$dir/bench.log
src=$dir/q7b.gguf
mp=$dir/mnt
mkdir -p "$mp"
base_secs=""

want() { [[ $steps == *",$1,"* ]]; }

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# row LABEL SECS RSS_KB NOTE: one table row, with the ratio to the baseline.
row() {
  local ratio="-"
  [ -n "$base_secs" ] && ratio=$(awk -v a="$2" -v b="$base_secs" 'BEGIN { printf "%.2fx", a / b }')
  printf '| %s | %.1f s | %s | %.2f GiB | %s |\n' "$1" "$2" "$ratio" \
    "$(awk -v k="$3" 'BEGIN { print k / 1048576 }')" "$4" | tee -a "$log"
}

# timed LABEL NOTE CMD...: run CMD under /usr/bin/time (cold page cache),
# keep its output in $dir/LABEL.out, print a row.
timed() {
  local label=$1 note=$2
  shift 2
  drop_caches
  /usr/bin/time -f '%e %M' -o "$dir/time.txt" "$@" >"$dir/$label.out" 2>&1 || {
    echo "$label failed:" >&2
    tail -5 "$dir/$label.out" >&2
    exit 1
  }
  read -r secs kb <"$dir/time.txt"
  row "$label" "$secs" "$kb" "$note"
}

size_note() { # FILE: size and honest bits per weight (whole file x 8 / parameters)
  "$bin/rknot" inspect "$1" --json | python3 -c '
import json, sys
t = json.load(sys.stdin)["totals"]
print("%.2f GB, %.3f bpw (whole file)" % (t["file_bytes"] / 1e9, t["bits_per_weight"]))'
}

echo "# bench-scale $(date -u +%FT%TZ) $(git rev-parse --short HEAD) on $(nproc) CPUs" | tee -a "$log"
echo "| step | wall | vs full decode | peak RSS | notes |" | tee -a "$log"
echo "|---|---|---|---|---|" | tee -a "$log"

if want gen; then
  [ -f "$src" ] || timed gen-7b "generate $src" "$gen" "$src" --shape qwen2.5-7b
  ls -l "$src" >>"$log"
fi

if want base; then
  timed read-source "cat the source file (disk)" sh -c 'cat "$1" >/dev/null' sh "$src"
  timed decode-source "rknot verify on the source: one full decode (the baseline)" "$bin/rknot" verify "$src"
  awk '{ print $1 }' "$dir/time.txt" >"$dir/base_secs"
fi
# The baseline of an earlier run when this one skips it.
[ -f "$dir/base_secs" ] && base_secs=$(cat "$dir/base_secs")

if want rknot; then
  rm -f "$dir/q7b.rknot"
  timed encode-rknot "faithful profile (self-contained)" "$bin/rknot" encode rknot "$src" -o "$dir/q7b.rknot" --profile faithful
  echo "  q7b.rknot: $(size_note "$dir/q7b.rknot"); $(tail -2 "$dir/encode-rknot.out" | head -1)" | tee -a "$log"
fi

if want sk32; then
  rm -f "$dir/q7b.sk32"
  timed encode-sk32 "SK32 rank 64" "$bin/rknot" encode sk32 "$src" --rank 64 -o "$dir/q7b.sk32"
  echo "  q7b.sk32: $(size_note "$dir/q7b.sk32"); $(tail -2 "$dir/encode-sk32.out" | head -1)" | tee -a "$log"
fi

if want mount; then
  # The .rknot alone (no --dense) through a 256 MiB decoded-block cache:
  # every tensor file once, dot spellings only.
  drop_caches
  out=$("$bin/rknot-mount" "$dir/q7b.rknot" "$mp" --cache-mb 256 --log-file "$dir/mount.log")
  pid=$(sed -n 's/.*(pid \([0-9]*\);.*/\1/p' <<<"$out")
  t0=$(date +%s.%N)
  bytes=0
  while read -r f; do
    n=$(cat "$mp/$f" | wc -c)
    bytes=$((bytes + n))
  done < <(python3 -c '
import json, sys
for t in json.load(open(sys.argv[1]))["tensors"]:
    print(t["name"] + ".f32")' "$mp/index.json")
  t1=$(date +%s.%N)
  hwm=$(awk '/VmHWM/ { print $2 }' "/proc/$pid/status")
  fusermount3 -u "$mp"
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')
  row mount-stream "$secs" "$hwm" "$(awk -v b="$bytes" -v s="$secs" 'BEGIN { printf "%.1f GB of f32 at %.2f GB/s; daemon RSS", b / 1e9, b / 1e9 / s }')"
fi

if want verify; then
  timed verify-rknot "verify q7b.rknot --dense (decodes both)" "$bin/rknot" verify "$dir/q7b.rknot" --dense "$src"
  timed verify-sk32 "verify q7b.sk32 (structure)" "$bin/rknot" verify "$dir/q7b.sk32"
fi

if want probe; then
  timed probe-rknot "probe q7b.rknot, one forward pass (auto: streamed)" \
    "$bin/rknot" probe "$dir/q7b.rknot" --prompt "The capital of France is" --top 3
  grep -E "streamed|prompt processing" "$dir/probe-rknot.out" | sed 's/^/  /' | tee -a "$log"
fi

if want 70b; then
  big=$dir/l70b-sparse.gguf
  [ -f "$big" ] || "$gen" "$big" --shape llama3-70b --sparse >/dev/null
  for f in model.gguf model.safetensors blk.0.attn_q.weight.f32; do
    t0=$(date +%s%N)
    out=$("$bin/rknot-mount" "$big" "$mp" --log-file "$dir/mount.log")
    head -c1 "$mp/$f" >/dev/null
    t1=$(date +%s%N)
    pid=$(sed -n 's/.*(pid \([0-9]*\);.*/\1/p' <<<"$out")
    hwm=$(awk '/VmHWM/ { print $2 }' "/proc/$pid/status")
    fusermount3 -u "$mp"
    row "70b-first-byte $f" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print (b - a) / 1e9 }')" "$hwm" "header-only 70B, fresh mount to first byte; daemon RSS"
  done
  for layers in 1 2; do
    m=$dir/l70b-$layers.gguf
    [ -f "$m" ] || "$gen" "$m" --shape llama3-70b --layers "$layers" >/dev/null
    rm -f "$dir/l70b-$layers.rknot"
    timed "encode-70b-$layers-layers" "faithful profile, $(du -h --apparent-size "$m" | cut -f1) source" \
      "$bin/rknot" encode rknot "$m" -o "$dir/l70b-$layers.rknot" --profile faithful
  done
fi
