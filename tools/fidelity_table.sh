#!/usr/bin/env bash
# Inference fidelity of SmolLM2 encodings read through a real mount (the
# encoded file over the GGUF as dense fallback): bits per weight of the
# encoded file (whole file x 8 / parameters it serves), perplexity over the GPL-3.0 text (ctx 256, 29
# windows), top-1 agreement / KL / logits cosine against the GGUF, and the
# Paris probe. Writes tests/data/quality/fidelity.json and prints markdown
# rows for docs/QUALITY.md. Needs root (mounts). Minutes on 2 cores.
# Run: tools/fidelity_table.sh [bin dir]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
text=tests/data/probe/gpl-3.0.txt
work=$(mktemp -d /tmp/rknot-fidelity.XXXXXX)
mnt=$work/mnt
mkdir -p "$mnt"
cleanup() { fusermount3 -uz "$mnt" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
rows=()
run() {  # label, file, encode args...
  local label=$1 file=$2; shift 2
  "$bin/rknot" encode "$@" -o "$work/$file" 2>/dev/null
  "$bin/rknot" inspect "$work/$file" --dense "$model" --json > "$work/inspect.json"
  "$bin/rknot-mount" "$work/$file" "$mnt" --dense "$model" -o nojobs > /dev/null
  "$bin/rknot" probe "$mnt" --compare "$model" --perplexity "$text" --ctx 256 > "$work/ppl.txt" 2>&1
  "$bin/rknot" probe "$mnt" --prompt "The capital of France is" --top 1 > "$work/paris.txt" 2>&1
  fusermount3 -u "$mnt"
  python3 - "$label" "$*" "$work" >> "$work/rows.jsonl" <<'PY'
import json, re, sys
label, cmd, work = sys.argv[1:4]
# The encoded file alone, whole file x 8 / parameters it serves (the GGUF
# fallback is the same for every row).
t = json.load(open(f"{work}/inspect.json"))["source"]
ppl = open(f"{work}/ppl.txt").read()
m = re.search(r"^perplexity: ([\d.]+) \+/- ([\d.]+)", ppl, re.M)
f = re.search(r"top-1 agreement ([\d.]+) \((\d+)/(\d+)\), mean KL ([\d.]+) nats.*logits cosine mean ([-\d.]+)", ppl)
paris = open(f"{work}/paris.txt").read()
p = re.search(r'^\s+1\s+\d+\s+([\d.]+)\s+[-\d.]+\s+(".*")\s*$', paris, re.M)
print(json.dumps({"label": label, "command": "rknot encode " + cmd, "bits_per_weight": t["bits_per_weight"],
                  "perplexity": float(m.group(1)), "perplexity_pm": float(m.group(2)),
                  "top1_agreement": float(f.group(1)), "kl": float(f.group(4)), "logits_cosine": float(f.group(5)),
                  "paris_top1": p.group(2) if p else None, "paris_prob": float(p.group(1)) if p else None}))
PY
  echo "$label done" >&2
}
run "SK32 rank 64" s.sk32 sk32 "$model" --rank 64
run "SK32 rank 128" s128.sk32 sk32 "$model" --rank 128
run ".rknot seed, coverage 0.3" seed.rknot rknot "$model" --profile seed --coverage 0.3
run ".rknot seed graded (+2), coverage 1.0" sg.rknot rknot "$model" --profile seed --coverage 1.0 --graded --extra-bits 2
run ".rknot faithful, 5.0 bpw" f5.rknot rknot "$model" --profile faithful
run ".rknot faithful, 6.0 bpw" f6.rknot rknot "$model" --profile faithful --target-bpw 6
run ".rknot faithful, 7.0 bpw" f7.rknot rknot "$model" --profile faithful --target-bpw 7
python3 - "$work/rows.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump(rows, open("tests/data/quality/fidelity.json", "w"), indent=1)
for r in rows:
    print(f'| {r["label"]} | mount of the encoded file + GGUF fallback | {r["bits_per_weight"]:.3f} | {r["top1_agreement"]:.4f} | {r["kl"]:.4f} | {r["logits_cosine"]:.4f} | {r["perplexity"]:.4g} ± {r["perplexity_pm"]:.3g} | {r["paris_top1"]} {r["paris_prob"]} |')
PY
