"""Type stubs of the compiled core (crates/slipstream-py)."""

from typing import final

__all__ = ["serve", "bench", "simulate", "Pool", "CoreError", "__version__"]

class CoreError(RuntimeError):
    """args: (kind, message)"""

@final
class Pool:
    @staticmethod
    def create(path: str, id: int, capacity: int) -> Pool: ...
    def unlink(self) -> None: ...
    @staticmethod
    def open(path: str) -> Pool: ...
    def alloc(self, nbytes: int) -> int: ...
    def free(self, offset: int, nbytes: int) -> None: ...
    @property
    def id(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...

def serve(
    spec_json: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    threads: int = 0,
    max_body_bytes: int = 0,
    request_timeout_s: float = 0.0,
    drain_timeout_s: float = 0.0,
    worker_start_timeout_s: float = 0.0,
    pool_mb: int = 0,
    admin_token: str | None = None,
    log: bool = True,
    store_dir: str | None = None,
    store_max_value_mb: int = 0,
    cluster_json: str | None = None,
) -> None: ...
def bench(config_json: str, quiet: bool = False) -> str: ...
def simulate(config_json: str) -> str: ...

__version__: str
