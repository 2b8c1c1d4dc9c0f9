//! The request path end to end, on fake in-process replicas
//! ([`crate::testing`]): DAG joins, deadlines, cancellation, retries after a
//! lost executor, joins over candidates with their cut-off, stage hooks,
//! and the one owner of replica sets.

use crate::arena::{HeapTensors, Tensors};
use crate::ext::{Lookup, StageHook, Versions};
use crate::join::{JoinPlan, JoinPolicy, JoinTiming};
use crate::prom::PromText;
use crate::replica::Phase;
use crate::scaling::Change;
use crate::testing::{floats, Fake, TestNode};
use crate::NodeError;
use parking_lot::Mutex;
use slipstream_sched::scale::ScaleAction;
use slipstream_types::DType;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One float32 output named `name` with `v` in its one row.
fn out(name: &str, v: &[f32]) -> HeapTensors {
    HeapTensors(vec![(
        name.into(),
        DType::Float32,
        vec![1, v.len() as u64],
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )])
}

fn first(inputs: &Tensors) -> Vec<f32> {
    floats(inputs, &inputs[0].0)
}

fn app(slo_ms: f64, stages: &str) -> String {
    format!(
        r#"{{"pipelines": [{{"name": "p", "inputs": {{"x": {{"dtype": "float32", "shape": [-1, 2]}}}},
              "slo": {{"p99_ms": {slo_ms}}}, "stages": {stages}}}]}}"#
    )
}

/// Stages a -> (b, c) -> d: b doubles, c negates, d adds what it gets.
fn diamond() -> Fake {
    Fake::new(|stage, inputs| {
        let x = first(inputs);
        Ok(match stage {
            "a" => out("a", &x),
            "b" => out("b", &x.iter().map(|v| v * 2.0).collect::<Vec<_>>()),
            "c" => out("c", &x.iter().map(|v| -v).collect::<Vec<_>>()),
            _ => {
                let (b, c) = (floats(inputs, "b"), floats(inputs, "c"));
                out("sum", &b.iter().zip(&c).map(|(b, c)| b + c).collect::<Vec<_>>())
            }
        })
    })
}

const DIAMOND: &str = r#"[{"name": "a", "component": "A"},
    {"name": "b", "component": "B", "parents": ["a"]}, {"name": "c", "component": "C", "parents": ["a"]},
    {"name": "d", "component": "D", "parents": ["b", "c"]}]"#;

#[tokio::test]
async fn a_fan_in_meets_and_answers_once() {
    let t = TestNode::new(&app(1000.0, DIAMOND), diamond()).await;
    let ans = t.infer("p", &[("x", &[1.0, 2.0])]).await.unwrap();
    assert_eq!(floats(&ans.outputs, "sum"), vec![1.0, 2.0], "2x + -x");
    assert!(ans.id.is_some() && ans.fallback.is_none());
    let p = t.node.pipeline("p").unwrap();
    assert_eq!(p.metrics.ok.load(Relaxed), 1);
    assert_eq!(p.inflight(), 0, "settled in the gate's books");
    for s in &p.stages {
        assert_eq!(s.metrics.requests.load(Relaxed), 1, "stage {} ran once", s.name);
    }
}

