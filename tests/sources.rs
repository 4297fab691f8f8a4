//! Sources that change under a mount or a reader: a GGUF rewritten in place
//! (same inode, data moved by one alignment unit) must never be served at
//! its old offsets.

mod common;

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::backend;
use rknot::format::gguf::{GgufFile, encode_header, write_gguf};
use rknot::format::meta::MetaValue;
use rknot::source::SourceFile;

/// Write to `dst` the model of the GGUF `src` with one more metadata key,
/// sized so that the data section, and so every tensor's data, starts one
/// alignment unit later. Returns that shift in bytes.
fn write_moved_version(src: &Path, dst: &Path) -> u64 {
    let f = SourceFile::open(src).unwrap();
    let g = GgufFile::read(&f).unwrap();
    let datas: Vec<Vec<u8>> = g
        .tensors
        .iter()
        .map(|t| f.read_vec(t.offset, t.n_bytes, "tensor").unwrap())
        .collect();
    let shapes: Vec<_> = g
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ty))
        .collect();
    let metadata = (1..=g.alignment as usize)
        .map(|n| {
            let mut md = g.metadata.clone();
            md.push(format!("rknot.test.{}", "v".repeat(n)), MetaValue::U32(2));
            md
        })
        .find(|md| {
            let (header, _) = encode_header(md, &shapes, g.alignment).unwrap();
            header.len() as u64 == g.data_offset + g.alignment
        })
        .expect("a key length that moves the data by one alignment unit");
    let tensors: Vec<_> = shapes
        .into_iter()
        .zip(&datas)
        .map(|((n, d, t), data)| (n, d, t, data.as_slice()))
        .collect();
    let mut out = Vec::new();
    write_gguf(&mut out, &metadata, &tensors, g.alignment).unwrap();
    std::fs::write(dst, out).unwrap();
    let moved = GgufFile::read(&SourceFile::open(dst).unwrap()).unwrap();
    assert_eq!(moved.data_offset, g.data_offset + g.alignment);
    g.alignment
}

/// `cp new old`: rewrites `old` in place, keeping its inode.
fn cp_in_place(new: &Path, old: &Path) {
    let ino = std::fs::metadata(old).unwrap().ino();
    let st = Command::new("cp").arg(new).arg(old).status().unwrap();
    assert!(st.success());
    assert_eq!(std::fs::metadata(old).unwrap().ino(), ino, "same inode");
}

needs! { [fuse]
/// A GGUF rewritten in place under a mount (page cache and direct I/O):
/// tensors not yet cached fail with ESTALE, never with bytes read at the
/// old offsets; cached ones keep being served; the daemon stays up and
/// says why in its log.
fn source_rewritten_in_place_fails_reads_never_serves_moved_bytes() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let original = demo_path("tiny-llama.gguf");
    let v2 = dir.path().join("v2.gguf");
    write_moved_version(&original, &v2);
    let reference = backend::open(&original, None).unwrap();
    for mode in [&[][..], &["-o", "direct_io"][..]] {
        let copy = dir.path().join("model.gguf");
        std::fs::copy(&original, &copy).unwrap();
        let mut m = Mounted::new(&copy, mode);
        let cached = "blk.0.attn_q.weight";
        let tensor_file = |t: &str| m.path(&format!("{t}.f32"));
        assert_eq!(
            std::fs::read(tensor_file(cached)).unwrap(),
            decode_bytes(reference.as_ref(), cached)
        );
        cp_in_place(&v2, &copy);
        for t in [
            "output.weight",
            "blk.1.ffn_down.weight",
            "token_embd.weight",
        ] {
            match std::fs::read(tensor_file(t)) {
                Ok(bytes) => panic!(
                    "{mode:?}: {t} read {} bytes after the source changed ({} the original's)",
                    bytes.len(),
                    if bytes == decode_bytes(reference.as_ref(), t) {
                        "equal to"
                    } else {
                        "different from"
                    }
                ),
                Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{mode:?} {t}: {e}"),
            }
        }
        // The whole-model view reads the same source: refused too.
        let e = std::fs::read(m.path("model.safetensors")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{mode:?}: {e}");
        // Decoded before the change: still served, and the daemon is up.
        assert_eq!(
            std::fs::read(tensor_file(cached)).unwrap(),
            decode_bytes(reference.as_ref(), cached),
            "{mode:?}"
        );
        assert!(m.try_wait().is_none(), "daemon died:\n{}", m.log());
        assert!(m.ctl().contains("source:"), "ctl still answers");
        let log = m.log();
        assert!(
            log.contains("the file changed after it was opened")
                && log.contains("remount")
                && log.contains(&copy.display().to_string()),
            "{log}"
        );
    }
}
}

needs! { [model]
/// `rknot cat` of a tensor whose file is rewritten while it streams: it
/// fails (exit 1, the reason on stderr) instead of finishing with bytes
/// from the new file at the old offsets.
fn cat_of_a_file_changed_while_reading_fails() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("model.gguf");
    std::fs::copy(&model, &copy).unwrap();
    let v2 = dir.path().join("v2.gguf");
    write_moved_version(&model, &v2);
    // token_embd decodes to 113 MB: `cat` streams it in 4 MiB pieces and
    // blocks on the pipe until this test reads.
    let mut child = Command::new(rknot_bin())
        .args(["cat", copy.to_str().unwrap(), "token_embd.weight"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = vec![0u8; 4096];
    stdout.read_exact(&mut first).unwrap();
    cp_in_place(&v2, &copy);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the file changed after it was opened") && stderr.contains("size"),
        "{stderr}"
    );
    assert!(
        ((first.len() + rest.len()) as u64) < 49152 * 576 * 4,
        "not the whole tensor"
    );
}
}
