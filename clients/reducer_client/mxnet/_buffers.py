"""NDArrays into the flat host buffers that travel, and the plan of which keys share one.

NumPy and MXNet's C API only; no store logic. A buffer holds one transfer:
one store key, or several small ones packed (fusion_groups). The store keeps
the buffer of each pushpull transfer and reduces into it in place, so a
steady-state step allocates no host arrays: NDArrays are copied straight
into their slice of the buffer (MXNDArraySyncCopyToCPU, what asnumpy() does
into a fresh array) and the results straight back out of it.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from collections.abc import Sequence

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

__all__ = ["copy_contribution", "fusion_groups", "wire_key", "write_result", "BufferCache"]


def _copy_to_host(array: mx.nd.NDArray, target: np.ndarray) -> None:
    """array's values into the C-contiguous NumPy `target` of its dtype and size."""
    assert target.flags.c_contiguous and target.size == array.size
    assert target.dtype == np.dtype(array.dtype)
    check_call(_LIB.MXNDArraySyncCopyToCPU(
        array.handle, target.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(array.size)))


def copy_contribution(arrays: Sequence[mx.nd.NDArray], target: np.ndarray) -> None:
    """This worker's contribution to one key, the sum of its per-device values, into `target`.

    One device is copied without any temporary. Several are summed in float64
    and rounded once to the values' dtype, so the local sum adds no error
    beyond that one rounding (this path allocates per call).
    """
    for array in arrays:
        if array.stype != "default":
            raise TypeError(f"reducer kvstore: {array.stype} arrays are not supported; "
                            "use dense gradients")
        if array.shape != arrays[0].shape:
            raise ValueError(f"reducer kvstore: values of one key differ in shape: "
                             f"{array.shape} vs {arrays[0].shape}")
    if len(arrays) == 1:
        _copy_to_host(arrays[0], target)
        return
    total = np.zeros(target.size, dtype=np.float64)
    for array in arrays:
        total += array.asnumpy().reshape(-1)
    np.copyto(target, total, casting="unsafe")


def write_result(result: np.ndarray, outs: Sequence[mx.nd.NDArray]) -> None:
    """Copy the (contiguous) result into every output; no host temporary."""
    for out in outs:
        out[:] = result.reshape(out.shape)


def fusion_groups(sizes: Sequence[tuple[int, np.dtype]], fusion_bytes: int,
                  ) -> list[list[int]]:
    """Indices of (nbytes, dtype) items grouped into transfers, the same on every worker.

    A key of `fusion_bytes` or more travels alone; smaller keys of one dtype
    fill a buffer in call order until the next would pass `fusion_bytes`.
    """
    groups: list[list[int]] = []
    open_group: dict[np.dtype, tuple[list[int], int]] = {}
    for index, (nbytes, dtype) in enumerate(sizes):
        if nbytes >= fusion_bytes:
            groups.append([index])
            continue
        members, total = open_group.get(dtype, (None, 0))
        if members is None or total + nbytes > fusion_bytes:
            members, total = [], 0
            groups.append(members)
        members.append(index)
        open_group[dtype] = (members, total + nbytes)
    return groups


def wire_key(kind: str, keys: Sequence[str]) -> str:
    """The core's key for one transfer: the store key, or a digest of a packed group."""
    if len(keys) == 1:
        return f"mx/{kind}/{keys[0]}"
    digest = hashlib.sha1("\0".join(keys).encode()).hexdigest()[:16]
    return f"mx/{kind}/fused/{len(keys)}/{digest}"


class BufferCache:
    """One flat host buffer per wire key, reused by every transfer of that key.

    Holds as many buffers as the store has transfers (its keys, packed), about
    one host copy of the gradients; a key whose size or dtype changes gets a
    new buffer. One transfer per wire key at a time: pushpull blocks until
    its transfers are done.
    """

    def __init__(self) -> None:
        # _lock guards _buffers; taken by whichever thread calls the store.
        self._lock = threading.Lock()
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, key: str, numel: int, dtype: np.dtype) -> np.ndarray:
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.size != numel or buffer.dtype != dtype:
                buffer = self._buffers[key] = np.empty(numel, dtype=dtype)
            return buffer

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)
