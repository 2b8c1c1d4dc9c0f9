"""`make bench-stream`: time to first chunk of a streamed answer, beside the
time to the whole answer, on AudioQuery (examples/audioquery.py: speech ->
transcript -> retrieval -> classifier -> spoken answer).

Its last stage, ``Speak``, streams: the text answer goes out as a chunk at
once, and the spoken answer (espeak-ng) follows as the final answer. A
client of ``/v2/models/audioquery/infer_stream`` (``ss.Client.stream``) can
show the text while the speech is synthesised; this measures by how much
sooner, per spoken question, sent one at a time (closed loop, so the
figures are service times, not queueing):

- ``first chunk``: request sent -> first chunk decoded;
- ``done``: request sent -> final answer decoded (the same request);
- ``plain``: a plain ``infer`` of the same question, for comparison.

Questions are the corpus' benchmark queries spoken by espeak-ng (as
``examples/audioquery_client.py`` makes them). Writes
bench/results/stream.{json,md}.

    .venv/bin/python -m bench.stream [-n 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import EXAMPLES, RESULTS, percentile

corpus = harness.example_module("models.corpus")
speech = harness.example_module("models.speech")
vindex = harness.example_module("models.vindex")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=30, help="spoken questions (each asked streamed and plain)")
    ap.add_argument("--slice", type=int, default=300, help="index slice (the tests' small one by default)")
    ap.add_argument("--out", type=Path, default=RESULTS / "stream")
    a = ap.parse_args(argv)

    machine = harness.machine()
    print(f"load average before: {machine['loadavg_before']}", file=sys.stderr)
    slice_dir = vindex.prepare(small=a.slice, threads=2)
    held = set(vindex.indexed_ids(slice_dir).tolist())
    queries = [q for q in corpus.load_queries() if q["passage_id"] in held][: a.n]
    env = {"AQ_INDEX": "small", "AQ_SLICE": str(a.slice), "AQ_SLO_MS": "20000"}
    rows: list[dict[str, Any]] = []
    with harness.node(EXAMPLES / "audioquery.py", env=env) as node, node.client() as c:
        width = int(c.metadata("audioquery")["inputs"]["audio"]["shape"][1])
        clips = [speech.synthesize(q["query"]) for q in queries]
        exclude = np.array([""], dtype=object)
        for i, clip in enumerate(clips):
            audio, length = speech.pad_batch([clip], width)
            inputs = {"audio": audio, "length": length, "exclude": exclude}
            t0 = time.perf_counter()
            with c.stream("audioquery", inputs) as s:
                chunks = list(s)
            done = time.perf_counter() - t0
            t1 = time.perf_counter()
            plain = c.infer("audioquery", inputs)
            plain_s = time.perf_counter() - t1
            assert s.final is not None and len(chunks) == 1 and s.first_chunk_s is not None
            assert s.final["answer"][0] == plain["answer"][0]
            rows.append({"first_chunk_ms": s.first_chunk_s * 1e3, "done_ms": done * 1e3, "plain_ms": plain_s * 1e3,
                         "speech_bytes": len(s.final["speech"][0])})
            print(f"  {i + 1}/{len(clips)}: first chunk {s.first_chunk_s * 1e3:.0f} ms, done {done * 1e3:.0f} ms, "
                  f"plain {plain_s * 1e3:.0f} ms", file=sys.stderr)
    summary = {k: {"p50": percentile([r[k] for r in rows], 50), "p90": percentile([r[k] for r in rows], 90)}
               for k in ("first_chunk_ms", "done_ms", "plain_ms")}
    saved = [r["done_ms"] - r["first_chunk_ms"] for r in rows]
    result = {"pipeline": "audioquery", "questions": len(rows), "summary": summary,
              "earlier_by_ms_p50": statistics.median(saved), "rows": rows}
    md = ["# Time to first chunk (AudioQuery, streamed text answer before its speech)", "",
          f"{len(rows)} spoken questions, one at a time.",
          "", "| | p50 ms | p90 ms |", "|---|---|---|"]
    names = {"first_chunk_ms": "first chunk (text answer)", "done_ms": "done (with speech)",
             "plain_ms": "plain infer"}
    for k, label in names.items():
        md.append(f"| {label} | {summary[k]['p50']:.0f} | {summary[k]['p90']:.0f} |")
    md += ["", f"The text answer arrives a median {result['earlier_by_ms_p50']:.0f} ms before the whole answer.",
           "", "Command: `make bench-stream` (`python -m bench.stream`)."]
    harness.write_results(a.out, result, "\n".join(md), machine)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
