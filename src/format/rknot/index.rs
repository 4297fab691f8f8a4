//! Reading where each block of a tensor lies: version 3's data range and
//! packed lengths (and block-group CRC-32s) from the binary block index,
//! every index range claimed once; version 2's `[offset, length]` pairs
//! from the header. Each checked against the body and its tiles as it is
//! read; the tables themselves are [`super::blocks`].

use serde::de::{self, MapAccess, SeqAccess};

use super::blocks;
use super::{BlockTable, Layout, LengthCode, PackedLengths, RknotTensorInfo};
use crate::error::{ErrorKind, Result, add, err};
use crate::format::checksum::{self, GroupSums};
use crate::format::json::{Entries, Expect, Field, Found, Parse, Seed, skip_value};
use crate::source::SourceFile;

/// A version-3 tensor's block-group CRC-32s: `ceil(n / group)` u32 LE at
/// index byte `at`, inside the index and counted with the length codes
/// against it; every group at most [`checksum::MAX_GROUP_BYTES`] long, so
/// a read holds at most that much.
pub(super) fn group_sums(
    info: &RknotTensorInfo,
    at: u64,
    group: u64,
    layout: &Layout,
    index: &mut IndexReader<'_>,
) -> Result<GroupSums> {
    let n = info.grid.n_blocks();
    let len = GroupSums::index_len(n, group)?;
    let end = add(at, len, "block_crc32 end")?;
    let index_at = layout.index_offset.saturating_add(at);
    if end > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "block_crc32 of {n} blocks in groups of {group} needs index bytes [{at}, {end}); \
                 the index has {} bytes",
                layout.index_len
            ),
        )
        .at(index_at));
    }
    index.claimed = add(index.claimed, len, "block index total")?;
    index.take(at, len, &info.name, "block_crc32");
    if index.claimed > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "the tensors' block_lengths and block_crc32 so far take {} index bytes; the \
                 index has {} (code ranges may not overlap: each tensor holds its own copy)",
                index.claimed, layout.index_len
            ),
        )
        .at(index_at));
    }
    let too_large = |g0: u64, bytes: u64| {
        let g1 = n.min(g0.saturating_add(group));
        err(
            ErrorKind::TooLarge,
            format!(
                "block group of blocks [{g0}, {g1}) takes {bytes} bytes or more, above the {}-byte \
                 cap",
                checksum::MAX_GROUP_BYTES
            ),
        )
        .at(index_at)
    };
    if matches!(&info.blocks, BlockTable::Packed(p) if p.uniform()) {
        // Equal-length blocks make equal groups: the first tells.
        let g1 = n.min(group);
        let bytes = info.blocks.span(0, g1).map(|(_, l)| l).unwrap_or(u64::MAX);
        if bytes > checksum::MAX_GROUP_BYTES {
            return Err(too_large(0, bytes));
        }
    } else {
        // One pass over the lengths (one per block; the blocks' number is
        // bounded by the index bytes their codes take), not a lookup per
        // group, which may sum 63 lengths for a group of one block.
        let (mut g0, mut bytes) = (0u64, 0u64);
        for (b, (_, len)) in (0u64..).zip(info.blocks.iter()) {
            if b - g0 == group {
                (g0, bytes) = (b, 0);
            }
            bytes += u64::from(len);
            if bytes > checksum::MAX_GROUP_BYTES {
                return Err(too_large(g0, bytes));
            }
        }
    }
    let bytes = index.src.read_vec(index_at, len, "block_crc32")?;
    Ok(GroupSums::from_index(group, &bytes))
}

/// Where version-3 tensors read their length codes from, and how many
/// index bytes they have taken so far (at most `index_len` in all).
pub(super) struct IndexReader<'a> {
    pub(super) src: &'a SourceFile,
    pub(super) claimed: u64,
    /// Every non-empty range taken: `[at, end)` in the index, the tensor
    /// and which of its fields.
    pub(super) ranges: Vec<(u64, u64, String, &'static str)>,
}

