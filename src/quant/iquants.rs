//! The i-quants: 256-element super-blocks (IQ4_NL: 32) whose codes index
//! lattice tables (`iq_grids`) or, for IQ4_NL/IQ4_XS, a 16-entry
//! non-linear table.
//!
//! Float order follows `gguf.quants` (which follows ggml's reference
//! `dequantize_row_iq*`): the sub-block scale first (`d * (0.5 + s) * 0.25`
//! for IQ2_*, `* 0.5` for IQ3_XXS, `d * (1 + 2s)` for IQ3_S and the IQ1s,
//! `d * s` for IQ4_XS), then one product with the grid value, then the
//! sign. IQ1 adds its ±1/8 shift to the grid value before the product.
//!
//! Untrusted bytes cannot index out of bounds: every grid index is a whole
//! byte (256-row grids) or masked to the grid's bit width (9, 10 or 11
//! bits for the 512-, 1024- and 2048-row grids), and every sign index is
//! seven bits into the 128-entry sign table.

use super::float::{f16_le_at, split};
use super::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};
use super::{GgmlType, Kernels, QK_K, blocks};

/// `v * s` for `s` = ±1.0 as numpy computes it (x86 `mulss`, Arm `fmul`):
/// an exact negation of every number, and a NaN back as it came (already
/// quiet: it is a product). Done on the bits because the compiler may turn
/// a product with -1.0 into a negation, which would flip a NaN's sign.
#[inline]
fn with_sign(v: f32, negative: bool) -> f32 {
    let flip = if negative && !v.is_nan() {
        0x8000_0000
    } else {
        0
    };
    f32::from_bits(v.to_bits() ^ flip)
}

/// Eight values `(db * grid[j]) * ±1`, the sign of value `j` being bit `j`
/// of `signs` (set: negative).
#[inline]
fn put8(db: f32, row: u64, signs: u8, y: &mut [f32; 8]) {
    for (j, (g, y)) in row.to_le_bytes().into_iter().zip(y).enumerate() {
        *y = with_sign(db * f32::from(g), signs & (1 << j) != 0);
    }
}

/// Four values of a 4-wide grid row, signs from bits `first..first + 4`
/// of `signs`.
#[inline]
fn put4(db: f32, row: u32, signs: u8, first: usize, y: &mut [f32; 4]) {
    for (j, (g, y)) in row.to_le_bytes().into_iter().zip(y).enumerate() {
        *y = with_sign(db * f32::from(g), signs & (1 << (first + j)) != 0);
    }
}

/// The sign byte of group `l` of an IQ2_XXS / IQ3_XXS sub-block: seven
/// bits of `aux` at `7 * l`, the eighth bit implied by parity (the table).
#[inline]
fn ksigns(aux: u32, l: usize) -> u8 {
    KSIGNS[((aux >> (7 * l)) & 0x7f) as usize]
}

/// The scale of the IQ2_* types: `d * (0.5 + s) * 0.25` with `s` a 4-bit
/// code.
#[inline]
fn iq2_scale(d: f32, s: u8) -> f32 {
    d * (0.5 + f32::from(s)) * 0.25
}

/// IQ2_XXS, 66 bytes: f16 d, then per 32 elements two little-endian u32:
/// the first is four grid indices (one byte each, 8 elements each), the
/// second holds four 7-bit sign indices (bits 0..28) and a 4-bit scale
/// (bits 28..32).
pub(super) fn iq2_xxs(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<66, QK_K>(src, out) {
        let (d, qs): (_, &[u8; 64]) = split(b);
        let d = f16_le_at(d);
        for (g, y) in qs.as_chunks::<8>().0.iter().zip(y.as_chunks_mut::<32>().0) {
            let (idx, aux): (&[u8; 4], &[u8; 4]) = split(g);
            let aux = u32::from_le_bytes(*aux);
            let db = iq2_scale(d, (aux >> 28) as u8);
            for (l, (&i, y)) in idx.iter().zip(y.as_chunks_mut::<8>().0).enumerate() {
                put8(db, IQ2XXS_GRID[usize::from(i)], ksigns(aux, l), y);
            }
        }
    }
}

