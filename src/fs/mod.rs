//! The filesystem: what the mount shows and how a read is served, with no
//! FUSE types (the kernel adapter is [`fuse`]). Tests drive this layer
//! directly; the integration tests drive it through a real mount.
//!
//! Namespace (one flat directory):
//! - `<underscore name>.f32` and `<dot name>.f32`: two names (hard links) of
//!   one inode per available tensor, mode 0444, size = elements × 4; with
//!   `--views f16` / `bf16` also `.f16` / `.bf16` files (elements × 2);
//!   for a safetensors checkpoint of a known family, each tensor's Hugging
//!   Face name too, rows as the checkpoint stores them ([`aliases`]);
//! - `model.safetensors` and `model.gguf`: the whole model as one file an
//!   engine loads directly, and `model.f16.safetensors` /
//!   `model.bf16.safetensors` when those formats are asked for ([`views`]);
//! - `index.json`: every tensor (names, shape, stored type, source, sizes),
//!   the model metadata and the views (which exist, and why any does not);
//! - `ctl`: live status (version, sources, cache statistics, reads in
//!   flight); writing a command line to it (`drop-cache`, job commands)
//!   acts on the daemon;
//! - `ctl.json`: the same status for tools, readable by everyone who can
//!   read the mount (`ctl` is its owner's: 0600);
//! - with encoding jobs on: `jobs/` (one file per job, `jobs/N`);
//! - for llama and qwen2 models, `hf/`: a Hugging Face checkpoint directory
//!   (`config.json`, `generation_config.json`, `tokenizer.json`,
//!   `tokenizer_config.json`, `model.safetensors` with HF names and llama's
//!   Q/K rows in HF order; [`hf`]).
//!
//! Inode numbers: 1 root, 2 `index.json`, 3 `ctl`, 4..=7 the model views,
//! 8 `ctl.json`, 9 `jobs/`, `2^48 + n` for `jobs/n`,
//! `16 + i + k * 2^32` for the i-th tensor in the backend's order in
//! format k (0 f32, 1 f16, 2 bf16), and `2^47 + j` for `hf/` (j = 0) and
//! its files (j = 1..=7, [`hf`]), `2^46 +` a tensor file's inode for its
//! Hugging Face-named file when the rows differ ([`aliases`]): all fixed
//! by the source files, so they
//! are stable across remounts of the same files. The tensor inodes end
//! below `3 * 2^32 + 16`, far under `2^47`.
//!
//! Every file with tensor bytes in it (tensor files in any format, model
//! views) is served from one decoded-chunk cache of f32 values, keyed by
//! tensor: a view read that spans tensors assembles its reply from several
//! tensors' chunks, and f16/bf16 are converted from the cached f32 chunk.
//!
//! Layout by concern, bottom up: [`elem`] (element formats and the f32 →
//! f16/bf16 conversion), [`inodes`] (the inode map), [`views`] (engine
//! views: layouts and their builders), [`files`] (the records of served
//! files), [`hf`] (the Hugging Face view), [`aliases`] (a checkpoint's
//! Hugging Face-named files), [`namespace`] (names,
//! attributes, listings),
//! [`read`] (the read path over the cache), [`ctl`] (the control files:
//! snapshots, commands, who may command), [`index`] (index.json, served in
//! pages), [`prefetch`] (read-ahead threads), [`passthrough`] (opens
//! served from the decoded-file store), [`fuse`] (the fuser adapter). Each
//! uses only those before it (and this module's shared types).

mod aliases;
mod ctl;
mod elem;
mod files;
pub mod fuse;
pub mod hf;
mod index;
mod inodes;
mod namespace;
mod native_read;
pub mod passthrough;
pub mod precision;
mod prefetch;
mod read;
pub mod views;

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use crate::backend::Backend;
use crate::cache::{BlockCache, Chunk};
pub use ctl::MAX_LINE as MAX_CTL_LINE;
pub use files::MAX_FILE_BYTES;
use inodes::{FORMAT_INO_STRIDE, HF_DIR_INO};
pub use namespace::{PartialModel, partial_model};
use views::{ElemFormat, ModelView, ViewSet};

pub use inodes::{
    CTL_INO, CTL_JSON_INO, CTL_JSON_NAME, CTL_NAME, FIRST_TENSOR_INO, INDEX_INO, INDEX_NAME,
    JOB_INO_BASE, JOBS_DIR_INO, JOBS_DIR_NAME, ROOT_INO, tensor_ino,
};

/// Default decoded bytes per cache chunk: the largest FUSE read (1 MiB), so
/// an aligned 1 MiB read is served from one chunk without a copy.
pub const DEFAULT_CHUNK_BYTES: u64 = 1 << 20;

/// Reads up to this size that miss the cache and are not part of a
/// sequential stream decode only their own bytes (see `read_tensor`).
pub const SMALL_READ_BYTES: u64 = 64 * 1024;

