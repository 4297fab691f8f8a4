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
//!   the counters in `ctl` must say how many retries happened (the loop,
//!   shared by both backends, is in `source::fetch`). Definite answers
//!   (401, 403, 404, 412, other 4xx, Range ignored) are not retried.
//! - Runtime: one small multi-thread tokio runtime for the process, created
//!   on first use and driven by `block_on` from the synchronous readers.
//!   [`stop_runtime`](super::stop_runtime) (`source::runtime`) shuts it
//!   down before the mount daemon forks; the next use creates a new one,
//!   and each source rebuilds its client for it.
//!
//! URLs are printed redacted ([`redact`]: no userinfo, no query string, no
//! fragment). URLs with a query string (presigned URLs) are refused for now:
//! the HTTP store cannot carry one.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use sha2::{Digest, Sha256};

use super::SourceVersion;
use super::fetch::{Counters, Pin, retrying, unless_stalled};
use super::lock;
use super::options::RemoteOptions;
use super::options::{read_ca_bundle, show_duration};
use super::part_cache::{PartKey, SourcePartCache, SourcePartCacheStats};
use super::parts::{BlockCache, Claim, FetchError, Lookup, PartStats};
use super::runtime::runtime;
use super::s3::{classify, pin_of, store_get};
use crate::error::{Error, ErrorKind, Result, err};

/// Whether `s` names a remote source (a URL scheme this layer reads).
pub fn is_remote(s: &str) -> bool {
    ["http://", "https://", "s3://"]
        .iter()
        .any(|p| s.len() >= p.len() && s[..p.len()].eq_ignore_ascii_case(p))
}

// What may be printed of a URL; defined with the identity, which needs
// it and nothing else of this module.
pub use super::identity::redact;

// ---------------------------------------------------------------------------
// Where the object is

#[derive(Debug, Clone)]
enum Target {
    /// An `http(s)` URL, used as given (`RemoteFile::url`).
    Http,
    S3 {
        bucket: String,
    },
}

fn parse_url(url: &str) -> std::result::Result<(Target, ObjPath), String> {
    if url.contains('#') {
        return Err("URLs with a fragment (#...) name no object".into());
    }
    let url_path = url.split('?').next().unwrap_or(url);
    if url_path.len() != url.len() && url[..2].eq_ignore_ascii_case("s3") {
        return Err(
            "s3:// URLs take no query string (credentials come from the AWS \
                    environment; a presigned URL is an https:// URL)"
                .into(),
        );
    }
    let url = url_path;
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
        "http" | "https" => Target::Http,
        "s3" => Target::S3 {
            bucket: auth.to_string(),
        },
        _ => return Err(format!("unsupported scheme {scheme}://")),
    };
    Ok((target, location))
}

fn build_store(
    bucket: &str,
    o: &RemoteOptions,
) -> std::result::Result<Arc<dyn ObjectStore>, String> {
    super::s3::s3_store(bucket, o)
}

// ---------------------------------------------------------------------------
// Counters

/// One source's use of the disk cache, and the cache's own state (shared
/// by every mount of the host that names its directory).
#[derive(Debug, Clone)]
pub struct DiskCacheStats {
    pub dir: PathBuf,
    /// Blocks of this source read from the disk cache.
    pub hits: u64,
    /// Blocks of this source not there (fetched, then stored).
    pub misses: u64,
    pub cache: SourcePartCacheStats,
}

/// A snapshot of one remote source's counters, for `ctl`.
#[derive(Debug, Clone)]
pub struct RemoteStats {
    /// The redacted URL.
    pub url: String,
    pub pinned: String,
    pub part_size: u64,
    /// The unit of caching (an eighth of a part).
    pub block_size: u64,
    pub bytes_fetched: u64,
    pub requests: u64,
    pub retries: u64,
    pub failures: u64,
    /// Requests under way now.
    pub in_flight: u64,
    /// Bytes requested by read-ahead (ahead of what a reader asked for).
    pub readahead_bytes: u64,
    /// The memory cache of blocks.
    pub parts: PartStats,
    /// The disk cache (`--source-cache`), if any.
    pub disk: Option<DiskCacheStats>,
    pub changed: bool,
}

