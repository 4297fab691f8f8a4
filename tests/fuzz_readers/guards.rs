//! The fuzzer's guards: an allocator that aborts on any single allocation
//! over 1 GiB and a watchdog that aborts a case running over 20 s, each
//! saving the input and printing target, seed and iteration first.

use super::*;

// ------------------------------------------------------- allocation guard

/// Largest single allocation a reader may make.
pub(crate) const MAX_ALLOC: usize = 1 << 30;

pub(crate) struct GuardedAlloc;

// SAFETY: every call is forwarded unchanged to the system allocator; the
// guard only inspects the requested size.
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        guard(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        guard(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        guard(new_size);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
pub(crate) static GLOBAL: GuardedAlloc = GuardedAlloc;

#[inline]
pub(crate) fn guard(size: usize) {
    if size > MAX_ALLOC {
        oversized(size);
    }
}

#[cold]
pub(crate) fn oversized(size: usize) -> ! {
    // Format into a stack buffer: no allocation before the message is out.
    let mut buf = [0u8; 512];
    let mut w = &mut buf[..];
    let _ = write!(
        w,
        "\nfuzz_readers: ABORT: one allocation of {size} bytes (> 1 GiB): a size from \
         the file reached the allocator without a check against the file size\n"
    );
    let used = 512 - w.len();
    let _ = std::io::stderr().write_all(&buf[..used]);
    CURRENT.with(|c| {
        if let Some(slot) = c.get() {
            slot.report_abort("alloc");
        }
    });
    std::process::abort();
}

// ------------------------------------------------------- case bookkeeping

/// What the guards need to know about the case running on a fuzz thread.
pub(crate) struct Slot {
    pub(crate) target: &'static str,
    pub(crate) seed: u64,
    pub(crate) iteration: AtomicU64,
    /// Milliseconds since the epoch when the current case started; 0 = idle.
    pub(crate) busy_since_ms: AtomicU64,
    pub(crate) done: AtomicBool,
    /// Where the current case's input files are.
    pub(crate) inputs: Vec<PathBuf>,
    pub(crate) failures: PathBuf,
}

thread_local! {
    pub(crate) static CURRENT: Cell<Option<&'static Slot>> = const { Cell::new(None) };
}

/// A case running longer than this is a hang.
pub(crate) const HANG_MS: u64 = 20_000;

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
}

impl Slot {
    /// Save the current input and say which case it was (before an abort).
    pub(crate) fn report_abort(&self, why: &str) {
        let it = self.iteration.load(Ordering::SeqCst);
        let saved = save_inputs(
            &self.failures,
            self.target,
            self.seed,
            it,
            why,
            &self.inputs,
        );
        eprintln!(
            "fuzz_readers: target {} seed {} iteration {it}: {why}; input saved as {saved:?} \
             (replay: RKNOT_FUZZ_REPRO=<file>[,<dense>] cargo test --profile ci --test \
             fuzz_readers fuzz_repro -- --nocapture)",
            self.target, self.seed
        );
    }
}

pub(crate) fn save_inputs(
    dir: &Path,
    target: &str,
    seed: u64,
    it: u64,
    why: &str,
    inputs: &[PathBuf],
) -> Vec<PathBuf> {
    let _ = std::fs::create_dir_all(dir);
    inputs
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let ext = p.extension()?.to_string_lossy().into_owned();
            let to = dir.join(format!("{target}-seed{seed}-iter{it}-{why}-{i}.{ext}"));
            std::fs::copy(p, &to).ok().map(|_| to)
        })
        .collect()
}

pub(crate) fn spawn_watchdog(slot: &'static Slot) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !slot.done.load(Ordering::SeqCst) {
            let since = slot.busy_since_ms.load(Ordering::SeqCst);
            if since != 0 && now_ms().saturating_sub(since) > HANG_MS {
                eprintln!(
                    "\nfuzz_readers: ABORT: target {} iteration {} has run for more than \
                     {} s: a hang",
                    slot.target,
                    slot.iteration.load(Ordering::SeqCst),
                    HANG_MS / 1000
                );
                slot.report_abort("hang");
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Register this thread's case bookkeeping with the allocation guard and
/// start its watchdog.
pub(crate) fn install_guards(
    target: &'static str,
    seed: u64,
    inputs: Vec<PathBuf>,
) -> (&'static Slot, std::thread::JoinHandle<()>) {
    let slot: &'static Slot = Box::leak(Box::new(Slot {
        target,
        seed,
        iteration: AtomicU64::new(0),
        busy_since_ms: AtomicU64::new(0),
        done: AtomicBool::new(false),
        inputs,
        failures: failures_dir(),
    }));
    CURRENT.with(|c| c.set(Some(slot)));
    (slot, spawn_watchdog(slot))
}

pub(crate) fn failures_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("fuzz-failures")
}
