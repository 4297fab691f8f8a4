//! The daemon's memory and decode work under small caches and large
//! chunks, through real mounts of synthetic GGUF files (no model needed):
//!
//! - read-ahead never decodes much more than a sequential reader is served,
//!   whatever the cache size (issue 9, item 18);
//! - with large chunks and many threads, peak RSS stays within the formula
//!   docs/OPERATIONS.md gives for `--cache-mb` (issue 9, item 23);
//! - hf/'s tokenizer files cost a mount next to nothing, however large the
//!   tokenizer (issue 26, item 4).

mod common;

use common::needs;

use std::io::Read;
use std::path::{Path, PathBuf};

use common::mount::{Mounted, fuse_available};
use rknot::format::gguf::write_gguf;
use rknot::format::meta::{MetaValue, Metadata};
use rknot::quant::GgmlType;
use rknot::synth::{self, Rng};

const MIB: u64 = 1 << 20;

/// A directory for the synthetic model: tmpfs when there is one, so the
/// source's bytes never wait on a disk.
fn model_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

/// A GGUF of `tensors` 2-D tensors of `elems` elements each, named
/// `t{i}.weight`, stored in the given types in turn. Tensors of one type
/// share their (random) bytes: the decode work is the same and the file is
/// written from a few buffers.
fn synthetic_gguf(dir: &Path, tensors: usize, elems: u64, types: &[GgmlType]) -> PathBuf {
    let cols = 4096u64;
    assert_eq!(elems % cols, 0);
    let mut rng = Rng(0x6d65_6d6f_7279_0001);
    let data: Vec<Vec<u8>> = types
        .iter()
        .map(|&ty| synth::ggml_blocks(ty, elems, 0.02, &mut rng))
        .collect();
    let list: Vec<(String, Vec<u64>, GgmlType, &[u8])> = (0..tensors)
        .map(|i| {
            let k = i % types.len();
            (
                format!("t{i}.weight"),
                vec![cols, elems / cols],
                types[k],
                data[k].as_slice(),
            )
        })
        .collect();
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("memtest".into()));
    let path = dir.join("model.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_gguf(&mut f, &md, &list, 32).unwrap();
    drop(f);
    path
}

fn drop_cache(m: &Mounted) {
    std::fs::write(m.path("ctl"), "drop-cache\n").unwrap();
}

/// Read a whole file with `bs`-byte reads; returns the bytes read.
fn read_all(p: &Path, bs: usize) -> u64 {
    let mut f = std::fs::File::open(p).unwrap();
    let mut buf = vec![0u8; bs];
    let mut n = 0u64;
    loop {
        let got = f.read(&mut buf).unwrap();
        if got == 0 {
            return n;
        }
        n += got as u64;
    }
}

