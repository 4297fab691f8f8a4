//! Bounded-time mutation fuzzing of every reader, on stable Rust.
//!
//! One test per reader (SK32, dense .knot, .rknot, GGUF, and SK32 + GGUF
//! layered). Each starts from small valid files written by the crate's
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

#[path = "common/malformed_corpus.rs"]
mod corpus;

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

// ------------------------------------------------------- allocation guard

/// Largest single allocation a reader may make.
const MAX_ALLOC: usize = 1 << 30;

struct GuardedAlloc;

// SAFETY: every call is forwarded unchanged to the system allocator; the
// guard only inspects the requested size.
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        guard(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        guard(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        guard(new_size);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: GuardedAlloc = GuardedAlloc;

#[inline]
fn guard(size: usize) {
    if size > MAX_ALLOC {
        oversized(size);
    }
}

#[cold]
fn oversized(size: usize) -> ! {
    // Format into a stack buffer: no allocation before the message is out.
    let mut buf = [0u8; 512];
    let mut w = &mut buf[..];
    let _ = write!(
        w,
        "\nfuzz_readers: ABORT: one allocation of {size} bytes (> 1 GiB): a size from \
         the file reached the allocator without a check against the file size\n"
    );
    let used = 512 - w.len();
    let _ = std::io::stderr().write_all(&buf[..used]);
    CURRENT.with(|c| {
        if let Some(slot) = c.get() {
            slot.report_abort("alloc");
        }
    });
    std::process::abort();
}

// ------------------------------------------------------- case bookkeeping

/// What the guards need to know about the case running on a fuzz thread.
struct Slot {
    target: &'static str,
    seed: u64,
    iteration: AtomicU64,
    /// Milliseconds since the epoch when the current case started; 0 = idle.
    busy_since_ms: AtomicU64,
    done: AtomicBool,
    /// Where the current case's input files are.
    inputs: Vec<PathBuf>,
    failures: PathBuf,
}

thread_local! {
    static CURRENT: Cell<Option<&'static Slot>> = const { Cell::new(None) };
}

/// A case running longer than this is a hang.
const HANG_MS: u64 = 20_000;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
}

impl Slot {
    /// Save the current input and say which case it was (before an abort).
    fn report_abort(&self, why: &str) {
        let it = self.iteration.load(Ordering::SeqCst);
        let saved = save_inputs(
            &self.failures,
            self.target,
            self.seed,
            it,
            why,
            &self.inputs,
        );
        eprintln!(
            "fuzz_readers: target {} seed {} iteration {it}: {why}; input saved as {saved:?} \
             (replay: RKNOT_FUZZ_REPRO=<file>[,<dense>] cargo test --profile ci --test \
             fuzz_readers fuzz_repro -- --nocapture)",
            self.target, self.seed
        );
    }
}

fn save_inputs(
    dir: &Path,
    target: &str,
    seed: u64,
    it: u64,
    why: &str,
    inputs: &[PathBuf],
) -> Vec<PathBuf> {
    let _ = std::fs::create_dir_all(dir);
    inputs
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let ext = p.extension()?.to_string_lossy().into_owned();
            let to = dir.join(format!("{target}-seed{seed}-iter{it}-{why}-{i}.{ext}"));
            std::fs::copy(p, &to).ok().map(|_| to)
        })
        .collect()
}

fn spawn_watchdog(slot: &'static Slot) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !slot.done.load(Ordering::SeqCst) {
            let since = slot.busy_since_ms.load(Ordering::SeqCst);
            if since != 0 && now_ms().saturating_sub(since) > HANG_MS {
                eprintln!(
                    "\nfuzz_readers: ABORT: target {} iteration {} has run for more than \
                     {} s: a hang",
                    slot.target,
                    slot.iteration.load(Ordering::SeqCst),
                    HANG_MS / 1000
                );
                slot.report_abort("hang");
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Register this thread's case bookkeeping with the allocation guard and
/// start its watchdog.
fn install_guards(
    target: &'static str,
    seed: u64,
    inputs: Vec<PathBuf>,
) -> (&'static Slot, std::thread::JoinHandle<()>) {
    let slot: &'static Slot = Box::leak(Box::new(Slot {
        target,
        seed,
        iteration: AtomicU64::new(0),
        busy_since_ms: AtomicU64::new(0),
        done: AtomicBool::new(false),
        inputs,
        failures: failures_dir(),
    }));
    CURRENT.with(|c| c.set(Some(slot)));
    (slot, spawn_watchdog(slot))
}

fn failures_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("fuzz-failures")
}

// -------------------------------------------------------------------- RNG

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn upto(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.upto(xs.len())]
    }
}

