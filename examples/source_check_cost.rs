//! What the change check on every source read costs: `SourceFile::read_at`
//! (pread, then fstat and a compare with the version at open) against a
//! bare `pread` of the same bytes, for 4 KiB and 1 MiB reads from the page
//! cache (the worst case for the check: no disk time to hide it).
//!
//! Run: `cargo run --profile ci --example source_check_cost [FILE]`
//! (default: the SmolLM2 test model).

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use rknot::source::SourceFile;

fn main() {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    let src = SourceFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let raw = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let len = src.len();
    for (size, reads) in [(4usize << 10, 400_000usize), (1 << 20, 4_000)] {
        let span = (len / size as u64).clamp(1, 16_384);
        let mut buf = vec![0u8; size];
        // Warm the page cache over the span read below.
        for i in 0..span {
            raw.read_exact_at(&mut buf, i * size as u64).unwrap();
        }
        let mut best = [f64::MAX; 2];
        for _round in 0..5 {
            for (which, slot) in best.iter_mut().enumerate() {
                let t = Instant::now();
                for i in 0..reads as u64 {
                    let off = (i * 7919 % span) * size as u64;
                    if which == 0 {
                        raw.read_exact_at(&mut buf, off).unwrap();
                    } else {
                        src.read_at(off, &mut buf).unwrap();
                    }
                }
                *slot = slot.min(t.elapsed().as_secs_f64() * 1e9 / reads as f64);
            }
        }
        println!(
            "{:>7} B reads: pread {:>8.0} ns, read_at with check {:>8.0} ns, +{:.0} ns ({:+.1}%)",
            size,
            best[0],
            best[1],
            best[1] - best[0],
            (best[1] / best[0] - 1.0) * 100.0
        );
    }
}
