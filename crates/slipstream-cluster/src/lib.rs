//! Beyond one machine: nodes that form a cluster on etcd and hand work to
//! each other over a direct data plane (`docs/design/cluster.md`).
//!
//! - `agent`: membership (a lease kept alive, the node's record under it),
//!   the watch on the cluster's keys, the placement written by the leader
//!   with a compare-and-swap (the placement itself is the pure
//!   [`slipstream_sched::placement`]), and applying it to this node through
//!   the node's one owner of replica sets;
//! - `remote`: replicas on other nodes, driven from here (a
//!   [`slipstream_core::drive::Launcher`] and its backend);
//! - `serve`: running another node's batches here; `wire`: the frames.
//!
//! It plugs into the node as a launcher (remote replicas) and a service
//! (its `cluster` status block); it reaches the request path through the
//! node's public API only.
//!
//! etcd holds everything shared, under `/slipstream/<cluster>/`:
//! `members/<node>` (bound to the node's lease), `deploy` (written by
//! `slipstream deploy`) and `placement`. Every record is signed with the
//! cluster key (HMAC-SHA256), so a process without the cluster token can
//! neither join routing nor place work, even where it can write to etcd;
//! the data plane's handshake keeps it from sending frames.

mod agent;
mod autoscale;
mod feedback;
mod handoff;
mod handover;
mod remote;
mod serve;
mod store;
mod wire;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use slipstream_core::events::EventKind;
use slipstream_core::ext::{Service, StatusDoc};
use slipstream_core::prom::PromText;
use slipstream_core::{Node, PipelineRt};
use slipstream_peer::ClusterKey;
use slipstream_sched::placement::Assignment;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

pub use autoscale::Report;
pub use feedback::{Feedback, FeedbackFn, TAG_SHIFT};

/// How a node joins its cluster (from `slipstream node --cluster ...`).
#[derive(Clone, Debug, Deserialize)]
pub struct ClusterOptions {
    /// etcd endpoints: `etcd://host:port[,host:port...]`.
    pub etcd: String,
    /// This node's name (unique in the cluster).
    pub name: String,
    /// The cluster's name: its keys live under `/slipstream/<cluster>/`.
    #[serde(default = "default_cluster")]
    pub cluster: String,
    /// The shared secret nodes authenticate each other with (and sign with).
    pub token: String,
    /// Other tokens accepted, never signed with: the old or the next one,
    /// while a token is rotated.
    #[serde(default)]
    pub accept_tokens: Vec<String>,
    /// Where the data plane listens (port 0: any free port).
    #[serde(default = "default_data_listen")]
    pub data_listen: String,
    /// The host other nodes reach this one at (default: the listen host, or
    /// 127.0.0.1 when listening on all interfaces).
    #[serde(default)]
    pub advertise: Option<String>,
    /// Membership lease: a node that stops renewing it is gone after this long.
    #[serde(default = "default_ttl")]
    pub ttl_s: u64,
    /// The deployment this node runs (its id, from the `deploy` record).
    pub deploy: String,
    /// Copies of each value in the cluster store (capped at the live members).
    #[serde(default = "default_store_replicas")]
    pub store_replicas: usize,
    /// Whether the placement this node writes (as the leader) keeps warm
    /// standbys for stages one node loss would empty.
    #[serde(default = "default_standbys")]
    pub standbys: bool,
    /// A directory of `ca.crt`, `tls.crt` and `tls.key`: mutual TLS on the
    /// data plane, and the client certificate for an `https://` etcd.
    #[serde(default)]
    pub tls: Option<std::path::PathBuf>,
    /// Whether a chain of stages on other nodes hands each request from
    /// node to node (see `handoff.rs`); false: every stage's answer comes
    /// back to the ingress (hub and spoke).
    #[serde(default = "default_direct")]
    pub direct: bool,
}

fn default_direct() -> bool {
    true
}

fn default_standbys() -> bool {
    true
}

fn default_store_replicas() -> usize {
    2
}

fn default_cluster() -> String {
    "default".into()
}
fn default_data_listen() -> String {
    "127.0.0.1:0".into()
}
fn default_ttl() -> u64 {
    3
}

impl ClusterOptions {
    pub fn root(&self) -> String {
        format!("/slipstream/{}/", self.cluster)
    }
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_s.max(1))
    }
}

