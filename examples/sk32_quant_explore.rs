//! What SK32's quantization choices buy, separately from truncation: for
//! sample SmolLM2 matrices, the error of the u8 sketch against the exact
//! rank-r truncated SVD it encodes, ‖Ŵ_q − W_r‖ / ‖W_r‖, for each variant
//! (balanced σ or not, clipping search or max-abs). docs/QUALITY.md.
//!
//! cargo run --release --example sk32_quant_explore -- MODEL.gguf [rank]

use rknot::backend;
use rknot::encode::linalg::Mat;
use rknot::encode::sk32::{Sk32Options, sketch_matrix};
use rknot::format::sk32::{dequant_sigma, dequant_uv};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let b = backend::open(std::path::Path::new(&args[1]), None)?;
    let rank: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let names = [
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.10.ffn_down.weight",
        "blk.20.ffn_gate.weight",
        "blk.29.attn_output.weight",
    ];
    for (label, balance, clip, refit) in [
        ("plain", false, false, false),
        ("clip", false, true, false),
        ("balance", true, false, false),
        ("balance+clip", true, true, false),
        ("refit", false, false, true),
        ("refit+clip", false, true, true),
    ] {
        let (mut num, mut den) = (0f64, 0f64);
        let (mut tot, mut wn, mut svd_err) = (0f64, 0f64, 0f64);
        for name in names {
            let i = b.find(name)?;
            let t = &b.tensors().entries()[i];
            let (m, n) = (t.shape[0] as usize, t.shape[1] as usize);
            let mut w = vec![0f32; m * n];
            b.read_f32(i, 0, &mut w)?;
            let o = Sk32Options {
                rank: Some(rank),
                balance,
                clip_search: clip,
                refit,
                ..Default::default()
            };
            // The exact truncated SVD the sketch encodes (same seed).
            let a = Mat::from_f32(m, n, &w);
            let mut svd = rknot::encode::linalg::randomized_svd(
                &a,
                rank,
                o.oversample,
                o.power_iters,
                o.seed,
            );
            svd.truncate(rank);
            let wr = svd.reconstruct();
            let s = sketch_matrix(name, &w, m, n, &o)?.sketch;
            let r = s.rank as usize;
            for row in 0..m {
                let coef: Vec<f64> = (0..r)
                    .map(|k| {
                        f64::from(dequant_uv(s.u_q8[row * r + k], s.u_max))
                            * f64::from(dequant_sigma(s.sigma_q8[k], s.sigma_max))
                    })
                    .collect();
                for col in 0..n {
                    let q: f64 = (0..r)
                        .map(|k| coef[k] * f64::from(dequant_uv(s.v_q8[k * n + col], s.v_max)))
                        .sum();
                    let x = wr.at(row, col);
                    num += (q - x).powi(2);
                    den += x * x;
                    let y = f64::from(w[row * n + col]);
                    tot += (q - y).powi(2);
                    wn += y * y;
                    svd_err += (x - y).powi(2);
                }
            }
        }
        println!(
            "rank {rank} {label:<13} vs exact rank-{rank} SVD: {:.5}   vs W: {:.5} (unquantized SVD: {:.5})",
            (num / den).sqrt(),
            (tot / wn).sqrt(),
            (svd_err / wn).sqrt()
        );
    }
    Ok(())
}
