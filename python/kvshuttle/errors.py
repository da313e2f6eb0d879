"""Named exceptions. Every public error derives from KVShuttleError and says what to do."""

from __future__ import annotations


class KVShuttleError(Exception):
    """Base class of every error kvshuttle raises on purpose."""


class LayoutError(KVShuttleError, ValueError):
    """A cache or staging buffer does not have a layout kvshuttle can move (shape, strides, dtype, device)."""


class BlockIdError(KVShuttleError, IndexError):
    """Block ids out of range, repeated, or not matching the token count."""


class StagingError(KVShuttleError, ValueError):
    """A staging buffer that is too small, on the wrong device, read-only or not contiguous."""


class BackendError(KVShuttleError, RuntimeError):
    """The requested backend is not available (e.g. CUDA arrays with a CPU-only build)."""
