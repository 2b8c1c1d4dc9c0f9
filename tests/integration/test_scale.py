"""Replica sets that change at run time: `POST /v1/admin/scale` and
`slipstream scale`, warm-up before routing, draining before exit, fan-in
joins and routing under a changing set, and admin authorisation."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import APPS, SLIPSTREAM, Node, wait_for


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(APPS / "scalable.py"))
    n.wait_ready()
    yield n
    n.stop()


def scale(node: Node, pipeline: str, stage: str, n: int, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, _, raw = node.request("POST", "/v1/admin/scale",
                                  {"pipeline": pipeline, "stage": stage, "replicas": n}, headers=headers)
    return status, json.loads(raw)


def replicas(node: Node, pipeline: str, stage: str) -> list[dict]:
    return list(node.stage(pipeline, stage)["replicas"])


def events(node: Node, **match: object) -> list[dict]:
    return [e for e in node.status()["events"] if all(e[k] == v for k, v in match.items())]


def test_a_new_replica_warms_up_before_it_takes_traffic(node: Node) -> None:
    # Serve a few requests: the first replica pays its slow first call, and
    # the stage keeps one request as its warm-up sample.
    for _ in range(3):
        assert node.infer("warm", x=[[1, 1]])[0] == 200
    first = replicas(node, "warm", "Warm")[0]["pid"]
    status, out = scale(node, "warm", "Warm", 2)
    assert status == 200, out
    assert (out["from"], out["replicas"], len(out["added"]), out["draining"]) == (1, 2, 1, [])
    new_id = out["added"][0]
    # While it starts and warms up it is not routed to: every request lands on the first replica.
    states = []
    while True:
        r = {x["id"]: x for x in replicas(node, "warm", "Warm")}
        states.append(r[new_id]["state"])
        if r[new_id]["state"] == "ready":
            break
        status, body = node.infer("warm", x=[[1, 1]])
        assert status == 200
        if body["outputs"]["pid"] != [[first]]:
            # Only if it turned ready between the status read and the request.
            r = {x["id"]: x for x in replicas(node, "warm", "Warm")}
            assert r[new_id]["state"] == "ready", "a starting replica got traffic"
        assert len(states) < 400, "the new replica never became ready"
    assert "starting" in states
    what = [e["what"] for e in events(node, pipeline="warm", stage="Warm", replica=new_id)]
    assert what.index("warmed_up") < what.index("ready"), what
    # Warm now: requests spread over both, and none pays a cold first call
    # (0.6 s; these take ~5 ms).
    def timed(_: int) -> tuple[int, int, float]:
        t0 = time.monotonic()
        status, body = node.infer("warm", x=[[1, 5]])
        return status, body["outputs"]["pid"][0][0], time.monotonic() - t0

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(timed, range(40)))
    assert all(status == 200 for status, _, _ in answers)
    assert len({pid for _, pid, _ in answers}) == 2, answers
    slowest = max(t for _, _, t in answers)
    assert slowest < 0.4, f"a request paid the new replica's cold start ({slowest:.2f} s)"


def test_removed_replicas_drain_before_they_exit(node: Node) -> None:
    assert scale(node, "warm", "Warm", 2)[0] == 200
    wait_for(lambda: [r["state"] for r in replicas(node, "warm", "Warm")] == ["ready", "ready"], timeout=30)
    # Keep both replicas busy with 300 ms batches, then scale down mid-batch.
    results: list[tuple[int, object]] = []
    threads = [threading.Thread(target=lambda: results.append(node.infer("warm", x=[[1, 300]]))) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: all(r["outstanding"] > 0 for r in replicas(node, "warm", "Warm")), timeout=5)
    status, out = scale(node, "warm", "Warm", 1)
    assert status == 200 and len(out["draining"]) == 1, out
    gone = out["draining"][0]
    for t in threads:
        t.join(10)
    assert [s for s, _ in results] == [200] * 4, results
    wait_for(lambda: [r["id"] for r in replicas(node, "warm", "Warm")] != [] and
             gone not in [r["id"] for r in replicas(node, "warm", "Warm")], timeout=10)
    what = [e["what"] for e in events(node, pipeline="warm", stage="Warm", replica=gone)]
    assert what[-2:] == ["draining", "removed"] or what[-1] == "removed", what
    assert node.infer("warm", x=[[2, 1]])[0] == 200


def test_fan_in_joins_stay_correct_while_the_set_changes(node: Node) -> None:
    stop = threading.Event()
    answers: list[tuple[int, object]] = []

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            a, b = k + 1, (i % 5) + 1
            status, body = node.infer("diamond", x=[[a, b]])
            answers.append((status, body if status != 200 else body["outputs"]["both"] == [[a + b, a * b]]))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for n in (3, 1, 2, 1, 3, 1):
            assert scale(node, "diamond", "Sum", n)[0] == 200
            time.sleep(0.4)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert len(answers) > 50
    wrong = [a for a in answers if a != (200, True)]
    assert not wrong, wrong[:5]
    wait_for(lambda: len(replicas(node, "diamond", "Sum")) == 1, timeout=15)


def test_scale_refuses_bad_requests(node: Node) -> None:
    for body, status, kind in [
        ({"pipeline": "warm", "stage": "Warm", "replicas": 0}, 400, "bad_input"),
        ({"pipeline": "warm", "stage": "Warm", "replicas": 65}, 400, "bad_input"),
        ({"pipeline": "warm", "stage": "Nope", "replicas": 2}, 404, "unknown_stage"),
        ({"pipeline": "nope", "stage": "Warm", "replicas": 2}, 404, "unknown_pipeline"),
        ({"pipeline": "warm", "stage": "Warm"}, 400, "bad_request"),
        ({"pipeline": "warm", "stage": "Warm", "replicas": -1}, 400, "bad_request"),
    ]:
        got, _, raw = node.request("POST", "/v1/admin/scale", body)
        assert (got, json.loads(raw)["error"]["kind"]) == (status, kind), (body, raw)
    assert node.request("GET", "/v1/admin/scale")[0] == 405
    assert len(replicas(node, "warm", "Warm")) >= 1


def test_the_cli_scales_and_waits_until_settled(node: Node) -> None:
    out = subprocess.run([*SLIPSTREAM, "scale", "--url", node.url, "diamond", "Prod", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1 -> 2 replicas" in out.stdout and "2 replicas ready" in out.stdout, out.stdout
    assert [r["state"] for r in replicas(node, "diamond", "Prod")] == ["ready", "ready"]
    bad = subprocess.run([*SLIPSTREAM, "scale", "--url", node.url, "diamond", "Nope", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no stage 'Nope'" in bad.stderr, bad.stderr
    status = subprocess.run([*SLIPSTREAM, "status", "--url", node.url], capture_output=True, text=True, timeout=60)
    assert "recent events:" in status.stdout and "scaled" in status.stdout, status.stdout


def test_admin_routes_need_a_token_beyond_loopback() -> None:
    open_node = Node(str(APPS / "scalable.py"), "--host", "0.0.0.0")
    try:
        open_node.wait_ready()
        status, out = scale(open_node, "warm", "Warm", 2)
        assert (status, out["error"]["kind"]) == (403, "forbidden"), out
        assert "--admin-token" in out["error"]["message"]
        assert open_node.request("POST", "/v1/admin/reset-metrics", b"")[0] == 403
        assert open_node.request("GET", "/v1/status")[0] == 200, "read-only routes stay open"
    finally:
        open_node.stop()
    guarded = Node(str(APPS / "scalable.py"), "--host", "0.0.0.0", "--admin-token", "s3cret")
    try:
        guarded.wait_ready()
        assert scale(guarded, "warm", "Warm", 2)[0] == 401
        status, out = scale(guarded, "warm", "Warm", 2, token="wrong")
        assert (status, out["error"]["kind"]) == (401, "unauthorized")
        assert scale(guarded, "warm", "Warm", 2, token="s3cret")[0] == 200
        cli = subprocess.run([*SLIPSTREAM, "scale", "--url", guarded.url, "warm", "Warm", "1", "--no-wait"],
                             capture_output=True, text=True, timeout=60,
                             env={**__import__("os").environ, "SLIPSTREAM_ADMIN_TOKEN": "s3cret"})
        assert cli.returncode == 0, cli.stderr
    finally:
        guarded.stop()
