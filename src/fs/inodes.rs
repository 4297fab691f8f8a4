//! The inode map of a mount (the `fs` module docs draw it): every fixed
//! entry's inode and name, the tensor files' and views' inodes, and the
//! `hf/` block, the HF-named files whose rows differ from their tensor
//! file's. All are fixed by the source files, so they are stable across
//! remounts. Kept in one place so no two modules can hand out one number.
//!
//! Ranges: 1..=9 fixed entries, `16 + i + k * 2^32` (below `3 * 2^32 + 16`)
//! tensor files, `2^46 +` a tensor file's inode for its HF-named file in
//! Hugging Face row order (below `2^46 + 3 * 2^32 + 16`), `2^47..2^47 + 16`
//! `hf/`, `2^48 + n` jobs.

use super::elem::ElemFormat;

pub const ROOT_INO: u64 = 1;
pub const INDEX_INO: u64 = 2;
pub const CTL_INO: u64 = 3;
/// Inode of `model.safetensors` (F32).
pub const SAFETENSORS_INO: u64 = 4;
/// Inode of `model.gguf`.
pub const GGUF_INO: u64 = 5;
/// Inode of `model.f16.safetensors`.
pub const F16_SAFETENSORS_INO: u64 = 6;
/// Inode of `model.bf16.safetensors`.
pub const BF16_SAFETENSORS_INO: u64 = 7;
/// Inode of `model.native.gguf` (the stored ggml blocks, verbatim).
pub const NATIVE_GGUF_INO: u64 = 10;
/// Tensor files of format k live at `16 + i + k * FORMAT_INO_STRIDE`.
pub const FORMAT_INO_STRIDE: u64 = 1 << 32;
pub const FIRST_TENSOR_INO: u64 = 16;
/// `ctl.json`: what `ctl` shows, as JSON for tools.
pub const CTL_JSON_INO: u64 = 8;
/// `jobs/`: one file per encoding job.
pub const JOBS_DIR_INO: u64 = 9;
/// Job `n` is the file `jobs/n`, inode `JOB_INO_BASE + n` (above every
/// tensor and view inode).
pub const JOB_INO_BASE: u64 = 1 << 48;

pub const INDEX_NAME: &str = "index.json";
pub const CTL_NAME: &str = "ctl";
pub const CTL_JSON_NAME: &str = "ctl.json";
pub const JOBS_DIR_NAME: &str = "jobs";

/// Inode of tensor file `f` in format `fmt` (module docs of `fs`).
pub fn tensor_ino(f: usize, fmt: ElemFormat) -> u64 {
    FIRST_TENSOR_INO + f as u64 + fmt.ordinal() * FORMAT_INO_STRIDE
}

/// An HF-named file whose rows are in another order than its tensor
/// file's (llama's Q/K from a checkpoint) is inode `ALIAS_INO_BASE +` the
/// tensor file's inode; one whose rows are the same is a hard link of the
/// tensor file.
pub const ALIAS_INO_BASE: u64 = 1 << 46;

/// Inode of the HF-named file of tensor file `f` in format `fmt`, rows in
/// Hugging Face order.
pub fn alias_ino(f: usize, fmt: ElemFormat) -> u64 {
    ALIAS_INO_BASE + tensor_ino(f, fmt)
}

/// The tensor file and format of an [`alias_ino`].
pub fn alias_of(ino: u64) -> Option<(usize, ElemFormat)> {
    let t = ino.checked_sub(ALIAS_INO_BASE)?;
    let fmt = ElemFormat::from_ordinal(t / FORMAT_INO_STRIDE)?;
    let f = usize::try_from((t % FORMAT_INO_STRIDE).checked_sub(FIRST_TENSOR_INO)?).ok()?;
    Some((f, fmt))
}

/// Inode of the directory `hf/`.
pub const HF_DIR_INO: u64 = 1 << 47;
pub const HF_DIR_NAME: &str = "hf";
pub const CONFIG_INO: u64 = HF_DIR_INO + 1;
pub const GENERATION_CONFIG_INO: u64 = HF_DIR_INO + 2;
pub const TOKENIZER_INO: u64 = HF_DIR_INO + 3;
pub const TOKENIZER_CONFIG_INO: u64 = HF_DIR_INO + 4;

/// Inode of `hf/model.safetensors` in format `fmt`.
pub fn hf_safetensors_ino(fmt: ElemFormat) -> u64 {
    HF_DIR_INO + 5 + fmt.ordinal()
}

/// Whether `ino` is in `hf/`'s block of inodes (the directory included).
pub fn is_hf_ino(ino: u64) -> bool {
    (HF_DIR_INO..HF_DIR_INO + 16).contains(&ino)
}
