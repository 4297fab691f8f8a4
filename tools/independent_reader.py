#!/usr/bin/env python3
"""Independent reader for the rknot file formats, written from docs/FORMAT.md only.

Formats: KNOT container (SK32 sketches, dense .knot), .rknot v2/v3, GGUF v2/v3.
Every tensor is served as little-endian f32, row-major over its served shape.

CLI:
  independent_reader.py list FILE [--dense DENSE]
  independent_reader.py cat FILE TENSOR [--dense DENSE] > out.bin
  independent_reader.py check FILE [--dense DENSE] --rknot-bin PATH
  independent_reader.py integrity FILE

Checksums (section 12): a file with a KSUM record is "checked"; its metadata CRC-32 is verified
at open and every tensor's stored bytes against its CRC-32s when the tensor is read. `integrity`
verifies every tensor's stored bytes without decoding them (exit 1 on any mismatch).
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import zlib

import numpy as np


class FormatError(Exception):
    pass


class ChecksumError(FormatError):
    """Section 12: a CRC-32 that disagrees with the bytes it covers, or a KSUM record and the
    tensors' checksum fields that disagree about whether the file is checked (`Checksum`)."""


# ---------------------------------------------------------------------------
# Section 10: tensor names
# ---------------------------------------------------------------------------

_SUFFIXES = ("weight", "bias", "scale", "scales")


def _alias(part: str) -> str:
    return "attn_output" if part == "attn_o" else part


def canonical_name(name: str) -> str:
    """Canonical dot name per FORMAT.md section 10 (steps 1-4)."""
    if "." in name:
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit():
            return f"blk.{parts[1]}.{_alias(parts[2])}.{parts[3]}"
        return name
    if name.startswith("blk_"):
        layer, sep, tail = name[4:].partition("_")
        if sep and layer.isascii() and layer.isdigit():
            part, sep2, suffix = tail.rpartition("_")
            if sep2 and part and suffix in _SUFFIXES:
                return f"blk.{layer}.{_alias(part)}.{suffix}"
        return name
    stem, sep, suffix = name.rpartition("_")
    if sep and stem and suffix in _SUFFIXES:
        return f"{stem}.{suffix}"
    return name


def _bad_char(c: str) -> bool:
    o = ord(c)
    return (c == "/" or o <= 0x1F or 0x7F <= o <= 0x9F or 0x202A <= o <= 0x202E
            or 0x2066 <= o <= 0x2069)


def check_name(name: str):
    """Section 10: non-empty, at most 240 bytes, not starting with '.', no '/', NUL, C0/C1
    controls, DEL or bidi overrides/isolates (a BadName error)."""
    if (not isinstance(name, str) or not name or len(name.encode()) > 240 or name.startswith(".")
            or any(_bad_char(c) for c in name)):
        raise FormatError(f"bad name: invalid tensor name {name!r}")


# ---------------------------------------------------------------------------
# Section 8: ggml block decoders (f32 arithmetic, in the order written)
# ---------------------------------------------------------------------------

def f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    """Exact binary16 -> binary32 widening from the bits (keeps NaN payloads)."""
    h = h.astype(np.uint32)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    out = np.zeros(h.shape, dtype=np.uint32)
    # normal
    normal = (exp != 0) & (exp != 31)
    out = np.where(normal, ((exp + 112) << 23) | (man << 13), out)
    # inf / nan
    infnan = exp == 31
    out = np.where(infnan, np.uint32(0x7F800000) | (man << 13), out)
    # subnormal: value = man * 2^-24, exact in f32
    sub = (exp == 0) & (man != 0)
    subval = (man.astype(np.float32) * np.float32(2.0 ** -24)).view(np.uint32)
    out = np.where(sub, subval, out)
    out = out | sign
    return out.astype(np.uint32).view(np.float32)


def _f16_field(blocks: np.ndarray, off: int) -> np.ndarray:
    """Read an f16 at byte offset `off` of every block (rows of a uint8 2-D array) -> f32 [nb, 1]."""
    h = blocks[:, off].astype(np.uint16) | (blocks[:, off + 1].astype(np.uint16) << 8)
    return f16_bits_to_f32(h)[:, None]


F32 = np.float32

