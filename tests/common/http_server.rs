//! A small HTTP/1.1 server on 127.0.0.1 for remote-source tests: HEAD,
//! ranged GET, ETag, If-Match -> 412, keep-alive, with switchable faults of
//! its own (503 every Nth request, a connection dropped mid-body, Range
//! ignored) and an object that can be replaced while it serves. It serves
//! `/m.gguf`; `/secret.gguf` answers 403, `/to-file.gguf` redirects to
//! `file:///etc/passwd`, `/loop-a.gguf` and `/loop-b.gguf` redirect to each
//! other, `/hop/N.gguf` to `/hop/N+1.gguf` (without end), and anything else
//! answers 404; objects added with `Server::add_file` are served at `/d/NAME`.
//! tests/common/fault_proxy.rs puts more faults in front of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub struct Faults {
    /// Answer 503 to every Nth request (0: never).
    pub fail_every: AtomicU64,
    /// Drop the connection halfway through the body of every Nth GET.
    pub drop_every: AtomicU64,
    /// Answer ranged GETs with 200 and the whole body.
    pub ignore_range: AtomicBool,
    /// The signature /r.gguf redirects to (/t.gguf?sig=N); /t.gguf answers
    /// 403 to any other: bump it to expire the redirect targets given out
    /// so far (a resolve URL redirecting to presigned CDN URLs).
    pub signature: AtomicU64,
}

struct Object {
    /// Shared, not copied per request: the real model is 100 MB.
    data: Arc<[u8]>,
    etag: String,
}

pub struct Server {
    pub port: u16,
    object: Arc<Mutex<Object>>,
    /// More objects, served at `/d/NAME` (a directory of several files).
    files: Arc<Mutex<HashMap<String, Arc<[u8]>>>>,
    pub faults: Arc<Faults>,
    pub requests: Arc<AtomicU64>,
}

impl Server {
    pub fn start(data: Vec<u8>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let object = Arc::new(Mutex::new(Object {
            data: data.into(),
            etag: "\"v1\"".into(),
        }));
        let faults = Arc::new(Faults::default());
        let requests = Arc::new(AtomicU64::new(0));
        let files = Arc::new(Mutex::new(HashMap::new()));
        let (o, f, r, d) = (
            object.clone(),
            faults.clone(),
            requests.clone(),
            files.clone(),
        );
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (o, f, r, d) = (o.clone(), f.clone(), r.clone(), d.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &o, &d, &f, &r);
                });
            }
        });
        Server {
            port,
            object,
            files,
            faults,
            requests,
        }
    }

    pub fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// Serve `data` at `/d/NAME` too (ETag `"NAME"`).
    pub fn add_file(&self, name: &str, data: Vec<u8>) {
        self.files.lock().unwrap().insert(name.into(), data.into());
    }

    /// Replace the object (new bytes, new ETag).
    pub fn replace(&self, data: Vec<u8>, etag: &str) {
        let mut o = self.object.lock().unwrap();
        o.data = data.into();
        o.etag = etag.into();
    }
}

/// The query string a presigned URL of /p.gguf carries (its "signature").
pub const PRESIGNED_QUERY: &str = "X-Amz-Expires=600&X-Amz-Signature=SECRETSIG0123";

/// A request's start line and headers (the body, if any, is left unread).
pub struct Request {
    pub method: String,
    /// The path and query, as sent.
    pub target: String,
    /// Every header as (name, value trimmed), in order.
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// The value of header `name` (any case; the last one when repeated).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .rev()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Read the next request of a keep-alive connection; `None` when the
/// client closes it (before or inside a request). Lenient, for test
/// servers: a header line without ':' is a name with an empty value.
pub fn read_request(r: &mut impl BufRead) -> std::io::Result<Option<Request>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Ok(None);
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap_or((h, ""));
        headers.push((k.to_string(), v.trim().to_string()));
    }
    Ok(Some(Request {
        method,
        target,
        headers,
    }))
}

