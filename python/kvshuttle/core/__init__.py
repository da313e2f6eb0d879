"""The core: paged-cache geometry, pack/unpack (native C++/CUDA or the numpy reference) and read planning.

Nothing here knows about handles, policies or peers; everything above builds on it.
"""

from __future__ import annotations

from .layout import CacheGeometry, CacheKind, PagedKVCache, StagingLayout, TokenOrder
from .ops import pack, staging_nbytes, unpack
from .plan import ReadPlan, SideGeometry, plan_read

__all__ = [
    "CacheGeometry",
    "CacheKind",
    "PagedKVCache",
    "ReadPlan",
    "SideGeometry",
    "StagingLayout",
    "TokenOrder",
    "pack",
    "plan_read",
    "staging_nbytes",
    "unpack",
]
