#!/usr/bin/env bash
# Finding 1 of the robustness work, reproduced with an independent load
# generator (the Rust crate `oha`: `cargo install oha --locked`): spikes far
# past capacity whose clients drop the connections still in flight when each
# run ends, then a steady load well within capacity. A node whose admission
# gate leaks abandoned requests refuses most of the steady load for good.
#
#   bench/spike_then_steady.sh [SPIKES] [STEADY_RPS]
#
# Prints oha's status-code distribution per run and the gate's books.
set -euo pipefail
cd "$(dirname "$0")/.."
spikes=${1:-4}; steady=${2:-3000}; port=${PORT:-18123}
command -v oha >/dev/null || { echo "needs oha: cargo install oha --locked" >&2; exit 1; }
.venv/bin/python -m slipstream._internal.cli serve examples/echo.py --port "$port" > /tmp/spike_then_steady.log 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 150); do curl -sf "localhost:$port/readyz" >/dev/null && break; sleep 0.2; done
body='{"inputs": {"x": [[3, 4]]}}'
url="http://127.0.0.1:$port/v1/pipelines/demo/infer"
summary() {
  .venv/bin/python -c 'import json, sys
d = json.load(sys.stdin); s = d["summary"]
print(f"  {s.get(\"requestsPerSec\", 0):.0f} req/s  statuses {d.get(\"statusCodeDistribution\")}  dropped by oha {d.get(\"errorDistribution\")}  p99 {d.get(\"latencyPercentiles\", {}).get(\"p99\", 0) * 1000:.1f} ms")'
}
books() {
  curl -s "localhost:$port/v1/status" | .venv/bin/python -c 'import json, sys
p = json.load(sys.stdin)["pipelines"][0]
print(f"  gate: {p.get(\"admission\")}  cancelled: {p.get(\"cancelled\")}")'
}
for i in $(seq "$spikes"); do
  echo "spike $i/$spikes: oha -z 8s -q 30000 -c 256 --latency-correction"
  oha -z 8s -q 30000 -c 256 --latency-correction --no-tui --output-format json \
    -m POST -T application/json -d "$body" "$url" 2>/dev/null | summary
  sleep 1
done
for i in 1 2; do
  echo "steady $steady req/s for 10 s ($i/2)"
  oha -z 10s -q "$steady" -c 64 --latency-correction --no-tui --output-format json \
    -m POST -T application/json -d "$body" "$url" 2>/dev/null | summary
  books
done
