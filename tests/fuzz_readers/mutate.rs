//! The fuzzer's random source and its mutations: byte-level (bit flips,
//! interesting integers aimed at a seed's fields, truncation, junk,
//! duplicated or deleted ranges) and structured (header JSON edited and
//! re-serialized behind a correct length prefix).

use super::*;

// -------------------------------------------------------------------- RNG

/// xorshift64*.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    pub(crate) fn upto(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    pub(crate) fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    pub(crate) fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.upto(xs.len())]
    }
}

// -------------------------------------------------------------- mutations

pub(crate) const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    4095,
    4096,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x1_0001,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 53,
    1 << 62,
    1 << 63,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
];

/// Where a seed's binary fields are, to aim integer overwrites at them.
#[derive(Clone, Default)]
pub(crate) struct FieldMap {
    /// (offset, width) of integer fields.
    pub(crate) fields: Vec<(usize, usize)>,
    /// End of the header (mutations are biased towards it).
    pub(crate) header_end: usize,
    /// The header is JSON.
    pub(crate) json: bool,
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Knot,
    Rknot,
    Gguf,
    Safetensors,
}

pub(crate) fn kind_of(bytes: &[u8]) -> Kind {
    if bytes.starts_with(b"RKNOT") {
        Kind::Rknot
    } else if bytes.starts_with(b"GGUF") {
        Kind::Gguf
    } else if safetensors_split(bytes).is_some() {
        Kind::Safetensors
    } else {
        Kind::Knot
    }
}

/// A safetensors file's header JSON and data, when its length prefix fits.
pub(crate) fn safetensors_split(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    let json = bytes.get(8..end)?;
    (json.first() == Some(&b'{')).then(|| (json, &bytes[end..]))
}

pub(crate) fn layout_of(bytes: &[u8]) -> FieldMap {
    match kind_of(bytes) {
        Kind::Knot => {
            let meta_len = u32::from_le_bytes(bytes[6..10].try_into().unwrap()) as usize;
            let codec = (10 + meta_len + 3) & !3;
            FieldMap {
                fields: vec![(4, 2), (6, 4), (codec, 1)],
                header_end: codec + 1,
                json: true,
            }
        }
        Kind::Rknot if bytes.starts_with(b"RKNOT\x03") => {
            // Footer lengths; the header is at the end, so every byte may
            // be a header byte.
            let n = bytes.len();
            FieldMap {
                fields: vec![(5, 1), (6, 2), (n - 24, 8), (n - 16, 8)],
                header_end: n,
                json: true,
            }
        }
        Kind::Rknot => {
            let len = u32::from_le_bytes(bytes[6..10].try_into().unwrap()) as usize;
            FieldMap {
                fields: vec![(5, 1), (6, 4)],
                header_end: 10 + len,
                json: true,
            }
        }
        Kind::Gguf => gguf_layout(bytes),
        Kind::Safetensors => FieldMap {
            fields: vec![(0, 8)],
            header_end: safetensors_split(bytes).map_or(8, |(j, _)| 8 + j.len()),
            json: true,
        },
    }
}

