//! The engine views through real FUSE mounts: `model.safetensors` read by
//! the Python `safetensors` package, `model.gguf` by gguf-py's GGUFReader,
//! `.f16`/`.bf16` files and the F16/BF16 safetensors against numpy's
//! conversions, and byte-exact reads that straddle every boundary.
//!
//! Needs root + fuse3 (like tests/mount.rs) and python3 with numpy,
//! safetensors and gguf (tools/test.sh installs them). Without FUSE or the
//! Python packages the tests skip with a note, unless RKNOT_REQUIRE_FUSE is
//! set (CI), where they fail.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use common::mount::{MountGuard, Mounted, background_pid, fuse_available, mount_bin};
use common::*;
use rknot::backend::{self, Backend, Role};
use rknot::format::gguf::{GgufFile, write_gguf};
use rknot::format::meta::{MetaValue, Metadata};
use rknot::fs::views;
use rknot::quant::GgmlType;
use rknot::source::SourceFile;

/// `name sha256 shape` per line -> name -> (sha, shape).
fn parse_hashes(out: &str) -> HashMap<String, (String, String)> {
    out.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ' ');
            Some((
                it.next()?.to_string(),
                (it.next()?.to_string(), it.next()?.to_string()),
            ))
        })
        .collect()
}

fn shape_text(shape: &[u64]) -> String {
    format!(
        "[{}]",
        shape
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    )
}

/// Every tensor of a safetensors file through safe_open(framework="numpy"):
/// `name sha256 shape` lines, then `META <json>` with `__metadata__`.
const SAFETENSORS_HASHES: &str = r#"
import sys, json, hashlib
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as f:
    for k in f.keys():
        a = f.get_tensor(k)
        assert a.dtype.str == "<f4", (k, a.dtype)
        print(k, hashlib.sha256(a.tobytes()).hexdigest(), json.dumps(list(a.shape)).replace(" ", ""))
    print("META", json.dumps(f.metadata()))
"#;

/// gguf-py over the view (argv[1]) and its source (argv[2]): every
/// key/value equal (types and contents, in order) except general.file_type
/// (0 in the view) and general.alignment; every tensor F32 with the
/// source's name and ne dims at an aligned offset. Prints `name sha256 ne`.
const GGUF_CHECK: &str = r#"
import sys, json, hashlib
from gguf import GGUFReader, GGMLQuantizationType
view, src = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
skip = {"general.file_type", "general.alignment"}
def kvs(r):
    return [(k, [t.name for t in f.types], f.contents()) for k, f in r.fields.items()
            if not k.startswith("GGUF.") and k not in skip]
a, b = kvs(view), kvs(src)
assert [k for k, _, _ in a] == [k for k, _, _ in b], "key order"
for x, y in zip(a, b):
    assert x == y, (x[0], x[1], y[1], str(x[2])[:200], str(y[2])[:200])
assert view.fields["general.file_type"].contents() == 0
align = view.fields["general.alignment"].contents() if "general.alignment" in view.fields else 32
srcalign = src.fields["general.alignment"].contents() if "general.alignment" in src.fields else 32
assert align == srcalign, (align, srcalign)
assert [t.name for t in view.tensors] == [t.name for t in src.tensors]
for t, s in zip(view.tensors, src.tensors):
    assert t.tensor_type == GGMLQuantizationType.F32, t.name
    assert list(t.shape) == list(s.shape), (t.name, t.shape, s.shape)
    assert (t.data_offset - view.data_offset) % align == 0, t.name
    print(t.name, hashlib.sha256(t.data.tobytes()).hexdigest(), json.dumps([int(x) for x in t.shape]).replace(" ", ""))
print("KEYS", len(a))
"#;

