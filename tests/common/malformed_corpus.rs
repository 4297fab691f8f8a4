//! Builds the malformed-file corpus of `tests/data/malformed`.
//!
//! Shared (by `#[path]`) between `examples/make_malformed_corpus.rs`, which
//! writes the corpus, `tests/malformed.rs`, which checks the committed corpus
//! against a fresh build and every case against the readers, and
//! `tests/fuzz_readers.rs`, which uses the valid seed builders.
//!
//! Every case starts from a small valid file written by the crate's own
//! writers and breaks exactly one thing. Everything here is deterministic:
//! no randomness, no time, and JSON maps serialize in sorted key order.

#![allow(dead_code)]

use rknot::format::container::write_container_header;
use rknot::format::gguf::write_gguf;
use rknot::format::knot::{KnotTensorOut, write_knot};
use rknot::format::meta::{MetaType, MetaValue, Metadata};
use rknot::format::rknot::{
    ArchMeta, Axis, Coding, LayerOut, LosslessFloat, Manifest, TensorSpec, write_rknot,
    write_rknot_v2,
};
use rknot::format::sk32::{Sketch, write_sk32};
use rknot::quant::GgmlType;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// One line of `expected.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Expected {
    /// File name in the corpus directory.
    pub file: String,
    /// Dense fallback file name (same directory), if the case opens a pair.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dense: Option<String>,
    /// `ErrorKind` as Debug.
    pub kind: String,
    /// Substring the error's Display must contain.
    pub contains: String,
    /// More substrings the Display must contain (e.g. both shapes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub contains_also: Vec<String>,
    pub why: String,
    /// The file opens; reading this whole tensor must fail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read: Option<String>,
    /// Which file the error must name: "file" (default) or "dense".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blame: Option<String>,
}

/// All files of the corpus (cases and the valid fallbacks they use) and the
/// expectations.
pub struct Corpus {
    pub files: Vec<(String, Vec<u8>)>,
    pub expected: Vec<Expected>,
}

/// The name of the expectations file.
pub const EXPECTED_JSON: &str = "expected.json";

impl Corpus {
    fn new() -> Self {
        Corpus {
            files: Vec::new(),
            expected: Vec::new(),
        }
    }

    /// A file the cases refer to but that is not itself a case.
    fn support(&mut self, file: &str, bytes: Vec<u8>) {
        assert!(!self.files.iter().any(|(f, _)| f == file), "{file} twice");
        self.files.push((file.to_string(), bytes));
    }

    /// A case: `file` must fail to open with `kind`, its message holding
    /// `contains`.
    fn case(&mut self, file: &str, bytes: Vec<u8>, kind: &str, contains: &str, why: &str) {
        self.support(file, bytes);
        self.expected.push(Expected {
            file: file.to_string(),
            dense: None,
            kind: kind.to_string(),
            contains: contains.to_string(),
            contains_also: Vec::new(),
            why: why.to_string(),
            read: None,
            blame: None,
        });
    }

    /// The last case must be read (tensor `name`) to fail.
    fn read(&mut self, name: &str) {
        self.last().read = Some(name.to_string());
    }

    fn last(&mut self) -> &mut Expected {
        self.expected.last_mut().expect("a case")
    }

    /// `expected.json` bytes.
    /// `expected.json` bytes: a JSON array, one case per line.
    pub fn expected_json(&self) -> Vec<u8> {
        let lines: Vec<String> = self
            .expected
            .iter()
            .map(|e| serde_json::to_string(e).expect("serialize expected"))
            .collect();
        format!("[\n{}\n]\n", lines.join(",\n")).into_bytes()
    }
}

// ------------------------------------------------------------------ values

/// Deterministic values in [-1, 1].
pub fn wave(i: usize, salt: usize) -> f32 {
    let x = (i.wrapping_mul(37).wrapping_add(salt.wrapping_mul(101)) % 29) as f32;
    (x - 14.0) / 14.0
}

fn waves(n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| wave(i, salt)).collect()
}

// -------------------------------------------------------------------- SK32

/// A quantized sketch with deterministic factors.
pub fn sketch(name: &str, d_out: usize, d_in: usize, rank: usize, salt: usize) -> Sketch {
    let u = waves(d_out * rank, salt);
    let sigma: Vec<f32> = (0..rank).map(|r| 2.0 / (r + 1) as f32).collect();
    let vt = waves(rank * d_in, salt + 7);
    Sketch::quantize(name, d_out, d_in, &u, &sigma, &vt)
}

pub fn sk32_bytes(sketches: &[Sketch]) -> Vec<u8> {
    let mut v = Vec::new();
    write_sk32(&mut v, "test", sketches).expect("write_sk32");
    v
}

/// Valid SK32: `blk.0.attn_q.weight` [8, 6] r2, `blk.0.ffn_up.weight` [4, 8] r1.
pub fn sk32_base() -> Vec<u8> {
    sk32_bytes(&[
        sketch("blk.0.attn_q.weight", 8, 6, 2, 1),
        sketch("blk.0.ffn_up.weight", 4, 8, 1, 2),
    ])
}

/// Fuzz seeds: SK32 files of varied shapes and ranks.
pub fn sk32_seeds() -> Vec<Vec<u8>> {
    vec![
        sk32_base(),
        sk32_bytes(&[sketch("blk.3.attn_o.weight", 1, 1, 1, 3)]),
        sk32_bytes(&[
            sketch("token_embd.weight", 16, 4, 4, 4),
            sketch("blk_0_ffn_down_weight", 3, 40, 3, 5),
            sketch("blk.0.attn_v.weight", 33, 2, 2, 6),
        ]),
        sk32_bytes(&[]),
    ]
}

// --------------------------------------------------------------- KNOT raw

/// A KNOT container around arbitrary meta bytes (for JSON that the writer
/// cannot produce).
pub fn knot_raw(meta: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(b"KNOT");
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    v.extend_from_slice(meta);
    while !v.len().is_multiple_of(4) {
        v.push(0);
    }
    v.push(0);
    let header_len = v.len();
    v.extend_from_slice(payload);
    reseal(&mut v, &[(0, header_len)]);
    v
}

/// Split a KNOT file into its meta JSON and payload.
pub fn knot_split(bytes: &[u8]) -> Option<(Value, Vec<u8>)> {
    if bytes.len() < 10 {
        return None;
    }
    let meta_len = u32::from_le_bytes(bytes[6..10].try_into().ok()?) as usize;
    let meta_end = 10usize.checked_add(meta_len)?;
    let meta: Value = serde_json::from_slice(bytes.get(10..meta_end)?).ok()?;
    let base = ((meta_end + 3) & !3) + 1;
    Some((meta, bytes.get(base..)?.to_vec()))
}

/// A KNOT file from meta JSON and payload (via the crate's header writer, so
/// padding and codec byte are right).
pub fn knot_join(meta: &Value, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    write_container_header(&mut v, meta).expect("container header");
    let header_len = v.len();
    v.extend_from_slice(payload);
    reseal(&mut v, &[(0, header_len)]);
    v
}

/// A file built from parts of a checked one (its data area ends in a KSUM
/// record, docs/FORMAT.md section 12) gets the record recomputed over its
/// new metadata `covered`, so an edit reaches the check it is made for
/// instead of failing the metadata checksum first. Cases about the record
/// itself edit the bytes after joining.
fn reseal(v: &mut [u8], covered: &[(usize, usize)]) {
    let Some(at) = record_at(v, covered) else {
        return;
    };
    let mut h = crc32fast::Hasher::new();
    for &(start, end) in covered {
        h.update(&v[start..end]);
    }
    v[at..at + 4].copy_from_slice(&h.finalize().to_le_bytes());
}

/// Where the KSUM record of a file whose metadata is `covered` (`[start,
/// end)` pairs) is, if it has one: the 8 bytes before the covered range
/// that starts after byte 0 (a .rknot's index), or the file's last 8 bytes
/// (a KNOT file).
fn record_at(v: &[u8], covered: &[(usize, usize)]) -> Option<usize> {
    let end = match covered.iter().find(|r| r.0 > 0) {
        Some(r) => r.0,
        None => v.len(),
    };
    let at = end.checked_sub(8)?;
    (at >= covered[0].1 && v.get(at + 4..at + 8)? == b"KSUM").then_some(at)
}

/// Edit the meta JSON (and payload) of a valid KNOT file.
fn knot_edit(base: &[u8], f: impl FnOnce(&mut Value, &mut Vec<u8>)) -> Vec<u8> {
    let (mut meta, mut payload) = knot_split(base).expect("valid KNOT");
    // The payload is edited without the KSUM record, which goes back at
    // its end (and is resealed by the join).
    let record = take_record(&mut payload);
    f(&mut meta, &mut payload);
    payload.extend_from_slice(&record);
    knot_join(&meta, &payload)
}

/// Remove a trailing KSUM record from `data`, returning it (empty if none).
fn take_record(data: &mut Vec<u8>) -> Vec<u8> {
    if data.len() >= 8 && data[data.len() - 4..] == *b"KSUM" {
        data.split_off(data.len() - 8)
    } else {
        Vec::new()
    }
}

/// Recompute the KSUM record of a KNOT file after an edit of its header
/// bytes (the codec byte, say), so the edit reaches its own check.
pub fn knot_reseal(v: &mut [u8]) {
    let base = knot_codec_at(v) + 1;
    reseal(v, &[(0, base)]);
}

/// Recompute the KSUM record of a KNOT or version-3 .rknot file, if it has
/// one where the file's own lengths say (a fuzzer's byte mutations then
/// reach the parsers behind the record, not only the record).
pub fn reseal_any(v: &mut [u8]) {
    let n = v.len();
    if v.starts_with(b"KNOT") && n >= 10 {
        let meta_len = u32::from_le_bytes([v[6], v[7], v[8], v[9]]) as usize;
        let base = ((10usize.saturating_add(meta_len) + 3) & !3) + 1;
        if base <= n {
            reseal(v, &[(0, base)]);
        }
    } else if v.starts_with(b"RKNOT\x03") && n >= 32 {
        let word = |at: usize| u64::from_le_bytes(v[at..at + 8].try_into().unwrap_or([0; 8]));
        let (index_len, header_len) = (word(n - 24), word(n - 16));
        let Some(index_at) = (n as u64 - 24)
            .checked_sub(header_len)
            .and_then(|h| h.checked_sub(index_len))
            .filter(|&i| i >= 8)
        else {
            return;
        };
        reseal(v, &[(0, 8), (index_at as usize, n)]);
    }
}

/// The same KNOT file without checksums: every `crc32` field and the KSUM
/// record removed (what writers made before checksums existed).
pub fn knot_unchecked(bytes: &[u8]) -> Vec<u8> {
    let (mut meta, mut payload) = knot_split(bytes).expect("valid KNOT");
    take_record(&mut payload);
    for table in ["sketches", "tensors"] {
        if let Some(t) = meta.get_mut(table).and_then(Value::as_object_mut) {
            for entry in t.values_mut() {
                if let Some(e) = entry.as_object_mut() {
                    e.remove("crc32");
                }
            }
        }
    }
    knot_join(&meta, &payload)
}

/// Offset of the codec byte of a KNOT file.
fn knot_codec_at(bytes: &[u8]) -> usize {
    let meta_len = u32::from_le_bytes(bytes[6..10].try_into().unwrap()) as usize;
    (10 + meta_len + 3) & !3
}

// -------------------------------------------------------------- dense knot

/// Valid ggml blocks: scales 1.0 (f16 0x3c00), deterministic quants.
pub fn ggml_data(ty: GgmlType, n_elements: u64, salt: usize) -> Vec<u8> {
    let blocks = (n_elements / ty.block_elems()) as usize;
    let bb = ty.block_bytes() as usize;
    let mut v = Vec::with_capacity(blocks * bb);
    match ty {
        GgmlType::F32 => {
            for i in 0..n_elements as usize {
                v.extend_from_slice(&wave(i, salt).to_le_bytes());
            }
        }
        _ => {
            for b in 0..blocks {
                let mut block: Vec<u8> = (0..bb)
                    .map(|i| (i.wrapping_mul(31) ^ b.wrapping_mul(7) ^ salt) as u8)
                    .collect();
                // ggml blocks of the types used here start with an f16 scale.
                if matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0) {
                    block[0..2].copy_from_slice(&0x3c00u16.to_le_bytes());
                }
                if matches!(ty, GgmlType::F16 | GgmlType::Bf16) {
                    block.copy_from_slice(&0x3c00u16.to_le_bytes());
                }
                v.extend_from_slice(&block);
            }
        }
    }
    v
}

pub fn knot_metadata() -> Metadata {
    let mut md = Metadata::default();
    md.push(
        "general.architecture",
        MetaValue::String("llama".to_string()),
    );
    md.push("llama.block_count", MetaValue::U32(1));
    md
}

pub fn knot_bytes(md: &Metadata, tensors: &[(&str, GgmlType, Vec<u64>)]) -> Vec<u8> {
    let datas: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(i, (_, ty, shape))| ggml_data(*ty, shape.iter().product(), i))
        .collect();
    let outs: Vec<KnotTensorOut> = tensors
        .iter()
        .zip(&datas)
        .map(|((name, ty, shape), data)| KnotTensorOut {
            name,
            ty: *ty,
            shape,
            data,
        })
        .collect();
    let mut v = Vec::new();
    write_knot(&mut v, md, &outs).expect("write_knot");
    v
}

/// Valid dense .knot: `blk_0_attn_q_weight` q8_0 [2, 64], `output_norm_weight`
/// f32 [16], `blk_0_ffn_up_weight` q4_0 [2, 32].
pub fn knot_base() -> Vec<u8> {
    knot_bytes(
        &knot_metadata(),
        &[
            ("blk.0.attn_q.weight", GgmlType::Q8_0, vec![2, 64]),
            ("output_norm.weight", GgmlType::F32, vec![16]),
            ("blk.0.ffn_up.weight", GgmlType::Q4_0, vec![2, 32]),
        ],
    )
}

