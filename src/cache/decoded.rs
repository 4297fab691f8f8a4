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
//! - A sequential reader does not have a chunk decoded twice when the
//!   cache holds two chunks or more. Three races did that on a busy
//!   machine: read-ahead requests left in the queue until the reader had
//!   passed their chunk (decoded again behind it), read-ahead evicting the
//!   chunk the reader was in (between two reads nobody holds it, and the
//!   chunk before it was still held by the previous reply), and, through
//!   the page cache, the kernel's read-ahead sending two reads at once
//!   whose three chunks (each 1 MiB read spans two) did not fit, so the
//!   later read evicted the chunk the earlier one was about to copy. So a
//!   read-ahead request is noted ([`BlockCache::request_ahead`]) and
//!   dropped if a reader asks for its chunk first; read-ahead spares the
//!   chunk its reader is in; and a read registers the chunks it will fetch
//!   ([`BlockCache::begin_read`]): until it has them, later reads (in the
//!   order the kernel sent them) do not evict them but wait, and it gets
//!   budget before them (the earliest read always proceeds: no read waits
//!   for a later one). What is left: a read that reaches the daemon's
//!   handler only after the read the kernel sent next was served (its FUSE
//!   thread delayed in between) was not registered in time, and with two
//!   chunks it decodes again.
//! - Errors are handed to every waiter and not cached: the next read tries
//!   again (a source file that was truncated and then restored recovers).
//! - Evicted buffers are reused for the next decode: a fresh 1 MiB buffer
//!   costs 256 page faults, which halved cold read throughput. With the
//!   cache full, a decode evicts one chunk and decodes into its buffer.
//! - A reader that saw no budget come back for [`BUDGET_WAIT`] decodes
//!   anyway (logged): only a caller that holds chunks while asking for more
//!   can get there (the daemon's readers drop each chunk before asking for
//!   the next), and it must not hang.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use lru::LruCache;

use super::lock;
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

/// A read in progress ([`BlockCache::begin_read`]): its place in line for
/// budget and the chunks it has still to fetch. Dropping it gives up the
/// chunks it did not fetch.
pub struct PendingRead<'a> {
    cache: &'a BlockCache,
    /// None when it registered no chunks.
    ticket: Option<Ticket>,
    /// The registered chunks it has not fetched yet: when none are left,
    /// dropping it has nothing to give up (and does not take the lock).
    unfetched: RefCell<Vec<ChunkKey>>,
}

impl PendingRead<'_> {
    /// [`BlockCache::get_or_decode`] for this read: `key` is no longer
    /// needed by it once it has the chunk.
    pub fn get_or_decode(
        &self,
        key: ChunkKey,
        len: usize,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Chunk> {
        let chunk = self.cache.read(key, len, self.ticket, decode)?;
        let mut unfetched = self.unfetched.borrow_mut();
        if let Some(i) = unfetched.iter().position(|k| *k == key) {
            unfetched.swap_remove(i);
        }
        Ok(chunk)
    }
}

impl Drop for PendingRead<'_> {
    fn drop(&mut self) {
        let unfetched = self.unfetched.get_mut();
        if unfetched.is_empty() {
            return;
        }
        let Some(ticket) = self.ticket else { return };
        let inner = &self.cache.inner;
        let mut s = lock(&inner.state);
        let mut gave_up = false;
        for k in unfetched.drain(..) {
            gave_up |= s.consumed(k, ticket);
        }
        // A read that failed or stopped early: chunks later reads waited
        // for may go now.
        if gave_up {
            inner.budget_changed(&mut s);
        }
    }
}

/// Which chunk of which tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
    /// A reader: gets the chunk, waits for budget. `read` is the ticket of
    /// its [`PendingRead`], if it registered one.
    Read { read: Option<Ticket> },
    /// Read-ahead: decodes into the cache if there is budget, never waits,
    /// and never evicts `reader_at`, the chunk the reader that asked for
    /// it is in.
    Prefetch { reader_at: Option<ChunkKey> },
}

impl Mode {
    fn is_read(self) -> bool {
        matches!(self, Mode::Read { .. })
    }
}

