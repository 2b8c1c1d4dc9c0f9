"""The speech parts of the AudioQuery example (examples/models/speech.py):
word error rate, text normalization, audio helpers, and real round trips
text -> espeak-ng -> pocketsphinx -> text.

espeak-ng (Debian package) and pocketsphinx (PyPI, ships its English model)
must be installed: the round-trip tests fail with the install command if
they are not (`python examples/models/speech.py` checks both).
"""

from __future__ import annotations

import io
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))

from models import speech  # noqa: E402

# ------------------------------------------------------------ word error rate


def test_edit_distance() -> None:
    assert speech.edit_distance([], []) == 0
    assert speech.edit_distance(["a", "b"], []) == 2
    assert speech.edit_distance([], ["a", "b", "c"]) == 3
    assert speech.edit_distance("a b c".split(), "a b c".split()) == 0
    assert speech.edit_distance("a b c".split(), "a x c".split()) == 1  # substitution
    assert speech.edit_distance("a b c".split(), "a c".split()) == 1  # deletion
    assert speech.edit_distance("a b c".split(), "a b b c".split()) == 1  # insertion
    assert speech.edit_distance("kitten sat down".split(), "sitting sat".split()) == 2
    # symmetric, and at most the longer length
    r, h = "the cat sat on the mat".split(), "a cat sit on mat today".split()
    assert speech.edit_distance(r, h) == speech.edit_distance(h, r) == 4


def test_wer() -> None:
    assert speech.wer("the digital audio workstation", "the digital audio workstation") == 0.0
    assert speech.wer("the digital audio workstation", "a digital audio workstation") == 0.25
    assert speech.wer("podcast client", "pod cast clients and more") == 2.5  # can exceed 1
    assert speech.wer("", "") == 0.0 and speech.wer("", "noise") == 1.0
    # normalization: case, punctuation, hyphens, digits spelled out
    assert speech.wer("Toolkit for the Git pkt-line format (library)", "toolkit for the git pkt line format library") == 0
    assert speech.wer("Python 3 module for ROS 2", "python three module for ros two") == 0
    # corpus WER weights by reference length, unlike the mean of per-utterance WERs
    refs, hyps = ["a b c d e f g h", "x y"], ["a b c d e f g h", "q"]
    assert speech.corpus_wer(refs, hyps) == pytest.approx(2 / 10)
    with pytest.raises(ValueError):
        speech.corpus_wer(["a"], [])


def test_normalize_and_number_words() -> None:
    assert speech.number_words(0) == "zero"
    assert speech.number_words(17) == "seventeen"
    assert speech.number_words(40) == "forty"
    assert speech.number_words(86) == "eighty six"
    assert speech.number_words(2048) == "two thousand forty eight"
    assert speech.number_words(1_000_001) == "one million one"
    assert speech.normalize_text("GTK+ x86_64, don't!") == ["gtk", "x", "eighty", "six", "sixty", "four", "don't"]


# ------------------------------------------------------------ audio helpers


def test_resample_keeps_a_tone() -> None:
    sr_in, f = 22050, 440.0
    t = np.arange(sr_in) / sr_in  # one second
    y = speech.resample(np.sin(2 * np.pi * f * t), sr_in, 16000)
    assert len(y) == 16000
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) - f) <= 1  # 1 Hz bins over one second
    assert np.max(np.abs(y)) == pytest.approx(1.0, abs=0.05)


def test_wav_round_trip_and_padding() -> None:
    x = (np.sin(np.arange(1000) / 5) * 10000).astype(np.int16)
    data = speech.write_wav(x)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, 1000)
    y, rate = speech.read_wav(data)
    assert rate == 16000 and y.dtype == np.int16
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(speech.load_audio(data), x)
    audio, lengths = speech.pad_batch([x, x[:10]], 2000)
    assert audio.shape == (2, 2000) and audio.dtype == np.int16 and lengths.dtype == np.int32
    assert lengths[:, 0].tolist() == [1000, 10]
    np.testing.assert_array_equal(audio[1, :10], x[:10])
    assert not audio[1, 10:].any()
    with pytest.raises(ValueError, match="more than"):
        speech.pad_batch([x], 999)


def test_install_check_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speech.shutil, "which", lambda _: None)
    with pytest.raises(speech.SpeechUnavailable, match="apt-get install -y espeak-ng"):
        speech.espeak_path()
    assert any("espeak-ng" in m for m in speech.missing())


# ------------------------------------------------------------ real speech


