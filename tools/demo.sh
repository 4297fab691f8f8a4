#!/usr/bin/env bash
# Build rknot and show it working on the demo model that ships in demo/ (a
# tiny llama-shaped model with random weights: tiny-llama.gguf, and
# tiny-llama.rknot, a compressed file of its layer matrices that uses the
# GGUF as dense fallback): mount it, look at the mount, read decoded values,
# run the model on the mounted tensors, encode the GGUF again with today's
# default profile, unmount, and sum up. Each step prints one line saying
# what it shows; every figure in the summary is measured here.
#
# Needs the Rust toolchain, python3 (standard library only) and FUSE
# (root, or fuse3's fusermount3; installed through apt-get when missing and
# run as root).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }
# runto FILE CMD...: the same, stdout into FILE (shown as a redirection).
runto() { local f=$1; shift; printf '$ %s > %s\n' "$*" "${f##*/}"; "$@" > "$f"; }
# A few fields of a JSON file, never a cut document: json FILE <<'PY'
# python printing lines, the document parsed as `d`
# PY
json() {
  python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
exec(sys.stdin.read())' "$1"
}

step "set-up: fuse3 (for mounting) and a release build of rknot and rknot-mount"
if ! command -v fusermount3 >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing fuse3"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 >/dev/null
fi
command -v python3 >/dev/null || { echo "demo: python3 is needed (Debian: apt-get install python3)" >&2; exit 1; }
if [ -x target/release/rknot ] && [ -x target/release/rknot-mount ]; then
  echo "building (incremental: seconds when nothing changed)"
else
  # Measured: `time cargo build --release` in a fresh clone on the 2-core
  # dev machine, nothing else running (empty target/, crates already
  # downloaded): 4 min 21 s.
  echo "first build: cargo compiles rknot and its ~210 dependencies in release mode, about 4.5 minutes on 2 idle cores (more on a busy machine); its progress follows"
fi
run cargo build --release
rknot=target/release/rknot
mount_bin=target/release/rknot-mount

work=$(mktemp -d /tmp/rknot-demo.XXXXXX)
mnt=$work/mnt
mkdir "$mnt"
# Unmount and clean up on every way out: success, a failed step (set -e),
# Ctrl-C, kill.
cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then
    fusermount3 -u "$mnt" 2>/dev/null || umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
  fi
  rm -rf "$work" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "the compressed demo file, checked against its GGUF: its size, and how far its values are from the GGUF's"
echo "(rknot verify: the structure of every block, then every tensor decoded from both files and compared)"
runto "$work/verify-demo.json" "$rknot" verify demo/tiny-llama.rknot --dense demo/tiny-llama.gguf --json --no-progress
json "$work/verify-demo.json" <<'PY'
o = d['overall']
print(f"format {d['format']}, structure {'OK' if d['ok'] else 'FAULTY'}: {d['file_bytes']} bytes for {d['parameters']} weights, {d['bits_per_weight']:.2f} bits per weight")
print(f"relative error {o['rel_err']:.3f}, cosine {o['cosine']:.3f} over those weights: the aggressive 'seed' profile, far from the GGUF")
PY

step "mount the compressed demo model (the .rknot over its GGUF as dense fallback): every tensor becomes a file of f32"
run "$mount_bin" demo/tiny-llama.rknot "$mnt" --dense demo/tiny-llama.gguf

step "list the mount: a .f32 file per tensor (under both spellings), engine views, index.json, ctl, jobs/"
run ls -l "$mnt" | sed -n 1,6p
echo "... $(ls "$mnt" | wc -l) names in all; those that are not tensor files:"
ls -l "$mnt" | grep -v '\.f32$' | grep -v '^total'

step "index.json describes what is mounted (a few of its fields, parsed with python3)"
cp "$mnt/index.json" "$work/index.json"
json "$work/index.json" <<'PY'
t = d['totals']
print(f"source {d['source']['format']} v{d['source']['version']}, fallback {d['fallback']['format']} v{d['fallback']['version']}")
print(f"{t['tensors']} tensors, {t['parameters']} parameters: {t['stored_bytes']} bytes stored, {t['served_bytes']} bytes served as f32")
for x in d['tensors'][:4]:
    print(f"  {x['name']:<26} {str(x['shape']):<11} {x['stored_type']:<8} from the {x['source']['role']}")
print(f"  ... and {len(d['tensors']) - 4} more")
PY

step "read decoded values: the first 8 floats of a spectral-residual tensor (zeros off the standing dimensions)"
run od -A d -t f4 -N 32 "$mnt/blk.0.attn_q.weight.f32"

