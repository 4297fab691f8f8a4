//! A cache key identifies exactly one object: two remote objects whose URLs
//! differ only in the query string (a download endpoint `/get?f=a.gguf`
//! and `?f=b.gguf`), with the same size and Last-Modified and no ETag, are
//! never served from each other's cached bytes: not by the disk cache of
//! parts (`--source-cache`), not by the decoded-file store
//! (`--decoded-cache`). Presigned URLs of one object that differ only in
//! their signature do share cached parts.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::http_server::read_request;
use common::mount::{Mounted, fuse_available};
use common::*;
use rknot::source::{RemoteOptions, SourceFile};

/// Serves `/get?f=a.gguf` and `/get?f=b.gguf` (and the same under any
/// extra signing parameters) with ranged GETs, no ETag and one
/// Last-Modified: nothing in a response tells the two objects apart but
/// their bytes.
struct QueryServer {
    port: u16,
    /// GET requests answered (for "was anything fetched").
    gets: Arc<AtomicU64>,
}

const LAST_MODIFIED: &str = "Tue, 01 Dec 2026 00:00:00 GMT";

impl QueryServer {
    fn start(a: Vec<u8>, b: Vec<u8>) -> QueryServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let objects: Arc<[Vec<u8>; 2]> = Arc::new([a, b]);
        let gets = Arc::new(AtomicU64::new(0));
        let g = gets.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (o, g) = (objects.clone(), g.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &o, &g);
                });
            }
        });
        QueryServer { port, gets }
    }

    fn url(&self, query: &str) -> String {
        format!("http://127.0.0.1:{}/get?{query}", self.port)
    }
}

fn serve(conn: TcpStream, objects: &[Vec<u8>; 2], gets: &AtomicU64) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = conn;
    loop {
        let Some(req) = read_request(&mut r)? else {
            return Ok(());
        };
        let (method, target) = (req.method.as_str(), req.target.as_str());
        let range = req.header("range").and_then(|v| {
            let (s, e) = v.trim_start_matches("bytes=").split_once('-')?;
            Some((s.parse::<u64>().unwrap(), e.parse::<u64>().unwrap()))
        });
        let query = target.split_once('?').map(|(_, q)| q).unwrap_or("");
        let which = query
            .split('&')
            .find_map(|p| p.strip_prefix("f="))
            .and_then(|f| match f {
                "a.gguf" => Some(0),
                "b.gguf" => Some(1),
                _ => None,
            });
        let Some(which) = which.filter(|_| target.starts_with("/get?")) else {
            w.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")?;
            continue;
        };
        let data = &objects[which];
        let total = data.len() as u64;
        let (s, e) = range.unwrap_or((0, total - 1));
        let e = e.min(total - 1);
        let body = &data[s as usize..=e as usize];
        let head = format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {s}-{e}/{total}\r\n\
             Last-Modified: {LAST_MODIFIED}\r\nAccept-Ranges: bytes\r\n\r\n",
            body.len()
        );
        w.write_all(head.as_bytes())?;
        if method == "GET" {
            gets.fetch_add(1, Ordering::Relaxed);
            w.write_all(body)?;
        }
        w.flush()?;
        let _ = r.fill_buf();
        let _ = r.by_ref().take(0).read_to_end(&mut Vec::new());
    }
}

/// The demo GGUF and a second object of the same size whose tensor bytes
/// differ (the header, and so every tensor's offset and shape, is the
/// same): what a re-quantization or a fine-tune of one model looks like.
fn two_objects() -> (Vec<u8>, Vec<u8>) {
    let a = std::fs::read(demo_path("tiny-llama.gguf")).unwrap();
    let mut b = a.clone();
    let from = b.len() / 2;
    for x in b[from..].iter_mut().step_by(7) {
        *x ^= 0x11;
    }
    assert_eq!(a.len(), b.len());
    (a, b)
}

fn read_all(src: &SourceFile) -> Vec<u8> {
    let mut got = vec![0u8; src.len() as usize];
    src.read_at(0, &mut got).unwrap();
    got
}

