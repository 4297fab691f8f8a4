//! Read-ahead: decode the chunks after a sequential reader's position on
//! other cores, into the shared cache, so a cold sequential read is not
//! bound by one thread's decode speed.
//!
//! Requests go through a bounded queue; when it is full a request is
//! dropped (the reader will decode that chunk itself). Chunks already cached,
//! being decoded or requested are skipped, and the cache's single-flight
//! makes a reader that arrives during the prefetch wait for it rather than
//! decode twice. A request whose chunk a reader asked for while it waited
//! in the queue is dropped ([`BlockCache::request_ahead`]): on a busy
//! machine the read-ahead threads can fall behind the reader, and decoding
//! the chunks it has passed decoded them twice and evicted the one it was
//! in. Read-ahead never evicts the chunk its reader is in.
//!
//! [`BlockCache::request_ahead`]: crate::cache::BlockCache::request_ahead
//!
//! How far ahead: never more chunks than half the cache holds
//! ([`max_window_chunks`]), for one stream's window and for the queue of
//! all streams. Chunks decoded ahead push older chunks out of the cache;
//! with a window as large as the cache they pushed out each other and the
//! chunk being read (SmolLM2's token_embd: `--cache-mb 1` decoded 2.8-3.5x,
//! `--cache-mb 8` 2.4-2.9x the bytes a cold sequential read was served).
//! Half leaves the other half to the chunks being read and to other
//! readers. The cache itself refuses a read-ahead decode that would evict
//! a chunk nobody has read yet, or that finds the budget all in flight or
//! a reader waiting for it (counted as dropped).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};

use super::read::Shared;
use crate::cache::{ChunkKey, Prefetched};

/// The queue's depth when the cache allows more.
const MAX_QUEUE_DEPTH: u64 = 256;

/// The largest read-ahead window, in chunks, for a cache of `cache_bytes`
/// and chunks of `chunk_bytes`: half the chunks the cache holds, at most
/// `configured`. 0 (no read-ahead) for a cache of fewer than two chunks,
/// where a chunk decoded ahead would evict the one being read.
pub(crate) fn max_window_chunks(cache_bytes: u64, chunk_bytes: u64, configured: u64) -> u64 {
    let capacity_chunks = cache_bytes / chunk_bytes.max(1);
    configured.min(capacity_chunks / 2)
}

pub(crate) struct Prefetcher {
    tx: Option<SyncSender<Request>>,
    counters: Arc<Counters>,
    shared: Arc<Shared>,
}

/// Decode chunk `chunk` of tensor file `file` for a reader now in chunk
/// `reader_at` (which the decode must not evict).
struct Request {
    file: usize,
    chunk: u64,
    reader_at: Option<ChunkKey>,
}

#[derive(Default)]
struct Counters {
    requested: AtomicU64,
    /// Requests dropped: the queue was full, or the cache had no budget.
    dropped: AtomicU64,
}

impl Prefetcher {
    /// Start `threads` read-ahead threads (none if 0 or if `max_window` is
    /// 0), with a queue of `max_window` requests (at most 256).
    pub(crate) fn start(shared: Arc<Shared>, threads: usize, max_window: u64) -> Prefetcher {
        let counters = Arc::new(Counters::default());
        let tx = if threads == 0 || max_window == 0 {
            None
        } else {
            let depth = max_window.min(MAX_QUEUE_DEPTH) as usize;
            let (tx, rx) = sync_channel::<Request>(depth);
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..threads {
                let (rx, shared, counters) = (rx.clone(), shared.clone(), counters.clone());
                let spawned = std::thread::Builder::new()
                    .name(format!("rknot-prefetch-{i}"))
                    .spawn(move || worker(&rx, &shared, &counters));
                if let Err(e) = spawned {
                    log::warn!("cannot start prefetch thread: {e}");
                }
            }
            Some(tx)
        };
        Prefetcher {
            tx,
            counters,
            shared,
        }
    }

    /// Ask for chunk `chunk` of file `f` to be decoded soon, for a reader
    /// now in chunk `reader_at`.
    pub(crate) fn request(&self, f: usize, chunk: u64, reader_at: Option<ChunkKey>) {
        let Some(tx) = &self.tx else { return };
        let key = ChunkKey {
            tensor: f as u32,
            chunk,
        };
        if !self.shared.cache.request_ahead(key) {
            return;
        }
        self.counters.requested.fetch_add(1, Ordering::Relaxed);
        let request = Request {
            file: f,
            chunk,
            reader_at,
        };
        match tx.try_send(request) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.shared.cache.cancel_ahead(key);
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn requested(&self) -> u64 {
        self.counters.requested.load(Ordering::Relaxed)
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }
}

fn worker(rx: &Mutex<Receiver<Request>>, shared: &Shared, counters: &Counters) {
    loop {
        // The lock is held only to take one request off the queue.
        let next = crate::cache::lock(rx).recv();
        let Ok(Request {
            file: f,
            chunk,
            reader_at,
        }) = next
        else {
            return; // the filesystem was dropped
        };
        // The cache skips it if it is present or a reader got there first.
        match shared.prefetch(f, chunk, reader_at) {
            Ok(Prefetched::Decoded | Prefetched::Present | Prefetched::Passed) => {}
            Ok(Prefetched::NoBudget) => {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
            // Rate-limited: a bad region would otherwise log once per
            // chunk of every read-ahead window.
            Err(e) => crate::logging::throttled!(
                log::Level::Warn,
                &format!("prefetch error {f} {:?}", e.kind()),
                "prefetch of chunk {chunk} of file {f}: {e}",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::max_window_chunks;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_window_is_half_the_cache_chunks_at_most_the_configured_maximum() {
        // (cache, chunk, configured) -> window
        let cases = [
            ((256 * MIB, MIB, 32), 32), // the defaults: unchanged
            ((MIB, MIB, 32), 0),        // one chunk: no read-ahead
            ((2 * MIB, MIB, 32), 1),
            ((3 * MIB, MIB, 32), 1),
            ((8 * MIB, MIB, 32), 4),
            ((64 * MIB, MIB, 32), 32),
            ((64 * MIB, 16 * MIB, 32), 2),
            ((16 * MIB, 16 * MIB, 32), 0),
            ((0, MIB, 32), 0),
            ((MIB, 0, 32), 32), // a zero chunk size is not a division by zero
            ((8 * MIB, MIB, 0), 0),
        ];
        for ((cache, chunk, configured), want) in cases {
            assert_eq!(
                max_window_chunks(cache, chunk, configured),
                want,
                "cache {cache} chunk {chunk} configured {configured}"
            );
        }
    }
}
