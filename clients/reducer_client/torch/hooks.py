"""allreduce_hook: a DistributedDataParallel communication hook over reducerd.

    ddp_model.register_comm_hook(state=rt.client(), hook=rt.allreduce_hook)

DDP calls the hook for each gradient bucket as soon as the bucket is full,
during backward, and waits for the returned future only at the end of
backward, so the reduction overlaps the rest of the backward pass. DDP's
own process group is still needed for what DDP does besides reducing
gradients (the initial broadcast of parameters, bucket rebuilding).

join (rt.join(), Horovod's hvd.join()): each bucket's reduction goes with a
control round (reducer_client.collectives, a STEP call naming the bucket's
index and size), so a rank that has joined learns of every bucket the
others reduce and sends zeros for it under the bucket's key; "mean" then
divides by the ranks that contributed (the daemons' mean times
world_size / active), as PyTorch's Join with divide_by_initial_world_size=
False and Horovod define it. The control round travels beside the bucket
(world_size x 124 bytes). join() ends by copying the parameters the hook has
seen from the rank that joined last. DDP's own process-group collectives
are not followed: a rank joins after its second step (DDP rebuilds its
buckets in the second forward, with a broadcast), and a module with buffers
needs DDP(..., broadcast_buffers=False).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares
# the hook's annotations with dist.GradBucket and Future[Tensor] as objects.

import inspect
import threading
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from reducer_wire import dtypes

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.torch._basics import resolve
from reducer_client.torch._tensors import staging_for

__all__ = ["allreduce_hook", "hook_parameters"]

if TYPE_CHECKING:
    from torch.distributed import GradBucket as _GradBucket
else:
    # Builds without torch.distributed have no GradBucket (and no DDP to hook into).
    _GradBucket = getattr(dist, "GradBucket", inspect.Parameter.empty)


class _Joinable:
    """Per Reducer: the tag of the hook's join shadow, and each bucket's parameters."""

    def __init__(self, reducer: Reducer) -> None:
        # The shadow must not keep the reducer alive (the session holding it is
        # a weak-keyed entry of the reducer).
        ref = weakref.ref(reducer)
        self.tag = coll.register_shadow(reducer, lambda rows: _shadow(ref, rows))
        # bucket index -> its parameters in the last backward pass; written by
        # one autograd thread at a time, read by join() after every step.
        self.params: dict[int, list[torch.Tensor]] = {}


# _joinables_lock guards _joinables; taken by autograd threads (the hook).
_joinables: weakref.WeakKeyDictionary[Reducer, _Joinable] = weakref.WeakKeyDictionary()
_joinables_lock = threading.Lock()


def _joinable(reducer: Reducer) -> _Joinable:
    with _joinables_lock:
        joinable = _joinables.get(reducer)
        if joinable is None:
            joinable = _joinables[reducer] = _Joinable(reducer)
        return joinable


def _bucket_key(index: int) -> str:
    return f"ddp/bucket/{index}"


def _shadow(ref: "weakref.ref[Reducer]", rows: np.ndarray) -> None:
    """A joined rank's part in a bucket the others reduce: zeros under its key."""
    reducer = ref()
    shape = coll.call_shape(rows)
    if reducer is None or not isinstance(shape, tuple) or len(shape) != 2:
        raise RuntimeError(f"join: a DDP bucket call this rank cannot follow ({shape})")
    index, numel = shape
    zeros = np.zeros(numel, np.float32)
    reducer.allreduce_async(zeros, _bucket_key(index), "mean", out=zeros).result()


def hook_parameters(reducer: Reducer) -> list[torch.Tensor]:
    """The parameters allreduce_hook reduced for `reducer`, in bucket order (join's sync)."""
    with _joinables_lock:
        joinable = _joinables.get(reducer)
    if joinable is None:
        return []
    return [p for index in sorted(joinable.params) for p in joinable.params[index]]


