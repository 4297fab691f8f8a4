//! Background encoding jobs started through the mount's `ctl` file.
//!
//! Commands (one per line written to `ctl`):
//! ```text
//! encode sk32 rank=64 out=NAME [energy=E] [overwrite=1]
//! encode rknot coverage=0.3 profile=faithful|seed|lossless out=NAME [bits_qk= bits_v= bits_ffn=
//!              graded=1 extra_bits= target_bpw= block=] [overwrite=1]
//! encode knot out=NAME [overwrite=1]
//! cancel JOB
//! ```
//! Rules:
//! - at most `max_running` jobs run at once, the rest wait in a queue; they
//!   run on their own thread pool at a lower CPU priority (nice 10), so the
//!   FUSE threads serving reads are never starved;
//! - NAME is a plain file name (no `/`, no `..`, no leading dot); outputs
//!   land only in the jobs directory; an existing file is never replaced
//!   without `overwrite=1` (also not one that appears while the job runs),
//!   and a source of the mount (the mounted file, its fallback; by device
//!   and inode, so a hard link too) never; two queued or running jobs never
//!   share an output;
//! - jobs read the model through the backend the mount holds open (the
//!   file it serves, whatever its path names now); outputs get at most the
//!   permission bits of the mount's source files;
//! - outputs are written atomically (temp file + fsync + rename): a failed
//!   or cancelled job, or a killed daemon, leaves nothing at the target;
//! - at most [`MAX_QUEUED`] jobs wait (a submit beyond fails) and the last
//!   [`MAX_FINISHED`] finished jobs are kept for `ctl`; older ones expire;
//! - `shutdown` (unmount) cancels queued and running jobs and waits for them
//!   to remove their temporary files.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use serde_json::{Value, json};

use crate::backend::Backend;
use crate::encode::Progress;
use crate::encode::output::OutputTarget;
use crate::encode::rknot::{Profile, RknotOptions};
use crate::encode::sk32::Sk32Options;
use crate::text::Escaped;

/// Jobs waiting to run, at most: a submit beyond this fails. Encodings take
/// minutes each; a longer queue is a script gone wrong, and every queued
/// job is rendered in each read of `ctl` and `ctl.json`.
pub const MAX_QUEUED: usize = 16;

/// Finished jobs (done, failed, cancelled) kept for `ctl`, `ctl.json` and
/// `jobs/`; the oldest expire first.
pub const MAX_FINISHED: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    Queued,
    Running,
    Done,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
    fn finished(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }
}

#[derive(Debug, Clone)]
enum Encoding {
    Sk32(Sk32Options),
    Rknot(Box<RknotOptions>),
    Knot,
}

/// A parsed `ctl` command.
#[derive(Debug, Clone)]
pub enum Command {
    Encode {
        encoding: EncodingKind,
        out: String,
        overwrite: bool,
    },
    Cancel(u64),
}

/// What to encode (kept opaque outside this module).
#[derive(Debug, Clone)]
pub struct EncodingKind(Encoding);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A plain file name for a job's output.
pub fn check_out_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("out= is empty".into());
    }
    if name.contains("..") {
        return Err(format!("out={name:?}: '..' is not allowed"));
    }
    if name.contains('/') || name.contains('\0') {
        return Err(format!("out={name:?}: must be a plain file name (no '/')"));
    }
    if name.starts_with('.') {
        return Err(format!("out={name:?}: must not start with '.'"));
    }
    // A control character in a file name drives the terminal of whoever
    // lists the directory.
    if name.chars().any(crate::text::is_unsafe_char) {
        return Err(format!("out={name:?}: control characters are not allowed"));
    }
    if name.len() > crate::encode::output::NAME_MAX {
        return Err(format!("out=: name of {} bytes is too long", name.len()));
    }
    Ok(())
}

fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{k}={v:?}: not a valid number"))
}