pub fn knot_seeds() -> Vec<Vec<u8>> {
    vec![
        knot_base(),
        knot_bytes(
            &Metadata::default(),
            &[
                ("blk.1.ffn_down.weight", GgmlType::Q4K, vec![2, 256]),
                ("blk.1.attn_v.weight", GgmlType::Q6K, vec![256]),
                ("token_embd.weight", GgmlType::F16, vec![3, 4]),
                ("rope_freqs.weight", GgmlType::Bf16, vec![2, 2, 2]),
            ],
        ),
        knot_bytes(
            &knot_metadata(),
            &[
                ("blk.2.attn_k.weight", GgmlType::Q5_1, vec![1, 1, 1, 32]),
                ("blk.2.attn_norm.weight", GgmlType::Q2K, vec![256]),
                ("blk.2.ffn_gate.weight", GgmlType::Q3K, vec![256]),
                ("blk.2.ffn_up.weight", GgmlType::Q5K, vec![256]),
                ("blk.2.ffn_norm.weight", GgmlType::Q4_1, vec![32]),
            ],
        ),
    ]
}

// ------------------------------------------------------------------- rknot

pub fn manifest(d: u64, standing: &[u64]) -> Manifest {
    let k = standing.len();
    Manifest {
        d,
        standing_indices: standing.to_vec(),
        amplitudes: (0..k).map(|i| 1.0 / (1u32 << i.min(20)) as f32).collect(),
        phase_alignment: (0..k).map(|i| 1.0 - i as f32 / 8.0).collect(),
    }
}

pub fn spec(
    name: &str,
    shape: [u64; 2],
    restrict: (bool, bool),
    coding: Coding,
    block: [u64; 2],
) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        d_out: shape[0],
        d_in: shape[1],
        restrict_rows: restrict.0,
        restrict_cols: restrict.1,
        coding,
        block_rows: block[0],
        block_cols: block[1],
    }
}

pub fn layer(index: u64, m: Manifest, specs: Vec<TensorSpec>, salt: usize) -> LayerOut {
    let tensors = specs
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let dense = waves((s.d_out * s.d_in) as usize, salt + i);
            let blocks = s.encode(&m, &dense);
            (s, blocks)
        })
        .collect();
    LayerOut {
        index,
        manifest: m,
        tensors,
    }
}

fn corpus_arch(num_layers: u64) -> ArchMeta {
    ArchMeta {
        arch: "llama".to_string(),
        hidden_dim: 16,
        num_layers,
        metadata: Metadata::default(),
    }
}

/// A version-2 .rknot (the layout of files written before version 3).
pub fn rknot_bytes(num_layers: u64, layers: &[LayerOut]) -> Vec<u8> {
    let mut v = Vec::new();
    write_rknot_v2(&mut v, &corpus_arch(num_layers), layers).expect("write_rknot_v2");
    v
}

/// A version-3 .rknot.
pub fn rknot3_bytes(num_layers: u64, layers: &[LayerOut]) -> Vec<u8> {
    let mut v = Vec::new();
    write_rknot(&mut v, &corpus_arch(num_layers), layers).expect("write_rknot");
    v
}

/// Valid .rknot. Layer 0 (d 16, standing [1, 5, 9, 12]):
/// tensors[0] `blk.0.attn_q.weight` [16, 16] cols restricted, uniform 4 bits,
/// block [4, 2]; tensors[1] `blk.0.ffn_up.weight` [8, 16] cols restricted,
/// graded max 6 by rows, widths [6, 5, 0, 3, 6, 2, 1, 4], block [4, 4];
/// tensors[2] `blk.0.attn_k.weight` [16, 8] rows restricted, uniform 8,
/// block [2, 8]. Layer 1 (d 16, standing [0, 15]): `blk.1.attn_q.weight`
/// [8, 16] unrestricted, graded max 5 by cols (widths i % 6), block [8, 8].
pub fn rknot_base() -> Vec<u8> {
    rknot_bytes(2, &rknot_base_layers())
}

/// [`rknot_base`] in version 3.
pub fn rknot3_base() -> Vec<u8> {
    rknot3_bytes(2, &rknot_base_layers())
}

/// [`rknot3_base`] plus one tensor stored as ggml blocks after the
/// compressed ones: `output_norm.weight`, f32 [16] (64 bytes).
pub fn rknot3_dense_base() -> Vec<u8> {
    use rknot::format::rknot::RknotWriter;
    use rknot::quant::GgmlType;
    let mut v = Vec::new();
    let mut w = RknotWriter::new(&mut v).expect("writer");
    for l in rknot_base_layers() {
        w.begin_layer(l.index, l.manifest.clone());
        for (spec, blocks) in &l.tensors {
            w.tensor(spec, blocks).expect("tensor");
        }
    }
    let values: Vec<u8> = (0..16)
        .flat_map(|i| (i as f32 / 16.0).to_le_bytes())
        .collect();
    w.dense_tensor("output_norm.weight", GgmlType::F32, &[16], |off, buf| {
        buf.copy_from_slice(&values[off as usize..off as usize + buf.len()]);
        Ok(())
    })
    .expect("dense tensor");
    w.finish(&corpus_arch(2)).expect("finish");
    v
}

fn rknot_base_layers() -> Vec<LayerOut> {
    let l0 = layer(
        0,
        manifest(16, &[1, 5, 9, 12]),
        vec![
            spec(
                "blk.0.attn_q.weight",
                [16, 16],
                (false, true),
                Coding::Uniform { bits: 4 },
                [4, 2],
            ),
            spec(
                "blk.0.ffn_up.weight",
                [8, 16],
                (false, true),
                Coding::Graded {
                    max_bits: 6,
                    line_axis: Axis::Rows,
                    line_bits: vec![6, 5, 0, 3, 6, 2, 1, 4],
                },
                [4, 4],
            ),
            spec(
                "blk.0.attn_k.weight",
                [16, 8],
                (true, false),
                Coding::Uniform { bits: 8 },
                [2, 8],
            ),
        ],
        0,
    );
    let l1 = layer(
        1,
        manifest(16, &[0, 15]),
        vec![spec(
            "blk.1.attn_q.weight",
            [8, 16],
            (false, false),
            Coding::Graded {
                max_bits: 5,
                line_axis: Axis::Cols,
                line_bits: (0..16).map(|i| (i % 6) as u8).collect(),
            },
            [8, 8],
        )],
        10,
    );
    vec![l0, l1]
}

/// A version-2 .rknot (no checksums: a codec fault is what a read meets)
/// of lossless tensors (docs/FORMAT.md 6.7), layer 0, d 16, nothing
/// restricted: tensors[0] `blk.0.attn_q.weight` lossless_bf16 [16, 64], one
/// coded block [16, 64]; tensors[1] `blk.0.attn_k.weight` lossless_f32
/// [4, 16], blocks [2, 16]; tensors[2] `blk.0.attn_v.weight` lossless_f16
/// [4, 16], block [4, 16]; tensors[3] `blk.0.ffn_up.weight` lossless_bf16
/// [2, 8] of one value (a constant block).
pub fn lossless_layers() -> Vec<LayerOut> {
    let lossless = |float| Coding::Lossless { float };
    // Every dimension standing, as the lossless profile writes.
    let all = Manifest {
        d: 16,
        standing_indices: (0..16).collect(),
        amplitudes: vec![1.0; 16],
        phase_alignment: vec![1.0; 16],
    };
    let mut l = layer(
        0,
        all,
        vec![
            spec(
                "blk.0.attn_q.weight",
                [16, 64],
                (false, false),
                lossless(LosslessFloat::Bf16),
                [16, 64],
            ),
            spec(
                "blk.0.attn_k.weight",
                [4, 16],
                (false, false),
                lossless(LosslessFloat::F32),
                [2, 16],
            ),
            spec(
                "blk.0.attn_v.weight",
                [4, 16],
                (false, false),
                lossless(LosslessFloat::F16),
                [4, 16],
            ),
        ],
        40,
    );
    let constant = spec(
        "blk.0.ffn_up.weight",
        [2, 8],
        (false, false),
        lossless(LosslessFloat::Bf16),
        [2, 8],
    );
    let blocks = constant.encode(&l.manifest, &[0.5; 16]);
    l.tensors.push((constant, blocks));
    vec![l]
}

pub fn lossless_base() -> Vec<u8> {
    rknot_bytes(1, &lossless_layers())
}

/// Lossless blocks (docs/FORMAT.md 6.7): code tables, stream and raw
/// lengths, kinds; each breaks one block of [`lossless_base`] and is met
/// when the tensor is read, except `bits`, refused at open.
fn lossless_cases(c: &mut Corpus) {
    let edit = |f: &dyn Fn(&mut Value, &mut Vec<u8>)| {
        let (mut h, mut body) = rknot_split(&lossless_base()).expect("valid lossless rknot");
        f(&mut h, &mut body);
        rknot_join(&h, &body)
    };
    let q = |h: &Value| block_off(h, 0, 0, 0);
    // The bf16 block's code lengths: nibbles of bytes 1..129; the symbols
    // of the waves (exponents near 127) have codes, the first ones not.
    let nibble = |body: &[u8], at: usize, y: usize| (body[at + 1 + y / 2] >> (4 * (y % 2))) & 0xf;
    let set_nibble = |body: &mut [u8], at: usize, y: usize, v: u8| {
        let b = &mut body[at + 1 + y / 2];
        *b = if y.is_multiple_of(2) {
            (*b & 0xf0) | v
        } else {
            (*b & 0x0f) | (v << 4)
        };
    };
    let used = |body: &[u8], at: usize| {
        (0..256)
            .find(|&y| nibble(body, at, y) != 0)
            .expect("a code")
    };
    c.case(
        "lossless_code_too_long.rknot",
        edit(&|h, body| {
            let at = q(h);
            let y = used(body, at);
            set_nibble(body, at, y, 13);
        }),
        "BadValue",
        "the longest allowed is 12",
        "a lossless code length of 13 bits",
    );
    c.read("blk.0.attn_q.weight");
    c.case(
        "lossless_oversubscribed.rknot",
        edit(&|h, body| {
            let at = q(h);
            set_nibble(body, at, 0, 1);
        }),
        "BadValue",
        "oversubscribed",
        "a 1-bit code added to a complete code: more codes than fit",
    );
    c.read("blk.0.attn_q.weight");
    c.case(
        "lossless_incomplete.rknot",
        edit(&|h, body| {
            // The shortest code (below 12 bits, as another is longer).
            let at = q(h);
            let y = (0..256)
                .filter(|&y| nibble(body, at, y) != 0)
                .min_by_key(|&y| nibble(body, at, y))
                .expect("a code");
            let l = nibble(body, at, y);
            set_nibble(body, at, y, l + 1);
        }),
        "BadValue",
        "incomplete",
        "a code made one bit longer: the code no longer fills the table",
    );
    c.read("blk.0.attn_q.weight");
    c.case(
        "lossless_stream_lengths.rknot",
        edit(&|h, body| {
            // One byte moved from stream 0 to stream 1: the total is
            // right, the codes end elsewhere.
            let at = q(h) + 129;
            let l0 = u32::from_le_bytes(body[at..at + 4].try_into().unwrap());
            let l1 = u32::from_le_bytes(body[at + 4..at + 8].try_into().unwrap());
            set(body, at, &(l0 - 1).to_le_bytes());
            set(body, at + 4, &(l1 + 1).to_le_bytes());
        }),
        "LengthMismatch",
        "stream 0 is",
        "a stream shorter than its codes (and the next one longer)",
    );
    c.read("blk.0.attn_q.weight");
    c.case(
        "lossless_stream_past_block.rknot",
        edit(&|h, body| {
            let at = q(h) + 129 + 8;
            set(body, at, &u32::MAX.to_le_bytes());
        }),
        "LengthMismatch",
        "lossless block: ",
        "a stream length of 2^32 - 1 bytes in a block of a few hundred",
    );
    c.read("blk.0.attn_q.weight");
    c.case(
        "lossless_raw_truncated.rknot",
        edit(&|h, _| {
            // The f32 tensor's second block listed one byte short: its raw
            // section ends early (the length is still in the open bounds).
            let b = &mut h["layers"][0]["tensors"][1]["blocks"][1];
            let len = b[1].as_u64().unwrap();
            b[1] = json!(len - 1);
        }),
        "LengthMismatch",
        "lossless block: ",
        "a lossless_f32 block whose raw section is cut short by a byte",
    );
    c.read("blk.0.attn_k.weight");
    c.case(
        "lossless_kind.rknot",
        edit(&|h, body| {
            let at = block_off(h, 0, 2, 0);
            body[at] = 7;
        }),
        "BadValue",
        "kind 7 is not 0 (coded) or 1 (constant)",
        "a lossless block kind other than coded (0) and constant (1)",
    );
    c.read("blk.0.attn_v.weight");
    c.case(
        "lossless_constant_short.rknot",
        edit(&|h, _| {
            let b = &mut h["layers"][0]["tensors"][3]["blocks"][0];
            let len = b[1].as_u64().unwrap();
            b[1] = json!(len - 1);
        }),
        "LengthMismatch",
        "block 0 has length 17; a 2x8 tile at 8 bits needs 18..=185",
        "a constant lossless block one raw byte short: below the shortest block, refused at open",
    );
    c.case(
        "lossless_bits.rknot",
        edit(&|h, _| {
            h["layers"][0]["tensors"][0]["bits"] = json!(9);
        }),
        "BadValue",
        "a lossless_bf16 tensor has bits 8, not 9",
        "a lossless tensor's bits other than 8",
    );
}

pub fn rknot_seeds() -> Vec<Vec<u8>> {
    let both = layer(
        3,
        manifest(12, &[0, 2, 3, 7, 11]),
        vec![
            spec(
                "blk.3.attn_o.weight",
                [12, 12],
                (true, true),
                Coding::Uniform { bits: 16 },
                [2, 3],
            ),
            spec(
                "blk.3.ffn_gate.weight",
                [12, 7],
                (true, false),
                Coding::Graded {
                    max_bits: 16,
                    line_axis: Axis::Cols,
                    line_bits: vec![16, 0, 1, 9, 15, 2, 7],
                },
                [3, 7],
            ),
            spec(
                "blk.3.ffn_down.weight",
                [5, 3],
                (false, false),
                Coding::Uniform { bits: 1 },
                [5, 3],
            ),
        ],
        20,
    );
    let odd = layer(
        0,
        manifest(4, &[3]),
        vec![spec(
            "output.weight",
            [4, 9],
            (true, false),
            Coding::Graded {
                max_bits: 3,
                line_axis: Axis::Rows,
                line_bits: vec![3],
            },
            [1, 4],
        )],
        30,
    );
    vec![
        rknot_base(),
        rknot_bytes(4, std::slice::from_ref(&both)),
        rknot_bytes(1, std::slice::from_ref(&odd)),
        rknot_bytes(0, &[]),
        rknot3_base(),
        rknot3_bytes(4, &[both]),
        rknot3_bytes(1, &[odd]),
        rknot3_bytes(0, &[]),
        rknot3_dense_base(),
        lossless_base(),
        rknot3_bytes(1, &lossless_layers()),
    ]
}

