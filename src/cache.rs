//! The decoded-block cache: an LRU of decoded chunks bounded in bytes, with
//! single-flight decoding, and the budget of every decoded chunk buffer in
//! the daemon.
//!
//! - The lock protects only the bookkeeping; decoding happens outside it,
//!   so any number of threads decode different chunks in parallel.
//! - Two readers that miss the same chunk decode it once: the first marks
//!   the chunk in flight and decodes; the others wait for it.
//! - **The budget** (the capacity, in bytes) covers every chunk buffer:
//!   cached chunks, buffers being decoded, chunks a reader still holds
//!   after they were evicted (a reply being sent), and recycled buffers
//!   waiting for reuse. A decode reserves its buffer before it allocates
//!   it, evicting LRU chunks that nobody holds to make room. When the
//!   budget is all in flight or held, a reader waits until some returns (a
//!   decode finishes, a reply drops its chunk: both wake it; waiting
//!   readers go in arrival order) and a read-ahead request is refused (the
//!   reader will decode that chunk itself; read-ahead is also refused while
//!   any reader waits). So concurrent decodes never exceed the budget, and
//!   with 16 MiB chunks and 16 threads the buffers stay within the cache
//!   instead of reaching one chunk per thread beyond it. The lock is never
//!   held during a decode, and a decode never waits for budget, so waiting
//!   readers always see budget come back.
//! - A chunk larger than the whole capacity is decoded only when nothing
//!   else is in the budget, returned to its readers and not kept.
//! - Chunks decoded ahead of a reader (`prefetch`) are marked unread until
//!   a reader gets them: read-ahead evicts only chunks that were read (it
//!   never throws away another prefetched chunk nobody has read yet: that
//!   is the thrash of a small cache), readers evict read chunks first.
//! - Errors are handed to every waiter and not cached: the next read tries
//!   again (a source file that was truncated and then restored recovers).
//! - Evicted buffers are reused for the next decode: a fresh 1 MiB buffer
//!   costs 256 page faults, which halved cold read throughput. With the
//!   cache full, a decode evicts one chunk and decodes into its buffer.
//! - A reader that saw no budget come back for [`BUDGET_WAIT`] decodes
//!   anyway (logged): only a caller that holds chunks while asking for more
//!   can get there (the daemon's readers drop each chunk before asking for
//!   the next), and it must not hang.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::error::{Error, ErrorKind, Result};

/// How long a reader waits for budget while none comes back before it
/// decodes beyond the budget.
pub const BUDGET_WAIT: Duration = Duration::from_secs(1);

/// Read-ahead looks at this many of the least recently used chunks for one
/// it may evict, then gives up (the request is dropped): a cache of tiny
/// chunks must not be scanned whole for every request.
const PREFETCH_VICTIM_SCAN: usize = 64;

/// One decoded chunk held by a reader: little-endian f32 values (it derefs
/// to `[f32]`). While anyone holds it, its buffer counts against the
/// cache's budget, also after it was evicted.
pub struct Chunk {
    /// `None` only while dropping.
    data: Option<Arc<Vec<f32>>>,
    lease: Option<Lease>,
}

/// Which cache entry a [`Chunk`] holds, to return it on drop.
struct Lease {
    cache: Weak<Inner>,
    key: ChunkKey,
    id: u64,
}

impl Chunk {
    /// Values decoded outside the cache (a small uncached read): not part
    /// of the budget.
    pub fn uncached(values: Vec<f32>) -> Chunk {
        Chunk {
            data: Some(Arc::new(values)),
            lease: None,
        }
    }
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunk")
            .field("len", &self.len())
            .field("cached", &self.lease.is_some())
            .finish()
    }
}

impl std::ops::Deref for Chunk {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        self.data.as_deref().map_or(&[][..], Vec::as_slice)
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // Our reference goes first. A cached chunk's entry keeps its own
        // until the last lease is returned, so this never frees its buffer
        // (an uncached chunk's buffer is freed here).
        drop(self.data.take());
        if let Some(l) = self.lease.take()
            && let Some(inner) = l.cache.upgrade()
        {
            inner.release(l.key, l.id);
        }
    }
}

/// Which chunk of which tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    pub tensor: u32,
    pub chunk: u64,
}

