#!/usr/bin/env bash
# The S3-compatible server of the object-storage tests (tests/remote_s3.rs):
# moto in server mode (`moto_server`, PyPI moto[server]) and boto3 (the
# tests upload objects and list multipart uploads with it), pinned, in a
# virtual environment of its own (about 320 MB, half a minute of downloads
# the first time; later runs only check the pinned versions).
#
#   RKNOT_MOTO_VENV   where the environment lives (default
#                     ${XDG_CACHE_HOME:-$HOME/.cache}/rknot/moto-venv)
#
# Sourced (tools/test.sh): `rknot_moto_env` creates or checks the environment
# and exports RKNOT_MOTO_SERVER (its moto_server), which build.rs and the
# tests read (the tests run the same environment's python3 for boto3).
# Run: `export RKNOT_MOTO_SERVER=$(tools/moto-env.sh)` does the same for a
# shell.

# moto 5.2 answers If-None-Match: * on PutObject and CompleteMultipartUpload
# with 412, as S3 does: the encoder's conditional create is tested against it.
RKNOT_MOTO_PINS="moto[server]==5.2.5 boto3==1.44.8 botocore==1.44.8"

# Whether python3 $1 has exactly the pinned versions, and imports them.
# The venv helpers (rknot_venv_create, rknot_venv_pip).
# shellcheck source=tools/python-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/python-env.sh"

rknot_moto_pins_ok() {
  "$1" - "$RKNOT_MOTO_PINS" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for pin in sys.argv[1].split():
    name, want = pin.split("==")
    if version(name.split("[")[0]) != want:
        sys.exit(1)
import boto3, moto.server, flask
PY
}

rknot_moto_env() {
  local venv=${RKNOT_MOTO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rknot/moto-venv}
  local py=$venv/bin/python3
  if [ -x "$py" ] && [ -x "$venv/bin/moto_server" ] && rknot_moto_pins_ok "$py"; then
    export RKNOT_MOTO_SERVER=$venv/bin/moto_server
    return 0
  fi
  mkdir -p "$(dirname "$venv")"
  local start=$SECONDS
  if ! [ -x "$py" ] || ! "$py" -m pip --version >/dev/null 2>&1; then
    rknot_venv_create moto-env "$venv" " (moto[server] + boto3)" || return 1
  fi
  rknot_venv_pip moto-env "$py" "$RKNOT_MOTO_PINS" || return 1
  if ! [ -x "$venv/bin/moto_server" ] || ! rknot_moto_pins_ok "$py"; then
    echo "moto-env: $venv does not have $RKNOT_MOTO_PINS after the install" >&2
    return 1
  fi
  echo "moto-env: ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))" >&2
  export RKNOT_MOTO_SERVER=$venv/bin/moto_server
}

# Run as a command: set up, then print the moto_server to use.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  rknot_moto_env
  echo "$RKNOT_MOTO_SERVER"
fi
