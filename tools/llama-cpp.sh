#!/usr/bin/env bash
# llama.cpp's command-line tools, built once from the llama.cpp that the
# llama-cpp-python sdist vendors (the same pinned version as
# tools/ggml_reference_errors.py and tools/probe_reference.py), CPU only, and
# cached. tests/llama_cpp.rs runs them on the mount's model.gguf
# (RKNOT_LLAMA_BIN; README: Tests).
#
#   tools/llama-cpp.sh [--print-bin-dir | --cached-bin-dir]
#
# Builds, when not cached yet, llama-completion (plain non-interactive
# completion: `llama-cli` in this version is the chat client built with the
# server), llama-perplexity, and llama-imatrix and llama-quantize (the
# calibrated peers of tools/llama_peers.sh), and prints the directory that
# holds them. A cache made before a tool joined the list lacks it and counts
# as incomplete: it is rebuilt whole (the build is one cmake run; the tools
# share the libraries that take most of its time).
# With --print-bin-dir, stdout is that directory alone (progress goes to
# stderr), for `export RKNOT_LLAMA_BIN=$(tools/llama-cpp.sh --print-bin-dir)`.
# With --cached-bin-dir, the same when the tools are cached, and exit 1
# without building when they are not (tools/env.sh: quick, never a build).
#
#   RKNOT_LLAMA_CPP_DIR  the cache (default
#                        ${XDG_CACHE_HOME:-$HOME/.cache}/rknot/llama.cpp-VERSION);
#                        the binaries are in its bin/. Delete it to rebuild.
#
# The sdist is fetched from PyPI once (its sha256 checked against the one the
# simple index names) and kept in ${XDG_CACHE_HOME:-$HOME/.cache}/rknot/.
# The build (cmake; installed through apt-get when missing and we are root)
# happens in a temporary directory; only the finished bin/ is moved into
# place, so a cache directory that exists is complete. The binaries are not
# tuned to this CPU (no GGML_NATIVE): on x86-64 they use AVX2, FMA and F16C
# (x86-64-v3) and no AVX-512 or AMX, so a cache moves between machines (and
# AMX, which -march=native turns on, traps in some VMs: SIGILL on tilezero).
# Cold build on 2 cores: about 5 to 6 minutes; the cache holds about 35 MB.
set -euo pipefail

VERSION=0.3.36 # llama-cpp-python; its vendor/llama.cpp is what gets built
TARGETS=(llama-completion llama-perplexity llama-imatrix llama-quantize)

print_bin_dir=false
cached_only=false
case ${1:-} in
  --print-bin-dir) print_bin_dir=true ;;
  --cached-bin-dir) print_bin_dir=true; cached_only=true ;;
  "") ;;
  *) echo "usage: $0 [--print-bin-dir | --cached-bin-dir]" >&2; exit 2 ;;
esac
# Progress to stderr, so that stdout is the bin directory alone.
say() { echo "llama-cpp.sh: $*" >&2; }

cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/rknot
dir=${RKNOT_LLAMA_CPP_DIR:-$cache_root/llama.cpp-$VERSION}

# CPU only, not -march=native (above), static (the binaries stand alone once
# moved), no OpenMP (ggml's own thread pool), none of the tests, examples,
# server, web UI or HTTPS.
flags=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF
  -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON
)

# Complete: the binaries are there and were built with these flags (a
# change of the flags above rebuilds).
complete() {
  local t
  [ -f "$dir/BUILD-INFO" ] || return 1
  for t in "${TARGETS[@]}"; do [ -x "$dir/bin/$t" ] || return 1; done
  grep -qxF "cmake ${flags[*]}" "$dir/BUILD-INFO"
}

if [ "$(uname -m)" = x86_64 ] && ! grep -qw avx2 /proc/cpuinfo; then
  say "this CPU lacks AVX2, which the llama.cpp build here assumes (x86-64-v3)"
  exit 1
fi

if complete; then
  if $print_bin_dir; then echo "$dir/bin"; else echo "llama.cpp tools (cached): $dir/bin"; fi
  exit 0
fi
if $cached_only; then
  say "not cached in $dir (run tools/llama-cpp.sh to build)"
  exit 1
fi
if [ -e "$dir" ]; then
  say "$dir is incomplete or was built with other flags: rebuilding"
fi

# The sdist, checked against the sha256 in PyPI's simple index (PEP 503).
sdist=$cache_root/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$sdist" ]; then
  say "fetching llama-cpp-python $VERSION (sdist) from PyPI"
  mkdir -p "$cache_root"
  python3 - "$VERSION" "$sdist" <<'EOF'
import hashlib, os, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{version}.tar.gz"
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
href = next(h for h in page.split('href="')[1:] if name + "#" in h.split('"')[0]).split('"')[0]
url, digest = href.split("#sha256=")
data = urllib.request.urlopen(url).read()
if hashlib.sha256(data).hexdigest() != digest:
    sys.exit(f"{name}: sha256 mismatch (index says {digest})")
with open(out + ".part", "wb") as f:
    f.write(data)
os.replace(out + ".part", out)
EOF
fi

missing=""
command -v cmake >/dev/null || missing="$missing cmake"
command -v g++ >/dev/null || missing="$missing g++"
command -v make >/dev/null || missing="$missing make"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing$missing"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    say "missing:$missing (install them)"
    exit 1
  fi
fi

mkdir -p "$(dirname "$dir")"
work=$(mktemp -d "$dir.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
say "building ${TARGETS[*]} from llama-cpp-python $VERSION's vendored llama.cpp in $work"
tar xzf "$sdist" -C "$work" "llama_cpp_python-$VERSION/vendor/llama.cpp"
src=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
start=$(date +%s)
cmake -S "$src" -B "$work/build" "${flags[@]}" >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target "${TARGETS[@]}" -j"${RKNOT_LLAMA_CPP_JOBS:-2}" >"$work/build.log" 2>&1 \
  || { tail -50 "$work/build.log" >&2; exit 1; }
mkdir "$work/out" "$work/out/bin"
for t in "${TARGETS[@]}"; do
  cp "$work/build/bin/$t" "$work/out/bin/"
  strip "$work/out/bin/$t" 2>/dev/null || true
done
{
  echo "llama-cpp-python $VERSION (vendor/llama.cpp), sdist sha256 $(sha256sum "$sdist" | cut -d' ' -f1)"
  echo "cmake ${flags[*]}"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(($(date +%s) - start)) s"
} >"$work/out/BUILD-INFO"
rm -rf "$dir"
# A concurrent build may have won the race: its directory is complete too.
mv -T "$work/out" "$dir" 2>/dev/null || complete
say "built in $(($(date +%s) - start)) s: $dir/bin ($(du -sh "$dir" | cut -f1))"
if $print_bin_dir; then echo "$dir/bin"; else echo "llama.cpp tools: $dir/bin"; fi
