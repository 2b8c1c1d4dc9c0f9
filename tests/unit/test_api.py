"""The declarative API: components, graphs, pipelines, specs."""

from __future__ import annotations

import numpy as np
import pytest
import slipstream as ss
from slipstream._internal.api import Graph


def comp(name: str, **kw: object) -> ss.Component:
    cls = type(name, (), {"__call__": lambda self, batch: {}})
    return ss.component(cls, **kw)  # type: ignore[arg-type]


def test_chain_and_fan_out_fan_in_edges() -> None:
    a, b, c, d = comp("A"), comp("B"), comp("C"), comp("D")
    g = a >> [b, c] >> d
    assert isinstance(g, Graph)
    assert list(g.nodes) == ["A", "B", "C", "D"]
    assert sorted(g.edges) == [("A", "B"), ("A", "C"), ("B", "D"), ("C", "D")]
    assert g.sources == ["A"] and g.sinks == ["D"]
    g2 = [b, c] >> d
    assert sorted(g2.edges) == [("B", "D"), ("C", "D")]
    assert g2.sources == ["B", "C"]


def test_pipeline_spec_has_stages_parents_inputs_and_slo() -> None:
    a = comp("A", max_batch_size=8, replicas=2, inputs={"x": ss.Tensor("float32", (None, 3))})
    b = comp("B")
    p = ss.Pipeline("p", a >> b, slo=ss.SLO(p99_ms=20))
    spec = p.to_spec()
    assert spec["inputs"] == {"x": {"dtype": "float32", "shape": [-1, 3]}}
    assert spec["slo"] == {"p99_ms": 20, "max_miss_rate": 0.01, "drop_late": True}
    assert [(s["name"], s["parents"], s["replicas"], s["max_batch_size"]) for s in spec["stages"]] == [
        ("A", [], 2, 8),
        ("B", ["A"], 1, 1),
    ]


def test_tensor_accepts_numpy_dtypes_and_rejects_others() -> None:
    assert ss.Tensor(np.float32, (-1, 2)).dtype == "float32"
    assert ss.Tensor("int64", [None]).shape == (-1,)
    with pytest.raises(ss.ConfigError, match="unsupported dtype"):
        ss.Tensor("complex64", (-1,))
    with pytest.raises(ss.ConfigError, match="at least one dimension"):
        ss.Tensor("float32", ())
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        ss.Tensor("float32", (-3,))


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: ss.SLO(p99_ms=0), "p99_ms"),
        (lambda: ss.SLO(p99_ms=10, max_miss_rate=1.5), "max_miss_rate"),
        (lambda: comp("A", max_batch_size=0), "max_batch_size"),
        (lambda: comp("A", replicas=0), "replicas"),
        (lambda: comp("bad name"), "component name"),
        (lambda: ss.Pipeline("p", comp("A")), "declares no inputs"),
        (lambda: ss.Pipeline("bad/name", comp("A")), "pipeline name"),
        (lambda: comp("A") >> comp("A"), "two different components"),
        (lambda: ss.Pipeline("p", 42, inputs={"x": ss.Tensor("float32", (-1,))}), "cannot put"),
    ],
)
def test_bad_declarations_are_config_errors(build: object, needle: str) -> None:
    with pytest.raises(ss.ConfigError, match=needle):
        build()  # type: ignore[operator]


def test_options_and_bind_copy() -> None:
    a = comp("A")
    b = a.options(name="A2", replicas=3)
    assert (a.name, a.replicas) == ("A", 1)
    assert (b.name, b.replicas) == ("A2", 3)
    with pytest.raises(ss.ConfigError, match="unknown component option"):
        a.options(colour="red")

    class Scaled:
        def __init__(self, k: int) -> None:
            self.k = k

        def __call__(self, batch: ss.Batch) -> dict:
            return {"y": batch["x"] * self.k}

    s = ss.component(Scaled).bind(3)
    inst = s.instantiate()
    out = inst(ss.Batch({"x": np.ones((2, 1))}, [1, 1]))
    assert out["y"].tolist() == [[3.0], [3.0]]


def test_batch_mapping_and_rows() -> None:
    b = ss.Batch({"x": np.zeros((5, 2))}, [2, 3])
    assert b.rows == 5 and len(b) == 1 and list(b) == ["x"]
    assert "requests=2" in repr(b)
    with pytest.raises(KeyError, match="no input 'y'"):
        b["y"]