/// What [`Inner::fetch`] did.
enum Fetched {
    /// A reader's chunk.
    Chunk(Chunk),
    /// What a read-ahead request did.
    Ahead(Prefetched),
}

/// What a read-ahead request did ([`BlockCache::prefetch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetched {
    Decoded,
    /// Cached or being decoded already.
    Present,
    /// No budget without evicting a chunk that is held, not read yet, or
    /// the one the reader is in: the reader will decode it.
    NoBudget,
    /// Not requested ([`BlockCache::request_ahead`]), or a reader asked for
    /// the chunk after the request: the reader decoded it (or waited for
    /// it), so it is behind the reader now and not decoded again.
    Passed,
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
    /// The budget, in bytes.
    capacity: u64,
    /// The event counters of [`CacheStats`] (`stats` fills in the rest).
    counts: CacheStats,
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
    waiting: BTreeSet<Ticket>,
    /// The next [`Ticket::id`].
    next_ticket: u64,
    /// Counts budget changes (returns, finished decodes, queue moves).
    changes: u64,
    /// Chunks requested for read-ahead that no reader has asked for since
    /// ([`BlockCache::request_ahead`]). A request waits in the prefetch
    /// queue; if its reader gets there first, decoding the chunk later
    /// would decode it a second time behind the reader (and evict a chunk
    /// the reader still needs to make room).
    ahead: HashSet<ChunkKey>,
    /// (chunk, ticket) for each chunk that a read in progress will still
    /// fetch ([`PendingRead`]); by chunk, then ticket, so a chunk's
    /// earliest read comes first.
    needed: BTreeSet<(ChunkKey, Ticket)>,
}

/// A reader's place in line: by `order`, then `id`. `id` is unique to the
/// reader; `order` is the FUSE request's unique id for the daemon's reads
/// ([`BlockCache::begin_read`]), else the same as `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Ticket {
    order: u64,
    id: u64,
}

impl Ticket {
    /// Before every ticket.
    const FIRST: Ticket = Ticket { order: 0, id: 0 };
}

fn buf_bytes(v: &Vec<f32>) -> u64 {
    v.capacity() as u64 * 4
}

impl State {
    /// A new reader's ticket, by `order` if given, else after every ticket
    /// so far without one.
    fn new_ticket(&mut self, order: Option<u64>) -> Ticket {
        let id = self.next_ticket;
        self.next_ticket += 1;
        Ticket {
            order: order.unwrap_or(id),
            id,
        }
    }

    /// Bytes of every chunk buffer the budget covers.
    fn committed(&self) -> u64 {
        self.bytes_used + self.held_bytes + self.reserved + self.pool_bytes
    }

    /// A pooled buffer for `len` values: the smallest that holds them, and
    /// not more than twice their size (a 16 MiB buffer must not be spent
    /// on a 2 KiB chunk). One of exactly that size (the usual case: chunks
    /// of one size) ends the search: after a `drop-cache` of a large cache
    /// of small chunks the pool holds tens of thousands of buffers, and
    /// every miss searches it with the lock held.
    fn take_pooled(&mut self, len: usize) -> Option<Vec<f32>> {
        let mut best: Option<(usize, usize)> = None;
        for (i, b) in self.pool.iter().enumerate() {
            let cap = b.capacity();
            if cap < len || cap / 2 > len || best.is_some_and(|(_, c)| c <= cap) {
                continue;
            }
            best = Some((i, cap));
            if cap == len {
                break;
            }
        }
        let (i, _) = best?;
        let b = self.pool.swap_remove(i);
        self.pool_bytes -= buf_bytes(&b);
        Some(b)
    }

    /// Keep `b` for reuse if the budget has room for it (it is no longer
    /// counted anywhere else), else hand it to `freed`.
    fn recycle(&mut self, b: Vec<f32>, freed: &mut Vec<Vec<f32>>) {
        if self.committed() + buf_bytes(&b) <= self.capacity {
            self.pool_bytes += buf_bytes(&b);
            self.pool.push(b);
        } else {
            freed.push(b);
        }
    }

