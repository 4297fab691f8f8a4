//! The probe's mixture-of-experts feed-forward: the router, top-k routing
//! as the family says ([`crate::arch::moe`]), and each chosen expert's
//! SwiGLU over the rows routed to it, weighted and summed.
//!
//! Experts are held in fp32 memory whatever the [`super::model::Residency`]
//! (streaming them would decode every expert for every batch); a model
//! too large for that is refused at load with the size it needs.

use super::linalg::{matmul_t, swiglu};
use super::sites::{ActivationRecorder, Site};
use crate::arch::moe::{self, MoeRouting};
use crate::error::{ErrorKind, Result, err};
use crate::format::meta::{MetaValue, Metadata};

/// A mixture-of-experts model's expert shape, from `{arch}.*` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_expert: usize,
    /// Experts per token (`expert_used_count`).
    pub n_used: usize,
    /// Rows of each expert's gate and up (`expert_feed_forward_length`,
    /// else `feed_forward_length`).
    pub d_ff: usize,
    pub routing: MoeRouting,
}

impl MoeConfig {
    /// The experts of a model of family `arch` (`name`), None when it has
    /// none (`expert_count` absent or 0); an error when the family has no
    /// mixture-of-experts form or the counts are out of range.
    pub fn from_metadata(
        md: &Metadata,
        arch: &dyn crate::arch::Architecture,
        dense_ff: usize,
    ) -> Result<Option<MoeConfig>> {
        let name = arch.name();
        let k = |s: &str| format!("{name}.{s}");
        let get = |s: &str| md.get(&k(s)).and_then(MetaValue::as_u64);
        let n_expert = get("expert_count").unwrap_or(0);
        if n_expert == 0 {
            return Ok(None);
        }
        let Some(routing) = arch.moe_routing() else {
            return Err(err(
                ErrorKind::UnsupportedType,
                format!(
                    "{} = {n_expert}: {name} has no mixture-of-experts form the probe runs \
                     (those of {})",
                    k("expert_count"),
                    moe_families()
                ),
            ));
        };
        let n_used = get("expert_used_count").ok_or_else(|| {
            err(
                ErrorKind::BadValue,
                format!(
                    "model metadata: key {:?} is missing",
                    k("expert_used_count")
                ),
            )
        })?;
        // A layer's weights are counted in fp32 elsewhere; these bound the
        // routing buffers.
        if n_used == 0 || n_used > n_expert || n_expert > 4096 {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "{} = {n_used} / {} = {n_expert}: out of range (1 ≤ used ≤ experts ≤ 4096)",
                    k("expert_used_count"),
                    k("expert_count")
                ),
            ));
        }
        let d_ff = match get("expert_feed_forward_length") {
            Some(0) | None => dense_ff,
            Some(f) => usize::try_from(f).map_err(|_| {
                err(
                    ErrorKind::TooLarge,
                    format!("{} = {f}", k("expert_feed_forward_length")),
                )
            })?,
        };
        Ok(Some(MoeConfig {
            n_expert: n_expert as usize,
            n_used: n_used as usize,
            d_ff,
            routing,
        }))
    }
}

