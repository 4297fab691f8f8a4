//! A remote source: an object at an `http(s)://` URL or `s3://BUCKET/KEY`,
//! read by ranged GETs through the `object_store` crate, pinned to the
//! version it had at open.
//!
//! - Open costs two round trips: a HEAD (size, ETag, Last-Modified: the
//!   pinned version) and the GET of the first part, which holds the header
//!   of any model whose header is smaller than a part; the readers then
//!   parse it from the part cache.
//! - Bytes are fetched in aligned parts ([`RemoteOptions::part_size`],
//!   8 MiB by default) into a [`PartCache`] bounded in bytes, single flight.
//! - Pinning: every GET carries `If-Match: <pinned ETag>` (a strong one;
//!   a weak ETag is compared in the response instead), and every response's
//!   ETag, size (from Content-Range) and, without an ETag, Last-Modified are
//!   compared with the pinned ones. A mismatch or a 412 makes the source
//!   `Changed` (sticky, ESTALE), as for a local file: parts already cached
//!   are of the pinned version, so bytes of two versions are never mixed.
//! - A server that ignores Range (200 and the whole body) is refused at
//!   open: object_store reports it before the body is read.
//! - Retries: object_store's own retries are off (max_retries 0) and this
//!   layer retries each part request itself, with exponential backoff and
//!   jitter, on everything that is not a definite answer (timeouts,
//!   connection errors and resets, truncated bodies, 5xx, 429): its retry
//!   loop is not observable from outside (its error type is private), and
//!   the counters in `ctl` must say how many retries happened. Definite
//!   answers (401, 403, 404, 412, other 4xx, Range ignored) are not retried.
//! - Runtime: one small multi-thread tokio runtime for the process, created
//!   on first use and driven by `block_on` from the synchronous readers.
//!   [`stop_runtime`] shuts it down before the mount daemon forks; the next
//!   use creates a new one, and each source rebuilds its client for it.
//!
//! URLs are printed redacted ([`redact`]: no userinfo, no query string, no
//! fragment). URLs with a query string (presigned URLs) are refused for now:
//! the HTTP store cannot carry one.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig};
use sha2::{Digest, Sha256};

use super::parts::{FetchError, PartCache, PartStats};
use super::{FileTime, SourceVersion};
use crate::error::{Error, ErrorKind, Result, err};

/// Whether `s` names a remote source (a URL scheme this layer reads).
pub fn is_remote(s: &str) -> bool {
    ["http://", "https://", "s3://"]
        .iter()
        .any(|p| s.len() >= p.len() && s[..p.len()].eq_ignore_ascii_case(p))
}

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

/// How remote sources fetch and cache.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Bytes per part (the unit of fetching and caching). 8 MiB: a ranged
    /// GET costs a round trip plus time to first byte (tens of ms on S3),
    /// so parts must be large for that to stay small beside the transfer
    /// (8 MiB at 100 MB/s is 80 ms), and small enough that reading one
    /// small tensor does not pull much more than it; S3's own guidance for
    /// ranged GETs is 8-16 MiB; and most model headers (tokenizer included)
    /// fit in the first part, so open costs one GET after the HEAD.
    pub part_size: u64,
    /// Bytes of parts kept in memory per source.
    pub cache_bytes: u64,
    /// Retries of one request before its read fails.
    pub max_retries: u32,
    /// Backoff before the first retry (doubling, capped at 5 s, jittered).
    pub backoff: Duration,
    /// Timeout of one request (connect to the end of the body).
    pub timeout: Duration,
    /// Part fetches in flight at once per source (read-ahead and the parts
    /// of one large read).
    pub max_in_flight: usize,
    /// The largest sequential read-ahead window, in bytes.
    pub readahead_max: u64,
    /// S3 endpoint (S3-compatible stores), overriding `AWS_ENDPOINT_URL`.
    pub endpoint: Option<String>,
    /// A PEM bundle of extra CA certificates trusted for https (added to
    /// the system's roots; verification is never turned off).
    pub ca_bundle: Option<PathBuf>,
    /// The persistent disk cache of parts (`--source-cache DIR`), if any.
    pub source_cache: Option<PathBuf>,
    /// Its size limit in bytes.
    pub source_cache_bytes: u64,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            part_size: 8 << 20,
            cache_bytes: 256 << 20,
            max_retries: 5,
            backoff: Duration::from_millis(100),
            timeout: Duration::from_secs(60),
            max_in_flight: 8,
            readahead_max: 64 << 20,
            endpoint: None,
            ca_bundle: None,
            source_cache: None,
            source_cache_bytes: 10 << 30,
        }
    }
}

