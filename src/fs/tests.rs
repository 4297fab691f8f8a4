//! TensorFs driven directly (no FUSE): namespace, reads, views, ctl.
use std::path::Path;

use serde_json::{Value, json};

use super::views::ElemFormat;
use super::*;
use crate::backend;

/// The daemon's own user (may command `ctl`).
fn me() -> Caller {
    // SAFETY: geteuid/getegid have no preconditions.
    unsafe {
        Caller {
            uid: libc::geteuid(),
            gid: libc::getegid(),
            pid: std::process::id(),
        }
    }
}

/// Open for reading as the daemon's user.
fn open_ro(fs: &TensorFs, ino: u64) -> std::result::Result<OpenMode, i32> {
    fs.open(ino, true, false, me())
}

/// Open for writing as the daemon's user.
fn open_wo(fs: &TensorFs, ino: u64) -> std::result::Result<OpenMode, i32> {
    fs.open(ino, false, true, me())
}

/// Names in directory `ino`, listed page by page (`page` entries per call).
fn list(
    fs: &TensorFs,
    ino: u64,
    page: usize,
) -> std::result::Result<Vec<(u64, Kind, String)>, i32> {
    let mut out = Vec::new();
    let mut offset = 0;
    loop {
        let mut got = 0;
        fs.readdir(ino, offset, |next, ino, kind, name| {
            out.push((ino, kind, name.to_string()));
            offset = next;
            got += 1;
            got == page
        })?;
        if got < page {
            return Ok(out);
        }
    }
}

fn demo_fs(config: FsConfig) -> TensorFs {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo");
    let b = backend::open(
        &d.join("tiny-llama.rknot"),
        Some(&d.join("tiny-llama.gguf")),
    )
    .unwrap();
    TensorFs::new(Arc::from(b), config)
}

