//! What the node tells about itself: the `/v1/status` document (what
//! `slipstream status` prints) and the Prometheus text on `/metrics`.
//!
//! Read-only: everything here is a snapshot of counters, histograms,
//! published replica loads and the event ring. `/v1/status` shows the
//! counts since the last `reset-metrics`; `/metrics` shows them since the
//! process started and exports latencies as Prometheus histograms (why, and
//! the bucket boundaries: [`crate::metrics`]). Every family is declared even
//! before it has samples, so the exported names do not depend on traffic
//! (the Grafana dashboard in `deploy/grafana/` is checked against them).
//!
//! The core writes its own part; each stage hook adds its block to its
//! stage's, and each registered [`crate::ext::Service`] adds its own
//! blocks and families, without this module knowing what they are.

use crate::ext::StatusDoc;
use crate::metrics::{le_label, slo_bound_us};
use crate::node::Node;
use crate::prom::PromText;
use crate::replica::Phase;
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;

impl Node {
    /// `GET /v1/status`.
    pub fn status(&self) -> Value {
        let mut doc = StatusDoc::new(core_status(self));
        for s in self.services() {
            s.status(&mut doc);
        }
        doc.into_value()
    }

    /// `GET /metrics` in Prometheus text format.
    pub fn prometheus(&self) -> String {
        let mut t = PromText::default();
        core_metrics(self, &mut t);
        for s in self.services() {
            s.metrics(&mut t);
        }
        t.finish()
    }
}

/// The core's part of the status document.
fn core_status(node: &Node) -> Value {
    let ms = 1000.0;
    let pipelines: Vec<Value> = node
        .pipelines()
        .values()
        .map(|p| {
            let stages: Vec<Value> = p
                .stages
                .iter()
                .map(|s| {
                    let m = &s.metrics;
                    let set = s.replicas();
                    json!({
                        "name": s.name,
                        "component": s.component,
                        "max_batch_size": s.max_batch,
                        "concurrency": s.concurrency,
                        "threads": s.threads,
                        "ready": s.is_ready(),
                        "replicas": set.iter().map(|r| {
                            let l = r.load();
                            // A remote replica's device is its own node's business.
                            let (device, gpu) = if r.is_local() { s.device_of(r) } else { (String::new(), None) };
                            json!({
                                "id": r.id,
                                "state": r.phase().name(),
                                "pid": r.pid(),
                                "healthy": r.phase() == Phase::Ready,
                                "queue": l.queued,
                                "outstanding": l.outstanding,
                                "batch_limit": r.batch_limit(),
                                "node": r.remote.as_ref().map(|at| at.node.as_str()),
                                "leaving": r.leaving(),
                                "standby": r.is_standby(),
                                "device": (!device.is_empty()).then_some(device),
                                "gpu": gpu,
                            })
                        }).collect::<Vec<_>>(),
                        "batches": m.batches.load(Relaxed),
                        "requests": m.requests.load(Relaxed),
                        "errors": m.errors.load(Relaxed),
                        "retries": m.retries.load(Relaxed),
                        "dropped_late": m.dropped_late.load(Relaxed),
                        "slack_ms": m.slack_us.summary(ms),
                        "late_dispatch_ms": m.late_us.summary(ms),
                        "batch_limit": set.iter().map(|r| r.batch_limit()).max().unwrap_or(0),
                        "restarts": m.restarts.load(Relaxed),
                        "batch_size": m.batch_size.summary(1.0),
                        "queue_wait_ms": m.queue_wait_us.summary(ms),
                        "compute_ms": m.compute_us.summary(ms),
                        "hop_ms": m.hop_us.summary(ms),
                    })
                })
                .collect();
            let gate = p.gate.lock();
            json!({
                "name": p.name(),
                "ready": node.pipeline_ready(p),
                "slo": p.spec.slo.map(|s| json!({"p99_ms": s.p99_ms, "max_miss_rate": s.max_miss_rate})),
                "sizing": p.spec.sizing,
                "ok": p.metrics.ok.load(Relaxed),
                "admitted": p.metrics.admitted.load(Relaxed),
                "shed": p.metrics.shed.load(Relaxed),
                "cancelled": p.metrics.cancelled.load(Relaxed),
                "admission_headroom": gate.headroom(),
                "admission": {
                    "headroom": gate.headroom(),
                    "inflight": gate.inflight(),
                    "sojourn_ms": gate.sojourn_ns() as f64 / 1e6,
                },
                "slo_met": p.metrics.slo_met.load(Relaxed),
                "slo_missed": p.metrics.slo_missed.load(Relaxed),
                "fallback": p.metrics.fallback.load(Relaxed),
                "errors": p.metrics.errors.since_reset(),
                "latency_ms": p.metrics.latency_us.summary(ms),
                "stages": stages,
            })
        })
        .collect();
    let mut doc = json!({
        "pid": std::process::id(),
        "uptime_s": node.uptime().as_secs_f64(),
        "ready": node.is_ready(),
        "draining": node.is_draining(),
        "inflight": node.inflight(),
        "copies": node.arena().copies.snapshot(),
        "arena": node.arena().usage(),
        "arena_used_bytes": node.arena().used_bytes(),
        "pipelines": pipelines,
        "store": {
            "path": node.store().dir(),
            "seq": node.store().seq(),
        },
        "cluster": null,
        "events": node.events().recent(),
    });
    let mut hooked = StatusDoc::new(std::mem::take(&mut doc));
    for p in node.pipelines().values() {
        for s in &p.stages {
            if let Some((name, v)) = s.hook_status() {
                hooked.set_stage(p.name(), &s.name, name, v);
            }
        }
    }
    hooked.into_value()
}

