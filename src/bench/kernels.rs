//! `rknot bench kernels`: throughput of every dequantization kernel, on one
//! thread, against a memcpy of the same number of f32 bytes measured in the
//! same run (the rate at which a decoder could at best hand out f32 it had
//! already made).
//!
//! Each type decodes `size_mb` MiB of f32 from random blocks (uniform bytes;
//! the MXFP4 scale byte kept in 100..=150 so that no product is subnormal,
//! which would measure the CPU's denormal assist instead of the kernel).
//! Cases are interleaved round by round and medians reported. Each case is
//! timed twice: by the CPU time of the benchmarking thread (what the
//! figures and ratios use: other processes on a shared machine do not
//! inflate it) and by the wall clock (shown for reference).

use std::fmt::Write as _;
use std::time::Instant;

/// CPU time of the calling thread, seconds.
fn thread_cpu_secs() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return f64::NAN;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Runs `f` once: (thread CPU seconds, wall seconds).
pub(super) fn timed(mut f: impl FnMut()) -> (f64, f64) {
    let (c, w) = (thread_cpu_secs(), Instant::now());
    f();
    (thread_cpu_secs() - c, w.elapsed().as_secs_f64())
}

use super::{BResult, gbs, median};
use crate::quant::{self, DECODABLE, GgmlType};
use crate::synth::Rng;

/// Random whole blocks of `ty` decoding to `n` elements.
fn random_blocks(ty: GgmlType, n: u64, rng: &mut Rng) -> Vec<u8> {
    let bytes = ty.bytes_for(n).unwrap_or(0) as usize;
    let mut v: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
    if ty == GgmlType::Mxfp4 {
        for b in v.chunks_exact_mut(ty.block_bytes() as usize) {
            b[0] = 100 + b[0] % 51;
        }
    }
    v
}

/// The benchmark's report: one line per type, GB/s of f32 produced and the
/// ratio to the memcpy baseline.
pub fn kernels_bench(
    size_mb: u64,
    rounds: usize,
    progress: crate::progress::Mode,
) -> BResult<String> {
    use crate::progress::{Meter, Unit};
    // A multiple of every block size (256 and 64 divide 2^18).
    let n = (size_mb.max(1) << 18).next_multiple_of(256);
    let out_bytes = n * 4;
    let mut rng = Rng::stream(&[0x6b65_726e, n]);
    let sources: Vec<(GgmlType, Vec<u8>)> = DECODABLE
        .iter()
        .map(|&ty| (ty, random_blocks(ty, n, &mut rng)))
        .collect();
    let copy_src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut out = vec![0f32; n as usize];

    let meter = Meter::new("bench kernels", Unit::Items("rounds"), progress);
    meter.set_total(rounds.max(1) as u64);
    // Per case: (CPU seconds, wall seconds) of each round.
    let mut copy_secs = (Vec::new(), Vec::new());
    let mut secs: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); sources.len()];
    for _ in 0..rounds.max(1) {
        let (c, w) = timed(|| {
            out.copy_from_slice(&copy_src);
            std::hint::black_box(&mut out);
        });
        copy_secs.0.push(c);
        copy_secs.1.push(w);
        for ((ty, src), s) in sources.iter().zip(&mut secs) {
            let mut res = Ok(());
            let (c, w) = timed(|| {
                res = quant::dequantize(*ty, std::hint::black_box(src), &mut out);
                std::hint::black_box(&mut out);
            });
            res.map_err(|e| format!("{ty}: {e}"))?;
            s.0.push(c);
            s.1.push(w);
        }
        meter.inc(1);
    }
    meter.finish();

    let base = gbs(out_bytes, median(&mut copy_secs.0));
    let base_wall = gbs(out_bytes, median(&mut copy_secs.1));
    let mut r = String::new();
    let _ = writeln!(
        r,
        "rknot bench kernels: {} MiB of f32 decoded per type from random blocks, 1 thread, \
         median of {} rounds (GB/s of f32 by thread CPU time; wall clock in the last column)",
        out_bytes >> 20,
        rounds.max(1)
    );
    let _ = writeln!(
        r,
        "baseline: memcpy of {} MiB of f32: {base:.2} GB/s (wall {base_wall:.2})",
        out_bytes >> 20
    );
    let _ = writeln!(
        r,
        "{:<9} {:>12} {:>9} {:>10} {:>11}",
        "type", "source MiB", "GB/s f32", "/ memcpy", "GB/s wall"
    );
    for ((ty, src), s) in sources.iter().zip(&mut secs) {
        let rate = gbs(out_bytes, median(&mut s.0));
        let _ = writeln!(
            r,
            "{:<9} {:>12.2} {:>9.2} {:>10.3} {:>11.2}",
            ty.to_string(),
            src.len() as f64 / (1u64 << 20) as f64,
            rate,
            rate / base,
            gbs(out_bytes, median(&mut s.1))
        );
    }
    Ok(r)
}
