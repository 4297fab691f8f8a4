//! The float dtype of the mount's main safetensors views
//! (`model.safetensors`, `hf/model.safetensors`, and so `hf/config.json`'s
//! `torch_dtype`), and whether a view in a given element format holds
//! every tensor's values exactly.
//!
//! `-o hf_dtype=auto` (the default) serves a source in its own precision:
//! the half type (F16 or BF16) that stores the largest share of the
//! matrices' bytes, when every served tensor's values are exact in it;
//! otherwise F32, which holds every decoded value exactly. A tensor is
//! exact in a format when it is stored in it (or in a float type it
//! widens from: the 8-bit floats), or, for a small float tensor (a norm
//! llama.cpp keeps F32 in an F16 GGUF), when each of its values converts
//! there and back unchanged: checked at mount, at most
//! [`VALUE_CHECK_ELEMS`] elements per tensor, [`VALUE_CHECK_BUDGET`] in
//! all. `-o hf_dtype=f32|f16|bf16` fixes the format; a view that rounds
//! then says so (index.json, ctl, the log).

use half::{bf16, f16};

use super::elem::ElemFormat;
use super::files::{TensorFile, ViewFile};
use super::views::ModelView;
use crate::backend::{Backend, StoredType, TensorInfo};
use crate::format::rknot::LosslessFloat;
use crate::quant::GgmlType;

/// Largest tensor whose values are checked at mount (a norm or bias).
pub const VALUE_CHECK_ELEMS: u64 = 1 << 20;
/// Most elements checked at mount in all.
pub const VALUE_CHECK_BUDGET: u64 = 16 << 20;
/// Elements read per call while checking.
const CHECK_BATCH: usize = 1 << 16;

/// `-o hf_dtype=`: the main safetensors views' dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HfDtype {
    /// The source's own precision where it is exact, else F32.
    #[default]
    Auto,
    Fixed(ElemFormat),
}

