"""`ss.Client` / `ss.AsyncClient` against a real node, and Pipeline objects
served with `ss.launch` / `ss.serve`.

What the client sends and how many TCP connections it opens are observed
on the wire, through a relay between the client and the node (`Relay`):
nothing in the client is replaced or patched.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import slipstream as ss
from slipstream._internal.client import encode_request

from tests.conftest import ROOT, wait_for

F32 = np.float32


class Relay:
    """A TCP relay in front of a node: counts the connections clients open,
    keeps the bytes they send and receive, and can close every connection
    from the node's side (as a node does with idle keep-alive connections)."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self.sent = bytearray()
        self.received = bytearray()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._drop_next = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                self.accepted += 1
                self._open.append(client)
            threading.Thread(target=self._pump, args=(client, upstream, self.sent), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.received), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, log: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    if log is self.sent and self._drop_next:
                        self._drop_next = False
                        return  # closed without forwarding it
                    log += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop_next_request(self) -> None:
        """Close the connection that carries the next request instead of
        forwarding it: a connection the node closed just as it was reused."""
        with self._lock:
            self._drop_next = True

    def close_connections(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        self.close_connections()


@pytest.fixture(scope="module")
def server() -> Iterator[ss.Server]:
    # Pipeline objects from importable app modules (their decorated classes
    # travel by value too: the module attribute is the Component).
    from tests.apps import chain, text

    pipelines = [chain.chain, chain.solo, chain.tight, chain.diamond, text.text, text.blob]
    with ss.launch(pipelines, request_timeout=2, max_body_mb=1) as node:
        yield node


@pytest.fixture()
def relay(server: ss.Server) -> Iterator[Relay]:
    r = Relay(server.url)
    yield r
    r.close()


def stage(client: ss.Client, pipeline: str, name: str) -> dict[str, Any]:
    p = next(p for p in client.status()["pipelines"] if p["name"] == pipeline)
    return next(s for s in p["stages"] if s["name"] == name)


def idle(client: ss.Client, pipeline: str, name: str) -> None:
    wait_for(lambda: all(r["outstanding"] == 0 for r in stage(client, pipeline, name)["replicas"]), timeout=15)


# --- round trips -----------------------------------------------------------------


def test_sync_round_trips_numbers_strings_and_bytes(server: ss.Server) -> None:
    with server.client() as c:
        assert c.ready() and c.ready("chain")
        x = np.array([[1, 2], [3, 4]], dtype=F32)
        out = c.infer("chain", {"x": x})
        assert set(out) == {"y", "pid"} and out.fallback is None
        np.testing.assert_array_equal(out["y"], x * 2 + 1)
        assert out["y"].dtype == F32 and out["pid"].dtype == np.int64 and out["pid"].shape == (2, 1)
        # Lists take the declared dtype (from the pipeline's description).
        out = c.infer("chain", {"x": [[1, 2]]}, outputs=["y"])
        assert list(out) == ["y"] and out["y"].dtype == F32 and out["y"].tolist() == [[3.0, 5.0]]

        out = c.infer("text", {"text": ["héllo wörld", "", 'a"quote']})
        assert out["loud"].dtype == object and out["loud"].tolist() == ["HÉLLO WÖRLD!", "!", 'A"QUOTE!']
        assert out["n"].dtype == np.int64 and out["n"].tolist() == [[11], [0], [7]]
        assert out["pair"].shape == (3, 2) and out["pair"][0].tolist() == ["HÉLLO WÖRLD!", "héllo wörld!"]
        # A numpy str array and an object array of str are the same input.
        out2 = c.infer("text", {"text": np.array(["abc", "de"])})
        assert out2["loud"].tolist() == ["ABC!", "DE!"]

        raw = bytes(range(256))
        out = c.infer("blob", {"blob": np.array([raw, b""], dtype=object)})
        assert out["rev"].tolist() == [raw[::-1], b""]

        assert {p["name"] for p in c.pipelines()} == {"chain", "solo", "tight", "diamond", "text", "blob"}
        meta = c.metadata("chain")
        assert meta["inputs"] == {"x": {"dtype": "float32", "shape": [-1, 2]}}
        assert c.status()["ready"] is True


def test_requests_and_answers_are_binary(server: ss.Server, relay: Relay) -> None:
    x = np.array([[1.5, -2.25], [1e-3, 7.0]], dtype=F32)
    head, parts = encode_request({"x": x})
    assert b'"binary_data_size":16' in head and b'"binary_data_output":true' in head and b'"data"' not in head
    assert bytes(parts[0]) == x.tobytes()
    with ss.Client(relay.url) as c:
        out = c.infer("chain", {"x": x})
    sent, received = bytes(relay.sent), bytes(relay.received)
    assert sent.startswith(b"POST /v2/models/chain/infer HTTP/1.1\r\n")
    assert re.search(rb"(?i)inference-header-content-length: %d\r\n" % len(head), sent)
    assert sent.endswith(head + x.tobytes()), "the tensor's own bytes follow the JSON header"
    assert re.search(rb"(?i)content-type: application/octet-stream", received)
    assert (x * 2 + 1).tobytes() in received and out["pid"].tobytes() in received
    # The outputs are views over the answer's bytes, not copies; aligned and writable.
    y = out["y"]
    assert not y.flags.owndata and y.flags.aligned and y.flags.writeable
    np.testing.assert_array_equal(y, x * 2 + 1)


def test_async_round_trips_and_many_concurrent_calls(server: ss.Server, relay: Relay) -> None:
    async def main() -> None:
        async with ss.AsyncClient(relay.url, max_connections=4) as c:
            assert await c.ready("chain")
            out = await c.infer("chain", {"x": np.array([[1, 2]], dtype=F32)})
            assert out["y"].tolist() == [[3.0, 5.0]] and not out["y"].flags.writeable
            out = await c.infer("text", {"text": ["ab", "c"]})
            assert out["loud"].tolist() == ["AB!", "C!"] and out["n"].tolist() == [[2], [1]]
            assert (await c.metadata("blob"))["inputs"]["blob"]["dtype"] == "bytes"

            # x + 0.5: chain's Double misbehaves on 13, 66 and 99 (tests/apps/chain.py).
            results = await asyncio.gather(
                *(c.infer("chain", {"x": np.array([[i + 0.5, 1]], dtype=F32)}) for i in range(200)))
            assert [r["y"][0, 0] for r in results] == [2.0 * i + 2 for i in range(200)]
            assert 1 <= c.connections_opened <= 4

    asyncio.run(main())
    assert 1 <= relay.accepted <= 4, "200 concurrent calls share at most max_connections connections"


def test_connections_are_reused_across_calls_and_threads(server: ss.Server, relay: Relay) -> None:
    with ss.Client(relay.url) as c:
        for i in range(50):  # + 0.5: chain's Double misbehaves on 13, 66 and 99
            assert c.infer("chain", {"x": np.array([[i + 0.5, 0]], dtype=F32)})["y"][0, 0] == 2 * i + 2
        assert (c.connections_opened, relay.accepted) == (1, 1)

        with ThreadPoolExecutor(4) as pool:
            ys = list(pool.map(lambda i: c.infer("chain", {"x": np.array([[i + 0.5, 0]], dtype=F32)})["y"][0, 0],
                               range(200)))
        assert ys == [2.0 * i + 2 for i in range(200)]
        assert c.connections_opened <= 5 and relay.accepted == c.connections_opened

        # The node side closes every kept-alive connection: the next call
        # opens a new one, without an error.
        relay.close_connections()
        before = c.connections_opened
        time.sleep(0.1)
        assert c.infer("chain", {"x": [[1, 1]]})["y"].tolist() == [[3.0, 3.0]]
        assert c.connections_opened == before + 1

        # Closed when the request arrives (after the client's idle check):
        # sent once more, on a new connection.
        relay.drop_next_request()
        assert c.infer("chain", {"x": [[2, 1]]})["y"].tolist() == [[5.0, 3.0]]
        assert c.connections_opened == before + 2

    async def in_async() -> None:
        async with ss.AsyncClient(relay.url) as ac:
            assert (await ac.infer("chain", {"x": [[1, 1]]}))["y"].tolist() == [[3.0, 3.0]]
            relay.drop_next_request()
            assert (await ac.infer("chain", {"x": [[2, 1]]}))["y"].tolist() == [[5.0, 3.0]]
            assert ac.connections_opened == 2

    asyncio.run(in_async())


# --- deadlines and errors -------------------------------------------------------------


def test_a_deadline_shorter_than_the_compute_is_deadline_exceeded(server: ss.Server) -> None:
    with server.client() as c:
        t0 = time.monotonic()
        with pytest.raises(ss.DeadlineExceeded) as e:
            c.infer("solo", {"x": [[1, 600]]}, deadline_ms=150)  # SlowSolo sleeps 600 ms
        took = time.monotonic() - t0
        assert (e.value.kind, e.value.status) == ("deadline_exceeded", 504)
        assert isinstance(e.value, TimeoutError) and not isinstance(e.value, ss.ClientTimeout)
        assert took < 0.55, f"answered at the deadline, not after the compute ({took:.3f} s)"
        idle(c, "solo", "SlowSolo")

        async def in_async() -> None:
            async with ss.AsyncClient(server.url) as ac:
                with pytest.raises(ss.DeadlineExceeded):
                    await ac.infer("solo", {"x": [[1, 600]]}, timeout=0.15)

        asyncio.run(in_async())
        idle(c, "solo", "SlowSolo")
        # With room to spare the same call succeeds.
        assert c.infer("solo", {"x": [[1, 20]]}, deadline_ms=1500)["y"].tolist() == [[3.0, 60.0]]


def test_error_kinds_are_exception_classes(server: ss.Server) -> None:
    c = server.client()
    with pytest.raises(ss.BadInput) as e:
        c.infer("chain", {"x": np.zeros((1, 2), dtype=np.float64)})  # arrays keep their dtype
    assert e.value.status == 400 and isinstance(e.value, ValueError) and "float32" in str(e.value)
    with pytest.raises(ss.BadInput, match="shape"):
        c.infer("chain", {"x": np.zeros((1, 3), dtype=F32)})
    with pytest.raises(ss.BadInput, match="missing"):
        c.infer("chain", {"z": np.zeros((1, 2), dtype=F32)})
    with pytest.raises(ss.BadInput) as e:
        c.infer("chain", {"x": np.zeros((1, 2), dtype=np.complex64)})
    assert e.value.status is None, "refused before sending"

    for inputs in ({"x": np.zeros((1, 2), dtype=F32)}, {"x": [[1, 2]]}):
        with pytest.raises(ss.UnknownPipeline) as e:
            c.infer("no-such-pipeline", inputs)
        assert (e.value.status, e.value.kind) == (404, "unknown_pipeline")
        assert isinstance(e.value, ss.NotFound) and isinstance(e.value, LookupError)

    with pytest.raises(ss.ComponentFailed, match="13 is unlucky") as e:
        c.infer("chain", {"x": [[13, 1]]})
    assert e.value.status == 500

    with pytest.raises(ss.PayloadTooLarge) as e:
        c.infer("chain", {"x": np.zeros((200_000, 2), dtype=F32)})  # 1.6 MB; the node takes 1 MB
    assert e.value.status == 413
    assert c.infer("chain", {"x": [[1, 1]]})["y"].tolist() == [[3.0, 3.0]], "the connection survives"

    with pytest.raises(ss.RequestTimeout) as e:  # Prod sleeps 5 s on 77; the node's timeout is 2 s
        c.infer("diamond", {"x": [[77, 1]]})
    assert (e.value.status, e.value.kind) == (504, "timeout") and isinstance(e.value, ss.DeadlineExceeded)

    with pytest.raises(ss.Unavailable) as e:  # Double's worker exits mid-batch on 66
        c.infer("chain", {"x": [[66, 1]]})
    assert (e.value.status, e.value.kind, e.value.retry_after) == (503, "unavailable", 1.0)
    assert isinstance(e.value, ConnectionError)
    wait_for(lambda: c.ready("chain"), timeout=30)
    c.close()

    with pytest.raises(ss.Unreachable):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # a port nobody listens on
        ss.Client(f"http://127.0.0.1:{port}").infer("chain", {"x": np.zeros((1, 2), dtype=F32)})
    assert ss.Client(f"http://127.0.0.1:{port}").ready() is False


def burst(c: ss.Client, n: int = 24) -> list[BaseException | None]:
    """A 150 ms SLO, taught that a batch takes ~100 ms, then a burst of `n`:
    the node refuses what cannot meet the SLO (as in test_deadlines)."""
    for _ in range(3):
        c.infer("tight", {"x": [[1, 100]]})

    def one(i: int) -> BaseException | None:
        try:
            c.infer("tight", {"x": np.array([[i, 100]], dtype=F32)})
            return None
        except ss.Error as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_overload_is_overloaded_with_retry_after(server: ss.Server) -> None:
    c = server.client(retry=None)
    results = burst(c)
    refused = [e for e in results if isinstance(e, ss.Overloaded)]
    assert refused, results
    # The node's wait in ms (its predicted drain time), not HTTP's whole seconds.
    assert all(e.status == 429 and e.retry_after is not None and 0 < e.retry_after < 1.0 for e in refused)
    assert all(r is None or isinstance(r, (ss.Overloaded, ss.DeadlineExceeded)) for r in results), results
    assert c.retry_stats.retries == 0
    c.close()


def test_refusals_are_retried_after_the_wait_within_the_budget(server: ss.Server) -> None:
    """The same burst with the default policy: refused calls come back after
    the node's wait, and no more retries are sent than the budget holds
    (its burst of 10, plus a tenth of the calls)."""
    c = server.client()
    results = burst(c)
    stats = c.retry_stats
    assert stats.calls == 27 and 0 < stats.retries <= 10 + 27 * 0.1, stats
    answered = sum(r is None for r in results)
    assert answered > 0 and all(r is None or isinstance(r, (ss.Overloaded, ss.DeadlineExceeded))
                                for r in results), results
    c.close()


# --- Pipeline objects ----------------------------------------------------------------------


def test_a_pipeline_defined_here_is_served_by_launch() -> None:
    power = 2  # captured by value with the class

    @ss.component(max_batch_size=8, inputs={"n": ss.Tensor("int32", (-1, 3))})
    class Power:
        def __init__(self, offset: int) -> None:
            self.offset = offset

        def __call__(self, batch: ss.Batch) -> dict:
            return {"p": batch["n"].astype(np.int64) ** power + self.offset, "pid": np.full(batch.rows, os.getpid())}

    pipe = ss.Pipeline("powers", Power.bind(offset=10))
    with ss.launch(pipe) as node:
        bundle = node.bundle_path
        assert bundle is not None and bundle.is_file()
        with node.client() as c:
            n = np.array([[1, 2, 3], [-4, 5, 0]], dtype=np.int32)
            out = c.infer("powers", {"n": n})
            assert out["p"].dtype == np.int64 and out["p"].tolist() == [[11, 14, 19], [26, 35, 10]]
            assert out["pid"][0] != os.getpid()
            assert c.infer("powers", {"n": [[2, 2, 2]]})["p"].tolist() == [[14, 14, 14]]

        async def in_async() -> list[int]:
            async with ss.AsyncClient(node.url) as ac:
                outs = await asyncio.gather(*(ac.infer("powers", {"n": [[i, 0, 0]]}) for i in range(20)))
                return [int(o["p"][0, 0]) for o in outs]

        assert asyncio.run(in_async()) == [i * i + 10 for i in range(20)]
    assert node.proc.returncode == 0
    assert not bundle.exists() and not bundle.parent.exists(), "the bundle goes with the node"


def test_launch_errors_remove_the_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    @ss.component(inputs={"x": ss.Tensor("float32", (-1,))})
    class Broken:
        def __init__(self) -> None:
            raise RuntimeError("no model here")

        def __call__(self, batch: ss.Batch) -> dict:
            return {}

    with pytest.raises(ss.ConfigError, match="no-such-option"):
        ss.launch(ss.Pipeline("broken", Broken), no_such_option=1)
    with pytest.raises(ss.ServeError, match="no model here"):
        ss.launch(ss.Pipeline("broken", Broken))
    assert list(tmp_path.glob("slipstream-app-*")) == []


def test_serve_blocks_and_serves_pipelines_of_main(tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import slipstream as ss

        @ss.component(max_batch_size=4, inputs={"x": ss.Tensor("float64", (-1,))})
        class Negate:  # defined in __main__: travels by value
            def __call__(self, batch):
                return {"y": -batch["x"]}

        if __name__ == "__main__":
            ss.serve(ss.Pipeline("neg", Negate), port=0)
            print("serve returned", flush=True)
    """))
    # A short private TMPDIR: the node's worker sockets go under it too, and
    # a socket's path must fit in 108 bytes (tmp_path under xdist may not).
    with tempfile.TemporaryDirectory(prefix="ss-serve-") as short:
        tmp = Path(short)
        proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            url = None
            for line in proc.stdout:
                lines.append(line)
                m = re.search(r"listening on (http://[\d.]+:\d+)", line)
                url = m.group(1) if m else url
                if "ready, serving" in line:
                    break
            assert url is not None and "ready, serving" in lines[-1], "".join(lines)
            assert list(tmp.glob("slipstream-app-*/pipelines.pkl")), "the pipelines went through a bundle"
            with ss.Client(url) as c:
                out = c.infer("neg", {"x": np.array([1.5, -2.0])})
                assert out["y"].dtype == np.float64 and out["y"].tolist() == [-1.5, 2.0]
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=30)
            lines.append(rest)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, "".join(lines)
        assert "serve returned" in "".join(lines)
        assert list(tmp.glob("slipstream-app-*")) == [], "the bundle is removed when serve returns"


# --- torch ------------------------------------------------------------------------------


def test_torch_tensors_in_and_out(server: ss.Server) -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    with server.client() as c:
        out = c.infer("chain", {"x": x}, as_torch=True)
        assert isinstance(out["y"], torch.Tensor) and out["y"].dtype == torch.float32
        assert torch.equal(out["y"], x * 2 + 1)
        out = c.infer("text", {"text": ["a"]}, as_torch=True)
        assert out["loud"].tolist() == ["A!"] and isinstance(out["n"], torch.Tensor)

    async def in_async() -> Any:
        async with ss.AsyncClient(server.url) as ac:
            return await ac.infer("chain", {"x": x[:1]}, as_torch=True)

    out = asyncio.run(in_async())
    assert torch.equal(out["y"], x[:1] * 2 + 1)