needs! { [model, fuse]
fn smollm2_safetensors_and_gguf_views_read_back() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&model, &[]);
    let b = backend::open(&model, None).unwrap();
    let reference = smollm2_reference();

    // safetensors: every tensor equal to gguf-py's dequantization (which
    // `rknot cat` matches bit for bit, tests/smollm2.rs), shapes outer-first.
    let Some(out) = python(SAFETENSORS_HASHES, &[&m.path("model.safetensors")]) else {
        return;
    };
    let got = parse_hashes(&out);
    assert_eq!(got.len() - 1, reference.len(), "every tensor (+ META)");
    for r in &reference {
        let (sha, shape) = &got[&r.name];
        assert_eq!(sha, &r.sha256, "{} (safetensors)", r.name);
        let served: Vec<u64> = r.ne.iter().rev().copied().collect();
        assert_eq!(shape, &shape_text(&served), "{}", r.name);
    }
    // `rknot cat` itself, for a few.
    for name in [
        "token_embd.weight",
        "blk.3.ffn_down.weight",
        "output_norm.weight",
    ] {
        let cat = Command::new(rknot_bin())
            .arg("cat")
            .arg(&model)
            .arg(name)
            .output()
            .unwrap();
        assert!(cat.status.success());
        assert_eq!(sha256_hex(&cat.stdout), got[name].0, "{name} vs rknot cat");
    }
    // __metadata__: every key/value of the model, as strings.
    let meta_line = out.lines().find_map(|l| l.strip_prefix("META ")).unwrap();
    let meta: HashMap<String, String> = serde_json::from_str(meta_line).unwrap();
    let md = &b.summary().metadata;
    assert_eq!(meta.len(), md.len());
    for (k, v) in &md.entries {
        assert_eq!(meta[k], views::meta_string(v), "{k}");
    }
    assert_eq!(meta["llama.block_count"], "30");
    let tokens: Vec<String> = serde_json::from_str(&meta["tokenizer.ggml.tokens"]).unwrap();
    assert_eq!(tokens.len(), 49152);

    // GGUF: key/values and tensors through gguf-py.
    let Some(out) = python(GGUF_CHECK, &[&m.path("model.gguf"), &model]) else {
        return;
    };
    let got = parse_hashes(&out);
    assert_eq!(got.len(), reference.len());
    let n_keys = b
        .summary()
        .metadata
        .entries
        .iter()
        .filter(|(k, _)| k != "general.file_type" && k != "general.alignment")
        .count();
    assert!(out.contains(&format!("\nKEYS {n_keys}\n")), "{out}");
    for r in &reference {
        let (sha, ne) = &got[&r.name];
        assert_eq!(sha, &r.sha256, "{} (gguf view)", r.name);
        assert_eq!(ne, &shape_text(&r.ne), "{}", r.name);
    }
    let ctl = m.ctl();
    assert!(ctl.contains("errors 0"), "{ctl}");
}
}

needs! { [model, fuse]
fn sk32_over_gguf_views_read_back() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sk = smollm2_sketch(&model, dir.path());
    let layered = backend::open(&sk, Some(&model)).unwrap();
    let m = Mounted::new(&sk, &["--dense", model.to_str().unwrap()]);
    let want: HashMap<String, String> = layered
        .tensors()
        .entries()
        .iter()
        .map(|t| {
            (
                t.name.dot.clone(),
                sha256_hex(&decode_bytes(layered.as_ref(), &t.name.dot)),
            )
        })
        .collect();
    assert_eq!(want.len(), 272);
    let Some(st) = python(SAFETENSORS_HASHES, &[&m.path("model.safetensors")]) else {
        return;
    };
    let st = parse_hashes(&st);
    for (name, sha) in &want {
        assert_eq!(&st[name].0, sha, "{name} (safetensors)");
    }
    // model.gguf (gguf-py reads this layout in the test above): the
    // fallback's key/values and tensor table, the layered tensors' values.
    let view = SourceFile::open(&m.path("model.gguf")).unwrap();
    let g = GgufFile::read(&view).unwrap();
    let fb = GgufFile::read(&SourceFile::open(&model).unwrap()).unwrap();
    assert_eq!(g.metadata.len(), fb.metadata.len());
    for ((k, v), (fk, fv)) in g.metadata.entries.iter().zip(&fb.metadata.entries) {
        assert_eq!(k, fk);
        if k == "general.file_type" {
            assert_eq!(v, &MetaValue::U32(0));
        } else {
            assert_eq!(v, fv, "{k}");
        }
    }
    assert_eq!(g.alignment, fb.alignment);
    assert_eq!(g.tensors.len(), fb.tensors.len());
    for (t, f) in g.tensors.iter().zip(&fb.tensors) {
        assert_eq!((&t.name, &t.dims, t.ty), (&f.name, &f.dims, GgmlType::F32));
        let bytes = view.read_vec(t.offset, t.n_bytes, "tensor").unwrap();
        assert_eq!(sha256_hex(&bytes), want[&t.name], "{} (gguf)", t.name);
    }
    // The sketched tensors are the primary's, as `rknot cat` serves them;
    // the vocab table is the fallback's.
    for name in [
        "blk.0.attn_q.weight",
        "blk.0.attn_output.weight",
        "token_embd.weight",
    ] {
        let cat = Command::new(rknot_bin())
            .arg("cat")
            .arg(&sk)
            .arg(name)
            .arg("--dense")
            .arg(&model)
            .output()
            .unwrap();
        assert!(cat.status.success());
        assert_eq!(sha256_hex(&cat.stdout), st[name].0, "{name} vs rknot cat");
    }
    let dense = backend::open_single(&model, Role::Fallback).unwrap();
    assert_eq!(
        st["token_embd.weight"].0,
        sha256_hex(&decode_bytes(dense.as_ref(), "token_embd.weight"))
    );
    assert_ne!(
        st["blk.0.attn_q.weight"].0,
        sha256_hex(&decode_bytes(dense.as_ref(), "blk.0.attn_q.weight")),
        "served from the sketch"
    );
}
}