impl HfDtype {
    /// `auto`, `f32`, `f16` or `bf16`.
    pub fn parse(s: &str) -> Result<HfDtype, String> {
        match s {
            "auto" => Ok(HfDtype::Auto),
            _ => ElemFormat::from_ext(s)
                .map(HfDtype::Fixed)
                .ok_or_else(|| format!("{s:?} is not a dtype (auto, f32, f16, bf16)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HfDtype::Auto => "auto",
            HfDtype::Fixed(f) => f.ext(),
        }
    }
}

/// The format a safetensors view named for `named` is served in: the
/// unsuffixed `model.safetensors` and `hf/model.safetensors` (the views
/// named F32 in [`super::views::ModelView`]) in the mount's `main` dtype,
/// the suffixed ones (`--views`) in their own.
pub fn served_format(named: ElemFormat, main: ElemFormat) -> ElemFormat {
    if named == ElemFormat::F32 {
        main
    } else {
        named
    }
}

/// What the mount serves its main safetensors views in, and which tensor
/// files each format holds exactly.
#[derive(Debug, Clone)]
pub struct Precision {
    /// The format of `model.safetensors` and `hf/model.safetensors`.
    pub main: ElemFormat,
    /// How `main` was chosen, for index.json and the log.
    pub reason: String,
    /// Per tensor file, per format ordinal: its values are exact there.
    exact: Vec<[bool; 3]>,
    /// Per tensor file, its stored type (for the notes).
    stored: Vec<String>,
}

impl Precision {
    /// Decide for the served `files` of `b`, as `option` asks. `also`:
    /// the other formats views are built in (`--views`), whose exactness
    /// the notes report too. `check_values`: whether small float tensors
    /// may be read at mount to see whether their values fit a half type
    /// (false under a manifest: a read there is checked, or held until the
    /// background check of a plain SHA256SUMS ends, before the mount
    /// answers; such tensors then count as not exact).
    pub(super) fn decide(
        b: &dyn Backend,
        files: &[TensorFile],
        option: HfDtype,
        also: &[ElemFormat],
        check_values: bool,
    ) -> Precision {
        let entries = b.tensors().entries();
        let infos: Vec<&TensorInfo> = files.iter().map(|f| &entries[f.index]).collect();
        let candidate = match option {
            HfDtype::Fixed(f) => Some(f),
            HfDtype::Auto => half_share(&infos),
        };
        let mut wanted: Vec<ElemFormat> = also.to_vec();
        wanted.extend(candidate);
        let mut budget = VALUE_CHECK_BUDGET;
        let mut exact = Vec::with_capacity(infos.len());
        for (f, info) in infos.iter().enumerate() {
            let mut e = [true, false, false];
            let mut need_values = false;
            for fmt in [ElemFormat::F16, ElemFormat::Bf16] {
                if !wanted.contains(&fmt) {
                    continue;
                }
                if stored_exact_in(&info.stored, fmt) {
                    e[fmt.ordinal() as usize] = true;
                } else {
                    need_values = true;
                }
            }
            let checkable = check_values
                && is_float(&info.stored)
                && info.n_elements <= VALUE_CHECK_ELEMS.min(budget);
            if need_values && checkable {
                budget -= info.n_elements;
                if let Some((in_f16, in_bf16)) = values_fit(b, files[f].index, info.n_elements) {
                    e[1] |= in_f16;
                    e[2] |= in_bf16;
                }
            }
            exact.push(e);
        }
        let stored = infos.iter().map(|i| i.stored.to_string()).collect();
        let all_exact = |fmt: ElemFormat| exact.iter().all(|e| e[fmt.ordinal() as usize]);
        let (main, reason) = match (option, candidate) {
            (HfDtype::Fixed(f), _) => (f, format!("-o hf_dtype={}", f.ext())),
            (HfDtype::Auto, Some(h)) if all_exact(h) => (
                h,
                format!(
                    "auto: the matrices are mostly {}, and every tensor is exact in it",
                    h.dtype()
                ),
            ),
            (HfDtype::Auto, Some(h)) => (
                ElemFormat::F32,
                format!(
                    "auto: the matrices are mostly {} but not every tensor is exact in it, so F32",
                    h.dtype()
                ),
            ),
            (HfDtype::Auto, None) => (
                ElemFormat::F32,
                "auto: the matrices are not stored as F16/BF16, so F32 (exact)".to_string(),
            ),
        };
        Precision {
            main,
            reason,
            exact,
            stored,
        }
    }

    /// [`Precision::rounding`] of a built view (None for one not offered,
    /// and for `model.native.gguf`: its bytes are the stored ones).
    pub(super) fn rounding_of(&self, v: &ViewFile) -> Option<String> {
        match (&v.layout, v.view) {
            (Err(_), _) | (_, ModelView::NativeGguf) => None,
            (Ok(l), _) => self.rounding(l.fmt(), &v.tensor_files()),
        }
    }

    /// None when a view of tensor files `files` (indexes into the served
    /// tensors) in `fmt` holds every value exactly; else what it rounds,
    /// as a note.
    pub(super) fn rounding(&self, fmt: ElemFormat, files: &[usize]) -> Option<String> {
        let k = fmt.ordinal() as usize;
        let mut by_type: Vec<(&str, usize)> = Vec::new();
        let mut n = 0;
        for &f in files {
            if self.exact.get(f).is_some_and(|e| e[k]) {
                continue;
            }
            n += 1;
            let ty = self.stored.get(f).map_or("?", String::as_str);
            match by_type.iter_mut().find(|(t, _)| *t == ty) {
                Some((_, c)) => *c += 1,
                None => by_type.push((ty, 1)),
            }
        }
        (n > 0).then(|| {
            let mix = by_type
                .iter()
                .map(|(t, c)| format!("{t} x{c}"))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "not exact: {n} of {} tensors ({mix}) are rounded to nearest-even {} \
                 (-o hf_dtype=f32 serves them exactly)",
                files.len(),
                fmt.dtype()
            )
        })
    }
}

/// The half type storing the largest share of the matrices' bytes (2-D
/// and larger tensors), if any matrix is stored as F16 or BF16.
fn half_share(infos: &[&TensorInfo]) -> Option<ElemFormat> {
    let bytes = |ty: GgmlType| -> u64 {
        infos
            .iter()
            .filter(|i| i.shape.len() >= 2 && stored_float_type(&i.stored) == Some(ty))
            .map(|i| i.stored_bytes)
            .sum()
    };
    let (f16s, bf16s) = (bytes(GgmlType::F16), bytes(GgmlType::Bf16));
    match (f16s, bf16s) {
        (0, 0) => None,
        (a, b) if b >= a => Some(ElemFormat::Bf16),
        _ => Some(ElemFormat::F16),
    }
}

/// Whether every value of a tensor stored as `stored` is exact in `fmt`
/// by its type alone.
fn stored_exact_in(stored: &StoredType, fmt: ElemFormat) -> bool {
    let Some(ty) = stored_float_type(stored) else {
        return fmt == ElemFormat::F32;
    };
    match fmt {
        ElemFormat::F32 => true,
        // The 8-bit floats' exponents and mantissas fit both halves.
        ElemFormat::F16 => matches!(ty, GgmlType::F16 | GgmlType::F8E4M3 | GgmlType::F8E5M2),
        ElemFormat::Bf16 => matches!(ty, GgmlType::Bf16 | GgmlType::F8E4M3 | GgmlType::F8E5M2),
    }
}

fn is_float(stored: &StoredType) -> bool {
    matches!(
        stored_float_type(stored),
        Some(GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::F64)
    )
}

/// The ggml type whose values a tensor holds exactly as stored: its own
/// for ggml blocks; for a .rknot's lossless blocks the float type they
/// code (a lossless encode of a bf16 checkpoint is a bf16 source); None
/// for the lossy codes.
fn stored_float_type(stored: &StoredType) -> Option<GgmlType> {
    match stored {
        StoredType::Ggml(ty) => Some(*ty),
        StoredType::RknotLossless(float) => Some(match float {
            LosslessFloat::Bf16 => GgmlType::Bf16,
            LosslessFloat::F16 => GgmlType::F16,
            LosslessFloat::F32 => GgmlType::F32,
        }),
        _ => None,
    }
}

/// Whether each decoded value of tensor `index` converts to f16 / bf16
/// and back unchanged (NaNs count as exact: both types have them). None
/// when it cannot be read (then it counts as rounding).
fn values_fit(b: &dyn Backend, index: usize, n: u64) -> Option<(bool, bool)> {
    let mut buf = vec![0f32; (n as usize).min(CHECK_BATCH)];
    let (mut in_f16, mut in_bf16) = (true, true);
    let mut at = 0u64;
    while at < n && (in_f16 || in_bf16) {
        let take = ((n - at) as usize).min(buf.len());
        let vals = &mut buf[..take];
        if let Err(e) = b.read_f32(index, at, vals) {
            log::debug!("checking values for the views' dtype: {e}");
            return None;
        }
        for &x in vals.iter() {
            if x.is_nan() {
                continue;
            }
            in_f16 &= f16::from_f32(x).to_f32().to_bits() == x.to_bits();
            in_bf16 &= bf16::from_f32(x).to_f32().to_bits() == x.to_bits();
        }
        at += take as u64;
    }
    Some((in_f16, in_bf16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_parses_its_four_values_and_names_a_bad_one() {
        assert_eq!(HfDtype::parse("auto"), Ok(HfDtype::Auto));
        assert_eq!(HfDtype::parse("bf16"), Ok(HfDtype::Fixed(ElemFormat::Bf16)));
        assert_eq!(HfDtype::parse("f16"), Ok(HfDtype::Fixed(ElemFormat::F16)));
        assert_eq!(HfDtype::parse("f32"), Ok(HfDtype::Fixed(ElemFormat::F32)));
        let e = HfDtype::parse("fp16").unwrap_err();
        assert!(e.contains("\"fp16\"") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn types_are_exact_only_where_their_values_fit() {
        let g = StoredType::Ggml;
        assert!(stored_exact_in(&g(GgmlType::Bf16), ElemFormat::Bf16));
        assert!(!stored_exact_in(&g(GgmlType::Bf16), ElemFormat::F16));
        assert!(!stored_exact_in(&g(GgmlType::F16), ElemFormat::Bf16));
        assert!(!stored_exact_in(&g(GgmlType::F32), ElemFormat::F16));
        assert!(!stored_exact_in(&g(GgmlType::Q4K), ElemFormat::Bf16));
        assert!(stored_exact_in(&g(GgmlType::Q4K), ElemFormat::F32));
        let rk = StoredType::Rknot {
            graded: false,
            bits: 4,
        };
        assert!(stored_exact_in(&rk, ElemFormat::F32));
        assert!(!stored_exact_in(&rk, ElemFormat::Bf16));
        // Lossless blocks hold their float type's values exactly.
        let lossless = StoredType::RknotLossless;
        assert!(stored_exact_in(
            &lossless(LosslessFloat::Bf16),
            ElemFormat::Bf16
        ));
        assert!(!stored_exact_in(
            &lossless(LosslessFloat::Bf16),
            ElemFormat::F16
        ));
        assert!(stored_exact_in(
            &lossless(LosslessFloat::F16),
            ElemFormat::F16
        ));
        assert!(!stored_exact_in(
            &lossless(LosslessFloat::F32),
            ElemFormat::Bf16
        ));
        assert!(is_float(&lossless(LosslessFloat::F32)));
    }
}
