"""Late-interaction (multi-vector) retrieval with the token embeddings on SSD.

This is ESPN (Shrestha et al., "ESPN: Memory-Efficient Multi-Vector
Information Retrieval", ISMM 2024) built over the RAG corpus: ColBERT-style
scoring wants every token of every passage as a vector, which is tens of
times the memory of one vector per passage. ESPN keeps those token
embeddings on SSD and hides the read behind the approximate search that
finds the candidates. The pieces here, and why each is shaped as it is
(docs/design/late-interaction.md has the measurements):

- **Token file** (:class:`TokenFile`, built by :func:`build_token_file`):
  one file; a 4 KiB header, then each passage's tokens as one run of 4 KiB
  blocks (a 64-byte block header: token count, dimension, passage id; then
  fp16 rows), then the offsets table, which is read into RAM at open
  (24 bytes a passage). One aligned run per passage is one ``O_DIRECT``
  read per candidate, with no read-modify of neighbours' bytes.
- **Three storages behind one interface** (:func:`open_storage`): ``ram``
  (the whole file in anonymous memory), ``mmap`` (the file mapped: the page
  cache holds what fits, a fault reads the rest) and ``ssd`` (``O_DIRECT``
  reads into page-aligned anonymous buffers, ``os.preadv`` on a small
  thread pool; the GIL is released while a read waits).
- **IVF probes run here** (:class:`IvfProbe`): the centroids and inverted
  lists are read out of the faiss ``IndexIVFFlat`` and probed in centroid
  order in numpy, so that the search can stop after the first fraction of
  the lists (the *prefetch step*) and start reading the token embeddings of
  the candidates it has so far while it probes the rest. The tests check the
  probes against faiss' own search.
- **Searcher** (:class:`LateSearcher`): single-vector candidates ->
  prefetch -> remaining probes -> **early re-rank** (candidates already read
  are scored by MaxSim at once, while the misses are read) -> answer. With a
  time budget it answers when the budget nears with what has been re-ranked
  (MaxSim order first, the rest in single-vector order) and says how many
  were; on the ``ssd`` storage it also fetches only as many of the top
  candidates as the measured bandwidth can bring in the time left
  (**partial re-rank**, ESPN-Lite), besides the fixed ``rerank_k``.

MaxSim (ColBERT): score(q, d) = sum over query tokens of the max over the
passage's tokens of their dot product; every vector is a unit vector (the
MiniLM encoder's per-token last hidden state, ``models.minilm.TokenEncoder``).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .prefetch import PrefetchPlan, PrefetchPolicy, marks
from .residual import VERSION as RESIDUAL_VERSION
from .residual import CodecError, ResidualCodec

BLOCK = 4096
MAGIC = b"SLTOKEN1"
FILE_VERSION = 1
DOC_HEADER = 64  # per passage: u32 tokens, u32 dim, i64 passage id, padding
_HEADER = struct.Struct("<8sIIQQQII40s")  # magic, version, dim, n, table offset, table bytes, dtype, doc header, fp
_DOC = struct.Struct("<IIq")
DTYPE_FP16 = 1
DTYPE_RESIDUAL = 2  # rows are residual records (models.residual); the codec follows the table
TABLE_DTYPE = np.dtype([("id", "<i8"), ("offset", "<u8"), ("ntok", "<u4"), ("nblocks", "<u4")])
TOKENS_FILE = "tokens.bin"
MODES = ("ram", "mmap", "ssd")
#: Seconds each ``O_DIRECT`` read of the ssd storage is held back
#: (``RAG_LATE_READ_DELAY_MS``, default 0): a slow disk, for the tests of
#: answering within the deadline.
READ_DELAY_S = float(os.environ.get("RAG_LATE_READ_DELAY_MS", "0") or 0) / 1e3


class TokenFileError(RuntimeError):
    """A token file that is missing, of another format, or damaged."""


def row_bytes(dim: int, codec: ResidualCodec | None = None) -> int:
    """Bytes of one token's row: fp16 of ``dim``, or a ``codec``'s record."""
    return 2 * int(dim) if codec is None else codec.token_bytes


def blocks_for(ntok: int, dim: int, codec: ResidualCodec | None = None) -> int:
    """4 KiB blocks holding one passage of ``ntok`` rows and its header."""
    return -(-(DOC_HEADER + ntok * row_bytes(dim, codec)) // BLOCK)


IdsLike = Sequence[int] | np.ndarray


def fingerprint(ids: IdsLike, texts: Sequence[str], key: str) -> str:
    """What a token file was built from: the model key, and the passages' ids and texts in order."""
    h = hashlib.sha1(key.encode())
    for i, t in zip(ids, texts, strict=True):
        h.update(f"{int(i)}\0".encode())
        h.update(t.encode("utf-8", "replace"))
        h.update(b"\0")
    return h.hexdigest()


# ----------------------------------------------------------------- the file

class TokenFileWriter:
    """Appends passages to a token file, each in its own aligned block run;
    :meth:`finish` writes the table and the header. Buffered writes (the
    file is read with ``O_DIRECT`` later: the kernel writes dirty pages back
    before a direct read of them). With a ``codec``
    (:class:`models.residual.ResidualCodec`) the rows are its records
    (tokens given as vectors are encoded) and the codec is stored after the
    table."""

    def __init__(self, path: Path, dim: int, entries: np.ndarray | None = None, end: int = BLOCK,
                 codec: ResidualCodec | None = None):
        if codec is not None and codec.dim != int(dim):
            raise ValueError(f"a codec of dimension {codec.dim} for {dim}-d tokens")
        self.path, self.dim, self.codec = Path(path), int(dim), codec
        resume = entries is not None
        self.f = open(self.path, "r+b" if resume else "wb")  # noqa: SIM115 (closed by finish/close)
        if resume:
            self.f.truncate(end)
            self.f.seek(end)
        else:
            self.f.write(b"\0" * BLOCK)  # the header, written last
        self.entries: list[np.ndarray] = [entries] if entries is not None and len(entries) else []
        self._new: list[tuple[int, int, int, int]] = []
        self.end = end

    def add(self, pid: int, tokens: np.ndarray) -> None:
        """One passage's token vectors (n, dim), or a residual file's records."""
        if self.codec is not None and tokens.dtype == np.uint8:
            t = np.ascontiguousarray(tokens)
            if not self.codec.is_records(t) or len(t) < 1:
                raise ValueError(f"passage {pid}: records must be (n >= 1, {self.codec.token_bytes}) uint8, "
                                 f"got {t.shape}")
        else:
            t = np.ascontiguousarray(tokens, dtype=np.float16)
            if t.ndim != 2 or t.shape[1] != self.dim or t.shape[0] < 1:
                raise ValueError(f"passage {pid}: tokens must be (n >= 1, {self.dim}), got {t.shape}")
            if self.codec is not None:
                t = self.codec.encode(t)
        n = blocks_for(t.shape[0], self.dim, self.codec)
        head = _DOC.pack(t.shape[0], self.dim, int(pid))
        body = t.tobytes()
        self.f.write(head + b"\0" * (DOC_HEADER - len(head)) + body + b"\0" * (n * BLOCK - DOC_HEADER - len(body)))
        self._new.append((int(pid), self.end, t.shape[0], n))
        self.end += n * BLOCK

    def table(self) -> np.ndarray:
        """The entries written so far (in write order)."""
        if self._new:
            self.entries.append(np.array(self._new, dtype=TABLE_DTYPE))
            self._new = []
        return np.concatenate(self.entries) if self.entries else np.zeros(0, TABLE_DTYPE)

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())

    def finish(self, fp: str) -> None:
        table = np.sort(self.table(), order="id")
        if len(np.unique(table["id"])) != len(table):
            raise ValueError("a passage id was written twice")
        self.f.seek(self.end)
        raw = table.tobytes()
        self.f.write(raw + b"\0" * (-len(raw) % BLOCK))
        if self.codec is not None:
            self.f.write(self.codec.to_bytes())
        self.f.seek(0)
        self.f.write(_HEADER.pack(MAGIC, FILE_VERSION, self.dim, len(table), self.end, len(raw),
                                  DTYPE_FP16 if self.codec is None else DTYPE_RESIDUAL,
                                  DOC_HEADER, fp.encode().ljust(40, b"\0")[:40]))
        self.sync()
        self.f.close()

    def close(self) -> None:
        self.f.close()