/// The placement map stored in etcd.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// The deployment it places (its id).
    pub deploy: String,
    /// Increases with every placement written for the cluster.
    pub epoch: u64,
    /// Per stage ("pipeline/stage"), replicas per node.
    pub stages: Assignment,
    /// Per stage, warm standbys per node (for stages one node loss would
    /// empty; see [`slipstream_sched::placement::standbys`]).
    #[serde(default, skip_serializing_if = "Assignment::is_empty")]
    pub standby: Assignment,
    /// The node that computed it.
    pub by: String,
}

impl Placement {
    /// Replicas of `stage` on `node`.
    pub fn count(&self, stage: &str, node: &str) -> u32 {
        self.stages.get(stage).and_then(|m| m.get(node)).copied().unwrap_or(0)
    }

    /// Standbys of `stage` on `node`.
    pub fn standbys(&self, stage: &str, node: &str) -> u32 {
        self.standby.get(stage).and_then(|m| m.get(node)).copied().unwrap_or(0)
    }
}

/// The planner's replicas per node for a deployment's stages (the `plan`
/// record: `slipstream deploy --plan`, `slipstream plan --cluster ...
/// --apply` or `--watch`, with a plan made for the cluster's nodes). The
/// leader follows it on the nodes that are members
/// ([`slipstream_sched::placement::follow_plan`]). A record of its own,
/// not part of the deployment's: a new plan moves replicas (make before
/// break) without restarting the nodes, as a new deployment does.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    /// The deployment it plans (its id); ignored for any other.
    pub deploy: String,
    /// "pipeline/stage" -> node -> replicas.
    pub planned: Assignment,
    /// A GPU plan's binding: "pipeline/stage" -> node -> the devices (places
    /// in that node's `nvidia-smi -L` list, as `cuda:N` names them) its
    /// replicas there take, by slot. Stages or nodes it lacks take any GPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub devices: BTreeMap<String, BTreeMap<String, Vec<usize>>>,
    /// When it was made (Unix seconds) and what from, for the status.
    #[serde(default)]
    pub at: f64,
    #[serde(default)]
    pub note: String,
}

/// A node as its membership record describes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub node: String,
    /// HTTP ingress.
    pub http: String,
    /// Data plane.
    pub data: SocketAddr,
    pub cores: usize,
    pub memory_bytes: u64,
    /// GPUs (uuid and name) the node can bind workers to.
    #[serde(default)]
    pub gpus: Vec<String>,
    /// Objects in its store (keys) and their bytes.
    #[serde(default)]
    pub store_keys: u64,
    /// Ready local replicas per stage ("pipeline/stage").
    #[serde(default)]
    pub ready: BTreeMap<String, u32>,
    /// Warm local standbys per stage.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub standby: BTreeMap<String, u32>,
    /// Its request ids' tag (see `feedback.rs`; 0: none claimed).
    #[serde(default)]
    pub tag: u32,
    /// The load offered at its ingress (the cluster autoscaler's input).
    #[serde(default, skip_serializing_if = "Report::is_empty")]
    pub load: Report,
    /// The deployment it runs.
    pub deploy: String,
    /// Its membership lease (filled in from etcd, not signed; shown in the
    /// status, where a [`Cordon`] record's writer reads it).
    #[serde(skip_deserializing, skip_serializing_if = "is_zero")]
    pub lease: i64,
}

/// The signed envelope every record is stored in.
#[derive(Serialize, Deserialize)]
struct Envelope {
    body: String,
    sig: String,
}

/// `value` serialised and signed for record kind `kind`.
pub fn seal<T: Serialize>(key: &ClusterKey, kind: &str, value: &T) -> Vec<u8> {
    let body = serde_json::to_string(value).expect("records serialise");
    let sig = key.sign_hex(&[kind.as_bytes(), body.as_bytes()]);
    serde_json::to_vec(&Envelope { body, sig }).expect("envelopes serialise")
}

/// The record's value, if it is well formed and signed with the cluster key.
pub fn open<T: for<'de> Deserialize<'de>>(key: &ClusterKey, kind: &str, bytes: &[u8]) -> Result<T, String> {
    let env: Envelope = serde_json::from_slice(bytes).map_err(|e| format!("not a signed record: {e}"))?;
    if !key.verify_hex(&[kind.as_bytes(), env.body.as_bytes()], &env.sig) {
        return Err("its signature does not match the cluster key".into());
    }
    serde_json::from_str(&env.body).map_err(|e| format!("malformed {kind} record: {e}"))
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// A member being emptied before it is removed (`cordon/<node>`, written
/// by whoever removes it: the Kubernetes scaling loop before it shrinks
/// the StatefulSet). It holds for that member's lease only, so a node
/// started again under the same name is not cordoned by a stale record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cordon {
    pub node: String,
    pub lease: i64,
}

