"""The container image and the Helm chart, run as Kubernetes would run them,
without a container engine: the Dockerfile's steps (read from the file,
tests/dockerfile.py) carried out on a Debian root made with debootstrap,
then three nodes started from that root, each in a network namespace of
its own (a pod: its own address, an overlay of the image as its file
system, its own /dev/shm and state directory) with exactly the arguments,
environment, configuration file, probes and preStop hook that `helm
template` renders (tests/chart.py), beside a real etcd. A pipeline is
deployed from outside (`slipstream deploy`, once the nodes are up and
waiting for one: live, not ready) and served through the nodes
a Service would route to (those whose readiness probe passes); then a
rolling restart as the StatefulSet does it (highest ordinal first: out of
the Service, preStop, SIGTERM, a new pod, ready) must fail no request; a
node killed and a node cut off must leave the cluster serving.

Needs root (chroot, mounts, network namespaces) and the network (apt and
PyPI, as an image build does); slow, like the wheel test it shares its
marker with (`-m 'not wheel'` skips both)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from slipstream.testing import TOKEN, Etcd, Subnet, deploy

from tests import chart, dockerfile
from tests.conftest import APPS, ROOT, wait_for
from tests.wheel import build_wheel

pytestmark = pytest.mark.wheel

ROOTFS = ROOT / ".venv" / "opt" / "rootfs"
NAMESPACE = "serving"
RELEASE = "ss"
PODS = 3
# A client's patience: the pipeline's SLO is 2 s; a request to a machine cut off hangs until this.
CLIENT_TIMEOUT_S = 2.5
ERRORS: list[tuple[float, str, str]] = []  # (when: wall clock, pod, what): requests answered with an error, or not at all


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dockerfile.Image:
    if os.geteuid() != 0:
        pytest.skip("the image test needs root (chroot, mounts)")
    stages = dockerfile.parse(ROOT / "Dockerfile")
    wheel_stage, final = stages[0], stages[-1]
    assert wheel_stage.name == "wheel" and final.name is None, [s.name for s in stages]
    release = dockerfile.debian_release(final.image)
    base = ROOTFS / release
    made = subprocess.run([str(ROOT / "scripts" / "debian_root.sh"), release, str(base)],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr
    tmp = tmp_path_factory.mktemp("image")
    wheels = tmp / "wheels"
    build_wheel(wheels)
    t0 = time.monotonic()
    steps: list[str] = []
    img = dockerfile.build(final, base, tmp / "root", context=ROOT, stage_outputs={"wheel": {"/wheels": wheels}},
                           build_env={"PIP_CERT": "/tmp/.build-ca.pem"},
                           build_files={"/tmp/.build-ca.pem": Path("/etc/ssl/certs/ca-certificates.crt")}, log=steps)
    print(f"image: {len(steps)} steps in {time.monotonic() - t0:.0f} s")
    return img


def test_the_image_runs_as_its_own_user_with_only_what_it_needs(image: dockerfile.Image) -> None:
    assert image.entrypoint == ["slipstream"] and image.user == "10001:10001", (image.entrypoint, image.user)
    assert {"8000", "7000"} <= set(image.exposed)
    out = _in_image(image, ["slipstream", "config", "--json"])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["host"]["value"] == "0.0.0.0"  # the image's ENV
    who = _in_image(image, ["sh", "-c", "id -u; command -v cc gcc cargo rustc pip3 || true; ls /tmp"])
    lines = who.stdout.split()
    assert lines[0] == "10001", who.stdout  # not root
    assert lines[1:] == [], f"build tools or leftovers in the image: {lines[1:]}"


def _in_image(image: dockerfile.Image, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["chroot", f"--userspec={image.user}", str(image.root), "/usr/bin/env", "-i",
                           *[f"{k}={v}" for k, v in image.env.items()], "HOME=/var/lib/slipstream", *argv],
                          capture_output=True, text=True, timeout=120)


class Pod:
    """One StatefulSet pod on machine `machine` of `net`: the chart's
    container run in an overlay of the image's root, a new one each time
    the pod is made; its state volume kept across them."""

    def __init__(self, image: dockerfile.Image, docs: list[dict[str, Any]], ordinal: int, net: Subnet,
                 where: Path) -> None:
        self.image, self.docs, self.net = image, docs, net
        self.name = f"{RELEASE}-slipstream-{ordinal}"
        self.machine = f"n{ordinal}"
        self.ip = net.ip[self.machine]
        self.container = chart.node_container(docs)
        self.pod = chart.node_statefulset(docs)["spec"]["template"]["spec"]
        fields = {"metadata.name": self.name, "status.podIP": self.ip, "metadata.namespace": NAMESPACE}
        # The container's environment over the image's, $(VAR) in args from it.
        self.env = {**image.env, **chart.container_env(docs, self.container, fields)}
        self.env.setdefault("HOME", _home(image.root, image.user))
        assert "command" not in self.container  # the image's entrypoint runs, with the chart's args
        self.argv = image.entrypoint + [chart.expand(a, self.env) for a in self.container["args"]]
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.port = ports["http"]
        self.ports = ports
        self.dir = where / self.name
        self.root = self.dir / "root"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._mounts: list[Path] = []
        self.terminating: float | None = None  # when its deletion began
        self.started = 0.0  # when this pod (incarnation) was made
        self.log = self.dir / "node.log"

    def probe(self, kind: str) -> bool:
        """The container's `kind` probe (startupProbe, readinessProbe, livenessProbe), once, as the kubelet sends it."""
        spec = self.container[kind]
        get = spec["httpGet"]
        port = self.ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{port}{get['path']}",
                                        timeout=spec.get("timeoutSeconds", 1)) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, OSError):
            return False

    def start(self) -> None:
        """A new pod: a fresh container file system (an overlay of the image)
        with the pod's volumes in it: its state volume (kept, as the
        StatefulSet's claim is), /dev/shm as memory, the ConfigMap's files."""
        self.starts += 1
        run = self.dir / f"run{self.starts}"
        for d in ("upper", "work"):
            (run / d).mkdir(parents=True)
        self.root.mkdir(parents=True, exist_ok=True)
        _sh("mount", "-t", "overlay", "overlay", "-o",
            f"lowerdir={self.image.root},upperdir={run / 'upper'},workdir={run / 'work'}", str(self.root))
        self._mounts = [self.root]
        state = self.dir / "state"
        if not state.exists():
            state.mkdir(parents=True)
            os.chown(state, *(int(x) for x in self.image.user.split(":")))  # fsGroup, as the kubelet sets it
        for m in self.container["volumeMounts"]:
            if m["name"] == "state":
                self._mount("--bind", str(state), self.root / m["mountPath"].lstrip("/"))
        self._mount("-t", "proc", "proc", self.root / "proc")
        shm = next(v for v in self.pod["volumes"] if v["name"] == "shm")["emptyDir"]
        assert shm["medium"] == "Memory"
        self._mount("-t", "tmpfs", "-o", f"size={shm['sizeLimit'].replace('i', '')},mode=1777", "tmpfs",
                    self.root / "dev" / "shm")
        for path, text in chart.mounted_files(self.docs, self.container).items():
            f = self.root / path.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        self.terminating = None
        self.started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.net.wrap(self.machine), *self._chroot(), *self.argv],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _mount(self, *args: str | Path) -> None:
        where = Path(args[-1])
        where.mkdir(parents=True, exist_ok=True)
        _sh("mount", *[str(a) for a in args])
        self._mounts.append(where)

    def _chroot(self) -> list[str]:
        return ["chroot", f"--userspec={self.image.user}", str(self.root), "/usr/bin/env", "-i",
                "-C", self.image.workdir, *[f"{k}={v}" for k, v in self.env.items()]]

    def wait_ready(self, timeout: float = 90.0) -> None:
        """The startup probe, then the readiness probe, as the kubelet runs them."""
        try:
            wait_for(lambda: self.probe("startupProbe"), timeout=timeout, every=0.5)
            wait_for(lambda: self.probe("readinessProbe"), timeout=timeout, every=0.5)
        except AssertionError:
            raise AssertionError(f"{self.name} did not become ready:\n{self.tail()}\n{self.debug()}") from None

    def debug(self) -> str:
        """What its /tmp holds and what is mounted for it, for a failure's message."""
        tmp = subprocess.run(["find", str(self.root / "tmp"), "-maxdepth", "2"], capture_output=True, text=True)
        mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if self.name in line]
        return f"--- its /tmp:\n{tmp.stdout}\n--- its mounts:\n" + "\n".join(mounts)

    def terminate(self) -> float:
        """What deleting the pod does: out of the Service, the preStop hook,
        SIGTERM, SIGKILL after the grace period. Seconds it took."""
        t0 = self.terminating = time.monotonic()
        grace = self.pod["terminationGracePeriodSeconds"]
        hook = self.container["lifecycle"]["preStop"]["exec"]["command"]
        subprocess.run([*self.net.wrap(self.machine), *self._chroot(), *hook], check=True, timeout=grace)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(max(1.0, grace - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} outlived its grace period ({grace} s):\n{self.tail()}") from None
        self._unmount()
        return time.monotonic() - t0

    def kill(self) -> None:
        """The machine is lost: everything in the pod dies at once."""
        self.terminating = time.monotonic()
        self._unmount()

    def _unmount(self) -> None:
        """Every process in the pod killed (as its cgroup is), then its mounts undone."""
        for _ in range(50):
            inside = [pid for pid in _pids() if _root_of(pid) == str(self.root)]
            if not inside:
                break
            for pid in inside:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait(30)
        for m in reversed(self._mounts):
            subprocess.run(["umount", str(m)], check=True, capture_output=True, timeout=30)
        self._mounts = []

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _timeline(pods: list[Pod], before_s: float = 6.0, after_s: float = 1.0) -> str:
    """The errors and what the nodes logged around them (replica and
    cluster events, by wall clock), for a failure's message."""
    if not ERRORS:
        return ""
    lo, hi = ERRORS[0][0] - before_s, ERRORS[-1][0] + after_s
    lines = [(t, f"{p} client: {what[:160]}") for t, p, what in ERRORS]
    for p in pods:
        text = p.log.read_text(errors="replace") if p.log.exists() else ""
        for line in text.splitlines():
            try:
                rec = json.loads(line)
                t = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            if lo <= t <= hi:
                lines.append((t, f"{p.name} {rec.get('level', '')} {rec.get('message', '')[:160]}"))
    lines.sort()
    return "\n".join(f"{time.strftime('%H:%M:%S', time.gmtime(t))}.{int(t % 1 * 1000):03d} {what}"
                     for t, what in lines[-300:])


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _root_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/root")
    except OSError:
        return None


def _home(root: Path, user: str) -> str:
    uid = user.split(":")[0]
    for line in (root / "etc" / "passwd").read_text().splitlines():
        f = line.split(":")
        if f[2] == uid:
            return f[5]
    return "/"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Service:
    """The chart's API Service as clients meet it: requests spread over the
    pods whose readiness probe passes (probed as the kubelet does, by the
    chart's period and failure threshold), a terminating pod dropped at once
    (its endpoint then still routed to for `lag` seconds, as kube-proxy
    catches up: what the preStop wait covers)."""

    def __init__(self, pods: list[Pod], lag: float = 0.5) -> None:
        self.pods, self.lag = pods, lag
        self.ready = {p.name: False for p in pods}
        self._ready_at = {p.name: 0.0 for p in pods}  # when the probe that made it ready was sent
        self._fails = Counter[str]()
        self.stop = threading.Event()
        self.results: list[tuple[float, float, int, str]] = []  # (sent, took, status, pod)
        threading.Thread(target=self._kubelet, daemon=True).start()

    def _kubelet(self) -> None:
        spec = self.pods[0].container["readinessProbe"]
        while not self.stop.is_set():
            for p in self.pods:
                if p.terminating is not None:
                    self.ready[p.name] = False
                    continue
                sent = time.monotonic()
                if p.probe("readinessProbe"):
                    self._fails[p.name] = 0
                    self.ready[p.name] = True
                    self._ready_at[p.name] = sent
                else:
                    self._fails[p.name] += 1
                    if self._fails[p.name] >= spec["failureThreshold"]:
                        self.ready[p.name] = False
            self.stop.wait(spec["periodSeconds"])

    def endpoints(self) -> list[Pod]:
        now = time.monotonic()
        # Ready means: a probe of this incarnation passed (a new pod starts unready).
        return [p for p in self.pods if (self.ready[p.name] and p.terminating is None
                                         and self._ready_at[p.name] >= p.started)
                or (p.terminating is not None and now - p.terminating < self.lag)]

    def load(self, clients: int = 4) -> list[threading.Thread]:
        def run(k: int) -> None:
            i = k
            while not self.stop.is_set():
                eps = self.endpoints()
                if not eps:
                    time.sleep(0.05)
                    continue
                pod = eps[i % len(eps)]
                x = [float(i % 7) + 1.0, 2.0]
                t0 = time.monotonic()
                status = _infer(pod, x)
                self.results.append((t0, time.monotonic() - t0, status, pod.name))
                i += clients
                time.sleep(0.02)

        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(clients)]
        for t in threads:
            t.start()
        return threads