/// What surrounds a .rknot header of either version.
pub enum RknotRest {
    V2 { body: Vec<u8> },
    V3 { body: Vec<u8>, index: Vec<u8> },
}

/// Split a .rknot of either version into its header JSON and the rest.
pub fn rknot_split_any(bytes: &[u8]) -> Option<(Value, RknotRest)> {
    if bytes.starts_with(b"RKNOT\x03") {
        let (h, body, index) = rknot3_split(bytes)?;
        Some((h, RknotRest::V3 { body, index }))
    } else {
        let (h, body) = rknot_split(bytes)?;
        Some((h, RknotRest::V2 { body }))
    }
}

/// Join raw header bytes and the rest, in the rest's version.
pub fn rknot_raw_any(header: &[u8], rest: &RknotRest) -> Vec<u8> {
    match rest {
        RknotRest::V2 { body } => rknot_raw(header, body),
        RknotRest::V3 { body, index } => rknot3_raw(header, body, index),
    }
}

/// Split a version-3 .rknot into header JSON, body and block index.
pub fn rknot3_split(bytes: &[u8]) -> Option<(Value, Vec<u8>, Vec<u8>)> {
    let n = bytes.len();
    if n < 32 || bytes.get(..6)? != b"RKNOT\x03" || bytes.get(n - 8..)? != b"RKNOTEND" {
        return None;
    }
    let word = |at: usize| -> Option<usize> {
        usize::try_from(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?)).ok()
    };
    let (index_len, header_len) = (word(n - 24)?, word(n - 16)?);
    let header_at = (n - 24).checked_sub(header_len)?;
    let index_at = header_at.checked_sub(index_len)?.max(8);
    let h: Value = serde_json::from_slice(bytes.get(header_at..n - 24)?).ok()?;
    Some((
        h,
        bytes.get(8..index_at)?.to_vec(),
        bytes.get(index_at..header_at)?.to_vec(),
    ))
}

/// A version-3 .rknot from raw header bytes, body and block index.
pub fn rknot3_raw(header: &[u8], body: &[u8], index: &[u8]) -> Vec<u8> {
    let mut v = b"RKNOT\x03\0\0".to_vec();
    v.extend_from_slice(body);
    let index_at = v.len();
    v.extend_from_slice(index);
    v.extend_from_slice(header);
    v.extend_from_slice(&(index.len() as u64).to_le_bytes());
    v.extend_from_slice(&(header.len() as u64).to_le_bytes());
    v.extend_from_slice(b"RKNOTEND");
    let n = v.len();
    reseal(&mut v, &[(0, 8), (index_at, n)]);
    v
}

pub fn rknot3_join(h: &Value, body: &[u8], index: &[u8]) -> Vec<u8> {
    rknot3_raw(&serde_json::to_vec(h).expect("header json"), body, index)
}

/// [`rknot3_base`] with its header, body and index edited by `f`.
fn rknot3_edit(f: impl FnOnce(&mut Value, &mut Vec<u8>, &mut Vec<u8>)) -> Vec<u8> {
    let (mut h, mut body, mut index) = rknot3_split(&rknot3_base()).expect("valid rknot v3");
    let record = take_record(&mut body);
    f(&mut h, &mut body, &mut index);
    body.extend_from_slice(&record);
    rknot3_join(&h, &body, &index)
}

/// Split a .rknot file into header JSON and body.
pub fn rknot_split(bytes: &[u8]) -> Option<(Value, Vec<u8>)> {
    let len = u32::from_le_bytes(bytes.get(6..10)?.try_into().ok()?) as usize;
    let end = 10usize.checked_add(len)?;
    let h: Value = serde_json::from_slice(bytes.get(10..end)?).ok()?;
    Some((h, bytes.get(end..)?.to_vec()))
}

/// A .rknot file from raw header bytes and body.
pub fn rknot_raw(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut v = b"RKNOT\x02".to_vec();
    v.extend_from_slice(&(header.len() as u32).to_le_bytes());
    v.extend_from_slice(header);
    v.extend_from_slice(body);
    v
}

pub fn rknot_join(h: &Value, body: &[u8]) -> Vec<u8> {
    rknot_raw(&serde_json::to_vec(h).expect("header json"), body)
}

fn rknot_edit(f: impl FnOnce(&mut Value, &mut Vec<u8>)) -> Vec<u8> {
    let (mut h, mut body) = rknot_split(&rknot_base()).expect("valid rknot");
    f(&mut h, &mut body);
    rknot_join(&h, &body)
}

/// Body offset of block `b` of tensor `t` of layer `l`.
fn block_off(h: &Value, l: usize, t: usize, b: usize) -> usize {
    h["layers"][l]["tensors"][t]["blocks"][b][0]
        .as_u64()
        .expect("block offset") as usize
}

// -------------------------------------------------------------------- GGUF

/// Little-endian GGUF builder (for fields the writer never produces).
#[derive(Default, Clone)]
pub struct G {
    pub out: Vec<u8>,
}

impl G {
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.out.extend_from_slice(b);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    pub fn pad(&mut self, align: usize) -> &mut Self {
        while !self.out.len().is_multiple_of(align) {
            self.out.push(0);
        }
        self
    }
    /// Tensor info: name, dims (ne order), ggml type id, relative offset.
    pub fn info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
}

/// The pieces of a small GGUF file, each overridable.
#[derive(Clone)]
pub struct GgufParts {
    pub version: u32,
    pub tensor_count: Option<u64>,
    pub kv_count: Option<u64>,
    /// Encoded kv pairs.
    pub kvs: Vec<Vec<u8>>,
    /// Encoded tensor infos.
    pub infos: Vec<Vec<u8>>,
    pub alignment: usize,
    pub data: Vec<u8>,
}

pub fn kv_str(key: &str, val: &str) -> Vec<u8> {
    let mut g = G::default();
    g.str(key).u32(8).str(val);
    g.out
}

pub fn kv_u32(key: &str, val: u32) -> Vec<u8> {
    let mut g = G::default();
    g.str(key).u32(4).u32(val);
    g.out
}

pub fn kv_str_array(key: &str, vals: &[&str]) -> Vec<u8> {
    let mut g = G::default();
    g.str(key).u32(9).u32(8).u64(vals.len() as u64);
    for v in vals {
        g.str(v);
    }
    g.out
}

pub fn info(name: &str, dims: &[u64], ty: GgmlType, offset: u64) -> Vec<u8> {
    let mut g = G::default();
    g.info(name, dims, ty.id(), offset);
    g.out
}

impl GgufParts {
    pub fn bytes(&self) -> Vec<u8> {
        let mut g = G::default();
        g.bytes(b"GGUF")
            .u32(self.version)
            .u64(self.tensor_count.unwrap_or(self.infos.len() as u64))
            .u64(self.kv_count.unwrap_or(self.kvs.len() as u64));
        for kv in &self.kvs {
            g.bytes(kv);
        }
        for i in &self.infos {
            g.bytes(i);
        }
        g.pad(self.alignment).bytes(&self.data);
        g.out
    }
}

/// The GGUF tensors of [`gguf_base`]: (name, ne dims, type).
pub fn gguf_base_tensors() -> Vec<(String, Vec<u64>, GgmlType)> {
    vec![
        (
            "blk.0.attn_q.weight".to_string(),
            vec![32, 2],
            GgmlType::Q8_0,
        ),
        ("output_norm.weight".to_string(), vec![8], GgmlType::F32),
    ]
}

pub fn gguf_metadata() -> Metadata {
    let mut md = Metadata::default();
    md.push(
        "general.architecture",
        MetaValue::String("llama".to_string()),
    );
    md.push("llama.block_count", MetaValue::U32(1));
    md.push(
        "tokenizer.ggml.tokens",
        MetaValue::Array {
            elem: MetaType::String,
            values: vec![
                MetaValue::String("a".to_string()),
                MetaValue::String("b".to_string()),
            ],
        },
    );
    md
}

pub fn gguf_bytes(md: &Metadata, tensors: &[(String, Vec<u64>, GgmlType)], align: u64) -> Vec<u8> {
    let datas: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(i, (_, dims, ty))| ggml_data(*ty, dims.iter().product(), i))
        .collect();
    let ts: Vec<(String, Vec<u64>, GgmlType, &[u8])> = tensors
        .iter()
        .zip(&datas)
        .map(|((n, d, t), data)| (n.clone(), d.clone(), *t, data.as_slice()))
        .collect();
    let mut v = Vec::new();
    write_gguf(&mut v, md, &ts, align).expect("write_gguf");
    v
}

/// Valid GGUF (written by `write_gguf`): `blk.0.attn_q.weight` q8_0 ne
/// [32, 2] at data offset 0 (68 bytes), `output_norm.weight` f32 ne [8] at
/// 96.
pub fn gguf_base() -> Vec<u8> {
    gguf_bytes(&gguf_metadata(), &gguf_base_tensors(), 32)
}

/// [`gguf_base`] as hand-built parts (checked equal to the writer's bytes
/// when the corpus is built).
pub fn gguf_parts() -> GgufParts {
    let t = gguf_base_tensors();
    let mut data = ggml_data(t[0].2, 64, 0);
    data.resize(96, 0);
    data.extend(ggml_data(t[1].2, 8, 1));
    GgufParts {
        version: 3,
        tensor_count: None,
        kv_count: None,
        kvs: vec![
            kv_str("general.architecture", "llama"),
            kv_u32("llama.block_count", 1),
            kv_str_array("tokenizer.ggml.tokens", &["a", "b"]),
        ],
        infos: vec![
            info(&t[0].0, &t[0].1, t[0].2, 0),
            info(&t[1].0, &t[1].1, t[1].2, 96),
        ],
        alignment: 32,
        data,
    }
}

pub fn gguf_seeds() -> Vec<Vec<u8>> {
    let mut md = Metadata::default();
    md.push("general.alignment", MetaValue::U32(64));
    md.push(
        "nested",
        MetaValue::Array {
            elem: MetaType::Array,
            values: vec![MetaValue::Array {
                elem: MetaType::F32,
                values: vec![MetaValue::F32(1.5), MetaValue::F32(-2.0)],
            }],
        },
    );
    md.push("flag", MetaValue::Bool(true));
    md.push("big", MetaValue::U64(u64::MAX));
    md.push("neg", MetaValue::I64(-5));
    md.push("pi", MetaValue::F64(3.25));
    vec![
        gguf_base(),
        gguf_bytes(
            &md,
            &[
                (
                    "blk.0.ffn_down.weight".to_string(),
                    vec![256, 2],
                    GgmlType::Q4K,
                ),
                ("blk.0.ffn_up.weight".to_string(), vec![256], GgmlType::Q6K),
                (
                    "token_embd.weight".to_string(),
                    vec![4, 3, 2, 1],
                    GgmlType::F16,
                ),
                (
                    "blk.0.attn_k.weight".to_string(),
                    vec![32, 1, 2],
                    GgmlType::Q5_0,
                ),
                ("blk.0.attn_v.weight".to_string(), vec![256], GgmlType::Q8K),
            ],
            64,
        ),
        gguf_bytes(&Metadata::default(), &[], 32),
    ]
}

// ------------------------------------------------------------- layered

/// Valid SK32 + GGUF pairs whose shared tensors' shapes agree (fuzz seeds).
/// The first SK32 holds `blk.0.attn_q.weight` [2, 32] (also in the GGUF),
/// a vocab sketch the GGUF also has and tensors only it has.
pub fn layered_seeds() -> Vec<(Vec<u8>, Vec<u8>)> {
    let sk = sk32_bytes(&[
        sketch("blk.0.attn_q.weight", 2, 32, 2, 40),
        sketch("token_embd.weight", 2, 4, 2, 41),
        sketch("blk.0.attn_o.weight", 2, 2, 2, 42),
        sketch("output.weight", 3, 3, 1, 43),
    ]);
    let mut t = gguf_base_tensors();
    t.push(("token_embd.weight".to_string(), vec![4, 2], GgmlType::F32));
    let gg = gguf_bytes(&gguf_metadata(), &t, 32);
    let sk2 = sk32_bytes(&[
        sketch("blk.0.ffn_down.weight", 2, 256, 2, 44),
        sketch("blk_1_attn_q_weight", 4, 4, 1, 45),
    ]);
    vec![(sk, gg), (sk2, gguf_seeds().swap_remove(1))]
}

// --------------------------------------------------------------- the corpus

fn set(v: &mut [u8], at: usize, bytes: &[u8]) {
    v[at..at + bytes.len()].copy_from_slice(bytes);
}

/// Build every file of the corpus.
pub fn build() -> Corpus {
    let mut c = Corpus::new();
    sk32_cases(&mut c);
    knot_cases(&mut c);
    rknot_cases(&mut c);
    rknot3_cases(&mut c);
    rknot3_dense_cases(&mut c);
    lossless_cases(&mut c);
    gguf_cases(&mut c);
    layered_cases(&mut c);
    magic_cases(&mut c);
    checksum_cases(&mut c);
    c
}

