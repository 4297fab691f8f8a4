//! A fault-injecting HTTP/1.1 proxy for tests: it listens on 127.0.0.1:0,
//! forwards each request of each client connection to an upstream server
//! (one upstream connection per client connection, kept alive) and relays
//! the response, with faults switchable while it runs (atomics):
//! a delay before forwarding, 500/503 instead of forwarding on every Nth
//! request (or on requests whose Range overlaps a given byte range), a
//! connection reset mid-body or a truncated body (fewer bytes than
//! Content-Length, then a clean close) on every Nth response with a body,
//! a rewritten ETag (a changed object, seen by the client) and If-Match
//! stripped from requests (an upstream that ignores it); a body that stalls
//! halfway (no more bytes for a while, then a reset), a request never
//! answered (the connection held open, silent), and an object replaced
//! mid-way (every later response carries other bytes and another ETag, as
//! from a server that ignores If-Match). Stalls last `stall_ms`, or until
//! their switch is turned off ([`ProxyFaults::clear`] ends them at once).
//!
//! Generic: the upstream is any HTTP/1.1 server (tests/common/http_server.rs,
//! an S3-compatible one); request bodies with Content-Length are forwarded
//! (S3 PUTs), the Host header is left alone (SigV4 signs it). Response
//! bodies: Content-Length, close-delimited, or chunked (relayed chunk by
//! chunk; the body faults then do not apply). Anything the proxy cannot
//! relay (a chunked request body, a malformed response) is recorded and
//! fails [`FaultProxy::assert_clean`] with a clear message instead of
//! being silently dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The switchable faults; 0 / false / None means off.
#[derive(Default)]
pub struct ProxyFaults {
    /// Milliseconds to wait before forwarding a request...
    pub delay_ms: AtomicU64,
    /// ...on every Nth request (0 or 1: every request).
    pub delay_every: AtomicU64,
    /// Answer `error_status` (without forwarding) to every Nth request.
    pub error_every: AtomicU64,
    /// The status of `error_every` and `error_range`: 500 or 503 (0: 503).
    pub error_status: AtomicU64,
    /// Reset the connection (RST) halfway through every Nth response body.
    pub drop_every: AtomicU64,
    /// Send all but the last quarter of every Nth response body, then
    /// close cleanly (FIN): a truncated body.
    pub truncate_every: AtomicU64,
    /// Replace the ETag of every response with this one.
    pub rewrite_etag: Mutex<Option<String>>,
    /// Remove If-Match from requests.
    pub strip_if_match: AtomicBool,
    /// Answer `error_status` to every request whose Range overlaps this
    /// byte range (a part of the object that cannot be fetched).
    pub error_range: Mutex<Option<Range<u64>>>,
    /// Send half of every Nth response body, then nothing (a stalled
    /// server) for `stall_ms`, then reset the connection.
    pub stall_every: AtomicU64,
    /// Read every Nth request and never answer it: the connection stays
    /// open and silent for `stall_ms`, then closes.
    pub hang_every: AtomicU64,
    /// How long stalls and hangs last, ms (0: ten minutes, i.e. for the
    /// whole test); either ends early when its switch is turned off.
    pub stall_ms: AtomicU64,
    /// The object was replaced: every response from now on carries the
    /// ETag `"replaced"` and its body bytes XOR 0x5a, and If-Match is
    /// removed from requests (the server ignores it).
    pub replaced: AtomicBool,
}

impl ProxyFaults {
    /// Every fault off.
    pub fn clear(&self) {
        for a in [
            &self.delay_ms,
            &self.delay_every,
            &self.error_every,
            &self.error_status,
            &self.drop_every,
            &self.truncate_every,
            &self.stall_every,
            &self.hang_every,
            &self.stall_ms,
        ] {
            a.store(0, Ordering::SeqCst);
        }
        self.strip_if_match.store(false, Ordering::SeqCst);
        self.replaced.store(false, Ordering::SeqCst);
        *self.rewrite_etag.lock().unwrap() = None;
        *self.error_range.lock().unwrap() = None;
    }
}

/// What the proxy did, for assertions.
#[derive(Default)]
pub struct ProxyCounts {
    /// Requests read from clients.
    pub requests: AtomicU64,
    /// Responses with a body relayed (or cut): what `drop_every` and
    /// `truncate_every` count.
    pub bodies: AtomicU64,
    /// Faults injected (errors, resets, truncations, delays, stalls).
    pub injected: AtomicU64,
    /// Stalls and hangs begun (counted in `injected` too).
    pub stalls: AtomicU64,
}

