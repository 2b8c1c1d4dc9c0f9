"""Torch tensors in and out of components, without copies on the CPU.

``@ss.component(tensors="torch", device=...)`` hands the component torch
tensors instead of numpy arrays; any component may return torch tensors.
The worker (``worker.py``) calls in here at two points: ``TorchInputs``
turns a batch's numpy views over shared memory into tensors, and
``host_output`` turns a returned tensor back into an array the worker can
describe to the node. torch is imported only here and only for components
that declare ``tensors="torch"`` (it takes seconds); returned tensors are
recognised through ``sys.modules``, so a numpy-only worker never imports it.

Inputs. ``torch.from_numpy`` over the same pages: zero-copy. The worker's
numpy views are read-only (published blocks never change, data-path.md),
but torch has no read-only tensors: ``from_numpy`` of a read-only array
warns (once a process) that writing is undefined, and DLPack export of a
read-only array is refused by numpy before 2.1. So the torch path asks the
worker for *writable* numpy views of the same mapping (which is mapped
read-write) and builds the tensors from those, without a warning. The
price: an in-place op on an input (``x.add_(1)``) would change bytes that
other stages and requests read, so inputs must not be written, as the
component docs say. (A second, read-only mapping would make such a write a
SIGSEGV of the worker instead: loud, but a crash loop for an innocent-looking
``relu_``, so we did not.) String and bytes inputs stay numpy object arrays.
For a CUDA component each input moves to the device once per batch (one
``.to``; the pages are not pinned, so the copy is synchronous).

Outputs. A CPU tensor becomes ``tensor.detach().numpy()``, a view of the
same memory: a slice of an input still lies in an input pool, so the worker
passes it on by reference ("borrowed"), and anything else is copied once
into the replica's pool, as for numpy outputs. A GPU tensor is copied from
the device once, straight into a new block of the replica's pool (no
intermediate host buffer).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from slipstream._internal.dtypes import DTYPES


class OwnPool(Protocol):
    """What ``host_output`` needs of the worker's pools."""

    own: Any  # the replica's own pool: .free(offset, nbytes)

    def own_array(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[np.ndarray, int, int]: ...


def is_torch(value: Any) -> bool:
    """A torch tensor? (Without importing torch: if none is loaded, it is not.)"""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


class TorchInputs:
    """Turns a batch's arrays into torch tensors on the component's device."""

    def __init__(self, device: str):
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"a component declared with tensors=\"torch\" needs torch in the worker's Python "
                              f"(pip install 'slipstream[torch]'): {e}") from None
        self.torch = torch
        self.device = "cpu"
        if device.startswith("cuda"):
            # The node set CUDA_VISIBLE_DEVICES to this replica's one GPU: it is cuda:0 here.
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"device={device!r}, but torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}; "
                    f"torch {torch.__version__} built for CUDA {torch.version.cuda})")
            torch.cuda.init()  # before ready, not on the first batch
            self.device = "cuda"

    def __call__(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, a in arrays.items():
            if a.dtype == object:  # string / bytes
                out[name] = a
                continue
            t = self.torch.from_numpy(a)
            if self.device != "cpu":
                t = t.to(self.device)
            out[name] = t
        return out


def for_component(tensors: str, device: str) -> TorchInputs | None:
    """The input conversion a component declared, or None for numpy."""
    return TorchInputs(device) if tensors == "torch" else None


def host_output(name: str, value: Any, pools: OwnPool) -> tuple[np.ndarray, tuple[int, int] | None]:
    """A returned torch tensor as a numpy array, and ``(offset, nbytes)`` of
    the block of the replica's pool it was copied into (a GPU tensor), or
    None when it is a view of the tensor's own memory (a CPU tensor)."""
    t = value.detach()
    # Only the dtypes the node serves: numpy may know more (ml_dtypes adds
    # bfloat16 to numpy, but torch's .numpy() still refuses it).
    name_of = str(t.dtype).removeprefix("torch.")
    if name_of not in DTYPES:
        raise TypeError(f"output {name!r} is a {t.dtype} tensor, which numpy cannot hold: "
                        "convert it (e.g. .float())")
    dtype = np.dtype(name_of)
    if t.device.type == "cpu":
        return t.resolve_conj().resolve_neg().numpy(), None
    import torch  # loaded: `value` is a tensor

    dst, off, nbytes = pools.own_array(dtype, tuple(t.shape))
    try:
        torch.from_numpy(dst).copy_(t)  # device to host, once, into shared memory
    except BaseException:
        pools.own.free(off, nbytes)
        raise
    return dst, (off, nbytes)


def as_numpy(value: Any) -> Any:
    """`value` as numpy when it is a torch tensor (copied off a GPU), else as
    it is: for tools that run components outside a worker (``slipstream
    profile``)."""
    return value.detach().cpu().resolve_conj().resolve_neg().numpy() if is_torch(value) else value
