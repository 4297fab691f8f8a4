//! GGUF -> dense .knot repack: ggml blocks verbatim, underscore names, the
//! GGUF key/values as the .knot metadata. Blocks are streamed from the
//! source in bounded pieces; nothing is decoded.

use std::io::Write;
use std::path::Path;

use crate::encode::Progress;
use crate::encode::output::AtomicOutput;
use crate::error::{ErrorKind, Result, err};
use crate::format::gguf::GgufFile;
use crate::format::knot::write_knot_with;
use crate::source::SourceFile;

/// Bytes copied per read while streaming a tensor.
const COPY_PIECE: u64 = 4 << 20;

/// Repack `gguf` into a dense .knot at `out`; returns the bytes written.
pub fn encode_knot(gguf: &Path, out: &Path, overwrite: bool, progress: &Progress) -> Result<u64> {
    let src = SourceFile::open(gguf)?;
    let g = GgufFile::read(&src)?;
    if let Some(t) = g.tensors.iter().find(|t| !t.ty.is_decodable()) {
        return Err(err(
            ErrorKind::UnsupportedType,
            format!("{} cannot be stored in a dense .knot", t.ty),
        )
        .tensor(&t.name)
        .path(gguf));
    }
    let shapes: Vec<Vec<u64>> = g
        .tensors
        .iter()
        .map(|t| t.dims.iter().rev().copied().collect())
        .collect();
    let layout: Vec<(&str, crate::quant::GgmlType, &[u64])> = g
        .tensors
        .iter()
        .zip(&shapes)
        .map(|(t, s)| (t.name.as_str(), t.ty, s.as_slice()))
        .collect();
    progress.start(g.tensors.len() as u64);
    let mut o = AtomicOutput::create(out, overwrite)?;
    let mut buf = vec![0u8; COPY_PIECE as usize];
    write_knot_with(&mut o, &g.metadata, &layout, |i, w| {
        progress.check()?;
        let t = &g.tensors[i];
        let mut done = 0u64;
        while done < t.n_bytes {
            let n = COPY_PIECE.min(t.n_bytes - done) as usize;
            src.read_at(t.offset + done, &mut buf[..n])?;
            w.write_all(&buf[..n])
                .map_err(|e| err(ErrorKind::Io, format!("write: {e}")).path(out))?;
            done += n as u64;
        }
        progress
            .bytes_written
            .store(w.bytes_written(), std::sync::atomic::Ordering::Relaxed);
        progress.tick(&t.name);
        Ok(())
    })?;
    let n = o.commit()?;
    progress
        .bytes_written
        .store(n, std::sync::atomic::Ordering::Relaxed);
    progress.finish();
    Ok(n)
}
