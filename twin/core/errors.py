"""The core's own exception (kept out of ``states.py`` so that module compiles: a compiled
class cannot subclass a built-in exception)."""

from __future__ import annotations


class ProtocolError(RuntimeError):
    """The core was asked for a transition its table does not allow (a bug, not bad input)."""
