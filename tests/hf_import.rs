//! A Hugging Face checkpoint's metadata (`rknot::arch::hf_import`) against
//! the real converter: tiny random llama, qwen2 and qwen3 checkpoints saved by
//! transformers' own classes (`save_pretrained`) with SmolLM2's byte-level
//! BPE tokenizer (from the `hf/` view of the SmolLM2 GGUF), converted by
//! llama.cpp's `convert_hf_to_gguf.py` from the llama-cpp-python sdist
//! (tools/llama-cpp.sh fetched it); every key our function writes must be
//! in the converter's GGUF with the same type and value, and every key the
//! converter writes must be ours, but for the few listed in [`NOT_OURS`].
//! And the round trip: the `hf/` view's files of SmolLM2 give back the
//! GGUF's own hyper-parameters and tokenizer.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::arch::hf_import::{HfFiles, HfImport, gguf_metadata};
use rknot::format::gguf::GgufFile;
use rknot::format::meta::{MetaValue, Metadata};
use rknot::source::SourceFile;

/// Keys the converter writes that describe the tensors or the directory,
/// not the checkpoint's files (the caller, which knows the tensors, adds
/// what it needs).
const NOT_OURS: &[(&str, &str)] = &[
    ("general.name", "the converter takes the directory's name"),
    ("general.size_label", "from the tensors' parameter count"),
    ("general.file_type", "from the output tensor type"),
    (
        "general.quantization_version",
        "describes quantized tensors",
    ),
];

/// Builds the checkpoints and converts them: argv smol_dir work_dir sdist.
const MAKE_AND_CONVERT: &str = r#"
import json, os, subprocess, sys, tarfile
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

smol, work, sdist = sys.argv[1:4]
prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
with tarfile.open(sdist) as tf:
    members = [m for m in tf.getmembers() if m.name.startswith(tuple(prefix + p for p in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")))]
    tf.extractall(work, members=members, filter="data")
converter = os.path.join(work, prefix, "convert_hf_to_gguf.py")

tok0 = json.load(open(os.path.join(smol, "tokenizer.json"), encoding="utf-8"))
tcfg0 = json.load(open(os.path.join(smol, "tokenizer_config.json"), encoding="utf-8"))
n = len(tok0["model"]["vocab"])
common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)

def save(name, model, tok, tcfg):
    out = os.path.join(work, name)
    model.save_pretrained(out)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tcfg, f, ensure_ascii=False, indent=2)
    return out

torch.manual_seed(0)
# llama: SmolLM2's own pre-tokenizer (digits one by one, then GPT-2's
# regex), which the converter's hash of the token ids names "smollm";
# linear rope scaling.
tok = json.loads(json.dumps(tok0))
tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
tcfg = dict(tcfg0, add_prefix_space=False)
cfg = LlamaConfig(vocab_size=n, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}, **common)
dirs = {"llama": (save("llama", LlamaForCausalLM(cfg), tok, tcfg), None)}

