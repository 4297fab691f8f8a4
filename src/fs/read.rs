//! The read path: tensor files and model views, served from the decoded
//! chunk cache.
//!
//! A read of tensor file `f` in format `fmt` maps its byte range to the
//! elements it covers, then:
//! - a small read (<= [`SMALL_READ_BYTES`]) that misses the cache and does
//!   not continue a sequential stream decodes only its own elements,
//!   uncached (a random 4 KiB read must not pay for a whole chunk);
//! - otherwise each chunk comes from the cache, through the read's
//!   registration ([`BlockCache::begin_read`], made as early as it can be
//!   so that concurrent reads of one stream do not evict each other's
//!   chunks);
//!   a range inside one f32 chunk is replied straight from it (no copy),
//!   anything else is assembled, converting f32 to f16/bf16 as it is
//!   copied.
//!
//! A view read maps its range to header bytes, zero padding and tensor
//! ranges ([`Layout::pieces`]) and serves each tensor range as above.
//! Sequential readers (per open file handle) get read-ahead: the chunks
//! after their position are decoded by [`super::prefetch`] threads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::files::TensorFile;
use super::namespace::Node;
use super::views::{self, ElemFormat, Layout, Piece};
use super::{ReadData, SMALL_READ_BYTES, TensorFs};
use crate::backend::Backend;
use crate::cache::{BlockCache, Chunk, ChunkKey, PendingRead, Prefetched, lock};
use crate::error::Result;

/// Everything the read path shares with the prefetch threads.
pub(crate) struct Shared {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) cache: BlockCache,
    pub(super) files: Vec<TensorFile>,
}

impl Shared {
    /// Decode chunk `chunk` of tensor file `f` through the cache, for
    /// `read` (registered with [`Shared::begin_read`]).
    pub(super) fn chunk(&self, read: &PendingRead<'_>, f: usize, chunk: u64) -> Result<Chunk> {
        let (key, first, len) = self.chunk_span(f, chunk);
        read.get_or_decode(key, len, |buf| self.decode(f, first, buf))
    }

    /// Register a read of the byte ranges `ranges` of tensor files (file,
    /// lo, hi; elements of `bpe` bytes) with the cache: the chunks it will
    /// fetch are kept from later reads and read-ahead until it has them
    /// ([`BlockCache::begin_read`]).
    fn begin_read(
        &self,
        order: Option<u64>,
        bpe: u64,
        ranges: impl IntoIterator<Item = (usize, u64, u64)>,
    ) -> PendingRead<'_> {
        self.cache.begin_read(
            order,
            ranges.into_iter().flat_map(move |(f, lo, hi)| {
                let ce = self.files[f].chunk_elems.max(1);
                let (c0, c1) = (lo / bpe / ce, hi.div_ceil(bpe).saturating_sub(1) / ce);
                (c0..=c1).map(move |chunk| ChunkKey {
                    tensor: f as u32,
                    chunk,
                })
            }),
        )
    }

    /// Read-ahead of chunk `chunk` of tensor file `f` into the cache, for
    /// a reader in chunk `reader_at`: never waits for budget (see
    /// [`BlockCache::prefetch`]).
    pub(super) fn prefetch(
        &self,
        f: usize,
        chunk: u64,
        reader_at: Option<ChunkKey>,
    ) -> Result<Prefetched> {
        let (key, first, len) = self.chunk_span(f, chunk);
        self.cache
            .prefetch(key, len, reader_at, |buf| self.decode(f, first, buf))
    }

    /// Chunk `chunk` of tensor file `f`: its cache key, first element and
    /// length in elements.
    fn chunk_span(&self, f: usize, chunk: u64) -> (ChunkKey, u64, usize) {
        let file = &self.files[f];
        let key = ChunkKey {
            tensor: f as u32,
            chunk,
        };
        let first = chunk * file.chunk_elems;
        let len = file.chunk_elems.min(file.n_elements.saturating_sub(first)) as usize;
        (key, first, len)
    }

    /// Decode elements `[first, first + out.len())` of tensor file `f`.
    /// Every decode of the read path comes through here, so a decoder panic
    /// (a bug) fails this one read with EIO instead of killing a FUSE
    /// worker thread, which would end the session.
    pub(super) fn decode(&self, f: usize, first: u64, out: &mut [f32]) -> Result<()> {
        let index = self.files[f].index;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.backend.read_f32(index, first, out)
        }))
        .unwrap_or_else(|_| {
            Err(crate::Error::new(
                crate::error::ErrorKind::BadValue,
                "internal error: decoder panicked",
            ))
        })
    }
}