/// The options set by the program's flags ([`RemoteOptions::set_current`]).
static CURRENT: Mutex<Option<RemoteOptions>> = Mutex::new(None);

impl RemoteOptions {
    /// The options every [`super::SourceFile::open`] of a URL uses: those
    /// set by [`RemoteOptions::set_current`] (the command line), else
    /// [`RemoteOptions::from_env`].
    pub fn current() -> RemoteOptions {
        lock(&CURRENT)
            .clone()
            .unwrap_or_else(RemoteOptions::from_env)
    }

    /// Set the options of every later open of a URL in this process (once,
    /// from the command line, before any source is opened).
    pub fn set_current(opts: RemoteOptions) {
        *lock(&CURRENT) = Some(opts);
    }

    /// The defaults, with overrides from `RKNOT_REMOTE_PART_SIZE`,
    /// `RKNOT_REMOTE_CACHE_BYTES`, `RKNOT_REMOTE_RETRIES`,
    /// `RKNOT_REMOTE_BACKOFF_MS` and `RKNOT_REMOTE_TIMEOUT_S` (provisional,
    /// until mount options and flags exist). Unparsable values are ignored.
    pub fn from_env() -> RemoteOptions {
        let num = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let d = RemoteOptions::default();
        RemoteOptions {
            part_size: num("RKNOT_REMOTE_PART_SIZE")
                .filter(|&n| n >= 4096)
                .unwrap_or(d.part_size),
            cache_bytes: num("RKNOT_REMOTE_CACHE_BYTES").unwrap_or(d.cache_bytes),
            max_retries: num("RKNOT_REMOTE_RETRIES")
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(d.max_retries),
            backoff: num("RKNOT_REMOTE_BACKOFF_MS").map_or(d.backoff, Duration::from_millis),
            timeout: num("RKNOT_REMOTE_TIMEOUT_S")
                .filter(|&n| n > 0)
                .map_or(d.timeout, Duration::from_secs),
            ..d
        }
    }
}

// ---------------------------------------------------------------------------
// The runtime

struct Rt {
    runtime: Option<Arc<tokio::runtime::Runtime>>,
    generation: u64,
}

static RUNTIME: Mutex<Rt> = Mutex::new(Rt {
    runtime: None,
    generation: 0,
});

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's remote-I/O runtime and its generation (which changes each
/// time one is created).
fn runtime() -> std::result::Result<(Arc<tokio::runtime::Runtime>, u64), String> {
    let mut rt = lock(&RUNTIME);
    if let Some(r) = &rt.runtime {
        return Ok((r.clone(), rt.generation));
    }
    let r = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rknot-remote")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the remote I/O runtime: {e}"))?;
    let r = Arc::new(r);
    rt.generation += 1;
    rt.runtime = Some(r.clone());
    Ok((r, rt.generation))
}

/// Shut the remote-I/O runtime down (its threads joined), e.g. before a
/// `fork`: a forked child has none of its threads. Remote sources opened
/// before keep working: the next request starts a new runtime and a new
/// client. Returns whether a runtime was running.
pub fn stop_runtime() -> bool {
    let taken = lock(&RUNTIME).runtime.take();
    match taken {
        Some(r) => {
            match Arc::try_unwrap(r) {
                Ok(r) => r.shutdown_timeout(Duration::from_secs(2)),
                Err(r) => drop(r),
            }
            true
        }
        None => false,
    }
}

// ---------------------------------------------------------------------------
// Where the object is

#[derive(Debug, Clone)]
enum Target {
    /// Base URL (scheme and host) and the object's path.
    Http {
        base: String,
        allow_http: bool,
    },
    S3 {
        bucket: String,
    },
}

