use super::value::{MetaType, MetaValue};
use super::*;
use crate::error::Error;
use std::os::unix::fs::FileExt;
use std::path::Path;

// -- helpers ----------------------------------------------------------

fn read_bytes(bytes: &[u8]) -> Result<GgufFile> {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    let src = SourceFile::open(f.path()).unwrap();
    GgufFile::read(&src)
}

/// Read, expect an error of `kind`, check it names the file and an
/// offset, and return it.
#[track_caller]
fn fails(bytes: &[u8], kind: ErrorKind) -> Error {
    let e = match read_bytes(bytes) {
        Ok(g) => panic!("expected {kind:?}, read OK: {g:?}"),
        Err(e) => e,
    };
    eprintln!("{:?}: {e}", e.kind());
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.file().is_some(), "no path: {e}");
    assert!(e.offset().is_some(), "no offset: {e}");
    e
}

/// Hand-rolled little-endian builder that remembers named offsets.
#[derive(Default, Clone)]
struct B {
    out: Vec<u8>,
    marks: Vec<(String, usize)>,
}

impl B {
    fn mark(&mut self, m: impl Into<String>) -> &mut Self {
        self.marks.push((m.into(), self.out.len()));
        self
    }
    fn at(&self, m: &str) -> usize {
        self.marks
            .iter()
            .find(|(k, _)| k == m)
            .unwrap_or_else(|| panic!("no mark {m}"))
            .1
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.out.extend_from_slice(b);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn pad(&mut self, align: usize) -> &mut Self {
        while !self.out.len().is_multiple_of(align) {
            self.out.push(0);
        }
        self
    }
    fn set_u32(&mut self, m: &str, v: u32) -> &mut Self {
        let at = self.at(m);
        self.out[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }
    fn set_u64(&mut self, m: &str, v: u64) -> &mut Self {
        let at = self.at(m);
        self.out[at..at + 8].copy_from_slice(&v.to_le_bytes());
        self
    }
    fn cut(&self, len: usize) -> Vec<u8> {
        self.out[..len].to_vec()
    }
}

/// Encoded (type id, value bytes).
fn v_u32(x: u32) -> (u32, Vec<u8>) {
    (4, x.to_le_bytes().to_vec())
}
fn v_str(s: &str) -> (u32, Vec<u8>) {
    let mut b = B::default();
    b.str(s);
    (8, b.out)
}
fn v_str_array(items: &[&str]) -> (u32, Vec<u8>) {
    let mut b = B::default();
    b.u32(8).u64(items.len() as u64);
    for s in items {
        b.str(s);
    }
    (9, b.out)
}

/// A GGUF file from parts. Marks: magic, version, tensor_count,
/// kv_count, key{i}, type{i}, value{i}, tensor{i}, n_dims{i},
/// ne{i}_{d}, ttype{i}, offset{i}, data.
fn file(
    version: u32,
    kvs: &[(&str, (u32, Vec<u8>))],
    tensors: &[(&str, &[u64], u32, u64)],
    align: usize,
    data_len: usize,
) -> B {
    let mut b = B::default();
    b.mark("magic").bytes(GGUF_MAGIC);
    b.mark("version").u32(version);
    b.mark("tensor_count").u64(tensors.len() as u64);
    b.mark("kv_count").u64(kvs.len() as u64);
    for (i, (k, (ty, v))) in kvs.iter().enumerate() {
        b.mark(format!("key{i}")).str(k);
        b.mark(format!("type{i}")).u32(*ty);
        b.mark(format!("value{i}")).bytes(v);
    }
    for (i, (name, dims, ty, off)) in tensors.iter().enumerate() {
        b.mark(format!("tensor{i}")).str(name);
        b.mark(format!("n_dims{i}")).u32(dims.len() as u32);
        for (d, ne) in dims.iter().enumerate() {
            b.mark(format!("ne{i}_{d}")).u64(*ne);
        }
        b.mark(format!("ttype{i}")).u32(*ty);
        b.mark(format!("offset{i}")).u64(*off);
    }
    b.pad(align).mark("data");
    let n = b.out.len() + data_len;
    let mut x = 1u8;
    while b.out.len() < n {
        x = x.wrapping_mul(31).wrapping_add(7);
        b.out.push(x);
    }
    b
}

const DESCRIPTION: &str = "A small test model — «naïve» café, 日本語, emoji 🦀. \
        Long enough that truncations inside it leave room for the declared counts. \
        Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.";

/// A small valid file: 5 kvs (a long non-ASCII string, a u32, a string
/// array, the alignment, a string), 2 tensors: `a.weight` F32 [8] at 0
/// (32 bytes) and `b.weight` Q8_0 [32, 2] at 64 (68 bytes).
fn small_v(version: u32) -> B {
    file(
        version,
        &[
            ("general.description", v_str(DESCRIPTION)),
            ("llama.block_count", v_u32(30)),
            ("tokenizer.ggml.tokens", v_str_array(&["a", "bé", "c"])),
            ("general.alignment", v_u32(32)),
            ("general.architecture", v_str("llama")),
        ],
        &[("a.weight", &[8], 0, 0), ("b.weight", &[32, 2], 8, 64)],
        32,
        160,
    )
}

fn small() -> B {
    small_v(3)
}

// -- valid files ------------------------------------------------------

#[test]
fn small_file_reads() {
    let b = small();
    let g = read_bytes(&b.out).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 32);
    assert_eq!(g.data_offset, b.at("data") as u64);
    assert_eq!(g.metadata.len(), 5);
    assert_eq!(
        g.metadata.get("general.description"),
        Some(&MetaValue::String(DESCRIPTION.into()))
    );
    assert_eq!(g.metadata.arch_u64("block_count"), Some(30));
    let t = g.tensor("b.weight").unwrap();
    assert_eq!(t.dims, vec![32, 2]);
    assert_eq!(t.ty, GgmlType::Q8_0);
    assert_eq!(t.n_elements, 64);
    assert_eq!(t.n_bytes, 68);
    assert_eq!(t.offset, g.data_offset + 64);
}

#[test]
fn v2_file_reads() {
    let g = read_bytes(&small_v(2).out).unwrap();
    assert_eq!(g.version, 2);
    assert_eq!(g.tensors.len(), 2);
    assert_eq!(g.metadata.len(), 5);
}

fn every_type_metadata() -> Metadata {
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    md.push("llama.block_count", MetaValue::U32(30));
    md.push("t.u8", MetaValue::U8(250));
    md.push("t.i8", MetaValue::I8(-100));
    md.push("t.u16", MetaValue::U16(65000));
    md.push("t.i16", MetaValue::I16(-30000));
    md.push("t.i32", MetaValue::I32(-2_000_000_000));
    md.push("t.f32", MetaValue::F32(1.0e-5));
    md.push("t.f32inf", MetaValue::F32(f32::NEG_INFINITY));
    md.push("t.bool", MetaValue::Bool(true));
    md.push("t.bool0", MetaValue::Bool(false));
    md.push(
        "t.str",
        MetaValue::String("Grüße, 世界 🦀\n\"quoted\"".into()),
    );
    md.push("t.empty_str", MetaValue::String(String::new()));
    md.push("t.u64", MetaValue::U64(u64::MAX));
    md.push("t.i64", MetaValue::I64(i64::MIN));
    md.push("t.f64", MetaValue::F64(-0.1));
    md.push(
        "t.arr_f32",
        MetaValue::Array {
            elem: MetaType::F32,
            values: vec![MetaValue::F32(1.5), MetaValue::F32(-2.0)],
        },
    );
    md.push(
        "t.arr_str",
        MetaValue::Array {
            elem: MetaType::String,
            values: vec![
                MetaValue::String("<s>".into()),
                MetaValue::String("ĠÃ©".into()),
                MetaValue::String(String::new()),
            ],
        },
    );
    md.push(
        "t.arr_empty",
        MetaValue::Array {
            elem: MetaType::I32,
            values: vec![],
        },
    );
    md.push(
        "t.arr_nested",
        MetaValue::Array {
            elem: MetaType::Array,
            values: vec![
                MetaValue::Array {
                    elem: MetaType::I16,
                    values: vec![MetaValue::I16(-2), MetaValue::I16(5)],
                },
                MetaValue::Array {
                    elem: MetaType::String,
                    values: vec![MetaValue::String("x".into())],
                },
                MetaValue::Array {
                    elem: MetaType::Array,
                    values: vec![MetaValue::Array {
                        elem: MetaType::Bool,
                        values: vec![MetaValue::Bool(true)],
                    }],
                },
                MetaValue::Array {
                    elem: MetaType::U64,
                    values: vec![],
                },
            ],
        },
    );
    md
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn round_trip(alignment: u64) {
    let md = every_type_metadata();
    let shapes: Vec<(String, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight".into(), vec![8], GgmlType::F32),
        ("blk.0.attn_norm.weight".into(), vec![16, 3], GgmlType::F16),
        ("blk.0.attn_q.weight".into(), vec![64, 2], GgmlType::Q8_0),
        ("blk.0.ffn_up.weight".into(), vec![256, 2, 3], GgmlType::Q4K),
    ];
    let sizes = [32usize, 96, 4 * 34, 6 * 144];
    let datas: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i as u8))
        .collect();
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = shapes
        .iter()
        .zip(&datas)
        .map(|((n, d, t), data)| (n.clone(), d.clone(), *t, data.as_slice()))
        .collect();