/// IQ2_XS, 74 bytes: f16 d, 32 little-endian u16 (9-bit grid index, 7-bit
/// sign index; 8 elements each), 8 bytes of 4-bit scales (low nibble
/// first; one per 16 elements).
pub(super) fn iq2_xs(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<74, QK_K>(src, out) {
        let (d, rest): (_, &[u8; 72]) = split(b);
        let (qs, scales): (&[u8; 64], &[u8; 8]) = split(rest);
        let d = f16_le_at(d);
        let sub = qs.as_chunks::<4>().0.iter().zip(y.as_chunks_mut::<16>().0);
        for (s, (q, y)) in sub.enumerate() {
            let db = iq2_scale(d, (scales[s / 2] >> (4 * (s % 2))) & 0x0f);
            for (q, y) in q.as_chunks::<2>().0.iter().zip(y.as_chunks_mut::<8>().0) {
                let q = u16::from_le_bytes(*q);
                put8(
                    db,
                    IQ2XS_GRID[usize::from(q & 0x1ff)],
                    KSIGNS[usize::from(q >> 9) & 0x7f],
                    y,
                );
            }
        }
    }
}

/// IQ2_S, 82 bytes: f16 d, 32 low bytes of the 10-bit grid indices, 32
/// sign bytes (bit `j` of byte `k`: element `8k + j`), 8 bytes of index
/// high bits (two per index, index `k` at bits `2(k % 4)` of byte `k / 4`),
/// 8 bytes of 4-bit scales (one per 16 elements).
pub(super) fn iq2_s(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<82, QK_K>(src, out) {
        let (d, rest): (_, &[u8; 80]) = split(b);
        let (qs, rest): (&[u8; 32], &[u8; 48]) = split(rest);
        let (signs, rest): (&[u8; 32], &[u8; 16]) = split(rest);
        let (qh, scales): (&[u8; 8], &[u8; 8]) = split(rest);
        let d = f16_le_at(d);
        for (k, y) in y.as_chunks_mut::<8>().0.iter_mut().enumerate() {
            let s = k / 2;
            let db = iq2_scale(d, (scales[s / 2] >> (4 * (s % 2))) & 0x0f);
            let high = (qh[k / 4] >> (2 * (k % 4))) & 0x03;
            let idx = usize::from(qs[k]) | (usize::from(high) << 8);
            put8(db, IQ2S_GRID[idx], signs[k], y);
        }
    }
}

/// IQ3_XXS, 98 bytes: f16 d, 64 grid indices (one byte, 4 elements each),
/// then per 32 elements a little-endian u32 with four 7-bit sign indices
/// and a 4-bit scale, as IQ2_XXS.
pub(super) fn iq3_xxs(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<98, QK_K>(src, out) {
        let (d, rest): (_, &[u8; 96]) = split(b);
        let (qs, aux): (&[u8; 64], &[u8; 32]) = split(rest);
        let d = f16_le_at(d);
        let groups = qs.as_chunks::<8>().0.iter().zip(aux.as_chunks::<4>().0);
        for ((idx, aux), y) in groups.zip(y.as_chunks_mut::<32>().0) {
            let aux = u32::from_le_bytes(*aux);
            let db = d * (0.5 + f32::from((aux >> 28) as u8)) * 0.5;
            let rows = idx.as_chunks::<2>().0.iter().zip(y.as_chunks_mut::<8>().0);
            for (l, (pair, y)) in rows.enumerate() {
                let signs = ksigns(aux, l);
                let (y0, y1): (&mut [f32; 4], &mut [f32; 4]) = split_mut(y);
                put4(db, IQ3XXS_GRID[usize::from(pair[0])], signs, 0, y0);
                put4(db, IQ3XXS_GRID[usize::from(pair[1])], signs, 4, y1);
            }
        }
    }
}

/// IQ3_S, 110 bytes: f16 d, 64 low bytes of the 9-bit grid indices (4
/// elements each), 8 bytes of index high bits (index `k`: bit `k % 8` of
/// byte `k / 8`), 32 sign bytes (bit `j` of byte `k`: element `8k + j`),
/// 4 bytes of 4-bit scales (one per 32 elements).
pub(super) fn iq3_s(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<110, QK_K>(src, out) {
        let (d, rest): (_, &[u8; 108]) = split(b);
        let (qs, rest): (&[u8; 64], &[u8; 44]) = split(rest);
        let (qh, rest): (&[u8; 8], &[u8; 36]) = split(rest);
        let (signs, scales): (&[u8; 32], &[u8; 4]) = split(rest);
        let d = f16_le_at(d);
        for (ib, y) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
            let s = (scales[ib / 2] >> (4 * (ib % 2))) & 0x0f;
            let db = d * f32::from(1 + 2 * s);
            for (r, y) in y.as_chunks_mut::<4>().0.iter_mut().enumerate() {
                let k = 8 * ib + r;
                let idx = usize::from(qs[k]) | (usize::from((qh[ib] >> r) & 1) << 8);
                put4(db, IQ3S_GRID[idx], signs[k / 2], 4 * (k % 2), y);
            }
        }
    }
}

