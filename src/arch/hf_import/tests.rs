use serde_json::{Value, json};

use super::*;

fn config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": 8,
        "bos_token_id": 0,
        "eos_token_id": 1,
    })
}

fn tokenizer() -> Value {
    json!({
        "added_tokens": [
            {"id": 0, "content": "<s>", "special": true, "normalized": false},
            {"id": 1, "content": "</s>", "special": true, "normalized": false},
            {"id": 5, "content": "<tool>", "special": false, "normalized": false},
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {}},
        "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4},
                  "merges": [["a", "b"]]},
    })
}

fn run(config: &Value, tok: Option<&Value>, tc: Option<&Value>) -> Result<HfImport, String> {
    let c = serde_json::to_vec(config).unwrap();
    let t = tok.map(|t| serde_json::to_vec(t).unwrap());
    let tc = tc.map(|t| serde_json::to_vec(t).unwrap());
    gguf_metadata(&HfFiles {
        config: &c,
        tokenizer: t.as_deref(),
        tokenizer_config: tc.as_deref(),
        generation_config: None,
    })
}

fn strings(v: Option<&MetaValue>) -> Vec<String> {
    match v {
        Some(MetaValue::Array { values, .. }) => values
            .iter()
            .map(|v| v.as_str().unwrap_or("?").to_string())
            .collect(),
        other => panic!("not an array: {other:?}"),
    }
}

fn ints(v: Option<&MetaValue>) -> Vec<i64> {
    match v {
        Some(MetaValue::Array { values, .. }) => values
            .iter()
            .map(|v| match v {
                MetaValue::I32(x) => i64::from(*x),
                _ => -1,
            })
            .collect(),
        other => panic!("not an array: {other:?}"),
    }
}

