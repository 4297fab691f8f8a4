//! `rknot verify`: structural checks of an encoded file, and fidelity
//! against its dense source.
//!
//! Structure: the header (every offset, length, table, shape) is validated
//! by the reader at open; then every tensor is decoded completely, which
//! checks every block (.rknot: finite scale, widths within the tensor's
//! maximum, exact payload lengths), and every decoded value must be finite.
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
//! and total stored bits over total weights.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use crate::backend::{self, Backend, Role};
use crate::encode::tensor_kind;
use crate::error::{Error, ErrorKind, Result, err};

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
}

impl Sums {
    fn add(&mut self, o: &Sums) {
        self.err2 += o.err2;
        self.ref2 += o.ref2;
        self.enc2 += o.enc2;
        self.dot += o.dot;
        self.stored_bits += o.stored_bits;
        self.n += o.n;
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
            "bits_per_weight": self.bpw(),
            "weights": self.n,
        })
    }
}

pub struct Report {
    pub path: String,
    pub format: String,
    pub faults: Vec<Fault>,
    /// (name, sums) per compared tensor.
    pub tensors: Vec<(String, Sums)>,
    pub dense: Option<String>,
}

impl Report {
    pub fn by_kind(&self) -> BTreeMap<String, Sums> {
        let mut m: BTreeMap<String, Sums> = BTreeMap::new();
        for (name, s) in &self.tensors {
            m.entry(tensor_kind(name).to_string()).or_default().add(s);
        }
        m
    }

    pub fn overall(&self) -> Sums {
        let mut t = Sums::default();
        for (_, s) in &self.tensors {
            t.add(s);
        }
        t
    }

    pub fn to_json(&self) -> Value {
        json!({
            "file": self.path,
            "format": self.format,
            "ok": self.faults.is_empty(),
            "faults": self.faults.iter().map(|f| json!({"tensor": f.tensor, "message": f.message})).collect::<Vec<_>>(),
            "dense": self.dense,
            "tensors": self.tensors.iter().map(|(n, s)| { let mut v = s.json(); v["name"] = json!(n); v }).collect::<Vec<_>>(),
            "by_kind": self.by_kind().iter().map(|(k, s)| (k.clone(), s.json())).collect::<serde_json::Map<_, _>>(),
            "overall": if self.tensors.is_empty() { Value::Null } else { self.overall().json() },
        })
    }

    pub fn to_text(&self) -> String {
        let mut o = format!("file:    {} ({})\n", self.path, self.format);
        if self.faults.is_empty() {
            o += "structure: OK (headers, every block decoded, every value finite)\n";
        } else {
            o += &format!("structure: {} FAULT(S)\n", self.faults.len());
            for f in &self.faults {
                o += &format!("  {}: {}\n", f.tensor.as_deref().unwrap_or("-"), f.message);
            }
        }
        if let Some(d) = &self.dense {
            o += &format!("dense:   {d}\n");
            o += &format!(
                "  {:<34} {:>9} {:>9} {:>9} {:>7}\n",
                "tensor", "rel_err", "cosine", "energy", "bpw"
            );
            for (n, s) in &self.tensors {
                o += &format!(
                    "  {:<34} {:>9.5} {:>9.6} {:>9.5} {:>7.3}\n",
                    n,
                    s.rel_err(),
                    s.cosine(),
                    s.energy(),
                    s.bpw()
                );
            }
            o += "by kind:\n";
            for (k, s) in self.by_kind() {
                o += &format!(
                    "  {:<34} {:>9.5} {:>9.6} {:>9.5} {:>7.3}\n",
                    k,
                    s.rel_err(),
                    s.cosine(),
                    s.energy(),
                    s.bpw()
                );
            }
            let t = self.overall();
            o += &format!(
                "  {:<34} {:>9.5} {:>9.6} {:>9.5} {:>7.3}\n",
                "overall",
                t.rel_err(),
                t.cosine(),
                t.energy(),
                t.bpw()
            );
        }
        o
    }
}

