"""False refusals below capacity: the two-stage echo chain
(examples/echo.py, pipeline ``demo``) offered 20,000 requests/s by oha
(open loop, latency from the scheduled send), beside a bare Go HTTP echo
server under the same oha run, alternating, ``--repeat`` times.

    make bench-false-refusals
    python -m bench.false_refusals [--rate 20000] [--seconds 10] [--repeat 3]

Pass (issue 22): refusals below 0.1% of the requests, and the chain's p99
within 2x of the bare echo's p99 (medians over the repeats). Writes
bench/results/false_refusals.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench import harness
from bench.run import start_echo

BODY = json.dumps({"inputs": {"x": [[3.0, 4.0]]}}).encode()


def point(url: str, rate: float, seconds: float, concurrency: int) -> dict[str, Any]:
    r = harness.oha(url, seconds=seconds, concurrency=concurrency, body=BODY, rate=rate,
                    headers=["content-type: application/json"])
    refused = r["status"].get("429", 0)
    return {"rps": r["rps"], "ok_rps": r["ok_rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
            "refused_share": refused / max(r["requests"], 1), "errors": r["errors"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(harness.RESULTS / "false_refusals"))
    a = ap.parse_args()
    machine = harness.machine()
    echo = start_echo()
    if echo is None:
        raise SystemExit("the bare echo baseline needs Go")
    proc, echo_url = echo
    runs: dict[str, list[dict[str, Any]]] = {"echo": [], "chain": []}
    try:
        with harness.node("examples/echo.py") as node:
            chain_url = f"{node.url}/v1/pipelines/demo/infer"
            for i in range(a.repeat):
                for name, url in (("echo", echo_url), ("chain", chain_url)):
                    r = point(url, a.rate, a.seconds, a.concurrency)
                    runs[name].append(r)
                    print(f"run {i + 1}/{a.repeat} {name}: {r['rps']:,.0f}/s, p99 {r['p99_ms']:.1f} ms, "
                          f"refused {100 * r['refused_share']:.3f}%", flush=True)
    finally:
        proc.kill()
    med = {name: harness.medians(rs, ("rps", "ok_rps", "p50_ms", "p99_ms", "refused_share")) for name, rs in runs.items()}
    ratio = med["chain"]["p99_ms"] / med["echo"]["p99_ms"]
    passed = med["chain"]["refused_share"] < 0.001 and ratio <= 2.0
    result = {"rate": a.rate, "seconds": a.seconds, "concurrency": a.concurrency, "runs": runs, "median": med,
              "p99_ratio": ratio, "pass": passed}
    md = [f"# False refusals: the echo chain at {a.rate:,.0f} req/s (oha, open loop), beside a bare Go echo", "",
          f"oha `-q {a.rate:g} --latency-correction -c {a.concurrency} -z {a.seconds:g}s`, alternating, "
          f"medians of {a.repeat}.", "",
          "| server | answered/s | p50 ms | p99 ms | refused |", "|---|---|---|---|---|"]
    for name, label in (("echo", "bare Go HTTP echo"), ("chain", "Slipstream, examples/echo.py `demo`")):
        m = med[name]
        md.append(f"| {label} | {m['ok_rps']:,.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                  f"{100 * m['refused_share']:.3f}% |")
    md += ["", f"p99 ratio {ratio:.2f} (pass: <= 2); refusals {100 * med['chain']['refused_share']:.3f}% "
           f"(pass: < 0.1%): **{'pass' if passed else 'fail'}**"]
    paths = harness.write_results(a.out, result, "\n".join(md), machine)
    print("\n".join(md))
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
