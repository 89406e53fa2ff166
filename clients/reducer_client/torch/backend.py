"""torch.distributed's "reducer" backend: init_process_group over the daemons.

    import reducer_client.torch                 # registers "reducer" (so does this module)
    dist.init_process_group("reducer")          # under torchrun, REDUCER_ADDRESSES set
    dist.init_process_group("reducer", pg_options=ReducerOptions(wire_dtype="bfloat16"))
    dist.init_process_group("cpu:gloo,cuda:reducer")   # CPU tensors to Gloo

Importing reducer_client.torch (or this module alone) registers the backend
with torch.distributed.Backend.register_backend, for CPU and CUDA tensors.
The process group is a Python ProcessGroup over the shim's own collectives
(collectives.py, broadcasts.py): every call is checked across ranks first,
so a shape, dtype, op or root that differs fails every rank at once with a
message naming the ranks; async_op=True gives a Work whose wait(),
is_completed() and get_future() behave as Gloo's.

What each collective does:
- all_reduce: SUM and AVG of floating-point tensors through the daemons, on
  the group's wire dtype (ReducerOptions.wire_dtype, else the client's:
  REDUCER_WIRE_DTYPE, float16 by default; float32 for exact float32 sums).
  SUM of integer and bool tensors is exact (gathered, then added here).
  MIN, MAX, PRODUCT, BAND, BOR, BXOR and PREMUL_SUM are refused
  (UnsupportedOpError, naming the op): the daemons only sum.
- broadcast, all_gather, all_gather_into_tensor, gather, scatter: exact for
  every dtype. Through summing daemons a gather costs world_size times a
  ring's bytes, and so does scatter (the root's whole input is broadcast).
- reduce_scatter, reduce_scatter_tensor, reduce: the full input allreduced,
  each rank keeping its part (world_size times a ring's bytes).
- barrier; the object collectives (all_gather_object, broadcast_object_list,
  gather_object, scatter_object_list) through the above.
- send, recv, all_to_all: refused (the daemons carry no point-to-point
  traffic): use a Gloo group, dist.new_group(backend="gloo").

The client: the default group's is the process-wide one of
reducer_client.torch.init() (it builds one from the environment, env.py:
REDUCER_ADDRESSES, REDUCER_JOB, REDUCER_TOKEN, REDUCER_WIRE_DTYPE, ...,
with torch's rank and world size, so rt.allreduce and the hook share it);
a client already set with the same rank and world size is used as it is.
The timeout given to init_process_group becomes the client's timeout for
each operation; without one (torch's default), REDUCER_TIMEOUT or 60 s.
Other groups (dist.new_group) use the same client under keys of their own.

The device map: torch 2.13 lets a Python ProcessGroup replace the whole
group (distributed_c10d._new_process_group_helper), so a backend that
torch made for another device is dropped. Where "reducer" is given an
accelerator only ("cpu:gloo,cuda:reducer", "cuda:reducer"), this group
makes its own Gloo backend on the same store and sends every CPU tensor
there, so CPU collectives (MIN and MAX, send and recv too) run on Gloo and
accelerator tensors through the daemons.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from reducer_wire import dtypes
from torch.distributed.constants import default_pg_timeout

from reducer_client.api import Reducer
from reducer_client.compression import wire_dtype_of
from reducer_client.horovod import Average, Sum, UnsupportedOpError
from reducer_client.torch._basics import basics
from reducer_client.torch.broadcasts import allgather_async, barrier_async, broadcast_async_
from reducer_client.torch.collectives import (
    allreduce_async,
    allreduce_async_,
    future_of,
    grouped_allreduce_async_,
    synchronize,
)

__all__ = ["BACKEND_NAME", "ReducerOptions", "ReducerProcessGroup", "ReducerWork", "register"]

BACKEND_NAME = "reducer"


@dataclass(frozen=True)
class ReducerOptions:
    """pg_options of a "reducer" process group (init_process_group / new_group).

    wire_dtype: what all_reduce values travel as in this group: "float16",
    "bfloat16", "float32", "int8", "fp8_e4m3" or "fp8_e5m2"; None keeps the
    client's (REDUCER_WIRE_DTYPE, float16 by default).
    """

    wire_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.wire_dtype is not None and self.wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"ReducerOptions(wire_dtype={self.wire_dtype!r}): one of "
                             f"{', '.join(dtypes.WIRE_DTYPES)}")


_OPS = {dist.ReduceOp.SUM: Sum, dist.ReduceOp.AVG: Average}
_REFUSED_OPS = ("MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_GLOO_INSTEAD = ("use a Gloo group for it: dist.new_group(backend=\"gloo\"), or "
                 "init_process_group(\"cpu:gloo,cuda:reducer\") for CPU tensors")
# How much longer than the client's timeout Work.wait() waits before it raises
# itself: the client fails every operation within its timeout (a control round
# and a data round, one after the other for a gather), this only catches a bug.
_WAIT_ROUNDS, _WAIT_SLACK_S = 3, 10.0


def _op_name(op: Any) -> str:
    """"sum" or "mean" for torch's ReduceOp; UnsupportedOpError for the others."""
    op = getattr(op, "op", op)  # a ReduceOp instance or its RedOpType
    for known, name in _OPS.items():
        if op == known:
            return name
    refused = next((n for n in _REFUSED_OPS if op == getattr(dist.ReduceOp, n, None)), str(op))
    raise UnsupportedOpError(
        f"the reducer backend cannot do ReduceOp.{refused}: reducerd's daemons only sum, so "
        f"all_reduce takes ReduceOp.SUM and ReduceOp.AVG; {_GLOO_INSTEAD}")


