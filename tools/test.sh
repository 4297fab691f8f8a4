#!/usr/bin/env bash
# The whole test suite, with its set-up, on a fresh Debian machine with the
# Rust toolchain and python3: installs the Python packages the cross-checks
# use in a virtual environment (tools/python-env.sh; Debian's python3 refuses
# pip into the system), fetches the SmolLM2 test model, builds llama.cpp's
# tools once (tools/llama-cpp.sh, cached), then runs lint, every cargo test
# (the real-model tests are mandatory here), the reader fuzzers for a bounded
# time, and the independent reader written from docs/FORMAT.md.
#
# Required by default: root, /dev/fuse (opened read-write), fusermount3,
# the SmolLM2 model, torch + transformers (tools/hf-env.sh) and moto's S3
# server (tools/moto-env.sh). A machine
# without one of them fails here, before the tests, naming what is missing
# (exports RKNOT_REQUIRE_FUSE=1 and RKNOT_REQUIRE_MODEL=1, so a test that
# cannot run fails instead of passing).
#
#   RKNOT_FUZZ_SECS    seconds per fuzz target (default 30)
#   RKNOT_ALLOW_SKIP=1 opt out: run without what is missing; the tests that
#                      need it are reported as ignored, with the reason
#                      (README: Tests). RKNOT_REQUIRE_FUSE/RKNOT_REQUIRE_MODEL
#                      set by the caller still apply.
#
# Tests build with the `ci` profile: optimized, with overflow checks.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

allow_skip=false
case ${RKNOT_ALLOW_SKIP:-} in "" | 0) ;; *) allow_skip=true ;; esac

step "set-up: system packages, test model, Python packages, llama.cpp tools"
# fuse3 (mount tests), rsync (the mount's rsync -a check), systemd
# (systemd-analyze verify of the unit), strace (the order of rknot-mount's
# checks on a hung mount), openssl (a test CA and server certificate for the
# https checks): installed when missing and possible.
missing=""
command -v fusermount3 >/dev/null || missing="$missing fuse3"
command -v rsync >/dev/null || missing="$missing rsync"
command -v systemd-analyze >/dev/null || missing="$missing systemd"
command -v strace >/dev/null || missing="$missing strace"
command -v openssl >/dev/null || missing="$missing openssl"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "missing:$missing (install them; the capability check below names what the tests need)"
  fi
fi
# The Python packages the cross-checks use, in a virtual environment that
# stays first on PATH for everything below (cargo's tests run `python3`):
# tools/python-env.sh says why and where (RKNOT_VENV). A failing install
# fails the run: the Python checks need these.
. tools/python-env.sh
rknot_python_env 'numpy>=1.26' 'safetensors>=0.4' 'gguf==0.19.0'
echo "python3: $(command -v python3) ($(python3 --version 2>&1))"
if ! tools/fetch-smollm2.sh; then
  echo "could not fetch the SmolLM2 test model (tools/fetch-smollm2.sh)"
  $allow_skip || exit 1
fi
# llama.cpp's llama-completion and llama-perplexity, built once from the
# llama-cpp-python sdist and cached (tools/llama-cpp.sh; a cold build is a
# few minutes of 2 cores), for tests/llama_cpp.rs, which runs them on the
# mount's model.gguf. A failed build fails the run (RKNOT_ALLOW_SKIP: the
# test is reported as ignored instead).
if llama_bin=$(tools/llama-cpp.sh --print-bin-dir); then
  export RKNOT_LLAMA_BIN=$llama_bin
  echo "llama.cpp tools: $RKNOT_LLAMA_BIN"
else
  echo "could not build llama.cpp's tools (tools/llama-cpp.sh)"
  $allow_skip || exit 1
  unset RKNOT_LLAMA_BIN
fi
# torch + transformers for the hf/ view's checks (tests/hf_view.rs), in an
# environment of their own (tools/hf-env.sh: ~5.6 GB and ~4 minutes the
# first time on a machine, a version check afterwards); exports
# RKNOT_HF_PYTHON, which build.rs and the test read. A caller's
# RKNOT_HF_PYTHON is used as it is.
if [ -z "${RKNOT_HF_PYTHON:-}" ]; then
  . tools/hf-env.sh
  if ! rknot_hf_env; then
    echo "could not set up torch + transformers (tools/hf-env.sh)"
    $allow_skip || exit 1
    echo "RKNOT_ALLOW_SKIP is set: the transformers checks of hf/ are reported as ignored"
  fi
fi
echo "transformers checks: ${RKNOT_HF_PYTHON:-off}"
# moto's S3 server and boto3 for the object-storage tests
# (tests/remote_s3.rs), in an environment of their own (tools/moto-env.sh:
# about 320 MB and half a minute the first time, a version check afterwards); exports
# RKNOT_MOTO_SERVER, which build.rs and the tests read. A caller's
# RKNOT_MOTO_SERVER is used as it is.
if [ -z "${RKNOT_MOTO_SERVER:-}" ]; then
  . tools/moto-env.sh
  if ! rknot_moto_env; then
    echo "could not set up moto's S3 server (tools/moto-env.sh)"
    $allow_skip || exit 1
    echo "RKNOT_ALLOW_SKIP is set: the S3 tests are reported as ignored"
  fi
