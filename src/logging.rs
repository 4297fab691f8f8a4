//! Logging for both binaries: one line per record, file- and user-derived
//! text escaped, and repeated events summarised instead of flooding.
//!
//! - [`init`] installs env_logger (RUST_LOG, default level given by the
//!   binary) with a format that escapes control characters in every
//!   message ([`crate::text::escape`]): a tensor name or a `ctl` command can
//!   never forge a log line or drive a terminal that tails the log.
//! - [`throttled!`] logs an event at most once per [`THROTTLE_WINDOW`] per
//!   key and counts the rest; the count is reported with the next line of
//!   that key ("... (and N more like it in the last 10 s)") or by
//!   [`flush_throttled`] (unmount). A reader retrying a bad block a million
//!   times, or a source that changed under the mount, costs a few lines.
//!   Its lines carry the caller's module as their target, as `log`'s own
//!   macros do (so `RUST_LOG=rknot::fs=debug` and the log's `[... target]`
//!   column name where the event happened).

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::text::Escaped;

/// At most one line per key per window.
pub const THROTTLE_WINDOW: Duration = Duration::from_secs(10);

/// Keys tracked at once; events of further keys share one overflow key, so
/// the table cannot grow with hostile input.
const MAX_KEYS: usize = 1024;

/// Install the logger. `default_level` applies when RUST_LOG is unset;
/// `target` is the log file (background daemon), else stderr. A second
/// call (tests) keeps the first logger.
pub fn init(default_level: &str, target: Option<std::fs::File>) {
    let mut b =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default_level));
    b.format(|buf, record| {
        let ts = buf.timestamp_millis();
        writeln!(
            buf,
            "[{ts} {:<5} {}] {}",
            record.level(),
            record.target(),
            Escaped(&record.args().to_string())
        )
    });
    // The HTTP client's own debug lines print request URLs whole, and a
    // presigned URL's query string is a credential: those crates stay at
    // warn whatever RUST_LOG says (set after the environment's filters, so
    // these win). rknot's own lines name URLs redacted.
    for module in ["reqwest", "hyper", "hyper_util", "h2"] {
        b.filter_module(module, log::LevelFilter::Warn);
    }
    if let Some(f) = target {
        b.target(env_logger::Target::Pipe(Box::new(f)));
    }
    let _ = b.try_init();
}

struct KeyState {
    window_start: Instant,
    suppressed: u64,
}

/// Per-key rate limiter for log lines (module docs).
pub struct Throttle {
    window: Duration,
    keys: Mutex<HashMap<String, KeyState>>,
}

/// What the caller should do with one event.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` similar events were dropped since the last line.
    Log { suppressed: u64 },
    /// Drop it (counted).
    Suppress,
}

impl Throttle {
    pub fn new(window: Duration) -> Throttle {
        Throttle {
            window,
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// Record one event of `key` at `now`.
    pub fn check_at(&self, key: &str, now: Instant) -> Verdict {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let key = if keys.len() >= MAX_KEYS && !keys.contains_key(key) {
            "(other)"
        } else {
            key
        };
        match keys.get_mut(key) {
            Some(s) if now.duration_since(s.window_start) < self.window => {
                s.suppressed += 1;
                Verdict::Suppress
            }
            Some(s) => {
                let suppressed = std::mem::take(&mut s.suppressed);
                s.window_start = now;
                Verdict::Log { suppressed }
            }
            None => {
                keys.insert(
                    key.to_string(),
                    KeyState {
                        window_start: now,
                        suppressed: 0,
                    },
                );
                Verdict::Log { suppressed: 0 }
            }
        }
    }

    /// Counts of events dropped since each key's last line, which are reset.
    pub fn take_suppressed(&self) -> Vec<(String, u64)> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, u64)> = keys
            .iter_mut()
            .filter(|(_, s)| s.suppressed > 0)
            .map(|(k, s)| (k.clone(), std::mem::take(&mut s.suppressed)))
            .collect();
        out.sort();
        out
    }
}

fn global() -> &'static Throttle {
    static T: OnceLock<Throttle> = OnceLock::new();
    T.get_or_init(|| Throttle::new(THROTTLE_WINDOW))
}

/// Log `msg` at `level` with target `target` unless an event of `key` was
/// logged less than [`THROTTLE_WINDOW`] ago (then it is only counted).
/// Called through [`throttled!`], which passes the caller's module.
pub fn throttled_at(target: &str, level: log::Level, key: &str, msg: impl std::fmt::Display) {
    if !log::log_enabled!(target: target, level) {
        return;
    }
    match global().check_at(key, Instant::now()) {
        Verdict::Suppress => {}
        Verdict::Log { suppressed: 0 } => log::log!(target: target, level, "{msg}"),
        Verdict::Log { suppressed } => log::log!(
            target: target,
            level,
            "{msg} (and {suppressed} more like it in the last {} s)",
            THROTTLE_WINDOW.as_secs()
        ),
    }
}

/// `throttled!(level, key, "format", args...)`: log like `log::log!` (the
/// caller's module is the target) unless an event of `key` was logged less
/// than [`THROTTLE_WINDOW`] ago (then it is only counted).
macro_rules! throttled {
    ($level:expr, $key:expr, $($arg:tt)+) => {
        $crate::logging::throttled_at(module_path!(), $level, $key, format_args!($($arg)+))
    };
}
pub(crate) use throttled;

/// Report every count still pending (at unmount), one line per key. At
/// info: the first event of each key was logged at its own level.
pub fn flush_throttled() {
    for (key, n) in global().take_suppressed() {
        log::info!("{n} more log line(s) about {key} were suppressed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_key_per_window_with_counts() {
        let t = Throttle::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(t.check_at("a", t0), Verdict::Log { suppressed: 0 });
        for i in 1..=1000u64 {
            let v = t.check_at("a", t0 + Duration::from_millis(i));
            assert_eq!(v, Verdict::Suppress);
        }
        // Another key is independent.
        assert_eq!(t.check_at("b", t0), Verdict::Log { suppressed: 0 });
        // After the window the next event is logged with the count.
        assert_eq!(
            t.check_at("a", t0 + Duration::from_secs(11)),
            Verdict::Log { suppressed: 1000 }
        );
        t.check_at("b", t0 + Duration::from_secs(1));
        assert_eq!(t.take_suppressed(), vec![("b".to_string(), 1)]);
        assert!(t.take_suppressed().is_empty());
    }

    #[test]
    fn key_table_is_bounded() {
        let t = Throttle::new(Duration::from_secs(10));
        let now = Instant::now();
        for i in 0..5000 {
            t.check_at(&format!("k{i}"), now);
        }
        assert!(t.keys.lock().unwrap().len() <= MAX_KEYS + 1);
    }
}