/// Read counters reported by `ctl`.
#[derive(Default)]
pub(super) struct Counters {
    pub(super) reads: AtomicU64,
    pub(super) read_errors: AtomicU64,
    /// Reads failed because stored bytes disagree with their checksum.
    pub(super) checksum_errors: AtomicU64,
    pub(super) reads_in_flight: AtomicU64,
    pub(super) small_reads: AtomicU64,
    pub(super) bytes_served: AtomicU64,
}

/// Read-ahead state of one open tensor or view file handle.
#[derive(Debug, Default)]
pub(super) struct Stream {
    next_offset: u64,
    window: u64,
    /// The last chunk handed to the prefetcher for this stream: later reads
    /// request only the chunks after it, so chunks still queued are not
    /// queued again.
    last_requested: Option<(usize, u64)>,
}

/// Open tensor and view files: one [`Stream`] per file handle.
#[derive(Default)]
pub(super) struct Streams {
    by_fh: Mutex<HashMap<u64, Stream>>,
}

impl Streams {
    pub(super) fn open(&self, fh: u64) {
        lock(&self.by_fh).insert(fh, Stream::default());
    }

    pub(super) fn release(&self, fh: u64) {
        lock(&self.by_fh).remove(&fh);
    }

    fn is_sequential(&self, fh: u64, offset: u64) -> bool {
        lock(&self.by_fh)
            .get(&fh)
            .is_some_and(|h| h.next_offset == offset && offset > 0)
    }
}

impl TensorFs {
    /// Serve `[offset, offset + size)` of tensor file or view `node`.
    /// `order` is the FUSE request's unique id, if it is one: concurrent
    /// reads get the cache in that order ([`BlockCache::begin_read`]).
    /// Errors are counted and logged (rate-limited per file) and become
    /// the error's errno.
    pub(super) fn read_node(
        &self,
        node: &Node<'_>,
        fh: u64,
        offset: u64,
        size: u32,
        order: Option<u64>,
    ) -> std::result::Result<ReadData, i32> {
        let c = &self.counters;
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.reads_in_flight.fetch_add(1, Ordering::Relaxed);
        let r = match node {
            Node::Tensor { f, fmt } => self.read_tensor(*f, *fmt, fh, offset, size, order),
            Node::View(_, l) | Node::Alias(_, l) => self.read_view(l, fh, offset, size, order),
            Node::Native(_, l) => self.read_native(l, offset, size),
        };
        c.reads_in_flight.fetch_sub(1, Ordering::Relaxed);
        match r {
            Ok(d) => {
                c.bytes_served
                    .fetch_add(d.bytes().len() as u64, Ordering::Relaxed);
                Ok(d)
            }
            Err(e) => {
                c.read_errors.fetch_add(1, Ordering::Relaxed);
                if e.kind() == crate::ErrorKind::Checksum {
                    c.checksum_errors.fetch_add(1, Ordering::Relaxed);
                }
                let what = match node {
                    Node::Tensor { f, fmt } => format!("{}.{}", self.tensor_name(*f), fmt.ext()),
                    Node::View(v, _) | Node::Native(v, _) => v.view.name().to_string(),
                    Node::Alias(a, l) => format!("{}.{}", a.name.dot, l.fmt().ext()),
                };
                // One line per file and kind of error per window: a reader
                // retrying a bad block must not flood the log.
                crate::logging::throttled!(
                    log::Level::Error,
                    &format!("read error {what} {:?}", e.kind()),
                    "read of {size} bytes at {offset} of {what}: {e}",
                );
                Err(e.errno())
            }
        }
    }

