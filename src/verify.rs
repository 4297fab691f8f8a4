//! `rknot verify`: structural checks of an encoded file, and fidelity
//! against its dense source.
//!
//! Structure: the header (every offset, length, table, shape) is validated
//! by the reader at open; then everything the file stores is checked, with
//! work bounded by the file's size, not by the shapes it declares (a tiny
//! .rknot may declare a 2^30 x 2^30 tensor):
//! - .rknot: every block (finite scale, widths within the tensor's maximum,
//!   exact payload lengths), and no value of it may decode to NaN or
//!   infinity (checked from the scale and the widest line; the codes are
//!   read only when that bound overflows);
//! - SK32: every factor byte is read; per row, `Σ_r |U σ| · max|Vᵀ_r|` must
//!   stay well inside f32, so no served value can be NaN or infinite;
//! - tensors stored as ggml blocks (all of a GGUF or dense .knot, the
//!   uncompressed ones of a self-contained .rknot) store every served
//!   value: each is decoded and every value must be finite.
//!
//! Fidelity, per tensor the encoded file carries, against the same tensor
//! of the dense file (`A` encoded, `B` dense):
//! - relative error `‖A − B‖_F / ‖B‖_F`;
//! - cosine similarity `⟨A, B⟩ / (‖A‖ ‖B‖)`;
//! - energy retained `‖A‖² / ‖B‖²` (for a truncated SVD, the fraction of
//!   the spectrum's energy kept);
//! - bits per weight of the encoded tensor.
//!
//! Summaries per tensor kind and overall aggregate over elements:
//! `sqrt(Σ‖A−B‖² / Σ‖B‖²)`, `Σ⟨A,B⟩ / sqrt(Σ‖A‖² Σ‖B‖²)`, `Σ‖A‖²/Σ‖B‖²`
//! and total stored bits over total weights ([`total`]). Two totals have
//! names: "overall" over every compared tensor (verbatim copies count,
//! with error 0) and "lossy-encoded" over the tensors stored lossy (the
//! figure the encoder prints, [`lossy_error`]).

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use serde_json::{Value, json};

use crate::backend::{self, Backend, ParsedFile, Role, StoredType};
use crate::encode::tensor_kind;
use crate::error::{Error, ErrorKind, Result, err};
use crate::format::rknot::{RknotFile, check_block};
use crate::format::sk32::{Sk32File, SketchInfo, dequant_sigma, dequant_uv};
use crate::integrity::checksums;
use crate::names;
use crate::progress::{Meter, Mode, Unit};
use crate::source::SourceFile;
use crate::text::escape;

/// Elements decoded per step (bounded memory).
const STEP: u64 = 1 << 20;

/// One structural problem.
#[derive(Debug, Clone)]
pub struct Fault {
    pub tensor: Option<String>,
    pub message: String,
}

#[derive(Debug, Clone, Default)]
pub struct Sums {
    pub err2: f64,
    pub ref2: f64,
    pub enc2: f64,
    pub dot: f64,
    pub stored_bits: f64,
    pub n: u64,
    /// Values whose f32 bits differ from the reference's (a NaN equals
    /// only a NaN of the same bits).
    pub differing: u64,
}

/// One tensor compared with the dense file.
#[derive(Debug, Clone)]
pub struct Compared {
    pub name: String,
    pub sums: Sums,
    /// Stored lossy-encoded, not as a copy of the dense file's blocks.
    pub lossy: bool,
}

/// The aggregate of `sums`: the one definition of a total figure.
pub fn total<'a>(sums: impl IntoIterator<Item = &'a Sums>) -> Sums {
    let mut t = Sums::default();
    for s in sums {
        t.add(s);
    }
    t
}

/// The "lossy-encoded" total of `tensors`: over those stored lossy; None
/// when there are none.
pub fn lossy_error(tensors: &[Compared]) -> Option<Sums> {
    let lossy: Vec<&Sums> = tensors
        .iter()
        .filter(|c| c.lossy)
        .map(|c| &c.sums)
        .collect();
    (!lossy.is_empty()).then(|| total(lossy))
}

impl Sums {
    fn add(&mut self, o: &Sums) {
        self.err2 += o.err2;
        self.ref2 += o.ref2;
        self.enc2 += o.enc2;
        self.dot += o.dot;
        self.stored_bits += o.stored_bits;
        self.n += o.n;
        self.differing += o.differing;
    }
    pub fn rel_err(&self) -> f64 {
        if self.ref2 > 0.0 {
            (self.err2 / self.ref2).sqrt()
        } else {
            0.0
        }
    }
    pub fn cosine(&self) -> f64 {
        let d = (self.enc2 * self.ref2).sqrt();
        if d > 0.0 { self.dot / d } else { 1.0 }
    }
    pub fn energy(&self) -> f64 {
        if self.ref2 > 0.0 {
            self.enc2 / self.ref2
        } else {
            1.0
        }
    }
    pub fn bpw(&self) -> f64 {
        if self.n > 0 {
            self.stored_bits / self.n as f64
        } else {
            0.0
        }
    }
    fn json(&self) -> Value {
        json!({
            "rel_err": self.rel_err(),
            "cosine": self.cosine(),
            "energy_retained": self.energy(),
            "payload_bits_per_weight": self.bpw(),
            "weights": self.n,
            "differing_values": self.differing,
        })
    }
}

