//! Integrity (docs/FORMAT.md section 12): damaged or tampered bytes of a
//! file with checksums are detected, never served, and everything else
//! keeps serving. The corruption matrix runs on files the encoders make
//! from the demo model: a self-contained faithful .rknot (compressed
//! tensors and tensors stored as ggml blocks), an SK32 and a dense .knot.

mod common;

use std::path::{Path, PathBuf};

use common::mount::{Mounted, fuse_available};
use common::{demo_path, needs, run_rknot};
use rknot::ErrorKind;
use rknot::backend::{self, ParsedFile, Role};

struct Files {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    rknot: PathBuf,
    sk32: PathBuf,
    knot: PathBuf,
}

fn encode(args: &[&str]) {
    let o = run_rknot(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn encoded() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let gguf = demo_path("tiny-llama.gguf");
    let g = gguf.to_str().unwrap();
    let f = Files {
        rknot: d.join("m.rknot"),
        sk32: d.join("m.sk32"),
        knot: d.join("m.knot"),
        dir: d,
        _dir: dir,
    };
    encode(&[
        "encode",
        "rknot",
        g,
        "--out",
        f.rknot.to_str().unwrap(),
        "--profile",
        "faithful",
    ]);
    encode(&[
        "encode",
        "sk32",
        g,
        "--out",
        f.sk32.to_str().unwrap(),
        "--rank",
        "8",
    ]);
    encode(&["encode", "knot", g, "--out", f.knot.to_str().unwrap()]);
    f
}

/// `path` copied to `name` in the same directory with `edit` applied.
fn damaged(path: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(path).unwrap();
    edit(&mut bytes);
    let out = path.with_file_name(name);
    std::fs::write(&out, bytes).unwrap();
    out
}

fn flip(at: u64) -> impl FnOnce(&mut Vec<u8>) {
    move |v| v[at as usize] ^= 0x10
}

/// Every tensor of `path` decoded, by name (the file alone).
fn decode_all(path: &Path) -> Vec<(String, Result<Vec<u8>, rknot::Error>)> {
    let b = backend::open_single(path, Role::Primary).unwrap();
    b.tensors()
        .entries()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.is_available())
        .map(|(i, t)| {
            let mut buf = vec![0u8; t.served_bytes() as usize];
            let r = b.read_bytes(i, 0, &mut buf).map(|_| buf);
            (t.name.dot.clone(), r)
        })
        .collect()
}

/// Where damage goes: the absolute byte range of a tensor's stored bytes,
/// by the file's own parse.
fn stored_range(path: &Path, tensor: &str) -> (u64, u64) {
    let b = backend::open_single(path, Role::Primary).unwrap();
    let i = b.tensors().get(tensor).unwrap();
    let r = b.stored_ranges(i).unwrap();
    (r.ranges[0].start, r.ranges[0].end)
}

