"""`make bench-espn`: late-interaction retrieval with the token embeddings in
RAM, in a memory-mapped file under memory pressure, and on SSD with ESPN's
prefetcher (Shrestha et al., "ESPN: Memory-Efficient Multi-Vector
Information Retrieval", ISMM 2024), over the Debian corpus of the RAG
example (examples/models/late.py; docs/design/late-interaction.md).

One run measures:

1. **Quality**: recall@10 and MRR@10 on the 1,000 benchmark queries,
   single-vector (the IVF index's top 10) against late interaction (the
   top ``--candidates`` re-ranked by MaxSim over MiniLM token embeddings),
   and at re-rank depths ``--depths`` (ESPN-Lite's partial re-rank).
2. **Per storage mode**, each in its own process (so that its resident
   memory is its own), on precomputed query embeddings (the encoder is
   not part of what is measured):
   - ``ram``: the token file read into anonymous memory;
   - ``mmap``: the file memory-mapped (``MADV_RANDOM``: no readahead), its
     page cache dropped first (``POSIX_FADV_DONTNEED``) and the process in
     a cgroup-v1 memory limit: its own peak anonymous memory (measured
     under load first) plus a margin plus ``--mem-frac`` of the token file,
     so that the page cache can keep only about that fraction of it;
   - ``mmap-readahead`` (not run unless asked for: slow): the same with the
     kernel's readahead (``MADV_NORMAL``);
   - ``ssd``: ``O_DIRECT`` reads with the prefetcher, in the same limit
     (the prefetch policy, models/prefetch.py, picks the step and the
     count from measured probe time, bandwidth and precision, or no
     prefetch; ``--prefetch-at`` fixes the step instead);
   - ``ssd-prefetch-all``: the prefetch reads every partial top candidate
     after a quarter of the probes (ESPN's prefetcher as published);
   - ``ssd-noprefetch``: no prefetch (reads start when the probes end),
     to show what the prefetch buys;
   - ``ram-compressed``, ``ssd-compressed``: the token embeddings as
     ``--nbits`` residuals (models/residual.py), in RAM and on SSD with
     the prefetcher (the limit: a quarter of that smaller file).
   Each: one pass over all queries, one at a time (latency p50/p99,
   quality, re-ranked counts, prefetch hit rate); then closed-loop
   clients (``--clients``, each thread sending the next query as soon as
   it has its answer, ``--duration`` s per level): **throughput at the
   SLO** is the highest answered rate among those levels whose p99 is
   within ``--slo-ms``; then one pass with a time budget (``--budget-ms``)
   reporting how many candidates were re-ranked and the quality under it.
   Resident memory: VmHWM/VmRSS (anonymous and file-backed) of the
   process, and the cgroup's peak usage (page cache included) where one
   was set.

    .venv/bin/python -m bench.espn --small   # 2,000-passage slice: a quick check (-> bench/results/espn_small.*)
    .venv/bin/python -m bench.espn           # full corpus (builds the index and token file if missing: long)

The full corpus' index is built the way ``scripts/prepare_rag.py`` builds it
(``vindex.prepare``) and its token file with ``late.ensure_tokens`` (both
resumable, with progress lines). Writes ``bench/results/espn.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import RESULTS, ROOT, percentile

corpus = harness.example_module("models.corpus")
late = harness.example_module("models.late")
vindex = harness.example_module("models.vindex")

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
MODES = ("ram", "mmap", "ssd", "ssd-prefetch-all", "ssd-noprefetch", "ram-compressed", "ssd-compressed",
         "mmap-readahead")
DEFAULT_MODES = MODES[:7]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def proc_memory() -> dict[str, int]:
    """This process' VmRSS, VmHWM, RssAnon, RssFile, RssShmem (bytes)."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


# ------------------------------------------------------------------ cgroup v1

