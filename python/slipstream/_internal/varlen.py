"""String and bytes tensors in their shared layout: per element, a
little-endian u32 length, then its bytes (text as UTF-8). Workers put them
into shared memory this way, and KServe v2's binary extension sends them
this way, so the worker and the client share one codec."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

_LEN = struct.Struct("<I")


def var_kind(a: np.ndarray, strict: bool = False) -> str | None:
    """'string' or 'bytes' for arrays of text or byte strings, else None.
    ``strict``: an object array holding anything else is a TypeError (a
    component's output), instead of None (a client's input, refused later)."""
    if a.dtype.kind == "U":
        return "string"
    if a.dtype.kind == "S":
        return "bytes"
    if a.dtype.kind == "O":
        flat = a.ravel()
        if all(isinstance(x, str) for x in flat):
            return "string"
        if all(isinstance(x, (bytes, bytearray, memoryview)) for x in flat):
            return "bytes"
        if strict:
            raise TypeError("an object array output must hold only str or only bytes")
    return None


def encode_var(a: np.ndarray) -> bytes:
    """A string or bytes array in the layout."""
    parts: list[bytes] = []
    for x in a.ravel():
        b = x.encode() if isinstance(x, str) else bytes(x)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_var(buf: memoryview | bytes, shape: Sequence[int], text: bool) -> np.ndarray:
    """The inverse of ``encode_var``: an object array of ``str`` or ``bytes``
    of ``shape``. Data that ends early or runs past the elements is a ValueError."""
    n = math.prod(shape)
    out = np.empty(n, dtype=object)
    at, end = 0, len(buf)
    for i in range(n):
        if at + 4 > end:
            raise ValueError(f"the data ends after {i} of {n} elements")
        (k,) = _LEN.unpack_from(buf, at)
        if at + 4 + k > end:
            raise ValueError(f"element {i} runs past the data")
        piece = bytes(buf[at + 4:at + 4 + k])
        out[i] = piece.decode() if text else piece
        at += 4 + k
    if at != end:
        raise ValueError(f"{end - at} bytes follow the last of {n} elements")
    return out.reshape(tuple(shape))
