"""Tiny random Hugging Face checkpoints and dtype files for tests/safetensors.rs.

Usage: make_checkpoints.py OUT_DIR. Writes, in OUT_DIR:
- one directory per checkpoint, saved by transformers' save_pretrained from
  a model of transformers' own classes (LlamaForCausalLM, Qwen2ForCausalLM),
  f32 or bf16, single file or sharded (max_shard_size);
- dtypes/model.safetensors, written by safetensors.torch.save_file: F16, F64,
  BF16, F8_E4M3 and F8_E5M2 (all 256 bytes of each), I32, BOOL, U8;
- reference.json: for each checkpoint, every tensor's served names (the
  Hugging Face name; for a known family also the GGUF name) and the file of
  its expected f32 bytes (torch's .to(torch.float32); the GGUF spelling's
  Q/K rows permuted as convert_hf_to_gguf.py's LlamaModel.permute does).
"""

import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

out = sys.argv[1]
torch.manual_seed(23)


def permute(w, n_head, n_head_kv):
    # convert_hf_to_gguf.py, LlamaModel.permute, verbatim in effect.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf):
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    layer, what, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{GGUF[what]}.{kind}"


reference = {}


def dump(name, tensors, family=None, heads=None):
    """Expected bytes of every tensor: torch's f32 values."""
    ref_dir = os.path.join(out, "ref", name)
    os.makedirs(ref_dir, exist_ok=True)
    entries = []
    for i, (hf, t) in enumerate(sorted(tensors.items())):
        if not (t.is_floating_point()):
            entries.append({"hf": hf, "served": None})
            continue
        f = t.to(torch.float32).contiguous()
        hf_file = os.path.join(ref_dir, f"{i}.hf.bin")
        f.numpy().tofile(hf_file)
        e = {"hf": hf, "hf_file": hf_file, "shape": list(f.shape)}
        if family is not None:
            g = gguf_name(hf)
            gw = f
            if family == "llama" and (".q_proj." in hf or ".k_proj." in hf):
                n_head, n_kv = heads
                gw = permute(f, n_head, n_head if ".q_proj." in hf else n_kv)
            g_file = os.path.join(ref_dir, f"{i}.gguf.bin")
            gw.contiguous().numpy().tofile(g_file)
            e["gguf"] = g
            e["gguf_file"] = g_file
        entries.append(e)
    reference[name] = {"dir": os.path.join(out, name), "family": family, "tensors": entries}


def loaded(path_dir):
    """Every tensor of a saved checkpoint, as the safetensors package reads it."""
    tensors = {}
    for f in sorted(os.listdir(path_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path_dir, f), framework="pt") as st:
                for k in st.keys():
                    assert k not in tensors
                    tensors[k] = st.get_tensor(k)
    return tensors


def checkpoint(name, config, dtype, shard):
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            # Random values everywhere (norms too), so a wrong row or
            # element cannot match by accident.
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype))
    d = os.path.join(out, name)
    model.save_pretrained(d, max_shard_size=shard, safe_serialization=True)
    family = config.model_type
    dump(name, loaded(d), family, (config.num_attention_heads, config.num_key_value_heads))


small = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
checkpoint("llama_f32", LlamaConfig(**small), torch.float32, "10GB")
checkpoint("llama_bf16_sharded", LlamaConfig(**small), torch.bfloat16, "40KB")
checkpoint("qwen2_bf16", Qwen2Config(**small), torch.bfloat16, "10GB")
checkpoint("qwen2_f32_sharded", Qwen2Config(**small), torch.float32, "60KB")

# Every dtype the reader decodes, and some it lists as unavailable.
all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
dtypes = {
    "w.f16": torch.randn(8, 16).to(torch.float16),
    "w.f64": torch.randn(4, 8, dtype=torch.float64) * 1e3,
    "w.bf16": torch.randn(16).to(torch.bfloat16),
    "w.f8_e4m3": all_bytes.clone().view(torch.float8_e4m3fn).reshape(16, 16),
    "w.f8_e5m2": all_bytes.clone().view(torch.float8_e5m2).reshape(16, 16),
    "w.f32": torch.randn(3, 5),
    "ids.i32": torch.arange(12, dtype=torch.int32),
    "mask.bool": torch.ones(5, dtype=torch.bool),
    "raw.u8": torch.arange(7, dtype=torch.uint8),
}
os.makedirs(os.path.join(out, "dtypes"))
save_file(dtypes, os.path.join(out, "dtypes", "model.safetensors"))
dump("dtypes", loaded(os.path.join(out, "dtypes")))

with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump(reference, f, indent=1)
