"""The request bodies sent to each pipeline, the same bytes for both
systems: one realistic request (``body``), or, where the example ships a
mix of real inputs, that mix (``mix``: RAG's 1,000 benchmark queries, of
varied lengths), which the open-loop generator sends in turn and the
offline limit batches (so that goodput and limit are measured on the same
inputs).

In order of preference, for pipeline ``NAME`` of ``examples/APP.py``:

1. ``bench/vs_ray/bodies/NAME.json`` if it exists (a checked-in body);
2. a builder below that uses the example's own client or data helpers
   (``examples/APP_client.py``'s ``body_for`` / ``example_body`` /
   ``request_body`` / ``sample_body``, or the builders in ``BUILDERS``);
3. a generic body from the pipeline's declared inputs: one row, ``-1``
   trailing dimensions as 8, deterministic values, text for string inputs.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import ROOT, example_module

HERE = Path(__file__).resolve().parent
CLIENT_FUNCS = ("example_body", "request_body", "sample_body", "body_for")
TEXT = "how do I configure a reverse proxy with TLS termination"


def _noop(app: Path, pipeline: Any) -> dict[str, Any]:
    return {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}


def _recsys(app: Path, pipeline: Any) -> dict[str, Any]:
    client = _client(app)
    history = [int(h) for h in np.random.default_rng(7).integers(0, 200_000, size=5)]
    if client is not None and hasattr(client, "body_for"):
        return dict(client.body_for(4242, history))
    return {"inputs": {"user": [[4242]], "history": [(history + [-1] * 8)[:8]]}}


def _multimodal(app: Path, pipeline: Any) -> dict[str, Any]:
    """A planted scene and its caption (the query must find that item first)."""
    mod = example_module(app.stem, app.resolve().parent)
    shape = mod.PLANTED[0]
    return {"inputs": {"text": [mod.caption(*shape)], "image": mod.scene(*shape)[None].tolist()}}


def _benchmark_query(app: Path) -> str:
    """The first of the examples' benchmark queries (a Debian package summary
    whose package is in the index), or a fixed question without the data."""
    try:
        corpus = example_module("models.corpus", app.resolve().parent)
        return str(corpus.load_queries()[0]["query"])
    except Exception as e:  # noqa: BLE001 - no prepared data: a fixed, realistic question
        print(f"bodies: no benchmark queries ({e}); using a fixed question", file=sys.stderr)
        return TEXT


def _rag(app: Path, pipeline: Any) -> dict[str, Any]:
    return {"inputs": {"query": [_benchmark_query(app)]}}


def _audioquery(app: Path, pipeline: Any) -> dict[str, Any]:
    """One spoken benchmark query (espeak-ng), as the example's client sends it."""
    speech = example_module("models.speech", app.resolve().parent)

    width = int(pipeline.inputs["audio"].shape[1])
    clip = speech.synthesize(_benchmark_query(app))[:width]
    client = _client(app)
    if client is not None and hasattr(client, "request_body"):
        return dict(client.request_body(clip, width, ""))
    audio, length = speech.pad_batch([clip], width)
    return {"inputs": {"audio": audio.tolist(), "length": length.tolist(), "exclude": [""]}}


BUILDERS: dict[str, Callable[[Path, Any], dict[str, Any]]] = {
    "noop": _noop,
    "recsys": _recsys,
    "multimodal": _multimodal,
    "rag": _rag,
    "rag_late": _rag,
    "audioquery": _audioquery,
}


def _client(app: Path) -> Any:
    path = app.with_name(f"{app.stem}_client.py")
    if not path.exists():
        return None
    try:
        return example_module(path.stem, app.resolve().parent)
    except Exception as e:  # noqa: BLE001 - a client being written right now
        print(f"bodies: cannot import {path.name} ({e}); using a generic body", file=sys.stderr)
        return None