/// Walk a valid GGUF header recording its integer fields.
pub(crate) fn gguf_layout(b: &[u8]) -> FieldMap {
    pub(crate) struct W<'a> {
        b: &'a [u8],
        pos: usize,
        fields: Vec<(usize, usize)>,
    }
    impl W<'_> {
        pub(crate) fn int(&mut self, width: usize) -> u64 {
            let mut v = [0u8; 8];
            v[..width].copy_from_slice(&self.b[self.pos..self.pos + width]);
            self.fields.push((self.pos, width));
            self.pos += width;
            u64::from_le_bytes(v)
        }
        pub(crate) fn string(&mut self) {
            let n = self.int(8) as usize;
            self.pos += n;
        }
        pub(crate) fn value(&mut self, ty: u64) {
            match ty {
                0 | 1 | 7 => self.pos += 1,
                2 | 3 => self.pos += 2,
                4..=6 => self.pos += 4,
                10..=12 => self.pos += 8,
                8 => self.string(),
                9 => {
                    let et = self.int(4);
                    let n = self.int(8);
                    for _ in 0..n {
                        self.value(et);
                    }
                }
                _ => panic!("seed GGUF has value type {ty}"),
            }
        }
    }
    let mut w = W {
        b,
        pos: 4,
        fields: Vec::new(),
    };
    w.int(4);
    let tc = w.int(8);
    let kc = w.int(8);
    let mut alignment = 32;
    for _ in 0..kc {
        let key_at = w.pos + 8;
        w.string();
        let key = &b[key_at..w.pos];
        let ty = w.int(4);
        if key == b"general.alignment" {
            alignment = u32::from_le_bytes(b[w.pos..w.pos + 4].try_into().unwrap()) as usize;
        }
        w.value(ty);
    }
    for _ in 0..tc {
        w.string();
        let nd = w.int(4);
        for _ in 0..nd {
            w.int(8);
        }
        w.int(4);
        w.int(8);
    }
    let header_end = w.pos.div_ceil(alignment) * alignment;
    FieldMap {
        fields: w.fields,
        header_end,
        json: false,
    }
}

pub(crate) fn interesting_int(rng: &mut Rng, old: u64) -> u64 {
    match rng.below(5) {
        0 => rng.next(),
        1 => old.wrapping_add(1 + rng.below(16)),
        2 => old.wrapping_sub(1 + rng.below(16)),
        _ => *rng.pick(INTERESTING),
    }
}

pub(crate) fn position(rng: &mut Rng, len: usize, lay: &FieldMap) -> usize {
    let head = lay.header_end.min(len);
    if lay.json && head < len && !rng.chance(4) {
        // JSON headers get structured edits; aim most raw edits past them.
        head + rng.upto(len - head)
    } else if !lay.json && head > 0 && rng.chance(2) {
        rng.upto(head)
    } else {
        rng.upto(len)
    }
}

/// One byte-level mutation.
pub(crate) fn mutate_bytes(d: &mut Vec<u8>, rng: &mut Rng, lay: &FieldMap) {
    if d.is_empty() {
        d.extend((0..1 + rng.upto(16)).map(|_| rng.next() as u8));
        return;
    }
    let len = d.len();
    match rng.below(11) {
        0 => {
            let p = position(rng, len, lay);
            d[p] ^= 1 << rng.below(8);
        }
        1 => {
            let p = position(rng, len, lay);
            d[p] = *rng.pick(&[0u8, 0xff, 0x7f, 0x80, 1, 0x3f, 0x20]);
        }
        2 => {
            let p = position(rng, len, lay);
            d[p] = rng.next() as u8;
        }
        3..=5 => {
            let (p, w) = if !lay.fields.is_empty() && rng.chance(2) {
                *rng.pick(&lay.fields)
            } else {
                (position(rng, len, lay), *rng.pick(&[1usize, 2, 4, 8]))
            };
            if p + w <= len {
                let mut old = [0u8; 8];
                old[..w].copy_from_slice(&d[p..p + w]);
                let v = interesting_int(rng, u64::from_le_bytes(old)).to_le_bytes();
                d[p..p + w].copy_from_slice(&v[..w]);
            }
        }
        6 => {
            let cut = if !lay.fields.is_empty() && rng.chance(2) {
                let (p, w) = *rng.pick(&lay.fields);
                p + rng.upto(w + 1)
            } else {
                rng.upto(len + 1)
            };
            d.truncate(cut.min(len));
        }
        7 => {
            let n = 1 + rng.upto(64);
            let junk = rng.below(3);
            for _ in 0..n {
                let b = match junk {
                    0 => 0,
                    1 => 0xff,
                    _ => rng.next() as u8,
                };
                d.push(b);
            }
        }
        8 => {
            // Duplicate a range.
            let a = rng.upto(len);
            let n = 1 + rng.upto((len - a).min(256));
            let chunk = d[a..a + n].to_vec();
            let at = rng.upto(len + 1);
            d.splice(at..at, chunk);
        }
        9 => {
            // Delete a range.
            let a = position(rng, len, lay);
            let n = 1 + rng.upto((len - a).min(64));
            d.drain(a..a + n);
        }
        _ => {
            // Fill a range with one byte.
            let a = position(rng, len, lay);
            let n = 1 + rng.upto((len - a).min(32));
            let b = *rng.pick(&[0u8, 0xff, b'9', b'[', b'{', b'"']);
            d[a..a + n].fill(b);
        }
    }
}