pub struct FaultProxy {
    pub port: u16,
    pub upstream: SocketAddr,
    pub faults: Arc<ProxyFaults>,
    pub counts: Arc<ProxyCounts>,
    errors: Arc<Mutex<Vec<String>>>,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let faults = Arc::new(ProxyFaults::default());
        let counts = Arc::new(ProxyCounts::default());
        let errors = Arc::new(Mutex::new(Vec::new()));
        let (f, c, e) = (faults.clone(), counts.clone(), errors.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (f, c, e) = (f.clone(), c.clone(), e.clone());
                std::thread::spawn(move || {
                    let mut relay = Relay {
                        upstream,
                        faults: &f,
                        counts: &c,
                        upstream_conn: None,
                    };
                    if let Err(ProxyError::Protocol(msg)) = relay.serve(conn) {
                        e.lock().unwrap().push(msg);
                    }
                });
            }
        });
        FaultProxy {
            port,
            upstream,
            faults,
            counts,
            errors,
        }
    }

    /// `http://127.0.0.1:PORT/path` through the proxy.
    pub fn url(&self, path: &str) -> String {
        format!(
            "http://127.0.0.1:{}/{}",
            self.port,
            path.trim_start_matches('/')
        )
    }

    pub fn requests(&self) -> u64 {
        self.counts.requests.load(Ordering::SeqCst)
    }

    pub fn injected(&self) -> u64 {
        self.counts.injected.load(Ordering::SeqCst)
    }

    pub fn stalls(&self) -> u64 {
        self.counts.stalls.load(Ordering::SeqCst)
    }

    /// Panics if the proxy met anything it could not relay.
    pub fn assert_clean(&self) {
        let e = self.errors.lock().unwrap();
        assert!(
            e.is_empty(),
            "the fault proxy could not relay traffic to {}: {e:?}",
            self.upstream
        );
    }
}

enum ProxyError {
    /// A socket closed or failed: normal for a proxy (the client timed
    /// out, a fault closed it).
    Io,
    /// Traffic the proxy does not understand: a test-setup bug.
    Protocol(String),
}

impl From<std::io::Error> for ProxyError {
    fn from(_: std::io::Error) -> Self {
        ProxyError::Io
    }
}

type PResult<T> = Result<T, ProxyError>;

fn protocol<T>(msg: String) -> PResult<T> {
    Err(ProxyError::Protocol(msg))
}

struct Upstream {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

struct Relay<'a> {
    upstream: SocketAddr,
    faults: &'a ProxyFaults,
    counts: &'a ProxyCounts,
    upstream_conn: Option<Upstream>,
}

/// A message head: the start line and the header lines, as read.
struct Head {
    start: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn has_token(&self, name: &str, token: &str) -> bool {
        self.get(name)
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }

    fn content_length(&self) -> PResult<Option<u64>> {
        match self.get("content-length") {
            None => Ok(None),
            Some(v) => match v.trim().parse() {
                Ok(n) => Ok(Some(n)),
                Err(_) => protocol(format!("bad Content-Length {v:?} in {:?}", self.start)),
            },
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut s = format!("{}\r\n", self.start);
        for (k, v) in &self.headers {
            s += &format!("{k}: {v}\r\n");
        }
        s += "\r\n";
        s.into_bytes()
    }
}

/// Read a head; `None` at a clean end of the stream before it.
fn read_head(r: &mut impl BufRead) -> PResult<Option<Head>> {
    let mut start = String::new();
    if r.read_line(&mut start)? == 0 {
        return Ok(None);
    }
    let start = start.trim_end().to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Err(ProxyError::Io);
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        match h.split_once(':') {
            Some((k, v)) => headers.push((k.to_string(), v.trim().to_string())),
            None => return protocol(format!("malformed header line {h:?} after {start:?}")),
        }
    }
    Ok(Some(Head { start, headers }))
}

/// The first byte of a `bytes=A-B` / `bytes=A-` Range and its end
/// (exclusive; `u64::MAX` when open).
fn range_of(v: &str) -> Option<Range<u64>> {
    let (a, b) = v.trim().strip_prefix("bytes=")?.split_once('-')?;
    let a: u64 = a.trim().parse().ok()?;
    let b = match b.trim() {
        "" => u64::MAX,
        b => b.parse::<u64>().ok()?.saturating_add(1),
    };
    Some(a..b)
}

/// `n` is a multiple of `every` (0: never).
fn nth(n: u64, every: u64) -> bool {
    every > 0 && n.is_multiple_of(every)
}