impl IndexReader<'_> {
    /// Take index bytes `[at, at + len)` for `tensor`'s `field`.
    fn take(&mut self, at: u64, len: u64, tensor: &str, field: &'static str) {
        if len > 0 {
            self.ranges.push((at, at + len, tensor.to_string(), field));
        }
    }

    /// No two ranges share a byte: every tensor's length codes and CRC-32s
    /// are its own, so what the reader holds for the index is at most the
    /// index (the sum rule alone would let ranges overlap where the index
    /// has bytes no tensor uses).
    pub(super) fn check_disjoint(&mut self, layout: &Layout) -> Result<()> {
        self.ranges.sort_unstable_by_key(|r| (r.0, r.1));
        for w in self.ranges.windows(2) {
            let ((a0, a1, ta, fa), (b0, b1, tb, fb)) = (&w[0], &w[1]);
            if a1 > b0 {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "index bytes [{b0}, {}) are both tensor {ta:?}'s {fa} [{a0}, {a1}) and \
                         tensor {tb:?}'s {fb} [{b0}, {b1}): no two index ranges may share a byte",
                        a1.min(b1)
                    ),
                )
                .tensor(tb)
                .at(layout.index_offset.saturating_add(*b0)));
            }
        }
        Ok(())
    }
}

/// A version-3 tensor's block table: its data range checked against the
/// body, its packed lengths read from the index and checked against the
/// tiles and the data length.
pub(super) fn packed_blocks(
    info: &RknotTensorInfo,
    data: &[u64],
    code: LengthCode,
    layout: &Layout,
    index: &mut IndexReader<'_>,
) -> Result<BlockTable> {
    let [offset, length] = data[..] else {
        return Err(err(
            ErrorKind::BadJson,
            format!("data {data:?} must be [offset, length]"),
        ));
    };
    let start = layout.data_at(offset, length)?;
    let n = info.grid.n_blocks();
    // Before the width sizes anything.
    if code.bits > blocks::MAX_LENGTH_BITS {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "block_lengths bits {} is above {}",
                code.bits,
                blocks::MAX_LENGTH_BITS
            ),
        ));
    }
    check_length_budget(info, n, length).map_err(|e| e.at(start))?;
    let packed_len = code.packed_len(n)?;
    let packed_end = add(code.at, packed_len, "block index end")?;
    if packed_end > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "block_lengths of {n} blocks at {} bits need index bytes [{}, {packed_end}); \
                 the index has {} bytes",
                code.bits, code.at, layout.index_len
            ),
        )
        .at(layout.index_offset.saturating_add(code.at)));
    }
    // Each tensor holds its own copy of its codes: ranges that add up to
    // more than the index (overlapping ones) would let a small file claim
    // many times its size in memory.
    index.claimed = add(index.claimed, packed_len, "block index total")?;
    index.take(code.at, packed_len, &info.name, "block_lengths");
    if index.claimed > layout.index_len {
        return Err(err(
            ErrorKind::OutOfBounds,
            format!(
                "the tensors' block_lengths so far take {} index bytes; the index has {} \
                 (code ranges may not overlap: each tensor holds its own copy)",
                index.claimed, layout.index_len
            ),
        )
        .at(layout.index_offset.saturating_add(code.at)));
    }
    let index_at = layout.index_offset + code.at;
    let packed = index.src.read_vec(index_at, packed_len, "block index")?;
    let grid = &info.grid;
    let (rt, ct) = (grid.row_tiles(), grid.col_tiles());
    // A block of each tile size: interior, right edge, bottom edge, corner.
    let one_of_each = [0, ct - 1, (rt - 1) * ct, n - 1];
    // Bounds depend only on the tile's size: one of four, picked without
    // a division while blocks come in order (the check of every length
    // asks for block after block).
    let kinds = [0, ct - 1, (rt - 1) * ct, n - 1].map(|b| info.block_len_bounds(&grid.tile(b)));
    let mut at = (0u64, 0u64, 0u64);
    let bounds = |b: u64| {
        let (next, r, c) = &mut at;
        if b == *next {
            *next += 1;
        } else {
            (*r, *c) = (b / ct, b % ct);
            *next = b + 1;
        }
        let kind = usize::from(*c == ct - 1) + 2 * usize::from(*r == rt - 1);
        *c += 1;
        if *c == ct {
            (*r, *c) = (*r + 1, 0);
        }
        kinds[kind]
    };
    let table = PackedLengths::build(code, n, packed, (start, length), bounds, &one_of_each)
        .map_err(|e| e.at(index_at))?;
    Ok(BlockTable::Packed(table))
}

