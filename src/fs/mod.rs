//! The filesystem: what the mount shows and how a read is served, with no
//! FUSE types (the kernel adapter is [`fuse`]). Tests drive this layer
//! directly; the integration tests drive it through a real mount.
//!
//! Namespace (one flat directory):
//! - `<underscore name>.f32` and `<dot name>.f32`: two names (hard links) of
//!   one inode per available tensor, mode 0444, size = elements × 4; with
//!   `--views f16` / `bf16` also `.f16` / `.bf16` files (elements × 2);
//! - `model.safetensors` and `model.gguf`: the whole model as one file an
//!   engine loads directly, and `model.f16.safetensors` /
//!   `model.bf16.safetensors` when those formats are asked for ([`views`]);
//! - `index.json`: every tensor (names, shape, stored type, source, sizes),
//!   the model metadata and the views (which exist, and why any does not);
//! - `ctl`: live status (version, sources, cache statistics, reads in
//!   flight); writing a command line to it (`drop-cache`) acts on the daemon.
//!
//! Inode numbers: 1 root, 2 `index.json`, 3 `ctl`, 4..=7 the model views,
//! and `16 + i + k * 2^32` for the i-th tensor in the backend's order in
//! format k (0 f32, 1 f16, 2 bf16), which is fixed by the source files, so
//! they are stable across remounts of the same files.
//!
//! Every file with tensor bytes in it (tensor files in any format, model
//! views) is served from one decoded-chunk cache of f32 values, keyed by
//! tensor: a view read that spans tensors assembles its reply from several
//! tensors' chunks, and f16/bf16 are converted from the cached f32 chunk.

pub mod fuse;
mod prefetch;
pub mod views;

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use serde_json::{Value, json};

use crate::backend::{Backend, SourceSummary};
use crate::cache::{BlockCache, Chunk, ChunkKey, lock};
use crate::error::Result;
use crate::format::meta::{MetaValue, Metadata};
use crate::report;
use views::{ElemFormat, FORMAT_INO_STRIDE, Layout, ModelView, Piece, ViewSet, ViewTensor};

pub const ROOT_INO: u64 = 1;
pub const INDEX_INO: u64 = 2;
pub const CTL_INO: u64 = 3;
pub const FIRST_TENSOR_INO: u64 = 16;
/// `ctl.json`: what `ctl` shows, as JSON for tools.
pub const CTL_JSON_INO: u64 = 8;
/// `jobs/`: one file per encoding job.
pub const JOBS_DIR_INO: u64 = 9;
/// Job `n` is the file `jobs/n`, inode `JOB_INO_BASE + n` (above every
/// tensor and view inode).
pub const JOB_INO_BASE: u64 = 1 << 48;

pub const INDEX_NAME: &str = "index.json";
pub const CTL_NAME: &str = "ctl";
pub const CTL_JSON_NAME: &str = "ctl.json";
pub const JOBS_DIR_NAME: &str = "jobs";

/// Default decoded bytes per cache chunk: the largest FUSE read (1 MiB), so
/// an aligned 1 MiB read is served from one chunk without a copy.
pub const DEFAULT_CHUNK_BYTES: u64 = 1 << 20;

/// Reads up to this size that miss the cache and are not part of a
/// sequential stream decode only their own bytes (see `read_tensor`).
pub const SMALL_READ_BYTES: u64 = 64 * 1024;

/// Metadata arrays longer than this are summarized in `index.json` (a
/// tokenizer's vocab would otherwise make it megabytes).
const INDEX_ARRAY_LIMIT: usize = 1024;

/// Settings of one mount.
#[derive(Debug, Clone)]
pub struct FsConfig {
    pub uid: u32,
    pub gid: u32,
    /// Serve tensor files with FOPEN_DIRECT_IO instead of the page cache.
    pub direct_io: bool,
    pub cache_bytes: u64,
    pub chunk_bytes: u64,
    /// Background decode threads for read-ahead (0 disables it).
    pub prefetch_threads: usize,
    /// Largest read-ahead window, in chunks.
    pub prefetch_max_chunks: u64,
    /// Tensor formats served besides f32 (`--views`).
    pub views: ViewSet,
    /// Encoding jobs through `ctl` (None: not offered).
    pub jobs: Option<JobsConfig>,
}

/// Where `ctl` encoding jobs read and write.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    /// Outputs land only here. Jobs read the mount's own backend.
    pub dir: std::path::PathBuf,
    /// Jobs running at once; the rest queue.
    pub max_running: usize,
    /// Threads per job (at lower CPU priority than the FUSE threads).
    pub threads: usize,
}

impl Default for FsConfig {
    fn default() -> Self {
        FsConfig {
            uid: 0,
            gid: 0,
            direct_io: false,
            cache_bytes: 256 << 20,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            prefetch_threads: 2,
            prefetch_max_chunks: 32,
            views: ViewSet::default(),
            jobs: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
}

/// File attributes, FUSE-agnostic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub kind: Kind,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: SystemTime,
}

/// How the kernel should treat an open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenMode {
    pub fh: u64,
    pub keep_cache: bool,
    pub direct_io: bool,
}

/// Bytes of a read reply: a slice of a cached chunk (no copy) or a buffer.
pub enum ReadData {
    Chunk(Chunk, Range<usize>),
    Owned(Vec<u8>),
}

impl ReadData {
    pub fn bytes(&self) -> &[u8] {
        match self {
            ReadData::Chunk(c, r) => &bytemuck::cast_slice::<f32, u8>(c)[r.clone()],
            ReadData::Owned(v) => v,
        }
    }
}

/// `statfs` answer.
#[derive(Debug, Clone, Copy)]
pub struct StatFs {
    pub blocks: u64,
    pub files: u64,
    pub bsize: u32,
    pub namelen: u32,
}

struct TensorFile {
    /// Index in the backend's table.
    index: usize,
    n_elements: u64,
    chunk_elems: u64,
    mtime: SystemTime,
    nlink: u32,
}

/// Read-ahead state of one open file handle.
#[derive(Debug, Default)]
struct HandleState {
    next_offset: u64,
    window: u64,
    /// The last chunk handed to the prefetcher for this stream: later reads
    /// request only the chunks after it, so chunks still queued are not
    /// queued again.
    last_requested: Option<(usize, u64)>,
}

/// Everything the read path shares with the prefetch threads.
pub(crate) struct Shared {
    backend: Arc<dyn Backend>,
    cache: BlockCache,
    files: Vec<TensorFile>,
}

impl TensorFile {
    /// Size of this tensor's file in `fmt`.
    fn bytes(&self, fmt: ElemFormat) -> u64 {
        self.n_elements * fmt.bytes()
    }
}

impl Shared {
    /// Decode chunk `chunk` of tensor file `f` through the cache.
    fn chunk(&self, f: usize, chunk: u64) -> Result<Chunk> {
        let file = &self.files[f];
        let key = ChunkKey {
            tensor: f as u32,
            chunk,
        };
        let first = chunk * file.chunk_elems;
        let len = file.chunk_elems.min(file.n_elements.saturating_sub(first)) as usize;
        self.cache
            .get_or_decode(key, len, |buf| self.decode(f, first, buf))
    }

    /// Decode elements `[first, first + out.len())` of tensor file `f`.
    /// Every decode of the read path comes through here, so a decoder panic
    /// (a bug) fails this one read with EIO instead of killing a FUSE
    /// worker thread, which would end the session.
    fn decode(&self, f: usize, first: u64, out: &mut [f32]) -> Result<()> {
        let index = self.files[f].index;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.backend.read_f32(index, first, out)
        }))
        .unwrap_or_else(|_| {
            Err(crate::Error::new(
                crate::error::ErrorKind::BadValue,
                "internal error: decoder panicked",
            ))
        })
    }
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    read_errors: AtomicU64,
    reads_in_flight: AtomicU64,
    small_reads: AtomicU64,
    bytes_served: AtomicU64,
}

/// One whole-model view (`model.safetensors`, ...): its layout when it is
/// offered, or why it is not.
struct ViewFile {
    view: ModelView,
    layout: std::result::Result<Layout, String>,
    notes: Vec<String>,
}

/// What an inode is.
enum Node<'a> {
    /// Tensor file `f` served in `fmt`.
    Tensor {
        f: usize,
        fmt: ElemFormat,
    },
    View(&'a ViewFile, &'a Layout),
}

