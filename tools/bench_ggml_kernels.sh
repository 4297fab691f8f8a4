#!/usr/bin/env bash
# ggml's own dequantization (`dequantize_row_*`, the reference C that ggml's
# type traits use as to_float) side by side with `rknot bench kernels`: the
# same measurement (one thread, random blocks, 16 MiB of f32 per type,
# median of 7 rounds by thread CPU time, against a memcpy of as many bytes
# in the same run),
# and the ratio rknot / ggml per type.
#
#   tools/bench_ggml_kernels.sh [RKNOT_BIN]     (default target/release/rknot)
#
# Compiles a small C harness against ggml-quants.c from the llama.cpp that
# the llama-cpp-python sdist vendors (the same pinned version and cache as
# tools/llama-cpp.sh, which fetches it: ~/.cache/rknot/llama_cpp_python-
# 0.3.36.tar.gz), with the flags of that build (-O3, x86-64-v3: AVX2, FMA,
# F16C), in a temporary directory. A benchmark: prints numbers, asserts none.
set -euo pipefail

VERSION=0.3.36
root=$(cd "$(dirname "$0")/.." && pwd)
rknot=${1:-$root/target/release/rknot}
sdist=${XDG_CACHE_HOME:-$HOME/.cache}/rknot/llama_cpp_python-$VERSION.tar.gz
[[ -f $sdist ]] || { echo "$sdist missing: run tools/llama-cpp.sh once" >&2; exit 1; }
[[ -x $rknot ]] || { echo "$rknot missing: cargo build --release" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
g=llama_cpp_python-$VERSION/vendor/llama.cpp/ggml
tar xzf "$sdist" -C "$tmp" --wildcards "$g/include/*" "$g/src/ggml-quants.*" \
  "$g/src/ggml-impl.h" "$g/src/ggml-common.h" "$g/src/ggml-cpu/*.h"

cat > "$tmp/harness.c" <<'C'
// Times ggml's dequantize_row_* per type; same cases and report as
// src/bench/kernels.rs.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*to_float)(const void *, float *, int64_t);
#define ROW(t) void dequantize_row_##t(const void *, float *, int64_t);
ROW(q4_0) ROW(q4_1) ROW(q5_0) ROW(q5_1) ROW(q8_0) ROW(q2_K) ROW(q3_K) ROW(q4_K)
ROW(q5_K) ROW(q6_K) ROW(iq1_s) ROW(iq1_m) ROW(iq2_xxs) ROW(iq2_xs) ROW(iq2_s)
ROW(iq3_xxs) ROW(iq3_s) ROW(iq4_nl) ROW(iq4_xs) ROW(tq1_0) ROW(tq2_0) ROW(mxfp4)
ROW(nvfp4)

// Only the quantizers use these; the dequantizers never call them.
void ggml_abort(const char *f, int l, const char *fmt, ...) { (void)f; (void)l; (void)fmt; abort(); }
size_t ggml_row_size(int t, int64_t n) { (void)t; (void)n; abort(); }
const char *ggml_type_name(int t) { (void)t; abort(); }
size_t ggml_type_size(int t) { (void)t; abort(); }

static const struct { const char *name; int elems, bytes; to_float f; } TYPES[] = {
  {"Q4_0", 32, 18, dequantize_row_q4_0}, {"Q4_1", 32, 20, dequantize_row_q4_1},
  {"Q5_0", 32, 22, dequantize_row_q5_0}, {"Q5_1", 32, 24, dequantize_row_q5_1},
  {"Q8_0", 32, 34, dequantize_row_q8_0}, {"Q2_K", 256, 84, dequantize_row_q2_K},
  {"Q3_K", 256, 110, dequantize_row_q3_K}, {"Q4_K", 256, 144, dequantize_row_q4_K},
  {"Q5_K", 256, 176, dequantize_row_q5_K}, {"Q6_K", 256, 210, dequantize_row_q6_K},
  {"IQ1_S", 256, 50, dequantize_row_iq1_s}, {"IQ1_M", 256, 56, dequantize_row_iq1_m},
  {"IQ2_XXS", 256, 66, dequantize_row_iq2_xxs}, {"IQ2_XS", 256, 74, dequantize_row_iq2_xs},
  {"IQ2_S", 256, 82, dequantize_row_iq2_s}, {"IQ3_XXS", 256, 98, dequantize_row_iq3_xxs},
  {"IQ3_S", 256, 110, dequantize_row_iq3_s}, {"IQ4_NL", 32, 18, dequantize_row_iq4_nl},
  {"IQ4_XS", 256, 136, dequantize_row_iq4_xs}, {"TQ1_0", 256, 54, dequantize_row_tq1_0},
  {"TQ2_0", 256, 66, dequantize_row_tq2_0}, {"MXFP4", 32, 17, dequantize_row_mxfp4},
  {"NVFP4", 64, 36, dequantize_row_nvfp4},
};
#define NT (sizeof TYPES / sizeof TYPES[0])
#define ROUNDS 7

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); // as rknot bench kernels
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
static double median(double *v) { qsort(v, ROUNDS, sizeof *v, cmp); return v[ROUNDS / 2]; }
static uint64_t rng = 0x9e3779b97f4a7c15u;
static uint8_t next_byte(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint8_t)rng; }

