//! Reads of `model.native.gguf` ([`super::views::native_gguf`]): header
//! bytes, zeros and ranges of tensors' ggml blocks. Stored ggml blocks are
//! read from the source through [`Backend::read_stored_blocks`] (a local
//! `pread`, or the remote source's block cache; the file's CRC-32s and a
//! manifest's checks as for a decode) straight into the reply; re-packed
//! ones ([`super::views::transcode`]) from the stored blocks behind them,
//! their codes moved; the rest decoded to F32 as `model.gguf` serves it. No
//! decoded-chunk cache: the kernel's page cache keeps what was read.
//!
//! [`Backend::read_stored_blocks`]: crate::backend::Backend::read_stored_blocks

use super::views::transcode::{self, SegmentBytes};
use super::views::{Layout, Piece};
use super::{ReadData, TensorFs};
use crate::error::{ErrorKind, Result, err};

impl TensorFs {
    /// Bytes `[offset, offset + size)` of a stored-bytes layout.
    pub(super) fn read_native(&self, l: &Layout, offset: u64, size: u32) -> Result<ReadData> {
        if offset >= l.size() || size == 0 {
            return Ok(ReadData::Owned(Vec::new()));
        }
        let end = l.size().min(offset.saturating_add(u64::from(size)));
        // At most `size` (a u32) bytes.
        let mut out = vec![0u8; (end - offset) as usize];
        let mut at = 0usize;
        for p in l.pieces(offset, end) {
            match p {
                Piece::Header(r) => {
                    let n = r.len();
                    out[at..at + n].copy_from_slice(&l.header()[r]);
                    at += n;
                }
                // `out` starts zeroed.
                Piece::Zeros(n) => at += n,
                Piece::Tensor { seg, range } => {
                    let n = (range.end - range.start) as usize;
                    let s = &l.segments()[seg];
                    let index =
                        self.shared
                            .files
                            .get(s.file)
                            .map(|f| f.index)
                            .ok_or_else(|| {
                                err(
                                    ErrorKind::BadValue,
                                    "internal error: a native view segment without its tensor",
                                )
                            })?;
                    let b = &*self.shared.backend;
                    let buf = &mut out[at..at + n];
                    match l.made(seg) {
                        SegmentBytes::Stored => b.read_stored_blocks(index, range.start, buf)?,
                        SegmentBytes::Repacked(r) => {
                            let name = self.tensor_name(s.file);
                            transcode::repack_range(b, index, name, r, range, buf)?;
                        }
                        SegmentBytes::DecodedF32 => {
                            let got = b.read_bytes(index, range.start, buf)?;
                            if got != n {
                                return Err(err(
                                    ErrorKind::LengthMismatch,
                                    format!("{got} decoded bytes for a read of {n}"),
                                )
                                .tensor(self.tensor_name(s.file)));
                            }
                        }
                    }
                    at += n;
                }
            }
        }
        Ok(ReadData::Owned(out))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use crate::backend::{self, Role};
    use crate::format::gguf::GgufFile;
    use crate::fs::inodes::NATIVE_GGUF_INO;
    use crate::fs::{Caller, FsConfig, TensorFs};
    use crate::source::SourceFile;

    /// The whole view read in reads of every awkward size (header, padding
    /// and tensor boundaries straddled) is one GGUF whose tensors are the
    /// demo GGUF's stored bytes; nothing is decoded.
    #[test]
    fn native_view_reads_are_the_sources_stored_bytes() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/tiny-llama.gguf");
        let b = backend::open_single(&src, Role::Primary).unwrap();
        let fs = TensorFs::new(
            Arc::from(b),
            FsConfig {
                prefetch_threads: 0,
                ..FsConfig::default()
            },
        );
        let size = fs.getattr(NATIVE_GGUF_INO).unwrap().size;
        let me = Caller {
            uid: 0,
            gid: 0,
            pid: 1,
        };
        let fh = fs.open(NATIVE_GGUF_INO, true, false, me).unwrap().fh;
        let mut whole = Vec::new();
        for step in [1000u32, 4096, 37, 1 << 20] {
            let mut got = Vec::new();
            while (got.len() as u64) < size {
                let d = fs
                    .read(NATIVE_GGUF_INO, fh, got.len() as u64, step)
                    .unwrap();
                assert!(!d.bytes().is_empty());
                got.extend_from_slice(d.bytes());
            }
            assert_eq!(got.len() as u64, size);
            if whole.is_empty() {
                whole = got;
            } else {
                assert!(got == whole, "reads of {step} bytes differ");
            }
        }
        assert!(
            fs.read(NATIVE_GGUF_INO, fh, size, 10)
                .unwrap()
                .bytes()
                .is_empty()
        );
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("native.gguf");
        std::fs::write(&copy, &whole).unwrap();
        let view = GgufFile::read(&SourceFile::open(&copy).unwrap()).unwrap();
        let source = GgufFile::read(&SourceFile::open(&src).unwrap()).unwrap();
        let raw = std::fs::read(&src).unwrap();
        assert_eq!(view.metadata, source.metadata);
        assert_eq!(view.tensors.len(), source.tensors.len());
        for (v, s) in view.tensors.iter().zip(&source.tensors) {
            assert_eq!(
                (&v.name, &v.dims, v.ty, v.n_bytes),
                (&s.name, &s.dims, s.ty, s.n_bytes)
            );
            let (a, b) = (v.offset as usize, s.offset as usize);
            let n = v.n_bytes as usize;
            assert!(whole[a..a + n] == raw[b..b + n], "{}", v.name);
        }
        assert_eq!(fs.cache_stats().bytes_decoded, 0);
    }
}
