//! `rknot cat`: a tensor's decoded f32 bytes on stdout, exactly what the
//! mount serves for it.

use std::io::{self, Write};
use std::path::PathBuf;

use clap::Args;

use super::{CliResult, install_remote, quiet_pipe, usage};
use crate::backend::{self, Backend};
use crate::source::cli::RemoteArgs;

#[derive(Args)]
pub struct CatArgs {
    /// Model file (.rknot, SK32 sketch, dense .knot or GGUF).
    file: PathBuf,
    /// Tensor name, GGUF-dot (blk.0.attn_q.weight) or underscore spelling;
    /// for a safetensors checkpoint also its Hugging Face name.
    tensor: String,
    /// Dense fallback (GGUF or dense .knot) for tensors FILE lacks.
    #[arg(long, value_name = "FILE")]
    dense: Option<PathBuf>,
    /// First byte to write: inside the tensor (below its size in bytes,
    /// 4 x elements); an offset past its end is refused (at the end: nothing).
    #[arg(long, default_value_t = 0)]
    offset: u64,
    /// Bytes to write at most (default: to the end of the tensor).
    #[arg(long)]
    length: Option<u64>,
    #[command(flatten)]
    remote: RemoteArgs,
}

impl CatArgs {
    pub fn run(self) -> CliResult {
        install_remote(&["cat"], &self.remote)?;
        let b = backend::open(&self.file, self.dense.as_deref())?;
        cat(b.as_ref(), &self.tensor, self.offset, self.length)
    }
}

/// Stream the byte range in chunks so a large tensor never sits in memory.
fn cat(b: &dyn Backend, tensor: &str, offset: u64, length: Option<u64>) -> CliResult {
    // A checkpoint's Hugging Face names too, rows in the checkpoint's order.
    let (index, alias) = match b.find(tensor) {
        Ok(i) => (i, None),
        Err(e) => match backend::hf_alias(b, tensor) {
            Some(a) => (a.index, Some(a)),
            None => return Err(e.into()),
        },
    };
    let size = b.tensors().entries()[index].served_bytes();
    // At the end is an empty read, as read(2) at end of file; past it is
    // a mistake.
    if offset > size {
        return Err(usage(
            &["cat"],
            format!(
                "--offset {offset} is past the end of tensor {} ({size} bytes: offsets 0..={size})",
                crate::text::escape(tensor),
            ),
        ));
    }
    let end = match length {
        Some(l) => size.min(offset.saturating_add(l)),
        None => size,
    };
    const CHUNK: usize = 4 << 20;
    let mut buf = vec![0u8; CHUNK];
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let mut pos = offset;
    while pos < end {
        let want = CHUNK.min((end - pos) as usize);
        let n = match &alias {
            Some(a) => a.read_bytes(b, pos, &mut buf[..want])?,
            None => b.read_bytes(index, pos, &mut buf[..want])?,
        };
        if n == 0 {
            break;
        }
        if let Err(e) = out.write_all(&buf[..n]) {
            return quiet_pipe(e);
        }
        pos += n as u64;
    }
    out.flush().or_else(quiet_pipe)
}
