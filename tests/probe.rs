//! `rknot probe`: the forward pass, tokenizer and perplexity against
//! llama.cpp and Python `tokenizers` figures committed in
//! tests/data/probe/reference.json (made by tools/probe_reference.py), the
//! CLI, and the same model read through a real mount.
//!
//! The SmolLM2 model is loaded once per test binary and shared.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::format::meta::{MetaType, MetaValue, Metadata};
use rknot::probe::eval;
use rknot::probe::weights::{BackendSource, MountSource};
use rknot::probe::{KvCache, Model, Residency, Tokenizer, WeightSource};
use serde_json::Value;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/probe")
        .join(name)
}

fn reference() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| {
        serde_json::from_slice(&std::fs::read(data("reference.json")).unwrap()).unwrap()
    })
}

struct Smol {
    path: PathBuf,
    model: Model,
    tok: Tokenizer,
}

/// SmolLM2 loaded through the backend (the mount's decode path), or None
/// (with the helper's note) when the model is absent.
fn smol() -> Option<&'static Smol> {
    static S: OnceLock<Option<Smol>> = OnceLock::new();
    S.get_or_init(|| {
        let path = smollm2()?;
        let src = BackendSource::open(&path, None).unwrap();
        let model = Model::load(&src).unwrap();
        let tok = Tokenizer::from_metadata(src.metadata()).unwrap();
        Some(Smol { path, model, tok })
    })
    .as_ref()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn read_f16(name: &str) -> Vec<f32> {
    std::fs::read(data(name))
        .unwrap()
        .chunks_exact(2)
        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

fn all_logits(m: &Model, ids: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(&m.config);
    m.forward(ids, &mut cache, 0..ids.len()).unwrap()
}

needs! { [model]
fn tokenizer_matches_python_tokenizers_and_llama_cpp() {
    let Some(s) = smol() else { return };
    let cases = reference()["tokenizer_cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids_of(&c["ids"]);
        let got = s
            .tok
            .encode(text, c["parse_special"].as_bool().unwrap(), false);
        assert_eq!(got, want, "ids of {text:?}");
        assert_eq!(s.tok.decode(&got), text, "round trip of {text:?}");
    }
    // The perplexity text: same token count as both references.
    let text = rknot::probe::read_text(&data("gpl-3.0.txt")).unwrap();
    let ids = s.tok.encode(&text, false, true);
    let r = &reference()["perplexity"];
    assert_eq!(ids.len() as u64, r["text_tokens"].as_u64().unwrap());
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    assert_eq!(
        sha256_hex(&bytes),
        r["text_ids_sha256_u32le"].as_str().unwrap()
    );
}
}

needs! { [model]
fn paris_is_the_first_answer() {
    let Some(s) = smol() else { return };
    let ids = s.tok.encode("The capital of France is", true, true);
    let mut cache = KvCache::new(&s.model.config);
    let logits = s
        .model
        .forward(&ids, &mut cache, ids.len() - 1..ids.len())
        .unwrap();
    let top = eval::top_k(&logits, 5);
    assert_eq!(s.tok.decode(&[top[0].id]), " Paris", "{top:?}");
    assert!(top[0].prob > 0.5, "{top:?}");
    // Greedy continuation through the KV cache starts with the answer.
    let g = eval::greedy(&s.model, &mut cache, &logits, 3, |_| false, |_| {}).unwrap();
    assert!(
        s.tok.decode(&g.tokens).starts_with(" Paris"),
        "{:?}",
        s.tok.decode(&g.tokens)
    );
}
}

needs! { [model]
fn forward_pass_matches_llama_cpp_on_the_same_weights() {
    let Some(s) = smol() else { return };
    let prompts: Vec<&Value> = reference()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["model"] == "f32")
        .collect();
    assert_eq!(prompts.len(), 5);
    let v = s.model.config.n_vocab;
    let (mut agree, mut total) = (0, 0);
    for p in prompts {
        let text = p["prompt"].as_str().unwrap();
        let ids = ids_of(&p["ids"]);
        assert_eq!(s.tok.encode(text, true, true), ids, "tokens of {text:?}");
        let logits = all_logits(&s.model, &ids);
        let want_top1 = ids_of(&p["top1_each_position"]);
        for (row, &w) in logits.chunks_exact(v).zip(&want_top1) {
            total += 1;
            agree += usize::from(eval::argmax(row) == w);
        }
        let last = &logits[logits.len() - v..];
        let reference_last = read_f16(p["last_logits_file"].as_str().unwrap());
        let cos = eval::cosine(last, &reference_last);
        eprintln!("{text:?}: last-position logits cosine vs llama.cpp {cos:.9}");
        assert!(cos >= 0.999, "{text:?}: logits cosine {cos}");
        let top: Vec<u32> = eval::top_k(last, 5).iter().map(|c| c.id).collect();
        let want: Vec<u32> = p["last_top5"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            top[0], want[0],
            "{text:?}: top-1 {top:?} vs llama.cpp {want:?}"
        );
        let shared = top.iter().filter(|t| want.contains(t)).count();
        assert!(shared >= 4, "{text:?}: top-5 {top:?} vs llama.cpp {want:?}");
        for (c, w) in eval::top_k(last, 5)
            .iter()
            .zip(p["last_top5"].as_array().unwrap())
        {
            if c.id == w["id"].as_u64().unwrap() as u32 {
                let dp = (c.prob - w["prob"].as_f64().unwrap()).abs();
                assert!(
                    dp < 0.01,
                    "{text:?}: p({}) {} vs {}",
                    c.id,
                    c.prob,
                    w["prob"]
                );
            }
        }
    }
    // Every position's argmax, not only the last: near-ties may flip.
    eprintln!("top-1 agreement with llama.cpp over every position: {agree}/{total}");
    assert!(agree * 100 >= total * 97, "top-1 agreement {agree}/{total}");
}
}

