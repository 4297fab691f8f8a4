//! Lossless blocks (docs/FORMAT.md section 6.3.1): a tile's bf16, f16 or
//! f32 words stored exactly. Each word is split into an 8-bit *symbol*
//! (the exponent of bf16 and f32, the high byte of f16) that is
//! entropy-coded, and a *raw* part (sign and mantissa: 1 byte for bf16 and
//! f16, 3 for f32) stored as it is, byte aligned, so the decoder copies it.
//!
//! Why this split: a weight's exponent takes few values (about 2.6 bits of
//! information in 8 for bf16 checkpoints) while its sign and mantissa are
//! close to uniform, so coding only the exponent gets nearly all of the
//! order-0 gain and leaves the raw bytes to a plain load.
//!
//! ```text
//! coded:    [u8 0] [128 B: 256 code lengths, 4 bits each] [4 x u32 LE stream lengths]
//!           [stream 0] [stream 1] [stream 2] [stream 3] [raw: n x R bytes]
//! constant: [u8 1] [u8 symbol] [raw: n x R bytes]
//! ```
//! The codes are canonical Huffman codes as DEFLATE assigns them (RFC 1951
//! §3.2.2), at most [`MAX_CODE_LEN`] bits, each packed into an LSB-first
//! bit stream most significant code bit first (DEFLATE's order). Value `i`
//! of the tile (row-major) has its code in stream `i % 4`: four
//! independent streams let the decoder keep four table lookups in flight
//! (one stream's next position depends on the code it is decoding).
//! Decoding is one 4096-entry table lookup per value.
//!
//! Every block is checked before any value is trusted: code lengths at
//! most 12 and a complete prefix code (Kraft sum exactly 1: no
//! oversubscribed or incomplete table), lengths that add up to the block,
//! and each stream exactly as long as its codes (a stream that its codes
//! run past, or with bytes they never reach, is refused).

use std::ops::Range;

use super::{BlockCodec, Coding};
use crate::error::{ErrorKind, Result, err};
use crate::format::rknot::{RknotTensorInfo, Tile};

/// The float type a lossless block stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LosslessFloat {
    Bf16,
    F16,
    F32,
}

impl LosslessFloat {
    pub const ALL: [LosslessFloat; 3] =
        [LosslessFloat::Bf16, LosslessFloat::F16, LosslessFloat::F32];

    pub fn name(self) -> &'static str {
        match self {
            LosslessFloat::Bf16 => "bf16",
            LosslessFloat::F16 => "f16",
            LosslessFloat::F32 => "f32",
        }
    }

    /// Bytes of a word.
    pub fn word_bytes(self) -> usize {
        match self {
            LosslessFloat::Bf16 | LosslessFloat::F16 => 2,
            LosslessFloat::F32 => 4,
        }
    }

    /// Bytes of a value's raw part.
    pub fn raw_bytes(self) -> usize {
        match self {
            LosslessFloat::Bf16 | LosslessFloat::F16 => 1,
            LosslessFloat::F32 => 3,
        }
    }

    /// A word's symbol and raw part.
    #[inline]
    pub fn split(self, w: u32) -> (u8, u32) {
        match self {
            // s eeeeeeee mmmmmmm: symbol = exponent, raw = s mmmmmmm.
            LosslessFloat::Bf16 => (((w >> 7) & 0xff) as u8, ((w >> 8) & 0x80) | (w & 0x7f)),
            // s eeeee mm | mmmmmmmm: symbol = high byte, raw = low byte.
            LosslessFloat::F16 => (((w >> 8) & 0xff) as u8, w & 0xff),
            // s eeeeeeee m{23}: symbol = exponent, raw = s m{23}.
            LosslessFloat::F32 => (
                ((w >> 23) & 0xff) as u8,
                ((w >> 8) & 0x80_0000) | (w & 0x7f_ffff),
            ),
        }
    }

    /// The word of a symbol and raw part ([`Self::split`]'s inverse).
    #[inline(always)]
    pub fn join(self, sym: u32, raw: u32) -> u32 {
        match self {
            LosslessFloat::Bf16 => ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7f),
            LosslessFloat::F16 => (sym << 8) | raw,
            LosslessFloat::F32 => ((raw & 0x80_0000) << 8) | (sym << 23) | (raw & 0x7f_ffff),
        }
    }

    /// The f32 bits of a word's value, exactly: every value widens to f32
    /// without rounding, and a NaN keeps its sign and payload (shifted) and
    /// its quiet bit, so a signalling NaN stays signalling (the `half`
    /// crate's conversion sets the quiet bit).
    #[inline]
    pub fn widen(self, w: u32) -> u32 {
        match self {
            LosslessFloat::Bf16 => w << 16,
            LosslessFloat::F32 => w,
            LosslessFloat::F16 => f16_to_f32_bits(w as u16),
        }
    }

    /// The word whose value is f32 `bits`, if this type holds it exactly
    /// ([`Self::widen`]'s inverse).
    pub fn narrow(self, bits: u32) -> Option<u32> {
        let w = match self {
            LosslessFloat::Bf16 => bits >> 16,
            LosslessFloat::F32 => bits,
            LosslessFloat::F16 => f32_bits_to_f16(bits)?,
        };
        (self.widen(w) == bits).then_some(w)
    }

    /// Whether word `w` is an infinity or a NaN.
    pub fn non_finite(self, w: u32) -> bool {
        match self {
            LosslessFloat::Bf16 => w & 0x7f80 == 0x7f80,
            LosslessFloat::F16 => w & 0x7c00 == 0x7c00,
            LosslessFloat::F32 => w & 0x7f80_0000 == 0x7f80_0000,
        }
    }
}

