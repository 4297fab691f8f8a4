//! Shared helpers for integration tests.
#![allow(dead_code)]

#[allow(unused_imports)]
pub(crate) use needs::needs;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rknot::backend::Backend;
use rknot::quant::GgmlType;
use sha2::{Digest, Sha256};

/// Whether the environment variable `name` is set to something other than
/// empty or "0" (the convention of RKNOT_REQUIRE_FUSE and
/// RKNOT_REQUIRE_MODEL).
pub fn env_flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Where tools/fetch-smollm2.sh puts the standard test model.
pub const SMOLLM2_REL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF, or `None` with a printed note when it is absent.
/// With `RKNOT_REQUIRE_MODEL=1` (set by tools/test.sh) a missing model fails
/// the test instead: CI must never skip the real-model checks silently.
/// Without it, tests that need the model are ignored at build time
/// (`rknot_no_model`, build.rs); this covers a binary run elsewhere than it
/// was built, or with `--ignored`.
pub fn smollm2() -> Option<PathBuf> {
    let p = std::env::var_os("RKNOT_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(SMOLLM2_REL));
    if p.is_file() {
        return Some(p);
    }
    if env_flag("RKNOT_REQUIRE_MODEL") {
        panic!(
            "SmolLM2 model required (RKNOT_REQUIRE_MODEL is set) but {} is missing; \
             run tools/fetch-smollm2.sh",
            p.display()
        );
    }
    eprintln!(
        "NOTE: skipping: SmolLM2 model not found at {} (run tools/fetch-smollm2.sh)",
        p.display()
    );
    None
}

/// The names of the entries of `dir`, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn f32_le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The committed per-tensor reference hashes of gguf-py's dequantization.
pub struct RefTensor {
    pub name: String,
    pub ty: String,
    pub ne: Vec<u64>,
    pub n_elements: u64,
    pub sha256: String,
}

pub fn smollm2_reference() -> Vec<RefTensor> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_dequant.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| RefTensor {
            name: t["name"].as_str().unwrap().to_string(),
            ty: t["type"].as_str().unwrap().to_string(),
            ne: t["ne"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect(),
            n_elements: t["n_elements"].as_u64().unwrap(),
            sha256: t["sha256"].as_str().unwrap().to_string(),
        })
        .collect()
}

pub fn rknot_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_rknot"))
}

/// Run the `rknot` binary with `args` and collect its output.
pub fn run_rknot(args: &[&str]) -> Output {
    Command::new(rknot_bin()).args(args).output().unwrap()
}

/// A file of the demo model that ships in demo/.
pub fn demo_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("demo")
        .join(name)
}

/// Tensor `name` of `b`, decoded, as little-endian f32 bytes.
pub fn decode_bytes(b: &dyn Backend, name: &str) -> Vec<u8> {
    let i = b.find(name).unwrap();
    let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
    b.read_f32(i, 0, &mut v).unwrap();
    f32_le_bytes(&v)
}

/// Every tensor of `b` decoded: (name, ggml `ne` (innermost first), f32
/// little-endian bytes), for writing as an F32 GGUF with [`as_f32_gguf`].
pub fn decoded_f32_tensors(b: &dyn Backend) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    b.tensors()
        .entries()
        .iter()
        .map(|t| {
            (
                t.name.dot.clone(),
                t.shape.iter().rev().copied().collect(),
                decode_bytes(b, &t.name.dot),
            )
        })
        .collect()
}

/// The tensor list `write_gguf` takes, every tensor F32.
pub fn as_f32_gguf(
    decoded: &[(String, Vec<u64>, Vec<u8>)],
) -> Vec<(String, Vec<u64>, GgmlType, &[u8])> {
    decoded
        .iter()
        .map(|(n, ne, d)| (n.clone(), ne.clone(), GgmlType::F32, &d[..]))
        .collect()
}

/// A synthetic GGUF at `path` of `n` Q8_0 tensors `t00.weight`.. of
/// 1024 x 256 weights each (random, from `seed`), architecture "test".
pub fn q8_0_gguf(path: &Path, n: usize, seed: u64) {
    use rknot::format::gguf::write_gguf;
    use rknot::format::meta::{MetaValue, Metadata};
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("test".into()));
    let mut rng = rknot::synth::Rng(seed);
    let (cols, rows) = (1024u64, 256u64);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|_| rknot::synth::ggml_blocks(GgmlType::Q8_0, cols * rows, 0.02, &mut rng))
        .collect();
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                format!("t{i:02}.weight"),
                vec![cols, rows],
                GgmlType::Q8_0,
                &d[..],
            )
        })
        .collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    write_gguf(&mut f, &md, &tensors, 32).unwrap();
}

