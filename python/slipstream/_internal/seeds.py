"""Seeds: files a pipeline puts under store keys when the node starts
(``ss.Pipeline(seed={key: path})``), and the registry of every seed the
pipelines of this process declared.

The registry is how a component's ``needs`` resolve outside a worker
(``needs.resolve``: profiling, benchmarks) when no node is named: the
seed file stands for the key's value. It lives here, below both the
declarations that fill it (``api.Pipeline``, ``bundle.load``) and the
resolution that reads it, so that neither has to import the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from slipstream._internal.errors import ConfigError
from slipstream._internal.keys import declared_key
from slipstream._internal.named_tensors import guess_content_type


@dataclass(frozen=True)
class Seed:
    """A file put under ``key`` when the node starts, before any worker, if
    the key has no live version. Made by ``Pipeline(seed=...)``."""

    key: str
    path: str
    content_type: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "path": self.path, "content_type": self.content_type}


#: Every seed the pipelines made in this process declared, by key: what a
#: component's needs resolve to outside a worker when no node is named.
SEEDS: dict[str, Seed] = {}


def declare_seed(key: Any, value: Any, where: str) -> Seed:
    """``seed={key: path}`` or ``{key: (path, content_type)}``: the file must
    exist now; its content type defaults to named tensors when the file
    starts with their magic, else what its name says, else octets."""
    declared_key(key, where, write=True)
    content_type = None
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], str):
            raise ConfigError(f"{where}: seed {key!r} takes a path or (path, content_type), got {value!r}")
        value, content_type = value
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{where}: seed {key!r} takes a file path, got {type(value).__name__}")
    path = os.path.abspath(os.fspath(value))
    if not os.path.isfile(path) and os.environ.get("SLIPSTREAM_WORKER") == "1":
        # A worker reads the key from the store (its node seeded it, from
        # where the deployment put the file); the file need not be here.
        return Seed(key, path, content_type or "application/octet-stream")
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: seed {key!r}: no such file {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ConfigError(f"{where}: seed {key!r}: cannot read {path}: {e.strerror or e}") from None
    return Seed(key, path, content_type or guess_content_type(head, str(path)))