    let f = tempfile::NamedTempFile::new().unwrap();
    {
        let mut w = std::io::BufWriter::new(std::fs::File::create(f.path()).unwrap());
        write_gguf(&mut w, &md, &tensors, alignment).unwrap();
    }
    let (header, rel) = encode_header(&md, &shapes, alignment).unwrap();
    assert_eq!(header.len() as u64 % alignment, 0);

    let src = SourceFile::open(f.path()).unwrap();
    let g = GgufFile::read(&src).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, alignment);
    assert_eq!(g.data_offset, header.len() as u64);
    let mut want_md = md.clone();
    if alignment != DEFAULT_ALIGNMENT {
        want_md.push(ALIGNMENT_KEY, MetaValue::U32(alignment as u32));
    }
    assert_eq!(g.metadata, want_md);
    assert_eq!(g.tensors.len(), 4);
    for (i, t) in g.tensors.iter().enumerate() {
        assert_eq!(t.name, shapes[i].0);
        assert_eq!(t.dims, shapes[i].1);
        assert_eq!(t.ty, shapes[i].2);
        assert_eq!(t.n_bytes, sizes[i] as u64);
        assert_eq!(t.n_elements, shapes[i].1.iter().product::<u64>());
        assert_eq!(t.offset, g.data_offset + rel[i]);
        assert_eq!(t.offset % alignment, 0);
        assert_eq!(src.read_vec(t.offset, t.n_bytes, "t").unwrap(), datas[i]);
    }
    // The file ends padded after the last tensor.
    let last = &g.tensors[3];
    assert_eq!(
        src.len(),
        align_up(last.offset + last.n_bytes, alignment).unwrap()
    );
    // The header bytes are exactly what encode_header returns.
    assert_eq!(src.read_vec(0, header.len() as u64, "h").unwrap(), header);
}

