//! A view's bytes: a header, then [`Segment`]s (each a range of one
//! tensor's elements, maybe in another row order), zeros between them;
//! [`Layout::pieces`] maps a byte range to those pieces without decoding
//! anything. A tensor of a view is usually one segment, the whole tensor
//! file; a tensor Hugging Face stores fused (a mixture-of-experts layer's
//! `gate_up_proj`: each expert's gate rows, then its up rows) is several
//! consecutive segments, each an element range of another tensor file.

use std::ops::Range;

use super::ElemFormat;
use super::transcode::SegmentBytes;
use crate::arch::rows::{RowGroups, RowOrder};
use crate::error::{ErrorKind, Result, add, err};

/// A run of one tensor's elements in a virtual file: bytes `[start, start
/// + len)` of the view are the elements of tensor file `file` from
/// `elem0` on, encoded in the view's format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub start: u64,
    pub len: u64,
    /// Index of the tensor file (the filesystem's table, not the backend's).
    pub file: usize,
    /// The tensor file's element at the segment's first byte (0: the
    /// segment starts at the tensor's start).
    pub elem0: u64,
    /// The segment's rows in Hugging Face order, the tensor file's in
    /// GGUF order (the `hf/` view's and the HF-named files' Q/K
    /// projections); `None`: the file's bytes as they are.
    pub rows: Option<RowGroups>,
}

impl Segment {
    /// `Layout::new` checked that this does not overflow; saturating for
    /// segments built elsewhere (`chunks_after` takes any slice).
    fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }

    /// The byte ranges of the tensor file (in a format of `bpe` bytes per
    /// element) that make up bytes `range` of the segment, in order: the
    /// range itself, or one range per row the range touches when the rows
    /// are permuted.
    pub fn source_ranges(&self, range: Range<u64>, bpe: u64) -> Vec<Range<u64>> {
        let base = self.elem0.saturating_mul(bpe);
        let shift = |r: Range<u64>| r.start.saturating_add(base)..r.end.saturating_add(base);
        let Some(p) = self.rows else {
            return vec![shift(range)];
        };
        let row_bytes = p.row_elems.saturating_mul(bpe);
        p.runs(RowOrder::Hf, row_bytes, range)
            .map(|(_, r)| shift(r))
            .collect()
    }

    /// The tensor file's element behind element `e` of the segment.
    pub fn src_elem(&self, e: u64) -> u64 {
        let e = match self.rows {
            Some(p) => p.source_elem(RowOrder::Hf, e),
            None => e,
        };
        e.saturating_add(self.elem0)
    }

    /// A segment of the whole of tensor file `file`, as it is.
    pub fn whole(start: u64, len: u64, file: usize) -> Segment {
        Segment {
            start,
            len,
            file,
            elem0: 0,
            rows: None,
        }
    }
}

/// Where the bytes of part of a read come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// These bytes of the header.
    Header(Range<usize>),
    /// This many zero bytes (alignment padding).
    Zeros(usize),
    /// Bytes `range` (relative to the segment's start, in the view's
    /// format) of segment `seg`.
    Tensor { seg: usize, range: Range<u64> },
}

/// A virtual file: header bytes, then segments in increasing order, zeros
/// in any gap and after the last segment up to `size`.
#[derive(Debug, Clone)]
pub struct Layout {
    header: Vec<u8>,
    fmt: ElemFormat,
    segments: Vec<Segment>,
    /// A stored-bytes layout's way of making each segment's bytes (empty:
    /// every segment is a tensor file in `fmt`).
    made: Vec<SegmentBytes>,
    size: u64,
}

