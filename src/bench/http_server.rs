//! The loopback HTTP/1.1 server of `rknot bench remote`: files served by
//! name with HEAD, ranged GET (`bytes=A-B`, `bytes=A-`), a strong ETag from
//! the file's size and mtime, Last-Modified, If-Match (412 on a mismatch)
//! and keep-alive; bodies go out with sendfile(2), so the server costs the
//! client as little as it can and curl and the mount are measured against
//! the same thing. A thread per connection; for benchmarks only (no TLS, no
//! authentication, 127.0.0.1 only).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub struct BenchServer {
    pub port: u16,
    stop: Arc<AtomicBool>,
    /// Requests answered (all methods and statuses).
    pub requests: Arc<AtomicU64>,
    /// Body bytes sent.
    pub bytes_sent: Arc<AtomicU64>,
}

impl BenchServer {
    /// Serve `files` (URL path without the leading `/` -> file) on
    /// 127.0.0.1 at a free port.
    pub fn start(files: HashMap<String, PathBuf>) -> std::io::Result<BenchServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let bytes_sent = Arc::new(AtomicU64::new(0));
        let files = Arc::new(files);
        let (s, r, b) = (stop.clone(), requests.clone(), bytes_sent.clone());
        std::thread::Builder::new()
            .name("bench-http".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let (f, r, b) = (files.clone(), r.clone(), b.clone());
                    let _ = std::thread::Builder::new()
                        .name("bench-http-conn".into())
                        .spawn(move || {
                            let _ = serve(conn, &f, &r, &b);
                        });
                }
            })?;
        Ok(BenchServer {
            port,
            stop,
            requests,
            bytes_sent,
        })
    }

    pub fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }
}

impl Drop for BenchServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// `bytes=A-B` or `bytes=A-` against a file of `size` bytes: `Some(Ok)`
/// for a satisfiable range (inclusive end), `Some(Err)` for one that is
/// not, `None` for a form this server does not take (served whole, as
/// HTTP allows).
fn parse_range(v: &str, size: u64) -> Option<Result<(u64, u64), ()>> {
    let (a, b) = v.trim().strip_prefix("bytes=")?.split_once('-')?;
    let a: u64 = a.trim().parse().ok()?;
    let b = match b.trim() {
        "" => u64::MAX,
        b => b.parse().ok()?,
    };
    if a > b || a >= size {
        return Some(Err(()));
    }
    Some(Ok((a, b.min(size - 1))))
}

fn http_date(secs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, 0)
        .map(|t| t.format("%a, %d %b %Y %H:%M:%S GMT").to_string())
        .unwrap_or_else(|| "Thu, 01 Jan 1970 00:00:00 GMT".into())
}

fn respond(w: &mut TcpStream, status: &str) -> std::io::Result<()> {
    write!(w, "HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n")?;
    w.flush()
}

/// One connection: requests until the client closes it.
fn serve(
    conn: TcpStream,
    files: &HashMap<String, PathBuf>,
    requests: &AtomicU64,
    bytes_sent: &AtomicU64,
) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = conn;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let target = parts.next().unwrap_or("").to_string();
        let (mut range, mut if_match, mut close) = (None, None, false);
        loop {
            let mut h = String::new();
            if r.read_line(&mut h)? == 0 {
                return Ok(());
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let Some((k, v)) = h.split_once(':') else {
                continue;
            };
            match k.trim().to_ascii_lowercase().as_str() {
                "range" => range = Some(v.trim().to_string()),
                "if-match" => if_match = Some(v.trim().to_string()),
                "connection" => close = v.trim().eq_ignore_ascii_case("close"),
                _ => {}
            }
        }
        requests.fetch_add(1, Ordering::Relaxed);
        if method != "GET" && method != "HEAD" {
            respond(&mut w, "405 Method Not Allowed")?;
            continue;
        }
        let path = target.split('?').next().unwrap_or("");
        let Some(file) = files.get(path.trim_start_matches('/')) else {
            respond(&mut w, "404 Not Found")?;
            continue;
        };
        let Ok(f) = File::open(file) else {
            respond(&mut w, "404 Not Found")?;
            continue;
        };
        let meta = f.metadata()?;
        let size = meta.len();
        let etag = format!("\"{:x}-{:x}{:09x}\"", size, meta.mtime(), meta.mtime_nsec());
        if if_match.as_ref().is_some_and(|m| m != "*" && *m != etag) {
            respond(&mut w, "412 Precondition Failed")?;
            continue;
        }
        let (status, start, len, content_range) =
            match range.as_deref().and_then(|v| parse_range(v, size)) {
                Some(Ok((a, b))) => (
                    "206 Partial Content",
                    a,
                    b - a + 1,
                    Some(format!("Content-Range: bytes {a}-{b}/{size}\r\n")),
                ),
                Some(Err(())) => {
                    write!(
                        w,
                        "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{size}\r\n\
                         Content-Length: 0\r\n\r\n"
                    )?;
                    continue;
                }
                None => ("200 OK", 0, size, None),
            };
        write!(
            w,
            "HTTP/1.1 {status}\r\nContent-Length: {len}\r\nETag: {etag}\r\n\
             Last-Modified: {}\r\nAccept-Ranges: bytes\r\n{}\r\n",
            http_date(meta.mtime()),
            content_range.unwrap_or_default()
        )?;
        w.flush()?;
        if method == "GET" {
            send_file(&w, &f, start, len)?;
            bytes_sent.fetch_add(len, Ordering::Relaxed);
        }
        if close {
            return Ok(());
        }
    }
}

/// `len` bytes of `f` from `start` to the socket, by sendfile(2).
fn send_file(sock: &TcpStream, f: &File, start: u64, len: u64) -> std::io::Result<()> {
    let mut off =
        libc::off_t::try_from(start).map_err(|_| std::io::Error::other("offset out of range"))?;
    let mut left = len;
    while left > 0 {
        let n = left.min(1 << 30) as usize;
        // SAFETY: both descriptors are open for the duration of the call;
        // `off` is a valid pointer that sendfile advances.
        let sent = unsafe { libc::sendfile(sock.as_raw_fd(), f.as_raw_fd(), &mut off, n) };
        if sent < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if sent == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "file shorter than its size",
            ));
        }
        left -= sent as u64;
    }
    Ok(())
}
