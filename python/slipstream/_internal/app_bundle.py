"""A deployment's files, carried to every node: no shared file system and no
identical paths needed.

``slipstream deploy app.py`` packs what the app's workers import and what
its pipelines seed into one zip (the bundle): the app file, the Python
modules and packages beside it (the app's directory is on the workers'
``sys.path``, so that is what a sibling import can reach), and every seed
file up to 1 MiB. A larger seed (a model, an index) travels through the
cluster's store instead: a node whose machine has the file at the path the
app names seeds it, and a node without it waits until the key is in the
store (its workers then fetch it from the nodes holding it). The bundle is written to etcd in chunks under
``/slipstream/<cluster>/bundles/<sha256>/``, before the deploy record that
names it (its SHA-256, size and layout) is signed and published, so a node
never sees a record whose bundle is incomplete. A node fetches the chunks,
checks the SHA-256 against the signed record (so the bytes are the
deployer's: a process without the cluster token can change neither), and
unpacks them once into its cache (``$XDG_CACHE_HOME/slipstream/deploys/<sha>``),
then runs the spec with its paths moved there. The seeds then go into the
cluster's store as on one machine (the first node to start puts them; the
others find them there).

Why etcd and not the object store: the store lives in the nodes, and
before the first deployment no node runs one. The bundle is bounded
(``MAX_BYTES``, 16 MiB, as Kubernetes bounds a ConfigMap to what etcd
holds well), which fits code and small seed files. Old bundles are deleted
when a new deployment replaces them.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Protocol

#: The largest bundle a deployment carries.
MAX_BYTES = 16 << 20
#: The largest seed file a bundle carries; larger ones go through the store.
SEED_MAX_BYTES = 1 << 20
#: Bytes per etcd value (well under etcd's 1.5 MiB request limit once base64'd).
CHUNK = 512 << 10


class KV(Protocol):
    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def keys(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...


class BundleError(Exception):
    pass


def _app_files(app: Path) -> list[tuple[Path, str]]:
    """The app file and the Python modules and packages beside it, as
    (file, name in the bundle) pairs."""
    root = app.parent
    out = [(app, f"app/{app.name}")]
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".py" and p != app:
            out.append((p, f"app/{p.name}"))
        elif p.is_dir() and (p / "__init__.py").is_file():
            for f in sorted(p.rglob("*.py")):
                if "__pycache__" not in f.parts:
                    out.append((f, f"app/{f.relative_to(root).as_posix()}"))
    return out


def pack(app: Path, seeds: list[dict[str, Any]]) -> tuple[bytes, dict[str, Any]]:
    """The bundle for `app` and `seeds` (the spec's seed entries), and its
    layout (where the app and each seed are inside it)."""
    files = _app_files(app)
    layout: dict[str, Any] = {"app": f"app/{app.name}", "seeds": {}, "external": {}}
    named = dict(files)
    for i, seed in enumerate(seeds):
        path = Path(seed["path"])
        if path.stat().st_size > SEED_MAX_BYTES:
            # Too large to carry: a node whose machine has it seeds the
            # cluster's store, and the others wait for it there.
            layout["external"][seed["key"]] = {"path": str(path), "size": path.stat().st_size}
            continue
        if path not in named:
            # A seed under the app's directory keeps its place (the app may
            # name it relative to itself); others get one of their own.
            inside = path.is_relative_to(app.parent)
            named[path] = f"app/{path.relative_to(app.parent).as_posix()}" if inside else f"seeds/{i}/{path.name}"
            files.append((path, named[path]))
        layout["seeds"][seed["key"]] = named[path]
    total = sum(f.stat().st_size for f, _ in files)
    if total > MAX_BYTES:
        largest = sorted(files, key=lambda fn: -fn[0].stat().st_size)[:3]
        sizes = ", ".join(f"{f} ({f.stat().st_size / 2**20:.1f} MiB)" for f, _ in largest)
        raise BundleError(
            f"the app's files and seeds come to {total / 2**20:.1f} MiB, over the {MAX_BYTES >> 20} MiB a "
            f"deployment carries (largest: {sizes}); keep data out of the app's directory (seeds over "
            f"{SEED_MAX_BYTES >> 20} MiB travel through the store), or deploy with --no-bundle "
            "(every node then needs the same files at the same paths)")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for f, name in files:
            z.write(f, name)
    data = buf.getvalue()
    layout.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data), chunks=(len(data) + CHUNK - 1) // CHUNK)
    return data, layout


def publish(kv: KV, root: str, data: bytes, layout: dict[str, Any]) -> None:
    """Write the bundle's chunks under ``<root>bundles/<sha>/``."""
    for i in range(layout["chunks"]):
        kv.put(f"{root}bundles/{layout['sha256']}/{i:05d}", data[i * CHUNK:(i + 1) * CHUNK])


def prune(kv: KV, root: str, keep_sha: str) -> int:
    """Delete the chunks of every bundle but `keep_sha`'s; how many."""
    stale = [k for k in kv.keys(f"{root}bundles/") if not k.startswith(f"{root}bundles/{keep_sha}/")]
    for k in stale:
        kv.delete(k)
    return len(stale)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slipstream" / "deploys"


def fetch(kv: KV, root: str, layout: dict[str, Any], into: Path | None = None) -> Path:
    """The bundle unpacked on this machine (fetched and checked first
    unless an earlier fetch already unpacked it); its directory."""
    sha = layout["sha256"]
    dest = (into or cache_dir()) / sha
    if (dest / ".complete").is_file():
        return dest
    parts = []
    for i in range(layout["chunks"]):
        chunk = kv.get(f"{root}bundles/{sha}/{i:05d}")
        if chunk is None:
            raise BundleError(f"bundle {sha[:12]}: chunk {i} of {layout['chunks']} is missing from etcd "
                              "(a newer deployment replaced it?)")
        parts.append(chunk)
    data = b"".join(parts)
    if hashlib.sha256(data).hexdigest() != sha or len(data) != layout["size"]:
        raise BundleError(f"bundle {sha[:12]}: the bytes in etcd do not match the signed deploy record")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=dest.parent))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for info in z.infolist():
                name = Path(info.filename)
                if name.is_absolute() or ".." in name.parts:
                    raise BundleError(f"bundle {sha[:12]}: refusing the path {info.filename!r}")
            z.extractall(tmp)
        (tmp / ".complete").write_text(sha)
        try:
            tmp.rename(dest)
        except OSError:  # another node on this machine unpacked it first
            if not (dest / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def relocate(spec: dict[str, Any], layout: dict[str, Any], where: Path) -> dict[str, Any]:
    """`spec` with its app and seed paths moved into the unpacked bundle at `where`."""
    argv = list(spec["worker_argv"])
    i = argv.index("--app") + 1
    attr = argv[i].rsplit(":", 1)[1] if ":" in Path(argv[i]).name else None
    argv[i] = str(where / layout["app"]) + (f":{attr}" if attr else "")
    seeds = [dict(s, path=str(where / layout["seeds"][s["key"]])) if s["key"] in layout["seeds"] else s
             for s in spec["store"]["seed"]]
    return {**spec, "worker_argv": argv, "store": {**spec["store"], "seed": seeds}}