/// The file opens, `bad` fails with a Checksum error naming it (in the
/// library and in `rknot cat`), every other tensor decodes to the original
/// bytes, and `verify --integrity` lists `bad` and exits 1.
#[track_caller]
fn only_tensor_fails(original: &Path, damaged: &Path, bad: &str) {
    let want = decode_all(original);
    let got = decode_all(damaged);
    assert_eq!(want.len(), got.len());
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        if name == bad {
            let e = g.as_ref().expect_err("damaged tensor was served");
            assert_eq!(e.kind(), ErrorKind::Checksum, "{e}");
            assert_eq!(
                e.tensor_name().map(rknot::names::canonical).as_deref(),
                Some(bad),
                "{e}"
            );
            assert!(
                e.to_string().contains(&damaged.display().to_string()),
                "{e}"
            );
        } else {
            assert_eq!(
                g.as_ref().unwrap_or_else(|e| panic!("{name}: {e}")),
                w.as_ref().unwrap(),
                "{name} changed"
            );
        }
    }
    let o = run_rknot(&["cat", damaged.to_str().unwrap(), bad]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("CRC-32"), "{err}");
    let o = run_rknot(&["verify", "--integrity", damaged.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains(&format!("tensor {bad}")), "{out}");
    // The structural verify reports it too (it used to say OK).
    let o = run_rknot(&["verify", damaged.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
}

/// The file does not open: the damage is in its metadata (or its end).
#[track_caller]
fn refused_at_open(damaged: &Path, kind: ErrorKind, says: &str) {
    let e = match ParsedFile::open(damaged) {
        Ok(_) => panic!("{} opened", damaged.display()),
        Err(e) => e,
    };
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.to_string().contains(says), "{e}");
    let o = run_rknot(&["verify", "--integrity", damaged.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn undamaged_files_are_checked_and_verify_integrity_passes() {
    let f = encoded();
    for p in [&f.rknot, &f.sk32, &f.knot] {
        let o = run_rknot(&["verify", "--integrity", p.to_str().unwrap(), "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["checked"], true, "{v}");
        assert!(v["units"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(v["bytes"], v["bytes"]);
        let b = backend::open_single(p, Role::Primary).unwrap();
        assert!(b.summary().checked);
    }
    // A GGUF has no checksums: unchecked, exit 0, and said.
    let o = run_rknot(&[
        "verify",
        "--integrity",
        demo_path("tiny-llama.gguf").to_str().unwrap(),
    ]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("unchecked"));
}

#[test]
fn rknot_corruption_matrix() {
    let f = encoded();
    let src = std::fs::read(&f.rknot).unwrap();
    let n = src.len() as u64;
    let (index_len, header_len) = (
        u64::from_le_bytes(src[src.len() - 24..src.len() - 16].try_into().unwrap()),
        u64::from_le_bytes(src[src.len() - 16..src.len() - 8].try_into().unwrap()),
    );
    let header_at = n - 24 - header_len;
    let index_at = header_at - index_len;

    // Header JSON and block index: the KSUM record refuses the file.
    let p = damaged(&f.rknot, "header.rknot", flip(header_at + header_len / 2));
    refused_at_open(&p, ErrorKind::Checksum, "the header or index is damaged");
    let p = damaged(&f.rknot, "index.rknot", flip(index_at + 1));
    refused_at_open(&p, ErrorKind::Checksum, "the header or index is damaged");

    // A compressed block's payload: that tensor fails, the rest serve.
    let q = "blk.1.attn_q.weight";
    let (start, end) = stored_range(&f.rknot, q);
    let p = damaged(&f.rknot, "payload.rknot", flip((start + end) / 2));
    only_tensor_fails(&f.rknot, &p, q);

    // A tensor stored as ggml blocks (the output norm, f32).
    let norm = "output_norm.weight";
    let (start, _) = stored_range(&f.rknot, norm);
    let p = damaged(&f.rknot, "dense.rknot", flip(start + 5));
    only_tensor_fails(&f.rknot, &p, norm);

    // Two equal-length blocks of one tensor swapped.
    let file = match ParsedFile::open(&f.rknot).unwrap() {
        ParsedFile::Rknot(_, file) => file,
        _ => unreachable!(),
    };
    let t = file
        .tensors
        .iter()
        .find(|t| rknot::names::canonical(&t.name) == "blk.1.ffn_down.weight")
        .unwrap();
    let (mut a, mut b) = (None, None);
    'find: for i in 0..t.blocks.len() {
        for j in i + 1..t.blocks.len() {
            let (oi, li) = t.blocks.get(i).unwrap();
            let (oj, lj) = t.blocks.get(j).unwrap();
            let (bi, bj) = (
                &src[oi as usize..][..li as usize],
                &src[oj as usize..][..lj as usize],
            );
            if li == lj && bi != bj {
                (a, b) = (Some((oi, li)), Some(oj));
                break 'find;
            }
        }
    }
    let ((oa, len), ob) = (a.unwrap(), b.unwrap());
    let p = damaged(&f.rknot, "swapped.rknot", |v| {
        let (oa, ob, len) = (oa as usize, ob as usize, len as usize);
        let block_a = v[oa..oa + len].to_vec();
        v.copy_within(ob..ob + len, oa);
        v[ob..ob + len].copy_from_slice(&block_a);
    });
    only_tensor_fails(&f.rknot, &p, "blk.1.ffn_down.weight");

    // A block cut short (one byte of a payload removed): the layout no
    // longer adds up, and the file is refused.
    let p = damaged(&f.rknot, "cut.rknot", |v| {
        v.remove(((start + end) / 2) as usize);
    });
    assert!(ParsedFile::open(&p).is_err());
    let o = run_rknot(&["verify", "--integrity", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    // The file cut short: its footer is gone.
    let p = damaged(&f.rknot, "short.rknot", |v| v.truncate(v.len() - 100));
    refused_at_open(&p, ErrorKind::BadMagic, "RKNOTEND");
}

#[test]
fn sk32_and_knot_corruption_matrix() {
    let f = encoded();
    // An SK32 factor byte (U of one sketch).
    let q = "blk.0.attn_q.weight";
    let (start, _) = stored_range(&f.sk32, q);
    let p = damaged(&f.sk32, "factor.sk32", flip(start + 3));
    only_tensor_fails(&f.sk32, &p, q);
    // Its meta JSON.
    let p = damaged(&f.sk32, "meta.sk32", flip(20));
    refused_at_open(&p, ErrorKind::Checksum, "the header or index is damaged");
    // A dense .knot tensor's bytes.
    let up = "blk.1.ffn_up.weight";
    let (start, end) = stored_range(&f.knot, up);
    let p = damaged(&f.knot, "data.knot", flip((start + end) / 2));
    only_tensor_fails(&f.knot, &p, up);
    // Truncated: the KSUM record is gone while every tensor has crc32.
    let p = damaged(&f.knot, "short.knot", |v| v.truncate(v.len() - 3));
    refused_at_open(&p, ErrorKind::Checksum, "no KSUM record");
}

needs! { [fuse]
fn the_mount_fails_only_the_damaged_tensor_and_counts_it() {
    if !fuse_available() {
        return;
    }
    let f = encoded();
    let q = "blk.1.attn_q.weight";
    let (start, end) = stored_range(&f.rknot, q);
    let p = damaged(&f.rknot, "mounted.rknot", flip((start + end) / 2));
    let m = Mounted::new(&p, &[]);
    let e = std::fs::read(m.path(&format!("{q}.f32"))).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // Everything else serves, and equals the undamaged file's bytes.
    let want = decode_all(&f.rknot);
    for (name, w) in &want {
        if name != q {
            let got = std::fs::read(m.path(&format!("{name}.f32"))).unwrap();
            assert_eq!(&got, w.as_ref().unwrap(), "{name}");
        }
    }
    let ctl = m.ctl_json();
    assert!(
        ctl["reads"]["checksum_errors"].as_u64().unwrap() >= 1,
        "{ctl}"
    );
    assert_eq!(ctl["source"]["checked"], true, "{ctl}");
    let log = m.log();
    assert!(log.contains(q) && log.contains("CRC-32"), "{log}");
    // Read again: still EIO, still one log line per window for it.
    assert!(std::fs::read(m.path(&format!("{q}.f32"))).is_err());
    let _ = &f.dir;
}
}

/// Files written before checksums existed (the same files with the record
/// and every checksum field removed) open as unchecked and serve exactly
/// the same bytes: the read path without checksums (blocks read in runs)
/// agrees with the one with them.
#[test]
fn files_without_checksums_serve_the_same_bytes() {
    let f = encoded();
    for p in [&f.rknot, &f.sk32, &f.knot] {
        let plain = p.with_extension(format!(
            "plain.{}",
            p.extension().unwrap().to_str().unwrap()
        ));
        rknot::bench::strip_checksums(p, &plain).unwrap();
        let b = backend::open_single(&plain, Role::Primary).unwrap();
        assert!(!b.summary().checked, "{}", plain.display());
        let want = decode_all(p);
        let got = decode_all(&plain);
        assert_eq!(want.len(), got.len());
        for ((name, w), (_, g)) in want.iter().zip(&got) {
            assert_eq!(g.as_ref().unwrap(), w.as_ref().unwrap(), "{name}");
        }
        let o = run_rknot(&["verify", "--integrity", plain.to_str().unwrap()]);
        assert!(o.status.success());
        assert!(String::from_utf8_lossy(&o.stdout).contains("unchecked"));
    }
}
