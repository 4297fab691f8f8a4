//! The GGUF writer: [`write_gguf`] and the header encoders, refusing what
//! the reader would refuse.

use std::collections::HashSet;
use std::io::Write;

use super::value::{MetaType, MetaValue, Metadata};
use super::*;
use crate::error::{Error, product};
use crate::names::check_servable;

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str, max: u64, what: &str) -> Result<()> {
    if s.len() as u64 > max {
        return Err(err(
            ErrorKind::TooLarge,
            format!(
                "{what}: string of {} bytes exceeds the cap of {max}",
                s.len()
            ),
        ));
    }
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Encode a value (without its type id). `enclosing` as in `read_value`.
fn put_value(out: &mut Vec<u8>, v: &MetaValue, key: &str, enclosing: usize) -> Result<()> {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => {
            put_str(out, s, MAX_STRING_BYTES, &format!("metadata key {key:?}"))?
        }
        MetaValue::Array { elem, values } => {
            let level = enclosing + 1;
            if *elem == MetaType::Array && level + 1 > MAX_ARRAY_DEPTH {
                return Err(err(
                    ErrorKind::TooLarge,
                    format!(
                        "metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
                    ),
                ));
            }
            put_u32(out, elem.id());
            put_u64(out, values.len() as u64);
            for x in values {
                if x.meta_type() != *elem {
                    return Err(err(
                        ErrorKind::BadValue,
                        format!(
                            "metadata key {key:?}: array of {} holds a {}",
                            elem.name(),
                            x.meta_type().name()
                        ),
                    ));
                }
                put_value(out, x, key, level)?;
            }
        }
    }
    Ok(())
}

/// Serialized header (everything before the data section, padding
/// included) and each tensor's offset relative to the data section, for
/// tensors laid out in the given order with alignment padding between them.
///
/// Writes GGUF v3. If `alignment` is not the default and `metadata` lacks
/// `general.alignment`, the key is appended as a u32; if the key is present
/// it must be a u32 equal to `alignment`. Everything the reader would
/// reject (bad names, shapes, keys, nesting, lengths) is refused here too.
pub fn encode_header(
    metadata: &Metadata,
    tensors: &[(String, Vec<u64>, GgmlType)],
    alignment: u64,
) -> Result<(Vec<u8>, Vec<u64>)> {
    encode_header_with(metadata, &[], tensors, alignment)
}

/// [`encode_header`] of `metadata` with `overrides`: each override's value
/// replaces that of its key where `metadata` has it, and is added after
/// the others where not. The same header as encoding a copy of `metadata`
/// changed that way, without the copy (a vocabulary's metadata can be
/// tens of megabytes of strings).
pub fn encode_header_with(
    metadata: &Metadata,
    overrides: &[(&str, MetaValue)],
    tensors: &[(String, Vec<u64>, GgmlType)],
    alignment: u64,
) -> Result<(Vec<u8>, Vec<u64>)> {
    check_alignment(alignment)?;
    let overridden = |key: &str| overrides.iter().find(|(k, _)| *k == key).map(|(_, v)| v);
    let value_of =
        |key: &str| -> Option<&MetaValue> { overridden(key).or_else(|| metadata.get(key)) };
    let added: Vec<&(&str, MetaValue)> = overrides
        .iter()
        .filter(|(k, _)| metadata.get(k).is_none())
        .collect();
    let add_alignment_key = match value_of(ALIGNMENT_KEY) {
        None => alignment != DEFAULT_ALIGNMENT,
        Some(MetaValue::U32(a)) if u64::from(*a) == alignment => false,
        Some(other) => {
            return Err(err(
                ErrorKind::BadValue,
                format!(
                    "metadata {ALIGNMENT_KEY} = {} ({}) disagrees with the requested \
                     alignment {alignment} (u32)",
                    other.summary(),
                    other.meta_type().name()
                ),
            ));
        }
    };

    let mut out = Vec::new();
    out.extend_from_slice(GGUF_MAGIC);
    put_u32(&mut out, WRITE_VERSION);
    put_u64(&mut out, tensors.len() as u64);
    put_u64(
        &mut out,
        (metadata.len() + added.len()) as u64 + u64::from(add_alignment_key),
    );

    let mut keys = HashSet::new();
    let entries = metadata
        .entries
        .iter()
        .map(|(k, v)| (k.as_str(), overridden(k).unwrap_or(v)))
        .chain(added.iter().map(|(k, v)| (*k, v)));
    for (key, value) in entries {
        if key.is_empty() {
            return Err(err(ErrorKind::BadValue, "empty metadata key"));
        }
        if !keys.insert(key) {
            return Err(err(
                ErrorKind::BadValue,
                format!("duplicate metadata key {key:?}"),
            ));
        }
        put_str(&mut out, key, MAX_KEY_BYTES, "metadata key")?;
        put_u32(&mut out, value.meta_type().id());
        put_value(&mut out, value, key, 0)?;
    }
    if add_alignment_key {
        put_str(&mut out, ALIGNMENT_KEY, MAX_KEY_BYTES, "metadata key")?;
        put_u32(&mut out, MetaType::U32.id());
        // check_alignment bounds it by MAX_ALIGNMENT.
        put_u32(&mut out, alignment as u32);
    }

    let mut names = HashSet::new();
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut next = 0u64;
    for (name, dims, ty) in tensors {
        check_servable(name)?;
        if !names.insert(name.as_str()) {
            return Err(err(
                ErrorKind::BadName,
                format!("duplicate tensor name {name:?}"),
            )
            .tensor(name));
        }
        let n_bytes = tensor_bytes(name, dims, *ty)?;
        let offset = align_up(next, alignment)?;
        next = add(offset, n_bytes, "data section size").map_err(|e| e.tensor(name))?;
        put_str(&mut out, name, MAX_TENSOR_NAME_BYTES, "tensor name")?;
        put_u32(&mut out, dims.len() as u32);
        for &d in dims {
            put_u64(&mut out, d);
        }
        put_u32(&mut out, ty.id());
        put_u64(&mut out, offset);
        offsets.push(offset);
    }
    let padded = align_up(out.len() as u64, alignment)?;
    out.resize(padded as usize, 0);
    if padded > MAX_HEADER_BYTES {
        return Err(err(
            ErrorKind::TooLarge,
            format!("GGUF header of {padded} bytes exceeds the cap of {MAX_HEADER_BYTES}"),
        ));
    }
    Ok((out, offsets))
}

