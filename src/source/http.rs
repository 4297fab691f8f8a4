//! Ranged GETs of one object at an `http://` or `https://` URL, with
//! reqwest (the HTTP client object_store itself is built on, so no new
//! crates).
//!
//! Why not object_store's HTTP store: it joins a path onto a base URL, so it
//! cannot carry a query string, and presigned URLs (S3 `X-Amz-Signature`,
//! the CDN URLs Hugging Face's resolve URLs redirect to) are nothing but a
//! query string; and a presigned GET URL usually refuses HEAD, so the pin
//! must come from a GET. Here the URL is used exactly as given (redirects
//! followed, at most 10), and the version is read off every ranged
//! response: its ETag, the total size in Content-Range and Last-Modified.
//!
//! Errors never print the URL: reqwest's own messages are stripped of it
//! (`without_url`), and the caller names the redacted URL.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, ETAG, HeaderMap, IF_MATCH, LAST_MODIFIED, RANGE};

use super::FileTime;
use super::fetch::{Attempt, BlockSplitter, Pin, RANGE_IGNORED, pin_changes, unless_stalled};
use super::options::RemoteOptions;
use crate::error::ErrorKind;

/// A client for the current runtime, with the options' timeouts and extra
/// CA certificates (added to the system's roots; verification stays on):
/// for http(s) sources and for the conditional completion of S3 uploads.
pub(crate) fn client(
    opts: &RemoteOptions,
    ca_pem: Option<&[u8]>,
) -> Result<reqwest::Client, String> {
    // A connection that is not up in 5 s (less under a short deadline)
    // goes to a host that is down or unreachable: retried, within the
    // deadline, rather than waited for.
    let connect = Duration::from_secs(5).min(opts.stall_within(opts.open_budget()));
    let mut b = reqwest::Client::builder()
        .timeout(opts.timeout)
        .connect_timeout(connect)
        .redirect(redirect_policy())
        .user_agent(concat!("rknot/", env!("CARGO_PKG_VERSION")));
    if let Some(pem) = ca_pem {
        // Checked by `remote::read_ca_bundle` when it was read.
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| format!("the CA bundle holds no usable PEM certificate: {e}"))?;
        b = b.tls_certs_merge(certs);
    }
    b.build()
        .map_err(|e| format!("cannot set up the HTTP client: {}", e.without_url()))
}

/// The most redirects one request follows.
const MAX_REDIRECTS: usize = 10;

/// Follow redirects to http(s) URLs, at most [`MAX_REDIRECTS`]; a redirect
/// elsewhere (`file://`), back to a URL already visited or past the limit
/// is an error that says so (final: asking again gets the same answer).
fn redirect_policy() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let next = attempt.url();
        if !matches!(next.scheme(), "http" | "https") {
            let shown = super::identity::redact(next.as_str());
            return attempt.error(RedirectRefused(not_http(&shown)));
        }
        if attempt.previous().iter().any(|u| u == next) {
            let shown = super::identity::redact(next.as_str());
            return attempt.error(RedirectRefused(format!(
                "redirect loop: it redirects back to {shown}, where it has been already"
            )));
        }
        if attempt.previous().len() > MAX_REDIRECTS {
            return attempt.error(RedirectRefused(format!(
                "too many redirects (more than {MAX_REDIRECTS})"
            )));
        }
        attempt.follow()
    })
}

fn not_http(target: &str) -> String {
    format!("it redirects to {target}, which is not http(s): refused")
}

/// Why a redirect was not followed (what the policy tells the caller).
#[derive(Debug)]
struct RedirectRefused(String);

impl std::fmt::Display for RedirectRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RedirectRefused {}

