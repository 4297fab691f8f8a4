#!/usr/bin/env python3
"""Write a tiny random llama-architecture F32 GGUF for the ggml type tests.

    python3 tools/tiny_llama_gguf.py OUT.gguf

Every matrix row is 256 or 512 wide, so llama-quantize can store every
matrix in the 256-element super-block types (a model like SmolLM2, whose
rows are 576 wide, falls back to other types for them). The vocabulary is
SentencePiece-style byte fallback (<unk>, <s>, </s>, then the 256 byte
tokens), enough for llama-imatrix to run on any text. Weights are
deterministic (fixed seed), normal with std 0.02 (norms 1.0).
Used by tests/ggml_types.rs; needs gguf-py (gguf==0.19.0) and numpy.
"""

from __future__ import annotations

import sys

import numpy as np
import gguf

EMBD = 256
FFN = 512
HEADS = 4
HEADS_KV = 2
LAYERS = 2
SEED = 23


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    rng = np.random.default_rng(SEED)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    vocab = len(tokens)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("rknot-tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(EMBD)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS_KV)
    w.add_rope_dimension_count(EMBD // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def mat(name: str, rows: int, cols: int) -> None:
        # numpy shape (rows, cols): GGUF ne = [cols, rows], rows `cols` wide.
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32))

    kv = EMBD // HEADS * HEADS_KV
    mat("token_embd.weight", vocab, EMBD)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(EMBD, dtype=np.float32))
        mat(f"blk.{i}.attn_q.weight", EMBD, EMBD)
        mat(f"blk.{i}.attn_k.weight", kv, EMBD)
        mat(f"blk.{i}.attn_v.weight", kv, EMBD)
        mat(f"blk.{i}.attn_output.weight", EMBD, EMBD)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(EMBD, dtype=np.float32))
        mat(f"blk.{i}.ffn_gate.weight", FFN, EMBD)
        mat(f"blk.{i}.ffn_up.weight", FFN, EMBD)
        mat(f"blk.{i}.ffn_down.weight", EMBD, FFN)
    w.add_tensor("output_norm.weight", np.ones(EMBD, dtype=np.float32))
    mat("output.weight", vocab, EMBD)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