/// Expected bytes of a safetensors view: its header as the mount serves it
/// (checked against the format's rules here), then each tensor's bytes
/// from the backend, in `fmt`, in header order.
fn expected_safetensors(header_and_more: &[u8], b: &dyn Backend, fmt: &str) -> Vec<u8> {
    let n = u64::from_le_bytes(header_and_more[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0, "header padded to 8");
    let text = std::str::from_utf8(&header_and_more[8..8 + n]).unwrap();
    assert!(text.starts_with('{'));
    let json_end = text.trim_end_matches(' ').len();
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text[..json_end]).unwrap();
    let mut out = header_and_more[..8 + n].to_vec();
    let mut off = 0u64;
    for (name, e) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let o = e["data_offsets"].as_array().unwrap();
        assert_eq!(o[0].as_u64().unwrap(), off, "{name}: contiguous, in order");
        let f32s = decode_bytes(b, name);
        let bytes: Vec<u8> = match fmt {
            "F32" => f32s,
            "F16" => f32s
                .chunks(4)
                .flat_map(|c| {
                    half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                })
                .collect(),
            _ => unreachable!(),
        };
        assert_eq!(e["dtype"], fmt);
        off += bytes.len() as u64;
        assert_eq!(o[1].as_u64().unwrap(), off, "{name}");
        out.extend_from_slice(&bytes);
    }
    assert_eq!(header.len(), b.tensors().len() + 1, "names unique");
    out
}

/// Reads at and around every boundary (header/data, tensor/tensor,
/// padding) and at random, against the expected bytes; past EOF is empty.
fn check_reads(path: &Path, want: &[u8], boundaries: &[u64]) {
    let f = std::fs::File::open(path).unwrap();
    let len = want.len() as u64;
    assert_eq!(f.metadata().unwrap().len(), len, "{}", path.display());
    let mut cases: Vec<(u64, usize)> = Vec::new();
    for &b in boundaries {
        for (back, n) in [(1u64, 2usize), (3, 8), (5, 4096), (4096, 8192), (0, 1)] {
            cases.push((b.saturating_sub(back), n));
        }
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..200 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        cases.push((x % len, (x >> 44) as usize % 300_000 + 1));
    }
    for (off, n) in cases {
        let mut buf = vec![0u8; n];
        let got = f.read_at(&mut buf, off).unwrap();
        let end = (off + n as u64).min(len) as usize;
        assert_eq!(
            &buf[..got],
            &want[off.min(len) as usize..end],
            "{} at {off}+{n}",
            path.display()
        );
    }
    let mut buf = [0u8; 16];
    assert_eq!(f.read_at(&mut buf, len).unwrap(), 0, "read at EOF");
    assert_eq!(
        f.read_at(&mut buf, len + 12345).unwrap(),
        0,
        "read past EOF"
    );
    assert_eq!(std::fs::read(path).unwrap(), want, "whole file");
}

