"""Test app: components that take and return torch tensors (CPU).

Each component checks what it was handed and reports, as outputs, facts the
tests assert on: whether torch is loaded in its worker at all, and where
its input tensor's memory lies.
"""

import sys

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 3))}


def _loaded(rows: int) -> np.ndarray:
    return np.full((rows, 1), "torch" in sys.modules)


@ss.component(max_batch_size=16, inputs=X, tensors="torch")
class TorchPass:
    """Returns (a slice of) its input: the worker passes it on by reference."""

    def __call__(self, batch: ss.Batch) -> dict:
        import torch

        x = batch["x"]
        if not isinstance(x, torch.Tensor) or x.requires_grad or x.device.type != "cpu":
            raise TypeError(f"expected a CPU torch tensor, got {type(x)}")
        return {"x": x[:, :]}


@ss.component(max_batch_size=16, tensors="torch")
class TorchAffine:
    def __call__(self, batch: ss.Batch) -> dict:
        import torch

        x = batch["x"]
        assert isinstance(x, torch.Tensor), type(x)
        return {"y": x * 2 + 1}


torch_chain = ss.Pipeline("torch_chain", TorchPass >> TorchAffine)


@ss.component(max_batch_size=16, inputs=X)
class NumpyFirst:
    """numpy mode: must not have torch loaded, must get numpy."""

    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        assert isinstance(x, np.ndarray) and not x.flags.writeable
        return {"x": x + 1, "first_torch": _loaded(batch.rows)}


@ss.component(max_batch_size=16, tensors="torch")
class TorchMiddle:
    def __call__(self, batch: ss.Batch) -> dict:
        import torch

        x = batch["x"]
        assert isinstance(x, torch.Tensor), type(x)
        # A tensor that requires grad, and a non-contiguous one: both become numpy outputs.
        w = torch.full((3,), 2.0, requires_grad=True)
        return {"x": x * w, "t": x.t().contiguous().t()[:, :2], "first_torch": batch["first_torch"]}


@ss.component(max_batch_size=16)
class NumpyLast:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        assert isinstance(x, np.ndarray) and isinstance(batch["t"], np.ndarray)
        return {"y": x - 1, "t": batch["t"], "first_torch": batch["first_torch"], "last_torch": _loaded(batch.rows)}


mixed = ss.Pipeline("mixed", NumpyFirst >> TorchMiddle >> NumpyLast)


@ss.component(max_batch_size=16, inputs=X)
class NumpyReturnsTorch:
    """numpy mode, returning torch tensors: a computed one and a strided slice."""

    def __call__(self, batch: ss.Batch) -> dict:
        import torch

        x = batch["x"]
        return {"y": torch.from_numpy(x * 3), "x0": torch.from_numpy(x.copy())[:, :1]}


np_torch = ss.Pipeline("np_torch", NumpyReturnsTorch)


@ss.component(max_batch_size=16, inputs={"s": ss.Tensor("string", (-1,)), **X}, tensors="torch")
class TorchText:
    """String inputs stay numpy object arrays in torch mode."""

    def __call__(self, batch: ss.Batch) -> dict:
        import torch

        s, x = batch["s"], batch["x"]
        assert isinstance(s, np.ndarray) and s.dtype == object and isinstance(x, torch.Tensor)
        return {"n": torch.tensor([[len(v)] for v in s], dtype=torch.int64), "s": s}


text = ss.Pipeline("torch_text", TorchText)