// ------------------------------------------------- structured JSON edits

pub(crate) const KEYS: &[&str] = &[
    "d_out",
    "d_in",
    "rank",
    "offset",
    "length",
    "u_max",
    "sigma_max",
    "v_max",
    "type",
    "shape",
    "format",
    "sketches",
    "tensors",
    "metadata",
    "version",
    "arch_meta",
    "layers",
    "index",
    "manifest",
    "d",
    "k",
    "standing_indices",
    "amplitudes",
    "phase_alignment",
    "name",
    "restricted_axes",
    "mode",
    "bits",
    "line_axis",
    "block_shape",
    "blocks",
    "num_layers",
    "hidden_dim",
    "arch",
    "topology",
    "elem_type",
    "value",
    "general.alignment",
];

pub(crate) const STRINGS: &[&str] = &[
    "rows",
    "cols",
    "uniform",
    "graded",
    "sk32",
    "knot",
    "rknot",
    "f32",
    "f16",
    "bf16",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q8_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q4_k_m",
    "q5_k",
    "q6_k",
    "iq2_xxs",
    "u8",
    "u32",
    "u64",
    "i64",
    "f64",
    "string",
    "array",
    "bool",
    "nan",
    "inf",
    "-inf",
    "",
    "blk.0.attn_o.weight",
    "blk.0.attn_output.weight",
    "blk_0_attn_q_weight",
    "blk.0.attn_q.weight",
    "blk.1.attn_q.weight",
    "token_embd.weight",
    "output.weight",
    "a/b",
    "..",
    ".",
    "x\u{0}y",
];

pub(crate) fn interesting_json(rng: &mut Rng) -> Value {
    match rng.below(12) {
        0 => json!(-1),
        1 => json!(i64::MIN),
        2 => json!(1e39),
        3 => json!(-1e39),
        4 => json!(0.5),
        5 => json!(-0.0),
        6 => json!(1e308),
        7 => json!(rng.below(20)),
        _ => json!(*rng.pick(INTERESTING)),
    }
}

pub(crate) fn escape(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}

