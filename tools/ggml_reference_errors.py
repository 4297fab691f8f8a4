#!/usr/bin/env python3
"""Reference quantization errors of ggml's own quantizers on SmolLM2.

For every block matrix of the SmolLM2 GGUF (the 210 attention and FFN
matrices), the dequantized weights (gguf-py) are quantized with ggml's
reference quantizers (quantize_row_q4_K_ref, _q6_K_ref, _q8_0_ref, _q4_0_ref,
compiled from the ggml sources vendored in the llama-cpp-python sdist, no
other code) and dequantized back with ggml's dequantize_row_*. The relative
Frobenius errors per tensor, per tensor kind and overall go to
tests/data/quality/ggml_reference_errors.json; docs/QUALITY.md compares the
encoders against them.

Run:  python3 tools/ggml_reference_errors.py [MODEL.gguf [OUT.json]]
Needs: gcc, numpy, gguf (pip install gguf==0.19.0 numpy), network access to
PyPI once (the sdist of llama-cpp-python==0.3.36 is cached in
~/.cache/rknot/).
"""
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

import numpy as np
import gguf

LLAMA_CPP_PYTHON = "0.3.36"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.expanduser("~/.cache/rknot")

# ggml type ids and (elements, bytes) per block
TYPES = {"q4_k": (12, 256, 144), "q6_k": (14, 256, 210), "q8_0": (8, 32, 34), "q4_0": (2, 32, 18)}


def ggml_sources():
    os.makedirs(CACHE, exist_ok=True)
    sdist = os.path.join(CACHE, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
    if not os.path.exists(sdist):
        # The simple index (PEP 503) names the sdist with its sha256.
        page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
        name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        href = next(h for h in page.split('href="')[1:] if name + "#" in h.split('"')[0]).split('"')[0]
        url, digest = href.split("#sha256=")
        data = urllib.request.urlopen(url).read()
        if hashlib.sha256(data).hexdigest() != digest:
            sys.exit(f"{name}: sha256 mismatch")
        with open(sdist + ".part", "wb") as f:
            f.write(data)
        os.replace(sdist + ".part", sdist)
    out = os.path.join(CACHE, f"ggml-{LLAMA_CPP_PYTHON}")
    if not os.path.exists(os.path.join(out, "src", "ggml-quants.c")):
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/ggml/"
        with tarfile.open(sdist) as t:
            for m in t.getmembers():
                if m.name.startswith(prefix) and ("/src/ggml-" in m.name or "/include/" in m.name) and m.isfile():
                    m.name = m.name[len(prefix):]
                    t.extract(m, out)
    return out


STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
/* ggml-quants.c references these on paths the reference quantizers never take. */
void ggml_abort(const char *f, int l, const char *fmt, ...) { fprintf(stderr, "ggml_abort %s:%d\n", f, l); abort(); }
size_t ggml_row_size(int t, int64_t n) { (void)t; (void)n; abort(); }
size_t ggml_type_size(int t) { (void)t; abort(); }
const char *ggml_type_name(int t) { (void)t; abort(); }
"""


def build_lib(src):
    lib = os.path.join(CACHE, f"libggml-quants-{LLAMA_CPP_PYTHON}.so")
    if not os.path.exists(lib):
        with tempfile.TemporaryDirectory() as d:
            stubs = os.path.join(d, "stubs.c")
            open(stubs, "w").write(STUBS)
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", f"-I{src}/include", f"-I{src}/src",
                            f"{src}/src/ggml-quants.c", stubs, "-lm", "-o", lib], check=True)
    return ctypes.CDLL(lib)


def roundtrip(lib, name, x):
    _, be, bb = TYPES[name]
    n = x.size
    assert n % be == 0
    q = np.zeros(n // be * bb, dtype=np.uint8)
    y = np.zeros(n, dtype=np.float32)
    xf = np.ascontiguousarray(x, dtype=np.float32)
    getattr(lib, f"quantize_row_{name.replace('_k', '_K')}_ref")(
        xf.ctypes.data_as(ctypes.c_void_p), q.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
    getattr(lib, f"dequantize_row_{name.replace('_k', '_K')}")(
        q.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
    return y


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    lib = build_lib(ggml_sources())
    r = gguf.GGUFReader(model)
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    per_tensor = {}
    sums = {t: {} for t in TYPES}
    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in kinds:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        ref2 = float(np.dot(w.astype(np.float64), w.astype(np.float64)))
        entry = {}
        for name in TYPES:
            y = roundtrip(lib, name, w)
            err2 = float(np.sum((y.astype(np.float64) - w) ** 2))
            entry[name] = (err2 / ref2) ** 0.5
            s = sums[name].setdefault(parts[2], [0.0, 0.0])
            s[0] += err2
            s[1] += ref2
        per_tensor[t.name] = entry
    bpw = {name: bb * 8 / be for name, (_, be, bb) in TYPES.items()}
    out = {
        "generator": "tools/ggml_reference_errors.py",
        "quantizers": f"ggml reference quantizers from llama-cpp-python=={LLAMA_CPP_PYTHON} (vendored llama.cpp)",
        "model_sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(),
        "metric": "relative Frobenius error ||Q(W) - W|| / ||W|| of the dequantized weights W",
        "bits_per_weight": bpw,
        "by_kind": {name: {k: (v[0] / v[1]) ** 0.5 for k, v in sums[name].items()} for name in TYPES},
        "overall": {name: (sum(v[0] for v in sums[name].values()) / sum(v[1] for v in sums[name].values())) ** 0.5
                    for name in TYPES},
        "tensors": per_tensor,
    }
    path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "tests", "data", "quality", "ggml_reference_errors.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps({"overall": out["overall"], "by_kind": out["by_kind"]}, indent=1))


if __name__ == "__main__":
    main()
