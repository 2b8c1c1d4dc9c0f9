//! The node's side of the cluster's control plane, on etcd.
//!
//! - **Membership**: the node's record (`members/<node>`: addresses,
//!   inventory, ready replicas per stage) lives under a lease that a loop
//!   renews every third of its TTL. A node that stops renewing (killed,
//!   partitioned from etcd) is gone when the lease expires; if this node's
//!   own lease expired while it was cut off, it grants a new one and puts
//!   its record again (it rejoins). The record is re-put when the node's
//!   ready replicas change, which is how other nodes learn that a replica
//!   placed here may take their work.
//! - **The view**: one watch on the cluster's prefix keeps the members and
//!   the placement current (a reload when etcd reports lost history).
//!   Records that are not signed with the cluster key are ignored.
//! - **Placement**: the member with the smallest name among those running
//!   this deployment is the leader; when members change it computes the
//!   placement ([`slipstream_sched::placement::place`]) and writes it with a
//!   compare-and-swap on the placement key's revision, so two nodes that
//!   both believe they lead cannot interleave their writes: the loser sees
//!   the winner's placement through the watch and computes again from it.
//! - **Applying it**: each node starts its own replicas placed on it,
//!   drains those it lost (after a grace period, so that nodes still
//!   routing here by the old placement are not refused), and keeps one
//!   remote replica per replica placed on every other node; all through
//!   the node's one owner of replica sets ([`Node::change`]).

use super::autoscale::{Meter, REPORT_EVERY};
use super::{open, placeable, seal, Cluster, Cordon, Member, Placement, PlanRecord, Report, View};
use slipstream_core::events::EventKind;
use slipstream_core::replica::Phase;
use slipstream_core::scaling::{Change, Elsewhere};
use slipstream_core::Node;
use slipstream_etcd::{Etcd, EtcdError, Kv, WatchEvent};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// What a member record says about this node now.
pub(crate) fn my_record(node: &Node, cluster: &Cluster) -> Member {
    let (mut ready, mut standby) = (BTreeMap::new(), BTreeMap::new());
    for p in node.pipelines().values() {
        for s in &p.stages {
            let set = s.replicas();
            for (phase, into) in [(Phase::Ready, &mut ready), (Phase::Standby, &mut standby)] {
                let n = set.iter().filter(|r| r.is_local() && r.phase() == phase).count();
                if n > 0 {
                    into.insert(p.stage_key(s.index), n as u32);
                }
            }
        }
    }
    Member {
        node: cluster.me().to_string(),
        http: cluster.http.clone(),
        data: cluster.data_addr,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_bytes: memory_bytes(),
        gpus: slipstream_core::gpu::inventory().to_vec(), // `nvidia-smi -L`, read once
        store_keys: node.store().totals().map_or(0, |t| t.0),
        ready,
        standby,
        load: Default::default(),
        tag: cluster.tag.load(Relaxed),
        deploy: cluster.opts.deploy.clone(),
        lease: 0,
    }
}

fn memory_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Join: a lease and this node's record under it. Err: etcd cannot be reached.
pub(crate) async fn join(etcd: &Etcd, node: &Node, cluster: &Cluster) -> Result<i64, EtcdError> {
    let lease = etcd.grant(cluster.opts.ttl().as_secs() as i64).await?;
    // Request ids name this node from here on (feedback finds it by them).
    let tag = crate::feedback::claim_tag(etcd, cluster, lease).await?;
    node.set_request_ids(crate::feedback::first_id(tag));
    put_record(etcd, node, cluster, lease).await?;
    cluster.lease_renewed();
    Ok(lease)
}

async fn put_record(etcd: &Etcd, node: &Node, cluster: &Cluster, lease: i64) -> Result<Member, EtcdError> {
    put(etcd, cluster, lease, my_record(node, cluster)).await
}

async fn put(etcd: &Etcd, cluster: &Cluster, lease: i64, rec: Member) -> Result<Member, EtcdError> {
    let key = format!("{}members/{}", cluster.opts.root(), cluster.me());
    etcd.put(&key, &seal(&cluster.key, "member", &rec), Some(lease)).await?;
    Ok(rec)
}

