//! The node's settings, each declared once.
//!
//! Every setting is one line of the [`settings!`] table below: its name,
//! type, default and (from its doc comment) its help text. Everything else
//! is derived from that table:
//!
//! - [`NodeConfig`], the typed configuration, with `Default`;
//! - [`settings()`], the table as data: the Python front end builds its
//!   flags (`--request-timeout-s`), environment variables
//!   (`SLIPSTREAM_REQUEST_TIMEOUT_S`) and TOML keys from it, and layers them
//!   (defaults < `--config FILE` < environment < flags; see
//!   `python/slipstream/_internal/config.py`, and `slipstream config` prints
//!   the effective values with where each came from);
//! - [`NodeConfig::check`], the one place values are checked, and
//!   [`NodeConfig::node_options`], the core's [`NodeOptions`] (the edge
//!   takes its listeners' settings from the same [`NodeConfig`]).
//!
//! Settings that shape an app's spec (batching, autoscaling) live here too
//! so that they have one default; the front end writes them into the spec,
//! where a cluster deployment carries them to every node.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

/// One row of the settings table, for the front end.
#[derive(Serialize, Debug, Clone)]
pub struct Setting {
    /// The setting's name (its TOML key; the flag and environment variable derive from it).
    pub name: &'static str,
    /// `str`, `int`, `float`, `bool`, or `choice`; `optional` says whether
    /// the setting may be left unset (no default value).
    pub kind: &'static str,
    /// Whether it may be left unset.
    pub optional: bool,
    /// The values a `choice` takes.
    pub choices: &'static [&'static str],
    /// Its default.
    pub default: Value,
    /// What it does.
    pub help: String,
    /// The command-line flag when it differs from `--name-with-dashes`
    /// (kept for flags that predate the table).
    pub flag: Option<&'static str>,
    /// `node` (how this node runs) or `spec` (how the app is scheduled:
    /// written into the app's spec, which `slipstream deploy` takes to
    /// every node of a cluster).
    pub scope: &'static str,
}

trait Kind {
    const KIND: &'static str;
    const OPTIONAL: bool = false;
}
impl Kind for String {
    const KIND: &'static str = "str";
}
impl Kind for u16 {
    const KIND: &'static str = "int";
}
impl Kind for u64 {
    const KIND: &'static str = "int";
}
impl Kind for usize {
    const KIND: &'static str = "int";
}
impl Kind for f64 {
    const KIND: &'static str = "float";
}
impl Kind for bool {
    const KIND: &'static str = "bool";
}
impl<T: Kind> Kind for Option<T> {
    const KIND: &'static str = T::KIND;
    const OPTIONAL: bool = true;
}

