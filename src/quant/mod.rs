//! ggml tensor types and their dequantization kernels.
//!
//! The kernels are bit-exact against the `gguf` Python package's
//! `gguf.quants.dequantize` (which follows ggml's reference C code): every
//! float operation is done in f32, in the same order, without fused
//! multiply-add. `tests/ggml_vectors.rs` checks them on committed vectors.
//!
//! Each family of types is a module (`float`, `legacy`, `kquants`,
//! `iquants` with its tables in `iq_grids`, `ternary`, `fp4`) whose
//! `KERNELS` table gives each type it decodes its kernel; [`dequantize`]
//! finds it through `FAMILIES`, so a new family is a new module and a line
//! there.

mod f8;
mod float;
mod fp4;
mod iq_grids;
mod iquants;
mod kquants;
mod legacy;
mod ternary;

pub use float::{bf16_bits_to_f32, f16_bits_to_f32};

/// Elements per super-block of the k-quants.
pub const QK_K: usize = 256;

/// Every tensor type a GGUF file can declare (ggml numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    Nvfp4,
    Q1_0,
    /// safetensors' `F8_E4M3` (no infinities, one NaN per sign): not a
    /// ggml type (see [`NON_GGML`]).
    F8E4M3,
    /// safetensors' `F8_E5M2` (the high byte of an f16): not a ggml type.
    F8E5M2,
}

/// (type, ggml id, lower-case name, elements per block, bytes per block)
const TYPES: &[(GgmlType, u32, &str, u64, u64)] = &[
    (GgmlType::F32, 0, "f32", 1, 4),
    (GgmlType::F16, 1, "f16", 1, 2),
    (GgmlType::Q4_0, 2, "q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "q8_1", 32, 40),
    (GgmlType::Q2K, 10, "q2_k", 256, 84),
    (GgmlType::Q3K, 11, "q3_k", 256, 110),
    (GgmlType::Q4K, 12, "q4_k", 256, 144),
    (GgmlType::Q5K, 13, "q5_k", 256, 176),
    (GgmlType::Q6K, 14, "q6_k", 256, 210),
    (GgmlType::Q8K, 15, "q8_k", 256, 292),
    (GgmlType::Iq2Xxs, 16, "iq2_xxs", 256, 66),
    (GgmlType::Iq2Xs, 17, "iq2_xs", 256, 74),
    (GgmlType::Iq3Xxs, 18, "iq3_xxs", 256, 98),
    (GgmlType::Iq1S, 19, "iq1_s", 256, 50),
    (GgmlType::Iq4Nl, 20, "iq4_nl", 32, 18),
    (GgmlType::Iq3S, 21, "iq3_s", 256, 110),
    (GgmlType::Iq2S, 22, "iq2_s", 256, 82),
    (GgmlType::Iq4Xs, 23, "iq4_xs", 256, 136),
    (GgmlType::I8, 24, "i8", 1, 1),
    (GgmlType::I16, 25, "i16", 1, 2),
    (GgmlType::I32, 26, "i32", 1, 4),
    (GgmlType::I64, 27, "i64", 1, 8),
    (GgmlType::F64, 28, "f64", 1, 8),
    (GgmlType::Iq1M, 29, "iq1_m", 256, 56),
    (GgmlType::Bf16, 30, "bf16", 1, 2),
    (GgmlType::Tq1_0, 34, "tq1_0", 256, 54),
    (GgmlType::Tq2_0, 35, "tq2_0", 256, 66),
    (GgmlType::Mxfp4, 39, "mxfp4", 32, 17),
    (GgmlType::Nvfp4, 40, "nvfp4", 64, 36),
    (GgmlType::Q1_0, 41, "q1_0", 128, 18),
];

/// Element types of other formats that are not ggml types (name, elements
/// and bytes per block): they have no ggml id, so no GGUF reader accepts
/// one ([`GgmlType::from_id`] never yields them), and [`GgmlType::bytes_for`]
/// refuses them, so no GGUF or dense .knot writer sizes (and writes) one.
const NON_GGML: &[(GgmlType, &str, u64, u64)] = &[
    (GgmlType::F8E4M3, "f8_e4m3", 1, 1),
    (GgmlType::F8E5M2, "f8_e5m2", 1, 1),
];

/// Types decoded beyond [`DECODABLE`], which dense .knot does not declare:
/// ggml's F64, and the safetensors-only 8-bit floats.
pub const OTHER_DECODABLE: &[GgmlType] = &[GgmlType::F64, GgmlType::F8E4M3, GgmlType::F8E5M2];

/// The types this crate decodes (and that dense .knot may declare).
pub const DECODABLE: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Iq1S,
    GgmlType::Iq1M,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq2S,
    GgmlType::Iq3Xxs,
    GgmlType::Iq3S,
    GgmlType::Iq4Nl,
    GgmlType::Iq4Xs,
    GgmlType::Tq1_0,
    GgmlType::Tq2_0,
    GgmlType::Mxfp4,
    GgmlType::Nvfp4,
];

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        // Every ggml variant has exactly one row in TYPES (checked by a test).
        TYPES.iter().find(|r| r.0 == self).unwrap_or(&TYPES[0])
    }

    /// The row of a type that is not a ggml type.
    fn non_ggml(self) -> Option<&'static (GgmlType, &'static str, u64, u64)> {
        NON_GGML.iter().find(|r| r.0 == self)
    }

    /// Whether this is one of ggml's types (it has a ggml id).
    pub fn is_ggml(self) -> bool {
        self.non_ggml().is_none()
    }

    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// The ggml id; `u32::MAX` (which no reader accepts) for a type that is
    /// not a ggml type, which never reaches a writer: [`Self::bytes_for`]
    /// refuses it first.
    pub fn id(self) -> u32 {
        match self.non_ggml() {
            Some(_) => u32::MAX,
            None => self.row().1,
        }
    }

    /// Lower-case name as used in dense .knot (`q4_k`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self.non_ggml() {
            Some(r) => r.1,
            None => self.row().2,
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        let lower = name.to_ascii_lowercase();
        TYPES.iter().find(|r| r.2 == lower).map(|r| r.0)
    }

    /// Elements per block.
    pub fn block_elems(self) -> u64 {
        match self.non_ggml() {
            Some(r) => r.2,
            None => self.row().3,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self.non_ggml() {
            Some(r) => r.3,
            None => self.row().4,
        }
    }

    pub fn is_decodable(self) -> bool {
        DECODABLE.contains(&self) || OTHER_DECODABLE.contains(&self)
    }

    /// Stored bytes for `n` elements in a ggml file (GGUF, dense .knot,
    /// .rknot); `None` if `n` is not a whole number of blocks, the size
    /// overflows, or the type is not a ggml type (no such file holds one).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        if !self.is_ggml() {
            return None;
        }
        self.elem_bytes_for(n)
    }

    /// Stored bytes for `n` elements of this element type in any format
    /// (a safetensors tensor of F8_E4M3 included); `None` as
    /// [`Self::bytes_for`] but for the ggml check.
    pub fn elem_bytes_for(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name().to_ascii_uppercase())
    }
}

