//! The decoded-block cache: an LRU of decoded chunks bounded in bytes, with
//! single-flight decoding.
//!
//! - The lock protects only the map; decoding happens outside it, so any
//!   number of threads decode different chunks in parallel.
//! - Two readers that miss the same chunk decode it once: the first inserts
//!   an in-flight slot and decodes; the others wait on that slot.
//! - Capacity is in bytes of decoded data. A chunk larger than the whole
//!   capacity is returned to its readers but not kept.
//! - Errors are handed to every waiter and not cached: the next read tries
//!   again (a source file that was truncated and then restored recovers).
//! - Evicted chunk buffers that no reply still holds go to a pool and are
//!   reused for the next decode: a fresh 1 MiB buffer costs 256 page faults,
//!   which halved cold read throughput. The pool uses the cache's unused
//!   capacity plus a fixed reserve (POOL_RESERVE).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use lru::LruCache;

use crate::error::{Error, ErrorKind, Result};

/// One decoded chunk: little-endian f32 values.
pub type Chunk = Arc<Vec<f32>>;

/// Which chunk of which tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    pub tensor: u32,
    pub chunk: u64,
}

/// Counters reported by `ctl`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub capacity: u64,
    pub bytes_used: u64,
    /// Bytes of recycled buffers waiting for reuse (within the capacity).
    pub pool_bytes: u64,
    pub chunks: u64,
    pub hits: u64,
    pub misses: u64,
    /// Misses that found the chunk already being decoded and waited for it.
    pub waits: u64,
    pub evictions: u64,
    pub bytes_decoded: u64,
    pub decode_errors: u64,
    pub in_flight: u64,
}

/// The outcome of a decode, shared with waiters.
type Outcome = std::result::Result<Chunk, (ErrorKind, String)>;

struct Slot {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

struct State {
    lru: LruCache<ChunkKey, Chunk>,
    bytes_used: u64,
    in_flight: HashMap<ChunkKey, Arc<Slot>>,
    /// Recycled buffers: they use the cache's free capacity plus at most
    /// POOL_RESERVE.
    pool: Vec<Vec<f32>>,
    pool_bytes: u64,
}

/// Pooled buffers kept beyond the capacity (16 chunks of 1 MiB): the
/// daemon's memory is bounded by capacity + POOL_RESERVE + fixed overhead.
pub const POOL_RESERVE: u64 = 16 << 20;

fn buf_bytes(v: &Vec<f32>) -> u64 {
    v.capacity() as u64 * 4
}

impl State {
    /// Keep an evicted chunk's buffer for reuse if nobody else holds it and
    /// the budget has room for it. Whatever is not kept is pushed to
    /// `freed`, for the caller to drop after releasing the lock (freeing a
    /// 1 MiB buffer is a munmap every reader would wait for).
    fn recycle(&mut self, c: Chunk, capacity: u64, freed: &mut Vec<Chunk>) {
        match Arc::try_unwrap(c) {
            Ok(v) if self.pool_bytes + buf_bytes(&v) <= self.pool_limit(capacity) => {
                self.pool_bytes += buf_bytes(&v);
                self.pool.push(v);
            }
            Ok(v) => freed.push(Arc::new(v)),
            Err(shared) => freed.push(shared),
        }
    }

    /// The pool may use the cache's unused capacity, and a fixed
    /// POOL_RESERVE beyond it so a full cache still recycles its evictions.
    fn pool_limit(&self, capacity: u64) -> u64 {
        POOL_RESERVE.max(capacity.saturating_sub(self.bytes_used))
    }

    /// A pooled buffer that can hold `len` values, if there is one.
    fn pooled_buffer(&mut self, len: usize) -> Option<Vec<f32>> {
        let i = self.pool.iter().position(|b| b.capacity() >= len)?;
        let b = self.pool.swap_remove(i);
        self.pool_bytes -= buf_bytes(&b);
        Some(b)
    }

