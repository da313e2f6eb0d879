"""The one door to the compiled extension ``kvshuttle._native``, typed by ``_native.pyi``.

Every native call in the package goes through :data:`ext`, so mypy checks each one against the stub (and
``mypy.stubtest`` keeps the stub true to the binary). A source checkout without a build has no extension:
:func:`available` is False there and the callers use the numpy reference or raise :class:`BackendError`.
The extension raises kvshuttle's named errors itself (translated where it is bound, csrc/bindings.cpp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ..errors import BackendError, shown

if TYPE_CHECKING:  # the extension's classes, for annotations only (they do not exist without a build)
    from .._native import AsyncCopier, CopyTicket, PagedCopySpec, ReadPlanSpec

try:
    from .. import _native as ext
except ImportError:  # a source checkout without a build; available() says so before anyone touches ext
    ext = None  # type: ignore[assignment]  # keeps ext typed as the module for every call

__all__ = ["BACKENDS", "AsyncCopier", "Backend", "CopyTicket", "PagedCopySpec", "ReadPlanSpec", "available",
           "check_backend", "cuda_built", "ext", "require"]

Backend = Literal["auto", "native", "reference"]
BACKENDS: tuple[Backend, ...] = ("auto", "native", "reference")


def available() -> bool:
    """Whether the extension is built and importable."""
    return ext is not None


def cuda_built() -> bool:
    """Whether the extension was built with the CUDA kernels."""
    return ext is not None and bool(ext.build_info().cuda)


def require() -> None:
    """BackendError unless the extension is built."""
    if ext is None:
        raise BackendError("the native extension is not built; reinstall kvshuttle or use backend='reference'")


def check_backend(backend: object) -> Backend:
    """``backend`` as a Backend; BackendError for anything else (a typo must not silently pick one)."""
    for name in BACKENDS:
        if isinstance(backend, str) and backend == name:
            return name
    raise BackendError(f"backend must be 'auto', 'native' or 'reference', not {shown(backend)}")
