//! Round trips bit for bit (random shapes, every float type, the special
//! values) and refusals of malformed blocks.

use proptest::prelude::*;

use super::*;
use crate::format::rknot::{Axis, BlockMode, BlockTable, TileGrid};

fn info(float: LosslessFloat, tile: &Tile) -> RknotTensorInfo {
    RknotTensorInfo {
        name: "t".into(),
        layer: 0,
        d_out: tile.rows,
        d_in: tile.cols,
        restrict_rows: false,
        restrict_cols: false,
        mode: BlockMode::lossless(float),
        bits: 8,
        line_axis: Axis::Rows,
        grid: TileGrid {
            compact_rows: tile.rows,
            compact_cols: tile.cols,
            block_rows: tile.rows,
            block_cols: tile.cols,
        },
        blocks: BlockTable::Listed(Vec::new()),
        sums: None,
    }
}

fn tile(rows: u64, cols: u64) -> Tile {
    Tile {
        row0: 0,
        rows,
        col0: 0,
        cols,
    }
}

/// Words of `float`'s special values: quiet and signalling NaNs with
/// payloads and either sign, infinities, zeros, subnormals, extremes.
fn specials(float: LosslessFloat) -> Vec<u32> {
    match float {
        LosslessFloat::Bf16 => vec![
            0x7fc0, 0xffc0, 0x7f81, 0xff81, 0x7fa5, 0x7f80, 0xff80, 0x0000, 0x8000, 0x0001, 0x807f,
            0x7f7f, 0xff7f, 0x0080, 0x3f80,
        ],
        LosslessFloat::F16 => vec![
            0x7e00, 0xfe00, 0x7c01, 0xfc01, 0x7d55, 0x7c00, 0xfc00, 0x0000, 0x8000, 0x0001, 0x83ff,
            0x7bff, 0xfbff, 0x0400, 0x3c00,
        ],
        LosslessFloat::F32 => vec![
            0x7fc0_0000,
            0xffc0_0000,
            0x7f80_0001,
            0xff80_0001,
            0x7fa5_a5a5,
            0x7f80_0000,
            0xff80_0000,
            0,
            0x8000_0000,
            1,
            0x807f_ffff,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x0080_0000,
            0x3f80_0000,
        ],
    }
}

fn mask(float: LosslessFloat) -> u32 {
    if float.word_bytes() == 2 {
        0xffff
    } else {
        u32::MAX
    }
}

/// Encode, decode words and f32, check bit equality and the non-finite
/// count; decode every run of rows through the codec too.
fn round_trip(float: LosslessFloat, rows: u64, cols: u64, words: &[u32]) {
    let t = tile(rows, cols);
    let ti = info(float, &t);
    let codec = Lossless(float);
    let block = pack_lossless_block(float, words);
    let (lo, hi) = codec.len_bounds(&ti, &t);
    assert!(
        (lo..=hi).contains(&(block.len() as u64)),
        "{} not in {lo}..={hi}",
        block.len()
    );
    let mut back = vec![0u32; words.len()];
    decode_lossless_words(float, &block, &mut back).unwrap();
    assert_eq!(back, words, "{float:?} {rows}x{cols}");
    let mut f = vec![0f32; words.len()];
    codec.decode_rows(&ti, &t, &block, 0..rows, &mut f).unwrap();
    for (v, &w) in f.iter().zip(words) {
        assert_eq!(v.to_bits(), float.widen(w), "{float:?} word {w:#x}");
        assert_eq!(float.narrow(v.to_bits()), Some(w));
    }
    let c = cols as usize;
    for r0 in [0, rows / 2, rows.saturating_sub(1)] {
        let r1 = rows;
        let mut part = vec![0f32; (r1 - r0) as usize * c];
        codec
            .decode_rows(&ti, &t, &block, r0..r1, &mut part)
            .unwrap();
        assert!(
            part.iter()
                .map(|v| v.to_bits())
                .eq(f[r0 as usize * c..].iter().map(|v| v.to_bits()))
        );
    }
    let nonfinite = words.iter().filter(|&&w| float.non_finite(w)).count() as u64;
    assert_eq!(codec.check(&ti, &t, &block).unwrap(), nonfinite);
    if float == LosslessFloat::Bf16 {
        let mut h = vec![0u16; words.len()];
        decode_lossless_bf16(&block, &mut h).unwrap();
        assert!(h.iter().map(|&x| u32::from(x)).eq(words.iter().copied()));
    }
}