def _from_client(app: Path) -> dict[str, Any] | None:
    client = _client(app)
    if client is None:
        return None
    for name in CLIENT_FUNCS:
        fn = getattr(client, name, None)
        if callable(fn) and all(p.default is not inspect.Parameter.empty
                                for p in inspect.signature(fn).parameters.values()):
            body = fn()
            if isinstance(body, dict):
                return body if "inputs" in body else {"inputs": body}
    return None


def generic(pipeline: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    inputs: dict[str, Any] = {}
    for name, spec in pipeline.inputs.items():
        shape = [1] + [d if d >= 0 else 8 for d in spec.shape[1:]]
        if spec.dtype == "string":
            inputs[name] = np.full(shape, TEXT, dtype=object).tolist()
        elif spec.dtype == "bytes":
            import base64

            inputs[name] = np.full(shape, base64.b64encode(TEXT.encode()).decode(), dtype=object).tolist()
        elif spec.dtype == "bool":
            inputs[name] = (rng.random(shape) < 0.5).tolist()
        elif spec.dtype.startswith(("int", "uint")):
            inputs[name] = rng.integers(0, 100, size=shape).tolist()
        else:
            inputs[name] = rng.standard_normal(shape).astype(spec.dtype).tolist()
    return {"inputs": inputs}


def _rag_mix(app: Path, pipeline: Any) -> list[dict[str, Any]]:
    """One request per benchmark query, in the file's (shuffled) order."""
    corpus = example_module("models.corpus", app.resolve().parent)
    return [{"inputs": {"query": [str(q["query"])]}} for q in corpus.load_queries()]


MIXES: dict[str, Callable[[Path, Any], list[dict[str, Any]]]] = {
    "rag": _rag_mix,
    "rag_late": _rag_mix,
}


def mix(app: Path, pipeline: Any) -> tuple[list[bytes], str]:
    """(the bodies, where they came from): the pipeline's real input mix
    where one is known and its data is prepared, else ``[body(...)]``."""
    build = MIXES.get(pipeline.name)
    if build is not None and not (HERE / "bodies" / f"{pipeline.name}.json").exists():
        try:
            bodies = [json.dumps(b).encode() for b in build(app, pipeline)]
            if bodies:
                return bodies, f"bodies.py:{pipeline.name} mix ({len(bodies)} requests)"
        except Exception as e:  # noqa: BLE001 - data not prepared: one request
            print(f"bodies: no input mix for {pipeline.name} ({e}); using one request", file=sys.stderr)
    one, source = body(app, pipeline)
    return [one], source


def body(app: Path, pipeline: Any) -> tuple[bytes, str]:
    """(the body, where it came from)."""
    fixed = HERE / "bodies" / f"{pipeline.name}.json"
    if fixed.exists():
        return fixed.read_bytes(), str(fixed.relative_to(ROOT))
    if pipeline.name in BUILDERS:
        return json.dumps(BUILDERS[pipeline.name](app, pipeline)).encode(), f"bodies.py:{pipeline.name}"
    from_client = _from_client(app)
    if from_client is not None:
        return json.dumps(from_client).encode(), f"{app.stem}_client.py"
    return json.dumps(generic(pipeline)).encode(), "generic (declared inputs)"


def as_v2(bodies: list[bytes], pipeline: Any) -> tuple[list[bytes], int]:
    """The same requests as KServe v2 binary bodies, what ``ss.Client``
    sends (``/v2/models/NAME/infer``): each a JSON header, then its tensors'
    raw bytes, binary outputs asked for. Every header is padded with spaces
    to the longest (JSON allows it), so that one
    ``Inference-Header-Content-Length`` (returned) fits every body: the
    generator sends the same headers on every request."""
    from slipstream._internal.client import encode_request

    from bench.vs_ray.ray_adapter import inputs_from_json

    encoded = [encode_request(inputs_from_json(json.loads(b), pipeline.inputs)) for b in bodies]
    n = max((len(head) for head, _ in encoded), default=0)
    return [head.ljust(n) + b"".join(bytes(p) for p in parts) for head, parts in encoded], n
