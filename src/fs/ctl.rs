//! The mount's control files: `ctl` (status text; commands are written to
//! it), `ctl.json` (the same status for tools) and `jobs/N` (one encoding
//! job).
//!
//! - Who may command: writes to `ctl` are authorised by the credentials of
//!   the FUSE request, not by the mode `stat` shows: only root and the
//!   daemon's own user may run commands. Jobs run with the daemon's rights
//!   and write next to the model, so letting the user named by `-o uid=`
//!   (or anyone else) start them would hand that user the daemon's rights.
//!   `ctl` is also owned by the daemon's user with mode 0600, so under
//!   `default_permissions` the kernel refuses other users before we see
//!   them; the check here holds even without it, and for a descriptor
//!   passed to another process.
//! - Reads: each open renders one snapshot of the file and serves every
//!   read of that handle from it (like /proc's seq_file), so a reader that
//!   needs several reads never gets halves of two renderings.
//! - Writes: bytes are buffered per handle; each complete line is a
//!   command. All complete lines of one `write()` are parsed before any
//!   runs: one malformed line fails the write (EINVAL) and runs nothing. A
//!   command refused when it runs (its output exists, ...) stops the rest of
//!   that write. A last line without a newline runs at close (flush), whose
//!   error `close()` returns. Invalid UTF-8 and lines longer than
//!   [`MAX_LINE`] bytes are refused (EINVAL). Every refusal is kept for
//!   `ctl`'s `last_error`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::{CTL_INO, CTL_JSON_INO, Caller, TensorFs};
use crate::backend::SourceSummary;
use crate::cache::lock;
use crate::text::Escaped;

/// Longest command line accepted (a real one is under 200 bytes).
pub const MAX_LINE: usize = 4096;

/// One open control file.
struct Handle {
    /// What reads of this handle return (rendered at open).
    snapshot: Option<Arc<Vec<u8>>>,
    /// Bytes written after the last newline.
    pending: Vec<u8>,
}

/// State of the control files.
pub(super) struct Ctl {
    /// The daemon's effective uid and gid: owner of the control files.
    pub(super) owner: (u32, u32),
    last_error: Mutex<Option<String>>,
    handles: Mutex<HashMap<u64, Handle>>,
}

/// A command line, checked.
enum Command {
    DropCache,
    /// Handed to the job manager (`encode ...`, `cancel N`).
    Job(String),
}