pub struct TensorFs {
    shared: Arc<Shared>,
    config: FsConfig,
    /// Tensor formats served, f32 first.
    formats: Vec<ElemFormat>,
    /// The requested model views, offered or not, in listing order.
    views: Vec<ViewFile>,
    /// Directory entries in listing order: (name, ino).
    entries: Vec<(String, u64)>,
    by_name: HashMap<String, u64>,
    index_json: Vec<u8>,
    root_mtime: SystemTime,
    /// Newest of the source files: the model views mix them.
    views_mtime: SystemTime,
    started: Instant,
    counters: Counters,
    handles: Mutex<HashMap<u64, HandleState>>,
    next_fh: AtomicU64,
    prefetch: prefetch::Prefetcher,
    last_ctl_error: Mutex<Option<String>>,
    jobs: Option<crate::jobs::JobManager>,
    /// Direct I/O as configured, unless the kernel cannot mmap such files.
    direct_io: std::sync::atomic::AtomicBool,
    /// Owner of `ctl`, `ctl.json` and `jobs/`: the daemon's own user, not
    /// `-o uid=`. Jobs run with the daemon's rights and write next to the
    /// model, so only that user (mode 0600) may start them.
    daemon_owner: (u32, u32),
}

fn mtime_of(path: &Path) -> SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Chunk length in elements for a tensor: a whole number of the backend's
/// decode granules when a granule fits in a chunk, so chunk edges do not
/// split a granule.
fn chunk_elems_for(granule: u64, chunk_bytes: u64) -> u64 {
    let target = (chunk_bytes / 4).max(1);
    if granule > 0 && granule <= target {
        target / granule * granule
    } else {
        target
    }
}

/// Inode of tensor file `f` in format `fmt` (module docs).
pub fn tensor_ino(f: usize, fmt: ElemFormat) -> u64 {
    FIRST_TENSOR_INO + f as u64 + fmt.ordinal() * FORMAT_INO_STRIDE
}

/// The key/values the model views carry, and whose they are: the dense
/// fallback's when there is one (it is the complete model file), unless it
/// has none; else the source's.
fn view_metadata(b: &dyn Backend) -> (&crate::format::meta::Metadata, &'static str) {
    match b.fallback_summary() {
        Some(f) if !f.metadata.is_empty() => (&f.metadata, "fallback"),
        _ => (&b.summary().metadata, "source"),
    }
}

/// Build the model views `requested` from shapes and metadata (no tensor is
/// decoded). A view that cannot be offered records why.
fn build_views(b: &dyn Backend, files: &[TensorFile], requested: &[ModelView]) -> Vec<ViewFile> {
    let entries = b.tensors().entries();
    let tensors: Vec<ViewTensor> = files
        .iter()
        .enumerate()
        .map(|(f, tf)| {
            let t = &entries[tf.index];
            ViewTensor {
                file: f,
                name: &t.name.dot,
                shape: &t.shape,
                n_elements: t.n_elements,
            }
        })
        .collect();
    let unavailable: Vec<&crate::backend::TensorInfo> =
        entries.iter().filter(|t| !t.is_available()).collect();
    let (md, _) = view_metadata(b);
    let st_formats: Vec<ElemFormat> = requested
        .iter()
        .filter_map(|v| match v {
            ModelView::Safetensors(f) => Some(*f),
            ModelView::Gguf => None,
        })
        .collect();
    // In `requested` order.
    let mut st = views::safetensors_all(&tensors, md, &st_formats).into_iter();
    let mut out = Vec::new();
    for &view in requested {
        let built = match view {
            ModelView::Safetensors(_) => match st.next() {
                Some(r) => r.map_err(|e| e.to_string()),
                None => Err("internal error: safetensors view not built".to_string()),
            },
            ModelView::Gguf => gguf_refusal(md, &tensors, &unavailable)
                .map_or_else(|| views::gguf(&tensors, md).map_err(|e| e.to_string()), Err),
        };
        let mut notes = Vec::new();
        if !unavailable.is_empty() && view != ModelView::Gguf {
            notes.push(format!(
                "{} unavailable tensor(s) left out: {}",
                unavailable.len(),
                name_list(&unavailable)
            ));
        }
        let layout = built.map(|b| {
            notes.extend(b.notes);
            b.layout
        });
        if let Err(why) = &layout {
            log::info!("{} is not offered: {why}", view.name());
        }
        out.push(ViewFile {
            view,
            layout,
            notes,
        });
    }
    out
}

fn name_list(ts: &[&crate::backend::TensorInfo]) -> String {
    let mut names: Vec<&str> = ts.iter().take(8).map(|t| t.name.dot.as_str()).collect();
    if ts.len() > 8 {
        names.push("...");
    }
    names.join(", ")
}

/// Why `model.gguf` cannot be offered, if it cannot: llama.cpp needs the
/// run metadata and every tensor.
fn gguf_refusal(
    md: &crate::format::meta::Metadata,
    tensors: &[ViewTensor],
    unavailable: &[&crate::backend::TensorInfo],
) -> Option<String> {
    let missing = views::gguf_missing_keys(md);
    if !missing.is_empty() {
        let hint = if md.is_empty() {
            " (the source carries no model key/values, e.g. a bare SK32: mount it with \
             --dense MODEL.gguf)"
        } else {
            ""
        };
        return Some(format!(
            "the model metadata lacks {}, which llama.cpp needs to load the model{hint}",
            missing.join(", ")
        ));
    }
    if let Some(first) = unavailable.first() {
        let why = match &first.availability {
            crate::backend::Availability::Unavailable(w) => w.as_str(),
            crate::backend::Availability::Available => "",
        };
        return Some(format!(
            "{} tensor(s) cannot be served ({}: {why}) and llama.cpp needs every tensor",
            unavailable.len(),
            name_list(unavailable)
        ));
    }
    let names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
    let missing = views::gguf_missing_tensors(md, &names);
    if !missing.is_empty() {
        return Some(format!(
            "the served tensors lack {}, which llama.cpp needs to build the model (a \
             compressed file alone carries only what it compresses: mount it with \
             --dense MODEL.gguf)",
            missing.join(" and ")
        ));
    }
    None
}

/// The backend as `report::inspect_json` should see it for index.json:
/// the same tensors and sources, with metadata arrays longer than
/// INDEX_ARRAY_LIMIT emptied (index.json summarizes them). Converting a
/// 150k-token vocabulary to JSON only to drop it cost ~50 ms of CPU on
/// every mount of a 7B model.
struct Lean<'a> {
    inner: &'a dyn Backend,
    summary: SourceSummary,
    fallback: Option<SourceSummary>,
}

impl<'a> Lean<'a> {
    fn new(inner: &'a dyn Backend) -> Self {
        let lean = |s: &SourceSummary| SourceSummary {
            format: s.format,
            version: s.version,
            path: s.path.clone(),
            notes: s.notes.clone(),
            metadata: Metadata {
                entries: s
                    .metadata
                    .entries
                    .iter()
                    .map(|(k, v)| {
                        let v = match v {
                            MetaValue::Array { elem, values }
                                if values.len() > INDEX_ARRAY_LIMIT =>
                            {
                                MetaValue::Array {
                                    elem: *elem,
                                    values: Vec::new(),
                                }
                            }
                            other => other.clone(),
                        };
                        (k.clone(), v)
                    })
                    .collect(),
            },
        };
        Lean {
            inner,
            summary: lean(inner.summary()),
            fallback: inner.fallback_summary().map(lean),
        }
    }
}

impl Backend for Lean<'_> {
    fn summary(&self) -> &SourceSummary {
        &self.summary
    }

    fn fallback_summary(&self) -> Option<&SourceSummary> {
        self.fallback.as_ref()
    }

    fn tensors(&self) -> &crate::backend::TensorTable {
        self.inner.tensors()
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        self.inner.read_f32(index, first_elem, out)
    }
}

