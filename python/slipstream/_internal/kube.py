"""The slow scaling loop on Kubernetes: more nodes when the cluster's
autoscaler needs more cores than its nodes have, fewer when the load fits
in fewer, by patching the StatefulSet's ``scale`` subresource.

Inside the nodes, the cluster autoscaler (crates/slipstream-cluster,
``autoscale.rs``) sizes stages declared with bounds within the cores the
members have; for each it reports ``need_uncapped``, the replicas the
offered load needs within the stage's bounds as if cores were unlimited.
This loop runs in every ``slipstream node`` started with
``SLIPSTREAM_K8S_STATEFULSET`` set (the chart's ``scaleNodes.enabled``) and
acts only on the cluster's leader (the member with the smallest name, as
for the placement):

- **Up**: when some stage's ``need_uncapped`` exceeds what the cores allow
  (``max_usable``) on ``up_checks`` checks in a row, the StatefulSet is
  scaled to the nodes that the cores needed by every stage fill (at most
  ``max_nodes``). New pods join; the placement gives them work.
- **Down**, with hysteresis: when every stage's need fits in one node
  fewer at ``down_fill`` of its cores for ``down_after_s``, the highest
  ordinal (the pod a StatefulSet removes) is emptied first: its pod is
  annotated ``slipstream.io/cordoned``, a signed ``cordon`` record moves
  its replicas and standbys to the others and makes its store copies
  elsewhere, and only once the placement names nothing on it and no value
  is under-replicated is the scale patched. A drain that does not finish
  in ``drain_timeout_s`` is undone (cordon removed) and tried later.

Requests go to the API server named by the in-cluster environment
(``KUBERNETES_SERVICE_HOST``/``PORT``, the service account's token and CA),
or by ``SLIPSTREAM_K8S_API`` (a URL; for a proxy or a test's API server).
The chart carries the Role (get and patch ``statefulsets/scale``, patch
``pods``) and ServiceAccount it needs.
"""

from __future__ import annotations

import json
import math
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
CORDON_ANNOTATION = "slipstream.io/cordoned"


class KubeError(Exception):
    pass