/// f16 bits to f32 bits, exact (subnormals normalized; NaN payload and
/// quiet bit kept).
fn f16_to_f32_bits(h: u16) -> u32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    match exp {
        0x1f => sign | 0x7f80_0000 | (man << 13),
        0 if man == 0 => sign,
        0 => {
            // Subnormal: man * 2^-24. Normalize: shift until bit 10 is set.
            let shift = man.leading_zeros() - 21;
            let m = (man << shift) & 0x3ff;
            let e = 127 - 15 + 1 - shift;
            sign | (e << 23) | (m << 13)
        }
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    }
}

/// The f16 word for f32 bits when the value (or NaN) is one f16 holds;
/// None otherwise ([`LosslessFloat::narrow`] checks by widening back).
fn f32_bits_to_f16(b: u32) -> Option<u32> {
    let sign = (b >> 16) & 0x8000;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return Some(sign | 0x7c00 | (man >> 13));
    }
    if exp == 0 {
        // f32 subnormals are far below f16's smallest subnormal: only zero.
        return (man == 0).then_some(sign);
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return None;
    }
    if e >= 1 {
        return Some(sign | ((e as u32) << 10) | (man >> 13));
    }
    // Subnormal f16: value = (1.m) * 2^(exp-127) = k * 2^-24.
    let shift = 14 - e; // bits of the 24-bit significand dropped
    if shift > 24 {
        return None;
    }
    let full = man | 0x80_0000;
    Some(sign | (full >> (shift as u32)))
}

/// Longest code, in bits; the decode table has `2^MAX_CODE_LEN` entries.
pub const MAX_CODE_LEN: u32 = 12;
/// Interleaved bit streams per coded block.
pub const STREAMS: usize = 4;
const TABLE_SIZE: usize = 1 << MAX_CODE_LEN;
const KIND_CODED: u8 = 0;
const KIND_CONSTANT: u8 = 1;
/// Bytes before a coded block's streams: kind, code lengths, stream lengths.
pub const CODED_HEADER: usize = 1 + 128 + 4 * STREAMS;
/// Bytes before a constant block's raw section.
const CONSTANT_HEADER: usize = 2;
/// Values decoded per fast-loop round: 4 per stream. After one refill a
/// stream's 64-bit window holds at least 57 unread bits, 4 codes take at
/// most 48.
const ROUND: usize = 4 * STREAMS;

pub(super) struct Lossless(pub(super) LosslessFloat);

/// A block's parts, checked against its length.
struct Parts<'a> {
    float: LosslessFloat,
    n: usize,
    body: Body<'a>,
    raw: &'a [u8],
}