/// Validate a shape for writing and return its byte size.
fn tensor_bytes(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64> {
    let bad = |m: String| err(ErrorKind::BadShape, m).tensor(name);
    if dims.is_empty() || dims.len() > MAX_DIMS as usize {
        return Err(bad(format!("{} dims; must be 1..={MAX_DIMS}", dims.len())));
    }
    if dims.contains(&0) {
        return Err(bad(format!("zero-sized shape {dims:?}")));
    }
    let n = product(dims, "element count").map_err(|e| e.tensor(name))?;
    let ne0 = dims.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(ty.block_elems()) {
        return Err(bad(format!(
            "ne0 = {ne0} is not a multiple of the {ty} block size {}",
            ty.block_elems()
        )));
    }
    if n > i64::MAX as u64 {
        return Err(err(
            ErrorKind::Overflow,
            format!("element count {n} does not fit in ggml's int64"),
        )
        .tensor(name));
    }
    ty.bytes_for(n).ok_or_else(|| {
        err(
            ErrorKind::Overflow,
            format!("byte size of {n} {ty} elements overflows u64"),
        )
        .tensor(name)
    })
}

fn write_err(e: std::io::Error) -> Error {
    err(ErrorKind::Io, format!("writing GGUF: {e}"))
}

fn write_zeros<W: Write>(w: &mut W, n: u64) -> Result<()> {
    let mut zeros = std::io::Read::take(std::io::repeat(0), n);
    std::io::copy(&mut zeros, w).map_err(write_err)?;
    Ok(())
}

/// Write a whole GGUF v3 file: the header from [`encode_header`], then each
/// tensor's bytes (which must be exactly `bytes_for(n_elements)`), zero
/// padding between them and after the last one (as llama.cpp and gguf-py
/// do). Nothing is written if any tensor's length is wrong.
pub fn write_gguf<W: Write>(
    w: &mut W,
    metadata: &Metadata,
    tensors: &[(String, Vec<u64>, GgmlType, &[u8])],
    alignment: u64,
) -> Result<()> {
    let shapes: Vec<(String, Vec<u64>, GgmlType)> = tensors
        .iter()
        .map(|(n, d, t, _)| (n.clone(), d.clone(), *t))
        .collect();
    let (header, offsets) = encode_header(metadata, &shapes, alignment)?;
    for (name, dims, ty, data) in tensors {
        let want = tensor_bytes(name, dims, *ty)?;
        if data.len() as u64 != want {
            return Err(err(
                ErrorKind::LengthMismatch,
                format!(
                    "{} bytes of data given for a {ty} tensor of shape {dims:?}, which takes {want}",
                    data.len()
                ),
            )
            .tensor(name));
        }
    }
    w.write_all(&header).map_err(write_err)?;
    let mut pos = 0u64;
    for ((_, _, _, data), &offset) in tensors.iter().zip(&offsets) {
        write_zeros(w, offset.saturating_sub(pos))?;
        w.write_all(data).map_err(write_err)?;
        pos = offset.saturating_add(data.len() as u64);
    }
    let end = align_up(pos, alignment)?;
    write_zeros(w, end - pos)?;
    w.flush().map_err(write_err)?;
    Ok(())
}
