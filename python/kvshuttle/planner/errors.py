"""The planner's named errors: a bad trace names its line and field, a bad profile names its field."""

from __future__ import annotations

from ..errors import KVShuttleError


class PlannerError(KVShuttleError, ValueError):
    """Base class of the planner's errors (bad input, never a bug in the caller's deployment)."""


class TraceError(PlannerError):
    """A trace that cannot be planned: the message names the file, the line and the field, and what it must be."""

    def __init__(self, message: str, *, line: int | None = None, field: str | None = None,
                 source: str = "<trace>") -> None:
        where = source if line is None else f"{source}:{line}"
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}: {what}{message}")
        self.line = line
        self.field = field
        self.source = source


class ProfileError(PlannerError):
    """A cost profile that cannot be used (unknown name, unreadable file, a missing or out-of-range field)."""
