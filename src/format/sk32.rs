//! SK32 sketches: rank-r factors U·diag(σ)·Vᵀ, each quantized to u8, in a
//! `KNOT` v1 container whose meta JSON has a `sketches` map.
//!
//! Per sketch, at `payload_base + offset`:
//! `u_q8 [d_out × rank]` row-major, `sigma_q8 [rank]`, `v_q8 [rank × d_in]`
//! row-major (this is Vᵀ). Dequantization:
//! `U = ((u - 128) / 127) · u_max`, `σ = (s / 255) · sigma_max`,
//! `Vᵀ = ((v - 128) / 127) · v_max`; served `W = U · diag(σ) · Vᵀ`,
//! row-major f32 `[d_out, d_in]`.

use std::io::Write;

use serde::de::MapAccess;
use serde_json::{Map, Value, json};

use crate::error::{Error, ErrorKind, Result, add, err, mul};
use crate::format::checksum::{self, ChunkHasher, ChunkSums};
use crate::format::container::{self, KnotContainer, TableEntry};
use crate::format::json::{Field, required, skip_value};
use crate::source::SourceFile;

/// One sketch's index entry, validated.
#[derive(Debug, Clone)]
pub struct SketchInfo {
    /// Name as stored in the file.
    pub name: String,
    pub d_out: u64,
    pub d_in: u64,
    pub rank: u64,
    pub u_max: f32,
    pub sigma_max: f32,
    pub v_max: f32,
    /// Absolute file offset of `u_q8`.
    pub offset: u64,
    pub length: u64,
    /// CRC-32 per chunk of the sketch's bytes, in a checked file.
    pub sums: Option<ChunkSums>,
}

impl SketchInfo {
    pub fn u_offset(&self) -> u64 {
        self.offset
    }
    /// Absolute offset of `sigma_q8` (in range: validated at open).
    pub fn sigma_offset(&self) -> u64 {
        self.offset + self.d_out * self.rank
    }
    /// Absolute offset of `v_q8`.
    pub fn v_offset(&self) -> u64 {
        self.sigma_offset() + self.rank
    }
}

/// A parsed SK32 file.
#[derive(Debug, Clone)]
pub struct Sk32File {
    pub topology: Option<String>,
    pub payload_base: u64,
    /// The file carries checksums (a KSUM record and one `crc32` per sketch).
    pub checked: bool,
    /// Sorted by offset.
    pub sketches: Vec<SketchInfo>,
}

/// Bytes of one sketch: `d_out*rank + rank + rank*d_in`, checked.
pub fn sketch_len(d_out: u64, d_in: u64, rank: u64) -> Result<u64> {
    let u = mul(d_out, rank, "sketch U size")?;
    let v = mul(rank, d_in, "sketch V size")?;
    add(add(u, rank, "sketch size")?, v, "sketch size")
}

/// A sketch entry as written, before validation.
#[derive(Default)]
struct RawSketch {
    d_out: Option<u64>,
    d_in: Option<u64>,
    rank: Option<u64>,
    offset: Option<u64>,
    length: Option<u64>,
    u_max: Option<f64>,
    sigma_max: Option<f64>,
    v_max: Option<f64>,
    crc32: Option<(u64, Vec<u64>)>,
}

impl TableEntry for RawSketch {
    fn read_field<'de, A: MapAccess<'de>>(
        &mut self,
        f: Field<'_>,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match f.key {
            "d_out" => self.d_out = Some(f.read_u64(map)?),
            "d_in" => self.d_in = Some(f.read_u64(map)?),
            "rank" => self.rank = Some(f.read_u64(map)?),
            "offset" => self.offset = Some(f.read_u64(map)?),
            "length" => self.length = Some(f.read_u64(map)?),
            "u_max" => self.u_max = Some(f.read_f64(map)?),
            "sigma_max" => self.sigma_max = Some(f.read_f64(map)?),
            "v_max" => self.v_max = Some(f.read_f64(map)?),
            "crc32" => self.crc32 = Some(checksum::read_chunk_sums(f, map)?),
            _ => skip_value(map)?,
        }
        Ok(())
    }
}

/// A float field that must be finite and representable as f32.
fn finite_f32(x: Option<f64>, ctx: &str, key: &str) -> Result<f32> {
    let x = required(x, ctx, key)?;
    let f = x as f32;
    if !f.is_finite() {
        return Err(err(
            ErrorKind::NonFinite,
            format!("{ctx}: field \"{key}\" = {x:?} is not a finite f32"),
        ));
    }
    Ok(f)
}