// ---------------------------------------------------------------------------
// The source

/// A client for one runtime: reqwest for http(s) (query strings kept), an
/// object_store client for s3.
#[derive(Clone)]
enum Client {
    Http(reqwest::Client),
    Store(Arc<dyn ObjectStore>),
}

/// How many bytes of a remote object one fetch may bring, and in what unit
/// they are cached.
///
/// Requests are of up to `part_size` bytes (8 MiB by default: see
/// [`RemoteOptions::part_size`]); the cache holds blocks of an eighth of
/// that (1 MiB), aligned to the block size, so a reader that touches a few
/// bytes brings one block, not a part, and reading one tensor costs at most
/// its stored bytes plus two blocks (a quarter of a part) beyond them.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    block: u64,
    blocks_per_request: u64,
}

impl Geometry {
    fn of(part_size: u64) -> Geometry {
        let part_size = part_size.max(4096);
        let block = if part_size >= 8 * 4096 {
            (part_size / 8) & !4095
        } else {
            part_size
        };
        Geometry {
            block,
            blocks_per_request: part_size.div_ceil(block),
        }
    }
}

/// Readers that read one stretch of the object in order: each gets a
/// read-ahead window that doubles with every read that continues it (from
/// one part up to [`RemoteOptions::readahead_max`]) and is gone when reads
/// jump. Several streams at once (two tensors read by two processes).
#[derive(Default)]
struct Streams {
    list: Vec<Stream>,
    tick: u64,
}

struct Stream {
    /// Where the next read of this stream is expected.
    next: u64,
    window: u64,
    last_used: u64,
    /// The extent (index) of its last read inside one.
    extent: Option<usize>,
    /// Whether it read one extent to its end and went on into the next
    /// (a reader of the whole file).
    crossed: bool,
}

const MAX_STREAMS: usize = 16;

pub(crate) struct RemoteFile {
    inner: Arc<Inner>,
}

struct Inner {
    /// The redacted URL, as a path (what errors and `ctl` name).
    display: PathBuf,
    /// Which object this is, for caches ([`super::identity`]): the redacted
    /// URL and a digest of everything in the URL that selects the object.
    identity: String,
    /// The URL as given (query string included: a presigned URL's
    /// signature). Never printed.
    url: String,
    /// Where `url` redirected to at open or since (e.g. a Hugging Face
    /// resolve URL's presigned CDN URL): requests go there directly, one
    /// round trip instead of two, until it refuses (expired), when `url`
    /// is asked again. Never printed.
    redirected: Mutex<Option<String>>,
    target: Target,
    location: ObjPath,
    opts: RemoteOptions,
    geometry: Geometry,
    /// The CA bundle's bytes, read once at open.
    ca_pem: Option<Vec<u8>>,
    /// The client, and the runtime generation it was built for.
    client: Mutex<(u64, Client)>,
    pin: Pin,
    /// `If-Match` value: the pinned ETag when it is a strong one.
    if_match: Option<String>,
    version: SourceVersion,
    blocks: Arc<BlockCache>,
    counters: Counters,
    changed: OnceLock<String>,
    /// The persistent cache of blocks (`--source-cache`), shared by every
    /// source of the process that names the same directory.
    disk: Option<Arc<SourcePartCache>>,
    /// Requests started and not finished.
    in_flight: AtomicUsize,
    /// Byte ranges of the object a reader declared it reads as units
    /// (tensors' stored bytes), sorted, disjoint: read-ahead never crosses
    /// the end of the one a read is in, and there is none outside them.
    extents: RwLock<Vec<Range<u64>>>,
    streams: Mutex<Streams>,
}

impl fmt::Debug for RemoteFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteFile")
            .field("url", &self.inner.display)
            .field("pin", &self.inner.pin)
            .finish_non_exhaustive()
    }
}

