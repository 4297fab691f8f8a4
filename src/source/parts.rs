//! The in-memory cache of a remote source's parts: aligned byte ranges of
//! the object, bounded in bytes, least recently used evicted first, and
//! single flight: readers that miss the same part while it is being fetched
//! wait for that one fetch instead of starting their own.
//!
//! Keys are part numbers of one pinned object version (a cache belongs to
//! one [`super::remote::RemoteFile`]), so a part of another version can
//! never be served from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use bytes::Bytes;
use lru::LruCache;

use crate::error::ErrorKind;

/// What a failed fetch tells the readers that waited for it (the error
/// type is not `Clone`: each waiter rebuilds its own from this).
pub(crate) type FetchError = (ErrorKind, String);

/// One fetch in flight: its result once known.
#[derive(Default)]
struct Flight {
    result: Mutex<Option<Result<Bytes, FetchError>>>,
    done: Condvar,
}

struct State {
    parts: LruCache<u64, Bytes>,
    bytes: u64,
    in_flight: HashMap<u64, Arc<Flight>>,
}

/// Counters of one part cache.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PartStats {
    pub hits: u64,
    pub misses: u64,
    /// Misses that waited for a fetch another reader had started.
    pub waits: u64,
    pub evictions: u64,
    pub bytes_used: u64,
    pub capacity: u64,
}

pub(crate) struct PartCache {
    capacity: u64,
    state: Mutex<State>,
    hits: AtomicU64,
    misses: AtomicU64,
    waits: AtomicU64,
    evictions: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves consistent data behind (every
    // update is a single insert/remove), so poisoning is ignored.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sets an error on a flight whose fetcher unwound before setting a result,
/// so waiters never wait forever.
struct FlightGuard<'a> {
    cache: &'a PartCache,
    key: u64,
    flight: Arc<Flight>,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        let mut r = lock(&self.flight.result);
        if r.is_none() {
            *r = Some(Err((
                ErrorKind::Io,
                "the fetch of this part was abandoned".into(),
            )));
        }
        drop(r);
        self.flight.done.notify_all();
        lock(&self.cache.state).in_flight.remove(&self.key);
    }
}

impl PartCache {
    pub(crate) fn new(capacity: u64) -> PartCache {
        PartCache {
            capacity,
            state: Mutex::new(State {
                parts: LruCache::unbounded(),
                bytes: 0,
                in_flight: HashMap::new(),
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// Part `key`, from the cache or else from `fetch` (called by exactly
    /// one of the readers that miss it at the same time).
    pub(crate) fn get_or_fetch(
        &self,
        key: u64,
        fetch: impl FnOnce() -> Result<Bytes, FetchError>,
    ) -> Result<Bytes, FetchError> {
        let flight = {
            let mut st = lock(&self.state);
            if let Some(b) = st.parts.get(&key) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(b.clone());
            }
            self.misses.fetch_add(1, Ordering::Relaxed);
            if let Some(f) = st.in_flight.get(&key) {
                let f = f.clone();
                drop(st);
                self.waits.fetch_add(1, Ordering::Relaxed);
                let mut r = lock(&f.result);
                while r.is_none() {
                    r = f.done.wait(r).unwrap_or_else(|p| p.into_inner());
                }
                return r
                    .clone()
                    .unwrap_or_else(|| Err((ErrorKind::Io, "no result".into())));
            }
            let f = Arc::new(Flight::default());
            st.in_flight.insert(key, f.clone());
            f
        };
        let guard = FlightGuard {
            cache: self,
            key,
            flight,
        };
        let result = fetch();
        if let Ok(b) = &result {
            self.insert(key, b.clone());
        }
        *lock(&guard.flight.result) = Some(result.clone());
        drop(guard);
        result
    }

    fn insert(&self, key: u64, part: Bytes) {
        let mut st = lock(&self.state);
        st.bytes += part.len() as u64;
        if let Some(old) = st.parts.put(key, part) {
            st.bytes -= old.len() as u64;
        }
        // Keep the newest part even when it alone is over the capacity.
        while st.bytes > self.capacity && st.parts.len() > 1 {
            if let Some((_, old)) = st.parts.pop_lru() {
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
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    #[test]
    fn bounded_by_bytes_lru() {
        let c = PartCache::new(10);
        for k in 0..3u64 {
            c.get_or_fetch(k, || Ok(Bytes::from(vec![k as u8; 4])))
                .unwrap();
        }
        // 12 bytes > 10: part 0 (least recently used) went.
        let s = c.stats();
        assert_eq!((s.bytes_used, s.evictions, s.misses), (8, 1, 3));
        let b = c.get_or_fetch(2, || panic!("cached")).unwrap();
        assert_eq!(&b[..], &[2, 2, 2, 2]);
        assert_eq!(c.stats().hits, 1);
        c.get_or_fetch(0, || Ok(Bytes::from_static(b"zz"))).unwrap();
        assert_eq!(c.stats().misses, 4);
    }

    #[test]
    fn single_flight_and_errors_are_not_cached() {
        let c = Arc::new(PartCache::new(1 << 20));
        let calls = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (c, calls) = (c.clone(), calls.clone());
                std::thread::spawn(move || {
                    c.get_or_fetch(7, || {
                        calls.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(100));
                        Ok(Bytes::from_static(b"part"))
                    })
                    .unwrap()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(&t.join().unwrap()[..], b"part");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let e = c
            .get_or_fetch(8, || Err((ErrorKind::Io, "boom".into())))
            .unwrap_err();
        assert_eq!(e.1, "boom");
        // Not cached: the next reader fetches again.
        c.get_or_fetch(8, || Ok(Bytes::from_static(b"ok"))).unwrap();
    }
}
