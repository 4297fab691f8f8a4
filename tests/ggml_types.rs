//! Every ggml type gguf-py 0.19 dequantizes, in a GGUF written by llama.cpp's
//! own `llama-quantize` (issue 23 item 3): every tensor, through `rknot cat`
//! and through a mount (both spellings of its file name), equals gguf-py's
//! `gguf.quants.dequantize` of that file bit for bit, `rknot inspect`
//! calls none of them unsupported, and tools/independent_reader.py's own
//! decoders agree with `rknot cat`.
//!
//! The model is tools/tiny_llama_gguf.py's: a random 2-layer llama-arch F32
//! GGUF written by gguf-py's GGUFWriter whose matrix rows are 256 or 512
//! wide, so that every matrix can take a 256-element super-block type
//! (SmolLM2's 576-wide rows would fall back to other types). One
//! `llama-quantize --pure` run gives each of its 16 matrices a type with
//! `--tensor-type`: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 and NVFP4 (this llama.cpp makes all
//! of them, so no type comes from gguf-py or random blocks here; the random
//! and hostile blocks are tests/ggml_vectors.rs's), the rest Q4_0. The
//! importance matrix the IQ1/IQ2 types require comes from `llama-imatrix`
//! on the same model (its byte-level vocabulary reads any text).
//!
//! Needs RKNOT_LLAMA_BIN (tools/llama-cpp.sh), FUSE, and python3 with
//! gguf==0.19.0 and numpy (tools/python-env.sh). About a minute, most of it
//! llama-quantize's IQ1 and IQ2_S grid set-up.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::mount::{Mounted, fuse_available};
use common::*;

/// The type each matrix gets (`--tensor-type` patterns are regexes).
const TENSOR_TYPES: &[(&str, &str)] = &[
    ("blk.0.attn_q", "iq1_s"),
    ("blk.0.attn_k", "iq1_m"),
    ("blk.0.attn_v", "iq2_xxs"),
    ("blk.0.attn_output", "iq2_xs"),
    ("blk.0.ffn_gate", "iq2_s"),
    ("blk.0.ffn_up", "iq3_xxs"),
    ("blk.0.ffn_down", "iq3_s"),
    ("blk.1.attn_q", "iq4_nl"),
    ("blk.1.attn_k", "iq4_xs"),
    ("blk.1.attn_v", "tq1_0"),
    ("blk.1.attn_output", "tq2_0"),
    ("blk.1.ffn_gate", "mxfp4"),
    ("blk.1.ffn_up", "nvfp4"),
];

/// gguf-py's view of a GGUF: per tensor, one line
/// `name type n_elements sha256(dequantize(...) as little-endian f32)`.
const REFERENCE: &str = r#"
import hashlib, sys
import numpy as np
import gguf
from gguf.quants import dequantize
r = gguf.GGUFReader(sys.argv[1])
for t in r.tensors:
    with np.errstate(invalid="ignore", over="ignore"):
        out = dequantize(t.data, t.tensor_type)
    out = np.ascontiguousarray(out, dtype="<f4").reshape(-1)
    assert out.size == int(t.n_elements), t.name
    print(t.name, t.tensor_type.name.lower(), out.size, hashlib.sha256(out.view(np.uint8)).hexdigest())
"#;

