//! `rknot probe`: real inference over exactly the fp32 weights the mount
//! serves, to see whether a compressed model still answers like the dense
//! one.
//!
//! - [`weights`]: the weights, through `backend::open` (the mount's decode
//!   path) or from a mounted directory's `.f32` files;
//! - [`model`]: a llama-like decoder in fp32 with a KV cache, for the
//!   families [`crate::arch`] knows (llama, qwen2);
//! - [`sites`]: the matrix inputs the forward pass shows a recorder;
//! - [`tokenizer`]: byte-level BPE from the GGUF key/values;
//! - [`linalg`]: SGEMM/GEMV on the rayon pool, norms, softmax;
//! - [`calibrate`]: activation statistics for calibrated encoding
//!   (`rknot calibrate`);
//! - [`eval`]: top-k, greedy generation, perplexity (llama-perplexity's
//!   windows), and two models' agreement (top-1, KL, logits cosine).

pub mod calibrate;
pub mod eval;
pub mod linalg;
pub mod model;
pub mod moe;
pub mod sites;
pub mod tokenizer;
pub mod weights;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

pub use eval::{Candidate, Fidelity, Perplexity};
pub use model::{Config, KvCache, Model, Residency};
pub use tokenizer::Tokenizer;
pub use weights::{WeightSource, open_source};

use crate::error::{ErrorKind, err};

/// Errors cross the rayon pool's boundary, so they must be `Send`.
type BoxResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `rknot probe` arguments.
#[derive(clap::Args, Debug, Clone)]
#[command(group(
    clap::ArgGroup::new("input")
        .required(true)
        .args(["prompt", "tokens", "perplexity"])
))]
pub struct ProbeArgs {
    /// Model file (.rknot, SK32, dense .knot, GGUF) or a mounted rknot
    /// directory (its index.json and .f32 files).
    pub source: PathBuf,
    /// Dense fallback (GGUF or dense .knot) for tensors SOURCE lacks.
    #[arg(long)]
    pub dense: Option<PathBuf>,
    #[command(flatten)]
    pub remote: crate::source::cli::RemoteArgs,
    /// Prompt text (control tokens such as <|im_start|> are parsed).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Prompt as token ids, comma- or space-separated.
    #[arg(long)]
    pub tokens: Option<String>,
    /// Text file: perplexity over windows of --ctx tokens, scoring the
    /// second half of each window (as llama.cpp's llama-perplexity).
    #[arg(long, value_name = "FILE")]
    pub perplexity: Option<PathBuf>,
    /// Window size for --perplexity.
    #[arg(long, default_value_t = 256)]
    pub ctx: usize,
    /// Score only the first N windows of --perplexity.
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
    /// Next-token candidates to print.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Greedy tokens to generate after the prompt.
    #[arg(
        long,
        default_value_t = 0,
        value_name = "N",
        conflicts_with = "perplexity"
    )]
    pub generate: usize,
    /// Compute threads (default: all CPUs).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Reference model (file or mount) to compare against over every
    /// position: top-1 agreement, KL(reference ‖ SOURCE), logits cosine.
    #[arg(long, value_name = "DENSE")]
    pub compare: Option<PathBuf>,
    /// Where the decoded weights live: `memory` holds the model in fp32 (4
    /// bytes per parameter); `stream` decodes each matrix from the source,
    /// 64 MiB of rows at a time, on every forward pass (memory stays small,
    /// each pass costs a full decode); `auto` streams when the fp32 model
    /// is larger than three quarters of the available memory.
    #[arg(long, value_enum, default_value_t = Residency::Auto)]
    pub weights: Residency,
    /// Take the tokenizer key/values from this model file (for a mount,
    /// whose index.json omits the vocab, default: the files it names).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

/// Run `rknot probe`.
pub fn run(args: ProbeArgs) -> Result<(), Box<dyn std::error::Error>> {
    if args.perplexity.is_none() && args.chunks.is_some() {
        return Err("--chunks applies to --perplexity".into());
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("probe-{i}"))
        .build()?;
    match pool.install(|| run_in_pool(&args, threads)) {
        // `rknot probe ... | head` ends quietly, as `rknot cat` does.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        r => r.map_err(|e| e as Box<dyn std::error::Error>),
    }
}