pub(crate) fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                pointers(x, format!("{at}/{}", escape(k)), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// One structured edit of a JSON document.
pub(crate) fn mutate_json(root: &mut Value, rng: &mut Rng) {
    let mut ptrs = Vec::new();
    pointers(root, String::new(), &mut ptrs);
    // Half the time, nudge a number: keeps the header parseable and probes
    // the value checks rather than the JSON accessors.
    if rng.chance(2) {
        let nums: Vec<&String> = ptrs
            .iter()
            .filter(|p| root.pointer(p).is_some_and(Value::is_number))
            .collect();
        if !nums.is_empty() {
            let p = nums[rng.upto(nums.len())].clone();
            if rng.chance(4)
                && let Some(old) = root.pointer(&p).cloned()
            {
                // Change every occurrence of this value at once: keeps
                // fields that must agree (a shape and the manifest's d, a
                // length and its shape) consistent while making them huge.
                let new = match old.as_u64() {
                    Some(o) => json!(interesting_int(rng, o)),
                    None => interesting_json(rng),
                };
                for q in &nums {
                    if let Some(node) = root.pointer_mut(q)
                        && *node == old
                    {
                        *node = new.clone();
                    }
                }
                return;
            }
            if let Some(node) = root.pointer_mut(&p) {
                *node = match node.as_u64() {
                    Some(old) if !rng.chance(4) => json!(interesting_int(rng, old)),
                    _ => interesting_json(rng),
                };
            }
            return;
        }
    }
    if rng.chance(6) {
        // Reorder an object's keys: key order carries no meaning, and a
        // typed metadata value may come before its "type".
        let objs: Vec<&String> = ptrs
            .iter()
            .filter(|p| root.pointer(p).is_some_and(Value::is_object))
            .collect();
        if !objs.is_empty() {
            let p = objs[rng.upto(objs.len())].clone();
            if let Some(Value::Object(m)) = root.pointer_mut(&p) {
                let mut entries: Vec<(String, Value)> = std::mem::take(m).into_iter().collect();
                if rng.chance(2) {
                    entries.reverse();
                } else if !entries.is_empty() {
                    let k = rng.upto(entries.len());
                    entries.rotate_left(k);
                }
                m.extend(entries);
            }
            return;
        }
    }
    let other = root
        .pointer(&ptrs[rng.upto(ptrs.len())])
        .cloned()
        .unwrap_or(Value::Null);
    let p = ptrs[rng.upto(ptrs.len())].clone();
    let Some(node) = root.pointer_mut(&p) else {
        return;
    };
    match rng.below(9) {
        0 => *node = interesting_json(rng),
        1 => {
            *node = match node {
                Value::Number(n) if n.is_u64() => {
                    let old = n.as_u64().unwrap_or(0);
                    json!(interesting_int(rng, old))
                }
                Value::Number(n) => json!(-n.as_f64().unwrap_or(0.0) * 1.5),
                _ => interesting_json(rng),
            }
        }
        2 => {
            *node = match rng.below(8) {
                0 => Value::Null,
                1 => json!(true),
                2 => json!(*rng.pick(STRINGS)),
                3 => json!([]),
                4 => json!({}),
                5 => json!([node.clone()]),
                6 => json!({"x": node.clone()}),
                _ => json!(node.to_string()),
            }
        }
        3 => match node {
            Value::Object(m) if !m.is_empty() => {
                let k = m.keys().nth(rng.upto(m.len())).cloned().unwrap_or_default();
                m.remove(&k);
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.upto(a.len());
                a.remove(i);
            }
            _ => *node = interesting_json(rng),
        },
        4 => match node {
            Value::Object(m) => {
                let v = if rng.chance(2) {
                    other
                } else {
                    interesting_json(rng)
                };
                m.insert(rng.pick(KEYS).to_string(), v);
            }
            Value::Array(a) => {
                let v = match a.first() {
                    Some(x) if rng.chance(2) => x.clone(),
                    _ => interesting_json(rng),
                };
                let at = rng.upto(a.len() + 1);
                a.insert(at, v);
            }
            _ => *node = other,
        },
        5 => match node {
            Value::Object(m) if !m.is_empty() => {
                // Rename a key (to a known key or a tensor-name alias).
                let k = m.keys().nth(rng.upto(m.len())).cloned().unwrap_or_default();
                if let Some(v) = m.remove(&k) {
                    let new = if rng.chance(2) {
                        rng.pick(KEYS).to_string()
                    } else {
                        rng.pick(STRINGS).to_string()
                    };
                    m.insert(new, v);
                }
            }
            Value::Array(a) if a.len() >= 2 => {
                let (i, j) = (rng.upto(a.len()), rng.upto(a.len()));
                if rng.chance(2) {
                    a.swap(i, j);
                } else {
                    a.truncate(i.max(1));
                }
            }
            _ => *node = json!(*rng.pick(STRINGS)),
        },
        6 => *node = other,
        7 => *node = json!(*rng.pick(STRINGS)),
        _ => {
            if let Value::Number(n) = node {
                let x = n.as_f64().unwrap_or(0.0);
                *node = json!(x + *rng.pick(&[0.5, -0.5, 1e-9, 2.0]));
            } else {
                *node = interesting_json(rng);
            }
        }
    }
}

/// Serialize, sometimes writing one object key twice (serde_json keeps the
/// last one).
pub(crate) fn to_text(v: &Value, rng: &mut Rng) -> Vec<u8> {
    pub(crate) fn write(v: &Value, out: &mut String, rng: &mut Rng, dups: &mut u32) {
        match v {
            Value::Object(m) => {
                out.push('{');
                let mut first = true;
                for (k, x) in m {
                    let key = serde_json::to_string(k).unwrap_or_default();
                    if *dups > 0 && rng.chance(6) {
                        *dups -= 1;
                        if !first {
                            out.push(',');
                        }
                        out.push_str(&key);
                        out.push(':');
                        out.push_str(&interesting_json(rng).to_string());
                        first = false;
                    }
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    out.push_str(&key);
                    out.push(':');
                    write(x, out, rng, dups);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out, rng, dups);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    if !rng.chance(8) {
        return serde_json::to_vec(v).unwrap_or_default();
    }
    let mut out = String::new();
    let mut dups = 1 + rng.below(2) as u32;
    write(v, &mut out, rng, &mut dups);
    out.into_bytes()
}

/// Raw edits of the JSON text (kept behind a correct length prefix).
pub(crate) fn mutate_text(t: &mut Vec<u8>, rng: &mut Rng) {
    pub(crate) const TOKENS: &[&[u8]] = &[
        b"1e999",
        b"-0",
        b"18446744073709551616",
        b"NaN",
        b"null",
        b"\"\\ud800\"",
        b"[[[[[[[[",
        b"}",
        b",",
        b"\xff",
    ];
    if t.is_empty() {
        let tok: &[u8] = TOKENS[rng.upto(TOKENS.len())];
        t.extend_from_slice(tok);
        return;
    }
    let at = rng.upto(t.len() + 1);
    match rng.below(3) {
        0 => {
            let tok: &[u8] = TOKENS[rng.upto(TOKENS.len())];
            t.splice(at..at, tok.iter().copied());
        }
        1 => t.truncate(at),
        _ => {
            let n = (t.len() - at).min(1 + rng.upto(8));
            t.drain(at..at + n);
        }
    }
}

/// A structured mutation of a KNOT or .rknot file; `None` if its header is
/// not JSON any more.
pub(crate) fn mutate_structured(d: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let kind = kind_of(d);
    let (mut v, rest) = match kind {
        Kind::Knot => {
            let (v, body) = corpus::knot_split(d)?;
            (v, corpus::RknotRest::V2 { body })
        }
        Kind::Rknot => corpus::rknot_split_any(d)?,
        Kind::Gguf => return None,
        Kind::Safetensors => {
            let (json, data) = safetensors_split(d)?;
            let mut v: Value = serde_json::from_slice(json).ok()?;
            for _ in 0..1 + rng.below(3) {
                mutate_json(&mut v, rng);
            }
            let mut text = to_text(&v, rng);
            if rng.chance(6) {
                mutate_text(&mut text, rng);
            }
            let mut out = (text.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&text);
            out.extend_from_slice(data);
            return Some(out);
        }
    };
    for _ in 0..1 + rng.below(3) {
        mutate_json(&mut v, rng);
    }
    let mut text = to_text(&v, rng);
    if rng.chance(6) {
        mutate_text(&mut text, rng);
    }
    Some(match (kind, &rest) {
        (Kind::Knot, corpus::RknotRest::V2 { body }) => corpus::knot_raw(&text, body),
        _ => corpus::rknot_raw_any(&text, &rest),
    })
}

/// Mutate one file of an input.
pub(crate) fn mutate(d: &mut Vec<u8>, rng: &mut Rng, lay: &FieldMap) {
    let structured = matches!(kind_of(d), Kind::Knot | Kind::Rknot | Kind::Safetensors);
    let mode = if structured { rng.below(20) } else { 10 };
    if mode < 10
        && let Some(m) = mutate_structured(d, rng)
    {
        *d = m;
    }
    let bytes_ops = match mode {
        0..=6 => 0,
        7..=9 => 1 + rng.below(2),
        _ => 1 + rng.below(4),
    };
    for _ in 0..bytes_ops {
        mutate_bytes(d, rng, lay);
    }
    // Files with checksums refuse any byte change to their metadata at the
    // KSUM record: half the time the record is recomputed, so the mutation
    // reaches the parsers behind it.
    if bytes_ops > 0 && rng.chance(2) {
        corpus::reseal_any(d);
    }
}
