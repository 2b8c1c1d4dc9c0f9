"""The worker's batch path against a real shared-memory pool."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
from slipstream import _core
from slipstream._internal import protocol
from slipstream._internal.worker import Pools, run_batch


@pytest.fixture()
def pools() -> Iterator[Pools]:
    d = tempfile.mkdtemp()
    prefix = os.path.join(d, "pool")
    ingress = _core.Pool.create(f"{prefix}-0", 0, 1 << 20)
    own = _core.Pool.create(f"{prefix}-1", 1, 1 << 20)
    p = Pools(prefix, 1)
    p._ingress = ingress  # type: ignore[attr-defined]
    yield p
    ingress.unlink()
    own.unlink()


def put_input(pools: Pools, a: np.ndarray) -> dict:
    ingress = pools._ingress  # type: ignore[attr-defined]
    off = ingress.alloc(a.nbytes)
    _, mv, _ = pools._map(0)
    np.frombuffer(mv, dtype=a.dtype, count=a.size, offset=off)[:] = a.ravel()
    return {"pool": 0, "offset": off, "nbytes": a.nbytes, "dtype": a.dtype.name, "shape": list(a.shape)}


def test_inputs_are_read_only_views_and_outputs_land_in_own_pool(pools: Pools) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    seen = {}

    class Comp:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            seen["x"] = batch["x"]
            return {"y": batch["x"] * 2}

    msg = {"id": 1, "rows": [1, 2], "inputs": {"x": put_input(pools, x)}}
    reply = run_batch(Comp(), pools, msg)
    assert not seen["x"].flags.writeable
    assert seen["x"].base is not None  # a view, not a copy
    y = reply["outputs"]["y"]
    assert y["origin"] == "copied" and y["pool"] == 1 and y["shape"] == [3, 2]
    np.testing.assert_array_equal(pools.array(y), x * 2)


def test_returning_an_input_passes_it_by_reference(pools: Pools) -> None:
    x = np.ones((4, 2), dtype=np.float32)

    class Identity:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {"same": batch["x"], "copy": batch["x"] + 0}

    d = put_input(pools, x)
    used_before = pools.own.used_bytes
    reply = run_batch(Identity(), pools, {"id": 2, "rows": [4], "inputs": {"x": d}})
    out = reply["outputs"]["same"]
    assert out["origin"] == "borrowed" and (out["pool"], out["offset"]) == (0, d["offset"])
    assert reply["outputs"]["copy"]["origin"] == "copied"
    # Only the computed output took space in the worker's pool.
    assert pools.own.used_bytes - used_before == 64


def test_wrong_row_count_or_type_raises_and_frees(pools: Pools) -> None:
    x = np.ones((2, 2), dtype=np.float32)
    msg = {"id": 3, "rows": [2], "inputs": {"x": put_input(pools, x)}}

    class WrongRows:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {"ok": np.zeros((2, 1)), "bad": np.zeros((3, 1))}

    before = pools.own.used_bytes
    with pytest.raises(ValueError, match="first dimension must be the batch's 2 rows"):
        run_batch(WrongRows(), pools, msg)
    assert pools.own.used_bytes == before  # the block written for "ok" was released

    class NotADict:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return [1, 2]

    with pytest.raises(TypeError, match="dict of arrays"):
        run_batch(NotADict(), pools, msg)

    class Complex:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {"c": np.array([1j, 2j])}

    with pytest.raises(TypeError, match="cannot be served"):
        run_batch(Complex(), pools, msg)

    class Mixed:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {"m": np.array(["a", b"b"], dtype=object)}

    with pytest.raises(TypeError, match="only str or only bytes"):
        run_batch(Mixed(), pools, msg)


def test_outputs_in_another_byte_order_are_served_in_the_machines(pools: Pools) -> None:
    x = np.ones((2, 2), dtype=np.float32)
    msg = {"id": 4, "rows": [2], "inputs": {"x": put_input(pools, x)}}
    foreign = ">" if np.little_endian else "<"

    class Swapped:
        def __call__(self, batch):  # type: ignore[no-untyped-def]
            return {"y": np.array([[1.5], [-2.0]], dtype=f"{foreign}f4"), "n": np.array([7, 8], dtype=f"{foreign}i8")}

    reply = run_batch(Swapped(), pools, msg)
    assert reply["outputs"]["y"]["dtype"] == "float32" and reply["outputs"]["n"]["dtype"] == "int64"
    np.testing.assert_array_equal(pools.array(reply["outputs"]["y"]), [[1.5], [-2.0]])
    np.testing.assert_array_equal(pools.array(reply["outputs"]["n"]), [7, 8])


def test_protocol_round_trip() -> None:
    msgs = [{"op": "ready", "pid": 1}, {"op": "batch", "id": 2, "rows": [1], "inputs": {}}]
    stream = io.BytesIO(b"".join(protocol.encode(m) for m in msgs))
    assert protocol.read(stream) == msgs[0]
    assert protocol.read(stream) == msgs[1]
    assert protocol.read(stream) is None
