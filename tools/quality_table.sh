#!/usr/bin/env bash
# Encode SmolLM2 every way docs/QUALITY.md reports, verify each against the
# GGUF, and write tests/data/quality/encodings.json (one `rknot verify
# --json` summary per encoding, with its command and encode time).
# Run: tools/quality_table.sh [rknot binary]   (minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/rknot}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
out=$(mktemp -d /tmp/rknot-quality.XXXXXX)
trap 'rm -rf "$out"' EXIT
results=tests/data/quality/encodings.json
echo "[" > "$out/all.json"
first=1
run() {  # name, file, encode args...
  local name=$1 file=$2; shift 2
  local t0=$(date +%s%N)
  "$bin" encode "$@" -o "$out/$file" --overwrite 2>/dev/null
  local t1=$(date +%s%N)
  "$bin" verify "$out/$file" --dense "$model" --json > "$out/v.json"
  python3 - "$name" "$*" "$(( (t1 - t0) / 1000000 ))" "$out/v.json" "$(stat -c %s "$out/$file")" >> "$out/all.json" <<'PY'
import json, sys
name, cmd, secs, path, size = sys.argv[1:6]
v = json.load(open(path))
print(json.dumps({"name": name, "command": "rknot encode " + cmd.replace("models/", "MODELS/"), "encode_seconds": round(int(secs) / 1000, 1),
                  "file_bytes": int(size), "bits_per_weight": v["bits_per_weight"], "ok": v["ok"], "overall": v["overall"], "by_kind": v["by_kind"]}) + ",")
PY
  echo "$name done" >&2
}
for variant in "refit+clip (default):" "refit:--no-clip" "clip:--no-refit" "plain:--no-refit --no-clip" "balance:--balance --no-refit --no-clip"; do
  n=${variant%%:*}; a=${variant#*:}
  run "sk32 r64 $n" s.sk32 sk32 "$model" --rank 64 $a
done
for r in 16 32 128; do run "sk32 r$r" s.sk32 sk32 "$model" --rank $r; done
for c in 0.3 0.5 1.0; do
  run "rknot seed c$c" r.rknot rknot "$model" --profile seed --coverage $c
  run "rknot seed graded c$c" r.rknot rknot "$model" --profile seed --coverage $c --graded --extra-bits 2
  run "rknot faithful c$c" r.rknot rknot "$model" --profile faithful --coverage $c
done
for b in 4.5 6.0 7.0; do run "rknot faithful 1.0 ${b}bpw" r.rknot rknot "$model" --profile faithful --coverage 1.0 --target-bpw $b; done
run "knot repack" k.knot knot "$model"
sed -i '$ s/,$//' "$out/all.json"
echo "]" >> "$out/all.json"
python3 -m json.tool "$out/all.json" > "$results"
echo "wrote $results"
