//! Bounded-time mutation fuzzing of every reader, on stable Rust.
//!
//! One test per reader (SK32, dense .knot, .rknot, GGUF, safetensors, and
//! SK32 + GGUF layered). Each starts from small valid files written by the crate's
//! writers (`tests/common/malformed_corpus.rs`), mutates a copy (bit flips,
//! interesting bytes and integer fields, truncation, junk, duplicated or
//! deleted ranges; for the JSON-headed formats also structured edits of the
//! header JSON, keys reordered, re-serialized behind a correct length
//! prefix), opens it with `backend::open` and, if it opens, reads bounded
//! ranges of every tensor. Passing means every call returned `Ok` or `Err`.
//!
//! `fuzz_header_parsers` drives the typed header parsers directly (no
//! backend): mutated KNOT meta JSON through `read_container` and
//! `Sk32File`/`DenseKnotFile::from_container`, mutated .rknot headers
//! through `RknotFile::read`, mutated model-metadata JSON (typed and plain
//! values, value before type, nested arrays) through
//! `parse_metadata_json`, and GGUFs with random metadata trees, then byte
//! mutations, through `GgufFile::read`. What parses must survive a
//! write/parse round trip unchanged; what a file reader refuses must name
//! the file and a byte offset.
//!
//! - `RKNOT_FUZZ_SECS`: time budget per target (default 2; CI, through
//!   .ci/run and tools/test.sh, uses 30);
//! - `RKNOT_FUZZ_SEED`: base seed (default: from the clock; always printed);
//! - `RKNOT_FUZZ_REPRO=file[,dense]`: run one saved input (see
//!   `fuzz_repro`), without catching the panic.
//!
//! A panicking input is saved to `<target dir>/fuzz-failures/`. Guards: a
//! global allocator that aborts on any single allocation above 1 GiB (sizes
//! from a file must be checked against the file before allocating), and a
//! watchdog that aborts if one case runs longer than 20 s; both print the
//! target, seed and iteration and save the input first.
//!
//! The guards live in `fuzz_readers/guards.rs`, the random source and the
//! mutations in `fuzz_readers/mutate.rs`; this file drives them.

#[path = "common/malformed_corpus.rs"]
mod corpus;
#[path = "fuzz_readers/guards.rs"]
mod guards;
#[path = "fuzz_readers/mutate.rs"]
mod mutate;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rknot::backend::{self, Availability};
use rknot::format::meta::{MetaType, MetaValue, Metadata};
use serde_json::{Value, json};

use guards::*;
use mutate::*;

// -------------------------------------------------------------- exercising

#[derive(Default)]
struct Stats {
    iterations: u64,
    opened: u64,
    open_errors: BTreeMap<String, u64>,
    reads_ok: u64,
    reads_err: u64,
    /// Open errors whose message names none of the input files.
    unnamed: Vec<String>,
}

