"""Slipstream's benchmarks, one module per benchmark, run from the
repository root as modules (``python -m bench.limit``; the Makefile's
``bench*`` targets do). What they share (the machine record, the percentile
convention, the load generators, starting nodes, writing results) is in
``bench.harness``; the Ray Serve side of the comparisons is ``bench.vs_ray``.
Results go to bench/results/ as JSON and Markdown.
"""
