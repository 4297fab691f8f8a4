//! Progress of long work, on stderr, the same for every command (`encode`,
//! `verify`, `verify --integrity`, `verify --manifest`, `manifest`,
//! `bench mount`, `bench checksums`).
//!
//! - stderr is a terminal: an indicatif bar with position/total, rate and
//!   ETA (cleared when the work ends, so only the command's own lines stay);
//! - otherwise plain lines, at a bounded rate: one when at least
//!   [`LINE_INTERVAL`] passed since the last, or when the work crossed a
//!   further [`LINE_STEP`] of its total at least [`MIN_GAP`] after the last
//!   (so a short run prints nothing but its final line), and a final line
//!   with the elapsed time from [`Meter::finish`]. At most 10 + elapsed/10 s
//!   lines plus the final one. The lines parse with one pattern:
//!
//!   ```text
//!   rknot: encode: 45% (123/272 tensors), 12.3 s elapsed, ETA 15.0 s
//!   rknot: manifest: 60% (600000000/1000000000 bytes), 2.0 s elapsed, 300.0 MB/s, ETA 1.3 s
//!   rknot: verify: 30%, 4.1 s elapsed, ETA 9.6 s
//!   rknot: encode: 100% (272/272 tensors), 27.3 s elapsed, done
//!   ```
//!
//! - [`Mode::Hidden`] (`rknot --no-progress`, library callers): nothing.
//!
//! Progress never goes to stdout, which carries reports and JSON.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Plain lines: at most one per this interval, unless a step is crossed.
pub const LINE_INTERVAL: Duration = Duration::from_secs(10);
/// Plain lines: one each time the work crosses a further tenth...
pub const LINE_STEP: u64 = 10;
/// ...but never closer than this to the previous line.
pub const MIN_GAP: Duration = Duration::from_secs(2);

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// A bar when stderr is a terminal, plain lines otherwise.
    #[default]
    Auto,
    /// Plain lines even on a terminal.
    Plain,
    /// Nothing.
    Hidden,
}

impl Mode {
    /// What a command line asked for: `Auto`, or `Hidden` with
    /// `--no-progress`.
    pub fn cli(shown: bool) -> Mode {
        if shown { Mode::Auto } else { Mode::Hidden }
    }
}

/// What the position and total count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Things, named by the noun (`tensors`, `steps`, `rounds`).
    Items(&'static str),
    /// Bytes (shown with a rate).
    Bytes,
    /// Weighted work of several kinds: only the percentage means anything.
    Work,
}

/// When a plain line is due (pure: the caller gives the time).
#[derive(Debug, Default)]
pub struct Limiter {
    last: Duration,
    last_step: u64,
}

impl Limiter {
    pub fn new() -> Limiter {
        Limiter::default()
    }

    /// `now` is the time since the work started; `done` of `total`. Never
    /// due once the work is complete (the final line says it).
    pub fn due(&mut self, now: Duration, done: u64, total: u64) -> bool {
        if total == 0 || done >= total {
            return false;
        }
        let step = (u128::from(done) * u128::from(LINE_STEP) / u128::from(total)) as u64;
        let gap = now.saturating_sub(self.last);
        let due = gap >= LINE_INTERVAL || (step > self.last_step && gap >= MIN_GAP);
        if due {
            self.last = now;
            self.last_step = step;
        }
        due
    }
}

type Clock = Box<dyn Fn() -> Duration + Send>;

struct Lines {
    sink: Box<dyn Write + Send>,
    clock: Clock,
    limiter: Limiter,
}

enum Output {
    Bar(indicatif::ProgressBar),
    Lines(Mutex<Lines>),
}

struct Inner {
    label: String,
    unit: Unit,
    done: AtomicU64,
    total: AtomicU64,
    out: Output,
}

/// Progress of one piece of work. Shared by reference between threads
/// (`inc` from rayon workers is fine).
#[derive(Default)]
pub struct Meter {
    inner: Option<Inner>,
}

impl Meter {
    /// Progress of the work `label` (shown as `rknot: LABEL: ...`), counted
    /// in `unit`, shown as `mode` says. The total may be set later.
    pub fn new(label: &str, unit: Unit, mode: Mode) -> Meter {
        match mode {
            Mode::Hidden => Meter::hidden(),
            Mode::Auto if std::io::stderr().is_terminal() => Meter::bar(label, unit),
            Mode::Auto | Mode::Plain => {
                let t0 = Instant::now();
                Meter::lines_to(
                    label,
                    unit,
                    Box::new(std::io::stderr()),
                    Box::new(move || t0.elapsed()),
                )
            }
        }
    }

    /// No output.
    pub fn hidden() -> Meter {
        Meter { inner: None }
    }

    /// Plain lines into `sink`, with time from `clock` (time since the
    /// start): for tests.
    pub fn lines_to(
        label: &str,
        unit: Unit,
        sink: Box<dyn Write + Send>,
        clock: Box<dyn Fn() -> Duration + Send>,
    ) -> Meter {
        Meter::with(
            label,
            unit,
            Output::Lines(Mutex::new(Lines {
                sink,
                clock,
                limiter: Limiter::new(),
            })),
        )
    }

