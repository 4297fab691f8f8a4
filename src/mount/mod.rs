//! `rknot-mount`: process lifecycle around the filesystem.
//!
//! - Everything that can fail with a clear message (options, mountpoint,
//!   FUSE availability, opening and validating the source files) is checked
//!   before anything is mounted.
//! - Background mode forks (before any thread exists); the child mounts,
//!   checks that the mount answers, and tells the parent through a pipe; the
//!   parent exits 0 only then, so a script can `ls` the mountpoint as soon as
//!   the command returns. Foreground mode (systemd) stays attached and sends
//!   `READY=1` to `$NOTIFY_SOCKET` when the mount answers.
//! - SIGINT, SIGTERM and SIGHUP cancel the jobs, unmount and exit 0; a
//!   busy mount is cut off after a grace period or at a second signal
//!   ([`stop`]). An external `fusermount3 -u` / `umount` ends the session
//!   loop and also exits 0.

pub mod checks;
pub mod cli;
pub mod helper;
pub mod options;
pub mod partial;
pub mod stop;

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fuser::{Config, Session};

use crate::backend::{self, Backend};
use crate::fs::fuse::FuseAdapter;
use crate::fs::views::ViewSet;
use crate::fs::{FsConfig, INDEX_NAME, TensorFs};
use crate::integrity::manifest::{self as manifest, MountIntegrity};

/// Default decoded-block cache. In the default page-cache mode the kernel
/// keeps decoded pages itself (FOPEN_KEEP_CACHE), so the daemon's cache
/// only has to hold the read-ahead windows of concurrent readers and the
/// chunks that partial reads share: 256 MiB is 256 chunks of 1 MiB.
pub const DEFAULT_CACHE_MB: u64 = 256;

/// What the command line asked for.
#[derive(Debug, Clone)]
pub struct MountRequest {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    pub dense: Option<PathBuf>,
    /// `--allow-partial` (or `-o allow_partial`): mount a source that
    /// cannot serve its model whole.
    pub allow_partial: bool,
    pub cache_mb: Option<u64>,
    pub threads: Option<usize>,
    pub foreground: bool,
    pub options: Vec<String>,
    /// mount(8)'s `-s`: unknown `-o` options are ignored (module helper).
    pub sloppy: bool,
    /// Print nothing on success (mount(8)'s helper without `-v`).
    pub quiet: bool,
    pub log_file: Option<PathBuf>,
    /// Tensor formats besides f32 (`--views`); overrides `-o views=`.
    pub views: Option<ViewSet>,
    pub jobs_dir: Option<PathBuf>,
    /// Grace period after the first stop signal (`--stop-timeout`);
    /// overrides `-o stop_timeout=`.
    pub stop_timeout: Option<u64>,
    /// Manifest the source files are checked against (`--manifest`);
    /// overrides `-o manifest=`.
    pub manifest: Option<PathBuf>,
    /// Decoded-file store (`--decoded-cache`), its limit in GB, and
    /// `--no-passthrough`; override the `-o` forms.
    pub decoded_cache: Option<PathBuf>,
    pub decoded_cache_gb: Option<f64>,
    pub no_passthrough: bool,
    /// Remote-source flags (`--endpoint`, `--source-cache`, ...); override
    /// the `-o` forms.
    pub remote: crate::source::cli::RemoteArgs,
}

/// A failure before or during mounting: message for the user.
fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("rknot-mount: error: {msg}");
    ExitCode::FAILURE
}

/// Why [`prepare`] did not get to mount, and the exit status that says so.
struct Unprepared {
    msg: String,
    code: u8,
}

impl From<String> for Unprepared {
    fn from(msg: String) -> Self {
        Unprepared { msg, code: 1 }
    }
}

impl Unprepared {
    fn exit(self) -> ExitCode {
        eprintln!("rknot-mount: error: {}", self.msg);
        ExitCode::from(self.code)
    }
}

struct Prepared {
    backend: Arc<dyn Backend>,
    /// The manifest checks, when a manifest was given.
    integrity: Option<Arc<MountIntegrity>>,
    mountpoint: PathBuf,
    fs_config: FsConfig,
    fuse_config: Config,
    readahead_kb: u32,
    log_file: PathBuf,
    stop_timeout: Duration,
}

