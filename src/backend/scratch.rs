//! Per-thread scratch buffers for the read path.
//!
//! A decode reads its source bytes into a buffer before the kernel runs;
//! allocating it per call costs a fresh mapping and page faults each time
//! (buffers of >128 KiB are mmap'd by the allocator), which showed up as
//! half the throughput of cold reads. Each thread keeps one buffer of each
//! kind and reuses it. A nested use on the same thread gets a fresh buffer
//! (the outer one is taken out while in use), so this can never alias.

use std::cell::RefCell;

/// Buffers larger than this are not kept between calls.
const KEEP_LIMIT: usize = 32 << 20;

thread_local! {
    static BYTES: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static FLOATS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn with<T: Copy + Default, R>(
    cell: &'static std::thread::LocalKey<RefCell<Vec<T>>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let mut buf = cell.with(|c| std::mem::take(&mut *c.borrow_mut()));
    buf.clear();
    buf.resize(len, T::default());
    let r = f(&mut buf);
    if buf.capacity() <= KEEP_LIMIT {
        cell.with(|c| *c.borrow_mut() = buf);
    }
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
}
