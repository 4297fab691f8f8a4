//! Caches of the daemon. `decoded`: decoded chunks of tensors (f32),
//! bounded in bytes, decoded once however many readers miss them; every
//! read of the mount goes through it. `store`: whole decoded files on disk
//! (`--decoded-cache`), served by FUSE passthrough, in the private
//! directory of `crate::source::cache_dir`. The parts of remote sources on
//! disk (`--source-cache`) are the remote source's own cache:
//! `crate::source::part_cache`, below this module.

mod decoded;
pub mod store;

pub use decoded::{BUDGET_WAIT, BlockCache, CacheStats, Chunk, ChunkKey, PendingRead, Prefetched};

/// The daemon's poison-tolerant lock (a poisoned lock's data is used as
/// is rather than taking the daemon down), shared with `source`.
pub(crate) use crate::source::lock;