/// docs/FORMAT.md section 12: the KSUM record and the checksum fields.
fn checksum_cases(c: &mut Corpus) {
    let knot = knot_base();
    let sk32 = sk32_base();
    let rknot = rknot3_base();
    let flip = |v: &[u8], at: usize| {
        let mut v = v.to_vec();
        v[at] ^= 0x20;
        v
    };
    c.case(
        "ck_knot_meta_flipped.knot",
        flip(&knot, 40),
        "Checksum",
        "the header or index is damaged",
        "a byte of a checked dense .knot's meta JSON flipped: the KSUM record disagrees",
    );
    c.case(
        "ck_knot_record_crc_flipped.knot",
        flip(&knot, knot.len() - 6),
        "Checksum",
        "its KSUM record says",
        "the KSUM record's CRC-32 itself damaged",
    );
    c.case(
        "ck_knot_record_cut.knot",
        knot[..knot.len() - 8].to_vec(),
        "Checksum",
        "has a checksum field but the file has no KSUM record",
        "the KSUM record cut off: every tensor still carries crc32",
    );
    c.case(
        "ck_knot_crc_missing.knot",
        knot_edit(&knot, |m, _| {
            m["tensors"]["output_norm_weight"]
                .as_object_mut()
                .unwrap()
                .remove("crc32");
        }),
        "Checksum",
        "has no checksum field",
        "a checked file whose tensor has no crc32",
    );
    c.case(
        "ck_knot_crc_count.knot",
        knot_edit(&knot, |m, _| {
            m["tensors"]["output_norm_weight"]["crc32"]["values"] = json!([1, 2]);
        }),
        "LengthMismatch",
        "crc32 has 2 values",
        "crc32 with more values than chunks",
    );
    c.case(
        "ck_knot_crc_chunk_0.knot",
        knot_edit(&knot, |m, _| {
            m["tensors"]["output_norm_weight"]["crc32"]["chunk"] = json!(0);
        }),
        "BadValue",
        "crc32 chunk 0",
        "crc32 chunk 0",
    );
    c.case(
        "ck_knot_crc_value_2_32.knot",
        knot_edit(&knot, |m, _| {
            m["tensors"]["output_norm_weight"]["crc32"]["values"] = json!([4294967296u64]);
        }),
        "BadValue",
        "crc32 value 4294967296",
        "a CRC-32 value that does not fit 32 bits",
    );
    c.case(
        "ck_knot_crc_not_object.knot",
        knot_edit(&knot, |m, _| {
            m["tensors"]["output_norm_weight"]["crc32"] = json!([1]);
        }),
        "BadJson",
        "must be a JSON object",
        "crc32 that is not an object",
    );
    c.case(
        "ck_knot_unchecked_with_crc.knot",
        {
            let (mut m, p) = knot_split(&knot_unchecked(&knot)).unwrap();
            m["tensors"]["output_norm_weight"]["crc32"] = json!({"chunk": 65536, "values": [0]});
            knot_join(&m, &p)
        },
        "Checksum",
        "no KSUM record",
        "a file without a KSUM record whose tensor carries crc32",
    );
    c.case(
        "ck_sk32_trunc.sk32",
        sk32[..sk32.len() - 5].to_vec(),
        "Checksum",
        "no KSUM record",
        "a checked SK32 cut short: its KSUM record is gone",
    );
    c.case(
        "ck_sk32_over_record.sk32",
        knot_edit(&sk32, |m, _| {
            let t = &mut m["sketches"]["blk.0.ffn_up.weight"];
            let off = t["offset"].as_u64().unwrap();
            t["offset"] = json!(off + 8);
        }),
        "OutOfBounds",
        "runs into the KSUM record",
        "a sketch moved over the KSUM record",
    );
    c.case(
        "ck_rknot3_header_flipped.rknot",
        flip(&rknot, rknot.len() - 40),
        "Checksum",
        "the header or index is damaged",
        "a byte of a checked .rknot's header flipped",
    );
    c.case(
        "ck_rknot3_crc_missing.rknot",
        rknot3_edit(|h, _, _| {
            h["layers"][0]["tensors"][0]
                .as_object_mut()
                .unwrap()
                .remove("block_crc32");
        }),
        "Checksum",
        "has no checksum field",
        "a checked .rknot tensor without block_crc32",
    );
    c.case(
        "ck_rknot3_crc_outside_index.rknot",
        rknot3_edit(|h, _, index| {
            h["layers"][0]["tensors"][0]["block_crc32"]["at"] = json!(index.len());
        }),
        "OutOfBounds",
        "block_crc32 of",
        "block_crc32 values past the end of the index",
    );
    c.case(
        "ck_rknot3_crc_group_0.rknot",
        rknot3_edit(|h, _, _| {
            h["layers"][0]["tensors"][0]["block_crc32"]["group"] = json!(0);
        }),
        "BadValue",
        "group 0",
        "block_crc32 group 0",
    );
    c.case(
        "ck_rknot3_record_cut.rknot",
        {
            let (h, mut body, index) = rknot3_split(&rknot).unwrap();
            take_record(&mut body);
            rknot3_join(&h, &body, &index)
        },
        "Checksum",
        "no KSUM record",
        "a checked .rknot whose KSUM record was removed",
    );
}