impl Sk32File {
    /// Index the sketches of a container already identified as SK32.
    pub fn from_container(src: &SourceFile, c: &KnotContainer) -> Result<Sk32File> {
        let path = src.path();
        let at = container::KNOT_PREFIX_LEN;
        let wrap = |e: Error| e.path(path).at(at);
        if let Some(f) = &c.meta.format
            && f != "sk32"
        {
            return Err(wrap(err(
                ErrorKind::BadValue,
                format!("meta has a \"sketches\" map but \"format\": {f:?} (want \"sk32\")"),
            )));
        }
        let topology = c.meta.topology.clone();
        let entries: Vec<(String, RawSketch)> =
            container::read_table(c, c.meta.sketches.as_ref(), "sketches", "sketch")
                .map_err(|e| e.path(path))?;
        let mut sketches = Vec::with_capacity(entries.len());
        for (name, mut r) in entries {
            let ctx = format!("sketch {name:?}");
            let mut parse = || -> Result<SketchInfo> {
                let d_out = required(r.d_out, &ctx, "d_out")?;
                let d_in = required(r.d_in, &ctx, "d_in")?;
                let rank = required(r.rank, &ctx, "rank")?;
                let offset = required(r.offset, &ctx, "offset")?;
                let length = required(r.length, &ctx, "length")?;
                let u_max = finite_f32(r.u_max, &ctx, "u_max")?;
                let sigma_max = finite_f32(r.sigma_max, &ctx, "sigma_max")?;
                let v_max = finite_f32(r.v_max, &ctx, "v_max")?;
                if d_out == 0 || d_in == 0 {
                    return Err(err(
                        ErrorKind::BadShape,
                        format!("d_out {d_out} x d_in {d_in} is empty"),
                    ));
                }
                // The served f32 bytes (d_out * d_in * 4) must fit u64 too.
                mul(mul(d_out, d_in, "d_out * d_in")?, 4, "served size in bytes")?;
                if rank == 0 || rank > d_out.min(d_in) {
                    return Err(err(
                        ErrorKind::BadRank,
                        format!("rank {rank} must be in 1..=min(d_out {d_out}, d_in {d_in})"),
                    ));
                }
                for (k, x) in [("u_max", u_max), ("sigma_max", sigma_max), ("v_max", v_max)] {
                    if x < 0.0 {
                        return Err(err(ErrorKind::BadValue, format!("{k} {x} is negative")));
                    }
                }
                let want = sketch_len(d_out, d_in, rank)?;
                if length != want {
                    return Err(err(
                        ErrorKind::LengthMismatch,
                        format!(
                            "length {length} != d_out*rank + rank + rank*d_in = {want} \
                             (d_out {d_out}, d_in {d_in}, rank {rank})"
                        ),
                    ));
                }
                let abs = c.payload_range(src, offset, length, "sketch")?;
                let sums =
                    checksum::entry_sums(r.crc32.take(), c.ksum.is_some(), length, "the sketch")?;
                Ok(SketchInfo {
                    name: name.clone(),
                    d_out,
                    d_in,
                    rank,
                    u_max,
                    sigma_max,
                    v_max,
                    offset: abs,
                    length,
                    sums,
                })
            };
            sketches.push(parse().map_err(|e| e.tensor(&name).path(path).at(at))?);
        }
        sketches.sort_by(|a, b| a.offset.cmp(&b.offset).then(a.name.cmp(&b.name)));
        for w in sketches.windows(2) {
            if w[0].offset + w[0].length > w[1].offset {
                return Err(err(
                    ErrorKind::BadValue,
                    format!(
                        "sketches {:?} and {:?} overlap in the payload",
                        w[0].name, w[1].name
                    ),
                )
                .path(path)
                .tensor(&w[1].name)
                .at(w[1].offset));
            }
        }
        Ok(Sk32File {
            topology,
            payload_base: c.payload_base,
            checked: c.ksum.is_some(),
            sketches,
        })
    }
}

/// Dequantize one u8 factor code of U or Vᵀ: `((q - 128) / 127) · max`.
#[inline]
pub fn dequant_uv(q: u8, max: f32) -> f32 {
    ((f32::from(q) - 128.0) / 127.0) * max
}

/// Dequantize one σ code: `(s / 255) · sigma_max`.
#[inline]
pub fn dequant_sigma(q: u8, sigma_max: f32) -> f32 {
    (f32::from(q) / 255.0) * sigma_max
}

/// One sketch, quantized, ready to write.
#[derive(Debug, Clone)]
pub struct Sketch {
    pub name: String,
    pub d_out: u64,
    pub d_in: u64,
    pub rank: u64,
    pub u_max: f32,
    pub sigma_max: f32,
    pub v_max: f32,
    /// `[d_out × rank]` row-major.
    pub u_q8: Vec<u8>,
    /// `[rank]`.
    pub sigma_q8: Vec<u8>,
    /// `[rank × d_in]` row-major (Vᵀ).
    pub v_q8: Vec<u8>,
}

