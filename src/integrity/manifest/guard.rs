//! The mount's manifest checks (`rknot-mount --manifest FILE.sums`).
//!
//! Each source file (the primary and the `--dense` fallback) is matched to
//! the manifest's lines by its basename and checked one of two ways:
//!
//! - per tensor, when the manifest has rknot lines for it (what `rknot
//!   manifest` writes): before mounting, the file's header (every byte in
//!   no tensor's stored ranges) is hashed and must match, and the file's
//!   tensors and the manifest's tensor lines must be the same set; then
//!   each tensor's stored bytes are hashed the first time a decode needs
//!   them (one hash however many readers arrive at once) and the outcome is
//!   kept: a verified tensor costs an atomic load per decode after that, a
//!   bad one fails every decode with `ErrorKind::Checksum` (EIO);
//! - as a whole file, when the manifest has only a whole-file line for it
//!   (a plain `SHA256SUMS`): the whole file is hashed on a background
//!   thread started once the daemon runs ([`MountIntegrity::start`]);
//!   until it finishes, decodes of the file's tensors wait
//!   ([`Unverified::Hold`], the default) or go ahead
//!   ([`Unverified::Allow`]); after a mismatch every decode of them fails.
//!
//! A file the manifest has no line for is refused at mount, and so is a
//! header mismatch: a manifest of another model never mounts.
//!
//! The checks sit in [`IntegrityBackend`], a wrapper around the mount's
//! backend, in `read_f32`: below the decoded-chunk cache, so a cached chunk
//! costs nothing and nothing unverified is ever cached (per tensor). All
//! hashing reads the mount's own open `SourceFile`s, never the paths
//! again, so what is hashed is what is decoded.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use serde_json::{Value, json};

use super::check::{Problem, structure};
use super::digest::{
    READ_PIECE, TensorBytes, digest_header, digest_ranges, digest_whole, tensor_bytes,
};
use super::{Digest, Manifest, basename, hex};
use crate::backend::{self, Backend, DenseBackend, SourceSummary, StoredRanges, TensorTable};
use crate::cache::lock;
use crate::error::{Error, ErrorKind, Result, err};
use crate::source::{SourceFile, SourceVersion};
use crate::text::Escaped;

/// Bytes per read when a tensor is verified on its first decode: several
/// decode threads may verify at once, each holding one such buffer, so it
/// is smaller than the command line's [`READ_PIECE`].
const TENSOR_PIECE: usize = 1 << 20;

/// Failed tensors named in `ctl` (the log names every one).
const FAILED_NAMES_SHOWN: usize = 16;

/// What decodes of a file under a whole-file check do until the check has
/// finished (`-o unverified=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unverified {
    /// Wait for the check; fail (EIO) if it fails. The default: no byte of
    /// the file reaches a reader before it is known to be the manifest's.
    #[default]
    Hold,
    /// Serve meanwhile; after a failed check every decode fails (EIO) and
    /// the daemon drops what it cached.
    Allow,
}

impl Unverified {
    pub fn parse(s: &str) -> Option<Unverified> {
        match s {
            "hold" => Some(Unverified::Hold),
            "allow" => Some(Unverified::Allow),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Unverified::Hold => "hold",
            Unverified::Allow => "allow",
        }
    }
}

/// How a source file is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileCheck {
    /// Header at mount, each tensor on its first decode.
    Tensors,
    /// The whole file, in the background.
    WholeFile,
}

// States of a tensor.
const UNCHECKED: u8 = 0;
const CHECKING: u8 = 1;
const VERIFIED: u8 = 2;
const BAD: u8 = 3;

// States of a whole-file check.
const PENDING: u8 = 0;
const FILE_VERIFIED: u8 = 1;
const FILE_FAILED: u8 = 2;

struct Cell {
    name: String,
    expected: Digest,
    /// The manifest's line for it (messages).
    line: usize,
    ranges: Vec<std::ops::Range<u64>>,
    state: AtomicU8,
    found: OnceLock<Digest>,
}

enum Check {
    Tensors {
        cells: Vec<Cell>,
        by_name: HashMap<String, usize>,
        verified: AtomicU64,
        failed: AtomicU64,
    },
    Whole {
        expected: Digest,
        state: AtomicU8,
        done: AtomicU64,
        /// Why it failed (set once, before the state says failed).
        problem: OnceLock<String>,
    },
}

