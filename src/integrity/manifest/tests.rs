use std::path::Path;

use sha2::{Digest as _, Sha256};

use super::*;

fn d(byte: u8) -> Digest {
    [byte; 32]
}

fn parse(text: &str) -> Result<Manifest> {
    Manifest::parse(text.as_bytes(), Path::new("/x/m.sums"))
}

fn msg(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

#[test]
fn lines_round_trip_with_gnu_escaping() {
    for (file, subject) in [
        (&b"m.gguf"[..], Subject::Whole),
        (b"m.gguf", Subject::Header),
        (b"m.gguf", Subject::Tensor("blk.0.attn_q.weight".into())),
        (b"a\\b.gguf", Subject::Whole),
        (b"new\nline.gguf", Subject::Header),
        (b"cr\r.gguf", Subject::Tensor("t\\x".into())),
        (b"\xff\xfe raw bytes", Subject::Whole),
    ] {
        let line = entry_line(file, &subject, &d(0xab));
        // One line, whatever the name holds.
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        assert!(!line[..line.len() - 1].contains(&b'\r'));
        let m = Manifest::parse(&line, Path::new("m.sums")).unwrap();
        let e = &m.entries()[0];
        assert_eq!(
            (e.file.as_slice(), &e.subject, e.digest),
            (file, &subject, d(0xab))
        );
    }
    // The exact bytes GNU sha256sum writes for such names.
    assert_eq!(
        entry_line(b"a\\b\nc", &Subject::Whole, &d(0)),
        format!("\\{}  a\\\\b\\nc\n", "0".repeat(64)).into_bytes()
    );
    assert_eq!(
        entry_line(b"m.gguf", &Subject::Tensor("x".into()), &d(0x01)),
        format!("#rknot {}  m.gguf//tensor/x\n", "01".repeat(32)).into_bytes()
    );
    assert_eq!(
        entry_line(b"m\\.gguf", &Subject::Header, &d(0)),
        format!("#rknot \\{}  m\\\\.gguf//header\n", "0".repeat(64)).into_bytes()
    );
}

#[test]
fn plain_sha256sums_parse() {
    let h = "0123456789abcdef".repeat(4);
    let upper = h.to_uppercase();
    let text =
        format!("# made by hand\n{h}  a.gguf\r\n{upper} *b.gguf\n\n{h}  ./c.gguf\n{h}  dir/d.gguf");
    let m = parse(&text).unwrap();
    assert_eq!(m.entries().len(), 4);
    let a = m.for_file(b"a.gguf");
    assert!(a.whole.is_some() && !a.per_tensor());
    assert_eq!(
        m.for_file(b"b.gguf").whole.map(|e| e.digest),
        a.whole.map(|e| e.digest)
    );
    assert_eq!(m.for_file(b"c.gguf").whole.map(|e| e.line), Some(5));
    // A path with a directory never matches a basename.
    assert!(m.for_file(b"d.gguf").is_empty());
    assert!(m.for_file(b"nope").is_empty());
}

#[test]
fn bad_manifests_name_the_file_and_line() {
    let h = "ab".repeat(32);
    for (text, want) in [
        (String::new(), "manifest is empty"),
        ("# only a comment\n".to_string(), "no entries"),
        (
            format!("{h}  a\n{}  b\n", "ab".repeat(16)),
            "line 2: a digest of 32 hex digits is not SHA-256",
        ),
        (format!("{h} a\n"), "line 1: expected a SHA-256 line"),
        (format!("{h}  \n"), "line 1: the name is empty"),
        (format!("{h}xx  a\n"), "line 1: expected a SHA-256 line"),
        (
            "SHA256 (a) = 00\n".to_string(),
            "line 1: BSD-style tagged line",
        ),
        (
            format!("{h}  a\n{h}  ./a\n"),
            "line 2: a is listed twice (first on line 1)",
        ),
        (format!("\\{h}  a\\tb\n"), "line 1: unknown escape \\t"),
        (format!("\\{h}  a\\\n"), "lone backslash"),
        (
            format!("#rknot {h}  a.gguf\n"),
            "line 1: an rknot line names a.gguf",
        ),
        (
            format!("#rknot {h}  a.gguf//body\n"),
            "expected BASENAME//header",
        ),
        (
            format!("#rknot {h}  //header\n"),
            "expected BASENAME//header",
        ),
        (
            format!("#rknot {h}  a.gguf//tensor/\n"),
            "expected BASENAME//header",
        ),
        (
            format!("#rknot {h} *a.gguf//header\n"),
            "no binary-mode marker",
        ),
        (
            format!("#rknot {h}  a//tensor/t\n#rknot {h}  a//tensor/t\n"),
            "line 2: a//tensor/t is listed twice",
        ),
    ] {
        let m = msg(&text);
        assert!(m.starts_with("/x/m.sums: "), "{m}");
        assert!(m.contains(want), "{text:?}: want {want:?} in {m}");
    }
    // Names reach terminals escaped.
    let m = msg(&format!("{h}  a\n{h}  a\x1b[2J\n{h}  a\x1b[2J\n"));
    assert!(!m.chars().any(crate::text::is_unsafe_char), "{m:?}");
    // Bounded before parsing.
    let big = vec![b'#'; (MAX_MANIFEST_BYTES + 1) as usize];
    let e = Manifest::parse(&big, Path::new("big.sums")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TooLarge);
}

#[test]
fn per_file_entries() {
    let h = "cd".repeat(32);
    let text = format!(
        "{h}  m.gguf\n#rknot {h}  m.gguf//header\n#rknot {h}  m.gguf//tensor/a\n\
         #rknot {h}  m.gguf//tensor/b\n{h}  other.gguf\n# a comment about #rknot\n"
    );
    let m = parse(&text).unwrap();
    let f = m.for_file(b"m.gguf");
    assert!(f.per_tensor() && f.whole.is_some() && f.header.is_some());
    let mut names: Vec<&str> = f.tensors.keys().copied().collect();
    names.sort();
    assert_eq!(names, ["a", "b"]);
    let o = m.for_file(b"other.gguf");
    assert!(!o.per_tensor() && o.whole.is_some());
}

/// The one-pass digests equal digests of the byte ranges computed apart,
/// for tensors in and out of file order, overlapping and touching, and
/// reads crossing the pass's pieces.
#[test]
fn one_pass_digests_equal_separate_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.bin");
    let len = READ_PIECE * 2 + 12345;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = crate::source::SourceFile::open(&path).unwrap();
    let p = READ_PIECE as u64;
    let t = |name: &str, ranges: &[(u64, u64)]| TensorBytes {
        name: name.into(),
        ranges: ranges.iter().map(|&(a, b)| a..b).collect(),
    };
    let tensors = vec![
        t("first", &[(100, 200)]),
        t("across", &[(p - 10, p + 10), (p + 10, p + 20)]),
        t("two_parts", &[(300, 400), (2 * p + 5, 2 * p + 100)]),
        t("out_of_order", &[(5000, 6000), (1000, 2000)]),
        t("overlaps_first", &[(150, 250)]),
        t("empty", &[]),
        t("to_the_end", &[(len as u64 - 7, len as u64)]),
    ];
    let sha = |parts: &[&[u8]]| -> Digest {
        let mut h = Sha256::new();
        for part in parts {
            h.update(part);
        }
        h.finalize().into()
    };
    let mut seen = 0;
    let got = digest_file(&file, &tensors, &mut |n| seen += n).unwrap();
    assert_eq!(seen, len as u64);
    assert_eq!(got.whole, sha(&[&bytes]));
    for (tb, (name, digest)) in tensors.iter().zip(&got.tensors) {
        assert_eq!(&tb.name, name);
        let parts: Vec<&[u8]> = tb
            .ranges
            .iter()
            .map(|r| &bytes[r.start as usize..r.end as usize])
            .collect();
        assert_eq!(*digest, sha(&parts), "{name}");
        assert_eq!(
            *digest,
            digest_ranges(&file, &tb.ranges, 4096).unwrap(),
            "{name}"
        );
    }
    // Header: every byte no tensor covers, in order.
    let mut covered = vec![false; len];
    for r in tensors.iter().flat_map(|t| t.ranges.iter()) {
        covered[r.start as usize..r.end as usize].fill(true);
    }
    let header: Vec<u8> = bytes
        .iter()
        .zip(&covered)
        .filter(|(_, c)| !**c)
        .map(|(b, _)| *b)
        .collect();
    assert_eq!(got.header, sha(&[&header]));
    assert_eq!(digest_header(&file, &tensors).unwrap(), got.header);
    assert_eq!(digest_whole(&file, 1000, &|_| {}).unwrap(), got.whole);
}
