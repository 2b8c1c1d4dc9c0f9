"""The planner: replicas, threads and a batch limit per stage, chosen so that
the pipelines' throughput is as high as the hardware allows within their SLOs.

`slipstream plan app.py` reads the latency profiles and a device inventory
(this machine's cores, or GPUs with their MIG layouts) and solves an integer
program with HiGHS. The objective is the Vortex formulation ("Vortex: Hosting
ML Inference and Knowledge Retrieval Services With Tight Latency and
Throughput Requirements", arXiv 2511.02062): maximise the smallest stage
throughput, then, with that one held, the next smallest, and so on
(lexicographic max-min). A pipeline runs at the rate of its slowest stage, so
the first level is the pipeline's capacity; the later levels give what is
left over (cores, GPU slices) to the next bottleneck as headroom instead of
leaving it idle or piling it on a stage that is already fast. With several
pipelines the first levels are the pipelines' rates, so none is starved.

Why an integer program: replica counts, a stage's one thread count and one
batch limit, and a GPU's one MIG layout are discrete choices that interact
through shared budgets (cores, slices, the SLO along a path); greedy rules
get the corners wrong (a stage bounded at 2 replicas wants 2 threads; a 10 GB
model does not fit a 6 GB slice) and the problems are small enough to solve
exactly in milliseconds.

The modules: `milp` (the program builder, the objective, the SLO path rule),
`plan` (what a plan is and how it is applied and printed), `cpu` (one
machine's cores, or a cluster's nodes with replicas per node, checked with
the SLO model), `gpu` (GPUs with MIG). Pure
functions: no I/O but reading the files passed in; `slipstream plan`
(cli.py) prints and writes.
"""

from slipstream._internal.planner.cpu import NETWORK_MS, plan_cpu
from slipstream._internal.planner.gpu import (
    GPU_MODELS,
    GpuGroup,
    GpuModel,
    parse_inventory,
    plan_gpu,
    spec_from_smi,
)
from slipstream._internal.planner.plan import (
    PipelinePlan,
    Plan,
    StagePlan,
    apply_plan,
    format_plan,
    profiles_for_threads,
    stage_points,
    with_components,
)

__all__ = ["GPU_MODELS", "NETWORK_MS", "GpuGroup", "GpuModel", "PipelinePlan", "Plan", "StagePlan", "apply_plan", "format_plan",
           "parse_inventory", "plan_cpu", "plan_gpu", "profiles_for_threads", "spec_from_smi", "stage_points",
           "with_components"]
