//! Two of Triton's protocol extensions, which the ecosystem's tools (Triton's
//! `perf_analyzer`, its model analyzer, KServe's clients) ask for beside the
//! Open Inference Protocol: a model's configuration (`GET
//! /v2/models/{name}/config`) and its statistics (`GET
//! /v2/models[/{name}]/stats`), in Triton's JSON shapes, one pipeline per
//! model.
//!
//! The configuration describes a pipeline as a client must call it: every
//! request carries its tensors whole (`max_batch_size` 0, the dimensions as
//! declared, -1 where any size goes), while the node forms batches across
//! requests itself (`dynamic_batching`, with the largest batch its first
//! stage runs; the stages are under `parameters`).
//!
//! The statistics are totals since the node started, never reset (a client
//! takes differences, as `perf_analyzer` does): `success` counts answered
//! requests with their time in the node; `fail` the failed and refused;
//! `queue` the time requests waited in stage queues, summed over the
//! stages; `compute_infer` the components' own time and `compute_input` the
//! node-to-worker hops, per batch weighted by the stage's mean batch size
//! (a request's share of the batches it rode in). Counts of the per-phase
//! entries are answered requests, so `ns / count` is a request's mean.

/// The protocol extensions the node serves, as its server metadata lists
/// them (`GET /v2`, gRPC `ServerMetadata`): tools such as perf_analyzer ask
/// for statistics only from a server that lists them.
pub(crate) const EXTENSIONS: [&str; 3] = ["binary_tensor_data", "model_configuration", "statistics"];

use serde_json::{json, Map, Value};
use slipstream_core::{Node, NodeError, PipelineRt};
use slipstream_kserve::inference::{
    model_instance_group::Kind, model_version_policy::Latest, DataType, InferStatistics, ModelConfig,
    ModelDynamicBatching, ModelInput, ModelInstanceGroup, ModelOutput, ModelParameter, ModelStatistics,
    ModelTransactionPolicy, ModelVersionPolicy, StatisticDuration,
};
use slipstream_types::TensorSpec;

/// Triton's name for a tensor element type (`TYPE_FP32`; strings are `TYPE_STRING`).
fn data_type(spec: &TensorSpec) -> DataType {
    let name = match spec.dtype.v2_name() {
        "BYTES" => "TYPE_STRING".to_string(),
        name => format!("TYPE_{name}"),
    };
    DataType::from_str_name(&name).unwrap_or(DataType::TypeInvalid)
}

fn dims(spec: &TensorSpec) -> Vec<i64> {
    spec.shape.clone()
}

/// A pipeline's configuration (see the module doc).
pub(crate) fn model_config(p: &PipelineRt) -> ModelConfig {
    let first = p.stages.first();
    let mut parameters: std::collections::HashMap<String, ModelParameter> = p
        .stages
        .iter()
        .map(|s| {
            let text = format!("component {}, max batch {}, replicas {}", s.component, s.max_batch, s.live_replicas());
            (format!("stage.{}", s.name), ModelParameter { string_value: text })
        })
        .collect();
    if let Some(slo) = p.spec.slo {
        parameters.insert("slo_p99_ms".into(), ModelParameter { string_value: slo.p99_ms.to_string() });
    }
    let outputs = p.outputs().cloned().unwrap_or_default();
    ModelConfig {
        name: p.name().to_string(),
        platform: "slipstream".into(),
        backend: "slipstream".into(),
        version_policy: Some(ModelVersionPolicy { latest: Some(Latest { num_versions: 1 }) }),
        max_batch_size: 0,
        input: p
            .spec
            .inputs
            .iter()
            .map(|(name, s)| ModelInput { name: name.clone(), data_type: data_type(s).into(), dims: dims(s) })
            .collect(),
        output: outputs
            .iter()
            .map(|(name, s)| ModelOutput { name: name.clone(), data_type: data_type(s).into(), dims: dims(s) })
            .collect(),
        instance_group: vec![ModelInstanceGroup {
            name: p.name().to_string(),
            count: first.map_or(0, |s| s.live_replicas()) as i32,
            kind: Kind::Cpu.into(),
        }],
        dynamic_batching: Some(ModelDynamicBatching {
            preferred_batch_size: vec![first.map_or(1, |s| s.max_batch) as i32],
            max_queue_delay_microseconds: 0,
        }),
        parameters,
        model_transaction_policy: Some(ModelTransactionPolicy { decoupled: false }),
    }
}

fn duration(count: u64, us: f64) -> Option<StatisticDuration> {
    Some(StatisticDuration { count, ns: (us * 1000.0).round() as u64 })
}

