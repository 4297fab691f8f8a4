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
