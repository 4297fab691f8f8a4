//! The view builders against their rules and the reference writers.

use super::*;
use crate::format::gguf::{self, ALIGNMENT_KEY};
use crate::format::meta::{MetaType, MetaValue, Metadata};
use crate::quant::GgmlType;
use serde_json::{Value, json};

fn md() -> Metadata {
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    md.push("general.file_type", MetaValue::U32(15));
    md.push("llama.block_count", MetaValue::U32(2));
    md.push("llama.embedding_length", MetaValue::U32(4));
    md.push("llama.context_length", MetaValue::U32(8));
    md.push("llama.eps", MetaValue::F32(1e-5));
    md.push("x.nan", MetaValue::F64(f64::NAN));
    md.push("tokenizer.ggml.model", MetaValue::String("gpt2".into()));
    md.push(
        "tokenizer.ggml.tokens",
        MetaValue::Array {
            elem: MetaType::String,
            values: vec![
                MetaValue::String("a\"".into()),
                MetaValue::String("b".into()),
            ],
        },
    );
    md
}

fn tensors() -> Vec<(usize, String, Vec<u64>)> {
    vec![
        (0, "token_embd.weight".into(), vec![3, 4]),
        (1, "blk.0.attn_norm.weight".into(), vec![5]),
        (2, "output.weight".into(), vec![2, 1, 3]),
    ]
}

fn views(ts: &[(usize, String, Vec<u64>)]) -> Vec<ViewTensor<'_>> {
    ts.iter()
        .map(|(f, n, s)| ViewTensor {
            file: *f,
            name: n,
            shape: s,
            n_elements: s.iter().product(),
            rows: None,
            runs: &[],
        })
        .collect()
}

