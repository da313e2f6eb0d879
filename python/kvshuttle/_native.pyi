"""Type stub of the compiled extension (csrc/bindings.cpp); ``python -m mypy.stubtest kvshuttle._native`` keeps it
true. Failures raise kvshuttle.errors' named classes (LayoutError, BlockIdError, StagingError, BackendError,
CudaError, NativeMemoryError), translated where the extension is bound."""

import enum
from typing import ClassVar, overload

import numpy as np
import numpy.typing as npt

class _Pybind11Type(type):
    """pybind11_builtins.pybind11_type: the metaclass of every class the extension binds."""

# py::native_enum: real enum.Enum classes; the capsule ties each to its C++ enum.
class TokenOrder(enum.Enum):
    __pybind11_native_enum__: ClassVar[object]
    NHD = 0
    HND = 1

class Direction(enum.Enum):
    __pybind11_native_enum__: ClassVar[object]
    PACK = 0
    UNPACK = 1

class PagedCopySpec(metaclass=_Pybind11Type):
    num_layers: int
    planes_per_layer: int
    num_blocks: int
    block_stride: int
    block_size: int
    num_heads: int
    head_offset: int
    token_stride: int
    head_stride: int
    staging_addr: int
    staging_bytes: int
    staging_block_size: int
    staging_heads: int
    staging_order: TokenOrder
    row_bytes: int
    num_tokens: int
    @overload
    def __init__(self) -> None: ...
    @overload
    def __init__(self, other: PagedCopySpec) -> None: ...
    def required_staging_bytes(self) -> int: ...

class BuildInfo(metaclass=_Pybind11Type):
    def __init__(self, *args: object, **kwargs: object) -> None: ...  # bound without a constructor: TypeError
    @property
    def version(self) -> str: ...
    @property
    def cuda(self) -> bool: ...
    @property
    def cuda_archs(self) -> str: ...
    @property
    def cuda_runtime_version(self) -> int: ...

class CudaLaunchStats(metaclass=_Pybind11Type):
    """Counters of the CUDA upload rings (zeros in a build without CUDA or before the first launch)."""
    def __init__(self, *args: object, **kwargs: object) -> None: ...  # bound without a constructor: TypeError
    @property
    def launches(self) -> int: ...
    @property
    def device_allocations(self) -> int: ...
    @property
    def host_allocations(self) -> int: ...
    @property
    def reuse_waits(self) -> int: ...

def paged_copy_cpu(
    spec: PagedCopySpec, plane_bases: npt.NDArray[np.uint64], block_ids: npt.NDArray[np.int64],
    direction: Direction,
) -> None: ...
def paged_copy_cuda(
    spec: PagedCopySpec, plane_bases: npt.NDArray[np.uint64], block_ids: npt.NDArray[np.int64],
    direction: Direction, stream: int = 0,
) -> None: ...
def parallel_memcpy(dst: int, src: int, nbytes: int) -> None: ...
def num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def streaming_min_bytes(direction: Direction) -> int: ...
def set_streaming_min_bytes(nbytes: int, direction: Direction) -> None: ...
def bytes_per_thread() -> int: ...
def set_bytes_per_thread(nbytes: int) -> None: ...
def build_info() -> BuildInfo: ...
def cuda_device_count() -> int: ...
def cuda_launch_stats() -> CudaLaunchStats: ...

class CopyTicket(metaclass=_Pybind11Type):
    def __init__(self, *args: object, **kwargs: object) -> None: ...  # bound without a constructor: TypeError
    def done(self) -> bool: ...
    def wait(self, timeout_s: float) -> bool: ...
    def result(self) -> float: ...

class AsyncCopier(metaclass=_Pybind11Type):
    def __init__(self) -> None: ...
    def submit(
        self, spec: PagedCopySpec, plane_bases: npt.NDArray[np.uint64], block_ids: npt.NDArray[np.int64],
        direction: Direction,
    ) -> CopyTicket: ...
    def close(self) -> None: ...
    def pending(self) -> int: ...

class ReadPlanSpec(metaclass=_Pybind11Type):
    num_walk_groups: int
    planes_per_walk_group: int
    piece_bytes: int
    local_block_stride: int
    remote_block_stride: int
    local_device: int
    remote_device: int
    def __init__(self) -> None: ...
    def num_pieces(self, num_ids: int) -> int: ...

def plan_read_descriptors(
    spec: ReadPlanSpec, walk_group_planes: npt.NDArray[np.int64], local_bases: npt.NDArray[np.uint64],
    local_ids: npt.NDArray[np.int64], remote_bases: npt.NDArray[np.uint64], remote_ids: npt.NDArray[np.int64],
    local_blocks: int, remote_blocks: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None: ...
