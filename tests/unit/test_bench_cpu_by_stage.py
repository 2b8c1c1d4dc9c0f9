"""bench.cpu_by_stage's table: every process a row, the limit's figure beside
each stage it measured, the totals summed as measured."""

from __future__ import annotations

from bench.cpu_by_stage import markdown


def test_the_table_puts_each_process_beside_the_limit_and_sums_both() -> None:
    res = {"pipeline": "p", "served_as": {"A": "2x1t b4"}, "limit_ms": {"A": 3.0, "B": 1.0},
           "rows": [{"rate_rps": 5.0, "median_ms": {"node": 0.5, "A": 4.0, "B": 1.5, "generator": 0.25},
                     "total_ms": 6.25}]}
    md = markdown([res], 10.0, 3)
    lines = md.splitlines()
    assert "| process | limit | 5 req/s |" in lines
    assert "| node |  | 0.50 |" in lines  # the node has no offline figure
    assert "| A | 3.00 | 4.00 |" in lines
    assert "| **total** | **4.00** | **6.25** |" in lines
    assert "median of 3 run(s) of 10 s" in md
