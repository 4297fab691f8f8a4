//! .rknot backend: scatter decoded tiles of the compact matrix into served
//! rows; everything off the standing indices is exactly 0.0.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use crate::backend::{
    Availability, Backend, BlockCode, Role, SourceSummary, StoredType, TensorInfo, TensorTable,
    entry_for_read, origin,
};
use crate::error::{ErrorKind, Result};
use crate::format::FileFormat;
use crate::format::checksum;
use crate::format::rknot::{BlockMode, Manifest, RknotFile, RknotTensorInfo, decode_block_rows};
use crate::names::TensorName;
use crate::source::SourceFile;

pub struct RknotBackend {
    src: SourceFile,
    summary: SourceSummary,
    table: TensorTable,
    file: RknotFile,
}

impl RknotBackend {
    pub fn new(src: SourceFile, mut file: RknotFile, role: Role) -> Result<Self> {
        let org = origin(role, FileFormat::Rknot, src.path());
        let mut table = TensorTable::default();
        for t in &file.tensors {
            let name = TensorName::from_stored(&t.name).map_err(|e| e.path(src.path()))?;
            let band_rows = if t.restrict_rows {
                1
            } else {
                t.grid.block_rows
            };
            let info = TensorInfo {
                name,
                shape: vec![t.d_out, t.d_in],
                n_elements: t.n_elements(),
                stored: match t.mode.lossless_float() {
                    Some(float) => StoredType::RknotLossless(float),
                    None => StoredType::Rknot {
                        graded: t.mode == BlockMode::Graded,
                        bits: t.bits,
                    },
                },
                stored_bytes: t.stored_bytes(),
                origin: org.clone(),
                availability: Availability::Available,
                granule: band_rows * t.d_in,
            };
            let at = t.blocks.first_offset().unwrap_or(file.layout.body_offset);
            table
                .push(info, &t.name)
                .map_err(|e| e.path(src.path()).at(at))?;
        }
        // Tensors stored as ggml blocks follow, in table order.
        for d in &file.dense {
            let name = TensorName::from_stored(&d.name).map_err(|e| e.path(src.path()))?;
            let info = TensorInfo {
                name,
                shape: d.shape.clone(),
                n_elements: d.n_elements,
                stored: StoredType::Ggml(d.ty),
                stored_bytes: d.length,
                origin: org.clone(),
                availability: super::dense::availability(d.ty),
                granule: d.ty.block_elems(),
            };
            table
                .push(info, &d.name)
                .map_err(|e| e.path(src.path()).at(d.offset))?;
        }
        let graded = file
            .tensors
            .iter()
            .filter(|t| t.mode == BlockMode::Graded)
            .count();
        let summary = SourceSummary {
            checked: file.layout.ksum.is_some(),
            format: FileFormat::Rknot,
            version: u32::from(file.layout.version),
            path: src.path().to_path_buf(),
            // Moved, not cloned: metadata can be tens of MB.
            metadata: std::mem::take(&mut file.arch.metadata),
            notes: vec![
                format!(
                    "arch {}, hidden_dim {}, {} layers ({} carried)",
                    file.arch.arch,
                    file.arch.hidden_dim,
                    file.arch.num_layers,
                    file.layers.len()
                ),
                if file.layout.version == 2 {
                    format!(
                        "{} tensors ({} graded), header {} bytes",
                        file.tensors.len(),
                        graded,
                        file.layout.header_len
                    )
                } else {
                    format!(
                        "{} tensors ({} graded) + {} stored as ggml blocks, header {} bytes, \
                         block index {} bytes",
                        file.tensors.len(),
                        graded,
                        file.dense.len(),
                        file.layout.header_len,
                        file.layout.index_len
                    )
                },
            ],
        };
        Ok(RknotBackend {
            src,
            summary,
            table,
            file,
        })
    }

    fn manifest(&self, t: &RknotTensorInfo) -> &Manifest {
        // `layer` indexes `layers` by construction in RknotFile::read.
        &self.file.layers[t.layer].manifest
    }

    /// Decode rows `rows` (relative to the tile) of block `b` of tensor `t`
    /// into `tile_buf` (resized to fit).
    fn decode(
        &self,
        bytes: &mut BlockBytes<'_>,
        b: u64,
        rows: std::ops::Range<u64>,
        tile_buf: &mut Vec<f32>,
    ) -> Result<()> {
        let cols = bytes.t.grid.tile(b).cols;
        tile_buf.resize(((rows.end - rows.start) * cols) as usize, 0.0);
        self.decode_into(bytes, b, rows, tile_buf)
    }

