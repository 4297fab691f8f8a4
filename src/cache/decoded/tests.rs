//! Tests of the decoded-chunk cache: budget, single flight, read-ahead
//! and read registrations, alone and under threads.

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

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
                        if cache.request_ahead(key(8, c)) {
                            cache
                                .prefetch(key(8, c), LEN, None, fill(c as f32))
                                .unwrap();
                        }
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
    // As the prefetcher does: a chunk cached or in flight is not
    // requested.
    let p = |c| match cache.request_ahead(key(7, c)) {
        true => cache
            .prefetch(key(7, c), 100, None, fill(c as f32))
            .unwrap(),
        false => Prefetched::Present,
    };
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

/// A decoder that counts its calls.
fn counting(calls: &AtomicUsize, v: f32) -> impl FnOnce(&mut [f32]) -> Result<()> + '_ {
    move |b| {
        calls.fetch_add(1, Ordering::SeqCst);
        b.fill(v);
        Ok(())
    }
}

#[test]
fn a_read_ahead_request_its_reader_got_to_first_is_dropped() {
    // On a busy machine the read-ahead thread took requests off the
    // queue after the reader had decoded the chunk itself and moved
    // on: it decoded the chunk again, behind the reader, evicting the
    // one the reader was in.
    let cache = BlockCache::new(2 * 400);
    assert!(cache.request_ahead(key(7, 1)));
    // Requested already: not queued twice.
    assert!(!cache.request_ahead(key(7, 1)));
    for c in 0..4 {
        drop(cache.get_or_decode(key(7, c), 100, fill(c as f32)).unwrap());
    }
    assert!(!cache.is_present(key(7, 1)));
    let calls = AtomicUsize::new(0);
    let p = cache.prefetch(key(7, 1), 100, None, counting(&calls, 1.0));
    assert_eq!(p.unwrap(), Prefetched::Passed);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // A request that was not queued is forgotten.
    assert!(cache.request_ahead(key(7, 9)));
    cache.cancel_ahead(key(7, 9));
    let p = cache.prefetch(key(7, 9), 100, None, counting(&calls, 9.0));
    assert_eq!(p.unwrap(), Prefetched::Passed);
    assert_eq!(cache.stats().bytes_decoded, 4 * 400);
}

#[test]
fn read_ahead_spares_the_chunk_its_reader_is_in() {
    // Two chunks of budget. The reader's previous reply still holds
    // chunk 0 when it reads chunk 1 and asks for chunk 2 ahead: the
    // only chunk nobody holds is 1, the one the reader is in.
    let cache = BlockCache::new(2 * 400);
    let reply = cache.get_or_decode(key(7, 0), 100, fill(0.0)).unwrap();
    drop(cache.get_or_decode(key(7, 1), 100, fill(1.0)).unwrap());
    assert!(cache.request_ahead(key(7, 2)));
    let p = cache.prefetch(key(7, 2), 100, Some(key(7, 1)), fill(2.0));
    assert_eq!(p.unwrap(), Prefetched::NoBudget);
    drop(reply);
    let calls = AtomicUsize::new(0);
    cache
        .get_or_decode(key(7, 1), 100, counting(&calls, 1.0))
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0, "chunk 1 was evicted");
    // Chunk 0 is done with: read-ahead may take its place.
    assert!(cache.request_ahead(key(7, 2)));
    let p = cache.prefetch(key(7, 2), 100, Some(key(7, 1)), fill(2.0));
    assert_eq!(p.unwrap(), Prefetched::Decoded);
    assert!(!cache.is_present(key(7, 0)));
}

#[test]
fn a_later_read_waits_for_the_chunks_an_earlier_read_still_needs() {
    // Two chunks of budget holding chunks 0 and 1. Read A needs chunks
    // 0 and 1, read B (sent after it) chunks 1 and 2, as the kernel's
    // read-ahead sends two 1 MiB reads at once. B gets chunk 1 first
    // and needs room for chunk 2: evicting chunk 0 made A decode it
    // again; B must wait until A has its chunks.
    let cache = BlockCache::new(2 * 400);
    for c in 0..2 {
        drop(cache.get_or_decode(key(7, c), 100, fill(c as f32)).unwrap());
    }
    let a = cache.begin_read(None, [key(7, 0), key(7, 1)]);
    let b = cache.begin_read(None, [key(7, 1), key(7, 2)]);
    let calls = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let later = s.spawn(move || {
            assert_eq!(b.get_or_decode(key(7, 1), 100, fill(1.0)).unwrap()[0], 1.0);
            assert_eq!(b.get_or_decode(key(7, 2), 100, fill(2.0)).unwrap()[0], 2.0);
        });
        // Until B waits for budget (or, before the fix, is done).
        while !later.is_finished() && cache.stats().budget_waits == 0 {
            std::thread::yield_now();
        }
        for c in 0..2 {
            let v = a.get_or_decode(key(7, c), 100, counting(&calls, c as f32));
            assert_eq!(v.unwrap()[0], c as f32);
        }
        later.join().unwrap();
    });
    assert_eq!(calls.load(Ordering::SeqCst), 0, "read A decoded again");
    drop(a);
    let st = cache.stats();
    assert_eq!((st.bytes_decoded, st.over_budget), (3 * 400, 0), "{st:?}");
    assert!(lock(&cache.inner.state).needed.is_empty());
}