pub struct Report {
    pub path: String,
    pub format: String,
    pub faults: Vec<Fault>,
    /// Every compared tensor, in the file's order.
    pub tensors: Vec<Compared>,
    pub dense: Option<String>,
    /// The whole file's size and the parameters it serves (0 when its
    /// header could not be read).
    pub file_bytes: u64,
    pub parameters: u64,
    /// Checksum units (block groups, chunks) compared against the file's
    /// CRC-32s; None: the file carries none ("unchecked").
    pub checksum_units: Option<u64>,
}

impl Report {
    /// Honest bits per weight: the whole file x 8 / parameters served.
    pub fn bits_per_weight(&self) -> f64 {
        if self.parameters > 0 {
            self.file_bytes as f64 * 8.0 / self.parameters as f64
        } else {
            0.0
        }
    }

    pub fn by_kind(&self) -> BTreeMap<String, Sums> {
        let mut m: BTreeMap<String, Sums> = BTreeMap::new();
        for c in &self.tensors {
            m.entry(tensor_kind(&c.name).to_string())
                .or_default()
                .add(&c.sums);
        }
        m
    }

    /// Every value of every compared tensor has the reference's f32 bits,
    /// and nothing failed: what `lossless: bit-identical` says. False
    /// without a reference.
    pub fn bit_identical(&self) -> bool {
        self.dense.is_some()
            && self.faults.is_empty()
            && !self.tensors.is_empty()
            && self.tensors.iter().all(|c| c.sums.differing == 0)
    }

    /// The `lossless:` line of the text report (with a reference).
    pub fn lossless_line(&self) -> String {
        let t = self.overall();
        if self.bit_identical() {
            format!(
                "lossless: bit-identical (all {} values of {} tensors have the reference's bits)",
                t.n,
                self.tensors.len()
            )
        } else {
            format!(
                "lossless: no ({} of {} compared values differ from the reference's bits{})",
                t.differing,
                t.n,
                if self.faults.is_empty() {
                    ""
                } else {
                    "; faults above"
                }
            )
        }
    }

    /// The total over every compared tensor.
    pub fn overall(&self) -> Sums {
        total(self.tensors.iter().map(|c| &c.sums))
    }

    pub fn to_json(&self) -> Value {
        json!({
            "file": self.path,
            "format": self.format,
            "ok": self.faults.is_empty(),
            "faults": self.faults.iter().map(|f| json!({"tensor": f.tensor, "message": f.message})).collect::<Vec<_>>(),
            "dense": self.dense,
            "file_bytes": self.file_bytes,
            "parameters": self.parameters,
            "bits_per_weight": self.bits_per_weight(),
            "checked": self.checksum_units.is_some(),
            "checksum_units": self.checksum_units,
            "tensors": self.tensors.iter().map(|c| { let mut v = c.sums.json(); v["name"] = json!(c.name); v["lossy"] = json!(c.lossy); v }).collect::<Vec<_>>(),
            "by_kind": self.by_kind().iter().map(|(k, s)| (k.clone(), s.json())).collect::<serde_json::Map<_, _>>(),
            "overall": if self.tensors.is_empty() { Value::Null } else { self.overall().json() },
            "lossy_encoded": lossy_error(&self.tensors).map_or(Value::Null, |s| s.json()),
            "bit_identical": self.dense.as_ref().map(|_| self.bit_identical()),
        })
    }