impl Relay<'_> {
    fn serve(&mut self, client: TcpStream) -> PResult<()> {
        client.set_nodelay(true)?;
        let mut cr = BufReader::new(client.try_clone()?);
        let mut cw = client;
        while let Some(mut req) = read_head(&mut cr)? {
            let n = self.counts.requests.fetch_add(1, Ordering::SeqCst) + 1;
            let f = self.faults;
            if req.has_token("transfer-encoding", "chunked") {
                return protocol(format!(
                    "chunked request body ({:?}): not supported by the fault proxy",
                    req.start
                ));
            }
            let body_len = req.content_length()?.unwrap_or(0);
            let mut body = vec![0u8; usize::try_from(body_len).unwrap_or(usize::MAX)];
            cr.read_exact(&mut body)?;
            let client_close = req.has_token("connection", "close");
            let is_head = req.start.starts_with("HEAD ");
            if nth(n, f.hang_every.load(Ordering::SeqCst)) {
                self.counts.injected.fetch_add(1, Ordering::SeqCst);
                self.counts.stalls.fetch_add(1, Ordering::SeqCst);
                stall(f, &f.hang_every);
                return Ok(());
            }

            let delay = f.delay_ms.load(Ordering::SeqCst);
            let delay_every = f.delay_every.load(Ordering::SeqCst);
            if delay > 0 && (delay_every <= 1 || nth(n, delay_every)) {
                self.counts.injected.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(delay));
            }
            let in_error_range = {
                let bad = f.error_range.lock().unwrap().clone();
                bad.is_some_and(|bad| {
                    req.get("range")
                        .and_then(range_of)
                        .is_some_and(|r| r.start < bad.end && bad.start < r.end)
                })
            };
            if nth(n, f.error_every.load(Ordering::SeqCst)) || in_error_range {
                self.counts.injected.fetch_add(1, Ordering::SeqCst);
                let status = match f.error_status.load(Ordering::SeqCst) {
                    500 => "500 Internal Server Error",
                    _ => "503 Service Unavailable",
                };
                let msg = b"injected by the fault proxy";
                write!(
                    cw,
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n",
                    msg.len()
                )?;
                cw.write_all(msg)?;
                cw.flush()?;
                continue;
            }
            let replaced = f.replaced.load(Ordering::SeqCst);
            if f.strip_if_match.load(Ordering::SeqCst) || replaced {
                req.headers
                    .retain(|(k, _)| !k.eq_ignore_ascii_case("if-match"));
            }

            // Forward; a kept-alive upstream connection may have been closed
            // meanwhile: one retry on a fresh connection, before any byte of
            // the response.
            let mut resp = None;
            for attempt in 0..2 {
                let up = self.connect()?;
                let sent = up
                    .writer
                    .write_all(&req.bytes())
                    .and_then(|()| up.writer.write_all(&body))
                    .and_then(|()| up.writer.flush());
                let head = match sent {
                    Ok(()) => read_head(&mut up.reader),
                    Err(e) => Err(e.into()),
                };
                match head {
                    Ok(Some(h)) => {
                        resp = Some(h);
                        break;
                    }
                    Ok(None) | Err(ProxyError::Io) if attempt == 0 => self.upstream_conn = None,
                    Ok(None) | Err(ProxyError::Io) => return Err(ProxyError::Io),
                    Err(e) => return Err(e),
                }
            }
            let Some(mut resp) = resp else {
                return Err(ProxyError::Io);
            };
            let new_tag = if replaced {
                Some("\"replaced\"".to_string())
            } else {
                f.rewrite_etag.lock().unwrap().clone()
            };
            if let Some(tag) = new_tag {
                for (k, v) in resp.headers.iter_mut() {
                    if k.eq_ignore_ascii_case("etag") {
                        *v = tag.clone();
                    }
                }
            }
            let status: u16 = resp
                .start
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .map_or_else(|| protocol(format!("bad status line {:?}", resp.start)), Ok)?;
            let upstream_close = resp.has_token("connection", "close");
            let no_body = is_head || status / 100 == 1 || status == 204 || status == 304;
            let up = self.upstream_conn.as_mut().ok_or(ProxyError::Io)?;
            if no_body {
                cw.write_all(&resp.bytes())?;
            } else if resp.has_token("transfer-encoding", "chunked") {
                cw.write_all(&resp.bytes())?;
                relay_chunked(&mut up.reader, &mut cw)?;
            } else if let Some(len) = resp.content_length()? {
                let k = self.counts.bodies.fetch_add(1, Ordering::SeqCst) + 1;
                if len > 1 && nth(k, f.stall_every.load(Ordering::SeqCst)) {
                    self.counts.injected.fetch_add(1, Ordering::SeqCst);
                    self.counts.stalls.fetch_add(1, Ordering::SeqCst);
                    cw.write_all(&resp.bytes())?;
                    copy_body(&mut up.reader, &mut cw, len / 2, replaced)?;
                    cw.flush()?;
                    stall(f, &f.stall_every);
                    set_linger_zero(&cw);
                    self.upstream_conn = None;
                    return Ok(());
                }
                let cut = if len > 1 && nth(k, f.drop_every.load(Ordering::SeqCst)) {
                    Some((len / 2, true))
                } else if len > 1 && nth(k, f.truncate_every.load(Ordering::SeqCst)) {
                    Some((len - len / 4 - 1, false))
                } else {
                    None
                };
                cw.write_all(&resp.bytes())?;
                match cut {
                    None => copy_body(&mut up.reader, &mut cw, len, replaced)?,
                    Some((send, reset)) => {
                        self.counts.injected.fetch_add(1, Ordering::SeqCst);
                        copy_body(&mut up.reader, &mut cw, send, replaced)?;
                        cw.flush()?;
                        if reset {
                            set_linger_zero(&cw);
                        } else {
                            let _ = cw.shutdown(Shutdown::Both);
                        }
                        // The rest of the body is still upstream: that
                        // connection cannot be reused.
                        self.upstream_conn = None;
                        return Ok(());
                    }
                }
            } else {
                // Close-delimited body: relay to the end, then close.
                cw.write_all(&resp.bytes())?;
                std::io::copy(&mut up.reader, &mut cw)?;
                cw.flush()?;
                return Ok(());
            }
            cw.flush()?;
            if upstream_close {
                self.upstream_conn = None;
            }
            if client_close {
                return Ok(());
            }
        }
        Ok(())
    }

    fn connect(&mut self) -> PResult<&mut Upstream> {
        if self.upstream_conn.is_none() {
            let s = TcpStream::connect(self.upstream)?;
            s.set_nodelay(true)?;
            self.upstream_conn = Some(Upstream {
                reader: BufReader::new(s.try_clone()?),
                writer: s,
            });
        }
        self.upstream_conn.as_mut().ok_or(ProxyError::Io)
    }
}

