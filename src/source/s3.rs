//! The S3 client of `s3://BUCKET/KEY` sources and outputs (AWS S3 and
//! S3-compatible stores: Cloudflare R2, MinIO, Ceph), built by the
//! `object_store` crate from the standard AWS configuration:
//!
//! - the environment, read by `AmazonS3Builder::from_env`: every `AWS_*`
//!   variable it knows, among them `AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` /
//!   `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`, and
//!   the web-identity, ECS-container and EC2-instance credential sources;
//! - the shared profile files, which `object_store` does NOT read: so this
//!   module reads the static keys of the profile `AWS_PROFILE` (default
//!   `default`) from `AWS_SHARED_CREDENTIALS_FILE` (default
//!   `~/.aws/credentials`) and its `region` and `endpoint_url` from
//!   `AWS_CONFIG_FILE` (default `~/.aws/config`), each only where the
//!   environment gives none. `credential_process`, SSO and `role_arn`
//!   profiles are not supported (use the environment for those);
//! - [`RemoteOptions::endpoint`] (`--endpoint`, `-o endpoint=`), which
//!   overrides every endpoint of the environment and the profile.
//!
//! With an endpoint (an S3-compatible store) requests use path-style
//! addressing (`ENDPOINT/BUCKET/KEY`), which every such store serves;
//! plain http is allowed only when that endpoint is an `http://` URL.
//! [`RemoteOptions::ca_bundle`] adds the certificates of a PEM bundle to
//! the trusted roots (verification is never turned off).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{Certificate, ClientOptions, ObjectStore, RetryConfig};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, GetRange};

use super::FileTime;
use super::fetch::{Attempt, BlockSplitter, Pin, RANGE_IGNORED, pin_changes, unless_stalled};
use super::options::RemoteOptions;
use crate::error::ErrorKind;

/// The client of `bucket` for reads: object_store's own retries off (the
/// source layer retries each part itself and counts the retries).
pub(crate) fn s3_store(bucket: &str, opts: &RemoteOptions) -> Result<Arc<dyn ObjectStore>, String> {
    let retry = RetryConfig {
        max_retries: 0,
        ..RetryConfig::default()
    };
    Ok(Arc::new(s3_client(bucket, opts, retry)?))
}

/// The client of `bucket` with `retry` (uploads let object_store retry each
/// request: a part upload is idempotent).
pub(crate) fn s3_client(
    bucket: &str,
    opts: &RemoteOptions,
    retry: RetryConfig,
) -> Result<AmazonS3, String> {
    s3_client_and_region(bucket, opts, retry).map(|(s, _)| s)
}

/// [`s3_client`] and the region it signs for.
pub(crate) fn s3_client_and_region(
    bucket: &str,
    opts: &RemoteOptions,
    retry: RetryConfig,
) -> Result<(AmazonS3, String), String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    // The profile files, for what the environment does not set.
    let profile = Profile::load(&env);
    if env("AWS_ACCESS_KEY_ID").is_none()
        && let (Some(id), Some(secret)) = (&profile.access_key_id, &profile.secret_access_key)
    {
        b = b.with_access_key_id(id).with_secret_access_key(secret);
        if let Some(t) = &profile.session_token {
            b = b.with_token(t);
        }
    }
    if env("AWS_REGION").is_none()
        && env("AWS_DEFAULT_REGION").is_none()
        && let Some(r) = &profile.region
    {
        b = b.with_region(r);
    }
    let endpoint = endpoint_of(opts, &env, &profile);
    let mut allow_http = false;
    if let Some((e, from)) = &endpoint {
        allow_http = check_endpoint(e).map_err(|m| format!("{from} {e:?}: {m}"))?;
        // Both keys: object_store prefers AWS_ENDPOINT_URL_S3 over the
        // generic endpoint, and an explicit endpoint must win over both.
        b = b
            .with_config(AmazonS3ConfigKey::Endpoint, e.trim_end_matches('/'))
            .with_config(AmazonS3ConfigKey::S3Endpoint, e.trim_end_matches('/'))
            .with_virtual_hosted_style_request(false);
    }
    let mut client = ClientOptions::new()
        .with_timeout(opts.timeout)
        .with_connect_timeout(Duration::from_secs(10))
        .with_allow_http(allow_http);
    if let Some(bundle) = &opts.ca_bundle {
        for c in read_ca_bundle(bundle)? {
            client = client.with_root_certificate(c);
        }
    }
    // object_store's default, which build() applies too.
    let region = b
        .get_config_value(&AmazonS3ConfigKey::Region)
        .unwrap_or_else(|| "us-east-1".into());
    let store = b
        .with_client_options(client)
        .with_retry(retry)
        .build()
        .map_err(|e| format!("cannot set up the S3 client: {e}"))?;
    Ok((store, region))
}

