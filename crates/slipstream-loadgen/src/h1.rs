//! A minimal HTTP/1.1 client connection, just enough for a load generator.
//!
//! The request is identical every time, so it is serialized once (see
//! `target.rs`) and each exchange is one `write` of those bytes plus the reads
//! of the response into a per-connection buffer that is reused forever: no
//! allocation, no header map, no channels per request. The response head is
//! parsed with `httparse`; the body is skipped, never copied, with framing
//! per RFC 9112 §6.3 (Content-Length, chunked, or until close; none for
//! HEAD, 1xx, 204 and 304). Anything the generator does not need (pipelining,
//! upgrades, trailers' contents) is rejected or ignored.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Initial per-connection read buffer.
const INIT_BUF: usize = 8 * 1024;
/// Largest response head (or chunk-size line) accepted.
const MAX_HEAD: usize = 64 * 1024;
/// Most response headers accepted.
const MAX_HEADERS: usize = 64;

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// What an exchange tells the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    /// Whether the connection may carry another request.
    pub(crate) keep_alive: bool,
    /// How long the server asked the client to wait before it retries, ms
    /// (`x-slipstream-retry-after-ms`, else `Retry-After` in seconds).
    pub(crate) retry_after_ms: Option<u64>,
}

/// How the response body is delimited, and how much of it is left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Empty,
    Length(u64),
    Chunked(Chunk),
    UntilEof,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chunk {
    /// Expecting a `hex-size[;ext]\r\n` line.
    Size,
    /// Inside chunk data, this many bytes left.
    Data(u64),
    /// Expecting the CRLF after chunk data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty line.
    Trailers,
}

/// A parsed response head.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    status: u16,
    /// Bytes of the head, including the blank line.
    len: usize,
    body: Body,
    keep_alive: bool,
    retry_after_ms: Option<u64>,
}

fn has_token(value: &[u8], token: &str) -> bool {
    value.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Parses a response head at the start of `buf`; `Ok(None)` if incomplete.
fn parse_head(buf: &[u8], head_request: bool) -> io::Result<Option<Head>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(bad(&format!("malformed response head: {e}"))),
    };
    let status = resp.code.unwrap_or(0);
    let http11 = resp.version == Some(1);
    let mut keep_alive = http11;
    let mut length: Option<u64> = None;
    let mut transfer_encoding: Option<bool> = None; // Some(ends with chunked)
    let (mut after_ms, mut after_s) = (None, None);
    let number = |v: &[u8]| std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<u64>().ok());
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("x-slipstream-retry-after-ms") {
            after_ms = number(h.value);
        } else if h.name.eq_ignore_ascii_case("retry-after") {
            after_s = number(h.value);
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| bad("invalid content-length"))?;
            if length.is_some_and(|l| l != v) {
                return Err(bad("conflicting content-length"));
            }
            length = Some(v);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let last = h.value.rsplit(|&b| b == b',').next().unwrap_or_default();
            transfer_encoding = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if h.name.eq_ignore_ascii_case("connection") {
            if has_token(h.value, "close") {
                keep_alive = false;
            } else if !http11 && has_token(h.value, "keep-alive") {
                keep_alive = true;
            }
        }
    }
    let body = if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
        Body::Empty
    } else if let Some(chunked) = transfer_encoding {
        if chunked {
            Body::Chunked(Chunk::Size)
        } else {
            Body::UntilEof
        }
    } else {
        match length {
            Some(0) => Body::Empty,
            Some(n) => Body::Length(n),
            None => Body::UntilEof,
        }
    };
    if body == Body::UntilEof {
        keep_alive = false;
    }
    let retry_after_ms = after_ms.or(after_s.map(|s| s.saturating_mul(1000)));
    Ok(Some(Head { status, len, body, keep_alive, retry_after_ms }))
}

impl Body {
    /// Consumes as much of `data` as belongs to the body. Returns the bytes
    /// consumed and whether the body is complete.
    fn advance(&mut self, data: &[u8]) -> io::Result<(usize, bool)> {
        match self {
            Body::Empty => Ok((0, true)),
            Body::UntilEof => Ok((data.len(), false)),
            Body::Length(left) => {
                let take = (*left).min(data.len() as u64);
                *left -= take;
                Ok((take as usize, *left == 0))
            }
            Body::Chunked(state) => advance_chunked(state, data),
        }
    }
}

