//! The thin FUSE adapter: turns fuser callbacks into [`TensorFs`] calls and
//! its results into replies. No filesystem logic lives here.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{
    BackingId, BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::{Attr, CTL_INO, Caller, Kind, OpenMode, TensorFs};
use crate::cache::lock;
use crate::cache::store::Entry;

/// Attributes and entries of the tensor files and views never change during
/// a mount, so the kernel may cache them for a long time (the live files,
/// `ctl`, `ctl.json` and `jobs/`, get no caching: see `ttl`).
const TTL: Duration = Duration::from_secs(3600);

/// Kernel read-ahead (bytes) we ask for; the kernel clamps it to what it
/// offers (128 KiB on stock kernels; `read_ahead_kb` raises it).
const MAX_READAHEAD: u32 = 1 << 20;

pub struct FuseAdapter {
    /// Shared with the threads that serve reads held by a manifest check.
    pub fs: Arc<TensorFs>,
    /// Reads waiting on their own threads (see `read`).
    pub held: Arc<AtomicUsize>,
    /// Whether any source is remote: reads of tensor files and views then
    /// run on threads of their own (see `read`).
    remote_data: bool,
    /// Those reads under way.
    remote_reads: Arc<AtomicUsize>,
    /// With a decoded-file store: how each open data inode is served.
    backing: Arc<Mutex<HashMap<u64, Backing>>>,
    /// Opens decoding into the store on threads of their own.
    decoding: Arc<AtomicUsize>,
    /// Run once when the session ends (see [`FuseAdapter::end_hook`]).
    end: EndHook,
}

/// Work for the end of the session, set after the session exists.
pub type EndHook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// How an open tensor file or view is served while any handle of it is
/// open: the kernel fails a passthrough open while a page-cache open of the
/// same inode is held (and the other way round), so every open of an inode
/// is served the way its first one was, until the last one is released.
enum Backing {
    /// By the kernel from a store entry: one backing registration per
    /// inode, reused by every open; the entry's lock keeps it from eviction.
    Passthrough {
        id: BackingId,
        _entry: Entry,
        open: usize,
    },
    /// By the daemon, as without a store.
    Plain { open: usize },
}

/// Opens decoding into the store on threads of their own, at most; further
/// ones decode in the FUSE worker.
const MAX_DECODING_OPENS: usize = 64;

/// Run `job` (which owns a FUSE reply) on a thread of its own while fewer
/// than `max` such jobs run (`running` counts them), else in the calling
/// FUSE worker. If the thread cannot start, the job is dropped with its
/// reply unsent, and fuser answers the request with EIO.
fn run_bounded(
    running: &Arc<AtomicUsize>,
    max: usize,
    name: &str,
    job: impl FnOnce() + Send + 'static,
) {
    if running.fetch_add(1, Ordering::AcqRel) >= max {
        job();
        running.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    let counter = running.clone();
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            job();
            counter.fetch_sub(1, Ordering::AcqRel);
        });
    if let Err(e) = spawned {
        running.fetch_sub(1, Ordering::AcqRel);
        log::error!("cannot start a thread ({name}): {e}");
    }
}

