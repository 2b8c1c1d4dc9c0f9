"""The AudioQuery example (examples/audioquery.py) end to end through a real
node: spoken questions (espeak-ng) -> pocketsphinx -> MiniLM -> faiss ->
zero-shot category filter -> espeak-ng answers, on a small slice of the
Debian package-description corpus (shared with test_rag.py; built on first
run and reused).

Needs espeak-ng (apt) and pocketsphinx (pip) besides the RAG example's
packages; the ASR language model for the slice is trained at start-up on the
slice's passages (~1 s) and cached in the data directory.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import slipstream as ss

from tests.conftest import ROOT, Node

sys.path.insert(0, str(ROOT / "examples"))

from models import speech, vindex  # noqa: E402

SLICE = 300  # the same slice as test_rag.py, so it is built once
ENV = {"AQ_INDEX": "small", "AQ_SLICE": str(SLICE), "AQ_SLO_MS": "20000"}
ALL_LABELS = ("games", "development", "documentation", "fonts", "multimedia", "graphics", "network", "science", "system")



@pytest.fixture(scope="module")
def slice_dir() -> Path:
    return vindex.prepare(small=SLICE, threads=2)


@pytest.fixture(scope="module")
def node(slice_dir: Path) -> Iterator[Node]:
    problems = speech.missing()
    assert not problems, problems  # says how to install them
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        n = Node(str(ROOT / "examples" / "audioquery.py"))
        try:
            n.wait_ready(180)
            yield n
        finally:
            n.stop()


@pytest.fixture(scope="module")
def queries(slice_dir: Path) -> list[dict]:
    return vindex.held_queries(slice_dir)


@pytest.fixture(scope="module")
def width(node: Node) -> int:
    status, desc = node.get("/v1/pipelines/audioquery")
    assert status == 200
    return int(desc["inputs"]["audio"]["shape"][1])


def ask(node: Node, clips: list[np.ndarray], width: int, exclude: list[str]) -> dict:
    audio, length = speech.pad_batch(clips, width)
    status, body = node.infer("audioquery", audio=audio.tolist(), length=length.tolist(), exclude=exclude)
    assert status == 200, body
    return body["outputs"]


def test_spoken_questions_are_understood_and_answered(node: Node, queries: list[dict], width: int) -> None:
    qs = queries[:8]
    outs = [ask(node, [speech.synthesize(q["query"])], width, [""]) for q in qs]
    assert set(outs[0]) == {"transcript", "answer", "package", "category", "passage_id", "score", "error", "speech"}
    heard = [o["transcript"][0] for o in outs]
    assert all(isinstance(h, str) for h in heard)
    # pocketsphinx on espeak-ng speech with the slice's language model: ~0.4 here.
    wer = speech.corpus_wer([q["query"] for q in qs], heard)
    assert wer < 0.75, list(zip([q["query"] for q in qs], heard, strict=True))
    right = [o["passage_id"][0][0] == q["passage_id"] for o, q in zip(outs, qs, strict=True)]
    assert sum(right) >= 3, (heard, [o["package"][0] for o in outs])
    for o in outs:
        assert o["error"] == [""]
        answer = o["answer"][0]
        assert o["package"][0] and answer.startswith(o["package"][0] + ":")
        assert len(answer) <= len(o["package"][0]) + 2 + 120 + 3  # AQ_ANSWER_CHARS, "..."
        assert o["category"][0] in ALL_LABELS
        wav = base64.b64decode(o["speech"][0])
        samples, rate = speech.read_wav(wav)
        assert rate == 16000 and len(samples) > 8000
        assert wav == speech.synthesize_wav(answer)  # the spoken answer is the answer text (espeak is deterministic)


def test_the_answer_text_streams_before_its_speech(node: Node, queries: list[dict], width: int) -> None:
    audio, length = speech.pad_batch([speech.synthesize(queries[0]["query"])], width)
    exclude = np.array([""], dtype=object)
    with ss.Client(node.url) as c, c.stream("audioquery", {"audio": audio, "length": length,
                                                            "exclude": exclude}) as s:
        chunks = list(s)
    assert len(chunks) == 1 and chunks[0]["speech"][0] == b"" and chunks[0]["answer"][0]
    assert s.final is not None and s.final["answer"][0] == chunks[0]["answer"][0]
    assert s.final["speech"][0][:4] == b"RIFF"
    assert s.first_chunk_s is not None


def test_several_rows_and_length_is_respected(node: Node, queries: list[dict], width: int) -> None:
    a, b = (speech.synthesize(q["query"]) for q in queries[8:10])
    one = ask(node, [a], width, [""])
    # Two rows in one request; row 0 has loud noise after its end, which `length` must hide.
    audio, length = speech.pad_batch([a, b], width)
    rng = np.random.default_rng(0)
    audio[0, len(a):] = rng.integers(-20000, 20000, width - len(a), dtype=np.int16)
    status, body = node.infer("audioquery", audio=audio.tolist(), length=length.tolist(), exclude=["", ""])
    assert status == 200, body
    two = body["outputs"]
    assert len(two["transcript"]) == 2 and len(two["speech"]) == 2 and np.array(two["passage_id"]).shape == (2, 1)
    assert two["transcript"][0] == one["transcript"][0]
    assert two["passage_id"][0] == one["passage_id"][0]
    assert two["transcript"][1] == ask(node, [b], width, [""])["transcript"][0]


def test_exclude_filters_categories_per_request(node: Node, queries: list[dict], width: int) -> None:
    # A question whose top passages span more than one category (nearly any).
    for q in queries[1:6]:
        clip = speech.synthesize(q["query"])
        plain = ask(node, [clip], width, [""])
        category = plain["category"][0]
        out = ask(node, [clip] * 4, width, [category, "", "all of them", ",".join(ALL_LABELS)])
        if out["passage_id"][0][0] >= 0:
            break
    else:
        pytest.fail("excluding the top answer's category left no answer for any of 5 questions")
    # row 0: the category of the plain answer is excluded -> another passage of another category
    assert out["category"][0] != category and out["passage_id"][0] != plain["passage_id"][0]
    assert out["error"][0] == "" and out["score"][0][0] <= plain["score"][0][0] + 1e-6
    # row 1: same request, nothing excluded -> the plain answer
    assert out["passage_id"][1] == plain["passage_id"][0] and out["answer"][1] == plain["answer"][0]
    # row 2: an unknown category is that row's error, not the batch's
    assert "unknown category" in out["error"][2] and out["passage_id"][2] == [-1]
    # row 3: everything excluded -> no passage, said so
    assert out["passage_id"][3] == [-1] and out["error"][3] == "" and "nothing" in out["answer"][3]
    assert all(len(base64.b64decode(s)) > 1000 for s in out["speech"])


def test_silence_is_answered(node: Node, width: int) -> None:
    out = ask(node, [np.zeros(0, dtype=np.int16), np.zeros(16000, dtype=np.int16)], width, ["", ""])
    assert out["transcript"] == ["", ""] and out["error"] == ["", ""]
    assert all(len(base64.b64decode(s)) > 1000 for s in out["speech"])  # some answer, still spoken


def test_bad_audio_shape_is_refused(node: Node, width: int) -> None:
    status, body = node.infer("audioquery", audio=[[0] * (width - 1)], length=[[10]], exclude=[""])
    assert status == 400 and body["error"]["kind"] == "bad_input", body


def test_zero_shot_labels(slice_dir: Path) -> None:
    import audioquery
    from models.minilm import TextEncoder

    assert tuple(audioquery.LABELS) == ALL_LABELS
    zs = audioquery.ZeroShot(TextEncoder(threads=1))
    texts = {
        "fonts": "This package contains the DejaVu fonts, a font family based on the Bitstream Vera fonts.",
        "games": "A fast-paced arcade game where you shoot asteroids; reach the highest score.",
        "development": "This package contains the header files and static library for libfoo.",
        "science": "A program for molecular dynamics simulation of proteins in chemistry and biology.",
    }
    got = zs.classify(TextEncoder(threads=1).encode(list(texts.values())))
    assert [zs.names[i] for i in got] == list(texts)
    with pytest.raises(ValueError, match="unknown category 'nope'"):
        zs.parse_exclude("games, nope")
    assert zs.parse_exclude(" Games ,fonts,") == {zs.names.index("games"), zs.names.index("fonts")}
    assert zs.parse_exclude("") == set()


def test_first_sentence() -> None:
    import audioquery

    text = "Ardour is a recorder (https://ardour.org/x). It does more.\nSecond paragraph."
    assert audioquery.first_sentence(text, 160) == "Ardour is a recorder."
    assert audioquery.first_sentence("one two three four five six", 12) == "one two..."


def test_client_reports_wer_and_writes_answers(node: Node, slice_dir: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "audioquery_client.py"), "--url", node.url, "-n", "4",
         "--concurrency", "2", "--out", str(tmp_path), "--index-dir", str(slice_dir), "--json"],
        capture_output=True, text=True, timeout=120, env=os.environ | ENV,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["queries"] == 4 and 0 <= m["wer"] < 1.0 and m["errors"] == 0
    assert set(m["stages_ms"]) == {"ASR", "Embed", "Search", "Filter", "Speak"}
    assert m["latency_ms"]["p50"] > m["stages_ms"]["ASR"]["compute_mean"] > 0
    assert "WER" in r.stderr and "said:" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for i, row in enumerate(rows):
        assert speech.read_wav((tmp_path / f"{i:04d}-question.wav").read_bytes())[1] == 16000
        assert (tmp_path / f"{i:04d}-answer.wav").read_bytes() == speech.synthesize_wav(row["answer"])