fn n_cpus() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn prepare(req: &MountRequest) -> Result<Prepared, Unprepared> {
    let (opts, _) = options::parse_with(&req.options, req.sloppy)?;
    // Before any source is opened (and before the fork of background
    // mode, which keeps it).
    req.remote.or(&opts.remote).install()?;
    checks::check_fuse()?;
    let mountpoint = checks::check_mountpoint(&req.mountpoint)?;
    let dense = req
        .dense
        .clone()
        .or_else(|| opts.dense.as_ref().map(PathBuf::from));
    // Absolute paths: the daemon changes directory to / and reports paths
    // in ctl and index.json.
    // URLs (remote sources) stay as given.
    let abs = |p: &Path| {
        if p.to_str().is_some_and(crate::source::is_remote) {
            return p.to_path_buf();
        }
        std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
    };
    let source = abs(&req.source);
    let dense = dense.map(|d| abs(&d));
    let manifest_path = req
        .manifest
        .clone()
        .or_else(|| opts.manifest.as_ref().map(PathBuf::from));
    // With a manifest, the files are checked before anything is mounted
    // (a header mismatch or a file it does not list refuses the mount).
    let (backend, integrity): (Arc<dyn Backend>, _) = match &manifest_path {
        Some(m) => {
            let (b, i) = manifest::open_verified(
                &source,
                dense.as_deref(),
                m,
                opts.unverified.unwrap_or_default(),
            )
            .map_err(|e| e.to_string())?;
            (b, Some(i))
        }
        None => (
            Arc::from(backend::open(&source, dense.as_deref()).map_err(|e| e.to_string())?),
            None,
        ),
    };
    // Before the fork: the user's stderr gets the refusal or the warning.
    match partial::check(
        backend.as_ref(),
        &source,
        req.allow_partial || opts.allow_partial,
    ) {
        Ok(Some(warning)) => eprintln!("rknot-mount: {warning}"),
        Ok(None) => {}
        Err(msg) => {
            return Err(Unprepared {
                msg,
                code: partial::EXIT_PARTIAL,
            });
        }
    }
    let cache_mb = req.cache_mb.or(opts.cache_mb).unwrap_or(DEFAULT_CACHE_MB);
    let threads = req
        .threads
        .or(opts.threads)
        .unwrap_or_else(|| n_cpus().clamp(2, 16).min(options::MAX_THREADS));
    options::check_threads(threads).map_err(|e| format!("--threads: {e}"))?;
    options::check_cache_mb(cache_mb).map_err(|e| format!("--cache-mb: {e}"))?;
    let uid = opts.uid.unwrap_or_else(checks::geteuid);
    // SAFETY: getegid takes no arguments and cannot fail.
    let gid = opts.gid.unwrap_or_else(|| unsafe { libc::getegid() });
    let fs_config = FsConfig {
        uid,
        gid,
        direct_io: opts.direct_io,
        cache_bytes: cache_mb.saturating_mul(1 << 20),
        // (chunk_kb is within options::CHUNK_KB: parse refuses the rest.)
        chunk_bytes: opts
            .chunk_kb
            .map_or(crate::fs::DEFAULT_CHUNK_BYTES, |k| k * 1024),
        prefetch_threads: opts
            .prefetch_threads
            .unwrap_or_else(|| n_cpus().min(options::MAX_PREFETCH_THREADS)),
        views: req.views.or(opts.views).unwrap_or_default(),
        hf_dtype: opts.hf_dtype.unwrap_or_default(),
        jobs: jobs_config(req, &opts, &source)?,
        integrity: integrity.clone(),
        decoded: decoded_setup(req, &opts)?,
        ..FsConfig::default()
    };
    let mut fuse_config = Config::default();
    fuse_config.mount_options = options::fuser_options(
        &opts,
        &crate::source::redact(&source.display().to_string()),
        !checks::can_mount_directly(),
    );
    fuse_config.acl = opts.acl;
    fuse_config.n_threads = Some(threads);
    let log_file = req
        .log_file
        .clone()
        .unwrap_or_else(|| default_log_file(&mountpoint));
    Ok(Prepared {
        backend,
        integrity,
        mountpoint,
        fs_config,
        fuse_config,
        readahead_kb: opts.readahead_kb.unwrap_or(1024),
        log_file,
        stop_timeout: Duration::from_secs(
            req.stop_timeout
                .or(opts.stop_timeout)
                .unwrap_or(stop::DEFAULT_STOP_TIMEOUT),
        ),
    })
}