/// Why a kernel refused its input. The callers turn this into a file error
/// with path, tensor and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// This type is not decodable.
    Unsupported(GgmlType),
    /// `src.len()` is not `out.len() / block_elems * block_bytes`, or
    /// `out.len()` is not a whole number of blocks.
    Size { src: usize, out: usize },
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelError::Unsupported(t) => write!(f, "tensor type {t} is not supported"),
            KernelError::Size { src, out } => write!(
                f,
                "kernel size mismatch: {src} source bytes for {out} output elements"
            ),
        }
    }
}

/// A type's dequantization kernel: `src` holds whole blocks of the type
/// (verbatim ggml layout), `out` receives their values in order; the sizes
/// were checked by [`dequantize`].
type Kernel = fn(&[u8], &mut [f32]);

/// The kernels a family module provides, one per type it decodes.
type Kernels = &'static [(GgmlType, Kernel)];

/// Every family's kernels. A family of types is one module with its
/// `KERNELS` and a line here (its types listed in [`DECODABLE`]); block
/// geometry stays in [`TYPES`], which names every type a file may declare.
const FAMILIES: &[Kernels] = &[
    float::KERNELS,
    legacy::KERNELS,
    kquants::KERNELS,
    iquants::KERNELS,
    ternary::KERNELS,
    fp4::KERNELS,
    f8::KERNELS,
];