/// The endpoint requests go to and where it was set: `--endpoint`, else
/// the environment, else the AWS profile; None for AWS itself.
fn endpoint_of(
    opts: &RemoteOptions,
    env: &dyn Fn(&str) -> Option<String>,
    profile: &Profile,
) -> Option<(String, &'static str)> {
    match &opts.endpoint {
        Some(e) => Some((e.clone(), "--endpoint")),
        None => env("AWS_ENDPOINT_URL_S3")
            .map(|e| (e, "AWS_ENDPOINT_URL_S3"))
            .or_else(|| env("AWS_ENDPOINT_URL").map(|e| (e, "AWS_ENDPOINT_URL")))
            .or_else(|| env("AWS_ENDPOINT").map(|e| (e, "AWS_ENDPOINT")))
            .or_else(|| {
                profile
                    .endpoint_url
                    .clone()
                    .map(|e| (e, "endpoint_url of the AWS profile"))
            }),
    }
}

/// The endpoint `s3://` objects are read from with `opts` (None: AWS): part
/// of an object's identity (`super::identity`), since one bucket name on
/// two stores is two buckets.
pub(crate) fn s3_endpoint(opts: &RemoteOptions) -> Option<String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    endpoint_of(opts, &env, &Profile::load(&env)).map(|(e, _)| e)
}

/// Check an endpoint URL: `http://` or `https://`, a host, nothing the
/// client would misread (credentials, a query). Returns whether it is
/// plain http.
pub(crate) fn check_endpoint(e: &str) -> Result<bool, String> {
    let lower = e.to_ascii_lowercase();
    let (http, rest) = if let Some(r) = lower.strip_prefix("http://") {
        (true, r)
    } else if let Some(r) = lower.strip_prefix("https://") {
        (false, r)
    } else {
        return Err("an endpoint is an http:// or https:// URL".into());
    };
    let host = rest.split('/').next().unwrap_or("");
    if host.is_empty() {
        return Err("no host".into());
    }
    if host.contains('@') || rest.contains(['?', '#']) {
        return Err("an endpoint carries no credentials, query or fragment".into());
    }
    if e.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("blanks or control characters in the URL".into());
    }
    Ok(http)
}

/// The certificates of a PEM bundle (`--ca-bundle`), at least one.
pub(crate) fn read_ca_bundle(path: &Path) -> Result<Vec<Certificate>, String> {
    let pem = super::options::read_ca_bundle(path)?;
    Certificate::from_pem_bundle(&pem).map_err(|e| {
        format!(
            "CA bundle {}: not a PEM bundle of certificates: {e}",
            crate::text::escape(&path.to_string_lossy())
        )
    })
}

/// What this module takes from the AWS profile files.
#[derive(Debug, Default, PartialEq)]
struct Profile {
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    session_token: Option<String>,
    region: Option<String>,
    endpoint_url: Option<String>,
}

