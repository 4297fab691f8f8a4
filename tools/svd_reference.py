#!/usr/bin/env python3
"""Singular values of two SmolLM2 matrices by numpy.linalg.svd (LAPACK), the
independent reference for the crate's exact SVD (tests/encode.rs).
Writes tests/data/quality/svd_reference.json.
Run: python3 tools/svd_reference.py [MODEL.gguf]   (numpy, gguf==0.19.0)
"""
import json, os, sys
import numpy as np
import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
r = gguf.GGUFReader(model)
out = {"generator": "tools/svd_reference.py", "numpy": np.__version__, "tensors": {}}
for name in ("blk.0.attn_q.weight", "blk.5.ffn_down.weight"):
    t = next(t for t in r.tensors if t.name == name)
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    s = np.linalg.svd(w, compute_uv=False)
    out["tensors"][name] = {"shape": list(w.shape), "frobenius2": float((w * w).sum()), "singular_values": [float(x) for x in s]}
path = os.path.join(ROOT, "tests", "data", "quality", "svd_reference.json")
json.dump(out, open(path, "w"), indent=1)
print("wrote", path)
