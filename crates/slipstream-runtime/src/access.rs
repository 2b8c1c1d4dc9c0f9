//! Who may call what at the edge: two bearer tokens.
//!
//! - The **admin token** guards the routes that change the node (scale,
//!   reset-metrics, store writes and triggers). Without one, those routes
//!   are open on a loopback listener and refused on any other.
//! - The **API token**, when set, guards the routes that run work or read
//!   data: inference over HTTP (`/v1/.../infer`, `stream`, `feedback`,
//!   `/v2/models/.../infer`, `infer_stream`) and gRPC (`ModelInfer`,
//!   `ModelStreamInfer`), and the store's reads. The admin token passes
//!   there too. Probes, `/metrics`, the status, the dashboard and the
//!   pipelines' descriptions stay open: orchestrators and scrapers call
//!   them without credentials.
//!
//! Tokens travel as `Authorization: Bearer <token>` (gRPC: the
//! `authorization` metadata) and are compared in constant time.

use slipstream_core::NodeError;

/// The edge's tokens (empty ones are none).
#[derive(Clone, Debug, Default)]
pub struct Access {
    admin: Option<String>,
    api: Option<String>,
}

impl Access {
    pub fn new(admin: Option<String>, api: Option<String>) -> Access {
        let set = |t: Option<String>| t.filter(|t| !t.is_empty());
        Access { admin: set(admin), api: set(api) }
    }

    /// The admin token, if the node has one.
    pub fn admin_token(&self) -> Option<&str> {
        self.admin.as_deref()
    }

    /// The token a worker of this node reads the store with: the admin
    /// token (its writes need it), else the API token.
    pub fn worker_token(&self) -> Option<&str> {
        self.admin.as_deref().or(self.api.as_deref())
    }

    /// Whether an admin route may run. `admin_open`: the listener is on
    /// loopback; `host`: what it binds (for the message); `given`: the
    /// value of the request's `Authorization` header.
    pub fn admin(&self, admin_open: bool, host: &str, given: Option<&str>) -> Result<(), NodeError> {
        let Some(token) = self.admin.as_deref() else {
            return if admin_open {
                Ok(())
            } else {
                Err(NodeError::Forbidden(format!(
                    "admin routes are disabled: the node listens on {host} without an admin token \
                     (start it with --admin-token or SLIPSTREAM_ADMIN_TOKEN)"
                )))
            };
        };
        match bearer(given) {
            Some(g) if same(g, token) => Ok(()),
            Some(_) => Err(NodeError::Unauthorized("wrong admin token".into())),
            None => Err(NodeError::Unauthorized("admin routes need 'Authorization: Bearer <admin token>'".into())),
        }
    }

    /// Whether a route that runs work or reads data may run (see the module
    /// docs): always without an API token; else with it or the admin token.
    pub fn api(&self, given: Option<&str>) -> Result<(), NodeError> {
        let Some(token) = self.api.as_deref() else { return Ok(()) };
        match bearer(given) {
            Some(g) if same(g, token) || self.admin.as_deref().is_some_and(|a| same(g, a)) => Ok(()),
            Some(_) => Err(NodeError::Unauthorized("wrong API token".into())),
            None => Err(NodeError::Unauthorized(
                "this node needs 'Authorization: Bearer <API token>' (the client's token=, $SLIPSTREAM_API_TOKEN)"
                    .into(),
            )),
        }
    }
}

/// The token of an `Authorization: Bearer <token>` value.
fn bearer(value: Option<&str>) -> Option<&str> {
    value.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim)
}

/// Compare without an early exit, so timing does not reveal a prefix.
fn same(given: &str, token: &str) -> bool {
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(r: Result<(), NodeError>) -> u16 {
        r.map_or_else(|e| e.http_status(), |()| 200)
    }

    #[test]
    fn without_an_api_token_work_is_open_and_admin_follows_the_listener() {
        let a = Access::new(None, Some(String::new()));
        assert_eq!(status(a.api(None)), 200);
        assert_eq!(status(a.admin(true, "127.0.0.1", None)), 200);
        assert_eq!(status(a.admin(false, "0.0.0.0", None)), 403);
        assert_eq!(a.worker_token(), None);
    }

    #[test]
    fn the_api_token_or_the_admin_token_runs_work_and_only_the_admin_token_administers() {
        let a = Access::new(Some("adm".into()), Some("api".into()));
        assert_eq!(status(a.api(None)), 401);
        assert_eq!(status(a.api(Some("Bearer nope"))), 401);
        assert_eq!(status(a.api(Some("api"))), 401, "not a bearer value");
        assert_eq!(status(a.api(Some("Bearer api"))), 200);
        assert_eq!(status(a.api(Some("Bearer adm "))), 200);
        assert_eq!(status(a.admin(true, "127.0.0.1", Some("Bearer api"))), 401);
        assert_eq!(status(a.admin(false, "0.0.0.0", Some("Bearer adm"))), 200);
        assert_eq!(a.worker_token(), Some("adm"));
        assert_eq!(Access::new(None, Some("api".into())).worker_token(), Some("api"));
    }
}