/// Wait while `switch` stays on, for `stall_ms` at most (0: ten minutes).
fn stall(f: &ProxyFaults, switch: &AtomicU64) {
    let ms = match f.stall_ms.load(Ordering::SeqCst) {
        0 => 600_000,
        ms => ms,
    };
    let until = std::time::Instant::now() + Duration::from_millis(ms);
    while switch.load(Ordering::SeqCst) != 0 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `n` bytes of a body from `r` to `w`; XOR 0x5a when the object was
/// `replaced` (other bytes than the server's).
fn copy_body(r: &mut impl Read, w: &mut impl Write, n: u64, replaced: bool) -> PResult<()> {
    if !replaced {
        return copy_exact(r, w, n);
    }
    let mut left = n;
    let mut buf = vec![0u8; 64 << 10];
    while left > 0 {
        let k = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        r.read_exact(&mut buf[..k])?;
        for b in &mut buf[..k] {
            *b ^= 0x5a;
        }
        w.write_all(&buf[..k])?;
        left -= k as u64;
    }
    Ok(())
}

fn copy_exact(r: &mut impl Read, w: &mut impl Write, n: u64) -> PResult<()> {
    let copied = std::io::copy(&mut r.take(n), w)?;
    if copied < n {
        return Err(ProxyError::Io);
    }
    Ok(())
}

/// Relay a chunked body verbatim: size lines, data, the last chunk and
/// the trailers.
fn relay_chunked(r: &mut impl BufRead, w: &mut impl Write) -> PResult<()> {
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Err(ProxyError::Io);
        }
        w.write_all(line.as_bytes())?;
        let size_hex = line.trim_end().split(';').next().unwrap_or("").trim();
        let Ok(size) = u64::from_str_radix(size_hex, 16) else {
            return protocol(format!("bad chunk size line {line:?}"));
        };
        if size == 0 {
            // Trailers, up to an empty line.
            loop {
                let mut t = String::new();
                if r.read_line(&mut t)? == 0 {
                    return Err(ProxyError::Io);
                }
                w.write_all(t.as_bytes())?;
                if t.trim_end().is_empty() {
                    return Ok(());
                }
            }
        }
        copy_exact(r, w, size + 2)?; // data and its CRLF
    }
}

/// Close `s` with a reset (RST) instead of a FIN: a connection reset by
/// the peer, as a crashed server or a middlebox produces.
fn set_linger_zero(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a socket we own, with a valid linger struct.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    // The reset goes out when the last descriptor of the socket closes:
    // the caller returns, dropping both.
}