# qwen2: Qwen2's split regex; a vocabulary padded past the tokenizer's
# (gaps), a user-defined added token and one that only looks special; the
# padding token from tokenizer_config.json. The converter's hash knows
# Qwen2's pre-tokenizer only with Qwen's own vocabulary, so it is told the
# name the hash gives that vocabulary ("qwen2"): everything else is the
# converter's own.
tok = json.loads(json.dumps(tok0))
tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
for i, (content, normalized) in enumerate([("<tool>", False), ("<|extra|>", True)]):
    tok["added_tokens"].append({"id": n + i, "content": content, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": normalized, "special": False})
tcfg = dict(tcfg0, pad_token="<|endoftext|>")
cfg = Qwen2Config(vocab_size=n + 8, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, **common)
dirs["qwen2"] = (save("qwen2", Qwen2ForCausalLM(cfg), tok, tcfg), "qwen2")

# qwen3: qwen2's tokenizer; its own head size (not hidden / heads).
cfg = Qwen3Config(vocab_size=n + 8, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  head_dim=24, **common)
dirs["qwen3"] = (save("qwen3", Qwen3ForCausalLM(cfg), tok, tcfg), "qwen2")

# qwen3moe: the expert keys (count, per token, expert size).
cfg = Qwen3MoeConfig(vocab_size=n + 8, head_dim=24, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=48, **common)
dirs["qwen3moe"] = (save("qwen3moe", Qwen3MoeForCausalLM(cfg), tok, tcfg), "qwen2")

wrapper = os.path.join(work, "convert.py")
with open(wrapper, "w") as f:
    f.write('''
import os, runpy, sys
script, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(script))
if pre != "-":
    import conversion.base
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
''')
for name, (d, pre) in dirs.items():
    out = os.path.join(work, name + ".gguf")
    r = subprocess.run([sys.executable, wrapper, converter, pre or "-", d, "--outfile", out, "--outtype", "f32"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"convert_hf_to_gguf.py failed for {name}:\n{r.stdout}\n{r.stderr}")
    print("CONVERTED", name)
"#;

fn sdist() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .expect("HOME or XDG_CACHE_HOME");
    let p = cache.join("rknot/llama_cpp_python-0.3.36.tar.gz");
    assert!(
        p.is_file(),
        "{} is missing: tools/llama-cpp.sh fetches it",
        p.display()
    );
    p
}

fn read(dir: &Path, name: &str) -> Option<Vec<u8>> {
    std::fs::read(dir.join(name)).ok()
}

/// `gguf_metadata` of the checkpoint files in `dir`.
fn import(dir: &Path) -> HfImport {
    let config = read(dir, "config.json").expect("config.json");
    let tokenizer = read(dir, "tokenizer.json");
    let tokenizer_config = read(dir, "tokenizer_config.json");
    let generation_config = read(dir, "generation_config.json");
    gguf_metadata(&HfFiles {
        config: &config,
        tokenizer: tokenizer.as_deref(),
        tokenizer_config: tokenizer_config.as_deref(),
        generation_config: generation_config.as_deref(),
    })
    .unwrap()
}

fn gguf_md(path: &Path) -> Metadata {
    GgufFile::read(&SourceFile::open(path).unwrap())
        .unwrap()
        .metadata
}

/// A value for a message (arrays by length and ends).
fn show(v: &MetaValue) -> String {
    match v {
        MetaValue::Array { elem, values } if values.len() > 6 => format!(
            "[{} x {}: {:?} .. {:?}]",
            values.len(),
            elem.name(),
            &values[..3],
            &values[values.len() - 3..]
        ),
        MetaValue::String(s) if s.len() > 80 => format!("{:?}...", &s[..80]),
        v => format!("{v:?}"),
    }
}

/// The first element where two arrays differ, for a message.
fn first_difference(a: &MetaValue, b: &MetaValue) -> String {
    match (a, b) {
        (MetaValue::Array { values: x, .. }, MetaValue::Array { values: y, .. }) => {
            match x.iter().zip(y).position(|(p, q)| p != q) {
                Some(i) => format!(" (first at [{i}]: {:?} vs {:?})", x[i], y[i]),
                None => format!(" (lengths {} vs {})", x.len(), y.len()),
            }
        }
        _ => String::new(),
    }
}

fn compare(name: &str, ours: &HfImport, theirs: &Metadata) {
    let mut wrong = Vec::new();
    for (k, v) in &ours.metadata.entries {
        if NOT_OURS.iter().any(|(n, _)| n == k) {
            continue;
        }
        match theirs.get(k) {
            None => wrong.push(format!("{k}: ours {} but the converter has none", show(v))),
            Some(t) if t != v => wrong.push(format!(
                "{k}: ours {} vs the converter's {}{}",
                show(v),
                show(t),
                first_difference(v, t)
            )),
            Some(_) => {}
        }
    }
    for (k, v) in &theirs.entries {
        if ours.metadata.get(k).is_none() && !NOT_OURS.iter().any(|(n, _)| n == k) {
            wrong.push(format!("{k}: the converter has {} and we none", show(v)));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: {} key(s) differ:\n{}\nnotes: {:?}",
        wrong.len(),
        wrong.join("\n"),
        ours.notes
    );
    eprintln!(
        "{name}: {} keys equal the converter's; notes {:?}",
        ours.metadata.len(),
        ours.notes
    );
}

/// SmolLM2's `hf/` files, copied out of a mount into `dir`.
fn smollm2_hf_files(model: &Path, dir: &Path) {
    let m = Mounted::new(model, &[]);
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(m.path("hf").join(f), dir.join(f)).unwrap();
    }
}

needs! { [hf, llama_cpp, model, fuse]
fn metadata_equals_the_converters() {
    let py = std::env::var_os("RKNOT_HF_PYTHON").expect("RKNOT_HF_PYTHON");
    let model = smollm2().expect("the SmolLM2 model");
    assert!(fuse_available(), "FUSE is needed to render SmolLM2's tokenizer");
    let work = tempfile::tempdir().unwrap();
    let smol = work.path().join("smol");
    std::fs::create_dir(&smol).unwrap();
    smollm2_hf_files(&model, &smol);
    let o = Command::new(&py)
        .arg("-c")
        .arg(MAKE_AND_CONVERT)
        .arg(&smol)
        .arg(work.path())
        .arg(sdist())
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for name in ["llama", "qwen2", "qwen3", "qwen3moe"] {
        let ours = import(&work.path().join(name));
        assert_eq!(ours.arch.map(|a| a.name()), Some(name));
        let theirs = gguf_md(&work.path().join(format!("{name}.gguf")));
        compare(name, &ours, &theirs);
        if name == "qwen3moe" {
            // Its per-expert tensors are not stacked into llama.cpp's 3-D
            // ones by the safetensors source yet: the metadata only.
            continue;
        }
        same_model_as_the_converters(
            name,
            &work.path().join(name),
            &work.path().join(format!("{name}.gguf")),
        );
    }
}
}

/// The checkpoint served as a source and the converter's f32 GGUF of it
/// are one model: the same tensors under the same names and shapes, every
/// value bit for bit (llama's Q/K rows in the converter's order), and the
/// probe's forward pass gives the same report on both.
fn same_model_as_the_converters(name: &str, checkpoint: &Path, converted: &Path) {
    use rknot::backend::{Role, open_single};
    let ours = open_single(checkpoint, Role::Primary).unwrap();
    let theirs = open_single(converted, Role::Primary).unwrap();
    let names = |b: &dyn rknot::backend::Backend| {
        let mut v: Vec<(String, Vec<u64>)> = b
            .tensors()
            .entries()
            .iter()
            .map(|t| (t.name.dot.clone(), t.shape.clone()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        names(ours.as_ref()),
        names(theirs.as_ref()),
        "{name}: tensors"
    );
    for (i, t) in theirs.tensors().entries().iter().enumerate() {
        let j = ours.tensors().get(&t.name.dot).unwrap();
        let n = t.n_elements as usize;
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        theirs.read_f32(i, 0, &mut a).unwrap();
        ours.read_f32(j, 0, &mut b).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&a) == bits(&b),
            "{name}: {} differs from the converter's",
            t.name.dot
        );
    }
    let probe = |path: &Path| {
        let o = Command::new(rknot_bin())
            .args([
                "probe",
                path.to_str().unwrap(),
                "--tokens",
                "1,2,3,4",
                "--top",
                "5",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{name} probe: {text}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        // The candidates and their scores, not the lines naming the file.
        text.lines()
            .skip_while(|l| !l.trim_start().starts_with("rank"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (a, b) = (probe(checkpoint), probe(converted));
    assert!(!a.is_empty(), "{name}: the probe printed no candidates");
    assert_eq!(
        a, b,
        "{name}: the probe differs between the checkpoint and the converter's GGUF"
    );
    // The calibrated encoder runs the same forward pass over text: it takes
    // the checkpoint as it takes a GGUF, and its output verifies against it
    // (a generous --target-bpw: the 49k-token f32 vocabulary of a 64-wide
    // model is most of its bytes).
    let out = tempfile::tempdir().unwrap();
    let text = out.path().join("calibration.txt");
    std::fs::write(
        &text,
        "The capital of France is Paris. 12 + 30 = 42.\n".repeat(40),
    )
    .unwrap();
    let rk = out.path().join("m.rknot");
    for args in [
        &[
            "encode",
            "rknot",
            "--no-progress",
            checkpoint.to_str().unwrap(),
            "--calibrate",
            text.to_str().unwrap(),
            "--calibration-ctx",
            "64",
            "--target-bpw",
            "12",
            "--out",
            rk.to_str().unwrap(),
        ][..],
        &[
            "verify",
            rk.to_str().unwrap(),
            "--dense",
            checkpoint.to_str().unwrap(),
        ][..],
    ] {
        let o = run_rknot(args);
        assert!(
            o.status.success(),
            "{name} {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

needs! { [model, fuse]
fn hf_view_files_give_the_gguf_metadata_back() {
    let model = smollm2().expect("the SmolLM2 model");
    assert!(fuse_available(), "FUSE is needed for the hf/ view");
    let dir = tempfile::tempdir().unwrap();
    smollm2_hf_files(&model, dir.path());
    let ours = import(dir.path());
    let gguf = gguf_md(&model);
    assert_eq!(ours.arch.map(|a| a.name()), Some("llama"));
    let mut keys: Vec<String> = [
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
        "vocab_size",
        "rope.dimension_count",
    ]
    .iter()
    .map(|k| format!("llama.{k}"))
    .collect();
    for k in [
        "general.architecture",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    ] {
        keys.push(k.to_string());
    }
    for k in &keys {
        let (a, b) = (ours.metadata.get(k), gguf.get(k));
        assert!(b.is_some(), "the GGUF lacks {k}");
        assert!(
            a == b,
            "{k}: {} from hf/ vs the GGUF's {}{}",
            a.map_or("none".to_string(), show),
            b.map_or("none".to_string(), show),
            match (a, b) {
                (Some(a), Some(b)) => first_difference(a, b),
                _ => String::new(),
            }
        );
    }
    // hf/ renders a "smollm" tokenizer with GPT-2's split alone (its
    // tokenizer.json has no digits step), so what comes back says so.
    assert_eq!(
        ours.metadata.get("tokenizer.ggml.pre"),
        Some(&MetaValue::String("gpt-2".into()))
    );
    assert_eq!(
        gguf.get("tokenizer.ggml.pre"),
        Some(&MetaValue::String("smollm".into()))
    );
}
}
