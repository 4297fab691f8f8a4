//! Writing .rknot files: [`RknotWriter`] streams version 3 (blocks as they
//! are made, then index, header and footer), [`write_rknot`] writes layers
//! held in memory, [`write_rknot_v2`] the previous layout for the tests of
//! old files. What goes into each block is the codecs' (`codec`).

use std::io::Write;

use serde_json::{Value, json};

use super::{
    ArchMeta, Coding, LengthCode, MAX_HEADER_LEN, MAX_HEADER_LEN_V3, MAX_INDEX_LEN, Manifest,
    RKNOT_MAGIC_V2, RKNOT_MAGIC_V3, RKNOT_V3_END_MAGIC, RKNOT_V3_FOOTER_LEN, RKNOT_VERSION,
    TileGrid,
};
use crate::error::{ErrorKind, Result, add, err};
use crate::format::checksum;
use crate::format::knot;
use crate::quant::GgmlType;

/// Layout of one tensor to write.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub d_out: u64,
    pub d_in: u64,
    pub restrict_rows: bool,
    pub restrict_cols: bool,
    pub coding: Coding,
    pub block_rows: u64,
    pub block_cols: u64,
}

/// A layer to write.
#[derive(Debug, Clone)]
pub struct LayerOut {
    pub index: u64,
    pub manifest: Manifest,
    /// Each tensor with its blocks' payloads in block order.
    pub tensors: Vec<(TensorSpec, Vec<Vec<u8>>)>,
}

impl TensorSpec {
    pub fn grid(&self, manifest: &Manifest) -> TileGrid {
        TileGrid {
            compact_rows: if self.restrict_rows {
                manifest.k()
            } else {
                self.d_out
            },
            compact_cols: if self.restrict_cols {
                manifest.k()
            } else {
                self.d_in
            },
            block_rows: self.block_rows,
            block_cols: self.block_cols,
        }
    }

    /// The compact matrix of a dense `[d_out, d_in]` row-major tensor.
    pub fn compact(&self, manifest: &Manifest, dense: &[f32]) -> Vec<f32> {
        let rows: Vec<u64> = if self.restrict_rows {
            manifest.standing_indices.clone()
        } else {
            (0..self.d_out).collect()
        };
        let cols: Vec<u64> = if self.restrict_cols {
            manifest.standing_indices.clone()
        } else {
            (0..self.d_in).collect()
        };
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for &r in &rows {
            let row = &dense[(r * self.d_in) as usize..((r + 1) * self.d_in) as usize];
            out.extend(cols.iter().map(|&c| row[c as usize]));
        }
        out
    }

    /// Encode a dense tensor into block payloads with its codec's reference
    /// quantizer ([`super::quantize_tile`]; affine: [`super::quantize_affine_tile`]).
    pub fn encode(&self, manifest: &Manifest, dense: &[f32]) -> Vec<Vec<u8>> {
        let grid = self.grid(manifest);
        let compact = self.compact(manifest, dense);
        (0..grid.n_blocks())
            .map(|b| {
                let tile = grid.tile(b);
                let mut vals = Vec::with_capacity((tile.rows * tile.cols) as usize);
                for r in tile.row0..tile.row0 + tile.rows {
                    let start = (r * grid.compact_cols + tile.col0) as usize;
                    vals.extend_from_slice(&compact[start..start + tile.cols as usize]);
                }
                self.coding
                    .mode()
                    .codec()
                    .encode_tile(&self.coding, &tile, &vals)
            })
            .collect()
    }
}

/// A tensor's header entry, with `located` (where its blocks are) after
/// `block_shape`: the key order version 2's writer had.
fn tensor_json(spec: &TensorSpec, located: Vec<(&str, Value)>) -> Value {
    let mut axes = Vec::new();
    if spec.restrict_rows {
        axes.push("rows");
    }
    if spec.restrict_cols {
        axes.push("cols");
    }
    let mut t = json!({
        "name": spec.name,
        "shape": [spec.d_out, spec.d_in],
        "restricted_axes": axes,
        "block_shape": [spec.block_rows, spec.block_cols],
    });
    for (k, v) in located {
        t[k] = v;
    }
    t["mode"] = json!(spec.coding.mode().name());
    t["bits"] = json!(spec.coding.bits());
    if let Coding::Graded { line_axis, .. } = &spec.coding {
        t["line_axis"] = json!(line_axis.name());
    }
    t
}

