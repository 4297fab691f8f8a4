//! The in-memory cache of a remote source's blocks: aligned byte ranges of
//! the object, bounded in bytes, least recently used evicted first, and
//! single flight: a block is fetched by one request at a time, and readers
//! that need a block while it is being fetched wait for that request
//! instead of starting their own.
//!
//! A fetch first *claims* the blocks it will bring ([`BlockCache::claim_run`]):
//! a claimed block is "in flight", and its [`Claim`] must be completed with
//! the bytes or an error (dropping it unfinished completes it with an
//! error, so no reader ever waits forever, even when a fetch task is
//! dropped with its runtime).
//!
//! Keys are block numbers of one pinned object version (a cache belongs to
//! one [`super::remote::RemoteFile`]), so a block of another version can
//! never be served from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use bytes::Bytes;
use lru::LruCache;

use super::lock;
use crate::error::ErrorKind;

/// What a failed fetch tells the readers that waited for it (the error
/// type is not `Clone`: each waiter rebuilds its own from this).
pub(crate) type FetchError = (ErrorKind, String);

/// One block in flight: its result once known.
#[derive(Default)]
pub(crate) struct Flight {
    result: Mutex<Option<Result<Bytes, FetchError>>>,
    done: Condvar,
}

impl Flight {
    /// Wait for the fetch's result until `deadline` at most: None when it has
    /// not finished by then (it goes on, bounded by its own deadline, and
    /// its result reaches the cache and later readers).
    pub(crate) fn wait_until(&self, deadline: Instant) -> Option<Result<Bytes, FetchError>> {
        let mut r = lock(&self.result);
        while r.is_none() {
            let left = deadline.checked_duration_since(Instant::now())?;
            if left.is_zero() {
                return None;
            }
            r = self
                .done
                .wait_timeout(r, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        r.clone()
    }
}

struct State {
    blocks: LruCache<u64, Bytes>,
    bytes: u64,
    in_flight: HashMap<u64, Arc<Flight>>,
}

/// Counters of one block cache.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PartStats {
    /// Blocks a reader found in memory.
    pub hits: u64,
    /// Blocks a reader did not find in memory (fetched, or read from the
    /// disk cache, for it or by read-ahead already under way).
    pub misses: u64,
    /// Misses that waited for a fetch already in flight (read-ahead, or
    /// another reader's).
    pub waits: u64,
    pub evictions: u64,
    pub bytes_used: u64,
    pub capacity: u64,
}

pub(crate) struct BlockCache {
    capacity: u64,
    state: Mutex<State>,
    hits: AtomicU64,
    misses: AtomicU64,
    waits: AtomicU64,
    evictions: AtomicU64,
}

/// What a reader finds for a block.
pub(crate) enum Lookup {
    Hit(Bytes),
    /// Being fetched: wait for it.
    InFlight(Arc<Flight>),
    /// Neither: nobody is fetching it.
    Absent,
}

/// A claimed block: the one fetch that will bring it. Complete it with
/// [`Claim::complete`]; dropped unfinished, it fails its waiters.
pub(crate) struct Claim {
    cache: Arc<BlockCache>,
    pub(crate) index: u64,
    flight: Arc<Flight>,
    done: bool,
}

impl Claim {
    /// The flight this claim completes (for the claimer to wait on).
    pub(crate) fn flight(&self) -> Arc<Flight> {
        self.flight.clone()
    }

    /// Publish the block's bytes (cached) or the fetch's error (not cached:
    /// the next reader tries again) to every waiter.
    pub(crate) fn complete(mut self, result: Result<Bytes, FetchError>) {
        self.finish(result);
    }