    /// The text report; names, paths and messages are escaped.
    pub fn to_text(&self) -> String {
        let mut o = format!("file:    {} ({})\n", escape(&self.path), self.format);
        if self.faults.is_empty() {
            o += "structure: OK (headers, every stored block, no value NaN or infinite)\n";
        }
        match self.checksum_units {
            Some(n) => o += &format!("checksums: {n} CRC-32s of stored bytes compared\n"),
            None if self.format != "?" => {
                o += "checksums: none in this file (unchecked; see `rknot manifest`)\n"
            }
            None => {}
        }
        if !self.faults.is_empty() {
            o += &format!("structure: {} FAULT(S)\n", self.faults.len());
            for f in &self.faults {
                o += &format!(
                    "  {}: {}\n",
                    escape(f.tensor.as_deref().unwrap_or("-")),
                    escape(&f.message)
                );
            }
        }
        if self.parameters > 0 {
            o += &format!(
                "size:    {:.3} bits per weight ({} B file x 8 / {} parameters)\n",
                self.bits_per_weight(),
                self.file_bytes,
                self.parameters
            );
        }
        if let Some(d) = &self.dense {
            o += &format!("dense:   {}\n", escape(d));
            o += &format!(
                "  {:<34} {:>9} {:>9} {:>9} {:>11}\n",
                "tensor", "rel_err", "cosine", "energy", "payload bpw"
            );
            for Compared { name, sums: s, .. } in &self.tensors {
                o += &format!(
                    "  {:<34} {:>9.5} {:>9.6} {:>9.5} {:>11.3}\n",
                    escape(name),
                    s.rel_err(),
                    s.cosine(),
                    s.energy(),
                    s.bpw()
                );
            }
            o += "by kind:\n";
            for (k, s) in self.by_kind() {
                o += &format!(
                    "  {:<34} {:>9.5} {:>9.6} {:>9.5} {:>11.3}\n",
                    k,
                    s.rel_err(),
                    s.cosine(),
                    s.energy(),
                    s.bpw()
                );
            }
            let totals = [
                ("overall (every tensor)", Some(self.overall())),
                ("lossy-encoded tensors", lossy_error(&self.tensors)),
            ];
            for (label, t) in totals {
                let Some(t) = t else { continue };
                o += &format!(
                    "  {:<34} {:>9.5} {:>9.6} {:>9.5} {:>11.3}\n",
                    label,
                    t.rel_err(),
                    t.cosine(),
                    t.energy(),
                    t.bpw()
                );
            }
            o += &self.lossless_line();
            o.push('\n');
        }
        o
    }
}

/// Decode every tensor stored as ggml blocks (all of a GGUF or dense
/// .knot, a self-contained .rknot's uncompressed ones); record non-finite
/// values and read errors. Such tensors store every value: the work is
/// bounded by the file's size.
fn check_tensors(b: &dyn Backend, faults: &mut Vec<Fault>, meter: &Meter) {
    let mut buf = vec![0f32; STEP as usize];
    for (i, t) in b.tensors().entries().iter().enumerate() {
        if !t.is_available() || !matches!(t.stored, StoredType::Ggml(_)) {
            continue;
        }
        let mut at = 0u64;
        let mut bad = 0u64;
        while at < t.n_elements {
            let n = STEP.min(t.n_elements - at) as usize;
            if let Err(e) = b.read_f32(i, at, &mut buf[..n]) {
                faults.push(Fault {
                    tensor: Some(t.name.dot.clone()),
                    message: e.to_string(),
                });
                break;
            }
            bad += buf[..n].iter().filter(|v| !v.is_finite()).count() as u64;
            at += n as u64;
            meter.inc(n as u64 * CHECK_WEIGHT);
        }
        if bad > 0 {
            faults.push(Fault {
                tensor: Some(t.name.dot.clone()),
                message: format!("{bad} decoded values are NaN or infinite"),
            });
        }
    }
}

/// Progress weights of `verify`'s phases, per byte read or element
/// decoded (rough relative costs measured on SmolLM2: a checksummed byte
/// read costs about an eighth of an element decoded from both files and
/// compared).
const SCAN_WEIGHT: u64 = 1;
const CHECK_WEIGHT: u64 = 4;
const COMPARE_WEIGHT: u64 = 8;

/// The tensors `compare` decodes.
/// Whether `compare` measures `t`: every available tensor, or with
/// `only_lossy` those not stored as the dense file stores them (ggml blocks
/// copied verbatim are exact; a vocabulary table requantized by the
/// calibrated profile is not).
fn compared(t: &backend::TensorInfo, dense: &dyn Backend, only_lossy: bool) -> bool {
    if !t.is_available() {
        return false;
    }
    if !only_lossy {
        return true;
    }
    if let StoredType::RknotLossless(_) = t.stored {
        return false;
    }
    if !matches!(t.stored, StoredType::Ggml(_)) {
        return true;
    }
    dense
        .find(&t.name.dot)
        .ok()
        .and_then(|j| dense.tensors().entries().get(j))
        .is_some_and(|d| d.stored != t.stored)
}

/// Progress weight of `compare` over `enc`.
fn compare_weight(enc: &dyn Backend, dense: &dyn Backend, only_lossy: bool) -> u64 {
    enc.tensors()
        .entries()
        .iter()
        .filter(|t| compared(t, dense, only_lossy))
        .fold(0u64, |a, t| {
            a.saturating_add(t.n_elements.saturating_mul(COMPARE_WEIGHT))
        })
}

