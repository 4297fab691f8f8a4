//! Integrity of the files a mount serves.
//!
//! - [`manifest`]: sha256sum-format manifests (whole file, header, every
//!   tensor), written by `rknot manifest`, checked at mount, on each
//!   tensor's first decode and by `rknot verify --manifest`.

pub mod manifest;