#[test]
fn a_llama_config_and_tokenizer_convert() {
    let tc = json!({"bos_token": "<s>", "eos_token": "</s>", "add_eos_token": false,
                    "chat_template": "{{ x }}", "add_prefix_space": false});
    let r = run(&config(), Some(&tokenizer()), Some(&tc)).unwrap();
    let md = &r.metadata;
    assert_eq!(r.arch.map(|a| a.name()), Some("llama"));
    assert_eq!(md.get("llama.block_count"), Some(&MetaValue::U32(2)));
    assert_eq!(
        md.get("llama.attention.head_count_kv"),
        Some(&MetaValue::U32(2))
    );
    assert_eq!(
        md.get("llama.attention.key_length"),
        Some(&MetaValue::U32(16))
    );
    assert_eq!(
        md.get("llama.rope.dimension_count"),
        Some(&MetaValue::U32(16))
    );
    assert_eq!(
        md.get("llama.attention.layer_norm_rms_epsilon"),
        Some(&MetaValue::F32(1e-5))
    );
    assert_eq!(md.get("llama.vocab_size"), Some(&MetaValue::U32(8)));
    assert!(md.get("llama.rope.scaling.type").is_none());
    assert_eq!(
        strings(md.get("tokenizer.ggml.tokens")),
        ["<s>", "</s>", "a", "b", "ab", "<tool>", "[PAD6]", "[PAD7]"]
    );
    assert_eq!(
        ints(md.get("tokenizer.ggml.token_type")),
        [3, 3, 1, 1, 1, 4, 5, 5]
    );
    assert_eq!(strings(md.get("tokenizer.ggml.merges")), ["a b"]);
    assert_eq!(
        md.get("tokenizer.ggml.pre"),
        Some(&MetaValue::String("gpt-2".into()))
    );
    assert_eq!(
        md.get("tokenizer.ggml.bos_token_id"),
        Some(&MetaValue::U32(0))
    );
    assert_eq!(
        md.get("tokenizer.ggml.eos_token_id"),
        Some(&MetaValue::U32(1))
    );
    // The template's leading <s> is the bos token: added.
    assert_eq!(
        md.get("tokenizer.ggml.add_bos_token"),
        Some(&MetaValue::Bool(true))
    );
    assert_eq!(
        md.get("tokenizer.ggml.add_eos_token"),
        Some(&MetaValue::Bool(false))
    );
    assert_eq!(
        md.get("tokenizer.ggml.add_space_prefix"),
        Some(&MetaValue::Bool(false))
    );
    assert_eq!(
        md.get("tokenizer.chat_template"),
        Some(&MetaValue::String("{{ x }}".into()))
    );
    assert_eq!(
        md.get("general.name"),
        Some(&MetaValue::String("llama".into()))
    );
    assert!(r.notes.is_empty(), "{:?}", r.notes);
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    for (field, want) in [
        ("hidden_size", "lacks hidden_size"),
        ("num_hidden_layers", "lacks num_hidden_layers"),
        ("intermediate_size", "lacks intermediate_size"),
        ("num_attention_heads", "lacks num_attention_heads"),
        ("vocab_size", "lacks vocab_size"),
        ("model_type", "lacks model_type"),
    ] {
        let mut c = config();
        c.as_object_mut().unwrap().remove(field);
        let e = run(&c, None, None).err().unwrap_or_default();
        assert!(e.contains(want), "{field}: {e}");
        assert!(e.contains("config.json"), "{e}");
    }
    for (field, v, want) in [
        ("hidden_size", json!(-1), "hidden_size is -1"),
        ("hidden_size", json!(64.5), "hidden_size is 64.5"),
        (
            "num_hidden_layers",
            json!("2"),
            "num_hidden_layers is \"2\"",
        ),
        (
            "max_position_embeddings",
            json!(1u64 << 40),
            "max_position_embeddings",
        ),
        ("rms_norm_eps", json!("x"), "rms_norm_eps"),
        ("rope_theta", json!(1e300), "rope_theta"),
        ("num_attention_heads", json!(0), "num_attention_heads is 0"),
        ("model_type", json!(3), "model_type is not a string"),
    ] {
        let mut c = config();
        c[field] = v;
        let e = run(&c, None, None).err().unwrap_or_default();
        assert!(e.contains(want), "{field}: {e}");
    }
    let mut yarn = config();
    yarn["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    let e = run(&yarn, None, None).err().unwrap_or_default();
    assert!(e.contains("original_max_position_embeddings"), "{e}");
    for bad in [
        &b""[..],
        b"{",
        b"[1]",
        b"null",
        b"{\"model_type\": \"llama\",}",
    ] {
        let e = gguf_metadata(&HfFiles {
            config: bad,
            tokenizer: None,
            tokenizer_config: None,
            generation_config: None,
        })
        .err()
        .unwrap_or_default();
        assert!(e.starts_with("config.json is not"), "{e}");
    }
}

#[test]
fn defaults_rope_scaling_and_text_config() {
    let mut c = config();
    let o = c.as_object_mut().unwrap();
    for k in [
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    ] {
        o.remove(k);
    }
    o.insert(
        "rope_parameters".into(),
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
               "beta_fast": 32.0, "rope_theta": 500000.0}),
    );
    let md = run(&c, None, None).unwrap().metadata;
    assert_eq!(
        md.get("llama.attention.head_count_kv"),
        Some(&MetaValue::U32(4))
    );
    assert_eq!(md.get("llama.context_length"), Some(&MetaValue::U32(2048)));
    assert_eq!(
        md.get("llama.rope.freq_base"),
        Some(&MetaValue::F32(500000.0))
    );
    assert_eq!(
        md.get("llama.rope.scaling.type"),
        Some(&MetaValue::String("yarn".into()))
    );
    assert_eq!(
        md.get("llama.rope.scaling.original_context_length"),
        Some(&MetaValue::U32(256))
    );
    assert_eq!(
        md.get("llama.rope.scaling.yarn_beta_fast"),
        Some(&MetaValue::F32(32.0))
    );
    // Legacy rope_scaling with "type"; llama3 scaling is a tensor: a note.
    let mut c = config();
    c["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    let md = run(&c, None, None).unwrap().metadata;
    assert_eq!(
        md.get("llama.rope.scaling.factor"),
        Some(&MetaValue::F32(2.0))
    );
    c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0});
    let r = run(&c, None, None).unwrap();
    assert!(r.metadata.get("llama.rope.scaling.type").is_none());
    assert!(
        r.notes.iter().any(|n| n.contains("rope_freqs")),
        "{:?}",
        r.notes
    );
    // A multimodal checkpoint's text_config; qwen2 writes no vocab_size.
    let c = json!({"model_type": "qwen2", "text_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 8}});
    let r = run(&c, None, None).unwrap();
    assert_eq!(r.arch.map(|a| a.name()), Some("qwen2"));
    assert_eq!(
        r.metadata.get("qwen2.embedding_length"),
        Some(&MetaValue::U32(32))
    );
    assert_eq!(
        r.metadata.get("qwen2.context_length"),
        Some(&MetaValue::U32(32768))
    );
    assert!(r.metadata.get("qwen2.vocab_size").is_none());
    assert!(r.metadata.get("qwen2.attention.key_length").is_none());
    assert!(r.notes.iter().any(|n| n.contains("no tokenizer.json")));
}

#[test]
fn an_unknown_family_gets_a_note() {
    let c = json!({"model_type": "mistral", "_name_or_path": "org/Some-Model/"});
    let r = run(&c, None, None).unwrap();
    assert!(r.arch.is_none());
    assert!(r.metadata.get("general.architecture").is_none());
    assert_eq!(
        r.metadata.get("general.name"),
        Some(&MetaValue::String("Some-Model".into()))
    );
    assert!(r.notes[0].contains("\"mistral\""), "{:?}", r.notes);
}

#[test]
fn pre_tokenizers_are_named_from_their_configuration() {
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    let seq = |a: Value, b: Value| json!({"type": "Sequence", "pretokenizers": [a, b]});
    let cases = [
        (byte_level(true), Some("gpt-2")),
        (
            seq(
                json!({"type": "Digits", "individual_digits": true}),
                byte_level(true),
            ),
            Some("smollm"),
        ),
        (
            seq(
                json!({"type": "Digits", "individual_digits": false}),
                byte_level(true),
            ),
            None,
        ),
        (
            seq(split(tokenizer_regexes().0), byte_level(false)),
            Some("llama-bpe"),
        ),
        (
            seq(split(tokenizer_regexes().1), byte_level(false)),
            Some("qwen2"),
        ),
        (seq(split(r"\s+"), byte_level(false)), None),
        (
            json!({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}),
            None,
        ),
    ];
    for (pre, want) in cases {
        let mut t = tokenizer();
        t["pre_tokenizer"] = pre.clone();
        let r = run(&config(), Some(&t), None).unwrap();
        let got = r
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(MetaValue::as_str);
        assert_eq!(got, want, "{pre}");
        assert_eq!(
            want.is_none(),
            r.notes
                .iter()
                .any(|n| n.contains("tokenizer.ggml.pre is not set")),
            "{:?}",
            r.notes
        );
    }
    // Not byte-level, not BPE: no tokenizer keys, a note.
    let mut t = tokenizer();
    t["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁"});
    let r = run(&config(), Some(&t), None).unwrap();
    assert!(r.metadata.get("tokenizer.ggml.tokens").is_none());
    assert!(
        r.notes.iter().any(|n| n.contains("no ByteLevel")),
        "{:?}",
        r.notes
    );
    let mut t = tokenizer();
    t["model"]["type"] = json!("Unigram");
    let r = run(&config(), Some(&t), None).unwrap();
    assert!(
        r.notes.iter().any(|n| n.contains("\"Unigram\"")),
        "{:?}",
        r.notes
    );
}

