"""allreduce_hook: a DistributedDataParallel communication hook over reducerd.

    ddp_model.register_comm_hook(state=rt.client(), hook=rt.allreduce_hook)

DDP calls the hook for each gradient bucket as soon as the bucket is full,
during backward, and waits for the returned future only at the end of
backward, so the reduction overlaps the rest of the backward pass. DDP's
own process group is still needed for what DDP does besides reducing
gradients (the initial broadcast of parameters, bucket rebuilding).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares
# the hook's annotations with dist.GradBucket and Future[Tensor] as objects.

import inspect
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from reducer_client.api import Reducer
from reducer_client.torch._basics import resolve
from reducer_client.torch._tensors import staging_for

__all__ = ["allreduce_hook"]

if TYPE_CHECKING:
    from torch.distributed import GradBucket as _GradBucket
else:
    # Builds without torch.distributed have no GradBucket (and no DDP to hook into).
    _GradBucket = getattr(dist, "GradBucket", inspect.Parameter.empty)


def allreduce_hook(state: Reducer | None, bucket: _GradBucket,
                   ) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all workers through the daemons; DDP's comm-hook signature.

    `state` is the Reducer to use (rt.client(), or None for the same). The
    bucket travels in the client's wire dtype; the daemons sum in float32
    and divide by the world size before rounding to the wire dtype once
    (so float16 does not overflow on large sums), and the result is
    written back into the bucket in its own dtype. Every rank reduces bucket
    i under the key "ddp/bucket/i", once per backward pass, which is what
    keeps the ranks' rounds in step. A failed reduction (a daemon down, a
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
    key = f"ddp/bucket/{bucket.index()}"
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

    def on_reduced(done: "Future[np.ndarray]") -> None:
        # Runs on the core's reader thread (or inline, if already done).
        try:
            staging.finish(done.result(), buffer, key, stream)
        except Exception as exc:
            failure.append(exc)
        complete()

    try:
        staging.start(reducer, buffer, key, "mean").add_done_callback(on_reduced)
    except Exception as exc:
        failure.append(exc)
        complete()
    return reduced_into_buffer.then(result_or_raise)