def _bucket_call(reducer: Reducer, tag: int, index: int, numel: int) -> coll.Call:
    wire = getattr(reducer, "wire_dtype", None)
    return coll.Call(coll.STEP, None, "float32", (index, numel), numel, op="mean",
                     wire=wire if wire in dtypes.WIRE_DTYPES else None, tag=tag)


def allreduce_hook(state: Reducer | None, bucket: _GradBucket,
                   ) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all workers through the daemons; DDP's comm-hook signature.

    `state` is the Reducer to use (rt.client(), or None for the same). The
    bucket travels in the client's wire dtype; the daemons sum in float32
    and divide by the world size before rounding to the wire dtype once
    (so float16 does not overflow on large sums), and the result is
    written back into the bucket in its own dtype. Every rank reduces bucket
    i under the key "ddp/bucket/i", once per backward pass, which is what
    keeps the ranks' rounds in step; beside it goes the bucket's control
    round (module doc: join), whose rows also fail every rank at once,
    naming them, where ranks disagree on the bucket's size. A failed reduction (a daemon down, a
    timeout) fails the returned future with the ReducerError; DDP's
    backward then raises a RuntimeError that quotes it.

    Nothing is allocated per step for the result: a CPU bucket (float16,
    float32, float64) is reduced in place, the core writing the result into
    the bucket's own memory; a bfloat16 CPU bucket goes through a float32
    host buffer kept for that bucket. On CUDA the bucket goes through a
    pinned host buffer reused for that bucket on every step, which the core
    reduces into, with non-blocking copies ordered on the CUDA stream that
    was current when DDP called the hook; the future is a CUDA future, so
    whoever waits for it waits for the copy back as well.
    """
    reducer = resolve(state)
    staging = staging_for(reducer)
    buffer = bucket.buffer()
    index = bucket.index()
    key = _bucket_key(index)
    world = reducer.world_size
    joinable = _joinable(reducer)
    joinable.params[index] = bucket.parameters()
    call = _bucket_call(reducer, joinable.tag, index, buffer.numel())
    cuda = buffer.device.type == "cuda"
    stream = torch.cuda.current_stream(buffer.device) if cuda else None
    reduced_into_buffer: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if cuda else None)
    # A torch.futures.Future holds a Python exception as its value, which
    # DDP's C++ side cannot read; an exception raised in a then() callback
    # fails the C++ future instead, so DDP's backward raises it (as a
    # RuntimeError that quotes the ReducerError).
    failure: list[Exception] = []

    def result_or_raise(done: torch.futures.Future) -> torch.Tensor:
        if failure:
            raise failure[0]
        return done.value()

    def complete() -> None:
        if cuda:
            # set_result records an event on the current stream: make that
            # the stream the copy back was queued on.
            with torch.cuda.stream(stream):
                reduced_into_buffer.set_result(buffer)
        else:
            reduced_into_buffer.set_result(buffer)

    def finish(done: "Future[np.ndarray]", control: "Future[np.ndarray] | None") -> None:
        # Runs on the core's reader thread (or inline, if already done).
        try:
            result = done.result()
            if control is not None:
                active = coll.check(control.result(), call)
                if 0 < active < world:  # joined ranks sent zeros: mean over the others
                    np.multiply(result, world / active, out=result, casting="unsafe")
            staging.finish(result, buffer, key, stream)
        except Exception as exc:
            failure.append(exc)
        complete()

    try:
        # One rank has nobody to join: no control round.
        control = coll.control_async(reducer, call) if world > 1 else None
        data = staging.start(reducer, buffer, key, "mean")
        if control is None:
            data.add_done_callback(lambda done: finish(done, None))
        else:
            # Both settle on the core's threads: the later one finishes the bucket.
            data.add_done_callback(lambda done: control.add_done_callback(
                lambda _: finish(done, control)))
    except Exception as exc:
        failure.append(exc)
        complete()
    return reduced_into_buffer.then(result_or_raise)