fn header_json(
    arch: &ArchMeta,
    version: u64,
    layers: Vec<Value>,
    dense_tensors: Option<Value>,
) -> Result<Vec<u8>> {
    let mut header = json!({
        "format": "rknot",
        "version": version,
        "arch_meta": {
            "arch": arch.arch, "hidden_dim": arch.hidden_dim, "num_layers": arch.num_layers,
            "metadata": arch.metadata.to_json(),
        },
        "layers": layers,
    });
    if let Some(d) = dense_tensors {
        header["dense_tensors"] = d;
    }
    serde_json::to_vec(&header)
        .map_err(|e| err(ErrorKind::BadJson, format!("cannot serialize header: {e}")))
}

fn write_err(e: std::io::Error) -> crate::Error {
    err(ErrorKind::Io, format!("write: {e}"))
}

/// Writes a version-3 .rknot as a stream: each tensor's blocks go out as
/// they are made; the block index and the header follow the last tensor,
/// and the footer says where they are. Memory: the index (a few bits per
/// block), the header, and one `u32` per block of the tensor being written.
pub struct RknotWriter<W: Write> {
    w: W,
    /// Bytes of body written so far (block offsets are relative to the
    /// body, which starts at byte 8).
    body_len: u64,
    index: Vec<u8>,
    /// Layer index, manifest, tensor entries.
    layers: Vec<(u64, Manifest, Vec<Value>)>,
    /// `dense_tensors` entries, in the order written.
    dense: serde_json::Map<String, Value>,
}

impl<W: Write> RknotWriter<W> {
    /// Start a file: writes the 8-byte prefix.
    pub fn new(mut w: W) -> Result<RknotWriter<W>> {
        w.write_all(RKNOT_MAGIC_V3).map_err(write_err)?;
        w.write_all(&[0, 0]).map_err(write_err)?;
        Ok(RknotWriter {
            w,
            body_len: 0,
            index: Vec::new(),
            layers: Vec::new(),
            dense: serde_json::Map::new(),
        })
    }

