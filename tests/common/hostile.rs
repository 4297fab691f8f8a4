//! Crafted hostile files for tests/hostile_headers.rs, and a way to run the
//! real `rknot` binary and read its peak RSS.
//!
//! - JSON headers (SK32, dense .knot, .rknot) of an exact size made of what
//!   the readers must skip (an ignored array of small numbers) or must keep
//!   (metadata arrays of small ints, a block table of millions of entries);
//! - GGUFs built by hand ([`Gguf`]): large u8 arrays, many tensors, names
//!   and metadata with terminal escapes (which the crate's writers refuse);
//! - a tiny .rknot declaring a 2^30 x 2^30 tensor.
//!
//! Bodies that only need a size are sparse (`set_len`).
#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

pub const MIB: u64 = 1 << 20;

/// The issue's target: peak RSS of any command on a header of `header`
/// bytes stays within 4x the header + 64 MiB (or the command refuses).
pub fn rss_bound(header: u64) -> u64 {
    4 * header + 64 * MIB
}

// ------------------------------------------------------------- JSON text

/// JSON text of exactly `len` bytes: `prefix` (which opens an array), then
/// `elem` repeated and comma-separated, then spaces, then `suffix` (which
/// closes the array and the document).
pub fn filled_json(prefix: &str, elem: &str, suffix: &str, len: usize) -> Vec<u8> {
    let body = len
        .checked_sub(prefix.len() + suffix.len() + elem.len())
        .expect("len too small for the frame");
    let n = 1 + body / (elem.len() + 1);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(prefix.as_bytes());
    for i in 0..n {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(elem.as_bytes());
    }
    out.resize(len - suffix.len(), b' ');
    out.extend_from_slice(suffix.as_bytes());
    assert_eq!(out.len(), len);
    out
}

/// A KNOT container with `meta` as its meta JSON and a 64-byte payload.
pub fn write_knot(path: &Path, meta: &[u8]) {
    let mut f = BufWriter::new(File::create(path).unwrap());
    f.write_all(b"KNOT").unwrap();
    f.write_all(&1u16.to_le_bytes()).unwrap();
    f.write_all(&(meta.len() as u32).to_le_bytes()).unwrap();
    f.write_all(meta).unwrap();
    let pad = (4 - (10 + meta.len()) % 4) % 4;
    f.write_all(&[0u8; 3][..pad]).unwrap();
    f.write_all(&[0u8]).unwrap();
    f.write_all(&[0u8; 64]).unwrap();
    f.flush().unwrap();
}

/// A .rknot with `header` and a body of `body_len` zero bytes (sparse).
pub fn write_rknot(path: &Path, header: &[u8], body_len: u64) {
    let mut f = BufWriter::new(File::create(path).unwrap());
    f.write_all(b"RKNOT\x02").unwrap();
    f.write_all(&(header.len() as u32).to_le_bytes()).unwrap();
    f.write_all(header).unwrap();
    let f = f.into_inner().unwrap();
    f.set_len(10 + header.len() as u64 + body_len).unwrap();
}

/// The hostile JSON headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonCase {
    /// SK32 with an ignored array of zeros.
    Sk32Ignored,
    /// Dense .knot with an ignored array of zeros.
    KnotIgnored,
    /// Dense .knot whose metadata is one plain array of small ints.
    KnotPlainMetadata,
    /// Dense .knot whose metadata is one typed u8 array.
    KnotTypedMetadata,
    /// .rknot with an ignored array of zeros.
    RknotIgnored,
    /// .rknot whose `arch_meta.metadata` is one plain array of small ints.
    RknotMetadata,
    /// A valid .rknot whose one tensor has one 5-byte block per row: the
    /// whole header is its block table (millions of entries).
    RknotBlocks,
    /// As `RknotBlocks`, every block at offset 0 (refused: they overlap).
    RknotOverlapping,
}

pub const RKNOT_BIG_TENSOR: &str = "blk.0.big.weight";

const RKNOT_ARCH: &str =
    r#""format":"rknot","version":2,"arch_meta":{"arch":"llama","hidden_dim":1,"num_layers":1"#;

