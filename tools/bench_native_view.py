#!/usr/bin/env python3
"""llama.cpp on the native view vs the source file (docs/PERFORMANCE.md,
"llama.cpp on model.native.gguf").

Mounts MODEL (a GGUF, or a .rknot) once and runs `llama-completion`
greedily on, in interleaved rounds (order rotated per round):

  source  a local GGUF of the view's ggml types: MODEL itself for a GGUF;
          for a .rknot, a local copy of its model.native.gguf (made once,
          before round 1) (a local file, in the page cache after round 1)
  native  MOUNT/model.native.gguf (its stored blocks through the mount; a
          .rknot's re-packed or decoded)
  f32     MOUNT/model.gguf (every tensor F32), for contrast

"x stored" is peak RSS over MODEL's own size (the .rknot's, not its
view's).

and reports per case the median peak RSS of the llama-completion process
(ru_maxrss from wait4: mapped file pages it touched included), the prompt
and generation tokens/s llama.cpp prints, and per round the ratios to the
source, as medians of the per-round ratios. Between rounds the daemon's
cache is not dropped: every case after round 1 runs warm, as an inference
host rerunning a model does; round 1 (cold) is shown apart.

  tools/bench_native_view.py MODEL [--rounds 5] [--llama-bin DIR]
      [--mount-bin target/ci/rknot-mount] [--tokens 64] [--threads 2]

Needs root, fuse3 and llama.cpp's tools (RKNOT_LLAMA_BIN or --llama-bin).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompt_text():
    # The first ~1000 characters of the GPL-3 text: about 250 tokens.
    with open(os.path.join(ROOT, "tests/data/probe/gpl-3.0.txt")) as f:
        return f.read(1000)


def run_completion(binary, model, prompt, tokens, threads):
    """One llama-completion run: (peak RSS MiB, prompt tok/s, gen tok/s,
    wall s)."""
    args = [binary, "-m", model, "-p", prompt, "-n", str(tokens), "--temp", "0",
            "--seed", "42", "-no-cnv", "-c", "1024", "-t", str(threads),
            "--ignore-eos"]
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # wait4 gives this child's own rusage; communicate() drains stderr first.
    err = p.stderr.read().decode(errors="replace")
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"llama-completion on {model} failed ({p.returncode}):\n{err[-3000:]}")
    def rate(label):
        m = re.search(label + r"\s*=.*?([0-9.]+) tokens per second", err)
        if not m:
            sys.exit(f"no '{label}' line from llama-completion:\n{err[-3000:]}")
        return float(m.group(1))
    # "llama_perf_context_print: prompt eval time = ..." and "...:        eval time = ...".
    return ru.ru_maxrss / 1024.0, rate("prompt eval time"), rate(r":\s+eval time"), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-bin", default=os.environ.get("RKNOT_LLAMA_BIN"))
    ap.add_argument("--mount-bin", default=os.path.join(ROOT, "target/ci/rknot-mount"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not a.llama_bin:
        sys.exit("set RKNOT_LLAMA_BIN or --llama-bin")
    completion = os.path.join(a.llama_bin, "llama-completion")
    model = os.path.abspath(a.model)
    stored = os.path.getsize(model)
    prompt = prompt_text()
    mp = tempfile.mkdtemp(prefix="rknot-native-bench-")
    out = subprocess.run([a.mount_bin, model, mp, "--log-file", mp + ".log"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"rknot-mount failed: {out.stderr}")
    pid = int(re.search(r"\(pid (\d+);", out.stdout).group(1))
    native = os.path.join(mp, "model.native.gguf")
    local = model
    with open(model, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    if not is_gguf:
        # The same ggml types as a local file: the view, copied once.
        fd, local = tempfile.mkstemp(prefix="rknot-native-local-", suffix=".gguf",
                                     dir=os.path.dirname(model))
        os.close(fd)
        t0 = time.monotonic()
        subprocess.run(["cp", native, local], check=True)
        print(f"local copy of the view: {os.path.getsize(local) / 2**20:.1f} MiB "
              f"({time.monotonic() - t0:.2f} s, a cold mount)", flush=True)
    cases = {"source": local,
             "native": native,
             "f32": os.path.join(mp, "model.gguf")}
    names = list(cases)
    rows = {n: [] for n in names}
    try:
        for r in range(a.rounds):
            order = names[r % 3:] + names[:r % 3]
            for n in order:
                rows[n].append(run_completion(completion, cases[n], prompt, a.tokens, a.threads))
            print(f"round {r + 1}: " + ", ".join(
                f"{n} {rows[n][-1][0]:.0f} MiB pp {rows[n][-1][1]:.1f} tg {rows[n][-1][2]:.1f}"
                for n in names), flush=True)
    finally:
        subprocess.run(["fusermount3", "-u", mp])
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)
        os.rmdir(mp)
        if local != model:
            os.unlink(local)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"\n{model}: {stored / 2**20:.1f} MiB stored; {a.rounds} rounds, "
          f"-n {a.tokens} -t {a.threads}; load average at the end {load}")
    print(f"{'case':8} {'peak RSS MiB':>12} {'x stored':>9} {'pp tok/s':>9} {'tg tok/s':>9}"
          f" {'RSS x src':>9} {'pp x src':>9} {'tg x src':>9}")
    warm = range(1, a.rounds) if a.rounds > 1 else range(a.rounds)
    for n in names:
        med = lambda k: statistics.median(rows[n][i][k] for i in warm)
        ratio = lambda k: statistics.median(rows[n][i][k] / rows["source"][i][k] for i in warm)
        print(f"{n:8} {med(0):12.0f} {med(0) * 2**20 / stored:9.2f} {med(1):9.1f} {med(2):9.1f}"
              f" {ratio(0):9.2f} {ratio(1):9.2f} {ratio(2):9.2f}")
    print("round 1 (cold mount): " + ", ".join(
        f"{n} {rows[n][0][0]:.0f} MiB tg {rows[n][0][2]:.1f} ({rows[n][0][3]:.2f} s)" for n in names))
    tg = statistics.median(rows["native"][i][2] / rows["source"][i][2] for i in warm)
    rss = statistics.median(rows["native"][i][0] for i in warm) * 2**20 / stored
    print(f"targets: native peak RSS <= 1.25x stored: {rss:.2f}x "
          f"{'met' if rss <= 1.25 else 'MISSED'}; native tg >= 0.95x source: {tg:.2f}x "
          f"{'met' if tg >= 0.95 else 'MISSED'}")


if __name__ == "__main__":
    main()