    pub(super) fn tensor_name(&self, f: usize) -> &str {
        let i = self.shared.files[f].index;
        &self.shared.backend.tensors().entries()[i].name.dot
    }

    /// Whether a read of bytes `[lo, hi)` of tensor file `f` in `fmt` at
    /// file offset `offset` should decode only its own elements, uncached:
    /// a small read that is not continuing a sequential stream and whose
    /// chunk is not cached. A random 4 KiB read must not pay for a whole
    /// chunk.
    fn small_read(
        &self,
        f: usize,
        fmt: ElemFormat,
        fh: u64,
        offset: u64,
        lo: u64,
        hi: u64,
    ) -> bool {
        let file = &self.shared.files[f];
        let bpe = fmt.bytes();
        let (c0, c1) = (
            lo / bpe / file.chunk_elems,
            (hi - 1) / bpe / file.chunk_elems,
        );
        hi - lo <= SMALL_READ_BYTES
            && c0 == c1
            && !self.streams.is_sequential(fh, offset)
            && !self.shared.cache.is_present(ChunkKey {
                tensor: f as u32,
                chunk: c0,
            })
    }

    fn read_tensor(
        &self,
        f: usize,
        fmt: ElemFormat,
        fh: u64,
        offset: u64,
        size: u32,
        order: Option<u64>,
    ) -> Result<ReadData> {
        let len = self.shared.files[f].bytes(fmt);
        if offset >= len || size == 0 {
            return Ok(ReadData::Owned(Vec::new()));
        }
        let end = len.min(offset.saturating_add(u64::from(size)));
        let small = self.small_read(f, fmt, fh, offset, offset, end);
        // Registered as early as it can be: until then, a read the kernel
        // sent after this one may evict the chunks this one needs. (The
        // small-read check takes no lock for a read larger than a small
        // one; a small read fetches no chunk.)
        let range = (!small).then_some((f, offset, end));
        let read = self.shared.begin_read(order, fmt.bytes(), range);
        let data = self.tensor_range(&read, f, fmt, offset, end, small)?;
        drop(read);
        let whole = [views::Segment::whole(0, len, f)];
        self.after_read(fh, offset, end, &whole, fmt);
        Ok(data)
    }

    fn read_view(
        &self,
        l: &Layout,
        fh: u64,
        offset: u64,
        size: u32,
        order: Option<u64>,
    ) -> Result<ReadData> {
        if offset >= l.size() || size == 0 {
            return Ok(ReadData::Owned(Vec::new()));
        }
        let end = l.size().min(offset.saturating_add(u64::from(size)));
        let bpe = l.fmt().bytes();
        // Tensor pieces as byte ranges of tensor files: a segment whose rows
        // are permuted (hf/'s Q and K) gives one range per row it touches.
        let mut parts = Vec::new();
        for p in l.pieces(offset, end) {
            match p {
                Piece::Header(r) => parts.push(Part::Header(r)),
                Piece::Zeros(n) => parts.push(Part::Zeros(n)),
                Piece::Tensor { seg, range } => {
                    let s = &l.segments()[seg];
                    parts.extend(
                        s.source_ranges(range, bpe)
                            .into_iter()
                            .map(|r| Part::Tensor(s.file, r)),
                    );
                }
            }
        }
        // Inside one tensor range: the tensor files' path (their small-read
        // rule, zero-copy from a chunk for f32).
        let inside = match parts.as_slice() {
            [Part::Tensor(f, r)] => Some((*f, r.clone())),
            _ => None,
        };
        let small = inside
            .as_ref()
            .is_some_and(|(f, r)| self.small_read(*f, l.fmt(), fh, offset, r.start, r.end));
        let tensor_ranges = parts.iter().filter_map(|p| match p {
            Part::Tensor(f, r) if !small => Some((*f, r.start, r.end)),
            _ => None,
        });
        // As early as it can be (see `read_tensor`).
        let read = self.shared.begin_read(order, bpe, tensor_ranges);
        let data = match inside {
            Some((f, r)) => self.tensor_range(&read, f, l.fmt(), r.start, r.end, small)?,
            None => {
                let mut out = Vec::with_capacity((end - offset) as usize);
                for p in parts {
                    match p {
                        Part::Header(r) => out.extend_from_slice(&l.header()[r]),
                        Part::Zeros(n) => out.resize(out.len() + n, 0),
                        Part::Tensor(f, r) => {
                            self.append_tensor(&read, f, l.fmt(), r.start, r.end, &mut out)?
                        }
                    }
                }
                ReadData::Owned(out)
            }
        };
        drop(read);
        self.after_read(fh, offset, end, l.segments(), l.fmt());
        Ok(data)
    }