impl JsonCase {
    pub const ALL: [JsonCase; 8] = [
        JsonCase::Sk32Ignored,
        JsonCase::KnotIgnored,
        JsonCase::KnotPlainMetadata,
        JsonCase::KnotTypedMetadata,
        JsonCase::RknotIgnored,
        JsonCase::RknotMetadata,
        JsonCase::RknotBlocks,
        JsonCase::RknotOverlapping,
    ];

    pub fn ext(self) -> &'static str {
        match self {
            JsonCase::Sk32Ignored => "sk32",
            JsonCase::KnotIgnored | JsonCase::KnotPlainMetadata | JsonCase::KnotTypedMetadata => {
                "knot"
            }
            _ => "rknot",
        }
    }

    /// A tensor the file has, if any.
    pub fn tensor(self) -> Option<&'static str> {
        matches!(self, JsonCase::RknotBlocks).then_some(RKNOT_BIG_TENSOR)
    }

    /// Write the file with a header (meta JSON) of exactly `len` bytes.
    pub fn write(self, path: &Path, len: usize) {
        match self {
            JsonCase::Sk32Ignored => write_knot(
                path,
                &filled_json(r#"{"format":"sk32","sketches":{},"pad":["#, "0", "]}", len),
            ),
            JsonCase::KnotIgnored => write_knot(
                path,
                &filled_json(r#"{"format":"knot","tensors":{},"pad":["#, "0", "]}", len),
            ),
            JsonCase::KnotPlainMetadata => write_knot(
                path,
                &filled_json(
                    r#"{"format":"knot","tensors":{},"metadata":{"big":["#,
                    "1",
                    "]}}",
                    len,
                ),
            ),
            JsonCase::KnotTypedMetadata => write_knot(
                path,
                &filled_json(
                    r#"{"format":"knot","tensors":{},"metadata":{"big":{"type":"array","elem_type":"u8","value":["#,
                    "1",
                    "]}}}",
                    len,
                ),
            ),
            JsonCase::RknotIgnored => write_rknot(
                path,
                &filled_json(
                    &format!(r#"{{{RKNOT_ARCH}}},"layers":[],"pad":["#),
                    "0",
                    "]}",
                    len,
                ),
                0,
            ),
            JsonCase::RknotMetadata => write_rknot(
                path,
                &filled_json(
                    &format!(r#"{{{RKNOT_ARCH},"metadata":{{"big":["#),
                    "1",
                    r#"]}},"layers":[]}"#,
                    len,
                ),
                0,
            ),
            JsonCase::RknotBlocks | JsonCase::RknotOverlapping => {
                let (header, body) = rknot_block_table(len, self == JsonCase::RknotOverlapping);
                write_rknot(path, &header, body);
            }
        }
    }
}

/// A .rknot header of exactly `len` bytes whose one tensor `[R, 1]` is
/// tiled 1x1 at 8 bits: R blocks of 5 bytes, listed one after another (or
/// all at 0). Returns the header and the body length.
fn rknot_block_table(len: usize, overlapping: bool) -> (Vec<u8>, u64) {
    let head = |rows: u64| {
        format!(
            r#"{{{RKNOT_ARCH}}},"layers":[{{"index":0,"manifest":{{"d":1,"k":1,"standing_indices":[0],"amplitudes":[1],"phase_alignment":[1]}},"tensors":[{{"name":"{RKNOT_BIG_TENSOR}","shape":[{rows},1],"restricted_axes":[],"mode":"uniform","bits":8,"block_shape":[1,1],"blocks":["#
        )
    };
    let tail = "]}]}]}";
    let entry = |i: u64| {
        if overlapping {
            "[0,5]".to_string()
        } else {
            format!("[{},5]", 5 * i)
        }
    };
    // Room for the longest row count the prefix may need.
    let room = len - head(u64::from(u32::MAX)).len() - tail.len();
    let mut used = 0usize;
    let mut rows = 0u64;
    loop {
        let n = entry(rows).len() + usize::from(rows > 0);
        if used + n > room {
            break;
        }
        used += n;
        rows += 1;
    }
    let mut out = head(rows).into_bytes();
    for i in 0..rows {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(entry(i).as_bytes());
    }
    out.extend_from_slice(tail.as_bytes());
    // Whitespace after the document is allowed.
    out.resize(len, b' ');
    (out, 5 * rows)
}

// ------------------------------------------------------------------ GGUF

/// A GGUF v3 built by hand: any names and keys (the crate's writer refuses
/// the hostile ones), arrays of any size.
#[derive(Default)]
pub struct Gguf {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data_len: u64,
}

impl Gguf {
    fn str_bytes(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn key(&mut self, key: &str, ty: u32) {
        Self::str_bytes(&mut self.kv, key);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.n_kv += 1;
    }

    pub fn string(mut self, key: &str, value: &str) -> Self {
        self.key(key, 8);
        Self::str_bytes(&mut self.kv, value);
        self
    }

    pub fn u32(mut self, key: &str, value: u32) -> Self {
        self.key(key, 4);
        self.kv.extend_from_slice(&value.to_le_bytes());
        self
    }

    /// A u8 array of `n` ones.
    pub fn u8_array(mut self, key: &str, n: u64) -> Self {
        self.key(key, 9);
        self.kv.extend_from_slice(&0u32.to_le_bytes());
        self.kv.extend_from_slice(&n.to_le_bytes());
        self.kv.resize(self.kv.len() + n as usize, 1);
        self
    }

    /// An i32 array of `n` values.
    pub fn i32_array(mut self, key: &str, n: u64) -> Self {
        self.key(key, 9);
        self.kv.extend_from_slice(&5u32.to_le_bytes());
        self.kv.extend_from_slice(&n.to_le_bytes());
        for i in 0..n {
            self.kv.extend_from_slice(&(i as i32).to_le_bytes());
        }
        self
    }

    /// A string array of `n` strings of `len` bytes each.
    pub fn string_array(mut self, key: &str, n: u64, len: usize) -> Self {
        self.key(key, 9);
        self.kv.extend_from_slice(&8u32.to_le_bytes());
        self.kv.extend_from_slice(&n.to_le_bytes());
        for i in 0..n {
            let s = format!("{i:0len$}");
            Self::str_bytes(&mut self.kv, &s[s.len() - len..]);
        }
        self
    }

    /// A one-element F32 tensor (32-byte aligned data).
    pub fn f32_tensor(mut self, name: &str) -> Self {
        Self::str_bytes(&mut self.infos, name);
        self.infos.extend_from_slice(&1u32.to_le_bytes());
        self.infos.extend_from_slice(&1u64.to_le_bytes());
        self.infos.extend_from_slice(&0u32.to_le_bytes());
        self.infos.extend_from_slice(&self.data_len.to_le_bytes());
        self.n_tensors += 1;
        self.data_len += 32;
        self
    }

    /// Bytes before the data section.
    pub fn header_len(&self) -> u64 {
        (24 + self.kv.len() + self.infos.len()).div_ceil(32) as u64 * 32
    }

    pub fn write(&self, path: &Path) {
        let mut f = BufWriter::new(File::create(path).unwrap());
        f.write_all(b"GGUF").unwrap();
        f.write_all(&3u32.to_le_bytes()).unwrap();
        f.write_all(&self.n_tensors.to_le_bytes()).unwrap();
        f.write_all(&self.n_kv.to_le_bytes()).unwrap();
        f.write_all(&self.kv).unwrap();
        f.write_all(&self.infos).unwrap();
        let used = 24 + self.kv.len() + self.infos.len();
        f.write_all(&vec![0u8; self.header_len() as usize - used])
            .unwrap();
        // Tensor data: 1.0f32 at each aligned slot.
        for _ in 0..self.n_tensors {
            let mut slot = [0u8; 32];
            slot[..4].copy_from_slice(&1f32.to_le_bytes());
            f.write_all(&slot).unwrap();
        }
        f.flush().unwrap();
    }
}

// ----------------------------------------------------------------- .rknot

/// A tiny valid .rknot (a few hundred bytes) whose one tensor declares
/// 2^30 x 2^30 served values: both axes restricted to one standing index
/// of a 2^30 hidden dimension, so it stores one 5-byte block.
pub fn tiny_rknot_declaring_2_30_squared(path: &Path) {
    use rknot::format::meta::Metadata;
    use rknot::format::rknot::{
        ArchMeta, Coding, LayerOut, Manifest, TensorSpec, TileGrid, pack_block, write_rknot,
    };
    let d = 1u64 << 30;
    let manifest = Manifest {
        d,
        standing_indices: vec![0],
        amplitudes: vec![1.0],
        phase_alignment: vec![1.0],
    };
    let coding = Coding::Uniform { bits: 8 };
    let spec = TensorSpec {
        name: "blk.0.attn_q.weight".into(),
        d_out: d,
        d_in: d,
        restrict_rows: true,
        restrict_cols: true,
        coding: coding.clone(),
        block_rows: 1,
        block_cols: 1,
    };
    let grid = TileGrid {
        compact_rows: 1,
        compact_cols: 1,
        block_rows: 1,
        block_cols: 1,
    };
    let block = pack_block(&coding, &grid.tile(0), 0.5, &[130]);
    let arch = ArchMeta {
        arch: "llama".into(),
        hidden_dim: d,
        num_layers: 1,
        metadata: Metadata::default(),
    };
    let layer = LayerOut {
        index: 0,
        manifest,
        tensors: vec![(spec, vec![block])],
    };
    let mut bytes = Vec::new();
    write_rknot(&mut bytes, &arch, &[layer]).unwrap();
    std::fs::write(path, bytes).unwrap();
}

// ------------------------------------------------------------ measuring

/// What a measured run of a command did.
#[derive(Debug)]
pub struct Run {
    pub status: ExitStatus,
    /// The first [`KEEP_STDOUT`] bytes of stdout.
    pub stdout: Vec<u8>,
    pub stdout_len: u64,
    pub stderr: String,
    /// Peak resident set size, bytes (wait4's ru_maxrss).
    pub max_rss: u64,
    /// Killed for running past the deadline.
    pub timed_out: bool,
    /// Wall time from spawn to exit (the launcher's start included).
    pub elapsed: Duration,
}

pub const KEEP_STDOUT: usize = 16 << 20;

impl Run {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Forks the command from a small process and reports the child's
/// `ru_maxrss` (KiB) in the file `argv[1]`. Measuring from the test process
/// itself would not do: a child's peak RSS includes the memory of the
/// process it was forked from, until it execs (here, the test harness with
/// its generated files). `argv[2]` is the deadline in seconds; a command
/// past it is killed (`<file>.timeout` is created).
const LAUNCHER: &str = r#"
import os, signal, sys
out, secs, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
pid = os.fork()
if pid == 0:
    try:
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
def on_alarm(*_):
    open(out + ".timeout", "w").close()
    os.kill(pid, signal.SIGKILL)
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, secs)
_, status, ru = os.wait4(pid, 0)
signal.setitimer(signal.ITIMER_REAL, 0)
with open(out, "w") as f:
    f.write(str(ru.ru_maxrss))
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"#;

/// Run `program args` (through [`LAUNCHER`]), counting its stdout, and
/// return its peak RSS. A run past `deadline` is killed (`timed_out`).
pub fn run_measured<S: AsRef<OsStr>>(program: &Path, args: &[S], deadline: Duration) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let rss_file = tmp.path().join("maxrss");
    let start = std::time::Instant::now();
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(LAUNCHER)
        .arg(&rss_file)
        .arg(deadline.as_secs_f64().to_string())
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let (mut keep, mut total) = (Vec::new(), 0u64);
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match out.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    total += n as u64;
                    let room = KEEP_STDOUT.saturating_sub(keep.len()).min(n);
                    keep.extend_from_slice(&buf[..room]);
                }
            }
        }
        (keep, total)
    });
    let t_err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let status = child.wait().unwrap();
    let elapsed = start.elapsed();
    let (stdout, stdout_len) = t_out.join().unwrap();
    let stderr = t_err.join().unwrap();
    let kib: u64 = std::fs::read_to_string(&rss_file)
        .unwrap_or_else(|e| panic!("launcher wrote no RSS ({e}); stderr: {stderr}"))
        .trim()
        .parse()
        .unwrap();
    Run {
        status,
        stdout,
        stdout_len,
        stderr,
        max_rss: kib * 1024,
        timed_out: rss_file.with_extension("timeout").exists(),
        elapsed,
    }
}

/// Whether `text` holds a character that must not reach a terminal raw
/// (newlines and tabs, which the outputs use for layout, excepted).
pub fn has_raw_control(text: &str) -> bool {
    text.chars()
        .any(|c| rknot::text::is_unsafe_char(c) && c != '\n' && c != '\t')
}
