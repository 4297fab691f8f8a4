//! Every model family against transformers and llama.cpp's converter: a
//! tiny random checkpoint per family, made by transformers' own classes
//! and converted to an F32 GGUF by `convert_hf_to_gguf.py`
//! (tests/data/families/make.py, which also records the reference:
//! transformers' fp32 logits of a fixed token sequence, its greedy
//! continuation and its tokenizer's ids of a few texts). The GGUF is
//! mounted and
//! - transformers loads `MOUNT/hf` (model and tokenizer) and gives the
//!   reference back (tests/data/families/check.py: logits within 1e-4
//!   relative, the same greedy tokens, the same ids);
//! - the probe's forward pass on the mount gives the reference logits
//!   (within 1e-3 relative) and `rknot probe` the same top-1;
//! - the checkpoint's safetensors directory, mounted as it is, gives the
//!   same `hf/` and the same probe report as the GGUF.
//!
//! One Python process makes every family (the conversions run in
//! parallel) and one checks every mount: each costs seconds, most of it
//! importing torch.

mod common;

use std::path::Path;
use std::process::Command;

use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::probe::sites::{ActivationRecorder, Site};
use rknot::probe::weights::{BackendSource, MountSource};
use rknot::probe::{KvCache, Model, WeightSource};

/// A checkpoint of tests/data/families/make.py and what is checked on it.
struct Family {
    /// make.py's name (transformers' `model_type`, or a variant of one).
    name: &'static str,
    /// `hf/` is offered and transformers loads it; false: `hf/` is absent
    /// and index.json's reason names an expert tensor.
    hf: bool,
    /// The safetensors directory serves the GGUF's tensors (false: its
    /// per-expert tensors are not stacked into the 3-D ones).
    safetensors: bool,
}

const FAMILIES: &[Family] = &[
    Family {
        name: "llama",
        hf: true,
        safetensors: true,
    },
    Family {
        name: "qwen2",
        hf: true,
        safetensors: true,
    },
    Family {
        name: "qwen3",
        hf: true,
        safetensors: true,
    },
    Family {
        name: "mixtral",
        hf: true,
        safetensors: true,
    },
    Family {
        name: "qwen3_moe",
        hf: true,
        safetensors: true,
    },
    Family {
        name: "qwen3_moe_forced",
        hf: true,
        safetensors: true,
    },
];

fn script(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/families")
        .join(name)
}

/// Run a Python script of tests/data/families with transformers, its
/// stdout, or a panic with both streams.
fn python(name: &str, args: &[&std::ffi::OsStr]) -> String {
    let py = std::env::var_os("RKNOT_HF_PYTHON").expect("RKNOT_HF_PYTHON");
    let o = Command::new(py)
        .arg(script(name))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{name}: {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

struct Reference {
    tokens: Vec<u32>,
    /// `tokens.len() × n_vocab`.
    logits: Vec<f32>,
    n_vocab: usize,
}

fn reference(work: &Path, family: &str) -> Reference {
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.join(format!("{family}.ref.json"))).unwrap())
            .unwrap();
    let tokens = r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let logits = std::fs::read(work.join(format!("{family}.logits.f32")))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Reference {
        tokens,
        logits,
        n_vocab: r["n_vocab"].as_u64().unwrap() as usize,
    }
}

/// max |a - b| / max |b|.
fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// The probe's logits of every position of `tokens`, or why not.
fn probe_logits(src: &dyn WeightSource, tokens: &[u32]) -> Result<Vec<f32>, String> {
    let model = Model::load(src).map_err(|e| e.to_string())?;
    let mut cache = KvCache::new(&model.config);
    model
        .forward(tokens, &mut cache, 0..tokens.len())
        .map_err(|e| e.to_string())
}

