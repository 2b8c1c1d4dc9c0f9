//! What the edge serves from, and the settings of a whole node.
//!
//! [`App`] holds handles, not internals: the node (the request path and
//! its reports) and the features that have routes of their own (feedback
//! on selections, the store's trigger route, the dashboard's history).
//! [`RunOptions`] are the checked settings of everything a node runs: the
//! core's, the edge's listeners, the cluster's; features with settings of
//! their own read them from the app's spec.

use crate::access::Access;
use crate::pacing::RefusalPacer;
use hyper::body::Incoming;
use hyper::header::AUTHORIZATION;
use slipstream_cluster::ClusterOptions;
use slipstream_core::config::seconds;
use slipstream_core::{Node, NodeConfig, NodeError, NodeOptions};
use slipstream_history::History;
use slipstream_select::Selections;
use slipstream_triggers::Triggers;
use std::sync::Arc;
use std::time::Duration;

/// The edge's settings: listeners, body limits, the admin token.
#[derive(Clone, Debug)]
pub struct EdgeOptions {
    /// The address the listeners bind.
    pub host: String,
    /// The HTTP port (0: any free port).
    pub port: u16,
    /// Serve the Open Inference Protocol over gRPC on the HTTP port too
    /// (a connection that opens with HTTP/2's preface is gRPC's).
    pub grpc: bool,
    /// A listener of gRPC's own on this port (0: any free port).
    pub grpc_port: Option<u16>,
    /// Tokio worker threads for the node.
    pub threads: usize,
    /// The largest request body (and gRPC message).
    pub max_body_bytes: usize,
    /// How long a graceful stop waits for requests in flight.
    pub drain_timeout: Duration,
    /// Held refusals answered a second (see [`crate::pacing`]).
    pub refusal_rate: u32,
    /// The admin and API tokens (see [`crate::access`]).
    pub access: Access,
    /// TLS on the HTTP and gRPC ports (see [`crate::conn`]).
    pub tls: Option<slipstream_tls::IngressTls>,
}

/// How the node logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Nothing (embedded nodes, tests).
    Off,
    /// Human-readable lines on stderr.
    Text,
    /// One JSON object per line on stderr.
    Json,
}

/// Everything a node runs with, checked.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The core's settings.
    pub node: NodeOptions,
    /// The edge's.
    pub edge: EdgeOptions,
    /// Join a cluster on etcd (`docs/design/cluster.md`); None: one machine.
    pub cluster: Option<ClusterOptions>,
    /// How it logs.
    pub log: LogFormat,
}

impl RunOptions {
    /// Check `cfg` and build the options (no cluster; logging as `cfg` says).
    pub fn from_config(cfg: &NodeConfig) -> Result<RunOptions, String> {
        cfg.check()?;
        let log = match cfg.log_format.as_str() {
            "json" => LogFormat::Json,
            _ => LogFormat::Text,
        };
        Ok(RunOptions {
            node: cfg.node_options()?,
            edge: EdgeOptions {
                host: cfg.host.clone(),
                port: cfg.http_port(),
                grpc: cfg.grpc,
                grpc_port: cfg.grpc_port(),
                threads: cfg.node_threads,
                max_body_bytes: cfg.max_body_bytes()?,
                drain_timeout: seconds("drain_timeout_s", cfg.drain_timeout_s)?,
                access: Access::new(cfg.admin_token.clone(), cfg.api_token.clone()),
                tls: match cfg.ingress_tls.as_deref().filter(|d| !d.is_empty()) {
                    Some(dir) => Some(
                        slipstream_tls::IngressTls::load(std::path::Path::new(dir), cfg.grpc)
                            .map_err(|e| format!("ingress_tls: {e}"))?,
                    ),
                    None => None,
                },
                refusal_rate: u32::try_from(cfg.refusal_rate)
                    .map_err(|_| format!("refusal_rate is too large: {}", cfg.refusal_rate))?,
            },
            cluster: None,
            log,
        })
    }
}

impl Default for RunOptions {
    /// The defaults of [`NodeConfig`], where each is declared.
    fn default() -> Self {
        RunOptions::from_config(&NodeConfig::default()).expect("the default configuration is valid")
    }
}

/// What the edge serves from (see the module docs).
pub(crate) struct App {
    pub(crate) node: Arc<Node>,
    pub(crate) edge: EdgeOptions,
    pub(crate) selections: Arc<Selections>,
    pub(crate) triggers: Arc<Triggers>,
    pub(crate) history: Arc<History>,
    /// Refusals to clients that ignore `Retry-After` wait their turn.
    pub(crate) pacer: Arc<RefusalPacer>,
    /// The cluster this node joined, if any (feedback on another node's
    /// answers goes to that node through it).
    pub(crate) cluster: std::sync::OnceLock<Arc<slipstream_cluster::Cluster>>,
}

impl App {
    /// An admin route may run (see [`crate::access`]). `admin_open`: the
    /// listener is on loopback.
    pub(crate) fn authorise_admin(&self, admin_open: bool, req: &hyper::Request<Incoming>) -> Result<(), NodeError> {
        self.edge.access.admin(admin_open, &self.edge.host, authorization(req))
    }

    /// A route that runs work or reads data may run (see [`crate::access`]).
    pub(crate) fn authorise_api(&self, req: &hyper::Request<Incoming>) -> Result<(), NodeError> {
        self.edge.access.api(authorization(req))
    }
}

/// The request's `Authorization` header, if it is text.
fn authorization(req: &hyper::Request<Incoming>) -> Option<&str> {
    req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_become_options() {
        let o = RunOptions::default();
        assert_eq!((o.edge.port, o.edge.grpc_port, o.edge.max_body_bytes), (8000, Some(8001), 64 << 20));
        assert_eq!(o.edge.drain_timeout, Duration::from_secs(30));
        assert!(o.edge.access.admin_token().is_none() && o.cluster.is_none());
        assert_eq!(o.log, LogFormat::Text);
        let c = NodeConfig { log_format: "json".into(), admin_token: Some(String::new()), ..Default::default() };
        let o = RunOptions::from_config(&c).unwrap();
        assert_eq!((o.log, o.edge.access.admin_token()), (LogFormat::Json, None));
        let bad = NodeConfig { drain_timeout_s: -1.0, ..Default::default() };
        assert!(RunOptions::from_config(&bad).unwrap_err().contains("drain_timeout_s"));
    }
}