enum Body<'a> {
    Constant(u8),
    Coded {
        table: Box<[u16; TABLE_SIZE]>,
        /// The streams (and everything after them, which the fast loop may
        /// load from but never decodes).
        from_streams: &'a [u8],
        /// Byte offsets of each stream in `from_streams`, and their lengths.
        starts: [usize; STREAMS],
        lens: [usize; STREAMS],
    },
}

fn bad(kind: ErrorKind, msg: String) -> crate::Error {
    err(kind, format!("lossless block: {msg}"))
}

/// Check the code lengths (at most 12, a complete prefix code over at
/// least two symbols) and build the decode table: entry `x` (the next 12
/// bits of the stream, first bit lowest) is `symbol << 4 | length`.
fn build_table(lengths: &[u8; 256]) -> Result<Box<[u16; TABLE_SIZE]>> {
    let mut count = [0u32; MAX_CODE_LEN as usize + 1];
    for (s, &l) in lengths.iter().enumerate() {
        if u32::from(l) > MAX_CODE_LEN {
            return Err(bad(
                ErrorKind::BadValue,
                format!("symbol {s} has a code of {l} bits, the longest allowed is {MAX_CODE_LEN}"),
            ));
        }
        count[l as usize] += 1;
    }
    let used: u32 = count[1..].iter().sum();
    let kraft: u32 = (1..=MAX_CODE_LEN as usize)
        .map(|l| count[l] << (MAX_CODE_LEN as usize - l))
        .sum();
    if used < 2 || kraft != 1 << MAX_CODE_LEN {
        let what = if kraft > 1 << MAX_CODE_LEN {
            "oversubscribed"
        } else {
            "incomplete"
        };
        return Err(bad(
            ErrorKind::BadValue,
            format!(
                "the code lengths are {what} ({used} symbols, Kraft sum {kraft}/{}): a coded \
                 block needs a complete prefix code of at least 2 symbols",
                1 << MAX_CODE_LEN
            ),
        ));
    }
    let codes = canonical_codes(lengths);
    let mut table = Box::new([0u16; TABLE_SIZE]);
    for (s, (&l, &c)) in lengths.iter().zip(codes.iter()).enumerate() {
        if l == 0 {
            continue;
        }
        let rev = reverse(c, l);
        let entry = ((s as u16) << 4) | u16::from(l);
        let mut x = rev as usize;
        while x < TABLE_SIZE {
            table[x] = entry;
            x += 1 << l;
        }
    }
    Ok(table)
}

