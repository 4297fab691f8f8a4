//! The daemon's memory and decode work under small caches, through real
//! mounts of synthetic GGUF files (no model needed):
//!
//! - read-ahead never decodes much more than a sequential reader is served,
//!   whatever the cache size (issue 9, item 18).

mod common;

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

fn ctl_json(m: &Mounted) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(m.path("ctl.json")).unwrap()).unwrap()
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

/// A cold sequential read of one tensor decodes each chunk about once at
/// any cache size: the read-ahead window never holds more chunks than the
/// cache keeps beside the one being read. Before, the window grew to 32
/// chunks whatever the cache: 2.0-2.7x the bytes served were decoded at 1,
/// 2, 3 and 8 MiB.
#[test]
fn sequential_read_decodes_each_chunk_about_once_at_any_cache_size() {
    if !fuse_available() {
        return;
    }
    let dir = model_dir();
    // One 64 MiB tensor (decoded): 64 chunks of 1 MiB.
    let model = synthetic_gguf(dir.path(), 1, 16 << 20, &[GgmlType::Q8_0]);
    let cases: &[(Option<u64>, &[&str])] = &[
        (Some(1), &[]),
        (Some(2), &[]),
        (Some(3), &[]),
        (Some(8), &[]),
        (None, &[]),
        (Some(2), &["-o", "direct_io"]),
        (Some(8), &["-o", "direct_io"]),
        (Some(8), &["-o", "prefetch_threads=4"]),
    ];
    let mut failures = Vec::new();
    for (cache_mb, extra) in cases {
        let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if let Some(mb) = cache_mb {
            args.extend(["--cache-mb".to_string(), mb.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let m = Mounted::new(&model, &args);
        drop_cache(&m);
        let before = ctl_json(&m);
        let read = read_all(&m.path("t0.weight.f32"), 128 << 10);
        assert_eq!(read, 64 * MIB);
        let after = ctl_json(&m);
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
        eprintln!(
            "cache {cache_mb:?} MiB {extra:?}: decoded {decoded} served {served} ratio {ratio:.2}; \
             window {window} of {capacity_chunks} chunks"
        );
        // ctl.json reports the window actually used: at most half the cache.
        if window > capacity_chunks / 2 {
            failures.push(format!(
                "cache {cache_mb:?} {extra:?}: window {window} > half of {capacity_chunks} chunks"
            ));
        }
        if ratio > 1.2 {
            failures.push(format!(
                "cache {cache_mb:?} {extra:?}: decoded/served {ratio:.2} > 1.2"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