class TokenFile:
    """A token file's header and offsets table, in RAM; the token rows stay
    on disk until a storage (:func:`open_storage`) reads them. A residual
    file (``codec`` set) holds records that :meth:`parse` returns as they
    are; the scorer decodes them."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise TokenFileError(f"{self.path}: no token file there")
        with open(self.path, "rb") as f:
            head = f.read(BLOCK)
            if len(head) < _HEADER.size or head[:8] != MAGIC:
                raise TokenFileError(f"{self.path} is not a token file (bad magic; unfinished build?)")
            magic, version, dim, n, toff, tbytes, dtype, dh, fp = _HEADER.unpack_from(head)
            if version != FILE_VERSION or dtype not in (DTYPE_FP16, DTYPE_RESIDUAL) or dh != DOC_HEADER:
                raise TokenFileError(f"{self.path}: format version {version}, dtype {dtype}: this reader "
                                     f"knows version {FILE_VERSION}, fp16 or residual")
            if tbytes != n * TABLE_DTYPE.itemsize or toff % BLOCK:
                raise TokenFileError(f"{self.path}: damaged header (table of {tbytes} bytes for {n} passages)")
            f.seek(toff)
            raw = f.read(tbytes)
            self.codec: ResidualCodec | None = None
            if dtype == DTYPE_RESIDUAL:
                f.seek(toff + tbytes + (-tbytes % BLOCK))
                try:
                    self.codec = ResidualCodec.from_bytes(f.read())
                except CodecError as e:
                    raise TokenFileError(f"{self.path}: its residual codec does not parse ({e})") from e
                if self.codec.dim != dim:
                    raise TokenFileError(f"{self.path}: a codec of dimension {self.codec.dim} for {dim}-d tokens")
        if len(raw) != tbytes:
            raise TokenFileError(f"{self.path}: truncated ({len(raw)} of {tbytes} table bytes)")
        self.dim, self.n, self.size = int(dim), int(n), int(toff)
        self.row_bytes = row_bytes(self.dim, self.codec)
        self.fingerprint = fp.rstrip(b"\0").decode()
        self.table = np.frombuffer(raw, dtype=TABLE_DTYPE).copy()
        self.ids = self.table["id"].copy()
        self.offsets = self.table["offset"].astype(np.int64)
        self.ntok = self.table["ntok"].astype(np.int64)
        self.nbytes = self.table["nblocks"].astype(np.int64) * BLOCK
        if n and (self.ids.min() < 0 or np.any(np.diff(self.ids) <= 0)):
            raise TokenFileError(f"{self.path}: the table's ids are not sorted and unique")
        if n and int((self.offsets + self.nbytes).max()) > toff:
            raise TokenFileError(f"{self.path}: a passage's blocks run past the table")
        self._lookup = np.full(int(self.ids.max(initial=-1)) + 2, -1, dtype=np.int64)
        self._lookup[self.ids] = np.arange(self.n)

    def rows_of(self, pids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Row (table position) of each passage id; -1 where the file does not hold it."""
        p = np.asarray(pids, dtype=np.int64)
        ok = (p >= 0) & (p < len(self._lookup) - 1)
        return np.where(ok, self._lookup[np.where(ok, p, len(self._lookup) - 1)], -1)

    @property
    def token_bytes(self) -> int:
        """Bytes of token rows (without headers and padding)."""
        return int(self.ntok.sum()) * self.row_bytes

    def parse(self, row: int, buf: Any, at: int = 0) -> np.ndarray:
        """The rows of passage ``row`` from its block run, which starts at
        ``buf[at]`` (no copy): (tokens, dim) fp16, or a residual file's
        (tokens, record bytes) uint8 records; checks the block header."""
        ntok, dim, pid = _DOC.unpack_from(buf, at)
        if ntok != self.ntok[row] or dim != self.dim or pid != self.ids[row]:
            raise TokenFileError(f"{self.path}: passage {self.ids[row]}: block header says {pid}/{ntok} tokens "
                                 f"x {dim}; table says {self.ntok[row]} x {self.dim}")
        if self.codec is not None:
            rb = self.codec.token_bytes
            return np.frombuffer(buf, dtype=np.uint8, count=ntok * rb, offset=at + DOC_HEADER).reshape(ntok, rb)
        return np.frombuffer(buf, dtype=np.float16, count=ntok * dim, offset=at + DOC_HEADER).reshape(ntok, dim)

    def read(self, f: Any, row: int) -> np.ndarray:
        """Passage ``row``'s rows (as :meth:`parse`) read from the open file ``f``."""
        f.seek(int(self.offsets[row]))
        return self.parse(row, f.read(int(self.nbytes[row])))

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """Token vectors from :meth:`parse`'s rows: fp16 as they are, residual records decoded (float32)."""
        return rows if self.codec is None else self.codec.decode(rows)

    def __repr__(self) -> str:
        kind = "fp16" if self.codec is None else f"{self.codec.nbits}-bit residuals over {self.codec.k} centroids"
        return f"TokenFile({self.path.name}: {self.n} passages, {int(self.ntok.sum())} tokens x {self.dim} ({kind}), " \
               f"{self.size / 1e6:.1f} MB)"


def read_header_fingerprint(path: Path) -> str | None:
    try:
        return TokenFile(path).fingerprint
    except TokenFileError:
        return None


def build_token_file(ids: IdsLike, texts: Sequence[str], out: Path, encoder: Any, key: str,
                     chunk: int = 64, label: str = "tokens", progress: bool = True) -> TokenFile:
    """Encode every text's tokens (``encoder.encode_tokens``) into the token
    file ``out``, once: a file whose header carries the same fingerprint
    (model ``key``, ids, texts) is reused. Work goes in chunks of ``chunk``
    texts, shortest first; after each chunk the blocks and the table so far
    are on disk (``<out>.partial`` + ``.partial.json`` / ``.partial.npy``),
    so a killed build resumes where it stopped."""
    from .vindex import Progress

    out = Path(out)
    if len(ids) != len(texts):
        raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
    fp = fingerprint(ids, texts, key)
    if out.is_file() and read_header_fingerprint(out) == fp:
        return TokenFile(out)
    partial = out.with_name(out.name + ".partial")
    state_path = out.with_name(out.name + ".partial.json")
    table_path = out.with_name(out.name + ".partial.npy")
    order = np.argsort(np.array([len(t) for t in texts]), kind="stable")
    chunks = [order[s:s + chunk] for s in range(0, len(texts), chunk)]
    done, end, entries = 0, BLOCK, None
    if partial.is_file() and state_path.is_file() and table_path.is_file():
        state = json.loads(state_path.read_text())
        if state.get("fingerprint") == fp and state.get("chunk") == chunk and partial.stat().st_size >= state["end"]:
            done, end = int(state["done_chunks"]), int(state["end"])
            entries = np.load(table_path)
            if len(entries) != sum(len(c) for c in chunks[:done]):
                done, end, entries = 0, BLOCK, None
    dim = int(getattr(encoder, "dim", 0))
    writer = TokenFileWriter(partial, dim, entries, end) if done else TokenFileWriter(partial, dim)
    weights = np.array([len(t) + 40 for t in texts], dtype=np.float64)
    bar = Progress(label, len(texts), float(weights.sum()))
    done_rows = sum(len(c) for c in chunks[:done])
    done_w = float(sum(weights[c].sum() for c in chunks[:done]))
    if progress and done:
        print(f"{label}: resuming at {done_rows}/{len(texts)}", file=sys.stderr, flush=True)
    start_rows, start_w = done_rows, done_w
    try:
        for i in range(done, len(chunks)):
            idx = chunks[i]
            _, toks, lens = encoder.encode_tokens([texts[j] for j in idx])
            for j, row in enumerate(idx):
                writer.add(int(ids[row]), toks[j, :lens[j]])
            writer.sync()
            np.save(table_path, writer.table())
            state_path.write_text(json.dumps({"fingerprint": fp, "chunk": chunk, "done_chunks": i + 1,
                                              "end": writer.end}))
            done_rows += len(idx)
            done_w += float(weights[idx].sum())
            if progress and i + 1 < len(chunks):
                bar.update(done_rows, done_w, start_rows, start_w)
        writer.finish(fp)
    except BaseException:
        writer.close()
        raise
    if progress:
        bar.update(done_rows, done_w, start_rows, start_w, final=True)
    os.replace(partial, out)
    state_path.unlink(missing_ok=True)
    table_path.unlink(missing_ok=True)
    return TokenFile(out)


