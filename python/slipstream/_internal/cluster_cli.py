"""A cluster of nodes on etcd: ``slipstream deploy`` and ``slipstream node``.

``deploy`` builds the app's spec (as ``serve`` does) and puts it into etcd
under ``/slipstream/<cluster>/deploy``, signed with the cluster token,
with the app's files and seeds as a bundle (``app_bundle.py``). ``node``
joins the cluster: it waits for a deployment, fetches and checks its
bundle (or, deployed with ``--no-bundle``, checks that the app file it
names is here and unchanged), and runs the node on it; the node's
agent takes it from there (membership, placement, routing across nodes;
docs/design/cluster.md). When a new deployment replaces the one it runs,
the node drains, stops, and ``node`` starts it again on the new one.

etcd is reached through its JSON gateway (``/v3/...``), as the node does,
over the transport every node client uses (``http_transport.py``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slipstream._internal import app_bundle, kube
from slipstream._internal.errors import Error, RequestError, from_core
from slipstream._internal.http_transport import Transport
from slipstream._internal.serve_cli import add_node_args, add_spec_args, build_spec, node_options
from slipstream._internal.store_cli import fail


class EtcdError(Exception):
    pass


class Etcd:
    """The few etcd calls the CLI needs, over the JSON gateway."""

    def __init__(self, url: str, timeout: float = 3.0, tls: str | Path | None = None) -> None:
        scheme, sep, rest = url.partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in ("etcd", "http", "etcds", "https") or not rest:
            raise EtcdError(f"--cluster {url!r}: expected etcd://HOST:PORT[,HOST:PORT...] "
                            "(etcds:// or https:// for TLS)")
        secure = scheme in ("etcds", "https")
        context = _etcd_tls(tls) if secure else None
        if secure and context is None:
            raise EtcdError(f"--cluster {url!r}: TLS to etcd needs a CA and a client certificate: "
                            "--tls DIR (or $SLIPSTREAM_TLS_DIR)")
        endpoints = [e.strip().partition("://")[2] or e.strip() for e in rest.rstrip("/").split(",") if e.strip()]
        self.endpoints = [f"{'https' if secure else 'http'}://{e}" for e in endpoints]
        self.timeout = timeout
        self._http = {ep: Transport(ep, what="etcd member", hint="", ssl_context=context) for ep in self.endpoints}

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers; its JSON answer."""
        last = ""
        for ep in self.endpoints:
            try:
                resp = self._http[ep].request("POST", path, headers={"Content-Type": "application/json"},
                                              body=[json.dumps(body).encode()], timeout=self.timeout)
            except RequestError as e:  # no answer: try the next member
                last = f"{ep}: {e}"
                continue
            if not 200 <= resp.status < 300:
                raise EtcdError(f"etcd at {ep}: {resp.status} {bytes(resp.body[:200])!r}")
            try:
                out: dict[str, Any] = json.loads(bytes(resp.body))
                return out
            except ValueError as e:
                last = f"{ep}: {e}"
        raise EtcdError(f"no etcd endpoint answered (last: {last})")

    def put(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": _b64(key.encode()), "value": _b64(value)})

    def get(self, key: str) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key.encode())}).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        kvs = self._call("/v3/kv/range", _range(prefix)).get("kvs") or []
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")) for kv in kvs}

    def records(self, prefix: str) -> list[tuple[str, bytes, int]]:
        """(key, value, mod_revision) of every key under `prefix`."""
        kvs = self._call("/v3/kv/range", _range(prefix)).get("kvs") or []
        return [(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
                 int(kv.get("mod_revision", 0))) for kv in kvs]

    def replace_if_unchanged(self, key: str, value: bytes, mod_revision: int) -> bool:
        """Put `value` at `key` if nobody wrote it since `mod_revision`,
        keeping the lease it is bound to; whether it was put."""
        k = _b64(key.encode())
        out = self._call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "ignore_lease": True}}],
        })
        return bool(out.get("succeeded"))

    def keys(self, prefix: str) -> list[str]:
        kvs = self._call("/v3/kv/range", {**_range(prefix), "keys_only": True}).get("kvs") or []
        return [base64.b64decode(kv["key"]).decode() for kv in kvs]

    def delete(self, key: str) -> None:
        self._call("/v3/kv/deleterange", {"key": _b64(key.encode())})


