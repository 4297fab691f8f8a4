#!/usr/bin/env bash
# The whole test suite, with its set-up, on a fresh Debian machine with the
# Rust toolchain and python3: fetches the SmolLM2 test model, installs the
# Python packages the cross-checks use, then runs lint, every cargo test
# (the real-model tests are mandatory here), the reader fuzzers for a bounded
# time, and the independent reader written from docs/FORMAT.md.
#
#   RKNOT_FUZZ_SECS   seconds per fuzz target (default 30)
#
# Tests build with the `ci` profile: optimized, with overflow checks.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "set-up: test model and Python packages"
tools/fetch-smollm2.sh
python3 -m pip install --quiet --disable-pip-version-check 'numpy>=1.26' 2>&1 | grep -v "Running pip as the 'root' user" || true

export RKNOT_REQUIRE_MODEL=1
export CARGO_TERM_COLOR=never

step "format and lint"
cargo fmt --check
cargo clippy --all-targets -- -D warnings

step "tests (unit, integration, real model, CLI)"
cargo test --profile ci

step "fuzz the readers (${RKNOT_FUZZ_SECS:-30}s per target)"
RKNOT_FUZZ_SECS=${RKNOT_FUZZ_SECS:-30} cargo test --profile ci --test fuzz_readers -- --test-threads 1 --nocapture

step "independent reader (written from docs/FORMAT.md alone) vs rknot cat"
bin=target/ci/rknot
for f in demo/tiny-llama.gguf demo/tiny-llama.knot demo/tiny-llama.sk32 demo/tiny-llama.rknot; do
  python3 tools/independent_reader.py check "$f" --rknot-bin "$bin"
done
for f in demo/tiny-llama.sk32 demo/tiny-llama.rknot; do
  python3 tools/independent_reader.py check "$f" --dense demo/tiny-llama.gguf --rknot-bin "$bin"
done
python3 tools/independent_reader.py check models/SmolLM2-135M-Instruct.Q4_1.gguf --rknot-bin "$bin"

step "all tests passed"