fn build_client(
    target: &Target,
    opts: &RemoteOptions,
    ca_pem: Option<&[u8]>,
) -> std::result::Result<Client, String> {
    Ok(match target {
        Target::Http => Client::Http(super::http::client(opts, ca_pem)?),
        Target::S3 { bucket } => Client::Store(build_store(bucket, opts)?),
    })
}

impl RemoteFile {
    /// Open `url` and pin its version: over http(s) one ranged GET of the
    /// first block (its response carries the version); over s3 a HEAD,
    /// then the first block. The readers then parse the header from the
    /// block cache; a header longer than a block costs one more request
    /// per block it spans.
    pub(crate) fn open(url: &str, opts: RemoteOptions) -> Result<RemoteFile> {
        let display = PathBuf::from(redact(url));
        let fail = |m: String| err(ErrorKind::Io, m).path(&display);
        let (target, location) = parse_url(url).map_err(fail)?;
        let s3_endpoint = match &target {
            Target::S3 { .. } => super::s3::s3_endpoint(&opts),
            Target::Http => None,
        };
        let identity = super::identity::object_identity(url, s3_endpoint.as_deref());
        let ca_pem = match &opts.ca_bundle {
            Some(p) => Some(read_ca_bundle(p).map_err(fail)?),
            None => None,
        };
        let disk = match &opts.source_cache {
            Some(dir) => Some(shared_disk_cache(dir, opts.source_cache_bytes)?),
            None => None,
        };
        let (rt, generation) = runtime().map_err(fail)?;
        let client = build_client(&target, &opts, ca_pem.as_deref()).map_err(fail)?;
        let geometry = Geometry::of(opts.part_size);
        let counters = Counters::default();
        let mut redirected = None;
        // Opening has a budget of its own, far shorter than a read's: a
        // dead server fails the mount in seconds.
        let budget = opts.open_budget();
        let stall = opts.stall_within(budget);
        let (pin, first) = match &client {
            Client::Http(c) => {
                let r = rt
                    .block_on(retrying(&counters, &opts, &display, "GET", budget, || {
                        super::http::get_first(c, url, geometry.block, stall)
                    }))
                    .map_err(|(k, m)| err(k, m).path(&display))?;
                counters
                    .bytes_fetched
                    .fetch_add(r.body.len() as u64, Ordering::Relaxed);
                redirected = (r.final_url != url).then_some(r.final_url);
                (r.pin, Some(r.body))
            }
            Client::Store(store) => {
                let meta = rt
                    .block_on(retrying(&counters, &opts, &display, "HEAD", budget, || {
                        unless_stalled(stall, "response", async {
                            store.head(&location).await.map_err(classify)
                        })
                    }))
                    .map_err(|(k, m)| err(k, m).path(&display))?;
                (pin_of(&meta), None)
            }
        };
        drop(rt);
        let if_match = pin.etag.clone().filter(|e| !e.starts_with("W/"));
        let blocks = Arc::new(BlockCache::new(opts.cache_bytes));
        let inner = Inner {
            version: synth_version(&identity, &pin),
            identity,
            display,
            url: url.to_string(),
            redirected: Mutex::new(redirected),
            target,
            location,
            geometry,
            ca_pem,
            client: Mutex::new((generation, client)),
            pin,
            if_match,
            blocks,
            counters,
            changed: OnceLock::new(),
            disk,
            in_flight: AtomicUsize::new(0),
            extents: RwLock::new(Vec::new()),
            streams: Mutex::new(Streams::default()),
            opts,
        };
        log::info!(
            "{}: opened remote object, {}",
            inner.display.display(),
            inner.pin
        );
        let f = RemoteFile {
            inner: Arc::new(inner),
        };
        match first {
            Some(body) if !body.is_empty() => {
                for claim in f.inner.blocks.claim_run(0, 1, 1) {
                    claim.complete(Ok(body.clone()));
                }
            }
            Some(_) => {}
            None if f.inner.pin.size > 0 => {
                let mut one = [0u8; 1];
                f.read_at(0, &mut one)?;
            }
            None => {}
        }
        Ok(f)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.inner.display
    }