def extract_token_file(src: TokenFile, ids: IdsLike, out: Path, fp: str) -> TokenFile:
    """A token file of the passages ``ids`` copied out of a bigger one (a
    slice of the corpus from the full file: no encoding)."""
    rows = src.rows_of(np.asarray(ids, dtype=np.int64))
    if (rows < 0).any():
        raise TokenFileError(f"{src.path} lacks {int((rows < 0).sum())} of the passages asked for")
    with new_token_file(Path(out), src.dim, src.codec) as writer, open(src.path, "rb") as f:
        for r in rows:
            writer.add(int(src.ids[r]), src.read(f, int(r)))
        writer.finish(fp)
    return TokenFile(out)


@contextmanager
def new_token_file(out: Path, dim: int, codec: ResidualCodec | None = None) -> Iterator[TokenFileWriter]:
    """A writer of a temporary file beside ``out`` that replaces ``out``
    when the block ends (the block calls ``finish``), or is removed if the
    block raises: a reader never sees a half-written file."""
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    writer = TokenFileWriter(tmp, dim, codec=codec)
    try:
        yield writer
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)


def compressed_name(nbits: int) -> str:
    """The residual token file of ``nbits`` bits a dimension beside ``tokens.bin``."""
    return f"tokens-r{int(nbits)}.bin"