impl Profile {
    fn load(env: &dyn Fn(&str) -> Option<String>) -> Profile {
        let name = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let home = env("HOME").map(PathBuf::from);
        let file = |var: &str, rel: &str| {
            env(var)
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(rel)))
        };
        let read = |p: Option<PathBuf>| p.and_then(|p| std::fs::read_to_string(p).ok());
        let mut p = Profile::default();
        if let Some(text) = read(file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials")) {
            let s = ini_section(&text, &name);
            p.access_key_id = s.get("aws_access_key_id").cloned();
            p.secret_access_key = s.get("aws_secret_access_key").cloned();
            p.session_token = s.get("aws_session_token").cloned();
        }
        if let Some(text) = read(file("AWS_CONFIG_FILE", ".aws/config")) {
            // In the config file a profile other than default is
            // `[profile NAME]`.
            let section = if name == "default" {
                ini_section(&text, "default")
            } else {
                ini_section(&text, &format!("profile {name}"))
            };
            p.region = section.get("region").cloned();
            p.endpoint_url = section.get("endpoint_url").cloned();
            if p.access_key_id.is_none() {
                p.access_key_id = section.get("aws_access_key_id").cloned();
                p.secret_access_key = section.get("aws_secret_access_key").cloned();
                p.session_token = section.get("aws_session_token").cloned();
            }
        }
        p
    }
}

/// The `key = value` lines of section `[name]` of an INI file (keys
/// lowercased; comments and nested sub-sections skipped).
fn ini_section(text: &str, name: &str) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let mut inside = false;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = s.trim() == name;
            continue;
        }
        // An indented line continues a sub-section (`s3 =` then
        // `  endpoint_url = ...`): only top-level keys count.
        if inside
            && !raw.starts_with([' ', '\t'])
            && let Some((k, v)) = line.split_once('=')
            && !v.trim().is_empty()
        {
            out.entry(k.trim().to_ascii_lowercase())
                .or_insert_with(|| v.trim().to_string());
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Reads through object_store: one ranged GET checked against the pin, and
// what its errors mean (a definite answer, or one worth retrying)

pub(super) fn pin_of(meta: &object_store::ObjectMeta) -> Pin {
    Pin {
        etag: meta.e_tag.clone(),
        size: meta.size,
        last_modified: FileTime {
            secs: meta.last_modified.timestamp(),
            nanos: meta.last_modified.timestamp_subsec_nanos(),
        },
    }
}

/// The HTTP status in an object_store error message, if any.
fn status_in(msg: &str) -> Option<u16> {
    let i = msg.find("status code: ")? + "status code: ".len();
    msg.get(i..i + 3)?.parse().ok()
}

fn short(msg: String) -> String {
    const MAX: usize = 400;
    if msg.len() <= MAX {
        return msg;
    }
    let mut end = MAX;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &msg[..end])
}

pub(super) fn classify(e: object_store::Error) -> Attempt {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => Attempt::Final(ErrorKind::Io, "HTTP 404: no such object".into()),
        E::PermissionDenied { .. } => Attempt::Final(
            ErrorKind::Io,
            "HTTP 403: access denied (check the credentials)".into(),
        ),
        E::Unauthenticated { .. } => Attempt::Final(
            ErrorKind::Io,
            "HTTP 401: not authenticated (check the credentials)".into(),
        ),
        E::Precondition { .. } => Attempt::Final(
            ErrorKind::Changed,
            "HTTP 412: the object no longer has the pinned etag".into(),
        ),
        E::NotSupported { source } if source.to_string().contains("Range") => {
            Attempt::Final(ErrorKind::Io, RANGE_IGNORED.into())
        }
        other => {
            let mut msg = other.to_string();
            let mut src = std::error::Error::source(&other);
            while let Some(s) = src {
                let t = s.to_string();
                if !msg.contains(&t) {
                    msg = format!("{msg}: {t}");
                }
                src = s.source();
            }
            if msg.contains("non-partial response") {
                return Attempt::Final(ErrorKind::Io, RANGE_IGNORED.into());
            }
            match status_in(&msg) {
                Some(s) if (400..500).contains(&s) && s != 408 && s != 429 => {
                    Attempt::Final(ErrorKind::Io, short(msg))
                }
                _ => Attempt::Retry(short(msg)),
            }
        }
    }
}