def _range(prefix: str) -> dict[str, str]:
    """The etcd range of every key starting with `prefix`."""
    raw = prefix.encode()
    return {"key": _b64(raw), "range_end": _b64(raw[:-1] + bytes([raw[-1] + 1]))}


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _etcd_tls(tls: str | Path | None) -> ssl.SSLContext | None:
    """What `slipstream node --tls DIR` shows etcd: DIR/tls.crt as a client
    certificate; etcd's certificate must chain to DIR/ca.crt and name the
    host dialled."""
    if tls is None:
        return None
    d = Path(tls)
    try:
        context = ssl.create_default_context(cafile=str(d / "ca.crt"))
        context.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
    except (OSError, ssl.SSLError) as e:
        raise EtcdError(f"--tls {d}: {e}") from None
    return context


def _check_tls(tls: str | None, name: str) -> None:
    """Read the TLS directory as the node `name` will, now rather than when
    a deployment arrives."""
    if tls is None:
        return
    from slipstream import _core

    try:
        _core.tls_check(tls, name)
    except _core.CoreError as e:
        raise EtcdError(f"--tls {tls}: {from_core(e)}") from None


def _etcd(a: argparse.Namespace) -> Etcd:
    return Etcd(a.cluster, tls=a.tls)


def _cluster_key(token: str) -> bytes:
    return hashlib.sha256(b"slipstream-cluster-v1\0" + token.encode()).digest()


def _sign(token: str, parts: list[bytes]) -> str:
    """HMAC-SHA256 over length-prefixed parts (the node's `ClusterKey::sign`)."""
    mac = hmac.new(_cluster_key(token), digestmod=hashlib.sha256)
    for p in parts:
        mac.update(len(p).to_bytes(8, "little"))
        mac.update(p)
    return mac.hexdigest()


def seal(token: str, kind: str, value: Any) -> bytes:
    return seal_body(token, kind, json.dumps(value, separators=(",", ":")))


def seal_body(token: str, kind: str, body: str) -> bytes:
    """A record: `body` (JSON text) and its signature under `token`."""
    return json.dumps({"body": body, "sig": _sign(token, [kind.encode(), body.encode()])}).encode()


def signed_by(tokens: str | Sequence[str], kind: str, env: Any) -> str | None:
    """Which of `tokens` signed the record envelope `env` as a `kind`; None: none of them."""
    body, sig = env.get("body"), env.get("sig")
    if not isinstance(body, str) or not isinstance(sig, str):
        return None
    return next((t for t in ([tokens] if isinstance(tokens, str) else tokens)
                 if hmac.compare_digest(_sign(t, [kind.encode(), body.encode()]), sig)), None)


def unseal(tokens: str | Sequence[str], kind: str, raw: bytes) -> Any:
    """A record's value, if one of `tokens` (the token, then those accepted
    while rotating it) signed it as a `kind`."""
    env = json.loads(raw)
    if signed_by(tokens, kind, env) is None:
        raise EtcdError(f"the {kind} record is not signed with this cluster token")
    return json.loads(env["body"])


def _root(a: argparse.Namespace) -> str:
    return f"/slipstream/{a.cluster_name}/"


def _token(a: argparse.Namespace) -> str:
    if not a.token:
        raise EtcdError("a cluster token is required: --token or $SLIPSTREAM_CLUSTER_TOKEN "
                        "(every node and deploy must hold the same one)")
    return str(a.token)


