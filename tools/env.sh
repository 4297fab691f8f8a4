# Sourced, not run: `. tools/env.sh` puts what the README's Use section
# runs on PATH, from what tools/demo.sh and tools/test.sh installed:
#
#   rknot, rknot-mount   target/release (cargo build --release; tools/demo.sh
#                        builds it), or $RKNOT_BIN_DIR
#   python3 (numpy, gguf, safetensors)
#                        the project's environment (tools/python-env.sh,
#                        $RKNOT_VENV)
#   llama-completion, llama-perplexity, ...
#                        llama.cpp's tools as tools/llama-cpp.sh cached them;
#                        also exported as RKNOT_LLAMA_BIN (the tests read it)
#   RKNOT_HF_PYTHON      the python3 of the torch + transformers environment
#                        (tools/hf-env.sh, $RKNOT_HF_VENV): its own
#                        environment, so not `python3`
#
# Fast (no install, no build, no network): what is missing is named on
# stderr with the command that installs it, and the rest is still set up.
# Sourcing it again puts nothing on PATH twice.

rknot_env() {
  local root
  root=$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
  local cache=${XDG_CACHE_HOME:-$HOME/.cache}/rknot
  # Prepend a directory unless PATH has it already.
  rknot_env_path() {
    case ":$PATH:" in
      *":$1:"*) ;;
      *) PATH=$1:$PATH ;;
    esac
  }
  local bin=${RKNOT_BIN_DIR:-$root/target/release}
  if [ -x "$bin/rknot" ] && [ -x "$bin/rknot-mount" ]; then
    rknot_env_path "$bin"
  else
    echo "tools/env.sh: no rknot binaries in $bin: cargo build --release (tools/demo.sh does it)" >&2
  fi
  local llama
  if llama=$("$root/tools/llama-cpp.sh" --cached-bin-dir 2>/dev/null); then
    rknot_env_path "$llama"
    export RKNOT_LLAMA_BIN=$llama
  else
    echo "tools/env.sh: llama.cpp's tools are not built: tools/llama-cpp.sh (about 6 minutes; tools/test.sh does it)" >&2
  fi
  local hf=${RKNOT_HF_VENV:-$cache/hf-venv}/bin/python3
  if [ -x "$hf" ]; then
    export RKNOT_HF_PYTHON=$hf
  else
    echo "tools/env.sh: no transformers environment at $hf: tools/hf-env.sh (5.6 GB; tools/test.sh does it)" >&2
  fi
  # Last, so that it comes first: `python3` is the project's environment.
  local venv=${RKNOT_VENV:-$cache/venv}
  if [ -x "$venv/bin/python3" ]; then
    rknot_env_path "$venv/bin"
  else
    echo "tools/env.sh: no Python environment at $venv: tools/test.sh makes it (tools/python-env.sh)" >&2
  fi
  export PATH
  unset -f rknot_env_path
}
rknot_env
unset -f rknot_env
