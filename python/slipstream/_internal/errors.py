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
