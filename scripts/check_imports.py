#!/usr/bin/env python3
"""Fails when modules import each other in a cycle: dependencies point one way.

    check_imports.py python python/slipstream   # the Python package's modules
    check_imports.py rust crates                # each crate's modules, and the crates

Exit status 0 with a one-line summary when there is no cycle; 1 with each
cycle named (``python: a -> b -> a``), and where each of its imports is,
when there is. Every strongly connected component of more than one member
is reported; when it holds more than one cycle, the cycles shown between
them cover each of its imports once at least.

What counts as an import:

- **Python** (every module of the package rooted at DIR): every ``import``
  statement anywhere in a module, in functions and under ``TYPE_CHECKING``
  too, since a lazy import is still a dependency, only hidden. ``from p
  import x`` depends on the module ``p.x`` when there is one, else on ``p``;
  relative forms (``from . import x``, ``from .mod import y``) resolve
  against the importing module's package. Importing a submodule does not
  count as depending on its parent package (Python runs the parent's
  ``__init__`` first, but every submodule would then "import" its package).
  Compiled modules and stubs (``_core.abi3.so``, ``.pyi``) are leaves.
- **Rust**, for each crate under DIR (``DIR/*/Cargo.toml``): (1) the crate's
  modules, one per file (``lib.rs``, ``main.rs`` and ``mod.rs`` are their
  directory's module; ``src/bin`` holds other crates and is skipped), with
  an edge for every ``crate::a::...`` path (``use`` or not, grouped ``use
  crate::{a, b::c}`` expanded) and every ``super::...`` path (resolved from
  the file's module, inline ``mod x { }`` blocks included), each to the
  deepest module file the path names. Comments, doc comments and string
  literals are not code. An item under ``#[cfg(test)]`` is skipped, and so
  is a file that is one (``#[cfg(test)] mod tests;``): tests may import
  freely. (2) The crates, with an edge for each ``[dependencies]`` (and
  ``[target.*.dependencies]``) entry naming another crate under DIR;
  ``[dev-dependencies]`` do not count.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


# --- graphs ------------------------------------------------------------------------


@dataclass
class Graph:
    """Who imports whom: edges[a][b] is where a first imports b (``file:line``)."""

    nodes: set[str]
    edges: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, src: str, dst: str, where: str) -> None:
        """Record ``src`` importing ``dst`` (a module importing itself is no cycle)."""
        if src != dst and dst in self.nodes:
            self.edges.setdefault(src, {}).setdefault(dst, where)

    def targets(self, node: str) -> list[str]:
        return sorted(self.edges.get(node, {}))

    def edge_count(self) -> int:
        return sum(len(v) for v in self.edges.values())


def cyclic_components(g: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's
    algorithm, with an explicit stack), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> Iterator[str]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(g.targets(node))

    for root in sorted(g.nodes):
        if root in index:
            continue
        work = [(root, visit(root))]
        while work:
            node, pending = work[-1]
            for nxt in pending:
                if nxt not in index:
                    work.append((nxt, visit(nxt)))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _shortest_path(g: Graph, start: str, goal: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> goal inside ``within`` (it exists:
    both lie in one strongly connected component)."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            break
        for nxt in g.targets(node):
            if nxt in within and nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    path = [goal]
    while path[-1] != start:
        prev = came_from[path[-1]]
        assert prev is not None
        path.append(prev)
    return path[::-1]


def covering_cycles(g: Graph, component: list[str]) -> list[list[str]]:
    """Cycles of the component that between them take each of its edges:
    for each edge a -> b not yet taken, a -> b and the shortest way back."""
    members = set(component)
    taken: set[tuple[str, str]] = set()
    cycles = []
    for a in component:
        for b in g.targets(a):
            if b in members and (a, b) not in taken:
                cycle = [a, *_shortest_path(g, b, a, members)]
                taken.update(zip(cycle[:-1], cycle[1:], strict=True))
                cycles.append(cycle)
    return cycles


def describe_cycles(label: str, noun: str, g: Graph) -> list[str]:
    """One block of lines per cyclic component of ``g``: the cycle (or the
    members and the cycles among them), then where each import is."""
    lines = []
    for component in cyclic_components(g):
        cycles = covering_cycles(g, component)
        if len(cycles) == 1:
            lines.append(f"{label}: {' -> '.join(cycles[0])}")
        else:
            lines.append(f"{label}: {len(component)} {noun} import each other in {len(cycles)} cycles: "
                         f"{', '.join(component)}")
            lines += [f"  {' -> '.join(cycle)}" for cycle in cycles]
        members = set(component)
        lines += [f"    {a} -> {b}  ({g.edges[a][b]})" for a in component for b in g.targets(a) if b in members]
    return lines


# --- Python --------------------------------------------------------------------------


def python_modules(root: Path) -> dict[str, Path | None]:
    """The package's modules: dotted name -> source file (None for a compiled
    module or a stub, which import nothing this check can see)."""
    package = root.resolve().name
    modules: dict[str, Path | None] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or not path.is_file():
            continue
        where = [package, *rel.parts[:-1]]
        if path.suffix == ".py":
            name = where if path.stem == "__init__" else [*where, path.stem]
            modules[".".join(name)] = path
        elif path.suffix in (".pyi", ".so", ".pyd") and path.name != "__init__.pyi":
            modules.setdefault(".".join([*where, path.name.split(".")[0]]), None)
    return modules


def _deepest_module(dotted: str, modules: dict[str, Path | None]) -> str | None:
    """The module the longest prefix of ``dotted`` names, if any."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path | None]) -> Iterator[str]:
    """The package's modules that one import statement depends on."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _deepest_module(alias.name, modules)
            if target is not None:
                yield target
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + (node.module.split(".") if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            target = submodule if submodule in modules else _deepest_module(base, modules)
            if target is not None:
                yield target


def python_graph(root: Path) -> Graph:
    modules = python_modules(root)
    g = Graph(set(modules))
    for name, path in modules.items():
        if path is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            for target in _imported(node, name, path.name == "__init__.py", modules):
                g.add(name, target, f"{path}:{getattr(node, 'lineno', 0)}")
    return g


def check_python(root: Path) -> tuple[list[str], str]:
    """(the cycles' lines, the summary line)."""
    g = python_graph(root)
    return describe_cycles("python", "modules", g), \
        f"python: {len(g.nodes)} modules, {g.edge_count()} imports among them, no cycle"


# --- Rust: reading source ---------------------------------------------------------------

_LITERAL_OR_COMMENT = re.compile(r"""//|/\*|[bc]?r\#*"|[bc]?"|b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])'""")
_STRING_BODY = re.compile(r'(?:\\.|[^"\\])*"', re.S)
_BLOCK_COMMENT_MARK = re.compile(r"/\*|\*/")
_VISIBILITY_PATH = re.compile(r"\bpub\s*\(\s*in\s+[^)]*\)")
_CFG_TEST = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
_INNER_CFG_TEST = re.compile(r"#\s*!\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
_OUTER_ATTRIBUTE = re.compile(r"\s*#\s*\[")
_MOD_DECLARATION = re.compile(r"\s*(?:pub\s*(?:\([^)]*\))?\s*)?mod\s+(?:r#)?(\w+)\s*;")
_INLINE_MOD = re.compile(r"\bmod\s+(?:r#)?\w+\s*\{")
_PATH_START = re.compile(r"(?<![\w$])(?:\$?crate|super)\s*::")
_SEGMENT = re.compile(r"\s*(?:r#)?([A-Za-z_]\w*|\*)")
_PATH_SEP = re.compile(r"\s*::")
_ALIAS = re.compile(r"\s+as\s+(?:r#)?\w+")


def _blank(text: str) -> str:
    """``text`` with everything but newlines as spaces (offsets and line numbers stay)."""
    return re.sub(r"[^\n]", " ", text)


def strip_rust(source: str) -> str:
    """The source with comments (doc comments too) and string and char
    literals blanked, so that only code is left to search."""
    out = []
    pos = 0
    while True:
        m = _LITERAL_OR_COMMENT.search(source, pos)
        if m is None:
            out.append(source[pos:])
            return "".join(out)
        out.append(source[pos:m.start()])
        token = m.group()
        if token == "//":
            end = source.find("\n", m.start())
            end = len(source) if end < 0 else end
        elif token == "/*":
            depth, end = 0, m.start()
            for mark in _BLOCK_COMMENT_MARK.finditer(source, m.start()):
                depth += 1 if mark.group() == "/*" else -1
                end = mark.end()
                if depth == 0:
                    break
            else:
                end = len(source)
        elif token.endswith('"') and "r" in token:  # raw string: ends at a quote and as many #
            closing = '"' + "#" * token.count("#")
            end = source.find(closing, m.end())
            end = len(source) if end < 0 else end + len(closing)
        elif token.endswith('"'):
            body = _STRING_BODY.match(source, m.end())
            end = body.end() if body else len(source)
        else:  # a char literal
            end = m.end()
        out.append(_blank(source[m.start():end]))
        pos = end


def _matching_brace(code: str, open_at: int, pair: str = "{}") -> int:
    """The offset just past the bracket that closes the one at ``open_at``
    (``pair``: the opening and closing characters)."""
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == pair[0]:
            depth += 1
        elif code[i] == pair[1]:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(code)


def _item_end(code: str, start: int) -> int:
    """Where the item beginning at ``start`` ends: its ``;`` at the top level,
    or the ``}`` closing its first top-level block."""
    depth = 0
    for i in range(start, len(code)):
        c = code[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "{" and depth == 0:
            return _matching_brace(code, i)
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == ";" and depth == 0:
            return i + 1
    return len(code)


def drop_test_items(code: str) -> tuple[str, list[str]]:
    """The code without its ``#[cfg(test)]`` items (blanked), and the names of
    the child modules declared under ``#[cfg(test)]`` in files of their own."""
    test_children = []
    while (m := _CFG_TEST.search(code)) is not None:
        start = m.end()
        while (attr := _OUTER_ATTRIBUTE.match(code, start)) is not None:  # further attributes of the same item
            start = _matching_brace(code, attr.end() - 1, "[]")
        declared = _MOD_DECLARATION.match(code, start)
        if declared is not None:
            test_children.append(declared.group(1))
        end = _item_end(code, start)
        code = code[:m.start()] + _blank(code[m.start():end]) + code[end:]
    return code, test_children


# --- Rust: paths ------------------------------------------------------------------------


def parse_use_tree(code: str, pos: int) -> tuple[list[list[str]], int]:
    """The paths of ``a::b::{c, d::e}`` starting at ``pos`` (each a list of
    segments, groups expanded) and the offset after it."""
    segments: list[str] = []
    while True:
        brace = re.compile(r"\s*\{").match(code, pos)
        if brace is not None:
            paths: list[list[str]] = []
            pos = brace.end()
            while True:
                close = re.compile(r"\s*[},]").match(code, pos)
                if close is not None:
                    pos = close.end()
                    if close.group().strip() == "}":
                        break
                    continue
                inner, after = parse_use_tree(code, pos)
                if after == pos:  # not a path: malformed, stop here
                    break
                paths += inner
                pos = after
            return [segments + p for p in paths] or [segments], pos
        segment = _SEGMENT.match(code, pos)
        if segment is None:
            return [segments], pos
        segments.append(segment.group(1))
        pos = segment.end()
        sep = _PATH_SEP.match(code, pos)
        if sep is None:
            alias = _ALIAS.match(code, pos)
            return [segments], alias.end() if alias else pos
        pos = sep.end()


@dataclass
class RustFile:
    module: tuple[str, ...]
    path: Path
    code: str


def _inline_depths(code: str) -> list[tuple[int, int]]:
    """The spans of the inline ``mod x { ... }`` blocks of a file."""
    return [(m.start(), _matching_brace(code, m.end() - 1)) for m in _INLINE_MOD.finditer(code)]


def _resolve(base: tuple[str, ...], segments: list[str], modules: set[tuple[str, ...]]) -> tuple[str, ...]:
    """The deepest module file that ``segments``, read from ``base``, name."""
    here = base
    for seg in segments:
        if (*here, seg) not in modules:
            break
        here = (*here, seg)
    return here


def module_references(f: RustFile, modules: set[tuple[str, ...]]) -> Iterator[tuple[tuple[str, ...], int]]:
    """(module, line) for each ``crate::`` and ``super::`` path of the file."""
    inline = _inline_depths(f.code)
    pos = 0
    while (m := _PATH_START.search(f.code, pos)) is not None:
        paths, pos = parse_use_tree(f.code, m.start() + (f.code[m.start()] == "$"))
        line = f.code.count("\n", 0, m.start()) + 1
        for segments in paths:
            if segments[0] == "crate":
                yield _resolve((), segments[1:], modules), line
                continue
            ups = 0
            while ups < len(segments) and segments[ups] == "super":
                ups += 1
            # Inside k inline modules, the first k `super`s stay in this file.
            beyond_file = ups - sum(1 for a, b in inline if a < m.start() < b)
            if 0 < beyond_file <= len(f.module):
                yield _resolve(f.module[:len(f.module) - beyond_file], segments[ups:], modules), line


def crate_files(crate: Path) -> list[RustFile]:
    """The crate's library (or binary) module files, test-only ones left out."""
    src = crate / "src"
    root = src / "lib.rs" if (src / "lib.rs").is_file() else src / "main.rs"
    if not root.is_file():
        return []
    files = [RustFile((), root, "")]
    for path in sorted(src.rglob("*.rs")):
        rel = path.relative_to(src)
        if rel.parts[0] == "bin" or path.parent == src and path.name in ("lib.rs", "main.rs"):
            continue
        parts = rel.with_suffix("").parts
        files.append(RustFile(tuple(parts[:-1] if parts[-1] == "mod" else parts), path, ""))
    test_modules: list[tuple[str, ...]] = []
    for f in files:
        code = strip_rust(f.path.read_text(encoding="utf-8"))
        if _INNER_CFG_TEST.search(code):  # #![cfg(test)]: the whole file
            test_modules.append(f.module)
        f.code, test_children = drop_test_items(_VISIBILITY_PATH.sub(lambda m: _blank(m.group()), code))
        test_modules += [(*f.module, child) for child in test_children]
    return [f for f in files if not any(f.module[:len(t)] == t for t in test_modules)]


def _module_name(module: tuple[str, ...]) -> str:
    return "::".join(("crate", *module))


def crate_module_graph(crate: Path) -> Graph:
    files = crate_files(crate)
    modules = {f.module for f in files}
    g = Graph({_module_name(m) for m in modules})
    for f in files:
        for target, line in module_references(f, modules):
            g.add(_module_name(f.module), _module_name(target), f"{f.path}:{line}")
    return g


def _package_name(manifest: Path) -> str:
    return str(tomllib.loads(manifest.read_text(encoding="utf-8"))["package"]["name"])


def crates_graph(crates_dir: Path) -> tuple[Graph, dict[str, Path]]:
    """The workspace crates under ``crates_dir`` (name -> directory) and their
    normal dependencies on each other."""
    manifests = sorted(crates_dir.glob("*/Cargo.toml"))
    dirs = {_package_name(m): m.parent for m in manifests}
    g = Graph(set(dirs))
    for name, d in dirs.items():
        manifest = tomllib.loads((d / "Cargo.toml").read_text(encoding="utf-8"))
        tables = [("dependencies", manifest.get("dependencies", {}))]
        tables += [(f"target.{t}.dependencies", spec.get("dependencies", {}))
                   for t, spec in manifest.get("target", {}).items()]
        for table, deps in tables:
            for key, spec in deps.items():
                dep = spec.get("package", key) if isinstance(spec, dict) else key
                g.add(name, dep, f"{d / 'Cargo.toml'} [{table}] {key}")
    return g, dirs


def check_rust(crates_dir: Path) -> tuple[list[str], str]:
    """(the cycles' lines, the summary line)."""
    crates, dirs = crates_graph(crates_dir)
    lines = describe_cycles("rust: crates", "crates", crates)
    modules = 0
    for name, d in sorted(dirs.items()):
        g = crate_module_graph(d)
        modules += len(g.nodes)
        lines += describe_cycles(f"rust: {name}", "modules", g)
    return lines, (f"rust: {len(dirs)} crates, {modules} modules: no cycle among the crates "
                   "or among any crate's modules")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fail when modules import each other in a cycle.")
    ap.add_argument("language", choices=["python", "rust"],
                    help="python: the package rooted at DIR; rust: each crate under DIR, and the crates")
    ap.add_argument("dir", type=Path)
    a = ap.parse_args(argv)
    if not a.dir.is_dir():
        print(f"check_imports: {a.dir} is not a directory", file=sys.stderr)
        return 2
    cycles, summary = check_python(a.dir) if a.language == "python" else check_rust(a.dir)
    if not cycles:
        print(summary)
        return 0
    print("\n".join(cycles))
    found = sum(1 for line in cycles if not line.startswith(" "))
    print(f"{a.language}: {found} import cycle(s): make dependencies point one way", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