def _infer(pod: Pod, x: list[float]) -> int:
    """One request of the diamond pipeline; its status (-1: no answer; 200 only when the answer is right)."""
    body = json.dumps({"inputs": {"x": [x]}}).encode()
    req = urllib.request.Request(f"http://{pod.ip}:{pod.port}/v1/pipelines/diamond/infer", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        ERRORS.append((time.time(), pod.name, f"{e.code} {e.read()[:300].decode(errors='replace')}"))
        return e.code
    except (urllib.error.URLError, OSError) as e:
        ERRORS.append((time.time(), pod.name, repr(e)))
        return -1
    both = out["outputs"]["both"][0]
    return 200 if both == [abs(x[0]) + abs(x[1]), x[0] * x[1]] else 0


@pytest.fixture(scope="module")
def net() -> Iterator[Subnet]:
    try:
        s = Subnet([f"n{i}" for i in range(PODS)])
    except Exception as e:  # noqa: BLE001 (any failure to make one means: not here)
        pytest.skip(f"cannot make network namespaces here (needs root and CAP_NET_ADMIN): {e}")
    yield s
    s.close()


def test_a_cluster_from_the_image_and_the_chart_serves_through_restarts_kills_and_cuts(
        image: dockerfile.Image, net: Subnet, tmp_path: Path) -> None:
    etcd = Etcd(1, host=net.host_ip)
    pods: list[Pod] = []
    svc: Service | None = None
    try:
        values = {"etcd": {"bundled": False, "endpoints": [etcd.url.removeprefix("etcd://")]},
                  "cluster": {"token": TOKEN, "ttlSeconds": 2}, "preStopSleepSeconds": 2,
                  "config": {"drain_timeout_s": 10, "request_timeout_s": 10}}
        docs = chart.render(values, name=RELEASE, namespace=NAMESPACE)
        pods = [Pod(image, docs, i, net, tmp_path) for i in range(PODS)]
        for p in pods:
            p.start()
        # Installed before anything is deployed: live (no restart loop), not ready, saying why.
        for p in pods:
            wait_for(lambda p=p: p.probe("startupProbe"), timeout=60, every=0.5)
            assert p.probe("livenessProbe") and not p.probe("readinessProbe")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://{p.ip}:{p.port}/readyz", timeout=5)
            assert "waiting for a deployment" in e.value.read().decode()
        out = deploy(etcd, APPS / "cluster.py", wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        for p in pods:
            p.wait_ready()
        svc = Service(pods)
        wait_for(lambda: all(svc.ready.values()), timeout=30)
        load = svc.load()
        time.sleep(1.0)

        # A rolling restart, as the StatefulSet does one: highest ordinal first.
        rolled_from = time.monotonic()
        took = []
        for p in reversed(pods):
            print(f"{time.monotonic():.2f} terminating {p.name}")
            took.append(p.terminate())
            print(f"{time.monotonic():.2f} stopped {p.name}")
            p.start()
            p.wait_ready()
            wait_for(lambda p=p: svc.ready[p.name], timeout=30)
        rolled = [r for r in svc.results if r[0] >= rolled_from]
        statuses = Counter(r[2] for r in rolled)
        print(f"rolling restart: {len(rolled)} requests, {dict(statuses)}, stops took "
              f"{', '.join(f'{t:.1f}' for t in took)} s")
        assert len(rolled) > 100, len(rolled)
        assert set(statuses) == {200}, f"{statuses} {ERRORS[:10]}\n{_timeline(pods)}"
        assert {r[3] for r in rolled} == {p.name for p in pods}

        # A machine lost: its pod killed, the StatefulSet makes it again.
        lost = pods[1]
        killed = time.monotonic()
        lost.kill()
        time.sleep(1.0)
        lost.start()
        lost.wait_ready()
        wait_for(lambda: svc.ready[lost.name], timeout=30)
        time.sleep(1.0)
        after = [r for r in svc.results if r[0] >= killed]
        print(f"kill: {len(after)} requests, {dict(Counter(r[2] for r in after))}")
        assert 0 not in {r[2] for r in after}  # never a wrong answer
        assert all(r[2] == 200 for r in after[-40:]), Counter(r[2] for r in after[-40:])

        # A machine cut off: its readiness fails, the others serve on.
        cut = pods[2]
        cut_at = time.monotonic()
        net.partition(cut.machine)
        wait_for(lambda: not svc.ready[cut.name], timeout=30)
        out_of_service = time.monotonic()
        time.sleep(CLIENT_TIMEOUT_S + 1.0)  # clients that were waiting on it give up
        recent = [r for r in svc.results if r[0] >= out_of_service]
        assert recent and all(r[2] == 200 for r in recent), Counter(r[2] for r in recent)
        net.heal(cut.machine)  # its rejoining is tests/integration/test_cluster_partition.py's
        after_cut = [r for r in svc.results if r[0] >= cut_at]
        print(f"cut off: {len(after_cut)} requests, {dict(Counter(r[2] for r in after_cut))}")
        assert 0 not in {r[2] for r in after_cut}
        svc.stop.set()
        for t in load:
            t.join(30)
    finally:
        if svc is not None:
            svc.stop.set()
        for p in pods:
            p.kill()
        etcd.stop()
        net.heal(f"n{PODS - 1}")