/// A 3xx that reached the caller: a redirect the client did not follow
/// (no usable Location, or one that is not an http(s) URL). Final.
fn redirect_not_followed(status: StatusCode, headers: &HeaderMap) -> Attempt {
    let code = status.as_u16();
    let location = headers
        .get(reqwest::header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    let m = match location {
        Some(l) if !is_http(l) && l.contains(':') => {
            format!("HTTP {code}: {}", not_http(&super::identity::redact(l)))
        }
        Some(l) => format!(
            "HTTP {code}: a redirect that was not followed (to {})",
            super::identity::redact(l)
        ),
        None => format!("HTTP {code}: a redirect without a Location header"),
    };
    Attempt::Final(ErrorKind::Io, m)
}

fn is_http(url: &str) -> bool {
    ["http://", "https://"]
        .iter()
        .any(|p| url.len() >= p.len() && url[..p.len()].eq_ignore_ascii_case(p))
        || url.starts_with('/')
}

/// One ranged response: the bytes asked for, the version they are of, and
/// the URL that answered (where redirects led).
pub(crate) struct RangeResponse {
    pub body: Bytes,
    pub pin: Pin,
    pub final_url: String,
}

/// `GET url` for bytes `want` of the version `pin` (conditional on
/// `if_match` when given): the response must be a 206 for exactly `want`,
/// of that version (ETag, size and, without an ETag, Last-Modified), else
/// the object changed. `want` must not be empty. The body comes back cut
/// into blocks of `block` bytes (the last may be short), with the URL that
/// answered (where redirects led).
pub(crate) async fn get_range(
    client: &reqwest::Client,
    url: &str,
    want: Range<u64>,
    block: u64,
    pin: &Pin,
    if_match: Option<&str>,
    stall: Duration,
) -> Result<(Vec<Bytes>, String), Attempt> {
    let mut req = client
        .get(url)
        .header(RANGE, format!("bytes={}-{}", want.start, want.end - 1));
    if let Some(tag) = if_match {
        req = req.header(IF_MATCH, tag);
    }
    let resp = unless_stalled(stall, "response", async {
        req.send().await.map_err(transport_error)
    })
    .await?;
    let status = resp.status();
    match status {
        StatusCode::PARTIAL_CONTENT => {}
        // Dropped unread: the whole body is never downloaded.
        StatusCode::OK => return Err(Attempt::Final(ErrorKind::Io, RANGE_IGNORED.into())),
        StatusCode::PRECONDITION_FAILED => {
            return Err(Attempt::Final(
                ErrorKind::Changed,
                "HTTP 412: the object no longer has the pinned etag".into(),
            ));
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            return Err(Attempt::Final(
                ErrorKind::Changed,
                format!(
                    "HTTP 416: bytes {}-{} are no longer in the object (it shrank)",
                    want.start,
                    want.end - 1
                ),
            ));
        }
        s if s.is_redirection() => return Err(redirect_not_followed(s, resp.headers())),
        s => return Err(status_error(s)),
    }
    let (start, end, total) = content_range(resp.headers())?;
    let now = version_of(resp.headers(), total);
    // The version first: a changed object may also answer other bytes.
    if let Some(d) = pin_changes(pin, &now) {
        return Err(Attempt::Final(ErrorKind::Changed, d));
    }
    if start != want.start || end != want.end {
        return Err(Attempt::Final(
            ErrorKind::Io,
            format!(
                "asked for bytes {}-{}, the server answered bytes {start}-{} of {total}",
                want.start,
                want.end - 1,
                end.saturating_sub(1)
            ),
        ));
    }
    let mut resp = resp;
    let final_url = resp.url().to_string();
    let mut blocks = BlockSplitter::new(block, want.end - want.start);
    while let Some(chunk) = unless_stalled(stall, "bytes of the body", async {
        resp.chunk().await.map_err(transport_error)
    })
    .await?
    {
        blocks.push(&chunk)?;
    }
    Ok((blocks.finish()?, final_url))
}

/// The first bytes of the object, up to `want_len`, and its version: how a
/// source is opened (one round trip; no HEAD, which presigned GET URLs
/// refuse). An empty object answers 416 with `bytes */0`.
pub(crate) async fn get_first(
    client: &reqwest::Client,
    url: &str,
    want_len: u64,
    stall: Duration,
) -> Result<RangeResponse, Attempt> {
    let req = client
        .get(url)
        .header(RANGE, format!("bytes=0-{}", want_len.max(1) - 1));
    let mut resp = unless_stalled(stall, "response", async {
        req.send().await.map_err(transport_error)
    })
    .await?;
    let status = resp.status();
    let headers = resp.headers();
    match status {
        StatusCode::PARTIAL_CONTENT => {}
        StatusCode::RANGE_NOT_SATISFIABLE
            if headers
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| c.trim() == "bytes */0") =>
        {
            return Ok(RangeResponse {
                body: Bytes::new(),
                pin: version_of(headers, 0),
                final_url: resp.url().to_string(),
            });
        }
        StatusCode::OK => return Err(Attempt::Final(ErrorKind::Io, RANGE_IGNORED.into())),
        s if s.is_redirection() => return Err(redirect_not_followed(s, headers)),
        s => return Err(status_error(s)),
    }
    let (start, end, total) = content_range(headers)?;
    let expect_end = want_len.max(1).min(total);
    if start != 0 || end != expect_end {
        return Err(Attempt::Final(
            ErrorKind::Io,
            format!(
                "asked for bytes 0-{}, the server answered bytes {start}-{} of {total}",
                want_len.max(1) - 1,
                end.saturating_sub(1)
            ),
        ));
    }
    let pin = version_of(resp.headers(), total);
    let final_url = resp.url().to_string();
    let mut body = bytes::BytesMut::with_capacity(usize::try_from(end).unwrap_or(0));
    while let Some(chunk) = unless_stalled(stall, "bytes of the body", async {
        resp.chunk().await.map_err(transport_error)
    })
    .await?
    {
        if (body.len() + chunk.len()) as u64 > end {
            return Err(Attempt::Final(
                ErrorKind::Io,
                format!("the body is longer than the {end} bytes asked for"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    if body.len() as u64 != end {
        return Err(Attempt::Retry(format!(
            "truncated body: {} of {end} bytes",
            body.len()
        )));
    }
    Ok(RangeResponse {
        body: body.freeze(),
        pin,
        final_url,
    })
}

/// The range a 206 answered: `(start, end exclusive, object size)`.
fn content_range(headers: &HeaderMap) -> Result<(u64, u64, u64), Attempt> {
    headers
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_content_range)
        .ok_or_else(|| {
            Attempt::Final(
                ErrorKind::Io,
                "a 206 response without a valid Content-Range header".into(),
            )
        })
}

/// The version an answer is of: its ETag, the object's size, its
/// Last-Modified (the epoch when absent or unreadable).
fn version_of(headers: &HeaderMap, size: u64) -> Pin {
    let text = |h| headers.get(h).and_then(|v| v.to_str().ok());
    Pin {
        etag: text(ETAG).map(str::to_string),
        size,
        last_modified: text(LAST_MODIFIED)
            .and_then(parse_http_date)
            .unwrap_or(FileTime { secs: 0, nanos: 0 }),
    }
}

/// A status other than 206: 404/403/401 and other 4xx are definite answers;
/// 408, 429 and 5xx are worth retrying.
fn status_error(s: StatusCode) -> Attempt {
    let code = s.as_u16();
    let reason = s.canonical_reason().unwrap_or("");
    match code {
        404 => Attempt::Final(ErrorKind::Io, "HTTP 404: no such object".into()),
        403 => Attempt::Final(
            ErrorKind::Io,
            "HTTP 403: access denied (check the credentials, or whether a presigned URL \
             expired)"
                .into(),
        ),
        401 => Attempt::Final(
            ErrorKind::Io,
            "HTTP 401: not authenticated (check the credentials)".into(),
        ),
        408 | 429 => Attempt::Retry(format!("HTTP {code} {reason}")),
        400..=499 => Attempt::Final(ErrorKind::Io, format!("HTTP {code} {reason}")),
        _ => Attempt::Retry(format!("HTTP {code} {reason}")),
    }
}

/// Timeouts, refused and reset connections, truncated bodies: all worth
/// retrying. The message never holds the URL: reqwest's own error drops it
/// (`without_url`), and the errors under it (hyper's, the socket's) never
/// had it; they say what happened (refused, reset, timed out).
fn transport_error(e: reqwest::Error) -> Attempt {
    let e = e.without_url();
    // A redirect the policy refused says why in its source (see
    // `redirect_policy`): that is the message, and it is final.
    if e.is_redirect() {
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            if let Some(r) = s.downcast_ref::<RedirectRefused>() {
                return Attempt::Final(ErrorKind::Io, r.0.clone());
            }
            src = s.source();
        }
    }
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        let t = s.to_string();
        if !msg.contains(&t) {
            msg = format!("{msg}: {t}");
        }
        src = s.source();
    }
    // A certificate that does not verify will not verify on a retry.
    if msg.contains("certificate") {
        return Attempt::Final(
            ErrorKind::Io,
            format!(
                "{msg} (TLS certificates are always verified: give the CA that signed the \
                 server's certificate with --ca-bundle)"
            ),
        );
    }
    Attempt::Retry(msg)
}

/// `bytes START-END/TOTAL` (END inclusive) as `(START, END + 1, TOTAL)`.
fn parse_content_range(v: &str) -> Option<(u64, u64, u64)> {
    let rest = v.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    let total: u64 = total.trim().parse().ok()?;
    let end = b.checked_add(1)?;
    (a < end && end <= total).then_some((a, end, total))
}

/// An HTTP date (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110's IMF-fixdate,
/// the only form servers are to send) as seconds since the epoch.
fn parse_http_date(v: &str) -> Option<FileTime> {
    let t = chrono::DateTime::parse_from_rfc2822(v.trim()).ok()?;
    Some(FileTime {
        secs: t.timestamp(),
        nanos: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_cut_into_blocks_and_checked_for_length() {
        let mut b = BlockSplitter::new(4, 10);
        for piece in [&b"abc"[..], b"defgh", b"ij"] {
            assert!(b.push(piece).is_ok());
        }
        let blocks = b.finish().ok().unwrap();
        let got: Vec<&[u8]> = blocks.iter().map(|x| &x[..]).collect();
        assert_eq!(got, [&b"abcd"[..], b"efgh", b"ij"]);
        // A body longer than asked: refused outright, never stored.
        let mut b = BlockSplitter::new(4, 5);
        assert!(matches!(b.push(b"abcdef"), Err(Attempt::Final(..))));
        // A short body (the connection closed early): retried.
        let mut b = BlockSplitter::new(4, 10);
        assert!(b.push(b"abcdef").is_ok());
        assert!(matches!(b.finish(), Err(Attempt::Retry(m)) if m.contains("6 of 10")));
    }

    #[test]
    fn content_ranges_and_dates() {
        assert_eq!(
            parse_content_range("bytes 0-1048575/5000000"),
            Some((0, 1 << 20, 5_000_000))
        );
        assert_eq!(parse_content_range("bytes 10-9/100"), None);
        assert_eq!(parse_content_range("bytes 0-100/100"), None);
        assert_eq!(parse_content_range("bytes */100"), None);
        assert_eq!(
            parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").map(|t| t.secs),
            Some(784111777)
        );
        assert!(matches!(
            status_error(StatusCode::SERVICE_UNAVAILABLE),
            Attempt::Retry(_)
        ));
        assert!(matches!(
            status_error(StatusCode::FORBIDDEN),
            Attempt::Final(..)
        ));
    }
}