macro_rules! settings {
    ($( $(#[doc = $doc:literal])+ $name:ident : $ty:ty = $default:expr $(, choices = [$($choice:literal),+])? $(, flag = $flag:literal)? $(, scope = $scope:literal)? ;)*) => {
        /// The node's configuration (see the module docs).
        #[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
        #[serde(default, deny_unknown_fields)]
        pub struct NodeConfig {
            $( $(#[doc = $doc])+ pub $name: $ty, )*
        }

        impl Default for NodeConfig {
            fn default() -> Self {
                NodeConfig { $( $name: $default, )* }
            }
        }

        /// The settings table (see the module docs).
        pub fn settings() -> Vec<Setting> {
            let d = NodeConfig::default();
            vec![$({
                let choices: &'static [&'static str] = &[$($($choice),+)?];
                Setting {
                    name: stringify!($name),
                    kind: if choices.is_empty() { <$ty as Kind>::KIND } else { "choice" },
                    optional: <$ty as Kind>::OPTIONAL,
                    choices,
                    default: serde_json::to_value(&d.$name).expect("a setting serialises"),
                    help: help_text(&[$($doc),+]),
                    flag: given(&[$($flag)?]),
                    scope: given(&[$($scope)?]).unwrap_or("node"),
                }
            }),*]
        }
    };
}

/// A macro option's value, if the setting gave it.
fn given(option: &[&'static str]) -> Option<&'static str> {
    option.first().copied()
}

fn help_text(lines: &[&str]) -> String {
    lines.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ")
}

/// The HTTP port when none is set.
pub const DEFAULT_PORT: u16 = 8000;
/// gRPC's own port when neither port is set (Triton's and KServe's layout).
pub const DEFAULT_GRPC_PORT: u16 = 8001;

/// The smallest pool requests are decoded into.
const INGRESS_POOL_BYTES: usize = 1 << 30;

fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get().min(4)).unwrap_or(2)
}

settings! {
    /// Address the HTTP and gRPC listeners bind (a non-loopback address
    /// needs `admin_token` for the admin routes).
    host: String = "127.0.0.1".into();
    /// HTTP port (unset: 8000, with gRPC on 8001 too, Triton's layout; 0:
    /// any free port). gRPC is also served on the HTTP port itself, so
    /// nodes started with `--port` alone never collide.
    port: Option<u16> = None;
    /// Serve the Open Inference Protocol over gRPC too.
    grpc: bool = true;
    /// A port of its own for gRPC (unset: 8001 when `port` is unset, else
    /// none; 0: any free port).
    grpc_port: Option<u16> = None;
    /// The node's own threads (HTTP, scheduling); workers run in their own
    /// processes. (Not `threads`: workers read `SLIPSTREAM_THREADS` as their
    /// stage's thread budget.)
    node_threads: usize = default_threads(), flag = "--threads";
    /// Largest request body, MiB.
    max_body_mb: f64 = 64.0;
    /// Seconds before a request still unanswered is answered 504 and its state released.
    request_timeout_s: f64 = 30.0, flag = "--request-timeout";
    /// Seconds a graceful stop waits for requests in flight.
    drain_timeout_s: f64 = 30.0, flag = "--drain-timeout";
    /// Seconds a worker may take to start (load its models) before start-up fails.
    worker_start_timeout_s: f64 = 300.0, flag = "--worker-start-timeout";
    /// Shared-memory pool per replica, MiB (the ingress pool is at least 1024).
    pool_mb: u64 = 256;
    /// Refusals (429) a second answered to connections that come back
    /// before the `Retry-After` they were given; the rest of those wait
    /// their turn, up to a second (0: answer every refusal at once).
    refusal_rate: u64 = 5000;
    /// Bearer token for the admin routes (scale, reset-metrics, store writes).
    admin_token: Option<String> = None;
    /// Bearer token for inference (HTTP and gRPC), feedback and store
    /// reads (unset: open; the admin token passes too). Probes, metrics
    /// and the status stay open.
    api_token: Option<String> = None;
    /// A directory with tls.crt and tls.key (a Kubernetes TLS Secret's
    /// layout): the HTTP and gRPC ports speak TLS with that certificate
    /// (plain HTTP is then answered only to connections from this machine:
    /// the node's workers, local tools).
    ingress_tls: Option<String> = None;
    /// How the node logs to stderr: human-readable lines, or one JSON object per line.
    log_format: String = "text".into(), choices = ["text", "json"];
    /// The object store's directory, kept across restarts (unset: an
    /// ephemeral store in a temporary directory, deleted at exit).
    store: Option<String> = None;
    /// Largest value the store takes, MiB.
    store_max_value_mb: u64 = 1024;
    /// Batch former: deadline-aware, or fixed max batch + wait (the Triton / Ray Serve policy).
    batching: String = crate::spec::BatchingSpec::default().policy, choices = ["deadline", "fixed"], scope = "spec";
    /// The fixed batching policy's wait for a full batch, ms.
    fixed_wait_ms: f64 = crate::spec::BatchingSpec::default().fixed_wait_ms, scope = "spec";
    /// The deadline-aware policy's longest delayed-batching wait, ms.
    max_wait_ms: f64 = crate::spec::BatchingSpec::default().max_wait_ms, scope = "spec";
    /// Refuse requests at ingress that are predicted to miss their SLO.
    admission: bool = crate::spec::BatchingSpec::default().admission, scope = "spec";
    /// Batch requests of similar length together, for stages that name a
    /// length input (`length_of`); off: by deadline order only.
    batch_by_length: bool = crate::spec::BatchingSpec::default().by_length, scope = "spec";
    /// How stages declared with replicas=(lo, hi) follow the load: warm
    /// standbys on the load trend, a replica only once requests miss, or no change.
    autoscale: String = "anticipatory".into(), choices = ["anticipatory", "reactive", "off"], scope = "spec";
    /// How `serve` sizes the stages whose replicas or threads the app does
    /// not give: planned for this machine from a profile (measured on first
    /// start, then cached), or as declared (1 replica with 1 thread).
    sizing: String = "plan".into(), choices = ["plan", "declared"], scope = "spec";
    /// Cores the replicas may use, for the autoscaler and the plan (unset: the machine's).
    cores: Option<f64> = None, scope = "spec";
    /// Seconds the load must need fewer replicas before the autoscaler retires one.
    scale_down_after_s: f64 = slipstream_sched::scale::ScaleOptions::default().down_after_ns as f64 / 1e9, flag = "--scale-down-after", scope = "spec";
}

fn positive(name: &str, v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{name} must be a positive number, got {v}"))
    }
}

fn mib(name: &str, v: u64) -> Result<usize, String> {
    if v == 0 {
        return Err(format!("{name} must be at least 1"));
    }
    v.checked_mul(1 << 20).and_then(|b| usize::try_from(b).ok()).ok_or_else(|| format!("{name} is too large: {v}"))
}

/// The core's settings (the node's request path, workers and store),
/// checked. Defaults suit one machine.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Longest a request may take before it is answered 504 and its state
    /// (including half-joined fan-in parts) is released.
    pub request_timeout: Duration,
    /// Longest a worker may take to start (load its models).
    pub worker_start_timeout: Duration,
    /// The ingress pool requests are decoded into.
    pub ingress_pool_bytes: usize,
    /// Each replica's own pool.
    pub replica_pool_bytes: usize,
    /// Where the shared-memory pools are created.
    pub shm_dir: PathBuf,
    /// The object store's directory; None: a temporary one, removed at exit.
    pub store_dir: Option<PathBuf>,
    /// The largest value a store put may carry.
    pub store_max_value: u64,
}

impl Default for NodeOptions {
    /// The defaults of [`NodeConfig`], where each is declared.
    fn default() -> Self {
        NodeConfig::default().node_options().expect("the default configuration is valid")
    }
}

/// `v` as a positive number of seconds (Err names the setting).
pub fn seconds(name: &str, v: f64) -> Result<Duration, String> {
    let v = positive(name, v)?;
    Duration::try_from_secs_f64(v).map_err(|_| format!("{name} is too large: {v}"))
}

impl NodeConfig {
    /// Parse a configuration from JSON (the front end's resolved values;
    /// absent keys take their defaults, unknown keys are refused).
    pub fn from_json(s: &str) -> Result<NodeConfig, String> {
        serde_json::from_str(s).map_err(|e| format!("node configuration: {e}"))
    }

    /// Check every value; Err names the first bad one.
    pub fn check(&self) -> Result<(), String> {
        if self.node_threads == 0 {
            return Err("node_threads must be at least 1".into());
        }
        self.max_body_bytes()?;
        for (name, v) in [("fixed_wait_ms", self.fixed_wait_ms), ("max_wait_ms", self.max_wait_ms)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be >= 0, got {v}"));
            }
        }
        if let Some(c) = self.cores {
            positive("cores", c)?;
        }
        if !(self.scale_down_after_s.is_finite() && self.scale_down_after_s >= 0.0) {
            return Err(format!("scale_down_after_s must be >= 0, got {}", self.scale_down_after_s));
        }
        seconds("drain_timeout_s", self.drain_timeout_s)?;
        self.node_options().map(|_| ())
    }

    /// The largest request body, bytes.
    pub fn max_body_bytes(&self) -> Result<usize, String> {
        let max_body = positive("max_body_mb", self.max_body_mb)? * (1u64 << 20) as f64;
        if max_body >= usize::MAX as f64 {
            return Err(format!("max_body_mb is too large: {}", self.max_body_mb));
        }
        Ok(max_body as usize)
    }

    /// The HTTP port.
    pub fn http_port(&self) -> u16 {
        self.port.unwrap_or(DEFAULT_PORT)
    }

    /// The port of gRPC's own listener (None: gRPC only on the HTTP port,
    /// or not at all).
    pub fn grpc_port(&self) -> Option<u16> {
        match (self.grpc, self.grpc_port, self.port) {
            (false, _, _) => None,
            (true, Some(p), _) => Some(p),
            (true, None, None) => Some(DEFAULT_GRPC_PORT),
            (true, None, Some(_)) => None,
        }
    }

    /// The core's options.
    pub fn node_options(&self) -> Result<NodeOptions, String> {
        let pool = mib("pool_mb", self.pool_mb)?;
        Ok(NodeOptions {
            request_timeout: seconds("request_timeout_s", self.request_timeout_s)?,
            worker_start_timeout: seconds("worker_start_timeout_s", self.worker_start_timeout_s)?,
            replica_pool_bytes: pool,
            ingress_pool_bytes: pool.max(INGRESS_POOL_BYTES),
            store_dir: self.store.as_deref().filter(|s| !s.is_empty()).map(PathBuf::from),
            store_max_value: mib("store_max_value_mb", self.store_max_value_mb)? as u64,
            shm_dir: slipstream_shm::default_dir(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_become_options() {
        let c = NodeConfig::default();
        c.check().unwrap();
        let o = c.node_options().unwrap();
        assert_eq!(c.http_port(), 8000);
        assert_eq!(o.request_timeout, Duration::from_secs(30));
        assert_eq!(c.max_body_bytes(), Ok(64 << 20));
        assert_eq!(o.replica_pool_bytes, 256 << 20);
        assert_eq!(o.ingress_pool_bytes, 1 << 30);
        assert_eq!(o.store_max_value, 1 << 30);
        assert_eq!(c.grpc_port(), Some(8001));
        assert!(c.admin_token.is_none() && o.store_dir.is_none());
    }

    #[test]
    fn table_describes_every_field() {
        let table = settings();
        let fields = serde_json::to_value(NodeConfig::default()).unwrap();
        assert_eq!(table.len(), fields.as_object().unwrap().len());
        let by = |n: &str| table.iter().find(|s| s.name == n).unwrap().clone();
        assert_eq!(by("port").kind, "int");
        assert_eq!(by("batching").kind, "choice");
        assert_eq!(by("batching").choices, ["deadline", "fixed"]);
        assert!(by("store").optional);
        assert_eq!(by("request_timeout_s").flag, Some("--request-timeout"));
        assert_eq!((by("port").scope, by("autoscale").scope), ("node", "spec"));
        assert_eq!(by("host").help, "Address the HTTP and gRPC listeners bind (a non-loopback address needs `admin_token` for the admin routes).");
        assert!(table.iter().all(|s| !s.help.is_empty()));
    }

    #[test]
    fn bad_values_are_refused_with_their_name() {
        let bad = |f: fn(&mut NodeConfig)| {
            let mut c = NodeConfig::default();
            f(&mut c);
            c.check().unwrap_err()
        };
        assert!(bad(|c| c.request_timeout_s = 0.0).contains("request_timeout_s"));
        assert!(bad(|c| c.max_body_mb = f64::NAN).contains("max_body_mb"));
        assert!(bad(|c| c.pool_mb = u64::MAX).contains("too large"));
        assert!(bad(|c| c.node_threads = 0).contains("node_threads"));
        assert!(NodeConfig::from_json(r#"{"prot": 1}"#).unwrap_err().contains("unknown field"));
        assert!(NodeConfig::from_json(r#"{"port": "x"}"#).is_err());
    }

    #[test]
    fn grpc_has_its_own_port_only_in_the_default_layout_or_when_asked() {
        let c = NodeConfig { port: Some(0), ..Default::default() };
        assert_eq!((c.http_port(), c.grpc_port()), (0, None));
        // The README's second node: --port 8001 alone takes no other port.
        let c = NodeConfig { port: Some(8001), ..Default::default() };
        assert_eq!((c.http_port(), c.grpc_port()), (8001, None));
        let c = NodeConfig { grpc: false, ..Default::default() };
        assert_eq!(c.grpc_port(), None);
        let c = NodeConfig { grpc_port: Some(9001), port: Some(0), ..Default::default() };
        assert_eq!(c.grpc_port(), Some(9001));
    }
}
