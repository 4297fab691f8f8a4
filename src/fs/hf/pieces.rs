//! A file of `hf/` served in pieces: literal text, and runs of items each
//! rendered on demand from the model metadata (a token of the vocabulary,
//! a merge, a piece of the chat template). Only the text, and the offset
//! of every `stride`-th item of a run, are kept; a read renders the items
//! it overlaps, starting from the mark before it. Rendering is
//! deterministic, so every read agrees with the length measured when the
//! file was built (once, item by item, at mount).
//!
//! This keeps the mount from holding a second, JSON-escaped copy of a
//! large vocabulary, merge list or chat template (issue 26, item 4): the
//! metadata is already in memory, and the kernel's page cache keeps what
//! readers read.

use crate::format::meta::Metadata;

/// A run of items of a file. `render` must append the same bytes for the
/// same item every time (the separator before it included).
pub(super) trait Items: Send + Sync {
    fn count(&self) -> usize;
    fn render(&self, md: &Metadata, i: usize, out: &mut Vec<u8>);
}

enum Part {
    Text(Vec<u8>),
    Run {
        items: Box<dyn Items>,
        stride: usize,
        /// `marks[k]`: offset of item `k * stride` from the run's start.
        marks: Vec<u64>,
    },
}

/// A file's parts and where each starts; `starts[parts.len()]` is the
/// file's length.
pub(super) struct Pieces {
    parts: Vec<Part>,
    starts: Vec<u64>,
}

impl Pieces {
    /// A file of literal bytes.
    pub(super) fn text(bytes: Vec<u8>) -> Pieces {
        let mut p = Pieces::new();
        p.push_text(bytes);
        p
    }

    pub(super) fn new() -> Pieces {
        Pieces {
            parts: Vec::new(),
            starts: vec![0],
        }
    }

    fn end(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    pub(super) fn push_text(&mut self, bytes: Vec<u8>) {
        let end = self.end() + bytes.len() as u64;
        self.parts.push(Part::Text(bytes));
        self.starts.push(end);
    }

    /// Append a run, measuring it by rendering every item once (into one
    /// item's worth of scratch memory).
    pub(super) fn push_items(&mut self, md: &Metadata, items: Box<dyn Items>, stride: usize) {
        let stride = stride.max(1);
        let n = items.count();
        let mut marks = Vec::with_capacity(n / stride + 1);
        let mut len = 0u64;
        let mut scratch = Vec::new();
        for i in 0..n {
            if i % stride == 0 {
                marks.push(len);
            }
            scratch.clear();
            items.render(md, i, &mut scratch);
            len += scratch.len() as u64;
        }
        let end = self.end() + len;
        self.parts.push(Part::Run {
            items,
            stride,
            marks,
        });
        self.starts.push(end);
    }

    pub(super) fn len(&self) -> u64 {
        self.end()
    }

    /// Bytes `[offset, offset + size)` of the file (fewer at its end).
    pub(super) fn read(&self, md: &Metadata, offset: u64, size: u32) -> Vec<u8> {
        let end = offset.saturating_add(u64::from(size)).min(self.len());
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        let mut scratch = Vec::new();
        for (k, part) in self.parts.iter().enumerate() {
            let (p_start, p_end) = (self.starts[k], self.starts[k + 1]);
            if p_end <= offset || p_start >= end {
                continue;
            }
            // The wanted range, relative to this part.
            let (lo, hi) = (offset.max(p_start) - p_start, end.min(p_end) - p_start);
            match part {
                // Both are at most the text's length, a usize.
                Part::Text(t) => out.extend_from_slice(&t[lo as usize..hi as usize]),
                Part::Run {
                    items,
                    stride,
                    marks,
                } => {
                    let m = marks.partition_point(|&x| x <= lo).saturating_sub(1);
                    let mut pos = marks.get(m).copied().unwrap_or(0);
                    let mut i = m * stride;
                    while pos < hi && i < items.count() {
                        scratch.clear();
                        items.render(md, i, &mut scratch);
                        let next = pos + scratch.len() as u64;
                        if next > lo {
                            let a = lo.saturating_sub(pos) as usize;
                            let b = (hi.min(next) - pos) as usize;
                            out.extend_from_slice(&scratch[a..b]);
                        }
                        pos = next;
                        i += 1;
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Item i is `i` in decimal and a comma; every third renders nothing.
    struct Numbers(usize);

    impl Items for Numbers {
        fn count(&self) -> usize {
            self.0
        }
        fn render(&self, _: &Metadata, i: usize, out: &mut Vec<u8>) {
            if i % 3 != 1 {
                out.extend_from_slice(format!("{i},").as_bytes());
            }
        }
    }

    #[test]
    fn every_range_reads_as_the_whole_rendered_at_once() {
        let md = Metadata::default();
        for stride in [1, 2, 7, 64] {
            let mut p = Pieces::new();
            p.push_text(b"head[".to_vec());
            p.push_items(&md, Box::new(Numbers(200)), stride);
            p.push_text(b"]mid".to_vec());
            p.push_items(&md, Box::new(Numbers(0)), stride);
            p.push_items(&md, Box::new(Numbers(5)), stride);
            p.push_text(b"tail".to_vec());
            let mut want = b"head[".to_vec();
            for i in (0..200).filter(|i| i % 3 != 1) {
                want.extend_from_slice(format!("{i},").as_bytes());
            }
            want.extend_from_slice(b"]mid0,2,3,tail");
            assert_eq!(p.len(), want.len() as u64);
            let n = want.len() as u64;
            for off in 0..=n + 2 {
                for size in [0u32, 1, 2, 5, 17, 1000] {
                    let lo = off.min(n) as usize;
                    let hi = (off + u64::from(size)).min(n) as usize;
                    assert_eq!(
                        p.read(&md, off, size),
                        want[lo..hi.max(lo)],
                        "stride {stride} offset {off} size {size}"
                    );
                }
            }
        }
        assert_eq!(Pieces::text(b"abc".to_vec()).read(&md, 1, 9), b"bc");
    }
}