fn parse_url(url: &str) -> std::result::Result<(Target, ObjPath), String> {
    if url.contains('?') || url.contains('#') {
        return Err(
            "URLs with a query string or fragment (presigned URLs) are not supported yet".into(),
        );
    }
    let i = url.find("://").ok_or("not a URL")?;
    let scheme = url[..i].to_ascii_lowercase();
    let rest = &url[i + 3..];
    let (auth, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if auth.contains('@') {
        return Err("credentials in the URL are not supported: use the environment (AWS_*), not user:password@".into());
    }
    if auth.is_empty() {
        return Err("no host (or bucket) in the URL".into());
    }
    let key = path.trim_start_matches('/');
    if key.is_empty() || key.ends_with('/') {
        return Err("the URL names no object (its path is empty or ends with /)".into());
    }
    let location = ObjPath::from_url_path(key).map_err(|e| format!("bad object path: {e}"))?;
    let target = match scheme.as_str() {
        "http" | "https" => Target::Http {
            base: format!("{scheme}://{auth}"),
            allow_http: scheme == "http",
        },
        "s3" => Target::S3 {
            bucket: auth.to_string(),
        },
        _ => return Err(format!("unsupported scheme {scheme}://")),
    };
    Ok((target, location))
}

fn build_store(t: &Target, o: &RemoteOptions) -> std::result::Result<Arc<dyn ObjectStore>, String> {
    let retry = RetryConfig {
        max_retries: 0,
        ..RetryConfig::default()
    };
    let client = ClientOptions::new()
        .with_timeout(o.timeout)
        .with_connect_timeout(Duration::from_secs(10));
    Ok(match t {
        Target::Http { base, allow_http } => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(base.clone())
                .with_client_options(client.with_allow_http(*allow_http))
                .with_retry(retry)
                .build()
                .map_err(|e| format!("cannot set up the HTTP client: {e}"))?,
        ),
        Target::S3 { bucket } => super::s3::s3_store(bucket, o)?,
    })
}

// ---------------------------------------------------------------------------
// The pinned version

/// The version of an object that a source serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    pub etag: Option<String>,
    pub size: u64,
    /// Last-Modified (the epoch when the server sent none).
    pub last_modified: FileTime,
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.etag {
            Some(e) => write!(f, "etag {e}, {} bytes", self.size),
            None => write!(
                f,
                "{} bytes, last-modified {} (no etag)",
                self.size, self.last_modified
            ),
        }
    }
}

fn pin_of(meta: &object_store::ObjectMeta) -> Pin {
    Pin {
        etag: meta.e_tag.clone(),
        size: meta.size,
        last_modified: FileTime {
            secs: meta.last_modified.timestamp(),
            nanos: meta.last_modified.timestamp_subsec_nanos(),
        },
    }
}

/// What differs between the pinned version and what a response says; None
/// when it is the same version.
fn pin_changes(pin: &Pin, now: &Pin) -> Option<String> {
    let mut d = Vec::new();
    if let (Some(a), Some(b)) = (&pin.etag, &now.etag)
        && a != b
    {
        d.push(format!("etag {a} -> {b}"));
    }
    if pin.size != now.size {
        d.push(format!("size {} -> {} bytes", pin.size, now.size));
    }
    if pin.etag.is_none() && pin.last_modified != now.last_modified {
        d.push(format!(
            "last-modified {} -> {}",
            pin.last_modified, now.last_modified
        ));
    }
    (!d.is_empty()).then(|| d.join(", "))
}

// ---------------------------------------------------------------------------
// Counters

/// A snapshot of one remote source's counters, for `ctl`.
#[derive(Debug, Clone)]
pub struct RemoteStats {
    /// The redacted URL.
    pub url: String,
    pub pinned: String,
    pub part_size: u64,
    pub bytes_fetched: u64,
    pub requests: u64,
    pub retries: u64,
    pub failures: u64,
    pub parts: PartStats,
    pub changed: bool,
}

#[derive(Default)]
struct Counters {
    bytes_fetched: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    failures: AtomicU64,
}