fn flag(k: &str, v: &str) -> Result<bool, String> {
    match v {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" => Ok(false),
        _ => Err(format!("{k}={v:?}: expected 0 or 1")),
    }
}

/// Parse one command line.
pub fn parse_command(line: &str) -> Result<Command, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["cancel", id] => Ok(Command::Cancel(
            id.parse()
                .map_err(|_| format!("cancel {id:?}: not a job id"))?,
        )),
        ["encode", kind, args @ ..] => {
            let mut out = None;
            let mut overwrite = false;
            let mut sk = Sk32Options::default();
            let mut rk = RknotOptions::default();
            for a in args {
                let (k, v) = a
                    .split_once('=')
                    .ok_or_else(|| format!("{a:?}: expected key=value"))?;
                match (*kind, k) {
                    (_, "out") => out = Some(v.to_string()),
                    (_, "overwrite") => overwrite = flag(k, v)?,
                    ("sk32", "rank") => sk.rank = Some(num(k, v)?),
                    ("sk32", "energy") => sk.energy = Some(num(k, v)?),
                    ("rknot", "coverage") => rk.coverage = num(k, v)?,
                    ("rknot", "profile") => {
                        rk.profile = Profile::parse(v)
                            .filter(|p| *p != Profile::Calibrated)
                            .ok_or_else(|| {
                                // Calibration reads a text and a STATS file
                                // by path, which a job must not do with the
                                // daemon's rights.
                                format!(
                                    "profile={v:?}: expected seed, faithful or lossless (the calibrated \
                                     profile runs from the command line: rknot encode rknot \
                                     --calibrate)"
                                )
                            })?
                    }
                    ("rknot", "bits_qk") => rk.bits_qk = num(k, v)?,
                    ("rknot", "bits_v") => rk.bits_v = num(k, v)?,
                    ("rknot", "bits_ffn") => rk.bits_ffn = num(k, v)?,
                    ("rknot", "graded") => rk.graded = flag(k, v)?,
                    ("rknot", "extra_bits") => rk.extra_bits = num(k, v)?,
                    ("rknot", "target_bpw") => rk.target_bpw = num(k, v)?,
                    ("rknot", "block") => rk.block = num(k, v)?,
                    ("rknot", "compressed_only") => rk.compressed_only = flag(k, v)?,
                    _ => return Err(format!("encode {kind}: unknown option {k:?}")),
                }
            }
            let out = out.ok_or_else(|| format!("encode {kind}: out=NAME is required"))?;
            check_out_name(&out)?;
            let encoding = match *kind {
                "sk32" => {
                    if let Some(e) = sk.energy
                        && !(0.0..=1.0).contains(&e)
                    {
                        return Err(format!("energy={e}: must be in [0, 1]"));
                    }
                    if sk.rank == Some(0) {
                        return Err("rank=0: must be at least 1".into());
                    }
                    Encoding::Sk32(sk)
                }
                "rknot" => {
                    if !(rk.coverage > 0.0 && rk.coverage <= 1.0) {
                        return Err(format!("coverage={}: must be in (0, 1]", rk.coverage));
                    }
                    for (k, b) in [
                        ("bits_qk", rk.bits_qk),
                        ("bits_v", rk.bits_v),
                        ("bits_ffn", rk.bits_ffn),
                    ] {
                        if !(1..=16).contains(&b) {
                            return Err(format!("{k}={b}: must be in 1..=16"));
                        }
                    }
                    Encoding::Rknot(Box::new(rk))
                }
                "knot" => Encoding::Knot,
                other => return Err(format!("encode {other:?}: expected sk32, rknot or knot")),
            };
            Ok(Command::Encode {
                encoding: EncodingKind(encoding),
                out,
                overwrite,
            })
        }
        [] => Err("empty command".into()),
        _ => Err(format!(
            "unknown command {line:?} (encode sk32|rknot|knot ... out=NAME, cancel JOB)"
        )),
    }
}

