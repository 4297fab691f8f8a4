#!/usr/bin/env python3
"""rknot's evaluation tool: the measurements behind docs/QUALITY.md's tables
and plot, one subcommand each, over one set of helpers (running rknot,
reading `rknot probe`'s output, mounting).

    tools/eval.py rows [--bin DIR] [--out JSON] [--cache DIR] LABEL=FILE[+DENSE] ...
    tools/eval.py fidelity [--bin DIR]        the "Inference fidelity" table (mounts; root)
    tools/eval.py quality [--bin DIR]         the weight-error table (tests/data/quality/encodings.json)
    tools/eval.py calibrated [--bin DIR]      the "Calibrated encoding" rows, then the plot
    tools/eval.py sk32 STATS [--bin DIR] [--work DIR] [--ranks R] [--variants V]
    tools/eval.py plot [--data JSON] [--out PNG]

Runs with any python3 (standard library only), except `plot`, which reruns
itself in rknot's Python environment with matplotlib (tools/python-env.sh).
Each subcommand's help (`tools/eval.py SUB --help`) says what it measures
and what it writes.
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
from contextlib import contextmanager
from math import prod
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE = MODEL
GPL_TEXT = "tests/data/probe/gpl-3.0.txt"
TEXTS = {"gpl-3.0": GPL_TEXT, "apache-2.0": "tests/data/probe/apache-2.0.txt"}
CALIBRATION_TEXT = "data/calibration/python-idle-help.txt"
PROMPT = "The capital of France is"
CTX = 256

# Over rknot probe's output.
PPL_RE = re.compile(r"^perplexity: ([\d.]+) \+/- ([\d.]+)", re.M)
CMP_RE = re.compile(
    r"top-1 agreement ([\d.]+) \((\d+)/(\d+)\), mean KL ([\d.]+) nats.*logits cosine mean ([-\d.]+)"
)
# The same without the cosine (a probe without --compare's cosine line).
CMP_KL_RE = re.compile(r"top-1 agreement ([\d.]+) \((\d+)/(\d+)\), mean KL ([\d.]+) nats")
TOP1_RE = re.compile(r'^\s+1\s+\d+\s+([\d.]+)\s+[-\d.]+\s+(".*")\s*$', re.M)
WINDOWS_RE = re.compile(r"\(ctx \d+, (\d+) windows\)")

# matplotlib for `plot` (pinned).
MATPLOTLIB = "3.11.2"
NUMPY = "2.4.6"
REFERENCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(cmd, what):
    """Run cmd (a list), return stdout+stderr; fail naming `what` and the command."""
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"eval: {what} failed (exit {p.returncode}): {shlex.join(cmd)}\n{p.stdout[-3000:]}")
    return p.stdout


def parse_spec(spec):
    label, sep, files = spec.partition("=")
    if not sep or not label or not files:
        sys.exit(f"eval rows: {spec!r}: expected LABEL=FILE or LABEL=FILE+DENSE")
    # FILE+DENSE, unless the whole is one file's name (a '+' in it).
    exists = lambda f: (ROOT / f).is_file() or Path(f).is_file()  # noqa: E731
    file, dense = (files, "") if exists(files) or "+" not in files else files.rsplit("+", 1)
    for f in (file, dense):
        if f and not exists(f):
            sys.exit(f"eval rows: {spec!r}: no such file {f}")
    return label, file, dense or None


def f32_twin(file, llama_bin, twin_dir):
    """llama-quantize's F32 dequantization of a GGUF rknot cannot decode."""
    twin = Path(twin_dir) / (Path(file).name.removesuffix(".gguf") + ".f32-twin.gguf")
    if not twin.is_file():
        if llama_bin is None:  # only such GGUFs need llama.cpp: build it then
            p = subprocess.run(["tools/llama-cpp.sh", "--print-bin-dir"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if p.returncode != 0:
                sys.exit("eval rows: tools/llama-cpp.sh failed")
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
        sys.exit(f"eval rows: {file}: inspect says {src['file_bytes']} bytes, the file has {size}")
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
        sys.exit(f"eval rows: {file}: size*8/parameters = {bpw}, inspect says {src['bits_per_weight']}")
    probed = file
    probed_note = None
    if undecodable:
        if src["format"] != "gguf" or dense:
            sys.exit(f"eval rows: {file}: rknot does not decode {', '.join(undecodable)}")
        probed = f32_twin(file, args.llama_bin, args.twin_dir)
        twin = json.loads(run([rknot, "inspect", probed, "--json"], f"rknot inspect {probed}"))["source"]
        if twin["parameters"] != params:
            sys.exit(f"eval rows: {file} holds {params} parameters, its F32 twin {twin['parameters']}")
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
            sys.exit(f"eval rows: cannot read rknot probe's output for {file} on {text}:\n{out}")
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


# ---------------------------------------------------------------------------
# rows (the one evaluation of a row of the calibrated-encoding table)

ROWS_DOC = '''One evaluation for every row of docs/QUALITY.md's calibrated-encoding table
(issue 12): whole-file bits per weight, and `rknot probe`'s perplexity, top-1
agreement and mean KL against the dense GGUF on two texts, plus the Paris
probe.

    tools/eval.py rows [--bin DIR] [--out JSON] [--threads N] LABEL=FILE ...

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
    tools/eval.py rows dense=models/SmolLM2-135M-Instruct.Q4_1.gguf
    for t in Q8_0 Q6_K Q4_K_M Q4_K_S Q4_0 IQ4_XS; do
      tools/eval.py rows "llama.cpp $t=$P/smollm2.$t.gguf" \
        "llama.cpp $t + imatrix=$P/smollm2.$t.imatrix.gguf"
    done

About 3.5 minutes a row on 2 shared cores (the reference runs beside FILE).

Each row is one JSON object in --out (default tests/data/quality/calibrated.json,
a list; a row with the same label is replaced), and a markdown row on stdout.
Runs with any python3 (standard library only).'''


def cmd_rows(args):
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


# ---------------------------------------------------------------------------
# Shared by fidelity, quality and sk32: encode, inspect, probe.


def rknot(args, *argv, quiet=False):
    """Run BIN/rknot with argv; its stdout. With quiet its stderr is dropped
    (the encoders' progress)."""
    cmd = [str(Path(args.bin) / "rknot"), *map(str, argv)]
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL if quiet else None, text=True)
    if p.returncode != 0:
        sys.exit(f"eval: {shlex.join(cmd)} failed (exit {p.returncode})")
    return p.stdout


def probe_row(args, target, layered=(), cosine=True):
    """`rknot probe TARGET --compare MODEL --perplexity GPL-3 --ctx 256` and the
    Paris prompt: the figures of a fidelity row (with the logits cosine) or of
    an sk32 row (without; run with --no-progress)."""
    quiet = [] if cosine else ["--no-progress"]
    ppl = run([str(Path(args.bin) / "rknot"), "probe", str(target), *layered, "--compare", MODEL,
               "--perplexity", GPL_TEXT, "--ctx", str(CTX), *quiet], "rknot probe --perplexity")
    paris = run([str(Path(args.bin) / "rknot"), "probe", str(target), *layered, "--prompt", PROMPT,
                 "--top", "1", *quiet], "rknot probe --prompt")
    m = PPL_RE.search(ppl)
    f = (CMP_RE if cosine else CMP_KL_RE).search(ppl)
    p = TOP1_RE.search(paris)
    row = {"perplexity": float(m.group(1)), "perplexity_pm": float(m.group(2)),
           "top1_agreement": float(f.group(1)), "kl": float(f.group(4))}
    if cosine:
        row["logits_cosine"] = float(f.group(5))
    row["paris_top1"] = p.group(2) if p else None
    row["paris_prob"] = float(p.group(1)) if p else None
    return row


@contextmanager
def mounted(args, file, mnt):
    """FILE mounted at MNT over the GGUF as dense fallback (no jobs)."""
    subprocess.run([str(Path(args.bin) / "rknot-mount"), str(file), str(mnt), "--dense", MODEL, "-o", "nojobs"],
                   cwd=ROOT, stdout=subprocess.DEVNULL, check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)


# ---------------------------------------------------------------------------
# fidelity: the "Inference fidelity" table, read through a real mount

FIDELITY_ROWS = [
    ("SK32 rank 64", "s.sk32", ["sk32", MODEL, "--rank", "64"]),
    ("SK32 rank 128", "s128.sk32", ["sk32", MODEL, "--rank", "128"]),
    (".rknot seed, coverage 0.3", "seed.rknot", ["rknot", MODEL, "--profile", "seed", "--coverage", "0.3"]),
    (".rknot seed graded (+2), coverage 1.0", "sg.rknot",
     ["rknot", MODEL, "--profile", "seed", "--coverage", "1.0", "--graded", "--extra-bits", "2"]),
    (".rknot faithful, 5.0 bpw", "f5.rknot", ["rknot", MODEL, "--profile", "faithful"]),
    (".rknot faithful, 6.0 bpw", "f6.rknot", ["rknot", MODEL, "--profile", "faithful", "--target-bpw", "6"]),
    (".rknot faithful, 7.0 bpw", "f7.rknot", ["rknot", MODEL, "--profile", "faithful", "--target-bpw", "7"]),
]


def cmd_fidelity(args):
    with tempfile.TemporaryDirectory(prefix="rknot-fidelity.", dir="/tmp") as work:
        mnt = Path(work) / "mnt"
        mnt.mkdir()
        rows = []
        try:
            for label, file, enc in FIDELITY_ROWS:
                out = Path(work) / file
                rknot(args, "encode", *enc, "-o", out, quiet=True)
                t = json.loads(rknot(args, "inspect", out, "--dense", MODEL, "--json"))["source"]
                with mounted(args, out, mnt):
                    figures = probe_row(args, mnt)
                rows.append({"label": label, "command": "rknot encode " + " ".join(enc),
                             "bits_per_weight": t["bits_per_weight"], **figures})
                print(f"{label} done", file=sys.stderr)
        finally:
            subprocess.run(["fusermount3", "-uz", str(mnt)], stderr=subprocess.DEVNULL, check=False)
    # Key order as the table's readers expect it.
    keys = ["label", "command", "bits_per_weight", "perplexity", "perplexity_pm", "top1_agreement", "kl",
            "logits_cosine", "paris_top1", "paris_prob"]
    rows = [{k: r[k] for k in keys} for r in rows]
    json.dump(rows, open(ROOT / "tests/data/quality/fidelity.json", "w"), indent=1)
    for r in rows:
        print(f'| {r["label"]} | mount of the encoded file + GGUF fallback | {r["bits_per_weight"]:.3f} '
              f'| {r["top1_agreement"]:.4f} | {r["kl"]:.4f} | {r["logits_cosine"]:.4f} '
              f'| {r["perplexity"]:.4g} ± {r["perplexity_pm"]:.3g} | {r["paris_top1"]} {r["paris_prob"]} |')


# ---------------------------------------------------------------------------
# quality: every encoding's weight error (rknot verify --json)


def quality_rows():
    for n, a in [("refit+clip (default)", []), ("refit", ["--no-clip"]), ("clip", ["--no-refit"]),
                 ("plain", ["--no-refit", "--no-clip"]), ("balance", ["--balance", "--no-refit", "--no-clip"])]:
        yield f"sk32 r64 {n}", "s.sk32", ["sk32", MODEL, "--rank", "64", *a]
    for r in (16, 32, 128):
        yield f"sk32 r{r}", "s.sk32", ["sk32", MODEL, "--rank", str(r)]
    for c in ("0.3", "0.5", "1.0"):
        yield f"rknot seed c{c}", "r.rknot", ["rknot", MODEL, "--profile", "seed", "--coverage", c]
        yield (f"rknot seed graded c{c}", "r.rknot",
               ["rknot", MODEL, "--profile", "seed", "--coverage", c, "--graded", "--extra-bits", "2"])
        yield f"rknot faithful c{c}", "r.rknot", ["rknot", MODEL, "--profile", "faithful", "--coverage", c]
    for b in ("4.5", "6.0", "7.0"):
        yield (f"rknot faithful 1.0 {b}bpw", "r.rknot",
               ["rknot", MODEL, "--profile", "faithful", "--coverage", "1.0", "--target-bpw", b])
    yield "knot repack", "k.knot", ["knot", MODEL]


def cmd_quality(args):
    results = "tests/data/quality/encodings.json"
    rows = []
    with tempfile.TemporaryDirectory(prefix="rknot-quality.", dir="/tmp") as work:
        for name, file, enc in quality_rows():
            out = Path(work) / file
            t0 = time.monotonic_ns()
            rknot(args, "encode", *enc, "-o", out, "--overwrite", quiet=True)
            ms = (time.monotonic_ns() - t0) // 1000000
            v = json.loads(rknot(args, "verify", out, "--dense", MODEL, "--json"))
            rows.append({"name": name, "command": "rknot encode " + " ".join(enc).replace("models/", "MODELS/"),
                         "encode_seconds": round(ms / 1000, 1), "file_bytes": out.stat().st_size,
                         "bits_per_weight": v["bits_per_weight"], "ok": v["ok"], "overall": v["overall"],
                         "by_kind": v["by_kind"]})
            print(f"{name} done", file=sys.stderr)
    (ROOT / results).write_text(json.dumps(rows, indent=4) + "\n")
    print(f"wrote {results}")


# ---------------------------------------------------------------------------
# calibrated: the .rknot rows of "Calibrated encoding", then the plot

def calibrated_rows(stats):
    s = ["--calibration-stats", stats]
    # The calibrated default (GPTQ, activation-weighted fit, balanced
    # allocation, widths 2-8 x groups 32/64, vocabulary as Q5_1) per target.
    for b in ("4.75", "5.0", "5.25", "5.5"):
        yield f".rknot calibrated {b}", f"cal-{b}.rknot", [*s, "--target-bpw", b]
    # Each technique on its own, at 5.0 (and 4.5).
    yield (".rknot calibrated 5.0, allocation output", "cal-5.0-output.rknot",
           [*s, "--target-bpw", "5.0", "--allocation", "output"])
    yield (".rknot calibrated 5.25, allocation output", "cal-5.25-output.rknot",
           [*s, "--target-bpw", "5.25", "--allocation", "output"])
    yield (".rknot calibrated 5.0, one width for all", "cal-5.0-uniform.rknot",
           [*s, "--target-bpw", "5.0", "--allocation", "uniform"])
    yield (".rknot calibrated 5.0, groups of 32, allocation output", "cal-5.0-g32.rknot",
           [*s, "--target-bpw", "5.0", "--groups", "32", "--allocation", "output"])
    yield (".rknot calibrated 5.0, groups of 32, allocation output, no GPTQ", "cal-5.0-g32-rtn.rknot",
           [*s, "--target-bpw", "5.0", "--groups", "32", "--allocation", "output", "--no-gptq"])
    yield (".rknot calibrated 4.5, groups of 32, allocation output", "cal-4.5-g32.rknot",
           [*s, "--target-bpw", "4.5", "--groups", "32", "--allocation", "output"])
    yield (".rknot affine 5.0, no calibration", "cal-5.0-plain.rknot",
           [*s, "--target-bpw", "5.0", "--no-gptq", "--no-weighted-fit", "--allocation", "uniform"])
    # The vocabulary kept as the source's Q8_0: (almost) every matrix exact.
    yield (".rknot calibrated 5.85, vocabulary kept (Q8_0)", "cal-5.85-keep.rknot",
           [*s, "--target-bpw", "5.85", "--vocab-type", "keep", "--allocation", "output"])
    # The faithful profile (no calibration), and with the activation manifest.
    yield ".rknot faithful 5.0", "faithful-5.0.rknot", ["--profile", "faithful", "--target-bpw", "5.0"]
    yield (".rknot faithful 5.0, activation manifest", "faithful-act-5.0.rknot",
           ["--profile", "faithful", "--target-bpw", "5.0", *s])


def cmd_calibrated(args):
    work = Path(os.environ.get("RKNOT_CALIBRATED_DIR", "/var/tmp/rknot-calibrated"))
    work.mkdir(parents=True, exist_ok=True)
    if not (ROOT / MODEL).is_file():
        subprocess.run(["tools/fetch-smollm2.sh"], cwd=ROOT, check=True)
    stats = work / "smollm2.stats.safetensors"
    if not stats.is_file():
        # The whole calibration text, windows of 512, with Gram matrices (403 MB).
        subprocess.run([str(Path(args.bin) / "rknot"), "calibrate", MODEL, "--text", CALIBRATION_TEXT,
                        "--gram", "-o", str(stats)], cwd=ROOT, check=True)
    specs = []
    for label, file, enc in calibrated_rows(str(stats)):
        out = work / file
        if not out.is_file():
            subprocess.run([str(Path(args.bin) / "rknot"), "encode", "rknot", MODEL, "-o", str(out), *enc],
                           cwd=ROOT, check=True)
        specs.append(f"{label}={out}")
    cmd_rows(argparse.Namespace(rows=specs, bin=args.bin, out="tests/data/quality/calibrated.json",
                                cache=str(work / "probes"), threads=None, llama_bin=None,
                                twin_dir=os.environ.get("RKNOT_PEERS_DIR", "/var/tmp/rknot-peers")))
    cmd_plot(argparse.Namespace(data="tests/data/quality/calibrated.json", out="docs/quality-ppl-bpw.png"))


# ---------------------------------------------------------------------------
# sk32: SK32 with and without activation weighting (issue 12)


def cmd_sk32(args):
    work = Path(args.work or tempfile.mkdtemp(prefix="rknot-sk32act.", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / "rows.jsonl"
    jsonl.touch()
    stats = args.stats
    for r in args.ranks.split():
        for v in args.variants.split():
            if v == "plain":
                label, file, extra = f"SK32 rank {r}", f"r{r}-plain.sk32", []
            elif v == "diagonal":
                label, file = f"SK32 rank {r}, diagonal activations", f"r{r}-diag.sk32"
                extra = ["--calibration-stats", stats, "--whiten", "diagonal"]
            elif v == "gram":
                label, file = f"SK32 rank {r}, Gram activations", f"r{r}-gram.sk32"
                extra = ["--calibration-stats", stats, "--whiten", "gram"]
            else:
                sys.exit(f"eval sk32: unknown variant {v!r} (plain, diagonal, gram)")
            # Rows already in WORK/rows.jsonl are kept (resumable).
            if f'"label": "{label}"' in jsonl.read_text():
                continue
            enc = ["sk32", MODEL, "--rank", r, *extra]
            out = work / file
            if not out.exists():
                rknot(args, "encode", *enc, "-o", out, "--no-progress", quiet=True)
            # The encoded file alone: whole file x 8 / the parameters it holds.
            t = json.loads(rknot(args, "inspect", out, "--json"))["totals"]
            figures = probe_row(args, out, ["--dense", MODEL], cosine=False)
            row = {"label": label, "command": "rknot encode " + " ".join(enc) + " -o OUT",
                   "bits_per_weight": t["bits_per_weight"], **figures}
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{label} done", file=sys.stderr)
    rows = [json.loads(line) for line in open(jsonl)]

    def order(r):
        kind = "Gram" if "Gram" in r["label"] else "diagonal" if "diagonal" in r["label"] else "SK32"
        return int(r["label"].split()[2].rstrip(",")), ["SK32", "diagonal", "Gram"].index(kind)

    rows.sort(key=order)
    for r in rows:
        r["command"] = r["command"].replace(stats, "STATS")
    json.dump(rows, open(ROOT / "tests/data/quality/sk32_activations.json", "w"), indent=1)
    for r in rows:
        print(f'| {r["label"]} | {r["bits_per_weight"]:.3f} | {r["perplexity"]:.4g} ± {r["perplexity_pm"]:.3g} '
              f'| {r["top1_agreement"]:.4f} | {r["kl"]:.4f} | {r["paris_top1"]} {r["paris_prob"]} |')


# ---------------------------------------------------------------------------
# plot: perplexity against bits per weight

PLOT_DOC = '''Perplexity (GPL-3 text, ctx 256) against whole-file bits per weight, every
row of tests/data/quality/calibrated.json (tools/eval.py rows) a labelled
point; the dense model's and llama.cpp's Q4_K_M perplexities as horizontal
reference lines. Writes docs/quality-ppl-bpw.png.

    tools/eval.py plot [--data JSON] [--out PNG]

Needs matplotlib MATPLOTLIB (pinned below); when this python3 lacks that
version, the script reruns itself in rknot's Python environment
(tools/python-env.sh), installing it there.

Groups (colour and marker) come from a row's "group" when it has one, else
from the file: the dense reference, llama.cpp GGUFs without and with an
importance matrix (llama_peers.sh names those *.imatrix.gguf), rknot files.'''


def ensure_matplotlib():
    try:
        import matplotlib

        if matplotlib.__version__ == MATPLOTLIB:
            return
    except ImportError:
        pass
    if os.environ.get("RKNOT_EVAL_PLOT_REEXEC"):
        sys.exit(f"eval plot: matplotlib {MATPLOTLIB} is still missing in {sys.executable}")
    script = (f'. tools/python-env.sh && rknot_python_env matplotlib=={MATPLOTLIB} numpy=={NUMPY} '
              f'&& exec python3 "$@"')
    env = dict(os.environ, RKNOT_EVAL_PLOT_REEXEC="1")
    sys.exit(subprocess.call(["bash", "-c", script, "bash", str(Path(__file__).resolve()), *sys.argv[1:]],
                             cwd=ROOT, env=env))


# group -> (colour, marker, legend text), in legend order.
GROUPS = {
    "dense": ("black", "*", "dense (the Q4_1 GGUF)"),
    "llama.cpp": ("#888888", "o", "llama.cpp llama-quantize"),
    "llama.cpp+imatrix": ("#1f77b4", "s", "llama.cpp llama-quantize --imatrix"),
    "rknot": ("#d62728", "D", "rknot"),
    "rknot calibrated": ("#2ca02c", "^", "rknot, calibrated"),
}


def group_of(row):
    if row.get("group"):
        return row["group"]
    if row["file"] == REFERENCE_FILE and not row.get("dense"):
        return "dense"
    if row["format"] == "gguf":
        return "llama.cpp+imatrix" if ".imatrix." in row["file"] else "llama.cpp"
    return "rknot calibrated" if "calib" in row["label"].lower() else "rknot"


def place_labels(fig, ax, points, texts):
    """Put each label at the one of 24 offsets around its point that
    overlaps least (in display space) with the labels already placed, the
    points and the axes' edge: readable without a layout package."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axbox = ax.get_window_extent(renderer)
    pts = [ax.transData.transform(p) for p in points]
    near = [(6, 4), (6, -10), (-6, 4), (-6, -10), (0, 9), (0, -14), (10, -3), (-10, -3)]
    # Farther out, with a leader line (drawn for every label, hidden by the
    # marker when the label is near), when the near places are taken.
    offsets = near + [(3 * dx, 3 * dy) for dx, dy in near] + [(5 * dx, 5 * dy) for dx, dy in near]
    placed = []

    def overlap(a, b):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        return w * h if w > 0 and h > 0 else 0.0

    # Labels of points crowded to the left first, so they pick before their
    # neighbours take the space.
    for i in sorted(range(len(texts)), key=lambda i: pts[i][0]):
        t = texts[i]
        best = None
        for dx, dy in offsets:
            t.set_position((dx, dy))
            t.set_horizontalalignment("left" if dx > 0 else "right" if dx < 0 else "center")
            bb = t.get_window_extent(renderer).expanded(1.05, 1.15)
            cost = sum(overlap(bb, p) for p in placed) + 0.5 * (abs(dx) + abs(dy))
            cost += sum(1e3 for (px, py) in pts if bb.x0 < px < bb.x1 and bb.y0 < py < bb.y1)
            outside = (max(0, axbox.x0 - bb.x0) + max(0, bb.x1 - axbox.x1)
                       + max(0, axbox.y0 - bb.y0) + max(0, bb.y1 - axbox.y1))
            cost += outside * 1e3
            if best is None or cost < best[0]:
                best = (cost, dx, dy, bb)
        _, dx, dy, bb = best
        t.set_position((dx, dy))
        t.set_horizontalalignment("left" if dx > 0 else "right" if dx < 0 else "center")
        placed.append(bb)


def cmd_plot(args):
    ensure_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    rows = json.loads((ROOT / args.data).read_text())
    if not rows:
        sys.exit(f"eval plot: {args.data} has no rows")
    xs = [r["bits_per_weight"] for r in rows]
    ys = [r["texts"]["gpl-3.0"]["perplexity"] for r in rows]

    fig, ax = plt.subplots(figsize=(9, 6), dpi=100)
    # A log axis when the perplexities span more than a factor of two, so
    # that the good encodings near the dense line stay apart.
    log_y = max(ys) / min(ys) > 2
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())

    def ref_line(pred, style, text):
        hits = [r for r in rows if pred(r)]
        if hits:
            y = hits[0]["texts"]["gpl-3.0"]["perplexity"]
            ax.axhline(y, color="#555555", linestyle=style, linewidth=0.8, zorder=1, label=f"{text}: {y:.2f}")

    ref_line(lambda r: group_of(r) == "dense", "-", "dense")
    ref_line(lambda r: r["file"] == "smollm2.Q4_K_M.gguf", "--", "llama.cpp Q4_K_M")
    ref_line(lambda r: r["file"] == "smollm2.Q4_K_M.imatrix.gguf", ":", "llama.cpp Q4_K_M + imatrix")

    # Rows at the same point (llama.cpp's Q8_0 ignores the imatrix: the same
    # tensors) share one marker and one label.
    points = {}
    for r, x, y in zip(rows, xs, ys):
        key = (round(x, 3), round(y, 3))
        points.setdefault(key, []).append(r)

    seen = set()
    texts, where = [], []
    for (x, y), same in points.items():
        g = group_of(same[0])
        colour, marker, legend = GROUPS.get(g, ("#9467bd", "v", g))
        ax.scatter([x], [y], c=colour, marker=marker, s=42 if marker != "*" else 110, zorder=3,
                   label=None if g in seen else legend, edgecolors="white", linewidths=0.5)
        seen.add(g)
        # The legend says which tool made a point; its label says how.
        names = [r["label"].removeprefix("llama.cpp ") if group_of(r).startswith("llama.cpp") else r["label"]
                 for r in same]
        texts.append(ax.annotate(" = ".join(names), (x, y), xytext=(6, 4), textcoords="offset points",
                                 fontsize=7, zorder=4, color=colour if g != "llama.cpp" else "#444444",
                                 arrowprops=dict(arrowstyle="-", color="#999999", linewidth=0.5,
                                                 shrinkA=0, shrinkB=3)))
        where.append((x, y))

    ax.set_xlabel("bits per weight (whole file × 8 / parameters served)")
    ax.set_ylabel("perplexity, GPL-3 text, ctx 256" + (" (log scale)" if log_y else ""))
    ax.set_title("SmolLM2-135M-Instruct: perplexity against size (rknot probe, fp32 forward pass)", fontsize=10)
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    span = max(xs) - min(xs) or 1.0
    ax.set_xlim(min(xs) - 0.08 * span, max(xs) + 0.12 * span)
    ylo, yhi = min(ys), max(ys)
    if log_y:
        ax.set_ylim(ylo / 1.05, yhi * 1.08)
    else:
        pad = (yhi - ylo) * 0.08 or 0.5
        ax.set_ylim(ylo - pad, yhi + pad)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    fig.tight_layout()
    place_labels(fig, ax, where, texts)

    out = ROOT / args.out
    tmp = out.with_name(out.name + ".tmp.png")
    # A small palette keeps the PNG small.
    fig.savefig(tmp, dpi=100, pil_kwargs={"optimize": True})
    try:
        from PIL import Image

        Image.open(tmp).convert("RGB").quantize(colors=64).save(tmp, optimize=True)
    except ImportError:
        pass
    os.replace(tmp, out)
    print(f"{args.out}: {len(rows)} points, {out.stat().st_size} bytes")


# ---------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("rows", help="evaluate LABEL=FILE rows into calibrated.json", description=ROWS_DOC,
                       formatter_class=raw)
    p.add_argument("rows", nargs="+", metavar="LABEL=FILE[+DENSE]")
    p.add_argument("--bin", default="target/ci", help="directory of the rknot binary (default target/ci)")
    p.add_argument("--out", default="tests/data/quality/calibrated.json")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="keep each probe's output in DIR and reuse it (see probe())")
    p.add_argument("--threads", type=int, default=None, help="rknot probe --threads (default: all CPUs)")
    p.add_argument("--llama-bin", default=None,
                   help="llama.cpp tools, for F32 twins (default: tools/llama-cpp.sh --print-bin-dir)")
    p.add_argument("--twin-dir", default=os.environ.get("RKNOT_PEERS_DIR", "/var/tmp/rknot-peers"),
                   help="where F32 twins are kept (default $RKNOT_PEERS_DIR or /var/tmp/rknot-peers)")
    p.set_defaults(run=cmd_rows)

    p = sub.add_parser("fidelity", formatter_class=raw, help="the inference-fidelity table, through a mount",
                       description="""Inference fidelity of SmolLM2 encodings read through a real mount (the
encoded file over the GGUF as dense fallback): bits per weight of the encoded
file (whole file x 8 / parameters it serves), perplexity over the GPL-3.0 text
(ctx 256, 29 windows), top-1 agreement / KL / logits cosine against the GGUF,
and the Paris probe. Writes tests/data/quality/fidelity.json and prints
markdown rows for docs/QUALITY.md. Needs root (mounts). Minutes on 2 cores.""")
    p.add_argument("--bin", default="target/release", help="directory of rknot and rknot-mount")
    p.set_defaults(run=cmd_fidelity)

    p = sub.add_parser("quality", formatter_class=raw, help="every encoding's weight error (encodings.json)",
                       description="""Encode SmolLM2 every way docs/QUALITY.md reports, verify each against
the GGUF, and write tests/data/quality/encodings.json (one `rknot verify
--json` summary per encoding, with its command and encode time). Minutes on
2 cores.""")
    p.add_argument("--bin", default="target/release", help="directory of rknot")
    p.set_defaults(run=cmd_quality)

    p = sub.add_parser("calibrated", formatter_class=raw, help="the calibrated-encoding rows, then the plot",
                       description="""The .rknot rows of docs/QUALITY.md "Calibrated encoding": SmolLM2
encoded with the calibrated profile at several whole-file targets and with
each technique switched off, the faithful profile (weight and activation
manifests), each evaluated as `rows` does into
tests/data/quality/calibrated.json; then the plot. The llama.cpp rows come
from tools/llama_peers.sh (see `rows --help`).

RKNOT_CALIBRATED_DIR: encoded files, STATS and probe outputs (default
/var/tmp/rknot-calibrated; reused when present: delete it after changing the
encoder). Hours on 2 cores: each encode takes 2-6 minutes, each row's
evaluation about 3.5 (two texts against the reference, and the Paris prompt).""")
    p.add_argument("--bin", default="target/release", help="directory of rknot")
    p.set_defaults(run=cmd_calibrated)

    p = sub.add_parser("sk32", formatter_class=raw, help="SK32 with and without activation weighting",
                       description="""SK32 with and without activation weighting (issue 12) on SmolLM2: for
each rank, the plain sketch, the diagonally whitened one and the
Gram-whitened one; whole-file bits per weight (`rknot inspect --json`),
perplexity on the GPL-3.0 text (ctx 256, 29 windows) with top-1 agreement
and KL against the GGUF, and the Paris probe. Writes
tests/data/quality/sk32_activations.json. Needs a STATS file with Gram
matrices (about 100 s to make):
  rknot calibrate MODEL --text data/calibration/python-idle-help.txt -o STATS --gram
Rows already in WORK/rows.jsonl are kept (resumable); each rank costs minutes
on 2 cores (rank 384: about 10).""")
    p.add_argument("stats", metavar="STATS")
    p.add_argument("--bin", default="target/release", help="directory of rknot")
    p.add_argument("--work", default=None, help="work directory (default: a new one in /tmp)")
    p.add_argument("--ranks", default=os.environ.get("RANKS", "64 128 256 384"),
                   help="the ranks, space-separated (default $RANKS or 64 128 256 384)")
    p.add_argument("--variants", default=os.environ.get("VARIANTS", "plain diagonal gram"),
                   help="the variants (default $VARIANTS or plain diagonal gram)")
    p.set_defaults(run=cmd_sk32)

    p = sub.add_parser("plot", formatter_class=raw, help="perplexity against bits per weight (PNG)",
                       description=PLOT_DOC)
    p.add_argument("--data", default="tests/data/quality/calibrated.json")
    p.add_argument("--out", default="docs/quality-ppl-bpw.png")
    p.set_defaults(run=cmd_plot)

    args = ap.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
