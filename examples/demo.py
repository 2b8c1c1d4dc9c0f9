"""`make demo`: serve the RAG pipeline (examples/rag.py) on real models and
ask it real questions.

Starts `slipstream serve examples/rag.py` (a Rust node, one worker process
per replica: MiniLM embedding -> faiss search over Debian package
descriptions), sends a few real queries (one-line package summaries whose
right answer is the package's long description), prints the top answers,
then puts a new document into the node's object store and finds it with
the next query (the knowledge base is live), measures recall@10 over 100 queries through the served pipeline and
shows the node's status. On a fresh machine the first run builds the corpus
from apt's package lists and embeds a 2,000-passage slice (about a minute);
`make data` builds the full 39k-passage index, which the demo then uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import slipstream as ss

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())




DOC = """stormcrow
Stormcrow watches a directory of weather-station CSV exports and turns each new file into
hourly rainfall and wind-gust charts, with an alert when gusts pass a threshold."""


def live_document(url: str) -> None:
    """The knowledge base is live: put a document, ask about it, get it back."""
    store = ss.store.Store(url)
    question = "chart rainfall and wind gusts from weather station files"
    print("\n# The knowledge base updates live: a new document, put into the node's object store")
    print(f"$ slipstream put /docs/demo/stormcrow stormcrow.txt --url {url}")
    t0 = time.perf_counter()
    v = store.put("/docs/demo/stormcrow", DOC)
    print(f"  /docs/demo/stormcrow version {v.version} ({len(DOC)} B)")
    body = {"inputs": {"query": [question]}}
    while True:
        out = post(f"{url}/v1/pipelines/rag/infer", body)["outputs"]
        if "stormcrow" in out["package"][0] or time.perf_counter() - t0 > 10:
            break
        time.sleep(0.01)
    ms = (time.perf_counter() - t0) * 1e3
    print(f"$ curl -d '{json.dumps(body)}' {url}/v1/pipelines/rag/infer")
    print(f"  (found {ms:.0f} ms after the put: the ingest trigger embedded it, Search added it to its index)")
    for i in range(3):
        print(f"   {i + 1}. {out['scores'][0][i]:.3f}  {out['package'][0][i]:<28} {out['passage'][0][i][:70]!r}")
    print("$ slipstream get /docs/demo/stormcrow")
    print("  " + store.get("/docs/demo/stormcrow").text().replace("\n", "\n  "))


def main() -> int:
    t0 = time.monotonic()
    print("$ slipstream serve examples/rag.py", flush=True)
    node = ss.launch(HERE / "rag.py", echo=True, cwd=ROOT)
    url = node.url
    print(f"  (ready after {time.monotonic() - t0:.0f} s)")
    try:
        sys.path.insert(0, str(HERE))
        import rag
        from models import corpus, vindex

        package = {p.id: p.package for p in corpus.load_passages()}
        served = set(vindex.indexed_ids(rag.index_dir()).tolist())
        queries = [q for q in corpus.load_queries() if q["passage_id"] in served][:5]
        for q in queries:
            body = {"inputs": {"query": [q["query"]]}}
            print(f"\n$ curl -d '{json.dumps(body)}' {url}/v1/pipelines/rag/infer")
            t = time.perf_counter()
            out = post(f"{url}/v1/pipelines/rag/infer", body)["outputs"]
            ms = (time.perf_counter() - t) * 1e3
            ids = out["ids"][0]
            rank = ids.index(q["passage_id"]) + 1 if q["passage_id"] in ids else None
            print(f"  query: {q['query']!r}   ({ms:.0f} ms; right answer {package[q['passage_id']]}"
                  f" {'at rank ' + str(rank) if rank else 'not in the top 10'})")
            for i in range(3):
                print(f"   {i + 1}. {out['scores'][0][i]:.3f}  {out['package'][0][i]:<28} {out['passage'][0][i][:70]!r}")
        live_document(url)
        print(f"\n$ python examples/rag_client.py --url {url} -n 100")
        subprocess.run([sys.executable, str(HERE / "rag_client.py"), "--url", url, "-n", "100", "--show", "0"],
                       check=False, cwd=ROOT)
        print(f"\n$ slipstream status --url {url}")
        subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "status", "--url", url], check=True)
    finally:
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
