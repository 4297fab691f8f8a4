//! Reference-model property test of the read path (the mountpoint-s3
//! "reftest" style): random sequences of reads of tensor files (f32, f16,
//! bf16) and safetensors views, at random and boundary offsets, with
//! sequential runs (read-ahead), cache drops and several threads at once,
//! through `TensorFs` with small chunks and a small cache, each reply
//! compared with a reference built independently: every tensor decoded
//! whole by the backend (no chunks, no cache), converted with the `half`
//! crate, and laid out at the offsets the safetensors header declares.
//!
//! A second test runs fewer cases through a real FUSE mount with `pread`.
//!
//! Failing cases are saved to, and replayed first from,
//! `tests/data/reftest.proptest-regressions` (committed).

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use rknot::backend::{self, Backend};
use rknot::fs::views::ViewSet;
use rknot::fs::{Caller, FsConfig, ROOT_INO, TensorFs};

use common::mount::{Mounted, fuse_available};
use common::*;

/// One file of the mount and its reference bytes.
struct RefFile {
    name: String,
    bytes: Vec<u8>,
}

/// Everything a case checks against.
struct Reference {
    files: Vec<RefFile>,
}

const SOURCES: [(&str, Option<&str>); 3] = [
    ("tiny-llama.gguf", None),
    ("tiny-llama.rknot", Some("tiny-llama.gguf")),
    ("tiny-llama.sk32", Some("tiny-llama.gguf")),
];

fn open_backend(source: usize) -> Arc<dyn Backend> {
    let (src, dense) = SOURCES[source];
    Arc::from(backend::open(&demo_path(src), dense.map(demo_path).as_deref()).unwrap())
}

fn to_half(f32_bytes: &[u8], bf16: bool) -> Vec<u8> {
    f32_bytes
        .chunks_exact(4)
        .flat_map(|c| {
            let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if bf16 {
                half::bf16::from_f32(x).to_le_bytes()
            } else {
                half::f16::from_f32(x).to_le_bytes()
            }
        })
        .collect()
}