fn tokenizer_regexes() -> (&'static str, &'static str) {
    (tokenizer::LLAMA3_REGEX, tokenizer::QWEN2_REGEX)
}

#[test]
fn bad_tokenizers_are_notes_not_errors() {
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|t| t["model"]["vocab"]["zz"] = json!(8)),
            "token id 8, past the vocabulary size 8",
        ),
        (
            Box::new(|t| t["model"]["vocab"]["zz"] = json!(-1)),
            "\"zz\" is not an unsigned",
        ),
        (
            Box::new(|t| t["model"]["merges"] = json!([["a", "b"], "a b"])),
            "merges[1]",
        ),
        (
            Box::new(|t| t["model"]["merges"] = json!([["a"]])),
            "merges[0]",
        ),
        (
            Box::new(|t| t["added_tokens"] = json!([{"id": "x"}])),
            "added_tokens[0]",
        ),
        (Box::new(|t| t["model"] = json!([])), "no \"model\""),
    ];
    for (edit, want) in cases {
        let mut t = tokenizer();
        edit(&mut t);
        let r = run(&config(), Some(&t), None).unwrap();
        assert!(r.metadata.get("tokenizer.ggml.tokens").is_none());
        assert!(
            r.notes.iter().any(|n| n.contains(want)),
            "{want}: {:?}",
            r.notes
        );
    }
    let mut c = config();
    c["vocab_size"] = json!(1u64 << 30);
    let r = run(&c, Some(&tokenizer()), None).unwrap();
    assert!(
        r.notes.iter().any(|n| n.contains("at most")),
        "{:?}",
        r.notes
    );
    // A broken tokenizer_config.json is left out, with a note.
    let t = serde_json::to_vec(&tokenizer()).unwrap();
    let c = serde_json::to_vec(&config()).unwrap();
    let r = gguf_metadata(&HfFiles {
        config: &c,
        tokenizer: Some(&t),
        tokenizer_config: Some(b"{oops"),
        generation_config: Some(b"[]"),
    })
    .unwrap();
    assert!(r.metadata.get("tokenizer.ggml.tokens").is_some());
    assert_eq!(r.notes.len(), 2, "{:?}", r.notes);
}