    /// [`Self::decode`] into a slice of exactly the rows' length.
    fn decode_into(
        &self,
        bytes: &mut BlockBytes<'_>,
        b: u64,
        rows: std::ops::Range<u64>,
        tile_buf: &mut [f32],
    ) -> Result<()> {
        let t = bytes.t;
        let tile = t.grid.tile(b);
        let (off, raw) = bytes.block(&self.src, b)?;
        decode_block_rows(t, &tile, raw, rows, tile_buf).map_err(|e| {
            crate::Error::new(e.kind(), format!("block {b}: {}", e.message()))
                .tensor(&t.name)
                .path(self.src.path())
                .at(off)
        })
    }
}

/// The stored bytes of one tensor's blocks for one read: a run of
/// consecutive blocks read with one pread and kept while the next blocks
/// the read decodes fall in it (a read visits a row of tiles in block
/// order). In a file with checksums the run is the block's checksum group,
/// verified once; without, about a group's worth (one syscall per ~8 KiB,
/// not per block of ~200 bytes).
struct BlockBytes<'a> {
    t: &'a RknotTensorInfo,
    buf: Vec<u8>,
    /// The blocks `[b0, b1)` held in `buf`, and their absolute offset.
    held: Option<(u64, u64, u64)>,
}

impl<'a> BlockBytes<'a> {
    fn new(t: &'a RknotTensorInfo) -> Self {
        BlockBytes {
            t,
            buf: Vec::new(),
            held: None,
        }
    }

    /// Absolute offset and stored bytes of block `b`.
    fn block(&mut self, src: &SourceFile, b: u64) -> Result<(u64, &[u8])> {
        let (off, len) = self
            .t
            .blocks
            .get(b)
            .ok_or_else(|| self.error(src, b, "no such block"))?;
        let start = match self.held {
            Some((b0, b1, start)) if (b0..b1).contains(&b) => start,
            _ => {
                self.held = None;
                let held = self.fetch(src, b, off, len)?;
                self.held = Some(held);
                held.2
            }
        };
        // Checked, so a table that broke the back-to-back rule fails this
        // read instead of the daemon.
        off.checked_sub(start)
            .and_then(|rel| self.buf.get(rel as usize..rel as usize + len as usize))
            .map(|bytes| (off, bytes))
            .ok_or_else(|| {
                self.error(src, b, "not inside the run of blocks read with it")
                    .at(off)
            })
    }

    /// Read the run holding block `b` (at `off`, `len` bytes) into `buf`:
    /// its checksum group, verified, or without checksums the blocks from
    /// `b` on, about a group's worth. Returns the run's blocks and offset.
    fn fetch(&mut self, src: &SourceFile, b: u64, off: u64, len: u32) -> Result<(u64, u64, u64)> {
        let t = self.t;
        let n = t.grid.n_blocks();
        let (b0, b1, start, run_len) = match &t.sums {
            Some(sums) => {
                let g0 = b / sums.group * sums.group;
                let g1 = n.min(g0 + sums.group);
                // Checked at open: the group's blocks are back to back and
                // at most MAX_GROUP_BYTES long.
                let (start, glen) = t
                    .blocks
                    .span(g0, g1)
                    .ok_or_else(|| self.error(src, b, "its group is not back to back"))?;
                (g0, g1, start, glen)
            }
            None => {
                let per = (checksum::WRITE_GROUP_BYTES / u64::from(len).max(1)).max(1);
                let b1 = n.min(b + per);
                // Version 2 lists each block on its own (no spans): a run
                // is then that block alone.
                match t.blocks.span(b, b1) {
                    Some((s, l)) if s == off && l <= checksum::WRITE_GROUP_BYTES * 2 => {
                        (b, b1, off, l)
                    }
                    _ => (b, b + 1, off, u64::from(len)),
                }
            }
        };
        self.buf.resize(run_len as usize, 0);
        src.read_at(start, &mut self.buf)
            .map_err(|e| e.tensor(&t.name))?;
        if let Some(sums) = &t.sums {
            let g = b0 / sums.group;
            if let Err((stored, actual)) = sums.check(g, &self.buf) {
                return Err(crate::Error::new(
                    ErrorKind::Checksum,
                    format!(
                        "blocks [{b0}, {b1}) (group {g}, {run_len} bytes) have CRC-32 \
                         {actual:08x}, the file records {stored:08x}: the stored bytes are \
                         damaged"
                    ),
                )
                .tensor(&t.name)
                .path(src.path())
                .at(start));
            }
        }
        Ok((b0, b1, start))
    }