/// Keep the lease alive and the record current until `stop`; then leave
/// (revoke the lease, so that the others stop routing here at once).
pub(crate) async fn membership(
    etcd: Etcd,
    node: Arc<Node>,
    cluster: Arc<Cluster>,
    mut lease: i64,
    mut stop: watch::Receiver<bool>,
) {
    let renew = (cluster.opts.ttl() / 3).max(Duration::from_millis(200));
    let mut last = my_record(&node, &cluster);
    let mut next_renew = tokio::time::Instant::now() + renew;
    // The load report, measured every REPORT_EVERY.
    let mut meter = Meter::new(&node);
    let mut load = Report::default();
    let mut next_report = tokio::time::Instant::now() + REPORT_EVERY;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        if *stop.borrow() {
            break;
        }
        let now = tokio::time::Instant::now();
        if now >= next_renew {
            next_renew = now + renew;
            match etcd.keep_alive(lease).await {
                Ok(_) => cluster.lease_renewed(),
                Err(EtcdError::LeaseExpired(_)) => {
                    match join(&etcd, &node, &cluster).await {
                        Ok(l) => {
                            lease = l;
                            node.events().node(EventKind::Rejoined, "the membership lease had expired".into());
                        }
                        Err(e) => node.events().node(EventKind::EtcdUnreachable, e.to_string()),
                    }
                    continue;
                }
                Err(e) => {
                    node.events().node(EventKind::EtcdUnreachable, e.to_string());
                    continue;
                }
            }
        }
        if now >= next_report {
            next_report = now + REPORT_EVERY;
            load = meter.report(&node);
        }
        let rec = Member { load: load.clone(), ..my_record(&node, &cluster) };
        if (&rec.ready, &rec.standby, &rec.load) != (&last.ready, &last.standby, &last.load) {
            if let Ok(r) = put(&etcd, &cluster, lease, rec).await {
                last = r;
            }
        }
    }
    let _ = etcd.revoke(lease).await;
}

/// The leader places only once the membership has been still this long,
/// so that nodes starting together get one placement, not one per arrival.
const SETTLE: Duration = Duration::from_millis(1000);

/// The raw state of the cluster's keys.
struct Keys {
    members: BTreeMap<String, Kv>,
    /// `cordon/<node>` records (see [`Cordon`]).
    cordons: BTreeMap<String, Kv>,
    placement: Option<Kv>,
    /// The `plan` record (see [`PlanRecord`]).
    plan: Option<Kv>,
    deploy: Option<Kv>,
    /// When a member last came or went.
    members_changed: tokio::time::Instant,
}

impl Default for Keys {
    fn default() -> Keys {
        Keys {
            members: BTreeMap::new(),
            cordons: BTreeMap::new(),
            placement: None,
            plan: None,
            deploy: None,
            members_changed: tokio::time::Instant::now(),
        }
    }
}

impl Keys {
    fn apply(&mut self, root: &str, ev: WatchEvent) {
        match ev {
            WatchEvent::Put(kv) => self.set(root, kv),
            WatchEvent::Delete { key, .. } => {
                if let Some(name) = key.strip_prefix(&format!("{root}members/")) {
                    self.members.remove(name);
                    self.members_changed = tokio::time::Instant::now();
                } else if let Some(name) = key.strip_prefix(&format!("{root}cordon/")) {
                    self.cordons.remove(name);
                } else if key == format!("{root}placement") {
                    self.placement = None;
                } else if key == format!("{root}plan") {
                    self.plan = None;
                } else if key == format!("{root}deploy") {
                    self.deploy = None;
                }
            }
            WatchEvent::Resync => {}
        }
    }

    fn set(&mut self, root: &str, kv: Kv) {
        if let Some(name) = kv.key.strip_prefix(&format!("{root}members/")) {
            if self.members.insert(name.to_string(), kv).is_none() {
                self.members_changed = tokio::time::Instant::now();
            }
        } else if let Some(name) = kv.key.strip_prefix(&format!("{root}cordon/")) {
            self.cordons.insert(name.to_string(), kv);
        } else if kv.key == format!("{root}placement") {
            self.placement = Some(kv);
        } else if kv.key == format!("{root}plan") {
            self.plan = Some(kv);
        } else if kv.key == format!("{root}deploy") {
            self.deploy = Some(kv);
        }
    }
}

/// The deploy record's fields the node reads.
#[derive(serde::Deserialize)]
struct DeployHead {
    id: String,
}