/// Tensor boundaries of a safetensors view.
fn safetensors_boundaries(want: &[u8]) -> Vec<u64> {
    let n = u64::from_le_bytes(want[..8].try_into().unwrap());
    let text = std::str::from_utf8(&want[8..8 + n as usize]).unwrap();
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text.trim_end_matches(' ')).unwrap();
    let mut v = vec![0, 8, 8 + n];
    for e in header.values().filter(|e| e.get("data_offsets").is_some()) {
        v.push(8 + n + e["data_offsets"][0].as_u64().unwrap());
    }
    v.push(want.len() as u64);
    v
}

needs! { [fuse]
fn view_reads_straddle_every_boundary() {
    if !fuse_available() {
        return;
    }
    let (src, dense) = (demo_path("tiny-llama.rknot"), demo_path("tiny-llama.gguf"));
    let b = backend::open(&src, Some(&dense)).unwrap();
    // Small chunks and cache: reads span many chunks and evictions happen.
    let m = Mounted::new(
        &src,
        &[
            "--dense",
            dense.to_str().unwrap(),
            "--views",
            "f32,f16",
            "--cache-mb",
            "1",
            "-o",
            "chunk_kb=16",
        ],
    );
    for (name, fmt) in [
        ("model.safetensors", "F32"),
        ("model.f16.safetensors", "F16"),
    ] {
        let mut head = vec![0u8; 1 << 16];
        let n = std::fs::File::open(m.path(name))
            .unwrap()
            .read_at(&mut head, 0)
            .unwrap();
        let want = expected_safetensors(&head[..n], b.as_ref(), fmt);
        check_reads(&m.path(name), &want, &safetensors_boundaries(&want));
    }

    // model.gguf is the GGUF that write_gguf makes of the decoded tensors,
    // with the fallback's key/values (file_type 0).
    let fallback_md: &Metadata = &b.fallback_summary().unwrap().metadata;
    let (md, align) = views::gguf_metadata(fallback_md).unwrap();
    assert_eq!(md.get("general.file_type"), Some(&MetaValue::U32(0)));
    let data = decoded_f32_tensors(b.as_ref());
    let tensors = as_f32_gguf(&data);
    let mut want = Vec::new();
    write_gguf(&mut want, &md, &tensors, align).unwrap();
    let (header, offsets) = rknot::format::gguf::encode_header(
        &md,
        &tensors
            .iter()
            .map(|(n, ne, t, _)| (n.clone(), ne.clone(), *t))
            .collect::<Vec<_>>(),
        align,
    )
    .unwrap();
    let h = header.len() as u64;
    let mut bounds = vec![0, 4, 24, h];
    for ((_, _, d), off) in data.iter().zip(&offsets) {
        bounds.push(h + off);
        bounds.push(h + off + d.len() as u64);
    }
    bounds.push(want.len() as u64);
    check_reads(&m.path("model.gguf"), &want, &bounds);

    let ctl = m.ctl();
    assert!(ctl.contains("errors 0"), "{ctl}");
    assert!(ctl.contains("view:      model.gguf (F32"), "{ctl}");
}
}

/// f16 and bf16 against numpy: `astype(float16)` for f16; for bf16 (which
/// numpy lacks) round-to-nearest-even on the f32 bits in numpy integer
/// arithmetic. On SmolLM2's tensors, and on a tensor of chosen values:
/// ties, overflow to inf, subnormals, every exponent.
const HALF_CHECK: &str = r#"
import sys, json, struct
import numpy as np
from safetensors import safe_open
mp = sys.argv[1]
names = json.loads(sys.argv[2])
def bf16_bits(a):
    u = a.view("<u4").astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    # A NaN keeps its sign and payload's high bits, signalling or not (the
    # bits a bf16 source's NaN had); the quiet bit only where the payload
    # would vanish (it must stay a NaN): fs::elem::keep_nans.
    nan = np.isnan(a)
    h = (u[nan] >> 16).astype(np.uint16)
    r[nan] = np.where(h & 0x7F == 0, h | 0x40, h)
    return r
