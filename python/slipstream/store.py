"""The node's versioned object store (docs/design/store.md).

Module-level functions talk to the node at ``$SLIPSTREAM_NODE_URL`` (set in
workers; default http://127.0.0.1:8000) with the token in
``$SLIPSTREAM_STORE_TOKEN`` or ``$SLIPSTREAM_ADMIN_TOKEN``; make a
``Store(url, token)`` for another node::

    import numpy as np
    import slipstream as ss

    v = ss.store.put("/models/minilm", {"weights": np.zeros((384, 384), np.float32)})
    obj = ss.store.get("/models/minilm")          # latest; version=, as_of= for older
    w = obj.tensors()["weights"]                   # read-only, no copy when mapped
    ss.store.put("/docs/a/text", "hello", if_version=0)   # only if never written
    seq, changes = ss.store.watch("/docs/", since=ss.store.cursor("/docs/"))

Inside a worker, ``group(key)`` returns the objects of the key's affinity
group from a per-process cache (see ``ss.Pool(affinity=...)``).
"""

from slipstream._internal.errors import (
    StoreBadRequest,
    StoreConflict,
    StoreError,
    StoreGone,
    StoreNotFound,
    StoreUnauthorized,
    StoreUnavailable,
    TensorFormatError,
)
from slipstream._internal.groups import cache_stats, group
from slipstream._internal.named_tensors import OCTETS, TENSORS, TEXT, decode_tensors, encode_tensors
from slipstream._internal.store import (
    Change,
    KeyList,
    Object,
    Store,
    Version,
    cursor,
    default_store,
    delete,
    get,
    keys,
    ls,
    meta,
    put,
    stats,
    trigger_put,
    versions,
    watch,
)

__all__ = [
    "OCTETS",
    "TENSORS",
    "TEXT",
    "Change",
    "KeyList",
    "Object",
    "Store",
    "StoreBadRequest",
    "StoreConflict",
    "StoreError",
    "StoreGone",
    "StoreNotFound",
    "StoreUnauthorized",
    "StoreUnavailable",
    "TensorFormatError",
    "Version",
    "cache_stats",
    "cursor",
    "decode_tensors",
    "default_store",
    "delete",
    "encode_tensors",
    "get",
    "group",
    "keys",
    "ls",
    "meta",
    "put",
    "stats",
    "trigger_put",
    "versions",
    "watch",
]