/// The families with a mixture-of-experts form, for messages.
fn moe_families() -> String {
    crate::arch::FAMILIES
        .iter()
        .filter(|a| a.moe_routing().is_some())
        .map(|a| a.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One layer's router and experts, in fp32.
pub(super) struct MoeFfn {
    pub(super) cfg: MoeConfig,
    /// `[n_expert, d_model]`.
    pub(super) router: Vec<f32>,
    /// `[n_expert, d_ff, d_model]` each.
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    /// `[n_expert, d_model, d_ff]`.
    pub(super) down: Vec<f32>,
}

impl MoeFfn {
    /// `out[n, d] = Σ_chosen w · down_e(swiglu(gate_e h, up_e h))` for the
    /// normed rows `h[n, d]`; the recorder sees each expert's own rows.
    pub(super) fn forward<'r>(
        &self,
        layer: usize,
        h: &[f32],
        n: usize,
        d: usize,
        out: &mut [f32],
        mut recorder: Option<&mut (dyn ActivationRecorder + 'r)>,
    ) {
        let (e_n, ff) = (self.cfg.n_expert, self.cfg.d_ff);
        let mut logits = vec![0f32; n * e_n];
        matmul_t(h, n, &self.router, e_n, d, &mut logits);
        // Per expert: its rows and their weights.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_n];
        let mut chosen = Vec::new();
        for (t, row) in logits.chunks_exact(e_n).enumerate() {
            moe::route(row, self.cfg.n_used, self.cfg.routing, &mut chosen);
            for &(e, w) in &chosen {
                routed[e].push((t, w));
            }
        }
        out.fill(0.0);
        let (mut x, mut g, mut u, mut y) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (e, rows) in routed.iter().enumerate() {
            let m = rows.len();
            if m == 0 {
                continue;
            }
            x.clear();
            for &(t, _) in rows {
                x.extend_from_slice(&h[t * d..(t + 1) * d]);
            }
            // Expert e's matrix is the e-th slab of each 3-D tensor.
            let slab = e * ff * d..(e + 1) * ff * d;
            let (wg, wu, wd) = (
                &self.gate[slab.clone()],
                &self.up[slab.clone()],
                &self.down[slab],
            );
            if let Some(r) = recorder.as_deref_mut() {
                r.record_expert(layer, e, Site::FfnIn, &x, m);
            }
            g.resize(m * ff, 0.0);
            u.resize(m * ff, 0.0);
            matmul_t(&x, m, wg, ff, d, &mut g);
            matmul_t(&x, m, wu, ff, d, &mut u);
            for (gr, ur) in g.chunks_exact_mut(ff).zip(u.chunks_exact(ff)) {
                swiglu(gr, ur);
            }
            if let Some(r) = recorder.as_deref_mut() {
                r.record_expert(layer, e, Site::FfnDownIn, &g, m);
            }
            y.resize(m * d, 0.0);
            matmul_t(&g, m, wd, d, ff, &mut y);
            for (&(t, w), yr) in rows.iter().zip(y.chunks_exact(d)) {
                for (o, v) in out[t * d..(t + 1) * d].iter_mut().zip(yr) {
                    *o += w * v;
                }
            }
        }
    }
}

/// The tensors of layer `layer`'s mixture of experts and their served
/// shapes, router first.
pub(super) fn plan(layer: usize, c: &MoeConfig, d: usize) -> Vec<(String, Vec<u64>)> {
    let (e, ff, d) = (c.n_expert as u64, c.d_ff as u64, d as u64);
    let [gate, up, down] = moe::expert_names(layer);
    vec![
        (moe::router_name(layer), vec![e, d]),
        (gate, vec![e, ff, d]),
        (up, vec![e, ff, d]),
        (down, vec![e, d, ff]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(arch: &str, keys: &[(&str, u32)]) -> Metadata {
        let mut md = Metadata::default();
        md.push("general.architecture", MetaValue::String(arch.into()));
        for (k, v) in keys {
            md.push(format!("{arch}.{k}"), MetaValue::U32(*v));
        }
        md
    }

    fn family(name: &str) -> &'static dyn crate::arch::Architecture {
        crate::arch::lookup(name).unwrap()
    }

    #[test]
    fn expert_counts_are_read_and_checked() {
        let q = family("qwen3moe");
        let m = md(
            "qwen3moe",
            &[
                ("expert_count", 8),
                ("expert_used_count", 2),
                ("expert_feed_forward_length", 48),
            ],
        );
        let c = MoeConfig::from_metadata(&m, q, 96).unwrap().unwrap();
        assert_eq!((c.n_expert, c.n_used, c.d_ff), (8, 2, 48));
        // Mixtral: llama with experts, each of the dense size.
        let m = md("llama", &[("expert_count", 4), ("expert_used_count", 2)]);
        let c = MoeConfig::from_metadata(&m, family("llama"), 96)
            .unwrap()
            .unwrap();
        assert_eq!(c.d_ff, 96);
        assert!(
            MoeConfig::from_metadata(&md("qwen3moe", &[]), q, 96)
                .unwrap()
                .is_none()
        );
        for (keys, why) in [
            (
                &[("expert_count", 4), ("expert_used_count", 5)][..],
                "out of range",
            ),
            (
                &[("expert_count", 4), ("expert_used_count", 0)][..],
                "out of range",
            ),
            (&[("expert_count", 4)][..], "expert_used_count"),
        ] {
            let e = MoeConfig::from_metadata(&md("qwen3moe", keys), q, 96).unwrap_err();
            assert!(e.to_string().contains(why), "{keys:?}: {e}");
        }
        let e = MoeConfig::from_metadata(
            &md("qwen2", &[("expert_count", 4), ("expert_used_count", 2)]),
            family("qwen2"),
            96,
        )
        .unwrap_err();
        assert!(e.to_string().contains("qwen2.expert_count"), "{e}");
    }
}