    fn error(&self, src: &SourceFile, b: u64, what: &str) -> crate::Error {
        crate::Error::new(ErrorKind::OutOfBounds, format!("block {b}: {what}"))
            .tensor(&self.t.name)
            .path(src.path())
    }
}

impl RknotBackend {
    /// `read_f32` for a tensor stored in one-column tiles (`block_cols` 1,
    /// no restricted axis: the faithful profile's column segments), band by
    /// band: the band's tiles decode (over the rows read) into one
    /// column-major buffer, then each row is gathered from it. The general
    /// path would visit a tile per served value.
    fn read_column_segments(
        &self,
        t: &RknotTensorInfo,
        first_elem: u64,
        out: &mut [f32],
    ) -> Result<()> {
        let g = t.grid;
        let d_in = t.d_in;
        let end = first_elem + out.len() as u64;
        let (row0, row1) = (first_elem / d_in, end.div_ceil(d_in));
        let mut band: Vec<f32> = Vec::new();
        let mut bytes = BlockBytes::new(t);
        // Only the read's first and last rows may be partial.
        let whole = |r: u64| r * d_in >= first_elem && (r + 1) * d_in <= end;
        let mut row = row0;
        while row < row1 {
            let rt = row / g.block_rows;
            let band_row0 = rt * g.block_rows;
            let mut band_end = (band_row0 + g.block_rows).min(row1);
            // A partial row is decoded on its own, over its own columns:
            // the buffer (rows x columns) then holds at most what the read
            // serves, not whole rows of a 2^33-wide tensor.
            if !whole(row) {
                band_end = row + 1;
            } else if band_end - row > 1 && !whole(band_end - 1) {
                band_end -= 1;
            }
            let n_rows = (band_end - row) as usize;
            // Columns the read needs in this band: all of them unless it is
            // a single row.
            let (c0, c1) = if band_end - row == 1 {
                let row_start = row * d_in;
                (
                    first_elem.max(row_start) - row_start,
                    end.min(row_start + d_in) - row_start,
                )
            } else {
                (0, d_in)
            };
            band.resize(n_rows * (c1 - c0) as usize, 0.0);
            for (c, col) in (c0..c1).zip(band.chunks_mut(n_rows)) {
                let b = g.block_index(rt, c);
                self.decode_into(&mut bytes, b, row - band_row0..band_end - band_row0, col)?;
            }
            // Transpose in groups of rows, so each column's values for the
            // group come from one or two cache lines of the band.
            const GROUP: u64 = 16;
            let mut g0 = row;
            while g0 < band_end {
                let g1 = (g0 + GROUP).min(band_end);
                for j in c0..c1 {
                    let col = &band[(j - c0) as usize * n_rows..][..n_rows];
                    for r in g0..g1 {
                        let at = r * d_in + j;
                        if at >= first_elem && at < end {
                            out[(at - first_elem) as usize] = col[(r - row) as usize];
                        }
                    }
                }
                g0 = g1;
            }
            row = band_end;
        }
        Ok(())
    }
}

impl RknotBackend {
    /// Bytes `[offset, offset + buf.len())` of a compressed tensor's blocks
    /// (version 3: back to back from its data offset), each block read
    /// through [`BlockBytes`]: a file's group CRC-32s verified as for a
    /// decode.
    fn read_block_bytes(&self, t: &RknotTensorInfo, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (start, total) = t.blocks.extent().ok_or_else(|| {
            crate::Error::new(
                ErrorKind::UnsupportedType,
                "a version-2 file lists its blocks apart: they are served decoded only",
            )
            .tensor(&t.name)
            .path(self.src.path())
        })?;
        check_stored_range(&t.name, total, offset, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let abs = start + offset;
        let abs_end = abs + buf.len() as u64;
        // The block holding byte `abs`: the last one starting at or before
        // it (blocks are back to back from `start`, so block 0 does).
        let (mut lo, mut hi) = (0u64, t.grid.n_blocks());
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match t.blocks.get(mid) {
                Some((off, _)) if off <= abs => lo = mid,
                _ => hi = mid,
            }
        }
        let mut bytes = BlockBytes::new(t);
        let mut b = lo;
        let mut at = abs;
        while at < abs_end {
            let (off, raw) = bytes.block(&self.src, b)?;
            let end = off + raw.len() as u64;
            if off > at || end <= at {
                return Err(bytes
                    .error(&self.src, b, "blocks do not lie back to back")
                    .at(off));
            }
            let hi = end.min(abs_end);
            buf[(at - abs) as usize..(hi - abs) as usize]
                .copy_from_slice(&raw[(at - off) as usize..(hi - off) as usize]);
            at = hi;
            b += 1;
        }
        Ok(())
    }
}