// -------------------------------------------------------------- mutations

const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    4095,
    4096,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x1_0001,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 53,
    1 << 62,
    1 << 63,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
];

/// Where a seed's binary fields are, to aim integer overwrites at them.
#[derive(Clone, Default)]
struct FieldMap {
    /// (offset, width) of integer fields.
    fields: Vec<(usize, usize)>,
    /// End of the header (mutations are biased towards it).
    header_end: usize,
    /// The header is JSON.
    json: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Knot,
    Rknot,
    Gguf,
}

fn kind_of(bytes: &[u8]) -> Kind {
    if bytes.starts_with(b"RKNOT") {
        Kind::Rknot
    } else if bytes.starts_with(b"GGUF") {
        Kind::Gguf
    } else {
        Kind::Knot
    }
}

fn layout_of(bytes: &[u8]) -> FieldMap {
    match kind_of(bytes) {
        Kind::Knot => {
            let meta_len = u32::from_le_bytes(bytes[6..10].try_into().unwrap()) as usize;
            let codec = (10 + meta_len + 3) & !3;
            FieldMap {
                fields: vec![(4, 2), (6, 4), (codec, 1)],
                header_end: codec + 1,
                json: true,
            }
        }
        Kind::Rknot if bytes.starts_with(b"RKNOT\x03") => {
            // Footer lengths; the header is at the end, so every byte may
            // be a header byte.
            let n = bytes.len();
            FieldMap {
                fields: vec![(5, 1), (6, 2), (n - 24, 8), (n - 16, 8)],
                header_end: n,
                json: true,
            }
        }
        Kind::Rknot => {
            let len = u32::from_le_bytes(bytes[6..10].try_into().unwrap()) as usize;
            FieldMap {
                fields: vec![(5, 1), (6, 4)],
                header_end: 10 + len,
                json: true,
            }
        }
        Kind::Gguf => gguf_layout(bytes),
    }
}

/// Walk a valid GGUF header recording its integer fields.
fn gguf_layout(b: &[u8]) -> FieldMap {
    struct W<'a> {
        b: &'a [u8],
        pos: usize,
        fields: Vec<(usize, usize)>,
    }
    impl W<'_> {
        fn int(&mut self, width: usize) -> u64 {
            let mut v = [0u8; 8];
            v[..width].copy_from_slice(&self.b[self.pos..self.pos + width]);
            self.fields.push((self.pos, width));
            self.pos += width;
            u64::from_le_bytes(v)
        }
        fn string(&mut self) {
            let n = self.int(8) as usize;
            self.pos += n;
        }
        fn value(&mut self, ty: u64) {
            match ty {
                0 | 1 | 7 => self.pos += 1,
                2 | 3 => self.pos += 2,
                4..=6 => self.pos += 4,
                10..=12 => self.pos += 8,
                8 => self.string(),
                9 => {
                    let et = self.int(4);
                    let n = self.int(8);
                    for _ in 0..n {
                        self.value(et);
                    }
                }
                _ => panic!("seed GGUF has value type {ty}"),
            }
        }
    }
    let mut w = W {
        b,
        pos: 4,
        fields: Vec::new(),
    };
    w.int(4);
    let tc = w.int(8);
    let kc = w.int(8);
    let mut alignment = 32;
    for _ in 0..kc {
        let key_at = w.pos + 8;
        w.string();
        let key = &b[key_at..w.pos];
        let ty = w.int(4);
        if key == b"general.alignment" {
            alignment = u32::from_le_bytes(b[w.pos..w.pos + 4].try_into().unwrap()) as usize;
        }
        w.value(ty);
    }
    for _ in 0..tc {
        w.string();
        let nd = w.int(4);
        for _ in 0..nd {
            w.int(8);
        }
        w.int(4);
        w.int(8);
    }
    let header_end = w.pos.div_ceil(alignment) * alignment;
    FieldMap {
        fields: w.fields,
        header_end,
        json: false,
    }
}

fn interesting_int(rng: &mut Rng, old: u64) -> u64 {
    match rng.below(5) {
        0 => rng.next(),
        1 => old.wrapping_add(1 + rng.below(16)),
        2 => old.wrapping_sub(1 + rng.below(16)),
        _ => *rng.pick(INTERESTING),
    }
}

fn position(rng: &mut Rng, len: usize, lay: &FieldMap) -> usize {
    let head = lay.header_end.min(len);
    if lay.json && head < len && !rng.chance(4) {
        // JSON headers get structured edits; aim most raw edits past them.
        head + rng.upto(len - head)
    } else if !lay.json && head > 0 && rng.chance(2) {
        rng.upto(head)
    } else {
        rng.upto(len)
    }
}

