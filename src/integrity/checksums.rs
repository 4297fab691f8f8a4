//! Scan a file's stored bytes against the checksums it carries
//! (docs/FORMAT.md section 12) without decoding anything: what
//! `rknot verify --integrity` and the structural `rknot verify` run.
//!
//! The metadata's KSUM record is checked when the file is opened (a
//! mismatch there fails the open); this scan covers every tensor's block
//! groups or chunks, reading in runs of up to 4 MiB, so a file is read
//! once, sequentially.

use crate::backend::ParsedFile;
use crate::error::{Error, ErrorKind, err};
use crate::format::checksum::{ChunkSums, crc32};
use crate::format::rknot::RknotTensorInfo;
use crate::source::SourceFile;

/// Bytes read per pread while scanning.
const RUN_BYTES: u64 = 4 << 20;

/// What a scan found.
#[derive(Debug, Default)]
pub struct ScanReport {
    /// The file carries checksums (false: nothing could be checked).
    pub checked: bool,
    /// Tensors scanned, checksum units (groups, chunks) compared, bytes read.
    pub tensors: u64,
    pub units: u64,
    pub bytes: u64,
    /// One error per damaged unit (kind `Checksum`, naming file, tensor,
    /// unit and offset), or per tensor that could not be read.
    pub mismatches: Vec<Error>,
}

/// One unit to compare: absolute offset, length, stored CRC-32, and how to
/// name it.
struct Unit {
    at: u64,
    len: u64,
    crc: u32,
    what: String,
}

/// Scan every tensor of `parsed` against its checksums. `progress(done,
/// total)` is called with bytes as the scan goes.
pub fn scan(parsed: &ParsedFile, progress: &mut dyn FnMut(u64, u64)) -> ScanReport {
    let mut r = ScanReport::default();
    // Per tensor: its name and its units in file order.
    let mut plan: Vec<(String, Vec<Unit>)> = Vec::new();
    // Tensors checked in chunks: (name, sums, absolute offset).
    let mut chunked = |entries: &mut dyn Iterator<Item = (&String, Option<&ChunkSums>, u64)>| {
        for (name, sums, offset) in entries {
            if let Some(s) = sums {
                plan.push((name.clone(), chunk_units(s, offset)));
            }
        }
    };
    let src = match parsed {
        ParsedFile::Rknot(src, f) => {
            r.checked = f.layout.ksum.is_some();
            chunked(&mut f.dense.iter().map(|d| (&d.name, d.sums.as_ref(), d.offset)));
            // The compressed tensors come first in the file's order.
            let groups = f.tensors.iter().map(|t| (t.name.clone(), group_units(t)));
            plan.splice(0..0, groups);
            src
        }
        ParsedFile::Sk32(src, f) => {
            r.checked = f.checked;
            chunked(
                &mut f
                    .sketches
                    .iter()
                    .map(|s| (&s.name, s.sums.as_ref(), s.offset)),
            );
            src
        }
        ParsedFile::DenseKnot(src, f) => {
            r.checked = f.checked;
            chunked(
                &mut f
                    .tensors
                    .iter()
                    .map(|t| (&t.name, t.sums.as_ref(), t.offset)),
            );
            src
        }
        ParsedFile::Gguf(..) | ParsedFile::GgufSplit(..) | ParsedFile::Safetensors(..) => return r,
    };
    plan.retain(|(_, units)| !units.is_empty());
    // Named as the read path names them: the dot spelling.
    for (name, _) in &mut plan {
        *name = crate::names::canonical(name);
    }
    let total: u64 = plan.iter().flat_map(|(_, u)| u).map(|u| u.len).sum();
    let mut buf = Vec::new();
    for (name, units) in &plan {
        r.tensors += 1;
        let mut i = 0;
        while i < units.len() {
            // A run of adjacent units, read with one pread.
            let start = units[i].at;
            let mut end = i;
            let mut run_end = start;
            while end < units.len()
                && units[end].at == run_end
                && (end == i || run_end + units[end].len - start <= RUN_BYTES)
            {
                run_end += units[end].len;
                end += 1;
            }
            // Unit lengths were bounded at open (groups <= 16 MiB, chunks
            // <= 64 MiB).
            buf.resize((run_end - start) as usize, 0);
            if let Err(e) = src.read_at(start, &mut buf) {
                r.mismatches.push(e.tensor(name));
                break;
            }
            for u in &units[i..end] {
                let bytes = &buf[(u.at - start) as usize..][..u.len as usize];
                let actual = crc32(bytes);
                r.units += 1;
                if actual != u.crc {
                    r.mismatches.push(mismatch(src, name, u, actual));
                }
            }
            r.bytes += run_end - start;
            progress(r.bytes, total);
            i = end;
        }
    }
    r
}

fn mismatch(src: &SourceFile, tensor: &str, u: &Unit, actual: u32) -> Error {
    err(
        ErrorKind::Checksum,
        format!(
            "{} ({} bytes) has CRC-32 {actual:08x}, the file records {:08x}",
            u.what, u.len, u.crc
        ),
    )
    .tensor(tensor)
    .path(src.path())
    .at(u.at)
}

/// A .rknot tensor's block groups (none without checksums).
fn group_units(t: &RknotTensorInfo) -> Vec<Unit> {
    let Some(sums) = &t.sums else {
        return Vec::new();
    };
    let n = t.grid.n_blocks();
    let mut units = Vec::with_capacity(sums.values.len());
    for (g, &crc) in sums.values.iter().enumerate() {
        let g0 = g as u64 * sums.group;
        let g1 = n.min(g0 + sums.group);
        // Spans were checked at open for every group.
        if let Some((at, len)) = t.blocks.span(g0, g1) {
            units.push(Unit {
                at,
                len,
                crc,
                what: format!("blocks [{g0}, {g1}) (group {g})"),
            });
        }
    }
    units
}

/// The chunks of a tensor stored from absolute `base`.
fn chunk_units(s: &ChunkSums, base: u64) -> Vec<Unit> {
    s.values
        .iter()
        .enumerate()
        .map(|(i, &crc)| {
            let rel = i as u64 * s.chunk;
            Unit {
                at: base + rel,
                len: s.chunk.min(s.len - rel),
                crc,
                what: format!("chunk {i}"),
            }
        })
        .collect()
}
