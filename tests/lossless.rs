//! Lossless .rknot (docs/FORMAT.md 6.7) end to end: `rknot encode rknot
//! --profile lossless` of a GGUF (F32) and of a tiny bf16 checkpoint saved by
//! transformers; `rknot verify --dense` says "lossless: bit-identical"; a
//! mount serves every tensor's `.f32` and `.bf16` bytes as the checkpoint's
//! (GGUF row order for the GGUF-named files), and transformers on
//! `MOUNT/hf` gives the checkpoint's logits exactly (torch.equal).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::mount::Mounted;
use common::*;
use rknot::backend::{self, Backend, StoredType};

fn work(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("lossless")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn encode(src: &Path, out: &Path) {
    let o = run_rknot(&[
        "encode",
        "rknot",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--profile",
        "lossless",
    ]);
    assert!(
        o.status.success(),
        "encode: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn verify_says_bit_identical(file: &Path, dense: &Path) {
    let o = run_rknot(&[
        "verify",
        file.to_str().unwrap(),
        "--dense",
        dense.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "verify: {text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(text.contains("lossless: bit-identical"), "{text}");
}

/// Every tensor of `enc` decodes to `dense`'s f32 bits.
fn same_bits(enc: &dyn Backend, dense: &dyn Backend) {
    let a = decoded_f32_tensors(enc);
    let b: std::collections::HashMap<String, (Vec<u64>, Vec<u8>)> = decoded_f32_tensors(dense)
        .into_iter()
        .map(|(n, s, v)| (n, (s, v)))
        .collect();
    assert_eq!(a.len(), b.len());
    for (name, shape, bytes) in &a {
        let (s, v) = &b[name];
        assert_eq!(shape, s, "{name}");
        assert!(bytes == v, "{name}: bytes differ");
    }
}

/// The demo model decoded to an F32 GGUF: every matrix stored
/// lossless_f32, every served value the GGUF's bits.
#[test]
fn a_f32_gguf_round_trips_bit_for_bit() {
    let d = work("f32");
    let demo = backend::open(&demo_path("tiny-llama.gguf"), None).unwrap();
    let decoded = decoded_f32_tensors(demo.as_ref());
    let src = d.join("tiny-llama-f32.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&src).unwrap());
    rknot::format::gguf::write_gguf(&mut f, &demo.summary().metadata, &as_f32_gguf(&decoded), 32)
        .unwrap();
    drop(f);
    let out = d.join("lossless.rknot");
    encode(&src, &out);
    let enc = backend::open(&out, None).unwrap();
    let dense = backend::open(&src, None).unwrap();
    let lossless = enc
        .tensors()
        .entries()
        .iter()
        .filter(|t| matches!(t.stored, StoredType::RknotLossless(_)))
        .count();
    let matrices = dense
        .tensors()
        .entries()
        .iter()
        .filter(|t| t.shape.len() == 2)
        .count();
    assert_eq!(lossless, matrices, "every matrix lossless");
    same_bits(enc.as_ref(), dense.as_ref());
    verify_says_bit_identical(&out, &src);
    // A lossy encode is not bit-identical, and verify says so.
    let lossy = d.join("faithful.rknot");
    let o = run_rknot(&[
        "encode",
        "rknot",
        src.to_str().unwrap(),
        "--out",
        lossy.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let o = run_rknot(&[
        "verify",
        lossy.to_str().unwrap(),
        "--dense",
        src.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("lossless: no ("), "{text}");
}

/// A bf16 GGUF with every special value (NaNs of both kinds and signs with
/// payloads, infinities, subnormals, -0.0) in its matrices: the encode's
/// values are the source's bits.
#[test]
fn special_values_survive_the_profile() {
    use rknot::format::gguf::write_gguf;
    use rknot::format::meta::{MetaValue, Metadata};
    use rknot::quant::GgmlType;
    let d = work("specials");
    let mut md = Metadata::default();
    md.push("general.architecture", MetaValue::String("llama".into()));
    md.push("llama.embedding_length", MetaValue::U32(16));
    md.push("llama.block_count", MetaValue::U32(1));
    let specials: [u16; 12] = [
        0x7fc0, 0xffc1, 0x7f81, 0xff81, 0x7f80, 0xff80, 0x0000, 0x8000, 0x0001, 0x807f, 0x7f7f,
        0x3f80,
    ];
    let mut words: Vec<u16> = (0..16 * 48)
        .map(|i| half::bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 300.0).to_bits())
        .collect();
    for (i, &s) in specials.iter().enumerate() {
        words[i * 13] = s;
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let f16: Vec<u8> = (0..16 * 16u32)
        .flat_map(|i| {
            let w: u16 = match i % 9 {
                0 => 0x7c01,
                1 => 0xfe00,
                2 => 0x0001,
                3 => 0x8000,
                _ => half::f16::from_f32(i as f32 / 100.0).to_bits(),
            };
            w.to_le_bytes()
        })
        .collect();
    let tensors: Vec<(String, Vec<u64>, GgmlType, &[u8])> = vec![
        // ggml order: [columns, rows].
        (
            "blk.0.attn_q.weight".into(),
            vec![16, 48],
            GgmlType::Bf16,
            &bytes[..],
        ),
        (
            "blk.0.attn_k.weight".into(),
            vec![16, 16],
            GgmlType::F16,
            &f16[..],
        ),
    ];
    let src = d.join("specials.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&src).unwrap());
    write_gguf(&mut f, &md, &tensors, 32).unwrap();
    drop(f);
    let out = d.join("specials.rknot");
    encode(&src, &out);
    let enc = backend::open(&out, None).unwrap();
    let i = enc.find("blk.0.attn_q.weight").unwrap();
    let mut v = vec![0f32; 16 * 48];
    enc.read_f32(i, 0, &mut v).unwrap();
    for (k, (x, &w)) in v.iter().zip(&words).enumerate() {
        assert_eq!(x.to_bits(), u32::from(w) << 16, "value {k}");
    }
    // The f16 tensor: its NaNs keep their payloads and signalling bit.
    let i = enc.find("blk.0.attn_k.weight").unwrap();
    let mut v = vec![0f32; 256];
    enc.read_f32(i, 0, &mut v).unwrap();
    assert_eq!(v[0].to_bits(), 0x7f80_2000);
    assert_eq!(v[1].to_bits(), 0xffc0_0000);
    assert_eq!(v[2], 2f32.powi(-24));
    assert_eq!(v[3].to_bits(), 0x8000_0000);
}

/// The checkpoint, its reference bytes and logits (transformers).
const MAKE_CHECKPOINT: &str = r#"
import json, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
torch.manual_seed(27)
cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  max_position_embeddings=128, tie_word_embeddings=False)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
with torch.no_grad():
    for p in m.parameters():
        # Per-output-channel scales and a few outliers, as real weights have.
        x = torch.randn_like(p, dtype=torch.float32) * 0.05
        if x.dim() == 2:
            x = x * (1 + 3 * torch.rand(x.shape[0], 1))
            x.view(-1)[torch.randint(0, x.numel(), (8,))] *= 20
        p.copy_(x.to(torch.bfloat16))
ckpt = os.path.join(out, "ckpt")
m.save_pretrained(ckpt, safe_serialization=True)
ids = torch.tensor([[1, 17, 42, 299, 5, 123, 7, 64]])
r = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
with torch.no_grad():
    torch.save(r(ids).logits, os.path.join(out, "logits.pt"))

def permute(w, n_head):
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down"}
top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
ref = []
for i, (k, t) in enumerate(m.state_dict().items()):
    if k in top:
        g = top[k]
    else:
        p = k.split(".")
        g = f"blk.{p[2]}.{GGUF['.'.join(p[3:-1])]}.{p[-1]}"
    if ".q_proj." in k:
        t = permute(t, 4)
    elif ".k_proj." in k:
        t = permute(t, 2)
    f = os.path.join(out, f"{i}.bf16")
    t.contiguous().view(torch.int16).numpy().tofile(f)
    ref.append([g, f])
json.dump(ref, open(os.path.join(out, "ref.json"), "w"))
print(os.path.join(out, "ckpt"))
"#;

const CHECK_LOGITS: &str = r#"
import os, sys
import torch
from transformers import LlamaForCausalLM
hf, ckpt, want = sys.argv[1:4]
a = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)
b = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
sa, sb = a.state_dict(), b.state_dict()
assert set(sa) == set(sb), sorted(set(sa) ^ set(sb))
for k in sa:
    assert torch.equal(sa[k].view(torch.int32), sb[k].view(torch.int32)), k
ids = torch.tensor([[1, 17, 42, 299, 5, 123, 7, 64]])
with torch.no_grad():
    got = a(ids).logits
assert torch.equal(got, torch.load(want)), (got - torch.load(want)).abs().max()
print("LOGITS EQUAL", len(sa))
"#;

fn hf_python(script: &str, args: &[&Path]) -> String {
    let py = std::env::var_os("RKNOT_HF_PYTHON")
        .filter(|p| !p.is_empty())
        .expect("RKNOT_HF_PYTHON: a python3 with torch and transformers (tools/hf-env.sh)");
    let o = Command::new(py)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

needs! { [hf, fuse]
    /// A bf16 checkpoint encoded losslessly and mounted: every tensor's
    /// `.bf16` file is the checkpoint's bytes (GGUF rows), its `.f32` file
    /// their exact widening; verify says bit-identical; transformers on
    /// MOUNT/hf has the checkpoint's tensors and logits exactly.
    fn a_bf16_checkpoint_serves_its_exact_bytes_and_logits() {
        let d = work("bf16");
        let ckpt = PathBuf::from(hf_python(MAKE_CHECKPOINT, &[&d]).trim());
        let out = d.join("lossless.rknot");
        encode(&ckpt, &out);
        verify_says_bit_identical(&out, &ckpt);
        let enc_len = std::fs::metadata(&out).unwrap().len();
        let ckpt_len = std::fs::metadata(ckpt.join("model.safetensors")).unwrap().len();
        eprintln!("lossless .rknot {enc_len} B, checkpoint {ckpt_len} B");
        assert!(enc_len < ckpt_len);
        let m = Mounted::new(&out, &["--views", "bf16"]);
        let reference: Vec<(String, String)> =
            serde_json::from_slice(&std::fs::read(d.join("ref.json")).unwrap()).unwrap();
        for (name, file) in &reference {
            let want = std::fs::read(file).unwrap();
            let got = std::fs::read(m.path(&format!("{name}.bf16")))
                .unwrap_or_else(|e| panic!("{name}.bf16: {e}\n{}", m.log()));
            assert!(got == want, "{name}.bf16 differs from the checkpoint's bytes");
            let f32: Vec<u8> = want
                .chunks_exact(2)
                .flat_map(|w| (u32::from(u16::from_le_bytes([w[0], w[1]])) << 16).to_le_bytes())
                .collect();
            let got = std::fs::read(m.path(&format!("{name}.f32"))).unwrap();
            assert!(got == f32, "{name}.f32 differs from the checkpoint's values");
        }
        // A lossless encode of a bf16 checkpoint is a bf16 source: hf/
        // comes in bf16 (fs::precision), the checkpoint's own bytes.
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(m.path("hf/config.json")).unwrap()).unwrap();
        assert_eq!(config["torch_dtype"], "bfloat16", "{config}");
        let logits = d.join("logits.pt");
        let said = hf_python(CHECK_LOGITS, &[&m.path("hf"), &ckpt, &logits]);
        assert!(said.contains("LOGITS EQUAL"), "{said}");
    }
}
