"""The worker's torch path (tensors.py) against a real shared-memory pool:
inputs are tensors over the pool's pages, outputs go back without copies
where they can, and the declared options are checked."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import slipstream as ss
from slipstream._internal import tensors
from slipstream._internal.errors import ConfigError
from slipstream._internal.worker import Pools, run_batch

from tests.unit.test_worker import pools, put_input  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")


def test_inputs_are_tensors_over_the_pool_and_slices_go_back_by_reference(pools: Pools) -> None:  # noqa: F811
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    d = put_input(pools, x)
    seen = {}

    class Comp:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            seen["x"] = batch["x"]
            x = batch["x"]
            return {"same": x[:], "new": x * 2, "grad": x * torch.ones(2, requires_grad=True)}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not writable" warning from torch.from_numpy
        reply = run_batch(Comp(), pools, {"id": 1, "rows": [4], "inputs": {"x": d}}, tensors.TorchInputs("cpu"))
    # The tensor's data is the pool's bytes, not a copy.
    _, _, base = pools._map(0)
    assert isinstance(seen["x"], torch.Tensor) and seen["x"].data_ptr() == base + d["offset"]
    out = reply["outputs"]
    assert (out["same"]["origin"], out["same"]["pool"], out["same"]["offset"]) == ("borrowed", 0, d["offset"])
    assert out["new"]["origin"] == out["grad"]["origin"] == "copied"
    np.testing.assert_array_equal(pools.array(out["new"]), x * 2)
    np.testing.assert_array_equal(pools.array(out["grad"]), x)


def test_torch_outputs_of_a_numpy_component(pools: Pools) -> None:  # noqa: F811
    x = np.ones((2, 3), dtype=np.float32)
    msg = {"id": 2, "rows": [2], "inputs": {"x": put_input(pools, x)}}

    class Comp:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            t = torch.from_numpy(batch["x"] * 3)
            return {"y": t, "t": t.t().contiguous().t(), "g": t * torch.ones(3, requires_grad=True)}

    reply = run_batch(Comp(), pools, msg)
    for name in ("y", "t", "g"):
        assert reply["outputs"][name]["origin"] == "copied"
        np.testing.assert_array_equal(pools.array(reply["outputs"][name]), x * 3)

    class BFloat:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {"b": torch.ones(2, 1, dtype=torch.bfloat16)}

    with pytest.raises(TypeError, match="numpy cannot hold"):
        run_batch(BFloat(), pools, msg)


def test_component_options_are_checked() -> None:
    class C:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {}

    c = ss.component(C, tensors="torch", device="cuda:1")
    assert (c.tensors, c.device) == ("torch", "cuda:1")
    assert c.options(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="tensors is"):
        ss.component(C, tensors="jax")
    for bad in ("gpu", "cuda:", "cuda:x", 0):
        with pytest.raises(ConfigError, match="device is"):
            ss.component(C, device=bad)
    spec = ss.Pipeline("p", c, inputs={"x": ss.Tensor("float32", (-1, 2))}).to_spec()
    assert spec["stages"][0]["device"] == "cuda:1"
