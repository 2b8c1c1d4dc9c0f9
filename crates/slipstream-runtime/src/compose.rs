//! The composition root: the one place that names every feature.
//!
//! The core builds pipelines and runs requests knowing no feature; here
//! each is installed where it plugs in:
//!
//! - the prediction cache (`slipstream-cache`): a stage hook on each stage
//!   that declares `cache`, and its model follower;
//! - model selection (`slipstream-select`): a join over each selection's
//!   candidates, and the feedback route's handle;
//! - the autoscaler (`slipstream-autoscale`), store triggers
//!   (`slipstream-triggers`), the dashboard's history (`slipstream-history`):
//!   services with their own tasks, status and metrics;
//! - the cluster (`slipstream-cluster`): a launcher for remote replicas and
//!   a service, when the node joins one (started by [`crate::lifecycle`],
//!   which knows the node's addresses).
//!
//! Features depend on the core only, never on each other; what they share
//! goes through the node's public API.

use crate::app::{App, EdgeOptions};
use crate::pacing::RefusalPacer;
use slipstream_autoscale::Autoscaler;
use slipstream_cache::PredictionCache;
use slipstream_core::arena::Arena;
use slipstream_core::pipeline::{BuildContext, BuildError, PipelineBuilder};
use slipstream_core::spec::SpecError;
use slipstream_core::{AppSpec, Node, NodeOptions, PipelineRt};
use slipstream_history::History;
use slipstream_select::{Selections, Selector};
use slipstream_triggers::Triggers;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

/// The app's pipelines with their features installed, before the node exists.
pub(crate) struct Pipelines {
    pub(crate) pipelines: Vec<Arc<PipelineRt>>,
    selections: Selections,
    caches: Vec<Arc<PredictionCache>>,
    scaling: slipstream_sched::scale::ScaleOptions,
}

/// Why the app cannot be built.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ComposeError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Spec(#[from] SpecError),
}

/// Build `spec`'s pipelines on `arena`, each with the hooks and joins its
/// stages declare. `start_replicas`: give each stage its declared replicas
/// (a cluster's placement decides them instead).
pub(crate) fn pipelines(
    spec: &AppSpec,
    opts: &NodeOptions,
    arena: &Arc<Arena>,
    start_replicas: bool,
) -> Result<Pipelines, ComposeError> {
    let spec_err = |pipeline: &str, reason: String| SpecError { pipeline: pipeline.to_string(), reason };
    let scaling = slipstream_autoscale::options(spec.autoscale.as_ref()).map_err(|r| spec_err("-", r))?;
    let cx = BuildContext {
        app: spec,
        arena,
        replica_pool_bytes: opts.replica_pool_bytes,
        request_timeout: opts.request_timeout,
        epoch: Instant::now(),
        start_replicas,
    };
    let mut out = Pipelines { pipelines: Vec::new(), selections: Selections::default(), caches: Vec::new(), scaling };
    for p in &spec.pipelines {
        let mut b = PipelineBuilder::new(p, &cx)?;
        for s in &p.stages {
            if let Some(c) = &s.cache {
                let cache = Arc::new(PredictionCache::new(c, &s.needs));
                b.hook(&s.name, cache.clone()).map_err(|r| spec_err(&p.name, r))?;
                out.caches.push(cache);
            }
        }
        let selectors: Vec<Arc<Selector>> = p.selects.iter().map(|sel| Arc::new(Selector::new(sel))).collect();
        for s in &selectors {
            b.join(s.clone()).map_err(|r| spec_err(&p.name, r))?;
        }
        out.selections.add(&p.name, selectors);
        out.pipelines.push(b.build());
    }
    Ok(out)
}

/// The node's features, installed: services registered for its status and
/// metrics, and the handles the edge serves from.
pub(crate) struct Installed {
    pub(crate) app: Arc<App>,
    pub(crate) autoscaler: Arc<Autoscaler>,
}

/// Install the features of `built` on `node`, and start the ones that run
/// from the start (the dashboard's sampler, the model follower).
pub(crate) fn install(
    node: &Arc<Node>,
    built: Pipelines,
    edge: EdgeOptions,
    stop: &watch::Receiver<bool>,
) -> Installed {
    let selections = Arc::new(built.selections);
    let triggers = Arc::new(Triggers::new(node.pipelines().values()));
    let autoscaler = Arc::new(Autoscaler::new(built.scaling, node.pipelines().values()));
    let history = Arc::new(History::default());
    node.register(selections.clone());
    node.register(triggers.clone());
    node.register(autoscaler.clone());
    // The dashboard's history, from the start: replicas starting and models
    // loading show on it too.
    tokio::spawn(slipstream_history::run(history.clone(), node.clone(), stop.clone()));
    tokio::spawn(slipstream_cache::follow_models(node.clone(), built.caches, stop.clone()));
    let pacer = Arc::new(RefusalPacer::new(edge.refusal_rate, crate::pacing::MAX_HOLD));
    node.register(pacer.clone());
    let cluster = std::sync::OnceLock::new();
    let app = Arc::new(App { node: node.clone(), edge, selections, triggers, history, pacer, cluster });
    Installed { app, autoscaler }
}

/// Start what runs once the node serves: the autoscaler (on one machine; a
/// cluster's placement sets replica counts) and store triggers from
/// `feed_start`.
pub(crate) fn start_serving(installed: &Installed, in_cluster: bool, feed_start: u64, stop: &watch::Receiver<bool>) {
    let node = &installed.app.node;
    if !in_cluster {
        tokio::spawn(slipstream_autoscale::run(installed.autoscaler.clone(), node.clone(), stop.clone()));
    }
    let triggers = &installed.app.triggers;
    if !triggers.is_empty() {
        tokio::spawn(slipstream_triggers::follow(node.clone(), triggers.clone(), stop.clone(), feed_start));
    }
}

/// Connect the edge and the features to the cluster this node joined:
/// feedback forwarded from other nodes is applied by model selection here,
/// and the edge forwards feedback on other nodes' answers.
pub(crate) fn join_cluster(installed: &Installed, cluster: &Arc<slipstream_cluster::Cluster>) {
    let selections = installed.app.selections.clone();
    cluster.set_feedback_handler(Arc::new(move |pipeline, body| selections.feedback(pipeline, body)));
    let _ = installed.app.cluster.set(cluster.clone());
}
