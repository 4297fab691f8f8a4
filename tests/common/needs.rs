//! `needs!`: a test that needs FUSE, the SmolLM2 model, llama.cpp,
//! transformers or moto's S3 server, in one line.
//!
//! The stable test harness decides `#[ignore]` at compile time, so build.rs
//! detects what this machine can run and emits a cfg per missing
//! capability (`rknot_no_fuse`, `rknot_no_model`, `rknot_no_llama_cpp`,
//! `rknot_no_hf`, `rknot_no_moto`; see build.rs).
//! `needs! { [fuse, model] fn name() { .. } }` is the test `name` with one
//! `#[cfg_attr(CFG, ignore = "REASON")]` per capability: ignored, with the
//! reason of the first capability listed that is missing, when any is.
//! With `RKNOT_REQUIRE_FUSE=1` / `RKNOT_REQUIRE_MODEL=1` build.rs emits no
//! cfg for them, so the test runs and its run-time check
//! ([`super::mount::fuse_available`], [`super::smollm2`]) fails loudly: a
//! test that cannot run fails or shows as ignored, never passes.
//!
//! Capabilities: `fuse` (root, /dev/fuse, fusermount3), `model` (SmolLM2:
//! tools/fetch-smollm2.sh), `llama_cpp` (RKNOT_LLAMA_BIN,
//! tools/llama-cpp.sh), `hf`
//! (RKNOT_HF_PYTHON, tools/hf-env.sh), `moto` (RKNOT_MOTO_SERVER,
//! tools/moto-env.sh). Attributes and doc comments before `fn` are kept.

#[allow(unused_macros)]
macro_rules! needs {
    // Entry: the capabilities, then the test function.
    ([$($cap:ident),+ $(,)?] $(#[$meta:meta])* fn $name:ident() $(-> $ret:ty)? $body:block) => {
        $crate::common::needs::needs!(@gate [$($cap)+] [] [] $(#[$meta])* fn $name() $(-> $ret)? $body);
    };
    // Every capability turned into its cfg_attr: emit the test.
    (@gate [] [$($prev:ident)*] [$($attrs:tt)*] $($item:tt)*) => {
        #[test]
        $($attrs)*
        $($item)*
    };
    // The next capability: ignored when it is missing and none before it
    // is (so that one reason, the first, is shown).
    (@gate [$cap:ident $($rest:ident)*] [$($prev:ident)*] [$($attrs:tt)*] $($item:tt)*) => {
        $crate::common::needs::needs!(@cap $cap [$($rest)*] [$($prev)*] [$($attrs)*] $($item)*);
    };
    (@cap fuse $($t:tt)*) => {
        $crate::common::needs::needs!(@attr rknot_no_fuse
            "needs root, /dev/fuse and fusermount3 (README: Tests)" $($t)*);
    };
    (@cap model $($t:tt)*) => {
        $crate::common::needs::needs!(@attr rknot_no_model
            "needs the SmolLM2 model: tools/fetch-smollm2.sh (README: Tests)" $($t)*);
    };
    (@cap llama_cpp $($t:tt)*) => {
        $crate::common::needs::needs!(@attr rknot_no_llama_cpp
            "opt-in: set RKNOT_LLAMA_BIN to the bin directory of tools/llama-cpp.sh (README: Tests)"
            $($t)*);
    };
    (@cap hf $($t:tt)*) => {
        $crate::common::needs::needs!(@attr rknot_no_hf
            "opt-in: set RKNOT_HF_PYTHON to a python3 with torch and transformers: tools/hf-env.sh (README: Tests)"
            $($t)*);
    };
    (@cap moto $($t:tt)*) => {
        $crate::common::needs::needs!(@attr rknot_no_moto
            "needs moto's S3 server: export RKNOT_MOTO_SERVER=$(tools/moto-env.sh) (README: Tests)"
            $($t)*);
    };
    (@attr $cfg:ident $reason:literal [$($rest:ident)*] [$($prev:ident)*] [$($attrs:tt)*] $($item:tt)*) => {
        $crate::common::needs::needs!(@gate [$($rest)*] [$($prev)* $cfg]
            [$($attrs)* #[cfg_attr(all($cfg $(, not($prev))*), ignore = $reason)]] $($item)*);
    };
}

#[allow(unused_imports)]
pub(crate) use needs;