impl Sketch {
    /// Quantize float factors with max-abs scales: `u = round(U/u_max·127)+128`
    /// (clamped to 1..=255), `s = round(σ/σ_max·255)`. `u` is `[d_out × rank]`,
    /// `vt` is `[rank × d_in]`.
    pub fn quantize(
        name: &str,
        d_out: usize,
        d_in: usize,
        u: &[f32],
        sigma: &[f32],
        vt: &[f32],
    ) -> Sketch {
        let rank = sigma.len();
        let max_abs = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let u_max = max_abs(u);
        let v_max = max_abs(vt);
        let sigma_max = max_abs(sigma);
        let q_uv = |x: f32, m: f32| -> u8 {
            if m == 0.0 {
                128
            } else {
                ((x / m * 127.0).round() + 128.0).clamp(1.0, 255.0) as u8
            }
        };
        let q_s = |x: f32| -> u8 {
            if sigma_max == 0.0 {
                0
            } else {
                (x.abs() / sigma_max * 255.0).round().clamp(0.0, 255.0) as u8
            }
        };
        Sketch {
            name: name.to_string(),
            d_out: d_out as u64,
            d_in: d_in as u64,
            rank: rank as u64,
            u_max,
            sigma_max,
            v_max,
            u_q8: u.iter().map(|&x| q_uv(x, u_max)).collect(),
            sigma_q8: sigma.iter().map(|&x| q_s(x)).collect(),
            v_q8: vt.iter().map(|&x| q_uv(x, v_max)).collect(),
        }
    }
}

/// Write an SK32 file: container header, then each sketch's bytes in order.
pub fn write_sk32<W: Write>(w: &mut W, topology: &str, sketches: &[Sketch]) -> Result<()> {
    for s in sketches {
        if s.u_q8.len() as u64 != s.d_out * s.rank
            || s.sigma_q8.len() as u64 != s.rank
            || s.v_q8.len() as u64 != s.rank * s.d_in
        {
            return Err(err(
                ErrorKind::LengthMismatch,
                "sketch factor lengths disagree with d_out/d_in/rank",
            )
            .tensor(&s.name));
        }
    }
    let heads: Vec<SketchHead> = sketches.iter().map(Sketch::head).collect();
    write_sk32_with(w, topology, &heads, |w| {
        let io = |e: std::io::Error| err(ErrorKind::Io, format!("write: {e}"));
        for s in sketches {
            w.write_all(&s.u_q8).map_err(io)?;
            w.write_all(&s.sigma_q8).map_err(io)?;
            w.write_all(&s.v_q8).map_err(io)?;
        }
        Ok(())
    })
}

/// A sketch's header entry: everything but its factor bytes.
#[derive(Debug, Clone)]
pub struct SketchHead {
    pub name: String,
    pub d_out: u64,
    pub d_in: u64,
    pub rank: u64,
    pub u_max: f32,
    pub sigma_max: f32,
    pub v_max: f32,
    /// CRC-32s of the factor bytes (`u`, `σ`, `v`) in chunks.
    pub sums: ChunkSums,
}

impl Sketch {
    pub fn head(&self) -> SketchHead {
        let mut h = ChunkHasher::new(checksum::WRITE_CHUNK);
        h.update(&self.u_q8);
        h.update(&self.sigma_q8);
        h.update(&self.v_q8);
        SketchHead {
            name: self.name.clone(),
            d_out: self.d_out,
            d_in: self.d_in,
            rank: self.rank,
            u_max: self.u_max,
            sigma_max: self.sigma_max,
            v_max: self.v_max,
            sums: h.finish(),
        }
    }
}

/// Write an SK32 file whose payload `write_payload` supplies: the factors
/// of every sketch of `heads`, in that order (`u`, `σ`, `v` each), exactly
/// the bytes their shapes and ranks imply. Lets an encoder stream the
/// factors to a scratch file as it makes them and keep only the heads.
pub fn write_sk32_with<W: Write>(
    w: &mut W,
    topology: &str,
    heads: &[SketchHead],
    write_payload: impl FnOnce(&mut W) -> Result<()>,
) -> Result<()> {
    let mut map = Map::new();
    let mut offset = 0u64;
    for s in heads {
        let length = sketch_len(s.d_out, s.d_in, s.rank)?;
        map.insert(
            s.name.clone(),
            json!({
                "offset": offset, "length": length,
                "d_out": s.d_out, "d_in": s.d_in, "rank": s.rank,
                "u_max": s.u_max, "sigma_max": s.sigma_max, "v_max": s.v_max,
                "crc32": s.sums.to_json(),
            }),
        );
        offset = add(offset, length, "payload size")?;
    }
    let meta = json!({"format": "sk32", "topology": topology, "sketches": Value::Object(map)});
    let (_, header_crc) = container::write_container_header_crc(w, &meta)?;
    write_payload(w)?;
    // The KSUM record closes the file (docs/FORMAT.md section 12).
    w.write_all(&checksum::ksum_record(header_crc))
        .map_err(|e| err(ErrorKind::Io, format!("write: {e}")))
}
