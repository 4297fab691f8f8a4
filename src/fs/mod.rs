//! The filesystem: what the mount shows and how a read is served, with no
//! FUSE types (the kernel adapter is [`fuse`]). Tests drive this layer
//! directly; the integration tests drive it through a real mount.
//!
//! Namespace (one flat directory):
//! - `<underscore name>.f32` and `<dot name>.f32`: two names (hard links) of
//!   one inode per available tensor, mode 0444, size = elements × 4;
//! - `index.json`: every tensor (names, shape, stored type, source, sizes)
//!   and the model metadata;
//! - `ctl`: live status (version, sources, cache statistics, reads in
//!   flight); writing a command line to it (`drop-cache`) acts on the daemon.
//!
//! Inode numbers: 1 root, 2 `index.json`, 3 `ctl`, and `16 + i` for the
//! i-th tensor in the backend's order, which is fixed by the source files,
//! so they are stable across remounts of the same files.

pub mod fuse;
mod prefetch;

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use serde_json::{Value, json};

use crate::backend::{Backend, SourceSummary};
use crate::cache::{BlockCache, Chunk, ChunkKey};
use crate::error::Result;
use crate::report;

pub const ROOT_INO: u64 = 1;
pub const INDEX_INO: u64 = 2;
pub const CTL_INO: u64 = 3;
pub const FIRST_TENSOR_INO: u64 = 16;

pub const INDEX_NAME: &str = "index.json";
pub const CTL_NAME: &str = "ctl";

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
    size: u64,
    chunk_elems: u64,
    mtime: SystemTime,
    nlink: u32,
}

/// Read-ahead state of one open file handle.
#[derive(Debug, Default)]
struct HandleState {
    next_offset: u64,
    window: u64,
}

/// Everything the read path shares with the prefetch threads.
pub(crate) struct Shared {
    backend: Arc<dyn Backend>,
    cache: BlockCache,
    files: Vec<TensorFile>,
}

impl Shared {
    /// Decode chunk `chunk` of tensor file `f` through the cache.
    fn chunk(&self, f: usize, chunk: u64) -> Result<Chunk> {
        let file = &self.files[f];
        let key = ChunkKey {
            tensor: f as u32,
            chunk,
        };
        let n_elems = file.size / 4;
        let first = chunk * file.chunk_elems;
        let len = file.chunk_elems.min(n_elems.saturating_sub(first)) as usize;
        self.cache.get_or_decode(key, len, |buf| {
            self.backend.read_f32(file.index, first, buf)
        })
    }

    fn n_chunks(&self, f: usize) -> u64 {
        let file = &self.files[f];
        (file.size / 4).div_ceil(file.chunk_elems)
    }
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    read_errors: AtomicU64,
    reads_in_flight: AtomicU64,
    small_reads: AtomicU64,
    bytes_served: AtomicU64,
    ctl_commands: AtomicU64,
}