/// `[offset, offset + n)` lies inside a tensor's `total` stored bytes.
fn check_stored_range(name: &str, total: u64, offset: u64, n: usize) -> Result<()> {
    if offset.checked_add(n as u64).is_none_or(|end| end > total) {
        return Err(crate::Error::new(
            ErrorKind::Range,
            format!("stored bytes [{offset}, {offset}+{n}) are outside the tensor's {total}"),
        )
        .tensor(name));
    }
    Ok(())
}

/// The decoded tiles of one row tile a read has visited, by column tile.
/// A slot per column tile while that is about what the read serves;
/// otherwise only the tiles visited (a read touches at most one tile per
/// value it serves), so a read of a few values of a tensor with 2^33
/// column tiles holds a few tiles, not 2^33 slots.
enum TileSlots {
    Dense(Vec<Option<Vec<f32>>>),
    Sparse(HashMap<u64, Vec<f32>>),
}

impl TileSlots {
    /// Slots for a row of `col_tiles` tiles read for `served` values.
    fn new(col_tiles: u64, served: usize) -> Self {
        match usize::try_from(col_tiles) {
            Ok(n) if n <= served.saturating_add(1 << 16) => TileSlots::Dense(vec![None; n]),
            _ => TileSlots::Sparse(HashMap::new()),
        }
    }

    /// Empty every slot, keeping the buffers in `spare`.
    fn clear_into(&mut self, spare: &mut Vec<Vec<f32>>) {
        match self {
            TileSlots::Dense(v) => spare.extend(v.iter_mut().filter_map(Option::take)),
            TileSlots::Sparse(m) => spare.extend(m.drain().map(|(_, buf)| buf)),
        }
    }

    /// Tile `ct`, decoded by `decode` on its first visit.
    fn get_or_insert_with(
        &mut self,
        ct: u64,
        decode: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<&Vec<f32>> {
        let slot = match self {
            TileSlots::Dense(v) => usize::try_from(ct).ok().and_then(|i| v.get_mut(i)),
            TileSlots::Sparse(m) => {
                return Ok(match m.entry(ct) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => e.insert(decode()?),
                });
            }
        };
        let slot = slot.ok_or_else(|| {
            crate::Error::new(ErrorKind::Range, format!("column tile {ct} out of range"))
        })?;
        if slot.is_none() {
            *slot = Some(decode()?);
        }
        slot.as_ref()
            .ok_or_else(|| crate::Error::new(ErrorKind::Range, "tile slot"))
    }
}

impl Backend for RknotBackend {
    fn summary(&self) -> &SourceSummary {
        &self.summary
    }

    fn tensors(&self) -> &TensorTable {
        &self.table
    }

    fn source_files(&self) -> Vec<&SourceFile> {
        vec![&self.src]
    }

