"""Read raw geometry (address, shape, byte strides, dtype, device) from numpy, torch or cupy arrays.

No framework is imported here: torch tensors are recognised by their type's module, cupy (and anything
else that speaks the CUDA array interface) through ``__cuda_array_interface__``, and everything else
through numpy's array interface.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LayoutError


@dataclass(frozen=True)
class ArrayView:
    """What the native code needs to know about one array. ``owner`` keeps the memory alive."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    dtype: str
    device: str  # "cpu" or "cuda:<index>"
    writeable: bool
    owner: Any

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize  # Python ints: no overflow, no numpy call per chunk

    def is_c_contiguous(self) -> bool:
        """numpy's rule: strides of length-1 axes do not matter, and an empty array is contiguous."""
        if 0 in self.shape:
            return True
        expected = c_strides(self.shape, self.itemsize)
        return all(n == 1 or got == want for n, got, want in zip(self.shape, self.strides, expected, strict=True))


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides: list[int] = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _is_torch_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype[Any]) -> str:
    return str(dtype)  # a few microseconds each time; every pack and unpack describes its staging


def describe(x: object) -> ArrayView:
    """Describe a numpy array, torch tensor (CPU or CUDA) or CUDA-array-interface object."""
    if _is_torch_tensor(x):
        t: Any = x
        itemsize = int(t.element_size())
        device = f"cuda:{t.device.index or 0}" if t.device.type == "cuda" else t.device.type
        if device not in ("cpu",) and not device.startswith("cuda"):
            raise LayoutError(f"torch tensors on device {t.device} are not supported (use cpu or cuda)")
        return ArrayView(
            address=int(t.data_ptr()),
            shape=tuple(int(s) for s in t.shape),
            strides=tuple(int(s) * itemsize for s in t.stride()),
            itemsize=itemsize,
            dtype=str(t.dtype).removeprefix("torch."),
            device=device,
            writeable=True,
            owner=x,
        )
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        dtype = np.dtype(cai["typestr"])
        shape = tuple(int(s) for s in cai["shape"])
        strides = cai.get("strides")
        device_id = getattr(getattr(x, "device", None), "id", 0)
        return ArrayView(
            address=int(cai["data"][0]),
            shape=shape,
            strides=tuple(int(s) for s in strides) if strides else c_strides(shape, dtype.itemsize),
            itemsize=dtype.itemsize,
            dtype=str(getattr(x, "dtype", dtype)),
            device=f"cuda:{device_id}",
            writeable=not cai["data"][1],
            owner=x,
        )
    if not isinstance(x, np.ndarray):
        raise LayoutError(f"expected a numpy array, torch tensor or CUDA array, got {type(x).__name__}")
    if x.dtype.hasobject or x.itemsize == 0:  # Python object pointers are not KV bytes: a copy would corrupt them
        raise LayoutError(f"arrays of dtype {x.dtype} cannot hold KV bytes; use a numeric dtype")
    return ArrayView(
        address=int(x.ctypes.data),
        shape=x.shape,  # numpy's shape and strides are tuples of Python ints already
        strides=x.strides,
        itemsize=x.itemsize,
        dtype=_dtype_name(x.dtype),
        device="cpu",
        writeable=bool(x.flags.writeable),
        owner=x,
    )


def allocation_of(x: object) -> int | None:
    """An identity of the allocation an array views (equal for views of one buffer), or None when unknown.

    torch: the storage's address; cupy: the memory block's address; numpy: the object at the root of the
    ``.base`` chain (kept alive by the views, so its id is stable while they live).
    """
    if _is_torch_tensor(x):
        t: Any = x
        return int(t.untyped_storage().data_ptr())
    if not isinstance(x, np.ndarray):
        ptr = getattr(getattr(getattr(x, "data", None), "mem", None), "ptr", None)  # cupy: x.data.mem.ptr
        return ptr if isinstance(ptr, int) else None
    root: Any = x
    for _ in range(64):  # as_strided and friends wrap the buffer in objects that have a .base too
        base = getattr(root, "base", None)
        if base is None:
            break
        root = base
    return id(root)


def host_bytes(address: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """A writable uint8 numpy view of host memory (used by the reference on any CPU array)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