/// `--source-cache`: the second object's blocks are its own, not the first
/// object's parts read back from disk; and presigned URLs of one object
/// that differ only in their signature share its parts.
#[test]
fn disk_cache_keeps_objects_that_differ_only_in_the_query_apart() {
    let (a, b) = two_objects();
    let s = QueryServer::start(a.clone(), b.clone());
    let cache = tempfile::tempdir().unwrap();
    let opts = || RemoteOptions {
        part_size: 64 << 10,
        backoff: Duration::from_millis(5),
        timeout: Duration::from_secs(10),
        source_cache: Some(cache.path().join("parts")),
        source_cache_bytes: 1 << 30,
        ..RemoteOptions::default()
    };
    let first = SourceFile::open_remote(&s.url("f=a.gguf"), opts()).unwrap();
    assert!(read_all(&first) == a);
    drop(first);

    let second = SourceFile::open_remote(&s.url("f=b.gguf"), opts()).unwrap();
    let got = read_all(&second);
    let wrong = got.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert_eq!(
        wrong, 0,
        "{wrong} bytes of ?f=b.gguf came from ?f=a.gguf's cached parts"
    );
    drop(second);

    // The same object under another signature: every block but the open's
    // from the disk cache.
    let before = s.gets.load(Ordering::Relaxed);
    let signed = SourceFile::open_remote(
        &s.url("f=a.gguf&X-Amz-Signature=0123abcd&X-Amz-Date=20261201T000000Z"),
        opts(),
    )
    .unwrap();
    assert!(read_all(&signed) == a);
    let st = signed.remote_stats().unwrap();
    assert!(st.disk.as_ref().unwrap().hits > 0, "{st:?}");
    assert_eq!(s.gets.load(Ordering::Relaxed) - before, 1, "{st:?}");
    // The signature is in no cache file's name or contents.
    for e in std::fs::read_dir(cache.path().join("parts")).unwrap() {
        let p = e.unwrap().path();
        assert!(!p.to_string_lossy().contains("0123abcd"));
        let bytes = std::fs::read(&p).unwrap();
        assert!(
            !bytes.windows(8).any(|w| w == b"0123abcd"),
            "{}",
            p.display()
        );
        assert!(
            !bytes.windows(8).any(|w| w == b"f=a.gguf"),
            "{}",
            p.display()
        );
    }
}

/// `rknot cat` of a local copy: the reference bytes of a tensor.
fn cat_local(path: &Path, tensor: &str) -> Vec<u8> {
    let out = Command::new(rknot_bin())
        .args(["cat", &path.display().to_string(), tensor])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

needs! { [fuse]
/// `--decoded-cache`: a mount of the second object does not serve the
/// first object's decoded files.
fn decoded_store_keeps_objects_that_differ_only_in_the_query_apart() {
    assert!(fuse_available(), "FUSE is not available here");
    let (a, b) = two_objects();
    let dir = tempfile::tempdir().unwrap();
    let local_b = dir.path().join("b.gguf");
    std::fs::write(&local_b, &b).unwrap();
    let s = QueryServer::start(a, b);
    let store = dir.path().join("store");
    let dc = store.display().to_string();
    // The last tensors lie in the half of the file that differs.
    let tensor = "output.weight";
    let file = format!("{tensor}.f32");
    {
        let m = Mounted::new(Path::new(&s.url("f=a.gguf")), &["--decoded-cache", &dc]);
        let got = std::fs::read(m.path(&file)).unwrap();
        assert!(!got.is_empty());
    }
    // ?f=a.gguf's decoded file is in the store.
    let entries = || {
        std::fs::read_dir(&store)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "data")
            })
            .count()
    };
    assert_eq!(entries(), 1, "no entry was stored for ?f=a.gguf");
    let m = Mounted::new(Path::new(&s.url("f=b.gguf")), &["--decoded-cache", &dc]);
    let got = std::fs::read(m.path(&file)).unwrap();
    let want = cat_local(&local_b, tensor);
    assert_eq!(got.len(), want.len());
    assert!(
        got == want,
        "{file} of ?f=b.gguf was served from ?f=a.gguf's decoded entry"
    );
    assert_eq!(entries(), 2, "?f=b.gguf has no entry of its own");
    // A remote mount without --jobs-dir has ctl.json, with its remote
    // counters.
    let v = m.ctl_json();
    assert!(v["remote"][0]["bytes_fetched"].as_u64() > Some(0), "{v}");
    assert_eq!(v["decoded_cache"]["builds"].as_u64(), Some(1), "{v}");
}
}
