//! What identifies a remote object for the caches that outlive a request
//! (the disk cache of parts, `--source-cache`; the decoded-file store,
//! `--decoded-cache`; the version a manifest check is matched by).
//!
//! The redacted URL ([`redact`]: no query string) is what may be
//! printed, but it is not an identity: `https://h/get?f=a.gguf` and
//! `https://h/get?f=b.gguf` (a download endpoint), or presigned URLs of two
//! versions of one key (`?versionId=...`), are different objects with one
//! redacted URL, and with the same size and Last-Modified and no ETag the
//! old key served one's bytes for the other. The identity keeps every part
//! of the URL that selects an object:
//!
//! - `http(s)://`: scheme and host (lowercased: they are case-insensitive),
//!   port, path and query string as given, except the query parameters
//!   that only authenticate a request (AWS Signature V2/V4 and Google Cloud
//!   Storage signed URLs: [`SIGNING_PARAMS`]). Those change with every
//!   presigned URL of the same object and name no object, so dropping them
//!   lets two presigned URLs of one object share cached parts; every other
//!   parameter (`versionId`, `f=`, a token of a download endpoint) stays.
//! - `s3://BUCKET/KEY`: the endpoint it is read from (`--endpoint`, the
//!   environment or the AWS profile: one bucket name on two S3-compatible
//!   stores is two buckets), the bucket and the key.
//!
//! The identity is the redacted URL (for a person reading a cache file)
//! and the SHA-256 of those fields, each preceded by its length; the
//! fields themselves (a query string may carry a token) never appear in a
//! file name, a cache file or a log line. The version of the object (ETag,
//! else size and Last-Modified) is added by the caches next to it: the
//! identity says which object, the pin which of its versions.

use sha2::{Digest, Sha256};

/// `url` without userinfo, query string or fragment: what may be printed.
pub fn redact(url: &str) -> String {
    let url = url.split(['?', '#']).next().unwrap_or("");
    let Some(i) = url.find("://") else {
        return url.to_string();
    };
    let (scheme, rest) = url.split_at(i + 3);
    let auth_end = rest.find('/').unwrap_or(rest.len());
    let (auth, path) = rest.split_at(auth_end);
    let host = auth.rsplit('@').next().unwrap_or(auth);
    format!("{scheme}{host}{path}")
}

/// Query parameters of signed URLs that authenticate a request and name no
/// object (compared case-insensitively): AWS Signature V4 and V2 (S3
/// presigned URLs, CloudFront's `Expires`/`Signature`), Google Cloud
/// Storage V4 and V2.
pub const SIGNING_PARAMS: &[&str] = &[
    "x-amz-algorithm",
    "x-amz-credential",
    "x-amz-date",
    "x-amz-expires",
    "x-amz-signedheaders",
    "x-amz-signature",
    "x-amz-security-token",
    "x-amz-content-sha256",
    "awsaccesskeyid",
    "signature",
    "expires",
    "x-goog-algorithm",
    "x-goog-credential",
    "x-goog-date",
    "x-goog-expires",
    "x-goog-signedheaders",
    "x-goog-signature",
    "googleaccessid",
];

/// Whether query parameter `p` (`name=value` or `name`) only signs.
fn is_signing_param(p: &str) -> bool {
    let name = p.split('=').next().unwrap_or(p);
    SIGNING_PARAMS.iter().any(|s| s.eq_ignore_ascii_case(name))
}

/// The fields of an `http(s)://` URL that select the object: scheme and
/// authority lowercased, path as given, the query string without its
/// signing parameters (the others in their order). The fragment is never
/// sent to a server.
fn http_fields(url: &str) -> Vec<String> {
    let url = url.split('#').next().unwrap_or(url);
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let (scheme, rest) = base.split_once("://").unwrap_or(("", base));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let kept: Vec<&str> = query
        .map(|q| {
            q.split('&')
                .filter(|p| !p.is_empty() && !is_signing_param(p))
                .collect()
        })
        .unwrap_or_default();
    vec![
        scheme.to_ascii_lowercase(),
        authority.to_ascii_lowercase(),
        path.to_string(),
        // `?` with nothing kept and no `?` at all are the same request.
        kept.join("&"),
    ]
}

