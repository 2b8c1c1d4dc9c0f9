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

From Python, ``ss.launch(app)`` starts a node in the background (``app``: a
file, or Pipeline objects) and ``ss.Client(url)`` / ``ss.AsyncClient(url)``
query one; errors are the ``ss.Error`` tree (``ss.Overloaded``,
``ss.DeadlineExceeded``, ...)::

    with ss.launch(app) as node, node.client() as client:
        out = client.infer("demo", {"x": np.ones((1, 2), np.float32)}, deadline_ms=50)
"""

from slipstream import store
from slipstream._internal.api import (
    SLO,
    Batch,
    Cache,
    Component,
    Graph,
    Pipeline,
    Pool,
    Select,
    Tensor,
    component,
    worker_threads,
)
from slipstream._internal.client import AsyncClient, AsyncStream, Client, Outputs, Stream
from slipstream._internal.errors import (
    ArenaFull,
    BadInput,
    BadRequest,
    Cancelled,
    ClientTimeout,
    ComponentError,
    ComponentFailed,
    ConfigError,
    DeadlineExceeded,
    Error,
    Forbidden,
    InternalError,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    RequestTimeout,
    ServeError,
    ShuttingDown,
    StoreBadRequest,
    StoreConflict,
    StoreError,
    StoreGone,
    StoreNotFound,
    StoreUnauthorized,
    StoreUnavailable,
    TensorFormatError,
    Unauthorized,
    Unavailable,
    UnknownPipeline,
    UnknownStage,
    Unreachable,
)
from slipstream._internal.launch import Server, launch, serve
from slipstream._internal.needs import loaded_versions
from slipstream._internal.retry import RetryPolicy, RetryStats
from slipstream._internal.store import Object

__version__ = "0.1.0"

__all__ = [
    "SLO",
    "ArenaFull",
    "AsyncClient",
    "AsyncStream",
    "BadInput",
    "BadRequest",
    "Batch",
    "Cache",
    "Cancelled",
    "Client",
    "ClientTimeout",
    "Component",
    "ComponentError",
    "ComponentFailed",
    "ConfigError",
    "DeadlineExceeded",
    "Error",
    "Forbidden",
    "Graph",
    "InternalError",
    "MethodNotAllowed",
    "NotFound",
    "Object",
    "Outputs",
    "Overloaded",
    "PayloadTooLarge",
    "Pipeline",
    "Pool",
    "RequestError",
    "RequestTimeout",
    "RetryPolicy",
    "RetryStats",
    "Select",
    "ServeError",
    "Server",
    "ShuttingDown",
    "StoreBadRequest",
    "StoreConflict",
    "StoreError",
    "StoreGone",
    "StoreNotFound",
    "StoreUnauthorized",
    "StoreUnavailable",
    "Stream",
    "Tensor",
    "TensorFormatError",
    "Unauthorized",
    "Unavailable",
    "UnknownPipeline",
    "UnknownStage",
    "Unreachable",
    "__version__",
    "component",
    "launch",
    "loaded_versions",
    "serve",
    "store",
    "worker_threads",
]