/// The reference: tensor files in three formats, and the safetensors views
/// rebuilt from their own headers (which a reader can check: JSON with
/// offsets) and the reference tensors.
fn reference(b: &dyn Backend, read_header: impl Fn(&str) -> Vec<u8>) -> Reference {
    let mut files = Vec::new();
    let mut by_dot: HashMap<String, Vec<u8>> = HashMap::new();
    for t in b.tensors().entries().iter().filter(|t| t.is_available()) {
        let f32_bytes = decode_bytes(b, &t.name.dot);
        for (ext, bytes) in [
            ("f32", f32_bytes.clone()),
            ("f16", to_half(&f32_bytes, false)),
            ("bf16", to_half(&f32_bytes, true)),
        ] {
            files.push(RefFile {
                name: format!("{}.{ext}", t.name.underscore),
                bytes,
            });
        }
        by_dot.insert(t.name.dot.clone(), f32_bytes);
    }
    for (view, bf16, f16) in [
        ("model.safetensors", false, false),
        ("model.f16.safetensors", false, true),
        ("model.bf16.safetensors", true, false),
    ] {
        let head = read_header(view);
        let n = u64::from_le_bytes(head[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&head[8..8 + n]).unwrap();
        let mut bytes = head[..8 + n].to_vec();
        for (name, e) in &header {
            if name == "__metadata__" {
                continue;
            }
            let o = e["data_offsets"].as_array().unwrap();
            assert_eq!(
                o[0].as_u64().unwrap() as usize + 8 + n,
                bytes.len(),
                "{view} {name}"
            );
            let f32_bytes = &by_dot[name];
            let data = if f16 || bf16 {
                to_half(f32_bytes, bf16)
            } else {
                f32_bytes.clone()
            };
            assert_eq!(
                o[1].as_u64().unwrap() - o[0].as_u64().unwrap(),
                data.len() as u64
            );
            bytes.extend_from_slice(&data);
        }
        files.push(RefFile {
            name: view.to_string(),
            bytes,
        });
    }
    Reference { files }
}

/// One step of one thread: (kind, file, position, length), interpreted by
/// [`Step::resolve`]. Raw numbers shrink well.
#[derive(Debug, Clone)]
struct Step {
    kind: u8,
    file: u16,
    pos: u32,
    len: u32,
}

/// What a step does.
enum Action {
    Read { file: usize, offset: u64, len: u32 },
    DropCache,
}

impl Step {
    /// `last_end[file]` is where this thread's previous read of `file`
    /// ended (a "continue" step reads on from there).
    fn resolve(&self, r: &Reference, chunk: u64, last_end: &HashMap<usize, u64>) -> Action {
        let file = self.file as usize % r.files.len();
        let size = r.files[file].bytes.len() as u64;
        let len = match self.len % 4 {
            0 => 1 + self.len % 16,
            1 => 1 + self.len % 70_000,
            2 => (chunk as u32).saturating_mul(1 + self.len % 3),
            _ => 4096,
        };
        let offset = match self.kind % 8 {
            // Anywhere, past the end included.
            0 | 1 => u64::from(self.pos) % (size + 64),
            // Near a chunk boundary of the f32 data.
            2 => (u64::from(self.pos % 64) * chunk).saturating_sub(u64::from(self.pos % 7)),
            // Near the end.
            3 => size.saturating_sub(u64::from(self.pos % 9)),
            // Continue a sequential run (read-ahead).
            4..=6 => last_end.get(&file).copied().unwrap_or(0),
            _ => return Action::DropCache,
        };
        Action::Read { file, offset, len }
    }
}

fn me() -> Caller {
    // SAFETY: geteuid/getegid have no preconditions.
    unsafe {
        Caller {
            uid: libc::geteuid(),
            gid: libc::getegid(),
            pid: std::process::id(),
        }
    }
}

fn expected(r: &Reference, file: usize, offset: u64, len: u32) -> &[u8] {
    let b = &r.files[file].bytes;
    let lo = (offset as usize).min(b.len());
    let hi = (offset.saturating_add(u64::from(len)) as usize).min(b.len());
    &b[lo..hi]
}

/// Run every thread's steps at once against `fs`; each reply must equal
/// the reference.
fn run_in_process(fs: &TensorFs, r: &Reference, chunk: u64, threads: &[Vec<Step>]) {
    let inos: Vec<u64> = r
        .files
        .iter()
        .map(|f| fs.lookup(ROOT_INO, &f.name).unwrap().ino)
        .collect();
    std::thread::scope(|s| {
        for steps in threads {
            let inos = &inos;
            s.spawn(move || {
                // One handle per file per thread, as a process would hold.
                let mut fhs: HashMap<usize, u64> = HashMap::new();
                let mut last_end: HashMap<usize, u64> = HashMap::new();
                for step in steps {
                    match step.resolve(r, chunk, &last_end) {
                        Action::DropCache => {
                            let ctl = fs.open(rknot::fs::CTL_INO, false, true, me()).unwrap();
                            fs.write_ctl(ctl.fh, b"drop-cache\n", me()).unwrap();
                            fs.release(ctl.fh);
                        }
                        Action::Read { file, offset, len } => {
                            let fh = *fhs.entry(file).or_insert_with(|| {
                                fs.open(inos[file], true, false, me()).unwrap().fh
                            });
                            let got = fs.read(inos[file], fh, offset, len).unwrap();
                            assert!(
                                got.bytes() == expected(r, file, offset, len),
                                "{} [{offset}, +{len}) differs from the reference",
                                r.files[file].name
                            );
                            last_end.insert(file, offset + got.bytes().len() as u64);
                        }
                    }
                }
                for fh in fhs.values() {
                    fs.release(*fh);
                }
            });
        }
    });
}

fn steps() -> impl Strategy<Value = Vec<Vec<Step>>> {
    let step = (any::<u8>(), any::<u16>(), any::<u32>(), any::<u32>()).prop_map(
        |(kind, file, pos, len)| Step {
            kind,
            file,
            pos,
            len,
        },
    );
    prop::collection::vec(prop::collection::vec(step, 1..40), 1..5)
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/data/reftest.proptest-regressions",
        ))),
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// TensorFs in-process: small chunks, small caches, read-ahead on or
    /// off, 1 to 4 threads.
    #[test]
    fn reads_match_the_reference(
        source in 0..SOURCES.len(),
        chunk_kib in prop::sample::select(vec![4u64, 8, 64, 1024]),
        cache_chunks in 1u64..8,
        prefetch in 0usize..3,
        threads in steps(),
    ) {
        let b = open_backend(source);
        let chunk = chunk_kib * 1024;
        let fs = TensorFs::new(b.clone(), FsConfig {
            chunk_bytes: chunk,
            cache_bytes: cache_chunks * chunk,
            prefetch_threads: prefetch,
            views: ViewSet { f16: true, bf16: true },
            ..FsConfig::default()
        });
        let r = reference(b.as_ref(), |view| {
            let ino = fs.lookup(ROOT_INO, view).unwrap().ino;
            let fh = fs.open(ino, true, false, me()).unwrap().fh;
            let head = fs.read(ino, fh, 0, 8).unwrap().bytes().to_vec();
            let n = u64::from_le_bytes(head[..8].try_into().unwrap());
            let all = fs.read(ino, fh, 0, 8 + n as u32).unwrap().bytes().to_vec();
            fs.release(fh);
            all
        });
        run_in_process(&fs, &r, chunk, &threads);
    }
}

