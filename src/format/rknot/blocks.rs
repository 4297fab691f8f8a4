//! Where each block of a .rknot tensor lies in the file.
//!
//! - Version 2 listed every block's `[offset, length]` in the JSON header
//!   (about 18 bytes per block: 8 MB of SmolLM2's 74 MB file at 5 bits per
//!   weight). [`BlockTable::Listed`] keeps those pairs.
//! - Version 3 stores a tensor's blocks back to back and only their lengths,
//!   as `base + step * v` with each `v` a `bits`-bit integer in the binary
//!   block index (docs/FORMAT.md §6.5). The lengths of one tensor take few
//!   distinct values (a faithful block's length is `5 + 32 * width`), so
//!   `v` needs 0 to 4 bits: 0.2% of the file. [`PackedLengths`] keeps the
//!   packed values as stored plus the offset of every 64th block, so finding
//!   a block sums at most 63 lengths, all in memory: no read of any other
//!   block.

use crate::error::{ErrorKind, Result, add, err, mul};

/// Blocks per anchor: a lookup sums at most `ANCHOR_EVERY - 1` lengths.
pub const ANCHOR_EVERY: u64 = 64;

/// Largest `bits` of a length code: a block is at most
/// `4 + 65536 + 65536 * 16 / 8` bytes, which needs 18 bits; 32 is the
/// format's limit.
pub const MAX_LENGTH_BITS: u64 = 32;

/// A tensor's blocks, in block order (row-tile major).
#[derive(Debug, Clone)]
pub enum BlockTable {
    /// Version 2: absolute offset and length of every block, as listed.
    Listed(Vec<(u64, u32)>),
    /// Version 3: back-to-back blocks with packed lengths.
    Packed(PackedLengths),
}

impl BlockTable {
    /// Number of blocks.
    pub fn len(&self) -> u64 {
        match self {
            BlockTable::Listed(v) => v.len() as u64,
            BlockTable::Packed(p) => p.n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Absolute file offset and length of block `b`; None past the end.
    pub fn get(&self, b: u64) -> Option<(u64, u32)> {
        match self {
            BlockTable::Listed(v) => v.get(usize::try_from(b).ok()?).copied(),
            BlockTable::Packed(p) => p.get(b),
        }
    }

    /// Bytes of all blocks together.
    pub fn stored_bytes(&self) -> u64 {
        match self {
            BlockTable::Listed(v) => v.iter().map(|&(_, l)| u64::from(l)).sum(),
            BlockTable::Packed(p) => p.total,
        }
    }

    /// Every block's absolute offset and length in block order, each found
    /// from the one before (a lookup by [`Self::get`] may sum up to 63
    /// lengths: a scan of all blocks by it costs 32 times this).
    pub fn iter(&self) -> Blocks<'_> {
        Blocks {
            table: self,
            next: 0,
            offset: match self {
                BlockTable::Listed(_) => 0,
                BlockTable::Packed(p) => p.start,
            },
        }
    }

    /// Version 3: absolute offset and byte length of all the blocks, which
    /// lie back to back (without visiting any block); None for version 2,
    /// whose blocks may lie anywhere.
    pub fn extent(&self) -> Option<(u64, u64)> {
        match self {
            BlockTable::Listed(_) => None,
            BlockTable::Packed(p) => Some((p.start, p.total)),
        }
    }

    /// Offset of the first block, if there is one.
    pub fn first_offset(&self) -> Option<u64> {
        self.get(0).map(|(o, _)| o)
    }

    /// Absolute offset and byte length of blocks `[b0, b1)` (`b0 < b1 <=
    /// n`), which lie back to back in version 3; None otherwise (version 2
    /// lists each block wherever it likes).
    pub fn span(&self, b0: u64, b1: u64) -> Option<(u64, u64)> {
        if let BlockTable::Listed(_) = self {
            return None;
        }
        let (start, _) = self.get(b0)?;
        let (last, len) = self.get(b1.checked_sub(1)?)?;
        Some((start, last.checked_add(u64::from(len))?.checked_sub(start)?))
    }
}

/// Iterator of [`BlockTable::iter`].
#[derive(Clone)]
pub struct Blocks<'a> {
    table: &'a BlockTable,
    next: u64,
    /// Version 3: where block `next` starts.
    offset: u64,
}

