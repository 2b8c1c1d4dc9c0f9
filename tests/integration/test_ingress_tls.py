"""TLS on the node's HTTP and gRPC port (`--ingress-tls DIR`): a client that
trusts the certificate's CA infers over HTTPS and over gRPC with TLS; one
that does not is refused by its own TLS check; plain HTTP is answered only
to connections from this machine (the node's workers, local tools), and
refused with a 400 from anywhere else; a directory without a usable
certificate stops the node at start, saying why."""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import slipstream as ss
from slipstream._internal.testing import ClusterCA

from tests.conftest import APPS, Node

APP = str(APPS / "rotate.py")  # a two-stage chain: y = 2x + 1


def outside_ip() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
            ip = str(s.getsockname()[0])
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.fixture(scope="module")
def ca() -> Iterator[ClusterCA]:
    c = ClusterCA()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def node(ca: ClusterCA) -> Iterator[tuple[Node, Path]]:
    names = ["localhost", "127.0.0.1", *([ip] if (ip := outside_ip()) else [])]
    d = ca.issue(*names)
    n = Node(APP, "--ingress-tls", str(d), "--host", "0.0.0.0", "--port", "0")
    try:
        n.wait_ready()
        yield n, d
    finally:
        n.stop()


def test_a_client_that_trusts_the_ca_infers_over_https_and_grpc(node: tuple[Node, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    n, d = node
    assert n.scheme == "https" and "listening on https://" in n.log()
    port = n.url.rsplit(":", 1)[1]
    monkeypatch.setenv("SSL_CERT_FILE", str(d / "ca.crt"))  # what the default TLS context trusts
    with ss.Client(f"https://localhost:{port}") as c:
        out = c.infer("chain", {"x": np.array([[1.0, 2.0]], dtype=np.float32)})
        assert out["y"].tolist() == [[3.0, 5.0]]
    import tritonclient.grpc as grpcclient

    g = grpcclient.InferenceServerClient(f"localhost:{port}", ssl=True, root_certificates=str(d / "ca.crt"))
    inp = grpcclient.InferInput("x", [1, 2], "FP32")
    inp.set_data_from_numpy(np.array([[3.0, 4.0]], dtype=np.float32))
    res = g.infer("chain", [inp])
    assert res.as_numpy("y").tolist() == [[7.0, 9.0]]


def test_a_client_that_does_not_trust_it_is_stopped_by_its_own_check(node: tuple[Node, Path]) -> None:
    n, _ = node
    port = n.url.rsplit(":", 1)[1]
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://localhost:{port}/healthz", timeout=5)


def test_plain_http_is_answered_only_from_this_machine(node: tuple[Node, Path]) -> None:
    n, _ = node
    assert n.request("GET", "/healthz")[0] == 200  # loopback, plain
    ip = outside_ip()
    if ip is None:
        pytest.skip("this machine has no address but loopback")
    port = int(n.url.rsplit(":", 1)[1])
    with socket.create_connection((ip, port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"this port speaks TLS" in answer, answer


def test_a_directory_without_a_certificate_stops_the_node_saying_why(tmp_path: Path) -> None:
    out = subprocess.run([str(Path(__file__).resolve().parents[2] / ".venv/bin/slipstream"), "serve", APP,
                          "--port", "0", "--ingress-tls", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "ingress_tls" in out.stderr and "tls.crt" in out.stderr, out.stderr