/// Canonical codes for `lengths`, as DEFLATE assigns them: shorter codes
/// first, codes of one length in symbol order.
fn canonical_codes(lengths: &[u8; 256]) -> [u32; 256] {
    let mut count = [0u32; 16];
    for &l in lengths {
        count[l as usize] += 1;
    }
    count[0] = 0;
    let mut next = [0u32; 16];
    let mut code = 0u32;
    for l in 1..16 {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    let mut codes = [0u32; 256];
    for (s, &l) in lengths.iter().enumerate() {
        if l > 0 {
            codes[s] = next[l as usize];
            next[l as usize] += 1;
        }
    }
    codes
}

/// The low `len` bits of `code`, reversed (a code's first bit, its most
/// significant, goes first into the LSB-first stream).
fn reverse(code: u32, len: u8) -> u32 {
    code.reverse_bits() >> (32 - u32::from(len))
}

fn parts<'a>(float: LosslessFloat, tile: &Tile, bytes: &'a [u8]) -> Result<Parts<'a>> {
    let n = usize::try_from(tile.rows * tile.cols).unwrap_or(usize::MAX);
    let raw_len = n.saturating_mul(float.raw_bytes());
    let Some(&kind) = bytes.first() else {
        return Err(bad(ErrorKind::LengthMismatch, "empty block".into()));
    };
    let short = |need: usize| {
        bad(
            ErrorKind::LengthMismatch,
            format!(
                "{} bytes for a tile of {n} {} values, {need} needed",
                bytes.len(),
                float.name()
            ),
        )
    };
    match kind {
        KIND_CONSTANT => {
            let want = CONSTANT_HEADER.saturating_add(raw_len);
            if bytes.len() != want {
                return Err(short(want));
            }
            Ok(Parts {
                float,
                n,
                body: Body::Constant(bytes[1]),
                raw: &bytes[CONSTANT_HEADER..],
            })
        }
        KIND_CODED => {
            if bytes.len() < CODED_HEADER {
                return Err(short(CODED_HEADER.saturating_add(raw_len)));
            }
            let mut lengths = [0u8; 256];
            for (s, l) in lengths.iter_mut().enumerate() {
                let b = bytes[1 + s / 2];
                *l = if s % 2 == 0 { b & 0xf } else { b >> 4 };
            }
            let table = build_table(&lengths)?;
            let mut lens = [0usize; STREAMS];
            let mut starts = [0usize; STREAMS];
            let mut total = 0u64;
            for (j, l) in lens.iter_mut().enumerate() {
                let at = 129 + 4 * j;
                let v =
                    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
                starts[j] = total as usize;
                total += u64::from(v);
                *l = v as usize;
                if total > bytes.len() as u64 {
                    break;
                }
            }
            let want = CODED_HEADER as u64 + total + raw_len as u64;
            if bytes.len() as u64 != want {
                return Err(bad(
                    ErrorKind::LengthMismatch,
                    format!(
                        "{} bytes, but its header, streams of {lens:?} bytes and {raw_len} raw \
                         bytes for {n} values make {want}",
                        bytes.len()
                    ),
                ));
            }
            let from_streams = &bytes[CODED_HEADER..];
            let raw = &from_streams[total as usize..];
            Ok(Parts {
                float,
                n,
                body: Body::Coded {
                    table,
                    from_streams,
                    starts,
                    lens,
                },
                raw,
            })
        }
        k => Err(bad(
            ErrorKind::BadValue,
            format!("kind {k} is not 0 (coded) or 1 (constant)"),
        )),
    }
}

/// The raw part of value `i` (`R` bytes, little endian).
#[inline(always)]
fn raw_at<const R: usize>(raw: &[u8], i: usize) -> u32 {
    if R == 1 {
        u32::from(raw[i])
    } else {
        let r = &raw[i * R..i * R + R];
        u32::from(r[0]) | (u32::from(r[1]) << 8) | (u32::from(r[2]) << 16)
    }
}

/// 8 bytes of `data` from `at`, little endian; bytes past the end read 0.
#[inline]
fn load_padded(data: &[u8], at: usize) -> u64 {
    let mut eight = [0u8; 8];
    if let Some(src) = data.get(at..) {
        let k = src.len().min(8);
        eight[..k].copy_from_slice(&src[..k]);
    }
    u64::from_le_bytes(eight)
}

#[inline(always)]
fn load8(data: &[u8], at: usize) -> u64 {
    let mut eight = [0u8; 8];
    eight.copy_from_slice(&data[at..at + 8]);
    u64::from_le_bytes(eight)
}