needs! { [model]
/// Greedy continuations of the factual prompts equal llama.cpp's (on the
/// same fp32 weights) token for token.
fn greedy_generation_matches_llama_cpp() {
    let Some(s) = smol() else { return };
    for g in reference()["greedy_f32"].as_array().unwrap() {
        let prompt = g["prompt"].as_str().unwrap();
        let ids = s.tok.encode(prompt, true, true);
        assert_eq!(ids, ids_of(&g["ids"]), "tokens of {prompt:?}");
        let want = ids_of(&g["greedy"]);
        let mut cache = KvCache::new(&s.model.config);
        let last = s
            .model
            .forward(&ids, &mut cache, ids.len() - 1..ids.len())
            .unwrap();
        let got = eval::greedy(
            &s.model,
            &mut cache,
            &last,
            want.len(),
            |t| s.tok.is_end_of_generation(t),
            |_| {},
        )
        .unwrap();
        eprintln!("{prompt:?} -> {:?}", s.tok.decode(&got.tokens));
        assert_eq!(
            got.tokens,
            want,
            "{prompt:?}: {:?}",
            s.tok.decode(&got.tokens)
        );
    }
}
}

needs! { [model]
fn perplexity_prefix_matches_llama_perplexity() {
    let Some(s) = smol() else { return };
    let r = &reference()["perplexity"];
    let ctx = r["ctx"].as_u64().unwrap() as usize;
    let chunks = r["prefix_chunks"].as_u64().unwrap() as usize;
    let want = r["f32"]["prefix"]["ppl"].as_f64().unwrap();
    let text = rknot::probe::read_text(&data("gpl-3.0.txt")).unwrap();
    let ids = s.tok.encode(&text, false, true);
    let bos = s.tok.add_bos.then_some(s.tok.bos).flatten();
    let p = eval::perplexity(&s.model, &ids, ctx, Some(chunks), bos).unwrap();
    assert_eq!(p.windows, chunks);
    assert_eq!(p.nll.count, chunks * (ctx - 1 - ctx / 2));
    let got = p.nll.perplexity();
    assert!(
        (got / want - 1.0).abs() < 0.01,
        "perplexity {got} vs llama-perplexity {want}"
    );
    eprintln!(
        "perplexity of {chunks} windows: {got:.4} (llama-perplexity {want}), {:.1} tokens/s",
        p.tokens_evaluated as f64 / p.elapsed.as_secs_f64()
    );
}
}