    /// The object named `name` next to this one: the URL as given with
    /// its last path segment replaced (scheme, host, bucket and query kept:
    /// an `s3://` URL has none), opened with this object's options. A
    /// presigned URL's signature covers its own path only, so a sibling of
    /// one is refused by the server (and named in the error).
    pub(crate) fn open_sibling(&self, name: &str) -> Result<RemoteFile> {
        let url = &self.inner.url;
        let (path, query) = match url.find('?') {
            Some(i) => url.split_at(i),
            None => (url.as_str(), ""),
        };
        let dir = path.rfind('/').map_or(path, |i| &path[..=i]);
        RemoteFile::open(&format!("{dir}{name}{query}"), self.inner.opts.clone())
    }

    pub(crate) fn identity(&self) -> &str {
        &self.inner.identity
    }

    pub(crate) fn version(&self) -> &SourceVersion {
        &self.inner.version
    }

    pub(crate) fn pin(&self) -> &Pin {
        &self.inner.pin
    }

    pub(crate) fn modified(&self) -> Option<SystemTime> {
        let lm = self.inner.pin.last_modified;
        (lm.secs > 0).then(|| {
            SystemTime::UNIX_EPOCH
                + Duration::new(lm.secs.unsigned_abs(), lm.nanos.min(999_999_999))
        })
    }

    pub(crate) fn is_changed(&self) -> bool {
        self.inner.changed.get().is_some()
    }

    pub(crate) fn check_unchanged(&self) -> Result<()> {
        match self.inner.changed.get() {
            Some(what) => Err(self.inner.changed_error(what)),
            None => Ok(()),
        }
    }

    /// Declare the byte ranges readers read as units (each tensor's stored
    /// bytes): sequential read-ahead stays inside the one a read is in.
    pub(crate) fn set_extents(&self, mut ranges: Vec<Range<u64>>) {
        ranges.retain(|r| r.start < r.end);
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start < last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        *self
            .inner
            .extents
            .write()
            .unwrap_or_else(|p| p.into_inner()) = merged;
    }

    pub(crate) fn stats(&self) -> RemoteStats {
        let i = &self.inner;
        let c = &i.counters;
        RemoteStats {
            url: i.display.display().to_string(),
            pinned: i.pin.to_string(),
            part_size: i.opts.part_size,
            block_size: i.geometry.block,
            bytes_fetched: c.bytes_fetched.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            failures: c.failures.load(Ordering::Relaxed),
            in_flight: i.in_flight.load(Ordering::Relaxed) as u64,
            readahead_bytes: c.readahead_bytes.load(Ordering::Relaxed),
            parts: i.blocks.stats(),
            disk: i.disk.as_ref().map(|d| DiskCacheStats {
                dir: d.dir().to_path_buf(),
                hits: c.disk_hits.load(Ordering::Relaxed),
                misses: c.disk_misses.load(Ordering::Relaxed),
                cache: d.stats(),
            }),
            changed: self.is_changed(),
        }
    }

    /// Fill `buf` from `offset` (bounds already checked against the pinned
    /// size by the caller). Every block the read spans is requested at
    /// once (runs of up to a part per request, a bounded number in
    /// flight), plus the read-ahead of a sequential reader; then each is
    /// waited for in order.
    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        let bs = inner.geometry.block;
        let end = offset + buf.len() as u64;
        let first = offset / bs;
        let last = (end - 1) / bs;
        let readahead_end = inner.readahead(offset, end).max(last + 1);
        // One deadline for the whole read, however many blocks it spans.
        let deadline = Instant::now() + inner.opts.deadline;
        let mut issued = first;
        let mut done = 0usize;
        for index in first..=last {
            if let Some(what) = inner.changed.get() {
                return Err(inner.changed_error(what));
            }
            issued = inner.pump(index, issued.max(index), last + 1, readahead_end);
            let block = inner.block(index, offset + done as u64, deadline)?;
            let pos = offset + done as u64;
            let within = usize::try_from(pos - index * bs).unwrap_or(usize::MAX);
            let avail = block.len().saturating_sub(within);
            if avail == 0 {
                return Err(err(
                    ErrorKind::Truncated,
                    format!("block {index} ends before byte {pos}"),
                )
                .path(&inner.display)
                .at(pos));
            }
            let n = avail.min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&block[within..within + n]);
            done += n;
        }
        Ok(())
    }
}

