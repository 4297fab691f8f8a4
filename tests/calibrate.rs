//! `rknot calibrate`: the statistics it writes against an independent
//! computation over the activations the probe's forward pass shows a
//! recorder (in Rust, and in numpy reading the STATS file with its own
//! parser), the hook's layer-0 input against the embeddings normed by
//! hand, and the CLI's errors.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;
use std::sync::Arc;

use common::*;
use rknot::probe::calibrate::{ActivationRecorder, Site, read_stats};
use rknot::probe::{KvCache, Model, Residency, WeightSource, open_source};

/// Every row the forward pass showed, per layer and site.
#[derive(Default)]
struct Capture {
    rows: HashMap<(usize, Site), Vec<Vec<f32>>>,
}

impl ActivationRecorder for Capture {
    fn record(&mut self, layer: usize, site: Site, x: &[f32], n: usize) {
        let d = x.len() / n;
        let rows = self.rows.entry((layer, site)).or_default();
        rows.extend(x.chunks_exact(d).map(<[f32]>::to_vec));
    }
}

const CTX: usize = 16;

/// 40 token ids of the tiny demo model's vocab (256): windows of 16, 16, 8.
fn tiny_ids() -> Vec<u32> {
    (0..40u32).map(|i| (i * 37 + 11) % 256).collect()
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn calibrate(args: &[&str]) -> Output {
    let mut a = vec!["calibrate"];
    a.extend_from_slice(args);
    run_rknot(&a)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn stats_match_an_independent_computation() {
    let dir = tempfile::tempdir().unwrap();
    let model_path = demo_path("tiny-llama.gguf");
    let stats_path = dir.path().join("tiny.stats");
    let ids = tiny_ids();
    let ids_s = ids_arg(&ids);
    let ctx_s = CTX.to_string();
    let o = calibrate(&[
        model_path.to_str().unwrap(),
        "--tokens",
        &ids_s,
        "--ctx",
        &ctx_s,
        "--gram",
        "--threads",
        "2",
        "-o",
        stats_path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "calibrate failed: {}", stderr(&o));
    let stats = read_stats(&stats_path).unwrap();
    assert_eq!(stats.tokens, ids.len() as u64);
    assert_eq!(stats.meta["format"], "rknot-calibration");
    assert_eq!(stats.meta["version"], "1");
    assert_eq!(stats.meta["windows"], "3");
    assert_eq!(stats.meta["gram"], "true");

    // The same windows through the library, every row captured.
    let src: Arc<dyn WeightSource> = Arc::from(open_source(&model_path, None, None).unwrap());
    let model = Model::load_with(src, Residency::Memory).unwrap();
    let c = model.config.clone();
    let mut cap = Capture::default();
    for w in ids.chunks(CTX) {
        let mut cache = KvCache::new(&c);
        model
            .forward_recorded(w, &mut cache, w.len()..w.len(), Some(&mut cap))
            .unwrap();
    }
    assert_eq!(stats.layers.len(), c.n_layer);

    // The hook's first input is what it claims: the embeddings, RMS-normed
    // and scaled by blk.0.attn_norm, computed here from the decoded tensors.
    let backend = rknot::backend::open_single(&model_path, rknot::backend::Role::Fallback).unwrap();
    let floats = |name: &str| -> Vec<f32> {
        decode_bytes(backend.as_ref(), name)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let (embd, norm) = (
        floats("token_embd.weight"),
        floats("blk.0.attn_norm.weight"),
    );
    let d = c.d_model;
    let first = &cap.rows[&(0, Site::AttnIn)];
    for (row, &t) in first.iter().zip(&ids) {
        let e = &embd[t as usize * d..(t as usize + 1) * d];
        let ms = e.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + f64::from(c.rms_eps)).sqrt();
        for ((&got, &v), &w) in row.iter().zip(e).zip(&norm) {
            let want = f64::from(v) * inv * f64::from(w);
            assert!(
                (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "layer-0 attention input {got} vs {want}"
            );
        }
    }

    // Every site: widths, mean squares and Gram matrices against f64 sums
    // of the captured rows; the rows go to files for numpy too.
    let widths = [
        (Site::AttnIn, d),
        (Site::AttnOutIn, c.q_dim()),
        (Site::FfnIn, d),
        (Site::FfnDownIn, c.d_ff),
    ];
    for layer in 0..c.n_layer {
        for (site, width) in widths {
            let rows = &cap.rows[&(layer, site)];
            let s = stats.site(layer, site).unwrap();
            let what = format!("blk.{layer}.{}", site.name());
            assert_eq!(rows.len(), ids.len(), "{what}: rows captured");
            assert_eq!(s.d, width, "{what}: width");
            let n = rows.len() as f64;
            for ch in 0..width {
                let want = rows.iter().map(|r| f64::from(r[ch]).powi(2)).sum::<f64>() / n;
                let got = s.mean_sq[ch];
                assert!(
                    (got - want).abs() <= 1e-9 * want.max(1e-30),
                    "{what}: mean_sq[{ch}] {got} vs {want}"
                );
            }
            let gram = s.gram.as_ref().unwrap();
            let mut scale = 0f64;
            let mut worst = 0f64;
            for i in 0..width {
                for j in 0..width {
                    let want = rows
                        .iter()
                        .map(|r| f64::from(r[i]) * f64::from(r[j]))
                        .sum::<f64>()
                        / n;
                    scale = scale.max(want.abs());
                    worst = worst.max((f64::from(gram[i * width + j]) - want).abs());
                }
            }
            assert!(
                worst <= 1e-5 * scale,
                "{what}: Gram off by {worst} (largest entry {scale})"
            );
            let flat: Vec<f32> = rows.iter().flatten().copied().collect();
            std::fs::write(dir.path().join(format!("{what}.f32")), f32_le_bytes(&flat)).unwrap();
        }
    }

    // numpy, reading the safetensors layout by hand.
    let script = r#"
import json, struct, sys
import numpy as np
path, acts = sys.argv[1], sys.argv[2]
b = open(path, "rb").read()
(n,) = struct.unpack("<Q", b[:8])
assert n % 8 == 0, n
h = json.loads(b[8:8 + n])
meta = h["__metadata__"]
assert meta["format"] == "rknot-calibration" and meta["version"] == "1", meta
data = b[8 + n:]
def arr(name):
    e = h[name]
    a, z = e["data_offsets"]
    dt = {"F64": "<f8", "F32": "<f4"}[e["dtype"]]
    return np.frombuffer(data[a:z], dtype=dt).reshape(e["shape"])
tokens = int(meta["tokens"])
worst = 0.0
for l in range(int(meta["layers"])):
    for site in json.loads(meta["sites"]):
        x = np.fromfile(f"{acts}/blk.{l}.{site}.f32", dtype="<f4").astype(np.float64)
        x = x.reshape(tokens, -1)
        ms = (x * x).mean(axis=0)
        g = x.T @ x / tokens
        got_ms, got_g = arr(f"blk.{l}.{site}.mean_sq"), arr(f"blk.{l}.{site}.gram")
        assert np.allclose(got_ms, ms, rtol=1e-9, atol=0), (l, site)
        err = np.abs(got_g - g).max() / np.abs(g).max()
        assert err < 1e-5, (l, site, err)
        worst = max(worst, err)
print(f"ok {worst:.2e}")
"#;
    let out = python(script, &[&stats_path, dir.path()])
        .expect("numpy is needed to check the STATS file independently");
    assert!(out.starts_with("ok"), "numpy: {out}");
    eprintln!("numpy agrees: largest relative Gram error {}", out.trim());
}

#[test]
fn output_is_atomic_and_not_replaced_without_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let model = demo_path("tiny-llama.gguf");
    let out = dir.path().join("s.stats");
    let ids = ids_arg(&tiny_ids());
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            model.to_str().unwrap().to_string(),
            "--tokens".into(),
            ids.clone(),
            "--ctx".into(),
            "8".into(),
            "-o".into(),
            out.to_str().unwrap().to_string(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |a: Vec<String>| calibrate(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(run(args(&[])).status.success());
    let first = read_stats(&out).unwrap();
    assert_eq!(first.meta["gram"], "false");
    assert!(first.layers.iter().flatten().all(|s| s.gram.is_none()));
    let o = run(args(&["--gram"]));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("exists"), "{}", stderr(&o));
    assert_eq!(read_stats(&out).unwrap().meta["gram"], "false");
    let o = run(args(&["--gram", "--overwrite"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(read_stats(&out).unwrap().meta["gram"], "true");
    // Only the output: no temporary files left behind.
    assert_eq!(listing(dir.path()), ["s.stats"]);
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = demo_path("tiny-llama.gguf");
    let m = model.to_str().unwrap();
    let out = d.join("out.stats");
    let o_s = out.to_str().unwrap();
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "\n  \n").unwrap();
    let text = d.join("text.txt");
    std::fs::write(&text, "Some calibration text.\n").unwrap();
    let missing = d.join("missing.txt");

    // Exit 1: the input is wrong, the message says which and why.
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![m, "--text", missing.to_str().unwrap(), "-o", o_s],
            "missing.txt",
        ),
        (
            vec![m, "--text", empty.to_str().unwrap(), "-o", o_s],
            "empty",
        ),
        // The tiny model has no BPE merges: a text cannot be tokenized.
        (
            vec![m, "--text", text.to_str().unwrap(), "-o", o_s],
            "tokenizer",
        ),
        (
            vec![text.to_str().unwrap(), "--tokens", "1,2", "-o", o_s],
            "text.txt",
        ),
        (vec![m, "--tokens", "1,256", "-o", o_s], "vocab"),
    ];
    for (args, needle) in cases {
        let o = calibrate(&args);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert!(e.contains(needle), "{args:?}: {e:?} lacks {needle:?}");
        assert!(!e.contains("panicked"), "{args:?}: {e}");
    }
    // Exit 2: usage.
    let usage: Vec<Vec<&str>> = vec![
        vec![m, "-o", o_s],
        vec![m, "--tokens", "1,2"],
        vec![m, "--tokens", "1,x", "-o", o_s],
        vec![m, "--tokens", "1,2", "--ctx", "1", "-o", o_s],
        vec![m, "--tokens", "1,2", "--max-tokens", "0", "-o", o_s],
        vec![
            m,
            "--tokens",
            "1,2",
            "--text",
            text.to_str().unwrap(),
            "-o",
            o_s,
        ],
    ];
    for args in usage {
        let o = calibrate(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    // Nothing was written.
    assert_eq!(listing(d), ["empty.txt", "text.txt"]);

    // A damaged STATS file is an error naming it, not a panic.
    assert!(
        calibrate(&[m, "--tokens", "1,2,3", "--gram", "-o", o_s])
            .status
            .success()
    );
    let bytes = std::fs::read(&out).unwrap();
    for cut in [0, 7, 8 + 16, bytes.len() / 2, bytes.len() - 1] {
        let p = d.join("cut.stats");
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let e = read_stats(&p).unwrap_err().to_string();
        assert!(e.contains("cut.stats"), "cut at {cut}: {e}");
    }
    let mut v2 = bytes.clone();
    let at = v2
        .windows(13)
        .position(|w| w == b"\"version\":\"1\"")
        .unwrap();
    v2[at + 11] = b'9';
    let p = d.join("v9.stats");
    std::fs::write(&p, &v2).unwrap();
    let e = read_stats(&p).unwrap_err().to_string();
    assert!(e.contains("version"), "{e}");
}

needs! { [model]
fn smollm2_over_the_committed_calibration_text() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smol.stats");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/calibration/python-idle-help.txt");
    let o = calibrate(&[
        model.to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--max-tokens",
        "64",
        "--ctx",
        "32",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = read_stats(&out).unwrap();
    assert_eq!(s.layers.len(), 30);
    assert_eq!(s.meta["text"], "python-idle-help.txt");
    assert_eq!(s.meta["windows"], "2");
    let (d, ff) = (576, 1536);
    for l in &s.layers {
        let widths: Vec<usize> = l.iter().map(|x| x.d).collect();
        assert_eq!(widths, [d, d, d, ff]);
        for x in l {
            assert!(x.mean_sq.iter().all(|v| v.is_finite() && *v >= 0.0));
            assert!(x.mean_sq.iter().any(|v| *v > 0.0));
        }
    }
}
}