/// The names of `members` that take replicas and store copies (see
/// [`View::placeable`]); the leader asks before its view is published.
pub(crate) fn placeable<'a>(
    members: &'a BTreeMap<String, Member>,
    cordoned: &'a std::collections::BTreeSet<String>,
) -> impl Iterator<Item = &'a str> + 'a {
    let all = members.keys().all(|m| cordoned.contains(m));
    members.keys().map(String::as_str).filter(move |m| all || !cordoned.contains(*m))
}

/// What this node knows of the cluster (published by the agent).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct View {
    /// Live, verified members by name.
    pub members: BTreeMap<String, Member>,
    pub placement: Option<Placement>,
    /// The plan in force for this deployment, if one was written.
    pub plan: Option<PlanRecord>,
    /// Members whose data plane failed on this node (see [`Cluster::suspect`]).
    pub suspects: std::collections::BTreeSet<String>,
    /// Members being emptied (see [`Cordon`]): they serve and hold data
    /// until they leave, but get no replicas, standbys or store copies.
    pub cordoned: std::collections::BTreeSet<String>,
}

impl View {
    /// The members that take replicas and store copies: all but the
    /// cordoned ones (all of them when every member is cordoned, so a
    /// cluster is never left with nowhere to place).
    pub fn placeable(&self) -> impl Iterator<Item = &str> + '_ {
        placeable(&self.members, &self.cordoned)
    }

    /// Whether `node` takes work for stage `key` now: a live member, not
    /// suspected here, reporting a ready replica or a warm standby of it
    /// (a standby takes work another node sends while the stage has no
    /// serving replica there).
    pub fn serves(&self, node: &str, key: &str) -> bool {
        let has = |m: &BTreeMap<String, u32>| m.get(key).copied().unwrap_or(0) > 0;
        !self.suspects.contains(node) && self.members.get(node).is_some_and(|m| has(&m.ready) || has(&m.standby))
    }
}

/// Counters of the cluster layer (for status and metrics).
#[derive(Default)]
pub struct ClusterCounters {
    /// Batches sent to remote replicas, and requests in them.
    pub sent_batches: AtomicU64,
    pub sent_requests: AtomicU64,
    /// Batches run here for other nodes.
    pub served_batches: AtomicU64,
    /// Requests retried elsewhere after a remote node failed with them.
    pub retried: AtomicU64,
    /// Batches waited for past their patience, as no other replica could
    /// take them (see `remote.rs`).
    pub patient_calls: AtomicU64,
    /// Records ignored for a bad signature.
    pub refused_records: AtomicU64,
    pub placements_written: AtomicU64,
}

/// The cluster side of a node.
pub struct Cluster {
    opts: ClusterOptions,
    key: ClusterKey,
    peers: slipstream_peer::Peers<wire::ArenaAlloc>,
    /// Where this node's HTTP ingress is reached (for its member record).
    http: String,
    /// Where this node's data plane listens (as advertised).
    data_addr: SocketAddr,
    view: watch::Sender<Arc<View>>,
    counters: ClusterCounters,
    /// The data plane's measured costs and the merge threshold chosen from them.
    costs: slipstream_peer::Costs,
    /// Set when the agent sees a new deployment: the node stops so that its
    /// launcher restarts it on the new one.
    redeploy: watch::Sender<bool>,
    /// When the membership lease was last granted or renewed (None: never).
    renewed: Mutex<Option<std::time::Instant>>,
    /// The data-plane server's counters (set once it listens).
    server: std::sync::OnceLock<slipstream_peer::ServerStats>,
    /// Members whose data plane failed here: node -> (its lease then, since when).
    suspects: Mutex<BTreeMap<String, (i64, std::time::Instant)>>,
    /// The cluster store on this node (set once it has loaded).
    store: std::sync::OnceLock<Arc<store::ClusterStore>>,
    /// This node's request-id tag (see `feedback.rs`).
    tag: std::sync::atomic::AtomicU32,
    /// What applies feedback forwarded here.
    feedback: std::sync::OnceLock<FeedbackFn>,
    /// The cluster's autoscaler (it decides while this node leads).
    scaler: autoscale::ClusterScaler,
    /// Requests handed on along chains of stages, this node their ingress.
    handoffs: handoff::Handoffs,
    /// The node's pipelines (fixed for its life) and event log.
    pipelines: Vec<Arc<PipelineRt>>,
    events: Arc<slipstream_core::events::Events>,
}