/// Counters reported by `ctl`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// The budget of every chunk buffer, in bytes.
    pub capacity: u64,
    /// Bytes of cached chunks.
    pub bytes_used: u64,
    /// Bytes of recycled buffers waiting for reuse (within the capacity).
    pub pool_bytes: u64,
    /// Bytes of buffers being decoded (within the capacity).
    pub bytes_in_flight: u64,
    /// Bytes of evicted (or too large to cache) chunks readers still hold
    /// (within the capacity).
    pub bytes_held: u64,
    pub chunks: u64,
    pub hits: u64,
    pub misses: u64,
    /// Misses that found the chunk already being decoded and waited for it.
    pub waits: u64,
    /// Reads that waited for budget (everything in flight or held).
    pub budget_waits: u64,
    /// Reads that decoded beyond the budget after waiting [`BUDGET_WAIT`].
    pub over_budget: u64,
    /// Read-ahead decodes refused for lack of budget.
    pub prefetch_refused: u64,
    pub evictions: u64,
    pub bytes_decoded: u64,
    pub decode_errors: u64,
    pub in_flight: u64,
}

/// A chunk the cache knows about: in the LRU, or held by readers after
/// eviction.
struct Entry {
    data: Arc<Vec<f32>>,
    /// Distinguishes this decode of a key from later ones.
    id: u64,
    /// Budget bytes: the buffer's capacity.
    bytes: u64,
    /// Readers holding it ([`Chunk`]s not yet dropped).
    leases: u32,
    /// Decoded ahead of a reader and not read yet.
    unread_prefetch: bool,
}

/// The outcome of a decode, for the readers waiting for it: the entry's id
/// (they take their own lease on it) or the error.
type Outcome = std::result::Result<u64, (ErrorKind, String)>;

struct Slot {
    done: Mutex<Option<Outcome>>,
    cv: Condvar,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A reader: gets the chunk, waits for budget.
    Read,
    /// Read-ahead: decodes into the cache if there is budget, never waits.
    Prefetch,
}

/// What [`Inner::fetch`] did.
enum Fetched {
    /// A reader's chunk.
    Chunk(Chunk),
    /// Read-ahead decoded the chunk into the cache.
    Decoded,
    /// Read-ahead found the chunk cached or in flight.
    Present,
    /// Read-ahead found no budget.
    Refused,
}

/// What a read-ahead request did ([`BlockCache::prefetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetched {
    Decoded,
    /// Cached or being decoded already.
    Present,
    /// No budget without evicting a chunk that is held or not read yet:
    /// the reader will decode it.
    NoBudget,
}

/// A granted decode: its slot, the recycled buffer (if any) and the
/// budget bytes reserved.
struct Granted {
    slot: Arc<Slot>,
    buf: Option<Vec<f32>>,
    reserved: u64,
}

enum Reservation {
    /// Budget for `bytes`, with a recycled buffer to decode into (or none:
    /// allocate one).
    Granted {
        buf: Option<Vec<f32>>,
        bytes: u64,
    },
    Wait,
    Refused,
}

struct State {
    lru: LruCache<ChunkKey, Entry>,
    bytes_used: u64,
    /// Evicted or never cached chunks that readers still hold, by id.
    held: HashMap<u64, Entry>,
    held_bytes: u64,
    /// Buffers being decoded.
    reserved: u64,
    in_flight: HashMap<ChunkKey, Arc<Slot>>,
    /// Recycled buffers, within the budget.
    pool: Vec<Vec<f32>>,
    pool_bytes: u64,
    next_id: u64,
    /// Readers waiting on `Inner::budget`.
    budget_waiters: u32,
    /// Tickets of readers waiting for budget, served in order.
    waiting: BTreeSet<u64>,
    next_ticket: u64,
    /// Counts budget changes (returns, finished decodes, queue moves).
    changes: u64,
}

fn buf_bytes(v: &Vec<f32>) -> u64 {
    v.capacity() as u64 * 4
}

impl State {
    /// Bytes of every chunk buffer the budget covers.
    fn committed(&self) -> u64 {
        self.bytes_used + self.held_bytes + self.reserved + self.pool_bytes
    }