    /// The least recently used chunk that nobody holds and whose eviction
    /// `mode` allows. Chunks that were read and that no read in progress
    /// will fetch go first. Read-ahead evicts nothing else, and spares
    /// `reader_at`, the chunk its reader is in: between two reads nobody
    /// holds it, and when the chunk before it was still held (the previous
    /// read's reply not yet dropped) it was the least recently used chunk
    /// left, and the reader decoded it again. A reader may then take an
    /// unread prefetched chunk or one that it or a later read will fetch,
    /// never one that an earlier read still has to fetch: with the page
    /// cache, the kernel's read-ahead sends a sequential reader's reads
    /// two at a time, and the later one evicted the chunk the earlier one
    /// was about to copy (each 1 MiB read spans two chunks: two reads need
    /// three). It waits for that read instead.
    fn victim(&self, mode: Mode) -> Option<ChunkKey> {
        let mut fallback = None;
        for (n, (k, e)) in self.lru.iter().rev().enumerate() {
            if !mode.is_read() && n >= PREFETCH_VICTIM_SCAN {
                break;
            }
            if e.leases > 0 {
                continue;
            }
            let first_reader = self.first_reader(*k);
            let spare = match mode {
                Mode::Read { read: Some(t) } => first_reader.is_some_and(|r| r < t),
                Mode::Read { read: None } => false,
                Mode::Prefetch { reader_at } => {
                    reader_at == Some(*k) || first_reader.is_some() || e.unread_prefetch
                }
            };
            if spare {
                continue;
            }
            if !e.unread_prefetch && first_reader.is_none() {
                return Some(*k);
            }
            fallback.get_or_insert(*k);
        }
        fallback
    }

    /// The ticket of the earliest read in progress that will still fetch
    /// `key`, if any.
    fn first_reader(&self, key: ChunkKey) -> Option<Ticket> {
        let &(k, t) = self.needed.range((key, Ticket::FIRST)..).next()?;
        (k == key).then_some(t)
    }

    /// The read with ticket `ticket` got chunk `key` (or gave up on it):
    /// it no longer needs it. Whether it did.
    fn consumed(&mut self, key: ChunkKey, ticket: Ticket) -> bool {
        self.needed.remove(&(key, ticket))
    }

    /// Evict `key` (held by nobody): its buffer goes to the pool.
    fn evict(&mut self, key: ChunkKey) {
        let Some(e) = self.lru.pop(&key) else { return };
        self.counts.evictions += 1;
        self.bytes_used -= e.bytes;
        // Nobody holds it (no lease), so this is the only reference.
        if let Ok(b) = Arc::try_unwrap(e.data) {
            self.pool_bytes += buf_bytes(&b);
            self.pool.push(b);
        }
    }

    /// Get back within the budget after a decode beyond it (an over-budget
    /// escape): pooled buffers first, then chunks nobody holds.
    fn shrink(&mut self, freed: &mut Vec<Vec<f32>>) {
        while self.committed() > self.capacity {
            if let Some(b) = self.pool.pop() {
                self.pool_bytes -= buf_bytes(&b);
                freed.push(b);
                continue;
            }
            let Some(k) = self.victim(Mode::Read { read: None }) else {
                return;
            };
            self.evict(k);
        }
    }