impl Cluster {
    /// This node's name in the cluster.
    pub fn me(&self) -> &str {
        &self.opts.name
    }

    /// The data plane to `node` failed (connection refused or lost, or no
    /// answer): take every remote replica on it out of routing at once, so
    /// that retries and new routes avoid it, until it proves reachable
    /// again ([`Cluster::clear_suspect`], after a probe) or rejoins with a
    /// new lease. Its lease expiring takes it out of the placement.
    pub fn suspect(&self, name: &str, why: &str) {
        let lease = self.view().members.get(name).map_or(0, |m| m.lease);
        let fresh = self.suspects.lock().insert(name.to_string(), (lease, std::time::Instant::now())).is_none();
        for p in &self.pipelines {
            for s in &p.stages {
                for r in s.replicas().iter().filter(|r| r.remote.as_ref().is_some_and(|at| at.node == name)) {
                    r.worker_died();
                }
            }
        }
        if fresh {
            self.events.node(EventKind::NodeSuspected, format!("{name}: {why}"));
        }
        self.publish_suspects();
        self.handoffs.lost(|n| n == name);
    }

    /// `node` answered again (or rejoined): route to it again.
    pub fn clear_suspect(&self, name: &str) {
        if self.suspects.lock().remove(name).is_some() {
            self.publish_suspects();
        }
    }

    /// Since when `node` is suspected here.
    pub fn suspected_since(&self, name: &str) -> Option<std::time::Instant> {
        self.suspects.lock().get(name).map(|(_, t)| *t)
    }

    /// The membership lease was granted or renewed just now.
    pub(crate) fn lease_renewed(&self) {
        *self.renewed.lock() = Some(std::time::Instant::now());
    }

    /// Forget suspicions of members that rejoined (a new lease) or left.
    pub(crate) fn prune_suspects(&self, members: &BTreeMap<String, Member>) {
        self.suspects.lock().retain(|name, (lease, _)| members.get(name).is_some_and(|m| m.lease == *lease));
    }

    /// Bring the view's suspects in line with the suspicions held.
    pub(crate) fn publish_suspects(&self) {
        let suspects: std::collections::BTreeSet<String> = self.suspects.lock().keys().cloned().collect();
        self.view.send_if_modified(|v| {
            if v.suspects == suspects {
                return false;
            }
            let mut next = (**v).clone();
            next.suspects = suspects;
            *v = Arc::new(next);
            true
        });
    }

    /// What this node knows of the cluster now.
    pub fn view(&self) -> Arc<View> {
        self.view.borrow().clone()
    }

    /// The status block.
    fn status(&self) -> serde_json::Value {
        let v = self.view();
        let c = &self.counters;
        let server = self.server.get();
        serde_json::json!({
            "node": self.me(),
            "cluster": self.opts.cluster,
            "etcd": self.opts.etcd,
            "data": self.data_addr.to_string(),
            "deploy": self.opts.deploy,
            "members": v.members,
            "placement": v.placement,
            "plan": v.plan,
            "cordoned": v.cordoned,
            // Members whose data plane failed here, out of routing until a probe answers.
            "suspects": v.suspects,
            "merge_threshold_bytes": self.costs.merge_threshold,
            "counters": {
                "sent_batches": c.sent_batches.load(Relaxed),
                "sent_requests": c.sent_requests.load(Relaxed),
                "served_batches": c.served_batches.load(Relaxed),
                "retried": c.retried.load(Relaxed),
                "patient_calls": c.patient_calls.load(Relaxed),
                "refused_records": c.refused_records.load(Relaxed),
                "refused_handshakes": server.map_or(0, |s| s.refused()),
                "placements_written": c.placements_written.load(Relaxed),
                "chains_started": self.handoffs.chains.load(Relaxed),
                "chains_delivered": self.handoffs.delivered.load(Relaxed),
                "chains_pending": self.handoffs.pending(),
                "handed_on": self.handoffs.handed_on.load(Relaxed),
                "chains_lost": self.handoffs.rerun.load(Relaxed),
            },
            "direct_handoff": self.opts.direct,
            // With TLS, encryption copies every byte once more on each
            // side: `zero_copy_tensors` then counts the copies we skip, not
            // what reaches the socket.
            "data_plane_tls": self.opts.tls.is_some(),
            "data_plane": self.peers.counters(),
            "data_plane_served": server.map(|s| s.counters()),
            "peer_connections": {"out": self.peers.connections(), "in": server.map_or(0, |s| s.connections())},
            "store": self.store.get().map(|s| s.status()),
            "autoscale": self.scaler.status(),
        })
    }
}

