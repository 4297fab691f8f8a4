//! Integrity: checksums inside the formats, scanned without decoding.

pub mod checksums;
