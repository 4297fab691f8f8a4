//! Unit tests of the STATS recorder, writer and reader.
use super::*;

fn config(n_layer: usize, d_model: usize, d_ff: usize) -> Config {
    Config {
        arch: &crate::arch::llama::Llama,
        n_layer,
        d_model,
        d_ff,
        moe: None,
        n_head: 1,
        n_head_kv: 1,
        head_dim: d_model,
        n_rot: 0,
        rope_base: 10000.0,
        rope_pos_scale: 1.0,
        rms_eps: 1e-5,
        n_vocab: 1,
        tied_embeddings: true,
    }
}

#[test]
fn sums_that_cannot_fit_are_an_error_not_an_abort() {
    // 2^33 wide: d² overflows on the way to a byte count.
    let e = StatsRecorder::for_model(&config(1, 8, 1 << 33), true)
        .err()
        .unwrap();
    assert!(e.to_string().contains("--gram"), "{e}");
    // A 70B-shaped model's Gram matrices: terabytes.
    let e = StatsRecorder::for_model(&config(80, 8192, 28672), true)
        .err()
        .unwrap();
    assert!(e.to_string().contains("memory available"), "{e}");
    // Mean squares alone fit.
    let r = StatsRecorder::for_model(&config(2, 16, 32), false).unwrap();
    assert_eq!(r.layers[1][Site::FfnDownIn.index()].sum_sq.len(), 32);
}

/// A mixture of experts: each expert's rows are its own, written as
/// version 2 and read back; an expert no row went to is all zeros.
#[test]
fn expert_sites_round_trip_through_a_stats_file() {
    use super::super::moe::MoeConfig;
    use crate::arch::moe::MoeRouting;
    let mut cfg = config(2, 4, 6);
    cfg.moe = Some(MoeConfig {
        n_expert: 3,
        n_used: 1,
        d_ff: 5,
        routing: MoeRouting { norm_topk: true },
    });
    for gram in [false, true] {
        let mut r = StatsRecorder::for_model(&cfg, gram).unwrap();
        let x4: Vec<f32> = (0..8).map(|i| i as f32).collect();
        for layer in 0..2 {
            for site in [Site::AttnIn, Site::AttnOutIn, Site::FfnIn] {
                r.record(layer, site, &x4, 2);
            }
            // Both rows to expert 1 in layer 0, to experts 0 and 2 in 1.
            let (a, b) = if layer == 0 { (1, 1) } else { (0, 2) };
            r.record_expert(layer, a, Site::FfnIn, &x4[..4], 1);
            r.record_expert(layer, a, Site::FfnDownIn, &[1.0, 2.0, 3.0, 4.0, 5.0], 1);
            r.record_expert(layer, b, Site::FfnIn, &x4[4..], 1);
            r.record_expert(layer, b, Site::FfnDownIn, &[2.0; 5], 1);
        }
        let stats = r.finish(BTreeMap::new()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe.stats");
        let target = OutputTarget {
            path: path.clone(),
            overwrite: false,
            mode: 0o644,
            sources: Vec::new(),
        };
        write_stats(&stats, &target).unwrap();
        let back = read_stats(&path).unwrap();
        assert_eq!(back.meta["version"], "2");
        assert_eq!(back.meta["experts"], "3");
        assert_eq!(back.n_expert(), 3);
        assert_eq!(back.layers[0].len(), 3, "no layer-wide ffn_down_in");
        assert!(back.site(0, Site::FfnDownIn).is_none());
        let rows: Vec<Vec<u64>> = back
            .experts
            .iter()
            .map(|l| l.iter().map(|e| e.rows).collect())
            .collect();
        assert_eq!(rows, vec![vec![0, 2, 0], vec![1, 0, 1]]);
        let e1 = back.expert_site(0, 1, Site::FfnIn).unwrap();
        // Mean over both rows of x²: (0² + 4²) / 2 for channel 0.
        assert_eq!(e1.mean_sq, vec![8.0, 13.0, 20.0, 29.0]);
        let down = back.expert_site(0, 1, Site::FfnDownIn).unwrap();
        assert_eq!(down.d, 5);
        assert_eq!(down.mean_sq, vec![2.5, 4.0, 6.5, 10.0, 14.5]);
        let idle = back.expert_site(0, 0, Site::FfnDownIn).unwrap();
        assert!(idle.mean_sq.iter().all(|&v| v == 0.0) && idle.d == 5);
        assert_eq!(idle.gram.as_ref().map(Vec::len), gram.then_some(25));
        assert_eq!(
            back.expert_site(1, 2, Site::FfnIn).unwrap().mean_sq,
            vec![16.0, 25.0, 36.0, 49.0]
        );
    }
    // Rows that do not add up to tokens × experts per token are an
    // internal error, not a file.
    let mut r = StatsRecorder::for_model(&cfg, false).unwrap();
    for layer in 0..2 {
        for site in [Site::AttnIn, Site::AttnOutIn, Site::FfnIn] {
            r.record(layer, site, &[1.0; 4], 1);
        }
    }
    let e = r.finish(BTreeMap::new()).unwrap_err();
    assert!(e.to_string().contains("experts saw 0 rows"), "{e}");
}

#[test]
fn names_round_trip() {
    let name = |layer, expert, site, kind| ArrayName {
        layer,
        expert,
        site,
        kind,
    };
    for s in Site::ALL {
        assert_eq!(Site::from_name(s.name()), Some(s));
        assert_eq!(
            parse_name(&format!("blk.3.{}.gram", s.name())),
            Some(name(3, None, s, ArrayKind::Gram))
        );
    }
    assert_eq!(parse_name("blk.x.attn_in.gram"), None);
    assert_eq!(parse_name("blk.0.attn_in.other"), None);
    assert_eq!(
        parse_name("blk.1.expert.7.ffn_down_in.mean_sq"),
        Some(name(1, Some(7), Site::FfnDownIn, ArrayKind::MeanSq))
    );
    assert_eq!(
        parse_name("blk.1.expert.7.rows"),
        Some(name(1, Some(7), Site::FfnIn, ArrayKind::Rows))
    );
    assert_eq!(parse_name("blk.1.expert.7.attn_in.mean_sq"), None);
    assert_eq!(parse_name("blk.1.rows"), None);
    assert_eq!(parse_name("blk.1.expert.x.ffn_in.gram"), None);
}