impl Layout {
    /// Check that segments follow the header, are in order, do not overlap,
    /// hold whole elements and end within `size`.
    pub fn new(
        header: Vec<u8>,
        fmt: ElemFormat,
        segments: Vec<Segment>,
        size: u64,
    ) -> Result<Layout> {
        let mut pos = header.len() as u64;
        for s in &segments {
            let end = add(s.start, s.len, "view segment end")?;
            let rows_fit = s
                .rows
                .is_none_or(|p| s.len.checked_div(fmt.bytes()).is_some_and(|n| p.tiles(n)));
            if s.start < pos || !s.len.is_multiple_of(fmt.bytes()) || !rows_fit {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "internal error: view segment [{}, {end}) overlaps byte {pos}, holds \
                         a partial element or permutes rows it does not have",
                        s.start
                    ),
                ));
            }
            pos = end;
        }
        if pos > size {
            return Err(err(
                ErrorKind::BadValue,
                format!("internal error: view segments end at {pos}, past the size {size}"),
            ));
        }
        // `stat` reports sizes as a signed 64-bit number.
        if size > i64::MAX as u64 {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "the view would be {size} bytes, more than the largest file size stat can \
                     report (2^63 - 1 bytes)"
                ),
            ));
        }
        Ok(Layout {
            header,
            fmt,
            segments,
            made: Vec::new(),
            size,
        })
    }

    /// A layout whose segments are tensors' stored bytes, verbatim
    /// (`model.native.gguf`): any length, rows in stored order, read
    /// through `fs::native_read`, never through the decoded path (so `fmt`
    /// is F32 only to fill the field).
    pub fn stored(header: Vec<u8>, segments: Vec<Segment>, size: u64) -> Result<Layout> {
        let made = vec![SegmentBytes::Stored; segments.len()];
        Layout::transcoded(header, segments, made, size)
    }

    /// A stored-bytes layout whose segment `i`'s bytes are made as
    /// `made[i]` says (stored, re-packed or decoded: `fs::views::transcode`).
    pub fn transcoded(
        header: Vec<u8>,
        segments: Vec<Segment>,
        made: Vec<SegmentBytes>,
        size: u64,
    ) -> Result<Layout> {
        if made.len() != segments.len() {
            return Err(err(
                ErrorKind::BadValue,
                "internal error: a stored-bytes view without one way per segment",
            ));
        }
        if segments.iter().any(|s| s.rows.is_some() || s.elem0 != 0) {
            return Err(err(
                ErrorKind::BadValue,
                "internal error: a stored-bytes view segment permutes rows or starts inside \
                 its tensor",
            ));
        }
        let mut pos = header.len() as u64;
        if pos > size || size > i64::MAX as u64 {
            return Err(err(
                ErrorKind::TooLarge,
                format!("the view would be {size} bytes (header {pos})"),
            ));
        }
        for s in &segments {
            let end = add(s.start, s.len, "view segment end")?;
            if s.start < pos || end > size {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "internal error: stored view segment [{}, {end}) overlaps byte {pos} or \
                         ends past the size {size}",
                        s.start
                    ),
                ));
            }
            pos = end;
        }
        Ok(Layout {
            header,
            fmt: ElemFormat::F32,
            segments,
            made,
            size,
        })
    }

    /// How segment `seg` of a stored-bytes layout is made (stored bytes for
    /// any other layout).
    pub fn made(&self, seg: usize) -> SegmentBytes {
        self.made.get(seg).copied().unwrap_or(SegmentBytes::Stored)
    }

    pub fn header(&self) -> &[u8] {
        &self.header
    }

    pub fn fmt(&self) -> ElemFormat {
        self.fmt
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Where bytes `[offset, end)` (clipped to the size) come from, in
    /// order. Empty at or past the end.
    pub fn pieces(&self, offset: u64, end: u64) -> Vec<Piece> {
        let end = end.min(self.size);
        let mut out = Vec::new();
        let mut pos = offset;
        let hlen = self.header.len() as u64;
        if pos < end && pos < hlen {
            let e = end.min(hlen);
            // Both are at most the header's length, which is a usize.
            out.push(Piece::Header(pos as usize..e as usize));
            pos = e;
        }
        let mut i = self.segments.partition_point(|s| s.end() <= pos);
        while pos < end {
            match self.segments.get(i) {
                Some(s) if pos < s.start => {
                    let e = end.min(s.start);
                    // A gap inside one read: bounded by the read's size.
                    out.push(Piece::Zeros((e - pos) as usize));
                    pos = e;
                }
                Some(s) => {
                    let e = end.min(s.end());
                    if e > pos {
                        out.push(Piece::Tensor {
                            seg: i,
                            range: pos - s.start..e - s.start,
                        });
                    }
                    pos = e;
                    i += 1;
                }
                None => {
                    out.push(Piece::Zeros((end - pos) as usize));
                    pos = end;
                }
            }
        }
        out
    }
}