    /// Bytes `[lo, hi)` (non-empty, within the tensor) of tensor file `f`
    /// encoded as `fmt`, for `read` (unless `small`: decoded uncached).
    fn tensor_range(
        &self,
        read: &PendingRead<'_>,
        f: usize,
        fmt: ElemFormat,
        lo: u64,
        hi: u64,
        small: bool,
    ) -> Result<ReadData> {
        let file = &self.shared.files[f];
        let bpe = fmt.bytes();
        let (e0, e1) = (lo / bpe, hi.div_ceil(bpe));
        if small {
            self.counters.small_reads.fetch_add(1, Ordering::Relaxed);
            let mut vals = vec![0f32; (e1 - e0) as usize];
            self.shared.decode(f, e0, &mut vals)?;
            let skip = (lo - e0 * bpe) as usize;
            let take = (hi - lo) as usize;
            if fmt == ElemFormat::F32 {
                // Replied straight from the decoded values, like a chunk.
                return Ok(ReadData::Chunk(Chunk::uncached(vals), skip..skip + take));
            }
            let mut out = Vec::with_capacity(take);
            views::encode_into(fmt, &vals, skip, take, &mut out);
            return Ok(ReadData::Owned(out));
        }
        let (c0, c1) = (e0 / file.chunk_elems, (e1 - 1) / file.chunk_elems);
        if fmt == ElemFormat::F32 && c0 == c1 {
            // A range inside one chunk is replied straight from it.
            let chunk = self.shared.chunk(read, f, c0)?;
            let base = c0 * file.chunk_elems * 4;
            return Ok(ReadData::Chunk(
                chunk,
                (lo - base) as usize..(hi - base) as usize,
            ));
        }
        let mut out = Vec::with_capacity((hi - lo) as usize);
        self.append_tensor(read, f, fmt, lo, hi, &mut out)?;
        Ok(ReadData::Owned(out))
    }

    /// Append bytes `[lo, hi)` of tensor file `f` encoded as `fmt` to
    /// `out`, from the cached chunks that cover them, for `read`.
    fn append_tensor(
        &self,
        read: &PendingRead<'_>,
        f: usize,
        fmt: ElemFormat,
        lo: u64,
        hi: u64,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let file = &self.shared.files[f];
        let bpe = fmt.bytes();
        let ce = file.chunk_elems;
        let (e0, e1) = (lo / bpe, hi.div_ceil(bpe));
        for c in e0 / ce..=(e1 - 1) / ce {
            let chunk = self.shared.chunk(read, f, c)?;
            let base = c * ce;
            // Elements of this chunk inside [e0, e1), chunk-relative.
            let a = e0.max(base) - base;
            let b = e1.min(base + chunk.len() as u64) - base;
            // Their encoded bytes start at (base + a) * bpe; take only [lo, hi).
            let first_byte = (base + a) * bpe;
            let skip = lo.saturating_sub(first_byte);
            let take = hi.min((base + b) * bpe) - (first_byte + skip);
            views::encode_into(
                fmt,
                &chunk[a as usize..b as usize],
                skip as usize,
                take as usize,
                out,
            );
        }
        Ok(())
    }