#[test]
fn round_trip_default_alignment() {
    round_trip(32);
}

#[test]
fn round_trip_alignment_64_and_4096() {
    round_trip(64);
    round_trip(4096);
}

#[test]
fn writer_alignment_key_rules() {
    let shapes = vec![("x.weight".to_string(), vec![4], GgmlType::F32)];
    // Present and agreeing: not written twice.
    let mut md = Metadata::default();
    md.push(ALIGNMENT_KEY, MetaValue::U32(64));
    let data = [0u8; 16];
    let mut out = Vec::new();
    write_gguf(
        &mut out,
        &md,
        &[("x.weight".into(), vec![4], GgmlType::F32, &data[..])],
        64,
    )
    .unwrap();
    let g = read_bytes(&out).unwrap();
    assert_eq!(g.metadata.len(), 1);
    assert_eq!(g.alignment, 64);
    // Default alignment without the key: no key added.
    let (h, _) = encode_header(&Metadata::default(), &shapes, 32).unwrap();
    assert_eq!(u64::from_le_bytes(h[16..24].try_into().unwrap()), 0);
    // Disagreeing or mistyped key.
    for v in [
        MetaValue::U32(32),
        MetaValue::U64(64),
        MetaValue::String("64".into()),
    ] {
        let mut md = Metadata::default();
        md.push(ALIGNMENT_KEY, v);
        let e = encode_header(&md, &shapes, 64).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadValue, "{e}");
    }
    for a in [0, 3, 48, 1 << 21] {
        let e = encode_header(&Metadata::default(), &shapes, a).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::BadValue, "{a}: {e}");
    }
}

type Shapes = Vec<(String, Vec<u64>, GgmlType)>;