def tokens(a: argparse.Namespace) -> list[str]:
    """The token, then the others accepted (never signed with) while it is rotated."""
    return [_token(a), *(t for t in a.accept_token if t != a.token)]


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cmd_deploy(a: argparse.Namespace) -> int:
    try:
        token = _token(a)
        etcd = _etcd(a)
        app = Path(a.app.split(":")[0]).resolve()
        if not app.is_file():
            return fail(f"no app file {app}")
        a.app = str(app) + (":" + a.app.split(":", 1)[1] if ":" in a.app else "")
        spec = build_spec(a, size_here=False)
        plan = _planned_nodes(a, etcd)
        body = json.dumps(spec, sort_keys=True)
        record = {"spec": spec, "app": str(app), "app_sha256": _file_sha256(app), "at": time.time()}
        if a.bundle:
            # The files travel with the deployment (app_bundle.py): written
            # before the record that names them.
            data, layout = app_bundle.pack(app, spec["store"]["seed"])
            app_bundle.publish(etcd, _root(a), data, layout)
            record["bundle"] = layout
            print(f"bundled {app.parent} ({layout['size'] / 1024:.0f} KiB with {len(layout['seeds'])} seed(s))",
                  file=sys.stderr)
            for key, ext in layout["external"].items():
                print(f"  seed {key} ({ext['size'] / 2**20:.1f} MiB) goes through the store: a node with "
                      f"{ext['path']} seeds it", file=sys.stderr)
        digest = layout["sha256"] if a.bundle else _file_sha256(app)
        deploy_id = hashlib.sha256((body + digest).encode()).hexdigest()[:12]
        record["id"] = deploy_id
        # The plan first, naming the deployment it is for, so that the
        # leader's first placement of it already follows the plan. Its own
        # record: the same app deployed again with another plan moves
        # replicas without restarting the nodes.
        if plan is not None:
            publish_plan(etcd, a, token, deploy_id, plan, f"slipstream deploy --plan {a.plan}")
        else:
            etcd.delete(_root(a) + "plan")
        etcd.put(_root(a) + "deploy", seal(token, "deploy", record))
        if a.bundle:
            app_bundle.prune(etcd, _root(a), layout["sha256"])
    except (EtcdError, app_bundle.BundleError) as e:
        return fail(str(e))
    stages = sum(len(p["stages"]) for p in spec["pipelines"])
    print(f"deployed {deploy_id}: {len(spec['pipelines'])} pipeline(s), {stages} stage(s) to cluster "
          f"'{a.cluster_name}' at {a.cluster}")
    if a.wait <= 0:
        return 0
    return _wait_ready(etcd, a, token, deploy_id, spec)


def _planned_nodes(a: argparse.Namespace, etcd: Etcd) -> Any:
    """``--plan`` when it is a cluster plan (replicas per node, for the
    leader to follow); None for none, or a plan made for one machine.
    Names the plan's nodes that are not members now (their replicas go to
    the others until they join)."""
    if not a.plan:
        return None
    from slipstream._internal.planner import Plan

    plan = Plan.load(Path(a.plan))
    planned = planned_per_node(plan)
    if not planned:
        return None
    names = sorted({n for per in planned.values() for n in per})
    members = {k.rsplit("/", 1)[-1] for k in etcd.get_prefix(_root(a) + "members/")}
    absent = [n for n in names if n not in members]
    print(f"placing per the plan on {', '.join(names)}"
          + (f" ({', '.join(absent)} not a member now: their replicas go to the others until they join)"
             if absent else ""), file=sys.stderr)
    return plan


def planned_per_node(plan: Any) -> dict[str, dict[str, int]]:
    """A cluster plan's replicas per node: "pipeline/stage" -> node ->
    count (empty for a plan made for one machine)."""
    return {f"{p}/{s}": dict(sp.nodes) for p, pp in plan.pipelines.items() for s, sp in pp.stages.items()
            if sp.nodes is not None}