/// The core's families in `/metrics`.
fn core_metrics(node: &Node, t: &mut PromText) {
    let failed = ("slipstream_requests_failed_total", "Requests answered with an error (or refused), by kind.");
    t.declare(failed.0, "counter", failed.1);
    let slo_target = (
        "slipstream_pipeline_slo_seconds",
        "The pipeline's SLO latency target; `bucket` names its le in slipstream_request_latency_seconds.",
    );
    t.declare(slo_target.0, "gauge", slo_target.1);
    let slo_miss = ("slipstream_pipeline_slo_max_miss_rate", "Share of requests the SLO allows to miss the target.");
    t.declare(slo_miss.0, "gauge", slo_miss.1);
    for p in node.pipelines().values() {
        let pl = [("pipeline", p.name())];
        let m = &p.metrics;
        for (name, help, v) in [
            ("slipstream_requests_ok_total", "Requests answered successfully.", &m.ok),
            ("slipstream_requests_admitted_total", "Requests let in by admission control.", &m.admitted),
            (
                "slipstream_requests_shed_total",
                "Requests refused at ingress (429): predicted to miss the SLO.",
                &m.shed,
            ),
            (
                "slipstream_requests_cancelled_total",
                "Admitted requests whose client went away before the answer.",
                &m.cancelled,
            ),
            ("slipstream_slo_met_total", "Requests answered within their deadline (goodput).", &m.slo_met),
            ("slipstream_slo_missed_total", "Requests answered after their deadline.", &m.slo_missed),
            ("slipstream_fallback_total", "Requests answered with the declared fallback.", &m.fallback),
        ] {
            t.counter(name, help, &pl, v.total());
        }
        for (kind, n) in m.errors.totals() {
            t.counter(failed.0, failed.1, &[pl[0], ("kind", kind)], n);
        }
        t.histogram(
            "slipstream_request_latency_seconds",
            "Latency of answered requests inside the node (body read to answer ready); every pipeline's SLO target is a bucket boundary.",
            &pl,
            &m.latency_us,
            1e6,
        );
        let (headroom, inflight) = {
            let g = p.gate.lock();
            (g.headroom(), g.inflight())
        };
        t.gauge(
            "slipstream_admission_headroom",
            "Share of its deadline budget a new request's predicted finish may use (learned).",
            &pl,
            headroom,
        );
        t.gauge("slipstream_admission_inflight", "Admitted requests not finished yet.", &pl, inflight as f64);
        if let Some(slo) = p.spec.slo {
            // `bucket` is the target's `le` in the latency histogram, so that
            // `... _bucket and on (pipeline, le) label_replace(this, "le", "$1", "bucket", "(.*)")`
            // selects the bucket of answers within the target (exact SLO attainment).
            let le = le_label(slo_bound_us(slo.p99_ms), 1e6);
            t.gauge(slo_target.0, slo_target.1, &[pl[0], ("bucket", &le)], slo.p99_ms / 1e3);
            t.gauge(slo_miss.0, slo_miss.1, &pl, slo.max_miss_rate);
        }
        t.gauge(
            "slipstream_pipeline_ready",
            "1 while every stage has a serving replica.",
            &pl,
            f64::from(u8::from(node.pipeline_ready(p))),
        );
        for s in &p.stages {
            let l = [("pipeline", p.name()), ("stage", s.name.as_str())];
            let m = &s.metrics;
            for (name, help, v) in [
                ("slipstream_stage_batches_total", "Batches run.", &m.batches),
                ("slipstream_stage_requests_total", "Requests run.", &m.requests),
                ("slipstream_stage_errors_total", "Requests failed by the component.", &m.errors),
                ("slipstream_stage_retries_total", "Requests retried after a worker died.", &m.retries),
                ("slipstream_stage_restarts_total", "Worker restarts.", &m.restarts),
                (
                    "slipstream_stage_dropped_late_total",
                    "Requests dropped after their deadline passed.",
                    &m.dropped_late,
                ),
            ] {
                t.counter(name, help, &l, v.total());
            }
            let set = s.replicas();
            let depth: u64 = set.iter().map(|r| r.load().queued as u64).sum();
            t.gauge("slipstream_stage_queue_depth", "Requests waiting.", &l, depth as f64);
            for phase in [Phase::Starting, Phase::Ready, Phase::Standby, Phase::Down, Phase::Draining] {
                let n = set.iter().filter(|r| r.phase() == phase).count();
                t.gauge(
                    "slipstream_stage_replicas",
                    "Replicas by state.",
                    &[l[0], l[1], ("state", phase.name())],
                    n as f64,
                );
            }
            t.gauge(
                "slipstream_stage_batch_size_mean",
                "Mean requests per batch since the last metrics reset.",
                &l,
                m.batch_size.summary(1.0).mean,
            );
            t.histogram("slipstream_stage_batch_size", "Requests per batch.", &l, &m.batch_size, 1.0);
            for (name, help, h) in [
                ("slipstream_stage_queue_wait_seconds", "Time from enqueue to dispatch.", &m.queue_wait_us),
                ("slipstream_stage_compute_seconds", "Component time per batch.", &m.compute_us),
                ("slipstream_stage_hop_seconds", "Node-worker-node overhead per batch.", &m.hop_us),
                (
                    "slipstream_stage_slack_seconds",
                    "Deadline slack of the most urgent request at dispatch, when it was not late.",
                    &m.slack_us,
                ),
                (
                    "slipstream_stage_dispatch_lateness_seconds",
                    "How late the most urgent request was at dispatch, when it was late (drop_late=False).",
                    &m.late_us,
                ),
            ] {
                t.histogram(name, help, &l, h, 1e6);
            }
            s.hook_metrics(t, &l);
        }
    }
    t.gauge(
        "slipstream_store_seq",
        "Sequence number of the store's last committed change.",
        &[],
        node.store().seq() as f64,
    );
    let c = node.arena().copies.snapshot();
    for (site, n, b) in [
        ("body_join", c.body_join, c.body_join_bytes),
        ("ingress", c.ingress, c.ingress_bytes),
        ("gather", c.gather, c.gather_bytes),
        ("worker", c.worker, c.worker_bytes),
        ("egress", c.egress, c.egress_bytes),
    ] {
        t.counter("slipstream_payload_copies_total", "Payload copies by site.", &[("site", site)], n);
        t.counter("slipstream_payload_copied_bytes_total", "Payload bytes copied by site.", &[("site", site)], b);
    }
    t.gauge("slipstream_arena_used_bytes", "Shared-memory bytes in use.", &[], node.arena().used_bytes() as f64);
}
