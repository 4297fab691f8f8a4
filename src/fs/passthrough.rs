//! Opens served from the decoded-file store (`--decoded-cache DIR`): the
//! first open of a tensor file or model view decodes the whole file into
//! the store ([`crate::cache::store`]); the FUSE adapter then answers that
//! open, and every later one, with passthrough to the stored file, so the
//! kernel reads (and maps) it directly and no read reaches the daemon.
//!
//! - **Keys.** An entry is keyed by every source file's identity and data
//!   version (path, device, inode, size, mtime: what the read path checks,
//!   [`crate::source::SourceVersion::same_data`]), what the file is (tensor
//!   and element format, or the view with the CRC-32 and size of its
//!   header, which fixes its layout) and the build of rknot that decoded
//!   it. At mount, entries of another version of the same source files are
//!   removed.
//! - **Decoding** streams the file in pieces of at most [`RENDER_BYTES`]:
//!   all cores decode pieces in parallel and write them at their offsets,
//!   bypassing the decoded-chunk cache (a full decode must not evict what
//!   readers use). One file decodes at a time; its memory is cores × a
//!   piece in f32 and in the output format, at most half the decoded-chunk
//!   cache's budget (`--cache-mb`). Each piece's CRC-32 is combined in
//!   order into the entry's checksum.
//! - **When passthrough is not possible** (no FUSE_PASSTHROUGH from the
//!   kernel, no CAP_SYS_ADMIN, `--no-passthrough`, the registration of a
//!   backing file refused), the mount serves files as it does without a
//!   store, and says so once; a file that cannot be stored (no room, a
//!   decode error) is served that way too, with one log line.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::json;

use super::TensorFs;
use super::namespace::Node;
use super::views::{self, ElemFormat, Piece};
use crate::cache::lock;
use crate::cache::store::{DecodedStore, Entry, EntryKey, Found, SourceId};

use crate::error::Result;

/// Largest piece of a file decoded by one worker at a time (in f32; the
/// f16/bf16 output is half of it). Lowered so that every worker's pieces
/// fit in half the decoded-chunk cache's budget (`--cache-mb`).
pub const RENDER_BYTES: u64 = 4 << 20;

/// Smallest piece: below it, per-piece overhead dominates.
const MIN_RENDER_BYTES: u64 = 64 << 10;

/// Why passthrough is off when the command line said so.
const NO_PASSTHROUGH: &str = "--no-passthrough";

/// The decoded-file store of a mount and whether opens may use it.
pub struct Decoded {
    pub store: Arc<DecodedStore>,
    /// Source identities, computed once (keys of every entry).
    sources: Vec<SourceId>,
    /// Passthrough allowed (cleared once when found impossible).
    enabled: AtomicBool,
    /// Why passthrough is off, when it is.
    off_reason: Mutex<Option<String>>,
    /// Opens answered with passthrough / served by the daemon instead.
    pub(super) passthrough_opens: AtomicU64,
    pub(super) plain_opens: AtomicU64,
    /// Backing files registered with the kernel now.
    pub(super) backing_open: AtomicUsize,
    /// One file decodes at a time (on every core): the memory of decodes
    /// stays that of one, however many first opens run at once.
    render: Mutex<()>,
    /// Entries of this mount's sources not yet checked by the background
    /// check that starts at mount.
    prechecks_pending: Arc<AtomicU64>,
}

impl std::fmt::Debug for Decoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Decoded({})", self.store.dir().display())
    }
}

/// The `--decoded-cache` settings of a mount, with the store opened.
#[derive(Debug, Clone)]
pub struct DecodedSetup {
    pub store: Arc<DecodedStore>,
    /// False: `--no-passthrough` (serve as without a store).
    pub passthrough: bool,
}

/// Whether this process has CAP_SYS_ADMIN in its effective set (None when
/// `/proc/self/status` does not say). The kernel requires it to register a
/// passthrough backing file (FUSE_DEV_IOC_BACKING_OPEN), and mount(2).
pub fn cap_sys_admin() -> Option<bool> {
    const CAP_SYS_ADMIN: u32 = 21;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .map(|caps| caps & (1 << CAP_SYS_ADMIN) != 0)
}

impl Decoded {
    pub(super) fn new(setup: &DecodedSetup, sources: Vec<SourceId>) -> Decoded {
        let d = Decoded {
            store: setup.store.clone(),
            sources,
            enabled: AtomicBool::new(true),
            off_reason: Mutex::new(None),
            passthrough_opens: AtomicU64::new(0),
            plain_opens: AtomicU64::new(0),
            backing_open: AtomicUsize::new(0),
            render: Mutex::new(()),
            prechecks_pending: Arc::new(AtomicU64::new(0)),
        };
        d.store.remove_stale_temporaries();
        let removed = d.store.evict_changed(&d.sources);
        if removed > 0 {
            log::info!(
                "decoded cache: removed {removed} entries of an older version of the sources"
            );
        }
        if !setup.passthrough {
            // Asked for: not something to warn about.
            d.turn_off(NO_PASSTHROUGH, log::Level::Info);
        } else if cap_sys_admin() != Some(true) {
            d.disable(
                "the daemon lacks CAP_SYS_ADMIN, which registering a passthrough backing \
                 file needs (run it as root)",
            );
        }
        // Entries are read whole to be checked: only worth it when they
        // can be served.
        if d.enabled() {
            d.start_prechecks();
        }
        d
    }

