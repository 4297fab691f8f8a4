"""Tiny random checkpoints of each family, by transformers' own classes,
converted to F32 GGUF by llama.cpp's convert_hf_to_gguf.py, with the
references tests/families.rs checks the mount against.

argv: smol_dir work_dir family...

The converter comes from the llama-cpp-python sdist tools/llama-cpp.sh
fetched ($XDG_CACHE_HOME or ~/.cache, rknot/llama_cpp_python-0.3.36.tar.gz).

smol_dir holds SmolLM2's tokenizer.json / tokenizer_config.json (from the
hf/ view of the SmolLM2 GGUF); its vocabulary with Qwen2's split regex is
every family's tokenizer. The converter's hash of the token ids knows that
split only with Qwen's own vocabulary, so it is told the name ("qwen2").

For each family F, work_dir/F/ is the checkpoint (save_pretrained) and
work_dir/F.gguf the conversion; work_dir/F.ref.json records the token
sequence, the greedy continuation and the tokenizer's ids of TEXTS, and
work_dir/F.logits.f32 the fp32 logits of every position (row-major,
little-endian).
"""
import json, os, runpy, sys, tarfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

smol, work = sys.argv[1:3]
families = sys.argv[3:]
cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
sdist = os.path.join(cache, "rknot", "llama_cpp_python-0.3.36.tar.gz")
if not os.path.isfile(sdist):
    sys.exit(f"{sdist} is missing: tools/llama-cpp.sh fetches it")

TOKENS = [1, 17, 300, 4242, 9, 77, 1000, 31337]
GREEDY_NEW = 6
TEXTS = ["The capital of France is Paris.", "12 + 30 = 42", "  spaces\tand\ttabs\n\nnew lines",
         "naïve café, Ünïcödé ✓", "<|im_start|>user\nhi<|im_end|>"]

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Per checkpoint: transformers' model_type and what its config needs
# beyond COMMON (a head_dim other than hidden / heads where the family has
# the field, experts for MoE).
QWEN3_MOE = dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
FAMILY = {
    "llama": ("llama", dict()),
    "qwen2": ("qwen2", dict()),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", QWEN3_MOE),
    # One expert per token, and the router forced to expert 0 (below).
    "qwen3_moe_forced": ("qwen3_moe", dict(QWEN3_MOE, num_experts_per_tok=1)),
}


def force_expert_0(model):
    """Residual channel 0 is 5 for every token in every layer (the
    embeddings' column 0; nothing writes to it), and each router's only
    weight is on it: expert 0's logit is positive, the others' 0."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 5.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.post_attention_layernorm.weight[0] = 1.0
            experts = layer.mlp.experts
            for name, p in experts.named_parameters():
                if "down" in name:
                    # [experts, d, ffn] (fused) or [d, ffn] (per expert).
                    p[..., 0, :] = 0.0
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[0, 0] = 10.0

prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
with tarfile.open(sdist) as tf:
    members = [m for m in tf.getmembers()
               if m.name.startswith(tuple(prefix + p for p in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")))]
    tf.extractall(work, members=members, filter="data")
converter = os.path.join(work, prefix, "convert_hf_to_gguf.py")
sys.path.insert(0, os.path.dirname(converter))
import conversion.base  # noqa: E402  (from the sdist just extracted)

# The converter's hash of the token ids knows Qwen2's split only with Qwen's
# own vocabulary: it is told the name that hash gives it.
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"


def convert(checkpoint, out):
    """convert_hf_to_gguf.py in this process (torch is imported once)."""
    argv = sys.argv
    sys.argv = [converter, checkpoint, "--outfile", out, "--outtype", "f32"]
    try:
        runpy.run_path(converter, run_name="__main__")
    finally:
        sys.argv = argv


tok = json.load(open(os.path.join(smol, "tokenizer.json"), encoding="utf-8"))
tcfg = json.load(open(os.path.join(smol, "tokenizer_config.json"), encoding="utf-8"))
tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
n_vocab = len(tok["model"]["vocab"])

for fam in families:
    torch.manual_seed(0)
    model_type, extra = FAMILY[fam]
    cfg = AutoConfig.for_model(model_type, vocab_size=n_vocab, **COMMON, **extra)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    # Weights big enough that the logits are far from uniform (the default
    # init's 0.02 makes every candidate nearly tied): norms around 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    if fam.endswith("_forced"):
        force_expert_0(model)
    out = os.path.join(work, fam)
    model.save_pretrained(out)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(tcfg, add_prefix_space=False), f, ensure_ascii=False, indent=2)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
        greedy = model.generate(ids, max_new_tokens=GREEDY_NEW, do_sample=False, min_new_tokens=GREEDY_NEW,
                                pad_token_id=0)[0, len(TOKENS):].tolist()
    logits.astype("<f4").tofile(os.path.join(work, fam + ".logits.f32"))
    t = AutoTokenizer.from_pretrained(out)
    ref = {"tokens": TOKENS, "greedy": greedy, "n_vocab": int(logits.shape[1]),
           "texts": TEXTS, "ids": [t(s, add_special_tokens=False)["input_ids"] for s in TEXTS]}
    with open(os.path.join(work, fam + ".ref.json"), "w") as f:
        json.dump(ref, f)
    convert(out, os.path.join(work, fam + ".gguf"))
    print("CONVERTED", fam, flush=True)
