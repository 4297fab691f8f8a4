//! Writing an encoder's output to `s3://BUCKET/KEY`: an S3 multipart
//! upload, so the object appears only when the whole file is there.
//!
//! - Parts are sent while the encoder runs (at most two in flight, so the
//!   upload overlaps the encoding), 8 MiB each and doubling every 1000
//!   parts: S3 takes at most 10,000 parts of at least 5 MiB (but the last),
//!   and growing parts keep any model size within that.
//! - The object appears at CompleteMultipartUpload only. Any failure, a
//!   cancel (drop without [`S3Upload::commit`]) or, in a program that
//!   called [`abort_on_signals`] (the `rknot` CLI, not the mount daemon,
//!   which has its own stop handling and cancels its jobs), SIGINT/SIGTERM
//!   aborts
//!   the upload, so no part is left stored; SIGKILL cannot: such a
//!   leftover upload is invisible to readers and removed by a bucket
//!   lifecycle rule (AbortIncompleteMultipartUpload).
//! - Without `overwrite` an existing object is never replaced: the object is
//!   looked up before anything is encoded (a clear early error), and the
//!   completion carries `If-None-Match: *`, so S3 refuses it (412) if an
//!   object appeared meanwhile. object_store's multipart API always
//!   completes unconditionally, so the completion is sent here: a request
//!   signed (SigV4, the If-None-Match header included) by object_store's
//!   public signer (`AwsAuthorizer`) with the store's credentials, posted
//!   with reqwest. A store that ignores the header (see
//!   docs/OPERATIONS.md) leaves only the early check.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use object_store::aws::AmazonS3;
use object_store::aws::AwsAuthorizer;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use object_store::signer::Signer;
use object_store::{ObjectStoreExt, PutPayload, RetryConfig};
use reqwest::header::{HeaderValue, IF_NONE_MATCH};

use super::identity::redact;
use super::options::RemoteOptions;
use crate::error::{ErrorKind, Result, err};

/// The first parts' size. S3's minimum is 5 MiB.
const FIRST_PART: usize = 8 << 20;

/// Parts of one size before the size doubles.
const PARTS_PER_SIZE: usize = 1000;

/// Part uploads in flight at once.
const IN_FLIGHT: usize = 2;

/// Where an output URL goes: `s3://BUCKET/KEY` only.
pub fn parse_output_url(url: &str) -> std::result::Result<(String, ObjPath), String> {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(
            "cannot write to an http(s) URL (a web server takes no uploads): write to a local \
             file or to s3://BUCKET/KEY"
                .into(),
        );
    }
    let rest = url
        .get(5..)
        .filter(|_| lower.starts_with("s3://"))
        .ok_or("not an s3:// URL")?;
    if rest.contains(['?', '#']) {
        return Err("an s3:// output takes no query string or fragment".into());
    }
    let (bucket, key) = rest.split_once('/').ok_or("no key: s3://BUCKET/KEY")?;
    if bucket.is_empty() || bucket.contains('@') {
        return Err("no bucket (s3://BUCKET/KEY, without credentials)".into());
    }
    if key.is_empty() || key.ends_with('/') {
        return Err("the URL names no object (its key is empty or ends with /)".into());
    }
    let location = ObjPath::from_url_path(key).map_err(|e| format!("bad object key: {e}"))?;
    Ok((bucket.to_string(), location))
}

/// `-o jobs_remote_prefix=`: an `s3://BUCKET/` or `s3://BUCKET/PREFIX/`
/// under which encoding jobs of a mount write (normalized to end with `/`,
/// so an output is PREFIX + its plain name).
pub fn check_output_prefix(prefix: &str) -> std::result::Result<String, String> {
    let with_slash = if prefix.ends_with('/') {
        prefix.to_string()
    } else {
        format!("{prefix}/")
    };
    parse_output_url(&format!("{with_slash}x"))?;
    if with_slash.get(5..).is_some_and(|rest| rest.contains("//")) {
        return Err("empty path segment (//) in the prefix".into());
    }
    Ok(with_slash)
}

