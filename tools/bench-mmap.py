#!/usr/bin/env python3
"""What engines that mmap pay for each view (docs/PERFORMANCE.md, "Engines
that mmap"; issue 25, item 3).

safetensors' `safe_open` and numpy's memmap (transformers' default load)
and llama.cpp's mmap of a GGUF touch a file through page faults, 4 KiB at a
time, in the order they use the tensors; the kernel turns the faults into
read-around requests of up to the mount's read-ahead. For each VIEW of a
mount of SOURCE this script measures, in one run:

  local    the view's bytes copied to a local file (page cache dropped for
           it with posix_fadvise DONTNEED before each pass): the baseline
  plain    a fresh mount (cold: nothing decoded, empty page cache)
  decoded  a fresh mount with --decoded-cache (a new empty store: the first
           open decodes the whole file, then FUSE passthrough)
  stored   a second fresh mount on the same store (the entry exists:
           passthrough from the open on)

and for each, per access pattern (`pages`: np.memmap, one byte read per
4 KiB page in file order, which is how an mmap engine faults in every
weight; `safe_open`: safetensors' safe_open(framework="numpy") and
get_tensor of every tensor, safetensors views only), the wall time, GB/s,
the ratio to local, the daemon's CPU seconds (utime + stime of the mount
process, from /proc) per GB, and the FUSE reads the daemon answered with
their mean size (ctl.json's reads.total and reads.bytes_served). It prints
the mount's read_ahead_kb (/sys/class/bdi) and the FUSE max_readahead.

  tools/bench-mmap.py SOURCE [--views hf/model.safetensors,model.gguf]
      [--mount-bin target/ci/rknot-mount] [--rounds 3] [--work DIR]
      [--hf-python PY]   # also: transformers' from_pretrained(hf/) peak RSS

With --hf-python (a python with torch + transformers), it also loads
MOUNT/hf with from_pretrained(dtype="auto") in a fresh process and
reports its peak RSS (ru_maxrss) against the size of hf/model.safetensors
and against the same load of the local copy (`rss`).

Needs root (passthrough and read_ahead_kb), fuse3, numpy, safetensors.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 4096


class Mount:
    """`rknot-mount --foreground SOURCE MP [args]`, stopped on exit."""

    def __init__(self, binary, source, args=()):
        self.mp = tempfile.mkdtemp(prefix="rknot-bench-mmap-")
        self.log = open(os.path.join(tempfile.gettempdir(), os.path.basename(self.mp) + ".log"), "w+")
        self.p = subprocess.Popen([binary, "--foreground", source, self.mp, *args],
                                  stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        # Ready when it says so: after its read-ahead is set (an open
        # before that keeps the kernel's 128 KiB default for the file).
        while True:
            self.log.seek(0)
            text = self.log.read()
            if "serving " in text:
                break
            if self.p.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"rknot-mount failed:\n{text[-3000:]}")
            time.sleep(0.05)

    def path(self, name):
        return os.path.join(self.mp, name)

    def cpu_s(self):
        with open(f"/proc/{self.p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def reads(self):
        with open(self.path("ctl.json")) as f:
            r = json.load(f)["reads"]
        return r["total"], r["bytes_served"]

    def readahead_kb(self):
        st = os.stat(self.mp)
        try:
            with open(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb") as f:
                return int(f.read())
        except OSError:
            return None

    def close(self):
        subprocess.run(["fusermount3", "-u", self.mp], stderr=subprocess.DEVNULL)
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()
        os.rmdir(self.mp)


def touch_pages(path):
    import numpy as np
    a = np.memmap(path, dtype=np.uint8, mode="r")
    s = int(a[::PAGE].sum(dtype=np.uint64))
    del a
    return s


def safe_open_all(path):
    from safetensors import safe_open
    n = 0
    with safe_open(path, framework="numpy") as f:
        for k in f.keys():
            n += f.get_tensor(k).nbytes
    return n


def numpy_reads(path):
    """Whether safe_open(framework="numpy") reads the file (numpy has no
    bfloat16: a BF16 file is measured by its pages only)."""
    try:
        from safetensors import safe_open
        with safe_open(path, framework="numpy") as f:
            k = next(iter(f.keys()))
            f.get_slice(k)[:1]
        return True
    except (TypeError, ValueError) as e:
        print(f"{os.path.basename(path)}: safe_open(numpy) cannot read it ({e}): pages only")
        return False


PATTERNS = {"pages": touch_pages, "safe_open": safe_open_all}


def drop_local(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        # Dirty pages (a fresh copy) are not dropped: write them first.
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, path):
    t0 = time.monotonic()
    fn(path)
    return time.monotonic() - t0


def hf_rss(py, hf_dir):
    """Peak RSS (MiB, the child's own ru_maxrss) of a fresh python loading
    hf_dir with transformers in dtype "auto", and of the same python only
    importing torch + transformers (the baseline); the load's dtype."""
    tail = "import resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    load = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype='auto')\n"
            "print(next(m.parameters()).dtype)\n" + tail)
    base = "import torch\nfrom transformers import AutoModelForCausalLM\nprint('-')\n" + tail

    def run(script, *args):
        o = subprocess.run([py, "-c", script, *args], capture_output=True, text=True)
        if o.returncode != 0:
            sys.exit(f"transformers load failed:\n{o.stderr[-3000:]}")
        dtype, kib = o.stdout.split()[-2:]
        return int(kib) / 1024, dtype

    (rss, dtype), (imports, _) = run(load, hf_dir), run(base)
    return rss, imports, dtype


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("--views", default="hf/model.safetensors,model.safetensors,model.gguf")
    ap.add_argument("--mount-bin", default=os.path.join(ROOT, "target/ci/rknot-mount"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=None, help="directory for local copies and stores")
    ap.add_argument("--hf-python", default=None)
    ap.add_argument("--mount-args", default="", help="extra rknot-mount arguments, space-separated")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="rknot-bench-mmap-work-")
    os.makedirs(work, exist_ok=True)
    extra = a.mount_args.split()
    views = [v for v in a.views.split(",") if v]

    m = Mount(a.mount_bin, a.source, extra)
    print(f"mount read_ahead_kb {m.readahead_kb()} (FUSE max_readahead 1024 KiB)")
    with open(m.path("index.json")) as f:
        index = json.load(f)
    print(f"main dtype {index['views'].get('main_dtype')}: {index['views'].get('main_dtype_reason')}")
    local = {}
    for v in views:
        dst = os.path.join(work, v.replace("/", "_"))
        shutil.copyfile(m.path(v), dst)
        local[v] = dst
    m.close()

    rows = []
    for v in views:
        size = os.path.getsize(local[v])
        gb = size / 1e9
        pats = ["pages"] + (["safe_open"] if v.endswith(".safetensors") and numpy_reads(local[v]) else [])
        for pat in pats:
            fn = PATTERNS[pat]
            res = {k: [] for k in ("local", "plain", "decoded", "stored")}
            cpu = {k: [] for k in res}
            req = {k: [] for k in res}
            for r in range(a.rounds):
                drop_local(local[v])
                res["local"].append(timed(fn, local[v]))
                store = os.path.join(work, f"store-{r}-{pat}-{v.replace('/', '_')}")
                shutil.rmtree(store, ignore_errors=True)
                for case, args in (("plain", []), ("decoded", ["--decoded-cache", store]),
                                   ("stored", ["--decoded-cache", store])):
                    mm = Mount(a.mount_bin, a.source, extra + args)
                    c0, (n0, b0) = mm.cpu_s(), mm.reads()
                    res[case].append(timed(fn, mm.path(v)))
                    c1, (n1, b1) = mm.cpu_s(), mm.reads()
                    cpu[case].append((c1 - c0) / gb)
                    req[case].append((n1 - n0, (b1 - b0) / max(1, n1 - n0)))
                    mm.close()
                shutil.rmtree(store, ignore_errors=True)
            for case in res:
                t = statistics.median(res[case])
                ratios = [x / y for x, y in zip(res[case], res["local"])]
                n, mean = req[case][len(req[case]) // 2] if req[case] else (0, 0)
                rows.append((v, pat, case, t, gb / t, statistics.median(ratios),
                             statistics.median(cpu[case]) if cpu[case] else 0.0, n, mean))
    print(f"\n{'view':24} {'pattern':9} {'case':8} {'s':>7} {'GB/s':>6} {'x local':>8} "
          f"{'cpu s/GB':>8} {'reads':>7} {'mean KiB':>8}")
    for v, pat, case, t, rate, ratio, cpu, n, mean in rows:
        print(f"{v:24} {pat:9} {case:8} {t:7.3f} {rate:6.2f} {ratio:8.2f} {cpu:8.2f} {n:7d} {mean / 1024:8.0f}")

    if a.hf_python:
        m = Mount(a.mount_bin, a.source, extra)
        st = os.path.getsize(m.path("hf/model.safetensors"))
        rss, base, dtype = hf_rss(a.hf_python, m.path("hf"))
        m.close()
        print(f"\ntransformers from_pretrained(MOUNT/hf, dtype='auto'): {dtype}, peak RSS {rss:.0f} MiB; "
              f"torch + transformers imported alone {base:.0f} MiB; hf/model.safetensors "
              f"{st / 2**20:.0f} MiB: RSS / size {rss * 2**20 / st:.2f}, "
              f"(RSS - imports) / size {(rss - base) * 2**20 / st:.2f}")


if __name__ == "__main__":
    main()
