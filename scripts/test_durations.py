"""Write tests/module_seconds.json, the seconds each test module took, from
a pytest run's ``--durations=0`` report (setup, call and teardown summed):

    .venv/bin/pytest -q -n 3 --dist loadscope --durations=0 tests > run.log
    .venv/bin/python scripts/test_durations.py run.log

`make test` hands the modules out longest first (tests/conftest.py): with
xdist's default order (most tests first), a two-test module of two minutes
was handed out late and ran past the others by a minute and a half.
Modules under two seconds are left out (they go last, in file order)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+([^:\s]+\.py)::")
OUT = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.json"


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    seconds: Counter[str] = Counter()
    for line in Path(sys.argv[1]).read_text().splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        raise SystemExit(f"no --durations=0 lines in {sys.argv[1]}")
    kept = {m: round(s) for m, s in seconds.most_common() if s >= 2}
    OUT.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{OUT}: {len(kept)} modules, {sum(kept.values())} s in all")


if __name__ == "__main__":
    main()
