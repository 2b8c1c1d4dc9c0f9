"""Render ``bench/results/vs_ray.json`` as markdown (``vs_ray.md``).

    .venv/bin/python -m bench.vs_ray.report [bench/results/vs_ray.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import RESULTS
from bench.limit import load_limit


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _rps(x: Any) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 10 else f"{x:g}"


def _bytes(x: Any) -> str:
    if x is None:
        return "-"
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _equal(p: dict[str, Any]) -> str:
    """'yes', or 'NO' with the outputs that differ where the run named them."""
    if p["outputs_match"]:
        return "yes"
    differ = p.get("outputs_differ")
    return f"NO ({', '.join(differ)})" if differ else "NO"


def _goodput(system: dict[str, Any]) -> str:
    """The goodput, or "< R" when even the lowest rate tried (R) missed the SLO."""
    if system["goodput_rps"]:
        return _rps(system["goodput_rps"])
    low = system.get("lowest_failing_rps")
    return f"< {_rps(low)}" if low else "0"


def _of_limit(system: dict[str, Any], limit: float | None) -> str:
    """Goodput as a fraction of the pipeline's offline compute limit (bench/limit.py)."""
    return "" if not limit or not system["goodput_rps"] else f" ({system['goodput_rps'] / limit:.0%})"


def markdown(res: dict[str, Any]) -> str:
    pipes = [p for p in res["pipelines"] if "systems" in p]
    lines = [
        "# Slipstream vs Ray Serve: the same components, the same load",
        "",
        f"{res['mode'].capitalize()} mode, {res.get('wall_s', 0) / 60:.0f} min; the load generator shares the "
        "machine's cores (below).",
        f"Ray Serve {res['ray']['version']} with "
        + ", ".join(f"`{k}={v}`" for k, v in res["ray"]["env"].items())
        + (f"; adapter options `{' '.join(res['ray']['adapter_options'])}`" if res["ray"]["adapter_options"] else "")
        + ". Settings: bench/vs_ray/README.md.",
        "",
        "## Goodput at the SLO",
        "",
        "Highest offered rate (open loop, Poisson) with p99 <= SLO and errors + SLO misses <= 1%. Limit: the",
        "machine's offline compute limit for the pipeline (`bench/limit.py`, `limit.md`); each goodput as a",
        "fraction of it.",
        "",
        "| pipeline | stages | SLO p99 | limit req/s | Slipstream req/s (of limit) | Ray Serve req/s (of limit) "
        "| Slipstream / Ray | unloaded latency Slipstream / Ray | outputs equal |",
        "|---|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for p in pipes:
        s, r = p["systems"]["slipstream"], p["systems"]["ray"]
        slo = f"{p['slo_ms']:g} ms" + ("" if p["slo_ms"] == p["slo_declared_ms"] else f" (declared {p['slo_declared_ms']:g})")
        ratio = (f"{p['goodput_ratio']:.1f}x" if p["goodput_ratio"]
                 else f"> {s['goodput_rps'] / r['lowest_failing_rps']:.0f}x" if s["goodput_rps"] and r.get("lowest_failing_rps")
                 else "-")
        limit = p.get("limit_rps") or load_limit(p["name"])
        lines.append(
            f"| {p['name']} | {len(p['stages'])} | {slo} | {_rps(limit)} | {_goodput(s)}{_of_limit(s, limit)} "
            f"| {_goodput(r)}{_of_limit(r, limit)} | {ratio} "
            f"| {_ms(s['unloaded_ms'])} / {_ms(r['unloaded_ms'])} ms | {_equal(p)} |")
    lines += ["", "Ray's transport between stages, chosen per pipeline: "
              + "; ".join(f"{p['name']} {p['systems']['ray'].get('transport', '?')}" for p in pipes) + "."]
    lines += ["", "Search resolution (lowest failing / goodput): "
              + "; ".join(f"{p['name']} Slipstream {p['systems']['slipstream']['resolution']}, "
                          f"Ray {p['systems']['ray']['resolution']}" for p in pipes) + ".", ""]
    lines += [
        "## Latency at fixed loads",
        "",
        "25%, 50% and 90% of Ray's goodput (loads both systems can sustain).",
        "",
        "| pipeline | offered req/s | Slipstream p50 / p99 ms | Ray Serve p50 / p99 ms | errors Slipstream / Ray |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in pipes:
        ss_f, ray_f = p["systems"]["slipstream"]["fixed"], p["systems"]["ray"]["fixed"]
        for a, b in zip(ss_f, ray_f, strict=False):
            lines.append(f"| {p['name']} | {_rps(a['offered_rps'])} | {_ms(a['p50_ms'])} / {_ms(a['p99_ms'])} "
                         f"| {_ms(b['p50_ms'])} / {_ms(b['p99_ms'])} | {a['errors']} / {b['errors']} |")
    lines += [
        "",
        "## Stage-to-stage handoff",
        "",
        "At the lowest fixed load. Slipstream: the stage's `hop_ms` from `/v1/status` (node -> worker -> node",
        "per batch, minus the component's compute: the tensors move as shared-memory descriptors). Ray: from",
        "the parent deployment's `__call__` returning to this deployment's `__call__` starting, per request",
        "(timestamps inside the adapter: serialization, the trip through the ingress, routing, deserialization).",
        "",
        "| pipeline | stage | parents | input per request | Slipstream hop p50 / p99 ms | Ray handoff p50 / p99 ms |",
        "|---|---|---|---:|---:|---:|",
    ]
    for p in pipes:
        for name, h in p.get("handoff", {}).items():
            fan = " (fan-in)" if h["fan_in"] else ""
            sh, rh = h["slipstream_hop_ms"], h["ray_handoff_ms"]
            lines.append(f"| {p['name']} | {name}{fan} | {' + '.join(h['parents'])} | "
                         f"{_bytes(h['input_bytes_per_request'])} | {_ms(sh['p50'])} / {_ms(sh['p99'])} "
                         f"| {_ms(rh['p50'])} / {_ms(rh['p99'])} |")
    lines += [
        "",
        "## Component compute time",
        "",
        "The same component code runs in both systems, so differences here are the machine (2 shared cores,",
        "other work running) rather than the runtime. Per-batch compute p50 at the 50% load, mean batch",
        "size in parentheses; the load average (1 min) when each system's measurements began.",
        "",
        "| pipeline | stage | Slipstream ms (batch) | Ray Serve ms (batch) |",
        "|---|---|---:|---:|",
    ]
    for p in pipes:
        s_, r_ = p["systems"]["slipstream"], p["systems"]["ray"]
        if len(s_["fixed"]) < 2 or len(r_["fixed"]) < 2:
            continue
        ss_st, ray_st = s_["fixed"][1].get("stages", {}), r_["fixed"][1].get("stages", {})
        for name in p["stages"]:
            a, b = ss_st.get(name, {}), ray_st.get(name, {})

            def cell(st: dict[str, Any]) -> str:
                if not st:
                    return "-"
                return f"{_ms(st['compute_ms']['p50'])} ({st['batch_size']['mean']:.1f})"

            lines.append(f"| {p['name']} | {name} | {cell(a)} | {cell(b)} |")
        la_s, la_r = s_.get("loadavg_at_start"), r_.get("loadavg_at_start")
        if la_s and la_r:
            lines.append(f"| {p['name']} | *load average* | {la_s[0]:.1f} | {la_r[0]:.1f} |")
    skipped = [p for p in res["pipelines"] if "systems" not in p]
    if skipped:
        lines += ["", "Not measured: " + "; ".join(
            f"{p.get('name', p['target'])} ({p.get('skipped') or p.get('failed')})" for p in skipped) + "."]
    lines += ["", "Plots: `vs_ray_<pipeline>.png` (latency vs offered load, both systems). Raw data: `vs_ray.json`.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, default=RESULTS / "vs_ray.json")
    a = ap.parse_args()
    res = json.loads(a.results.read_text())
    _, md = harness.write_results(a.results, res, markdown(res), res["machine"])
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
