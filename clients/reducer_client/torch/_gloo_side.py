"""The reducer process group's Gloo side: what the daemons do not carry.

Point-to-point traffic and all_to_all go to Gloo where the device map gave
the group's CPU tensors to Gloo ("cpu:gloo,cuda:reducer": the group makes its
own Gloo backend, reducer_client.torch.backend), and are refused otherwise
with an error that names the Gloo alternative.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GLOO_INSTEAD", "GlooOrRefused", "made_for_cpu"]

GLOO_INSTEAD = ("use a Gloo group for it: dist.new_group(backend=\"gloo\"), or "
                 "init_process_group(\"cpu:gloo,cuda:reducer\") for CPU tensors")


def _refuse(what: str) -> None:
    raise NotImplementedError(f"the reducer backend has no {what}: reducerd's daemons "
                              f"sum and carry no point-to-point traffic; {GLOO_INSTEAD}")


def made_for_cpu(store: dist.Store) -> bool:
    """Whether torch made this backend for CPU tensors (its store's prefix is "cpu/").

    _new_process_group_helper gives each device's backend PrefixStore(f"{device}/",
    group store); a key set through ours shows under "cpu/" in the one below.
    """
    below = getattr(store, "underlying_store", None)
    if below is None:
        return True
    store.set("reducer/device", "1")
    return dist.PrefixStore("cpu/", below).check(["reducer/device"])


class GlooOrRefused(dist.ProcessGroup):
    """What the daemons do not carry (point-to-point, all_to_all): Gloo's where
    the device map gave this group's CPU tensors to Gloo (`_cpu`), else refused."""

    _cpu: Any = None

    def _gloo(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The Gloo backend for CPU tensors where the device map gave CPU to Gloo."""
        if self._cpu is not None and all(t.device.type == "cpu" for t in tensors):
            return self._cpu
        return None

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.send(tensors, dst, tag)
        _refuse("send")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.recv(tensors, src, tag)
        _refuse("recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        gloo = self._gloo(tensors)
        if gloo is not None:
            return gloo.recv_anysource(tensors, tag)
        _refuse("recv from any source")

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        gloo = self._gloo([*outputs, *inputs])
        if gloo is not None:
            return gloo.alltoall(outputs, inputs, opts)
        _refuse("all_to_all")

    def alltoall_base(self, output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> dist.Work:
        gloo = self._gloo([output, tensor])
        if gloo is not None:
            return gloo.alltoall_base(output, tensor, output_split_sizes, input_split_sizes,
                                      opts)
        _refuse("all_to_all_single")

    all_to_all_single = alltoall_base
