//! The request under test: URL parsing, address resolution, and the
//! pre-built request template that every send clones cheaply.

use std::net::{SocketAddr, ToSocketAddrs};

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST};
use hyper::{HeaderMap, Method, Request, Uri};

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
        Some((scheme, _)) => {
            return Err(bad(&format!("scheme {scheme:?} unsupported (http only)")))
        }
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
        let (h, p) = v6
            .split_once(']')
            .ok_or_else(|| bad("unclosed '[' in host"))?;
        let p = p
            .strip_prefix(':')
            .ok_or_else(|| bad("port required (host:port)"))?;
        (h, p)
    } else {
        authority
            .rsplit_once(':')
            .ok_or_else(|| bad("port required (host:port)"))?
    };
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    let port: u16 = port.parse().map_err(|_| bad("invalid port"))?;
    if port == 0 {
        return Err(bad("port 0"));
    }
    let path_and_query = if tail.starts_with('/') {
        tail.to_string()
    } else {
        format!("/{tail}")
    };
    Ok(ParsedUrl {
        authority: authority.to_string(),
        host: host.to_string(),
        port,
        path_and_query,
    })
}

/// Everything a connection task needs to open sockets and build requests.
pub(crate) struct Target {
    pub(crate) addr: SocketAddr,
    /// `host:port`, for messages.
    pub(crate) authority: String,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Target {
    /// Validates the request-shaping part of `cfg` and resolves the host once.
    pub(crate) fn from_config(cfg: &BenchConfig) -> Result<Self, LoadgenError> {
        let url = parse_url(&cfg.url)?;
        let bad_cfg = LoadgenError::BadConfig;
        let method_str = if cfg.method.trim().is_empty() {
            "POST".to_string()
        } else {
            cfg.method.trim().to_ascii_uppercase()
        };
        let method = Method::from_bytes(method_str.as_bytes())
            .map_err(|_| bad_cfg(format!("invalid method {:?}", cfg.method)))?;
        let uri: Uri = url
            .path_and_query
            .parse()
            .map_err(|e| LoadgenError::BadUrl(format!("{:?}: bad path: {e}", cfg.url)))?;
        let mut headers = HeaderMap::new();
        let host = HeaderValue::from_str(&url.authority)
            .map_err(|_| LoadgenError::BadUrl(format!("{:?}: bad host", cfg.url)))?;
        headers.insert(HOST, host);
        if !cfg.content_type.is_empty() {
            let ct = HeaderValue::from_str(&cfg.content_type)
                .map_err(|_| bad_cfg(format!("invalid content_type {:?}", cfg.content_type)))?;
            headers.insert(CONTENT_TYPE, ct);
        }
        for (k, v) in &cfg.headers {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| bad_cfg(format!("invalid header name {k:?}")))?;
            let value = HeaderValue::from_str(v)
                .map_err(|_| bad_cfg(format!("invalid value for header {k:?}")))?;
            headers.append(name, value);
        }
        let addr = (url.host.as_str(), url.port)
            .to_socket_addrs()
            .map_err(|e| LoadgenError::BadUrl(format!("{:?}: cannot resolve host: {e}", cfg.url)))?
            .next()
            .ok_or_else(|| LoadgenError::BadUrl(format!("{:?}: host has no address", cfg.url)))?;
        Ok(Self {
            addr,
            authority: url.authority,
            method,
            uri,
            headers,
            body: Bytes::copy_from_slice(&cfg.body),
        })
    }

    /// A fresh request: the body is a refcounted `Bytes` clone (no copy);
    /// the header map clone is the only per-request allocation here.
    pub(crate) fn request(&self) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        req
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

    #[test]
    fn request_template() {
        let cfg = BenchConfig {
            url: "http://127.0.0.1:1/p?q=1".into(),
            method: "get".into(),
            body: b"{}".to_vec(),
            headers: vec![("x-a".into(), "1".into())],
            ..BenchConfig::default()
        };
        let t = Target::from_config(&cfg).unwrap();
        let r = t.request();
        assert_eq!(r.method(), Method::GET);
        assert_eq!(r.uri(), "/p?q=1");
        assert_eq!(r.headers()["host"], "127.0.0.1:1");
        assert_eq!(r.headers()["content-type"], "application/json");
        assert_eq!(r.headers()["x-a"], "1");

        let bad = BenchConfig {
            headers: vec![("bad header".into(), "1".into())],
            ..cfg
        };
        assert_eq!(
            Target::from_config(&bad).err().unwrap().kind(),
            "bad_config"
        );
    }
}
