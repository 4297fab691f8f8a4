//! How a benchmark prints its targets. A verdict needs a median of
//! several rounds: a single round (the smoke runs of tools/test.sh, which
//! only keep the benchmarks working, use `--rounds 1`) is one noisy
//! sample on a loaded machine, so its targets are shown as not checked
//! instead of "met" or "MISSED".

/// Whether a run of `rounds` rounds judges its targets.
pub(super) fn judged(rounds: usize) -> bool {
    rounds >= 2
}

/// What a run of one round prints in place of a verdict.
const NOT_CHECKED: &str = "not checked: one round";

/// The `targets:` section of `rknot bench mount`: one line per target,
/// `[met]` / `[MISSED]` when `judged`, else `[not checked: one round]`.
pub(super) fn targets(verdicts: &[(&str, &str, bool, String)], judged: bool) -> String {
    let mut out = String::from("\ntargets:\n");
    for (mode, what, ok, val) in verdicts {
        let label = match (judged, ok) {
            (false, _) => NOT_CHECKED,
            (true, true) => "met",
            (true, false) => "MISSED",
        };
        out.push_str(&format!("  [{label}] {what} ({mode} mode) {val}\n"));
    }
    out
}

/// A ratio against its goal (`rknot bench remote`): `>= 0.8x: met` /
/// `NOT met`, or `>= 0.8x: not checked: one round`.
pub(super) fn meets(ratio: f64, goal: f64, judged: bool) -> String {
    let label = match (judged, ratio >= goal) {
        (false, _) => NOT_CHECKED,
        (true, true) => "met",
        (true, false) => "NOT met",
    };
    format!(">= {goal}x: {label}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_round_prints_no_verdict_and_more_rounds_do() {
        let v = [
            (
                "page cache",
                "cold >= 1 GB/s",
                false,
                "0.5 GB/s".to_string(),
            ),
            ("direct_io", "warm >= 2 GB/s", true, "3 GB/s".to_string()),
        ];
        let smoke = targets(&v, judged(1));
        assert!(
            !smoke.contains("MISSED") && !smoke.contains("[met]"),
            "{smoke}"
        );
        assert_eq!(
            smoke.matches("[not checked: one round]").count(),
            2,
            "{smoke}"
        );
        let real = targets(&v, judged(3));
        assert!(real.contains("[MISSED] cold >= 1 GB/s (page cache mode) 0.5 GB/s"));
        assert!(real.contains("[met] warm >= 2 GB/s (direct_io mode) 3 GB/s"));
        assert_eq!(
            meets(0.5, 0.8, judged(1)),
            ">= 0.8x: not checked: one round"
        );
        assert_eq!(meets(0.5, 0.8, judged(2)), ">= 0.8x: NOT met");
        assert_eq!(meets(0.9, 0.8, judged(3)), ">= 0.8x: met");
    }
}