/// One connection: requests until the client closes it (keep-alive).
fn serve(
    conn: TcpStream,
    object: &Mutex<Object>,
    files: &Mutex<HashMap<String, Arc<[u8]>>>,
    faults: &Faults,
    requests: &AtomicU64,
) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = conn;
    loop {
        let Some(req) = read_request(&mut r)? else {
            return Ok(());
        };
        let (method, path) = (req.method.clone(), req.target.clone());
        let range = req.header("range").map(str::to_string);
        let if_match = req.header("if-match").map(str::to_string);
        let n = requests.fetch_add(1, Ordering::SeqCst) + 1;
        let every = faults.fail_every.load(Ordering::SeqCst);
        if every > 0 && n.is_multiple_of(every) {
            respond(&mut w, "503 Service Unavailable", &[], b"busy")?;
            continue;
        }
        let (mut data, mut etag) = {
            let o = object.lock().unwrap();
            (o.data.clone(), o.etag.clone())
        };
        // A presigned URL's stand-in: /p.gguf answers only with its
        // signature in the query string.
        let (path, query) = match path.split_once('?') {
            Some((p, q)) => (p.to_string(), Some(q.to_string())),
            None => (path, None),
        };
        let signature = format!("sig={}", faults.signature.load(Ordering::SeqCst));
        let file = path
            .strip_prefix("/d/")
            .and_then(|n| Some((n, files.lock().unwrap().get(n)?.clone())));
        match path.as_str() {
            "/m.gguf" => {}
            _ if file.is_some() => {
                if let Some((name, d)) = file {
                    etag = format!("\"{name}\"");
                    data = d;
                }
            }
            "/r.gguf" => {
                respond(
                    &mut w,
                    "302 Found",
                    &[&format!("Location: /t.gguf?{signature}")],
                    b"",
                )?;
                continue;
            }
            "/t.gguf" if query.as_deref() == Some(signature.as_str()) => {}
            "/t.gguf" => {
                respond(&mut w, "403 Forbidden", &[], b"expired")?;
                continue;
            }
            "/p.gguf" if query.as_deref() == Some(PRESIGNED_QUERY) => {}
            "/p.gguf" => {
                respond(&mut w, "403 Forbidden", &[], b"bad signature")?;
                continue;
            }
            "/to-file.gguf" => {
                respond(&mut w, "302 Found", &["Location: file:///etc/passwd"], b"")?;
                continue;
            }
            "/loop-a.gguf" | "/loop-b.gguf" => {
                let other = if path == "/loop-a.gguf" { "b" } else { "a" };
                let to = format!("Location: /loop-{other}.gguf");
                respond(&mut w, "302 Found", &[&to], b"")?;
                continue;
            }
            p if p.starts_with("/hop/") => {
                let n: u64 = p
                    .trim_start_matches("/hop/")
                    .trim_end_matches(".gguf")
                    .parse()
                    .unwrap_or(0);
                let to = format!("Location: /hop/{}.gguf", n + 1);
                respond(&mut w, "302 Found", &[&to], b"")?;
                continue;
            }
            "/secret.gguf" => {
                respond(&mut w, "403 Forbidden", &[], b"no")?;
                continue;
            }
            _ => {
                respond(&mut w, "404 Not Found", &[], b"none")?;
                continue;
            }
        }
        if if_match.as_ref().is_some_and(|m| *m != etag) {
            respond(&mut w, "412 Precondition Failed", &[], b"")?;
            continue;
        }
        let lm = "Mon, 01 Jan 2024 00:00:00 GMT".to_string();
        let total = data.len();
        if method == "HEAD" {
            write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Length: {total}\r\nETag: {etag}\r\n\
                 Last-Modified: {lm}\r\nAccept-Ranges: bytes\r\n\r\n"
            )?;
            continue;
        }
        let ranged = range
            .as_deref()
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.split_once('-'))
            .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)))
            .filter(|_| !faults.ignore_range.load(Ordering::SeqCst));
        let (status, body, extra) = match ranged {
            Some((a, b)) if a <= b && a < total => {
                let b = b.min(total - 1);
                (
                    "206 Partial Content",
                    &data[a..=b],
                    vec![format!("Content-Range: bytes {a}-{b}/{total}")],
                )
            }
            Some(_) => {
                respond(&mut w, "416 Range Not Satisfiable", &[], b"")?;
                continue;
            }
            None => ("200 OK", &data[..], vec![]),
        };
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nETag: {etag}\r\nLast-Modified: {lm}\r\n",
            body.len()
        );
        for e in extra {
            head += &e;
            head += "\r\n";
        }
        head += "\r\n";
        w.write_all(head.as_bytes())?;
        let drop_every = faults.drop_every.load(Ordering::SeqCst);
        if drop_every > 0 && n.is_multiple_of(drop_every) && body.len() > 1 {
            w.write_all(&body[..body.len() / 2])?;
            w.flush()?;
            let _ = w.shutdown(std::net::Shutdown::Both);
            return Ok(());
        }
        w.write_all(body)?;
        w.flush()?;
    }
}

fn respond(w: &mut TcpStream, status: &str, headers: &[&str], body: &[u8]) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
    for h in headers {
        head += h;
        head += "\r\n";
    }
    head += "\r\n";
    w.write_all(head.as_bytes())?;
    w.write_all(body)?;
    w.flush()
}