/// The decoded-file store (`--decoded-cache DIR`), opened (and checked:
/// owner, mode, no symlink) before anything is mounted.
fn decoded_setup(
    req: &MountRequest,
    opts: &options::MountOpts,
) -> Result<Option<crate::fs::passthrough::DecodedSetup>, String> {
    let Some(dir) = req
        .decoded_cache
        .clone()
        .or_else(|| opts.decoded_cache.as_ref().map(PathBuf::from))
    else {
        if req.decoded_cache_gb.or(opts.decoded_cache_gb).is_some() {
            return Err("decoded_cache_gb needs decoded_cache=DIR".into());
        }
        return Ok(None);
    };
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    let limit = req
        .decoded_cache_gb
        .or(opts.decoded_cache_gb)
        .map(|gb| (gb * 1e9) as u64);
    let store = crate::cache::store::DecodedStore::open(&dir, limit)
        .map_err(|e| format!("--decoded-cache: {e}"))?;
    Ok(Some(crate::fs::passthrough::DecodedSetup {
        store: Arc::new(store),
        passthrough: !(req.no_passthrough || opts.no_passthrough),
    }))
}

/// Encoding jobs through `ctl`: outputs go to `--jobs-dir` (default: the
/// source file's directory); they encode from the mounted model's dense
/// data (the source when it is dense, else the fallback), read through the
/// mount's open backend (`jobs::JobSource::of_mount`).
fn jobs_config(
    req: &MountRequest,
    opts: &options::MountOpts,
    source: &Path,
) -> Result<Option<crate::fs::JobsConfig>, String> {
    if opts.no_jobs {
        return Ok(None);
    }
    let jobs_dir = req
        .jobs_dir
        .clone()
        .or_else(|| opts.jobs_dir.as_ref().map(PathBuf::from));
    // The administrator's object-store prefix: outputs are uploaded there
    // (src/source/upload.rs), still only under plain names.
    if let Some(prefix) = &opts.jobs_remote_prefix {
        if let Some(d) = jobs_dir {
            return Err(format!(
                "jobs_remote_prefix={prefix} and a jobs directory ({}) exclude each other",
                d.display()
            ));
        }
        return Ok(Some(crate::fs::JobsConfig {
            dir: PathBuf::from(prefix),
            max_running: opts.max_jobs.unwrap_or(1).max(1),
            threads: n_cpus().saturating_sub(1).max(1),
        }));
    }
    let dir = match jobs_dir {
        Some(d) => std::path::absolute(&d).unwrap_or(d),
        // A remote source has no local directory: jobs only with --jobs-dir.
        None if source.to_str().is_some_and(crate::source::is_remote) => {
            log::info!("encoding jobs off: the source is remote and no --jobs-dir was given");
            return Ok(None);
        }
        None => source
            .parent()
            .map_or_else(|| PathBuf::from("/"), Path::to_path_buf),
    };
    if !dir.is_dir() {
        return Err(format!(
            "jobs directory {} is not a directory",
            dir.display()
        ));
    }
    Ok(Some(crate::fs::JobsConfig {
        dir,
        max_running: opts.max_jobs.unwrap_or(1).max(1),
        // One core is left to the FUSE threads.
        threads: n_cpus().saturating_sub(1).max(1),
    }))
}

/// Where a background daemon logs: `/var/log/rknot/` for root, else
/// `$XDG_STATE_HOME/rknot/` (default `~/.local/state/rknot/`), in a file
/// named after the mountpoint ([`default_log_name`]).
pub fn default_log_file(mountpoint: &Path) -> PathBuf {
    let dir = if checks::geteuid() == 0 {
        PathBuf::from("/var/log/rknot")
    } else if let Some(x) = std::env::var_os("XDG_STATE_HOME") {
        PathBuf::from(x).join("rknot")
    } else if let Some(h) = std::env::var_os("HOME") {
        PathBuf::from(h).join(".local/state/rknot")
    } else {
        std::env::temp_dir().join("rknot")
    };
    dir.join(default_log_name(mountpoint))
}

