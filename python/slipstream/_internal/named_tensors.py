"""Store values: their content types, and the named-tensor format
(``application/x-slipstream-tensors``) the node validates on put.

A named-tensor value is a preamble (magic ``SSTN``, format version, header
length), a JSON header naming each array's dtype, shape, offset and size,
then the arrays' bytes, each at a multiple of 64 bytes, so that decoded
arrays are aligned views over the value without a copy. The node's codec
(slipstream-store) reads and checks the same layout; keep the two in step.

Shared by the store client, the CLI's ``put`` and the declarations that
seed keys with files (``seeds.py``), which need the content types and the
guess of a file's type without the client.
"""

from __future__ import annotations

import json
import math
import mimetypes
import mmap
import struct
from collections.abc import Mapping
from typing import Any, TypeAlias, TypeGuard

import numpy as np

from slipstream._internal.dtypes import NUMERIC_DTYPES
from slipstream._internal.errors import TensorFormatError

OCTETS = "application/octet-stream"
TENSORS = "application/x-slipstream-tensors"
TEXT = "text/plain; charset=utf-8"

Buffer: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | np.ndarray"

_MAGIC = b"SSTN"
_FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<4sIQ")  # magic, format version, header length
#: Every array's offset is a multiple of this.
ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encode_tensors(tensors: Mapping[str, Any]) -> list[bytes | memoryview]:
    """Named arrays as an ``application/x-slipstream-tensors`` value, in
    pieces: the preamble and JSON header, then each array's own buffer (no
    copy when it is already C-contiguous and little-endian), with zero
    padding so every offset is a multiple of 64. ``b"".join(...)`` gives the
    value as one ``bytes`` (e.g. to write a seed file)."""
    if not isinstance(tensors, Mapping):
        raise TensorFormatError(f"named tensors are a dict of name -> array, got {type(tensors).__name__}")
    header: dict[str, dict[str, Any]] = {}
    arrays: list[np.ndarray] = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise TensorFormatError(f"tensor names are non-empty strings, got {name!r}")
        a = np.asarray(value)
        if a.dtype.name not in NUMERIC_DTYPES:
            raise TensorFormatError(
                f"tensor {name!r} has dtype {a.dtype}; named tensors hold {', '.join(NUMERIC_DTYPES)}"
            )
        a = np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C")
        header[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes}
        arrays.append(a)
        offset += _align(a.nbytes)
    text = json.dumps(header, separators=(",", ":")).encode()
    head = _PREAMBLE.pack(_MAGIC, _FORMAT_VERSION, len(text)) + text
    parts: list[bytes | memoryview] = [head + bytes(_align(len(head)) - len(head))]
    for i, a in enumerate(arrays):
        if a.nbytes:
            parts.append(a.reshape(-1).view(np.uint8).data)
        pad = _align(a.nbytes) - a.nbytes
        if pad and i < len(arrays) - 1:
            parts.append(bytes(pad))
    return parts


def _byte_view(buf: Buffer) -> memoryview:
    mv = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise TensorFormatError("named tensors must be read from a contiguous buffer")
        mv = mv.cast("B")
    return mv


def decode_tensors(buf: Buffer) -> dict[str, np.ndarray]:
    """The arrays of an ``application/x-slipstream-tensors`` value, as
    read-only views over ``buf`` (no copy; each array keeps ``buf`` alive).
    Every field is checked; a malformed value raises ``TensorFormatError``
    saying what is wrong, never an out-of-bounds read."""
    mv = _byte_view(buf)
    n = len(mv)
    if n < _PREAMBLE.size:
        raise TensorFormatError(f"named tensors: {n} bytes is shorter than the {_PREAMBLE.size}-byte preamble")
    magic, version, hlen = _PREAMBLE.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise TensorFormatError(f"named tensors: the value starts with {bytes(magic)!r}, not {_MAGIC!r}")
    if version != _FORMAT_VERSION:
        raise TensorFormatError(f"named tensors: format version {version} (this client reads {_FORMAT_VERSION})")
    if hlen > n - _PREAMBLE.size:
        raise TensorFormatError(f"named tensors: a {hlen}-byte header does not fit in a {n}-byte value")
    try:
        header = json.loads(bytes(mv[_PREAMBLE.size:_PREAMBLE.size + hlen]))
    except (UnicodeDecodeError, ValueError) as e:
        raise TensorFormatError(f"named tensors: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise TensorFormatError("named tensors: the header is not a JSON object")
    start = _align(_PREAMBLE.size + hlen)
    data_len = max(0, n - start)
    out: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        dtype, shape, offset, nbytes = _check_entry(name, entry)
        if offset + nbytes > data_len:
            raise TensorFormatError(
                f"named tensors: {name!r} (data bytes {offset}..{offset + nbytes}) lies outside the "
                f"value's {data_len} bytes of data"
            )
        count = math.prod(shape)
        if count == 0:
            a = np.zeros(shape, dtype=dtype)
        else:
            a = np.frombuffer(mv, dtype=dtype, count=count, offset=start + offset).reshape(shape)
        a.flags.writeable = False
        out[name] = a
    return out


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(name: str, entry: Any) -> tuple[np.dtype[Any], list[int], int, int]:
    """One header entry, checked: (dtype, shape, offset, nbytes)."""
    what = f"named tensors: {name!r}"
    if not isinstance(entry, dict):
        raise TensorFormatError(f"{what}: the entry is not an object")
    dtype = entry.get("dtype")
    if dtype not in NUMERIC_DTYPES:
        raise TensorFormatError(f"{what}: dtype {dtype!r} is not one of {', '.join(NUMERIC_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise TensorFormatError(f"{what}: shape {shape!r} is not a list of non-negative integers")
    offset, nbytes = entry.get("offset"), entry.get("nbytes")
    if not _is_int(offset) or offset < 0 or offset % ALIGN:
        raise TensorFormatError(f"{what}: offset {offset!r} is not a non-negative multiple of {ALIGN}")
    dt = np.dtype(dtype).newbyteorder("<")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * dt.itemsize:
        raise TensorFormatError(
            f"{what}: nbytes {nbytes!r} is not prod(shape) x itemsize = {math.prod(shape) * dt.itemsize}"
        )
    return dt, shape, offset, nbytes


def guess_content_type(head: bytes, name: str | None = None) -> str:
    """The content type of a file: named tensors by their magic, else what
    its name says (``notes.txt``: text/plain), else octets."""
    if head[:4] == _MAGIC:
        return TENSORS
    if name:
        guessed, encoding = mimetypes.guess_type(name)
        if guessed and encoding is None:
            return f"{guessed}; charset=utf-8" if guessed.startswith("text/") else guessed
    return OCTETS
