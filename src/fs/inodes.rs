//! The inode map of a mount (the `fs` module docs draw it): every fixed
//! entry's inode and name, the tensor files' and views' inodes, and the
//! `hf/` block. All are fixed by the source files, so they are stable across
//! remounts. Kept in one place so no two modules can hand out one number.

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