GGML_TYPES = {
    # id: (name, block_elems, block_bytes)
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
}
OTHER_GGML_TYPES = {
    9: ("Q8_1", 32, 40), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """qs [nb,16] -> q [nb,32]: e<16 low nibble of qs[e], e>=16 high nibble of qs[e-16]."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32)


def _qh_bits32(qh_bytes: np.ndarray) -> np.ndarray:
    qh = (qh_bytes[:, 0].astype(np.uint32) | (qh_bytes[:, 1].astype(np.uint32) << 8)
          | (qh_bytes[:, 2].astype(np.uint32) << 16) | (qh_bytes[:, 3].astype(np.uint32) << 24))
    e = np.arange(32, dtype=np.uint32)
    return ((qh[:, None] >> e[None, :]) & 1).astype(np.int32)


def dec_q4_0(b):
    d = _f16_field(b, 0)
    q = _nibbles32(b[:, 2:18])
    return d * (q - 8).astype(F32)


def dec_q4_1(b):
    d = _f16_field(b, 0)
    m = _f16_field(b, 2)
    q = _nibbles32(b[:, 4:20])
    return d * q.astype(F32) + m


def dec_q5_0(b):
    d = _f16_field(b, 0)
    hb = _qh_bits32(b[:, 2:6])
    q = _nibbles32(b[:, 6:22]) | (hb << 4)
    return d * (q - 16).astype(F32)


def dec_q5_1(b):
    d = _f16_field(b, 0)
    m = _f16_field(b, 2)
    hb = _qh_bits32(b[:, 4:8])
    q = _nibbles32(b[:, 8:24]) | (hb << 4)
    return d * q.astype(F32) + m


def dec_q8_0(b):
    d = _f16_field(b, 0)
    qs = b[:, 2:34].view(np.int8).astype(F32)
    return qs * d


# index helpers for e = 128h + 32s + l
_E = np.arange(256)
_H = _E // 128
_S = (_E // 32) % 4
_L = _E % 32


def dec_q2_k(b):
    scales = b[:, 0:16].astype(np.int32)
    qs = b[:, 16:80].astype(np.int32)
    d = _f16_field(b, 80)
    dmin = _f16_field(b, 82)
    q = (qs[:, 32 * _H + _L] >> (2 * _S)) & 3
    sc = scales[:, _E // 16]
    return (d * (sc & 0xF).astype(F32)) * q.astype(F32) - (dmin * (sc >> 4).astype(F32))


def dec_q3_k(b):
    hmask = b[:, 0:32].astype(np.int32)
    qs = b[:, 32:96].astype(np.int32)
    scales = b[:, 96:108].astype(np.int32)
    d = _f16_field(b, 108)
    low = (qs[:, 32 * _H + _L] >> (2 * _S)) & 3
    hbit = (hmask[:, _L] >> (4 * _H + _S)) & 1
    q = low - 4 * (1 - hbit)
    i = np.arange(16)
    lo = (scales[:, i % 8] >> (4 * (i // 8))) & 0xF
    hi = (scales[:, 8 + i % 4] >> (2 * (i // 4))) & 3
    sc16 = (lo | (hi << 4)) - 32
    sc = sc16[:, _E // 16]
    return (d * sc.astype(F32)) * q.astype(F32)


def _k_scale_min(scales: np.ndarray):
    """scales [nb,12] int32 -> sc, m each [nb, 8]."""
    sc = np.empty((scales.shape[0], 8), dtype=np.int32)
    m = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[:, j] = scales[:, j] & 63
            m[:, j] = scales[:, j + 4] & 63
        else:
            sc[:, j] = (scales[:, j + 4] & 0xF) | ((scales[:, j - 4] >> 6) << 4)
            m[:, j] = (scales[:, j + 4] >> 4) | ((scales[:, j] >> 6) << 4)
    return sc, m


# e = 64c + 32k + l
_C = _E // 64
_K = (_E // 32) % 2
_J = _E // 32


def dec_q4_k(b):
    d = _f16_field(b, 0)
    dmin = _f16_field(b, 2)
    scales = b[:, 4:16].astype(np.int32)
    qs = b[:, 16:144].astype(np.int32)
    q = (qs[:, 32 * _C + _L] >> (4 * _K)) & 0xF
    sc, m = _k_scale_min(scales)
    return (d * sc[:, _J].astype(F32)) * q.astype(F32) - (dmin * m[:, _J].astype(F32))


def dec_q5_k(b):
    d = _f16_field(b, 0)
    dmin = _f16_field(b, 2)
    scales = b[:, 4:16].astype(np.int32)
    qh = b[:, 16:48].astype(np.int32)
    qs = b[:, 48:176].astype(np.int32)
    q = ((qs[:, 32 * _C + _L] >> (4 * _K)) & 0xF) | (((qh[:, _L] >> _J) & 1) << 4)
    sc, m = _k_scale_min(scales)
    return (d * sc[:, _J].astype(F32)) * q.astype(F32) - (dmin * m[:, _J].astype(F32))


def dec_q6_k(b):
    ql = b[:, 0:128].astype(np.int32)
    qh = b[:, 128:192].astype(np.int32)
    scales = b[:, 192:208].view(np.int8).astype(np.int32)
    d = _f16_field(b, 208)
    low4 = (ql[:, 64 * _H + 32 * (_S % 2) + _L] >> (4 * (_S // 2))) & 0xF
    high2 = (qh[:, 32 * _H + _L] >> (2 * _S)) & 3
    q = (low4 | (high2 << 4)) - 32
    return (d * scales[:, _E // 16].astype(F32)) * q.astype(F32)


# ggml types added in issue 23: i-quants, ternary, 4-bit floats. Layouts as ggml's block
# structs; the lattice grids are data that define the IQ formats, taken from gguf-py's tables
# (the only thing used from it; without gguf-py these types are listed as not decoded).

def _u16_at(b, off):
    return b[:, off].astype(np.uint32) | (b[:, off + 1].astype(np.uint32) << 8)


def _u32_at(b, off):
    return _u16_at(b, off) | (_u16_at(b, off + 2) << 16)


def _cols(b, offs):
    """b[:, offs] as int64 (offs: an index array, per element)."""
    return b[:, offs].astype(np.int64)


# 7 sign bits + an eighth that makes the count of set bits even.
_KSIGNS = np.array([k | ((bin(k).count("1") & 1) << 7) for k in range(128)], dtype=np.int64)
_PLUS_MINUS = np.array([1.0, -1.0], dtype=F32)
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=F32)
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=F32)
_GRIDS = {}


def _grid(name):
    if name not in _GRIDS:
        from gguf import quants
        cls = getattr(quants, name)
        cls.init_grid()
        _GRIDS[name] = np.asarray(cls.grid, dtype=F32).reshape(cls.grid_shape)
    return _GRIDS[name]


def _f16_col(bits):
    return f16_bits_to_f32(bits.astype(np.uint16))


def _iq2_scale(d, s):
    return d * (F32(0.5) + s.astype(F32)) * F32(0.25)


def dec_iq2_xxs(b):
    d = _f16_field(b, 0)
    g, l, j = _E // 32, (_E % 32) // 8, _E % 8
    aux = np.stack([_u32_at(b, 2 + 8 * i + 4) for i in range(8)], axis=1).astype(np.int64)[:, g]
    idx = _cols(b, 2 + 8 * g + l)
    neg = (_KSIGNS[(aux >> (7 * l)) & 127] >> j) & 1
    return _iq2_scale(d, aux >> 28) * _grid("IQ2_XXS")[idx, j] * _PLUS_MINUS[neg]


def dec_iq2_xs(b):
    d = _f16_field(b, 0)
    k, s, j = _E // 8, _E // 16, _E % 8
    q = np.stack([_u16_at(b, 2 + 2 * i) for i in range(32)], axis=1).astype(np.int64)[:, k]
    sc = (_cols(b, 66 + s // 2) >> (4 * (s % 2))) & 15
    neg = (_KSIGNS[q >> 9] >> j) & 1
    return _iq2_scale(d, sc) * _grid("IQ2_XS")[q & 511, j] * _PLUS_MINUS[neg]


def dec_iq2_s(b):
    d = _f16_field(b, 0)
    k, s, j = _E // 8, _E // 16, _E % 8
    idx = _cols(b, 2 + k) | (((_cols(b, 66 + k // 4) >> (2 * (k % 4))) & 3) << 8)
    neg = (_cols(b, 34 + k) >> j) & 1
    sc = (_cols(b, 74 + s // 2) >> (4 * (s % 2))) & 15
    return _iq2_scale(d, sc) * _grid("IQ2_S")[idx, j] * _PLUS_MINUS[neg]


def dec_iq3_xxs(b):
    d = _f16_field(b, 0)
    ib, l = _E // 32, (_E % 32) // 8
    aux = np.stack([_u32_at(b, 66 + 4 * i) for i in range(8)], axis=1).astype(np.int64)[:, ib]
    db = d * (F32(0.5) + (aux >> 28).astype(F32)) * F32(0.5)
    neg = (_KSIGNS[(aux >> (7 * l)) & 127] >> (_E % 8)) & 1
    return db * _grid("IQ3_XXS")[_cols(b, 2 + _E // 4), _E % 4] * _PLUS_MINUS[neg]


def dec_iq3_s(b):
    d = _f16_field(b, 0)
    k, ib = _E // 4, _E // 32
    idx = _cols(b, 2 + k) | (((_cols(b, 66 + k // 8) >> (k % 8)) & 1) << 8)
    neg = (_cols(b, 74 + _E // 8) >> (_E % 8)) & 1
    sc = (_cols(b, 106 + ib // 2) >> (4 * (ib % 2))) & 15
    db = d * (1 + 2 * sc).astype(F32)
    return db * _grid("IQ3_S")[idx, _E % 4] * _PLUS_MINUS[neg]


def _iq1(dl, idx, delta_neg):
    delta = np.where(delta_neg != 0, F32(-0.125), F32(0.125)).astype(F32)
    return dl * (_grid("IQ1_S")[idx, _E % 8] + delta)


def dec_iq1_s(b):
    d = _f16_field(b, 0)
    ib, l = _E // 32, (_E % 32) // 8
    qh = np.stack([_u16_at(b, 34 + 2 * i) for i in range(8)], axis=1).astype(np.int64)[:, ib]
    idx = _cols(b, 2 + 4 * ib + l) | (((qh >> (3 * l)) & 7) << 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).astype(F32)
    return _iq1(dl, idx, qh & 0x8000)


def dec_iq1_m(b):
    sc = [_u16_at(b, 48 + 2 * i) for i in range(4)]
    bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000)
    d = _f16_col(bits)[:, None]
    k, s = _E // 8, _E // 16
    scs = np.stack(sc, axis=1).astype(np.int64)[:, s // 4]
    dl = d * (2 * ((scs >> (3 * (s % 4))) & 7) + 1).astype(F32)
    nib = (_cols(b, 32 + k // 2) >> (4 * (k % 2))) & 15
    idx = _cols(b, k) | ((nib & 7) << 8)
    return _iq1(dl, idx, nib & 8)


_E32 = np.arange(32)


def dec_iq4_nl(b):
    d = _f16_field(b, 0)
    q = (_cols(b, 2 + _E32 % 16) >> (4 * (_E32 // 16))) & 15
    return d * _IQ4_VALUES[q]


def dec_iq4_xs(b):
    d = _f16_field(b, 0)
    ib = _E // 32
    low = (_cols(b, 4 + ib // 2) >> (4 * (ib % 2))) & 15
    high = (_u16_at(b, 2).astype(np.int64)[:, None] >> (2 * ib)) & 3
    dl = d * ((low | (high << 4)) - 32).astype(F32)
    q = (_cols(b, 8 + 16 * ib + _E % 16) >> (4 * ((_E % 32) // 16))) & 15
    return dl * _IQ4_VALUES[q]


# TQ1_0: element e is base-3 digit n of byte `byte` (digit read as the top after * 3^n mod 256).
_TQ1_BYTE = np.concatenate([_E[:160] % 32, 32 + (_E[160:240] - 160) % 16, 48 + (_E[240:] - 240) % 4])
_TQ1_DIGIT = np.concatenate([_E[:160] // 32, (_E[160:240] - 160) // 16, (_E[240:] - 240) // 4])


def dec_tq1_0(b):
    d = _f16_field(b, 52)
    q = (_cols(b, _TQ1_BYTE) * (3 ** _TQ1_DIGIT)) & 255
    return d * (((q * 3) >> 8) - 1).astype(F32)


def dec_tq2_0(b):
    d = _f16_field(b, 64)
    q = (_cols(b, 32 * (_E // 128) + _E % 32) >> (2 * ((_E % 128) // 32))) & 3
    return d * (q - 1).astype(F32)


def dec_mxfp4(b):
    e = b[:, 0].astype(np.uint32)
    # Half of 2^(e - 127): 2^(e - 128), built from its bits (subnormal for e < 2).
    d = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    d = d.view(np.float32)[:, None]
    q = (_cols(b, 1 + _E32 % 16) >> (4 * (_E32 // 16))) & 15
    return d * _E2M1_DOUBLED[q]


_E64 = np.arange(64)


def dec_nvfp4(b):
    x = _cols(b, _E64 // 16)
    exp, man = (x >> 3) & 15, x & 7
    # Half the unsigned E4M3 scale; 0x00 and 0x7f (its NaN) read as 0; exact in float32.
    half = np.where(exp == 0, man * 2.0 ** -10, (8 + man) * np.exp2(exp - 11.0))
    d = np.where((x == 0) | (x == 0x7F), 0.0, half).astype(F32)
    q = (_cols(b, 4 + 8 * (_E64 // 16) + _E64 % 8) >> (4 * ((_E64 % 16) // 8))) & 15
    return d * _E2M1_DOUBLED[q]


BLOCK_DECODERS = {2: dec_q4_0, 3: dec_q4_1, 6: dec_q5_0, 7: dec_q5_1, 8: dec_q8_0,
                  10: dec_q2_k, 11: dec_q3_k, 12: dec_q4_k, 13: dec_q5_k, 14: dec_q6_k,
                  20: dec_iq4_nl, 23: dec_iq4_xs, 34: dec_tq1_0, 35: dec_tq2_0, 39: dec_mxfp4,
                  40: dec_nvfp4}
# The lattice types need gguf-py's grids.
_GRID_DECODERS = {16: dec_iq2_xxs, 17: dec_iq2_xs, 18: dec_iq3_xxs, 19: dec_iq1_s, 21: dec_iq3_s,
                  22: dec_iq2_s, 29: dec_iq1_m}
try:
    import gguf.quants  # noqa: F401
    BLOCK_DECODERS.update(_GRID_DECODERS)
except ImportError:
    pass
for _tid in list(OTHER_GGML_TYPES):
    if _tid in BLOCK_DECODERS:
        GGML_TYPES[_tid] = OTHER_GGML_TYPES.pop(_tid)
NAME_TO_ID = {v[0].lower(): k for k, v in GGML_TYPES.items()}


def decode_ggml(type_id: int, raw: bytes, n: int) -> np.ndarray:
    """Decode n elements of ggml type `type_id` -> flat f32 array."""
    name, be, bb = GGML_TYPES[type_id]
    if n % be:
        raise FormatError(f"{n} elements not a multiple of block size {be}")
    need = n // be * bb
    if len(raw) != need:
        raise FormatError(f"{name}: {len(raw)} bytes, expected {need}")
    if type_id == 0:
        return np.frombuffer(raw, dtype="<f4").astype(F32)
    if type_id == 1:
        return f16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
    if type_id == 30:
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, bb)
    with np.errstate(all="ignore"):
        out = BLOCK_DECODERS[type_id](blocks)
    assert out.dtype == F32, (name, out.dtype)
    return out.reshape(-1)


# ---------------------------------------------------------------------------
# Tensor handles
# ---------------------------------------------------------------------------

class Tensor:
    def __init__(self, name, shape, loader, kind, stored_name=None, unavailable=None, lossy=False):
        self.name = name            # canonical dot name
        self.shape = list(shape)    # served shape, outer first
        self.loader = loader        # () -> flat np.float32 array
        self.kind = kind            # "exact" or "sk32"
        self.stored_name = stored_name or name
        self.unavailable = unavailable
        # lossy-encoded (an SK32 sketch or .rknot blocks), as opposed to ggml blocks (GGUF, dense
        # .knot, a .rknot's dense_tensors): the vocab-table rule of section 10 applies to these only
        self.lossy = lossy
        self.extra = {}
        self.sums = None            # StoredSums in a checked file (section 12), else None

    def data(self) -> np.ndarray:
        if self.unavailable:
            raise FormatError(f"tensor {self.name} unavailable: {self.unavailable}")
        if self.sums is not None:
            # Section 12: every chunk / block group a read touches is verified before anything
            # in it is decoded; this reader reads the whole tensor, so all of them.
            self.sums.verify(self.stored_name)
        arr = self.loader()
        n = math.prod(self.shape)
        if arr.size != n:
            raise FormatError(f"tensor {self.name}: decoded {arr.size} values, expected {n}")
        return arr

    def served_bytes(self) -> bytes:
        return self.data().astype("<f4").tobytes()


class TensorMap(dict):
    """canonical dot name -> Tensor, plus an index of the underscore spellings (for _add).
    `checked`: the file has a KSUM record (section 12); `no_sums`: why a format has no place
    for checksums (GGUF, .rknot version 2), else None."""

    def __init__(self):
        super().__init__()
        self.under = {}
        self.checked = False
        self.no_sums = None


def _add(tensors: TensorMap, t: Tensor, path: str):
    """Register a tensor; two stored tensors whose resolved names agree in either spelling
    (dot or underscore) are an error (section 10)."""
    try:
        check_name(t.stored_name)
    except FormatError as ex:
        raise FormatError(f"{path}: {ex}")
    under = t.name.replace(".", "_")
    other = tensors.get(t.name) or tensors.under.get(under)
    if other is not None:
        raise FormatError(f"{path}: tensors {other.stored_name!r} and {t.stored_name!r} "
                          f"both resolve to {t.name} / {under}")
    tensors[t.name] = t
    tensors.under[under] = t


class _JObj(dict):
    """A JSON object; `dups` holds the keys given more than once (the last value counts)."""
    dups = ()


def _pairs(pairs):
    obj = _JObj()
    dups = []
    for k, v in pairs:
        if k in obj:
            dups.append(k)
        obj[k] = v
    if dups:
        obj.dups = dups
    return obj


def _loads(text: str):
    """json.loads that remembers duplicate keys: section 1 makes a key given twice in a tensor
    map (`sketches`, `tensors`, and `dense_tensors`, "exactly like" `tensors`) two tensors of
    one name, a BadName error, while for other fields the last one counts."""
    return json.loads(text, object_pairs_hook=_pairs)


def _tensor_map(path, obj, key):
    """The `name -> entry` object `obj[key]`; duplicate names are a BadName error."""
    m = obj[key]
    if not isinstance(m, dict):
        raise FormatError(f"{path}: {key} must be a JSON object, got {type(m).__name__}")
    for k in getattr(m, "dups", ()):
        raise FormatError(f"{path}: bad name: tensor {k!r} listed twice in {key}")
    return m


def _nonneg_int(v, what):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise FormatError(f"{what} must be a non-negative integer, got {v!r}")
    return v


# ---------------------------------------------------------------------------
# Section 12: checksums
# ---------------------------------------------------------------------------

KSUM_TAG = b"KSUM"
KSUM_LEN = 8
MAX_CHUNK = 1 << 26            # crc32.chunk: 1..=2^26 (64 MiB)
MAX_CHUNK_VALUES = 1 << 24     # crc32.values: more is TooLarge
MAX_GROUP_BYTES = 16 << 20     # a .rknot block group: at most 16 MiB


def _ksum(path, buf, at, covered):
    """Section 12.1: the KSUM record at absolute `at`, if the 8 bytes there end in the tag. Its
    CRC-32 must be that of the byte ranges `covered` (absolute (start, end), concatenated in
    order): else the file is refused. Returns `at` for a checked file, None for an unchecked one."""
    if bytes(buf[at + 4:at + 8]) != KSUM_TAG:
        return None
    (stored,) = struct.unpack_from("<I", buf, at)
    actual = 0
    for a, b in covered:
        actual = zlib.crc32(memoryview(buf)[a:b], actual)
    if actual != stored:
        spans = " + ".join(f"[{a}, {b})" for a, b in covered if b > a)
        raise ChecksumError(f"{path}: checksum: at byte {at}: the file's metadata (bytes {spans}) "
                            f"has CRC-32 {actual:08x}; its KSUM record says {stored:08x}: the "
                            f"header or index is damaged")
    return at


class StoredSums:
    """One tensor's checksums (sections 12.2, 12.3): value i is the CRC-32 of file bytes
    spans[i] = (absolute start, absolute end). `unit` is "chunk" or "group"; `groups` holds the
    block range [g0, g1) of each group."""

    def __init__(self, path, buf, unit, spans, values, groups=None):
        self.path, self.buf, self.unit = path, buf, unit
        self.spans, self.values, self.groups = spans, values, groups

    def label(self, i):
        if self.unit == "group":
            g0, g1 = self.groups[i]
            return f"group {i} (blocks [{g0}, {g1}))"
        return f"chunk {i}"

    def mismatches(self):
        """(i, start, end, recorded, actual) for every value that disagrees with its bytes."""
        mv = memoryview(self.buf)
        for i, ((a, b), v) in enumerate(zip(self.spans, self.values)):
            actual = zlib.crc32(mv[a:b])
            if actual != v:
                yield i, a, b, v, actual

    def message(self, tensor, i, a, b, stored, actual):
        return (f"{self.path}: tensor {tensor}: checksum: at byte {a}: {self.label(i)} ({b - a} "
                f"bytes) has CRC-32 {actual:08x}, the file records {stored:08x}: the stored "
                f"bytes are damaged")

    def verify(self, tensor):
        for m in self.mismatches():
            raise ChecksumError(self.message(tensor, *m))

    def n_bytes(self):
        return sum(b - a for a, b in self.spans)


def _presence(path, what, has_field, checked, field):
    """Section 12.1: in a checked file every tensor has its checksum field, in an unchecked one
    none does; either mismatch is a Checksum error at open."""
    if has_field == checked:
        return
    if checked:
        raise ChecksumError(f"{path}: {what}: checksum: the file has a KSUM record but the tensor "
                            f"has no {field} field: the file is damaged")
    raise ChecksumError(f"{path}: {what}: checksum: the tensor has a {field} field but the file "
                        f"has no KSUM record (its end is damaged or cut)")


def _chunk_sums(path, what, e, checked, buf, start, length):
    """Section 12.3: an entry's `crc32` {"chunk": C, "values": [...]} over its `length` stored
    bytes at absolute `start` -> StoredSums, or None in an unchecked file."""
    _presence(path, what, "crc32" in e, checked, "crc32")
    if not checked:
        return None
    where = f"{path}: {what}: crc32"
    c = e["crc32"]
    if not isinstance(c, dict) or "chunk" not in c or "values" not in c:
        raise FormatError(f"{where} must be an object with \"chunk\" and \"values\", got {c!r}")
    chunk = _nonneg_int(c["chunk"], f"{where}: chunk")
    if not 1 <= chunk <= MAX_CHUNK:
        raise FormatError(f"{where}: chunk {chunk} must be in 1..={MAX_CHUNK}")
    values = c["values"]
    if not isinstance(values, list):
        raise FormatError(f"{where}: values must be an array, got {values!r}")
    if len(values) > MAX_CHUNK_VALUES:
        raise FormatError(f"{where}: too large: {len(values)} values, more than 2^24")
    for v in values:
        if _nonneg_int(v, f"{where}: value") >= 1 << 32:
            raise FormatError(f"{where}: value {v} is not below 2^32")
    want = -(-length // chunk)
    if len(values) != want:
        raise FormatError(f"{where}: length mismatch: {len(values)} values; {length} stored bytes "
                          f"in chunks of {chunk} need {want}")
    spans = [(start + i * chunk, start + min(length, (i + 1) * chunk)) for i in range(want)]
    return StoredSums(path, buf, "chunk", spans, values)


def _group_sums(path, what, te, checked, buf, index, index_offset, claimed, body, blocks):
    """Section 12.2: a version-3 tensor's `block_crc32` {"at": A, "group": G} -> StoredSums
    over its blocks (body-relative (offset, length) each, back to back), or None in an
    unchecked file. `claimed` ([int]) counts the index bytes the tensors take (section 6.5)."""
    _presence(path, what, "block_crc32" in te, checked, "block_crc32")
    if not checked:
        return None
    where = f"{path}: {what}: block_crc32"
    bc = te["block_crc32"]
    if not isinstance(bc, dict) or "at" not in bc or "group" not in bc:
        raise FormatError(f"{where} must be an object with \"at\" and \"group\", got {bc!r}")
    at = _u64(bc["at"], f"{where}: at")
    group = _u64(bc["group"], f"{where}: group")
    if group < 1:
        raise FormatError(f"{where}: group {group} must be at least 1")
    n = len(blocks)
    ng = -(-n // group)
    nbytes = 4 * ng
    if at + nbytes > len(index):
        raise FormatError(f"{where}: its {ng} CRC-32s ({n} blocks in groups of {group}) take index "
                          f"bytes [{at}, {at + nbytes}) (file bytes [{index_offset + at}, "
                          f"{index_offset + at + nbytes})), past the end of the {len(index)}-byte "
                          f"block index")
    claimed[0] += nbytes
    if nbytes:
        claimed[1].append((at, at + nbytes, f"{what}'s block_crc32"))
    if claimed[0] > len(index):
        raise FormatError(f"{where}: at byte {index_offset + at}: the tensors' length codes and "
                          f"CRC-32s so far take {claimed[0]} index bytes; the index has "
                          f"{len(index)} (ranges may not be shared)")
    values = list(struct.unpack_from(f"<{ng}I", index, at))
    spans, groups = [], []
    for g in range(ng):
        g0, g1 = g * group, min(n, g * group + group)
        a = body + blocks[g0][0]
        b = body + blocks[g1 - 1][0] + blocks[g1 - 1][1]
        if b - a > MAX_GROUP_BYTES:
            raise FormatError(f"{where}: too large: group {g} (blocks [{g0}, {g1})) is {b - a} "
                              f"bytes, above the {MAX_GROUP_BYTES}-byte cap")
        spans.append((a, b))
        groups.append((g0, g1))
    return StoredSums(path, buf, "group", spans, values, groups)


# ---------------------------------------------------------------------------
# Section 3-5: KNOT container, SK32, dense .knot
# ---------------------------------------------------------------------------

def open_knot(path: str, buf: bytes):
    if len(buf) < 10:
        raise FormatError(f"{path}: truncated KNOT header")
    version, meta_len = struct.unpack_from("<HI", buf, 4)
    if version != 1:
        raise FormatError(f"{path}: KNOT version {version} unsupported")
    if meta_len > 1 << 30:
        raise FormatError(f"{path}: meta_len {meta_len} over 1 GiB cap")
    if 10 + meta_len > len(buf):
        raise FormatError(f"{path}: meta JSON past end of file")
    codec_at = (10 + meta_len + 3) & ~3
    base = codec_at + 1
    # Section 12.1: a KSUM record in the last 8 bytes (a file of at least payload_base + 8
    # bytes) covers bytes [0, payload_base); it is checked before the meta JSON is parsed.
    ksum_at = (_ksum(path, buf, len(buf) - KSUM_LEN, [(0, base)])
               if len(buf) >= base + KSUM_LEN else None)
    meta = _loads(buf[10:10 + meta_len].decode("utf-8"))
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: meta JSON is not an object")
    if codec_at >= len(buf):
        raise FormatError(f"{path}: missing codec byte")
    if buf[codec_at] != 0:
        raise FormatError(f"{path}: unsupported codec byte {buf[codec_at]}")
    has_s, has_t = "sketches" in meta, "tensors" in meta
    if has_s == has_t:
        raise FormatError(f"{path}: meta must have exactly one of 'sketches' / 'tensors'")
    if has_s:
        return "sk32", open_sk32(path, buf, meta, base, ksum_at)
    return "knot", open_dense_knot(path, buf, meta, base, ksum_at)


def _check_ranges(path, ranges, limit, ksum_at=None):
    ranges = sorted(r for r in ranges if r[1] > 0)
    end, last = -1, None   # furthest end so far, and whose it is
    for a, l, n in ranges:
        if a < end:
            raise FormatError(f"{path}: {last} overlaps {n} (at byte {a})")
        if a + l > end:
            end, last = a + l, n
    for a, l, n in ranges:
        if a + l > limit:
            if ksum_at is not None:
                # section 12.1: the record's 8 bytes belong to no tensor (OutOfBounds)
                raise FormatError(f"{path}: {n} range [{a}, {a + l}) runs into the KSUM record "
                                  f"at byte {ksum_at} (the data ends there)")
            raise FormatError(f"{path}: {n} range [{a}, {a + l}) past end {limit}")


def open_sk32(path, buf, meta, base, ksum_at=None):
    if "format" in meta and meta["format"] != "sk32":
        raise FormatError(f"{path}: format {meta['format']!r} is not sk32")
    tensors = TensorMap()
    tensors.checked = ksum_at is not None
    ranges = []
    for stored, e in _tensor_map(path, meta, "sketches").items():
        off = _nonneg_int(e["offset"], "offset")
        length = _nonneg_int(e["length"], "length")
        d_out = _nonneg_int(e["d_out"], "d_out")
        d_in = _nonneg_int(e["d_in"], "d_in")
        rank = _nonneg_int(e["rank"], "rank")
        if d_out < 1 or d_in < 1:
            raise FormatError(f"{path}: tensor {stored}: empty shape")
        if not 1 <= rank <= min(d_out, d_in):
            raise FormatError(f"{path}: tensor {stored}: rank {rank} out of range")
        if length != d_out * rank + rank + rank * d_in:
            raise FormatError(f"{path}: tensor {stored}: length {length} mismatch")
        scales = {}
        for k in ("u_max", "sigma_max", "v_max"):
            v = e[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise FormatError(f"{path}: tensor {stored}: {k} not a number")
            f = np.float32(v) if abs(float(v)) < 3.5e38 else np.float32(np.inf)
            if not np.isfinite(f) or f < 0:
                raise FormatError(f"{path}: tensor {stored}: {k} {v} not finite/non-negative")
            scales[k] = float(v)
        ranges.append((base + off, length, stored))
        # the sketch's stored bytes: u_q8 | sigma_q8 | v_q8
        sums = _chunk_sums(path, f"tensor {stored}", e, tensors.checked, buf, base + off, length)

        aux = {}

        def loader(start=base + off, d_out=d_out, d_in=d_in, rank=rank, s=scales, aux=aux):
            raw = np.frombuffer(buf, dtype=np.uint8, count=length_of(d_out, d_in, rank), offset=start)
            uq = raw[:d_out * rank].reshape(d_out, rank).astype(np.float64)
            sq = raw[d_out * rank:d_out * rank + rank].astype(np.float64)
            vq = raw[d_out * rank + rank:].reshape(rank, d_in).astype(np.float64)
            U = ((uq - 128) / 127) * s["u_max"]
            S = (sq / 255) * s["sigma_max"]
            V = ((vq - 128) / 127) * s["v_max"]
            US = U * S[None, :]
            W = US @ V
            mag = np.abs(US) @ np.abs(V)
            aux["mag"] = mag.reshape(-1)
            return W.reshape(-1)  # f64; compared with tolerance

        name = canonical_name(stored)
        t = Tensor(name, [d_out, d_in], loader, "sk32", stored, lossy=True)
        t.extra["rank"] = rank
        t.extra["aux"] = aux
        t.sums = sums
        _add(tensors, t, path)
    _check_ranges(path, ranges, len(buf) if ksum_at is None else ksum_at, ksum_at)
    return tensors


def length_of(d_out, d_in, rank):
    return d_out * rank + rank + rank * d_in


def parse_type(s: str) -> int:
    if not isinstance(s, str):
        raise FormatError(f"type must be a string, got {s!r}")
    s = s.lower()
    if s in ("q4_k_m", "q4_k_s"):
        s = "q4_k"
    if s not in NAME_TO_ID:
        raise FormatError(f"unknown type {s!r}")
    return NAME_TO_ID[s]


def parse_dense_entry(path, stored, e):
    """A `name -> entry` value of a dense .knot's `tensors` or a .rknot's `dense_tensors`
    (sections 5, 6.6): {"type", "shape", "offset", "length"} -> (type id, shape, n, offset,
    length), with type, shape and length checked."""
    where = f"{path}: tensor {stored}"
    if not isinstance(e, dict):
        raise FormatError(f"{where}: entry must be a JSON object, got {e!r}")
    try:
        tid = parse_type(e["type"])
    except FormatError as ex:
        raise FormatError(f"{where}: {ex}")
    shape = e["shape"]
    if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
        raise FormatError(f"{where}: shape must be 1 to 4 dims, got {shape!r}")
    shape = [_nonneg_int(x, f"{where}: dim") for x in shape]
    if min(shape) < 1:
        raise FormatError(f"{where}: bad shape {shape} (every dim must be >= 1)")
    name, be, bb = GGML_TYPES[tid]
    if shape[-1] % be:
        raise FormatError(f"{where}: last dim {shape[-1]} of shape {shape} is not a multiple of "
                          f"the {name} block size {be}")
    n = math.prod(shape)
    if n >= 1 << 64:
        raise FormatError(f"{where}: shape {shape} has more than 2^64 elements")
    off = _u64(e["offset"], f"{where}: offset")
    length = _u64(e["length"], f"{where}: length")
    if length != n // be * bb:
        raise FormatError(f"{where}: length {length} != {n // be * bb}, the bytes of {n} "
                          f"{name} values (shape {shape})")
    return tid, shape, n, off, length


def open_dense_knot(path, buf, meta, base, ksum_at=None):
    if "format" in meta and meta["format"] != "knot":
        raise FormatError(f"{path}: format {meta['format']!r} is not knot")
    tensors = TensorMap()
    tensors.checked = ksum_at is not None
    ranges = []
    for stored, e in _tensor_map(path, meta, "tensors").items():
        tid, shape, n, off, length = parse_dense_entry(path, stored, e)
        ranges.append((base + off, length, stored))
        sums = _chunk_sums(path, f"tensor {stored}", e, tensors.checked, buf, base + off, length)

        def loader(tid=tid, a=base + off, length=length, n=n):
            return decode_ggml(tid, buf[a:a + length], n)

        t = Tensor(canonical_name(stored), shape, loader, "exact", stored)
        t.sums = sums
        _add(tensors, t, path)
    _check_ranges(path, ranges, len(buf) if ksum_at is None else ksum_at, ksum_at)
    return tensors


# ---------------------------------------------------------------------------
# Section 6: .rknot
# ---------------------------------------------------------------------------

def unpack_codes(payload: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """LSB-first bit stream -> unsigned codes of the given widths (all >= 1), in order."""
    if widths.size == 0:
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(payload, bitorder="little").astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    wmax = int(widths.max())
    k = np.arange(wmax)
    idx = starts[:, None] + k[None, :]
    mask = k[None, :] < widths[:, None]
    idx = np.where(mask, idx, 0)
    vals = np.where(mask, bits[idx], 0)
    return (vals << k[None, :]).sum(axis=1)


LOSSLESS_MODES = {"lossless_bf16": 1, "lossless_f16": 1, "lossless_f32": 3}  # mode -> raw bytes R


def _lossless_words(sym: np.ndarray, raw: np.ndarray, mode: str) -> np.ndarray:
    """Section 6.7's table: the word of each symbol and raw part (uint32)."""
    y = sym.astype(np.uint32)
    if mode == "lossless_f32":
        r = raw[:, 0].astype(np.uint32) | (raw[:, 1].astype(np.uint32) << 8) \
            | (raw[:, 2].astype(np.uint32) << 16)
        return ((r & 0x800000) << 8) | (y << 23) | (r & 0x7FFFFF)
    r = raw[:, 0].astype(np.uint32)
    if mode == "lossless_bf16":
        return ((r & 0x80) << 8) | (y << 7) | (r & 0x7F)
    return (y << 8) | r


def _widen_f16_bits(h: np.ndarray) -> np.ndarray:
    """Section 6.7: f16 words -> f32 bits, exactly; NaNs keep sign, payload and quiet bit."""
    return f16_bits_to_f32(h.astype(np.uint16)).view(np.uint32)


def decode_lossless_block(payload: bytes, n: int, mode: str) -> np.ndarray:
    """Section 6.7: a lossless block of n values -> their f32 bits (uint32)."""
    R = LOSSLESS_MODES[mode]
    p = np.frombuffer(payload, dtype=np.uint8)
    if len(p) == 0:
        raise FormatError("empty lossless block")
    if p[0] == 1:
        if len(p) != 2 + n * R:
            raise FormatError(f"constant lossless block length {len(p)} != {2 + n * R}")
        sym = np.full(n, p[1], dtype=np.uint32)
        raw = p[2:].reshape(n, R)
    elif p[0] == 0:
        if len(p) < 145:
            raise FormatError("coded lossless block shorter than its header")
        nib = np.empty(256, dtype=np.int64)
        nib[0::2] = p[1:129] & 0xF
        nib[1::2] = p[1:129] >> 4
        if (nib > 12).any():
            raise FormatError(f"code length {int(nib.max())} > 12")
        used = nib > 0
        kraft = int((np.int64(1) << (12 - nib[used])).sum())
        if used.sum() < 2 or kraft != 4096:
            raise FormatError(f"code lengths not a complete prefix code (Kraft {kraft}/4096, "
                              f"{int(used.sum())} symbols)")
        lens = list(struct.unpack_from("<4I", payload, 129))
        if len(p) != 145 + sum(lens) + n * R:
            raise FormatError(f"lossless block length {len(p)} != {145 + sum(lens) + n * R}")
        # RFC 1951 3.2.2 canonical codes; decode MSB-first codes from an LSB-first stream by
        # reading one bit at a time and matching (length, code) pairs.
        count = [int((nib == l).sum()) for l in range(16)]
        count[0] = 0
        nxt, code = [0] * 16, 0
        for l in range(1, 16):
            code = (code + count[l - 1]) << 1
            nxt[l] = code
        lookup = {}
        for y in range(256):
            l = int(nib[y])
            if l:
                lookup[(l, nxt[l])] = y
                nxt[l] += 1
        sym = np.zeros(n, dtype=np.uint32)
        at = 145
        for j in range(4):
            bits = np.unpackbits(p[at:at + lens[j]], bitorder="little").tolist()
            pos = 0
            for i in range(j, n, 4):
                c, l = 0, 0
                while (l, c) not in lookup:
                    if l >= 12 or pos >= len(bits):
                        raise FormatError(f"stream {j}: codes run past its {lens[j]} bytes")
                    c = (c << 1) | bits[pos]
                    pos += 1
                    l += 1
                sym[i] = lookup[(l, c)]
            if (pos + 7) // 8 != lens[j]:
                raise FormatError(f"stream {j} is {lens[j]} bytes, its codes take {pos} bits")
            at += lens[j]
        raw = p[at:].reshape(n, R)
    else:
        raise FormatError(f"lossless block kind {int(p[0])} is not 0 or 1")
    words = _lossless_words(sym, raw, mode)
    if mode == "lossless_bf16":
        return (words << 16).astype(np.uint32)
    if mode == "lossless_f16":
        return _widen_f16_bits(words)
    return words


def decode_rknot_block(payload: bytes, tr: int, tc: int, mode: str, bits: int, line_axis):
    if mode in LOSSLESS_MODES:
        return decode_lossless_block(payload, tr * tc, mode).view(F32).reshape(tr, tc)
    if len(payload) < 4:
        raise FormatError("block shorter than its scale")
    if mode == "affine":
        # Section 6.3: f16 scale, f16 offset, `bits`-bit codes; code*scale then +offset, each
        # rounded to f32 (numpy float32 arithmetic: two roundings, no fused multiply-add).
        scale, offset = np.frombuffer(payload, dtype="<f2", count=2).astype(F32)
        if not (np.isfinite(scale) and np.isfinite(offset)):
            raise FormatError(f"non-finite affine block scale {scale} / offset {offset}")
        need = 4 + (tr * tc * bits + 7) // 8
        if len(payload) != need:
            raise FormatError(f"affine block length {len(payload)} != {need}")
        p = np.frombuffer(payload, dtype=np.uint8)
        codes = unpack_codes(p[4:], np.full(tr * tc, bits, dtype=np.int64))
        prod = codes.astype(F32) * scale
        return (prod + offset).astype(F32).reshape(tr, tc)
    scale = np.frombuffer(payload, dtype="<f4", count=1)[0]
    if not np.isfinite(scale):
        raise FormatError(f"non-finite block scale {scale}")
    p = np.frombuffer(payload, dtype=np.uint8)
    if mode == "uniform":
        need = 4 + (tr * tc * bits + 7) // 8
        if len(payload) != need:
            raise FormatError(f"uniform block length {len(payload)} != {need}")
        w = np.full(tr * tc, bits, dtype=np.int64)
        codes = unpack_codes(p[4:], w)
        vals = (codes - (1 << (bits - 1))).astype(F32) * scale
        return vals.reshape(tr, tc)
    # graded
    lines = tr if line_axis == "rows" else tc
    if len(payload) < 4 + lines:
        raise FormatError("graded block shorter than its width table")
    wt = p[4:4 + lines].astype(np.int64)
    if (wt > bits).any():
        raise FormatError(f"graded width {int(wt.max())} > bits {bits}")
    line_len = tc if line_axis == "rows" else tr
    need = 4 + lines + (int(wt.sum()) * line_len + 7) // 8
    if len(payload) != need:
        raise FormatError(f"graded block length {len(payload)} != {need}")
    if line_axis == "rows":
        wfull = np.repeat(wt[:, None], tc, axis=1)
    else:
        wfull = np.repeat(wt[None, :], tr, axis=0)
    wflat = wfull.reshape(-1)
    keep = wflat > 0
    codes = unpack_codes(p[4 + lines:], wflat[keep])
    out = np.zeros(tr * tc, dtype=F32)
    wk = wflat[keep]
    centered = codes - (np.int64(1) << (wk - 1))
    out[keep] = centered.astype(F32) * scale
    return out.reshape(tr, tc)


# Limits of section 11.1 that the .rknot reader applies.
RKNOT_V2_HEADER_CAP = 1 << 30      # version 2 header_len
RKNOT_V3_HEADER_CAP = 128 << 20    # version 3 header_len
RKNOT_V3_INDEX_CAP = 2 << 30       # version 3 index_len
MAX_TENSORS = 65536                # .rknot tensors of all layers
MAX_LAYERS = 65536
RKNOT_END = b"RKNOTEND"


def _rknot_container(path, buf):
    """Section 6 layouts. Returns (header dict, version, body_offset, body_len, index, index_offset,
    ksum_at); index (bytes) and index_offset are None for version 2; ksum_at is the absolute
    offset of a version-3 file's KSUM record (section 12.1), which body_len then leaves out, or
    None."""
    if len(buf) < 6:
        raise FormatError(f"{path}: truncated .rknot magic")
    version = buf[5]
    if version == 2:
        if len(buf) < 10:
            raise FormatError(f"{path}: truncated .rknot header")
        (hlen,) = struct.unpack_from("<I", buf, 6)
        if hlen > RKNOT_V2_HEADER_CAP:
            raise FormatError(f"{path}: too large: header_len {hlen} over the version-2 cap "
                              f"{RKNOT_V2_HEADER_CAP} (1 GiB)")
        if 10 + hlen > len(buf):
            raise FormatError(f"{path}: header_len {hlen} runs past the end of the file "
                              f"({len(buf)} bytes)")
        hdr_bytes = buf[10:10 + hlen]
        body, body_len = 10 + hlen, len(buf) - (10 + hlen)
        index = index_offset = ksum_at = None
    elif version == 3:
        n = len(buf)
        if n < 32:
            raise FormatError(f"{path}: version-3 .rknot of {n} bytes, shorter than the 32 bytes "
                              f"of magic, pad and footer")
        if buf[6:8] != b"\0\0":
            raise FormatError(f"{path}: at byte 6: pad bytes {list(buf[6:8])} must be [0, 0]")
        if buf[n - 8:] != RKNOT_END:
            raise FormatError(f"{path}: at byte {n - 8}: footer magic {bytes(buf[n - 8:])!r} is not "
                              f"{RKNOT_END!r} (file cut short or never finished?)")
        index_len, header_len = struct.unpack_from("<QQ", buf, n - 24)
        if header_len > RKNOT_V3_HEADER_CAP:
            raise FormatError(f"{path}: too large: header_len {header_len} over the version-3 cap "
                              f"{RKNOT_V3_HEADER_CAP} (128 MiB)")
        if index_len > RKNOT_V3_INDEX_CAP:
            raise FormatError(f"{path}: too large: index_len {index_len} over the cap "
                              f"{RKNOT_V3_INDEX_CAP} (2 GiB)")
        if 8 + index_len + header_len > n - 24:
            raise FormatError(f"{path}: index_len {index_len} + header_len {header_len} do not fit "
                              f"between byte 8 and the footer at byte {n - 24}")
        header_offset = n - 24 - header_len
        index_offset = header_offset - index_len
        hdr_bytes = buf[header_offset:n - 24]
        index = buf[index_offset:header_offset]
        body, body_len = 8, index_offset - 8
        # Section 12.1: a KSUM record in the body's last 8 bytes (a body of at least 8 bytes)
        # covers [0, 8) + [index_offset, file_len); checked before the header is parsed. Its
        # bytes belong to no tensor: the tensors' body ends before it.
        ksum_at = None
        if body_len >= KSUM_LEN:
            ksum_at = _ksum(path, buf, index_offset - KSUM_LEN, [(0, 8), (index_offset, n)])
        if ksum_at is not None:
            body_len -= KSUM_LEN
    else:
        raise FormatError(f"{path}: unsupported .rknot version {version} (magic "
                          f"{bytes(buf[:6])!r}; this reader knows 2 and 3)")
    hdr = _loads(hdr_bytes.decode("utf-8"))
    if not isinstance(hdr, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    if "format" in hdr and hdr["format"] != "rknot":
        raise FormatError(f"{path}: format {hdr['format']!r} is not 'rknot'")
    if "version" in hdr and (isinstance(hdr["version"], bool) or hdr["version"] != version):
        raise FormatError(f"{path}: header version {hdr['version']!r} disagrees with the magic "
                          f"(version {version})")
    return hdr, version, body, body_len, index, index_offset, ksum_at


def _tile_dims(R, C, BR, BC, CT, n):
    """Section 6.2: rows and columns of every tile, in block order (int64 arrays)."""
    b = np.arange(n, dtype=np.int64)
    rt, ct = b // CT, b % CT
    tr = np.minimum(R, rt * BR + BR) - rt * BR
    tc = np.minimum(C, ct * BC + BC) - ct * BC
    return tr, tc


def _length_bounds(tr, tc, mode, bits, line_axis):
    """Section 6.3, checked at open: [lo, hi] of a valid block length per tile."""
    if mode in LOSSLESS_MODES:
        n, R = tr * tc, LOSSLESS_MODES[mode]
        return 2 + n * R, 145 + 4 * ((-(-n // 4) * 12 + 7) // 8) + n * R
    codes = (tr * tc * bits + 7) // 8
    if mode in ("uniform", "affine"):
        exact = 4 + codes
        return exact, exact
    lines = tr if line_axis == "rows" else tc
    return 4 + lines, 4 + lines + codes


def _bad_length_msg(b, length, lo, hi, tr, tc, mode):
    want = f"{lo}" if lo == hi else f"in {lo}..={hi}"
    return (f"block {b} ({tr}x{tc} tile, {mode}) length {length} must be {want}")


def _u32_codes(index: bytes, at: int, n: int, w: int) -> np.ndarray:
    """Section 6.5: n W-bit codes packed LSB-first from byte `at` of the index -> int64."""
    if w == 0:
        return np.zeros(n, dtype=np.int64)
    nbytes = (n * w + 7) // 8
    raw = np.frombuffer(index, dtype=np.uint8, count=nbytes, offset=at)
    bitsarr = np.unpackbits(raw, bitorder="little")[:n * w].reshape(n, w).astype(np.int64)
    return bitsarr @ (np.int64(1) << np.arange(w, dtype=np.int64))


def _u64(v, what):
    """A non-negative JSON integer that fits in u64 (offsets, lengths and codes of section 6.5;
    section 11 has readers do checked u64 arithmetic on all of them)."""
    _nonneg_int(v, what)
    if v >= 1 << 64:
        raise FormatError(f"{what} {v} does not fit in u64")
    return v


def _outside_body(d_off, d_len, body_len, ksum_at):
    """Why [d_off, d_off + d_len) (body-relative) is not inside the body (None if it is)."""
    if d_off + d_len <= body_len:
        return None
    if ksum_at is not None:
        return (f"runs into the KSUM record at byte {ksum_at} (the body's last 8 bytes, "
                f"which belong to no tensor; the tensors' body is {body_len} bytes)")
    return f"lies outside the {body_len}-byte body"


def _v3_blocks(path, stored, te, index, index_offset, body_len, R, C, BR, BC, CT, n,
               mode, bits, line_axis, claimed, ksum_at):
    """Version 3 `data` + `block_lengths` -> [(offset relative to the body, length)] per block,
    with every check section 6.5 makes at open. `claimed` ([int]) counts the index bytes the
    tensors' length codes and CRC-32s take so far (at most index_len in all)."""
    where = f"{path}: tensor {stored}"
    data = te["data"]
    if not isinstance(data, list) or len(data) != 2:
        raise FormatError(f"{where}: data must be [offset, length], got {data!r}")
    d_off = _u64(data[0], f"{where}: data offset")
    d_len = _u64(data[1], f"{where}: data length")
    bl = te["block_lengths"]
    if not isinstance(bl, dict):
        raise FormatError(f"{where}: block_lengths must be an object, got {bl!r}")
    A = _u64(bl["at"], f"{where}: block_lengths.at")
    B = _u64(bl["base"], f"{where}: block_lengths.base")
    S = _u64(bl["step"], f"{where}: block_lengths.step")
    W = _u64(bl["bits"], f"{where}: block_lengths.bits")
    if W > 32:
        raise FormatError(f"{where}: block_lengths.bits {W} must be at most 32")
    if (S == 0) != (W == 0):
        raise FormatError(f"{where}: block_lengths step {S} and bits {W}: step must be 0 "
                          f"exactly when bits is 0")
    # The codes are bytes [A, A + nbytes) of the index; read literally, even the empty range
    # of W = 0 must lie inside it (A <= index_len).
    nbytes = (n * W + 7) // 8
    if A + nbytes > len(index):
        raise FormatError(f"{where}: its {n} length codes of {W} bits take index bytes "
                          f"[{A}, {A + nbytes}) (file bytes [{index_offset + A}, "
                          f"{index_offset + A + nbytes})), past the end of the {len(index)}-byte "
                          f"block index")
    claimed[0] += nbytes
    if nbytes:
        claimed[1].append((A, A + nbytes, f"tensor {stored}'s block_lengths"))
    if claimed[0] > len(index):
        raise FormatError(f"{where}: at byte {index_offset + A}: the tensors' length codes and "
                          f"CRC-32s so far take {claimed[0]} index bytes; the index has "
                          f"{len(index)} (ranges may not be shared)")
    why = _outside_body(d_off, d_len, body_len, ksum_at)
    if why:
        raise FormatError(f"{where}: data [{d_off}, {d_off + d_len}) (file bytes "
                          f"[{8 + d_off}, {8 + d_off + d_len})) {why}")
    # Section 6.5: the tiling must fit the data range, checked from the four tile sizes before
    # anything is sized by n.
    RT = -(-R // BR)
    lo_sum = hi_sum = 0
    for r, r_count in ((0, RT - 1), (RT - 1, 1)):
        for c, c_count in ((0, CT - 1), (CT - 1, 1)):
            if r_count * c_count:
                tr1 = min(R, r * BR + BR) - r * BR
                tc1 = min(C, c * BC + BC) - c * BC
                lo1, hi1 = _length_bounds(tr1, tc1, mode, bits, line_axis)
                lo_sum += r_count * c_count * lo1
                hi_sum += r_count * c_count * hi1
    if not lo_sum <= d_len <= hi_sum:
        raise FormatError(f"{where}: its {n} blocks take {lo_sum}..={hi_sum} bytes (the lengths "
                          f"their tiles allow), but data.length is {d_len}")
    v = _u32_codes(index, A, n, W)
    tr, tc = _tile_dims(R, C, BR, BC, CT, n)
    lo, hi = _length_bounds(tr, tc, mode, bits, line_axis)
    top = int(hi.max())
    # len[b] = B + S * v[b]; clamp B and S so the arithmetic stays in int64 without changing
    # which lengths are valid (anything above `top` is invalid either way).
    lens = min(B, top + 1) + min(S, top + 1) * v
    bad = np.nonzero((lens < lo) | (lens > hi))[0]
    if bad.size:
        b = int(bad[0])
        raise FormatError(f"{where}: " + _bad_length_msg(b, B + S * int(v[b]), int(lo[b]),
                                                       int(hi[b]), int(tr[b]), int(tc[b]), mode)
                          + f" (base {B} + step {S} * code {int(v[b])})")
    total = int(lens.sum())
    if total != d_len:
        raise FormatError(f"{where}: block lengths sum to {total}, but data.length is {d_len}")
    offs = d_off + np.concatenate([[0], np.cumsum(lens)[:-1]])
    return [(int(o), int(l)) for o, l in zip(offs, lens)], (d_off, d_len)


def open_rknot(path, buf):
    hdr, version, body, body_len, index, index_offset, ksum_at = _rknot_container(path, buf)
    num_layers = _nonneg_int(hdr["arch_meta"]["num_layers"], "num_layers")
    layers = hdr["layers"]
    if not isinstance(layers, list):
        raise FormatError(f"{path}: layers must be an array")
    if len(layers) > MAX_LAYERS:
        raise FormatError(f"{path}: too large: {len(layers)} layers over the cap {MAX_LAYERS}")
    # Section 6.6: version 3 may list tensors stored as ggml blocks; version 2 ignores the key.
    dense = _tensor_map(path, hdr, "dense_tensors") if version == 3 and "dense_tensors" in hdr else {}
    n_compressed = sum(len(layer["tensors"]) for layer in layers)
    if n_compressed + len(dense) > MAX_TENSORS:
        raise FormatError(f"{path}: too large: {n_compressed} compressed + {len(dense)} dense "
                          f"tensors, over the cap {MAX_TENSORS}")
    tensors = TensorMap()
    tensors.checked = ksum_at is not None
    if version == 2:
        tensors.no_sums = ".rknot version 2 has no place for checksums"
    # Index bytes taken by length codes and block CRC-32s, and each non-empty range (section 6.5).
    claimed = [0, []]
    seen_idx = set()
    ranges = []
    for layer in layers:
        idx = _nonneg_int(layer["index"], "index")
        if idx in seen_idx or idx >= num_layers:
            raise FormatError(f"{path}: bad layer index {idx}")
        seen_idx.add(idx)
        man = layer["manifest"]
        d = _nonneg_int(man["d"], "d")
        k = _nonneg_int(man["k"], "k")
        si = [_nonneg_int(x, "standing index") for x in man["standing_indices"]]
        if not (d >= 1 and 1 <= k <= d and len(si) == k and all(x < d for x in si)
                and all(a < b for a, b in zip(si, si[1:]))):
            raise FormatError(f"{path}: layer {idx}: bad manifest")
        if len(man["amplitudes"]) != k or not all(math.isfinite(a) for a in man["amplitudes"]):
            raise FormatError(f"{path}: layer {idx}: bad amplitudes")
        if len(man["phase_alignment"]) != k or not all(0 <= a <= 1 for a in man["phase_alignment"]):
            raise FormatError(f"{path}: layer {idx}: bad phase_alignment")
        standing = np.array(si, dtype=np.int64)
        for te in layer["tensors"]:
            stored = te["name"]
            d_out, d_in = [_nonneg_int(x, "dim") for x in te["shape"]]
            if d_out < 1 or d_in < 1:
                raise FormatError(f"{path}: {stored}: bad shape")
            ra = te["restricted_axes"]
            if not set(ra) <= {"rows", "cols"} or len(set(ra)) != len(ra):
                raise FormatError(f"{path}: {stored}: bad restricted_axes {ra}")
            rrow, rcol = "rows" in ra, "cols" in ra
            if rrow and d_out != d or rcol and d_in != d:
                raise FormatError(f"{path}: {stored}: restricted axis length != d {d}")
            R = k if rrow else d_out
            C = k if rcol else d_in
            mode = te["mode"]
            bits = _nonneg_int(te["bits"], "bits")
            if mode not in ("uniform", "graded", "affine", *LOSSLESS_MODES) or not 1 <= bits <= 16:
                raise FormatError(f"{path}: {stored}: bad mode/bits")
            if mode in LOSSLESS_MODES and bits != 8:
                raise FormatError(f"{path}: {stored}: a {mode} tensor has bits 8, not {bits}")
            line_axis = te.get("line_axis") if mode == "graded" else None
            if mode == "graded" and line_axis not in ("rows", "cols"):
                raise FormatError(f"{path}: {stored}: graded needs line_axis")
            BR, BC = [_nonneg_int(x, "block dim") for x in te["block_shape"]]
            if not (1 <= BR <= R and 1 <= BC <= C and BR * BC <= 65536):
                raise FormatError(f"{path}: {stored}: bad block_shape")
            RT, CT = -(-R // BR), -(-C // BC)
            n = RT * CT
            if version == 3:
                blocks, (d_off, d_len) = _v3_blocks(path, stored, te, index, index_offset, body_len,
                                                    R, C, BR, BC, CT, n, mode, bits, line_axis,
                                                    claimed, ksum_at)
                ranges.append((body + d_off, d_len, f"tensor {stored} data"))
                sums = _group_sums(path, f"tensor {stored}", te, tensors.checked, buf, index,
                                   index_offset, claimed, body, blocks)
            else:
                sums = None
                blocks = te["blocks"]
                if not isinstance(blocks, list):
                    raise FormatError(f"{path}: {stored}: blocks must be an array")
                if len(blocks) != n:
                    raise FormatError(f"{path}: {stored}: {len(blocks)} blocks, expected {n}")
                tr, tc = _tile_dims(R, C, BR, BC, CT, n)
                lo, hi = (x.tolist() for x in _length_bounds(tr, tc, mode, bits, line_axis))
                for bi, (bo, bl) in enumerate(blocks):
                    _nonneg_int(bo, "block offset"); _nonneg_int(bl, "block length")
                    if not lo[bi] <= bl <= hi[bi]:
                        raise FormatError(f"{path}: tensor {stored}: at byte {body + bo}: "
                                          + _bad_length_msg(bi, bl, lo[bi], hi[bi],
                                                            int(tr[bi]), int(tc[bi]), mode))
                    ranges.append((body + bo, bl, f"{stored} block {bi}"))
            rows_map = standing if rrow else np.arange(d_out)
            cols_map = standing if rcol else np.arange(d_in)

            def loader(R=R, C=C, BR=BR, BC=BC, CT=CT, blocks=blocks, mode=mode, bits=bits,
                       line_axis=line_axis, rows_map=rows_map, cols_map=cols_map,
                       d_out=d_out, d_in=d_in, stored=stored):
                compact = np.zeros((R, C), dtype=F32)
                for b, (bo, bl) in enumerate(blocks):
                    rt, ct = divmod(b, CT)
                    r0, c0 = rt * BR, ct * BC
                    r1, c1 = min(R, r0 + BR), min(C, c0 + BC)
                    try:
                        tile = decode_rknot_block(buf[body + bo:body + bo + bl], r1 - r0, c1 - c0,
                                                  mode, bits, line_axis)
                    except FormatError as ex:
                        raise FormatError(f"{path}: tensor {stored}: block {b} at byte "
                                          f"{body + bo}: {ex}")
                    compact[r0:r1, c0:c1] = tile
                full = np.zeros((d_out, d_in), dtype=F32)
                full[np.ix_(rows_map, cols_map)] = compact
                return full.reshape(-1)

            t = Tensor(canonical_name(stored), [d_out, d_in], loader, "exact", stored,
                       lossy=mode not in LOSSLESS_MODES)
            t.sums = sums
            _add(tensors, t, path)
    # Section 6.5: no two index ranges (length codes, block CRC-32s) share a byte.
    taken = sorted(claimed[1])
    for (a0, a1, wa), (b0, b1, wb) in zip(taken, taken[1:]):
        if a1 > b0:
            raise FormatError(f"{path}: index bytes [{b0}, {min(a1, b1)}) (file bytes from "
                              f"{index_offset + b0}) are both {wa} and {wb}: no two index ranges "
                              f"may share a byte")
    for stored, e in dense.items():
        tid, shape, n, off, length = parse_dense_entry(path, f"{stored} (dense_tensors)", e)
        why = _outside_body(off, length, body_len, ksum_at)
        if why:
            raise FormatError(f"{path}: dense tensor {stored}: [{off}, {off + length}) (file bytes "
                              f"[{body + off}, {body + off + length})) {why}")
        ranges.append((body + off, length, f"dense tensor {stored}"))
        sums = _chunk_sums(path, f"dense tensor {stored}", e, tensors.checked, buf, body + off,
                           length)

        def loader(tid=tid, a=body + off, length=length, n=n):
            return decode_ggml(tid, buf[a:a + length], n)

        # _add refuses a name that collides, in either spelling, with a compressed tensor or
        # another dense one: one namespace (section 6.6)
        t = Tensor(canonical_name(stored), shape, loader, "exact", stored)
        t.extra["dense"] = True
        t.sums = sums
        _add(tensors, t, path)
    # data ranges of compressed tensors and dense tensors: inside the body, no two overlapping
    _check_ranges(path, ranges, body + body_len)
    return tensors


# ---------------------------------------------------------------------------
# Section 7: GGUF
# ---------------------------------------------------------------------------

class _R:
    def __init__(self, buf, pos=0):
        self.buf, self.pos = buf, pos

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self):
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise FormatError("string past end of file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}


def _gguf_value(r: _R, vt: int):
    if vt in _GGUF_SCALARS:
        return r.take(_GGUF_SCALARS[vt])
    if vt == 8:
        return r.string()
    if vt == 9:
        et = r.take("I")
        n = r.take("Q")
        if n > len(r.buf) - r.pos:
            raise FormatError("array count exceeds remaining bytes")
        return [_gguf_value(r, et) for _ in range(n)]
    raise FormatError(f"unknown GGUF value type {vt}")


def open_gguf(path, buf):
    r = _R(buf, 4)
    version = r.take("I")
    if version not in (2, 3):
        raise FormatError(f"{path}: GGUF version {version} unsupported")
    n_t = r.take("Q")
    n_kv = r.take("Q")
    kv = {}
    for _ in range(n_kv):
        key = r.string()
        vt = r.take("I")
        kv[key] = (vt, _gguf_value(r, vt))
    align = 32
    if "general.alignment" in kv:
        vt, a = kv["general.alignment"]
        if vt != 4 or a == 0 or a & (a - 1) or a > 1 << 20:
            raise FormatError(f"{path}: bad general.alignment {a}")
        align = a
    infos = []
    for _ in range(n_t):
        name = r.string()
        nd = r.take("I")
        if not 1 <= nd <= 4:
            raise FormatError(f"{path}: tensor {name}: n_dims {nd}")
        ne = [r.take("Q") for _ in range(nd)]
        tt = r.take("I")
        off = r.take("Q")
        infos.append((name, ne, tt, off))
    data = (r.pos + align - 1) // align * align
    tensors = TensorMap()
    tensors.no_sums = "GGUF has no place for checksums"
    for name, ne, tt, off in infos:
        shape = list(reversed(ne))
        n = math.prod(ne)
        if off % align:
            raise FormatError(f"{path}: tensor {name}: offset {off} not aligned")
        if tt in GGML_TYPES:
            _, be, bb = GGML_TYPES[tt]
            length = n // be * bb
            if ne[0] % be or data + off + length > len(buf):
                raise FormatError(f"{path}: tensor {name}: bad layout")

            def loader(tt=tt, a=data + off, length=length, n=n):
                return decode_ggml(tt, buf[a:a + length], n)

            _add(tensors, Tensor(canonical_name(name), shape, loader, "exact", name), path)
        else:
            tn = OTHER_GGML_TYPES.get(tt, (f"type {tt}",))[0]
            _add(tensors, Tensor(canonical_name(name), shape, None, "exact", name,
                                 unavailable=f"ggml type {tn} not decoded"), path)
    return tensors


# ---------------------------------------------------------------------------
# Opening and layering (sections 2, 10)
# ---------------------------------------------------------------------------

VOCAB_TABLES = ("token_embd.weight", "output.weight")


def open_any(path: str):
    with open(path, "rb") as f:
        buf = f.read()
    head = buf[:6]
    if head[:5] == b"RKNOT":
        if len(head) < 6 or head[5] not in (2, 3):
            raise FormatError(f"{path}: unsupported .rknot version: found {list(head)} ({head!r})")
        return "rknot", open_rknot(path, buf)
    if head[:4] == b"KNOT":
        return open_knot(path, buf)
    if head[:4] == b"GGUF":
        return "gguf", open_gguf(path, buf)
    raise FormatError(f"{path}: bad magic: found {list(head)} ({head!r})")


def checksum_status(tensors: TensorMap) -> str:
    """Section 12: "checked" (a KSUM record, verified at open, and CRC-32s for every tensor) or
    "unchecked", with what that means for the file."""
    if tensors.checked:
        n = sum(len(t.sums.values) for t in tensors.values() if t.sums is not None)
        return (f"checked (KSUM record matches the metadata; {len(tensors)} tensors with "
                f"{n} CRC-32s, verified when read)")
    return f"unchecked ({tensors.no_sums or 'no KSUM record: the file carries no checksums'})"


def open_view(path: str, dense: str | None):
    """Returns (dict canonical name -> Tensor, dict name -> source label, [(path, TensorMap)]
    of the files opened).

    Section 10 layering: a tensor both files have is served from the primary, except the vocab
    tables when the primary holds them lossy-encoded (an SK32 sketch or .rknot blocks): those
    come from the fallback, or are unavailable without one. A vocab table a .rknot holds as ggml
    blocks (section 6.6 dense_tensors) is served from it like any tensor. Listing order: the
    fallback's tensors in its order, then the primary-only ones in the primary's order."""
    _, prim = open_any(path)
    files = [(path, prim)]
    fb = {}
    if dense is not None:
        _, fb = open_any(dense)
        files.append((dense, fb))
        for name, t in prim.items():
            if name in fb and fb[name].shape != t.shape:
                raise FormatError(f"shape mismatch: tensor {name} is {t.shape} in {path} but "
                                  f"{fb[name].shape} in {dense}")

    def never_served(t):
        return t.lossy and t.name in VOCAB_TABLES

    view, source = {}, {}
    for name, t in fb.items():
        if name in prim and not never_served(prim[name]):
            view[name], source[name] = prim[name], "primary"
        else:
            view[name], source[name] = t, "fallback"
    for name, t in prim.items():
        if name in view:
            continue
        if never_served(t):
            view[name] = Tensor(name, t.shape, None, t.kind, t.stored_name, lossy=True,
                                unavailable="a compressed primary never serves a lossy-encoded "
                                            "vocab table and no dense fallback has it")
            source[name] = "unavailable"
        else:
            view[name], source[name] = t, "primary"
    return view, source, files


def lookup(view: dict, name: str) -> Tensor:
    c = canonical_name(name)
    if c not in view:
        raise FormatError(f"no tensor {name!r} (canonical {c!r})")
    return view[c]


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

def cmd_list(args):
    view, _, files = open_view(args.file, args.dense)
    for path, tmap in files:
        print(f"# file {path}: {checksum_status(tmap)}", file=sys.stderr)
    for name, t in view.items():
        shp = "x".join(str(x) for x in t.shape)
        if t.unavailable:
            print(f"# {name} {shp} unavailable: {t.unavailable}", file=sys.stderr)
        else:
            print(f"{name} {shp}")


def cmd_cat(args):
    view, _, _ = open_view(args.file, args.dense)
    t = lookup(view, args.tensor)
    data = t.data()
    sys.stdout.buffer.write(data.astype("<f4").tobytes())


def check_listing(args, view, source, files) -> int:
    """Compare which tensors are served, from which file, in which order, with `rknot inspect
    --json` (section 10 layering). The bytes alone cannot tell: a .rknot's ggml-block tensors
    are usually the fallback's bytes verbatim. Also whether each file is checked (section 12),
    when the binary's JSON says. Returns the number of mismatches."""
    cmd = [args.rknot_bin, "inspect", "--json", args.file] + (["--dense", args.dense] if args.dense else [])
    p = subprocess.run(cmd, capture_output=True)
    try:
        doc = json.loads(p.stdout)
        theirs = [(t["name"], list(t["shape"]), t["source"]["role"], bool(t["available"]))
                  for t in doc["tensors"]]
    except (ValueError, KeyError, TypeError) as ex:
        print(f"note: listing not compared: `{' '.join(cmd)}` gave no usable tensor table "
              f"(rc={p.returncode}, {type(ex).__name__}: {ex})")
        return 0
    bad = 0
    for (path, tmap), key in zip(files, ("source", "fallback")):
        src = doc.get(key)
        if isinstance(src, dict) and "checked" in src and bool(src["checked"]) != tmap.checked:
            print(f"MISMATCH {path}: binary says checked={src['checked']!r}, this reader "
                  f"{checksum_status(tmap)}")
            bad += 1
    mine = [(name, t.shape, "primary" if source[name] == "unavailable" else source[name],
             not t.unavailable) for name, t in view.items()]
    if mine == theirs:
        return bad
    print(f"MISMATCH listing (name, shape, source, available) vs `{' '.join(cmd)}`:")
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            print(f"   [{i}] mine={a} binary={b}")
    return bad + 1


def cmd_integrity(args):
    """Section 12: every tensor's stored bytes against its CRC-32s, nothing decoded. One line per
    mismatch and a summary; 1 on any mismatch (the metadata's, found at open, included), 0 when
    all match or the file has no checksums."""
    path = args.file
    try:
        _, tensors = open_any(path)
    except ChecksumError as ex:
        print(f"MISMATCH {ex}")
        print(f"FAIL: {path}: refused at open (a Checksum error: its metadata or checksum fields "
              f"are damaged)")
        return 1
    if not tensors.checked:
        print(f"{path}: {checksum_status(tensors)}: nothing to verify")
        return 0
    n_bad = n_values = n_bytes = 0
    bad_tensors = set()
    for t in tensors.values():
        s = t.sums
        n_values += len(s.values)
        n_bytes += s.n_bytes()
        for i, a, b, stored, actual in s.mismatches():
            print(f"MISMATCH {path}: tensor {t.stored_name}: {s.label(i)} at byte {a} ({b - a} "
                  f"bytes): CRC-32 {actual:08x}, the file records {stored:08x}")
            n_bad += 1
            bad_tensors.add(t.name)
    if n_bad:
        print(f"FAIL: {path}: checked: {n_bad} of {n_values} CRC-32s disagree with the stored "
              f"bytes, in {len(bad_tensors)} of {len(tensors)} tensors")
        return 1
    print(f"OK: {path}: checked: metadata and {len(tensors)} tensors ({n_values} CRC-32s over "
          f"{n_bytes} stored bytes) match")
    return 0


def cmd_check(args):
    view, source, files = open_view(args.file, args.dense)
    for path, tmap in files:
        print(f"file {path}: {checksum_status(tmap)}")
    n_ok = n_exact = n_tol = n_refused = 0
    max_rel = 0.0
    failures = check_listing(args, view, source, files)
    unavailable = []
    for name, t in view.items():
        if t.unavailable:
            unavailable.append(name)
            continue
        cmd = [args.rknot_bin, "cat", args.file, name]
        if args.dense:
            cmd += ["--dense", args.dense]
        p = subprocess.run(cmd, capture_output=True)
        try:
            mine = t.data()
            my_err = None
        except FormatError as ex:
            mine, my_err = None, str(ex)
        if p.returncode != 0 or my_err is not None:
            theirs_err = p.stderr.decode(errors="replace").strip() if p.returncode != 0 else None
            if my_err is not None and theirs_err is not None:
                print(f"note: {name}: read fails in both (mine: {my_err}; binary: {theirs_err})")
                n_refused += 1
                continue
            print(f"MISMATCH {name}: reader error: {my_err}; binary rc={p.returncode}: {theirs_err}")
            failures += 1
            continue
        theirs = np.frombuffer(p.stdout, dtype="<f4") if len(p.stdout) % 4 == 0 else None
        n = math.prod(t.shape)
        if theirs is None or theirs.size != n:
            print(f"MISMATCH {name}: binary wrote {len(p.stdout)} bytes, expected {n * 4} "
                  f"(served shape {t.shape})")
            failures += 1
            continue
        if t.kind == "exact":
            a = mine.astype("<f4").view("<u4")
            b = theirs.view("<u4")
            diff = np.nonzero(a != b)[0]
            if diff.size:
                print(f"MISMATCH {name} ({source[name]}): {diff.size}/{n} elements differ; first:")
                for i in diff[:8]:
                    print(f"   [{i}] mine={float(mine[i])!r} (0x{int(a[i]):08x}) "
                          f"binary={float(theirs[i])!r} (0x{int(b[i]):08x})")
                failures += 1
                continue
            n_exact += 1
        else:
            rank = t.extra["rank"]
            tol = rank * 1e-5
            mag = t.extra["aux"]["mag"]
            err = np.abs(theirs.astype(np.float64) - mine)
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(mag > 0, err / mag, np.where(err > 0, np.inf, 0.0))
            bad = np.nonzero(~(rel <= tol))[0]
            if bad.size:
                print(f"MISMATCH {name} (sk32, tol {tol:g}): {bad.size}/{n} elements out of tolerance; first:")
                for i in bad[:8]:
                    print(f"   [{i}] mine(f64)={float(mine[i])!r} binary={float(theirs[i])!r} "
                          f"sum|terms|={float(mag[i])!r} rel={float(rel[i]):.3g}")
                failures += 1
                continue
            max_rel = max(max_rel, float(rel.max()))
            n_tol += 1
        n_ok += 1
    # tensors that should be unavailable: the binary must refuse them
    for name in unavailable:
        cmd = [args.rknot_bin, "cat", args.file, name] + (["--dense", args.dense] if args.dense else [])
        p = subprocess.run(cmd, capture_output=True)
        if p.returncode == 0:
            print(f"MISMATCH {name}: expected unavailable ({view[name].unavailable}), "
                  f"binary served {len(p.stdout)} bytes")
            failures += 1
        else:
            print(f"note: {name} unavailable in both (binary: "
                  f"{p.stderr.decode(errors='replace').strip().splitlines()[-1] if p.stderr else ''})")
    n_fb = sum(1 for s in source.values() if s == "fallback")
    n_dense = sum(1 for name, s in source.items() if s == "primary" and view[name].extra.get("dense"))
    if failures:
        print(f"FAIL: {failures} mismatches (tensors or listing); {n_ok} tensors OK ({n_exact} "
              f"bit-exact, {n_tol} within tolerance)")
        return 1
    extra = f"; {n_dense} stored as ggml blocks in the .rknot" if n_dense else ""
    extra += f"; {n_fb} from dense fallback" if args.dense else ""
    if n_refused:
        extra += f"; {n_refused} refused by both readers"
    print(f"OK: {n_ok} tensors, {n_exact} bit-exact, {n_tol} within tolerance "
          f"(max rel err {max_rel:.3g}){extra}")
    return 0


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:
        try:
            sys.stdout = None  # suppress the flush error at exit
        except Exception:
            pass
        return 141


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list"); p.add_argument("file"); p.add_argument("--dense")
    p = sub.add_parser("cat"); p.add_argument("file"); p.add_argument("tensor"); p.add_argument("--dense")
    p = sub.add_parser("check"); p.add_argument("file"); p.add_argument("--dense")
    p.add_argument("--rknot-bin", required=True)
    p = sub.add_parser("integrity"); p.add_argument("file")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            cmd_list(args)
        elif args.cmd == "cat":
            cmd_cat(args)
        elif args.cmd == "integrity":
            return cmd_integrity(args)
        else:
            return cmd_check(args)
    except FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
        # missing/mistyped header fields, truncated tables, bad JSON or UTF-8
        print(f"error: {args.file}: malformed file: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
