"""Latency vs offered load, per pipeline, both systems: one PNG each
(``bench/results/vs_ray_<pipeline>.png``) from ``vs_ray.json``.

Every measured run is a point (goodput-search probes and fixed loads);
p50 dashed, p99 solid, the SLO as a horizontal line and each system's
goodput as a vertical one. Both axes are logarithmic: the two systems'
rates and latencies differ by orders of magnitude.

    .venv/bin/python -m bench.vs_ray.plot [bench/results/vs_ray.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.harness import RESULTS

COLORS = {"slipstream": "#1f77b4", "ray": "#d62728"}
LABELS = {"slipstream": "Slipstream", "ray": "Ray Serve"}


def plot(res: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    written = []
    for p in res["pipelines"]:
        if "systems" not in p:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for system, data in p["systems"].items():
            runs = sorted(data["probes"], key=lambda r: r["offered_rps"])
            if not runs:
                continue
            x = [r["offered_rps"] for r in runs]
            c = COLORS.get(system, "gray")
            ax.plot(x, [max(r["p99_ms"], 1e-3) for r in runs], "-o", color=c, ms=4, label=f"{LABELS.get(system, system)} p99")
            ax.plot(x, [max(r["p50_ms"], 1e-3) for r in runs], "--", color=c, alpha=0.7, label=f"{LABELS.get(system, system)} p50")
            fail = [r for r in runs if r["errors"] > 0.01 * max(r["sent"], 1)]
            if fail:
                ax.plot([r["offered_rps"] for r in fail], [max(r["p99_ms"], 1e-3) for r in fail], "x", color=c, ms=9)
            if data["goodput_rps"]:
                ax.axvline(data["goodput_rps"], color=c, lw=0.8, ls=":")
        ax.axhline(p["slo_ms"], color="black", lw=1, ls="-.", label=f"SLO p99 {p['slo_ms']:g} ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # 1, 2, 5, 10, 20, ... instead of 2x10^0
            axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("offered load (req/s, open loop, Poisson)")
        ax.set_ylabel("latency (ms)")
        ratio = f", goodput ratio {p['goodput_ratio']:.1f}x" if p.get("goodput_ratio") else ""
        ax.set_title(f"{p['name']}: latency vs offered load{ratio}")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=8, loc="upper left")
        fig.text(0.01, 0.01, "x: >1% errors; dotted verticals: goodput at the SLO", fontsize=7, color="gray")
        fig.tight_layout()
        path = out_dir / f"vs_ray_{p['name']}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, default=RESULTS / "vs_ray.json")
    a = ap.parse_args()
    for p in plot(json.loads(a.results.read_text()), a.results.parent):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