#[test]
fn safetensors_header_follows_the_rules() {
    let ts = tensors();
    for fmt in ElemFormat::ALL {
        let b = safetensors(&views(&ts), &md(), fmt).unwrap();
        let l = &b.layout;
        let h = l.header();
        let n = u64::from_le_bytes(h[..8].try_into().unwrap());
        assert_eq!(n as usize + 8, h.len());
        assert_eq!(n % 8, 0, "padded to a multiple of 8");
        assert_eq!(h[8], b'{');
        let text = std::str::from_utf8(&h[8..]).unwrap();
        assert_eq!(text.trim_end(), text.trim_end_matches(' '));
        let v: Value = serde_json::from_str(text).unwrap();
        let obj = v.as_object().unwrap();
        let keys: Vec<&String> = obj.keys().collect();
        assert_eq!(
            keys,
            [
                "__metadata__",
                "token_embd.weight",
                "blk.0.attn_norm.weight",
                "output.weight"
            ]
        );
        let meta = &obj["__metadata__"];
        assert_eq!(meta["llama.block_count"], "2");
        assert_eq!(meta["llama.eps"], "1e-5");
        assert_eq!(meta["x.nan"], "nan");
        assert_eq!(meta["general.file_type"], "15");
        assert_eq!(meta["tokenizer.ggml.tokens"], r#"["a\"","b"]"#);
        // Contiguous, in order, sized by dtype, ending at the file's end.
        let mut off = 0;
        for ((_, name, shape), seg) in ts.iter().zip(l.segments()) {
            let e = &obj[name.as_str()];
            assert_eq!(e["dtype"], fmt.dtype());
            assert_eq!(e["shape"], json!(shape));
            let n_el: u64 = shape.iter().product();
            assert_eq!(e["data_offsets"], json!([off, off + n_el * fmt.bytes()]));
            assert_eq!(seg.start, 8 + n + off);
            off += n_el * fmt.bytes();
        }
        assert_eq!(l.size(), 8 + n + off);
    }
    // Duplicate names and a tensor called __metadata__ are refused.
    let mut dup = tensors();
    dup.push((3, "output.weight".into(), vec![1]));
    assert!(safetensors(&views(&dup), &md(), ElemFormat::F32).is_err());
    let meta_named = vec![(0, "__metadata__".to_string(), vec![1])];
    assert!(safetensors(&views(&meta_named), &md(), ElemFormat::F32).is_err());
}

#[test]
fn gguf_view_is_what_write_gguf_writes() {
    let ts = tensors();
    let b = gguf(&views(&ts), &md()).unwrap();
    let (vmd, al) = gguf_metadata(&md()).unwrap();
    assert_eq!(al, 32);
    assert_eq!(vmd.get("general.file_type"), Some(&MetaValue::U32(0)));
    // Data: element i of file f is f * 100 + i.
    let data: Vec<Vec<u8>> = ts
        .iter()
        .map(|(f, _, s)| {
            let n: u64 = s.iter().product();
            (0..n)
                .flat_map(|i| ((*f as f32) * 100.0 + i as f32).to_le_bytes())
                .collect()
        })
        .collect();
    let with_data: Vec<(String, Vec<u64>, GgmlType, &[u8])> = ts
        .iter()
        .zip(&data)
        .map(|((_, n, s), d)| {
            (
                n.clone(),
                s.iter().rev().copied().collect(),
                GgmlType::F32,
                &d[..],
            )
        })
        .collect();
    let mut want = Vec::new();
    gguf::write_gguf(&mut want, &vmd, &with_data, al).unwrap();
    let l = &b.layout;
    assert_eq!(l.size(), want.len() as u64);
    let mut got = Vec::new();
    for p in l.pieces(0, l.size()) {
        match p {
            Piece::Header(r) => got.extend_from_slice(&l.header()[r]),
            Piece::Zeros(n) => got.resize(got.len() + n, 0),
            Piece::Tensor { seg, range } => {
                let d = &data[l.segments()[seg].file];
                got.extend_from_slice(&d[range.start as usize..range.end as usize]);
            }
        }
    }
    assert_eq!(got, want);
}

#[test]
fn gguf_needs_run_metadata_and_a_valid_alignment() {
    assert!(gguf_missing_keys(&md()).is_empty());
    let missing = gguf_missing_keys(&Metadata::default());
    assert_eq!(missing, ["general.architecture", "tokenizer.ggml.model"]);
    let mut m = md();
    m.entries
        .retain(|(k, _)| k != "llama.block_count" && k != "tokenizer.ggml.tokens");
    assert_eq!(
        gguf_missing_keys(&m),
        ["llama.block_count", "tokenizer.ggml.tokens"]
    );
    let mut m = md();
    m.push(ALIGNMENT_KEY, MetaValue::U64(64));
    let (vmd, al) = gguf_metadata(&m).unwrap();
    assert_eq!(
        (al, vmd.get(ALIGNMENT_KEY)),
        (64, Some(&MetaValue::U32(64)))
    );
    let mut m = md();
    m.push(ALIGNMENT_KEY, MetaValue::U32(48));
    assert!(gguf_metadata(&m).is_err());
    let mut m = md();
    m.entries.retain(|(k, _)| k != "general.file_type");
    let (vmd, _) = gguf_metadata(&m).unwrap();
    assert_eq!(vmd.entries.last().unwrap().0, "general.file_type");
}

#[test]
fn gguf_needs_the_embedding_and_every_block() {
    let m = md();
    let all = [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.1.ffn_up.weight",
    ];
    assert!(gguf_missing_tensors(&m, &all).is_empty());
    assert_eq!(
        gguf_missing_tensors(&m, &["blk.0.attn_q.weight", "blk.7.x.weight"]),
        ["token_embd.weight", "tensors of 1 of the 2 blocks"]
    );
}

#[test]
fn view_lists_parse() {
    assert_eq!(ViewSet::parse("f32").unwrap(), ViewSet::default());
    assert_eq!(
        ViewSet::parse("f32,f16, bf16").unwrap(),
        ViewSet {
            f16: true,
            bf16: true
        }
    );
    assert_eq!(ViewSet::parse("bf16+f32").unwrap().names(), "f32,bf16");
    assert!(ViewSet::parse("f32,f64").unwrap_err().contains("\"f64\""));
    assert_eq!(ViewSet::parse("").unwrap(), ViewSet::default());
}