pub struct Job {
    pub id: u64,
    pub command: String,
    encoding: Encoding,
    pub output: PathBuf,
    overwrite: bool,
    pub progress: Progress,
    state: Mutex<JobState>,
    error: Mutex<Option<String>>,
    submitted: SystemTime,
    started: Mutex<Option<Instant>>,
    elapsed: Mutex<Option<f64>>,
}

impl Job {
    pub fn state(&self) -> JobState {
        *lock(&self.state)
    }

    pub fn error(&self) -> Option<String> {
        lock(&self.error).clone()
    }

    fn elapsed_secs(&self) -> f64 {
        if let Some(e) = *lock(&self.elapsed) {
            return e;
        }
        lock(&self.started).map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    pub fn to_json(&self) -> Value {
        let done = self.progress.done.load(Ordering::Relaxed);
        let total = self.progress.total.load(Ordering::Relaxed);
        json!({
            "id": self.id,
            "command": self.command,
            "state": self.state().name(),
            "tensors_done": done,
            "tensors_total": total,
            "percent": if total > 0 { done as f64 * 100.0 / total as f64 } else { 0.0 },
            "output": self.output.display().to_string(),
            "bytes_written": self.progress.bytes_written.load(Ordering::Relaxed),
            "elapsed_s": (self.elapsed_secs() * 10.0).round() / 10.0,
            "submitted_unix": self.submitted.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            "error": self.error(),
        })
    }

    pub fn to_text(&self) -> String {
        let v = self.to_json();
        let mut s = format!(
            "job {} {:<9} {}/{} tensors ({:.0}%) {:.1}s {} B -> {}\n    {}\n",
            self.id,
            v["state"].as_str().unwrap_or(""),
            v["tensors_done"],
            v["tensors_total"],
            v["percent"].as_f64().unwrap_or(0.0),
            v["elapsed_s"].as_f64().unwrap_or(0.0),
            v["bytes_written"],
            Escaped(&self.output.display().to_string()),
            Escaped(&self.command)
        );
        if let Some(e) = self.error() {
            s += &format!("    error: {}\n", Escaped(&e));
        }
        s
    }
}

/// What jobs read: the backend the mount serves, already open.
#[derive(Clone)]
pub struct JobSource {
    /// The mount's backend: its source files (the mounted file and its
    /// fallback) are what an output must never replace, and their
    /// permission bits bound the output's.
    pub mounted: Arc<dyn Backend>,
    /// The dense model jobs encode from: the mounted backend when it is
    /// dense, else its fallback; None when the mount has no dense data.
    pub dense: Option<Arc<dyn Backend>>,
}

impl JobSource {
    /// Jobs of a mount serving `backend`.
    pub fn of_mount(backend: &Arc<dyn Backend>) -> JobSource {
        let dense = if backend.as_dense().is_some() {
            Some(backend.clone())
        } else {
            backend.fallback_backend()
        };
        JobSource {
            mounted: backend.clone(),
            dense,
        }
    }

