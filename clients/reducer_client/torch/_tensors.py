"""Tensors to and from the core's NumPy arrays, on any device.

The core takes float16, float32 and float64 NumPy arrays, converts its input
to the wire dtype before allreduce_async returns, and writes the result into
a buffer the caller names (out=, which may be the input). So the reductions
of flat buffers (DDP buckets, the optimizer's buckets) that Staging runs
allocate nothing per step:
- a contiguous CPU tensor of those dtypes is handed over as a zero-copy
  NumPy view and reduced in place (out= the same view);
- another CPU tensor (bfloat16, which NumPy lacks) is copied into a float32
  host buffer kept for its key, reduced in place there, and copied back;
- CUDA tensors go through a pinned host buffer per key, reused across
  steps: the device-to-host copy is queued on the current CUDA stream
  without blocking, one staging thread waits for it and hands the buffer to
  the core, which reduces into it, so the autograd thread that launched it
  keeps queuing kernels. The result goes back from the same buffer with a
  non-blocking host-to-device copy on the stream the caller names.
One-off calls (to_numpy) take a view where they can, else a copy; any
device other than CPU and CUDA takes a plain blocking copy through the CPU.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from reducer_client.api import Reducer
from reducer_client.compression import wire_scale
from reducer_client.feedback import ErrorFeedback
from reducer_client.torch._basics import resolve

__all__ = ["flat_dtype", "to_numpy", "numpy_view", "staging_for", "Staging",
           "set_error_feedback"]

_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def flat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a tensor of `dtype` is handed to the core."""
    return dtype if dtype in _NUMPY_DTYPES else torch.float32


def numpy_view(tensor: torch.Tensor) -> np.ndarray | None:
    """A NumPy array sharing the tensor's memory, or None where there is none.

    Only contiguous CPU tensors of float16, float32 and float64 have one.
    """
    if (tensor.device.type != "cpu" or tensor.dtype not in _NUMPY_DTYPES
            or not tensor.is_contiguous()):
        return None
    return tensor.detach().numpy()


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a NumPy array the core accepts (a view where possible)."""
    if not tensor.is_floating_point():
        raise TypeError(f"dtype {tensor.dtype} cannot be reduced: the wire carries "
                        "floating-point values only")
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()  # blocking: the simple path for one-off calls
    return host.to(flat_dtype(host.dtype)).contiguous().numpy()


def _priority(priority: int) -> dict[str, Any]:
    """The keyword for Reducer.allreduce_async: only a priority that is not 0."""
    return {"priority": priority} if priority else {}


def _chain(source: Future, target: Future) -> None:
    """Complete `target` with `source`'s outcome once it has one."""
    def copy(done: Future) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())
    source.add_done_callback(copy)


@dataclass
class _HostBuffer:
    """A host staging buffer (pinned for CUDA) and, for CUDA, the event after
    which it may be overwritten."""

    host: torch.Tensor
    free: torch.cuda.Event | None = None


