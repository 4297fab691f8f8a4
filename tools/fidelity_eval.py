#!/usr/bin/env python3
"""One evaluation for every row of docs/QUALITY.md's calibrated-encoding table
(issue 12): whole-file bits per weight, and `rknot probe`'s perplexity, top-1
agreement and mean KL against the dense GGUF on two texts, plus the Paris
probe.

    tools/fidelity_eval.py [--bin DIR] [--out JSON] [--threads N] LABEL=FILE ...

FILE is a GGUF or a self-contained .rknot / .knot; LABEL=FILE+DENSE is a file
layered over a dense GGUF (an SK32 or partial .rknot), probed as
`rknot probe FILE --dense DENSE`. For each row:

* bits per weight: FILE's size x 8 / the parameters FILE serves, as
  `rknot inspect FILE [--dense DENSE] --json` reports them ("source"); a
  layered pair counts FILE's bytes only. Checked against the file size on
  disk.
* `rknot probe FILE --compare REFERENCE --perplexity TEXT --ctx 256` on
  tests/data/probe/gpl-3.0.txt (29 windows) and tests/data/probe/apache-2.0.txt
  (a text the calibration never saw): perplexity +/-, top-1 agreement, mean
  KL(reference || FILE), logits cosine. REFERENCE is the Q4_1 GGUF itself.
* the Paris probe: `rknot probe FILE --prompt "The capital of France is" --top 1`.

A GGUF holding a tensor type rknot does not decode (llama.cpp's IQ4_XS and its
32-wide fallback IQ4_NL) is probed through its F32 twin, made by llama.cpp's
own `llama-quantize --allow-requantize FILE TWIN F32` (tools/llama-cpp.sh),
which dequantizes with llama.cpp's kernels: the same fp32 values llama.cpp
computes with. Its bits per weight remain FILE's; the row says "probed".

The llama.cpp rows of the table (tools/llama_peers.sh makes the files):

    P=/var/tmp/rknot-peers
    tools/fidelity_eval.py dense=models/SmolLM2-135M-Instruct.Q4_1.gguf
    for t in Q8_0 Q6_K Q4_K_M Q4_K_S Q4_0 IQ4_XS; do
      tools/fidelity_eval.py "llama.cpp $t=$P/smollm2.$t.gguf" \
        "llama.cpp $t + imatrix=$P/smollm2.$t.imatrix.gguf"
    done

About 3.5 minutes a row on 2 shared cores (the reference runs beside FILE).

Each row is one JSON object in --out (default tests/data/quality/calibrated.json,
a list; a row with the same label is replaced), and a markdown row on stdout.
Runs with any python3 (standard library only).
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from math import prod
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = {"gpl-3.0": "tests/data/probe/gpl-3.0.txt", "apache-2.0": "tests/data/probe/apache-2.0.txt"}
PROMPT = "The capital of France is"
CTX = 256

# tools/fidelity_table.sh's regexes over rknot probe's output.
PPL_RE = re.compile(r"^perplexity: ([\d.]+) \+/- ([\d.]+)", re.M)
CMP_RE = re.compile(
    r"top-1 agreement ([\d.]+) \((\d+)/(\d+)\), mean KL ([\d.]+) nats.*logits cosine mean ([-\d.]+)"
)
TOP1_RE = re.compile(r'^\s+1\s+\d+\s+([\d.]+)\s+[-\d.]+\s+(".*")\s*$', re.M)
WINDOWS_RE = re.compile(r"\(ctx \d+, (\d+) windows\)")


def run(cmd, what):
    """Run cmd (a list), return stdout+stderr; fail naming `what` and the command."""
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"fidelity_eval: {what} failed (exit {p.returncode}): {shlex.join(cmd)}\n{p.stdout[-3000:]}")
    return p.stdout


def parse_spec(spec):
    label, sep, files = spec.partition("=")
    if not sep or not label or not files:
        sys.exit(f"fidelity_eval: {spec!r}: expected LABEL=FILE or LABEL=FILE+DENSE")
    # FILE+DENSE, unless the whole is one file's name (a '+' in it).
    exists = lambda f: (ROOT / f).is_file() or Path(f).is_file()  # noqa: E731
    file, dense = (files, "") if exists(files) or "+" not in files else files.rsplit("+", 1)
    for f in (file, dense):
        if f and not exists(f):
            sys.exit(f"fidelity_eval: {spec!r}: no such file {f}")
    return label, file, dense or None


def f32_twin(file, llama_bin, twin_dir):
    """llama-quantize's F32 dequantization of a GGUF rknot cannot decode."""
    twin = Path(twin_dir) / (Path(file).name.removesuffix(".gguf") + ".f32-twin.gguf")
    if not twin.is_file():
        if llama_bin is None:  # only such GGUFs need llama.cpp: build it then
            p = subprocess.run(["tools/llama-cpp.sh", "--print-bin-dir"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if p.returncode != 0:
                sys.exit("fidelity_eval: tools/llama-cpp.sh failed")
            llama_bin = p.stdout.strip()
        part = twin.with_name(twin.name + ".part")
        run([str(Path(llama_bin) / "llama-quantize"), "--allow-requantize", file, str(part), "F32"],
            f"llama-quantize to F32 of {file}")
        os.replace(part, twin)
    return str(twin)


def probe(cmd, what, args, file, key):
    """`run`, through --cache DIR when given: the output of the same probe of the same
    FILE (DIR/STEM.KEY.out, STEM the file's name without its suffix) is reused, and a new
    one kept there. A cached output must be of this command on this file's bytes:
    delete the directory when the file or rknot changes."""
    if not args.cache:
        return run(cmd, what)
    cached = Path(args.cache) / f"{Path(file).stem}.{key}.out"
    if cached.is_file():
        return cached.read_text()
    out = run(cmd, what)
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    cached.write_text(out)
    return out


def evaluate(label, file, dense, args):
    t0 = time.monotonic()
    rknot = str(Path(args.bin) / "rknot")
    layered = ["--dense", dense] if dense else []
    inspect = json.loads(run([rknot, "inspect", file, *layered, "--json"], f"rknot inspect {file}"))
    src = inspect["source"]
    size = os.stat(ROOT / file if not Path(file).is_absolute() else file).st_size
    if src["file_bytes"] != size:
        sys.exit(f"fidelity_eval: {file}: inspect says {src['file_bytes']} bytes, the file has {size}")
    # Tensors of FILE itself that rknot cannot decode (a layered file's
    # missing tensors are the dense file's business).
    primary = [t for t in inspect["tensors"] if t["source"]["role"] == "primary"]
    undecodable = sorted({t["stored_type"] for t in primary if not t["available"]})
    # inspect counts the parameters of the tensors it can serve; with
    # undecodable ones, the file's parameters are its tensors' shapes.
    params = src["parameters"]
    if undecodable:
        params = sum(prod(t["shape"]) for t in primary)
    bpw = size * 8 / params
    if not undecodable and abs(bpw - src["bits_per_weight"]) > 1e-9:
        sys.exit(f"fidelity_eval: {file}: size*8/parameters = {bpw}, inspect says {src['bits_per_weight']}")
    probed = file
    probed_note = None
    if undecodable:
        if src["format"] != "gguf" or dense:
            sys.exit(f"fidelity_eval: {file}: rknot does not decode {', '.join(undecodable)}")
        probed = f32_twin(file, args.llama_bin, args.twin_dir)
        twin = json.loads(run([rknot, "inspect", probed, "--json"], f"rknot inspect {probed}"))["source"]
        if twin["parameters"] != params:
            sys.exit(f"fidelity_eval: {file} holds {params} parameters, its F32 twin {twin['parameters']}")
        probed_note = (f"F32 twin by llama-quantize --allow-requantize (rknot does not decode "
                       f"{', '.join(undecodable)})")
    threads = ["--threads", str(args.threads)] if args.threads else []
    row = {"label": label, "file": Path(file).name, "dense": Path(dense).name if dense else None,
           "format": src["format"], "file_bytes": size, "parameters": params,
           "bits_per_weight": bpw}
    if probed_note:
        row["probed"] = probed_note
    commands = [shlex.join(["rknot", "inspect", file, *layered, "--json"])]
    if probed != file:
        commands.append(shlex.join(["llama-quantize", "--allow-requantize", file, probed, "F32"]))
    row["texts"] = {}
    for name, text in TEXTS.items():
        cmd = [rknot, "probe", probed, *layered, "--compare", REFERENCE, "--perplexity", text,
               "--ctx", str(CTX), "--no-progress", *threads]
        out = probe(cmd, f"rknot probe --perplexity {text} on {probed}", args, probed, name)
        commands.append(shlex.join(["rknot", *cmd[1:]]))
        m, c = PPL_RE.search(out), CMP_RE.search(out)
        if not m or not c:
            sys.exit(f"fidelity_eval: cannot read rknot probe's output for {file} on {text}:\n{out}")
        w = WINDOWS_RE.search(out)
        row["texts"][name] = {
            "perplexity": float(m.group(1)), "perplexity_pm": float(m.group(2)),
            "top1_agreement": float(c.group(1)), "positions": int(c.group(3)),
            "kl": float(c.group(4)), "logits_cosine": float(c.group(5)),
            "windows": int(w.group(1)) if w else None,
        }
    cmd = [rknot, "probe", probed, *layered, "--prompt", PROMPT, "--top", "1", "--no-progress", *threads]
    out = probe(cmd, f"rknot probe --prompt on {probed}", args, probed, "paris")
    commands.append(shlex.join(["rknot", *cmd[1:]]))
    p = TOP1_RE.search(out)
    row["paris_top1"] = json.loads(p.group(2)) if p else None
    row["paris_prob"] = float(p.group(1)) if p else None
    row["commands"] = commands
    row["seconds"] = round(time.monotonic() - t0, 1)
    row["rknot"] = run([rknot, "--version"], "rknot --version").strip()
    return row


def markdown(r):
    g, a = r["texts"]["gpl-3.0"], r["texts"]["apache-2.0"]
    paris = f'{json.dumps(r["paris_top1"])} {r["paris_prob"]:.3f}' if r["paris_top1"] is not None else "?"
    return (f'| {r["label"]} | {r["bits_per_weight"]:.3f} | {g["perplexity"]:.2f} ± {g["perplexity_pm"]:.2f} '
            f'| {g["kl"]:.4f} | {g["top1_agreement"]:.4f} | {a["perplexity"]:.2f} ± {a["perplexity_pm"]:.2f} '
            f'| {a["kl"]:.4f} | {a["top1_agreement"]:.4f} | {paris} |')


HEADER = ("| encoding | bpw (whole file) | ppl GPL-3 | KL GPL-3 | top-1 GPL-3 | ppl Apache-2.0 "
          "| KL Apache-2.0 | top-1 Apache-2.0 | Paris (top-1, p) |\n|---|---|---|---|---|---|---|---|---|")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", metavar="LABEL=FILE[+DENSE]")
    ap.add_argument("--bin", default="target/ci", help="directory of the rknot binary (default target/ci)")
    ap.add_argument("--out", default="tests/data/quality/calibrated.json")
    ap.add_argument("--cache", default=None, metavar="DIR",
                    help="keep each probe's output in DIR and reuse it (see probe())")
    ap.add_argument("--threads", type=int, default=None, help="rknot probe --threads (default: all CPUs)")
    ap.add_argument("--llama-bin", default=None,
                    help="llama.cpp tools, for F32 twins (default: tools/llama-cpp.sh --print-bin-dir)")
    ap.add_argument("--twin-dir", default=os.environ.get("RKNOT_PEERS_DIR", "/var/tmp/rknot-peers"),
                    help="where F32 twins are kept (default $RKNOT_PEERS_DIR or /var/tmp/rknot-peers)")
    args = ap.parse_args()
    specs = [parse_spec(s) for s in args.rows]
    print(HEADER)
    out = ROOT / args.out
    for label, file, dense in specs:
        row = evaluate(label, file, dense, args)
        rows = json.loads(out.read_text()) if out.is_file() else []
        rows = [r for r in rows if r["label"] != label] + [row]
        with tempfile.NamedTemporaryFile("w", dir=out.parent, prefix=out.name, suffix=".tmp", delete=False) as f:
            json.dump(rows, f, indent=1, ensure_ascii=False)
            f.write("\n")
        os.replace(f.name, out)
        print(markdown(row), flush=True)
        print(f"{label}: {row['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
