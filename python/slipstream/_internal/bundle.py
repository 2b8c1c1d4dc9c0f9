"""Pipeline objects as an app file: ``ss.launch(pipeline)`` and ``ss.serve(pipeline)``.

Workers are separate processes that load their component from the app
(``--app FILE``, see worker.py), so a ``Pipeline`` built in a script, a test
or a notebook has to reach them as a file. It is written with cloudpickle
into a private temporary directory and given to ``slipstream serve`` as the
app; ``app.load_pipelines`` reads a ``.pkl`` app with this module, so the
spec, the workers and the CLI's checks all take the same path as an app file.

Why cloudpickle: the standard pickle stores a class by its import path, and
a class defined in ``__main__``, a notebook cell or a function body has none
that another process could import. cloudpickle stores those by value (their
code and the globals they use); classes in importable modules stay by
reference, so the file also records the creator's ``sys.path`` and the
loader appends the entries it lacks before unpickling.

A pickle runs code when it is loaded: the file lives in a directory only its
owner can read (``tempfile.mkdtemp``), and is removed when the node stops.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slipstream._internal.api import Pipeline
from slipstream._internal.errors import ConfigError
from slipstream._internal.seeds import SEEDS

#: An app path with this suffix is a bundle, not a Python file.
SUFFIX = ".pkl"
_FORMAT = 1


def as_pipelines(obj: Any) -> list[Pipeline] | None:
    """``obj`` as a list of pipelines if it is a ``Pipeline`` or an iterable of
    them (not a path), else None."""
    if isinstance(obj, Pipeline):
        return [obj]
    if isinstance(obj, (str, bytes, os.PathLike)) or not isinstance(obj, Iterable):
        return None
    items = list(obj)
    if items and all(isinstance(p, Pipeline) for p in items):
        return items
    return None


def write(pipelines: list[Pipeline]) -> Path:
    """Write ``pipelines`` to ``pipelines.pkl`` in a new private temporary
    directory and return the file's path (remove it with ``remove``)."""
    import cloudpickle

    names = [p.name for p in pipelines]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"several pipelines are named {', '.join(dup)}")
    try:
        payload = cloudpickle.dumps(pipelines, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # a lock, an open file, a live model handle... in a component's options
        raise ConfigError(f"cannot send the pipelines to their workers: {type(e).__name__}: {e} "
                          "(construct models in the component's __init__, not before)") from e
    directory = Path(tempfile.mkdtemp(prefix="slipstream-app-"))
    path = directory / ("pipelines" + SUFFIX)
    cwd = os.getcwd()
    doc = {"format": _FORMAT, "sys_path": [p or cwd for p in sys.path], "pipelines": payload}
    path.write_bytes(pickle.dumps(doc, protocol=pickle.HIGHEST_PROTOCOL))
    return path


def remove(path: Path) -> None:
    """Remove a bundle written by ``write``, with its directory."""
    shutil.rmtree(path.parent, ignore_errors=True)


def load(path: Path) -> list[Pipeline]:
    """The pipelines in a bundle written by ``write``."""
    try:
        doc = pickle.loads(path.read_bytes())
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a slipstream pipeline bundle")
        for entry in doc["sys_path"]:
            if entry not in sys.path:
                sys.path.append(entry)
        pipelines = pickle.loads(doc["pipelines"])
    except (OSError, ValueError, KeyError, ImportError, AttributeError, pickle.UnpicklingError) as e:
        raise ConfigError(f"cannot load the pipelines from {path}: {e}") from None
    if not isinstance(pipelines, list) or not all(isinstance(p, Pipeline) for p in pipelines):
        raise ConfigError(f"{path} holds no list of slipstream.Pipeline")
    for p in pipelines:  # as Pipeline.__init__ does in the creating process
        SEEDS.update((s.key, s) for s in p.seeds)
    return pipelines
