//! Integrity of the files a mount serves (docs/OPERATIONS.md, "Integrity").
//!
//! - [`checksums`]: the CRC-32s inside rknot's own formats (docs/FORMAT.md
//!   section 12), scanned without decoding by `rknot verify --integrity`;
//!   the read path verifies them in the backends as it decodes.
//! - [`manifest`]: sha256sum-format manifests (whole file, header, every
//!   tensor), written by `rknot manifest`, checked at mount, on each
//!   tensor's first decode and by `rknot verify --manifest`.

pub mod checksums;
pub mod manifest;