/// Compare every tensor `enc` carries with `dense`'s.
fn compare(
    enc: &dyn Backend,
    dense: &dyn Backend,
    only_lossy: bool,
    faults: &mut Vec<Fault>,
    meter: &Meter,
) -> Vec<Compared> {
    // Tensors in parallel, each summed in order as before: the figures do
    // not depend on the thread count, and results keep the file's order.
    let results: Vec<Option<std::result::Result<Sums, Fault>>> = enc
        .tensors()
        .entries()
        .par_iter()
        .enumerate()
        .map(|(i, t)| {
            if !compared(t, dense, only_lossy) {
                return None;
            }
            let fault = |message: String| Fault {
                tensor: Some(t.name.dot.clone()),
                message,
            };
            let Ok(j) = dense.find(&t.name.dot) else {
                return Some(Err(fault("not in the dense file".into())));
            };
            let d = &dense.tensors().entries()[j];
            if d.shape != t.shape {
                return Some(Err(fault(format!(
                    "shape {:?} here, {:?} in the dense file",
                    t.shape, d.shape
                ))));
            }
            let mut s = Sums {
                stored_bits: t.stored_bytes as f64 * 8.0,
                n: t.n_elements,
                ..Sums::default()
            };
            let (mut a, mut b) = (vec![0f32; STEP as usize], vec![0f32; STEP as usize]);
            let mut at = 0u64;
            while at < t.n_elements {
                let n = STEP.min(t.n_elements - at) as usize;
                if let Err(e) = enc
                    .read_f32(i, at, &mut a[..n])
                    .and_then(|()| dense.read_f32(j, at, &mut b[..n]))
                {
                    return Some(Err(fault(e.to_string())));
                }
                for (&x, &y) in a[..n].iter().zip(&b[..n]) {
                    s.differing += u64::from(x.to_bits() != y.to_bits());
                    let (x, y) = (f64::from(x), f64::from(y));
                    s.err2 += (x - y) * (x - y);
                    s.ref2 += y * y;
                    s.enc2 += x * x;
                    s.dot += x * y;
                }
                at += n as u64;
                meter.inc(n as u64 * COMPARE_WEIGHT);
            }
            Some(Ok(s))
        })
        .collect();
    let mut out = Vec::new();
    for (t, r) in enc.tensors().entries().iter().zip(results) {
        match r {
            Some(Ok(s)) => out.push(Compared {
                name: t.name.dot.clone(),
                sums: s,
                lossy: compared(t, dense, true),
            }),
            Some(Err(f)) => faults.push(f),
            None => {}
        }
    }
    out
}

/// Bytes read at once when checking blocks that lie one after another.
const RUN_BYTES: u64 = 4 << 20;

/// Check every block of a .rknot: structure, and values that would decode
/// to NaN or infinity. One fault per tensor for the first bad block, one
/// for its non-finite values.
fn check_rknot(src: &SourceFile, f: &RknotFile, faults: &mut Vec<Fault>) {
    let mut buf = Vec::new();
    for t in &f.tensors {
        let name = names::canonical(&t.name);
        let mut bad = 0u64;
        // Blocks in order, each offset found from the one before: the
        // scan costs one length per block (a lookup by index would sum up
        // to 63), in proportion to the bytes the tensor stores.
        let mut blocks = t.blocks.iter().enumerate().peekable();
        'blocks: while let Some(&(b, (start, _))) = blocks.peek() {
            // A run of adjacent blocks, read with one pread.
            let run = blocks.clone();
            let mut end = b;
            let mut run_end = start;
            while let Some(&(_, (o, l))) = blocks.peek() {
                if o != run_end || (end > b && run_end + u64::from(l) - start > RUN_BYTES) {
                    break;
                }
                run_end = o + u64::from(l);
                end += 1;
                blocks.next();
            }
            // Block lengths were checked at open (<= ~200 KiB each).
            buf.resize((run_end - start) as usize, 0);
            if let Err(e) = src.read_at(start, &mut buf) {
                faults.push(Fault {
                    tensor: Some(name.clone()),
                    message: e.tensor(&t.name).to_string(),
                });
                break;
            }
            for (bi, (o, l)) in run.take(end - b) {
                let bytes = &buf[(o - start) as usize..][..l as usize];
                match check_block(t, &t.grid.tile(bi as u64), bytes) {
                    Ok(n) => bad += n,
                    Err(e) => {
                        let e = Error::new(e.kind(), format!("block {bi}: {}", e.message()))
                            .tensor(&t.name)
                            .path(src.path())
                            .at(o);
                        faults.push(Fault {
                            tensor: Some(name.clone()),
                            message: e.to_string(),
                        });
                        break 'blocks;
                    }
                }
            }
        }
        if bad > 0 {
            faults.push(Fault {
                tensor: Some(name),
                message: format!("{bad} stored values decode to NaN or infinity"),
            });
        }
    }
}

/// Largest magnitude a served value may be bounded by for every f32
/// operation computing it to stay finite (half of f32::MAX leaves room for
/// the rounding of a rank-long sum).
const F32_SAFE: f64 = f32::MAX as f64 / 2.0;

/// Check every factor of every sketch: each served value
/// `Σ_r c[i][r] (v[r][j] - 128)` (`c = U σ v_max / 127`) is bounded per
/// row by `Σ_r |c[i][r]| · max_j |v[r][j] - 128|`; a row whose bound (or
/// one coefficient) is not well inside f32 is a fault, since its values may
/// overflow. Reads each factor byte once.
fn check_sketches(src: &SourceFile, f: &Sk32File, faults: &mut Vec<Fault>) {
    for s in &f.sketches {
        if let Err(message) = check_sketch(src, s) {
            faults.push(Fault {
                tensor: Some(names::canonical(&s.name)),
                message,
            });
        }
    }
}

