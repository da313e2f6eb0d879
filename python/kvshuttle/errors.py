"""Named exceptions. Every public error derives from KVShuttleError and says what to do.

The native extension raises these too: its C++ exceptions (csrc/include/kvshuttle/errors.h) are translated to
the classes of the same name where the extension is bound (csrc/bindings.cpp).
"""

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


class CudaError(BackendError):
    """A CUDA call of the native extension failed (allocation, copy, launch); the message names the call and
    CUDA's error. The destination may be partly written: treat it as lost and retry or recompute."""


class NativeMemoryError(BackendError, MemoryError):
    """The native extension could not allocate host memory for its work (scratch tables, descriptor rows)."""


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, without raising or flooding a log.

    A Python int of more than 4300 digits has no str/repr (ValueError), and a caller's object may raise in its
    own ``__repr__``; neither may turn a named error into another exception.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit integer>"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
