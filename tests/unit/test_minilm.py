"""The MiniLM text encoder of examples/models/minilm.py: the ONNX graph built
from the safetensors weights must compute what the model computes.

Three independent checks, none needing torch:
- ONNX (batched, padded, masked) vs a float64 numpy forward pass (one
  sentence at a time, unpadded);
- both vs a fingerprint of sentence-transformers' own output for the same
  sentences (first 8 dimensions and all pairwise cosines, recorded once
  with sentence-transformers 6.2 / torch 2.15 on CPU);
- meaning: paraphrases are closer than unrelated sentences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from models import minilm  # noqa: E402

# `make setup` installs the model; without it these tests fail with its message.
minilm.model_dir()

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~360 tokens: truncated at 256
ST_SENTENCES = [
    "A man is playing a guitar.",
    "Someone strums an acoustic guitar on stage.",
    "The stock market fell sharply on Monday.",
    "library for reading and writing compressed zip archives",
    "Debian GNU/Linux: command-line utility to convert images between formats (PNG, JPEG, GIF).",
    "x",
    LONG,
]
# sentence-transformers' embeddings of ST_SENTENCES: the first 8 dimensions...
ST_HEAD = [
    [0.021664, -0.004864, -0.009649, -0.063401, -0.167494, 0.004676, 0.080600, -0.024142],
    [0.045590, 0.056341, -0.052487, -0.080097, -0.116836, 0.040457, 0.035879, 0.004710],
    [0.045246, -0.013580, 0.069360, 0.037988, -0.017809, 0.021027, -0.061489, 0.050969],
    [-0.075784, 0.056548, -0.110325, 0.056738, -0.018143, -0.021444, -0.033112, 0.032094],
    [0.012641, -0.028679, -0.071066, -0.049178, 0.085733, -0.115541, -0.065078, 0.065282],
    [-0.097910, -0.064001, -0.023181, -0.046197, 0.021700, -0.028492, 0.154854, 0.054404],
    [0.052869, -0.037107, 0.071428, 0.004930, -0.060187, -0.016994, -0.018774, -0.074810],
]
# ... and their pairwise cosines.
ST_COS = [
    [1.000001, 0.587960, -0.061473, -0.092722, -0.035600, -0.049439, -0.078366],
    [0.587960, 1.000001, -0.054725, -0.165047, 0.007475, 0.009057, -0.039054],
    [-0.061473, -0.054725, 1.000001, -0.001973, -0.000917, -0.048109, 0.087643],
    [-0.092722, -0.165047, -0.001973, 1.000000, 0.224546, 0.086463, 0.058900],
    [-0.035600, 0.007475, -0.000917, 0.224546, 1.000000, 0.039191, 0.060412],
    [-0.049439, 0.009057, -0.048109, 0.086463, 0.039191, 1.000001, 0.134715],
    [-0.078366, -0.039054, 0.087643, 0.058900, 0.060412, 0.134715, 1.000000],
]


@pytest.fixture(scope="module")
def encoder() -> minilm.TextEncoder:
    return minilm.TextEncoder(threads=1)


@pytest.fixture(scope="module")
def onnx_st(encoder: minilm.TextEncoder) -> np.ndarray:
    return encoder.encode(ST_SENTENCES)


@pytest.fixture(scope="module")
def numpy_st() -> np.ndarray:
    return minilm.numpy_encode(ST_SENTENCES)


def test_output_shape_dtype_and_unit_norm(onnx_st: np.ndarray) -> None:
    assert onnx_st.shape == (len(ST_SENTENCES), minilm.DIM) and onnx_st.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(onnx_st, axis=1), 1.0, atol=1e-5)


def test_onnx_agrees_with_numpy(onnx_st: np.ndarray, numpy_st: np.ndarray) -> None:
    cos = (onnx_st * numpy_st).sum(axis=1)
    assert cos.min() > 0.9999, cos
    assert np.abs(onnx_st - numpy_st).max() < 1e-4


@pytest.mark.parametrize("which", ["onnx", "numpy"])
def test_matches_sentence_transformers_fingerprint(which: str, onnx_st: np.ndarray, numpy_st: np.ndarray) -> None:
    e = onnx_st if which == "onnx" else numpy_st
    np.testing.assert_allclose(e[:, :8], np.array(ST_HEAD), atol=1e-4)
    np.testing.assert_allclose(e @ e.T, np.array(ST_COS), atol=1e-4)


def test_truncation_is_at_256_tokens(onnx_st: np.ndarray) -> None:
    # The shipped tokenizer.json truncates at 128; the model is meant to see 256.
    short = minilm.TextEncoder(max_length=128).encode([LONG])[0]
    assert np.abs(short - onnx_st[-1]).max() > 1e-2
    np.testing.assert_allclose(onnx_st[-1, :8], ST_HEAD[-1], atol=1e-4)  # sentence-transformers: 256


def test_padding_does_not_change_embeddings(encoder: minilm.TextEncoder) -> None:
    alone = encoder.encode(["x"])
    padded = encoder.encode(["x", LONG, "a somewhat longer sentence than x"])
    np.testing.assert_allclose(alone[0], padded[0], atol=1e-5)


def test_input_order_is_kept(encoder: minilm.TextEncoder) -> None:
    texts = ["long " * 50, "b", "medium length text", "c c"]
    e = encoder.encode(texts)
    for i, t in enumerate(texts):
        np.testing.assert_allclose(e[i], encoder.encode([t])[0], atol=1e-5)
    assert encoder.encode([]).shape == (0, minilm.DIM)
    np.testing.assert_allclose(encoder.encode(np.array(["b", "c c"], dtype=object)), e[[1, 3]], atol=1e-5)


def test_paraphrases_are_closer_than_unrelated(encoder: minilm.TextEncoder) -> None:
    pairs = [
        ("How do I reset my password?", "I forgot my password and need to change it."),
        ("tool to compress files into zip archives", "utility for creating zip files"),
        ("The cat sat on the mat.", "A cat was sitting on a rug."),
        ("library for parsing XML documents", "XML parser library"),
    ]
    a = encoder.encode([p[0] for p in pairs])
    b = encoder.encode([p[1] for p in pairs])
    sim = a @ b.T  # sim[i, j]: sentence i vs paraphrase of j
    for i in range(len(pairs)):
        others = np.delete(sim[i], i)
        assert sim[i, i] > others.max() + 0.1, (pairs[i], sim[i])
        assert sim[i, i] > 0.5


def test_tokenizer_pads_to_longest_and_truncates(encoder: minilm.TextEncoder) -> None:
    ids, mask = encoder.tokenize(["hello", "hello world, how are you today?"])
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    n_short, n_long = mask.sum(axis=1)
    assert ids.shape == (2, n_long)  # padded to the longest in the batch, not to a fixed 128
    assert n_short == 3  # [CLS] hello [SEP]
    assert ids[0, 0] == ids[1, 0] == 101 and ids[0, 2] == 102  # [CLS], [SEP]
    assert (ids[0, 3:] == 0).all() and (mask[0, 3:] == 0).all()  # [PAD] = 0, masked
    ids, mask = encoder.tokenize([LONG])
    assert ids.shape == (1, 256) and mask.all() and ids[0, -1] == 102
    assert encoder.token_counts(["hello", LONG]).tolist() == [3, 256]


def test_onnx_graph_is_cached() -> None:
    path = minilm.build_onnx()
    assert path.is_file() and path.name == minilm.ONNX_NAME
    mtime = path.stat().st_mtime_ns
    assert minilm.build_onnx() == path and path.stat().st_mtime_ns == mtime


def test_bad_max_length_is_refused() -> None:
    with pytest.raises(ValueError, match="max_length"):
        minilm.load_tokenizer(1000)
