//! `rknot bench checksums FILE`: what verifying checksums on the read path
//! costs. The file (a .rknot v3, SK32 or dense .knot with checksums) is
//! read through the library in full, tensor by tensor, as a mount's cache
//! misses read it, against a copy of the same file with its checksums
//! stripped (same bytes, same layout, no KSUM record, no checksum fields),
//! rounds interleaved; it reports medians and the ratio.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use serde_json::Value;

use crate::backend::{self, Backend, ParsedFile, Role};
use crate::format::checksum::KSUM_LEN;
use crate::format::container;

type BResult<T> = std::result::Result<T, String>;

/// Elements per read, as the mount's decoded-cache chunks (4 MiB of f32).
const READ_ELEMS: usize = 1 << 20;

/// Bench `file` for `rounds` rounds; the stripped copy goes in `scratch`.
pub fn checksums_bench(
    file: &Path,
    scratch: &Path,
    rounds: usize,
    progress: crate::progress::Mode,
) -> BResult<String> {
    use crate::progress::{Meter, Unit};
    let meter = Meter::new("bench checksums", Unit::Items("rounds"), progress);
    meter.set_total(rounds.max(1) as u64);
    meter.set_message("writing the copy without checksums");
    let parsed = ParsedFile::open(file).map_err(|e| e.to_string())?;
    let plain = scratch.join("unchecked-copy");
    strip(file, &parsed, &plain)?;
    drop(parsed);
    let checked = backend::open_single(file, Role::Primary).map_err(|e| e.to_string())?;
    let unchecked = backend::open_single(&plain, Role::Primary).map_err(|e| e.to_string())?;
    if !checked.summary().checked || unchecked.summary().checked {
        let _ = std::fs::remove_file(&plain);
        return Err(format!(
            "{} carries no checksums: nothing to compare (encode it with this version)",
            file.display()
        ));
    }
    let stored: u64 = checked
        .tensors()
        .entries()
        .iter()
        .map(|t| t.stored_bytes)
        .sum();
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let mut bytes = 0u64;
    for round in 0..rounds.max(1) {
        meter.set_message(&format!("round {} of {}", round + 1, rounds.max(1)));
        // Both files were just read: the page cache holds them alike.
        let (t, b, hb) = read_all(unchecked.as_ref())?;
        off.push(t);
        let (t, _, hc) = read_all(checked.as_ref())?;
        on.push(t);
        if hb != hc {
            return Err("the two copies served different values".into());
        }
        bytes = b;
        meter.inc(1);
    }
    let _ = std::fs::remove_file(&plain);
    let (m_on, m_off) = (median(&mut on), median(&mut off));
    // The checksum alone, over as many bytes as the file stores, for scale.
    let block = vec![0x5au8; 1 << 20];
    let t0 = Instant::now();
    let mut x = 0u32;
    let mut hashed = 0u64;
    while hashed < stored.max(1 << 20) {
        x ^= crate::format::checksum::crc32(&block);
        hashed += block.len() as u64;
    }
    let crc_secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(x);
    meter.finish();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "file: {} ({} v{}), {} tensors, {stored} stored bytes, {bytes} bytes served",
        crate::text::escape(&file.display().to_string()),
        checked.summary().format,
        checked.summary().version,
        checked.tensors().len()
    );
    let _ = writeln!(
        o,
        "read every tensor in {} MiB reads, 1 thread, median of {} rounds:",
        (READ_ELEMS * 4) >> 20,
        on.len()
    );
    let _ = writeln!(
        o,
        "  checksums stripped  {m_off:8.3} s  {:6.2} GB/s served",
        gbs(bytes, m_off)
    );
    let _ = writeln!(
        o,
        "  checksums verified  {m_on:8.3} s  {:6.2} GB/s served",
        gbs(bytes, m_on)
    );
    let _ = writeln!(
        o,
        "  CRC-32 alone over {hashed} bytes: {crc_secs:.3} s ({:.1} GB/s)",
        gbs(hashed, crc_secs)
    );
    let _ = writeln!(
        o,
        "  ratio verified / stripped: {:.3} (verification costs {:+.1}% of read time)",
        m_on / m_off,
        (m_on / m_off - 1.0) * 100.0
    );
    Ok(o)
}

