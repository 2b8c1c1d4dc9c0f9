"""The same pipelines under Ray Serve and under Slipstream
(``python -m bench.vs_ray.compare``; README.md here). ``ray_adapter.py``
and ``autoscaled.py`` run in Ray's own virtualenv as scripts; the rest runs
in the project's environment as modules of this package.
"""
