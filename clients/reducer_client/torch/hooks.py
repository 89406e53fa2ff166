"""allreduce_hook: a DistributedDataParallel communication hook over reducerd.

    ddp_model.register_comm_hook(state=rt.client(), hook=rt.allreduce_hook)

DDP calls the hook for each gradient bucket as soon as the bucket is full,
during backward, and waits for the returned future only at the end of
backward, so the reduction overlaps the rest of the backward pass. DDP's
own process group is still needed for what DDP does besides reducing
gradients (the initial broadcast of parameters, bucket rebuilding).

join (opt-in, as PyTorch's Join: ranks with uneven inputs train inside
`with rt.Join():`, which joins on leaving it): there each bucket's reduction goes with a
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

Several DDP models on one client (a GAN, teacher and student): each model
has keys of its own ("ddp/bucket/i" for the first, "ddp/model.m/bucket/i"
for the m-th), numbered in the order of their first backward pass, which is
the same on every rank that runs the same program; a bucket belongs to the
model whose parameters it holds. Where two models' first backward passes
interleave so that a bucket could belong to either, the hook raises: give
each model a HookState of its own (its keys then follow that state). A
bucket's parameters differing from its last call (DDP's rebuild reorders
them, whatever the size) carry their error-feedback residual to their new
places (_lifetime.move_residual); a bucket that gained or lost parameters
starts afresh.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares
# the hook's annotations with dist.GradBucket and Future[Tensor] as objects.

import inspect
import operator
import threading
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from reducer_wire import dtypes
from torch.utils.weak import WeakIdKeyDictionary

from reducer_client import collectives as coll
from reducer_client.api import Reducer
from reducer_client.torch._basics import resolve
from reducer_client.torch._lifetime import move_residual
from reducer_client.torch._tensors import staging_for

__all__ = ["allreduce_hook", "hook_parameters", "HookState"]

if TYPE_CHECKING:
    from torch.distributed import GradBucket as _GradBucket
else:
    # Builds without torch.distributed have no GradBucket (and no DDP to hook into).
    _GradBucket = getattr(dist, "GradBucket", inspect.Parameter.empty)


class HookState:
    """allreduce_hook's state for one DDP model, where the default cannot tell
    the models apart (module doc): one per model, on every rank.

        ddp_model.register_comm_hook(state=HookState(client), hook=rt.allreduce_hook)

    reducer: the Reducer to use (None: init()'s, looked up at each call).
    """

    def __init__(self, reducer: Reducer | None = None) -> None:
        self.reducer = reducer


class _Model:
    """One DDP model's slot (its keys) and each bucket's parameters at its last call."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.params: dict[int, list[torch.Tensor]] = {}  # bucket index -> parameters
        self.next_index = 0  # in the first backward pass: the bucket expected next


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class _Joinable:
    """Per Reducer: the tag of the hook's join shadow, and its DDP models."""

    def __init__(self, reducer: Reducer) -> None:
        # The shadow must not keep the reducer alive (the session holding it is
        # a weak-keyed entry of the reducer).
        ref = weakref.ref(reducer)
        self.tag = coll.register_shadow(reducer, lambda rows: _shadow(ref, rows))
        # _lock guards everything below and the _Models' fields; taken by
        # autograd threads (the hook) and by join().
        self._lock = threading.Lock()
        self.models: list[_Model] = []  # by slot
        self._owner = WeakIdKeyDictionary()  # parameter -> its _Model (default state)
        self._opening: list[_Model] = []  # default-state models in their first pass
        self._states: weakref.WeakKeyDictionary[HookState, _Model] = (
            weakref.WeakKeyDictionary())

    def _new_model(self) -> _Model:
        self.models.append(_Model(len(self.models)))
        return self.models[-1]

    def bucket_model(self, state: HookState | None, bucket: _GradBucket,
                     ) -> tuple[_Model, list[torch.Tensor] | None]:
        """The bucket's model, and the parameters it held at its last call where
        they differ from now (None where they are the same or it is new)."""
        index, params = bucket.index(), bucket.parameters()
        with self._lock:
            if state is not None:
                model = self._states.get(state)
                if model is None:
                    model = self._states[state] = self._new_model()
            elif not params:  # nothing to tell models apart by
                model = self.models[0] if self.models else self._new_model()
            else:
                model = self._owner.get(params[0])
                if model is None or not _same(model.params.get(index, []), params):
                    model = self._default_model(index, params, bucket.is_last())
            previous = model.params.get(index)
            model.params[index] = params
            if params and bucket.is_last():  # fewer buckets after DDP's rebuild
                for stale in [i for i in model.params if i > index]:
                    del model.params[stale]
        return model, None if previous is None or _same(previous, params) else previous

    def _default_model(self, index: int, params: list[torch.Tensor],
                       last: bool) -> _Model:
        """The model of a default-state bucket whose parameters are new at `index`."""
        found = [self._owner.get(p) for p in params]
        owners = {id(m): m for m in found if m is not None}
        if len(owners) == 1 and None not in found:  # all the same model's
            model = next(iter(owners.values()))
        elif owners:
            raise RuntimeError(f"allreduce_hook: DDP bucket {index} holds parameters of "
                               "two models, or of a model and new ones: register each model's "
                               "hook with a HookState of its own (reducer_client.torch.hooks)")
        else:
            waiting = [m for m in self._opening if m.next_index == index]
            if not waiting and index == 0:
                model = self._new_model()
                self._opening.append(model)
            elif len(waiting) == 1:
                model = waiting[0]
            else:
                raise RuntimeError(
                    f"allreduce_hook: cannot tell which DDP model bucket {index} belongs "
                    "to (models' first backward passes interleave on one state): register "
                    "each model's hook with a HookState of its own "
                    "(reducer_client.torch.hooks)")
            for param in params:
                self._owner[param] = model
        if model in self._opening:
            model.next_index = index + 1
            if last:
                self._opening.remove(model)
        return model


# _joinables_lock guards _joinables; taken by autograd threads (the hook).
_joinables: weakref.WeakKeyDictionary[Reducer, _Joinable] = weakref.WeakKeyDictionary()
_joinables_lock = threading.Lock()


def _joinable(reducer: Reducer) -> _Joinable:
    with _joinables_lock:
        joinable = _joinables.get(reducer)
        if joinable is None:
            joinable = _joinables[reducer] = _Joinable(reducer)
        return joinable


# Reducers whose rank trains inside rt.Join() now (join.py), with how many
# Join blocks are open on each; _joining_lock guards it (the training thread
# enters and leaves, autograd threads read it in the hook).
_joining_count: dict[int, int] = {}
_joining_lock = threading.Lock()


def _joining(reducer: Reducer) -> bool:
    return id(reducer) in _joining_count


def joining_block(reducer: Reducer, opened: bool) -> None:
    """A Join block opens (opened) or closes for `reducer` (join.py)."""
    with _joining_lock:
        left = _joining_count.get(id(reducer), 0) + (1 if opened else -1)
        if left:
            _joining_count[id(reducer)] = left
        else:
            _joining_count.pop(id(reducer), None)


def _bucket_key(slot: int, index: int) -> str:
    """Bucket `index` of the model in `slot` (the first model's keys are the
    one-model keys of before)."""
    return f"ddp/bucket/{index}" if slot == 0 else f"ddp/model.{slot}/bucket/{index}"


def _shadow(ref: "weakref.ref[Reducer]", rows: np.ndarray) -> None:
    """A joined rank's part in a bucket the others reduce: zeros under its key."""
    reducer = ref()
    shape = coll.call_shape(rows)
    if reducer is None or not isinstance(shape, tuple) or len(shape) != 3:
        raise RuntimeError(f"join: a DDP bucket call this rank cannot follow ({shape})")
    slot, index, numel = shape
    zeros = np.zeros(numel, np.float32)
    reducer.allreduce_async(zeros, _bucket_key(slot, index), "mean", out=zeros).result()


def hook_parameters(reducer: Reducer) -> list[torch.Tensor]:
    """The parameters allreduce_hook reduced for `reducer`, by model and bucket (join's sync)."""
    with _joinables_lock:
        joinable = _joinables.get(reducer)
    if joinable is None:
        return []
    with joinable._lock:
        return [p for model in joinable.models for index in sorted(model.params)
                for p in model.params[index]]


def _bucket_call(reducer: Reducer, tag: int, slot: int, index: int, numel: int) -> coll.Call:
    wire = getattr(reducer, "wire_dtype", None)
    return coll.Call(coll.STEP, None, "float32", (slot, index, numel), numel, op="mean",
                     wire=wire if wire in dtypes.WIRE_DTYPES else None, tag=tag)


def allreduce_hook(state: HookState | Reducer | None, bucket: _GradBucket,
                   ) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all workers through the daemons; DDP's comm-hook signature.

    `state` is the Reducer to use (rt.client(), or None for the same), or a
    HookState (module doc: several models). The
    bucket travels in the client's wire dtype; the daemons sum in float32
    and divide by the world size before rounding to the wire dtype once
    (so float16 does not overflow on large sums), and the result is
    written back into the bucket in its own dtype. Every rank reduces bucket
    i under the key "ddp/bucket/i" (the first model's), once per backward pass, which is what
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
    if isinstance(state, HookState):
        hook_state, reducer = state, resolve(state.reducer)
    else:
        hook_state, reducer = None, resolve(state)
    staging = staging_for(reducer)
    buffer = bucket.buffer()
    index = bucket.index()
    world = reducer.world_size
    joinable = _joinable(reducer)
    model, before = joinable.bucket_model(hook_state, bucket)
    key = _bucket_key(model.slot, index)
    if before is not None:  # laid out anew (DDP's rebuild): each parameter keeps its residual
        move_residual(staging, key, before, bucket.parameters())
    call = _bucket_call(reducer, joinable.tag, model.slot, index, buffer.numel())
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
        # Only inside Join() (join.py) can a rank join: elsewhere no control
        # round (it cost a bucket a round trip of its own); one rank has nobody.
        control = (coll.control_async(reducer, call) if world > 1 and _joining(reducer)
                   else None)
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