    /// Where job outputs go and what they may be: mode and sources from the
    /// mount's open files.
    fn target(&self, path: &Path, overwrite: bool) -> Result<OutputTarget, String> {
        OutputTarget::from_sources(path, overwrite, &self.mounted.source_files())
            .map_err(|e| e.to_string())
    }
}

struct Shared {
    jobs: Mutex<Vec<Arc<Job>>>,
    queue: Mutex<VecDeque<Arc<Job>>>,
    wake: Condvar,
    stopping: Mutex<bool>,
    jobs_dir: PathBuf,
    source: JobSource,
    pool: Option<rayon::ThreadPool>,
}

pub struct JobManager {
    shared: Arc<Shared>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    next_id: Mutex<u64>,
}

/// Lower this thread's CPU priority (Linux: per-thread nice).
fn lower_priority() {
    // SAFETY: setpriority/gettid on the calling thread only.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}

impl JobManager {
    pub fn new(
        jobs_dir: PathBuf,
        source: JobSource,
        max_running: usize,
        threads: usize,
    ) -> JobManager {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("rknot-job-{i}"))
            .start_handler(|_| lower_priority())
            .build()
            .map_err(|e| log::warn!("job thread pool: {e}"))
            .ok();
        let shared = Arc::new(Shared {
            jobs: Mutex::new(Vec::new()),
            queue: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            stopping: Mutex::new(false),
            jobs_dir,
            source,
            pool,
        });
        let mut workers = Vec::new();
        for i in 0..max_running.max(1) {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name(format!("rknot-jobs-{i}"))
                .spawn(move || worker(&s))
            {
                Ok(h) => workers.push(h),
                Err(e) => log::error!("cannot start job worker: {e}"),
            }
        }
        JobManager {
            shared,
            workers: Mutex::new(workers),
            next_id: Mutex::new(1),
        }
    }

    pub fn jobs_dir(&self) -> &Path {
        &self.shared.jobs_dir
    }

    /// Run one command line; returns a short answer (the job id).
    pub fn submit(&self, line: &str) -> Result<String, String> {
        match parse_command(line)? {
            Command::Cancel(id) => {
                let job = self
                    .job(id)
                    .ok_or_else(|| format!("cancel {id}: no such job"))?;
                let mut st = lock(&job.state);
                match *st {
                    JobState::Queued => {
                        *st = JobState::Cancelled;
                        drop(st);
                        lock(&self.shared.queue).retain(|j| j.id != id);
                        expire_finished(&mut lock(&self.shared.jobs));
                    }
                    JobState::Running => job.progress.cancel(),
                    s => return Err(format!("cancel {id}: job is already {}", s.name())),
                }
                Ok(format!("cancelling job {id}"))
            }
            Command::Encode {
                encoding,
                out,
                overwrite,
            } => {
                let output = self.shared.jobs_dir.join(&out);
                let Some(dense) = &self.shared.source.dense else {
                    return Err(
                        "no dense model to encode from (mount a GGUF/.knot, or use --dense)".into(),
                    );
                };
                if matches!(encoding.0, Encoding::Knot)
                    && !dense
                        .as_dense()
                        .is_some_and(|d| d.summary().format.is_repackable())
                {
                    return Err("encode knot needs a GGUF dense source".into());
                }
                if std::fs::symlink_metadata(&output).is_ok() && !overwrite {
                    return Err(format!(
                        "{} exists (add overwrite=1 to replace it)",
                        output.display()
                    ));
                }
                self.shared
                    .source
                    .target(&output, overwrite)?
                    .check_not_a_source()
                    .map_err(|e| e.to_string())?;
                // Checks against other jobs and the insert under one lock:
                // two submits cannot both pass.
                let mut jobs = lock(&self.shared.jobs);
                // Checked under the jobs lock: shutdown sets `stopping`
                // before it walks the jobs under that lock, so a job
                // inserted here is either refused or cancelled by it, never
                // queued with no worker left to run it.
                if *lock(&self.shared.stopping) {
                    return Err("the mount is stopping: no new jobs".into());
                }
                let mut queued = 0;
                for j in jobs.iter() {
                    let state = j.state();
                    if state.finished() {
                        continue;
                    }
                    if j.output == output {
                        return Err(format!(
                            "job {} ({}) already writes {}",
                            j.id,
                            state.name(),
                            output.display()
                        ));
                    }
                    if state == JobState::Queued {
                        queued += 1;
                    }
                }
                if queued >= MAX_QUEUED {
                    return Err(format!(
                        "{queued} jobs are queued, the most allowed: wait for some to finish \
                         or cancel some"
                    ));
                }
                let id = {
                    let mut n = lock(&self.next_id);
                    let id = *n;
                    *n += 1;
                    id
                };
                let job = Arc::new(Job {
                    id,
                    command: line.trim().to_string(),
                    encoding: encoding.0,
                    output,
                    overwrite,
                    progress: Progress::default(),
                    state: Mutex::new(JobState::Queued),
                    error: Mutex::new(None),
                    submitted: SystemTime::now(),
                    started: Mutex::new(None),
                    elapsed: Mutex::new(None),
                });
                jobs.push(job.clone());
                expire_finished(&mut jobs);
                lock(&self.shared.queue).push_back(job);
                drop(jobs);
                self.shared.wake.notify_one();
                Ok(format!("job {id} queued"))
            }
        }
    }

    pub fn job(&self, id: u64) -> Option<Arc<Job>> {
        lock(&self.shared.jobs).iter().find(|j| j.id == id).cloned()
    }

    pub fn jobs(&self) -> Vec<Arc<Job>> {
        lock(&self.shared.jobs).clone()
    }

    pub fn to_json(&self) -> Value {
        Value::Array(self.jobs().iter().map(|j| j.to_json()).collect())
    }

    pub fn to_text(&self) -> String {
        let jobs = self.jobs();
        if jobs.is_empty() {
            return "jobs:      none\n".into();
        }
        let mut s = format!(
            "jobs:      {} (output directory {})\n",
            jobs.len(),
            Escaped(&self.shared.jobs_dir.display().to_string())
        );
        for j in jobs {
            s += &j.to_text();
        }
        s
    }

    /// Cancel everything and wait for running jobs to clean up.
    pub fn shutdown(&self) {
        *lock(&self.shared.stopping) = true;
        lock(&self.shared.queue).clear();
        // Every unfinished job is in the list, also one a worker has taken
        // from the queue but not yet marked running: under the job's state
        // lock it is either still queued (then the worker skips it) or
        // running (then it sees the cancel at its next tensor).
        for j in self.jobs() {
            let mut st = lock(&j.state);
            match *st {
                JobState::Queued => *st = JobState::Cancelled,
                JobState::Running => j.progress.cancel(),
                _ => {}
            }
        }
        self.shared.wake.notify_all();
        for h in lock(&self.workers).drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for JobManager {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker(s: &Shared) {
    loop {
        let job = {
            let mut q = lock(&s.queue);
            loop {
                if *lock(&s.stopping) {
                    return;
                }
                if let Some(j) = q.pop_front() {
                    break j;
                }
                q = s.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        {
            let mut st = lock(&job.state);
            if *st != JobState::Queued {
                continue;
            }
            *st = JobState::Running;
        }
        *lock(&job.started) = Some(Instant::now());
        log::info!("job {} started: {}", job.id, job.command);
        match &job.encoding {
            Encoding::Sk32(_) => {
                log::warn!("job {}: {}", job.id, crate::encode::warnings::SK32);
            }
            Encoding::Rknot(o) if o.profile == Profile::Seed => {
                log::warn!("job {}: {}", job.id, crate::encode::warnings::SEED_PROFILE);
            }
            _ => {}
        }
        let result = match &s.pool {
            Some(p) => p.install(|| run(s, &job)),
            None => run(s, &job),
        };
        *lock(&job.elapsed) = Some(lock(&job.started).map_or(0.0, |t| t.elapsed().as_secs_f64()));
        let cancelled = job.progress.cancelled.load(Ordering::Relaxed);
        let state = match (&result, cancelled) {
            (Ok(()), _) => JobState::Done,
            (Err(_), true) => JobState::Cancelled,
            (Err(_), false) => JobState::Failed,
        };
        if let Err(e) = &result
            && state == JobState::Failed
        {
            *lock(&job.error) = Some(e.clone());
        }
        log::info!(
            "job {} {}{}",
            job.id,
            state.name(),
            job.error().map_or(String::new(), |e| format!(": {e}"))
        );
        *lock(&job.state) = state;
        debug_assert!(state.finished());
        expire_finished(&mut lock(&s.jobs));
    }
}

/// Drop the oldest finished jobs beyond [`MAX_FINISHED`] (the list is in
/// submission order; queued and running jobs always stay).
fn expire_finished(jobs: &mut Vec<Arc<Job>>) {
    let finished = jobs.iter().filter(|j| j.state().finished()).count();
    let mut excess = finished.saturating_sub(MAX_FINISHED);
    if excess > 0 {
        jobs.retain(|j| {
            if excess > 0 && j.state().finished() {
                excess -= 1;
                false
            } else {
                true
            }
        });
    }
}

fn run(s: &Shared, job: &Job) -> Result<(), String> {
    let dense = s.source.dense.as_deref().ok_or("no dense source")?;
    let target = s.source.target(&job.output, job.overwrite)?;
    let result = match &job.encoding {
        Encoding::Knot => {
            crate::encode::knot::encode_knot(dense, &target, &job.progress).map(|_| ())
        }
        Encoding::Sk32(o) => {
            crate::encode::sk32::encode_sk32(dense, &target, o, &job.progress).map(|_| ())
        }
        Encoding::Rknot(o) => {
            crate::encode::rknot::encode_rknot(dense, &target, o, &job.progress).map(|_| ())
        }
    };
    result.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commands_and_rejects_bad_names() {
        assert!(matches!(parse_command("cancel 3"), Ok(Command::Cancel(3))));
        assert!(matches!(
            parse_command("encode sk32 rank=8 out=a.sk32"),
            Ok(Command::Encode { .. })
        ));
        assert!(
            parse_command("encode rknot coverage=0.3 profile=faithful out=x.rknot bits_v=6")
                .is_ok()
        );
        assert!(parse_command("encode knot out=x.knot overwrite=1").is_ok());
        match parse_command("encode rknot profile=lossless out=x.rknot") {
            Ok(Command::Encode {
                encoding: EncodingKind(Encoding::Rknot(o)),
                ..
            }) => assert_eq!(o.profile, Profile::Lossless),
            other => panic!("{other:?}"),
        }
        for (bad, want) in [
            ("encode sk32 rank=8", "out=NAME is required"),
            ("encode sk32 rank=8 out=../x", "'..'"),
            ("encode sk32 rank=8 out=/etc/x", "plain file name"),
            ("encode sk32 rank=8 out=.hidden", "must not start with '.'"),
            (
                "encode sk32 rank=8 out=a\u{1b}]0;x\u{7}",
                "control characters",
            ),
            ("encode sk32 rank=x out=a", "not a valid number"),
            ("encode sk32 bits_qk=4 out=a", "unknown option"),
            ("encode rknot coverage=0 out=a", "coverage"),
            ("encode rknot profile=wild out=a", "profile"),
            ("encode zip out=a", "expected sk32, rknot or knot"),
            (
                "encode sk32 rank=8 out=a overwrite=maybe",
                "expected 0 or 1",
            ),
            ("frobnicate", "unknown command"),
            ("cancel x", "not a job id"),
        ] {
            let e = parse_command(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    fn demo() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo/tiny-llama.gguf")
    }

    fn wait_finished(m: &JobManager, id: u64) -> Arc<Job> {
        let deadline = Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let j = m.job(id).unwrap();
            if j.state().finished() {
                return j;
            }
            assert!(Instant::now() < deadline, "job {id} did not finish");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// A job a worker has taken from the queue but not yet marked running
    /// is cancelled by shutdown too; it was left queued, and the worker
    /// then ran it to the end while shutdown waited.
    #[test]
    fn shutdown_cancels_a_job_taken_from_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let source = JobSource::of_mount(&Arc::from(crate::backend::open(&demo(), None).unwrap()));
        // No workers: the job below stands for one a worker has popped.
        let m = JobManager {
            shared: Arc::new(Shared {
                jobs: Mutex::new(Vec::new()),
                queue: Mutex::new(VecDeque::new()),
                wake: Condvar::new(),
                stopping: Mutex::new(false),
                jobs_dir: dir.path().to_path_buf(),
                source,
                pool: None,
            }),
            workers: Mutex::new(Vec::new()),
            next_id: Mutex::new(2),
        };
        let Ok(Command::Encode { encoding, .. }) = parse_command("encode knot out=k.knot") else {
            panic!("parse");
        };
        let popped = Arc::new(Job {
            id: 1,
            command: "encode knot out=k.knot".into(),
            encoding: encoding.0,
            output: dir.path().join("k.knot"),
            overwrite: false,
            progress: Progress::default(),
            state: Mutex::new(JobState::Queued),
            error: Mutex::new(None),
            submitted: SystemTime::now(),
            started: Mutex::new(None),
            elapsed: Mutex::new(None),
        });
        lock(&m.shared.jobs).push(popped.clone());
        m.shutdown();
        assert_eq!(popped.state(), JobState::Cancelled);
    }

    /// After shutdown no worker is left: a submit must be refused, not
    /// queued forever (it was: "job 1 queued", and it never ran).
    #[test]
    fn submit_after_shutdown_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let m = JobManager::new(
            dir.path().to_path_buf(),
            JobSource::of_mount(&Arc::from(crate::backend::open(&demo(), None).unwrap())),
            1,
            2,
        );
        m.shutdown();
        let e = m.submit("encode knot out=late.knot").unwrap_err();
        assert!(e.contains("stopping"), "{e}");
        assert!(m.jobs().is_empty());
        assert!(!dir.path().join("late.knot").exists());
    }

    #[test]
    fn jobs_run_queue_refuse_overwrite_and_cancel() {
        let dir = tempfile::tempdir().unwrap();
        let m = JobManager::new(
            dir.path().to_path_buf(),
            JobSource::of_mount(&Arc::from(crate::backend::open(&demo(), None).unwrap())),
            1,
            2,
        );
        assert_eq!(
            m.submit("encode sk32 rank=4 out=a.sk32").unwrap(),
            "job 1 queued"
        );
        assert_eq!(m.submit("encode knot out=b.knot").unwrap(), "job 2 queued");
        let a = wait_finished(&m, 1);
        assert_eq!(a.state(), JobState::Done, "{:?}", a.error());
        assert!(dir.path().join("a.sk32").exists());
        assert_eq!(wait_finished(&m, 2).state(), JobState::Done);
        let e = m.submit("encode sk32 rank=4 out=a.sk32").unwrap_err();
        assert!(e.contains("exists"), "{e}");
        assert!(
            m.submit("encode sk32 rank=4 out=a.sk32 overwrite=1")
                .is_ok()
        );
        wait_finished(&m, 3);
        // Cancel a queued job behind a running one.
        m.submit("encode rknot profile=faithful out=c.rknot")
            .unwrap();
        m.submit("encode sk32 rank=4 out=d.sk32").unwrap();
        m.submit("cancel 5").unwrap();
        m.submit("cancel 4").unwrap();
        assert_eq!(wait_finished(&m, 5).state(), JobState::Cancelled);
        assert_eq!(wait_finished(&m, 4).state(), JobState::Cancelled);
        assert!(!dir.path().join("c.rknot").exists() && !dir.path().join("d.sk32").exists());
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert!(
            names.iter().all(|n| !n.starts_with('.')),
            "temp files left: {names:?}"
        );
        let text = m.to_text();
        assert!(
            text.contains("done") && text.contains("cancelled"),
            "{text}"
        );
        let v = m.to_json();
        assert_eq!(v.as_array().unwrap().len(), 5);
        assert_eq!(v[0]["tensors_done"], v[0]["tensors_total"]);
        assert!(m.submit("cancel 1").unwrap_err().contains("already done"));
    }
}