#[test]
fn writer_refuses_what_the_reader_would() {
    let md = Metadata::default();
    let t = |n: &str, d: Vec<u64>, ty| vec![(n.to_string(), d, ty)];
    let cases: Vec<(Shapes, ErrorKind)> = vec![
        (t("a", vec![], GgmlType::F32), ErrorKind::BadShape),
        (
            t("a", vec![1, 1, 1, 1, 1], GgmlType::F32),
            ErrorKind::BadShape,
        ),
        (t("a", vec![4, 0], GgmlType::F32), ErrorKind::BadShape),
        (t("a", vec![33], GgmlType::Q8_0), ErrorKind::BadShape),
        (
            t("a", vec![1 << 40, 1 << 40], GgmlType::F32),
            ErrorKind::Overflow,
        ),
        (t("a/b", vec![4], GgmlType::F32), ErrorKind::BadName),
        (
            vec![
                ("a".into(), vec![4], GgmlType::F32),
                ("a".into(), vec![4], GgmlType::F32),
            ],
            ErrorKind::BadName,
        ),
    ];
    for (shapes, kind) in cases {
        let e = encode_header(&md, &shapes, 32).unwrap_err();
        assert_eq!(e.kind(), kind, "{shapes:?}: {e}");
    }
    let mut dup = Metadata::default();
    dup.push("k", MetaValue::U8(1));
    dup.push("k", MetaValue::U8(2));
    assert_eq!(
        encode_header(&dup, &[], 32).unwrap_err().kind(),
        ErrorKind::BadValue
    );
    let mut mixed = Metadata::default();
    mixed.push(
        "k",
        MetaValue::Array {
            elem: MetaType::U8,
            values: vec![MetaValue::U16(1)],
        },
    );
    assert_eq!(
        encode_header(&mixed, &[], 32).unwrap_err().kind(),
        ErrorKind::BadValue
    );
    // Wrong data length: LengthMismatch, nothing written.
    let mut out = Vec::new();
    let e = write_gguf(
        &mut out,
        &md,
        &[("a".into(), vec![4], GgmlType::F32, &[0u8; 15][..])],
        32,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LengthMismatch);
    assert_eq!(e.tensor_name(), Some("a"));
    assert!(out.is_empty());
}

#[test]
fn large_header_streams_through_chunks() {
    // A 3 MiB string (read directly) and 300k short strings (buffer
    // refills at chunk boundaries).
    let big = "é".repeat(3 << 19);
    let tokens: Vec<MetaValue> = (0..300_000)
        .map(|i| MetaValue::String(format!("tok{i}")))
        .collect();
    let mut md = Metadata::default();
    md.push("big", MetaValue::String(big.clone()));
    md.push(
        "tokenizer.ggml.tokens",
        MetaValue::Array {
            elem: MetaType::String,
            values: tokens.clone(),
        },
    );
    let data = pattern(4 * 32 * 4, 9);
    let mut out = Vec::new();
    write_gguf(
        &mut out,
        &md,
        &[("w".into(), vec![32, 4], GgmlType::F32, &data[..])],
        32,
    )
    .unwrap();
    let g = read_bytes(&out).unwrap();
    assert_eq!(g.metadata, md);
    let t = &g.tensors[0];
    assert_eq!(&out[t.offset as usize..][..t.n_bytes as usize], &data[..]);
}

#[test]
fn real_model_if_present() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !p.exists() {
        eprintln!("skipping: {} not present", p.display());
        return;
    }
    let src = SourceFile::open(&p).unwrap();
    let g = GgufFile::read(&src).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.tensors.len(), 272);
    assert_eq!(g.metadata.len(), 33);
    assert_eq!(
        g.metadata
            .get("llama.block_count")
            .and_then(MetaValue::as_u64),
        Some(30)
    );
    let te = g.tensor("token_embd.weight").unwrap();
    assert_eq!(te.dims, vec![576, 49152]);
    assert_eq!(te.ty, GgmlType::Q8_0);
    let fd = g.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!(fd.dims, vec![1536, 576]);
    assert_eq!(fd.ty, GgmlType::Q4_1);
    let count = |ty| g.tensors.iter().filter(|t| t.ty == ty).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(count(GgmlType::F32), 61);
    assert_eq!(count(GgmlType::Q8_0), 1);
    for t in &g.tensors {
        assert!(t.offset >= g.data_offset && t.offset + t.n_bytes <= src.len());
    }
}

// -- malformed files --------------------------------------------------

#[test]
fn wrong_magic() {
    let mut b = small();
    b.out[..4].copy_from_slice(b"GGML");
    let e = fails(&b.out, ErrorKind::BadMagic);
    assert!(e.message().contains("GGML"), "{e}");
    assert_eq!(e.offset(), Some(0));
}

#[test]
fn v1_is_unsupported() {
    let mut b = small();
    b.set_u32("version", 1);
    let e = fails(&b.out, ErrorKind::UnsupportedVersion);
    assert!(
        e.message().contains("GGUF v1 is not supported (v2/v3 are)"),
        "{e}"
    );
    assert_eq!(e.offset(), Some(4));
}