fn advance_chunked(state: &mut Chunk, data: &[u8]) -> io::Result<(usize, bool)> {
    let mut pos = 0;
    loop {
        let rest = &data[pos..];
        match *state {
            Chunk::Size | Chunk::Trailers => {
                let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
                    if rest.len() > MAX_HEAD {
                        return Err(bad("chunk line too long"));
                    }
                    return Ok((pos, false));
                };
                let line = rest[..nl].strip_suffix(b"\r").unwrap_or(&rest[..nl]);
                pos += nl + 1;
                if *state == Chunk::Trailers {
                    if line.is_empty() {
                        return Ok((pos, true));
                    }
                    continue;
                }
                let hex = line.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
                let size = std::str::from_utf8(hex)
                    .ok()
                    .filter(|h| !h.is_empty() && h.len() <= 16)
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    .ok_or_else(|| bad("invalid chunk size"))?;
                *state = if size == 0 { Chunk::Trailers } else { Chunk::Data(size) };
            }
            Chunk::Data(left) => {
                let take = left.min(rest.len() as u64);
                pos += take as usize;
                *state = if take == left { Chunk::DataEnd } else { Chunk::Data(left - take) };
                if *state != Chunk::DataEnd {
                    return Ok((pos, false));
                }
            }
            Chunk::DataEnd => match rest {
                [] | [b'\r'] => return Ok((pos, false)),
                [b'\r', b'\n', ..] => {
                    pos += 2;
                    *state = Chunk::Size;
                }
                [b'\n', ..] => {
                    pos += 1;
                    *state = Chunk::Size;
                }
                _ => return Err(bad("missing CRLF after chunk data")),
            },
        }
    }
}

