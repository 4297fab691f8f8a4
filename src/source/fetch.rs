//! What the fetch backends of a remote source share (`http` over reqwest,
//! `s3` over object_store; `remote` drives them): the pinned version and
//! how an answer is compared with it, the outcome of one attempt, the retry
//! loop and its deadline, stall detection, and the cutting of a body into
//! the cache's blocks. It uses no backend, so each backend and the source
//! above them use it, never the other way round.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::FileTime;
use super::options::{RemoteOptions, show_duration};
use super::parts::FetchError;
use crate::error::ErrorKind;

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

/// What differs between the pinned version and what a response says; None
/// when it is the same version.
pub(crate) fn pin_changes(pin: &Pin, now: &Pin) -> Option<String> {
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

#[derive(Default)]
pub(super) struct Counters {
    pub(super) bytes_fetched: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) retries: AtomicU64,
    pub(super) failures: AtomicU64,
    pub(super) readahead_bytes: AtomicU64,
    pub(super) disk_hits: AtomicU64,
    pub(super) disk_misses: AtomicU64,
}

/// One request's failure: a definite answer, or one worth retrying.
pub(crate) enum Attempt {
    Final(ErrorKind, String),
    Retry(String),
}

pub(crate) const RANGE_IGNORED: &str = "the server ignored the Range header (it answered 200 with the \
    whole object instead of 206 with the bytes asked for): refused, since every read would \
    download the whole object; serve it from a server that supports ranged GETs";

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

/// Run one request (`what` names it in errors) with bounded retries,
/// backoff and jitter, counting requests, retries and failures, all of it
/// within `budget`: an attempt still under way when the budget runs out is
/// abandoned, and no retry starts that its backoff would push past it.
pub(super) async fn retrying<T, F, Fut>(
    counters: &Counters,
    opts: &RemoteOptions,
    display: &Path,
    what: &str,
    budget: Duration,
    op: F,
) -> std::result::Result<T, FetchError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = std::result::Result<T, Attempt>>,
{
    let deadline = tokio::time::Instant::now() + budget;
    let mut attempt = 0u32;
    let mut last: Option<String> = None;
    loop {
        counters.requests.fetch_add(1, Ordering::Relaxed);
        let outcome = match tokio::time::timeout_at(deadline, op()).await {
            Ok(outcome) => outcome,
            Err(_) => {
                counters.failures.fetch_add(1, Ordering::Relaxed);
                let before = last.map_or(String::new(), |m| format!("; before: {m}"));
                return Err((
                    ErrorKind::Io,
                    format!(
                        "{what}: no complete answer within the {} deadline, {} attempt(s){before}",
                        show_duration(budget),
                        attempt + 1
                    ),
                ));
            }
        };
        match outcome {
            Ok(v) => return Ok(v),
            Err(Attempt::Final(kind, m)) => {
                counters.failures.fetch_add(1, Ordering::Relaxed);
                return Err((kind, format!("{what}: {m}")));
            }
            Err(Attempt::Retry(m)) if attempt >= opts.max_retries => {
                counters.failures.fetch_add(1, Ordering::Relaxed);
                return Err((
                    ErrorKind::Io,
                    format!("{what}: {m} (gave up after {attempt} retries)"),
                ));
            }
            Err(Attempt::Retry(m)) => {
                let exp = opts
                    .backoff
                    .saturating_mul(1u32 << attempt.min(16))
                    .min(Duration::from_secs(5));
                // Equal jitter: half fixed, half random.
                let sleep = exp / 2 + exp.mul_f64(jitter() / 2.0);
                if tokio::time::Instant::now() + sleep >= deadline {
                    counters.failures.fetch_add(1, Ordering::Relaxed);
                    return Err((
                        ErrorKind::Io,
                        format!(
                            "{what}: {m} (gave up after {attempt} retries: the {} deadline \
                             leaves no time for another)",
                            show_duration(budget)
                        ),
                    ));
                }
                crate::logging::throttled!(
                    log::Level::Warn,
                    &format!("retries of {}", display.display()),
                    "{}: {what}: {m}; retry {} of {} in {} ms",
                    display.display(),
                    attempt + 1,
                    opts.max_retries,
                    sleep.as_millis()
                );
                counters.retries.fetch_add(1, Ordering::Relaxed);
                attempt += 1;
                last = Some(m);
                tokio::time::sleep(sleep).await;
            }
        }
    }
}