class KubeApi:
    """The three calls the loop makes to the Kubernetes API."""

    def __init__(self, base: str, namespace: str, token: str | None = None, ca_file: str | None = None,
                 timeout: float = 10.0) -> None:
        self.base = base.rstrip("/")
        self.namespace = namespace
        self.token = token
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_file) if self.base.startswith("https:") else None

    @classmethod
    def from_env(cls, namespace: str | None = None) -> KubeApi:
        """In a pod: the API server and credentials Kubernetes mounts (or ``SLIPSTREAM_K8S_API``)."""
        ns = namespace or os.environ.get("SLIPSTREAM_K8S_NAMESPACE") or _read(f"{SA}/namespace")
        if not ns:
            raise KubeError("no namespace: set SLIPSTREAM_K8S_NAMESPACE (the chart sets it)")
        token = os.environ.get("SLIPSTREAM_K8S_TOKEN") or _read(f"{SA}/token")
        url = os.environ.get("SLIPSTREAM_K8S_API")
        if url:
            return cls(url, ns, token)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST) and no SLIPSTREAM_K8S_API")
        host = f"[{host}]" if ":" in host else host
        ca = f"{SA}/ca.crt"
        if not os.path.isfile(ca):
            raise KubeError(f"no service account CA at {ca} (automountServiceAccountToken off?)")
        return cls(f"https://{host}:{port}", ns, token, ca_file=ca)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise KubeError(f"{method} {path}: {e.code} {e.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise KubeError(f"{method} {path}: {e}") from None

    def _sts(self, name: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{name}/scale"

    def replicas(self, statefulset: str) -> int:
        """The StatefulSet's replicas (its ``scale`` subresource's spec)."""
        return int(self._call("GET", self._sts(statefulset))["spec"]["replicas"])

    def set_replicas(self, statefulset: str, n: int) -> None:
        self._call("PATCH", self._sts(statefulset), {"spec": {"replicas": n}})

    def annotate_pod(self, pod: str, annotations: dict[str, str | None]) -> None:
        """Set (None: remove) annotations on a pod."""
        self._call("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{pod}",
                   {"metadata": {"annotations": annotations}})


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass
class Demand:
    """What the cluster's stages need, read from a node's status."""

    cores_needed: float  # every stage's replicas (the load's need for autoscaled ones) x threads
    short: list[str]  # autoscaled stages the cores hold back: "key: need N, cores allow M"
    cores_per_node: float  # the smallest placeable member's


def demand(status: dict[str, Any]) -> Demand | None:
    """The cores the stages need and who is held back, from `/v1/status`
    (None when the node is not in a cluster or knows no members yet)."""
    cluster = status.get("cluster") or {}
    members: dict[str, Any] = cluster.get("members") or {}
    cordoned = set(cluster.get("cordoned") or [])
    placeable = [m for n, m in members.items() if n not in cordoned] or list(members.values())
    if not placeable:
        return None
    models = {k: s.get("model") for k, s in ((cluster.get("autoscale") or {}).get("stages") or {}).items()}
    placement = (cluster.get("placement") or {}).get("stages") or {}
    cores, short = 0.0, []
    for p in status.get("pipelines", []):
        for s in p.get("stages", []):
            key = f"{p['name']}/{s['name']}"
            threads = max(1, int(s.get("threads") or 1))
            model = models.get(key)
            if model:
                need = int(model["need_uncapped"])
                if need > int(model["max_usable"]):
                    short.append(f"{key}: the load needs {need} replicas, the cores allow {model['max_usable']}")
            else:
                need = sum(int(c) for c in (placement.get(key) or {}).values())
            cores += need * threads
    return Demand(cores, short, min(float(m.get("cores") or 1) for m in placeable))


@dataclass
class Policy:
    min_nodes: int = 1
    max_nodes: int = 10
    up_checks: int = 2  # checks in a row that must say "short" before adding nodes
    down_fill: float = 0.7  # one node fewer must hold the need at this fill of its cores
    down_after_s: float = 300.0  # ... for this long
    drain_timeout_s: float = 300.0


def target_nodes(d: Demand, current: int, p: Policy) -> int:
    """Nodes wanted now, before hysteresis: more when a stage is short,
    one fewer when the need fits in one node fewer at `down_fill`."""
    if d.short:
        want = max(current + 1, math.ceil(d.cores_needed / d.cores_per_node))
    elif current > 1 and d.cores_needed <= (current - 1) * d.cores_per_node * p.down_fill:
        want = current - 1
    else:
        want = current
    return max(p.min_nodes, min(p.max_nodes, want))


class NodeCountLoop:
    """The loop (see the module docs), run on a thread beside the node."""

    def __init__(self, api: KubeApi, statefulset: str, status: Callable[[], dict[str, Any]],
                 cordon: Callable[[str, int], None], uncordon: Callable[[str], None],
                 policy: Policy | None = None, every_s: float = 5.0,
                 say: Callable[[str], None] = lambda m: print(f"slipstream: node scaling: {m}", file=sys.stderr)) -> None:
        self.api, self.sts, self.status = api, statefulset, status
        self.cordon, self.uncordon = cordon, uncordon
        self.policy = policy or Policy()
        self.every_s = every_s
        self.say = say
        self._short_checks = 0
        self._fits_since: float | None = None
        self._removed: set[str] = set()  # cordoned and scaled away: their records go once they have left
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-scaling", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 (the loop outlives any one failed check, and says why)
                self.say(f"{type(e).__name__}: {e} (tried again in {self.every_s:g} s)")

    def check(self) -> None:
        """One check: decide and, when due, act."""
        st = self.status()
        cluster = st.get("cluster") or {}
        members = sorted((cluster.get("members") or {}).keys())
        for gone in sorted(self._removed - set(members)):
            self.uncordon(gone)  # it left: its cordon record has nothing more to say
            self._removed.discard(gone)
        if not members or members[0] != cluster.get("node"):
            self._short_checks, self._fits_since = 0, None
            return  # only the leader scales
        d = demand(st)
        if d is None:
            return
        current = self.api.replicas(self.sts)
        want = target_nodes(d, current, self.policy)
        now = time.monotonic()
        self._short_checks = self._short_checks + 1 if want > current else 0
        self._fits_since = (self._fits_since or now) if want < current else None
        if want > current and self._short_checks >= self.policy.up_checks:
            self.say(f"{current} -> {want} nodes: {'; '.join(d.short)}")
            self.api.set_replicas(self.sts, want)
            self._short_checks = 0
        elif want < current and self._fits_since is not None and now - self._fits_since >= self.policy.down_after_s:
            self._fits_since = None
            self.shrink(current, d)

    def shrink(self, current: int, d: Demand) -> bool:
        """Empty the highest ordinal, then scale to one node fewer; False if it did not empty in time."""
        victim = f"{self.sts}-{current - 1}"
        member = ((self.status().get("cluster") or {}).get("members") or {}).get(victim)
        if member is None:  # not a member (not started, or gone): nothing to move
            self.api.set_replicas(self.sts, current - 1)
            return True
        self.say(f"{current} -> {current - 1} nodes: the need ({d.cores_needed:g} cores) fits in fewer; "
                 f"emptying {victim} first")
        self.api.annotate_pod(victim, {CORDON_ANNOTATION: "emptying before the StatefulSet shrinks"})
        self.cordon(victim, int(member.get("lease") or 0))
        until = time.monotonic() + self.policy.drain_timeout_s
        while time.monotonic() < until and not self._stop.is_set():
            if is_empty(self.status(), victim):
                self.api.set_replicas(self.sts, current - 1)
                self._removed.add(victim)
                self.say(f"{victim} emptied; scaled to {current - 1}")
                return True
            time.sleep(0.5)
        self.say(f"{victim} did not empty within {self.policy.drain_timeout_s:g} s; left in place")
        self.uncordon(victim)
        self.api.annotate_pod(victim, {CORDON_ANNOTATION: None})
        return False


def is_empty(status: dict[str, Any], node: str) -> bool:
    """Whether the placement names nothing on `node`, it runs no replica or
    standby, and the cluster's store has no value short of its copies."""
    cluster = status.get("cluster") or {}
    placement = cluster.get("placement") or {}
    if node not in set(cluster.get("cordoned") or []):
        return False  # the cordon has not reached this node's view yet
    # Replicas and standbys placed on it (stage -> {node: count}), and those it runs.
    placed = [*(placement.get("stages") or {}).values(), *(placement.get("standby") or {}).values()]
    if any(int(where.get(node, 0)) > 0 for where in placed):
        return False
    member = (cluster.get("members") or {}).get(node) or {}
    if any(int(n) > 0 for kind in ("ready", "standby") for n in (member.get(kind) or {}).values()):
        return False
    repair = (cluster.get("store") or {}).get("repair") or {}
    return int(repair.get("under_replicated_versions", 0)) == 0