/// Watch the cluster's keys and act on them until `stop`.
pub(crate) async fn follow(etcd: Etcd, node: Arc<Node>, cluster: Arc<Cluster>, mut stop: watch::Receiver<bool>) {
    let root = cluster.opts.root();
    'reload: loop {
        let (kvs, rev) = loop {
            match etcd.get_prefix(&root).await {
                Ok(r) => break r,
                Err(e) => {
                    node.events().node(EventKind::EtcdUnreachable, e.to_string());
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        };
        let mut keys = Keys::default();
        for kv in kvs {
            keys.set(&root, kv);
        }
        let mut events = etcd.watch_prefix(&root, rev + 1);
        loop {
            reconcile(&etcd, &node, &cluster, &keys).await;
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = stop.changed() => return,
                // Re-check now and then: a placement write that lost its
                // compare-and-swap, or replicas that became ready.
                _ = tokio::time::sleep(SETTLE / 4) => continue,
            };
            let Some(ev) = ev else { continue 'reload };
            if matches!(ev, WatchEvent::Resync) {
                continue 'reload;
            }
            keys.apply(&root, ev);
            while let Ok(ev) = events.try_recv() {
                if matches!(ev, WatchEvent::Resync) {
                    continue 'reload;
                }
                keys.apply(&root, ev);
            }
        }
    }
}

/// Bring this node in line with the keys: view, leader's placement, replicas.
async fn reconcile(etcd: &Etcd, node: &Arc<Node>, cluster: &Arc<Cluster>, keys: &Keys) {
    let deploy = &cluster.opts.deploy;
    let refuse = |what: &str, why: String| {
        cluster.counters.refused_records.fetch_add(1, Relaxed);
        node.events().node(EventKind::RecordRefused, format!("{what}: {why}"));
    };
    if let Some(kv) = &keys.deploy {
        match open::<DeployHead>(&cluster.key, "deploy", &kv.value) {
            Ok(d) if &d.id != deploy => {
                if !*cluster.redeploy.borrow() {
                    node.events().node(EventKind::Redeploy, format!("deployment {} replaces {deploy}", d.id));
                    let _ = cluster.redeploy.send(true);
                }
                return;
            }
            Ok(_) => {}
            Err(e) => refuse("deploy", e),
        }
    }
    let mut members = BTreeMap::new();
    for (name, kv) in &keys.members {
        match open::<Member>(&cluster.key, "member", &kv.value) {
            Ok(mut m) if m.node == *name => {
                m.lease = kv.lease;
                if m.deploy == *deploy {
                    members.insert(name.clone(), m);
                }
            }
            Ok(_) => refuse(&kv.key, "its record names another node".into()),
            Err(e) => refuse(&kv.key, e),
        }
    }
    // Cordons of the members' current leases (a stale one names an
    // incarnation that is gone).
    let mut cordoned = std::collections::BTreeSet::new();
    for (name, kv) in &keys.cordons {
        match open::<Cordon>(&cluster.key, "cordon", &kv.value) {
            Ok(c) if c.node == *name => {
                if members.get(name).is_some_and(|m: &Member| m.lease == c.lease) {
                    cordoned.insert(name.clone());
                }
            }
            Ok(_) => refuse(&kv.key, "its record names another node".into()),
            Err(e) => refuse(&kv.key, e),
        }
    }
    let current =
        keys.placement.as_ref().and_then(|kv| match open::<Placement>(&cluster.key, "placement", &kv.value) {
            Ok(p) => Some((p, kv.mod_revision)),
            Err(e) => {
                refuse("placement", e);
                None
            }
        });
    let plan = keys.plan.as_ref().and_then(|kv| match open::<PlanRecord>(&cluster.key, "plan", &kv.value) {
        Ok(p) => Some(p).filter(|p| &p.deploy == deploy),
        Err(e) => {
            refuse("plan", e);
            None
        }
    });
    // The leader writes the placement, once the membership has settled.
    let settled = keys.members_changed.elapsed() >= SETTLE;
    if settled && members.keys().next().map(String::as_str) == Some(cluster.me()) {
        // Cordoned members get nothing: what they run moves to the others.
        let names: Vec<String> = placeable(&members, &cordoned).map(str::to_string).collect();
        let placeable_members: BTreeMap<String, Member> =
            names.iter().map(|n| (n.clone(), members[n].clone())).collect();
        let in_force = current.as_ref().map(|(p, _)| p).filter(|p| &p.deploy == deploy);
        let (prev, prev_standby) = (in_force.map(|p| &p.stages), in_force.map(|p| &p.standby));
        // Declared counts, or the autoscaler's for stages with bounds.
        let wanted = cluster.scaler.wanted(node, &placeable_members, prev);
        let want = &wanted.serving;
        // Stages that read affinity groups go where the groups are (the
        // groups are counted only when some stage reads them).
        let grouped: Vec<String> = node
            .pipelines()
            .values()
            .flat_map(|p| {
                p.spec.stages.iter().enumerate().filter(|(_, s)| s.affinity.is_some()).map(|(i, _)| p.stage_key(i))
            })
            .collect();
        let groups = match (grouped.is_empty(), cluster.store.get()) {
            (false, Some(store)) => store.group_bytes(),
            _ => Default::default(),
        };
        let data: slipstream_sched::placement::DataAt = match groups.is_empty() {
            true => Default::default(),
            false => grouped.into_iter().map(|stage| (stage, groups.clone())).collect(),
        };
        // A standby becomes the stage's next replica: one that stood in
        // for a lost node's, or the autoscaler's when the stage grows.
        let adopted = prev_standby.map(|sb| slipstream_sched::placement::adopt_standbys(want, &names, prev, sb));
        let before = adopted.as_ref().or(prev);
        let stages = slipstream_sched::placement::place_near(want, &names, before, &data);
        let no_plan = Default::default();
        let planned = plan.as_ref().map_or(&no_plan, |p| &p.planned);
        let stages = slipstream_sched::placement::follow_plan(stages, want, &names, before, planned);
        let failover = cluster.opts.standbys;
        let standby = slipstream_sched::placement::standbys(&stages, &names, prev_standby, &wanted.standby, failover);
        if prev != Some(&stages) || prev_standby != Some(&standby) {
            let epoch = current.as_ref().map_or(0, |(p, _)| p.epoch) + 1;
            let by = cluster.me().to_string();
            let p = Placement { deploy: deploy.clone(), epoch, stages, standby, by };
            let key = format!("{}placement", cluster.opts.root());
            let expected = current.as_ref().map_or(0, |(_, rev)| *rev);
            match etcd.put_if(&key, &seal(&cluster.key, "placement", &p), expected, None).await {
                Ok(Ok(_)) => {
                    cluster.counters.placements_written.fetch_add(1, Relaxed);
                    node.events().node(EventKind::Placed, format!("epoch {epoch} over {}", names.join(", ")));
                }
                Ok(Err(_)) => {} // another writer won; its placement arrives through the watch
                Err(e) => node.events().node(EventKind::EtcdUnreachable, e.to_string()),
            }
        }
    }
    let placement = current.map(|(p, _)| p).filter(|p| &p.deploy == deploy);
    if let Some(p) = &placement {
        apply(node, cluster, p, plan.as_ref(), &members);
    }
    cluster.prune_suspects(&members);
    cluster.handoffs.lost(|n| !members.contains_key(n));
    cluster.view.send_if_modified(|v| {
        let changed = v.members != members || v.placement != placement || v.cordoned != cordoned || v.plan != plan;
        if changed {
            *v = Arc::new(View { members, placement, plan, suspects: v.suspects.clone(), cordoned });
        }
        changed
    });
    cluster.publish_suspects();
}

/// Start, keep and drain replicas so that this node matches the placement
/// (on the devices the plan, if any, binds them to here).
fn apply(
    node: &Arc<Node>,
    cluster: &Cluster,
    p: &Placement,
    plan: Option<&PlanRecord>,
    members: &BTreeMap<String, Member>,
) {
    for pipe in node.pipelines().values() {
        for st in &pipe.stages {
            let key = pipe.stage_key(st.index);
            let me = cluster.me();
            let bound = plan.and_then(|plan| plan.devices.get(&key)).and_then(|per| per.get(me));
            node.change(pipe, st.index, Change::Bind(bound.unwrap_or(&pipe.spec.stages[st.index].devices)));
            // Placed replicas first: one placed where this node's standby
            // was promotes it.
            node.change(pipe, st.index, Change::Place(p.count(&key, me) as usize));
            node.change(pipe, st.index, Change::Stand(p.standbys(&key, me) as usize));
            let remote: BTreeMap<String, Elsewhere> = members
                .iter()
                .filter(|(n, _)| n.as_str() != me)
                .map(|(name, m)| {
                    let (serving, standby) = (p.count(&key, name) as usize, p.standbys(&key, name) as usize);
                    (name.clone(), Elsewhere { addr: m.data, serving, standby })
                })
                .collect();
            node.change(pipe, st.index, Change::Remote(&remote));
        }
    }
}
