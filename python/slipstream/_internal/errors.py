"""The exception tree users see.

``slipstream.Error`` is the root. Where a built-in exception means the same
thing, the subclass also derives from it (a bad configuration is a
``ValueError``), so callers can catch either.
"""

from __future__ import annotations

from typing import Any


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


# --- requests to a node (ss.Client) ----------------------------------------
#
# One class per error kind the node sends (crates/slipstream-runtime/src/
# error.rs, in the `x-slipstream-error-kind` header of every error answer),
# so that callers catch `ss.Overloaded` instead of comparing strings. A kind
# this table does not know becomes the class of its HTTP status, else
# `RequestError`; `kind` always holds the node's own string.


_CLASS_STATUS: Any = object()


class RequestError(Error):
    """The node refused a request or could not answer it.

    ``kind``: the node's error kind; ``status``: the HTTP status (None when
    no answer came back, or the client refused the request before sending
    it); ``retry_after``: seconds the node asked the client to wait before
    retrying (429 and 503), else None."""

    kind = "request_error"
    status: int | None = None

    def __init__(self, message: str, *, kind: str | None = None, status: int | None = _CLASS_STATUS,
                 retry_after: float | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        if status is not _CLASS_STATUS:  # else the class's own
            self.status = status
        self.retry_after = retry_after


class BadRequest(RequestError, ValueError):
    """The request is malformed (400): not the protocol's shape, or refused
    by the client before sending (then ``status`` is None)."""

    kind = "bad_request"
    status = 400


class BadInput(BadRequest):
    """An input is missing or unexpected, or has the wrong dtype, shape or
    row count (400)."""

    kind = "bad_input"


class PayloadTooLarge(BadRequest):
    """The body is over the node's ``--max-body-mb`` (413)."""

    kind = "payload_too_large"
    status = 413


class Unauthorized(RequestError, PermissionError):
    """An admin route without the node's bearer token, or with a wrong one (401)."""

    kind = "unauthorized"
    status = 401


class Forbidden(RequestError, PermissionError):
    """An admin route on a node that listens beyond loopback without an admin token (403)."""

    kind = "forbidden"
    status = 403


class NotFound(RequestError, LookupError):
    """No such route, pipeline or stage (404)."""

    kind = "not_found"
    status = 404


class UnknownPipeline(NotFound):
    """The node serves no pipeline of that name (404)."""

    kind = "unknown_pipeline"


class UnknownStage(NotFound):
    """The pipeline has no stage of that name (404)."""

    kind = "unknown_stage"


class MethodNotAllowed(RequestError):
    """The route exists, but not for this HTTP method (405)."""

    kind = "method_not_allowed"
    status = 405


class Overloaded(RequestError):
    """Refused at admission: the request was predicted to miss its deadline
    (429). ``retry_after`` says when to try again."""

    kind = "overloaded"
    status = 429


class ComponentFailed(RequestError, RuntimeError):
    """A component raised, or returned outputs of the wrong shape (500);
    only the requests of that batch fail."""

    kind = "component_error"
    status = 500


class InternalError(RequestError, RuntimeError):
    """The node failed in a way that is not the request's fault (500)."""

    kind = "internal"
    status = 500


class Unavailable(RequestError, ConnectionError):
    """The node cannot serve the request now (503): a worker died with it in
    flight and no other replica could take it; retry after ``retry_after``."""

    kind = "unavailable"
    status: int | None = 503


class ShuttingDown(Unavailable):
    """The node is draining before it stops (503)."""

    kind = "shutting_down"


class ArenaFull(Unavailable):
    """The node's shared memory is exhausted for now (503)."""

    kind = "arena_full"


class Unreachable(Unavailable):
    """No node answers at the URL, or the connection broke before the answer
    was complete (no HTTP status)."""

    kind = "unreachable"
    status = None


class DeadlineExceeded(RequestError, TimeoutError):
    """The request's deadline (its SLO, or the client's tighter one) passed
    before its answer (504): it was dropped rather than answered late."""

    kind = "deadline_exceeded"
    status: int | None = 504


class RequestTimeout(DeadlineExceeded):
    """Not answered within the node's ``--request-timeout`` (504)."""

    kind = "timeout"


class ClientTimeout(DeadlineExceeded):
    """No answer within the client's own socket timeout (no HTTP status)."""

    kind = "client_timeout"
    status = None


class Cancelled(RequestError):
    """The node gave up the request because its client went away (never sent
    by the node; here for completeness of the kinds)."""

    kind = "cancelled"
    status = 499


#: The node's error kinds -> the class raised for them.
REQUEST_ERRORS: dict[str, type[RequestError]] = {
    "bad_request": BadRequest,
    "bad_input": BadInput,
    "payload_too_large": PayloadTooLarge,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "unknown_pipeline": UnknownPipeline,
    "unknown_stage": UnknownStage,
    "method_not_allowed": MethodNotAllowed,
    "overloaded": Overloaded,
    "component_error": ComponentFailed,
    "internal": InternalError,
    # Shared-memory failures other than a full arena (500).
    "io": InternalError,
    "bad_header": InternalError,
    "out_of_bounds": InternalError,
    "unavailable": Unavailable,
    "shutting_down": ShuttingDown,
    "arena_full": ArenaFull,
    # The object store's kinds, should an infer route ever carry them.
    "store_in_use": Unavailable,
    "store_unavailable": Unavailable,
    "deadline_exceeded": DeadlineExceeded,
    "timeout": RequestTimeout,
    "cancelled": Cancelled,
}

#: Fallback by HTTP status for kinds not in the table (a newer node, a proxy).
_BY_STATUS: dict[int, type[RequestError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 405: MethodNotAllowed,
    413: PayloadTooLarge, 429: Overloaded, 500: InternalError, 503: Unavailable, 504: DeadlineExceeded,
}


def request_error(status: int | None, kind: str | None, message: str,
                  retry_after: float | None = None) -> RequestError:
    """The exception for an error answer: by the node's kind, else by status."""
    cls = REQUEST_ERRORS.get(kind or "") or (_BY_STATUS.get(status) if status is not None else None) or RequestError
    return cls(message, kind=kind or cls.kind, status=status, retry_after=retry_after)


def from_core(e: BaseException) -> Error:
    """A ``slipstream._core.CoreError(kind, message)`` as the ``slipstream.Error``
    it stands for, so that users catch one tree: a configuration the core
    refused is a ``ConfigError``, anything else that stops a node a
    ``ServeError``."""
    if len(e.args) >= 2:
        kind, message = str(e.args[0]), str(e.args[1])
    else:
        kind, message = "internal", str(e)
    if kind in ("invalid_spec", "invalid_option", "invalid_config"):
        err = ConfigError(message)
        err.kind = kind
        return err
    return ServeError(kind, message)
