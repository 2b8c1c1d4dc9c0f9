"""`slipstream reseal` against a real etcd: records signed with the old
token are re-signed with the new one, bodies and leases kept; records of
another token, current ones and keys that are not records are left alone;
the list of record kinds stays in step with the code that signs them."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from slipstream._internal.cluster_cli import Etcd as EtcdClient
from slipstream._internal.cluster_cli import EtcdError, seal, signed_by, unseal
from slipstream._internal.reseal import KINDS, reseal
from slipstream.testing import CLI, Etcd

ROOT = Path(__file__).resolve().parents[2]


def test_the_kinds_are_every_kind_the_code_signs() -> None:
    found: set[str] = set()
    for src in (ROOT / "crates/slipstream-cluster/src").rglob("*.rs"):
        text = src.read_text()
        found |= set(re.findall(r'seal\(&[\w.]+, "([\w-]+)"', text))
        found |= set(re.findall(r'const \w*KIND: &str = "([\w-]+)"', text))
    for src in (ROOT / "python/slipstream/_internal").glob("*.py"):
        found |= set(re.findall(r'\bseal\(token, "([\w-]+)"', src.read_text()))
    assert found and found == set(KINDS), found ^ set(KINDS)


@pytest.fixture(scope="module")
def etcd() -> Iterator[Etcd]:
    e = Etcd(1)
    yield e
    e.stop()


def _lease(client: EtcdClient, key: str) -> int:
    kvs = client._call("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()})["kvs"]
    return int(kvs[0].get("lease", 0))


def test_old_records_are_re_signed_with_bodies_and_leases_kept(etcd: Etcd) -> None:
    c = EtcdClient(etcd.url)
    root = "/slipstream/rot/"
    lease = int(c._call("/v3/lease/grant", {"TTL": 60})["ID"])
    c.put(root + "deploy", seal("old", "deploy", {"id": "d1"}))
    c.put(root + "store/objects/a", seal("old", "object", {"digest": "ab", "holders": ["n1"]}))
    c._call("/v3/kv/put", {"key": base64.b64encode((root + "members/n1").encode()).decode(),
                           "value": base64.b64encode(seal("old", "member", {"node": "n1"})).decode(),
                           "lease": str(lease)})
    c.put(root + "placement", seal("new", "placement", {"epoch": 3}))
    c.put(root + "cordon/n9", seal("stranger", "cordon", {"node": "n9"}))
    c.put(root + "bundles/x/0", b"\x00binary chunk")
    body_before = json.loads(c.get(root + "store/objects/a") or b"")["body"]

    counts = reseal(c, root, ["new", "old"])
    assert counts == {"resealed": 3, "current": 1, "not_records": 1, "unverified": 1, "raced": 0}, counts
    for key, kind in (("deploy", "deploy"), ("store/objects/a", "object"), ("members/n1", "member")):
        raw = c.get(root + key) or b""
        assert signed_by("new", kind, json.loads(raw)) == "new", key
        with pytest.raises(EtcdError):
            unseal("old", kind, raw)
    assert json.loads(c.get(root + "store/objects/a") or b"")["body"] == body_before, "the body is kept as it was"
    assert _lease(c, root + "members/n1") == lease, "a member's record keeps its lease"
    assert signed_by("stranger", "cordon", json.loads(c.get(root + "cordon/n9") or b"")), "left as it was"
    # A second pass finds nothing left to do.
    again = reseal(c, root, ["new", "old"])
    assert again["resealed"] == 0 and again["current"] == 4, again


def test_the_command_refuses_a_single_token_and_reports_strangers(etcd: Etcd) -> None:
    import subprocess

    c = EtcdClient(etcd.url)
    c.put("/slipstream/cmd/deploy", seal("zzz", "deploy", {"id": "x"}))
    one = subprocess.run([*CLI, "reseal", "--cluster", etcd.url, "--cluster-name", "cmd", "--token", "new"],
                         capture_output=True, text=True, timeout=60)
    assert one.returncode == 1 and "--accept-token" in one.stderr, one.stderr
    out = subprocess.run([*CLI, "reseal", "--cluster", etcd.url, "--cluster-name", "cmd", "--token", "new",
                          "--accept-token", "old"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "1 signed by no token given" in out.stdout, out.stdout + out.stderr
