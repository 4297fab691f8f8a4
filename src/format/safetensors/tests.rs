use super::index::check_shard_name;
use super::*;

#[test]
fn dtype_table_is_consistent() {
    for r in DTYPES {
        assert_eq!(Dtype::from_name(r.1), Some(r.0));
        assert_eq!(r.0.row().1, r.1, "{:?} must have one row", r.0);
    }
    assert_eq!(Dtype::from_name("bf16"), None, "names are case-sensitive");
    assert_eq!(Dtype::F4.bytes_for(3), None);
    assert_eq!(Dtype::F4.bytes_for(4), Some(2));
    assert_eq!(Dtype::Bf16.bytes_for(u64::MAX), None);
    for d in [Dtype::I32, Dtype::U8, Dtype::Bool, Dtype::I64] {
        assert!(d.element().unwrap_err().contains("not weights"), "{d}");
    }
    assert_eq!(Dtype::F8E4M3.element(), Ok(GgmlType::F8E4M3));
}

#[test]
fn shard_names_are_plain_file_names() {
    check_shard_name("model-00001-of-00002.safetensors").unwrap();
    for bad in [
        "",
        ".",
        "..",
        "../m.safetensors",
        "/etc/passwd",
        "a/b.safetensors",
        "a\\b",
        "http://h/m.safetensors",
        "C:m.safetensors",
        ".hidden",
        "a\u{1b}b",
        "a\u{202e}b",
    ] {
        assert!(check_shard_name(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn a_header_parses_into_its_tensors_in_data_order() {
    let json = br#"{"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let f = header::parse(json, 8 + json.len() as u64 + 12).unwrap();
    assert_eq!(f.metadata, vec![("format".to_string(), "pt".to_string())]);
    let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(f.data_start, 8 + json.len() as u64);
    // An empty checkpoint is a valid file (nothing to serve).
    let f = header::parse(b"{}", 10).unwrap();
    assert!(f.tensors.is_empty());
    // Zero-sized tensors take no bytes, and may share an offset.
    let json = br#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[1,0],"data_offsets":[0,0]}}"#;
    assert_eq!(
        header::parse(json, 8 + json.len() as u64)
            .unwrap()
            .tensors
            .len(),
        2
    );
}