/// The tiling's blocks must fit the tensor's data range: the smallest
/// length every tile allows, summed over the blocks, at most `length` (and
/// the largest at least `length`). `length` lies inside the body, so the
/// blocks a header may declare are bounded by what the file stores: a
/// 465-byte header cannot declare 2^34 blocks over an 8 KB body. Computed
/// from the four tile sizes (interior, right edge, bottom edge, corner)
/// and their counts, before any index byte is read or any block visited.
fn check_length_budget(info: &RknotTensorInfo, n: u64, length: u64) -> Result<()> {
    let grid = &info.grid;
    let (rt, ct) = (grid.row_tiles(), grid.col_tiles());
    let (mut lo_sum, mut hi_sum) = (0u128, 0u128);
    // A representative tile of each size, and how many tiles have it.
    let rows = [(0, rt - 1), (rt - 1, 1)];
    let cols = [(0, ct - 1), (ct - 1, 1)];
    for &(r, r_count) in &rows {
        for &(c, c_count) in &cols {
            let count = u128::from(r_count) * u128::from(c_count);
            if count == 0 {
                continue;
            }
            let (lo, hi) = info.block_len_bounds(&grid.tile(grid.block_index(r, c)));
            lo_sum += count * u128::from(lo);
            hi_sum += count * u128::from(hi);
        }
    }
    let length = u128::from(length);
    if length < lo_sum || length > hi_sum {
        let (which, bound) = if length < lo_sum {
            ("at least", lo_sum)
        } else {
            ("at most", hi_sum)
        };
        return Err(err(
            ErrorKind::LengthMismatch,
            format!(
                "{n} blocks of its tiling take {which} {bound} bytes (the lengths its tiles \
                 allow), data length is {length}"
            ),
        ));
    }
    Ok(())
}

/// A tensor's `block_lengths`: `{"at", "base", "step", "bits"}`, all
/// required non-negative integers.
pub(super) struct LengthFields<'a> {
    pub(super) p: &'a Parse,
    /// at, base, step, bits as seen.
    pub(super) seen: [Option<u64>; 4],
}

const LENGTH_FIELDS: [&str; 4] = ["at", "base", "step", "bits"];

impl<'de> Entries<'de> for LengthFields<'_> {
    type Value = LengthCode;
    fn entry<A: MapAccess<'de>>(&mut self, key: String, map: &mut A) -> Result<(), A::Error> {
        match LENGTH_FIELDS.iter().position(|k| *k == key) {
            Some(i) => {
                let f = Field::new(self.p, "block_lengths", &key);
                self.seen[i] = Some(f.read_u64(map)?);
            }
            None => skip_value(map)?,
        }
        Ok(())
    }
    fn done<E: de::Error>(self) -> Result<LengthCode, E> {
        let mut v = [0u64; 4];
        for (i, s) in self.seen.iter().enumerate() {
            v[i] = s.ok_or_else(|| {
                self.p.fail(
                    ErrorKind::BadJson,
                    format!("block_lengths: missing field \"{}\"", LENGTH_FIELDS[i]),
                )
            })?;
        }
        Ok(LengthCode {
            at: v[0],
            base: v[1],
            step: v[2],
            bits: v[3],
        })
    }
}

