//! Digests of a file's bytes: the whole file, its header (every byte in no
//! tensor's stored ranges) and each tensor's stored bytes.
//!
//! All reads go through [`SourceFile::read_at`] on the file as it was
//! opened (the mount's own descriptor), in large sequential pieces, so a
//! 5 GB file hashes at disk or SHA speed, and what is hashed is exactly
//! what is decoded. [`digest_file`] computes all three kinds in one
//! sequential pass: each piece read goes to the whole-file hasher and to
//! the header's or the tensors' hashers by the ranges it overlaps.

use std::ops::Range;

use sha2::{Digest as _, Sha256};

use super::Digest;
use crate::backend::Backend;
use crate::error::{ErrorKind, Result, err};
use crate::source::SourceFile;

/// Bytes per read while hashing: large enough that a read costs far less
/// than hashing it, small enough to keep in memory per hashing thread.
pub const READ_PIECE: usize = 4 << 20;

/// A tensor's stored bytes in its file: absolute ranges in format order
/// (what `Backend::stored_ranges` says), under the tensor's dot name.
#[derive(Debug, Clone)]
pub struct TensorBytes {
    pub name: String,
    pub ranges: Vec<Range<u64>>,
}

/// Everything a manifest lists about one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDigests {
    pub whole: Digest,
    pub header: Digest,
    /// In the file's tensor order.
    pub tensors: Vec<(String, Digest)>,
}

/// Every file of a backend opened on its own (as `open_single` gives: one
/// file, or every shard of a split set) and every tensor's stored bytes in
/// it, in the backend's order; a file no tensor lies in (a split set's
/// metadata-only first shard) with none. A tensor listed without bytes of
/// its own (`stored_ranges` None) is left out: it has nothing to digest,
/// and the mount checks the same list.
pub fn tensor_bytes(b: &dyn Backend) -> Result<Vec<(&SourceFile, Vec<TensorBytes>)>> {
    let mut out: Vec<(&SourceFile, Vec<TensorBytes>)> = b
        .source_files()
        .into_iter()
        .map(|f| (f, Vec::new()))
        .collect();
    for (i, t) in b.tensors().entries().iter().enumerate() {
        let Some(sr) = b.stored_ranges(i) else {
            continue;
        };
        let Some((file, list)) = out.iter_mut().find(|(f, _)| std::ptr::eq(*f, sr.file)) else {
            return Err(err(
                ErrorKind::BadValue,
                "stored bytes lie in a file that is not among the backend's own",
            )
            .path(sr.file.path())
            .tensor(&t.name.dot));
        };
        for r in &sr.ranges {
            if r.start > r.end || r.end > file.len() {
                return Err(err(
                    ErrorKind::OutOfBounds,
                    format!(
                        "stored bytes [{}, {}) lie outside the file ({} bytes)",
                        r.start,
                        r.end,
                        file.len()
                    ),
                )
                .path(file.path())
                .tensor(&t.name.dot)
                .at(r.start));
            }
        }
        list.push(TensorBytes {
            name: t.name.dot.clone(),
            ranges: sr.ranges,
        });
    }
    Ok(out)
}

/// The union of every tensor's ranges, sorted and merged: what is not in
/// it is the header.
fn covered(tensors: &[TensorBytes]) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = tensors
        .iter()
        .flat_map(|t| t.ranges.iter().cloned())
        .filter(|r| r.start < r.end)
        .collect();
    all.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(all.len());
    for r in all {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

/// The header's pieces: `[0, len)` minus `covered`.
fn gaps(covered: &[Range<u64>], len: u64) -> Vec<Range<u64>> {
    let mut out = Vec::with_capacity(covered.len() + 1);
    let mut pos = 0;
    for c in covered {
        if c.start > pos {
            out.push(pos..c.start.min(len));
        }
        pos = pos.max(c.end);
    }
    if pos < len {
        out.push(pos..len);
    }
    out
}

/// Whether a tensor's ranges are in file order without overlap, so one
/// sequential pass can feed its hasher.
fn ascending(ranges: &[Range<u64>]) -> bool {
    ranges.windows(2).all(|w| w[1].start >= w[0].end)
}

/// The header's and the tensors' hashers, fed the file's pieces in order.
struct PartHashers<'a> {
    covered: &'a [Range<u64>],
    cov_i: usize,
    /// Segments of the tensors the pass feeds, by start.
    segs: Vec<(Range<u64>, usize)>,
    next_seg: usize,
    active: Vec<usize>,
    header: Sha256,
    tensors: Vec<Sha256>,
}

impl PartHashers<'_> {
    /// Bytes `[pos, pos + chunk.len())` of the file.
    fn feed(&mut self, pos: u64, chunk: &[u8]) {
        let end = pos + chunk.len() as u64;
        // Header: the parts of [pos, end) outside every tensor.
        let mut p = pos;
        while p < end {
            while self.covered.get(self.cov_i).is_some_and(|c| c.end <= p) {
                self.cov_i += 1;
            }
            match self.covered.get(self.cov_i) {
                Some(c) if c.start <= p => p = c.end.min(end),
                Some(c) => {
                    let g = c.start.min(end);
                    self.header
                        .update(&chunk[(p - pos) as usize..(g - pos) as usize]);
                    p = g;
                }
                None => {
                    self.header.update(&chunk[(p - pos) as usize..]);
                    p = end;
                }
            }
        }
        // Tensors: every segment overlapping [pos, end), in start order (a
        // tensor's own segments are ascending, so its hasher gets its
        // bytes in format order).
        while self
            .segs
            .get(self.next_seg)
            .is_some_and(|(r, _)| r.start < end)
        {
            self.active.push(self.next_seg);
            self.next_seg += 1;
        }
        for &s in &self.active {
            let (r, t) = &self.segs[s];
            let (a, b) = (r.start.max(pos), r.end.min(end));
            if a < b {
                self.tensors[*t].update(&chunk[(a - pos) as usize..(b - pos) as usize]);
            }
        }
        let segs = &self.segs;
        self.active.retain(|&s| segs[s].0.end > end);
    }
}

