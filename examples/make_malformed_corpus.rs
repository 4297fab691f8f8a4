//! Writes the malformed-file corpus checked by `tests/malformed.rs`:
//!
//! ```text
//! cargo run --example make_malformed_corpus -- tests/data/malformed
//! ```
//!
//! The cases are built in `tests/common/malformed_corpus.rs` (shared with the
//! tests, which rebuild them and compare with the committed files).

#[path = "../tests/common/malformed_corpus.rs"]
mod corpus;

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let dir = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .unwrap_or_else(|| "tests/data/malformed".into()),
    );
    match corpus::write_to(&dir) {
        Ok(c) => {
            let total: usize = c.files.iter().map(|(_, b)| b.len()).sum();
            println!(
                "wrote {} cases ({} files, {total} bytes) and {} to {}",
                c.expected.len(),
                c.files.len(),
                corpus::EXPECTED_JSON,
                dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("make_malformed_corpus: {}: {e}", dir.display());
            ExitCode::FAILURE
        }
    }
}