def test_espeak_speaks_16k_int16() -> None:
    x = speech.synthesize("hello world")
    assert x.dtype == np.int16 and x.ndim == 1
    assert 0.5 < len(x) / speech.SAMPLE_RATE < 3.0
    assert np.abs(x.astype(np.int32)).max() > 1000  # not silence
    longer = speech.synthesize("hello world, this sentence is clearly longer than the first one")
    assert len(longer) > 2 * len(x)
    data = speech.synthesize_wav("hi")
    assert data[:4] == b"RIFF" and speech.read_wav(data)[1] == speech.SAMPLE_RATE


def test_round_trip_general_language_model() -> None:
    """TTS -> ASR with the wheel's general English model, on sentences it
    can recognise; the bound is generous (these score ~0.2 here)."""
    said = ["the digital audio workstation", "tools to manage network connections",
            "a library for reading and writing compressed files"]
    rec = speech.Recognizer()
    heard = rec.transcribe_batch([speech.synthesize(s) for s in said])
    assert all(isinstance(h, str) for h in heard)
    assert speech.corpus_wer(said, heard) < 0.5, list(zip(said, heard, strict=True))
    assert rec.transcribe(np.zeros(8000, dtype=np.int16)) == ""  # silence: no words
    assert rec.transcribe(np.full(8000, speech.SILENCE_PEAK - 1, dtype=np.int16)) == ""
    assert rec.transcribe(np.zeros(0, dtype=np.int16)) == ""


def test_round_trip_domain_language_model(tmp_path: Path) -> None:
    """A language model trained on a small domain text (what the
    AudioQuery app does with the corpus) makes in-domain sentences that the
    general model garbles (WER > 0.7 there) come out nearly right, including
    a word no dictionary has ("gupnp"), pronounced as espeak-ng says it."""
    texts = [
        "A text editor for programmers. It highlights the syntax of many languages.",
        "Play music files from the command line. It supports playlists and streaming radio.",
        "Backup tool for remote servers: it copies only the files that changed, over a secure shell.",
        "Monitor system resources and processes in a terminal.",
        "The GUPnP library finds network devices. Programs use GUPnP to talk to routers.",
        "Version 2 of the library adds support for reading compressed files.",
    ]
    lm = speech.build_lm(texts, tmp_path / "domain.lm.bin")
    dic = lm.with_suffix(".dict")
    assert lm.is_file() and dic.is_file()
    entries = dict(line.split(" ", 1) for line in dic.read_text().splitlines())
    assert "gupnp" in entries and "programmers" in entries and "zebra" not in entries  # just the model's words
    said = ["a text editor for programmers", "play music files from the command line",
            "backup tool for remote servers", "the gupnp library finds network devices"]
    heard = speech.Recognizer(lm, dic).transcribe_batch([speech.synthesize(s) for s in said])
    assert speech.corpus_wer(said, heard) <= 0.25, list(zip(said, heard, strict=True))
    assert "gupnp" in heard[3]
    with pytest.raises(ValueError, match="no language-model text"):
        speech.build_lm(["zzqx qqzx"], tmp_path / "empty.lm.bin")


def test_espeak_pronunciations_use_the_acoustic_models_phones() -> None:
    from pocketsphinx import get_model_path

    with open(get_model_path("en-us/cmudict-en-us.dict"), encoding="utf-8") as f:
        cmudict = [line.split() for line in f]
    phones = {p for entry in cmudict for p in entry[1:]}  # the acoustic model's phones
    known = {" ".join(e[1:]) for e in cmudict if e[0] in ("cat", "xylophone")}
    got = speech.espeak_pronunciations(["cat", "xylophone", "xmllint", "gupnp", ""])
    assert set(got) == {"cat", "xylophone", "xmllint", "gupnp"}
    assert got["cat"] in known and got["xylophone"] in known  # espeak-ng agrees with CMUdict on plain words
    assert got["xmllint"].startswith("EH K S EH M")  # "x m l lint", spelled out as espeak-ng says it
    for p in got.values():
        assert set(p.split()) <= phones


def test_lm_sentences_cut_at_unknown_words() -> None:
    vocab = {"a", "library", "for", "parsing", "documents", "two"}
    got = list(speech.lm_sentences(["A library for parsing XML documents. For 2 documents! Two"], vocab))
    # "xml" is unknown: the sentence is cut there and "documents" alone is
    # dropped; digits are spelled out; sentences are split at punctuation.
    assert got == ["a library for parsing", "for two documents"]