#[test]
fn merges_with_spaces_and_special_vocab_rules() {
    let mut t = tokenizer();
    t["model"]["merges"] = json!([["a", "b"], ["a b", "c"]]);
    // Not marked special, but <|...|> looks special; ▁ in a user token is a space.
    t["added_tokens"][2] = json!({"id": 5, "content": "<|x|>", "special": false});
    t["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(json!({"id": 6, "content": "▁tab", "special": false}));
    t["post_processor"] = json!({"type": "ByteLevel"});
    let tc = json!({"bos_token": {"content": "<s>"}, "pad_token": "</s>", "unk_token": "nope",
                    "chat_template": [{"name": "default", "template": "D"}, {"name": "tool use", "template": "T"}]});
    let mut c = config();
    c["pad_token_id"] = json!(0);
    c["eos_token_id"] = json!([1, 2]);
    let md = run(&c, Some(&t), Some(&tc)).unwrap().metadata;
    assert_eq!(
        strings(md.get("tokenizer.ggml.merges")),
        ["a b", "a\u{120}b c"]
    );
    assert_eq!(ints(md.get("tokenizer.ggml.token_type"))[5..7], [3, 4]);
    assert_eq!(strings(md.get("tokenizer.ggml.tokens"))[6], " tab");
    assert_eq!(
        md.get("tokenizer.ggml.bos_token_id"),
        Some(&MetaValue::U32(0))
    );
    // tokenizer_config.json's pad token wins over config.json's id; a
    // list of eos ids is not one id; an unknown token not added is none.
    assert_eq!(
        md.get("tokenizer.ggml.padding_token_id"),
        Some(&MetaValue::U32(1))
    );
    assert!(md.get("tokenizer.ggml.eos_token_id").is_none());
    assert!(md.get("tokenizer.ggml.unknown_token_id").is_none());
    assert_eq!(
        md.get("tokenizer.ggml.add_bos_token"),
        Some(&MetaValue::Bool(false))
    );
    assert_eq!(
        md.get("tokenizer.chat_template"),
        Some(&MetaValue::String("D".into()))
    );
    assert_eq!(
        md.get("tokenizer.chat_template.tool_use"),
        Some(&MetaValue::String("T".into()))
    );
    assert_eq!(strings(md.get("tokenizer.chat_templates")), ["tool_use"]);
    // llama at SmolLM2's vocabulary size: add_bos_token forced false.
    let mut c = config();
    c["vocab_size"] = json!(49152);
    let md = run(&c, Some(&tokenizer()), None).unwrap().metadata;
    assert_eq!(
        md.get("tokenizer.ggml.add_bos_token"),
        Some(&MetaValue::Bool(false))
    );
    assert_eq!(strings(md.get("tokenizer.ggml.tokens")).len(), 49152);
}

#[test]
fn qwen3_head_dim_defaults_to_its_class_default() {
    // Qwen3Config's head_dim is 128 unless given (not hidden / heads), and
    // the converter reads the config through that class.
    let mut c = config();
    c["model_type"] = json!("qwen3");
    c["architectures"] = json!(["Qwen3ForCausalLM"]);
    let r = run(&c, None, None).unwrap();
    assert_eq!(r.arch.map(|a| a.name()), Some("qwen3"));
    for k in ["key_length", "value_length"] {
        assert_eq!(
            r.metadata.get(&format!("qwen3.attention.{k}")),
            Some(&MetaValue::U32(128))
        );
    }
    c["head_dim"] = json!(24);
    let r = run(&c, None, None).unwrap();
    assert_eq!(
        r.metadata.get("qwen3.attention.key_length"),
        Some(&MetaValue::U32(24))
    );
    assert!(r.metadata.get("qwen3.vocab_size").is_none());
}

#[test]
fn every_family_has_conversion_rules() {
    for a in crate::arch::FAMILIES {
        assert!(config::rules(a.name()).is_some(), "{}", a.name());
    }
}

#[test]
fn mangled_files_never_panic() {
    // Every single-byte truncation and a byte flip at each offset of a
    // config and a tokenizer: an error or notes, no panic.
    let c = serde_json::to_vec(&config()).unwrap();
    let t = serde_json::to_vec(&tokenizer()).unwrap();
    let tc = br#"{"bos_token": "<s>", "add_bos_token": true, "chat_template": "x"}"#;
    for i in 0..c.len() {
        for bytes in [c[..i].to_vec(), flip(&c, i)] {
            let _ = gguf_metadata(&HfFiles {
                config: &bytes,
                tokenizer: Some(&t),
                tokenizer_config: Some(tc),
                generation_config: None,
            });
        }
    }
    for i in 0..t.len() {
        for bytes in [t[..i].to_vec(), flip(&t, i)] {
            let r = gguf_metadata(&HfFiles {
                config: &c,
                tokenizer: Some(&bytes),
                tokenizer_config: Some(tc),
                generation_config: None,
            });
            assert!(r.is_ok(), "a broken tokenizer is a note");
        }
    }
}

fn flip(b: &[u8], i: usize) -> Vec<u8> {
    let mut v = b.to_vec();
    v[i] = match v[i] {
        b'"' => b'}',
        b'0'..=b'9' => b'-',
        x => x ^ 0x20,
    };
    v
}

#[test]
fn a_template_with_bos_eos_and_a_separator() {
    // What the sdist's gguf-py SpecialVocab gives for these files:
    // ids {bos 0, eos 1, sep 6, eot 5}, add {bos, eos, sep: true} (the
    // template's trailing </s> takes eos over tokenizer_config.json's <e2>,
    // which becomes eot; the post-processor's add_eos wins over the
    // config's false).
    let sp = |id: &str, type_id: u32| json!({"SpecialToken": {"id": id, "type_id": type_id}});
    let sq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut t = tokenizer();
    t["added_tokens"] = json!([
        {"id": 0, "content": "<s>", "special": true},
        {"id": 1, "content": "</s>", "special": true},
        {"id": 5, "content": "<e2>", "special": true},
        {"id": 6, "content": "<sep>", "special": true},
    ]);
    t["post_processor"] = json!({"type": "TemplateProcessing",
        "single": [sp("<s>", 0), sq("A", 0), sp("</s>", 0)],
        "pair": [sp("<s>", 0), sq("A", 0), sp("</s>", 0), sp("<sep>", 0), sq("B", 1), sp("</s>", 1)]});
    let tc = json!({"bos_token": "<s>", "eos_token": "<e2>", "sep_token": "<sep>", "add_eos_token": false});
    let mut c = config();
    let o = c.as_object_mut().unwrap();
    o.remove("bos_token_id");
    o.remove("eos_token_id");
    let md = run(&c, Some(&t), Some(&tc)).unwrap().metadata;
    for (k, id) in [
        ("bos_token_id", 0),
        ("eos_token_id", 1),
        ("seperator_token_id", 6),
        ("eot_token_id", 5),
    ] {
        assert_eq!(
            md.get(&format!("tokenizer.ggml.{k}")),
            Some(&MetaValue::U32(id)),
            "{k}"
        );
    }
    for k in ["bos", "eos", "sep"] {
        assert_eq!(
            md.get(&format!("tokenizer.ggml.add_{k}_token")),
            Some(&MetaValue::Bool(true)),
            "{k}"
        );
    }
}
