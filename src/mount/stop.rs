//! Stopping the daemon: what SIGTERM, SIGINT and SIGHUP do.
//!
//! - First signal: cancel the encoding jobs (each removes its temporary
//!   file at its next tensor), tell systemd `STOPPING=1`, and unmount; a
//!   mount still in use (a reader holds a file open, a process has its
//!   working directory there) is detached lazily, so it vanishes from the
//!   namespace at once while open files keep working.
//! - The daemon exits 0 as soon as the FUSE session ends (the last open file
//!   was closed) and the cancelled jobs have cleaned up: a clean stop.
//! - A second signal, or the end of the grace period (`--stop-timeout`,
//!   default [`DEFAULT_STOP_TIMEOUT`] s) with the session still running,
//!   forces the stop: the FUSE connection is aborted (as root through
//!   /sys/fs/fuse/connections/N/abort when fusectl is mounted; in any case
//!   by the daemon's exit, which closes /dev/fuse), so open files fail with
//!   ENOTCONN from then on, and the daemon exits 0. After the grace period
//!   it first waits for the cancelled jobs to remove their temporary files;
//!   after a second signal it does not wait (a temporary file may be left,
//!   as after SIGKILL; never a partial output at the target name).
//!
//! Without this, a reader holding a file open kept the lazily detached
//! mount, its daemon and its running jobs alive, invisible, until the
//! reader closed it; further signals were ignored.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fuser::SessionUnmounter;

use crate::jobs::JobManager;

use super::checks;

/// Seconds from the first stop signal until the connection is aborted
/// (`--stop-timeout`). Long enough for a reader to notice the unmount and
/// finish its current read or close its files; short enough to stay well
/// inside systemd's stop timeout (TimeoutStopSec=30 in the shipped unit).
pub const DEFAULT_STOP_TIMEOUT: u64 = 10;

/// What a stop needs to know about the mount.
pub struct StopPlan {
    pub mountpoint: PathBuf,
    pub grace: Duration,
    pub jobs: Option<Arc<JobManager>>,
    /// The FUSE connection's number under /sys/fs/fuse/connections.
    pub connection: Option<u64>,
}

/// How the stop went, shared with the main thread for its last log line.
#[derive(Default)]
pub struct StopState {
    signal: AtomicI32,
    forced: AtomicBool,
    /// Set when the FUSE session loop has returned. From then on the
    /// connection number may be freed with /dev/fuse and reused by another
    /// mount, so it must not be aborted; the lock also covers the abort
    /// itself, so the two never overlap.
    session_over: Mutex<bool>,
}

impl StopState {
    /// The stop signal received, if any.
    pub fn signal(&self) -> Option<i32> {
        Some(self.signal.load(Ordering::SeqCst)).filter(|&s| s != 0)
    }

    pub fn forced(&self) -> bool {
        self.forced.load(Ordering::SeqCst)
    }

    /// The session loop has returned: call before the session (and its
    /// /dev/fuse descriptor) is dropped. Waits for an abort in progress.
    pub fn end_session(&self) {
        *self.session_over.lock().unwrap_or_else(|p| p.into_inner()) = true;
    }
}

pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGHUP => "SIGHUP".into(),
        n => format!("signal {n}"),
    }
}

/// The stop signals, to be blocked in every thread (the signal thread takes
/// them with sigwait).
pub fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialize the set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}

/// Wait for one of `set` (blocked in this thread), at most `timeout`; None
/// when the time is up (or, without a timeout, when sigwait failed: logged).
fn wait_signal(set: &libc::sigset_t, timeout: Option<Duration>) -> Option<i32> {
    // A timeout too long for an Instant (--stop-timeout 18446744073709551615)
    // is no timeout.
    let Some(deadline) = timeout.and_then(|t| Instant::now().checked_add(t)) else {
        let mut sig = 0i32;
        // SAFETY: set is initialized; sig is ours.
        let rc = unsafe { libc::sigwait(set, &mut sig) };
        if rc != 0 {
            // sigwait returns its error number; errno is not set.
            log::error!("sigwait failed: {}", std::io::Error::from_raw_os_error(rc));
            return None;
        }
        return Some(sig);
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(left.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: left.subsec_nanos().into(),
        };
        // SAFETY: set and ts are initialized; a null siginfo is allowed.
        let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
        if sig > 0 {
            return Some(sig);
        }
        // EAGAIN: timed out; EINTR: interrupted by another signal's handler.
        if left.is_zero() || std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN) {
            return None;
        }
    }
}

/// Start the signal thread. Every thread must have `set` blocked.
pub fn spawn(
    set: libc::sigset_t,
    unmounter: SessionUnmounter,
    plan: StopPlan,
    state: Arc<StopState>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("rknot-signals".into())
        .spawn(move || stop_on_signal(&set, unmounter, &plan, &state))
}