/// A loaded model with what the report says about it.
struct Loaded {
    label: String,
    model: Model,
    source: Arc<dyn WeightSource>,
}

fn load(
    title: &str,
    path: &Path,
    dense: Option<&Path>,
    tokenizer: Option<&Path>,
    residency: Residency,
    out: &mut (impl Write + ?Sized),
) -> BoxResult<Loaded> {
    let t = Instant::now();
    let source: Arc<dyn WeightSource> = Arc::from(open_source(path, dense, tokenizer)?);
    let model = Model::load_with(Arc::clone(&source), residency)?;
    let secs = t.elapsed().as_secs_f64();
    let label = source.describe();
    let bpw = source
        .bits_per_weight(&model.tensor_names)
        .map_or_else(String::new, |b| {
            format!(", {b:.3} bits/weight in tensor payloads")
        });
    writeln!(out, "{title:<9} {label}")?;
    if let Some(n) = source.note() {
        writeln!(out, "          {n}")?;
    }
    writeln!(out, "          {}", model.config.summary())?;
    writeln!(
        out,
        "          {:.1}M parameters, {:.0} MiB fp32, loaded in {secs:.2} s{bpw}",
        model.n_params() as f64 / 1e6,
        model.n_params() as f64 * 4.0 / (1 << 20) as f64
    )?;
    if model.is_streamed() {
        writeln!(
            out,
            "          weights streamed: every forward pass decodes the matrices from the source again"
        )?;
    }
    Ok(Loaded {
        label,
        model,
        source,
    })
}

fn parse_ids(s: &str) -> BoxResult<Vec<u32>> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>().map_err(|e| {
                err(
                    ErrorKind::BadValue,
                    format!("--tokens: {p:?} is not a token id: {e}"),
                )
                .into()
            })
        })
        .collect()
}

/// A token for tables: its text quoted (escapes shown), else `#id`.
fn show_token(tok: Option<&Tokenizer>, id: u32) -> String {
    match tok {
        Some(t) => format!("{:?}", String::from_utf8_lossy(&t.token_bytes(id))),
        None => format!("#{id}"),
    }
}