/// Open the input and read bounded ranges of every tensor. Panics (only)
/// on a broken invariant.
fn exercise(paths: &[PathBuf], rng: &mut Rng, stats: &mut Stats) {
    let dense = paths.get(1).map(PathBuf::as_path);
    let b = match backend::open(&paths[0], dense) {
        Ok(b) => b,
        Err(e) => {
            let count = stats
                .open_errors
                .entry(format!("{:?}", e.kind()))
                .or_default();
            *count += 1;
            let shown = e.to_string();
            if *count <= env_u64("RKNOT_FUZZ_VERBOSE").unwrap_or(0) {
                println!("sample {:?}: {shown}", e.kind());
            }
            let named = paths
                .iter()
                .any(|p| shown.contains(&p.display().to_string()));
            if !named && stats.unnamed.len() < 20 {
                stats.unnamed.push(shown);
            }
            return;
        }
    };
    stats.opened += 1;
    let mut tally = |r: rknot::Result<()>| match r {
        Ok(()) => stats.reads_ok += 1,
        Err(_) => stats.reads_err += 1,
    };
    let table = b.tensors();
    let mut buf = vec![0f32; 4096];
    let mut bytes = vec![0u8; 4099];
    for (i, info) in table.entries().iter().enumerate() {
        assert_eq!(
            b.find(&info.name.dot).ok(),
            Some(i),
            "find {}",
            info.name.dot
        );
        let _ = b.find(&info.name.underscore);
        let n = info.n_elements;
        let size = info.served_bytes();
        let _ = info.payload_bits_per_weight();
        let k = n.min(4096) as usize;
        tally(b.read_f32(i, 0, &mut buf[..k]));
        tally(b.read_f32(i, n - k as u64, &mut buf[..k]));
        for _ in 0..3 {
            let start = rng.below(n);
            let len = 1 + rng.below((n - start).min(4096)) as usize;
            tally(b.read_f32(i, start, &mut buf[..len]));
        }
        let past = b.read_f32(i, n, &mut buf[..1]);
        assert!(
            past.is_err(),
            "read past the end of {} succeeded",
            info.name.dot
        );
        assert!(b.read_f32(i, u64::MAX - 1, &mut buf[..4]).is_err());
        for _ in 0..2 {
            let off = rng.below(size.saturating_add(16));
            let len = 1 + rng.upto(bytes.len());
            tally(b.read_bytes(i, off, &mut bytes[..len]).map(|_| ()));
        }
        tally(
            b.read_bytes(i, size.saturating_sub(5), &mut bytes[..7])
                .map(|_| ()),
        );
        if info.availability == Availability::Available {
            // Reads of an available tensor may fail (a bad block), but a
            // clipped read must say how much it wrote.
            if let Ok(w) = b.read_bytes(i, size.saturating_sub(3), &mut bytes[..8]) {
                assert_eq!(w as u64, size.min(3), "clipped read of {}", info.name.dot);
            }
        }
    }
    assert!(b.read_f32(table.len(), 0, &mut buf[..1]).is_err());
    let _ = b.find("no.such.tensor");
    let _ = rknot::report::inspect_json(&*b);
    let _ = rknot::report::inspect_text(&*b);
}

// ---------------------------------------------------------------- driver

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Fuzz one reader: `seeds` are inputs of one file, or of a primary and a
/// fallback (`exts` names their extensions).
fn fuzz(target: &'static str, exts: &[&str], seeds: Vec<Vec<Vec<u8>>>) {
    let secs = env_u64("RKNOT_FUZZ_SECS").unwrap_or(2);
    let base_seed = env_u64("RKNOT_FUZZ_SEED").unwrap_or_else(now_ms);
    let seed = base_seed ^ fnv(target);
    println!("fuzz {target}: RKNOT_FUZZ_SEED={base_seed}, {secs} s");
    let tmp = tempfile::tempdir().expect("tempdir");
    let paths: Vec<PathBuf> = exts
        .iter()
        .enumerate()
        .map(|(i, e)| tmp.path().join(format!("{target}-{i}.{e}")))
        .collect();
    let write = |files: &[Vec<u8>]| {
        for (p, f) in paths.iter().zip(files) {
            std::fs::write(p, f).expect("write input");
        }
    };

    // The seeds themselves must open and read.
    let layouts: Vec<Vec<FieldMap>> = seeds
        .iter()
        .map(|s| s.iter().map(|f| layout_of(f)).collect())
        .collect();
    for (si, s) in seeds.iter().enumerate() {
        write(s);
        let b = backend::open(&paths[0], paths.get(1).map(PathBuf::as_path))
            .unwrap_or_else(|e| panic!("seed {si} of {target} does not open: {e}"));
        for (i, info) in b.tensors().entries().iter().enumerate() {
            let k = info.n_elements.min(4096) as usize;
            let r = b.read_f32(i, 0, &mut vec![0f32; k]);
            assert_eq!(
                r.is_ok(),
                info.is_available(),
                "seed {si} {}: {r:?}",
                info.name.dot
            );
        }
    }

    let (slot, watchdog) = install_guards(target, base_seed, paths.clone());

    let mut rng = Rng::new(seed);
    let mut stats = Stats::default();
    let mut panics = Vec::new();
    let start = Instant::now();
    let budget = Duration::from_secs(secs);
    while start.elapsed() < budget {
        let si = rng.upto(seeds.len());
        let mut files = seeds[si].clone();
        let which = match files.len() {
            1 => 1,
            _ => 1 + rng.below(3), // 1 = primary, 2 = fallback, 3 = both
        };
        for (fi, f) in files.iter_mut().enumerate() {
            if which & (1 << fi) != 0 {
                mutate(f, &mut rng, &layouts[si][fi]);
            }
        }
        write(&files);
        let mut case_rng = Rng::new(rng.next());
        let it = stats.iterations;
        slot.iteration.store(it, Ordering::SeqCst);
        slot.busy_since_ms.store(now_ms(), Ordering::SeqCst);
        let r = catch_unwind(AssertUnwindSafe(|| {
            exercise(&paths, &mut case_rng, &mut stats);
        }));
        slot.busy_since_ms.store(0, Ordering::SeqCst);
        stats.iterations += 1;
        if let Err(p) = r {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let saved = save_inputs(&slot.failures, target, base_seed, it, "panic", &paths);
            panics.push(format!(
                "iteration {it}: {msg}\n    input saved as {saved:?}"
            ));
            if panics.len() >= 5 {
                break;
            }
        }
    }
    slot.done.store(true, Ordering::SeqCst);
    let _ = watchdog.join();
    CURRENT.with(|c| c.set(None));

    println!(
        "fuzz {target}: {} iterations in {:.1} s, {} opened, reads {} ok / {} err",
        stats.iterations,
        start.elapsed().as_secs_f64(),
        stats.opened,
        stats.reads_ok,
        stats.reads_err
    );
    println!(
        "fuzz {target}: open errors by kind: {:?}",
        stats.open_errors
    );
    for u in &stats.unnamed {
        println!("fuzz {target}: open error naming no input file: {u}");
    }
    assert!(
        panics.is_empty(),
        "fuzz {target} (RKNOT_FUZZ_SEED={base_seed}): {} panicking input(s):\n{}\n\
         replay one with RKNOT_FUZZ_REPRO=<file>[,<dense>] cargo test --profile ci --test \
         fuzz_readers fuzz_repro -- --nocapture",
        panics.len(),
        panics.join("\n")
    );
}