fn stop_on_signal(
    set: &libc::sigset_t,
    mut unmounter: SessionUnmounter,
    plan: &StopPlan,
    state: &StopState,
) {
    let Some(sig) = wait_signal(set, None) else {
        return;
    };
    state.signal.store(sig, Ordering::SeqCst);
    let mp = plan.mountpoint.display();
    let grace = plan.grace.as_secs();
    log::info!(
        "{}: stopping: cancelling encoding jobs and unmounting {mp} (open files are cut off \
         after {grace} s or at a second signal)",
        signal_name(sig)
    );
    // Let systemd wait for the grace period plus the jobs' cleanup even if
    // TimeoutStopSec is shorter than what -o stop_timeout asked for.
    let extend_us = plan
        .grace
        .saturating_add(Duration::from_secs(10))
        .as_micros();
    super::sd_notify(&format!(
        "STOPPING=1\nSTATUS=stopping ({})\nEXTEND_TIMEOUT_USEC={extend_us}",
        signal_name(sig)
    ));
    let jobs_done = cancel_jobs(plan.jobs.clone());
    match unmounter.unmount() {
        // Root's umount(2) fails when busy (below); fuser unmounts for
        // other users with fusermount3 -uz, which detaches even then.
        Ok(()) if checks::geteuid() == 0 => log::info!("unmounted {mp}"),
        Ok(()) => log::info!("unmounted {mp} (lazily, if it was busy)"),
        Err(e) => {
            super::lazy_unmount(&plan.mountpoint);
            log::info!("{mp} was busy ({e}): detaching lazily; open files keep working");
        }
    }
    // The main thread exits the process when the session ends; this thread
    // only acts if that does not happen in time.
    let second = wait_signal(set, Some(plan.grace));
    state.forced.store(true, Ordering::SeqCst);
    let reason = match second {
        Some(s) => format!("second signal ({})", signal_name(s)),
        None => format!("grace period of {grace} s is over"),
    };
    log::warn!("{reason} and the session has not ended: aborting the FUSE connection of {mp}");
    let how = abort_connection(plan.connection, state);
    log::warn!("{how}");
    if second.is_none() {
        wait_for_jobs(set, &jobs_done);
    }
    if checks::is_mountpoint(&plan.mountpoint).unwrap_or(false) {
        log::error!(
            "{mp} is still mounted and becomes a dead mount; clear it with: fusermount3 -uz {mp}"
        );
    }
    crate::logging::flush_throttled();
    log::info!(
        "stopped by {} ({reason}): connection aborted; exiting",
        signal_name(sig)
    );
    // _exit: the other threads may be blocked anywhere (FUSE workers, job
    // cleanup, the main thread's teardown); the log lines are written
    // unbuffered, and nothing else needs flushing.
    // SAFETY: _exit ends the process; no Rust state needs to survive.
    unsafe { libc::_exit(0) };
}

/// Cancel every job on a helper thread (`shutdown` also waits for the
/// running ones to remove their temporary files); the receiver gets one
/// message when they have.
fn cancel_jobs(jobs: Option<Arc<JobManager>>) -> Receiver<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let Some(jobs) = jobs else {
        let _ = tx.send(());
        return rx;
    };
    let spawned = std::thread::Builder::new()
        .name("rknot-stop-jobs".into())
        .spawn(move || {
            jobs.shutdown();
            let _ = tx.send(());
        });
    if let Err(e) = spawned {
        log::error!("cannot start the thread cancelling jobs: {e}");
    }
    rx
}

/// After the grace period: the jobs were cancelled when it began; wait
/// until they have removed their temporary files, unless another signal
/// says not to wait.
fn wait_for_jobs(set: &libc::sigset_t, done: &Receiver<()>) {
    let mut logged = false;
    loop {
        match done.try_recv() {
            Ok(()) | Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {}
        }
        if !logged {
            log::info!("waiting for cancelled encoding jobs to remove their temporary files");
            logged = true;
        }
        if let Some(s) = wait_signal(set, Some(Duration::from_millis(100))) {
            log::warn!(
                "{}: not waiting for the encoding jobs; a hidden temporary file may be left",
                signal_name(s)
            );
            return;
        }
    }
}

/// Abort the FUSE connection: every pending and future request on it fails
/// (ENOTCONN), which releases readers blocked on the mount and ends the
/// session. Returns what was done, for the log.
fn abort_connection(connection: Option<u64>, state: &StopState) -> String {
    const EXIT: &str = "the connection is aborted when the daemon exits and closes /dev/fuse";
    // Held until the write is done: the main thread cannot drop the session
    // (freeing the connection number) in between.
    let session_over = state.session_over.lock().unwrap_or_else(|p| p.into_inner());
    if *session_over {
        return "the session has ended; nothing to abort".into();
    }
    let Some(n) = connection else {
        return format!("FUSE connection unknown; {EXIT}");
    };
    let path = Path::new("/sys/fs/fuse/connections")
        .join(n.to_string())
        .join("abort");
    if checks::geteuid() != 0 {
        return format!("not root, {} is not writable; {EXIT}", path.display());
    }
    if !path.exists() {
        return format!(
            "{} does not exist (fusectl not mounted); {EXIT}",
            path.display()
        );
    }
    match std::fs::write(&path, b"1") {
        Ok(()) => format!("aborted the FUSE connection through {}", path.display()),
        Err(e) => format!("cannot write {}: {e}; {EXIT}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Once the session loop has returned, the connection number may belong
    /// to another mount: no abort is written, whatever the number.
    #[test]
    fn no_abort_after_the_session_ended() {
        let state = StopState::default();
        state.end_session();
        let how = abort_connection(Some(u64::MAX), &state);
        assert_eq!(how, "the session has ended; nothing to abort");
    }

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(libc::SIGHUP), "SIGHUP");
        assert_eq!(signal_name(99), "signal 99");
    }
}