/// One keep-alive connection.
pub(crate) struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream) -> Self {
        // Best effort: a failure only costs latency, never correctness.
        let _ = stream.set_nodelay(true);
        Self { stream, buf: vec![0; INIT_BUF], start: 0, end: 0 }
    }

    /// Reads more bytes after `buf[start..end]`; returns 0 at EOF.
    async fn fill(&mut self) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.end == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            } else if self.buf.len() < MAX_HEAD {
                let len = (self.buf.len() * 2).min(MAX_HEAD);
                self.buf.resize(len, 0);
            } else {
                return Err(bad("response head too large"));
            }
        }
        let n = self.stream.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n)
    }

    /// Sends `request` (complete serialized bytes) and reads the whole
    /// response. Skips 1xx responses. Errors are transport/protocol failures.
    pub(crate) async fn exchange(&mut self, request: &[u8], head_request: bool) -> io::Result<Reply> {
        self.stream.write_all(request).await?;
        loop {
            let head = loop {
                if let Some(head) = parse_head(&self.buf[self.start..self.end], head_request)? {
                    break head;
                }
                if self.fill().await? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            };
            self.start += head.len;
            if (100..200).contains(&head.status) {
                if head.status == 101 {
                    return Err(bad("unexpected protocol upgrade"));
                }
                continue;
            }
            let mut body = head.body;
            let mut keep_alive = head.keep_alive;
            loop {
                let (used, done) = body.advance(&self.buf[self.start..self.end])?;
                self.start += used;
                if done {
                    break;
                }
                if self.fill().await? == 0 {
                    if body == Body::UntilEof {
                        break;
                    }
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            if self.start != self.end {
                // Bytes nobody asked for: the stream can no longer be trusted.
                keep_alive = false;
            }
            self.start = 0;
            self.end = 0;
            return Ok(Reply { status: head.status, keep_alive, retry_after_ms: head.retry_after_ms });
        }
    }

    /// Resolves once the idle connection is unusable: the server closed it,
    /// reset it, or sent bytes nobody asked for. Pending otherwise.
    pub(crate) async fn closed_while_idle(&self) {
        loop {
            if self.stream.readable().await.is_err() {
                return;
            }
            let mut probe = [0u8; 1];
            match self.stream.try_read(&mut probe) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                _ => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(s: &str) -> Head {
        parse_head(s.as_bytes(), false).unwrap().unwrap()
    }

    #[test]
    fn framing_rules() {
        let h = head("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
        assert_eq!((h.status, h.body, h.keep_alive, h.len), (200, Body::Length(5), true, 38));
        let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n");
        assert_eq!(h.body, Body::Chunked(Chunk::Size));
        let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n");
        assert_eq!((h.body, h.keep_alive), (Body::UntilEof, false));
        let h = head("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((h.body, h.keep_alive), (Body::UntilEof, false));
        let h = head("HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: keep-alive, Close\r\n\r\n");
        assert_eq!((h.status, h.body, h.keep_alive), (503, Body::Empty, false));
        let h = head("HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\n");
        assert_eq!(h.body, Body::Empty);
        let h = head("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n");
        assert!(!h.keep_alive);
        let h = head("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n");
        assert!(h.keep_alive);
        let h = head("HTTP/1.1 429 Busy\r\nRetry-After: 2\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(h.retry_after_ms, Some(2000));
        let h =
            head("HTTP/1.1 429 Busy\r\nretry-after: 1\r\nX-Slipstream-Retry-After-Ms: 7\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(h.retry_after_ms, Some(7), "the millisecond header is the finer one");
        assert_eq!(head("HTTP/1.1 429 Busy\r\nRetry-After: soon\r\n\r\n").retry_after_ms, None);
        let h = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true).unwrap().unwrap();
        assert_eq!(h.body, Body::Empty);
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Len", false).unwrap().is_none());
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", false).is_err());
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", false).is_err());
        assert!(parse_head(b"garbage\r\n\r\n", false).is_err());
    }

    /// Feeds `data` in pieces of `step` bytes, as reads would deliver it.
    fn feed(mut body: Body, data: &[u8], step: usize) -> io::Result<usize> {
        let mut buf: Vec<u8> = Vec::new();
        let mut consumed = 0;
        for piece in data.chunks(step) {
            buf.extend_from_slice(piece);
            let (used, done) = body.advance(&buf)?;
            buf.drain(..used);
            consumed += used;
            if done {
                return Ok(consumed);
            }
        }
        Err(io::ErrorKind::UnexpectedEof.into())
    }

    #[test]
    fn chunked_bodies_at_every_split() {
        let body = b"5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-Trailer: 1\r\n\r\n";
        for step in 1..=body.len() {
            let n = feed(Body::Chunked(Chunk::Size), body, step).unwrap();
            assert_eq!(n, body.len(), "step {step}");
        }
        // Bare LF line endings are tolerated.
        let lf = b"3\nabc\n0\n\n";
        assert_eq!(feed(Body::Chunked(Chunk::Size), lf, 1).unwrap(), lf.len());
        // Nothing past the end is consumed.
        let mut extra = body.to_vec();
        extra.extend_from_slice(b"HTTP/1.1");
        assert_eq!(feed(Body::Chunked(Chunk::Size), &extra, extra.len()).unwrap(), body.len());
        assert!(feed(Body::Chunked(Chunk::Size), b"zz\r\n", 4).is_err());
        assert!(feed(Body::Chunked(Chunk::Size), b"3\r\nabcX\r\n", 9).is_err());
    }

    #[test]
    fn length_bodies() {
        assert_eq!(feed(Body::Length(10), b"0123456789tail", 3).unwrap(), 10);
        assert!(feed(Body::Length(10), b"012", 1).is_err());
    }

    /// Serves one scripted byte stream per connection, then closes.
    async fn scripted(response: &'static [u8]) -> Conn {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            // Dribble the response to exercise partial reads.
            for piece in response.chunks(7) {
                s.write_all(piece).await.unwrap();
                s.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            // Hold the socket open briefly so keep-alive responses are not EOF-terminated.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        });
        Conn::new(TcpStream::connect(addr).await.unwrap())
    }

    #[test]
    fn exchanges_over_a_socket() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let req = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
            let mut c =
                scripted(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc").await;
            let r = c.exchange(req, false).await.unwrap();
            assert_eq!(r, Reply { status: 201, keep_alive: true, retry_after_ms: None });

            let mut c = scripted(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwiki\r\n0\r\n\r\n").await;
            assert_eq!(c.exchange(req, false).await.unwrap().status, 200);

            let mut c = scripted(b"HTTP/1.1 200 OK\r\n\r\nuntil the end").await;
            let r = c.exchange(req, false).await.unwrap();
            assert_eq!(r, Reply { status: 200, keep_alive: false, retry_after_ms: None });

            let mut c = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort").await;
            assert!(c.exchange(req, false).await.is_err());

            let mut c = scripted(b"").await;
            let e = c.exchange(req, false).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);

            let mut c = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nEXTRA").await;
            assert!(!c.exchange(req, false).await.unwrap().keep_alive);

            // The server closes after answering: the idle watch notices.
            let mut c = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await;
            assert!(c.exchange(req, false).await.unwrap().keep_alive);
            tokio::time::timeout(std::time::Duration::from_secs(5), c.closed_while_idle())
                .await
                .expect("close noticed");
        });
    }
}