pub struct TensorFs {
    shared: Arc<Shared>,
    config: FsConfig,
    /// Directory entries in listing order: (name, ino).
    entries: Vec<(String, u64)>,
    by_name: HashMap<String, u64>,
    index_json: Vec<u8>,
    root_mtime: SystemTime,
    started: Instant,
    counters: Counters,
    handles: Mutex<HashMap<u64, HandleState>>,
    next_fh: AtomicU64,
    prefetch: prefetch::Prefetcher,
    last_ctl_error: Mutex<Option<String>>,
    /// Direct I/O as configured, unless the kernel cannot mmap such files.
    direct_io: std::sync::atomic::AtomicBool,
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

impl TensorFs {
    pub fn new(backend: Arc<dyn Backend>, config: FsConfig) -> TensorFs {
        let mut files = Vec::new();
        let mut entries = vec![
            (INDEX_NAME.to_string(), INDEX_INO),
            (CTL_NAME.to_string(), CTL_INO),
        ];
        for (i, t) in backend.tensors().entries().iter().enumerate() {
            if !t.is_available() {
                continue;
            }
            let ino = FIRST_TENSOR_INO + files.len() as u64;
            let dot = format!("{}.f32", t.name.dot);
            let us = format!("{}.f32", t.name.underscore);
            let nlink = if dot == us { 1 } else { 2 };
            entries.push((us.clone(), ino));
            if dot != us {
                entries.push((dot, ino));
            }
            files.push(TensorFile {
                index: i,
                size: t.served_bytes(),
                chunk_elems: chunk_elems_for(t.granule, config.chunk_bytes),
                mtime: mtime_of(&t.origin.path),
                nlink,
            });
        }
        let by_name = entries.iter().cloned().collect();
        let root_mtime = mtime_of(&backend.summary().path);
        let index_json = Self::render_index(backend.as_ref());
        let shared = Arc::new(Shared {
            backend,
            cache: BlockCache::new(config.cache_bytes),
            files,
        });
        let prefetch = prefetch::Prefetcher::start(shared.clone(), config.prefetch_threads);
        TensorFs {
            shared,
            entries,
            by_name,
            index_json,
            root_mtime,
            started: Instant::now(),
            counters: Counters::default(),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            prefetch,
            last_ctl_error: Mutex::new(None),
            direct_io: std::sync::atomic::AtomicBool::new(config.direct_io),
            config,
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.shared.backend
    }

    pub fn config(&self) -> &FsConfig {
        &self.config
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

    fn file_index(&self, ino: u64) -> Option<usize> {
        let i = ino.checked_sub(FIRST_TENSOR_INO)? as usize;
        (i < self.shared.files.len()).then_some(i)
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
            // Live content: size 0, read with direct I/O (like /proc).
            CTL_INO => Ok(Attr {
                perm: 0o600,
                mtime: SystemTime::now(),
                ..base
            }),
            _ => {
                let f = &self.shared.files[self.file_index(ino).ok_or(libc::ENOENT)?];
                Ok(Attr {
                    size: f.size,
                    nlink: f.nlink,
                    mtime: f.mtime,
                    ..base
                })
            }
        }
    }

    pub fn lookup(&self, parent: u64, name: &str) -> std::result::Result<Attr, i32> {
        if parent != ROOT_INO {
            return Err(libc::ENOENT);
        }
        let ino = *self.by_name.get(name).ok_or(libc::ENOENT)?;
        self.getattr(ino)
    }

    /// Directory listing: ".", "..", then every entry, as (ino, kind, name).
    pub fn readdir(&self, ino: u64) -> std::result::Result<Vec<(u64, Kind, String)>, i32> {
        if ino != ROOT_INO {
            return Err(libc::ENOTDIR);
        }
        let mut v = vec![
            (ROOT_INO, Kind::Dir, ".".to_string()),
            (ROOT_INO, Kind::Dir, "..".to_string()),
        ];
        v.extend(
            self.entries
                .iter()
                .map(|(n, i)| (*i, Kind::File, n.clone())),
        );
        Ok(v)
    }

    /// Open a file. Only `ctl` may be opened for writing; anything else
    /// opened for writing is EROFS (root would pass the mode bits).
    pub fn open(&self, ino: u64, write: bool) -> std::result::Result<OpenMode, i32> {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        match ino {
            ROOT_INO => Err(libc::EISDIR),
            CTL_INO => Ok(OpenMode {
                fh,
                keep_cache: false,
                direct_io: true,
            }),
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
                self.file_index(ino).ok_or(libc::ENOENT)?;
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
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serve `[offset, offset + size)` of a file. Tensor reads decode only
    /// the chunks that overlap the range; errors are logged and become EIO.
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
            ROOT_INO => Err(libc::EISDIR),
            _ => {
                let f = self.file_index(ino).ok_or(libc::ENOENT)?;
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .reads_in_flight
                    .fetch_add(1, Ordering::Relaxed);
                let r = self.read_tensor(f, fh, offset, size);
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
                        log::error!(
                            "read of {} bytes at {offset} of {}: {e}",
                            size,
                            self.tensor_name(f)
                        );
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

    fn read_tensor(&self, f: usize, fh: u64, offset: u64, size: u32) -> Result<ReadData> {
        let file = &self.shared.files[f];
        if offset >= file.size || size == 0 {
            return Ok(ReadData::Owned(Vec::new()));
        }
        let end = file.size.min(offset + u64::from(size));
        let cb = file.chunk_elems * 4;
        let (c0, c1) = (offset / cb, (end - 1) / cb);
        let key = ChunkKey {
            tensor: f as u32,
            chunk: c0,
        };
        // A small read that is not continuing a sequential stream and whose
        // chunk is not cached decodes just its own elements, uncached: a
        // random 4 KiB read must not pay for a whole chunk.
        let small = end - offset <= SMALL_READ_BYTES
            && c0 == c1
            && !self.is_sequential(fh, offset)
            && !self.shared.cache.is_present(key);
        let data = if small {
            self.counters.small_reads.fetch_add(1, Ordering::Relaxed);
            let (e0, e1) = (offset / 4, end.div_ceil(4));
            let mut v = vec![0f32; (e1 - e0) as usize];
            self.shared.backend.read_f32(file.index, e0, &mut v)?;
            let skip = (offset - e0 * 4) as usize;
            ReadData::Owned(
                bytemuck::cast_slice::<f32, u8>(&v)[skip..skip + (end - offset) as usize].to_vec(),
            )
        } else if c0 == c1 {
            let chunk = self.shared.chunk(f, c0)?;
            let base = c0 * cb;
            ReadData::Chunk(chunk, (offset - base) as usize..(end - base) as usize)
        } else {
            let mut out = Vec::with_capacity((end - offset) as usize);
            for c in c0..=c1 {
                let chunk = self.shared.chunk(f, c)?;
                let bytes = bytemuck::cast_slice::<f32, u8>(&chunk);
                let base = c * cb;
                let lo = offset.max(base) - base;
                let hi = end.min(base + bytes.len() as u64) - base;
                out.extend_from_slice(&bytes[lo as usize..hi as usize]);
            }
            ReadData::Owned(out)
        };
        self.after_read(f, fh, offset, end, c1);
        Ok(data)
    }

    fn is_sequential(&self, fh: u64, offset: u64) -> bool {
        self.lock_handles()
            .get(&fh)
            .is_some_and(|h| h.next_offset == offset && offset > 0)
    }

    /// Sequential readers get a read-ahead window that doubles on each
    /// sequential read (up to the configured maximum) and resets on a seek.
    fn after_read(&self, f: usize, fh: u64, offset: u64, end: u64, last_chunk: u64) {
        if self.config.prefetch_threads == 0 {
            return;
        }
        let window = {
            let mut handles = self.lock_handles();
            let Some(h) = handles.get_mut(&fh) else {
                return;
            };
            if offset == h.next_offset {
                h.window = (h.window * 2).clamp(1, self.config.prefetch_max_chunks);
            } else {
                h.window = 0;
            }
            h.next_offset = end;
            h.window
        };
        let n = self.shared.n_chunks(f);
        for c in last_chunk + 1..n.min(last_chunk + 1 + window) {
            self.prefetch.request(f, c);
        }
    }

    /// A command written to `ctl`. Returns the bytes consumed.
    pub fn write_ctl(&self, data: &[u8]) -> std::result::Result<usize, i32> {
        let text = String::from_utf8_lossy(data);
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            self.counters.ctl_commands.fetch_add(1, Ordering::Relaxed);
            match line {
                "drop-cache" => {
                    self.shared.cache.clear();
                    log::info!("ctl: drop-cache");
                }
                other => {
                    let msg = format!("unknown command {other:?} (commands: drop-cache)");
                    log::warn!("ctl: {msg}");
                    *self
                        .last_ctl_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(msg);
                    return Err(libc::EINVAL);
                }
            }
        }
        Ok(data.len())
    }

    pub fn statfs(&self) -> StatFs {
        let served: u64 = self
            .shared
            .files
            .iter()
            .fold(0u64, |a, f| a.saturating_add(f.size));
        StatFs {
            blocks: served.div_ceil(4096),
            files: 3 + self.shared.files.len() as u64,
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
            "tensors:   {} files ({} names)\n\
             mode:      {}\n\
             uptime_s:  {}\n\
             cache:     capacity {} B, used {} B in {} chunks of <= {} B, {} B of buffers pooled\n\
             cache:     hits {}, misses {} ({} waited for a decode in flight), evictions {}\n\
             cache:     bytes decoded {}, decode errors {}, decodes in flight {}\n\
             reads:     in flight {}, total {}, errors {}, bytes served {}, small uncached {}\n\
             prefetch:  threads {}, chunks requested {}, dropped {}\n\
             commands:  write one per line to this file: drop-cache\n",
            self.shared.files.len(),
            self.entries.len() - 2,
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
        );
        if let Some(e) = self
            .last_ctl_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            o += &format!("last_error: {e}\n");
        }
        o
    }

    fn render_index(b: &dyn Backend) -> Vec<u8> {
        let mut v = report::inspect_json(b);
        if let Some(md) = v.get_mut("metadata").and_then(Value::as_object_mut) {
            for val in md.values_mut() {
                let long = val
                    .get("value")
                    .and_then(Value::as_array)
                    .is_some_and(|a| a.len() > INDEX_ARRAY_LIMIT);
                if long {
                    let len = val["value"].as_array().map_or(0, Vec::len);
                    *val = json!({
                        "type": "array",
                        "elem_type": val["elem_type"].clone(),
                        "len": len,
                        "omitted": true,
                    });
                }
            }
        }
        if let Some(ts) = v.get_mut("tensors").and_then(Value::as_array_mut) {
            for t in ts {
                if t["available"] == json!(true) {
                    let us = format!("{}.f32", t["underscore_name"].as_str().unwrap_or_default());
                    let dot = format!("{}.f32", t["name"].as_str().unwrap_or_default());
                    t["files"] = if us == dot {
                        json!([us])
                    } else {
                        json!([us, dot])
                    };
                }
            }
        }
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
        assert_eq!(fs.getattr(ROOT_INO).unwrap().kind, Kind::Dir);
        let names: Vec<String> = fs
            .readdir(ROOT_INO)
            .unwrap()
            .into_iter()
            .map(|e| e.2)
            .collect();
        assert_eq!(names.len(), 2 + 2 + 21 * 2);
        assert!(names.contains(&"index.json".to_string()) && names.contains(&"ctl".to_string()));
        assert_eq!(fs.readdir(a.ino), Err(libc::ENOTDIR));
        assert_eq!(fs.statfs().files, 3 + 21);
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
