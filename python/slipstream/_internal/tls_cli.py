"""``slipstream tls``: a cluster's own certificate authority.

``slipstream tls ca DIR`` makes the CA (``ca.crt``, and ``ca.key``, which
only the one who issues certificates keeps); ``slipstream tls cert --ca
DIR --out OUT NAME [NAME...]`` issues a certificate for a node (its first
name is the node's ``--name``) or an etcd member (its host names and IP
addresses), into a directory that ``slipstream node --tls OUT`` or etcd
reads as it is: ``tls.crt``, ``tls.key`` and a copy of ``ca.crt``, the
names a Kubernetes TLS Secret uses. The work is the compiled core's
(``crates/slipstream-tls``), so the node and this command agree on what a
valid certificate is.
"""

from __future__ import annotations

import argparse
from typing import Any

from slipstream._internal.errors import from_core
from slipstream._internal.store_cli import fail


def _days(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of days, got {text!r}") from None
    if not 1 <= n <= 36500:
        raise argparse.ArgumentTypeError(f"must be between 1 and 36500 days, got {n}")
    return n


def cmd_ca(a: argparse.Namespace) -> int:
    from slipstream import _core

    try:
        files = _core.tls_make_ca(a.dir, a.days)
    except _core.CoreError as e:
        return fail(str(from_core(e)))
    print(f"made a cluster CA valid for {a.days} days: {', '.join(map(str, files))}")
    print(f"keep {files[-1]} secret; issue node certificates with: "
          f"slipstream tls cert --ca {a.dir} --out DIR NODE-NAME")
    return 0


def cmd_cert(a: argparse.Namespace) -> int:
    from slipstream import _core

    try:
        files, not_after = _core.tls_issue(a.ca, a.out, a.names, a.days)
    except _core.CoreError as e:
        return fail(str(from_core(e)))
    print(f"issued a certificate for {', '.join(a.names)} (valid until {not_after}): {', '.join(map(str, files))}")
    return 0


def add_tls_commands(sub: Any) -> None:
    """Register ``tls ca`` and ``tls cert`` on the command line's subparsers."""
    t = sub.add_parser("tls", help="make a cluster CA and issue certificates for nodes and etcd (mutual TLS)")
    tsub = t.add_subparsers(dest="tls_cmd", required=True)
    ca = tsub.add_parser("ca", help="make a new cluster CA in DIR (ca.crt, ca.key); nothing is overwritten")
    ca.add_argument("dir", metavar="DIR")
    ca.add_argument("--days", type=_days, default=3650, help="how long the CA is valid (default: 3650)")
    ca.set_defaults(fn=cmd_ca)
    c = tsub.add_parser("cert", help="issue a certificate for a node or an etcd member with the CA in --ca")
    c.add_argument("names", nargs="+", metavar="NAME",
                   help="DNS names or IP addresses it is valid for; for a node, its --name first")
    c.add_argument("--ca", required=True, metavar="DIR", help="the CA's directory (ca.crt and ca.key)")
    c.add_argument("--out", required=True, metavar="DIR",
                   help="where to write tls.crt, tls.key and a copy of ca.crt (`slipstream node --tls DIR`)")
    c.add_argument("--days", type=_days, default=365, help="how long it is valid (default: 365)")
    c.set_defaults(fn=cmd_cert)