fn check_sketch(src: &SourceFile, s: &SketchInfo) -> std::result::Result<(), String> {
    let shown = |e: Error| e.tensor(&s.name).to_string();
    // Sizes were checked against the file at open.
    let rank = s.rank as usize;
    let mut sigma_q = vec![0u8; rank];
    src.read_at(s.sigma_offset(), &mut sigma_q).map_err(shown)?;
    // max_j |v[r][j] - 128| per factor row, reading Vᵀ in slices.
    let mut v_peak = vec![0u8; rank];
    let mut chunk = vec![0u8; (RUN_BYTES as usize).min((s.rank * s.d_in) as usize)];
    for (r, peak) in v_peak.iter_mut().enumerate() {
        let mut done = 0u64;
        while done < s.d_in {
            let n = (s.d_in - done).min(chunk.len() as u64) as usize;
            src.read_at(s.v_offset() + r as u64 * s.d_in + done, &mut chunk[..n])
                .map_err(shown)?;
            let m = chunk[..n]
                .iter()
                .map(|&v| v.abs_diff(128))
                .max()
                .unwrap_or(0);
            *peak = (*peak).max(m);
            done += n as u64;
        }
    }
    let v_step = f64::from(s.v_max) / 127.0;
    let scale: Vec<f64> = sigma_q
        .iter()
        .map(|&q| f64::from(dequant_sigma(q, s.sigma_max)) * v_step)
        .collect();
    let rows_per_chunk = (chunk.len() / rank).max(1) as u64;
    let mut u = vec![0u8; (rows_per_chunk * s.rank) as usize];
    let (mut over, mut first, mut worst) = (0u64, None, 0f64);
    let mut row = 0u64;
    while row < s.d_out {
        let n = (s.d_out - row).min(rows_per_chunk);
        let bytes = &mut u[..(n * s.rank) as usize];
        src.read_at(s.u_offset() + row * s.rank, bytes)
            .map_err(shown)?;
        for (i, urow) in bytes.chunks_exact(rank).enumerate() {
            let (mut bound, mut coef_max) = (0f64, 0f64);
            for ((&q, &sc), &vp) in urow.iter().zip(&scale).zip(&v_peak) {
                let c = (f64::from(dequant_uv(q, s.u_max)) * sc).abs();
                coef_max = coef_max.max(c);
                bound += c * f64::from(vp);
            }
            let b = bound.max(coef_max);
            if b.is_nan() || b > F32_SAFE {
                over += 1;
                first.get_or_insert(row + i as u64);
                worst = worst.max(b);
            }
        }
        row += n;
    }
    match first {
        None => Ok(()),
        Some(r) => Err(format!(
            "{over} row(s) (first: row {r}) can reach |value| {worst:e}, beyond f32: \
             u_max {}, sigma_max {}, v_max {} make U·diag(σ)·Vᵀ overflow",
            s.u_max, s.sigma_max, s.v_max
        )),
    }
}