def cgroup_available() -> str | None:
    """None if a cgroup-v1 memory limit can be set here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if not (CGROUP_ROOT / "memory.limit_in_bytes").is_file():
        return f"no cgroup-v1 memory controller at {CGROUP_ROOT}"
    return None


def cgroup_read(cg: Path, name: str) -> int:
    return int((cg / name).read_text().split()[0])


def cgroup_stat(cg: Path) -> dict[str, int]:
    stat = {}
    for line in (cg / "memory.stat").read_text().splitlines():
        k, v = line.split()
        if k in ("cache", "rss", "mapped_file", "total_cache", "total_rss"):
            stat[k] = int(v)
    return stat


# ------------------------------------------------------------------ the child

def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One storage mode, measured in this process."""
    cg = Path(cfg["cgroup"]) if cfg.get("cgroup") else None
    if cg is not None:
        (cg / "cgroup.procs").write_text(str(os.getpid()))
    mode = cfg["mode"]
    storage = "ssd" if mode.startswith("ssd") else "mmap" if mode.startswith("mmap") else "ram"
    nbits = cfg["nbits"] if mode.endswith("-compressed") else 0
    index_dir = Path(cfg["index_dir"])
    with np.load(cfg["queries"]) as z:
        qv, qt, ql = z["vecs"], z["toks"], z["lens"]  # token rows stay fp16 (widened per search)
    truth: list[int] = [int(t) for t in cfg["truth"]]
    tokens = index_dir / (late.compressed_name(nbits) if nbits else late.TOKENS_FILE)
    conf = late.LateConfig(candidates=cfg["candidates"], rerank_k=cfg["rerank_k"],
                           prefetch_at=0.0 if mode == "ssd-noprefetch" else 0.25 if mode == "ssd-prefetch-all"
                           else cfg["prefetch_at"], nprobe=cfg["nprobe"],
                           prefetch_k=cfg["candidates"] if mode == "ssd-prefetch-all" else None)
    probe = late.IvfProbe.load(index_dir / vindex.INDEX_FILE)
    tf = late.TokenFile(tokens)
    res: dict[str, Any] = {"mode": mode, "token_file_bytes": tokens.stat().st_size, "nprobe": probe.nprobe,
                           "nlist": probe.nlist, "passages": tf.n, "nbits": nbits,
                           "codec_bytes": tf.codec.nbytes() if tf.codec else 0}
    t = time.perf_counter()
    st = late.open_storage(storage, tf, threads=cfg["io_threads"],
                           mmap_advice="normal" if mode == "mmap-readahead" else "random")
    res["open_s"] = round(time.perf_counter() - t, 3)
    searcher = late.LateSearcher(probe, tf, st, conf)
    n = len(qv)

    def one(i: int, budget: float | None = None, c: late.LateConfig | None = None) -> late.SearchResult:
        return searcher.search(qv[i:i + 1], qt[i:i + 1], ql[i:i + 1], budget_s=budget, config=c)

    res["memory_before_run"] = proc_memory()
    if cg is not None:
        # The limit: this process' own peak anonymous memory under the
        # heaviest load it will see (the most client threads), measured
        # here, plus a margin, plus --mem-frac of the token file. So the page
        # cache can hold about that fraction of the file, whatever the
        # mode's own working memory is.
        peak = calibrate(cg, one, n, max(cfg["clients"]), cfg["calibrate_s"])
        limit = int(peak + cfg["mem_margin_mb"] * 2**20 + cfg["mem_frac"] * tf.size)
        st.evict()
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        (cg / "memory.max_usage_in_bytes").write_text("0")  # the peak from here on
        res.update({"cgroup_limit_bytes": limit, "cgroup_anon_peak_calibration": peak})
    else:
        for i in range(min(cfg["warmup"], n)):  # not measured
            one(n - 1 - i)
    if storage in ("mmap", "ssd"):
        st.evict()
        res["page_cache"] = "dropped (POSIX_FADV_DONTNEED) before the measured run"
    # 1. every query, one at a time, no budget
    lat, ids, single, rr, hits, tgt, arrived, pre = [], [], [], [], [], [], [], []
    for i in range(n):
        r = one(i)
        lat.append(r.total_s * 1e3)
        ids.append(r.ids[0])
        single.append(r.single_ids[0])
        rr.append(int(r.reranked[0]))
        tgt.append(int(r.target[0]))
        hits.append(int(r.hits[0]))
        arrived.append(int(r.arrived[0]))
        pre.append(int(r.prefetched[0]))
    res["sequential"] = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "mean_ms": float(np.mean(lat)),
                         "late": vindex.retrieval_metrics(np.array(ids), truth),
                         "single": vindex.retrieval_metrics(np.array(single), truth),
                         "reranked_mean": float(np.mean(rr)),
                         "prefetch_hit_rate": float(np.sum(hits) / max(1, np.sum(tgt))) if storage == "ssd" else None,
                         "prefetch_arrived_rate": float(np.sum(arrived) / max(1, np.sum(tgt)))
                         if storage == "ssd" else None,
                         "prefetched_mean": float(np.mean(pre)), "target_mean": float(np.mean(tgt))}
    res["ids_digest"] = int(np.array(ids).sum() % 1_000_000_007)
    # what the prefetch policy measured over the pass, and what it plans now
    res["prefetch"] = {"plan": searcher.prefetch_plan().why, **searcher.prefetch.state(),
                       "bandwidth_mb_s": None if st.bandwidth() == float("inf") else st.bandwidth() / 1e6,
                       "passage_kib": float(tf.nbytes.mean()) / 1024}
    # 2. closed loop, N client threads
    levels = []
    for clients in cfg["clients"]:
        flat, wall = closed_loop(one, n, clients, cfg["duration"])
        levels.append({"clients": clients, "answered": len(flat), "rate": len(flat) / wall,
                       "p50_ms": percentile(flat, 50), "p99_ms": percentile(flat, 99)})
    res["closed_loop"] = levels
    ok = [lv for lv in levels if lv["p99_ms"] <= cfg["slo_ms"]]
    best = max(ok, key=lambda lv: lv["rate"]) if ok else None
    res["throughput_at_slo"] = {"rate": best["rate"] if best else 0.0, "clients": best["clients"] if best else None,
                                "p99_ms": best["p99_ms"] if best else None}
    # 3. with a time budget
    if cfg["budget_ms"]:
        lat, ids, rr, tgt, cut = [], [], [], [], 0
        for i in range(n):
            r = one(i, budget=cfg["budget_ms"] / 1e3)
            lat.append(r.total_s * 1e3)
            ids.append(r.ids[0])
            rr.append(int(r.reranked[0]))
            tgt.append(int(r.target[0]))
            cut += int(r.cut[0])
        res["budget"] = {"budget_ms": cfg["budget_ms"], "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                         "reranked_mean": float(np.mean(rr)), "target_mean": float(np.mean(tgt)),
                         "cut_share": cut / n, "late": vindex.retrieval_metrics(np.array(ids), truth)}
    # 4. re-rank depth (ESPN-Lite): quality in RAM, latency on SSD
    if cfg["depths"] and mode in ("ram", "ssd", "ram-compressed", "ssd-compressed"):
        rows = []
        m = min(n, cfg["depth_queries"]) if storage == "ssd" else n
        for d in cfg["depths"]:
            c = late.LateConfig(candidates=cfg["candidates"], rerank_k=d, prefetch_at=conf.prefetch_at,
                                nprobe=cfg["nprobe"], prefetch_k=conf.prefetch_k)
            lat, ids = [], []
            for i in range(m):
                r = one(i, c=c)
                lat.append(r.total_s * 1e3)
                ids.append(r.ids[0])
            row: dict[str, Any] = {"rerank_k": d, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "queries": m}
            if m == n:
                row.update(vindex.retrieval_metrics(np.array(ids), truth))
            rows.append(row)
        res["depths"] = rows
    res["memory"] = proc_memory()
    res["probe_bytes"] = probe.nbytes
    res["table_bytes"] = int(tf.table.nbytes)
    if cg is not None:
        res["cgroup_max_usage_bytes"] = cgroup_read(cg, "memory.max_usage_in_bytes")
        res["cgroup_failcnt"] = cgroup_read(cg, "memory.failcnt")
        res["cgroup_stat"] = cgroup_stat(cg)
    st.close()
    return res