fn sk32_cases(c: &mut Corpus) {
    let base = sk32_base();
    let codec_at = knot_codec_at(&base);
    let meta_len = u32::from_le_bytes(base[6..10].try_into().unwrap()) as usize;
    let edit = |f: &dyn Fn(&mut Value)| knot_edit(&base, |m, _| f(m));
    fn with_q(m: &mut Value, f: impl FnOnce(&mut Value)) {
        f(&mut m["sketches"]["blk.0.attn_q.weight"]);
    }

    // Truncation at every section boundary.
    c.case(
        "sk32_trunc_magic.sk32",
        base[..3].to_vec(),
        "BadMagic",
        "[75, 78, 79]",
        "file ends inside the magic: 3 bytes are no known magic (sniffing reports BadMagic)",
    );
    c.case(
        "sk32_trunc_version.sk32",
        base[..5].to_vec(),
        "Truncated",
        "10-byte prefix",
        "file ends inside the version field",
    );
    c.case(
        "sk32_trunc_meta_len.sk32",
        base[..8].to_vec(),
        "Truncated",
        "10-byte prefix",
        "file ends inside meta_len",
    );
    c.case(
        "sk32_trunc_meta.sk32",
        base[..10 + meta_len / 2].to_vec(),
        "Truncated",
        "runs past the end of the file",
        "file ends inside the meta JSON",
    );
    c.case(
        "sk32_trunc_before_codec.sk32",
        base[..codec_at].to_vec(),
        "Truncated",
        "before the codec byte",
        "file ends after the meta JSON padding, before the codec byte",
    );
    c.case(
        "sk32_trunc_payload.sk32",
        knot_unchecked(&base).pipe(|u| u[..u.len() - 5].to_vec()),
        "OutOfBounds",
        "lie outside the file",
        "file ends inside the payload: the last sketch runs past EOF",
    );
    // meta_len.
    let mut v = base.clone();
    set(&mut v, 6, &(base.len() as u32).to_le_bytes());
    c.case(
        "sk32_meta_len_past_eof.sk32",
        v,
        "Truncated",
        "runs past the end of the file",
        "meta_len points past EOF",
    );
    let mut v = base.clone();
    set(&mut v, 6, &u32::MAX.to_le_bytes());
    c.case(
        "sk32_meta_len_huge.sk32",
        v,
        "TooLarge",
        "exceeds the 67108864-byte cap",
        "meta_len 0xffffffff is above the 64 MiB cap (refused before allocating)",
    );
    // Container fields.
    let mut v = base.clone();
    v[4] = 2;
    c.case(
        "sk32_version_2.sk32",
        v,
        "UnsupportedVersion",
        "KNOT container version 2",
        "container version 2",
    );
    let mut v = base.clone();
    v[codec_at] = 1;
    knot_reseal(&mut v);
    c.case(
        "sk32_codec_1.sk32",
        v,
        "UnsupportedCodec",
        "unsupported codec byte 1",
        "codec byte 1 (only 0 = raw exists)",
    );
    let mut v = base.clone();
    v[codec_at] = 0xff;
    knot_reseal(&mut v);
    c.case(
        "sk32_codec_255.sk32",
        v,
        "UnsupportedCodec",
        "unsupported codec byte 255",
        "codec byte 255",
    );
    // Meta JSON shape.
    let (_, payload) = knot_split(&base).unwrap();
    c.case(
        "sk32_json_invalid.sk32",
        knot_raw(br#"{"format":"sk32","sketches":{"#, &payload),
        "BadJson",
        "meta_json is not valid JSON",
        "meta JSON cut short (not valid JSON)",
    );
    c.case(
        "sk32_json_not_utf8.sk32",
        knot_raw(b"{\"format\":\"sk\xff32\",\"sketches\":{}}", &payload),
        "BadJson",
        "meta_json is not valid JSON",
        "meta JSON with an invalid UTF-8 byte",
    );
    c.case(
        "sk32_json_array.sk32",
        knot_raw(br#"[{"sketches":{}}]"#, &payload),
        "BadJson",
        "must be a JSON object, found an array",
        "meta JSON is an array, not an object",
    );
    c.case(
        "sk32_json_number.sk32",
        knot_raw(b"42", &payload),
        "BadJson",
        "must be a JSON object, found a number",
        "meta JSON is a number, not an object",
    );
    c.case(
        "sk32_json_empty.sk32",
        knot_raw(b"", &payload),
        "BadJson",
        "not valid JSON",
        "meta_len 0: empty meta JSON",
    );
    c.case(
        "knot_meta_both_maps.sk32",
        edit(&|m| m["tensors"] = json!({})),
        "BadJson",
        "both a \"sketches\" and a \"tensors\" map",
        "KNOT meta with both a sketches and a tensors map",
    );
    c.case(
        "knot_meta_neither_map.sk32",
        edit(&|m| {
            let s = m["sketches"].take();
            m.as_object_mut().unwrap().remove("sketches");
            m["sketchez"] = s;
        }),
        "BadJson",
        "neither a \"sketches\" map (SK32) nor a \"tensors\" map",
        "KNOT meta with neither map (a typo'd key)",
    );
    c.case(
        "knot_meta_sketches_array.sk32",
        edit(&|m| m["sketches"] = json!([1, 2])),
        "BadJson",
        "neither a \"sketches\" map",
        "\"sketches\" is an array, so the file is neither SK32 nor dense",
    );
    c.case(
        "sk32_format_knot.sk32",
        edit(&|m| m["format"] = json!("knot")),
        "BadValue",
        "\"format\": \"knot\"",
        "a sketches map under \"format\": \"knot\"",
    );
    c.case(
        "sk32_sketch_not_object.sk32",
        edit(&|m| m["sketches"]["blk.0.attn_q.weight"] = json!(7)),
        "BadJson",
        "must be a JSON object, found a number",
        "a sketch entry that is a number",
    );
    for field in ["d_out", "rank", "offset", "length", "u_max"] {
        c.case(
            &format!("sk32_missing_{field}.sk32"),
            edit(&|m| {
                with_q(m, |s| {
                    s.as_object_mut().unwrap().remove(field);
                })
            }),
            "BadJson",
            &format!("missing field \"{field}\""),
            &format!("sketch without \"{field}\""),
        );
    }
    c.case(
        "sk32_d_out_string.sk32",
        edit(&|m| with_q(m, |s| s["d_out"] = json!("8"))),
        "BadJson",
        "field \"d_out\" must be a non-negative integer, found a string",
        "d_out is a string",
    );
    c.case(
        "sk32_rank_float.sk32",
        edit(&|m| with_q(m, |s| s["rank"] = json!(2.0))),
        "BadJson",
        "field \"rank\" must be a non-negative integer, found a number",
        "rank is 2.0 (a float)",
    );
    c.case(
        "sk32_offset_negative.sk32",
        edit(&|m| with_q(m, |s| s["offset"] = json!(-1))),
        "BadJson",
        "field \"offset\" must be a non-negative integer",
        "offset is -1",
    );
    c.case(
        "sk32_u_max_bool.sk32",
        edit(&|m| with_q(m, |s| s["u_max"] = json!(true))),
        "BadJson",
        "field \"u_max\" must be a number, found a bool",
        "u_max is a bool",
    );
    // Values.
    c.case(
        "sk32_d_out_zero.sk32",
        edit(&|m| with_q(m, |s| s["d_out"] = json!(0))),
        "BadShape",
        "d_out 0 x d_in 6 is empty",
        "d_out 0",
    );
    c.case(
        "sk32_shape_overflow.sk32",
        edit(&|m| {
            with_q(m, |s| {
                s["d_out"] = json!(1u64 << 33);
                s["d_in"] = json!(1u64 << 33);
            })
        }),
        "Overflow",
        "d_out * d_in",
        "d_out * d_in = 2^66 overflows u64",
    );
    c.case(
        "sk32_rank_zero.sk32",
        edit(&|m| with_q(m, |s| s["rank"] = json!(0))),
        "BadRank",
        "rank 0 must be in 1..=min(d_out 8, d_in 6)",
        "rank 0",
    );
    c.case(
        "sk32_rank_too_big.sk32",
        edit(&|m| with_q(m, |s| s["rank"] = json!(7))),
        "BadRank",
        "rank 7 must be in 1..=min(d_out 8, d_in 6)",
        "rank 7 > min(d_out 8, d_in 6)",
    );
    c.case(
        "sk32_length_mismatch.sk32",
        edit(&|m| with_q(m, |s| s["length"] = json!(29))),
        "LengthMismatch",
        "length 29 != d_out*rank + rank + rank*d_in = 30",
        "length 29, d_out*rank + rank + rank*d_in is 30",
    );
    c.case(
        "sk32_served_size_overflow.sk32",
        edit(&|m| {
            with_q(m, |s| {
                s["d_out"] = json!(u64::from(u32::MAX));
                s["d_in"] = json!(u64::from(u32::MAX));
                s["rank"] = json!(u64::from(u32::MAX));
            })
        }),
        "Overflow",
        "served size in bytes",
        "d_out = d_in = rank = 2^32-1: d_out * d_in fits u64, the served bytes (x4) and \
         the sketch length do not",
    );
    c.case(
        "sk32_offset_past_payload.sk32",
        edit(&|m| with_q(m, |s| s["offset"] = json!(100_000))),
        "OutOfBounds",
        "lie outside the file",
        "sketch offset 100000 is past the payload",
    );
    c.case(
        "sk32_offset_overflow.sk32",
        edit(&|m| with_q(m, |s| s["offset"] = json!(u64::MAX - 3))),
        "Overflow",
        "overflows u64",
        "payload_base + offset overflows u64",
    );
    c.case(
        "sk32_overlap.sk32",
        edit(&|m| m["sketches"]["blk.0.ffn_up.weight"]["offset"] = json!(20)),
        "BadValue",
        "overlap in the payload",
        "two sketches share payload bytes",
    );
    c.case(
        "sk32_u_max_1e39.sk32",
        edit(&|m| with_q(m, |s| s["u_max"] = json!(1e39))),
        "NonFinite",
        "field \"u_max\" = 1e39 is not a finite f32",
        "u_max 1e39 overflows f32 to infinity",
    );
    c.case(
        "sk32_sigma_max_neg_1e39.sk32",
        edit(&|m| with_q(m, |s| s["sigma_max"] = json!(-1e39))),
        "NonFinite",
        "field \"sigma_max\" = -1e39 is not a finite f32",
        "sigma_max -1e39 overflows f32 to -infinity",
    );
    c.case(
        "sk32_v_max_nan_string.sk32",
        edit(&|m| with_q(m, |s| s["v_max"] = json!("nan"))),
        "BadJson",
        "field \"v_max\" must be a number, found a string",
        "v_max is the string \"nan\" (JSON has no NaN; strings are not numbers here)",
    );
    c.case(
        "sk32_v_max_negative.sk32",
        edit(&|m| with_q(m, |s| s["v_max"] = json!(-0.5))),
        "BadValue",
        "v_max -0.5 is negative",
        "v_max is negative",
    );
    // Names.
    c.case(
        "sk32_dup_attn_o_alias.sk32",
        sk32_bytes(&[
            sketch("blk.0.attn_o.weight", 4, 4, 1, 1),
            sketch("blk.0.attn_output.weight", 4, 4, 1, 2),
        ]),
        "BadName",
        "duplicate tensor name",
        "blk.0.attn_o.weight and blk.0.attn_output.weight are the same tensor after aliasing",
    );
    c.case(
        "sk32_dup_underscore.sk32",
        sk32_bytes(&[
            sketch("blk.0.attn_q.weight", 4, 4, 1, 1),
            sketch("blk_0_attn_q_weight", 4, 4, 1, 2),
        ]),
        "BadName",
        "duplicate tensor name",
        "blk.0.attn_q.weight and blk_0_attn_q_weight are the same tensor",
    );
    c.case(
        "sk32_name_slash.sk32",
        edit(&|m| {
            let s = m["sketches"]["blk.0.ffn_up.weight"].take();
            let o = m["sketches"].as_object_mut().unwrap();
            o.remove("blk.0.ffn_up.weight");
            o.insert("../etc/passwd".to_string(), s);
        }),
        "BadName",
        "cannot be served as a file name",
        "a sketch name with a slash",
    );
}

fn knot_cases(c: &mut Corpus) {
    let base = knot_base();
    let codec_at = knot_codec_at(&base);
    let meta_len = u32::from_le_bytes(base[6..10].try_into().unwrap()) as usize;
    fn with_t(m: &mut Value, f: impl FnOnce(&mut Value)) {
        f(&mut m["tensors"]["blk_0_attn_q_weight"]);
    }
    let edit = |f: &dyn Fn(&mut Value)| knot_edit(&base, |m, _| f(m));

    c.case(
        "knot_trunc_version.knot",
        base[..6].to_vec(),
        "Truncated",
        "10-byte prefix",
        "file ends after the version field",
    );
    c.case(
        "knot_trunc_meta.knot",
        base[..10 + meta_len - 1].to_vec(),
        "Truncated",
        "runs past the end of the file",
        "file ends one byte before the end of the meta JSON",
    );
    c.case(
        "knot_trunc_before_codec.knot",
        base[..codec_at].to_vec(),
        "Truncated",
        "before the codec byte",
        "file ends before the codec byte",
    );
    c.case(
        "knot_trunc_payload.knot",
        base[..codec_at + 1 + 40].to_vec(),
        "OutOfBounds",
        "lie outside the file",
        "file ends inside the first tensor's data",
    );
    let mut v = base.clone();
    set(&mut v, 6, &((base.len() - 9) as u32).to_le_bytes());
    c.case(
        "knot_meta_len_past_eof.knot",
        v,
        "Truncated",
        "runs past the end of the file",
        "meta_len one byte past EOF",
    );
    let mut v = base.clone();
    v[codec_at] = 2;
    knot_reseal(&mut v);
    c.case(
        "knot_codec_2.knot",
        v,
        "UnsupportedCodec",
        "unsupported codec byte 2",
        "codec byte 2",
    );
    c.case(
        "knot_format_sk32.knot",
        edit(&|m| m["format"] = json!("sk32")),
        "BadValue",
        "\"format\": \"sk32\"",
        "a tensors map under \"format\": \"sk32\"",
    );
    c.case(
        "knot_unknown_dtype.knot",
        edit(&|m| with_t(m, |t| t["type"] = json!("q9_9"))),
        "UnknownType",
        "unknown tensor type \"q9_9\"",
        "dtype q9_9 does not exist",
    );
    c.case(
        "knot_dtype_q8_1.knot",
        edit(&|m| with_t(m, |t| t["type"] = json!("q8_1"))),
        "UnknownType",
        "unknown tensor type \"q8_1\"",
        "q8_1 is a ggml type but not a dense .knot type",
    );
    c.case(
        "knot_dtype_number.knot",
        edit(&|m| with_t(m, |t| t["type"] = json!(8))),
        "BadJson",
        "field \"type\" must be a string, found a number",
        "dtype is the ggml id 8 instead of a name",
    );
    c.case(
        "knot_length_mismatch.knot",
        edit(&|m| with_t(m, |t| t["length"] = json!(132))),
        "LengthMismatch",
        "length 132 != 136 bytes implied by Q8_0 [2, 64]",
        "length 132 for q8_0 [2, 64] (136 bytes)",
    );
    c.case(
        "knot_type_shape_mismatch.knot",
        edit(&|m| with_t(m, |t| t["type"] = json!("q4_0"))),
        "LengthMismatch",
        "length 136 != 72 bytes implied by Q4_0 [2, 64]",
        "type changed to q4_0: the length no longer matches type and shape",
    );
    c.case(
        "knot_inner_not_block_multiple.knot",
        edit(&|m| {
            with_t(m, |t| {
                t["shape"] = json!([3, 48]);
                t["length"] = json!(153);
            })
        }),
        "BadShape",
        "innermost dim 48 is not a multiple of the Q8_0 block size 32",
        "q8_0 with innermost dim 48",
    );
    c.case(
        "knot_shape_overflow.knot",
        edit(&|m| with_t(m, |t| t["shape"] = json!([1u64 << 32, 1u64 << 37]))),
        "Overflow",
        "element count",
        "shape product 2^69 overflows u64",
    );
    c.case(
        "knot_bytes_overflow.knot",
        edit(&|m| {
            m["tensors"]["output_norm_weight"]["shape"] = json!([1u64 << 62, 2]);
        }),
        "Overflow",
        "byte size of 9223372036854775808 F32 elements",
        "2^63 f32 elements: the element count fits, the byte size does not",
    );
    c.case(
        "knot_shape_empty.knot",
        edit(&|m| with_t(m, |t| t["shape"] = json!([]))),
        "BadShape",
        "must have 1 to 4 dims",
        "shape []",
    );
    c.case(
        "knot_shape_5d.knot",
        edit(&|m| with_t(m, |t| t["shape"] = json!([1, 1, 1, 2, 64]))),
        "BadShape",
        "must have 1 to 4 dims",
        "shape with 5 dims",
    );
    c.case(
        "knot_shape_zero_dim.knot",
        edit(&|m| with_t(m, |t| t["shape"] = json!([0, 64]))),
        "BadShape",
        "has a zero dim",
        "shape [0, 64]",
    );
    c.case(
        "knot_shape_not_array.knot",
        edit(&|m| with_t(m, |t| t["shape"] = json!("2x64"))),
        "BadJson",
        "field \"shape\" must be an array, found a string",
        "shape is a string",
    );
    c.case(
        "knot_missing_offset.knot",
        edit(&|m| {
            with_t(m, |t| {
                t.as_object_mut().unwrap().remove("offset");
            })
        }),
        "BadJson",
        "missing field \"offset\"",
        "tensor without offset",
    );
    c.case(
        "knot_offset_past_payload.knot",
        edit(&|m| with_t(m, |t| t["offset"] = json!(1000))),
        "OutOfBounds",
        "lie outside the file",
        "tensor offset 1000 is past the payload",
    );
    c.case(
        "knot_offset_overflow.knot",
        edit(&|m| with_t(m, |t| t["offset"] = json!(u64::MAX))),
        "Overflow",
        "overflows u64",
        "payload_base + offset overflows u64",
    );
    c.case(
        "knot_overlap.knot",
        edit(&|m| m["tensors"]["blk_0_ffn_up_weight"]["offset"] = json!(100)),
        "BadValue",
        "overlap in the payload",
        "two tensors share payload bytes",
    );
    c.case(
        "knot_metadata_not_object.knot",
        edit(&|m| m["metadata"] = json!([1, 2])),
        "BadJson",
        "\"metadata\" is not a JSON object",
        "metadata is an array",
    );
    c.case(
        "knot_metadata_bad_typed.knot",
        edit(&|m| {
            m["metadata"]["llama.block_count"] = json!({"type": "u8", "value": 300});
        }),
        "BadJson",
        "metadata key \"llama.block_count\"",
        "typed metadata u8 value 300 is out of range",
    );
    c.case(
        "knot_json_array.knot",
        knot_raw(br#"[]"#, b""),
        "BadJson",
        "must be a JSON object, found an array",
        "meta JSON is an array",
    );
    c.case(
        "knot_dup_underscore.knot",
        edit(&|m| {
            let t = m["tensors"]["blk_0_ffn_up_weight"].take();
            let o = m["tensors"].as_object_mut().unwrap();
            o.remove("blk_0_ffn_up_weight");
            o.insert("blk.0.attn_q.weight".to_string(), t);
        }),
        "BadName",
        "duplicate tensor name",
        "blk.0.attn_q.weight and blk_0_attn_q_weight are the same tensor",
    );
    c.case(
        "knot_dup_attn_o_alias.knot",
        knot_bytes(
            &Metadata::default(),
            &[("blk.0.attn_output.weight", GgmlType::F32, vec![4])],
        )
        .pipe(|b| {
            knot_edit(&b, |m, p| {
                let t = m["tensors"]["blk_0_attn_output_weight"].clone();
                let mut t2 = t.clone();
                t2["offset"] = json!(16);
                m["tensors"]["blk_0_attn_o_weight"] = t2;
                p.extend_from_slice(&[0u8; 16]);
            })
        }),
        "BadName",
        "duplicate tensor name",
        "blk_0_attn_o_weight and blk_0_attn_output_weight are the same tensor after aliasing",
    );
}

/// `x.pipe(f)` = `f(x)`, to keep builders readable.
trait Pipe: Sized {
    fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
        f(self)
    }
}
impl<T> Pipe for T {}

/// Version 3: footer, index and the new tensor fields. The rest of the
/// header (manifests, shapes, modes) is the same as version 2's and is
/// covered by [`rknot_cases`].
fn rknot3_cases(c: &mut Corpus) {
    let base = rknot3_base();
    let n = base.len();
    // Tensor 1 of layer 0 (graded, two blocks of equal length).
    fn t1(h: &mut Value) -> &mut Value {
        &mut h["layers"][0]["tensors"][1]
    }
    // The tensor of layer 1: graded blocks of 28 and 32 bytes, coded as
    // base 28, step 4, 1 bit.
    fn l1(h: &mut Value) -> &mut Value {
        &mut h["layers"][1]["tensors"][0]
    }
    let hedit = |f: &dyn Fn(&mut Value)| rknot3_edit(|h, _, _| f(h));
    c.case(
        "rknot3_short.rknot",
        base[..20].to_vec(),
        "Truncated",
        "32-byte prefix and footer",
        "a version-3 file shorter than its prefix and footer",
    );
    c.case(
        "rknot3_unfinished.rknot",
        base[..n - 5].to_vec(),
        "BadMagic",
        "RKNOTEND",
        "file cut short: the footer's end magic is missing",
    );
    let mut v = base.clone();
    v[6] = 1;
    c.case(
        "rknot3_pad.rknot",
        v,
        "BadMagic",
        "bytes 6..8",
        "the two bytes after the magic are not zero",
    );
    let mut v = base.clone();
    set(&mut v, n - 16, &(1u64 << 40).to_le_bytes());
    c.case(
        "rknot3_header_len_huge.rknot",
        v,
        "TooLarge",
        "exceeds the 134217728-byte cap",
        "header_len above the 128 MiB cap",
    );
    let mut v = base.clone();
    set(&mut v, n - 24, &(1u64 << 40).to_le_bytes());
    c.case(
        "rknot3_index_len_huge.rknot",
        v,
        "TooLarge",
        "exceeds the 2147483648-byte cap",
        "index_len above the 2 GiB cap",
    );
    let mut v = base.clone();
    set(&mut v, n - 24, &(n as u64).to_le_bytes());
    c.case(
        "rknot3_index_len_past_start.rknot",
        v,
        "Truncated",
        "between prefix and footer",
        "index_len + header_len run back past the prefix",
    );
    c.case(
        "rknot3_header_version_2.rknot",
        hedit(&|h| h["version"] = json!(2)),
        "UnsupportedVersion",
        "does not match the file's magic",
        "a version-3 file whose header says version 2",
    );
    c.case(
        "rknot3_no_data.rknot",
        hedit(&|h| {
            t1(h).as_object_mut().unwrap().remove("data");
        }),
        "BadJson",
        "missing field \"data\"",
        "a tensor without data",
    );
    c.case(
        "rknot3_no_block_lengths.rknot",
        hedit(&|h| {
            t1(h).as_object_mut().unwrap().remove("block_lengths");
        }),
        "BadJson",
        "missing field \"block_lengths\"",
        "a tensor without block_lengths",
    );
    c.case(
        "rknot3_block_lengths_no_step.rknot",
        hedit(&|h| {
            t1(h)["block_lengths"]
                .as_object_mut()
                .unwrap()
                .remove("step");
        }),
        "BadJson",
        "missing field \"step\"",
        "block_lengths without step",
    );
    c.case(
        "rknot3_data_three.rknot",
        hedit(&|h| t1(h)["data"] = json!([0, 1, 2])),
        "BadShape",
        "must be [offset, length]",
        "data with three numbers",
    );
    c.case(
        "rknot3_data_past_body.rknot",
        hedit(&|h| {
            let off = t1(h)["data"][0].as_u64().unwrap();
            t1(h)["data"][0] = json!(off + 100_000);
        }),
        "OutOfBounds",
        "lies outside the body",
        "a tensor's data range past the end of the body",
    );
    c.case(
        "rknot3_data_overflow.rknot",
        hedit(&|h| t1(h)["data"][0] = json!(u64::MAX - 3)),
        "Overflow",
        "data end",
        "data offset + length overflows u64",
    );
    c.case(
        "rknot3_length_sum.rknot",
        hedit(&|h| {
            let len = t1(h)["data"][1].as_u64().unwrap();
            t1(h)["data"][1] = json!(len - 1);
        }),
        "LengthMismatch",
        "add up to",
        "block lengths do not add up to the data length",
    );
    c.case(
        "rknot3_bits_33.rknot",
        hedit(&|h| t1(h)["block_lengths"]["bits"] = json!(33)),
        "BadValue",
        "bits 33 is above 32",
        "33-bit length codes: the format allows at most 32",
    );
    c.case(
        "rknot3_step_zero.rknot",
        hedit(&|h| l1(h)["block_lengths"]["step"] = json!(0)),
        "BadValue",
        "step is 0 exactly when bits is 0",
        "a step of 0 with length codes of more than 0 bits",
    );
    c.case(
        "rknot3_codes_past_index.rknot",
        hedit(&|h| t1(h)["block_lengths"]["at"] = json!(1000)),
        "OutOfBounds",
        "the index has",
        "length codes starting past the end of the block index",
    );
    c.case(
        "rknot3_codes_shared.rknot",
        // Tensor 1's two equal blocks of length L coded as base L - 8, step
        // 4, 2 bits, both values 2, read from the byte that holds layer 1's
        // codes (bits 0-1: 0 and 1; bit 3 set for tensor 1's second value).
        // Every length is valid; the ranges add up to twice the index.
        rknot3_edit(|h, _, index| {
            let at = l1(h)["block_lengths"]["at"].as_u64().unwrap();
            let len = t1(h)["data"][1].as_u64().unwrap() / 2;
            t1(h)["block_lengths"] = json!({"at": at, "base": len - 8, "step": 4, "bits": 2});
            index[at as usize] |= 0b1000;
        }),
        "OutOfBounds",
        "code ranges may not overlap",
        "two tensors' length codes sharing index bytes (a small file could claim many times its \
         size in memory)",
    );
    c.case(
        "rknot3_bad_block_length.rknot",
        hedit(&|h| l1(h)["block_lengths"]["base"] = json!(100)),
        "LengthMismatch",
        "block 0 has length 100; its tile needs 12..=52",
        "a block length the tile cannot have (a graded 8x8 tile at 5 bits: 12 to 52 bytes)",
    );
    c.case(
        "rknot3_overlap.rknot",
        hedit(&|h| {
            let d0 = h["layers"][0]["tensors"][0]["data"].clone();
            let len = d0[1].as_u64().unwrap();
            // Tensor 2 has the same length codes as tensor 0 (uniform,
            // equal blocks) only if shapes agree; move tensor 0 onto the
            // first bytes of tensor 1 instead, keeping its length.
            let t1_off = t1(h)["data"][0].as_u64().unwrap();
            h["layers"][0]["tensors"][0]["data"] = json!([t1_off, len]);
        }),
        "BadValue",
        "overlap",
        "two tensors' data ranges overlap",
    );
    rknot3_open_bound_cases(c);
}

/// A version-3 file (no checksums) of one layer holding one tensor, from
/// its JSON entry, a body and an index.
fn rknot3_one_tensor(tensor: Value, body: &[u8], index: &[u8]) -> Vec<u8> {
    let h = json!({
        "format": "rknot",
        "version": 3,
        "arch_meta": {"arch": "llama", "hidden_dim": 1, "num_layers": 1},
        "layers": [{
            "index": 0,
            "manifest": {
                "d": 1, "k": 1, "standing_indices": [0],
                "amplitudes": [1.0], "phase_alignment": [1.0]
            },
            "tensors": [tensor]
        }]
    });
    rknot3_join(&h, body, index)
}

/// Issue 26, item 3: headers whose numbers would size work or memory at
/// open beyond what the file stores, and index ranges two tensors share.
fn rknot3_open_bound_cases(c: &mut Corpus) {
    // One tensor of `side x side` 1x1 tiles, uniform at 1 bit (every block
    // is 5 bytes), over a 64-byte body.
    let declaring = |side: u64, bits: u64, data_len: u64| {
        rknot3_one_tensor(
            json!({
                "name": "blk.0.attn_q.weight",
                "shape": [side, side],
                "restricted_axes": [],
                "mode": "uniform",
                "bits": 1,
                "block_shape": [1, 1],
                "data": [0, data_len],
                "block_lengths": {
                    "at": 0, "base": 5, "step": if bits == 0 { 0 } else { 1 }, "bits": bits
                }
            }),
            &[0u8; 64],
            &[0u8; 16],
        )
    };
    c.case(
        "rknot3_bits0_2_30_blocks.rknot",
        declaring(1 << 15, 0, 60),
        "LengthMismatch",
        "1073741824 blocks of its tiling take at least 5368709120 bytes",
        "2^30 equal-length blocks (no index bytes) declared over a 64-byte body: the blocks \
         a header declares must fit the data range (at least 5 bytes each)",
    );
    c.case(
        "rknot3_bits0_2_34_blocks.rknot",
        declaring(1 << 17, 0, 60),
        "LengthMismatch",
        "17179869184 blocks of its tiling take at least 85899345920 bytes",
        "2^34 equal-length blocks declared over a 64-byte body",
    );
    c.case(
        "rknot3_bits1_2_30_blocks.rknot",
        declaring(1 << 15, 1, 60),
        "LengthMismatch",
        "1073741824 blocks of its tiling take at least 5368709120 bytes",
        "2^30 blocks with 1-bit length codes over a 64-byte body and a 16-byte index: \
         refused before the codes are read",
    );
    fn t1(h: &mut Value) -> &mut Value {
        &mut h["layers"][0]["tensors"][1]
    }
    fn l1(h: &mut Value) -> &mut Value {
        &mut h["layers"][1]["tensors"][0]
    }
    let mut case = rknot3_edit(|h, _, index| {
        // As rknot3_codes_shared, with a spare byte at the end of the
        // index, so the ranges add up to no more than the index.
        let at = l1(h)["block_lengths"]["at"].as_u64().unwrap();
        let len = t1(h)["data"][1].as_u64().unwrap() / 2;
        t1(h)["block_lengths"] = json!({"at": at, "base": len - 8, "step": 4, "bits": 2});
        index[at as usize] |= 0b1000;
        index.push(0);
    });
    c.case(
        "rknot3_codes_shared_spare.rknot",
        std::mem::take(&mut case),
        "BadValue",
        "no two index ranges may share a byte",
        "two tensors' length codes on the same index byte while the index has a byte no \
         tensor uses (the sum rule alone lets that through)",
    );
    c.last().contains_also = vec!["blk.0.ffn_up.weight".into(), "blk.1.attn_q.weight".into()];
    c.case(
        "rknot3_crc_shares_codes.rknot",
        rknot3_edit(|h, _, _| {
            // Tensor 1's CRC-32s moved onto layer 1's length codes (and
            // the CRC-32s of layer 1 that follow): its own range is left
            // unused, so the sum still fits.
            let at = l1(h)["block_lengths"]["at"].as_u64().unwrap();
            t1(h)["block_crc32"]["at"] = json!(at);
        }),
        "BadValue",
        "no two index ranges may share a byte",
        "a tensor's block CRC-32s on another tensor's length codes",
    );
}

/// Version 3's `dense_tensors` (tensors stored as ggml blocks).
fn rknot3_dense_cases(c: &mut Corpus) {
    let edit = |f: &dyn Fn(&mut Value)| {
        let (mut h, body, index) = rknot3_split(&rknot3_dense_base()).expect("valid rknot v3");
        f(&mut h);
        rknot3_join(&h, &body, &index)
    };
    fn d(h: &mut Value) -> &mut Value {
        &mut h["dense_tensors"]["output_norm.weight"]
    }
    c.case(
        "rknot3_dense_type.rknot",
        edit(&|h| d(h)["type"] = json!("q9_x")),
        "UnknownType",
        "unknown tensor type \"q9_x\"",
        "a dense tensor of an unknown ggml type",
    );
    c.case(
        "rknot3_dense_length.rknot",
        edit(&|h| d(h)["length"] = json!(60)),
        "LengthMismatch",
        "length 60 != 64 bytes implied by F32 [16]",
        "a dense tensor whose length disagrees with its type and shape",
    );
    c.case(
        "rknot3_dense_past_body.rknot",
        edit(&|h| d(h)["offset"] = json!(1_000_000)),
        "OutOfBounds",
        "lies outside the body",
        "a dense tensor past the end of the body",
    );
    c.case(
        "rknot3_dense_overlap.rknot",
        edit(&|h| d(h)["offset"] = json!(0)),
        "BadValue",
        "overlap",
        "a dense tensor over a compressed tensor's blocks",
    );
    c.case(
        "rknot3_dense_name_clash.rknot",
        edit(&|h| {
            let t = h["dense_tensors"]["output_norm.weight"].take();
            h["dense_tensors"] = json!({ "blk_0_attn_q_weight": t });
            h["dense_tensors"]["blk_0_attn_q_weight"]["shape"] = json!([16]);
        }),
        "BadName",
        "blk",
        "a dense tensor named like a compressed one (other spelling)",
    );
}

fn rknot_cases(c: &mut Corpus) {
    let base = rknot_base();
    let header_len = u32::from_le_bytes(base[6..10].try_into().unwrap()) as usize;
    // Paths into the header.
    fn t0(h: &mut Value, i: usize) -> &mut Value {
        &mut h["layers"][0]["tensors"][i]
    }
    fn m0(h: &mut Value) -> &mut Value {
        &mut h["layers"][0]["manifest"]
    }
    let hedit = |f: &dyn Fn(&mut Value)| rknot_edit(|h, _| f(h));

    c.case(
        "rknot_trunc_magic.rknot",
        base[..4].to_vec(),
        "BadMagic",
        "[82, 75, 78, 79]",
        "file ends inside the magic: 4 bytes are no known magic",
    );
    c.case(
        "rknot_trunc_after_magic.rknot",
        base[..6].to_vec(),
        "Truncated",
        "10-byte prefix",
        "file ends right after the magic",
    );
    c.case(
        "rknot_trunc_header_len.rknot",
        base[..8].to_vec(),
        "Truncated",
        "10-byte prefix",
        "file ends inside header_len",
    );
    c.case(
        "rknot_trunc_header.rknot",
        base[..10 + header_len / 2].to_vec(),
        "Truncated",
        "header_len",
        "file ends inside the header JSON",
    );
    c.case(
        "rknot_trunc_body.rknot",
        base[..base.len() - 3].to_vec(),
        "OutOfBounds",
        "lies outside the body",
        "file ends inside the body: the last block runs past EOF",
    );
    c.case(
        "rknot_trunc_no_body.rknot",
        base[..10 + header_len].to_vec(),
        "OutOfBounds",
        "lies outside the body (0 bytes)",
        "file ends exactly after the header: every block is outside the body",
    );
    let mut v = base.clone();
    set(&mut v, 6, &((header_len + 4096) as u32).to_le_bytes());
    c.case(
        "rknot_header_len_past_eof.rknot",
        v,
        "Truncated",
        "runs past the end of the file",
        "header_len points past EOF",
    );
    let mut v = base.clone();
    set(&mut v, 6, &0xffff_fff0u32.to_le_bytes());
    c.case(
        "rknot_header_len_huge.rknot",
        v,
        "TooLarge",
        "exceeds the 1073741824-byte cap",
        "header_len near 4 GiB is above the 1 GiB cap",
    );
    let mut v = base.clone();
    v[5] = 4;
    c.case(
        "rknot_magic_v4.rknot",
        v,
        "UnsupportedVersion",
        "version byte 4",
        "RKNOT\\x04 magic",
    );
    c.case(
        "rknot_header_version_3.rknot",
        hedit(&|h| h["version"] = json!(3)),
        "UnsupportedVersion",
        "header version 3",
        "header JSON says version 3",
    );
    c.case(
        "rknot_header_format.rknot",
        hedit(&|h| h["format"] = json!("knot")),
        "BadValue",
        "header \"format\" is \"knot\"",
        "header JSON says format knot",
    );
    let (_, body) = rknot_split(&base).unwrap();
    c.case(
        "rknot_json_invalid.rknot",
        rknot_raw(br#"{"format":"rknot","layers":[}"#, &body),
        "BadJson",
        "header_json is not valid JSON",
        "header JSON is not JSON",
    );
    c.case(
        "rknot_json_array.rknot",
        rknot_raw(br#"[1,2,3]"#, &body),
        "BadJson",
        "header_json must be a JSON object, found an array",
        "header JSON is an array",
    );
    c.case(
        "rknot_json_number.rknot",
        rknot_raw(b"2", &body),
        "BadJson",
        "header_json must be a JSON object, found a number",
        "header JSON is a number",
    );
    c.case(
        "rknot_missing_arch_meta.rknot",
        hedit(&|h| {
            h.as_object_mut().unwrap().remove("arch_meta");
        }),
        "BadJson",
        "missing field \"arch_meta\"",
        "header without arch_meta",
    );
    c.case(
        "rknot_num_layers_string.rknot",
        hedit(&|h| h["arch_meta"]["num_layers"] = json!("2")),
        "BadJson",
        "field \"num_layers\" must be a non-negative integer, found a string",
        "num_layers is a string",
    );
    c.case(
        "rknot_layers_object.rknot",
        hedit(&|h| h["layers"] = json!({})),
        "BadJson",
        "field \"layers\" must be an array, found an object",
        "layers is an object",
    );
    // Manifest.
    c.case(
        "rknot_standing_unsorted.rknot",
        hedit(&|h| m0(h)["standing_indices"] = json!([1, 9, 5, 12])),
        "BadValue",
        "strictly increasing",
        "standing indices not sorted",
    );
    c.case(
        "rknot_standing_duplicate.rknot",
        hedit(&|h| m0(h)["standing_indices"] = json!([1, 5, 5, 12])),
        "BadValue",
        "strictly increasing",
        "standing index 5 twice",
    );
    c.case(
        "rknot_standing_out_of_range.rknot",
        hedit(&|h| m0(h)["standing_indices"] = json!([1, 5, 9, 16])),
        "BadValue",
        "standing index 16 is not below d = 16",
        "standing index 16 with d 16",
    );
    c.case(
        "rknot_k_mismatch.rknot",
        hedit(&|h| m0(h)["k"] = json!(3)),
        "BadValue",
        "standing_indices has 4 entries, k is 3",
        "k 3 with 4 standing indices",
    );
    c.case(
        "rknot_k_zero.rknot",
        hedit(&|h| m0(h)["k"] = json!(0)),
        "BadValue",
        "manifest k 0 must be in 1..=d (16)",
        "k 0",
    );
    c.case(
        "rknot_amplitudes_short.rknot",
        hedit(&|h| m0(h)["amplitudes"] = json!([1.0, 0.5])),
        "BadValue",
        "amplitudes has 2 entries, k is 4",
        "2 amplitudes for k 4",
    );
    c.case(
        "rknot_amplitude_1e39.rknot",
        hedit(&|h| m0(h)["amplitudes"][2] = json!(1e39)),
        "NonFinite",
        "\"amplitudes\" holds 1e39, not a finite f32",
        "an amplitude overflows f32",
    );
    c.case(
        "rknot_phase_above_1.rknot",
        hedit(&|h| m0(h)["phase_alignment"][1] = json!(1.5)),
        "BadValue",
        "phase_alignment 1.5 is outside [0, 1]",
        "phase_alignment 1.5",
    );
    c.case(
        "rknot_phase_negative.rknot",
        hedit(&|h| m0(h)["phase_alignment"][0] = json!(-0.25)),
        "BadValue",
        "phase_alignment -0.25 is outside [0, 1]",
        "phase_alignment -0.25",
    );
    c.case(
        "rknot_manifest_d_zero.rknot",
        hedit(&|h| m0(h)["d"] = json!(0)),
        "BadValue",
        "manifest d is 0",
        "manifest d 0",
    );
    c.case(
        "rknot_restricted_len_ne_d.rknot",
        hedit(&|h| m0(h)["d"] = json!(20)),
        "BadShape",
        "cols are restricted to the standing indices but have length 16, manifest d is 20",
        "restricted axis of length 16 with manifest d 20",
    );
    // Layers.
    c.case(
        "rknot_layer_dup.rknot",
        hedit(&|h| h["layers"][1]["index"] = json!(0)),
        "BadValue",
        "layer index 0 is duplicated or not below num_layers 2",
        "two layers with index 0",
    );
    c.case(
        "rknot_layer_out_of_range.rknot",
        hedit(&|h| h["layers"][1]["index"] = json!(2)),
        "BadValue",
        "layer index 2 is duplicated or not below num_layers 2",
        "layer index 2 with num_layers 2",
    );
    // Tensor fields.
    c.case(
        "rknot_shape_3d.rknot",
        hedit(&|h| t0(h, 0)["shape"] = json!([16, 16, 1])),
        "BadShape",
        "must be [d_out, d_in]",
        "a 3-dim shape",
    );
    c.case(
        "rknot_shape_zero.rknot",
        hedit(&|h| t0(h, 0)["shape"] = json!([0, 16])),
        "BadShape",
        "shape [0, 16] is empty",
        "d_out 0",
    );
    c.case(
        "rknot_shape_overflow.rknot",
        hedit(&|h| {
            h["layers"][1]["tensors"][0]["shape"] = json!([1u64 << 32, 1u64 << 32]);
        }),
        "Overflow",
        "d_out * d_in",
        "d_out * d_in = 2^64 overflows u64",
    );
    let small = rknot_bytes(
        1,
        &[layer(
            0,
            manifest(16, &[3, 7]),
            vec![spec(
                "blk.0.attn_k.weight",
                [16, 8],
                (true, false),
                Coding::Uniform { bits: 8 },
                [2, 8],
            )],
            50,
        )],
    );
    let (mut h, body) = rknot_split(&small).unwrap();
    // Rows restricted: d_out is the manifest's d. 2^60 x 8 elements fit
    // u64, their 2^65 served bytes do not.
    h["layers"][0]["manifest"]["d"] = json!(1u64 << 60);
    h["layers"][0]["tensors"][0]["shape"] = json!([1u64 << 60, 8]);
    c.case(
        "rknot_served_size_overflow.rknot",
        rknot_join(&h, &body),
        "Overflow",
        "served size",
        "rows restricted to a manifest of d 2^60: d_out * d_in fits u64, the served \
         byte size (x4) does not",
    );
    c.case(
        "rknot_restricted_axes_bad.rknot",
        hedit(&|h| t0(h, 0)["restricted_axes"] = json!(["diag"])),
        "BadValue",
        "restricted_axes entry \"diag\" is not \"rows\" or \"cols\"",
        "restricted_axes holds \"diag\"",
    );
    c.case(
        "rknot_bits_0.rknot",
        hedit(&|h| t0(h, 0)["bits"] = json!(0)),
        "BadValue",
        "bits 0 must be in 1..=16",
        "bits 0",
    );
    c.case(
        "rknot_bits_17.rknot",
        hedit(&|h| t0(h, 1)["bits"] = json!(17)),
        "BadValue",
        "bits 17 must be in 1..=16",
        "bits 17",
    );
    c.case(
        "rknot_mode_unknown.rknot",
        hedit(&|h| t0(h, 0)["mode"] = json!("sparse")),
        "BadValue",
        "mode \"sparse\" is not one of \"uniform\", \"graded\", \"affine\", \"lossless_bf16\"",
        "mode sparse",
    );
    c.case(
        "rknot_graded_no_line_axis.rknot",
        hedit(&|h| {
            t0(h, 1).as_object_mut().unwrap().remove("line_axis");
        }),
        "BadJson",
        "graded tensor without \"line_axis\"",
        "graded tensor without line_axis",
    );
    c.case(
        "rknot_line_axis_bad.rknot",
        hedit(&|h| t0(h, 1)["line_axis"] = json!(1)),
        "BadValue",
        "line_axis 1 is not \"rows\" or \"cols\"",
        "line_axis is a number",
    );
    c.case(
        "rknot_block_count.rknot",
        hedit(&|h| {
            t0(h, 0)["blocks"].as_array_mut().unwrap().pop();
        }),
        "BadValue",
        "7 blocks listed, the tiling needs 8",
        "7 blocks for a 4x2 tiling",
    );
    c.case(
        "rknot_block_shape_zero.rknot",
        hedit(&|h| t0(h, 0)["block_shape"] = json!([0, 2])),
        "BadShape",
        "block_shape [0, 2] must be non-empty",
        "block_shape [0, 2]",
    );
    c.case(
        "rknot_block_shape_1d.rknot",
        hedit(&|h| t0(h, 0)["block_shape"] = json!([4])),
        "BadShape",
        "block_shape [4] must be [rows, cols]",
        "block_shape with one dim",
    );
    c.case(
        "rknot_block_shape_too_big.rknot",
        hedit(&|h| {
            let t = &mut h["layers"][1]["tensors"][0];
            t["shape"] = json!([300, 300]);
            t["block_shape"] = json!([300, 300]);
        }),
        "BadShape",
        "hold at most 65536 values",
        "block_shape [300, 300] = 90000 values > 65536",
    );
    c.case(
        "rknot_block_shape_exceeds_matrix.rknot",
        hedit(&|h| t0(h, 0)["block_shape"] = json!([4, 5])),
        "BadShape",
        "fit the compact matrix [16, 4]",
        "block 4x5 on a compact matrix with 4 columns",
    );
    c.case(
        "rknot_block_not_pair.rknot",
        hedit(&|h| t0(h, 0)["blocks"][3] = json!([8])),
        "BadJson",
        "blocks[3] must be [offset, length]",
        "a block entry [offset] without length",
    );
    c.case(
        "rknot_block_offset_past_body.rknot",
        hedit(&|h| t0(h, 0)["blocks"][2][0] = json!(5000)),
        "OutOfBounds",
        "block 2 [5000, 5008) lies outside the body",
        "block offset past the body",
    );
    c.case(
        "rknot_block_offset_overflow.rknot",
        hedit(&|h| t0(h, 0)["blocks"][2][0] = json!(u64::MAX - 2)),
        "Overflow",
        "block end",
        "block offset + length overflows u64",
    );
    c.case(
        "rknot_blocks_overlap.rknot",
        hedit(&|h| t0(h, 0)["blocks"][1][0] = json!(4)),
        "BadValue",
        "blocks overlap in the body",
        "block 1 starts inside block 0",
    );
    c.case(
        "rknot_blocks_overlap_tensors.rknot",
        hedit(&|h| {
            let off = h["layers"][0]["tensors"][0]["blocks"][0][0].clone();
            h["layers"][0]["tensors"][2]["blocks"][0] = json!([off, 20]);
            // attn_k blocks are 2x8 at 8 bits: 4 + 16 = 20 bytes.
        }),
        "BadValue",
        "blocks overlap in the body",
        "a block of attn_k placed over attn_q's blocks",
    );
    c.case(
        "rknot_uniform_block_len.rknot",
        hedit(&|h| t0(h, 0)["blocks"][0][1] = json!(9)),
        "LengthMismatch",
        "block 0 has length 9; a 4x2 tile at 4 bits needs 8",
        "uniform block one byte too long",
    );
    c.case(
        "rknot_graded_block_too_short.rknot",
        hedit(&|h| t0(h, 1)["blocks"][0][1] = json!(7)),
        "LengthMismatch",
        "block 0 has length 7; a 4x4 tile at 6 bits needs 8..=20",
        "graded block shorter than scale + width table",
    );
    c.case(
        "rknot_dup_attn_o_alias.rknot",
        hedit(&|h| {
            t0(h, 0)["name"] = json!("blk.0.attn_o.weight");
            t0(h, 2)["name"] = json!("blk.0.attn_output.weight");
        }),
        "BadName",
        "duplicate tensor name",
        "blk.0.attn_o.weight and blk.0.attn_output.weight in one file",
    );
    c.case(
        "rknot_name_dotdot.rknot",
        hedit(&|h| t0(h, 0)["name"] = json!("..")),
        "BadName",
        "cannot be served as a file name",
        "tensor named ..",
    );
    c.case(
        "rknot_name_missing.rknot",
        hedit(&|h| {
            t0(h, 0).as_object_mut().unwrap().remove("name");
        }),
        "BadJson",
        "missing field \"name\"",
        "tensor without a name",
    );
    // Read-time: the file opens, decoding the block fails.
    let scale_case = |c: &mut Corpus, file: &str, scale: f32, contains: &str, why: &str| {
        c.case(
            file,
            rknot_edit(|h, body| {
                let off = block_off(h, 0, 0, 3);
                set(body, off, &scale.to_le_bytes());
            }),
            "NonFinite",
            contains,
            why,
        );
        c.read("blk.0.attn_q.weight");
    };
    scale_case(
        c,
        "rknot_read_nan_scale.rknot",
        f32::NAN,
        "block scale is NaN",
        "block 3 of attn_q has a NaN scale",
    );
    scale_case(
        c,
        "rknot_read_inf_scale.rknot",
        f32::INFINITY,
        "block scale is inf",
        "block 3 of attn_q has an infinite scale",
    );
    scale_case(
        c,
        "rknot_read_neg_inf_scale.rknot",
        f32::NEG_INFINITY,
        "block scale is -inf",
        "block 3 of attn_q has a -inf scale",
    );
    c.case(
        "rknot_read_width_gt_bits.rknot",
        rknot_edit(|h, body| {
            let off = block_off(h, 0, 1, 1);
            body[off + 4 + 2] = 7;
        }),
        "BadValue",
        "width table holds 7 bits, the tensor's maximum is 6",
        "graded width 7 in a tensor of at most 6 bits",
    );
    c.read("blk.0.ffn_up.weight");
    c.case(
        "rknot_read_graded_len.rknot",
        rknot_edit(|h, body| {
            let off = block_off(h, 0, 1, 0);
            // Widths [6, 5, 0, 3] -> [6, 1, 0, 3]: 40 code bits, 56 stored.
            body[off + 4 + 1] = 1;
        }),
        "LengthMismatch",
        "graded block has 7 code bytes, its width table implies 5",
        "graded block whose length disagrees with its width table",
    );
    c.read("blk.0.ffn_up.weight");
    c.case(
        "rknot_read_graded_width_cols.rknot",
        rknot_edit(|h, body| {
            let off = block_off(h, 1, 0, 1);
            body[off + 4] = 0xff;
        }),
        "BadValue",
        "width table holds 255 bits",
        "graded-by-cols width 255",
    );
    c.read("blk.1.attn_q.weight");
}

fn gguf_cases(c: &mut Corpus) {
    let base = gguf_base();
    let p = gguf_parts();
    assert_eq!(p.bytes(), base, "hand-built GGUF differs from write_gguf");
    // Section boundaries of the base file.
    let kv_start = 4 + 4 + 8 + 8;
    let kv_len: usize = p.kvs.iter().map(Vec::len).sum();
    let info_start = kv_start + kv_len;
    let info_len: usize = p.infos.iter().map(Vec::len).sum();
    let data_start = (info_start + info_len + 31) & !31;
    let with = |f: &dyn Fn(&mut GgufParts)| {
        let mut q = gguf_parts();
        f(&mut q);
        q.bytes()
    };

    c.case(
        "gguf_trunc_magic.gguf",
        base[..2].to_vec(),
        "BadMagic",
        "[71, 71]",
        "file ends inside the magic",
    );
    c.case(
        "gguf_trunc_version.gguf",
        base[..6].to_vec(),
        "Truncated",
        "GGUF version",
        "file ends inside the version",
    );
    c.case(
        "gguf_trunc_tensor_count.gguf",
        base[..12].to_vec(),
        "Truncated",
        "tensor count",
        "file ends inside the tensor count",
    );
    c.case(
        "gguf_trunc_kv_count.gguf",
        base[..20].to_vec(),
        "Truncated",
        "metadata kv count",
        "file ends inside the kv count",
    );
    c.case(
        "gguf_trunc_counts.gguf",
        base[..kv_start + 30].to_vec(),
        "Truncated",
        "tensor count: 2 declared, needing at least 64 bytes",
        "file too short for the declared tensor and kv counts",
    );
    c.case(
        "gguf_trunc_kv.gguf",
        base[..info_start - 1].to_vec(),
        "Truncated",
        "value of metadata key \"tokenizer.ggml.tokens\": needs 1 bytes",
        "file ends inside the last kv pair",
    );
    c.case(
        "gguf_trunc_infos.gguf",
        base[..info_start + 10].to_vec(),
        "Truncated",
        "tensor #0",
        "file ends inside the first tensor info",
    );
    c.case(
        "gguf_trunc_data.gguf",
        base[..data_start + 100].to_vec(),
        "OutOfBounds",
        "lie outside the file",
        "file ends inside the first tensor's data",
    );
    c.case(
        "gguf_v1.gguf",
        with(&|q| q.version = 1),
        "UnsupportedVersion",
        "GGUF v1 is not supported",
        "GGUF version 1",
    );
    c.case(
        "gguf_v4.gguf",
        with(&|q| q.version = 4),
        "UnsupportedVersion",
        "GGUF version 4 is not supported",
        "GGUF version 4",
    );
    c.case(
        "gguf_big_endian.gguf",
        with(&|q| q.version = 3u32.swap_bytes()),
        "UnsupportedVersion",
        "big-endian GGUF is not supported",
        "version field 0x03000000: a big-endian file",
    );
    c.case(
        "gguf_tensor_count_huge.gguf",
        with(&|q| q.tensor_count = Some(u64::MAX)),
        "TooLarge",
        "tensor count",
        "tensor count 2^64-1",
    );
    c.case(
        "gguf_kv_count_huge.gguf",
        with(&|q| q.kv_count = Some(1 << 40)),
        "TooLarge",
        "metadata kv count",
        "kv count 2^40",
    );
    c.case(
        "gguf_kv_count_past_eof.gguf",
        with(&|q| q.kv_count = Some(1000)),
        "Truncated",
        "metadata kv count: 1000 declared",
        "kv count 1000 cannot fit in the file",
    );
    c.case(
        "gguf_kv_count_extra.gguf",
        with(&|q| q.kv_count = Some(4)),
        "BadName",
        "name of tensor #0: string length",
        "kv count one too many: the first tensor info is read as a kv pair, then the \
         second is read as the first and its bytes make an absurd name length",
    );
    c.case(
        "gguf_string_len_huge.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("general.architecture")
                .u32(8)
                .u64(u64::MAX - 1)
                .bytes(b"llama");
            q.kvs[0] = g.out;
        }),
        "TooLarge",
        "string length 18446744073709551614 exceeds the cap",
        "a string value claiming 2^64-2 bytes",
    );
    c.case(
        "gguf_string_len_past_eof.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("general.architecture")
                .u32(8)
                .u64(5000)
                .bytes(b"llama");
            q.kvs[0] = g.out;
        }),
        "Truncated",
        "needs 5000 bytes",
        "a 5000-byte string in a smaller file",
    );
    c.case(
        "gguf_key_len_huge.gguf",
        with(&|q| {
            let mut g = G::default();
            g.u64(1 << 62).bytes(b"general.architecture");
            q.kvs[0] = g.out;
        }),
        "TooLarge",
        "key of metadata kv #0",
        "a key claiming 2^62 bytes",
    );
    c.case(
        "gguf_array_count_huge.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("tokenizer.ggml.tokens")
                .u32(9)
                .u32(8)
                .u64(u64::MAX / 2);
            g.str("a").str("b");
            q.kvs[2] = g.out;
        }),
        "TooLarge",
        "array of string",
        "a string array claiming 2^63 elements",
    );
    c.case(
        "gguf_array_count_past_eof.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("tokenizer.ggml.tokens").u32(9).u32(4).u64(100_000);
            g.str("a").str("b");
            q.kvs[2] = g.out;
        }),
        "Truncated",
        "100000 declared",
        "a u32 array of 100000 elements in a small file",
    );
    c.case(
        "gguf_value_type_unknown.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("llama.block_count").u32(13).u32(1);
            q.kvs[1] = g.out;
        }),
        "UnknownType",
        "unknown value type id 13",
        "value type 13",
    );
    c.case(
        "gguf_array_elem_type_unknown.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("tokenizer.ggml.tokens")
                .u32(9)
                .u32(0xffff_ffff)
                .u64(2);
            g.str("a").str("b");
            q.kvs[2] = g.out;
        }),
        "UnknownType",
        "unknown array element type id 4294967295",
        "array element type 0xffffffff",
    );
    c.case(
        "gguf_array_too_deep.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("deep").u32(9);
            for _ in 0..5 {
                g.u32(9).u64(1);
            }
            g.u32(4).u64(1).u32(7);
            q.kvs.push(g.out);
        }),
        "TooLarge",
        "nested deeper than 4 levels",
        "arrays nested 6 deep",
    );
    c.case(
        "gguf_bool_2.gguf",
        with(&|q| {
            let mut g = G::default();
            g.str("flag").u32(7).bytes(&[2]);
            q.kvs.push(g.out);
        }),
        "BadValue",
        "bool byte is 2",
        "a bool value byte 2",
    );
    c.case(
        "gguf_key_not_utf8.gguf",
        with(&|q| {
            let mut g = G::default();
            g.u64(4).bytes(b"k\xffey").u32(4).u32(1);
            q.kvs.push(g.out);
        }),
        "BadValue",
        "not valid UTF-8",
        "a key with an invalid UTF-8 byte",
    );
    c.case(
        "gguf_key_duplicate.gguf",
        with(&|q| q.kvs.push(kv_u32("llama.block_count", 2))),
        "BadValue",
        "duplicate metadata key \"llama.block_count\"",
        "the same key twice",
    );
    c.case(
        "gguf_alignment_3.gguf",
        with(&|q| q.kvs.push(kv_u32("general.alignment", 3))),
        "BadValue",
        "general.alignment = 3",
        "alignment 3 is not a power of two",
    );
    c.case(
        "gguf_alignment_0.gguf",
        with(&|q| q.kvs.push(kv_u32("general.alignment", 0))),
        "BadValue",
        "general.alignment = 0",
        "alignment 0",
    );
    c.case(
        "gguf_alignment_string.gguf",
        with(&|q| q.kvs.push(kv_str("general.alignment", "32"))),
        "BadValue",
        "general.alignment must be a u32",
        "alignment stored as a string",
    );
    let t = gguf_base_tensors();
    c.case(
        "gguf_ggml_type_unknown.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[1].0, &t[1].1, 99, 96);
            q.infos[1] = g.out;
        }),
        "UnknownType",
        "unknown ggml type id 99",
        "ggml type 99",
    );
    c.case(
        "gguf_ggml_type_removed.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[1].0, &t[1].1, 4, 96);
            q.infos[1] = g.out;
        }),
        "UnknownType",
        "unknown ggml type id 4",
        "ggml type 4 (the removed Q4_2)",
    );
    c.case(
        "gguf_n_dims_0.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[1].0, &[], 0, 96);
            q.infos[1] = g.out;
        }),
        "BadShape",
        "n_dims is 0",
        "a tensor with 0 dims",
    );
    c.case(
        "gguf_n_dims_5.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[1].0, &[8, 1, 1, 1, 1], 0, 96);
            q.infos[1] = g.out;
        }),
        "BadShape",
        "n_dims is 5",
        "a tensor with 5 dims",
    );
    c.case(
        "gguf_zero_dim.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[0].0, &[32, 0], 8, 0);
            q.infos[0] = g.out;
        }),
        "BadShape",
        "ne[1] is 0",
        "a tensor with a zero dim",
    );
    c.case(
        "gguf_ne_overflow.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[0].0, &[1 << 32, 1 << 32, 2], 0, 0);
            q.infos[0] = g.out;
        }),
        "Overflow",
        "element count",
        "ne product 2^65 overflows u64",
    );
    c.case(
        "gguf_ne_above_i64.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[0].0, &[1 << 32, 1 << 31], 0, 0);
            q.infos[0] = g.out;
        }),
        "Overflow",
        "does not fit in ggml's int64",
        "ne product 2^63 does not fit ggml's int64",
    );
    c.case(
        "gguf_ne0_not_block_multiple.gguf",
        with(&|q| {
            let mut g = G::default();
            g.info(&t[0].0, &[48, 2], 8, 0);
            q.infos[0] = g.out;
        }),
        "BadShape",
        "ne0 = 48 is not a multiple of the Q8_0 block size 32",
        "q8_0 with ne0 48",
    );
    c.case(
        "gguf_offset_misaligned.gguf",
        with(&|q| q.infos[1] = info(&t[1].0, &t[1].1, t[1].2, 98)),
        "BadValue",
        "data offset 98 is not a multiple of the alignment 32",
        "tensor data offset 98 with alignment 32",
    );
    c.case(
        "gguf_data_past_eof.gguf",
        with(&|q| q.infos[1] = info(&t[1].0, &t[1].1, t[1].2, 4096)),
        "OutOfBounds",
        "lie outside the file",
        "tensor data at offset 4096 of a 128-byte data section",
    );
    c.case(
        "gguf_offset_overflow.gguf",
        with(&|q| q.infos[1] = info(&t[1].0, &t[1].1, t[1].2, u64::MAX - 31)),
        "Overflow",
        "absolute tensor offset",
        "data offset near 2^64: data_offset + offset overflows",
    );
    c.case(
        "gguf_overlap.gguf",
        with(&|q| q.infos[1] = info(&t[1].0, &t[1].1, t[1].2, 64)),
        "BadValue",
        "tensor data overlaps",
        "output_norm's data starts inside attn_q's",
    );
    c.case(
        "gguf_tensor_dup.gguf",
        with(&|q| q.infos[1] = info(&t[0].0, &t[1].1, t[1].2, 96)),
        "BadName",
        "duplicate tensor name \"blk.0.attn_q.weight\"",
        "two tensor infos with one name",
    );
    c.case(
        "gguf_tensor_dup_alias.gguf",
        with(&|q| {
            q.infos[0] = info("blk.0.attn_o.weight", &t[0].1, t[0].2, 0);
            q.infos[1] = info("blk.0.attn_output.weight", &t[1].1, t[1].2, 96);
        }),
        "BadName",
        "duplicate tensor name",
        "blk.0.attn_o.weight and blk.0.attn_output.weight: one tensor after aliasing",
    );
    c.case(
        "gguf_tensor_name_slash.gguf",
        with(&|q| q.infos[1] = info("a/b", &t[1].1, t[1].2, 96)),
        "BadName",
        "cannot be served as a file name",
        "a tensor name with a slash",
    );
    c.case(
        "gguf_tensor_name_long.gguf",
        with(&|q| {
            let mut g = G::default();
            g.u64(1 << 20).bytes(b"x");
            q.infos[1] = g.out;
        }),
        "BadName",
        "exceeds the cap of 4096 bytes",
        "a tensor name claiming 1 MiB",
    );
}

