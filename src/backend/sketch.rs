//! SK32 backend: rows of W = U·diag(σ)·Vᵀ computed on demand.

use crate::backend::scratch;
use crate::backend::{
    Availability, Backend, Role, SourceSummary, StoredType, TensorInfo, TensorTable,
    entry_for_read, origin,
};
use crate::error::Result;
use crate::format::FileFormat;
use crate::format::meta::Metadata;
use crate::format::sk32::{Sk32File, SketchInfo, dequant_sigma, dequant_uv};
use crate::names::TensorName;
use crate::source::SourceFile;

pub struct SketchBackend {
    src: SourceFile,
    summary: SourceSummary,
    table: TensorTable,
    sketches: Vec<SketchInfo>,
}

/// Rows per granule: enough that one granule is a useful decode unit.
const GRANULE_TARGET_ELEMS: u64 = 64 * 1024;

impl SketchBackend {
    pub fn new(src: SourceFile, f: Sk32File, role: Role) -> Result<Self> {
        let org = origin(role, FileFormat::Sk32, src.path());
        let mut table = TensorTable::default();
        for s in &f.sketches {
            let name = TensorName::from_stored(&s.name).map_err(|e| e.path(src.path()))?;
            let rows_per_granule = (GRANULE_TARGET_ELEMS / s.d_in).max(1);
            let info = TensorInfo {
                name,
                shape: vec![s.d_out, s.d_in],
                n_elements: s.d_out * s.d_in,
                stored: StoredType::Sketch { rank: s.rank },
                stored_bytes: s.length,
                origin: org.clone(),
                availability: Availability::Available,
                granule: rows_per_granule * s.d_in,
            };
            table
                .push(info, &s.name)
                .map_err(|e| e.path(src.path()).at(s.offset))?;
        }
        let mut notes = vec![format!("{} sketches", f.sketches.len())];
        if let Some(t) = &f.topology {
            notes.push(format!("topology {t}"));
        }
        let summary = SourceSummary {
            checked: f.checked,
            format: FileFormat::Sk32,
            version: 1,
            path: src.path().to_path_buf(),
            metadata: Metadata::default(),
            notes,
        };
        Ok(SketchBackend {
            src,
            summary,
            table,
            sketches: f.sketches,
        })
    }
}

impl Backend for SketchBackend {
    fn summary(&self) -> &SourceSummary {
        &self.summary
    }

    fn tensors(&self) -> &TensorTable {
        &self.table
    }

    fn source_files(&self) -> Vec<&SourceFile> {
        vec![&self.src]
    }