step "a tensor the .rknot lacks, served from the GGUF fallback, and the same file under its underscore name"
run od -A d -t f4 -N 32 "$mnt/blk.0.attn_output.weight.f32"
run od -A d -t f4 -N 32 "$mnt/blk_0_attn_output_weight.f32"
run cmp "$mnt/blk.0.attn_output.weight.f32" "$mnt/blk_0_attn_output_weight.f32" && echo "same bytes"

tokens=$(seq -s, 1 32)
step "run the model (an fp32 forward pass) on the mounted tensors: the next token after 32 token ids, against the GGUF"
runto "$work/probe-mount.txt" "$rknot" probe "$mnt" --tokens "$tokens" --top 3 --compare demo/tiny-llama.gguf
# Its model line, both next-token tables and the agreement line.
grep -E '^model:|next token|^  rank|^ +[0-9]+ +[0-9]+ |^fidelity' "$work/probe-mount.txt"

step "what the daemon did: ctl, the mount's status file (the same as JSON in ctl.json)"
run cat "$mnt/ctl"
cp "$mnt/ctl.json" "$work/ctl.json"

step "unmount"
run fusermount3 -u "$mnt"
if mountpoint -q "$mnt"; then
  echo "demo: $mnt is still mounted" >&2
  exit 1
fi
echo "unmounted"

# The default profile is the calibrated one; the demo model's tokenizer has
# no BPE merges, so the encoder cannot calibrate it, says so in one line and
# takes the faithful profile (seconds).
step "encode the GGUF again with the default profile, into a self-contained .rknot, and check it"
run "$rknot" encode rknot demo/tiny-llama.gguf -o "$work/tiny.rknot" --no-progress 2>&1
runto "$work/verify-new.json" "$rknot" verify "$work/tiny.rknot" --dense demo/tiny-llama.gguf --json --no-progress
json "$work/verify-new.json" <<'PY'
print(f"format {d['format']}: {d['file_bytes']} bytes for {d['parameters']} weights, {d['bits_per_weight']:.2f} bits per weight; relative error {d['overall']['rel_err']:.3f} over every tensor it stores")
PY
runto "$work/probe-new.txt" "$rknot" probe "$work/tiny.rknot" --tokens "$tokens" --top 3 --compare demo/tiny-llama.gguf
grep '^fidelity' "$work/probe-new.txt"

# The summary: every figure from the outputs above.
agree() { sed -n 's/.*top-1 agreement [0-9.]* (\([0-9]*\/[0-9]*\)).*/\1/p' "$1"; }
top1() { awk '/^next token/ {getline; getline; print $2; exit}' "$1"; }
ref1() { awk '/^reference next token/ {getline; getline; print $2; exit}' "$1"; }
step "summary: what this demo showed"
json "$work/index.json" <<'PY'
t = d['totals']
print(f"- a mount of a .rknot over its GGUF: {t['tensors']} tensors ({t['parameters']} parameters) as f32 files, {t['served_bytes']} bytes served from {t['stored_bytes']} bytes stored")
PY
json "$work/ctl.json" <<'PY'
r, c = d['reads'], d['cache']
print(f"- read through it in this demo: {r['bytes_served']} bytes of f32 in {r['total']} reads; the daemon decoded {c['bytes_decoded']} bytes ({c['misses']} cache misses, {c['hits']} hits)")
PY
json "$work/verify-demo.json" <<'PY'
print(f"- the shipped demo/tiny-llama.rknot ({d['format']}, seed profile): {d['bits_per_weight']:.2f} bits per weight, relative error {d['overall']['rel_err']:.3f} against the GGUF")
PY
json "$work/verify-new.json" <<'PY'
print(f"- the GGUF re-encoded with the default profile (faithful here: the demo model cannot be calibrated; {d['format']}, self-contained): {d['bits_per_weight']:.2f} bits per weight, relative error {d['overall']['rel_err']:.3f} over every tensor it stores")
PY
echo "- next token after ids 1..32: #$(top1 "$work/probe-mount.txt") through the mount, #$(ref1 "$work/probe-mount.txt") from the GGUF, #$(top1 "$work/probe-new.txt") from the re-encoded file"
echo "- top-1 agreement with the GGUF over the 32 positions: $(agree "$work/probe-mount.txt") for the demo .rknot, $(agree "$work/probe-new.txt") for the re-encoded one"
echo "- unmounted; the scratch directory $work is removed on exit"