fn expected(fs: &TensorFs, name: &str) -> Vec<u8> {
    let b = fs.backend();
    let i = b.find(name).unwrap();
    let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
    b.read_f32(i, 0, &mut v).unwrap();
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn open_fs(src: &str, dense: Option<&str>, config: FsConfig) -> TensorFs {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo");
    let b = backend::open(&d.join(src), dense.map(|x| d.join(x)).as_deref()).unwrap();
    TensorFs::new(Arc::from(b), config)
}

fn all_views() -> ViewSet {
    ViewSet {
        f16: true,
        bf16: true,
    }
}

/// The whole of a file, read in pieces of `step` bytes through one
/// handle.
fn read_all(fs: &TensorFs, ino: u64, step: u32) -> Vec<u8> {
    let fh = open_ro(fs, ino).unwrap().fh;
    let mut out = Vec::new();
    loop {
        let d = fs.read(ino, fh, out.len() as u64, step).unwrap();
        if d.bytes().is_empty() {
            break;
        }
        out.extend_from_slice(d.bytes());
    }
    fs.release(fh);
    out
}

fn encoded(vals: &[u8], fmt: ElemFormat) -> Vec<u8> {
    let v: Vec<f32> = vals
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    match fmt {
        ElemFormat::F32 => vals.to_vec(),
        ElemFormat::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        ElemFormat::Bf16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

#[test]
fn view_inodes_names_and_sizes() {
    let fs = demo_fs(FsConfig {
        views: all_views(),
        ..FsConfig::default()
    });
    for (name, ino) in [
        ("model.safetensors", 4),
        ("model.gguf", 5),
        ("model.f16.safetensors", 6),
        ("model.bf16.safetensors", 7),
    ] {
        let a = fs.lookup(ROOT_INO, name).unwrap();
        assert_eq!((a.ino, a.perm, a.nlink), (ino, 0o444, 1), "{name}");
    }
    let f32a = fs.lookup(ROOT_INO, "blk.0.attn_q.weight.f32").unwrap();
    for (ext, k) in [("f16", 1u64), ("bf16", 2)] {
        let a = fs
            .lookup(ROOT_INO, &format!("blk.0.attn_q.weight.{ext}"))
            .unwrap();
        let b = fs
            .lookup(ROOT_INO, &format!("blk_0_attn_q_weight.{ext}"))
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(a.ino, f32a.ino + k * (1 << 32));
        assert_eq!((a.size, a.nlink), (f32a.size / 2, 2));
    }
    let n = list(&fs, ROOT_INO, 7).unwrap().len();
    // . .. index.json ctl ctl.json, 5 views, hf/, 2 names x 3 formats
    // per tensor.
    assert_eq!(n, 2 + 3 + 5 + 1 + 21 * 2 * 3);
    // hf/: its block of inodes at 2^47.
    let hf = fs.lookup(ROOT_INO, "hf").unwrap();
    assert_eq!((hf.ino, hf.kind), (super::inodes::HF_DIR_INO, Kind::Dir));
    for (name, ino) in [
        ("config.json", 1),
        ("generation_config.json", 2),
        ("model.safetensors", 5),
        ("model.f16.safetensors", 6),
        ("model.bf16.safetensors", 7),
    ] {
        let a = fs.lookup(hf.ino, name).unwrap();
        assert_eq!(a.ino, hf.ino + ino, "hf/{name}");
    }
    // The demo's vocabulary has no merges: no tokenizer files.
    assert_eq!(fs.lookup(hf.ino, "tokenizer.json"), Err(libc::ENOENT));
    let hf_names: Vec<String> = list(&fs, hf.ino, 3)
        .unwrap()
        .into_iter()
        .map(|e| e.2)
        .collect();
    assert_eq!(
        hf_names,
        [
            ".",
            "..",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "model.f16.safetensors",
            "model.bf16.safetensors"
        ]
    );
    assert_eq!(fs.lookup(ROOT_INO, "config.json"), Err(libc::ENOENT));
    assert_eq!(open_ro(&fs, hf.ino).map(|_| ()), Err(libc::EISDIR));
    // Without --views f16/bf16 the half files and views do not exist,
    // and the f32 inodes are the same.
    let plain = demo_fs(FsConfig::default());
    assert_eq!(
        plain.lookup(ROOT_INO, "blk.0.attn_q.weight.f16"),
        Err(libc::ENOENT)
    );
    assert_eq!(
        plain.lookup(ROOT_INO, "model.f16.safetensors"),
        Err(libc::ENOENT)
    );
    assert_eq!(plain.getattr(f32a.ino + (1 << 32)), Err(libc::ENOENT));
    assert_eq!(plain.getattr(6), Err(libc::ENOENT));
    assert_eq!(
        plain
            .lookup(ROOT_INO, "blk.0.attn_q.weight.f32")
            .unwrap()
            .ino,
        f32a.ino
    );
    assert_eq!(open_wo(&plain, 5), Err(libc::EROFS));
}

#[test]
fn building_and_reading_view_headers_decodes_nothing() {
    // No read-ahead threads: a reader at byte 0 gets a one-chunk window,
    // which would decode the first tensor's first chunk.
    let fs = demo_fs(FsConfig {
        views: all_views(),
        prefetch_threads: 0,
        ..FsConfig::default()
    });
    // The root's 5 and hf/'s 3 (a .rknot's native view: transcoded).
    assert_eq!(fs.ns.views.len(), 8);
    for v in &fs.ns.views {
        let l = v.layout.as_ref().unwrap();
        let ino = v.view.ino();
        let fh = open_ro(&fs, ino).unwrap().fh;
        // The header and the padding up to the first tensor.
        let n = l.segments()[0].start as u32;
        let h = fs.read(ino, fh, 0, n).unwrap();
        assert_eq!(&h.bytes()[..l.header().len()], l.header());
    }
    let s = fs.cache_stats();
    assert_eq!((s.misses, s.bytes_decoded), (0, 0), "{s:?}");
}

#[test]
fn gguf_view_is_write_gguf_of_the_decoded_tensors() {
    for (src, dense) in [
        ("tiny-llama.gguf", None),
        ("tiny-llama.rknot", Some("tiny-llama.gguf")),
        ("tiny-llama.sk32", Some("tiny-llama.gguf")),
    ] {
        let fs = open_fs(
            src,
            dense,
            FsConfig {
                chunk_bytes: 4096,
                ..FsConfig::default()
            },
        );
        let b = fs.backend().clone();
        let data: Vec<(String, Vec<u64>, Vec<u8>)> = b
            .tensors()
            .entries()
            .iter()
            .map(|t| {
                (
                    t.name.dot.clone(),
                    t.shape.iter().rev().copied().collect(),
                    expected(&fs, &t.name.dot),
                )
            })
            .collect();
        let tensors: Vec<(String, Vec<u64>, crate::quant::GgmlType, &[u8])> = data
            .iter()
            .map(|(n, ne, d)| (n.clone(), ne.clone(), crate::quant::GgmlType::F32, &d[..]))
            .collect();
        let (md, al) = views::gguf_metadata(files::view_metadata(b.as_ref()).0).unwrap();
        let mut want = Vec::new();
        crate::format::gguf::write_gguf(&mut want, &md, &tensors, al).unwrap();
        assert_eq!(fs.getattr(views::GGUF_INO).unwrap().size, want.len() as u64);
        // Odd read sizes straddle header, padding and tensor boundaries.
        for step in [4096, 1000, 65_537] {
            assert_eq!(
                read_all(&fs, views::GGUF_INO, step),
                want,
                "{src} step {step}"
            );
        }
    }
}

#[test]
fn safetensors_views_hold_every_tensor_in_order() {
    let fs = demo_fs(FsConfig {
        views: all_views(),
        chunk_bytes: 4096,
        ..FsConfig::default()
    });
    let b = fs.backend().clone();
    for (ino, fmt) in [
        (4, ElemFormat::F32),
        (6, ElemFormat::F16),
        (7, ElemFormat::Bf16),
    ] {
        let bytes = read_all(&fs, ino, 70_001);
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let header: serde_json::Map<String, Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let data = &bytes[8 + n..];
        let names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
        let want_names: Vec<&String> = b.tensors().entries().iter().map(|t| &t.name.dot).collect();
        assert_eq!(names, want_names, "backend order");
        let mut off = 0u64;
        for name in names {
            let e = &header[name.as_str()];
            assert_eq!(e["dtype"], fmt.dtype());
            let o = e["data_offsets"].as_array().unwrap();
            let (a, z) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            assert_eq!(a, off, "contiguous");
            off = z;
            assert_eq!(
                &data[a as usize..z as usize],
                encoded(&expected(&fs, name), fmt),
                "{name} {fmt:?}"
            );
        }
        assert_eq!(off as usize, data.len(), "data ends at EOF");
        let md = &header["__metadata__"];
        assert_eq!(md["general.architecture"], "llama");
        assert_eq!(md["llama.block_count"], "2");
        assert_eq!(md["llama.attention.layer_norm_rms_epsilon"], "1e-5");
        // Random reads of any size at any offset, past EOF included.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let fh = open_ro(&fs, ino).unwrap().fh;
        for _ in 0..300 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = x % (bytes.len() as u64 + 100);
            let len = (x >> 40) as u32 % 20_000;
            let d = fs.read(ino, fh, off, len).unwrap();
            let lo = (off as usize).min(bytes.len());
            let hi = (off as usize + len as usize).min(bytes.len());
            assert_eq!(d.bytes(), &bytes[lo..hi], "{ino} {off}+{len}");
        }
    }
}

#[test]
fn half_tensor_files_convert_the_f32_values() {
    let fs = demo_fs(FsConfig {
        views: all_views(),
        chunk_bytes: 4096,
        ..FsConfig::default()
    });
    for fmt in [ElemFormat::F16, ElemFormat::Bf16] {
        for name in [
            "blk.1.ffn_down.weight",
            "token_embd.weight",
            "output_norm.weight",
        ] {
            let ino = fs
                .lookup(ROOT_INO, &format!("{name}.{}", fmt.ext()))
                .unwrap()
                .ino;
            let want = encoded(&expected(&fs, name), fmt);
            assert_eq!(read_all(&fs, ino, 3001), want, "{name} {fmt:?}");
            let fh = open_ro(&fs, ino).unwrap().fh;
            let end = want.len() as u64;
            for (off, len) in [(1u64, 3u32), (end / 2 - 1, 4), (end - 1, 9), (end, 5)] {
                let d = fs.read(ino, fh, off, len).unwrap();
                let lo = (off as usize).min(want.len());
                let hi = (off as usize + len as usize).min(want.len());
                assert_eq!(d.bytes(), &want[lo..hi]);
            }
        }
    }
    // f16 files share the f32 files' cached chunks: no second decode.
    let before = fs.cache_stats().bytes_decoded;
    let ino = fs
        .lookup(ROOT_INO, "blk.1.ffn_down.weight.f32")
        .unwrap()
        .ino;
    read_all(&fs, ino, 4096);
    assert_eq!(fs.cache_stats().bytes_decoded, before);
}

#[test]
fn views_say_why_they_are_absent() {
    let index = |fs: &TensorFs| -> Value { serde_json::from_slice(&fs.index_json()).unwrap() };
    let view = |v: &Value, name: &str| -> Value {
        v["views"]["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["name"] == name)
            .unwrap()
            .clone()
    };
    // A bare SK32: no metadata, so no model.gguf; the safetensors view
    // has the sketched tensors.
    let fs = open_fs("tiny-llama.sk32", None, FsConfig::default());
    let v = index(&fs);
    let g = view(&v, "model.gguf");
    assert_eq!(g["available"], false);
    let why = g["unavailable_reason"].as_str().unwrap();
    assert!(
        why.contains("general.architecture") && why.contains("--dense"),
        "{why}"
    );
    assert_eq!(fs.lookup(ROOT_INO, "model.gguf"), Err(libc::ENOENT));
    assert!(fs.ctl_text().contains("model.gguf absent"));
    let st = view(&v, "model.safetensors");
    assert_eq!(st["available"], true);
    assert_eq!(st["tensors"], fs.n_tensor_files());
    // .rknot alone: metadata, but only the compressed layers' tensors.
    let fs = open_fs("tiny-llama.rknot", None, FsConfig::default());
    let g = view(&index(&fs), "model.gguf");
    let why = g["unavailable_reason"].as_str().unwrap();
    assert!(why.contains("lack token_embd.weight"), "{why}");
    // Layered over the GGUF: both views, metadata from the fallback.
    let fs = demo_fs(FsConfig::default());
    let v = index(&fs);
    assert_eq!(v["views"]["metadata_from"], "fallback");
    assert_eq!(view(&v, "model.gguf")["available"], true);
    assert_eq!(v["views"]["tensor_formats"], json!(["f32"]));
    // model.safetensors, model.gguf, model.native.gguf (the .rknot's
    // blocks decoded or re-packed, the fallback's as stored),
    // hf/model.safetensors.
    assert!(v["views"]["files"].as_array().unwrap().len() == 4);
    assert_eq!(view(&v, "model.native.gguf")["available"], true);
    assert_eq!(v["views"]["hf"]["available"], true);
    let t0 = &v["tensors"][0]["files"];
    assert_eq!(
        *t0,
        json!(["token_embd_weight.f32", "token_embd.weight.f32"])
    );
}

#[test]
fn namespace_and_attributes() {
    let fs = demo_fs(FsConfig {
        uid: 7,
        gid: 8,
        ..FsConfig::default()
    });
    let a = fs.lookup(ROOT_INO, "blk.0.attn_q.weight.f32").unwrap();
    let b = fs.lookup(ROOT_INO, "blk_0_attn_q_weight.f32").unwrap();
    assert_eq!(a, b);
    assert_eq!(
        (a.size, a.perm, a.nlink, a.uid, a.gid),
        (256 * 256 * 4, 0o444, 2, 7, 8)
    );
    // token_embd, attn_norm, then attn_q: inode from the source's order.
    assert_eq!(a.ino, FIRST_TENSOR_INO + 2);
    assert_eq!(fs.lookup(ROOT_INO, "nope.f32"), Err(libc::ENOENT));
    assert_eq!(fs.lookup(a.ino, "x"), Err(libc::ENOENT));
    assert_eq!(fs.getattr(CTL_INO).unwrap().perm, 0o600);
    // ctl starts jobs with the daemon's rights: owned by the daemon's
    // user, not by -o uid=.
    // SAFETY: geteuid has no preconditions.
    assert_eq!(fs.getattr(CTL_INO).unwrap().uid, unsafe { libc::geteuid() });
    assert_eq!(fs.getattr(ROOT_INO).unwrap().kind, Kind::Dir);
    let names: Vec<String> = list(&fs, ROOT_INO, 5)
        .unwrap()
        .into_iter()
        .map(|e| e.2)
        .collect();
    // . .. index.json ctl ctl.json model.safetensors model.gguf
    // model.native.gguf hf, 2 names per tensor.
    assert_eq!(names.len(), 2 + 3 + 3 + 1 + 21 * 2);
    assert!(names.contains(&"index.json".to_string()) && names.contains(&"ctl".to_string()));
    // ctl.json without jobs: the read-only status, for every reader.
    assert!(names.contains(&"ctl.json".to_string()));
    assert_eq!(fs.getattr(CTL_JSON_INO).unwrap().perm, 0o444);
    assert_eq!(list(&fs, a.ino, 100), Err(libc::ENOTDIR));
    // hf/: the directory, config.json, generation_config.json and its
    // model.safetensors.
    assert_eq!(fs.statfs().files, 3 + 21 + 3 + 4);
}

#[test]
fn reads_match_the_backend_at_any_offset() {
    let fs = demo_fs(FsConfig {
        chunk_bytes: 4096,
        ..FsConfig::default()
    });
    let ino = fs
        .lookup(ROOT_INO, "blk.1.ffn_down.weight.f32")
        .unwrap()
        .ino;
    let want = expected(&fs, "blk.1.ffn_down.weight");
    let fh = open_ro(&fs, ino).unwrap().fh;
    for (off, len) in [
        (0u64, 4096u32),
        (1, 3),
        (4095, 2),
        (4000, 70_000),
        (want.len() as u64 - 1, 10),
        (want.len() as u64, 10),
    ] {
        let d = fs.read(ino, fh, off, len).unwrap();
        let lo = (off as usize).min(want.len());
        let hi = (off as usize + len as usize).min(want.len());
        assert_eq!(d.bytes(), &want[lo..hi], "{off}+{len}");
    }
    // Sequential reads trigger read-ahead; everything still matches.
    let mut all = Vec::new();
    let mut off = 0;
    while off < want.len() as u64 {
        let d = fs.read(ino, fh, off, 10_000).unwrap();
        off += d.bytes().len() as u64;
        all.extend_from_slice(d.bytes());
    }
    assert_eq!(all, want);
    fs.release(fh);
    assert!(
        fs.ctl_text().contains("small uncached"),
        "{}",
        fs.ctl_text()
    );
}

#[test]
fn writes_and_ctl_commands() {
    let fs = demo_fs(FsConfig::default());
    let ino = fs.lookup(ROOT_INO, "output.weight.f32").unwrap().ino;
    assert_eq!(open_wo(&fs, ino), Err(libc::EROFS));
    assert_eq!(open_wo(&fs, INDEX_INO), Err(libc::EROFS));
    assert_eq!(open_ro(&fs, ROOT_INO), Err(libc::EISDIR));
    let ctl = open_wo(&fs, CTL_INO).unwrap();
    assert!(ctl.direct_io);
    let fh = open_ro(&fs, ino).unwrap().fh;
    fs.read(ino, fh, 0, 1 << 20).unwrap();
    assert!(fs.cache_stats().bytes_used > 0);
    assert_eq!(fs.write_ctl(ctl.fh, b"drop-cache\n", me()), Ok(11));
    assert_eq!(fs.cache_stats().bytes_used, 0);
    assert_eq!(fs.write_ctl(ctl.fh, b"explode\n", me()), Err(libc::EINVAL));
    assert!(fs.ctl_text().contains("unknown command \"explode\""));
    let index: serde_json::Value = serde_json::from_slice(&fs.index_json()).unwrap();
    assert_eq!(index["tensors"].as_array().unwrap().len(), 21);
    assert_eq!(index["fallback"]["format"], "gguf");
    let tok = &index["metadata"]["tokenizer.ggml.tokens"];
    assert_eq!(
        tok["value"].as_array().unwrap().len(),
        256,
        "short arrays are kept whole"
    );
}

#[test]
fn listings_and_index_pages_agree_whatever_the_page_size() {
    let fs = demo_fs(FsConfig {
        views: all_views(),
        ..FsConfig::default()
    });
    let whole = list(&fs, ROOT_INO, 100_000).unwrap();
    for page in [1, 2, 3, 7, 64] {
        assert_eq!(list(&fs, ROOT_INO, page).unwrap(), whole, "page {page}");
    }
    // Every listed name looks up to the listed inode.
    for (ino, _, name) in &whole[2..] {
        assert_eq!(fs.lookup(ROOT_INO, name).unwrap().ino, *ino, "{name}");
    }
    // Names that are not listed do not resolve: aliases, other formats'
    // extensions, tensor names without extension.
    for bad in [
        "blk.0.attn_o.weight.f32",
        "blk.0.attn_q.weight",
        "blk.0.attn_q.weight.f64",
        "blk_0_attn_q.weight.f32",
    ] {
        assert_eq!(fs.lookup(ROOT_INO, bad), Err(libc::ENOENT), "{bad}");
    }
    let index = fs.index_json();
    let v: Value = serde_json::from_slice(&index).unwrap();
    assert_eq!(v["tensors"].as_array().unwrap().len(), 21);
    assert_eq!(fs.getattr(INDEX_INO).unwrap().size, index.len() as u64);
    let fh = open_ro(&fs, INDEX_INO).unwrap().fh;
    for step in [1u32, 13, 4096] {
        let mut got = Vec::new();
        loop {
            let d = fs.read(INDEX_INO, fh, got.len() as u64, step).unwrap();
            if d.bytes().is_empty() {
                break;
            }
            got.extend_from_slice(d.bytes());
        }
        assert_eq!(got, index, "step {step}");
    }
}

#[test]
fn ctl_commands_by_caller_snapshot_and_lines() {
    let fs = demo_fs(FsConfig::default());
    let stranger = Caller {
        uid: 54_321,
        gid: 54_321,
        pid: 1,
    };
    // Others may neither open ctl for writing nor write through a handle
    // the daemon's user opened.
    assert_eq!(fs.open(CTL_INO, false, true, stranger), Err(libc::EACCES));
    let ctl = open_wo(&fs, CTL_INO).unwrap();
    assert_eq!(
        fs.write_ctl(ctl.fh, b"drop-cache\n", stranger),
        Err(libc::EACCES)
    );
    // A command split across writes is one command.
    let ino = fs.lookup(ROOT_INO, "output.weight.f32").unwrap().ino;
    let fh = open_ro(&fs, ino).unwrap().fh;
    fs.read(ino, fh, 0, 1 << 20).unwrap();
    assert_eq!(fs.write_ctl(ctl.fh, b"drop-", me()), Ok(5));
    assert!(
        fs.cache_stats().bytes_used > 0,
        "not run before its newline"
    );
    assert_eq!(fs.write_ctl(ctl.fh, b"cache\n", me()), Ok(6));
    assert_eq!(fs.cache_stats().bytes_used, 0);
    // A good line and a bad one: nothing runs.
    fs.read(ino, fh, 0, 1 << 20).unwrap();
    assert_eq!(
        fs.write_ctl(ctl.fh, b"drop-cache\nexplode\n", me()),
        Err(libc::EINVAL)
    );
    assert!(fs.cache_stats().bytes_used > 0);
    assert!(
        fs.ctl_text().contains("line 2: explode"),
        "{}",
        fs.ctl_text()
    );
    // Without a newline it runs at flush.
    assert_eq!(fs.write_ctl(ctl.fh, b"drop-cache", me()), Ok(10));
    assert!(fs.cache_stats().bytes_used > 0);
    assert_eq!(fs.flush(ctl.fh, me()), Ok(()));
    assert_eq!(fs.cache_stats().bytes_used, 0);
    assert_eq!(
        fs.write_ctl(ctl.fh, b"drop-\xffcache\n", me()),
        Err(libc::EINVAL)
    );
    assert_eq!(
        fs.write_ctl(ctl.fh, &[b'a'; MAX_CTL_LINE + 1], me()),
        Err(libc::EINVAL)
    );
    fs.release(ctl.fh);
    // Reads of one open see the rendering made at open.
    let r = open_ro(&fs, CTL_INO).unwrap().fh;
    let first = fs.read(CTL_INO, r, 0, 1 << 20).unwrap().bytes().to_vec();
    for off in 0..20 {
        fs.read(ino, fh, off * 4096, 4096).unwrap();
    }
    let again = fs.read(CTL_INO, r, 0, 1 << 20).unwrap().bytes().to_vec();
    assert_eq!(first, again);
    fs.release(r);
    let fresh = open_ro(&fs, CTL_INO).unwrap().fh;
    assert_ne!(
        fs.read(CTL_INO, fresh, 0, 1 << 20).unwrap().bytes(),
        &first[..]
    );
}

#[test]
fn ctl_refusals_at_close_by_line_length_and_for_reads_of_a_write_handle() {
    let fs = demo_fs(FsConfig::default());
    let stranger = Caller {
        uid: 54_321,
        gid: 54_321,
        pid: 1,
    };
    let ctl = open_wo(&fs, CTL_INO).unwrap();
    // A complete line over the limit (the newline in the same write).
    let mut long = vec![b'a'; MAX_CTL_LINE + 1];
    long.push(b'\n');
    assert_eq!(fs.write_ctl(ctl.fh, &long, me()), Err(libc::EINVAL));
    assert!(
        fs.ctl_text().contains("line 1: longer than 4096 bytes"),
        "{}",
        fs.ctl_text()
    );
    // A last line without newline, closed by another user (a descriptor
    // handed over): not run.
    let ino = fs.lookup(ROOT_INO, "output.weight.f32").unwrap().ino;
    let fh = open_ro(&fs, ino).unwrap().fh;
    fs.read(ino, fh, 0, 1 << 20).unwrap();
    assert_eq!(fs.write_ctl(ctl.fh, b"drop-cache", me()), Ok(10));
    assert_eq!(fs.flush(ctl.fh, stranger), Err(libc::EACCES));
    assert!(fs.cache_stats().bytes_used > 0);
    // Opened for writing only: there is no snapshot to read.
    assert!(matches!(fs.read(CTL_INO, ctl.fh, 0, 100), Err(libc::EBADF)));
    fs.release(ctl.fh);
    assert!(
        fs.cache_stats().bytes_used > 0,
        "the refused line ran at release"
    );
}