    /// A pooled buffer for `len` values: the smallest that holds them, and
    /// not more than twice their size (a 16 MiB buffer must not be spent
    /// on a 2 KiB chunk).
    fn take_pooled(&mut self, len: usize) -> Option<Vec<f32>> {
        let (i, _) = self
            .pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len && b.capacity() / 2 <= len)
            .min_by_key(|(_, b)| b.capacity())?;
        let b = self.pool.swap_remove(i);
        self.pool_bytes -= buf_bytes(&b);
        Some(b)
    }

    /// Keep `b` for reuse if the budget has room for it (it is no longer
    /// counted anywhere else), else hand it to `freed`.
    fn recycle(&mut self, b: Vec<f32>, capacity: u64, freed: &mut Vec<Vec<f32>>) {
        if self.committed() + buf_bytes(&b) <= capacity {
            self.pool_bytes += buf_bytes(&b);
            self.pool.push(b);
        } else {
            freed.push(b);
        }
    }

    /// The least recently used chunk that nobody holds and whose eviction
    /// `mode` allows: read chunks first; readers then take unread
    /// prefetched ones, read-ahead never does.
    fn victim(&self, mode: Mode) -> Option<ChunkKey> {
        let mut unread = None;
        for (n, (k, e)) in self.lru.iter().rev().enumerate() {
            if mode == Mode::Prefetch && n >= PREFETCH_VICTIM_SCAN {
                break;
            }
            if e.leases > 0 {
                continue;
            }
            if !e.unread_prefetch {
                return Some(*k);
            }
            unread.get_or_insert(*k);
        }
        match mode {
            Mode::Read => unread,
            Mode::Prefetch => None,
        }
    }

    /// Evict `key` (held by nobody): its buffer goes to the pool.
    fn evict(&mut self, key: ChunkKey) {
        let Some(e) = self.lru.pop(&key) else { return };
        self.bytes_used -= e.bytes;
        // Nobody holds it (no lease), so this is the only reference.
        if let Ok(b) = Arc::try_unwrap(e.data) {
            self.pool_bytes += buf_bytes(&b);
            self.pool.push(b);
        }
    }

    /// Get back within the budget after a decode beyond it (an over-budget
    /// escape): pooled buffers first, then chunks nobody holds.
    fn shrink(&mut self, capacity: u64, evictions: &AtomicU64, freed: &mut Vec<Vec<f32>>) {
        while self.committed() > capacity {
            if let Some(b) = self.pool.pop() {
                self.pool_bytes -= buf_bytes(&b);
                freed.push(b);
                continue;
            }
            let Some(k) = self.victim(Mode::Read) else {
                return;
            };
            self.evict(k);
            evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Budget for a decode of `len` values, making room by dropping pooled
    /// buffers that do not fit and evicting chunks nobody holds.
    fn reserve(
        &mut self,
        len: usize,
        mode: Mode,
        capacity: u64,
        evictions: &AtomicU64,
        freed: &mut Vec<Vec<f32>>,
    ) -> Reservation {
        let need = len as u64 * 4;
        loop {
            if let Some(b) = self.take_pooled(len) {
                let bytes = buf_bytes(&b);
                self.reserved += bytes;
                return Reservation::Granted {
                    buf: Some(b),
                    bytes,
                };
            }
            if self.committed() + need <= capacity {
                self.reserved += need;
                return Reservation::Granted {
                    buf: None,
                    bytes: need,
                };
            }
            // Pooled buffers that do not fit this decode go before any
            // cached chunk does.
            if let Some(b) = self.pool.pop() {
                self.pool_bytes -= buf_bytes(&b);
                freed.push(b);
                continue;
            }
            if let Some(k) = self.victim(mode) {
                self.evict(k);
                evictions.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // A chunk larger than the whole budget: alone, or not at all.
            if mode == Mode::Read && self.committed() == 0 {
                self.reserved += need;
                return Reservation::Granted {
                    buf: None,
                    bytes: need,
                };
            }
            return match mode {
                Mode::Read => Reservation::Wait,
                Mode::Prefetch => Reservation::Refused,
            };
        }
    }

    /// Mark `key` in flight: readers that miss it wait for this decode.
    fn start(&mut self, key: ChunkKey) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            done: Mutex::new(None),
            cv: Condvar::new(),
        });
        self.in_flight.insert(key, slot.clone());
        slot
    }

    /// A new lease on the entry `id` of `key` (in the LRU, or held after
    /// eviction), if it is still there.
    fn lease(&mut self, key: ChunkKey, id: u64) -> Option<Arc<Vec<f32>>> {
        let e = match self.lru.get_mut(&key) {
            Some(e) if e.id == id => e,
            _ => self.held.get_mut(&id)?,
        };
        e.leases += 1;
        e.unread_prefetch = false;
        Some(e.data.clone())
    }
}

struct Inner {
    capacity: u64,
    state: Mutex<State>,
    /// Signalled when budget may have come free: a decode finished, a
    /// held chunk was returned, the cache was cleared.
    budget: Condvar,
    hits: AtomicU64,
    misses: AtomicU64,
    waits: AtomicU64,
    budget_waits: AtomicU64,
    over_budget: AtomicU64,
    prefetch_refused: AtomicU64,
    evictions: AtomicU64,
    bytes_decoded: AtomicU64,
    decode_errors: AtomicU64,
}