impl Parts<'_> {
    /// Decode every value of the block into `out` (`n` entries) as
    /// `emit(symbol, raw)`, checking each stream's length against its
    /// codes. `R` is the raw width in bytes.
    #[inline(always)]
    fn decode_with<T: Copy, const R: usize>(
        &self,
        out: &mut [T],
        emit: impl Fn(u32, u32) -> T,
    ) -> Result<()> {
        debug_assert_eq!(R, self.float.raw_bytes());
        let n = self.n;
        let out = &mut out[..n];
        let raw = &self.raw[..n * R];
        let (table, data, starts, lens) = match &self.body {
            Body::Constant(sym) => {
                let sym = u32::from(*sym);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = emit(sym, raw_at::<R>(raw, i));
                }
                return Ok(());
            }
            Body::Coded {
                table,
                from_streams,
                starts,
                lens,
            } => (&**table, *from_streams, starts, lens),
        };
        let mut pos = starts.map(|s| s * 8);
        // Fast rounds while every stream has 8 bytes to load from its
        // position (within the block: the checks below catch a stream whose
        // codes ran into the next one's bytes).
        let rounds = n / ROUND;
        let mut done = 0usize;
        // None when the data is too short for any 8-byte load.
        let limit = data.len().checked_sub(8);
        for (oc, rc) in out
            .chunks_exact_mut(ROUND)
            .zip(raw.chunks_exact(ROUND * R))
            .take(rounds)
        {
            let Some(limit) = limit else { break };
            if pos.iter().any(|&p| p / 8 > limit) {
                break;
            }
            // Each value written as soon as its code is looked up: the four
            // streams' lookup chains are independent, so the CPU overlaps
            // them. Positions stay below 8 * data.len() + 48 (checked
            // above), far from overflowing: plain wrapping adds.
            for (j, p) in pos.iter_mut().enumerate() {
                let mut window = load8(data, *p / 8) >> (*p % 8);
                let mut used = 0u32;
                for k in 0..4 {
                    let e = u32::from(table[(window & (TABLE_SIZE as u64 - 1)) as usize]);
                    let len = e & 0xf;
                    window >>= len;
                    used = used.wrapping_add(len);
                    let i = k * STREAMS + j;
                    oc[i] = emit(e >> 4, raw_at::<R>(rc, i));
                }
                *p = p.wrapping_add(used as usize);
            }
            done += ROUND;
        }
        // The rest one value at a time, loads padded with zeros.
        for (i, o) in out.iter_mut().enumerate().skip(done) {
            let j = i % STREAMS;
            let p = pos[j];
            let window = load_padded(data, p / 8) >> (p % 8);
            let e = u32::from(table[(window & (TABLE_SIZE as u64 - 1)) as usize]);
            pos[j] = p + (e & 0xf) as usize;
            *o = emit(e >> 4, raw_at::<R>(raw, i));
        }
        for j in 0..STREAMS {
            let used = pos[j] - starts[j] * 8;
            if used.div_ceil(8) != lens[j] {
                return Err(bad(
                    ErrorKind::LengthMismatch,
                    format!(
                        "stream {j} is {} bytes, its codes take {used} bits",
                        lens[j]
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every value's f32 bits.
    fn decode_f32(&self, out: &mut [f32]) -> Result<()> {
        match self.float {
            LosslessFloat::Bf16 => self.decode_with::<f32, 1>(out, |s, r| {
                f32::from_bits(LosslessFloat::Bf16.join(s, r) << 16)
            }),
            LosslessFloat::F32 => self
                .decode_with::<f32, 3>(out, |s, r| f32::from_bits(LosslessFloat::F32.join(s, r))),
            LosslessFloat::F16 => self.decode_with::<f32, 1>(out, |s, r| {
                f32::from_bits(f16_to_f32_bits(LosslessFloat::F16.join(s, r) as u16))
            }),
        }
    }

    /// Every value's word.
    fn decode_words(&self, out: &mut [u32]) -> Result<()> {
        match self.float {
            LosslessFloat::Bf16 => {
                self.decode_with::<u32, 1>(out, |s, r| LosslessFloat::Bf16.join(s, r))
            }
            LosslessFloat::F16 => {
                self.decode_with::<u32, 1>(out, |s, r| LosslessFloat::F16.join(s, r))
            }
            LosslessFloat::F32 => {
                self.decode_with::<u32, 3>(out, |s, r| LosslessFloat::F32.join(s, r))
            }
        }
    }
}

/// Decode a lossless bf16 block of `out.len()` values into their bf16
/// words (the hot path the benchmark measures; the mount's decode is the
/// same loop writing f32).
pub fn decode_lossless_bf16(bytes: &[u8], out: &mut [u16]) -> Result<()> {
    let tile = flat_tile(out.len());
    let p = parts(LosslessFloat::Bf16, &tile, bytes)?;
    p.decode_with::<u16, 1>(out, |s, r| LosslessFloat::Bf16.join(s, r) as u16)
}

/// Decode a lossless block of `out.len()` values of `float` into their
/// words (low 16 bits for bf16 and f16).
pub fn decode_lossless_words(float: LosslessFloat, bytes: &[u8], out: &mut [u32]) -> Result<()> {
    let tile = flat_tile(out.len());
    parts(float, &tile, bytes)?.decode_words(out)
}

fn flat_tile(n: usize) -> Tile {
    Tile {
        row0: 0,
        rows: 1,
        col0: 0,
        cols: n as u64,
    }
}

/// Huffman code lengths for symbol counts `freq`, none longer than
/// `max` bits: an optimal (Huffman) code, then, if it is too deep, the
/// lengths folded to `max` and the Kraft sum repaired by lengthening the
/// deepest codes that fit (the way miniz and zlib limit theirs), the
/// shortest codes given to the most frequent symbols.
pub fn code_lengths(freq: &[u64; 256], max: u32) -> [u8; 256] {
    let mut lengths = [0u8; 256];
    let used: Vec<usize> = (0..256).filter(|&s| freq[s] > 0).collect();
    if used.len() < 2 {
        return lengths;
    }
    // Huffman tree: nodes 0..m are leaves, then internal nodes.
    let m = used.len();
    let mut parent = vec![0usize; 2 * m - 1];
    let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>> = used
        .iter()
        .enumerate()
        .map(|(i, &s)| std::cmp::Reverse((freq[s], i)))
        .collect();
    let mut next = m;
    while heap.len() > 1 {
        let std::cmp::Reverse((wa, a)) = heap.pop().unwrap_or(std::cmp::Reverse((0, 0)));
        let std::cmp::Reverse((wb, b)) = heap.pop().unwrap_or(std::cmp::Reverse((0, 0)));
        parent[a] = next;
        parent[b] = next;
        heap.push(std::cmp::Reverse((wa + wb, next)));
        next += 1;
    }
    let root = next - 1;
    // Depth of each node: parents have larger ids, so walk down from the root.
    let mut depth = vec![0u32; 2 * m - 1];
    for v in (0..root).rev() {
        depth[v] = depth[parent[v]] + 1;
    }
    let mut count = vec![0u32; 64];
    for d in &depth[..m] {
        count[(*d as usize).min(63)] += 1;
    }
    let max = max as usize;
    for d in max + 1..64 {
        count[max] += count[d];
        count[d] = 0;
    }
    let mut kraft: u64 = (1..=max).map(|l| u64::from(count[l]) << (max - l)).sum();
    while kraft > 1 << max {
        count[max] -= 1;
        for l in (1..max).rev() {
            if count[l] != 0 {
                count[l] -= 1;
                count[l + 1] += 2;
                break;
            }
        }
        kraft -= 1;
    }
    // Most frequent symbols get the shortest codes.
    let mut by_freq = used.clone();
    by_freq.sort_by(|&a, &b| freq[b].cmp(&freq[a]).then(a.cmp(&b)));
    let mut it = by_freq.into_iter();
    for (l, &c) in count.iter().enumerate().take(max + 1).skip(1) {
        for _ in 0..c {
            if let Some(s) = it.next() {
                lengths[s] = l as u8;
            }
        }
    }
    lengths
}

/// LSB-first bit stream writer of the encoder.
#[derive(Default)]
struct Stream {
    out: Vec<u8>,
    acc: u64,
    have: u32,
}

impl Stream {
    fn push(&mut self, code: u32, len: u32) {
        self.acc |= u64::from(code) << self.have;
        self.have += len;
        while self.have >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.have -= 8;
        }
    }
    fn finish(mut self) -> Vec<u8> {
        if self.have > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// The lossless block of `words` (a tile's values row-major, each the low
/// 16 bits for bf16 and f16; higher bits ignored).
pub fn pack_lossless_block(float: LosslessFloat, words: &[u32]) -> Vec<u8> {
    let mut freq = [0u64; 256];
    let mut raw = Vec::with_capacity(words.len() * float.raw_bytes());
    let mut syms = Vec::with_capacity(words.len());
    for &w in words {
        let (s, r) = float.split(w);
        freq[usize::from(s)] += 1;
        syms.push(s);
        raw.extend_from_slice(&r.to_le_bytes()[..float.raw_bytes()]);
    }
    let distinct = freq.iter().filter(|&&f| f > 0).count();
    if distinct <= 1 {
        let mut out = vec![KIND_CONSTANT, syms.first().copied().unwrap_or(0)];
        out.extend_from_slice(&raw);
        return out;
    }
    let lengths = code_lengths(&freq, MAX_CODE_LEN);
    let codes = canonical_codes(&lengths);
    let rev: Vec<(u32, u32)> = (0..256)
        .map(|s| {
            let l = lengths[s];
            if l == 0 {
                (0, 0)
            } else {
                (reverse(codes[s], l), u32::from(l))
            }
        })
        .collect();
    let mut streams: [Stream; STREAMS] = Default::default();
    for (i, &s) in syms.iter().enumerate() {
        let (c, l) = rev[usize::from(s)];
        streams[i % STREAMS].push(c, l);
    }
    let streams = streams.map(Stream::finish);
    let mut out =
        Vec::with_capacity(CODED_HEADER + streams.iter().map(Vec::len).sum::<usize>() + raw.len());
    out.push(KIND_CODED);
    for pair in lengths.chunks_exact(2) {
        out.push(pair[0] | (pair[1] << 4));
    }
    for s in &streams {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    }
    for s in &streams {
        out.extend_from_slice(s);
    }
    out.extend_from_slice(&raw);
    out
}

impl BlockCodec for Lossless {
    fn len_bounds(&self, _t: &RknotTensorInfo, tile: &Tile) -> (u64, u64) {
        let n = tile.rows * tile.cols;
        let raw = n * self.0.raw_bytes() as u64;
        // Each stream holds at most ceil(n / 4) codes of at most 12 bits.
        let stream = (n.div_ceil(STREAMS as u64) * u64::from(MAX_CODE_LEN)).div_ceil(8);
        (
            CONSTANT_HEADER as u64 + raw,
            CODED_HEADER as u64 + STREAMS as u64 * stream + raw,
        )
    }

    fn decode_rows(
        &self,
        _t: &RknotTensorInfo,
        tile: &Tile,
        bytes: &[u8],
        rows: Range<u64>,
        out: &mut [f32],
    ) -> Result<()> {
        let p = parts(self.0, tile, bytes)?;
        // The streams interleave every value of the tile: decode it all
        // (also checking the whole block), then keep the rows asked for.
        if rows.start == 0 && rows.end == tile.rows {
            return p.decode_f32(out);
        }
        let mut all = vec![0f32; p.n];
        p.decode_f32(&mut all)?;
        let c = tile.cols as usize;
        out.copy_from_slice(&all[rows.start as usize * c..rows.end as usize * c]);
        Ok(())
    }

    fn check(&self, _t: &RknotTensorInfo, tile: &Tile, bytes: &[u8]) -> Result<u64> {
        let p = parts(self.0, tile, bytes)?;
        let mut words = vec![0u32; p.n];
        p.decode_words(&mut words)?;
        Ok(words.iter().filter(|&&w| self.0.non_finite(w)).count() as u64)
    }

    fn widths(&self, _coding: &Coding, tile: &Tile) -> Vec<u8> {
        vec![(self.0.word_bytes() * 8) as u8; (tile.rows * tile.cols) as usize]
    }

    /// `codes` are the words; `scale` is unused.
    fn pack(&self, _coding: &Coding, _tile: &Tile, _scale: f32, codes: &[u32]) -> Vec<u8> {
        pack_lossless_block(self.0, codes)
    }

    /// Values this type does not hold exactly are narrowed by truncation
    /// (encoders check [`LosslessFloat::narrow`] first).
    fn encode_tile(&self, _coding: &Coding, _tile: &Tile, values: &[f32]) -> Vec<u8> {
        let words: Vec<u32> = values
            .iter()
            .map(|v| {
                let b = v.to_bits();
                self.0.narrow(b).unwrap_or(match self.0 {
                    LosslessFloat::Bf16 => b >> 16,
                    LosslessFloat::F16 => u32::from(half::f16::from_f32(*v).to_bits()),
                    LosslessFloat::F32 => b,
                })
            })
            .collect();
        pack_lossless_block(self.0, &words)
    }
}

#[cfg(test)]
mod tests;