struct FileState {
    path: PathBuf,
    version: SourceVersion,
    size: u64,
    /// Index of this file in the mount backend's `source_files()`.
    source: usize,
    check: Check,
}

/// The manifest checks of one mount: shared by the backend wrappers (the
/// read path, jobs) and `ctl`.
pub struct MountIntegrity {
    manifest: PathBuf,
    unverified: Unverified,
    files: Vec<FileState>,
    /// The mount's backend (unwrapped): its open files are what is hashed.
    backend: Arc<dyn Backend>,
    /// Guards state changes that waiters wait for (tensors being checked,
    /// whole-file checks); the states themselves are atomics, so a decode
    /// of a verified tensor takes no lock.
    lock: Mutex<()>,
    settled: Condvar,
    on_failure: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
    started: AtomicBool,
}

impl std::fmt::Debug for MountIntegrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountIntegrity")
            .field("manifest", &self.manifest)
            .field("unverified", &self.unverified)
            .field("files", &self.files.len())
            .finish()
    }
}

/// Open `source` (and `dense`) as [`backend::open`] does, check each file
/// against the manifest at `manifest` (refusing what must not mount), and
/// return the backend to serve (checked on decode) with its checks.
pub fn open_verified(
    source: &Path,
    dense: Option<&Path>,
    manifest: &Path,
    unverified: Unverified,
) -> Result<(Arc<dyn Backend>, Arc<MountIntegrity>)> {
    let m = Manifest::read(manifest)?;
    let (primary, fallback) = backend::open_parts(source, dense)?;
    let mut plans = Vec::new();
    for part in std::iter::once(&primary).chain(fallback.iter()) {
        for (file, tensors) in tensor_bytes(part.as_ref())? {
            plans.push(plan_file(file, &tensors, &m)?);
        }
    }
    let inner: Arc<dyn Backend> = Arc::from(backend::assemble(primary, fallback)?);
    // The assembled backend's files are the parts' (moved, maybe into new
    // allocations): found again by path and version.
    let sources = inner.source_files();
    let mut files = Vec::with_capacity(plans.len());
    for (path, version, size, check) in plans {
        let source = sources
            .iter()
            .position(|s| s.path() == path && *s.version() == version)
            .ok_or_else(|| {
                err(
                    ErrorKind::BadValue,
                    "internal error: an opened file is not among the mount's files",
                )
                .path(&path)
            })?;
        files.push(FileState {
            path,
            version,
            size,
            source,
            check,
        });
    }
    drop(sources);
    let integrity = Arc::new(MountIntegrity {
        manifest: std::path::absolute(manifest).unwrap_or_else(|_| manifest.to_path_buf()),
        unverified,
        files,
        backend: inner.clone(),
        lock: Mutex::new(()),
        settled: Condvar::new(),
        on_failure: Mutex::new(Vec::new()),
        started: AtomicBool::new(false),
    });
    let wrapped = IntegrityBackend::wrap(inner, integrity.clone());
    Ok((Arc::new(wrapped), integrity))
}

type Plan = (PathBuf, SourceVersion, u64, Check);