#[test]
fn big_endian_is_unsupported() {
    for v in [0x0300_0000u32, 0x0200_0000] {
        let mut b = small();
        b.set_u32("version", v);
        let e = fails(&b.out, ErrorKind::UnsupportedVersion);
        assert!(e.message().contains("big-endian"), "{e}");
    }
    let mut b = small();
    b.set_u32("version", 4);
    let e = fails(&b.out, ErrorKind::UnsupportedVersion);
    assert!(e.message().contains("version 4"), "{e}");
}

#[test]
fn truncated_at_every_section() {
    let b = small();
    let elems = b.at("value2") + 12;
    // (label, cut length, expected kind, expected offset)
    let cases: Vec<(&str, usize, ErrorKind, Option<u64>)> = vec![
        ("empty file", 0, ErrorKind::Truncated, Some(0)),
        ("inside magic", 2, ErrorKind::Truncated, Some(0)),
        ("inside version", 6, ErrorKind::Truncated, Some(4)),
        ("inside tensor_count", 12, ErrorKind::Truncated, Some(8)),
        ("inside kv_count", 20, ErrorKind::Truncated, Some(16)),
        // Too little left for the declared counts.
        (
            "inside first key",
            b.at("key0") + 11,
            ErrorKind::Truncated,
            None,
        ),
        // Inside the long description string: past the count check.
        (
            "inside a string value",
            b.at("value0") + 150,
            ErrorKind::Truncated,
            Some(b.at("value0") as u64 + 8),
        ),
        (
            "inside a key",
            b.at("key1") + 12,
            ErrorKind::Truncated,
            Some(b.at("key1") as u64 + 8),
        ),
        (
            "inside a u32 value",
            b.at("value1") + 2,
            ErrorKind::Truncated,
            Some(b.at("value1") as u64),
        ),
        (
            "inside array header",
            b.at("value2") + 6,
            ErrorKind::Truncated,
            Some(b.at("value2") as u64 + 4),
        ),
        (
            "inside array elements",
            elems + 25,
            ErrorKind::Truncated,
            Some(elems as u64 + 20),
        ),
        (
            "inside a tensor name",
            b.at("tensor0") + 10,
            ErrorKind::Truncated,
            Some(b.at("tensor0") as u64 + 8),
        ),
        (
            "inside a tensor ne",
            b.at("ne1_1") + 3,
            ErrorKind::Truncated,
            Some(b.at("ne1_1") as u64),
        ),
        (
            "inside a tensor offset",
            b.at("offset1") + 7,
            ErrorKind::Truncated,
            Some(b.at("offset1") as u64),
        ),
        (
            "inside padding",
            b.at("data") - 1,
            ErrorKind::OutOfBounds,
            None,
        ),
        (
            "inside first tensor's data",
            b.at("data") + 10,
            ErrorKind::OutOfBounds,
            Some(b.at("data") as u64),
        ),
        (
            "inside last tensor's data",
            b.at("data") + 100,
            ErrorKind::OutOfBounds,
            Some(b.at("data") as u64 + 64),
        ),
    ];
    for (label, len, kind, off) in cases {
        let e = fails(&b.cut(len), kind);
        if let Some(off) = off {
            assert_eq!(e.offset(), Some(off), "{label}: {e}");
        }
        assert!(
            e.offset().unwrap() <= len as u64 || kind == ErrorKind::OutOfBounds,
            "{label}: {e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("file") || msg.contains("outside"),
            "{label}: {e}"
        );
        if kind == ErrorKind::OutOfBounds {
            assert!(e.tensor_name().is_some(), "{label}: {e}");
        }
    }
    // The last byte of the last tensor is needed too; trailing padding
    // is not.
    fails(&b.cut(b.at("data") + 131), ErrorKind::OutOfBounds);
    read_bytes(&b.cut(b.at("data") + 132)).unwrap();
}

#[test]
fn absurd_counts() {
    for v in [u64::MAX, 1 << 40, u64::MAX / 32 + 1] {
        let mut b = small();
        b.set_u64("tensor_count", v);
        let e = fails(&b.out, ErrorKind::TooLarge);
        assert_eq!(e.offset(), Some(8), "{e}");
        assert!(e.message().contains(&v.to_string()), "{e}");
        let mut b = small();
        b.set_u64("kv_count", v);
        let e = fails(&b.out, ErrorKind::TooLarge);
        assert_eq!(e.offset(), Some(16), "{e}");
    }
    // Plausible counts the file cannot hold: truncated.
    let mut b = small();
    b.set_u64("tensor_count", 1000);
    fails(&b.out, ErrorKind::Truncated);
}

