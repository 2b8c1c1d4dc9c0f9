//! The request under test: URL parsing, validation, address resolution, and
//! the request serialized once into the exact bytes every send writes.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::{BenchConfig, LoadgenError};

/// `http://host:port/path?query`, split into what a connection needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParsedUrl {
    /// `host:port` exactly as written (used for the Host header).
    pub(crate) authority: String,
    pub(crate) host: String,
    pub(crate) port: u16,
    /// Origin-form request target, at least `/`.
    pub(crate) path_and_query: String,
}

/// Parses an `http://host:port[/path][?query]` URL. HTTPS, userinfo, a
/// missing port and fragments are rejected with `bad_url`.
pub(crate) fn parse_url(url: &str) -> Result<ParsedUrl, LoadgenError> {
    let bad = |why: &str| LoadgenError::BadUrl(format!("{url:?}: {why}"));
    let url = url.trim();
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some((scheme, _)) => return Err(bad(&format!("scheme {scheme:?} unsupported (http only)"))),
        None => return Err(bad("expected http://host:port/path")),
    };
    if rest.contains('#') {
        return Err(bad("fragments are not allowed"));
    }
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(split);
    if authority.contains('@') {
        return Err(bad("userinfo is not supported"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, p) = v6.split_once(']').ok_or_else(|| bad("unclosed '[' in host"))?;
        let p = p.strip_prefix(':').ok_or_else(|| bad("port required (host:port)"))?;
        (h, p)
    } else {
        authority.rsplit_once(':').ok_or_else(|| bad("port required (host:port)"))?
    };
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    let port: u16 = port.parse().map_err(|_| bad("invalid port"))?;
    if port == 0 {
        return Err(bad("port 0"));
    }
    let path_and_query = if tail.starts_with('/') { tail.to_string() } else { format!("/{tail}") };
    Ok(ParsedUrl { authority: authority.to_string(), host: host.to_string(), port, path_and_query })
}

