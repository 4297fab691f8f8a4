#!/usr/bin/env python3
"""Generate the committed ggml dequantization test vectors.

Pinned versions (the committed outputs were produced with exactly these):
    gguf==0.19.0
    numpy==2.4.6
    (Python 3.11, x86_64)

Run from anywhere, after tools/fetch-smollm2.sh has fetched the model:

    python3 tools/gen_ggml_vectors.py

The script refuses to run with other gguf/numpy versions unless given
--any-version (the vectors are the reference for bit-exact kernels, so a
silent change of reference would defeat them).

Outputs (paths relative to the repository root):

  tests/data/ggml/<name>.bin      raw ggml block bytes (verbatim layout)
  tests/data/ggml/<name>.f32      gguf.quants.dequantize(<name>.bin) as
                                  little-endian float32
  tests/data/ggml/manifest.json   one entry per vector: name, type,
                                  n_elements, source, sha256 of both files
  tests/data/smollm2_dequant.json sha256 of the dequantized f32 bytes of
                                  every tensor of the SmolLM2 model

Everything is deterministic (fixed seed); re-running reproduces the same
bytes. Read by tests/ggml_vectors.rs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

PINNED_GGUF = "0.19.0"
PINNED_NUMPY = "2.4.6"
SEED = 20250117

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_DIR = ROOT / "tests" / "data" / "ggml"
MODEL_JSON = ROOT / "tests" / "data" / "smollm2_dequant.json"

TYPE_NAMES = {
    T.F32: "f32",
    T.F16: "f16",
    T.BF16: "bf16",
    T.Q4_0: "q4_0",
    T.Q4_1: "q4_1",
    T.Q5_0: "q5_0",
    T.Q5_1: "q5_1",
    T.Q8_0: "q8_0",
    T.Q2_K: "q2_k",
    T.Q3_K: "q3_k",
    T.Q4_K: "q4_k",
    T.Q5_K: "q5_k",
    T.Q6_K: "q6_k",
    T.IQ1_S: "iq1_s",
    T.IQ1_M: "iq1_m",
    T.IQ2_XXS: "iq2_xxs",
    T.IQ2_XS: "iq2_xs",
    T.IQ2_S: "iq2_s",
    T.IQ3_XXS: "iq3_xxs",
    T.IQ3_S: "iq3_s",
    T.IQ4_NL: "iq4_nl",
    T.IQ4_XS: "iq4_xs",
    T.TQ1_0: "tq1_0",
    T.TQ2_0: "tq2_0",
    T.MXFP4: "mxfp4",
    T.NVFP4: "nvfp4",
}


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def f32_bytes(a: np.ndarray) -> bytes:
    """Little-endian float32 bytes in storage order, without any float op
    (a byte view, so NaN payloads are kept as numpy produced them)."""
    assert a.dtype == np.float32, a.dtype
    a = np.ascontiguousarray(a).reshape(-1)
    if sys.byteorder != "little":
        a = a.byteswap()
    return a.view(np.uint8).tobytes()


def u16_bytes(bits) -> bytes:
    return np.asarray(bits, dtype="<u2").tobytes()


def f16_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


class Writer:
    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.entries: list[dict] = []

    def add(self, name: str, qtype: T, raw: bytes, source: str) -> None:
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        assert len(raw) % block_bytes == 0, (name, len(raw))
        n_elements = len(raw) // block_bytes * block_elems
        data = np.frombuffer(raw, dtype=np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            out = dequantize(data, qtype)
        assert out.dtype == np.float32 and out.size == n_elements, name
        f32 = f32_bytes(out)
        (self.out_dir / f"{name}.bin").write_bytes(raw)
        (self.out_dir / f"{name}.f32").write_bytes(f32)
        self.entries.append(
            {
                "name": name,
                "type": TYPE_NAMES[qtype],
                "n_elements": n_elements,
                "source": source,
                "bin_sha256": sha256(raw),
                "f32_sha256": sha256(f32),
            }
        )


def tensor_blocks(tensor, start: int, count: int) -> bytes:
    """Raw bytes of blocks [start, start + count) of a GGUF tensor."""
    _, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    raw = tensor.data.reshape(-1).view(np.uint8)
    assert (start + count) * block_bytes <= raw.size, tensor.name
    return raw[start * block_bytes : (start + count) * block_bytes].tobytes()


def real_vectors(w: Writer, reader: gguf.GGUFReader) -> None:
    tensors = {t.name: t for t in reader.tensors}

    def take(name, start, count, label):
        t = tensors[name]
        n_blocks = t.data.nbytes // GGML_QUANT_SIZES[t.tensor_type][1]
        if start < 0:
            start = n_blocks // 2 - count // 2
        ty = TYPE_NAMES[t.tensor_type]
        w.add(
            f"smollm2_{ty}_{label}",
            t.tensor_type,
            tensor_blocks(t, start, count),
            f"SmolLM2-135M-Instruct.Q4_1.gguf {name} blocks {start}..{start + count}"
            f" of {n_blocks}",
        )

    # Q4_1: three tensors of different shapes, first and middle slices.
    take("blk.0.attn_q.weight", 0, 64, "blk0_attn_q_head")
    take("blk.10.ffn_down.weight", -1, 64, "blk10_ffn_down_mid")
    take("blk.29.attn_v.weight", -1, 32, "blk29_attn_v_mid")
    # Q8_0: token embeddings, first rows and the middle of the vocabulary.
    take("token_embd.weight", 0, 64, "token_embd_head")
    take("token_embd.weight", -1, 64, "token_embd_mid")
    # F32: norm weights, whole tensors.
    for name, label in [
        ("blk.0.attn_norm.weight", "blk0_attn_norm"),
        ("output_norm.weight", "output_norm"),
    ]:
        t = tensors[name]
        assert t.tensor_type == T.F32
        w.add(
            f"smollm2_f32_{label}",
            T.F32,
            f32_bytes(t.data),
            f"SmolLM2-135M-Instruct.Q4_1.gguf {name} (whole tensor)",
        )


def realistic_values(rng: np.random.Generator, n_blocks: int, block: int = 32) -> np.ndarray:
    """Weights-like data: normal * 0.02, with a few wide blocks, single-value
    outliers, one all-zero block, one constant block and one block so small
    that its f16 scale is subnormal."""
    x = rng.normal(0.0, 0.02, size=(n_blocks, block)).astype(np.float32)
    x[4:7] *= 25.0  # wide blocks
    for b in (9, 17, 30):  # one outlier each
        x[b, rng.integers(block)] = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 3.0)
    x[3] = 0.0  # all-zero block
    x[12] = 0.0123  # constant block
    x[20] *= 1e-4  # scale below f16's normal range (subnormal d)
    return x.reshape(-1)


def random_vectors(w: Writer, rng: np.random.Generator) -> None:
    x = rng.normal(0.0, 0.02, size=4096).astype(np.float32)
    x[:8] = [0.0, -0.0, 1e-7, -3e-6, 65504.0, -70000.0, 1e-9, 0.5]
    with np.errstate(over="ignore"):  # -70000 overflows to -inf on purpose
        f16 = x.astype(np.float16).tobytes()
    w.add(
        "random_f16",
        T.F16,
        f16,
        "random normal*0.02 (plus a few extremes), numpy astype(float16)",
    )

    x = rng.normal(0.0, 0.02, size=2048).astype(np.float32)
    x[:4] = [0.0, -0.0, 3.0e38, -1.0e-39]
    w.add(
        "random_bf16",
        T.BF16,
        quantize(x, T.BF16).tobytes(),
        "random normal*0.02 (plus a few extremes), quantized by gguf-py BF16",
    )

    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        x = realistic_values(rng, 64)
        raw = quantize(x.reshape(2, -1), qtype).tobytes()
        name = TYPE_NAMES[qtype]
        w.add(
            f"random_{name}",
            qtype,
            raw,
            f"random, quantized by gguf-py {qtype.name}: normal*0.02, blocks 4-6"
            " scaled x25, outliers in blocks 9/17/30, block 3 all zero,"
            " block 12 constant, block 20 tiny (subnormal f16 scale)",
        )


# Byte offsets of the f16 super-scales within each k-quant block.
K_SCALE_OFFSETS = {
    T.Q2_K: (80, 82),  # d, dmin (after scales[16], qs[64])
    T.Q3_K: (108,),  # d (after hmask[32], qs[64], scales[12])
    T.Q4_K: (0, 2),  # d, dmin
    T.Q5_K: (0, 2),  # d, dmin
    T.Q6_K: (208,),  # d (after ql[128], qh[64], scales[16])
}


def kquant_vectors(w: Writer, rng: np.random.Generator) -> None:
    n_blocks = 16
    for qtype, offsets in K_SCALE_OFFSETS.items():
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for off in offsets:
            mag = 10.0 ** rng.uniform(-4.0, -1.0, size=n_blocks)
            sign = rng.choice([-1.0, 1.0], size=n_blocks)
            scale = (sign * mag).astype(np.float16)
            assert np.all(np.isfinite(scale))
            blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        name = TYPE_NAMES[qtype]
        w.add(
            f"random_{name}",
            qtype,
            blocks.tobytes(),
            f"random block bytes ({n_blocks} super-blocks); gguf-py has no {qtype.name}"
            " quantizer, so every byte is uniform random except the f16 super-scales"
            " (d" + (", dmin" if len(offsets) == 2 else "") + "), which are set to"
            " finite values with |x| log-uniform in [1e-4, 0.1] and random sign",
        )


def edge_vectors(w: Writer) -> None:
    # f16: every pattern with exponent 0 (zeros, subnormals) or 31 (infinities,
    # quiet and signalling NaNs with every payload), both signs, plus every
    # 17th pattern of the whole range and the normal-range landmarks.
    every = np.arange(0x10000, dtype=np.uint32)
    exp = (every >> 10) & 0x1F
    special = every[(exp == 0) | (exp == 31)]
    landmarks = [0x0400, 0x8400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x3555, 0x0001, 0x03FF]
    bits = np.concatenate([special, every[::17], landmarks]).astype(np.uint16)
    w.add(
        "edge_f16",
        T.F16,
        u16_bytes(bits),
        "edge cases: all f16 patterns with exponent 0 or 31 (+-0, subnormals, +-inf,"
        " quiet and signalling NaNs with all payloads), every 17th pattern, normal"
        " landmarks (min/max normal, +-1); numpy keeps NaN payloads and does not"
        " set the quiet bit",
    )

    every = np.arange(0x10000, dtype=np.uint32)
    exp = (every >> 7) & 0xFF
    special = every[(exp == 0) | (exp == 0xFF)]
    landmarks = [0x0080, 0x8080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7F81, 0x7FC0]
    bits = np.concatenate([special, every[::37], landmarks]).astype(np.uint16)
    w.add(
        "edge_bf16",
        T.BF16,
        u16_bytes(bits),
        "edge cases: all bf16 patterns with exponent 0 or 255 (+-0, subnormals,"
        " +-inf, quiet and signalling NaNs with all payloads), every 37th pattern,"
        " landmarks",
    )

    # Blocks whose f16 scale is not finite. We decode them exactly as gguf-py
    # does (inf / NaN results) instead of rejecting them. Codes are chosen
    # nonzero so no inf * 0 occurs: its default-NaN sign differs between
    # x86 (negative) and Arm (positive), which would make the vector
    # platform-dependent. A NaN scale propagates quieted with its payload.
    scales = [0x7C00, 0xFC00, 0x7C01, 0xFE55, f16_bits(0.25)]
    codes = np.array([v for v in range(-128, 128) if v != 0], dtype=np.int8)
    rng = np.random.default_rng(SEED + 1)
    raw = b""
    for s in scales:
        raw += u16_bytes([s]) + rng.choice(codes, size=32).tobytes()
    w.add(
        "edge_q8_0_special_scale",
        T.Q8_0,
        raw,
        "edge cases: Q8_0 blocks with scale +inf, -inf, signalling NaN 0x7c01,"
        " quiet NaN 0xfe55, then 0.25; nonzero random codes. Decoded exactly as"
        " gguf-py does (inf/NaN out), not rejected",
    )
    nibbles = np.array([v for v in range(16) if v != 8], dtype=np.uint8)  # q - 8 != 0
    raw = b""
    for s in scales:
        lo = rng.choice(nibbles, size=16)
        hi = rng.choice(nibbles, size=16)
        raw += u16_bytes([s]) + (lo | (hi << 4)).astype(np.uint8).tobytes()
    w.add(
        "edge_q4_0_special_scale",
        T.Q4_0,
        raw,
        "edge cases: Q4_0 blocks with scale +inf, -inf, signalling NaN 0x7c01,"
        " quiet NaN 0xfe55, then 0.25; codes != 8 (no inf * 0). Decoded exactly"
        " as gguf-py does (inf/NaN out), not rejected",
    )


# The f16 super-scale of the types added in issue 23 that have one in two
# plain bytes: its byte offset in the block.
F16_SCALE_OFFSET = {
    T.IQ1_S: 0,
    T.IQ2_XXS: 0,
    T.IQ2_XS: 0,
    T.IQ2_S: 0,
    T.IQ3_XXS: 0,
    T.IQ3_S: 0,
    T.IQ4_NL: 0,
    T.IQ4_XS: 0,
    T.TQ1_0: 52,  # after qs[48], qh[4]
    T.TQ2_0: 64,  # after qs[64]
}

# Special f16 scales: +inf, -inf, signalling NaN, quiet NaN with payload,
# max normal, min subnormal, negative zero.
SPECIAL_SCALES = [0x7C00, 0xFC00, 0x7C01, 0xFE55, 0x7BFF, 0x0001, 0x8000]


def set_f16_scales(qtype: T, blocks: np.ndarray, bits: np.ndarray) -> None:
    """Store f16 super-scales (bit patterns, one per block) in place."""
    bits = np.asarray(bits, dtype=np.uint16)
    if qtype == T.IQ1_M:
        # The f16 is spread over the top nibbles of the four u16 at 48..56.
        sc = blocks[:, 48:56].copy().view("<u2")
        for i in range(4):
            nib = (bits >> (4 * i)) & 0xF
            sc[:, i] = (sc[:, i] & 0x0FFF) | (nib << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
        return
    off = F16_SCALE_OFFSET[qtype]
    blocks[:, off : off + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)


def finite_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    mag = 10.0 ** rng.uniform(-4.0, -1.0, size=n)
    sign = rng.choice([-1.0, 1.0], size=n)
    return (sign * mag).astype(np.float16).view(np.uint16)


# Grid geometry of the lattice types: (grid rows, grid indices per block).
GRID_TYPES = {
    T.IQ1_S: (2048, 32),
    T.IQ1_M: (2048, 32),
    T.IQ2_XXS: (256, 32),
    T.IQ2_XS: (512, 32),
    T.IQ2_S: (1024, 32),
    T.IQ3_XXS: (256, 64),
    T.IQ3_S: (512, 64),
}


def set_grid_indices(qtype: T, blocks: np.ndarray, idx: np.ndarray) -> None:
    """Store grid indices (n_blocks x indices per block) in place, leaving
    every other bit as it was."""
    idx = idx.astype(np.int64)
    k = np.arange(idx.shape[1])
    if qtype == T.IQ2_XXS:  # one byte each, 4 per 8-byte group
        blocks[:, 2 + 8 * (k // 4) + k % 4] = idx
    elif qtype == T.IQ2_XS:  # low 9 bits of 32 u16
        q = blocks[:, 2:66].copy().view("<u2")
        q[:] = (q & 0xFE00) | idx.astype(np.uint16)
        blocks[:, 2:66] = q.view(np.uint8)
    elif qtype == T.IQ2_S:  # low byte + 2 bits in qh[k / 4]
        blocks[:, 2 + k] = idx & 0xFF
        qh = blocks[:, 66:74].astype(np.int64)
        for j in range(32):
            sh = 2 * (j % 4)
            qh[:, j // 4] = (qh[:, j // 4] & ~(3 << sh)) | (((idx[:, j] >> 8) & 3) << sh)
        blocks[:, 66:74] = qh
    elif qtype == T.IQ3_XXS:  # one byte each
        blocks[:, 2 + k] = idx
    elif qtype == T.IQ3_S:  # low byte + 1 bit in qh[k / 8]
        blocks[:, 2 + k] = idx & 0xFF
        qh = blocks[:, 66:74].astype(np.int64)
        for j in range(64):
            sh = j % 8
            qh[:, j // 8] = (qh[:, j // 8] & ~(1 << sh)) | (((idx[:, j] >> 8) & 1) << sh)
        blocks[:, 66:74] = qh
    elif qtype == T.IQ1_S:  # low byte + 3 bits in the u16 qh[k / 4]
        blocks[:, 2 + k] = idx & 0xFF
        qh = blocks[:, 34:50].copy().view("<u2").astype(np.int64)
        for j in range(32):
            sh = 3 * (j % 4)
            qh[:, j // 4] = (qh[:, j // 4] & ~(7 << sh)) | (((idx[:, j] >> 8) & 7) << sh)
        blocks[:, 34:50] = qh.astype("<u2").view(np.uint8)
    elif qtype == T.IQ1_M:  # low byte + 3 bits of the nibble k % 2 of qh[k / 2]
        blocks[:, k] = idx & 0xFF
        qh = blocks[:, 32:48].astype(np.int64)
        for j in range(32):
            sh = 4 * (j % 2)
            qh[:, j // 2] = (qh[:, j // 2] & ~(7 << sh)) | (((idx[:, j] >> 8) & 7) << sh)
        blocks[:, 32:48] = qh
    else:
        raise AssertionError(qtype)


def random_blocks(rng: np.random.Generator, qtype: T, n_blocks: int) -> np.ndarray:
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)


def newer_type_vectors(w: Writer, rng: np.random.Generator) -> None:
    """The types added in issue 23: random, every-grid-index and hostile
    blocks (issue 23 item 3)."""
    # Random bytes with finite log-uniform f16 scales (gguf-py quantizes
    # none of the i-quants); for the types gguf-py does quantize, its
    # blocks of weights-like data too.
    for qtype in [*GRID_TYPES, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0]:
        n = 64 if GGML_QUANT_SIZES[qtype][0] == 32 else 16
        blocks = random_blocks(rng, qtype, n)
        set_f16_scales(qtype, blocks, finite_scales(rng, n))
        name = TYPE_NAMES[qtype]
        w.add(
            f"random_{name}",
            qtype,
            blocks.tobytes(),
            f"random block bytes ({n} blocks), uniform except the f16 super-scale d,"
            " finite with |d| log-uniform in [1e-4, 0.1] and random sign",
        )
    for qtype in (T.MXFP4, T.NVFP4):
        blocks = random_blocks(rng, qtype, 64)
        w.add(
            f"random_{TYPE_NAMES[qtype]}",
            qtype,
            blocks.tobytes(),
            "random block bytes (64 blocks), every byte uniform (the scales are"
            " E8M0 / UE4M3 bytes: every value is a scale)",
        )
    for qtype in (T.TQ1_0, T.TQ2_0, T.MXFP4):
        x = realistic_values(rng, 64, 256 if qtype != T.MXFP4 else 32)
        raw = quantize(x.reshape(2, -1), qtype).tobytes()
        w.add(
            f"quantized_{TYPE_NAMES[qtype]}",
            qtype,
            raw,
            f"weights-like data (as random_q4_0) quantized by gguf-py {qtype.name}",
        )

    # Every grid index, in order, the other bits random.
    for qtype, (rows, per_block) in GRID_TYPES.items():
        n = rows // per_block
        blocks = random_blocks(rng, qtype, n)
        set_grid_indices(qtype, blocks, np.arange(rows).reshape(n, per_block))
        set_f16_scales(qtype, blocks, np.full(n, f16_bits(1.0)))
        w.add(
            f"grid_{TYPE_NAMES[qtype]}",
            qtype,
            blocks.tobytes(),
            f"every grid index 0..{rows} in order ({n} blocks), d = 1.0, every other"
            " bit random (scales, signs, shifts)",
        )

    # Hostile scales: infinities, NaNs, extremes. Blocks with an infinite
    # scale get codes that make no zero factor (no inf * 0, whose NaN sign
    # differs between x86 and Arm); NaN times anything is that NaN.
    for qtype in [*GRID_TYPES, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0]:
        n = len(SPECIAL_SCALES)
        blocks = random_blocks(rng, qtype, n)
        if qtype == T.IQ4_XS:  # no sub-block scale code 32 (a zero factor)
            sl = blocks[:, 4:8]
            blocks[:, 4:8] = (sl & 0xF0) | ((sl & 0x0F) | 1)  # low nibble odd: never 32
        if qtype == T.TQ1_0:  # every trit -1 or +1: digits 0 or 2
            digits = rng.choice([0, 2], size=(n, 52, 5))
            weights = np.array([81, 27, 9, 3, 1])
            v = (digits * weights).sum(axis=-1)
            v[:, 48:] = (digits[:, 48:, :4] * np.array([81, 27, 9, 3])).sum(axis=-1)
            blocks[:, :52] = ((v * 256 + 242) // 243).astype(np.uint8)
        if qtype == T.TQ2_0:  # codes 0, 2, 3: never 1 (zero)
            codes = rng.choice([0, 2, 3], size=(n, 64, 4))
            blocks[:, :64] = (codes << np.array([0, 2, 4, 6])).sum(axis=-1).astype(np.uint8)
        set_f16_scales(qtype, blocks, SPECIAL_SCALES)
        w.add(
            f"edge_{TYPE_NAMES[qtype]}_special_scale",
            qtype,
            blocks.tobytes(),
            "edge cases: f16 super-scale +inf, -inf, signalling NaN 0x7c01, quiet NaN"
            " 0xfe55, 65504, smallest subnormal, -0; random codes, with no zero factor"
            " where the scale is infinite. Decoded exactly as gguf-py does",
        )

    # MXFP4 / NVFP4: every scale byte.
    blocks = random_blocks(rng, T.MXFP4, 256)
    blocks[:, 0] = np.arange(256)
    w.add("edge_mxfp4_every_scale", T.MXFP4, blocks.tobytes(),
          "edge cases: every E8M0 scale byte 0..256 (subnormal halves at 0, 1; 2^127"
          " at 255), random codes")
    blocks = random_blocks(rng, T.NVFP4, 64)
    blocks[:, 0:4] = np.arange(256).reshape(64, 4)
    w.add("edge_nvfp4_every_scale", T.NVFP4, blocks.tobytes(),
          "edge cases: every UE4M3 scale byte 0..256 (0x7f and 0x00 read as 0, bit 7"
          " ignored), random codes")


def model_manifest(reader: gguf.GGUFReader) -> dict:
    h = hashlib.sha256()
    with open(MODEL, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    tensors = []
    for t in reader.tensors:
        with np.errstate(invalid="ignore", over="ignore"):
            out = dequantize(t.data, t.tensor_type)
        assert out.size == int(t.n_elements), t.name
        tensors.append(
            {
                "name": t.name,
                "type": TYPE_NAMES[t.tensor_type],
                "ne": [int(d) for d in t.shape],
                "n_elements": int(t.n_elements),
                "sha256": sha256(f32_bytes(out)),
            }
        )
    return {
        "generator": "tools/gen_ggml_vectors.py",
        "gguf": gguf_version(),
        "numpy": np.__version__,
        "model": {
            "file": str(MODEL.relative_to(ROOT)),
            "size": MODEL.stat().st_size,
            "sha256": h.hexdigest(),
        },
        "hash_of": "gguf.quants.dequantize(t.data, t.tensor_type) as contiguous"
        " little-endian float32 bytes in storage order",
        "tensors": tensors,
    }


def dump_json(obj: dict, list_key: str) -> str:
    """JSON with one line per entry of obj[list_key] (small, greppable diffs)."""
    lines = ["{"]
    items = list(obj.items())
    for i, (k, v) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if k == list_key:
            lines.append(f" {json.dumps(k)}: [")
            lines += [f"  {json.dumps(e)}{',' if j < len(v) - 1 else ''}" for j, e in enumerate(v)]
            lines.append(f" ]{comma}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--any-version", action="store_true", help="skip the pinned-version check")
    args = ap.parse_args()

    versions = (gguf_version(), np.__version__)
    if versions != (PINNED_GGUF, PINNED_NUMPY) and not args.any_version:
        print(
            f"error: need gguf=={PINNED_GGUF} and numpy=={PINNED_NUMPY}, have"
            f" gguf=={versions[0]} numpy=={versions[1]} (or pass --any-version)",
            file=sys.stderr,
        )
        return 1
    if not MODEL.is_file():
        print(f"error: {MODEL} missing; run tools/fetch-smollm2.sh", file=sys.stderr)
        return 1

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for old in list(OUT_DIR.glob("*.bin")) + list(OUT_DIR.glob("*.f32")):
        old.unlink()

    reader = gguf.GGUFReader(MODEL)
    rng = np.random.default_rng(SEED)
    w = Writer(OUT_DIR)
    real_vectors(w, reader)
    random_vectors(w, rng)
    kquant_vectors(w, rng)
    edge_vectors(w)
    newer_type_vectors(w, np.random.default_rng(SEED + 2))

    missing = set(TYPE_NAMES.values()) - {e["type"] for e in w.entries}
    assert not missing, missing

    manifest = {
        "generator": "tools/gen_ggml_vectors.py",
        "gguf": versions[0],
        "numpy": versions[1],
        "seed": SEED,
        "reference": "each <name>.f32 is gguf.quants.dequantize(<name>.bin, type) as"
        " little-endian float32 bytes; kernels must match bit for bit (NaN payloads"
        " included)",
        "vectors": w.entries,
    }
    (OUT_DIR / "manifest.json").write_text(dump_json(manifest, "vectors"))
    MODEL_JSON.write_text(dump_json(model_manifest(reader), "tensors"))

    total = sum(p.stat().st_size for p in OUT_DIR.iterdir())
    print(f"{len(w.entries)} vectors, {total} bytes in {OUT_DIR.relative_to(ROOT)}")
    print(f"{len(reader.tensors)} tensors in {MODEL_JSON.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