/// A running cluster membership: dropping it stops the data-plane server.
pub struct Joined {
    /// The cluster side of this node.
    pub cluster: Arc<Cluster>,
    /// Becomes true when the agent sees a new deployment.
    pub redeploy: watch::Receiver<bool>,
    leave: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    etcd: slipstream_etcd::Etcd,
    _server: slipstream_peer::ServerHandle,
}

impl Joined {
    /// Before [`Joined::leave`] on a graceful stop: take this node out of
    /// what the leader places and wait, at most `limit`, until every stage
    /// with a replica here is ready on another member (`handover.rs`),
    /// serving all the while. What it did, for the log.
    pub async fn hand_over(&self, limit: Duration) -> String {
        handover::hand_over(&self.etcd, &self.cluster, limit).await
    }

    /// Leave the cluster now (revoke the lease: the others stop routing
    /// here at once) and stop following it; waits briefly for the revoke.
    pub async fn leave(&mut self) {
        let _ = self.leave.send(true);
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
    }
}

impl Service for Cluster {
    fn status(&self, doc: &mut StatusDoc) {
        doc.set(&["cluster"], self.status());
    }

    /// Routable: the lease held (renewed within its TTL), this node's
    /// record seen through the watch (what the others route by), a
    /// placement of this deployment, and every stage placed here reported
    /// ready in that record. Never etcd itself on the request: the answer
    /// is from state the agent keeps.
    fn unready(&self) -> Option<String> {
        let ttl = self.opts.ttl();
        match *self.renewed.lock() {
            Some(t) if t.elapsed() < ttl => {}
            Some(t) => {
                return Some(format!(
                    "cluster: membership lease not renewed for {:.1} s (TTL {} s): etcd unreachable?",
                    t.elapsed().as_secs_f64(),
                    ttl.as_secs()
                ))
            }
            None => return Some("cluster: not joined yet".into()),
        }
        let view = self.view();
        let me = self.me();
        let Some(rec) = view.members.get(me) else {
            return Some("cluster: this node's member record is not yet seen through the watch".into());
        };
        let Some(placement) = view.placement.as_ref().filter(|p| p.deploy == self.opts.deploy) else {
            return Some("cluster: no placement of this deployment yet".into());
        };
        let cold = |placed: &Assignment, warm: &BTreeMap<String, u32>| {
            placed
                .iter()
                .find(|(key, per_node)| {
                    per_node.get(me).copied().unwrap_or(0) > 0 && warm.get(*key).copied().unwrap_or(0) == 0
                })
                .map(|(key, _)| key.clone())
        };
        if let Some(key) = cold(&placement.stages, &rec.ready) {
            return Some(format!("cluster: stage {key} is placed here and not yet reported ready to the others"));
        }
        // A standby placed here counts too: it is what keeps its stage
        // serving when the node holding its replicas goes, so a rolling
        // restart must not take that node down before this one is warm.
        cold(&placement.standby, &rec.standby)
            .map(|key| format!("cluster: a standby of stage {key} is placed here and not yet warm"))
    }

    fn metrics(&self, t: &mut PromText) {
        if let Some(s) = self.store.get() {
            s.metrics(t);
        }
    }
}