/// Decode every tensor; record non-finite values and read errors.
fn check_tensors(b: &dyn Backend, faults: &mut Vec<Fault>) {
    let mut buf = vec![0f32; STEP as usize];
    for (i, t) in b.tensors().entries().iter().enumerate() {
        if !t.is_available() {
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
        }
        if bad > 0 {
            faults.push(Fault {
                tensor: Some(t.name.dot.clone()),
                message: format!("{bad} decoded values are NaN or infinite"),
            });
        }
    }
}

/// Compare every tensor `enc` carries with `dense`'s.
fn compare(enc: &dyn Backend, dense: &dyn Backend, faults: &mut Vec<Fault>) -> Vec<(String, Sums)> {
    let mut out = Vec::new();
    let (mut a, mut b) = (vec![0f32; STEP as usize], vec![0f32; STEP as usize]);
    for (i, t) in enc.tensors().entries().iter().enumerate() {
        if !t.is_available() {
            continue;
        }
        let Ok(j) = dense.find(&t.name.dot) else {
            faults.push(Fault {
                tensor: Some(t.name.dot.clone()),
                message: "not in the dense file".into(),
            });
            continue;
        };
        let d = &dense.tensors().entries()[j];
        if d.shape != t.shape {
            faults.push(Fault {
                tensor: Some(t.name.dot.clone()),
                message: format!("shape {:?} here, {:?} in the dense file", t.shape, d.shape),
            });
            continue;
        }
        let mut s = Sums {
            stored_bits: t.stored_bytes as f64 * 8.0,
            n: t.n_elements,
            ..Sums::default()
        };
        let mut at = 0u64;
        let mut ok = true;
        while at < t.n_elements {
            let n = STEP.min(t.n_elements - at) as usize;
            if let Err(e) = enc
                .read_f32(i, at, &mut a[..n])
                .and_then(|()| dense.read_f32(j, at, &mut b[..n]))
            {
                faults.push(Fault {
                    tensor: Some(t.name.dot.clone()),
                    message: e.to_string(),
                });
                ok = false;
                break;
            }
            for (&x, &y) in a[..n].iter().zip(&b[..n]) {
                let (x, y) = (f64::from(x), f64::from(y));
                s.err2 += (x - y) * (x - y);
                s.ref2 += y * y;
                s.enc2 += x * x;
                s.dot += x * y;
            }
            at += n as u64;
        }
        if ok {
            out.push((t.name.dot.clone(), s));
        }
    }
    out
}

/// Verify `encoded` (structure), and against `dense` when given.
pub fn verify(encoded: &Path, dense: Option<&Path>) -> Result<Report> {
    let mut faults = Vec::new();
    let enc = match backend::open_single(encoded, Role::Primary) {
        Ok(b) => b,
        Err(e) => {
            // A header fault: report it as the structural verdict.
            return Ok(Report {
                path: encoded.display().to_string(),
                format: "?".into(),
                faults: vec![Fault {
                    tensor: e.tensor_name().map(str::to_string),
                    message: e.to_string(),
                }],
                tensors: Vec::new(),
                dense: dense.map(|d| d.display().to_string()),
            });
        }
    };
    check_tensors(enc.as_ref(), &mut faults);
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
            compare(enc.as_ref(), db.as_ref(), &mut faults)
        }
        None => Vec::new(),
    };
    Ok(Report {
        path: encoded.display().to_string(),
        format: format!("{} v{}", enc.summary().format, enc.summary().version),
        faults,
        tensors,
        dense: dense.map(|d| d.display().to_string()),
    })
}

/// Error for a failed verification (exit status 1 in the CLI).
pub fn faults_error(r: &Report) -> Error {
    err(
        ErrorKind::BadValue,
        format!("{} structural fault(s) in {}", r.faults.len(), r.path),
    )
}
