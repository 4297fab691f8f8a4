//! `rknot encode sk32 --calibration-stats STATS`: activation-weighted
//! sketches of the tiny demo model (STATS from `rknot calibrate`), lower
//! output error than the plain sketch at the same rank, and a STATS that
//! does not fit the model refused by name before anything is written.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;
use rknot::backend::{self, Backend};
use rknot::encode::output::OutputTarget;
use rknot::probe::calibrate::{CalibrationStats, Site, read_stats, write_stats};

const RANK: &str = "3";

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A STATS file of the tiny model (with Gram matrices) over 48 token ids.
fn tiny_stats(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.stats");
    tiny_calibration_stats(&path);
    path
}

fn encode(out: &Path, extra: &[&str]) -> Output {
    let model = demo_path("tiny-llama.gguf");
    let mut args = vec![
        "encode",
        "sk32",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--rank",
        RANK,
    ];
    args.extend_from_slice(extra);
    run_rknot(&args)
}

fn read_all(b: &dyn Backend, name: &str) -> Vec<f32> {
    let i = b.find(name).unwrap();
    let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
    b.read_f32(i, 0, &mut v).unwrap();
    v
}

/// Σ over the sketched matrices of tr(E G Eᵀ), E = W − Ŵ: the mean squared
/// output error over the calibration inputs (with `diagonal`, G's
/// off-diagonal terms dropped: Σ_j mean_sq_j Σ_i E_ij²).
fn output_error(sketch: &Path, stats: &CalibrationStats, diagonal: bool) -> f64 {
    let dense = backend::open(&demo_path("tiny-llama.gguf"), None).unwrap();
    let s = backend::open(sketch, None).unwrap();
    let mut total = 0.0;
    let mut matrices = 0;
    for t in s.tensors().entries() {
        let name = &t.name.dot;
        let kind = format!("{}.weight", rknot::encode::tensor_kind(name));
        let layer = rknot::encode::tensor_layer(name).unwrap() as usize;
        let site = Site::ALL
            .into_iter()
            .find(|x| x.feeds().contains(&kind.as_str()))
            .unwrap();
        let st = stats.site(layer, site).unwrap();
        let (w, w_hat) = (read_all(dense.as_ref(), name), read_all(s.as_ref(), name));
        let n = st.d;
        let g = st.gram.as_ref().unwrap();
        for (row, row_hat) in w.chunks(n).zip(w_hat.chunks(n)) {
            let e: Vec<f64> = row
                .iter()
                .zip(row_hat)
                .map(|(a, b)| f64::from(a - b))
                .collect();
            for i in 0..n {
                if diagonal {
                    total += st.mean_sq[i] * e[i] * e[i];
                } else {
                    let gi = &g[i * n..(i + 1) * n];
                    total += e[i]
                        * gi.iter()
                            .zip(&e)
                            .map(|(g, x)| f64::from(*g) * x)
                            .sum::<f64>();
                }
            }
        }
        matrices += 1;
    }
    assert!(matrices > 0);
    total
}

#[test]
fn activation_weighted_sketches_lower_the_output_error() {
    let dir = tempfile::tempdir().unwrap();
    let stats_path = tiny_stats(dir.path());
    let stats = read_stats(&stats_path).unwrap();
    let s = stats_path.to_str().unwrap();
    let plain = dir.path().join("plain.sk32");
    let diag = dir.path().join("diag.sk32");
    let gram = dir.path().join("gram.sk32");
    for (out, extra) in [
        (&plain, vec![]),
        (&diag, vec!["--calibration-stats", s]),
        (&gram, vec!["--calibration-stats", s, "--whiten", "gram"]),
    ] {
        let o = encode(out, &extra);
        let e = stderr(&o);
        assert!(o.status.success(), "{extra:?}: {e}");
        if !extra.is_empty() {
            assert!(e.contains("activation-weighted"), "{e}");
        }
    }
    let inspect = run_rknot(&["inspect", gram.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    let notes = v["source"]["notes"].to_string();
    assert!(notes.contains("whitened-gram"), "{notes}");

    let e_plain = output_error(&plain, &stats, true);
    let e_diag = output_error(&diag, &stats, true);
    eprintln!("diagonal output error: plain {e_plain:.5e}, diagonal whitening {e_diag:.5e}");
    assert!(e_diag < e_plain, "diagonal {e_diag} vs plain {e_plain}");
    let g_plain = output_error(&plain, &stats, false);
    let g_gram = output_error(&gram, &stats, false);
    eprintln!("Gram output error: plain {g_plain:.5e}, Gram whitening {g_gram:.5e}");
    assert!(g_gram < g_plain, "gram {g_gram} vs plain {g_plain}");
}

#[test]
fn a_stats_that_does_not_fit_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stats_path = tiny_stats(d);
    let stats = read_stats(&stats_path).unwrap();
    let n_layer = stats.layers.len();
    assert!(n_layer >= 2, "the tiny model has {n_layer} layers");
    let save = |name: &str, s: &CalibrationStats| -> PathBuf {
        let p = d.join(name);
        let target = OutputTarget {
            path: p.clone(),
            overwrite: false,
            mode: 0o644,
            sources: Vec::new(),
        };
        write_stats(s, &target).unwrap();
        p
    };
    // One layer short.
    let mut short = stats.clone();
    short.layers.truncate(n_layer - 1);
    let short = save("short.stats", &short);
    // Another model's width at the FFN down input of layer 0.
    let mut wide = stats.clone();
    for layer in &mut wide.layers {
        for s in layer.iter_mut() {
            s.gram = None;
        }
    }
    wide.meta.insert("gram".into(), "false".into());
    let no_gram = save("nogram.stats", &wide);
    let down = &mut wide.layers[0][Site::FfnDownIn as usize];
    down.d += 1;
    down.mean_sq.push(1.0);
    let wide = save("wide.stats", &wide);
    let model = demo_path("tiny-llama.gguf");
    let last = n_layer - 1;
    let missing = d.join("missing.stats");
    let cases: Vec<(Vec<&str>, Vec<String>)> = vec![
        (
            vec!["--calibration-stats", short.to_str().unwrap()],
            vec![format!("no blk.{last}."), "layers".into()],
        ),
        (
            vec!["--calibration-stats", wide.to_str().unwrap()],
            vec!["blk.0.ffn_down.weight".into(), "channels".into()],
        ),
        (
            vec![
                "--calibration-stats",
                no_gram.to_str().unwrap(),
                "--whiten",
                "gram",
            ],
            vec!["no Gram matrix".into(), "--gram".into()],
        ),
        (
            vec!["--calibration-stats", model.to_str().unwrap()],
            vec!["tiny-llama.gguf".into()],
        ),
        (
            vec!["--calibration-stats", missing.to_str().unwrap()],
            vec!["missing.stats".into()],
        ),
    ];
    let out = d.join("out.sk32");
    for (extra, needles) in cases {
        let o = encode(&out, &extra);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {e}");
        for needle in needles {
            assert!(e.contains(&needle), "{extra:?}: {e:?} lacks {needle:?}");
        }
        assert!(!e.contains("panicked"), "{extra:?}: {e}");
        assert!(!out.exists(), "{extra:?} wrote {out:?}");
    }
    // --whiten without statistics is a usage error.
    let o = encode(&out, &["--whiten", "gram"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!out.exists());
}