/// Start the data plane, join the cluster and follow it; `http` is where
/// other nodes and clients reach this node's HTTP ingress; `scale`: the
/// autoscaler's settings (the app's), which the cluster's leader runs.
pub async fn start(
    node: &Arc<Node>,
    opts: ClusterOptions,
    http: String,
    scale: slipstream_sched::scale::ScaleOptions,
) -> Result<Joined, String> {
    let tls = match &opts.tls {
        Some(dir) => {
            let tls = slipstream_tls::NodeTls::load(dir).map_err(|e| format!("--tls: {e}"))?;
            tls.check_own_name(&opts.name).map_err(|e| format!("--tls: {e}"))?;
            Some(tls)
        }
        None => None,
    };
    let etcd = slipstream_etcd::Etcd::with_tls(&opts.etcd, tls.as_ref())
        .map_err(|e| format!("--cluster {}: {e}", opts.etcd))?;
    let listener = tokio::net::TcpListener::bind(&opts.data_listen)
        .await
        .map_err(|e| format!("cannot listen for the data plane on {}: {e}", opts.data_listen))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let host = match &opts.advertise {
        Some(h) => h.parse::<std::net::IpAddr>().map_err(|e| format!("--advertise {h}: {e}"))?,
        None if bound.ip().is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        None => bound.ip(),
    };
    let data_addr = SocketAddr::new(host, bound.port());
    let costs = tokio::task::spawn_blocking(slipstream_peer::measure_costs).await.map_err(|e| e.to_string())?;
    let key = ClusterKey::with_accepted(&opts.token, &opts.accept_tokens);
    let alloc = Arc::new(wire::ArenaAlloc(node.arena().clone()));
    let peer_config = slipstream_peer::PeerConfig {
        merge_threshold: costs.merge_threshold,
        tls,
        ..slipstream_peer::PeerConfig::default()
    };
    let peers = slipstream_peer::Peers::with_config(key.clone(), opts.name.clone(), alloc.clone(), peer_config.clone());
    let (redeploy_tx, redeploy) = watch::channel(false);
    let cluster = Arc::new(Cluster {
        key: key.clone(),
        peers,
        http,
        data_addr,
        view: watch::channel(Arc::new(View::default())).0,
        counters: ClusterCounters::default(),
        costs,
        redeploy: redeploy_tx,
        renewed: Mutex::new(None),
        server: std::sync::OnceLock::new(),
        suspects: Mutex::new(BTreeMap::new()),
        store: std::sync::OnceLock::new(),
        scaler: autoscale::ClusterScaler::new(scale),
        tag: Default::default(),
        feedback: std::sync::OnceLock::new(),
        handoffs: Default::default(),
        pipelines: node.pipelines().values().cloned().collect(),
        events: node.events().clone(),
        opts,
    });
    node.set_remote_launcher(Arc::new(remote::RemoteLauncher(cluster.clone())));
    node.register(cluster.clone());
    let (n, c) = (node.clone(), cluster.clone());
    let server = slipstream_peer::serve_with_config(
        listener,
        key,
        cluster.opts.name.clone(),
        alloc,
        peer_config,
        move |from, inc, parts| serve::serve_call(n.clone(), c.clone(), from, inc, parts),
    );
    let _ = cluster.server.set(server.stats());
    let lease = agent::join(&etcd, node, &cluster)
        .await
        .map_err(|e| format!("cannot join the cluster through etcd at {}: {e}", cluster.opts.etcd))?;
    let (leave, stop) = watch::channel(false);
    // The lease is kept alive from now on: loading the store below can take
    // longer than its TTL on a busy machine.
    let mut tasks =
        vec![tokio::spawn(agent::membership(etcd.clone(), node.clone(), cluster.clone(), lease, stop.clone()))];
    // The store is shared from here on: every committed version is applied
    // before the node serves a read (and before the placement starts
    // replicas, whose workers read it).
    let shared = store::ClusterStore::start(
        cluster.clone(),
        etcd.clone(),
        node.store().clone(),
        cluster.opts.store_replicas,
        stop.clone(),
    )
    .await?;
    let _ = cluster.store.set(shared.clone());
    node.set_shared_store(shared);
    tasks.push(tokio::spawn(agent::follow(etcd.clone(), node.clone(), cluster.clone(), stop)));
    // Until the view holds this node, the store has no replica set to
    // write to (the seeds are put next).
    let mut views = cluster.view.subscribe();
    let me = cluster.me().to_string();
    if tokio::time::timeout(cluster.opts.ttl() * 3, views.wait_for(|v| v.members.contains_key(&me))).await.is_err() {
        tracing::warn!("this node's membership record has not come back from etcd's watch yet");
    }
    tracing::info!(
        "joined cluster '{}' as {} (etcd {}, data plane {data_addr}{}, merging tensors under {} bytes)",
        cluster.opts.cluster,
        cluster.opts.name,
        cluster.opts.etcd,
        if cluster.opts.tls.is_some() { " with mutual TLS" } else { "" },
        cluster.costs.merge_threshold
    );
    Ok(Joined { cluster, redeploy, leave, tasks, etcd, _server: server })
}