/// Weight-like words: a few exponents common, the rest rare.
fn weightish(float: LosslessFloat, seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..n)
        .map(|_| {
            let r = next();
            let v = ((r as u32 as f32) / u32::MAX as f32 - 0.5)
                * 0.1
                * if r >> 60 == 0 { 100.0 } else { 1.0 };
            let b = v.to_bits();
            match float {
                LosslessFloat::Bf16 => b >> 16,
                LosslessFloat::F16 => u32::from(half::f16::from_f32(v).to_bits()),
                LosslessFloat::F32 => b,
            }
        })
        .collect()
}

#[test]
fn specials_all_equal_single_and_tails() {
    for float in LosslessFloat::ALL {
        let sp = specials(float);
        // The specials mixed into weights, at every tail length.
        for n in [1usize, 2, 3, 15, 16, 17, 31, 33, 100, 1000, 4099] {
            let mut w = weightish(float, n as u64, n);
            for (i, &s) in sp.iter().enumerate() {
                if i * 7 < n {
                    w[i * 7] = s;
                }
            }
            round_trip(float, 1, n as u64, &w);
        }
        // Every special alone in a block, and all equal in a big block.
        for &s in &sp {
            round_trip(float, 1, 1, &[s]);
            round_trip(float, 256, 256, &vec![s; 65536]);
        }
        round_trip(float, 3, 5, &sp[..15]);
        // Two symbols only; every symbol once (the deepest codes).
        let two: Vec<u32> = (0..999).map(|i| sp[i % 2 + 7]).collect();
        round_trip(float, 27, 37, &two);
        let all: Vec<u32> = (0..256u32)
            .map(|s| float.join(s, s * 7 % 128) & mask(float))
            .collect();
        round_trip(float, 16, 16, &all);
    }
}

#[test]
fn skewed_counts_are_length_limited() {
    // Fibonacci-like counts make a Huffman tree as deep as there are
    // symbols: the limit must fold it to 12 bits and stay complete.
    let mut freq = [0u64; 256];
    let (mut a, mut b) = (1u64, 1u64);
    for f in freq.iter_mut().take(40) {
        *f = a;
        (a, b) = (b, a + b);
    }
    let l = code_lengths(&freq, MAX_CODE_LEN);
    assert!(l.iter().all(|&x| u32::from(x) <= MAX_CODE_LEN));
    assert!(build_table(&l).is_ok());
    // A block with those counts round-trips.
    let mut words = Vec::new();
    for (s, &f) in freq.iter().enumerate().take(25) {
        for _ in 0..f.min(20000) {
            words.push(LosslessFloat::Bf16.join(s as u32, (words.len() % 128) as u32));
        }
    }
    let n = words.len();
    round_trip(LosslessFloat::Bf16, 1, n as u64, &words);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_shapes_round_trip(
        rows in 1u64..64,
        cols in 1u64..300,
        seed in any::<u64>(),
        f in 0usize..3,
        noise in any::<bool>(),
    ) {
        let float = LosslessFloat::ALL[f];
        let n = (rows * cols) as usize;
        let mut w = weightish(float, seed, n);
        if noise {
            // Uniformly random words: every symbol, NaNs included.
            let mut s = seed | 1;
            for x in w.iter_mut() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                *x = (s >> 32) as u32 & mask(float);
            }
        }
        round_trip(float, rows, cols, &w);
    }
}

fn refused(float: LosslessFloat, n: u64, block: &[u8], what: &str) {
    let t = tile(1, n);
    let ti = info(float, &t);
    let codec = Lossless(float);
    let mut out = vec![0f32; n as usize];
    let e = codec
        .decode_rows(&ti, &t, block, 0..1, &mut out)
        .unwrap_err();
    assert!(e.to_string().contains(what), "{e}");
    let c = codec.check(&ti, &t, block).unwrap_err();
    assert_eq!(c.to_string(), e.to_string());
}