/// One upload in progress, as the signal handler sees it.
struct Active {
    id: u64,
    bucket: String,
    location: ObjPath,
    upload_id: String,
    opts: RemoteOptions,
}

static ACTIVE: Mutex<Vec<Active>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// The signal that arrived (0: none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

fn active() -> std::sync::MutexGuard<'static, Vec<Active>> {
    ACTIVE.lock().unwrap_or_else(|p| p.into_inner())
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: the watcher thread does the work.
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// From now on, SIGINT and SIGTERM abort every upload in progress, then
/// end the process with status 128 + the signal (as the default action
/// would, but without leaving stored parts behind). A watcher thread does
/// it (a signal handler may not make requests). For a command-line
/// program; idempotent.
pub fn abort_on_signals() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a plain handler that only stores an atomic.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
        let spawned = std::thread::Builder::new()
            .name("rknot-upload-signals".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(Duration::from_millis(20));
                    let sig = SIGNALLED.load(Ordering::SeqCst);
                    if sig == 0 {
                        continue;
                    }
                    let uploads: Vec<Active> = std::mem::take(&mut *active());
                    for a in &uploads {
                        let shown = format!("s3://{}/{}", a.bucket, a.location);
                        match abort_upload(a) {
                            Ok(()) => eprintln!(
                                "rknot: interrupted (signal {sig}): upload to {shown} aborted, \
                                 nothing written"
                            ),
                            Err(e) => eprintln!(
                                "rknot: interrupted (signal {sig}): could not abort the upload to \
                                 {shown}: {e} (a bucket lifecycle rule removes it)"
                            ),
                        }
                    }
                    std::process::exit(128 + sig);
                }
            });
        if let Err(e) = spawned {
            log::warn!("cannot watch for SIGINT/SIGTERM during uploads: {e}");
        }
    });
}

/// Abort `a` with a client and runtime of its own (the uploading thread's
/// may be busy or stuck in a request).
fn abort_upload(a: &Active) -> std::result::Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let store = super::s3::s3_client(&a.bucket, &a.opts, RetryConfig::default())?;
    rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(30),
            store.abort_multipart(&a.location, &a.upload_id),
        )
        .await
    })
    .map_err(|_| "timed out".to_string())?
    .map_err(|e| e.to_string())
}

type PartTask = tokio::task::JoinHandle<object_store::Result<PartId>>;

/// An output being uploaded to S3; [`std::io::Write`] it, then
/// [`S3Upload::commit`]. Dropped uncommitted, it aborts the upload.
pub struct S3Upload {
    /// The redacted URL (for messages).
    shown: String,
    id: u64,
    rt: tokio::runtime::Runtime,
    store: Arc<AmazonS3>,
    /// The store's region (the signature's scope).
    region: String,
    opts: RemoteOptions,
    location: ObjPath,
    upload_id: String,
    overwrite: bool,
    buf: Vec<u8>,
    in_flight: VecDeque<PartTask>,
    parts: Vec<PartId>,
    written: u64,
    /// Whether the upload is over (completed or aborted).
    finished: bool,
}

impl std::fmt::Debug for S3Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Upload")
            .field("url", &self.shown)
            .finish_non_exhaustive()
    }
}

fn object_error(shown: &str, what: &str, e: object_store::Error) -> crate::error::Error {
    use object_store::Error as E;
    let msg = match &e {
        E::NotFound { .. } => format!("{what}: HTTP 404: no such bucket or object"),
        E::PermissionDenied { .. } => {
            format!("{what}: HTTP 403: access denied (check the credentials)")
        }
        E::Unauthenticated { .. } => {
            format!("{what}: HTTP 401: not authenticated (check the credentials)")
        }
        // Without keys in the environment or the profile files,
        // object_store asks the EC2 instance metadata service last.
        _ if e.to_string().contains("169.254.169.254") => format!(
            "{what}: no AWS credentials (none in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the \
             profile files, and no EC2 instance metadata service answered): {e}"
        ),
        _ => format!("{what}: {e}"),
    };
    err(ErrorKind::Io, msg).path(std::path::Path::new(shown))
}