/// The kernel's flags for an open served by the daemon.
fn plain_flags(m: &OpenMode) -> FopenFlags {
    let mut f = FopenFlags::empty();
    if m.keep_cache {
        f |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if m.direct_io {
        f |= FopenFlags::FOPEN_DIRECT_IO;
    }
    f
}

/// Reads that wait for a whole-file check on threads of their own, at
/// most; further ones wait in the FUSE worker. The kernel itself keeps few
/// reads outstanding (64 in the background plus one per reading thread).
const MAX_HELD_READS: usize = 256;

/// Reads of remote data on threads of their own, at most; further ones
/// run in the FUSE worker (the kernel keeps at most 64 reads in the
/// background plus one per reading thread outstanding, so this is reached
/// only by hundreds of threads reading at once). Each is bounded by the
/// remote deadline (`--remote-deadline`).
const MAX_REMOTE_READS: usize = 256;

impl FuseAdapter {
    pub fn new(fs: TensorFs) -> FuseAdapter {
        let remote_data = fs
            .shared
            .backend
            .source_files()
            .iter()
            .any(|f| f.is_remote());
        FuseAdapter {
            fs: Arc::new(fs),
            held: Arc::new(AtomicUsize::new(0)),
            remote_data,
            remote_reads: Arc::new(AtomicUsize::new(0)),
            backing: Arc::new(Mutex::new(HashMap::new())),
            decoding: Arc::new(AtomicUsize::new(0)),
            end: Arc::new(Mutex::new(None)),
        }
    }

    /// A slot for work that runs once in `destroy`, after the session loop
    /// ended and before fuser's own clean-up (the mount module ends the
    /// mount there: `super::super::mount`).
    pub fn end_hook(&self) -> EndHook {
        self.end.clone()
    }
}

/// Answer open `m` of `ino` the way the inode is served now, if any handle
/// of it is open; gives the reply back otherwise.
fn reuse_backing(
    fs: &TensorFs,
    table: &mut HashMap<u64, Backing>,
    ino: u64,
    m: &OpenMode,
    reply: ReplyOpen,
) -> Option<ReplyOpen> {
    let d = fs.decoded()?;
    match table.get_mut(&ino) {
        Some(Backing::Passthrough { id, open, .. }) => {
            *open += 1;
            d.passthrough_opens.fetch_add(1, Ordering::Relaxed);
            reply.opened_passthrough(FileHandle(m.fh), FopenFlags::empty(), id);
            None
        }
        Some(Backing::Plain { open }) => {
            *open += 1;
            d.plain_opens.fetch_add(1, Ordering::Relaxed);
            reply.opened(FileHandle(m.fh), plain_flags(m));
            None
        }
        None => Some(reply),
    }
}

/// The first open of `ino` with a store: decode it into the store (or find
/// it there), register the entry as the inode's backing file and answer
/// with passthrough; on any failure serve the inode by the daemon.
fn open_from_store(
    fs: &TensorFs,
    backing: &Mutex<HashMap<u64, Backing>>,
    ino: u64,
    m: OpenMode,
    reply: ReplyOpen,
) {
    let entry = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fs.decoded_entry(ino)));
    let mut table = lock(backing);
    // Another open of the inode may have been answered meanwhile.
    let Some(reply) = reuse_backing(fs, &mut table, ino, &m, reply) else {
        return;
    };
    let Some(d) = fs.decoded() else {
        return reply.opened(FileHandle(m.fh), plain_flags(&m));
    };
    if let Ok(Ok((entry, _))) = entry {
        match reply.open_backing(&entry.file) {
            Ok(id) => {
                reply.opened_passthrough(FileHandle(m.fh), FopenFlags::empty(), &id);
                d.passthrough_opens.fetch_add(1, Ordering::Relaxed);
                d.backing_open.fetch_add(1, Ordering::Relaxed);
                table.insert(
                    ino,
                    Backing::Passthrough {
                        id,
                        _entry: entry,
                        open: 1,
                    },
                );
                return;
            }
            Err(e) => {
                let refused = matches!(
                    e.raw_os_error(),
                    Some(
                        libc::EPERM | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOTTY | libc::ENOSYS
                    )
                );
                if refused {
                    d.disable(&format!(
                        "the kernel refused to register a backing file: {e}"
                    ));
                } else {
                    crate::logging::throttled!(
                        log::Level::Warn,
                        "decoded cache backing",
                        "decoded cache: cannot register a backing file ({e}); serving by the daemon",
                    );
                }
            }
        }
    } else if entry.is_err() {
        log::error!("decoding into the decoded cache panicked (a bug); serving by the daemon");
    }
    d.plain_opens.fetch_add(1, Ordering::Relaxed);
    table.insert(ino, Backing::Plain { open: 1 });
    reply.opened(FileHandle(m.fh), plain_flags(&m));
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: match a.kind {
            Kind::Dir => FileType::Directory,
            Kind::File => FileType::RegularFile,
        },
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: 1 << 20,
        flags: 0,
    }
}

fn errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

/// The credentials of a request: what `ctl` authorises commands by.
fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
    }
}

impl FuseAdapter {
    /// How long the kernel may cache an inode's entry and attributes: long
    /// for the immutable files, not at all for the live ones (ctl, jobs).
    fn ttl(&self, ino: u64) -> Duration {
        if self.fs.is_live(ino) {
            Duration::ZERO
        } else {
            TTL
        }
    }
}