fn run_in_pool(args: &ProbeArgs, threads: usize) -> BoxResult<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let main = load(
        "model:",
        &args.source,
        args.dense.as_deref(),
        args.tokenizer.as_deref(),
        args.weights,
        &mut out,
    )?;
    let tok_result = Tokenizer::from_metadata(main.source.metadata());
    let reference = match &args.compare {
        Some(p) => {
            let r = load(
                "reference:",
                p,
                None,
                args.tokenizer.as_deref(),
                args.weights,
                &mut out,
            )?;
            if r.model.config.n_vocab != main.model.config.n_vocab {
                return Err(err(
                    ErrorKind::ShapeMismatch,
                    format!(
                        "--compare: vocab sizes differ ({} vs {})",
                        r.model.config.n_vocab, main.model.config.n_vocab
                    ),
                )
                .into());
            }
            Some(r)
        }
        None => None,
    };
    writeln!(out, "threads:  {threads}")?;
    let tok = tok_result.as_ref().ok();

    if let Some(file) = &args.perplexity {
        let tok = tok_result
            .as_ref()
            .map_err(|e| format!("--perplexity needs the tokenizer: {e}"))?;
        return run_perplexity(args, file, &main, reference.as_ref(), tok, &mut out);
    }

    let ids = match (&args.prompt, &args.tokens) {
        (Some(p), _) => {
            let t = tok_result
                .as_ref()
                .map_err(|e| format!("--prompt needs the tokenizer: {e}"))?;
            t.encode(p, true, true)
        }
        (None, Some(s)) => parse_ids(s)?,
        (None, None) => return Err("one of --prompt, --tokens or --perplexity is required".into()),
    };
    if ids.is_empty() {
        return Err("the prompt has no tokens".into());
    }
    let shown: Vec<String> = ids.iter().map(|&i| show_token(tok, i)).collect();
    writeln!(out, "prompt:   {} tokens {:?}", ids.len(), ids)?;
    writeln!(out, "          {}", shown.join(" "))?;

    let n_vocab = main.model.config.n_vocab;
    let all_rows = reference.is_some();
    let rows = if all_rows {
        0..ids.len()
    } else {
        ids.len() - 1..ids.len()
    };
    let mut cache = KvCache::new(&main.model.config);
    let t = Instant::now();
    let logits = main.model.forward(&ids, &mut cache, rows)?;
    let secs = t.elapsed().as_secs_f64();
    writeln!(
        out,
        "prompt processing: {} tokens in {:.3} s = {:.1} tokens/s",
        ids.len(),
        secs,
        ids.len() as f64 / secs
    )?;
    let last = &logits[logits.len() - n_vocab..];
    print_top(&mut out, "next token", last, args.top, tok)?;

    let mut ref_state = None;
    if let Some(r) = &reference {
        let mut rcache = KvCache::new(&r.model.config);
        let rlogits = r.model.forward(&ids, &mut rcache, 0..ids.len())?;
        let rlast = rlogits[rlogits.len() - n_vocab..].to_vec();
        print_top(
            &mut out,
            &format!("reference next token ({})", r.label),
            &rlast,
            args.top,
            tok,
        )?;
        let mut f = Fidelity::default();
        f.add_rows(&rlogits, &logits, n_vocab);
        print_fidelity(&mut out, &f, "prompt positions")?;
        ref_state = Some((rcache, rlast));
    }

    if args.generate > 0 {
        generate(
            &mut out,
            "greedy",
            &main.model,
            &mut cache,
            last,
            args.generate,
            tok,
        )?;
        if let (Some(r), Some((mut rcache, rlast))) = (&reference, ref_state) {
            generate(
                &mut out,
                "reference greedy",
                &r.model,
                &mut rcache,
                &rlast,
                args.generate,
                tok,
            )?;
        }
    }
    Ok(())
}

fn print_top(
    out: &mut impl Write,
    title: &str,
    logits: &[f32],
    k: usize,
    tok: Option<&Tokenizer>,
) -> BoxResult<()> {
    writeln!(out, "{title} (top {k}):")?;
    writeln!(out, "  rank  token id      prob     logit  text")?;
    for (i, c) in eval::top_k(logits, k).iter().enumerate() {
        writeln!(
            out,
            "  {:>4}  {:>8}  {:>8.4}  {:>8.3}  {}",
            i + 1,
            c.id,
            c.prob,
            c.logit,
            show_token(tok, c.id)
        )?;
    }
    Ok(())
}

fn print_fidelity(out: &mut impl Write, f: &Fidelity, over: &str) -> BoxResult<()> {
    writeln!(
        out,
        "fidelity vs reference over {} {over}: top-1 agreement {:.4} ({}/{}), mean KL {:.6} nats (max {:.4}), logits cosine mean {:.6} (min {:.6})",
        f.positions,
        f.top1_rate(),
        f.top1_agree,
        f.positions,
        f.mean_kl(),
        f.kl_max,
        f.mean_cos(),
        f.cos_min
    )?;
    Ok(())
}

fn generate(
    out: &mut impl Write,
    title: &str,
    model: &Model,
    cache: &mut KvCache,
    last: &[f32],
    n: usize,
    tok: Option<&Tokenizer>,
) -> BoxResult<()> {
    writeln!(out, "{title} ({n} tokens):")?;
    write!(out, "  ")?;
    out.flush()?;
    let mut stream = tokenizer::TextStream::default();
    let mut io_err = None;
    let g = eval::greedy(
        model,
        cache,
        last,
        n,
        |id| tok.is_some_and(|t| t.is_end_of_generation(id)),
        |id| {
            let text = match tok {
                Some(t) => stream.push(&t.token_bytes(id)),
                None => format!("#{id} "),
            };
            if let Err(e) = write!(out, "{}", text.replace('\n', "\n  ")).and_then(|()| out.flush())
            {
                io_err.get_or_insert(e);
            }
        },
    )?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    writeln!(out, "{}", stream.finish())?;
    // The first token comes from the prompt's logits; the rest each took
    // one forward pass.
    let passes = g.tokens.len().saturating_sub(1);
    let rate = if g.elapsed.as_secs_f64() > 0.0 {
        format!("{:.1} tokens/s", passes as f64 / g.elapsed.as_secs_f64())
    } else {
        "n/a".to_string()
    };
    writeln!(
        out,
        "  [{} tokens{}; generation {passes} passes in {:.3} s = {rate}]",
        g.tokens.len(),
        if g.stopped_at_end {
            ", stopped at end-of-generation token"
        } else {
            ""
        },
        g.elapsed.as_secs_f64(),
    )?;
    writeln!(out, "  ids {:?}", g.tokens)?;
    Ok(())
}