struct Reference {
    name: String,
    ty: String,
    n_elements: u64,
    sha256: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The llama.cpp bin directory; RKNOT_LLAMA_BIN is set (the test is
/// ignored at build time otherwise), so a missing tool fails.
fn llama_bin() -> PathBuf {
    let dir = PathBuf::from(
        std::env::var_os("RKNOT_LLAMA_BIN").expect("RKNOT_LLAMA_BIN is set (needs! llama_cpp)"),
    );
    for tool in ["llama-quantize", "llama-imatrix"] {
        assert!(
            dir.join(tool).is_file(),
            "RKNOT_LLAMA_BIN is set but {} is missing (tools/llama-cpp.sh builds it)",
            dir.join(tool).display()
        );
    }
    dir
}

fn run(cmd: &mut Command) {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Writes the tiny model, its importance matrix and its llama-quantize'd
/// copy into `dir`; returns the quantized file.
fn quantized_model(bin: &Path, dir: &Path) -> Option<PathBuf> {
    let f32_model = dir.join("tiny-f32.gguf");
    let script = root().join("tools/tiny_llama_gguf.py");
    let o = Command::new("python3")
        .arg(&script)
        .arg(&f32_model)
        .output()
        .expect("python3");
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        if err.contains("No module named") && !env_flag("RKNOT_REQUIRE_FUSE") {
            eprintln!("NOTE: skipping: {}", err.lines().last().unwrap_or_default());
            return None;
        }
        panic!("{}: {err}", script.display());
    }
    let imatrix = dir.join("imatrix.gguf");
    let text = root().join("tests/data/probe/gpl-3.0.txt");
    run(Command::new(bin.join("llama-imatrix"))
        .arg("-m")
        .arg(&f32_model)
        .arg("-f")
        .arg(&text)
        .args(["-c", "128", "--chunks", "4", "-t", "2", "-o"])
        .arg(&imatrix));
    let quantized = dir.join("tiny-mixed.gguf");
    let mut q = Command::new(bin.join("llama-quantize"));
    q.arg("--imatrix").arg(&imatrix).arg("--pure");
    for (tensor, ty) in TENSOR_TYPES {
        q.arg("--tensor-type")
            .arg(format!("{}={ty}", tensor.replace('.', r"\.")));
    }
    q.arg(&f32_model).arg(&quantized).args(["Q4_0", "2"]);
    run(&mut q);
    Some(quantized)
}

fn reference(model: &Path) -> Option<Vec<Reference>> {
    let out = python(REFERENCE, &[model])?;
    Some(
        out.lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                assert_eq!(f.len(), 4, "reference line {l:?}");
                Reference {
                    name: f[0].to_string(),
                    ty: f[1].to_string(),
                    n_elements: f[2].parse().unwrap(),
                    sha256: f[3].to_string(),
                }
            })
            .collect(),
    )
}

needs! { [llama_cpp, fuse]
fn llama_quantize_types_read_bit_exact_like_gguf_py() {
    let bin = llama_bin();
    if !fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some(model) = quantized_model(&bin, tmp.path()) else { return };
    let Some(refs) = reference(&model) else { return };

    // The file holds every type asked for, on the tensor asked for.
    for (tensor, ty) in TENSOR_TYPES {
        let name = format!("{tensor}.weight");
        let r = refs
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("{name} missing from the quantized file"));
        assert_eq!(&r.ty, ty, "{name}: llama-quantize stored another type");
    }

    let inspect = run_rknot(&["inspect", model.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(inspect.status.success(), "{}", String::from_utf8_lossy(&inspect.stderr));
    assert!(!text.contains("not supported"), "rknot inspect:\n{text}");
    for (_, ty) in TENSOR_TYPES {
        assert!(text.to_lowercase().contains(ty), "rknot inspect does not show {ty}:\n{text}");
    }

    for (i, r) in refs.iter().enumerate() {
        // Both spellings, alternating.
        let name = if i % 2 == 0 { r.name.clone() } else { r.name.replace('.', "_") };
        let out = run_rknot(&["cat", model.to_str().unwrap(), &name]);
        assert!(out.status.success(), "cat {name}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout.len() as u64, r.n_elements * 4, "cat {name} ({})", r.ty);
        assert_eq!(sha256_hex(&out.stdout), r.sha256, "cat {name} ({}) differs from gguf-py", r.ty);
    }

    let m = Mounted::new(&model, &[]);
    for r in &refs {
        for file in [format!("{}.f32", r.name), format!("{}.f32", r.name.replace('.', "_"))] {
            let bytes = std::fs::read(m.path(&file))
                .unwrap_or_else(|e| panic!("reading {file} from the mount: {e}\n{}", m.log()));
            assert_eq!(bytes.len() as u64, r.n_elements * 4, "{file} ({})", r.ty);
            assert_eq!(sha256_hex(&bytes), r.sha256, "{file} ({}) differs from gguf-py", r.ty);
        }
    }
    drop(m);

    // And the independent Python reader (its own decoders) agrees with `rknot cat`.
    run(Command::new("python3")
        .arg(root().join("tools/independent_reader.py"))
        .arg("check")
        .arg(&model)
        .arg("--rknot-bin")
        .arg(rknot_bin()));
}
}