/// A member of deployment "d" with 2 cores, lease 1 and `ready` replicas.
#[cfg(test)]
pub(crate) fn member_for_tests(name: &str, ready: &[(&str, u32)]) -> Member {
    Member {
        node: name.into(),
        http: String::new(),
        data: "127.0.0.1:1".parse().unwrap(),
        cores: 2,
        memory_bytes: 0,
        gpus: vec![],
        store_keys: 0,
        ready: ready.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
        standby: BTreeMap::new(),
        load: Report::default(),
        tag: 0,
        deploy: "d".into(),
        lease: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `slipstream deploy` (Python) seals records the node opens: the same
    /// vector is checked in tests/unit/test_cluster_cli.py.
    const SEALED_BY_PYTHON: &str =
        r#"{"body": "{\"id\":\"x\"}", "sig": "ec0d33655ff61f052d4ace384e1cf0ea472ac37819e435f89d6f1b49489d27ed"}"#;

    #[derive(Deserialize, Serialize, PartialEq, Debug)]
    struct Head {
        id: String,
    }

    #[test]
    fn records_sealed_in_python_open_here_and_nothing_else_does() {
        let key = ClusterKey::from_token("t");
        let d: Head = open(&key, "deploy", SEALED_BY_PYTHON.as_bytes()).unwrap();
        assert_eq!(d.id, "x");
        assert!(
            open::<Head>(&ClusterKey::from_token("u"), "deploy", SEALED_BY_PYTHON.as_bytes()).is_err(),
            "another token"
        );
        assert!(open::<Head>(&key, "placement", SEALED_BY_PYTHON.as_bytes()).is_err(), "another kind");
        let tampered = SEALED_BY_PYTHON.replace(r#"\"x\""#, r#"\"y\""#);
        assert!(open::<Head>(&key, "deploy", tampered.as_bytes()).is_err(), "a changed body");
        assert!(open::<Head>(&key, "deploy", b"not json").is_err());
        let mine = seal(&key, "member", &Head { id: "n1".into() });
        assert_eq!(open::<Head>(&key, "member", &mine).unwrap(), Head { id: "n1".into() });
    }

    #[test]
    fn a_suspected_node_serves_nothing_until_cleared() {
        let mut v = View::default();
        let m = Member {
            node: "n2".into(),
            http: String::new(),
            data: "127.0.0.1:1".parse().unwrap(),
            cores: 1,
            memory_bytes: 0,
            gpus: vec![],
            store_keys: 0,
            ready: [("p/s".to_string(), 1)].into(),
            standby: [("p/u".to_string(), 1)].into(),
            load: Report::default(),
            tag: 0,
            deploy: "d".into(),
            lease: 7,
        };
        v.members.insert("n2".into(), m);
        assert!(v.serves("n2", "p/s") && !v.serves("n2", "p/t") && !v.serves("n3", "p/s"));
        assert!(v.serves("n2", "p/u"), "a warm standby takes work sent to it");
        v.suspects.insert("n2".into());
        assert!(!v.serves("n2", "p/s"));
        // The lease shows in the status (a cordon's writer reads it) but a
        // record read from etcd takes its lease from etcd, not from the body.
        let shown = serde_json::to_value(&v.members["n2"]).unwrap();
        assert_eq!(shown["lease"], 7);
        let read: Member = serde_json::from_value(shown).unwrap();
        assert_eq!(read.lease, 0);
    }

    #[test]
    fn cordoned_members_take_nothing_new_unless_all_are() {
        let mut v = View::default();
        for n in ["a", "b", "c"] {
            v.members.insert(n.into(), member_for_tests(n, &[]));
        }
        assert_eq!(v.placeable().collect::<Vec<_>>(), ["a", "b", "c"]);
        v.cordoned.insert("c".into());
        assert_eq!(v.placeable().collect::<Vec<_>>(), ["a", "b"]);
        v.cordoned.extend(["a".to_string(), "b".to_string()]);
        assert_eq!(v.placeable().collect::<Vec<_>>(), ["a", "b", "c"], "never nowhere to place");
    }
}