/// The identity of the object at `url` ([`super::is_remote`]); `s3_endpoint`
/// is the endpoint an `s3://` URL is read from (None: AWS itself). See the
/// module documentation.
pub fn object_identity(url: &str, s3_endpoint: Option<&str>) -> String {
    let fields: Vec<String> = if url.len() >= 5 && url[..5].eq_ignore_ascii_case("s3://") {
        let rest = &url[5..];
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        vec![
            "s3".into(),
            s3_endpoint
                .map(|e| e.trim_end_matches('/').to_ascii_lowercase())
                .unwrap_or_else(|| "aws".into()),
            bucket.to_string(),
            key.to_string(),
        ]
    } else {
        http_fields(url)
    };
    let mut h = Sha256::new();
    h.update(b"rknot remote object\0");
    for f in &fields {
        h.update((f.len() as u64).to_le_bytes());
        h.update(f.as_bytes());
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("{} sha256:{hex}", redact(url))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(url: &str) -> String {
        object_identity(url, None)
    }

    #[test]
    fn the_query_selects_the_object() {
        // The case: one download endpoint, two files.
        assert_ne!(id("https://h/get?f=a.gguf"), id("https://h/get?f=b.gguf"));
        assert_ne!(id("https://h/get?f=a.gguf"), id("https://h/get"));
        assert_ne!(
            id("https://h/k.gguf?versionId=1"),
            id("https://h/k.gguf?versionId=2")
        );
        // Parameter order is kept: a server may read it.
        assert_ne!(id("https://h/g?a=1&b=2"), id("https://h/g?b=2&a=1"));
        // Fields cannot run into each other.
        assert_ne!(id("https://h/a?b"), id("https://h/a%3Fb"));
        assert_ne!(id("http://h/m.gguf"), id("https://h/m.gguf"));
        assert_ne!(id("https://h:8443/m.gguf"), id("https://h/m.gguf"));
    }

    #[test]
    fn signatures_are_not_identity_and_never_appear() {
        let a = "https://b.s3.amazonaws.com/m.gguf?versionId=7&X-Amz-Algorithm=AWS4-HMAC-SHA256\
                 &X-Amz-Credential=AKIA%2F1&X-Amz-Date=20261201T000000Z&X-Amz-Expires=3600\
                 &X-Amz-SignedHeaders=host&X-Amz-Signature=abc123";
        let b = "https://b.s3.amazonaws.com/m.gguf?versionId=7&X-Amz-Algorithm=AWS4-HMAC-SHA256\
                 &X-Amz-Credential=AKIA%2F2&X-Amz-Date=20261202T000000Z&X-Amz-Expires=60\
                 &X-Amz-SignedHeaders=host&X-Amz-Signature=def456";
        assert_eq!(id(a), id(b));
        assert_eq!(
            id("https://h/m.gguf?Signature=x&Expires=1&AWSAccessKeyId=k"),
            id("https://h/m.gguf")
        );
        assert_ne!(id(a), id("https://b.s3.amazonaws.com/m.gguf?versionId=8"));
        for secret in ["abc123", "AKIA", "versionId", "f=a"] {
            assert!(!id(a).contains(secret), "{secret} in {}", id(a));
            assert!(!id("https://h/get?f=a.gguf").contains(secret));
        }
        assert!(id(a).starts_with("https://b.s3.amazonaws.com/m.gguf sha256:"));
    }

    #[test]
    fn case_insensitive_parts_and_fragments() {
        // (The redacted URL beside the digest keeps the case as given.)
        let digest = |u: &str| id(u).split_once(" sha256:").unwrap().1.to_string();
        assert_eq!(
            digest("HTTPS://H.example/m.gguf"),
            digest("https://h.example/m.gguf")
        );
        assert_ne!(id("https://h/M.gguf"), id("https://h/m.gguf"));
        assert_eq!(id("https://h/m.gguf#x"), id("https://h/m.gguf"));
        assert_eq!(id("https://h/m.gguf?"), id("https://h/m.gguf"));
    }

    #[test]
    fn s3_objects_are_told_apart_by_endpoint() {
        let aws = object_identity("s3://b/k/m.gguf", None);
        let minio = object_identity("s3://b/k/m.gguf", Some("http://127.0.0.1:9000"));
        let other = object_identity("s3://b/k/m.gguf", Some("http://127.0.0.1:9001/"));
        assert_ne!(aws, minio);
        assert_ne!(minio, other);
        assert_eq!(
            minio,
            object_identity("s3://b/k/m.gguf", Some("http://127.0.0.1:9000/"))
        );
        assert_ne!(aws, object_identity("s3://b/k/n.gguf", None));
        assert_ne!(aws, object_identity("s3://c/k/m.gguf", None));
        // An http URL never equals an s3 one.
        assert_ne!(aws, id("https://b/k/m.gguf"));
    }
}
