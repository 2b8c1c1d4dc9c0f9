//! An operator's `slipstream scale` and autoscale ticks at the same time:
//! every count the stage reaches is one that one of them asked for.
//!
//! Before replica sets had one owner, a tick that had counted one serving
//! replica added a second while an operator's scale to three was adding
//! two: four serving, which nobody asked for.

use slipstream_autoscale::Autoscaler;
use slipstream_core::scaling::Change;
use slipstream_core::testing::{Fake, TestNode};
use slipstream_core::Node;
use slipstream_sched::scale::{ScaleOptions, ScalePolicy};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

const APP: &str = r#"{
  "pipelines": [{"name": "p", "inputs": {"x": {"dtype": "float32", "shape": [-1, 2]}},
                 "slo": {"p99_ms": 100},
                 "stages": [{"name": "a", "component": "A", "replicas": 1, "min_replicas": 1, "max_replicas": 4}]}],
  "profiles": [{"pipeline": "p", "stages": {"a": {"points": [{"batch": 1, "mean_ms": 10, "p99_ms": 10}, {"batch": 2, "mean_ms": 20, "p99_ms": 20}]}}}]
}"#;

/// Serving replicas of the stage (starting ones included; not standbys),
/// counted under the owner's lock: replica by replica without it, a count
/// could straddle a change (one replica read before a scale-down, another
/// after the scale-up that followed) and see a total that never was.
fn serving(node: &Node) -> usize {
    let p = node.pipeline("p").unwrap();
    node.census(&p, 0).0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_scaling_and_autoscale_ticks_never_overshoot() {
    let t = TestNode::new(APP, Fake::echo()).await;
    let node = t.node.clone();
    let pipe = node.pipeline("p").unwrap();
    // 100 req/s on replicas of 100 req/s at 75% busy: the autoscaler wants 2.
    let opts = ScaleOptions { policy: ScalePolicy::Anticipatory, cores: 8.0, ..ScaleOptions::default() };
    let auto = Arc::new(Autoscaler::new(opts, node.pipelines().values()));
    let done = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicUsize::new(0));

    let watcher = {
        let (node, done, most) = (node.clone(), done.clone(), most.clone());
        tokio::spawn(async move {
            while !done.load(Relaxed) {
                most.fetch_max(serving(&node), Relaxed);
                tokio::task::yield_now().await;
            }
        })
    };
    let ticks = {
        let (node, auto, pipe) = (node.clone(), auto.clone(), pipe.clone());
        tokio::task::spawn_blocking(move || {
            for _ in 0..5000 {
                pipe.metrics.admitted.fetch_add(10, Relaxed);
                auto.tick(&node, 0.1);
            }
        })
    };
    let operator = {
        let node = node.clone();
        tokio::task::spawn_blocking(move || {
            for i in 0..5000 {
                let want = if i % 2 == 0 { 3 } else { 1 };
                let c = node.scale("p", "a", want).unwrap();
                assert_eq!(c.to, want, "the scale's own count");
            }
        })
    };
    ticks.await.unwrap();
    operator.await.unwrap();
    // The operator's last word, then one more tick at the same load.
    node.scale("p", "a", 1).unwrap();
    pipe.metrics.admitted.fetch_add(10, Relaxed);
    auto.tick(&node, 0.1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    done.store(true, Relaxed);
    watcher.await.unwrap();
    assert!(most.load(Relaxed) <= 3, "{} serving replicas: more than anyone asked for", most.load(Relaxed));
    assert_eq!(serving(&node), 2, "the autoscaler's need after the operator's 1");
    // And the owner's view agrees with the census.
    let c = node.change(&pipe, 0, Change::Set(2));
    assert_eq!((c.from, c.to), (2, 2));
}
