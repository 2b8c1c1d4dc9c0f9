"""``ray_adapter.py serve`` with Ray Serve's own autoscaler on one
deployment, and that deployment's replicas watched: the Ray side of
``bench.surge``.

It runs in Ray's virtualenv as a script, like ``ray_adapter.py`` beside it
(whose ``serve`` it runs, by the same module name, so Ray's workers resolve
the deployments' classes the same way)::

    bench/vs_ray/.venv-ray/bin/python bench/vs_ray/autoscaled.py examples/rag.py:rag --port 8001 \\
        --stage Embed --autoscaling '{"min_replicas": 1, "max_replicas": 2}' --replica-log /tmp/embed.log

``--autoscaling`` (a Ray Serve ``autoscaling_config``) goes on the
deployment named ``--stage``, with ``num_replicas="auto"``; without it the
stage keeps the component's fixed count. Once the app answers, the Serve
controller is asked every ``--poll-s`` seconds for the stage's replicas by
state, its target replica count and its new scaling decisions, one JSON
line each in ``--replica-log``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import ray_adapter  # does not import ray; serve_main sets Ray's environment first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("app", help="app.py:pipeline")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stage", required=True, help="the deployment to autoscale and watch")
    ap.add_argument("--autoscaling", help="Ray Serve autoscaling_config for the stage (JSON)")
    ap.add_argument("--replica-log", required=True)
    ap.add_argument("--poll-s", type=float, default=0.25)
    ap.add_argument("--nodes", type=int, default=1,
                    help="a Ray cluster of this many nodes on this machine (ray_adapter.py serve --nodes)")
    a = ap.parse_args(argv)
    build, wait_http = ray_adapter.build_app, ray_adapter._wait_http
    ready = threading.Event()

    def build_app(target: str, **kw: Any) -> Any:
        # The adapter's app, with `autoscaling_config` on the one deployment.
        from ray import serve

        real = serve.deployment

        def deployment(cls: Any, **opts: Any) -> Any:
            if a.autoscaling and opts.get("name") == a.stage:
                opts["num_replicas"] = "auto"
                opts["autoscaling_config"] = json.loads(a.autoscaling)
            return real(cls, **opts)

        serve.deployment = deployment
        try:
            return build(target, **kw)
        finally:
            serve.deployment = real

    def wait_then_watch(url: str, timeout: float) -> None:
        wait_http(url, timeout)
        ready.set()

    def watch() -> None:
        # The controller's own view: replicas by state, its target, and its
        # scaling decisions (each logged once).
        ready.wait()
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        seen: set[float] = set()
        with open(a.replica_log, "a") as out:
            while True:
                t = time.time()
                try:
                    d = client.get_serve_details()["applications"]["vs_ray"]["deployments"][a.stage]
                    states: dict[str, int] = {}
                    on: dict[str, int] = {}
                    for r in d.get("replicas", []):
                        state = str(getattr(r["state"], "value", r["state"]))  # an enum in the raw details
                        states[state] = states.get(state, 0) + 1
                        if state == "RUNNING" and r.get("node_id"):
                            on[str(r["node_id"])[:8]] = on.get(str(r["node_id"])[:8], 0) + 1
                    rec: dict[str, Any] = {"t": t, "replicas": states, "target": d.get("target_num_replicas"),
                                           "running_on": on}
                    decisions = (d.get("autoscaling_detail") or {}).get("decisions") or []
                    new = [x for x in decisions if x["timestamp_s"] not in seen]
                    seen.update(x["timestamp_s"] for x in new)
                    if new:
                        rec["decisions"] = new
                    out.write(json.dumps(rec, default=str) + "\n")
                    out.flush()
                except Exception as e:  # noqa: BLE001 - shutting down, or a transient controller error
                    out.write(json.dumps({"t": t, "error": f"{type(e).__name__}: {e}"}) + "\n")
                time.sleep(max(0.0, a.poll_s - (time.time() - t)))

    ray_adapter.build_app = build_app
    ray_adapter._wait_http = wait_then_watch
    threading.Thread(target=watch, daemon=True).start()
    nodes = ["--nodes", str(a.nodes)] if a.nodes > 1 else []
    return int(ray_adapter.main(["serve", a.app, "--port", str(a.port), *nodes]))


if __name__ == "__main__":
    sys.exit(main())