    /// Write a tensor stored as ggml blocks of type `ty`, shape outer-first
    /// as a dense .knot's: `fill(offset, buf)` supplies its bytes (verbatim
    /// ggml blocks) from byte `offset` of the tensor, in pieces of at most
    /// 4 MiB.
    pub fn dense_tensor(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[u64],
        mut fill: impl FnMut(u64, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        const PIECE: u64 = 4 << 20;
        if self.dense.contains_key(name) {
            return Err(err(ErrorKind::BadName, "written twice").tensor(name));
        }
        let n = knot::check_shape(shape, ty).map_err(|e| e.tensor(name))?;
        let length = ty.bytes_for(n).ok_or_else(|| {
            err(
                ErrorKind::Overflow,
                format!("byte size of {n} {ty} elements"),
            )
            .tensor(name)
        })?;
        let offset = self.body_len;
        let mut buf = vec![0u8; PIECE.min(length) as usize];
        let mut done = 0u64;
        let mut sums = checksum::ChunkHasher::new(checksum::WRITE_CHUNK);
        while done < length {
            let piece = &mut buf[..(length - done).min(PIECE) as usize];
            fill(done, piece)?;
            sums.update(piece);
            self.w.write_all(piece).map_err(write_err)?;
            done += piece.len() as u64;
        }
        self.body_len = add(self.body_len, length, "body size")?;
        self.dense.insert(
            name.to_string(),
            json!({"type": ty.name(), "shape": shape, "offset": offset, "length": length,
                   "crc32": sums.finish().to_json()}),
        );
        Ok(())
    }

    /// The tensors written next belong to layer `index`.
    pub fn begin_layer(&mut self, index: u64, manifest: Manifest) {
        self.layers.push((index, manifest, Vec::new()));
    }

    /// Write one tensor of the current layer: its blocks' payloads in block
    /// order, exactly as many as its tiling has.
    pub fn tensor<B: AsRef<[u8]>>(
        &mut self,
        spec: &TensorSpec,
        blocks: impl IntoIterator<Item = B>,
    ) -> Result<()> {
        let Some((_, manifest, entries)) = self.layers.last_mut() else {
            return Err(
                err(ErrorKind::BadValue, "a tensor before any layer was begun").tensor(&spec.name),
            );
        };
        let need = spec.grid(manifest).n_blocks();
        let offset = self.body_len;
        let mut lengths: Vec<u32> = Vec::new();
        let mut sums = checksum::GroupHasher::default();
        for b in blocks {
            let b = b.as_ref();
            let len = u32::try_from(b.len())
                .map_err(|_| err(ErrorKind::TooLarge, format!("a block of {} bytes", b.len())))?;
            lengths.push(len);
            sums.block(b);
            self.w.write_all(b).map_err(write_err)?;
            self.body_len = add(self.body_len, b.len() as u64, "body size")?;
        }
        if lengths.len() as u64 != need {
            return Err(err(
                ErrorKind::BadValue,
                format!("{} blocks for a grid of {need}", lengths.len()),
            )
            .tensor(&spec.name));
        }
        let mut code = LengthCode::for_lengths(&lengths);
        code.at = self.index.len() as u64;
        self.index.extend(code.pack(&lengths));
        let sums = sums.finish();
        let sums_at = self.index.len() as u64;
        self.index.extend(sums.to_le_bytes());
        entries.push(tensor_json(
            spec,
            vec![
                ("data", json!([offset, self.body_len - offset])),
                (
                    "block_lengths",
                    json!({"at": code.at, "base": code.base, "step": code.step, "bits": code.bits}),
                ),
                ("block_crc32", json!({"at": sums_at, "group": sums.group})),
            ],
        ));
        Ok(())
    }

    /// Write the block index, the header and the footer; returns the
    /// writer (flushed).
    pub fn finish(mut self, arch: &ArchMeta) -> Result<W> {
        let layers = std::mem::take(&mut self.layers)
            .into_iter()
            .map(|(index, m, tensors)| {
                json!({"index": index, "manifest": m.to_json(true), "tensors": tensors})
            })
            .collect();
        let dense = std::mem::take(&mut self.dense);
        let dense = (!dense.is_empty()).then_some(Value::Object(dense));
        let header = header_json(arch, RKNOT_VERSION, layers, dense)?;
        let (index_len, header_len) = (self.index.len() as u64, header.len() as u64);
        if header_len > MAX_HEADER_LEN_V3 || index_len > MAX_INDEX_LEN {
            return Err(err(
                ErrorKind::TooLarge,
                format!(
                    "header {header_len} bytes / block index {index_len} bytes: above the \
                     caps readers apply ({MAX_HEADER_LEN_V3} / {MAX_INDEX_LEN})"
                ),
            ));
        }
        let mut footer = Vec::with_capacity(RKNOT_V3_FOOTER_LEN as usize);
        footer.extend_from_slice(&index_len.to_le_bytes());
        footer.extend_from_slice(&header_len.to_le_bytes());
        footer.extend_from_slice(RKNOT_V3_END_MAGIC);
        // The KSUM record ends the body: a CRC-32 of everything that is not
        // body (docs/FORMAT.md section 12).
        let mut crc = crc32fast::Hasher::new();
        crc.update(RKNOT_MAGIC_V3);
        crc.update(&[0, 0]);
        crc.update(&self.index);
        crc.update(&header);
        crc.update(&footer);
        self.w
            .write_all(&checksum::ksum_record(crc.finalize()))
            .map_err(write_err)?;
        self.w.write_all(&self.index).map_err(write_err)?;
        self.w.write_all(&header).map_err(write_err)?;
        self.w.write_all(&footer).map_err(write_err)?;
        self.w.flush().map_err(write_err)?;
        Ok(self.w)
    }
}

/// Write a .rknot file (version 3) from layers held in memory. Blocks are
/// laid out in layer, tensor, block order.
pub fn write_rknot<W: Write>(w: &mut W, arch: &ArchMeta, layers: &[LayerOut]) -> Result<()> {
    let mut out = RknotWriter::new(w)?;
    for l in layers {
        out.begin_layer(l.index, l.manifest.clone());
        for (spec, blocks) in &l.tensors {
            out.tensor(spec, blocks)?;
        }
    }
    out.finish(arch)?;
    Ok(())
}

/// Write the previous layout, version 2 (every block listed in the JSON
/// header). Nothing writes it any more but tests: they check that files
/// made by earlier releases keep opening and serving the same bytes.
pub fn write_rknot_v2<W: Write>(w: &mut W, arch: &ArchMeta, layers: &[LayerOut]) -> Result<()> {
    let mut offset = 0u64;
    let mut layer_json = Vec::new();
    for l in layers {
        let mut tj = Vec::new();
        for (spec, blocks) in &l.tensors {
            let grid = spec.grid(&l.manifest);
            if blocks.len() as u64 != grid.n_blocks() {
                return Err(err(
                    ErrorKind::BadValue,
                    format!("{} blocks for a grid of {}", blocks.len(), grid.n_blocks()),
                )
                .tensor(&spec.name));
            }
            let mut table = Vec::with_capacity(blocks.len());
            for b in blocks {
                table.push(json!([offset, b.len()]));
                offset = add(offset, b.len() as u64, "body size")?;
            }
            tj.push(tensor_json(spec, vec![("blocks", json!(table))]));
        }
        layer_json
            .push(json!({"index": l.index, "manifest": l.manifest.to_json(false), "tensors": tj}));
    }
    let bytes = header_json(arch, 2, layer_json, None)?;
    let header_len = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| u64::from(n) <= MAX_HEADER_LEN)
        .ok_or_else(|| err(ErrorKind::TooLarge, "header JSON is too large"))?;
    w.write_all(RKNOT_MAGIC_V2).map_err(write_err)?;
    w.write_all(&header_len.to_le_bytes()).map_err(write_err)?;
    w.write_all(&bytes).map_err(write_err)?;
    for l in layers {
        for (_, blocks) in &l.tensors {
            for b in blocks {
                w.write_all(b).map_err(write_err)?;
            }
        }
    }
    Ok(())
}

impl Manifest {
    /// The manifest as header JSON: floats in their shortest f32 form
    /// (version 3) or widened to f64 as version 2's writer printed them.
    pub(super) fn to_json(&self, short_floats: bool) -> Value {
        let floats = |v: &[f32]| -> Value {
            if short_floats {
                Value::Array(short_f32s(v))
            } else {
                json!(v)
            }
        };
        json!({
            "d": self.d, "k": self.k(),
            "standing_indices": self.standing_indices,
            "amplitudes": floats(&self.amplitudes),
            "phase_alignment": floats(&self.phase_alignment),
        })
    }
}

/// f32 values as JSON numbers in their shortest form ("0.49652302", not the
/// f64 widening "0.49652302265167236"): about half the bytes of a
/// manifest. Readers parse a number as f64 and round it to f32; a value
/// for which that would not give it back (a double rounding) keeps its
/// exact f64 form.
fn short_f32s(values: &[f32]) -> Vec<Value> {
    values
        .iter()
        .map(|&x| {
            let short: Option<f64> = x.to_string().parse().ok();
            match short {
                Some(d) if d as f32 == x => json!(d),
                _ => json!(f64::from(x)),
            }
        })
        .collect()
}