/// Settings of one mount.
#[derive(Debug, Clone)]
pub struct FsConfig {
    pub uid: u32,
    pub gid: u32,
    /// Serve tensor files with FOPEN_DIRECT_IO instead of the page cache.
    pub direct_io: bool,
    pub cache_bytes: u64,
    pub chunk_bytes: u64,
    /// Background decode threads for read-ahead (0 disables it; a cache of
    /// fewer than two chunks disables it too).
    pub prefetch_threads: usize,
    /// Largest read-ahead window, in chunks. `TensorFs::new` lowers it to
    /// half the chunks the cache holds (`prefetch::max_window_chunks`).
    pub prefetch_max_chunks: u64,
    /// Tensor formats served besides f32 (`--views`).
    pub views: ViewSet,
    /// The dtype of `model.safetensors` and `hf/` (`-o hf_dtype=`).
    pub hf_dtype: precision::HfDtype,
    /// Encoding jobs through `ctl` (None: not offered).
    pub jobs: Option<JobsConfig>,
    /// Manifest checks of the backend (`--manifest`): reported in `ctl`;
    /// a failed whole-file check under `unverified=allow` drops the cache.
    pub integrity: Option<Arc<crate::integrity::manifest::MountIntegrity>>,
    /// The decoded-file store (`--decoded-cache`) and whether opens may be
    /// served from it by passthrough.
    pub decoded: Option<passthrough::DecodedSetup>,
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
            hf_dtype: precision::HfDtype::Auto,
            jobs: None,
            integrity: None,
            decoded: None,
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

/// Who is asking: the credentials of a FUSE request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

pub struct TensorFs {
    shared: Arc<read::Shared>,
    config: FsConfig,
    ns: namespace::Namespace,
    index: index::IndexJson,
    started: Instant,
    counters: read::Counters,
    streams: read::Streams,
    next_fh: AtomicU64,
    prefetch: prefetch::Prefetcher,
    ctl: ctl::Ctl,
    /// Shared with the signal thread, which cancels jobs at the first stop
    /// signal (mount::stop).
    jobs: Option<Arc<crate::jobs::JobManager>>,
    /// Direct I/O as configured, unless the kernel cannot mmap such files.
    direct_io: AtomicBool,
    /// The decoded-file store, with `--decoded-cache`.
    decoded: Option<passthrough::Decoded>,
}

impl TensorFs {
    pub fn new(backend: Arc<dyn Backend>, mut config: FsConfig) -> TensorFs {
        // The inode scheme gives each format 2^32 - 16 tensor inodes; no
        // file a reader accepts holds that many tensors, but a larger table
        // must not make inodes collide.
        let n_tensors = backend.tensors().len() as u64;
        if n_tensors > FORMAT_INO_STRIDE - FIRST_TENSOR_INO && config.views != ViewSet::default() {
            log::warn!("{n_tensors} tensors: too many for .f16/.bf16 inodes; serving f32 only");
            config.views = ViewSet::default();
        }
        let formats = config.views.formats();
        let (files, unserved) = namespace::tensor_files(backend.as_ref(), &config);
        for (name, why) in &unserved {
            log::warn!("{name} gets no file: {why}");
        }
        // The views' headers (megabytes for a large vocabulary) are built
        // on two threads, GGUF and safetensors apart: the GGUF one is the
        // longest job.
        let started = Instant::now();
        let precision = precision::Precision::decide(
            backend.as_ref(),
            &files,
            config.hf_dtype,
            &formats[1..],
            config.integrity.is_none(),
        );
        log::info!(
            "model.safetensors and hf/ in {} ({})",
            precision.main.dtype(),
            precision.reason
        );
        let main = precision.main;
        let requested: Vec<ModelView> = ModelView::ALL
            .into_iter()
            .filter(|v| v.requested(config.views))
            .collect();
        let hf_formats: Vec<ElemFormat> = requested
            .iter()
            .filter(|v| v.in_hf_dir())
            .map(|v| v.format())
            .collect();
        let (gguf, safetensors): (Vec<ModelView>, Vec<ModelView>) = requested
            .iter()
            .filter(|v| !v.in_hf_dir())
            .partition(|v| **v == ModelView::Gguf);
        let (mut views, views_ms, hf_dir) = std::thread::scope(|s| {
            // hf/ (its header, config and tokenizer JSON) on a third thread.
            let hf = {
                let (b, files, formats) = (backend.as_ref(), &files, &hf_formats);
                s.spawn(move || hf::build(b, files, formats, main))
            };
            let build = |which: Vec<ModelView>| {
                let (b, files) = (backend.as_ref(), &files);
                s.spawn(move || {
                    let t = Instant::now();
                    (
                        namespace::build_views(b, files, &which, main),
                        t.elapsed().as_secs_f64() * 1e3,
                    )
                })
            };
            let handles = [build(gguf), build(safetensors)];
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
            let hf_dir = match hf.join() {
                Ok(built) => {
                    views.0.extend(built.views);
                    built.dir
                }
                Err(_) => {
                    log::error!("building hf/ failed (a bug); it is not offered");
                    Err("internal error while building hf/".to_string())
                }
            };
            (views.0, views.1, hf_dir)
        });
        views.sort_by_key(|v| ModelView::ALL.iter().position(|x| *x == v.view));
        // Never a silent precision loss: a view that rounds says so in its
        // notes (index.json, ctl) and once in the log.
        for v in &mut views {
            let Some(note) = precision.rounding_of(v) else {
                continue;
            };
            {
                log::warn!("{} ({}): {note}", v.view.name(), v.dtype());
                v.notes.push(note);
            }
        }
        let jobs = config.jobs.as_ref().map(|j| {
            crate::jobs::JobManager::new(
                j.dir.clone(),
                crate::jobs::JobSource::of_mount(&backend),
                j.max_running,
                j.threads,
            )
        });
        let jobs = jobs.map(Arc::new);
        let ns = namespace::Namespace::new(
            backend.as_ref(),
            &files,
            unserved,
            formats,
            namespace::ServedViews { views, precision },
            hf_dir,
            jobs.is_some(),
        );
        let index = index::IndexJson::build(backend.as_ref(), &ns);
        log::info!(
            "namespace built in {:.1} ms (views {views_ms:.1} ms; index.json {} B): {}",
            started.elapsed().as_secs_f64() * 1e3,
            index.len(),
            ns.views
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
        // Read-ahead never reaches further than half the cache holds (see
        // `prefetch`); what ctl reports is what is used.
        config.prefetch_max_chunks = prefetch::max_window_chunks(
            config.cache_bytes,
            config.chunk_bytes,
            config.prefetch_max_chunks,
        );
        if config.prefetch_max_chunks == 0 {
            config.prefetch_threads = 0;
        }
        let shared = Arc::new(read::Shared {
            backend,
            cache: BlockCache::new(config.cache_bytes),
            files,
        });
        if let Some(i) = &config.integrity {
            // A whole-file check that fails after reads were served
            // (unverified=allow): what was decoded meanwhile is not served
            // again. Weak: the checks must not keep the cache alive.
            let weak = Arc::downgrade(&shared);
            i.on_failure(move || {
                if let Some(s) = weak.upgrade() {
                    s.cache.clear();
                }
            });
        }
        let decoded = config.decoded.as_ref().map(|setup| {
            let d =
                passthrough::Decoded::new(setup, passthrough::source_ids(shared.backend.as_ref()));
            // Under unverified=allow a whole-file check may fail after bytes
            // were served; files decoded meanwhile must not outlive the
            // mount in the store.
            if let Some(i) = &config.integrity {
                use crate::integrity::manifest::{FileCheck, Unverified};
                let whole = i.files().iter().any(|(_, c)| *c == FileCheck::WholeFile);
                if whole && i.unverified() == Unverified::Allow {
                    d.disable(
                        "a manifest checks a whole file in the background under unverified=allow",
                    );
                }
            }
            d
        });
        let prefetch = prefetch::Prefetcher::start(
            shared.clone(),
            config.prefetch_threads,
            config.prefetch_max_chunks,
        );
        TensorFs {
            shared,
            ns,
            index,
            started: Instant::now(),
            counters: read::Counters::default(),
            streams: read::Streams::default(),
            next_fh: AtomicU64::new(1),
            prefetch,
            ctl: ctl::Ctl::new(),
            direct_io: AtomicBool::new(config.direct_io),
            decoded,
            jobs,
            config,
        }
    }

    /// The encoding jobs, for the daemon's signal thread: it cancels them
    /// on a stop signal while this filesystem belongs to the FUSE session.
    pub fn jobs(&self) -> Option<Arc<crate::jobs::JobManager>> {
        self.jobs.clone()
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

    /// Open a file for `caller`. Only `ctl` may be opened for writing (by
    /// root and the daemon's user, see [`ctl`]); anything else opened for
    /// writing is EROFS (root would pass the mode bits).
    pub fn open(
        &self,
        ino: u64,
        read: bool,
        write: bool,
        caller: Caller,
    ) -> std::result::Result<OpenMode, i32> {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let live = OpenMode {
            fh,
            keep_cache: false,
            direct_io: true,
        };
        match ino {
            ROOT_INO => Err(libc::EISDIR),
            JOBS_DIR_INO if self.jobs.is_some() => Err(libc::EISDIR),
            HF_DIR_INO if self.ns.hf.is_ok() => Err(libc::EISDIR),
            _ if self.is_live(ino) && self.getattr(ino).is_ok() => {
                self.open_ctl(ino, fh, read, write, caller)?;
                Ok(live)
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
            _ if self.hf_file(ino).is_some() => Ok(OpenMode {
                fh,
                keep_cache: true,
                direct_io: false,
            }),
            _ => {
                self.node(ino).ok_or(libc::ENOENT)?;
                self.streams.open(fh);
                let dio = self.direct_io();
                Ok(OpenMode {
                    fh,
                    keep_cache: !dio,
                    direct_io: dio,
                })
            }
        }
    }

    /// Serve `[offset, offset + size)` of a file. Tensor and view reads
    /// decode only the chunks that overlap the range; errors are logged
    /// (rate-limited) and become EIO (or the error's errno).
    pub fn read(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> std::result::Result<ReadData, i32> {
        self.read_in_order(ino, fh, offset, size, None)
    }

    /// [`TensorFs::read`] for the FUSE request with unique id `unique`:
    /// the kernel numbers its requests in the order it sends them, and
    /// concurrent reads get the decoded-chunk cache in that order, not in
    /// the order the FUSE threads happen to start them (see
    /// `BlockCache::begin_read`).
    pub fn read_request(
        &self,
        unique: u64,
        ino: u64,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> std::result::Result<ReadData, i32> {
        self.read_in_order(ino, fh, offset, size, Some(unique))
    }

    fn read_in_order(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        size: u32,
        order: Option<u64>,
    ) -> std::result::Result<ReadData, i32> {
        match ino {
            INDEX_INO => Ok(ReadData::Owned(self.index.read(
                self.shared.backend.as_ref(),
                &self.ns,
                offset,
                size,
            ))),
            ROOT_INO | JOBS_DIR_INO | HF_DIR_INO => Err(libc::EISDIR),
            _ if let Some(f) = self.hf_file(ino) => Ok(ReadData::Owned(f.read(
                self.shared.backend.as_ref(),
                offset,
                size,
            ))),
            // Control files, from their handle's snapshot. The inode is
            // checked first: a tensor read takes no lock of ctl's.
            _ if (matches!(ino, CTL_INO | CTL_JSON_INO) || ino >= JOB_INO_BASE)
                && self.ctl.is_open(fh) =>
            {
                Ok(ReadData::Owned(self.read_ctl(fh, offset, size)?))
            }
            _ if self.is_live(ino) => Err(libc::EBADF),
            _ => {
                let node = self.node(ino).ok_or(libc::ENOENT)?;
                self.read_node(&node, fh, offset, size, order)
            }
        }
    }

    /// `close()` of a descriptor (FUSE flush): runs a command left without
    /// a newline in `ctl`.
    pub fn flush(&self, fh: u64, caller: Caller) -> std::result::Result<(), i32> {
        self.flush_ctl(fh, Some(caller))
    }

    /// The last close of an open file.
    pub fn release(&self, fh: u64) {
        self.streams.release(fh);
        if self.ctl.is_open(fh) {
            self.release_ctl(fh);
        }
    }

    pub fn n_tensor_files(&self) -> usize {
        self.shared.files.len()
    }

    /// Whether a read of `ino` may wait for a whole-file manifest check
    /// (`-o unverified=hold` while one runs): the FUSE adapter serves such
    /// reads on threads of their own.
    pub fn read_may_wait(&self, ino: u64) -> bool {
        let data = (FIRST_TENSOR_INO..HF_DIR_INO).contains(&ino)
            || ModelView::ALL.iter().any(|v| v.ino() == ino);
        data && self.config.integrity.as_ref().is_some_and(|i| i.may_hold())
    }

    /// Every inode with tensor bytes in it (tensor files in each format,
    /// model views): what the kernel must forget when bytes it cached are
    /// withdrawn.
    pub fn data_inodes(&self) -> Vec<u64> {
        let mut inos: Vec<u64> = (0..self.shared.files.len())
            .flat_map(|f| self.ns.formats.iter().map(move |fmt| tensor_ino(f, *fmt)))
            .collect();
        inos.extend(self.ns.views.iter().map(|v| v.view.ino()));
        inos.extend(self.alias_inodes());
        inos
    }

    pub fn cache_stats(&self) -> crate::cache::CacheStats {
        self.shared.cache.stats()
    }

    /// index.json, whole (tests and tools; the mount serves it in pages).
    pub fn index_json(&self) -> Vec<u8> {
        let len = self.index.len();
        let mut out = Vec::with_capacity(len as usize);
        while (out.len() as u64) < len {
            let page = self.index.read(
                self.shared.backend.as_ref(),
                &self.ns,
                out.len() as u64,
                1 << 20,
            );
            if page.is_empty() {
                break;
            }
            out.extend_from_slice(&page);
        }
        out
    }
}

#[cfg(test)]
mod tests;