/// Whether a failed request's message is a refusal (401, 403, 404, 410):
/// what an expired presigned URL answers.
fn refused(msg: &str) -> bool {
    ["HTTP 401", "HTTP 403", "HTTP 404", "HTTP 410"]
        .iter()
        .any(|s| msg.contains(s))
}

/// The disk cache at `dir`, one per directory in the process: its size
/// estimate and eviction are shared by every source that uses it.
fn shared_disk_cache(dir: &Path, limit: u64) -> Result<Arc<SourcePartCache>> {
    static CACHES: Mutex<Vec<(PathBuf, Arc<SourcePartCache>)>> = Mutex::new(Vec::new());
    let mut caches = lock(&CACHES);
    if let Some((_, c)) = caches.iter().find(|(d, _)| d == dir) {
        return Ok(c.clone());
    }
    let c = SourcePartCache::open(dir, limit)?;
    caches.push((dir.to_path_buf(), c.clone()));
    Ok(c)
}

/// A [`SourceVersion`] standing for the pinned version: device 0 (no local
/// file has it) and an "inode" hashed from the object's identity (not its
/// redacted URL: two objects may share that) and the pin, so caches keyed
/// by versions tell objects and versions apart.
fn synth_version(identity: &str, pin: &Pin) -> SourceVersion {
    let mut h = Sha256::new();
    h.update((identity.len() as u64).to_le_bytes());
    h.update(identity.as_bytes());
    h.update(pin.to_string().as_bytes());
    let d = h.finalize();
    let mut ino = [0u8; 8];
    ino.copy_from_slice(&d[..8]);
    SourceVersion {
        dev: 0,
        ino: u64::from_le_bytes(ino),
        size: pin.size,
        mtime: pin.last_modified,
        ctime: pin.last_modified,
    }
}

impl Inner {
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

    /// The client for the current runtime (rebuilt after [`stop_runtime`]:
    /// a client's pooled connections belong to the runtime that made them).
    fn client(&self) -> std::result::Result<(Arc<tokio::runtime::Runtime>, Client), String> {
        let (rt, generation) = runtime()?;
        let mut c = lock(&self.client);
        if c.0 != generation {
            *c = (
                generation,
                build_client(&self.target, &self.opts, self.ca_pem.as_deref())?,
            );
        }
        Ok((rt, c.1.clone()))
    }

