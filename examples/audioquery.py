"""AudioQuery: ask a question by voice, hear the answer. Speech in, speech out.

    .venv/bin/slipstream serve examples/audioquery.py
    .venv/bin/python examples/audioquery_client.py --url http://127.0.0.1:8000 -n 100 --out answers/

Stages (a chain; each stage passes on what later stages or the response need):

1. ``ASR`` (pocketsphinx): ``audio`` + ``length`` -> ``transcript``.
2. ``Embed`` (all-MiniLM-L6-v2): ``transcript`` -> ``embedding`` (384-d unit vector).
3. ``Search`` (faiss IVF over ~39k Debian package descriptions, see
   ``models.vindex``): -> top-k ``ids``, ``scores`` and the passages' own
   embeddings ``vectors`` (k, 384), read back from the index.
4. ``Filter``: a zero-shot classifier puts each retrieved passage in one of
   ``LABELS`` (cosine similarity of its embedding to each label's
   description, embedded once with the same MiniLM), drops the passages of
   the categories the request excludes, and keeps the best one left:
   ``package``, ``category``, ``passage_id``, ``score`` and ``answer``, the
   text to speak (package name and the passage's first sentence, at most
   ``AQ_ANSWER_CHARS`` characters, to keep the response small).
5. ``Speak`` (espeak-ng): ``answer`` -> ``speech``, a 16 kHz mono 16-bit WAV file.

Request (one row per utterance; a request may carry several):
- ``audio`` int16 ``(rows, AQ_MAX_SECONDS * 16000)``: 16 kHz mono samples,
  zero-padded to the fixed length. Fixed, so that every request can share a
  batch with every other (requests whose trailing shapes differ cannot),
  and numeric, so the samples reach the ASR worker through shared memory
  without a copy. Longer utterances must be cut by the client.
- ``length`` int32 ``(rows, 1)``: how many of the samples are real.
- ``exclude`` string ``(rows,)``: categories (``LABELS``, comma-separated)
  whose passages must not be the answer; ``""`` excludes none.

Response: ``transcript`` (what the ASR heard: string), ``answer`` (string),
``package`` (string), ``category`` (string), ``passage_id`` int64 (rows, 1)
(-1 if every retrieved passage was excluded), ``score`` float32 (rows, 1),
``error`` (string, "" if none: e.g. an unknown category in ``exclude``; a
bad row is answered with its error rather than failing its whole batch)
and ``speech`` (bytes: the WAV; base64 in the pipeline API's JSON).

Speech recognition uses a language model trained on the passages of the
served index (not on the package summaries the benchmark queries are taken
from), with a pronunciation dictionary that adds the passages' words that
CMUdict lacks ("gupnp", "xmllint"), pronounced as espeak-ng's rules say
them; built once into ``<data>/asr/`` (~1 min for the full corpus, ~1 s for
a small slice). ``AQ_ASR_LM=general`` uses the wheel's general English model.
Word error rate on spoken benchmark queries (espeak-ng ``en-us+f5``):
0.42 on 200 through the served pipeline with the full index; through the
recognizer alone on 100: 0.44 (0.61 without the added words, ~1.0 with the
general model). The right package is the answer for 24% of the spoken
queries (top-1 of 39k passages), against 50% for the same queries typed.

The zero-shot filter agrees with the Debian section of 64% of the passages
whose section maps to a label (6,000 sampled); it is good at games (precision
0.68) and development (0.71), loose at fonts (0.17) and documentation
(0.11): passages of other kinds fall into those labels.

Latency on two cores shared with other work (load average 4-6), one
request at a time, 200 questions of 3.3 s: p50 1.0 s, p90 1.9 s, p99 3.0 s
(another run: p99 6.4 s), nearly all of it ASR (pocketsphinx, ~0.3 s per
second of speech here, mean 1.0 s; Embed 9 ms, Search 2 ms, Filter <1 ms,
Speak 83 ms). The default SLO is p99 5000 ms: the node drops requests that
can no longer meet theirs, and a tight SLO drops long questions after their
costly ASR (with 3000 ms, one of the first 30 was dropped at Embed).

Environment variables (read when the app is loaded, by the server and each worker):
- ``SLIPSTREAM_DATA``: data directory (default ``<repo>/data``).
- ``AQ_INDEX``: ``auto`` (full index if built, else the slice), ``full`` or ``small``.
- ``AQ_SLICE``: passages in the slice (default 2000); built at load if missing.
- ``AQ_TOPK``: passages retrieved before filtering (default 10).
- ``AQ_MAX_SECONDS``: longest utterance (default 8).
- ``AQ_ANSWER_CHARS``: longest spoken answer, package name aside (default 120).
- ``AQ_ASR_LM``: ``corpus`` (default) or ``general``.
- ``AQ_ASR_REPLICAS``: ASR replicas (default: planned by ``slipstream serve``;
  pocketsphinx uses one core each).
- ``AQ_VOICE``: espeak-ng voice of the answers (default ``en-us+f5``).
- ``AQ_SLO_MS``: the pipeline's p99 objective (default 5000).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np
import slipstream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import corpus, data_dir, speech, vindex  # noqa: E402
from models.minilm import DIM, ModelNotInstalled, TextEncoder  # noqa: E402

MODE = os.environ.get("AQ_INDEX", "auto").strip().lower()
SLICE = int(os.environ.get("AQ_SLICE", "2000"))
TOPK = int(os.environ.get("AQ_TOPK", "10"))
MAX_SECONDS = float(os.environ.get("AQ_MAX_SECONDS", "8"))
MAX_SAMPLES = int(MAX_SECONDS * speech.SAMPLE_RATE)
ANSWER_CHARS = int(os.environ.get("AQ_ANSWER_CHARS", "120"))
ASR_LM = os.environ.get("AQ_ASR_LM", "corpus").strip().lower()
ASR_REPLICAS = int(os.environ["AQ_ASR_REPLICAS"]) if os.environ.get("AQ_ASR_REPLICAS") else None  # None: planned
VOICE = os.environ.get("AQ_VOICE", speech.ANSWER_VOICE)
SLO_MS = float(os.environ.get("AQ_SLO_MS", "5000"))

if MODE not in ("auto", "full", "small"):
    raise ss.ConfigError(f"AQ_INDEX must be auto, full or small, not {MODE!r}")
if ASR_LM not in ("corpus", "general"):
    raise ss.ConfigError(f"AQ_ASR_LM must be corpus or general, not {ASR_LM!r}")

# The zero-shot classifier's labels: name -> descriptions, written in the
# style of the passages (Debian package descriptions). A label's vector is
# the normalized mean of its descriptions' embeddings; a passage belongs to
# the label whose vector is most similar to its own embedding.
LABELS: dict[str, tuple[str, ...]] = {
    "games": ("This package contains a game: an arcade, puzzle, strategy, card, board or role-playing game.",
              "A fun game for one or more players, with levels, scores and multiplayer."),
    "development": ("This package contains the development files: headers and static library for programmers.",
                    "A library module with bindings for Python, Perl, Go, Rust or JavaScript programs.",
                    "A shared library providing an API for applications."),
    "documentation": ("This package contains the documentation: the manual, user guide and API reference "
                      "in HTML or PDF.",),
    "fonts": ("A font family: typefaces and glyphs for displaying and printing text.",
              "This package contains TrueType and OpenType fonts."),
    "multimedia": ("Audio, music, sound and video: players, recorders, editors and codecs.",),
    "graphics": ("Images and graphics: image viewer, photo editing, drawing and 3D rendering.",),
    "network": ("Networking: a server or client for network protocols, the web, email and chat.",),
    "science": ("Scientific software for mathematics, statistics, physics, chemistry, biology or astronomy.",
                "A program for simulation and analysis of experimental data in scientific research."),
    "system": ("A system administration tool: command-line utilities, file systems, hardware, "
               "kernel and boot.",),
}


# ---------------------------------------------------------------------------
# Data: which index, the ASR language model


def index_dir() -> Path:
    """The index this app serves, per ``AQ_INDEX``."""
    return vindex.served_index_dir(MODE, SLICE, "AQ_INDEX")


def ensure_index() -> Path:
    """The index directory, building the slice if it is the one chosen and missing."""
    d = index_dir()
    if not vindex.is_built(d):
        try:
            vindex.prepare(small=SLICE, threads=2)
        except (corpus.CorpusError, ModelNotInstalled) as e:
            raise ss.ConfigError(f"cannot build the search index: {e}") from e
    return d


def ensure_lm() -> Path | None:
    """The ASR language model file (None: the wheel's general model),
    trained on the passages of the served index (all ~39k for the full
    index: ~25 s; a slice's own passages for a slice: ~1 s), cached in
    ``<data>/asr/`` by a fingerprint of those passages."""
    if ASR_LM == "general":
        return None
    try:
        held = vindex.indexed_ids(ensure_index())
        passages = corpus.load_passages()
    except (corpus.CorpusError, OSError) as e:
        raise ss.ConfigError(f"cannot build the ASR language model: {e}") from e
    texts = [passages[int(i)].text for i in held]
    path = data_dir("asr") / f"passages-{_fingerprint(texts)}.lm.bin"
    if not path.is_file():
        print(f"audioquery: training the ASR language model on {len(texts)} passages -> {path} ...",
              file=sys.stderr, flush=True)
        speech.build_lm(texts, path)
    return path


def _fingerprint(texts: list[str]) -> str:
    h = hashlib.sha1(b"asr-lm-v3")  # bump when build_lm changes
    for t in texts:
        h.update(t.encode("utf-8", "replace") + b"\0")
    return h.hexdigest()[:16]


def first_sentence(text: str, limit: int) -> str:
    """The first sentence of `text` without URLs, cut at a word boundary to
    at most `limit` characters (with "..." when cut)."""
    text = re.sub(r"\s*\(?\b(?:https?://|www\.)[^\s()]*[^\s().,;:]\)?", "", text)  # URLs are no fun to listen to
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])|\n", text.strip(), maxsplit=1)[0].strip()
    if len(first) <= limit:
        return first
    cut = first[: limit + 1].rsplit(" ", 1)[0].rstrip(",;:")
    return (cut or first[:limit]) + "..."


class ZeroShot:
    """Zero-shot classification by embedding similarity: each label's
    descriptions are embedded once and averaged; an embedding's label is
    the most similar label vector (cosine: all vectors are unit length)."""

    def __init__(self, encoder: TextEncoder, labels: dict[str, tuple[str, ...]] = LABELS):
        self.names = list(labels)
        vectors = []
        for descriptions in labels.values():
            v = np.asarray(encoder.encode(list(descriptions)), dtype=np.float32).mean(axis=0)
            vectors.append(v / np.linalg.norm(v))
        self.label_vectors = np.stack(vectors)

    def scores(self, vectors: np.ndarray) -> np.ndarray:
        """(..., n_labels) cosine similarities."""
        return np.asarray(vectors, dtype=np.float32) @ self.label_vectors.T

    def classify(self, vectors: np.ndarray) -> np.ndarray:
        """(...) label indices."""
        return self.scores(vectors).argmax(axis=-1)

    def parse_exclude(self, value: str) -> set[int]:
        """Label indices named in a comma-separated list; ValueError names unknown ones."""
        names = [n.strip().lower() for n in str(value).split(",") if n.strip()]
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))} "
                             f"(known: {', '.join(self.names)})")
        return {self.names.index(n) for n in names}


# ---------------------------------------------------------------------------
# Components

STR = ss.Tensor("string", (-1,))


@ss.component(max_batch_size=8, replicas=ASR_REPLICAS,
              inputs={"audio": ss.Tensor("int16", (-1, MAX_SAMPLES)), "length": ss.Tensor("int32", (-1, 1)),
                      "exclude": STR},
              outputs={"transcript": STR, "exclude": STR})
class ASR:
    """Speech -> text with pocketsphinx. A batch is decoded one utterance
    after another (pocketsphinx has no batched decoding)."""

    def __init__(self) -> None:
        lm = ensure_lm()
        self.recognizer = speech.Recognizer(lm_file=lm, dict_file=None if lm is None else lm.with_suffix(".dict"))

    def __call__(self, batch: ss.Batch) -> dict:
        audio, length = batch["audio"], batch["length"][:, 0]
        n = np.clip(length, 0, audio.shape[1])
        text = np.array([self.recognizer.transcribe(audio[i, : n[i]]) for i in range(batch.rows)], dtype=object)
        return {"transcript": text, "exclude": batch["exclude"]}


@ss.component(max_batch_size=32, inputs={"transcript": STR, "exclude": STR},
              outputs={"embedding": ss.Tensor("float32", (-1, DIM)), "transcript": STR, "exclude": STR},
              length_of="transcript")
class Embed:
    """Transcript -> unit-norm MiniLM embedding."""

    def __init__(self) -> None:
        self.encoder = TextEncoder(threads=1)
        self.encoder.encode(["warm up"])

    def __call__(self, batch: ss.Batch) -> dict:
        return {"embedding": self.encoder.encode(batch["transcript"]), "transcript": batch["transcript"],
                "exclude": batch["exclude"]}


@ss.component(max_batch_size=64,
              outputs={"ids": ss.Tensor("int64", (-1, TOPK)), "scores": ss.Tensor("float32", (-1, TOPK)),
                       "vectors": ss.Tensor("float32", (-1, TOPK, DIM)), "transcript": STR, "exclude": STR})
class Search:
    """Embedding -> the top-k passages of the IVF index, with their embeddings."""

    def __init__(self) -> None:
        import faiss

        d = ensure_index()
        vindex.configure_faiss(1)
        self.index = vindex.VectorIndex.load(d)
        # Vectors by passage id (the ids are not positions): a hash-table direct map.
        self.index.index.set_direct_map_type(faiss.DirectMap.Hashtable)

    def __call__(self, batch: ss.Batch) -> dict:
        scores, ids = self.index.search(batch["embedding"], TOPK)
        vectors = np.zeros((*ids.shape, DIM), dtype=np.float32)
        found = ids >= 0
        if found.any():
            vectors[found] = self.index.index.reconstruct_batch(np.ascontiguousarray(ids[found]))
        return {"ids": ids, "scores": scores, "vectors": vectors, "transcript": batch["transcript"],
                "exclude": batch["exclude"]}


@ss.component(max_batch_size=64,
              outputs={"answer": STR, "package": STR, "category": STR, "passage_id": ss.Tensor("int64", (-1, 1)),
                       "score": ss.Tensor("float32", (-1, 1)), "error": STR, "transcript": STR})
class Filter:
    """Drop retrieved passages of excluded categories (zero-shot classified
    from their embeddings); keep the best remaining one as the answer."""

    def __init__(self) -> None:
        self.classifier = ZeroShot(TextEncoder(threads=1))
        self.passages = corpus.load_passages()

    def __call__(self, batch: ss.Batch) -> dict:
        ids, scores = batch["ids"], batch["scores"]
        labels = self.classifier.classify(batch["vectors"])  # (rows, k)
        n = batch.rows
        out = {k: np.full(n, "", dtype=object) for k in ("answer", "package", "category", "error")}
        passage_id = np.full((n, 1), -1, dtype=np.int64)
        score = np.zeros((n, 1), dtype=np.float32)
        for i in range(n):
            try:
                excluded = self.classifier.parse_exclude(batch["exclude"][i])
            except ValueError as e:
                out["error"][i] = str(e)
                out["answer"][i] = "Sorry, I do not know that category."
                continue
            keep = [j for j in range(ids.shape[1]) if ids[i, j] >= 0 and labels[i, j] not in excluded]
            if not keep:
                out["answer"][i] = "Sorry, I found nothing outside the excluded categories."
                continue
            j = keep[0]
            p = self.passages[int(ids[i, j])]
            passage_id[i, 0], score[i, 0] = p.id, scores[i, j]
            out["package"][i] = p.package
            out["category"][i] = self.classifier.names[labels[i, j]]
            out["answer"][i] = f"{p.package}: {first_sentence(p.text, ANSWER_CHARS)}"
        return {**out, "passage_id": passage_id, "score": score, "transcript": batch["transcript"]}


@ss.component(max_batch_size=16,
              outputs={"speech": ss.Tensor("bytes", (-1,)), "answer": STR, "package": STR, "category": STR,
                       "passage_id": ss.Tensor("int64", (-1, 1)), "score": ss.Tensor("float32", (-1, 1)),
                       "error": STR, "transcript": STR})
class Speak:
    """Answer text -> a 16 kHz mono WAV file, with espeak-ng (one process per row).

    It streams: the text answer goes out at once as a first chunk (with
    empty ``speech``), so a client of ``/stream`` can show it while the
    speech is synthesised; the stage's output (what a plain call returns)
    is the whole answer with its speech."""

    def __init__(self) -> None:
        speech.espeak_path()  # fail at start-up, with how to install it, if missing
        self.voice = VOICE

    def __call__(self, batch: ss.Batch):
        passthrough = ("answer", "package", "category", "passage_id", "score", "error", "transcript")
        text = {k: batch[k] for k in passthrough}
        yield {"speech": np.array([b""] * batch.rows, dtype=object), **text}
        wavs = np.array([speech.synthesize_wav(t, self.voice) for t in batch["answer"]], dtype=object)
        return {"speech": wavs, **text}


if __name__.startswith("slipstream_app_") and os.environ.get("SLIPSTREAM_WORKER") != "1":
    # `slipstream serve` is loading the app: check the tools and build the
    # index slice and the language model now, once, with progress on the
    # terminal, rather than in several workers at once.
    problems = speech.missing()
    if problems:
        raise ss.ConfigError("audioquery: " + "; ".join(problems))
    ensure_index()
    ensure_lm()

#: The spoken request profiles measure with (see `spoken_example`).
EXAMPLE_QUERY = "a tool to configure a reverse proxy with TLS termination"


def spoken_example() -> dict[str, list]:
    """One spoken query (espeak-ng, as the client speaks them): the request
    `slipstream profile` and first-start sizing run the stages on. Without
    it they would give ASR synthetic silence, which it decodes in no time,
    and the plan would size the pipeline's most expensive stage as free."""
    clip = speech.synthesize(EXAMPLE_QUERY)[:MAX_SAMPLES]
    audio, length = speech.pad_batch([clip], MAX_SAMPLES)
    return {"audio": audio.tolist(), "length": length.tolist(), "exclude": [""]}


# ASR is nearly all of the cost: once it is spent, a late answer beats none.
audioquery = ss.Pipeline(
    "audioquery", ASR >> Embed >> Search >> Filter >> Speak, slo=ss.SLO(p99_ms=SLO_MS, drop_late=False),
    example=spoken_example,
)
