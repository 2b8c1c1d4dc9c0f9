"""The Helm chart (deploy/helm/slipstream): `helm lint --strict` and
`helm template` by Helm's own library, every rendered manifest validated
against the Kubernetes API's schemas (kubernetes-validate), for the default
values and for a GPU cluster's (ci/gpu-values.yaml); what the probes,
shutdown and Services must mean; node.toml and the node's arguments as the
binary reads them. tests/integration/test_image.py starts a cluster with
exactly what the chart renders."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from tests import chart
from tests.conftest import ROOT

pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (make setup)")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

# The oldest Kubernetes the chart declares (Chart.yaml's kubeVersion) and the newest the validator knows.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
CASES = {"default": None, "gpu": "gpu"}


def _values(case: str | None) -> dict[str, Any] | None:
    return chart.gpu_values() if case == "gpu" else None


@pytest.mark.parametrize("case", CASES)
def test_the_chart_lints_clean(case: str) -> None:
    report = chart.lint(_values(CASES[case]))
    assert report["errors"] == [], report
    # 1 = info ("icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_manifest_is_valid_kubernetes(case: str) -> None:
    docs = chart.render(_values(CASES[case]))
    kinds = sorted(d["kind"] for d in docs)
    want = {"ConfigMap", "Secret", "Service", "StatefulSet", "PodDisruptionBudget"}
    assert want <= set(kinds), kinds
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD's kind: not in the API's schemas (its shape is checked below)
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any error
        checked += 1
    assert checked >= 7


def test_probes_and_shutdown_say_what_they_mean() -> None:
    docs = chart.render()
    c = chart.node_container(docs)
    pod = chart.node_statefulset(docs)["spec"]["template"]["spec"]
    # Liveness asks the process only, never etcd; readiness means routable.
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The kubelet waits out the preStop, the node's hand-over of its stages
    # (HANDOVER_LIMIT in crates/slipstream-runtime/src/lifecycle.rs: 10 s)
    # and its own drain before it kills.
    (sleep,) = [int(a) for a in c["lifecycle"]["preStop"]["exec"]["command"][1:]]
    toml = chart.config_file(docs, "ss-slipstream-config", "node.toml")
    drain = float(_settings(toml)["drain_timeout_s"]["value"])
    assert pod["terminationGracePeriodSeconds"] > sleep + 10 + drain
    # Shared memory for the data path: a memory-backed /dev/shm larger than the pool.
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert _bytes(shm["emptyDir"]["sizeLimit"]) > float(_settings(toml)["pool_mb"]["value"]) * 2**20
    # Non-root, with a read-only root file system (everything written goes to volumes).
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert {"/var/lib/slipstream", "/tmp", "/dev/shm"} <= {m["mountPath"] for m in c["volumeMounts"]}


def test_services_route_to_ready_nodes_and_peers_find_every_node() -> None:
    docs = chart.render()
    pods = chart.node_statefulset(docs)["spec"]["template"]["metadata"]["labels"]
    api = chart.one(docs, "Service", "ss-slipstream")
    peers = chart.one(docs, "Service", "ss-slipstream-peers")
    for svc in (api, peers):
        assert svc["spec"]["selector"].items() <= pods.items()
    assert not api["spec"].get("publishNotReadyAddresses")  # clients reach routable nodes only
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    assert chart.node_statefulset(docs)["spec"]["serviceName"] == "ss-slipstream-peers"
    pdb = chart.one(docs, "PodDisruptionBudget", "ss-slipstream")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()
    # The bundled etcd: three members, each named in every node's --cluster.
    etcd = chart.one(docs, "StatefulSet", "ss-slipstream-etcd")
    assert etcd["spec"]["replicas"] == 3
    url = chart.node_container(docs)["args"][chart.node_container(docs)["args"].index("--cluster") + 1]
    assert url == "etcd://" + ",".join(f"ss-slipstream-etcd-{i}.ss-slipstream-etcd.serving.svc:2379" for i in range(3))


def test_gpu_values_ask_for_gpus_and_turn_on_metrics() -> None:
    docs = chart.render(chart.gpu_values())
    c = chart.node_container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["memory"] == "64Gi"
    assert not [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-etcd")]
    assert "etcds://etcd-0.etcd.platform.svc:2379," in " ".join(c["args"])
    monitor = chart.one(docs, "ServiceMonitor")
    api = chart.one(docs, "Service", "ss-slipstream")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= api["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    dashboard = json.loads(chart.one(docs, "ConfigMap", "ss-slipstream-dashboard")["data"]["slipstream.json"])
    assert dashboard == json.loads((chart.CHART / "dashboards" / "slipstream.json").read_text())


def test_the_node_count_loop_gets_its_statefulset_and_only_the_rights_it_needs() -> None:
    off = chart.render()
    assert not [d for d in off if d["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    pod = chart.node_statefulset(off)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert not any(e["name"].startswith("SLIPSTREAM_K8S_") for e in chart.node_container(off)["env"])

    docs = chart.render(chart.gpu_values())  # scaleNodes on
    sts = chart.node_statefulset(docs)
    pod = sts["spec"]["template"]["spec"]
    account = chart.one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == account
    env = {e["name"]: e.get("value") for e in chart.node_container(docs)["env"]}
    assert env["SLIPSTREAM_K8S_STATEFULSET"] == sts["metadata"]["name"]
    assert (env["SLIPSTREAM_K8S_MIN_NODES"], env["SLIPSTREAM_K8S_MAX_NODES"]) == ("2", "8")
    rules = chart.one(docs, "Role")["rules"]
    assert {(r["apiGroups"][0], res, v) for r in rules for res in r["resources"] for v in r["verbs"]} == {
        ("apps", "statefulsets/scale", "get"), ("apps", "statefulsets/scale", "patch"), ("", "pods", "patch")}
    assert rules[0]["resourceNames"] == [sts["metadata"]["name"]]
    binding = chart.one(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == chart.one(docs, "Role")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "serving"}]


def test_the_node_reads_the_rendered_configuration_as_the_chart_meant(tmp_path) -> None:
    for values in (None, chart.gpu_values()):
        docs = chart.render(values)
        toml = tmp_path / "node.toml"
        toml.write_text(chart.config_file(docs, "ss-slipstream-config", "node.toml"))
        settings = _settings(toml.read_text())
        assert settings["host"]["value"] == "0.0.0.0" and settings["port"]["value"] == 8000
        assert settings["store"]["value"] == "/var/lib/slipstream/store"
        for key, want in ((values or {}).get("config") or {}).items():
            assert settings[key]["value"] == want, key
        # Every argument the chart passes is one `slipstream node` takes.
        c = chart.node_container(docs)
        env = {"POD_NAME": "ss-slipstream-0", "POD_IP": "10.1.2.3"}
        args = [chart.expand(a, env) for a in c["args"]]
        out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                              "import sys; from slipstream._internal.cli import build_parser; "
                              "a = build_parser().parse_args(sys.argv[1:]); print(a.name, a.advertise, a.cluster)",
                              *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["ss-slipstream-0", "10.1.2.3", args[args.index("--cluster") + 1]]


def test_tls_and_accepted_tokens_reach_the_node_as_it_reads_them() -> None:
    docs = chart.render({"tls": {"secretName": "ss-node-tls", "etcd": True, "ingressSecretName": "ss-api-tls"},
                         "etcd": {"bundled": False, "endpoints": ["etcd.infra:2379"]},
                         "cluster": {"token": "new", "acceptTokens": ["old"]}})
    c = chart.node_container(docs)
    env = chart.container_env(docs, c, {"metadata.name": "ss-slipstream-0", "status.podIP": "10.1.2.3",
                                        "metadata.namespace": "serving"})
    assert env["SLIPSTREAM_CLUSTER_TOKEN"] == "new" and env["SLIPSTREAM_CLUSTER_ACCEPT_TOKENS"] == "old"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert mount["readOnly"] and env["SLIPSTREAM_TLS_DIR"] == mount["mountPath"]
    pod = chart.node_statefulset(docs)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]
    assert volume["secretName"] == "ss-node-tls" and volume["defaultMode"] & 0o040, "the node's group reads it"
    # The ingress's certificate, and probes that speak HTTPS to it.
    api = next(m for m in c["volumeMounts"] if m["name"] == "ingress-tls")
    assert env["SLIPSTREAM_INGRESS_TLS"] == api["mountPath"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", probe
    args = [chart.expand(a, {**env, "POD_NAME": "ss-slipstream-0", "POD_IP": "10.1.2.3"}) for a in c["args"]]
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                          "import sys; from slipstream._internal.cli import build_parser; "
                          "from slipstream._internal.cluster_cli import tokens; "
                          "a = build_parser().parse_args(sys.argv[1:]); print(a.cluster, a.tls, ','.join(tokens(a)))",
                          *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["etcds://etcd.infra:2379", "/var/run/slipstream/tls", "new,old"]
    # Off by default: no mount, no TLS variable, no accepted tokens.
    plain = chart.render(None)
    c = chart.node_container(plain)
    assert not any(m["name"] == "tls" for m in c["volumeMounts"])
    env = chart.container_env(plain, c, {"metadata.name": "n", "status.podIP": "1.2.3.4",
                                         "metadata.namespace": "serving"})
    assert "SLIPSTREAM_TLS_DIR" not in env and "SLIPSTREAM_CLUSTER_ACCEPT_TOKENS" not in env
    assert "SLIPSTREAM_INGRESS_TLS" not in env and "scheme" not in c["readinessProbe"]["httpGet"]
    assert "SLIPSTREAM_API_TOKEN" not in env, "inference open unless apiToken is set"


def test_the_api_token_reaches_the_node_from_the_values_or_an_existing_secret() -> None:
    docs = chart.render({"apiToken": "t0ken"})
    c = chart.node_container(docs)
    env = chart.container_env(docs, c, {"metadata.name": "n", "status.podIP": "1.2.3.4",
                                        "metadata.namespace": "serving"})
    assert env["SLIPSTREAM_API_TOKEN"] == "t0ken" and env["SLIPSTREAM_ADMIN_TOKEN"] != "t0ken"
    ref = next(e for e in c["env"] if e["name"] == "SLIPSTREAM_API_TOKEN")["valueFrom"]["secretKeyRef"]
    assert (ref["key"], ref["optional"]) == ("api-token", True), "a Secret of one's own may lack it"


@pytest.mark.parametrize("bad, why", [
    ({"nodes": -1}, "/nodes"),
    ({"nodez": 3}, "nodez"),
    ({"config": {"port": 9000}}, "/config"),
    ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    ({"etcd": {"bundled": False}}, "etcd.endpoints"),
    ({"tls": {"etcd": True, "secretName": "x"}}, "the bundled etcd speaks plain HTTP"),
    ({"tls": {"etcd": True}, "etcd": {"bundled": False, "endpoints": ["e:1"]}}, "needs tls.secretName"),
    ({"cluster": {"acceptTokens": ["a,b"]}}, "/cluster/acceptTokens"),
])
def test_bad_values_are_refused_with_the_key_named(bad: dict[str, Any], why: str) -> None:
    from helm_python import errors

    with pytest.raises((errors.HelmError,)) as e:
        chart.render(bad)
    assert why in str(e.value)


def _settings(toml_text: str) -> dict[str, Any]:
    """`slipstream config --config FILE --json` of this text: what a node makes of it."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(toml_text)
        f.flush()
        out = subprocess.run([str(ROOT / ".venv" / "bin" / "slipstream"), "config", "--config", f.name, "--json"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    parsed = json.loads(out.stdout)
    return {s["name"]: s for s in parsed} if isinstance(parsed, list) else parsed


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, mult in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * mult
    return float(quantity)