/// Verify `encoded` (structure), and against `dense` when given; progress
/// is shown as `mode` says (one meter over every phase, weighted by bytes
/// read and elements decoded).
pub fn verify(encoded: &Path, dense: Option<&Path>, mode: Mode) -> Result<Report> {
    let header_fault = |e: Error| Report {
        path: encoded.display().to_string(),
        format: "?".into(),
        faults: vec![Fault {
            tensor: e.tensor_name().map(str::to_string),
            message: e.to_string(),
        }],
        tensors: Vec::new(),
        dense: dense.map(|d| d.display().to_string()),
        file_bytes: 0,
        parameters: 0,
        checksum_units: None,
    };
    // A header fault is the structural verdict.
    let parsed = match ParsedFile::open(encoded) {
        Ok(p) => p,
        Err(e) => return Ok(header_fault(e)),
    };
    let meter = Meter::new("verify", Unit::Work, mode);
    let (file_len, structured) = match &parsed {
        ParsedFile::Rknot(src, _) | ParsedFile::Sk32(src, _) => (src.len(), true),
        ParsedFile::DenseKnot(src, _) => (src.len(), false),
        // No checksums, nothing stored but ggml blocks.
        ParsedFile::Gguf(..) | ParsedFile::GgufSplit(..) | ParsedFile::Safetensors(..) => {
            (0, false)
        }
    };
    let scan_weight = file_len.saturating_mul(SCAN_WEIGHT);
    let struct_weight = if structured { scan_weight } else { 0 };
    if meter.is_shown() {
        // Every total up front, so the percentage and ETA hold from the
        // start: the tensor table comes from a second read of the header
        // (milliseconds; only when progress is shown).
        let later = backend::open_single(encoded, Role::Primary).map_or(0, |b| {
            let check = b
                .tensors()
                .entries()
                .iter()
                .filter(|t| t.is_available() && matches!(t.stored, StoredType::Ggml(_)))
                .fold(0u64, |a, t| {
                    a.saturating_add(t.n_elements.saturating_mul(CHECK_WEIGHT))
                });
            let cmp = if dense.is_some() {
                // Every tensor counts (not only lossy ones): the dense
                // file is not consulted.
                compare_weight(b.as_ref(), b.as_ref(), false)
            } else {
                0
            };
            check.saturating_add(cmp)
        });
        meter.set_total(
            scan_weight
                .saturating_add(struct_weight)
                .saturating_add(later),
        );
    }
    let mut faults = Vec::new();
    // Stored bytes against their checksums first: a damaged block would
    // otherwise show as whatever it decodes to.
    meter.set_message("checksums");
    let scan = checksums::scan(&parsed, &mut |done, total| {
        let at = u128::from(done) * u128::from(scan_weight) / u128::from(total.max(1));
        meter.set_position(at.min(u128::from(scan_weight)) as u64);
    });
    meter.set_position(scan_weight);
    let checksum_units = scan.checked.then_some(scan.units);
    faults.extend(scan.mismatches.into_iter().map(|e| Fault {
        tensor: e.tensor_name().map(names::canonical),
        message: e.to_string(),
    }));
    meter.set_message("blocks");
    match &parsed {
        ParsedFile::Rknot(src, f) => check_rknot(src, f, &mut faults),
        ParsedFile::Sk32(src, f) => check_sketches(src, f, &mut faults),
        ParsedFile::DenseKnot(..)
        | ParsedFile::Gguf(..)
        | ParsedFile::GgufSplit(..)
        | ParsedFile::Safetensors(..) => {}
    }
    meter.set_position(scan_weight.saturating_add(struct_weight));
    let enc = match parsed.into_backend(Role::Primary) {
        Ok(b) => b,
        Err(e) => return Ok(header_fault(e)),
    };
    meter.set_message("decoding");
    check_tensors(enc.as_ref(), &mut faults, &meter);
    let file_bytes = enc.source_files().iter().map(|f| f.len()).sum();
    // What a mount of the file alone serves: the layering rule the raw
    // backend does not apply leaves out a lossy-encoded vocabulary table.
    let parameters = enc
        .tensors()
        .entries()
        .iter()
        .filter(|t| t.is_available() && !backend::is_lossy_vocab(t))
        .fold(0u64, |a, t| a.saturating_add(t.n_elements));
    // Fidelity is per served element, but only of tensors the dense file
    // has with the same shape: bounded by the dense file's size.
    let tensors = match dense {
        Some(d) => {
            let db = backend::open(d, None)?;
            if db.summary().format.is_primary_kind() {
                return Err(err(
                    ErrorKind::BadValue,
                    "the reference must be a dense file (GGUF or dense .knot)",
                )
                .path(d));
            }
            meter.set_message("comparing");
            compare(enc.as_ref(), db.as_ref(), false, &mut faults, &meter)
        }
        None => Vec::new(),
    };
    meter.finish();
    Ok(Report {
        path: encoded.display().to_string(),
        format: format!("{} v{}", enc.summary().format, enc.summary().version),
        faults,
        tensors,
        dense: dense.map(|d| d.display().to_string()),
        file_bytes,
        parameters,
        checksum_units,
    })
}

/// `rknot verify --integrity`: the stored bytes against the checksums the
/// file carries, nothing decoded. Damage to the metadata fails the open
/// (its KSUM record) and is reported as the one mismatch.
pub fn verify_integrity(path: &Path, mode: Mode) -> IntegrityReport {
    let mut r = IntegrityReport {
        path: path.display().to_string(),
        ..IntegrityReport::default()
    };
    let parsed = match ParsedFile::open(path) {
        Ok(p) => p,
        Err(e) => {
            r.open_error = Some(e);
            return r;
        }
    };
    let name = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy();
    let meter = Meter::new(
        &format!("verify --integrity {}", escape(&name)),
        Unit::Bytes,
        mode,
    );
    r.scan = checksums::scan(&parsed, &mut |done, total| {
        meter.set_total(total);
        meter.set_position(done);
    });
    meter.finish();
    r
}

/// What `verify --integrity` found in one file.
#[derive(Debug, Default)]
pub struct IntegrityReport {
    pub path: String,
    /// The file did not open (a damaged header fails its KSUM record).
    pub open_error: Option<Error>,
    pub scan: checksums::ScanReport,
}

impl IntegrityReport {
    pub fn ok(&self) -> bool {
        self.open_error.is_none() && self.scan.mismatches.is_empty()
    }

    /// Every problem found, each naming file, tensor and offset.
    pub fn problems(&self) -> impl Iterator<Item = &Error> {
        self.open_error.iter().chain(&self.scan.mismatches)
    }

