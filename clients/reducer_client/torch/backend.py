"""torch.distributed's "reducer" backend: init_process_group over the daemons.

    import reducer_client.torch                 # registers "reducer" (so does this module)
    dist.init_process_group("reducer")          # under torchrun, REDUCER_ADDRESSES set
    dist.init_process_group("reducer", pg_options=ReducerOptions(wire_dtype="bfloat16"))
    dist.init_process_group("cpu:gloo,cuda:reducer")   # CPU tensors to Gloo

Importing reducer_client.torch (or this module alone) registers the backend
with torch.distributed.Backend.register_backend, for CPU and CUDA tensors.
The process group is a Python ProcessGroup over the shim's own collectives
(collectives.py, broadcasts.py), which are checked across ranks first (a
shape, dtype, op or root that differs fails every rank at once, naming the
ranks), except all_reduce of one floating-point CPU tensor (DDP's buckets):
that goes straight to the daemons under the group's next call key
(_group_parts.call_key; torch's rule that ranks call in the same order pairs
them), whose chunks check length, wire dtype and op; ReducerOptions
(check_calls=True) or TORCH_DISTRIBUTED_DEBUG=DETAIL checks it too.
async_op=True gives a Work whose wait(), is_completed() and get_future()
behave as Gloo's. docs/howto/torch-distributed.md has what each collective
does: all_reduce SUM and AVG on the group's wire dtype (error feedback on the
8-bit wires: _group_feedback.py), exact for integers and bool; broadcast, the
gathers and scatter exact; reduce_scatter and reduce as a whole allreduce;
MIN, MAX, PRODUCT, the bitwise ops, PREMUL_SUM, send, recv, all_to_all refused.

The client: the default group's is the process-wide one of
reducer_client.torch.init() (built from the environment, env.py, with
torch's rank and world size, so rt.allreduce and the hook share it); a client
already set with the same rank and world size is used as it is. The timeout
given to init_process_group becomes the client's timeout for each operation;
without one (torch's default), REDUCER_TIMEOUT or 60 s. Other groups
(dist.new_group) use the same client under keys of their own.

The device map: torch 2.13 lets a Python ProcessGroup replace the whole
group, so a backend torch made for another device is dropped. Where
"reducer" is given an accelerator only ("cpu:gloo,cuda:reducer"), this group
makes its own Gloo backend on the same store and sends every CPU tensor there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from reducer_client.api import Reducer
from reducer_client.compression import wire_dtype_of
from reducer_client.horovod import Sum
from reducer_client.torch._basics import basics
from reducer_client.torch._gloo_side import GLOO_INSTEAD, GlooOrRefused, made_for_cpu
from reducer_client.torch._group_feedback import group_feedback
from reducer_client.torch._group_parts import (
    ReducerOptions,
    ReducerWork,
    _AllOf,
    _check_list,
    _default_client,
    _GroupKeys,
    _op_name,
    _split_exact,
    _sum_exactly,
    _timeout_s,
    call_key,
    unchecked_allreduce,
)
from reducer_client.torch.broadcasts import allgather_async, barrier_async, broadcast_async_
from reducer_client.torch.collectives import (
    allreduce_async,
    allreduce_async_,
    grouped_allreduce_async_,
)

__all__ = ["BACKEND_NAME", "ReducerOptions", "ReducerProcessGroup", "ReducerWork", "register"]

BACKEND_NAME = "reducer"


class ReducerProcessGroup(GlooOrRefused):
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
        # The keys of unchecked all_reduce calls: every rank counts its calls alike.
        self._calls = itertools.count()
        self.check_calls = self.options.checks_calls()
        # 8-bit wires: a tensor reduced again carries its last rounding (_group_feedback).
        self.feedback = group_feedback(self.reducer, self.wire, self.options.error_feedback)
        self._cpu: Any = None
        if not made_for_cpu(store):
            self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("reducer/gloo/", store),
                                              rank, world_size, timeout)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # -- routing ---------------------------------------------------------

    def _work(self, handles: Sequence[int], outputs: list[torch.Tensor],
              then: Callable[[list[Any]], None] | None = None) -> ReducerWork:
        return ReducerWork(handles, outputs, self.timeout_s, then)

    # -- collectives ---------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.allreduce(tensors, opts)
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        floats, exact = _split_exact(tensors)
        if exact and op != Sum:
            raise TypeError(f"all_reduce of {exact[0].dtype}: ReduceOp.AVG needs a "
                            "floating-point tensor (integers and bool take ReduceOp.SUM)")
        if len(floats) == 1 and not exact and not self.check_calls \
                and floats[0].device.type == "cpu":
            return self._allreduce_unchecked(tensors[0], floats[0], op)
        handles, staged = [], []
        if len(floats) == 1:
            sent = self.feedback.stage(floats[0]) if self.feedback is not None else floats[0]
            if sent is not floats[0]:  # a host copy with the residual: copied back after
                staged.append((floats[0], sent))
            handles.append(allreduce_async_(sent, op=op, compression=self.wire,
                                            reducer=self.reducer))
        elif floats:
            handles.append(grouped_allreduce_async_(floats, op=op, compression=self.wire,
                                                    reducer=self.reducer))
        gathered = [allgather_async(t.reshape(1, -1), reducer=self.reducer) for t in exact]

        def finish(results: list[Any]) -> None:
            with torch.no_grad():
                for tensor, host in staged:
                    tensor.copy_(host.reshape(tensor.shape))
            _sum_exactly(exact, results[len(handles):])
        return self._work(handles + gathered, list(tensors),
                          finish if exact or staged else None)

    def _allreduce_unchecked(self, tensor: torch.Tensor, values: torch.Tensor,
                             op: str) -> dist.Work:
        """all_reduce of one CPU floating-point tensor with no control round
        (ReducerOptions.check_calls); `values` is `tensor` or its real view."""
        sent = self.feedback.stage(values) if self.feedback is not None else values
        handle = unchecked_allreduce(self.reducer, call_key(next(self._calls)), tensor,
                                     values, sent, op, self.wire)
        return self._work([handle], [tensor])

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
        works = [self.allgather([[rank_outs[i] for rank_outs in output_lists]], [tensor], opts)
                 for i, tensor in enumerate(inputs)]  # output_lists[rank][input]
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
                            f"floating-point tensors here; {GLOO_INSTEAD}")
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
        _check_list(tensors, like, self.size(), what)


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
