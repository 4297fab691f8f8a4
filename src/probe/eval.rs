//! What the probe measures: top-k next tokens, greedy continuations,
//! perplexity the way llama.cpp's `llama-perplexity` computes it, and the
//! agreement of two models' next-token distributions.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::linalg::log_softmax;
use super::model::{KvCache, Model};
use crate::error::{ErrorKind, Result, err};

/// One candidate next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub prob: f64,
    pub logit: f32,
}

/// The `k` most probable tokens of a logits row, most probable first (ties
/// by lower id, so the order is deterministic).
pub fn top_k(logits: &[f32], k: usize) -> Vec<Candidate> {
    let lp = log_softmax(logits);
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(idx.len());
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, by_logit);
    }
    idx.truncate(k);
    idx.sort_by(by_logit);
    idx.into_iter()
        .map(|i| Candidate {
            id: i as u32,
            prob: lp[i].exp(),
            logit: logits[i],
        })
        .collect()
}

/// Index of the largest logit (the lowest id on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A greedy continuation.
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Time spent in forward passes for the generated tokens.
    pub elapsed: Duration,
    pub stopped_at_end: bool,
}

/// Greedy decoding after a prompt whose KV entries are in `cache` and
/// whose last logits are `last`: up to `n` tokens, stopping after a token
/// for which `is_end` holds. `on_token` sees each token as it is chosen.
pub fn greedy(
    model: &Model,
    cache: &mut KvCache,
    last: &[f32],
    n: usize,
    is_end: impl Fn(u32) -> bool,
    mut on_token: impl FnMut(u32),
) -> Result<Generation> {
    let mut tokens = Vec::with_capacity(n);
    let mut next = argmax(last);
    let mut elapsed = Duration::ZERO;
    for i in 0..n {
        tokens.push(next);
        on_token(next);
        if is_end(next) {
            return Ok(Generation {
                tokens,
                elapsed,
                stopped_at_end: true,
            });
        }
        if i + 1 == n {
            break;
        }
        let t = Instant::now();
        let logits = model.forward(&[next], cache, 0..1)?;
        elapsed += t.elapsed();
        next = argmax(&logits);
    }
    Ok(Generation {
        tokens,
        elapsed,
        stopped_at_end: false,
    })
}

/// Negative log-likelihood sums, as llama-perplexity keeps them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Nll {
    pub sum: f64,
    pub sum_sq: f64,
    pub count: usize,
}

impl Nll {
    pub fn add(&mut self, logits: &[f32], target: u32) {
        let lp = log_softmax(logits);
        let nll = -lp[target as usize];
        self.sum += nll;
        self.sum_sq += nll * nll;
        self.count += 1;
    }

    pub fn perplexity(&self) -> f64 {
        (self.sum / self.count.max(1) as f64).exp()
    }

    /// llama-perplexity's "+/-": the standard error of the mean NLL
    /// carried through exp().
    pub fn uncertainty(&self) -> f64 {
        if self.count < 2 {
            return 0.0;
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = (self.sum_sq / n - mean * mean).max(0.0) / (n - 1.0);
        var.sqrt() * self.perplexity()
    }
}

/// The windows llama-perplexity scores: `tokens.len() / ctx` consecutive
/// non-overlapping windows of `ctx` tokens (at most `max_windows`), the
/// text needing at least `2 ctx` tokens.
pub fn perplexity_windows(
    n_tokens: usize,
    ctx: usize,
    max_windows: Option<usize>,
) -> Result<Vec<Range<usize>>> {
    if ctx < 4 {
        return Err(err(
            ErrorKind::BadValue,
            format!("--ctx {ctx}: must be at least 4"),
        ));
    }
    if n_tokens < 2 * ctx {
        return Err(err(
            ErrorKind::BadValue,
            format!(
                "the text has {n_tokens} tokens; perplexity with --ctx {ctx} needs at least {}",
                2 * ctx
            ),
        ));
    }
    let n = (n_tokens / ctx).min(max_windows.unwrap_or(usize::MAX));
    Ok((0..n).map(|i| i * ctx..(i + 1) * ctx).collect())
}

/// Run one perplexity window. As llama-perplexity does: a fresh context,
/// the window's first token replaced by BOS when the vocab adds one, and
/// logits kept for the second half, positions `ctx/2 .. ctx-1`, each
/// scored on the token after it. Returns those logits (`ctx - 1 - ctx/2`
/// rows) and the targets.
pub fn score_window(
    model: &Model,
    window: &[u32],
    bos: Option<u32>,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let ctx = window.len();
    let first = ctx / 2;
    let mut input = window.to_vec();
    if let (Some(b), Some(t0)) = (bos, input.first_mut()) {
        *t0 = b;
    }
    let mut cache = KvCache::new(&model.config);
    let logits = model.forward(&input, &mut cache, first..ctx - 1)?;
    Ok((logits, window[first + 1..].to_vec()))
}

/// Perplexity of `tokens` in windows of `ctx` (see [`score_window`]).
pub struct Perplexity {
    pub nll: Nll,
    pub windows: usize,
    /// Running perplexity after each window, as llama-perplexity prints.
    pub running: Vec<f64>,
    pub elapsed: Duration,
    pub tokens_evaluated: usize,
}

pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    max_windows: Option<usize>,
    bos: Option<u32>,
) -> Result<Perplexity> {
    let windows = perplexity_windows(tokens.len(), ctx, max_windows)?;
    let mut nll = Nll::default();
    let mut running = Vec::with_capacity(windows.len());
    let t = Instant::now();
    for w in &windows {
        let (logits, targets) = score_window(model, &tokens[w.clone()], bos)?;
        for (row, &target) in logits.chunks_exact(model.config.n_vocab).zip(&targets) {
            nll.add(row, target);
        }
        running.push(nll.perplexity());
    }
    Ok(Perplexity {
        nll,
        windows: windows.len(),
        running,
        elapsed: t.elapsed(),
        tokens_evaluated: windows.len() * ctx,
    })
}