/// Characters of the mountpoint kept in the log file's name.
const LOG_NAME_TAIL: usize = 64;

/// The default log file name of a mount at `mountpoint` (canonical):
/// `mount-<tail>-<hash>.log`, where the tail is the end of the path with
/// `/` and anything unusual as `_` (readable, at most [`LOG_NAME_TAIL`]
/// characters) and the hash is FNV-1a 64 of the whole path. Bounded (91
/// bytes, far below NAME_MAX, whatever the path's length) and distinct for
/// distinct paths (`/a/b_c` and `/a_b/c` share a tail, not a hash). FNV
/// rather than std's hasher: the name must not change between builds, so a
/// restarted daemon appends to the same log.
pub fn default_log_name(mountpoint: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let bytes = mountpoint.as_os_str().as_bytes();
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let flat: Vec<char> = mountpoint
        .to_string_lossy()
        .trim_matches('/')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let tail: String = flat[flat.len().saturating_sub(LOG_NAME_TAIL)..]
        .iter()
        .collect();
    let tail = if tail.is_empty() { "root".into() } else { tail };
    format!("mount-{tail}-{hash:016x}.log")
}

fn init_logging(target: Option<std::fs::File>) {
    crate::logging::init("info", target);
}

/// Every check [`run`] makes before mounting, and nothing mounted
/// (mount(8)'s `-f`, "fake"): 0 when the mount would be attempted.
pub fn check_only(req: &MountRequest) -> ExitCode {
    match prepare(req) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => e.exit(),
    }
}

/// Entry point of the `rknot-mount` binary.
pub fn run(req: MountRequest) -> ExitCode {
    let prep = match prepare(&req) {
        Ok(p) => p,
        Err(e) => return e.exit(),
    };
    if req.foreground {
        init_logging(None);
        return serve(prep, None);
    }
    // Open the log before forking so a bad path is reported here.
    if let Some(dir) = prep.log_file.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let log = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&prep.log_file)
    {
        Ok(f) => f,
        Err(e) => {
            return fail(format!(
                "cannot open log file {}: {e}",
                prep.log_file.display()
            ));
        }
    };
    let mut fds = [0i32; 2];
    // SAFETY: pipe writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return fail(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just created and are owned only here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // No thread exists yet (the backend opens with plain reads; a remote
    // source's I/O runtime is shut down here, its threads joined, and
    // restarted by the child's first request), so fork is safe: the child
    // continues with a copy of this single thread.
    crate::source::stop_runtime();
    // SAFETY: see above; the child only runs Rust code of this process.
    match unsafe { libc::fork() } {
        -1 => fail(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            drop(rd);
            // SAFETY: setsid has no preconditions; it detaches from the
            // terminal so the shell's SIGINT/SIGHUP do not reach the daemon.
            unsafe { libc::setsid() };
            // Do not keep the caller's directory busy.
            let _ = std::env::set_current_dir("/");
            redirect_stdio(&log);
            init_logging(Some(log));
            serve(prep, Some(std::fs::File::from(wr)))
        }
        child => {
            drop(wr);
            let mut msg = String::new();
            let _ = std::fs::File::from(rd).read_to_string(&mut msg);
            if let Some(rest) = msg.strip_prefix("OK ") {
                if !req.quiet {
                    println!("rknot-mount: {}", rest.trim_end());
                }
                ExitCode::SUCCESS
            } else if let Some(rest) = msg.strip_prefix("ERR ") {
                fail(rest.trim_end())
            } else {
                fail(format!(
                    "the daemon (pid {child}) exited before the mount was ready; see {}",
                    prep.log_file.display()
                ))
            }
        }
    }
}