/// A tensor's `blocks`: `[offset, length]` pairs, each checked against the
/// body and its tile as it is read.
pub(super) struct BlocksSeed<'a> {
    pub(super) p: &'a Parse,
    pub(super) info: &'a RknotTensorInfo,
    pub(super) body_offset: u64,
    pub(super) body_len: u64,
}

impl BlocksSeed<'_> {
    fn check(&self, bi: u64, off: u64, len: u64) -> Result<(u64, u32)> {
        let body_offset = self.body_offset;
        let end = add(off, len, "block end")?;
        if end > self.body_len {
            return Err(err(
                ErrorKind::OutOfBounds,
                format!(
                    "block {bi} [{off}, {end}) lies outside the body ({} bytes)",
                    self.body_len
                ),
            )
            .at(body_offset.saturating_add(off)));
        }
        let tile = self.info.grid.tile(bi);
        let (lo, hi) = self.info.block_len_bounds(&tile);
        if len < lo || len > hi {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "block {bi} has length {len}; a {}x{} tile at {} bits needs {}",
                    tile.rows,
                    tile.cols,
                    self.info.bits,
                    if lo == hi {
                        lo.to_string()
                    } else {
                        format!("{lo}..={hi}")
                    }
                ),
            )
            .at(body_offset + off));
        }
        // len <= hi < 2^32 (a tile is <= 65536 values of <= 16 bits), and
        // end <= body_len, so the absolute offset fits.
        Ok((body_offset + off, len as u32))
    }
}

impl<'de> Expect<'de> for BlocksSeed<'_> {
    type Value = Vec<(u64, u32)>;
    fn wrong<E: de::Error>(self, found: Found) -> E {
        Field::new(self.p, "tensor", "blocks").wrong("an array", found)
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<(u64, u32)>, A::Error> {
        let p = self.p;
        let need = self.info.grid.n_blocks();
        // Not reserved from `need`: that number comes from the file.
        let mut out = Vec::new();
        let mut listed = 0u64;
        loop {
            if listed < need {
                match seq.next_element_seed(Seed(Pair { p, bi: listed }))? {
                    Some((off, len)) => {
                        out.push(self.check(listed, off, len).map_err(|e| p.fail_error(e))?);
                    }
                    None => break,
                }
            } else if seq.next_element::<de::IgnoredAny>()?.is_none() {
                break;
            }
            listed += 1;
        }
        if listed != need {
            return Err(p.fail(
                ErrorKind::BadValue,
                format!("{listed} blocks listed, the tiling needs {need}"),
            ));
        }
        Ok(out)
    }
}

/// One `[offset, length]` pair.
#[derive(Clone, Copy)]
struct Pair<'a> {
    p: &'a Parse,
    bi: u64,
}

impl Pair<'_> {
    /// `blocks[i] must be [offset, length]` (BadJson), for any other shape.
    fn bad<E: de::Error>(self) -> E {
        self.p.fail(
            ErrorKind::BadJson,
            format!("blocks[{}] must be [offset, length]", self.bi),
        )
    }
}

impl<'de> Expect<'de> for Pair<'_> {
    type Value = (u64, u64);
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.bad()
    }
    fn on_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(u64, u64), A::Error> {
        let first = seq.next_element_seed(Seed(PairElem(self)))?;
        let second = seq.next_element_seed(Seed(PairElem(self)))?;
        match (first, second) {
            (Some(o), Some(l)) => {
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(self.bad());
                }
                Ok((o, l))
            }
            _ => Err(self.bad()),
        }
    }
}

/// One number of a pair.
struct PairElem<'a>(Pair<'a>);

impl<'de> Expect<'de> for PairElem<'_> {
    type Value = u64;
    fn wrong<E: de::Error>(self, _: Found) -> E {
        self.0.bad()
    }
    fn on_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
}