    pub fn to_text(&self) -> String {
        let mut o = format!("file:      {}\n", escape(&self.path));
        let s = &self.scan;
        if self.open_error.is_none() {
            o += &if s.checked {
                format!(
                    "checksums: {} CRC-32s over {} tensors, {} bytes read\n",
                    s.units, s.tensors, s.bytes
                )
            } else {
                "checksums: none in this file: unchecked (use `rknot manifest` for files \
                 without checksums)\n"
                    .to_string()
            };
        }
        let n = self.problems().count();
        if n == 0 {
            o += "integrity: OK\n";
        } else {
            o += &format!("integrity: {n} MISMATCH(ES)\n");
            for e in self.problems() {
                o += &format!("  {}\n", escape(&e.to_string()));
            }
        }
        o
    }

    pub fn to_json(&self) -> Value {
        let s = &self.scan;
        json!({
            "file": self.path,
            "ok": self.ok(),
            "checked": s.checked,
            "tensors": s.tensors,
            "units": s.units,
            "bytes": s.bytes,
            "mismatches": self.problems().map(|e| json!({
                "tensor": e.tensor_name(),
                "offset": e.offset(),
                "kind": format!("{:?}", e.kind()),
                "message": e.to_string(),
            })).collect::<Vec<_>>(),
        })
    }
}

/// The relative weight error of `enc`'s lossy-encoded tensors against
/// `dense` ([`lossy_error`], `verify --dense`'s "lossy-encoded tensors":
/// tensors stored as the dense file's ggml blocks are exact copies and
/// would only dilute the figure the verdict's thresholds were measured on);
/// 0 when every tensor is such a copy, None when nothing is comparable.
pub fn lossy_weight_error(enc: &dyn Backend, dense: &dyn Backend, meter: &Meter) -> Option<f64> {
    let mut faults = Vec::new();
    meter.set_total(compare_weight(enc, dense, true));
    let tensors = compare(enc, dense, true, &mut faults, meter);
    meter.finish();
    if !faults.is_empty() {
        // A figure over part of the model would mislead.
        return None;
    }
    if tensors.is_empty() {
        // Nothing lossy: exact when everything is stored verbatim.
        let entries = enc.tensors().entries();
        let verbatim = !entries.is_empty()
            && entries
                .iter()
                .all(|t| matches!(t.stored, StoredType::Ggml(_)));
        return verbatim.then_some(0.0);
    }
    lossy_error(&tensors).map(|t| t.rel_err())
}

/// What an overall relative weight error means for answers, from the
/// fidelity table of docs/QUALITY.md (SmolLM2-135M read through a mount):
/// 0.018 kept perplexity within 2% of dense, 0.05-0.07 within 40% with the
/// same answer to the Paris probe; 0.66 and above (SK32, the seed profile)
/// gave perplexities of 10^5-10^8 and wrong answers.
pub fn verdict(rel_err: f64) -> &'static str {
    if rel_err == 0.0 {
        "lossless: serves exactly the dense values"
    } else if rel_err <= 0.03 {
        "near dense: at this error SmolLM2's perplexity was within 2-12% of the dense model's"
    } else if rel_err <= 0.08 {
        "usable: at this error SmolLM2 still answered like the dense model (perplexity up to \
         40% higher)"
    } else if rel_err <= 0.3 {
        "degraded: untested range between the usable and the broken encodings; check answers \
         with rknot probe before using it"
    } else {
        "far from dense: answers will degrade (SmolLM2 at 0.66 and above answered wrongly, \
         perplexity 10^5-10^8)"
    }
}