/// RFC 9110 token (method, header name).
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Header value without CR, LF or other control characters (HTAB allowed).
fn is_field_value(s: &str) -> bool {
    s.bytes().all(|b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// Everything a connection task needs to open sockets and send requests.
pub(crate) struct Target {
    pub(crate) addr: SocketAddr,
    /// `host:port`, for messages.
    pub(crate) authority: String,
    /// The complete serialized requests (head and body), written as is:
    /// arrival `i` sends `requests[i % len]` (one unless a body mix was given).
    pub(crate) requests: Vec<Box<[u8]>>,
    /// A HEAD request: responses carry no body whatever they announce.
    pub(crate) head_request: bool,
}

impl Target {
    /// The request arrival `seq` sends.
    pub(crate) fn request(&self, seq: u64) -> &[u8] {
        &self.requests[(seq % self.requests.len() as u64) as usize]
    }

    /// Validates the request-shaping part of `cfg` and resolves the host once.
    pub(crate) fn from_config(cfg: &BenchConfig) -> Result<Self, LoadgenError> {
        let url = parse_url(&cfg.url)?;
        let bad_cfg = LoadgenError::BadConfig;
        let method =
            if cfg.method.trim().is_empty() { "POST".to_string() } else { cfg.method.trim().to_ascii_uppercase() };
        if !is_token(&method) {
            return Err(bad_cfg(format!("invalid method {:?}", cfg.method)));
        }
        if !url.path_and_query.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(LoadgenError::BadUrl(format!("{:?}: path must be percent-encoded visible ASCII", cfg.url)));
        }
        if !is_field_value(&cfg.content_type) {
            return Err(bad_cfg(format!("invalid content_type {:?}", cfg.content_type)));
        }
        let mut user_host = false;
        let mut extra = String::new();
        for (k, v) in &cfg.headers {
            if !is_token(k) {
                return Err(bad_cfg(format!("invalid header name {k:?}")));
            }
            if !is_field_value(v) {
                return Err(bad_cfg(format!("invalid value for header {k:?}")));
            }
            if k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("transfer-encoding") {
                return Err(bad_cfg(format!("header {k:?} is set by the generator")));
            }
            if k.eq_ignore_ascii_case("content-type") && !cfg.content_type.is_empty() {
                return Err(bad_cfg("content-type given twice (headers and content_type)".into()));
            }
            user_host |= k.eq_ignore_ascii_case("host");
            extra.push_str(&format!("{k}: {}\r\n", v.trim()));
        }
        let mut head = format!("{method} {} HTTP/1.1\r\n", url.path_and_query);
        if !user_host {
            head.push_str(&format!("host: {}\r\n", url.authority));
        }
        if !cfg.content_type.is_empty() {
            head.push_str(&format!("content-type: {}\r\n", cfg.content_type));
        }
        head.push_str(&extra);
        let no_body_method = matches!(method.as_str(), "GET" | "HEAD" | "DELETE" | "OPTIONS" | "TRACE");
        let bodies: Vec<&[u8]> =
            if cfg.bodies.is_empty() { vec![&cfg.body] } else { cfg.bodies.iter().map(Vec::as_slice).collect() };
        let requests = bodies
            .into_iter()
            .map(|body| {
                let mut request = head.clone();
                if !body.is_empty() || !no_body_method {
                    request.push_str(&format!("content-length: {}\r\n", body.len()));
                }
                request.push_str("\r\n");
                let mut request = request.into_bytes();
                request.extend_from_slice(body);
                request.into_boxed_slice()
            })
            .collect();

        let addr = (url.host.as_str(), url.port)
            .to_socket_addrs()
            .map_err(|e| LoadgenError::BadUrl(format!("{:?}: cannot resolve host: {e}", cfg.url)))?
            .next()
            .ok_or_else(|| LoadgenError::BadUrl(format!("{:?}: host has no address", cfg.url)))?;
        Ok(Self { addr, authority: url.authority, requests, head_request: method == "HEAD" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_typical_urls() {
        let u = parse_url("http://127.0.0.1:8000/v1/pipelines/demo/infer").unwrap();
        assert_eq!(u.authority, "127.0.0.1:8000");
        assert_eq!(u.host, "127.0.0.1");
        assert_eq!(u.port, 8000);
        assert_eq!(u.path_and_query, "/v1/pipelines/demo/infer");

        let u = parse_url("HTTP://localhost:9100").unwrap();
        assert_eq!(u.path_and_query, "/");
        let u = parse_url("http://localhost:9100?x=1").unwrap();
        assert_eq!(u.path_and_query, "/?x=1");
        let u = parse_url("http://[::1]:80/a?b").unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.authority, "[::1]:80");
        assert_eq!(u.path_and_query, "/a?b");
    }

    #[test]
    fn rejects_bad_urls() {
        for bad in [
            "https://127.0.0.1:8000/",
            "127.0.0.1:8000/x",
            "http://127.0.0.1/x",
            "http://127.0.0.1:/x",
            "http://127.0.0.1:99999/x",
            "http://:80/x",
            "http://u@h:80/",
            "http://h:80/#frag",
            "http://[::1/x",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert_eq!(e.kind(), "bad_url", "{bad}");
        }
    }

    fn serialized(cfg: &BenchConfig) -> String {
        String::from_utf8(Target::from_config(cfg).unwrap().request(0).to_vec()).unwrap()
    }

    #[test]
    fn request_bytes() {
        let cfg = BenchConfig {
            url: "http://127.0.0.1:1/p?q=1".into(),
            body: b"{}".to_vec(),
            headers: vec![("x-a".into(), " 1 ".into())],
            ..BenchConfig::default()
        };
        assert_eq!(
            serialized(&cfg),
            "POST /p?q=1 HTTP/1.1\r\nhost: 127.0.0.1:1\r\ncontent-type: application/json\r\n\
             x-a: 1\r\ncontent-length: 2\r\n\r\n{}"
        );
        let get = BenchConfig {
            method: "get".into(),
            body: vec![],
            content_type: String::new(),
            headers: vec![("Host".into(), "example".into())],
            ..cfg.clone()
        };
        assert_eq!(serialized(&get), "GET /p?q=1 HTTP/1.1\r\nHost: example\r\n\r\n");
        let head = BenchConfig { method: "HEAD".into(), ..get.clone() };
        assert!(Target::from_config(&head).unwrap().head_request);
        let empty_post = BenchConfig { body: vec![], ..cfg.clone() };
        assert!(serialized(&empty_post).ends_with("content-length: 0\r\n\r\n"));

        for bad in [
            BenchConfig { headers: vec![("bad header".into(), "1".into())], ..cfg.clone() },
            BenchConfig { headers: vec![("x".into(), "a\r\nb".into())], ..cfg.clone() },
            BenchConfig { headers: vec![("Content-Length".into(), "3".into())], ..cfg.clone() },
            BenchConfig { headers: vec![("content-type".into(), "a/b".into())], ..cfg.clone() },
            BenchConfig { method: "PO ST".into(), ..cfg.clone() },
        ] {
            assert_eq!(Target::from_config(&bad).err().unwrap().kind(), "bad_config", "{bad:?}");
        }
        let spacey = BenchConfig { url: "http://h:1/a b".into(), ..cfg };
        assert_eq!(Target::from_config(&spacey).err().unwrap().kind(), "bad_url");
    }

    #[test]
    fn a_body_mix_is_sent_in_turn() {
        let cfg = BenchConfig {
            url: "http://127.0.0.1:1/p".into(),
            body: b"unused".to_vec(),
            bodies: vec![b"a".to_vec(), b"bcd".to_vec()],
            ..BenchConfig::default()
        };
        let t = Target::from_config(&cfg).unwrap();
        let sent: Vec<String> = (0..3).map(|i| String::from_utf8(t.request(i).to_vec()).unwrap()).collect();
        assert!(sent[0].ends_with("content-length: 1\r\n\r\na"), "{}", sent[0]);
        assert!(sent[1].ends_with("content-length: 3\r\n\r\nbcd"), "{}", sent[1]);
        assert_eq!(sent[2], sent[0]);
    }
}
