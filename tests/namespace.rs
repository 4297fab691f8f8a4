//! The mount's namespace under hostile or extreme files: many tensors
//! (listings and index.json in pages, bounded memory), tensors too large
//! for `stat`, and names with control characters.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::format::gguf::write_gguf;
use rknot::format::meta::{MetaValue, Metadata};
use rknot::quant::GgmlType;

/// A GGUF with `n` one-element F32 tensors `t.<i>.weight`.
fn many_tensors(path: &Path, n: usize) {
    let data = 1f32.to_le_bytes();
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = (0..n)
        .map(|i| (format!("t.{i}.weight"), vec![1], GgmlType::F32, &data[..]))
        .collect();
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    write_gguf(&mut f, &md, &tensors, 32).unwrap();
}

needs! { [fuse]
/// Item 10: 65,536 tensors (the readers' cap) mount quickly in bounded
/// memory; `ls` pages through 131,074 names; index.json, served in pages,
/// is whole and valid.
fn many_tiny_tensors_mount_list_and_index_in_bounded_memory() {
    if !fuse_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("many.gguf");
    let n = 65_536;
    many_tensors(&model, n);
    let t0 = Instant::now();
    let m = Mounted::new(&model, &["-o", "nojobs"]);
    let mount_s = t0.elapsed().as_secs_f64();
    // . and .. are not returned by read_dir; index.json, ctl, and the two
    // views (metadata lacks what llama.cpp needs: no model.gguf).
    let names = std::fs::read_dir(&m.mp).unwrap().count();
    let index_bytes = std::fs::read(m.path("index.json")).unwrap();
    let index: serde_json::Value = serde_json::from_slice(&index_bytes).unwrap();
    let tensors = index["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), n);
    assert_eq!(tensors[n - 1]["name"], format!("t.{}.weight", n - 1));
    assert_eq!(
        tensors[7]["files"],
        serde_json::json!(["t_7_weight.f32", "t.7.weight.f32"])
    );
    // Pages agree with the whole: read it again in odd-sized pieces.
    let mut pieces = Vec::new();
    let f = std::fs::File::open(m.path("index.json")).unwrap();
    let mut off = 0u64;
    loop {
        let mut buf = vec![0u8; 12_345];
        let k = std::os::unix::fs::FileExt::read_at(&f, &mut buf, off).unwrap();
        if k == 0 {
            break;
        }
        pieces.extend_from_slice(&buf[..k]);
        off += k as u64;
    }
    assert_eq!(pieces, index_bytes);
    assert!(names >= 2 * n, "{names}");
    let rss_mib = m.peak_rss_kib() / 1024;
    eprintln!(
        "{n} tensors: mounted in {mount_s:.2} s, {names} names, index.json {} B, daemon peak RSS {rss_mib} MiB",
        index_bytes.len()
    );
    // index.json alone is ~30 MB for this file: it must not be held whole.
    assert!(
        (index_bytes.len() as u64) > 25 << 20,
        "{}",
        index_bytes.len()
    );
    assert!(rss_mib < 200, "daemon peak RSS {rss_mib} MiB");
}
}

needs! { [fuse]
/// Item 13: a tensor whose f32 file would exceed i64::MAX bytes (what
/// `stat` can report) gets no file, and the mount says why; everything else
/// is served.
fn tensors_larger_than_stat_can_report_are_not_offered() {
    if !fuse_available() {
        return;
    }
    use rknot::format::rknot::{
        Coding, Manifest, RKNOT_MAGIC_V2, TensorSpec, write_rknot_v2,
    };
    // A valid .rknot whose one tensor is [d, d] with d = 1.5 * 2^30, all
    // rows and columns restricted to 2 standing indices: a few hundred
    // bytes that declare 2^61.2 elements (2^63.2 bytes of f32).
    let small_d = 4;
    let manifest = Manifest {
        d: small_d,
        standing_indices: vec![0, 2],
        amplitudes: vec![1.0, 0.5],
        phase_alignment: vec![1.0, 0.75],
    };
    let spec = TensorSpec {
        name: "blk.0.attn_q.weight".into(),
        d_out: small_d,
        d_in: small_d,
        restrict_rows: true,
        restrict_cols: true,
        coding: Coding::Uniform { bits: 8 },
        block_rows: 2,
        block_cols: 2,
    };
    let dense: Vec<f32> = (0..16).map(|i| i as f32 / 16.0 - 0.5).collect();
    let (arch, layers) = common::one_tensor_rknot_parts(&manifest, spec, &dense);
    // Version 2: its header is right after a 10-byte prefix, easy to edit.
    let mut base = Vec::new();
    write_rknot_v2(&mut base, &arch, &layers).unwrap();
    // Grow every dimension in the header JSON.
    let huge: u64 = 3 << 29;
    let len = u32::from_le_bytes(base[6..10].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&base[10..10 + len]).unwrap();
    let edited = header
        .replace(&format!("\"d\":{small_d}"), &format!("\"d\":{huge}"))
        .replace(
            &format!("\"shape\":[{small_d},{small_d}]"),
            &format!("\"shape\":[{huge},{huge}]"),
        )
        .replace(
            &format!("\"hidden_dim\":{small_d}"),
            &format!("\"hidden_dim\":{huge}"),
        );
    assert_ne!(edited, header, "header JSON layout changed: {header}");
    let mut file = RKNOT_MAGIC_V2.to_vec();
    file.extend_from_slice(&(edited.len() as u32).to_le_bytes());
    file.extend_from_slice(edited.as_bytes());
    file.extend_from_slice(&base[10 + len..]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.rknot");
    std::fs::write(&path, &file).unwrap();
    let info = run_rknot(&["inspect", "--json", path.to_str().unwrap()]);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let served = v["tensors"][0]["served_bytes"].as_u64().unwrap();
    assert!(served > i64::MAX as u64, "{served}");

    let m = Mounted::new(&path, &[]);
    // Every listed file can be stat'ed; the huge tensor is not listed.
    for e in std::fs::read_dir(&m.mp).unwrap() {
        let e = e.unwrap();
        std::fs::metadata(e.path()).unwrap_or_else(|err| panic!("{:?}: {err}", e.path()));
    }
    assert!(!m.path("blk.0.attn_q.weight.f32").exists());
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    assert_eq!(index["unserved"][0]["name"], "blk.0.attn_q.weight");
    assert!(
        index["unserved"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("largest file size stat can report")
    );
    assert!(
        m.ctl().contains("unserved:  blk.0.attn_q.weight"),
        "{}",
        m.ctl()
    );
}
}

needs! { [fuse]
/// Item 7 (the mount's part): a source whose file name and metadata hold
/// terminal escapes, CR and C1 controls: ctl, ctl.json, index.json and the
/// daemon's log carry them escaped, never raw.
fn control_characters_from_files_never_reach_ctl_index_or_log_raw() {
    if !fuse_available() {
        return;
    }
    let evil = "\u{1b}]0;owned\u{7}\r\u{9b}31m\u{202e}";
    let dir = tempfile::tempdir().unwrap();
    let path = dir
        .path()
        .join(format!("model{}.gguf", evil.replace('\u{202e}', "")));
    let src = demo_path("tiny-llama.gguf");
    let b = rknot::backend::open(&src, None).unwrap();
    let mut md = b.summary().metadata.clone();
    md.entries.retain(|(k, _)| k != "general.name");
    md.push("general.name", MetaValue::String(format!("name{evil}")));
    md.push(
        format!("evil{evil}.key"),
        MetaValue::String(evil.to_string()),
    );
    let tensors = decoded_f32_tensors(b.as_ref());
    let refs = as_f32_gguf(&tensors);
    let mut f = std::fs::File::create(&path).unwrap();
    write_gguf(&mut f, &md, &refs, 32).unwrap();
    drop(f);
    let m = Mounted::new(&path, &[]);
    let raw = |bytes: &[u8]| {
        let s = String::from_utf8_lossy(bytes);
        s.chars()
            .filter(|&c| {
                // Controls (C0, DEL, C1) and bidi overrides, newline and tab
                // aside.
                (c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'))
                    && c != '\n'
                    && c != '\t'
            })
            .count()
    };
    for name in ["ctl", "ctl.json", "index.json"] {
        let bytes = std::fs::read(m.path(name)).unwrap();
        assert_eq!(
            raw(&bytes),
            0,
            "{name}:\n{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.path("index.json")).unwrap()).unwrap();
    assert_eq!(
        index["metadata"]["general.name"]["value"],
        format!("name{evil}")
    );
    // Trigger a log line naming the file: a refused command quoting it.
    let _ = std::fs::write(m.path("ctl"), format!("bogus {evil}\n"));
    assert!(m.ctl().contains("\\x1b]0;owned\\x07"), "{}", m.ctl());
    assert_eq!(raw(m.log().as_bytes()), 0, "{}", m.log());
    assert!(m.log().contains("\\x1b"), "{}", m.log());
    let _ = std::fs::metadata(&path).unwrap().ino();
}
}
