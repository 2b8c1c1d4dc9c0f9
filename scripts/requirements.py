"""Print the package's requirements, one per line, for `pip install -r`:
its dependencies and those of the extras named on the command line
(`python scripts/requirements.py dev,examples,torch`), read from
pyproject.toml, their one place. `make setup` installs them while the Rust
extension compiles (network and CPU at once)."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"requirements: unknown extras {unknown} (known: {sorted(optional)})")
    return list(project.get("dependencies", [])) + [r for e in extras for r in optional[e]]


if __name__ == "__main__":
    print("\n".join(requirements([e for a in sys.argv[1:] for e in a.split(",") if e])))
