"""`make demo`: serve examples/echo.py, query it, show the node's status, stop.

Runs the real thing: a Rust node, one worker process per replica, HTTP on a
free local port.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    cmd = [sys.executable, "-m", "slipstream._internal.cli", "serve", str(HERE / "echo.py"), "--port", "0"]
    print("$ slipstream serve examples/echo.py", flush=True)
    node = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert node.stderr is not None
    url = None
    deadline = time.monotonic() + 120
    for line in node.stderr:
        print("  " + line.rstrip(), flush=True)
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            url = m.group(1)
        if "ready, serving" in line or time.monotonic() > deadline:
            break
    if url is None:
        print("the node did not start", file=sys.stderr)
        return 1
    try:
        queries = [
            ("demo", {"x": [[3, 4]]}),
            ("demo", {"x": [[1, 0], [1, 1]]}),
            ("stats", {"x": [[1, 5, 3], [2, 2, 2]]}),
        ]
        for name, inputs in queries:
            body = {"inputs": inputs}
            print(f"\n$ curl -d '{json.dumps(body)}' {url}/v1/pipelines/{name}/infer")
            print("  " + json.dumps(post(f"{url}/v1/pipelines/{name}/infer", body)))
        print(f"\n$ slipstream status --url {url}")
        subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "status", "--url", url], check=True)
    finally:
        node.send_signal(signal.SIGINT)
        rest = node.stderr.read()
        node.wait(30)
        for line in rest.splitlines():
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
