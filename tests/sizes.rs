//! Honest sizes: "bits per weight" is the whole file's bytes x 8 over the
//! parameters it serves, for every format, in `inspect` (text and JSON,
//! which index.json shares), `verify` and the encoder's last line; the
//! tensors' payload alone is given beside it, labelled as such.

mod common;

use std::path::Path;

use common::*;

fn json_of(args: &[&str]) -> serde_json::Value {
    let o = run_rknot(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn every_format_reports_whole_file_bits_per_weight() {
    for name in [
        "tiny-llama.gguf",
        "tiny-llama.knot",
        "tiny-llama.sk32",
        "tiny-llama.rknot",
    ] {
        let p = demo_path(name);
        let ps = p.to_str().unwrap();
        let j = json_of(&["inspect", "--json", ps]);
        let t = &j["totals"];
        let params = t["parameters"].as_u64().unwrap();
        let honest = file_len(&p) as f64 * 8.0 / params as f64;
        assert_eq!(t["file_bytes"].as_u64().unwrap(), file_len(&p), "{name}");
        assert!(
            close(t["bits_per_weight"].as_f64().unwrap(), honest),
            "{name}: {t}"
        );
        assert!(
            close(j["source"]["bits_per_weight"].as_f64().unwrap(), honest),
            "{name}"
        );
        let payload = t["stored_bytes"].as_u64().unwrap() as f64 * 8.0 / params as f64;
        assert!(close(
            t["payload_bits_per_weight"].as_f64().unwrap(),
            payload
        ));
        // The file holds more than its tensors' payloads.
        assert!(honest > payload, "{name}: {honest} <= {payload}");
        let text = String::from_utf8(run_rknot(&["inspect", ps]).stdout).unwrap();
        assert!(
            text.contains(&format!("size:      {honest:.3} bits per weight")),
            "{name}: {text}"
        );
        let v = json_of(&["verify", "--json", ps]);
        assert!(
            close(v["bits_per_weight"].as_f64().unwrap(), honest),
            "{name}: {v}"
        );
    }
}

/// Over a dense fallback: the compressed file's own figure (its bytes over
/// the parameters it serves) and the mount's (both files over everything
/// served).
#[test]
fn layered_sources_report_each_file_and_the_whole() {
    let (r, g) = (demo_path("tiny-llama.rknot"), demo_path("tiny-llama.gguf"));
    let j = json_of(&[
        "inspect",
        "--json",
        r.to_str().unwrap(),
        "--dense",
        g.to_str().unwrap(),
    ]);
    let src = &j["source"];
    let fb = &j["fallback"];
    let (pr, pf) = (
        src["parameters"].as_u64().unwrap(),
        fb["parameters"].as_u64().unwrap(),
    );
    assert!(pr > 0 && pf > 0);
    assert!(close(
        src["bits_per_weight"].as_f64().unwrap(),
        file_len(&r) as f64 * 8.0 / pr as f64
    ));
    assert!(close(
        fb["bits_per_weight"].as_f64().unwrap(),
        file_len(&g) as f64 * 8.0 / pf as f64
    ));
    let t = &j["totals"];
    assert_eq!(t["parameters"].as_u64().unwrap(), pr + pf);
    assert!(close(
        t["bits_per_weight"].as_f64().unwrap(),
        (file_len(&r) + file_len(&g)) as f64 * 8.0 / (pr + pf) as f64
    ));
}

#[test]
fn the_encoder_ends_with_the_honest_figure() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.rknot");
    let o = run_rknot(&[
        "encode",
        "rknot",
        "--profile",
        "faithful",
        "-o",
        out.to_str().unwrap(),
        demo_path("tiny-llama.gguf").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let j = json_of(&["inspect", "--json", out.to_str().unwrap()]);
    let params = j["totals"]["parameters"].as_u64().unwrap();
    let honest = file_len(&out) as f64 * 8.0 / params as f64;
    assert!(
        err.contains(&format!(
            "{} bytes, {params} parameters: {honest:.3} bits per weight",
            file_len(&out)
        )),
        "{err}"
    );
    assert!(err.contains("tensor payloads alone"), "{err}");
}