/// How one file is checked, after the checks that refuse a mount.
fn plan_file(file: &SourceFile, tensors: &[TensorBytes], m: &Manifest) -> Result<Plan> {
    let path = file.path().to_path_buf();
    let entries = m.for_file(&basename(&path)?);
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let problems = structure(&path, &entries, &names);
    if !problems.is_empty() {
        let kind = if problems.iter().any(|p| p.problem == Problem::NoEntry) {
            ErrorKind::BadValue
        } else {
            ErrorKind::Checksum
        };
        let shown: Vec<String> = problems.iter().take(5).map(|p| p.to_string()).collect();
        let more = problems.len().saturating_sub(shown.len());
        return Err(refusal(
            kind,
            m,
            format!(
                "{}{}",
                shown.join("; "),
                if more > 0 {
                    format!("; and {more} more")
                } else {
                    String::new()
                }
            ),
        ));
    }
    let check = match entries.header {
        Some(h) => {
            let found = digest_header(file, tensors)?;
            if found != h.digest {
                return Err(refusal(
                    ErrorKind::Checksum,
                    m,
                    format!(
                        "{}: header sha256 {} differs from the manifest's {} (line {}): the file's \
                         metadata and tensor index are not those the manifest was made from (another \
                         model's manifest, or a changed or damaged file)",
                        Escaped(&path.to_string_lossy()),
                        hex(&found),
                        hex(&h.digest),
                        h.line
                    ),
                ));
            }
            tensor_check(tensors, &entries.tensors)
        }
        None => match entries.whole {
            Some(w) => Check::Whole {
                expected: w.digest,
                state: AtomicU8::new(PENDING),
                done: AtomicU64::new(0),
                problem: OnceLock::new(),
            },
            // `structure` refused a file without lines.
            None => {
                return Err(refusal(
                    ErrorKind::BadValue,
                    m,
                    "no line for the file".into(),
                ));
            }
        },
    };
    Ok((path, *file.version(), file.len(), check))
}

fn tensor_check(tensors: &[TensorBytes], lines: &HashMap<&str, &super::Entry>) -> Check {
    let mut cells = Vec::with_capacity(tensors.len());
    let mut by_name = HashMap::with_capacity(tensors.len());
    for t in tensors {
        // `structure` checked that every tensor has its line.
        let Some(e) = lines.get(t.name.as_str()) else {
            continue;
        };
        by_name.insert(t.name.clone(), cells.len());
        cells.push(Cell {
            name: t.name.clone(),
            expected: e.digest,
            line: e.line,
            ranges: t.ranges.clone(),
            state: AtomicU8::new(UNCHECKED),
            found: OnceLock::new(),
        });
    }
    Check::Tensors {
        cells,
        by_name,
        verified: AtomicU64::new(0),
        failed: AtomicU64::new(0),
    }
}

fn refusal(kind: ErrorKind, m: &Manifest, why: String) -> Error {
    err(
        kind,
        format!(
            "refusing to mount: {why} (manifest {})",
            Escaped(&m.path().to_string_lossy())
        ),
    )
}

/// Resets a tensor left `CHECKING` by a hash that did not finish (an I/O
/// error, or a panic), so the next decode tries again instead of waiting
/// for ever.
struct CheckingGuard<'a> {
    integrity: &'a MountIntegrity,
    cell: &'a Cell,
    armed: bool,
}

impl Drop for CheckingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.integrity
                .settle(|| self.cell.state.store(UNCHECKED, Ordering::Release));
        }
    }
}

impl MountIntegrity {
    pub fn manifest(&self) -> &Path {
        &self.manifest
    }

    pub fn unverified(&self) -> Unverified {
        self.unverified
    }

    /// How each source file is checked, with its path.
    pub fn files(&self) -> Vec<(&Path, FileCheck)> {
        self.files
            .iter()
            .map(|f| {
                (
                    f.path.as_path(),
                    match f.check {
                        Check::Tensors { .. } => FileCheck::Tensors,
                        Check::Whole { .. } => FileCheck::WholeFile,
                    },
                )
            })
            .collect()
    }

    /// Run `f` whenever a whole-file check fails under
    /// [`Unverified::Allow`] (the mount drops its cached chunks and the
    /// kernel's pages through it: they were served unverified).
    pub fn on_failure(&self, f: impl Fn() + Send + Sync + 'static) {
        lock(&self.on_failure).push(Box::new(f));
    }

