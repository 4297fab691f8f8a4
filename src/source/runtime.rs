//! The remote-I/O runtime: one small multi-thread tokio runtime for the
//! process, created on first use and driven by `block_on` from the
//! synchronous readers. [`stop_runtime`] shuts it down before the mount
//! daemon forks; the next use creates a new one (a new generation), and
//! each source rebuilds its client for it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::lock;

struct Rt {
    runtime: Option<Arc<tokio::runtime::Runtime>>,
    generation: u64,
}

static RUNTIME: Mutex<Rt> = Mutex::new(Rt {
    runtime: None,
    generation: 0,
});

/// The process's remote-I/O runtime and its generation (which changes each
/// time one is created).
pub(super) fn runtime() -> std::result::Result<(Arc<tokio::runtime::Runtime>, u64), String> {
    let mut rt = lock(&RUNTIME);
    if let Some(r) = &rt.runtime {
        return Ok((r.clone(), rt.generation));
    }
    let r = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rknot-remote")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the remote I/O runtime: {e}"))?;
    let r = Arc::new(r);
    rt.generation += 1;
    rt.runtime = Some(r.clone());
    Ok((r, rt.generation))
}

/// Shut the remote-I/O runtime down (its threads joined), e.g. before a
/// `fork`: a forked child has none of its threads. Remote sources opened
/// before keep working: the next request starts a new runtime and a new
/// client. Returns whether a runtime was running.
pub fn stop_runtime() -> bool {
    let taken = lock(&RUNTIME).runtime.take();
    match taken {
        Some(r) => {
            match Arc::try_unwrap(r) {
                Ok(r) => r.shutdown_timeout(Duration::from_secs(2)),
                Err(r) => drop(r),
            }
            true
        }
        None => false,
    }
}