    /// Budget for a decode of `len` values, making room by dropping pooled
    /// buffers that do not fit and evicting chunks nobody holds.
    fn reserve(&mut self, len: usize, mode: Mode, freed: &mut Vec<Vec<f32>>) -> Reservation {
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
            if self.committed() + need <= self.capacity {
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
                continue;
            }
            // A chunk larger than the whole budget: alone, or not at all.
            if mode.is_read() && self.committed() == 0 {
                self.reserved += need;
                return Reservation::Granted {
                    buf: None,
                    bytes: need,
                };
            }
            return match mode {
                Mode::Read { .. } => Reservation::Wait,
                Mode::Prefetch { .. } => Reservation::Refused,
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
    state: Mutex<State>,
    /// Signalled when budget may have come free: a decode finished, a
    /// held chunk was returned, the cache was cleared.
    budget: Condvar,
}

pub struct BlockCache {
    inner: Arc<Inner>,
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
                            s.recycle(b, &mut freed);
                        }
                    }
                }
            }
            s.shrink(&mut freed);
            self.budget_changed(s);
        }
        // Freed outside the lock: freeing a large buffer is a munmap every
        // reader would wait for.
        drop(freed);
    }

    /// Find, wait for, or decode the chunk `key` (`len` values).
    ///
    /// When the budget is short, readers are served in ticket order (only
    /// the first may take budget) so none starves behind later arrivals,
    /// and read-ahead is refused while any reader waits. A registered read
    /// ([`PendingRead`]) has its ticket from when it registered (by its
    /// order), so it goes before every later read, also one that waited
    /// first: those may be waiting for it to fetch its chunks (see
    /// `State::victim`). Others take a ticket when they start to wait.
    fn fetch(
        self: &Arc<Self>,
        key: ChunkKey,
        len: usize,
        mode: Mode,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Fetched> {
        let mut counted = false;
        let registered = match mode {
            Mode::Read { read } => read,
            Mode::Prefetch { .. } => None,
        };
        let mut ticket = registered;
        // Whether `ticket` is in the queue for budget.
        let mut queued = false;
        // When this reader last saw the budget change, and its change count
        // then: the over-budget escape needs BUDGET_WAIT without any change.
        let mut stalled: Option<(Instant, u64)> = None;
        // The budget, when this reader decodes beyond it (logged).
        let mut over_budget = None;
        let mut freed = Vec::new();
        let granted = loop {
            drop(std::mem::take(&mut freed));
            let mut s = lock(&self.state);
            if !mode.is_read() {
                // Checked under the same lock as the decode starts: a
                // reader that comes later finds it in flight and waits.
                if !s.ahead.remove(&key) {
                    return Ok(Fetched::Ahead(Prefetched::Passed));
                }
                if s.lru.contains(&key) || s.in_flight.contains_key(&key) {
                    return Ok(Fetched::Ahead(Prefetched::Present));
                }
            } else {
                // This reader got here first: a read-ahead request for the
                // chunk still queued is late now.
                s.ahead.remove(&key);
                if let Some(id) = s.lru.get(&key).map(|e| e.id) {
                    if !counted {
                        s.counts.hits += 1;
                    }
                    if let Some(d) = s.lease(key, id) {
                        self.leave_queue(&mut s, &mut queued, ticket);
                        if let Some(t) = registered {
                            s.consumed(key, t);
                        }
                        drop(s);
                        return Ok(Fetched::Chunk(self.chunk(d, key, id)));
                    }
                }
            }
            // A read-ahead request counts as a miss only if it decodes.
            if !counted && mode.is_read() {
                s.counts.misses += 1;
                counted = true;
            }
            if let Some(slot) = s.in_flight.get(&key) {
                let slot = slot.clone();
                self.leave_queue(&mut s, &mut queued, ticket);
                s.counts.waits += 1;
                drop(s);
                let id = Self::wait(&slot)?;
                drop(slot);
                let mut s = lock(&self.state);
                if let Some(d) = s.lease(key, id) {
                    if let Some(t) = registered {
                        s.consumed(key, t);
                    }
                    drop(s);
                    return Ok(Fetched::Chunk(self.chunk(d, key, id)));
                }
                // Evicted before we got to it (a tiny cache): again.
                continue;
            }
            // The first in the queue, or before it (a registered read that
            // started before the first one in the queue).
            let my_turn = s
                .waiting
                .first()
                .is_none_or(|f| ticket.is_some_and(|t| t <= *f));
            let reservation = match (my_turn, mode) {
                (true, _) => s.reserve(len, mode, &mut freed),
                (false, Mode::Read { .. }) => Reservation::Wait,
                (false, Mode::Prefetch { .. }) => Reservation::Refused,
            };
            match reservation {
                Reservation::Granted { buf, bytes } => {
                    if !mode.is_read() {
                        s.counts.misses += 1;
                    }
                    self.leave_queue(&mut s, &mut queued, ticket);
                    break Granted {
                        slot: s.start(key),
                        buf,
                        reserved: bytes,
                    };
                }
                Reservation::Refused => {
                    s.counts.prefetch_refused += 1;
                    drop(s);
                    return Ok(Fetched::Ahead(Prefetched::NoBudget));
                }
                Reservation::Wait if !freed.is_empty() => {
                    // Free what reserve let go first (outside the lock),
                    // then look again.
                    continue;
                }
                Reservation::Wait => {
                    if !queued {
                        let t = *ticket.get_or_insert_with(|| s.new_ticket(None));
                        s.waiting.insert(t);
                        queued = true;
                        s.counts.budget_waits += 1;
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
                        s.counts.over_budget += 1;
                        over_budget = Some(s.capacity);
                        self.leave_queue(&mut s, &mut queued, ticket);
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
        if let Some(capacity) = over_budget {
            crate::logging::throttled!(
                log::Level::Warn,
                "cache over budget",
                "the decoded-chunk budget ({capacity} B) stayed in use for {} ms; decoding \
                 beyond it",
                BUDGET_WAIT.as_millis(),
            );
        }
        self.decode_into(key, len, mode, granted, decode)
    }

    /// Give up this reader's place in the queue for budget (it got budget,
    /// a hit, or joined a decode in flight); the next one may go.
    fn leave_queue(&self, s: &mut State, queued: &mut bool, ticket: Option<Ticket>) {
        if std::mem::take(queued)
            && let Some(t) = ticket
        {
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
                    s.counts.bytes_decoded += len as u64 * 4;
                    let id = s.next_id;
                    s.next_id += 1;
                    let bytes = buf_bytes(&buf);
                    let data = Arc::new(buf);
                    let read = mode.is_read();
                    if let Mode::Read { read: Some(t) } = mode {
                        s.consumed(key, t);
                    }
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
                    if bytes <= s.capacity {
                        s.bytes_used += bytes;
                        // Single flight: the key was not cached.
                        if let Some((_, old)) = s.lru.push(key, entry) {
                            s.bytes_used -= old.bytes;
                            if old.leases > 0 {
                                s.held_bytes += old.bytes;
                                s.held.insert(old.id, old);
                            } else if let Ok(b) = Arc::try_unwrap(old.data) {
                                s.recycle(b, &mut freed);
                            }
                        }
                    } else if read {
                        // Too large to keep: held by its reader only.
                        s.held_bytes += bytes;
                        s.held.insert(id, entry);
                    } else if let Ok(b) = Arc::try_unwrap(entry.data) {
                        // (Read-ahead never gets such a budget.)
                        s.recycle(b, &mut freed);
                    }
                    (Ok(id), handout.map(|d| (d, id)))
                }
                Err(e) => {
                    s.counts.decode_errors += 1;
                    s.recycle(buf, &mut freed);
                    (Err((e.kind(), e.to_string())), None)
                }
            };
            s.shrink(&mut freed);
            self.budget_changed(&mut s);
            r
        };
        drop(freed);
        *lock(&slot.done) = Some(outcome.clone());
        slot.cv.notify_all();
        match (outcome, chunk) {
            (Err((kind, msg)), _) => Err(Error::new(kind, msg)),
            (Ok(_), Some((data, id))) => Ok(Fetched::Chunk(self.chunk(data, key, id))),
            (Ok(_), None) => Ok(Fetched::Ahead(Prefetched::Decoded)),
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
                state: Mutex::new(State {
                    capacity: capacity_bytes,
                    counts: CacheStats::default(),
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
                    ahead: HashSet::new(),
                    needed: BTreeSet::new(),
                }),
                budget: Condvar::new(),
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
        self.read(key, len, None, decode)
    }

    /// A reader's fetch; `read` is its [`PendingRead`]'s ticket.
    fn read(
        &self,
        key: ChunkKey,
        len: usize,
        read: Option<Ticket>,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Chunk> {
        match self.inner.fetch(key, len, Mode::Read { read }, decode)? {
            Fetched::Chunk(c) => Ok(c),
            // Read mode always ends with a chunk or an error.
            _ => Err(Error::new(
                ErrorKind::BadValue,
                "internal error: cache read returned no chunk",
            )),
        }
    }

    /// Register a read that will fetch the chunks `keys` (in any order)
    /// through [`PendingRead::get_or_decode`]: until it has fetched one, a
    /// later read does not evict it (it waits for budget instead), and
    /// read-ahead does not either; and it gets budget before later reads.
    /// The daemon registers every cached read, so that the two reads the
    /// kernel's read-ahead sends at once do not evict each other's chunks
    /// (`State::victim`).
    ///
    /// Later means a larger `order`: the daemon passes the FUSE request's
    /// unique id, which the kernel gives its requests in the order it
    /// sends them. Two FUSE threads can start the kernel's reads in the
    /// other order, and in the order they registered the later read went
    /// first and evicted the earlier one's chunks. Without an order
    /// (`None`), reads go in the order they register.
    pub fn begin_read(
        &self,
        order: Option<u64>,
        keys: impl IntoIterator<Item = ChunkKey>,
    ) -> PendingRead<'_> {
        let mut keys = keys.into_iter().peekable();
        if keys.peek().is_none() {
            // Nothing to register (a small read decodes uncached): no lock.
            // Fetching through it is an unregistered read.
            return PendingRead {
                cache: self,
                ticket: None,
                unfetched: RefCell::default(),
            };
        }
        let mut s = lock(&self.inner.state);
        let ticket = s.new_ticket(order);
        // Each chunk once, however often `keys` names it.
        let registered = keys.filter(|&k| s.needed.insert((k, ticket))).collect();
        PendingRead {
            cache: self,
            ticket: Some(ticket),
            unfetched: RefCell::new(registered),
        }
    }

    /// Note a read-ahead request for `key`: true if it should be queued
    /// (the chunk is not cached, in flight or requested already). Every
    /// request noted here ends in [`BlockCache::prefetch`] or
    /// [`BlockCache::cancel_ahead`].
    pub fn request_ahead(&self, key: ChunkKey) -> bool {
        let mut s = lock(&self.inner.state);
        if s.lru.contains(&key) || s.in_flight.contains_key(&key) {
            return false;
        }
        s.ahead.insert(key)
    }

    /// Forget a read-ahead request that was not queued.
    pub fn cancel_ahead(&self, key: ChunkKey) {
        lock(&self.inner.state).ahead.remove(&key);
    }

    /// Read-ahead of a chunk noted by [`BlockCache::request_ahead`]: decode
    /// `key` into the cache unless a reader asked for it since, it is there
    /// or in flight, or the budget has no room without evicting a chunk
    /// that is held, not read yet, or `reader_at` (the chunk the requesting
    /// reader is in). Never waits for budget.
    pub fn prefetch(
        &self,
        key: ChunkKey,
        len: usize,
        reader_at: Option<ChunkKey>,
        decode: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<Prefetched> {
        let mode = Mode::Prefetch { reader_at };
        Ok(match self.inner.fetch(key, len, mode, decode)? {
            Fetched::Ahead(p) => p,
            // (Read-ahead gets no chunk.)
            Fetched::Chunk(_) => Prefetched::Present,
        })
    }

    /// Drop every cached chunk (in-flight decodes finish normally; chunks
    /// readers hold stay in the budget until they are dropped).
    pub fn clear(&self) {
        let inner = &self.inner;
        let mut freed = Vec::new();
        let mut s = lock(&inner.state);
        s.counts.evictions += s.lru.len() as u64;
        while let Some((_, e)) = s.lru.pop_lru() {
            s.bytes_used -= e.bytes;
            if e.leases > 0 {
                s.held_bytes += e.bytes;
                s.held.insert(e.id, e);
            } else if let Ok(b) = Arc::try_unwrap(e.data) {
                s.recycle(b, &mut freed);
            }
        }
        inner.budget_changed(&mut s);
        drop(s);
        drop(freed);
    }

    pub fn stats(&self) -> CacheStats {
        let s = lock(&self.inner.state);
        CacheStats {
            capacity: s.capacity,
            bytes_used: s.bytes_used,
            pool_bytes: s.pool_bytes,
            bytes_in_flight: s.reserved,
            bytes_held: s.held_bytes,
            chunks: s.lru.len() as u64,
            in_flight: s.in_flight.len() as u64,
            ..s.counts
        }
    }
}
#[cfg(test)]
mod tests;
