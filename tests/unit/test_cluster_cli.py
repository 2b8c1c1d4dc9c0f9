"""The cluster CLI's pure parts: record sealing (shared with the node) and etcd URLs."""

from __future__ import annotations

import json

import pytest
from slipstream._internal.cluster_cli import Etcd, EtcdError, seal, unseal

# The node opens exactly this (crates/slipstream-runtime/src/cluster/mod.rs, SEALED_BY_PYTHON).
SEALED = b'{"body": "{\\"id\\":\\"x\\"}", "sig": "ec0d33655ff61f052d4ace384e1cf0ea472ac37819e435f89d6f1b49489d27ed"}'


def test_seal_matches_the_node_and_unseal_refuses_other_tokens_and_tampering() -> None:
    assert seal("t", "deploy", {"id": "x"}) == SEALED
    assert unseal("t", "deploy", SEALED) == {"id": "x"}
    with pytest.raises(EtcdError, match="not signed"):
        unseal("u", "deploy", SEALED)
    with pytest.raises(EtcdError):
        unseal("t", "member", SEALED)
    env = json.loads(SEALED)
    env["body"] = env["body"].replace("x", "y")
    with pytest.raises(EtcdError):
        unseal("t", "deploy", json.dumps(env).encode())


def test_etcd_urls() -> None:
    assert Etcd("etcd://a:1,b:2").endpoints == ["http://a:1", "http://b:2"]
    assert Etcd("http://h:2379").endpoints == ["http://h:2379"]
    for bad in ("h:2379", "ftp://h:1", "etcd://"):
        with pytest.raises(EtcdError, match="expected etcd://"):
            Etcd(bad)
    for secure in ("https://h:1", "etcds://h:1"):
        with pytest.raises(EtcdError, match="TLS to etcd needs a CA and a client certificate: --tls DIR"):
            Etcd(secure)