/// One pipeline's statistics (see the module doc).
fn pipeline_stats(p: &PipelineRt) -> ModelStatistics {
    let m = &p.metrics;
    let ok = m.ok.total();
    let failed: u64 = m.errors.totals().values().sum();
    let (mut queue_us, mut compute_us, mut hop_us, mut executions) = (0f64, 0f64, 0f64, 0u64);
    for s in &p.stages {
        let t = s.metrics.totals();
        queue_us += s.metrics.queue_wait_us.buckets().sum as f64;
        // Per batch, weighted by the batch's mean size: a request's share.
        let per_request = if t.batches == 0 { 0.0 } else { t.requests as f64 / t.batches as f64 };
        compute_us += s.metrics.compute_us.buckets().sum as f64 * per_request;
        hop_us += s.metrics.hop_us.buckets().sum as f64 * per_request;
        executions = executions.max(t.batches);
    }
    ModelStatistics {
        name: p.name().to_string(),
        version: "1".into(),
        last_inference: 0,
        inference_count: ok,
        execution_count: executions,
        inference_stats: Some(InferStatistics {
            success: duration(ok, m.latency_us.buckets().sum as f64),
            fail: duration(failed, 0.0),
            queue: duration(ok, queue_us),
            compute_input: duration(ok, hop_us),
            compute_infer: duration(ok, compute_us),
            compute_output: duration(ok, 0.0),
            cache_hit: duration(0, 0.0),
            cache_miss: duration(0, 0.0),
        }),
    }
}

/// Every pipeline's statistics (`name` None or empty), or one's.
pub(crate) fn model_stats(node: &Node, name: Option<&str>) -> Result<Vec<ModelStatistics>, NodeError> {
    Ok(match name.filter(|n| !n.is_empty()) {
        Some(n) => vec![pipeline_stats(node.pipeline(n)?.as_ref())],
        None => node.pipelines().values().map(|p| pipeline_stats(p)).collect(),
    })
}

/// Triton's JSON for a configuration (`GET /v2/models/{name}/config`).
pub(crate) fn config_json(c: &ModelConfig) -> Value {
    let type_name = |t: i32| DataType::try_from(t).unwrap_or(DataType::TypeInvalid).as_str_name();
    // serde_json's map keeps its keys sorted: the parameters come out in order.
    let params: Map<String, Value> =
        c.parameters.iter().map(|(k, v)| (k.clone(), json!({"string_value": v.string_value}))).collect();
    let latest = c.version_policy.as_ref().and_then(|v| v.latest.as_ref()).map_or(1, |l| l.num_versions);
    json!({
        "name": c.name,
        "platform": c.platform,
        "backend": c.backend,
        "version_policy": {"latest": {"num_versions": latest}},
        "max_batch_size": c.max_batch_size,
        "input": c.input.iter().map(|i| json!({"name": i.name, "data_type": type_name(i.data_type), "dims": i.dims})).collect::<Vec<_>>(),
        "output": c.output.iter().map(|o| json!({"name": o.name, "data_type": type_name(o.data_type), "dims": o.dims})).collect::<Vec<_>>(),
        "instance_group": c.instance_group.iter().map(|g| json!({
            "name": g.name, "count": g.count,
            "kind": Kind::try_from(g.kind).unwrap_or(Kind::Auto).as_str_name(),
        })).collect::<Vec<_>>(),
        "dynamic_batching": c.dynamic_batching.as_ref().map(|d| json!({
            "preferred_batch_size": d.preferred_batch_size,
            "max_queue_delay_microseconds": d.max_queue_delay_microseconds,
        })),
        "model_transaction_policy": {"decoupled": c.model_transaction_policy.is_some_and(|t| t.decoupled)},
        "parameters": params,
    })
}

/// Triton's JSON for statistics (`GET /v2/models[/{name}]/stats`).
pub(crate) fn stats_json(stats: &[ModelStatistics]) -> Value {
    let d = |x: &Option<StatisticDuration>| {
        let x = x.unwrap_or_default();
        json!({"count": x.count, "ns": x.ns})
    };
    let entries: Vec<Value> = stats
        .iter()
        .map(|s| {
            let i = s.inference_stats.unwrap_or_default();
            json!({
                "name": s.name,
                "version": s.version,
                "last_inference": s.last_inference,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": d(&i.success), "fail": d(&i.fail), "queue": d(&i.queue),
                    "compute_input": d(&i.compute_input), "compute_infer": d(&i.compute_infer),
                    "compute_output": d(&i.compute_output), "cache_hit": d(&i.cache_hit), "cache_miss": d(&i.cache_miss),
                },
                "batch_stats": [],
            })
        })
        .collect();
    json!({ "model_stats": entries })
}