impl S3Upload {
    /// Start an upload to `url` (`s3://BUCKET/KEY`). Without `overwrite`
    /// an existing object is refused here already.
    pub fn create(url: &str, overwrite: bool, opts: &RemoteOptions) -> Result<S3Upload> {
        let shown = redact(url);
        let at = |m: String| err(ErrorKind::BadValue, m).path(std::path::Path::new(&shown));
        let (bucket, location) = parse_output_url(url).map_err(at)?;
        let retry = RetryConfig {
            max_retries: opts.max_retries as usize,
            ..RetryConfig::default()
        };
        let (store, region) = super::s3::s3_client_and_region(&bucket, opts, retry)
            .map_err(|m| err(ErrorKind::Io, m).path(std::path::Path::new(&shown)))?;
        let store = Arc::new(store);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rknot-upload")
            .enable_all()
            .build()
            .map_err(|e| {
                err(
                    ErrorKind::Io,
                    format!("cannot start the upload runtime: {e}"),
                )
            })?;
        if !overwrite {
            match rt.block_on(store.head(&location)) {
                Ok(_) => {
                    return Err(err(
                        ErrorKind::BadValue,
                        "output exists (pass --overwrite to replace it)",
                    )
                    .path(std::path::Path::new(&shown)));
                }
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(object_error(&shown, "HEAD", e)),
            }
        }
        let upload_id = rt
            .block_on(store.create_multipart(&location))
            .map_err(|e| object_error(&shown, "CreateMultipartUpload", e))?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        active().push(Active {
            id,
            bucket,
            location: location.clone(),
            upload_id: upload_id.clone(),
            opts: opts.clone(),
        });
        log::info!("{shown}: multipart upload started");
        Ok(S3Upload {
            shown,
            id,
            rt,
            store,
            region,
            opts: opts.clone(),
            location,
            upload_id,
            overwrite,
            buf: Vec::with_capacity(FIRST_PART),
            in_flight: VecDeque::new(),
            parts: Vec::new(),
            written: 0,
            finished: false,
        })
    }

    /// The redacted URL.
    pub fn url(&self) -> &str {
        &self.shown
    }

    fn part_size(&self) -> usize {
        let n = self.parts.len() + self.in_flight.len();
        // At most 4 GiB (S3 takes parts up to 5 GiB).
        FIRST_PART << (n / PARTS_PER_SIZE).min(9)
    }

    /// Wait for the oldest part in flight.
    fn settle_one(&mut self) -> std::io::Result<()> {
        let Some(task) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let n = self.parts.len() + 1;
        let part = self
            .rt
            .block_on(task)
            .map_err(|e| std::io::Error::other(format!("upload of part {n}: {e}")))?
            .map_err(|e| std::io::Error::other(format!("upload of part {n}: {e}")))?;
        self.parts.push(part);
        Ok(())
    }