def compress_token_file(src: TokenFile, out: Path, nbits: int = 2, k: int | None = None, sample: int = 1 << 17,
                        seed: int = 0, threads: int = 2, chunk: int = 512, progress: bool = True,
                        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> TokenFile:
    """The fp16 token file ``src`` as residuals (:mod:`models.residual`):
    centroids trained on ``sample`` token vectors of random passages, then
    every passage encoded, ``chunk`` passages at a time, with progress
    lines. Reused when ``out`` was made from the same file with the same
    parameters (its fingerprint). Not resumable: minutes, not hours (the
    full corpus: ~3.2 M tokens)."""
    from .vindex import Progress

    if src.codec is not None:
        raise TokenFileError(f"{src.path} is already compressed")
    out = Path(out)
    fp = hashlib.sha1(f"{src.fingerprint}/residual-v{RESIDUAL_VERSION}/nbits={nbits}/k={k}/sample={sample}/seed={seed}"
                      .encode()).hexdigest()
    if out.is_file() and read_header_fingerprint(out) == fp:
        return TokenFile(out)
    t0 = time.monotonic()
    order = np.random.default_rng(seed).permutation(src.n)
    take = order[:int(np.searchsorted(np.cumsum(src.ntok[order]), sample)) + 1]
    with open(src.path, "rb") as f:
        x = np.concatenate([src.read(f, int(r)) for r in np.sort(take)]).astype(np.float32)
        codec = ResidualCodec.train(x, nbits=nbits, k=k, seed=seed, threads=threads, log=log)
        del x
        bar = Progress(f"late: compress {out.name}", src.n, float(src.ntok.sum()))
        done_w = 0.0
        with new_token_file(out, src.dim, codec) as writer:
            for s in range(0, src.n, chunk):
                part = range(s, min(src.n, s + chunk))
                docs = [src.read(f, r) for r in part]
                recs = codec.encode(np.concatenate(docs))
                at = 0
                for r, d in zip(part, docs, strict=True):
                    writer.add(int(src.ids[r]), recs[at:at + len(d)])
                    at += len(d)
                done_w += float(src.ntok[part.start:part.stop].sum())
                if progress:
                    bar.update(part.stop, done_w, final=part.stop == src.n)
            writer.finish(fp)
    tf = TokenFile(out)
    log(f"late: {tf} from {src.size / 1e6:.1f} MB in {time.monotonic() - t0:.0f} s")
    return tf


def drop_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (``POSIX_FADV_DONTNEED``;
    clean pages go, so a later read or fault comes from the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ----------------------------------------------------------------- storages

class Reads(Protocol):
    """One search's view of a storage: ask for passages (by table row), see
    them arrive, read their tokens while the reads last. ``collect``
    returns the rows that arrived since it was last called (in request
    order for an immediate storage); ``drop`` withdraws the requests not yet
    started of rows outside ``keep`` (returns how many rows); ``wait``
    blocks until more arrive or the timeout passes (False: nothing came, or
    nothing is in flight)."""

    def request(self, rows: Iterable[int]) -> None: ...
    def requested(self, row: int) -> bool: ...
    def arrived(self, row: int) -> bool: ...
    def collect(self) -> list[int]: ...
    def drop(self, keep: set[int]) -> int: ...
    def wait(self, timeout: float | None) -> bool: ...
    def get(self, row: int) -> np.ndarray: ...
    def close(self) -> None: ...


class Storage(Protocol):
    mode: str
    tf: TokenFile
    #: reads take time and run beside the caller: a prefetch pays
    asynchronous: bool

    def reader(self) -> Reads: ...
    def bandwidth(self) -> float: ...  # bytes/s one search can count on (inf: reads are immediate)
    def evict(self) -> None: ...
    def close(self) -> None: ...


class _Immediate:
    """Reads of a storage whose bytes are addressable (RAM, a mapped file):
    a request is answered at once with views; a mapped file's pages are read
    (faulted in) when the views are first touched, i.e. while scoring."""

    def __init__(self, tf: TokenFile, buf: Any):
        self.tf, self.buf = tf, buf
        self.rows: set[int] = set()
        self.fresh: list[int] = []

    def request(self, rows: Iterable[int]) -> None:
        for r in rows:
            if int(r) not in self.rows:
                self.rows.add(int(r))
                self.fresh.append(int(r))

    def requested(self, row: int) -> bool:
        return row in self.rows

    def arrived(self, row: int) -> bool:
        return row in self.rows

    def collect(self) -> list[int]:
        out, self.fresh = self.fresh, []
        return out

    def drop(self, keep: set[int]) -> int:
        return 0

    def wait(self, timeout: float | None) -> bool:
        return False

    def get(self, row: int) -> np.ndarray:
        return self.tf.parse(row, self.buf, int(self.tf.offsets[row]))

    def close(self) -> None:
        self.rows = set()


def _open_direct(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        raise TokenFileError(f"cannot open {path} with O_DIRECT ({e.strerror}): the ssd storage needs a "
                             "filesystem with direct I/O (not tmpfs); use the mmap or ram storage there") from e


class RamStorage:
    """The whole token file in anonymous memory (read with ``O_DIRECT`` when
    the filesystem allows, so that loading it does not also fill the page
    cache)."""

    mode = "ram"
    asynchronous = False

    def __init__(self, tf: TokenFile):
        self.tf = tf
        self.mem = anonymous(max(tf.size, BLOCK))
        view = memoryview(self.mem)
        try:
            fd = _open_direct(tf.path)
        except TokenFileError:
            fd = os.open(tf.path, os.O_RDONLY)
        try:
            at, step = 0, 8 << 20
            while at < tf.size:
                n = os.preadv(fd, [view[at:min(tf.size, at + step)]], at)
                if n <= 0:
                    raise TokenFileError(f"{tf.path}: short read at {at}")
                at += n
        finally:
            os.close(fd)
            view.release()

    def reader(self) -> Reads:
        return _Immediate(self.tf, self.mem)

    def bandwidth(self) -> float:
        return math.inf

    def evict(self) -> None:
        """Nothing to evict: the rows are the process' own memory."""

    def close(self) -> None:
        pass


class MmapStorage:
    """The token file mapped read-only: the page cache holds what memory
    allows; touching a passage that is not cached faults its pages in from
    the disk, synchronously, while scoring.

    ``advice``: ``random`` (default; ``MADV_RANDOM``: a fault reads its own
    page, no readahead) or ``normal`` (the kernel's readahead around each
    fault: ``read_ahead_kb`` of the device, 8 MiB on the VM these were
    measured on, which under memory pressure reads megabytes per 64 KiB
    passage and evicts them again before use; measured on the 2,000-passage
    slice with a quarter of the file cacheable: p50 717 ms a search against
    86 ms with ``random``)."""

    mode = "mmap"
    asynchronous = False
    ADVICE = {"random": mmap.MADV_RANDOM, "normal": mmap.MADV_NORMAL}

    def __init__(self, tf: TokenFile, advice: str = "random"):
        if advice not in self.ADVICE:
            raise ValueError(f"mmap advice must be random or normal, not {advice!r}")
        self.tf, self.advice = tf, advice
        with open(tf.path, "rb") as f:
            self.mem = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.mem.madvise(self.ADVICE[advice])

    def reader(self) -> Reads:
        return _Immediate(self.tf, self.mem)

    def bandwidth(self) -> float:
        return math.inf

    def evict(self) -> None:
        """Unmap the pages this process faulted in and drop the file from
        the page cache: the next touches read from the disk (a cold start)."""
        self.mem.madvise(mmap.MADV_DONTNEED)
        drop_cache(self.tf.path)

    def close(self) -> None:
        pass


def anonymous(n: int) -> mmap.mmap:
    """``n`` bytes of private anonymous memory: page-aligned (as ``O_DIRECT``
    wants), counted as the process' own (RssAnon; ``mmap.mmap(-1, n)`` alone
    would be shared memory)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class BufferPool:
    """Page-aligned read buffers for ``O_DIRECT``: anonymous maps of
    ``chunk`` bytes, reused across searches; at most ``keep`` idle ones are
    kept (the rest are unmapped)."""

    def __init__(self, chunk: int = 4 << 20, keep: int = 8):
        self.chunk, self.keep = int(chunk), int(keep)
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return anonymous(self.chunk)

    def give(self, chunks: list[mmap.mmap]) -> None:
        with self._lock:
            room = max(0, self.keep - len(self._free))
            self._free.extend(chunks[:room])
            self.allocated -= max(0, len(chunks) - room)


class _Direct:
    """One search's ``O_DIRECT`` reads: each requested passage gets a slot
    in this search's buffers and one ``preadv`` of its block run; rows are
    read in groups of ``group`` on the storage's thread pool, in the order
    they were requested (best candidates first). Buffers go back to the pool
    when the search is closed and the last read in flight has landed (a
    search cut by its deadline does not wait for its stragglers)."""

    def __init__(self, st: DirectStorage):
        self.st, self.tf = st, st.tf
        self.slots: dict[int, tuple[mmap.mmap, int]] = {}
        self.done: dict[int, np.ndarray] = {}
        self.fresh: list[int] = []
        self.spare: dict[int, tuple[mmap.mmap, int]] = {}  # slots of withdrawn reads, by row
        self.futures: list[tuple[Future[None], list[int]]] = []
        self.chunks: list[mmap.mmap] = []
        self.used = st.pool.chunk  # bump pointer into chunks[-1]
        # (rows read, error, seconds the task spent reading)
        self.q: queue.SimpleQueue[tuple[list[int], BaseException | None, float]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.inflight = 0
        self.closed = False
        self.bytes_done = 0
        self.busy_s = 0.0  # summed over tasks: time spent in preadv

    def _slot(self, nbytes: int) -> tuple[mmap.mmap, int]:
        if nbytes > self.st.pool.chunk:
            raise TokenFileError(f"a passage of {nbytes} bytes exceeds the read buffers ({self.st.pool.chunk})")
        if self.used + nbytes > self.st.pool.chunk:
            self.chunks.append(self.st.pool.take())
            self.used = 0
        at = self.used
        self.used += nbytes
        return self.chunks[-1], at

    def request(self, rows: Iterable[int]) -> None:
        new = [int(r) for r in rows if int(r) not in self.slots]
        if not new:
            return
        items = []
        for r in new:
            # a row whose queued read was withdrawn gets its slot back
            buf, at = self.spare.pop(r) if r in self.spare else self._slot(int(self.tf.nbytes[r]))
            self.slots[r] = (buf, at)
            items.append((r, int(self.tf.offsets[r]), int(self.tf.nbytes[r]), buf, at))
        g = self.st.group
        with self.lock:
            self.inflight += -(-len(items) // g)
        for s in range(0, len(items), g):
            part = items[s:s + g]
            self.futures.append((self.st.pool_exec.submit(self._read, part), [it[0] for it in part]))

    def _read(self, items: list[tuple[int, int, int, mmap.mmap, int]]) -> None:
        rows: list[int] = []
        err: BaseException | None = None
        t0 = time.perf_counter()
        try:
            for r, off, n, buf, at in items:
                if READ_DELAY_S > 0:
                    time.sleep(READ_DELAY_S)
                with memoryview(buf) as mv:
                    got = os.preadv(self.st.fd, [mv[at:at + n]], off)
                if got != n:
                    raise TokenFileError(f"{self.tf.path}: short read of passage {self.tf.ids[r]} ({got} of {n})")
                rows.append(r)
        except BaseException as e:  # reported to the search, which raises it
            err = e
        self.q.put((rows, err, time.perf_counter() - t0))
        with self.lock:
            self.inflight -= 1
            release = self.closed and self.inflight == 0
        if release:
            self.st.pool.give(self.chunks)

    def _drain(self, first: tuple[list[int], BaseException | None, float] | None) -> bool:
        got = False
        item = first
        while True:
            if item is None:
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    return got
            rows, err, busy = item
            item = None
            for r in rows:
                buf, at = self.slots[r]
                self.done[r] = self.tf.parse(r, buf, at)
                self.fresh.append(r)
                self.bytes_done += int(self.tf.nbytes[r])
                got = True
            self.busy_s += busy
            if err is not None:
                raise err

    def requested(self, row: int) -> bool:
        return row in self.slots

    def arrived(self, row: int) -> bool:
        if row not in self.done:
            self._drain(None)
        return row in self.done

    def collect(self) -> list[int]:
        self._drain(None)
        out, self.fresh = self.fresh, []
        return out

    def drop(self, keep: set[int]) -> int:
        """Cancel queued reads none of whose rows are in ``keep`` (the
        prefetch's guesses that the final candidates did not confirm), so
        that the reads that matter go first."""
        kept: list[tuple[Future[None], list[int]]] = []
        tasks = rows_dropped = 0
        for fut, rows in self.futures:
            if not fut.done() and not any(r in keep for r in rows) and fut.cancel():
                tasks += 1
                rows_dropped += len(rows)
                for r in rows:
                    self.spare[r] = self.slots.pop(r)
            else:
                kept.append((fut, rows))
        self.futures = kept
        if tasks:
            with self.lock:
                self.inflight -= tasks
        return rows_dropped

    def wait(self, timeout: float | None) -> bool:
        """Block until another group of reads lands (True) or ``timeout`` s pass (False)."""
        if self._drain(None):
            return True
        with self.lock:
            if self.inflight == 0 and self.q.empty():
                return False
        try:
            item = self.q.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return False
        return self._drain(item)

    def get(self, row: int) -> np.ndarray:
        if row not in self.done and not self.arrived(row):
            raise KeyError(f"passage row {row} has not been read")
        return self.done[row]

    def close(self) -> None:
        if self.closed:
            return
        if self.bytes_done and self.busy_s > 0:
            self.st.observe(self.bytes_done, self.busy_s)
        self.st._closed()
        self.done = {}
        # Reads still queued (a search cut by its budget) are dropped, so
        # that they do not hold the I/O threads up for the next search.
        dropped = sum(1 for f, _ in self.futures if f.cancel())
        self.futures = []
        with self.lock:
            self.inflight -= dropped
            self.closed = True
            release = self.inflight == 0
        if release:
            self.st.pool.give(self.chunks)


class DirectStorage:
    """Token rows on disk, read with ``O_DIRECT`` (no page cache: memory
    stays what the process allocates) by ``threads`` I/O threads, ``group``
    passages per task. Keeps an estimate of the read bandwidth it gets (for
    partial re-ranking under a deadline)."""

    mode = "ssd"
    asynchronous = True

    def __init__(self, tf: TokenFile, threads: int = 8, group: int = 4, pool: BufferPool | None = None):
        if threads < 1 or group < 1:
            raise ValueError(f"threads and group must be >= 1, got {threads}, {group}")
        self.tf = tf
        self.fd = _open_direct(tf.path)
        self.group = int(group)
        self.threads = int(threads)
        largest = int(tf.nbytes.max(initial=BLOCK))
        self.pool = pool or BufferPool(chunk=max(4 << 20, largest))
        self.pool_exec = ThreadPoolExecutor(max_workers=int(threads), thread_name_prefix="late-io")
        self._bw = 400e6  # bytes/s until measured
        self._bw_lock = threading.Lock()
        self.active = 0  # searches reading now (they share the disk)

    def reader(self) -> Reads:
        with self._bw_lock:
            self.active += 1
        return _Direct(self)

    def observe(self, nbytes: int, busy_s: float) -> None:
        """A search read ``nbytes`` in ``busy_s`` summed over its read tasks:
        with the pool's threads all reading, the disk delivers ``threads``
        times that rate (Little's law: throughput = reads in flight /
        time per read, the time measured under the same load)."""
        with self._bw_lock:
            self._bw = 0.8 * self._bw + 0.2 * (self.threads * nbytes / busy_s)

    def _closed(self) -> None:
        with self._bw_lock:
            self.active -= 1

    def bandwidth(self) -> float:
        """Bytes/s one search can count on: the measured bandwidth shared
        by the searches reading now."""
        with self._bw_lock:
            return self._bw / max(1, self.active)

    def evict(self) -> None:
        """``O_DIRECT`` keeps nothing in the page cache; drop what other readers left there."""
        drop_cache(self.tf.path)

    def close(self) -> None:
        self.pool_exec.shutdown(wait=True)
        os.close(self.fd)


def open_storage(mode: str, tf: TokenFile, threads: int = 8, group: int = 4, mmap_advice: str = "random",
                 ) -> Storage:
    """``ram``, ``mmap`` (with ``mmap_advice``) or ``ssd`` (``O_DIRECT``
    reads on ``threads`` I/O threads, ``group`` passages per task)."""
    if mode == "ram":
        return RamStorage(tf)
    if mode == "mmap":
        return MmapStorage(tf, advice=mmap_advice)
    if mode == "ssd":
        return DirectStorage(tf, threads=threads, group=group)
    raise ValueError(f"storage mode must be one of {', '.join(MODES)}, not {mode!r}")


# ----------------------------------------------------------------- IVF probes

class IvfProbe:
    """An inverted-file index over unit vectors (inner product), probed
    here: ``centroids`` (nlist, d), the lists' vectors back to back in
    ``vectors`` with their ``ids``, list ``l`` at rows
    ``bounds[l]:bounds[l + 1]``. :meth:`from_faiss` reads them out of a faiss
    ``IndexIVFFlat``; :meth:`search` returns what faiss' own search returns
    for the same ``nprobe``."""

    def __init__(self, centroids: np.ndarray, vectors: np.ndarray, ids: np.ndarray, bounds: np.ndarray,
                 nprobe: int):
        self.centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.nlist, self.dim = self.centroids.shape
        if len(self.bounds) != self.nlist + 1 or int(self.bounds[-1]) != len(self.vectors) \
                or len(self.ids) != len(self.vectors) or self.vectors.shape[1:] != (self.dim,):
            raise ValueError("inconsistent IVF arrays (centroids, vectors, ids, list bounds)")
        self.nprobe = min(max(1, int(nprobe)), self.nlist)

    @classmethod
    def from_faiss(cls, index: Any) -> IvfProbe:
        import faiss

        found = faiss.try_extract_index_ivf(index)
        if found is None:
            raise ValueError(f"IvfProbe reads an IndexIVFFlat with inner product, not {type(index).__name__}")
        ivf: Any = faiss.downcast_index(found)
        if not isinstance(ivf, faiss.IndexIVFFlat) or ivf.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError(f"IvfProbe reads an IndexIVFFlat with inner product, not {type(ivf).__name__}")
        d, nlist = int(ivf.d), int(ivf.nlist)
        if int(ivf.code_size) != 4 * d:
            raise ValueError(f"an IndexIVFFlat whose codes are {ivf.code_size} bytes for {d} floats")
        centroids = ivf.quantizer.reconstruct_n(0, nlist).reshape(nlist, d)
        inv: Any = ivf.invlists
        sizes = np.array([inv.list_size(lst) for lst in range(nlist)], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        vectors = np.empty((int(bounds[-1]), d), dtype=np.float32)
        ids = np.empty(int(bounds[-1]), dtype=np.int64)
        for lst in range(nlist):
            n = int(sizes[lst])
            if n:
                a = int(bounds[lst])
                ids[a:a + n] = faiss.rev_swig_ptr(inv.get_ids(lst), n)
                vectors[a:a + n] = faiss.rev_swig_ptr(inv.get_codes(lst), n * ivf.code_size).view(np.float32) \
                    .reshape(n, d)
        return cls(centroids, vectors, ids, bounds, int(ivf.nprobe))

    @classmethod
    def load(cls, index_file: Path) -> IvfProbe:
        import faiss

        return cls.from_faiss(faiss.read_index(str(index_file)))

    @property
    def nbytes(self) -> int:
        return int(self.centroids.nbytes + self.vectors.nbytes + self.ids.nbytes + self.bounds.nbytes)

    def order(self, queries: np.ndarray, nprobe: int | None = None) -> np.ndarray:
        """(nq, nprobe) list numbers, nearest centroid first."""
        p = min(self.nprobe if nprobe is None else max(1, int(nprobe)), self.nlist)
        c = queries @ self.centroids.T
        part = np.argpartition(-c, p - 1, axis=1)[:, :p] if p < self.nlist else \
            np.broadcast_to(np.arange(self.nlist), c.shape)
        sc = np.take_along_axis(c, part, axis=1)
        return np.take_along_axis(part, np.argsort(-sc, axis=1, kind="stable"), axis=1)

    def scan(self, q: np.ndarray, lists: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scores and ids of every vector in ``lists`` (one query)."""
        scores, ids = [], []
        for lst in lists:
            a, b = int(self.bounds[lst]), int(self.bounds[lst + 1])
            if b > a:
                scores.append(self.vectors[a:b] @ q)
                ids.append(self.ids[a:b])
        if not scores:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        return np.concatenate(scores), np.concatenate(ids)

    def search(self, queries: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Like faiss: (scores, ids), (nq, k), best first; past what the
        probed lists hold, ids -1 and scores the lowest float32 (as faiss)."""
        q = _as_queries(queries, self.dim)
        orders = self.order(q, nprobe)
        out_s = np.full((len(q), k), np.finfo(np.float32).min, dtype=np.float32)
        out_i = np.full((len(q), k), -1, dtype=np.int64)
        for i in range(len(q)):
            s, ids = self.scan(q[i], orders[i])
            s, ids = top_k(s, ids, k)
            out_s[i, :len(s)], out_i[i, :len(ids)] = s, ids
        return out_s, out_i


def top_k(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (score descending; ties: lower id first)."""
    if len(scores) > k:
        keep = np.argpartition(-scores, k - 1)[:k]
        scores, ids = scores[keep], ids[keep]
    o = np.lexsort((ids, -scores))
    return scores[o], ids[o]


def _as_queries(queries: np.ndarray, dim: int) -> np.ndarray:
    q = np.asarray(queries)
    if q.ndim != 2 or q.shape[1] != dim:
        raise ValueError(f"query vectors must be (n, {dim}), got shape {q.shape}")
    if not np.issubdtype(q.dtype, np.floating):
        raise ValueError(f"query vectors must be floats, got {q.dtype}")
    return np.ascontiguousarray(q, dtype=np.float32)


# ----------------------------------------------------------------- scoring

def maxsim(q: np.ndarray, docs: Sequence[np.ndarray]) -> np.ndarray:
    """ColBERT MaxSim of one query (tokens, d) against each passage's
    (tokens_i, d) rows: sum over query tokens of the max dot product over
    the passage's tokens. One matrix product for all passages (fp16 rows are
    widened to fp32 once)."""
    if not docs:
        return np.zeros(0, dtype=np.float32)
    lens = np.array([len(d) for d in docs])
    if (lens < 1).any():
        raise ValueError("a passage with no tokens")
    flat = np.concatenate(docs, axis=0, dtype=np.float32, casting="same_kind")
    sims = flat @ np.ascontiguousarray(q, dtype=np.float32).T
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.maximum.reduceat(sims, starts, axis=0).sum(axis=1).astype(np.float32)


class MaxSimScorer:
    """:func:`maxsim` with the fp16 -> fp32 widening and the product done by
    onnxruntime (a two-node graph, Cast + MatMul): numpy's fp16 cast runs
    at ~2.3 ns an element on this machine's CPU, several times slower than
    the product itself, and the widening of ~8k token rows a query was most
    of a search's time; onnxruntime's cast is ~4x faster. The max per
    passage stays in numpy (``reduceat`` over the small score matrix).
    ``threads``: onnxruntime's intra-op threads. With a ``codec`` the
    passages are residual records, decoded (numpy) and multiplied in fp32 by
    numpy (onnxruntime's Gather was slower than ``np.take`` at decoding).
    Thread-safe."""

    def __init__(self, dim: int, threads: int = 1, codec: ResidualCodec | None = None):
        self.dim, self.codec = int(dim), codec
        if codec is not None:
            return  # residual records are scored by the codec: no graph to build
        import onnxruntime as ort
        from onnx import TensorProto, helper

        g = helper.make_graph(
            [helper.make_node("Cast", ["docs"], ["docs32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["docs32", "query_t"], ["sims"])], "maxsim",
            [helper.make_tensor_value_info("docs", TensorProto.FLOAT16, ["n", dim]),
             helper.make_tensor_value_info("query_t", TensorProto.FLOAT, [dim, "t"])],
            [helper.make_tensor_value_info("sims", TensorProto.FLOAT, ["n", "t"])])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="slipstream-examples")
        model.ir_version = 8
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def __call__(self, q: np.ndarray, docs: Sequence[np.ndarray]) -> np.ndarray:
        if not docs:
            return np.zeros(0, dtype=np.float32)
        lens = np.array([len(d) for d in docs])
        if (lens < 1).any():
            raise ValueError("a passage with no tokens")
        flat = np.concatenate(docs, axis=0) if len(docs) > 1 else docs[0]
        qt = np.ascontiguousarray(np.asarray(q, dtype=np.float32).T)
        if self.codec is not None:
            sims = self.codec.scores(flat, qt)
        else:
            (sims,) = self.session.run(["sims"], {"docs": np.ascontiguousarray(flat, dtype=np.float16), "query_t": qt})
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        return np.maximum.reduceat(sims, starts, axis=0).sum(axis=1).astype(np.float32)


def query_tokens(qtoks: np.ndarray, qlen: int | None) -> np.ndarray:
    """One query's token rows: its first ``qlen``, or (None) up to its last
    non-zero row (zero rows, the padding, score 0 in MaxSim anyway)."""
    if qlen is None:
        nz = np.flatnonzero(np.any(qtoks != 0, axis=1))
        qlen = int(nz[-1]) + 1 if len(nz) else 0
    if qlen < 1:
        raise ValueError("a query with no tokens")
    return qtoks[:qlen]


# ----------------------------------------------------------------- the search

@dataclass
class LateConfig:
    """How a search runs (see :class:`LateSearcher`)."""

    k: int = 10  # passages answered
    nprobe: int | None = None  # IVF lists probed (default: the index's tuned nprobe)
    candidates: int = 100  # single-vector candidates kept (k')
    rerank_k: int | None = None  # ESPN-Lite: re-rank at most the top rerank_k (default: all candidates)
    # Prefetch step: the fraction of the probes after which reads start (0: no prefetch); None: chosen from
    # measured probe time, bandwidth and precision (models.prefetch), with the count.
    prefetch_at: float | None = None
    # How many of the partial top candidates the prefetch reads: None (adaptive) as many as the measured
    # bandwidth brings in the time the remaining probes take; a number: that many (at most the re-rank depth).
    prefetch_k: int | None = None
    adaptive: bool = True  # under a budget, fetch only what the measured bandwidth brings in time
    margin_s: float = 0.001  # stop waiting for reads this long before the budget ends (to score and answer)
    score_group: int = 16  # passages scored per MaxSim call when they are all at hand

    def check(self) -> None:
        if self.k < 1 or self.candidates < 1:
            raise ValueError(f"k and candidates must be >= 1, got {self.k}, {self.candidates}")
        if self.rerank_k is not None and self.rerank_k < 0:
            raise ValueError(f"rerank_k must be >= 0, got {self.rerank_k}")
        if self.prefetch_at is not None and not 0.0 <= self.prefetch_at < 1.0:
            raise ValueError(f"prefetch_at is a fraction of the probes in [0, 1), got {self.prefetch_at}")
        if self.prefetch_k is not None and self.prefetch_k < 0:
            raise ValueError(f"prefetch_k must be >= 0 (or None: adaptive), got {self.prefetch_k}")
        if self.nprobe is not None and self.nprobe < 1:
            raise ValueError(f"nprobe must be >= 1, got {self.nprobe}")
        if self.score_group < 1 or self.margin_s < 0:
            raise ValueError("score_group must be >= 1 and margin_s >= 0")


@dataclass
class SearchResult:
    """A batch of answers. Per query: ``ids`` (k, best first; -1 past the
    candidates), ``maxsim`` (the MaxSim score; NaN where the passage was
    not re-ranked), ``cosine`` (single-vector score); ``reranked`` (the
    length of the prefix of the candidates, in single-vector order, that
    was scored by MaxSim and is answered in MaxSim order; the rest follow
    in single-vector order), ``target`` (how many it meant to re-rank:
    ``rerank_k``, fewer when partial re-ranking trimmed them to the time
    left), ``scored`` (passages scored, past the prefix too),
    ``candidates``; prefetch: ``prefetched`` (reads issued at the prefetch
    step), ``hits`` (targets whose read this query's prefetch had requested
    and that were still wanted when the probes ended: queued, started or
    done; under a budget only started or done, since the queued ones are
    requested again in the final order), ``arrived`` (of those, already
    read then); ``cut``
    (the budget ended the search before every target was re-ranked)."""

    ids: np.ndarray
    maxsim: np.ndarray
    cosine: np.ndarray
    reranked: np.ndarray
    target: np.ndarray
    candidates: np.ndarray
    prefetched: np.ndarray
    hits: np.ndarray
    arrived: np.ndarray
    cut: np.ndarray
    scored: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ann_s: float = 0.0
    total_s: float = 0.0
    single_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    def hit_rate(self) -> float:
        t = int(self.target.sum())
        return float(self.hits.sum()) / t if t else float("nan")


class LateSearcher:
    """Single-vector IVF candidates re-ranked by MaxSim over token
    embeddings held by a :class:`Storage`.

    One batch of queries goes: probe the first ``prefetch_at`` of each
    query's lists -> request the reads of each query's current top
    ``rerank_k`` (the prefetch; only on an asynchronous storage) -> probe
    the rest -> final candidates -> request the targets the prefetch missed
    (under a budget, on the ssd storage, only as many of the top ones as the
    bandwidth estimate says arrive in time) -> score (MaxSim) whatever has
    arrived, as it arrives (the prefetched ones first: early re-rank) ->
    answer when every target is scored or the budget nears. Safe to call
    from several threads at once."""

    def __init__(self, probe: IvfProbe, tokens: TokenFile, storage: Storage, config: LateConfig | None = None,
                 threads: int = 1):
        self.probe, self.tf, self.storage = probe, tokens, storage
        self.scorer = MaxSimScorer(tokens.dim, threads=threads, codec=tokens.codec)
        self.config = config or LateConfig()
        self.config.check()
        if tokens.dim != probe.dim:
            raise ValueError(f"token vectors are {tokens.dim}-d, the IVF index {probe.dim}-d")
        missing = int((tokens.rows_of(probe.ids) < 0).sum())
        if missing:
            raise TokenFileError(f"{tokens.path} lacks the tokens of {missing} indexed passages: rebuild it")
        self.prefetch = PrefetchPolicy()
        self.passage_bytes = float(tokens.nbytes.mean()) if tokens.n else float(BLOCK)

    def prefetch_plan(self, config: LateConfig | None = None) -> PrefetchPlan:
        """What the next search would prefetch, and why (``config``'s
        ``prefetch_at`` None: the measured plan; a number: that step)."""
        cfg = config or self.config
        depth = cfg.candidates if cfg.rerank_k is None else min(cfg.rerank_k, cfg.candidates)
        nprobe = min(cfg.nprobe or self.probe.nprobe, self.probe.nlist)
        if not self.storage.asynchronous:
            return PrefetchPlan(0, 0, 0.0, f"off: the {self.storage.mode} storage reads while scoring")
        if cfg.prefetch_at is None:
            return self.prefetch.plan(nprobe, depth, self.storage.bandwidth(), self.passage_bytes)
        if cfg.prefetch_at == 0 or nprobe < 2 or depth < 1:
            return PrefetchPlan(0, 0, 0.0, "off (prefetch_at=0)" if cfg.prefetch_at == 0 else "off: nothing to overlap")
        step = min(nprobe - 1, max(1, math.ceil(cfg.prefetch_at * nprobe)))
        k = None if cfg.prefetch_k is None else min(depth, cfg.prefetch_k)
        return PrefetchPlan(step, k, 0.0, f"fixed: after {step} of {nprobe} lists, "
                                          f"{'bandwidth-sized' if k is None else f'{k} passages'}")

    def search(self, qvecs: np.ndarray, qtoks: np.ndarray, qlens: np.ndarray | Sequence[int] | None = None,
               budget_s: float | None = None, config: LateConfig | None = None) -> SearchResult:
        """``qvecs`` (n, d) sentence embeddings; ``qtoks`` (n, T, d) token
        embeddings (zero rows past each query's ``qlens``); ``budget_s``:
        answer within about this long (None: re-rank every target)."""
        cfg = config or self.config
        cfg.check()
        t0 = time.perf_counter()
        deadline = t0 + budget_s if budget_s is not None else math.inf
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        q = _as_queries(qvecs, self.probe.dim)
        toks = np.asarray(qtoks)
        if toks.ndim != 3 or toks.shape[0] != len(q) or toks.shape[2] != self.tf.dim:
            raise ValueError(f"query tokens must be ({len(q)}, T, {self.tf.dim}), got {toks.shape}")
        lens = [None] * len(q) if qlens is None else [int(x) for x in np.asarray(qlens).reshape(-1)]
        if len(lens) != len(q):
            raise ValueError(f"{len(lens)} query lengths for {len(q)} queries")
        qt = [np.ascontiguousarray(query_tokens(toks[i], lens[i]), dtype=np.float32) for i in range(len(q))]
        nq, kc = len(q), cfg.candidates
        depth = kc if cfg.rerank_k is None else min(cfg.rerank_k, kc)
        nprobe = min(cfg.nprobe or self.probe.nprobe, self.probe.nlist)
        orders = self.probe.order(q, nprobe)
        plan = self.prefetch_plan(cfg)
        p0 = plan.step
        # On an asynchronous storage every search measures what the prefetch
        # policy needs: the per-list probe time and, at each checkpoint, the
        # partial top list (compared with the final targets below).
        measure = marks(nprobe) if self.storage.asynchronous and depth > 0 else []
        partial: list[dict[float, np.ndarray]] = [{} for _ in range(nq)]
        acc: list[tuple[list[np.ndarray], list[np.ndarray]]] = [([], []) for _ in range(nq)]

        def probe_to(i: int, start: int, stop: int) -> None:
            """Probe query i's lists [start, stop), noting the partial top list at the checkpoints."""
            pos = start
            for f, step in [m for m in measure if start < m[1] <= stop] + [(-1.0, stop)]:
                if step > pos:
                    s_, i_ = self.probe.scan(q[i], orders[i, pos:step])
                    acc[i][0].append(s_)
                    acc[i][1].append(i_)
                    pos = step
                if f >= 0 and acc[i][0]:
                    partial[i][f] = top_k(np.concatenate(acc[i][0]), np.concatenate(acc[i][1]), depth)[1]

        reads = self.storage.reader()
        try:
            prefetched = np.zeros(nq, np.int64)
            mine: list[set[int]] = [set() for _ in range(nq)]  # each query's own prefetch
            bounded = self.storage.asynchronous and cfg.adaptive and math.isfinite(deadline)
            t_probe = time.perf_counter()
            for i in range(nq):  # the prefetch step
                probe_to(i, 0, p0)
                if p0:
                    s1, i1 = np.concatenate(acc[i][0]), np.concatenate(acc[i][1])
                    _, top = top_k(s1, i1, depth if plan.k is None else min(depth, plan.k))
                    rows = self.tf.rows_of(top)
                    if plan.k is None:
                        # Adaptive: what the disk can bring while this query's
                        # remaining probes run (their time from the probes so far).
                        per_list = (time.perf_counter() - t_probe) / ((i + 1) * p0)
                        rows, _ = self._trim(reads, rows, per_list * (nprobe - p0), 1)
                    if bounded:
                        rows, _ = self._trim(reads, rows, deadline - cfg.margin_s - time.perf_counter(), nq)
                    reads.request(rows)
                    mine[i] = set(rows.tolist())
                    prefetched[i] = len(rows)
            cand_s = np.full((nq, kc), -np.inf, np.float32)
            cand_i = np.full((nq, kc), -1, np.int64)
            for i in range(nq):  # the rest of the probes
                probe_to(i, p0, nprobe)
                s, ids = top_k(np.concatenate(acc[i][0]), np.concatenate(acc[i][1]), kc)
                cand_s[i, :len(s)], cand_i[i, :len(ids)] = s, ids
            t_ann = time.perf_counter()
            if measure:
                self._observe(partial, cand_i, depth, (t_ann - t_probe) / (nq * nprobe))
            targets: list[np.ndarray] = []
            hits, arrived, target_n = (np.zeros(nq, np.int64) for _ in range(3))
            if p0 and bounded:
                # Under a budget only a prefix of the candidates can be
                # re-ranked, so reads must go best first: the prefetch's
                # queued reads (in the partial order) are withdrawn and the
                # targets requested below in the final order. Started or
                # finished reads stay.
                reads.drop(set())
            elif p0:
                # Without one every target is read anyway: only the queued
                # reads of passages that are not among them are withdrawn.
                reads.drop({int(r) for i in range(nq) for r in self.tf.rows_of(cand_i[i, :depth])})
            for i in range(nq):
                rows = self.tf.rows_of(cand_i[i, :depth][cand_i[i, :depth] >= 0])
                if bounded:
                    rows, _ = self._trim(reads, rows, deadline - cfg.margin_s - time.perf_counter(), nq)
                hit = np.array([int(r) in mine[i] and reads.requested(int(r)) for r in rows], dtype=bool)
                arrived[i] = sum(reads.arrived(int(r)) for r in rows[hit])
                hits[i], target_n[i] = int(hit.sum()), len(rows)
                targets.append(rows)
            for i in range(nq):  # what the prefetch did not ask for, best first
                reads.request(int(r) for r in targets[i] if not reads.requested(int(r)))
            scored: list[dict[int, float]] = [{} for _ in range(nq)]
            self._score(reads, qt, targets, scored, deadline - cfg.margin_s, cfg.score_group)
        finally:
            reads.close()
        return self._answer(cfg, cand_s, cand_i, scored, target_n, prefetched, hits, arrived, t0, t_ann)

    def _observe(self, partial: list[dict[float, np.ndarray]], cand_i: np.ndarray, depth: int,
                 per_list_s: float) -> None:
        """Feed the prefetch policy: the share of the final targets each
        checkpoint's partial top list held, averaged over the batch."""
        prec: dict[float, list[float]] = {}
        for i, got in enumerate(partial):
            final = cand_i[i, :depth]
            final = final[final >= 0]
            if len(final):
                for f, top in got.items():
                    prec.setdefault(f, []).append(len(np.intersect1d(top, final)) / len(final))
        self.prefetch.observe(per_list_s, {f: float(np.mean(v)) for f, v in prec.items()})

    def _trim(self, reads: Reads, rows: np.ndarray, left_s: float, share: int) -> tuple[np.ndarray, np.ndarray]:
        """ESPN-Lite under a budget: keep the longest prefix of ``rows``
        (best first) whose not-yet-requested bytes the measured bandwidth
        can bring in the time left (a ``1/share`` of it: the batch's queries
        share the disk); rows already requested cost nothing more. Only a
        prefix is worth reading: the answer re-orders a prefix of the
        candidates (see :meth:`_answer`). Returns the rows kept and which
        of them were already requested."""
        asked = np.array([reads.requested(int(r)) for r in rows], dtype=bool)
        miss_bytes = np.where(asked, 0, self.tf.nbytes[rows])
        allowed = max(0.0, left_s) * self.storage.bandwidth() / max(1, share)
        n = int(np.searchsorted(np.cumsum(miss_bytes), allowed, side="right"))
        return rows[:n], asked[:n]

    def _score(self, reads: Reads, qt: list[np.ndarray], targets: list[np.ndarray], scored: list[dict[int, float]],
               stop_at: float, group: int) -> None:
        """Score each query's targets as their reads arrive (those already
        read first: the early re-rank), ``group`` passages per call, until
        all are scored or ``stop_at``."""
        wanted: dict[int, list[int]] = {}
        for i, t in enumerate(targets):
            for r in t:
                wanted.setdefault(int(r), []).append(i)
        left = sum(len(t) for t in targets)
        ready: list[list[int]] = [[] for _ in targets]
        while left:
            for r in reads.collect():
                for i in wanted.pop(r, ()):
                    ready[i].append(r)
            progressed = False
            for i, rows in enumerate(ready):
                for s in range(0, len(rows), group):
                    if time.perf_counter() >= stop_at:
                        return
                    part = rows[s:s + group]
                    for r, v in zip(part, self.scorer(qt[i], [reads.get(r) for r in part]), strict=True):
                        scored[i][r] = float(v)
                    left -= len(part)
                    progressed = True
                ready[i] = []
            if left and not progressed:
                wait = stop_at - time.perf_counter()
                if wait <= 0:
                    return
                if not reads.wait(None if math.isinf(wait) else wait):
                    if time.perf_counter() >= stop_at - 1e-4:
                        return
                    raise RuntimeError(f"{left} re-rank targets were never read (no read in flight)")

    def _answer(self, cfg: LateConfig, cand_s: np.ndarray, cand_i: np.ndarray, scored: list[dict[int, float]],
                target_n: np.ndarray, prefetched: np.ndarray, hits: np.ndarray, arrived: np.ndarray, t0: float,
                t_ann: float) -> SearchResult:
        nq, k = len(cand_i), cfg.k
        ids = np.full((nq, k), -1, np.int64)
        ms = np.full((nq, k), np.nan, np.float32)
        cos = np.full((nq, k), -np.inf, np.float32)
        reranked = np.zeros(nq, np.int64)
        for i in range(nq):
            valid = cand_i[i] >= 0
            pids, cs = cand_i[i][valid], cand_s[i][valid]
            rows = self.tf.rows_of(pids)
            sc = np.array([scored[i].get(int(r), np.nan) for r in rows], np.float32)
            # The re-ranked set is the longest prefix of the candidates that
            # was scored: ordering it by MaxSim and keeping the single-vector
            # order after it never lets a passage ranked low by both scores
            # jump ahead of a better single-vector candidate that was not
            # read in time. (Passages scored past a gap keep their place.)
            gap = np.flatnonzero(np.isnan(sc))
            m = int(gap[0]) if len(gap) else len(sc)
            sc[m:] = np.nan
            order = np.concatenate([np.argsort(-sc[:m], kind="stable"), np.arange(m, len(sc))])[:k]
            n = len(order)
            ids[i, :n], ms[i, :n], cos[i, :n] = pids[order], sc[order], cs[order]
            reranked[i] = m
        return SearchResult(ids=ids, maxsim=ms, cosine=cos, reranked=reranked, target=target_n,
                            candidates=(cand_i >= 0).sum(axis=1), prefetched=prefetched, hits=hits,
                            arrived=arrived, cut=reranked < target_n,
                            scored=np.array([len(s) for s in scored], np.int64), ann_s=t_ann - t0,
                            total_s=time.perf_counter() - t0, single_ids=cand_i[:, :k].copy())


# ----------------------------------------------------------------- the RAG corpus

TOKEN_KEY_SUFFIX = "fp16"


def token_key(max_length: int) -> str:
    from .minilm import TOKEN_ONNX_NAME

    return f"{TOKEN_ONNX_NAME}/max_length={int(max_length)}/{TOKEN_KEY_SUFFIX}"


@contextmanager
def _tokens_lock(index_dir: Path) -> Iterator[None]:
    """The lock of one index directory's token files: a slice's build does
    not wait for the full corpus' (an hour), and two builds of one file
    never mix."""
    from . import build_lock

    with build_lock(f"tokens-{Path(index_dir).name}"):
        yield


def ensure_tokens(index_dir: Path, threads: int = 2, batch_size: int = 16, progress: bool = True,
                  log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> TokenFile:
    """The token file of a RAG index directory (``<index_dir>/tokens.bin``:
    the passages the index holds), built if missing or stale: copied out of
    the full corpus' file when that one is built and current, else encoded
    (resumable; minutes per thousands of passages on two cores), one
    process at a time per directory (``build_lock``)."""
    from . import corpus, minilm, vindex

    index_dir = Path(index_dir)
    with _tokens_lock(index_dir):
        ids = vindex.indexed_ids(index_dir)
        passages = corpus.load_passages()
        if len(ids) and int(ids.max()) >= len(passages):
            raise TokenFileError(f"{index_dir} holds passage ids past the corpus ({len(passages)} passages): "
                                 "rebuild the index (scripts/prepare_rag.py --force)")
        texts = [passages[int(i)].text for i in ids]
        key = token_key(minilm.MAX_LENGTH)
        fp = fingerprint(ids, texts, key)
        out = index_dir / TOKENS_FILE
        if out.is_file() and read_header_fingerprint(out) == fp:
            return TokenFile(out)
        full = vindex.rag_index_dir(None) / TOKENS_FILE
        if full != out and full.is_file():
            all_ids = np.arange(len(passages), dtype=np.int64)
            if read_header_fingerprint(full) == fingerprint(all_ids, [p.text for p in passages], key):
                log(f"late: tokens of {len(ids)} passages copied from {full}")
                return extract_token_file(TokenFile(full), ids, out, fp)
        log(f"late: encoding the tokens of {len(ids)} passages -> {out}")
        enc = minilm.TokenEncoder(threads=threads, batch_size=batch_size)
        t0 = time.monotonic()
        tf = build_token_file(ids, texts, out, enc, key, label="late: tokens", progress=progress)
        log(f"late: {tf} in {time.monotonic() - t0:.0f}s")
        return tf


def query_embeddings(texts: Sequence[str], out: Path, threads: int = 2, max_tokens: int = 32,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sentence and token embeddings of queries (``TokenEncoder``), cached in
    ``out`` (.npz) under a fingerprint of the texts and the model."""
    from . import minilm

    key = f"{token_key(minilm.MAX_LENGTH)}/q{max_tokens}"
    fp = fingerprint(range(len(texts)), texts, key)
    out = Path(out)
    if out.is_file():
        with np.load(out) as z:
            if str(z["fingerprint"]) == fp:
                return z["vecs"], z["toks"], z["lens"]
    enc = minilm.TokenEncoder(threads=threads, batch_size=32)
    vecs, toks, lens = enc.encode_tokens(list(texts), max_tokens=max_tokens)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, vecs=vecs, toks=toks.astype(np.float16), lens=lens, fingerprint=np.array(fp))
    os.replace(tmp, out)
    return vecs, toks.astype(np.float16), lens


def ensure_compressed(index_dir: Path, nbits: int = 2, threads: int = 2, progress: bool = True) -> TokenFile:
    """The residual token file of a RAG index directory
    (``tokens-r<nbits>.bin``), compressed from its fp16 token file (built
    first if missing: :func:`ensure_tokens`), one process at a time."""
    src = ensure_tokens(index_dir, threads=threads, progress=progress)
    with _tokens_lock(index_dir):
        return compress_token_file(src, Path(index_dir) / compressed_name(nbits), nbits=nbits, threads=threads,
                                   progress=progress)


def open_index(index_dir: Path, mode: str, config: LateConfig | None = None, io_threads: int = 8,
               nbits: int = 0) -> LateSearcher:
    """A :class:`LateSearcher` over a RAG index directory's IVF index and
    token file (which must exist: :func:`ensure_tokens`, or with ``nbits``
    the residual file: :func:`ensure_compressed`), with the storage
    ``mode``. The faiss index is read, its arrays copied out, and dropped."""
    from . import vindex

    index_dir = Path(index_dir)
    if mode not in MODES:
        raise ValueError(f"storage mode must be one of {', '.join(MODES)}, not {mode!r}")
    probe = IvfProbe.load(index_dir / vindex.INDEX_FILE)
    tf = TokenFile(index_dir / (compressed_name(nbits) if nbits else TOKENS_FILE))
    return LateSearcher(probe, tf, open_storage(mode, tf, threads=io_threads), config)