impl Iterator for Blocks<'_> {
    type Item = (u64, u32);
    fn next(&mut self) -> Option<(u64, u32)> {
        let b = self.next;
        let found = match self.table {
            BlockTable::Listed(v) => v.get(usize::try_from(b).ok()?).copied()?,
            BlockTable::Packed(p) => {
                if b >= p.n {
                    return None;
                }
                let len = u32::try_from(p.length(b).ok()?).ok()?;
                let at = self.offset;
                self.offset = at.checked_add(u64::from(len))?;
                (at, len)
            }
        };
        self.next += 1;
        Some(found)
    }
}

/// How a version-3 tensor's block lengths are coded (its `block_lengths`
/// header field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LengthCode {
    /// Byte offset of the packed values in the block index.
    pub at: u64,
    pub base: u64,
    pub step: u64,
    pub bits: u64,
}

impl LengthCode {
    /// The code for `lengths`: base the smallest, step the greatest common
    /// divisor of the differences, bits the fewest that hold the largest
    /// value (0 when every length is the same). `at` is left 0.
    pub fn for_lengths(lengths: &[u32]) -> LengthCode {
        let Some(&base) = lengths.iter().min() else {
            return LengthCode::default();
        };
        let step = lengths.iter().fold(0u32, |g, &l| gcd(g, l - base)).max(1);
        let top = lengths
            .iter()
            .map(|&l| (l - base) / step)
            .max()
            .unwrap_or(0);
        let bits = u64::from(u32::BITS - top.leading_zeros());
        LengthCode {
            at: 0,
            base: u64::from(base),
            step: if bits == 0 { 0 } else { u64::from(step) },
            bits,
        }
    }

    /// Bytes the packed values of `n` blocks take.
    pub fn packed_len(&self, n: u64) -> Result<u64> {
        Ok(mul(n, self.bits, "block index bits")?.div_ceil(8))
    }