/// Read a text as llama-perplexity's `-f` does: the whole file, minus one
/// trailing newline.
pub fn read_text(path: &Path) -> BoxResult<String> {
    let mut text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if text.ends_with('\n') {
        text.pop();
    }
    Ok(text)
}

fn run_perplexity(
    args: &ProbeArgs,
    file: &Path,
    main: &Loaded,
    reference: Option<&Loaded>,
    tok: &Tokenizer,
    out: &mut impl Write,
) -> BoxResult<()> {
    let text = read_text(file)?;
    // As llama-perplexity: specials added per the vocab, none parsed.
    let ids = tok.encode(&text, false, true);
    let bos = tok.add_bos.then_some(tok.bos).flatten();
    let windows = eval::perplexity_windows(ids.len(), args.ctx, args.chunks)?;
    writeln!(
        out,
        "text:     {} ({} bytes, {} tokens); {} windows of {} tokens, each scoring its last {} \
         tokens (predicted from positions {}..={})",
        file.display(),
        text.len(),
        ids.len(),
        windows.len(),
        args.ctx,
        args.ctx - 1 - args.ctx / 2,
        args.ctx / 2,
        args.ctx - 2
    )?;
    let n_vocab = main.model.config.n_vocab;
    let mut nll = eval::Nll::default();
    let mut ref_nll = eval::Nll::default();
    let mut fid = Fidelity::default();
    let t = Instant::now();
    let mut ref_secs = 0.0;
    write!(out, "running perplexity:")?;
    for (i, w) in windows.iter().enumerate() {
        let (logits, targets) = eval::score_window(&main.model, &ids[w.clone()], bos)?;
        for (row, &target) in logits.chunks_exact(n_vocab).zip(&targets) {
            nll.add(row, target);
        }
        if let Some(r) = reference {
            let tr = Instant::now();
            let (rlogits, _) = eval::score_window(&r.model, &ids[w.clone()], bos)?;
            ref_secs += tr.elapsed().as_secs_f64();
            for (row, &target) in rlogits.chunks_exact(n_vocab).zip(&targets) {
                ref_nll.add(row, target);
            }
            fid.add_rows(&rlogits, &logits, n_vocab);
        }
        write!(out, " [{}]{:.4}", i + 1, nll.perplexity())?;
        out.flush()?;
    }
    writeln!(out)?;
    let secs = t.elapsed().as_secs_f64() - ref_secs;
    writeln!(
        out,
        "perplexity: {:.4} +/- {:.4} over {} scored tokens (ctx {}, {} windows)",
        nll.perplexity(),
        nll.uncertainty(),
        nll.count,
        args.ctx,
        windows.len()
    )?;
    writeln!(
        out,
        "throughput: {} tokens in {:.2} s = {:.1} tokens/s (batched prompt processing)",
        windows.len() * args.ctx,
        secs,
        (windows.len() * args.ctx) as f64 / secs
    )?;
    if reference.is_some() {
        writeln!(
            out,
            "reference perplexity: {:.4} +/- {:.4} (ratio {:.5})",
            ref_nll.perplexity(),
            ref_nll.uncertainty(),
            nll.perplexity() / ref_nll.perplexity()
        )?;
        print_fidelity(out, &fid, "scored positions")?;
    }
    Ok(())
}