#[test]
fn malformed_blocks_are_refused() {
    let float = LosslessFloat::Bf16;
    let words = weightish(float, 5, 1000);
    let good = pack_lossless_block(float, &words);
    assert_eq!(good[0], KIND_CODED);
    // Code lengths: one raised past 12 (nibble 13), oversubscribed, incomplete.
    let sym = (1..129).find(|&i| good[i] & 0xf != 0).unwrap();
    let mut long = good.clone();
    long[sym] = (long[sym] & 0xf0) | 13;
    refused(float, 1000, &long, "longest allowed is 12");
    let mut over = good.clone();
    let spare = (1..129).find(|&i| good[i] == 0).unwrap();
    over[spare] = 1;
    refused(float, 1000, &over, "oversubscribed");
    // The shortest code one bit longer (another is longer: below 12).
    let mut incomplete = good.clone();
    let short = (1..129)
        .filter(|&i| good[i] & 0xf != 0)
        .min_by_key(|&i| good[i] & 0xf)
        .unwrap();
    incomplete[short] = (good[short] & 0xf0) | ((good[short] & 0xf) + 1);
    refused(float, 1000, &incomplete, "incomplete");
    let mut one = good.clone();
    one[1..129].fill(0);
    one[1] = 1;
    refused(float, 1000, &one, "incomplete");
    // Stream lengths: moving a byte from stream 0 to stream 1 keeps the
    // total but the codes no longer end where the streams do.
    let mut shifted = good.clone();
    let l0 = u32::from_le_bytes(shifted[129..133].try_into().unwrap());
    let l1 = u32::from_le_bytes(shifted[133..137].try_into().unwrap());
    shifted[129..133].copy_from_slice(&(l0 - 1).to_le_bytes());
    shifted[133..137].copy_from_slice(&(l1 + 1).to_le_bytes());
    refused(float, 1000, &shifted, "stream 0 is");
    // A stream longer than declared (a huge length) or the block cut short.
    let mut huge = good.clone();
    huge[129..133].copy_from_slice(&u32::MAX.to_le_bytes());
    refused(float, 1000, &huge, "make");
    refused(float, 1000, &good[..good.len() - 1], "make");
    refused(float, 1000, &good[..100], "needed");
    let mut longer = good.clone();
    longer.push(0);
    refused(float, 1000, &longer, "make");
    // Too many values for the block: raw section short.
    refused(float, 1001, &good, "make");
    refused(float, 1000, &[], "empty");
    refused(float, 1000, &[7], "kind 7");
    // Constant blocks: raw section truncated or too long.
    let c = pack_lossless_block(float, &[0x3f80; 100]);
    assert_eq!(c[0], KIND_CONSTANT);
    refused(float, 100, &c[..c.len() - 1], "needed");
    refused(float, 99, &c, "needed");
    refused(float, 100, &c[..1], "needed");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any corruption of a valid block decodes or is refused, never panics.
    #[test]
    fn corrupted_blocks_never_panic(
        seed in any::<u64>(),
        f in 0usize..3,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<Option<usize>>(),
    ) {
        let float = LosslessFloat::ALL[f];
        let n = 1 + (seed % 700) as usize;
        let words = weightish(float, seed, n);
        let mut block = pack_lossless_block(float, &words);
        for (at, x) in flips {
            let i = at % block.len();
            block[i] ^= x;
        }
        if let Some(c) = cut {
            block.truncate(c % (block.len() + 1));
        }
        let t = tile(1, n as u64);
        let ti = info(float, &t);
        let mut out = vec![0f32; n];
        let _ = Lossless(float).decode_rows(&ti, &t, &block, 0..1, &mut out);
        let _ = Lossless(float).check(&ti, &t, &block);
    }
}

#[test]
fn f16_conversions_are_exact() {
    for h in 0..=u16::MAX {
        let b = f16_to_f32_bits(h);
        let v = f32::from_bits(b);
        if !v.is_nan() {
            assert_eq!(v, half::f16::from_bits(h).to_f32(), "{h:#x}");
        } else {
            assert_eq!(b >> 13 & 0x3ff, u32::from(h & 0x3ff));
        }
        assert_eq!(LosslessFloat::F16.narrow(b), Some(u32::from(h)), "{h:#x}");
    }
    assert_eq!(LosslessFloat::F16.narrow(1.0e-10f32.to_bits()), None);
    assert_eq!(LosslessFloat::F16.narrow(70000f32.to_bits()), None);
    assert_eq!(LosslessFloat::Bf16.narrow(0x3f80_0001), None);
}

/// The example block of docs/FORMAT.md section 6.7.
#[test]
fn format_example() {
    let block = pack_lossless_block(LosslessFloat::Bf16, &[0x3f80, 0x4000, 0x3f80, 0xbf80]);
    let mut want = vec![0u8; 129];
    want[64] = 0x10;
    want[65] = 0x01;
    for _ in 0..4 {
        want.extend_from_slice(&[1, 0, 0, 0]);
    }
    want.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0x80]);
    assert_eq!(block, want);
}