class ReducerWork(dist.Work):
    """The Work of one collective: done once all of its operations are.

    `handles` are the shim's (synchronize(handle) finishes each one, writing
    into the tensors); `then(results)` runs after them, on the thread that
    settles the last one, and returns the output tensors. get_future()'s
    value is that list; a failure fails it (as Gloo's), and wait() raises it.
    """

    def __init__(self, handles: Sequence[int], outputs: list[torch.Tensor],
                 timeout_s: float, then: Callable[[list[Any]], None] | None = None) -> None:
        super().__init__()
        self._outputs, self._then = outputs, then
        self._wait_s = _WAIT_ROUNDS * timeout_s + _WAIT_SLACK_S
        self._done = threading.Event()
        self._error: BaseException | None = None
        settled = torch.futures.Future()
        # A torch Future holding a Python exception as its value cannot be read
        # from C++ (DDP waits on it there); an exception raised in then() fails
        # the C++ future instead (hooks.py does the same).
        self._future = settled.then(self._value_or_raise)
        self._settled = settled
        # _lock guards _pending; taken by the core's threads settling operations.
        self._lock = threading.Lock()
        self._pending = len(handles)
        self._handles = list(handles)
        if not handles:
            self._finish()
        for handle in handles:
            future_of(handle).add_done_callback(self._one_done)

    def _one_done(self, _: Future) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        results: list[Any] = []
        for handle in self._handles:
            try:
                results.append(synchronize(handle))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                if self._error is None:
                    self._error = exc
        if self._error is None and self._then is not None:
            try:
                self._then(results)
            except BaseException as exc:  # noqa: BLE001
                self._error = exc
        self._done.set()
        self._settled.set_result(self._outputs)

    def _value_or_raise(self, done: torch.futures.Future) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return done.value()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done (timeout: at most that long; 0, torch's default: the
        client's timeout bounds it); raise the operation's error."""
        limit = timeout.total_seconds() if timeout and timeout.total_seconds() > 0 \
            else self._wait_s
        if not self._done.wait(limit):
            raise RuntimeError(f"reducer backend: the operation did not finish within "
                               f"{limit:.0f} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs


class _GroupKeys:
    """A Reducer whose keys are `inner`'s under `prefix`, with the group's rank and
    size: a dist.new_group's, so that its rounds never pair with another group's."""

    def __init__(self, inner: Reducer, prefix: str, rank: int, world_size: int) -> None:
        self.inner, self.prefix = inner, prefix
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_size = 0, 1
        self.timeout, self.wire_dtype = inner.timeout, inner.wire_dtype

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum",
                        **kwargs: Any) -> Future[np.ndarray]:
        return self.inner.allreduce_async(array, self.prefix + key, op, **kwargs)

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum",
                  **kwargs: Any) -> np.ndarray:
        return self.allreduce_async(array, key, op, **kwargs).result()

    def broadcast_async(self, array: np.ndarray, key: str,
                        root_rank: int = 0) -> Future[np.ndarray]:
        return self.inner.broadcast_async(array, self.prefix + key, root_rank)

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        return self.broadcast_async(array, key, root_rank).result()

    def close(self) -> None:
        """The process-wide client is closed with the default group, not here."""


def _default_client(rank: int, world_size: int, timeout_s: float | None) -> tuple[Reducer, bool]:
    """The process-wide client for the default group, and whether it was made here.

    A client already set with this rank and world size is used as it is (its
    own timeout and wire dtype); otherwise one is made from the environment
    with torch's rank, world size and timeout, and set process-wide.
    """
    if basics.is_initialized():
        client = basics.client()
        if (client.rank, client.world_size) == (rank, world_size):
            return client, False
    from reducer_client.client import ReducerClient  # grpc only when a group is made

    # torch's rank and size win over the launcher's variables (a file:// or
    # tcp:// init gives them as arguments).
    environ = {**os.environ, "REDUCER_RANK": str(rank), "REDUCER_WORLD_SIZE": str(world_size)}
    overrides = {} if timeout_s is None else {"timeout": timeout_s}
    return basics.init(ReducerClient.from_env(environ, **overrides)), True


def _made_for_cpu(store: dist.Store) -> bool:
    """Whether torch made this backend for CPU tensors (its store's prefix is "cpu/").

    _new_process_group_helper gives each device's backend PrefixStore(f"{device}/",
    group store); a key set through ours shows under "cpu/" in the one below.
    """
    below = getattr(store, "underlying_store", None)
    if below is None:
        return True
    store.set("reducer/device", "1")
    return dist.PrefixStore("cpu/", below).check(["reducer/device"])


def _timeout_s(timeout: timedelta | None) -> float | None:
    """The op timeout torch gives, None where it is torch's default (not chosen)."""
    if timeout is None or timeout == default_pg_timeout or timeout.total_seconds() <= 0:
        return None
    return timeout.total_seconds()


class ReducerProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives go through reducerd.

    Made by torch (init_process_group / new_group with backend "reducer"):
    `store`, `rank`, `world_size` and `timeout` are torch's; `options` the
    ReducerOptions given as pg_options; `group_name` torch's name for it;
    `global_ranks` empty for the default group. Module doc: what each
    collective does.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                 options: ReducerOptions | None = None, group_name: str = "",
                 global_ranks: Sequence[int] = ()) -> None:
        super().__init__(rank, world_size)
        if options is not None and not isinstance(options, ReducerOptions):
            raise TypeError(f"pg_options of a reducer group: a ReducerOptions, got "
                            f"{type(options).__name__}")
        self.options = options or ReducerOptions()
        self.wire = wire_dtype_of(self.options.wire_dtype)
        timeout_s = _timeout_s(timeout)
        default = not global_ranks
        client, self._owns_client = _default_client(
            rank if default else dist.get_rank(), world_size if default
            else dist.get_world_size(), timeout_s)
        self.reducer: Reducer = client if default else _GroupKeys(
            client, f"pg/{group_name}/", rank, world_size)
        self.timeout_s = self.reducer.timeout
        self._cpu: Any = None
        if not _made_for_cpu(store):
            self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("reducer/gloo/", store),
                                              rank, world_size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # -- routing ---------------------------------------------------------

    def _gloo(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The Gloo backend for CPU tensors where the device map gave CPU to Gloo."""
        if self._cpu is not None and all(t.device.type == "cpu" for t in tensors):
            return self._cpu
        return None

    def _work(self, handles: Sequence[int], outputs: list[torch.Tensor],
              then: Callable[[list[Any]], None] | None = None) -> ReducerWork:
        return ReducerWork(handles, outputs, self.timeout_s, then)

    # -- collectives ---------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.allreduce(tensors, opts)
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        floats = [t for t in tensors if t.is_floating_point()]
        exact = [t for t in tensors if not t.is_floating_point()]
        handles = []
        if len(floats) == 1:
            handles.append(allreduce_async_(floats[0], op=op, compression=self.wire,
                                            reducer=self.reducer))
        elif floats:
            handles.append(grouped_allreduce_async_(floats, op=op, compression=self.wire,
                                                    reducer=self.reducer))
        if exact and op != Sum:
            raise TypeError(f"all_reduce of {exact[0].dtype}: ReduceOp.AVG needs a "
                            "floating-point tensor (integers and bool take ReduceOp.SUM)")
        gathered = [allgather_async(t.reshape(1, -1), reducer=self.reducer) for t in exact]

        def add_exactly(results: list[Any]) -> None:
            # Integers and bool: every rank's values gathered, summed here in
            # int64 (bool: any), as Gloo sums them.
            with torch.no_grad():
                for tensor, rows in zip(exact, results[len(handles):], strict=True):
                    total = (rows.any(0) if tensor.dtype == torch.bool
                             else rows.to(torch.int64).sum(0))
                    tensor.copy_(total.reshape(tensor.shape).to(tensor.dtype))
        return self._work(handles + gathered, list(tensors), add_exactly if exact else None)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.reduce(tensors, opts)
        op = _op_name(opts.reduceOp)
        [tensor] = tensors
        if not tensor.is_floating_point():
            return self.allreduce(tensors, opts)  # exact; the other ranks' inputs change too
        handle = allreduce_async(tensor, op=op, compression=self.wire, reducer=self.reducer)
        root = opts.rootRank

        def keep_on_root(results: list[Any]) -> None:
            if self.reducer.rank == root:
                with torch.no_grad():
                    tensor.copy_(results[0])
        return self._work([handle], tensors, keep_on_root)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.broadcast(tensors, opts)
        handles = [broadcast_async_(t, opts.rootRank, reducer=self.reducer) for t in tensors]
        return self._work(handles, list(tensors))

    def _gather_rows(self, tensor: torch.Tensor) -> int:
        """Start an allgather of `tensor` as one row per rank."""
        return allgather_async(tensor.reshape(1, -1), reducer=self.reducer)

    def allgather(self, output_lists: list[list[torch.Tensor]],
                  inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        gloo = self._gloo(inputs)
        if gloo is not None:
            return gloo.allgather(output_lists, inputs, opts)
        [outputs], [tensor] = output_lists, inputs
        self._check_list(outputs, tensor, "all_gather's output list")

        def place(results: list[Any]) -> None:
            with torch.no_grad():
                for out, row in zip(outputs, results[0], strict=True):
                    out.copy_(row.reshape(out.shape))
        return self._work([self._gather_rows(tensor)], outputs, place)

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor,
                        opts: Any = None) -> dist.Work:
        gloo = self._gloo([output, tensor])
        if gloo is not None:
            return gloo._allgather_base(output, tensor, opts)
        if output.numel() != tensor.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: the output has {output.numel()} "
                             f"elements, world_size x input is {tensor.numel() * self.size()}")

        def place(results: list[Any]) -> None:
            with torch.no_grad():
                output.copy_(results[0].reshape(output.shape))
        return self._work([self._gather_rows(tensor)], [output], place)

    # all_gather_into_tensor's names: torch 2.13's Python API, its C++ callers'.
    all_gather_single = _allgather_base

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _AllOf(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        works = [self.allgather([outs], [tensor], opts)
                 for outs, tensor in zip(output_lists, inputs, strict=True)]
        return _AllOf(works, [t for outs in output_lists for t in outs])

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any) -> dist.Work:
        gloo = self._gloo(inputs)
        if gloo is not None:
            return gloo.gather(output_lists, inputs, opts)
        [tensor], root = inputs, opts.rootRank
        outputs = output_lists[0] if self.reducer.rank == root else []
        if outputs:
            self._check_list(outputs, tensor, "gather's gather_list")

        def place(results: list[Any]) -> None:
            with torch.no_grad():
                for out, row in zip(outputs, results[0], strict=False):
                    out.copy_(row.reshape(out.shape))
        return self._work([self._gather_rows(tensor)], outputs, place)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any) -> dist.Work:
        gloo = self._gloo(outputs)
        if gloo is not None:
            return gloo.scatter(outputs, input_lists, opts)
        [output], root, world = outputs, opts.rootRank, self.size()
        if self.reducer.rank == root:
            [inputs] = input_lists
            self._check_list(inputs, output, "scatter's scatter_list")
            whole = torch.cat([t.detach().reshape(-1) for t in inputs])
        else:
            whole = torch.empty(world * output.numel(), dtype=output.dtype, device=output.device)
        handle = broadcast_async_(whole, root, reducer=self.reducer)
        rank = self.reducer.rank

        def keep_own(results: list[Any]) -> None:
            with torch.no_grad():
                output.copy_(whole.view(world, -1)[rank].reshape(output.shape))
        return self._work([handle], outputs, keep_own)

    def reduce_scatter(self, outputs: list[torch.Tensor],
                       input_lists: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        gloo = self._gloo(outputs)
        if gloo is not None:
            return gloo.reduce_scatter(outputs, input_lists, opts)
        [output], [inputs] = outputs, input_lists
        self._check_list(inputs, output, "reduce_scatter's input list")
        return self._reduce_then_keep(torch.cat([t.detach().reshape(-1) for t in inputs]),
                                      output, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, tensor: torch.Tensor,
                             opts: Any) -> dist.Work:
        gloo = self._gloo([output, tensor])
        if gloo is not None:
            return gloo._reduce_scatter_base(output, tensor, opts)
        if tensor.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor: the input has {tensor.numel()} "
                             f"elements, world_size x output is {output.numel() * self.size()}")
        return self._reduce_then_keep(tensor.detach().reshape(-1).clone(), output, opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        works = [self._reduce_scatter_base(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return _AllOf(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_then_keep(self, whole: torch.Tensor, output: torch.Tensor,
                          opts: Any) -> dist.Work:
        """Allreduce `whole` (this rank's flat input, a tensor of its own) and keep
        this rank's part in `output`."""
        op = _op_name(opts.reduceOp)
        if not whole.is_floating_point():
            raise TypeError(f"reduce_scatter of {whole.dtype}: the reducer backend reduces "
                            f"floating-point tensors here; {_GLOO_INSTEAD}")
        handle = allreduce_async_(whole, op=op, compression=self.wire, reducer=self.reducer)
        rank, world = self.reducer.rank, self.size()

        def keep_own(results: list[Any]) -> None:
            with torch.no_grad():
                output.copy_(whole.view(world, -1)[rank].reshape(output.shape))
        return self._work([handle], [output], keep_own)

    def barrier(self, opts: Any = None) -> dist.Work:
        if self._cpu is not None:  # the device map gave Gloo the CPU: a CPU program's barrier
            return self._cpu.barrier(opts) if opts is not None else self._cpu.barrier()
        return self._work([barrier_async(reducer=self.reducer)], [])

    # -- refused ---------------------------------------------------------------

    def _refuse(self, what: str) -> None:
        raise NotImplementedError(f"the reducer backend has no {what}: reducerd's daemons "
                                  f"sum and carry no point-to-point traffic; {_GLOO_INSTEAD}")

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.send(tensors, dst, tag)
        self._refuse("send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.recv(tensors, src, tag)
        self._refuse("recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.recv_anysource(tensors, tag)
        self._refuse("recv from any source")

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        gloo = self._gloo([*outputs, *inputs])
        if gloo is not None:
            return gloo.alltoall(outputs, inputs, opts)
        self._refuse("all_to_all")

    def alltoall_base(self, output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> dist.Work:
        gloo = self._gloo([output, tensor])
        if gloo is not None:
            return gloo.alltoall_base(output, tensor, output_split_sizes, input_split_sizes,
                                      opts)
        self._refuse("all_to_all_single")

    all_to_all_single = alltoall_base

    # -- lifetime --------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the process-wide client where this group made it (destroy_process_group)."""
        if self._owns_client and basics.is_initialized() and basics.client() is self.reducer:
            basics.shutdown()
        self._owns_client = False

    def abort(self) -> None:
        self.shutdown()

    def _check_list(self, tensors: Sequence[torch.Tensor], like: torch.Tensor,
                    what: str) -> None:
        if len(tensors) != self.size():
            raise ValueError(f"{what} has {len(tensors)} tensors, the group has "
                             f"{self.size()} ranks")
        for t in tensors:
            if t.numel() != like.numel():
                raise ValueError(f"{what}: a tensor of {t.numel()} elements where this "
                                 f"rank's has {like.numel()}")


class _AllOf(dist.Work):
    """Done when every Work of `works` is (the coalesced forms)."""

    def __init__(self, works: list[dist.Work], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._outputs = works, outputs
        # value() of each re-raises its failure: the collected future fails then.
        self._future = torch.futures.collect_all([w.get_future() for w in works]).then(
            lambda done: [f.value() for f in done.value()] and outputs)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs


def _create(backend_options: Any, pg_options: Any) -> ReducerProcessGroup:
    """torch's creator (extended_api): its DistributedBackendOptions and pg_options."""
    return ReducerProcessGroup(backend_options.store, backend_options.group_rank,
                               backend_options.group_size, backend_options.timeout,
                               pg_options, str(backend_options.group_id),
                               list(backend_options.global_ranks_in_group))


def register() -> None:
    """Register "reducer" with torch.distributed (done on import; again is a no-op)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=["cpu", "cuda"])


register()