    fn bar(label: &str, unit: Unit) -> Meter {
        let bar = indicatif::ProgressBar::new(0);
        let counts = match unit {
            Unit::Items(noun) => format!("{{pos}}/{{len}} {noun} ({{rate}}/s)"),
            Unit::Bytes => {
                "{binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec})".to_string()
            }
            Unit::Work => "{percent}%".to_string(),
        };
        let template = format!(
            "rknot: {{prefix}}: [{{elapsed_precise}}] {{bar:30}} {counts}, ETA {{eta}} {{msg}}"
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(&template) {
            bar.set_style(style.with_key(
                "rate",
                |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(w, "{:.1}", s.per_sec());
                },
            ));
        }
        bar.set_prefix(label.to_string());
        Meter::with(label, unit, Output::Bar(bar))
    }

    fn with(label: &str, unit: Unit, out: Output) -> Meter {
        Meter {
            inner: Some(Inner {
                label: label.to_string(),
                unit,
                done: AtomicU64::new(0),
                total: AtomicU64::new(0),
                out,
            }),
        }
    }

    /// Whether anything is shown (callers may skip preparing totals).
    pub fn is_shown(&self) -> bool {
        self.inner.is_some()
    }

    pub fn set_total(&self, total: u64) {
        if let Some(i) = &self.inner {
            i.total.store(total, Ordering::Relaxed);
            if let Output::Bar(b) = &i.out {
                b.set_length(total);
            }
        }
    }

    pub fn add_total(&self, more: u64) {
        if let Some(i) = &self.inner {
            let t = i
                .total
                .fetch_add(more, Ordering::Relaxed)
                .saturating_add(more);
            if let Output::Bar(b) = &i.out {
                b.set_length(t);
            }
        }
    }

    /// `n` more done.
    pub fn inc(&self, n: u64) {
        if let Some(i) = &self.inner {
            let done = i.done.fetch_add(n, Ordering::Relaxed).saturating_add(n);
            i.moved(done);
        }
    }

    /// Done so far, absolute (never moves backwards).
    pub fn set_position(&self, done: u64) {
        if let Some(i) = &self.inner {
            let done = i.done.fetch_max(done, Ordering::Relaxed).max(done);
            i.moved(done);
        }
    }

    /// What is being worked on (the bar shows it; escaped).
    pub fn set_message(&self, msg: &str) {
        if let Some(Inner {
            out: Output::Bar(b),
            ..
        }) = &self.inner
        {
            b.set_message(crate::text::escape(msg).into_owned());
        }
    }

    /// The work is complete: the bar is cleared; plain lines end with the
    /// final line (100%, elapsed time, `done`).
    pub fn finish(&self) {
        let Some(i) = &self.inner else {
            return;
        };
        let total = i.total.load(Ordering::Relaxed);
        let done = i.done.fetch_max(total, Ordering::Relaxed).max(total);
        match &i.out {
            Output::Bar(b) => b.finish_and_clear(),
            Output::Lines(l) => {
                let mut l = l.lock().unwrap_or_else(|e| e.into_inner());
                let now = (l.clock)();
                let line = i.line(done, done.max(total), now, true);
                let _ = writeln!(l.sink, "{line}");
                let _ = l.sink.flush();
            }
        }
    }
}

impl Inner {
    fn moved(&self, done: u64) {
        match &self.out {
            Output::Bar(b) => b.set_position(done),
            Output::Lines(l) => {
                let total = self.total.load(Ordering::Relaxed);
                let mut l = l.lock().unwrap_or_else(|e| e.into_inner());
                let now = (l.clock)();
                if l.limiter.due(now, done, total) {
                    let line = self.line(done, total, now, false);
                    let _ = writeln!(l.sink, "{line}");
                    let _ = l.sink.flush();
                }
            }
        }
    }