def test_fallback_must_cover_declared_outputs_with_one_row() -> None:
    a = comp("A", inputs={"x": ss.Tensor("float32", (-1, 2))})
    outs = {"y": ss.Tensor("float32", (-1, 2))}
    p = ss.Pipeline("p", a, outputs=outs, fallback={"y": [0, 1]})
    assert p.to_spec()["fallback"] == {"y": [0.0, 1.0]}
    with pytest.raises(ss.ConfigError, match="needs declared outputs"):
        ss.Pipeline("p", a, fallback={"y": [0, 1]})
    with pytest.raises(ss.ConfigError, match="one row of shape"):
        ss.Pipeline("p", a, outputs=outs, fallback={"y": [[0, 1]]})


def test_length_options_are_checked() -> None:
    def c(**kw: object) -> ss.Component:
        return comp("C", inputs={"text": ss.Tensor("string", (-1,)), "x": ss.Tensor("float32", (-1,))}, **kw)

    ok = c(length_of="text", max_batch_tokens=4096)
    stage = ss.Pipeline("p", ok).to_spec()["stages"][0]
    assert (stage["length_input"], stage["max_batch_tokens"]) == ("text", 4096)
    for kw, why in [({"length_of": "nope"}, "not one of its inputs"), ({"length_of": "x"}, "string or bytes"),
                    ({"max_batch_tokens": 10}, "needs length_of"),
                    ({"length_of": "text", "max_batch_tokens": 0}, ">= 1")]:
        with pytest.raises(ss.ConfigError, match=why):
            c(**kw)


def test_a_plan_s_device_binding_is_checked() -> None:
    gpu = comp("G", device="cuda")
    assert gpu.options(devices=[3, 1]).devices == (3, 1)
    for kw, why in [({"devices": [0]}, "needs device=\"cuda\""),
                    ({"device": "cuda:1", "devices": [0]}, "needs device=\"cuda\""),
                    ({"device": "cuda", "devices": [-1]}, "integers >= 0"),
                    ({"device": "cuda", "devices": ["0"]}, "integers >= 0")]:
        with pytest.raises(ss.ConfigError, match=why):
            comp("G").options(**kw)


def test_elastic_ms_is_checked_and_reaches_the_node() -> None:
    x = {"x": ss.Tensor("float32", (-1,))}
    ok = comp("E", elastic_ms=20, inputs=x)
    assert ss.Pipeline("p", ok).to_spec()["stages"][0]["elastic_ms"] == 20.0
    assert ss.Pipeline("p", comp("F", inputs=x)).to_spec()["stages"][0]["elastic_ms"] is None
    assert ok.options(elastic_ms=5.5).elastic_ms == 5.5
    for bad in (0, -1, float("nan"), float("inf"), True, "20"):
        with pytest.raises(ss.ConfigError, match="elastic_ms must be a number"):
            comp("E", elastic_ms=bad)


def test_a_batch_says_how_long_each_request_has_left() -> None:
    import time

    x = np.zeros((3, 1), np.float32)
    assert np.isinf(ss.Batch({"x": x}, [1, 2]).time_left()).all(), "no node, no deadline"
    now = time.monotonic()
    left = ss.Batch({"x": x}, [1, 2], deadlines=[now + 0.5, now - 0.1]).time_left()
    assert left.shape == (2,) and 0.4 < left[0] <= 0.5 and left[1] < 0


def test_an_example_may_be_a_function_called_and_checked_when_first_needed() -> None:
    calls = []

    def make() -> dict:
        calls.append(1)
        return {"x": [[1.0, 2.0, 3.0, 4.0]]}

    @ss.component(inputs={"x": ss.Tensor("float32", (-1, 4))}, outputs={"y": ss.Tensor("float32", (-1, 4))})
    class Same:
        def __call__(self, batch):
            return {"y": batch["x"]}

    pipe = ss.Pipeline("lazy", Same, example=make)
    assert calls == []  # declaring the pipeline (every worker imports the app) costs nothing
    assert pipe.example_batch(2)["x"].tolist() == [[1.0, 2.0, 3.0, 4.0]] * 2
    assert pipe.to_spec()["example"] == {"x": [[1.0, 2.0, 3.0, 4.0]]}
    assert calls == [1]
    wrong = ss.Pipeline("wrong", Same, example=lambda: {"z": [[1.0]]})
    with pytest.raises(ss.ConfigError, match="example must give exactly the inputs"):
        wrong.example_batch(1)