/// `fut`, abandoned (a retry) when it gives nothing for `stall`.
pub(crate) async fn unless_stalled<T>(
    stall: Duration,
    waiting_for: &str,
    fut: impl Future<Output = std::result::Result<T, Attempt>>,
) -> std::result::Result<T, Attempt> {
    match tokio::time::timeout(stall, fut).await {
        Ok(r) => r,
        Err(_) => Err(Attempt::Retry(format!(
            "stalled: no {waiting_for} for {}",
            show_duration(stall)
        ))),
    }
}

/// Cuts a response body into blocks of the cache's size as it arrives:
/// each block its own allocation (so the memory cache's byte count is what
/// it holds, whichever blocks it evicts), one copy of every byte in all.
pub(crate) struct BlockSplitter {
    block: usize,
    expect: u64,
    got: u64,
    current: bytes::BytesMut,
    done: Vec<Bytes>,
}

impl BlockSplitter {
    pub(crate) fn new(block: u64, expect: u64) -> BlockSplitter {
        let block = usize::try_from(block).unwrap_or(usize::MAX).max(1);
        BlockSplitter {
            block,
            expect,
            got: 0,
            current: bytes::BytesMut::new(),
            done: Vec::new(),
        }
    }

    /// Take the next piece of the body; more bytes than asked for is an
    /// error (never trusted, never stored).
    pub(crate) fn push(&mut self, mut chunk: &[u8]) -> Result<(), Attempt> {
        self.got += chunk.len() as u64;
        if self.got > self.expect {
            return Err(Attempt::Final(
                ErrorKind::Io,
                format!(
                    "the body is longer than the {} bytes asked for",
                    self.expect
                ),
            ));
        }
        while !chunk.is_empty() {
            if self.current.is_empty() {
                let left = self.expect - (self.got - chunk.len() as u64);
                let cap = (self.block as u64).min(left);
                self.current
                    .reserve(usize::try_from(cap).unwrap_or(self.block));
            }
            let n = (self.block - self.current.len()).min(chunk.len());
            self.current.extend_from_slice(&chunk[..n]);
            chunk = &chunk[n..];
            if self.current.len() == self.block {
                self.done.push(std::mem::take(&mut self.current).freeze());
            }
        }
        Ok(())
    }

    /// The blocks, once the body is complete; a short body is retried.
    pub(crate) fn finish(mut self) -> Result<Vec<Bytes>, Attempt> {
        if self.got != self.expect {
            return Err(Attempt::Retry(format!(
                "truncated body: {} of {} bytes",
                self.got, self.expect
            )));
        }
        if !self.current.is_empty() {
            self.done.push(self.current.freeze());
        }
        Ok(self.done)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn retries_end_at_the_deadline() {
        let (rt, _) = super::super::runtime::runtime().unwrap();
        let opts = RemoteOptions {
            max_retries: 100,
            backoff: Duration::from_millis(20),
            ..RemoteOptions::default()
        };
        let c = Counters::default();
        let shown = Path::new("http://h/m");
        // An attempt that never completes: abandoned at the deadline.
        let t = Instant::now();
        let r: std::result::Result<(), _> = rt.block_on(retrying(
            &c,
            &opts,
            shown,
            "GET bytes 0-9",
            Duration::from_millis(150),
            std::future::pending,
        ));
        let (kind, m) = r.unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert_eq!(kind, ErrorKind::Io);
        assert!(
            m.contains("GET bytes 0-9") && m.contains("150 ms deadline"),
            "{m}"
        );
        // Attempts that keep failing: no retry starts past the deadline,
        // however many are allowed.
        let t = Instant::now();
        let r: std::result::Result<(), _> = rt.block_on(retrying(
            &c,
            &opts,
            shown,
            "GET",
            Duration::from_millis(300),
            || async { Err(Attempt::Retry("HTTP 503".into())) },
        ));
        let (_, m) = r.unwrap_err();
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert!(m.contains("HTTP 503") && m.contains("deadline"), "{m}");
        assert!(c.retries.load(Ordering::Relaxed) < 100);
        // A stalled attempt is abandoned as a retry.
        let r: std::result::Result<(), Attempt> = rt.block_on(unless_stalled(
            Duration::from_millis(20),
            "bytes of the body",
            std::future::pending(),
        ));
        assert!(
            matches!(r, Err(Attempt::Retry(m)) if m.contains("no bytes of the body for 20 ms"))
        );
    }

    #[test]
    fn pins() {
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
