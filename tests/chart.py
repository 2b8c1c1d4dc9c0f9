"""The Helm chart (deploy/helm/slipstream) rendered as Kubernetes would
receive it, for the tests that check it and the tests that start nodes
with exactly what it renders.

Helm itself does the rendering: its Go library, built into the PyPI
package helm-python-sdk (no helm binary, no cluster)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import ROOT

CHART = ROOT / "deploy" / "helm" / "slipstream"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"


def render(values: dict[str, Any] | None = None, *, name: str = "ss", namespace: str = "serving") -> list[dict[str, Any]]:
    """Every manifest `helm template NAME CHART -n NAMESPACE -f values` renders, parsed."""
    from helm_python import chart

    out = chart.Chart.load(str(CHART)).render(values, name=name, namespace=namespace)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def gpu_values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(GPU_VALUES.read_text())
    return loaded


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """`helm lint --strict` of the chart: {"messages": [...], "errors": [...]}."""
    from helm_python import chart

    report: dict[str, Any] = chart.lint(str(CHART), values, strict=True)
    return report


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single manifest of `kind` (and `name`, when given)."""
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} manifests"
    return found[0]


def node_statefulset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"
              and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "node"]
    return sts


def node_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = node_statefulset(docs)["spec"]["template"]["spec"]["containers"]
    return c


def secret_value(docs: list[dict[str, Any]], name: str, key: str) -> str:
    import base64

    return base64.b64decode(one(docs, "Secret", name)["data"][key]).decode()


def config_file(docs: list[dict[str, Any]], configmap: str, key: str) -> str:
    return str(one(docs, "ConfigMap", configmap)["data"][key])


def expand(arg: str, env: dict[str, str]) -> str:
    """An argument as the kubelet expands it: `$(VAR)` from the container's environment."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def container_env(docs: list[dict[str, Any]], container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: values, Secret
    keys looked up in the rendered Secrets, `fieldRef`s from `fields`
    (e.g. {"metadata.name": "ss-slipstream-0", "status.podIP": "10.0.0.2"})."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            if ref.get("optional") and ref["key"] not in one(docs, "Secret", ref["name"]).get("data", {}):
                continue  # the kubelet leaves an optional key that is not there unset
            env[e["name"]] = secret_value(docs, ref["name"], ref["key"])
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"the test cannot make env {e}")
    return env


def mounted_files(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The files the container's ConfigMap volumes put in place: {path in the container: text}."""
    pod = node_statefulset(docs)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    files: dict[str, str] = {}
    for m in container["volumeMounts"]:
        cm = volumes.get(m["name"], {}).get("configMap")
        if cm:
            for key, text in one(docs, "ConfigMap", cm["name"])["data"].items():
                files[str(Path(m["mountPath"]) / key)] = str(text)
    return files
