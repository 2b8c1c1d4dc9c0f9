"""The object store's key and prefix rules (docs/design/store.md, "Data model").

One copy of the rules, shared by the store client (checked before a request
is sent, so a typo fails here with the reason rather than as a 400), the
declarations that name keys (``needs``, ``watch``, ``ss.Pool``, seeds) and
the CLI. The node checks the same rules; keep the two in step.

``key_problem`` / ``prefix_problem`` say what is wrong; the ``check_*``
functions raise it as the store client's ``StoreBadRequest``, the
``declared_*`` ones as the ``ConfigError`` of a declaration.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from slipstream._internal.errors import ConfigError, StoreBadRequest

MAX_KEY_BYTES = 1024
#: Keys under this prefix are the node's own records (failed triggers): readable, not writable.
RESERVED_PREFIX = "/_slipstream/"


def _common_problem(text: object, what: str) -> str | None:
    if not isinstance(text, str):
        return f"a {what} is a string, got {type(text).__name__}"
    if not text.startswith("/"):
        return f"a {what} starts with '/'"
    try:
        n = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return f"a {what} must be valid UTF-8"
    if n > MAX_KEY_BYTES:
        return f"a {what} is at most {MAX_KEY_BYTES} bytes, this one has {n}"
    # Unicode category Cc: C0, DEL and C1, the set Rust's char::is_control tests.
    if any(unicodedata.category(c) == "Cc" for c in text):
        return f"a {what} has no control characters"
    return None


def _segments_problem(path: str, what: str) -> str | None:
    for seg in path.split("/"):
        if not seg:
            return f"a {what} has no empty segment ('//')"
        if seg in (".", ".."):
            return f"a {what} has no '.' or '..' segment"
    return None


def key_problem(key: object, *, write: bool = False) -> str | None:
    """Why ``key`` is not a valid key (None if it is). ``write``: also refuse
    the node's reserved keys."""
    problem = _common_problem(key, "key")
    if problem is not None:
        return problem
    assert isinstance(key, str)
    if key == "/":
        return "'/' is the root prefix, not a key"
    if key.endswith("/"):
        return "a key has no trailing '/' (a name ending in '/' is a prefix)"
    problem = _segments_problem(key[1:], "key")
    if problem is not None:
        return problem
    if write and (key + "/").startswith(RESERVED_PREFIX):
        return f"keys under {RESERVED_PREFIX} are the node's own records"
    return None


def prefix_problem(prefix: object, *, whole_segments: bool = False) -> str | None:
    """Why ``prefix`` is not a valid prefix (None if it is).

    A listing or watch takes '/' or a key, with or without a trailing '/'
    (the worker watches one exact key this way; matching is by string
    prefix, so ``/docs/a`` also matches ``/docs/ab``). ``whole_segments`` is
    the rule for declared prefixes (``watch=``, ``ss.Pool``): '/' or a key
    followed by '/', so ``/docs/`` never also matches ``/docs2/...``."""
    problem = _common_problem(prefix, "prefix")
    if problem is not None:
        return problem
    assert isinstance(prefix, str)
    if prefix == "/":
        return None
    if whole_segments and not prefix.endswith("/"):
        return "a declared prefix ends with '/'"
    return _segments_problem(prefix[1:].removesuffix("/"), "prefix")


def check_key(key: str, *, write: bool = False) -> str:
    """``key`` if it is a valid key, else ``StoreBadRequest`` saying why."""
    problem = key_problem(key, write=write)
    if problem is not None:
        raise StoreBadRequest(f"invalid key {key!r}: {problem}", key=key if isinstance(key, str) else None)
    return key


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a valid listing or watch prefix, else ``StoreBadRequest``."""
    problem = prefix_problem(prefix)
    if problem is not None:
        raise StoreBadRequest(f"invalid prefix {prefix!r}: {problem}")
    return prefix


def declared_key(key: Any, where: str, *, write: bool = False) -> str:
    """A key named by a declaration (``needs``, a seed), else ``ConfigError``."""
    problem = key_problem(key, write=write)
    if problem is not None:
        raise ConfigError(f"{where}: invalid store key {key!r}: {problem}")
    return str(key)


def declared_prefix(prefix: Any, where: str) -> str:
    """A prefix named by a declaration (``watch``, ``ss.Pool``): whole
    segments only, else ``ConfigError``."""
    problem = prefix_problem(prefix, whole_segments=True)
    if problem is not None:
        raise ConfigError(f"{where}: invalid store prefix {prefix!r}: {problem}")
    return str(prefix)