/// Threads that keep every CPU busy until dropped: the races between the
/// daemon's FUSE and read-ahead threads that decoded chunks twice showed on
/// a busy machine (a thread preempted at the wrong moment), rarely on an
/// idle one.
struct BusyCpus {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyCpus {
    fn new() -> BusyCpus {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let n = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        BusyCpus { stop, threads }
    }
}

impl Drop for BusyCpus {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

needs! { [fuse]
/// A cold sequential read of one tensor decodes each chunk about once at
/// any cache size (issue 9, item 18: decoded/served <= 1.2 at any cache of
/// 2 chunks or more): the read-ahead window never holds more chunks than
/// the cache keeps beside the one being read, and read-ahead never evicts
/// a chunk nobody has read. Before, the window grew to 32 chunks whatever
/// the cache: 2.0-2.7x the bytes served were decoded at 1, 2, 3 and 8 MiB.
///
/// At 2 chunks on a busy machine some chunks were still decoded twice
/// (1.02-1.23, so the 1.2 target failed now and then): read-ahead requests
/// served after the reader had passed their chunk, read-ahead evicting the
/// chunk the reader was in, and (page cache) the later of the kernel's two
/// concurrent reads evicting the chunk the earlier one needed. With direct
/// I/O the daemon sees one read at a time, and with 2 chunks or more it now
/// decodes each chunk exactly once. Through the page cache a read the
/// kernel sent first can still reach the daemon's handler after the next
/// one was served (its FUSE thread delayed in between; seen in 2 of 30
/// runs with the CPUs busy, re-decoding two chunks), so those cases are
/// held to the 1.2. The 2-chunk cases run three times each with every CPU kept
/// busy ([`BusyCpus`]): before the fix they failed 5 runs out of 5.
fn sequential_read_decodes_each_chunk_about_once_at_any_cache_size() {
    if !fuse_available() {
        return;
    }
    let dir = model_dir();
    // One 64 MiB tensor (decoded): 64 chunks of 1 MiB.
    let model = synthetic_gguf(dir.path(), 1, 16 << 20, &[GgmlType::Q8_0]);
    // (cache MiB, mount arguments, runs)
    let cases: &[(Option<u64>, &[&str], u32)] = &[
        (Some(1), &[], 1),
        (Some(2), &[], 3),
        (Some(3), &[], 1),
        (Some(8), &[], 1),
        (None, &[], 1),
        (Some(2), &["-o", "direct_io"], 3),
        (Some(3), &["-o", "direct_io"], 1),
        (Some(8), &["-o", "direct_io"], 1),
        (Some(8), &["-o", "prefetch_threads=4"], 1),
    ];
    let mut failures = Vec::new();
    for &(cache_mb, extra, runs) in cases {
        let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if let Some(mb) = cache_mb {
            args.extend(["--cache-mb".to_string(), mb.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let direct_io = extra.contains(&"direct_io");
        let busy = (runs > 1).then(BusyCpus::new);
        for run in 1..=runs {
            // A new mount each run: the page cache must not serve the file.
            let m = Mounted::new(&model, &args);
            drop_cache(&m);
            let before = m.ctl_json();
            let read = read_all(&m.path("t0.weight.f32"), 128 << 10);
            assert_eq!(read, 64 * MIB);
            let after = m.ctl_json();
            let delta = |section: &str, key: &str| {
                after[section][key].as_u64().unwrap() - before[section][key].as_u64().unwrap()
            };
            let (decoded, served) = (
                delta("cache", "bytes_decoded"),
                delta("reads", "bytes_served"),
            );
            let ratio = decoded as f64 / served as f64;
            let capacity_chunks = after["cache"]["capacity"].as_u64().unwrap()
                / after["cache"]["chunk_bytes"].as_u64().unwrap();
            let window = after["prefetch"]["max_window_chunks"].as_u64().unwrap();
            let case = format!("cache {cache_mb:?} MiB {extra:?} run {run}");
            eprintln!(
                "{case}: decoded {decoded} served {served} ratio {ratio:.3}; \
                 window {window} of {capacity_chunks} chunks"
            );
            // ctl.json reports the window actually used: at most half the cache.
            if window > capacity_chunks / 2 {
                failures.push(format!(
                    "{case}: window {window} > half of {capacity_chunks} chunks"
                ));
            }
            if ratio > 1.2 {
                failures.push(format!("{case}: decoded/served {ratio:.3} > 1.2"));
            }
            if direct_io && capacity_chunks >= 2 && decoded != served {
                failures.push(format!(
                    "{case}: decoded {decoded} != served {served}: a chunk was decoded twice"
                ));
            }
        }
        drop(busy);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
}

needs! { [fuse]
/// Peak RSS with 16 MiB chunks, 16 FUSE threads and 4 read-ahead threads,
/// 16 readers of different tensors at once through a 64 MiB cache: within
/// the formula of docs/OPERATIONS.md (`--cache-mb`),
/// fixed + cache + D x S + 32 MiB + T x 1 MiB, where fixed is the daemon's
/// peak once mounted, before any read. Before, in-flight decodes, chunks
/// held by replies after eviction and per-thread scratch buffers (up to
/// 2 x 32 MiB each) took it to 574 MiB.
fn peak_rss_stays_within_the_formula_with_large_chunks() {
    if !fuse_available() {
        return;
    }
    let dir = model_dir();
    // 16 tensors of 32 MiB decoded (two 16 MiB chunks each), stored as
    // Q8_0, F16 and F32: the F32 ones need 16 MiB of source bytes per chunk.
    let types = [GgmlType::Q8_0, GgmlType::F16, GgmlType::F32];
    let model = synthetic_gguf(dir.path(), 16, 8 << 20, &types);
    let (cache_mb, threads, prefetch_threads, chunk_kb) = (64u64, 16u64, 4u64, 16384u64);
    let opts = format!("chunk_kb={chunk_kb},threads={threads},prefetch_threads={prefetch_threads}");
    let m = Mounted::new(&model, &["--cache-mb", &cache_mb.to_string(), "-o", &opts]);
    let fixed_kib = m.peak_rss_kib();
    let files: Vec<PathBuf> = (0..16)
        .map(|i| m.path(&format!("t{i}.weight.f32")))
        .collect();
    for round in 0..2 {
        drop_cache(&m);
        std::thread::scope(|s| {
            for (i, p) in files.iter().enumerate() {
                // Half the readers use 1 MiB reads, half 128 KiB.
                let bs = if (i + round) % 2 == 0 {
                    1 << 20
                } else {
                    128 << 10
                };
                s.spawn(move || assert_eq!(read_all(p, bs), 32 * MIB));
            }
        });
    }
    let peak_kib = m.peak_rss_kib();
    let j = m.ctl_json();
    assert_eq!(j["cache"]["decode_errors"].as_u64(), Some(0));
    // The documented bound (docs/OPERATIONS.md, --cache-mb): every decoded
    // chunk buffer (cached, being decoded, held by a reply, recycled)
    // within the cache; D decodes at once, each reading S source bytes (at
    // most a chunk: the F32 tensors read a whole chunk); 32 MiB of idle
    // scratch buffers across threads; 1 MiB per thread for an assembled
    // reply.
    let chunk_mb = chunk_kb / 1024;
    let t = threads + prefetch_threads;
    let decodes = t.min((cache_mb / chunk_mb).max(1));
    let bound_mib = cache_mb + decodes * chunk_mb + 32 + t;
    let bound_kib = fixed_kib + bound_mib * 1024;
    eprintln!(
        "peak RSS {} MiB (fixed after mount {} MiB; bound {} MiB); pool {} B",
        peak_kib >> 10,
        fixed_kib >> 10,
        bound_kib >> 10,
        j["cache"]["pool_bytes"]
    );
    // The budget was never exceeded: the escape for callers that hold
    // chunks while asking for more logs a line.
    assert!(!m.log().contains("decoding beyond it"), "{}", m.log());
    assert!(
        peak_kib <= bound_kib,
        "peak RSS {peak_kib} KiB > fixed {fixed_kib} KiB + {bound_mib} MiB"
    );
}
}

/// The daemon's resident memory now, in KiB (VmRSS of /proc/PID/status).
fn rss_kib(m: &Mounted) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", m.pid())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{}/status", m.pid()))
}

/// tests/data/probe/tiny-qwen2.gguf (which gets `hf/`) with its tokenizer
/// replaced: `tokens` (all of type normal, no bos/eos), `merges`, and a
/// chat template; its `tokenizer.ggml.model` is byte-level BPE when `bpe`,
/// else "llama" (hf/ renders no tokenizer then). Returns the file and the
/// length of its header (everything before the tensor data).
fn qwen2_with_tokenizer(
    dir: &Path,
    bpe: bool,
    tokens: Vec<String>,
    merges: Vec<String>,
    template: Option<String>,
) -> (PathBuf, u64) {
    use rknot::format::meta::MetaType;
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/probe/tiny-qwen2.gguf");
    let b = rknot::backend::open(&src, None).unwrap();
    let mut md = b.summary().metadata.clone();
    md.entries.retain(|(k, _)| {
        !matches!(
            k.as_str(),
            "tokenizer.ggml.tokens"
                | "tokenizer.ggml.token_type"
                | "tokenizer.ggml.merges"
                | "tokenizer.chat_template"
                | "tokenizer.ggml.bos_token_id"
                | "tokenizer.ggml.eos_token_id"
                | "tokenizer.ggml.model"
        )
    });
    let model = if bpe { "gpt2" } else { "llama" };
    md.push("tokenizer.ggml.model", MetaValue::String(model.into()));
    let strings = |v: Vec<String>| MetaValue::Array {
        elem: MetaType::String,
        values: v.into_iter().map(MetaValue::String).collect(),
    };
    // The merges first: the parser refuses an array before reading it when
    // 32 bytes per element would not fit the budget for the header read so
    // far, and 2 M short merges after 1 M tokens would not.
    md.push("tokenizer.ggml.merges", strings(merges));
    md.push("tokenizer.ggml.tokens", strings(tokens));
    if let Some(t) = template {
        md.push("tokenizer.chat_template", MetaValue::String(t));
    }
    let data: Vec<(String, Vec<u64>, Vec<u8>)> = b
        .tensors()
        .entries()
        .iter()
        .map(|t| {
            let mut v = vec![0f32; t.n_elements as usize];
            b.read_f32(b.find(&t.name.dot).unwrap(), 0, &mut v).unwrap();
            (
                t.name.dot.clone(),
                t.shape.iter().rev().copied().collect(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = data
        .iter()
        .map(|(n, ne, d)| (n.clone(), ne.clone(), GgmlType::F32, &d[..]))
        .collect();
    let shapes: Vec<(String, Vec<u64>, GgmlType)> = tensors
        .iter()
        .map(|(n, ne, t, _)| (n.clone(), ne.clone(), *t))
        .collect();
    let header = rknot::format::gguf::encode_header(&md, &shapes, 32)
        .unwrap()
        .0
        .len() as u64;
    let path = dir.join(format!("big-tokenizer-{model}.gguf"));
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_gguf(&mut f, &md, &tensors, 32).unwrap();
    drop(f);
    (path, header)
}

/// 100 characters of GPT-2's byte alphabet, each two bytes of UTF-8
/// (Latin-1's printable ones stand for themselves; U+0100 on stand for
/// the control bytes).
fn alphabet() -> Vec<char> {
    ('\u{a1}'..='\u{ac}')
        .chain('\u{ae}'..='\u{ff}')
        .chain('\u{100}'..='\u{105}')
        .collect()
}

/// A byte-level BPE vocabulary of 100 units of two characters, every
/// pair and every triple of them (1,010,100 tokens), and the merges that
/// build them: each pair once, each triple twice (`a bc` and `ab c`):
/// 2,010,000 merges, all valid (both halves and their concatenation in the
/// vocabulary). Units of two characters keep the parsed metadata within
/// its cap (2 x header + 32 MiB: 32 bytes per value).
fn big_merges() -> (Vec<String>, Vec<String>) {
    let a = alphabet();
    let units: Vec<String> = (0..100)
        .map(|i| format!("{}{}", a[i], a[(i * 7 + 3) % 100]))
        .collect();
    let mut tokens = units.clone();
    let mut merges = Vec::new();
    for x in &units {
        for y in &units {
            tokens.push(format!("{x}{y}"));
            merges.push(format!("{x} {y}"));
        }
    }
    for x in &units {
        for y in &units {
            for z in &units {
                tokens.push(format!("{x}{y}{z}"));
                merges.push(format!("{x} {y}{z}"));
                merges.push(format!("{x}{y} {z}"));
            }
        }
    }
    (tokens, merges)
}

needs! { [fuse]
/// hf/'s tokenizer files cost a mount next to nothing, however large the
/// tokenizer (2 M merges; 1 M tokens; a 50 MB chat template): the daemon's
/// peak and steady RSS with them (after reading both files whole) stay
/// within a few MiB of a mount of the same file without them (its
/// `tokenizer.ggml.model` another than byte-level BPE, so hf/ renders no
/// tokenizer files), and the files are what they should be (issue 26,
/// item 4). Before, they were rendered at mount and held for the life of
/// the mount, a second, JSON-escaped copy of the vocabulary, merges and
/// template: +120 MiB peak and +60 MiB steady for the 2 M merges, +36 MiB
/// steady for the 1 M tokens, +58 MiB peak and +59 MiB steady for the
/// template. (The root's model.gguf and model.safetensors views hold the
/// metadata too; docs/OPERATIONS.md, "Untrusted files", says what a mount
/// adds to opening the file.)
fn huge_tokenizer_files_cost_the_mount_next_to_nothing() {
    if !fuse_available() {
        return;
    }
    let a = alphabet();
    let seed = || {
        let mut t: Vec<String> = a.iter().map(|c| c.to_string()).collect();
        t.push(format!("{}{}", a[0], a[1]));
        (t, vec![format!("{} {}", a[0], a[1])])
    };
    let mut failures = Vec::new();
    for case in ["2M merges", "1M tokens", "50 MB chat template"] {
        let (tokens, merges, template) = match case {
            "2M merges" => {
                let (t, m) = big_merges();
                (t, m, None)
            }
            "1M tokens" => {
                // 101 + 999,899 tokens of 14 characters, distinct.
                let (mut t, m) = seed();
                let n = 1_000_000 - t.len();
                t.extend((0..n).map(|i| {
                    let d = |k: usize| a[(i / 100usize.pow(k as u32)) % 100];
                    format!("{}{}{}{}", d(0), d(1), d(2), "\u{a1}".repeat(11))
                }));
                (t, m, None)
            }
            _ => {
                let (t, m) = seed();
                // Quotes, backslashes and newlines: the escaped form is
                // larger than the template.
                let line = "{{ '\"x\\y' }}\n";
                (t, m, Some(line.repeat(50_000_000 / line.len())))
            }
        };
        let (n_tokens, n_merges) = (tokens.len(), merges.len());
        let want_template = template.clone();
        let dir = model_dir();
        // (peak, RSS) in KiB after mounting and reading hf/'s files.
        let mut measured = Vec::new();
        for bpe in [false, true] {
            let (model, header) = qwen2_with_tokenizer(
                dir.path(),
                bpe,
                tokens.clone(),
                merges.clone(),
                template.clone(),
            );
            let m = Mounted::new(&model, &[]);
            let tok_path = m.path("hf/tokenizer.json");
            assert_eq!(tok_path.exists(), bpe, "{case}: {}", m.log());
            let mut sizes = (0, 0);
            if bpe {
                let tok_bytes = std::fs::read(&tok_path).unwrap();
                let config_bytes = std::fs::read(m.path("hf/tokenizer_config.json")).unwrap();
                sizes = (tok_bytes.len(), config_bytes.len());
                // The files are whole and right.
                let tok: serde_json::Value = serde_json::from_slice(&tok_bytes).unwrap();
                assert_eq!(
                    tok["model"]["vocab"].as_object().unwrap().len(),
                    n_tokens,
                    "{case}"
                );
                assert_eq!(
                    tok["model"]["merges"].as_array().unwrap().len(),
                    n_merges,
                    "{case}"
                );
                let config: serde_json::Value = serde_json::from_slice(&config_bytes).unwrap();
                assert_eq!(
                    config["chat_template"].as_str(),
                    want_template.as_deref(),
                    "{case}"
                );
                // Reads at odd offsets agree with the whole.
                let f = std::fs::File::open(&tok_path).unwrap();
                let len = tok_bytes.len() as u64;
                for (off, n) in [
                    (0u64, 1u64),
                    (len / 3 + 7, 100_003),
                    (len / 2 - 1, 4096),
                    (len - 3, 3),
                ] {
                    let n = n.min(len - off);
                    let mut got = vec![0u8; n as usize];
                    std::os::unix::fs::FileExt::read_exact_at(&f, &mut got, off).unwrap();
                    assert!(
                        got == tok_bytes[off as usize..(off + n) as usize],
                        "{case}: {n} bytes at {off}"
                    );
                }
            }
            let (peak, rss) = (m.peak_rss_kib(), rss_kib(&m));
            eprintln!(
                "{case}, tokenizer files {}: header {} MiB; peak {} MiB, RSS {} MiB after the \
                 mount and reading {} + {} bytes of them",
                if bpe { "rendered" } else { "absent" },
                header / MIB,
                peak >> 10,
                rss >> 10,
                sizes.0,
                sizes.1
            );
            // The mount's documented bound (OPERATIONS.md, "Untrusted
            // files"): opening's 4 x header + 64 MiB, plus model.gguf's
            // header (about the source's) and model.safetensors' (at most
            // 100 MB): 5 x header + 164 MiB.
            let bound_kib = (5 * header + 164 * MIB) / 1024;
            if peak > bound_kib {
                failures.push(format!(
                    "{case}, tokenizer files {}: peak {peak} KiB, over the bound of 5 x header \
                     + 164 MiB = {bound_kib} KiB",
                    if bpe { "rendered" } else { "absent" },
                ));
            }
            measured.push((peak, rss));
        }
        let ((peak_without, rss_without), (peak_with, rss_with)) = (measured[0], measured[1]);
        // While the mount checks the tokenizer: a table of 4-byte ids, at
        // most 4 slots per token, and a scratch entry; the views' threads
        // build at the same time, so the peak varies by some MiB.
        let peak_margin = 32 * 1024 + 16 * n_tokens as u64 / 1024;
        // Kept: a bit per token and 8 bytes per 64 entries.
        let rss_margin = 8 * 1024 + n_tokens as u64 / 1024;
        if peak_with > peak_without + peak_margin {
            failures.push(format!(
                "{case}: peak {peak_with} KiB with the tokenizer files, {peak_without} KiB \
                 without (margin {peak_margin} KiB)"
            ));
        }
        if rss_with > rss_without + rss_margin {
            failures.push(format!(
                "{case}: RSS {rss_with} KiB with the tokenizer files, {rss_without} KiB \
                 without (margin {rss_margin} KiB)"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
}
