"""scripts/check_imports.py on small trees built here, and on the real package:
it fails, naming the cycle, when modules import each other in a loop (lazy
imports included; Rust test modules excluded), and passes otherwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "scripts" / "check_imports.py"


def check(mode: str, directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), mode, str(directory)], capture_output=True, text=True,
                          timeout=60)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


# --- Python ------------------------------------------------------------------------

PACKAGE_WITHOUT_CYCLE = {
    "pkg/__init__.py": "from pkg._internal.api import thing\nfrom pkg import store\n",
    "pkg/store.py": "from pkg._internal import api\nfrom ._internal.tables import DTYPES\n",
    "pkg/_internal/__init__.py": "",
    "pkg/_internal/tables.py": "DTYPES = ('float32',)\n",
    "pkg/_internal/api.py": """\
        from . import tables
        from .tables import DTYPES
        import json

        def thing():
            from pkg._internal import tables as t  # lazy, and still no cycle
            return t.DTYPES
        """,
}


def test_a_package_without_a_cycle_passes(tmp_path: Path) -> None:
    r = check("python", write_tree(tmp_path, PACKAGE_WITHOUT_CYCLE) / "pkg")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().count("\n") == 0  # one line
    assert "5 modules" in r.stdout and "no cycle" in r.stdout


def test_a_cycle_through_a_function_level_import_fails(tmp_path: Path) -> None:
    files = dict(PACKAGE_WITHOUT_CYCLE)
    files["pkg/_internal/tables.py"] = """\
        DTYPES = ('float32',)

        def guess():
            from pkg._internal.api import thing  # the import that closes the loop
            return thing
        """
    r = check("python", write_tree(tmp_path, files) / "pkg")
    assert r.returncode == 1
    assert "python: pkg._internal.api -> pkg._internal.tables -> pkg._internal.api" in r.stdout
    assert f"{Path('pkg/_internal/tables.py')}:4" in r.stdout  # where the lazy import is


def test_relative_and_package_forms_are_followed(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from .a import x\n",  # pkg.sub -> pkg.sub.a
        "pkg/sub/a.py": "x = 1\nfrom .. import sub\n",  # pkg.sub.a -> pkg.sub
    }
    r = check("python", write_tree(tmp_path, files) / "pkg")
    assert r.returncode == 1
    assert "python: pkg.sub -> pkg.sub.a -> pkg.sub" in r.stdout


def test_the_slipstream_package_has_no_cycle() -> None:
    r = check("python", ROOT / "python" / "slipstream")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no cycle" in r.stdout


# --- Rust ----------------------------------------------------------------------------


def rust_crate(root: Path, name: str, sources: dict[str, str], manifest_extra: str = "") -> None:
    files = {f"{name}/Cargo.toml": f'[package]\nname = "{name}"\nversion = "0.1.0"\n{manifest_extra}'}
    files.update({f"{name}/src/{rel}": text for rel, text in sources.items()})
    write_tree(root, files)


CRATE_WITHOUT_CYCLE = {
    "lib.rs": """\
        //! Mentions crate::b in a doc comment: not code.
        pub mod a;
        pub mod b;
        pub mod c;
        """,
    "a.rs": """\
        use crate::{b::Thing, c};
        pub fn f() -> Thing { c::g(); Thing }
        """,
    "b.rs": """\
        /// See [`crate::a::f`].
        pub struct Thing;
        pub const NAME: &str = "crate::a::f";
        pub const QUOTE: char = '"';
        pub fn h<'a>(s: &'a str) -> &'a str { s }
        """,
    "c/mod.rs": "pub mod inner;\npub fn g() { inner::k(); }\n",
    "c/inner.rs": "use super::super::b::Thing;\npub fn k() -> Option<Thing> { None }\n",
}


def test_a_crate_without_a_cycle_passes(tmp_path: Path) -> None:
    rust_crate(tmp_path, "alpha", CRATE_WITHOUT_CYCLE)
    r = check("rust", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 crates, 5 modules" in r.stdout


def test_a_module_cycle_through_grouped_uses_fails(tmp_path: Path) -> None:
    sources = dict(CRATE_WITHOUT_CYCLE)
    sources["a.rs"] = "use crate::{b::Thing, c::{self, inner::k}};\npub fn f() -> Thing { c::g(); k(); Thing }\n"
    sources["c/inner.rs"] = "use crate::{b::Thing, a::{self}};\npub fn k() -> Option<Thing> { None }\n"
    rust_crate(tmp_path, "alpha", sources)
    r = check("rust", tmp_path)
    assert r.returncode == 1
    assert "rust: alpha: crate::a -> crate::c::inner -> crate::a" in r.stdout
    assert f"crate::c::inner -> crate::a  ({tmp_path / 'alpha/src/c/inner.rs'}:1)" in r.stdout


def test_a_cycle_through_super_in_code_fails(tmp_path: Path) -> None:
    sources = dict(CRATE_WITHOUT_CYCLE)
    sources["b.rs"] = """\
        pub struct Thing;
        mod local {
            pub fn here() { super::h(); }  // within this file: no edge
        }
        pub fn h() { let _ = super::a::f(); }
        """
    rust_crate(tmp_path, "alpha", sources)
    r = check("rust", tmp_path)
    assert r.returncode == 1
    assert "rust: alpha: crate::a -> crate::b -> crate::a" in r.stdout
    assert f"crate::b -> crate::a  ({tmp_path / 'alpha/src/b.rs'}:5)" in r.stdout


def test_a_cycle_only_inside_cfg_test_passes(tmp_path: Path) -> None:
    sources = dict(CRATE_WITHOUT_CYCLE)
    sources["b.rs"] = """\
        pub struct Thing;

        #[cfg(test)]
        #[allow(unused)]
        mod tests {
            use crate::a::f;
            #[test]
            fn t() { let _ = f(); }
        }

        #[cfg(test)]
        mod helpers;
        """
    sources["b/helpers.rs"] = "pub fn make() { crate::a::f(); }\n"
    rust_crate(tmp_path, "alpha", sources)
    r = check("rust", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 modules" in r.stdout  # b/helpers.rs is test code, not a module of the library


def test_a_crate_cycle_fails_and_dev_dependencies_do_not_count(tmp_path: Path) -> None:
    lib = {"lib.rs": "pub fn f() {}\n"}
    rust_crate(tmp_path, "one", lib, '[dependencies]\ntwo = { path = "../two" }\n')
    rust_crate(tmp_path, "two", lib, '[dev-dependencies]\none = { path = "../one" }\n')
    assert check("rust", tmp_path).returncode == 0
    rust_crate(tmp_path, "two", lib, '[dependencies]\nthree.workspace = true\n')
    rust_crate(tmp_path, "three", lib, '[target.\'cfg(unix)\'.dependencies]\none = { path = "../one" }\n')
    r = check("rust", tmp_path)
    assert r.returncode == 1
    assert "rust: crates: one -> two -> three -> one" in r.stdout
