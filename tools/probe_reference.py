#!/usr/bin/env python3
"""Reference figures for `rknot probe` (tests/probe.rs compares against them).

Independent implementations on the same SmolLM2 weights:

* tokenizer: Python `tokenizers` (a BPE built from the GGUF's own vocab and
  merges, with the pre-tokenizer SmolLM2's tokenizer.json declares:
  individual digits, then GPT-2 byte-level), cross-checked against
  llama.cpp's tokenizer on the same strings;
* forward pass: llama.cpp (through llama-cpp-python) on an F32 GGUF made by
  llama.cpp's own `llama-quantize` from the Q4_1 file, i.e. the same fp32
  values rknot serves, with an f32 KV cache and no flash attention; the
  Q4_1 file run natively (llama.cpp's quantized matmuls) is recorded too,
  for information;
* perplexity: llama.cpp's `llama-perplexity` binary on that F32 GGUF,
  `-c 256`, over tests/data/probe/gpl-3.0.txt (all windows, and the first
  4 that the Rust test recomputes), plus a re-implementation of its
  windowing through llama-cpp-python as a check on how we read it.

Writes tests/data/probe/reference.json and tests/data/probe/logits_*.f16
(the last-position logits of each prompt, float16 little-endian) and
tests/data/probe/tiny-qwen2.gguf (random weights; its llama.cpp logits are in
the JSON).

Versions used for the committed figures (2 CPU cores, x86-64):
  llama-cpp-python 0.3.36 (built from the PyPI sdist; its vendored
  llama.cpp also built the two tools below), tokenizers 0.23.3, gguf 0.19.0,
  numpy 2.4.6, Python 3.11.7.

How they were produced:

  python3 -m venv /tmp/rknot-probe-venv
  /tmp/rknot-probe-venv/bin/pip install scikit-build-core cmake ninja \\
      numpy==2.4.6 tokenizers==0.23.3 gguf==0.19.0
  /tmp/rknot-probe-venv/bin/pip download --no-deps --no-build-isolation \\
      --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d /tmp/llsdist
  tar xzf /tmp/llsdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsdist
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
      /tmp/rknot-probe-venv/bin/pip install --no-build-isolation \\
      /tmp/llsdist/llama_cpp_python-0.3.36.tar.gz
  PATH=/tmp/rknot-probe-venv/bin:$PATH cmake \\
      -S /tmp/llsdist/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/llbuild-tools \\
      -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF \\
      -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \\
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  PATH=/tmp/rknot-probe-venv/bin:$PATH cmake --build /tmp/llbuild-tools \\
      --target llama-perplexity llama-quantize -j2
  /tmp/rknot-probe-venv/bin/python tools/probe_reference.py \\
      --llama-bin /tmp/llbuild-tools/bin

CI does not run this: it needs llama.cpp. The Rust tests read the JSON.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "tests" / "data" / "probe"
TEXT = OUT / "gpl-3.0.txt"
CTX = 256
PREFIX_CHUNKS = 4

# Strings for the tokenizer check: spaces (leading, doubled, trailing),
# digits, punctuation, contractions, non-ASCII scripts, emoji, control
# whitespace, code, and a chat turn with control tokens.
TOKENIZER_CASES = [
    "The capital of France is",
    "Hello, world! How's it going?",
    "  leading, double  spaces and trailing   ",
    "Numbers: 3.14159, 1,000,000 and 2024-11-30; 42nd, x2, 0xFF.",
    "I'm sure they'll say we've done it, isn't it? 'quoted' \"double\"",
    "naïve café, Straße, Ελληνικά, русский текст, 東京タワー, 한국어, عربى",
    "emoji 🎉👍🏽 and symbols €£¥ © ™ — … «»",
    "tabs\tand\nnewlines\n\n  indented\r\nwindows line",
    "def f(x):\n    return x**2 + 1  # comment\n",
    "!!!???...---___ ((([[[{{{}}}]]])))",
    "x=1;y=2;z=x+y",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
]

# Prompts for the forward-pass check (control tokens parsed, as the probe
# and llama.cpp's CLI do for prompts).
PROMPTS = [
    "The capital of France is",
    "The quick brown fox jumps over the lazy",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, Neil Armstrong became the first person to walk on the",
]


# Factual prompts for greedy generation (GEN_TOKENS tokens each, argmax at
# every step, f32 weights), recorded for docs/QUALITY.md and the tests.
GEN_PROMPTS = [
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water is made of hydrogen and",
    "The first president of the United States was",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
]
GEN_TOKENS = 16


def greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        if t == llm.token_eos():
            break
        llm.eval([t])
    return out


def gguf_vocab(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))

    def field(name):
        f = r.fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def ints(name):
        f = r.fields[name]
        return [int(f.parts[i][0]) for i in f.data]

    return field("tokenizer.ggml.tokens"), ints("tokenizer.ggml.token_type"), field("tokenizer.ggml.merges")


def hf_tokenizer(tokens, types, merges):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    # GGUF token type 3 = control: special tokens matched in text.
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return tk


def llama(path, **kw):
    from llama_cpp import Llama

    return Llama(model_path=str(path), verbose=False, **kw)


def logits_all(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def top5(row):
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:5]
    m = row.max()
    lse = m + np.log(np.exp(row.astype(np.float64) - m).sum())
    return [{"id": int(i), "logit": float(row[i]), "prob": float(np.exp(row[i] - lse))} for i in order]


def ppl_windows_python(llm, ids, ctx, chunks, bos):
    """llama-perplexity's loop, re-done: window i is ids[i*ctx:(i+1)*ctx]
    with its first token replaced by BOS when the vocab adds one; positions
    ctx/2 .. ctx-2 are scored on the next token."""
    nll, count = 0.0, 0
    first = ctx // 2
    for c in range(min(chunks, len(ids) // ctx)):
        w = list(ids[c * ctx : (c + 1) * ctx])
        if bos is not None:
            w[0] = bos
        lg = logits_all(llm, w).astype(np.float64)
        for j in range(first, ctx - 1):
            row = lg[j]
            m = row.max()
            lse = m + np.log(np.exp(row - m).sum())
            nll += lse - row[ids[c * ctx + j + 1]]
            count += 1
    return float(np.exp(nll / count)), count


def run_perplexity(bin_dir, model, chunks, threads):
    cmd = [
        str(bin_dir / "llama-perplexity"),
        "-m", str(model), "-f", str(TEXT), "-c", str(CTX), "-b", str(CTX),
        "-t", str(threads), "-ctk", "f32", "-ctv", "f32", "-fa", "off",
    ]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = p.stdout + p.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    n = re.search(r"calculating perplexity over (\d+) chunks", log)
    t = re.search(r"tokenizes to only|tokenization took", log)
    if not m:
        sys.exit("no final estimate in llama-perplexity output:\n" + log)
    display = ["llama-perplexity"] + [Path(a).name if "/" in a else a for a in cmd[1:]]
    return {
        "command": " ".join(display),
        "chunks": int(n.group(1)) if n else None,
        "ppl": float(m.group(1)),
        "ppl_uncertainty": float(m.group(2)),
    }, t is not None


TINY_QWEN2 = OUT / "tiny-qwen2.gguf"
TINY_IDS = [256, 5, 71, 258, 100, 33, 257, 200, 17]


def byte_chars():
    """GPT-2's byte -> printable char table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_qwen2(path):
    """A 2-layer qwen2 with random fp32 weights (seeded): Q/K/V biases,
    NeoX RoPE, GQA 4/2, separate output head. It checks the qwen2 code path
    against llama.cpp without a real Qwen model."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(20241130)
    d, ff, nh, nkv, hd, layers = 32, 64, 4, 2, 8, 2
    toks = byte_chars() + ["\u0120t", "he", "\u0120the", "<|endoftext|>"]
    types = [1] * (len(toks) - 1) + [3]
    nv = len(toks)
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2 (random weights, rknot probe test)")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 t", "h e", "\u0120t he"])
    w.add_bos_token_id(nv - 1)
    w.add_eos_token_id(nv - 1)
    w.add_add_bos_token(False)

    def t(name, *shape, scale=0.3, base=0.0):
        w.add_tensor(name, (base + scale * rng.standard_normal(shape)).astype(np.float32))

    t("token_embd.weight", nv, d, scale=1.0)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", d, scale=0.1, base=1.0)
        t(f"blk.{i}.attn_q.weight", nh * hd, d)
        t(f"blk.{i}.attn_q.bias", nh * hd, scale=0.5)
        t(f"blk.{i}.attn_k.weight", nkv * hd, d)
        t(f"blk.{i}.attn_k.bias", nkv * hd, scale=0.5)
        t(f"blk.{i}.attn_v.weight", nkv * hd, d)
        t(f"blk.{i}.attn_v.bias", nkv * hd, scale=0.5)
        t(f"blk.{i}.attn_output.weight", d, nh * hd)
        t(f"blk.{i}.ffn_norm.weight", d, scale=0.1, base=1.0)
        t(f"blk.{i}.ffn_gate.weight", ff, d)
        t(f"blk.{i}.ffn_up.weight", ff, d)
        t(f"blk.{i}.ffn_down.weight", d, ff)
    t("output_norm.weight", d, scale=0.1, base=1.0)
    t("output.weight", nv, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="dir with llama-perplexity and llama-quantize")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    import llama_cpp
    import tokenizers

    OUT.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = gguf_vocab(MODEL)
    hf = hf_tokenizer(tokens, types, merges)
    vocab_llm = llama(MODEL, vocab_only=True)

    tok_cases = []
    for text in TOKENIZER_CASES:
        ids_hf = hf.encode(text, add_special_tokens=False).ids
        ids_llama = vocab_llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if ids_hf != ids_llama:
            sys.exit(f"tokenizers and llama.cpp disagree on {text!r}:\n  {ids_hf}\n  {ids_llama}")
        if hf.decode(ids_hf, skip_special_tokens=False) != text:
            sys.exit(f"tokenizers does not round-trip {text!r}")
        tok_cases.append({"text": text, "parse_special": True, "ids": ids_hf})

    text = TEXT.read_text(encoding="utf-8")
    if text.endswith("\n"):  # llama-perplexity -f drops one trailing newline
        text = text[:-1]
    text_ids = hf.encode(text, add_special_tokens=False).ids
    text_ids_llama = vocab_llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    if text_ids != text_ids_llama:
        sys.exit("tokenizers and llama.cpp disagree on the perplexity text")
    add_bos = bool(vocab_llm._model.add_bos_token()) if hasattr(vocab_llm, "_model") else False
    bos = vocab_llm.token_bos() if add_bos else None

    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "smollm2-f32.gguf"
        subprocess.run(
            [str(args.llama_bin / "llama-quantize"), "--allow-requantize", str(MODEL), str(f32), "F32"],
            check=True, capture_output=True,
        )
        models = {"f32": f32, "q4_1": MODEL}
        prompts = []
        for label, path in models.items():
            llm = llama(path, n_ctx=512, n_batch=512, n_threads=args.threads, logits_all=True,
                        flash_attn=False, type_k=0, type_v=0)  # 0 = GGML_TYPE_F32
            for pi, prompt in enumerate(PROMPTS):
                ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
                lg = logits_all(llm, ids)
                entry = {
                    "model": label,
                    "prompt": prompt,
                    "ids": ids,
                    "top1_each_position": [int(np.argmax(r)) for r in lg],
                    "last_top5": top5(lg[-1]),
                }
                if label == "f32":
                    name = f"logits_{pi}.f16"
                    lg[-1].astype("<f2").tofile(OUT / name)
                    entry["last_logits_file"] = name
                prompts.append(entry)
                print(label, repr(prompt), "->", [(t["id"], round(t["prob"], 4)) for t in entry["last_top5"]])
            if label == "f32":
                py_ppl, py_count = ppl_windows_python(llm, text_ids, CTX, PREFIX_CHUNKS, bos)
                generations = []
                for prompt in GEN_PROMPTS:
                    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
                    gen = greedy(llm, ids, GEN_TOKENS)
                    text = llm.detokenize(gen, special=True).decode("utf-8", "replace")
                    generations.append({"prompt": prompt, "ids": ids, "greedy": gen, "text": text})
                    print("greedy", repr(prompt), "->", repr(text))
            del llm
        ppl = {}
        for label, path in models.items():
            ppl[label] = {
                "prefix": run_perplexity(args.llama_bin, path, PREFIX_CHUNKS, args.threads)[0],
                "full": run_perplexity(args.llama_bin, path, None, args.threads)[0],
            }
            print(label, "perplexity", ppl[label])

    write_tiny_qwen2(TINY_QWEN2)
    tiny = llama(TINY_QWEN2, n_ctx=64, n_batch=64, n_threads=1, logits_all=True,
                 flash_attn=False, type_k=0, type_v=0)
    tiny_logits = logits_all(tiny, TINY_IDS)
    del tiny
    version = subprocess.run([str(args.llama_bin / "llama-perplexity"), "--version"],
                             capture_output=True, text=True).stderr.strip().splitlines()

    ref = {
        "generated_by": "tools/probe_reference.py --llama-bin <dir with llama-perplexity, llama-quantize>",
        "versions": {
            "llama_cpp_python": llama_cpp.__version__,
            "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0],
        },
        "model": MODEL.name,
        "forward_model_note": "f32 = llama-quantize --allow-requantize <Q4_1 file> F32 (same fp32 values rknot serves); "
        "q4_1 = the file itself through llama.cpp's quantized kernels; both with f32 KV cache, no flash attention",
        "llama_cpp_tools_version": version,
        "tokenizer_cases": tok_cases,
        "prompts": prompts,
        "perplexity": {
            "text": TEXT.name,
            "ctx": CTX,
            "text_tokens": len(text_ids),
            "text_ids_sha256_u32le": hashlib.sha256(np.array(text_ids, dtype="<u4").tobytes()).hexdigest(),
            "add_bos": add_bos,
            "prefix_chunks": PREFIX_CHUNKS,
            "python_reimplementation_prefix": {"ppl": py_ppl, "scored_tokens": py_count},
            **ppl,
        },
        "greedy_f32": generations,
        "tiny_qwen2": {
            "file": TINY_QWEN2.name,
            "ids": TINY_IDS,
            "logits": [[round(float(v), 6) for v in row] for row in tiny_logits],
        },
    }
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print("wrote", OUT / "reference.json")


if __name__ == "__main__":
    main()
