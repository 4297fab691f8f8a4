//! Caches of the daemon. `decoded`: decoded chunks of tensors (f32),
//! bounded in bytes, decoded once however many readers miss them; every
//! read of the mount goes through it. `store`: whole decoded files on disk
//! (`--decoded-cache`), served by FUSE passthrough, in the private
//! directory of `crate::source::cache_dir`. The parts of remote sources on
//! disk (`--source-cache`) are the remote source's own cache:
//! `crate::source::part_cache`, below this module.

mod decoded;
pub mod store;

use std::sync::{Mutex, MutexGuard};

pub use decoded::{BUDGET_WAIT, BlockCache, CacheStats, Chunk, ChunkKey, PendingRead, Prefetched};

/// Lock a mutex whose data stays consistent even if a holder panicked.
/// Every lock in the daemon guards state that each mutation leaves whole
/// (a map insert, a counter), so a poisoned lock is used as is rather than
/// taking the daemon down.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
