"""Where a served request's CPU goes, process by process, beside what the
offline limit charges it: why goodput stops short of the limit.

    .venv/bin/python -m bench.cpu_by_stage --pipelines multimodal --rates 5,10
    .venv/bin/python -m bench.cpu_by_stage --pipelines rag --rates 100,180

Serves each example out of the box (`slipstream serve APP`, sized from
this machine's profile, as bench.goodput's ``out-of-box``), offers each
rate open loop (Poisson) with the pipeline's input mix
(``bench.vs_ray.bodies.mix``, the requests bench.limit measures on), and
reads from /proc the CPU time of the node, of each stage's replicas and of
this process (the load generator) across the run. Each figure is CPU
milliseconds per request sent. Beside each stage: bench.limit's CPU per
request for it (at its best batch, no serving), so that the table shows
what serving adds: the node's own work (HTTP, codecs, scheduling), the
generator, and a stage's cost at the batch sizes a rate gives it (a
component at batch 1 pays its per-call cost on every request).

The whole machine's CPU per request bounds the rate: 2 cores at 110 ms a
request cannot serve more than 18 req/s, whatever the batching or the
queueing. Writes bench/results/cpu_by_stage.{json,md}; each run records
the load average before it.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Any

from bench import harness
from bench.goodput import APPS, Wire, served_as
from bench.harness import RESULTS, ROOT, group_cpu_seconds
from bench.limit import limit_entry


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(name: str, rates: list[float], duration: float, repeat: int, wire_kind: str = "json") -> dict[str, Any]:
    from slipstream._internal.app import load_pipelines

    from bench.vs_ray.bodies import mix

    app = APPS[name]
    _, pipes = load_pipelines(str(ROOT / app))
    pipe = next(p for p in pipes if p.name == name)
    bodies, source = mix(ROOT / app, pipe)
    wire = Wire.v2(bodies, pipe) if wire_kind == "v2" else Wire(bodies)
    slo_ms = pipe.slo.p99_ms if pipe.slo else 0.0
    rows: list[dict[str, Any]] = []
    with harness.node(ROOT / app, sizing="plan") as node:
        time.sleep(1.0)
        st = node.status()
        stages = next(p["stages"] for p in st["pipelines"] if p["name"] == name)
        groups = {"node": [st["pid"]], **{s["name"]: [r["pid"] for r in s["replicas"]] for s in stages}}
        sizes = served_as(st, name)
        print(f"{name}: served as {sizes}; requests from {source}, as {wire_kind}", file=sys.stderr)
        for rate in rates:
            runs = []
            for _ in range(repeat):
                load = os.getloadavg()[0]
                before = group_cpu_seconds(groups)
                gen0 = _self_cpu()
                r = wire.run(node.url, name, rate, duration, warmup_s=0.0, seed=3, slo_ms=slo_ms)
                sent = max(int(r["ok"]) + int(r["errors"]), 1)
                ms = {g: (cpu - before[g]) * 1e3 / sent for g, cpu in group_cpu_seconds(groups).items()}
                ms["generator"] = (_self_cpu() - gen0) * 1e3 / sent
                runs.append({"ms": ms, "total_ms": sum(ms.values()), "sent": sent, "errors": int(r["errors"]),
                             "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"], "load_avg": load})
                print(f"  {rate:g} req/s: {sum(ms.values()):.1f} ms CPU a request "
                      f"({', '.join(f'{g} {v:.1f}' for g, v in ms.items())}); p99 {r['latency_ms']['p99']:.0f} ms; "
                      f"load before {load:.2f}", file=sys.stderr)
            med = {g: statistics.median(run["ms"][g] for run in runs) for g in runs[0]["ms"]}
            rows.append({"rate_rps": rate, "median_ms": med, "total_ms": statistics.median(r["total_ms"] for r in runs),
                         "runs": runs})
    lim = limit_entry(name)
    limit_ms = {s: v["cpu_us_per_request"] / 1e3 for s, v in lim["stages"].items()} if lim else {}
    return {"pipeline": name, "app": app, "served_as": sizes, "body": source, "wire": wire.route, "rows": rows,
            "limit_ms": limit_ms, "limit_rps": lim["limit_rps"] if lim else None}


def markdown(results: list[dict[str, Any]], duration: float, repeat: int) -> str:
    md = ["# CPU per served request, by process, beside the offline limit's", "",
          f"Served out of the box; median of {repeat} run(s) of {duration:g} s per rate; CPU ms per request sent "
          "(/proc). `limit`: bench.limit's CPU per request for the stage (best batch, no serving). "
          "`python -m bench.cpu_by_stage`.", ""]
    for res in results:
        rates = [r["rate_rps"] for r in res["rows"]]
        binary = ", KServe v2 binary requests" if res.get("wire", "").startswith("/v2/") else ""
        md += [f"## {res['pipeline']} ({', '.join(f'{k} {v}' for k, v in res['served_as'].items())}{binary})", "",
               "| process | limit | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
               "|---|---:|" + "---:|" * len(rates)]
        for g in res["rows"][0]["median_ms"]:
            lim = res["limit_ms"].get(g)
            md.append(f"| {g} | {'' if lim is None else f'{lim:.2f}'} | "
                      + " | ".join(f"{r['median_ms'][g]:.2f}" for r in res["rows"]) + " |")
        total_lim = sum(res["limit_ms"].values())
        md.append(f"| **total** | **{total_lim:.2f}** | "
                  + " | ".join(f"**{r['total_ms']:.2f}**" for r in res["rows"]) + " |")
        md.append("")
    return "\n".join(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", default="multimodal", help=f"comma-separated, of {', '.join(APPS)}")
    ap.add_argument("--rates", default="5,10", help="req/s, comma-separated (one set for all pipelines)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--wire", choices=("json", "v2"), default="json",
                    help="requests as the pipeline API's JSON or KServe v2 binary tensors (bench.goodput's +v2 "
                         "configurations)")
    ap.add_argument("--out", default=str(RESULTS / "cpu_by_stage.json"))
    a = ap.parse_args()
    machine = harness.machine()
    rates = [float(r) for r in a.rates.split(",")]
    results = [measure(n, rates, a.duration, a.repeat, a.wire) for n in a.pipelines.split(",")]
    md = markdown(results, a.duration, a.repeat)
    print(md)
    json_path, md_path = harness.write_results(a.out, {"results": results}, md, machine)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
