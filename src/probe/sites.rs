//! Where the forward pass shows its activations: the distinct inputs of
//! a layer's weight matrices ([`Site`]) and the [`ActivationRecorder`]
//! the forward pass ([`super::model::Model::forward_recorded`]) hands
//! them to. Below both the model and `calibrate` (which records them into
//! statistics), so neither uses the other for these.

/// The distinct matrix inputs of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Site {
    /// The attention-normed x, input of attn_q, attn_k and attn_v.
    AttnIn,
    /// The attention's output (heads concatenated), input of attn_output.
    AttnOutIn,
    /// The FFN-normed x, input of ffn_gate and ffn_up.
    FfnIn,
    /// silu(gate) ⊙ up, input of ffn_down.
    FfnDownIn,
}

impl Site {
    pub const ALL: [Site; 4] = [Site::AttnIn, Site::AttnOutIn, Site::FfnIn, Site::FfnDownIn];

    /// The name in STATS files.
    pub fn name(self) -> &'static str {
        match self {
            Site::AttnIn => "attn_in",
            Site::AttnOutIn => "attn_out_in",
            Site::FfnIn => "ffn_in",
            Site::FfnDownIn => "ffn_down_in",
        }
    }

    pub fn from_name(name: &str) -> Option<Site> {
        Site::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The tensors of layer `blk.L.` this input is multiplied by.
    pub fn feeds(self) -> &'static [&'static str] {
        match self {
            Site::AttnIn => &["attn_q.weight", "attn_k.weight", "attn_v.weight"],
            Site::AttnOutIn => &["attn_output.weight"],
            Site::FfnIn => &["ffn_gate.weight", "ffn_up.weight"],
            Site::FfnDownIn => &["ffn_down.weight"],
        }
    }

    /// The site whose activations multiply a matrix of kind `kind`
    /// (`attn_q`, `ffn_down`, ...): the one that [`Site::feeds`] it.
    pub fn input_of(kind: &str) -> Option<Site> {
        Site::ALL.into_iter().find(|s| {
            s.feeds()
                .iter()
                .any(|t| t.strip_suffix(".weight") == Some(kind))
        })
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// What the forward pass shows a recorder: for layer `layer`, the `n`
/// rows (`x` is `n × d`, row-major) about to be multiplied at `site`.
pub trait ActivationRecorder {
    fn record(&mut self, layer: usize, site: Site, x: &[f32], n: usize);

    /// In a mixture-of-experts layer, the `n` rows routed to expert
    /// `expert` at `site` ([`Site::FfnIn`]: the normed rows its gate and up
    /// multiply; [`Site::FfnDownIn`]: its SwiGLU output, which its down
    /// multiplies). The layer's [`Site::FfnIn`] (every row, the router's
    /// input) goes to [`Self::record`]; its [`Site::FfnDownIn`] has no
    /// one matrix and is not recorded there.
    fn record_expert(&mut self, layer: usize, expert: usize, site: Site, x: &[f32], n: usize) {
        let _ = (layer, expert, site, x, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_matrix_kind_has_the_site_that_feeds_it() {
        for (kind, site) in [
            ("attn_q", Site::AttnIn),
            ("attn_k", Site::AttnIn),
            ("attn_v", Site::AttnIn),
            ("attn_output", Site::AttnOutIn),
            ("ffn_gate", Site::FfnIn),
            ("ffn_up", Site::FfnIn),
            ("ffn_down", Site::FfnDownIn),
        ] {
            assert_eq!(Site::input_of(kind), Some(site), "{kind}");
        }
        for other in ["attn_norm", "token_embd", "attn_q.weight", ""] {
            assert_eq!(Site::input_of(other), None, "{other}");
        }
    }
}