needs! { [model]
fn kv_cache_generation_equals_full_recompute() {
    let Some(s) = smol() else { return };
    let ids = s.tok.encode("Water boils at a temperature of", true, true);
    let v = s.model.config.n_vocab;
    let mut cache = KvCache::new(&s.model.config);
    let first = s
        .model
        .forward(&ids, &mut cache, ids.len() - 1..ids.len())
        .unwrap();
    let g = eval::greedy(&s.model, &mut cache, &first, 6, |_| false, |_| {}).unwrap();
    assert_eq!(cache.len(), ids.len() + 5);
    // The same sequence in one batch gives the same argmax at each step
    // and (nearly) the same logits at the last position.
    let mut all = ids.clone();
    all.extend_from_slice(&g.tokens[..5]);
    let full = all_logits(&s.model, &all);
    for (k, &t) in g.tokens.iter().enumerate() {
        let row = &full[(ids.len() - 1 + k) * v..(ids.len() + k) * v];
        assert_eq!(eval::argmax(row), t, "step {k}");
    }
    let mut step_cache = KvCache::new(&s.model.config);
    s.model
        .forward(&all[..all.len() - 1], &mut step_cache, 0..1)
        .unwrap();
    let inc = s
        .model
        .forward(&all[all.len() - 1..], &mut step_cache, 0..1)
        .unwrap();
    let cos = eval::cosine(&inc, &full[full.len() - v..]);
    assert!(cos > 0.99999, "incremental vs batched logits cosine {cos}");
}
}

needs! { [model, fuse]
/// A mounted rknot directory serves the bytes the backend decodes, so the
/// model read from the mount gives bit-identical logits.
fn probe_through_a_real_mount() {
    let Some(s) = smol() else { return };
    if !fuse_available() {
        return;
    }
    let m = Mounted::new(&s.path, &[]);
    let src = MountSource::open(&m.mp, None).unwrap();
    assert!(
        src.tokenizer_note().contains("tokenizer key/values from"),
        "{}",
        src.tokenizer_note()
    );
    let tok = Tokenizer::from_metadata(src.metadata()).unwrap();
    let model = Model::load(&src).unwrap();
    let ids = tok.encode("The capital of France is", true, true);
    assert_eq!(ids, s.tok.encode("The capital of France is", true, true));
    let a = all_logits(&model, &ids);
    let b = all_logits(&s.model, &ids);
    assert!(a == b, "logits through the mount differ from the backend's");
    // Streamed from the mount's .f32 files (positioned reads), in chunks
    // that end inside tensors.
    let shared: Arc<dyn WeightSource> = Arc::new(MountSource::open(&m.mp, None).unwrap());
    let mut streamed = Model::load_with(shared, Residency::Stream).unwrap();
    streamed.set_stream_chunk(100_000);
    assert!(all_logits(&streamed, &ids) == b, "streamed from the mount");
    // And the CLI on the mount directory.
    let text = probe_ok(&[
        m.mp.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--top",
        "2",
    ]);
    assert!(first_candidate(&text).contains("\" Paris\""), "{text}");
}
}

