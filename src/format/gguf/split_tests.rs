use std::path::{Path, PathBuf};

use super::*;
use crate::format::gguf::write_gguf;
use crate::quant::GgmlType;

/// One shard's header: split keys (no, count, tensors count) and extra
/// metadata, then its tensors (4 f32 each, valued by their index).
struct Spec<'a> {
    no: u64,
    count: u64,
    total: i32,
    meta: &'a [(&'a str, &'a str)],
    tensors: &'a [&'a str],
}

fn write_shard(path: &Path, s: &Spec) {
    let mut md = Metadata::default();
    for (k, v) in s.meta {
        md.push(*k, MetaValue::String(v.to_string()));
    }
    md.push(SPLIT_NO, MetaValue::U16(s.no as u16));
    md.push(SPLIT_COUNT, MetaValue::U16(s.count as u16));
    md.push(SPLIT_TENSORS_COUNT, MetaValue::I32(s.total));
    let data: Vec<Vec<u8>> = (0..s.tensors.len())
        .map(|i| {
            (0..4)
                .flat_map(|j| ((i * 4 + j) as f32).to_le_bytes())
                .collect()
        })
        .collect();
    let tensors: Vec<_> = s
        .tensors
        .iter()
        .zip(&data)
        .map(|(n, d)| (n.to_string(), vec![4u64], GgmlType::F32, &d[..]))
        .collect();
    let mut bytes = Vec::new();
    write_gguf(&mut bytes, &md, &tensors, 32).unwrap();
    std::fs::write(path, bytes).unwrap();
}

const ARCH: &[(&str, &str)] = &[("general.architecture", "llama")];

/// A good set of three in `dir`: `m-0000k-of-00003.gguf`, shard 0 holding
/// the metadata and no tensors when `small_first`.
fn write_set(dir: &Path, small_first: bool) -> Vec<PathBuf> {
    let groups: [&[&str]; 3] = if small_first {
        [&[], &["a.weight", "b.weight"], &["c.weight"]]
    } else {
        [&["a.weight"], &["b.weight"], &["c.weight"]]
    };
    (0..3)
        .map(|i| {
            let p = dir.join(format!("m-{:05}-of-00003.gguf", i + 1));
            let meta = if i == 0 { ARCH } else { &[] };
            write_shard(
                &p,
                &Spec {
                    no: i,
                    count: 3,
                    total: 3,
                    meta,
                    tensors: groups[i as usize],
                },
            );
            p
        })
        .collect()
}

fn open_path(p: &Path) -> Result<GgufSplit> {
    let src = SourceFile::open(p)?;
    let g = GgufFile::read(&src)?;
    assert!(is_shard(&g, p).unwrap());
    GgufSplit::open(src, g)
}

fn refusal(p: &Path) -> String {
    open_path(p).expect_err("refused").to_string()
}

#[test]
fn shard_names_parse_as_llama_cpp_writes_them() {
    let n = ShardName::parse("Model-Q4-00002-of-00003.gguf").unwrap();
    assert_eq!((n.prefix.as_str(), n.no, n.count), ("Model-Q4", 1, 3));
    assert_eq!(n.of_shard(0), "Model-Q4-00001-of-00003.gguf");
    for bad in [
        "m-2-of-3.gguf",
        "m-00004-of-00003.gguf",
        "m-00000-of-00003.gguf",
        "-00001-of-00003.gguf",
        "m-00001-of-00003.bin",
        "m-+0001-of-00003.gguf",
        "m.gguf",
    ] {
        assert_eq!(ShardName::parse(bad), None, "{bad}");
    }
}

#[test]
fn any_shard_opens_the_whole_set_with_the_first_shards_metadata() {
    for small_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let paths = write_set(dir.path(), small_first);
        for p in &paths {
            let set = open_path(p).unwrap();
            assert_eq!(set.shards.len(), 3);
            for (i, s) in set.shards.iter().enumerate() {
                assert_eq!(s.src.path(), paths[i]);
            }
            let names: Vec<_> = set
                .shards
                .iter()
                .flat_map(|s| s.file.tensors.iter().map(|t| t.name.as_str()))
                .collect();
            assert_eq!(names, ["a.weight", "b.weight", "c.weight"]);
            let md = set.metadata();
            assert_eq!(md.architecture(), Some("llama"));
            assert!(md.entries.iter().all(|(k, _)| !k.starts_with("split.")));
        }
        assert_eq!(
            dir_member(dir.path()).unwrap().as_deref(),
            Some(paths[0].as_path())
        );
    }
}