/// Point stdin at /dev/null and stdout/stderr at the log.
fn redirect_stdio(log: &std::fs::File) {
    use std::os::fd::AsRawFd;
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto the standard descriptors, from descriptors we own.
        unsafe { libc::dup2(null.as_raw_fd(), 0) };
    }
    // SAFETY: as above.
    unsafe {
        libc::dup2(log.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
}

/// Keep freed chunk buffers from piling up in the allocator: glibc raises
/// its mmap threshold dynamically after the first large free, after which
/// 1 MiB chunks come from arenas that rarely shrink, and the daemon's RSS
/// grows far past the cache budget. A fixed threshold makes every chunk its
/// own mapping, returned to the kernel on eviction (measured: peak RSS
/// 95 MiB -> 47 MiB streaming SmolLM2 through a 16 MiB cache).
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Hand the memory freed while building the namespace back to the kernel.
/// Rendering index.json and the views' headers allocates (and frees) tens
/// of MB of small objects for a large vocabulary, some on a helper thread's
/// arena; glibc keeps freed small blocks mapped, which otherwise stays in
/// the daemon's RSS for its whole life.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Mount and serve until unmounted. `notify` is the pipe to the waiting
/// parent in background mode.
fn serve(prep: Prepared, mut notify: Option<std::fs::File>) -> ExitCode {
    tune_allocator();
    let report = |notify: &mut Option<std::fs::File>, line: String| {
        if let Some(p) = notify.as_mut() {
            let _ = p.write_all(line.as_bytes());
        }
        *notify = None;
    };
    // Block the stop signals in this thread before any other thread starts,
    // so every thread inherits the mask and only the signal thread (which
    // waits for them with sigwait) ever sees them.
    let set = stop::stop_signals();
    // SAFETY: set is initialized; changing this thread's mask is sound.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    // A remote source started its I/O runtime while opening (in the
    // foreground, nothing stopped it since): its worker threads predate the
    // mask, so a SIGTERM could land on one and kill the daemon with the
    // default action, leaving a dead mount. Stop it; the next request starts
    // it again from a thread that has the mask.
    crate::source::stop_runtime();

    let mountpoint = prep.mountpoint.clone();
    // Only what the log line and the stop plan name: the summary's
    // metadata may be tens of megabytes (a large vocabulary), and a copy of
    // it lived as long as the mount.
    let (source_path, source_format) = {
        let s = prep.backend.summary();
        (s.path.clone(), s.format)
    };
    let fs = TensorFs::new(prep.backend, prep.fs_config);
    // The signal thread cancels the jobs; the filesystem itself moves into
    // the session.
    let jobs = fs.jobs();
    release_free_memory();
    let direct_io = fs.direct_io();
    let n_files = fs.n_tensor_files();
    let decoded_note = fs.decoded().map_or(String::new(), |d| {
        format!(
            ", decoded cache {} (limit {:.2} GB)",
            d.store.dir().display(),
            d.store.limit() as f64 / 1e9
        )
    });
    // Under unverified=allow a failed whole-file check withdraws what was
    // served: the kernel must forget the pages it cached of every file
    // with tensor bytes (the daemon's own cache is dropped by `fs`).
    let withdraw = prep
        .integrity
        .as_ref()
        .filter(|i| i.unverified() == manifest::Unverified::Allow)
        .map(|_| fs.data_inodes());
    let adapter = FuseAdapter::new(fs);
    let end_hook = adapter.end_hook();
    let mut session = match Session::new(adapter, &mountpoint, &prep.fuse_config) {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("cannot mount {}: {e}", mountpoint.display());
            log::error!("{msg}");
            if notify.is_some() {
                report(&mut notify, format!("ERR {msg}\n"));
                return ExitCode::FAILURE;
            }
            return fail(msg);
        }
    };
    {
        let mut unmounter = session.unmount_callable();
        let mp = mountpoint.clone();
        let end: Box<dyn FnOnce() + Send> = Box::new(move || end_mount(&mut unmounter, &mp));
        *end_hook.lock().unwrap_or_else(|p| p.into_inner()) = Some(end);
    }
    if let Some(i) = &prep.integrity {
        if let Some(inos) = withdraw {
            let notifier = session.notifier();
            i.on_failure(move || {
                for &ino in &inos {
                    // ENOENT for inodes the kernel never looked up.
                    let _ = notifier.inval_inode(fuser::INodeNo(ino), 0, 0);
                }
            });
        }
        // Whole-file checks run on their own threads, which exist only
        // from here on (after the fork of background mode).
        i.start();
    }
    log::info!(
        "mounted {} at {} ({}, {} tensor files, {}{decoded_note})",
        source_path.display(),
        mountpoint.display(),
        source_format,
        n_files,
        if direct_io { "direct_io" } else { "page cache" }
    );

    // Signal thread: SIGINT/SIGTERM/SIGHUP stop the daemon (module stop).
    let plan = stop::StopPlan {
        mountpoint: mountpoint.clone(),
        grace: prep.stop_timeout,
        jobs,
        // The mount exists once Session::new returned; its device number
        // names the FUSE connection.
        connection: checks::mount_entry(&mountpoint)
            .ok()
            .flatten()
            .filter(checks::MountEntry::is_fuse)
            .map(|m| m.fuse_connection()),
    };
    let stop_state = Arc::new(stop::StopState::default());
    if let Err(e) = stop::spawn(set, session.unmount_callable(), plan, stop_state.clone()) {
        log::error!("cannot start the signal thread: {e}");
    }

    // Readiness: the mount is live once a lookup through it answers. That
    // needs the session loop, so check from a helper thread.
    let mp = mountpoint.clone();
    let source = source_path;
    let log_file = prep.log_file.clone();
    let background = notify.is_some();
    let readahead_kb = prep.readahead_kb;
    // Set when the mount never answered: it is then detached, and the
    // daemon exits 1 instead of serving a mount nobody was told about.
    let not_ready = Arc::new(AtomicBool::new(false));
    let not_ready_flag = not_ready.clone();
    let ready = std::thread::Builder::new()
        .name("rknot-ready".into())
        .spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            let probe = mp.join(INDEX_NAME);
            while std::fs::metadata(&probe).is_err() {
                if Instant::now() > deadline {
                    let msg = format!("mount at {} did not answer within 30 s", mp.display());
                    log::error!("{msg}; unmounting");
                    report(&mut notify, format!("ERR {msg}\n"));
                    not_ready_flag.store(true, Ordering::SeqCst);
                    lazy_unmount(&mp);
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            // Only now: stat of the mount root needs the session loop.
            set_readahead(&mp, readahead_kb);
            let pid = std::process::id();
            let line = if background {
                format!(
                    "serving {} at {} (pid {pid}; log {})",
                    source.display(),
                    mp.display(),
                    log_file.display()
                )
            } else {
                format!(
                    "serving {} at {} (pid {pid})",
                    source.display(),
                    mp.display()
                )
            };
            log::info!("{line}");
            report(&mut notify, format!("OK {line}\n"));
            sd_notify(&format!("READY=1\nMAINPID={pid}\nSTATUS={line}"));
        });
    if let Err(e) = ready {
        log::error!("cannot start the readiness thread: {e}");
    }

    let ran = session.run();
    stop_state.end_session();
    match ran {
        Ok(()) if not_ready.load(Ordering::SeqCst) => ExitCode::FAILURE,
        Ok(()) => {
            crate::logging::flush_throttled();
            match stop_state.signal() {
                Some(sig) if stop_state.forced() => log::info!(
                    "stopped by {}: connection aborted, unmounted {}; exiting",
                    stop::signal_name(sig),
                    mountpoint.display()
                ),
                Some(sig) => log::info!(
                    "stopped by {}: unmounted {}; exiting",
                    stop::signal_name(sig),
                    mountpoint.display()
                ),
                None => log::info!("unmounted {}; exiting", mountpoint.display()),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            log::error!("session ended with an error: {e}");
            lazy_unmount(&mountpoint);
            ExitCode::FAILURE
        }
    }
}

/// The end of the session (the filesystem's `destroy`): the loop ended
/// because the connection is gone. After a stop signal the signal thread
/// has unmounted already and this finds nothing to do. After an external
/// `umount` / `fusermount3 -u` the kernel has unmounted, and fuser 0.18
/// would try again when the session is dropped (its "is it still mounted"
/// poll of /dev/fuse answers yes once the connection is gone) and log the
/// EINVAL of that second umount as `WARN Failed to umount filesystem`. Doing
/// it here takes the mount out of the session first, and EINVAL (the path
/// is no longer a mount point) is the expected outcome, not a warning.
fn end_mount(unmounter: &mut fuser::SessionUnmounter, mp: &Path) {
    match unmounter.unmount() {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            log::debug!("{} was unmounted already ({e})", mp.display());
        }
        Err(e) => log::warn!("cannot unmount {}: {e}", mp.display()),
    }
}