#[test]
fn absurd_string_lengths() {
    for m in ["value0", "key1"] {
        for v in [u64::MAX, 1 << 40, MAX_STRING_BYTES + 1] {
            let mut b = small();
            b.set_u64(m, v);
            let e = fails(&b.out, ErrorKind::TooLarge);
            assert_eq!(e.offset(), Some(b.at(m) as u64), "{e}");
            assert!(e.message().contains(&v.to_string()), "{e}");
        }
        // Within the cap but past the end of the file.
        let mut b = small();
        b.set_u64(m, 60_000);
        let e = fails(&b.out, ErrorKind::Truncated);
        assert_eq!(e.offset(), Some(b.at(m) as u64 + 8), "{e}");
    }
}

#[test]
fn absurd_array_count() {
    let count_at = "value2";
    for v in [u64::MAX, 1 << 40, u64::MAX / 8 + 1] {
        let mut b = small();
        let at = b.at(count_at) + 4;
        b.out[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let e = fails(&b.out, ErrorKind::TooLarge);
        assert_eq!(e.offset(), Some(at as u64), "{e}");
        assert!(e.message().contains("tokenizer.ggml.tokens"), "{e}");
    }
    let mut b = small();
    let at = b.at(count_at) + 4;
    b.out[at..at + 8].copy_from_slice(&1000u64.to_le_bytes());
    let e = fails(&b.out, ErrorKind::Truncated);
    assert_eq!(e.offset(), Some(at as u64), "{e}");
}

#[test]
fn array_nesting_too_deep() {
    // Five levels of arrays.
    let mut v = B::default();
    for _ in 0..4 {
        v.u32(9).u64(1);
    }
    v.u32(0).u64(1).bytes(&[7]);
    let b = file(3, &[("deep", (9, v.out.clone()))], &[], 32, 0);
    let e = fails(&b.out, ErrorKind::TooLarge);
    assert!(e.message().contains("nested"), "{e}");
    // Four levels are fine.
    let mut v = B::default();
    for _ in 0..3 {
        v.u32(9).u64(1);
    }
    v.u32(0).u64(1).bytes(&[7]);
    read_bytes(&file(3, &[("deep", (9, v.out))], &[], 32, 0).out).unwrap();
}

#[test]
fn unknown_value_type() {
    let mut b = small();
    b.set_u32("type1", 13);
    let e = fails(&b.out, ErrorKind::UnknownType);
    assert_eq!(e.offset(), Some(b.at("type1") as u64));
    assert!(
        e.message().contains("13") && e.message().contains("llama.block_count"),
        "{e}"
    );
    // Unknown array element type.
    let mut b = small();
    b.set_u32("value2", 99);
    let e = fails(&b.out, ErrorKind::UnknownType);
    assert_eq!(e.offset(), Some(b.at("value2") as u64));
    assert!(e.message().contains("99"), "{e}");
}

#[test]
fn unknown_ggml_type() {
    for id in [4u32, 5, 36, 1000, u32::MAX] {
        let mut b = small();
        b.set_u32("ttype1", id);
        let e = fails(&b.out, ErrorKind::UnknownType);
        assert_eq!(e.tensor_name(), Some("b.weight"));
        assert_eq!(e.offset(), Some(b.at("ttype1") as u64));
        assert!(e.message().contains(&format!("id {id}")), "{e}");
    }
    // Known but not decodable types are accepted.
    let b = file(3, &[], &[("iq.weight", &[256], 16, 0)], 32, 66);
    assert_eq!(read_bytes(&b.out).unwrap().tensors[0].ty, GgmlType::Iq2Xxs);
}

#[test]
fn bad_n_dims() {
    for n in [0u32, 5, u32::MAX] {
        let mut b = small();
        b.set_u32("n_dims1", n);
        let e = fails(&b.out, ErrorKind::BadShape);
        assert_eq!(e.tensor_name(), Some("b.weight"));
        assert_eq!(e.offset(), Some(b.at("n_dims1") as u64));
        assert!(e.message().contains(&format!("n_dims is {n}")), "{e}");
    }
}

#[test]
fn zero_dim() {
    let mut b = small();
    b.set_u64("ne1_1", 0);
    let e = fails(&b.out, ErrorKind::BadShape);
    assert_eq!(e.offset(), Some(b.at("ne1_1") as u64));
    assert!(e.message().contains("ne[1] is 0"), "{e}");
}

#[test]
fn element_count_overflow() {
    for ne1 in [1u64 << 60, u64::MAX, 1 << 58] {
        let mut b = small();
        b.set_u64("ne1_1", ne1);
        let e = fails(&b.out, ErrorKind::Overflow);
        assert_eq!(e.tensor_name(), Some("b.weight"));
        assert_eq!(e.offset(), Some(b.at("ne1_0") as u64), "{e}");
    }
    // The 2^42 + 1 wraparound shape from llama.cpp PR #18674.
    let b = file(
        3,
        &[],
        &[("w", &[1 << 42, (1 << 22) + 1, 1 << 0], 0, 0)],
        32,
        0,
    );
    // 2^42 * (2^22 + 1) = 2^64 + 2^42 overflows u64.
    let e = fails(&b.out, ErrorKind::Overflow);
    assert!(
        e.message().contains("overflow") || e.message().contains("int64"),
        "{e}"
    );
}

#[test]
fn ne0_not_multiple_of_block() {
    let mut b = small();
    b.set_u64("ne1_0", 33);
    let e = fails(&b.out, ErrorKind::BadShape);
    assert_eq!(e.offset(), Some(b.at("ne1_0") as u64));
    assert!(e.message().contains("block size 32"), "{e}");
}

#[test]
fn misaligned_offset() {
    let mut b = small();
    b.set_u64("offset1", 65);
    let e = fails(&b.out, ErrorKind::BadValue);
    assert_eq!(e.tensor_name(), Some("b.weight"));
    assert_eq!(e.offset(), Some(b.at("offset1") as u64));
    assert!(e.message().contains("alignment 32"), "{e}");
}

#[test]
fn offset_past_eof() {
    for off in [1u64 << 20, u64::MAX - 31] {
        let mut b = small();
        b.set_u64("offset1", off);
        let e = read_bytes(&b.out).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::OutOfBounds | ErrorKind::Overflow),
            "{e}"
        );
        assert_eq!(e.tensor_name(), Some("b.weight"));
        assert!(e.offset().is_some() && e.file().is_some(), "{e}");
    }
    let mut b = small();
    b.set_u64("offset1", 1 << 20);
    let e = fails(&b.out, ErrorKind::OutOfBounds);
    assert!(e.message().contains("outside the file"), "{e}");
}