    /// Send the buffer as the next part.
    fn send_part(&mut self) -> std::io::Result<()> {
        while self.in_flight.len() >= IN_FLIGHT {
            self.settle_one()?;
        }
        let next = self.part_size();
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(next));
        let idx = self.parts.len() + self.in_flight.len();
        let (store, location, upload_id) = (
            self.store.clone(),
            self.location.clone(),
            self.upload_id.clone(),
        );
        let task = self.rt.spawn(async move {
            store
                .put_part(&location, &upload_id, idx, PutPayload::from(data))
                .await
        });
        self.in_flight.push_back(task);
        Ok(())
    }

    /// Send what is left, complete the upload (conditionally without
    /// overwrite) and return the bytes written. On any error the upload is
    /// aborted (by drop) and nothing appears.
    pub fn commit(mut self) -> Result<u64> {
        let io = |e: std::io::Error| err(ErrorKind::Io, e.to_string());
        // At least one part, possibly empty: S3 completes no upload without.
        if !self.buf.is_empty() || self.parts.len() + self.in_flight.len() == 0 {
            self.send_part()
                .map_err(|e| io(e).path(std::path::Path::new(&self.shown)))?;
        }
        while !self.in_flight.is_empty() {
            self.settle_one()
                .map_err(|e| io(e).path(std::path::Path::new(&self.shown)))?;
        }
        let parts = self.parts.clone();
        if self.overwrite {
            self.rt
                .block_on(
                    self.store
                        .complete_multipart(&self.location, &self.upload_id, parts),
                )
                .map_err(|e| object_error(&self.shown, "CompleteMultipartUpload", e))?;
        } else {
            self.complete_if_absent(&parts)?;
        }
        self.finished = true;
        active().retain(|a| a.id != self.id);
        log::info!("{}: uploaded {} bytes", self.shown, self.written);
        Ok(self.written)
    }

    /// CompleteMultipartUpload with `If-None-Match: *`: refused (412) when
    /// an object exists at the key by then.
    fn complete_if_absent(&self, parts: &[PartId]) -> Result<()> {
        let shown = std::path::Path::new(&self.shown);
        let fail =
            |m: String| err(ErrorKind::Io, format!("CompleteMultipartUpload: {m}")).path(shown);
        // The object's URL exactly as object_store addresses it
        // (endpoint, path or virtual-host style, key encoding): a
        // presigned URL without its query string.
        let mut url = self
            .rt
            .block_on(self.store.signed_url(
                reqwest::Method::POST,
                &self.location,
                Duration::from_secs(60),
            ))
            .map_err(|e| fail(format!("cannot address the object: {e}")))?;
        url.set_query(None);
        url.query_pairs_mut()
            .append_pair("uploadId", &self.upload_id);
        let mut body = String::from("<CompleteMultipartUpload>");
        for (i, p) in parts.iter().enumerate() {
            body += &format!(
                "<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>",
                i + 1,
                xml_escape(&p.content_id)
            );
        }
        body += "</CompleteMultipartUpload>";
        let pem = match &self.opts.ca_bundle {
            Some(bundle) => Some(super::options::read_ca_bundle(bundle).map_err(fail)?),
            None => None,
        };
        // The completion of a large upload can take minutes on the store's
        // side: at least 300 s.
        let patient = RemoteOptions {
            timeout: self.opts.timeout.max(Duration::from_secs(300)),
            ..self.opts.clone()
        };
        let client = super::http::client(&patient, pem.as_deref()).map_err(fail)?;
        let mut attempt = 0u32;
        loop {
            // Signed anew each attempt (the signature carries the time).
            let signed = self
                .rt
                .block_on(self.sign_post(url.as_str(), &body))
                .map_err(|e| fail(format!("cannot sign the request: {e}")))?;
            let sent = self.rt.block_on(async {
                let r = client
                    .post(url.clone())
                    .headers(signed)
                    .body(body.clone())
                    .send()
                    .await?;
                let status = r.status();
                let text = r.text().await?;
                Ok::<_, reqwest::Error>((status, text))
            });
            let retry = match sent {
                Ok((s, _)) if s.as_u16() == 412 => {
                    return Err(err(
                        ErrorKind::BadValue,
                        "an object appeared at the output while encoding; it was left as it is \
                         (pass --overwrite to replace it)",
                    )
                    .path(shown));
                }
                Ok((s, text)) if s.is_success() && !text.contains("<Error>") => return Ok(()),
                // S3 may answer 200 with an error in the body (it failed
                // after sending the status): InternalError is retried.
                Ok((s, text)) if (s.is_server_error() || text.contains("InternalError")) => {
                    format!("HTTP {s}: {}", first_line(&text))
                }
                Ok((s, text)) => {
                    let hint = if s.as_u16() == 501 {
                        " (this store does not support conditional completion: pass --overwrite \
                         to upload without it)"
                    } else {
                        ""
                    };
                    return Err(fail(format!("HTTP {s}: {}{hint}", first_line(&text))));
                }
                // Without the URL (its uploadId is noise in a message).
                Err(e) => e.without_url().to_string(),
            };
            if attempt >= self.opts.max_retries {
                return Err(fail(format!("{retry} (gave up after {attempt} retries)")));
            }
            attempt += 1;
            log::warn!("{}: CompleteMultipartUpload: {retry}; retrying", self.shown);
            std::thread::sleep(self.opts.backoff.saturating_mul(1 << attempt.min(6)));
        }
    }
}

