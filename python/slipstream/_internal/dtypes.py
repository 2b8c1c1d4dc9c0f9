"""The element types a node serves: one table for the declarations
(``ss.Tensor``), the store's named tensors, the workers and the client.

Names are numpy's, plus ``"string"`` and ``"bytes"`` for variable-size
elements (numpy object arrays of ``str`` / ``bytes`` in workers). The node's
own table is slipstream-types' ``DType``; keep the two in step. KServe v2
names the fixed-size ones in upper case and calls both variable-size ones
``BYTES``.
"""

from __future__ import annotations

DTYPES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "string", "bytes",
)
#: Variable-size element types.
VAR_DTYPES = ("string", "bytes")
#: Fixed-size element types: what a named-tensor store value may hold.
NUMERIC_DTYPES = tuple(d for d in DTYPES if d not in VAR_DTYPES)

#: numpy name -> KServe v2 datatype, for the fixed-size types.
V2_DATATYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}
#: KServe v2 datatype -> numpy name.
FROM_V2: dict[str, str] = {v: k for k, v in V2_DATATYPES.items()}
