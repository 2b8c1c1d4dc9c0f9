"""Shared fixtures: a real node (`slipstream serve`) with real worker
processes on a free port (``slipstream.testing.Node``), talked to over HTTP.
``Node`` and ``wait_for`` are imported from here by the tests.

Parallel runs: `make test` runs pytest-xdist workers with ``--dist
loadscope``: a module's tests run one after another on one worker, so its
module-scoped nodes start once, while other modules run beside it. Any
test may share the machine with any other: every node and service takes a
free port, and data built on first use is built under a lock
(``examples/models``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from slipstream.testing import CLI, Node, wait_for  # noqa: F401 (wait_for: re-exported to the tests)

ROOT = Path(__file__).resolve().parent.parent
APPS = Path(__file__).resolve().parent / "apps"
SLIPSTREAM = CLI  # `slipstream ...` in this interpreter


@pytest.fixture(scope="module")
def chain_node() -> Iterator[Node]:
    node = Node(str(APPS / "chain.py"), "--request-timeout", "2", "--max-body-mb", "1")
    node.wait_ready()
    yield node
    node.stop()


def shm_files_of(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"slipstream-{pid}-")] if os.path.isdir("/dev/shm") else []