    /// Drop pooled buffers until cache + pool fit the capacity.
    fn trim_pool(&mut self, capacity: u64, freed: &mut Vec<Chunk>) {
        while self.pool_bytes > self.pool_limit(capacity) {
            match self.pool.pop() {
                Some(b) => {
                    self.pool_bytes -= buf_bytes(&b);
                    freed.push(Arc::new(b));
                }
                None => break,
            }
        }
    }
}

pub struct BlockCache {
    capacity: u64,
    state: Mutex<State>,
    hits: AtomicU64,
    misses: AtomicU64,
    waits: AtomicU64,
    evictions: AtomicU64,
    bytes_decoded: AtomicU64,
    decode_errors: AtomicU64,
}

fn chunk_bytes(c: &Chunk) -> u64 {
    c.len() as u64 * 4
}

/// Lock a mutex whose data stays consistent even if a holder panicked.
/// Every lock in the daemon guards state that each mutation leaves whole
/// (a map insert, a counter), so a poisoned lock is used as is rather than
/// taking the daemon down.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl BlockCache {
    pub fn new(capacity_bytes: u64) -> Self {
        BlockCache {
            capacity: capacity_bytes,
            state: Mutex::new(State {
                lru: LruCache::unbounded(),
                bytes_used: 0,
                in_flight: HashMap::new(),
                pool: Vec::new(),
                pool_bytes: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            bytes_decoded: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
        }
    }

    /// Whether a chunk is cached or being decoded (for the prefetcher).
    pub fn is_present(&self, key: ChunkKey) -> bool {
        let s = lock(&self.state);
        s.lru.contains(&key) || s.in_flight.contains_key(&key)
    }

    /// The chunk for `key` (`len` values), decoding it with `decode` on a
    /// miss. `decode` must fill the whole slice; it runs without any lock.
    pub fn get_or_decode(
        &self,
        key: ChunkKey,
        len: usize,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Chunk> {
        let (slot, pooled) = {
            let mut s = lock(&self.state);
            if let Some(c) = s.lru.get(&key) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(c.clone());
            }
            self.misses.fetch_add(1, Ordering::Relaxed);
            if let Some(slot) = s.in_flight.get(&key) {
                let slot = slot.clone();
                drop(s);
                self.waits.fetch_add(1, Ordering::Relaxed);
                return Self::wait(&slot);
            }
            let slot = Arc::new(Slot {
                done: Mutex::new(None),
                cv: Condvar::new(),
            });
            s.in_flight.insert(key, slot.clone());
            (slot, s.pooled_buffer(len))
        };
        // Sized outside the lock: a fresh buffer is an mmap plus page faults.
        // Its contents are unspecified; the decoder overwrites all of it.
        let mut buf = pooled.unwrap_or_default();
        buf.resize(len, 0.0);

        // Decode outside the lock. A panic in `decode` must still release
        // the waiters, so catch it and turn it into an error.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(&mut buf)))
            .unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::BadValue,
                    "internal error: decoder panicked",
                ))
            });
        let outcome: Outcome = match result {
            Ok(()) => {
                let c: Chunk = Arc::new(buf);
                self.bytes_decoded
                    .fetch_add(chunk_bytes(&c), Ordering::Relaxed);
                Ok(c)
            }
            Err(e) => {
                self.decode_errors.fetch_add(1, Ordering::Relaxed);
                Err((e.kind(), e.to_string()))
            }
        };
        let mut freed = Vec::new();
        {
            let mut s = lock(&self.state);
            s.in_flight.remove(&key);
            if let Ok(c) = &outcome {
                let size = chunk_bytes(c);
                if size <= self.capacity {
                    if let Some(old) = s.lru.put(key, c.clone()) {
                        s.bytes_used -= chunk_bytes(&old);
                    }
                    s.bytes_used += size;
                    while s.bytes_used > self.capacity {
                        match s.lru.pop_lru() {
                            Some((_, old)) => {
                                s.bytes_used -= chunk_bytes(&old);
                                self.evictions.fetch_add(1, Ordering::Relaxed);
                                s.recycle(old, self.capacity, &mut freed);
                            }
                            None => break,
                        }
                    }
                    s.trim_pool(self.capacity, &mut freed);
                }
            }
        }
        drop(freed);
        *lock(&slot.done) = Some(outcome.clone());
        slot.cv.notify_all();
        outcome.map_err(|(kind, msg)| Error::new(kind, msg))
    }

    fn wait(slot: &Slot) -> Result<Chunk> {
        let mut done = lock(&slot.done);
        loop {
            if let Some(o) = done.as_ref() {
                return o.clone().map_err(|(kind, msg)| Error::new(kind, msg));
            }
            done = slot.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Drop every cached chunk (in-flight decodes finish normally).
    pub fn clear(&self) {
        let mut freed = Vec::new();
        let mut s = lock(&self.state);
        let n = s.lru.len() as u64;
        s.bytes_used = 0;
        while let Some((_, c)) = s.lru.pop_lru() {
            s.recycle(c, self.capacity, &mut freed);
        }
        drop(s);
        drop(freed);
        self.evictions.fetch_add(n, Ordering::Relaxed);
    }

    pub fn stats(&self) -> CacheStats {
        let s = lock(&self.state);
        CacheStats {
            capacity: self.capacity,
            bytes_used: s.bytes_used,
            pool_bytes: s.pool_bytes,
            chunks: s.lru.len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes_decoded: self.bytes_decoded.load(Ordering::Relaxed),
            decode_errors: self.decode_errors.load(Ordering::Relaxed),
            in_flight: s.in_flight.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn key(t: u32, c: u64) -> ChunkKey {
        ChunkKey {
            tensor: t,
            chunk: c,
        }
    }

    fn fill(v: f32) -> impl FnOnce(&mut [f32]) -> Result<()> {
        move |b| {
            b.fill(v);
            Ok(())
        }
    }

    #[test]
    fn hit_miss_and_byte_bound() {
        let cache = BlockCache::new(3 * 400);
        for c in 0..5 {
            let v = cache.get_or_decode(key(0, c), 100, fill(c as f32)).unwrap();
            assert_eq!(v[0], c as f32);
        }
        let s = cache.stats();
        assert_eq!((s.misses, s.hits, s.chunks, s.bytes_used), (5, 0, 3, 1200));
        assert_eq!(s.evictions, 2);
        // 4 is cached, 0 was evicted.
        cache
            .get_or_decode(key(0, 4), 100, |_| panic!("must hit"))
            .unwrap();
        let calls = AtomicUsize::new(0);
        cache
            .get_or_decode(key(0, 0), 100, |b| {
                calls.fetch_add(1, Ordering::SeqCst);
                b.fill(0.0);
                Ok(())
            })
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn oversize_chunk_is_served_not_kept() {
        let cache = BlockCache::new(100);
        let v = cache.get_or_decode(key(1, 0), 1000, fill(1.0)).unwrap();
        assert_eq!(v.len(), 1000);
        assert_eq!(cache.stats().bytes_used, 0);
    }

    #[test]
    fn errors_reach_the_caller_and_are_not_cached() {
        let cache = BlockCache::new(1 << 20);
        let e = cache
            .get_or_decode(key(2, 0), 1, |_| {
                Err(Error::new(ErrorKind::Truncated, "gone"))
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Truncated);
        let v = cache.get_or_decode(key(2, 0), 1, fill(2.0)).unwrap();
        assert_eq!(v[0], 2.0);
        assert_eq!(cache.stats().decode_errors, 1);
    }

    #[test]
    fn concurrent_misses_decode_once() {
        let cache = Arc::new(BlockCache::new(1 << 20));
        let calls = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (cache, calls) = (cache.clone(), calls.clone());
                std::thread::spawn(move || {
                    cache
                        .get_or_decode(key(3, 7), 10, |b| {
                            calls.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            b.fill(7.0);
                            Ok(())
                        })
                        .unwrap()[0]
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), 7.0);
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let s = cache.stats();
        assert_eq!(s.misses, 8);
        assert!(s.waits >= 1);
    }

    #[test]
    fn evicted_buffers_are_reused() {
        let cache = BlockCache::new(400);
        let first = cache.get_or_decode(key(5, 0), 100, fill(1.0)).unwrap();
        let ptr = first.as_ptr();
        drop(first);
        // Chunk 1 evicts chunk 0 (nobody holds it): its buffer is pooled,
        // and chunk 2 decodes into it.
        cache.get_or_decode(key(5, 1), 100, fill(2.0)).unwrap();
        let third = cache.get_or_decode(key(5, 2), 100, fill(3.0)).unwrap();
        assert_eq!(third.as_ptr(), ptr);
        assert!(third.iter().all(|&v| v == 3.0));
    }

    #[test]
    fn a_panicking_decoder_releases_waiters() {
        let cache = BlockCache::new(1 << 20);
        let e = cache
            .get_or_decode(key(4, 0), 1, |_| panic!("boom"))
            .unwrap_err();
        assert!(e.to_string().contains("panicked"));
        assert_eq!(cache.stats().in_flight, 0);
    }
}