/// Run a Python script (`python3 -c`, from PATH) with arguments and return
/// its stdout. `None` (the caller skips; a note is printed) when a module it
/// needs is missing and RKNOT_REQUIRE_FUSE is not set; any other failure,
/// or a missing module in CI, panics with the script's stderr.
pub fn python(script: &str, args: &[&Path]) -> Option<String> {
    let o = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3");
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        if err.contains("No module named") && !env_flag("RKNOT_REQUIRE_FUSE") {
            eprintln!("NOTE: skipping: {}", err.lines().last().unwrap_or_default());
            return None;
        }
        panic!("python3 failed:\n{err}");
    }
    Some(String::from_utf8(o.stdout).unwrap())
}
pub mod capability;
pub mod fault_proxy;
pub mod http_server;
pub mod mount;
pub mod needs;
pub mod s3;
pub mod users;

/// An SK32 with rank-8 sketches of a few SmolLM2 matrices (token_embd
/// included: the layered backend must serve it from the fallback).
pub fn smollm2_sketch(model: &std::path::Path, dir: &std::path::Path) -> PathBuf {
    let dense = rknot::backend::open_single(model, rknot::backend::Role::Fallback).unwrap();
    let mut sketches = Vec::new();
    for name in [
        "blk.0.attn_q.weight",
        "blk.0.attn_output.weight",
        "blk.4.ffn_up.weight",
        "token_embd.weight",
    ] {
        let i = dense.find(name).unwrap();
        let t = &dense.tensors().entries()[i];
        let (d_out, d_in) = (t.shape[0] as usize, t.shape[1] as usize);
        let mut w = vec![0f32; d_out * d_in];
        dense.read_f32(i, 0, &mut w).unwrap();
        let r = 8;
        let u: Vec<f32> = (0..d_out)
            .flat_map(|row| w[row * d_in..row * d_in + r].to_vec())
            .collect();
        let mut vt = vec![0f32; r * d_in];
        for k in 0..r {
            vt[k * d_in + k] = 1.0;
        }
        sketches.push(rknot::format::sk32::Sketch::quantize(
            &name.replace("attn_output", "attn_o"),
            d_out,
            d_in,
            &u,
            &vec![1.0; r],
            &vt,
        ));
    }
    let sk = dir.join("smol.sk32");
    let mut bytes = Vec::new();
    rknot::format::sk32::write_sk32(&mut bytes, "test", &sketches).unwrap();
    std::fs::write(&sk, bytes).unwrap();
    sk
}

/// The header and layer of a one-layer llama .rknot holding one tensor:
/// `spec`'s, encoded from `dense` (row-major `d_out x d_in`) under
/// `manifest` (`hidden_dim` is the manifest's `d`), for `write_rknot` or
/// `write_rknot_v2`.
pub fn one_tensor_rknot_parts(
    manifest: &rknot::format::rknot::Manifest,
    spec: rknot::format::rknot::TensorSpec,
    dense: &[f32],
) -> (
    rknot::format::rknot::ArchMeta,
    Vec<rknot::format::rknot::LayerOut>,
) {
    let blocks = spec.encode(manifest, dense);
    let arch = rknot::format::rknot::ArchMeta {
        arch: "llama".into(),
        hidden_dim: manifest.d,
        num_layers: 1,
        metadata: rknot::format::meta::Metadata::default(),
    };
    let layer = rknot::format::rknot::LayerOut {
        index: 0,
        manifest: manifest.clone(),
        tensors: vec![(spec, blocks)],
    };
    (arch, vec![layer])
}

/// [`one_tensor_rknot_parts`] written as a version-3 .rknot.
pub fn one_tensor_rknot(
    manifest: &rknot::format::rknot::Manifest,
    spec: rknot::format::rknot::TensorSpec,
    dense: &[f32],
) -> Vec<u8> {
    let (arch, layers) = one_tensor_rknot_parts(manifest, spec, dense);
    let mut bytes = Vec::new();
    rknot::format::rknot::write_rknot(&mut bytes, &arch, &layers).expect("write .rknot");
    bytes
}

/// 48 fixed token ids of the demo's tiny llama, as `--tokens` takes them.
pub fn tiny_calibration_ids() -> String {
    (0..48u32)
        .map(|i| ((i * 37 + 11) % 256).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// `rknot calibrate` of the demo's tiny llama on [`tiny_calibration_ids`]
/// (context 16, with Gram matrices), writing the STATS file `out`.
pub fn tiny_calibration_stats(out: &Path) {
    let ids = tiny_calibration_ids();
    let model = demo_path("tiny-llama.gguf");
    let o = run_rknot(&[
        "calibrate",
        model.to_str().unwrap(),
        "--tokens",
        &ids,
        "--ctx",
        "16",
        "--gram",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `rknot probe MODEL --prompt "The capital of France is" --top 1`: it
/// succeeds and its top candidate is " Paris".
pub fn assert_probe_answers_paris(model: &Path) {
    let o = run_rknot(&[
        "probe",
        model.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--top",
        "1",
    ]);
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    let first = text
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_else(|| panic!("no top-1 line: {text}"));
    assert!(first.contains("\" Paris\""), "{text}");
}