    /// The end (a block index, exclusive) of the read-ahead for a read of
    /// `[offset, end)`: nothing for a read that continues no stream, or
    /// that lies outside every declared extent; else the stream's window,
    /// inside the extent the read ends in.
    fn readahead(&self, offset: u64, end: u64) -> u64 {
        let bs = self.geometry.block;
        let part = bs * self.geometry.blocks_per_request;
        let max = self
            .opts
            .readahead_max
            .min(self.opts.cache_bytes / 4)
            .max(part);
        let extents = self.extents.read().unwrap_or_else(|p| p.into_inner());
        let extent = {
            let i = extents.partition_point(|r| r.end < end);
            extents.get(i).filter(|r| r.start < end).map(|r| (i, r.end))
        };
        let (window, crossed) = {
            let mut st = lock(&self.streams);
            st.tick += 1;
            let tick = st.tick;
            // A read continues a stream if it starts within a part of where
            // the stream's next read was expected (FUSE and the kernel's own
            // read-ahead deliver a sequential reader's reads a little out of
            // order).
            let found = st
                .list
                .iter_mut()
                .find(|s| offset + part >= s.next && offset <= s.next + part);
            match found {
                Some(s) => {
                    // Crossed: it read its extent to (near) the end and now
                    // reads the start of the next one, as a reader of the
                    // whole file does; not a reader of a few nearby tensors.
                    if let (Some(was), Some((now, _))) = (s.extent, extent)
                        && now == was + 1
                        && let (Some(prev), Some(cur)) = (extents.get(was), extents.get(now))
                        && s.next + bs >= prev.end
                        && offset <= cur.start + bs
                    {
                        s.crossed = true;
                    }
                    s.window = (s.window * 2).clamp(part, max);
                    s.next = s.next.max(end);
                    s.last_used = tick;
                    s.extent = extent.map(|e| e.0).or(s.extent);
                    (s.window, s.crossed)
                }
                None => {
                    let fresh = Stream {
                        next: end,
                        window: 0,
                        last_used: tick,
                        extent: extent.map(|e| e.0),
                        crossed: false,
                    };
                    if st.list.len() < MAX_STREAMS {
                        st.list.push(fresh);
                    } else if let Some(oldest) = st.list.iter_mut().min_by_key(|s| s.last_used) {
                        *oldest = fresh;
                    }
                    (0, false)
                }
            }
        };
        drop(extents);
        let last_block = (end - 1) / bs + 1;
        if window == 0 {
            return last_block;
        }
        let Some((_, extent_end)) = extent else {
            return last_block;
        };
        // A stream that went on from one tensor into the next reads the
        // file whole (cat of a view, an engine loading the model): its
        // read-ahead runs on across tensors, with no stall at each one's
        // end. One that has not stays inside its tensor.
        let limit = if crossed { self.pin.size } else { extent_end };
        let stop = (end.saturating_add(window)).min(limit).min(self.pin.size);
        stop.div_ceil(bs).max(last_block)
    }

    /// Start fetches of the blocks from `from` on, up to `readahead_end`
    /// (exclusive), in runs of up to a part, while fewer than
    /// `max_in_flight` requests are under way; block `current` (the one the
    /// reader waits for next) is always started. Returns the first block
    /// not looked at.
    fn pump(self: &Arc<Self>, current: u64, from: u64, demand_end: u64, readahead_end: u64) -> u64 {
        let bpr = self.geometry.blocks_per_request;
        let max = self.opts.max_in_flight.max(1);
        let mut index = from;
        while index < readahead_end {
            let busy = self.in_flight.load(Ordering::Relaxed) >= max;
            if busy && index > current {
                break;
            }
            let claims = self.blocks.claim_run(index, readahead_end, bpr);
            if claims.is_empty() {
                index += 1;
                continue;
            }
            index += claims.len() as u64;
            if index > demand_end {
                let ahead = (index - demand_end.max(claims[0].index)) * self.geometry.block;
                self.counters
                    .readahead_bytes
                    .fetch_add(ahead, Ordering::Relaxed);
            }
            self.spawn_fetch(claims);
        }
        index
    }

