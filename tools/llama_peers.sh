#!/usr/bin/env bash
# llama.cpp's own quantizations of SmolLM2, the peers docs/QUALITY.md sets
# beside rknot's encodings (issue 12): each type without and with an
# importance matrix from llama-imatrix over the same calibration text the
# rknot encoder uses, so the calibrated peer is a fair one.
#
#   tools/llama_peers.sh
#
# Steps, each skipped when its output exists (the work dir is reused):
#  1. smollm2.f32.gguf: the Q4_1 file requantized to F32 by llama-quantize
#     (--allow-requantize), i.e. the fp32 values rknot serves, the common
#     source of every peer (as tools/probe_reference.py made its F32 model);
#  2. imatrix.gguf: llama-imatrix on that F32 model over
#     data/calibration/python-idle-help.txt, -c 512 and every whole chunk
#     (8506 tokens: 16 chunks; the last 314 tokens do not fill a chunk and
#     llama-imatrix drops them). ctx 512 is the context `rknot calibrate`
#     used for the encoder's statistics, so both see the same windows;
#  3. smollm2.TYPE.gguf and smollm2.TYPE.imatrix.gguf for each TYPE below,
#     llama-quantize from the F32 model (no --allow-requantize: the source
#     is F32). SmolLM2's rows are 576 wide, not a multiple of 256, so the
#     k-quants and IQ4_XS fall back to 32-wide types on most matrices
#     (llama-quantize says which: see quantize-TYPE*.log).
# Then prints every file made with its size.
#
#   RKNOT_PEERS_DIR   the work dir (default /var/tmp/rknot-peers)
#   RKNOT_THREADS     threads for llama.cpp (default: nproc)
#
# The tools come from tools/llama-cpp.sh (built once and cached); the model
# from tools/fetch-smollm2.sh. About 3 minutes on 2 cores when nothing is
# cached but the tools.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

TYPES=(Q8_0 Q6_K Q4_K_M Q4_K_S IQ4_XS Q4_0)
model=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
calib=$root/data/calibration/python-idle-help.txt
work=${RKNOT_PEERS_DIR:-/var/tmp/rknot-peers}
threads=${RKNOT_THREADS:-$(nproc)}
IMATRIX_CTX=512

say() { echo "llama_peers.sh: $*" >&2; }

tools/fetch-smollm2.sh "$model" >&2
bin=$(tools/llama-cpp.sh --print-bin-dir)
mkdir -p "$work"

# Outputs go to NAME.part and are renamed into place on success, so a file
# that exists is complete and a rerun skips it.
f32=$work/smollm2.f32.gguf
if [ ! -f "$f32" ]; then
  say "F32 model: llama-quantize --allow-requantize $model F32"
  "$bin/llama-quantize" --allow-requantize "$model" "$f32.part" F32 "$threads" \
    >"$work/quantize-F32.log" 2>&1 || { tail -30 "$work/quantize-F32.log" >&2; exit 1; }
  mv "$f32.part" "$f32"
fi

imatrix=$work/imatrix.gguf
if [ ! -f "$imatrix" ]; then
  say "importance matrix: llama-imatrix -c $IMATRIX_CTX over $calib"
  start=$(date +%s)
  # -o must end in .gguf for llama-imatrix to write the GGUF format.
  "$bin/llama-imatrix" -m "$f32" -f "$calib" -c "$IMATRIX_CTX" -t "$threads" \
    -o "$work/imatrix.part.gguf" >"$work/imatrix.log" 2>&1 \
    || { tail -30 "$work/imatrix.log" >&2; exit 1; }
  mv "$work/imatrix.part.gguf" "$imatrix"
  say "imatrix took $(($(date +%s) - start)) s"
fi

quantize() {  # TYPE, output, extra args...
  local type=$1 out=$2; shift 2
  local log=$work/quantize-$(basename "$out" .gguf).log
  [ -f "$out" ] && return 0
  say "llama-quantize $* F32 -> $type: $(basename "$out")"
  if "$bin/llama-quantize" "$@" "$f32" "$out.part" "$type" "$threads" >"$log" 2>&1; then
    mv "$out.part" "$out"
  else
    rm -f "$out.part"
    say "llama-quantize refused $type $*; its last lines ($log):"
    tail -5 "$log" >&2
    return 1
  fi
}

failed=()
for type in "${TYPES[@]}"; do
  quantize "$type" "$work/smollm2.$type.gguf" || failed+=("$type")
  quantize "$type" "$work/smollm2.$type.imatrix.gguf" --imatrix "$imatrix" || failed+=("$type+imatrix")
done

echo "llama.cpp peers in $work:"
for f in "$work"/smollm2.*.gguf "$imatrix"; do
  printf '  %-32s %10d bytes\n' "$(basename "$f")" "$(stat -c %s "$f")"
done
# What llama-quantize made of each: the stored types and the fallbacks on
# the 576-wide rows (its own warnings, counted).
for type in "${TYPES[@]}"; do
  for v in "" .imatrix; do
    log=$work/quantize-smollm2.$type$v.log
    [ -f "$log" ] || continue
    types=$(grep -o 'converting to [A-Za-z0-9_]*' "$log" | sed 's/converting to //' | sort | uniq -c | xargs || true)
    fb=$(grep -o 'required for type *[A-Za-z0-9_]*) -> falling back to *[A-Za-z0-9_]*' "$log" \
      | sed 's/required for type *//; s/) -> falling back to */->/' | sort | uniq -c | xargs || true)
    echo "  $type$v: tensors quantized to ${types:-nothing}${fb:+; fallbacks (rows not a multiple of 256): $fb}"
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  say "not made: ${failed[*]}"
  exit 1
fi