#[test]
fn overlapping_tensors() {
    let mut b = small();
    b.set_u64("offset1", 0);
    let e = fails(&b.out, ErrorKind::BadValue);
    assert!(
        e.message().contains("a.weight") && e.message().contains("b.weight"),
        "{e}"
    );
    assert!(e.message().contains("overlap"), "{e}");
    // Touching ranges are fine: a.weight is 32 bytes at 0, b at 32.
    let mut b = small();
    b.set_u64("offset1", 32);
    read_bytes(&b.out).unwrap();
}

#[test]
fn duplicate_tensor_name() {
    let b = file(
        3,
        &[],
        &[("a.weight", &[8], 0, 0), ("a.weight", &[8], 0, 32)],
        32,
        64,
    );
    let e = fails(&b.out, ErrorKind::BadName);
    assert_eq!(e.offset(), Some(b.at("tensor1") as u64));
    assert!(e.message().contains("duplicate"), "{e}");
}

#[test]
fn bad_tensor_names() {
    for name in ["", "a/b", "..", "x\0y"] {
        let b = file(3, &[], &[(name, &[8], 0, 0)], 32, 32);
        let e = fails(&b.out, ErrorKind::BadName);
        assert_eq!(e.offset(), Some(b.at("tensor0") as u64), "{name:?}: {e}");
    }
    let long = "n".repeat(300);
    let b = file(3, &[], &[(&long, &[8], 0, 0)], 32, 32);
    fails(&b.out, ErrorKind::BadName);
    // Declared length over the 4096-byte cap.
    let mut b = file(3, &[], &[("a", &[8], 0, 0)], 32, 32);
    b.set_u64("tensor0", 5000);
    let e = fails(&b.out, ErrorKind::BadName);
    assert!(e.message().contains("5000"), "{e}");
}

#[test]
fn duplicate_and_empty_keys() {
    let b = file(3, &[("k", v_u32(1)), ("k", v_u32(2))], &[], 32, 0);
    let e = fails(&b.out, ErrorKind::BadValue);
    assert_eq!(e.offset(), Some(b.at("key1") as u64));
    assert!(e.message().contains("duplicate metadata key \"k\""), "{e}");
    let b = file(3, &[("", v_u32(1))], &[], 32, 0);
    let e = fails(&b.out, ErrorKind::BadValue);
    assert!(e.message().contains("empty key"), "{e}");
}