/// Pairs each `B`-byte source block with its `E` output values. The caller
/// guarantees equal block counts; `zip` stops at the shorter side
/// regardless, so no index is ever out of bounds.
fn blocks<'s, 'o, const B: usize, const E: usize>(
    src: &'s [u8],
    out: &'o mut [f32],
) -> impl Iterator<Item = (&'s [u8; B], &'o mut [f32; E])> {
    src.as_chunks::<B>()
        .0
        .iter()
        .zip(out.as_chunks_mut::<E>().0.iter_mut())
}

/// The kernel of `ty`, if this crate decodes it.
fn kernel(ty: GgmlType) -> Option<Kernel> {
    FAMILIES
        .iter()
        .flat_map(|f| f.iter())
        .find(|k| k.0 == ty)
        .map(|k| k.1)
}

/// Dequantize whole blocks: `src` holds `out.len() / block_elems` blocks of
/// `ty`, verbatim ggml layout; `out` receives the f32 values in order.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let be = ty.block_elems() as usize;
    let bb = ty.block_bytes() as usize;
    if !out.len().is_multiple_of(be) || src.len() != out.len() / be * bb {
        return Err(KernelError::Size {
            src: src.len(),
            out: out.len(),
        });
    }
    let kernel = kernel(ty).ok_or(KernelError::Unsupported(ty))?;
    kernel(src, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_table_is_consistent() {
        for r in TYPES {
            assert_eq!(GgmlType::from_id(r.1), Some(r.0));
            assert_eq!(GgmlType::from_name(r.2), Some(r.0));
            assert_eq!(r.0.row().1, r.1, "{:?} must have one row", r.0);
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_name("Q4_K"), Some(GgmlType::Q4K));
        assert_eq!(GgmlType::Q4K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4K.bytes_for(100), None);
    }

    /// The decodable types are exactly those with a kernel, each with one.
    #[test]
    fn every_decodable_type_has_one_kernel() {
        let mut with_kernel: Vec<GgmlType> = FAMILIES
            .iter()
            .flat_map(|f| f.iter().map(|k| k.0))
            .collect();
        let mut decodable = [DECODABLE, OTHER_DECODABLE].concat();
        let key = |t: &GgmlType| format!("{t:?}");
        with_kernel.sort_by_key(key);
        decodable.sort_by_key(key);
        assert_eq!(with_kernel, decodable);
        assert!(decodable.windows(2).all(|w| w[0] != w[1]));
    }

    /// The 8-bit floats of safetensors are no ggml type: no id of a GGUF
    /// yields one, no name of a dense .knot or GGUF type table names one,
    /// and no ggml file's size (what the GGUF and .knot writers ask
    /// before writing a tensor) is given for one.
    #[test]
    fn non_ggml_types_are_never_read_from_or_written_to_a_ggml_file() {
        for id in (0..=u16::MAX as u32).chain([u32::MAX - 1, u32::MAX]) {
            assert!(GgmlType::from_id(id).is_none_or(GgmlType::is_ggml), "{id}");
        }
        for ty in [GgmlType::F8E4M3, GgmlType::F8E5M2] {
            assert!(!ty.is_ggml() && ty.is_decodable());
            assert_eq!(GgmlType::from_id(ty.id()), None);
            assert_eq!(GgmlType::from_name(ty.name()), None);
            assert!(
                !DECODABLE.contains(&ty),
                "a dense .knot may not declare {ty}"
            );
            assert_eq!(ty.bytes_for(4), None);
            assert_eq!(ty.elem_bytes_for(4), Some(4));
        }
        assert_eq!(GgmlType::F64.bytes_for(2), Some(16));
        let mut out = [0f32; 2];
        dequantize(
            GgmlType::F64,
            &[0, 0, 0, 0, 0, 0, 0xf0, 0x3f, 0, 0, 0, 0, 0, 0, 0, 0xc0],
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [1.0, -2.0]);
    }

    #[test]
    fn size_mismatch_is_an_error_not_a_panic() {
        let mut out = vec![0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out),
            Err(KernelError::Size { .. })
        ));
        let mut out = vec![0f32; 31];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out).is_err());
        let mut out = vec![0f32; 256];
        assert_eq!(
            dequantize(GgmlType::Q8K, &[0u8; 292], &mut out),
            Err(KernelError::Unsupported(GgmlType::Q8K))
        );
    }
}