    /// Track the handle's stream: a read that starts where the previous one
    /// ended is sequential (that also decides the small-read rule). With
    /// prefetch on, sequential readers get a read-ahead window that doubles
    /// on each sequential read (up to `prefetch_max_chunks`, which
    /// `TensorFs::new` limits to half the cache's chunks) and resets on
    /// a seek; the window's chunks are those after byte `end` of the file,
    /// whose tensor bytes are `segments` in `fmt` (one segment for a tensor
    /// file; a view continues into the next tensors).
    fn after_read(
        &self,
        fh: u64,
        offset: u64,
        end: u64,
        segments: &[views::Segment],
        fmt: ElemFormat,
    ) {
        let prefetch = self.config.prefetch_threads > 0;
        let wanted = {
            let mut streams = lock(&self.streams.by_fh);
            let Some(h) = streams.get_mut(&fh) else {
                return;
            };
            let sequential = offset == h.next_offset;
            h.next_offset = end;
            if !prefetch {
                return;
            }
            if sequential {
                // The limit is a fraction of the cache's chunks
                // (`prefetch::max_window_chunks`), 0 for a cache too small
                // to read ahead into.
                h.window = (h.window * 2).max(1).min(self.config.prefetch_max_chunks);
            } else {
                h.window = 0;
                h.last_requested = None;
            }
            let mut next = views::chunks_after(segments, fmt.bytes(), end, h.window, |f| {
                self.shared.files[f].chunk_elems
            });
            // Skip what this stream already requested (the list is in read
            // order, so everything up to the last request).
            if let Some(i) = h
                .last_requested
                .and_then(|last| next.iter().position(|c| *c == last))
            {
                next.drain(..=i);
            }
            if let Some(last) = next.last() {
                h.last_requested = Some(*last);
            }
            next
        };
        if wanted.is_empty() {
            return;
        }
        // The chunk this read ended in: its read-ahead must not evict it.
        let reader_at = chunk_holding(segments, fmt.bytes(), end - 1, |f| {
            self.shared.files[f].chunk_elems
        })
        .map(|(f, chunk)| ChunkKey {
            tensor: f as u32,
            chunk,
        });
        for (f, c) in wanted {
            self.prefetch.request(f, c, reader_at);
        }
    }
}

/// Where the bytes of part of a view read come from: [`Piece`] with
/// tensor pieces resolved to byte ranges of tensor files.
enum Part {
    Header(std::ops::Range<usize>),
    Zeros(usize),
    /// Bytes `range` (in the view's format) of tensor file `file`.
    Tensor(usize, std::ops::Range<u64>),
}

/// The (tensor file, chunk) holding byte `pos` of a file whose tensor bytes
/// are `segments` (elements of `bpe` bytes), if `pos` is a tensor byte.
fn chunk_holding(
    segments: &[views::Segment],
    bpe: u64,
    pos: u64,
    chunk_elems: impl Fn(usize) -> u64,
) -> Option<(usize, u64)> {
    let s = segments.get(segments.partition_point(|s| s.start.saturating_add(s.len) <= pos))?;
    (pos >= s.start).then(|| {
        (
            s.file,
            s.src_elem((pos - s.start) / bpe) / chunk_elems(s.file).max(1),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::chunk_holding;
    use crate::fs::views::Segment;

    #[test]
    fn chunk_holding_finds_the_segment_and_chunk_of_a_byte() {
        // A view: 100 header bytes, then tensor file 3 (8 f32 elements in
        // chunks of 2), 8 padding bytes, then tensor file 5 (4 elements in
        // one chunk of 4).
        let segments = [
            Segment {
                start: 100,
                len: 32,
                file: 3,
                elem0: 0,
                rows: None,
            },
            Segment {
                start: 140,
                len: 16,
                file: 5,
                elem0: 0,
                rows: None,
            },
        ];
        let ce = |f| if f == 3 { 2 } else { 4 };
        let at = |pos| chunk_holding(&segments, 4, pos, ce);
        assert_eq!(at(0), None);
        assert_eq!(at(99), None);
        assert_eq!(at(100), Some((3, 0)));
        assert_eq!(at(107), Some((3, 0)));
        assert_eq!(at(108), Some((3, 1)));
        assert_eq!(at(131), Some((3, 3)));
        assert_eq!(at(132), None);
        assert_eq!(at(140), Some((5, 0)));
        assert_eq!(at(155), Some((5, 0)));
        assert_eq!(at(156), None);
    }
}
