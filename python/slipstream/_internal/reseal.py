"""``slipstream reseal``: re-sign a cluster's records in etcd with the
current token, the third step of rotating it without downtime.

Every record a cluster keeps in etcd (deployment, members, placement,
cordons, the store's object records and trigger progress) is a JSON
envelope ``{"body", "sig"}`` whose signature covers the record's kind and
body under the cluster token. Rotating the token (docs/design/cluster.md,
"Rotating the cluster token") is: (1) roll the nodes with ``--accept-token
NEW``; (2) roll them with ``--token NEW --accept-token OLD``; (3) this
command, with the same two, re-signs whatever is still signed with OLD;
(4) roll them with ``--token NEW`` alone. Without step 3, records written
before step 2 (a store object nobody has rewritten, say) would be refused
after step 4.

Each record is replaced only if nobody wrote it meanwhile (a compare on its
revision; a record rewritten by a node is signed with the new token
already), and keeps its lease (a member's record still expires with its
node). The body is kept byte for byte.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from slipstream._internal.cluster_cli import (
    Etcd,
    EtcdError,
    _etcd,
    _root,
    add_cluster_args,
    seal_body,
    signed_by,
    tokens,
)
from slipstream._internal.store_cli import fail

#: The kinds of record a cluster signs (crates/slipstream-cluster: `seal`
#: calls; cluster_cli: deploy and cordon). tests/unit/test_reseal.py keeps
#: this list in step with the sources.
KINDS = ("deploy", "plan", "member", "placement", "cordon", "object", "triggers-settled")


def reseal(etcd: Etcd, root: str, keys: list[str]) -> dict[str, int]:
    """Re-sign every record under `root` that one of `keys[1:]` signed,
    with `keys[0]`; counts of what was found."""
    counts = {"resealed": 0, "current": 0, "not_records": 0, "unverified": 0, "raced": 0}
    for key, value, revision in etcd.records(root):
        try:
            env: Any = json.loads(value)
        except ValueError:
            env = None
        if not isinstance(env, dict) or set(env) != {"body", "sig"}:
            counts["not_records"] += 1  # bundle chunks and the like: not signed
            continue
        found = next(((kind, t) for kind in KINDS if (t := signed_by(keys, kind, env)) is not None), None)
        if found is None:
            counts["unverified"] += 1
        elif found[1] == keys[0]:
            counts["current"] += 1
        elif etcd.replace_if_unchanged(key, seal_body(keys[0], found[0], env["body"]), revision):
            counts["resealed"] += 1
        else:
            counts["raced"] += 1  # rewritten meanwhile, by a node that signs with the new token
    return counts


def cmd_reseal(a: argparse.Namespace) -> int:
    try:
        keys = tokens(a)
        if len(keys) < 2:
            return fail("nothing to re-sign with a single token: give the old one with --accept-token")
        counts = reseal(_etcd(a), _root(a), keys)
    except EtcdError as e:
        return fail(str(e))
    print(f"cluster '{a.cluster_name}': {counts['resealed']} record(s) re-signed with the current token, "
          f"{counts['current']} already were, {counts['raced']} rewritten meanwhile (by a node on the new token), "
          f"{counts['unverified']} signed by no token given (left as they are), "
          f"{counts['not_records']} other key(s)")
    return 1 if counts["unverified"] else 0


def add_reseal_command(sub: Any) -> None:
    r = sub.add_parser("reseal", help="re-sign a cluster's records in etcd with the current token "
                                      "(the third step of rotating it)")
    add_cluster_args(r)
    r.set_defaults(fn=cmd_reseal)
