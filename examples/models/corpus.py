"""A retrieval corpus of Debian package descriptions, from apt's lists.

Every Debian package has a one-line summary (the short description) and a
paragraph or more of prose (the long description). The long descriptions are
the passages; each package's short description is a query whose one right
answer is that package's passage. It is real English text about software,
about 33k passages, available offline on any Debian machine: no hub, no
download beyond apt's own package lists.

Where the text lives: ``/var/lib/apt/lists/*_Packages*`` hold each package's
short description (and, in some archives, the long one), and
``*_i18n_Translation-en*`` hold the long descriptions. Debian's Docker
images turn the Translation files off (``Acquire::Languages "none"``); then
this module runs ``apt-get update -o Acquire::Languages=en`` (as root) to
fetch them. Lists may be compressed (.lz4, .gz, .xz): they are read with
``apt-helper cat-file``, which handles all of apt's formats.

Cleaning: the long description's paragraphs are joined into plain text
(one line per paragraph); a package whose long description is shorter than
``MIN_CHARS`` is dropped; packages whose long descriptions open with the same
paragraph (binary packages of one source: ``libfoo1``, ``libfoo-dev``,
``libfoo-doc``...) are near-duplicates whose queries would have several right
answers, so only one of them is kept (the longest text). Queries are taken only from
packages whose short description is unique in the corpus, and ``N_QUERIES``
of them are sampled with a fixed seed.

Output (in ``<data>/rag/``):
- ``passages.jsonl``: ``{"id", "package", "title", "text"}``, ``id`` = line number
- ``queries.jsonl``: ``{"query", "passage_id", "package"}``
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import data_dir

LISTS = Path("/var/lib/apt/lists")
MIN_CHARS = 80
N_QUERIES = 1000
SEED = 1234
CORPUS_VERSION = 1


class CorpusError(RuntimeError):
    pass


@dataclass
class Passage:
    id: int
    package: str
    title: str
    text: str


def rag_dir() -> Path:
    return data_dir("rag")


def passages_path() -> Path:
    return rag_dir() / "passages.jsonl"


def queries_path() -> Path:
    return rag_dir() / "queries.jsonl"


# ------------------------------------------------------------ reading apt

def _list_files(kind: str, lists: Path) -> list[Path]:
    pat = "*_Packages*" if kind == "packages" else "*_i18n_Translation-en*"
    files = [Path(p) for p in sorted(glob.glob(str(lists / pat)))]
    return [p for p in files if not p.name.endswith((".diff_Index", ".IndexDiff")) and p.is_file()]


def _read_list(path: Path) -> str:
    """Decompressed text of an apt list file, whatever its compression."""
    helper = Path("/usr/lib/apt/apt-helper")
    if helper.exists():
        r = subprocess.run([str(helper), "cat-file", str(path)], capture_output=True)
        if r.returncode == 0:
            return r.stdout.decode("utf-8", errors="replace")
    # Fallbacks without apt-helper.
    data = path.read_bytes()
    if path.suffix == ".gz":
        import gzip
        data = gzip.decompress(data)
    elif path.suffix == ".xz":
        import lzma
        data = lzma.decompress(data)
    elif path.suffix == ".lz4":
        raise CorpusError(f"cannot read {path}: it is lz4-compressed and /usr/lib/apt/apt-helper is missing")
    return data.decode("utf-8", errors="replace")


def _stanzas(text: str) -> Iterator[dict[str, str]]:
    """RFC822-style stanzas; continuation lines kept with their newlines."""
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in block.split("\n"):
            if not line:
                continue
            if line[0] in " \t" and key is not None:
                fields[key] += "\n" + line
            else:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields:
            yield fields


def _split_description(value: str) -> tuple[str, str]:
    """Debian description field -> (short, long as plain text). In the long
    part, a line ' .' separates paragraphs and lines indented by two or more
    spaces are verbatim (lists, code)."""
    first, _, rest = value.partition("\n")
    paras: list[list[str]] = [[]]
    for line in rest.split("\n"):
        body = line[1:] if line.startswith(" ") else line
        if body.strip() == ".":
            paras.append([])
        elif body.strip():
            paras[-1].append(body.strip())
    text = "\n".join(" ".join(p) for p in paras if p)
    return first.strip(), re.sub(r"[ \t]+", " ", text).strip()


def apt_update() -> None:
    """Fetch the English Translation lists (long descriptions)."""
    if shutil.which("apt-get") is None:
        raise CorpusError("apt-get not found: the RAG corpus is built from Debian's package lists (Debian/Ubuntu only)")
    if os.geteuid() != 0:
        raise CorpusError(
            "the apt lists hold no long descriptions (no *_Translation-en files in /var/lib/apt/lists). "
            "Run as root: apt-get update -o Acquire::Languages=en"
        )
    print("corpus: apt-get update -o Acquire::Languages=en (fetching long descriptions) ...", flush=True)
    r = subprocess.run(["apt-get", "update", "-o", "Acquire::Languages=en"], capture_output=True, text=True)
    if r.returncode != 0:
        raise CorpusError(f"apt-get update failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def read_descriptions(lists: Path = LISTS, update: bool = True) -> dict[str, tuple[str, str]]:
    """``package -> (short, long)`` from the apt lists (the newest stanza of a
    package wins, as files are read in name order; security/updates lists
    sort after the main one)."""
    translations = _list_files("translation", lists)
    if not translations and update:
        apt_update()
        translations = _list_files("translation", lists)
    out: dict[str, tuple[str, str]] = {}
    for f in _list_files("packages", lists):
        for st in _stanzas(_read_list(f)):
            if "Package" in st and "Description" in st:
                short, long = _split_description(st["Description"])
                if long:
                    out[st["Package"]] = (short, long)
    for f in translations:
        for st in _stanzas(_read_list(f)):
            if "Package" in st and "Description-en" in st:
                out[st["Package"]] = _split_description(st["Description-en"])
    if not out:
        raise CorpusError(
            f"no package descriptions found in {lists}: run `apt-get update -o Acquire::Languages=en` "
            "(the long descriptions are in *_Translation-en files)"
        )
    if not any(long for _, long in out.values()):
        raise CorpusError(f"the lists in {lists} have short descriptions only: run `apt-get update -o Acquire::Languages=en`")
    return out


# ----------------------------------------------------------------- build

def build(lists: Path = LISTS, n_queries: int = N_QUERIES, seed: int = SEED, force: bool = False,
          update: bool = True) -> tuple[Path, Path]:
    """Write ``passages.jsonl`` and ``queries.jsonl`` (kept if present unless
    ``force``). Returns their paths."""
    pp, qp = passages_path(), queries_path()
    if pp.is_file() and qp.is_file() and not force:
        return pp, qp
    desc = read_descriptions(lists, update=update)
    # Binary packages built from one source often repeat the same first
    # paragraph and add a sentence ("This package contains the headers").
    # Keep one package per first paragraph: the one with the longest text.
    groups: dict[str, list[str]] = {}
    tiny = 0
    for pkg, (_, long) in desc.items():
        if len(long) < MIN_CHARS:
            tiny += 1
            continue
        groups.setdefault(" ".join(long.split("\n")[0].lower().split()), []).append(pkg)
    kept = sorted(min(g, key=lambda p: (-len(desc[p][1]), p)) for g in groups.values())
    passages = [Passage(i, p, desc[p][0], desc[p][1]) for i, p in enumerate(kept)]
    titles = Counter(p.title.lower() for p in passages)
    candidates = [p for p in passages if titles[p.title.lower()] == 1 and len(p.title) >= 8]
    rng = random.Random(seed)
    queries = rng.sample(candidates, min(n_queries, len(candidates)))
    _write_jsonl(pp, ({"id": p.id, "package": p.package, "title": p.title, "text": p.text} for p in passages))
    _write_jsonl(qp, ({"query": p.title, "passage_id": p.id, "package": p.package} for p in queries))
    print(f"corpus: {len(desc)} packages -> {len(passages)} passages "
          f"(dropped {tiny} tiny, {len(desc) - tiny - len(passages)} repeating another's first paragraph), "
          f"{len(queries)} queries -> {pp.parent}", flush=True)
    return pp, qp


def _write_jsonl(path: Path, rows: Iterator[dict]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def load_passages(path: Path | None = None) -> list[Passage]:
    path = path or passages_path()
    if not path.is_file():
        raise CorpusError(f"{path} is missing: run `python scripts/prepare_rag.py --small` (or without --small)")
    with path.open() as f:
        return [Passage(**json.loads(line)) for line in f]


def load_queries(path: Path | None = None) -> list[dict]:
    path = path or queries_path()
    if not path.is_file():
        raise CorpusError(f"{path} is missing: run `python scripts/prepare_rag.py --small` (or without --small)")
    with path.open() as f:
        return [json.loads(line) for line in f]
