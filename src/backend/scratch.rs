//! Per-thread scratch buffers for the read path.
//!
//! A decode reads its source bytes into a buffer before the kernel runs;
//! allocating it per call costs a fresh mapping and page faults each time
//! (buffers of >128 KiB are mmap'd by the allocator), which showed up as
//! half the throughput of cold reads. Each thread keeps one buffer of each
//! kind and reuses it. A nested use on the same thread gets a fresh buffer
//! (the outer one is taken out while in use), so this can never alias.
//!
//! What all threads keep between calls is bounded in total by
//! [`KEEP_TOTAL`], not per thread: with 16 MiB chunks, 16 FUSE threads and
//! 4 read-ahead threads each kept up to 2 x 32 MiB, hundreds of MiB beyond
//! the cache. A buffer that does not fit is freed after use (the next call
//! on that thread allocates again). Buffers in use are not limited here:
//! they exist only during a decode, and the cache's budget bounds how many
//! decodes run at once.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of idle scratch buffers all threads together keep: 32 threads'
/// worth of the default 1 MiB chunk (an f32 source reads 1 MiB per chunk).
pub const KEEP_TOTAL: usize = 32 << 20;

/// Bytes of scratch buffers kept idle right now, across threads.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// A thread's idle buffer; counted in [`KEPT`] until taken or the thread
/// exits.
struct Kept<T>(Vec<T>);

impl<T> Kept<T> {
    fn bytes(v: &Vec<T>) -> usize {
        v.capacity() * std::mem::size_of::<T>()
    }

    /// The idle buffer, no longer counted as kept.
    fn take(&mut self) -> Vec<T> {
        let v = std::mem::take(&mut self.0);
        KEPT.fetch_sub(Self::bytes(&v), Ordering::Relaxed);
        v
    }

    /// Keep `v` if the total allows it; otherwise it is freed. Replaces
    /// what a nested use kept meanwhile.
    fn put(&mut self, v: Vec<T>) {
        drop(self.take());
        let n = Self::bytes(&v);
        let before = KEPT.fetch_add(n, Ordering::Relaxed);
        if before + n <= KEEP_TOTAL {
            self.0 = v;
        } else {
            KEPT.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

impl<T> Drop for Kept<T> {
    fn drop(&mut self) {
        KEPT.fetch_sub(Self::bytes(&self.0), Ordering::Relaxed);
    }
}

thread_local! {
    static BYTES: RefCell<Kept<u8>> = const { RefCell::new(Kept(Vec::new())) };
    static FLOATS: RefCell<Kept<f32>> = const { RefCell::new(Kept(Vec::new())) };
}

fn with<T: Copy + Default, R>(
    cell: &'static std::thread::LocalKey<RefCell<Kept<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let mut buf = cell.with(|c| c.borrow_mut().take());
    buf.clear();
    buf.resize(len, T::default());
    let r = f(&mut buf);
    cell.with(|c| c.borrow_mut().put(buf));
    r
}

/// Run `f` with a reused byte buffer of exactly `len` bytes (zeroed).
pub(crate) fn with_bytes<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    with(&BYTES, len, f)
}

/// Run `f` with a reused f32 buffer of exactly `len` values (zeroed).
pub(crate) fn with_floats<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    with(&FLOATS, len, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept_bytes() -> usize {
        KEPT.load(Ordering::Relaxed)
    }

    #[test]
    fn nested_use_gets_separate_buffers() {
        with_bytes(4, |a| {
            a.copy_from_slice(&[1, 2, 3, 4]);
            with_bytes(4, |b| {
                assert_eq!(b, &[0, 0, 0, 0]);
                b[0] = 9;
            });
            assert_eq!(a, &[1, 2, 3, 4]);
        });
        with_floats(3, |f| assert_eq!(f, &[0.0; 3]));
    }

    #[test]
    fn threads_keep_at_most_the_total_between_them() {
        // Each thread uses (and would keep) more than a third of the total,
        // and stays alive until all have used theirs: at most two keep.
        let each = KEEP_TOTAL / 3 + 1;
        let threads = 6;
        let used = std::sync::Barrier::new(threads + 1);
        let checked = std::sync::Barrier::new(threads + 1);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    with_bytes(each, |b| b[each - 1] = 1);
                    with_floats(each / 4, |f| f[0] = 1.0);
                    used.wait();
                    checked.wait();
                });
            }
            used.wait();
            // Other tests' threads keep buffers too: only the bound holds
            // exactly.
            assert!(kept_bytes() <= KEEP_TOTAL, "{} kept", kept_bytes());
            checked.wait();
        });
        assert!(kept_bytes() <= KEEP_TOTAL);
    }
}