impl Filesystem for FuseAdapter {
    /// Unmount: cancel encoding jobs and let them remove their temporary
    /// files before the process exits.
    fn destroy(&mut self) {
        self.fs.shutdown_jobs();
        crate::logging::flush_throttled();
        let end = self.end.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(f) = end {
            f();
        }
    }

    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Setters answer Err(nearest valid value) when out of range: take it.
        if let Err(v) = config.set_max_readahead(MAX_READAHEAD) {
            let _ = config.set_max_readahead(v);
        }
        if let Err(v) = config.set_max_background(64) {
            let _ = config.set_max_background(v);
        }
        let mut wanted = InitFlags::FUSE_ASYNC_READ | InitFlags::FUSE_PARALLEL_DIROPS;
        if self.fs.direct_io() {
            // Lets mmap of a direct_io file work (kernels >= 6.6).
            wanted |= InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP;
        }
        let offered = config.capabilities();
        if let Some(d) = self.fs.decoded().filter(|d| d.enabled()) {
            if offered.contains(InitFlags::FUSE_PASSTHROUGH) {
                wanted |= InitFlags::FUSE_PASSTHROUGH;
                // 1: backing files on a plain filesystem (0 disables
                // passthrough).
                if let Err(v) = config.set_max_stack_depth(1) {
                    let _ = config.set_max_stack_depth(v);
                }
            } else {
                d.disable(
                    "the kernel does not offer FUSE passthrough (Linux >= 6.9 with \
                     CONFIG_FUSE_PASSTHROUGH)",
                );
            }
        }
        if let Err(missing) = config.add_capabilities(wanted & offered) {
            log::warn!("kernel refused FUSE capabilities {missing:?}");
        }
        if self.fs.direct_io() && !offered.contains(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP) {
            log::warn!(
                "kernel lacks FUSE_DIRECT_IO_ALLOW_MMAP (Linux < 6.6): mmap of direct_io files \
                 would fail, so tensor files are served through the page cache instead"
            );
            self.fs.fall_back_to_page_cache();
        }
        log::info!("FUSE init: capabilities offered {offered:?}");
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        match self.fs.lookup(parent.0, name) {
            Ok(a) => reply.entry(&self.ttl(a.ino), &file_attr(&a), Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&self.ttl(a.ino), &file_attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // `echo cmd > ctl` truncates first: accept size 0 on ctl only.
        let only_truncate = mode.is_none() && uid.is_none() && gid.is_none() && size == Some(0);
        if ino.0 == CTL_INO && only_truncate {
            return match self.fs.getattr(ino.0) {
                Ok(a) => reply.attr(&self.ttl(a.ino), &file_attr(&a)),
                Err(e) => reply.error(errno(e)),
            };
        }
        match self.fs.getattr(ino.0) {
            Ok(_) => reply.error(Errno::EROFS),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let acc = flags.acc_mode();
        let read = acc != OpenAccMode::O_WRONLY;
        let write = acc != OpenAccMode::O_RDONLY;
        let m = match self.fs.open(ino.0, read, write, caller(req)) {
            Ok(m) => m,
            Err(e) => return reply.error(errno(e)),
        };
        if self.fs.decoded().is_none() || !self.fs.is_data(ino.0) {
            return reply.opened(FileHandle(m.fh), plain_flags(&m));
        }
        let mut table = lock(&self.backing);
        let Some(reply) = reuse_backing(&self.fs, &mut table, ino.0, &m, reply) else {
            return;
        };
        if !self.fs.wants_passthrough(ino.0) {
            if let Some(d) = self.fs.decoded() {
                d.plain_opens.fetch_add(1, Ordering::Relaxed);
            }
            table.insert(ino.0, Backing::Plain { open: 1 });
            return reply.opened(FileHandle(m.fh), plain_flags(&m));
        }
        drop(table);
        // A first open decodes the whole file (seconds for a large view)
        // on a thread of its own, so the FUSE workers keep answering.
        let (fs, backing) = (self.fs.clone(), self.backing.clone());
        run_bounded(
            &self.decoding,
            MAX_DECODING_OPENS,
            "rknot-decode-open",
            move || open_from_store(&fs, &backing, ino.0, m, reply),
        );
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let unique = req.unique().0;
        // A read that may wait for a whole-file manifest check (-o
        // unverified=hold) waits on a thread of its own: with every FUSE
        // worker waiting, `ctl` (which shows the check's progress) and
        // `ls` would not answer until the check is done.
        if self.fs.read_may_wait(ino.0) {
            let fs = self.fs.clone();
            return run_bounded(
                &self.held,
                MAX_HELD_READS,
                "rknot-held-read",
                move || match fs.read_request(unique, ino.0, fh.0, offset, size) {
                    Ok(d) => reply.data(d.bytes()),
                    Err(e) => reply.error(errno(e)),
                },
            );
        }
        // A read of a remote source's data may wait on the network (up to
        // the remote deadline): on a thread of its own, so that the FUSE
        // workers keep answering `ls`, `stat`, `ctl` and `index.json` even
        // while every reader waits on a server that stalled. Those never
        // wait on the network: they are answered from memory.
        if self.remote_data && self.fs.is_data(ino.0) {
            let fs = self.fs.clone();
            return run_bounded(
                &self.remote_reads,
                MAX_REMOTE_READS,
                "rknot-remote-read",
                move || match fs.read_request(unique, ino.0, fh.0, offset, size) {
                    Ok(d) => reply.data(d.bytes()),
                    Err(e) => reply.error(errno(e)),
                },
            );
        }
        match self.fs.read_request(unique, ino.0, fh.0, offset, size) {
            Ok(d) => reply.data(d.bytes()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino.0 != CTL_INO {
            return reply.error(Errno::EROFS);
        }
        match self.fs.write_ctl(fh.0, data, caller(req)) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Every `close()`: a `ctl` command written without a final newline
    /// runs now, and its error is what `close()` returns.
    fn flush(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        match self.fs.flush(fh.0, caller(req)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.fs.release(fh.0);
        if let Some(d) = self.fs.decoded() {
            let mut table = lock(&self.backing);
            let last = match table.get_mut(&ino.0) {
                Some(Backing::Passthrough { open, .. } | Backing::Plain { open }) => {
                    *open = open.saturating_sub(1);
                    *open == 0
                }
                None => false,
            };
            if last && let Some(Backing::Passthrough { .. }) = table.remove(&ino.0) {
                // Dropped: the registration is closed and the entry's
                // lock released (it may be evicted from now on).
                d.backing_open.fetch_sub(1, Ordering::Relaxed);
            }
        }
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.getattr(ino.0) {
            // The root never changes: let the kernel cache its listing.
            // `jobs/` grows as jobs are submitted.
            Ok(a) if a.kind == Kind::Dir && !self.fs.is_live(ino.0) => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Ok(a) if a.kind == Kind::Dir => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        // Each call lists from `offset` until the reply is full; nothing is
        // collected first, so a directory of many thousands of names costs
        // no more per call than a small one.
        let listed = self.fs.readdir(ino.0, offset, |next, ino, kind, name| {
            let kind = match kind {
                Kind::Dir => FileType::Directory,
                Kind::File => FileType::RegularFile,
            };
            reply.add(INodeNo(ino), next, kind, name)
        });
        match listed {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.fs.statfs();
        reply.statfs(s.blocks, 0, 0, s.files, 0, s.bsize, s.namelen, s.bsize);
    }

    /// No extended attributes: every name answers ENODATA, as on a
    /// filesystem that supports xattrs but has none set. (ENOSYS would be
    /// remembered by the kernel, saving the round trip, but turns into
    /// EOPNOTSUPP for callers.)
    fn getxattr(&self, _req: &Request, ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        match self.fs.getattr(ino.0) {
            Ok(_) => reply.error(Errno::from_i32(libc::ENODATA)),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Every `open()` from Python (isatty) and many tools asks for TCGETS:
    /// answer "not a terminal" without logging (fuser's default logs three
    /// lines per call).
    #[allow(clippy::too_many_arguments)]
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        reply.error(Errno::from_i32(libc::ENOTTY));
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.fs.getattr(ino.0) {
            Ok(_) if size == 0 => reply.size(0),
            Ok(_) => reply.data(&[]),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }
}
