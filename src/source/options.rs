//! How remote sources fetch and cache: [`RemoteOptions`] (from the flags or
//! the environment), the deadlines every fetch runs under, and the CA
//! bundle every client trusts. Used by the fetch backends (`http`, `s3`),
//! the remote source (`remote`) and uploads alike.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::lock;

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
    /// The longest one fetch of remote data may take, every attempt and
    /// backoff included (`--remote-deadline`): past it the read fails with
    /// EIO. Bounds how long a reader (and the FUSE request it serves) waits
    /// on a server that stalls or never answers.
    pub deadline: Duration,
    /// The longest opening may take (the first GET, or the HEAD), every
    /// attempt included: at most [`RemoteOptions::deadline`]. Short, so
    /// that a mount against a dead server fails in seconds.
    pub open_deadline: Duration,
    /// An attempt that receives nothing for this long (no response head,
    /// or a body that stops) is abandoned and retried within the deadline:
    /// at most half the deadline it runs under, so that one retry fits.
    pub stall_timeout: Duration,
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
            deadline: Duration::from_secs(30),
            open_deadline: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(10),
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
    /// `RKNOT_REMOTE_BACKOFF_MS`, `RKNOT_REMOTE_TIMEOUT_S`,
    /// `RKNOT_REMOTE_DEADLINE_S`, `RKNOT_REMOTE_OPEN_DEADLINE_S`,
    /// `RKNOT_REMOTE_STALL_S` (seconds, fractions allowed),
    /// `RKNOT_SOURCE_CACHE` (a directory) and `RKNOT_SOURCE_CACHE_BYTES`.
    /// Unparsable values are ignored.
    pub fn from_env() -> RemoteOptions {
        let num = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let secs = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .filter(|d| !d.is_zero() && *d <= MAX_DEADLINE)
        };
        let d = RemoteOptions::default();
        RemoteOptions {
            deadline: secs("RKNOT_REMOTE_DEADLINE_S").unwrap_or(d.deadline),
            open_deadline: secs("RKNOT_REMOTE_OPEN_DEADLINE_S").unwrap_or(d.open_deadline),
            stall_timeout: secs("RKNOT_REMOTE_STALL_S").unwrap_or(d.stall_timeout),
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
            source_cache: std::env::var_os("RKNOT_SOURCE_CACHE")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            source_cache_bytes: num("RKNOT_SOURCE_CACHE_BYTES")
                .filter(|&n| n > 0)
                .unwrap_or(d.source_cache_bytes),
            ..d
        }
    }
}

/// The longest deadline accepted (`--remote-deadline`, the environment).
pub const MAX_DEADLINE: Duration = Duration::from_secs(3600);

impl RemoteOptions {
    /// The budget of opening: the open deadline, within the read deadline.
    pub(crate) fn open_budget(&self) -> Duration {
        self.open_deadline.min(self.deadline)
    }

    /// How long an attempt under a budget of `budget` may receive nothing
    /// before it is abandoned: the stall timeout, at most half the budget.
    pub(crate) fn stall_within(&self, budget: Duration) -> Duration {
        self.stall_timeout
            .min(budget / 2)
            .max(Duration::from_millis(10))
    }
}

/// `d` as people read it: "30 s", "2.5 s", "150 ms".
pub(crate) fn show_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// The bytes of a CA bundle (`--ca-bundle`), for every client (http(s),
/// s3, uploads): at most 16 MiB (a bundle of every public CA is ~250 KB)
/// and at least one PEM certificate, else an error naming the file.
pub(crate) fn read_ca_bundle(path: &Path) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    let shown = crate::text::escape(&path.to_string_lossy()).to_string();
    let mut pem = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(16 << 20).read_to_end(&mut pem))
        .map_err(|e| format!("CA bundle {shown}: {e}"))?;
    match reqwest::Certificate::from_pem_bundle(&pem) {
        Ok(certs) if !certs.is_empty() => Ok(pem),
        Ok(_) => Err(format!(
            "CA bundle {shown}: no certificate in it (expected PEM: -----BEGIN CERTIFICATE-----)"
        )),
        Err(e) => Err(format!(
            "CA bundle {shown}: not a PEM bundle of certificates: {e}"
        )),
    }
}
