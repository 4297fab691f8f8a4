#!/usr/bin/env bash
# Build rknot and show it working on the demo model that ships in demo/ (a
# tiny llama-shaped model: a .rknot over its GGUF as dense fallback): mount
# it, list it, read a few decoded values, unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v fusermount3 >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null
fi
cargo build --release --quiet
mnt=$(mktemp -d /tmp/rknot-demo.XXXXXX)
cleanup() { fusermount3 -u "$mnt" 2>/dev/null || true; rmdir "$mnt" 2>/dev/null || true; }
trap cleanup EXIT
set -x
target/release/rknot-mount demo/tiny-llama.rknot "$mnt" --dense demo/tiny-llama.gguf
ls -l "$mnt" | head -12
head -c 400 "$mnt/index.json"; echo
# The first 8 values of a spectral-residual tensor (zeros off the standing
# dimensions), of a tensor served from the GGUF fallback, and the same tensor
# by its underscore name:
od -A d -t f4 -N 32 "$mnt/blk.0.attn_q.weight.f32"
od -A d -t f4 -N 32 "$mnt/blk.0.attn_output.weight.f32"
od -A d -t f4 -N 32 "$mnt/blk_0_attn_output_weight.f32"
cat "$mnt/ctl"
fusermount3 -u "$mnt"