    /// Start the whole-file checks (once; in the daemon, after it forked:
    /// threads do not survive a fork).
    pub fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::SeqCst) {
            return;
        }
        // Logged here, not at open: the daemon's log exists only now.
        for f in &self.files {
            log::info!(
                "{}: checked against manifest {}: {}",
                Escaped(&f.path.to_string_lossy()),
                Escaped(&self.manifest.to_string_lossy()),
                match &f.check {
                    Check::Tensors { cells, .. } => format!(
                        "header verified at mount; each of its {} tensors is verified on its first read",
                        cells.len()
                    ),
                    Check::Whole { .. } => format!(
                        "whole file, verified in the background (unverified={})",
                        self.unverified.name()
                    ),
                }
            );
        }
        for (slot, f) in self.files.iter().enumerate() {
            if !matches!(f.check, Check::Whole { .. }) {
                continue;
            }
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("rknot-sha256-{slot}"))
                .spawn(move || me.verify_whole(slot));
            if let Err(e) = spawned {
                self.finish_whole(
                    slot,
                    Err(format!("cannot start the verification thread: {e}")),
                );
            }
        }
    }

    /// Whether a decode may have to wait for a whole-file check.
    pub fn may_hold(&self) -> bool {
        self.unverified == Unverified::Hold
            && self.files.iter().any(|f| {
                matches!(&f.check, Check::Whole { state, .. } if state.load(Ordering::Acquire) == PENDING)
            })
    }

    /// Change state under the lock, then wake every waiter.
    fn settle(&self, change: impl FnOnce()) {
        let g = lock(&self.lock);
        change();
        drop(g);
        self.settled.notify_all();
    }

    fn source(&self, slot: usize) -> Option<&SourceFile> {
        let source = self.files.get(slot)?.source;
        self.backend.source_files().get(source).copied()
    }

    /// The background check of file `slot` (its own thread).
    fn verify_whole(&self, slot: usize) {
        let Some(f) = self.files.get(slot) else {
            return;
        };
        let Check::Whole { expected, done, .. } = &f.check else {
            return;
        };
        let Some(file) = self.source(slot) else {
            self.finish_whole(slot, Err("internal error: the file is not open".into()));
            return;
        };
        let t0 = Instant::now();
        let last_log = Mutex::new(Instant::now());
        let shown = Escaped(&f.path.to_string_lossy()).to_string();
        let result = digest_whole(file, READ_PIECE, &|n| {
            let now = done.fetch_add(n, Ordering::Relaxed) + n;
            let mut last = lock(&last_log);
            // A large file on a slow disk: say how far it is now and then.
            if last.elapsed().as_secs() >= 10 {
                *last = Instant::now();
                log::info!(
                    "{shown}: verifying against the manifest: {} of {} MiB",
                    now >> 20,
                    f.size >> 20
                );
            }
        });
        let outcome = match result {
            Ok(d) if d == *expected => {
                log::info!(
                    "{shown}: whole-file sha256 matches manifest {} ({} MiB in {:.1} s)",
                    Escaped(&self.manifest.to_string_lossy()),
                    f.size >> 20,
                    t0.elapsed().as_secs_f64()
                );
                Ok(())
            }
            Ok(d) => Err(format!(
                "sha256 {} differs from the manifest's {}",
                hex(&d),
                hex(expected)
            )),
            Err(e) => Err(format!("could not be read to verify it: {e}")),
        };
        self.finish_whole(slot, outcome);
    }

    fn finish_whole(&self, slot: usize, outcome: std::result::Result<(), String>) {
        let Some(f) = self.files.get(slot) else {
            return;
        };
        let Check::Whole { state, problem, .. } = &f.check else {
            return;
        };
        let failed = outcome.is_err();
        if let Err(why) = outcome {
            log::error!(
                "{}: {why} (manifest {}); every read of its tensors fails with EIO",
                Escaped(&f.path.to_string_lossy()),
                Escaped(&self.manifest.to_string_lossy())
            );
            let _ = problem.set(why);
        }
        self.settle(|| {
            state.store(
                if failed { FILE_FAILED } else { FILE_VERIFIED },
                Ordering::Release,
            )
        });
        if failed && self.unverified == Unverified::Allow {
            for f in lock(&self.on_failure).iter() {
                f();
            }
        }
    }

    /// Whether tensor bytes behind `gate` may be decoded now: verifies a
    /// tensor on its first decode, waits for a held whole-file check.
    fn admit(&self, gate: &Gate) -> Result<()> {
        match *gate {
            Gate::Open => Ok(()),
            Gate::Unlisted { slot } => Err(self.unlisted(slot)),
            Gate::Tensor { slot, cell } => self.admit_tensor(slot, cell),
            Gate::File { slot } => self.admit_file(slot, true),
        }
    }

    /// After a decode: a whole-file check that failed meanwhile (allow)
    /// wins over the bytes just decoded.
    fn after_decode(&self, gate: &Gate) -> Result<()> {
        match *gate {
            Gate::File { slot } => self.admit_file(slot, false),
            _ => Ok(()),
        }
    }

    fn unlisted(&self, slot: usize) -> Error {
        let path = self
            .files
            .get(slot)
            .map(|f| f.path.clone())
            .unwrap_or_default();
        err(
            ErrorKind::Checksum,
            format!(
                "the manifest {} has no line for this tensor; it is not served",
                Escaped(&self.manifest.to_string_lossy())
            ),
        )
        .path(&path)
    }

    fn admit_file(&self, slot: usize, wait: bool) -> Result<()> {
        let Some(f) = self.files.get(slot) else {
            return Ok(());
        };
        let Check::Whole { state, problem, .. } = &f.check else {
            return Ok(());
        };
        let mut s = state.load(Ordering::Acquire);
        if s == PENDING && wait && self.unverified == Unverified::Hold {
            let mut g = lock(&self.lock);
            while state.load(Ordering::Acquire) == PENDING {
                g = self.settled.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            drop(g);
            s = state.load(Ordering::Acquire);
        }
        if s == FILE_FAILED {
            return Err(err(
                ErrorKind::Checksum,
                format!(
                    "whole-file check against manifest {} failed ({}); nothing of this file is served",
                    Escaped(&self.manifest.to_string_lossy()),
                    problem.get().map_or("", String::as_str)
                ),
            )
            .path(&f.path));
        }
        Ok(())
    }

    fn admit_tensor(&self, slot: usize, index: usize) -> Result<()> {
        let Some(f) = self.files.get(slot) else {
            return Ok(());
        };
        let Check::Tensors {
            cells,
            verified,
            failed,
            ..
        } = &f.check
        else {
            return Ok(());
        };
        let Some(cell) = cells.get(index) else {
            return Err(self.unlisted(slot));
        };
        loop {
            match cell.state.load(Ordering::Acquire) {
                VERIFIED => return Ok(()),
                BAD => return Err(self.bad_tensor(f, cell)),
                UNCHECKED => {
                    if cell
                        .state
                        .compare_exchange(UNCHECKED, CHECKING, Ordering::AcqRel, Ordering::Acquire)
                        .is_err()
                    {
                        continue;
                    }
                    // This thread hashes; the others wait for it.
                    let mut guard = CheckingGuard {
                        integrity: self,
                        cell,
                        armed: true,
                    };
                    let file = self.source(slot).ok_or_else(|| {
                        err(ErrorKind::BadValue, "internal error: the file is not open")
                            .path(&f.path)
                    })?;
                    let found = digest_ranges(file, &cell.ranges, TENSOR_PIECE)
                        .map_err(|e| e.tensor(&cell.name))?;
                    guard.armed = false;
                    let good = found == cell.expected;
                    if good {
                        verified.fetch_add(1, Ordering::Relaxed);
                    } else {
                        let _ = cell.found.set(found);
                        failed.fetch_add(1, Ordering::Relaxed);
                        crate::logging::throttled!(
                            log::Level::Error,
                            &format!("manifest mismatch {}", f.path.display()),
                            "{}: tensor {}: stored bytes have sha256 {}, which differs from manifest {} \
                             (line {}: {}); every read of this tensor fails with EIO, other tensors \
                             are served",
                            Escaped(&f.path.to_string_lossy()),
                            Escaped(&cell.name),
                            hex(&found),
                            Escaped(&self.manifest.to_string_lossy()),
                            cell.line,
                            hex(&cell.expected)
                        );
                    }
                    self.settle(|| {
                        cell.state
                            .store(if good { VERIFIED } else { BAD }, Ordering::Release)
                    });
                    return if good {
                        Ok(())
                    } else {
                        Err(self.bad_tensor(f, cell))
                    };
                }
                _ => {
                    // Another decode is hashing this tensor: wait for it.
                    let mut g = lock(&self.lock);
                    while cell.state.load(Ordering::Acquire) == CHECKING {
                        g = self.settled.wait(g).unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
        }
    }

    fn bad_tensor(&self, f: &FileState, cell: &Cell) -> Error {
        err(
            ErrorKind::Checksum,
            format!(
                "stored bytes differ from manifest {} (line {}: sha256 {}, found {}); this tensor is \
                 not served",
                Escaped(&self.manifest.to_string_lossy()),
                cell.line,
                hex(&cell.expected),
                cell.found.get().map_or_else(|| "?".to_string(), hex)
            ),
        )
        .tensor(&cell.name)
        .path(&f.path)
    }

    /// Tensors verified and failed so far, over every file.
    pub fn tensor_counts(&self) -> (u64, u64) {
        self.files.iter().fold((0, 0), |(v, b), f| match &f.check {
            Check::Tensors {
                verified, failed, ..
            } => (
                v + verified.load(Ordering::Relaxed),
                b + failed.load(Ordering::Relaxed),
            ),
            Check::Whole { .. } => (v, b),
        })
    }

    fn failed_names(cells: &[Cell]) -> Vec<&str> {
        cells
            .iter()
            .filter(|c| c.state.load(Ordering::Relaxed) == BAD)
            .take(FAILED_NAMES_SHOWN)
            .map(|c| c.name.as_str())
            .collect()
    }

    fn whole_state(state: &AtomicU8) -> &'static str {
        match state.load(Ordering::Acquire) {
            PENDING => "verifying",
            FILE_VERIFIED => "verified",
            _ => "failed",
        }
    }

    /// `ctl`'s lines.
    pub fn status_text(&self) -> String {
        let (v, b) = self.tensor_counts();
        let mut o = format!(
            "integrity: manifest {} (unverified={})\n\
             integrity: tensors verified {v}, failed {b}\n",
            Escaped(&self.manifest.to_string_lossy()),
            self.unverified.name()
        );
        for f in &self.files {
            let path = Escaped(&f.path.to_string_lossy()).to_string();
            match &f.check {
                Check::Tensors {
                    cells,
                    verified,
                    failed,
                    ..
                } => {
                    o += &format!(
                        "integrity: {path}: per tensor: verified {}, failed {} of {} (header verified at mount)\n",
                        verified.load(Ordering::Relaxed),
                        failed.load(Ordering::Relaxed),
                        cells.len()
                    );
                    for n in Self::failed_names(cells) {
                        o += &format!("integrity: {path}: failed tensor {}\n", Escaped(n));
                    }
                }
                Check::Whole {
                    state,
                    done,
                    problem,
                    ..
                } => {
                    o += &format!(
                        "integrity: {path}: whole file {}, {} of {} bytes hashed{}\n",
                        Self::whole_state(state),
                        done.load(Ordering::Relaxed),
                        f.size,
                        problem
                            .get()
                            .map_or(String::new(), |p| format!(": {}", Escaped(p)))
                    );
                }
            }
        }
        o
    }

    /// `ctl.json`'s `integrity` object.
    pub fn status_json(&self) -> Value {
        let (v, b) = self.tensor_counts();
        let files: Vec<Value> = self
            .files
            .iter()
            .map(|f| match &f.check {
                Check::Tensors {
                    cells,
                    verified,
                    failed,
                    ..
                } => json!({
                    "path": f.path.display().to_string(),
                    "check": "tensors",
                    "tensors": cells.len(),
                    "tensors_verified": verified.load(Ordering::Relaxed),
                    "tensors_failed": failed.load(Ordering::Relaxed),
                    "failed_tensors": Self::failed_names(cells),
                }),
                Check::Whole {
                    state,
                    done,
                    problem,
                    ..
                } => json!({
                    "path": f.path.display().to_string(),
                    "check": "whole_file",
                    "state": Self::whole_state(state),
                    "bytes_hashed": done.load(Ordering::Relaxed),
                    "bytes_total": f.size,
                    "error": problem.get(),
                }),
            })
            .collect();
        json!({
            "manifest": self.manifest.display().to_string(),
            "unverified": self.unverified.name(),
            "tensors_verified": v,
            "tensors_failed": b,
            "files": files,
        })
    }
}

/// What stands between a tensor index and its decode.
#[derive(Debug, Clone, Copy)]
enum Gate {
    /// No bytes of its own (an unavailable placeholder): nothing to check.
    Open,
    /// Verified on first decode: cell `cell` of file `slot`.
    Tensor { slot: usize, cell: usize },
    /// Its file is checked as a whole.
    File { slot: usize },
    /// Its file is checked per tensor but the manifest has no line for it
    /// (refused at mount; kept closed should it ever happen).
    Unlisted { slot: usize },
}

/// The mount's backend behind its manifest checks (module docs). Every
/// other method is the inner backend's.
pub struct IntegrityBackend {
    inner: Arc<dyn Backend>,
    integrity: Arc<MountIntegrity>,
    gates: Vec<Gate>,
    /// The fallback, checked the same way (encoding jobs read it).
    fallback: Option<Arc<dyn Backend>>,
}

impl IntegrityBackend {
    /// `inner` (the mount's backend or its fallback) checked by `integrity`.
    pub fn wrap(inner: Arc<dyn Backend>, integrity: Arc<MountIntegrity>) -> IntegrityBackend {
        let sources = inner.source_files();
        // Which of the integrity's files each of `inner`'s files is.
        let slot_of: Vec<Option<usize>> = sources
            .iter()
            .map(|s| {
                integrity
                    .files
                    .iter()
                    .position(|f| f.path == s.path() && f.version == *s.version())
            })
            .collect();
        let mut gates = Vec::with_capacity(inner.tensors().len());
        for (i, t) in inner.tensors().entries().iter().enumerate() {
            let gate = match inner.stored_ranges(i) {
                None => Gate::Open,
                Some(sr) => {
                    let slot = sources
                        .iter()
                        .position(|s| std::ptr::eq(*s, sr.file))
                        .and_then(|j| slot_of.get(j).copied().flatten());
                    match slot.map(|s| (s, &integrity.files[s].check)) {
                        Some((slot, Check::Tensors { by_name, .. })) => {
                            match by_name.get(&t.name.dot) {
                                Some(&cell) => Gate::Tensor { slot, cell },
                                None => Gate::Unlisted { slot },
                            }
                        }
                        Some((slot, Check::Whole { .. })) => Gate::File { slot },
                        // A file the manifest checks did not plan: never
                        // served unchecked.
                        None => Gate::Unlisted { slot: usize::MAX },
                    }
                }
            };
            gates.push(gate);
        }
        drop(sources);
        let fallback = inner
            .fallback_backend()
            .map(|fb| Arc::new(IntegrityBackend::wrap(fb, integrity.clone())) as Arc<dyn Backend>);
        IntegrityBackend {
            inner,
            integrity,
            gates,
            fallback,
        }
    }

    pub fn integrity(&self) -> &Arc<MountIntegrity> {
        &self.integrity
    }
}

impl Backend for IntegrityBackend {
    fn summary(&self) -> &SourceSummary {
        self.inner.summary()
    }

    fn fallback_summary(&self) -> Option<&SourceSummary> {
        self.inner.fallback_summary()
    }

    fn tensors(&self) -> &TensorTable {
        self.inner.tensors()
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        let Some(gate) = self.gates.get(index) else {
            return self.inner.read_f32(index, first_elem, out);
        };
        self.integrity.admit(gate)?;
        self.inner.read_f32(index, first_elem, out)?;
        self.integrity.after_decode(gate)
    }

    /// Stored blocks pass the same gate as a decode: nothing of a tensor
    /// the manifest has not verified reaches the native view either.
    fn read_stored_blocks(&self, index: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let Some(gate) = self.gates.get(index) else {
            return self.inner.read_stored_blocks(index, offset, buf);
        };
        self.integrity.admit(gate)?;
        self.inner.read_stored_blocks(index, offset, buf)?;
        self.integrity.after_decode(gate)
    }

    fn block_code(&self, index: usize) -> Option<crate::backend::BlockCode> {
        self.inner.block_code(index)
    }

    fn source_files(&self) -> Vec<&SourceFile> {
        self.inner.source_files()
    }

    fn fallback_backend(&self) -> Option<Arc<dyn Backend>> {
        self.fallback.clone()
    }

    /// The inner dense backend: encoding jobs copy ggml blocks verbatim
    /// through it (`read_stored`), which these checks do not see.
    fn as_dense(&self) -> Option<&DenseBackend> {
        self.inner.as_dense()
    }

    fn stored_ranges(&self, index: usize) -> Option<StoredRanges<'_>> {
        self.inner.stored_ranges(index)
    }
}