/// Read every available tensor whole; returns seconds, bytes served and a
/// hash of the values (so both copies are compared, and nothing is
/// optimized away).
fn read_all(b: &dyn Backend) -> BResult<(f64, u64, u64)> {
    let mut buf = vec![0f32; READ_ELEMS];
    let (mut sum, mut bytes) = (0u64, 0u64);
    let t0 = Instant::now();
    for (i, t) in b.tensors().entries().iter().enumerate() {
        if !t.is_available() {
            continue;
        }
        let mut at = 0u64;
        while at < t.n_elements {
            let n = (t.n_elements - at).min(READ_ELEMS as u64) as usize;
            b.read_f32(i, at, &mut buf[..n])
                .map_err(|e| e.to_string())?;
            sum = buf[..n]
                .iter()
                .fold(sum, |s, v| s.rotate_left(5) ^ u64::from(v.to_bits()));
            at += n as u64;
        }
        bytes += t.served_bytes();
    }
    Ok((t0.elapsed().as_secs_f64(), bytes, sum))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Write `file` without checksums to `out`: the KSUM record and every
/// checksum field removed, all else byte for byte (tensor offsets are
/// relative to the body or payload, which does not move). What a file
/// written before checksums existed looks like (tests use it too).
pub fn strip_checksums(file: &Path, out: &Path) -> BResult<()> {
    let parsed = ParsedFile::open(file).map_err(|e| e.to_string())?;
    strip(file, &parsed, out)
}

fn strip(file: &Path, parsed: &ParsedFile, out: &Path) -> BResult<()> {
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let io = |e: std::io::Error| format!("{}: {e}", out.display());
    let stripped = match parsed {
        ParsedFile::Rknot(_, f) if f.layout.ksum.is_some() => {
            let l = &f.layout;
            let (io_, hl) = (l.index_offset as usize, l.header_len as usize);
            let body_end = io_ - KSUM_LEN as usize;
            let mut h: Value = serde_json::from_slice(&bytes[l.header_offset as usize..][..hl])
                .map_err(|e| e.to_string())?;
            if let Some(layers) = h["layers"].as_array_mut() {
                for layer in layers {
                    if let Some(ts) = layer["tensors"].as_array_mut() {
                        for t in ts {
                            if let Some(t) = t.as_object_mut() {
                                t.remove("block_crc32");
                            }
                        }
                    }
                }
            }
            if let Some(d) = h.get_mut("dense_tensors") {
                remove_crc32(d);
            }
            let header = serde_json::to_vec(&h).map_err(|e| e.to_string())?;
            let mut v = bytes[..body_end].to_vec();
            let index = &bytes[io_..io_ + l.index_len as usize];
            v.extend_from_slice(index);
            v.extend_from_slice(&header);
            v.extend_from_slice(&(index.len() as u64).to_le_bytes());
            v.extend_from_slice(&(header.len() as u64).to_le_bytes());
            v.extend_from_slice(b"RKNOTEND");
            v
        }
        ParsedFile::Sk32(_, f) if f.checked => knot_stripped(&bytes, f.payload_base, "sketches")?,
        ParsedFile::DenseKnot(_, f) if f.checked => {
            knot_stripped(&bytes, f.payload_base, "tensors")?
        }
        _ => return Err(format!("{}: no checksums to strip", file.display())),
    };
    std::fs::write(out, stripped).map_err(io)
}

fn remove_crc32(table: &mut Value) {
    if let Some(t) = table.as_object_mut() {
        for e in t.values_mut() {
            if let Some(e) = e.as_object_mut() {
                e.remove("crc32");
            }
        }
    }
}

fn knot_stripped(bytes: &[u8], payload_base: u64, table: &str) -> BResult<Vec<u8>> {
    let meta_len = u32::from_le_bytes([bytes[6], bytes[7], bytes[8], bytes[9]]) as usize;
    let mut meta: Value =
        serde_json::from_slice(&bytes[10..10 + meta_len]).map_err(|e| e.to_string())?;
    remove_crc32(&mut meta[table]);
    let mut v = Vec::new();
    container::write_container_header(&mut v, &meta).map_err(|e| e.to_string())?;
    v.extend_from_slice(&bytes[payload_base as usize..bytes.len() - KSUM_LEN as usize]);
    Ok(v)
}