#[test]
fn reads_go_in_the_order_given_not_the_order_they_registered() {
    // The same two reads, but B (the kernel's later request: a larger
    // unique id) registers first, as when the FUSE thread given A was
    // slower to start it. B must still wait for A's chunks.
    let cache = BlockCache::new(2 * 400);
    for c in 0..2 {
        drop(cache.get_or_decode(key(7, c), 100, fill(c as f32)).unwrap());
    }
    let b = cache.begin_read(Some(20), [key(7, 1), key(7, 2)]);
    let a = cache.begin_read(Some(10), [key(7, 0), key(7, 1)]);
    let calls = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let later = s.spawn(move || {
            assert_eq!(b.get_or_decode(key(7, 1), 100, fill(1.0)).unwrap()[0], 1.0);
            assert_eq!(b.get_or_decode(key(7, 2), 100, fill(2.0)).unwrap()[0], 2.0);
        });
        while !later.is_finished() && cache.stats().budget_waits == 0 {
            std::thread::yield_now();
        }
        for c in 0..2 {
            let v = a.get_or_decode(key(7, c), 100, counting(&calls, c as f32));
            assert_eq!(v.unwrap()[0], c as f32);
        }
        later.join().unwrap();
    });
    assert_eq!(calls.load(Ordering::SeqCst), 0, "read A decoded again");
}

#[test]
fn a_read_that_stops_early_lets_later_reads_go() {
    // Read A registered chunk 0 and failed before fetching it: read B,
    // waiting for that chunk to be fetched, goes on when A is dropped.
    let cache = BlockCache::new(400);
    drop(cache.get_or_decode(key(7, 0), 100, fill(0.0)).unwrap());
    let a = cache.begin_read(None, [key(7, 0)]);
    let b = cache.begin_read(None, [key(7, 1)]);
    std::thread::scope(|s| {
        let later = s.spawn(move || b.get_or_decode(key(7, 1), 100, fill(1.0)).unwrap()[0]);
        while !later.is_finished() && cache.stats().budget_waits == 0 {
            std::thread::yield_now();
        }
        drop(a);
        assert_eq!(later.join().unwrap(), 1.0);
    });
    let st = cache.stats();
    assert_eq!((st.budget_waits, st.over_budget), (1, 0), "{st:?}");
}

#[test]
fn a_read_that_fetches_one_chunk_twice_still_gives_up_the_others() {
    // Registered chunks 0 and 1, fetched chunk 0 twice and never chunk
    // 1: dropping the read must still give up chunk 1, or later reads
    // would spare (and wait for) it for ever.
    let cache = BlockCache::new(4 * 400);
    let read = cache.begin_read(None, [key(7, 0), key(7, 1)]);
    for _ in 0..2 {
        drop(read.get_or_decode(key(7, 0), 100, fill(0.0)).unwrap());
    }
    drop(read);
    assert!(lock(&cache.inner.state).needed.is_empty());
}

#[test]
fn registered_reads_and_read_ahead_never_deadlock() {
    // Two chunks of budget; 16 readers, each registering 1 to 3
    // consecutive chunks and fetching them in order while holding each
    // across a yield (like a reply), and 4 read-ahead threads. Every
    // read finishes with the right values, nobody needed the
    // over-budget escape, and nothing stays registered.
    const LEN: usize = 300;
    let cache = BlockCache::new(2 * LEN as u64 * 4);
    std::thread::scope(|s| {
        for t in 0..20u64 {
            let cache = &cache;
            s.spawn(move || {
                let mut x = 0x853c_49e6_748f_ea9b ^ (t + 1);
                for _ in 0..200 {
                    let first = next(&mut x) % 12;
                    if t < 4 {
                        let k = key(6, first);
                        if cache.request_ahead(k) {
                            let at = Some(key(6, first.saturating_sub(1)));
                            cache.prefetch(k, LEN, at, fill(first as f32)).unwrap();
                        }
                        continue;
                    }
                    let n = 1 + next(&mut x) % 3;
                    let read = cache.begin_read(None, (first..first + n).map(|c| key(6, c)));
                    for c in first..first + n {
                        let v = read.get_or_decode(key(6, c), LEN, fill(c as f32)).unwrap();
                        std::thread::yield_now();
                        assert_eq!((v[0], v[LEN - 1]), (c as f32, c as f32));
                    }
                }
            });
        }
    });
    let st = cache.stats();
    assert_eq!(st.over_budget, 0, "{st:?}");
    assert!(committed(&st) <= st.capacity, "{st:?}");
    assert_eq!((st.bytes_in_flight, st.bytes_held, st.in_flight), (0, 0, 0));
    let s = lock(&cache.inner.state);
    assert!(s.needed.is_empty() && s.ahead.is_empty() && s.waiting.is_empty());
}