    fn stored_ranges(&self, index: usize) -> Option<super::StoredRanges<'_>> {
        let s = self.sketches.get(index)?;
        Some(super::StoredRanges::one(&self.src, s.offset, s.length))
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let (info, s) = entry_for_read(&self.table, &self.sketches, index, first_elem, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        // All sizes below are bounded by the sketch length validated at open.
        let rank = s.rank as usize;
        let d_in = s.d_in;
        let end = first_elem + out.len() as u64;
        let row0 = first_elem / d_in;
        let row1 = end.div_ceil(d_in);
        // Served columns [lo, hi) of a row of the request.
        let cols = |row: u64| {
            let row_start = row * d_in;
            (
                first_elem.max(row_start) - row_start,
                end.min(row_start + d_in) - row_start,
            )
        };
        // Vᵀ is read whole if any row of the request is whole; otherwise
        // (at most two partial rows) each row reads only its columns of
        // each Vᵀ row, so a small read never pulls in all of Vᵀ.
        let v_whole = (row0..row1).any(|r| cols(r) == (0, d_in));
        let v_width = if v_whole {
            d_in
        } else {
            (row0..row1)
                .map(|r| cols(r).1 - cols(r).0)
                .max()
                .unwrap_or(0)
        };
        let u_len = ((row1 - row0) * s.rank) as usize;
        let v_len = rank * v_width as usize;
        // One reused buffer for U's rows, σ and Vᵀ: no allocation per read.
        scratch::with_bytes(u_len + rank + v_len, |bytes| {
            let (u, rest) = bytes.split_at_mut(u_len);
            let (sig, v) = rest.split_at_mut(rank);
            // Offsets relative to the sketch, read through its checksums
            // when the file has them.
            let read = |rel: u64, buf: &mut [u8]| {
                super::dense::read_stored_bytes(
                    &self.src,
                    s.offset,
                    s.sums.as_ref(),
                    rel,
                    buf,
                    &info.name.dot,
                )
            };
            let (sigma_rel, v_rel) = (s.sigma_offset() - s.offset, s.v_offset() - s.offset);
            read(row0 * s.rank, u)?;
            read(sigma_rel, sig)?;
            if v_whole {
                read(v_rel, v)?;
            }
            // W[i, j] = sum_r U[i,r] σ[r] Vᵀ[r,j], with Vᵀ[r,j] = (v - 128) · v_max/127:
            // fold U·σ·v_max/127 into one coefficient per (row, r) so the
            // inner loop over columns is a contiguous u8 -> f32 multiply-add.
            let v_step = s.v_max / 127.0;
            scratch::with_floats(2 * rank, |floats| {
                let (sigma, coef) = floats.split_at_mut(rank);
                for (d, &q) in sigma.iter_mut().zip(sig.iter()) {
                    *d = dequant_sigma(q, s.sigma_max);
                }
                let mut written = 0usize;
                for row in row0..row1 {
                    let (lo, hi) = cols(row);
                    let width = (hi - lo) as usize;
                    let urow = &u[((row - row0) * s.rank) as usize..][..rank];
                    for ((c, &uq), &sg) in coef.iter_mut().zip(urow).zip(sigma.iter()) {
                        *c = dequant_uv(uq, s.u_max) * sg * v_step;
                    }
                    // (bytes of Vᵀ, stride between Vᵀ rows, first column in them)
                    let (vt, stride, col0) = if v_whole {
                        (&v[..], d_in as usize, lo as usize)
                    } else {
                        let part = &mut v[..rank * width];
                        for (r, dst) in part.chunks_exact_mut(width).enumerate() {
                            read(v_rel + r as u64 * d_in + lo, dst)?;
                        }
                        (&v[..rank * width], width, 0)
                    };
                    row_product(&mut out[written..written + width], coef, vt, stride, col0);
                    written += width;
                }
                Ok(())
            })
        })
    }
}

/// `dst[j] = Σ_r coef[r] · (v[r·stride + col0 + j] - 128)`: one row of the
/// sketch product, a contiguous multiply-add over columns. Dispatches to an
/// AVX2 build of the same code when the CPU has it (twice the vector width);
/// the arithmetic, and so the result, is the same loop either way.
fn row_product(dst: &mut [f32], coef: &[f32], v: &[u8], stride: usize, col0: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { row_product_avx2(dst, coef, v, stride, col0) };
        }
    }
    row_product_generic(dst, coef, v, stride, col0);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_product_avx2(dst: &mut [f32], coef: &[f32], v: &[u8], stride: usize, col0: usize) {
    row_product_generic(dst, coef, v, stride, col0);
}

/// Four factor rows per pass over `dst`, so the accumulator is loaded and
/// stored a quarter as often as with one row per pass.
#[inline(always)]
fn row_product_generic(dst: &mut [f32], coef: &[f32], v: &[u8], stride: usize, col0: usize) {
    let width = dst.len();
    let row = |r: usize| &v[r * stride + col0..][..width];
    dst.fill(0.0);
    let mut r = 0;
    while r + 4 <= coef.len() {
        let (c0, c1, c2, c3) = (coef[r], coef[r + 1], coef[r + 2], coef[r + 3]);
        let (v0, v1, v2, v3) = (row(r), row(r + 1), row(r + 2), row(r + 3));
        for ((((d, &a), &b), &c), &e) in dst.iter_mut().zip(v0).zip(v1).zip(v2).zip(v3) {
            *d += c0 * (f32::from(a) - 128.0)
                + c1 * (f32::from(b) - 128.0)
                + c2 * (f32::from(c) - 128.0)
                + c3 * (f32::from(e) - 128.0);
        }
        r += 4;
    }
    for (k, &c) in coef.iter().enumerate().skip(r) {
        for (d, &a) in dst.iter_mut().zip(row(k)) {
            *d += c * (f32::from(a) - 128.0);
        }
    }
}
