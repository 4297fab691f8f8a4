//! GGUF -> dense .knot repack: ggml blocks verbatim, underscore names, the
//! GGUF key/values as the .knot metadata. Blocks are streamed in bounded
//! pieces from the dense backend's open file (for a `ctl` job, the file the
//! mount serves, whatever its path names now); nothing is decoded.

use crate::backend::{Backend, StoredType};
use crate::encode::Progress;
use crate::error::{ErrorKind, Result, err};
use crate::format::knot::write_knot_with;
use crate::output::{AtomicOutput, OutputTarget};
use crate::quant::GgmlType;

/// Bytes copied per read while streaming a tensor.
const COPY_PIECE: u64 = 4 << 20;

/// Repack the GGUF behind `gguf` (a dense backend) into a dense .knot at
/// `out`; returns the bytes written.
pub fn encode_knot(gguf: &dyn Backend, out: &OutputTarget, progress: &Progress) -> Result<u64> {
    let path = &gguf.summary().path;
    let dense = gguf
        .as_dense()
        .filter(|d| d.summary().format.is_repackable())
        .ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!(
                    "encode knot repacks a GGUF; this is {}",
                    gguf.summary().format
                ),
            )
            .path(path)
        })?;
    let entries = dense.tensors().entries();
    let mut layout: Vec<(&str, GgmlType, &[u64])> = Vec::with_capacity(entries.len());
    for t in entries {
        match t.stored {
            StoredType::Ggml(ty) if ty.is_decodable() => {
                layout.push((t.name.dot.as_str(), ty, t.shape.as_slice()))
            }
            ref other => {
                return Err(err(
                    ErrorKind::UnsupportedType,
                    format!("{other} cannot be stored in a dense .knot"),
                )
                .tensor(&t.name.dot)
                .path(path));
            }
        }
    }
    // Each tensor is read twice: once for its checksums (the header that
    // holds them comes first), once to copy it.
    progress.start(2 * entries.len() as u64);
    let mut o = AtomicOutput::create(out)?;
    let mut buf = vec![0u8; COPY_PIECE as usize];
    let mut copied = 0u64;
    write_knot_with(&mut o, &dense.summary().metadata, &layout, |i, w| {
        progress.check()?;
        let t = &entries[i];
        let mut done = 0u64;
        while done < t.stored_bytes {
            let n = COPY_PIECE.min(t.stored_bytes - done) as usize;
            dense.read_stored(i, done, &mut buf[..n])?;
            w.write_all(&buf[..n])
                .map_err(|e| err(ErrorKind::Io, format!("write: {e}")).path(&out.path))?;
            done += n as u64;
        }
        copied += t.stored_bytes;
        progress
            .bytes_written
            .store(copied / 2, std::sync::atomic::Ordering::Relaxed);
        progress.tick(&t.name.dot);
        Ok(())
    })?;
    let n = o.commit()?;
    progress
        .bytes_written
        .store(n, std::sync::atomic::Ordering::Relaxed);
    progress.finish();
    Ok(n)
}