#[test]
fn bad_alignment() {
    for a in [0u32, 3, 48, 1 << 21, u32::MAX] {
        let mut b = small();
        b.set_u32("value3", a);
        let e = fails(&b.out, ErrorKind::BadValue);
        assert_eq!(e.offset(), Some(b.at("value3") as u64));
        assert!(e.message().contains("general.alignment"), "{e}");
    }
    let b = file(3, &[("general.alignment", v_str("32"))], &[], 32, 0);
    let e = fails(&b.out, ErrorKind::BadValue);
    assert!(e.message().contains("must be a u32"), "{e}");
    let b = file(
        3,
        &[("general.alignment", (10, 32u64.to_le_bytes().to_vec()))],
        &[],
        32,
        0,
    );
    fails(&b.out, ErrorKind::BadValue);
    // A valid non-default alignment moves the data section.
    let b = file(
        3,
        &[("general.alignment", v_u32(256))],
        &[("a", &[8], 0, 0)],
        256,
        32,
    );
    let g = read_bytes(&b.out).unwrap();
    assert_eq!((g.alignment, g.data_offset), (256, 256));
}

#[test]
fn bad_utf8_and_bool() {
    let mut b = small();
    let at = b.at("value0") + 8 + 3;
    b.out[at] = 0xff;
    let e = fails(&b.out, ErrorKind::BadValue);
    assert_eq!(e.offset(), Some(at as u64));
    assert!(e.message().contains("UTF-8"), "{e}");
    let b = file(3, &[("flag", (7, vec![2]))], &[], 32, 0);
    let e = fails(&b.out, ErrorKind::BadValue);
    assert!(e.message().contains("bool"), "{e}");
}

// -- fuzz ---------------------------------------------------------------

#[test]
fn mutations_never_panic() {
    let base = small().out;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut rng = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let huge = [
        u64::MAX,
        1 << 40,
        1 << 63,
        1 << 32,
        u64::MAX - 31,
        0,
        1 << 20,
    ];
    let f = tempfile::NamedTempFile::new().unwrap();
    let (mut ok, mut errs) = (0, 0);
    let mut kinds = std::collections::BTreeSet::new();
    let t0 = std::time::Instant::now();
    for _ in 0..20_000 {
        let mut m = base.clone();
        for _ in 0..1 + rng() % 3 {
            let len = m.len().max(1) as u64;
            match rng() % 5 {
                0 => {
                    let i = (rng() % len) as usize;
                    if let Some(x) = m.get_mut(i) {
                        *x ^= 1 << (rng() % 8);
                    }
                }
                1 => {
                    let i = (rng() % len) as usize;
                    if let Some(x) = m.get_mut(i) {
                        *x = rng() as u8;
                    }
                }
                2 => m.truncate((rng() % len) as usize),
                3 => {
                    let i = (rng() % len) as usize;
                    let v = huge[(rng() % huge.len() as u64) as usize].to_le_bytes();
                    for (k, b) in v.iter().enumerate() {
                        if let Some(x) = m.get_mut(i + k) {
                            *x = *b;
                        }
                    }
                }
                _ => {
                    let i = (rng() % len) as usize;
                    let v = (rng() as u32 % 64).to_le_bytes();
                    for (k, b) in v.iter().enumerate() {
                        if let Some(x) = m.get_mut(i + k) {
                            *x = *b;
                        }
                    }
                }
            }
        }
        // Rewrite in place without truncating to zero (ext4 flushes a
        // file replaced by truncation on close, which is slow).
        f.as_file().set_len(m.len() as u64).unwrap();
        f.as_file().write_all_at(&m, 0).unwrap();
        let src = SourceFile::open(f.path()).unwrap();
        match GgufFile::read(&src) {
            Ok(g) => {
                ok += 1;
                for t in &g.tensors {
                    assert!(t.offset + t.n_bytes <= src.len());
                }
            }
            Err(e) => {
                errs += 1;
                assert!(e.file().is_some(), "{e}");
                assert!(e.offset().is_some(), "{e}");
                kinds.insert(format!("{:?}", e.kind()));
            }
        }
    }
    eprintln!(
        "fuzz: {ok} ok, {errs} errors {kinds:?} in {:?}",
        t0.elapsed()
    );
    assert!(errs > 5000);
}