needs! { [fuse]
/// The same through a real mount: `pread` on the files from several
/// threads (fewer cases: each mounts).
fn mounted_reads_match_the_reference() {
    if !fuse_available() {
        return;
    }
    let mut runner = proptest::test_runner::TestRunner::new(config(6));
    let strategy = (0..SOURCES.len(), 1u64..6, steps());
    runner
        .run(&strategy, |(source, cache_mb, threads)| {
            let (src, dense) = SOURCES[source];
            let chunk = 16 * 1024u64;
            let mut args = vec![
                "--views".to_string(),
                "f32,f16,bf16".to_string(),
                "-o".to_string(),
                format!("chunk_kb=16,cache_mb={cache_mb}"),
            ];
            if let Some(d) = dense {
                args.push("--dense".into());
                args.push(demo_path(d).display().to_string());
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let m = Mounted::new(&demo_path(src), &args);
            let b = open_backend(source);
            let r = reference(b.as_ref(), |view| {
                let f = std::fs::File::open(m.path(view)).unwrap();
                let mut head = [0u8; 8];
                f.read_exact_at(&mut head, 0).unwrap();
                let n = u64::from_le_bytes(head) as usize;
                let mut all = vec![0u8; 8 + n];
                f.read_exact_at(&mut all, 0).unwrap();
                all
            });
            std::thread::scope(|s| {
                for steps in &threads {
                    let (r, m) = (&r, &m);
                    s.spawn(move || {
                        let mut last_end: HashMap<usize, u64> = HashMap::new();
                        let mut open: HashMap<usize, std::fs::File> = HashMap::new();
                        for step in steps {
                            match step.resolve(r, chunk, &last_end) {
                                Action::DropCache => {
                                    std::fs::write(m.path("ctl"), "drop-cache\n").unwrap();
                                }
                                Action::Read { file, offset, len } => {
                                    let f = open.entry(file).or_insert_with(|| {
                                        std::fs::File::open(m.path(&r.files[file].name)).unwrap()
                                    });
                                    let mut buf = vec![0u8; len as usize];
                                    let mut got = 0;
                                    while got < buf.len() {
                                        let k = f
                                            .read_at(&mut buf[got..], offset + got as u64)
                                            .unwrap();
                                        if k == 0 {
                                            break;
                                        }
                                        got += k;
                                    }
                                    assert!(
                                        buf[..got] == *expected(r, file, offset, len),
                                        "{} [{offset}, +{len}) differs from the reference",
                                        r.files[file].name
                                    );
                                    last_end.insert(file, offset + got as u64);
                                }
                            }
                        }
                    });
                }
            });
            Ok(())
        })
        .unwrap();
}
}
