"""The exception tree users see.

``slipstream.Error`` is the root. Where a built-in exception means the same
thing, the subclass also derives from it (a bad configuration is a
``ValueError``), so callers can catch either.
"""

from __future__ import annotations


class Error(Exception):
    """Base class of every Slipstream error."""

    kind = "error"


class ConfigError(Error, ValueError):
    """A component, pipeline or option is declared wrongly."""

    kind = "invalid_spec"


class ServeError(Error, RuntimeError):
    """The node could not start or stopped with an error."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ComponentError(Error, RuntimeError):
    """A component returned something the runtime cannot use."""

    kind = "component_error"


class StoreError(Error):
    """The object store refused a request or could not be reached.

    ``kind`` is the node's error kind; ``status`` the HTTP status (None when
    no answer came back); ``key`` the key the request was about, if any."""

    kind = "store_error"

    def __init__(self, message: str, *, status: int | None = None, key: str | None = None):
        super().__init__(message)
        self.status = status
        self.key = key


class StoreNotFound(StoreError, LookupError):
    """No such key or version: never written, deleted, removed by retention,
    or nothing current at the time asked for."""

    kind = "not_found"


class StoreConflict(StoreError):
    """An ``if_version`` precondition failed. ``current`` is the key's latest
    version (0: never written), when the node said."""

    kind = "conflict"

    def __init__(self, message: str, *, status: int | None = None, key: str | None = None,
                 current: int | None = None):
        super().__init__(message, status=status, key=key)
        self.current = current


class StoreBadRequest(StoreError, ValueError):
    """A malformed key, prefix, option or value (refused before sending, or
    by the node)."""

    kind = "bad_request"


class StoreUnauthorized(StoreError, PermissionError):
    """A write without the node's admin token (or with a wrong one), or on a
    listener that takes no writes."""

    kind = "unauthorized"


class StoreGone(StoreError):
    """A watch cursor older than the change feed the node keeps: take a new
    cursor and re-read what you track."""

    kind = "gone"


class StoreUnavailable(StoreError, ConnectionError):
    """No node answers, or it is shutting down or overloaded."""

    kind = "unavailable"


class TensorFormatError(StoreError, ValueError):
    """A value is not well-formed named tensors (or arrays cannot be stored
    as such)."""

    kind = "bad_tensors"