impl TensorFs {
    pub fn new(backend: Arc<dyn Backend>, mut config: FsConfig) -> TensorFs {
        // The inode scheme gives each format 2^32 - 16 tensor inodes; no
        // real header holds that many tensors (a GGUF header is capped at
        // 256 MiB), but a larger table must not make inodes collide.
        let n_tensors = backend.tensors().len() as u64;
        if n_tensors > FORMAT_INO_STRIDE - FIRST_TENSOR_INO && config.views != ViewSet::default() {
            log::warn!("{n_tensors} tensors: too many for .f16/.bf16 inodes; serving f32 only");
            config.views = ViewSet::default();
        }
        let formats = config.views.formats();
        let mut files = Vec::new();
        for (i, t) in backend.tensors().entries().iter().enumerate() {
            if !t.is_available() {
                continue;
            }
            files.push(TensorFile {
                index: i,
                n_elements: t.n_elements,
                chunk_elems: chunk_elems_for(t.granule, config.chunk_bytes),
                mtime: mtime_of(&t.origin.path),
                nlink: if t.name.dot == t.name.underscore {
                    1
                } else {
                    2
                },
            });
        }
        // The views' headers (megabytes for a large vocabulary) are built on
        // a second thread while this one renders index.json, which costs
        // about as much: with two cores, views add no time to the mount.
        let started = Instant::now();
        let requested: Vec<ModelView> = ModelView::ALL
            .into_iter()
            .filter(|v| v.requested(config.views))
            .collect();
        let (gguf, safetensors): (Vec<ModelView>, Vec<ModelView>) =
            requested.iter().partition(|v| **v == ModelView::Gguf);
        let ((mut views, views_ms), index) = std::thread::scope(|s| {
            // The GGUF header and the safetensors headers on their own
            // threads: the GGUF one is the longest job.
            let build = |which: Vec<ModelView>| {
                let (b, files) = (backend.as_ref(), &files);
                s.spawn(move || {
                    let t = Instant::now();
                    (
                        build_views(b, files, &which),
                        t.elapsed().as_secs_f64() * 1e3,
                    )
                })
            };
            let handles = [build(gguf), build(safetensors)];
            let index = Self::index_value(backend.as_ref(), &formats);
            let mut views = (Vec::new(), 0f64);
            for h in handles {
                match h.join() {
                    Ok((v, ms)) => {
                        views.0.extend(v);
                        views.1 = views.1.max(ms);
                    }
                    Err(_) => {
                        log::error!("building a model view failed (a bug); it is not offered")
                    }
                }
            }
            (views, index)
        });
        views.sort_by_key(|v| ModelView::ALL.iter().position(|x| *x == v.view));
        log::info!(
            "views built in {views_ms:.1} ms (alongside index.json: both in {:.1} ms): {}",
            started.elapsed().as_secs_f64() * 1e3,
            views
                .iter()
                .map(|v| format!(
                    "{} {}",
                    v.view.name(),
                    match &v.layout {
                        Ok(l) => format!("{} B", l.size()),
                        Err(_) => "absent".to_string(),
                    }
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut entries = vec![
            (INDEX_NAME.to_string(), INDEX_INO),
            (CTL_NAME.to_string(), CTL_INO),
        ];
        let jobs = config.jobs.as_ref().map(|j| {
            crate::jobs::JobManager::new(
                j.dir.clone(),
                crate::jobs::JobSource::of_mount(&backend),
                j.max_running,
                j.threads,
            )
        });
        if jobs.is_some() {
            entries.push((CTL_JSON_NAME.to_string(), CTL_JSON_INO));
            entries.push((JOBS_DIR_NAME.to_string(), JOBS_DIR_INO));
        }
        for v in views.iter().filter(|v| v.layout.is_ok()) {
            entries.push((v.view.name().to_string(), v.view.ino()));
        }
        let table = backend.tensors().entries();
        for (f, tf) in files.iter().enumerate() {
            let name = &table[tf.index].name;
            for &fmt in &formats {
                let ino = tensor_ino(f, fmt);
                let us = format!("{}.{}", name.underscore, fmt.ext());
                let dot = format!("{}.{}", name.dot, fmt.ext());
                if dot != us {
                    entries.push((us, ino));
                }
                entries.push((dot, ino));
            }
        }
        let by_name = entries.iter().cloned().collect();
        let root_mtime = mtime_of(&backend.summary().path);
        let views_mtime = backend
            .fallback_summary()
            .map_or(root_mtime, |f| root_mtime.max(mtime_of(&f.path)));
        let index_json = Self::render_index(index, &views);
        let shared = Arc::new(Shared {
            backend,
            cache: BlockCache::new(config.cache_bytes),
            files,
        });
        let prefetch = prefetch::Prefetcher::start(shared.clone(), config.prefetch_threads);
        TensorFs {
            shared,
            formats,
            views,
            entries,
            by_name,
            index_json,
            root_mtime,
            views_mtime,
            started: Instant::now(),
            counters: Counters::default(),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            prefetch,
            last_ctl_error: Mutex::new(None),
            direct_io: std::sync::atomic::AtomicBool::new(config.direct_io),
            // SAFETY: geteuid/getegid have no preconditions.
            daemon_owner: unsafe { (libc::geteuid(), libc::getegid()) },
            jobs,
            config,
        }
    }

    /// Cancel encoding jobs and wait until they removed their temporary
    /// files (unmount).
    pub fn shutdown_jobs(&self) {
        if let Some(j) = &self.jobs {
            j.shutdown();
        }
    }

    /// Whether an inode's attributes and content change while mounted
    /// (the kernel must not cache them).
    pub fn is_live(&self, ino: u64) -> bool {
        matches!(ino, CTL_INO | CTL_JSON_INO | JOBS_DIR_INO) || self.job_of(ino).is_some()
    }

    fn job_of(&self, ino: u64) -> Option<Arc<crate::jobs::Job>> {
        let id = ino.checked_sub(JOB_INO_BASE)?;
        self.jobs.as_ref()?.job(id)
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.shared.backend
    }

    /// Whether tensor files are opened with direct I/O.
    pub fn direct_io(&self) -> bool {
        self.direct_io.load(Ordering::Relaxed)
    }

    /// Serve tensor files through the page cache instead of direct I/O
    /// (the kernel cannot mmap direct_io files without
    /// FUSE_DIRECT_IO_ALLOW_MMAP).
    pub fn fall_back_to_page_cache(&self) {
        self.direct_io.store(false, Ordering::Relaxed);
    }

    /// The tensor file or offered model view behind an inode.
    fn node(&self, ino: u64) -> Option<Node<'_>> {
        if let Some(v) = self.views.iter().find(|v| v.view.ino() == ino) {
            return v.layout.as_ref().ok().map(|l| Node::View(v, l));
        }
        let fmt = ElemFormat::from_ordinal(ino / FORMAT_INO_STRIDE)?;
        if !self.formats.contains(&fmt) {
            return None;
        }
        let f = usize::try_from((ino % FORMAT_INO_STRIDE).checked_sub(FIRST_TENSOR_INO)?).ok()?;
        (f < self.shared.files.len()).then_some(Node::Tensor { f, fmt })
    }

    pub fn getattr(&self, ino: u64) -> std::result::Result<Attr, i32> {
        let base = Attr {
            ino,
            size: 0,
            kind: Kind::File,
            perm: 0o444,
            nlink: 1,
            uid: self.config.uid,
            gid: self.config.gid,
            mtime: self.root_mtime,
        };
        let live = Attr {
            uid: self.daemon_owner.0,
            gid: self.daemon_owner.1,
            mtime: SystemTime::now(),
            ..base
        };
        match ino {
            ROOT_INO => Ok(Attr {
                kind: Kind::Dir,
                perm: 0o555,
                nlink: 2,
                ..base
            }),
            INDEX_INO => Ok(Attr {
                size: self.index_json.len() as u64,
                ..base
            }),
            // Live content: size 0, read with direct I/O (like /proc),
            // owned by the daemon's user.
            CTL_INO => Ok(Attr {
                perm: 0o600,
                ..live
            }),
            CTL_JSON_INO if self.jobs.is_some() => Ok(live),
            JOBS_DIR_INO if self.jobs.is_some() => Ok(Attr {
                kind: Kind::Dir,
                perm: 0o555,
                nlink: 2,
                ..live
            }),
            _ if self.job_of(ino).is_some() => Ok(live),
            _ => match self.node(ino).ok_or(libc::ENOENT)? {
                Node::Tensor { f, fmt } => {
                    let file = &self.shared.files[f];
                    Ok(Attr {
                        size: file.bytes(fmt),
                        nlink: file.nlink,
                        mtime: file.mtime,
                        ..base
                    })
                }
                Node::View(_, l) => Ok(Attr {
                    size: l.size(),
                    mtime: self.views_mtime,
                    ..base
                }),
            },
        }
    }

    pub fn lookup(&self, parent: u64, name: &str) -> std::result::Result<Attr, i32> {
        if parent == JOBS_DIR_INO && self.jobs.is_some() {
            let id: u64 = name.parse().map_err(|_| libc::ENOENT)?;
            return self.getattr(JOB_INO_BASE.checked_add(id).ok_or(libc::ENOENT)?);
        }
        if parent != ROOT_INO {
            return Err(libc::ENOENT);
        }
        let ino = *self.by_name.get(name).ok_or(libc::ENOENT)?;
        self.getattr(ino)
    }

    /// Directory listing: ".", "..", then every entry, as (ino, kind, name).
    pub fn readdir(&self, ino: u64) -> std::result::Result<Vec<(u64, Kind, String)>, i32> {
        if let (JOBS_DIR_INO, Some(jobs)) = (ino, &self.jobs) {
            let mut v = vec![
                (JOBS_DIR_INO, Kind::Dir, ".".to_string()),
                (ROOT_INO, Kind::Dir, "..".to_string()),
            ];
            v.extend(
                jobs.jobs()
                    .iter()
                    .map(|j| (JOB_INO_BASE + j.id, Kind::File, j.id.to_string())),
            );
            return Ok(v);
        }
        if ino != ROOT_INO {
            return Err(libc::ENOTDIR);
        }
        let mut v = vec![
            (ROOT_INO, Kind::Dir, ".".to_string()),
            (ROOT_INO, Kind::Dir, "..".to_string()),
        ];
        v.extend(self.entries.iter().map(|(n, i)| {
            let kind = if *i == JOBS_DIR_INO {
                Kind::Dir
            } else {
                Kind::File
            };
            (*i, kind, n.clone())
        }));
        Ok(v)
    }

    /// Open a file. Only `ctl` may be opened for writing; anything else
    /// opened for writing is EROFS (root would pass the mode bits).
    pub fn open(&self, ino: u64, write: bool) -> std::result::Result<OpenMode, i32> {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        match ino {
            ROOT_INO => Err(libc::EISDIR),
            JOBS_DIR_INO if self.jobs.is_some() => Err(libc::EISDIR),
            CTL_INO => Ok(OpenMode {
                fh,
                keep_cache: false,
                direct_io: true,
            }),
            _ if self.is_live(ino) && self.getattr(ino).is_ok() => {
                if write {
                    return Err(libc::EROFS);
                }
                Ok(OpenMode {
                    fh,
                    keep_cache: false,
                    direct_io: true,
                })
            }
            _ if write => {
                self.getattr(ino)?;
                Err(libc::EROFS)
            }
            INDEX_INO => Ok(OpenMode {
                fh,
                keep_cache: true,
                direct_io: false,
            }),
            _ => {
                self.node(ino).ok_or(libc::ENOENT)?;
                self.lock_handles().insert(fh, HandleState::default());
                let dio = self.direct_io();
                Ok(OpenMode {
                    fh,
                    keep_cache: !dio,
                    direct_io: dio,
                })
            }
        }
    }

    pub fn release(&self, fh: u64) {
        self.lock_handles().remove(&fh);
    }

    fn lock_handles(&self) -> std::sync::MutexGuard<'_, HashMap<u64, HandleState>> {
        lock(&self.handles)
    }

    /// Serve `[offset, offset + size)` of a file. Tensor and view reads
    /// decode only the chunks that overlap the range; errors are logged and
    /// become EIO.
    pub fn read(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> std::result::Result<ReadData, i32> {
        match ino {
            INDEX_INO => Ok(ReadData::Owned(
                slice_at(&self.index_json, offset, size).to_vec(),
            )),
            CTL_INO => {
                let text = self.ctl_text();
                Ok(ReadData::Owned(
                    slice_at(text.as_bytes(), offset, size).to_vec(),
                ))
            }
            CTL_JSON_INO if self.jobs.is_some() => {
                let mut text = serde_json::to_vec_pretty(&self.ctl_json()).unwrap_or_default();
                text.push(b'\n');
                Ok(ReadData::Owned(slice_at(&text, offset, size).to_vec()))
            }
            ROOT_INO | JOBS_DIR_INO => Err(libc::EISDIR),
            _ if self.job_of(ino).is_some() => {
                let text = self.job_of(ino).map(|j| j.to_text()).unwrap_or_default();
                Ok(ReadData::Owned(
                    slice_at(text.as_bytes(), offset, size).to_vec(),
                ))
            }
            _ => {
                let node = self.node(ino).ok_or(libc::ENOENT)?;
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .reads_in_flight
                    .fetch_add(1, Ordering::Relaxed);
                let r = match &node {
                    Node::Tensor { f, fmt } => self.read_tensor(*f, *fmt, fh, offset, size),
                    Node::View(_, l) => self.read_view(l, fh, offset, size),
                };
                self.counters
                    .reads_in_flight
                    .fetch_sub(1, Ordering::Relaxed);
                match r {
                    Ok(d) => {
                        self.counters
                            .bytes_served
                            .fetch_add(d.bytes().len() as u64, Ordering::Relaxed);
                        Ok(d)
                    }
                    Err(e) => {
                        self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                        let what = match node {
                            Node::Tensor { f, fmt } => {
                                format!("{}.{}", self.tensor_name(f), fmt.ext())
                            }
                            Node::View(v, _) => v.view.name().to_string(),
                        };
                        log::error!("read of {size} bytes at {offset} of {what}: {e}");
                        Err(e.errno())
                    }
                }
            }
        }
    }

    fn tensor_name(&self, f: usize) -> &str {
        let i = self.shared.files[f].index;
        &self.shared.backend.tensors().entries()[i].name.dot
    }

    /// Whether a read of bytes `[lo, hi)` of tensor file `f` in `fmt` at
    /// file offset `offset` should decode only its own elements, uncached:
    /// a small read that is not continuing a sequential stream and whose
    /// chunk is not cached. A random 4 KiB read must not pay for a whole
    /// chunk.
    fn small_read(
        &self,
        f: usize,
        fmt: ElemFormat,
        fh: u64,
        offset: u64,
        lo: u64,
        hi: u64,
    ) -> bool {
        let file = &self.shared.files[f];
        let bpe = fmt.bytes();
        let (c0, c1) = (
            lo / bpe / file.chunk_elems,
            (hi - 1) / bpe / file.chunk_elems,
        );
        hi - lo <= SMALL_READ_BYTES
            && c0 == c1
            && !self.is_sequential(fh, offset)
            && !self.shared.cache.is_present(ChunkKey {
                tensor: f as u32,
                chunk: c0,
            })
    }

    fn read_tensor(
        &self,
        f: usize,
        fmt: ElemFormat,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> Result<ReadData> {
        let len = self.shared.files[f].bytes(fmt);
        if offset >= len || size == 0 {
            return Ok(ReadData::Owned(Vec::new()));
        }
        let end = len.min(offset.saturating_add(u64::from(size)));
        let small = self.small_read(f, fmt, fh, offset, offset, end);
        let data = self.tensor_range(f, fmt, offset, end, small)?;
        let whole = [views::Segment {
            start: 0,
            len,
            file: f,
        }];
        self.after_read(fh, offset, end, &whole, fmt);
        Ok(data)
    }

    fn read_view(&self, l: &Layout, fh: u64, offset: u64, size: u32) -> Result<ReadData> {
        if offset >= l.size() || size == 0 {
            return Ok(ReadData::Owned(Vec::new()));
        }
        let end = l.size().min(offset.saturating_add(u64::from(size)));
        let pieces = l.pieces(offset, end);
        let data = match pieces.as_slice() {
            // Inside one tensor: the tensor files' path (zero-copy from a
            // chunk for f32, the small-read rule).
            [Piece::Tensor { seg, range }] => {
                let f = l.segments()[*seg].file;
                let small = self.small_read(f, l.fmt(), fh, offset, range.start, range.end);
                self.tensor_range(f, l.fmt(), range.start, range.end, small)?
            }
            _ => {
                let mut out = Vec::with_capacity((end - offset) as usize);
                for p in pieces {
                    match p {
                        Piece::Header(r) => out.extend_from_slice(&l.header()[r]),
                        Piece::Zeros(n) => out.resize(out.len() + n, 0),
                        Piece::Tensor { seg, range } => self.append_tensor(
                            l.segments()[seg].file,
                            l.fmt(),
                            range.start,
                            range.end,
                            &mut out,
                        )?,
                    }
                }
                ReadData::Owned(out)
            }
        };
        self.after_read(fh, offset, end, l.segments(), l.fmt());
        Ok(data)
    }

    /// Bytes `[lo, hi)` (non-empty, within the tensor) of tensor file `f`
    /// encoded as `fmt`.
    fn tensor_range(
        &self,
        f: usize,
        fmt: ElemFormat,
        lo: u64,
        hi: u64,
        small: bool,
    ) -> Result<ReadData> {
        let file = &self.shared.files[f];
        let bpe = fmt.bytes();
        let (e0, e1) = (lo / bpe, hi.div_ceil(bpe));
        if small {
            self.counters.small_reads.fetch_add(1, Ordering::Relaxed);
            let mut vals = vec![0f32; (e1 - e0) as usize];
            self.shared.decode(f, e0, &mut vals)?;
            let skip = (lo - e0 * bpe) as usize;
            let take = (hi - lo) as usize;
            if fmt == ElemFormat::F32 {
                // Replied straight from the decoded values, like a chunk.
                return Ok(ReadData::Chunk(Arc::new(vals), skip..skip + take));
            }
            let mut out = Vec::with_capacity(take);
            views::encode_into(fmt, &vals, skip, take, &mut out);
            return Ok(ReadData::Owned(out));
        }
        let (c0, c1) = (e0 / file.chunk_elems, (e1 - 1) / file.chunk_elems);
        if fmt == ElemFormat::F32 && c0 == c1 {
            // A range inside one chunk is replied straight from it.
            let chunk = self.shared.chunk(f, c0)?;
            let base = c0 * file.chunk_elems * 4;
            return Ok(ReadData::Chunk(
                chunk,
                (lo - base) as usize..(hi - base) as usize,
            ));
        }
        let mut out = Vec::with_capacity((hi - lo) as usize);
        self.append_tensor(f, fmt, lo, hi, &mut out)?;
        Ok(ReadData::Owned(out))
    }

    /// Append bytes `[lo, hi)` of tensor file `f` encoded as `fmt` to
    /// `out`, from the cached chunks that cover them.
    fn append_tensor(
        &self,
        f: usize,
        fmt: ElemFormat,
        lo: u64,
        hi: u64,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let file = &self.shared.files[f];
        let bpe = fmt.bytes();
        let ce = file.chunk_elems;
        let (e0, e1) = (lo / bpe, hi.div_ceil(bpe));
        for c in e0 / ce..=(e1 - 1) / ce {
            let chunk = self.shared.chunk(f, c)?;
            let base = c * ce;
            // Elements of this chunk inside [e0, e1), chunk-relative.
            let a = e0.max(base) - base;
            let b = e1.min(base + chunk.len() as u64) - base;
            // Their encoded bytes start at (base + a) * bpe; take only [lo, hi).
            let first_byte = (base + a) * bpe;
            let skip = lo.saturating_sub(first_byte);
            let take = hi.min((base + b) * bpe) - (first_byte + skip);
            views::encode_into(
                fmt,
                &chunk[a as usize..b as usize],
                skip as usize,
                take as usize,
                out,
            );
        }
        Ok(())
    }

    fn is_sequential(&self, fh: u64, offset: u64) -> bool {
        self.lock_handles()
            .get(&fh)
            .is_some_and(|h| h.next_offset == offset && offset > 0)
    }

    /// Track the handle's stream: a read that starts where the previous one
    /// ended is sequential (that also decides the small-read rule). With
    /// prefetch on, sequential readers get a read-ahead window that doubles
    /// on each sequential read (up to the configured maximum) and resets on
    /// a seek; the window's chunks are those after byte `end` of the file,
    /// whose tensor bytes are `segments` in `fmt` (one segment for a tensor
    /// file; a view continues into the next tensors).
    fn after_read(
        &self,
        fh: u64,
        offset: u64,
        end: u64,
        segments: &[views::Segment],
        fmt: ElemFormat,
    ) {
        let prefetch = self.config.prefetch_threads > 0;
        let wanted = {
            let mut handles = self.lock_handles();
            let Some(h) = handles.get_mut(&fh) else {
                return;
            };
            let sequential = offset == h.next_offset;
            h.next_offset = end;
            if !prefetch {
                return;
            }
            if sequential {
                h.window = (h.window * 2).clamp(1, self.config.prefetch_max_chunks);
            } else {
                h.window = 0;
                h.last_requested = None;
            }
            let next = views::chunks_after(segments, fmt.bytes(), end, h.window, |f| {
                self.shared.files[f].chunk_elems
            });
            // Skip what this stream already requested (the list is in read
            // order, so everything up to the last request).
            let fresh = match h.last_requested {
                Some(last) => next.iter().position(|c| *c == last).map_or(0, |i| i + 1),
                None => 0,
            };
            if let Some(last) = next.last() {
                h.last_requested = Some(*last);
            }
            next.into_iter().skip(fresh).collect::<Vec<_>>()
        };
        for (f, c) in wanted {
            self.prefetch.request(f, c);
        }
    }

    /// A command written to `ctl`. Returns the bytes consumed.
    pub fn write_ctl(&self, data: &[u8]) -> std::result::Result<usize, i32> {
        let text = String::from_utf8_lossy(data);
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let result = match (line, &self.jobs) {
                ("drop-cache", _) => {
                    self.shared.cache.clear();
                    Ok("cache dropped".to_string())
                }
                (_, Some(jobs)) if line.starts_with("encode") || line.starts_with("cancel") => {
                    jobs.submit(line)
                }
                (_, None) if line.starts_with("encode") || line.starts_with("cancel") => {
                    Err("encoding jobs are not enabled on this mount".to_string())
                }
                (other, _) => Err(format!(
                    "unknown command {other:?} (commands: drop-cache, encode sk32|rknot|knot \
                     ... out=NAME, cancel JOB)"
                )),
            };
            match result {
                Ok(msg) => log::info!("ctl: {line}: {msg}"),
                Err(msg) => {
                    log::warn!("ctl: {line}: {msg}");
                    *lock(&self.last_ctl_error) = Some(format!("{line}: {msg}"));
                    return Err(libc::EINVAL);
                }
            }
        }
        Ok(data.len())
    }

    /// Offered model views.
    fn offered_views(&self) -> impl Iterator<Item = (&ViewFile, &Layout)> {
        self.views
            .iter()
            .filter_map(|v| v.layout.as_ref().ok().map(|l| (v, l)))
    }

    pub fn statfs(&self) -> StatFs {
        let per_elem: u64 = self.formats.iter().map(|f| f.bytes()).sum();
        let tensors = self.shared.files.iter().fold(0u64, |a, f| {
            a.saturating_add(f.n_elements.saturating_mul(per_elem))
        });
        let served = self
            .offered_views()
            .fold(tensors, |a, (_, l)| a.saturating_add(l.size()));
        StatFs {
            blocks: served.div_ceil(4096),
            files: 3
                + (self.shared.files.len() * self.formats.len()) as u64
                + self.offered_views().count() as u64,
            bsize: 4096,
            namelen: 255,
        }
    }

    /// The text served by `ctl`.
    pub fn ctl_text(&self) -> String {
        let s = self.shared.cache.stats();
        let b = self.shared.backend.as_ref();
        let src = |s: &SourceSummary| format!("{} ({} v{})", s.path.display(), s.format, s.version);
        let mut o = format!(
            "rknot-mount {}\nsource:    {}\n",
            env!("CARGO_PKG_VERSION"),
            src(b.summary())
        );
        if let Some(f) = b.fallback_summary() {
            o += &format!("fallback:  {}\n", src(f));
        }
        let c = &self.counters;
        o += &format!(
            "tensors:   {} tensors in {}: {} files ({} names)\n\
             mode:      {}\n\
             uptime_s:  {}\n\
             cache:     capacity {} B, used {} B in {} chunks of <= {} B, {} B of buffers pooled\n\
             cache:     hits {}, misses {} ({} waited for a decode in flight), evictions {}\n\
             cache:     bytes decoded {}, decode errors {}, decodes in flight {}\n\
             reads:     in flight {}, total {}, errors {}, bytes served {}, small uncached {}\n\
             prefetch:  threads {}, chunks requested {}, dropped {}\n\
             commands:  write one per line to this file: drop-cache{}\n",
            self.shared.files.len(),
            self.config.views.names(),
            self.shared.files.len() * self.formats.len(),
            self.entries
                .iter()
                .filter(|(_, ino)| self
                    .node(*ino)
                    .is_some_and(|n| matches!(n, Node::Tensor { .. })))
                .count(),
            if self.direct_io() {
                "direct_io"
            } else {
                "page cache (keep_cache)"
            },
            self.started.elapsed().as_secs(),
            s.capacity,
            s.bytes_used,
            s.chunks,
            self.config.chunk_bytes,
            s.pool_bytes,
            s.hits,
            s.misses,
            s.waits,
            s.evictions,
            s.bytes_decoded,
            s.decode_errors,
            s.in_flight,
            c.reads_in_flight.load(Ordering::Relaxed),
            c.reads.load(Ordering::Relaxed),
            c.read_errors.load(Ordering::Relaxed),
            c.bytes_served.load(Ordering::Relaxed),
            c.small_reads.load(Ordering::Relaxed),
            self.config.prefetch_threads,
            self.prefetch.requested(),
            self.prefetch.dropped(),
            if self.jobs.is_some() {
                ", encode sk32|rknot|knot ... out=NAME, cancel JOB"
            } else {
                ""
            },
        );
        if let Some(j) = &self.jobs {
            o += &j.to_text();
        }
        for v in &self.views {
            o += &match &v.layout {
                Ok(l) => format!(
                    "view:      {} ({}, {} B)\n",
                    v.view.name(),
                    v.view.format().dtype(),
                    l.size()
                ),
                Err(why) => format!("view:      {} absent: {why}\n", v.view.name()),
            };
        }
        if let Some(e) = lock(&self.last_ctl_error).as_ref() {
            o += &format!("last_error: {e}\n");
        }
        o
    }

    /// `ctl.json`: sources, cache and read counters, and the jobs.
    pub fn ctl_json(&self) -> Value {
        let s = self.shared.cache.stats();
        let b = self.shared.backend.as_ref();
        let src = |s: &SourceSummary| json!({"path": s.path.display().to_string(), "format": s.format.name(), "version": s.version});
        let c = &self.counters;
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "source": src(b.summary()),
            "fallback": b.fallback_summary().map(src),
            "mode": if self.direct_io() { "direct_io" } else { "page_cache" },
            "uptime_s": self.started.elapsed().as_secs(),
            "tensor_formats": self.config.views.names(),
            "cache": {
                "capacity": s.capacity, "bytes_used": s.bytes_used, "chunks": s.chunks,
                "chunk_bytes": self.config.chunk_bytes, "pool_bytes": s.pool_bytes,
                "hits": s.hits, "misses": s.misses, "waits": s.waits, "evictions": s.evictions,
                "bytes_decoded": s.bytes_decoded, "decode_errors": s.decode_errors, "decodes_in_flight": s.in_flight,
            },
            "reads": {
                "in_flight": c.reads_in_flight.load(Ordering::Relaxed),
                "total": c.reads.load(Ordering::Relaxed),
                "errors": c.read_errors.load(Ordering::Relaxed),
                "bytes_served": c.bytes_served.load(Ordering::Relaxed),
                "small_uncached": c.small_reads.load(Ordering::Relaxed),
            },
            "prefetch": {
                "threads": self.config.prefetch_threads,
                "chunks_requested": self.prefetch.requested(),
                "dropped": self.prefetch.dropped(),
            },
            "views": self.views.iter().map(|v| match &v.layout {
                Ok(l) => json!({"name": v.view.name(), "dtype": v.view.format().dtype(), "size": l.size()}),
                Err(why) => json!({"name": v.view.name(), "absent": why}),
            }).collect::<Vec<_>>(),
            "jobs_dir": self.jobs.as_ref().map(|j| j.jobs_dir().display().to_string()),
            "jobs": self.jobs.as_ref().map_or(Value::Array(Vec::new()), |j| j.to_json()),
            "last_error": lock(&self.last_ctl_error).clone(),
        })
    }

