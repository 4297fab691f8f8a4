//! Measure .rknot encodings of SmolLM2 matrices under different settings:
//! relative Frobenius error and bits per weight per tensor kind. Used to
//! choose the faithful profile's block size, line axis and bit budget
//! (docs/QUALITY.md).
//!
//! cargo run --release --example rknot_explore -- MODEL.gguf [layers,comma,separated] [configs...]
//! config: profile:block:lines(h|o):target_bpw:clip(1|0), e.g. faithful:64:o:4.75:1

use std::path::PathBuf;

use rknot::backend;
use rknot::encode::output::OutputTarget;
use rknot::encode::rknot::{Profile, RknotOptions, encode_rknot};
use rknot::encode::{Progress, tensor_kind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model = PathBuf::from(&args[1]);
    let layers: Vec<String> = args.get(2).map_or(
        vec!["0".into(), "10".into(), "20".into(), "29".into()],
        |s| s.split(',').map(str::to_string).collect(),
    );
    let configs: Vec<String> = if args.len() > 3 {
        args[3..].to_vec()
    } else {
        vec!["faithful:64:o:4.75:1".into()]
    };
    let dense = backend::open(&model, None)?;
    let dir = tempfile::tempdir()?;
    for cfg in &configs {
        let p: Vec<&str> = cfg.split(':').collect();
        let mut o = RknotOptions {
            profile: Profile::parse(p[0]).ok_or("profile")?,
            block: p[1].parse()?,
            hidden_lines: p[2] == "h",
            target_bpw: p[3].parse()?,
            clip_search: p[4] == "1",
            ..RknotOptions::default()
        };
        if let Some(c) = p.get(5) {
            o.coverage = c.parse()?;
        }
        let glob = format!("blk.{{{}}}.*", layers.join(","));
        let _ = glob;
        let mut totals: std::collections::BTreeMap<String, (f64, f64, u64, u64)> =
            Default::default();
        for l in &layers {
            o.tensors = Some(format!("blk.{l}.*"));
            let out = dir.path().join(format!("x{l}.rknot"));
            let t0 = std::time::Instant::now();
            let target = OutputTarget::from_sources(&out, true, &dense.source_files())?;
            encode_rknot(dense.as_ref(), &target, &o, &Progress::default())?;
            let secs = t0.elapsed().as_secs_f64();
            let enc = backend::open_single(&out, backend::Role::Primary)?;
            for t in enc.tensors().entries() {
                let i = enc.find(&t.name.dot)?;
                let mut a = vec![0f32; t.n_elements as usize];
                enc.read_f32(i, 0, &mut a)?;
                let j = dense.find(&t.name.dot)?;
                let mut b = vec![0f32; t.n_elements as usize];
                dense.read_f32(j, 0, &mut b)?;
                let err: f64 = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| f64::from(x - y).powi(2))
                    .sum();
                let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
                let e = totals
                    .entry(tensor_kind(&t.name.dot).to_string())
                    .or_default();
                e.0 += err;
                e.1 += norm;
                e.2 += t.stored_bytes;
                e.3 += t.n_elements;
            }
            eprintln!("{cfg} layer {l}: {secs:.1}s");
        }
        let (mut e, mut n, mut s, mut c) = (0.0, 0.0, 0u64, 0u64);
        let mut line = String::new();
        for (k, v) in &totals {
            line += &format!(
                " {k}={:.4}@{:.2}",
                (v.0 / v.1).sqrt(),
                v.2 as f64 * 8.0 / v.3 as f64
            );
            e += v.0;
            n += v.1;
            s += v.2;
            c += v.3;
        }
        println!(
            "{cfg}: all={:.4}@{:.3}bpw |{line}",
            (e / n).sqrt(),
            s as f64 * 8.0 / c as f64
        );
    }
    Ok(())
}