/// Last resort when a plain unmount fails (busy): detach the mount so no
/// stale "Transport endpoint is not connected" stays behind.
pub(crate) fn lazy_unmount(mp: &Path) {
    if checks::is_mountpoint(mp).unwrap_or(false) {
        let st = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg("-z")
            .arg(mp)
            .status();
        if !matches!(st, Ok(s) if s.success()) {
            log::error!("lazy unmount of {} failed: {st:?}", mp.display());
        }
    }
}

/// Raise the kernel read-ahead of the mount's bdi (root only): with 1 MiB
/// the kernel asks for 1 MiB per FUSE read instead of 128 KiB.
fn set_readahead(mp: &Path, kb: u32) {
    use std::os::unix::fs::MetadataExt;
    if kb == 0 || checks::geteuid() != 0 {
        return;
    }
    let Ok(meta) = std::fs::metadata(mp) else {
        return;
    };
    let dev = meta.dev();
    // SAFETY: major/minor are pure arithmetic on the device number.
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let path = format!("/sys/class/bdi/{maj}:{min}/read_ahead_kb");
    match std::fs::write(&path, kb.to_string()) {
        Ok(()) => log::info!("{path} = {kb}"),
        Err(e) => log::warn!("cannot set {path}: {e}"),
    }
}

/// A state change for systemd (Type=notify), when `$NOTIFY_SOCKET` is set.
pub(crate) fn sd_notify(state: &str) {
    use std::os::unix::net::UnixDatagram;
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let p = path.to_string_lossy();
    let sent = if let Some(abs) = p.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abs.as_bytes())
            .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), &*p)
    };
    if let Err(e) = sent {
        log::warn!("sd_notify: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_names_are_bounded() {
        // 40 levels of 60-character names: 2.4 KB, ten times NAME_MAX.
        let long: PathBuf = std::iter::once("/".to_string())
            .chain((0..40).map(|i| format!("{i:02}{}", "d".repeat(58))))
            .collect();
        assert!(long.as_os_str().len() > 2000);
        let name = default_log_name(&long);
        assert!(name.len() <= 91, "{} bytes: {name}", name.len());
        assert!(
            name.starts_with("mount-") && name.ends_with(".log"),
            "{name}"
        );
        // The readable part is the end of the path.
        assert!(name.contains(&format!("39{}", "d".repeat(20))), "{name}");
        // Another long path with the same tail gets another name.
        let elsewhere = Path::new("/x").join(long.strip_prefix("/").unwrap());
        assert_ne!(default_log_name(&elsewhere), name);
        assert_eq!(
            default_log_name(&long.clone()),
            name,
            "same path, same name"
        );
        // Only plain characters in the name.
        let odd = default_log_name(Path::new("/mnt/a b\n\u{1b}[31m/ü"));
        assert!(
            odd.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
            "{odd}"
        );
        assert!(default_log_name(Path::new("/")).starts_with("mount-root-"));
    }

    #[test]
    fn log_names_do_not_collide() {
        // Both flatten to a_b_c, which named one log for two mounts.
        let a = default_log_name(Path::new("/a/b_c"));
        let b = default_log_name(Path::new("/a_b/c"));
        assert_ne!(a, b);
        assert!(a.starts_with("mount-a_b_c-") && b.starts_with("mount-a_b_c-"));
        // Stable across builds and runs: a restarted daemon appends to the
        // same file (FNV-1a 64 of "/a/b_c").
        assert_eq!(a, "mount-a_b_c-ae644e6e342a1bde.log");
        // The example in docs/OPERATIONS.md.
        assert_eq!(
            default_log_name(Path::new("/mnt/w")),
            "mount-mnt_w-5af2c8bcdc203f69.log"
        );
    }
}