    /// index.json without the views section (see `render_index`).
    fn index_value(b: &dyn Backend, formats: &[ElemFormat]) -> Value {
        let mut v = report::inspect_json(&Lean::new(b));
        // Lean emptied the long arrays; say what they were.
        let full = report::effective_metadata(b);
        if let Some(md) = v.get_mut("metadata").and_then(Value::as_object_mut) {
            for (k, val) in &full.entries {
                if let MetaValue::Array { elem, values } = val
                    && values.len() > INDEX_ARRAY_LIMIT
                    && let Some(slot) = md.get_mut(k)
                {
                    *slot = json!({
                        "type": "array",
                        "elem_type": elem.name(),
                        "len": values.len(),
                        "omitted": true,
                    });
                }
            }
        }
        if let Some(ts) = v.get_mut("tensors").and_then(Value::as_array_mut) {
            for t in ts {
                if t["available"] == json!(true) {
                    let us = t["underscore_name"].as_str().unwrap_or_default();
                    let dot = t["name"].as_str().unwrap_or_default();
                    let mut files = Vec::new();
                    for fmt in formats {
                        files.push(format!("{us}.{}", fmt.ext()));
                        if us != dot {
                            files.push(format!("{dot}.{}", fmt.ext()));
                        }
                    }
                    t["files"] = json!(files);
                }
            }
        }
        v["views"] = json!({
            "tensor_formats": formats.iter().map(|f| f.ext()).collect::<Vec<_>>(),
            "metadata_from": view_metadata(b).1,
        });
        v
    }

