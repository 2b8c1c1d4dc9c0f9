"""The exception tree users see, and the one reading of a node's error answers.

``slipstream.Error`` is the root. Where a built-in exception means the same
thing, the subclass also derives from it (a bad configuration is a
``ValueError``), so callers can catch either.

Every error answer of a node carries its kind in the
``x-slipstream-error-kind`` header (and ``retry-after`` on 429 and 503); the
body is ``{"error": {"kind", "message"}}`` (the pipeline API, the store, the
admin routes) or KServe v2's ``{"error": "<message>"}``.
``error_from_response`` reads all of that, for the client, the store client
and the CLI alike, into the class of the kind: from the requests tree
(``RequestError``) or the store's (``StoreError``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
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


#: The store's error kinds -> the class raised for them (a store request's
#: errors are the ``StoreError`` tree, whatever the node's kind).
STORE_ERRORS: dict[str, type[StoreError]] = {
    "not_found": StoreNotFound,
    "conflict": StoreConflict,
    "gone": StoreGone,
    "bad_request": StoreBadRequest,
    "bad_input": StoreBadRequest,
    "payload_too_large": StoreBadRequest,
    "unauthorized": StoreUnauthorized,
    "forbidden": StoreUnauthorized,
    "unavailable": StoreUnavailable,
    "store_unavailable": StoreUnavailable,
    "shutting_down": StoreUnavailable,
    "overloaded": StoreUnavailable,
}
_STORE_BY_STATUS: dict[int, type[StoreError]] = {
    400: StoreBadRequest, 401: StoreUnauthorized, 403: StoreUnauthorized, 404: StoreNotFound,
    409: StoreConflict, 410: StoreGone, 413: StoreBadRequest, 429: StoreUnavailable, 503: StoreUnavailable,
}

#: The header of every error answer that names its kind.
ERROR_KIND_HEADER = "x-slipstream-error-kind"
RETRY_AFTER_MS_HEADER = "x-slipstream-retry-after-ms"


def error_from_response(status: int | None, headers: Mapping[str, str], body: bytes | memoryview, *,
                        tree: type[RequestError] | type[StoreError] = RequestError,
                        key: str | None = None) -> RequestError | StoreError:
    """The exception for an error answer: ``status`` (None for an error that
    arrives inside a stream), ``headers`` with lower-case names, and the body.

    The kind is the header's, else the body's (``{"error": {"kind"}}``, or
    the flat ``{"error": message, "kind": kind}``); the class is the kind's
    in ``tree``, else the status's, else the tree's root. The message is
    the body's, on one line (the body itself when it is not JSON).
    ``RequestError`` also gets ``retry_after`` (seconds) from its headers;
    ``StoreError`` gets ``key`` and, for a conflict, the key's ``current``
    version (from the body, or the message's "the key is at N")."""
    raw = bytes(body)
    kind = headers.get(ERROR_KIND_HEADER)
    message: Any = None
    current: Any = None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict):
            kind = kind or err.get("kind")
            message = err.get("message")
            current = err.get("current")
        elif isinstance(err, str):
            message = err
        kind = kind or doc.get("kind")
        current = doc.get("current", current)
    if not message:
        message = raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
    message = " ".join(str(message).split())
    if tree is StoreError:
        cls = STORE_ERRORS.get(kind or "") or (_STORE_BY_STATUS.get(status) if status is not None else None) \
            or StoreError
        if cls is StoreConflict:
            if not isinstance(current, int) or isinstance(current, bool):
                at = re.search(r"the key is at (\d+)", message)
                current = int(at.group(1)) if at else None
            return StoreConflict(message, status=status, key=key, current=current)
        return cls(message, status=status, key=key)
    request_cls = REQUEST_ERRORS.get(kind or "") or (_BY_STATUS.get(status) if status is not None else None) \
        or RequestError
    return request_cls(message, kind=kind or request_cls.kind, status=status, retry_after=_retry_after(headers))


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait before a retry: the node's milliseconds
    (``x-slipstream-retry-after-ms``), else HTTP's ``Retry-After``."""
    ms = _seconds(headers.get(RETRY_AFTER_MS_HEADER))
    if ms is not None and ms >= 0:
        return ms / 1000.0
    return _seconds(headers.get("retry-after"))


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


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
