//! The Hugging Face view `hf/` through real mounts: its listing, config,
//! safetensors header and tensors (llama's Q/K rows un-permuted, checked
//! against a permutation computed here from llama.cpp's converter's
//! definition), a layered .rknot, qwen2 (not permuted), an architecture
//! without `hf/`; and, opt-in (`RKNOT_HF_PYTHON`, tools/hf-env.sh),
//! transformers itself: the model loaded from `MOUNT/hf` against
//! transformers' own GGUF loader (every tensor bit for bit), its logits
//! against `rknot probe`'s, and the tokenizer against transformers' GGUF
//! tokenizer and llama.cpp's ids; the `tokenizers` library loads every
//! tokenizer.json rendered for crafted tokenizers (duplicates, empty and
//! respelled tokens), and the ones it would refuse are not rendered.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::backend::{self, Backend};
use rknot::format::gguf;
use rknot::format::meta::MetaValue;
use rknot::quant::GgmlType;
use serde_json::Value;

fn probe_data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/probe")
        .join(name)
}

fn json_file(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// The safetensors header of `path`: name -> (dtype, shape, [start, end))
/// with offsets from the file's start, and `__metadata__`.
struct StHeader {
    tensors: HashMap<String, (String, Vec<u64>, u64, u64)>,
    meta: Value,
}

fn st_header(path: &Path) -> StHeader {
    let f = std::fs::File::open(path).unwrap();
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0).unwrap();
    let n = u64::from_le_bytes(n);
    let mut h = vec![0u8; n as usize];
    f.read_exact_at(&mut h, 8).unwrap();
    let v: Value = serde_json::from_slice(&h).unwrap();
    let mut tensors = HashMap::new();
    for (k, e) in v.as_object().unwrap() {
        if k == "__metadata__" {
            continue;
        }
        let shape = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let off = e["data_offsets"].as_array().unwrap();
        tensors.insert(
            k.clone(),
            (
                e["dtype"].as_str().unwrap().to_string(),
                shape,
                8 + n + off[0].as_u64().unwrap(),
                8 + n + off[1].as_u64().unwrap(),
            ),
        );
    }
    StHeader {
        tensors,
        meta: v["__metadata__"].clone(),
    }
}

fn read_range(path: &Path, start: u64, end: u64) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap();
    let mut v = vec![0u8; (end - start) as usize];
    f.read_exact_at(&mut v, start).unwrap();
    v
}

/// llama.cpp's converter permutes a Q/K weight of `rows` rows as
/// `w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2)`: its row
/// (h, i, j) is the original row (h, j, i). The original (Hugging Face)
/// tensor from the GGUF one, written out directly from that definition.
fn unpermute(gguf_rows: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    let rows = gguf_rows.len() / cols;
    let half = rows / n_head / 2;
    let mut out = vec![f32::NAN; gguf_rows.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let gguf_row = (h * half + i) * 2 + j;
                let hf_row = (h * 2 + j) * half + i;
                out[hf_row * cols..(hf_row + 1) * cols]
                    .copy_from_slice(&gguf_rows[gguf_row * cols..(gguf_row + 1) * cols]);
            }
        }
    }
    out
}

fn decode(b: &dyn Backend, name: &str) -> Vec<f32> {
    let i = b.find(name).unwrap();
    let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
    b.read_f32(i, 0, &mut v).unwrap();
    v
}

/// Reads of `path` at `[start, end)` in odd pieces (unaligned, straddling
/// rows and the tensor's ends within the file) equal `want`.
fn check_odd_reads(path: &Path, start: u64, want: &[u8]) {
    let f = std::fs::File::open(path).unwrap();
    let len = want.len() as u64;
    for (off, n) in [
        (0u64, 7u64),
        (3, 4096),
        (2301, 10),
        (len / 3 + 1, 100_003),
        (len - 5, 5),
        (1, len - 2),
    ] {
        let n = n.min(len - off);
        let mut got = vec![0u8; n as usize];
        f.read_exact_at(&mut got, start + off).unwrap();
        assert!(
            got == want[off as usize..(off + n) as usize],
            "{} bytes at {off} of the tensor at {start}",
            n
        );
    }
}

