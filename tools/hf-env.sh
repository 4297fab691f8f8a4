#!/usr/bin/env bash
# The Python environment of the transformers checks of the mount's hf/ view
# (tests/hf_view.rs: transformers_loads_the_hf_view): torch, transformers
# and what transformers' own GGUF loader needs, pinned, in a virtual
# environment of its own. It is kept apart from tools/python-env.sh's light
# one because it is large: torch from PyPI (the index rknot's machines
# reach) brings the CUDA libraries with it, about 5.6 GB installed and four
# minutes of downloads on a fresh machine (README: Tests). Later runs only
# check that the pinned versions are there (a second or two).
#
#   RKNOT_HF_VENV   where the environment lives (default
#                   ${XDG_CACHE_HOME:-$HOME/.cache}/rknot/hf-venv)
#
# Sourced (tools/test.sh): `rknot_hf_env` creates or checks the environment
# and exports RKNOT_HF_PYTHON (its python3), which build.rs and the test read.
# Run: `export RKNOT_HF_PYTHON=$(tools/hf-env.sh)` does the same for a shell.

# The versions the checks were written against (torch 2.15 / transformers
# 5.23 load llama and qwen2 GGUFs through transformers' legacy GGUF loader,
# which dequantizes with gguf-py: the anchor of the bit-exact comparison).
# sentencepiece: llama.cpp's convert_hf_to_gguf.py imports it before it
# falls back to a checkpoint's tokenizer.json (tests/hf_import.rs).
RKNOT_HF_PINS="torch==2.15.0 transformers==5.23.0 accelerate==1.15.0 tokenizers==0.23.3 safetensors==0.8.0 gguf==0.19.0 numpy==2.4.6 sentencepiece==0.2.3"

# Free space the first install needs where the environment goes, in GiB
# (5.6 GiB installed, plus pip's unpacking).
RKNOT_HF_MIN_FREE_GIB=9

# Whether python3 $1 has exactly the pinned versions, and imports them.
# The venv helpers (rknot_venv_create, rknot_venv_pip).
# shellcheck source=tools/python-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/python-env.sh"

rknot_hf_pins_ok() {
  "$1" - "$RKNOT_HF_PINS" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for pin in sys.argv[1].split():
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
import torch, transformers, accelerate, gguf, safetensors, tokenizers, sentencepiece
PY
}

rknot_hf_env() {
  local venv=${RKNOT_HF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rknot/hf-venv}
  local py=$venv/bin/python3
  if [ -x "$py" ] && rknot_hf_pins_ok "$py"; then
    export RKNOT_HF_PYTHON=$py
    return 0
  fi
  mkdir -p "$(dirname "$venv")"
  local start=$SECONDS
  if ! [ -x "$py" ] || ! "$py" -m pip --version >/dev/null 2>&1; then
    local free_kib
    free_kib=$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 { print $4 }')
    if [ -n "$free_kib" ] && [ "$free_kib" -lt $((RKNOT_HF_MIN_FREE_GIB * 1024 * 1024)) ]; then
      echo "hf-env: $(dirname "$venv") has $((free_kib / 1024 / 1024)) GiB free; torch + transformers need about $RKNOT_HF_MIN_FREE_GIB (set RKNOT_HF_VENV elsewhere)" >&2
      return 1
    fi
    rknot_venv_create hf-env "$venv" ": torch + transformers, about 5.6 GB, several minutes the first time" ||
      return 1
  fi
  rknot_venv_pip hf-env "$py" "$RKNOT_HF_PINS" || return 1
  if ! rknot_hf_pins_ok "$py"; then
    echo "hf-env: $venv does not have $RKNOT_HF_PINS after the install" >&2
    return 1
  fi
  echo "hf-env: ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))" >&2
  export RKNOT_HF_PYTHON=$py
}

# Run as a command: set up, then print the python3 to use.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  rknot_hf_env
  echo "$RKNOT_HF_PYTHON"
fi