    /// Pack `lengths` with this code (LSB-first, like the block codes).
    pub fn pack(&self, lengths: &[u32]) -> Vec<u8> {
        let n = lengths.len() as u64;
        let mut out = vec![0u8; (n * self.bits).div_ceil(8) as usize];
        if self.bits == 0 {
            return out;
        }
        for (i, &l) in lengths.iter().enumerate() {
            let v = (u64::from(l) - self.base) / self.step;
            let bit = i as u64 * self.bits;
            for k in 0..self.bits {
                if v >> k & 1 == 1 {
                    let at = bit + k;
                    out[(at / 8) as usize] |= 1 << (at % 8);
                }
            }
        }
        out
    }
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A version-3 tensor's block table in memory: the packed lengths as stored
/// and an anchor offset every [`ANCHOR_EVERY`] blocks.
#[derive(Debug, Clone)]
pub struct PackedLengths {
    /// Absolute offset of block 0.
    start: u64,
    /// Sum of all lengths.
    total: u64,
    n: u64,
    base: u64,
    step: u64,
    bits: u64,
    packed: Box<[u8]>,
    /// Offset of block `i * ANCHOR_EVERY` from `start` (empty when every
    /// block has the same length: then block `b` is at `b * base`).
    anchors: Box<[u64]>,
}

impl PackedLengths {
    /// Check `code` over `n` blocks against `packed` (its bytes from the
    /// index, exactly [`LengthCode::packed_len`] of them): every length
    /// within `bounds(block)` (inclusive), the lengths adding up to
    /// `total`. `one_of_each` holds a block of every tile size (bounds
    /// depend only on it): when all lengths are equal only those are
    /// checked, so a header declaring 2^40 equal blocks costs nothing.
    /// Errors carry no offset; the caller adds it.
    pub fn build(
        code: LengthCode,
        n: u64,
        packed: Vec<u8>,
        (start, total): (u64, u64),
        mut bounds: impl FnMut(u64) -> (u64, u64),
        one_of_each: &[u64],
    ) -> Result<PackedLengths> {
        if code.bits > MAX_LENGTH_BITS {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "block_lengths bits {} is above {MAX_LENGTH_BITS}",
                    code.bits
                ),
            ));
        }
        if (code.bits == 0) != (code.step == 0) {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "block_lengths step {} with bits {}: step is 0 exactly when bits is 0",
                    code.step, code.bits
                ),
            ));
        }
        debug_assert_eq!(packed.len() as u64, code.packed_len(n).unwrap_or(0));
        let mut table = PackedLengths {
            start,
            total,
            n,
            base: code.base,
            step: code.step,
            bits: code.bits,
            packed: packed.into_boxed_slice(),
            anchors: Box::new([]),
        };
        let bad_len = |b: u64, len: u64, (lo, hi): (u64, u64)| {
            err(
                ErrorKind::LengthMismatch,
                format!(
                    "block {b} has length {len}; its tile needs {}",
                    if lo == hi {
                        lo.to_string()
                    } else {
                        format!("{lo}..={hi}")
                    }
                ),
            )
        };
        let sum_mismatch = |sum: u64| {
            err(
                ErrorKind::LengthMismatch,
                format!("block lengths add up to {sum} bytes, data length is {total}"),
            )
        };
        if code.bits == 0 {
            // Every block is `base` long. The tiles differ only at the
            // right and bottom edges: check one block of each kind.
            let sum = mul(n, code.base, "data length")?;
            if sum != total {
                return Err(sum_mismatch(sum));
            }
            for &b in one_of_each.iter().filter(|&&b| b < n) {
                let bd = bounds(b);
                if code.base < bd.0 || code.base > bd.1 {
                    return Err(bad_len(b, code.base, bd));
                }
            }
            return Ok(table);
        }
        // n <= packed bytes * 8 / bits: the loop and the anchors are
        // bounded by what the file stores (and n by the data range, which
        // the caller checked against the tiling's smallest lengths).
        let mut anchors = Vec::with_capacity(n.div_ceil(ANCHOR_EVERY) as usize);
        let mut sum = 0u64;
        for b in 0..n {
            if b % ANCHOR_EVERY == 0 {
                anchors.push(sum);
            }
            let len = table.length(b)?;
            let bd = bounds(b);
            if len < bd.0 || len > bd.1 {
                return Err(bad_len(b, len, bd));
            }
            sum = add(sum, len, "data length")?;
        }
        if sum != total {
            return Err(sum_mismatch(sum));
        }
        table.anchors = anchors.into_boxed_slice();
        Ok(table)
    }

    /// Every block has the same length.
    pub fn uniform(&self) -> bool {
        self.bits == 0
    }

    /// The `bits`-bit value of block `b`.
    fn value(&self, b: u64) -> u64 {
        if self.bits == 0 {
            return 0;
        }
        let bit = b * self.bits;
        let byte = (bit / 8) as usize;
        // One load where 8 bytes remain (a value is at most 32 bits from
        // a bit offset below 8: it fits); the index's last bytes one by one.
        if let Some(w) = self.packed.get(byte..byte + 8) {
            let mut eight = [0u8; 8];
            eight.copy_from_slice(w);
            return (u64::from_le_bytes(eight) >> (bit % 8)) & ((1u64 << self.bits) - 1);
        }
        let mut word = 0u64;
        for k in 0..5 {
            if let Some(&x) = self.packed.get(byte + k) {
                word |= u64::from(x) << (8 * k);
            }
        }
        (word >> (bit % 8)) & ((1u64 << self.bits) - 1)
    }

    /// Length of block `b` (`b < n`).
    fn length(&self, b: u64) -> Result<u64> {
        let v = mul(self.value(b), self.step, "block length")?;
        add(self.base, v, "block length")
    }

    fn get(&self, b: u64) -> Option<(u64, u32)> {
        if b >= self.n {
            return None;
        }
        // Checked at build: every length fits its tile (< 2^32) and they
        // add up without overflow.
        let len = self.length(b).ok()?;
        let rel = if self.anchors.is_empty() {
            b * self.base
        } else {
            let first = b - b % ANCHOR_EVERY;
            let mut rel = self.anchors[(b / ANCHOR_EVERY) as usize];
            for i in first..b {
                rel += self.length(i).ok()?;
            }
            rel
        };
        Some((self.start + rel, u32::try_from(len).ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(lengths: &[u32], start: u64) -> PackedLengths {
        let code = LengthCode::for_lengths(lengths);
        let packed = code.pack(lengths);
        let total = lengths.iter().map(|&l| u64::from(l)).sum();
        PackedLengths::build(
            code,
            lengths.len() as u64,
            packed,
            (start, total),
            |_| (0, u64::MAX),
            &[],
        )
        .unwrap()
    }

    #[test]
    fn code_choice() {
        assert_eq!(
            LengthCode::for_lengths(&[37, 101, 69, 37]),
            LengthCode {
                at: 0,
                base: 37,
                step: 32,
                bits: 2
            }
        );
        assert_eq!(
            LengthCode::for_lengths(&[9, 9, 9]),
            LengthCode {
                at: 0,
                base: 9,
                step: 0,
                bits: 0
            }
        );
        assert_eq!(LengthCode::for_lengths(&[]), LengthCode::default());
    }

    #[test]
    fn offsets_are_prefix_sums_across_anchors() {
        let mut state = 7u64;
        let lengths: Vec<u32> = (0..1000)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                5 + 32 * ((state >> 33) % 9) as u32
            })
            .collect();
        let t = table(&lengths, 8);
        let mut off = 8u64;
        for (b, &l) in lengths.iter().enumerate() {
            assert_eq!(t.get(b as u64), Some((off, l)), "block {b}");
            off += u64::from(l);
        }
        assert_eq!(t.get(1000), None);
        let same = table(&[12; 300], 100);
        assert_eq!(same.get(299), Some((100 + 299 * 12, 12)));
    }

    #[test]
    fn refusals() {
        let lengths = [10u32, 20, 30];
        let code = LengthCode::for_lengths(&lengths);
        let packed = code.pack(&lengths);
        let any = |_| (0, u64::MAX);
        let e = PackedLengths::build(code, 3, packed.clone(), (0, 61), any, &[]).unwrap_err();
        assert!(e.to_string().contains("add up to 60"), "{e}");
        let e = PackedLengths::build(
            code,
            3,
            packed.clone(),
            (0, 60),
            |b| if b == 2 { (31, 40) } else { (0, 99) },
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("block 2 has length 30"), "{e}");
        let wide = LengthCode { bits: 33, ..code };
        assert!(PackedLengths::build(wide, 3, packed.clone(), (0, 60), any, &[]).is_err());
        let no_step = LengthCode { step: 0, ..code };
        assert!(PackedLengths::build(no_step, 3, packed, (0, 60), any, &[]).is_err());
        // Equal lengths: the sum is n * base, checked without a loop.
        let eq = LengthCode::for_lengths(&[4, 4]);
        let huge =
            PackedLengths::build(eq, u64::MAX / 2, Vec::new(), (0, 8), any, &[]).unwrap_err();
        assert!(
            huge.to_string().contains("overflow") || huge.to_string().contains("add up"),
            "{huge}"
        );
        // Equal lengths are checked against one block of each tile size.
        let e = PackedLengths::build(eq, 2, Vec::new(), (0, 8), |b| (b + 4, b + 4), &[0, 1])
            .unwrap_err();
        assert!(e.to_string().contains("block 1 has length 4"), "{e}");
    }
}