def check(name, a):
    h = np.fromfile(f"{mp}/{name}.f16", "<u2")
    want = a.astype("<f2").view("<u2")
    ok = ~np.isnan(a)
    assert np.array_equal(h[ok], want[ok]), name
    assert np.isnan(h.view("<f2")[~ok]).all(), name
    g = np.fromfile(f"{mp}/{name}.bf16", "<u2")
    assert np.array_equal(g, bf16_bits(a)), name
n = 0
for name in names:
    a = np.fromfile(f"{mp}/{name}.f32", "<f4")
    check(name, a)
    n += a.size
# The F16 safetensors through safe_open: every entry's dtype and shape, and
# the chosen tensors' values.
with safe_open(f"{mp}/model.f16.safetensors", framework="numpy") as f:
    keys = list(f.keys())
    for k in keys:
        assert f.get_slice(k).get_dtype() == "F16", k
    for k in names:
        a = np.fromfile(f"{mp}/{k}.f32", "<f4").reshape(f.get_slice(k).get_shape())
        t = f.get_tensor(k)
        assert t.dtype == np.float16 and t.shape == a.shape, k
        ok = ~np.isnan(a)
        assert np.array_equal(t.view("<u2")[ok], a.astype("<f2").view("<u2")[ok]), k
# The BF16 one (numpy has no bfloat16): its header by hand, the chosen
# tensors' bytes at their offsets.
with open(f"{mp}/model.bf16.safetensors", "rb") as f:
    hn = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(hn))
    assert sorted(k for k in header if k != "__metadata__") == sorted(keys)
    for k in names:
        e = header[k]
        assert e["dtype"] == "BF16", k
        lo, hi = e["data_offsets"]
        f.seek(8 + hn + lo)
        got = np.frombuffer(f.read(hi - lo), "<u2")
        assert np.array_equal(got, bf16_bits(np.fromfile(f"{mp}/{k}.f32", "<f4"))), k
print("OK", n)
"#;

needs! { [fuse]
fn half_precision_views_match_numpy() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Every exponent and sign, plus values exactly halfway between two f16
    // (and two bf16) numbers, the f16 overflow edge, subnormals, inf, NaN.
    let mut vals: Vec<f32> = (0..65536u32)
        .map(|i| f32::from_bits(i.wrapping_mul(65537).wrapping_add(i >> 3)))
        .collect();
    for e in -24..16 {
        let one = 2f32.powi(e);
        vals.extend([
            one * (1.0 + 1.0 / 2048.0),
            one * (1.0 + 3.0 / 2048.0),
            one * (1.0 + 1.0 / 256.0),
            one * (1.0 + 3.0 / 256.0),
            -one * (1.0 + 1.0 / 2048.0),
        ]);
    }
    vals.extend([
        65504.0,
        65519.99,
        65520.0,
        1e9,
        -1e-30,
        f32::INFINITY,
        f32::NAN,
    ]);
    vals.resize(vals.len().next_multiple_of(64), 0.0);
    let bytes = f32_le_bytes(&vals);
    let path = dir.path().join("special.gguf");
    let mut out = Vec::new();
    write_gguf(
        &mut out,
        &Metadata::default(),
        &[(
            "special.weight".to_string(),
            vec![64, vals.len() as u64 / 64],
            GgmlType::F32,
            &bytes[..],
        )],
        32,
    )
    .unwrap();
    std::fs::write(&path, out).unwrap();
    let m = Mounted::new(&path, &["--views", "f32,f16,bf16"]);
    // (None: a Python module is missing outside CI; python() noted the skip.)
    if let Some(out) = python(HALF_CHECK, &[&m.mp, Path::new("[\"special.weight\"]")]) {
        assert!(out.starts_with("OK "), "{out}");
    }
    // No run metadata: safetensors yes, gguf no, and index.json says why.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    let files = index["views"]["files"].as_array().unwrap();
    let gguf = files.iter().find(|f| f["name"] == "model.gguf").unwrap();
    assert_eq!(gguf["available"], false);
    assert!(
        gguf["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("general.architecture")
    );
    assert!(!m.path("model.gguf").exists());
    assert!(m.path("model.bf16.safetensors").exists());
    drop(m);

    let Some(model) = smollm2() else { return };
    let m = Mounted::new(&model, &["-o", "views=f32,f16,bf16"]);
    let names = serde_json::to_string(&[
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_norm.weight",
        "blk.17.ffn_down.weight",
        "blk.29.attn_v.weight",
        "output_norm.weight",
    ])
    .unwrap();
    if let Some(out) = python(HALF_CHECK, &[&m.mp, Path::new(&names)]) {
        assert!(out.starts_with("OK "), "{out}");
    }
}
}