class Staging:
    """Start reductions of flat tensors and write the results back, for one Reducer.

    Contract: at most one reduction per key is in flight (each key's next
    round starts after its previous result was written back), which is how
    DDP buckets and the DistributedOptimizer's buckets behave.
    """

    def __init__(self) -> None:
        # _lock guards _buffers and _executor; taken by autograd threads
        # (start), the core's reader threads (finish) and step() callers.
        self._lock = threading.Lock()
        self._buffers: dict[str, _HostBuffer] = {}
        self._executor: ThreadPoolExecutor | None = None
        # Error feedback for the 8-bit wires (reducer_client.feedback): chosen
        # at the first start (on for an 8-bit wire_dtype) or by set_feedback;
        # guarded by _lock.
        self._feedback: ErrorFeedback | None = None
        self._feedback_chosen = False

    def set_feedback(self, reducer: Reducer, enabled: bool) -> None:
        """Error feedback on (for reducer's wire dtype) or off for every key.

        On is ErrorFeedback.for_reducer's: under node-local aggregation the
        node's slice senders keep the residue (a NodeFeedback), as the
        default does; a worker-side residue there would feed back a rounding
        that never went on the wire.
        """
        with self._lock:
            self._feedback = ErrorFeedback.choose(reducer, enabled)
            self._feedback_chosen = True

    @property
    def feedback(self) -> ErrorFeedback | None:
        """The error feedback chosen (None: off, or not chosen before a first start).
        Chosen once under the lock; reading the reference needs none."""
        return self._feedback

    def _compensate(self, reducer: Reducer, key: str, values: np.ndarray, op: str) -> None:
        """Add what the wire dropped from this key's last contribution (if feedback is on)."""
        with self._lock:
            if not self._feedback_chosen:
                self._feedback = ErrorFeedback.choose(reducer, None)
                self._feedback_chosen = True
            feedback = self._feedback
        if feedback is not None:
            feedback.apply(key, values, wire_scale(reducer, op))

    def start(self, reducer: Reducer, flat: torch.Tensor, key: str, op: str,
              priority: int = 0) -> Future[np.ndarray]:
        """Start reducing the 1-D tensor `flat` into itself or its key's host buffer.

        The future holds the result in NumPy: a view of `flat` (CPU float16,
        float32, float64) or of the key's host buffer; finish() writes it
        into the tensor where it is not there already. priority: the core's
        (passed only when not 0, so any Reducer serves the rest).
        """
        if flat.device.type == "cuda":
            return self._start_cuda(reducer, flat, key, op, priority)
        view = numpy_view(flat)
        if view is None:  # bfloat16, or any other non-NumPy layout
            host = self._host_buffer(key, flat.numel(), flat_dtype(flat.dtype),
                                     pinned=False).host
            host.copy_(flat.reshape(-1))
            view = host.numpy()
        self._compensate(reducer, key, view, op)
        return reducer.allreduce_async(view, key, op, out=view, **_priority(priority))

    def finish(self, result: np.ndarray, out: torch.Tensor, key: str,
               stream: torch.cuda.Stream | None = None) -> None:
        """Make the 1-D tensor `out` hold the reduced `result`, converting its dtype.

        Nothing to do where the result was reduced into `out` itself. For
        CUDA the copy is queued on `stream` (default: the current one), so
        work queued on that stream afterwards sees the result.
        """
        if out.device.type == "cuda":
            self._finish_cuda(result, out, key, stream)
        elif not _same_memory(result, out):
            out.copy_(torch.from_numpy(result))

    # -- CUDA ----------------------------------------------------------------

    def _start_cuda(self, reducer: Reducer, flat: torch.Tensor, key: str, op: str,
                    priority: int = 0) -> Future[np.ndarray]:
        # Cast to the wire's float16 on the GPU when that is the wire dtype:
        # half the bytes over PCIe, and the same rounding (nearest even) the
        # core would apply on the host.
        if getattr(reducer, "wire_dtype", None) == "float16" and flat.dtype != torch.float16:
            host_dtype = torch.float16
        else:
            host_dtype = flat_dtype(flat.dtype)
        buffer = self._host_buffer(key, flat.numel(), host_dtype)
        stream = torch.cuda.current_stream(flat.device)
        if buffer.free is not None:
            stream.wait_event(buffer.free)  # the last result's copy has read the buffer
        # A dtype change happens on the GPU (copy_ converts on the source
        # device for non-blocking device-to-host copies).
        buffer.host.copy_(flat, non_blocking=True)
        # A blocking-sync event: the staging thread sleeps instead of spinning
        # on a core that the core's gRPC threads need.
        copied = torch.cuda.Event(blocking=True)
        copied.record(stream)
        reduced: Future[np.ndarray] = Future()

        def hand_over() -> None:
            # One staging thread, first in first out: each key's rounds reach
            # the core in launch order, the same on every rank.
            copied.synchronize()
            host = buffer.host.numpy()
            self._compensate(reducer, key, host, op)
            _chain(reducer.allreduce_async(host, key, op, out=host, **_priority(priority)),
                   reduced)

        def report(done: Future) -> None:
            if done.exception() is not None:
                reduced.set_exception(done.exception())

        self._staging_thread().submit(hand_over).add_done_callback(report)
        return reduced

    def _finish_cuda(self, result: np.ndarray, out: torch.Tensor, key: str,
                     stream: torch.cuda.Stream | None) -> None:
        with self._lock:
            buffer = self._buffers[key]
        if not _same_memory(result, buffer.host):
            # A Reducer that answered elsewhere. Safe to overwrite: the
            # device-to-host copy of this round completed before the core
            # got the buffer.
            buffer.host.numpy()[...] = result
        stream = stream if stream is not None else torch.cuda.current_stream(out.device)
        with torch.cuda.stream(stream):
            if out.dtype == buffer.host.dtype:
                out.copy_(buffer.host, non_blocking=True)
            else:
                # Copy, then convert on the GPU: copy_ alone would convert on
                # the host into pageable memory and copy synchronously.
                out.copy_(buffer.host.to(out.device, non_blocking=True))
            free = torch.cuda.Event()
            free.record(stream)
        buffer.free = free

    def _host_buffer(self, key: str, numel: int, dtype: torch.dtype,
                     pinned: bool = True) -> _HostBuffer:
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.host.numel() != numel or buffer.host.dtype != dtype:
                # DDP rebuilds its buckets after the first step: sizes change once.
                buffer = _HostBuffer(torch.empty(numel, dtype=dtype, pin_memory=pinned))
                self._buffers[key] = buffer
            return buffer

    def _staging_thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="reducer-torch-staging")
            return self._executor


def _same_memory(result: np.ndarray, tensor: torch.Tensor) -> bool:
    """Whether `result` is the memory of `tensor` (the reduction went in place)."""
    return (result.ctypes.data == tensor.data_ptr()
            and result.nbytes == tensor.numel() * tensor.element_size())


# One Staging per Reducer, dropped with it. _stagings_lock guards the map.
_stagings: weakref.WeakKeyDictionary[Reducer, Staging] = weakref.WeakKeyDictionary()
_stagings_lock = threading.Lock()


def set_error_feedback(enabled: bool, reducer: Reducer | None = None) -> None:
    """Error feedback on or off for the DDP hook and the DistributedOptimizer.

    On by default for the 8-bit wires ("int8", "fp8_e4m3", "fp8_e5m2")
    (reducer_client.feedback): each bucket keeps what quantization dropped
    from this worker's gradient and adds it to the next step's; under
    node-local aggregation the local rank that sends each slice of the
    node's sum keeps that slice's residue instead. reducer: the Reducer to
    set it for (None: init()'s).
    """
    reducer = resolve(reducer)
    staging_for(reducer).set_feedback(reducer, enabled)


def all_stagings() -> list[Staging]:
    """The Staging of every Reducer still alive."""
    with _stagings_lock:
        return list(_stagings.values())


def staging_for(reducer: Reducer) -> Staging:
    """The Staging (pinned buffers, staging thread) that belongs to `reducer`."""
    with _stagings_lock:
        staging = _stagings.get(reducer)
        if staging is None:
            staging = _stagings[reducer] = Staging()
        return staging