/// One request's failure: a definite answer, or one worth retrying.
enum Attempt {
    Final(ErrorKind, String),
    Retry(String),
}

const RANGE_IGNORED: &str = "the server ignored the Range header (it answered 200 with the \
    whole object instead of 206 with the bytes asked for): refused, since every read would \
    download the whole object; serve it from a server that supports ranged GETs";

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

fn classify(e: object_store::Error) -> Attempt {
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

/// A number in [0, 1) for jitter: xorshift over a process-wide state.
fn jitter() -> f64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed);
    if x == 0 {
        x = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0x9e37_79b9_7f4a_7c15, |d| d.as_nanos() as u64)
            | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    STATE.store(x, Ordering::Relaxed);
    (x >> 11) as f64 / (1u64 << 53) as f64
}

// ---------------------------------------------------------------------------
// The source

pub(crate) struct RemoteFile {
    /// The redacted URL, as a path (what errors and `ctl` name).
    display: PathBuf,
    target: Target,
    location: ObjPath,
    opts: RemoteOptions,
    /// The client, and the runtime generation it was built for.
    store: Mutex<(u64, Arc<dyn ObjectStore>)>,
    pin: Pin,
    /// `If-Match` value: the pinned ETag when it is a strong one.
    if_match: Option<String>,
    version: SourceVersion,
    parts: PartCache,
    counters: Counters,
    changed: OnceLock<String>,
}

impl fmt::Debug for RemoteFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteFile")
            .field("url", &self.display)
            .field("pin", &self.pin)
            .finish_non_exhaustive()
    }
}

impl RemoteFile {
    /// Open `url`: a HEAD pins the version, then the first part is fetched
    /// (and cached) so the readers parse the header without another trip.
    pub(crate) fn open(url: &str, opts: RemoteOptions) -> Result<RemoteFile> {
        let display = PathBuf::from(redact(url));
        let (target, location) =
            parse_url(url).map_err(|m| err(ErrorKind::Io, m).path(&display))?;
        let (_, generation) = runtime().map_err(|m| err(ErrorKind::Io, m).path(&display))?;
        let store =
            build_store(&target, &opts).map_err(|m| err(ErrorKind::Io, m).path(&display))?;
        let mut f = RemoteFile {
            version: SourceVersion {
                dev: 0,
                ino: 0,
                size: 0,
                mtime: FileTime { secs: 0, nanos: 0 },
                ctime: FileTime { secs: 0, nanos: 0 },
            },
            display,
            target,
            location,
            parts: PartCache::new(opts.cache_bytes),
            opts,
            store: Mutex::new((generation, store)),
            pin: Pin {
                etag: None,
                size: 0,
                last_modified: FileTime { secs: 0, nanos: 0 },
            },
            if_match: None,
            counters: Counters::default(),
            changed: OnceLock::new(),
        };
        let meta = f
            .with_retries("HEAD", |store, loc| async move {
                store.head(&loc).await.map_err(classify)
            })
            .map_err(|(k, m)| err(k, m).path(&f.display))?;
        f.pin = pin_of(&meta);
        f.if_match = f.pin.etag.clone().filter(|e| !e.starts_with("W/"));
        f.version = f.synth_version();
        log::info!("{}: opened remote object, {}", f.display.display(), f.pin);
        if f.pin.size > 0 {
            f.part(0, 0)?;
        }
        Ok(f)
    }