/// One ranged GET through object_store, checked against the pin.
pub(super) async fn store_get(
    store: &dyn ObjectStore,
    location: &ObjPath,
    want: Range<u64>,
    block: u64,
    pin: &Pin,
    if_match: Option<String>,
    stall: Duration,
) -> std::result::Result<Vec<Bytes>, Attempt> {
    let opts = GetOptions {
        range: Some(GetRange::Bounded(want.clone())),
        if_match,
        ..GetOptions::default()
    };
    let res = unless_stalled(stall, "response", async {
        store.get_opts(location, opts).await.map_err(classify)
    })
    .await?;
    if let Some(d) = pin_changes(pin, &pin_of(&res.meta)) {
        return Err(Attempt::Final(ErrorKind::Changed, d));
    }
    if res.range != want {
        return Err(Attempt::Final(
            ErrorKind::Io,
            format!(
                "the server answered bytes {}-{} instead",
                res.range.start,
                res.range.end.saturating_sub(1)
            ),
        ));
    }
    let mut blocks = BlockSplitter::new(block, want.end - want.start);
    let mut body = res.into_stream();
    while let Some(chunk) =
        unless_stalled(stall, "bytes of the body", async { Ok(body.next().await) }).await?
    {
        blocks.push(&chunk.map_err(classify)?)?;
    }
    blocks.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(
            status_in("Server returned non-2xx status code: 503 Service"),
            Some(503)
        );
    }

    #[test]
    fn endpoints() {
        assert_eq!(check_endpoint("http://127.0.0.1:9000"), Ok(true));
        assert_eq!(
            check_endpoint("https://x.r2.cloudflarestorage.com/"),
            Ok(false)
        );
        assert!(check_endpoint("127.0.0.1:9000").is_err());
        assert!(check_endpoint("https://").is_err());
        assert!(check_endpoint("https://u:p@h").is_err());
        assert!(check_endpoint("https://h/?x=1").is_err());
    }

    #[test]
    fn profile_files() {
        let d = tempfile::tempdir().unwrap();
        let creds = d.path().join("credentials");
        let config = d.path().join("config");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = A\naws_secret_access_key = B\n\
             [work]\n# comment\naws_access_key_id=C\ns3 =\n  aws_access_key_id = nested\naws_secret_access_key=D\naws_session_token=T\n",
        )
        .unwrap();
        std::fs::write(
            &config,
            "[default]\nregion = eu-west-1\n[profile work]\nregion=auto\n\
             endpoint_url = https://acct.r2.cloudflarestorage.com\n",
        )
        .unwrap();
        let vars = |profile: Option<&str>| {
            let (c, f) = (creds.clone(), config.clone());
            let profile = profile.map(str::to_string);
            move |k: &str| match k {
                "AWS_SHARED_CREDENTIALS_FILE" => Some(c.display().to_string()),
                "AWS_CONFIG_FILE" => Some(f.display().to_string()),
                "AWS_PROFILE" => profile.clone(),
                _ => None,
            }
        };
        let p = Profile::load(&vars(None));
        assert_eq!(p.access_key_id.as_deref(), Some("A"));
        assert_eq!(p.region.as_deref(), Some("eu-west-1"));
        assert_eq!(p.endpoint_url, None);
        let p = Profile::load(&vars(Some("work")));
        assert_eq!(p.access_key_id.as_deref(), Some("C"));
        assert_eq!(p.session_token.as_deref(), Some("T"));
        assert_eq!(p.region.as_deref(), Some("auto"));
        assert_eq!(
            p.endpoint_url.as_deref(),
            Some("https://acct.r2.cloudflarestorage.com")
        );
        assert_eq!(Profile::load(&vars(Some("none"))), Profile::default());
    }

    #[test]
    fn ca_bundles() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ca.pem");
        std::fs::write(&p, "not a certificate\n").unwrap();
        let e = read_ca_bundle(&p).unwrap_err();
        assert!(e.contains("ca.pem"), "{e}");
        let e = read_ca_bundle(&d.path().join("missing.pem")).unwrap_err();
        assert!(e.contains("missing.pem"), "{e}");
    }
}