/// `rknot probe ARGS...`: asserts that it succeeds (stdout and stderr in
/// the message) and returns its stdout.
fn probe_ok(args: &[&str]) -> String {
    let out = Command::new(rknot_bin())
        .arg("probe")
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn first_candidate(report: &str) -> String {
    report
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("rank"))
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

needs! { [model]
fn cli_prompt_top_k_and_generation() {
    let Some(s) = smol() else { return };
    let text = probe_ok(&[
        s.path.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--top",
        "3",
        "--generate",
        "4",
        "--threads",
        "2",
    ]);
    assert!(first_candidate(&text).contains("\" Paris\""), "{text}");
    assert!(text.contains("prompt processing: 5 tokens"), "{text}");
    assert!(text.contains("greedy (4 tokens):\n   Paris"), "{text}");
    assert!(text.contains("tokens/s]"), "{text}");

    // --compare against itself: full agreement; --tokens needs no text.
    let text = probe_ok(&[
        s.path.to_str().unwrap(),
        "--tokens",
        "504,3575,282,4649,314",
        "--compare",
        s.path.to_str().unwrap(),
        "--top",
        "1",
    ]);
    assert!(
        text.contains("top-1 agreement 1.0000 (5/5), mean KL 0.000000"),
        "{text}"
    );
}
}

#[test]
fn cli_usage_errors() {
    // No input at all is a usage error (exit 2).
    let out = Command::new(rknot_bin())
        .args(["probe", "nowhere.gguf"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // A missing file fails with status 1 and names it.
    let out = Command::new(rknot_bin())
        .args(["probe", "nowhere.gguf", "--tokens", "1,2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nowhere.gguf"));
}

// ---- without the real model: the qwen2 path and error messages ----

/// The tiny random-weight qwen2 (Q/K/V biases, NeoX RoPE, GQA 4/2, own
/// output head) against llama.cpp's logits at every position, in one batch
/// and token by token through the KV cache.
#[test]
fn tiny_qwen2_matches_llama_cpp() {
    let r = &reference()["tiny_qwen2"];
    let src = BackendSource::open(&data(r["file"].as_str().unwrap()), None).unwrap();
    let model = Model::load(&src).unwrap();
    assert!(model.config.rope_neox() && !model.config.tied_embeddings);
    let ids = ids_of(&r["ids"]);
    let want: Vec<Vec<f32>> = r["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let v = model.config.n_vocab;
    let batched = all_logits(&model, &ids);
    let mut cache = KvCache::new(&model.config);
    let (mut worst, mut worst_err) = (1f64, 0f32);
    for (i, w) in want.iter().enumerate() {
        let got = &batched[i * v..(i + 1) * v];
        let step = model.forward(&ids[i..i + 1], &mut cache, 0..1).unwrap();
        for (label, g) in [("batched", got), ("cached", &step[..])] {
            let cos = eval::cosine(g, w);
            let max_err = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst = worst.min(cos);
            worst_err = worst_err.max(max_err);
            assert!(
                cos > 0.9999999 && max_err < 1e-4,
                "{label} position {i}: cosine {cos}, max |Δ| {max_err}"
            );
        }
    }
    eprintln!("tiny qwen2 vs llama.cpp: min cosine {worst:.9}, max |Δlogit| {worst_err:.2e}");
    let tok = Tokenizer::from_metadata(src.metadata()).unwrap();
    assert_eq!(
        tok.encode(" the hello", false, false),
        [258, 32, 257, 108, 108, 111]
    );
}

/// Streamed weights (`--weights stream`: decoded from the source a chunk
/// of rows at a time on every pass) give the logits of weights held in
/// memory bit for bit: batches on the GEMV path (≤ 12 tokens) and the
/// SGEMM path, chunks that end inside a tensor and inside a stack of them,
/// the tied head (SmolLM2) and a separate one with biases (tiny qwen2).
#[test]
fn streamed_weights_give_the_same_logits() {
    let mut sources: Vec<(String, Arc<dyn WeightSource>)> = Vec::new();
    let r = &reference()["tiny_qwen2"];
    let tiny = data(r["file"].as_str().unwrap());
    sources.push((
        "tiny qwen2".into(),
        Arc::new(BackendSource::open(&tiny, None).unwrap()),
    ));
    if let Some(s) = smol() {
        sources.push((
            "SmolLM2".into(),
            Arc::new(BackendSource::open(&s.path, None).unwrap()),
        ));
    }
    for (label, src) in sources {
        let held = Model::load_with(Arc::clone(&src), Residency::Memory).unwrap();
        assert!(!held.is_streamed());
        let n_vocab = held.config.n_vocab as u32;
        for chunk in [usize::MAX, 1000, 64 * 576 + 7] {
            let mut streamed = Model::load_with(Arc::clone(&src), Residency::Stream).unwrap();
            assert!(streamed.is_streamed());
            assert_eq!(streamed.n_params(), held.n_params());
            streamed.set_stream_chunk(chunk);
            for n in [1, 5, 13, 40] {
                let ids: Vec<u32> = (0..n).map(|i| (i * 7919 + 3) % n_vocab).collect();
                let a = all_logits(&held, &ids);
                let b = all_logits(&streamed, &ids);
                assert!(
                    a == b,
                    "{label}: {n} tokens, chunk {chunk}: streamed logits differ"
                );
            }
        }
    }
}

/// In-memory weights for error tests.
struct Mem {
    md: Metadata,
    shapes: HashMap<String, Vec<u64>>,
}

impl WeightSource for Mem {
    fn shape(&self, name: &str) -> Option<Vec<u64>> {
        self.shapes.get(name).cloned()
    }
    fn read_into(&self, _name: &str, first: u64, out: &mut [f32]) -> rknot::Result<()> {
        for (i, v) in out.iter_mut().enumerate() {
            *v = (((first as usize + i) % 7) as f32 - 3.0) * 0.01;
        }
        Ok(())
    }
    fn metadata(&self) -> &Metadata {
        &self.md
    }
    fn describe(&self) -> String {
        "memory".into()
    }
    fn bits_per_weight(&self, _: &[String]) -> Option<f64> {
        None
    }
}

fn tiny_llama() -> Mem {
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    for (k, v) in [
        ("block_count", 1),
        ("embedding_length", 8),
        ("feed_forward_length", 12),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
    ] {
        md.push(format!("llama.{k}"), MetaValue::U32(v));
    }
    md.push(
        "llama.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-5),
    );
    let mut shapes = HashMap::new();
    for (n, s) in [
        ("token_embd.weight", vec![10, 8]),
        ("output_norm.weight", vec![8]),
        ("blk.0.attn_norm.weight", vec![8]),
        ("blk.0.attn_q.weight", vec![8, 8]),
        ("blk.0.attn_k.weight", vec![4, 8]),
        ("blk.0.attn_v.weight", vec![4, 8]),
        ("blk.0.attn_output.weight", vec![8, 8]),
        ("blk.0.ffn_norm.weight", vec![8]),
        ("blk.0.ffn_gate.weight", vec![12, 8]),
        ("blk.0.ffn_up.weight", vec![12, 8]),
        ("blk.0.ffn_down.weight", vec![8, 12]),
    ] {
        shapes.insert(n.to_string(), s);
    }
    Mem { md, shapes }
}

#[test]
fn errors_name_the_missing_key_or_the_bad_tensor() {
    let ok = tiny_llama();
    let m = Model::load(&ok).unwrap();
    assert!(m.config.tied_embeddings);
    let logits = m
        .forward(&[1, 2, 3], &mut KvCache::new(&m.config), 0..3)
        .unwrap();
    assert_eq!(logits.len(), 30);
    assert!(
        m.forward(&[10], &mut KvCache::new(&m.config), 0..1)
            .is_err(),
        "token id past the vocab"
    );

    let mut no_key = tiny_llama();
    no_key
        .md
        .entries
        .retain(|(k, _)| k != "llama.feed_forward_length");
    let e = Model::load(&no_key).err().unwrap().to_string();
    assert!(e.contains("llama.feed_forward_length"), "{e}");

    let mut bad_shape = tiny_llama();
    bad_shape
        .shapes
        .insert("blk.0.attn_k.weight".into(), vec![8, 8]);
    let e = Model::load(&bad_shape).err().unwrap().to_string();
    assert!(
        e.contains("blk.0.attn_k.weight") && e.contains("[8, 8]"),
        "{e}"
    );

    let mut missing = tiny_llama();
    missing.shapes.remove("blk.0.ffn_up.weight");
    let e = Model::load(&missing).err().unwrap().to_string();
    assert!(e.contains("blk.0.ffn_up.weight"), "{e}");

    // Hostile sizes are errors, not aborts or endless loops.
    let mut layers = tiny_llama();
    layers.md.entries.retain(|(k, _)| k != "llama.block_count");
    layers.md.push("llama.block_count", MetaValue::U64(1 << 40));
    let e = Model::load(&layers).err().unwrap().to_string();
    assert!(e.contains("blk.1.attn_norm.weight"), "{e}");
    let mut heads = tiny_llama();
    heads
        .md
        .entries
        .retain(|(k, _)| k != "llama.attention.key_length");
    heads
        .md
        .push("llama.attention.key_length", MetaValue::U64(u64::MAX / 4));
    let e = Model::load(&heads).err().unwrap().to_string();
    assert!(e.contains("overflow"), "{e}");

    let mut arch = tiny_llama();
    arch.md.entries[0].1 = MetaValue::String("mamba".into());
    let e = Model::load(&arch).err().unwrap().to_string();
    assert!(e.contains("mamba"), "{e}");

    // A tokenizer whose token_type disagrees with its tokens names both.
    let mut md = Metadata::default();
    md.push("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    md.push(
        "tokenizer.ggml.tokens",
        MetaValue::Array {
            elem: MetaType::String,
            values: vec![MetaValue::String("a".into())],
        },
    );
    md.push(
        "tokenizer.ggml.token_type",
        MetaValue::Array {
            elem: MetaType::I32,
            values: vec![],
        },
    );
    let e = Tokenizer::from_metadata(&md).err().unwrap().to_string();
    assert!(e.contains("tokenizer.ggml.token_type"), "{e}");
}