#[tokio::test]
async fn a_request_past_its_deadline_is_answered_504_at_the_deadline() {
    let fake = Fake::echo().delay("a", Duration::from_millis(300));
    let t = TestNode::new(&app(1000.0, r#"[{"name": "a", "component": "A"}]"#), fake).await;
    let t0 = Instant::now();
    let e = t.infer_within("p", &[("x", &[1.0, 2.0])], Some(Duration::from_millis(50))).await.err().unwrap();
    assert!(matches!(e, NodeError::DeadlineExceeded { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_millis(250), "answered at the deadline, not when the batch ended");
    let p = t.node.pipeline("p").unwrap();
    assert_eq!(p.metrics.errors.since_reset().get("deadline_exceeded"), Some(&1));
    assert_eq!(p.inflight(), 0);
}

#[tokio::test]
async fn a_request_whose_client_goes_away_is_cancelled_and_its_work_skipped() {
    let fake = Fake::echo().delay("a", Duration::from_millis(150));
    let t = TestNode::new(
        &app(5000.0, r#"[{"name": "a", "component": "A"}, {"name": "b", "component": "B", "parents": ["a"]}]"#),
        fake.clone(),
    )
    .await;
    let infer = t.infer("p", &[("x", &[1.0, 2.0])]);
    // Dropped while stage a runs.
    assert!(tokio::time::timeout(Duration::from_millis(50), infer).await.is_err());
    tokio::time::sleep(Duration::from_millis(250)).await;
    let p = t.node.pipeline("p").unwrap();
    assert_eq!(p.metrics.cancelled.load(Relaxed), 1);
    assert_eq!(p.inflight(), 0, "off the gate's books");
    assert_eq!(p.stages[1].metrics.requests.load(Relaxed), 0, "b never ran for it");
    assert_eq!(t.node.inflight(), 0);
}

#[tokio::test]
async fn a_replica_removed_while_the_node_starts_does_not_fail_its_start() {
    // As when a placement change moves a cluster node's first replica away
    // before it came up: the node starts with the others.
    let stages = r#"[{"name": "a", "component": "A", "replicas": 2}]"#;
    let t = TestNode::new(&app(5000.0, stages), Fake::echo().remove_next_start("a")).await;
    let st = &t.node.pipeline("p").unwrap().stages[0];
    until("the removed replica leaves its stage", || st.replicas().len() == 1).await;
    let ans = t.infer("p", &[("x", &[3.0, 4.0])]).await.unwrap();
    assert_eq!(floats(&ans.outputs, "x"), vec![3.0, 4.0]);
}

#[tokio::test]
async fn a_lost_executor_s_batch_is_retried_once_on_a_sibling_else_503() {
    let stages = r#"[{"name": "a", "component": "A", "replicas": 2}]"#;
    let fake = Fake::echo();
    let t = TestNode::new(&app(5000.0, stages), fake.clone()).await;
    fake.lose_next("a");
    let ans = t.infer("p", &[("x", &[3.0, 4.0])]).await.unwrap();
    assert_eq!(floats(&ans.outputs, "x"), vec![3.0, 4.0]);
    let st = &t.node.pipeline("p").unwrap().stages[0];
    assert_eq!((st.metrics.retries.load(Relaxed), st.metrics.restarts.load(Relaxed)), (1, 1));
    // One replica: nowhere to retry.
    let fake = Fake::echo();
    let t = TestNode::new(&app(5000.0, r#"[{"name": "a", "component": "A"}]"#), fake.clone()).await;
    fake.lose_next("a");
    let e = t.infer("p", &[("x", &[3.0, 4.0])]).await.err().unwrap();
    assert!(matches!(e, NodeError::Unavailable { .. }), "{e}");
    assert_eq!(e.http_status(), 503);
    // The replica comes back and serves.
    until("the replica comes back", || t.node.pipeline("p").unwrap().stages[0].replicas()[0].phase() == Phase::Ready)
        .await;
    assert!(t.infer("p", &[("x", &[3.0, 4.0])]).await.is_ok());
}

#[tokio::test]
async fn parallel_branches_lost_together_are_each_retried() {
    // b and c run at once; both lose their executor (as when one node
    // holding both is killed): each stage's work is retried once, so the
    // request is answered (a single retry per request failed the second).
    let stages = r#"[{"name": "a", "component": "A"},
        {"name": "b", "component": "B", "parents": ["a"], "replicas": 2},
        {"name": "c", "component": "C", "parents": ["a"], "replicas": 2},
        {"name": "d", "component": "D", "parents": ["b", "c"]}]"#;
    let fake = diamond();
    let t = TestNode::new(&app(5000.0, stages), fake.clone()).await;
    fake.lose_next("b");
    fake.lose_next("c");
    let ans = t.infer("p", &[("x", &[1.0, 2.0])]).await.unwrap();
    assert_eq!(floats(&ans.outputs, "sum"), vec![1.0, 2.0]);
    let p = t.node.pipeline("p").unwrap();
    assert_eq!((p.stages[1].metrics.retries.load(Relaxed), p.stages[2].metrics.retries.load(Relaxed)), (1, 1));
}

#[tokio::test]
async fn a_warm_standby_stands_in_for_a_lost_replica_and_stays_a_standby() {
    let fake = Fake::echo();
    let t = TestNode::new(&app(5000.0, r#"[{"name": "a", "component": "A"}]"#), fake.clone()).await;
    let p = t.node.pipeline("p").unwrap();
    let c = t.node.change(&p, 0, Change::Stand(1));
    assert_eq!((c.from, c.to, c.added.len()), (1, 1, 1));
    assert!(t.node.change(&p, 0, Change::Stand(1)).added.is_empty(), "one is kept, not one more");
    let st = &p.stages[0];
    let standby = st.replicas().iter().find(|r| r.is_standby()).unwrap().clone();
    until("the standby is warm", || standby.phase() == Phase::Standby).await;
    // The serving replica loses its executor with the batch: the standby
    // runs it (no 503), and is still a standby afterwards.
    fake.lose_next("a");
    let ans = t.infer("p", &[("x", &[3.0, 4.0])]).await.unwrap();
    assert_eq!(floats(&ans.outputs, "x"), vec![3.0, 4.0]);
    assert_eq!(st.metrics.retries.load(Relaxed), 1);
    assert!(standby.is_standby() && standby.phase() == Phase::Standby);
    assert_eq!(t.node.census(&p, 0), (1, 1), "one serving (restarted), one standby");
    // Placed elsewhere: the standby drains.
    let c = t.node.change(&p, 0, Change::Stand(0));
    assert_eq!(c.draining, vec![standby.id]);
}

#[tokio::test]
async fn a_drained_replica_leaves_though_its_node_last_reported_a_backlog() {
    let stages = r#"[{"name": "a", "component": "A", "replicas": 2}]"#;
    let t = TestNode::new(&app(5000.0, stages), Fake::echo()).await;
    let st = &t.node.pipeline("p").unwrap().stages[0];
    let r = st.replicas()[0].clone();
    // Another node's work, as a remote replica's node reports it: not this
    // replica's to finish (before, a drained remote replica whose node had
    // left waited for it until the node's exit aborted it).
    r.set_backlog(3);
    assert!(r.drain());
    until("the drained replica leaves its stage", || !st.replicas().iter().any(|x| x.id == r.id)).await;
}

#[tokio::test]
async fn a_stage_whose_chunks_reached_the_client_is_not_retried() {
    // A retry would stream the chunks again from the first.
    let stages = r#"[{"name": "a", "component": "A", "replicas": 2}]"#;
    let t = TestNode::new(&app(5000.0, stages), Fake::echo().delay("a", Duration::from_secs(1))).await;
    let pipe = t.node.pipeline("p").unwrap();
    let st = &pipe.stages[0];
    until("both replicas are ready", || st.replicas().iter().all(|r| r.phase() == Phase::Ready)).await;
    let now = Instant::now();
    let bytes: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let inputs = HeapTensors(vec![("x".into(), DType::Float32, vec![1, 2], bytes)]).to_arena(t.node.arena()).unwrap();
    let route = vec![st.replicas()[0].clone()];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let ticket = crate::pipeline::Ticket::new(1, now, now + Duration::from_secs(5), route);
    let (req, _answer) = crate::Request::for_stage(pipe.clone(), 0, inputs.clone(), ticket, Some(tx));
    assert!(req.wants_chunks(0));
    // A request that has streamed nothing may be retried once.
    let (other, _) = crate::Request::for_stage(
        pipe.clone(),
        0,
        inputs.clone(),
        crate::pipeline::Ticket::new(2, now, now + Duration::from_secs(5), vec![st.replicas()[0].clone()]),
        None,
    );
    assert!(!other.wants_chunks(0), "no chunk channel: nobody to pass chunks to");
    assert!(crate::replica::Job::mark_retried(&*other, 0));
    req.push_chunk(0, inputs);
    assert!(rx.try_recv().is_ok(), "the chunk was passed on");
    assert!(!crate::replica::Job::mark_retried(&*req, 0), "a stage that streamed is not retried");
}

#[tokio::test]
async fn work_waits_for_a_serving_replica_coming_back_not_a_standby_warming_up() {
    // The serving replica loses its worker and restarts (300 ms); a standby
    // added meanwhile takes 3 s to warm up. New work waits for the serving
    // replica: queued on the cold standby, it waited there for its
    // deadline (a rolling restart's 504 in CI).
    let fake = Fake::echo();
    let t = TestNode::new(&app(5000.0, r#"[{"name": "a", "component": "A"}]"#), fake.clone()).await;
    let p = t.node.pipeline("p").unwrap();
    let serving = p.stages[0].replicas()[0].clone();
    until("the replica is ready", || serving.phase() == Phase::Ready).await;
    fake.slow_starts(Duration::from_millis(300), Duration::from_secs(3));
    fake.lose_next("a");
    assert!(t.infer("p", &[("x", &[1.0])]).await.is_err(), "nowhere to retry the lost batch");
    t.node.change(&p, 0, Change::Stand(1));
    assert!(serving.phase() != Phase::Ready, "the serving replica is restarting");
    let (errors, took) = eight_at_once(&t).await;
    assert!(errors.is_empty(), "{errors:?}");
    assert!(took < Duration::from_secs(2), "served once the replica came back: {took:?}");
}

/// Eight requests to pipeline `p` at once: the errors among the answers,
/// and how long the last one took.
async fn eight_at_once(t: &TestNode) -> (Vec<NodeError>, Duration) {
    let t0 = Instant::now();
    let x = [("x", &[1.0f32][..])];
    let a = tokio::join!(
        t.infer("p", &x),
        t.infer("p", &x),
        t.infer("p", &x),
        t.infer("p", &x),
        t.infer("p", &x),
        t.infer("p", &x),
        t.infer("p", &x),
        t.infer("p", &x)
    );
    let errors = [a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7].into_iter().filter_map(Result::err).collect();
    (errors, t0.elapsed())
}

#[tokio::test]
async fn work_queued_on_a_replica_still_starting_goes_to_a_sibling_that_comes_back_first() {
    // A second replica starts slowly (3 s, a cold worker on a busy
    // machine); the first loses its worker and restarts in 300 ms. Work
    // that arrived while neither served queued on either; what queued on
    // the slow one is taken over by the first when it is back, instead of
    // waiting there for 3 s (a rolling restart's 504s in CI).
    let fake = Fake::echo();
    let t = TestNode::new(&app(5000.0, r#"[{"name": "a", "component": "A"}]"#), fake.clone()).await;
    let p = t.node.pipeline("p").unwrap();
    let st = &p.stages[0];
    let first = st.replicas()[0].clone();
    until("the first replica is ready", || first.phase() == Phase::Ready).await;
    fake.slow_starts(Duration::from_secs(3), Duration::from_secs(3));
    t.node.change(&p, 0, Change::Set(2));
    until("the second replica is starting", || st.replicas().len() == 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await; // its start has begun (and takes 3 s)
    fake.slow_starts(Duration::from_millis(300), Duration::from_secs(3));
    fake.lose_next("a");
    assert!(t.infer("p", &[("x", &[1.0])]).await.is_err(), "nowhere to retry the lost batch");
    assert!(st.replicas().iter().all(|r| r.phase() != Phase::Ready), "neither serves");
    let (errors, took) = eight_at_once(&t).await;
    assert!(errors.is_empty(), "{errors:?}");
    assert!(took < Duration::from_secs(2), "served once the first replica came back: {took:?}");
    assert!(st.replicas().iter().any(|r| r.phase() != Phase::Ready), "the second is still starting");
}

/// Waits until `f` holds (5 s at most).
async fn until(what: &str, f: impl Fn() -> bool) {
    tokio::time::timeout(Duration::from_secs(5), async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}"));
}

#[tokio::test]
async fn a_replica_placed_elsewhere_serves_until_another_one_does() {
    let t = TestNode::new(&app(5000.0, r#"[{"name": "a", "component": "A"}]"#), Fake::echo()).await;
    let p = t.node.pipeline("p").unwrap();
    let st = &p.stages[0];
    let old = st.replicas()[0].clone();
    until("the first replica is ready", || old.phase() == Phase::Ready).await;
    // Placed elsewhere while nothing else of the stage serves here (the
    // replica that replaces it is still starting on another node): it
    // keeps serving, past the grace period, instead of leaving the stage
    // empty.
    let c = t.node.change(&p, 0, Change::Place(0));
    assert_eq!((c.from, c.to, c.draining.clone()), (1, 0, vec![old.id]));
    assert!(old.leaving());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(old.phase(), Phase::Ready);
    let ans = t.infer("p", &[("x", &[1.0, 2.0])]).await.unwrap();
    assert_eq!(floats(&ans.outputs, "x"), vec![1.0, 2.0]);
    // Once another replica serves, it drains after the grace period.
    let c = t.node.change(&p, 0, Change::Place(1));
    assert_eq!((c.from, c.to, c.added.len()), (0, 1, 1));
    let new = st.replicas().iter().find(|r| r.id == c.added[0]).unwrap().clone();
    until("the new replica is ready", || new.phase() == Phase::Ready).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(old.phase(), Phase::Ready, "the grace period: other nodes catch up");
    until("the replaced replica drains", || !old.phase().will_serve()).await;
}

/// A join that runs both candidates and answers with the first that arrived.
struct First {
    candidates: Vec<String>,
    wait: Duration,
    late: AtomicUsize,
}

impl JoinPolicy for First {
    fn name(&self) -> &str {
        "first"
    }
    fn candidates(&self) -> &[String] {
        &self.candidates
    }
    fn context_input(&self) -> Option<&str> {
        None
    }
    fn plan(&self, context: Option<String>) -> JoinPlan {
        JoinPlan { chosen: vec![true; self.candidates.len()], weights: vec![1.0; self.candidates.len()], context }
    }
    fn cutoff(&self, dispatched: Instant, deadline: Instant, rest: Duration) -> Instant {
        (dispatched + self.wait).min(deadline - rest)
    }
    fn combine(&self, _: u64, _: &JoinPlan, arrived: &[Option<Tensors>], _: u64) -> Result<HeapTensors, String> {
        let (i, t) = arrived.iter().enumerate().find_map(|(i, t)| t.as_ref().map(|t| (i, t))).ok_or("none")?;
        let mut h = HeapTensors::of(t);
        h.0.push(out("from", &[i as f32]).0.remove(0));
        Ok(h)
    }
    fn late(&self, _: u64, _: usize, _: &Tensors, _: u64) {
        self.late.fetch_add(1, Relaxed);
    }
    fn timing(&self) -> JoinTiming {
        JoinTiming::Fastest
    }
}

#[tokio::test]
async fn a_join_answers_at_its_cutoff_with_what_arrived_and_hears_the_straggler_late() {
    let stages = r#"[{"name": "fast", "component": "F"}, {"name": "slow", "component": "S"},
                     {"name": "after", "component": "X", "parents": ["fast", "slow"]}]"#;
    let fake = Fake::new(|stage, inputs| {
        Ok(if stage == "after" { HeapTensors::of(inputs) } else { out("y", &first(inputs)) })
    })
    .delay("slow", Duration::from_millis(400));
    let join = Arc::new(First {
        candidates: vec!["fast".into(), "slow".into()],
        wait: Duration::from_millis(40),
        late: AtomicUsize::new(0),
    });
    let j = join.clone();
    let t = TestNode::with(&app(2000.0, stages), fake, move |b| b.join(j.clone()).unwrap()).await;
    let t0 = Instant::now();
    let ans = t.infer("p", &[("x", &[5.0, 6.0])]).await.unwrap();
    assert!(t0.elapsed() < Duration::from_millis(300), "did not wait for the straggler: {:?}", t0.elapsed());
    assert_eq!((floats(&ans.outputs, "y"), floats(&ans.outputs, "from")), (vec![5.0, 6.0], vec![0.0]));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(join.late.load(Relaxed), 1, "the straggler's answer reached the policy");
}

/// A hook that answers `x == [9, 9]` itself and remembers what ran.
#[derive(Default)]
struct Nines {
    stored: Mutex<Vec<u128>>,
}

impl StageHook for Nines {
    fn name(&self) -> &'static str {
        "nines"
    }
    fn lookup(&self, inputs: &Tensors) -> Lookup {
        if first(inputs) == [9.0, 9.0] {
            Lookup::Hit(Arc::new(out("x", &[99.0, 99.0])))
        } else {
            Lookup::Miss(first(inputs)[0] as u128)
        }
    }
    fn store(&self, memo: u128, _: &Tensors, _: &Versions) {
        self.stored.lock().push(memo);
    }
    fn status(&self) -> serde_json::Value {
        serde_json::json!({"stored": self.stored.lock().len()})
    }
    fn metrics(&self, t: &mut PromText, labels: &[(&str, &str)]) {
        t.counter("nines_stored_total", "Results stored.", labels, self.stored.lock().len() as u64);
    }
}

#[tokio::test]
async fn a_stage_hook_answers_without_the_stage_and_sees_every_result() {
    let fake = Fake::echo();
    let hook = Arc::new(Nines::default());
    let h = hook.clone();
    let t = TestNode::with(&app(2000.0, r#"[{"name": "a", "component": "A"}]"#), fake.clone(), move |b| {
        b.hook("a", h.clone()).unwrap()
    })
    .await;
    let hit = t.infer("p", &[("x", &[9.0, 9.0])]).await.unwrap();
    assert_eq!(floats(&hit.outputs, "x"), vec![99.0, 99.0]);
    assert_eq!(fake.batches.load(Relaxed), 0, "no batch ran");
    let miss = t.infer("p", &[("x", &[7.0, 1.0])]).await.unwrap();
    assert_eq!(floats(&miss.outputs, "x"), vec![7.0, 1.0]);
    assert_eq!(*hook.stored.lock(), vec![7], "its memo came back with the result");
    let status = t.node.status();
    assert_eq!(status["pipelines"][0]["stages"][0]["nines"]["stored"], 1);
    assert!(t.node.prometheus().contains("nines_stored_total{pipeline=\"p\",stage=\"a\"} 1"));
}

#[tokio::test]
async fn replica_sets_change_through_one_owner_to_the_counts_asked() {
    let stages = r#"[{"name": "a", "component": "A", "replicas": 1, "min_replicas": 1, "max_replicas": 4}]"#;
    let t = TestNode::new(&app(2000.0, stages), Fake::echo()).await;
    let node = &t.node;
    let p = node.pipeline("p").unwrap();
    let c = node.scale("p", "a", 3).unwrap();
    assert_eq!((c.from, c.to, c.added.len()), (1, 3, 2));
    // An autoscaler that counted 1 asks for 2: it is not added to 3.
    let c = node.change(&p, 0, Change::Scale(ScaleAction::Grow { to: 2, max: 4 }));
    assert_eq!((c.from, c.to, c.added.len()), (3, 3, 0));
    let c = node.scale("p", "a", 1).unwrap();
    assert_eq!((c.to, c.draining.len()), (1, 2));
    // A standby, then a scale that promotes it before starting another.
    let c = node.change(&p, 0, Change::Scale(ScaleAction::AddStandby { max: 4 }));
    assert_eq!(c.added.len(), 1);
    let c = node.change(&p, 0, Change::Scale(ScaleAction::AddStandby { max: 4 }));
    assert!(c.added.is_empty(), "one standby at a time");
    let c = node.scale("p", "a", 3).unwrap();
    assert_eq!((c.promoted, c.added.len(), c.to), (1, 1, 3));
    assert!(matches!(node.scale("p", "a", 0), Err(NodeError::BadInput(_))));
    assert!(matches!(node.scale("p", "zz", 2), Err(NodeError::UnknownStage { .. })));
}