needs! { [model, fuse]
fn smollm2_hf_listing_config_and_tensors() {
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&model, &["--views", "f16,bf16"]);
    let hf = m.path("hf");
    assert!(listing(&m.mp).contains(&"hf".to_string()));
    assert_eq!(
        listing(&hf),
        [
            "config.json",
            "generation_config.json",
            "model.bf16.safetensors",
            "model.f16.safetensors",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    // Inodes: the documented block at 2^47, whatever --views says.
    let md = std::fs::metadata(&hf).unwrap();
    assert!(md.is_dir());
    assert_eq!(md.ino(), 1 << 47);
    assert_eq!(
        std::fs::metadata(hf.join("model.safetensors"))
            .unwrap()
            .ino(),
        (1 << 47) + 5
    );

    let c = json_file(&hf.join("config.json"));
    assert_eq!(c["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    assert_eq!(c["model_type"], "llama");
    for (k, v) in [
        ("hidden_size", 576),
        ("intermediate_size", 1536),
        ("num_hidden_layers", 30),
        ("num_attention_heads", 9),
        ("num_key_value_heads", 3),
        ("head_dim", 64),
        ("vocab_size", 49152),
        ("max_position_embeddings", 8192),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
    ] {
        assert_eq!(c[k], v, "{k}");
    }
    assert_eq!(c["rope_theta"], 100000.0);
    assert!((c["rms_norm_eps"].as_f64().unwrap() - 1e-5).abs() < 1e-9);
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["torch_dtype"], "float32");
    let g = json_file(&hf.join("generation_config.json"));
    assert_eq!(
        (g["bos_token_id"].as_u64(), g["eos_token_id"].as_u64()),
        (Some(1), Some(2))
    );
    let tc = json_file(&hf.join("tokenizer_config.json"));
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(
        tc["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );
    let tok = json_file(&hf.join("tokenizer.json"));
    assert_eq!(tok["model"]["type"], "BPE");
    assert_eq!(tok["model"]["vocab"].as_object().unwrap().len(), 49152);
    assert_eq!(tok["model"]["merges"].as_array().unwrap().len(), 48900);
    assert_eq!(tok["added_tokens"].as_array().unwrap().len(), 17);

    // index.json lists hf/ and its files.
    let index = json_file(&m.path("index.json"));
    let h = &index["views"]["hf"];
    assert_eq!(h["available"], true, "{h}");
    assert!(
        h["files"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("hf/model.safetensors"))
    );

    // The safetensors header: HF names and shapes, no lm_head (tied).
    let st = st_header(&hf.join("model.safetensors"));
    assert_eq!(st.meta, serde_json::json!({"format": "pt"}));
    assert_eq!(st.tensors.len(), 2 + 30 * 9);
    assert!(!st.tensors.contains_key("lm_head.weight"));
    let shape = |n: &str| st.tensors[n].1.clone();
    assert_eq!(shape("model.embed_tokens.weight"), [49152, 576]);
    assert_eq!(shape("model.norm.weight"), [576]);
    assert_eq!(shape("model.layers.7.self_attn.q_proj.weight"), [576, 576]);
    assert_eq!(shape("model.layers.7.self_attn.k_proj.weight"), [192, 576]);
    assert_eq!(shape("model.layers.7.self_attn.v_proj.weight"), [192, 576]);
    assert_eq!(shape("model.layers.7.self_attn.o_proj.weight"), [576, 576]);
    assert_eq!(shape("model.layers.7.mlp.gate_proj.weight"), [1536, 576]);
    assert_eq!(shape("model.layers.7.mlp.down_proj.weight"), [576, 1536]);
    assert_eq!(shape("model.layers.7.input_layernorm.weight"), [576]);
    assert_eq!(
        shape("model.layers.7.post_attention_layernorm.weight"),
        [576]
    );
    for (dtype, ..) in st.tensors.values() {
        assert_eq!(dtype, "F32");
    }

    // Tensors: Q and K un-permuted, the rest as decoded.
    let b = backend::open(&model, None).unwrap();
    let path = hf.join("model.safetensors");
    for (layer, gguf_name, hf_name, heads) in [
        (0, "attn_q", "q_proj", 9),
        (0, "attn_k", "k_proj", 3),
        (29, "attn_q", "q_proj", 9),
        (29, "attn_k", "k_proj", 3),
        (13, "attn_v", "v_proj", 0),
        (13, "ffn_down", "mlp.down_proj", 0),
    ] {
        let g = decode(b.as_ref(), &format!("blk.{layer}.{gguf_name}.weight"));
        let hf_name = if hf_name.starts_with("mlp.") {
            format!("model.layers.{layer}.{hf_name}.weight")
        } else {
            format!("model.layers.{layer}.self_attn.{hf_name}.weight")
        };
        let (_, shape, start, end) = st.tensors[&hf_name].clone();
        let want = if heads > 0 {
            let w = unpermute(&g, heads, shape[1] as usize);
            assert!(w != g, "{hf_name}: the permutation moves rows");
            w
        } else {
            g
        };
        let want = f32_le_bytes(&want);
        assert!(read_range(&path, start, end) == want, "{hf_name}");
        check_odd_reads(&path, start, &want);
    }
    let emb = f32_le_bytes(&decode(b.as_ref(), "token_embd.weight"));
    let (_, _, s, e) = st.tensors["model.embed_tokens.weight"].clone();
    assert!(read_range(&path, s, e) == emb);

    // f16/bf16: the same tensors converted (one Q checked).
    let q = unpermute(&decode(b.as_ref(), "blk.3.attn_q.weight"), 9, 576);
    for (file, conv) in [
        (
            "model.f16.safetensors",
            (|x: f32| half::f16::from_f32(x).to_le_bytes()) as fn(f32) -> [u8; 2],
        ),
        ("model.bf16.safetensors", |x: f32| {
            half::bf16::from_f32(x).to_le_bytes()
        }),
    ] {
        let p = hf.join(file);
        let st = st_header(&p);
        let (dtype, _, s, e) = st.tensors["model.layers.3.self_attn.q_proj.weight"].clone();
        assert_eq!(dtype, if file.contains("bf16") { "BF16" } else { "F16" });
        let want: Vec<u8> = q.iter().flat_map(|&x| conv(x)).collect();
        assert!(read_range(&p, s, e) == want, "{file}");
        check_odd_reads(&p, s, &want);
    }
    let ctl = m.ctl();
    assert!(ctl.contains("errors 0"), "{ctl}");
    assert!(ctl.contains("hf/model.safetensors"), "{ctl}");
}
}

needs! { [fuse]
fn layered_rknot_serves_hf() {
    if !fuse_available() {
        return;
    }
    let (rk, dense) = (demo_path("tiny-llama.rknot"), demo_path("tiny-llama.gguf"));
    let m = Mounted::new(&rk, &["--dense", dense.to_str().unwrap()]);
    let hf = m.path("hf");
    // The demo's vocabulary has no merges: no tokenizer, and index.json
    // says why.
    assert_eq!(
        listing(&hf),
        ["config.json", "generation_config.json", "model.safetensors"]
    );
    let index = json_file(&m.path("index.json"));
    let notes = index["views"]["hf"]["notes"].to_string();
    assert!(notes.contains("tokenizer.ggml.merges"), "{notes}");
    let c = json_file(&hf.join("config.json"));
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["hidden_size"], 256);
    assert_eq!(c["num_hidden_layers"], 2);
    assert_eq!(c["num_attention_heads"], 8);
    assert_eq!(c["num_key_value_heads"], 4);
    assert_eq!(c["head_dim"], 32);
    let b = backend::open(&rk, Some(&dense)).unwrap();
    let tied = b.find("output.weight").is_err();
    assert_eq!(c["tie_word_embeddings"], tied);
    let path = hf.join("model.safetensors");
    let st = st_header(&path);
    for l in 0..2 {
        for (g, h, heads) in [("attn_q", "q_proj", 8), ("attn_k", "k_proj", 4)] {
            let w = decode(b.as_ref(), &format!("blk.{l}.{g}.weight"));
            let want = f32_le_bytes(&unpermute(&w, heads, 256));
            let (_, shape, s, e) =
                st.tensors[&format!("model.layers.{l}.self_attn.{h}.weight")].clone();
            assert_eq!(shape[1], 256);
            assert!(read_range(&path, s, e) == want, "layer {l} {h}");
            check_odd_reads(&path, s, &want);
        }
    }
    // Every tensor of the layered backend is there, as many bytes as served.
    assert_eq!(st.tensors.len(), b.tensors().len());
    // Through the decoded-file store: its whole-file decode maps rows
    // through the same permutation.
    let store = tempfile::tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(store.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let mc = Mounted::new(
        &rk,
        &[
            "--dense",
            dense.to_str().unwrap(),
            "--decoded-cache",
            store.path().to_str().unwrap(),
        ],
    );
    let whole = std::fs::read(&path).unwrap();
    assert!(std::fs::read(mc.path("hf/model.safetensors")).unwrap() == whole);
    let ctl = mc.ctl();
    assert!(
        ctl.contains("errors 0") && ctl.contains("passthrough on"),
        "{ctl}"
    );
    let log = mc.log();
    assert!(log.contains("decoded cache: hf/model.safetensors"), "{log}");
}
}

needs! { [fuse]
fn qwen2_rows_are_served_as_stored() {
    if !fuse_available() {
        return;
    }
    let src = probe_data("tiny-qwen2.gguf");
    let m = Mounted::new(&src, &[]);
    let hf = m.path("hf");
    let c = json_file(&hf.join("config.json"));
    assert_eq!(c["architectures"], serde_json::json!(["Qwen2ForCausalLM"]));
    assert_eq!(c["model_type"], "qwen2");
    assert_eq!(c["tie_word_embeddings"], false);
    assert_eq!(c["vocab_size"], 260);
    let b = backend::open(&src, None).unwrap();
    let path = hf.join("model.safetensors");
    let st = st_header(&path);
    assert!(st.tensors.contains_key("lm_head.weight"));
    for (g, h) in [
        (
            "blk.1.attn_q.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ),
        (
            "blk.1.attn_k.weight",
            "model.layers.1.self_attn.k_proj.weight",
        ),
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ("blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias"),
        ("output.weight", "lm_head.weight"),
    ] {
        let (_, _, s, e) = st.tensors[h].clone();
        assert!(
            read_range(&path, s, e) == f32_le_bytes(&decode(b.as_ref(), g)),
            "{h}"
        );
    }
    let tok = json_file(&hf.join("tokenizer.json"));
    assert_eq!(
        tok["pre_tokenizer"]["type"], "Sequence",
        "qwen2's split regex"
    );
}
}

needs! { [fuse]
fn other_architectures_get_no_hf_and_index_json_says_why() {
    if !fuse_available() {
        return;
    }
    // tiny-qwen2 rewritten as a "phi2" model (same tensors, F32).
    let src = probe_data("tiny-qwen2.gguf");
    let b = backend::open(&src, None).unwrap();
    let mut md = b.summary().metadata.clone();
    for (k, v) in md.entries.iter_mut() {
        if k == "general.architecture" {
            *v = MetaValue::String("phi2".into());
        } else if let Some(rest) = k.strip_prefix("qwen2.") {
            *k = format!("phi2.{rest}");
        }
    }
    let data = decoded_f32_tensors(b.as_ref());
    let tensors = as_f32_gguf(&data);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("phi2.gguf");
    let mut out = Vec::new();
    gguf::write_gguf(&mut out, &md, &tensors, 32).unwrap();
    std::fs::write(&path, out).unwrap();

    let m = Mounted::new(&path, &[]);
    assert!(!listing(&m.mp).contains(&"hf".to_string()));
    assert!(!m.path("hf").exists());
    let index = json_file(&m.path("index.json"));
    let h = &index["views"]["hf"];
    assert_eq!(h["available"], false);
    let why = h["unavailable_reason"].as_str().unwrap();
    assert!(
        why.contains(&rknot::arch::supported_list(false)) && why.contains("phi2"),
        "{why}"
    );
    // The root's own views are unaffected.
    assert!(m.path("model.safetensors").exists());
}
}

/// transformers' GGUF loader, `rknot probe` and llama.cpp's token ids
/// against `MOUNT/hf`; opt-in (a Python with torch and transformers: set
/// RKNOT_HF_PYTHON, tools/hf-env.sh makes one).
const TRANSFORMERS_CHECK: &str = r#"
import json, os, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
hf_dir, gguf_path, probe_logits, probe_ids, reference = sys.argv[1:6]
gdir, gname = os.path.split(gguf_path)

# Every tensor equal, bit for bit, to transformers' GGUF loader's.
m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
r = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
a, b = m.state_dict(), r.state_dict()
assert set(a) == set(b), sorted(set(a) ^ set(b))
for k in a:
    assert a[k].dtype == b[k].dtype == torch.float32, k
    assert a[k].shape == b[k].shape, k
    assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k
print("TENSORS", len(a))

# Greedy next token and logits against rknot probe's.
tok = AutoTokenizer.from_pretrained(hf_dir)
ids = tok("The capital of France is", return_tensors="pt").input_ids
assert ids[0].tolist() == json.loads(probe_ids), (ids, probe_ids)
with torch.no_grad():
    logits = m(ids).logits[0, -1].numpy()
want = np.fromfile(probe_logits, dtype="<f4")
rel = float(np.abs(logits - want).max() / np.abs(want).max())
print("NEXT", repr(tok.decode([int(logits.argmax())])), "REL", rel)
assert int(logits.argmax()) == int(want.argmax())
assert rel < 1e-3, rel

# The tokenizer: as transformers' GGUF tokenizer, and as llama.cpp.
g = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
texts = [
    "The capital of France is", "Hello, world! How's it going?",
    "12345 and 2024, 3.14159 x=-7 1,000,000", "  leading, double  spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\r\n end", "naïve café — 日本語のテキスト 🤖👍🏽 Ünïcödé",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<file_sep>",
    "don't you'll I'M", "   ", "",
]
for t in texts:
    x, y = tok(t).input_ids, g(t).input_ids
    assert x == y, (t, x, y)
    assert tok.decode(x) == g.decode(y), t
msgs = [{"role": "user", "content": "What is 2+2?"}]
ca = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
assert ca == g.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), ca
assert tok.apply_chat_template(msgs, add_generation_prompt=True) == g.apply_chat_template(msgs, add_generation_prompt=True)
for k in ["bos_token", "eos_token", "pad_token", "unk_token"]:
    assert getattr(tok, k) == getattr(g, k), k
n = 0
for c in json.load(open(reference))["tokenizer_cases"]:
    if c["parse_special"]:
        assert tok(c["text"], add_special_tokens=False).input_ids == c["ids"], c
        n += 1
print("TOKENIZER", len(texts), "LLAMA_CPP_CASES", n)
"#;

/// The tiny qwen2 (biases, no permutation, own head): tensors against
/// transformers' GGUF loader.
const TRANSFORMERS_QWEN2: &str = r#"
import os, sys
import torch
from transformers import AutoModelForCausalLM
hf_dir, gguf_path = sys.argv[1:3]
gdir, gname = os.path.split(gguf_path)
a = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
b = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).state_dict()
assert set(a) == set(b), sorted(set(a) ^ set(b))
for k in a:
    assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k
print("TENSORS", len(a))
"#;

fn run_py(py: &std::ffi::OsStr, script: &str, args: &[&std::ffi::OsStr]) -> String {
    let o = Command::new(py)
        .arg("-c")
        .arg(script)
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

needs! { [hf, model, fuse]
fn transformers_loads_the_hf_view() {
    let Some(py) = std::env::var_os("RKNOT_HF_PYTHON").filter(|p| !p.is_empty()) else {
        eprintln!("NOTE: skipping: set RKNOT_HF_PYTHON to a python3 with torch and transformers");
        return;
    };
    let Some(model) = smollm2() else { return };
    if !fuse_available() {
        return;
    }
    // rknot probe's last-position logits for the prompt.
    use rknot::probe::weights::BackendSource;
    use rknot::probe::{KvCache, Model, Tokenizer, WeightSource};
    let src = BackendSource::open(&model, None).unwrap();
    let probe = Model::load(&src).unwrap();
    let tok = Tokenizer::from_metadata(src.metadata()).unwrap();
    let ids = tok.encode("The capital of France is", true, true);
    let mut cache = KvCache::new(&probe.config);
    let logits = probe
        .forward(&ids, &mut cache, ids.len() - 1..ids.len())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let logits_path = dir.path().join("probe_logits.f32");
    std::fs::write(&logits_path, f32_le_bytes(&logits)).unwrap();
    let ids_json = serde_json::to_string(&ids).unwrap();

    let m = Mounted::new(&model, &[]);
    let out = run_py(
        &py,
        TRANSFORMERS_CHECK,
        &[
            m.path("hf").as_os_str(),
            model.as_os_str(),
            logits_path.as_os_str(),
            ids_json.as_ref(),
            probe_data("reference.json").as_os_str(),
        ],
    );
    eprint!("{out}");
    assert!(out.contains("TENSORS 273"), "{out}");
    assert!(out.contains("NEXT ' Paris'"), "{out}");
    assert!(out.contains("TOKENIZER 11"), "{out}");
    let ctl = m.ctl();
    assert!(ctl.contains("errors 0"), "{ctl}");

    let qwen = probe_data("tiny-qwen2.gguf");
    let mq = Mounted::new(&qwen, &[]);
    let out = run_py(
        &py,
        TRANSFORMERS_QWEN2,
        &[mq.path("hf").as_os_str(), qwen.as_os_str()],
    );
    assert!(out.contains("TENSORS"), "{out}");
}
}

/// tests/data/probe/tiny-qwen2.gguf with its metadata edited, written to
/// `dir` (F32 tensors).
fn tiny_qwen2_with(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut rknot::format::meta::Metadata),
) -> PathBuf {
    let src = probe_data("tiny-qwen2.gguf");
    let b = backend::open(&src, None).unwrap();
    let mut md = b.summary().metadata.clone();
    edit(&mut md);
    let data = decoded_f32_tensors(b.as_ref());
    let tensors = as_f32_gguf(&data);
    let path = dir.join(name);
    let mut out = Vec::new();
    gguf::write_gguf(&mut out, &md, &tensors, 32).unwrap();
    std::fs::write(&path, out).unwrap();
    path
}

/// Replace `key`'s value, or add it.
fn set_meta(md: &mut rknot::format::meta::Metadata, key: &str, v: MetaValue) {
    md.entries.retain(|(k, _)| k != key);
    md.push(key, v);
}

/// Append to the array under `key`.
fn extend_meta(md: &mut rknot::format::meta::Metadata, key: &str, more: Vec<MetaValue>) {
    let Some((_, MetaValue::Array { values, .. })) = md.entries.iter_mut().find(|(k, _)| k == key)
    else {
        panic!("no array {key}");
    };
    values.extend(more);
}

/// The `tokenizers` library against MOUNT/hf/tokenizer.json, and
/// transformers' GGUF tokenizer of the same file: the same vocabulary (ids
/// included, added tokens too), every id it lists maps back to its token,
/// and the same ids for some texts through `AutoTokenizer`.
const TOKENIZERS_CHECK: &str = r#"
import os, sys
from tokenizers import Tokenizer
from transformers import AutoTokenizer
hf_dir, gguf_path = sys.argv[1:3]
gdir, gname = os.path.split(gguf_path)
t = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
g = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
a, b = t.get_vocab(with_added_tokens=True), g.get_vocab()
assert a == b, sorted(set(a.items()) ^ set(b.items()))[:20]
for token, i in a.items():
    assert t.id_to_token(i) == token, (i, token, t.id_to_token(i))
tok = AutoTokenizer.from_pretrained(hf_dir)
for text in ["the he<|endoftext|>", " the  he a b", "a b<think>x he", ""]:
    x, y = tok(text).input_ids, g(text).input_ids
    assert x == y, (text, x, y)
    assert tok.decode(x) == g.decode(y), text
print("VOCAB", len(a))
"#;

needs! { [hf, fuse]
/// Every tokenizer.json hf/ renders loads in the `tokenizers` library with
/// the ids transformers' GGUF loader gives (issue 26, item 5): duplicate
/// spellings (a control token and the bos token among them), an empty
/// token, a token outside the byte alphabet, a user-defined token. What
/// the library would refuse (a merge whose halves or concatenation are not
/// tokens) or transformers cannot express (a bos id past the tokens) gets
/// no tokenizer files and a note in index.json. Before, the duplicate's
/// tokenizer put the GGUF's bos id (a spelling's earlier id, which the
/// vocabulary does not list) in front of every text, and the bad merge's
/// tokenizer.json made the library panic.
fn tokenizers_load_every_rendered_tokenizer() {
    let Some(py) = std::env::var_os("RKNOT_HF_PYTHON").filter(|p| !p.is_empty()) else {
        eprintln!("NOTE: skipping: set RKNOT_HF_PYTHON to a python3 with torch and transformers");
        return;
    };
    if !fuse_available() {
        return;
    }
    let s = |x: &str| MetaValue::String(x.into());
    let dir = tempfile::tempdir().unwrap();
    // tiny-qwen2's tokens: the 256 byte characters, "Ġt", "he", "Ġthe",
    // "<|endoftext|>" (259, control, its bos and eos).
    let dups = tiny_qwen2_with(dir.path(), "dups.gguf", |md| {
        extend_meta(
            md,
            "tokenizer.ggml.tokens",
            ["<|endoftext|>", "", "he", "a b", "<think>"]
                .map(s)
                .to_vec(),
        );
        extend_meta(
            md,
            "tokenizer.ggml.token_type",
            [3, 3, 1, 1, 4].map(MetaValue::I32).to_vec(),
        );
        set_meta(md, "tokenizer.ggml.add_bos_token", MetaValue::Bool(true));
    });
    let m = Mounted::new(&dups, &[]);
    let out = run_py(
        &py,
        TOKENIZERS_CHECK,
        &[m.path("hf").as_os_str(), dups.as_os_str()],
    );
    // 265 tokens, two of them earlier ids of a spelling.
    assert!(out.contains("VOCAB 263"), "{out}");
    let index = json_file(&m.path("index.json"));
    let notes = index["views"]["hf"]["notes"].to_string();
    assert!(
        notes.contains("2 of the 265 tokens share their spelling"),
        "{notes}"
    );
    drop(m);

    for (name, edit, why) in [
        (
            "merge.gguf",
            Box::new(move |md: &mut rknot::format::meta::Metadata| {
                extend_meta(md, "tokenizer.ggml.merges", vec![s("Ġthe Ġt")])
            }) as Box<dyn FnOnce(&mut rknot::format::meta::Metadata)>,
            "tokenizer.ggml.merges[3] \\\"Ġthe Ġt\\\" needs \\\"ĠtheĠt\\\"",
        ),
        (
            "bos.gguf",
            Box::new(move |md: &mut rknot::format::meta::Metadata| {
                set_meta(md, "tokenizer.ggml.bos_token_id", MetaValue::U32(999))
            }),
            "bos_token_id 999 is not a token",
        ),
    ] {
        let path = tiny_qwen2_with(dir.path(), name, edit);
        let m = Mounted::new(&path, &[]);
        let hf = listing(&m.path("hf"));
        let index = json_file(&m.path("index.json"));
        let notes = index["views"]["hf"]["notes"].to_string();
        assert!(
            !hf.contains(&"tokenizer.json".to_string())
                && !hf.contains(&"tokenizer_config.json".to_string()),
            "{name}: {hf:?}"
        );
        assert!(notes.contains(why), "{name}: {notes}");
        assert!(
            m.log().contains("hf/tokenizer.json is not offered"),
            "{name}"
        );
    }
}
}

/// tests/data/probe/tiny-qwen2.gguf with its matrices stored as `half`
/// (F16 or BF16) and its vectors (norms, biases) F32, as llama.cpp's
/// converter writes an F16/BF16 GGUF; the vectors' values rounded to
/// `half` first (so they are exact there) but for `inexact`, whose first
/// value is then nudged off it.
fn tiny_qwen2_half(dir: &Path, name: &str, half: GgmlType, inexact: Option<&str>) -> PathBuf {
    use half::{bf16, f16};
    let src = probe_data("tiny-qwen2.gguf");
    let b = backend::open(&src, None).unwrap();
    let md = b.summary().metadata.clone();
    let round = |x: f32| match half {
        GgmlType::F16 => f16::from_f32(x).to_f32(),
        _ => bf16::from_f32(x).to_f32(),
    };
    let mut data: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> = Vec::new();
    for (n, ne, bytes) in decoded_f32_tensors(b.as_ref()) {
        let vals: Vec<f32> = bytes
            .chunks(4)
            .map(|c| round(f32::from_le_bytes(c.try_into().unwrap())))
            .collect();
        if ne.len() >= 2 {
            let out: Vec<u8> = vals
                .iter()
                .flat_map(|&x| match half {
                    GgmlType::F16 => f16::from_f32(x).to_le_bytes(),
                    _ => bf16::from_f32(x).to_le_bytes(),
                })
                .collect();
            data.push((n, ne, half, out));
        } else {
            let mut vals = vals;
            if inexact == Some(n.as_str()) {
                vals[0] = f32::from_bits(vals[0].to_bits() + 1);
            }
            data.push((n, ne, GgmlType::F32, f32_le_bytes(&vals)));
        }
    }
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = data
        .iter()
        .map(|(n, ne, t, d)| (n.clone(), ne.clone(), *t, &d[..]))
        .collect();
    let path = dir.join(name);
    let mut out = Vec::new();
    gguf::write_gguf(&mut out, &md, &tensors, 32).unwrap();
    std::fs::write(&path, out).unwrap();
    path
}

/// The stored bytes of tensor `name` of the GGUF at `path`.
fn stored_bytes(path: &Path, name: &str) -> Vec<u8> {
    let g = gguf_header(path);
    let t = g.tensor(name).unwrap();
    let f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; t.n_bytes as usize];
    f.read_exact_at(&mut buf, t.offset).unwrap();
    buf
}

fn gguf_header(path: &Path) -> gguf::GgufFile {
    gguf::GgufFile::read(&rknot::source::SourceFile::open(path).unwrap()).unwrap()
}

needs! { [fuse]
/// Issue 25, item 2: an F16 or BF16 GGUF (matrices half, vectors F32 but
/// exact in half) gives hf/ and model.safetensors in its own dtype by
/// default, config.json's torch_dtype to match, the safetensors bytes the
/// GGUF's stored ones; model.gguf stays F32. A vector that is not exact in
/// the half type keeps them F32 (auto never rounds), and -o hf_dtype=
/// overrides either way, a rounding view saying so in index.json, ctl and
/// the log.
fn half_sources_are_served_in_their_own_dtype() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let views = |m: &Mounted| -> Vec<Value> {
        let index = json_file(&m.path("index.json"));
        index["views"]["files"].as_array().unwrap().clone()
    };
    let view = |vs: &[Value], name: &str| -> Value {
        vs.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("no {name}: {vs:?}")).clone()
    };
    for (half, st, torch) in [
        (GgmlType::F16, "F16", "float16"),
        (GgmlType::Bf16, "BF16", "bfloat16"),
    ] {
        let src = tiny_qwen2_half(dir.path(), &format!("q-{st}.gguf"), half, None);
        let m = Mounted::new(&src, &[]);
        let c = json_file(&m.path("hf/config.json"));
        assert_eq!((c["torch_dtype"].as_str(), c["dtype"].as_str()), (Some(torch), Some(torch)));
        for path in [m.path("hf/model.safetensors"), m.path("model.safetensors")] {
            let h = st_header(&path);
            assert!(h.tensors.values().all(|t| t.0 == st), "{st} {path:?}");
        }
        // Bytes: the GGUF's stored ones (qwen2's rows are not permuted);
        // the F32 vectors' values in the half type, exactly.
        let hf = m.path("hf/model.safetensors");
        let h = st_header(&hf);
        let (_, _, s, e) = h.tensors["model.layers.1.self_attn.q_proj.weight"].clone();
        assert!(read_range(&hf, s, e) == stored_bytes(&src, "blk.1.attn_q.weight"), "{st}");
        let vs = views(&m);
        for name in ["model.safetensors", "hf/model.safetensors"] {
            let v = view(&vs, name);
            assert_eq!((v["dtype"].as_str(), v["exact"].as_bool()), (Some(st), Some(true)), "{v}");
        }
        assert_eq!(view(&vs, "model.gguf")["dtype"], "F32");
        let index = json_file(&m.path("index.json"));
        assert_eq!(index["views"]["main_dtype"], st, "{index}");
        let g = gguf_header(&m.path("model.gguf"));
        assert!(g.tensors.iter().all(|t| t.ty == GgmlType::F32));
        drop(m);

        // One vector not exact in the half type: auto keeps F32, exactly.
        let off = tiny_qwen2_half(dir.path(), &format!("q-{st}-off.gguf"), half, Some("blk.0.attn_norm.weight"));
        let m = Mounted::new(&off, &[]);
        assert_eq!(json_file(&m.path("hf/config.json"))["torch_dtype"], "float32");
        let index = json_file(&m.path("index.json"));
        assert_eq!(index["views"]["main_dtype"], "F32", "{index}");
        let reason = index["views"]["main_dtype_reason"].as_str().unwrap();
        assert!(reason.contains("not every tensor is exact"), "{reason}");
        assert!(views(&m).iter().all(|v| v["exact"] != false), "{index}");
        drop(m);

        // Asked for: served as asked, the rounding said.
        let other = if st == "F16" { "bf16" } else { "f16" };
        let opt = format!("hf_dtype={other}");
        let m = Mounted::new(&off, &["-o", &opt]);
        let vs = views(&m);
        let v = view(&vs, "hf/model.safetensors");
        assert_eq!((v["dtype"].as_str(), v["exact"].as_bool()), (Some(other.to_uppercase().as_str()), Some(false)), "{v}");
        let note = v["notes"].to_string();
        assert!(note.contains("not exact") && note.contains("-o hf_dtype=f32"), "{note}");
        let ctl = std::fs::read_to_string(m.path("ctl")).unwrap();
        assert!(ctl.contains("hf/model.safetensors (") && ctl.contains("not exact:"), "{ctl}");
        let log = m.log();
        assert_eq!(log.matches("hf/model.safetensors (").count(), 1, "{log}");
        drop(m);
        let m = Mounted::new(&src, &["-o", "hf_dtype=f32"]);
        assert_eq!(json_file(&m.path("hf/config.json"))["torch_dtype"], "float32");
        assert!(st_header(&m.path("hf/model.safetensors")).tensors.values().all(|t| t.0 == "F32"));
        drop(m);
    }
    // A bad value is a usage error naming the option.
    let src = probe_data("tiny-qwen2.gguf");
    let mp = tempfile::tempdir().unwrap();
    let o = Command::new(common::mount::mount_bin())
        .arg(&src)
        .arg(mp.path())
        .args(["-o", "hf_dtype=half"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("hf_dtype=\"half\""), "{err}");
}
}
