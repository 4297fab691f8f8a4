//! Field access on header JSON with errors that say which field was wrong.
//!
//! Header JSON is untrusted: every accessor returns a `BadJson` error naming
//! the object (`ctx`) and field instead of panicking or defaulting.

use serde_json::{Map, Value};

use crate::error::{ErrorKind, Result, err};
use crate::format::container::json_kind;

pub type Obj = Map<String, Value>;

fn missing(ctx: &str, key: &str) -> crate::error::Error {
    err(
        ErrorKind::BadJson,
        format!("{ctx}: missing field \"{key}\""),
    )
}

fn wrong(ctx: &str, key: &str, want: &str, got: &Value) -> crate::error::Error {
    err(
        ErrorKind::BadJson,
        format!(
            "{ctx}: field \"{key}\" must be {want}, found {}",
            json_kind(got)
        ),
    )
}

pub fn field<'a>(o: &'a Obj, ctx: &str, key: &str) -> Result<&'a Value> {
    o.get(key).ok_or_else(|| missing(ctx, key))
}

pub fn u64_field(o: &Obj, ctx: &str, key: &str) -> Result<u64> {
    let v = field(o, ctx, key)?;
    v.as_u64()
        .ok_or_else(|| wrong(ctx, key, "a non-negative integer", v))
}

pub fn f64_field(o: &Obj, ctx: &str, key: &str) -> Result<f64> {
    let v = field(o, ctx, key)?;
    v.as_f64().ok_or_else(|| wrong(ctx, key, "a number", v))
}

/// A float field that must be finite and representable as f32.
pub fn finite_f32_field(o: &Obj, ctx: &str, key: &str) -> Result<f32> {
    let x = f64_field(o, ctx, key)?;
    let f = x as f32;
    if !f.is_finite() {
        return Err(err(
            ErrorKind::NonFinite,
            format!("{ctx}: field \"{key}\" = {x:?} is not a finite f32"),
        ));
    }
    Ok(f)
}

pub fn str_field<'a>(o: &'a Obj, ctx: &str, key: &str) -> Result<&'a str> {
    let v = field(o, ctx, key)?;
    v.as_str().ok_or_else(|| wrong(ctx, key, "a string", v))
}

pub fn bool_field(o: &Obj, ctx: &str, key: &str) -> Result<bool> {
    let v = field(o, ctx, key)?;
    v.as_bool().ok_or_else(|| wrong(ctx, key, "a bool", v))
}

pub fn obj_field<'a>(o: &'a Obj, ctx: &str, key: &str) -> Result<&'a Obj> {
    let v = field(o, ctx, key)?;
    v.as_object().ok_or_else(|| wrong(ctx, key, "an object", v))
}

pub fn arr_field<'a>(o: &'a Obj, ctx: &str, key: &str) -> Result<&'a Vec<Value>> {
    let v = field(o, ctx, key)?;
    v.as_array().ok_or_else(|| wrong(ctx, key, "an array", v))
}

/// Array of non-negative integers.
pub fn u64_array(o: &Obj, ctx: &str, key: &str) -> Result<Vec<u64>> {
    arr_field(o, ctx, key)?
        .iter()
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| wrong(ctx, key, "an array of non-negative integers", v))
        })
        .collect()
}

/// Array of finite numbers (as f32).
pub fn f32_array(o: &Obj, ctx: &str, key: &str) -> Result<Vec<f32>> {
    arr_field(o, ctx, key)?
        .iter()
        .map(|v| {
            let x = v
                .as_f64()
                .ok_or_else(|| wrong(ctx, key, "an array of numbers", v))?;
            let f = x as f32;
            if f.is_finite() {
                Ok(f)
            } else {
                Err(err(
                    ErrorKind::NonFinite,
                    format!("{ctx}: \"{key}\" holds {x:?}, not a finite f32"),
                ))
            }
        })
        .collect()
}

pub fn as_obj<'a>(v: &'a Value, ctx: &str) -> Result<&'a Obj> {
    v.as_object().ok_or_else(|| {
        err(
            ErrorKind::BadJson,
            format!("{ctx} must be a JSON object, found {}", json_kind(v)),
        )
    })
}