def bound_per_node(plan: Any, gpus_of: dict[str, list[str]]) -> dict[str, dict[str, list[int]]]:
    """A cluster GPU plan's binding on the nodes that are members now:
    "pipeline/stage" -> node -> the devices (``cuda:N`` places there) its
    replicas on that node take, from each node's ``nvidia-smi -L`` lines
    (`gpus_of`: node -> lines, the members' records). ConfigError when a
    node's GPUs are not as the plan cuts them. A node that joins later
    binds its own when it starts (`_bind_here`, from the record's
    ``gpu_plan``)."""
    from slipstream._internal.planner.gpu import gpu_binding

    gpu_plan = gpu_plan_of(plan)
    out: dict[str, dict[str, list[int]]] = {}
    for node in sorted({str(g["node"]) for g in gpu_plan.get("gpus", []) if "node" in g} & set(gpus_of)):
        for (p, s), places in gpu_binding(gpu_plan, _placed(gpu_plan), gpus_of[node], node).items():
            out.setdefault(f"{p}/{s}", {})[node] = places
    return out


def gpu_plan_of(plan: Any) -> dict[str, Any]:
    """What of a cluster GPU plan a node needs to bind its replicas: the
    plan's GPUs (id, model, layout, node) and each stage's slices
    ("pipeline/stage" -> placements); empty for any other plan."""
    if "gpu_nodes" not in plan.inventory:
        return {}
    return {"gpus": plan.inventory.get("gpus", []),
            "placement": {f"{p}/{s}": sp.placement for p, pp in plan.pipelines.items()
                          for s, sp in pp.stages.items() if sp.placement}}