impl Ctl {
    pub(super) fn new() -> Ctl {
        Ctl {
            // SAFETY: geteuid/getegid have no preconditions.
            owner: unsafe { (libc::geteuid(), libc::getegid()) },
            last_error: Mutex::new(None),
            handles: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `caller` may run commands (module docs).
    pub(super) fn may_command(&self, caller: Caller) -> bool {
        caller.uid == 0 || caller.uid == self.owner.0
    }

    /// Who may command, in words.
    fn commanders(&self) -> String {
        match self.owner.0 {
            0 => "root".to_string(),
            uid => format!("root and uid {uid}"),
        }
    }

    pub(super) fn is_open(&self, fh: u64) -> bool {
        lock(&self.handles).contains_key(&fh)
    }

    /// A command refused (malformed, or refused when it runs): the writer
    /// gets EINVAL and `last_error`; the log has it at info, since it is the
    /// writer's mistake, not the daemon's.
    fn set_error(&self, msg: String) {
        log::info!("ctl: {msg}");
        *lock(&self.last_error) = Some(msg);
    }
}

impl TensorFs {
    /// Open a control file: render its snapshot when it is opened for
    /// reading; refuse writers who may not command.
    pub(super) fn open_ctl(
        &self,
        ino: u64,
        fh: u64,
        read: bool,
        write: bool,
        caller: Caller,
    ) -> std::result::Result<(), i32> {
        if write {
            if ino != CTL_INO {
                return Err(libc::EROFS);
            }
            if !self.ctl.may_command(caller) {
                self.refuse(caller);
                return Err(libc::EACCES);
            }
        }
        let snapshot = if read {
            Some(Arc::new(self.render_live(ino).ok_or(libc::ENOENT)?))
        } else {
            None
        };
        lock(&self.ctl.handles).insert(
            fh,
            Handle {
                snapshot,
                pending: Vec::new(),
            },
        );
        Ok(())
    }

    fn refuse(&self, caller: Caller) {
        crate::logging::throttled!(
            log::Level::Warn,
            &format!("ctl refused uid {}", caller.uid),
            "ctl: command from uid {} (pid {}) refused: only {} may command this mount",
            caller.uid,
            caller.pid,
            self.ctl.commanders(),
        );
    }

    /// The current text of a live file.
    fn render_live(&self, ino: u64) -> Option<Vec<u8>> {
        match ino {
            CTL_INO => Some(self.ctl_text().into_bytes()),
            CTL_JSON_INO => {
                let mut text = serde_json::to_string_pretty(&self.ctl_json()).unwrap_or_default();
                text.push('\n');
                Some(crate::text::escape_json_text(text).into_bytes())
            }
            _ => self.job_of(ino).map(|j| j.to_text().into_bytes()),
        }
    }

    /// A read of an open control file: from its snapshot.
    pub(super) fn read_ctl(
        &self,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> std::result::Result<Vec<u8>, i32> {
        let handles = lock(&self.ctl.handles);
        let snap = handles
            .get(&fh)
            .and_then(|h| h.snapshot.clone())
            .ok_or(libc::EBADF)?;
        drop(handles);
        let start = offset.min(snap.len() as u64) as usize;
        let end = offset
            .saturating_add(u64::from(size))
            .min(snap.len() as u64) as usize;
        Ok(snap[start..end].to_vec())
    }

    /// Bytes written to `ctl` through handle `fh` by `caller`. Returns the
    /// bytes consumed.
    pub fn write_ctl(
        &self,
        fh: u64,
        data: &[u8],
        caller: Caller,
    ) -> std::result::Result<usize, i32> {
        if !self.ctl.may_command(caller) {
            self.refuse(caller);
            return Err(libc::EACCES);
        }
        let lines = {
            let mut handles = lock(&self.ctl.handles);
            let h = handles.get_mut(&fh).ok_or(libc::EBADF)?;
            h.pending.extend_from_slice(data);
            let Some(last_nl) = h.pending.iter().rposition(|&b| b == b'\n') else {
                if h.pending.len() > MAX_LINE {
                    h.pending.clear();
                    drop(handles);
                    self.ctl.set_error(format!(
                        "a command line longer than {MAX_LINE} bytes was refused"
                    ));
                    return Err(libc::EINVAL);
                }
                return Ok(data.len());
            };
            let rest = h.pending.split_off(last_nl + 1);
            std::mem::replace(&mut h.pending, rest)
        };
        self.run_lines(&lines)?;
        Ok(data.len())
    }

    /// Close of a `ctl` handle (flush; also release): run a last line
    /// written without a newline. Its error reaches `close()`.
    pub(super) fn flush_ctl(
        &self,
        fh: u64,
        caller: Option<Caller>,
    ) -> std::result::Result<(), i32> {
        let pending = match lock(&self.ctl.handles).get_mut(&fh) {
            Some(h) => std::mem::take(&mut h.pending),
            None => return Ok(()),
        };
        if pending.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        if let Some(c) = caller
            && !self.ctl.may_command(c)
        {
            self.refuse(c);
            return Err(libc::EACCES);
        }
        self.run_lines(&pending)
    }

    pub(super) fn release_ctl(&self, fh: u64) {
        // A writer that never flushed (the kernel flushes on every close, so
        // this is belt and braces): its last line still runs.
        let _ = self.flush_ctl(fh, None);
        lock(&self.ctl.handles).remove(&fh);
    }

    /// Check every line of `bytes`, then run them in order (module docs).
    fn run_lines(&self, bytes: &[u8]) -> std::result::Result<(), i32> {
        let mut commands = Vec::new();
        for (n, raw) in bytes.split(|&b| b == b'\n').enumerate() {
            let line_no = n + 1;
            if raw.len() > MAX_LINE {
                self.ctl.set_error(format!(
                    "line {line_no}: longer than {MAX_LINE} bytes; nothing in this write was run"
                ));
                return Err(libc::EINVAL);
            }
            let Ok(text) = std::str::from_utf8(raw) else {
                self.ctl.set_error(format!(
                    "line {line_no}: not valid UTF-8; nothing in this write was run"
                ));
                return Err(libc::EINVAL);
            };
            let line = text.trim();
            if line.is_empty() {
                continue;
            }
            match self.parse_line(line) {
                Ok(c) => commands.push((line, c)),
                Err(why) => {
                    self.ctl.set_error(format!(
                        "line {line_no}: {line}: {why}; nothing in this write was run",
                        line = Escaped(line)
                    ));
                    return Err(libc::EINVAL);
                }
            }
        }
        let total = commands.len();
        for (i, (line, c)) in commands.into_iter().enumerate() {
            let result = match c {
                Command::DropCache => {
                    self.shared.cache.clear();
                    Ok("cache dropped".to_string())
                }
                Command::Job(l) => match &self.jobs {
                    Some(j) => j.submit(&l),
                    None => Err("encoding jobs are not enabled on this mount".to_string()),
                },
            };
            match result {
                Ok(msg) => log::info!("ctl: {}: {msg}", Escaped(line)),
                Err(why) => {
                    let skipped = total - i - 1;
                    self.ctl.set_error(format!(
                        "{}: {why}{}",
                        Escaped(line),
                        if skipped > 0 {
                            format!(" ({skipped} later command(s) of this write not run)")
                        } else {
                            String::new()
                        }
                    ));
                    return Err(libc::EINVAL);
                }
            }
        }
        Ok(())
    }

    fn parse_line(&self, line: &str) -> std::result::Result<Command, String> {
        if line == "drop-cache" {
            return Ok(Command::DropCache);
        }
        let word = line.split_whitespace().next().unwrap_or_default();
        if word == "encode" || word == "cancel" {
            if self.jobs.is_none() {
                return Err("encoding jobs are not enabled on this mount".to_string());
            }
            crate::jobs::parse_command(line)?;
            return Ok(Command::Job(line.to_string()));
        }
        Err(format!(
            "unknown command {:?} (commands: drop-cache, encode sk32|rknot|knot ... out=NAME, \
             cancel JOB)",
            line
        ))
    }

    /// The text served by `ctl`.
    pub fn ctl_text(&self) -> String {
        let s = self.shared.cache.stats();
        let b = self.shared.backend.as_ref();
        let src = |s: &SourceSummary| {
            format!(
                "{} ({} v{}, {})",
                Escaped(&s.path.display().to_string()),
                s.format,
                s.version,
                if s.checked {
                    "checksums verified on read"
                } else {
                    "unchecked"
                }
            )
        };
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
            "tensors:   {} tensors in {}: {} files ({} names)\n\
             mode:      {}\n\
             uptime_s:  {}\n\
             cache:     capacity {} B, used {} B in {} chunks of <= {} B, {} B of buffers pooled\n\
             cache:     hits {}, misses {} ({} waited for a decode in flight), evictions {}\n\
             cache:     bytes decoded {}, decode errors {}, decodes in flight {} ({} B), {} B held by replies\n\
             cache:     waits for budget {}, decodes over budget {}, read-ahead refused {}\n\
             reads:     in flight {}, total {}, errors {} ({} checksum), bytes served {}, small uncached {}\n\
             prefetch:  threads {}, chunks requested {}, dropped {}\n\
             commands:  write one per line to this file ({} only): drop-cache{}\n",
            self.shared.files.len(),
            self.config.views.names(),
            self.shared.files.len() * self.ns.formats.len(),
            self.n_tensor_names(),
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
            s.bytes_in_flight,
            s.bytes_held,
            s.budget_waits,
            s.over_budget,
            s.prefetch_refused,
            c.reads_in_flight.load(Ordering::Relaxed),
            c.reads.load(Ordering::Relaxed),
            c.read_errors.load(Ordering::Relaxed),
            c.checksum_errors.load(Ordering::Relaxed),
            c.bytes_served.load(Ordering::Relaxed),
            c.small_reads.load(Ordering::Relaxed),
            self.config.prefetch_threads,
            self.prefetch.requested(),
            self.prefetch.dropped(),
            self.ctl.commanders(),
            if self.jobs.is_some() {
                ", encode sk32|rknot|knot ... out=NAME, cancel JOB"
            } else {
                ""
            },
        );
        for r in b.source_files().iter().filter_map(|f| f.remote_stats()) {
            o += &format!(
                "remote:    {} ({}{}): fetched {} B in {} requests ({} retries, {} failures, \
                 {} under way, {} B read ahead); blocks of {} B (parts of {} B) in memory: \
                 hits {}, misses {} ({} waited), {} B of {} B\n",
                Escaped(&r.url),
                Escaped(&r.pinned),
                if r.changed { ", CHANGED" } else { "" },
                r.bytes_fetched,
                r.requests,
                r.retries,
                r.failures,
                r.in_flight,
                r.readahead_bytes,
                r.block_size,
                r.part_size,
                r.parts.hits,
                r.parts.misses,
                r.parts.waits,
                r.parts.bytes_used,
                r.parts.capacity,
            );
            if let Some(d) = &r.disk {
                o += &format!(
                    "           disk cache {}: hits {}, misses {}; whole cache: {} B of {} B \
                     in {} parts, {} corrupt parts refetched, {} evictions, {} write failures\n",
                    Escaped(&d.dir.display().to_string()),
                    d.hits,
                    d.misses,
                    d.cache.bytes,
                    d.cache.limit,
                    d.cache.entries,
                    d.cache.corrupt,
                    d.cache.evictions,
                    d.cache.write_failures,
                );
            }
        }
        if let Some(j) = &self.jobs {
            o += &j.to_text();
        }
        for v in &self.ns.views {
            o += &match &v.layout {
                Ok(l) => format!(
                    "view:      {} ({}, {} B{})\n",
                    v.view.name(),
                    v.dtype(),
                    l.size(),
                    self.ns
                        .precision
                        .rounding_of(v)
                        .map_or(String::new(), |r| format!("; {r}"))
                ),
                Err(why) => format!("view:      {} absent: {}\n", v.view.name(), Escaped(why)),
            };
        }
        for (name, why) in &self.ns.unserved {
            o += &format!("unserved:  {}: {}\n", Escaped(name), Escaped(why));
        }
        if let Some(d) = self.decoded() {
            o += &d.status_text();
        }
        if let Some(i) = &self.config.integrity {
            o += &i.status_text();
        }
        if let Some(e) = lock(&self.ctl.last_error).as_ref() {
            o += &format!("last_error: {}\n", Escaped(e));
        }
        o
    }

    /// `ctl.json`: sources, cache and read counters, and the jobs.
    pub fn ctl_json(&self) -> Value {
        let s = self.shared.cache.stats();
        let b = self.shared.backend.as_ref();
        let src = |s: &SourceSummary| json!({"path": s.path.display().to_string(), "format": s.format.name(), "version": s.version, "checked": s.checked});
        let c = &self.counters;
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "source": src(b.summary()),
            "fallback": b.fallback_summary().map(src),
            "mode": if self.direct_io() { "direct_io" } else { "page_cache" },
            "uptime_s": self.started.elapsed().as_secs(),
            "tensor_formats": self.config.views.names(),
            "cache": {
                "capacity": s.capacity, "bytes_used": s.bytes_used, "chunks": s.chunks,
                "chunk_bytes": self.config.chunk_bytes, "pool_bytes": s.pool_bytes,
                "hits": s.hits, "misses": s.misses, "waits": s.waits, "evictions": s.evictions,
                "bytes_decoded": s.bytes_decoded, "decode_errors": s.decode_errors, "decodes_in_flight": s.in_flight,
                "bytes_in_flight": s.bytes_in_flight, "bytes_held": s.bytes_held,
                "budget_waits": s.budget_waits, "over_budget": s.over_budget, "prefetch_refused": s.prefetch_refused,
            },
            "reads": {
                "in_flight": c.reads_in_flight.load(Ordering::Relaxed),
                "total": c.reads.load(Ordering::Relaxed),
                "errors": c.read_errors.load(Ordering::Relaxed),
                "checksum_errors": c.checksum_errors.load(Ordering::Relaxed),
                "bytes_served": c.bytes_served.load(Ordering::Relaxed),
                "small_uncached": c.small_reads.load(Ordering::Relaxed),
            },
            "prefetch": {
                "threads": self.config.prefetch_threads,
                "max_window_chunks": self.config.prefetch_max_chunks,
                "chunks_requested": self.prefetch.requested(),
                "dropped": self.prefetch.dropped(),
            },
            "views": self.ns.views.iter().map(|v| match &v.layout {
                Ok(l) => {
                    let rounding = self.ns.precision.rounding_of(v);
                    json!({"name": v.view.name(), "dtype": v.dtype(), "size": l.size(),
                           "exact": rounding.is_none(), "rounding": rounding})
                }
                Err(why) => json!({"name": v.view.name(), "absent": why}),
            }).collect::<Vec<_>>(),
            "unserved": self.ns.unserved.iter().map(|(n, why)| json!({"name": n, "reason": why})).collect::<Vec<_>>(),
            "commanders": {"uid": self.ctl.owner.0, "root": true},
            "jobs_dir": self.jobs.as_ref().map(|j| j.jobs_dir().display().to_string()),
            "jobs": self.jobs.as_ref().map_or(Value::Array(Vec::new()), |j| j.to_json()),
            "integrity": self.config.integrity.as_ref().map(|i| i.status_json()),
            "decoded_cache": self.decoded().map(|d| d.status_json()),
            "remote": b.source_files().iter().filter_map(|f| {
                let r = f.remote_stats()?;
                let mut v = remote_identity_json(f)?;
                v["changed"] = json!(r.changed);
                v["bytes_fetched"] = json!(r.bytes_fetched);
                v["requests"] = json!(r.requests);
                v["retries"] = json!(r.retries);
                v["failures"] = json!(r.failures);
                v["in_flight"] = json!(r.in_flight);
                v["readahead_bytes"] = json!(r.readahead_bytes);
                v["memory_cache"] = json!({
                    "hits": r.parts.hits, "misses": r.parts.misses, "waits": r.parts.waits,
                    "evictions": r.parts.evictions, "bytes_used": r.parts.bytes_used,
                    "capacity": r.parts.capacity,
                });
                v["disk_cache"] = match &r.disk {
                    Some(d) => json!({
                        "dir": d.dir.display().to_string(),
                        "hits": d.hits, "misses": d.misses,
                        "cache_bytes": d.cache.bytes, "cache_limit": d.cache.limit,
                        "cache_entries": d.cache.entries, "corrupt": d.cache.corrupt,
                        "evictions": d.cache.evictions, "writes": d.cache.writes,
                        "write_failures": d.cache.write_failures,
                    }),
                    None => Value::Null,
                };
                Some(v)
            }).collect::<Vec<_>>(),
            "last_error": lock(&self.ctl.last_error).clone(),
        })
    }
}

/// What identifies a remote source and how it is read, for `ctl.json` and
/// `index.json` (which holds nothing that changes while mounted): the
/// redacted URL, the pinned version, part and block sizes. None for a
/// local file.
pub(super) fn remote_identity_json(f: &crate::source::SourceFile) -> Option<Value> {
    let r = f.remote_stats()?;
    let pin = f.remote_pin()?;
    Some(json!({
        "url": r.url,
        "pinned": {"etag": pin.etag, "size": pin.size, "last_modified": pin.last_modified.to_string()},
        "part_size": r.part_size,
        "block_size": r.block_size,
    }))
}