needs! { [fuse]
fn views_option_and_namespace() {
    if !fuse_available() {
        return;
    }
    let gguf = demo_path("tiny-llama.gguf");
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    // A bad --views or -o views= is a usage error (2, README: a bad `-o`
    // value exits 2). Nothing is mounted.
    for (args, code) in [
        (vec!["--views", "f32,f64"], 2),
        (vec!["-o", "views=f32,f64"], 2),
        (vec!["-o", "views=f16,fp8"], 2),
    ] {
        let o = Command::new(mount_bin())
            .arg(&gguf)
            .arg(&empty)
            .args(&args)
            .output()
            .unwrap();
        // Should it mount after all, unmount it and stop the daemon when an
        // assertion below fails.
        let _guard = MountGuard::new(&empty, background_pid(&String::from_utf8_lossy(&o.stdout)));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains("unknown view"), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);

    let m = Mounted::new(&gguf, &[]);
    let names: Vec<String> = std::fs::read_dir(&m.mp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.contains(&"model.safetensors".to_string()));
    assert!(names.contains(&"model.gguf".to_string()));
    assert!(
        !names
            .iter()
            .any(|n| n.ends_with(".f16") || n.ends_with(".bf16"))
    );
    assert!(!names.iter().any(|n| n.contains("f16.safetensors")));
    use std::os::unix::fs::MetadataExt;
    let st = std::fs::metadata(m.path("model.safetensors")).unwrap();
    let gg = std::fs::metadata(m.path("model.gguf")).unwrap();
    assert_eq!((st.ino(), gg.ino()), (4, 5));
    assert_eq!(st.mode() & 0o7777, 0o444);
    let f32_ino = std::fs::metadata(m.path("blk.0.attn_q.weight.f32"))
        .unwrap()
        .ino();
    drop(m);

    let m = Mounted::new(&gguf, &["-o", "views=f16", "-o", "allow_other"]);
    let f16 = std::fs::metadata(m.path("blk_0_attn_q_weight.f16")).unwrap();
    assert_eq!(f16.ino(), f32_ino + (1 << 32), "stable inode scheme");
    assert_eq!(f16.nlink(), 2);
    assert_eq!(
        std::fs::metadata(m.path("blk.0.attn_q.weight.f32"))
            .unwrap()
            .ino(),
        f32_ino
    );
    assert_eq!(
        std::fs::metadata(m.path("model.f16.safetensors"))
            .unwrap()
            .ino(),
        6
    );
    assert!(!m.path("model.bf16.safetensors").exists());
    let ctl = m.ctl();
    assert!(ctl.contains("in f32,f16:"), "{ctl}");
    drop(m);

    // Mounting and reading only the views' headers decodes nothing (direct
    // I/O: the kernel reads no further than asked; no read-ahead threads,
    // which would decode the first tensor's first chunk for a reader that
    // starts at byte 0).
    let m = Mounted::new(&gguf, &["-o", "direct_io,views=f16,prefetch_threads=0"]);
    for name in ["model.safetensors", "model.f16.safetensors", "model.gguf"] {
        let f = std::fs::File::open(m.path(name)).unwrap();
        let mut head = [0u8; 8];
        f.read_at(&mut head, 0).unwrap();
        let n = if name.ends_with(".gguf") {
            4096 // the demo's GGUF header is 4.6 KiB
        } else {
            8 + u64::from_le_bytes(head) as usize
        };
        let mut buf = vec![0u8; n];
        assert_eq!(f.read_at(&mut buf, 0).unwrap(), n);
    }
    assert!(m.ctl().contains("bytes decoded 0,"), "{}", m.ctl());
}
}