/// How closely a test model's next-token distributions follow a
/// reference's, accumulated over positions.
#[derive(Debug, Clone, Default)]
pub struct Fidelity {
    pub positions: usize,
    pub top1_agree: usize,
    /// Σ KL(reference ‖ test), nats.
    pub kl_sum: f64,
    pub kl_max: f64,
    /// Σ cosine of the raw logit vectors.
    pub cos_sum: f64,
    pub cos_min: f64,
}

impl Fidelity {
    /// Add rows of logits (`n_vocab` each) of the same positions.
    pub fn add_rows(&mut self, reference: &[f32], test: &[f32], n_vocab: usize) {
        for (r, t) in reference
            .chunks_exact(n_vocab)
            .zip(test.chunks_exact(n_vocab))
        {
            self.add(r, t);
        }
    }

    pub fn add(&mut self, reference: &[f32], test: &[f32]) {
        let (lp, lq) = (log_softmax(reference), log_softmax(test));
        let kl: f64 = lp
            .iter()
            .zip(&lq)
            .map(|(&p, &q)| if p > -745.0 { p.exp() * (p - q) } else { 0.0 })
            .sum::<f64>()
            .max(0.0);
        let cos = cosine(reference, test);
        if self.positions == 0 {
            self.cos_min = cos;
        }
        self.positions += 1;
        self.top1_agree += usize::from(argmax(reference) == argmax(test));
        self.kl_sum += kl;
        self.kl_max = self.kl_max.max(kl);
        self.cos_sum += cos;
        self.cos_min = self.cos_min.min(cos);
    }

    pub fn top1_rate(&self) -> f64 {
        self.top1_agree as f64 / self.positions.max(1) as f64
    }

    pub fn mean_kl(&self) -> f64 {
        self.kl_sum / self.positions.max(1) as f64
    }

    pub fn mean_cos(&self) -> f64 {
        self.cos_sum / self.positions.max(1) as f64
    }
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_and_breaks_ties_by_id() {
        let t = top_k(&[1.0, 3.0, 3.0, -2.0, 2.0], 3);
        assert_eq!(t.iter().map(|c| c.id).collect::<Vec<_>>(), [1, 2, 4]);
        assert!((t.iter().map(|c| c.prob).sum::<f64>() - 0.9).abs() < 0.1);
        assert_eq!(argmax(&[0.0, 5.0, 5.0]), 1);
    }

    #[test]
    fn windows_follow_llama_perplexity() {
        assert!(perplexity_windows(511, 256, None).is_err());
        assert_eq!(
            perplexity_windows(1000, 256, None).unwrap(),
            [0..256, 256..512, 512..768]
        );
        let one = perplexity_windows(1000, 256, Some(1)).unwrap();
        assert!(one.len() == 1 && one[0] == (0..256));
    }

    #[test]
    fn identical_logits_agree_fully() {
        let mut f = Fidelity::default();
        f.add(&[1.0, 2.0, 0.5], &[1.0, 2.0, 0.5]);
        assert_eq!(f.top1_rate(), 1.0);
        assert!(f.mean_kl().abs() < 1e-12);
        assert!((f.mean_cos() - 1.0).abs() < 1e-12);
        f.add(&[1.0, 2.0, 0.5], &[2.0, 1.0, 0.5]);
        assert_eq!(f.top1_agree, 1);
        assert!(f.kl_max > 0.1);
    }
}