def closed_loop(one: Any, n: int, clients: int, seconds: float) -> tuple[list[float], float]:
    """``clients`` threads, each sending the next query as soon as it has
    its answer, for ``seconds``: (latencies in ms, wall seconds)."""
    stop = time.perf_counter() + seconds
    lats: list[list[float]] = [[] for _ in range(clients)]

    def loop(c: int) -> None:
        i = c * (n // clients)
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            one(i % n)
            lats[c].append((time.perf_counter() - t0) * 1e3)
            i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [x for xs in lats for x in xs], time.perf_counter() - t0


def calibrate(cg: Path, one: Any, n: int, clients: int, seconds: float) -> int:
    """Peak anonymous memory of the cgroup (memory.stat ``rss``, sampled
    every 5 ms) while ``clients`` closed-loop threads search for ``seconds``."""
    peak = [cgroup_stat(cg)["rss"]]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], cgroup_stat(cg)["rss"])
            time.sleep(0.005)

    th = threading.Thread(target=sample)
    th.start()
    try:
        closed_loop(one, n, clients, seconds)
    finally:
        done.set()
        th.join()
    return peak[0]


def run_child(cfg: dict[str, Any], use_cgroup: bool) -> dict[str, Any]:
    cg = None
    if use_cgroup:
        cg = CGROUP_ROOT / f"slipstream-espn-{os.getpid()}-{cfg['mode']}"
        cg.mkdir()
        cfg = {**cfg, "cgroup": str(cg)}
    proc = subprocess.Popen([sys.executable, "-m", "bench.espn", "--child", json.dumps(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | ONE_THREAD)
    try:
        out, err = proc.communicate(timeout=3600)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if r.returncode != 0:
            why = "killed by SIGKILL (the cgroup's OOM killer: its working memory did not fit the limit)" \
                if r.returncode == -9 and cg is not None else f"exit {r.returncode}"
            print(f"espn: {cfg['mode']}: failed, {why}:\n{r.stderr[-3000:]}", file=sys.stderr, flush=True)
            return {"mode": cfg["mode"], "failed": why}
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, SIGTERM, timeout): the cgroup cannot go while it lives
            proc.kill()
            proc.wait()
        if cg is not None:
            for _ in range(50):  # the child's charges move to the parent; the directory goes once it is empty
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


# ------------------------------------------------------------------ the parent

def prepare(small: int | None, threads: int, nbits: int) -> tuple[Path, Path, list[int]]:
    index_dir = vindex.prepare(small=small, threads=threads)
    late.ensure_tokens(index_dir, threads=threads)
    if nbits:
        late.ensure_compressed(index_dir, nbits=nbits, threads=threads)
    queries = corpus.load_queries()
    held = set(vindex.indexed_ids(index_dir).tolist())
    qs = [q for q in queries if q["passage_id"] in held]
    qfile = vindex.data_dir("rag") / f"late-queries-{len(queries)}.npz"
    late.query_embeddings([q["query"] for q in queries], qfile, threads=threads)
    if len(qs) != len(queries):  # a slice that lacks some right answers: keep the queries it can answer
        keep = [i for i, q in enumerate(queries) if q["passage_id"] in held]
        with np.load(qfile) as z:
            sub = {k: z[k][keep] for k in ("vecs", "toks", "lens")} | {"fingerprint": z["fingerprint"]}
        qfile = index_dir / "late-queries.npz"
        np.savez(qfile, **sub)
    return index_dir, qfile, [int(q["passage_id"]) for q in qs]


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


#: ESPN's headline ratios (Shrestha et al., ISMM 2024: abstract and evaluation): memory against keeping the
#: embeddings in RAM, and retrieval speed against memory-mapped files under memory pressure.
PAPER = {"memory_vs_ram": (5.0, 16.0), "speedup_vs_mmap": (3.1, 3.9)}


def ratios(modes: list[dict[str, Any]]) -> list[str]:
    """This run's figures beside the paper's ratios (where the modes they need ran)."""
    by = {m["mode"]: m for m in modes}
    out = []
    ram = by.get("ram")
    for ssd_mode in ("ssd", "ssd-compressed"):
        ssd = by.get(ssd_mode)
        if ram and ssd:
            out.append(f"- memory, peak resident of ram / {ssd_mode}: {ram['memory']['VmHWM'] / ssd['memory']['VmHWM']:.1f}x "
                       f"({mb(ram['memory']['VmHWM'])} vs {mb(ssd['memory']['VmHWM'])} MiB); "
                       f"ESPN reports {PAPER['memory_vs_ram'][0]:g}-{PAPER['memory_vs_ram'][1]:g}x less memory than RAM")
        mm = by.get("mmap")
        if mm and ssd:
            s, m = ssd["sequential"], mm["sequential"]
            rate = (f"; throughput at the SLO {ssd['throughput_at_slo']['rate']:.0f} ({ssd_mode}) vs "
                    f"{mm['throughput_at_slo']['rate']:.0f} (mmap) q/s")
            out.append(f"- speed, mmap / {ssd_mode} at the same memory limit: p50 {m['p50_ms'] / s['p50_ms']:.1f}x "
                       f"({m['p50_ms']:.1f} vs {s['p50_ms']:.1f} ms), p99 {m['p99_ms'] / s['p99_ms']:.1f}x{rate}; "
                       f"ESPN reports {PAPER['speedup_vs_mmap'][0]:g}-{PAPER['speedup_vs_mmap'][1]:g}x faster than mmap")
    return out


def report(result: dict[str, Any]) -> str:
    failed = [m for m in result["modes"] if "failed" in m]
    modes = [m for m in result["modes"] if "failed" not in m]
    ram = next((m for m in modes if m["mode"] == "ram"), None)
    fp16 = [m for m in modes if not m.get("nbits")]
    comp = next((m for m in modes if m.get("nbits")), None)
    seq = (fp16 or modes)[0]["sequential"]
    md = [f"# Late interaction (ESPN) on the Debian corpus{' (small slice)' if result['small'] else ''}", "",
          f"{result['passages']:,} passages, {result['queries']} queries; token file "
          f"{result['token_file_bytes'] / 2**20:,.0f} MiB (fp16, 4 KiB-aligned per passage); IVF nlist "
          f"{modes[0]['nlist']}, nprobe {modes[0]['nprobe']}; {result['config']['candidates']} candidates, "
          f"re-rank depth {result['config']['rerank_k'] or result['config']['candidates']}, prefetch after "
          f"{'a step the policy chose' if result['config']['prefetch_at'] is None else format(result['config']['prefetch_at'], '.0%') + ' of the probes'}"
          f" (ssd-prefetch-all: the whole depth after 25%); {result['config']['io_threads']} I/O threads. "
          f"Load average after: {result['load_after'][0]:.2f} (before: below).", "",
          "## Quality (1,000 benchmark queries)" if result["queries"] == 1000 else "## Quality", "",
          "| | recall@10 | MRR@10 |", "|---|---:|---:|",
          f"| single vector (IVF top 10) | {seq['single']['recall@10']:.3f} | {seq['single']['mrr@10']:.3f} |",
          f"| late interaction (MaxSim re-rank) | {seq['late']['recall@10']:.3f} | {seq['late']['mrr@10']:.3f} |"]
    if comp:
        cs = comp["sequential"]["late"]
        md.append(f"| late interaction, compressed tokens ({comp['nbits']}-bit residuals: "
                  f"{mb(comp['token_file_bytes'])} MiB file, {result['token_file_bytes'] / comp['token_file_bytes']:.1f}x "
                  f"smaller) | {cs['recall@10']:.3f} | {cs['mrr@10']:.3f} |")
    if ram and ram.get("depths"):
        md += ["", "Re-rank depth (ESPN-Lite: only the top k of the candidates re-ranked; quality from the RAM "
               "run, latency from the SSD run):", "", "| re-rank k | recall@10 | MRR@10 | SSD p50 ms | SSD p99 ms |",
               "|---:|---:|---:|---:|---:|"]
        ssd: dict[str, Any] = next((m for m in modes if m["mode"] == "ssd"), {})
        by_k = {d["rerank_k"]: d for d in ssd.get("depths", [])}
        for d in ram["depths"]:
            s = by_k.get(d["rerank_k"], {})
            md.append(f"| {d['rerank_k']} | {d.get('recall@10', float('nan')):.3f} | {d.get('mrr@10', float('nan')):.3f}"
                      f" | {s.get('p50_ms', float('nan')):.2f} | {s.get('p99_ms', float('nan')):.2f} |")
    slo = result["config"]["slo_ms"]
    md += ["", f"## Storage modes (SLO p99 {slo:.0f} ms; one search call per query, precomputed query embeddings)", "",
           "| mode | p50 ms | p99 ms | throughput at SLO (q/s, clients) | prefetch hit rate | peak RSS MiB "
           "(anon / file at end) | cgroup peak MiB (limit) | recall@10 | MRR@10 |",
           "|---|---:|---:|---|---:|---|---|---:|---:|"]
    for m in modes:
        s, mem, t = m["sequential"], m["memory"], m["throughput_at_slo"]
        hit = "-" if s["prefetch_hit_rate"] is None else \
            f"{s['prefetch_hit_rate']:.2f} ({s['prefetch_arrived_rate']:.2f} read; {s['prefetched_mean']:.0f} prefetched)"
        cgp = "-" if "cgroup_max_usage_bytes" not in m else \
            f"{mb(m['cgroup_max_usage_bytes'])} ({mb(m['cgroup_limit_bytes'])})"
        md.append(f"| {m['mode']} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {t['rate']:.0f} ({t['clients']}) | {hit} | "
                  f"{mb(mem['VmHWM'])} ({mb(mem['RssAnon'])} / {mb(mem['RssFile'])}) | {cgp} | "
                  f"{s['late']['recall@10']:.3f} | {s['late']['mrr@10']:.3f} |")
    for m in failed:
        md.append(f"| {m['mode']} | failed: {m['failed']} | | | | | | | |")
    md += ["", "Prefetch policy after the sequential pass (per-list probe time, precision of the partial top list "
           "at 1/8, 1/4, 1/2 of the lists, bandwidth, mean passage read; the plan):", ""]
    for m in modes:
        p = m.get("prefetch")
        if p and m["mode"].startswith("ssd"):
            per = "-" if p["per_list_ms"] is None else f"{p['per_list_ms']:.3f} ms a list"
            bw = "-" if p["bandwidth_mb_s"] is None else f"{p['bandwidth_mb_s']:.0f} MB/s"
            md.append(f"- {m['mode']}: {per}, precision {p['precision']}, {bw}, {p['passage_kib']:.1f} KiB a passage; "
                      f"{p['plan']}")
    md += ["", "Closed loop (clients: answered q/s, p99 ms):", ""]
    for m in modes:
        md.append(f"- {m['mode']}: " + "; ".join(f"{lv['clients']}: {lv['rate']:.0f} q/s, p99 {lv['p99_ms']:.1f}"
                                               for lv in m["closed_loop"]))
    if any("budget" in m for m in modes):
        b0 = next(m["budget"] for m in modes if "budget" in m)
        md += ["", f"## With a time budget of {b0['budget_ms']:g} ms per search", "",
               "| mode | p50 ms | p99 ms | re-ranked (of target) | searches cut | recall@10 | MRR@10 |",
               "|---|---:|---:|---|---:|---:|---:|"]
        for m in modes:
            b = m.get("budget")
            if b:
                md.append(f"| {m['mode']} | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | {b['reranked_mean']:.1f} "
                          f"({b['target_mean']:.1f}) | {b['cut_share']:.1%} | {b['late']['recall@10']:.3f} | "
                          f"{b['late']['mrr@10']:.3f} |")
    vs = ratios(modes)
    if vs:
        md += ["", "## Against the ESPN paper's ratios", ""] + vs
    md += ["", "Memory pressure: " + result["pressure"] + "."]
    for m in modes:
        if "cgroup_limit_bytes" in m:
            st = m["cgroup_stat"]
            md.append(f"- {m['mode']}: limit {mb(m['cgroup_limit_bytes'])} MiB (own peak anonymous "
                      f"{mb(m['cgroup_anon_peak_calibration'])} MiB); at the end the cgroup held "
                      f"{mb(st['cache'])} MiB of page cache (token file {mb(m['token_file_bytes'])} MiB), "
                      f"peak usage {mb(m['cgroup_max_usage_bytes'])} MiB, limit reached {m['cgroup_failcnt']:,} times")
    md += ["",
           "RAM mode holds the whole token file in anonymous memory; mmap and SSD modes hold the offsets table "
           f"({mb(modes[0]['table_bytes'])} MiB) and read buffers; every mode holds the IVF arrays "
           f"({mb(modes[0]['probe_bytes'])} MiB) and the query embeddings.",
           "", f"{'Small slice: a quick check, noisy' if result['small'] else 'Full corpus'} (command below)."]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, nargs="?", const=2000, default=None, metavar="N",
                    help="a slice of N passages (default 2000) instead of the full corpus")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"storage modes, of {','.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    ap.add_argument("--slo-ms", type=float, default=50.0, help="p99 target for throughput at the SLO (default 50)")
    ap.add_argument("--budget-ms", type=float, default=10.0, help="time budget of the deadline pass (0: skip)")
    ap.add_argument("--clients", default="1,2,4,8", help="closed-loop client threads per level (default 1,2,4,8)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per closed-loop level (default 8)")
    ap.add_argument("--candidates", type=int, default=100, help="single-vector candidates (default 100)")
    ap.add_argument("--rerank-k", type=int, default=None, help="re-rank depth (default: every candidate)")
    ap.add_argument("--depths", default="0,10,20,50,100", help="re-rank depths for the ESPN-Lite table")
    ap.add_argument("--depth-queries", type=int, default=300, help="queries per depth in the SSD latency sweep")
    ap.add_argument("--prefetch-at", type=float, default=None,
                    help="prefetch step, a fraction of nprobe (default: chosen by the prefetch policy)")
    ap.add_argument("--nprobe", type=int, default=None, help="IVF lists probed (default: the index's tuned value)")
    ap.add_argument("--io-threads", type=int, default=8, help="O_DIRECT reader threads (default 8)")
    ap.add_argument("--nbits", type=int, default=2, choices=(1, 2, 4),
                    help="bits per dimension of the compressed modes' residuals (default 2)")
    ap.add_argument("--mem-frac", type=float, default=0.25,
                    help="cgroup limit: the process' own peak anonymous memory (measured) + a margin + this "
                         "fraction of the token file (default 0.25)")
    ap.add_argument("--mem-margin-mb", type=float, default=32, help="cgroup limit: the margin (default 32 MiB)")
    ap.add_argument("--calibrate-s", type=float, default=3.0,
                    help="seconds of closed-loop load (the most clients) measuring the peak anonymous memory")
    ap.add_argument("--no-cgroup", action="store_true", help="only drop the page cache, no cgroup memory limit")
    ap.add_argument("--warmup", type=int, default=50, help="unmeasured queries first (default 50)")
    ap.add_argument("--threads", type=int, default=2, help="threads for building embeddings (default 2)")
    ap.add_argument("--out", type=Path, default=None, help="results path without suffix "
                    "(default bench/results/espn, or espn_small with --small)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: children killed, cgroups removed
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes takes a comma-separated subset of {','.join(MODES)}; got {a.modes!r}")
    try:
        clients = [int(c) for c in a.clients.split(",") if c.strip()]
        depths = [int(d) for d in a.depths.split(",") if d.strip()]
    except ValueError:
        ap.error("--clients and --depths take comma-separated integers")
    if not clients or min(clients) < 1 or (depths and min(depths) < 0):
        ap.error("--clients must be >= 1 and --depths >= 0")
    if (a.prefetch_at is not None and not 0 <= a.prefetch_at < 1) or not 0 < a.mem_frac <= 1:
        ap.error("--prefetch-at must be in [0, 1) and --mem-frac in (0, 1]")
    out = a.out or RESULTS / ("espn_small" if a.small else "espn")

    machine = harness.machine()
    print(f"espn: load average before: {machine['loadavg_before']}", file=sys.stderr)
    index_dir, qfile, truth = prepare(a.small, a.threads, a.nbits if any(m.endswith("-compressed") for m in modes) else 0)
    why_not = None if not a.no_cgroup else "--no-cgroup"
    why_not = why_not or cgroup_available()
    pressure = ("page cache of the token file dropped before the mmap and SSD runs "
                "(POSIX_FADV_DONTNEED)" + ("; cgroup-v1 memory limit (memory.limit_in_bytes) on the mmap and SSD "
                                           f"processes: their own peak anonymous memory (measured under {max(clients)} "
                                           f"closed-loop clients for {a.calibrate_s:g} s first) + {a.mem_margin_mb:g} MiB"
                                           f" + {a.mem_frac:.0%} of the token file, so the page cache can keep about "
                                           "that fraction of the file" if why_not is None else f"; no cgroup limit ({why_not})"))
    cfg = {"index_dir": str(index_dir), "queries": str(qfile), "truth": truth, "candidates": a.candidates,
           "rerank_k": a.rerank_k, "prefetch_at": a.prefetch_at, "nprobe": a.nprobe, "io_threads": a.io_threads,
           "mem_frac": a.mem_frac, "mem_margin_mb": a.mem_margin_mb, "calibrate_s": a.calibrate_s,
           "warmup": a.warmup, "clients": clients, "duration": a.duration,
           "slo_ms": a.slo_ms, "budget_ms": a.budget_ms, "depths": depths, "depth_queries": a.depth_queries,
           "nbits": a.nbits}
    results = []
    for mode in modes:
        print(f"espn: {mode} ...", file=sys.stderr, flush=True)
        r = run_child({**cfg, "mode": mode}, use_cgroup=why_not is None and not mode.startswith("ram"))
        results.append(r)
        if "failed" in r:
            continue
        s = r["sequential"]
        print(f"espn: {mode}: p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, throughput at SLO "
              f"{r['throughput_at_slo']['rate']:.0f} q/s, peak RSS {mb(r['memory']['VmHWM'])} MiB, "
              f"MRR@10 {s['late']['mrr@10']:.3f}", file=sys.stderr, flush=True)
    done = [r for r in results if "failed" not in r]
    if not done:
        print("espn: every mode failed", file=sys.stderr)
        return 1
    # Modes over the same token file must answer the same passages (compressed ones differ from fp16).
    digests = {r["mode"]: r["ids_digest"] for r in done}
    same = all(len({r["ids_digest"] for r in done if r["nbits"] == b}) == 1 for b in {r["nbits"] for r in done})
    load_after = os.getloadavg()
    fp16 = next((r for r in done if not r["nbits"]), done[0])
    result = {"small": a.small or 0, "passages": done[0]["passages"], "queries": len(truth),
              "token_file_bytes": fp16["token_file_bytes"], "modes": results, "pressure": pressure,
              "same_answers_in_every_mode": same, "config": cfg | {"truth": None},
              "load_after": load_after, "paper": PAPER}
    md = report(result)
    if not result["same_answers_in_every_mode"]:
        md += f"\nWARNING: the modes' answers differ (digests {digests}).\n"
    harness.write_results(out, result, md, machine)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