def _placed(gpu_plan: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    return {tuple(k.split("/", 1)): v for k, v in gpu_plan.get("placement", {}).items()}  # type: ignore[misc]


def _bind_here(etcd: Etcd, a: argparse.Namespace, name: str, deploy_id: str, spec: dict[str, Any]) -> None:
    """Bind this node's replicas of a cluster GPU plan's stages to the
    slices the plan chose on this node (the spec's ``devices``, which the
    node keeps unless the plan record names a binding for it), matching
    the plan's GPUs here to this machine's ``nvidia-smi -L``. Error when
    they differ (a MIG layout not as planned, a GPU missing)."""
    from slipstream._internal.planner.gpu import gpu_binding, local_smi_lines

    raw = etcd.get(_root(a) + "plan")
    if raw is None:
        return
    try:
        record = unseal(tokens(a), "plan", raw)
    except (ValueError, KeyError) as e:
        raise EtcdError(f"the plan record: {e}") from None
    gpu_plan = record.get("gpu_plan") or {}
    if record.get("deploy") != deploy_id or not any(g.get("node") == name for g in gpu_plan.get("gpus", [])):
        return
    bound = gpu_binding(gpu_plan, _placed(gpu_plan), local_smi_lines(), name)
    for pipe in spec["pipelines"]:
        for stage in pipe["stages"]:
            if (pipe["name"], stage["name"]) in bound:
                stage["devices"] = bound[(pipe["name"], stage["name"])]
    if bound:
        print(f"slipstream: node {name}: bound to the plan's slices here: "
              + ", ".join(f"{p}/{s} on " + ",".join(f"cuda:{d}" for d in ds) for (p, s), ds in sorted(bound.items())),
              file=sys.stderr)


def publish_plan(etcd: Etcd, a: argparse.Namespace, token: str, deploy_id: str, plan: Any, note: str) -> None:
    """Write the `plan` record: replicas per node for deployment
    `deploy_id`'s stages, which the cluster's leader follows, and for a
    GPU plan the devices it binds them to on each member (applied at once)
    with what a node joining later binds its own by."""
    planned, gpu_plan = planned_per_node(plan), gpu_plan_of(plan)
    bound = bound_per_node(plan, member_gpus(a, etcd)) if gpu_plan else {}
    by_node: dict[str, list[str]] = {}
    for stage, per in sorted(bound.items()):
        for node, places in sorted(per.items()):
            by_node.setdefault(node, []).append(f"{stage} on " + ",".join(f"cuda:{d}" for d in places))
    if by_node:
        print("binding GPU replicas: " + "; ".join(f"{n}: {', '.join(v)}" for n, v in sorted(by_node.items())),
              file=sys.stderr)
    record: dict[str, Any] = {"deploy": deploy_id, "planned": planned, "at": time.time(), "note": note}
    if gpu_plan:
        record["devices"], record["gpu_plan"] = bound, gpu_plan
    etcd.put(_root(a) + "plan", seal(token, "plan", record))


def current_deployment(a: argparse.Namespace) -> dict[str, Any]:
    """The cluster's deploy record (its id and spec): EtcdError if none."""
    raw = _etcd(a).get(_root(a) + "deploy")
    if raw is None:
        raise EtcdError(f"cluster '{a.cluster_name}' at {a.cluster} has no deployment: run slipstream deploy first")
    try:
        return dict(unseal(tokens(a), "deploy", raw))
    except (ValueError, KeyError) as e:
        raise EtcdError(f"the deploy record: {e}") from None


def apply_plan(a: argparse.Namespace, d: dict[str, Any], plan: Any, note: str) -> str:
    """Write `plan` (replicas per node, and a GPU plan's binding) for
    deployment `d` (`current_deployment`); its id. EtcdError when the plan
    names stages the deployment lacks."""
    stages = {f"{p['name']}/{s['name']}" for p in d["spec"]["pipelines"] for s in p["stages"]}
    unknown = sorted(set(planned_per_node(plan)) - stages)
    if unknown:
        raise EtcdError(f"the plan names stages deployment {d['id']} lacks: {', '.join(unknown)}")
    publish_plan(_etcd(a), a, _token(a), str(d["id"]), plan, note)
    return str(d["id"])


def _member_records(a: argparse.Namespace, etcd: Etcd) -> list[dict[str, Any]]:
    """The members' signed records, opened; EtcdError names one that is not."""
    out = []
    for key, raw in etcd.get_prefix(_root(a) + "members/").items():
        try:
            out.append(dict(unseal(tokens(a), "member", raw)))
        except (ValueError, KeyError) as e:
            raise EtcdError(f"{key}: {e}") from None
    return out


def member_gpus(a: argparse.Namespace, etcd: Etcd) -> dict[str, list[str]]:
    """Each member's ``nvidia-smi -L`` lines, by node name."""
    return {str(m["node"]): [str(x) for x in m.get("gpus") or []] for m in _member_records(a, etcd)}


def member_inventory(a: argparse.Namespace, warn: Callable[[str], None] | None = None
                     ) -> dict[str, tuple[float, float, str]]:
    """The cores, memory (MiB) and GPUs (as ``--nodes`` writes them; "":
    none) of the cluster's members now (`slipstream plan --cluster`), by
    node name, from their signed records. GPUs of a model the planner
    does not know are left out, and said through `warn` (default: on
    stderr)."""
    from slipstream._internal.planner import spec_from_smi

    out: dict[str, tuple[float, float, str]] = {}
    for m in _member_records(a, _etcd(a)):
        gpus, unknown = spec_from_smi([str(x) for x in m.get("gpus") or []])
        if unknown:
            (warn or (lambda msg: print(msg, file=sys.stderr)))(
                f"{m['node']}: left out of the plan, GPUs of a model the planner does not know: {', '.join(unknown)}")
        out[str(m["node"])] = (float(m["cores"]), float(m.get("memory_bytes") or 0) / 2**20, gpus)
    if not out:
        raise EtcdError(f"cluster '{a.cluster_name}' at {a.cluster} has no members now: start the nodes first, "
                        "or give --nodes")
    return out


def _wait_ready(etcd: Etcd, a: argparse.Namespace, token: str, deploy_id: str, spec: dict[str, Any]) -> int:
    """Until every stage has a ready replica somewhere in the cluster (or --wait runs out)."""
    want = {f"{p['name']}/{s['name']}" for p in spec["pipelines"] for s in p["stages"]}
    until = time.monotonic() + a.wait
    last = ""
    while time.monotonic() < until:
        ready: set[str] = set()
        nodes = 0
        for raw in etcd.get_prefix(_root(a) + "members/").values():
            try:
                m = unseal(tokens(a), "member", raw)
            except (EtcdError, ValueError, KeyError):
                continue
            if m.get("deploy") == deploy_id:
                nodes += 1
                ready |= {k for k, n in (m.get("ready") or {}).items() if n > 0}
        line = f"{nodes} node(s) run it; {len(want & ready)}/{len(want)} stages ready"
        if line != last:
            print(f"  {line}", file=sys.stderr)
            last = line
        if want <= ready:
            print("ready")
            return 0
        time.sleep(0.3)
    return fail(f"not ready after {a.wait:.0f} s: {last}")


class WaitingProbes:
    """`/healthz` (200) and `/readyz` (503, saying why) on the node's own
    address while ``slipstream node`` has no deployment to run yet, so that
    an orchestrator's startup and liveness probes see a live process
    instead of a refused connection (Kubernetes would restart the pod in a
    loop). Closed before the node itself listens there. With `tls` (the
    node's ingress_tls directory) it speaks TLS, as the node will, so that
    probes configured for HTTPS pass from the start."""

    def __init__(self, host: str, port: int, why: str, tls: str | None = None) -> None:
        import http.server
        import threading

        body = json.dumps({"status": "not ready", "held_back": [why]}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?")[0]
                if path in ("/healthz", "/v2/health/live"):
                    self._answer(200, b'{"status": "live"}')
                else:  # readiness, and anything else: not ready yet
                    self._answer(503, body)

            def _refuse(self) -> None:
                """Anything but a probe: 503 (not 501), the request read so the answer reaches the client."""
                n = int(self.headers.get("Content-Length") or 0)
                if 0 < n <= 1 << 20:
                    self.rfile.read(n)
                self.close_connection = True
                self._answer(503, body)

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815 (the stdlib's names)

            def _answer(self, code: int, payload: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                context.load_cert_chain(str(Path(tls) / "tls.crt"), str(Path(tls) / "tls.key"))
            except (OSError, ssl.SSLError):
                self.server.server_close()
                raise
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Waiting:
    """The probes' listener while the node waits (see `WaitingProbes`):
    opened when waiting starts, closed before the node binds its port."""

    def __init__(self, host: str, port: int | None, tls: str | None = None) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.probes: WaitingProbes | None = None

    def open(self, why: str) -> None:
        if self.probes is not None or not self.port:  # port 0: nothing could probe it
            return
        try:
            self.probes = WaitingProbes(self.host, int(self.port), why, self.tls)
            print(f"slipstream: answering probes while waiting (/healthz live, /readyz not ready), "
                  f"listening on {'https' if self.tls else 'http'}://{self.host}:{self.port}", file=sys.stderr)
        except (OSError, ssl.SSLError) as e:  # the port is taken (the node's own bind will say so), or the cert
            print(f"slipstream: cannot answer probes while waiting: {e}", file=sys.stderr)

    def close(self) -> None:
        if self.probes is not None:
            self.probes.close()
            self.probes = None


def cmd_node(a: argparse.Namespace) -> int:
    try:
        token = _token(a)
        etcd = _etcd(a)
        opts = json.loads(node_options(a))
        name = a.name or f"{os.uname().nodename}-{opts['port'] or 8000}"
        _check_tls(a.tls, name)
    except EtcdError as e:
        return fail(str(e))
    waiting = _Waiting(opts.get("host") or "127.0.0.1", opts.get("port"), opts.get("ingress_tls") or None)
    try:
        return _run_node(a, etcd, token, name, waiting, opts.get("port") or 8000)
    finally:
        waiting.close()


def _run_node(a: argparse.Namespace, etcd: Etcd, token: str, name: str, waiting: _Waiting, port: int) -> int:
    """`cmd_node`'s loop: wait for a deployment, run it; again after a redeploy."""
    from slipstream import _core

    waiting_said = False
    while True:
        waiting.open(f"node {name}: waiting for a deployment in cluster '{a.cluster_name}'")
        try:
            raw = etcd.get(_root(a) + "deploy")
        except EtcdError as e:
            return fail(str(e))
        if raw is None:
            if not waiting_said:
                print(f"slipstream: node {name}: waiting for a deployment "
                      f"(slipstream deploy APP --cluster {a.cluster})", file=sys.stderr)
                waiting_said = True
            time.sleep(0.5)
            continue
        try:
            d = unseal(tokens(a), "deploy", raw)
        except (EtcdError, ValueError, KeyError) as e:
            return fail(f"cluster '{a.cluster_name}': {e}")
        spec = d["spec"]
        if "bundle" in d:
            try:
                where = app_bundle.fetch(etcd, _root(a), d["bundle"])
            except (EtcdError, app_bundle.BundleError, OSError) as e:
                return fail(f"deployment {d['id']}: cannot fetch its files: {e}")
            spec = app_bundle.relocate(spec, d["bundle"], where)
            app = where / d["bundle"]["app"]
        else:
            app = Path(d["app"])
            if not app.is_file() or _file_sha256(app) != d["app_sha256"]:
                return fail(f"deployment {d['id']} runs {app}, which this machine lacks or holds in another "
                            "version; deployed with --no-bundle, every node needs the same app files "
                            "(a shared file system or the same image)")
        spec["worker_argv"][0] = sys.executable
        try:
            _bind_here(etcd, a, name, str(d["id"]), spec)
        except (EtcdError, Error) as e:
            return fail(f"node {name}: deployment {d['id']}: {e}")
        cluster = {"etcd": a.cluster, "name": name, "cluster": a.cluster_name, "token": token,
                   "accept_tokens": tokens(a)[1:],
                   "data_listen": a.data_listen, "ttl_s": a.ttl, "deploy": d["id"],
                   "store_replicas": a.store_replicas, "standbys": not a.no_standbys,
                   "direct": not a.via_ingress,
                   **({"tls": str(Path(a.tls).resolve())} if a.tls else {}),
                   **({"advertise": a.advertise} if a.advertise else {})}
        print(f"slipstream: node {name}: running deployment {d['id']} ({app})", file=sys.stderr)
        waiting.close()
        scaling = _node_scaling(a, etcd, token, port)
        try:
            _core.serve(json.dumps(spec), node_options(a), cluster_json=json.dumps(cluster))
        except _core.CoreError as e:
            kind, message = e.args
            if kind == "redeploy":
                print(f"slipstream: node {name}: {message}", file=sys.stderr)
                waiting_said = False
                continue
            raise from_core(e) from None
        except KeyboardInterrupt:
            pass
        finally:
            if scaling is not None:
                scaling.stop()
        return 0


def _node_scaling(a: argparse.Namespace, etcd: Etcd, token: str, port: int) -> kube.NodeCountLoop | None:
    """The Kubernetes node-count loop (kube.py), when `SLIPSTREAM_K8S_STATEFULSET` names the StatefulSet."""
    sts = os.environ.get("SLIPSTREAM_K8S_STATEFULSET")
    if not sts:
        return None
    env = os.environ.get
    try:
        api = kube.KubeApi.from_env()
        policy = kube.Policy(min_nodes=int(env("SLIPSTREAM_K8S_MIN_NODES", "1")),
                             max_nodes=int(env("SLIPSTREAM_K8S_MAX_NODES", "10")),
                             down_after_s=float(env("SLIPSTREAM_K8S_DOWN_AFTER_S", "300")),
                             drain_timeout_s=float(env("SLIPSTREAM_K8S_DRAIN_TIMEOUT_S", "300")))
        every = float(env("SLIPSTREAM_K8S_CHECK_EVERY_S", "5"))
    except (kube.KubeError, ValueError) as e:
        print(f"slipstream: node scaling is off: {e}", file=sys.stderr)
        return None
    if not 1 <= policy.min_nodes <= policy.max_nodes:
        print(f"slipstream: node scaling is off: min nodes {policy.min_nodes} and max {policy.max_nodes} "
              "must satisfy 1 <= min <= max", file=sys.stderr)
        return None
    status_url = Transport(f"http://127.0.0.1:{port}", what="this node", hint="")

    def status() -> dict[str, Any]:
        resp = status_url.request("GET", "/v1/status", timeout=5.0)
        out: dict[str, Any] = json.loads(bytes(resp.body))
        return out

    def cordon(node: str, lease: int) -> None:
        etcd.put(_root(a) + "cordon/" + node, seal(token, "cordon", {"node": node, "lease": lease}))

    def uncordon(node: str) -> None:
        etcd.delete(_root(a) + "cordon/" + node)

    loop = kube.NodeCountLoop(api, sts, status, cordon, uncordon, policy, every_s=every)
    loop.start()
    return loop


def add_cluster_args(p: argparse.ArgumentParser, required: bool = True, what: str = "") -> None:
    p.add_argument("--cluster", required=required, metavar="etcd://HOST:PORT[,HOST:PORT]",
                   help=what or "the etcd cluster that holds the cluster's membership, deployment and placement")
    p.add_argument("--cluster-name", default=os.environ.get("SLIPSTREAM_CLUSTER_NAME", "default"),
                   help="several clusters may share one etcd (default: 'default')")
    p.add_argument("--token", default=os.environ.get("SLIPSTREAM_CLUSTER_TOKEN"),
                   help="the cluster's shared secret: nodes without it cannot join, place work or send "
                        "frames (default: $SLIPSTREAM_CLUSTER_TOKEN)")
    p.add_argument("--accept-token", action="append", metavar="TOKEN",
                   default=[t for t in os.environ.get("SLIPSTREAM_CLUSTER_ACCEPT_TOKENS", "").split(",") if t],
                   help="another token to accept but never sign with, while the token is rotated "
                        "(repeatable; default: the comma-separated $SLIPSTREAM_CLUSTER_ACCEPT_TOKENS)")
    p.add_argument("--tls", default=os.environ.get("SLIPSTREAM_TLS_DIR") or None, metavar="DIR",
                   help="a directory of ca.crt, tls.crt and tls.key (`slipstream tls`, or a Kubernetes TLS "
                        "Secret): mutual TLS between nodes, and the client certificate for an etcds:// "
                        "cluster (default: $SLIPSTREAM_TLS_DIR)")


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_cluster_commands(sub: Any) -> None:
    """Register ``deploy`` and ``node`` on the command line's subparsers."""
    d = sub.add_parser("deploy", help="put an app's pipelines into a cluster (nodes place and run them)")
    add_spec_args(d)
    add_cluster_args(d)
    d.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait until every stage has a ready replica in the cluster")
    d.add_argument("--no-bundle", dest="bundle", action="store_false",
                   help="do not carry the app's files and seeds to the nodes (every node then needs the same "
                        "files at the same paths: a shared file system or the same image)")
    d.set_defaults(fn=cmd_deploy)

    n = sub.add_parser("node", help="run a node that joins a cluster on etcd and serves its deployment")
    add_node_args(n)
    add_cluster_args(n)
    n.add_argument("--name", default=None, help="the node's name in the cluster (default: HOSTNAME-PORT)")
    n.add_argument("--data-listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the data plane listens for other nodes (default: a free loopback port)")
    n.add_argument("--advertise", default=None, metavar="IP",
                   help="the address other nodes reach this one's data plane at (default: the listen address)")
    n.add_argument("--ttl", type=int, default=3, metavar="SECONDS",
                   help="membership lease: a node that stops renewing it leaves the cluster after this long")
    n.add_argument("--store-replicas", type=_positive, default=2, metavar="N",
                   help="copies of each value in the cluster's store (a put is acknowledged once all N hold it; "
                        "fewer when fewer nodes are up)")
    n.add_argument("--no-standbys", action="store_true",
                   help="keep no warm standby of a stage whose replicas all run on one node (by default, when "
                        "this node places the cluster, such a stage gets one on another node, which stands in "
                        "at once when that node is lost)")
    n.add_argument("--via-ingress", action="store_true",
                   help="bring every stage's answer back to the request's ingress before the next stage (by "
                        "default, a chain of stages on other nodes hands each request from node to node and the "
                        "last delivers the answer, crossing each link once)")
    n.set_defaults(fn=cmd_node)
