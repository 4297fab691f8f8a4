#!/usr/bin/env bash
# SK32 with and without activation weighting (issue 12) on SmolLM2: for each
# rank, the plain sketch, the diagonally whitened one and the Gram-whitened
# one; whole-file bits per weight (`rknot inspect --json`), perplexity on
# the GPL-3.0 text (ctx 256, 29 windows) with top-1 agreement and KL against
# the GGUF, and the Paris probe. Writes tests/data/quality/sk32_activations.json.
# Needs a STATS file with Gram matrices (about 100 s to make):
#   rknot calibrate MODEL --text data/calibration/python-idle-help.txt -o STATS --gram
# Run: tools/sk32_activations.sh STATS [bin dir] [work dir]; RANKS="64 128"
# chooses the ranks, VARIANTS="plain diagonal gram" the variants. Rows already in WORK/rows.jsonl are kept (resumable);
# each rank costs minutes on 2 cores (rank 384: about 10).
set -euo pipefail
cd "$(dirname "$0")/.."
stats=${1:?usage: tools/sk32_activations.sh STATS [bin dir] [work dir]}
bin=${2:-target/release}
work=${3:-$(mktemp -d /tmp/rknot-sk32act.XXXXXX)}
mkdir -p "$work"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
text=tests/data/probe/gpl-3.0.txt
touch "$work/rows.jsonl"
run() {  # label, file, encode args...
  local label=$1 file=$2; shift 2
  if grep -qF "\"label\": \"$label\"" "$work/rows.jsonl"; then return; fi
  [ -e "$work/$file" ] || "$bin/rknot" encode "$@" -o "$work/$file" --no-progress 2>/dev/null
  "$bin/rknot" inspect "$work/$file" --json > "$work/inspect.json"
  "$bin/rknot" probe "$work/$file" --dense "$model" --compare "$model" \
    --perplexity "$text" --ctx 256 --no-progress > "$work/ppl.txt" 2>&1
  "$bin/rknot" probe "$work/$file" --dense "$model" \
    --prompt "The capital of France is" --top 1 --no-progress > "$work/paris.txt" 2>&1
  python3 - "$label" "$*" "$work" >> "$work/rows.jsonl" <<'PY'
import json, re, sys
label, cmd, work = sys.argv[1:4]
# The encoded file alone: whole file x 8 / the parameters it holds.
t = json.load(open(f"{work}/inspect.json"))["totals"]
ppl = open(f"{work}/ppl.txt").read()
m = re.search(r"^perplexity: ([\d.]+) \+/- ([\d.]+)", ppl, re.M)
f = re.search(r"top-1 agreement ([\d.]+) \((\d+)/(\d+)\), mean KL ([\d.]+) nats", ppl)
paris = open(f"{work}/paris.txt").read()
p = re.search(r'^\s+1\s+\d+\s+([\d.]+)\s+[-\d.]+\s+(".*")\s*$', paris, re.M)
print(json.dumps({"label": label, "command": "rknot encode " + cmd + " -o OUT",
                  "bits_per_weight": t["bits_per_weight"],
                  "perplexity": float(m.group(1)), "perplexity_pm": float(m.group(2)),
                  "top1_agreement": float(f.group(1)), "kl": float(f.group(4)),
                  "paris_top1": p.group(2) if p else None, "paris_prob": float(p.group(1)) if p else None}))
PY
  echo "$label done" >&2
}
for r in ${RANKS:-64 128 256 384}; do
  for v in ${VARIANTS:-plain diagonal gram}; do
    case $v in
      plain) run "SK32 rank $r" "r$r-plain.sk32" sk32 "$model" --rank "$r" ;;
      diagonal) run "SK32 rank $r, diagonal activations" "r$r-diag.sk32" sk32 "$model" \
        --rank "$r" --calibration-stats "$stats" --whiten diagonal ;;
      gram) run "SK32 rank $r, Gram activations" "r$r-gram.sk32" sk32 "$model" \
        --rank "$r" --calibration-stats "$stats" --whiten gram ;;
    esac
  done
done
python3 - "$work/rows.jsonl" "$stats" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
order = lambda r: (int(r["label"].split()[2].rstrip(",")), ["SK32", "diagonal", "Gram"].index(
    "Gram" if "Gram" in r["label"] else "diagonal" if "diagonal" in r["label"] else "SK32"))
rows.sort(key=order)
for r in rows:
    r["command"] = r["command"].replace(sys.argv[2], "STATS")
json.dump(rows, open("tests/data/quality/sk32_activations.json", "w"), indent=1)
for r in rows:
    print(f'| {r["label"]} | {r["bits_per_weight"]:.3f} | {r["perplexity"]:.4g} ± {r["perplexity_pm"]:.3g} '
          f'| {r["top1_agreement"]:.4f} | {r["kl"]:.4f} | {r["paris_top1"]} {r["paris_prob"]} |')
PY