    /// index.json: `inspect --json` (long metadata arrays summarized), each
    /// tensor's file names, and the views.
    fn render_index(mut v: Value, views: &[ViewFile]) -> Vec<u8> {
        let view_list: Vec<Value> = views
            .iter()
            .map(|vf| {
                let mut e = json!({
                    "name": vf.view.name(),
                    "kind": match vf.view {
                        ModelView::Gguf => "gguf",
                        ModelView::Safetensors(_) => "safetensors",
                    },
                    "dtype": vf.view.format().dtype(),
                    "available": vf.layout.is_ok(),
                });
                match &vf.layout {
                    Ok(l) => {
                        e["size"] = json!(l.size());
                        e["header_bytes"] = json!(l.header().len());
                        e["tensors"] = json!(l.segments().len());
                    }
                    Err(why) => e["unavailable_reason"] = json!(why),
                }
                if !vf.notes.is_empty() {
                    e["notes"] = json!(vf.notes);
                }
                e
            })
            .collect();
        v["views"]["files"] = json!(view_list);
        v["version"] = json!(env!("CARGO_PKG_VERSION"));
        let mut bytes = serde_json::to_vec_pretty(&v).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    pub fn n_tensor_files(&self) -> usize {
        self.shared.files.len()
    }

    pub fn cache_stats(&self) -> crate::cache::CacheStats {
        self.shared.cache.stats()
    }
}

fn slice_at(data: &[u8], offset: u64, size: u32) -> &[u8] {
    let start = (offset.min(data.len() as u64)) as usize;
    let end = (offset
        .saturating_add(u64::from(size))
        .min(data.len() as u64)) as usize;
    &data[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend;

    fn demo_fs(config: FsConfig) -> TensorFs {
        let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo");
        let b = backend::open(
            &d.join("tiny-llama.rknot"),
            Some(&d.join("tiny-llama.gguf")),
        )
        .unwrap();
        TensorFs::new(Arc::from(b), config)
    }

    fn expected(fs: &TensorFs, name: &str) -> Vec<u8> {
        let b = fs.backend();
        let i = b.find(name).unwrap();
        let mut v = vec![0f32; b.tensors().entries()[i].n_elements as usize];
        b.read_f32(i, 0, &mut v).unwrap();
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn open_fs(src: &str, dense: Option<&str>, config: FsConfig) -> TensorFs {
        let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo");
        let b = backend::open(&d.join(src), dense.map(|x| d.join(x)).as_deref()).unwrap();
        TensorFs::new(Arc::from(b), config)
    }

    fn all_views() -> ViewSet {
        ViewSet {
            f16: true,
            bf16: true,
        }
    }

    /// The whole of a file, read in pieces of `step` bytes through one
    /// handle.
    fn read_all(fs: &TensorFs, ino: u64, step: u32) -> Vec<u8> {
        let fh = fs.open(ino, false).unwrap().fh;
        let mut out = Vec::new();
        loop {
            let d = fs.read(ino, fh, out.len() as u64, step).unwrap();
            if d.bytes().is_empty() {
                break;
            }
            out.extend_from_slice(d.bytes());
        }
        fs.release(fh);
        out
    }

    fn encoded(vals: &[u8], fmt: ElemFormat) -> Vec<u8> {
        let v: Vec<f32> = vals
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        match fmt {
            ElemFormat::F32 => vals.to_vec(),
            ElemFormat::F16 => v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
            ElemFormat::Bf16 => v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        }
    }

    #[test]
    fn view_inodes_names_and_sizes() {
        let fs = demo_fs(FsConfig {
            views: all_views(),
            ..FsConfig::default()
        });
        for (name, ino) in [
            ("model.safetensors", 4),
            ("model.gguf", 5),
            ("model.f16.safetensors", 6),
            ("model.bf16.safetensors", 7),
        ] {
            let a = fs.lookup(ROOT_INO, name).unwrap();
            assert_eq!((a.ino, a.perm, a.nlink), (ino, 0o444, 1), "{name}");
        }
        let f32a = fs.lookup(ROOT_INO, "blk.0.attn_q.weight.f32").unwrap();
        for (ext, k) in [("f16", 1u64), ("bf16", 2)] {
            let a = fs
                .lookup(ROOT_INO, &format!("blk.0.attn_q.weight.{ext}"))
                .unwrap();
            let b = fs
                .lookup(ROOT_INO, &format!("blk_0_attn_q_weight.{ext}"))
                .unwrap();
            assert_eq!(a, b);
            assert_eq!(a.ino, f32a.ino + k * (1 << 32));
            assert_eq!((a.size, a.nlink), (f32a.size / 2, 2));
        }
        let n = fs.readdir(ROOT_INO).unwrap().len();
        assert_eq!(n, 2 + 2 + 4 + 21 * 2 * 3);
        // Without --views f16/bf16 the half files and views do not exist,
        // and the f32 inodes are the same.
        let plain = demo_fs(FsConfig::default());
        assert_eq!(
            plain.lookup(ROOT_INO, "blk.0.attn_q.weight.f16"),
            Err(libc::ENOENT)
        );
        assert_eq!(
            plain.lookup(ROOT_INO, "model.f16.safetensors"),
            Err(libc::ENOENT)
        );
        assert_eq!(plain.getattr(f32a.ino + (1 << 32)), Err(libc::ENOENT));
        assert_eq!(plain.getattr(6), Err(libc::ENOENT));
        assert_eq!(
            plain
                .lookup(ROOT_INO, "blk.0.attn_q.weight.f32")
                .unwrap()
                .ino,
            f32a.ino
        );
        assert_eq!(plain.open(5, true), Err(libc::EROFS));
    }

    #[test]
    fn building_and_reading_view_headers_decodes_nothing() {
        // No read-ahead threads: a reader at byte 0 gets a one-chunk window,
        // which would decode the first tensor's first chunk.
        let fs = demo_fs(FsConfig {
            views: all_views(),
            prefetch_threads: 0,
            ..FsConfig::default()
        });
        assert_eq!(fs.views.len(), 4);
        for v in &fs.views {
            let l = v.layout.as_ref().unwrap();
            let ino = v.view.ino();
            let fh = fs.open(ino, false).unwrap().fh;
            // The header and the padding up to the first tensor.
            let n = l.segments()[0].start as u32;
            let h = fs.read(ino, fh, 0, n).unwrap();
            assert_eq!(&h.bytes()[..l.header().len()], l.header());
        }
        let s = fs.cache_stats();
        assert_eq!((s.misses, s.bytes_decoded), (0, 0), "{s:?}");
    }

    #[test]
    fn gguf_view_is_write_gguf_of_the_decoded_tensors() {
        for (src, dense) in [
            ("tiny-llama.gguf", None),
            ("tiny-llama.rknot", Some("tiny-llama.gguf")),
            ("tiny-llama.sk32", Some("tiny-llama.gguf")),
        ] {
            let fs = open_fs(
                src,
                dense,
                FsConfig {
                    chunk_bytes: 4096,
                    ..FsConfig::default()
                },
            );
            let b = fs.backend().clone();
            let data: Vec<(String, Vec<u64>, Vec<u8>)> = b
                .tensors()
                .entries()
                .iter()
                .map(|t| {
                    (
                        t.name.dot.clone(),
                        t.shape.iter().rev().copied().collect(),
                        expected(&fs, &t.name.dot),
                    )
                })
                .collect();
            let tensors: Vec<(String, Vec<u64>, crate::quant::GgmlType, &[u8])> = data
                .iter()
                .map(|(n, ne, d)| (n.clone(), ne.clone(), crate::quant::GgmlType::F32, &d[..]))
                .collect();
            let (md, al) = views::gguf_metadata(view_metadata(b.as_ref()).0).unwrap();
            let mut want = Vec::new();
            crate::format::gguf::write_gguf(&mut want, &md, &tensors, al).unwrap();
            assert_eq!(fs.getattr(views::GGUF_INO).unwrap().size, want.len() as u64);
            // Odd read sizes straddle header, padding and tensor boundaries.
            for step in [4096, 1000, 65_537] {
                assert_eq!(
                    read_all(&fs, views::GGUF_INO, step),
                    want,
                    "{src} step {step}"
                );
            }
        }
    }

    #[test]
    fn safetensors_views_hold_every_tensor_in_order() {
        let fs = demo_fs(FsConfig {
            views: all_views(),
            chunk_bytes: 4096,
            ..FsConfig::default()
        });
        let b = fs.backend().clone();
        for (ino, fmt) in [
            (4, ElemFormat::F32),
            (6, ElemFormat::F16),
            (7, ElemFormat::Bf16),
        ] {
            let bytes = read_all(&fs, ino, 70_001);
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            assert_eq!(n % 8, 0);
            let header: serde_json::Map<String, Value> =
                serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let data = &bytes[8 + n..];
            let names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
            let want_names: Vec<&String> =
                b.tensors().entries().iter().map(|t| &t.name.dot).collect();
            assert_eq!(names, want_names, "backend order");
            let mut off = 0u64;
            for name in names {
                let e = &header[name.as_str()];
                assert_eq!(e["dtype"], fmt.dtype());
                let o = e["data_offsets"].as_array().unwrap();
                let (a, z) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
                assert_eq!(a, off, "contiguous");
                off = z;
                assert_eq!(
                    &data[a as usize..z as usize],
                    encoded(&expected(&fs, name), fmt),
                    "{name} {fmt:?}"
                );
            }
            assert_eq!(off as usize, data.len(), "data ends at EOF");
            let md = &header["__metadata__"];
            assert_eq!(md["general.architecture"], "llama");
            assert_eq!(md["llama.block_count"], "2");
            assert_eq!(md["llama.attention.layer_norm_rms_epsilon"], "1e-5");
            // Random reads of any size at any offset, past EOF included.
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let fh = fs.open(ino, false).unwrap().fh;
            for _ in 0..300 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let off = x % (bytes.len() as u64 + 100);
                let len = (x >> 40) as u32 % 20_000;
                let d = fs.read(ino, fh, off, len).unwrap();
                let lo = (off as usize).min(bytes.len());
                let hi = (off as usize + len as usize).min(bytes.len());
                assert_eq!(d.bytes(), &bytes[lo..hi], "{ino} {off}+{len}");
            }
        }
    }

    #[test]
    fn half_tensor_files_convert_the_f32_values() {
        let fs = demo_fs(FsConfig {
            views: all_views(),
            chunk_bytes: 4096,
            ..FsConfig::default()
        });
        for fmt in [ElemFormat::F16, ElemFormat::Bf16] {
            for name in [
                "blk.1.ffn_down.weight",
                "token_embd.weight",
                "output_norm.weight",
            ] {
                let ino = fs
                    .lookup(ROOT_INO, &format!("{name}.{}", fmt.ext()))
                    .unwrap()
                    .ino;
                let want = encoded(&expected(&fs, name), fmt);
                assert_eq!(read_all(&fs, ino, 3001), want, "{name} {fmt:?}");
                let fh = fs.open(ino, false).unwrap().fh;
                let end = want.len() as u64;
                for (off, len) in [(1u64, 3u32), (end / 2 - 1, 4), (end - 1, 9), (end, 5)] {
                    let d = fs.read(ino, fh, off, len).unwrap();
                    let lo = (off as usize).min(want.len());
                    let hi = (off as usize + len as usize).min(want.len());
                    assert_eq!(d.bytes(), &want[lo..hi]);
                }
            }
        }
        // f16 files share the f32 files' cached chunks: no second decode.
        let before = fs.cache_stats().bytes_decoded;
        let ino = fs
            .lookup(ROOT_INO, "blk.1.ffn_down.weight.f32")
            .unwrap()
            .ino;
        read_all(&fs, ino, 4096);
        assert_eq!(fs.cache_stats().bytes_decoded, before);
    }

    #[test]
    fn views_say_why_they_are_absent() {
        let index = |fs: &TensorFs| -> Value { serde_json::from_slice(&fs.index_json).unwrap() };
        let view = |v: &Value, name: &str| -> Value {
            v["views"]["files"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["name"] == name)
                .unwrap()
                .clone()
        };
        // A bare SK32: no metadata, so no model.gguf; the safetensors view
        // has the sketched tensors.
        let fs = open_fs("tiny-llama.sk32", None, FsConfig::default());
        let v = index(&fs);
        let g = view(&v, "model.gguf");
        assert_eq!(g["available"], false);
        let why = g["unavailable_reason"].as_str().unwrap();
        assert!(
            why.contains("general.architecture") && why.contains("--dense"),
            "{why}"
        );
        assert_eq!(fs.lookup(ROOT_INO, "model.gguf"), Err(libc::ENOENT));
        assert!(fs.ctl_text().contains("model.gguf absent"));
        let st = view(&v, "model.safetensors");
        assert_eq!(st["available"], true);
        assert_eq!(st["tensors"], fs.n_tensor_files());
        // .rknot alone: metadata, but only the compressed layers' tensors.
        let fs = open_fs("tiny-llama.rknot", None, FsConfig::default());
        let g = view(&index(&fs), "model.gguf");
        let why = g["unavailable_reason"].as_str().unwrap();
        assert!(why.contains("lack token_embd.weight"), "{why}");
        // Layered over the GGUF: both views, metadata from the fallback.
        let fs = demo_fs(FsConfig::default());
        let v = index(&fs);
        assert_eq!(v["views"]["metadata_from"], "fallback");
        assert_eq!(view(&v, "model.gguf")["available"], true);
        assert_eq!(v["views"]["tensor_formats"], json!(["f32"]));
        assert!(v["views"]["files"].as_array().unwrap().len() == 2);
        let t0 = &v["tensors"][0]["files"];
        assert_eq!(
            *t0,
            json!(["token_embd_weight.f32", "token_embd.weight.f32"])
        );
    }

    #[test]
    fn namespace_and_attributes() {
        let fs = demo_fs(FsConfig {
            uid: 7,
            gid: 8,
            ..FsConfig::default()
        });
        let a = fs.lookup(ROOT_INO, "blk.0.attn_q.weight.f32").unwrap();
        let b = fs.lookup(ROOT_INO, "blk_0_attn_q_weight.f32").unwrap();
        assert_eq!(a, b);
        assert_eq!(
            (a.size, a.perm, a.nlink, a.uid, a.gid),
            (256 * 256 * 4, 0o444, 2, 7, 8)
        );
        // token_embd, attn_norm, then attn_q: inode from the source's order.
        assert_eq!(a.ino, FIRST_TENSOR_INO + 2);
        assert_eq!(fs.lookup(ROOT_INO, "nope.f32"), Err(libc::ENOENT));
        assert_eq!(fs.lookup(a.ino, "x"), Err(libc::ENOENT));
        assert_eq!(fs.getattr(CTL_INO).unwrap().perm, 0o600);
        // ctl starts jobs with the daemon's rights: owned by the daemon's
        // user, not by -o uid=.
        // SAFETY: geteuid has no preconditions.
        assert_eq!(fs.getattr(CTL_INO).unwrap().uid, unsafe { libc::geteuid() });
        assert_eq!(fs.getattr(ROOT_INO).unwrap().kind, Kind::Dir);
        let names: Vec<String> = fs
            .readdir(ROOT_INO)
            .unwrap()
            .into_iter()
            .map(|e| e.2)
            .collect();
        // . .. index.json ctl model.safetensors model.gguf, 2 names per tensor.
        assert_eq!(names.len(), 2 + 2 + 2 + 21 * 2);
        assert!(names.contains(&"index.json".to_string()) && names.contains(&"ctl".to_string()));
        assert_eq!(fs.readdir(a.ino), Err(libc::ENOTDIR));
        assert_eq!(fs.statfs().files, 3 + 21 + 2);
    }

    #[test]
    fn reads_match_the_backend_at_any_offset() {
        let fs = demo_fs(FsConfig {
            chunk_bytes: 4096,
            ..FsConfig::default()
        });
        let ino = fs
            .lookup(ROOT_INO, "blk.1.ffn_down.weight.f32")
            .unwrap()
            .ino;
        let want = expected(&fs, "blk.1.ffn_down.weight");
        let fh = fs.open(ino, false).unwrap().fh;
        for (off, len) in [
            (0u64, 4096u32),
            (1, 3),
            (4095, 2),
            (4000, 70_000),
            (want.len() as u64 - 1, 10),
            (want.len() as u64, 10),
        ] {
            let d = fs.read(ino, fh, off, len).unwrap();
            let lo = (off as usize).min(want.len());
            let hi = (off as usize + len as usize).min(want.len());
            assert_eq!(d.bytes(), &want[lo..hi], "{off}+{len}");
        }
        // Sequential reads trigger read-ahead; everything still matches.
        let mut all = Vec::new();
        let mut off = 0;
        while off < want.len() as u64 {
            let d = fs.read(ino, fh, off, 10_000).unwrap();
            off += d.bytes().len() as u64;
            all.extend_from_slice(d.bytes());
        }
        assert_eq!(all, want);
        fs.release(fh);
        assert!(
            fs.ctl_text().contains("small uncached"),
            "{}",
            fs.ctl_text()
        );
    }

    #[test]
    fn writes_and_ctl_commands() {
        let fs = demo_fs(FsConfig::default());
        let ino = fs.lookup(ROOT_INO, "output.weight.f32").unwrap().ino;
        assert_eq!(fs.open(ino, true), Err(libc::EROFS));
        assert_eq!(fs.open(INDEX_INO, true), Err(libc::EROFS));
        assert_eq!(fs.open(ROOT_INO, false), Err(libc::EISDIR));
        assert!(fs.open(CTL_INO, true).unwrap().direct_io);
        let fh = fs.open(ino, false).unwrap().fh;
        fs.read(ino, fh, 0, 1 << 20).unwrap();
        assert!(fs.cache_stats().bytes_used > 0);
        assert_eq!(fs.write_ctl(b"drop-cache\n"), Ok(11));
        assert_eq!(fs.cache_stats().bytes_used, 0);
        assert_eq!(fs.write_ctl(b"explode\n"), Err(libc::EINVAL));
        assert!(fs.ctl_text().contains("unknown command \"explode\""));
        let index: serde_json::Value = serde_json::from_slice(&fs.index_json).unwrap();
        assert_eq!(index["tensors"].as_array().unwrap().len(), 21);
        assert_eq!(index["fallback"]["format"], "gguf");
        let tok = &index["metadata"]["tokenizer.ggml.tokens"];
        assert_eq!(
            tok["value"].as_array().unwrap().len(),
            256,
            "short arrays are kept whole"
        );
    }
}
