# Sourced by tools/test.sh and tools/fetch-smollm2.sh: a Python virtual
# environment for rknot's cross-checks, put first on PATH, so `python3` and
# `pip` are the environment's. Debian's own python3 refuses `pip install`
# into the system (PEP 668, "externally-managed-environment"), and a stock
# Debian has no pip at all; a virtual environment works on both, and on any
# other python3.
#
#   RKNOT_VENV   where the environment lives (default
#                ${XDG_CACHE_HOME:-$HOME/.cache}/rknot/venv); kept between
#                runs, so later runs only check that the packages are there.
#
# rknot_python_env [PACKAGE...]: create the environment if needed (installing
# Debian's python3-venv through apt-get when the venv module is missing and
# we are root), install the packages into it, and activate it.
# rknot_venv_create TAG VENV WHAT: a fresh virtual environment at VENV (for
# the environments of their own, tools/hf-env.sh and tools/moto-env.sh);
# TAG prefixes the messages, WHAT says what goes in.
rknot_venv_create() {
  local tag=$1 venv=$2 what=$3
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    echo "$tag: python3 has no venv module (Debian: apt-get install python3-venv; tools/python-env.sh does it)" >&2
    return 1
  fi
  echo "$tag: creating $venv$what" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" || return 1
}

# rknot_venv_pip TAG PY PINS: install PINS (words) with PY's pip, retrying
# once (large wheels over a slow network).
rknot_venv_pip() {
  local tag=$1 py=$2 pins=$3
  echo "$tag: installing $pins" >&2
  # shellcheck disable=SC2086 # the pins are words
  if ! "$py" -m pip install --quiet --disable-pip-version-check --retries 10 --timeout 120 $pins >&2; then
    echo "$tag: pip install failed; retrying once" >&2
    # shellcheck disable=SC2086
    "$py" -m pip install --quiet --disable-pip-version-check --retries 10 --timeout 120 $pins >&2 || return 1
  fi
}

rknot_python_env() {
  local venv=${RKNOT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rknot/venv}
  if [ ! -x "$venv/bin/python3" ] || ! "$venv/bin/python3" -m pip --version >/dev/null 2>&1; then
    if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing python3-venv (Debian's venv module, with pip for environments)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip >/dev/null
      else
        echo "python3 has no venv module: install python3-venv (Debian: apt-get install python3-venv)" >&2
        return 1
      fi
    fi
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    echo "created the Python environment $venv"
  fi
  if [ $# -gt 0 ]; then
    "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check "$@"
  fi
  export VIRTUAL_ENV=$venv
  case ":$PATH:" in
    *":$venv/bin:"*) ;;
    *) export PATH="$venv/bin:$PATH" ;;
  esac
  hash -r
}
