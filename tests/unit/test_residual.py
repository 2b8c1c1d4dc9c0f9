"""Residual compression of token embeddings (examples/models/residual.py)
and the compressed token file (examples/models/late.py): the bit layout
against a slow per-dimension reference, reconstruction quality rising with
the bits, the codec's bytes round-tripping and refusing damage, every
storage returning the records written, MaxSim over decoded records near
MaxSim over the originals, and the compressed file reused when current.

Small synthetic data (clustered unit vectors, as token states are): the
module runs in seconds.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from models import late, residual  # noqa: E402


@pytest.fixture()
def workdir() -> Iterator[Path]:
    """On the repository's filesystem: O_DIRECT is refused on tmpfs."""
    from models import data_dir

    d = Path(tempfile.mkdtemp(prefix="test-residual-", dir=data_dir("tmp")))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def clustered(n: int, dim: int, clusters: int = 24, spread: float = 0.35, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    x = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, dim)) * np.sqrt(dim / 16)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def slow_decode(codec: residual.ResidualCodec, records: np.ndarray) -> np.ndarray:
    """Per token, per dimension: the centroid plus the value of the dimension's
    code, codes packed lowest bits first after the centroid id and the
    inverse length; then unit length (computed here)."""
    out = np.zeros((len(records), codec.dim), np.float64)
    mask = (1 << codec.nbits) - 1
    for t, rec in enumerate(records):
        cid = int(rec[0]) | int(rec[1]) << 8
        for d in range(codec.dim):
            bit = d * codec.nbits
            code = (int(rec[4 + bit // 8]) >> (bit % 8)) & mask
            out[t, d] = codec.centroids[cid, d] + codec.values[d, code]
    return out / np.linalg.norm(out, axis=1, keepdims=True)


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_records_decode_as_the_bit_layout_says(nbits: int) -> None:
    x = clustered(600, 32, seed=nbits)
    codec = residual.ResidualCodec.train(x, nbits=nbits, k=16, threads=1)
    rec = codec.encode(x[:40])
    assert rec.shape == (40, 4 + 32 * nbits // 8) and rec.dtype == np.uint8
    np.testing.assert_allclose(codec.decode(rec), slow_decode(codec, rec), atol=2e-3)  # the stored length is fp16
    q = clustered(5, 32, seed=7).T
    np.testing.assert_allclose(codec.scores(rec, q), slow_decode(codec, rec) @ q, atol=2e-3)


def test_more_bits_reconstruct_closer_and_all_beat_the_centroid_alone() -> None:
    x = clustered(4000, 64)
    cos = {}
    for nbits in (1, 2, 4):
        codec = residual.ResidualCodec.train(x[:3000], nbits=nbits, k=32, threads=1)
        y = codec.decode(codec.encode(x[3000:]))  # vectors the codec was not trained on
        cos[nbits] = float(np.mean(np.sum(x[3000:] * y, axis=1)))
        assert np.allclose(np.linalg.norm(y, axis=1), 1.0, atol=1e-3)  # the stored inverse length is fp16
    c = codec.centroids[codec.encode(x[3000:])[:, 0].astype(np.intp) | codec.encode(x[3000:])[:, 1].astype(np.intp) << 8]
    centroid_only = float(np.mean(np.sum(x[3000:] * c / np.linalg.norm(c, axis=1, keepdims=True), axis=1)))
    assert centroid_only < cos[1] < cos[2] < cos[4], (centroid_only, cos)
    assert cos[2] > 0.95, cos


def test_codec_bytes_round_trip_and_damage_is_refused() -> None:
    codec = residual.ResidualCodec.train(clustered(500, 16), nbits=2, k=8, threads=1)
    raw = codec.to_bytes()
    back = residual.ResidualCodec.from_bytes(raw)
    for name in ("centroids", "cutoffs", "values"):
        np.testing.assert_array_equal(getattr(back, name), getattr(codec, name))
    rec = codec.encode(clustered(10, 16, seed=3))
    np.testing.assert_array_equal(back.decode(rec), codec.decode(rec))
    with pytest.raises(residual.CodecError, match="takes"):
        residual.ResidualCodec.from_bytes(raw[:-4])
    with pytest.raises(residual.CodecError, match="magic"):
        residual.ResidualCodec.from_bytes(b"X" + raw[1:])
    bad = bytearray(raw)
    bad[20:24] = (3).to_bytes(4, "little")  # nbits 3
    with pytest.raises(residual.CodecError, match="damaged"):
        residual.ResidualCodec.from_bytes(bytes(bad))
    with pytest.raises(residual.CodecError, match="nbits"):
        residual.ResidualCodec.train(clustered(100, 16), nbits=3)
    with pytest.raises(residual.CodecError, match="centroid 9"):
        r = rec.copy()
        r[0, :2] = (9, 0)
        codec.decode(r)
    with pytest.raises(residual.CodecError, match="records"):
        codec.decode(rec[:, 1:])


def make_file(workdir: Path, n: int = 50, dim: int = 64) -> tuple[late.TokenFile, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(5)
    ids = rng.permutation(np.arange(n) * 7 + 1).astype(np.int64)
    pool = clustered(n * 60, dim, seed=6)
    lens = [1, 200] + list(rng.integers(2, 60, n - 2))  # 200 rows of 66 bytes cross a 4 KiB block
    docs, at = [], 0
    for k in lens:
        docs.append(pool[at:at + int(k)].astype(np.float16))
        at += int(k)
    w = late.TokenFileWriter(workdir / late.TOKENS_FILE, dim)
    for pid, d in zip(ids, docs, strict=True):
        w.add(int(pid), d)
    w.finish("a" * 40)
    return late.TokenFile(workdir / late.TOKENS_FILE), ids, docs


@pytest.mark.parametrize("mode", late.MODES)
def test_a_compressed_file_is_read_back_by_every_storage(workdir: Path, mode: str) -> None:
    src, ids, docs = make_file(workdir)
    out = workdir / late.compressed_name(2)
    tf = late.compress_token_file(src, out, nbits=2, k=32, sample=2000, threads=1, progress=False,
                                  log=lambda s: None)
    assert tf.codec is not None and tf.codec.nbits == 2 and tf.n == src.n
    assert tf.token_bytes * 6 < src.token_bytes  # 20 bytes a token against 128
    assert tf.size < src.size
    st = late.open_storage(mode, tf, threads=2, group=3)
    try:
        reads = st.reader()
        rows = tf.rows_of(ids)
        reads.request(rows)
        got: set[int] = set(reads.collect())
        while len(got) < len(rows):
            assert reads.wait(5.0) or len(got) == len(rows)
            got.update(reads.collect())
        for d, r in zip(docs, rows, strict=True):
            rec = reads.get(int(r))
            assert rec.shape == (len(d), tf.codec.token_bytes)
            np.testing.assert_array_equal(rec, tf.codec.encode(d))
            cos = np.sum(tf.vectors(rec) * d.astype(np.float32), axis=1)
            assert cos.mean() > 0.9, cos
        reads.close()
    finally:
        st.close()


def test_maxsim_over_decoded_records_is_near_maxsim_over_the_originals(workdir: Path) -> None:
    src, ids, docs = make_file(workdir)
    tf = late.compress_token_file(src, workdir / late.compressed_name(4), nbits=4, k=32, sample=2000, threads=1,
                                  progress=False, log=lambda s: None)
    assert tf.codec is not None
    q = clustered(12, 64, seed=9)
    exact = late.maxsim(q, docs)
    scorer = late.MaxSimScorer(64, codec=tf.codec)
    approx = scorer(q, [tf.codec.encode(d) for d in docs])
    assert np.max(np.abs(approx - exact)) < 0.05 * len(q), np.max(np.abs(approx - exact))
    assert np.corrcoef(exact, approx)[0, 1] > 0.99


def test_the_compressed_file_is_reused_while_current_and_its_source_must_be_fp16(workdir: Path) -> None:
    src, _, _ = make_file(workdir, n=12)
    out = workdir / late.compressed_name(1)
    kw = {"nbits": 1, "k": 8, "sample": 500, "threads": 1, "progress": False, "log": lambda s: None}
    first = late.compress_token_file(src, out, **kw)
    stamp = out.stat().st_mtime_ns
    again = late.compress_token_file(src, out, **kw)
    assert out.stat().st_mtime_ns == stamp and again.fingerprint == first.fingerprint
    other = late.compress_token_file(src, out, **{**kw, "seed": 1})  # other parameters: rebuilt
    assert other.fingerprint != first.fingerprint
    with pytest.raises(late.TokenFileError, match="already compressed"):
        late.compress_token_file(other, workdir / "x.bin", **kw)
    # a damaged codec section is a clear error, not a crash in the re-rank
    with open(out, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.truncate()
    with pytest.raises(late.TokenFileError, match="codec"):
        late.TokenFile(out)