impl S3Upload {
    /// The headers of a SigV4-signed `POST url` with `body` and
    /// `If-None-Match: *` (signed with every other header, the payload's
    /// SHA-256 included), by object_store's own signer and credentials.
    async fn sign_post(
        &self,
        url: &str,
        body: &str,
    ) -> std::result::Result<reqwest::header::HeaderMap, String> {
        let credential = self
            .store
            .credentials()
            .get_credential()
            .await
            .map_err(|e| e.to_string())?;
        let mut request: object_store::client::HttpRequest = http::Request::builder()
            .method(http::Method::POST)
            .uri(url)
            .header(IF_NONE_MATCH, HeaderValue::from_static("*"))
            .body(object_store::client::HttpRequestBody::from(
                body.to_string(),
            ))
            .map_err(|e| e.to_string())?;
        AwsAuthorizer::new(&credential, "s3", &self.region)
            .try_authorize(&mut request, None)
            .map_err(|e| e.to_string())?;
        Ok(request.headers().clone())
    }
}

fn first_line(s: &str) -> String {
    let s = s.trim();
    let line = s.lines().next().unwrap_or("");
    // The error code is what says something; the XML around it does not.
    if let (Some(a), Some(b)) = (s.find("<Code>"), s.find("</Code>"))
        && a + 6 <= b
    {
        return s[a + 6..b].to_string();
    }
    line.chars().take(200).collect()
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl std::io::Write for S3Upload {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.finished {
            return Err(std::io::Error::other("upload already finished"));
        }
        let room = self.part_size().saturating_sub(self.buf.len());
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        self.written += n as u64;
        if self.buf.len() >= self.part_size() {
            self.send_part()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for S3Upload {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Parts in flight finish or fail first: an abort while a part is
        // being stored may leave that part behind.
        for t in std::mem::take(&mut self.in_flight) {
            let _ = self.rt.block_on(t);
        }
        active().retain(|a| a.id != self.id);
        match self
            .rt
            .block_on(self.store.abort_multipart(&self.location, &self.upload_id))
        {
            Ok(()) => log::info!("{}: upload aborted, nothing written", self.shown),
            Err(e) => eprintln!(
                "rknot: warning: {}: could not abort the unfinished upload: {e} (a bucket \
                 lifecycle rule removes it)",
                self.shown
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_urls() {
        let (b, k) = parse_output_url("s3://models/q/7b.rknot").unwrap();
        assert_eq!((b.as_str(), k.as_ref()), ("models", "q/7b.rknot"));
        assert!(
            parse_output_url("https://h/x.rknot")
                .unwrap_err()
                .contains("http(s)")
        );
        assert!(parse_output_url("s3://b/").is_err());
        assert!(parse_output_url("s3://b").is_err());
        assert!(parse_output_url("s3://b/k?x=1").is_err());
        assert_eq!(check_output_prefix("s3://b/jobs").unwrap(), "s3://b/jobs/");
        assert_eq!(check_output_prefix("s3://b/").unwrap(), "s3://b/");
        assert!(check_output_prefix("s3://b//x").is_err());
        assert!(check_output_prefix("https://h/p/").is_err());
        assert!(check_output_prefix("/srv/jobs").is_err());
        assert_eq!(
            first_line("<Error><Code>NoSuchUpload</Code></Error>"),
            "NoSuchUpload"
        );
    }
}