/// `rknot probe SOURCE --tokens ...`'s candidate lines, or why not.
fn probe_cli(source: &Path, tokens: &[u32]) -> Result<String, String> {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let o = Command::new(rknot_bin())
        .arg("probe")
        .arg(source)
        .args(["--tokens", &ids.join(","), "--top", "3"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    if !o.status.success() {
        return Err(format!(
            "rknot probe failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    Ok(text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("rank"))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// The token id of the first candidate of a probe report.
fn top1(report: &str) -> Option<u32> {
    report
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A weight source as opened, or why not.
type OpenedSource = Result<Box<dyn WeightSource>, String>;

/// What the probe gets wrong on `family`'s mounted GGUF and its
/// safetensors directory.
fn probe_problems(work: &Path, fam: &Family, gguf_mount: &Path) -> Vec<String> {
    let family = fam.name;
    let r = reference(work, family);
    let mut wrong = Vec::new();
    let want_top1 = argmax(&r.logits[r.logits.len() - r.n_vocab..]);
    let mut reports = Vec::new();
    let checkpoint = work.join(family);
    let mut sources: Vec<(&str, OpenedSource, &Path)> = vec![
        (
            "the mounted GGUF",
            MountSource::open(gguf_mount, None)
                .map(|s| Box::new(s) as Box<dyn WeightSource>)
                .map_err(|e| e.to_string()),
            gguf_mount,
        ),
        (
            "the safetensors directory",
            BackendSource::open(&checkpoint, None)
                .map(|s| Box::new(s) as Box<dyn WeightSource>)
                .map_err(|e| e.to_string()),
            &checkpoint,
        ),
    ];
    if !fam.safetensors {
        sources.pop();
    }
    for (what, src, path) in sources {
        match src.and_then(|s| probe_logits(s.as_ref(), &r.tokens)) {
            Err(e) => wrong.push(format!("{family}: the probe on {what}: {e}")),
            Ok(got) if got.len() != r.logits.len() => wrong.push(format!(
                "{family}: the probe on {what}: {} logits, transformers {}",
                got.len(),
                r.logits.len()
            )),
            Ok(got) => {
                let rel = max_rel_diff(&got, &r.logits);
                eprintln!("{family}: probe on {what}: logits max relative difference {rel:.3e}");
                // NaN fails too.
                if rel.is_nan() || rel > 1e-3 {
                    wrong.push(format!(
                        "{family}: the probe on {what}: logits max relative difference {rel:.3e} > 1e-3"
                    ));
                }
            }
        }
        match probe_cli(path, &r.tokens) {
            Err(e) => wrong.push(format!("{family}: {what}: {e}")),
            Ok(report) => {
                if top1(&report) != Some(want_top1) {
                    wrong.push(format!(
                        "{family}: rknot probe on {what}: top-1 {:?}, transformers {want_top1}",
                        top1(&report)
                    ));
                }
                reports.push(report);
            }
        }
    }
    if let [a, b] = &reports[..]
        && a != b
    {
        wrong.push(format!(
            "{family}: rknot probe differs between the GGUF and the safetensors directory:\n{a}\nvs\n{b}"
        ));
    }
    wrong
}

/// Rows the forward pass showed a recorder, per layer: the layer's
/// `ffn_in` and each expert's own `ffn_in` / `ffn_down_in`.
#[derive(Default)]
struct RoutedRows {
    ffn_in: Vec<usize>,
    /// `[layer][expert]`: (ffn_in rows, ffn_down_in rows).
    experts: Vec<Vec<(usize, usize)>>,
}

impl ActivationRecorder for RoutedRows {
    fn record(&mut self, layer: usize, site: Site, _x: &[f32], n: usize) {
        if site == Site::FfnIn {
            self.ffn_in.resize(self.ffn_in.len().max(layer + 1), 0);
            self.ffn_in[layer] += n;
        }
    }

    fn record_expert(&mut self, layer: usize, expert: usize, site: Site, _x: &[f32], n: usize) {
        self.experts
            .resize(self.experts.len().max(layer + 1), Vec::new());
        let l = &mut self.experts[layer];
        l.resize(l.len().max(expert + 1), (0, 0));
        match site {
            Site::FfnIn => l[expert].0 += n,
            Site::FfnDownIn => l[expert].1 += n,
            _ => {}
        }
    }
}

/// With the router forced to expert 0 (make.py's `force_expert_0`), the
/// recorder sees every row at expert 0 and none at the others.
fn forced_router_problems(family: &str, mount: &Path) -> Vec<String> {
    let src = MountSource::open(mount, None).unwrap();
    let model = Model::load(&src).unwrap();
    let n_expert = model.config.moe.map(|m| m.n_expert).unwrap_or(0);
    let tokens = [5u32, 6, 7, 8, 9];
    let mut rec = RoutedRows::default();
    let mut cache = KvCache::new(&model.config);
    model
        .forward_recorded(&tokens, &mut cache, 0..1, Some(&mut rec))
        .unwrap();
    let mut wrong = calibrated_router_problems(family, mount, &tokens, n_expert);
    for layer in 0..model.config.n_layer {
        let mut want = vec![(0, 0); n_expert];
        if let Some(w) = want.first_mut() {
            *w = (tokens.len(), tokens.len());
        }
        let mut got = rec.experts.get(layer).cloned().unwrap_or_default();
        got.resize(n_expert, (0, 0));
        if got != want || rec.ffn_in.get(layer) != Some(&tokens.len()) {
            wrong.push(format!(
                "{family}: layer {layer}: experts saw {got:?} rows (want {want:?}), the layer's \
                 ffn_in {:?}",
                rec.ffn_in.get(layer)
            ));
        }
    }
    wrong
}

/// `rknot calibrate` on the mount of a router forced to expert 0: expert
/// 0's statistics are every token's (its ffn_in the layer's), the others'
/// rows 0 and their statistics zeros.
fn calibrated_router_problems(
    family: &str,
    mount: &Path,
    tokens: &[u32],
    n_expert: usize,
) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let stats_path = dir.path().join("forced.stats");
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let o = Command::new(rknot_bin())
        .arg("calibrate")
        .arg(mount)
        .args(["--tokens", &ids.join(","), "--gram", "-o"])
        .arg(&stats_path)
        .output()
        .unwrap();
    if !o.status.success() {
        return vec![format!(
            "{family}: rknot calibrate failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )];
    }
    let stats = match rknot::probe::calibrate::read_stats(&stats_path) {
        Ok(s) => s,
        Err(e) => return vec![format!("{family}: the STATS file: {e}")],
    };
    let mut wrong = Vec::new();
    if stats.n_expert() != n_expert || stats.meta.get("version").map(String::as_str) != Some("2") {
        wrong.push(format!(
            "{family}: STATS of {} experts, version {:?}",
            stats.n_expert(),
            stats.meta.get("version")
        ));
    }
    for (layer, experts) in stats.experts.iter().enumerate() {
        let rows: Vec<u64> = experts.iter().map(|e| e.rows).collect();
        let mut want = vec![0; n_expert];
        want[0] = tokens.len() as u64;
        if rows != want {
            wrong.push(format!(
                "{family}: STATS layer {layer}: expert rows {rows:?}, want {want:?}"
            ));
        }
        let all = stats.site(layer, Site::FfnIn).map(|s| &s.mean_sq);
        let mine = stats.expert_site(layer, 0, Site::FfnIn).map(|s| &s.mean_sq);
        let same = all.zip(mine).is_some_and(|(a, m)| {
            let a: Vec<f32> = a.iter().map(|&v| v as f32).collect();
            let m: Vec<f32> = m.iter().map(|&v| v as f32).collect();
            a.len() == m.len() && max_rel_diff(&m, &a) <= 1e-6
        });
        if !same {
            wrong.push(format!(
                "{family}: STATS layer {layer}: expert 0's ffn_in is not the layer's"
            ));
        }
        for e in experts.iter().skip(1) {
            let zero = e.sites.iter().all(|s| {
                s.mean_sq.iter().all(|&v| v == 0.0)
                    && s.gram.as_ref().is_some_and(|g| g.iter().all(|&v| v == 0.0))
            });
            if !zero {
                wrong.push(format!(
                    "{family}: STATS layer {layer}: an expert no token went to has non-zero \
                     statistics"
                ));
            }
        }
    }
    wrong
}

needs! { [hf, llama_cpp, model, fuse]
fn every_family_matches_transformers() {
    let model = smollm2().expect("the SmolLM2 model");
    assert!(fuse_available(), "FUSE is needed for the hf/ views");
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    // SmolLM2's byte-level BPE vocabulary, from its hf/ view.
    let smol = w.join("smol");
    std::fs::create_dir(&smol).unwrap();
    {
        let m = Mounted::new(&model, &[]);
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(m.path("hf").join(f), smol.join(f)).unwrap();
        }
    }
    let mut args: Vec<&std::ffi::OsStr> = vec![smol.as_os_str(), w.as_os_str()];
    args.extend(FAMILIES.iter().map(|f| std::ffi::OsStr::new(f.name)));
    python("make.py", &args);

    let mut wrong = Vec::new();
    let mut mounts = Vec::new();
    for fam in FAMILIES {
        let f = fam.name;
        let gguf = Mounted::new(&w.join(format!("{f}.gguf")), &[]);
        if !fam.hf {
            let index: serde_json::Value =
                serde_json::from_slice(&std::fs::read(gguf.path("index.json")).unwrap()).unwrap();
            let why = index["views"]["hf"]["unavailable_reason"]
                .as_str()
                .unwrap_or_default();
            if gguf.path("hf").exists() || !(why.contains("_exps.weight") && why.contains("expert")) {
                wrong.push(format!("{f}: hf/ should be absent, naming the experts: {why:?}"));
            }
        }
        if f.ends_with("_forced") {
            wrong.extend(forced_router_problems(f, &gguf.mp));
        }
        wrong.extend(probe_problems(w, fam, &gguf.mp));
        if !fam.hf {
            continue;
        }
        let st = Mounted::new(&w.join(f), &[]);
        for (label, m) in [(f.to_string(), &gguf), (format!("{f}:safetensors"), &st)] {
            if !m.path("hf").join("config.json").is_file() {
                let index = std::fs::read_to_string(m.path("index.json")).unwrap_or_default();
                wrong.push(format!("{label}: no hf/ ({index:.400})"));
            }
        }
        mounts.push((f, gguf, st));
    }
    let labels: Vec<std::ffi::OsString> = mounts
        .iter()
        .flat_map(|(f, gguf, st)| {
            [
                format!("{f}={}", gguf.path("hf").display()),
                format!("{f}:safetensors={}", st.path("hf").display()),
            ]
        })
        .map(Into::into)
        .collect();
    let mut args: Vec<&std::ffi::OsStr> = vec![w.as_os_str()];
    args.extend(labels.iter().map(|s| s.as_os_str()));
    let out = python("check.py", &args);
    eprintln!("{out}");
    for line in out.lines() {
        if !line.starts_with("OK ") {
            wrong.push(line.to_string());
        }
    }
    assert_eq!(
        out.lines().count(),
        2 * FAMILIES.iter().filter(|f| f.hf).count(),
        "check.py reported on every mount:\n{out}"
    );
    drop(mounts);
    assert!(wrong.is_empty(), "{} problem(s):\n{}", wrong.len(), wrong.join("\n"));
}
}