fn layered_cases(c: &mut Corpus) {
    c.support("ok_fallback.gguf", gguf_base());
    c.support("ok_primary.sk32", sk32_base());
    c.case(
        "layered_shape_mismatch.sk32",
        sk32_base(),
        "ShapeMismatch",
        "has shape [8, 6]",
        "SK32 blk.0.attn_q.weight is [8, 6], the GGUF fallback's is [2, 32]",
    );
    let e = c.last();
    e.dense = Some("ok_fallback.gguf".to_string());
    e.contains_also = vec!["has [2, 32]".to_string(), "ok_fallback.gguf".to_string()];
    c.case(
        "layered_fallback_is_sk32.sk32",
        sk32_bytes(&[sketch("blk.0.ffn_up.weight", 4, 8, 1, 2)]),
        "BadValue",
        "the fallback must be a dense file (GGUF or dense .knot), this is sk32",
        "an SK32 given as the dense fallback",
    );
    let e = c.last();
    e.dense = Some("ok_primary.sk32".to_string());
    e.blame = Some("dense".to_string());
    c.case(
        "layered_fallback_is_rknot.sk32",
        sk32_bytes(&[sketch("blk.0.ffn_up.weight", 4, 8, 1, 2)]),
        "BadValue",
        "this is rknot",
        "an .rknot given as the dense fallback",
    );
    let e = c.last();
    e.dense = Some("ok_primary.rknot".to_string());
    e.blame = Some("dense".to_string());
    c.support("ok_primary.rknot", rknot_base());
    c.case(
        "layered_fallback_truncated.sk32",
        sk32_base(),
        "Truncated",
        "tensor count",
        "a valid SK32 over a GGUF fallback that ends inside its header",
    );
    let e = c.last();
    e.dense = Some("gguf_trunc_tensor_count.gguf".to_string());
    e.blame = Some("dense".to_string());
    c.case(
        "layered_rknot_shape_mismatch.rknot",
        rknot_edit(|h, _| {
            // attn_q of the fallback is [2, 32]; make the .rknot's [8, 16]
            // tensor of layer 1 claim that name at a different shape.
            h["layers"][1]["tensors"][0]["name"] = json!("blk.0.attn_q.weight");
            h["layers"][0]["tensors"][0]["name"] = json!("blk.0.attn_v.weight");
        }),
        "ShapeMismatch",
        "has shape [8, 16]",
        ".rknot blk.0.attn_q.weight is [8, 16], the GGUF fallback's is [2, 32]",
    );
    let e = c.last();
    e.dense = Some("ok_fallback.gguf".to_string());
    e.contains_also = vec!["has [2, 32]".to_string()];
    c.support(
        "fallback_dotted_name.gguf",
        gguf_bytes(
            &Metadata::default(),
            &[("output.norm.weight".to_string(), vec![8], GgmlType::F32)],
            32,
        ),
    );
    c.case(
        "layered_name_collision.sk32",
        sk32_bytes(&[sketch("output_norm.weight", 2, 4, 1, 3)]),
        "BadName",
        "duplicate tensor name: stored name \"output_norm.weight\" resolves to \
         \"output_norm_weight\"",
        "primary output_norm.weight and fallback output.norm.weight are different tensors \
         whose underscore spellings (served file names) collide",
    );
    c.last().dense = Some("fallback_dotted_name.gguf".to_string());
}

