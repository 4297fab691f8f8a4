#!/usr/bin/env bash
# The .rknot rows of docs/QUALITY.md "Calibrated encoding": SmolLM2 encoded
# with the calibrated profile at several whole-file targets and with each
# technique switched off, the faithful profile (weight and activation
# manifests), each evaluated by tools/fidelity_eval.py into
# tests/data/quality/calibrated.json; then the plot. The llama.cpp rows come
# from tools/llama_peers.sh (see tools/fidelity_eval.py's header).
#
#   tools/calibrated_table.sh [BIN_DIR]      (default target/release)
#
#   RKNOT_CALIBRATED_DIR  encoded files, STATS and probe outputs (default
#                         /var/tmp/rknot-calibrated; reused when present:
#                         delete it after changing the encoder)
#
# Hours on 2 cores: each encode takes 2-6 minutes, each row's evaluation
# about 3.5 (two texts against the reference, and the Paris prompt).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
work=${RKNOT_CALIBRATED_DIR:-/var/tmp/rknot-calibrated}
mkdir -p "$work"
[ -f "$model" ] || tools/fetch-smollm2.sh
stats=$work/smollm2.stats.safetensors
if [ ! -f "$stats" ]; then
  # The whole calibration text, windows of 512, with Gram matrices (403 MB).
  "$bin/rknot" calibrate "$model" --text data/calibration/python-idle-help.txt --gram -o "$stats"
fi
rows=()
enc() {  # label, file, encode args...
  local label=$1 file=$work/$2; shift 2
  [ -f "$file" ] || "$bin/rknot" encode rknot "$model" -o "$file" "$@"
  rows+=("$label=$file")
}
S=(--calibration-stats "$stats")
# The calibrated default (GPTQ, activation-weighted fit, balanced
# allocation, widths 2-8 x groups 32/64, vocabulary as Q5_1) per target.
for b in 4.75 5.0 5.25 5.5; do
  enc ".rknot calibrated $b" "cal-$b.rknot" "${S[@]}" --target-bpw "$b"
done
# Each technique on its own, at 5.0 (and 4.5).
enc ".rknot calibrated 5.0, allocation output" cal-5.0-output.rknot "${S[@]}" --target-bpw 5.0 \
  --allocation output
enc ".rknot calibrated 5.25, allocation output" cal-5.25-output.rknot "${S[@]}" --target-bpw 5.25 \
  --allocation output
enc ".rknot calibrated 5.0, one width for all" cal-5.0-uniform.rknot "${S[@]}" --target-bpw 5.0 \
  --allocation uniform
enc ".rknot calibrated 5.0, groups of 32, allocation output" cal-5.0-g32.rknot "${S[@]}" \
  --target-bpw 5.0 --groups 32 --allocation output
enc ".rknot calibrated 5.0, groups of 32, allocation output, no GPTQ" cal-5.0-g32-rtn.rknot \
  "${S[@]}" --target-bpw 5.0 --groups 32 --allocation output --no-gptq
enc ".rknot calibrated 4.5, groups of 32, allocation output" cal-4.5-g32.rknot "${S[@]}" \
  --target-bpw 4.5 --groups 32 --allocation output
enc ".rknot affine 5.0, no calibration" cal-5.0-plain.rknot "${S[@]}" --target-bpw 5.0 \
  --no-gptq --no-weighted-fit --allocation uniform
# The vocabulary kept as the source's Q8_0: (almost) every matrix exact.
enc ".rknot calibrated 5.85, vocabulary kept (Q8_0)" cal-5.85-keep.rknot "${S[@]}" \
  --target-bpw 5.85 --vocab-type keep --allocation output
# The faithful profile (no calibration), and with the activation manifest.
enc ".rknot faithful 5.0" faithful-5.0.rknot --profile faithful --target-bpw 5.0
enc ".rknot faithful 5.0, activation manifest" faithful-act-5.0.rknot --profile faithful \
  --target-bpw 5.0 "${S[@]}"
tools/fidelity_eval.py --bin "$bin" --cache "$work/probes" "${rows[@]}"
tools/quality_plot.py