/// One byte-level mutation.
fn mutate_bytes(d: &mut Vec<u8>, rng: &mut Rng, lay: &FieldMap) {
    if d.is_empty() {
        d.extend((0..1 + rng.upto(16)).map(|_| rng.next() as u8));
        return;
    }
    let len = d.len();
    match rng.below(11) {
        0 => {
            let p = position(rng, len, lay);
            d[p] ^= 1 << rng.below(8);
        }
        1 => {
            let p = position(rng, len, lay);
            d[p] = *rng.pick(&[0u8, 0xff, 0x7f, 0x80, 1, 0x3f, 0x20]);
        }
        2 => {
            let p = position(rng, len, lay);
            d[p] = rng.next() as u8;
        }
        3..=5 => {
            let (p, w) = if !lay.fields.is_empty() && rng.chance(2) {
                *rng.pick(&lay.fields)
            } else {
                (position(rng, len, lay), *rng.pick(&[1usize, 2, 4, 8]))
            };
            if p + w <= len {
                let mut old = [0u8; 8];
                old[..w].copy_from_slice(&d[p..p + w]);
                let v = interesting_int(rng, u64::from_le_bytes(old)).to_le_bytes();
                d[p..p + w].copy_from_slice(&v[..w]);
            }
        }
        6 => {
            let cut = if !lay.fields.is_empty() && rng.chance(2) {
                let (p, w) = *rng.pick(&lay.fields);
                p + rng.upto(w + 1)
            } else {
                rng.upto(len + 1)
            };
            d.truncate(cut.min(len));
        }
        7 => {
            let n = 1 + rng.upto(64);
            let junk = rng.below(3);
            for _ in 0..n {
                let b = match junk {
                    0 => 0,
                    1 => 0xff,
                    _ => rng.next() as u8,
                };
                d.push(b);
            }
        }
        8 => {
            // Duplicate a range.
            let a = rng.upto(len);
            let n = 1 + rng.upto((len - a).min(256));
            let chunk = d[a..a + n].to_vec();
            let at = rng.upto(len + 1);
            d.splice(at..at, chunk);
        }
        9 => {
            // Delete a range.
            let a = position(rng, len, lay);
            let n = 1 + rng.upto((len - a).min(64));
            d.drain(a..a + n);
        }
        _ => {
            // Fill a range with one byte.
            let a = position(rng, len, lay);
            let n = 1 + rng.upto((len - a).min(32));
            let b = *rng.pick(&[0u8, 0xff, b'9', b'[', b'{', b'"']);
            d[a..a + n].fill(b);
        }
    }
}

// ------------------------------------------------- structured JSON edits

const KEYS: &[&str] = &[
    "d_out",
    "d_in",
    "rank",
    "offset",
    "length",
    "u_max",
    "sigma_max",
    "v_max",
    "type",
    "shape",
    "format",
    "sketches",
    "tensors",
    "metadata",
    "version",
    "arch_meta",
    "layers",
    "index",
    "manifest",
    "d",
    "k",
    "standing_indices",
    "amplitudes",
    "phase_alignment",
    "name",
    "restricted_axes",
    "mode",
    "bits",
    "line_axis",
    "block_shape",
    "blocks",
    "num_layers",
    "hidden_dim",
    "arch",
    "topology",
    "elem_type",
    "value",
    "general.alignment",
];

const STRINGS: &[&str] = &[
    "rows",
    "cols",
    "uniform",
    "graded",
    "sk32",
    "knot",
    "rknot",
    "f32",
    "f16",
    "bf16",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q8_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q4_k_m",
    "q5_k",
    "q6_k",
    "iq2_xxs",
    "u8",
    "u32",
    "u64",
    "i64",
    "f64",
    "string",
    "array",
    "bool",
    "nan",
    "inf",
    "-inf",
    "",
    "blk.0.attn_o.weight",
    "blk.0.attn_output.weight",
    "blk_0_attn_q_weight",
    "blk.0.attn_q.weight",
    "blk.1.attn_q.weight",
    "token_embd.weight",
    "output.weight",
    "a/b",
    "..",
    ".",
    "x\u{0}y",
];

fn interesting_json(rng: &mut Rng) -> Value {
    match rng.below(12) {
        0 => json!(-1),
        1 => json!(i64::MIN),
        2 => json!(1e39),
        3 => json!(-1e39),
        4 => json!(0.5),
        5 => json!(-0.0),
        6 => json!(1e308),
        7 => json!(rng.below(20)),
        _ => json!(*rng.pick(INTERESTING)),
    }
}

