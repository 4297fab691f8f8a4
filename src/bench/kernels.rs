//! `rknot bench kernels`: throughput of every dequantization kernel, on one
//! thread, against a memcpy of the same number of f32 bytes measured in the
//! same run (the rate at which a decoder could at best hand out f32 it had
//! already made).
//!
//! Each type decodes `size_mb` MiB of f32 from random blocks (uniform bytes;
//! the MXFP4 scale byte kept in 100..=150 so that no product is subnormal,
//! which would measure the CPU's denormal assist instead of the kernel).
//! Cases are interleaved round by round and medians reported.

use std::fmt::Write as _;
use std::time::Instant;

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
    let mut copy_secs = Vec::new();
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); sources.len()];
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        out.copy_from_slice(&copy_src);
        std::hint::black_box(&mut out);
        copy_secs.push(t.elapsed().as_secs_f64());
        for ((ty, src), s) in sources.iter().zip(&mut secs) {
            let t = Instant::now();
            quant::dequantize(*ty, std::hint::black_box(src), &mut out)
                .map_err(|e| format!("{ty}: {e}"))?;
            std::hint::black_box(&mut out);
            s.push(t.elapsed().as_secs_f64());
        }
        meter.inc(1);
    }
    meter.finish();

    let base = gbs(out_bytes, median(&mut copy_secs));
    let mut r = String::new();
    let _ = writeln!(
        r,
        "rknot bench kernels: {} MiB of f32 decoded per type from random blocks, 1 thread, \
         median of {} rounds",
        out_bytes >> 20,
        rounds.max(1)
    );
    let _ = writeln!(
        r,
        "baseline: memcpy of {} MiB of f32: {base:.2} GB/s",
        out_bytes >> 20
    );
    let _ = writeln!(
        r,
        "{:<9} {:>12} {:>9} {:>10}",
        "type", "source MiB", "GB/s f32", "/ memcpy"
    );
    for ((ty, src), s) in sources.iter().zip(&mut secs) {
        let rate = gbs(out_bytes, median(s));
        let _ = writeln!(
            r,
            "{:<9} {:>12.2} {:>9.2} {:>10.3}",
            ty.to_string(),
            src.len() as f64 / (1u64 << 20) as f64,
            rate,
            rate / base
        );
    }
    Ok(r)
}
