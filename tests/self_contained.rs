//! A .rknot that stands alone (issue 11): `rknot encode rknot MODEL` with
//! its defaults stores every tensor the profile does not compress as its
//! ggml blocks verbatim, so the file alone serves the whole model: the
//! probe answers without `--dense`, a mount of it alone lists every tensor
//! and its `model.gguf` reads back through gguf-py, and the tensors it did
//! not compress are bit-exact with the source.

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::collections::HashMap;
use std::time::Duration;

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::backend::{self, StoredType};

/// A self-contained file of the tiny demo model, and one with
/// `--compressed-only`: the first serves all 21 tensors alone, the second
/// the 14 compressed matrices (vocabulary tables unavailable, as before);
/// both layer over the GGUF.
#[test]
fn tiny_model_self_contained_and_compressed_only() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = demo_path("tiny-llama.gguf");
    let full = dir.path().join("full.rknot");
    let only = dir.path().join("only.rknot");
    for (out, extra) in [(&full, vec![]), (&only, vec!["--compressed-only"])] {
        let mut args = vec![
            "encode",
            "rknot",
            gguf.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = run_rknot(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let dense = backend::open(&gguf, None).unwrap();
    let b = backend::open(&full, None).unwrap();
    assert_eq!(b.tensors().len(), dense.tensors().len());
    for t in dense.tensors().entries() {
        let i = b.find(&t.name.dot).unwrap();
        let e = &b.tensors().entries()[i];
        assert!(e.is_available(), "{}", t.name.dot);
        assert_eq!(e.shape, t.shape, "{}", t.name.dot);
        if matches!(e.stored, StoredType::Ggml(_)) {
            // Stored verbatim: the same type and the same decoded bytes.
            assert_eq!(e.stored, t.stored, "{}", t.name.dot);
            assert_eq!(
                decode_bytes(b.as_ref(), &t.name.dot),
                decode_bytes(dense.as_ref(), &t.name.dot),
                "{}",
                t.name.dot
            );
        }
    }
    let c = backend::open(&only, None).unwrap();
    assert_eq!(
        c.tensors()
            .entries()
            .iter()
            .filter(|t| t.is_available())
            .count(),
        14
    );
    // Layered over the GGUF, both serve the same model.
    let lf = backend::open(&full, Some(&gguf)).unwrap();
    let lo = backend::open(&only, Some(&gguf)).unwrap();
    for t in dense.tensors().entries() {
        assert_eq!(
            decode_bytes(lf.as_ref(), &t.name.dot),
            decode_bytes(lo.as_ref(), &t.name.dot),
            "{}",
            t.name.dot
        );
    }
}

/// gguf-py over the mount's model.gguf (argv[1]): every tensor F32, named
/// and shaped as in the source (argv[2]); prints `name sha256`.
const GGUF_VIEW: &str = r#"
import sys, hashlib
from gguf import GGUFReader, GGMLQuantizationType
view, src = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
shapes = {t.name: list(t.shape) for t in src.tensors}
assert sorted(t.name for t in view.tensors) == sorted(shapes), "tensor names"
for t in view.tensors:
    assert t.tensor_type == GGMLQuantizationType.F32, t.name
    assert list(t.shape) == shapes[t.name], (t.name, t.shape, shapes[t.name])
    print(t.name, hashlib.sha256(t.data.tobytes()).hexdigest())
"#;

needs! { [model]
/// The faithful profile (the calibrated default's own checks, slower and
/// larger in memory, are in tests/calibrated.rs).
fn smollm2_faithful_encode_stands_alone() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.rknot");
    let run = hostile::run_measured(
        &rknot_bin(),
        &[
            "encode",
            "rknot",
            model.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--profile",
            "faithful",
        ],
        Duration::from_secs(600),
    );
    assert_eq!(run.code(), Some(0), "{}", run.stderr);
    // Encoding in bounded memory: below the model's fp32 size (540 MB).
    let fp32_bytes = 134_515_008u64 * 4;
    assert!(
        run.max_rss < fp32_bytes,
        "encode peak RSS {} MiB >= the fp32 model's {} MiB",
        run.max_rss >> 20,
        fp32_bytes >> 20
    );
    eprintln!("encode peak RSS {} MiB", run.max_rss >> 20);

    // Honest size: file bytes x 8 / parameters served (all 272 tensors).
    let j: serde_json::Value =
        serde_json::from_slice(&run_rknot(&["inspect", "--json", out.to_str().unwrap()]).stdout)
            .unwrap();
    let t = &j["totals"];
    assert_eq!(t["tensors"], 272);
    assert_eq!(t["available"], 272);
    let len = std::fs::metadata(&out).unwrap().len();
    let params = t["parameters"].as_u64().unwrap();
    assert_eq!(params, 134_515_008);
    let bpw = t["bits_per_weight"].as_f64().unwrap();
    assert!((bpw - len as f64 * 8.0 / params as f64).abs() < 1e-9, "{t}");
    assert!(
        run.stderr.contains(&format!("{bpw:.3} bits per weight")),
        "{}",
        run.stderr
    );

    // The probe needs no --dense.
    assert_probe_answers_paris(&out);

    // A mount of the file alone serves every tensor and a model.gguf that
    // gguf-py reads; the uncompressed tensors are bit-exact with gguf-py's
    // dequantization of the source.
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&out, &[]);
    let reference = smollm2_reference();
    assert_eq!(reference.len(), 272);
    for r in &reference {
        let f = m.path(&format!("{}.f32", r.name));
        let len = std::fs::metadata(&f).map(|x| x.len());
        assert_eq!(len.ok(), Some(r.n_elements * 4), "{}", f.display());
    }
    let Some(out_py) = python(GGUF_VIEW, &[&m.path("model.gguf"), &model]) else {
        return;
    };
    let got: HashMap<&str, &str> = out_py.lines().filter_map(|l| l.split_once(' ')).collect();
    assert_eq!(got.len(), 272);
    let b = backend::open(&out, None).unwrap();
    let mut exact = 0;
    for r in &reference {
        let i = b.find(&r.name).unwrap();
        if matches!(b.tensors().entries()[i].stored, StoredType::Ggml(_)) {
            assert_eq!(got[r.name.as_str()], r.sha256, "{}", r.name);
            exact += 1;
        }
    }
    assert_eq!(exact, 62, "tensors stored verbatim");
}
}