    /// A [`SourceVersion`] standing for the pinned version: device 0 (no
    /// local file has it) and an "inode" hashed from the redacted URL and
    /// the pin, so caches keyed by versions tell objects and versions apart.
    fn synth_version(&self) -> SourceVersion {
        let mut h = Sha256::new();
        h.update(self.display.as_os_str().as_encoded_bytes());
        h.update([0]);
        h.update(self.pin.to_string().as_bytes());
        let d = h.finalize();
        let mut ino = [0u8; 8];
        ino.copy_from_slice(&d[..8]);
        SourceVersion {
            dev: 0,
            ino: u64::from_le_bytes(ino),
            size: self.pin.size,
            mtime: self.pin.last_modified,
            ctime: self.pin.last_modified,
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.display
    }

    pub(crate) fn version(&self) -> &SourceVersion {
        &self.version
    }

    pub(crate) fn pin(&self) -> &Pin {
        &self.pin
    }

    pub(crate) fn modified(&self) -> Option<SystemTime> {
        let lm = self.pin.last_modified;
        (lm.secs > 0).then(|| {
            SystemTime::UNIX_EPOCH
                + Duration::new(lm.secs.unsigned_abs(), lm.nanos.min(999_999_999))
        })
    }

    pub(crate) fn is_changed(&self) -> bool {
        self.changed.get().is_some()
    }

    pub(crate) fn check_unchanged(&self) -> Result<()> {
        match self.changed.get() {
            Some(what) => Err(self.changed_error(what)),
            None => Ok(()),
        }
    }

    fn changed_error(&self, what: &str) -> Error {
        err(
            ErrorKind::Changed,
            format!(
                "the object changed after it was opened ({what}); nothing more is read from \
                 it: remount to serve the new version"
            ),
        )
        .path(&self.display)
    }

    pub(crate) fn stats(&self) -> RemoteStats {
        let c = &self.counters;
        RemoteStats {
            url: self.display.display().to_string(),
            pinned: self.pin.to_string(),
            part_size: self.opts.part_size,
            bytes_fetched: c.bytes_fetched.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            failures: c.failures.load(Ordering::Relaxed),
            parts: self.parts.stats(),
            changed: self.is_changed(),
        }
    }

    /// The client for the current runtime (rebuilt after [`stop_runtime`]).
    fn client(
        &self,
    ) -> std::result::Result<(Arc<tokio::runtime::Runtime>, Arc<dyn ObjectStore>), String> {
        let (rt, generation) = runtime()?;
        let mut s = lock(&self.store);
        if s.0 != generation {
            *s = (generation, build_store(&self.target, &self.opts)?);
        }
        Ok((rt, s.1.clone()))
    }

    /// Run one request (`what` names it in errors) with bounded retries,
    /// backoff and jitter, counting requests, retries and failures.
    fn with_retries<T, F, Fut>(&self, what: &str, op: F) -> std::result::Result<T, FetchError>
    where
        F: Fn(Arc<dyn ObjectStore>, ObjPath) -> Fut,
        Fut: Future<Output = std::result::Result<T, Attempt>>,
    {
        let c = &self.counters;
        let mut attempt = 0u32;
        loop {
            let (rt, store) = self.client().map_err(|m| (ErrorKind::Io, m))?;
            c.requests.fetch_add(1, Ordering::Relaxed);
            let result = rt.block_on(op(store, self.location.clone()));
            drop(rt);
            match result {
                Ok(v) => return Ok(v),
                Err(Attempt::Final(kind, m)) => {
                    c.failures.fetch_add(1, Ordering::Relaxed);
                    return Err((kind, format!("{what}: {m}")));
                }
                Err(Attempt::Retry(m)) if attempt >= self.opts.max_retries => {
                    c.failures.fetch_add(1, Ordering::Relaxed);
                    return Err((
                        ErrorKind::Io,
                        format!("{what}: {m} (gave up after {attempt} retries)"),
                    ));
                }
                Err(Attempt::Retry(m)) => {
                    let exp = self
                        .opts
                        .backoff
                        .saturating_mul(1u32 << attempt.min(16))
                        .min(Duration::from_secs(5));
                    // Equal jitter: half fixed, half random.
                    let sleep = exp / 2 + exp.mul_f64(jitter() / 2.0);
                    log::warn!(
                        "{}: {what}: {m}; retry {} of {} in {} ms",
                        self.display.display(),
                        attempt + 1,
                        self.opts.max_retries,
                        sleep.as_millis()
                    );
                    c.retries.fetch_add(1, Ordering::Relaxed);
                    attempt += 1;
                    std::thread::sleep(sleep);
                }
            }
        }
    }

    /// Part `idx`, from the cache or fetched. `at` is the offset a reader
    /// asked for (named in errors).
    fn part(&self, idx: u64, at: u64) -> Result<Bytes> {
        if let Some(what) = self.changed.get() {
            return Err(self.changed_error(what));
        }
        self.parts
            .get_or_fetch(idx, || self.fetch_part(idx))
            .map_err(|(kind, m)| {
                if kind == ErrorKind::Changed {
                    let what = self.changed.get_or_init(|| m.clone());
                    log::error!("{}: {m}", self.display.display());
                    return self.changed_error(what);
                }
                err(kind, m).path(&self.display).at(at)
            })
    }

    fn fetch_part(&self, idx: u64) -> std::result::Result<Bytes, FetchError> {
        let p = self.opts.part_size;
        let start = idx.checked_mul(p).filter(|&s| s < self.pin.size).ok_or((
            ErrorKind::OutOfBounds,
            format!("part {idx} lies outside the object"),
        ))?;
        let end = start.saturating_add(p).min(self.pin.size);
        let want = start..end;
        let what = format!("GET bytes {start}-{}", end - 1);
        let bytes = self.with_retries(&what, |store, loc| {
            let want = want.clone();
            let if_match = self.if_match.clone();
            let pin = &self.pin;
            async move {
                let opts = GetOptions {
                    range: Some(GetRange::Bounded(want.clone())),
                    if_match,
                    ..GetOptions::default()
                };
                let res = store.get_opts(&loc, opts).await.map_err(classify)?;
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
                let body = res.bytes().await.map_err(classify)?;
                let n = want.end - want.start;
                if body.len() as u64 != n {
                    return Err(Attempt::Retry(format!(
                        "truncated body: {} of {n} bytes",
                        body.len()
                    )));
                }
                Ok(body)
            }
        })?;
        self.counters
            .bytes_fetched
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Fill `buf` from `offset` (bounds already checked against the pinned
    /// size by the caller).
    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let p = self.opts.part_size;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let idx = pos / p;
            let part = self.part(idx, pos)?;
            let within = usize::try_from(pos - idx * p).unwrap_or(usize::MAX);
            let avail = part.len().saturating_sub(within);
            if avail == 0 {
                return Err(err(
                    ErrorKind::Truncated,
                    format!("part {idx} ends before byte {pos}"),
                )
                .path(&self.display)
                .at(pos));
            }
            let n = avail.min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&part[within..within + n]);
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_credentials_and_queries() {
        assert_eq!(
            redact("https://user:pw@host:8443/a/b.gguf?X-Amz-Signature=abc#f"),
            "https://host:8443/a/b.gguf"
        );
        assert_eq!(redact("s3://bucket/k/m.rknot"), "s3://bucket/k/m.rknot");
        assert_eq!(redact("http://h"), "http://h");
        assert!(is_remote("HTTP://x/y") && is_remote("s3://b/k") && !is_remote("/tmp/x"));
    }

    #[test]
    fn parses_urls() {
        let (t, l) = parse_url("http://127.0.0.1:80/d/m%20x.gguf").unwrap();
        assert!(
            matches!(t, Target::Http { ref base, allow_http: true } if base == "http://127.0.0.1:80")
        );
        assert_eq!(l.as_ref(), "d/m x.gguf");
        let (t, l) = parse_url("s3://models/q/7b.rknot").unwrap();
        assert!(matches!(t, Target::S3 { ref bucket } if bucket == "models"));
        assert_eq!(l.as_ref(), "q/7b.rknot");
        assert!(
            parse_url("https://h/x?sig=1")
                .unwrap_err()
                .contains("query")
        );
        assert!(
            parse_url("https://u:p@h/x")
                .unwrap_err()
                .contains("credentials")
        );
        assert!(parse_url("https://h/").is_err());
    }

    #[test]
    fn statuses_and_pins() {
        assert_eq!(
            status_in("Server returned non-2xx status code: 503 Service"),
            Some(503)
        );
        let a = Pin {
            etag: Some("\"a\"".into()),
            size: 5,
            last_modified: FileTime { secs: 1, nanos: 0 },
        };
        let mut b = a.clone();
        assert_eq!(pin_changes(&a, &b), None);
        b.etag = Some("\"b\"".into());
        assert_eq!(pin_changes(&a, &b).unwrap(), "etag \"a\" -> \"b\"");
    }
}
