"""The parts of bench/vs_ray that need no Ray: the adapter's JSON <-> array
conversions, batching and splitting, the DAG walk, and compare.py's pass
rule, rate rounding, output comparison, SLO wrapper and report."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import slipstream as ss

from bench.vs_ray import compare, report, servers
from bench.vs_ray import ray_adapter as ra


def test_inputs_from_json_numeric_and_checks() -> None:
    specs = {"x": ss.Tensor("float32", (-1, 3)), "n": ss.Tensor("int64", (-1, 1))}
    got = ra.inputs_from_json({"inputs": {"x": [[1, 2, 3], [4, 5, 6]], "n": [[7], [8]]}}, specs)
    assert got["x"].dtype == np.float32 and got["x"].shape == (2, 3)
    assert got["n"].dtype == np.int64 and got["n"][1, 0] == 8
    with pytest.raises(ValueError, match="missing input"):
        ra.inputs_from_json({"inputs": {"x": [[1, 2, 3]]}}, specs)
    with pytest.raises(ValueError, match="does not match"):
        ra.inputs_from_json({"inputs": {"x": [[1, 2]], "n": [[1]]}}, specs)
    with pytest.raises(ValueError, match="rows"):
        ra.inputs_from_json({"inputs": {"x": [[1, 2, 3]], "n": [[1], [2]]}}, specs)
    with pytest.raises(ValueError, match="JSON object"):
        ra.inputs_from_json({"x": 1}, specs)


def test_string_and_bytes_tensors_round_trip() -> None:
    specs = {"text": ("string", (-1,)), "blob": ("bytes", (-1,))}
    blob = base64.b64encode(b"\x00\xffhi").decode()
    got = ra.inputs_from_json({"inputs": {"text": ["a b", "c"], "blob": [blob, blob]}}, specs)
    assert got["text"].dtype == object and list(got["text"]) == ["a b", "c"]
    assert got["blob"][0] == b"\x00\xffhi"
    with pytest.raises(ValueError, match="non-string"):
        ra.json_to_array([1, 2], "string")
    # outputs: str stays str, bytes become base64, numpy '<U' arrays become lists
    assert ra.array_to_json(np.array(["x", "y"], dtype=object)) == ["x", "y"]
    assert ra.array_to_json(np.array([b"\x00\xffhi"], dtype=object)) == [blob]
    assert ra.array_to_json(np.array([["p", "q"]])) == [["p", "q"]]
    num = ra.array_to_json(np.ones((2, 2), np.float32))
    assert isinstance(num, np.ndarray)  # left to the encoder (orjson handles numpy)


def test_concat_split_round_trip_and_groups() -> None:
    reqs = [{"x": np.full((n, 2), i, np.float32)} for i, n in enumerate([1, 3, 2])]
    tensors, sizes = ra.concat_requests(reqs)
    assert sizes == [1, 3, 2] and tensors["x"].shape == (6, 2)
    assert not tensors["x"].flags.writeable  # like Slipstream's shared-memory views
    batch = ss.Batch(tensors, sizes)
    parts = ra.split_rows({"y": batch["x"] * 2}, batch.sizes)
    for i, (r, p) in enumerate(zip(reqs, parts, strict=True)):
        np.testing.assert_array_equal(p["y"], r["x"] * 2)
        assert p["y"].shape[0] == sizes[i]
    with pytest.raises(ValueError, match="first dim must be 6"):
        ra.split_rows({"y": np.zeros((5, 2))}, sizes, "C")
    with pytest.raises(TypeError, match="dict of arrays"):
        ra.split_rows([1], sizes)  # type: ignore[arg-type]
    mixed = [{"x": np.zeros((1, 2))}, {"x": np.zeros((1, 3))}, {"x": np.zeros((2, 2))}]
    assert ra.group_by_shape(mixed) == [[0, 2], [1]]


def test_a_streaming_component_answers_its_result_as_a_worker_would() -> None:
    """A generator component (audioquery's Speak yields the text first, then
    returns it with the speech): the stage's output is its return value, else
    its last chunk; split by rows like any other output."""

    def speak(batch: ss.Batch):  # type: ignore[no-untyped-def]
        yield {"speech": np.array([b""] * batch.rows, dtype=object)}
        return {"speech": np.array([b"wav"] * batch.rows, dtype=object)}

    def chunks(batch: ss.Batch):  # type: ignore[no-untyped-def]
        yield {"n": np.zeros(batch.rows)}
        yield {"n": np.ones(batch.rows)}

    tensors, sizes = ra.concat_requests([{"x": np.zeros((1, 2))}, {"x": np.zeros((2, 2))}])
    out = ra.split_rows(ra.run_component(speak, ss.Batch(tensors, sizes)), sizes, "Speak")
    assert [list(o["speech"]) for o in out] == [[b"wav"], [b"wav", b"wav"]]
    assert list(ra.run_component(chunks, ss.Batch(tensors, sizes))["n"]) == [1.0, 1.0, 1.0]
    assert ra.run_component(lambda b: {"y": b["x"]}, ss.Batch(tensors, sizes))["y"].shape == (3, 2)


def test_single_request_batch_does_not_copy() -> None:
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    tensors, _ = ra.concat_requests([{"x": a}])
    assert np.shares_memory(tensors["x"], a) and a.flags.writeable


def test_merge_parts_and_dag() -> None:
    merged, t = ra.merge_parts([{"a": 1, ra.T_DONE: 5.0}, {"b": 2, ra.T_DONE: 7.0}])
    assert merged == {"a": 1, "b": 2} and t == 7.0
    assert ra.merge_parts([{"x": 1}]) == ({"x": 1}, None)
    stages = {"D": ["B", "C"], "B": ["A"], "C": ["A"], "A": []}
    order = ra.topo_order(stages)
    assert order.index("A") < order.index("B") < order.index("D") and order.index("C") < order.index("D")
    assert ra.sinks(stages) == ["D"]
    with pytest.raises(ValueError, match="cycle"):
        ra.topo_order({"A": ["B"], "B": ["A"]})


def test_load_pipeline_by_name_and_variable(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(
        "import slipstream as ss\n"
        "@ss.component(inputs={'x': ss.Tensor('float32', (-1, 2))})\n"
        "class A:\n    def __call__(self, b): return {'y': b['x']}\n"
        "var_name = ss.Pipeline('pipe', A, slo=ss.SLO(p99_ms=5))\n"
    )
    assert ra.load_pipeline(f"{app}:pipe").name == "pipe"
    assert ra.load_pipeline(f"{app}:var_name").name == "pipe"
    assert ra.load_pipeline(str(app)).name == "pipe"


def test_percentiles_shape() -> None:
    p = ra.percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["count"] == 4 and p["max"] == 4.0 and 2.0 <= p["p50"] <= 3.0
    assert ra.percentiles([])["count"] == 0


def _run(p99: float, p999: float, errors: int = 0, sent: int = 1000) -> dict:
    return {"sent": sent, "ok": sent - errors, "errors": errors, "latency_ms": {"p99": p99, "p999": p999}}


def test_verdict_counts_errors_and_misses() -> None:
    assert compare.verdict(_run(40, 45), 50, 0.01)[0]
    assert not compare.verdict(_run(60, 70), 50, 0.01)[0]
    # p999 within the SLO: misses <= 0.1%, so up to ~0.9% errors still pass
    assert compare.verdict(_run(40, 45, errors=8), 50, 0.01)[0]
    assert not compare.verdict(_run(40, 45, errors=11), 50, 0.01)[0]
    # p999 above the SLO: misses may already be 1%, so any error fails
    assert not compare.verdict(_run(40, 80, errors=1), 50, 0.01)[0]
    assert not compare.verdict(_run(0, 0, errors=1000), 50, 0.01)[0]


def test_nice_rate_and_outputs_match() -> None:
    assert compare.nice_rate(1234.5) == 1200 and compare.nice_rate(0.456) == 0.46 and compare.nice_rate(96) == 96
    a = {"ids": [[1, 2]], "scores": [[0.5, 0.25]], "text": ["x"]}
    assert compare.outputs_match(a, {"ids": [[1, 2]], "scores": [[0.50001, 0.25]], "text": ["x"]})
    assert not compare.outputs_match(a, {"ids": [[1, 3]], "scores": [[0.5, 0.25]], "text": ["x"]})
    assert not compare.outputs_match(a, {"ids": [[1, 2]], "scores": [[0.5, 0.25]]})
    # A mismatch names the outputs that differ (or are missing on one side).
    assert compare.outputs_differing(a, dict(a)) == []
    assert compare.outputs_differing(a, {"ids": [[1, 3]], "scores": [[0.5, 0.25]]}) == ["ids", "text"]
    assert compare.outputs_differing([1], [2]) == ["outputs"]


def test_the_wrapper_serves_the_same_components_with_another_slo_or_the_plan_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "WRAPPERS", tmp_path / "wrappers")
    app, pipe, target = compare.load_target("examples/noop.py:noop")
    path, serve_target = compare.wrapper(app, "noop", 50.0)
    assert serve_target == f"{path}:noop"
    wrapped = ra.load_pipeline(serve_target)
    assert wrapped.slo.p99_ms == 50.0 and wrapped.name == "noop"
    assert [c.cls.__qualname__ for c in wrapped.graph.nodes.values()] == ["First", "Second"]
    # The plan's counts, pinned, for both systems; the SLO as declared.
    path2, target2 = compare.wrapper(app, "noop", None, {"First": (2, 1, 8), "Second": (1, 2, 4)})
    assert path2 != path
    sized = ra.load_pipeline(target2)
    assert sized.slo.p99_ms == pipe.slo.p99_ms
    got = {n: (c.replicas, c.threads, c.max_batch_size, {"replicas", "threads"} <= c.pinned)
           for n, c in sized.graph.nodes.items()}
    assert got == {"First": (2, 1, 8, True), "Second": (1, 2, 4, True)}


def test_report_renders_a_result() -> None:
    probe = {"offered_rps": 100.0, "p50_ms": 5.0, "p99_ms": 9.0, "errors": 0, "sent": 500}
    fixed = probe | {"stages": {}}
    system = {"goodput_rps": 100.0, "unloaded_ms": 2.0, "resolution": 1.2, "probes": [probe], "fixed": [fixed]}
    res = {
        "mode": "quick", "wall_s": 60,
        "ray": {"version": "2.60.0", "env": {"K": "V"}, "adapter_options": []},
        "pipelines": [
            {"name": "p", "stages": {"A": {}}, "slo_ms": 10.0, "slo_declared_ms": 10.0, "outputs_match": True,
             "limit_rps": 1000.0,
             "goodput_ratio": 1.0, "systems": {"slipstream": system, "ray": system},
             "handoff": {"B": {"fan_in": True, "parents": ["A", "C"], "input_bytes_per_request": 6.4e6,
                               "slipstream_hop_ms": {"p50": 0.2, "p99": 1.0},
                               "ray_handoff_ms": {"p50": 12.0, "p99": 20.0}}}},
            {"target": "examples/x.py:x", "skipped": "ImportError: no"},
        ],
    }
    md = report.markdown(res)
    assert "| p | 1 | 10 ms | 1,000 | 100 (10%) | 100 (10%) | 1.0x |" in md
    assert "B (fan-in)" in md and "6.40 MB" in md and "Not measured: examples/x.py:x" in md
    json.dumps(res)  # the shape compare.py writes is plain JSON


def test_ray_server_options_are_per_pipeline(tmp_path: Path) -> None:
    shared = ["--batch-wait-ms=0"]
    a = servers.RayServer("examples/noop.py", "noop", tmp_path, shared)
    a.options.append("--by-reference")  # what pick_transport does for a large-tensor pipeline
    b = servers.RayServer("examples/noop.py", "noop", tmp_path, shared)
    assert shared == ["--batch-wait-ms=0"] and "--by-reference" not in b.options