fn escape(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}

fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                pointers(x, format!("{at}/{}", escape(k)), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// One structured edit of a JSON document.
fn mutate_json(root: &mut Value, rng: &mut Rng) {
    let mut ptrs = Vec::new();
    pointers(root, String::new(), &mut ptrs);
    // Half the time, nudge a number: keeps the header parseable and probes
    // the value checks rather than the JSON accessors.
    if rng.chance(2) {
        let nums: Vec<&String> = ptrs
            .iter()
            .filter(|p| root.pointer(p).is_some_and(Value::is_number))
            .collect();
        if !nums.is_empty() {
            let p = nums[rng.upto(nums.len())].clone();
            if rng.chance(4)
                && let Some(old) = root.pointer(&p).cloned()
            {
                // Change every occurrence of this value at once: keeps
                // fields that must agree (a shape and the manifest's d, a
                // length and its shape) consistent while making them huge.
                let new = match old.as_u64() {
                    Some(o) => json!(interesting_int(rng, o)),
                    None => interesting_json(rng),
                };
                for q in &nums {
                    if let Some(node) = root.pointer_mut(q)
                        && *node == old
                    {
                        *node = new.clone();
                    }
                }
                return;
            }
            if let Some(node) = root.pointer_mut(&p) {
                *node = match node.as_u64() {
                    Some(old) if !rng.chance(4) => json!(interesting_int(rng, old)),
                    _ => interesting_json(rng),
                };
            }
            return;
        }
    }
    if rng.chance(6) {
        // Reorder an object's keys: key order carries no meaning, and a
        // typed metadata value may come before its "type".
        let objs: Vec<&String> = ptrs
            .iter()
            .filter(|p| root.pointer(p).is_some_and(Value::is_object))
            .collect();
        if !objs.is_empty() {
            let p = objs[rng.upto(objs.len())].clone();
            if let Some(Value::Object(m)) = root.pointer_mut(&p) {
                let mut entries: Vec<(String, Value)> = std::mem::take(m).into_iter().collect();
                if rng.chance(2) {
                    entries.reverse();
                } else if !entries.is_empty() {
                    let k = rng.upto(entries.len());
                    entries.rotate_left(k);
                }
                m.extend(entries);
            }
            return;
        }
    }
    let other = root
        .pointer(&ptrs[rng.upto(ptrs.len())])
        .cloned()
        .unwrap_or(Value::Null);
    let p = ptrs[rng.upto(ptrs.len())].clone();
    let Some(node) = root.pointer_mut(&p) else {
        return;
    };
    match rng.below(9) {
        0 => *node = interesting_json(rng),
        1 => {
            *node = match node {
                Value::Number(n) if n.is_u64() => {
                    let old = n.as_u64().unwrap_or(0);
                    json!(interesting_int(rng, old))
                }
                Value::Number(n) => json!(-n.as_f64().unwrap_or(0.0) * 1.5),
                _ => interesting_json(rng),
            }
        }
        2 => {
            *node = match rng.below(8) {
                0 => Value::Null,
                1 => json!(true),
                2 => json!(*rng.pick(STRINGS)),
                3 => json!([]),
                4 => json!({}),
                5 => json!([node.clone()]),
                6 => json!({"x": node.clone()}),
                _ => json!(node.to_string()),
            }
        }
        3 => match node {
            Value::Object(m) if !m.is_empty() => {
                let k = m.keys().nth(rng.upto(m.len())).cloned().unwrap_or_default();
                m.remove(&k);
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.upto(a.len());
                a.remove(i);
            }
            _ => *node = interesting_json(rng),
        },
        4 => match node {
            Value::Object(m) => {
                let v = if rng.chance(2) {
                    other
                } else {
                    interesting_json(rng)
                };
                m.insert(rng.pick(KEYS).to_string(), v);
            }
            Value::Array(a) => {
                let v = match a.first() {
                    Some(x) if rng.chance(2) => x.clone(),
                    _ => interesting_json(rng),
                };
                let at = rng.upto(a.len() + 1);
                a.insert(at, v);
            }
            _ => *node = other,
        },
        5 => match node {
            Value::Object(m) if !m.is_empty() => {
                // Rename a key (to a known key or a tensor-name alias).
                let k = m.keys().nth(rng.upto(m.len())).cloned().unwrap_or_default();
                if let Some(v) = m.remove(&k) {
                    let new = if rng.chance(2) {
                        rng.pick(KEYS).to_string()
                    } else {
                        rng.pick(STRINGS).to_string()
                    };
                    m.insert(new, v);
                }
            }
            Value::Array(a) if a.len() >= 2 => {
                let (i, j) = (rng.upto(a.len()), rng.upto(a.len()));
                if rng.chance(2) {
                    a.swap(i, j);
                } else {
                    a.truncate(i.max(1));
                }
            }
            _ => *node = json!(*rng.pick(STRINGS)),
        },
        6 => *node = other,
        7 => *node = json!(*rng.pick(STRINGS)),
        _ => {
            if let Value::Number(n) = node {
                let x = n.as_f64().unwrap_or(0.0);
                *node = json!(x + *rng.pick(&[0.5, -0.5, 1e-9, 2.0]));
            } else {
                *node = interesting_json(rng);
            }
        }
    }
}

/// Serialize, sometimes writing one object key twice (serde_json keeps the
/// last one).
fn to_text(v: &Value, rng: &mut Rng) -> Vec<u8> {
    fn write(v: &Value, out: &mut String, rng: &mut Rng, dups: &mut u32) {
        match v {
            Value::Object(m) => {
                out.push('{');
                let mut first = true;
                for (k, x) in m {
                    let key = serde_json::to_string(k).unwrap_or_default();
                    if *dups > 0 && rng.chance(6) {
                        *dups -= 1;
                        if !first {
                            out.push(',');
                        }
                        out.push_str(&key);
                        out.push(':');
                        out.push_str(&interesting_json(rng).to_string());
                        first = false;
                    }
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    out.push_str(&key);
                    out.push(':');
                    write(x, out, rng, dups);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out, rng, dups);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    if !rng.chance(8) {
        return serde_json::to_vec(v).unwrap_or_default();
    }
    let mut out = String::new();
    let mut dups = 1 + rng.below(2) as u32;
    write(v, &mut out, rng, &mut dups);
    out.into_bytes()
}

/// Raw edits of the JSON text (kept behind a correct length prefix).
fn mutate_text(t: &mut Vec<u8>, rng: &mut Rng) {
    const TOKENS: &[&[u8]] = &[
        b"1e999",
        b"-0",
        b"18446744073709551616",
        b"NaN",
        b"null",
        b"\"\\ud800\"",
        b"[[[[[[[[",
        b"}",
        b",",
        b"\xff",
    ];
    if t.is_empty() {
        let tok: &[u8] = TOKENS[rng.upto(TOKENS.len())];
        t.extend_from_slice(tok);
        return;
    }
    let at = rng.upto(t.len() + 1);
    match rng.below(3) {
        0 => {
            let tok: &[u8] = TOKENS[rng.upto(TOKENS.len())];
            t.splice(at..at, tok.iter().copied());
        }
        1 => t.truncate(at),
        _ => {
            let n = (t.len() - at).min(1 + rng.upto(8));
            t.drain(at..at + n);
        }
    }
}

/// A structured mutation of a KNOT or .rknot file; `None` if its header is
/// not JSON any more.
fn mutate_structured(d: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let kind = kind_of(d);
    let (mut v, rest) = match kind {
        Kind::Knot => {
            let (v, body) = corpus::knot_split(d)?;
            (v, corpus::RknotRest::V2 { body })
        }
        Kind::Rknot => corpus::rknot_split_any(d)?,
        Kind::Gguf => return None,
    };
    for _ in 0..1 + rng.below(3) {
        mutate_json(&mut v, rng);
    }
    let mut text = to_text(&v, rng);
    if rng.chance(6) {
        mutate_text(&mut text, rng);
    }
    Some(match (kind, &rest) {
        (Kind::Knot, corpus::RknotRest::V2 { body }) => corpus::knot_raw(&text, body),
        _ => corpus::rknot_raw_any(&text, &rest),
    })
}

/// Mutate one file of an input.
fn mutate(d: &mut Vec<u8>, rng: &mut Rng, lay: &FieldMap) {
    let structured = matches!(kind_of(d), Kind::Knot | Kind::Rknot);
    let mode = if structured { rng.below(20) } else { 10 };
    if mode < 10
        && let Some(m) = mutate_structured(d, rng)
    {
        *d = m;
    }
    let bytes_ops = match mode {
        0..=6 => 0,
        7..=9 => 1 + rng.below(2),
        _ => 1 + rng.below(4),
    };
    for _ in 0..bytes_ops {
        mutate_bytes(d, rng, lay);
    }
    // Files with checksums refuse any byte change to their metadata at the
    // KSUM record: half the time the record is recomputed, so the mutation
    // reaches the parsers behind it.
    if bytes_ops > 0 && rng.chance(2) {
        corpus::reseal_any(d);
    }
}

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