/// The shift IQ1 adds to its grid values, by the sign bit of a group.
#[inline]
fn iq1_delta(negative: bool) -> f32 {
    if negative { -0.125 } else { 0.125 }
}

/// Eight IQ1 values `dl * (grid[j] + delta)`.
#[inline]
fn put_iq1(dl: f32, idx: usize, delta: f32, y: &mut [f32; 8]) {
    for (g, y) in IQ1S_GRID[idx & 0x7ff].to_le_bytes().into_iter().zip(y) {
        *y = dl * (f32::from(g as i8) + delta);
    }
}

/// IQ1_S, 50 bytes: f16 d, 32 low bytes of the 11-bit grid indices (8
/// elements each), then per 32 elements a little-endian u16: four 3-bit
/// index high parts (bits 0..12), a 3-bit scale (bits 12..15) and the sign
/// of the ±1/8 shift (bit 15).
pub(super) fn iq1_s(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<50, QK_K>(src, out) {
        let (d, rest): (_, &[u8; 48]) = split(b);
        let (qs, qh): (&[u8; 32], &[u8; 16]) = split(rest);
        let d = f16_le_at(d);
        let groups = qs.as_chunks::<4>().0.iter().zip(qh.as_chunks::<2>().0);
        for ((idx, qh), y) in groups.zip(y.as_chunks_mut::<32>().0) {
            let qh = u16::from_le_bytes(*qh);
            let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
            let delta = iq1_delta(qh & 0x8000 != 0);
            for (l, (&i, y)) in idx.iter().zip(y.as_chunks_mut::<8>().0).enumerate() {
                let high = usize::from((qh >> (3 * l)) & 7);
                put_iq1(dl, usize::from(i) | (high << 8), delta, y);
            }
        }
    }
}

/// IQ1_M, 56 bytes: 32 low bytes of the 11-bit grid indices, 16 bytes of
/// one nibble per index (3 high index bits, then the shift's sign; low
/// nibble first), 4 little-endian u16 holding sixteen 3-bit scales (one per
/// 16 elements, 3 bits apart) in bits 0..12 and, in their top nibbles, the
/// f16 super-scale (u16 `i` gives bits `4i..4i+4`).
pub(super) fn iq1_m(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<56, QK_K>(src, out) {
        let (qs, rest): (&[u8; 32], &[u8; 24]) = split(b);
        let (qh, sc): (&[u8; 16], &[u8; 8]) = split(rest);
        let sc: [u16; 4] = std::array::from_fn(|i| u16::from_le_bytes([sc[2 * i], sc[2 * i + 1]]));
        let d_bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        let d = f16_le_at(&d_bits.to_le_bytes());
        for (k, y) in y.as_chunks_mut::<8>().0.iter_mut().enumerate() {
            let s = k / 2;
            let dl = d * f32::from(2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1);
            let nib = qh[k / 2] >> (4 * (k % 2));
            let idx = usize::from(qs[k]) | (usize::from(nib & 7) << 8);
            put_iq1(dl, idx, iq1_delta(nib & 8 != 0), y);
        }
    }
}

/// The non-linear codebook of IQ4_NL and IQ4_XS.
const IQ4_VALUES: [f32; 16] = [
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0,
    89.0, 113.0,
];

/// 32 values `dl * IQ4_VALUES[code]` from 16 bytes: element `j` from the
/// low nibble of byte `j`, element `16 + j` from its high nibble.
#[inline]
fn iq4_32(dl: f32, qs: &[u8; 16], y: &mut [f32; 32]) {
    let (lo, hi): (&mut [f32; 16], &mut [f32; 16]) = split_mut(y);
    for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
        *lo = dl * IQ4_VALUES[usize::from(q & 0x0f)];
        *hi = dl * IQ4_VALUES[usize::from(q >> 4)];
    }
}

/// IQ4_NL, 18 bytes: f16 d, 16 bytes of codebook nibbles.
pub(super) fn iq4_nl(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<18, 32>(src, out) {
        let (d, qs) = split(b);
        iq4_32(f16_le_at(d), qs, y);
    }
}