int main(void) {
  const int64_t n = (int64_t)16 << 18; // 16 MiB of f32
  float *out = calloc(n, 4), *copy_src = malloc(n * 4);
  uint8_t *src[NT];
  for (int64_t i = 0; i < n; i++) copy_src[i] = (float)i;
  for (size_t t = 0; t < NT; t++) {
    size_t bytes = n / TYPES[t].elems * TYPES[t].bytes;
    src[t] = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) src[t][i] = next_byte();
    if (!strcmp(TYPES[t].name, "MXFP4")) // no subnormal products (as rknot bench)
      for (size_t i = 0; i < bytes; i += 17) src[t][i] = 100 + src[t][i] % 51;
  }
  double cs[ROUNDS], s[NT][ROUNDS];
  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now();
    memcpy(out, copy_src, n * 4);
    __asm__ volatile("" : : "r"(out) : "memory");
    cs[r] = now() - t0;
    for (size_t t = 0; t < NT; t++) {
      t0 = now();
      TYPES[t].f(src[t], out, n);
      __asm__ volatile("" : : "r"(out) : "memory");
      s[t][r] = now() - t0;
    }
  }
  double base = n * 4 / median(cs) / 1e9;
  printf("baseline %.2f\n", base);
  for (size_t t = 0; t < NT; t++) printf("%s %.2f\n", TYPES[t].name, n * 4 / median(s[t]) / 1e9);
  return 0;
}
C
cc -O3 -DNDEBUG -march=x86-64-v3 -std=c11 -D_GNU_SOURCE -I"$tmp/$g/include" -I"$tmp/$g/src" \
  "$tmp/harness.c" "$tmp/$g/src/ggml-quants.c" -o "$tmp/harness" -lm

ggml=$("$tmp/harness")
ours=$("$rknot" bench kernels --size-mb 16 --rounds 7 2>/dev/null)
echo "$ours" | head -2
echo "ggml dequantize_row_* (llama.cpp of llama-cpp-python $VERSION): memcpy $(echo "$ggml" | awk '$1 == "baseline" {print $2}') GB/s"
printf '%-9s %12s %12s %14s\n' type "rknot GB/s" "ggml GB/s" "rknot / ggml"
echo "$ours" | awk 'NR > 3 {print $1, $3}' | while read -r ty rate; do
  theirs=$(echo "$ggml" | awk -v t="$ty" '$1 == t {print $2}')
  if [[ -n $theirs ]]; then
    printf '%-9s %12s %12s %14s\n' "$ty" "$rate" "$theirs" "$(awk -v a="$rate" -v b="$theirs" 'BEGIN {printf "%.2f", a / b}')"
  else
    printf '%-9s %12s %12s %14s\n' "$ty" "$rate" "-" "-"
  fi
done