fn single(seeds: Vec<Vec<u8>>) -> Vec<Vec<Vec<u8>>> {
    seeds.into_iter().map(|s| vec![s]).collect()
}

#[test]
fn fuzz_sk32() {
    fuzz("sk32", &["sk32"], single(corpus::sk32_seeds()));
}

#[test]
fn fuzz_dense_knot() {
    fuzz("knot", &["knot"], single(corpus::knot_seeds()));
}

#[test]
fn fuzz_rknot() {
    fuzz("rknot", &["rknot"], single(corpus::rknot_seeds()));
}

#[test]
fn fuzz_gguf() {
    fuzz("gguf", &["gguf"], single(corpus::gguf_seeds()));
}

/// Small valid safetensors files: every decoded dtype, an integer tensor,
/// metadata, a scalar, a zero-sized tensor; a 2-D F32 tensor under a name a
/// known family would map (no config.json beside it: HF names).
fn safetensors_seeds() -> Vec<Vec<u8>> {
    let file = |tensors: &[(&str, &str, &[u64], usize)]| {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut data = Vec::new();
        for (i, (name, dtype, shape, bytes)) in tensors.iter().enumerate() {
            let begin = data.len();
            data.extend((0..*bytes).map(|k| (k * 37 + i * 11) as u8 & 0x3f));
            header.insert(
                (*name).into(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        let text = Value::Object(header).to_string();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(text.as_bytes());
        out.extend(data);
        out
    };
    vec![
        file(&[
            (
                "model.layers.0.self_attn.q_proj.weight",
                "F32",
                &[4, 8],
                128,
            ),
            ("a.bf16", "BF16", &[16], 32),
            ("a.f16", "F16", &[2, 3], 12),
            ("a.f64", "F64", &[3], 24),
            ("a.e4m3", "F8_E4M3", &[5, 2], 10),
            ("a.e5m2", "F8_E5M2", &[7], 7),
        ]),
        file(&[
            ("ids", "I64", &[3], 24),
            ("s", "F32", &[], 4),
            ("empty", "F32", &[0, 4], 0),
            ("w", "F16", &[1, 1, 2, 2], 8),
        ]),
    ]
}

#[test]
fn fuzz_safetensors() {
    fuzz("safetensors", &["safetensors"], single(safetensors_seeds()));
}

#[test]
fn fuzz_layered_sk32_gguf() {
    let seeds = corpus::layered_seeds()
        .into_iter()
        .map(|(a, b)| vec![a, b])
        .collect();
    fuzz("layered", &["sk32", "gguf"], seeds);
}

// ------------------------------------------------- header parsers directly

/// Model metadata exercising every value form the JSON parser accepts.
fn sample_metadata() -> Metadata {
    let mut md = corpus::gguf_metadata();
    md.push("x.i8", MetaValue::I8(-3));
    md.push("x.u64", MetaValue::U64(u64::MAX));
    md.push("x.i64", MetaValue::I64(i64::MIN));
    md.push("x.f32", MetaValue::F32(f32::INFINITY));
    md.push("x.f64", MetaValue::F64(0.1));
    md.push("x.bool", MetaValue::Bool(true));
    md.push("x.str", MetaValue::String("a\u{1b}b".into()));
    md.push(
        "x.nested",
        MetaValue::Array {
            elem: MetaType::Array,
            values: vec![MetaValue::Array {
                elem: MetaType::I16,
                values: vec![MetaValue::I16(-2), MetaValue::I16(7)],
            }],
        },
    );
    md.push(
        "x.floats",
        MetaValue::Array {
            elem: MetaType::F32,
            values: vec![MetaValue::F32(f32::NAN), MetaValue::F32(1.5)],
        },
    );
    md
}

/// The metadata as JSON, with some values plain (as other tools write).
fn sample_metadata_json(rng: &mut Rng) -> Value {
    let mut v = sample_metadata().to_json();
    if let Value::Object(m) = &mut v {
        for (_, x) in m.iter_mut() {
            if rng.chance(3)
                && let Some(plain) = x.get("value").cloned()
                && !plain.is_object()
            {
                *x = plain;
            }
        }
        if rng.chance(3) {
            m.insert("plain.array".into(), json!([1, 2, 3]));
        }
    }
    v
}

/// A random metadata value: scalars of every type, strings with control
/// characters, arrays (nested up to `depth`).
fn random_value(rng: &mut Rng, depth: u32) -> MetaValue {
    let ty = MetaType::from_id(rng.below(13) as u32).unwrap_or(MetaType::U8);
    random_of(rng, ty, depth)
}

fn random_of(rng: &mut Rng, ty: MetaType, depth: u32) -> MetaValue {
    let x = *rng.pick(INTERESTING);
    match ty {
        MetaType::U8 => MetaValue::U8(x as u8),
        MetaType::I8 => MetaValue::I8(x as i8),
        MetaType::U16 => MetaValue::U16(x as u16),
        MetaType::I16 => MetaValue::I16(x as i16),
        MetaType::U32 => MetaValue::U32(x as u32),
        MetaType::I32 => MetaValue::I32(x as i32),
        MetaType::U64 => MetaValue::U64(x),
        MetaType::I64 => MetaValue::I64(x as i64),
        MetaType::F32 => MetaValue::F32(f32::from_bits(rng.next() as u32)),
        MetaType::F64 => MetaValue::F64(f64::from_bits(rng.next())),
        MetaType::Bool => MetaValue::Bool(rng.chance(2)),
        MetaType::String => MetaValue::String(
            (0..rng.upto(12))
                .map(|_| *rng.pick(&['a', '\u{1b}', '\u{9b}', '"', '\\', 'é', '\0']))
                .collect(),
        ),
        MetaType::Array => {
            let elem = if depth > 1 && rng.chance(4) {
                MetaType::Array
            } else {
                MetaType::from_id(rng.below(13) as u32)
                    .filter(|t| *t != MetaType::Array)
                    .unwrap_or(MetaType::U32)
            };
            // Long arrays only at the top: nested ones multiply.
            let n = if depth >= 3 && rng.chance(8) {
                rng.upto(3000)
            } else {
                rng.upto(6)
            };
            MetaValue::Array {
                elem,
                values: (0..n).map(|_| random_of(rng, elem, depth - 1)).collect(),
            }
        }
    }
}

/// Typed JSON text of metadata (NaN and infinities as strings): what a
/// round trip must reproduce.
fn typed_text(md: &Metadata) -> String {
    serde_json::to_string(&md.to_json()).unwrap_or_default()
}

/// A header reader's error must name the file and the byte offset it is
/// about (rknot's rule: file, tensor and offset; a tensor is named where
/// the error concerns one, which a random input cannot tell).
#[track_caller]
fn assert_located(e: &rknot::Error, path: &Path) {
    assert_eq!(e.file(), Some(path), "error without its file: {e}");
    assert!(e.offset().is_some(), "error without a byte offset: {e}");
}

/// The value, or `None` after checking the error with [`assert_located`].
#[track_caller]
fn located<T>(r: rknot::Result<T>, path: &Path) -> Option<T> {
    r.map_err(|e| assert_located(&e, path)).ok()
}

/// One case of the parser fuzzer: a file to write (or `None` for the
/// in-memory metadata parser) and what to do with it.
fn parsers_case(rng: &mut Rng, path: &Path) {
    use rknot::format::container::read_container;
    use rknot::format::gguf::{GgufFile, write_gguf};
    use rknot::format::knot::DenseKnotFile;
    use rknot::format::meta::parse_metadata_json;
    use rknot::format::rknot::RknotFile;
    use rknot::format::sk32::Sk32File;
    use rknot::source::SourceFile;

    match rng.below(4) {
        0 | 1 => {
            // A KNOT or .rknot header, structurally edited.
            let seeds = if rng.chance(2) {
                let mut s = corpus::sk32_seeds();
                s.extend(corpus::knot_seeds());
                s
            } else {
                corpus::rknot_seeds()
            };
            let seed = rng.pick(&seeds).clone();
            let knot = seed.starts_with(b"KNOT");
            let (mut v, rest) = if knot {
                corpus::knot_split(&seed).map(|(v, rest)| (v, corpus::RknotRest::V2 { body: rest }))
            } else {
                corpus::rknot_split_any(&seed)
            }
            .expect("seed splits");
            if knot && rng.chance(2) {
                // Give the dense files rich metadata to mutate.
                if let Some(m) = v.get_mut("metadata") {
                    *m = sample_metadata_json(rng);
                }
            }
            for _ in 0..1 + rng.below(4) {
                mutate_json(&mut v, rng);
            }
            let mut text = to_text(&v, rng);
            if rng.chance(6) {
                mutate_text(&mut text, rng);
            }
            let bytes = match (&rest, knot) {
                (corpus::RknotRest::V2 { body }, true) => corpus::knot_raw(&text, body),
                _ => corpus::rknot_raw_any(&text, &rest),
            };
            std::fs::write(path, bytes).expect("write input");
            let src = SourceFile::open(path).expect("open input");
            if knot {
                if let Some(c) = located(read_container(&src), path) {
                    if c.has_sketches() {
                        located(Sk32File::from_container(&src, &c), path);
                    }
                    if c.has_tensors()
                        && let Some(f) = located(DenseKnotFile::from_container(&src, &c), path)
                    {
                        let text = typed_text(&f.metadata);
                        let back = parse_metadata_json(text.as_bytes(), text.len() as u64)
                            .expect("parsed metadata re-parses");
                        assert_eq!(typed_text(&back), text, "metadata round trip");
                    }
                }
            } else if let Some(f) = located(RknotFile::read(&src), path) {
                for t in &f.tensors {
                    assert_eq!(t.blocks.len(), t.grid.n_blocks(), "{}", t.name);
                }
            }
        }
        2 => {
            // A metadata object alone.
            let mut v = sample_metadata_json(rng);
            for _ in 0..1 + rng.below(4) {
                mutate_json(&mut v, rng);
            }
            let mut text = to_text(&v, rng);
            if rng.chance(6) {
                mutate_text(&mut text, rng);
            }
            std::fs::write(path, &text).expect("write input");
            if let Ok(md) = parse_metadata_json(&text, text.len() as u64) {
                let typed = typed_text(&md);
                let back = parse_metadata_json(typed.as_bytes(), typed.len() as u64)
                    .expect("parsed metadata re-parses");
                assert_eq!(
                    typed_text(&back),
                    typed,
                    "metadata round trip of {}",
                    String::from_utf8_lossy(&text)
                );
            }
        }
        _ => {
            // A GGUF with random metadata, then byte mutations.
            let mut md = Metadata::default();
            for i in 0..1 + rng.below(6) {
                md.push(format!("k{i}.\u{1b}"), random_value(rng, 3));
            }
            let mut bytes = Vec::new();
            let tensors = corpus::gguf_base_tensors();
            let datas: Vec<Vec<u8>> = tensors
                .iter()
                .enumerate()
                .map(|(i, (_, d, t))| corpus::ggml_data(*t, d.iter().product(), i))
                .collect();
            let ts: Vec<(String, Vec<u64>, rknot::quant::GgmlType, &[u8])> = tensors
                .iter()
                .zip(&datas)
                .map(|((n, d, t), x)| (n.clone(), d.clone(), *t, x.as_slice()))
                .collect();
            if write_gguf(&mut bytes, &md, &ts, 32).is_err() {
                return;
            }
            let lay = gguf_layout(&bytes);
            let clean = rng.chance(3);
            if !clean {
                for _ in 0..1 + rng.below(4) {
                    mutate_bytes(&mut bytes, rng, &lay);
                }
            }
            std::fs::write(path, &bytes).expect("write input");
            let src = SourceFile::open(path).expect("open input");
            let r = GgufFile::read(&src);
            if let Err(e) = &r {
                assert_located(e, path);
            }
            if clean {
                let g = r.expect("a GGUF the writer wrote reads");
                assert_eq!(typed_text(&g.metadata), typed_text(&md), "GGUF metadata");
            }
        }
    }
}

#[test]
fn fuzz_header_parsers() {
    let target = "parsers";
    let secs = env_u64("RKNOT_FUZZ_SECS").unwrap_or(2);
    let base_seed = env_u64("RKNOT_FUZZ_SEED").unwrap_or_else(now_ms);
    println!("fuzz {target}: RKNOT_FUZZ_SEED={base_seed}, {secs} s");
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("parsers-0.bin");
    let (slot, watchdog) = install_guards(target, base_seed, vec![path.clone()]);
    let mut rng = Rng::new(base_seed ^ fnv(target));
    let (start, budget) = (Instant::now(), Duration::from_secs(secs));
    let mut panics = Vec::new();
    let mut it = 0u64;
    while start.elapsed() < budget {
        let mut case_rng = Rng::new(rng.next());
        slot.iteration.store(it, Ordering::SeqCst);
        slot.busy_since_ms.store(now_ms(), Ordering::SeqCst);
        let r = catch_unwind(AssertUnwindSafe(|| parsers_case(&mut case_rng, &path)));
        slot.busy_since_ms.store(0, Ordering::SeqCst);
        if let Err(p) = r {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let saved = save_inputs(
                &slot.failures,
                target,
                base_seed,
                it,
                "panic",
                std::slice::from_ref(&path),
            );
            panics.push(format!(
                "iteration {it}: {msg}\n    input saved as {saved:?}"
            ));
            if panics.len() >= 5 {
                break;
            }
        }
        it += 1;
    }
    slot.done.store(true, Ordering::SeqCst);
    let _ = watchdog.join();
    CURRENT.with(|c| c.set(None));
    println!(
        "fuzz {target}: {it} iterations in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    assert!(
        panics.is_empty(),
        "fuzz {target} (RKNOT_FUZZ_SEED={base_seed}): {} panicking case(s):\n{}",
        panics.len(),
        panics.join("\n")
    );
}

/// `RKNOT_FUZZ_REPRO=file[,dense]`: run one saved input without catching
/// the panic (for a backtrace). A helper run by hand, not a check: when the
/// variable is unset it does nothing and passes.
#[test]
fn fuzz_repro() {
    let Ok(spec) = std::env::var("RKNOT_FUZZ_REPRO") else {
        return;
    };
    let paths: Vec<PathBuf> = spec.split(',').map(PathBuf::from).collect();
    let mut stats = Stats::default();
    let seed = env_u64("RKNOT_FUZZ_SEED").unwrap_or(1);
    exercise(&paths, &mut Rng::new(seed), &mut stats);
    println!(
        "repro {spec}: opened {}, open errors {:?}, reads {} ok / {} err",
        stats.opened, stats.open_errors, stats.reads_ok, stats.reads_err
    );
    for u in &stats.unnamed {
        println!("open error naming no input file: {u}");
    }
}

/// `RKNOT_FUZZ_GUARD_SELFTEST=alloc` (or `hang`): check by hand that the
/// allocation guard (or the watchdog) aborts the process with its message.
/// A helper run by hand, not a check: when the variable is unset it does
/// nothing and passes.
#[test]
fn fuzz_guard_selftest() {
    let Ok(which) = std::env::var("RKNOT_FUZZ_GUARD_SELFTEST") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let input = tmp.path().join("selftest-0.bin");
    std::fs::write(&input, b"selftest").expect("write input");
    let (slot, _watchdog) = install_guards("selftest", 0, vec![input]);
    slot.iteration.store(7, Ordering::SeqCst);
    slot.busy_since_ms.store(now_ms(), Ordering::SeqCst);
    if which == "alloc" {
        let v = vec![0u8; std::hint::black_box(MAX_ALLOC + 1)];
        println!("allocated {} bytes: the guard did not fire", v.len());
    } else {
        std::thread::sleep(Duration::from_millis(HANG_MS + 5_000));
        println!("slept past the hang limit: the watchdog did not fire");
    }
    panic!("guard self-test: the process should have aborted");
}