/// IQ4_XS, 136 bytes: f16 d, a little-endian u16 of the scales' top two
/// bits (sub-block `i` at bits `2i`), 4 bytes of their low nibbles (low
/// first), 128 bytes of codebook nibbles (16 per 32-element sub-block, laid
/// out as IQ4_NL). Scale `i` is the 6-bit number minus 32.
pub(super) fn iq4_xs(src: &[u8], out: &mut [f32]) {
    for (b, y) in blocks::<136, QK_K>(src, out) {
        let (d, rest): (_, &[u8; 134]) = split(b);
        let (sh, rest): (&[u8; 2], &[u8; 132]) = split(rest);
        let (sl, qs): (&[u8; 4], &[u8; 128]) = split(rest);
        let d = f16_le_at(d);
        let sh = u16::from_le_bytes(*sh);
        let sub = qs.as_chunks::<16>().0.iter().zip(y.as_chunks_mut::<32>().0);
        for (ib, (qs, y)) in sub.enumerate() {
            let low = (sl[ib / 2] >> (4 * (ib % 2))) & 0x0f;
            let high = ((sh >> (2 * ib)) & 3) as u8;
            let scale = i16::from(low | (high << 4)) - 32;
            iq4_32(d * f32::from(scale), qs, y);
        }
    }
}

/// Splits a mutable array into its first `A` and last `B` elements
/// (`A + B == N` checked at compile time).
#[inline]
fn split_mut<const A: usize, const B: usize, const N: usize>(
    x: &mut [f32; N],
) -> (&mut [f32; A], &mut [f32; B]) {
    const { assert!(A + B == N) };
    let (a, b) = x.split_at_mut(A);
    match (a.try_into(), b.try_into()) {
        (Ok(a), Ok(b)) => (a, b),
        _ => unreachable!("A + B == N is asserted at compile time"),
    }
}

/// The kernels of this family (registered in [`super::FAMILIES`]).
pub(super) const KERNELS: Kernels = &[
    (GgmlType::Iq1S, iq1_s),
    (GgmlType::Iq1M, iq1_m),
    (GgmlType::Iq2Xxs, iq2_xxs),
    (GgmlType::Iq2Xs, iq2_xs),
    (GgmlType::Iq2S, iq2_s),
    (GgmlType::Iq3Xxs, iq3_xxs),
    (GgmlType::Iq3S, iq3_s),
    (GgmlType::Iq4Nl, iq4_nl),
    (GgmlType::Iq4Xs, iq4_xs),
];

#[cfg(test)]
mod tests {
    use super::super::iq_grids::TABLES_SHA256;
    use super::*;
    use sha2::{Digest, Sha256};

    /// The tables are what tools/gen_iq_grids.py made from gguf-py: their
    /// bytes hash to the checksum it wrote (and that this test pins, so a
    /// regenerated file with other tables shows up here).
    #[test]
    fn grid_tables_match_their_checksum() {
        let mut h = Sha256::new();
        for g in [&IQ2XXS_GRID[..], &IQ2XS_GRID, &IQ2S_GRID] {
            g.iter().for_each(|r| h.update(r.to_le_bytes()));
        }
        for g in [&IQ3XXS_GRID[..], &IQ3S_GRID] {
            g.iter().for_each(|r| h.update(r.to_le_bytes()));
        }
        IQ1S_GRID.iter().for_each(|r| h.update(r.to_le_bytes()));
        h.update(KSIGNS);
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(got, TABLES_SHA256);
        assert_eq!(
            got,
            "5ee43012c704027693bcd30483784fa4a2346ac08747cb129a18d15712603bc2"
        );
    }

    /// The sign table is the even-parity completion of its index.
    #[test]
    fn ksigns_is_the_parity_completion() {
        for (i, &s) in KSIGNS.iter().enumerate() {
            let parity = (i.count_ones() % 2) as u8;
            assert_eq!(s, i as u8 | (parity << 7), "{i}");
        }
    }

    #[test]
    fn a_product_with_minus_one_keeps_a_nan_as_it_is() {
        let nan = f32::from_bits(0x7fc0_1234);
        assert_eq!(with_sign(nan, true).to_bits(), 0x7fc0_1234);
        assert_eq!(with_sign(-0.0, true).to_bits(), 0);
        assert_eq!(with_sign(0.0, true).to_bits(), 0x8000_0000);
        assert_eq!(with_sign(f32::INFINITY, true), f32::NEG_INFINITY);
        assert_eq!(with_sign(2.5, false), 2.5);
    }
}
