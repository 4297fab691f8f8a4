//! The one place the CPU's vector extensions are detected and chosen.
//!
//! Every fast decoder (the .rknot codecs, the ggml kernels, the lossless
//! coder) asks [`level`] which build of its loop to run. The scalar code
//! stays the reference that every vector build must equal bit for bit;
//! tests and benchmarks compare them by asking for a level explicitly
//! ([`Level::available`]) or, for a whole process, through the
//! environment: `RKNOT_SIMD=scalar|avx2|avx512` caps the level (a cap above
//! what the CPU has is ignored, so it can never select an instruction the
//! CPU lacks).

use std::sync::OnceLock;

/// A build of a kernel, ordered from the most portable up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Plain Rust (whatever the compile target's baseline gives: SSE2 on
    /// x86-64, NEON on aarch64): the reference.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (x86-64-v3).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL on top of [`Level::Avx2`].
    Avx512,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" | "off" => Some(Level::Scalar),
            "avx2" => Some(Level::Avx2),
            "avx512" => Some(Level::Avx512),
            _ => None,
        }
    }

    /// The highest level this CPU runs, ignoring `RKNOT_SIMD`.
    pub fn detected() -> Level {
        static DETECTED: OnceLock<Level> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// Every level this CPU runs, lowest first (tests run each of them).
    pub fn available() -> Vec<Level> {
        let top = Level::detected();
        [Level::Scalar, Level::Avx2, Level::Avx512]
            .into_iter()
            .filter(|l| *l <= top)
            .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    let avx2 = std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl");
    if avx512 {
        Level::Avx512
    } else if avx2 {
        Level::Avx2
    } else {
        Level::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Scalar
}

/// The level kernels run at in this process: the CPU's, capped by
/// `RKNOT_SIMD` when it names one (an unknown value is ignored with a
/// warning in the log, once).
pub fn level() -> Level {
    static CHOSEN: OnceLock<Level> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let top = Level::detected();
        match std::env::var("RKNOT_SIMD") {
            Ok(v) => match Level::parse(&v) {
                Some(cap) => cap.min(top),
                None => {
                    log::warn!("RKNOT_SIMD={v:?} is not scalar, avx2 or avx512: ignored");
                    top
                }
            },
            Err(_) => top,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_the_chosen_one_is_available() {
        assert!(Level::Scalar < Level::Avx2 && Level::Avx2 < Level::Avx512);
        assert_eq!(Level::available()[0], Level::Scalar);
        assert!(Level::available().contains(&level()));
        assert_eq!(Level::parse(" AVX2 "), Some(Level::Avx2));
        assert_eq!(Level::parse("sse9"), None);
    }
}