/// Whole file, header and every tensor of `file` in one sequential pass
/// (tensors whose ranges are not in file order, which no writer makes, are
/// hashed after it). `progress` gets the bytes of each piece read.
///
/// Each byte is hashed twice (the whole file, and the header or its
/// tensors), so the two run on two threads while the next piece is read:
/// the pass goes at the speed of one SHA-256 stream or of the disk.
pub fn digest_file(
    file: &SourceFile,
    tensors: &[TensorBytes],
    progress: &mut dyn FnMut(u64),
) -> Result<FileDigests> {
    let len = file.len();
    let covered = covered(tensors);
    let mut segs: Vec<(Range<u64>, usize)> = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| ascending(&t.ranges))
        .flat_map(|(i, t)| {
            t.ranges
                .iter()
                .filter(|r| r.start < r.end)
                .map(move |r| (r.clone(), i))
        })
        .collect();
    segs.sort_by_key(|(r, _)| r.start);
    let mut parts = PartHashers {
        covered: &covered,
        cov_i: 0,
        segs,
        next_seg: 0,
        active: Vec::new(),
        header: Sha256::new(),
        tensors: tensors.iter().map(|_| Sha256::new()).collect(),
    };
    let mut whole = Sha256::new();
    let piece = READ_PIECE.min(len as usize).max(1);
    let (mut cur, mut next) = (vec![0u8; piece], vec![0u8; piece]);
    let read = |pos: u64, buf: &mut Vec<u8>| -> Result<()> {
        let n = (len - pos).min(piece as u64) as usize;
        buf.resize(n, 0);
        file.read_at(pos, buf)
    };
    let mut pos = 0u64;
    if len > 0 {
        read(0, &mut cur)?;
    }
    while pos < len {
        let n = cur.len() as u64;
        let following = pos + n;
        let (w, pa, chunk) = (&mut whole, &mut parts, cur.as_slice());
        let ahead = std::thread::scope(|s| {
            let h = s.spawn(move || w.update(chunk));
            pa.feed(pos, chunk);
            let ahead = if following < len {
                read(following, &mut next)
            } else {
                Ok(())
            };
            // A panic in the hasher is a bug; surface it as one.
            h.join().map_err(|_| {
                err(
                    ErrorKind::BadValue,
                    "internal error: the hashing thread panicked",
                )
                .path(file.path())
            })?;
            ahead
        });
        ahead?;
        progress(n);
        pos = following;
        std::mem::swap(&mut cur, &mut next);
    }
    let mut out = Vec::with_capacity(tensors.len());
    for (t, h) in tensors.iter().zip(parts.tensors) {
        let d = if ascending(&t.ranges) {
            h.finalize().into()
        } else {
            digest_ranges(file, &t.ranges, READ_PIECE).map_err(|e| e.tensor(&t.name))?
        };
        out.push((t.name.clone(), d));
    }
    Ok(FileDigests {
        whole: whole.finalize().into(),
        header: parts.header.finalize().into(),
        tensors: out,
    })
}

/// The header digest alone: reads only the bytes outside every tensor
/// (what the mount checks before it mounts).
pub fn digest_header(file: &SourceFile, tensors: &[TensorBytes]) -> Result<Digest> {
    let pieces = gaps(&covered(tensors), file.len());
    digest_ranges(file, &pieces, READ_PIECE)
}

/// SHA-256 of the concatenation of `ranges` of `file`, read `piece` bytes
/// at a time.
pub fn digest_ranges(file: &SourceFile, ranges: &[Range<u64>], piece: usize) -> Result<Digest> {
    let longest = ranges
        .iter()
        .map(|r| r.end.saturating_sub(r.start))
        .max()
        .unwrap_or(0);
    let mut buf = vec![0u8; (piece as u64).min(longest).max(1) as usize];
    let mut h = Sha256::new();
    for r in ranges {
        let mut pos = r.start;
        while pos < r.end {
            let n = (r.end - pos).min(buf.len() as u64) as usize;
            file.read_at(pos, &mut buf[..n])?;
            h.update(&buf[..n]);
            pos += n as u64;
        }
    }
    Ok(h.finalize().into())
}

/// The whole file, `piece` bytes at a time; `progress` gets each piece's
/// length (a mount's background check counts them for `ctl`).
pub fn digest_whole(file: &SourceFile, piece: usize, progress: &dyn Fn(u64)) -> Result<Digest> {
    let len = file.len();
    let mut buf = vec![0u8; (piece as u64).min(len).max(1) as usize];
    let mut h = Sha256::new();
    let mut pos = 0;
    while pos < len {
        let n = (len - pos).min(buf.len() as u64) as usize;
        file.read_at(pos, &mut buf[..n])?;
        h.update(&buf[..n]);
        pos += n as u64;
        progress(n as u64);
    }
    Ok(h.finalize().into())
}
