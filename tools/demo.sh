#!/usr/bin/env bash
# Build rknot and show it working on the demo model that ships in demo/:
# a tiny llama-shaped model as GGUF, plus a .rknot and an SK32 sketch of it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/rknot
set -x
$bin inspect demo/tiny-llama.rknot --dense demo/tiny-llama.gguf
# First 8 decoded values of a spectral-residual tensor, of the dense source,
# and of a sketch (attn_o is the sketch generator's name for attn_output):
$bin cat demo/tiny-llama.rknot blk.0.attn_q.weight --length 32 | od -A d -t f4
$bin cat demo/tiny-llama.gguf blk_0_attn_q_weight --length 32 | od -A d -t f4
$bin cat demo/tiny-llama.sk32 blk.1.attn_o.weight --dense demo/tiny-llama.gguf --offset 4096 --length 32 | od -A d -t f4