    fn line(&self, done: u64, total: u64, now: Duration, finished: bool) -> String {
        let secs = now.as_secs_f64();
        let pct = if finished {
            100
        } else {
            (u128::from(done) * 100 / u128::from(total.max(1))) as u64
        };
        let counts = match self.unit {
            Unit::Items(noun) => format!(" ({done}/{total} {noun})"),
            Unit::Bytes => format!(" ({done}/{total} bytes)"),
            Unit::Work => String::new(),
        };
        let rate = match self.unit {
            // (No rate for nothing done: a file without checksums to scan.)
            Unit::Bytes if done > 0 => {
                format!(", {:.1} MB/s", done as f64 / secs.max(1e-9) / 1e6)
            }
            _ => String::new(),
        };
        let end = if finished {
            "done".to_string()
        } else if done == 0 {
            "ETA unknown".to_string()
        } else {
            let eta = secs / done as f64 * total.saturating_sub(done) as f64;
            format!("ETA {eta:.1} s")
        };
        format!(
            "rknot: {}: {pct}%{counts}, {secs:.1} s elapsed{rate}, {end}",
            self.label
        )
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        // Work that ended early (an error): no final line, no bar left.
        if let Some(Inner {
            out: Output::Bar(b),
            ..
        }) = &self.inner
            && !b.is_finished()
        {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A sink tests can read back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Shared {
        fn lines(&self) -> Vec<String> {
            String::from_utf8(self.0.lock().unwrap().clone())
                .unwrap()
                .lines()
                .map(str::to_string)
                .collect()
        }
    }

    /// A clock the test moves.
    fn clock() -> (Arc<AtomicU64>, Clock) {
        let ms = Arc::new(AtomicU64::new(0));
        let c = ms.clone();
        (
            ms,
            Box::new(move || Duration::from_millis(c.load(Ordering::Relaxed))),
        )
    }

    #[test]
    fn limiter_steps_and_interval() {
        let mut l = Limiter::new();
        let s = Duration::from_secs;
        // A new tenth, but too soon after the start.
        assert!(!l.due(s(1), 15, 100));
        // A new tenth, 2 s after the start.
        assert!(l.due(s(2), 15, 100));
        // Same tenth, before 10 s: not due.
        assert!(!l.due(s(5), 19, 100));
        // The next tenth crossed, 3 s later.
        assert!(l.due(s(5), 20, 100));
        // 10 s without a new tenth: due anyway.
        assert!(!l.due(s(14), 21, 100));
        assert!(l.due(s(15), 21, 100));
        // Several tenths at once: one line.
        assert!(l.due(s(17), 95, 100));
        assert!(!l.due(s(18), 99, 100));
        // Complete: the final line says it.
        assert!(!l.due(s(40), 100, 100));
        // No total: never.
        assert!(!Limiter::new().due(s(40), 5, 0));
    }

    #[test]
    fn lines_are_bounded_and_parse() {
        let sink = Shared::default();
        let (ms, clock) = clock();
        let m = Meter::lines_to(
            "encode",
            Unit::Items("tensors"),
            Box::new(sink.clone()),
            clock,
        );
        m.set_total(1000);
        // 1000 items over 100 s, one every 100 ms.
        for _ in 0..1000 {
            ms.fetch_add(100, Ordering::Relaxed);
            m.inc(1);
        }
        m.finish();
        let lines = sink.lines();
        // At most one per tenth (9 before the end) and one per 10 s,
        // plus the final one.
        assert!(lines.len() <= 9 + 10 + 1, "{lines:#?}");
        assert!(lines.len() >= 9, "{lines:#?}");
        for l in &lines[..lines.len() - 1] {
            let rest = l.strip_prefix("rknot: encode: ").unwrap();
            let (pct, rest) = rest.split_once("% (").unwrap();
            let pct: u64 = pct.parse().unwrap();
            let (counts, rest) = rest.split_once(" tensors), ").unwrap();
            let (done, total) = counts.split_once('/').unwrap();
            let (done, total): (u64, u64) = (done.parse().unwrap(), total.parse().unwrap());
            assert_eq!(total, 1000);
            assert_eq!(pct, done * 100 / total);
            let (secs, rest) = rest.split_once(" s elapsed, ETA ").unwrap();
            let secs: f64 = secs.parse().unwrap();
            assert!((secs - done as f64 / 10.0).abs() < 0.2, "{l}");
            let eta: f64 = rest.strip_suffix(" s").unwrap().parse().unwrap();
            assert!((eta - (total - done) as f64 / 10.0).abs() < 0.2, "{l}");
        }
        assert_eq!(
            lines.last().unwrap(),
            "rknot: encode: 100% (1000/1000 tensors), 100.0 s elapsed, done"
        );
    }

    #[test]
    fn a_short_run_prints_only_its_final_line() {
        let sink = Shared::default();
        let (ms, clock) = clock();
        let m = Meter::lines_to("verify", Unit::Work, Box::new(sink.clone()), clock);
        m.set_total(50);
        for _ in 0..50 {
            ms.fetch_add(10, Ordering::Relaxed);
            m.inc(1);
        }
        m.finish();
        assert_eq!(sink.lines(), ["rknot: verify: 100%, 0.5 s elapsed, done"]);
    }

    #[test]
    fn bytes_lines_carry_a_rate() {
        let sink = Shared::default();
        let (ms, clock) = clock();
        let m = Meter::lines_to("manifest", Unit::Bytes, Box::new(sink.clone()), clock);
        m.set_total(1_000_000_000);
        ms.store(2000, Ordering::Relaxed);
        m.set_position(600_000_000);
        // Never backwards.
        m.set_position(10);
        m.finish();
        assert_eq!(
            sink.lines(),
            [
                "rknot: manifest: 60% (600000000/1000000000 bytes), 2.0 s elapsed, \
                 300.0 MB/s, ETA 1.3 s",
                "rknot: manifest: 100% (1000000000/1000000000 bytes), 2.0 s elapsed, \
                 500.0 MB/s, done",
            ]
        );
    }

    #[test]
    fn hidden_does_nothing() {
        let m = Meter::new("x", Unit::Bytes, Mode::Hidden);
        assert!(!m.is_shown());
        m.set_total(5);
        m.inc(3);
        m.finish();
    }
}