/// Up to `n` (tensor file, chunk) pairs a sequential reader of `segments`
/// (elements of `bpe` bytes) will need after byte `end`: the chunks after
/// the one holding byte `end - 1`, continuing into the following segments.
/// `chunk_elems(file)` is that file's chunk length in elements.
pub fn chunks_after(
    segments: &[Segment],
    bpe: u64,
    end: u64,
    n: u64,
    chunk_elems: impl Fn(usize) -> u64,
) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    let mut i = segments.partition_point(|s| s.end() <= end);
    let mut first = match segments.get(i) {
        Some(s) if end > s.start => {
            let ce = chunk_elems(s.file).max(1);
            s.src_elem((end - s.start - 1) / bpe) / ce + 1
        }
        _ => 0,
    };
    while (out.len() as u64) < n {
        let Some(s) = segments.get(i) else { break };
        let ce = chunk_elems(s.file).max(1);
        // The chunks of the segment's element range of its file.
        let last = s.elem0.saturating_add(s.len / bpe).div_ceil(ce);
        let mut c = first.max(s.elem0 / ce);
        while c < last && (out.len() as u64) < n {
            // A chunk an earlier segment of the same file listed.
            if !out.contains(&(s.file, c)) {
                out.push((s.file, c));
            }
            c += 1;
        }
        first = 0;
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        // header 10 bytes, tensor 0 at [16, 24), tensor 1 at [24, 36),
        // gap to 40, tensor 2 at [40, 44), trailing zeros to 48.
        Layout::new(
            (0u8..10).collect(),
            ElemFormat::F32,
            vec![
                Segment {
                    start: 16,
                    len: 8,
                    file: 0,
                    elem0: 0,
                    rows: None,
                },
                Segment {
                    start: 24,
                    len: 12,
                    file: 1,
                    elem0: 0,
                    rows: None,
                },
                Segment {
                    start: 40,
                    len: 4,
                    file: 2,
                    elem0: 0,
                    rows: None,
                },
            ],
            48,
        )
        .unwrap()
    }

    fn t(seg: usize, r: Range<u64>) -> Piece {
        Piece::Tensor { seg, range: r }
    }

    #[test]
    fn pieces_cover_header_gaps_and_segment_boundaries() {
        let l = layout();
        assert_eq!(l.pieces(0, 48).len(), 7);
        assert_eq!(
            l.pieces(0, 48),
            vec![
                Piece::Header(0..10),
                Piece::Zeros(6),
                t(0, 0..8),
                t(1, 0..12),
                Piece::Zeros(4),
                t(2, 0..4),
                Piece::Zeros(4),
            ]
        );
        // Straddles header/padding/data.
        assert_eq!(
            l.pieces(8, 18),
            vec![Piece::Header(8..10), Piece::Zeros(6), t(0, 0..2)]
        );
        // Straddles two tensors, unaligned at both ends.
        assert_eq!(l.pieces(21, 27), vec![t(0, 5..8), t(1, 0..3)]);
        // Inside one tensor.
        assert_eq!(l.pieces(25, 26), vec![t(1, 1..2)]);
        // Exactly one tensor.
        assert_eq!(l.pieces(24, 36), vec![t(1, 0..12)]);
        // Tail padding, clipped at EOF; past EOF is empty.
        assert_eq!(l.pieces(43, 1000), vec![t(2, 3..4), Piece::Zeros(4)]);
        assert_eq!(l.pieces(48, 60), vec![]);
        assert_eq!(l.pieces(1000, 2000), vec![]);
        assert_eq!(l.pieces(5, 5), vec![]);
        // Every byte is accounted for exactly once, for every range.
        for a in 0..50u64 {
            for b in a..52u64 {
                let n: u64 = l
                    .pieces(a, b)
                    .iter()
                    .map(|p| match p {
                        Piece::Header(r) => r.len() as u64,
                        Piece::Zeros(n) => *n as u64,
                        Piece::Tensor { range, .. } => range.end - range.start,
                    })
                    .sum();
                assert_eq!(n, b.min(48).saturating_sub(a), "{a}..{b}");
            }
        }
    }

    #[test]
    fn layouts_refuse_overlap_partial_elements_and_overrun() {
        let seg = |start, len| Segment::whole(start, len, 0);
        assert!(Layout::new(vec![0; 8], ElemFormat::F32, vec![seg(4, 4)], 16).is_err());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(0, 8), seg(4, 8)], 16).is_err());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(0, 6)], 16).is_err());
        assert!(Layout::new(vec![], ElemFormat::F16, vec![seg(0, 6)], 16).is_ok());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(0, 8)], 4).is_err());
        assert!(Layout::new(vec![], ElemFormat::F32, vec![seg(u64::MAX, 4)], 4).is_err());
    }

    #[test]
    fn layouts_larger_than_stat_can_report_are_refused() {
        let max = i64::MAX as u64;
        let segs = |len| vec![Segment::whole(8, len, 0)];
        let e = Layout::new(vec![0; 8], ElemFormat::F32, segs(8), max + 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TooLarge);
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("the view would be {} bytes", max + 1))
                && msg.contains("the largest file size stat can report (2^63 - 1 bytes)"),
            "{msg}"
        );
        // The largest size stat can report is fine.
        assert!(Layout::new(vec![0; 8], ElemFormat::F32, segs(max - 11), max).is_ok());
    }

    #[test]
    fn permuted_segments_map_rows_to_their_source() {
        // 2 groups of 4 rows of 3 elements, f32: rows 0..8 of the segment
        // come from file rows 0 2 1 3 | 4 6 5 7.
        let p = RowGroups {
            groups: 2,
            group_rows: 4,
            row_elems: 3,
        };
        let s = Segment {
            start: 100,
            len: 8 * 3 * 4,
            file: 0,
            elem0: 0,
            rows: Some(p),
        };
        let rows: Vec<u64> = (0..8).map(|r| p.gguf_row(r)).collect();
        assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
        // Bytes 10..30: the end of row 0, all of row 1, the start of row 2.
        assert_eq!(s.source_ranges(10..30, 4), vec![10..12, 24..36, 12..18]);
        // Every byte once, in order, for every range.
        for a in 0..96u64 {
            for b in a..=96 {
                let got: Vec<u64> = s.source_ranges(a..b, 4).into_iter().flatten().collect();
                let want: Vec<u64> = (a..b).map(|x| p.gguf_row(x / 12) * 12 + x % 12).collect();
                assert_eq!(got, want, "{a}..{b}");
            }
        }
        assert_eq!(s.src_elem(4), 2 * 3 + 1);
        // The layout refuses a permutation that does not cover the segment.
        let bad = Segment {
            len: 7 * 3 * 4,
            ..s.clone()
        };
        assert!(Layout::new(vec![0; 100], ElemFormat::F32, vec![bad], 400).is_err());
        assert!(Layout::new(vec![0; 100], ElemFormat::F32, vec![s], 400).is_ok());
    }

    #[test]
    fn segments_inside_a_tensor_map_to_its_elements() {
        // Elements 6.. of file 2 (f32), rows of 3 elements permuted in 2
        // groups of 2: segment row r is file row 6/3 + gguf_row(r).
        let p = RowGroups {
            groups: 2,
            group_rows: 2,
            row_elems: 3,
        };
        let s = Segment {
            start: 40,
            len: 4 * 3 * 4,
            file: 2,
            elem0: 6,
            rows: None,
        };
        assert_eq!(s.source_ranges(0..8, 4), vec![24..32]);
        assert_eq!(s.src_elem(5), 11);
        let permuted = Segment {
            rows: Some(p),
            ..s.clone()
        };
        for e in 0..12 {
            let want = 6 + p.gguf_row(e / 3) * 3 + e % 3;
            assert_eq!(permuted.src_elem(e), want, "{e}");
            let r = permuted.source_ranges(e * 4..e * 4 + 4, 4);
            assert_eq!(r, vec![want * 4..want * 4 + 4], "{e}");
        }
        // Stored-bytes views take whole tensors only.
        assert!(Layout::stored(vec![0; 40], vec![s.clone()], 100).is_err());
        // Read-ahead: gate rows 0..4 then up rows 0..4 of two experts
        // fused (file 0: elements 0..4 and 4..8 alternate with file 1's),
        // chunks of 4 elements: each file's chunk 0, then chunk 1, once.
        let fused: Vec<Segment> = (0..4u64)
            .map(|k| Segment {
                start: 16 * k,
                len: 16,
                file: (k % 2) as usize,
                elem0: 4 * (k / 2),
                rows: None,
            })
            .collect();
        assert_eq!(
            chunks_after(&fused, 4, 0, 10, |_| 4),
            vec![(0, 0), (1, 0), (0, 1), (1, 1)]
        );
        assert_eq!(
            chunks_after(&fused, 4, 16, 10, |_| 4),
            vec![(1, 0), (0, 1), (1, 1)]
        );
        // Chunks of 8: each file's one chunk.
        assert_eq!(chunks_after(&fused, 4, 0, 10, |_| 8), vec![(0, 0), (1, 0)]);
    }

    #[test]
    fn read_ahead_follows_segments() {
        let segs = vec![
            // 10 elements: chunks of 4 -> 3 chunks.
            Segment::whole(100, 40, 7),
            // 4 elements -> 1 chunk.
            Segment::whole(140, 16, 3),
        ];
        let ce = |_| 4;
        assert_eq!(
            chunks_after(&segs, 4, 0, 10, ce),
            vec![(7, 0), (7, 1), (7, 2), (3, 0)]
        );
        // After byte 116 (end of chunk 0): chunk 1 onwards.
        assert_eq!(chunks_after(&segs, 4, 116, 2, ce), vec![(7, 1), (7, 2)]);
        // Mid-chunk 1: its chunk was just read, the next is 2.
        assert_eq!(chunks_after(&segs, 4, 121, 5, ce), vec![(7, 2), (3, 0)]);
        assert_eq!(chunks_after(&segs, 4, 140, 5, ce), vec![(3, 0)]);
        assert_eq!(chunks_after(&segs, 4, 150, 5, ce), vec![]);
        assert_eq!(chunks_after(&segs, 4, 0, 0, ce), vec![]);
    }
}