/// Error for a failed verification (exit status 1 in the CLI).
pub fn faults_error(r: &Report) -> Error {
    err(
        ErrorKind::BadValue,
        format!("{} structural fault(s) in {}", r.faults.len(), r.path),
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::format::meta::Metadata;
    use crate::format::rknot::{
        ArchMeta, Coding, LayerOut, Manifest, TensorSpec, pack_block, write_rknot,
    };
    use crate::format::sk32::{Sketch, write_sk32};

    const NAME: &str = "blk.0.attn_q.weight";

    /// A .rknot of one 4x4 tensor (columns restricted to 2 standing
    /// indices, uniform 8 bits, 2x2 tiles: 2 blocks) whose second block is
    /// packed with `scale` and the codes 0, 255, 128, 128.
    fn rknot_file(dir: &Path, scale: f32) -> PathBuf {
        let manifest = Manifest {
            d: 4,
            standing_indices: vec![0, 2],
            amplitudes: vec![1.0, 0.5],
            phase_alignment: vec![1.0, 0.75],
        };
        let spec = TensorSpec {
            name: NAME.into(),
            d_out: 4,
            d_in: 4,
            restrict_rows: false,
            restrict_cols: true,
            coding: Coding::Uniform { bits: 8 },
            block_rows: 2,
            block_cols: 2,
        };
        let dense: Vec<f32> = (0..16).map(|i| i as f32 / 16.0 - 0.5).collect();
        let mut blocks = spec.encode(&manifest, &dense);
        let tile = spec.grid(&manifest).tile(1);
        blocks[1] = pack_block(&spec.coding, &tile, scale, &[0, 255, 128, 128]);
        let arch = ArchMeta {
            arch: "llama".into(),
            hidden_dim: 4,
            num_layers: 1,
            metadata: Metadata::default(),
        };
        let layer = LayerOut {
            index: 0,
            manifest,
            tensors: vec![(spec, blocks)],
        };
        let mut bytes = Vec::new();
        write_rknot(&mut bytes, &arch, &[layer]).unwrap();
        let path = dir.join("t.rknot");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// An SK32 of one rank-2 4x3 sketch, its maxima set to `max`.
    fn sk32_file(dir: &Path, max: f32) -> PathBuf {
        let u = [0.5f32, -1.0, 0.25, 1.0, -0.5, 0.75, 1.0, 0.0];
        let vt = [1.0f32, -0.5, 0.25, 0.5, 1.0, -1.0];
        let mut s = Sketch::quantize(NAME, 4, 3, &u, &[2.0, 1.0], &vt);
        (s.u_max, s.sigma_max, s.v_max) = (max, max, max);
        let mut bytes = Vec::new();
        write_sk32(&mut bytes, "test", &[s]).unwrap();
        let path = dir.join("t.sk32");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// The one fault of `path`'s report: its tensor and message.
    fn one_fault(path: &Path) -> (Option<String>, String) {
        let r = verify(path, None, Mode::Hidden).unwrap();
        assert_eq!(r.faults.len(), 1, "{}", r.to_text());
        assert!(r.to_text().contains("structure: 1 FAULT(S)"));
        let f = &r.faults[0];
        (f.tensor.clone(), f.message.clone())
    }

    #[test]
    fn sound_files_have_no_faults() {
        let dir = tempfile::tempdir().unwrap();
        for path in [rknot_file(dir.path(), 0.01), sk32_file(dir.path(), 2.0)] {
            let r = verify(&path, None, Mode::Hidden).unwrap();
            assert!(r.faults.is_empty(), "{}", r.to_text());
            assert!(r.to_text().contains("structure: OK"));
        }
    }

    /// A self-contained .rknot's uncompressed tensors (ggml blocks) are
    /// checked like a dense file's: a NaN in one is a fault naming it.
    #[test]
    fn rknot_dense_tensor_with_nan_is_a_fault() {
        use crate::format::rknot::RknotWriter;
        use crate::quant::GgmlType;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.rknot");
        let mut bytes = Vec::new();
        let mut w = RknotWriter::new(&mut bytes).unwrap();
        let values: Vec<u8> = [1.0f32, f32::NAN, 2.0, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        w.dense_tensor("output_norm.weight", GgmlType::F32, &[4], |off, buf| {
            buf.copy_from_slice(&values[off as usize..off as usize + buf.len()]);
            Ok(())
        })
        .unwrap();
        w.finish(&ArchMeta {
            arch: "llama".into(),
            hidden_dim: 4,
            num_layers: 1,
            metadata: Metadata::default(),
        })
        .unwrap();
        std::fs::write(&path, bytes).unwrap();
        let (tensor, message) = one_fault(&path);
        assert_eq!(tensor.as_deref(), Some("output_norm.weight"));
        assert_eq!(message, "1 decoded values are NaN or infinite");
    }

    #[test]
    fn rknot_values_that_decode_to_infinity_are_a_fault() {
        // (0 - 128) * f32::MAX and (255 - 128) * f32::MAX overflow.
        let dir = tempfile::tempdir().unwrap();
        let (tensor, message) = one_fault(&rknot_file(dir.path(), f32::MAX));
        assert_eq!(tensor.as_deref(), Some(NAME));
        assert_eq!(message, "2 stored values decode to NaN or infinity");
    }

    #[test]
    fn rknot_block_the_reader_refuses_is_a_fault_naming_file_tensor_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = rknot_file(dir.path(), f32::NAN);
        let f = RknotFile::read(&SourceFile::open(&path).unwrap()).unwrap();
        let block_at = f.tensors[0].blocks.get(1).unwrap().0;
        let (tensor, message) = one_fault(&path);
        assert_eq!(tensor.as_deref(), Some(NAME));
        for want in [
            path.display().to_string(),
            format!("tensor {NAME}: "),
            format!("at byte {block_at}: "),
            "block 1: ".into(),
            "scale".into(),
        ] {
            assert!(message.contains(&want), "{want:?} in {message}");
        }
    }

    #[test]
    fn sk32_factors_whose_product_overflows_are_a_fault() {
        let dir = tempfile::tempdir().unwrap();
        let (tensor, message) = one_fault(&sk32_file(dir.path(), 1e30));
        assert_eq!(tensor.as_deref(), Some(NAME));
        assert!(message.contains("beyond f32"), "{message}");
        assert!(message.contains("(first: row 0)"), "{message}");
    }
}