pub struct BlockCache {
    inner: Arc<Inner>,
}

/// Lock a mutex whose data stays consistent even if a holder panicked.
/// Every lock in the daemon guards state that each mutation leaves whole
/// (a map insert, a counter), so a poisoned lock is used as is rather than
/// taking the daemon down.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    /// Budget may have come free (or the queue moved): wake the readers
    /// waiting for it.
    fn budget_changed(&self, s: &mut State) {
        s.changes += 1;
        if s.budget_waiters > 0 {
            self.budget.notify_all();
        }
    }

    /// A reader dropped its [`Chunk`] of entry `id` of `key`.
    fn release(&self, key: ChunkKey, id: u64) {
        let mut freed = Vec::new();
        {
            let mut guard = lock(&self.state);
            let s = &mut *guard;
            match s.lru.peek_mut(&key) {
                Some(e) if e.id == id => e.leases = e.leases.saturating_sub(1),
                _ => {
                    let Some(e) = s.held.get_mut(&id) else { return };
                    e.leases = e.leases.saturating_sub(1);
                    if e.leases == 0
                        && let Some(e) = s.held.remove(&id)
                    {
                        s.held_bytes -= e.bytes;
                        // Every lease dropped its reference before
                        // returning, so this one is the last.
                        if let Ok(b) = Arc::try_unwrap(e.data) {
                            s.recycle(b, self.capacity, &mut freed);
                        }
                    }
                }
            }
            s.shrink(self.capacity, &self.evictions, &mut freed);
            self.budget_changed(s);
        }
        // Freed outside the lock: freeing a large buffer is a munmap every
        // reader would wait for.
        drop(freed);
    }

    /// Find, wait for, or decode the chunk `key` (`len` values).
    ///
    /// When the budget is short, readers are served in arrival order (a
    /// ticket each; only the first may take budget) so none starves behind
    /// later arrivals, and read-ahead is refused while any reader waits.
    fn fetch(
        self: &Arc<Self>,
        key: ChunkKey,
        len: usize,
        mode: Mode,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Fetched> {
        let mut counted = false;
        let mut ticket: Option<u64> = None;
        // When this reader last saw the budget change, and its change count
        // then: the over-budget escape needs BUDGET_WAIT without any change.
        let mut stalled: Option<(Instant, u64)> = None;
        let mut over_budget = false;
        let mut freed = Vec::new();
        let granted = loop {
            drop(std::mem::take(&mut freed));
            let mut s = lock(&self.state);
            if mode == Mode::Prefetch {
                if s.lru.contains(&key) || s.in_flight.contains_key(&key) {
                    return Ok(Fetched::Present);
                }
            } else if let Some(id) = s.lru.get(&key).map(|e| e.id) {
                if !counted {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(d) = s.lease(key, id) {
                    self.leave_queue(&mut s, &mut ticket);
                    drop(s);
                    return Ok(Fetched::Chunk(self.chunk(d, key, id)));
                }
            }
            // A read-ahead request counts as a miss only if it decodes.
            if !counted && mode == Mode::Read {
                self.misses.fetch_add(1, Ordering::Relaxed);
                counted = true;
            }
            if let Some(slot) = s.in_flight.get(&key) {
                let slot = slot.clone();
                self.leave_queue(&mut s, &mut ticket);
                drop(s);
                self.waits.fetch_add(1, Ordering::Relaxed);
                let id = Self::wait(&slot)?;
                drop(slot);
                if let Some(d) = lock(&self.state).lease(key, id) {
                    return Ok(Fetched::Chunk(self.chunk(d, key, id)));
                }
                // Evicted before we got to it (a tiny cache): again.
                continue;
            }
            let my_turn = s.waiting.first().is_none_or(|f| ticket == Some(*f));
            let reservation = match (my_turn, mode) {
                (true, _) => s.reserve(len, mode, self.capacity, &self.evictions, &mut freed),
                (false, Mode::Read) => Reservation::Wait,
                (false, Mode::Prefetch) => Reservation::Refused,
            };
            match reservation {
                Reservation::Granted { buf, bytes } => {
                    if mode == Mode::Prefetch {
                        self.misses.fetch_add(1, Ordering::Relaxed);
                    }
                    self.leave_queue(&mut s, &mut ticket);
                    break Granted {
                        slot: s.start(key),
                        buf,
                        reserved: bytes,
                    };
                }
                Reservation::Refused => {
                    self.prefetch_refused.fetch_add(1, Ordering::Relaxed);
                    drop(s);
                    return Ok(Fetched::Refused);
                }
                Reservation::Wait if !freed.is_empty() => {
                    // Free what reserve let go first (outside the lock),
                    // then look again.
                    continue;
                }
                Reservation::Wait => {
                    if ticket.is_none() {
                        let t = s.next_ticket;
                        s.next_ticket += 1;
                        s.waiting.insert(t);
                        ticket = Some(t);
                        self.budget_waits.fetch_add(1, Ordering::Relaxed);
                    }
                    let (since, seen) = match stalled {
                        Some((since, seen)) if seen == s.changes => (since, seen),
                        _ => (Instant::now(), s.changes),
                    };
                    stalled = Some((since, seen));
                    let left = BUDGET_WAIT.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        // Nothing came back for BUDGET_WAIT: only a caller
                        // holding chunks itself gets here (module docs).
                        // Decode beyond the budget rather than hang; logged
                        // below, outside the lock.
                        self.over_budget.fetch_add(1, Ordering::Relaxed);
                        over_budget = true;
                        self.leave_queue(&mut s, &mut ticket);
                        let need = len as u64 * 4;
                        s.reserved += need;
                        break Granted {
                            slot: s.start(key),
                            buf: None,
                            reserved: need,
                        };
                    }
                    s.budget_waiters += 1;
                    let (mut s, _) = self
                        .budget
                        .wait_timeout(s, left)
                        .unwrap_or_else(|p| p.into_inner());
                    s.budget_waiters -= 1;
                }
            }
        };
        drop(freed);
        if over_budget {
            crate::logging::throttled(
                log::Level::Warn,
                "cache over budget",
                format_args!(
                    "the decoded-chunk budget ({} B) stayed in use for {} ms; decoding beyond it",
                    self.capacity,
                    BUDGET_WAIT.as_millis()
                ),
            );
        }
        self.decode_into(key, len, mode, granted, decode)
    }

    /// Give up this reader's place in the queue for budget (it got budget,
    /// a hit, or joined a decode in flight); the next one may go.
    fn leave_queue(&self, s: &mut State, ticket: &mut Option<u64>) {
        if let Some(t) = ticket.take() {
            s.waiting.remove(&t);
            self.budget_changed(s);
        }
    }

    /// Decode into the reserved buffer (outside the lock), then cache the
    /// chunk and hand it to the waiters.
    fn decode_into(
        self: &Arc<Self>,
        key: ChunkKey,
        len: usize,
        mode: Mode,
        granted: Granted,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Fetched> {
        let Granted {
            slot,
            buf: pooled,
            reserved,
        } = granted;
        // Sized outside the lock: a fresh buffer is an mmap plus page faults.
        // Its contents are unspecified; the decoder overwrites all of it.
        let mut buf = pooled.unwrap_or_else(|| Vec::with_capacity(len));
        buf.resize(len, 0.0);
        // A panic in `decode` must still release the waiters and the
        // budget, so catch it and turn it into an error.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(&mut buf)))
            .unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::BadValue,
                    "internal error: decoder panicked",
                ))
            });
        let mut freed = Vec::new();
        let (outcome, chunk) = {
            let mut s = lock(&self.state);
            s.in_flight.remove(&key);
            s.reserved -= reserved;
            let r = match result {
                Ok(()) => {
                    self.bytes_decoded
                        .fetch_add(len as u64 * 4, Ordering::Relaxed);
                    let id = s.next_id;
                    s.next_id += 1;
                    let bytes = buf_bytes(&buf);
                    let data = Arc::new(buf);
                    let read = mode == Mode::Read;
                    // Read-ahead keeps no reference: an entry nobody
                    // holds must be the only owner of its buffer.
                    let handout = read.then(|| data.clone());
                    let entry = Entry {
                        data,
                        id,
                        bytes,
                        leases: u32::from(read),
                        unread_prefetch: !read,
                    };
                    if bytes <= self.capacity {
                        s.bytes_used += bytes;
                        // Single flight: the key was not cached.
                        if let Some((_, old)) = s.lru.push(key, entry) {
                            s.bytes_used -= old.bytes;
                            if old.leases > 0 {
                                s.held_bytes += old.bytes;
                                s.held.insert(old.id, old);
                            } else if let Ok(b) = Arc::try_unwrap(old.data) {
                                s.recycle(b, self.capacity, &mut freed);
                            }
                        }
                    } else if read {
                        // Too large to keep: held by its reader only.
                        s.held_bytes += bytes;
                        s.held.insert(id, entry);
                    } else if let Ok(b) = Arc::try_unwrap(entry.data) {
                        // (Read-ahead never gets such a budget.)
                        s.recycle(b, self.capacity, &mut freed);
                    }
                    (Ok(id), handout.map(|d| (d, id)))
                }
                Err(e) => {
                    self.decode_errors.fetch_add(1, Ordering::Relaxed);
                    s.recycle(buf, self.capacity, &mut freed);
                    (Err((e.kind(), e.to_string())), None)
                }
            };
            s.shrink(self.capacity, &self.evictions, &mut freed);
            self.budget_changed(&mut s);
            r
        };
        drop(freed);
        *lock(&slot.done) = Some(outcome.clone());
        slot.cv.notify_all();
        match (outcome, chunk) {
            (Err((kind, msg)), _) => Err(Error::new(kind, msg)),
            (Ok(_), Some((data, id))) => Ok(Fetched::Chunk(self.chunk(data, key, id))),
            (Ok(_), None) => Ok(Fetched::Decoded),
        }
    }

    fn chunk(self: &Arc<Self>, data: Arc<Vec<f32>>, key: ChunkKey, id: u64) -> Chunk {
        Chunk {
            data: Some(data),
            lease: Some(Lease {
                cache: Arc::downgrade(self),
                key,
                id,
            }),
        }
    }

    fn wait(slot: &Slot) -> Result<u64> {
        let mut done = lock(&slot.done);
        loop {
            if let Some(o) = done.as_ref() {
                return o.clone().map_err(|(kind, msg)| Error::new(kind, msg));
            }
            done = slot.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl BlockCache {
    pub fn new(capacity_bytes: u64) -> Self {
        BlockCache {
            inner: Arc::new(Inner {
                capacity: capacity_bytes,
                state: Mutex::new(State {
                    lru: LruCache::unbounded(),
                    bytes_used: 0,
                    held: HashMap::new(),
                    held_bytes: 0,
                    reserved: 0,
                    in_flight: HashMap::new(),
                    pool: Vec::new(),
                    pool_bytes: 0,
                    next_id: 0,
                    budget_waiters: 0,
                    waiting: BTreeSet::new(),
                    next_ticket: 0,
                    changes: 0,
                }),
                budget: Condvar::new(),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                waits: AtomicU64::new(0),
                budget_waits: AtomicU64::new(0),
                over_budget: AtomicU64::new(0),
                prefetch_refused: AtomicU64::new(0),
                evictions: AtomicU64::new(0),
                bytes_decoded: AtomicU64::new(0),
                decode_errors: AtomicU64::new(0),
            }),
        }
    }

    /// Whether a chunk is cached or being decoded (for the prefetcher).
    pub fn is_present(&self, key: ChunkKey) -> bool {
        let s = lock(&self.inner.state);
        s.lru.contains(&key) || s.in_flight.contains_key(&key)
    }

    /// The chunk for `key` (`len` values), decoding it with `decode` on a
    /// miss. `decode` must fill the whole slice; it runs without any lock.
    /// Waits for budget when all of it is in flight or held (module docs).
    pub fn get_or_decode(
        &self,
        key: ChunkKey,
        len: usize,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Chunk> {
        match self.inner.fetch(key, len, Mode::Read, decode)? {
            Fetched::Chunk(c) => Ok(c),
            // Read mode always ends with a chunk or an error.
            _ => Err(Error::new(
                ErrorKind::BadValue,
                "internal error: cache read returned no chunk",
            )),
        }
    }

    /// Read-ahead: decode `key` into the cache unless it is there or in
    /// flight, or the budget has no room without evicting a chunk that
    /// is held or not read yet. Never waits for budget.
    pub fn prefetch(
        &self,
        key: ChunkKey,
        len: usize,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Prefetched> {
        Ok(match self.inner.fetch(key, len, Mode::Prefetch, decode)? {
            Fetched::Decoded => Prefetched::Decoded,
            Fetched::Refused => Prefetched::NoBudget,
            Fetched::Present | Fetched::Chunk(_) => Prefetched::Present,
        })
    }

    /// Drop every cached chunk (in-flight decodes finish normally; chunks
    /// readers hold stay in the budget until they are dropped).
    pub fn clear(&self) {
        let inner = &self.inner;
        let mut freed = Vec::new();
        let mut s = lock(&inner.state);
        let n = s.lru.len() as u64;
        while let Some((_, e)) = s.lru.pop_lru() {
            s.bytes_used -= e.bytes;
            if e.leases > 0 {
                s.held_bytes += e.bytes;
                s.held.insert(e.id, e);
            } else if let Ok(b) = Arc::try_unwrap(e.data) {
                s.recycle(b, inner.capacity, &mut freed);
            }
        }
        inner.budget_changed(&mut s);
        drop(s);
        drop(freed);
        inner.evictions.fetch_add(n, Ordering::Relaxed);
    }

    pub fn stats(&self) -> CacheStats {
        let inner = &self.inner;
        let s = lock(&inner.state);
        CacheStats {
            capacity: inner.capacity,
            bytes_used: s.bytes_used,
            pool_bytes: s.pool_bytes,
            bytes_in_flight: s.reserved,
            bytes_held: s.held_bytes,
            chunks: s.lru.len() as u64,
            hits: inner.hits.load(Ordering::Relaxed),
            misses: inner.misses.load(Ordering::Relaxed),
            waits: inner.waits.load(Ordering::Relaxed),
            budget_waits: inner.budget_waits.load(Ordering::Relaxed),
            over_budget: inner.over_budget.load(Ordering::Relaxed),
            prefetch_refused: inner.prefetch_refused.load(Ordering::Relaxed),
            evictions: inner.evictions.load(Ordering::Relaxed),
            bytes_decoded: inner.bytes_decoded.load(Ordering::Relaxed),
            decode_errors: inner.decode_errors.load(Ordering::Relaxed),
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

    /// Bytes the budget covers right now.
    fn committed(s: &CacheStats) -> u64 {
        s.bytes_used + s.bytes_in_flight + s.bytes_held + s.pool_bytes
    }

    /// xorshift, for test keys.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn concurrent_decodes_never_exceed_the_budget() {
        // Room for 4 chunks, 16 threads missing on 64 keys, holding each
        // chunk for a moment like a reply being sent.
        const LEN: usize = 1000;
        let cache = BlockCache::new(4 * LEN as u64 * 4);
        let running = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..16u64 {
                let (cache, running, most) = (&cache, &running, &most);
                s.spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                    for _ in 0..300 {
                        let c = next(&mut x) % 64;
                        let v = cache
                            .get_or_decode(key(9, c), LEN, |b| {
                                let n = running.fetch_add(1, Ordering::SeqCst) + 1;
                                most.fetch_max(n, Ordering::SeqCst);
                                let st = cache.stats();
                                assert!(committed(&st) <= st.capacity, "{st:?}");
                                std::thread::yield_now();
                                b.fill(c as f32);
                                running.fetch_sub(1, Ordering::SeqCst);
                                Ok(())
                            })
                            .unwrap();
                        std::thread::yield_now();
                        assert!(v.iter().all(|&e| e == c as f32));
                    }
                });
            }
        });
        assert!(most.load(Ordering::SeqCst) <= 4, "{most:?} decodes at once");
        let st = cache.stats();
        assert!(committed(&st) <= st.capacity, "{st:?}");
        assert_eq!((st.bytes_in_flight, st.bytes_held, st.in_flight), (0, 0, 0));
        assert_eq!(st.over_budget, 0);
    }

    #[test]
    fn no_deadlock_with_a_budget_of_one_chunk() {
        // One chunk of budget; 24 readers (each holding its chunk across a
        // yield, like a reply) and 8 read-ahead threads on 8 keys.
        // Everything finishes, every reader gets the right values, and
        // nobody needed the over-budget escape.
        const LEN: usize = 500;
        let cache = BlockCache::new(LEN as u64 * 4);
        std::thread::scope(|s| {
            for t in 0..32u64 {
                let cache = &cache;
                s.spawn(move || {
                    let mut x = 0x2545_f491_4f6c_dd1d ^ (t + 1);
                    for _ in 0..300 {
                        let c = next(&mut x) % 8;
                        if t < 8 {
                            cache.prefetch(key(8, c), LEN, fill(c as f32)).unwrap();
                            continue;
                        }
                        let v = cache.get_or_decode(key(8, c), LEN, fill(c as f32)).unwrap();
                        std::thread::yield_now();
                        assert_eq!((v.len(), v[0], v[LEN - 1]), (LEN, c as f32, c as f32));
                    }
                });
            }
        });
        let st = cache.stats();
        assert_eq!(st.over_budget, 0, "{st:?}");
        assert!(committed(&st) <= st.capacity, "{st:?}");
        assert_eq!((st.bytes_in_flight, st.bytes_held, st.in_flight), (0, 0, 0));
    }

    #[test]
    fn read_ahead_never_evicts_a_chunk_nobody_has_read() {
        let cache = BlockCache::new(2 * 400);
        let p = |c| cache.prefetch(key(7, c), 100, fill(c as f32)).unwrap();
        assert_eq!(p(0), Prefetched::Decoded);
        assert_eq!(p(1), Prefetched::Decoded);
        assert_eq!(p(0), Prefetched::Present);
        // Both unread: a third would evict one of them.
        assert_eq!(p(2), Prefetched::NoBudget);
        assert_eq!(cache.stats().prefetch_refused, 1);
        // Chunk 0 is read (a hit); now it may go.
        cache
            .get_or_decode(key(7, 0), 100, |_| panic!("must hit"))
            .unwrap();
        assert_eq!(p(2), Prefetched::Decoded);
        assert!(!cache.is_present(key(7, 0)));
        // A reader may evict unread chunks when nothing else is left.
        let v = cache.get_or_decode(key(7, 3), 100, fill(3.0)).unwrap();
        assert_eq!(v[0], 3.0);
        assert_eq!(cache.stats().chunks, 2);
    }

    #[test]
    fn a_held_chunk_counts_until_it_is_dropped() {
        let cache = BlockCache::new(2 * 400);
        let a = cache.get_or_decode(key(6, 0), 100, fill(1.0)).unwrap();
        cache.clear();
        let st = cache.stats();
        assert_eq!((st.bytes_used, st.bytes_held), (0, 400));
        // One chunk of room is left beside the held one.
        drop(cache.get_or_decode(key(6, 1), 100, fill(2.0)).unwrap());
        drop(cache.get_or_decode(key(6, 2), 100, fill(3.0)).unwrap());
        let st = cache.stats();
        // Evictions: chunk 0 by clear, chunk 1 for chunk 2.
        assert_eq!((st.chunks, st.bytes_held, st.evictions), (1, 400, 2));
        assert_eq!(a[99], 1.0);
        drop(a);
        let st = cache.stats();
        assert_eq!((st.bytes_held, st.pool_bytes, st.bytes_used), (0, 400, 400));
    }

    #[test]
    fn a_caller_holding_the_whole_budget_is_not_left_waiting() {
        // The daemon never does this; a library caller that does gets its
        // chunk after BUDGET_WAIT instead of a hang.
        let cache = BlockCache::new(400);
        let a = cache.get_or_decode(key(5, 0), 100, fill(1.0)).unwrap();
        let b = cache.get_or_decode(key(5, 1), 100, fill(2.0)).unwrap();
        assert_eq!((a[0], b[0]), (1.0, 2.0));
        let st = cache.stats();
        assert_eq!((st.budget_waits, st.over_budget), (1, 1));
        drop((a, b));
        let st = cache.stats();
        assert!(committed(&st) <= st.capacity, "{st:?}");
    }

    #[test]
    fn chunks_larger_than_the_budget_are_decoded_one_at_a_time() {
        let cache = BlockCache::new(100);
        let running = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (cache, running) = (&cache, &running);
                s.spawn(move || {
                    for i in 0..20 {
                        let v = cache
                            .get_or_decode(key(4, t * 100 + i), 1000, |b| {
                                assert_eq!(running.fetch_add(1, Ordering::SeqCst), 0);
                                std::thread::yield_now();
                                b.fill(1.0);
                                running.fetch_sub(1, Ordering::SeqCst);
                                Ok(())
                            })
                            .unwrap();
                        assert_eq!(v.len(), 1000);
                    }
                });
            }
        });
        let st = cache.stats();
        assert_eq!((st.bytes_used, st.bytes_held, st.over_budget), (0, 0, 0));
    }

    #[test]
    fn a_failed_decode_returns_its_budget() {
        let cache = BlockCache::new(400);
        for _ in 0..3 {
            cache
                .get_or_decode(key(3, 0), 100, |_| Err(Error::new(ErrorKind::Io, "no")))
                .unwrap_err();
        }
        let st = cache.stats();
        assert_eq!(
            (st.bytes_in_flight, st.decode_errors, st.over_budget),
            (0, 3, 0)
        );
        assert!(committed(&st) <= st.capacity);
    }
}