    /// Fetch the claimed run of blocks on the runtime; the claims are
    /// completed (bytes or error) whatever happens.
    fn spawn_fetch(self: &Arc<Self>, claims: Vec<Claim>) {
        let (rt, client) = match self.client() {
            Ok(c) => c,
            Err(m) => {
                for c in claims {
                    c.complete(Err((ErrorKind::Io, m.clone())));
                }
                return;
            }
        };
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let inner = self.clone();
        rt.spawn(async move {
            inner.fetch_run(client, claims).await;
            inner.in_flight.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// The disk cache's key of block `index` of the pinned version: the
    /// object's identity and the pin (never credentials).
    fn disk_key<'a>(&'a self, version: &'a str, index: u64) -> PartKey<'a> {
        PartKey {
            object: &self.identity,
            version,
            part_size: self.geometry.block,
            index,
        }
    }

    /// The length of block `index` (the last one may be short).
    fn block_len(&self, index: u64) -> u64 {
        let bs = self.geometry.block;
        self.pin.size.saturating_sub(index * bs).min(bs)
    }

    /// Bring a claimed run of blocks: those in the disk cache from there
    /// (checked), the rest by one request per contiguous stretch.
    async fn fetch_run(&self, client: Client, claims: Vec<Claim>) {
        let version = self.pin.to_string();
        let mut missing: Vec<Claim> = Vec::with_capacity(claims.len());
        for c in claims {
            let from_disk = self.disk.as_ref().and_then(|d| {
                let len = usize::try_from(self.block_len(c.index)).ok()?;
                d.get(&self.disk_key(&version, c.index), len)
            });
            match from_disk {
                Some(bytes) => {
                    self.counters.disk_hits.fetch_add(1, Ordering::Relaxed);
                    c.complete(Ok(bytes));
                }
                None => {
                    if self.disk.is_some() {
                        self.counters.disk_misses.fetch_add(1, Ordering::Relaxed);
                    }
                    missing.push(c);
                }
            }
        }
        while !missing.is_empty() {
            let stretch = missing
                .windows(2)
                .position(|w| w[1].index != w[0].index + 1)
                .map_or(missing.len(), |i| i + 1);
            let rest = missing.split_off(stretch);
            self.fetch_stretch(&client, missing, &version).await;
            missing = rest;
        }
    }

    /// One request for contiguous claimed blocks; the blocks go to the
    /// waiters, the memory cache and the disk cache.
    async fn fetch_stretch(&self, client: &Client, claims: Vec<Claim>, version: &str) {
        let (Some(first), Some(last)) = (claims.first(), claims.last()) else {
            return;
        };
        let bs = self.geometry.block;
        let start = first.index * bs;
        let end = ((last.index + 1) * bs).min(self.pin.size);
        let result = if start >= end {
            Err((
                ErrorKind::OutOfBounds,
                format!("block {} lies outside the object", first.index),
            ))
        } else {
            self.get(client, start..end).await
        };
        match result {
            Ok(blocks) => {
                let n: u64 = blocks.iter().map(|b| b.len() as u64).sum();
                self.counters.bytes_fetched.fetch_add(n, Ordering::Relaxed);
                let mut blocks = blocks.into_iter();
                for c in claims {
                    let Some(block) = blocks.next() else {
                        c.complete(Err((ErrorKind::Truncated, "short response".into())));
                        continue;
                    };
                    if let Some(d) = &self.disk {
                        d.put(&self.disk_key(version, c.index), &block);
                    }
                    c.complete(Ok(block));
                }
            }
            Err((kind, m)) => {
                if kind == ErrorKind::Changed && self.changed.set(m.clone()).is_ok() {
                    log::error!("{}: {m}", self.display.display());
                }
                for c in claims {
                    c.complete(Err((kind, m.clone())));
                }
            }
        }
    }

    /// Bytes `want` of the pinned version, in blocks, with retries.
    async fn get(
        &self,
        client: &Client,
        want: Range<u64>,
    ) -> std::result::Result<Vec<Bytes>, FetchError> {
        let block = self.geometry.block;
        let what = format!("GET bytes {}-{}", want.start, want.end - 1);
        let if_match = self.if_match.as_deref();
        let started = std::time::Instant::now();
        let budget = self.opts.deadline;
        let stall = self.opts.stall_within(budget);
        match client {
            Client::Http(c) => {
                let target = lock(&self.redirected).clone();
                let url = target.as_deref().unwrap_or(&self.url);
                let r = retrying(
                    &self.counters,
                    &self.opts,
                    &self.display,
                    &what,
                    budget,
                    || {
                        super::http::get_range(
                            c,
                            url,
                            want.clone(),
                            block,
                            &self.pin,
                            if_match,
                            stall,
                        )
                    },
                )
                .await;
                let r = match r {
                    // The redirect target refuses: a presigned CDN URL that
                    // expired. Ask the URL as given again (it redirects
                    // afresh; reqwest follows), and go there from now on,
                    // within what is left of the deadline.
                    Err((ErrorKind::Io, m)) if target.is_some() && refused(&m) => {
                        log::info!(
                            "{}: the URL it redirected to refuses ({m}); asking it again",
                            self.display.display()
                        );
                        *lock(&self.redirected) = None;
                        let left = budget.saturating_sub(started.elapsed());
                        retrying(
                            &self.counters,
                            &self.opts,
                            &self.display,
                            &what,
                            left,
                            || {
                                super::http::get_range(
                                    c,
                                    &self.url,
                                    want.clone(),
                                    block,
                                    &self.pin,
                                    if_match,
                                    stall,
                                )
                            },
                        )
                        .await
                    }
                    r => r,
                };
                r.map(|(blocks, answered)| {
                    if answered != self.url {
                        *lock(&self.redirected) = Some(answered);
                    }
                    blocks
                })
            }
            Client::Store(s) => {
                retrying(
                    &self.counters,
                    &self.opts,
                    &self.display,
                    &what,
                    budget,
                    || {
                        store_get(
                            s.as_ref(),
                            &self.location,
                            want.clone(),
                            block,
                            &self.pin,
                            self.if_match.clone(),
                            stall,
                        )
                    },
                )
                .await
            }
        }
    }

    /// Block `index`, from memory, from a fetch under way, or fetched now,
    /// waiting until `deadline` at most (the fetch has a deadline of its
    /// own; this one bounds the reader's wait whoever started the fetch).
    /// `at` is the offset a reader asked for (named in errors).
    fn block(self: &Arc<Self>, index: u64, at: u64, deadline: Instant) -> Result<Bytes> {
        let mut joined = false;
        let result = loop {
            match self.blocks.lookup(index) {
                Lookup::Hit(b) => break Some(Ok(b)),
                Lookup::InFlight(f) => {
                    let r = f.wait_until(deadline);
                    // Someone else's fetch (read-ahead, another reader, one
                    // that began before the server came back) failed: with
                    // time left, this reader asks once itself.
                    let failed = matches!(&r, Some(Err((k, _))) if *k != ErrorKind::Changed);
                    if failed && !joined && Instant::now() < deadline {
                        joined = true;
                        continue;
                    }
                    break r;
                }
                Lookup::Absent => {
                    // Its fetch failed between `pump` and here (errors are
                    // not cached): fetch it again, once, for this reader.
                    let claims = self.blocks.claim_run(index, index + 1, 1);
                    let Some(flight) = claims.first().map(Claim::flight) else {
                        continue;
                    };
                    self.spawn_fetch(claims);
                    break flight.wait_until(deadline);
                }
            }
        };
        let result = result.unwrap_or_else(|| {
            let bs = self.geometry.block;
            let start = index * bs;
            let end = (start + bs).min(self.pin.size);
            Err((
                ErrorKind::Io,
                format!(
                    "GET bytes {start}-{}: no answer within the {} deadline",
                    end.saturating_sub(1),
                    show_duration(self.opts.deadline)
                ),
            ))
        });
        result.map_err(|(kind, m)| {
            if kind == ErrorKind::Changed {
                let what = self.changed.get_or_init(|| m.clone());
                return self.changed_error(what);
            }
            err(kind, m).path(&self.display).at(at)
        })
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
        assert!(matches!(t, Target::Http));
        assert_eq!(l.as_ref(), "d/m x.gguf");
        let (t, l) = parse_url("s3://models/q/7b.rknot").unwrap();
        assert!(matches!(t, Target::S3 { ref bucket } if bucket == "models"));
        assert_eq!(l.as_ref(), "q/7b.rknot");
        // Presigned https URLs keep their query (in requests only); s3://
        // URLs take none.
        assert!(parse_url("https://h/x?sig=1").is_ok());
        assert!(parse_url("s3://b/x?sig=1").unwrap_err().contains("query"));
        assert!(parse_url("https://h/x#f").is_err());
        assert!(
            parse_url("https://u:p@h/x")
                .unwrap_err()
                .contains("credentials")
        );
        assert!(parse_url("https://h/").is_err());
    }
}
