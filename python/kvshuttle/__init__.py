"""kvshuttle: bidirectional paged KV-cache transfer for disaggregated LLM serving."""

from __future__ import annotations

from typing import Any

from .core.layout import CacheGeometry, CacheKind, PagedKVCache, StagingLayout, TokenOrder
from .core.ops import pack, staging_nbytes, unpack
from .errors import (
    BackendError,
    BlockIdError,
    CudaError,
    KVShuttleError,
    LayoutError,
    NativeMemoryError,
    StagingError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BlockIdError",
    "CacheGeometry",
    "CacheKind",
    "CudaError",
    "KVShuttleError",
    "LayoutError",
    "NativeMemoryError",
    "PagedKVCache",
    "StagingError",
    "StagingLayout",
    "TokenOrder",
    "__version__",
    "build_info",
    "pack",
    "staging_nbytes",
    "unpack",
]


def build_info() -> dict[str, Any]:
    """What was built (CPU path, CUDA path, architectures) and whether a GPU is usable now."""
    from .core import native

    if not native.available():
        return {"version": __version__, "native": False, "cuda": False, "cuda_archs": [],
                "gpu_available": False, "num_threads": 0}
    ext = native.ext
    info = ext.build_info()
    return {
        "version": info.version,
        "native": True,
        "cuda": bool(info.cuda),
        "cuda_archs": [a for a in info.cuda_archs.split(",") if a],
        "cuda_runtime_version": int(info.cuda_runtime_version),
        "gpu_available": bool(info.cuda) and ext.cuda_device_count() > 0,
        "num_threads": int(ext.num_threads()),
    }