#[test]
fn a_missing_shard_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_set(dir.path(), false);
    std::fs::remove_file(&paths[1]).unwrap();
    for p in [&paths[0], &paths[2]] {
        let e = refusal(p);
        assert!(e.contains("m-00002-of-00003.gguf"), "{e}");
        assert!(
            e.contains("shard 2 of the split set of 3 is missing"),
            "{e}"
        );
    }
    // Through the directory too: the set is found, then refused.
    let member = dir_member(dir.path()).unwrap().unwrap();
    assert!(refusal(&member).contains("m-00002-of-00003.gguf"));
}

#[test]
fn an_extra_shard_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_set(dir.path(), false);
    let extra = dir.path().join("m-00004-of-00004.gguf");
    std::fs::copy(&paths[2], &extra).unwrap();
    let e = refusal(&paths[0]);
    assert!(
        e.contains("m-00004-of-00004.gguf") && e.contains("extra shard"),
        "{e}"
    );
    // A directory of two sets is ambiguous.
    std::fs::remove_file(&extra).unwrap();
    let other = dir.path().join("n-00001-of-00002.gguf");
    std::fs::copy(&paths[0], &other).unwrap();
    let e = dir_member(dir.path()).unwrap_err().to_string();
    assert!(e.contains("more than one model"), "{e}");
    assert!(
        e.contains("n-00001-of-00002.gguf") && e.contains("m-00001-of-00003.gguf"),
        "{e}"
    );
}

#[test]
fn a_duplicated_or_reordered_shard_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_set(dir.path(), false);
    // Shard 1's bytes under shard 2's name: split.no disagrees with it.
    std::fs::copy(&paths[0], &paths[1]).unwrap();
    let e = refusal(&paths[0]);
    assert!(e.contains("m-00002-of-00003.gguf"), "{e}");
    assert!(e.contains("split.no is 0"), "{e}");
    // Opened from the copy itself: the same verdict about itself.
    let e = refusal(&paths[1]);
    assert!(e.starts_with(&paths[1].display().to_string()), "{e}");
}

#[test]
fn a_foreign_shard_or_mismatched_counts_are_refused_naming_the_shard() {
    let cases: [(&str, Spec, &str); 4] = [
        (
            "another set's count",
            Spec {
                no: 1,
                count: 4,
                total: 3,
                meta: &[],
                tensors: &["b.weight"],
            },
            "split.count is 4",
        ),
        (
            "another set's tensor count",
            Spec {
                no: 1,
                count: 3,
                total: 5,
                meta: &[],
                tensors: &["b.weight"],
            },
            "split.tensors.count is 5",
        ),
        (
            "a tensor of another shard",
            Spec {
                no: 1,
                count: 3,
                total: 3,
                meta: &[],
                tensors: &["a.weight"],
            },
            "is in shard 1 too",
        ),
        (
            "another architecture",
            Spec {
                no: 1,
                count: 3,
                total: 3,
                meta: &[("general.architecture", "qwen2")],
                tensors: &["b.weight"],
            },
            "general.architecture",
        ),
    ];
    for (what, spec, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let paths = write_set(dir.path(), false);
        write_shard(&paths[1], &spec);
        let e = refusal(&paths[2]);
        assert!(e.contains("m-00002-of-00003.gguf"), "{what}: {e}");
        assert!(e.contains(want), "{what}: {e}");
    }
    // Every shard agrees with the others, but the set holds fewer tensors
    // than it says.
    let dir = tempfile::tempdir().unwrap();
    let paths = write_set(dir.path(), false);
    write_shard(
        &paths[2],
        &Spec {
            no: 2,
            count: 3,
            total: 3,
            meta: &[],
            tensors: &[],
        },
    );
    let e = refusal(&paths[1]);
    assert!(
        e.contains("hold 2 tensors, but split.tensors.count says 3"),
        "{e}"
    );
    assert!(e.contains("m-00001-of-00003.gguf"), "{e}");
}

#[test]
fn a_shard_not_named_as_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_set(dir.path(), false);
    let renamed = dir.path().join("model.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let e = refusal(&renamed);
    assert!(e.contains("PREFIX-NNNNN-of-NNNNN.gguf"), "{e}");
    // Named as a set of 2 while it says 3.
    let two = dir.path().join("m-00001-of-00002.gguf");
    std::fs::rename(&renamed, &two).unwrap();
    let e = refusal(&two);
    assert!(
        e.contains("named as one of 2 shards, but its split.count is 3"),
        "{e}"
    );
}
