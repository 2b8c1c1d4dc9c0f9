"""The Kubernetes node-count loop (python/slipstream/_internal/kube.py)
against a fake Kubernetes API server that checks every request: the verb,
the path (the StatefulSet's `scale` subresource, the pod), the merge-patch
content type and the bearer token, and that a shrink annotates and empties
the highest ordinal before it patches the scale. The cluster side (the
cordon emptying a real node) is tests/integration/test_node_scaling.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from slipstream._internal import kube

from tests.fake_kube import NS, STS, TOKEN, FakeApi


@pytest.fixture
def api() -> Iterator[FakeApi]:
    a = FakeApi(replicas=3)
    yield a
    a.server.shutdown()


def _status(nodes: int, *, need: int, usable: int, on_last: int = 1, cordoned: tuple[str, ...] = (),
            under: int = 0, cores: int = 2) -> dict[str, Any]:
    """A leader's /v1/status: `nodes` members, one autoscaled stage."""
    names = [f"{STS}-{i}" for i in range(nodes)]
    last = names[-1]
    per = {n: 1 for n in names[:-1]} | ({last: on_last} if on_last else {})
    return {
        "pipelines": [{"name": "p", "stages": [{"name": "s", "threads": 1}]}],
        "cluster": {
            "node": names[0],
            "members": {n: {"cores": cores, "lease": 100 + i, "ready": {"p/s": per.get(n, 0)}}
                        for i, n in enumerate(names)},
            "cordoned": list(cordoned),
            "placement": {"stages": {"p/s": per}},
            "autoscale": {"stages": {"p/s": {"model": {"need_uncapped": need, "max_usable": usable}}}},
            "store": {"repair": {"under_replicated_versions": under}},
        },
    }


def _loop(api: FakeApi, statuses: Iterator[dict[str, Any]], **policy: Any) -> tuple[kube.NodeCountLoop, list[Any]]:
    events: list[Any] = []
    current: dict[str, Any] = {}

    def status() -> dict[str, Any]:
        current["s"] = next(statuses, current.get("s"))
        return current["s"]

    loop = kube.NodeCountLoop(kube.KubeApi(api.url, NS, TOKEN), STS, status,
                              cordon=lambda n, lease: events.append(("cordon", n, lease)),
                              uncordon=lambda n: events.append(("uncordon", n)),
                              policy=kube.Policy(**{"down_after_s": 0.0, "drain_timeout_s": 5.0, **policy}),
                              say=lambda m: events.append(("say", m)))
    return loop, events


def test_a_stage_the_cores_hold_back_adds_nodes_after_two_checks(api: FakeApi) -> None:
    # 3 nodes of 2 cores: the load needs 9 one-thread replicas, 6 fit.
    loop, events = _loop(api, iter([_status(3, need=9, usable=6)] * 3), max_nodes=10)
    loop.check()
    assert api.replicas == 3 and api.verbs() == [("GET", "ss-slipstream/scale")]  # once is not yet
    loop.check()
    assert api.replicas == 5  # ceil(9 cores / 2 per node)
    verb, path, body = api.calls[-1]
    assert (verb, path, body) == ("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/{STS}/scale",
                                  {"spec": {"replicas": 5}})
    assert any("the load needs 9 replicas, the cores allow 6" in str(e) for e in events)


def test_the_count_stays_within_its_bounds(api: FakeApi) -> None:
    loop, _ = _loop(api, iter([_status(3, need=40, usable=6)] * 3), max_nodes=4)
    loop.check()
    loop.check()
    assert api.replicas == 4


def test_a_shrink_empties_the_highest_ordinal_before_it_patches(api: FakeApi) -> None:
    # The need (1 core) fits in 2 nodes: node 2 is annotated and cordoned,
    # and the scale is patched only once the status shows it empty.
    statuses = iter([_status(3, need=1, usable=6), _status(3, need=1, usable=6),  # check, then shrink's lookup
                     _status(3, need=1, usable=6, cordoned=(f"{STS}-2",)),  # cordoned, still running one
                     _status(3, need=1, usable=6, cordoned=(f"{STS}-2",), on_last=0, under=2),  # copies short
                     _status(3, need=1, usable=6, cordoned=(f"{STS}-2",), on_last=0)])  # empty
    loop, events = _loop(api, statuses, min_nodes=1)
    seen_empty = []
    api.on_scale.append(lambda n: seen_empty.append((n, kube.is_empty(loop.status(), f"{STS}-2"),
                                                     ("cordon", f"{STS}-2", 102) in events)))
    loop.check()
    assert api.replicas == 2
    assert api.verbs() == [("GET", "ss-slipstream/scale"), ("PATCH", f"{STS}-2"), ("PATCH", "ss-slipstream/scale")]
    assert api.calls[1][2] == {"metadata": {"annotations": {kube.CORDON_ANNOTATION: "emptying before the "
                                                                                   "StatefulSet shrinks"}}}
    # At the scale patch: node 2 empty, and cordoned before (with that member's lease).
    assert seen_empty == [(2, True, True)]
    # Once it has left the members, its cordon record is removed.
    assert ("uncordon", f"{STS}-2") not in events
    loop.status = lambda: _status(2, need=1, usable=4)
    loop.policy.min_nodes = 2
    loop.check()
    assert ("uncordon", f"{STS}-2") in events


def test_a_node_that_does_not_empty_is_left_and_uncordoned(api: FakeApi) -> None:
    stuck = _status(3, need=1, usable=6, cordoned=(f"{STS}-2",))  # keeps its replica
    loop, events = _loop(api, iter([_status(3, need=1, usable=6), _status(3, need=1, usable=6)] + [stuck] * 100),
                         drain_timeout_s=1.0)
    loop.check()
    assert api.replicas == 3
    assert ("uncordon", f"{STS}-2") in events
    assert api.calls[-1][2] == {"metadata": {"annotations": {kube.CORDON_ANNOTATION: None}}}


def test_min_nodes_and_hysteresis_hold_a_shrink(api: FakeApi) -> None:
    loop, _ = _loop(api, iter([_status(3, need=1, usable=6)] * 5), min_nodes=3)
    loop.check()
    assert api.replicas == 3 and [v for v, _ in api.verbs()] == ["GET"]
    loop2, _ = _loop(api, iter([_status(3, need=1, usable=6)] * 5), down_after_s=60.0)
    loop2.check()
    loop2.check()
    assert api.replicas == 3  # fits in fewer, but not for long enough yet


def test_only_the_leader_scales(api: FakeApi) -> None:
    st = _status(3, need=9, usable=6)
    st["cluster"]["node"] = f"{STS}-1"
    loop, _ = _loop(api, iter([st] * 3))
    loop.check()
    loop.check()
    assert api.calls == []


def test_a_refused_request_is_an_error_with_its_status(api: FakeApi) -> None:
    loop, _ = _loop(api, iter([_status(3, need=9, usable=6)] * 3))
    loop.api = kube.KubeApi(api.url, NS, "wrong")
    with pytest.raises(kube.KubeError, match="401"):
        loop.check()


def test_the_in_cluster_api_comes_from_the_pod_s_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("SLIPSTREAM_K8S_API", "SLIPSTREAM_K8S_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLIPSTREAM_K8S_NAMESPACE", "serving")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(kube, "SA", "/nonexistent")
    with pytest.raises(kube.KubeError, match="no service account CA"):
        kube.KubeApi.from_env()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(kube.KubeError, match="not in a Kubernetes pod"):
        kube.KubeApi.from_env()