fi
echo "S3 server: ${RKNOT_MOTO_SERVER:-off}"

step "capabilities: FUSE mounts and the SmolLM2 model"
# The same checks as build.rs and the tests' fuse_available()/smollm2().
model=${RKNOT_SMOLLM2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
fuse_lacks=()
[ "$(id -u)" = 0 ] || fuse_lacks+=("root (running as uid $(id -u))")
{ : <>/dev/fuse; } 2>/dev/null || fuse_lacks+=("/dev/fuse opened read-write")
[ -e /usr/bin/fusermount3 ] || [ -e /bin/fusermount3 ] || fuse_lacks+=("fusermount3 in /usr/bin or /bin (package fuse3)")
have_model=true
[ -f "$model" ] || have_model=false
if [ ${#fuse_lacks[@]} = 0 ] && $have_model; then
  echo "FUSE mounts: yes; SmolLM2 model: $model"
  export RKNOT_REQUIRE_FUSE=1 RKNOT_REQUIRE_MODEL=1
else
  for what in "${fuse_lacks[@]}"; do
    echo "missing: $what: needed by the FUSE mount tests"
  done
  $have_model || echo "missing: the SmolLM2 model at $model: needed by the real-model tests (tools/fetch-smollm2.sh)"
  if ! $allow_skip; then
    echo "FAIL: this machine cannot run the whole suite (README: Tests)."
    echo "Run as root with fuse3 and the model, or set RKNOT_ALLOW_SKIP=1 to run"
    echo "the rest, with the tests that need what is missing reported as ignored."
    exit 1
  fi
  echo "RKNOT_ALLOW_SKIP is set: the tests that need what is missing are reported as ignored"
  if [ ${#fuse_lacks[@]} = 0 ]; then export RKNOT_REQUIRE_FUSE=1; fi
  if $have_model; then export RKNOT_REQUIRE_MODEL=1; fi
fi
export CARGO_TERM_COLOR=never

step "format and lint"
cargo fmt --check
cargo clippy --all-targets -- -D warnings

step "tests (unit, integration, real model, CLI, mounts)"
# The fuzzers get their full budget in the next step; here a short run.
RKNOT_FUZZ_SECS=2 cargo test --profile ci

step "fuzz the readers (${RKNOT_FUZZ_SECS:-30}s per target)"
RKNOT_FUZZ_SECS=${RKNOT_FUZZ_SECS:-30} cargo test --profile ci --test fuzz_readers -- --nocapture

step "systemd unit: systemd-analyze verify"
unit_dir=$(mktemp -d)
trap 'rm -rf "$unit_dir"' EXIT
# The unit names /usr/local/bin/rknot-mount; verify a copy that names the
# binary just built (verify checks that ExecStart is executable).
sed "s#/usr/local/bin/rknot-mount#$PWD/target/ci/rknot-mount#" systemd/rknot-mount@.service > "$unit_dir/rknot-mount@.service"
systemd-analyze verify "$unit_dir/rknot-mount@.service"
echo "unit OK"

step "benchmark smoke run (no thresholds: keeps 'rknot bench mount' working)"
if [ ${#fuse_lacks[@]} = 0 ]; then
  target/ci/rknot bench mount --dir "$unit_dir/bench" --rounds 1 --size-mb 64 --random-reads 20 | tail -12
else
  echo "skipped (RKNOT_ALLOW_SKIP): needs root, /dev/fuse and fusermount3"
fi

step "benchmark smoke run (no thresholds: keeps 'rknot bench remote' working; needs curl)"
if [ ${#fuse_lacks[@]} = 0 ]; then
  target/ci/rknot bench remote --dir "$unit_dir/bench-remote" --rounds 1 --size-mb 8 --shapes qwen2.5-7b | tail -14
else
  echo "skipped (RKNOT_ALLOW_SKIP): needs root, /dev/fuse and fusermount3"
fi

step "independent reader (written from docs/FORMAT.md alone) vs rknot cat"
bin=target/ci/rknot
for f in demo/tiny-llama.gguf demo/tiny-llama.knot demo/tiny-llama.sk32 demo/tiny-llama.rknot; do
  python3 tools/independent_reader.py check "$f" --rknot-bin "$bin"
done
for f in demo/tiny-llama.sk32 demo/tiny-llama.rknot; do
  python3 tools/independent_reader.py check "$f" --dense demo/tiny-llama.gguf --rknot-bin "$bin"
done
# demo/tiny-llama.rknot is a version-2 file; version 3 (what the writer makes
# now) is checked on files the binary just built encodes from the demo GGUF.
v3_dir=$(mktemp -d)
trap 'rm -rf "$unit_dir" "$v3_dir"' EXIT
encode_v3() { # NAME [encode options...]: writes $v3_dir/NAME.rknot, checks its magic
  local out="$v3_dir/$1.rknot"; shift
  "$bin" encode rknot demo/tiny-llama.gguf --out "$out" "$@" >"$v3_dir/encode.log" 2>&1 \
    || { cat "$v3_dir/encode.log"; return 1; }
  tail -1 "$v3_dir/encode.log"
  if [ "$(head -c 6 "$out" | od -An -tx1 | tr -d ' \n')" != 524b4e4f5403 ]; then
    echo "$out: not a version-3 .rknot (magic $(head -c 6 "$out" | od -An -tx1))"; return 1
  fi
}
# By default the encoder also stores every tensor it does not compress (embeddings,
# norms, output head) as ggml blocks (FORMAT.md section 6.6), so the file serves the
# whole model alone; --compressed-only leaves them out, as files used to be.
encode_v3 seed-graded --profile seed --graded
encode_v3 faithful --profile faithful
encode_v3 seed --profile seed
encode_v3 compressed-only --profile faithful --compressed-only
# Lossless (FORMAT.md section 6.7): the demo's F16 and BF16 matrices in lossless blocks,
# its quantized ones as ggml blocks.
encode_v3 lossless --profile lossless
for name in seed-graded faithful seed compressed-only lossless; do
  f="$v3_dir/$name.rknot"
  alone=""
  for dense in "" demo/tiny-llama.gguf; do
    out=$(python3 tools/independent_reader.py check "$f" ${dense:+--dense "$dense"} --rknot-bin "$bin") \
      || { echo "$out"; echo "FAIL: independent reader check $f ${dense:+--dense $dense}"; exit 1; }
    echo "$out"
    [ -n "$dense" ] || alone=$out
  done
  # checksums (FORMAT.md section 12): every stored byte matches; one flipped payload byte
  # (byte 100 is in the body's first blocks) is a mismatch, exit status 1
  out=$(python3 tools/independent_reader.py integrity "$f") && case $out in *": checked:"*) ;; *) false ;; esac \
    || { echo "$out"; echo "FAIL: independent reader integrity $f"; exit 1; }
  echo "$out"
  python3 -c 'import sys; b = bytearray(open(sys.argv[1], "rb").read()); b[100] ^= 1; open(sys.argv[2], "wb").write(b)' \
    "$f" "$v3_dir/flipped.rknot"
  rc=0; out=$(python3 tools/independent_reader.py integrity "$v3_dir/flipped.rknot") || rc=$?
  [ "$rc" = 1 ] || { echo "$out"; echo "FAIL: integrity of $f with a flipped payload byte: exit $rc, want 1"; exit 1; }
  # self-contained (the default): the file alone lists every tensor of the source, shapes
  # included; --compressed-only: no tensor stored as ggml blocks
  if [ "$name" = compressed-only ]; then
    case $alone in
      *"stored as ggml blocks"*) echo "FAIL: $f was encoded with --compressed-only but holds dense tensors"; exit 1 ;;
    esac
  else
    # (without the "# file F: checked/unchecked" lines, which differ)
    diff <(python3 tools/independent_reader.py list "$f" 2>&1 | grep -v '^# file ' | sort) \
         <(python3 tools/independent_reader.py list demo/tiny-llama.gguf 2>&1 | grep -v '^# file ' | sort) \
      || { echo "FAIL: $f does not serve the whole model alone"; exit 1; }
  fi
done
# Lossless blocks of every matrix of an F32 GGUF (lossless_f32), decoded by the
# independent reader from FORMAT.md alone, and verify's bit-identical verdict.
python3 tools/tiny_llama_gguf.py "$v3_dir/f32.gguf"
"$bin" encode rknot "$v3_dir/f32.gguf" --out "$v3_dir/lossless-f32.rknot" --profile lossless \
  >"$v3_dir/encode.log" 2>&1 || { cat "$v3_dir/encode.log"; exit 1; }
python3 tools/independent_reader.py check "$v3_dir/lossless-f32.rknot" --dense "$v3_dir/f32.gguf" \
  --rknot-bin "$bin"
out=$("$bin" verify "$v3_dir/lossless-f32.rknot" --dense "$v3_dir/f32.gguf")
case $out in *"lossless: bit-identical"*) echo "lossless-f32: verify says bit-identical" ;;
  *) echo "$out"; echo "FAIL: verify of a lossless encode is not bit-identical"; exit 1 ;; esac
if $have_model; then
  python3 tools/independent_reader.py check "$model" --rknot-bin "$bin"
else
  echo "skipped (RKNOT_ALLOW_SKIP): the SmolLM2 model is missing"
fi

step "all tests passed"