    /// Check this mount's entries (those decoded from exactly its sources
    /// by this build) on a thread of their own, so that a first open finds
    /// its entry checked and answers at once. An open that comes first
    /// waits for its entry's check (or does it itself): either way an
    /// entry is checked before its first use in this mount.
    fn start_prechecks(&self) {
        let stems = self.store.entries_of(&self.sources);
        if stems.is_empty() {
            return;
        }
        self.prechecks_pending
            .store(stems.len() as u64, Ordering::Relaxed);
        let (store, pending) = (self.store.clone(), self.prechecks_pending.clone());
        let spawned = std::thread::Builder::new()
            .name("rknot-store-check".into())
            .spawn(move || {
                let t = Instant::now();
                let n = stems.len();
                for stem in stems {
                    store.precheck(&stem);
                    pending.fetch_sub(1, Ordering::Relaxed);
                }
                log::info!(
                    "decoded cache: {n} entries of this mount's sources checked in {:.2} s",
                    t.elapsed().as_secs_f64()
                );
            });
        if let Err(e) = spawned {
            // Opens check their entries themselves.
            self.prechecks_pending.store(0, Ordering::Relaxed);
            log::warn!("decoded cache: cannot start the background check: {e}");
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turn passthrough off for the rest of the mount (files already
    /// served by it stay so until closed), with one log line.
    pub fn disable(&self, why: &str) {
        self.turn_off(why, log::Level::Warn);
    }

    /// [`Self::disable`], logging at `level`.
    fn turn_off(&self, why: &str, level: log::Level) {
        let mut r = lock(&self.off_reason);
        if r.is_none() {
            log::log!(
                level,
                "decoded cache: FUSE passthrough is off ({why}); files are served by the daemon \
                 as without --decoded-cache"
            );
            *r = Some(why.to_string());
        }
        self.enabled.store(false, Ordering::Relaxed);
    }

    pub fn off_reason(&self) -> Option<String> {
        lock(&self.off_reason).clone()
    }

    /// `ctl`'s lines about the store.
    pub(super) fn status_text(&self) -> String {
        let s = self.store.stats();
        let mode = match self.off_reason() {
            None => "on".to_string(),
            Some(why) => format!("off ({})", crate::text::Escaped(&why)),
        };
        format!(
            "decoded:   {}: {} entries, {} B of {} B; passthrough {mode}\n\
             decoded:   hits {}, misses {}, evictions {}, built {} ({} B in {:.2} s), build failures {}, too large {}\n\
             decoded:   checked {} ({} B in {:.2} s), waiting for the check at mount {}, bad entries rebuilt {}\n\
             decoded:   opens by passthrough {} ({} backing files open), opens served by the daemon {}\n",
            crate::text::Escaped(&self.store.dir().display().to_string()),
            s.entries,
            s.bytes,
            s.limit,
            s.hits,
            s.misses,
            s.evictions,
            s.builds,
            s.bytes_built,
            s.build_secs,
            s.build_failures,
            s.too_large,
            s.checks,
            s.bytes_checked,
            s.check_secs,
            self.prechecks_pending.load(Ordering::Relaxed),
            s.corrupt,
            self.passthrough_opens.load(Ordering::Relaxed),
            self.backing_open.load(Ordering::Relaxed),
            self.plain_opens.load(Ordering::Relaxed),
        )
    }

    /// `ctl.json`'s `decoded_cache`.
    pub(super) fn status_json(&self) -> serde_json::Value {
        let s = self.store.stats();
        json!({
            "dir": self.store.dir().display().to_string(),
            "passthrough": self.enabled(),
            "passthrough_off_reason": self.off_reason(),
            "entries": s.entries, "bytes": s.bytes, "limit": s.limit,
            "hits": s.hits, "misses": s.misses, "evictions": s.evictions,
            "builds": s.builds, "bytes_built": s.bytes_built, "build_secs": s.build_secs,
            "build_failures": s.build_failures, "too_large": s.too_large,
            "checks": s.checks, "bytes_checked": s.bytes_checked, "check_secs": s.check_secs,
            "checks_pending": self.prechecks_pending.load(Ordering::Relaxed),
            "bad_entries": s.corrupt,
            "passthrough_opens": self.passthrough_opens.load(Ordering::Relaxed),
            "backing_files_open": self.backing_open.load(Ordering::Relaxed),
            "daemon_opens": self.plain_opens.load(Ordering::Relaxed),
        })
    }
}

/// The source files of a backend as store identities.
pub(super) fn source_ids(b: &dyn crate::backend::Backend) -> Vec<SourceId> {
    b.source_files()
        .iter()
        .map(|s| SourceId {
            path: s.cache_identity(),
            version: *s.version(),
        })
        .collect()
}

/// One piece of a file to decode: where it goes, what it is.
enum Work {
    Header(std::ops::Range<usize>),
    Zeros(u64),
    /// Elements `[e0, e1)` of tensor file `f`.
    Tensor {
        f: usize,
        e0: u64,
        e1: u64,
    },
}

impl TensorFs {
    /// The decoded-file store, when `--decoded-cache` is on.
    pub fn decoded(&self) -> Option<&Decoded> {
        self.decoded.as_ref()
    }

    /// Whether `ino` is a tensor file or an offered view.
    pub fn is_data(&self, ino: u64) -> bool {
        self.node(ino).is_some()
    }

    /// Whether an open of `ino` should go through the store and passthrough
    /// (a tensor file or view, the store on, passthrough possible).
    pub fn wants_passthrough(&self, ino: u64) -> bool {
        // The native view is the source's own bytes: it is not decoded, so
        // the store has nothing to add (the daemon serves it).
        self.decoded.as_ref().is_some_and(|d| d.enabled())
            && self
                .node(ino)
                .is_some_and(|n| !matches!(n, Node::Native(..)))
    }

    /// The store entry holding all of `ino`'s bytes, decoding it now if it
    /// is not stored yet (concurrent callers wait for one decode).
    pub fn decoded_entry(&self, ino: u64) -> Result<(Entry, Found)> {
        let not_data =
            || crate::error::err(crate::ErrorKind::NotFound, "not a tensor file or view");
        let d = self.decoded.as_ref().ok_or_else(not_data)?;
        let node = self.node(ino).ok_or_else(not_data)?;
        let (what, size, fmt, name) = match &node {
            Node::Tensor { f, fmt } => {
                let name = self.tensor_name(*f).to_string();
                (
                    json!({"tensor": name, "format": fmt.ext()}),
                    self.shared.files[*f].bytes(*fmt),
                    *fmt,
                    format!("{name}.{}", fmt.ext()),
                )
            }
            Node::Alias(a, l) => (
                json!({"hf_name": a.name.dot, "format": l.fmt().ext(), "size": l.size()}),
                l.size(),
                l.fmt(),
                format!("{}.{}", a.name.dot, l.fmt().ext()),
            ),
            Node::Native(v, _) => {
                return Err(crate::error::err(
                    crate::ErrorKind::UnsupportedType,
                    format!(
                        "{} is served from the source's bytes, not stored",
                        v.view.name()
                    ),
                ));
            }
            Node::View(v, l) => (
                json!({
                    "view": v.view.name(),
                    "size": l.size(),
                    "header_crc32": crc32fast::hash(l.header()),
                    "tensors": l.segments().len(),
                }),
                l.size(),
                l.fmt(),
                v.view.name().to_string(),
            ),
        };
        let key = EntryKey::new(&d.sources, what);
        let t = Instant::now();
        let r = d.store.get_or_build(&key, size, |file| {
            let _one = lock(&d.render);
            self.render_into(&node, fmt, size, file)
        });
        match &r {
            Ok((_, Found::Built)) => log::info!(
                "decoded cache: {name} ({size} B) decoded into {} in {:.2} s",
                key.name(),
                t.elapsed().as_secs_f64()
            ),
            Ok((_, Found::Hit)) => {}
            Err(e) => crate::logging::throttled!(
                log::Level::Warn,
                &format!("decoded cache {name}"),
                "decoded cache: {name} is served by the daemon instead: {e}",
            ),
        }
        r
    }

    /// Decode all `size` bytes of `node` into `file`, on every core;
    /// returns their CRC-32.
    fn render_into(&self, node: &Node<'_>, fmt: ElemFormat, size: u64, file: &File) -> Result<u32> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        // Each worker holds a piece in f32 and one encoded (<= f32 size).
        let piece = (self.config.cache_bytes / 2 / (2 * cores as u64))
            .clamp(MIN_RENDER_BYTES, RENDER_BYTES);
        let work = self.render_plan(node, fmt, piece);
        let header: &[u8] = match node {
            Node::View(_, l) | Node::Alias(_, l) => l.header(),
            Node::Tensor { .. } | Node::Native(..) => &[],
        };
        let workers = cores.min(work.len()).max(1);
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let sums: Vec<Mutex<Option<crc32fast::Hasher>>> =
            work.iter().map(|_| Mutex::new(None)).collect();
        let first_error: Mutex<Option<crate::Error>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| {
                    let mut scratch = (Vec::new(), Vec::new());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= work.len() || failed.load(Ordering::Relaxed) {
                            break;
                        }
                        match self.render_piece(&work[i], header, fmt, &mut scratch, file) {
                            Ok(h) => *lock(&sums[i]) = Some(h),
                            Err(e) => {
                                failed.store(true, Ordering::Relaxed);
                                lock(&first_error).get_or_insert(e);
                                break;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = lock(&first_error).take() {
            return Err(e);
        }
        let mut total = crc32fast::Hasher::new();
        let mut covered = 0u64;
        for h in sums {
            let h = h
                .into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .ok_or_else(|| crate::error::err(crate::ErrorKind::BadValue, "piece missing"))?;
            covered += h.total_len();
            total.combine(&h);
        }
        if covered != size {
            return Err(crate::error::err(
                crate::ErrorKind::BadValue,
                format!("decoded {covered} B of {size} (a bug)"),
            ));
        }
        Ok(total.finalize())
    }

    /// The pieces of `node` in file order, each with its file offset.
    fn render_plan(&self, node: &Node<'_>, fmt: ElemFormat, piece: u64) -> Vec<(u64, Work)> {
        let bpe = fmt.bytes();
        // Elements per piece (decoded as f32: 4 bytes each).
        let step = (piece / 4).max(1);
        let mut plan = Vec::new();
        let tensor = |plan: &mut Vec<(u64, Work)>, at: u64, f: usize, e0: u64, e1: u64| {
            let mut e = e0;
            while e < e1 {
                let end = e1.min(e + step);
                plan.push((at + (e - e0) * bpe, Work::Tensor { f, e0: e, e1: end }));
                e = end;
            }
        };
        match node {
            Node::Tensor { f, .. } => tensor(&mut plan, 0, *f, 0, self.shared.files[*f].n_elements),
            // Never stored (`decoded_entry`).
            Node::Native(..) => {}
            Node::View(_, l) | Node::Alias(_, l) => {
                let mut at = 0u64;
                for p in l.pieces(0, l.size()) {
                    match p {
                        Piece::Header(r) => {
                            let n = r.len() as u64;
                            plan.push((at, Work::Header(r)));
                            at += n;
                        }
                        Piece::Zeros(n) => {
                            plan.push((at, Work::Zeros(n as u64)));
                            at += n as u64;
                        }
                        Piece::Tensor { seg, range } => {
                            // Whole segments, so element-aligned; a segment
                            // with permuted rows is decoded row by row.
                            let s = &l.segments()[seg];
                            for r in s.source_ranges(range, bpe) {
                                let n = r.end - r.start;
                                tensor(&mut plan, at, s.file, r.start / bpe, r.end.div_ceil(bpe));
                                at += n;
                            }
                        }
                    }
                }
            }
        }
        plan
    }

    /// Decode one piece and write it at `at`; its CRC-32 state.
    fn render_piece(
        &self,
        (at, w): &(u64, Work),
        header: &[u8],
        fmt: ElemFormat,
        (vals, out): &mut (Vec<f32>, Vec<u8>),
        file: &File,
    ) -> Result<crc32fast::Hasher> {
        let mut h = crc32fast::Hasher::new();
        let io = |e: std::io::Error| {
            crate::Error::io(std::path::Path::new("decoded cache"), "cannot write", e)
        };
        match w {
            Work::Header(r) => {
                let bytes = header.get(r.clone()).ok_or_else(|| {
                    crate::error::err(crate::ErrorKind::BadValue, "header range (a bug)")
                })?;
                h.update(bytes);
                file.write_all_at(bytes, *at).map_err(io)?;
            }
            Work::Zeros(n) => {
                // The file is sparse: zeros need no write, only hashing.
                let zeros = [0u8; 4096];
                let mut left = *n;
                while left > 0 {
                    let k = left.min(zeros.len() as u64) as usize;
                    h.update(&zeros[..k]);
                    left -= k as u64;
                }
            }
            Work::Tensor { f, e0, e1 } => {
                vals.clear();
                vals.resize((e1 - e0) as usize, 0.0);
                self.shared
                    .decode(*f, *e0, vals)
                    .map_err(|e| e.tensor(self.tensor_name(*f)))?;
                let bytes: &[u8] = if fmt == ElemFormat::F32 {
                    bytemuck::cast_slice(vals)
                } else {
                    out.clear();
                    let n = vals.len() * fmt.bytes() as usize;
                    views::encode_into(fmt, vals, 0, n, out);
                    out
                };
                h.update(bytes);
                file.write_all_at(bytes, *at).map_err(io)?;
            }
        }
        Ok(h)
    }
}
