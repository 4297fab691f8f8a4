//! Read-ahead: decode the chunks after a sequential reader's position on
//! other cores, into the shared cache, so a cold sequential read is not
//! bound by one thread's decode speed.
//!
//! Requests go through a bounded queue; when it is full a request is
//! dropped (the reader will decode that chunk itself). Chunks already cached
//! or being decoded are skipped, and the cache's single-flight makes a
//! reader that arrives first wait for the prefetch rather than decode twice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};

use super::read::Shared;
use crate::cache::ChunkKey;

const QUEUE_DEPTH: usize = 256;

pub(crate) struct Prefetcher {
    tx: Option<SyncSender<(usize, u64)>>,
    requested: AtomicU64,
    dropped: AtomicU64,
    shared: Arc<Shared>,
}

impl Prefetcher {
    pub(crate) fn start(shared: Arc<Shared>, threads: usize) -> Prefetcher {
        let tx = if threads == 0 {
            None
        } else {
            let (tx, rx) = sync_channel::<(usize, u64)>(QUEUE_DEPTH);
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..threads {
                let (rx, shared) = (rx.clone(), shared.clone());
                let spawned = std::thread::Builder::new()
                    .name(format!("rknot-prefetch-{i}"))
                    .spawn(move || worker(&rx, &shared));
                if let Err(e) = spawned {
                    log::warn!("cannot start prefetch thread: {e}");
                }
            }
            Some(tx)
        };
        Prefetcher {
            tx,
            requested: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            shared,
        }
    }

    /// Ask for chunk `chunk` of file `f` to be decoded soon.
    pub(crate) fn request(&self, f: usize, chunk: u64) {
        let Some(tx) = &self.tx else { return };
        let key = ChunkKey {
            tensor: f as u32,
            chunk,
        };
        if self.shared.cache.is_present(key) {
            return;
        }
        self.requested.fetch_add(1, Ordering::Relaxed);
        match tx.try_send((f, chunk)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn requested(&self) -> u64 {
        self.requested.load(Ordering::Relaxed)
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

fn worker(rx: &Mutex<Receiver<(usize, u64)>>, shared: &Shared) {
    loop {
        // The lock is held only to take one request off the queue.
        let next = crate::cache::lock(rx).recv();
        let Ok((f, chunk)) = next else {
            return; // the filesystem was dropped
        };
        let key = ChunkKey {
            tensor: f as u32,
            chunk,
        };
        if shared.cache.is_present(key) {
            continue;
        }
        if let Err(e) = shared.chunk(f, chunk) {
            log::warn!("prefetch of chunk {chunk} of file {f}: {e}");
        }
    }
}
