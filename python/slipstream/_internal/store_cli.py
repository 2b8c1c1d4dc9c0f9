"""The object store's commands: ``slipstream put / get / ls / versions / rm``.

Each talks to a node's ``/v1/store`` routes through ``ss.store.Store``;
errors from the node come back as one line (exit status 1).
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import sys
import time
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from slipstream._internal.keys import check_key
from slipstream._internal.named_tensors import TENSORS, guess_content_type
from slipstream._internal.store import Store, map_blob


def fail(msg: str, code: int = 1) -> int:
    """Say what went wrong on one line; the command's exit status."""
    print(f"slipstream: error: {msg}", file=sys.stderr)
    return code


def _store(a: argparse.Namespace) -> Store:
    return Store(a.url, a.token)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


def _unix_time(text: str) -> float:
    """``--as-of``: unix seconds, or an ISO date-time in local time (2026-05-09T14:30:00)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not unix seconds or an ISO date-time: {text!r}") from None


def _read_input(path: str) -> memoryview:
    """A file's bytes (memory-mapped, not copied) or stdin's (``-``)."""
    if path == "-":
        return memoryview(sys.stdin.buffer.read())
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a file")
    data = map_blob(path, st.st_size)
    if data is None:
        raise OSError(f"{path} changed while it was read")
    return data


def _read_npz(path: str) -> dict[str, Any]:
    """The arrays of an .npz file (or one .npy array, as "value")."""
    try:
        loaded = np.load(io.BytesIO(sys.stdin.buffer.read()) if path == "-" else path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return {"value": loaded}
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path} is not a .npz file of numeric arrays ({e})") from None


def cmd_put(a: argparse.Namespace) -> int:
    check_key(a.key, write=True)
    try:
        if a.npz:
            if a.content_type not in (None, TENSORS):
                return fail(f"--npz stores named tensors ({TENSORS}), not {a.content_type}")
            value: Any = _read_npz(a.file)
            content_type = TENSORS
        else:
            value = _read_input(a.file)
            content_type = a.content_type or guess_content_type(value[:4].tobytes(), None if a.file == "-" else a.file)
    except (OSError, ValueError) as e:
        return fail(f"cannot read {a.file}: {getattr(e, 'strerror', None) or e}")
    v = _store(a).put(a.key, value, if_version=a.if_version, content_type=content_type)
    print(f"{v.key} version {v.version} ({_size(v.size)}, {v.content_type})")
    return 0


def cmd_get(a: argparse.Namespace) -> int:
    obj = _store(a).get(a.key, version=a.version, as_of=a.as_of)
    what = f"{obj.key} version {obj.version} ({_size(obj.size)}, {obj.content_type}, {_when(obj.timestamp)})"
    if a.output:
        try:
            Path(a.output).write_bytes(obj.memoryview())
        except OSError as e:
            return fail(f"cannot write {a.output}: {e.strerror or e}")
        print(f"wrote {a.output}: {what}", file=sys.stderr)
    elif obj.content_type == TENSORS:
        print(what)
        for name, t in obj.tensors().items():
            print(f"  {name:<24} {t.dtype.name:<8} {list(t.shape)}")
    else:
        sys.stdout.buffer.write(obj.memoryview())
        sys.stdout.flush()
    return 0


def cmd_ls(a: argparse.Namespace) -> int:
    listing = _store(a).keys(a.prefix, limit=a.limit)
    width = max((len(v.key) for v in listing), default=0)
    for v in listing:
        print(f"{v.key:<{width}}  v{v.version:<5} {_size(v.size):>9}  {_when(v.timestamp)}  {v.content_type}")
    if listing.truncated:
        print(f"slipstream: more keys under {a.prefix} than --limit {a.limit}", file=sys.stderr)
    return 0


def cmd_versions(a: argparse.Namespace) -> int:
    for v in _store(a).versions(a.key):
        what = "deleted" if v.deleted else f"{_size(v.size):>9}  {v.content_type}"
        print(f"v{v.version:<5} {_when(v.timestamp)}  {what}")
    return 0


def cmd_rm(a: argparse.Namespace) -> int:
    v = _store(a).delete(a.key, if_version=a.if_version)
    print(f"deleted {v.key} (tombstone version {v.version})")
    return 0


def add_store_commands(sub: Any, default_url: str) -> None:
    """Register the store's subcommands on the CLI's subparsers."""
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--url", default=default_url, help="node base URL")
    store.add_argument("--token", default=os.environ.get("SLIPSTREAM_ADMIN_TOKEN"),
                       help="admin token, for writes (default: $SLIPSTREAM_ADMIN_TOKEN)")
    sp = sub.add_parser("put", parents=[store], help="store a file (or stdin) as the next version of a key")
    sp.add_argument("key", help="store key, e.g. /models/minilm")
    sp.add_argument("file", help="file to store, or - for stdin")
    sp.add_argument("--if-version", type=int, metavar="N",
                    help="only if the key's latest version is N (0: only if never written)")
    sp.add_argument("--content-type", help="content type (default: named tensors if the file is, else octets)")
    sp.add_argument("--npz", action="store_true", help="store the arrays of an .npz file as named tensors")
    sp.set_defaults(fn=cmd_put)
    sg = sub.add_parser("get", parents=[store], help="read a key's value (tensors: a summary unless -o)")
    sg.add_argument("key")
    when = sg.add_mutually_exclusive_group()
    when.add_argument("--version", type=int, metavar="N", help="this version rather than the latest")
    when.add_argument("--as-of", type=_unix_time, metavar="T",
                      help="the version current at T (unix seconds, or an ISO date-time)")
    sg.add_argument("-o", "--output", metavar="FILE", help="write the value to FILE (default: stdout)")
    sg.set_defaults(fn=cmd_get)
    sl = sub.add_parser("ls", parents=[store], help="list the live keys under a prefix")
    sl.add_argument("prefix", nargs="?", default="/")
    sl.add_argument("--limit", type=int, default=1000, help="at most this many keys (up to 100000)")
    sl.set_defaults(fn=cmd_ls)
    sv = sub.add_parser("versions", parents=[store], help="the versions of a key that retention kept")
    sv.add_argument("key")
    sv.set_defaults(fn=cmd_versions)
    sr = sub.add_parser("rm", parents=[store], help="delete a key (writes a tombstone version)")
    sr.add_argument("key")
    sr.add_argument("--if-version", type=int, metavar="N", help="only if the key's latest version is N")
    sr.set_defaults(fn=cmd_rm)
