"""Slipstream: serve multi-stage ML pipelines under a latency SLO.

Declare components (plain Python classes with a batched ``__call__``), wire
them into a DAG with ``>>``, give the pipeline an SLO, and serve it with
``slipstream serve app.py``::

    import numpy as np
    import slipstream as ss

    @ss.component(max_batch_size=64, replicas=2)
    class Normalize:
        def __call__(self, batch: ss.Batch) -> dict:
            x = batch["x"]
            return {"y": x / np.linalg.norm(x, axis=1, keepdims=True)}

    app = ss.Pipeline("demo", Normalize, inputs={"x": ss.Tensor("float32", (-1, 2))},
                      slo=ss.SLO(p99_ms=50))

Models, indices and documents live in the node's versioned object store
(``ss.store``): a component declares the objects it needs
(``@ss.component(needs={"model": "/models/m"})``) and is rebuilt when a new
version is put, or is invoked by puts under a prefix (``watch="/docs/"``).
"""

from slipstream import store
from slipstream._internal.api import (
    SLO,
    Batch,
    Component,
    Graph,
    Pipeline,
    Pool,
    Tensor,
    component,
    worker_threads,
)
from slipstream._internal.errors import (
    ComponentError,
    ConfigError,
    Error,
    ServeError,
    StoreBadRequest,
    StoreConflict,
    StoreError,
    StoreGone,
    StoreNotFound,
    StoreUnauthorized,
    StoreUnavailable,
    TensorFormatError,
)
from slipstream._internal.launch import Server, launch
from slipstream._internal.needs import loaded_versions
from slipstream._internal.store import Object

__version__ = "0.1.0"

__all__ = [
    "SLO",
    "Batch",
    "Component",
    "ComponentError",
    "ConfigError",
    "Error",
    "Graph",
    "Object",
    "Pipeline",
    "Pool",
    "ServeError",
    "Server",
    "StoreBadRequest",
    "StoreConflict",
    "StoreError",
    "StoreGone",
    "StoreNotFound",
    "StoreUnauthorized",
    "StoreUnavailable",
    "Tensor",
    "TensorFormatError",
    "__version__",
    "component",
    "launch",
    "loaded_versions",
    "store",
    "worker_threads",
]