    fn stored_ranges(&self, index: usize) -> Option<super::StoredRanges<'_>> {
        let n_compressed = self.file.tensors.len();
        if index >= n_compressed {
            let d = self.file.dense.get(index - n_compressed)?;
            return Some(super::StoredRanges::one(&self.src, d.offset, d.length));
        }
        let t = self.file.tensors.get(index)?;
        // Version 3 stores a tensor's blocks back to back: one range, found
        // without visiting a block (a tensor may declare 2^34 of them; this
        // runs at every open, for the source's extents).
        if let Some((start, len)) = t.blocks.extent() {
            return Some(super::StoredRanges::one(&self.src, start, len));
        }
        // Version 2: the blocks the header lists, each in its own place.
        Some(super::StoredRanges::merged(
            &self.src,
            (0..t.grid.n_blocks())
                .filter_map(|b| t.blocks.get(b))
                .map(|(off, len)| (off, u64::from(len))),
        ))
    }

    /// Affine tensors of one-row blocks that tile their rows: every block
    /// the same length (a tile of `1 x group`, whose one valid length the
    /// reader checked at open), back to back.
    fn block_code(&self, index: usize) -> Option<BlockCode> {
        let t = self.file.tensors.get(index)?;
        let g = t.grid;
        let code = BlockCode::AffineRows {
            bits: t.bits,
            group: g.block_cols,
        };
        let fits = t.mode == BlockMode::Affine
            && !t.restrict_rows
            && !t.restrict_cols
            && g.block_rows == 1
            && g.block_cols > 0
            && t.d_in.is_multiple_of(g.block_cols)
            && t.blocks.extent().map(|(_, len)| len)
                == g.n_blocks().checked_mul(code.block_bytes());
        fits.then_some(code)
    }

    fn read_stored_blocks(&self, index: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let n_compressed = self.file.tensors.len();
        if index >= n_compressed {
            let d = self
                .file
                .dense
                .get(index - n_compressed)
                .ok_or_else(|| super::no_such_index(index))?;
            check_stored_range(&d.name, d.length, offset, buf.len())?;
            return super::dense::read_stored_bytes(
                &self.src,
                d.offset,
                d.sums.as_ref(),
                offset,
                buf,
                &d.name,
            );
        }
        let t = self
            .file
            .tensors
            .get(index)
            .ok_or_else(|| super::no_such_index(index))?;
        self.read_block_bytes(t, offset, buf)
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let n_compressed = self.file.tensors.len();
        if index >= n_compressed {
            // Tensors stored as ggml blocks: table entries after the
            // compressed ones.
            let d = self
                .file
                .dense
                .get(index - n_compressed)
                .ok_or_else(|| super::no_such_index(index))?;
            let info = self
                .table
                .info(index)
                .ok_or_else(|| super::no_such_index(index))?;
            super::check_read(info, first_elem, out.len())?;
            return super::dense::read_ggml_f32(
                &self.src,
                info,
                (d.ty, d.offset, d.sums.as_ref()),
                first_elem,
                out,
            );
        }
        let (_, t) = entry_for_read(
            &self.table,
            &self.file.tensors,
            index,
            first_elem,
            out.len(),
        )?;
        out.fill(0.0);
        if out.is_empty() {
            return Ok(());
        }
        let g = t.grid;
        if g.block_cols == 1 && !t.restrict_rows && !t.restrict_cols {
            return self.read_column_segments(t, first_elem, out);
        }
        let m = self.manifest(t);
        let end = first_elem + out.len() as u64;
        let (row0, row1) = (first_elem / t.d_in, end.div_ceil(t.d_in));
        // The compact rows this read touches: tiles are decoded only over
        // them (a tile may be far taller than a read).
        let (p_lo, p_hi) = if t.restrict_rows {
            (m.lower_bound(row0) as u64, m.lower_bound(row1) as u64)
        } else {
            (row0, row1)
        };
        let mut band_r0 = 0;
        // Decoded tiles of the current row tile, by column tile: only those
        // the read touches (at most one per value served), never one slot
        // per column tile of the row (2^33 for a 2^33-wide tensor).
        let mut cached_rt = u64::MAX;
        let mut tiles = TileSlots::new(g.col_tiles(), out.len());
        // Buffers of tiles already used, reused for the next row tile's
        // decodes (a tile is up to 256 KiB: a fresh one is an mmap).
        let mut spare: Vec<Vec<f32>> = Vec::new();
        let mut bytes = BlockBytes::new(t);
        for row in row0..row1 {
            let p = if t.restrict_rows {
                match m.position(row) {
                    Some(p) => p as u64,
                    None => continue,
                }
            } else {
                row
            };
            let row_start = row * t.d_in;
            let j0 = first_elem.max(row_start) - row_start;
            let j1 = end.min(row_start + t.d_in) - row_start;
            // Compact column range covering served columns [j0, j1).
            let (q0, q1) = if t.restrict_cols {
                (m.lower_bound(j0) as u64, m.lower_bound(j1) as u64)
            } else {
                (j0, j1)
            };
            if q0 >= q1 {
                continue;
            }
            let rt = p / g.block_rows;
            if rt != cached_rt {
                cached_rt = rt;
                band_r0 = p_lo.max(rt * g.block_rows);
                tiles.clear_into(&mut spare);
            }
            let out_row = (row_start + j0 - first_elem) as usize;
            for ct in q0 / g.block_cols..=(q1 - 1) / g.block_cols {
                let b = g.block_index(rt, ct);
                let tile = g.tile(b);
                let tile_vals = tiles.get_or_insert_with(ct, || {
                    let mut buf = spare.pop().unwrap_or_default();
                    let r1 = p_hi.min(tile.row0 + tile.rows);
                    let rows = band_r0 - tile.row0..r1 - tile.row0;
                    self.decode(&mut bytes, b, rows, &mut buf)?;
                    Ok(buf)
                })?;
                let tr = (p - band_r0) as usize;
                let lo = q0.max(tile.col0);
                let hi = q1.min(tile.col0 + tile.cols);
                let src_row = &tile_vals[tr * tile.cols as usize..][..tile.cols as usize];
                for q in lo..hi {
                    let col = if t.restrict_cols {
                        m.standing_indices[q as usize]
                    } else {
                        q
                    };
                    out[out_row + (col - j0) as usize] = src_row[(q - tile.col0) as usize];
                }
            }
        }
        Ok(())
    }
}
