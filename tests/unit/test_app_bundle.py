"""The files a deployment carries (app_bundle.py): what goes in, what stays
out, the chunks in etcd checked against the signed layout, and paths moved
into the unpacked copy."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from slipstream._internal import app_bundle


class KV:
    """A dict with the etcd calls the bundle uses."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.d[key] = value

    def get(self, key: str) -> bytes | None:
        return self.d.get(key)

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.d if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self.d.pop(key, None)


def make_app(tmp_path: Path) -> tuple[Path, list[dict[str, str]]]:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "app.py").write_text("import helper\n")
    (src / "helper.py").write_text("X = 1\n")
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "mod.py").write_text("Y = 2\n")
    (src / "notes.txt").write_text("not code, not a seed: left out\n")
    (src / "small.txt").write_text("3")
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\x01\x02")
    big = tmp_path / "model.onnx"
    big.write_bytes(b"\0" * (app_bundle.SEED_MAX_BYTES + 1))
    seeds = [{"key": "/cfg/small", "path": str(src / "small.txt"), "content_type": "text/plain"},
             {"key": "/cfg/outside", "path": str(outside), "content_type": "application/octet-stream"},
             {"key": "/models/big", "path": str(big), "content_type": "application/octet-stream"}]
    return src / "app.py", seeds


def test_a_bundle_carries_code_and_small_seeds_and_moves_their_paths(tmp_path: Path) -> None:
    app, seeds = make_app(tmp_path)
    data, layout = app_bundle.pack(app, seeds)
    names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    assert names == {"app/app.py", "app/helper.py", "app/pkg/__init__.py", "app/pkg/mod.py", "app/small.txt",
                     "seeds/1/elsewhere.bin"}
    assert layout["seeds"] == {"/cfg/small": "app/small.txt", "/cfg/outside": "seeds/1/elsewhere.bin"}
    assert list(layout["external"]) == ["/models/big"], "a large seed goes through the store"
    kv = KV()
    app_bundle.publish(kv, "/r/", data, layout)
    assert all(len(v) <= app_bundle.CHUNK for v in kv.d.values())
    where = app_bundle.fetch(kv, "/r/", layout, into=tmp_path / "cache")
    assert (where / "app" / "pkg" / "mod.py").read_text() == "Y = 2\n"
    assert app_bundle.fetch(kv, "/r/", layout, into=tmp_path / "cache") == where, "unpacked once"
    spec = {"worker_argv": ["python", "-m", "w", "--app", f"{app}:main"], "store": {"pools": [], "seed": seeds}}
    moved = app_bundle.relocate(spec, layout, where)
    assert moved["worker_argv"][-1] == f"{where / 'app' / 'app.py'}:main"
    paths = {s["key"]: s["path"] for s in moved["store"]["seed"]}
    assert paths == {"/cfg/small": str(where / "app/small.txt"), "/cfg/outside": str(where / "seeds/1/elsewhere.bin"),
                     "/models/big": seeds[2]["path"]}
    # A newer deployment's bundle replaces it: the old chunks go.
    kv.put("/r/bundles/old/00000", b"x")
    assert app_bundle.prune(kv, "/r/", layout["sha256"]) == 1 and "/r/bundles/old/00000" not in kv.d


def test_bytes_that_do_not_match_the_signed_layout_are_refused(tmp_path: Path) -> None:
    app, seeds = make_app(tmp_path)
    data, layout = app_bundle.pack(app, seeds[:1])
    kv = KV()
    app_bundle.publish(kv, "/r/", data, layout)
    key = next(iter(kv.d))
    kv.d[key] = kv.d[key][:-1] + bytes([kv.d[key][-1] ^ 1])
    with pytest.raises(app_bundle.BundleError, match="do not match"):
        app_bundle.fetch(kv, "/r/", layout, into=tmp_path / "cache")
    kv.d.clear()
    with pytest.raises(app_bundle.BundleError, match="missing"):
        app_bundle.fetch(kv, "/r/", layout, into=tmp_path / "cache")


def test_an_app_too_large_to_carry_is_refused_with_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app, seeds = make_app(tmp_path)
    monkeypatch.setattr(app_bundle, "MAX_BYTES", 10)
    with pytest.raises(app_bundle.BundleError, match="--no-bundle"):
        app_bundle.pack(app, seeds)


def test_a_bundle_cannot_write_outside_its_directory(tmp_path: Path) -> None:
    import hashlib
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../escaped.py", "x = 1\n")
    data = buf.getvalue()
    layout = {"app": "app/app.py", "seeds": {}, "external": {}, "sha256": hashlib.sha256(data).hexdigest(),
              "size": len(data), "chunks": 1}
    kv = KV()
    app_bundle.publish(kv, "/r/", data, layout)
    with pytest.raises(app_bundle.BundleError, match="refusing"):
        app_bundle.fetch(kv, "/r/", layout, into=tmp_path / "cache")
    assert not (tmp_path / "escaped.py").exists() and not (tmp_path / "cache" / "escaped.py").exists()