fn magic_cases(c: &mut Corpus) {
    c.case(
        "magic_zip.bin",
        b"PK\x03\x04\x14\x00\x00\x00\x08\x00".to_vec(),
        "BadMagic",
        "[80, 75, 3, 4, 20, 0]",
        "a zip file",
    );
    c.case(
        "magic_empty.bin",
        Vec::new(),
        "BadMagic",
        "found []",
        "an empty file",
    );
    c.case(
        "magic_lowercase_gguf.bin",
        b"gguf\x03\x00\x00\x00".to_vec(),
        "BadMagic",
        "[103, 103, 117, 102, 3, 0]",
        "lower-case gguf",
    );
    c.case(
        "magic_rknot_v1.bin",
        b"RKNOT\x01\x00\x00\x00\x00".to_vec(),
        "UnsupportedVersion",
        "version byte 1",
        "RKNOT\\x01 magic",
    );
}

/// Write the corpus into `dir`: every file plus `expected.json`. Files of
/// the corpus's extensions that are no longer part of it are removed.
pub fn write_to(dir: &std::path::Path) -> std::io::Result<Corpus> {
    let corpus = build();
    std::fs::create_dir_all(dir)?;
    let mut keep: Vec<&str> = corpus.files.iter().map(|(f, _)| f.as_str()).collect();
    keep.push(EXPECTED_JSON);
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let ours = [".sk32", ".knot", ".rknot", ".gguf", ".bin"]
            .iter()
            .any(|e| name.ends_with(e));
        if ours && !keep.contains(&name.as_str()) {
            std::fs::remove_file(dir.join(&name))?;
        }
    }
    for (name, bytes) in &corpus.files {
        std::fs::write(dir.join(name), bytes)?;
    }
    std::fs::write(dir.join(EXPECTED_JSON), corpus.expected_json())?;
    Ok(corpus)
}