    fn finish(&mut self, result: Result<Bytes, FetchError>) {
        if self.done {
            return;
        }
        self.done = true;
        // Out of `in_flight` (and into the cache) before the waiters wake:
        // a reader that comes after one of them must not find this flight
        // and its (possibly failed) result again.
        {
            let mut st = lock(&self.cache.state);
            st.in_flight.remove(&self.index);
            if let Ok(b) = &result {
                self.cache.insert_locked(&mut st, self.index, b.clone());
            }
        }
        *lock(&self.flight.result) = Some(result);
        self.flight.done.notify_all();
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.finish(Err((
            ErrorKind::Io,
            "the fetch of this block was abandoned".into(),
        )));
    }
}

impl BlockCache {
    pub(crate) fn new(capacity: u64) -> BlockCache {
        BlockCache {
            capacity,
            state: Mutex::new(State {
                blocks: LruCache::unbounded(),
                bytes: 0,
                in_flight: HashMap::new(),
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// What a reader finds for block `index` (counted as a hit or miss).
    pub(crate) fn lookup(&self, index: u64) -> Lookup {
        let mut st = lock(&self.state);
        if let Some(b) = st.blocks.get(&index) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Lookup::Hit(b.clone());
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        match st.in_flight.get(&index) {
            Some(f) => {
                self.waits.fetch_add(1, Ordering::Relaxed);
                Lookup::InFlight(f.clone())
            }
            None => Lookup::Absent,
        }
    }

    /// Claim the blocks `start, start + 1, ...` (at most `max`, below
    /// `end`) that are neither cached nor in flight, stopping at the first
    /// one that is: one contiguous run for one request. Empty when `start`
    /// itself is present.
    pub(crate) fn claim_run(self: &Arc<Self>, start: u64, end: u64, max: u64) -> Vec<Claim> {
        let mut st = lock(&self.state);
        let mut claims = Vec::new();
        let mut index = start;
        while index < end && (claims.len() as u64) < max {
            if st.blocks.contains(&index) || st.in_flight.contains_key(&index) {
                break;
            }
            let flight = Arc::new(Flight::default());
            st.in_flight.insert(index, flight.clone());
            claims.push(Claim {
                cache: self.clone(),
                index,
                flight,
                done: false,
            });
            index += 1;
        }
        claims
    }

    fn insert_locked(&self, st: &mut State, index: u64, block: Bytes) {
        st.bytes += block.len() as u64;
        if let Some(old) = st.blocks.put(index, block) {
            st.bytes -= old.len() as u64;
        }
        // Keep the newest block even when it alone is over the capacity.
        while st.bytes > self.capacity && st.blocks.len() > 1 {
            if let Some((_, old)) = st.blocks.pop_lru() {
                st.bytes -= old.len() as u64;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn stats(&self) -> PartStats {
        let bytes_used = lock(&self.state).bytes;
        PartStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes_used,
            capacity: self.capacity,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn fill(c: &Arc<BlockCache>, index: u64, bytes: &'static [u8]) {
        let claims = c.claim_run(index, index + 1, 1);
        assert_eq!(claims.len(), 1);
        for cl in claims {
            cl.complete(Ok(Bytes::from_static(bytes)));
        }
    }

    #[test]
    fn bounded_by_bytes_lru() {
        let c = Arc::new(BlockCache::new(10));
        fill(&c, 0, b"aaaa");
        fill(&c, 1, b"bbbb");
        fill(&c, 2, b"cccc");
        // 12 bytes > 10: block 0 (least recently used) went.
        let s = c.stats();
        assert_eq!((s.bytes_used, s.evictions), (8, 1));
        assert!(matches!(c.lookup(2), Lookup::Hit(b) if &b[..] == b"cccc"));
        assert!(matches!(c.lookup(0), Lookup::Absent));
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (1, 1));
    }

    #[test]
    fn runs_stop_at_present_blocks_and_waiters_get_the_result() {
        let c = Arc::new(BlockCache::new(1 << 20));
        fill(&c, 3, b"three");
        let run = c.claim_run(0, 10, 8);
        assert_eq!(run.iter().map(|x| x.index).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(c.claim_run(1, 10, 8).is_empty(), "in flight");
        let Lookup::InFlight(f) = c.lookup(1) else {
            panic!("block 1 is in flight")
        };
        let waiter = std::thread::spawn(move || {
            f.wait_until(Instant::now() + Duration::from_secs(60))
                .expect("in time")
        });
        std::thread::sleep(Duration::from_millis(50));
        let mut run = run.into_iter();
        run.next()
            .unwrap()
            .complete(Ok(Bytes::from_static(b"zero")));
        run.next()
            .unwrap()
            .complete(Err((ErrorKind::Io, "boom".into())));
        // Block 2's claim is dropped unfinished: its waiters fail.
        drop(run);
        assert_eq!(waiter.join().unwrap().unwrap_err().1, "boom");
        assert!(matches!(c.lookup(0), Lookup::Hit(_)));
        // Errors are not cached: blocks 1 and 2 can be claimed again.
        assert_eq!(c.claim_run(1, 3, 8).len(), 2);
        assert_eq!(c.stats().waits, 1);
    }

    #[test]
    fn a_wait_ends_at_its_deadline_and_the_fetch_still_completes() {
        let c = Arc::new(BlockCache::new(1 << 20));
        let run = c.claim_run(0, 1, 1);
        let Lookup::InFlight(f) = c.lookup(0) else {
            panic!("block 0 is in flight")
        };
        let t = Instant::now();
        assert!(f.wait_until(t + Duration::from_millis(50)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(50));
        for cl in run {
            cl.complete(Ok(Bytes::from_static(b"late")));
        }
        assert!(matches!(f.wait_until(Instant::now()), Some(Ok(b)) if &b[..] == b"late"));
        assert!(matches!(c.lookup(0), Lookup::Hit(_)));
    }
}
